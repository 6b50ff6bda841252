"""Acceptance rules of speculative decoding: pure functions, vectorised over batch and nodes.

A draft tree, per batch row, has N nodes in topological order (parents[b, n] < n). Node 0 is
the root: the last token already emitted, whose target distribution gives the first new token.
A chain of K drafts is N = K + 1 with parents [-1, 0, 1, ..., K-1]. The target's verification
forward gives, at every node u, its next-token logits (greedy) or warped probabilities p_u.

Rules (names as in the papers):
- greedy: follow the children whose token is the target's argmax at their parent.
- deterministic drafts (EAGLE / SGLang top-k trees, `draft_probs=None`): SpecInfer multi-draft
  rejection sampling with one-hot proposals. Children c_1, c_2, ... of u are tried in node
  order; c_i is accepted with probability p_res(c_i), where p_res starts at p_u and each
  rejected child's token is removed (p_res <- normalize(max(p_res - onehot(c), 0))). If every
  child is rejected, the bonus token is drawn from the final p_res.
- sampled drafts (`draft_probs` given: node c was drawn from q_c = draft_probs[b, c]): the
  SpecInfer / multi-step speculative sampling rule, accept c_i with prob min(1, p_res/q_{c_i})
  at its token, on rejection p_res <- normalize(max(p_res - q_{c_i}, 0)).

Both are exactly lossless: by induction over the children, the token leaving node u is
distributed as p_u (for the q-rule because every proposal is independent of the earlier coins,
so after a rejection the remaining children are a fresh speculative sample of p_res).

Only `max_depth` / `max_width` (Python ints that size loops and outputs) may need a host sync;
pass them (`--spec-steps`, `--spec-topk`) from the engine to make every function sync-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from draftsman.sampling import sample

PAD = -1  # fills `path` and `accepted_tokens` after the end of a row's accepted path


@dataclass(frozen=True)
class AcceptResult:
    """One verification round. Row b emits accepted_tokens[b, : accept_len[b] + 1]."""

    accept_len: Tensor  # [B] accepted draft tokens (root and bonus excluded)
    path: Tensor  # [B, D+1] accepted node ids from the root (path[:, 0] = 0), PAD after the end
    bonus: Tensor  # [B] token drawn (or argmaxed) at the deepest accepted node
    accepted_tokens: Tensor  # [B, D+1] draft tokens along the path, then the bonus, PAD after

    @property
    def last_node(self) -> Tensor:
        """[B] the deepest accepted node: its hidden state seeds the next draft round."""
        return self.path.gather(1, self.accept_len[:, None]).squeeze(1)


# ---------------------------------------------------------------------------------------------
# Tree helpers: pointer doubling, so ceil(log2 N) parent-gathers and no data-dependent loop.


def _doubling_steps(num_nodes: int) -> int:
    return max(num_nodes - 1, 0).bit_length()  # 2**steps >= N - 1 >= any depth


def _jump_start(parents: Tensor) -> Tensor:
    """Each node's parent; roots (and padding with parent -1) point at themselves."""
    node = torch.arange(parents.shape[-1], device=parents.device)
    return torch.where(parents >= 0, parents, node)


def tree_depth(parents: Tensor) -> Tensor:
    """parents [..., N] -> depth [..., N] (root 0), by pointer jumping towards the root."""
    parents = parents.long()
    jump = _jump_start(parents)
    depth = (parents >= 0).long()  # invariant: depth[i] = distance from i to jump[i]
    for _ in range(_doubling_steps(parents.shape[-1])):
        depth = depth + depth.gather(-1, jump)
        jump = jump.gather(-1, jump)
    return depth


def ancestor_mask(parents: Tensor) -> Tensor:
    """parents [..., N] -> bool [..., N, N]: [i, j] iff j is i or an ancestor of i.

    This is the verification attention mask of a tree (node i attends to its root path).
    """
    parents = parents.long()
    lead, n = parents.shape[:-1], parents.shape[-1]
    jump = _jump_start(parents.reshape(-1, n))
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(jump.shape[0], n, n)
    # invariant: row i holds the path from i up to jump[i], both included
    mask = eye | eye.gather(1, jump[:, :, None].expand(-1, -1, n))
    for _ in range(_doubling_steps(n)):
        mask = mask | mask.gather(1, jump[:, :, None].expand(-1, -1, n))
        jump = jump.gather(1, jump)
    return mask.reshape(*lead, n, n)


