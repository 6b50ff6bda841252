"""Conversation records -> token ids and assistant-only loss masks, derived from the chat template.

Readers accept the JSONL layouts drafter corpora come in (ShareGPT, OpenAI messages, plain
prompts, MT-bench turns, GPTeacher/Alpaca instructions, GSM8K) and yield (id, messages).

The loss mask marks the tokens the target itself wrote: every assistant turn, including the
template's end-of-turn marker (the drafter must learn to predict it too). Where those tokens lie
is derived from the template itself, never from hard-coded separators: the assistant turn i spans
the characters between the rendering of messages[:i] with the generation prompt and the rendering
of messages[:i+1]. A template for which that derivation is unsound raises LossMaskError naming
the problem, because a silently wrong mask trains a drafter that cannot be accepted.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names; chatgpt/bing/bard occur in ShareGPT_V3 as assistant turns.
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
}
ID_KEYS = ("id", "question_id", "task_id")


# ---- readers ------------------------------------------------------------------------------------
def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line number, parsed value) of every non-blank line of a .jsonl or
    .jsonl.gz file; a malformed line or gzip stream raises ValueError naming file and line."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
                yield lineno, value
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{path}: corrupt or truncated gzip stream after line {lineno}: {e}") from None


def read_records(path: str | Path) -> Iterator[tuple[str, list[Message]]]:
    """Yield (record id, messages) from a .jsonl or .jsonl.gz file.

    The id is the record's `id`, `question_id` or `task_id` (as a string), else its 1-based line
    number. Blank lines are skipped; a malformed line raises ValueError naming file and line.
    """
    for lineno, record in iter_jsonl(path):
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        try:
            messages = record_messages(record)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
        yield record_id(record, lineno), messages


def record_id(record: dict[str, Any], lineno: int) -> str:
    for key in ID_KEYS:
        if record.get(key) is not None:
            return str(record[key])
    return str(lineno)


def record_messages(record: dict[str, Any]) -> list[Message]:
    """The conversation of one record, whatever its layout (ValueError if none is recognised)."""
    if "conversations" in record:
        return [_sharegpt_turn(t, k) for k, t in enumerate(_list(record, "conversations"))]
    if "messages" in record:
        return [_openai_message(m, k) for k, m in enumerate(_list(record, "messages"))]
    if "turns" in record:  # MT-bench / alpaca80: user turns only
        return [{"role": "user", "content": _str(t, f"turns[{k}]")} for k, t in enumerate(_list(record, "turns"))]
    if "instruction" in record:  # GPTeacher {instruction, input, response}, Alpaca {..., output}
        prompt = _str(record["instruction"], "instruction")
        extra = _str(record.get("input") or "", "input")
        prompt = f"{prompt}\n\n{extra}" if extra.strip() else prompt
        answer_key = "response" if "response" in record else "output" if "output" in record else None
        return _pair(prompt, record, answer_key)
    if "question" in record:  # GSM8K {question, answer}
        return _pair(_str(record["question"], "question"), record, "answer" if "answer" in record else None)
    if "prompt" in record:
        return [{"role": "user", "content": _str(record["prompt"], "prompt")}]
    raise ValueError(
        f"unrecognised record with keys {sorted(record)}: expected conversations (ShareGPT), messages "
        "(OpenAI), turns, instruction/input/response (GPTeacher), question/answer (GSM8K) or prompt"
    )


def _pair(prompt: str, record: dict[str, Any], answer_key: str | None) -> list[Message]:
    messages = [{"role": "user", "content": prompt}]
    if answer_key is not None:
        messages.append({"role": "assistant", "content": _str(record[answer_key], answer_key)})
    return messages


def _sharegpt_turn(turn: Any, k: int) -> Message:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise ValueError(f"conversations[{k}] must be an object with 'from' and 'value'")
    role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
    if role is None:
        raise ValueError(f"conversations[{k}]: unknown speaker {turn['from']!r} (expected one of {sorted(SHAREGPT_ROLES)})")
    return {"role": role, "content": _str(turn["value"], f"conversations[{k}].value")}


def _openai_message(message: Any, k: int) -> Message:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{k}] must be an object with 'role' and 'content'")
    if message["role"] not in ROLES:
        raise ValueError(f"messages[{k}]: unsupported role {message['role']!r} (expected one of {list(ROLES)})")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {"role": message["role"], "content": _str(content, f"messages[{k}].content")}


def _list(record: dict[str, Any], key: str) -> list:
    if not isinstance(record[key], list):
        raise ValueError(f"'{key}' must be a list, got {type(record[key]).__name__}")
    return record[key]


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


# ---- loss masks ---------------------------------------------------------------------------------
@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token belongs to an assistant turn


class LossMaskError(ValueError):
    """The chat template does not let assistant tokens be located soundly."""


def tokenize_conversation(
    tokenizer, messages: Sequence[Message], max_length: int | None = None
) -> TokenizedConversation:
    """Render `messages` with the tokenizer's chat template and mark the assistant tokens.

    The result is cut to `max_length` tokens; its mask may then be all zeros (the assistant turns
    lay past the cut), which callers skip. Raises LossMaskError when the template cannot be
    used to derive the mask, the mask is empty, or it covers a token of a system/user message.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise LossMaskError("the tokenizer has no chat template (tokenizer_config.json chat_template)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("loss masks need a fast tokenizer (tokenizer.json): offsets are required")
    full, assistant_spans, prompt_spans = template_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = mask_from_spans(offsets, assistant_spans, len(full))
    if not any(mask):
        raise LossMaskError(
            "empty loss mask: no token lies wholly inside an assistant span "
            f"(spans {assistant_spans} of {len(full)} chars); the template or the tokenizer's offsets "
            "merge assistant text with its surroundings"
        )
    covered = tokens_overlapping(offsets, mask, prompt_spans, len(full))
    if covered:
        t = covered[0]
        raise LossMaskError(
            f"the loss mask covers the prompt: {len(covered)} masked tokens overlap a system/user "
            f"message, first token {t} ({full[offsets[t][0]:offsets[t][1]]!r}); the chat template's "
            "generation prompt does not end where the prompt's rendering ends"
        )
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedConversation(ids, mask)


def _check_messages(messages: Sequence[Message]) -> None:
    for k, m in enumerate(messages):
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{k}] must have a role in {list(ROLES)} and string content, got {m!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise LossMaskError("empty loss mask: the conversation has no assistant message")
    if messages[0]["role"] == "assistant":
        raise LossMaskError("assistant message 0 opens the conversation: there is no prompt to render its "
                            "generation prompt from (drop leading assistant turns, as tokenize_file does)")


def render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The chat template's rendering as a string (template errors become LossMaskError)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except (TemplateError, ValueError, TypeError) as e:
        raise LossMaskError(
            f"the chat template fails on the first {len(messages)} messages "
            f"(add_generation_prompt={add_generation_prompt}): {e}"
        ) from e


def template_spans(
    tokenizer, messages: Sequence[Message]
) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """(full rendering, assistant char spans, system/user message char spans).

    Message k's rendering is the text between the renderings of messages[:k] and
    messages[:k+1]; assistant turn i is the text after messages[:i]'s generation prompt. Both
    need every partial rendering to be a prefix of the full one (checked).
    """
    n = len(messages)
    full = render(tokenizer, messages, False)
    ends = [0]  # ends[k] = length of the rendering of messages[:k]
    for k in range(1, n):
        part = render(tokenizer, messages[:k], False)
        _require_prefix(part, full, f"the rendering of the first {k} of {n} messages is not a prefix of "
                                    "the whole conversation's (the template re-renders earlier turns)")
        ends.append(len(part))
    ends.append(len(full))
    assistant, prompt = [], []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            prompt.append((ends[i], ends[i + 1]))
            continue
        with_prompt = render(tokenizer, messages[:i], True)
        turn = full[: ends[i + 1]]
        _require_prefix(with_prompt, turn, f"messages[:{i}] rendered with add_generation_prompt=True is not "
                                           f"a prefix of messages[:{i + 1}] rendered without it")
        span = (len(with_prompt), ends[i + 1])
        content = m["content"].strip()
        if content and content not in full[span[0] : span[1]]:
            raise LossMaskError(
                f"the chat template drops or rewrites assistant message {i}: its content is not in the "
                f"text after the generation prompt ({full[span[0]:span[1]][:80]!r})"
            )
        assistant.append(span)
    return full, assistant, prompt


def _require_prefix(prefix: str, text: str, problem: str) -> None:
    if text.startswith(prefix):
        return
    d = next((j for j, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b), min(len(prefix), len(text)))
    raise LossMaskError(
        f"{problem}: they differ at char {d}: {prefix[max(0, d - 20):d + 30]!r} vs {text[max(0, d - 20):d + 30]!r}"
    )


def _char_flags(spans: Sequence[tuple[int, int]], length: int) -> bytearray:
    flags = bytearray(length)
    for a, b in spans:
        flags[a:b] = b"\x01" * (b - a)
    return flags


def mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], length: int) -> list[int]:
    """1 for tokens whose (non-empty) char span lies wholly inside one of `spans`."""
    inside = _char_flags(spans, length)
    return [int(e > s and inside.find(0, s, e) == -1) for s, e in offsets]


