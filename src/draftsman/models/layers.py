"""Building blocks shared by every model: RMSNorm, rotary embeddings, SwiGLU MLP, attention."""

from __future__ import annotations

import math
import os
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from draftsman.config import RopeConfig
from draftsman.kernels import triton_available

# Outputs at most this wide go to the Triton GEMV at batch 1: measured on the H200 for the 8B's
# shapes (benchmarks/h200_gemv.py), it reads q/k/v, o and down weights at 0.81-0.95 of copy
# bandwidth where cuBLAS reaches 0.63-0.90; for gate/up and lm_head cuBLAS is as fast or faster.
GEMV_MAX_OUT = 8192


class DecodeLinear(nn.Linear):
    """An inference nn.Linear (same parameters and state_dict) whose products run where they
    measured fastest: one-row products on CUDA in bf16/fp16 on draftsman's Triton GEMV
    (kernels/gemv.py) where that beat cuBLAS; on CPU, oneDNN over a copy of the weight reordered
    once into its blocked layout (cpu_packed_linear); everything else is F.linear."""

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:
            if (x.numel() == self.in_features and self.bias is None and self.out_features <= GEMV_MAX_OUT
                    and x.dtype in (torch.bfloat16, torch.float16) and triton_available()):
                from draftsman.kernels.gemv import gemv

                return gemv(x.reshape(1, -1), self.weight).view(*x.shape[:-1], self.out_features)
        elif cpu_packs(self, x):
            out = cpu_packed_linear(self, x)
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)


# CPU products through oneDNN with the weight reordered once (what vLLM's CPU backend does):
# MKL's sgemm under F.linear reads a [N, K] weight at a fraction of the bandwidth for the few rows
# of decode and verify steps. SmolLM2-135M's 121 projections of a step, fp32, 2 cores of this
# project's AMD EPYC (benchmarks/cpu_linear_rows.py): F.linear 49.1 / 65.9 / 63.0 ms at 1 / 4 /
# 8 rows, packed 26.1 / 24.1 / 29.0 ms. DRAFTSMAN_CPU_PACK=0 (read at import) turns it off.
CPU_PACK = os.environ.get("DRAFTSMAN_CPU_PACK", "1") != "0" and torch.backends.mkldnn.is_available()
# The row count oneDNN's reorder plans the blocked layout for; one packing serves every count
# (16 measured as fast as 1 at one row, and faster from 4 up).
CPU_PACK_ROWS = 16


def cpu_packs(linear: nn.Linear, x: Tensor) -> bool:
    """Whether DecodeLinear runs x on the packed CPU path: CPU_PACK, fp32/bf16 input and weight
    alike, no gradient wanted, not inside torch.compile (inductor packs weights itself)."""
    return (CPU_PACK and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and linear.weight.dtype == x.dtype and not linear.weight.requires_grad
            and not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling())


def cpu_packed_linear(linear: nn.Linear, x: Tensor) -> Tensor | None:
    """F.linear(x, weight, bias) through oneDNN on a reordered copy of the weight, made on first
    use (so only the projections a forward runs are packed: not q/k/v once fused into qkv) and
    again whenever the weight is written in place (its version counter moves). The copy doubles
    the memory of each packed weight. None where oneDNN refused the first product (warned once;
    the caller computes F.linear, and this module no longer tries)."""
    w = linear.weight
    packed = linear.__dict__.get("_cpu_packed")
    if packed is False:
        return None
    bias = linear.bias.detach() if linear.bias is not None else None
    if packed is not None and packed[0] == w._version and packed[1] == w.data_ptr():
        return torch.ops.mkldnn._linear_pointwise(x, packed[2], bias, "none", [], "")
    try:
        packed = (w._version, w.data_ptr(), torch.ops.mkldnn._reorder_linear_weight(w.detach(), CPU_PACK_ROWS))
        out = torch.ops.mkldnn._linear_pointwise(x, packed[2], bias, "none", [], "")
    except RuntimeError as e:
        linear.__dict__["_cpu_packed"] = False
        warnings.warn(f"oneDNN refused a packed {tuple(w.shape)} {w.dtype} product ({e}); using F.linear there",
                      stacklevel=3)
        return None
    linear.__dict__["_cpu_packed"] = packed
    return out


