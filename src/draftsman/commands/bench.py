"""Benchmark speculative decoding: plain vs speculative arms side by side, in one run.

In-process (draftsman's own engine):
  draftsman bench --target DIR --drafter DRAFTER_DIR --dataset mt-bench --num-prompts 80 \\
      --max-new-tokens 256 --batch-sizes 1,4,16,64 --spec-steps 3,5 --spec-topk 1,4 --json --plot out/
Client (any OpenAI-compatible server: draftsman serve, SGLang, vLLM):
  draftsman bench --server-url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \\
      --dataset gsm8k --concurrency 16 --json

Prompt sets: mt-bench, humaneval, gsm8k, alpaca (80 prompts each, first turn, bundled), or any
JSONL file whose records carry prompt / turns / question / instruction / messages. Prompts are
sent as one user turn through the chat template (in-process: the target tokenizer's; client:
/v1/chat/completions); --no-chat sends them raw (client: /v1/completions).

Arms. In-process: `plain` and one `spec-s{steps}-k{topk}-n{draft_tokens}` arm per valid
combination of --spec-steps x --spec-topk x --spec-draft-tokens (comma lists; SGLang meanings:
draft depth, branching per step, verified tree nodes incl. the root); without those flags, the
adaptive policy's candidates (5/4/16, 5/4/6, 5/1/6). Each batch size B runs every arm over the
same prompts with at most B requests in flight, refilling a slot as soon as a request finishes
(continuous batching). With --spec-policy adaptive (the default without --spec-* flags; what
generate, demo and serve decode with by default) `spec-adaptive` joins them: each round it runs
one of those settings or a plain step, whichever is fastest at the running batch size by round
times and acceptance it measures itself (it tries every choice first, keeping what it measured
during the warm-up, as a running server would; once no request is left to join, it instead
picks what finishes the slowest running row first; see draftsman/spec/adaptive.py). Client: `server` (the served configuration) and, with
--baseline-url, `baseline` (a plain server) at each concurrency. --warmup N requests run
untimed before every arm and batch size (in-process: at least one full batch, and again while
they capture CUDA graphs, up to --warmup-passes times).

Metrics, per arm and batch size. Tokens are the generated tokens returned to the user (EOS
included when emitted; client: the server's usage.completion_tokens), counted the same way
for every arm. tokens/s and requests/s are over the run's wall time. TTFT = time from a
request's start to its first token; TPOT = (last - first token time) / (tokens - 1), per
request; ITL = gaps between successive deliveries (a speculative round delivers several
tokens at once). tau (accept_length) = tokens emitted per target verify forward; p_i =
rounds accepting >= i drafts / rounds, so tau = 1 + sum p_i (SGLang / vLLM definitions).
speedup = arm tokens/s / plain tokens/s at the same batch size in the same run. The roofline
of plain decoding: weight bytes one decode step reads (embedding rows only unless tied; MoE:
the routed experts the step activates, E(1-(1-k/E)^B), plus everything else; KV cache not
counted) / median full-batch step time / a device-to-device copy bandwidth measured in the
same run (CUDA only).

Output: a table, and with --json one JSON object as the last stdout line. Top-level keys:
  mode                "in-process" | "client"
  dataset, num_prompts, max_new_tokens, temperature, top_p, top_k, seed, chat, ignore_eos, warmup, warmup_passes,
  repeats             timed runs per arm
  join_wait_rounds    in-process (null in client mode)
  batch_sizes         [int]  (client: concurrencies)
  target, drafter, device, dtype        in-process (null in client mode)
  server_url, baseline_url, model       client mode (null in-process)
  specs               [{steps, topk, draft_tokens}] of the speculative arms (in-process)
  copy_bandwidth_gb_s device copy bandwidth (read + write) measured in this run; null off CUDA
  adaptive_speedup    spec-adaptive's speedup at the first batch size (null without that arm)
  adaptive_vs_best_fixed  spec-adaptive's tokens/s / the best fixed speculative arm's, first batch size
  best_arm            the speculative arm with the highest tokens/s at the first batch size;
                      the next five keys are that arm's, at the first batch size
  accept_length       tau, or null when unknown
  accept_rate_per_position  [p_1, p_2, ...] or null
  speedup             spec_tokens_per_s / plain_tokens_per_s, or null without a plain arm
  plain_tokens_per_s  plain arm (client: baseline) tokens/s, or null
  spec_tokens_per_s   best speculative arm (client: served) tokens/s
  bandwidth_fraction  the plain arm's fraction of copy bandwidth at the first batch size (CUDA)
  identical           greedy (temperature 0): every speculative arm's outputs equal plain
                      outputs token for token (client: served text equals baseline text);
                      null when sampling or when there is nothing to compare
  notes               [str] caveats (missing acceptance data, token counts from chunks, ...)
  arms                [object] one per arm and batch size, every key always present (null
                      when it does not apply):
    arm                 "plain", "spec-s{steps}-k{topk}-n{draft_tokens}", "spec-adaptive";
                        client: "server", "baseline"
    kind                "plain" | "spec" | "served" (client: the server under test)
    spec                {steps, topk, draft_tokens}, {"adaptive": [those]}, or null
    batch_size          concurrent requests; url: the server (client mode)
    num_requests, output_tokens, duration_s, tokens_per_s, requests_per_s
    ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms, itl_p50_ms, itl_p99_ms
    accept_length, accept_rate_per_position
    rounds, draft_tokens, accepted_tokens   verify forwards, drafted tokens verified, accepted
    accept_length_histogram                 in-process: rounds by number of accepted drafts
    acceptance_source   "engine" | "response" | "metrics (PREFIX_*)" | null
    speedup             tokens_per_s / the plain (baseline) arm's at this batch size
    identical, mismatched_requests          vs plain at this batch size, temperature 0
    finish_reasons      {reason: count}
    adaptive            spec-adaptive: [{batch_bucket, arm, round_ms, join_ms_per_round, tau, rounds,
                        untimed_rounds, timed_s, chosen}],
                        what the policy measured per batch bucket and arm (warm-up included) and
                        what it settled on (its acceptance keys cover its speculative rounds only)
    weight_bytes_per_step, decode_step_ms, weight_bandwidth_gb_s, bandwidth_fraction
                        the roofline, on in-process plain arms
    graph_captures      in-process: CUDA graphs the arm captured while timed (each costs
                        several steps; 0 off CUDA, null in client mode)
    warmup_passes       in-process: warm-up passes run before the timed run (null in client mode)
    session_steps, time_in_steps_s, joins, time_in_joins_s, time_elsewhere_s
                        in-process: where duration_s went: rounds (session steps), prefills of
                        newcomers joining the batch, and the rest (emitting tokens, bookkeeping)
    durations_s         every timed run's duration (--repeats; the reported run is
                        the one of median duration)
    catch_ups, catch_up_s
                        spec-adaptive: the drafter's catch-ups after plain rounds in the
                        reported run (over the backlog and any deferred pairs), and their
                        seconds (part of its steps' time)
    deferred_prefills, spills
                        spec-adaptive: requests that joined while plain decoding was the
                        choice, their drafter prefill deferred (run at the next speculative
                        round, or never if they finish first), and full backlogs of plain
                        rounds' pairs kept for later rather than run through the drafter
    spec_rounds, plain_rounds
                        speculative arms: rounds that decoded a request speculatively / plainly,
                        summed over the reported run's requests (plain rounds: spec-adaptive only)
--plot DIR writes acceptance_per_position.png (bars per speculative arm, first batch size)
and speedup_vs_batch_size.png (a line per speculative arm).
"""