def tokens_overlapping(
    offsets: Sequence[tuple[int, int]], mask: Sequence[int], spans: Sequence[tuple[int, int]], length: int
) -> list[int]:
    """Indices of masked tokens that share a character with `spans`."""
    flags = _char_flags(spans, length)
    return [t for t, ((s, e), m) in enumerate(zip(offsets, mask, strict=True)) if m and flags.find(1, s, e) != -1]


def drop_leading_assistant(messages: list[Message]) -> list[Message]:
    """messages without the assistant turns that come before the first user turn."""
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [m for k, m in enumerate(messages) if k >= first_user or m["role"] != "assistant"]


# ---- files --------------------------------------------------------------------------------------
def tokenize_file(
    tokenizer, path: str | Path, max_length: int | None = None, num_samples: int | None = None
) -> list[TokenizedConversation]:
    """Tokenize every record of `path` (the first `num_samples` usable ones when given).

    Assistant turns that open a conversation are dropped (ShareGPT chunks often start mid-dialogue:
    there is no prompt they answer). Skips, and counts in a warning, records without an assistant
    turn and records whose assistant tokens all lie past `max_length`; every other problem raises,
    naming the record.
    """
    out: list[TokenizedConversation] = []
    no_answer = truncated = 0
    for rid, messages in read_records(path):
        if num_samples is not None and len(out) >= num_samples:
            break
        messages = drop_leading_assistant(messages)
        if not any(m["role"] == "assistant" for m in messages):
            no_answer += 1
            continue
        try:
            example = tokenize_conversation(tokenizer, messages, max_length)
        except LossMaskError as e:
            raise LossMaskError(f"{path}: record {rid}: {e}") from e
        if not any(example.loss_mask):
            truncated += 1
            continue
        out.append(example)
    if no_answer or truncated:
        logger.warning("%s: skipped %d records without an assistant turn and %d whose assistant tokens all "
                       "lie past max_length=%s", path, no_answer, truncated, max_length)
    if not out:
        raise ValueError(
            f"{path}: no usable record ({no_answer} without an assistant turn, {truncated} truncated away); "
            "prompt-only data needs answers first: draftsman prepare-data"
        )
    return out
