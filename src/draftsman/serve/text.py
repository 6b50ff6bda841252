"""Token ids -> response text: stop-string truncation and incremental (streaming) detokenization.

The engine stops a row on the token that completes a stop string and keeps that token; OpenAI's
API returns the text *before* the stop string, so both paths cut the decoded text at the earliest
stop string. While streaming, the last `len(longest stop) - 1` characters are held back until
they can no longer turn into a stop string, so a client never sees text that is later withdrawn.
"""

from __future__ import annotations

from collections.abc import Sequence


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Text before the earliest occurrence of any stop string, and whether one occurred."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def final_text(tokenizer, tokens: Sequence[int], stops: Sequence[str]) -> str:
    """The response text of a finished request (empty without a tokenizer)."""
    if tokenizer is None:
        return ""
    return cut_at_stop(tokenizer.decode(list(tokens), skip_special_tokens=True), stops)[0]


class TextStream:
    """Turns a growing list of token ids into text deltas, each final once sent.

    Decodes a short window (TGI/vLLM style): the text of tokens[prefix:] minus the text of
    tokens[prefix:read], so the cost per round does not grow with the output, and a window
    ending in an incomplete UTF-8 sequence (U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # decoded so far (may still hold a stop string's beginning)
        self.sent = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Add a round's tokens; return the text that became final."""
        if self.tokenizer is None or self.stopped:
            return ""
        self.tokens.extend(tokens)
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: flush what was held back (up to a stop string)."""
        if self.tokenizer is None or self.stopped:
            return ""
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        self.text += after[len(before):]
        self.prefix = self.read = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text, hit = cut_at_stop(self.text, self.stops)
        if hit:
            self.stopped = True
            end = len(text)
        else:
            end = len(text) if final else max(self.sent, len(text) - self.hold)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta
