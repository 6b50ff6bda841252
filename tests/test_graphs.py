"""Static shapes and CUDA graphs: masks over whole caches decode exactly what dynamic masks do
(CPU), and graph replays of decode/draft/verify steps equal eager ones (GPU, `-m gpu`)."""

from __future__ import annotations

import pytest
import torch

import draftsman
from draftsman.generate import StopRules
from draftsman.graphs import CudaGraphRunner, GraphTable, graph_table, signature
from draftsman.models.layers import slot_mask
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, run_to_completion
from draftsman.spec.engine import SpecConfig, SpecSession

SPECS = [SpecConfig.chain(4), SpecConfig(steps=4, topk=3, draft_tokens=10)]


@pytest.fixture(scope="module")
def pair():
    target, drafter = draftsman.reference_pair()
    t = draftsman.load_target(target)
    return t, draftsman.load_drafter(drafter, target=t)


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 8000, (k,), generator=g).tolist() for k in (9, 17, 5)[:n]]


def new_session(target, drafter, spec, max_len=64, seed=7, **flags):
    """A plain (spec None) or speculative session with attributes (static, graphed) overridden."""
    session = (PlainSession(target, max_len, seed=seed) if spec is None
               else SpecSession(target, drafter, spec, max_len, seed=seed))
    for name, value in flags.items():
        setattr(session, name, value)
    return session


def decode(session, params, new=24):
    done = run_to_completion(session, prompts(), StopRules(max_new_tokens=new), params)
    return [r.state.tokens for r in done], [r.histogram for r in done]


def test_a_longer_slot_mask_extends_the_default_mask():
    """Static steps size masks by a span past the slots in use: the extra slots stay masked."""
    index = torch.tensor([[3, 4], [0, 1]])
    full = slot_mask(index, 9)
    assert full.shape == (2, 2, 9)
    assert torch.equal(full[..., :5], slot_mask(index, 5)) and not full[..., 5:].any()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [None, *SPECS], ids=["plain", "chain", "tree"])
def test_padded_batches_decode_the_same_tokens(pair, spec, temperature):
    """Static steps on batches padded to a power of two (3 rows finishing at different times run
    as 4, 2, 1) decode what unpadded dynamic-shape steps do."""
    target, drafter = pair
    params = SamplingParams(temperature=temperature, seed=7)
    rules = StopRules(max_new_tokens=40, eos_ids=frozenset({1}))
    outs = []
    for static in (False, True):
        session = new_session(target, drafter, spec, max_len=80, static=static, pad=static)
        done = run_to_completion(session, prompts(), rules, params)
        outs.append([r.state.tokens for r in done])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [None, *SPECS], ids=["plain", "chain", "tree"])
def test_static_masks_decode_the_same_tokens(pair, spec, temperature):
    """On CPU sessions size masks by the slots in use; on CUDA by the whole cache. Same output,
    same acceptance, same random stream."""
    target, drafter = pair
    params = SamplingParams(temperature=temperature, seed=7)
    outs = []
    for static in (False, True):
        outs.append(decode(new_session(target, drafter, spec, static=static), params))
    assert outs[0] == outs[1]
    if spec is not None and temperature == 0:
        assert sum(sum(h[1:]) for h in outs[0][1]) > 0  # some drafts accepted: compaction exercised


def test_signature_tells_caches_apart():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    x = {"x": torch.zeros(4)}
    assert signature(x, [a]) == signature(x, [a])
    assert signature(x, [a]) != signature(x, [b])
    assert signature(x, [a]) != signature({"x": torch.zeros(5)}, [a])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_graph_runner_replays_the_function():
    w = torch.randn(8, 8, device="cuda")
    runner = CudaGraphRunner(lambda x: (x @ w).relu(), {"x": torch.randn(4, 8, device="cuda")})
    for _ in range(3):
        x = torch.randn(4, 8, device="cuda")
        torch.testing.assert_close(runner(x=x), (x @ w).relu())


@pytest.mark.gpu
@gpu
def test_graph_table_captures_once_per_key_and_evicts():
    table = GraphTable(max_graphs=2)
    fn = lambda x: x * 2  # noqa: E731
    for n in (3, 3, 4, 5, 3):
        x = torch.ones(n, device="cuda")
        assert torch.equal(table.run(("f", n), fn, {"x": x}), x * 2)
    assert table.captures == 4 and len(table.runners) == 2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [None, *SPECS], ids=["plain", "chain", "tree"])
def test_graphed_sessions_equal_eager_ones(spec, temperature):
    """The reference pair on the GPU in fp32: graph replays decode what eager static-shape
    forwards decode (bf16 would differ by kernel choice, not by the graphs)."""
    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda")
    params = SamplingParams(temperature=temperature, seed=7)
    outs = []
    for graphed in (False, True):
        outs.append(decode(new_session(target, drafter, spec, graphed=graphed), params))
    assert outs[0] == outs[1]
    for module in (target, drafter):
        assert not graph_table(module).failed, graph_table(module).failed
    assert graph_table(target).captures > 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", [None, SPECS[1]], ids=["plain", "tree"])
