"""Adaptive speculation: the policy picks the arm with the best measured tokens/s per batch
bucket (or plain decoding), and a session switching between speculation and plain rounds stays
lossless with the drafter caught up after plain stretches."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import Scripted, ScriptedProbing, deferred_vs_eager, mean_accepted

import draftsman
from draftsman.generate import StopRules
from draftsman.reference import TARGET_DIR
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, Request, run_to_completion
from draftsman.spec import engine
from draftsman.spec.adaptive import PLAIN, AdaptivePolicy, bucket
from draftsman.spec.engine import BACKLOG, SpecConfig, SpecSession
from draftsman.tokenizer import encode_prompt, load_tokenizer

CHAIN, TREE = SpecConfig.chain(4), SpecConfig(steps=4, topk=3, draft_tokens=10)


def feed(policy, batch, costs, taus, rounds):
    """Run the policy against fixed per-arm round costs and acceptance; return the arms chosen."""
    chosen = []
    for _ in range(rounds):
        arm = policy.choose(batch)
        chosen.append(arm)
        policy.observe(arm, batch, costs[arm], [taus[arm] - 1] * batch)
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_policy_measures_every_arm_then_keeps_the_fastest():
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000)
    costs = {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}  # tokens/s: 1, 2, 2.5
    chosen = feed(policy, 1, costs, taus, 30)
    assert set(chosen[:3]) == {PLAIN, CHAIN, TREE}  # one timed round each
    # ... the chain probed while its few rounds leave its rate uncertain (confidence_z), then none
    assert chosen.count(CHAIN) <= 3 and chosen[-20:] == [TREE] * 20


def test_policy_flags_its_one_round_measurements_as_probes():
    """First timings and re-measurements are flagged `probing` (the session runs them in step at
    batch > 1); the bucket's own choice is not."""
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=10, max_explore_every=10)
    costs, taus = {PLAIN: 1.0, CHAIN: 3.5, TREE: 6.0}, {PLAIN: 1, CHAIN: 3, TREE: 5}
    flags = []
    for _ in range(25):
        arm = policy.choose(8)
        flags.append((arm, policy.probing))
        policy.observe(arm, 8, costs[arm], [taus[arm] - 1] * 8)
    assert all(probing for _, probing in flags[:3])  # each arm timed once
    assert all(not probing for arm, probing in flags[3:] if arm is PLAIN)  # the choice: plain
    assert [i for i, (arm, probing) in enumerate(flags) if probing and i >= 3]  # re-measurements
    assert all(arm is not PLAIN for arm, probing in flags[3:] if probing)


def test_policy_turns_speculation_off_where_it_loses():
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000)
    costs = {PLAIN: 1.0, CHAIN: 3.5, TREE: 6.0}  # large batch: rounds cost far more than a step
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}
    assert feed(policy, 64, costs, taus, 20)[3:] == [PLAIN] * 17  # (no confidence probes past batch 1)
    # ... per batch bucket: at batch 1 the same policy still speculates
    chosen = feed(policy, 1, {PLAIN: 1.0, CHAIN: 1.2, TREE: 1.6}, taus, 20)
    assert chosen.count(TREE) >= 16 and chosen[-14:] == [TREE] * 14


def test_tau_memo_follows_observations_mixes_and_staleness():
    """tau(arm) is memoized (choose asks it many times a round); every input it reads moves it:
    a round observed, a new mix, the round counter (a running τ goes stale)."""
    policy = AdaptivePolicy([CHAIN], tau_stale_after=2, tau_alpha=0.5)  # (a running τ: half the last row's)
    policy.observe(CHAIN, 1, 1.0, [3], [0.0])
    policy.set_mix((0.0,))
    assert policy.tau(CHAIN) == 4.0
    policy.observe(CHAIN, 1, 1.0, [0], [0.0])  # the same round: the memo must not stand
    assert policy.tau(CHAIN) == pytest.approx(2.5)
    for _ in range(6):
        policy.observe(CHAIN, 1, 1.0, [2], [0.0])
    running = policy.tau(CHAIN)
    policy.round += 3  # stale: the mean over every row instead
    assert policy.tau(CHAIN) == pytest.approx((4 + 1 + 6 * 3) / 8) != running
    policy.set_mix((1.0,))  # a class the arm has not run at
    assert policy.tau(CHAIN) is None
    both = (0.0, 1.0)
    policy.set_mix(both)
    policy.observe(CHAIN, 2, 1.0, [2, 0], list(both))
    assert policy.tau(CHAIN) == pytest.approx((policy.taus[CHAIN, 0.0] + 1.0) / 2)
    policy.set_mix(both)  # the same tuple again: the same mix, nothing made anew
    assert policy.mix == {0.0: 1, 1.0: 1}


def test_tau_is_kept_per_temperature_and_a_batch_expects_its_rows_mean():
    """Greedy rows accept a drafter's guesses far more often than rows sampled at T=1. τ kept per
    sampling class lets the policy speculate for greedy rows and decode plainly for sampled ones
    without re-learning at every change of the traffic; a class it has not seen is measured."""
    policy = AdaptivePolicy([TREE], confidence_z=0, explore_every=1000)
    costs, tau = {PLAIN: 1.0, TREE: 2.0}, {0.0: 5.0, 1.0: 1.2}  # tree tokens/s: 2.5 greedy, 0.6 at T=1

    def run(classes, rounds):
        policy.set_mix(classes)
        chosen = []
        for _ in range(rounds):
            arm = policy.choose(len(classes))
            chosen.append(arm)
            accepted = [0 if arm is PLAIN else tau[c] - 1 for c in classes]
            policy.observe(arm, len(classes), costs[arm], accepted, classes)
        return chosen

    assert run([0.0], 12)[2:] == [TREE] * 10
    at_t1 = run([1.0], 12)
    assert at_t1[0] is TREE and at_t1[1:] == [PLAIN] * 11  # one round learns T=1's τ, then plain
    assert run([0.0], 5) == [TREE] * 5  # greedy again: no re-learning
    assert policy.taus[TREE, 0.0] == pytest.approx(5.0) and policy.taus[TREE, 1.0] == pytest.approx(1.2)
    policy.set_mix([0.0, 1.0])  # one row of each: τ 3.1, 1.55 tokens/s against plain's 1
    assert policy.tau(TREE) == pytest.approx(3.1)
    assert run([0.0, 1.0], 4)[-1] is TREE


def test_a_session_keeps_tau_per_row_temperature(pair):
    """A SpecSession hands the policy each row's sampling class: rows at T=0 and T=1 decoding
    together feed two τ of the same arm."""
    from draftsman.session import Request

    class ChainOnly(AdaptivePolicy):  # timing-free: a loaded CPU may make plain rounds win
        def choose(self, batch, ready=None, drain=None):
            return CHAIN

    target, drafter = pair
    policy = ChainOnly([CHAIN], explore_every=1000)
    session = SpecSession(target, drafter, None, 120, seed=0, policy=policy)
    rules = StopRules(max_new_tokens=30)
    session.add([Request(i, p, rules, SamplingParams(temperature=t, seed=0))
                 for i, (p, t) in enumerate(zip(prompts(), (0.0, 1.0), strict=True))])
    while session.num_running:
        session.step()
    assert {key[1] for key in policy.taus} == {0.0, 1.0}
    assert policy.tau_rows[CHAIN, 0.0] > 3 and policy.tau_rows[CHAIN, 1.0] > 3


def test_noisy_acceptance_at_batch_1_does_not_drop_the_best_arm():
    """At batch 1 a round's acceptance is one draw in 0..steps. With the chain's mean τ 3.2 and a
    round costing 1.65 plain steps, speculation wins unless τ falls under 1.65; the running τ
    must not swing there on runs of bad rounds (as a per-round mean did on the H200, where the
    policy then decoded plainly for hundreds of rounds)."""
    gen = torch.Generator().manual_seed(0)
    policy = AdaptivePolicy([CHAIN])
    draws = torch.multinomial(torch.tensor([0.25, 0.15, 0.1, 0.1, 0.4]), 4000, True, generator=gen).tolist()
    chosen = []
    for accepted in draws:  # mean accepted 2.2: τ 3.2
        arm = policy.choose(1)
        chosen.append(arm)
        policy.observe(arm, 1, 1.0 if arm is PLAIN else 1.65, [] if arm is PLAIN else [accepted])
    assert chosen.count(CHAIN) >= 0.98 * len(chosen)
    assert 2.6 < policy.taus[CHAIN, None] < 3.8


