"""Join coalescing (joins.JoinCoalescer): freed slots wait to fill together while what their
emptiness costs stays below a join's fixed part, fitted from the joins seen."""

from __future__ import annotations

import pytest
import torch

from draftsman.bench import drive_session
from draftsman.generate import StopRules
from draftsman.joins import JoinCoalescer
from draftsman.session import PlainSession, Request


def fitted(fixed: float, per_token: float, sizes=(32, 64, 128, 256) * 3) -> JoinCoalescer:
    c = JoinCoalescer()
    for t in sizes:
        c.observe_join(fixed + per_token * t, t)
    return c


def test_the_fit_recovers_the_fixed_part_of_a_join():
    assert fitted(3e-3, 1e-5).fixed_seconds() == pytest.approx(3e-3)
    assert fitted(0.0, 1e-4).fixed_seconds() == pytest.approx(0.0, abs=1e-12)  # a CPU: all per token
    assert fitted(3e-3, 1e-5, sizes=(64,) * 12).fixed_seconds() == 0.0  # one size: cannot tell
    assert fitted(3e-3, 1e-5, sizes=(32, 64)).fixed_seconds() == 0.0  # too few joins to trust


def test_freed_slots_wait_while_the_rows_expected_to_free_would_pay_for_it():
    c = fitted(3e-3, 1e-5)
    assert c.join_now(1, 16)  # no round timed yet: at once
    for i in range(401):  # rounds of 2 ms, a row leaving every other round
        c.observe_round(2e-3, i % 2)
    # r x F = ~0.5 x 3 ms = ~1.5 ms saved a round, against f/16 x 2 ms lost: wait while f < ~12
    assert not c.join_now(2, 16) and not c.join_now(11, 16) and c.join_now(13, 16)
    c.observe_join(3e-3, 64)
    assert [c.join_now(2, 16) for _ in range(c.max_wait_rounds + 1)] == [False] * c.max_wait_rounds + [True]
    assert c.join_now(16, 16)  # nothing running: always at once


def test_no_fixed_part_or_no_leaving_rows_means_no_waiting():
    c = fitted(0.0, 1e-4)
    c.observe_round(1e-3, 1)
    assert c.join_now(1, 16)
    c = fitted(3e-3, 1e-5)
    c.observe_round(1e-3, 0)  # no row has left: nothing to wait for
    assert c.join_now(1, 16)


def test_a_session_times_its_joins_and_rounds(ref_target):
    """drive_session asks the session's coalescer; its joins and rounds feed it."""
    session = PlainSession(ref_target, 128)
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    requests = [Request(i, p, StopRules(4, frozenset())) for i, p in enumerate(prompts)]
    drive_session(session, requests, 2)
    assert session.joins._joins >= 3 and session.joins.round_seconds > 0
    assert all(r.state.done for r in requests)


def test_coalesced_joins_are_fewer_and_change_no_output(ref_target):
    """Rows of different budgets free their slots apart; with a join's fixed part large against
    the rounds, the freed slots fill together (fewer joins), and every request decodes as before."""
    prompts = [[1, 2, 3 + i, 4 + 2 * i] for i in range(12)]

    def run(coalescer: JoinCoalescer | None):
        session = PlainSession(ref_target, 128)
        if coalescer is not None:
            session.joins = coalescer
        requests = [Request(i, p, StopRules(3 + i % 5, frozenset())) for i, p in enumerate(prompts)]
        result = drive_session(session, requests, 4)
        return [r.state.tokens for r in requests], len(result.joins)

    plain_out, plain_joins = run(None)
    out, joins = run(fitted(1.0, 0.0))  # a 1 s fixed part: slots wait max_wait_rounds
    assert out == plain_out and joins < plain_joins


@pytest.fixture(scope="module")
def ref_target():
    from draftsman.models import load_target
    from draftsman.reference import TARGET_DIR

    return load_target(TARGET_DIR, device=torch.device("cpu"), dtype=torch.float32)
