"""Expected acceptance: the drafter scored teacher-forced on answers the target wrote itself, under
the configured conventions and under plausible wrong ones (the probes).

The target answers each prompt greedily; one forward over prompt + answer captures its aux states.
The drafter then runs the training-time-test unroll of train/ttt.py over those states: step k at
index t reads the true token x_{t+k+1} and its own hidden state of step k-1, and predicts
x_{t+k+2}. Because the answer is the target's own greedy output, x_{t+k+2} is exactly the token a
greedy verifier accepts, so a hit is an acceptance.

From the hits, a greedy chain of depth K is replayed round by round as an engine runs it: the
target has committed the prompt, the prefill emitted the first answer token, and each round at
index t = n-1 accepts the leading run of hits of steps 0..K-1 there, emits run+1 tokens and moves
on. That gives τ and p_i = rounds accepting >= i drafts / rounds with SGLang's and vLLM's
definitions, directly comparable to a live measurement on the same prompts (equal, up to float
rounding, for draftsman's own engine). With top-k > 1 the same replay counts a step as accepted
when the true token is among the drafter's top k along the true path: an upper bound for a
dynamic tree (it ignores the competition for the frontier and the verify budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsman.config import RopeConfig
from draftsman.models.layers import Rotary
from draftsman.train.ttt import (
    chain_acceptance,
    predicted_tau,
    shift_left,
    ttt_attention_mask,
    ttt_layer,
)


@dataclass
class Sample:
    """One prompt and the target's greedy answer to it (token ids). `answer` runs `lookahead`
    tokens past what an engine emits (`length` tokens: the budget or the first EOS), because an
    engine's last round verifies drafts past its stopping point too."""

    prompt: list[int]
    answer: list[int]
    length: int = -1  # tokens an engine emits; -1: all of `answer`

    def __post_init__(self) -> None:
        if self.length < 0:
            self.length = len(self.answer)

    @property
    def emitted(self) -> list[int]:
        return self.answer[: self.length]


@dataclass
class Features:
    """Target aux states over target-written sequences, captured once and shared by every probe."""

    input_ids: Tensor  # [B, T] right-padded with 0
    lengths: Tensor  # [B] prompt + answer (lookahead included)
    prompt_lengths: Tensor  # [B]
    answer_lengths: Tensor  # [B] tokens an engine emits (Sample.length)
    states: dict[int, Tensor]  # layer id -> [B, T, H]: the residual stream entering that layer

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True)
class Convention:
    """How the drafter's inputs are produced: which layers, how the last state is taken, how draft
    rows map to target ids, where drafted tokens sit, which RoPE, and which prompts."""

    layer_ids: tuple[int, ...]
    draft_token_ids: Tensor  # [draft_vocab] target id of each draft row (may hold invalid ids)
    post_norm: bool = False  # the last aux state taken after the target's final norm
    draft_position_offset: int = 0  # added to the positions of drafted tokens (steps >= 1)
    rope: RopeConfig | None = None  # None: the drafter's own
    data: str = "chat"  # "chat" | "raw": which Features the drafter reads
    norm_before_fc: bool = False  # an RMSNorm (unit weight) over cat(aux) before fc
    flip_norm_before_residual: bool = False  # the residual taken on the other side of hidden_norm


@dataclass
class Score:
    """Teacher-forced acceptance of one convention."""

    step_accept: list[float]  # a_k: top-1 hit rate of step k over scored positions
    chain: list[float]  # joint rate: steps 0..k all right at the same index
    accept_rate_per_position: list[float]  # p_i of the replayed greedy chain
    accept_length: float  # τ of the replayed chain = 1 + Σ p_i
    rounds: int
    positions: int  # scored positions of step 0
    tree: dict | None = None  # top-k replay (upper bound for a tree), when topk > 1

    @property
    def step0(self) -> float:
        return self.step_accept[0] if self.step_accept else 0.0

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["tau_pred"] = round(predicted_tau(self.step_accept), 6)
        out["tau_chain"] = round(1.0 + sum(self.chain), 6)
        return out


# ---- target side ----------------------------------------------------------------------------------
def pad_samples(samples: Sequence[Sample], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    seqs = [s.prompt + s.answer for s in samples]
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=device)
    prompts = torch.tensor([len(s.prompt) for s in samples], device=device)
    return ids, lengths, prompts


@torch.no_grad()
def capture_features(target, samples: Sequence[Sample], layer_ids: Sequence[int], rows_per_forward: int = 8) -> Features:
    """One teacher-forced target forward per chunk of rows, keeping the states entering `layer_ids`
    (right padding is harmless: attention is causal)."""
    device = target.embed_tokens.weight.device
    ids, lengths, prompts = pad_samples(samples, device)
    wanted = sorted(set(layer_ids))
    parts: dict[int, list[Tensor]] = {i: [] for i in wanted}
    for start in range(0, ids.shape[0], rows_per_forward):
        out = target.run(ids[start : start + rows_per_forward], aux_layer_ids=wanted, compute_logits=False)
        for i, state in zip(wanted, out.aux_hidden, strict=True):
            parts[i].append(state)
    emitted = torch.tensor([s.length for s in samples], device=device)
    return Features(ids, lengths, prompts, emitted, {i: torch.cat(p) for i, p in parts.items()})


