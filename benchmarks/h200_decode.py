"""Plain decoding and speculation-round costs at Llama-3.1-8B geometry (or, with --geometry,
Moonlight-16B-A3B's) on one GPU, random bf16 weights (a dense model's speed does not depend on
their values; an MoE's routing does, and random routing is close to uniform).

    python benchmarks/h200_decode.py --out benchmarks/results/h200_decode_8b.json

Arms, all batch 1, greedy, one prompt of --prompt-len tokens then --new-tokens tokens:
  hf_generate       transformers LlamaForCausalLM.generate on the same weights (its default cache)
  engine_eager      draftsman's PlainSession (eager PyTorch, one host sync per token)
  graph_eager       the decode step (full-cache mask, no host sync) captured in a CUDA graph
  graph_compiled    the same step through torch.compile, then captured
  *_math            a graph arm with attention as matmuls + softmax instead of SDPA
  *_autotune        a compiled arm in torch.compile's max-autotune-no-cudagraphs mode
  *_cublas          a graph arm with every GEMV on cuBLAS (default: batch-1 GEMVs on draftsman's
                    Triton GEMV, as inference models run; layers.use_gemv)
  (default)         fused decode layers as decode_chained (norms fed by the previous GEMV's sums
                    of squares; llama.FUSED_DECODE_CHAINED) with the gate/up GEMV bare
  *_unchained       ... as decode_fused instead (each GEMV's norm prologue reads its whole input)
  *_gu_F            a chained arm whose gate/up GEMV folds F of the post-attention norm and
                    SiLU * up (F: norm, glu, norm-glu, none; the rest apart), or is a PyTorch
                    matmul (F: linear, cuBLAS); default: llama.CHAINED_GATE_UP
  *_torchargmax     the next token by one-pass torch.argmax (default: sampling.greedy_argmax)
  *_sdpa            one-token attention through SDPA (default: draftsman's Triton decode-attention
                    kernel, kernels/attention.py; layers.DECODE_ATTENTION)
  *_torchmoe        (Moonlight) routing by PyTorch's top-k, the shared experts as their own
                    SwiGLU, MLA's absorbed per-head products as batched GEMMs (default: the
                    Triton routing kernel, shared experts in the routed experts' launches,
                    head_gemv; deepseek.ROUTE_KERNEL, SHARED_WITH_ROUTED, HEAD_GEMV_ROWS)
  *_noabsorbcombine (Moonlight) the attention's split combine and the absorbed value projection
                    as three kernels (default: one, deepseek.ABSORB_IN_COMBINE)
  *_unfused         Triton GEMVs, but without the fused decode layers (default for Llama: RMSNorm,
                    SwiGLU and residual adds folded into the GEMVs; llama.FUSED_DECODE)
ms/token = (time for N tokens - time for 1 token) / (N - 1), so prefill is excluded.
Floor: bytes of all weights / measured copy bandwidth (the issue's definition; `strict_floor_ms`
counts only what a token must read: weights less the embedding table, plus its KV cache).
Verify/draft: one target forward over T tokens (T = 1 is a decode step) and one forward of an
8B-shaped EAGLE-3 drafter over k tokens, each in its own CUDA graph (the best step variant).
rounds: the engine's own plain step and whole speculation rounds (chain and 16/32/64-node trees)
with that drafter, as session.step() calls (see round_costs).
Prints one JSON line; --out keeps it (rewritten after every arm, so a cut-short run keeps what
it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
from geometries import (  # benchmarks/ is on sys.path when run as a script
    LLAMA_31_8B,
    MOONLIGHT_16B_A3B,
)
from h200_json import update_h200_json, write_results

from draftsman.bench import decode_weight_bytes
from draftsman.config import parse_target_config
from draftsman.graphs import CudaGraphRunner, compile_step
from draftsman.models import build_target
from draftsman.models.layers import attention as sdpa_attention
from draftsman.models.layers import slot_mask, use_gemv
from draftsman.sampling import greedy_argmax
from draftsman.weights import build_empty

GEOMETRIES = {"llama-3.1-8b": LLAMA_31_8B, "moonlight-16b-a3b": MOONLIGHT_16B_A3B}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time(fn, iters: int) -> float:
    """Seconds per call of fn, by CUDA events around `iters` calls (after one warm call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    best = min(cuda_time(lambda: dst.copy_(src), 5) for _ in range(3))
    return 2 * n * 2 / best


def random_model(raw: dict, seed: int = 0, fuse: bool = True):
    """Random weights, q/k/v and gate/up fused as load_target does (--no-fuse: separate GEMMs)."""
    config = parse_target_config(raw)
    model = build_empty(lambda: build_target(config), "cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model = model.eval().requires_grad_(False)
    return model.fuse_projections() if fuse else model


def per_token(run, n: int) -> float:
    """(t(n) - t(1)) / (n - 1) in seconds, each the best of two runs."""
    def timed(k):
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            run(k)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best
    return (timed(n) - timed(1)) / (n - 1)


def hf_arm(model, raw: dict, prompt: torch.Tensor, n: int) -> dict:
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    sd = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    hf.load_state_dict(sd, strict=False, assign=True)  # share the same weight tensors
    hf.eval()
    out = {}

    def run(k):
        out["tokens"] = hf.generate(prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    return {"ms_per_token": per_token(run, n) * 1e3, "tokens": out["tokens"], "transformers": transformers.__version__}


def engine_arm(model, prompt: torch.Tensor, n: int) -> dict:
    from draftsman.generate import StopRules, generate_plain

    out = {}

    def run(k):
        out["tokens"] = generate_plain(model, [prompt[0].tolist()], StopRules(max_new_tokens=k)).token_ids[0]
    return {"ms_per_token": per_token(run, n) * 1e3, "tokens": out["tokens"]}


def decode_step_fn(model, cache, max_len: int, argmax=greedy_argmax):
    """One greedy decode step that feeds itself: reads token/pos, writes the next token (argmax of
    the logits [B, V] -> [B]) and pos+1 back into them (so replays chain with no host work)."""
    def step(token, pos):
        mask = slot_mask(pos, max_len)
        logits = model.run(token, positions=pos, cache=cache, cache_index=pos, attn_mask=mask).logits
        nxt = argmax(logits[:, -1])[:, None]
        token.copy_(nxt)
        pos.add_(1)
        return nxt
    return step


def math_attention(q, k, v, mask, scale):
    """Attention as plain matmuls + masked softmax (fp32 scores), for inductor to fuse; the
    `_math` arms swap it in for SDPA in the Llama layers."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores = (qg.float() @ k.permute(0, 2, 3, 1).float()) * scale  # [B, Hkv, g*T, S]
    scores = scores.view(b, hkv, g, t, -1).masked_fill(~mask[:, None, None], float("-inf"))
    p = scores.softmax(-1).to(v.dtype).view(b, hkv, g * t, -1)
    out = p @ v.permute(0, 2, 1, 3)  # [B, Hkv, g*T, Dv]
    return out.view(b, hkv, g, t, -1).permute(0, 3, 1, 2, 4).reshape(b, t, h, -1)


def profile_step(step, inputs: dict, steps: int = 5, top: int = 30) -> list[dict]:
    """GPU time per decode step of the step function run without a graph, by kernel (top N)."""
    from torch.profiler import ProfilerActivity, profile

    step(**inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(**inputs)
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:120], "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count / steps}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    # Each attention and combine call of the last step, in launch order (target layers and
    # drafter forwards differ in tokens and slots: their sum hides which is slow)
    calls: dict[str, list[float]] = {}
    for e in prof.events():
        # (by prefix: Inductor names fused kernels after the ops they hold, decode_attention among them)
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith(("_decode_attention", "_combine")):
            calls.setdefault(e.name[:60], []).append(round(e.device_time, 2))
    last = {k: v[-len(v) // steps:] for k, v in calls.items()}
    return [{"total_us_per_step": total, "attention_calls_last_step_us": last}, *rows[:top]]


def graph_arm(model, prompt: torch.Tensor, n: int, compiled: bool, profile: bool = False,
              argmax=greedy_argmax) -> dict:
    max_len = prompt.shape[1] + n + 8
    cache = model.new_cache(1, max_len)
    step = decode_step_fn(model, cache, max_len, argmax)
    if compiled:
        t0 = time.perf_counter()
        torch._dynamo.reset()  # arms differ in module classes (use_gemv): trace afresh
        step = compile_step(step)
    first = model.run(prompt, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    start_pos = torch.full((1, 1), prompt.shape[1], dtype=torch.long, device="cuda")
    runner = CudaGraphRunner(step, {"token": first, "pos": start_pos})  # warm-up decodes, rewound below
    setup_s = time.perf_counter() - t0 if compiled else None

    def rewind():
        runner.inputs["token"].copy_(first)
        runner.inputs["pos"].copy_(start_pos)

    tokens = []
    rewind()
    for _ in range(n):
        tokens.append(runner()[0, 0].clone())  # GPU scalars; read once at the end
    tokens = [first.item(), *torch.stack(tokens).tolist()[:-1]]

    def run(k):
        rewind()
        for _ in range(k - 1):
            runner.graph.replay()
    out = {"ms_per_token": per_token(run, n) * 1e3, "tokens": tokens}
    if profile:
        rewind()
        out["profile"] = profile_step(step, runner.inputs)
    if setup_s is not None:
        out["compile_and_capture_s"] = setup_s
    return out, runner, cache


def forward_graph_ms(fn, example: dict, iters: int = 50) -> float:
    runner = CudaGraphRunner(fn, example)
    return cuda_time(runner.graph.replay, iters) * 1e3


def verify_costs(model, sizes, ctx_len: int, compiled: bool) -> dict:
    """ms of one target forward over T tokens at context ctx_len, per T, in CUDA graphs."""
    max_len = ctx_len + max(sizes) + 8
    cache = model.new_cache(1, max_len)

    def fwd(tokens, slots):
        mask = slot_mask(slots, max_len)
        return model.run(tokens, positions=slots, cache=cache, cache_index=slots, attn_mask=mask).logits
    f = compile_step(fwd) if compiled else fwd
    out = {}
    for t in sizes:
        slots = (ctx_len + torch.arange(t, device="cuda"))[None]
        tokens = torch.randint(0, model.config.vocab_size, (1, t), device="cuda")
        out[str(t)] = forward_graph_ms(f, {"tokens": tokens, "slots": slots})
    return out


def draft_costs(model, sizes, ctx_len: int, compiled: bool) -> dict:
    """ms of one 8B-shaped EAGLE-3 drafter forward (+ log-softmax top-k) over k tokens."""
    from draftsman.models.eagle3 import init_drafter

    drafter = init_drafter(model, draft_vocab_size=32000, seed=0, dtype=torch.bfloat16)
    max_len = ctx_len + 64
    cache = drafter.new_cache(1, max_len)
    hidden = torch.randn(1, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def fwd(tokens, slots, hidden):
        mask = slot_mask(slots, max_len)
        logits, _ = drafter(tokens, hidden, slots, cache=cache, cache_index=slots, attn_mask=mask)
        return torch.log_softmax(logits.float(), -1).topk(4, dim=-1)
    f = compile_step(fwd) if compiled else fwd
    out = {}
    for k in sizes:
        slots = (ctx_len + torch.arange(k, device="cuda"))[None]
        tokens = torch.randint(0, 32000, (1, k), device="cuda")
        out[str(k)] = forward_graph_ms(f, {"tokens": tokens, "slots": slots, "hidden": hidden.expand(1, k, -1)})
    params = sum(p.numel() for p in drafter.parameters())
    return {"ms": out, "drafter_params": params}


# (steps, topk, draft tokens); tree64_s4: a 64-token tree of depth 4, for the bytes a round reads
# (each draft step reads the whole drafter, ~0.05 of the 8B's weights)
ROUND_SPECS = {"chain6": (5, 1, 6), "tree16": (5, 4, 16), "tree32": (6, 6, 32), "tree64": (7, 8, 64),
               "tree64_s4": (4, 8, 64), "tree64_s3": (3, 8, 64)}


def round_costs(model, ctx_len: int, batches=(1,), rounds: int = 20, compile: bool = False,
                names: list[str] | None = None, progress=None, profile: bool = False) -> dict:
    """ms of one engine step (plain: a decode step; spec: a whole round, draft + verify + accept +
    drafter extension, greedy so the round is one graph) with an 8B-shaped drafter, per batch
    size: the mean over `rounds` steady session.step() calls, each timed by the host clock and
    ending in the round's one host sync. Steady: no graph was captured during the call (the
    first call captures; so does the first one after a row outgrows its attention span), so
    steps continue past captures until `rounds` steady ones are timed; `captures_skipped`
    counts the others. Speculation's break-even tau at a batch size is its round time over the
    plain step time. compile: the sessions' torch.compile'd forwards. names: ROUND_SPECS keys to
    run (default all; each new verify/draft shape compiles for a minute at 8B). progress(dict):
    called with the figures so far after each arm (a deadline may cut the run). profile: also
    each arm's kernels at the first batch size, over 3 more steps run without graphs (the same
    forwards, compiled or not; graph replays hide their kernels from the profiler)."""
    from draftsman.generate import StopRules
    from draftsman.graphs import captures
    from draftsman.models.eagle3 import init_drafter
    from draftsman.session import PlainSession, Request
    from draftsman.spec.engine import SpecConfig, SpecSession

    vocab = model.config.vocab_size
    drafter = init_drafter(model, draft_vocab_size=min(32000, vocab), seed=0, dtype=model.embed_tokens.weight.dtype)
    gen = torch.Generator().manual_seed(2)
    limit = 3 * rounds + 8  # steps per arm at most
    budget = 8 * (limit + 4)  # (3 more steps to profile)
    max_len = ctx_len + budget + 1
    makers = {"plain": lambda: PlainSession(model, max_len, compile=compile)}
    specs = ROUND_SPECS if names is None else {k: ROUND_SPECS[k] for k in names}  # in the order asked
    for name, (steps, topk, n) in specs.items():
        makers[name] = (lambda cfg: lambda: SpecSession(model, drafter, cfg, max_len, compile=compile))(
            SpecConfig(steps=steps, topk=topk, draft_tokens=n))

    out: dict = {}
    for b in batches:
        prompts = [torch.randint(0, min(128000, vocab), (ctx_len,), generator=gen).tolist() for _ in range(b)]
        ms, skipped, kernels = {}, {}, {}
        for name, make in makers.items():
            session = make()
            session.add([Request(i, p, StopRules(max_new_tokens=budget)) for i, p in enumerate(prompts)])
            times: list[float] = []
            skipped[name] = -1  # the first step's capture is expected
            for _ in range(limit):
                before = captures(model, drafter)
                sync()
                t = time.perf_counter()
                session.step()
                dt = time.perf_counter() - t
                if captures(model, drafter) != before or (not times and skipped[name] < 0):
                    skipped[name] += 1
                    continue
                times.append(dt)
                if len(times) == rounds:
                    break
            if len(times) < rounds:
                raise RuntimeError(f"{name}: only {len(times)} steady steps in {limit}")
            ms[name] = sum(times) / len(times) * 1e3
            if profile and b == batches[0]:
                session.graphed = False
                kernels[name] = profile_step(session.step, {}, steps=3)
            del session
            if progress is not None:
                progress({"batch": b, "ms": dict(ms), "captures_skipped": dict(skipped), "profile": dict(kernels)})
        out[str(b)] = {"ms": ms, "over_plain_step": {k: v / ms["plain"] for k, v in ms.items() if k != "plain"},
                       "captures_skipped": skipped, **({"profile": kernels} if kernels else {})}
    single = out[str(batches[0])]
    # Bytes bound at batch 1: a round runs `steps` drafter forwards (the extension over accepted
    # tokens seeds depth 1; steps - 1 draft forwards) besides the verify, and each reads the
    # drafter's layer and lm_head, while a step reads the target's weights less its embedding
    # table. At equal bandwidth efficiency a round costs at least 1 + steps * ratio of a step
    # (plus what the verify costs over a step: the issue measured 1.10x for bare matmuls).
    step_bytes = decode_weight_bytes(model, 1)
    draft_bytes = sum(p.numel() * p.element_size() for n, p in drafter.named_parameters()
                      if not n.startswith(("fc.", "embed_tokens")))
    ratio = draft_bytes / step_bytes
    return {"ms": single["ms"], "over_plain_step": single["over_plain_step"], "by_batch": out,
            "specs": specs, "draft_forward_bytes_over_step": ratio,
            "bytes_bound_over_step": {k: 1 + s * ratio for k, (s, _, _) in specs.items()}}


def h200_figures(res: dict) -> dict:
    """The issue's headline keys from one results JSON of this script (absent arms: no key)."""
    arms, out = res.get("arms", {}), {}
    tag = {"llama-3.1-8b": "8b", "moonlight-16b-a3b": "moonlight"}[res.get("geometry", "llama-3.1-8b")]
    graphs = {k: v for k, v in arms.items() if k.startswith("graph_")}
    if graphs:
        name, best = max(graphs.items(), key=lambda kv: kv[1]["fraction_of_floor"])
        out |= {f"plain_decode_fraction_of_floor_{tag}": best["fraction_of_floor"],
                f"plain_decode_ms_{tag}": best["ms_per_token"], f"plain_decode_arm_{tag}": name,
                f"floor_ms_{tag}": res["floor_ms"], "copy_bandwidth_TBps": res["copy_bandwidth_TBps"]}
    if "hf_generate" in arms:
        out[f"hf_generate_ms_{tag}"] = arms["hf_generate"]["ms_per_token"]
    if "rounds" in arms:
        kind = "compiled_" if arms["rounds"].get("compiled") else ""  # (--compile-rounds)
        for name, ratio in arms["rounds"]["over_plain_step"].items():
            out[f"round_over_step_{tag}_{kind}{name}"] = ratio
        for name, bound in arms["rounds"].get("bytes_bound_over_step", {}).items():
            out[f"round_bytes_bound_{tag}_{name}"] = bound
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=list(GEOMETRIES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--arms", default="hf_generate,engine_eager,graph_eager,graph_compiled,verify,draft")
    ap.add_argument("--profile", action="store_true",
                    help="graph arms: also profile kernels per step; rounds: each arm's kernels per round")
    ap.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up GEMMs (as before fusion)")
    ap.add_argument("--compile-rounds", action="store_true", help="rounds arm: torch.compile'd sessions")
    ap.add_argument("--batches", default="1", help="rounds arm: batch sizes, comma list (default 1)")
    ap.add_argument("--round-specs", help=f"rounds arm: which of {','.join(ROUND_SPECS)} (comma list; default all)")
    ap.add_argument("--out")
    ap.add_argument("--h200-json", help="merge the headline figures into this file (benchmarks/h200.json)")
    ap.add_argument("--from-results", nargs="+", metavar="JSON",
                    help="run nothing: merge the figures of saved results files into --h200-json")
    args = ap.parse_args()
    if args.from_results:
        if not args.h200_json:
            ap.error("--from-results needs --h200-json")
        for f in args.from_results:
            update_h200_json(args.h200_json, h200_figures(json.loads(Path(f).read_text())), f)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {"fused_projections": not args.no_fuse, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "geometry": args.geometry, "batch": 1,
                 "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                 "date": time.strftime("%Y-%m-%d"), "arms": {}, "errors": {}}

    def save():
        write_results(args.out, res)

    bw = copy_bandwidth()
    raw = GEOMETRIES[args.geometry]
    model = random_model(raw, fuse=not args.no_fuse)
    ctx = args.prompt_len + args.new_tokens // 2
    kv_bytes = model.new_cache(1, 1).nbytes() * ctx
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The floors: dense, every weight once per token; MoE, only the routed experts a
    # token uses (and embedding rows, not the table).
    floor_bytes = weight_bytes if model.config.moe is None else decode_weight_bytes(model, 1)
    must_read = decode_weight_bytes(model, 1) + kv_bytes
    res.update(copy_bandwidth_TBps=bw / 1e12, weight_bytes=weight_bytes, floor_bytes=floor_bytes,
               floor_ms=floor_bytes / bw * 1e3, strict_floor_ms=must_read / bw * 1e3)
    save()
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, 128000, (1, args.prompt_len), device="cuda", generator=gen)
    arms = args.arms.split(",")
    best_compiled = False
    for arm in arms:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if arm == "hf_generate":
                    if model.config.moe is not None:
                        raise ValueError("hf_generate arm: Llama geometries only (HF stores MoE experts fused)")
                    r = hf_arm(model, raw, prompt, args.new_tokens)
                elif arm == "engine_eager":
                    r = engine_arm(model, prompt, args.new_tokens)
                elif arm.startswith(("graph_eager", "graph_compiled")):
                    import draftsman.models.deepseek as deepseek
                    import draftsman.models.layers as layers
                    import draftsman.models.llama as llama

                    llama.attention = math_attention if "_math" in arm else sdpa_attention
                    use_gemv(model, "_cublas" not in arm)
                    llama.FUSED_DECODE = "_unfused" not in arm
                    chained_defaults = llama.FUSED_DECODE_CHAINED, llama.CHAINED_GATE_UP
                    absorb_default = deepseek.ABSORB_IN_COMBINE
                    llama.FUSED_DECODE_CHAINED = "_unchained" not in arm
                    if "_gu_" in arm:
                        fold = arm.split("_gu_")[1].split("_")[0]
                        llama.CHAINED_GATE_UP = () if fold == "none" else tuple(fold.split("-"))
                    layers.DECODE_ATTENTION = "_sdpa" not in arm
                    # MoE/MLA decode kernels (Moonlight): "_torchmoe" arms route with PyTorch's
                    # top-k, run the shared experts as their own SwiGLU and the absorbed
                    # per-head products as batched GEMMs (the path before those kernels)
                    deepseek.ROUTE_KERNEL = deepseek.SHARED_WITH_ROUTED = "_torchmoe" not in arm
                    deepseek.HEAD_GEMV_ROWS = 0 if "_torchmoe" in arm else 8
                    deepseek.ABSORB_IN_COMBINE = absorb_default and "_noabsorbcombine" not in arm
                    if "_autotune" in arm:  # Triton GEMM templates with fused epilogues
                        os.environ["DRAFTSMAN_COMPILE_MODE"] = "max-autotune-no-cudagraphs"
                    try:
                        argmax = (lambda x: x.argmax(-1)) if "_torchargmax" in arm else greedy_argmax
                        r, _runner, _cache = graph_arm(model, prompt, args.new_tokens, "compiled" in arm,
                                                       args.profile, argmax)
                    finally:
                        llama.attention = sdpa_attention
                        use_gemv(model, True)
                        llama.FUSED_DECODE = True
                        llama.FUSED_DECODE_CHAINED, llama.CHAINED_GATE_UP = chained_defaults
                        layers.DECODE_ATTENTION = True
                        deepseek.ROUTE_KERNEL = deepseek.SHARED_WITH_ROUTED = True
                        deepseek.HEAD_GEMV_ROWS = 8
                        deepseek.ABSORB_IN_COMBINE = absorb_default
                        os.environ.pop("DRAFTSMAN_COMPILE_MODE", None)
                    del _runner, _cache
                    if arm == "graph_compiled":
                        best_compiled = r["ms_per_token"] < res["arms"].get("graph_eager", {}).get("ms_per_token", 1e9)
                elif arm == "verify":
                    r = {"compiled": best_compiled, "ms": verify_costs(model, [1, 6, 16, 32, 64], ctx, best_compiled)}
                elif arm == "rounds":
                    def partial(figures: dict) -> None:
                        res["arms"]["rounds_partial"] = figures
                        save()
                    r = round_costs(model, ctx, [int(b) for b in args.batches.split(",")], compile=args.compile_rounds,
                                    names=args.round_specs.split(",") if args.round_specs else None, progress=partial,
                                    profile=args.profile)
                    res["arms"].pop("rounds_partial", None)
                    r["compiled"] = args.compile_rounds
                elif arm == "draft":
                    r = {"compiled": best_compiled} | draft_costs(model, [1, 4, 6, 8], ctx, best_compiled)
                else:
                    raise ValueError(f"unknown arm {arm!r}")
        except Exception as e:  # keep the other arms' figures; say what broke
            res["errors"][arm] = "".join(traceback.format_exception(e))[-3000:]
            save()
            continue
        r["wall_s"] = time.perf_counter() - t0
        if "ms_per_token" in r:
            r["fraction_of_floor"] = res["floor_ms"] / r["ms_per_token"]
            r["fraction_of_strict_floor"] = res["strict_floor_ms"] / r["ms_per_token"]
        r.pop("tokens", None)  # random weights: near-tied logits, so greedy tokens are no check here
        res["arms"][arm] = r
        print(arm, {k: v for k, v in r.items() if k != "tokens"}, flush=True)
        save()
    save()
    if args.h200_json:
        update_h200_json(args.h200_json, h200_figures(res), args.out or "(not saved)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
