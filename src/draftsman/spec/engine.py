"""EAGLE-3 speculative decoding: prefill -> draft tree -> one verify forward -> accept -> compact.

Slot conventions (per batch row, `n` = tokens the target has committed, root = last emitted token
at position n, not yet seen by the target):
  target cache   slots [0, n) committed; the verified tree is written at n + node index, the
                 accepted path is then compacted to n+1.. (the root already sits at n).
  drafter cache  the pair (token_{i+1}, target feature f_i) lives at slot/position i, so slots
                 [0, n) are committed; the depth-d frontier is drafted at position n+d-1 into
                 scratch slots n + (d-1)*topk + j, overwritten next round by true features.
One host sync per round: reading the accepted tokens to emit them and test stop rules.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsman.generate import GenerationOutput, RowState, StopRules, next_token, pad_prompts
from draftsman.models.base import TargetModel
from draftsman.sampling import SamplingParams, make_generator, warp_probs
from draftsman.spec.tree import CandidatePool, VerifyTree, check_tree_args, select_tree
from draftsman.spec.verify import SpecStats, ancestor_mask, greedy_accept, sample_accept


@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape, with SGLang's flag meanings."""

    steps: int = 5  # --spec-steps: draft depth
    topk: int = 4  # --spec-topk: branching per step
    draft_tokens: int = 16  # --spec-draft-tokens: verified nodes including the root

    def __post_init__(self) -> None:
        check_tree_args(self.steps, self.topk, self.draft_tokens)

    @classmethod
    def chain(cls, steps: int) -> SpecConfig:
        return cls(steps=steps, topk=1, draft_tokens=steps + 1)


@dataclass
class _Batch:
    """Device state of the rows still decoding."""

    rows: list[int]  # indices into the caller's prompt list
    n: Tensor  # [B] committed target length (= position of the root)
    root: Tensor  # [B] last emitted token
    d_logits: Tensor  # [B, Vd] drafter logits for depth 1
    d_hidden: Tensor  # [B, H] drafter hidden paired with depth-1 tokens


