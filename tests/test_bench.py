"""`draftsman bench`: in-process arms side by side, plots, client mode against a fake
OpenAI-compatible server, bundled prompt sets, and the pure metric helpers."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from test_cli_generate import make_tokenizer

import draftsman
from draftsman import bench
from draftsman.cli import main
from draftsman.models.eagle3 import init_drafter, save_drafter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORDS = ["hello world", "how are you", "w5 w6 w7 w8", "hello how are you world", "w20 w30 w40", "you are w9"]


def run_main(*args: str) -> tuple[str, dict | None]:
    """Run the CLI in this process; (stdout, the last line's JSON when --json)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    text = out.getvalue()
    return text, json.loads(text.strip().splitlines()[-1]) if "--json" in args else None


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    """(target dir with a chat tokenizer, drafter dir, dataset path)."""
    root = tmp_path_factory.mktemp("bench")
    target_dir = shutil.copytree(tiny_llama_dir, root / "target")
    make_tokenizer(target_dir)
    drafter = init_drafter(draftsman.load_target(target_dir), seed=1)
    drafter_dir = save_drafter(drafter, root / "drafter")
    records = [{"prompt": WORDS[0]}, {"turns": [WORDS[1], "second turn"]}, {"question": WORDS[2]},
               {"instruction": WORDS[3]}, {"messages": [{"role": "user", "content": WORDS[4]}]},
               {"prompt": WORDS[5]}]
    return target_dir, drafter_dir, write_jsonl(root / "prompts.jsonl", records)


@pytest.fixture(scope="module")
def inproc(pair, tmp_path_factory):
    """One in-process run: 2 batch sizes x (plain + a 2-setting grid), with plots."""
    target_dir, drafter_dir, dataset = pair
    plots = tmp_path_factory.mktemp("plots")
    stdout, result = run_main("bench", "--target", str(target_dir), "--drafter", str(drafter_dir),
                              "--dataset", dataset, "--num-prompts", "5", "--max-new-tokens", "8",
                              "--batch-sizes", "1,3", "--spec-steps", "2", "--spec-topk", "1,2",
                              "--warmup", "1", "--json", "--plot", str(plots))
    return stdout, result, plots


TOP_KEYS = {"mode": str, "dataset": str, "num_prompts": int, "batch_sizes": list, "arms": list, "notes": list,
            "specs": list, "best_arm": str, "accept_length": float, "accept_rate_per_position": list,
            "speedup": float, "plain_tokens_per_s": float, "spec_tokens_per_s": float, "identical": bool}
ARM_KEYS = {"arm": str, "kind": str, "batch_size": int, "num_requests": int, "output_tokens": int,
            "duration_s": float, "tokens_per_s": float, "requests_per_s": float, "ttft_p50_ms": float,
            "ttft_p99_ms": float, "tpot_p50_ms": float, "tpot_p99_ms": float, "itl_p50_ms": float,
            "itl_p99_ms": float, "finish_reasons": dict}
ARM_SCHEMA = {*ARM_KEYS, *bench.ARM_DEFAULTS, "spec"}


def test_in_process_arms_split_their_time(inproc):
    """duration_s = time in session steps + joins + elsewhere; at batch 1 every request joins
    alone, and a round runs between joins."""
    _, result, _ = inproc
    for a in result["arms"]:
        parts = a["time_in_steps_s"] + a["time_in_joins_s"] + a["time_elsewhere_s"]
        assert abs(parts - a["duration_s"]) < 1e-6 and min(a["time_in_steps_s"], a["time_in_joins_s"]) > 0, a["arm"]
        assert a["time_elsewhere_s"] >= 0 and a["session_steps"] >= 1
        if a["batch_size"] == 1:
            assert a["joins"] == a["num_requests"] == 5
        else:
            assert 2 <= a["joins"] <= 5  # the first three together, then as slots free


def test_in_process_json_keys_and_types(inproc):
    _, result, _ = inproc
    for key, typ in TOP_KEYS.items():
        assert isinstance(result[key], typ), key
    assert result["mode"] == "in-process" and result["batch_sizes"] == [1, 3]
    assert result["specs"] == [{"steps": 2, "topk": 1, "draft_tokens": 3}, {"steps": 2, "topk": 2, "draft_tokens": 7}]
    assert result["copy_bandwidth_gb_s"] is None and result["bandwidth_fraction"] is None  # CPU
    arms = result["arms"]
    assert [(a["arm"], a["batch_size"]) for a in arms] == [
        (name, bs) for bs in (1, 3) for name in ("plain", "spec-s2-k1-n3", "spec-s2-k2-n7")]
    for a in arms:
        for key, typ in ARM_KEYS.items():
            assert isinstance(a[key], typ), (a["arm"], key)
        assert a["num_requests"] == 5
    assert all(set(a) == ARM_SCHEMA for a in arms)  # stable: every key on every arm
    plain = arms[0]
    assert plain["weight_bytes_per_step"] > 0 and plain["decode_step_ms"] > 0
    assert plain["speedup"] is None and plain["accept_length"] is None


def test_in_process_lossless_and_consistent(inproc):
    _, result, _ = inproc
    assert result["identical"] is True
    arms = result["arms"]
    for bs in (1, 3):
        plain = next(a for a in arms if a["kind"] == "plain" and a["batch_size"] == bs)
        for a in (a for a in arms if a["kind"] == "spec" and a["batch_size"] == bs):
            assert a["identical"] is True and a["mismatched_requests"] == 0
            # same tokens returned, counted the same way, so the speed-up is the tokens/s ratio
            assert a["output_tokens"] == plain["output_tokens"]
            assert a["speedup"] == pytest.approx(a["tokens_per_s"] / plain["tokens_per_s"])
            assert a["accept_length"] == pytest.approx(1 + sum(a["accept_rate_per_position"]))
            assert len(a["accept_rate_per_position"]) == a["spec"]["steps"]
            assert sum(a["accept_length_histogram"]) == a["rounds"] > 0
            assert a["acceptance_source"] == "engine"
    first = [a for a in arms if a["kind"] == "spec" and a["batch_size"] == 1]
    best = max(first, key=lambda a: a["tokens_per_s"])
    assert result["best_arm"] == best["arm"]
    assert result["accept_length"] == best["accept_length"]
    assert result["speedup"] == pytest.approx(result["spec_tokens_per_s"] / result["plain_tokens_per_s"])


def log_drives(monkeypatch) -> list[tuple]:
    """bench's drive_session runs, in order, as (session, timed: not a warm-up run)."""
    runs, drive = [], bench.drive_session

    def logged(session, requests, max_running, *a, **k):
        runs.append((session, not str(requests[0].request_id).startswith("warmup")))
        return drive(session, requests, max_running, *a, **k)

    monkeypatch.setattr(bench, "drive_session", logged)
    return runs


def test_adaptive_arm_is_lossless_and_reports_its_choices(pair, monkeypatch):
    """... and is timed right after plain decoding, its reference (results keep their order)."""
    target_dir, drafter_dir, dataset = pair
    runs = log_drives(monkeypatch)
    _, result = run_main("bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dataset", dataset,
                         "--num-prompts", "4", "--max-new-tokens", "12", "--spec-steps", "2", "--spec-topk", "1,2",
                         "--spec-adaptive", "--json")
    timed = ["adaptive" if getattr(x, "policy", None) else getattr(x, "spec", None) for x, t in runs if t]
    assert timed[:2] == [None, "adaptive"] and len(timed) == 4
    arms = {a["arm"]: a for a in result["arms"]}
    assert list(arms) == ["plain", "spec-s2-k1-n3", "spec-s2-k2-n7", "spec-adaptive"]
    adaptive = arms["spec-adaptive"]
    assert set(adaptive) == ARM_SCHEMA and adaptive["identical"] is True
    assert adaptive["spec"] == {"adaptive": result["specs"]}
    assert adaptive["output_tokens"] == arms["plain"]["output_tokens"]
    seen = {row["arm"] for row in adaptive["adaptive"] if row["rounds"]}
    assert seen == {"plain", "s2-k1-n3", "s2-k2-n7"}  # every choice measured before settling
    assert all(a["adaptive"] is None for name, a in arms.items() if name != "spec-adaptive")
    # (the timed run may be all plain rounds: the policy kept what it measured in the warm-up)
    assert adaptive["spec_rounds"] == (adaptive["rounds"] or 0)
    assert adaptive["spec_rounds"] + adaptive["plain_rounds"] > 0
    assert arms["spec-s2-k1-n3"]["plain_rounds"] == 0 and arms["spec-s2-k1-n3"]["spec_rounds"] > 0
    assert arms["plain"]["spec_rounds"] is None
    assert all(isinstance(adaptive[k], int) and adaptive[k] >= 0 for k in ("catch_ups", "deferred_prefills", "spills"))
    assert arms["spec-s2-k1-n3"]["deferred_prefills"] is None
    assert result["adaptive_speedup"] == adaptive["speedup"]
    best_fixed = max(arms[a]["tokens_per_s"] for a in ("spec-s2-k1-n3", "spec-s2-k2-n7"))
    assert result["adaptive_vs_best_fixed"] == pytest.approx(adaptive["tokens_per_s"] / best_fixed)


def test_default_arms_are_the_adaptive_candidates_and_the_adaptive_arm(pair):
    """Without --spec-* flags bench runs what generate and serve decode with by default (the
    adaptive arm) beside each of its candidates; --spec-policy fixed drops the adaptive arm."""
    from dataclasses import asdict

    from draftsman.spec.adaptive import DEFAULT_CANDIDATES

    target_dir, drafter_dir, dataset = pair
    args = ("bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dataset", dataset,
            "--num-prompts", "2", "--max-new-tokens", "6", "--json")
    _, result = run_main(*args)
    assert result["specs"] == [asdict(c) for c in DEFAULT_CANDIDATES]
    assert [a["arm"] for a in result["arms"]] == ["plain", "spec-s5-k4-n16", "spec-s5-k4-n6", "spec-s5-k1-n6",
                                                 "spec-adaptive"]
    assert result["identical"] is True
    _, fixed = run_main(*args, "--spec-policy", "fixed")
    assert [a["arm"] for a in fixed["arms"]] == ["plain", "spec-s5-k4-n16"]
    assert fixed["adaptive_speedup"] is None and fixed["adaptive_vs_best_fixed"] is None


def test_repeats_go_round_the_arms_and_report_the_median_run(pair, monkeypatch):
    """--repeats 3: every arm warmed up first, then the timed runs interleaved across the arms
    (each in its arm's own session; each round of runs starting one arm further on), and each
    arm reports its run of median duration."""
    target_dir, drafter_dir, dataset = pair
    runs = log_drives(monkeypatch)
    _, result = run_main("bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dataset", dataset,
                         "--num-prompts", "3", "--max-new-tokens", "6", "--spec-steps", "2", "--spec-topk", "1",
                         "--repeats", "3", "--json")
    assert result["repeats"] == 3
    timed = [(type(x).__name__, id(x)) for x, t in runs if t]
    assert len(timed) == 6 and [t for _, t in runs].index(True) == 2  # both warm-ups first
    assert [k for k, _ in timed] == ["PlainSession", "SpecSession", "SpecSession", "PlainSession",
                                     "PlainSession", "SpecSession"]  # interleaved, each round one arm on
    assert len({i for k, i in timed if k == "PlainSession"}) == 1  # one session per arm throughout
    for a in result["arms"]:
        assert len(a["durations_s"]) == 3 and a["duration_s"] == pytest.approx(sorted(a["durations_s"])[1], abs=1e-5)
        assert a["identical"] in (True, None) or a["arm"] != "plain"
    assert {a["arm"]: a["identical"] for a in result["arms"]}["spec-s2-k1-n3"] is True


def test_eager_prefill_reaches_every_arm_s_session(pair, monkeypatch):
    """Staged prefills are the sessions' default where graphs run; bench --eager-prefill turns them
    off in each arm's session (plain, fixed, adaptive)."""
    import draftsman.session

    monkeypatch.setattr(draftsman.session, "graphs_enabled", lambda device: True)  # (as on CUDA)
    target_dir, drafter_dir, _ = pair
    target = draftsman.load_target(target_dir)
    drafter = draftsman.load_drafter(drafter_dir, target=target)
    rules, params = draftsman.generate.StopRules(max_new_tokens=4), draftsman.sampling.SamplingParams(temperature=0.0)
    spec = bench.SpecConfig(steps=2, topk=1, draft_tokens=3)
    for arm in (None, spec, bench.ADAPTIVE):
        assert bench.make_session(target, drafter, arm, bench.Workload([[5]], rules, params), [spec]).graph_prefill
        eager = bench.Workload([[5]], rules, params, graph_prefill=False)
        assert bench.make_session(target, drafter, arm, eager, [spec]).graph_prefill is False
    monkeypatch.setattr(draftsman.session, "graphs_enabled", lambda device: False)  # (CPU)
    assert bench.make_session(target, drafter, None, bench.Workload([[5]], rules, params)).graph_prefill is False


def test_partial_acceptance_matches_engine(tiny_llama_dir):
    """With a drafter that is right only sometimes, per-position acceptance is non-trivial, adds up
    to τ, and continuous batching leaves it equal to a SpecEngine run of the same prompts."""
    from test_engine import BigramDrafter, prompts_of

    from draftsman.generate import StopRules
    from draftsman.sampling import SamplingParams
    from draftsman.spec.engine import SpecConfig, SpecEngine

    target = draftsman.load_target(tiny_llama_dir)
    drafter = BigramDrafter(target)
    prompts = prompts_of([5, 9, 7, 4])
    rules = StopRules(16, eos_ids=frozenset(target.config.eos_token_ids))
    specs = [SpecConfig.chain(3), SpecConfig(steps=2, topk=3, draft_tokens=6)]
    workload = bench.Workload(prompts, rules, SamplingParams(temperature=0.0), batch_sizes=(1, 3), warmup=1)
    arms = bench.bench_in_process(target, drafter, specs, workload)
    bench.add_speedups(arms)
    assert len(arms) == 6
    for a in (a for a in arms if a["kind"] == "spec"):
        spec = SpecConfig(**a["spec"])
        stats = SpecEngine(target, drafter, spec).generate(prompts, rules).stats
        assert a["identical"] is True
        assert a["accept_length"] == pytest.approx(stats["accept_length"])
        assert a["accept_rate_per_position"] == pytest.approx(stats["accept_rate_per_position"])
        rates = a["accept_rate_per_position"]
        assert 1 < a["accept_length"] == pytest.approx(1 + sum(rates))
        assert rates == sorted(rates, reverse=True) and 0 < rates[0] <= 1
        assert a["accepted_tokens"] == sum(i * h for i, h in enumerate(a["accept_length_histogram"]))


def test_warm_up_repeats_while_a_pass_captures(tiny_llama_dir, monkeypatch):
    """--warmup-passes: the warm-up runs again while its pass captured CUDA graphs (an adaptive
    arm's shapes differ from pass to pass), up to the limit, and stops after a pass without."""
    from test_engine import prompts_of

    from draftsman.generate import StopRules
    from draftsman.sampling import SamplingParams
    from draftsman.session import PlainSession

    target = draftsman.load_target(tiny_llama_dir)
    rules = StopRules(4, eos_ids=frozenset())
    count = iter(range(1000))
    made = {"n": 0}
    passes_capturing = [3, 1, 0, 5]  # captures made by successive passes
    monkeypatch.setattr(bench, "captures", lambda *modules: made["n"])
    drive = bench.drive_session

    def capturing_drive(session, requests, max_running, *a, **k):
        made["n"] += passes_capturing[next(count)]
        return drive(session, requests, max_running, *a, **k)

    monkeypatch.setattr(bench, "drive_session", capturing_drive)
    for limit, expected in ((1, 1), (2, 2), (5, 3)):
        count, made["n"] = iter(range(1000)), 0
        workload = bench.Workload(prompts_of([5, 6]), rules, SamplingParams(temperature=0.0), warmup=2,
                                  warmup_passes=limit)
        assert bench.warm_up(PlainSession(target, 32), workload, 2) == expected
    assert bench.warm_up(PlainSession(target, 32), bench.Workload(prompts_of([5]), rules, SamplingParams(),
                                                                  warmup=0, warmup_passes=3), 1) == 0


def test_warm_up_runs_at_least_one_full_batch(tiny_llama_dir, monkeypatch):
    """A warm-up pass runs max(--warmup, batch size) requests: with fewer, the timed run met
    the full batch's shapes first and paid their CUDA graph captures (on the H200 at batch 16,
    25 captures in a timed run of 58 rounds after a 4-request warm-up)."""
    from test_engine import prompts_of

    from draftsman.generate import StopRules
    from draftsman.sampling import SamplingParams
    from draftsman.session import PlainSession

    target = draftsman.load_target(tiny_llama_dir)
    seen = []
    drive = bench.drive_session

    def counting_drive(session, requests, max_running, *a, **k):
        seen.append((len(requests), max_running))
        return drive(session, requests, max_running, *a, **k)

    monkeypatch.setattr(bench, "drive_session", counting_drive)
    workload = bench.Workload(prompts_of([5, 6, 7, 8, 9, 4]), StopRules(3, eos_ids=frozenset()),
                              SamplingParams(temperature=0.0), warmup=1)
    for bs, expected in ((1, 1), (4, 4), (16, 6)):  # (capped by the prompts there are)
        seen.clear()
        bench.warm_up(PlainSession(target, 32), workload, bs)
        assert seen == [(expected, bs)]


def test_table_and_plots(inproc):
    stdout, _, plots = inproc
    assert "tok/s" in stdout and "acceptance per position" in stdout and "spec-s2-k2-n7" in stdout
    import matplotlib.image

    for name in ("acceptance_per_position.png", "speedup_vs_batch_size.png"):
        path = plots / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_sampling_reports_no_identity(pair):
    target_dir, drafter_dir, dataset = pair
    _, result = run_main("bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dataset", dataset,
                         "--num-prompts", "2", "--max-new-tokens", "4", "--spec-steps", "2", "--spec-topk", "1",
                         "--temperature", "0.8", "--seed", "3", "--warmup", "0", "--no-chat", "--json")
    assert result["identical"] is None and result["chat"] is False
    assert [a["arm"] for a in result["arms"]] == ["plain", "spec-s2-k1-n3"]


def test_ignore_eos_makes_every_arm_generate_max_new_tokens(pair, monkeypatch):
    """--ignore-eos: requests run to --max-new-tokens whatever they sample (every id made an EOS
    here, so without the flag each request stops at its first token)."""
    import draftsman.tokenizer

    target_dir, drafter_dir, dataset = pair
    monkeypatch.setattr(draftsman.tokenizer, "eos_token_ids", lambda *a, **k: set(range(256)))
    args = ["bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dataset", dataset,
            "--num-prompts", "3", "--max-new-tokens", "5", "--spec-steps", "2", "--spec-topk", "1",
            "--temperature", "0.8", "--seed", "3", "--warmup", "0", "--json"]
    _, stopped = run_main(*args)
    assert stopped["ignore_eos"] is False and all(a["output_tokens"] == 3 for a in stopped["arms"])
    _, full = run_main(*args, "--ignore-eos")
    assert full["ignore_eos"] is True
    assert all(a["output_tokens"] == 15 and a["finish_reasons"] == {"length": 3} for a in full["arms"])
    with pytest.raises(SystemExit, match="--ignore-eos is in-process only"):
        main(["bench", "--server-url", "http://127.0.0.1:9", "--ignore-eos"])


# ---- client mode against a fake OpenAI-compatible server ------------------------------------------

SPEC_FIELD = {"accept_length": 2.5, "accept_rate_per_position": [0.9, 0.6], "rounds": 4, "draft_tokens": 8,
              "accepted_tokens": 6}


class FakeServer:
    """Streams `tokens` chunks of text per request with `delay` seconds between them; optionally
    adds a spec_decoding field to the final chunk, or bumps draftsman:spec_decode counters."""

    def __init__(self, delay: float, spec_field: dict | None = None, counters: bool = False, tokens: int = 5):
        self.delay, self.spec_field, self.counters, self.tokens = delay, spec_field, counters, tokens
        self.requests: list[dict] = []
        self.drafts = self.accepted = 0
        self.per_pos = [0, 0, 0]
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: bytes, ctype: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "fake-model"}]}).encode(), "application/json")
                elif self.path == "/metrics" and server.counters:
                    self._send(server.metrics().encode(), "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, **body})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chat = self.path.endswith("chat/completions")
                n = min(server.tokens, body["max_tokens"])
                for i in range(n):
                    time.sleep(server.delay)
                    choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                    choice["finish_reason"] = "length" if i == n - 1 else None
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
                if server.spec_field:
                    final["spec_decoding"] = server.spec_field
                if server.counters:
                    server.drafts, server.accepted = server.drafts + 4, server.accepted + 6
                    server.per_pos = [c + d for c, d in zip(server.per_pos, (3, 2, 1), strict=True)]
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def metrics(self) -> str:
        lines = ["# TYPE draftsman:spec_decode_num_drafts counter",
                 f'draftsman:spec_decode_num_drafts_total{{model_name="fake"}} {self.drafts}',
                 f'draftsman:spec_decode_num_draft_tokens_total{{model_name="fake"}} {self.drafts * 3}',
                 f'draftsman:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {self.accepted}',
                 'draftsman:spec_decode_num_drafts_created{model_name="fake"} 1.7e9']
        lines += [f'draftsman:spec_decode_num_accepted_tokens_per_pos_total{{model_name="fake",position="{i}"}} {c}'
                  for i, c in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def prompts_file(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": w} for w in WORDS])


def test_client_reads_tau_from_responses(prompts_file):
    with FakeServer(0.002, SPEC_FIELD) as spec, FakeServer(0.004) as plain:
        _, result = run_main("bench", "--server-url", spec.url + "/v1", "--baseline-url", plain.url,
                             "--dataset", prompts_file, "--max-new-tokens", "5", "--batch-sizes", "1,3",
                             "--warmup", "1", "--json")
    assert result["mode"] == "client" and result["model"] == "fake-model"
    assert result["accept_length"] == pytest.approx(2.5)
    assert result["accept_rate_per_position"] == pytest.approx([0.9, 0.6])
    arms = result["arms"]
    assert all(set(a) == ARM_SCHEMA for a in arms)  # the same keys as in-process
    assert [(a["arm"], a["batch_size"]) for a in arms] == [("server", 1), ("baseline", 1), ("server", 3),
                                                          ("baseline", 3)]
    for bs in (1, 3):
        served = next(a for a in arms if a["arm"] == "server" and a["batch_size"] == bs)
        base = next(a for a in arms if a["arm"] == "baseline" and a["batch_size"] == bs)
        assert served["acceptance_source"] == "response" and served["rounds"] == 4 * len(WORDS)
        assert base["accept_length"] is None
        assert served["output_tokens"] == base["output_tokens"] == 5 * len(WORDS)
        assert served["speedup"] == pytest.approx(served["tokens_per_s"] / base["tokens_per_s"])
        assert served["identical"] is True
        assert served["ttft_p50_ms"] > 0 and served["itl_p50_ms"] > 0 and served["tpot_p50_ms"] > 0
    assert result["speedup"] > 1  # the fake speculative server streams twice as fast
    bodies = spec.requests
    assert all(b["path"] == "/v1/chat/completions" and b["stream"] and b["messages"][0]["role"] == "user"
               for b in bodies)
    assert len(bodies) == 2 * (len(WORDS) + 1)  # two concurrencies, each with one warm-up request


def test_client_falls_back_to_metrics_and_raw_completions(prompts_file):
    with FakeServer(0.0, counters=True) as srv:
        _, result = run_main("bench", "--server-url", srv.url, "--model", "m", "--dataset", prompts_file,
                             "--num-prompts", "4", "--max-new-tokens", "3", "--concurrency", "2", "--no-chat",
                             "--warmup", "0", "--json")
    served = result["arms"][0]
    assert served["acceptance_source"].startswith("metrics")
    assert served["accept_length"] == pytest.approx(1 + 6 / 4)
    assert served["accept_rate_per_position"] == pytest.approx([0.75, 0.5, 0.25])
    assert served["rounds"] == 16 and served["output_tokens"] == 12
    assert result["speedup"] is None and any("baseline" in n for n in result["notes"])
    assert all(r["path"] == "/v1/completions" and r["model"] == "m" for r in srv.requests)


def test_client_without_acceptance_data_says_so(prompts_file):
    with FakeServer(0.0) as srv:
        _, result = run_main("bench", "--server-url", srv.url, "--dataset", prompts_file, "--num-prompts", "2",
                             "--max-new-tokens", "2", "--warmup", "0", "--json")
    assert result["accept_length"] is None and result["arms"][0]["acceptance_source"] is None
    assert any("no acceptance data" in n for n in result["notes"])


# ---- prompt sets and pure helpers -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mt-bench", "humaneval", "gsm8k", "alpaca", "mt_bench"])
def test_bundled_prompt_sets(name):
    prompts = bench.load_prompt_set(name)
    assert len(prompts) == 80 and all(isinstance(p, str) and p.strip() for p in prompts)
    assert bench.load_prompt_set(name, 5) == prompts[:5]


def test_bundled_prompt_contents():
    assert bench.load_prompt_set("mt-bench", 1)[0].startswith("Compose an engaging travel blog post")
    assert bench.load_prompt_set("humaneval", 1)[0].startswith("from typing import List")
    assert bench.load_prompt_set("gsm8k", 1)[0].startswith("Janet")


def test_prompt_file_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a bundled"):
        bench.load_prompt_set(tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"answer": "x"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: no prompt"):
        bench.load_prompt_set(bad)
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]},
                                                   {"instruction": "do", "input": "this"}])
    assert bench.load_prompt_set(sharegpt) == ["hi", "do\n\nthis"]