from __future__ import annotations

import argparse
import os
import sys

from draftsman.cli import (
    add_device_args,
    add_sampling_args,
    print_json,
    resolve_device,
    resolve_dtype,
)

HELP = "measure speed-up, latency and acceptance: plain vs speculative, in-process or against a server"


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HF checkpoint directory, .gguf file or hub id: benchmark draftsman's engine in-process")
    where.add_argument("--server-url", help="OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--drafter", help="EAGLE-3 drafter directory (in-process): adds speculative arms")
    p.add_argument("--model", help="model name to request (client; default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default: $OPENAI_API_KEY)")
    p.add_argument("--baseline-url", help="a plain (non-speculative) server to measure the speed-up against")
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench, humaneval, gsm8k, alpaca, or a JSONL path (default mt-bench)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the set (default: all)")
    p.add_argument("--batch-sizes", default=None,
                   help="comma list of concurrent requests, e.g. 1,4,16,64 (default 1)")
    p.add_argument("--concurrency", type=int, default=None, help="one batch size (alias, client mode style)")
    p.add_argument("--spec-steps", default=None, help="draft depth(s), comma list (default 5)")
    p.add_argument("--spec-topk", default=None, help="branching per step, comma list (default 4)")
    p.add_argument("--spec-draft-tokens", default=None,
                   help="verified nodes incl. the root, comma list (default 16; steps + 1 for topk 1)")
    p.add_argument("--spec-policy", choices=("adaptive", "fixed"), default=None,
                   help="adaptive (the default without --spec-* flags): besides the fixed arms (default: the "
                        "adaptive policy's candidates, tree 5/4/16, tree 5/4/6, chain 5), a `spec-adaptive` arm: "
                        "per round, one of them or plain decoding, whichever measured round times and acceptance "
                        "say is fastest at the running batch size, as generate and serve decode by default; "
                        "fixed (the default with --spec-* flags): the fixed arms only (in-process, needs --drafter)")
    p.add_argument("--spec-adaptive", action="store_true", help="the same as --spec-policy adaptive")
    p.add_argument("--eager-prefill", action="store_true",
                   help="prefill newcomers eagerly, as before staged prefills (by default, on a GPU, they run as "
                        "CUDA-graphed static steps over reused staging caches, prompts padded to a power of two; "
                        "CPU runs eager prefills either way): for comparisons (in-process)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode/draft/verify forwards (in-process; each new step shape "
                        "compiles first: seconds on small models, minutes on 8B ones; warm up with --warmup)")
    p.add_argument("--no-chat", action="store_true", help="send raw prompts, no chat template")
    p.add_argument("--ignore-eos", action="store_true",
                   help="in-process: every request generates exactly --max-new-tokens, EOS or not, so every arm "
                        "does the same work; at T > 0 the arms' sampled answers differ and stop at different "
                        "lengths, which moves throughput ratios by several percent over a few prompts")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before each arm (default 1; in-process, "
                   "at least one full batch: max(N, batch size)), in the session that then runs the timed "
                   "requests, as a server keeps one session: on CUDA they capture the arm's graphs "
                   "(the JSON's graph_captures counts captures left in the timed run); 0: none")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="in-process: run the warm-up requests up to this many times per arm (default 1), "
                        "stopping after a pass that captured no CUDA graph: an adaptive arm's choices differ "
                        "between passes, so one pass leaves shapes (and captures) for the timed run")
    p.add_argument("--join-wait-rounds", type=int, default=8,
                   help="in-process: the most rounds freed batch slots wait to be refilled together, as the server "
                   "does (draftsman/joins.py; default 8; 0: waiting requests join at once)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per arm (default 1); with more, every arm is warmed up first and "
                        "the runs go round the arms (client: the server and the baseline), each round starting "
                        "one arm further on, each arm reporting its run of median duration (drift of a noisy "
                        "machine then falls on every arm alike; in-process, every arm's session stays alive "
                        "meanwhile)")
    p.add_argument("--timeout", type=float, default=600.0, help="client: seconds per request (default 600)")
    add_sampling_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")