class SpecEngine:
    def __init__(self, target: TargetModel, drafter, spec: SpecConfig = SpecConfig()) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec
        self.aux_ids = tuple(drafter.aux_layer_ids)

    # ---- public ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        rules: StopRules,
        params: SamplingParams = SamplingParams(temperature=0.0),
    ) -> GenerationOutput:
        device = self.target.embed_tokens.weight.device
        ids, lengths = pad_prompts(prompts, device)
        max_len = int(lengths.max()) + rules.max_new_tokens
        k, steps, m = self.spec.topk, self.spec.steps, self.spec.draft_tokens
        self.t_cache = self.target.new_cache(len(prompts), max_len + m + 1)
        self.d_cache = self.drafter.new_cache(len(prompts), max_len + (steps - 1) * k + steps + 2)
        generator = make_generator(params.seed, device)
        states = [RowState(rules) for _ in prompts]
        stats = SpecStats(steps, m - 1)  # histograms per request slot (= prompt index) and overall
        every = torch.arange(len(prompts), device=device)
        start = time.perf_counter()
        batch, first = self._prefill(ids, lengths, params, generator)
        for row, tok in zip(states, first.tolist(), strict=True):
            row.extend([tok])
        batch = self._drop_finished(batch, states)
        while batch.rows:
            tree = self._draft(batch)
            accept_len, emitted = self._verify_and_accept(batch, tree, params, generator)
            rows = torch.tensor(batch.rows, device=device)
            stats.update(torch.zeros_like(every).index_copy(0, rows, accept_len), torch.isin(every, rows))
            lens, toks = accept_len.tolist(), emitted.tolist()  # the round's host sync
            for i, r in enumerate(batch.rows):
                states[r].extend(toks[i][: lens[i] + 1])
            batch = self._drop_finished(batch, states)
        elapsed = time.perf_counter() - start
        out = GenerationOutput([s.tokens for s in states], [s.finish_reason for s in states], elapsed)
        out.stats = stats.to_dict(per_request=True) | {"spec": dataclasses.asdict(self.spec)}
        return out

    # ---- phases ------------------------------------------------------------------------
    def _prefill(self, ids: Tensor, lengths: Tensor, params: SamplingParams, generator) -> tuple[_Batch, Tensor]:
        b, t = ids.shape
        last = (lengths - 1)[:, None]
        out = self.target.run(ids, cache=self.t_cache, aux_layer_ids=self.aux_ids, logits_index=last)
        first = next_token(out.logits[:, 0], params, generator)
        # Drafter pairs (x_{i+1}, f_i): the prompt shifted by one, the new token at len-1.
        shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, last, first[:, None])
        positions = torch.arange(t, device=ids.device).expand(b, t)
        d_logits, d_hidden = self._extend(shifted, out.aux_hidden, positions, lengths - 1)
        return _Batch(list(range(b)), lengths.clone(), first, d_logits, d_hidden), first

    def _extend(self, tokens: Tensor, aux: list[Tensor] | Tensor, positions: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        """Run the drafter over (token, target feature) pairs written at slot = position;
        return its logits and hidden state at index `last` [B] of each row."""
        hidden = self.drafter.project(aux)
        logits, h = self.drafter(tokens, hidden, positions, cache=self.d_cache, cache_index=positions)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return logits[rows, last], h[rows, last]

    def _draft(self, batch: _Batch) -> VerifyTree:
        k, steps = self.spec.topk, self.spec.steps
        bsz, device = batch.n.shape[0], batch.n.device
        pool = CandidatePool.empty(bsz, steps, k, device)
        scores, ids = F.log_softmax(batch.d_logits.float(), -1).topk(k, dim=-1)
        level = pool.level_slice(1, k)
        pool.tokens[:, level] = self.drafter.draft_to_target(ids)
        pool.scores[:, level] = scores
        f_tokens, f_scores = pool.tokens[:, level], scores
        f_pool = torch.arange(k, device=device).expand(bsz, k)
        f_hidden = batch.d_hidden[:, None].expand(-1, k, -1)
        scratch = (steps - 1) * k
        f_anc = torch.zeros(bsz, k, max(scratch, 1), dtype=torch.bool, device=device)
        for d in range(1, steps):
            own = (d - 1) * k + torch.arange(k, device=device)  # scratch index of each frontier node
            slots = batch.n[:, None] + own
            f_anc = f_anc.clone()
            f_anc[:, torch.arange(k), own] = True
            mask = self._scratch_mask(batch.n, f_anc, scratch)
            positions = (batch.n + d - 1)[:, None].expand(bsz, k)
            logits, h = self.drafter(f_tokens, f_hidden, positions, cache=self.d_cache, cache_index=slots,
                                     attn_mask=mask)
            c_scores, c_ids = F.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k, k]
            cum = (f_scores[..., None] + c_scores).reshape(bsz, k * k)
            level = pool.level_slice(d + 1, k)
            pool.tokens[:, level] = self.drafter.draft_to_target(c_ids).reshape(bsz, k * k)
            pool.scores[:, level] = cum
            pool.parents[:, level] = f_pool[:, :, None].expand(bsz, k, k).reshape(bsz, k * k)
            f_scores, best = cum.topk(k, dim=-1)
            parent = best // k
            f_tokens = pool.tokens[:, level].gather(1, best)
            f_pool = level.start + best
            f_hidden = h.gather(1, parent[..., None].expand(-1, -1, h.shape[-1]))
            f_anc = f_anc.gather(1, parent[..., None].expand(-1, -1, f_anc.shape[-1]))
        return select_tree(pool, batch.root, self.spec.draft_tokens)

    @staticmethod
    def _scratch_mask(n: Tensor, anc: Tensor, scratch: int) -> Tensor:
        """[B, T, S] mask: committed slots [0, n) plus the scratch slots n + j marked in anc."""
        s = int(n.max()) + scratch
        slots = torch.arange(s, device=n.device)
        rel = slots[None, :] - n[:, None]  # [B, S] index into the scratch region
        in_scratch = (rel >= 0) & (rel < scratch)
        picked = anc.gather(2, rel.clamp(0, anc.shape[-1] - 1)[:, None, :].expand(-1, anc.shape[1], -1))
        return (rel < 0)[:, None, :] | (in_scratch[:, None, :] & picked)

    def _verify_and_accept(self, batch: _Batch, tree: VerifyTree, params: SamplingParams, generator) -> tuple[Tensor, Tensor]:
        n = batch.n
        _bsz, m = tree.tokens.shape
        anc = ancestor_mask(tree.parents)  # [B, m, m]
        mask = self._scratch_mask(n, anc, m)
        slots = n[:, None] + torch.arange(m, device=n.device)
        out = self.target.run(tree.tokens, positions=n[:, None] + tree.depth, cache=self.t_cache,
                              cache_index=slots, attn_mask=mask, aux_layer_ids=self.aux_ids)
        if params.temperature == 0:
            res = greedy_accept(tree.tokens, tree.parents, out.logits, max_depth=self.spec.steps)
        else:
            probs = warp_probs(out.logits, params.temperature, params.top_k, params.top_p)
            res = sample_accept(tree.tokens, tree.parents, probs, generator=generator,
                                max_depth=self.spec.steps, max_width=self.spec.topk)
        path = res.path  # [B, D+1] node indices from the root, -1 padded
        depth = path.shape[1] - 1
        steps = torch.arange(1, depth + 1, device=n.device)
        dst = n[:, None] + steps
        src = torch.where(path[:, 1:] >= 0, n[:, None] + path[:, 1:], dst)
        self.t_cache.compact(src, dst)
        feats = torch.cat(out.aux_hidden, -1)
        feats = feats.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, feats.shape[-1]))
        emitted = res.accepted_tokens
        tokens = emitted.clamp(min=0)
        positions = n[:, None] + torch.arange(depth + 1, device=n.device)
        batch.d_logits, batch.d_hidden = self._extend(tokens, feats, positions, res.accept_len)
        batch.n = n + res.accept_len + 1
        batch.root = res.bonus
        return res.accept_len, emitted

    def _drop_finished(self, batch: _Batch, states: list[RowState]) -> _Batch:
        keep = [i for i, r in enumerate(batch.rows) if not states[r].done]
        if len(keep) == len(batch.rows):
            return batch
        idx = torch.tensor(keep, dtype=torch.long, device=batch.n.device)
        self.t_cache.select_rows(idx)
        self.d_cache.select_rows(idx)
        return _Batch([batch.rows[i] for i in keep], batch.n[idx], batch.root[idx], batch.d_logits[idx],
                      batch.d_hidden[idx])
