"""What an adaptive session's plain round costs beyond a plain session's step, with the embedded
reference pair at one batch size: the same requests decoded by a `PlainSession` and by an
adaptive `SpecSession` whose policy weighs its arms as usual but always answers plain (so the
round runs the policy, the readiness checks, the backlog and the drafter's catch-ups), asked
every round (`adaptive_plain`: its choice stays a speculative arm, so no plain hold applies) or
as a real session asks once plain decoding is the choice (`adaptive_held`: held for up to
hold_rounds rounds); and an adaptive session asked every round and answering the tree
(`adaptive_tree16`) against a fixed session of that tree (`tree16`): the policy's cost on the
speculative rounds where speculation pays.

    python benchmarks/h200_adaptive_overhead.py --out benchmarks/results/h200_adaptive_overhead.json

On the H200 the adaptive arm's plain rounds read 2.51 ms against 1.99 ms per plain step at
batch 64 (results/h200_batch_16_64_median.json). A third arm, `adaptive_bare`, runs the adaptive
session's plain rounds without the policy's work (no rates, no readiness questions). Per arm this
prints: wall ms per step (the catch-ups included), the policy's round clock (adaptive), host
microseconds per step in the session's and policy's methods (HOST_PARTS), the host cost of
launching each of its graphs alone, and with --kernel-profile from torch.profiler over
--profile-steps steps the kernels and their time per step (off by default: once the profiler
has run, every later graph launch in the process costs ~170 us more, which session 11 read as
the adaptive rounds' own cost). One JSON line; --out keeps it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import Counter

import torch
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

import draftsman
import draftsman.graphs
import draftsman.session
from draftsman.bench import load_prompt_set
from draftsman.cli import resolve_device, resolve_dtype
from draftsman.generate import StopRules
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, Request
from draftsman.spec.adaptive import PLAIN, AdaptivePolicy
from draftsman.spec.engine import SpecConfig, SpecSession
from draftsman.tokenizer import encode_prompt, load_tokenizer

ARMS = [SpecConfig(5, 1, 6), SpecConfig(5, 4, 6), SpecConfig(5, 4, 16)]  # h200_batch.py's


class PlainOnly(AdaptivePolicy):
    """The adaptive policy's work every round, its answer always plain decoding."""

    def choose(self, batch, ready=None, drain=None):
        super().choose(batch, ready)
        return PLAIN


class PlainHeld(AdaptivePolicy):
    """The policy as a real session meets it where speculation loses: every speculative arm is
    observed once as slow (1 s a round, nothing accepted) before the bucket's first choice, so
    the policy chooses plain decoding itself and the session holds that choice for up to
    hold_rounds rounds without asking (plain_hold)."""

    def choose(self, batch, ready=None, drain=None):
        for arm in self.candidates:
            if self.estimate(arm, batch).seconds is None:
                self.observe(arm, batch, 1.0, [0] * batch)
        return super().choose(batch, ready, drain)


class TreeAsked(AdaptivePolicy):
    """The policy's work every round, its answer always the tree (ARMS[2]): an adaptive session's
    speculative round against a fixed session's of the same tree."""

    def choose(self, batch, ready=None, drain=None):
        super().choose(batch, ready)
        return ARMS[2]


class Bare(AdaptivePolicy):
    """Plain decoding without the policy's work (no rates, no readiness questions): what the
    adaptive session's plain round costs by itself."""

    def choose(self, batch, ready=None, drain=None):
        self.round += 1
        return PLAIN


# Host-side parts of a step, timed by wrapping these methods (launches are asynchronous, so a
# part's time is host work; the round's one host sync is outside them, in its .tolist()).
# Nested parts count in each (choose calls _captured).
HOST_PARTS = {"session": ("run_step", "sample_next", "_emit", "_captured", "_catch_up", "_set_spans"),
              "policy": ("choose", "observe")}


# ... and inside run_step (module and class attributes, wrapped for the timed steps only): the
# graph key over the cache buffers, the table lookup with the input copies, the replay itself.
RUN_STEP_PARTS = [(draftsman.session, "padded_key", "run_step.padded_key"),
                  (draftsman.graphs.GraphTable, "run", "run_step.table_run"),
                  (draftsman.graphs.CudaGraphRunner, "__call__", "run_step.table_run.runner"),
                  (torch.cuda.CUDAGraph, "replay", "run_step.table_run.runner.replay")]