def test_graphed_prefills_decode_like_eager_ones(spec):
    """graph_prefill on the GPU (fp32 reference pair): prefills captured over the staging caches
    decode what eager prefills do, for the first batch and for a join into a running batch; a
    later join of the same padded shape replays without a capture."""
    from draftsman.session import Request

    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda")
    rules = StopRules(max_new_tokens=20)
    outs = []
    for staged in (False, True):
        session = new_session(target, drafter, spec, max_len=96, graph_prefill=staged)
        reqs = [Request(i, p, rules, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts() + prompts(seed=1))]
        session.add(reqs[:2])
        session.step()
        session.add(reqs[2:4])  # a join into the running batch (2 rows, 16 columns)
        before = [graph_table(m).captures for m in (target, drafter)]
        session.add(reqs[4:])  # the first prefill's padded shape (2 rows, 32 columns): replayed
        added = [graph_table(m).captures for m in (target, drafter)]
        while session.num_running:
            session.step()
        outs.append([r.state.tokens for r in reqs])
        if staged:
            assert any(key[0][0] == "prefill" for key in graph_table(target).runners)
            # (prefill, 2 rows, 32 columns) replayed; the rounds after it may capture new spans
            assert added == before
    assert outs[0] == outs[1]
    for module in (target, drafter):
        assert not graph_table(module).failed, graph_table(module).failed


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_graphed_speculation_equals_plain_decoding_in_fp32(spec):
    """Greedy speculation on the GPU (whole-round graphs) decodes exactly what graphed plain
    decoding does, in fp32 (bf16 may flip near-tied argmaxes between verify and decode shapes)."""
    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda")
    params = SamplingParams(temperature=0.0)
    plain, _ = decode(PlainSession(target, 96), params, new=48)
    spec_out, hist = decode(SpecSession(target, drafter, spec, 96), params, new=48)
    assert spec_out == plain
    assert sum(sum(h[1:]) for h in hist) > 0


@pytest.mark.parametrize("spec", [None, SPECS[1]], ids=["plain", "tree"])
def test_compiled_sessions_decode_the_same_tokens(pair, spec):
    """torch.compile'd decode/draft/verify forwards (CPU inductor here; on CUDA they are then
    captured in graphs) decode what eager forwards decode."""
    target, drafter = pair
    params = SamplingParams(temperature=0.0)
    outs = []
    for compile in (False, True):
        session = (PlainSession(target, 64, compile=compile) if spec is None
                   else SpecSession(target, drafter, spec, 64, compile=compile))
        session.static = True
        done = run_to_completion(session, prompts(1), StopRules(max_new_tokens=12), params)  # one shape per step
        outs.append(done[0].state.tokens)
    assert outs[0] == outs[1]


def test_compile_mode_comes_from_the_environment(monkeypatch):
    from draftsman.graphs import compile_mode

    monkeypatch.delenv("DRAFTSMAN_COMPILE_MODE", raising=False)
    assert compile_mode() is None
    monkeypatch.setenv("DRAFTSMAN_COMPILE_MODE", "max-autotune-no-cudagraphs")
    assert compile_mode() == "max-autotune-no-cudagraphs"
    monkeypatch.setenv("DRAFTSMAN_COMPILE_MODE", "reduce-overhead")
    with pytest.raises(ValueError, match="captures CUDA graphs itself"):
        compile_mode()


def test_span_covers_the_longest_row_in_powers_of_two(pair):
    """Static steps attend over a power-of-two span (>= 64) covering the longest row plus the
    slots the step writes past it, never beyond the cache."""
    from draftsman.session import Request

    target, _ = pair
    session = PlainSession(target, 400)
    session.add([Request(0, list(range(5, 75)), StopRules(max_new_tokens=300)),
                 Request(1, list(range(5, 15)), StopRules(max_new_tokens=300))])
    cache = session.caches[0]
    assert session.span(cache, 1) == 128  # 70 prompt + 1 emitted + 1 written
    assert session.span(cache, 58) == 256  # 71 + 58 = 129 > 128
    assert session.span(cache, 10_000) == cache.max_len
    session.cancel([0])
    assert session.span(session.caches[0], 1) == 64  # only the 10-token prompt left


