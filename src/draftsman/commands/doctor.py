"""Why is acceptance low? Check an EAGLE-3 drafter against its target, measure what acceptance it
should get and what an engine does get, and name the cause of the gap.

  draftsman doctor --target DIR --drafter DRAFTER_DIR
  draftsman doctor --target DIR --drafter DRAFTER_DIR --server-url http://127.0.0.1:30000 --json
  draftsman doctor --target DIR --drafter ORIGINAL --drafter FINETUNE      # side by side

Each line is PASS / WARN / FAIL (or SKIP, with the reason) with what was checked and the numbers:
  static        hidden sizes (fc width = 3 x target hidden), vocab, d2t (offsets in range and
                one-to-one; WARN for an all-zero d2t with a reduced vocabulary), t2d (marks exactly
                what d2t maps to), layer ids (present; the layers SGLang (+1 on eagle_config ids),
                vLLM (top-level ids as given) and draftsman each capture; FAIL when they disagree),
                rope (theta, scaling type and factor vs the target), max positions, tokenizer,
                chat template.
  expected      the target answers the prompts greedily (chat template applied, a few lookahead
                tokens past --max-new-tokens); the drafter is scored teacher-forced on those answers
                (the training-time-test unroll); the chain is replayed round by round as an engine
                runs it: τ and p_i exactly as a greedy engine would measure them on the same prompts.
                With --spec-topk > 1 an upper bound for the tree is added (the true token among the
                drafter's top k along the true path).
  probes        the same score under plausible wrong conventions: layer ids -1 / +1, the layers
                SGLang or vLLM would capture, the default layers, a search over the target's layers,
                the last aux state after the final norm, d2t as absolute ids, the vocabulary t2d
                marks, raw prompts without the chat template, drafted tokens one position off, the
                target's RoPE; and faults an engine makes loading a healthy export: d2t missing
                (draft ids as target ids) or shuffled, RoPE at the default theta 10000,
                norm_before_residual flipped, an RMSNorm over cat(aux) before fc. A probe "clearly" beats the configuration when its step-0 acceptance
                or its accepted drafts per round (τ - 1) is higher by > 0.1 absolute and > 1.5x:
                "this drafter was trained with X; the configuration uses Y".
  live          τ of draftsman's engine on the same prompts (greedy; it must equal the replay and
                reproduce plain greedy output), and with --server-url, of the external engine
                (responses' spec_decoding field, else deltas of draftsman:/vllm: spec_decode_*
                counters on /metrics). The server is assumed to serve the first --drafter with the
                same --spec-* settings.
  will it pay   median time of a plain decode step and of a speculative round (draft + verify +
                drafter extend) at each --batch-sizes, measured in-process with full batches;
                predicted speed-up = τ x t_plain / t_round (τ of draftsman's engine), and the batch
                size from which speculation loses.
  verdict       healthy | configuration (a probe clearly beats the configuration) | checkpoint
                (expected acceptance low, explained by a static warning such as d2t or the chat
                template) | training (expected acceptance low under every convention) |
                integration (expected fine, live low; the probes whose expected τ reproduces the
                live τ are the likely causes).
Exit status 1 when any check FAILs (0 with --exit-zero), 2 when doctor cannot run, else 0.

--json prints one JSON object as the last stdout line. Keys (stable):
  target, drafter (the first), drafters_compared, dataset, num_prompts, max_new_tokens,
  chat_template, spec {steps, topk, draft_tokens}, batch_sizes, device, dtype, server_url,
  simulate, target_layers, notes [str]
  status        PASS | WARN | FAIL, the worst over every drafter
  checks        [{name, status, message, evidence {...}}] of the first drafter
  expected      {accept_rate_per_position [p_1..p_K], accept_length, step_accept [a_0..a_K-1]
                (teacher-forced top-1 rate per step), chain [joint rate: steps 0..k all right],
                rounds, positions, tree {topk, accept_length, accept_rate_per_position, rounds} |
                null, tau_pred (independent steps), tau_chain, chat_template} | null
  probes        [{name, applicable, accept_length, step0_accept, delta (accept_length - expected),
                step_accept, accept_rate_per_position, clearly_better, trained_with, configured,
                layer_ids, note}]; names: "layer ids -1", "layer ids +1", "sglang layer ids",
                "vllm layer ids", "default layer ids", "post-norm last aux", "d2t absolute",
                "vocab from t2d", "no chat template", "positions +1", "target rope", "d2t missing",
                "d2t shuffled", "default rope theta", "norm_before_residual flipped",
                "norm before fc", "layer search"
  live          {engine: {source, accept_length, accept_rate_per_position, rounds,
                accept_length_histogram, identical, simulated, spec} | null,
                server: {source, url, model, accept_length, accept_rate_per_position, rounds,
                acceptance_source, output_tokens, tokens_per_s, text_equal_chat, text_equal_raw,
                text_matches, notes} | null}
  verdict       {kind, message, causes [check or probe names]}
  pay           {accept_length, accept_length_source ("live" | "expected"), rows [{batch_size,
                plain_step_ms, spec_round_ms, breakeven_accept_length, speedup}],
                loses_from_batch_size, pays_up_to_batch_size} | null
  drafters      [{drafter, status, layer_ids, checks, expected, probes, live, verdict, pay}] one per
                --drafter, in order (the top-level checks..pay are the first one's)
"""