def use_cpu_packing(model: nn.Module, on: bool = True) -> None:
    """Route an inference model's CPU products to oneDNN with packed weights (DecodeLinear), or
    back to nn.Linear; only the class changes (the packed copies are made on first use).
    No-op where CPU_PACK is off or for trainable weights."""
    if on and not CPU_PACK:
        return
    for m in inference_linears(model):
        if m.weight.device.type == "cpu":
            m.__class__ = DecodeLinear if on else nn.Linear
            m.__dict__.pop("_cpu_packed", None)


def inference_linears(model: nn.Module) -> list[nn.Linear]:
    """A model's frozen nn.Linear/DecodeLinear modules, the fused projections among them."""
    mods = list(model.modules()) + [getattr(m, a) for m in model.modules() for a in FUSED_ATTRS if hasattr(m, a)]
    return [m for m in mods if type(m) in (nn.Linear, DecodeLinear) and not m.weight.requires_grad]


# Fused projections kept as plain attributes (not submodules) by the modules' `fuse`.
FUSED_ATTRS = ("qkv_proj", "gate_up_proj", "q_kv_a_proj")


def use_gemv(model: nn.Module, on: bool = True) -> None:
    """Route an inference model's batch-1 GEMVs to the Triton kernel (DecodeLinear), or back to
    nn.Linear; only the class changes. No-op without Triton or for trainable weights."""
    if on and not triton_available():
        return
    for m in inference_linears(model):
        m.__class__ = DecodeLinear if on else nn.Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and cast back before the weight, as HF Llama/DeepSeek do.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the MLP of Llama, Qwen and DeepSeek."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        """One GEMM for gate and up (inference): see fuse_linears."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:  # a plain attribute: not a submodule, so never counted or saved twice
            object.__setattr__(self, "gate_up_proj", fused)


def fuse_projections(model: nn.Module) -> None:
    """Fuse every submodule's same-input projections (its `fuse`: q/k/v, gate/up), for
    inference, and route batch-1 GEMVs to the Triton kernel where it pays (use_gemv) and CPU
    products to oneDNN with packed weights (use_cpu_packing);
    parameter names, values and the state_dict are unchanged."""
    for module in model.modules():
        if module is not model and hasattr(module, "fuse"):
            module.fuse()
    use_gemv(model)
    use_cpu_packing(model)


def qkv_sizes(attn: nn.Module) -> list[int]:
    """Widths of q, k and v in the fused qkv_proj output."""
    return [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]


def project_qkv(attn: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of an attention module with q_proj/k_proj/v_proj, through their fused qkv_proj
    when `fuse_qkv` made one."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj(x).split(qkv_sizes(attn), dim=-1)
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def fuse_qkv(attn: nn.Module) -> None:
    """One GEMM for q, k and v (inference): see fuse_linears."""
    fused = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    if fused is not None:  # a plain attribute: not a submodule, so never counted or saved twice
        object.__setattr__(attn, "qkv_proj", fused)


def fuse_linears(linears: list[nn.Module]) -> nn.Linear | None:
    """A Linear computing cat([l(x) for l in linears], -1) in one GEMM, or None when they cannot
    be fused (not plain Linears, e.g. INT4-packed; trainable; different dtype/device; mixed
    biases). The originals' parameters become views of the fused ones, so names, state_dict
    and memory stay as they were. A decode step reads each weight once either way, but one wide GEMV uses the
    memory bandwidth better than several narrow ones (measured on the H200: an 8 MB GEMV runs
    at ~38% of copy bandwidth, a 48 MB one at ~65%+)."""
    if not all(type(m) in (nn.Linear, DecodeLinear) for m in linears):
        return None
    if any(p.requires_grad for m in linears for p in m.parameters()):
        return None  # trainable: gradients would reach the fused copy, not the parameters
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or weights[0].is_meta:
        return None
    if any(b is None for b in biases) != all(b is None for b in biases):
        return None
    w = weights[0]
    fused = nn.Linear(w.shape[1], sum(x.shape[0] for x in weights), bias=biases[0] is not None,
                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat(biases))
    fused.requires_grad_(False)
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused.weight[start : start + n], requires_grad=False)
        if fused.bias is not None:
            m.bias = nn.Parameter(fused.bias[start : start + n], requires_grad=False)
        start += n
    return fused


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """Inverse frequencies for `dim` rotary dims and the factor that scales cos/sin
    (YaRN's attention factor; 1.0 otherwise). Same arithmetic as HF transformers."""
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    original = rope.original_max_position_embeddings or max_position_embeddings
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        low_wavelen = original / rope.low_freq_factor
        high_wavelen = original / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, dim, original)
    raise ValueError(f"unsupported rope type {rope.type!r}")