def host_parts(session, steps: int) -> dict:
    """Microseconds per step spent in each of HOST_PARTS over `steps` steps (methods present)."""
    spent: Counter = Counter()

    def timed(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    owners = {"session": session, "policy": getattr(session, "policy", None)}
    for owner, names in HOST_PARTS.items():
        for name in names:
            if owners[owner] is not None and hasattr(owners[owner], name):
                timed(owners[owner], name, f"{owner}.{name}")
    inner = [(o, n, getattr(o, n)) for o, n, _ in RUN_STEP_PARTS]
    for o, n, label in RUN_STEP_PARTS:
        timed(o, n, label)
    start = time.perf_counter()
    for _ in range(steps):
        session.step()
    total = time.perf_counter() - start
    for owner, names in HOST_PARTS.items():  # unwrap: the instance attributes go
        for name in names:
            if owners[owner] is not None and name in vars(owners[owner]):
                delattr(owners[owner], name)
    for o, n, fn in inner:
        setattr(o, n, fn)
    return {"wall_us_per_step": total / steps * 1e6} | {k: v / steps * 1e6 for k, v in sorted(spent.items())}


def kernel_profile(session, steps: int, device: torch.device) -> dict:
    """Kernels of `steps` session steps: count and device microseconds per step, top 8."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            session.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    kernels: Counter = Counter()
    calls: Counter = Counter()
    host: Counter = Counter()  # host-side ops (aten ops, CUDA runtime calls such as cudaGraphLaunch): self time
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            host[e.key] += e.self_cpu_time_total
    for e in prof.events():
        if device.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time
            calls[e.name] += 1
    top = [{"kernel": k[:90], "us_per_step": v / steps, "calls_per_step": calls[k] / steps}
           for k, v in kernels.most_common(8)]
    host_top = [{"op": k[:90], "self_us_per_step": v / steps} for k, v in host.most_common(12)]
    return {"kernels_per_step": sum(calls.values()) / steps, "kernel_us_per_step": sum(kernels.values()) / steps,
            "top": top, "host_top": host_top}


def launch_us(runner, reps: int = 50) -> dict:
    """Median host microseconds of `runner`'s graph.replay() call (the launch; the device is idle
    before it) and of the whole replay to a sync."""
    launch, whole = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        launch.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    return {"launch_us": statistics.median(launch) * 1e6, "replay_us": statistics.median(whole) * 1e6}


def replay_costs(modules: dict, skip: frozenset = frozenset()) -> dict:
    """launch_us of every graph captured so far for these modules (but those whose runner is in
    `skip`), by (module, step kind, rows)."""
    out = {}
    for name, module in modules.items():
        for key, runner in draftsman.graphs.graph_table(module).runners.items():
            if runner in skip:
                continue
            kind, rows = key[0][0], key[1][0][1][0]  # (kind, ...), ((input, shape, dtype), ...)
            out[f"{name}:{kind}:{rows}:{len(out)}"] = launch_us(runner)
    return out


def runners(session) -> frozenset:
    """The graph runners of the session's modules captured so far."""
    modules = [session.target, getattr(session, "drafter", None)]
    return frozenset(r for m in modules if m is not None for r in draftsman.graphs.graph_table(m).runners.values())


