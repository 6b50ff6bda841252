"""DeepSeek-V3 / Kimi-K2: multi-head latent attention (MLA) and DeepSeek's mixture of experts.

Attention caches only the compressed latent: per token the normalised `c_kv` (kv_lora_rank) and
the rotated key shared by all heads (qk_rope_head_dim). With a cache, attention runs in the
"absorbed" form: `kv_b_proj`'s key half is folded into the query and its value half applied after
attention, so every head attends directly over the latent (multi-query attention with one
kv_lora_rank + rope wide key head). Without a cache the ordinary per-head keys/values are expanded,
as Hugging Face does; both compute the same function.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsman.config import MoEConfig, TargetConfig
from draftsman.kernels import triton_available
from draftsman.models.base import AttnContext, TargetModel
from draftsman.models.layers import (
    DecodeLinear,
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rotary,
    attention,
    decode_kernel_applies,
    deinterleave,
    fuse_linears,
    yarn_softmax_scale,
)
from draftsman.weights import SKIP, CheckpointError

# Set once a Triton MoE kernel (experts or routing) has failed in this process (the error, for reports).
_KERNEL_FAILED: list[str] = []


def _kernels_usable(x: Tensor, *weights: Tensor) -> bool:
    """The Triton MoE kernels apply: on CUDA, Triton present, no earlier failure, and no
    autograd graph to record (they have no backward)."""
    recording = torch.is_grad_enabled() and any(w.requires_grad for w in (x, *weights))
    return x.is_cuda and triton_available() and not _KERNEL_FAILED and not recording


def _kernel_failed(e: Exception) -> None:
    """A Triton build or launch failure: note it, warn once, and serve on through PyTorch."""
    _KERNEL_FAILED.append(repr(e))
    warnings.warn(f"Triton MoE kernel failed ({e!r}); using the PyTorch experts and routing (one host sync "
                  "per MoE layer) from now on", stacklevel=3)

# DeepSeek's reference code (and HF) build q_a/kv_a layernorms without passing rms_norm_eps.
_LATENT_NORM_EPS = 1e-6

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


# Rows (tokens) up to which MLA's absorbed per-head products run as Triton GEMVs (decode; 0: never).
HEAD_GEMV_ROWS = 8
# Routing in one Triton kernel (kernels/router.py) on CUDA; False: PyTorch's top-k chain.
ROUTE_KERNEL = True
# Decode: the shared experts in the routed experts' two kernel launches; False: a separate SwiGLU.
SHARED_WITH_ROUTED = True
# Decode: the attention's split combine and the absorbed value projection in one kernel
# (kernels.attention.combine_project) instead of two combine kernels and a head_gemv: Moonlight
# on the H200 at 2.372 ms/token against 2.449 in the same run (h200_decode arm `_noabsorbcombine`).
ABSORB_IN_COMBINE = True


def _head_gemv_applies(x: Tensor, w: Tensor) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype and triton_available()
            and x.shape[0] * x.shape[1] <= HEAD_GEMV_ROWS and not (x.requires_grad or w.requires_grad))


class MLAttention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank = mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        h, q_out, bias = cfg.hidden_size, self.n_heads * mla.qk_head_dim, cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, h, bias=bias)
        # HF and DeepSeek's own code apply the mscale_all_dim softmax correction under any
        # non-default rope scaling (in practice always YaRN).
        rope = cfg.rope if cfg.rope.type == "default" else replace(cfg.rope, type="yarn")
        self.scale = yarn_softmax_scale(rope, mla.qk_head_dim)

    def _rope(self, x: Tensor, ctx: AttnContext) -> Tensor:
        # Checkpoints with rope_interleave store each rotary pair side by side; regrouping them
        # into halves first is exactly HF's interleaved rotation (its output is half-split too).
        if self.interleaved:
            x = deinterleave(x)
        return apply_rotary(x, ctx.cos, ctx.sin)

    def kernel_heads(self) -> tuple[int, int, int, int, int]:
        """The absorbed form's layout (layers.decode_kernel_serves): every head a query against
        one KV head, the latent (keys and values) plus the rope part."""
        return self.n_heads, 1, self.rank, self.rank, self.rope_dim

    def _input_projections(self) -> list[nn.Module]:
        """The projections of the layer input: q (or its LoRA down-projection) and kv_a."""
        return [self.q_proj if hasattr(self, "q_proj") else self.q_a_proj, self.kv_a_proj_with_mqa]

    def fuse(self) -> None:
        """One GEMM for the projections of x (inference): see layers.fuse_linears."""
        fused = fuse_linears(self._input_projections())
        if fused is not None:  # a plain attribute: not a submodule, so never counted or saved twice
            object.__setattr__(self, "q_kv_a_proj", fused)

    def forward(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        b, t, _ = x.shape
        if hasattr(self, "q_kv_a_proj"):
            q_in, kv = self.q_kv_a_proj(x).split([m.out_features for m in self._input_projections()], dim=-1)
        else:
            q_in, kv = (m(x) for m in self._input_projections())
        q = q_in if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(q_in))
        q_nope, q_pe = q.view(b, t, self.n_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = self._rope(q_pe, ctx)
        k_pe = self._rope(k_pe[:, :, None], ctx)  # [B, T, 1, rope]: one key shared by all heads
        if ctx.cache is None:
            out = self._expanded(q_nope, q_pe, c_kv, k_pe, ctx.mask)
        else:
            ctx.cache.write(layer, ctx.cache_index, ckv=c_kv, kpe=k_pe[:, :, 0])
            s = ctx.mask.shape[-1]
            c_all, pe_all = ctx.cache.read(layer, "ckv", s), ctx.cache.read(layer, "kpe", s)
            out = self._absorbed(q_nope, q_pe, c_all, pe_all, ctx.mask, ctx.limit)
        return self.o_proj(out.reshape(b, t, -1))

    def _expanded(self, q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, mask: Tensor) -> Tensor:
        """Per-head keys and values decompressed from the latent: what HF computes."""
        b, s, _ = c_kv.shape
        k_nope, v = self.kv_b_proj(c_kv).view(b, s, self.n_heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(b, s, self.n_heads, self.rope_dim)), dim=-1)
        return attention(torch.cat((q_nope, q_pe), dim=-1), k, v, mask, self.scale)

    def _absorbed(self, q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, mask: Tensor,
                  limit: Tensor | None = None) -> Tensor:
        """Attention over the cached latent. q_nope.k_nope = (q_nope W_UK) . c_kv, and
        softmax(.) (c_kv W_UV^T) = (softmax(.) c_kv) W_UV^T, so no per-slot decompression is needed:
        each head becomes a query of width kv_lora_rank + rope against one shared key/value head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [heads, nope, rank], [heads, v, rank]
        b, t = q_nope.shape[:2]
        if _head_gemv_applies(q_nope, w):  # decode: the per-head products as GEMVs, not batched GEMMs
            from draftsman.kernels.gemv import head_gemv

            q_latent = head_gemv(q_nope.reshape(b * t, self.n_heads, self.nope), w_uk, transposed=True)
            q_latent = q_latent.view(b, t, self.n_heads, self.rank)
        else:
            q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
        # keys [c_kv | k_pe] (one head), values c_kv: the cache is read in place, never concatenated
        rope = (q_pe, k_pe[:, :, None])
        if ABSORB_IN_COMBINE and _head_gemv_applies(q_latent, w) and decode_kernel_applies(q_latent, c_kv[:, :, None],
                                                                                          None, rope):
            from draftsman.kernels.attention import decode_attention

            return decode_attention(q_latent, c_kv[:, :, None], None, mask, self.scale, rope=rope, out_proj=w_uv,
                                    limit=limit)
        out_latent = attention(q_latent, c_kv[:, :, None], None, mask, self.scale, rope=rope,
                               limit=limit)  # [B, T, heads, rank]
        if _head_gemv_applies(out_latent, w):
            from draftsman.kernels.gemv import head_gemv

            return head_gemv(out_latent.reshape(b * t, self.n_heads, self.rank), w_uv).view(b, t, self.n_heads, -1)
        return torch.einsum("bthr,hvr->bthv", out_latent, w_uv)


