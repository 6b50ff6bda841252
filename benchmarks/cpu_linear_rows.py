"""What a verify forward costs on a CPU against a one-token step: all 211 linears of
SmolLM2-135M (30 layers x q, k, v, o, gate, up, down, and the 49152-wide lm_head) at M rows of
input, float32 against bfloat16, on random weights (the shapes are what matter). On CPUs with
AMX-bf16, bf16 costs about the same at 1 and 32 rows; fp32 does not.

    python benchmarks/cpu_linear_rows.py > benchmarks/results/cpu_linear_rows.json

Prints one JSON line: {"torch_threads", "ms": {"float32": {M: ms}, "bfloat16": {M: ms}}} (the
median of 5 passes after 2 untimed ones).
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 576, 1536, 30, 49152, 192
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
          (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [(VOCAB, HIDDEN)]


def time_pass(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        F.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    out: dict[str, dict[int, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in SHAPES]
        name = str(dtype).removeprefix("torch.")
        out[name] = {}
        for rows in (1, 2, 4, 6, 8, 16, 32):
            inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}
            for _ in range(2):
                time_pass(weights, inputs)
            out[name][rows] = round(1e3 * sorted(time_pass(weights, inputs) for _ in range(5))[2], 1)
    print(json.dumps({"torch_threads": torch.get_num_threads(), "ms": out}))


if __name__ == "__main__":
    main()