def feature_bytes(samples: Sequence[Sample], hidden: int, element_size: int) -> int:
    """Bytes one captured layer takes for these samples (padded to the longest)."""
    longest = max(len(s.prompt) + len(s.answer) for s in samples)
    return len(samples) * longest * hidden * element_size


# ---- drafter side ---------------------------------------------------------------------------------
def scored_tokens(feats: Features, lookahead: bool = False) -> Tensor:
    """[B, T] bool: answer tokens a drafter would have to propose (after the first, which the
    prefill emits), up to what an engine emits, or with `lookahead` every generated one."""
    t = torch.arange(feats.input_ids.shape[1], device=feats.input_ids.device)
    end = feats.lengths if lookahead else feats.prompt_lengths + feats.answer_lengths
    return (t[None] > feats.prompt_lengths[:, None]) & (t[None] < end[:, None])


def aux_inputs(feats: Features, conv: Convention, final_norm: Callable[[Tensor], Tensor], rows: slice,
               eps: float = 1e-6) -> list[Tensor]:
    states = [feats.states[i][rows] for i in conv.layer_ids]
    if conv.post_norm:
        states[-1] = final_norm(states[-1])
    if conv.norm_before_fc:  # RMS over the whole concatenation, as an engine's input_norm does
        x = torch.cat(states, dim=-1).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        states = list(x.to(states[0].dtype).chunk(len(states), dim=-1))
    return states


@contextmanager
def residual_side(drafter, flip: bool) -> Iterator[None]:
    """The drafter layer with its norm_before_residual flipped while scoring (restored after)."""
    layer = drafter.midlayer
    saved = layer.norm_before_residual
    layer.norm_before_residual = saved != flip
    try:
        yield
    finally:
        layer.norm_before_residual = saved


@torch.no_grad()
def unrolled_predictions(drafter, embed: Callable[[Tensor], Tensor], input_ids: Tensor, hidden: Tensor, steps: int,
                         topk: int, rotary: Rotary, draft_position_offset: int = 0) -> list[Tensor]:
    """Top-k draft-vocabulary ids [B, T, topk] of TTT steps 0..steps-1 (ttt.py's unroll, with a
    replaceable rotary and an optional offset on the drafted tokens' positions)."""
    b, t = input_ids.shape
    dtype = drafter.fc.weight.dtype
    base = torch.arange(t, device=input_ids.device).expand(b, t)
    past: list[tuple[Tensor, Tensor]] = []
    out = []
    for k in range(steps):
        embeds = embed(shift_left(input_ids, k + 1)).to(dtype)
        cos, sin = rotary(base + k + (draft_position_offset if k else 0), dtype)
        mask = ttt_attention_mask(t, k, input_ids.device)
        hidden = ttt_layer(drafter.midlayer, embeds, hidden, cos, sin, past, mask)
        out.append(drafter.compute_logits(hidden).topk(topk, dim=-1).indices)
    return out


def drafter_embed(drafter, target) -> Callable[[Tensor], Tensor]:
    """The embedding the drafter reads (its own, or the target's), without needing it bound."""
    return drafter.embed_tokens if drafter.has_own_embedding else target.embed_tokens