def test_a_lucky_first_round_does_not_keep_a_losing_arm():
    """τ starts as the mean of the rows seen, not an exponential mean seeded by the first
    round: a chain that accepts everything once and 1 draft after (τ 2, below the 3.0 it needs
    against plain steps) is dropped after a few rounds, not ~20."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000)
    chosen, first = [], True
    for _ in range(40):
        arm = policy.choose(1)
        chosen.append(arm)
        accepted = [] if arm is PLAIN else [4 if first else 1]
        first = first and arm is PLAIN
        policy.observe(arm, 1, 1.0 if arm is PLAIN else 3.0, accepted)
    # (4 rounds by the rows' mean; 2 more as confidence probes: 6 rows say little at batch 1)
    assert chosen.count(CHAIN) <= 6 and chosen[-10:] == [PLAIN] * 10
    k = chosen.count(CHAIN)
    assert policy.tau_rows[CHAIN, None] == k and policy.taus[CHAIN, None] == pytest.approx((5 + 2 * (k - 1)) / k)


def _share_of_speculation(confidence_z: float, seed: int, p: float, rounds: int = 3000) -> float:
    """A 5-step tree at batch 1 costing 3 plain steps, each draft accepted with probability p
    (p 0.75: τ 3.29, 1.10x plain decoding; p 0.55: τ 2.1, 0.70x), its first four rows drawn low
    (τ 2.25, as on CPU with GSM8K); the share of rounds the policy speculates."""
    tree = SpecConfig(steps=5, topk=4, draft_tokens=16)
    gen = torch.Generator().manual_seed(seed)
    policy = AdaptivePolicy([tree], confidence_z=confidence_z)
    first, spec = [1, 2, 0, 2], 0
    for _ in range(rounds):
        arm = policy.choose(1)
        if arm is PLAIN:
            policy.observe(arm, 1, 1.0, [])
            continue
        if first:
            accepted = first.pop(0)
        else:
            accepted = 0
            while accepted < tree.steps and torch.rand((), generator=gen).item() < p:
                accepted += 1
        policy.observe(arm, 1, 3.0, [accepted])
        spec += 1
    return spec / rounds


def test_a_few_low_first_draws_do_not_keep_the_best_arm_off_at_batch_1():
    """Confidence probes (AdaptivePolicy.confidence_z): an arm whose few rows leave its rate
    uncertain is run again while its optimistic rate beats the choice. Without them a tree that
    wins by 10% stays off after four low draws, re-measured one round at doubling intervals (on
    CPU: 1 speculative round of 1,005). Seeded: the same draws with and without."""
    seeds = range(6)
    with_probes = [_share_of_speculation(1.0, s, 0.75) for s in seeds]
    without = [_share_of_speculation(0.0, s, 0.75) for s in seeds]
    assert sum(without) / len(without) < 0.1
    assert sum(with_probes) / len(with_probes) > 0.3 and all(w >= o for w, o in zip(with_probes, without, strict=True))
    # ... and a tree that loses (0.70x) is soon left alone
    assert max(_share_of_speculation(1.0, s, 0.55) for s in seeds) < 0.02


def feed_ready(policy, batch, costs, taus, rounds, ready):
    """feed() with the session's readiness answer (arms whose graphs are captured)."""
    chosen = []
    for _ in range(rounds):
        arm = policy.choose(batch, ready=lambda a: a in ready)
        chosen.append(arm)
        policy.observe(arm, batch, costs[arm], [taus[arm] - 1] * batch)
    return chosen


def test_policy_keeps_to_captured_arms_unless_a_capture_clearly_pays():
    """A capture costs several rounds: re-measurements skip arms that would capture, a switch to
    one needs capture_margin, and an arm that is not captured either (a new shape) is no reason
    to stay."""
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}
    policy = AdaptivePolicy([CHAIN, TREE], confidence_z=0, explore_every=4, tau_alpha=1.0, capture_after=0)
    assert feed_ready(policy, 1, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.4}, taus, 3, ready={CHAIN})[0] == CHAIN
    # TREE 4% faster than CHAIN but not captured: stay; re-measure only captured arms (CHAIN only)
    chosen = feed_ready(policy, 1, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.4}, taus, 40, ready={CHAIN})
    assert set(chosen) == {CHAIN}
    # captured now: the usual margin applies
    assert feed_ready(policy, 1, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.4}, taus, 3, ready={CHAIN, TREE})[-1] == TREE
    # the current arm needs a capture too (a new span): take the best
    policy = AdaptivePolicy([CHAIN, TREE], confidence_z=0, explore_every=1000, window=1, tau_alpha=1.0, capture_after=0)
    feed_ready(policy, 1, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.4}, taus, 4, ready={PLAIN, CHAIN, TREE})
    assert policy.current[1] == TREE
    assert policy.choose(1, ready=lambda a: False) == TREE  # nothing captured: no reason to move
    policy.observe(CHAIN, 1, 2.2, [2])  # CHAIN at 1.09x TREE's rate: not worth a capture ...
    assert policy.choose(1, ready=lambda a: a is TREE) == TREE
    policy.observe(CHAIN, 1, 1.0, [4])  # ... at 2.4x it is
    assert policy.choose(1, ready=lambda a: a is TREE) == CHAIN


def test_a_new_bucket_times_captured_arms_and_borrows_the_rest():
    """A batch draining into a smaller bucket (rows finishing at the end of a burst) must not
    capture every arm there just to time it: arms captured in the bucket are timed, the others
    borrow their rate from the nearest timed bucket (scaled by plain decoding's round time
    between the two), and only a clear gain pays a capture."""
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000, window=1, tau_alpha=1.0, plain_margin=0.0, single_row_margin=0.0,
                            capture_after=0)
    feed(policy, 64, {PLAIN: 1.0, CHAIN: 3.6, TREE: 6.0}, taus, 3)  # batch 64: plain wins
    ready = {PLAIN}
    chosen = feed_ready(policy, 32, {PLAIN: 0.8, CHAIN: 2.8, TREE: 4.0}, taus, 20, ready)
    assert chosen == [PLAIN] * 20  # CHAIN at 3/2.88, TREE at 5/4.8 of plain's rate: no capture
    assert policy.estimate(CHAIN, 32).rounds == policy.estimate(TREE, 32).rounds == 0
    assert policy.rate(TREE, 32) is None and policy._borrowed(TREE, 32) == pytest.approx(5 / 4.8)
    # timed at batch 4, where TREE wins 2.5x: at batch 2 its borrowed rate (from 4, the nearest:
    # 5 / (2.0 * 0.9 / 1.0)) is still 2.5x plain's, worth a capture
    feed(policy, 4, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}, taus, 3)
    chosen = feed_ready(policy, 2, {PLAIN: 0.9, CHAIN: 1.4, TREE: 1.8}, taus, 5, ready)
    assert chosen[0] is PLAIN and chosen[1:] == [TREE] * 4 and policy.estimate(CHAIN, 2).rounds == 0
    # a fresh policy with nothing captured still times every arm (nothing to borrow from)
    fresh = AdaptivePolicy([CHAIN, TREE], explore_every=1000)
    assert set(feed_ready(fresh, 8, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}, taus, 3, set())) == {PLAIN, CHAIN, TREE}
    assert fresh.summary()[0]["untimed_rounds"] == 0


def test_captures_wait_until_the_batch_stays_in_its_bucket():
    """A batch passing through a bucket (rows finishing at the end of a burst) does not stay long
    enough to pay a capture back: an arm that would capture is chosen only after capture_after
    rounds in the bucket, though it is 2.5x faster."""
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000, window=1, tau_alpha=1.0, capture_after=8)
    feed(policy, 4, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}, taus, 3)
    chosen = feed_ready(policy, 2, {PLAIN: 0.9, CHAIN: 1.4, TREE: 1.8}, taus, 12, ready={PLAIN})
    assert chosen[:7] == [PLAIN] * 7 and chosen[7:] == [TREE] * 5
    chosen = feed_ready(policy, 1, {PLAIN: 0.8, CHAIN: 1.4, TREE: 1.8}, taus, 3, ready={PLAIN})
    assert chosen == [PLAIN] * 3  # a new bucket: the count starts again


