"""The weight reads a speculation round cannot avoid, timed: goal 2's floor (issue 10).

A round with a 64-token tree over the Llama-3.1-8B geometry (3 draft steps, top-8, the 8B-shaped
EAGLE-3 drafter of `h200_decode.py --arms rounds`) reads every target weight once for the verify
(64 rows) and the drafter's weights once per drafter forward: two tree steps over the top-8
frontier (8 rows) and the extension over the accepted path after the verify (4 rows, plus its fc
projection of the target's features). Each arm is the cuBLAS matmul chain of those weights alone
(F.linear, no attention, norms or anything else), replayed from a CUDA graph:

    python benchmarks/h200_round_floor.py --out benchmarks/results/h200_round_floor.json

* `step`: the target's chain at 1 row (a plain step's matmuls);
* `verify64`: the target's chain at 64 rows;
* `draft`: the drafter's three forwards;
* `round`: verify64 and draft in one graph;

and `round_over_step` = round / step: the ratio no round with this drafter can go below with
cuBLAS matmuls (goal 2 asks <= 1.3 of a whole plain step, which costs more than `step`).
`--plain-step-ms` adds the ratio to a measured plain step. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from h200_decode import copy_bandwidth  # benchmarks/ is on sys.path when run as a script
from h200_gemv import time_calls
from h200_json import write_results

HIDDEN, INNER, VOCAB, LAYERS = 4096, 14336, 128256, 32
TARGET = [(6144, HIDDEN), (HIDDEN, HIDDEN), (2 * INNER, HIDDEN), (HIDDEN, INNER)]  # per layer: q/k/v, o, gate/up, down
DRAFT_VOCAB = 32000
# The drafter's decoder layer reads [embedding | hidden] (2 x HIDDEN) in its q/k/v projection.
DRAFTER = [(6144, 2 * HIDDEN), (HIDDEN, HIDDEN), (2 * INNER, HIDDEN), (HIDDEN, INNER), (DRAFT_VOCAB, HIDDEN)]
FC = (HIDDEN, 3 * HIDDEN)  # the drafter's projection of three target layers' features


def weights(shapes: list[tuple[int, int]], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.empty(s, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen) for s in shapes]


def chain(ws: list[torch.Tensor], rows: int) -> list:
    """One F.linear per weight over `rows` rows of input (inputs made once, outside the graph)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in ws}
    return [lambda w=w, x=xs[w.shape[1]]: F.linear(x, w) for w in ws]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree-rows", type=int, default=8, help="rows of each tree step (top-k)")
    ap.add_argument("--tree-steps", type=int, default=2, help="drafter forwards over the tree (steps - 1)")
    ap.add_argument("--extend-rows", type=int, default=4, help="rows of the extension after the verify")
    ap.add_argument("--verify-rows", type=int, default=64)
    ap.add_argument("--plain-step-ms", type=float, help="a measured plain step, for round / plain step")
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    target = weights(TARGET * LAYERS + [(VOCAB, HIDDEN)], gen)
    drafter, fc = weights(DRAFTER, gen), weights([FC], gen)
    bw = copy_bandwidth()
    step = chain(target, 1)
    verify = chain(target, args.verify_rows)
    draft = [c for _ in range(args.tree_steps) for c in chain(drafter, args.tree_rows)]
    draft += chain(fc, args.extend_rows) + chain(drafter, args.extend_rows)
    arms = {"step": step, "verify64": verify, "draft": draft, "round": verify + draft}
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_gbs": bw / 1e9,
                 "args": vars(args)}
    target_bytes = sum(w.numel() * 2 for w in target)
    drafter_bytes = args.tree_steps * sum(w.numel() * 2 for w in drafter) + sum(w.numel() * 2 for w in drafter + fc)
    res["bytes"] = {"target": target_bytes, "draft": drafter_bytes}
    for name, calls in arms.items():
        res[f"{name}_ms"] = time_calls(calls) * len(calls) * 1e3
    res["round_over_step"] = res["round_ms"] / res["step_ms"]
    res["verify64_over_step"] = res["verify64_ms"] / res["step_ms"]
    res["draft_over_step"] = res["draft_ms"] / res["step_ms"]
    res["draft_floor_ms"] = drafter_bytes / bw * 1e3
    if args.plain_step_ms:
        res["round_over_plain_step"] = res["round_ms"] / args.plain_step_ms
    write_results(args.out, res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