def test_latency_metrics():
    t = bench.Trace(start=1.0, deliveries=[1.5, 1.6, 2.0], num_tokens=5)
    assert bench.ttft(t) == pytest.approx(0.5)
    assert bench.tpot(t) == pytest.approx(0.5 / 4)
    assert bench.itls(t) == pytest.approx([0.1, 0.4])
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 99, 100):
        assert bench.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert bench.percentile([], 50) is None
    s = bench.latency_summary([t, bench.Trace(start=0.0, deliveries=[0.2], num_tokens=1)], 2.0)
    assert s["output_tokens"] == 6 and s["tokens_per_s"] == 3.0 and s["requests_per_s"] == 1.0
    assert s["tpot_p50_ms"] == pytest.approx(125.0)  # one-token requests have no TPOT


def test_spec_grid_keeps_valid_combinations():
    grid = bench.spec_grid([2, 4], [1, 3], [3, 5])
    names = [bench.arm_name(s) for s in grid]
    assert names == ["spec-s2-k1-n3", "spec-s2-k3-n3", "spec-s2-k3-n5", "spec-s4-k1-n3", "spec-s4-k1-n5",
                     "spec-s4-k3-n3", "spec-s4-k3-n5"]
    assert [bench.arm_name(s) for s in bench.spec_grid([3], [1], None)] == ["spec-s3-k1-n4"]
    with pytest.raises(ValueError, match="no valid"):
        bench.spec_grid([1], [1], [9])


