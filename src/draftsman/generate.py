"""Plain autoregressive decoding (batch >= 1), and the stopping rules speculative decoding shares."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftsman.models.base import TargetModel
from draftsman.sampling import SamplingParams, sample, warp_probs


@dataclass
class StopRules:
    """When a row is finished: EOS ids, a token budget, stop strings (needs a tokenizer)."""

    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")


@dataclass
class RowState:
    """Tokens generated so far for one request and why it ended."""

    rules: StopRules
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def left(self) -> int:
        """Tokens the budget still allows."""
        return self.rules.max_new_tokens - len(self.tokens)

    def extend(self, new: Sequence[int]) -> int:
        """Append tokens emitted this step, cutting at EOS, the budget or a stop string.
        Returns how many were kept."""
        kept = 0
        for tok in new:
            if self.done:
                break
            self.tokens.append(int(tok))
            kept += 1
            if tok in self.rules.eos_ids or self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.rules.max_new_tokens:
                self.finish_reason = "length"
        return kept

    def _hit_stop_string(self) -> bool:
        if not self.rules.stop_strings:
            return False
        # Decoding a short tail is enough: a stop string ends in the newest tokens.
        tail = self.rules.tokenizer.decode(self.tokens[-32:])
        return any(s in tail for s in self.rules.stop_strings)


@dataclass
class GenerationOutput:
    token_ids: list[list[int]]  # generated ids per row (prompt excluded)
    finish_reasons: list[str]
    time_s: float
    stats: dict = field(default_factory=dict)  # speculation statistics, when speculating

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.time_s if self.time_s > 0 else float("nan")


def pad_prompts(prompts: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad prompts into [B, T]; returns ids and lengths [B]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    return ids, lengths


def next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """logits [B, V] -> token ids [B]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = warp_probs(logits, params.temperature, params.top_k, params.top_p)
    return sample(probs, generator=generator)


def generate_plain(
    model: TargetModel,
    prompts: Sequence[Sequence[int]],
    rules: StopRules,
    params: SamplingParams = SamplingParams(temperature=0.0),
) -> GenerationOutput:
    """Decode every prompt one token per target forward, batched, with a static cache."""
    from draftsman.session import PlainSession, run_to_completion

    longest = max(len(p) for p in prompts)
    session = PlainSession(model, longest + rules.max_new_tokens, seed=params.seed)
    start = time.perf_counter()
    done = run_to_completion(session, prompts, rules, params)
    elapsed = time.perf_counter() - start
    return GenerationOutput([r.state.tokens for r in done], [r.state.finish_reason for r in done], elapsed)
