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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsman.generate import GenerationOutput, StopRules
from draftsman.graphs import captures, compiled, failures, pow2_ceil
from draftsman.kvcache import StaticCache
from draftsman.models.base import TargetModel
from draftsman.models.layers import decode_kernel_serves, slot_mask
from draftsman.sampling import SamplingParams, greedy_argmax
from draftsman.session import DecodeSession, Event, Request, run_to_completion
from draftsman.spec.tree import CandidatePool, VerifyTree, check_tree_args, select_tree
from draftsman.spec.verify import (
    AcceptResult,
    ancestor_mask,
    greedy_accept,
    sample_accept,
    summarize_histogram,
)

if TYPE_CHECKING:
    from draftsman.spec.adaptive import AdaptivePolicy

# Plain rounds (adaptive speculation off) a drafter can catch up on when speculation resumes.
BACKLOG = 64
# Draining (no request waiting): the rows that decide when the batch ends are re-chosen when a
# row joins or leaves, or after this many rounds (their tokens left are read every round).
DRAIN_REFRESH = 8
# Spilled pairs a row may hold deferred (past its prompt) before a full backlog is caught up
# instead: deferred chunks are device memory (a feature row per token), so a long plain stretch
# pays the drafter's forwards once per BACKLOG rounds, as a session that never defers does.
SPILL_LIMIT = 4 * BACKLOG
# Per-row state a speculation round and a plain round (adaptive sessions) read and replace.
ROUND_STATE = ("n", "root", "d_logits", "d_hidden")
PLAIN_STATE = ("n", "root")


