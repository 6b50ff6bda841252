"""Train an EAGLE-3 drafter for a target with the training-time test (TTT), as SpecForge and
SafeAILab/EAGLE do, from conversations the target answered (draftsman prepare-data).

Examples:
  draftsman train --target DIR --data train.jsonl --out drafter/ --epochs 2
  draftsman train --target DIR --data train.jsonl --out drafter/ --resume        # after a stop
  draftsman dump-hidden --target DIR --data train.jsonl --out states/
  draftsman train --target DIR --hidden-dir states/ --out drafter/               # offline
  torchrun --nproc-per-node 8 -m draftsman.cli train --target DIR --data d.jsonl --out o/ [--fsdp]
  draftsman train --target KIMI_DIR --data d.jsonl --out o/ --device-map auto     # target over all GPUs

--batch-size is the GLOBAL batch in sequences: with P processes and --micro-batch-size m, each
process accumulates batch/(P*m) micro-batches per optimizer step, so the run is the same whatever
P is. Each TTT step's loss is averaged over the masked positions of the whole global batch and
weighted 0.8^k. AdamW (betas 0.9, 0.95), warmup + cosine, gradient clipping 0.5, bf16 autocast on
CUDA with fp32 master weights.

OUT receives train_log.jsonl (one line per optimizer step), eval_log.jsonl (with --eval-data),
checkpoints/step-N/ (atomic; the latest --keep-checkpoints are kept) and, at the end, the drafter
itself (config.json + model.safetensors, loadable by draftsman generate --drafter, SGLang and
vLLM) with training_state/ beside it. Ctrl-C (or SIGTERM) finishes the current step, writes a
checkpoint and stops; --resume then continues with the next unseen batch, exactly.
"""

from __future__ import annotations

import argparse

from draftsman.cli import print_json

HELP = "train an EAGLE-3 drafter with the training-time test (online or from dump-hidden states)"


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --aux-layers {text!r}: expected comma-separated integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    p.add_argument("--data", nargs="+", default=[], help="JSONL conversation file(s) (prepare-data output)")
    p.add_argument("--hidden-dir", help="train from dump-hidden states instead of running the target")
    p.add_argument("--out", required=True, help="output directory (drafter, checkpoints, logs)")
    p.add_argument("--init", help="finetune this EAGLE-3 drafter (keeps its vocabulary and aux layers)")
    p.add_argument("--aux-layers", help="aux layer ids, input-of-layer convention (default 2,L//2,L-3)")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT unroll length (default 7)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    g.add_argument("--max-steps", type=int, help="optimizer steps (overrides --epochs)")
    p.add_argument("--stop-after", type=int,
                   help="stop with a checkpoint after this many steps of this run (schedule unchanged)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch in sequences (default 16)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per forward (default 1)")
    p.add_argument("--max-length", type=int, default=2048, help="cut conversations to this many tokens")
    p.add_argument("--num-samples", type=int, help="use only the first N usable records")
    p.add_argument("--draft-vocab-size", type=int, help="draft vocabulary size (default 32000)")
    p.add_argument("--warmup-ratio", type=float, default=0.02)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--eval-data", help="held-out JSONL (or dump-hidden dir) for periodic evaluation")
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end only "
                   "when --eval-data is given)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's dtype (default bf16 on GPU); the drafter trains in fp32 + autocast")
    p.add_argument("--drafter-hidden-size", type=int, help="drafter width (default: the target's)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP under torchrun")
    p.add_argument("--device-map", help="spread the target's layers over devices as a pipeline ('auto': all "
                   "visible GPUs, or cuda:0,cuda:1,...); one process, the drafter on the first device")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from draftsman.train.trainer import TrainConfig, train

    if not args.data and not args.hidden_dir:
        raise SystemExit("error: give --data FILE(S) or --hidden-dir DIR")
    import os

    if args.device_map and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("error: --device-map spreads one target over all GPUs in ONE process; under torchrun "
                         "each process holds its own target copy (use --hidden-dir states from a "
                         "--device-map dump-hidden run to train with several processes)")
    eval_every = args.eval_every
    max_steps = args.max_steps
    cfg = TrainConfig(
        target=args.target, out=args.out, data=args.data, hidden_dir=args.hidden_dir, init=args.init,
        aux_layers=parse_layers(args.aux_layers), ttt_steps=args.ttt_steps, epochs=args.epochs,
        max_steps=max_steps, stop_after=args.stop_after, lr=args.lr, batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, max_length=args.max_length, num_samples=args.num_samples,
        draft_vocab_size=args.draft_vocab_size, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, resume=args.resume, eval_data=args.eval_data, eval_samples=args.eval_samples,
        eval_every=eval_every, save_every=args.save_every, keep_checkpoints=args.keep_checkpoints,
        seed=args.seed, device=args.device, dtype=args.dtype, drafter_hidden_size=args.drafter_hidden_size,
        fsdp=args.fsdp, progress=not args.no_progress, device_map=args.device_map,
    )
    try:
        res = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        state = "stopped (resume with --resume)" if res.interrupted else "done"
        print(f"{state} at step {res.global_step}/{res.total_steps}; output in {res.out}")
        if args.json:
            print_json({"out": str(res.out), "global_step": res.global_step, "total_steps": res.total_steps,
                        "interrupted": res.interrupted, "losses": res.losses, "eval": res.last_eval})
    return 0
