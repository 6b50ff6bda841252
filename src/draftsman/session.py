"""Decoding sessions: a running batch that requests join and leave between rounds.

A session owns the static caches of its running rows. `add` prefills the newcomers as their own
small batch and appends their cache rows to the running ones; `step` advances every running row
by one round (one target forward: one token for plain decoding, a verified draft tree for
speculation); finished or cancelled rows are dropped from the caches. `generate_plain` and the
speculative engine's `generate` are this loop run to completion; the server interleaves `add`
and `step` (continuous batching).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Hashable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsman.generate import RowState, StopRules, pad_prompts
from draftsman.graphs import (
    Outputs,
    captures,
    compiled,
    graph_table,
    graphs_enabled,
    pow2_ceil,
    signature,
)
from draftsman.joins import JoinCoalescer
from draftsman.kvcache import StaticCache
from draftsman.models.base import TargetModel
from draftsman.models.layers import decode_kernel_serves, slot_mask
from draftsman.sampling import SamplingParams, greedy_argmax, make_generator, sample, warp_probs


@dataclass
class Event:
    """Tokens a request emitted in one round (after stop rules), and whether it ended."""

    request_id: Hashable
    tokens: list[int]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | None (still running)


@dataclass
class Request:
    """One request's inputs and running state; the caller may keep it to read results."""

    request_id: Hashable
    prompt: Sequence[int]
    rules: StopRules
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    state: RowState = field(init=False)
    histogram: list[int] = field(default_factory=list)  # rounds by accepted drafts (speculation)
    drafted: int = 0  # draft tokens verified for this request, over all its rounds
    # What its batch peers accepted in the same rounds, per row (a round's mean): accepted /
    # expected is the request's acceptance relative to its batch's, whatever the arms were.
    expected: float = 0.0
    plain_rounds: int = 0  # rounds that decoded it plainly in a speculative session (adaptive policy)

    def __post_init__(self) -> None:
        self.state = RowState(self.rules)

    @property
    def accepted(self) -> int:
        """Drafts accepted over all its rounds (from `histogram`)."""
        return sum(a * rounds for a, rounds in enumerate(self.histogram))

    @property
    def spec_rounds(self) -> int:
        """Speculative rounds (verify forwards) it took part in (from `histogram`)."""
        return sum(self.histogram)


@contextmanager
def padded(caches: Sequence[StaticCache], rows: int) -> Iterator[None]:
    """Every cache presenting `rows` rows (StaticCache.padded)."""
    with ExitStack() as stack:
        for c in caches:
            stack.enter_context(c.padded(rows))
        yield


def padded_key(kind: Hashable, caches: Sequence[StaticCache], inputs: dict[str, Tensor], rows: int | None = None) -> tuple:
    """A step's graph-table key inside padded(caches, ...): its kind, the inputs' shapes (the
    batch as `rows` if given) and the cache buffers' identities."""
    return (kind, *signature(inputs, [t for c in caches for t in c.buffers.values()], rows=rows))


