"""The server's decoding loop: one background thread owns every decoding session.

HTTP handlers (asyncio) `submit` jobs and `cancel` them. The thread admits queued jobs into the
running batch between rounds (up to `max_batch_size` rows in all), runs one round for every
running row, and pushes each round's `Event`s to the job's asyncio queue. Only this thread touches
a session, so sessions need no locks; the queue of waiting jobs and the set of cancellations are
the only state shared with the event loop, behind one condition variable.

Seeds: a session samples its whole batch from one torch generator, so a sampled request's draws
depend on its batch neighbours. A request with a `seed` and temperature > 0 therefore decodes in
a session of its own, seeded with it: its output is what `draftsman generate --seed S` prints for
the same prompt, whatever else the server is doing. It still advances every loop iteration, next
to the shared batch, only not in the same target forward.

Failures: an exception while admitting a group of newcomers is retried one newcomer at a time, so
only the request that raises fails. An exception inside a round fails the rows of that session
(their caches may be half-written) and the shared session is replaced by a fresh one; requests
in other sessions and later requests are served normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

import torch

from draftsman.serve.metrics import ServeMetrics
from draftsman.session import DecodeSession, Event, Request

logger = logging.getLogger("draftsman.serve")

SessionFactory = Callable[[int | None], DecodeSession]  # seed -> an empty session


class ShuttingDown(RuntimeError):
    """Raised by `submit` once the server has stopped admitting requests."""


class JobFailed(Exception):
    """Delivered to a job's queue instead of an Event when the engine raised serving it."""


@dataclass(eq=False)
class Job:
    """One request in flight: its engine state and the asyncio queue its handler reads."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    own_session: bool = False  # seeded sampling: decoded in a session of its own
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    counted: list[int] = field(default_factory=list)  # histogram already added to the metrics
    counted_drafted: int = 0  # draft tokens already added to the metrics
    counted_plain: int = 0  # plain rounds already added to the metrics

    @property
    def request_id(self) -> Hashable:
        return self.request.request_id

    def push(self, item: Event | JobFailed) -> None:
        """Hand an item to the handler's event loop (called from the scheduler thread)."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def histogram_delta(now: Sequence[int], before: Sequence[int]) -> list[int]:
    return [a - b for a, b in zip_longest(now, before, fillvalue=0)]