def chain_parents(num_drafts: int, device: torch.device | str | None = None) -> Tensor:
    """parents [K+1] of a chain of K drafts: [-1, 0, 1, ..., K-1] (broadcasts over the batch)."""
    return torch.arange(-1, num_drafts, device=device)


def _earlier_siblings(parents: Tensor, valid: Tensor) -> Tensor:
    """bool [B, N, N]: [c, c'] iff c' is a valid sibling of c tried before it (c' < c)."""
    node = torch.arange(parents.shape[-1], device=parents.device)
    same_parent = (parents[:, :, None] == parents[:, None, :]) & (parents[:, :, None] >= 0)
    return same_parent & (node[None, :] < node[:, None]) & valid[:, None, :]


def _first_among_siblings(ok: Tensor, earlier: Tensor) -> Tensor:
    """Children are tried in order, so only the first acceptable one of each parent counts."""
    return ok & ~(earlier & ok[:, None, :]).any(-1)


def _tree_extent(parents: Tensor, valid: Tensor, earlier: Tensor) -> tuple[int, int]:
    """(max depth, max children per node) over valid nodes. The one host sync in this module."""
    depth = tree_depth(parents).masked_fill(~valid, 0).amax()
    width = (earlier.sum(-1) + 1).masked_fill(~valid | (parents < 0), 0).amax()
    max_depth, max_width = torch.stack([depth, width]).tolist()
    return int(max_depth), int(max_width)


def _truncate(
    parents: Tensor, valid: Tensor, earlier: Tensor, max_depth: int | None, max_width: int | None
) -> Tensor:
    """Nodes beyond the caller's max_depth / max_width become padding: never proposed, so the
    rules stay lossless on the truncated tree (and no index can leave the output shapes)."""
    if max_depth is not None:
        valid = valid & (tree_depth(parents) <= max_depth)
    if max_width is not None:
        valid = valid & (earlier.sum(-1) < max_width)  # sibling rank
    return valid


def _prepare(
    tokens: Tensor, parents: Tensor, valid: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    batch, n = tokens.shape
    parents = parents.to(tokens.device).long()
    if parents.dim() == 1:  # one topology for the whole batch
        parents = parents.expand(batch, n)
    if valid is None:
        valid = torch.ones_like(tokens, dtype=torch.bool)
    return tokens.long(), parents, valid.to(tokens.device).bool()


def _resolve_path(parents: Tensor, chosen: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """chosen [B, N]: node would be taken if its parent is reached (root True, at most one
    chosen child per node) -> (accept_len [B], path [B, D+1]).

    A node is on the accepted path iff it and all its ancestors are chosen; that set is a
    single root path, whose deepest node ends the round.
    """
    batch, n = parents.shape
    anc = ancestor_mask(parents)
    on_path = ~(anc & ~chosen[:, None, :]).any(-1)
    depth = anc.sum(-1) - 1
    accept_len = torch.where(on_path, depth, -1).amax(-1)
    # scatter node ids to their depth; nodes off the path land in a dump column
    column = torch.where(on_path, depth.clamp(max=max_depth), max_depth + 1)
    node = torch.arange(n, device=parents.device).expand(batch, n)
    path = parents.new_full((batch, max_depth + 2), PAD).scatter(1, column, node)
    return accept_len, path[:, : max_depth + 1]


def _result(tokens: Tensor, path: Tensor, accept_len: Tensor, bonus: Tensor) -> AcceptResult:
    steps = path[:, 1:]
    drafts = tokens.gather(1, steps.clamp(min=0)).masked_fill(steps < 0, PAD)
    emitted = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), PAD)], dim=1)
    emitted = emitted.scatter(1, accept_len[:, None], bonus[:, None])
    return AcceptResult(accept_len=accept_len, path=path, bonus=bonus, accepted_tokens=emitted)


# ---------------------------------------------------------------------------------------------
# Acceptance rules.


