"""Sampling utilities shared by plain decoding and speculative verification.

`warp_probs` turns logits into the distribution a request actually samples from (temperature,
top-k, top-p with Hugging Face transformers' semantics); lossless speculative decoding must
preserve exactly this warped distribution, so the drafter's proposals and the target's
verification both go through it. Every parameter may be a Python scalar (one request) or a
tensor with one value per batch row (a batch that mixes requests), and nothing here reads a
tensor back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Param = float | int | Tensor


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. temperature 0 = greedy, top_p 1.0 and top_k 0 = off.

    `seed` seeds the generator of a single-request run (`make_generator`); a batch is sampled
    with one generator, so per-row seeds are not honoured inside a mixed batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def batch_params(
    params: Sequence[SamplingParams], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (temperature f32, top_k i64, top_p f64) tensors for `warp_probs`.

    top_p stays float64 so that `1 - top_p` is rounded exactly as transformers rounds it.
    """
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    return temperature, top_k, top_p


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator on `device`, or None (global RNG) when seed is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _per_row(value: Tensor, like: Tensor) -> Tensor:
    """Reshape a per-row parameter [B] (or [B, N]) so it broadcasts against `like` [B, ..., V]."""
    if value.dim() >= like.dim():
        raise ValueError(
            f"a per-row parameter of shape {tuple(value.shape)} needs fewer dims than logits "
            f"{tuple(like.shape)}"
        )
    return value.to(like.device).reshape(*value.shape, *([1] * (like.dim() - value.dim())))


def _check_scalar(temperature: Param, top_k: Param, top_p: Param) -> None:
    if not isinstance(temperature, Tensor) and not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(top_k, Tensor) and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not isinstance(top_p, Tensor) and not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (1 = off), got {top_p}")


def warp_probs(
    logits: Tensor, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0
) -> Tensor:
    """Logits [..., V] -> float32 probabilities after temperature, top-k, then top-p.

    Matches transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper ->
    softmax (the order `generate` applies them): top-k keeps every token tied with the k-th
    largest logit; top-p sorts ascending, drops tokens whose cumulative mass is <= 1 - top_p and
    always keeps the top token, i.e. keeps the smallest set whose mass is >= top_p. A row with
    temperature 0 gets a one-hot at the argmax of its raw logits (greedy).
    """
    _check_scalar(temperature, top_k, top_p)
    x = logits.float()
    vocab = x.shape[-1]

    if isinstance(temperature, Tensor):
        t = _per_row(temperature.float(), x)
        greedy = t == 0
        x = x / torch.where(greedy, torch.ones_like(t), t)
    elif temperature == 0:
        return _one_hot_argmax(x)
    else:
        greedy = None
        x = x / temperature

    use_k = isinstance(top_k, Tensor) or top_k > 0
    use_p = isinstance(top_p, Tensor) or top_p < 1.0
    if use_k or use_p:
        # One ascending sort serves both filters; removals are decided in sorted space and
        # scattered back, exactly as TopPLogitsWarper does.
        sorted_x, order = torch.sort(x, dim=-1)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if use_k:
            remove = _top_k_remove(sorted_x, top_k, vocab)
            sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        if use_p:
            remove = remove | _top_p_remove(sorted_x, top_p)
        x = x.masked_fill(remove.scatter(-1, order, remove), float("-inf"))

    probs = torch.softmax(x, dim=-1)
    if greedy is not None:
        probs = torch.where(greedy, _one_hot_argmax(logits.float()), probs)
    return probs


def _top_k_remove(sorted_x: Tensor, top_k: Param, vocab: int) -> Tensor:
    """Mask (in ascending-sorted space) of tokens strictly below the k-th largest logit."""
    if isinstance(top_k, Tensor):
        k = _per_row(top_k.long(), sorted_x)
        index = (vocab - k.clamp(1, vocab)).expand(*sorted_x.shape[:-1], 1)
        kth = sorted_x.gather(-1, index)
        return (sorted_x < kth) & (k > 0)
    kth = sorted_x[..., vocab - min(int(top_k), vocab), None]
    return sorted_x < kth


