"""EAGLE-2 dynamic draft trees, as fixed-shape tensors.

Drafting grows a candidate pool level by level: depth 1 holds the top-k tokens of the root's draft
distribution; every later level holds the top-k children of each of the k frontier nodes (k*k),
and the next frontier is the top-k of those by cumulative log-probability. The verified tree is the
root plus the best `draft_tokens - 1` candidates of the whole pool (SGLang's meaning of
--spec-draft-tokens). A child's cumulative log-probability never exceeds its parent's, so the
selection is closed under ancestors; ties are broken towards shallower nodes to keep it so.

Pool layout per row: level 1 at [0, k), level d >= 2 at [k + (d-2)k^2, k + (d-1)k^2), child c of
frontier node j at offset j*k + c. Parents always precede children, so sorting selected pool
indices gives a topological node order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def pool_size(steps: int, topk: int) -> int:
    return topk + (steps - 1) * topk * topk


def max_draft_tokens(steps: int, topk: int) -> int:
    """Largest meaningful --spec-draft-tokens: the whole pool plus the root."""
    return pool_size(steps, topk) + 1


def check_tree_args(steps: int, topk: int, draft_tokens: int) -> None:
    if steps < 1 or topk < 1:
        raise ValueError(f"--spec-steps and --spec-topk must be >= 1 (got {steps}, {topk})")
    hi = max_draft_tokens(steps, topk)
    if not 2 <= draft_tokens <= hi:
        raise ValueError(
            f"--spec-draft-tokens={draft_tokens} must lie in [2, {hi}] for steps={steps}, topk={topk} "
            f"(it counts the verified tree's nodes including the root; a chain has steps + 1)"
        )


@dataclass
class CandidatePool:
    """All drafted candidates of one round: [B, P] each."""

    tokens: Tensor  # target-vocabulary ids
    scores: Tensor  # cumulative draft log-probability (float32)
    parents: Tensor  # pool index of the parent, -1 for children of the root
    depth: Tensor  # 1..steps

    @classmethod
    def empty(cls, batch: int, steps: int, topk: int, device: torch.device) -> CandidatePool:
        p = pool_size(steps, topk)
        depth = torch.ones(p, dtype=torch.long, device=device)
        for d in range(2, steps + 1):
            start = topk + (d - 2) * topk * topk
            depth[start : start + topk * topk] = d
        return cls(
            tokens=torch.zeros(batch, p, dtype=torch.long, device=device),
            scores=torch.full((batch, p), -torch.inf, device=device),
            parents=torch.full((batch, p), -1, dtype=torch.long, device=device),
            depth=depth.expand(batch, p),
        )

    def level_slice(self, d: int, topk: int) -> slice:
        start = 0 if d == 1 else topk + (d - 2) * topk * topk
        return slice(start, start + (topk if d == 1 else topk * topk))


@dataclass
class VerifyTree:
    """The tree the target verifies: node 0 is the root (last emitted token). [B, N] each."""

    tokens: Tensor
    parents: Tensor  # node index of the parent, -1 for the root
    depth: Tensor  # 0 for the root


def select_tree(pool: CandidatePool, root_tokens: Tensor, draft_tokens: int) -> VerifyTree:
    """Root + the best (draft_tokens - 1) candidates, in topological order."""
    b, p = pool.scores.shape
    m = draft_tokens - 1
    # float64 so the tiny depth tie-break never reorders genuinely different scores.
    key = pool.scores.double() - pool.depth.double() * 1e-9
    chosen = key.topk(m, dim=-1).indices.sort(dim=-1).values  # [B, m], parents first
    node_of = torch.full((b, p), -1, dtype=torch.long, device=chosen.device)
    node_of.scatter_(1, chosen, torch.arange(1, m + 1, device=chosen.device).expand(b, m))
    parent_pool = pool.parents.gather(1, chosen)
    parent_node = torch.where(parent_pool < 0, 0, node_of.gather(1, parent_pool.clamp(min=0)))
    root = torch.full((b, 1), -1, dtype=torch.long, device=chosen.device)
    return VerifyTree(
        tokens=torch.cat([root_tokens[:, None], pool.tokens.gather(1, chosen)], 1),
        parents=torch.cat([root, parent_node], 1),
        depth=torch.cat([torch.zeros_like(root), pool.depth.gather(1, chosen)], 1),
    )