def greedy_accept(
    tokens: Tensor,
    parents: Tensor,
    target_logits: Tensor,
    valid: Tensor | None = None,
    *,
    max_depth: int | None = None,
) -> AcceptResult:
    """Longest root path whose every token is the target's argmax at its parent; the bonus is
    the target's argmax at the deepest accepted node.

    tokens [B, N], parents [B, N] or [N], target_logits [B, N, V], valid [B, N] bool.
    max_depth sizes `path` ([B, max_depth + 1]); None reads it from `parents` (one host sync);
    deeper nodes are treated as padding.
    """
    tokens, parents, valid = _prepare(tokens, parents, valid)
    earlier = _earlier_siblings(parents, valid)
    if max_depth is None:
        max_depth, _ = _tree_extent(parents, valid, earlier)
    else:
        valid = _truncate(parents, valid, earlier, max_depth, None)
    target_choice = target_logits.argmax(-1)  # [B, N]
    ok = valid & (tokens == target_choice.gather(1, parents.clamp(min=0)))
    ok[:, 0] = True
    chosen = _first_among_siblings(ok, earlier)
    accept_len, path = _resolve_path(parents, chosen, max_depth)
    last = path.gather(1, accept_len[:, None])
    bonus = target_choice.gather(1, last).squeeze(1)
    return _result(tokens, path, accept_len, bonus)


def sample_accept(
    tokens: Tensor,
    parents: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    valid: Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    max_depth: int | None = None,
    max_width: int | None = None,
) -> AcceptResult:
    """Lossless rejection sampling over a draft tree (see the module docstring for the rules).

    target_probs [B, N, V]: the target's warped next-token distribution p_u at each node.
    draft_probs [B, N, V] or None: the distribution each node's token was drawn from (siblings
    drawn independently); None means deterministic drafts (top-k trees, greedy drafters).
    Randomness: one uniform per node (drawn first), then one `sample` draw for the bonus, so
    the two rules consume `generator` identically. max_depth (`--spec-steps`) and max_width
    (`--spec-topk`, used with draft_probs only) avoid the one host sync that derives them;
    nodes deeper than max_depth, or past the first max_width children of a node, are treated as
    padding. Rows of target_probs / draft_probs must sum to 1.
    """
    tokens, parents, valid = _prepare(tokens, parents, valid)
    batch, n, _ = target_probs.shape
    earlier = _earlier_siblings(parents, valid)
    if draft_probs is None:
        max_width = None  # the one-hot rule needs no loop over sibling rank
    if max_depth is not None or max_width is not None:
        valid = _truncate(parents, valid, earlier, max_depth, max_width)
    if max_depth is None or (draft_probs is not None and max_width is None):
        depth_seen, width_seen = _tree_extent(parents, valid, earlier)
        max_depth = depth_seen if max_depth is None else max_depth
        max_width = width_seen if max_width is None else max_width
    coins = torch.rand(batch, n, generator=generator, device=target_probs.device)
    if draft_probs is None:
        accept_len, path, residual = _accept_deterministic(
            tokens, parents, valid, earlier, target_probs, coins, max_depth
        )
    else:
        accept_len, path, residual = _accept_sampled(
            tokens, parents, valid, earlier, target_probs, draft_probs, coins,
            max_depth, max_width or 0,
        )  # fmt: skip
    bonus = sample(residual, generator=generator)
    return _result(tokens, path, accept_len, bonus)


