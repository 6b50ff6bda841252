"""Generate text with a target model, plainly or with EAGLE-3 speculative decoding.

Examples:
  draftsman generate --target DIR --prompt "Hello" --chat --max-new-tokens 64
  draftsman generate --target DIR --prompt-ids 1,2,3 --json
  draftsman generate --target DIR --drafter DRAFTER_DIR --prompt "Hi" --chat \
      --spec-steps 5 --spec-topk 4 --spec-draft-tokens 16

Speculation flags mean what SGLang's do: --spec-steps is the draft depth, --spec-topk the
branching per step, --spec-draft-tokens the verified tree's nodes including the root (a chain,
topk 1, has steps + 1). Output is the target's own, token for token at temperature 0.

With --json the last stdout line is one JSON object: token_ids (generated ids only; a list of
lists when several prompts are given), text (when the checkpoint has a tokenizer),
num_new_tokens, time_s, tokens_per_s, finish_reasons, and with --drafter also
accept_length (tau: tokens per target verify forward, over speculative rounds),
accept_rate_per_position, spec ({steps, topk, draft_tokens}, or {"adaptive": [those]}), and
spec_rounds / plain_rounds (per request: rounds it was decoded speculatively / plainly).

With --drafter, speculation is adaptive by default (--spec-policy): each round runs one of a few
speculation settings or a plain step, whichever is measured fastest right now, so a drafter that
cannot pay (sampling, large batches, slow verification) costs little more than plain decoding.
--spec-* flags pin one setting (--spec-policy fixed), as for experiments.
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

HELP = "decode prompts with a target, plainly or speculatively with --drafter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeat for a batch)")
    p.add_argument("--drafter", help="EAGLE-3 drafter directory: decode speculatively")
    p.add_argument("--spec-steps", type=int, default=None, help="draft depth (default 5; chain: 5)")
    p.add_argument("--spec-topk", type=int, default=None, help="branching per draft step (default 4)")
    p.add_argument("--spec-draft-tokens", type=int, default=None,
                   help="verified tree nodes incl. the root (default 16; steps + 1 when topk is 1)")
    add_spec_policy_arg(p)
    p.add_argument("--batch-size", type=int, default=None,
                   help="decode prompts in batches of this size (default: all together)")
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

    from draftsman.generate import StopRules
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
    decode = make_decoder(args, model, device)
    batch = args.batch_size or len(prompts)
    if batch < 1:
        raise SystemExit("error: --batch-size must be >= 1")
    parts = [decode(prompts[i : i + batch], rules, params) for i in range(0, len(prompts), batch)]
    out = merge_outputs(parts)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in out.token_ids] if tokenizer else None
    if not args.json or texts:
        for i, ids in enumerate(out.token_ids):
            shown = texts[i] if texts else ",".join(map(str, ids))
            print(shown if len(prompts) == 1 else f"[{i}] {shown}")
    if out.stats:
        rates = " ".join(f"{p:.2f}" for p in out.stats["accept_rate_per_position"])
        print(f"accept length (tau) {out.stats['accept_length']:.2f}; per position {rates}; "
              f"{out.stats['spec_rounds']} speculative and {out.stats['plain_rounds']} plain rounds "
              "(summed over requests)", file=sys.stderr)
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
        if out.stats:
            result["accept_length"] = round(out.stats["accept_length"], 4)
            result["accept_rate_per_position"] = [round(p, 4) for p in out.stats["accept_rate_per_position"]]
            result["spec"] = out.stats["spec"]
            rounds = [(r["spec_rounds"], r["plain_rounds"]) for r in out.stats["per_request"]]
            result["spec_rounds"] = rounds[0][0] if single else [s for s, _ in rounds]
            result["plain_rounds"] = rounds[0][1] if single else [p for _, p in rounds]
        print_json(result)
    return 0


SPEC_POLICY_HELP = (
    "adaptive (the default without --spec-* flags): each round speculate with one of a few settings "
    "(the tree 5/4/16, the tree 5/4/6, the chain 5; or just the --spec-* one) or decode plainly, "
    "whichever round times and acceptance measured while decoding say is fastest, so speculation "
    "that would lose falls back to plain decoding and is probed again later; fixed (the default "
    "with --spec-* flags): every round speculates with the --spec-* setting")


def add_spec_policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-policy", choices=("adaptive", "fixed"), default=None, help=SPEC_POLICY_HELP)


def spec_flags_given(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.spec_steps, args.spec_topk, args.spec_draft_tokens))


def spec_policy_from_args(args: argparse.Namespace):
    """(spec, candidates) for SpecEngine / SpecSession: a pinned SpecConfig and None (fixed
    policy), or None and the adaptive policy's candidates (the --spec-* setting alone when
    given, else DEFAULT_CANDIDATES)."""
    from draftsman.spec.adaptive import DEFAULT_CANDIDATES

    flags = spec_flags_given(args)
    policy = args.spec_policy or ("fixed" if flags else "adaptive")
    if policy == "fixed":
        return spec_config_from_args(args), None
    return None, (spec_config_from_args(args),) if flags else DEFAULT_CANDIDATES


def spec_config_from_args(args: argparse.Namespace):
    """SpecConfig from --spec-* flags; a missing --spec-draft-tokens defaults to the chain length
    when --spec-topk is 1."""
    from draftsman.spec.engine import SpecConfig

    default = SpecConfig()
    steps = args.spec_steps or default.steps
    topk = args.spec_topk or default.topk
    draft = args.spec_draft_tokens or (steps + 1 if topk == 1 else default.draft_tokens)
    try:
        return SpecConfig(steps=steps, topk=topk, draft_tokens=draft)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def make_decoder(args: argparse.Namespace, model, device):
    """generate_plain, or a SpecEngine's generate when --drafter is given."""
    from draftsman.generate import generate_plain

    if not args.drafter:
        if spec_flags_given(args) or args.spec_policy:
            raise SystemExit("error: --spec-* flags need --drafter")
        return lambda prompts, rules, params: generate_plain(model, prompts, rules, params)
    from draftsman.models.eagle3 import load_drafter
    from draftsman.spec.engine import SpecEngine

    spec, candidates = spec_policy_from_args(args)
    try:
        drafter = load_drafter(args.drafter, target=model, device=device, dtype=model.lm_head.weight.dtype,
                               inference=True)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"error: --drafter {args.drafter}: {e}") from None
    return SpecEngine(model, drafter, spec, candidates).generate


def merge_outputs(parts):
    """One GenerationOutput from consecutive batches (stats summed over rounds)."""
    from draftsman.generate import GenerationOutput
    from draftsman.spec.verify import merge_stats

    out = GenerationOutput([t for p in parts for t in p.token_ids], [r for p in parts for r in p.finish_reasons],
                           sum(p.time_s for p in parts))
    if parts[0].stats:
        out.stats = merge_stats([p.stats for p in parts])
    return out
