"""DeepSeek-V3 expert selection in one kernel per MoE layer, for decode.

PyTorch's route (sigmoid, bias, group ranking, top-k, gather, normalise) is a chain of small
kernels whose top-k alone (a radix select and a sort) took ~9 us per layer on the H200 at 64
experts, about 0.23 ms of a Moonlight decode step. Here one program per token holds all of its
expert scores in registers and picks the top k by repeated maxima, with the same arithmetic as
deepseek.Router: fp32 sigmoid affinities; the bias only steers the choice; group-limited
routing ranks groups by the sum of their two best biased scores; mixing weights are the chosen
unbiased affinities, normalised and scaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, scaling,
                  E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    ok = e < E
    logits = tl.load(logits_ptr + row * stride_l + e, mask=ok, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    choice = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    if N_GROUP > 1:  # E == E_PAD here: groups are rows of a [N_GROUP, E / N_GROUP] view
        grouped = tl.reshape(choice, (N_GROUP, E_PAD // N_GROUP))
        col = tl.arange(0, E_PAD // N_GROUP)[None, :]
        best = tl.max(grouped, axis=1)
        first = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(col == first[:, None], float("-inf"), grouped), axis=1)
        group_score = best + second
        gid = tl.arange(0, N_GROUP)
        keep = tl.zeros((N_GROUP,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, axis=0)
            keep = keep | (gid == pick)
            group_score = tl.where(gid == pick, float("-inf"), group_score)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E_PAD,))
    slot = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, axis=0)
        weights = tl.where(slot == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), weights)
        ids = tl.where(slot == j, pick.to(tl.int64), ids)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + row * K + slot, weights * scaling, mask=slot < K)
    tl.store(ids_ptr + row * K + slot, ids, mask=slot < K)


def routable(n_experts: int, k: int, n_group: int) -> bool:
    """What the kernel serves: any k up to the expert count; groups only when a power-of-two
    count of them splits a power-of-two expert count."""
    if k > n_experts:
        return False
    if n_group > 1:
        return n_experts & (n_experts - 1) == 0 and n_experts % n_group == 0 and n_group & (n_group - 1) == 0
    return True


def route(logits: Tensor, bias: Tensor, k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits [N, E] (the router's fp32 x Wᵀ), bias [E] fp32 -> (weights [N, k] fp32, ids [N, k]
    int64), as deepseek.Router.forward after its matmul (the chosen experts in descending
    biased score)."""
    n, e = logits.shape
    if not routable(e, k, n_group) or bias.shape != (e,):
        raise ValueError(f"route: logits {tuple(logits.shape)}, bias {tuple(bias.shape)}, k={k}, n_group={n_group} "
                         "not served")
    logits = logits.contiguous()
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(n,)](logits, bias.float().contiguous(), weights, ids, logits.stride(0), float(scaling), E=e,
                        E_PAD=triton.next_power_of_2(e), K=k, K_PAD=triton.next_power_of_2(k), N_GROUP=n_group, TOPK_GROUP=topk_group,
                        NORM=norm_topk_prob, num_warps=1 if e <= 128 else 4)
    return weights, ids
