"""When requests waiting for a slot join a running batch: now, or after a few more rounds with
the freed slots together.

A join (prefill of the newcomers, appending their cache rows) costs a fixed part whatever it
holds, launches and host syncs, and a part per prompt token. On a GPU with a small target the
fixed part dominates: on the H100 and the H200 with the reference pair a join of one request
took ~3 ms and one of 16 requests ~9 ms, against a decode step of ~1.2 ms at batch 16. Rows
that finish together join together, but rows of one budget finish apart once a speculative
round has accepted more for some than for others, and then every finishing row paid the fixed
part alone (H200, batch 16, the tree: 27 joins per 64 requests against plain decoding's 4,
0.14 s against 0.04 s, of a 0.34 s run).

Waiting costs too: a round run with f of the batch's B slots empty yields f/B fewer tokens,
f/B x R seconds of a round of R seconds. Another round of waiting pays when the rows it is
expected to free (the running rate of rows leaving per round, r) would each have joined alone:
r x F saved, F the fixed part of a join, against f/B x R lost. So freed slots wait while
r x F > f/B x R, at most `max_wait_rounds` rounds (a newcomer's time to first token). Rows that
finish together (one budget, plain decoding) join at once, as does any join where the slots
are all free. F is fitted online, seconds = F + per-token x prompt tokens over the recent
joins; until their sizes vary enough to tell the parts apart, or where the fit finds no fixed
part, newcomers join at once. (On the CPU with the reference pair the fit gives F ~10-12 ms
against 11-13 ms rounds at batch 4, where rows of 64 tokens leave 4/64 a round: at once.)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class JoinCoalescer:
    """Decides, before each round while requests wait for free slots, whether they join now."""

    max_wait_rounds: int = 8  # the most rounds a free slot waits (bounds added time to first token)
    decay: float = 0.98  # weight of a join in the fit, per join after it
    min_joins: int = 8  # joins seen before the fit is trusted
    alpha: float = 0.05  # weight of one round in the running round time and leave rate
    # Decayed sums of the fit: joins, prompt tokens, seconds, tokens^2, tokens x seconds
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    _joins: int = 0
    round_seconds: float | None = None  # running mean of round time (R)
    leave_rate: float = 0.0  # running mean of rows leaving per round (r)
    _waited: int = 0  # rounds run since newcomers last joined with requests waiting and slots free

    def observe_join(self, seconds: float | None, tokens: int) -> None:
        """A join of `tokens` prompt tokens (padded, as prefilled) took `seconds` (None: not
        representative, e.g. it captured a CUDA graph: a one-off cost)."""
        self._waited = 0
        if seconds is None:
            return
        s, d = self._sums, self.decay
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            s[i] = s[i] * d + v
        self._joins += 1

    def observe_round(self, seconds: float | None, left: int) -> None:
        """A round took `seconds` (None: not representative) and `left` rows finished in it."""
        a = self.alpha
        self.leave_rate = (1 - a) * self.leave_rate + a * left
        if seconds is not None:
            self.round_seconds = seconds if self.round_seconds is None else (1 - a) * self.round_seconds + a * seconds

    def fixed_seconds(self) -> float:
        """The fitted fixed part of a join (0 until the fit can tell, or if it finds none)."""
        n, x, y, xx, xy = self._sums
        if self._joins < self.min_joins or n <= 0:
            return 0.0
        var = xx / n - (x / n) ** 2
        if var <= (0.05 * x / n) ** 2:  # joins of (nearly) one size: the parts cannot be told apart
            return 0.0
        slope = (xy / n - (x / n) * (y / n)) / var
        return min(max(y / n - slope * x / n, 0.0), y / n)

    def join_now(self, free: int, capacity: int) -> bool:
        """Whether requests waiting for `free` of `capacity` slots join before the next round;
        False means one round runs first."""
        if free >= capacity or self.round_seconds is None or self._waited >= self.max_wait_rounds:
            return True
        if self.leave_rate * self.fixed_seconds() <= free / capacity * self.round_seconds:
            return True
        self._waited += 1
        return False
