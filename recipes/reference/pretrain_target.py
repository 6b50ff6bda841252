"""Pretrain draftsman's reference target: a small DeepSeek-V3 (MLA + MoE) chat model.

    python recipes/reference/pretrain_target.py --data ../shared/data/train \
        --tokenizer recipes/reference/out/tokenizer --out recipes/reference/out/target --minutes 6

Uses HF transformers' own DeepseekV3Config / DeepseekV3ForCausalLM. Every train conversation
of ../shared/data/train (normalised by refdata.py) is rendered with the tokenizer's chat
template, the documents are packed back to back into fixed-length windows, and the model is
trained with AdamW (warmup + cosine over the wall-clock budget), bf16 autocast and fp32
master weights. ~1% of conversations (refdata.is_validation) are held out for perplexity.

`--minutes` bounds the training loop (not data preparation or saving): training stops when it
runs out, the learning rate having followed its cosine schedule over that budget, and the
model is still evaluated and saved. The output is an ordinary HF checkpoint in bf16
(router weights and routing biases stay fp32, as transformers keeps them), sharded under
12 MB, with the tokenizer files, generation_config.json and train_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refdata

# The reference architecture; `--size toy` is for smoke tests on a CPU.
SIZES = {
    "reference": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1024,
                      moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2,
                      n_shared_experts=1, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
                      qk_rope_head_dim=16, v_head_dim=32),
    "toy": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_config(tokenizer, size: str, max_positions: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer), **SIZES[size],
        num_key_value_heads=SIZES[size]["num_attention_heads"],
        first_k_dense_replace=1,  # layer 0 dense, the rest MoE
        n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0,  # top-2 of 4 with normalised weights: no rescaling needed
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # no YaRN
        rope_interleave=True, attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=max_positions, initializer_range=0.02, tie_word_embeddings=False,
        num_nextn_predict_layers=0,  # no multi-token-prediction module is trained or saved
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )


def tokenize(tokenizer, convs) -> list[np.ndarray]:
    """Chat-template each conversation and encode it (batch, all cores). No special tokens are
    added: the template writes <|bos|> itself."""
    texts = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in convs]
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    out = []
    for i in range(0, len(texts), 4096):
        out += [np.asarray(e.ids, dtype=np.int32) for e in encode(texts[i:i + 4096], add_special_tokens=False)]
    return out


def pack(docs: list[np.ndarray], seq_len: int) -> torch.Tensor:
    """Documents back to back, cut into windows of seq_len + 1 tokens that overlap by one (inputs
    are window[:-1], targets window[1:], so every token but the first is a target once)."""
    stream = np.concatenate(docs)
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: after each optimizer step, every
    router's e_score_correction_bias moves by `speed` towards under-loaded experts. Counts are
    accumulated on the device by forward hooks (no host sync)."""

    def __init__(self, model, speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.speed = speed
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        self.totals = [torch.zeros_like(c) for c in self.counts]  # since the last load_fractions()
        for router, count in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(count))

    def _hook(self, count):
        def hook(module, args, output):
            if module.training:
                ids = output[2].reshape(-1)
                count.scatter_add_(0, ids, torch.ones_like(ids, dtype=count.dtype))
        return hook

    @torch.no_grad()
    def step(self) -> None:
        for router, count, total in zip(self.routers, self.counts, self.totals, strict=True):
            router.e_score_correction_bias.add_(self.speed * torch.sign(count.mean() - count))
            total.add_(count)
            count.zero_()

    def load_fractions(self) -> list[list[float]]:
        """Share of routed assignments per expert and MoE layer since the last call (host sync:
        for logs); a balanced layer gives each of E experts 1/E."""
        shares = [(t / t.sum().clamp_min(1)).tolist() for t in self.totals]
        for t in self.totals:
            t.zero_()
        return shares


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int, device, amp) -> float:
    """Mean next-token cross-entropy over every target token of the held-out windows."""
    model.eval()
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size].to(device, non_blocking=True)
        with amp():
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").double()
        count += w[:, 1:].numel()
    model.train()
    return (total / max(count, 1)).item()


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def save_checkpoint(model, tokenizer, out: Path, tokenizer_dir: Path) -> list[str]:
    """bf16 HF checkpoint in shards under 12 MB (transformers writes MoE experts per expert),
    with the router weight and routing bias kept fp32, plus the tokenizer files."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json"), out / "train_report.json"]:
        stale.unlink(missing_ok=True)  # a previous run's shards would shadow or mix with these
    model = model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.data = p.data.float()
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out), max_shard_size="12MB")
    for f in tokenizer_dir.iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            shutil.copy2(f, out / f.name)
    sizes = {f.name: f.stat().st_size for f in out.iterdir()}
    too_big = [n for n, s in sizes.items() if s >= 16 * 2**20]
    if too_big:
        raise RuntimeError(f"files of 16 MB or more: {too_big}")
    return sorted(sizes)


@torch.no_grad()
def sample(model, tokenizer, device, prompt: str, max_new_tokens: int = 96) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=False)
    ids = torch.tensor([tokenizer.encode(ids, add_special_tokens=False)], device=device)
    model.eval()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.train()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/train")
    ap.add_argument("--tokenizer", default="recipes/reference/out/tokenizer")
    ap.add_argument("--out", default="recipes/reference/out/target")
    ap.add_argument("--size", choices=sorted(SIZES), default="reference")
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    ap.add_argument("--total-minutes", type=float, default=None,
                    help="cap on the whole run: the training budget shrinks so that data preparation, "
                         "training, evaluation and saving end within it (for a device with a hard limit)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (toy runs)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--bias-update-speed", type=float, default=1e-3, help="router bias step (0: off)")
    ap.add_argument("--val-percent", type=float, default=1.0)
    ap.add_argument("--limit", type=int, default=None, help="toy runs: keep every n-th conversation")
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the training forward (off by default: see README)")
    ap.add_argument("--experts", choices=["auto", "grouped_mm", "eager"], default="auto",
                    help="transformers' experts implementation; auto: on a GPU, the faster of the two")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    import transformers
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer_dir = Path(args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train_convs, val_convs = refdata.load_split(args.data, args.val_percent, args.limit)
    random.Random(args.seed).shuffle(train_convs)
    t0 = time.time()
    train_docs, val_docs = tokenize(tokenizer, train_convs), tokenize(tokenizer, val_convs)
    train = pack(train_docs, args.seq_len).to(device)  # a few hundred MB: lives on the GPU
    val = pack(val_docs, args.seq_len)
    n_train_tokens = int(sum(len(d) for d in train_docs))
    log(f"data: {len(train_convs)} train / {len(val_convs)} held-out conversations, {n_train_tokens / 1e6:.2f}M "
        f"train tokens -> {len(train)} windows of {args.seq_len}; {len(val)} held-out windows "
        f"(tokenised in {time.time() - t0:.1f}s on {os.cpu_count()} cores)")

    config = make_config(tokenizer, args.size, args.max_positions)
    model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    experts = model.config._experts_implementation
    log(f"model: DeepseekV3ForCausalLM {n_params / 1e6:.2f}M parameters ({n_params * 2 / 2**20:.1f} MiB bf16), "
        f"attention {model.config._attn_implementation}, experts {experts}")

    balancer = RouterBalancer(model, args.bias_update_speed) if args.bias_update_speed > 0 else None
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=cuda)

    def amp():  # bf16 autocast on the GPU; CPU smoke tests stay fp32 (CPU bf16 matmuls are slow)
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def loss_fn(m, batch):
        with amp():
            logits = m(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def train_step(m, batch, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_fn(m, batch)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if balancer is not None:
            balancer.step()
        return loss.detach(), gnorm.detach()

    # Pre-flight: time forward+backward of a full batch with transformers' grouped-GEMM experts
    # and with its eager per-expert loop (fp32 master weights send grouped_mm down torch's
    # fallback path), and train with the faster; one that raises is skipped.
    experts_timing = {}
    candidates = [experts, "eager"] if args.experts == "auto" and cuda else [
        experts if args.experts == "auto" else args.experts]
    for impl in dict.fromkeys(candidates):
        try:
            model.set_experts_implementation(impl)
            iters = 4 if len(candidates) > 1 else 1  # one warm-up, three timed; or just a check
            t0 = time.time()
            for i in range(iters):
                if i == 1:
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.time()
                loss_fn(model, train[:args.batch_size]).backward()
            if cuda:
                torch.cuda.synchronize()
            experts_timing[impl] = round((time.time() - t0) / max(1, iters - 1), 4)
        except Exception as exc:
            experts_timing[impl] = f"{type(exc).__name__}: {str(exc)[:300]}"
        opt.zero_grad(set_to_none=True)
    timed = {k: v for k, v in experts_timing.items() if isinstance(v, float)}
    if not timed:
        raise RuntimeError(f"no experts implementation runs: {experts_timing}")
    experts = min(timed, key=timed.get)
    model.set_experts_implementation(experts)
    log(f"experts implementation: {experts} (seconds per forward+backward: {experts_timing})")
    if balancer is not None:
        for count in [*balancer.counts, *balancer.totals]:
            count.zero_()

    budget = args.minutes * 60.0
    if args.total_minutes is not None:
        reserve = 45.0  # final evaluation, a sample generation and saving take a few seconds on a GPU
        budget = max(0.0, min(budget, args.total_minutes * 60.0 - (time.time() - t_start) - reserve))
        log(f"training budget {budget:.0f}s (--minutes {args.minutes}, --total-minutes {args.total_minutes})")
    step, epoch, tokens_seen = 0, 0, 0
    order = torch.randperm(len(train), device=device)
    cursor = 0
    forward_model = model
    compile_state = {"requested": args.compile, "used": False, "error": None}
    if args.compile:
        log("compiling the model (torch.compile, default mode; falls back to eager on errors)")
        forward_model, compile_state["used"] = torch.compile(model), True
    history, last_eval = [], time.time()
    train_loss = float("nan")
    t_train = time.time()
    t_window, tok_window = time.time(), 0
    loss_acc, loss_n = torch.zeros((), device=device), 0

    def lr_at(step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)

    while True:
        # Progress (which drives the cosine) is the share of the wall-clock budget spent.
        progress = (time.time() - t_train) / budget if budget > 0 else 1.0
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1.0:
            break
        if cursor + args.batch_size > len(train):
            order, cursor, epoch = torch.randperm(len(train), device=device), 0, epoch + 1
        batch = train[order[cursor:cursor + args.batch_size]]
        cursor += args.batch_size
        try:
            loss, gnorm = train_step(forward_model, batch, lr_at(step, progress))
        except Exception as exc:  # only a compiled step may fail here; eager errors are raised
            if forward_model is model:
                raise
            compile_state.update(error=f"{type(exc).__name__}: {str(exc)[:300]}", used=False)
            log(f"torch.compile failed ({compile_state['error']}); continuing eager")
            forward_model = model
            opt.zero_grad(set_to_none=True)
            loss, gnorm = train_step(forward_model, batch, lr_at(step, progress))
        step += 1
        n_tok = batch[:, 1:].numel()
        tokens_seen += n_tok
        tok_window += n_tok
        loss_acc += loss
        loss_n += 1

        if step % args.log_every == 0:
            train_loss = (loss_acc / loss_n).item()  # the one host sync per log line
            now = time.time()
            rec = {"step": step, "epoch": epoch, "tokens": tokens_seen, "loss": round(train_loss, 4),
                   "lr": round(lr_at(step, progress), 6), "grad_norm": round(float(gnorm), 3),
                   "tokens_per_s": round(tok_window / (now - t_window)), "elapsed_s": round(now - t_train, 1)}
            if balancer is not None and step % (args.log_every * 10) == 0:
                loads = balancer.load_fractions()  # routed share per expert since the last report
                rec["expert_load_min_max"] = [round(min(min(x) for x in loads), 3),
                                              round(max(max(x) for x in loads), 3)]
            if now - last_eval >= args.eval_every_s:
                rec["val_loss"] = round(evaluate(model, val, args.batch_size, device, amp), 4)
                rec["val_ppl"] = round(math.exp(rec["val_loss"]), 2)
                last_eval = time.time()
            history.append(rec)
            log(json.dumps(rec))
            t_window, tok_window = time.time(), 0
            loss_acc, loss_n = torch.zeros((), device=device), 0
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.time() - t_train
    if loss_n:
        train_loss = (loss_acc / loss_n).item()

    val_loss = evaluate(model, val, args.batch_size, device, amp)
    log(f"trained {step} steps ({tokens_seen / 1e6:.1f}M tokens, {epoch} full epochs) in {train_seconds:.0f}s: "
        f"{tokens_seen / train_seconds:.0f} tokens/s; train loss {train_loss:.4f}; held-out loss "
        f"{val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
    prompt = "How do I sort a list in Python?"
    generation = sample(model, tokenizer, device, prompt)
    log(f"sample: {prompt!r} -> {generation!r}")

    out = Path(args.out)
    files = save_checkpoint(model, tokenizer, out, tokenizer_dir)
    report = {
        "model": "DeepseekV3ForCausalLM", "size": args.size,
        "architecture": {k: getattr(config, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
            "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "max_position_embeddings", "routed_scaling_factor", "tie_word_embeddings")},
        "parameters": n_params,
        "bf16_megabytes": round(sum((out / f).stat().st_size for f in files if f.endswith(".safetensors")) / 1e6, 2),
        "train_conversations": len(train_convs), "heldout_conversations": len(val_convs),
        "train_tokens_per_epoch": n_train_tokens, "heldout_tokens": int(val[:, 1:].numel()),
        "steps": step, "batch_size": args.batch_size, "seq_len": args.seq_len, "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / max(1, len(train) * args.seq_len), 2),
        "train_budget_seconds": round(budget, 1), "train_seconds": round(train_seconds, 1),
        "tokens_per_s": round(tokens_seen / train_seconds),  # evaluations and warm-up included
        "tokens_per_s_median_window": round(float(np.median([h["tokens_per_s"] for h in history]))) if history else None,
        "final_train_loss": round(train_loss, 4), "heldout_loss": round(val_loss, 4),
        "heldout_perplexity": round(math.exp(val_loss), 3),
        "heldout_note": "mean next-token loss over all tokens (user, assistant, specials) of the held-out "
                        "conversations, packed like the training data",
        "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay, "router_bias_update_speed": args.bias_update_speed,
        "experts_implementation": experts, "experts_timing_s": experts_timing, "compile": compile_state,
        "sample": {"prompt": prompt, "greedy_96_tokens": generation},
        "wall_seconds": round(time.time() - t_start, 1),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", "recipes/reference/pretrain_target.py", *(argv or sys.argv[1:])]),
        "files": [*files, "train_report.json"], "history": history,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"saved {out} ({report['bf16_megabytes']} MB of weights); wall {report['wall_seconds']}s")


if __name__ == "__main__":
    main()