@pytest.mark.gpu
@gpu
def test_interleaved_adaptive_sessions_on_cuda_decode_like_plain():
    """Two adaptive sessions stepping in turn on the GPU (as the server's sessions do), switching
    between plain steps and both speculation shapes: every graph shares its module's memory
    pool, and each session's state must survive the other's replays."""
    from draftsman.session import Request
    from draftsman.spec.adaptive import AdaptivePolicy

    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda", inference=True)
    greedy = SamplingParams(temperature=0.0)
    rules = StopRules(max_new_tokens=48)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 96), prompts(), rules, greedy)]
    sessions = [SpecSession(target, drafter, None, 96, policy=AdaptivePolicy(SPECS, explore_every=3))
                for _ in range(2)]
    requests = [[Request(i, p, rules, greedy) for i, p in enumerate(prompts())] for _ in sessions]
    for session, reqs in zip(sessions, requests, strict=True):
        session.add(reqs)
    while any(s.num_running for s in sessions):
        for s in sessions:
            s.step()
    for reqs in requests:
        assert [r.state.tokens for r in reqs] == plain
    for module in (target, drafter):
        assert not graph_table(module).failed


@pytest.mark.gpu
@gpu
def test_attention_limit_reads_no_slot_past_it_on_cuda():
    """bf16 reference target on CUDA: a decode step and a 6-token chain verify over a mask
    spanning the whole cache (the decode kernel bounded by attention_limit) give the logits of
    masks sized to the slots in use, with NaN in every cache slot past the rows' limits: none is
    read."""
    target_dir, _ = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(5, 8000, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for t in (1, 6):
        logits = []
        for whole in (True, False):
            cache = target.new_cache(2, 512)
            used = torch.tensor([40, 25], device="cuda")  # rows of different lengths
            target.run(ids, cache=cache, positions=torch.arange(40, device="cuda").expand(2, 40))
            for buf in cache.buffers.values():  # poison every slot at or past a row's new tokens
                buf[:, 0, 40 + t:] = float("nan")
                buf[:, 1, 25 + t:] = float("nan")
            pos = used[:, None] + torch.arange(t, device="cuda")
            mask = slot_mask(pos, 512 if whole else 40 + t)
            logits.append(target.run(ids[:, :t], cache=cache, positions=pos, attn_mask=mask).logits.float())
        assert torch.isfinite(logits[0]).all()
        torch.testing.assert_close(logits[0], logits[1], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_full_span_sessions_capture_one_graph_per_batch_bucket():
    """A graphed bf16 plain session on the decode kernel (full_span) attends over the whole cache:
    rows growing past 64, 128 and 256 slots replay the graph of their batch bucket, where spans
    sized to the slots in use capture one per span."""
    target_dir, _ = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda", dtype=torch.bfloat16)
    keys = []
    for full in (True, False):
        table = graph_table(target)
        table.runners.clear()
        session = new_session(target, None, None, max_len=320)
        assert session.full_span  # (bf16 on CUDA with Triton: the kernel serves the reference target)
        session.full_span = full
        run_to_completion(session, prompts(1), StopRules(max_new_tokens=280), SamplingParams(temperature=0.0))
        keys.append([k for k in table.runners if k[0][0] == "decode"])
    assert len(keys[0]) == 1 and len(keys[1]) >= 3


@pytest.mark.gpu
@gpu
def test_graphed_sessions_defer_drafter_work_and_match_the_eager_drafter():
    """tests/test_adaptive's deferred-drafter check on the GPU (fp32, graphed rounds): a graphed
    session that defers its joins' drafter prefill and spills its backlog while plain decoding is
    the choice (the deferred chunks then run through the catch-up's graph, in passes of the
    backlog's width) decodes as plain decoding does, and its drafter cache and acceptance match
    the session's that is never asked to defer."""
    from helpers import deferred_vs_eager

    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda", inference=True)
    deferred_vs_eager(target, drafter, prompts(), device="cuda")


@pytest.mark.gpu
@gpu
def test_graphed_probe_rounds_run_in_step_and_decode_like_plain():
    """tests/test_adaptive's in-step probe check on the GPU (fp32, whole-round graphs): rows keep
    the batch's shortest accepted path on probe rounds, emit alike every round, and decode as
    plain decoding does."""
    from helpers import ScriptedProbing

    from draftsman.session import Request

    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cuda")
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cuda", inference=True)
    greedy, rules = SamplingParams(temperature=0.0), StopRules(max_new_tokens=40)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, 96), prompts(), rules, greedy)]
    policy = ScriptedProbing([SPECS[0], None, SPECS[1], SPECS[0], None, SPECS[1]])
    policy.candidates = list(SPECS)
    session = SpecSession(target, drafter, None, 96, policy=policy)
    reqs = [Request(i, p, rules, greedy) for i, p in enumerate(prompts())]
    session.add(reqs)
    rounds = []
    while session.rows:
        rounds.append({len(e.tokens) for e in session.step()})
    assert [r.state.tokens for r in reqs] == plain
    assert all(len(r) == 1 for r in rounds)
    assert any(len(set(acc)) > 1 for arm, acc in policy.log if arm is not None)  # cuts were made