def test_acceptance_aggregation():
    resp = bench.acceptance_from_responses([{"accept_length": 3.0, "accept_rate_per_position": [1.0, 1.0],
                                             "rounds": 1}, None,
                                            {"accept_length": 1.5, "accept_rate_per_position": [0.5, 0.0],
                                             "rounds": 3},
                                            {"accept_length": 0.0, "accept_rate_per_position": [0.0, 0.0],
                                             "rounds": 0}])  # ended at its first token: no weight
    assert resp["accept_length"] == pytest.approx((3.0 + 4.5) / 4)
    assert resp["accept_rate_per_position"] == pytest.approx([(1 + 1.5) / 4, 0.25])
    assert bench.acceptance_from_responses([None, {}]) is None
    before = bench.spec_counters('vllm:spec_decode_num_drafts_total 10\nvllm:spec_decode_num_accepted_tokens_total 5\n'
                                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5\n')
    after = bench.spec_counters('vllm:spec_decode_num_drafts_total 20\nvllm:spec_decode_num_accepted_tokens_total 17\n'
                                'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 13\n'
                                'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4\n')
    acc = bench.acceptance_from_counters(before, after)
    assert acc["accept_length"] == pytest.approx(2.2) and acc["accept_rate_per_position"] == pytest.approx([0.8, 0.4])
    assert bench.acceptance_from_counters(after, after) is None


def test_weight_bytes_count_active_experts(tiny_llama_dir, tiny_deepseek_dir):
    llama = draftsman.load_target(tiny_llama_dir)
    params = sum(p.numel() * 4 for p in llama.parameters())
    embed = llama.embed_tokens.weight
    assert bench.decode_weight_bytes(llama, 1) == params - embed.numel() * 4 + embed.shape[1] * 4
    ds = draftsman.load_target(tiny_deepseek_dir)
    moe = ds.config.moe
    experts = sum(p.numel() * 4 for n, p in ds.named_parameters() if ".experts." in n)
    rest = sum(p.numel() * 4 for n, p in ds.named_parameters() if ".experts." not in n) - ds.embed_tokens.weight.numel() * 4
    one = bench.decode_weight_bytes(ds, 1)
    assert one == pytest.approx(rest + ds.config.hidden_size * 4 + experts * moe.num_experts_per_tok / moe.n_routed_experts, abs=2)
    assert one < bench.decode_weight_bytes(ds, 64) <= rest + 64 * ds.config.hidden_size * 4 + experts
    assert bench.expected_active_experts(8, 2, 1) == pytest.approx(2)


@pytest.mark.parametrize("args,message", [
    (["--server-url", "http://127.0.0.1:9", "--drafter", "x"], "--drafter is for in-process"),
    (["--target", "x", "--spec-steps", "3"], "need --drafter"),
    (["--target", "x", "--spec-adaptive"], "need --drafter"),
    (["--server-url", "http://127.0.0.1:9", "--spec-adaptive"], "in-process mode"),
    (["--target", "x", "--baseline-url", "http://127.0.0.1:9"], "--baseline-url needs --server-url"),
    (["--target", "x", "--batch-sizes", "1,a"], "comma-separated integers"),
    (["--target", "x", "--dataset", "nope"], "neither a bundled"),
    (["--target", "x", "--join-wait-rounds", "-1"], "--join-wait-rounds must be >= 0"),
])
def test_bad_arguments_are_explained(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    assert message in str(exc.value.code)


def test_copy_bandwidth_is_cuda_only():
    assert bench.measure_copy_bandwidth(torch.device("cpu")) is None
