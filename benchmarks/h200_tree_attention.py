"""Tree (and decode) attention on the GPU: draftsman's Triton kernel (kernels/attention.py) over
its tile settings against SDPA, for 8B geometry (32 query heads, 8 KV heads, head dim 128) at
batch 1, T query tokens per row (a verified draft tree) over S cache slots with a tree mask.

    python benchmarks/h200_tree_attention.py --out benchmarks/results/h200_tree_attention.json

Each setting is checked against SDPA (fp32 reference) first, then timed as 20 calls replayed in
one CUDA graph (device time per call, launches excluded: the engine replays graphs too). One
JSON line: microseconds per call per (T, S, setting), and the fastest setting per (T, S).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

from draftsman.graphs import CudaGraphRunner
from draftsman.kernels.attention import decode_attention


def tree_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[1, T, S]: the committed prefix (S - T slots) and, among the T tree slots, the token
    itself and random earlier ones (a tree's ancestors)."""
    g = torch.Generator().manual_seed(0)
    tree = torch.rand(t, t, generator=g).tril() < 0.3
    tree |= torch.eye(t, dtype=torch.bool)
    return torch.cat([torch.ones(t, s - t, dtype=torch.bool), tree], 1)[None].to(device)


def device_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Device microseconds per replay of a captured graph (after one untimed replay)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def timed_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Device microseconds per call: `calls` calls captured in one graph, replayed `reps` times."""
    runner = CudaGraphRunner(lambda: [fn() for _ in range(calls)], {}, warmup=1)
    return device_us(runner.graph, reps) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,64")
    ap.add_argument("--slots", default="512,2048")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    h, hkv, d = 32, 8, 128
    settings = [{"block_t": bt, "num_warps": nw, "splits_x": sx}
                for bt in (1, 2, 4, 8, 16) for nw in (4, 8) for sx in (1, 2)]
    results, best, errors = {}, {}, {}
    for t in map(int, args.tokens.split(",")):
        for s in map(int, args.slots.split(",")):
            q = torch.randn(1, t, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16)
            mask = tree_mask(t, s, dev)
            scale = d ** -0.5
            ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                                 v.float().transpose(1, 2), attn_mask=mask[:, None], scale=scale,
                                                 enable_gqa=True).transpose(1, 2)
            key = f"T{t}_S{s}"
            row = {"sdpa": timed_us(partial(F.scaled_dot_product_attention, q.transpose(1, 2), k.transpose(1, 2),
                                            v.transpose(1, 2), attn_mask=mask[:, None], scale=scale, enable_gqa=True))}
            for st in settings:
                if st["block_t"] > t:
                    continue
                tb = -(-t // st["block_t"])
                blocks = -(-s // 64)
                splits = max(1, min(blocks, round(max(1, -(-128 // (hkv * tb))) * st["splits_x"])))
                name = f"bt{st['block_t']}_w{st['num_warps']}_sp{splits}"
                if name in row:
                    continue
                fn = partial(decode_attention, q, k, v, mask, scale, block_t=st["block_t"],
                             num_warps=st["num_warps"], splits=splits)
                try:
                    err = (fn().float() - ref).abs().max().item()
                    if err > 5e-2:
                        errors[f"{key}_{name}"] = err
                        continue
                    row[name] = timed_us(fn)
                except Exception as e:  # (a setting the GPU cannot run: out of shared memory)
                    errors[f"{key}_{name}"] = f"{type(e).__name__}: {str(e)[:120]}"
            row["default"] = timed_us(partial(decode_attention, q, k, v, mask, scale))  # as the engine calls it
            results[key] = row
            kernel = {n: us for n, us in row.items() if n not in ("sdpa",)}
            name = min(kernel, key=kernel.get)
            best[key] = {"setting": name, "us": kernel[name], "default_us": row["default"], "sdpa_us": row["sdpa"]}
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "geometry": {"heads": h, "kv_heads": hkv, "head_dim": d, "batch": 1}, "best": best, "us": results,
           "errors": errors}
    write_results(args.out, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
