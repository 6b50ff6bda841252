"""Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm). GQA, tied or
untied embeddings, RoPE default/linear/llama3/yarn."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsman.config import TargetConfig
from draftsman.models.base import AttnContext, TargetModel
from draftsman.models.layers import (
    DecodeLinear,
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rotary,
    attention,
    fuse_qkv,
    project_qkv,
    qkv_sizes,
)
from draftsman.weights import SKIP

# Batch-1 decode layers as four fused GEMV kernels where they apply (LlamaDecoderLayer.fused_decode);
# False: every op separately (benchmarks compare both).
FUSED_DECODE = True
# ... as decode_chained (norms fed by the previous GEMV's sums of squares, and a bare gate/up
# GEMV, see CHAINED_GATE_UP): on the H200 (8B, compiled and graphed) 4.473 ms/token against
# 4.606 with gate/up folding SiLU * up, and 4.639 for decode_fused (another call); with gate/up
# on cuBLAS and greedy_argmax, 4.396 (0.857 of the floor; results/h200_decode_8b_default.json).
FUSED_DECODE_CHAINED = True
# decode_chained's gate/up GEMV: which of the post-attention RMSNorm ("norm") and SiLU(gate) * up
# ("glu") it folds in. The others run apart: the norm as one small op on the o GEMV's sums of
# squares, SiLU * up in the down GEMV's prologue. Both folded cost gate/up 65.9 us against 56.7
# bare on the H200 (benchmarks/h200_gemv.py), 0.3 ms per 8B step. "linear" (nothing folded):
# the bare GEMV as a PyTorch matmul (cuBLAS: 55.2 us there) instead of the Triton kernel.
CHAINED_GATE_UP: tuple[str, ...] = ("linear",)  # 4.396 ms/token against 4.438 with the Triton GEMV


class LlamaAttention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and cfg.model_type != "qwen2"  # Qwen2 biases q/k/v only
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        return self.o_proj(self.attend(*project_qkv(self, x), ctx, layer))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        """Attention over projected q/k/v [B, T, heads * head_dim] (rotary, cache write and read):
        the input of o_proj, [B, T, n_heads * head_dim]."""
        b, t, _ = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write(layer, ctx.cache_index, k=k, v=v)
            s = ctx.mask.shape[-1]
            k, v = ctx.cache.read(layer, "k", s), ctx.cache.read(layer, "v", s)
        return attention(q, k, v, ctx.mask, self.scale, limit=ctx.limit).reshape(b, t, -1)

    def kernel_heads(self) -> tuple[int, int, int, int]:
        """(query heads, KV heads, key width, value width): layers.decode_kernel_serves."""
        return self.n_heads, self.n_kv, self.head_dim, self.head_dim

    def fuse(self) -> None:
        """One GEMM for q, k and v (inference; TargetModel.fuse_projections)."""
        fuse_qkv(self)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        if self.fused_decode(x):
            return self.decode_fused(x, ctx, layer)
        ctx.norm_ss = None  # (they describe a fused layer's output, not this one's)
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_decode(self, x: Tensor) -> bool:
        """One token of one sequence (a batch-1 decode step) of an inference model on CUDA whose
        GEMVs run on the Triton kernel (layers.use_gemv), with fused, bias-free projections."""
        attn, mlp = self.self_attn, self.mlp
        return (FUSED_DECODE and x.numel() == x.shape[-1] and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and type(attn.o_proj) is DecodeLinear and hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")
                and attn.qkv_proj.bias is None and attn.o_proj.bias is None and not hasattr(attn, "q_norm"))

    def decode_fused(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        """forward() for fused_decode inputs in four GEMV kernels with the layer's small ops folded
        in (same roundings): RMSNorm into the q/k/v and gate/up GEMVs, SiLU * up into the down
        GEMV, the residual adds into the o and down GEMVs."""
        from draftsman.kernels.gemv import fused_tiles, gemv

        if FUSED_DECODE_CHAINED:
            return self.decode_chained(x, ctx, layer)
        attn, mlp, n1, n2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        h = x.view(1, -1)
        w = attn.qkv_proj.weight
        qkv = gemv(h, w, norm_weight=n1.weight, eps=n1.eps, **fused_tiles(*w.shape)).view(*x.shape[:-1], -1)
        out = attn.attend(*qkv.split(qkv_sizes(attn), dim=-1), ctx, layer)
        h = gemv(out.view(1, -1), attn.o_proj.weight, residual=h)
        w = mlp.gate_up_proj.weight
        gate_up = gemv(h, w, norm_weight=n2.weight, eps=n2.eps, **fused_tiles(*w.shape))
        w = mlp.down_proj.weight
        return gemv(gate_up, w, swiglu=True, residual=h, **fused_tiles(*w.shape)).view_as(x)

    def decode_chained(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        """decode_fused's variant with less work repeated per program: the o and down GEMVs leave
        their output row's sum of squares in partials, which the next norm reads instead of a
        pass over its input (ctx.norm_ss carries them between layers); SiLU(gate) * up in the
        gate/up GEMV's epilogue (gate and up rows in one program). CHAINED_GATE_UP says which
        of the norm and SiLU * up the gate/up GEMV folds in."""
        from draftsman.kernels.gemv import fused_tiles, gemv, sum_squares_parts

        attn, mlp, n1, n2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        h = x.view(1, -1)
        ss = ctx.norm_ss if ctx.norm_ss is not None and ctx.norm_ss.device == x.device else None
        w = attn.qkv_proj.weight
        qkv = gemv(h, w, norm_weight=n1.weight, eps=n1.eps, norm_sum_squares=ss, **fused_tiles(*w.shape))
        out = attn.attend(*qkv.view(*x.shape[:-1], -1).split(qkv_sizes(attn), dim=-1), ctx, layer)
        ss = h.new_empty(1, sum_squares_parts(h.shape[1], 8), dtype=torch.float32)
        h = gemv(out.view(1, -1), attn.o_proj.weight, residual=h, sum_squares_out=ss, block_n=8)
        w, fold = mlp.gate_up_proj.weight, CHAINED_GATE_UP
        if "norm" in fold:
            x2, norm = h, {"norm_weight": n2.weight, "eps": n2.eps, "norm_sum_squares": ss}
        else:
            x2, norm = rms_norm_from_sum_squares(h, ss, n2), {}
        if "glu" in fold:
            act, down = gemv(x2, w, glu=True, block_n=4, **norm), {"block_n": 8}
        else:  # SiLU * up in the down GEMV's prologue (recomputed per program: its wide tiles)
            act = x2 @ w.t() if "linear" in fold and not norm else gemv(x2, w, block_n=8, **norm)
            down = {"swiglu": True, **fused_tiles(*mlp.down_proj.weight.shape)}
        ctx.norm_ss = h.new_empty(1, sum_squares_parts(h.shape[1], down["block_n"]), dtype=torch.float32)
        return gemv(act, mlp.down_proj.weight, residual=h, sum_squares_out=ctx.norm_ss, **down).view_as(x)


def rms_norm_from_sum_squares(x: Tensor, sum_squares: Tensor, norm: RMSNorm) -> Tensor:
    """norm(x) for rows [M, K] whose sums of squares are given in fp32 partials [M, P]: the
    roundings of layers.RMSNorm without its pass over x for them."""
    rstd = torch.rsqrt(sum_squares.sum(-1, keepdim=True) / x.shape[-1] + norm.eps)
    return norm.weight * (x.float() * rstd).to(x.dtype)


class LlamaModel(TargetModel):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.tie_weights()

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        kv = (self.config.num_key_value_heads, self.config.head_dim)
        return {"k": kv, "v": kv}

    def checkpoint_name(self, name: str) -> tuple[str, None] | str | None:
        """HF names: `model.X` -> `X`, `lm_head.weight` as is (absent when tied)."""
        if name.endswith("rotary_emb.inv_freq"):  # stored by old checkpoints; recomputed here
            return SKIP
        if name.startswith("model."):
            return name.removeprefix("model."), None
        if name == "lm_head.weight":
            return name, None
        return None
