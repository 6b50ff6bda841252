r"""Serve a target over an OpenAI-compatible HTTP API, speculatively with --drafter.

Examples:
  draftsman serve --target DIR
  draftsman serve --target DIR --drafter DRAFTER_DIR --port 8000 --api-key "$KEY" --max-batch-size 32
  draftsman serve --target DIR --drafter DRAFTER_DIR --spec-steps 5 --spec-topk 4 \
      --spec-draft-tokens 16        # one fixed speculation setting (--spec-policy fixed)

Endpoints (as vLLM and SGLang serve them):
  GET  /v1/models             the one served model (--served-model-name, default: the target
                              directory's name)
  POST /v1/completions        prompt as text or token ids; stream, temperature, top_p, top_k,
                              max_tokens (default 16), stop, seed, stream_options.include_usage
  POST /v1/chat/completions   messages rendered with the tokenizer's chat template; also
                              max_completion_tokens (default: the rest of --max-model-len)
  GET  /health                200 {"status": "ok"}, 503 while shutting down
  GET  /metrics               Prometheus text (draftsman:* names mirroring vLLM's vllm:*)
  GET  /openapi.json, /docs   the API schema

Responses carry the generated `token_ids` in each choice and, with --drafter, a
`spec_decoding` object with this request's accept_length (tau), accept_rate_per_position,
rounds (speculative), plain_rounds, draft_tokens and accepted_tokens (in a stream: on the
last chunk). /metrics counts both kinds of rounds too (spec_decode_num_drafts and
spec_decode_num_plain_rounds, summed over requests).

With --drafter, speculation is adaptive by default (--spec-policy): each round the running
batch speculates with one of a few settings, or decodes plainly, whichever round times and the
acceptance of the requests in flight say is fastest at that batch size, so a drafter that cannot
pay at some batch size or temperature falls back to plain decoding there (and is probed again
later). --spec-* flags pin one setting (--spec-policy fixed).

Requests arriving together decode together: a request joins the running batch between rounds
and leaves it when done (continuous batching, up to --max-batch-size rows). A request with a seed
and temperature > 0 decodes in a batch of its own seeded with it, so it is reproducible and
equals `draftsman generate --seed` for the same prompt. Output at temperature 0 equals
`draftsman generate`. The server binds 127.0.0.1 unless --host says otherwise; with --api-key
(or DRAFTSMAN_API_KEY) every /v1/ route needs `Authorization: Bearer KEY`. SIGTERM or Ctrl-C
stops admitting, lets in-flight requests finish (for up to --shutdown-timeout s), exits 0.
"""

from __future__ import annotations

import argparse
import os

import torch

from draftsman.cli import add_device_args, resolve_device, resolve_dtype
from draftsman.commands.generate import add_spec_policy_arg

HELP = "serve a target (and drafter) over an OpenAI-compatible HTTP API"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="HF checkpoint directory, .gguf file or hub id (org/name) of the target model")
    p.add_argument("--drafter", help="EAGLE-3 drafter directory: decode speculatively")
    p.add_argument("--spec-steps", type=int, default=None, help="draft depth (default 5)")
    p.add_argument("--spec-topk", type=int, default=None, help="branching per draft step (default 4)")
    p.add_argument("--spec-draft-tokens", type=int, default=None,
                   help="verified tree nodes incl. the root (default 16; steps + 1 when topk is 1)")
    add_spec_policy_arg(p)
    p.add_argument("--spec-adaptive", action="store_true",
                   help="the same as --spec-policy adaptive (with --spec-* flags: adaptive between that setting "
                        "and plain decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("DRAFTSMAN_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/ routes (default: $DRAFTSMAN_API_KEY)")
    p.add_argument("--served-model-name", help="model name clients send (default: the target dir's name)")
    p.add_argument("--max-batch-size", type=int, default=32, help="rows decoded together at most (default 32)")
    p.add_argument("--join-wait-rounds", type=int, default=8,
                   help="the most decoding rounds freed batch slots wait to be refilled together, where the "
                   "requests expected to finish meanwhile would each pay a join's fitted fixed cost (launches, "
                   "syncs) alone for more than the empty slots cost (default 8; 0: waiting requests join at once)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generated tokens per request (default: the target's "
                        "max_position_embeddings, at most 4096)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_device_args(p)


def run(args: argparse.Namespace) -> int:
    import logging

    from draftsman.commands.generate import spec_flags_given, spec_policy_from_args
    from draftsman.serve import load_state, run_server

    # uvicorn sets up its own loggers only; the scheduler's (failures, shutdown) go here.
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")

    if args.max_batch_size < 1:
        raise SystemExit("error: --max-batch-size must be >= 1")
    if args.join_wait_rounds < 0:
        raise SystemExit("error: --join-wait-rounds must be >= 0")
    if args.spec_adaptive:
        if args.spec_policy == "fixed":
            raise SystemExit("error: --spec-adaptive contradicts --spec-policy fixed")
        args.spec_policy = "adaptive"
    spec = candidates = None
    if args.drafter:
        spec, candidates = spec_policy_from_args(args)
    elif spec_flags_given(args) or args.spec_policy:
        raise SystemExit("error: --spec-* flags need --drafter")
    device = resolve_device(args.device)
    # Every decoding forward runs on the scheduler thread, and only it may run OpenMP teams: once a
    # second thread (here, this one while loading) has had a team, libgomp counts more threads than
    # cores and its workers sleep after a few spins, so each small parallel region waits for a
    # wake-up. On this project's 2-core CPU that made SmolLM2's projections 1.7x slower in the
    # scheduler thread (a 3072x576 product 145 us against 85 us) and its decode step 48-52 ms
    # against 37-39 ms. This thread keeps one intra-op thread; the scheduler's get them all (on
    # CPU: a GPU server's forwards are launches, and its load may convert weights on the host).
    threads = None
    if device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        state = load_state(args.target, args.drafter, spec, device=device,
                           dtype=resolve_dtype(args.dtype, device), max_model_len=args.max_model_len,
                           max_batch_size=args.max_batch_size, model_name=args.served_model_name,
                           api_key=args.api_key, candidates=candidates,
                           join_wait_rounds=args.join_wait_rounds, threads=threads)
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {e}") from None
    run_server(state, args.host, args.port, args.shutdown_timeout, args.log_level)
    return 0
