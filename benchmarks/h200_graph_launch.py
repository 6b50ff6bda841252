"""What a CUDA graph launch costs the host, and what that cost depends on.

Session 11 measured `CUDAGraph.replay()` at 10-24 us of host time inside a plain decode session
but 192-298 us inside adaptive sessions, and 225-230 us for any graph launched alone right after
a sync, at equal device time. This times the launch (the replay() call, not the work) of
synthetic graphs of N small kernels, and of N kernels that keep the GPU busy ~1 ms, under the
conditions that differ between those cases: the device idle or busy when the launch is issued,
time spent on the host after the sync, a small kernel or copy issued right before, host ahead
of the device, two graphs alternating, another stream.

    python benchmarks/h200_graph_launch.py --out benchmarks/results/h200_graph_launch.json

One JSON line: median host microseconds of replay() per (graph, condition).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script
from h200_tree_attention import device_us

from draftsman.graphs import CudaGraphRunner


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def body_of(kind: str, n: int):
    """n nodes of one kind: 'tiny' (an in-place multiply), 'matmul' (1024-row matmuls into fresh
    buffers, ~1 ms of device work for 512), 'triton' (a Triton kernel), 'memcpy' (half copies
    between device buffers, captured as memcpy nodes)."""
    heavy = kind == "matmul"
    x = torch.randn(1024 if heavy else 4096, 1024 if heavy else 1, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def body() -> None:
        z = x
        for i in range(n):
            if heavy:
                z = z @ w
            elif kind == "triton":
                _bump[(4,)](x, x.numel(), BLOCK=1024)
            elif kind == "memcpy" and i % 2:
                y.copy_(x)
            else:
                x.mul_(1.0)

    return body, (x, w, y)


def capture(n: int, kind: str, pool=None) -> tuple[torch.cuda.CUDAGraph, float]:
    """A graph of n nodes of `kind` (body_of) and its device time in us."""
    body, keep = body_of(kind, n)
    g = CudaGraphRunner(body, {}, warmup=1, pool=pool).graph
    g._keep = keep  # the captured buffers live as long as the graph
    return g, device_us(g, 10)


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def launch_us(g: torch.cuda.CUDAGraph, before: Callable[[], None], reps: int = 40, sync: bool = True,
              other: torch.cuda.CUDAGraph | None = None) -> float:
    """Median host us of g.replay() after `before()` (and a device sync first unless not `sync`;
    `other` is replayed between, untimed, so the two alternate)."""
    times = []
    for _ in range(reps):
        if other is not None:
            other.replay()
        if sync:
            torch.cuda.synchronize()
        before()
        t0 = time.perf_counter()
        g.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times[5:]) * 1e6


def conditions(g: torch.cuda.CUDAGraph, other: torch.cuda.CUDAGraph) -> dict[str, float]:
    small = torch.zeros(64, device="cuda")
    pinned = torch.zeros(64, pin_memory=True)
    probe = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()

    def item_sync() -> None:
        probe.add_(1).item()  # a stream sync through a device-to-host copy, as .tolist() does

    def in_side(fn: Callable[[], float]) -> float:
        with torch.cuda.stream(side):
            return fn()

    out = {
        "idle_after_sync": launch_us(g, lambda: None),
        "idle_after_item_sync": launch_us(g, item_sync),
        "host_wait_50us": launch_us(g, lambda: spin(50)),
        "host_wait_200us": launch_us(g, lambda: spin(200)),
        "host_wait_1000us": launch_us(g, lambda: spin(1000)),
        "after_small_kernel": launch_us(g, lambda: small.add_(1)),
        "after_h2d_copy": launch_us(g, lambda: small.copy_(pinned, non_blocking=True)),
        "busy_2ms_sleep_kernel": launch_us(g, lambda: torch.cuda._sleep(4_000_000)),
        "host_ahead_no_sync": launch_us(g, lambda: None, sync=False),
        "alternating_two_graphs": launch_us(g, lambda: None, other=other),
        "side_stream": in_side(lambda: launch_us(g, lambda: None)),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.cuda.init()
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "date": time.strftime("%Y-%m-%d"), "graphs": {}}
    for n, kind in ((32, "tiny"), (128, "tiny"), (512, "tiny"), (512, "matmul"), (512, "triton"), (512, "memcpy")):
        g, dev_us = capture(n, kind)
        other, _ = capture(n, kind)
        name = f"{n}_{kind}"
        results["graphs"][name] = {"device_us": dev_us, "launch_us": conditions(g, other)}
        print(name, json.dumps(results["graphs"][name]), flush=True)
    # Many graphs alive (an adaptive session holds dozens): graph 0's launch as more are captured,
    # each in its own pool and all in one shared pool; then round-robin over all of them.
    for shared in (False, True):
        first, _ = capture(512, "tiny")
        pool = first.pool() if shared else None
        graphs, row = [first], {}
        for total in (1, 8, 32, 96):
            while len(graphs) < total:
                graphs.append(capture(512, "tiny", pool=pool)[0])
            row[f"graph0_with_{total}_alive"] = launch_us(first, lambda: None)
        times = []
        for i in range(3 * len(graphs)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs[i % len(graphs)].replay()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        row["round_robin_96"] = statistics.median(times) * 1e6
        results[f"many_graphs_{'shared_pool' if shared else 'own_pools'}"] = row
        print(row, flush=True)
        del graphs, first
    # Much device memory allocated (an 8B target and its caches)
    big = torch.empty(100 << 30, dtype=torch.uint8, device="cuda")
    g, _ = capture(512, "tiny")
    results["with_100GB_allocated"] = launch_us(g, lambda: None)
    del big
    # After torch.profiler has run once in the process (CUPTI attached): the same graph again
    before = launch_us(g, lambda: None)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        g.replay()
        torch.cuda.synchronize()
    results["profiler"] = {"before": before, "after": launch_us(g, lambda: None)}
    print(results["profiler"], flush=True)
    write_results(args.out, results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
