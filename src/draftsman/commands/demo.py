"""Plain vs speculative decoding on the embedded reference pair (or your own models).

Loads the target and its EAGLE-3 drafter, decodes a handful of chat prompts greedily, once
plainly and once speculatively, and prints tokens/s of each, the speed-up, the acceptance
length τ (tokens per target forward), per-position acceptance, and whether the two outputs are
identical (they must be: speculation is lossless).

  draftsman demo                      # the embedded reference pair, on CPU
  draftsman demo --json               # the same, one JSON object on the last line
  draftsman demo --target DIR --drafter DIR --prompt "..." --prompt "..."

Speculation is adaptive, as everywhere by default (--spec-policy): each round runs one of a few
speculation settings or a plain step, whichever is measured fastest; --spec-* flags pin one.

JSON keys: identical, accept_length, accept_rate_per_position, plain_tokens_per_s,
spec_tokens_per_s, speedup, num_prompts, new_tokens, spec ({steps, topk, draft_tokens} or
{"adaptive": [those]}), spec_rounds, plain_rounds (rounds decoded speculatively / plainly,
summed over prompts), device, target, drafter.
"""

from __future__ import annotations

import argparse
import sys

from draftsman.cli import add_device_args, print_json, resolve_device, resolve_dtype
from draftsman.commands.generate import add_spec_policy_arg

HELP = "plain vs speculative decoding on the embedded reference pair: speed-up, τ, losslessness"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint directory, .gguf file or hub id (default: the embedded reference target)")
    p.add_argument("--drafter", help="EAGLE-3 drafter (default: the embedded reference drafter)")
    p.add_argument("--prompt", action="append", help="chat prompt (repeatable; default: built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    p.add_argument("--spec-steps", type=int, default=None, help="draft depth (default: the engine's)")
    p.add_argument("--spec-topk", type=int, default=None, help="branching per step")
    p.add_argument("--spec-draft-tokens", type=int, default=None, help="verified tree nodes incl. root")
    add_spec_policy_arg(p)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    add_device_args(p, "float32", "default float32, so plain and speculative outputs must match token for "
                    "token on any device; in bf16 a GPU's verify and decode GEMMs round near-tied logits "
                    "differently")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    import torch

    from draftsman.commands.generate import spec_policy_from_args
    from draftsman.generate import StopRules, generate_plain
    from draftsman.models import load_target
    from draftsman.models.eagle3 import load_drafter
    from draftsman.reference import DEMO_PROMPTS, reference_pair
    from draftsman.spec.engine import SpecEngine
    from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

    if (args.target is None) != (args.drafter is None):
        raise SystemExit("error: give both --target and --drafter, or neither (the embedded pair)")
    target_dir, drafter_dir = (args.target, args.drafter) if args.target else reference_pair()
    device = resolve_device(args.device)
    torch.set_grad_enabled(False)
    target = load_target(target_dir, device=device, dtype=resolve_dtype(args.dtype, device))
    drafter = load_drafter(drafter_dir, target=target, device=device, dtype=target.lm_head.weight.dtype,
                           inference=True)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise SystemExit(f"error: {target_dir} has no tokenizer; the demo needs one for chat prompts")
    texts = args.prompt or list(DEMO_PROMPTS)
    prompts = [encode_prompt(tokenizer, t, chat=True) for t in texts]
    rules = StopRules(args.max_new_tokens, frozenset(eos_token_ids(target_dir, target.config.eos_token_ids, tokenizer)))
    engine = SpecEngine(target, drafter, *spec_policy_from_args(args))
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    generate_plain(target, prompts[:1], StopRules(4))  # warm-up: first-call overheads out of the timing
    engine.generate(prompts[:1], StopRules(4))
    plain = [generate_plain(target, b, rules) for b in batches]
    spec = [engine.generate(b, rules) for b in batches]
    plain_ids = [t for o in plain for t in o.token_ids]
    spec_ids = [t for o in spec for t in o.token_ids]
    from draftsman.spec.verify import merge_stats

    stats = merge_stats([o.stats for o in spec])
    plain_tps = sum(o.num_new_tokens for o in plain) / sum(o.time_s for o in plain)
    spec_tps = sum(o.num_new_tokens for o in spec) / sum(o.time_s for o in spec)
    result = {
        "identical": plain_ids == spec_ids,
        "accept_length": round(stats["accept_length"], 4),
        "accept_rate_per_position": [round(p, 4) for p in stats["accept_rate_per_position"]],
        "plain_tokens_per_s": round(plain_tps, 2),
        "spec_tokens_per_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 4),
        "num_prompts": len(prompts),
        "new_tokens": sum(len(t) for t in spec_ids),
        "spec": stats.get("spec"),
        "spec_rounds": stats["spec_rounds"],
        "plain_rounds": stats["plain_rounds"],
        "device": str(device),
        "target": str(target_dir),
        "drafter": str(drafter_dir),
    }
    print_table(result, tokenizer.decode(spec_ids[0], skip_special_tokens=True), texts[0])
    if args.json:
        print_json(result)
    return 0 if result["identical"] else 1


def print_table(r: dict, sample: str, prompt: str) -> None:
    rates = " ".join(f"{p:.2f}" for p in r["accept_rate_per_position"])
    spec = r["spec"] or {}
    lines = [
        f"prompt 1: {prompt}",
        f"answer 1: {sample[:300]}{'...' if len(sample) > 300 else ''}",
        "",
        f"{'':24}{'plain':>12}{'speculative':>14}",
        f"{'tokens/s':24}{r['plain_tokens_per_s']:>12.1f}{r['spec_tokens_per_s']:>14.1f}",
        f"{'speed-up':24}{'':>12}{r['speedup']:>13.2f}x",
        f"{'accept length (tau)':24}{'1.00':>12}{r['accept_length']:>14.2f}",
        f"per-position acceptance: {rates}",
        f"speculation: {describe_spec(spec)}; {r['spec_rounds']} speculative and {r['plain_rounds']} plain rounds",
        f"{r['num_prompts']} prompts, {r['new_tokens']} new tokens on {r['device']}",
        f"outputs identical: {'yes' if r['identical'] else 'NO - speculation changed the output'}",
    ]
    print("\n".join(lines), file=sys.stdout)


def describe_spec(spec: dict) -> str:
    """A SpecEngine.describe() dict in words."""
    def shape(c: dict) -> str:
        return f"steps={c['steps']} topk={c['topk']} draft_tokens={c['draft_tokens']}"

    if "adaptive" in spec:
        return "adaptive, each round plain or one of [" + "; ".join(shape(c) for c in spec["adaptive"]) + "]"
    return "fixed, " + shape(spec)
