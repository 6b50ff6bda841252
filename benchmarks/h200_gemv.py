"""Batch-1 GEMVs of the Llama-3.1-8B decode step: cuBLAS (F.linear) against draftsman's Triton
GEMV (kernels/gemv.py) over a grid of its tile configurations, per weight shape and for the
whole step's chain of matmuls (32 layers of fused q/k/v, o, fused gate/up, down, then lm_head:
every weight of the model once), each replayed from a CUDA graph.

    python benchmarks/h200_gemv.py --out benchmarks/results/h200_gemv.json

Per shape, calls cycle over enough weight copies (>= 1 GiB) that L2 (50 MB) cannot serve them.
Reports GB/s and the fraction of the measured copy bandwidth; the chain's ms against the
floor (weight bytes / copy bandwidth). Checks every config's output against F.linear. Prints
one JSON line; --out keeps it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
from h200_decode import copy_bandwidth, cuda_time  # benchmarks/ is on sys.path when run as a script
from h200_json import write_results

from draftsman.kernels.gemv import gemv, sum_squares_parts

HIDDEN, INNER, VOCAB, LAYERS = 4096, 14336, 128256, 32
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN), "down": (HIDDEN, INNER),
          "lm_head": (VOCAB, HIDDEN)}
CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2, 4))]
# The fused decode layer's GEMVs (llama.LlamaDecoderLayer.decode_fused): RMSNorm prologues on q/k/v
# and gate/up that read the sums of squares the previous residual GEMV left ("norm_ss"), residual
# epilogues on o and down that write them ("ss_out"), and gate/up rows combined by SiLU in the
# gate/up epilogue ("glu", half the outputs). Their prologue work is repeated by every program.
FUSED = {"qkv": ("norm_ss",), "o": ("residual", "ss_out"), "gate_up": ("norm_ss", "glu"), "down": ("residual", "ss_out")}
# Other splits of the MLP's small ops between its two GEMVs (llama.CHAINED_GATE_UP): gate/up with
# only one of its fusions, or none of them and SiLU * up in the down GEMV's prologue ("swiglu");
# "norm": the prologue's own pass over x for the sum of squares. name -> (shape, fusions).
FUSED_VARIANTS = {"gate_up[glu]": ("gate_up", ("glu",)), "gate_up[norm_ss]": ("gate_up", ("norm_ss",)),
                  "gate_up[norm]": ("gate_up", ("norm",)), "down[swiglu]": ("down", ("swiglu", "residual", "ss_out"))}
FUSED_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                 for bn, bk, w, s in itertools.product((4, 8, 16, 32), (512, 1024), (4, 8), (2, 4))]


def graph_of(calls) -> torch.cuda.CUDAGraph:
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def time_calls(calls, iters: int = 5) -> float:
    """Seconds per call of a graph replaying `calls` back to back (best of 3)."""
    g = graph_of(calls)
    return min(cuda_time(g.replay, iters) for _ in range(3)) / len(calls)


def split_for(n: int, block_n: int, sms: int) -> int:
    """K splits so the grid has >= 2 programs per SM."""
    programs = -(-n // block_n)
    return 1 if programs >= 2 * sms else min(8, -(-2 * sms // programs))


def fused_inputs(gen: torch.Generator) -> dict:
    """Per fused shape: the GEMV's input row and kw(config) -> its fusion arguments (buffers for
    the sums of squares it writes depend on the config's block_n)."""
    out = {}
    for name, (shape, kinds) in ({k: (k, v) for k, v in FUSED.items()} | FUSED_VARIANTS).items():
        n, k = SHAPES[shape]
        n_out = n // 2 if "glu" in kinds else n
        x = torch.randn(1, 2 * k if "swiglu" in kinds else k, device="cuda", dtype=torch.bfloat16, generator=gen)
        fixed: dict = {}
        if "norm_ss" in kinds or "norm" in kinds:
            fixed["norm_weight"] = 1 + 0.1 * torch.randn(k, device="cuda", generator=gen).to(torch.bfloat16)
        if "norm_ss" in kinds:  # as the 512 partials an 8-wide o/down GEMV leaves
            fixed["norm_sum_squares"] = (x.float() ** 2).view(1, 512, -1).sum(-1)
        if "swiglu" in kinds:
            fixed["swiglu"] = True
        if "glu" in kinds:
            fixed["glu"] = True
        if "residual" in kinds:
            fixed["residual"] = torch.randn(1, n_out, device="cuda", dtype=torch.bfloat16, generator=gen)

        def kw(cfg: dict, fixed=fixed, n_out=n_out, ss="ss_out" in kinds) -> dict:
            parts = sum_squares_parts(n_out, cfg["block_n"])
            return fixed | ({"sum_squares_out": torch.empty(1, parts, device="cuda")} if ss else {})
        out[name] = {"x": x, "kw": kw, "shape": shape, "fusions": kinds}
    return out