def _accept_deterministic(
    tokens: Tensor,
    parents: Tensor,
    valid: Tensor,
    earlier: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    max_depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """One-hot proposals, all nodes decided at once (no loop over depth or rank).

    Removing rejected children renormalises by the mass left, so the i-th child is accepted
    with p_u(c_i) / (1 - sum_{j<i} p_u(c_j)): then P(take c_i) = p_u(c_i), and after all
    rejections the bonus ~ p_u without the children. That is exactly "draw x ~ p_u and follow
    the child whose token is x" (siblings are distinct), i.e. lossless; per-node coins cost
    B*N uniforms where drawing x at every node would cost B*N*V.
    """
    batch, _, vocab = target_probs.shape
    rows = torch.arange(batch, device=tokens.device)[:, None]
    p_tok = target_probs[rows, parents.clamp(min=0), tokens.clamp(0, vocab - 1)].float()
    mass_before = (earlier.float() * p_tok[:, None, :]).sum(-1)  # p_u of siblings tried before
    # coin < p / (1 - mass_before), written without the division (1 - mass_before may be 0)
    ok = valid & (coins * (1 - mass_before).clamp(min=0) < p_tok)
    ok[:, 0] = True
    accept_len, path = _resolve_path(parents, _first_among_siblings(ok, earlier), max_depth)

    last = path.gather(1, accept_len[:, None]).squeeze(1)
    p_last = target_probs[rows.squeeze(1), last].float()
    is_child = valid & (parents == last[:, None])
    dump = torch.where(is_child, tokens.clamp(0, vocab - 1), vocab)
    removed = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=tokens.device)
    removed = removed.scatter(1, dump, torch.ones_like(dump, dtype=torch.bool))[:, :vocab]
    residual = p_last.masked_fill(removed, 0.0)
    # all children rejected although they held all the mass: a float-rounding event only
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)
    return accept_len, path, residual


