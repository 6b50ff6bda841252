"""Write a trained drafter as the package ships it: bf16 weights (vocabulary maps unchanged),
`torch_dtype` bfloat16, and the held-out evaluation next to it.

    python recipes/reference/publish_drafter.py RUN_DIR OUT_DIR [--eval eval.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a drafter directory written by draftsman train (fp32 master weights)")
    ap.add_argument("out_dir")
    ap.add_argument("--eval", help="eval-drafter --json output to keep as eval.json")
    args = ap.parse_args()
    src, out = Path(args.run_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if args.eval:
        shutil.copy(args.eval, out / "eval.json")
    size = (out / "model.safetensors").stat().st_size
    params = sum(v.numel() for k, v in tensors.items() if v.is_floating_point())
    print(json.dumps({"out": str(out), "parameters": params, "bytes": size}))


if __name__ == "__main__":
    main()
