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
def _gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, r_ptr, M, N, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                 K: tl.constexpr, K_LEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    n_ok = n < N
    m_ok = m < M
    dt = x_ptr.dtype.element_ty
    x_rows = x_ptr + m[:, None] * stride_xm
    if NORM:  # RMSNorm needs each row's sum of squares over all of K, not this split's share
        sq = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        for j0 in range(0, K, BLOCK_K):
            j = j0 + tl.arange(0, BLOCK_K)
            xj = _load(x_rows + j[None, :], m_ok[:, None] & (j < K)[None, :], EVEN).to(tl.float32)
            sq += xj * xj
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)  # [ROWS]
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_LEN, BLOCK_K):  # this split's share of K
        k = pid_k * K_LEN + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = _load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], n_ok[:, None] & k_ok[None, :], EVEN)
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
    y = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
    y_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        y = y.to(y_ptr.dtype.element_ty)
        if RESIDUAL:  # residual + out as PyTorch adds them: the product rounded, then the sum
            r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=y_ok, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptrs, y, mask=y_ok)
    else:
        tl.atomic_add(y_ptrs, y, mask=y_ok)


def gemv(x: Tensor, w: Tensor, block_n: int = 8, block_k: int = 1024, split_k: int = 1, num_warps: int = 4,
         num_stages: int | None = None, norm_weight: Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
         residual: Tensor | None = None) -> Tensor:
    """x [M, K] @ w[N, K]ᵀ -> [M, N] in x's dtype, for small M (rows padded to a power of two
    inside the kernel). w must be contiguous along K. Fusions, with PyTorch's roundings:
    norm_weight [K]: RMSNorm(x) @ wᵀ, as layers.RMSNorm with this weight and eps;
    swiglu: x is [M, 2K] = [gate | up] and the product is (F.silu(gate) * up) @ wᵀ;
    residual [M, N]: residual + x @ wᵀ (split_k 1 only: split partials are summed atomically)."""
    if norm_weight is not None and swiglu:
        raise ValueError("gemv: norm_weight and swiglu cannot be fused together")
    if residual is not None and split_k != 1:
        raise ValueError("gemv: residual needs split_k=1 (split partials are added atomically)")
    m = x.shape[0]
    n, k = w.shape
    if x.shape[1] != (2 * k if swiglu else k) or w.stride(1) != 1:
        raise ValueError(f"gemv: w {tuple(w.shape)} (strides {w.stride()}) does not fit x {tuple(x.shape)}"
                         f"{' (swiglu)' if swiglu else ''}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"gemv: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not fit x "
                         f"{tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != x.dtype):
        raise ValueError(f"gemv: residual {tuple(residual.shape)} {residual.dtype} does not fit the output "
                         f"{(m, n)} {x.dtype}")
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
    grid = (triton.cdiv(n, block_n), split_k)
    _gemv_kernel[grid](x, w, y, nw, r, m, n, x.stride(0), w.stride(0), y.stride(0), r.stride(0), eps, K=k,
                       K_LEN=triton.cdiv(k, split_k * block_k) * block_k, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
                       SPLIT_K=split_k, EVEN=even, NORM=norm_weight is not None, SWIGLU=swiglu,
                       RESIDUAL=residual is not None, num_warps=num_warps, num_stages=num_stages)
    return y if split_k == 1 else y.to(x.dtype)


def fused_tiles(n: int, k: int) -> dict:
    """Tile overrides for a GEMV with a norm or SwiGLU prologue (recomputed by every program).
    Where N leaves programs to spare (<= 8192 outputs), 16-row blocks halve that repeated work
    per weight byte; measured on the H200 (benchmarks/h200_gemv.py, fused sweep) at 8B shapes:
    q/k/v 17.2 -> 16.2 us, down 33.5 -> 32.1 us; gate/up (28672 outputs) keeps the defaults."""
    if n > 8192:
        return {}
    return {"block_n": 16, "block_k": 512 if k <= 4096 else 1024, "num_stages": 4}
