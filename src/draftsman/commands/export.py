"""Export an EAGLE-3 drafter for SGLang, vLLM or the `speculators` format.

Examples:
  draftsman export --drafter DRAFTER_DIR --to sglang --out drafter-sglang/ --target TARGET_DIR
  draftsman export --drafter DRAFTER_DIR --to vllm --out drafter-vllm/ --target TARGET_DIR
  draftsman export --drafter DRAFTER_DIR --to speculators --out drafter-spec/ \\
      --target moonshotai/Kimi-K2-Thinking --spec-steps 3
  draftsman export --drafter specforge-out/ --draft-config kimi-eagle3.json --to sglang --out d/

--drafter takes any layout draftsman reads: its own, SGLang/SpecForge, vLLM, SafeAILab/EAGLE,
speculators, or a SpecForge training state (training_state.pt, a {run}-stepN directory or a run
directory; with --draft-config when no config.json sits beside it). The input's aux-layer-id
convention is printed, and the output states its ids explicitly in the convention its engine
reads: sglang/vllm write eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of layer
i, +1 at capture) AND the top-level eagle_aux_hidden_state_layer_ids (vLLM: input of layer i),
so one directory serves both engines; speculators writes the top-level ids (vLLM reads them as
given) with its speculators_config (algorithm eagle3, greedy proposal of --spec-steps tokens,
verifier = --target). d2t/t2d, RoPE (theta, scaling) and max positions are kept; with a local
--target the drafter is checked against it, ids missing from the drafter take the target
default, and a drafter window shorter than the target's is raised to it with the rotary
frequencies pinned (SGLang refuses shorter drafts).

Every key and the engine code that reads it: draftsman/interop/formats.py, docs/deploy.md.
"""

from __future__ import annotations

import argparse

from draftsman.cli import DTYPES, print_json

HELP = "write a drafter that SGLang, vLLM or speculators load as-is"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from draftsman.interop.formats import EXPORT_FORMATS

    p.add_argument("--drafter", required=True, help="drafter directory (any supported layout) or training state")
    p.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="target engine / format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--target", help="target checkpoint directory, .gguf file or hub name (required for speculators)")
    p.add_argument("--draft-config", help="draft config json for a SpecForge training state")
    p.add_argument("--layer-id-convention", choices=["input", "output", "sglang", "vllm", "specforge", "eagle"],
                   help="how to read the input's eagle_config ids when the file is ambiguous")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="tensor dtype written (default: the drafter's torch_dtype, else bfloat16)")
    p.add_argument("--spec-steps", type=int, default=3,
                   help="speculators: proposal length vLLM uses as num_speculative_tokens (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    import torch

    from draftsman.config import ConfigError
    from draftsman.interop.export import export_drafter, resolve_target
    from draftsman.models.eagle3 import load_drafter
    from draftsman.weights import CheckpointError

    try:
        drafter = load_drafter(args.drafter, dtype=torch.float32, layer_id_convention=args.layer_id_convention,
                               draft_config=args.draft_config)
        dtype = DTYPES.get(args.dtype) or DTYPES.get(drafter.config.torch_dtype or "", torch.bfloat16)
        result = export_drafter(drafter, args.to, args.out, resolve_target(args.target), dtype, args.spec_steps)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    cfg = drafter.config
    print(f"read {args.drafter} as {drafter.source_format}: {cfg.layer_ids_source}")
    for note in result.notes:
        print(f"note: {note}")
    for key, ids in result.aux_layer_ids.items():
        print(f"wrote {key} = {ids}")
    print(f"{args.to} drafter ({len(result.tensors)} tensors, {str(dtype).removeprefix('torch.')}) -> {result.out}")
    if args.json:
        print_json({"out": str(result.out), "format": args.to, "source_format": drafter.source_format,
                    "source_layer_id_convention": cfg.layer_id_convention, "aux_layer_ids": result.aux_layer_ids,
                    "tensors": result.tensors, "notes": result.notes})
    return 0