def test_a_capture_waits_until_the_time_in_the_bucket_would_pay_for_it():
    """Once a capture's cost is measured, an arm that would capture is chosen only when the share
    of time it saves, over as long again as the batch has stayed in its bucket, covers that cost:
    TREE's score at batch 2 is 2.27x plain's (its rate borrowed from batch 4, less plain_margin):
    it saves 56% of the time, a capture costs 3 s, so it waits for 5.4 s of plain rounds (0.9 s
    each: 6 rounds) and not for capture_after (1 round)."""
    taus = {PLAIN: 1, CHAIN: 3, TREE: 5}
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000, window=1, tau_alpha=1.0, capture_after=1)
    feed(policy, 4, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}, taus, 3)
    policy.observe_capture(3.0)
    assert policy.capture_seconds == 3.0
    chosen = feed_ready(policy, 2, {PLAIN: 0.9, CHAIN: 1.4, TREE: 1.8}, taus, 9, ready={PLAIN})
    assert chosen[:6] == [PLAIN] * 6 and chosen[6:] == [TREE] * 3
    # a new bucket: its time starts again from nothing
    chosen = feed_ready(policy, 1, {PLAIN: 0.8, CHAIN: 1.4, TREE: 1.8}, taus, 3, ready={PLAIN})
    assert chosen == [PLAIN] * 3


def test_a_dropped_arm_s_tau_goes_back_to_its_mean_once_stale():
    """An arm dropped on a run of bad rounds keeps the running τ it was dropped with, since
    nothing updates it while it does not run; after tau_stale_after rounds the policy trusts the
    arm's mean over all its rows instead, and takes it up again where that wins."""
    policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=10_000, window=1, tau_alpha=0.05, tau_stale_after=50)
    chosen = []
    for i in range(400):
        arm = policy.choose(1)
        chosen.append(arm)
        bad = 100 <= i < 130  # a hard stretch of text: nothing accepted
        policy.observe(arm, 1, 1.0 if arm is PLAIN else 2.0, [] if arm is PLAIN else [0 if bad else 3])
    drop = chosen.index(PLAIN, 2)  # the chain (τ 4 at 2 units: 2 tokens per unit) dropped in the hard stretch
    assert 100 < drop < 130 and policy.tau(CHAIN) > 3.5
    back = chosen.index(CHAIN, drop)
    assert back - drop <= 52 and chosen[-100:] == [CHAIN] * 100  # taken up again once stale, and kept
    assert policy.tau_sums[CHAIN, None] / policy.tau_rows[CHAIN, None] == pytest.approx(
        (4 * (policy.tau_rows[CHAIN, None] - 30) + 30) / policy.tau_rows[CHAIN, None], rel=0.05)


def test_one_slow_round_does_not_flip_the_choice():
    """Round times are medians of the last rounds: a host hiccup (one plain round 10x slower)
    must not make speculation that loses look like it wins."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, tau_alpha=1.0, plain_margin=0.0, single_row_margin=0.0)
    feed(policy, 64, {PLAIN: 1.0, CHAIN: 3.3}, {PLAIN: 1, CHAIN: 3}, 10)
    assert policy.current[64] is PLAIN
    policy.observe(PLAIN, 64, 10.0, [0] * 64)  # the hiccup
    assert feed(policy, 64, {PLAIN: 1.0, CHAIN: 3.3}, {PLAIN: 1, CHAIN: 3}, 10) == [PLAIN] * 10
    assert policy.estimate(PLAIN, 64).seconds == 1.0


def test_policy_asks_readiness_once_per_arm_and_round():
    """The session's readiness answer costs host time (graph keys): one question per arm at most."""
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=3)
    asked: list = []
    for _ in range(30):
        before = len(asked)
        arm = policy.choose(4, ready=lambda a: asked.append(a) or a is not TREE)
        assert len(asked) - before == len(set(asked[before:]))
        policy.observe(arm, 4, {PLAIN: 1.0, CHAIN: 1.5, TREE: 2.0}[arm], [2] * 4)


def test_untimed_rounds_count_acceptance_not_cost():
    """Rounds that captured a CUDA graph report no time: a capture must not make an arm look slow."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, window=1, tau_alpha=1.0)
    feed(policy, 1, {PLAIN: 1.0, CHAIN: 1.0}, {PLAIN: 1, CHAIN: 3}, 4)
    policy.observe(CHAIN, 1, None, [4])  # a capture round: acceptance counts, its 'cost' does not
    assert policy.estimate(CHAIN, 1).seconds == 1.0 and policy.taus[CHAIN, None] == 5.0
    assert policy.choose(1) == CHAIN


def test_acceptance_carries_across_batch_buckets():
    """τ is a property of the text and drafter, one estimate per arm: acceptance seen at batch 16
    moves the choice at batch 1, while round times stay per bucket."""
    policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=1000, window=1, tau_alpha=1.0)
    feed(policy, 1, {PLAIN: 1.0, CHAIN: 1.2}, {PLAIN: 1, CHAIN: 3}, 3)
    assert policy.choose(1) == CHAIN and policy.rate(CHAIN, 16) is None  # not timed at 16 yet
    policy.observe(CHAIN, 16, 5.0, [0] * 16)  # the text turned hard: nothing accepted
    assert policy.taus[CHAIN, None] == 1.0 and policy.estimate(CHAIN, 1).seconds == 1.2
    assert policy.choose(1) == PLAIN


def test_re_measurements_back_off_while_they_change_nothing():
    """Where speculation clearly loses, re-measuring it every explore_every rounds would cost
    throughput forever: the interval doubles (to max_explore_every) while choices hold, and a
    re-measurement that changes the choice is acted on."""
    policy = AdaptivePolicy([CHAIN], explore_every=4, max_explore_every=64, window=1, tau_alpha=1.0)
    losing = feed(policy, 1, {PLAIN: 1.0, CHAIN: 4.0}, {PLAIN: 1, CHAIN: 2}, 200)
    assert 4 <= losing.count(CHAIN) <= 9  # 1 + re-measurements at 4, 8, 16, 32, 64, 64 rounds
    winning = feed(policy, 1, {PLAIN: 1.0, CHAIN: 0.5}, {PLAIN: 1, CHAIN: 2}, 80)
    first = winning.index(CHAIN)  # found at the next re-measurement (<= 64 rounds away) ...
    assert first <= 64 and winning[first:].count(PLAIN) <= 3  # ... and kept (plain re-measured rarely)


def test_policy_needs_a_margin_to_switch_and_re_measures_stale_arms():
    policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=10, window=1, tau_alpha=1.0, plain_margin=0.0, single_row_margin=0.0)
    feed(policy, 1, {PLAIN: 1.0, CHAIN: 1.0}, {PLAIN: 1, CHAIN: 2}, 6)
    assert policy.current[1] == CHAIN
    # plain now 2% faster than the chain: within the margin, no switch (except explorations)
    chosen = feed(policy, 1, {PLAIN: 1.0, CHAIN: 2.04}, {PLAIN: 1, CHAIN: 2}, 20)
    assert chosen.count(CHAIN) >= 17 and PLAIN in chosen  # PLAIN only as the stalest arm
    chosen = feed(policy, 1, {PLAIN: 1.0, CHAIN: 4.0}, {PLAIN: 1, CHAIN: 2}, 20)
    assert chosen[-5:] == [PLAIN] * 5


def test_speculation_must_beat_plain_by_the_plain_margin():
    """Rates within plain_margin of plain decoding keep plain rounds (costs no estimate sees fall
    on speculation); a clear win still speculates."""
    taus = {PLAIN: 1, CHAIN: 3}
    policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=1000, window=1, tau_alpha=1.0, tau_round_cap=1.0)
    assert feed(policy, 64, {PLAIN: 1.0, CHAIN: 2.85}, taus, 10)[2:] == [PLAIN] * 8  # 5% faster
    policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=1000, window=1, tau_alpha=1.0, tau_round_cap=1.0)
    assert feed(policy, 64, {PLAIN: 1.0, CHAIN: 2.5}, taus, 10)[2:] == [CHAIN] * 8  # 20% faster


def test_one_row_needs_only_the_single_row_margin():
    """One row cannot finish apart from others (what plain_margin stands for): at batch 1
    speculation 5% ahead is taken, at batch 2 it is not."""
    taus = {PLAIN: 1, CHAIN: 3}
    for batch, expected in ((1, CHAIN), (2, PLAIN)):
        policy = AdaptivePolicy([CHAIN], confidence_z=0, explore_every=1000, window=1, tau_alpha=1.0, tau_round_cap=1.0)
        assert feed(policy, batch, {PLAIN: 1.0, CHAIN: 2.85}, taus, 10)[2:] == [expected] * 8


def test_joins_cost_per_token_decoded_whatever_the_arm():
    """A join prefills requests, work per request and so per token decoded, whatever arm decoded
    it: the bucket's join seconds per row-token, times an arm's τ, is its join time per round.
    (Charged to the arm of the round before, the many small joins speculation's staggered
    finishes bring landed on plain rounds run between them.)"""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, window=1, tau_alpha=1.0, join_decay=1.0,
                            plain_margin=0.0, single_row_margin=0.0)
    assert feed(policy, 16, {PLAIN: 1.0, CHAIN: 2.0}, {PLAIN: 1, CHAIN: 3}, 3) == [PLAIN, CHAIN, CHAIN]
    policy.observe_join(7.0)  # 7 s of joins after rounds that decoded 1 + 3 + 3 tokens per row ...
    policy.observe(CHAIN, 16, 2.0, [2] * 16)  # ... and 3 more: 0.7 s per token
    assert policy.join_seconds(PLAIN, 16) == pytest.approx(0.7)
    assert policy.join_seconds(CHAIN, 16) == pytest.approx(2.1)
    assert policy.rate(CHAIN, 16) == pytest.approx(3 / 4.1) and policy.rate(PLAIN, 16) == pytest.approx(1 / 1.7)
    assert policy.summary()[1]["join_ms_per_round"] == pytest.approx(2100.0)


def test_join_time_is_a_long_mean():
    """A join is rare and large (a wave of newcomers after rows that finished together): the
    join time per token is a long decayed mean, not swung by each join."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, window=1, tau_alpha=1.0)
    for i in range(320):  # plain: a 32 s join every 32 rounds (1 s a round on average)
        policy.observe(PLAIN, 16, 1.0, [0] * 16)
        if i % 32 == 31:
            policy.observe_join(32.0)
            policy.observe(PLAIN, 16, 1.0, [0] * 16)
            assert 0.8 < policy.join_seconds(PLAIN, 16) < 1.25  # (right after a join: no swing)
    assert 0.85 < policy.join_seconds(PLAIN, 16) < 1.15  # (a mean per round of 0.05 weight: 1.6 or more)
    policy.observe(CHAIN, 16, 2.0, [2] * 16)
    assert policy.join_seconds(CHAIN, 16) == pytest.approx(3 * policy.join_seconds(PLAIN, 16))


