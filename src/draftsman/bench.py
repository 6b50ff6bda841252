"""Benchmark speculative decoding: arms side by side, with acceptance and a roofline.

The measuring core of `draftsman bench` (draftsman.commands.bench is the CLI, and its docstring
documents every JSON key). Pure pieces — prompt sets, per-request latency metrics, acceptance
from engine histograms / response fields / Prometheus counters, the speculation grid, the
weight-bytes roofline — sit beside the in-process driver, which runs a decoding session with
continuous batching: at most `batch_size` requests run at once and a finished request's slot
is refilled before the next round. The HTTP client mode lives in draftsman.bench_client.

Timing: a request's clock starts when it joins the session (or is sent, in client mode). Every
delivery of tokens is timestamped after the call that produced it returned; the engine reads
its tokens back to the host in that call, so on CUDA the stamp follows the device work.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from itertools import pairwise, product
from pathlib import Path

import torch

from draftsman.generate import StopRules
from draftsman.graphs import captures
from draftsman.sampling import SamplingParams
from draftsman.session import DecodeSession, PlainSession, Request
from draftsman.spec.adaptive import AdaptivePolicy
from draftsman.spec.engine import SpecConfig, SpecSession
from draftsman.spec.tree import max_draft_tokens
from draftsman.spec.verify import summarize_histogram
from draftsman.train.data import iter_jsonl

# ---- prompt sets ---------------------------------------------------------------------------------

PROMPT_SETS = {
    "mt-bench": "mt_bench.jsonl",
    "humaneval": "humaneval.jsonl",
    "gsm8k": "gsm8k.jsonl",
    "alpaca": "alpaca.jsonl",
}


def prompt_text(record: dict) -> str | None:
    """The first user turn of one JSONL record, from the field names common prompt sets use:
    prompt, question, text, turns[0], instruction (+ input), messages / conversations."""
    for key in ("prompt", "question", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns:
        first = turns[0]
        return first if isinstance(first, str) else first.get("content")
    if isinstance(record.get("instruction"), str):
        extra = record.get("input")
        return f"{record['instruction']}\n\n{extra}" if isinstance(extra, str) and extra else record["instruction"]
    for key, role_key, content_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        msgs = record.get(key)
        if isinstance(msgs, list):
            for m in msgs:
                if isinstance(m, dict) and m.get(role_key) in ("user", "human"):
                    return m.get(content_key)
    return None


def prompt_set_path(name_or_path: str | Path) -> Path:
    """A bundled set by name (mt-bench, humaneval, gsm8k, alpaca; `_` works for `-`) or a path."""
    key = str(name_or_path).lower().replace("_", "-")
    if key in PROMPT_SETS:
        return Path(str(resources.files("draftsman") / "assets" / "prompts" / PROMPT_SETS[key]))
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--dataset {name_or_path}: neither a bundled prompt set "
                         f"({', '.join(PROMPT_SETS)}) nor a JSONL file")
    return path


def load_prompt_set(name_or_path: str | Path, num_prompts: int | None = None) -> list[str]:
    """The first `num_prompts` prompts (all when None) of a bundled set or a JSONL file."""
    path = prompt_set_path(name_or_path)
    prompts: list[str] = []
    for lineno, record in iter_jsonl(path):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        text = prompt_text(record) if isinstance(record, dict) else record if isinstance(record, str) else None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{lineno}: no prompt found (expected a prompt, turns, question, "
                             "instruction, text, messages or conversations field)")
        prompts.append(text)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# ---- per-request timelines and their metrics -----------------------------------------------------


@dataclass
class Trace:
    """One request's timeline: when it started, when each delivery of tokens arrived, and what
    came back. `num_tokens` counts generated tokens returned to the user (the same for every arm)."""

    start: float
    deliveries: list[float] = field(default_factory=list)  # arrival time of each non-empty delivery
    num_tokens: int = 0
    output: list[int] | str | None = None
    finish_reason: str | None = None
    spec_decoding: dict | None = None  # a server's per-request acceptance fields, when sent
    counted_by_usage: bool | None = None  # client mode: num_tokens from the server's usage


def ttft(trace: Trace) -> float | None:
    return trace.deliveries[0] - trace.start if trace.deliveries else None


def tpot(trace: Trace) -> float | None:
    """Time per output token after the first (vLLM's TPOT): (last - first delivery) / (n - 1)."""
    if trace.num_tokens < 2 or not trace.deliveries:
        return None
    return (trace.deliveries[-1] - trace.deliveries[0]) / (trace.num_tokens - 1)


def itls(trace: Trace) -> list[float]:
    """Gaps between successive deliveries (a speculative round delivers several tokens at once)."""
    d = trace.deliveries
    return [b - a for a, b in pairwise(d)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 4)


def latency_summary(traces: Sequence[Trace], duration_s: float) -> dict:
    """Throughput and latency percentiles of one run (one arm at one batch size)."""
    tokens = sum(t.num_tokens for t in traces)
    firsts = [x for x in map(ttft, traces) if x is not None]
    per_tok = [x for x in map(tpot, traces) if x is not None]
    gaps = [g for t in traces for g in itls(t)]
    return {
        "num_requests": len(traces),
        "output_tokens": tokens,
        "duration_s": round(duration_s, 6),
        "tokens_per_s": tokens / duration_s if duration_s > 0 else None,
        "requests_per_s": len(traces) / duration_s if duration_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(firsts, 50)),
        "ttft_p99_ms": _ms(percentile(firsts, 99)),
        "tpot_p50_ms": _ms(percentile(per_tok, 50)),
        "tpot_p99_ms": _ms(percentile(per_tok, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
    }


# ---- acceptance, three ways ----------------------------------------------------------------------

NO_ACCEPTANCE = {"accept_length": None, "accept_rate_per_position": None, "rounds": None,
                 "draft_tokens": None, "accepted_tokens": None, "accept_length_histogram": None}

# Every arm dict carries every key (null when it does not apply), so the JSON schema is stable.
ARM_DEFAULTS = NO_ACCEPTANCE | {
    "acceptance_source": None, "speedup": None, "identical": None, "mismatched_requests": None,
    "weight_bytes_per_step": None, "decode_step_ms": None, "weight_bandwidth_gb_s": None,
    "bandwidth_fraction": None, "url": None, "adaptive": None, "graph_captures": None, "warmup_passes": None,
    "session_steps": None, "time_in_steps_s": None, "joins": None, "time_in_joins_s": None, "time_elsewhere_s": None,
    "durations_s": None, "catch_ups": None, "catch_up_s": None, "deferred_prefills": None, "spills": None,
    "spec_rounds": None, "plain_rounds": None,
}

ADAPTIVE = "adaptive"  # the arm whose sessions pick a speculation shape (or none) per round


def with_defaults(arm: dict) -> dict:
    """The arm's own keys first, then every ARM_DEFAULTS key it lacks (as null)."""
    return arm | {k: v for k, v in ARM_DEFAULTS.items() if k not in arm}


def acceptance_from_histograms(histograms: Iterable[Sequence[int]], spec: SpecConfig) -> dict:
    """τ and per-position acceptance from per-request histograms of accepted drafts per round
    (Request.histogram); p_i = rounds accepting >= i drafts / rounds, so τ = 1 + Σ p_i."""
    total = [0] * (spec.steps + 1)
    for hist in histograms:
        for i, count in enumerate(hist):
            total[i] += count
    s = summarize_histogram(total, spec.draft_tokens - 1)
    if not s["rounds"]:
        return dict(NO_ACCEPTANCE)
    return {"accept_length": s["accept_length"], "accept_rate_per_position": s["accept_rate_per_position"],
            "rounds": s["rounds"], "draft_tokens": s["drafted_tokens"], "accepted_tokens": s["accepted_tokens"],
            "accept_length_histogram": s["accept_length_histogram"]}


def acceptance_from_responses(fields: Sequence[dict | None]) -> dict | None:
    """Aggregate per-request `spec_decoding` fields ({accept_length, accept_rate_per_position,
    rounds, draft_tokens, accepted_tokens}) of a server, each request weighted by its rounds."""
    usable = [f for f in fields if isinstance(f, dict) and f.get("accept_length") is not None]
    # A request that ended before any verify round reports rounds 0 (and τ 0): weight 0, not 1.
    weights = [float(f["rounds"]) if isinstance(f.get("rounds"), int | float) else 1.0 for f in usable]
    total = sum(weights)
    if not usable or total <= 0:
        return None
    tau = sum(w * float(f["accept_length"]) for w, f in zip(weights, usable, strict=True)) / total
    depth = max(len(f.get("accept_rate_per_position") or []) for f in usable)
    per_pos = [0.0] * depth
    for w, f in zip(weights, usable, strict=True):
        for i, p in enumerate(f.get("accept_rate_per_position") or []):
            per_pos[i] += w * float(p)

    def total_of(key: str) -> int | None:
        vals = [f.get(key) for f in usable]
        return int(sum(vals)) if all(isinstance(v, int | float) for v in vals) else None

    rounds, accepted = total_of("rounds"), total_of("accepted_tokens")
    if rounds and accepted is not None:  # exact, where servers round the per-request τ
        tau = 1 + accepted / rounds
    return {"accept_length": tau, "accept_rate_per_position": [p / total for p in per_pos] if depth else None,
            "rounds": rounds, "draft_tokens": total_of("draft_tokens"), "accepted_tokens": accepted}


SPEC_METRIC_PREFIXES = ("draftsman:spec_decode", "vllm:spec_decode")


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    import re

    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    out = []
    for line in text.splitlines():
        m = line_re.match(line.strip())
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(label_re.findall(m.group(2) or "")), value))
    return out


