"""Dump a target's states for offline drafter training (draftsman train --hidden-dir).

Example:
  draftsman dump-hidden --target DIR --data train.jsonl --out states/ [--with-logits]
  draftsman dump-hidden --target KIMI_DIR --data train.jsonl --out states/ --device-map auto

Per conversation: input_ids, loss_mask, the aux hidden states [T, 3H] at the drafter's aux layer
ids (input-of-layer convention), the final normed hidden state [T, H] (training computes the
teacher logits from it with the target's lm_head), and with --with-logits the logits [T, V].
Sharded safetensors plus index.json (target, aux layer ids, dtype, data fingerprint). Rerun the
same command after a stop: whole shards already written are skipped.
"""

from __future__ import annotations

import argparse

from draftsman.cli import add_device_args, print_json, resolve_device, resolve_dtype
from draftsman.commands.train import parse_layers

HELP = "dump a target's aux/final hidden states for offline drafter training"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    p.add_argument("--data", required=True, nargs="+", help="JSONL conversation file(s)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--aux-layers", help="aux layer ids, input-of-layer convention (default 2,L//2,L-3)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--num-samples", type=int, help="only the first N usable records")
    p.add_argument("--with-logits", action="store_true", help="also store the full logits (large)")
    p.add_argument("--shard-size", type=int, default=256, help="conversations per shard file")
    p.add_argument("--batch-size", type=int, default=4, help="conversations per target forward")
    add_device_args(p)
    p.add_argument("--device-map", help="spread the target's layers over devices as a pipeline: 'auto' "
                   "(all visible GPUs) or a list such as cuda:0,cuda:1")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from draftsman.models import load_target
    from draftsman.train.hidden_store import dump_hidden
    from draftsman.train.trainer import load_tokenized
    from draftsman.train.vocab import fingerprint_files

    device = resolve_device(args.device)
    target = load_target(args.target, device=device, dtype=resolve_dtype(args.dtype, device),
                         device_map=args.device_map)
    aux = parse_layers(args.aux_layers) or list(target.config.default_aux_layer_ids())
    try:
        examples = load_tokenized(args.target, args.data, args.max_length, args.num_samples)
        meta = {"target": str(Path(args.target).resolve()), "data": fingerprint_files(args.data),
                "max_length": args.max_length, "num_samples": args.num_samples}
        with tqdm(total=len(examples), desc="dump-hidden", dynamic_ncols=True) as bar:
            out = dump_hidden(target, examples, args.out, aux, meta, shard_size=args.shard_size,
                              batch_size=args.batch_size, with_logits=args.with_logits, progress=bar.update)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    tokens = sum(len(e.input_ids) for e in examples)
    print(f"{len(examples)} conversations, {tokens} tokens -> {out}")
    if args.json:
        print_json({"out": str(out), "num_examples": len(examples), "num_tokens": tokens, "aux_layer_ids": aux})
    return 0
