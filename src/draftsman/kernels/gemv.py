"""Skinny matmul (GEMV) for decode: y = x Wᵀ with a handful of rows in x.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading W once;
cuBLAS picks GEMM tilings that leave part of the bandwidth unused for some of these shapes. Here
each program reads BLOCK_N whole rows of W in BLOCK_K chunks (contiguous, vectorized loads),
keeps a [ROWS, BLOCK_N, BLOCK_K] fp32 partial product and reduces it once at the end; programs
split K (SPLIT_K > 1) when N alone gives too few programs to keep every SM's loads in flight,
adding their fp32 partials atomically.

Optional fusions cut the kernels a decode step runs per layer: an RMSNorm or SwiGLU prologue computes the
input row from x on the fly (each intermediate rounded to x's dtype where PyTorch rounds it), and
a residual epilogue adds `residual` to the rounded product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    """Unmasked when every block is full: masks cost the loads their vectorization."""
    return tl.load(ptrs) if EVEN else tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, r_ptr, ssi_ptr, sso_ptr, M, N, stride_xm, stride_wn, stride_ym,
                 stride_rm, stride_ssi, stride_sso, eps,
                 K: tl.constexpr, K_LEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                 GLU: tl.constexpr, SS_PARTS: tl.constexpr, SS_PAD: tl.constexpr, SS_OUT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    n_ok = n < N
    m_ok = m < M
    dt = x_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None] * stride_xm
    if NORM:  # RMSNorm needs each row's sum of squares over all of K, not this split's share
        if SS_PARTS > 0:  # ... summed from the partials the kernel that wrote x left (SS_OUT)
            p = tl.arange(0, SS_PAD)
            parts = tl.load(ssi_ptr + m[:, None] * stride_ssi + p[None, :], mask=m_ok[:, None] & (p < SS_PARTS)[None, :],
                            other=0.0)
            rstd = tl.rsqrt(tl.sum(parts, axis=1) / K + eps)  # [ROWS]
        else:
            sq = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
            for j0 in range(0, K, BLOCK_K):
                j = j0 + tl.arange(0, BLOCK_K)
                xj = _load(x_rows + j[None, :], m_ok[:, None] & (j < K)[None, :], EVEN).to(tl.float32)
                sq += xj * xj
            rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)  # [ROWS]
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if GLU:  # the up rows, N further down W, for the epilogue's F.silu(gate) * up
        acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_LEN, BLOCK_K):  # this split's share of K
        k = pid_k * K_LEN + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
        w = _load(w_ptrs, n_ok[:, None] & k_ok[None, :], EVEN)
        x_ptrs = x_rows + k[None, :]
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = _load(x_ptrs, x_ok, EVEN)
        if NORM:  # as layers.RMSNorm: normalised in fp32 and rounded, then times the weight, rounded
            x = (x.to(tl.float32) * rstd[:, None]).to(dt)
            x = (x.to(tl.float32) * _load(nw_ptr + k, k_ok, EVEN).to(tl.float32)[None, :]).to(dt)
        if SWIGLU:  # x holds the gate, up is K further along the row: F.silu(gate) * up, each rounded
            gate = x.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dt)
            x = (silu.to(tl.float32) * _load(x_ptrs + K, x_ok, EVEN).to(tl.float32)).to(dt)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if GLU:
            w_up = _load(w_ptrs + N * stride_wn, n_ok[:, None] & k_ok[None, :], EVEN)
            acc_up += x.to(tl.float32)[:, None, :] * w_up.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
    y_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        dt_out = y_ptr.dtype.element_ty
        y = y.to(dt_out)
        if GLU:  # as F.silu(gate) * up over the rounded products: silu rounded, then the product
            up = tl.sum(acc_up, axis=2).to(dt_out).to(tl.float32)
            gate = y.to(tl.float32)
            y = ((gate / (1.0 + tl.exp(-gate))).to(dt_out).to(tl.float32) * up).to(dt_out)
        if RESIDUAL:  # residual + out as PyTorch adds them: the product rounded, then the sum
            r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=y_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dt_out)
        tl.store(y_ptrs, y, mask=y_ok)
        if SS_OUT:  # this block's share of each output row's sum of squares, for the next norm
            yf = tl.where(y_ok, y.to(tl.float32), 0.0)
            tl.store(sso_ptr + m * stride_sso + pid_n, tl.sum(yf * yf, axis=1), mask=m_ok)
    else:
        tl.atomic_add(y_ptrs, y, mask=y_ok)


def gemv(x: Tensor, w: Tensor, block_n: int = 8, block_k: int = 1024, split_k: int = 1, num_warps: int = 4,
         num_stages: int | None = None, norm_weight: Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
         residual: Tensor | None = None, glu: bool = False, norm_sum_squares: Tensor | None = None,
         sum_squares_out: Tensor | None = None) -> Tensor:
    """x [M, K] @ w[N, K]ᵀ -> [M, N] in x's dtype, for small M (rows padded to a power of two
    inside the kernel). w must be contiguous along K. Fusions, with PyTorch's roundings:
    norm_weight [K]: RMSNorm(x) @ wᵀ, as layers.RMSNorm with this weight and eps;
    norm_sum_squares [M, P] fp32: with norm_weight, x's sums of squares in P partials (another
    gemv's sum_squares_out), instead of a pass over x in every program;
    swiglu: x is [M, 2K] = [gate | up] and the product is (F.silu(gate) * up) @ wᵀ;
    glu: w is [2N', K] = [gate | up] rows and the output [M, N'] is F.silu(x @ gateᵀ) * (x @ upᵀ);
    residual [M, N]: residual + x @ wᵀ (split_k 1 only: split partials are summed atomically);
    sum_squares_out [M, sum_squares_parts(N, block_n)] fp32: filled with each output row's sum of
    squares, one partial per block of block_n outputs (for the next RMSNorm)."""
    if norm_weight is not None and swiglu:
        raise ValueError("gemv: norm_weight and swiglu cannot be fused together")
    if split_k != 1 and (residual is not None or glu or sum_squares_out is not None):
        raise ValueError("gemv: residual, glu and sum_squares_out need split_k=1 (split partials are added "
                         "atomically)")
    if norm_sum_squares is not None and norm_weight is None:
        raise ValueError("gemv: norm_sum_squares is for the norm prologue: give norm_weight too")
    m = x.shape[0]
    n, k = w.shape
    if glu:
        if n % 2:
            raise ValueError(f"gemv: glu needs w of [gate | up] rows, got {n} rows")
        n //= 2
    if x.shape[1] != (2 * k if swiglu else k) or w.stride(1) != 1:
        raise ValueError(f"gemv: w {tuple(w.shape)} (strides {w.stride()}) does not fit x {tuple(x.shape)}"
                         f"{' (swiglu)' if swiglu else ''}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"gemv: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not fit x "
                         f"{tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != x.dtype):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} {residual.dtype} does not fit the output "
                         f"{(m, n)} {x.dtype}")
    parts_out = sum_squares_parts(n, block_n)
    for name, t, cols in (("norm_sum_squares", norm_sum_squares, None), ("sum_squares_out", sum_squares_out, parts_out)):
        if t is not None and (t.dim() != 2 or t.shape[0] != m or t.dtype != torch.float32 or t.stride(1) != 1
                              or (cols is not None and t.shape[1] != cols)):
            raise ValueError(f"gemv: {name} {tuple(t.shape)} {t.dtype} does not fit {m} rows"
                             f"{'' if cols is None else f' x {cols} partials'} (fp32, contiguous rows)")
    if num_stages is None:  # the fastest on the H200 for the 8B's shapes (benchmarks/h200_gemv.py)
        num_stages = 2 if k <= 4096 else 4
    x = x.contiguous()
    nw = x if norm_weight is None else norm_weight.contiguous()  # x: a placeholder the kernel never reads
    r = x if residual is None else residual.contiguous()
    rows = triton.next_power_of_2(m)
    even = k % (block_k * split_k) == 0 and n % block_n == 0 and rows == m
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    ssi = norm_sum_squares if norm_sum_squares is not None else y  # placeholders the kernel never reads ...
    sso = sum_squares_out if sum_squares_out is not None else y  # ... or writes
    parts_in = 0 if norm_sum_squares is None else norm_sum_squares.shape[1]
    grid = (parts_out, split_k)
    _gemv_kernel[grid](x, w, y, nw, r, ssi, sso, m, n, x.stride(0), w.stride(0), y.stride(0), r.stride(0),
                       ssi.stride(0), sso.stride(0), eps, K=k,
                       K_LEN=triton.cdiv(k, split_k * block_k) * block_k, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
                       SPLIT_K=split_k, EVEN=even, NORM=norm_weight is not None, SWIGLU=swiglu,
                       RESIDUAL=residual is not None, GLU=glu, SS_PARTS=parts_in,
                       SS_PAD=triton.next_power_of_2(max(parts_in, 1)), SS_OUT=sum_squares_out is not None,
                       num_warps=num_warps, num_stages=num_stages)
    return y if split_k == 1 else y.to(x.dtype)


def sum_squares_parts(n: int, block_n: int) -> int:
    """Partials of a row's sum of squares that a gemv with N = n outputs writes (one per block)."""
    return triton.cdiv(n, block_n)


