"""What a plain session and an adaptive session decoding plainly do on the host outside their
model steps, counted: the aten ops dispatched per round and per join, with every model step
(`run_step`) memoized, so only the session's own work runs. On a GPU each non-view op is a
launch of ~5-10 us of host time; a launch-bound step (small models, small batches) pays them in
full, which timings on a shared machine cannot resolve to single ops. The adaptive session's
policy is `PlainHeld` (h200_adaptive_overhead.py: speculation observed slow, plain decoding
chosen and held as in real sessions where it loses). Static shapes and padded batches are
forced on, as on CUDA, so the counted path is the GPU's (its graphs replaced by the memo).

    python benchmarks/host_ops.py --out benchmarks/results/host_ops_cpu.json

Prints one JSON line: per (temperature, batch size, arm) ops, non-view ops and model steps per
round and per join, and the adaptive arm's non-view ops over the plain arm's; then, untraced,
the host microseconds per join and per round (held plain rounds and rounds that asked the
policy apart) and per request, and the adaptive arm's per-request host time over plain's. This
machine's ops are not a GPU's launches, but the host's share of a launch-bound step is the
same work: on the H100 at batch 1, T=1 the adaptive arm's rounds and joins took 2.2-2.7 ms a
request longer than plain decoding's in HumanEval and GSM8K (MT-bench: none), where
speculation ran 2 rounds in ~1,980 (results/never_slower_h100_reference_t1_r3_1a7b669.json).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from h200_adaptive_overhead import PlainHeld  # benchmarks/ is on sys.path when run as a script
from h200_json import write_results
from torch.utils._python_dispatch import TorchDispatchMode

import draftsman
from draftsman.bench import Workload, _requests, drive_session, load_prompt_set, make_session
from draftsman.generate import StopRules
from draftsman.graphs import pow2_ceil
from draftsman.sampling import SamplingParams
from draftsman.spec.adaptive import DEFAULT_CANDIDATES
from draftsman.spec.engine import SpecSession
from draftsman.tokenizer import encode_prompt, load_tokenizer

# Ops that make views or read scalars: no kernel launch on a GPU
VIEWS = frozenset({"select", "slice", "alias", "view", "unsqueeze", "expand", "_unsafe_view", "t", "transpose",
                   "permute", "lift_fresh", "_local_scalar_dense", "split", "detach", "squeeze"})


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def host_only(session) -> tuple:
    """The session with static shapes and padding on, its model steps memoized per (kind,
    input shapes): the first call of each runs, later ones return its outputs. Returns the
    session and a Counter whose "model_steps" counts run_step calls."""
    session.static = session.pad = session.graph_prefill = True
    memo: dict = {}
    calls: Counter = Counter()
    run_step = session.run_step

    def memoized(module, kind, fn, caches, **inputs):
        key = (kind, tuple((k, tuple(v.shape)) for k, v in inputs.items()))  # (kinds are graph keys: hashable)
        if key not in memo:
            memo[key] = run_step(module, kind, fn, caches, **inputs)
        calls["model_steps"] += 1
        return memo[key]

    session.run_step = memoized
    return session, calls


def count(session, model_steps: Counter, requests, batch: int) -> dict:
    """Ops per round (`step`) and per join (`add`) over one drive_session run."""
    totals = {"join": Counter(), "step": Counter()}
    calls, steps = Counter(), Counter()
    methods = {"join": session.add, "step": session.step}

    def counted(kind: str):
        def call(*args, **kwargs):
            before = model_steps["model_steps"]
            with OpCounter() as c:
                out = methods[kind](*args, **kwargs)
            totals[kind].update(c.ops)
            calls[kind] += 1
            steps[kind] += model_steps["model_steps"] - before
            return out
        return call

    session.add, session.step = counted("join"), counted("step")
    drive_session(session, requests, batch)
    del session.add, session.step
    out = {}
    for kind, ops in totals.items():
        n = max(calls[kind], 1)
        out[kind] = {"count": calls[kind], "ops": sum(ops.values()) / n,
                     "non_view_ops": sum(v for k, v in ops.items() if k not in VIEWS) / n,
                     "model_steps": steps[kind] / n,
                     "top": {k: round(v / n, 2) for k, v in ops.most_common() if k not in VIEWS}}
    return out


def host_time(session, requests_of, batch: int, passes: int) -> dict:
    """Host microseconds per request over `passes` drive_session runs (requests_of(i): pass i's
    requests): joins (`add`), and rounds (`step`), split for an adaptive session into rounds
    run on a held plain choice and rounds that asked the policy; with rounds per request."""
    spent, calls = Counter(), Counter()
    step, add = session.step, session.add
    policy = getattr(session, "policy", None)

    def kind() -> str:
        if policy is None:
            return "round"
        if hasattr(session, "_holding"):
            held = session._holding(len(session.rows))
        else:  # (sessions before commit 2795525: a hold stood for the same roster)
            key, bucket_, until, _ = session._hold
            held = key == session.roster and bucket_ == pow2_ceil(len(session.rows)) and policy.round < until
        return "held_round" if held and session._hold[3] is None else "asked_round"

    def timed(fn, name):
        def call(*args, **kwargs):
            k = name or kind()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[k] += time.perf_counter() - t
            calls[k] += 1
            return out
        return call

    session.step, session.add = timed(step, None), timed(add, "join")
    n = 0
    for i in range(passes):
        reqs = requests_of(i)
        n += len(reqs)
        drive_session(session, reqs, batch)
    del session.step, session.add
    out = {f"{k}_us": spent[k] / calls[k] * 1e6 for k in sorted(calls)}
    out |= {f"{k}s_per_request": calls[k] / n for k in sorted(calls) if k != "join"}
    return out | {"per_request_us": sum(spent.values()) / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--timed-passes", type=int, default=5, help="untraced passes over the prompts per arm, timed")
    ap.add_argument("--out")
    args = ap.parse_args()
    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device="cpu", dtype=torch.float32)
    drafter = draftsman.load_drafter(drafter_dir, target=target, device="cpu", dtype=torch.float32, inference=True)
    tok = load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, t, chat=True) for t in load_prompt_set(args.dataset, args.num_prompts)]
    rows = []
    for temperature in map(float, args.temperatures.split(",")):
        w = Workload(prompts, StopRules(max_new_tokens=args.max_new_tokens), SamplingParams(temperature=temperature),
                     seed=0)
        for bs in map(int, args.batch_sizes.split(",")):
            arms = {"plain": make_session(target, drafter, None, w),
                    "adaptive": SpecSession(target, drafter, None, w.max_len, seed=0,
                                            policy=PlainHeld(DEFAULT_CANDIDATES))}
            row = {"temperature": temperature, "batch_size": bs}
            for name, session in arms.items():
                session, model_steps = host_only(session)
                for i in range(2):  # the memo fills; the policy settles
                    drive_session(session, _requests(prompts, w, f"warmup{i}-"), bs)
                row[name] = count(session, model_steps, _requests(prompts, w), bs)
                row[name]["host"] = host_time(session, lambda i, w=w: _requests(prompts, w, f"timed{i}-"), bs,
                                              args.timed_passes)
            row["host_us_per_request_adaptive_over_plain"] = (row["adaptive"]["host"]["per_request_us"]
                                                              / row["plain"]["host"]["per_request_us"])
            for kind in ("step", "join"):
                row[f"{kind}_non_view_ops_adaptive_over_plain"] = (row["adaptive"][kind]["non_view_ops"]
                                                                   / row["plain"][kind]["non_view_ops"])
            rows.append(row)
    result = {"device": "cpu (the GPU's static path, model steps memoized)", "torch": torch.__version__,
              "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    write_results(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