def test_held_plain_rounds_are_observed():
    """Rounds run on a held plain choice (plain_hold) are timed (the rounds that ask are the
    first after a change, slower than the rest) and decode a token per row each: a join during
    a hold is spread over them too."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, join_decay=1.0)
    policy.choose(16)
    policy.observe(PLAIN, 16, 2.0, [0] * 16)
    for _ in range(15):
        policy.held(16, 1.0)
    policy.observe_join(16.0)
    policy.held(16, 1.0)
    assert policy.join_seconds(PLAIN, 16) == pytest.approx(16 / 17)  # 16 s over 17 plain rounds
    assert policy.estimate(PLAIN, 16).seconds == 1.0  # held rounds are timed too (a median)
    assert policy.round == 17


def test_a_chosen_speculative_arm_holds_a_few_rounds_but_not_a_probe():
    """spec_hold: the bucket's speculative choice stands unasked for up to spec_hold_rounds
    rounds, never past the next re-measurement; probes and plain decoding get none."""
    policy = AdaptivePolicy([CHAIN], explore_every=1000, confidence_z=0)
    costs, taus = {PLAIN: 1.0, CHAIN: 1.5}, {PLAIN: 1, CHAIN: 4}
    arm = policy.choose(4)
    assert policy.probing and policy.spec_hold(4, arm) == 0  # a first timing
    feed(policy, 4, costs, taus, 4)
    arm = policy.choose(4)
    assert arm == CHAIN and not policy.probing and policy.spec_hold(4, arm) == policy.spec_hold_rounds
    assert policy.spec_hold(4, PLAIN) == 0
    policy._next[4] = policy.round + 2  # a re-measurement two rounds on
    assert policy.spec_hold(4, arm) == 1
    before = policy.round
    policy.skip(4)
    assert policy.round == before + 1 and not policy.probing


def test_the_best_arm_becomes_the_batch_1_choice_rather_than_a_probe():
    """At batch 1 a confidence probe runs an arm that might beat the best; the best arm itself
    is the choice (it was once probed every round and never made current)."""
    policy = AdaptivePolicy([TREE], explore_every=1000)
    feed(policy, 1, {PLAIN: 1.0, TREE: 1.5}, {PLAIN: 1, TREE: 5}, 2)  # one timing each
    assert policy.choose(1) == TREE and not policy.probing and policy.current[1] == TREE


def test_sessions_hold_a_speculative_choice_and_stay_lossless(pair):
    """A session whose policy speculates asks it about one round in spec_hold_rounds + 1 (each
    held round still observed), decodes what plain decoding does, and asks every round while
    its batch drains (waiting 0: which arm finishes first is decided each round)."""
    target, drafter = pair
    rules, greedy = StopRules(max_new_tokens=60), SamplingParams(temperature=0.0)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 200), prompts(), rules, greedy)]

    def run(waiting):
        """(choices asked, rounds run)"""
        policy = AdaptivePolicy([CHAIN], explore_every=1000, plain_margin=-0.9, single_row_margin=-0.9)
        asked, observed = [], []
        choose, observe = policy.choose, policy.observe
        policy.choose = lambda *a, **k: asked.append(1) or choose(*a, **k)
        policy.observe = lambda arm, *a, **k: observed.append(arm) or observe(arm, *a, **k)
        session = SpecSession(target, drafter, None, 200, policy=policy)
        session.waiting = waiting
        reqs = [Request(i, p, rules, greedy) for i, p in enumerate(prompts())]
        session.add(reqs)
        steps = 0
        while session.rows:
            session.step()
            steps += 1
        assert [r.state.tokens for r in reqs] == plain
        assert len(observed) == steps and observed.count(CHAIN) > steps - 3  # (speculation is the choice)
        return len(asked), steps

    asked, steps = run(None)
    assert asked <= steps / (AdaptivePolicy.spec_hold_rounds + 1) + 4  # (first timings; a new bucket)
    asked, steps = run(0)
    assert asked == steps  # draining: asked every round


def test_one_large_round_does_not_swing_tau():
    """At batch 64 a round holds 64 rows: its weight in τ is capped (tau_round_cap), so one
    round's acceptance moves τ by at most that share once the estimate is warm."""
    policy = AdaptivePolicy([CHAIN], tau_alpha=0.05)
    for _ in range(20):
        policy.observe(CHAIN, 64, 1.0, [3] * 64)  # τ 4 from 1280 rows
    policy.observe(CHAIN, 64, 1.0, [0] * 64)  # a bad round: without the cap, 96% of the new τ
    assert policy.taus[CHAIN, None] == pytest.approx(4 - 0.2 * 3)


@pytest.fixture(scope="module")
def pair():
    target, drafter = draftsman.reference_pair()
    t = draftsman.load_target(target)
    return t, draftsman.load_drafter(drafter, target=t)


def prompts():
    tok = load_tokenizer(TARGET_DIR)
    return [encode_prompt(tok, t, chat=True) for t in ("Write a haiku about rain.", "What is 7 times 8?")]


@pytest.mark.parametrize("static", [False, True])
def test_switching_session_is_lossless_and_the_drafter_catches_up(pair, static):
    target, drafter = pair
    rules = StopRules(max_new_tokens=200)
    greedy = SamplingParams(temperature=0.0)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 260), prompts(), rules, greedy)]
    # chain, a short plain stretch, chain, a stretch longer than the backlog, chain
    schedule = [CHAIN] * 3 + [None] * 5 + [CHAIN] * 4 + [None] * (BACKLOG + 6) + [CHAIN] * 8
    policy = Scripted(schedule)
    session = SpecSession(target, drafter, None, 260, policy=policy)
    session.static = static
    done = run_to_completion(session, prompts(), rules, greedy)
    assert [r.state.tokens for r in done] == plain
    assert [arm for arm, _ in policy.log[:len(schedule)]] == schedule
    assert all(a == [0, 0] for arm, a in policy.log if arm is None)
    # Right after catching up on the short stretch, the chain accepts about what a chain that was
    # never interrupted accepts over the same rounds (a stale drafter would accept ~nothing).
    always = Scripted([CHAIN])
    run_to_completion(SpecSession(target, drafter, None, 260, policy=always), prompts(), rules, greedy)
    assert mean_accepted(always.log, range(3, 12)) > 1.5
    assert mean_accepted(policy.log, range(8, 12)) > 0.6 * mean_accepted(always.log, range(3, 12))