def sweep_fused(gen: torch.Generator, bw: float, res: dict) -> dict:
    """Time the fused GEMVs (FUSED, then FUSED_VARIANTS) over FUSED_CONFIGS (weight copies as for
    the plain sweep); returns the best config of each."""
    inputs, best = fused_inputs(gen), {}
    for name, spec in inputs.items():
        n, k = SHAPES[spec["shape"]]
        nbytes = n * k * 2
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
              for _ in range(max(2, -(-(1 << 30) // nbytes)))]
        trials = []
        for cfg in FUSED_CONFIGS:
            try:
                kw = spec["kw"](cfg)
                t = time_calls([lambda w=w, c=cfg, kw=kw, x=spec["x"]: gemv(x, w, **kw, **c) for w in ws])
            except Exception as e:  # e.g. out of registers for a wide config
                trials.append(cfg | {"error": repr(e)[:200]})
                continue
            trials.append(cfg | {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw})
        ok = sorted((tr for tr in trials if "us" in tr), key=lambda tr: tr["us"])
        best[name] = ok[0] if ok else None
        row = {"fusions": list(spec["fusions"]), "best": best[name], "trials": ok[:5],
               "failed": [tr for tr in trials if "error" in tr][:3]}
        if name in FUSED:
            res["shapes"].setdefault(name, {})["fused"] = row
        else:
            res.setdefault("fused_variants", {})[name] = row
        print(name, "fused", best[name], flush=True)
        del ws
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (decode batch)")
    ap.add_argument("--fused-only", action="store_true", help="only the fused GEMVs' sweep (no plain sweep, no chain)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
                 "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_TBps": bw / 1e12, "shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = {k: torch.randn(args.rows, kk, device="cuda", dtype=torch.bfloat16, generator=gen) for k, (_, kk) in SHAPES.items()}
    best: dict = {}
    if args.fused_only:
        sweep_fused(gen, bw, res)
        write_results(args.out, res)
        print(json.dumps(res))
        return
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(1 << 30) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
        xi = x[name]
        ref = F.linear(xi.float(), ws[0].float())
        row = {"bytes": nbytes, "copies": copies}
        t = time_calls([lambda w=w, xi=xi: F.linear(xi, w) for w in ws])
        row["cublas"] = {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw}
        trials = []
        for cfg in CONFIGS:
            c = cfg | {"split_k": split_for(n, cfg["block_n"], sms)}
            try:
                err = (gemv(xi, ws[0], **c).float() - ref).abs().max().item()
                t = time_calls([lambda w=w, xi=xi, c=c: gemv(xi, w, **c) for w in ws])
            except Exception as e:  # e.g. out of shared memory/registers for a config
                trials.append(c | {"error": repr(e)[:200]})
                continue
            trials.append(c | {"us": t * 1e6, "fraction_of_copy_bw": nbytes / t / bw, "max_abs_err": err})
        ok = [tr for tr in trials if "us" in tr and tr["max_abs_err"] < 1e-2 * max(1.0, ref.abs().max().item())]
        row["triton_best"] = min(ok, key=lambda tr: tr["us"]) if ok else None
        row["triton_trials"] = sorted(ok, key=lambda tr: tr["us"])[:5]
        row["triton_failed"] = [tr for tr in trials if tr not in ok][:5]
        best[name] = row["triton_best"]
        res["shapes"][name] = row
        print(name, {"cublas": row["cublas"], "triton": row["triton_best"]}, flush=True)
        del ws
    try:
        fused_best = sweep_fused(gen, bw, res)
    except Exception as e:  # keep the plain sweep and chain; say what broke
        res["fused_error"], fused_best = repr(e)[:2000], {}
    # The step's whole matmul chain, every weight once (16 GB): cuBLAS vs the best configs.
    weights = [(name, torch.empty(SHAPES[name], device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen))
               for _ in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")]
    weights.append(("lm_head", torch.empty(SHAPES["lm_head"], device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)))
    total = sum(w.numel() * 2 for _, w in weights)
    chain = {"weight_bytes": total, "floor_ms": total / bw * 1e3}
    arms = {"cublas": lambda name, w: F.linear(x[name], w)}
    if all(best.values()):
        arms["triton"] = lambda name, w: gemv(x[name], w, **{k: best[name][k] for k in
                                                            ("block_n", "block_k", "num_warps", "num_stages", "split_k")})
        arms["mixed"] = lambda name, w: (arms["triton"] if best[name]["us"] < res["shapes"][name]["cublas"]["us"]
                                         else arms["cublas"])(name, w)
    fused_best = {name: c for name, c in fused_best.items() if name in FUSED}
    if fused_best and all(fused_best.values()):  # the decode layer's fused GEMVs, each with its best config
        inputs = fused_inputs(gen)
        cfgs = {name: {k: c[k] for k in ("block_n", "block_k", "num_warps", "num_stages")} for name, c in fused_best.items()}
        kws = {name: inputs[name]["kw"](cfgs[name]) for name in cfgs}
        arms["triton_fused"] = lambda name, w: (
            F.linear(x[name], w) if name == "lm_head" else gemv(inputs[name]["x"], w, **kws[name], **cfgs[name]))
    for arm, fn in arms.items():
        g = graph_of([lambda name=name, w=w, fn=fn: fn(name, w) for name, w in weights])
        ms = min(cuda_time(g.replay, 5) for _ in range(3)) * 1e3
        chain[arm] = {"ms": ms, "fraction_of_floor": chain["floor_ms"] / ms}
        del g
    res["chain_8b"] = chain
    print("chain", chain, flush=True)
    write_results(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if k != "shapes"}))


if __name__ == "__main__":
    main()
