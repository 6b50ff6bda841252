"""Routed experts grouped by expert, without a host sync (CUDA-graph friendly), for any number
of experts.

The (token, slot) assignments are sorted by expert on the device; one kernel computes
silu(x Gᵉᵀ) * (x Uᵉᵀ) and a second (h Dᵉᵀ) for blocks of BLOCK_T assignments of one expert at a
time, so every chosen expert's weights are read once per block of its tokens and unchosen
experts not at all (a decode step reads only the k experts it routes to). The grid covers the
worst case (all assignments on one expert); programs past an expert's count exit at once. Each
expert's output is accumulated in fp32 and rounded once, after mixing.

With few assignments (decode: k per token) the block-of-tokens tiles would be mostly padding and
each expert's weights feed a single row: there, one program per (assignment, BLOCK_N output
rows) reads its rows of the chosen expert as a GEMV does (elementwise products, one reduction
at the end), spreading each expert's read over many SMs. DeepSeek's shared experts (a SwiGLU
a whole number of experts wide) ride along as more assignments per token, so a decode step's
MoE is two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from draftsman.kernels.gemv import _load


@triton.jit
def _expert_rows(start_ptr, count_ptr, e, tb, BLOCK_T: tl.constexpr):
    """Block `tb` of expert `e`'s assignment rows (expert-sorted order): (rows, which are real,
    whether the block holds any)."""
    count = tl.load(count_ptr + e)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    return tl.load(start_ptr + e) + t, t < count, tb * BLOCK_T < count


@triton.jit
def _gate_up_kernel(x_ptr, tok_ptr, start_ptr, count_ptr, g_ptr, u_ptr, h_ptr,
                    stride_xn, stride_ge, stride_gi, stride_hp,
                    HIDDEN: tl.constexpr, INNER: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)  # e * stride can pass 2**31 elements (large MoEs)
    rows, t_ok, live = _expert_rows(start_ptr, count_ptr, e, tl.program_id(2), BLOCK_T)
    if live:
        toks = tl.load(tok_ptr + rows, mask=t_ok, other=0)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = i < INNER
        acc_g = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_T, BLOCK_I), dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < HIDDEN
            xt = tl.load(x_ptr + toks[:, None] * stride_xn + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w_off = e * stride_ge + i[None, :] * stride_gi + k[:, None]  # [BLOCK_K, BLOCK_I]: Wᵀ tile
            w_ok = k_ok[:, None] & i_ok[None, :]
            acc_g = tl.dot(xt, tl.load(g_ptr + w_off, mask=w_ok, other=0.0), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, tl.load(u_ptr + w_off, mask=w_ok, other=0.0), acc_u, input_precision=PRECISION)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + rows[:, None] * stride_hp + i[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & i_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, start_ptr, count_ptr, d_ptr, y_ptr,
                 stride_hp, stride_de, stride_dh, stride_yp,
                 HIDDEN: tl.constexpr, INNER: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)  # e * stride can pass 2**31 elements (large MoEs)
    rows, t_ok, live = _expert_rows(start_ptr, count_ptr, e, tl.program_id(2), BLOCK_T)
    if live:
        o = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        o_ok = o < HIDDEN
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for k0 in range(0, INNER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INNER
            ht = tl.load(h_ptr + rows[:, None] * stride_hp + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(d_ptr + e * stride_de + o[None, :] * stride_dh + k[:, None],
                        mask=k_ok[:, None] & o_ok[None, :], other=0.0)
            acc = tl.dot(ht, w, acc, input_precision=PRECISION)
        tl.store(y_ptr + rows[:, None] * stride_yp + o[None, :], acc, mask=t_ok[:, None] & o_ok[None, :])


@triton.jit
def _gate_up_gemv_kernel(x_ptr, ids_ptr, g_ptr, u_ptr, sgu_ptr, h_ptr, P, stride_xn, stride_ge, stride_hp,
                         SLOTS: tl.constexpr, PARTS: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr,
                         BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    a = tl.program_id(0)
    if a < P:  # assignment a: token a // SLOTS, its (a % SLOTS)-th routed expert
        e = tl.load(ids_ptr + a).to(tl.int64)
        g_base = g_ptr + e * stride_ge
        u_base = u_ptr + e * stride_ge
        tok = a // SLOTS
    else:  # a shared-expert part: INNER rows of the shared gate (and of its up, PARTS * INNER further)
        j = a - P
        part = (j % PARTS).to(tl.int64)
        g_base = sgu_ptr + part * INNER * HIDDEN
        u_base = sgu_ptr + (PARTS + part) * INNER * HIDDEN
        tok = j // PARTS
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < INNER
    acc_g = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < HIDDEN
        xv = _load(x_ptr + tok * stride_xn + k, k_ok, EVEN).to(tl.float32)[None, :]
        off = i[:, None] * HIDDEN + k[None, :]
        ok = i_ok[:, None] & k_ok[None, :]
        acc_g += _load(g_base + off, ok, EVEN).to(tl.float32) * xv
        acc_u += _load(u_base + off, ok, EVEN).to(tl.float32) * xv
    g = tl.sum(acc_g, axis=1)
    h = g * tl.sigmoid(g) * tl.sum(acc_u, axis=1)
    tl.store(h_ptr + a * stride_hp + i, h.to(h_ptr.dtype.element_ty), mask=i_ok)


@triton.jit
def _down_gemv_kernel(h_ptr, ids_ptr, d_ptr, sd_ptr, y_ptr, P, stride_hp, stride_de, stride_yp,
                      PARTS: tl.constexpr, HIDDEN: tl.constexpr, INNER: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    a = tl.program_id(0)
    if a < P:
        e = tl.load(ids_ptr + a).to(tl.int64)
        d_base = d_ptr + e * stride_de
        row = INNER
    else:  # the shared down weight [HIDDEN, PARTS * INNER]: this part's INNER columns
        d_base = sd_ptr + ((a - P) % PARTS).to(tl.int64) * INNER
        row = PARTS * INNER
    o = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    o_ok = o < HIDDEN
    acc = tl.zeros((BLOCK_H, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, INNER, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < INNER
        hv = _load(h_ptr + a * stride_hp + k, k_ok, EVEN).to(tl.float32)[None, :]
        w = _load(d_base + o[:, None] * row + k[None, :], o_ok[:, None] & k_ok[None, :], EVEN)
        acc += w.to(tl.float32) * hv
    tl.store(y_ptr + a * stride_yp + o, tl.sum(acc, axis=1), mask=o_ok)


# Assignments (tokens x k) up to which the GEMV-style kernels run (decode, small verifies).
GEMV_ASSIGNMENTS = 16


def _divisor_block(n: int, cap: int) -> int:
    """The largest power-of-two block <= cap dividing n (unmasked, vectorized loads), else cap."""
    b = cap
    while b >= 64 and n % b:
        b //= 2
    return b if n % b == 0 else cap


def moe_experts_gemv(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                     shared: tuple[Tensor, Tensor] | None = None, block_n: int = 4, block_k: int = 1024) -> Tensor:
    """moe_experts for few assignments: each (token, expert) pair as two GEMVs over the chosen
    expert's rows; same fp32 accumulation, rounding and mixing as moe_experts.

    shared (gate_up [2 * S, H] = [gate | up] rows, down [H, S]; S a multiple of the experts'
    inner size): DeepSeek's shared experts in the same two launches, as S / inner more
    assignments per token, and the result is routed + shared, each rounded to x's dtype first
    (as MoE.forward adds them).

    Tiles: (4, 1024) took 50.0 us against 52.7 us for (8, 512) on the H200 at Moonlight's
    shapes with the shared experts (benchmarks/h200_moonlight_gemv.py); block_k is capped at
    the hidden size's power of two (the reference pair's 256: no lanes masked off)."""
    n, hidden = x.shape
    block_k = min(block_k, triton.next_power_of_2(hidden))
    k = ids.shape[1]
    inner = gate.shape[1]
    x, gate, up, down = x.contiguous(), gate.contiguous(), up.contiguous(), down.contiguous()
    parts = 0
    sgu, sd = gate, down  # placeholders the kernels never read
    if shared is not None:
        sgu, sd = shared[0].contiguous(), shared[1].contiguous()
        parts = sd.shape[1] // inner
        if parts * inner != sd.shape[1] or sgu.shape != (2 * parts * inner, hidden) or sd.shape[0] != hidden:
            raise ValueError(f"moe_experts_gemv: shared gate_up {tuple(sgu.shape)} / down {tuple(sd.shape)} are not "
                             f"whole multiples of the experts' inner size {inner} at hidden {hidden}")
    flat = ids.flatten().contiguous()
    p = flat.numel()
    rows = p + n * parts
    block_k_down = _divisor_block(inner, block_k)
    h = torch.empty(rows, inner, dtype=x.dtype, device=x.device)
    _gate_up_gemv_kernel[(rows, triton.cdiv(inner, block_n))](
        x, flat, gate, up, sgu, h, p, x.stride(0), gate.stride(0), h.stride(0),
        SLOTS=k, PARTS=max(parts, 1), HIDDEN=hidden, INNER=inner, BLOCK_I=block_n, BLOCK_K=block_k,
        EVEN=hidden % block_k == 0 and inner % block_n == 0)
    y = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    _down_gemv_kernel[(rows, triton.cdiv(hidden, block_n))](
        h, flat, down, sd, y, p, h.stride(0), down.stride(0), y.stride(0),
        PARTS=max(parts, 1), HIDDEN=hidden, INNER=inner, BLOCK_H=block_n, BLOCK_K=block_k_down,
        EVEN=inner % block_k_down == 0 and hidden % block_n == 0)
    out = (y[:p].view(n, k, hidden) * weights[..., None].float()).sum(1).to(x.dtype)
    if parts:
        out = out + y[p:].view(n, parts, hidden).sum(1).to(x.dtype)
    return out


def moe_experts(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                block_t: int = 16, block_n: int = 64, block_k: int = 64) -> Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x): x [N, H], weights/ids [N, k], gate/up
    [E, I, H], down [E, H, I] (nn.Linear orientation) -> [N, H] in x's dtype."""
    if ids.numel() <= GEMV_ASSIGNMENTS:
        return moe_experts_gemv(x, weights, ids, gate, up, down)
    n, hidden = x.shape
    k = ids.shape[1]
    e, inner = gate.shape[0], gate.shape[1]
    x, gate, up, down = x.contiguous(), gate.contiguous(), up.contiguous(), down.contiguous()
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # assignment rows grouped by expert
    tokens = (order // k).contiguous()
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = counts.cumsum(0) - counts
    p = flat.numel()
    h = torch.empty(p, inner, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(p, block_t)
    # fp32 models get fp32 products (tl.dot would round fp32 inputs to TF32 on tensor cores)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gate_up_kernel[(e, triton.cdiv(inner, block_n), blocks)](
        x, tokens, starts, counts, gate, up, h, x.stride(0), gate.stride(0), gate.stride(1), h.stride(0),
        HIDDEN=hidden, INNER=inner, BLOCK_T=block_t, BLOCK_I=block_n, BLOCK_K=block_k, PRECISION=precision)
    y = torch.empty(p, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(e, triton.cdiv(hidden, block_n), blocks)](
        h, starts, counts, down, y, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        HIDDEN=hidden, INNER=inner, BLOCK_T=block_t, BLOCK_H=block_n, BLOCK_K=block_k, PRECISION=precision)
    mixed = torch.empty_like(y).index_copy_(0, order, y).view(n, k, hidden)  # back to (token, slot) order
    return (mixed * weights[..., None].float()).sum(1).to(x.dtype)