@pytest.mark.parametrize("static", [False, True])
def test_probe_rounds_run_in_step_and_stay_lossless(pair, static):
    """Probe rounds at batch > 1 (AdaptivePolicy.probing) keep every row to the batch's shortest
    accepted path: rows of one budget emit alike and finish in the same round, greedy outputs
    are plain decoding's, and the policy is told what each row accepted, not the cut."""
    target, drafter = pair
    rules = StopRules(max_new_tokens=48)
    greedy = SamplingParams(temperature=0.0)
    texts = [*prompts(), encode_prompt(load_tokenizer(TARGET_DIR), "Name three colours.", chat=True)]
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 160), texts, rules, greedy)]
    policy = ScriptedProbing([CHAIN, None, TREE, CHAIN, None, None, TREE])
    session = SpecSession(target, drafter, None, 160, policy=policy)
    session.static = session.pad = static  # (static: 3 rows padded to 4, as graphed rounds run)
    reqs = [Request(i, p, rules, greedy) for i, p in enumerate(texts)]
    session.add(reqs)
    rounds = []
    while session.rows:
        rounds.append([len(e.tokens) for e in session.step()])
    assert [r.state.tokens for r in reqs] == plain
    assert all(len(set(r)) == 1 for r in rounds)  # every row emitted alike, every round
    assert len(rounds[-1]) == len(texts)  # ... so all finished together
    spec = [acc for arm, acc in policy.log if arm is not None]
    assert any(len(set(acc)) > 1 for acc in spec)  # rows accepted differently: the cut was made
    emitted = [r[0] - 1 for r in rounds]  # drafts kept per round (the same for every row)
    assert all(min(acc) == emitted[i] for i, (arm, acc) in enumerate(policy.log) if arm is not None
               and i < len(rounds) - 1)  # (the last round stops at the budget)


@pytest.mark.parametrize("static", [False, True])
def test_deferred_drafter_work_reaches_the_drafter_before_speculation(pair, static):
    """With plain decoding the choice, joins skip the drafter's prefill and a full backlog is
    spilled rather than run; when speculation resumes the drafter runs over all of it first: its
    cache then holds what it holds with nothing deferred, and the chain accepts as much."""
    deferred_vs_eager(*pair, prompts(), device="cpu", static=static)


@pytest.mark.parametrize("static", [False, True])
def test_rows_holding_the_spill_limit_catch_up_instead_of_spilling(pair, static, monkeypatch):
    """Deferred pairs are memory: once a row holds SPILL_LIMIT spilled pairs, the next full
    backlog runs the drafter over everything deferred (one spill here, then a catch-up), and
    the drafter still ends as one that never deferred."""
    monkeypatch.setattr(engine, "SPILL_LIMIT", BACKLOG)
    deferred_vs_eager(*pair, prompts(), device="cpu", static=static, stretch=2 * BACKLOG + 10, spills=1)


@pytest.mark.parametrize("static", [False, True])
def test_a_row_deferred_just_before_speculation_drafts_from_its_prompt(pair, static):
    """A newcomer joins (its drafter prefill deferred) right before a speculative round: with no
    plain-round pairs of its own, its drafter state is the deferred chunks' output at its
    prompt's last pair, so its drafts are accepted as in a session that never defers."""
    from helpers import ScriptedCurrent

    first, second = prompts()
    rules, greedy = StopRules(max_new_tokens=24), SamplingParams(temperature=0.0)
    schedule = [PLAIN] * 3 + [CHAIN] * 6
    logs, tokens = {}, {}
    for policy in (Scripted(schedule), ScriptedCurrent(schedule)):
        session = SpecSession(pair[0], pair[1], None, 96, policy=policy)
        session.static = static
        requests = [Request(0, first, rules, greedy), Request(1, second, rules, greedy)]
        session.add(requests[:1])
        for _ in range(3):
            session.step()
        session.add(requests[1:])
        session.waiting = 0
        while session.num_running:
            session.step()
        name = type(policy).__name__
        logs[name], tokens[name] = policy.log, [r.state.tokens for r in requests]
        assert session.deferred_prefills == (1 if name == "ScriptedCurrent" else 0)
    assert tokens["Scripted"] == tokens["ScriptedCurrent"]
    chain_rounds = [x for arm, x in logs["Scripted"] if arm is not None]
    assert chain_rounds[0][1] >= 2  # (the newcomer's first drafts: accepted when its state is right)
    assert [x for arm, x in logs["ScriptedCurrent"] if arm is not None] == chain_rounds


def test_adaptive_session_with_the_real_policy_matches_plain(pair):
    target, drafter = pair
    rules = StopRules(max_new_tokens=60)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 100), prompts(), rules,
                                                        SamplingParams(temperature=0.0))]
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=8)
    done = run_to_completion(SpecSession(target, drafter, None, 100, policy=policy), prompts(), rules,
                             SamplingParams(temperature=0.0))
    assert [r.state.tokens for r in done] == plain
    arms = {row["arm"] for row in policy.summary() if row["rounds"]}
    assert arms == {"plain", "s4-k1-n5", "s4-k3-n10"}


def test_sampled_switching_session_runs_to_the_budget(pair):
    target, drafter = pair
    schedule = [TREE] * 2 + [None] * 4 + [CHAIN] * 3 + [None] * 3 + [TREE] * 4
    session = SpecSession(target, drafter, None, 80, seed=1, policy=Scripted(schedule))
    done = run_to_completion(session, prompts(), StopRules(max_new_tokens=40), SamplingParams(temperature=1.0, seed=1))
    assert all(len(r.state.tokens) == 40 and all(0 <= t < 8192 for t in r.state.tokens) for r in done)


def test_session_knows_which_graphs_a_round_would_capture(pair, monkeypatch):
    """What SpecSession._captured asks the graph tables for is what the round then runs: the
    plain round's key, or the speculation round's (after the catch-up's, following plain rounds;
    it stops at the first key not captured). Checked on CPU with the tables recording keys and
    running steps eagerly."""
    from draftsman.graphs import GraphTable
    from draftsman.session import Request

    used, asked = [], []

    def run(self, key, fn, inputs):  # every key "captures" (has() says none is captured)
        used.append(key)
        self.captures += 1
        return fn(**inputs)
    monkeypatch.setattr(GraphTable, "run", run)
    monkeypatch.setattr(GraphTable, "has", lambda self, key: asked.append(key) or False)
    target, drafter = pair
    schedule = [CHAIN, CHAIN, None, None, CHAIN, None, CHAIN]
    session = SpecSession(target, drafter, None, 260, policy=Scripted(schedule))
    session.static = session.pad = session.graphed = True
    session.add([Request(i, p, StopRules(max_new_tokens=40)) for i, p in enumerate(prompts())])
    caught_up = []
    for arm in schedule:
        used.clear(), asked.clear()
        assert session._captured(arm) is False
        session.step()
        # the keys asked for (up to the first not captured) are the ones the round then ran
        assert asked and asked == used[: len(asked)], arm
        kinds = [key[0][0] for key in used]  # key = (kind, input shapes, cache identities)
        assert kinds == ["plain"] if arm is None else kinds in (["round"], ["extend", "round"]), kinds
        caught_up.append(kinds[0] == "extend")
    assert caught_up == [False, False, False, False, True, False, True]  # after each plain stretch


