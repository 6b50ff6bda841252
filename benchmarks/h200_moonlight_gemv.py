"""Batch-1 GEMVs of the Moonlight-16B-A3B decode step (random bf16 weights): what tiles the
Triton kernels want at its shapes, against cuBLAS, each timed in a CUDA graph.

    python benchmarks/h200_moonlight_gemv.py --out benchmarks/results/h200_moonlight_gemv.json

Shapes: the fused q + kv_a projection (3648 x 2048), o (2048 x 2048), the fp32 router (64 x 2048),
each over the plain GEMV's tile grid (as h200_gemv.py, weight copies cycled past L2); and the
routed + shared experts' two GEMV kernels (`moe_experts_gemv` with 6 of 64 experts and the
shared pair: 92 MB of gate/up and 46 MB of down rows a call) over their (block_n, block_k),
each call routing to other experts so L2 cannot serve them. Reports us and the fraction of
the measured copy bandwidth (bytes a call must read / time / copy bandwidth). Prints one JSON
line; --out keeps it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from h200_decode import copy_bandwidth  # benchmarks/ is on sys.path when run as a script
from h200_gemv import CONFIGS, split_for, time_calls
from h200_json import write_results

from draftsman.kernels.gemv import gemv
from draftsman.kernels.moe import moe_experts_gemv

HIDDEN, INNER, EXPERTS, TOP_K, SHARED = 2048, 1408, 64, 6, 2
SHAPES = {"q_kv_a": (3648, HIDDEN, torch.bfloat16), "o": (HIDDEN, HIDDEN, torch.bfloat16),
          "router": (EXPERTS, HIDDEN, torch.float32)}
MOE_CONFIGS = [dict(block_n=bn, block_k=bk) for bn, bk in itertools.product((4, 8, 16, 32), (256, 512, 1024))]


def sweep_gemv(name: str, n: int, k: int, dtype: torch.dtype, bw: float, sms: int, gen) -> dict:
    """cuBLAS and every plain GEMV config at one shape, weight copies cycled past L2."""
    nbytes = n * k * dtype.itemsize
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.02
          for _ in range(max(2, -(-(1 << 30) // nbytes)))]
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    ref = F.linear(x.float(), ws[0].float())
    t = time_calls([lambda w=w: F.linear(x, w) for w in ws])
    row: dict = {"bytes": nbytes, "cublas": {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw}}
    trials = []
    for cfg in CONFIGS:
        c = cfg | {"split_k": split_for(n, cfg["block_n"], sms)}
        try:
            err = (gemv(x, ws[0], **c).float() - ref).abs().max().item()
            t = time_calls([lambda w=w, c=c: gemv(x, w, **c) for w in ws])
        except Exception as e:  # e.g. out of registers for a config
            trials.append(c | {"error": repr(e)[:200]})
            continue
        trials.append(c | {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw, "max_abs_err": err})
    ok = sorted((tr for tr in trials if "us" in tr and tr["max_abs_err"] < 1e-2 * max(1.0, ref.abs().max().item())),
                key=lambda tr: tr["us"])
    row |= {"triton_best": ok[0] if ok else None, "triton_trials": ok[:5],
            "triton_failed": [tr for tr in trials if tr not in ok][:5]}
    print(name, {"cublas": row["cublas"], "triton": row["triton_best"]}, flush=True)
    return row


def sweep_moe(bw: float, gen) -> dict:
    """moe_experts_gemv with the shared experts over MOE_CONFIGS; 8 calls a graph, each routed to
    other experts (48 of the 64 read per graph replay)."""
    gate, up = (torch.randn(EXPERTS, INNER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INNER, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    shared = (torch.randn(2 * SHARED * INNER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
              torch.randn(HIDDEN, SHARED * INNER, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    weights = torch.rand(1, TOP_K, device="cuda", generator=gen)
    order = torch.randperm(EXPERTS, device="cuda", generator=gen)
    ids = [order[i * TOP_K:(i + 1) * TOP_K][None] for i in range(8)]
    nbytes = (TOP_K + SHARED) * 3 * INNER * HIDDEN * 2  # rows a call must read
    ref = moe_experts_gemv(x, weights, ids[0], gate, up, down, shared).float()
    trials = []
    for cfg in MOE_CONFIGS:
        try:
            err = (moe_experts_gemv(x, weights, ids[0], gate, up, down, shared, **cfg).float() - ref).abs().max().item()
            t = time_calls([lambda i=i, c=cfg: moe_experts_gemv(x, weights, i, gate, up, down, shared, **c) for i in ids])
        except Exception as e:
            trials.append(cfg | {"error": repr(e)[:200]})
            continue
        trials.append(cfg | {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw, "max_abs_err": err})
    ok = sorted((tr for tr in trials if "us" in tr), key=lambda tr: tr["us"])
    row = {"bytes": nbytes, "best": ok[0] if ok else None, "trials": ok[:6],
           "failed": [tr for tr in trials if "error" in tr][:3],
           "default": next((tr for tr in ok if tr["block_n"] == 8 and tr["block_k"] == 512), None)}
    print("moe_experts_gemv", {"best": row["best"], "default": row["default"]}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "copy_bandwidth_TBps": bw / 1e12, "shapes": {}, "errors": {}}
    for name, (n, k, dtype) in SHAPES.items():
        try:
            res["shapes"][name] = sweep_gemv(name, n, k, dtype, bw, sms, gen)
        except Exception as e:  # keep the other shapes' figures; say what broke
            res["errors"][name] = repr(e)[:2000]
        write_results(args.out, res)
    try:
        res["moe_experts_gemv"] = sweep_moe(bw, gen)
    except Exception as e:
        res["errors"]["moe_experts_gemv"] = repr(e)[:2000]
    write_results(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if k != "shapes"}))


if __name__ == "__main__":
    main()