@dataclass(frozen=True)
class SpecConfig:
    """Speculation shape, with SGLang's flag meanings."""

    steps: int = 5  # --spec-steps: draft depth
    topk: int = 4  # --spec-topk: branching per step
    draft_tokens: int = 16  # --spec-draft-tokens: verified nodes including the root

    def __post_init__(self) -> None:
        check_tree_args(self.steps, self.topk, self.draft_tokens)
        # Hashed once: arms key the adaptive policy's tables, ~60 lookups a round, and the
        # dataclass's own hash builds a tuple each time (a third of `choose`'s host time).
        object.__setattr__(self, "_hash", hash((self.steps, self.topk, self.draft_tokens)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def chain(cls, steps: int) -> SpecConfig:
        return cls(steps=steps, topk=1, draft_tokens=steps + 1)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where work runs as it is issued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecSession(DecodeSession):
    """Speculative decoding of a running batch (see the module docstring for slot layout).

    Per-row device state: n (committed target length = root position), root (last emitted
    token), d_logits/d_hidden (drafter output that seeds depth 1), and sampling parameters."""

    def __init__(self, target: TargetModel, drafter, spec: SpecConfig | None, max_len: int, seed: int | None = None,
                 policy: AdaptivePolicy | None = None, compile: bool = False) -> None:
        """spec: the speculation shape of every round; or None with `policy`, which picks one of
        its candidates, or plain decoding, per round (spec/adaptive.py). compile: as for
        DecodeSession, for the drafter's forwards too."""
        if (spec is None) == (policy is None):
            raise ValueError("give a SpecConfig, or spec=None and an AdaptivePolicy")
        super().__init__(target, max_len, seed, compile)
        self.full_span = self.full_span and decode_kernel_serves(drafter)  # (both caches, or neither)
        self.d_fwd = compiled(drafter, "forward") if compile else drafter
        self.drafter, self.policy = drafter, policy
        self.shapes = [spec] if policy is None else list(policy.candidates)
        self.spec = self.shapes[0]  # the shape of the round being run
        self.max_steps = max(c.steps for c in self.shapes)
        self.aux_ids = tuple(drafter.aux_layer_ids)
        self._plain_run = 0  # plain rounds since the drafter last caught up (a row holds at most this many pairs)
        self._t_span = self._d_span = None  # attention spans of the round being run (_set_spans)
        self._compiled_shapes: set = set()  # (arm, batch bucket) rounds run so far, with compile
        # _captured's answers per shape (its question to the graph tables builds keys over every
        # cache buffer, host time each round): valid until the tables capture again (a capture
        # may evict) or a capture fails.
        self._ready: dict[tuple, bool] = {}
        self._ready_captures: tuple[int, int] = (-1, -1)
        self._ready_round: tuple[int, tuple] = (-1, ())  # (policy round, _ready_context) when made
        self._span_memo: tuple[int, dict] = (-1, {})  # (roster, (_spans, longest row they hold to) per (spec, plain))
        self._in_step_flags: dict[tuple[int, bool], Tensor] = {}  # _round_inputs' flags per (rows, value)
        self._front: tuple[int, int, list] = (-1, -1, [])  # (roster, policy round, drain_front) when made
        self.catch_ups, self.catch_up_seconds = 0, 0.0  # the drafter's catch-ups (reports)
        self._plain_drain: tuple[int, int] | None = None  # (roster, batch bucket) draining plainly
        # (rows' key, batch bucket, policy round, arm): the arm chosen holds until that round,
        # unasked (plain decoding: plain_hold, for rows of the same sampling classes; a
        # speculative arm: spec_hold, for the same rows)
        self._hold: tuple[Hashable, int, int, SpecConfig | None] = (-1, -1, -1, None)
        # Deferred drafter work (adaptive sessions decoding plainly): per request, the
        # (token, feature) pairs not yet in the drafter's cache, as chunks (tokens [L], features
        # [L, F], position of the first), run through the drafter only when speculation is next
        # tried (_prefill_pending); _joining carries a prefill's chunks to _join.
        self._pending: dict[Hashable, list[tuple[Tensor, Tensor, int]]] = {}
        self._joining: list[tuple[Tensor, Tensor, int]] | None = None
        self._d_zero: tuple[Tensor, Tensor] | None = None  # one zero row of the drafter state (after one prefill)
        self.deferred_prefills = self.spills = 0  # (reports)
        self._mix: tuple[int, list] = (-1, [])  # (roster, the rows' sampling classes) when made

    def _modules(self) -> tuple:
        return (self.target, self.drafter)

    # ---- prefill ------------------------------------------------------------------------
    def _prefill(self, ids, lengths, sampling, rows):
        b, t = ids.shape
        t_extra = max(c.draft_tokens for c in self.shapes) + 1
        d_extra = max((c.steps - 1) * c.topk + c.steps for c in self.shapes) + 2
        if self.policy is not None:
            d_extra += BACKLOG  # catch-up writes padding entries past n
        last = (lengths - 1)[:, None]
        positions = torch.arange(t, device=ids.device).expand(b, t)
        staged = self._staged_prefill(ids)
        # Plain decoding is the running batch's choice: the drafter's prefill waits until
        # speculation is next tried, and rows that finish before never pay it (on CPU the joins'
        # drafter prefills cost the adaptive arm 0.6-3% against plain decoding). Its cache rows
        # are then not made here: the running drafter cache grows by rows that the deferred
        # prefill writes before any is read (DecodeSession._join; a staging cache's copy was two
        # more launches and a cache's worth of copying per join).
        lazy = self._d_zero is not None and self._lazy(len(self.rows) + b)
        d_cache = None
        if staged:  # static steps over staging caches (graphed): see DecodeSession._staged_prefill
            t_cache = self.staging("target", lambda r: self.target.new_cache(r, self.max_len + t_extra), b)
            if not lazy:
                d_cache = self.staging("drafter", lambda r: self.drafter.new_cache(r, self.max_len + d_extra), b)
            logits, feats = self.run_step(self.target, ("prefill", self.aux_ids),
                                          self.staged_target_prefill(t_cache, self.aux_ids), [t_cache], ids=ids,
                                          last=last)
        else:
            t_cache = self.target.new_cache(b, self.prefill_slots(self.max_len + t_extra, t))
            if not lazy:
                d_cache = self.drafter.new_cache(b, self.prefill_slots(self.max_len + d_extra, t))
            out = self.target.run(ids, cache=t_cache, aux_layer_ids=self.aux_ids, logits_index=last)
            logits, feats = out.logits[:, 0], torch.cat(out.aux_hidden, -1)
        first = self.sample_first(logits, sampling, rows)
        # Drafter pairs (x_{i+1}, f_i): the prompt shifted by one, the new token at len-1.
        shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, last, first[:, None])
        if lazy:
            # (one copy of a staged prefill's features, a graph output; rows' chunks are views)
            kept = feats.clone() if staged else feats
            self._joining = [(shifted[i, :len(r.prompt)], kept[i, :len(r.prompt)], 0) for i, r in enumerate(rows)]
            self.deferred_prefills += b
            # (zero rows as views of one zero row: never written in place, joined by a copy)
            d_logits, d_hidden = (x.expand(b, *x.shape[1:]) for x in self._d_zero)
        elif staged:
            # (the uncompiled drafter, as the target's staged prefill: a compiled forward would
            # recompile for every prefill shape)
            out = self.run_step(self.drafter, ("prefill",), self._drafter_step(d_cache, t, self.drafter), [d_cache],
                                tokens=shifted, feats=feats, positions=positions, last=lengths - 1)
            d_logits, d_hidden = (x.clone() for x in out)  # graph outputs: they outlive the next replay
        else:
            d_logits, d_hidden = self._extend(d_cache, shifted, feats, positions, lengths - 1, prefill=True)
        if self._d_zero is None:  # (shapes, dtypes and device stay: made once)
            self._d_zero = tuple(x.new_zeros(1, *x.shape[1:]) for x in (d_logits, d_hidden))
        state = {"n": lengths.clone(), "root": first, "d_logits": d_logits, "d_hidden": d_hidden, **sampling}
        if self.policy is not None:  # (token, feature) pairs of plain rounds, for the drafter
            # (columns: plain rounds since the last catch-up; newcomers' pairs start at this one)
            state |= {"bk_tokens": torch.zeros(b, BACKLOG, dtype=torch.long, device=ids.device),
                      "bk_feats": feats.new_zeros(b, BACKLOG, feats.shape[-1]),
                      "bk_start": torch.full((b,), self._plain_run, dtype=torch.long, device=ids.device)}
        return [t_cache, d_cache], state, first

    def _extend(self, d_cache: StaticCache, tokens: Tensor, aux: list[Tensor] | Tensor, positions: Tensor,
                last: Tensor, prefill: bool = False, graph: bool = True) -> tuple[Tensor, Tensor]:
        """Run the drafter over (token, target feature) pairs written at slot = position;
        return its logits and hidden state at index `last` [B] of each row. Prefills (any length)
        run eagerly; per-round extensions are static-shape steps (graphed unless `graph` is
        False: already inside a captured round)."""
        if prefill or not self.static:
            logits, h = self.drafter(tokens, self.drafter.project(aux), positions, cache=d_cache, cache_index=positions)
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            return logits[rows, last], h[rows, last]
        step = self._drafter_step(d_cache, self._d_span, self.d_fwd)
        inputs = {"tokens": tokens, "feats": aux if isinstance(aux, Tensor) else torch.cat(aux, -1),
                  "positions": positions, "last": last}
        if not graph:
            return step(**inputs)
        return self.run_step(self.drafter, self._extend_key(self._d_span), step, [d_cache], **inputs)

    def _drafter_step(self, cache: StaticCache, span: int, fwd):
        """The drafter over (token, feature) pairs at slot = position as a static step, attending
        over `span` slots: step(tokens, feats, positions, last) -> its (logits, hidden) at `last`
        [B] of each row (gathered in the step: a graph keeps only those rows)."""
        def step(tokens: Tensor, feats: Tensor, positions: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
            logits, h = fwd(tokens, self.drafter.project(feats), positions, cache=cache, cache_index=positions,
                            attn_mask=slot_mask(positions, span))
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            return logits[rows, last], h[rows, last]
        return step

    def _observe_join(self, seconds: float | None, tokens: int, running: bool) -> None:
        """DecodeSession's; with a policy, a join while rows decode is reported to it too (its
        prefill is part of what decoding costs per token: spec/adaptive.py). One that captured a
        graph is not: charged, it made the arm before it look slow for many rounds (on the H200 at
        batch 4, 5.2 ms of joins per round against 0.3 ms measured without them)."""
        super()._observe_join(seconds, tokens, running)
        if self.policy is not None and running and seconds is not None:
            self.policy.observe_join(seconds)

    def _join(self, rows: list[Request], caches: list[StaticCache | None], tensors: dict[str, Tensor]) -> None:
        super()._join(rows, caches, tensors)
        if self._joining is not None:
            for row, chunk in zip(rows, self._joining, strict=True):
                self._pending[row.request_id] = [chunk]
            self._joining = None

    def _keep(self, keep: list[int]) -> None:
        roster = self.roster
        super()._keep(keep)
        if self._pending and self.roster != roster:  # (every round asks: most keep every row)
            live = {r.request_id for r in self.rows}
            self._pending = {k: v for k, v in self._pending.items() if k in live}

    # ---- deferred drafter work (adaptive sessions) ----------------------------------------
    def _lazy(self, batch: int) -> bool:
        """Whether the drafter's work on new pairs waits (joins' prefills, a full backlog): plain
        decoding is the policy's current choice at this batch size. Graphed sessions too: their
        deferred chunks run through the backlog's extension graph (_prefill_pending), where one
        eager forward of a new width each time took 0.7 s apiece on the H100
        (results/h100_adaptive28.json), and their joins' staged drafter prefill made the adaptive
        arm's joins 17% slower than plain decoding's (SmolLM2 on the H100, 0.192 against 0.164 s,
        results/never_slower_h100_smollm2_41e84fc.json)."""
        return self.policy is not None and self.policy.current.get(pow2_ceil(max(batch, 1)), 0) is None

    def _spill(self) -> None:
        """A full backlog while plain decoding is the choice: its pairs join the rows' deferred
        chunks (one device copy per row per BACKLOG rounds) instead of a drafter forward."""
        st = self.tensors
        used = self._plain_run
        # (one copy of the whole backlog, rows' chunks views of it: two copies a spill, not two a row)
        tokens, feats = st["bk_tokens"][:, :used].clone(), st["bk_feats"][:, :used].clone()
        for i, (row, n, start) in enumerate(zip(self.rows, st["n"].tolist(), st["bk_start"].tolist(), strict=True)):
            if start < used:
                self._pending.setdefault(row.request_id, []).append((tokens[i, start:], feats[i, start:], n - used + start))
        st["bk_start"] = torch.zeros_like(st["bk_start"])
        self._plain_run = 0
        self.spills += 1

    def _spills_full(self) -> bool:
        """Whether some row holds SPILL_LIMIT spilled pairs or more (past its prompt's chunk)."""
        return any(sum(len(c[0]) for c in ch[1:]) >= SPILL_LIMIT for ch in self._pending.values())

    def _prefill_pending(self) -> None:
        """Run the drafter over every row's deferred chunks (rows padded to the longest; padding
        written at slot n, scratch) and take its output at their last pair as the rows' drafter
        state (a backlog catch-up after it replaces that where it has pairs). One eager forward,
        or in static sessions passes of BACKLOG columns through the catch-up's static step (its
        graph: no shape of its own), each pass's output kept for the rows whose last pair it has."""
        st, rows = self.tensors, self.rows
        idx = [i for i, r in enumerate(rows) if r.request_id in self._pending]
        self._pending, chunks = {}, [self._pending[rows[i].request_id] for i in idx]
        if not idx:
            return
        width = max(sum(len(c[0]) for c in ch) for ch in chunks)
        if self.static:
            width = -(-width // BACKLOG) * BACKLOG
        b, n = len(rows), st["n"]
        tokens = torch.zeros(b, width, dtype=torch.long, device=n.device)
        feats = chunks[0][0][1].new_zeros(b, width, chunks[0][0][1].shape[-1])
        positions = n[:, None].repeat(1, width)
        last = torch.zeros_like(n)
        for i, ch in zip(idx, chunks, strict=True):
            k = sum(len(c[0]) for c in ch)
            tokens[i, :k] = torch.cat([c[0] for c in ch])
            feats[i, :k] = torch.cat([c[1] for c in ch])
            positions[i, :k] = torch.cat([torch.arange(p, p + len(t), device=n.device) for t, _, p in ch])
            last[i] = k - 1
        has = torch.zeros(b, dtype=torch.bool, device=n.device)
        has[idx] = True
        if not self.static:
            d_logits, d_hidden = self._extend(self.caches[1], tokens, feats, positions, last, prefill=True)
            st["d_logits"] = torch.where(has[:, None], d_logits, st["d_logits"])
            st["d_hidden"] = torch.where(has[:, None], d_hidden, st["d_hidden"])
            return
        for s in range(0, width, BACKLOG):
            cols = slice(s, s + BACKLOG)
            d_logits, d_hidden = self._extend(self.caches[1], tokens[:, cols], feats[:, cols], positions[:, cols],
                                              (last - s).clamp(0, BACKLOG - 1))
            here = (has & (last >= s) & (last < s + BACKLOG))[:, None]
            st["d_logits"] = torch.where(here, d_logits, st["d_logits"])
            st["d_hidden"] = torch.where(here, d_hidden, st["d_hidden"])

    # ---- one round ----------------------------------------------------------------------
    def _round(self) -> list[Event]:
        if self.policy is None:
            self._set_spans()
            return self._spec_round()[0]
        batch, rows = len(self.rows), self.rows
        draining = self.waiting == 0 and self._plain_drain == (self.roster, pow2_ceil(batch))
        holding, held = self._holding(batch), self._hold[3]
        if draining or (holding and held is None):
            # Plain decoding chosen for rows of this mix, unchanged since: the policy is not asked
            # (its choice and readiness questions took ~90 us a round at batch 64 on the H200
            # host, results/h200_adaptive_overhead_session13.json;
            # on the H100 the adaptive arm's plain rounds took 35-56 us longer than plain
            # decoding's steps, 4-6% of a 0.9 ms step). Draining, the rows' tokens left fall
            # together and no acceptance is observed, so nothing can change the choice until a
            # row joins or leaves. Holding, the round is still timed: the rounds that ask are the
            # first after a change and ran 9% slower on the H100 (a median 1.156 ms against
            # 1.065 ms over all of them), so plain decoding timed on those alone looked slower.
            self._set_spans(plain=True)
            self._drafter_before(None)
            before, start = captures(self.target) if self.graphed else 0, time.perf_counter()
            events = self._plain_round()[0]
            if not draining:  # (a new span's capture is no plain round's cost)
                seconds = time.perf_counter() - start
                self.policy.held(batch, None if self.graphed and captures(self.target) != before else seconds)
            self._observe_finished(rows)
            return events
        classes = self._classes()
        if holding and self.waiting != 0:  # a speculative arm chosen for these rows, unchanged since: unasked
            arm = held
            self.policy.skip(batch)
        else:
            arm = self.policy.choose(batch, ready=self._captured, drain=self._drain())
            self._plain_drain = (self.roster, pow2_ceil(batch)) if self.policy.settled else None
            if arm is None:
                hold = self.policy.plain_hold(batch)
            else:  # (not while the batch drains: which arm finishes first is decided every round)
                hold = self.policy.spec_hold(batch, arm) if self.waiting != 0 else 0
            # A plain hold outlives joins and leaves that keep the rows' sampling classes: with
            # no speculative round since, only plain decoding's own round time has changed, as
            # within a hold (at batch 1 every request's join asked again, a round that cost
            # 2.5x a held one on CPU, host work only)
            self._hold = (classes if arm is None else self.roster, pow2_ceil(batch), self.policy.round + hold, arm)
        shape = (arm, pow2_ceil(batch))  # compiled forwards specialize on the padded batch
        compiling = self.compile and shape not in self._compiled_shapes
        self._compiled_shapes.add(shape)
        if arm is not None:
            self.spec = arm
        self._set_spans(plain=arm is None)
        # The drafter's catch-up over the plain rounds' pairs is the switch's one-off cost,
        # not the arm's: timed with the round, it made every re-measurement after a plain
        # stretch look slow (reference pair on CPU, batch 1: a chain round measured 51 ms
        # after plain rounds, 41 ms after another chain round; 44 and 43 ms with the
        # catch-up outside the clock). Synced so the round's clock is its own. No pair is ever
        # dropped: a full backlog is caught up, or spilled into the rows' deferred chunks while
        # plain decoding is the choice (_drafter_before), and deferred chunks reach the drafter
        # before speculation. A drafter missing older pairs attends over unwritten slots for
        # the rest of the request, and every probe of speculation after a long plain stretch
        # then measured a low τ (on the H200 at batch 1, τ 1.8-2.3 against 3.2-3.9 for the
        # same arms run throughout).
        self._drafter_before(arm)
        before = captures(self.target, self.drafter)
        start = time.perf_counter()
        in_step = self.policy.probing and batch > 1  # (rows of one budget finish together still)
        events, accepted = self._plain_round() if arm is None else self._spec_round(in_step)
        seconds = time.perf_counter() - start  # the round ended in a host sync: its real cost
        captured = captures(self.target, self.drafter) != before
        untimed = compiling or captured  # one-off costs, not the arm's
        if captured and not compiling:
            self.policy.observe_capture(seconds)
        self.policy.observe(arm, batch, None if untimed else seconds, accepted, classes)
        self._observe_finished(rows)
        return events

    def _holding(self, batch: int) -> bool:
        """Whether the arm last chosen (`_hold`) still stands unasked for this round of `batch`
        rows: same batch bucket, within its hold, and the rows unchanged (a plain hold: rows of
        the same sampling classes)."""
        rows_key, bucket_, until, held = self._hold
        return (bucket_ == pow2_ceil(batch) and self.policy.round < until
                and rows_key == (self._row_classes() if held is None else self.roster))

    def _classes(self) -> list:
        """The running rows' sampling classes (spec/adaptive.sampling_class), made when the rows
        change, and handed to the policy as its mix every round (a server's sessions share one
        policy)."""
        classes = self._row_classes()
        self.policy.set_mix(classes)
        return classes

    def _row_classes(self) -> tuple:
        """The running rows' sampling classes, made when the rows change."""
        made, classes = self._mix
        if made != self.roster:
            from draftsman.spec.adaptive import sampling_class

            classes = tuple(sampling_class(r.params.temperature) for r in self.rows)  # (set_mix: unchanged)
            self._mix = (self.roster, classes)
        return classes

    def _observe_finished(self, rows: list[Request]) -> None:
        """The policy's history of finished rows' acceptance (AdaptivePolicy.observe_finished)."""
        for row in rows:
            if row.state.done:
                self.policy.observe_finished(row)

    def _drafter_before(self, arm: SpecConfig | None) -> None:
        """The drafter's work a round of `arm` starts with: before speculation, its deferred
        chunks and backlog; before a plain round with a full backlog, a spill where plain
        decoding is the choice (_lazy), else a catch-up."""
        if self._catch_up_due(arm):
            self._timed_catch_up()
        elif arm is None and self._plain_run >= BACKLOG:
            self._spill()

    def _timed_catch_up(self) -> None:
        """The drafter's deferred chunks (if any) and backlog catch-up, synced, counted and timed
        for reports (catch_ups, catch_up_seconds)."""
        start = time.perf_counter()
        if self._pending:
            self._prefill_pending()
        if self._plain_run > 0:
            self._catch_up()
        sync(self.device)
        self.catch_ups += 1
        self.catch_up_seconds += time.perf_counter() - start

    def _drain(self) -> list[tuple[int, float]] | None:
        """The policy's drain front of the running rows, as (tokens left, relative acceptance),
        when no request waits for a slot and none will come (`waiting` 0); else None."""
        if self.waiting != 0:
            return None
        roster, made, front = self._front
        if roster != self.roster or self.policy.round - made >= DRAIN_REFRESH:
            front = self.policy.drain_front(self.rows)
            self._front = (self.roster, self.policy.round, front)
        return [(r.state.left, rel) for r, rel in front]

    # Graph keys of the static-shape steps, from the spec and spans they run with.
    def _round_key(self, spec: SpecConfig, t_span: int | None, d_span: int | None) -> tuple:
        return ("round", spec, self.drafter, t_span, d_span)

    def _plain_key(self, t_span: int | None) -> tuple:
        return ("plain", self.aux_ids, t_span)

    @staticmethod
    def _extend_key(d_span: int | None) -> tuple:
        return ("extend", d_span)

    def _catch_up_due(self, arm: SpecConfig | None) -> bool:
        """Whether a round of `arm` now starts with the drafter's catch-up (_timed_catch_up):
        before speculation after plain rounds or with deferred chunks, and before a plain round
        when the backlog is full (unless it spills: plain decoding is the choice and no row holds
        SPILL_LIMIT spilled pairs)."""
        if arm is not None:
            return self._plain_run > 0 or bool(self._pending)
        return self._plain_run >= BACKLOG and (not self._lazy(len(self.rows)) or self._spills_full())

    def _captured(self, arm: SpecConfig | None) -> bool:
        """Whether a round of `arm` now would replay CUDA graphs captured before (a capture costs
        several rounds). Known for greedy static rounds; True otherwise (nothing to avoid)."""
        if not (self.graphed and self.static and self.all_greedy):
            return True
        t_span, d_span = self._spans(self.spec if arm is None else arm, plain=arm is None)
        due = self._catch_up_due(arm)
        shape = (arm, t_span, d_span, due, self._ready_context())
        if shape not in self._ready:
            self._ready[shape] = self._ask_captured(arm, t_span, d_span, due)
        return self._ready[shape]

    def _ready_context(self) -> tuple:
        """What _captured's answers share within one choice, made once per policy round (a
        choice asks for every arm): the padded batch and the caches' allocations (graphs are
        captured over their buffers). Answers hold until the graph tables change (a capture,
        which may also evict, or a failed capture): asking again builds keys over every cache
        buffer, and an arm not captured here was asked every round (~0.1 ms a round at batch
        64 on the H200 host)."""
        when, context = self._ready_round
        if when == self.policy.round:
            return context
        made = (captures(self.target, self.drafter), failures(self.target, self.drafter))
        if made != self._ready_captures:
            self._ready, self._ready_captures = {}, made
        context = (pow2_ceil(len(self.rows)),
                   tuple((next(iter(c.buffers.values())).data_ptr(), c.capacity) for c in self.caches))
        self._ready_round = (self.policy.round, context)
        return context

    def _ask_captured(self, arm: SpecConfig | None, t_span: int | None, d_span: int | None, due: bool) -> bool:
        """_captured's question to the graph tables."""
        st = self.tensors
        if due:  # the catch-up forward runs first, with these shapes
            inputs = {"tokens": st["bk_tokens"], "feats": st["bk_feats"], "positions": st["bk_tokens"],
                      "last": st["bk_start"]}
            if not self.captured(self.drafter, self._extend_key(d_span), self.caches[1:], **inputs):
                return False
        if arm is None:
            return self.captured(self.target, self._plain_key(t_span), self.caches[:1],
                                 **{k: st[k] for k in PLAIN_STATE})
        return self.captured(self.target, self._round_key(arm, t_span, d_span), self.caches,
                             **self._round_inputs(False))

    def _spans(self, spec: SpecConfig, plain: bool = False) -> tuple[int | None, int | None]:
        """The slots a round's static-shape steps attend over, target and drafter
        (DecodeSession.span): the verified tree (one node for a plain round) past the target's
        rows; the drafter's scratch, its extension and any catch-up padding past its rows. None
        without static shapes: masks then cover just the slots in use."""
        if not self.static:
            return None, None
        made, memo = self._span_memo  # (a choice asks for every arm, then the round for its own)
        if made != self.roster:
            memo = {}
            self._span_memo = (self.roster, memo)
        longest = self.longest_row()
        if (spec, plain) in memo and longest <= memo[spec, plain][1]:
            return memo[spec, plain][0]
        scratch = (spec.steps - 1) * spec.topk + spec.steps + 1
        needs = ((self.caches[0], 1 if plain else spec.draft_tokens),
                 (self.caches[1], max(scratch, BACKLOG if self.policy is not None else 0)))
        spans = tuple(self.span(cache, extra) for cache, extra in needs)
        # Rows only grow while the roster stands: the spans hold until the longest row outgrows
        # one of them (a span of the whole cache, never)
        limit = min((s - extra for s, (cache, extra) in zip(spans, needs, strict=True) if s < cache.max_len),
                    default=float("inf"))
        memo[spec, plain] = (spans, limit)
        return spans

    def _set_spans(self, plain: bool = False) -> None:
        """This round's spans (_spans of its spec)."""
        self._t_span, self._d_span = self._spans(self.spec, plain)

    def _spec_round(self, in_step: bool = False) -> tuple[list[Event], list[int]]:
        """One speculation round: (events, accepted drafts per row as the policy weighs them).
        in_step (adaptive sessions): every row keeps the batch's shortest accepted path and the
        token after it (AdaptivePolicy.probing); the policy is told what each row accepted."""
        st = self.tensors
        state = self._round_inputs(in_step)
        if self.static and self.all_greedy:
            # Greedy rounds have no host sync and fixed shapes: one graph for the whole round.
            key = self._round_key(self.spec, self._t_span, self._d_span)
            out = self.run_step(self.target, key, self._greedy_round, self.caches, **state)
        else:
            tree = self._draft_tree({k: state[k] for k in ROUND_STATE})
            out = self._verify_and_accept(tree, state["n"], state.get("in_step"))
        accept_len, emitted, *new, full = out
        # Graph outputs live in the table's shared pool, where a graph captured earlier may keep
        # its scratch: state that outlives this round is copied out.
        st["n"], st["root"], st["d_logits"], st["d_hidden"] = (x.clone() for x in new)
        lens, toks = accept_len.tolist(), emitted.tolist()  # the round's host sync
        self._count(lens, self.spec.draft_tokens - 1)
        events = self._emit(range(len(self.rows)), [t[: a + 1] for t, a in zip(toks, lens, strict=True)])
        # What the policy weighs is what rows keep: drafts accepted past a row's budget or stop
        # are not tokens served (short budgets end mid-round for most rows). In step, rows that
        # go on are weighed by what they accepted, as a round out of step would have kept.
        kept = [max(len(e.tokens) - 1, 0) for e in events]
        if in_step:
            kept = [k if e.finish_reason is not None else a for k, a, e in zip(kept, full.tolist(), events, strict=True)]
        return events, kept

    def _round_inputs(self, in_step: bool) -> dict[str, Tensor]:
        """A speculation round's inputs: ROUND_STATE, and in adaptive sessions the rows' in-step
        marks (_commit: each row's index on in-step rounds, else -1), one tensor per batch size
        and value, made once: no launch a round."""
        st = self.tensors
        state = {k: st[k] for k in ROUND_STATE}
        if self.policy is not None:
            key = (len(self.rows), in_step)
            if key not in self._in_step_flags:
                rows = torch.arange(len(self.rows), device=self.device)
                self._in_step_flags[key] = rows if in_step else torch.full_like(rows, -1)
            state["in_step"] = self._in_step_flags[key]
        return state

    def _count(self, lens: list[int], drafted: int) -> None:
        """Per-request statistics of a round: accepted drafts, and `drafted` tokens verified."""
        mean = sum(lens) / len(lens)
        for row, a in zip(self.rows, lens, strict=True):
            row.drafted += drafted
            row.expected += mean
            if len(row.histogram) <= self.max_steps:
                row.histogram += [0] * (self.max_steps + 1 - len(row.histogram))
            row.histogram[a] += 1

    # ---- plain rounds (adaptive speculation turned off) -----------------------------------
    def _plain_round(self) -> tuple[list[Event], list[int]]:
        """One target forward over the root, as plain decoding does; the (token, feature) pair
        it yields goes to the backlog instead of the drafter, so the round costs what a plain
        step costs (the drafter catches up in one forward when speculation resumes). Greedy
        rounds with static shapes run as one graph, as a plain session's step does. The backlog
        stays out of the graph: column `_plain_run` of every row is written in place (two small
        writes), where shifting and returning whole backlogs cost ~10 more launches a round."""
        st = self.tensors
        state = {k: st[k] for k in PLAIN_STATE}
        if self.static and self.all_greedy:
            key = self._plain_key(self._t_span)
            nxt, feats = self.run_step(self.target, key, self._greedy_plain, [self.caches[0]], **state)
        elif self.static:
            # Sampled rows: the forward and its mask in one graph, sampling after it, as a plain
            # session's step runs (the mask built outside the graph and copied into it cost the
            # sampled plain round ~80 us against plain decoding's step on the H100).
            key = ("plain-logits", self.aux_ids, self._t_span)
            logits, feats = self.run_step(self.target, key, self._plain_logits, [self.caches[0]], **state)
            nxt = self.sample_next(logits, st, False)
        else:
            nxt, feats = self._plain_step(**state, sample=lambda logits: self.sample_next(logits, st, self.all_greedy))
        col = self._plain_run
        st["bk_tokens"][:, col] = nxt
        st["bk_feats"][:, col] = feats
        # The root is a graph output (the shared pool's: see _spec_round): the backlog's column
        # holds it outside the pool, so it needs no copy of its own (one launch less a round).
        # The column is rewritten only after a catch-up or spill restarts the backlog, by a
        # plain round, which reads the root before it writes.
        st["n"], st["root"] = st["n"] + 1, st["bk_tokens"][:, col]
        self._plain_run += 1
        for row in self.rows:
            row.plain_rounds += 1
        # Not counted in the requests' acceptance statistics: they describe speculative rounds.
        return self._emit(range(len(self.rows)), [[t] for t in nxt.tolist()]), [0] * len(self.rows)

    def _greedy_plain(self, n: Tensor, root: Tensor) -> tuple[Tensor, Tensor]:
        return self._plain_step(n, root, sample=greedy_argmax, graph=False)

    def _plain_logits(self, n: Tensor, root: Tensor) -> tuple[Tensor, Tensor]:
        return self._plain_step(n, root, sample=lambda logits: logits, graph=False)

    def _plain_step(self, n: Tensor, root: Tensor, sample, graph: bool = True) -> tuple[Tensor, Tensor]:
        """The plain round's device work: (next token [B], its features for the drafter [B, F])."""
        # The root alone, written at slot n, seeing slots 0..n: a decode step's mask, without the
        # tree's ancestor mask (fewer kernels in a round that should cost what a plain step does).
        pos = n[:, None]
        inputs = {"tokens": root[:, None], "positions": pos, "slots": pos,
                  "mask": slot_mask(pos, self._t_span if self._t_span is not None else int(n.max()) + 1)}
        logits, *aux = self._verify(inputs) if graph else self._target_verify(**inputs)
        return sample(logits[:, 0]), torch.cat(aux, -1)[:, 0]

    def _catch_up(self) -> None:
        """Extend the drafter over the backlog's pairs: columns [bk_start, _plain_run) of a row,
        the last at position n-1. Columns outside (rows that joined during the plain stretch,
        and the unused tail) are written past n, into scratch slots drafting overwrites. It runs
        before the backlog overflows (_catch_up_due), so every committed pair reaches the drafter."""
        st = self.tensors
        n, start, used = st["n"], st["bk_start"], self._plain_run
        j = torch.arange(BACKLOG, device=n.device)
        valid = (j[None, :] >= start[:, None]) & (j[None, :] < used)
        positions = torch.where(valid, n[:, None] - used + j, n[:, None] + j)
        d_logits, d_hidden = self._extend(self.caches[1], st["bk_tokens"], st["bk_feats"], positions,
                                          torch.full_like(n, used - 1))
        has = (start < used)[:, None]
        st["d_logits"] = torch.where(has, d_logits, st["d_logits"])
        st["d_hidden"] = torch.where(has, d_hidden, st["d_hidden"])
        st["bk_start"] = torch.zeros_like(start)
        self._plain_run = 0

    def _greedy_round(self, n: Tensor, root: Tensor, d_logits: Tensor, d_hidden: Tensor,
                      in_step: Tensor | None = None) -> tuple[Tensor, ...]:
        tree = self._draft(n, root, d_logits, d_hidden)
        logits, *aux = self._target_verify(**self._verify_inputs(tree, n))
        res = greedy_accept(tree.tokens, tree.parents, logits, max_depth=self.spec.steps)
        return self._commit(res, n, aux, graph=False, in_step=in_step)

    def _draft_tree(self, state: dict[str, Tensor]) -> VerifyTree:
        """The draft phase alone (sampled rounds), graphed when static: it has no host sync."""
        fn = lambda **kw: dataclasses.astuple(self._draft(**kw))  # noqa: E731
        out = self.run_step(self.drafter, ("draft", self.spec, self._d_span), fn, [self.caches[1]], **state)
        return VerifyTree(*(t.clone() for t in out))  # must survive the verify graph's replay

    def _draft(self, n: Tensor, root: Tensor, d_logits: Tensor, d_hidden: Tensor) -> VerifyTree:
        k, steps = self.spec.topk, self.spec.steps
        d_cache = self.caches[1]
        bsz, device = n.shape[0], n.device
        pool = CandidatePool.empty(bsz, steps, k, device)
        scores, ids = F.log_softmax(d_logits.float(), -1).topk(k, dim=-1)
        level = pool.level_slice(1, k)
        pool.tokens[:, level] = self.drafter.draft_to_target(ids)
        pool.scores[:, level] = scores
        f_tokens, f_scores = pool.tokens[:, level], scores
        f_pool = torch.arange(k, device=device).expand(bsz, k)
        f_hidden = d_hidden[:, None].expand(-1, k, -1)
        scratch = (steps - 1) * k
        f_anc = torch.zeros(bsz, k, max(scratch, 1), dtype=torch.bool, device=device)
        eye = torch.eye(k, dtype=torch.bool, device=device)
        for d in range(1, steps):
            own = (d - 1) * k + torch.arange(k, device=device)  # scratch index of each frontier node
            slots = n[:, None] + own
            f_anc = f_anc.clone()
            f_anc[:, :, (d - 1) * k : d * k] |= eye  # each frontier node is its own ancestor
            mask = self._scratch_mask(n, f_anc, scratch, self._d_span)
            positions = (n + d - 1)[:, None].expand(bsz, k)
            logits, h = self.d_fwd(f_tokens, f_hidden, positions, cache=d_cache, cache_index=slots,
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
        return select_tree(pool, root, self.spec.draft_tokens)

    @staticmethod
    def _scratch_mask(n: Tensor, anc: Tensor, scratch: int, span: int | None) -> Tensor:
        """[B, T, S] mask: committed slots [0, n) plus the scratch slots n + j marked in anc.
        S = span for static shapes, else just the slots in use (read from the device)."""
        s = span if span is not None else int(n.max()) + scratch
        slots = torch.arange(s, device=n.device)
        rel = slots[None, :] - n[:, None]  # [B, S] index into the scratch region
        in_scratch = (rel >= 0) & (rel < scratch)
        picked = anc.gather(2, rel.clamp(0, anc.shape[-1] - 1)[:, None, :].expand(-1, anc.shape[1], -1))
        return (rel < 0)[:, None, :] | (in_scratch[:, None, :] & picked)

    def _verify_inputs(self, tree: VerifyTree, n: Tensor) -> dict[str, Tensor]:
        m = tree.tokens.shape[1]
        return {"tokens": tree.tokens, "positions": n[:, None] + tree.depth,
                "slots": n[:, None] + torch.arange(m, device=n.device),
                "mask": self._scratch_mask(n, ancestor_mask(tree.parents), m, self._t_span)}

    def _target_verify(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
        """One target forward over the tree, written at slots n + node: (logits, *aux states)."""
        out = self.t_run(tokens, positions=positions, cache=self.caches[0], cache_index=slots, attn_mask=mask,
                         aux_layer_ids=self.aux_ids)
        return (out.logits, *out.aux_hidden)

    def _verify(self, inputs: dict[str, Tensor]) -> tuple[Tensor, ...]:
        """_target_verify(**inputs), from a CUDA graph when static: (logits, *aux states)."""
        return self.run_step(self.target, ("verify", self.aux_ids), self._target_verify, [self.caches[0]], **inputs)

    def _verify_and_accept(self, tree: VerifyTree, n: Tensor, in_step: Tensor | None = None) -> tuple[Tensor, ...]:
        """Verify and accept with the per-row sampling rules."""
        logits, *aux = self._verify(self._verify_inputs(tree, n))
        if self.all_greedy:
            res = greedy_accept(tree.tokens, tree.parents, logits, max_depth=self.spec.steps)
        else:  # rows at temperature 0 get one-hot probabilities: greedy acceptance for them
            res = sample_accept(tree.tokens, tree.parents, self.warped(logits), generator=self.generator,
                                max_depth=self.spec.steps, max_width=self.spec.topk)
        return self._commit(res, n, aux, graph=True, in_step=in_step)

    def _commit(self, res: AcceptResult, n: Tensor, aux: list[Tensor], graph: bool,
                in_step: Tensor | None = None) -> tuple[Tensor, ...]:
        """Move the accepted path's cache entries next to the prefix, extend the drafter over it;
        (accept_len, emitted tokens, new n, new root, new drafter logits, new drafter hidden,
        the accepted drafts before any in-step cut). Rows flagged in_step keep the batch's
        shortest accepted path and the token after it on theirs: still lossless, since whether
        a row's next token is kept depends only on its tokens so far and on other rows (a
        stopping time), and each token kept was drawn as the target's next token would be (an
        accepted draft, or the one drawn at the first rejection)."""
        full = res.accept_len
        accept_len, bonus = full, res.bonus
        if in_step is not None:
            # in_step[i] is i on in-step rounds, else -1. Rows padded into a graph repeat row 0's
            # value, so only rows whose value is their index are the batch's: padding rows, whose
            # cache rows hold no request, must not set the cut.
            rows = torch.arange(full.shape[0], device=full.device)
            cut = torch.where(in_step == rows, full, torch.iinfo(full.dtype).max).min()
            accept_len = torch.where(in_step >= 0, torch.minimum(full, cut), full)
            bonus = res.accepted_tokens.gather(1, accept_len[:, None])[:, 0]
        t_cache, d_cache = self.caches
        path = res.path  # [B, D+1] node indices from the root, -1 padded
        depth = path.shape[1] - 1
        steps = torch.arange(1, depth + 1, device=n.device)
        dst = n[:, None] + steps
        src = torch.where(path[:, 1:] >= 0, n[:, None] + path[:, 1:], dst)
        t_cache.compact(src, dst)
        feats = torch.cat(aux, -1)
        feats = feats.gather(1, path.clamp(min=0)[..., None].expand(-1, -1, feats.shape[-1]))
        emitted = res.accepted_tokens
        positions = n[:, None] + torch.arange(depth + 1, device=n.device)
        d_logits, d_hidden = self._extend(d_cache, emitted.clamp(min=0), feats, positions, accept_len, graph=graph)
        return accept_len, emitted, n + accept_len + 1, bonus, d_logits, d_hidden, full


class SpecEngine:
    """Speculative generation of a fixed set of prompts (a SpecSession run to completion).

    `spec` pins one speculation shape for every round. Without it (the default) the engine is
    adaptive: an AdaptivePolicy over `candidates` (default DEFAULT_CANDIDATES) runs one of them
    or a plain round each round, whichever its measured round times and acceptance say is
    fastest, so where speculation would lose (sampling with a weak drafter, large batches, slow
    verification) it decodes plainly. The policy lives as long as the engine: what it measured
    carries over from one generate call to the next, as in a server."""

    def __init__(self, target: TargetModel, drafter, spec: SpecConfig | None = None,
                 candidates: Sequence[SpecConfig] | None = None) -> None:
        if spec is not None and candidates is not None:
            raise ValueError("give a SpecConfig (fixed) or candidates (adaptive), not both")
        self.target, self.drafter, self.spec = target, drafter, spec
        self.policy = None
        if spec is None:
            from draftsman.spec.adaptive import DEFAULT_CANDIDATES, AdaptivePolicy

            self.policy = AdaptivePolicy(list(candidates or DEFAULT_CANDIDATES))

    @property
    def shapes(self) -> list[SpecConfig]:
        """The speculation shapes rounds may run."""
        return [self.spec] if self.policy is None else list(self.policy.candidates)

    def describe(self) -> dict:
        """The configuration, for reports: {steps, topk, draft_tokens}, or {"adaptive": [those]}."""
        if self.policy is None:
            return dataclasses.asdict(self.spec)
        return {"adaptive": [dataclasses.asdict(c) for c in self.policy.candidates]}

    def session(self, max_len: int, seed: int | None = None) -> SpecSession:
        return SpecSession(self.target, self.drafter, self.spec, max_len, seed, policy=self.policy)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        rules: StopRules,
        params: SamplingParams = SamplingParams(temperature=0.0),
    ) -> GenerationOutput:
        longest = max(len(p) for p in prompts)
        session = self.session(longest + rules.max_new_tokens, seed=params.seed)
        start = time.perf_counter()
        done = run_to_completion(session, prompts, rules, params)
        elapsed = time.perf_counter() - start
        out = GenerationOutput([r.state.tokens for r in done], [r.state.finish_reason for r in done], elapsed)
        out.stats = request_stats(done, max(c.steps for c in self.shapes)) | {"spec": self.describe()}
        return out


def request_stats(done: Sequence[Request], max_steps: int) -> dict:
    """Acceptance statistics of finished requests, over all of them and per request
    (summarize_histogram's keys), with their speculative and plain rounds."""
    empty = [0] * (max_steps + 1)

    def rounds(rs: Sequence[Request]) -> dict:
        return {"spec_rounds": sum(r.spec_rounds for r in rs), "plain_rounds": sum(r.plain_rounds for r in rs)}

    per_request = [summarize_histogram(r.histogram or empty, 0, drafted=r.drafted) | rounds([r]) for r in done]
    total = [sum(col) for col in zip(*(r.histogram or empty for r in done), strict=True)]
    return summarize_histogram(total, 0, drafted=sum(r.drafted for r in done)) | rounds(done) | {
        "per_request": per_request}