def test_session_remembers_captured_shapes_until_the_tables_capture(pair, monkeypatch):
    """_captured asks the graph tables once per shape while they capture nothing new, whatever
    they answered; after a capture (which may evict a graph) or a failed one, the next choice
    (policy round) asks again."""
    from draftsman.graphs import GraphTable
    from draftsman.session import Request

    asked, captured = [], {"answer": True}
    monkeypatch.setattr(GraphTable, "has", lambda self, key: asked.append(key) or captured["answer"])
    target, drafter = pair
    session = SpecSession(target, drafter, None, 120, policy=Scripted([CHAIN]))
    session.static = session.pad = session.graphed = True
    session.add([Request(0, prompts()[0], StopRules(max_new_tokens=40))])
    assert session._captured(CHAIN) and session._captured(None)
    n = len(asked)
    assert session._captured(CHAIN) and session._captured(None) and len(asked) == n  # remembered
    from draftsman.graphs import graph_table
    graph_table(target).captures += 1  # the tables captured a graph
    try:
        assert session._captured(CHAIN) and len(asked) == n  # (within one choice: its answers stand)
        session.policy.round += 1  # the next choice
        assert session._captured(CHAIN) and len(asked) > n
    finally:
        graph_table(target).captures -= 1
    # "not captured" is remembered too: an arm not captured here was asked about every round
    captured["answer"] = False
    graph_table(drafter).failed["x"] = "a failed capture"  # (also a change of the tables)
    session.policy.round += 1
    try:
        assert not session._captured(CHAIN)
        n = len(asked)
        assert not session._captured(CHAIN) and len(asked) == n
    finally:
        del graph_table(drafter).failed["x"]
    session.policy.round += 1
    assert not session._captured(CHAIN) and len(asked) > n  # (the tables changed again)


def test_the_drafter_catch_up_is_not_timed_as_the_arm_s_round(pair, monkeypatch):
    """The catch-up after plain rounds is a switch's one-off cost: a re-measurement that counted it
    would make speculation look slower than it runs, and keep it off where it wins."""
    import time

    from draftsman.session import Request

    target, drafter = pair
    policy = Scripted([None] * 3 + [CHAIN] * 2)
    session = SpecSession(target, drafter, None, 120, policy=policy)
    seconds = []
    policy.observe = lambda arm, batch, s, accepted, classes=None: seconds.append((arm, s))
    catch_up = session._catch_up

    def slow_catch_up():
        time.sleep(0.5)
        catch_up()

    monkeypatch.setattr(session, "_catch_up", slow_catch_up)
    session.add([Request(0, prompts()[0], StopRules(max_new_tokens=50), SamplingParams(temperature=0.0))])
    for _ in range(5):
        session.step()
    assert [arm for arm, _ in seconds] == [None] * 3 + [CHAIN] * 2
    first_spec = seconds[3][1]
    assert first_spec is not None and first_spec < 0.5  # timed, and without the catch-up


def test_session_reports_joins_made_while_rows_decode(pair):
    """A prefill of newcomers into a running batch is part of the cost of the arm before it; the
    first join (nothing decoding yet) and empty adds are not."""
    from draftsman.session import Request

    target, drafter = pair
    policy = Scripted([CHAIN] * 4)
    joins = []
    policy.observe_join = joins.append
    session = SpecSession(target, drafter, None, 120, policy=policy)
    rules = StopRules(max_new_tokens=30)
    session.add([Request(0, prompts()[0], rules)])
    session.step()
    session.add([])
    assert joins == []
    session.add([Request(1, prompts()[1], rules)])
    assert len(joins) == 1 and joins[0] > 0
    # a join that captured a graph (a staged prefill of a new shape) is a one-off cost: not charged
    from draftsman.graphs import graph_table

    session.step()
    prefill = session._prefill

    def capturing_prefill(*args):
        graph_table(target).captures += 1  # as a staged prefill of a new shape does
        return prefill(*args)

    session._prefill = capturing_prefill
    try:
        session.add([Request(2, prompts()[0], rules)])
    finally:
        graph_table(target).captures -= 1
    assert len(joins) == 1


def test_session_wants_a_spec_or_a_policy(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="AdaptivePolicy"):
        SpecSession(target, drafter, None, 50)


@pytest.mark.parametrize("plain_rounds", [5, BACKLOG + 30])
def test_catch_up_leaves_the_drafter_as_a_fresh_prefill_would(pair, plain_rounds):
    """After plain rounds, the drafter's state (its output at position n-1) equals what a drafter
    prefilled over the whole committed text computes: the backlog pairs went in, in place, also
    after a plain stretch longer than the backlog (it is flushed when full, none dropped)."""
    from draftsman.session import Request

    target, drafter = pair
    prompt = prompts()[0]
    session = SpecSession(target, drafter, None, 260, policy=Scripted([CHAIN] * 3 + [None] * plain_rounds))
    req = Request(0, prompt, StopRules(max_new_tokens=200), SamplingParams(temperature=0.0))
    session.add([req])
    for _ in range(3 + plain_rounds):
        session.step()
    stale = session.tensors["d_logits"].clone()
    session._catch_up()
    *committed, root = prompt + req.state.tokens
    fresh = SpecSession(target, drafter, CHAIN, 260)
    fresh.add([Request(1, committed, StopRules(max_new_tokens=5), SamplingParams(temperature=0.0))])
    assert fresh.rows[0].state.tokens == [root]
    torch.testing.assert_close(session.tensors["d_logits"], fresh.tensors["d_logits"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(stale, fresh.tensors["d_logits"], atol=1e-2)


def test_catch_up_covers_rows_that_joined_during_the_plain_stretch(pair):
    """A row joining after some plain rounds holds fewer backlog pairs than the rows before it
    (its own start column): after the catch-up, every row's drafter state is a fresh prefill's."""
    from draftsman.session import Request

    target, drafter = pair
    first, second = prompts()
    session = SpecSession(target, drafter, None, 260, policy=Scripted([CHAIN] * 2 + [None] * 40))
    reqs = [Request(0, first, StopRules(max_new_tokens=200), SamplingParams(temperature=0.0)),
            Request(1, second, StopRules(max_new_tokens=200), SamplingParams(temperature=0.0))]
    session.add(reqs[:1])
    for _ in range(2 + 7):  # two chain rounds, then 7 plain rounds before the newcomer
        session.step()
    session.add(reqs[1:])
    for _ in range(5):  # 5 more plain rounds: the newcomer has 5 pairs, the first row 12
        session.step()
    assert session.tensors["bk_start"].tolist() == [0, 7] and session._plain_run == 12
    with torch.no_grad():  # (as in a round: the caches' views were made without grad)
        session._catch_up()
    for i, req in enumerate(reqs):
        *committed, root = req.prompt + req.state.tokens
        fresh = SpecSession(target, drafter, CHAIN, 260)
        fresh.add([Request(9, committed, StopRules(max_new_tokens=5), SamplingParams(temperature=0.0))])
        assert fresh.rows[0].state.tokens == [root]
        torch.testing.assert_close(session.tensors["d_logits"][i], fresh.tensors["d_logits"][0], rtol=1e-4,
                                   atol=1e-4)


def vocab8_target(tmp_path_factory):
    """A 4-layer Llama with a vocabulary of 8 and a peaked (not degenerate) distribution."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)
    path = tmp_path_factory.mktemp("vocab8")
    hf.save_pretrained(path)
    return draftsman.load_target(path)


def assert_tokens_2_3_follow_the_target(target, prompt, done) -> None:
    """The joint law of generated tokens 2 and 3 over `done` (requests from `prompt`, sampled at
    T=1) equals the target's, computed exactly (chi-square, sparse bins pooled)."""
    import math

    from test_engine import _chi2_critical

    from draftsman.sampling import warp_probs

    n = len(done)
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt]))[0, -1], 1.0, 0, 1.0)  # [8]
        two = torch.tensor([[*prompt, a] for a in range(8)])
        p2 = warp_probs(target(two)[:, -1], 1.0, 0, 1.0)  # [8 (t1), 8 (t2)]
        three = torch.tensor([[*prompt, a, b] for a in range(8) for b in range(8)])
        p3 = warp_probs(target(three)[:, -1], 1.0, 0, 1.0).view(8, 8, 8)  # [t1, t2, t3]
    expected = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten() * n  # law of (t2, t3)
    pairs = torch.tensor([r.state.tokens[1:3] for r in done])
    observed = torch.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64).double()
    keep = expected > 5
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    rest_o, rest_e = observed[~keep].sum(), expected[~keep].sum()
    assert rest_o <= rest_e + 5 * math.sqrt(rest_e + 1) + 5
    assert stat < _chi2_critical(int(keep.sum()) - 1), (stat, int(keep.sum()))