def run(args: argparse.Namespace) -> int:
    from draftsman import bench

    try:
        check_args(args)
        batch_sizes = [args.concurrency] if args.concurrency else (
            bench.parse_int_list(args.batch_sizes, "--batch-sizes") or [1])
        prompts = bench.load_prompt_set(args.dataset, args.num_prompts)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    notes: list[str] = []
    if args.num_prompts and len(prompts) < args.num_prompts:
        notes.append(f"--num-prompts {args.num_prompts}: the set has only {len(prompts)} prompts")
    if max(batch_sizes) > len(prompts):
        notes.append(f"batch size {max(batch_sizes)} exceeds the {len(prompts)} prompts: that batch never fills")
    result = {
        "mode": "in-process" if args.target else "client", "dataset": args.dataset, "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "chat": not args.no_chat, "ignore_eos": args.ignore_eos,
        "warmup": args.warmup,
        "warmup_passes": args.warmup_passes, "repeats": args.repeats,
        "join_wait_rounds": args.join_wait_rounds if args.target else None,
        "batch_sizes": batch_sizes, "target": args.target, "drafter": args.drafter, "device": None,
        "dtype": None, "server_url": args.server_url, "baseline_url": args.baseline_url, "model": args.model,
        "specs": [], "copy_bandwidth_gb_s": None,
    }
    runner = run_in_process if args.target else run_client
    arms, more_notes = runner(args, prompts, batch_sizes, result)
    bench.add_speedups(arms)
    result |= bench.headline(arms)
    result["notes"] = notes + more_notes
    result["arms"] = arms
    print(bench.format_table(result))
    if args.plot:
        for path in bench.write_plots(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print_json(result)
    return 0


def check_args(args: argparse.Namespace) -> None:
    spec_flags = (args.spec_steps, args.spec_topk, args.spec_draft_tokens)
    if args.server_url:
        if args.drafter:
            raise ValueError("--drafter is for in-process mode (--target); a server uses its own")
        if any(f is not None for f in spec_flags) or args.spec_adaptive or args.spec_policy or args.compile \
                or args.eager_prefill:
            raise ValueError("--spec-* flags, --compile and --eager-prefill are for in-process mode; a server uses "
                             "its own configuration")
    else:
        if args.baseline_url:
            raise ValueError("--baseline-url needs --server-url (in-process mode measures plain decoding itself)")
        if (any(f is not None for f in spec_flags) or args.spec_adaptive or args.spec_policy) and not args.drafter:
            raise ValueError("--spec-* flags need --drafter")
        if args.spec_adaptive and args.spec_policy == "fixed":
            raise ValueError("--spec-adaptive contradicts --spec-policy fixed")
    if args.ignore_eos and args.server_url:
        raise ValueError("--ignore-eos is in-process only (a server's requests stop where it decides)")
    if args.concurrency is not None and args.batch_sizes is not None:
        raise ValueError("give --batch-sizes or --concurrency, not both")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.warmup_passes < 1:
        raise ValueError("--warmup-passes must be >= 1")
    if args.join_wait_rounds < 0:
        raise ValueError("--join-wait-rounds must be >= 0")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'draftsman[plot]'") from None


def progress_bar(total: int):
    """A stderr progress bar over every timed request of the run (hidden when not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="req", file=sys.stderr, disable=None, leave=False)


def run_in_process(args: argparse.Namespace, prompts: list[str], batch_sizes: list[int],
                   result: dict) -> tuple[list[dict], list[str]]:
    import torch

    from draftsman import bench
    from draftsman.generate import StopRules
    from draftsman.models import load_target
    from draftsman.sampling import SamplingParams
    from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    flags = (args.spec_steps, args.spec_topk, args.spec_draft_tokens)
    policy = "adaptive" if args.spec_adaptive else args.spec_policy or (
        "fixed" if any(f is not None for f in flags) else "adaptive")
    try:
        if not args.drafter:
            specs = []
        elif policy == "adaptive" and all(f is None for f in flags):
            from draftsman.spec.adaptive import DEFAULT_CANDIDATES

            specs = list(DEFAULT_CANDIDATES)
        else:
            specs = bench.spec_grid(*(bench.parse_int_list(f, n) for f, n in (
                (args.spec_steps, "--spec-steps"), (args.spec_topk, "--spec-topk"),
                (args.spec_draft_tokens, "--spec-draft-tokens"))))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise SystemExit(f"error: {args.target} has no tokenizer: bench needs one to encode text prompts")
    try:
        ids = [encode_prompt(tokenizer, text, chat=not args.no_chat) for text in prompts]
    except ValueError as e:
        raise SystemExit(f"error: {e}; pass --no-chat for raw prompts") from None
    model = load_target(args.target, device=device, dtype=dtype)
    drafter = None
    if args.drafter:
        from draftsman.models.eagle3 import load_drafter

        try:
            drafter = load_drafter(args.drafter, target=model, device=device, dtype=dtype, inference=True)
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"error: --drafter {args.drafter}: {e}") from None
    if args.seed is not None:
        torch.manual_seed(args.seed)
    eos = frozenset() if args.ignore_eos else frozenset(eos_token_ids(args.target, model.config.eos_token_ids, tokenizer))
    rules = StopRules(args.max_new_tokens, eos)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    workload = bench.Workload(ids, rules, params, tuple(batch_sizes), min(args.warmup, len(ids)), args.seed,
                              compile=args.compile, graph_prefill=not args.eager_prefill,
                              warmup_passes=args.warmup_passes, repeats=args.repeats,
                              join_wait_rounds=args.join_wait_rounds)
    if workload.max_len > model.config.max_position_embeddings:  # fail before any arm runs
        raise SystemExit(f"error: the longest prompt + --max-new-tokens needs {workload.max_len} positions, more "
                         f"than the target's max_position_embeddings={model.config.max_position_embeddings}")
    copy_bw = bench.measure_copy_bandwidth(device)
    result.update(device=str(device), dtype=str(dtype).removeprefix("torch."),
                  specs=[{"steps": s.steps, "topk": s.topk, "draft_tokens": s.draft_tokens} for s in specs],
                  copy_bandwidth_gb_s=None if copy_bw is None else round(copy_bw / 1e9, 2))
    adaptive = bool(specs) and policy == "adaptive"
    with progress_bar(len(ids) * len(batch_sizes) * (1 + len(specs) + adaptive)) as bar:
        arms = bench.bench_in_process(model, drafter, specs, workload, copy_bw, on_finish=lambda: bar.update(1),
                                      adaptive=adaptive)
    notes = [] if device.type == "cuda" else ["no bandwidth fraction off CUDA (no copy-bandwidth ceiling measured)"]
    return arms, notes


def run_client(args: argparse.Namespace, prompts: list[str], batch_sizes: list[int],
               result: dict) -> tuple[list[dict], list[str]]:
    from draftsman import bench_client as bc

    url = bc.base_url(args.server_url)
    try:
        model = args.model or bc.served_model(url, args.api_key)
        cfg = bc.ClientConfig(url, model, chat=not args.no_chat, max_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              api_key=args.api_key, timeout_s=args.timeout)
        baseline = None
        if args.baseline_url:
            burl = bc.base_url(args.baseline_url)
            baseline = bc.ClientConfig(burl, args.model or bc.served_model(burl, args.api_key), chat=cfg.chat,
                                       max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                       top_k=cfg.top_k, seed=cfg.seed, api_key=cfg.api_key, timeout_s=cfg.timeout_s)
        result["model"] = model
        total = len(prompts) * len(batch_sizes) * (2 if baseline else 1) * args.repeats
        with progress_bar(total) as bar:
            arms, notes = bc.bench_server(cfg, prompts, batch_sizes, baseline=baseline,
                                          warmup=min(args.warmup, len(prompts)), repeats=args.repeats,
                                          on_finish=lambda: bar.update(1))
    except (bc.ServerError, bc.httpx.HTTPError) as e:
        raise SystemExit(f"error: {e}") from None
    if not baseline:
        notes.append("no --baseline-url: no plain arm, so no speed-up")
    return arms, notes
