"""Generate text with a target model.

Examples:
  draftsman generate --target DIR --prompt "Hello" --chat --max-new-tokens 64
  draftsman generate --target DIR --prompt-ids 1,2,3 --json

With --json the last stdout line is one JSON object: token_ids (generated ids only; a list of
lists when several prompts are given), text (when the checkpoint has a tokenizer),
num_new_tokens, time_s, tokens_per_s, finish_reasons.
"""

from __future__ import annotations

import argparse
import sys

from draftsman.cli import (
    add_device_args,
    add_sampling_args,
    print_json,
    resolve_device,
    resolve_dtype,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory of the target model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to --prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_sampling_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise SystemExit("error: --prompt-ids is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    import torch

    from draftsman.generate import StopRules, generate_plain
    from draftsman.models import load_target
    from draftsman.sampling import SamplingParams
    from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

    device = resolve_device(args.device)
    model = load_target(args.target, device=device, dtype=resolve_dtype(args.dtype, device))
    tokenizer = load_tokenizer(args.target)
    if args.prompt is not None:
        if tokenizer is None:
            raise SystemExit(f"error: {args.target} has no tokenizer; pass --prompt-ids instead of --prompt")
        prompts = [encode_prompt(tokenizer, text, args.chat) for text in args.prompt]
    else:
        prompts = [parse_ids(t) for t in args.prompt_ids]
    vocab = model.config.vocab_size
    for p in prompts:
        if max(p) >= vocab or min(p) < 0:
            raise SystemExit(f"error: prompt token ids must lie in [0, {vocab}), got {p}")
    rules = StopRules(args.max_new_tokens, frozenset(eos_token_ids(args.target, model.config.eos_token_ids, tokenizer)),
                      tuple(args.stop), tokenizer if args.stop else None)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    out = generate_plain(model, prompts, rules, params)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in out.token_ids] if tokenizer else None
    if not args.json or texts:
        for i, ids in enumerate(out.token_ids):
            shown = texts[i] if texts else ",".join(map(str, ids))
            print(shown if len(prompts) == 1 else f"[{i}] {shown}")
    print(f"{out.num_new_tokens} tokens in {out.time_s:.2f} s ({out.tokens_per_s:.1f} tok/s)", file=sys.stderr)
    if args.json:
        single = len(prompts) == 1
        result = {
            "token_ids": out.token_ids[0] if single else out.token_ids,
            "num_new_tokens": out.num_new_tokens,
            "time_s": round(out.time_s, 4),
            "tokens_per_s": round(out.tokens_per_s, 2),
            "finish_reasons": out.finish_reasons,
        }
        if texts is not None:
            result["text"] = texts[0] if single else texts
        print_json(result)
    return 0