@pytest.mark.parametrize("schedule", [[None, TREE], [TREE, None, CHAIN]], ids=["plain-then-tree", "tree-plain-chain"])
def test_switching_samples_from_the_target_distribution(tmp_path_factory, schedule):
    """Vocabulary of 8, 4000 rows: with rounds switching between plain steps and speculation,
    the joint law of generated tokens 2 and 3 equals the target's (chi-square), as it must for
    lossless sampling."""
    from test_engine import BigramDrafter

    target = vocab8_target(tmp_path_factory)
    prompt, n = [1, 5, 3], 4000
    policy = Scripted(schedule)
    policy.candidates = [CHAIN, TREE]
    session = SpecSession(target, BigramDrafter(target), None, 16, seed=0, policy=policy)
    done = run_to_completion(session, [prompt] * n, StopRules(max_new_tokens=3), SamplingParams(temperature=1.0, seed=0))
    assert_tokens_2_3_follow_the_target(target, prompt, done)
    assert sum(r.accepted for r in done) > 0  # speculation accepted drafts


def test_in_step_probe_rounds_sample_from_the_target_distribution(tmp_path_factory):
    """Probe rounds run in step (every row keeps the batch's shortest accepted path): in batches
    of 4, where the cut falls at every depth, the joint law of generated tokens 2 and 3 is still
    the target's (chi-square)."""
    from test_engine import BigramDrafter

    target = vocab8_target(tmp_path_factory)
    prompt, n, batch = [1, 5, 3], 4000, 4
    policy = ScriptedProbing([CHAIN])
    policy.candidates = [CHAIN]
    session = SpecSession(target, BigramDrafter(target), None, 16, seed=0, policy=policy)
    rules, params = StopRules(max_new_tokens=3), SamplingParams(temperature=1.0, seed=0)
    done = []
    for g in range(n // batch):
        reqs = [Request(g * batch + i, prompt, rules, params) for i in range(batch)]
        session.add(reqs)
        while session.rows:
            session.step()
        done += reqs
    assert_tokens_2_3_follow_the_target(target, prompt, done)
    cut = [min(acc) for arm, acc in policy.log if arm is not None]
    assert sum(c > 0 for c in cut) > 100 and sum(c == 0 for c in cut) > 100  # the cut fell at depth 0 and past it
    assert any(len(set(acc)) > 1 for arm, acc in policy.log)  # ... with rows that had accepted more


def test_masks_see_no_slot_past_the_attention_limit(pair, monkeypatch):
    """The models' contract behind layers.attention_limit (the decode kernel reads no slot at or
    past it): every mask a session builds lets a token see no slot past the highest its row
    writes in that forward. Checked on every cached forward of a static session whose masks span
    the whole cache (full_span, as graphed sessions on the decode kernel run): trees, chains,
    plain rounds, the drafter's catch-up with its padding, a row joining mid-stretch; and the
    session stays lossless."""
    import draftsman.models.base as base
    import draftsman.models.eagle3 as eagle3
    from draftsman.session import Request

    real, widths = base.AttnContext, set()

    def checked(cos, sin, mask, cache=None, cache_index=None, limit=None):
        if cache is not None:
            slots = torch.arange(mask.shape[-1])
            past = slots[None, None, :] > cache_index.amax(1)[:, None, None]
            assert not (mask & past).any(), "a mask sees a slot past its row's highest written slot"
            widths.add((mask.shape[1], mask.shape[-1]))
        return real(cos, sin, mask, cache, cache_index, limit)

    target, drafter = pair
    rules, greedy = StopRules(max_new_tokens=120), SamplingParams(temperature=0.0)
    first, second = prompts()
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 260), [first, second], rules, greedy)]
    monkeypatch.setattr(base, "AttnContext", checked)
    monkeypatch.setattr(eagle3, "AttnContext", checked)
    schedule = [TREE] * 2 + [None] * 6 + [CHAIN] * 2 + [None] * (BACKLOG + 3) + [TREE] * 3 + [None] * 2 + [TREE]
    session = SpecSession(target, drafter, None, 260, policy=Scripted(schedule))
    session.static = session.full_span = True
    reqs = [Request(i, p, rules, greedy) for i, p in enumerate((first, second))]
    session.add(reqs[:1])
    for _ in range(5):  # two tree rounds, three plain rounds; then a newcomer mid-stretch
        session.step()
    session.add(reqs[1:])
    while session.num_running:
        session.step()
    assert [r.state.tokens for r in reqs] == plain
    whole = {c.max_len for c in session.caches}  # every round's steps span a whole cache (prefills: their prompt)
    assert {(t, s) for t, s in widths if s in whole} >= {(1, session.caches[0].max_len),  # plain rounds
                                                         (TREE.topk, session.caches[1].max_len),  # draft steps
                                                         (TREE.draft_tokens, session.caches[0].max_len),  # verify
                                                         (BACKLOG, session.caches[1].max_len)}  # catch-up


def test_draining_batches_choose_by_when_the_slowest_row_finishes():
    """With no request waiting, the arm whose slowest row finishes first: speculation that
    yields more tokens per row on average still loses when some row accepts too little to
    finish before plain decoding would (and wins when every row accepts alike)."""
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000)
    costs, taus = {PLAIN: 1.0, CHAIN: 2.0, TREE: 2.8}, {PLAIN: 1, CHAIN: 2.5, TREE: 3.6}  # rates 1, 1.25, 1.29
    feed(policy, 64, costs, taus, 10)
    assert policy.choose(64) == TREE
    alike = [(100, 1.0)]  # every row: 100 tokens left, the batch's acceptance: 100 / 3.6 x 2.8 x 1.1 = 86 < 100
    assert policy.choose(64, drain=alike) == TREE
    slow = [(100, 1.0), (90, 0.4)]  # a row at 0.4 of the batch's acceptance: tree 2.04 tokens a round, 136 > 100
    assert policy.choose(64, drain=slow) is PLAIN
    assert policy.choose(64, drain=alike) == TREE  # (TREE finishes 14% sooner: past switch_margin)
    # a bucket where nothing was timed: no round spent timing there, rates borrowed from 64
    assert policy.choose(8, drain=slow) is PLAIN
    assert policy.estimate(TREE, 8).rounds == 0
    # joins of 3.0 per token decoded here: they dominate every arm's time per token, so
    # speculation's plain_margin makes it lose per round; but none come while draining
    policy._bucket_joins[64] = [3.0, 1.0]
    assert policy.choose(64) is PLAIN and policy.choose(64, drain=alike) == TREE


def test_a_wave_presumes_its_rows_as_slow_as_the_slowest_of_as_many_finished_ones():
    """drain_front: rows with no rounds behind them get low_relative (the 1/(rows+1) quantile of
    finished rows' relative acceptance), so a fresh wave of 64 rows drains plainly where one row
    alone speculates; a row's own evidence moves it; only rows no longer-budget row out-slows
    are kept."""
    policy = AdaptivePolicy([CHAIN, TREE], explore_every=1000)
    assert policy.low_relative(64) == 1.0  # nothing finished yet: the batch's own
    for i in range(100):  # relative acceptance 0.2, 0.21, ..., 1.19
        policy.observe_finished(_row(100, 100 / (0.2 + i / 100)))
    assert policy.low_relative(64) == pytest.approx(0.21)  # index 100 // 65 = 1
    assert policy.low_relative(1) == pytest.approx(0.7)  # the median
    fresh = [_row(0, 0, left=120) for _ in range(64)]
    ((row, rel),) = policy.drain_front(fresh)  # all alike: the first longest row
    assert row is fresh[0] and rel == pytest.approx(0.21)
    costs, taus = {PLAIN: 1.0, CHAIN: 2.0, TREE: 2.8}, {PLAIN: 1, CHAIN: 2.5, TREE: 3.6}
    feed(policy, 64, costs, taus, 10)
    assert policy.choose(64, drain=[(row.state.left, rel)]) is PLAIN  # 120 / 1.55 x 2.8 x 1.1 = 238 > 120
    feed(policy, 1, {PLAIN: 1.0, CHAIN: 1.5, TREE: 1.8}, taus, 10)
    ((_, rel1),) = policy.drain_front(fresh[:1])
    assert rel1 == pytest.approx(0.7)
    assert policy.choose(1, drain=[(120, rel1)]) == TREE  # 120 / 2.82 x 1.8 x 1.1 = 84 < 120
    proven = _row(40, 40, left=120)  # 40 accepted drafts where its peers averaged 40: relative 1
    assert policy.drain_front([proven])[0][1] == pytest.approx((40 + 16 * 0.7) / (40 + 16))
    # (left, rel): (100, 1.0) decides; (90, 0.5) accepts less, kept; (80, 2.0) finishes first under any arm
    late = [_row(30, 30, left=60) for _ in range(15)] + [_row(0, 0, left=120)]  # one row joined lately
    assert policy.drain_front(late)[0][1] == pytest.approx(0.7)  # the slowest of one row: the median
    rows = [_row(1, 1, left=80), _row(100, 100, left=100), _row(5, 10, left=90)]
    policy.drain_prior = 0.0
    assert [(r.state.left, rel) for r, rel in policy.drain_front(rows)] == [(100, 1.0), (90, 0.5)]