def _yarn_inv_freq(rope: RopeConfig, dim: int, original: int) -> tuple[Tensor, float]:
    factor, base = rope.factor, rope.theta
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled frequency per dim
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def yarn_softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """DeepSeek's softmax scale: 1/sqrt(d) times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = head_dim**-0.5
    if rope.type == "yarn" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class Rotary(nn.Module):
    """cos/sin tables indexed by absolute position (so tree tokens can take any position)."""

    def __init__(self, rope: RopeConfig, dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rope, self.dim, self.max_position_embeddings = rope, dim, max_position_embeddings
        self.register_buffer("inv_freq", torch.empty(dim // 2, dtype=torch.float32), persistent=False)
        self.attention_factor = 1.0
        if self.inv_freq.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the frequency table in fp32 (also after building on the meta device)."""
        inv_freq, self.attention_factor = rope_inv_freq(self.rope, self.dim, self.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, T, dim] (half-split layout, duplicated halves)."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


def deinterleave(x: Tensor) -> Tensor:
    """DeepSeek checkpoints store rotary pairs interleaved (x0,y0,x1,y1,...); regroup them as
    (x0,x1,...,y0,y1,...) so the half-split rotation applies."""
    *lead, d = x.shape
    return x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


# Not cuDNN's fused attention: it builds an execution plan for every new shape, ~50 ms of host
# time each (measured on the H200), and decoding changes the key length every step while
# training changes it every micro-batch (steps of 1.4 s instead of 0.12 s).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Decode steps and verified draft trees (a few query tokens per row) on CUDA in bf16/fp16
# through draftsman's Triton kernel (kernels/attention.py), inference only: compiled steps
# otherwise expand K/V to every query head in fp32 (~2.3 ms of an 8B's 8.6 ms verify round at 64
# tokens). False: always SDPA (benchmarks' `_sdpa` arms).
DECODE_ATTENTION = True
# Most query tokens per row sent to the kernel: its tiles are sized for draft trees (up to 64
# tokens); longer prefills keep SDPA's flash kernels, which tile long query runs far better.
DECODE_ATTENTION_MAX_T = 64


def decode_kernel_applies(q: Tensor, k: Tensor, v: Tensor | None, rope: tuple[Tensor, Tensor] | None = None) -> bool:
    """Whether attention() runs draftsman's decode-attention kernel for these inputs: 1 to
    DECODE_ATTENTION_MAX_T query tokens, CUDA, bf16/fp16, Triton, inference, and shapes it serves."""
    if not (DECODE_ATTENTION and 1 <= q.shape[1] <= DECODE_ATTENTION_MAX_T and q.is_cuda
            and q.dtype in (torch.bfloat16, torch.float16) and triton_available()
            and not any(x.requires_grad for x in (q, k, v) if x is not None)):
        return False
    from draftsman.kernels.attention import fits

    return fits(q, k, v, rope)