class Router(nn.Module):
    """DeepSeek-V3 routing: sigmoid affinities; a per-expert bias steers only *which* experts are
    chosen (group-limited), the mixing weights are the unbiased affinities. Kept in fp32, as HF
    does, so low-precision weights do not perturb expert choice."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        moe = self.moe
        if ROUTE_KERNEL and _kernels_usable(x, self.weight):
            from draftsman.kernels.router import routable

            if routable(moe.n_routed_experts, moe.num_experts_per_tok, moe.n_group):
                try:
                    return self._route_kernel(x)
                except Exception as e:
                    _kernel_failed(e)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if moe.n_group > 1:
            # Rank groups by the sum of their two best biased scores; keep the best topk_group.
            grouped = choice.view(x.shape[0], moe.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(moe.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids

    def _route_kernel(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """forward's choice in one Triton kernel after the fp32 matmul (on the GEMV kernel for
        decode's few rows): no top-k/sort chain of small kernels per layer."""
        from draftsman.kernels.gemv import gemv
        from draftsman.kernels.router import route

        moe, w = self.moe, self.weight.float()
        # (2 experts a program: 32 programs over Moonlight's 64 x 2048 fp32 router)
        logits = gemv(x.float(), w, block_n=2) if x.shape[0] <= 8 else F.linear(x.float(), w)
        return route(logits, self.e_score_correction_bias, moe.num_experts_per_tok, moe.n_group, moe.topk_group,
                     moe.norm_topk_prob, moe.routed_scaling_factor)


