"""Convert a GGUF file into a plain Hugging Face checkpoint directory.

Example:
  draftsman convert --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2-135m/
  draftsman convert --gguf model.gguf --out model-bf16/ --dtype bfloat16

The weights are dequantized through transformers' GGUF reader (needs the `gguf` and
`accelerate` packages: pip install 'draftsman[gguf]') and written as config.json,
model.safetensors, generation_config.json and the tokenizer with its chat template, which every
draftsman command and HF transformers read. Architectures: llama, mistral, qwen2, qwen3.

Every command's --target also takes the .gguf file itself: it is converted once (float32) into
draftsman's cache ($DRAFTSMAN_CACHE, else ~/.cache/draftsman) and reused from there.
"""

from __future__ import annotations

import argparse

from draftsman.cli import DTYPES, print_json

HELP = "dequantize a GGUF file into a plain HF checkpoint directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", required=True, help="the .gguf file")
    p.add_argument("--out", required=True, help="output checkpoint directory (new, or an earlier conversion to replace)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="dtype of the written weights (default float32: the dequantized values exactly; "
                        "bfloat16 halves the size)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from draftsman.target_source import TargetSourceError, convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out, DTYPES[args.dtype])
    except TargetSourceError as e:
        raise SystemExit(f"error: {e}") from None
    size = sum(f.stat().st_size for f in Path(out).iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {args.dtype})")
    if args.json:
        print_json({"out": str(out), "bytes": size, "dtype": args.dtype, "gguf": str(args.gguf)})
    return 0
