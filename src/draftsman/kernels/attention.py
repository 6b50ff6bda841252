"""Decode attention: a few query tokens per row over the KV cache, grouped-query heads.

Under torch.compile, SDPA with a mask and grouped heads lowers to expanding K and V to every
query head in fp32 and two fp32 GEMMs per layer: about 16 us per layer on the H200 for one
token at a few hundred slots (half a millisecond per 8B step), and ~2.3 ms of an 8.6 ms round
when verifying a 64-token draft tree. Here each program reads its share of one KV head's slots
once for all the query rows that share it (flash-decoding: slots split across programs, each
keeping an online softmax), and a small combine kernel weighs the splits by their maxima and
normalizers (with one split the kernel writes the output itself: no partials, no second launch;
a PyTorch combine was ~10 small kernels per layer in eager CUDA graphs). The tile's rows are
(token, query head of the group) pairs: one token's G heads in a decode step, a block of tokens
of a verified tree otherwise (programs over row, KV head, block of tokens and split of slots),
each row masked by its own token's mask row.

Multi-head latent attention (DeepSeek) attends in the absorbed form with one KV head that is
[latent | rope] wide (576: not a power of two) and whose values are the latent itself: the
kernel takes the rope part as a second query/key pair (q_rope, k_rope) whose scores add to the
first, and reads V from the K tile when V is K (no second load, no concatenated cache copy).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

SM_TARGET = 128  # programs to aim for (about one per SM on an H100/H200)


@triton.jit
def _attend_block(s0, end, q, qr, m_i, l_i, acc, k_ptr, v_ptr, kr_ptr, m_row, m_row0, row_ok, scale, b, hk, d, dv,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ms,
                  stride_krb, stride_krs, stride_krh, BLOCK_T: tl.constexpr, DR: tl.constexpr,
                  V_IS_K: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr):
    """One block of slots [s0, s0 + BLOCK_S) (those below `end`) into the online softmax
    (m_i, l_i, acc) of the tile's rows: the updated triple."""
    s = s0 + tl.arange(0, BLOCK_S)
    s_ok = s < end
    k = tl.load(k_ptr + b * stride_kb + s[:, None] * stride_ks + hk * stride_kh + d[None, :],
                mask=s_ok[:, None], other=0.0)
    # [BLOCK_M, BLOCK_S] fp32 (cast: an fp64 scale, as Inductor's launches passed, widens the loop state)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if DR > 0:
        dr = tl.arange(0, DR)
        kr = tl.load(kr_ptr + b * stride_krb + s[:, None] * stride_krs + hk * stride_krh + dr[None, :],
                     mask=s_ok[:, None], other=0.0)
        qk = tl.dot(qr, tl.trans(kr), qk, input_precision=PRECISION)
    scores = (qk * scale).to(tl.float32)
    if BLOCK_T == 1:  # decode: one mask row for the whole tile (padding rows are dropped later)
        visible = (tl.load(m_row0 + s * stride_ms, mask=s_ok, other=0) != 0)[None, :]
    else:
        visible = tl.load(m_row + s[None, :] * stride_ms, mask=row_ok[:, None] & s_ok[None, :], other=0) != 0
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    if V_IS_K:
        v = k
    else:
        v = tl.load(v_ptr + b * stride_vb + s[:, None] * stride_vs + hk * stride_vh + dv[None, :],
                    mask=s_ok[:, None], other=0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, acc_ptr, stat_ptr, out_ptr, qr_ptr, kr_ptr, lim_ptr, T, TB, S,
                             scale,
                             stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, stride_mb, stride_mt, stride_ms,
                             stride_qrb, stride_qrt, stride_qrh, stride_krb, stride_krs, stride_krh,
                             HKV: tl.constexpr, SPLITS: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                             V_IS_K: tl.constexpr, BLOCK_S: tl.constexpr, S_ITERS: tl.constexpr,
                             HAS_LIMIT: tl.constexpr, DYNAMIC: tl.constexpr, DIRECT: tl.constexpr,
                             PRECISION: tl.constexpr):
    pid = tl.program_id(0)  # (batch row, kv head, block of tokens)
    split = tl.program_id(1)
    b = pid // (HKV * TB)
    hk = (pid // TB) % HKV
    r = tl.arange(0, BLOCK_M)  # tile row = (token in the block, query head in the group)
    t = (pid % TB) * BLOCK_T + r // G
    head = hk * G + r % G
    row_ok = (r < BLOCK_T * G) & (t < T)  # padding rows: nothing visible, zeros
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    qr = q  # (unused without a rope part)
    if DR > 0:  # the rope part's queries (MLA)
        dr = tl.arange(0, DR)
        qr = tl.load(qr_ptr + b * stride_qrb + t[:, None] * stride_qrt + head[:, None] * stride_qrh + dr[None, :],
                     mask=row_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    m_row = m_ptr + b * stride_mb + t[:, None] * stride_mt  # each row's own token's mask row
    m_row0 = m_ptr + b * stride_mb + (pid % TB) * stride_mt
    # This split's share of the slots the row attends within: [0, limit) when given, else [0, S)
    lim = S
    if HAS_LIMIT:
        lim = tl.minimum(tl.load(lim_ptr + b), S)
    share = ((lim + BLOCK_S - 1) // BLOCK_S + SPLITS - 1) // SPLITS * BLOCK_S
    start = split * share
    end = tl.minimum(start + share, lim)
    if DYNAMIC:
        for s0 in range(start, end, BLOCK_S):
            m_i, l_i, acc = _attend_block(s0, end, q, qr, m_i, l_i, acc, k_ptr, v_ptr, kr_ptr, m_row, m_row0, row_ok,
                                          scale, b, hk, d, dv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                          stride_vh, stride_ms, stride_krb, stride_krs, stride_krh, BLOCK_T, DR,
                                          V_IS_K, BLOCK_S, PRECISION)
    else:  # Triton's interpreter cannot run a loop whose bounds are tensors: S_ITERS blocks, those past `end` skipped
        for i in range(0, S_ITERS):
            if start + i * BLOCK_S < end:
                m_i, l_i, acc = _attend_block(start + i * BLOCK_S, end, q, qr, m_i, l_i, acc, k_ptr, v_ptr, kr_ptr,
                                              m_row, m_row0, row_ok, scale, b, hk, d, dv, stride_kb, stride_ks,
                                              stride_kh, stride_vb, stride_vs, stride_vh, stride_ms, stride_krb,
                                              stride_krs, stride_krh, BLOCK_T, DR, V_IS_K, BLOCK_S, PRECISION)
    if DIRECT:  # one split: the output itself, [B, T, H, DV] in its dtype (zeros where nothing was visible)
        o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        out_row = (b * T + t) * (HKV * G) + head
        tl.store(out_ptr + out_row[:, None] * DV + dv[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # partials of this split: acc [B, HKV, TB, SPLITS, BLOCK_M, DV], (max, normalizer) [..., BLOCK_M, 2]
        row = (pid * SPLITS + split) * BLOCK_M + r
        tl.store(acc_ptr + row[:, None] * DV + dv[None, :], acc)
        tl.store(stat_ptr + row * 2, m_i)
        tl.store(stat_ptr + row * 2 + 1, l_i)


def fits(q: Tensor, k: Tensor, v: Tensor | None, rope: tuple[Tensor, Tensor] | None = None) -> bool:
    """Shapes the kernel serves: at least one query token (any number: the callers bound it), head
    dims (and the rope part's) powers of two >= 16, H a multiple of Hkv, at most 16 query heads
    per KV head. out_proj is served for any T too."""
    _, t, h, d = q.shape
    dv = (k if v is None else v).shape[-1]
    return t >= 1 and fits_heads(h, k.shape[2], d, dv, 0 if rope is None else rope[0].shape[-1])


def fits_heads(h: int, hkv: int, d: int, dv: int, dr: int = 0) -> bool:
    """fits() for a head layout: h query heads over hkv KV heads, key width d, value width dv,
    rope part width dr (0: none)."""
    dims = (d, dv) if dr == 0 else (d, dv, dr)
    pow2 = all(x >= 16 and x & (x - 1) == 0 for x in dims)
    return pow2 and h % hkv == 0 and h // hkv <= 16


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tile_rows(d: int, dv: int) -> int:
    """Most tile rows ((token, head) pairs) per program: the fp32 accumulator is rows x Dv and
    the query tile rows x D, so wide heads (MLA's 512-wide latent) get fewer rows."""
    wide = max(d, dv)
    return 64 if wide <= 128 else 32 if wide <= 256 else 16


def decode_attention(q: Tensor, k: Tensor, v: Tensor | None, mask: Tensor, scale: float,
                     block_s: int | None = None, splits: int | None = None,
                     rope: tuple[Tensor, Tensor] | None = None, out_proj: Tensor | None = None,
                     block_t: int | None = None, num_warps: int | None = None,
                     limit: Tensor | None = None, num_stages: int | None = None) -> Tensor:
    """q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], mask [B, T, S] bool (True = may
    attend; size-1 dims broadcast) -> [B, T, H, Dv] in q's dtype, as layers.attention (a query
    row that sees no slot gets zeros). T = 1 is a decode step, T > 1 a verified draft tree, each
    token with its own mask row. Query head h reads KV head h // (H / Hkv). v None: the values
    are the keys (MLA's latent), read once. rope (q_rope [B, T, H, Dr], k_rope
    [B, S, Hkv, Dr]): scores of this second pair add to q.k (attention over the concatenated
    heads). Programs run over (row, KV head, block of block_t tokens) x splits along the slots.
    splits: default enough for about SM_TARGET programs; block_s: slots per iteration (default
    64, 32 for heads over 256 wide); block_t: tokens per program (default: as many as fill
    tile_rows with their G heads each); num_warps: default 4, 8 for heads over 256 wide;
    num_stages: Triton's default when None.
    out_proj [H, N, Dv] (any strides, last dim contiguous; MLA's absorbed value projection): the
    result is instead [B, T, H, N] = per head out_proj[h] @ (the attention output rounded to q's
    dtype), merged with the split combine in one kernel (combine_project).
    limit [B] int32 (on q's device): row b sees no slot at or past limit[b] (the caller's promise:
    attention_limit), so only slots below it are read, divided among the splits; the grid stays
    sized for S. A CUDA graph captured over the whole cache then costs ~what the slots in use
    cost, and one graph serves a row's whole life instead of one per span.

    Under torch.compile the call is one opaque operator (draftsman::decode_attention) whose
    launches Triton makes as in eager code: compiled by Inductor as a user kernel, the 64-token
    tree call took 23 us a layer in the compiled 8B round on the H200, 13.4 us as the operator
    (benchmarks/README.md, session 12)."""
    if torch.compiler.is_compiling():
        q_rope, k_rope = (None, None) if rope is None else rope
        return torch.ops.draftsman.decode_attention(q, k, v, mask, scale, q_rope, k_rope, out_proj, limit, block_s,
                                                    splits, block_t, num_warps, num_stages)
    return _decode_attention(q, k, v, mask, scale, block_s, splits, rope, out_proj, block_t, num_warps, limit,
                             num_stages)


def _decode_attention(q: Tensor, k: Tensor, v: Tensor | None, mask: Tensor, scale: float, block_s: int | None,
                      splits: int | None, rope: tuple[Tensor, Tensor] | None, out_proj: Tensor | None,
                      block_t: int | None, num_warps: int | None, limit: Tensor | None,
                      num_stages: int | None) -> Tensor:
    """decode_attention's launches (argument checks included)."""
    v_is_k = v is None
    v = k if v is None else v
    if not fits(q, k, v, rope):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                         f"{'' if rope is None else f', rope {tuple(rope[0].shape)}'} not served")
    b, t, h, d = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if mask.dim() != 3 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, t) or mask.shape[2] != s:
        raise ValueError(f"decode_attention: mask {tuple(mask.shape)} does not fit {(b, t, s)}")
    if rope is not None and (rope[0].shape[:3] != q.shape[:3] or rope[1].shape[:3] != k.shape[:3]
                             or rope[0].shape[-1] != rope[1].shape[-1]):
        raise ValueError(f"decode_attention: rope {tuple(rope[0].shape)}, {tuple(rope[1].shape)} does not fit "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    qr, kr = (q, k) if rope is None else (_last_dim_contiguous(rope[0]), _last_dim_contiguous(rope[1]))
    if block_s is None:
        block_s = 64 if d <= 256 else 32
    mask = mask.expand(b, t, s).view(torch.uint8)  # (never traced: compiled code calls the operator)
    g = h // hkv
    if block_t is None:
        block_t = max(1, tile_rows(d, dv) // triton.next_power_of_2(g))
    block_t = min(block_t, t)
    block_m = max(16, triton.next_power_of_2(block_t * g))  # tl.dot's smallest tile is 16
    tb = triton.cdiv(t, block_t)
    blocks = triton.cdiv(s, block_s)
    if splits is None:
        splits = max(1, min(blocks, triton.cdiv(SM_TARGET, b * hkv * tb)))
    splits = triton.cdiv(s, triton.cdiv(blocks, splits) * block_s)  # (none left empty at full length)
    iters = triton.cdiv(blocks, splits)  # blocks of a split's share at most
    if limit is not None and (limit.shape != (b,) or limit.dtype != torch.int32 or limit.device != q.device):
        raise ValueError(f"decode_attention: limit {tuple(limit.shape)} {limit.dtype} on {limit.device} is not "
                         f"[{b}] int32 on {q.device}")
    direct = splits == 1 and out_proj is None  # no partials to combine: the kernel writes the output
    out = torch.empty(b, t, h, dv, dtype=q.dtype, device=q.device) if out_proj is None else None
    # (direct: no partials, the kernel's acc/stat pointers go unused)
    acc = out if direct else torch.empty(b, hkv, tb, splits, block_m, dv, dtype=torch.float32, device=q.device)
    stat = out if direct else torch.empty(b, hkv, tb, splits, block_m, 2, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # (bf16/fp16 dots ignore it)
    _decode_attention_kernel[(b * hkv * tb, splits)](  # (unused pointers get q)
        q, k, v, mask, acc, stat, q if out is None else out, qr, kr, q if limit is None else limit, t, tb, s, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0), mask.stride(1), mask.stride(2),
        qr.stride(0), qr.stride(1), qr.stride(2),
        kr.stride(0), kr.stride(1), kr.stride(2), HKV=hkv, SPLITS=splits, G=g, BLOCK_T=block_t, BLOCK_M=block_m,
        D=d, DV=dv, DR=0 if rope is None else qr.shape[-1], V_IS_K=v_is_k, BLOCK_S=block_s, S_ITERS=iters,
        DYNAMIC=os.environ.get("TRITON_INTERPRET") != "1", HAS_LIMIT=limit is not None, DIRECT=direct,
        PRECISION=precision, num_warps=num_warps or (4 if d <= 256 else 8),
        **({} if num_stages is None else {"num_stages": num_stages}))
    if out_proj is not None:
        return combine_project(acc, stat, out_proj, g, t, block_t, q.dtype)
    if not direct:
        combine_project(acc, stat, None, g, t, block_t, q.dtype, out=out)
    return out


@triton.jit
def _combine_project_kernel(acc_ptr, stat_ptr, w_ptr, y_ptr, stride_wh, stride_wn, T, TB, HKV: tl.constexpr,
                            SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, G: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, DV: tl.constexpr, N: tl.constexpr,
                            BLOCK_N: tl.constexpr, PROJECT: tl.constexpr):
    row = tl.program_id(0)  # (batch row, token, query head): y's row
    bt, hq = row // (HKV * G), row % (HKV * G)
    b, t = bt // T, bt % T
    hk, g = hq // G, hq % G
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < SPLITS
    base = ((b * HKV + hk) * TB + t // BLOCK_T) * SPLITS + sp  # this token block's partials: one per split
    tile_row = (base * BLOCK_M + (t % BLOCK_T) * G + g)
    m = tl.load(stat_ptr + tile_row * 2, mask=sp_ok, other=float("-inf"))
    z = tl.load(stat_ptr + tile_row * 2 + 1, mask=sp_ok, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # 0 for splits that saw nothing
    den = tl.sum(z * w, axis=0)
    r = tl.arange(0, DV)
    part = tl.load(acc_ptr + tile_row[:, None] * DV + r[None, :], mask=sp_ok[:, None], other=0.0)
    o = tl.sum(part * w[:, None], axis=0) / tl.maximum(den, 1e-30)
    o = tl.where(den > 0, o, 0.0).to(y_ptr.dtype.element_ty)  # as decode_attention's output
    if PROJECT:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        wt = tl.load(w_ptr + hq.to(tl.int64) * stride_wh + n[:, None] * stride_wn + r[None, :], mask=n_ok[:, None],
                     other=0.0)
        y = tl.sum(wt.to(tl.float32) * o.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + row * N + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:  # the attention output itself: y [B, T, H, DV]
        tl.store(y_ptr + row * DV + r, o)


def combine_project(acc: Tensor, stat: Tensor, w: Tensor | None, g: int, t: int, block_t: int, dtype: torch.dtype,
                    block_n: int = 8, out: Tensor | None = None) -> Tensor:
    """The split combine of decode_attention's partials (acc [B, Hkv, TB, splits, BLOCK_M, Dv],
    stat [..., 2]; tile row (i, j) of token block tb is token tb * block_t + i, head j of the
    group) for each of the t tokens and Hkv * g query heads, rounded to `dtype`, then w[h]
    [N, Dv] applied per head: [B, t, Hkv * g, N] in `dtype`. One program per (row, token, head,
    block of N) recombines its head's splits (a few kilobytes) before its share of the product.
    w None: no projection, the combined output itself [B, t, Hkv * g, Dv] in `dtype` (one
    program per row, token and head), written into `out` if given."""
    b, hkv, tb, splits, block_m, dv = acc.shape
    heads = hkv * g
    if w is None:
        y = torch.empty(b, t, heads, dv, dtype=dtype, device=acc.device) if out is None else out
        w, n, grid = y, dv, (b * t * heads, 1)
    elif w.shape[0] != heads or w.shape[2] != dv or w.stride(2) != 1:
        raise ValueError(f"combine_project: w {tuple(w.shape)} (strides {w.stride()}) does not fit {heads} heads "
                         f"of width {dv}")
    else:
        n = w.shape[1]
        y, grid = torch.empty(b, t, heads, n, dtype=dtype, device=acc.device), (b * t * heads, triton.cdiv(n, block_n))
    _combine_project_kernel[grid](
        acc, stat, w, y, w.stride(0), w.stride(1), t, tb, HKV=hkv, SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits), G=g, BLOCK_T=block_t, BLOCK_M=block_m, DV=dv, N=n,
        BLOCK_N=block_n, PROJECT=w is not y, num_warps=4)
    return y


# decode_attention as one operator for torch.compile (see its docstring): a schema, the launches
# as its implementation, and its output's shape for tracing.
_LIB = torch.library.Library("draftsman", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor? v, Tensor mask, float scale, Tensor? q_rope, "
            "Tensor? k_rope, Tensor? out_proj, Tensor? limit, int? block_s, int? splits, int? block_t, "
            "int? num_warps, int? num_stages) -> Tensor")


def _op(q, k, v, mask, scale, q_rope, k_rope, out_proj, limit, block_s, splits, block_t, num_warps, num_stages):
    rope = None if q_rope is None else (q_rope, k_rope)
    return _decode_attention(q, k, v, mask, scale, block_s, splits, rope, out_proj, block_t, num_warps, limit,
                             num_stages)


def _op_shape(q, k, v, mask, scale, q_rope, k_rope, out_proj, limit, block_s, splits, block_t, num_warps,
              num_stages):
    b, t, h, _ = q.shape
    n = (k if v is None else v).shape[-1] if out_proj is None else out_proj.shape[1]
    return q.new_empty(b, t, h, n)


_LIB.impl("decode_attention", _op, "CompositeExplicitAutograd")
torch.library.register_fake("draftsman::decode_attention", _op_shape, lib=_LIB)
