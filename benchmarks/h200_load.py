"""Loading a multi-GB sharded safetensors checkpoint onto the GPU: draftsman's `load_target`
against HF transformers `from_pretrained(..., device_map=...)`, same files, same run.

    python benchmarks/h200_load.py --out benchmarks/results/h200_load_8b.json

Arms: draftsman (pinned, multi-threaded staging: weights.PinnedStager), draftsman_unstaged
(DRAFTSMAN_STAGED_LOAD=0: tensor by tensor, safetensors reading straight to the device), HF.
Writes a random bf16 checkpoint of the geometry (HF names, 5 GB shards + index, config.json)
under --dir, then loads it with each loader in turn (--repeats rounds, alternating; the files
were just written, so both read from a warm page cache: this measures deserialisation and the
host-to-device copy, not the disk). GB/s = checkpoint bytes / wall seconds to a usable model
(CUDA synchronised). Prints one JSON line; --out keeps it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path

import torch
from geometries import LLAMA_31_8B, MOONLIGHT_16B_A3B  # benchmarks/ is on sys.path as a script
from h200_json import write_results

from draftsman.config import parse_target_config
from draftsman.models import build_target, load_target
from draftsman.weights import build_empty, save_safetensors

GEOMETRIES = {"llama-3.1-8b": LLAMA_31_8B, "moonlight-16b-a3b": MOONLIGHT_16B_A3B,
              "tiny": dict(LLAMA_31_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024)}


def write_checkpoint(raw: dict, out: Path, shard_bytes: int, device: str) -> int:
    """Random bf16 weights in HF layout; returns the bytes written."""
    config = parse_target_config(raw)
    model = build_empty(lambda: build_target(config), device, torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    names = {"lm_head.weight": "lm_head.weight"}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                p.normal_(0, 0.02)
            hf = names.get(name, f"model.{name}")
            # stacked experts -> one tensor per expert, as HF checkpoints store them
            parts = _split_experts(hf, p) if config.family == "deepseek" else {hf: p}
            for k, v in parts.items():
                n = v.numel() * v.element_size()
                if size and size + n > shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][k] = v
                size += n
                total += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, out / fname)
        weight_map |= {k: fname for k in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw))
    return total


def _split_experts(name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if name.endswith(f"mlp.experts.{proj}"):
            base = name.removesuffix(f".{proj}")
            return {f"{base}.{e}.{proj}.weight": p[e] for e in range(p.shape[0])}
    return {name: p}


def timed_load(fn, device: str) -> float:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    t = time.perf_counter()
    model = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    del model
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=list(GEOMETRIES))
    ap.add_argument("--dir", default="/tmp/draftsman-load-bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    ap.add_argument("--out")
    args = ap.parse_args()
    import transformers

    raw = GEOMETRIES[args.geometry]
    path = Path(args.dir) / args.geometry
    t = time.perf_counter()
    nbytes = write_checkpoint(raw, path, int(args.shard_gb * 1e9), args.device)
    res = {"geometry": args.geometry, "device": args.device, "checkpoint_bytes": nbytes,
           "shards": len(list(path.glob("*.safetensors"))), "write_s": time.perf_counter() - t,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "date": time.strftime("%Y-%m-%d"), "page_cache": "warm (files just written)", "runs": []}
    def hf_load():
        auto = transformers.AutoModelForCausalLM
        try:
            return auto.from_pretrained(path, dtype=torch.bfloat16, device_map=args.device)
        except ValueError as e:  # device_map needs `accelerate`: load on the host, then move
            if "accelerate" not in str(e):
                raise
            res["hf_mode"] = "from_pretrained(...).to(device): accelerate not installed"
            return auto.from_pretrained(path, dtype=torch.bfloat16).to(args.device)

    res["hf_mode"] = f"from_pretrained(..., device_map={args.device!r})"
    def unstaged():  # tensor by tensor, each read by safetensors straight to the device
        os.environ["DRAFTSMAN_STAGED_LOAD"] = "0"
        try:
            return load_target(path, device=args.device, dtype=torch.bfloat16)
        finally:
            os.environ.pop("DRAFTSMAN_STAGED_LOAD")

    arms = {"draftsman": lambda: load_target(path, device=args.device, dtype=torch.bfloat16),
            "draftsman_unstaged": unstaged, "hf_from_pretrained": hf_load}
    for _ in range(args.repeats):
        for arm, fn in arms.items():
            s = timed_load(fn, args.device)
            res["runs"].append({"arm": arm, "s": s, "GB_per_s": nbytes / s / 1e9})
    for arm in arms:
        best = min(r["s"] for r in res["runs"] if r["arm"] == arm)
        res[f"{arm}_best_s"], res[f"{arm}_GB_per_s"] = best, nbytes / best / 1e9
    res["speedup_over_hf"] = res["hf_from_pretrained_best_s"] / res["draftsman_best_s"]
    if not args.keep:
        shutil.rmtree(path)
    write_results(args.out, res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
