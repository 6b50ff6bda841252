"""What a decode or verify forward's projections cost on a CPU at M rows of input: the 121
products draftsman runs for SmolLM2-135M (30 layers x fused q/k/v, o, fused gate/up, down, and
the 49152-wide lm_head), through `F.linear` (MKL under the hood) and through draftsman's
DecodeLinear, which runs them on oneDNN with the weights reordered once into its blocked layout
(layers.cpu_packed_linear), float32 and bfloat16, random weights (the shapes are what matter).
The two arms alternate pass by pass, so a noisy machine's drift falls on both alike.

    python benchmarks/cpu_linear_rows.py --out benchmarks/results/cpu_linear_rows.json

Prints one JSON line: {"torch_threads", "cpu", "ms": {dtype: {arm: {M: ms}}}, "packed_speedup":
{dtype: {M: F.linear ms / packed ms}}} (per arm the median of --passes timed passes, after 2
untimed ones).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from draftsman.models.layers import use_cpu_packing

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 576 + 2 * 192
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [
    (VOCAB, HIDDEN)]
ROWS = (1, 2, 4, 8, 16, 32)


def linears(dtype: torch.dtype, packed: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    mods = [nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False) for n, k in SHAPES]
    for m in mods:
        use_cpu_packing(m, on=packed)
    return mods


def time_pass(mods: list[nn.Linear], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for m in mods:
        m(inputs[m.in_features])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args(argv)
    ms: dict[str, dict[str, dict[int, float]]] = {}
    speedup: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            arms = {"F.linear": linears(dtype, False), "packed": linears(dtype, True)}
            ms[name] = {arm: {} for arm in arms}
            for rows in ROWS:
                inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}
                times: dict[str, list[float]] = {arm: [] for arm in arms}
                for i in range(args.passes + 2):
                    for arm, mods in arms.items():
                        t = time_pass(mods, inputs)
                        if i >= 2:
                            times[arm].append(t)
                for arm in arms:
                    ms[name][arm][rows] = round(1e3 * sorted(times[arm])[len(times[arm]) // 2], 2)
            speedup[name] = {r: round(ms[name]["F.linear"][r] / ms[name]["packed"][r], 3) for r in ROWS}
    result = {"torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "ms": ms, "packed_speedup": speedup}
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
