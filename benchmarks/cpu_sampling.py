"""What a sampled row's token costs on CPU before and after commit 373cc5c, on one vocabulary's
logits (default 49,152: SmolLM2's), at a decode step's rows and at a tree verify's nodes:

* before: warp_probs over per-row tensors (a session's sampling state), which sorted the
  vocabulary whenever top_k/top_p were tensors, also when every row had them off; then the
  exponential race (sampling.exponential_race, sample's CUDA path), one Exp(1) draw per vocabulary entry;
* after: the session's warp (DecodeSession._warp) with its rows' filters off, as sessions now
  pass them, then sampling.sample, which on CPU inverts one uniform per row.

Both arms alternate call by call; medians in ms. Prints one JSON line.

    python benchmarks/cpu_sampling.py --out benchmarks/results/cpu_sampling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draftsman.sampling import SamplingParams, batch_params, exponential_race, sample, warp_probs
from draftsman.session import DecodeSession


def time_arms(logits: torch.Tensor, state: dict, g: torch.Generator, iters: int) -> dict[str, list[float]]:
    """Seconds of each call of the two arms, alternating, after one untimed call each."""
    t, k, p = state["temperature"], state["top_k"], state["top_p"]
    arms = {"before": lambda: exponential_race(warp_probs(logits, t, k, p), g),
            "after": lambda: sample(DecodeSession._warp(logits, state, (False, False)), g)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():
        fn()
    for _ in range(iters):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--shapes", default="1,4,1x17,4x17", help="rows, or rows x tree nodes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        dims = [int(x) for x in shape.split("x")]
        logits = torch.randn(*dims, args.vocab, generator=g) * 4
        t, k, p = batch_params([SamplingParams(args.temperature)] * dims[0])
        if len(dims) > 1:  # per-row params broadcast over a tree's nodes
            t, k, p = t[:, None], k[:, None], p[:, None]
        times = time_arms(logits, {"temperature": t, "top_k": k, "top_p": p}, g, args.iters)
        med = {name: 1e3 * statistics.median(v) for name, v in times.items()}
        rows_out.append({"shape": shape, "before_ms": round(med["before"], 3), "after_ms": round(med["after"], 3),
                         "speedup": round(med["before"] / med["after"], 1)})
    result = {"vocab": args.vocab, "temperature": args.temperature, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "rows": rows_out}
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