def run_arm(session, prompts: list[list[int]], steps: int, warmup: int, profile_steps: int,
            device: torch.device, kernels: bool = False, tokens_per_step: int = 1, temperature: float = 0.0) -> dict:
    """tokens_per_step: the most tokens a step emits per row (a speculative round: steps + 1), so
    no row finishes before the last profiled step (sessions 11-12 gave the tree arm one token a
    step: its rows were done before the timed steps ended)."""
    earlier = runners(session) if device.type == "cuda" else frozenset()
    rules = StopRules(max_new_tokens=tokens_per_step * (warmup + steps + 2 * profile_steps) + 8)
    params = SamplingParams(temperature=temperature, seed=0 if temperature > 0 else None)
    session.add([Request(i, p, rules, params) for i, p in enumerate(prompts)])
    for _ in range(warmup):  # captures every graph the timed steps replay (spans included)
        session.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        session.step()
        times.append(time.perf_counter() - t)
    times.sort()
    out = {"rows": session.num_running, "wall_ms_per_step_median": times[len(times) // 2] * 1e3,
           "wall_ms_per_step_mean": sum(times) / len(times) * 1e3}
    policy = getattr(session, "policy", None)
    if policy is not None:
        plain = [r for r in policy.summary() if r["arm"] == "plain" and r["round_ms"] is not None]
        out["policy_plain_round_ms"] = plain[-1]["round_ms"] if plain else None
    out["host_us_per_step"] = host_parts(session, profile_steps)
    if kernels:
        out |= kernel_profile(session, profile_steps, device)
    if device.type == "cuda":  # this arm's own graphs, launched alone while its caches live
        modules = {"target": session.target, "drafter": getattr(session, "drafter", None)}
        out["launches"] = replay_costs({k: m for k, m in modules.items() if m is not None}, skip=earlier)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (sampled rounds at T > 0)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per arm")
    ap.add_argument("--warmup", type=int, default=200, help="untimed steps first: they capture the graphs of the "
                    "spans the timed steps meet (spans double with the rows' length)")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--kernel-profile", action="store_true",
                    help="also each arm's kernels from torch.profiler: once it has run, every CUDA graph launch in "
                         "the process costs ~170 us more host time (CUPTI stays attached; 5 -> 175 us for a "
                         "512-kernel graph in results/h200_graph_launch.json), so the later arms' host figures "
                         "and every launch time measured after it are inflated")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir, device=device, dtype=dtype)
    drafter = draftsman.load_drafter(drafter_dir, target=target, device=device, dtype=dtype, inference=True)
    tok = load_tokenizer(target_dir)
    texts = load_prompt_set("mt-bench")
    prompts = [encode_prompt(tok, texts[i % len(texts)], chat=True) for i in range(args.batch)]
    tree = ARMS[2]
    tree_tokens = (tree.steps + 1) * (args.warmup // 4 + args.steps // 4 + 2 * args.profile_steps)
    max_len = max(map(len, prompts)) + max(args.warmup + args.steps + 2 * args.profile_steps, tree_tokens) + 16
    arm = functools.partial(run_arm, temperature=args.temperature)
    arms = {
        "plain": arm(PlainSession(target, max_len), prompts, args.steps, args.warmup, args.profile_steps, device,
                         args.kernel_profile),
        "adaptive_plain": arm(SpecSession(target, drafter, None, max_len, policy=PlainOnly(ARMS)), prompts,
                                  args.steps, args.warmup, args.profile_steps, device, args.kernel_profile),
        "adaptive_held": arm(SpecSession(target, drafter, None, max_len, policy=PlainHeld(ARMS)), prompts,
                                 args.steps, args.warmup, args.profile_steps, device, args.kernel_profile),
        "adaptive_bare": arm(SpecSession(target, drafter, None, max_len, policy=Bare(ARMS)), prompts,
                                 args.steps, args.warmup, args.profile_steps, device, args.kernel_profile),
        "tree16": arm(SpecSession(target, drafter, tree, max_len), prompts, args.steps // 4,
                          args.warmup // 4, args.profile_steps, device, args.kernel_profile, tree.steps + 1),
        "adaptive_tree16": arm(SpecSession(target, drafter, None, max_len, policy=TreeAsked(ARMS)), prompts,
                                   args.steps // 4, args.warmup // 4, args.profile_steps, device, args.kernel_profile,
                                   tree.steps + 1),
    }
    plain_ms = arms["plain"]["wall_ms_per_step_median"]
    ratios = {f"{name}_over_plain_step": arm["wall_ms_per_step_median"] / plain_ms
              for name, arm in arms.items() if name != "plain"}
    ratios["adaptive_tree16_over_tree16"] = (arms["adaptive_tree16"]["wall_ms_per_step_median"]
                                             / arms["tree16"]["wall_ms_per_step_median"])
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
              "temperature": args.temperature,
              "steps": args.steps, "date": time.strftime("%Y-%m-%d"), "arms": arms,
              **ratios}
    write_results(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
