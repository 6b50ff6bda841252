"""Adaptive speculation: pick the speculation setting for each round, or none, from what rounds
actually cost and yield on this device, so speculation runs only where it wins.

Throughput of an arm at a batch size is τ / round time (τ = tokens per row per round: 1 for plain
decoding, 1 + accepted drafts for a speculation setting). Both are measured online: the session
reports each round's wall time (every round ends in a host sync, so it is the real cost) and
accepted lengths. Round time depends on the batch, so it is kept per batch bucket (powers of
two); τ depends on the text and the drafter, not on the batch, so it is kept per arm, across
buckets, and an arm tried in one bucket needs no new acceptance estimate in the next. Rounds
that captured a CUDA graph (or compiled) report no time: a capture costs several rounds, once
per shape, and would make an arm look slow for long after. Every arm is timed once in a bucket
before the policy trusts it; the best arm is then kept unless another beats it by
`switch_margin`, and now and then the arm timed longest ago is tried again so estimates follow
changes in the text (acceptance) or the load (cost): after `explore_every` rounds, then at
doubling intervals (up to `max_explore_every`) while re-measuring changes no choice, since
where speculation clearly loses every re-measurement is a loss. Shapes matter too: an arm not
yet captured at the current batch bucket and attention span costs a CUDA graph capture (several
rounds), so re-measurements pick only captured arms and a switch to an uncaptured one needs
`capture_margin` (the session says which are captured). For the same reason a bucket's first
rounds time only the arms already captured there: an arm that would capture borrows its rate
from the nearest bucket where it was timed (its round time scaled by plain decoding's between
the two buckets), so a batch draining through smaller buckets (rows finishing at the end of a
burst) does not capture every arm in every bucket on the way down; and an arm that would capture
is chosen only once the batch has stayed in its bucket for `capture_after` rounds, and long
enough that the time the arm would save over as long again pays for the measured cost of a
capture. An arm's running τ follows the text now decoding; once the arm has not run for
`tau_stale_after` rounds its mean over all its rows stands in (a running τ frozen at the low it
was dropped with kept the best arm off for good).

τ depends on how rows sample, too: a drafter's guesses match a greedy row's next token far more
often than a token drawn at T=1. So τ is kept per arm and sampling class (the row's temperature
to one decimal, `sampling_class`), the session tells the policy its rows' classes each round
(`set_mix`), and an arm's expected τ is the mean of its rows' classes' τ. A class an arm has not
run at is measured (one round) rather than guessed from another's, and traffic that changes
temperature back and forth finds each class's τ where it left it.

Rounds are not the whole cost of an arm. Newcomers join the batch between rounds (a prefill):
that work is per request, so per token decoded, whatever arm decoded it. The session reports
each join made while rows were decoding; the bucket's join time per row-token (a long decayed
mean over every round) is added to each arm's time per token, and an arm's rate is
τ / (round time + τ x join time per token). Charging each join to the arm of the round before
it (kept until session 18) was contaminated wherever arms mix: speculation staggers when rows
finish, and the many small joins that follow landed on the plain rounds run between them (on
the H100 at batch 16, plain's join time read 1.0 ms a round against 0.2 ms in a plain run, and
the policy speculated at 0.5x; results/h100_adaptive28.json). What staggering costs beyond the
same requests' prefills falls in plain_margin. And speculation must beat plain decoding by
`plain_margin` (`single_row_margin` for one row, which cannot finish apart from others) before
the policy speculates: costs no estimate sees (the drafter's catch-up after plain stretches,
re-measurements, a batch's slow tail when rows finish apart) fall on speculation.

A choice costs host time (the rates of every arm, graph-readiness questions): the session asks
again only after a few rounds of the same choice with the rows unchanged (plain_hold: up to
hold_rounds; spec_hold: up to spec_hold_rounds while requests wait or may come), each held round
still observed. A one-round measurement (first timing, re-measurement, confidence probe) is
flagged `probing`; at batch > 1 the session runs it in step (every row keeps the batch's
shortest accepted path) so that rows of one budget still finish together.

When no request waits for a slot and none will come (the session's `waiting` is 0: the running
rows are the last of a batch job, as its driver knows; a server, where requests come at any
time, leaves it unknown), what counts is when the last of them finishes, not tokens per row:
under plain decoding rows of one budget finish together, under speculation they finish apart,
and the rows that accept least decode through a tail of rounds that cost nearly what a full
batch's do (on the H200 with the reference pair, 64 MT-bench prompts at batch 64: tree 16 ran
25% more tokens per row per ms than plain decoding at the full batch and finished at 0.95x).
The policy then picks the arm that finishes the slowest row first (`drain_front`): a row's
tokens per round under an arm are 1 + (τ - 1) x its acceptance relative to its batch peers',
and rows with few rounds behind them are presumed as slow as the slowest of that many rows has
been (a low quantile of finished rows' relative acceptance, `low_relative`): at the start of a
wave nothing tells its rows apart, and the wave ends with its slowest row. No joins come while
a batch drains, so their time is left out of the rates compared then.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from draftsman.graphs import pow2_ceil
from draftsman.spec.engine import SpecConfig

if TYPE_CHECKING:
    from draftsman.session import Request

PLAIN = None  # the arm without speculation

# What adaptive speculation chooses among by default, besides plain decoding: the default tree
# (SGLang's 5/4/16), a small tree and a chain of the same depth, the arms of the H200
# batch-scaling runs (benchmarks/h200_batch.py): the large tree wins at batch 1 on a GPU, the
# small ones where verifying 16 nodes costs more than it yields (larger batches, the CPU).
DEFAULT_CANDIDATES = (SpecConfig(), SpecConfig(steps=5, topk=4, draft_tokens=6), SpecConfig.chain(5))


def bucket(batch: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share estimates: the next power of two."""
    return pow2_ceil(batch)