def _top_p_remove(sorted_x: Tensor, top_p: Param) -> Tensor:
    """Mask (in ascending-sorted space) of the low tail whose cumulative mass is <= 1 - top_p."""
    cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    if isinstance(top_p, Tensor):
        p = _per_row(top_p, sorted_x)
        # transformers compares against float32(1 - top_p computed in double).
        threshold = (1 - p.double()).float()
        remove = (cumulative <= threshold) & (p < 1)
    else:
        remove = cumulative <= 1 - top_p
    remove[..., -1] = False  # min_tokens_to_keep = 1: the top token always survives
    return remove


def greedy_argmax(logits: Tensor, blocks: int = 256) -> Tensor:
    """logits [..., V] -> the first maximal index over V, as torch.argmax (NaN counts as the
    maximum), in two passes when V is large: per block of V / blocks, then over the blocks'
    maxima. A decode step's single row of a 128k vocabulary is one reduction program in one
    pass (30 us of a 4.6 ms compiled 8B step on the H200); in blocks it spreads over `blocks`."""
    v = logits.shape[-1]
    if v < 64 * blocks:
        return logits.argmax(-1)
    size = -(-v // blocks)
    # -inf padding at the end: a tie with it resolves to the earlier, real index.
    x = F.pad(logits, (0, size * blocks - v), value=float("-inf")) if size * blocks != v else logits
    x = x.reshape(*logits.shape[:-1], blocks, size)
    inner = x.argmax(-1)  # [..., blocks]: each block's first maximum
    best = x.gather(-1, inner[..., None]).squeeze(-1)
    block = best.argmax(-1, keepdim=True)  # the first block holding the maximum
    return block.squeeze(-1) * size + inner.gather(-1, block).squeeze(-1)


def _one_hot_argmax(x: Tensor) -> Tensor:
    return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token id per row of probs [..., V] (need not be normalised) -> int64 [...].
    Zero-mass tokens are never drawn; reproducible with a torch.Generator.

    On CUDA: an exponential race, argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d., picks v with
    probability p_v / sum(p) (the Gumbel-max trick in disguise); it never syncs with the host.
    On CPU that is one serial draw per vocabulary entry (5 ms a step for 4 rows of a 49k
    vocabulary, a tenth of SmolLM2's step), so one uniform per row is inverted through the
    cumulative mass instead (`_inverse_cdf`)."""
    if probs.device.type == "cpu":
        return _inverse_cdf(probs, generator)
    return exponential_race(probs, generator)


def exponential_race(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """sample() on CUDA: argmax_v p_v / E_v over one Exp(1) draw per vocabulary entry."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    # Exp(1) draws of exactly 0 would turn 0/0 into NaN (which argmax would pick).
    race.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs.float() / race).argmax(dim=-1)


def _inverse_cdf(probs: Tensor, generator: torch.Generator | None, block: int = 256) -> Tensor:
    """sample() by inverse transform: u ~ U(0, total] per row, the first token whose cumulative
    mass reaches u. Two levels, both summed in float64: the block holding u from the blocks'
    masses, then the token inside it, so rounding moves no token's probability by more than
    ~1e-16 (a float32 running sum over the vocabulary drifts by ~1e-7 per token). Searching for
    the first index reaching u > 0 never lands on a zero-mass token (or block)."""
    v = probs.shape[-1]
    x = probs.reshape(-1, v).float()
    rows, blocks = x.shape[0], -(-v // block)
    if blocks * block != v:
        x = F.pad(x, (0, blocks * block - v))
    x = x.view(rows, blocks, block)
    cdf = x.sum(-1, dtype=torch.float64).cumsum(-1)  # [rows, blocks]
    u = (1 - torch.rand(rows, 1, generator=generator, dtype=torch.float64)) * cdf[:, -1:]
    b = torch.searchsorted(cdf, u).clamp_max(blocks - 1)  # [rows, 1]
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0)), 0.0)
    inner = x[torch.arange(rows), b[:, 0]].double().cumsum(-1)  # [rows, block]
    # (u - before) > 0; capped at the block's own sum, which adds in another order
    r = torch.minimum(u - before, inner[:, -1:])
    j = torch.searchsorted(inner, r).clamp_max(block - 1)
    return (b * block + j).view(probs.shape[:-1])