def _row(accepted: int, expected: float, left: int = 10):
    """A Request with `left` tokens of budget and the given acceptance counters."""
    from draftsman.session import Request

    r = Request(object(), [1], StopRules(max_new_tokens=left))
    r.histogram, r.expected = [0, accepted], expected  # (`accepted` rounds of one accepted draft)
    return r


def test_draining_session_reports_its_front_and_relative_acceptance(pair):
    """SpecSession: rounds add each row's accepted drafts and its batch's mean (`expected`);
    _drain is None while requests wait, else the policy's front as (tokens left, relative
    acceptance); finished rows feed the policy's history; drive_session sets `waiting`."""
    from draftsman.bench import drive_session
    from draftsman.session import Request

    target, drafter = pair
    policy = AdaptivePolicy([CHAIN], explore_every=1000)
    session = SpecSession(target, drafter, None, 200, policy=policy)
    reqs = [Request(i, p, StopRules(max_new_tokens=n), SamplingParams(temperature=0.0))
            for i, (p, n) in enumerate(zip(prompts() * 2, (50, 40, 30, 20), strict=True))]
    session.add(reqs)
    session._count([4, 0, 2, 2], 4)
    assert [(r.accepted, r.expected) for r in reqs] == [(4, 2.0), (0, 2.0), (2, 2.0), (2, 2.0)]
    session.waiting = 3
    assert session._drain() is None
    session.waiting, policy.drain_prior = 0, 0.0
    left = [r.rules.max_new_tokens - len(r.state.tokens) for r in reqs]  # (the prefill emitted one token each)
    assert session._drain() == [(left[0], 2.0), (left[1], 0.0)]
    session = SpecSession(target, drafter, None, 200, policy=AdaptivePolicy([CHAIN], explore_every=1000))
    seen = []
    session.step = lambda step=session.step: seen.append(session.waiting) or step()
    drive_session(session, [Request(i, p, StopRules(max_new_tokens=12)) for i, p in enumerate(prompts() * 2)], 2)
    assert seen[0] == 2 and seen[-1] == 0
    finished = session.policy.finished
    assert 0 < len(finished) <= 4 and all(x >= 0 for x in finished)


def test_a_batch_draining_plainly_is_not_asked_again_until_its_rows_change(pair):
    """Once a draining batch settles on plain decoding the session stops asking the policy (its
    rows' budgets fall together and nothing new is learnt) until the rows change; outputs stay
    plain decoding's."""
    target, drafter = pair
    calls = []

    class Counting(AdaptivePolicy):
        def choose(self, batch, ready=None, drain=None):
            arm = super().choose(batch, ready, drain)
            calls.append((arm, self.settled, drain is not None))
            return arm

        def observe(self, arm, batch, seconds, accepted, classes=None):  # speculation made to lose clearly
            super().observe(arm, batch, None if seconds is None else seconds * (1 if arm is None else 10), accepted,
                            classes)

    rules = StopRules(max_new_tokens=40)
    greedy = SamplingParams(temperature=0.0)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 100), prompts(), rules, greedy)]
    session = SpecSession(target, drafter, None, 100, policy=Counting([CHAIN, TREE], explore_every=1000))
    done = run_to_completion(session, prompts(), rules, greedy)
    assert [r.state.tokens for r in done] == plain
    settled = [i for i, (arm, s, drain) in enumerate(calls) if s]
    assert settled and all(calls[i][0] is None and calls[i][2] for i in settled)
    assert len(calls) < settled[0] + 5  # a few more questions at most (a row leaving), not one a round
    assert sum(len(t) for t in plain) / 2 > settled[0] + 20  # (and many rounds were left to run)


def test_plain_decoding_chosen_holds_for_hold_rounds_without_asking(pair):
    """Rows that keep coming (a server: `waiting` unknown): once plain decoding is the bucket's
    arm the session asks the policy once per `hold_rounds` rounds, not every round, still
    re-measures speculation when due, and outputs stay plain decoding's."""
    target, drafter = pair
    calls = []

    class Counting(AdaptivePolicy):
        def choose(self, batch, ready=None, drain=None):
            arm = super().choose(batch, ready, drain)
            calls.append((self.round, arm))
            return arm

        def observe(self, arm, batch, seconds, accepted, classes=None):  # speculation made to lose clearly
            super().observe(arm, batch, None if seconds is None else seconds * (1 if arm is None else 10), accepted,
                            classes)

    rules = StopRules(max_new_tokens=90)
    greedy = SamplingParams(temperature=0.0)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 140), prompts()[:1], rules, greedy)]
    policy = Counting([CHAIN], explore_every=32, max_explore_every=32, hold_rounds=8)
    session = SpecSession(target, drafter, None, 140, policy=policy)
    request = Request(0, prompts()[0], rules, greedy)
    session.add([request])
    session.waiting = None
    while session.num_running:
        session.step()
    assert request.state.tokens == plain[0]
    assert policy.round >= 80
    spec_probes = [r for r, arm in calls if arm is not None]
    assert len(spec_probes) >= 3  # timed first, then re-measured every 32 rounds
    assert len(calls) <= policy.round / 8 + len(spec_probes) * 2 + 4  # not asked every round
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(calls)]
    assert max(gaps) <= 9


def test_a_plain_hold_outlives_joins_of_the_same_sampling_classes(pair):
    """At batch 1 every request joins an empty batch: the plain hold stands across requests of
    the rows' sampling classes (nothing speculative ran, only plain decoding's round time
    changed), so the policy is asked about once per hold_rounds rounds, not once per request;
    a request at another temperature asks at once. Outputs stay plain decoding's."""
    from draftsman.bench import drive_session

    target, drafter = pair
    calls = []

    class Counting(AdaptivePolicy):
        def choose(self, batch, ready=None, drain=None):
            arm = super().choose(batch, ready, drain)
            calls.append((self.round, arm, tuple(self.mix)))
            return arm

        def observe(self, arm, batch, seconds, accepted, classes=None):  # speculation made to lose clearly
            super().observe(arm, batch, None if seconds is None else seconds * (1 if arm is None else 10), accepted,
                            classes)

    rules, greedy = StopRules(max_new_tokens=8), SamplingParams(temperature=0.0)
    texts = prompts() * 6
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 100), texts, rules, greedy)]
    policy = Counting([CHAIN], explore_every=1000, max_explore_every=1000, hold_rounds=64)
    session = SpecSession(target, drafter, None, 100, policy=policy)
    requests = [Request(i, p, rules, greedy) for i, p in enumerate(texts)]
    drive_session(session, requests, 1)
    assert [r.state.tokens for r in requests] == plain
    assert policy.current[1] is PLAIN and sum(r.plain_rounds for r in requests) >= 70  # of 84
    asked = len(calls)
    assert asked <= 6  # timing the arms, the first plain choice: then held across 11 joins
    sampled = Request(99, texts[0], rules, SamplingParams(temperature=1.0, seed=0))
    drive_session(session, [sampled], 1)
    assert len(calls) > asked and calls[asked][2] == (1.0,)  # a new class: asked at its first round


def test_confidence_probes_only_at_batch_1():
    """Past batch 1 a round brings as many draws as rows, and a probe round sets rows of one
    budget apart (staggered joins): an arm's few rounds there are not re-run on their bounds."""
    costs, taus = {PLAIN: 1.0, CHAIN: 1.9}, {PLAIN: 1, CHAIN: 2}  # the chain: 1.05 tokens/unit vs 1.0
    for batch, probes in ((1, True), (4, False)):
        policy = AdaptivePolicy([CHAIN], explore_every=1000, plain_margin=0.1, single_row_margin=0.1)
        chosen = feed(policy, batch, costs, taus, 40)
        assert (chosen[2:].count(CHAIN) > 0) is probes