class Experts(nn.Module):
    """Routed SwiGLU experts stacked along dim 0, in nn.Linear's [out, in] orientation, so one
    per-expert checkpoint tensor fills one slice."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        e, i = moe.n_routed_experts, moe.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, hidden))
        self.up_proj = nn.Parameter(torch.empty(e, i, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, i))

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x [N, H], weights/ids [N, k] -> sum_k weights * expert_ids(x)."""
        if self.gate_proj.shape[0] <= 2 * ids.shape[1]:
            return self.dense(x, weights, ids)
        if _kernels_usable(x, self.gate_proj):  # grouped on the device: no host sync
            try:
                from draftsman.kernels.moe import moe_experts

                return moe_experts(x, weights, ids, self.gate_proj, self.up_proj, self.down_proj)
            except Exception as e:
                _kernel_failed(e)
        return self.grouped(x, weights, ids)

    def dense(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Every expert on every token, unchosen ones weighted 0: with few experts (E <= 2k) this
        costs at most twice the routed compute and has no host sync (CUDA-graph friendly)."""
        e = self.gate_proj.shape[0]
        mix = torch.zeros(x.shape[0], e, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        h = x[None].expand(e, -1, -1)
        y = F.silu(torch.bmm(h, self.gate_proj.transpose(1, 2))) * torch.bmm(h, self.up_proj.transpose(1, 2))
        y = torch.bmm(y, self.down_proj.transpose(1, 2))  # [E, N, H]
        # Scale in fp32 (the weights' dtype) and round once per expert, as the grouped path does.
        scaled = (y * mix.T[:, :, None]).to(x.dtype)
        out = scaled[0]
        for i in range(1, e):  # sum in the grouped path's order (expert 0 first): same rounding
            out = out + scaled[i]
        return out

    def grouped(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Each expert on the tokens routed to it."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # group the N*k assignments by expert
        tokens = order // k
        # One host sync per MoE layer to size each expert's batch: simple and fine on CPU; on
        # CUDA with Triton, kernels.moe runs the same grouping without it.
        counts = torch.bincount(flat, minlength=self.gate_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            w = weights.flatten()[order[start : start + count]]
            h = x[rows]
            y = F.silu(h @ self.gate_proj[expert].T) * (h @ self.up_proj[expert].T)
            # Scale in fp32 (the weights' dtype) and round once, as HF does.
            out.index_add_(0, rows, ((y @ self.down_proj[expert].T) * w[:, None]).to(x.dtype))
            start += count
        return out


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = Experts(cfg.hidden_size, moe)
        if moe.n_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, moe.moe_intermediate_size * moe.n_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        shared = self._decode_shared(flat, ids)
        if shared is not None:  # decode: routed and shared experts in the same two kernel launches
            try:
                from draftsman.kernels.moe import moe_experts_gemv

                e = self.experts
                return moe_experts_gemv(flat, weights, ids, e.gate_proj, e.up_proj, e.down_proj, shared).view_as(x)
            except Exception as err:
                _kernel_failed(err)
        out = self.experts(flat, weights, ids).view_as(x)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def _decode_shared(self, flat: Tensor, ids: Tensor) -> tuple[Tensor, Tensor] | None:
        """The shared experts' (gate_up, down) weights when the decode kernels can take them
        along with the routed ones: few assignments, plain stacked experts (not packed INT4, not
        the all-experts path), fused shared gate/up (inference), one dtype."""
        e, shared = self.experts, getattr(self, "shared_experts", None)
        if not SHARED_WITH_ROUTED or shared is None or type(e) is not Experts or not _kernels_usable(flat, e.gate_proj):
            return None
        # (kernels.moe imports Triton: only once _kernels_usable found it)
        from draftsman.kernels.moe import GEMV_ASSIGNMENTS

        if ids.numel() > GEMV_ASSIGNMENTS:
            return None
        if e.gate_proj.shape[0] <= 2 * ids.shape[1] or not hasattr(shared, "gate_up_proj"):
            return None
        gate_up, down = shared.gate_up_proj, shared.down_proj
        if type(down) not in (nn.Linear, DecodeLinear) or down.bias is not None or gate_up.bias is not None:
            return None
        if down.in_features % e.gate_proj.shape[1]:  # shared inner: whole multiples of an expert's
            return None
        if len({e.gate_proj.dtype, gate_up.weight.dtype, flat.dtype}) != 1:
            return None
        return gate_up.weight, down.weight


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        use_moe = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        self.mlp = MoE(cfg) if use_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, ctx: AttnContext, layer: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(TargetModel):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__(cfg)
        assert cfg.mla is not None, "DeepseekV3Model needs an MLA config"
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.rotary = Rotary(cfg.rope, cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings)
        for name, param in self.named_parameters():
            if ".mlp.experts." in name:
                self.stacked_params[name] = param.shape[0]
        self.tie_weights()

    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        mla = self.config.mla
        assert mla is not None
        return {"ckv": (mla.kv_lora_rank,), "kpe": (mla.qk_rope_head_dim,)}

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | str | None:
        """HF / DeepSeek names: `model.X` -> `X`; per-expert tensors -> a slice of the stacked
        expert parameter; layers past num_hidden_layers (the MTP module) are skipped."""
        if name.endswith("rotary_emb.inv_freq"):
            return SKIP
        if name == "lm_head.weight":
            return name, None
        layer = _LAYER_RE.fullmatch(name)
        if layer is None:
            return (name.removeprefix("model."), None) if name.startswith("model.") else None
        index, rest = int(layer.group(1)), layer.group(2)
        if index >= self.config.num_hidden_layers:
            return SKIP  # DeepSeek-V3's multi-token-prediction layer(s)
        expert = _EXPERT_RE.fullmatch(rest)
        if expert is not None:
            return f"layers.{index}.mlp.experts.{expert.group(2)}", int(expert.group(1))
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            raise CheckpointError(
                f"tensor '{name}': fused expert tensors (transformers' in-memory layout, written by "
                "save_pretrained(save_original_format=False)) are not supported; re-save the model "
                "with save_pretrained() defaults to get per-expert tensors"
            )
        return f"layers.{index}.{rest}", None
