"""Skinny matmul (GEMV) for decode: y = x Wᵀ with a handful of rows in x.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading W once;
cuBLAS picks GEMM tilings that leave part of the bandwidth unused for some of these shapes. Here
each program reads BLOCK_N whole rows of W in BLOCK_K chunks (contiguous, vectorized loads),
keeps a [ROWS, BLOCK_N, BLOCK_K] fp32 partial product and reduces it once at the end; programs
split K (SPLIT_K > 1) when N alone gives too few programs to keep every SM's loads in flight,
adding their fp32 partials atomically.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym,
                 K: tl.constexpr, K_LEN: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    n_ok = n < N
    m_ok = m < M
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_LEN, BLOCK_K):  # this split's share of K
        k = pid_k * K_LEN + k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :]
        x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
        if EVEN:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_ok = k < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(y_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: Tensor, w: Tensor, block_n: int = 8, block_k: int = 512, split_k: int = 1, num_warps: int = 4,
         num_stages: int = 3) -> Tensor:
    """x [M, K] @ w[N, K]ᵀ -> [M, N] in x's dtype, for small M (rows padded to a power of two
    inside the kernel). w must be contiguous along K."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"gemv: w {tuple(w.shape)} (strides {w.stride()}) does not fit x {tuple(x.shape)}")
    x = x.contiguous()
    rows = triton.next_power_of_2(m)
    even = k % (block_k * split_k) == 0 and n % block_n == 0 and rows == m
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    _gemv_kernel[grid](x, w, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k, K_LEN=triton.cdiv(k, split_k * block_k) * block_k, ROWS=rows, BLOCK_N=block_n,
                       BLOCK_K=block_k, SPLIT_K=split_k, EVEN=even, num_warps=num_warps, num_stages=num_stages)
    return y if split_k == 1 else y.to(x.dtype)
