"""Where the verify's attention time goes: draftsman's decode/tree attention kernel at 8B geometry
(32 query heads, 8 KV heads, head dim 128, batch 1) over a whole-cache buffer with a per-row
limit, as the engine calls it in a round, with variants that leave one part out.

    python benchmarks/h200_attention_diag.py --out benchmarks/results/h200_attention_diag.json

Each case is device us per call (20 calls in one CUDA graph, replayed), for: the default call;
one split (no combine: the kernel alone); a mask shared by all tokens ([1, 1, S]: no per-row
mask loads); num_stages 1/2/3/4; slots per block; the call inside torch.compile (an operator since
session 12).
Also the registers and spills of each compiled kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial

import torch
import torch.nn.functional as F
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script
from h200_tree_attention import timed_us, tree_mask

from draftsman.kernels import attention as attn


def compiled_kernels() -> list[dict]:
    """n_regs / n_spills / shared of every compiled variant of the attention kernels."""
    out = []
    for name in ("_decode_attention_kernel", "_combine_project_kernel"):
        fn = getattr(attn, name)
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for k in kernels.values():
                md = getattr(k, "metadata", None)
                out.append({"kernel": name, "n_regs": getattr(k, "n_regs", None),
                            "n_spills": getattr(k, "n_spills", None),
                            "num_warps": getattr(md, "num_warps", None), "num_stages": getattr(md, "num_stages", None),
                            "shared": getattr(md, "shared", None),
                            "constants": str({c: v for c, v in getattr(md, "constants", {}).items()})[:300]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="4096,705", help="cache slots (the whole-cache buffer), one run each")
    ap.add_argument("--used", default="256,1024", help="slots in use (the per-row limit)")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    h, hkv, d = 32, 8, 128
    scale = d ** -0.5
    results, errors = {}, {}
    for s, used, t in itertools.product(map(int, args.cache.split(",")), map(int, args.used.split(",")),
                                        map(int, args.tokens.split(","))):
        if used > s:
            continue
        q = torch.randn(1, t, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16)
        mask = torch.zeros(1, t, s, dtype=torch.bool, device=dev)
        mask[:, :, :used] = tree_mask(t, used, dev)
        limit = torch.full((1,), used, dtype=torch.int32, device=dev)
        shared = torch.zeros(1, 1, s, dtype=torch.bool, device=dev)
        shared[:, :, :used] = True
        ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                             v.float().transpose(1, 2), attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=True).transpose(1, 2)
        base = partial(attn.decode_attention, q, k, v, mask, scale, limit=limit)
        cases = {"default": base, "one_split": partial(base, splits=1),
                 "shared_mask": partial(attn.decode_attention, q, k, v, shared, scale, limit=limit),
                 "no_limit": partial(attn.decode_attention, q, k, v, mask, scale)}
        for st in (1, 2, 3, 4):
            cases[f"stages{st}"] = partial(base, num_stages=st)
        for bs in (32, 128):
            cases[f"block_s{bs}"] = partial(base, block_s=bs)
        # as the engine's compiled forwards call it (torch.compile around the call)
        compiled = torch.compile(lambda q, k, v, mask, limit: attn.decode_attention(q, k, v, mask, scale,
                                                                                   limit=limit), fullgraph=True)
        cases["compiled"] = partial(compiled, q, k, v, mask, limit)
        key = f"S{s}_T{t}_used{used}"
        row = {"sdpa_full_cache": timed_us(partial(F.scaled_dot_product_attention, q.transpose(1, 2),
                                                   k.transpose(1, 2), v.transpose(1, 2),
                                                   attn_mask=mask[:, None], scale=scale, enable_gqa=True))}
        for name, fn in cases.items():
            try:
                if name != "shared_mask":
                    err = (fn().float() - ref).abs().max().item()
                    if err > 5e-2:
                        errors[f"{key}_{name}"] = err
                row[name] = timed_us(fn)
            except Exception as e:
                errors[f"{key}_{name}"] = f"{type(e).__name__}: {str(e)[:160]}"
        results[key] = row
        print(key, json.dumps(row), flush=True)
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "us": results, "errors": errors, "kernels": compiled_kernels()}
    write_results(args.out, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