def spec_counters(metrics_text: str) -> dict | None:
    """Speculation counters (draftsman: or vllm: spec_decode_*), summed over label sets:
    {source, drafts, draft_tokens, accepted, per_pos: {position: accepted}}; None if absent."""
    samples = parse_prometheus(metrics_text)
    for prefix in SPEC_METRIC_PREFIXES:
        counts: dict = {"source": prefix, "drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
        found = False
        for name, labels, value in samples:
            if not name.startswith(prefix + "_") or name.endswith("_created"):
                continue
            stem = name[len(prefix) + 1:].removesuffix("_total")
            key = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens",
                   "num_accepted_tokens": "accepted"}.get(stem)
            if key:
                counts[key] += value
                found = True
            elif stem == "num_accepted_tokens_per_pos" and "position" in labels:
                pos = int(labels["position"])
                counts["per_pos"][pos] = counts["per_pos"].get(pos, 0.0) + value
        if found:
            return counts
    return None


def acceptance_from_counters(before: dict | None, after: dict | None) -> dict | None:
    """τ = 1 + Δaccepted / Δdrafts and p_i = Δaccepted_at_position_i / Δdrafts over a run."""
    if after is None:
        return None
    before = before or {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    accepted = after["accepted"] - before["accepted"]
    per_pos = [(after["per_pos"][p] - before["per_pos"].get(p, 0.0)) / drafts for p in sorted(after["per_pos"])]
    return {"accept_length": 1 + accepted / drafts, "accept_rate_per_position": per_pos or None,
            "rounds": int(drafts), "draft_tokens": int(after["draft_tokens"] - before["draft_tokens"]),
            "accepted_tokens": int(accepted)}


# ---- speculative arms ----------------------------------------------------------------------------


def parse_int_list(text: str | None, flag: str) -> list[int] | None:
    """'1,4,16' -> [1, 4, 16]; None stays None."""
    if text is None:
        return None
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: expected integers >= 1")
    return values


def default_draft_tokens(steps: int, topk: int) -> int:
    """A chain verifies steps + 1 nodes; a tree SpecConfig's default, capped at what fits."""
    return steps + 1 if topk == 1 else min(SpecConfig().draft_tokens, max_draft_tokens(steps, topk))


def spec_grid(steps: Sequence[int] | None, topks: Sequence[int] | None,
              draft_tokens: Sequence[int] | None) -> list[SpecConfig]:
    """Every valid SpecConfig of the cross product, in flag order, duplicates dropped."""
    default = SpecConfig()
    out: list[SpecConfig] = []
    errors: list[str] = []
    for s, k in product(steps or [default.steps], topks or [default.topk]):
        for n in draft_tokens or [default_draft_tokens(s, k)]:
            try:
                spec = SpecConfig(steps=s, topk=k, draft_tokens=n)
            except ValueError as e:
                errors.append(str(e))
                continue
            if spec not in out:
                out.append(spec)
    if not out:
        raise ValueError("no valid speculation setting in the grid: " + "; ".join(errors))
    return out


def arm_name(spec: SpecConfig | str | None) -> str:
    if spec == ADAPTIVE:
        return "spec-adaptive"
    return "plain" if spec is None else f"spec-s{spec.steps}-k{spec.topk}-n{spec.draft_tokens}"


def spec_dict(spec: SpecConfig | str | None, specs: Sequence[SpecConfig]) -> dict | None:
    if spec is None:
        return None
    if spec == ADAPTIVE:
        return {"adaptive": [spec_dict(c, specs) for c in specs]}
    return {"steps": spec.steps, "topk": spec.topk, "draft_tokens": spec.draft_tokens}


# ---- roofline ------------------------------------------------------------------------------------


def expected_active_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts a batch of `tokens` touches under uniform routing: E(1 - (1 - k/E)^B)
    (= k for one token)."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


def decode_weight_bytes(model: torch.nn.Module, batch_size: int = 1) -> int:
    """Bytes of weights one plain decode step of `batch_size` rows reads: every parameter once,
    the embedding only for its looked-up rows (unless tied to the LM head), and for MoE layers
    only the routed experts the step activates (KV-cache reads are not counted)."""
    config = getattr(model, "config", None)
    moe = getattr(config, "moe", None)
    embed = getattr(model, "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    tied = embed is not None and lm_head is not None and lm_head.weight is embed.weight
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if embed is not None and p is embed.weight and not tied:
            nbytes = min(batch_size, p.shape[0]) * p.shape[1] * p.element_size()
        elif moe is not None and ".experts." in name and p.dim() >= 1 and p.shape[0] == moe.n_routed_experts:
            active = expected_active_experts(moe.n_routed_experts, moe.num_experts_per_tok, batch_size)
            nbytes = nbytes * active / moe.n_routed_experts
        total += nbytes
    return int(total)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write counted), the practical ceiling a
    decode step's weight reads are compared with; None off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    n = max(1 << 20, min(nbytes, free // 4))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * n / seconds


def roofline(weight_bytes: int, step_times: Sequence[float], copy_bandwidth: float | None) -> dict:
    """Median plain decode step time, the weight bandwidth it implies, and its fraction of the
    measured copy bandwidth (None off CUDA)."""
    step = percentile(step_times, 50)
    achieved = weight_bytes / step if step else None
    return {
        "weight_bytes_per_step": weight_bytes,
        "decode_step_ms": _ms(step),
        "weight_bandwidth_gb_s": None if achieved is None else round(achieved / 1e9, 3),
        "bandwidth_fraction": None if achieved is None or not copy_bandwidth else round(achieved / copy_bandwidth, 4),
    }


# ---- in-process driver ---------------------------------------------------------------------------


@dataclass
class SessionRun:
    traces: list[Trace]
    requests: list[Request]
    duration_s: float
    steps: list[tuple[float, int]]  # (seconds, running rows) of each round
    joins: list[tuple[float, int]]  # (seconds, requests) of each prefill of newcomers


def drive_session(session: DecodeSession, requests: Sequence[Request], max_running: int,
                  on_finish: Callable[[], None] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> SessionRun:
    """Continuous batching: keep at most `max_running` requests in the session, refilling freed
    slots (a prefill of the newcomers) before a round when the session's join coalescer says so
    (joins.JoinCoalescer: at once, or with more freed slots together). Requests' ids must be
    unique."""
    queue = deque(requests)
    traces = {r.request_id: Trace(start=0.0) for r in requests}
    steps: list[tuple[float, int]] = []
    joins: list[tuple[float, int]] = []
    t0 = clock()
    while queue or session.num_running:
        free = max_running - session.num_running
        if queue and free > 0 and session.joins.join_now(free, max_running):
            batch = [queue.popleft() for _ in range(min(free, len(queue)))]
            now = clock()
            for r in batch:
                traces[r.request_id].start = now
            events = session.add(batch)
            joins.append((clock() - now, len(batch)))
        else:
            rows, before = session.num_running, clock()
            session.waiting = len(queue)
            events = session.step()
            steps.append((clock() - before, rows))
        now = clock()
        for ev in events:
            trace = traces[ev.request_id]
            if ev.tokens:
                trace.deliveries.append(now)
                trace.num_tokens += len(ev.tokens)
            if ev.finish_reason is not None:
                trace.finish_reason = ev.finish_reason
                if on_finish:
                    on_finish()
    duration = clock() - t0
    for r in requests:
        traces[r.request_id].output = list(r.state.tokens)
    return SessionRun([traces[r.request_id] for r in requests], list(requests), duration, steps, joins)


@dataclass(frozen=True)
class Workload:
    """What every arm decodes: tokenized prompts, stop rules, sampling, batch sizes."""

    prompts: list[list[int]]
    rules: StopRules
    params: SamplingParams
    batch_sizes: tuple[int, ...] = (1,)
    warmup: int = 0
    seed: int | None = None
    compile: bool = False  # torch.compile the step forwards (DecodeSession's compile)
    graph_prefill: bool = True  # staged (graphed) prefills of newcomers where graphs run (DecodeSession's)
    warmup_passes: int = 1  # warm-up runs per arm at most; they stop after one that captured nothing
    repeats: int = 1  # timed runs per arm, interleaved across arms (bench_in_process)
    join_wait_rounds: int = 8  # the most rounds freed slots wait to fill together (joins.JoinCoalescer)

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.rules.max_new_tokens


def make_session(target, drafter, spec: SpecConfig | str | None, workload: Workload,
                 candidates: Sequence[SpecConfig] = ()) -> DecodeSession:
    """spec: None (plain), a SpecConfig, or ADAPTIVE (a fresh AdaptivePolicy over candidates)."""
    w = workload
    if spec is None:
        session = PlainSession(target, w.max_len, seed=w.seed, compile=w.compile)
    elif spec == ADAPTIVE:
        session = SpecSession(target, drafter, None, w.max_len, seed=w.seed,
                              policy=AdaptivePolicy(candidates), compile=w.compile)
    else:
        session = SpecSession(target, drafter, spec, w.max_len, seed=w.seed, compile=w.compile)
    session.graph_prefill = session.graph_prefill and w.graph_prefill
    session.joins.max_wait_rounds = w.join_wait_rounds
    return session


def _requests(prompts: Sequence[Sequence[int]], workload: Workload, prefix: str = "") -> list[Request]:
    return [Request(f"{prefix}{i}" if prefix else i, p, workload.rules, workload.params)
            for i, p in enumerate(prompts)]


def warm_up(session: DecodeSession, workload: Workload, batch_size: int) -> int:
    """Run the warm-up requests through the session, again while a pass captured CUDA graphs (up
    to workload.warmup_passes): a fixed arm repeats itself exactly, but an adaptive arm's choices
    (and so its shapes) differ from pass to pass. A pass runs at least one full batch (warmup
    requests, or batch_size when more): the shapes of a full batch and of its drain, which the
    timed run meets, are captured here rather than timed. Returns the passes run."""
    modules, passes = (session.target, getattr(session, "drafter", None)), 0
    prompts = workload.prompts[: max(workload.warmup, batch_size)]
    while workload.warmup and passes < workload.warmup_passes:
        before = captures(*modules)
        drive_session(session, _requests(prompts, workload, f"warmup{passes}-"), batch_size)
        passes += 1
        if captures(*modules) == before:
            break
    return passes


def time_split(run: SessionRun) -> dict:
    """Where a run's wall time went: session steps (rounds), joins (prefills of newcomers), and
    the rest (emitting tokens, bookkeeping), in seconds and as counts."""
    steps, joins = sum(t for t, _ in run.steps), sum(t for t, _ in run.joins)
    return {"session_steps": len(run.steps), "time_in_steps_s": steps, "joins": len(run.joins), "time_in_joins_s": joins,
            "time_elsewhere_s": run.duration_s - steps - joins}


def full_steps(steps: Sequence[tuple[float, int]], batch_size: int) -> list[float]:
    """Step times at full occupancy when there are any (the steady state), else all of them."""
    full = [t for t, rows in steps if rows == batch_size]
    return full or [t for t, _ in steps]


def bench_in_process(target, drafter, specs: Sequence[SpecConfig], workload: Workload,
                     copy_bandwidth: float | None = None,
                     on_finish: Callable[[], None] | None = None, adaptive: bool = False) -> list[dict]:
    """Plain decoding and each speculative setting (and, with `adaptive`, adaptive speculation
    over them) over the same prompts at every batch size. Returns one result dict per (arm,
    batch size): latency_summary keys plus acceptance, roofline (plain) and `identical`
    (speculative vs plain outputs at temperature 0). With workload.repeats > 1 every arm's
    session is warmed up first, then the timed runs go round the arms `repeats` times (each
    round starting one arm further on), and each arm reports its run of median duration
    (`durations_s`: all of them): a machine's drift during the run falls on every arm alike.
    Arms run plain decoding first, then the adaptive arm, then the fixed ones; results come in
    the order plain, fixed, adaptive."""
    arms: list[dict] = []
    greedy = workload.params.temperature == 0
    for bs in workload.batch_sizes:
        order = [None, *specs, *([ADAPTIVE] if adaptive else [])]
        # The adaptive arm runs next to plain decoding, its reference: run last, it came a minute
        # or more after it, behind every fixed arm's warm-up and run, and on the H100 the host's
        # speed has moved between arms run in turn (run_step's host time 219 against 92 us a
        # step, results/h100_adaptive_overhead_b1_f0702a7.json).
        runs_in = [0, *([len(order) - 1] if adaptive else []), *range(1, 1 + len(specs))]
        # Warm-up and timed runs share one session per arm, as a server keeps one for its
        # lifetime: its cache allocations, so the CUDA graphs captured over them in the warm-up
        # replay in the timed run (a new session's caches would need new captures, each costing
        # several rounds), and the adaptive arm's policy with its measurements. One repeat: each
        # session lives only for its arm.
        live = workload.repeats > 1
        sessions: dict = {}
        runs: dict = {i: [] for i in range(len(order))}  # (run, graph captures, catch-ups, catch-up s)
        results: dict = {}
        if live:
            sessions = {i: _warm_session(target, drafter, order[i], specs, workload, bs) for i in runs_in}
        for rep in range(workload.repeats):
            for j in range(len(order)):
                i = runs_in[(rep + j) % len(order)]  # (each repeat starts one arm further on)
                if i not in sessions:
                    sessions[i] = _warm_session(target, drafter, order[i], specs, workload, bs)
                session = sessions[i][0]
                before, drafter_work = captures(target, drafter), _drafter_work(session)
                run = drive_session(session, _requests(workload.prompts, workload), bs, on_finish)
                after = _drafter_work(session)
                runs[i].append((run, captures(target, drafter) - before, {k: after[k] - drafter_work[k] for k in after}))
                if not live:
                    results[i] = _arm_result(order[i], specs, bs, runs[i], sessions.pop(i), copy_bandwidth, target)
        if live:
            results = {i: _arm_result(spec, specs, bs, runs[i], sessions[i], copy_bandwidth, target)
                       for i, spec in enumerate(order)}
        plain_outputs = results[0].pop("_outputs")
        for i in range(1, len(order)):
            outputs = results[i].pop("_outputs")
            mismatched = sum(x != y for x, y in zip(outputs, plain_outputs, strict=True))
            results[i]["identical"] = (mismatched == 0) if greedy else None
            results[i]["mismatched_requests"] = mismatched if greedy else None
        arms += [results[i] for i in range(len(order))]
    return arms


DRAFTER_WORK = {"catch_ups": "catch_ups", "catch_up_s": "catch_up_seconds", "deferred_prefills": "deferred_prefills",
                "spills": "spills"}


def _drafter_work(session: DecodeSession) -> dict:
    """An adaptive session's counters of the drafter's work around plain rounds so far: catch-ups
    and their seconds, prefills deferred, backlogs spilled (zeros for other sessions)."""
    return {k: getattr(session, attr, 0) for k, attr in DRAFTER_WORK.items()}


def _warm_session(target, drafter, spec, specs: Sequence[SpecConfig], workload: Workload, bs: int) -> tuple:
    """(A new session of the arm, the warm-up passes it ran at batch size `bs`)."""
    session = make_session(target, drafter, spec, workload, specs)
    return session, warm_up(session, workload, bs)


def _arm_result(spec, specs: Sequence[SpecConfig], bs: int, runs: list, made: tuple, copy_bandwidth: float | None,
                target) -> dict:
    """One arm's result dict from its timed runs (the one of median duration reported) and its
    (session, warm-up passes); `_outputs` holds that run's outputs for bench_in_process."""
    session, passes = made
    ranked = sorted(runs, key=lambda r: r[0].duration_s)
    run, _, drafter_work = ranked[(len(ranked) - 1) // 2]
    arm = {"arm": arm_name(spec), "kind": "plain" if spec is None else "spec",
           "spec": spec_dict(spec, specs), "batch_size": bs, **latency_summary(run.traces, run.duration_s),
           "graph_captures": sum(r[1] for r in runs), "warmup_passes": passes, **time_split(run),
           "durations_s": [r[0].duration_s for r in runs]}
    if spec is None:
        arm |= roofline(decode_weight_bytes(target, bs), full_steps(run.steps, bs), copy_bandwidth)
    else:
        deepest = max(specs if spec == ADAPTIVE else [spec], key=lambda c: c.steps)
        arm |= acceptance_from_histograms((r.histogram for r in run.requests), deepest)
        arm["acceptance_source"] = "engine"
        arm["spec_rounds"] = sum(r.spec_rounds for r in run.requests)
        arm["plain_rounds"] = sum(r.plain_rounds for r in run.requests)
        if spec == ADAPTIVE:  # rounds mix shapes (and plain rounds): no single drafted count
            arm["draft_tokens"] = None
            arm["adaptive"] = session.policy.summary()
            # the drafter's work around plain rounds in the reported run: catch-ups (in its steps'
            # time), joins whose drafter prefill was deferred, backlogs spilled
            arm |= drafter_work
    arm["finish_reasons"] = count_reasons(run.traces)
    arm["_outputs"] = [t.output for t in run.traces]
    return with_defaults(arm)


def count_reasons(traces: Iterable[Trace]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in traces:
        key = t.finish_reason or "unknown"
        out[key] = out.get(key, 0) + 1
    return out


# ---- the report ----------------------------------------------------------------------------------


def add_speedups(arms: list[dict]) -> None:
    """speedup = arm tokens/s ÷ the plain arm's tokens/s at the same batch size (same run)."""
    plain = {a["batch_size"]: a["tokens_per_s"] for a in arms if a["kind"] == "plain"}
    for a in arms:
        base = plain.get(a["batch_size"])
        a["speedup"] = None if a["kind"] == "plain" or not base or a["tokens_per_s"] is None \
            else a["tokens_per_s"] / base


def headline(arms: Sequence[dict]) -> dict:
    """Top-level keys from the first batch size: the speculative arm with the highest tokens/s
    (first on ties) against plain decoding."""
    if not arms:
        return {}
    first = arms[0]["batch_size"]
    plain = next((a for a in arms if a["kind"] == "plain" and a["batch_size"] == first), None)
    specs = [a for a in arms if a["kind"] != "plain" and a["batch_size"] == first]
    best = max(specs, key=lambda a: a["tokens_per_s"] or 0.0) if specs else None
    verdicts = [a["identical"] for a in arms if a["kind"] != "plain" and a.get("identical") is not None]
    adaptive = next((a for a in specs if a["arm"] == arm_name(ADAPTIVE)), None)
    fixed = [a["tokens_per_s"] for a in specs if a is not adaptive and a["tokens_per_s"]]
    return {
        "adaptive_speedup": adaptive["speedup"] if adaptive else None,
        "adaptive_vs_best_fixed": adaptive["tokens_per_s"] / max(fixed) if adaptive and fixed else None,
        "best_arm": best["arm"] if best else None,
        "accept_length": best["accept_length"] if best else None,
        "accept_rate_per_position": best["accept_rate_per_position"] if best else None,
        "speedup": best["speedup"] if best else None,
        "plain_tokens_per_s": plain["tokens_per_s"] if plain else None,
        "spec_tokens_per_s": best["tokens_per_s"] if best else None,
        "bandwidth_fraction": plain.get("bandwidth_fraction") if plain else None,
        "identical": all(verdicts) if verdicts else None,
    }


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _pair(a: float | None, b: float | None) -> str:
    return f"{_fmt(a)}/{_fmt(b)}"


def format_table(result: dict) -> str:
    """The human-readable report: one row per arm and batch size, then acceptance per position."""
    cols = ["arm", "bs", "tok/s", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
            "tau", "speedup", "identical", "BW frac"]
    rows = []
    for a in result["arms"]:
        ident = {True: "yes", False: "NO", None: "-"}[a.get("identical")]
        rows.append([a["arm"], str(a["batch_size"]), _fmt(a["tokens_per_s"]), _fmt(a["requests_per_s"], ".2f"),
                     _pair(a["ttft_p50_ms"], a["ttft_p99_ms"]), _pair(a["tpot_p50_ms"], a["tpot_p99_ms"]),
                     _pair(a["itl_p50_ms"], a["itl_p99_ms"]), _fmt(a["accept_length"], ".2f"),
                     "-" if a.get("speedup") is None else f"{a['speedup']:.2f}x", ident,
                     _fmt(a.get("bandwidth_fraction"), ".1%") if a.get("bandwidth_fraction") is not None else "-"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True)))]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
              for r in rows]
    accept = [a for a in result["arms"] if a.get("accept_rate_per_position")]
    if accept:
        lines.append("")
        lines.append("acceptance per position (p_i = rounds accepting >= i drafts / rounds; tau = 1 + sum p_i):")
        for a in accept:
            rates = " ".join(f"{p:.3f}" for p in a["accept_rate_per_position"])
            src = f" [{a['acceptance_source']}]" if a.get("acceptance_source") else ""
            lines.append(f"  {a['arm']} bs={a['batch_size']}: tau {a['accept_length']:.3f} | {rates}{src}")
    plain = [a for a in result["arms"] if a["kind"] == "plain" and a.get("weight_bytes_per_step")]
    if plain:
        lines.append("")
        bw = result.get("copy_bandwidth_gb_s")
        ceiling = f"copy bandwidth {bw:.0f} GB/s" if bw else "no copy-bandwidth ceiling off CUDA"
        lines.append(f"roofline of plain decoding ({ceiling}):")
        for a in plain:
            lines.append(f"  bs={a['batch_size']}: {a['weight_bytes_per_step'] / 1e9:.3f} GB weights/step, "
                         f"step {_fmt(a['decode_step_ms'], '.3f')} ms -> {_fmt(a['weight_bandwidth_gb_s'], '.1f')} GB/s"
                         + (f" = {a['bandwidth_fraction']:.1%} of copy bandwidth" if a.get("bandwidth_fraction")
                            is not None else ""))
    if result.get("identical") is not None:
        lines.append("")
        lines.append("greedy speculative output identical to plain: " + ("yes" if result["identical"] else "NO"))
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ---- plots ---------------------------------------------------------------------------------------


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """acceptance_per_position.png (bars per speculative arm, first batch size) and
    speedup_vs_batch_size.png (a line per speculative arm); each only when it has data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = result["arms"]
    written: list[Path] = []
    first = arms[0]["batch_size"] if arms else None
    accept = [a for a in arms if a["batch_size"] == first and a.get("accept_rate_per_position")]
    if accept:
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        width = 0.8 / len(accept)
        for j, a in enumerate(accept):
            rates = a["accept_rate_per_position"]
            xs = [i + 1 + (j - (len(accept) - 1) / 2) * width for i in range(len(rates))]
            bars = ax.bar(xs, rates, width=width, label=f"{a['arm']} (tau {a['accept_length']:.2f})")
            if len(accept) <= 4:
                ax.bar_label(bars, fmt="%.2f", fontsize=7)
        depth = max(len(a["accept_rate_per_position"]) for a in accept)
        ax.set_xticks(range(1, depth + 1))
        ax.set_xlabel("draft position i")
        ax.set_ylabel("acceptance p_i")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"Per-position acceptance (batch size {first})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "acceptance_per_position.png"
        fig.savefig(path)
        written.append(path)
    by_arm: dict[str, list[tuple[int, float]]] = {}
    for a in arms:
        if a.get("speedup") is not None:
            by_arm.setdefault(a["arm"], []).append((a["batch_size"], a["speedup"]))
    if by_arm:
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for name, points in by_arm.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        sizes = sorted({p[0] for pts in by_arm.values() for p in pts})
        if len(sizes) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel("speed-up over plain decoding")
        ax.set_title("Speed-up vs batch size")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "speedup_vs_batch_size.png"
        fig.savefig(path)
        written.append(path)
    return written