@dataclass
class Estimate:
    """Round time of one arm in one batch bucket (AdaptivePolicy.window)."""

    recent: deque = field(default_factory=deque)  # the last timed rounds' seconds (maxlen: the window)
    rounds: int = 0  # rounds observed, timed or not
    last_seen: int = -1  # policy round counter at the last observation
    untimed: int = 0  # rounds that reported no time (they captured a CUDA graph or compiled)
    total: float = 0.0  # seconds of all timed rounds (reports)
    _median: float | None = None  # of `recent`, when `_fresh`
    _fresh: bool = True

    def add(self, seconds: float) -> None:
        """One timed round (the window's oldest drops out)."""
        self.total += seconds
        self.recent.append(seconds)
        self._fresh = False

    @property
    def seconds(self) -> float | None:
        """Per round: the median of `recent` (None before a timed round). Made when read: held
        plain rounds are observed every round but read only when the policy is next asked."""
        if not self._fresh:
            self._median, self._fresh = statistics.median(self.recent), True
        return self._median


@dataclass
class AdaptivePolicy:
    """Chooses, per round, one of `candidates` or PLAIN (None)."""

    candidates: Sequence[SpecConfig]
    # An arm's round time in a bucket: the median of its last `window` timed rounds. A running
    # mean took host jitter in whole (on the H200, the adaptive arm's plain rounds at batch 64
    # read 2.88 ms against 2.05 ms per plain-session step, and speculation looked ahead there).
    window: int = 15
    # Weight of one row's accepted length in an arm's running τ: a round of B rows weighs
    # 1 - (1 - tau_alpha)^B. Per row, not per round: at batch 1 one round's acceptance is one
    # noisy draw (0..steps), and a per-round mean swung enough to drop the best arm for
    # hundreds of rounds (measured on the H200: adaptive at 0.85x while its arms ran 1.28x).
    # Until an arm has seen 1/tau_alpha rows, τ is their plain mean instead (a round weighs at
    # least B / rows seen): an exponential mean seeded by one lucky first round kept a losing
    # arm chosen for ~20 rounds (seen on CPU, where speculation loses at every batch).
    tau_alpha: float = 0.05
    switch_margin: float = 0.03  # another arm must beat the current one by this fraction
    capture_margin: float = 0.15  # ... this much if it needs a CUDA graph capture and a captured arm does not
    plain_margin: float = 0.1  # speculation must beat plain decoding by this fraction to be chosen
    # ... and by this at batch 1, where what plain_margin stands for (rows finishing apart: a slow
    # tail, staggered joins) cannot happen, and speculation's whole gain may be ~15%: on the H200
    # at batch 1 (GSM8K, T=0) the tree ran 1.19x plain decoding's speed and the adaptive arm
    # 1.09x, left on plain rounds by every dip of τ inside the margin (710 of 1,087 rounds).
    single_row_margin: float = 0.03
    tau_round_cap: float = 0.2  # most weight one round has in τ (at large batch a round has many rows),
    # once τ has seen 1/tau_alpha rows (or one row's weight, if tau_alpha is more)
    # An arm's running τ says what it accepts on the text now decoding; once the arm has not run
    # for tau_stale_after rounds, the text has moved on and its τ is the arm's mean over every
    # row it has run instead (the running τ restarts from that mean when it runs again). Else
    # an arm dropped on a run of bad rounds kept the low τ it was dropped with (nothing updates
    # it while it does not run), and one re-measurement at batch 1 weighs too little to lift
    # it: on the H200 the reference pair's best arm was dropped at a running τ of 2.8 against
    # its 3.9 mean, and the adaptive arm decoded plainly for 14k of 16k rounds (1.0x against 1.46x).
    # 16 rounds, not 64: at batch 1 a dip of one request's acceptance dropped the best arm for
    # 64 rounds each time (with the H200's batch-1 costs, a simulation of 128 GSM8K-like requests
    # gave 1.09x for 64 and 1.11x for 16, single_row_margin 0.03, against the tree's 1.14x run
    # throughout).
    tau_stale_after: int = 16
    # Capture an arm's graphs (choose an arm not captured at this shape while a captured one is
    # available) only after the batch has stayed in its bucket for this many rounds: a batch
    # draining at the end of a burst passes each smaller bucket in a few rounds, too few to pay
    # a capture back (on the H200 at batch 64, captures in buckets 1-16 cost the run 0.37x).
    capture_after: int = 32
    # ... and only once the time the batch has spent in its bucket, times the fraction of it the
    # capturing arm would save, pays for a capture (its measured cost: the capturing rounds'
    # time, a running mean). On the H200 with the reference pair, an adaptive run at batch 16
    # captured 5 graphs in its timed part (new attention spans as rows came and went), ~0.1 s
    # each, and ran at 0.68x of plain where its best arm alone ran at 1.30x.
    capture_alpha: float = 0.3  # weight of one capture in the running mean of capture costs
    capture_seconds: float | None = None  # that mean (None until a capture is reported)
    # The bucket's join time per row-token: joins' seconds over the tokens per row decoded, each
    # round's share decayed by join_decay per round after it (a join is rare and large: a wave
    # of 16 newcomers ~20 ms against 1.3 ms rounds on the H100).
    join_decay: float = 0.995
    # Draining (module docstring): a row's relative acceptance is its own, shrunk towards the
    # presumed low by this many accepted drafts' worth of evidence (a row's first rounds are noisy).
    drain_prior: float = 16.0
    finished: deque = field(default_factory=lambda: deque(maxlen=512))  # finished rows' relative acceptance
    explore_every: int = 64  # rounds between re-measurements of the stalest arm, at first
    # Plain decoding chosen as the bucket's arm, the rows unchanged: the session runs up to this
    # many plain rounds before asking again (plain_hold). Asking costs host time every round (the
    # rates of every arm, graph-readiness questions: ~90 us at batch 64 on the H200 host), which a
    # launch-bound plain step pays in full; while plain rounds run, only plain's own round time
    # changes what choose would answer, and the round that asks again times it.
    hold_rounds: int = 64
    # ... and a speculative arm chosen as the bucket's arm (not a probe), while requests wait or
    # may come (a draining batch decides every round): up to this many rounds unasked
    # (spec_hold), each still observed. Asked every round, the policy cost a tree round 61-110 us
    # of host time on the H100 (choose) besides its observation, 4-9% of the round
    # (results/h100_adaptive_overhead_b{1,4}_f0702a7.json), most of what the T=0 batch-1 goal
    # allows; a hold this short delays a switch by at most 4 rounds.
    spec_hold_rounds: int = 4
    max_explore_every: int = 1024  # ... doubling up to this while they change nothing
    # Confidence probes (batch 1): an arm whose optimistic rate (τ raised, round time lowered, by
    # confidence_z standard errors of what it has measured) beats the best arm's score is run
    # for a round, so a choice never rests on an arm's first few draws. At batch 1 a round's
    # acceptance is one draw (0..steps): on CPU with GSM8K the tree's τ read 2.25 after 4 rounds
    # against its 3.26 over a fixed run, and its median round 35 ms against 30, and the policy
    # decoded 1,004 of 1,005 rounds plainly where the tree ran 1.075x plain decoding
    # (results/never_slower_cpu_reference.json). The bounds shrink as evidence grows, so an arm
    # that loses is soon left alone, and one near a tie (cheap to run) is probed longest. In a
    # simulation of batch-1 requests with the H200's costs (benchmarks/policy_sim.py, 16 seeds)
    # the adaptive arm went from 0.94 to 0.985 of the best fixed arm (10th percentile 0.80 to
    # 0.94); where speculation loses by 8% (CPU, MT-bench) the probes cost 1% (0.992 to 0.982).
    confidence_z: float = 1.0
    # Spread presumed of a row's tokens per round before it is measured (x steps), and how many
    # rows' worth that presumption weighs: a few equal draws must not read as certainty.
    prior_tau_sd: float = 0.35
    prior_rows: float = 2.0
    prior_time_sd: float = 0.2  # relative spread of a round's time, presumed until 3 rounds are timed
    estimates: dict[tuple[int, Hashable], Estimate] = field(default_factory=dict)
    # τ is kept per (arm, sampling class): rows decoding at T=1 accept less than greedy ones, so
    # each class has its own, and a batch expects the mean of its rows' (set_mix).
    taus: dict[tuple, float] = field(default_factory=dict)  # tokens per row per round, per (arm, class)
    tau_rows: dict[tuple, int] = field(default_factory=dict)  # rows behind each τ
    tau_sums: dict[tuple, float] = field(default_factory=dict)  # their tokens (1 + accepted), summed
    tau_seen: dict[tuple, int] = field(default_factory=dict)  # policy round of each τ's last update
    tau_squares: dict[tuple, float] = field(default_factory=dict)  # their tokens' squares, summed (τ's spread)
    mix: dict[Hashable, int] = field(default_factory=lambda: {None: 1})  # running rows per class (set_mix)
    current: dict[int, SpecConfig | None] = field(default_factory=dict)  # chosen arm per bucket
    round: int = 0
    # Whether the last choice was plain decoding for a draining batch: it then holds until a row
    # joins or leaves (the session need not ask each round: see _drain_choice).
    settled: bool = False
    # Whether the last choice was one round of an arm that is not the bucket's choice: a first
    # timing, a re-measurement or a confidence probe. At batch > 1 the session runs such a round
    # in step (every row keeps the batch's shortest accepted path, the policy sees what each
    # accepted), so rows of one budget still finish together: on the H100 one re-measurement
    # round at batch 4 left rows finishing apart, newcomers joining in 46 prefills instead of
    # plain decoding's 16 (0.36 s against 0.11 s), and partial batches capturing new graphs.
    probing: bool = False
    _interval: dict[int, int] = field(default_factory=dict)  # per bucket: rounds between re-measurements
    _next: dict[int, int] = field(default_factory=dict)  # per bucket: round of the next re-measurement
    _probed: dict[int, SpecConfig | None] = field(default_factory=dict)  # choice before a re-measurement
    _last: tuple[int, Hashable] | None = None  # (bucket, arm) of the last round observed
    _joined: float = 0.0  # seconds of joins since that round
    _bucket_joins: dict[int, list[float]] = field(default_factory=dict)  # per bucket: decayed [seconds, row-tokens]
    _bucket: int = 0  # bucket of the last choice ...
    _bucket_rounds: int = 0  # ... and the choices in a row made in it
    _bucket_seconds: float = 0.0  # ... and the seconds of its rounds observed since (captures included)
    # tau(arm) memoized while nothing it reads changes (the round: staleness; the mix; a τ
    # observed): one choice asks it ~8 times per arm, ~40% of choose's host time before.
    _tau_key: tuple = (-1, -1)  # (round, _tau_version) the memo holds for
    _tau_memo: dict = field(default_factory=dict)
    _tau_version: int = 0
    _mix_from: object = None  # the classes tuple the mix was last made from (set_mix)

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("adaptive speculation needs at least one speculation setting")
        self.candidates = list(dict.fromkeys(self.candidates))

    @property
    def arms(self) -> list[SpecConfig | None]:
        return [PLAIN, *self.candidates]

    def estimate(self, arm: SpecConfig | None, batch: int) -> Estimate:
        key = (bucket(batch), arm)
        if key not in self.estimates:
            self.estimates[key] = Estimate(recent=deque(maxlen=self.window))
        return self.estimates[key]

    def rate(self, arm: SpecConfig | None, batch: int) -> float | None:
        """Measured tokens per second per row of `arm` at this batch size (joins included), or
        None."""
        e, tau = self.estimate(arm, batch), self.tau(arm)
        return None if e.seconds is None or tau is None else tau / (e.seconds + self.join_seconds(arm, batch))

    def join_seconds(self, arm: SpecConfig | None, batch: int) -> float:
        """Seconds of joins per round of `arm` at this batch size: the bucket's per row-token,
        times the tokens per row the arm yields (τ)."""
        total, tokens = self._bucket_joins.get(bucket(batch), (0.0, 0.0))
        tau = self.tau(arm)
        return total / tokens * tau if tokens and tau is not None else 0.0

    def _count_round(self, b: int, tokens: float) -> None:
        """A round in bucket b decoded `tokens` per row; the joins since the round before go to
        that round's bucket (join_seconds)."""
        if self._last is not None and self._joined:
            self._bucket_joins.setdefault(self._last[0], [0.0, 0.0])[0] += self._joined
        self._joined = 0.0
        j = self._bucket_joins.setdefault(b, [0.0, 0.0])
        j[0], j[1] = j[0] * self.join_decay, j[1] * self.join_decay + tokens

    def set_mix(self, classes: Sequence[Hashable]) -> None:
        """The running rows' sampling classes (sampling_class: their temperatures), one per row;
        an arm's expected τ is then the mean over the rows of their class's τ. The same tuple
        as last time is the same mix (a session hands one over every round, made per roster)."""
        if isinstance(classes, tuple) and classes is self._mix_from:
            return
        self._mix_from = classes
        self.mix = dict(Counter(classes)) or {None: 1}
        self._tau_version += 1

    def tau(self, arm: SpecConfig | None) -> float | None:
        """Tokens per row per round the arm is expected to yield now for the running rows (their
        classes' τ, tau_stale_after), or None while one of their classes has no τ for it yet (a
        temperature the arm has not run at is measured, not guessed from another's)."""
        if arm is PLAIN:
            return 1.0
        if self._tau_key != (self.round, self._tau_version):
            self._tau_key, self._tau_memo = (self.round, self._tau_version), {}
        memo = self._tau_memo
        if arm not in memo:
            memo[arm] = self._expected_tau(arm)
        return memo[arm]

    def _expected_tau(self, arm: SpecConfig) -> float | None:
        """tau(arm), computed."""
        total = 0.0
        for cls, rows in self.mix.items():
            key = (arm, cls)
            if key not in self.taus:
                return None
            total += rows * (self._mean_tau(key) if self._stale(key) else self.taus[key])
        return total / sum(self.mix.values())

    def _stale(self, key: tuple) -> bool:
        """Whether an (arm, class) running τ is older than tau_stale_after rounds."""
        return self.round - self.tau_seen[key] > self.tau_stale_after

    def _mean_tau(self, key: tuple) -> float:
        """An (arm, class) τ over every row it has run."""
        return self.tau_sums[key] / self.tau_rows[key]

    def _borrowed(self, arm: SpecConfig | None, batch: int, joins: bool = True) -> float | None:
        """The rate of an arm not timed in this bucket, from the nearest bucket where it was (the
        larger on a tie: speculation gains less at larger batches), its round time scaled by plain
        decoding's between the two buckets where plain was timed in both; None if nowhere.
        joins=False: without the joins' time (none come while a batch drains)."""
        b = bucket(batch)
        timed = [k for (k, a), e in self.estimates.items() if a == arm and k != b and e.seconds is not None]
        tau = self.tau(arm)
        if not timed or tau is None:
            return None
        near = min(timed, key=lambda k: (abs(k.bit_length() - b.bit_length()), -k))
        e, scale = self.estimates[(near, arm)], 1.0
        here, there = self.estimates.get((b, PLAIN)), self.estimates.get((near, PLAIN))
        if arm is not PLAIN and here and there and here.seconds and there.seconds:
            scale = here.seconds / there.seconds
        return tau / (e.seconds * scale + (self.join_seconds(arm, near) if joins else 0.0))

    def _drain_rate(self, arm: SpecConfig | None, batch: int) -> float | None:
        """Tokens per second per row of `arm` at this batch size without joins (own or borrowed)."""
        e, tau = self.estimate(arm, batch), self.tau(arm)
        if tau is None:
            return None
        return tau / e.seconds if e.seconds is not None else self._borrowed(arm, batch, joins=False)

    def _tau_upper(self, arm: SpecConfig) -> float | None:
        """τ of a speculative arm raised by confidence_z standard errors of its rows' mean (per
        sampling class, their spread shrunk towards prior_tau_sd x steps by prior_rows rows)."""
        tau = self.tau(arm)
        if tau is None:
            return None
        total = 0.0
        for cls, rows in self.mix.items():
            key = (arm, cls)
            n, mean = self.tau_rows[key], self._mean_tau(key)
            spread = max(self.tau_squares[key] - n * mean * mean, 0.0)
            sd = ((spread + self.prior_rows * (self.prior_tau_sd * arm.steps) ** 2) / (n - 1 + self.prior_rows)) ** 0.5
            total += rows * self.confidence_z * sd / n ** 0.5
        return tau + total / sum(self.mix.values())

    def _seconds_lower(self, e: Estimate) -> float:
        """An arm's round time lowered by confidence_z standard errors of its median (the relative
        spread of its recent rounds, prior_time_sd until 3 are timed; a median's standard error
        is ~1.25 sigma / sqrt(m))."""
        m = len(e.recent)
        rel = self.prior_time_sd
        if m >= 3:
            mad = statistics.median(abs(x - e.seconds) for x in e.recent)
            rel = max(1.4826 * mad / e.seconds, 0.02)
        return e.seconds * max(0.5, 1.0 - self.confidence_z * 1.25 * rel / m ** 0.5)

    def _optimistic(self, batch: int, best: float, is_ready: Callable[[SpecConfig | None], bool]
                    ) -> dict[SpecConfig, float]:
        """The speculative arms whose optimistic score (τ raised, round time lowered, by
        confidence_z standard errors) beats `best` by switch_margin, with that score: arms timed
        in this bucket and ready (a capture costs several rounds). None with confidence_z 0."""
        upper: dict[SpecConfig, float] = {}
        if self.confidence_z <= 0:
            return upper
        for arm in self.candidates:
            e = self.estimate(arm, batch)
            if e.seconds is None:
                continue
            tau = self._tau_upper(arm)
            if tau is None:
                continue
            score = self._score(arm, tau / (self._seconds_lower(e) + self.join_seconds(arm, batch)), batch)
            if score > best * (1 + self.switch_margin) and is_ready(arm):
                upper[arm] = score
        return upper

    def _margin(self, batch: int) -> float:
        """What speculation must beat plain decoding by at this batch size."""
        return self.single_row_margin if batch == 1 else self.plain_margin

    def _score(self, arm: SpecConfig | None, rate: float, batch: int) -> float:
        """What choices compare: the rate, speculation's discounted by the margin (_margin)."""
        return rate if arm is PLAIN else rate / (1 + self._margin(batch))

    def choose(self, batch: int, ready: Callable[[SpecConfig | None], bool] | None = None,
               drain: Sequence[tuple[int, float]] | None = None) -> SpecConfig | None:
        """The arm to run next at this batch size. ready(arm): whether running it now needs no
        CUDA graph capture (a capture costs several rounds, so re-measurements skip arms that
        would capture, and choosing one needs `capture_margin` over the best captured arm);
        None: every arm is ready. drain: when no request waits for a slot, the rows that decide
        when the batch ends, as (tokens left, relative acceptance) (`drain_front`): the arm is
        then the one that finishes them first."""
        self.round += 1
        self.settled = self.probing = False
        b = bucket(batch)
        if b != self._bucket:
            self._bucket_rounds, self._bucket_seconds = 0, 0.0
        self._bucket_rounds += 1
        self._bucket = b
        answers: dict[Hashable, bool] = {}

        def is_ready(arm: SpecConfig | None) -> bool:  # asked once per arm and round (it costs host time)
            if arm not in answers:
                answers[arm] = ready is None or ready(arm)
            return answers[arm]

        rates = {arm: self.rate(arm, batch) for arm in self.arms}
        untried = [arm for arm, r in rates.items() if r is None]
        if drain:  # the batch ends soon: no round spent timing an arm timed elsewhere; borrowed rates
            drain_rates = {arm: self._drain_rate(arm, batch) for arm in self.arms}
            if None not in drain_rates.values():
                return self._drain_choice(b, drain_rates, drain, is_ready)
        if untried:  # time every captured arm in this bucket before choosing; borrow the others' rates
            timeable = [arm for arm in untried if is_ready(arm)]
            if timeable:
                self.probing = True
                return timeable[0]
            rates |= {arm: self._borrowed(arm, batch) for arm in untried}
            untried = [arm for arm in untried if rates[arm] is None]
            if untried:
                self.probing = True
                return untried[0]
        scores = {arm: self._score(arm, r, batch) for arm, r in rates.items()}
        interval = self._interval.setdefault(b, self.explore_every)
        if self.round >= self._next.setdefault(b, self.round + interval):
            self._next[b] = self.round + interval
            stale = sorted(rates, key=lambda arm: self.estimate(arm, batch).last_seen)
            probes = [arm for arm in stale if arm != self.current.get(b) and is_ready(arm)]
            if probes:  # (PLAIN is None: test the list, not the arm)
                self._probed[b] = self.current.get(b)
                self.probing = True
                return probes[0]
        best = max(scores, key=lambda arm: scores[arm])
        top = scores[best]
        if not is_ready(best):
            # A capture costs several rounds: the best captured arm, unless the gain clearly pays
            captured = [arm for arm in scores if is_ready(arm)]
            alt = max(captured, key=lambda arm: scores[arm]) if captured else best
            if (self._bucket_rounds < self.capture_after or scores[best] <= scores[alt] * (1 + self.capture_margin)
                    or not self._capture_pays(scores[best], scores[alt])):
                best = alt
        if b in self.current and is_ready(self.current[b]):
            current = self.current[b]
            if scores[best] > scores[current] * (1 + self.switch_margin):
                current = best
        else:  # the first choice in this bucket, or the current arm needs a capture (a new span)
            current = best
        # A confidence probe: one round, not made the bucket's choice. At batch 1 only: there a
        # round's acceptance is one draw and rows cannot finish apart; at larger batches a round
        # brings as many draws, and a probe round sets rows of one budget apart (on the H100 at
        # batch 16 one probe round left rows joining one by one, each join ~3 ms). The arm of
        # highest optimistic score runs; when that is the choice itself, it runs as the choice
        # (once, a best arm not yet the choice ran as a probe every round and never became it).
        upper = self._optimistic(batch, top, is_ready) if batch == 1 else {}
        if upper and (probe := max(upper, key=lambda arm: upper[arm])) != current:
            self.probing = True
            return probe
        if b in self._probed:  # the first choice after a re-measurement: back off if it changed nothing
            changed = self._probed.pop(b) != current
            self._interval[b] = self.explore_every if changed else min(2 * interval, self.max_explore_every)
            self._next[b] = self.round + self._interval[b]
        self.current[b] = current
        return current

    def plain_hold(self, batch: int) -> int:
        """Rounds after this one for which plain decoding, just chosen as this batch size's
        arm, stands without asking (the rows unchanged): at most hold_rounds, and none past the
        next re-measurement. 0 when the choice was not plain, or was a probe or a first timing
        (their arm is not the bucket's current one)."""
        b = bucket(batch)
        if b not in self.current or self.current[b] is not PLAIN:
            return 0
        return self._hold_for(b, self.hold_rounds)

    def spec_hold(self, batch: int, arm: SpecConfig | None) -> int:
        """Rounds after this one for which `arm`, a speculative arm just chosen as this batch
        size's arm (not a probe), stands without asking (the rows unchanged): at most
        spec_hold_rounds, and none past the next re-measurement; 0 otherwise."""
        b = bucket(batch)
        if arm is PLAIN or self.probing or self.current.get(b) != arm:
            return 0
        return self._hold_for(b, self.spec_hold_rounds)

    def _hold_for(self, b: int, rounds: int) -> int:
        """A hold in bucket b of at most `rounds` rounds after this one, none past its next
        re-measurement."""
        return max(0, min(rounds, self._next.get(b, self.round) - self.round - 1))

    def skip(self, batch: int) -> None:
        """A round the session runs on a held choice (plain_hold, spec_hold) instead of asking:
        counted as a choice made in the bucket (re-measurements and staleness count rounds);
        the session observes it as any other."""
        self.round += 1
        self._bucket_rounds += 1
        self.settled = self.probing = False

    def held(self, batch: int, seconds: float | None) -> None:
        """A plain round the session ran on a held choice (plain_hold) instead of asking, in
        `seconds` (None: not representative, it captured a graph): skip, then observed as any
        plain round."""
        self.skip(batch)
        self.observe(PLAIN, batch, seconds, ())

    def _drain_choice(self, b: int, rates: dict, drain: Sequence[tuple[int, float]],
                      is_ready: Callable[[SpecConfig | None], bool]) -> SpecConfig | None:
        """The captured arm that finishes the deciding rows first (no capture or re-measurement:
        the batch ends soon; rates without joins: none come), speculation's time inflated by
        plain_margin; the current arm stays unless another finishes switch_margin sooner."""
        finish = {}
        for arm, rate in rates.items():
            tau = self.tau(arm)
            if rate is None or tau is None or not is_ready(arm):
                continue
            rounds = max(left / (1.0 + (tau - 1.0) * rel) for left, rel in drain)
            finish[arm] = rounds * tau / rate * (1.0 if arm is PLAIN else 1.0 + self._margin(b))
        if not finish:
            return self.current.get(b, PLAIN)
        best = min(finish, key=lambda arm: finish[arm])
        current = self.current.get(b, best)
        if current in finish and finish[best] * (1 + self.switch_margin) >= finish[current]:
            best = current
        self.current[b] = best
        # Plain rounds add no acceptance evidence and shorten every row's budget alike, which
        # leaves speculation's finish no nearer relative to plain decoding's: settled.
        self.settled = best is PLAIN
        return best

    def low_relative(self, rows: int) -> float:
        """The relative acceptance presumed of rows with no rounds behind them, `rows` of them:
        the 1/(rows + 1) quantile of finished rows' (the slowest of `rows` rows is about that
        slow); 1.0 (the batch's) until 16 rows have finished."""
        if len(self.finished) < 16:
            return 1.0
        ranked = sorted(self.finished)
        return ranked[min(len(ranked) - 1, int(len(ranked) / (max(rows, 1) + 1)))]

    def observe_finished(self, row: Request) -> None:
        """A row left after speculative rounds: its relative acceptance joins `finished`."""
        if row.expected > 0:
            self.finished.append(row.accepted / row.expected)

    def drain_front(self, rows: Sequence[Request]) -> list[tuple[Request, float]]:
        """The rows that decide when a draining batch ends, with their relative acceptance: their
        own evidence shrunk by `drain_prior` towards `low_relative` of the rows with less evidence
        than that (rows that joined lately: the slowest of them decides). Longest budgets first;
        a row kept only if it accepts less than every row with more tokens left (the others
        finish before one of those under any arm)."""
        k = self.drain_prior
        low = self.low_relative(sum(r.expected < k for r in rows))
        ranked = sorted(rows, key=lambda r: -r.state.left)
        front, lowest = [], float("inf")
        for r in ranked:
            rel = (r.accepted + k * low) / (r.expected + k)
            if rel < lowest:
                front.append((r, rel))
                lowest = rel
        return front

    def _capture_pays(self, best: float, alt: float) -> bool:
        """Whether an arm scoring `best`, which needs a capture, pays for it against `alt`: the
        share of time it saves, over as long again as the batch has stayed in its bucket, covers
        the measured capture cost (True while no capture was measured)."""
        if self.capture_seconds is None or best <= 0:
            return True
        return (1 - alt / best) * self._bucket_seconds >= self.capture_seconds

    def observe_capture(self, seconds: float) -> None:
        """A round that captured CUDA graphs took `seconds` (reported besides observe's None)."""
        self._bucket_seconds += seconds
        old = self.capture_seconds
        self.capture_seconds = seconds if old is None else old + self.capture_alpha * (seconds - old)

    def observe(self, arm: SpecConfig | None, batch: int, seconds: float | None, accepted: Sequence[int],
                classes: Sequence[Hashable] | None = None) -> None:
        """One round of `arm` over `batch` rows took `seconds` (None: not representative, e.g. it
        captured a CUDA graph) and accepted `accepted[i]` drafts in row i (all 0 for plain
        rounds); classes[i]: row i's sampling class (None: one class for every row)."""
        self._count_round(bucket(batch), 1.0 + sum(accepted) / len(accepted) if accepted else 1.0)
        self._last = (bucket(batch), arm)
        e = self.estimate(arm, batch)
        e.rounds += 1
        e.untimed += seconds is None
        e.last_seen = self.round
        if arm is not PLAIN and accepted:
            groups: dict[Hashable, list[int]] = {}
            for a, cls in zip(accepted, classes or [None] * len(accepted), strict=True):
                groups.setdefault(cls, []).append(a)
            for cls, acc in groups.items():
                self._observe_tau((arm, cls), acc)
        if seconds is not None:
            self._bucket_seconds += seconds
            e.add(seconds)

    def _observe_tau(self, key: tuple, accepted: Sequence[int]) -> None:
        """A round's accepted drafts of the rows of one class, into that (arm, class) τ."""
        if key in self.taus and self._stale(key):
            self.taus[key] = self._mean_tau(key)  # a stale τ restarts from the mean
        tau, old, rows = 1.0 + sum(accepted) / len(accepted), self.taus.get(key), self.tau_rows.get(key, 0)
        self.tau_sums[key] = self.tau_sums.get(key, 0.0) + len(accepted) + sum(accepted)
        self.tau_squares[key] = self.tau_squares.get(key, 0.0) + sum((1 + a) ** 2 for a in accepted)
        self.tau_seen[key] = self.round
        w = max(len(accepted) / (rows + len(accepted)),
                min(1.0 - (1.0 - self.tau_alpha) ** len(accepted), max(self.tau_round_cap, self.tau_alpha)))
        self.taus[key] = tau if old is None else (1 - w) * old + w * tau
        self.tau_rows[key] = rows + len(accepted)
        self._tau_version += 1

    def observe_join(self, seconds: float) -> None:
        """Newcomers joined the running batch (a prefill) in `seconds`: charged to the batch
        bucket of the round before, per token decoded (see the module docstring)."""
        self._joined += seconds

    def summary(self) -> list[dict]:
        """Per (bucket, arm): round time, τ and tokens per second per row, for reports."""
        out = []
        for (b, arm), e in sorted(self.estimates.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            out.append({"batch_bucket": b, "arm": arm_label(arm), "round_ms": None if e.seconds is None
                        else e.seconds * 1e3, "join_ms_per_round": self.join_seconds(arm, b) * 1e3,
                        "tau": self.tau(arm), "rounds": e.rounds,
                        "untimed_rounds": e.untimed, "timed_s": e.total,
                        "chosen": self.current.get(b, "?") == arm})
        return out


def sampling_class(temperature: float) -> float:
    """The class a row's τ is kept under: its temperature to one decimal (0.0: greedy)."""
    return round(float(temperature), 1)


def arm_label(arm: SpecConfig | None) -> str:
    return "plain" if arm is None else f"s{arm.steps}-k{arm.topk}-n{arm.draft_tokens}"