class Scheduler:
    """Continuous batching over `DecodeSession`s in a background thread."""

    def __init__(self, new_session: SessionFactory, max_batch_size: int, metrics: ServeMetrics,
                 draft_tokens_per_round: int = 0, join_wait_rounds: int = 8, threads: int | None = None) -> None:
        """join_wait_rounds: the most rounds freed slots wait to be refilled together (the shared
        session's joins.JoinCoalescer decides; 0: waiting requests join at once). threads: the
        intra-op (OpenMP) threads the scheduler thread computes with, set when it starts (None:
        the process's setting); see commands/serve.py for why the loading thread keeps one."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if join_wait_rounds < 0:
            raise ValueError(f"join_wait_rounds must be >= 0, got {join_wait_rounds}")
        self.join_wait_rounds = join_wait_rounds
        self.new_session = new_session
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.draft_tokens_per_round = draft_tokens_per_round  # 0: plain decoding
        self.threads = threads
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancelled: set[Hashable] = set()
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the scheduler thread:
        self._jobs: dict[Hashable, Job] = {}
        self._session_of: dict[Hashable, DecodeSession] = {}
        self._shared = self._new_shared()

    # ---- called from the event loop ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._jobs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="draftsman-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            self._waiting.append(job)
            self.metrics.waiting.labels(self.metrics.model_name).set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request_id: Hashable) -> None:
        """Free a request's slot (a client went away); a no-op once it has finished."""
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify()

    def close(self) -> None:
        """Stop admitting new requests; those already submitted keep running."""
        with self._cond:
            self._closed = True

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel whatever is still queued or running and end the thread."""
        with self._cond:
            self._closed = self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._waiting or self._cancelled
                                    or self._jobs)
                if self._stopping:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                dropped = [j for j in self._waiting if j.request_id in cancelled]
                for job in dropped:
                    self._waiting.remove(job)
                admit = []
                free = self.max_batch_size - len(self._jobs)
                # (freed slots may wait a few rounds to fill together: joins.JoinCoalescer)
                coalesce = (bool(self._waiting) and free > 0 and self._shared.num_running > 0
                            and not self._shared.joins.join_now(free, self.max_batch_size))
                while not coalesce and self._waiting and len(self._jobs) + len(admit) < self.max_batch_size:
                    admit.append(self._waiting.popleft())
            try:
                for job in dropped:
                    job.push(Event(job.request_id, [], "cancelled"))
                self._cancel_running(cancelled)
                self._admit(admit)
                self._step_all()
            except Exception as e:  # a bug in the loop itself: fail what runs, keep serving
                logger.exception("scheduler loop failed")
                self._fail_all(e)
            self._update_gauges()
        self._shutdown()

    def _new_shared(self) -> DecodeSession:
        """The session every unseeded request joins, its join coalescing bounded by join_wait_rounds."""
        session = self.new_session(None)
        session.joins.max_wait_rounds = self.join_wait_rounds
        return session

    def _sessions(self) -> list[DecodeSession]:
        own = {id(s): s for j, s in self._session_of.items() if self._jobs[j].own_session}
        return [self._shared, *own.values()]

    def _cancel_running(self, ids: set[Hashable]) -> None:
        by_session: dict[int, tuple[DecodeSession, list[Hashable]]] = {}
        for rid in ids:
            if rid in self._session_of:
                session = self._session_of[rid]
                by_session.setdefault(id(session), (session, []))[1].append(rid)
        for session, rids in by_session.values():
            self._dispatch(session.cancel(rids))

    def _admit(self, jobs: list[Job]) -> None:
        shared = [j for j in jobs if not j.own_session]
        if shared:
            self._add(self._shared, shared)
        for job in jobs:
            if job.own_session:
                try:
                    session = self.new_session(job.request.params.seed)
                except Exception as e:
                    logger.exception("creating a seeded session failed")
                    job.push(JobFailed(f"{type(e).__name__}: {e}"))
                    continue
                self._add(session, [job])

    def _add(self, session: DecodeSession, jobs: list[Job]) -> None:
        for job in jobs:
            self._jobs[job.request_id] = job
            self._session_of[job.request_id] = session
        try:
            events = session.add([j.request for j in jobs])
        except Exception as e:
            session.cancel([j.request_id for j in jobs])  # rows that joined before the failure
            for job in jobs:
                self._forget(job.request_id)
            if len(jobs) > 1:  # find the culprit: the others are served normally
                for job in jobs:
                    self._add(session, [job])
                return
            logger.exception("admitting request %s failed", jobs[0].request_id)
            jobs[0].push(JobFailed(f"{type(e).__name__}: {e}"))
            return
        self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(
            sum(len(j.request.prompt) for j in jobs))
        self._dispatch(events)

    def _step_all(self) -> None:
        for session in self._sessions():
            if not session.num_running:
                continue
            self.metrics.batch_size.labels(self.metrics.model_name).observe(session.num_running)
            try:
                events = session.step()
            except Exception as e:
                logger.exception("decoding round failed; failing its %d rows", session.num_running)
                self._fail_session(session, e)
                continue
            self._dispatch(events)

    def _fail_session(self, session: DecodeSession, error: Exception) -> None:
        ids = [rid for rid, s in self._session_of.items() if s is session]
        for rid in ids:
            self._jobs[rid].push(JobFailed(f"{type(error).__name__}: {error}"))
            self._forget(rid)
        if session is self._shared:
            self._shared = self._new_shared()  # its caches may be half-written

    def _fail_all(self, error: Exception) -> None:
        for job in list(self._jobs.values()):
            job.push(JobFailed(f"{type(error).__name__}: {error}"))
        self._jobs.clear()
        self._session_of.clear()
        self._shared = self._new_shared()

    def _forget(self, request_id: Hashable) -> None:
        self._jobs.pop(request_id, None)
        self._session_of.pop(request_id, None)

    def _dispatch(self, events: list[Event]) -> None:
        """Record metrics for a round's events and hand them to their handlers."""
        now = time.perf_counter()
        name = self.metrics.model_name
        for ev in events:
            job = self._jobs.get(ev.request_id)
            if job is None:
                continue
            self._count_rounds(job)
            if ev.tokens:
                self.metrics.generation_tokens.labels(name).inc(len(ev.tokens))
                if job.first_token is None:
                    job.first_token = now
                    self.metrics.ttft.labels(name).observe(now - job.submitted)
                else:
                    gap = (now - job.last_token) / len(ev.tokens)
                    for _ in ev.tokens:
                        self.metrics.itl.labels(name).observe(gap)
                job.last_token = now
            if ev.finish_reason is not None:
                self.metrics.e2e.labels(name).observe(now - job.submitted)
                self._forget(ev.request_id)
            job.push(ev)

    def _count_rounds(self, job: Job) -> None:
        r = job.request
        if not self.draft_tokens_per_round or (r.histogram == job.counted and r.plain_rounds == job.counted_plain):
            return
        self.metrics.count_rounds(histogram_delta(r.histogram, job.counted), r.drafted - job.counted_drafted,
                                  r.plain_rounds - job.counted_plain)
        job.counted, job.counted_drafted, job.counted_plain = list(r.histogram), r.drafted, r.plain_rounds

    def _update_gauges(self) -> None:
        name = self.metrics.model_name
        self.metrics.running.labels(name).set(len(self._jobs))
        self.metrics.waiting.labels(name).set(len(self._waiting))

    def _shutdown(self) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            job.push(Event(job.request_id, [], "cancelled"))
        self._cancel_running(set(self._jobs))
        self._update_gauges()