def fused_tiles(n: int, k: int) -> dict:
    """Tile overrides for a GEMV with a norm or SwiGLU prologue (recomputed by every program).
    Where N leaves programs to spare (<= 8192 outputs), 16-row blocks halve that repeated work
    per weight byte; measured on the H200 (benchmarks/h200_gemv.py, fused sweep) at 8B shapes:
    q/k/v 17.2 -> 16.2 us, down 33.5 -> 32.1 us; gate/up (28672 outputs) keeps the defaults."""
    if n > 8192:
        return {}
    return {"block_n": 16, "block_k": 512 if k <= 4096 else 1024, "num_stages": 4}


@triton.jit
def _head_gemv_kernel(x_ptr, w_ptr, y_ptr, M, stride_xm, stride_xh, stride_wh, stride_wn, stride_wk, stride_ym,
                      stride_yh, N: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + h * stride_xh + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    tl.store(y_ptr + m[:, None] * stride_ym + h * stride_yh + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def head_gemv(x: Tensor, w: Tensor, transposed: bool = False) -> Tensor:
    """Per-head products for a few rows: x [M, H, K] -> y [M, H, N] in x's dtype with
    y[m, h] = w[h] @ x[m, h] for w [H, N, K], or x[m, h] @ w[h] for w [H, K, N] (transposed),
    w any strided view (MLA's absorbed kv_b halves). A batched GEMM with one row per head
    leaves cuBLAS on small GEMV kernels (~4 us per call for 2 MB on the H200); here every
    head's weight streams through its own programs, contiguous along w's last dim."""
    m, heads, k = x.shape
    # A whole K per program where it fits (one round of loads in flight, no loop): these
    # products are small (2 MB at Moonlight's shapes), so latency, not bandwidth, bounds them;
    # measured there, 4-row x 128-wide loop tiles ran 3.9 us a call (cuBLAS: 4.1).
    if transposed:
        n = w.shape[2]
        stride_wn, stride_wk = w.stride(2), w.stride(1)
        block_n, block_k = 32, min(128, triton.next_power_of_2(k))  # tiles along w's contiguous N
    else:
        n = w.shape[1]
        stride_wn, stride_wk = w.stride(1), w.stride(2)
        block_n, block_k = 8, min(512, triton.next_power_of_2(k))
    if w.shape[0] != heads or (w.shape[1] if transposed else w.shape[2]) != k:
        raise ValueError(f"head_gemv: w {tuple(w.shape)} does not fit x {tuple(x.shape)}"
                         f"{' (transposed)' if transposed else ''}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(m, heads, n, dtype=x.dtype, device=x.device)
    _head_gemv_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, y, m, x.stride(0), x.stride(1), w.stride(0), stride_wn, stride_wk, y.stride(0), y.stride(1), N=n, K=k,
        ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y
