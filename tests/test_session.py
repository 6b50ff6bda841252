"""Continuous batching: requests join and leave a running session between rounds without
changing anyone's output."""

from __future__ import annotations

import pytest
import torch

import draftsman
from draftsman.generate import StopRules, generate_plain
from draftsman.models.eagle3 import init_drafter
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, Request
from draftsman.spec.engine import SpecConfig, SpecSession


@pytest.fixture(scope="module")
def target(tiny_deepseek_dir):
    return draftsman.load_target(tiny_deepseek_dir)


def make_session(kind, target, max_len=96):
    if kind == "plain":
        return PlainSession(target, max_len, seed=0)
    return SpecSession(target, init_drafter(target, seed=3), SpecConfig(steps=3, topk=2, draft_tokens=6), max_len,
                       seed=0)


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_join_midway_and_cancel(target, kind):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 4)]
    rules = StopRules(max_new_tokens=20)
    alone = generate_plain(target, prompts, rules).token_ids
    session = make_session(kind, target)
    a, b, c = (Request(i, p, rules) for i, p in enumerate(prompts))
    session.add([a])
    for _ in range(3):
        session.step()
    session.add([b, c])  # join a running batch
    session.step()
    events = session.cancel([2])
    assert [e.finish_reason for e in events] == ["cancelled"] and session.num_running == 2
    while session.num_running:
        for e in session.step():
            assert e.request_id in (0, 1)
    assert a.state.tokens == alone[0] and b.state.tokens == alone[1]
    assert c.state.tokens == alone[2][: len(c.state.tokens)]


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_longest_row_follows_joins_rounds_and_cancels(target, kind):
    """longest_row (behind every span) is remembered between changes: it must follow tokens
    emitted, rows joining and rows leaving, as a fresh count does."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 5, 9)]
    session = make_session(kind, target)
    reqs = [Request(i, p, StopRules(max_new_tokens=m)) for i, (p, m) in enumerate(zip(prompts, (6, 40, 30), strict=True))]

    def fresh():
        return max((len(r.prompt) + len(r.state.tokens) for r in session.rows), default=0)

    session.add(reqs[1:2])
    seen = [session.longest_row()]
    assert seen[-1] == fresh()
    session.add(reqs[:1])  # a longer prompt joins
    assert session.longest_row() == fresh() == 31
    while session.num_running:
        session.step()
        assert session.longest_row() == fresh()
        if session.num_running == 1 and len(reqs[2].state.tokens) == 0:
            session.add(reqs[2:])
            assert session.longest_row() == fresh()
            session.cancel([1])
            assert session.longest_row() == fresh()
    assert session.longest_row() == 0 and len(reqs[2].state.tokens) == 30  # (the join and cancel ran)


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_greedy_rows_unaffected_by_sampled_neighbours(target, kind):
    prompts = [[5, 9, 14, 3], [7, 7, 8]]
    rules = StopRules(max_new_tokens=16)
    greedy = generate_plain(target, prompts[:1], rules).token_ids[0]
    session = make_session(kind, target)
    r0 = Request(0, prompts[0], rules, SamplingParams(temperature=0.0))
    r1 = Request(1, prompts[1], rules, SamplingParams(temperature=1.0, top_p=0.9))
    session.add([r0, r1])
    while session.num_running:
        session.step()
    assert r0.state.tokens == greedy
    assert len(r1.state.tokens) == 16


def test_prompt_too_long_for_session(target):
    session = PlainSession(target, 16)
    with pytest.raises(ValueError, match="exceeds the session's max length 16"):
        session.add([Request(0, list(range(3, 13)), StopRules(max_new_tokens=8))])
    assert session.num_running == 0


def test_prefill_groups_respect_the_scores_budget():
    from draftsman.session import prefill_groups

    lengths = [5, 7, 100, 3, 3, 3, 60]
    groups = prefill_groups(lengths, max_len=200, heads=2, budget=2 * 100 * 200 * 2)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # order kept, none lost
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) * 200 * 2 <= 2 * 100 * 200 * 2
    assert prefill_groups([10_000], max_len=20_000, heads=8, budget=1) == [[0]]


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_grouped_prefill_same_output(target, kind, monkeypatch):
    """A budget so small that every request is prefilled alone changes nobody's tokens."""
    import draftsman.session as session_mod

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 4, 9)]
    rules = StopRules(max_new_tokens=12)

    def run():
        session = make_session(kind, target)
        reqs = [Request(i, p, rules) for i, p in enumerate(prompts)]
        session.add(reqs)
        while session.num_running:
            session.step()
        return [r.state.tokens for r in reqs]

    together = run()
    monkeypatch.setattr(session_mod, "PREFILL_SCORES_BUDGET", 1)
    assert run() == together


def test_rows_leave_and_join_in_place():
    """Leaving rows are compacted within the cache's allocation and joining rows fill it, so the
    buffers keep their address (CUDA graphs captured over them stay valid) until it is full."""
    from draftsman.kvcache import StaticCache

    cache = StaticCache.allocate({"k": (2,)}, 2, 3, 5, "cpu", torch.float32)
    for b in range(3):
        cache.buffers["k"][:, b] = b + 1.0
    ptr = cache.buffers["k"].data_ptr()
    cache.select_rows(torch.tensor([2, 0]))
    assert cache.batch_size == 2 and cache.buffers["k"].data_ptr() == ptr
    assert cache.buffers["k"][:, :, 0, 0].tolist() == [[3.0, 1.0], [3.0, 1.0]]
    other = StaticCache.allocate({"k": (2,)}, 2, 1, 5, "cpu", torch.float32)
    other.buffers["k"].fill_(9.0)
    cache.append_rows(other)  # fits the allocation: same address
    assert cache.buffers["k"].data_ptr() == ptr and cache.buffers["k"][:, :, 0, 0].tolist() == [[3.0, 1.0, 9.0]] * 2
    cache.append_rows(other)  # outgrows it: a new allocation of 4 rows, rows kept
    assert cache.capacity == 4 and cache.buffers["k"][:, :, 0, 0].tolist() == [[3.0, 1.0, 9.0, 9.0]] * 2


@pytest.mark.parametrize("kind", ["plain", "spec", "adaptive"])
def test_staged_prefills_decode_the_same(target, kind):
    """graph_prefill: newcomers prefilled as static steps over reused staging caches (prompt
    columns padded to a power of two, rows to one) decode exactly as plain prefills do, for
    the first batch and for rows joining a running one; the running rows never share the
    staging cache's memory. On CPU the steps run eagerly with the padding (graphs: -m gpu)."""
    from draftsman.spec.adaptive import AdaptivePolicy

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 19, 4, 9)]
    rules = StopRules(max_new_tokens=14)
    alone = generate_plain(target, prompts, rules).token_ids

    def session():
        if kind == "adaptive":
            cfg = SpecConfig(steps=3, topk=2, draft_tokens=6)
            s = SpecSession(target, init_drafter(target, seed=3), None, 96, seed=0,
                            policy=AdaptivePolicy([cfg], explore_every=4))
        else:
            s = make_session(kind, target)
        s.static = s.pad = s.graph_prefill = True
        return s

    s = session()
    reqs = [Request(i, p, rules) for i, p in enumerate(prompts)]
    s.add(reqs[:2])
    assert s._staging and all(c is not t for c in s.caches for t in s._staging.values())
    s.step()
    s.add(reqs[2:])  # three rows (padded to four), a 19-token prompt (32 columns)
    while s.num_running:
        s.step()
    assert [r.state.tokens for r in reqs] == alone