def decode_kernel_serves(model: nn.Module) -> bool:
    """Whether attention() sends a model's cached steps of 1 to DECODE_ATTENTION_MAX_T tokens to
    the decode-attention kernel: on CUDA in bf16/fp16 with Triton, and every attention module's
    head layout (`kernel_heads()`) one the kernel serves. Such steps read only the slots below
    attention_limit, so sessions can size their masks for the whole cache
    (DecodeSession.span)."""
    params = next(model.parameters(), None)
    if not (DECODE_ATTENTION and params is not None and params.is_cuda
            and params.dtype in (torch.bfloat16, torch.float16) and triton_available()):
        return False
    from draftsman.kernels.attention import fits_heads  # (imports Triton)

    heads = [m.kernel_heads() for m in model.modules() if hasattr(m, "kernel_heads")]
    return bool(heads) and all(fits_heads(*h) for h in heads)


def attention_limit(cache: object | None, cache_index: Tensor | None) -> Tensor | None:
    """[B] int32: one past the highest cache slot each row writes in this forward, or None
    (no cache, or off CUDA, where the decode-attention kernel does not run). The models'
    contract (TargetModel.run): a token sees no slot past the highest one its row writes, as
    every mask draftsman builds (slots up to the token's own; a tree's ancestors, written before
    it), so the kernel reads only the slots below this."""
    if cache is None or cache_index is None or not cache_index.is_cuda:
        return None
    return (cache_index.amax(1) + 1).to(torch.int32)


def attention(q: Tensor, k: Tensor, v: Tensor | None, mask: Tensor, scale: float,
              rope: tuple[Tensor, Tensor] | None = None, limit: Tensor | None = None) -> Tensor:
    """q [B, T, H, D], k/v [B, S, Hkv, D*], mask [B, T, S] bool (True = may attend) -> [B, T, H, Dv].

    Grouped-query attention when Hkv < H. v None: the values are the keys (MLA's latent). rope
    (q_rope [B, T, H, Dr], k_rope [B, S, Hkv, Dr]): a second query/key part, as if concatenated
    to q and k (MLA's shared rotary key), never concatenated on the decode-kernel path. A query
    row with no visible key returns zeros instead of NaN (padding rows). limit [B] int32
    (attention_limit): no row sees a slot at or past limit[b]; the decode kernel reads only the
    slots below it (the other paths read the mask's S slots)."""
    if decode_kernel_applies(q, k, v, rope):
        from draftsman.kernels.attention import decode_attention

        return decode_attention(q, k, v, mask, scale, rope=rope, limit=limit)
    v = k if v is None else v
    if rope is not None:
        q, k = torch.cat((q, rope[0]), dim=-1), torch.cat((k, rope[1]), dim=-1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Under torch.compile the backend choice is process-wide (see graphs.compile_step).
    pick = q.is_cuda and not torch.compiler.is_compiling()
    with sdpa_kernel(SDPA_BACKENDS) if pick else nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out.transpose(1, 2)


def causal_mask(batch: int, seq: int, device: torch.device) -> Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, seq, seq)


def slot_mask(cache_index: Tensor, length: int) -> Tensor:
    """Default mask over cache slots: a token written at slot s sees slots 0..s."""
    slots = torch.arange(length, device=cache_index.device)
    return slots[None, None, :] <= cache_index[:, :, None]


def resolve_slots(
    input_ids: Tensor,
    positions: Tensor | None,
    cached: bool,
    cache_index: Tensor | None,
    attn_mask: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The forward conventions every model shares: positions default to 0..T-1 (or to the cache
    slots), cache slots to the positions, and the mask to causal (no cache) or to "every slot
    <= own slot" over the cache."""
    b, t = input_ids.shape
    arange = torch.arange(t, device=input_ids.device).expand(b, t)
    if cached and cache_index is None:
        cache_index = positions if positions is not None else arange
    if positions is None:
        positions = cache_index if cache_index is not None else arange
    if attn_mask is None:
        attn_mask = slot_mask(cache_index, int(cache_index.max()) + 1) if cached else causal_mask(b, t, input_ids.device)
    return positions, cache_index, attn_mask