@torch.no_grad()
def hits(drafter, target, feats: Features, conv: Convention, steps: int, topk: int = 1,
         rows_per_forward: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """(top-1 hits, top-k hits, scored) each [steps, B, T] bool: step k at index t predicts
    x_{t+k+2}; it is scored when that token is an answer token an engine emits. Hits also cover
    the lookahead tokens (the replay's last rounds read them), so mask them with `scored` for
    per-step rates."""
    ids = feats.input_ids
    scored = scored_tokens(feats)
    known = scored_tokens(feats, lookahead=True)
    truth = torch.stack([shift_left(ids, k + 2, -1) for k in range(steps)])
    masks = torch.stack([shift_left(scored, k + 2, False) for k in range(steps)])
    reach = torch.stack([shift_left(known, k + 2, False) for k in range(steps)])
    rotary = drafter.rotary if conv.rope is None else Rotary(conv.rope, drafter.config.head_dim,
                                                             drafter.config.max_position_embeddings).to(ids.device)
    embed = drafter_embed(drafter, target)
    to_target = conv.draft_token_ids.to(ids.device)
    top1 = torch.zeros_like(masks)
    topn = torch.zeros_like(masks)
    eps = drafter.config.rms_norm_eps
    with residual_side(drafter, conv.flip_norm_before_residual):
        for start in range(0, ids.shape[0], rows_per_forward):
            rows = slice(start, start + rows_per_forward)
            hidden = drafter.project(aux_inputs(feats, conv, target.norm, rows, eps))
            preds = unrolled_predictions(drafter, embed, ids[rows], hidden, steps, topk, rotary,
                                         conv.draft_position_offset)
            for k, p in enumerate(preds):
                cand = to_target[p]  # [b, T, topk] target ids
                want = truth[k, rows][..., None]
                top1[k, rows] = cand[..., 0] == want[..., 0]
                topn[k, rows] = (cand == want).any(-1)
    return top1 & reach, topn & reach, masks


def replay_chain(run: Sequence[int], prompt_len: int, answer_len: int, steps: int) -> list[int]:
    """Accepted drafts per round of a greedy chain over one target-written answer. run[t] = number
    of leading steps right at index t. The prefill emits answer[0]; a round at index n-1 (n =
    committed tokens) accepts min(run, steps) drafts and emits that many + 1."""
    accepted = []
    n, emitted = prompt_len, 1
    while emitted < answer_len:
        a = min(run[n - 1], steps)
        accepted.append(a)
        emitted += a + 1
        n += a + 1
    return accepted


def histogram_rates(rounds: Sequence[int], steps: int) -> tuple[list[float], float]:
    """(p_i for i = 1..steps, τ) from accepted drafts per round."""
    if not rounds:
        return [0.0] * steps, 1.0
    n = len(rounds)
    rates = [sum(a >= i for a in rounds) / n for i in range(1, steps + 1)]
    return rates, 1.0 + sum(rates)


def replay(hit: Tensor, feats: Features, steps: int) -> list[int]:
    """Replay every row's chain; accepted drafts of every round, all rows together."""
    run = hit.long().cumprod(0).sum(0).tolist()  # [B][T] leading hits
    out: list[int] = []
    for b, row in enumerate(run):
        out += replay_chain(row, int(feats.prompt_lengths[b]), int(feats.answer_lengths[b]), steps)
    return out


def score(drafter, target, feats: Features, conv: Convention, steps: int, topk: int = 1) -> Score:
    top1, topn, masks = hits(drafter, target, feats, conv, steps, topk)
    counts = masks.flatten(1).sum(1).clamp(min=1)
    step_accept = ((top1 & masks).flatten(1).sum(1) / counts).tolist()
    joint_hit, joint_n = chain_acceptance(list(masks), list(top1 & masks))
    chain = [h / max(1, n) for h, n in zip(joint_hit, joint_n, strict=True)]
    rounds = replay(top1, feats, steps)
    rates, tau = histogram_rates(rounds, steps)
    tree = None
    if topk > 1:
        tree_rounds = replay(topn, feats, steps)
        t_rates, t_tau = histogram_rates(tree_rounds, steps)
        tree = {"topk": topk, "accept_length": t_tau, "accept_rate_per_position": t_rates, "rounds": len(tree_rounds)}
    return Score([round(a, 6) for a in step_accept], [round(c, 6) for c in chain], [round(r, 6) for r in rates],
                 round(tau, 6), len(rounds), int(masks[0].sum()), tree)


def step0_accept(drafter, target, feats: Features, conv: Convention) -> float:
    """Step-0 acceptance only (one drafter layer per row chunk): the layer search's objective."""
    top1, _, masks = hits(drafter, target, feats, conv, 1)
    return float((top1 & masks).sum()) / max(1, int(masks.sum()))


def layer_search(drafter, target, feats: Features, base: Convention, starts: Sequence[Sequence[int]],
                 n_layers: int, sweeps: int = 3, noise: float = 0.02) -> tuple[tuple[int, ...], float, int]:
    """Coordinate ascent on step-0 acceptance over aux layer ids 0..n_layers (fc is linear in the
    three states, so fixing one slot at a time finds the trained layers from a reasonable start),
    from the best of `starts` (the configured ids first). The configured ids are kept unless the
    best found beats them by more than `noise`. Returns (best ids, step-0 acceptance, evaluations)."""
    cache: dict[tuple[int, ...], float] = {}

    def value(ids: tuple[int, ...]) -> float:
        if ids not in cache:
            cache[ids] = step0_accept(drafter, target, feats, dataclasses.replace(base, layer_ids=ids))
        return cache[ids]

    valid = [tuple(s) for s in starts if len(s) == 3 and all(0 <= i <= n_layers for i in s)]
    if not valid:
        raise ValueError(f"no valid start among {list(starts)} for a {n_layers}-layer target")
    best = max(valid, key=value)  # the first of equals: the configured ids win ties
    for _ in range(sweeps):
        before = best
        for slot in range(3):
            options = [(*best[:slot], layer, *best[slot + 1 :]) for layer in range(n_layers + 1)]
            top = max(options, key=value)
            best = top if value(top) > value(best) else best
        if best == before:
            break
    if value(valid[0]) >= value(best) - noise:
        best = valid[0]
    return best, value(best), len(cache)