class DecodeSession(abc.ABC):
    """Shared bookkeeping: rows, per-row sampling tensors, join/leave of cache rows."""

    def __init__(self, target: TargetModel, max_len: int, seed: int | None = None, compile: bool = False) -> None:
        """compile: decode/draft/verify forwards through torch.compile (graphs.compiled): faster
        steps, after a compilation per step shape (seconds on small models, minutes on 8B ones)."""
        self.target = target
        self.compile = compile
        self.t_run = compiled(target, "run") if compile else target.run
        self.max_len = max_len
        self.device = target.embed_tokens.weight.device
        self.generator = make_generator(seed, self.device)
        self.rows: list[Request] = []
        self.caches: list[StaticCache] = []
        self.tensors: dict[str, Tensor] = {}  # per-row device state, dim 0 = row
        # On CUDA every decode/draft/verify forward attends over a span of cache slots sized on
        # the host (`span`: fixed shapes, no device sync) and is replayed from a CUDA graph.
        self.static = self.device.type == "cuda" or compile  # compiled steps need fixed shapes
        self.graphed = graphs_enabled(self.device)
        # Graphed steps whose attention runs the decode kernel read only the slots below each
        # row's limit (layers.attention_limit), so their masks span the whole cache (span): one
        # graph per batch bucket serves a row's whole life, where a span per power of two was
        # captured again (~0.1 s each with the reference pair on the H200) whenever the longest
        # row crossed one, and an adaptive session met new spans in every run.
        self.full_span = self.graphed and decode_kernel_serves(target)
        # Static steps run on batches padded to a power of two (rows copied from row 0 into
        # cache rows past the live ones), so a graph serves every batch size of its bucket.
        self.pad = self.graphed
        # Prefills of newcomers through staging caches, prompts padded to a power of two, as
        # static steps (so graphed): see _staged_prefill. On the H200 with the reference pair a
        # join took 2.5-3.7 ms so against 17-27 ms eager (benchmarks/README.md, section 4).
        self.graph_prefill = self.graphed
        self._staging: dict[str, StaticCache] = {}
        self._stageable: bool | None = None  # whether the target's caches can stage (not a pipeline's)
        # The longest row (prompt + tokens), asked several times a round (spans of each arm the
        # adaptive policy weighs): computed once per change of the rows or their tokens.
        self._changes = 0
        self._longest: tuple[int, int] = (-1, 0)  # (_changes when computed, length)
        # (roster when computed, (all_greedy, *filters)): the running rows' sampling, from their params
        self._sampling_flags: tuple[int, tuple[bool, bool, bool]] = (-1, (True, False, False))
        # Requests the driver holds until a row frees, set before each round by drivers that know
        # every request up front (drive_session, run_to_completion). 0: the running rows are the
        # last, and an adaptive session finishes them as soon as it can rather than at the best
        # rate per row. None: unknown, more may come at any time (a server).
        self.waiting: int | None = None
        self.roster = 0  # changes of the running rows' membership (joins and leaves)
        # When waiting requests join (drivers ask joins.join_now): now, or with more freed slots
        self.joins = JoinCoalescer()

    # ---- public ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.rows)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        need = prompt_len + max_new_tokens
        window = self.target.config.max_position_embeddings
        if need > self.max_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {need} exceeds "
                f"the session's max length {self.max_len}"
            )
        if need > window:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {need} exceeds "
                f"the model's max_position_embeddings={window}"
            )

    @torch.no_grad()
    def add(self, requests: Sequence[Request]) -> list[Event]:
        """Prefill newcomers, emit their first token, and join them to the running batch."""
        if not requests:
            return []
        for r in requests:
            self.check_fits(len(r.prompt), r.rules.max_new_tokens)
        start, began, before = len(self.rows), time.perf_counter(), captures(*self._modules())
        first: list[int] = []
        tokens_in = 0
        for group in prefill_groups([len(r.prompt) for r in requests], self.max_len,
                                    self.target.config.num_attention_heads):
            batch = [requests[i] for i in group]
            ids, lengths = pad_prompts([r.prompt for r in batch], self.device)
            if self._staged_prefill(ids):  # columns to a power of two: few prefill graphs
                ids = F.pad(ids, (0, prefill_columns(ids.shape[1]) - ids.shape[1]))
            caches, tensors, tokens = self._prefill(ids, lengths, self._sampling_tensors([r.params for r in batch]),
                                                    batch)
            self._join(batch, caches, tensors)
            first += tokens.tolist()  # (a host sync: the join's time is its own)
            tokens_in += ids.numel()
        # A join that captured a graph (a staged prefill of a new shape) is a one-off cost: untimed
        captured = captures(*self._modules()) != before
        self._observe_join(None if captured else time.perf_counter() - began, tokens_in, start > 0)
        return self._emit(range(start, len(self.rows)), [[t] for t in first])

    def _observe_join(self, seconds: float | None, tokens: int, running: bool) -> None:
        """A join of `tokens` prompt tokens took `seconds` (None: it captured a graph); `running`:
        rows were decoding when it came."""
        self.joins.observe_join(seconds, tokens)

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One round for every running row."""
        if not self.rows:
            return []
        began, before, rows = time.perf_counter(), captures(*self._modules()), len(self.rows)
        events = self._round()  # (ends in a host sync: the tokens)
        seconds = time.perf_counter() - began if captures(*self._modules()) == before else None
        self.joins.observe_round(seconds, rows - len(self.rows))
        return events

    def _modules(self) -> tuple:
        """The modules whose CUDA graphs this session captures (graphs.captures)."""
        return (self.target,)

    def cancel(self, request_ids: Sequence[Hashable]) -> list[Event]:
        gone = set(request_ids)
        events = [Event(r.request_id, [], "cancelled") for r in self.rows if r.request_id in gone]
        self._keep([i for i, r in enumerate(self.rows) if r.request_id not in gone])
        return events

    # ---- for subclasses ----------------------------------------------------------------
    @abc.abstractmethod
    def _prefill(self, ids: Tensor, lengths: Tensor, sampling: dict[str, Tensor], rows: Sequence[Request]
                 ) -> tuple[list[StaticCache], dict[str, Tensor], Tensor]:
        """Prefill a batch of newcomers (`rows`, whose prompts and sampling the host knows: no
        device reads for them): (their caches, their per-row tensors, first tokens [B]). A
        cache may be None: its rows are written by the session before any is read (_join)."""

    @abc.abstractmethod
    def _round(self) -> list[Event]:
        """Advance every running row by one target forward."""

    def span(self, cache: StaticCache, extra: int) -> int:
        """Cache slots a static-shape step attends over: enough for the longest running row plus
        `extra` slots written past it, rounded up to a power of two (>= 64; a handful of graph
        shapes over a row's life), at most the cache. Known on the host (prompt + emitted
        tokens), so sizing it costs no device sync, and attention reads ~the slots in use rather
        than the whole cache (which at large batch would cost more than the weights). Compiled
        sessions attend over the whole cache: each new span would recompile the forwards; so do
        `full_span` sessions, whose attention reads only the slots in use whatever the span."""
        if self.compile or self.full_span:  # one shape for the whole cache (no new compilation or graph)
            return cache.max_len
        need = self.longest_row() + extra
        return min(cache.max_len, max(SPAN_MIN, pow2_ceil(need)))

    def longest_row(self) -> int:
        """Tokens in the longest running row (prompt + emitted), as of the last change."""
        if self._longest[0] != self._changes:
            self._longest = (self._changes, max((len(r.prompt) + len(r.state.tokens) for r in self.rows), default=0))
        return self._longest[1]

    def run_step(self, module: torch.nn.Module, kind: str, fn, caches: Sequence[StaticCache],
                 **inputs: Tensor) -> Outputs:
        """fn(**inputs), replayed from a CUDA graph captured per (kind, input shapes, caches) when
        the session is graphed. Every input and output has one row per running request (dim 0).
        fn must read nothing else that changes between calls."""
        if not (self.graphed or self.pad) or not all(hasattr(c, "buffers") for c in caches):
            return fn(**inputs)  # eager, also for pipelines over several GPUs (ShardedCache)
        b = next(iter(inputs.values())).shape[0]
        p = pow2_ceil(b)  # batches run padded to a power of two: few graphs
        if p != b:
            inputs = {k: torch.cat([v, v[:1].expand(p - b, *v.shape[1:])]) for k, v in inputs.items()}
        with padded(caches, p):
            if self.graphed:
                out = graph_table(module).run(padded_key(kind, caches, inputs), fn, inputs)
            else:
                out = fn(**inputs)
        if p == b:
            return out
        return tuple(o[:b] for o in out) if isinstance(out, tuple) else out[:b]

    def graph_key(self, kind: Hashable, caches: Sequence[StaticCache], inputs: dict[str, Tensor]) -> tuple:
        """The graph-table key of run_step(kind, caches, **inputs), whose batch it pads to a
        power of two."""
        p = pow2_ceil(next(iter(inputs.values())).shape[0])
        with padded(caches, p):
            return padded_key(kind, caches, inputs, rows=p)

    def captured(self, module: torch.nn.Module, kind: Hashable, caches: Sequence[StaticCache],
                 **inputs: Tensor) -> bool:
        """Whether run_step(module, kind, fn, caches, **inputs) would replay without a capture
        (True when the session is not graphed)."""
        return not self.graphed or graph_table(module).has(self.graph_key(kind, caches, inputs))

    def _sampling_tensors(self, params: Sequence[SamplingParams]) -> dict[str, Tensor]:
        return {
            "temperature": torch.tensor([p.temperature for p in params], device=self.device),
            "top_k": torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float64, device=self.device),
        }

    def _row_flags(self) -> tuple[bool, bool, bool]:
        """(all_greedy, *filters), made when the running rows' membership changes (asked several
        times a round; rows' sampling parameters are fixed at their join)."""
        if self._sampling_flags[0] != self.roster:
            p = [r.params for r in self.rows]
            self._sampling_flags = (self.roster, (all(x.temperature == 0 for x in p), *self.filters_of(p)))
        return self._sampling_flags[1]

    @property
    def all_greedy(self) -> bool:
        """Whether every running row decodes at temperature 0."""
        return self._row_flags()[0]

    @property
    def filters(self) -> tuple[bool, bool]:
        """Whether any running row uses (top-k, top-p). warp_probs sorts the vocabulary for
        either, also when every row's tensor entry is off: 8 ms a step at batch 4 of SmolLM2 on
        CPU, 130 ms for a 17-node tree's verify, so rows without filters skip them."""
        return self._row_flags()[1:]

    def sample_next(self, logits: Tensor, sampling: dict[str, Tensor], greedy: bool,
                    filters: tuple[bool, bool] | None = None) -> Tensor:
        """logits [B, V] -> tokens [B], each row with its own temperature/top-k/top-p. filters:
        as `filters`, for rows not running yet (sample_first); default the running rows'."""
        if greedy:
            return greedy_argmax(logits)
        return sample(self._warp(logits, sampling, filters or self.filters), generator=self.generator)

    def warped(self, logits: Tensor) -> Tensor:
        return self._warp(logits, self.tensors, self.filters)

    @staticmethod
    def _warp(logits: Tensor, sampling: dict[str, Tensor], filters: tuple[bool, bool]) -> Tensor:
        top_k, top_p = filters
        return warp_probs(logits, sampling["temperature"], sampling["top_k"] if top_k else 0,
                          sampling["top_p"] if top_p else 1.0)

    def sample_first(self, logits: Tensor, sampling: dict[str, Tensor], rows: Sequence[Request]) -> Tensor:
        """sample_next for a prefill's newcomers `rows`, whose greedy check and filters come from
        their parameters on the host (read back from the sampling tensors, they were two host
        syncs that made every join wait for its prefill before its next launch)."""
        params = [r.params for r in rows]
        if all(p.temperature == 0 for p in params):
            return greedy_argmax(logits)
        return self.sample_next(logits, sampling, False, self.filters_of(params))

    @staticmethod
    def filters_of(params: Sequence[SamplingParams]) -> tuple[bool, bool]:
        """`filters` of rows with these parameters: whether any uses (top-k, top-p)."""
        return any(p.top_k > 0 for p in params), any(p.top_p < 1 for p in params)

    def _emit(self, row_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[Event]:
        """Apply stop rules to each row's new tokens, report them, drop finished rows."""
        self._changes += 1
        events = []
        for i, toks in zip(row_ids, tokens, strict=True):
            row = self.rows[i]
            kept = row.state.extend(toks)
            events.append(Event(row.request_id, row.state.tokens[len(row.state.tokens) - kept:],
                                row.state.finish_reason))
        self._keep([i for i, r in enumerate(self.rows) if not r.state.done])
        return events

    def _staged_prefill(self, ids: Tensor) -> bool:
        """Whether a prefill of these (unpadded) prompts runs as a static step over staging
        caches: graph_prefill on, static steps, and at most GRAPH_PREFILL_TOKENS padded tokens
        (a graph keeps its outputs, and long prefills are not launch-bound anyway)."""
        cols = prefill_columns(ids.shape[1])
        if not (self.graph_prefill and self.static and cols <= self.max_len
                and pow2_ceil(ids.shape[0]) * cols <= GRAPH_PREFILL_TOKENS):
            return False
        if self._stageable is None:  # a pipeline over several GPUs keeps per-device layers: eager prefills
            self._stageable = hasattr(self.target.new_cache(1, 1), "buffers")
        return self._stageable

    def prefill_slots(self, full: int, columns: int) -> int:
        """Slots of an eager prefill's cache that a running session would allocate `full` slots:
        the prompt's columns plus the cache's scratch past max_len, where the rows then join the
        session's caches (StaticCache.append_rows takes shorter ones; a server's rows have
        thousands of slots, zeroed and copied whole on every join before); `full` for the first
        prefill, whose caches become the session's."""
        if not self.caches or not getattr(self.caches[0], "appends_shorter", False):
            return full
        return min(full, columns + full - self.max_len)

    def staging(self, name: str, new_cache, rows: int) -> StaticCache:
        """The session's staging cache `name` (made by new_cache(rows) once, then reused, so
        graphs captured over it replay), presenting `rows` rows."""
        cache = self._staging.get(name)
        if cache is None:
            cache = self._staging[name] = new_cache(rows)
        cache.use_rows(rows)
        return cache

    def staged_target_prefill(self, cache: StaticCache, aux_layer_ids: Sequence[int] = ()):
        """The target's prefill over `cache` as a static step (explicit positions and causal
        mask: nothing read back to the host): step(ids, last) -> (logits at `last` [B, V],) and,
        with aux_layer_ids, the concatenated features [B, T, F]."""
        def step(ids: Tensor, last: Tensor) -> tuple[Tensor, ...]:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
            out = self.target.run(ids, positions, cache=cache, cache_index=positions,
                                  attn_mask=slot_mask(positions, ids.shape[1]), aux_layer_ids=aux_layer_ids,
                                  logits_index=last)
            return (out.logits[:, 0], torch.cat(out.aux_hidden, -1)) if aux_layer_ids else (out.logits[:, 0],)
        return step

    def _join(self, rows: list[Request], caches: list[StaticCache | None], tensors: dict[str, Tensor]) -> None:
        self._changes += 1
        self.roster += 1
        if not self.caches:
            if any(c is None for c in caches):
                raise ValueError("the first rows to join must bring every cache")
            # A staging cache is reused by the next prefill: the running rows get their own.
            staged = {id(c) for c in self._staging.values()}
            caches = [c.clone_rows() if id(c) in staged else c for c in caches]
            self.rows, self.caches, self.tensors = rows, caches, tensors
            return
        # Rows join the existing caches, even when all earlier rows have left: their
        # allocations (and the CUDA graphs captured over them) are kept.
        self.rows += rows
        for mine, theirs in zip(self.caches, caches, strict=True):
            if theirs is None:  # rows the session writes before any is read: no copy
                mine.use_rows(mine.batch_size + len(rows))
            else:
                mine.append_rows(theirs)
        self.tensors = {k: torch.cat([v, tensors[k]]) for k, v in self.tensors.items()}

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self._changes += 1
        self.roster += 1
        if not keep:  # every row leaves (at batch 1, every request's end): nothing to move
            self.rows = []
            for cache in self.caches:
                cache.drop_rows()
            self.tensors = {k: v[:0] for k, v in self.tensors.items()}
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        used = self.longest_row()  # (of the kept rows: _changes moved above)
        for cache in self.caches:
            # Every slot a row still needs lies below its tokens so far plus the scratch its
            # cache was allocated past max_len for.
            cache.select_rows(idx, slots=used + cache.max_len - self.max_len)
        self.tensors = {k: v[idx] for k, v in self.tensors.items()}


class PlainSession(DecodeSession):
    """Plain autoregressive decoding: one token per row per target forward."""

    def _prefill(self, ids, lengths, sampling, rows):
        last = (lengths - 1)[:, None]
        if self._staged_prefill(ids):
            cache = self.staging("target", lambda b: self.target.new_cache(b, self.max_len), ids.shape[0])
            logits, = self.run_step(self.target, ("prefill",), self.staged_target_prefill(cache), [cache], ids=ids,
                                    last=last)
        else:
            cache = self.target.new_cache(ids.shape[0], self.prefill_slots(self.max_len, ids.shape[1]))
            logits = self.target(ids, cache=cache, logits_index=last)[:, 0]
        first = self.sample_first(logits, sampling, rows)
        return [cache], {"cur": lengths.clone(), "last": first, **sampling}, first

    def _round(self) -> list[Event]:
        t = self.tensors
        logits = self._decode(t["last"][:, None], t["cur"][:, None])[:, 0]
        tok = self.sample_next(logits, t, self.all_greedy)
        t["cur"], t["last"] = t["cur"] + 1, tok
        return self._emit(range(len(self.rows)), [[x] for x in tok.tolist()])  # one host sync

    def _decode(self, tokens: Tensor, positions: Tensor) -> Tensor:
        cache = self.caches[0]
        if not self.static:
            return self.target(tokens, cache=cache, positions=positions)

        span = self.span(cache, 1)

        def step(tokens: Tensor, positions: Tensor) -> Tensor:
            return self.t_run(tokens, cache=cache, positions=positions,
                              attn_mask=slot_mask(positions, span)).logits
        return self.run_step(self.target, ("decode", span), step, [cache], tokens=tokens, positions=positions)


# Smallest attention span of a static-shape step (DecodeSession.span).
SPAN_MIN = 64

# Staged prefills (graph_prefill): prompt columns padded to a power of two, at least this many,
# and at most this many padded tokens (rows x columns) per staged prefill.
PREFILL_MIN_COLUMNS = 16
GRAPH_PREFILL_TOKENS = 4096


def prefill_columns(length: int) -> int:
    """Columns a staged prefill of prompts up to `length` tokens runs with."""
    return max(PREFILL_MIN_COLUMNS, pow2_ceil(length))

# Attention scores one prefill may hold (rows x heads x prompt x slots): large batches of long
# prompts are prefilled in groups, so a kernel that materializes the scores stays within ~1 GB.
PREFILL_SCORES_BUDGET = 1 << 28


def prefill_groups(lengths: Sequence[int], max_len: int, heads: int,
                   budget: int | None = None) -> list[list[int]]:
    """Consecutive groups of request indices whose padded prefill stays within `budget` scores
    (a single request always forms a group, however long)."""
    budget = PREFILL_SCORES_BUDGET if budget is None else budget
    groups: list[list[int]] = []
    group: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if group and (len(group) + 1) * max(longest, n) * max_len * heads > budget:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    return [*groups, group] if group else groups


def run_to_completion(session: DecodeSession, prompts: Sequence[Sequence[int]], rules: StopRules,
                      params: SamplingParams) -> list[Request]:
    """Add every prompt at once and step until all finish; requests in prompt order."""
    requests = [Request(i, p, rules, params) for i, p in enumerate(prompts)]
    session.add(requests)
    session.waiting = 0  # (these rows are the last)
    while session.num_running:
        session.step()
    return requests