from __future__ import annotations

import argparse
import os
import sys

from draftsman.cli import add_device_args, print_json

HELP = "why is acceptance low? static checks, expected vs live acceptance, convention probes, speed-up"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from draftsman.doctor.live import SIMULATIONS

    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    p.add_argument("--drafter", action="append", required=True,
                   help="EAGLE-3 drafter directory (repeat to compare drafters on the same prompts)")
    p.add_argument("--server-url", help="OpenAI-compatible server serving the (first) drafter: measure its τ")
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default: $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight against the server (default 4)")
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench, humaneval, gsm8k, alpaca, or a JSONL path (default mt-bench)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts to use (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer tokens per prompt (default 128)")
    p.add_argument("--spec-steps", type=int, default=3, help="draft depth (default 3)")
    p.add_argument("--spec-topk", type=int, default=1, help="branching per step (default 1: a chain)")
    p.add_argument("--spec-draft-tokens", type=int, default=None,
                   help="verified nodes incl. the root (default: steps + 1 for a chain, else 16 or what fits)")
    p.add_argument("--batch-sizes", default="1,4,16,64",
                   help="comma list for the step-cost measurement (default 1,4,16,64; 0 = skip)")
    p.add_argument("--timing-steps", type=int, default=8, help="timed rounds per batch size (default 8)")
    p.add_argument("--no-layer-search", action="store_true", help="skip the search over the target's layers")
    p.add_argument("--simulate-integration-fault", choices=SIMULATIONS, default=None, metavar="FAULT",
                   help="make the in-process live engine reproduce an integration fault, to see (or test) what "
                        f"doctor reports for it: {', '.join(SIMULATIONS)}")
    add_device_args(p)
    p.add_argument("--exit-zero", action="store_true",
                   help="exit 0 even when a check FAILs (scripts that report and go on)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")


def spec_from_args(args: argparse.Namespace):
    from draftsman.bench import default_draft_tokens
    from draftsman.spec.engine import SpecConfig

    n = args.spec_draft_tokens or default_draft_tokens(args.spec_steps, args.spec_topk)
    return SpecConfig(steps=args.spec_steps, topk=args.spec_topk, draft_tokens=n)


def options_from_args(args: argparse.Namespace):
    from draftsman.bench import parse_int_list
    from draftsman.doctor import DoctorOptions

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.concurrency < 1 or args.timing_steps < 1:
        raise ValueError("--num-prompts, --max-new-tokens, --concurrency and --timing-steps must be >= 1")
    sizes = () if args.batch_sizes.strip() == "0" else tuple(parse_int_list(args.batch_sizes, "--batch-sizes"))
    return DoctorOptions(dataset=args.dataset, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                         spec=spec_from_args(args), batch_sizes=sizes, device=args.device, dtype=args.dtype,
                         server_url=args.server_url, model=args.model, api_key=args.api_key,
                         concurrency=args.concurrency, simulate=args.simulate_integration_fault,
                         layer_search=not args.no_layer_search, timing_steps=args.timing_steps)


def run(args: argparse.Namespace) -> int:
    from draftsman.bench_client import ServerError, httpx
    from draftsman.doctor import DoctorError, diagnose, format_report
    from draftsman.doctor.core import stderr_progress

    try:
        opts = options_from_args(args)
        result = diagnose(args.target, args.drafter, opts, progress=stderr_progress)
    except (ValueError, DoctorError, ServerError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json:
        print_json(result)
    return 1 if result["status"] == "FAIL" and not args.exit_zero else 0
