"""Measure what acceptance a drafter should get: teacher-forced per-step top-1 acceptance on
held-out conversations, and the acceptance length tau it predicts for a chain.

Example:
  draftsman eval-drafter --target DIR --drafter DRAFTER_DIR --data heldout.jsonl --json

Step k at index t feeds the true token x_{t+k+1} and the drafter's own hidden state of step k-1
(the training-time test, as a chain draft sees it) and checks the drafter's top-1 against the
target's argmax at t+k+1, over assistant tokens. A target argmax outside the draft vocabulary
counts as a miss. tau_pred = 1 + sum_k prod_{j<=k} a_k assumes the steps are independent;
tau_chain counts the joint event "steps 0..k all right at the same index" (no such assumption).
Compare with `draftsman generate --drafter ... --spec-topk 1 --json` (accept_length).

--json keys: num_samples, ttt_steps, positions_per_step, acceptance_per_step, tau_pred,
chain_acceptance, tau_chain, draft_vocab_coverage, loss_per_step.
"""

from __future__ import annotations

import argparse
import sys

from draftsman.cli import add_device_args, print_json, resolve_device, resolve_dtype

HELP = "teacher-forced per-step acceptance of a drafter and the tau it predicts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory")
    p.add_argument("--data", required=True, help="held-out JSONL conversations (or a dump-hidden directory)")
    p.add_argument("--num-samples", type=int, default=200, help="conversations to use (default 200)")
    p.add_argument("--ttt-steps", type=int, default=7, help="chain depth K (default 7)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4, help="conversations per forward")
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from draftsman.models import load_target
    from draftsman.models.eagle3 import load_drafter
    from draftsman.train.hidden_store import HeadOnlyTarget, HiddenStore
    from draftsman.train.trainer import OfflineSource, OnlineSource, evaluate, load_tokenized

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        if Path(args.data).is_dir():
            store = HiddenStore(args.data)
            target = HeadOnlyTarget.load(args.target, device, dtype)
            drafter = load_drafter(args.drafter, target=target, device=device, dtype=dtype, inference=True)
            if tuple(store.aux_layer_ids) != tuple(drafter.aux_layer_ids):
                raise ValueError(f"{args.data} holds aux layers {list(store.aux_layer_ids)}, the drafter reads "
                                 f"{list(drafter.aux_layer_ids)}")
            source = OfflineSource(store, target)
        else:
            target = load_target(args.target, device=device, dtype=dtype)
            drafter = load_drafter(args.drafter, target=target, device=device, dtype=dtype, inference=True)
            examples = load_tokenized(args.target, [args.data], args.max_length, args.num_samples)
            source = OnlineSource(examples, target, drafter.aux_layer_ids)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    source.set_draft_vocab(drafter.draft_token_ids)
    indices = list(range(min(len(source), args.num_samples)))
    res = evaluate(drafter, source, indices, args.ttt_steps, args.batch_size)
    rates = " ".join(f"{a:.3f}" for a in res["acceptance_per_step"])
    print(f"{res['num_samples']} conversations; per-step acceptance {rates}", file=sys.stderr)
    print(f"tau_pred {res['tau_pred']:.3f} (independent steps), tau_chain {res['tau_chain']:.3f} (joint) "
          f"for a chain of depth {args.ttt_steps}; draft vocabulary covers {res['draft_vocab_coverage']:.1%} "
          "of target choices", file=sys.stderr)
    if args.json:
        print_json(res)
    return 0