def _accept_sampled(
    tokens: Tensor,
    parents: Tensor,
    valid: Tensor,
    earlier: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor,
    coins: Tensor,
    max_depth: int,
    max_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The q-rule walks the tree: loops over depth and sibling rank, [B, V] work per step.

    p_res depends on the proposals rejected before, so each node's siblings are visited in
    order; only the current node's residual is kept (B*V floats, not B*N*V).
    """
    batch, n, vocab = target_probs.shape
    rows = torch.arange(batch, device=tokens.device)
    node = torch.arange(n, device=tokens.device)
    rank = earlier.sum(-1)  # sibling rank among valid children
    is_child = valid & (parents >= 0) & (node > 0)
    tiny = torch.finfo(torch.float32).tiny

    current = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    walking = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    residual = target_probs[:, 0].float()
    path = torch.full((batch, max_depth + 1), PAD, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    for depth in range(max_depth):
        step = current
        moved = torch.zeros_like(walking)
        for k in range(max_width):
            kth_child = is_child & (rank == k) & (parents == current[:, None])
            tried = walking & ~moved & kth_child.any(-1)
            child = kth_child.long().argmax(-1)
            token = tokens[rows, child].clamp(0, vocab - 1)
            q = draft_probs[rows, child].float()
            # accept with prob min(1, p_res(x) / q(x)), written without the division
            take = tried & (coins[rows, child] * q[rows, token] < residual[rows, token])
            step = torch.where(take, child, step)
            moved = moved | take
            rest = (residual - q).clamp(min=0)
            mass = rest.sum(-1, keepdim=True)
            # mass 0 means rejection had probability 0 (p_res == q): keep p_res on that rounding
            update = (tried & ~take)[:, None] & (mass > 0)
            residual = torch.where(update, rest / mass.clamp(min=tiny), residual)
        path[:, depth + 1] = torch.where(moved, step, PAD)
        current, walking = step, moved
        residual = torch.where(moved[:, None], target_probs[rows, current].float(), residual)
    accept_len = (path[:, 1:] >= 0).sum(-1)
    return accept_len, path, residual


# ---------------------------------------------------------------------------------------------
# Statistics.


class SpecStats:
    """Acceptance counters with SGLang / vLLM definitions.

    accept_length (τ) = tokens emitted per verification forward = mean(accept_len + 1);
    accept_rate_per_position[i-1] = p_i = rounds with accept_len >= i / rounds, so
    τ = 1 + Σ p_i. Counts live on the device as histograms of accept_len (update never syncs);
    reading a statistic syncs once. Per-request counters are kept per batch row (request slot):
    call `reset_rows` when a new request takes a slot; the aggregate keeps every round.
    """

    def __init__(self, max_depth: int, draft_tokens_per_round: int | None = None) -> None:
        self.max_depth = max_depth
        # nodes verified besides the root (`--spec-draft-tokens` - 1); a chain drafts max_depth
        self.draft_tokens_per_round = (
            max_depth if draft_tokens_per_round is None else draft_tokens_per_round
        )
        self._rows: Tensor | None = None  # [B, D+1] histogram of accept_len per batch row
        self._total: Tensor | None = None  # [D+1] histogram over all rows and rounds

    def update(self, accept_len: Tensor, active_mask: Tensor | None = None) -> None:
        """Count one round: accept_len [B]; rows with active_mask False (finished) are skipped."""
        length = accept_len.long().clamp(0, self.max_depth)
        weight = torch.ones_like(length) if active_mask is None else active_mask.long()
        batch = length.shape[0]
        if self._rows is None or self._total is None:
            self._rows = torch.zeros(
                batch, self.max_depth + 1, dtype=torch.long, device=length.device
            )
            self._total = torch.zeros(self.max_depth + 1, dtype=torch.long, device=length.device)
        elif self._rows.shape[0] < batch:
            grow = self._rows.new_zeros(batch - self._rows.shape[0], self.max_depth + 1)
            self._rows = torch.cat([self._rows, grow])
        self._rows[:batch].scatter_add_(1, length[:, None], weight[:, None])
        self._total.scatter_add_(0, length, weight)

    def reset_rows(self, rows: Tensor | list[int]) -> None:
        """Zero the per-request counters of these batch rows (the aggregate is kept)."""
        if self._rows is not None:
            self._rows[rows] = 0

    @property
    def histogram(self) -> list[int]:
        """Rounds by accept_len 0..max_depth, all requests together."""
        return [0] * (self.max_depth + 1) if self._total is None else self._total.tolist()

    @property
    def rounds(self) -> int:
        return sum(self.histogram)

    @property
    def accept_length(self) -> float:
        return summarize_histogram(self.histogram, self.draft_tokens_per_round)["accept_length"]

    @property
    def accept_rate_per_position(self) -> list[float]:
        return summarize_histogram(self.histogram, self.draft_tokens_per_round)["accept_rate_per_position"]

    def request(self, row: int) -> dict:
        """Statistics of the request in batch row `row`."""
        hist = [0] * (self.max_depth + 1) if self._rows is None else self._rows[row].tolist()
        return summarize_histogram(hist, self.draft_tokens_per_round)

    def to_dict(self, per_request: bool = False) -> dict:
        out = summarize_histogram(self.histogram, self.draft_tokens_per_round)
        if per_request:
            rows = [] if self._rows is None else self._rows.tolist()
            out["per_request"] = [summarize_histogram(h, self.draft_tokens_per_round) for h in rows]
        return out


def summarize_histogram(hist: list[int], draft_tokens_per_round: int, drafted: int | None = None) -> dict:
    """Rounds by accepted drafts -> τ and acceptance rates. drafted: the draft tokens verified,
    when rounds differ in shape (adaptive speculation); else rounds x draft_tokens_per_round."""
    rounds = sum(hist)
    accepted = sum(i * h for i, h in enumerate(hist))
    if drafted is None:
        drafted = rounds * draft_tokens_per_round
    at_least = [sum(hist[i:]) for i in range(1, len(hist))]  # rounds with accept_len >= i
    return {
        "rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "emitted_tokens": accepted + rounds,
        "accept_length": (accepted + rounds) / rounds if rounds else 0.0,
        "accept_rate": accepted / drafted if drafted else 0.0,
        "accept_rate_per_position": [c / rounds if rounds else 0.0 for c in at_least],
        "accept_length_histogram": list(hist),
    }


def merge_stats(parts: Sequence[dict]) -> dict:
    """Combine the statistics of separate runs (SpecEngine.generate's `stats`): histograms, draft
    tokens and round counts add up; every ratio is recomputed from them."""
    hists = [p["accept_length_histogram"] for p in parts]
    width = max(len(h) for h in hists)
    total = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    first = parts[0]
    out = summarize_histogram(total, 0, drafted=sum(p["drafted_tokens"] for p in parts))
    for key in ("spec_rounds", "plain_rounds"):
        if all(key in p for p in parts):
            out[key] = sum(p[key] for p in parts)
    if "spec" in first:
        out["spec"] = first["spec"]
    if all("per_request" in p for p in parts):
        out["per_request"] = [r for p in parts for r in p["per_request"]]
    return out
