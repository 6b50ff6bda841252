"""Triton kernels against their PyTorch references: in Triton's CPU interpreter where Triton is
installed (CI's CPU image has no Triton: those tests skip), and on CUDA with -m gpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsman.config import MoEConfig
from draftsman.models.deepseek import Experts

triton = pytest.importorskip("triton")


def routed(n: int, e: int, k: int, hidden: int, inner: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    moe = MoEConfig(n_routed_experts=e, num_experts_per_tok=k, moe_intermediate_size=inner)
    experts = Experts(hidden, moe).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(n, hidden, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(device)
    weights = torch.rand(n, k, generator=g).to(device)
    return experts, x, weights, ids


INTERPRETED = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_kernels import routed
from draftsman.kernels.moe import moe_experts, moe_experts_gemv
from draftsman.models.layers import SwiGLU
for n in (1, 5, 21):  # decode, a small verify, more assignments than one block
    experts, x, weights, ids = routed(n, e=12, k=3, hidden=48, inner=40, device="cpu")
    w = (experts.gate_proj, experts.up_proj, experts.down_proj)
    expected = experts.grouped(x, weights, ids)
    torch.testing.assert_close(moe_experts(x, weights, ids, *w, block_t=16, block_n=16, block_k=16), expected,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe_experts_gemv(x, weights, ids, *w, block_n=8, block_k=16), expected,
                               rtol=1e-5, atol=1e-5)
    if n * 3 <= 16:  # decode: DeepSeek's shared experts (two experts' width) in the same launches
        shared = SwiGLU(48, 80)
        with torch.no_grad():
            for p in shared.parameters():
                p.copy_(torch.randn(p.shape) * 0.1)
        gate_up = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
        got = moe_experts_gemv(x, weights, ids, *w, shared=(gate_up, shared.down_proj.weight), block_n=8, block_k=16)
        torch.testing.assert_close(got, expected + shared(x), rtol=1e-5, atol=1e-5)
        # the default tiles (block_k capped at the hidden size's power of two: 64 here, 48 used)
        got = moe_experts_gemv(x, weights, ids, *w, shared=(gate_up, shared.down_proj.weight))
        torch.testing.assert_close(got, expected + shared(x), rtol=1e-5, atol=1e-5)
print("ok")
"""


ROUTE_INTERPRETED = """
import torch
from draftsman.config import MoEConfig
from draftsman.kernels.gemv import gemv
from draftsman.kernels.router import route
from draftsman.models.deepseek import Router
g = torch.Generator().manual_seed(0)
cases = ((64, 6, 1, 1, True, 2.446), (16, 4, 4, 2, True, 2.5), (24, 3, 1, 1, False, 1.0), (32, 8, 8, 3, False, 1.5))
for e, k, groups, topk_group, norm, scaling in cases:
    moe = MoEConfig(n_routed_experts=e, num_experts_per_tok=k, moe_intermediate_size=8, n_group=groups,
                    topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling)
    router = Router(40, moe)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, 40, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.5)
    for n in (1, 5):
        x = torch.randn(n, 40, generator=g)
        want_w, want_ids = router(x)  # CPU: the PyTorch route
        logits = gemv(x, router.weight, block_n=4, block_k=16) if n <= 8 else x @ router.weight.T
        got_w, got_ids = route(logits, router.e_score_correction_bias, k, groups, topk_group, norm, scaling)
        assert torch.equal(got_ids, want_ids), (e, k, groups, got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_route_kernel_matches_the_router_interpreted():
    """Expert choice (ids in the same order) and mixing weights as deepseek.Router, with and
    without group-limited routing, normalisation and scaling, k not a power of two, E not one."""
    proc = subprocess.run([sys.executable, "-c", ROUTE_INTERPRETED], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_moe_kernel_matches_the_grouped_loop_interpreted():
    """Triton's interpreter must be chosen before Triton is imported: a fresh process."""
    code = INTERPRETED.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 6, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_kernel_matches_the_grouped_loop_on_cuda(n, dtype):
    """Moonlight-like routing (64 experts, top-6), the kernel called directly (Experts.forward
    would fall back to the loop on a kernel failure), then through Experts.forward."""
    from draftsman.kernels.moe import moe_experts
    from draftsman.models import deepseek

    experts, x, weights, ids = routed(n, e=64, k=6, hidden=256, inner=176, device="cuda", dtype=dtype)
    experts.requires_grad_(False)  # a frozen target's experts (with autograd recording: the loop)
    got = moe_experts(x, weights, ids, experts.gate_proj, experts.up_proj, experts.down_proj)
    if n * 6 <= 16:  # the GEMV-style kernels ran: the grouped ones must agree with them
        from draftsman.kernels.moe import moe_experts_gemv

        grouped = moe_experts(torch.cat([x] * 3), weights.repeat(3, 1), ids.repeat(3, 1), experts.gate_proj,
                              experts.up_proj, experts.down_proj)[:n]
        torch.testing.assert_close(grouped, moe_experts_gemv(x, weights, ids, experts.gate_proj, experts.up_proj,
                                                             experts.down_proj), rtol=2e-2, atol=2e-2)
    if dtype == torch.float32:  # fp32 products (no TF32): the loop's result up to summation order
        torch.testing.assert_close(got, experts.grouped(x, weights, ids), rtol=1e-4, atol=1e-4)
    else:  # bf16: both round differently; the kernel (fp32 accumulation) must be no further from fp32
        ref = experts.float().grouped(x.float(), weights, ids)
        loop_err = (experts.to(dtype).grouped(x, weights, ids).float() - ref).abs().max().item()
        assert (got.float() - ref).abs().max().item() <= 1.5 * loop_err + 1e-3
    torch.testing.assert_close(experts(x, weights, ids), got, rtol=0, atol=0)
    assert not deepseek._KERNEL_FAILED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_kernel_inside_cuda_graphs():
    """A many-expert DeepSeek target decodes the same in graphed and eager sessions: the kernel
    path (device-side sort, no host sync) can be captured."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from geometries import MOONLIGHT_16B_A3B

    from draftsman.config import parse_target_config
    from draftsman.generate import StopRules
    from draftsman.graphs import graph_table
    from draftsman.models import build_target, deepseek
    from draftsman.sampling import SamplingParams
    from draftsman.session import PlainSession, run_to_completion

    raw = dict(MOONLIGHT_16B_A3B, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, vocab_size=512, n_routed_experts=16,
               num_experts_per_tok=4)
    torch.manual_seed(0)
    model = build_target(parse_target_config(raw)).cuda().eval().requires_grad_(False)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 12)]
    outs = []
    for graphed in (False, True):
        session = PlainSession(model, 40)
        session.graphed = graphed
        done = run_to_completion(session, prompts, StopRules(max_new_tokens=16), SamplingParams(temperature=0.0))
        outs.append([r.state.tokens for r in done])
    assert outs[0] == outs[1]
    assert not graph_table(model).failed and not deepseek._KERNEL_FAILED


GEMV_INTERPRETED = """
import torch
import torch.nn.functional as F
from draftsman.kernels.gemv import gemv
g = torch.Generator().manual_seed(0)
for m, n, k, split in ((1, 24, 64, 1), (3, 20, 72, 1), (2, 16, 64, 2), (1, 40, 96, 3)):
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = gemv(x, w, block_n=8, block_k=16, split_k=split, num_warps=1)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
print("ok")
"""

HEAD_GEMV_INTERPRETED = """
import torch
from draftsman.kernels.gemv import head_gemv
g = torch.Generator().manual_seed(0)
for m in (1, 3):
    kv_b = torch.randn(4, 24 + 20, 40, generator=g)  # MLA's kv_b per head: [nope | v] rows of the rank
    w_uk, w_uv = kv_b[:, :24], kv_b[:, 24:]
    q, o = torch.randn(m, 4, 24, generator=g), torch.randn(m, 4, 40, generator=g)
    torch.testing.assert_close(head_gemv(q, w_uk, transposed=True), torch.einsum("mhd,hdr->mhr", q, w_uk),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head_gemv(o, w_uv), torch.einsum("mhr,hvr->mhv", o, w_uv), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_head_gemv_matches_einsum_interpreted():
    """Both orientations of MLA's absorbed products over strided halves of kv_b, ragged N and K
    (not multiples of the tiles), padded rows."""
    proc = subprocess.run([sys.executable, "-c", HEAD_GEMV_INTERPRETED], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_gemv_matches_linear_interpreted():
    """Even and ragged shapes (rows padded, N and K not multiples of the blocks), with and
    without split K."""
    proc = subprocess.run([sys.executable, "-c", GEMV_INTERPRETED], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


GEMV_FUSED_INTERPRETED = """
import torch
import torch.nn.functional as F
from draftsman.kernels.gemv import gemv
from draftsman.models.layers import RMSNorm
g = torch.Generator().manual_seed(0)
for m, n, k, split in ((1, 24, 64, 1), (3, 20, 72, 1), (1, 20, 72, 2), (3, 40, 96, 3)):
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    norm = RMSNorm(k, eps=1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(k, generator=g))
    gate_up, residual = torch.randn(m, 2 * k, generator=g), torch.randn(m, n, generator=g)
    blocks = dict(block_n=8, block_k=16, split_k=split, num_warps=1)
    torch.testing.assert_close(gemv(x, w, norm_weight=norm.weight, eps=norm.eps, **blocks), F.linear(norm(x), w),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(gate_up, w, swiglu=True, **blocks),
                               F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], w), rtol=1e-5, atol=1e-5)
    if split == 1:
        torch.testing.assert_close(gemv(x, w, residual=residual, **blocks), residual + F.linear(x, w),
                                   rtol=1e-5, atol=1e-5)
print("ok")
"""


GEMV_CHAINED_INTERPRETED = """
import torch
import torch.nn.functional as F
from draftsman.kernels.gemv import gemv, sum_squares_parts
from draftsman.models.layers import RMSNorm
g = torch.Generator().manual_seed(0)
for m, n, k in ((1, 24, 64), (3, 20, 72)):
    x, w2 = torch.randn(m, k, generator=g), torch.randn(2 * n, k, generator=g)
    blocks = dict(block_n=8, block_k=16, num_warps=1)
    gate, up = F.linear(x, w2[:n]), F.linear(x, w2[n:])
    torch.testing.assert_close(gemv(x, w2, glu=True, **blocks), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    # a residual GEMV leaves its output's sums of squares; the next norm GEMV reads them
    w, residual = torch.randn(k, n, generator=g), torch.randn(m, k, generator=g)
    ss = torch.full((m, sum_squares_parts(k, 8)), float("nan"))
    h = gemv(F.silu(gate) * up, w, residual=residual, sum_squares_out=ss, **blocks)
    torch.testing.assert_close(ss.sum(1), (h * h).sum(1), rtol=1e-5, atol=1e-4)
    norm = RMSNorm(k, eps=1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(k, generator=g))
    torch.testing.assert_close(gemv(h, w2, norm_weight=norm.weight, eps=norm.eps, norm_sum_squares=ss, glu=True, **blocks),
                               F.silu(F.linear(norm(h), w2[:n])) * F.linear(norm(h), w2[n:]), rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_gemv_chained_fusions_match_pytorch_interpreted():
    """The GLU epilogue (gate and up rows in one program, F.silu(gate) * up out), and a residual
    GEMV's sums of squares handed to the next norm GEMV in place of its pass over the input."""
    proc = subprocess.run([sys.executable, "-c", GEMV_CHAINED_INTERPRETED], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_gemv_fusions_match_pytorch_interpreted():
    """RMSNorm and SwiGLU prologues (with and without split K: the norm's sum of squares must
    cover the whole row) and the residual epilogue, on even and ragged shapes."""
    proc = subprocess.run([sys.executable, "-c", GEMV_FUSED_INTERPRETED], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_gemv_refuses_fusions_it_cannot_do():
    """Checked before launching, so no device or interpreter is needed."""
    from draftsman.kernels.gemv import gemv

    x, w = torch.randn(1, 64), torch.randn(8, 32)
    with pytest.raises(ValueError, match="together"):
        gemv(x, w, norm_weight=torch.ones(32), swiglu=True)
    with pytest.raises(ValueError, match="split_k"):
        gemv(x[:, :32], w, split_k=2, residual=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, w)  # [gate | up] without swiglu
    with pytest.raises(ValueError, match="norm_weight"):
        gemv(x[:, :32], w, norm_weight=torch.ones(32, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("split_k", [1, 4])
def test_gemv_matches_linear_on_cuda(m, split_k):
    import torch.nn.functional as F

    from draftsman.kernels.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(gemv(x, w, split_k=split_k).float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_linear_runs_one_row_products_on_the_gemv():
    import torch.nn.functional as F
    from torch import nn

    from draftsman.models.layers import DecodeLinear, use_gemv

    lin = nn.Linear(512, 1000, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    use_gemv(lin)
    assert type(lin) is DecodeLinear
    x1, x8 = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((1, 1, 512), (8, 512)))
    torch.testing.assert_close(lin(x1).float(), F.linear(x1.float(), lin.weight.float()), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lin(x8), F.linear(x8, lin.weight), rtol=0, atol=0)  # many rows: cuBLAS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fusion", ["norm", "swiglu", "residual"])
@pytest.mark.parametrize("wide", [False, True])
def test_gemv_fusions_match_pytorch_on_cuda(m, fusion, wide):
    """bf16 against PyTorch's bf16 decode-layer ops (N ragged against the default blocks, and
    against the fused decode layers' wider tiles)."""
    import torch.nn.functional as F

    from draftsman.kernels.gemv import fused_tiles, gemv
    from draftsman.models.layers import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    k, n = 4096, 1000
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    tiles = fused_tiles(n, k) if wide else {}
    assert tiles or not wide
    if fusion == "norm":
        norm = RMSNorm(k).to("cuda", torch.bfloat16).requires_grad_(False)
        norm.weight.copy_(1 + 0.1 * torch.randn(k, device="cuda", generator=g))
        got, expected = gemv(x, w, norm_weight=norm.weight, eps=norm.eps, **tiles), F.linear(norm(x), w)
    elif fusion == "swiglu":
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
        got, expected = (gemv(gate_up, w, swiglu=True, **tiles),
                         F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], w))
    else:
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
        got, expected = gemv(x, w, residual=residual, **tiles), residual + F.linear(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chained", [False, True, ("norm", "glu"), ("glu",), ("linear",)])
def test_fused_decode_layers_match_the_unfused_ones(chained, monkeypatch):
    """Batch-1 decode through LlamaDecoderLayer.decode_fused (GEMVs with RMSNorm, SwiGLU and
    residual folded in) against the same model with every product on cuBLAS, in a session."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from geometries import LLAMA_31_8B

    from draftsman.config import parse_target_config
    from draftsman.models import build_target, llama
    from draftsman.models.layers import use_gemv

    monkeypatch.setattr(llama, "FUSED_DECODE_CHAINED", chained is not False)
    if isinstance(chained, tuple):
        monkeypatch.setattr(llama, "CHAINED_GATE_UP", chained)
    raw = dict(LLAMA_31_8B, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, vocab_size=1000)
    torch.manual_seed(0)
    model = build_target(parse_target_config(raw)).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    model.fuse_projections()
    assert model.layers[0].fused_decode(torch.zeros(1, 1, 512, device="cuda", dtype=torch.bfloat16))
    ids = torch.randint(0, 1000, (1, 12), device="cuda")
    logits = []
    for on in (True, False):
        use_gemv(model, on)
        cache = model.new_cache(1, 16)
        model.run(ids[:, :8], cache=cache)
        steps = [model.run(ids[:, i : i + 1], positions=torch.tensor([[i]], device="cuda"), cache=cache,
                           cache_index=torch.tensor([[i]], device="cuda")).logits for i in range(8, 12)]
        logits.append(torch.cat(steps, 1).float())
    fused, reference = logits
    scale = reference.abs().max()
    assert (fused - reference).abs().max() <= 0.03 * scale


DECODE_ATTENTION_INTERPRETED = """
import torch
from draftsman.kernels.attention import decode_attention
from draftsman.models.layers import attention
g = torch.Generator().manual_seed(0)
for b, h, hkv, d, dv, s, splits in ((2, 8, 2, 16, 16, 100, None), (1, 4, 4, 16, 32, 37, 1), (3, 6, 2, 32, 16, 70, 3)):
    q = torch.randn(b, 1, h, d, generator=g)
    k, v = torch.randn(b, s + 5, hkv, d, generator=g)[:, :s], torch.randn(b, s, hkv, dv, generator=g)
    mask = torch.rand(b, 1, s, generator=g) < 0.7
    mask[0, 0, 40:] = False  # a whole split with nothing visible
    if b > 1:
        mask[1] = False  # a row that sees nothing: zeros, as attention()
    got = decode_attention(q, k, v, mask, d ** -0.5, block_s=16, splits=splits)
    want = attention(q, k, v, mask, d ** -0.5)
    torch.testing.assert_close(got, torch.nan_to_num(want), rtol=1e-4, atol=1e-4)
# MLA's absorbed form: one KV head whose values are the keys, plus a rope query/key part
for b, h, d, dr, s in ((2, 4, 32, 16, 50), (1, 16, 64, 16, 21)):
    q, qr = torch.randn(b, 1, h, d, generator=g), torch.randn(b, 1, h, dr, generator=g)
    latent = torch.randn(b, s, 1, d + dr, generator=g)  # a cache row [c_kv | k_pe], read as two views
    kv, kr = latent[..., :d], latent[..., d:]
    mask = torch.rand(b, 1, s, generator=g) < 0.8
    got = decode_attention(q, kv, None, mask, 0.1, block_s=16, rope=(qr, kr))
    want = attention(torch.cat((q, qr), -1), latent, kv, mask, 0.1)
    torch.testing.assert_close(got, torch.nan_to_num(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(attention(q, kv, None, mask, 0.1, rope=(qr, kr)), want)  # the PyTorch path
    # ... with the split combine and MLA's absorbed value projection in one kernel
    w_uv = torch.randn(h, 2 * 20, d, generator=g)[:, ::2]  # [heads, 20, d], a strided view (ragged N)
    for splits in (1, 3):
        got = decode_attention(q, kv, None, mask, 0.1, block_s=16, splits=splits, rope=(qr, kr), out_proj=w_uv)
        torch.testing.assert_close(got, torch.einsum("bthr,hvr->bthv", torch.nan_to_num(want), w_uv),
                                   rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_decode_attention_matches_attention_interpreted():
    """One query token over ragged slot counts, grouped heads (and one query head per KV head),
    Dv != D, strided K, split and unsplit slots, a split and a row with nothing visible; MLA's
    form (values are the keys, a rope part from another view of the same cache rows), also with
    the combine and the absorbed value projection fused."""
    proc = subprocess.run([sys.executable, "-c", DECODE_ATTENTION_INTERPRETED], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,s", [(1, 264), (4, 1000)])
def test_decode_attention_matches_sdpa_on_cuda(b, s):
    """bf16 at Llama-3.1-8B's heads (32 query, 8 KV, dim 128) over a cache buffer longer than the
    span read, against SDPA's math backend in fp32."""
    from draftsman.kernels.attention import decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, b, s + 64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = cache[0, :, :s], cache[1, :, :s]
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.randint(s // 2, s, (b, 1), device="cuda")
    mask = torch.arange(s, device="cuda")[None, None, :] <= pos[:, :, None]
    got = decode_attention(q, k, v, mask, 128 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask[:, None],
        scale=128 ** -0.5, enable_gqa=True).transpose(1, 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


TREE_ATTENTION_INTERPRETED = """
import torch
from draftsman.kernels.attention import decode_attention
from draftsman.models.layers import attention
g = torch.Generator().manual_seed(0)


def tree_mask(b, t, prefix, s):
    # each token sees the prefix, itself and a random subset of the earlier tree tokens (its
    # ancestors, say); slots past prefix + t are never visible; token 1 of row 0 sees nothing
    tree = torch.rand(b, t, t, generator=g) < 0.4
    tree = (tree.tril(-1) | torch.eye(t, dtype=torch.bool)).expand(b, t, t)
    mask = torch.zeros(b, t, s, dtype=torch.bool)
    mask[..., :prefix] = True
    mask[..., prefix : prefix + t] = tree
    if t > 1:
        mask[0, 1] = False
    return mask


def check(got, q, k, v, mask, scale, rope=None):
    want = torch.nan_to_num(attention(q, k, v, mask, scale, rope=rope))  # PyTorch's path on CPU
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# (b, h, hkv, d, dv, t, prefix, splits, block_t): GQA, MHA, 3 heads per KV head (rows not a
# power of two), 1 to 64 tokens, default and small token blocks (one token: the decode path's
# single mask row; a ragged last block)
for b, h, hkv, d, dv, t, prefix, splits, block_t in (
        (2, 8, 2, 16, 16, 1, 30, None, None), (2, 8, 2, 16, 32, 3, 30, 2, 1), (1, 8, 2, 32, 16, 16, 21, None, 3),
        (1, 8, 2, 16, 16, 64, 40, None, None), (2, 4, 4, 16, 16, 16, 12, 1, None), (1, 4, 4, 16, 16, 64, 9, 3, 20),
        (1, 6, 2, 16, 16, 16, 33, None, None)):
    s = prefix + t + 7  # slots past the tree: allocated, never visible
    q = torch.randn(b, t, h, d, generator=g)
    k, v = torch.randn(b, s + 5, hkv, d, generator=g)[:, :s], torch.randn(b, s, hkv, dv, generator=g)
    mask = tree_mask(b, t, prefix, s)
    check(decode_attention(q, k, v, mask, d ** -0.5, block_s=16, splits=splits, block_t=block_t), q, k, v, mask,
          d ** -0.5)
    # values are the keys; one mask for every row (broadcast)
    check(decode_attention(q, k, None, mask[:1], 0.2, block_s=16, splits=splits, block_t=block_t), q, k, k,
          mask[:1].expand(b, t, s), 0.2)
# MLA's absorbed form (values are the keys, a rope part), also with the fused value projection;
# one token per program, as 512-wide latents get on the GPU
for b, h, d, dr, t, prefix, splits, block_t in ((1, 4, 32, 16, 5, 20, None, None), (2, 16, 16, 16, 16, 9, 2, 1)):
    s = prefix + t
    q, qr = torch.randn(b, t, h, d, generator=g), torch.randn(b, t, h, dr, generator=g)
    latent = torch.randn(b, s, 1, d + dr, generator=g)  # a cache row [c_kv | k_pe], read as two views
    kv, kr = latent[..., :d], latent[..., d:]
    mask = tree_mask(b, t, prefix, s)
    got = decode_attention(q, kv, None, mask, 0.1, block_s=16, splits=splits, rope=(qr, kr), block_t=block_t)
    check(got, q, kv, None, mask, 0.1, rope=(qr, kr))
    want = torch.nan_to_num(attention(torch.cat((q, qr), -1), latent, kv, mask, 0.1))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)  # ... as attention over the concatenation
    w_uv = torch.randn(h, 2 * 20, d, generator=g)[:, ::2]  # [heads, 20, d], a strided view (ragged N)
    got = decode_attention(q, kv, None, mask, 0.1, block_s=16, splits=splits, rope=(qr, kr), out_proj=w_uv,
                           block_t=block_t)
    torch.testing.assert_close(got, torch.einsum("bthr,hvr->bthv", want, w_uv), rtol=2e-5, atol=2e-5)
# A per-row limit: slots at or past it are neither read nor seen, though the mask (against the
# contract, to prove it) marks some visible; NaN keys and values there poison any that is read.
# Limits shorter than one split's share, not a block multiple, 0 (nothing visible: zeros).
for b, h, hkv, d, t, splits, block_t, limits in ((3, 8, 2, 16, 4, None, None, (50, 7, 0)),
                                                 (2, 4, 4, 16, 1, 3, None, (33, 120)),
                                                 (2, 8, 2, 16, 16, 2, 5, (90, 17))):
    s = 120
    lim = torch.tensor(limits, dtype=torch.int32)
    q = torch.randn(b, t, h, d, generator=g)
    k, v = torch.randn(b, s, hkv, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
    mask = torch.rand(b, t, s, generator=g) < 0.7
    past = torch.arange(s)[None, :] >= lim[:, None]  # [B, S]
    nan = past[..., None, None]
    bad_k, bad_v = k.masked_fill(nan, float("nan")), v.masked_fill(nan, float("nan"))
    got = decode_attention(q, bad_k, bad_v, mask, d ** -0.5, block_s=16, splits=splits, block_t=block_t, limit=lim)
    check(got, q, k, v, mask & ~past[:, None], d ** -0.5)
    latent = torch.randn(b, s, 1, d + 16, generator=g).masked_fill(past[..., None, None], float("nan"))
    qr, w_uv = torch.randn(b, t, h, 16, generator=g), torch.randn(h, 8, d, generator=g)
    got = decode_attention(q, latent[..., :d], None, mask, 0.1, block_s=16, splits=splits, block_t=block_t,
                           rope=(qr, latent[..., d:]), out_proj=w_uv, limit=lim)
    clean = latent.nan_to_num(0.0)
    want = torch.nan_to_num(attention(q, clean[..., :d], None, mask & ~past[:, None], 0.1, rope=(qr, clean[..., d:])))
    torch.testing.assert_close(got, torch.einsum("bthr,hvr->bthv", want, w_uv), rtol=2e-5, atol=2e-5)
# Inside torch.compile the call is one operator (draftsman::decode_attention): the same launches
b, t, s = 2, 16, 50
q = torch.randn(b, t, 8, 16, generator=g)
k, v = torch.randn(b, s, 2, 16, generator=g), torch.randn(b, s, 2, 16, generator=g)
mask, lim = tree_mask(b, t, 30, s), torch.tensor([46, 40], dtype=torch.int32)
eager = decode_attention(q, k, v, mask, 0.25, block_s=16, limit=lim)
compiled = torch.compile(lambda q, k, v, mask, lim: decode_attention(q, k, v, mask, 0.25, block_s=16, limit=lim),
                         fullgraph=True)
assert torch.equal(compiled(q, k, v, mask, lim), eager)
print("ok")
"""


def test_tree_attention_matches_attention_interpreted():
    """Several query tokens per row (1 to 64), each with its own tree mask (the prefix, itself, a
    random subset of the earlier tree slots; one token that sees nothing): grouped heads (2 and 3
    per KV head) and one per KV head, Dv != D, strided K, default and ragged token blocks, splits;
    values that are the keys, a mask broadcast over rows; MLA's rope pair, with and without the
    fused value projection; per-row limits past which nothing is read (NaN there) or seen.
    Against attention()'s PyTorch path in fp32."""
    proc = subprocess.run([sys.executable, "-c", TREE_ATTENTION_INTERPRETED], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _tree_inputs(t: int, s: int, seed: int = 0):
    """Llama-3.1-8B's attention (32 query heads, 8 KV heads, dim 128) in bf16 on CUDA: t draft
    tokens at slots s - t .. s - 1 of a longer cache buffer, each seeing the prefix, itself and
    a random subset of the earlier tree tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(2, 1, s + 64, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = cache[0, :, :s], cache[1, :, :s]
    q = torch.randn(1, t, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    tree = torch.rand(t, t, device="cuda", generator=g) < 0.3
    tree = tree.tril(-1) | torch.eye(t, dtype=torch.bool, device="cuda")
    mask = torch.ones(1, t, s, dtype=torch.bool, device="cuda")
    mask[0, :, s - t :] = tree
    return q, k, v, mask


def _sdpa_fp32(q, k, v, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,s", [(1, 300), (16, 700), (64, 2048), (64, 333)])
def test_tree_attention_matches_sdpa_on_cuda(t, s):
    """bf16 draft-tree verification at Llama-3.1-8B's heads against SDPA's math in fp32."""
    from draftsman.kernels.attention import decode_attention

    q, k, v, mask = _tree_inputs(t, s)
    got = decode_attention(q, k, v, mask, 128 ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (1, t, 32, 128)
    torch.testing.assert_close(got.float(), _sdpa_fp32(q, k, v, mask, 128 ** -0.5), rtol=2e-2, atol=2e-2)
    # inside torch.compile: one operator, the same launches
    compiled = torch.compile(lambda q, k, v, mask: decode_attention(q, k, v, mask, 128 ** -0.5), fullgraph=True)
    assert torch.equal(compiled(q, k, v, mask), got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_routes_trees_to_the_kernel_on_cuda(monkeypatch):
    """layers.attention sends a 64-token inference verify to the kernel (also inside
    torch.compile, as the compiled steps call it) and longer or differentiable calls to SDPA."""
    import draftsman.kernels.attention as kernel
    from draftsman.models import layers

    calls = []
    real = kernel.decode_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "decode_attention", spy)
    q, k, v, mask = _tree_inputs(64, 1000)
    want = _sdpa_fp32(q, k, v, mask, 128 ** -0.5)
    with torch.no_grad():
        assert layers.decode_kernel_applies(q, k, v)
        got = layers.attention(q, k, v, mask, 128 ** -0.5)
        assert calls == [64]
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        compiled = torch.compile(layers.attention, fullgraph=True)(q, k, v, mask, 128 ** -0.5)
        torch.testing.assert_close(compiled.float(), want, rtol=2e-2, atol=2e-2)
        prefill = torch.zeros(1, layers.DECODE_ATTENTION_MAX_T + 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        assert not layers.decode_kernel_applies(prefill, k, v)  # SDPA's flash kernels
    assert not layers.decode_kernel_applies(q.requires_grad_(), k, v)


FUSED_LAYERS_INTERPRETED = """
import sys
import torch
sys.path.insert(0, "benchmarks")
from geometries import LLAMA_31_8B
from draftsman.config import parse_target_config
from draftsman.models import build_target, llama
from draftsman.models.layers import use_gemv
raw = dict(LLAMA_31_8B, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, vocab_size=300)
torch.manual_seed(0)
model = build_target(parse_target_config(raw)).eval().requires_grad_(False)
for name, p in model.named_parameters():
    if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * torch.randn(p.shape))
model.fuse_projections()
use_gemv(model, True)
ids = torch.randint(0, 300, (1, 10))
llama.FUSED_DECODE_CHAINED = sys.argv[1].startswith("chained")
llama.CHAINED_GATE_UP = ()
if ":" in sys.argv[1]:
    llama.CHAINED_GATE_UP = tuple(f for f in sys.argv[1].split(":")[1].split("+") if f)
logits = []
for fused in (True, False):
    llama.LlamaDecoderLayer.fused_decode = lambda self, x, on=fused: on and x.numel() == x.shape[-1]
    cache = model.new_cache(1, 16)
    model.run(ids[:, :6], cache=cache)
    steps = [model.run(ids[:, i : i + 1], positions=torch.tensor([[i]]), cache=cache,
                       cache_index=torch.tensor([[i]])).logits for i in range(6, 10)]
    logits.append(torch.cat(steps, 1))
torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
print("ok")
"""


@pytest.mark.parametrize("variant", ["fused", "chained", "chained:glu", "chained:norm", "chained:norm+glu",
                                     "chained:linear"])
def test_fused_decode_layers_match_the_unfused_ones_interpreted(variant):
    """Batch-1 decode steps through LlamaDecoderLayer.decode_fused (fp32, Triton's interpreter)
    against the layers' plain forward; `chained`: norms reading the sums of squares the previous
    layer's GEMVs left (decode_chained, its default gate/up); `chained:F`: its gate/up GEMV
    folding F of the norm and SiLU * up, or a PyTorch matmul (F: linear; llama.CHAINED_GATE_UP)."""
    proc = subprocess.run([sys.executable, "-c", FUSED_LAYERS_INTERPRETED, variant], capture_output=True, text=True,
                          timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_argmax_compiled_on_cuda_is_torch_argmax():
    """The two-pass argmax of a decode step's next token, through torch.compile on the GPU (its
    path in compiled decode steps), against torch.argmax on a 128k vocabulary with ties."""
    from draftsman.sampling import greedy_argmax

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(-5, 6, (3, 128256), device="cuda", generator=g).to(torch.bfloat16)
    x[1, 100_000] = 7.0
    x[2] = float("-inf")
    fn = torch.compile(greedy_argmax, fullgraph=True)
    torch.testing.assert_close(fn(x), x.argmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(fn(x[:1]), x[:1].argmax(-1), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moonlight_decode_kernels_match_pytorch_on_cuda():
    """At Moonlight-16B-A3B's shapes in bf16: MLA decode attention over the latent cache (values
    are the keys, a rope part), the absorbed per-head products, routing (64 experts, top 6) and
    routed + shared experts in one launch pair, each against its PyTorch path."""
    import torch.nn.functional as F

    from draftsman.config import MoEConfig
    from draftsman.kernels.attention import decode_attention
    from draftsman.kernels.gemv import gemv, head_gemv
    from draftsman.kernels.moe import moe_experts_gemv
    from draftsman.kernels.router import route
    from draftsman.models.deepseek import Router
    from draftsman.models.layers import SwiGLU

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    # attention: 16 heads over a [c_kv (512) | k_pe (64)] cache row, 300 of 400 slots read
    cache = torch.randn(1, 400, 1, 576, device=dev, dtype=bf, generator=g)
    q, qr = torch.randn(1, 1, 16, 512, device=dev, dtype=bf, generator=g), torch.randn(1, 1, 16, 64, device=dev,
                                                                                          dtype=bf, generator=g)
    kv, kr = cache[:, :300, :, :512], cache[:, :300, :, 512:]
    mask = torch.arange(300, device=dev)[None, None, :] <= 250
    got = decode_attention(q, kv, None, mask, 0.07, rope=(qr, kr))
    want = F.scaled_dot_product_attention(torch.cat((q, qr), -1).float().transpose(1, 2),
                                          cache[:, :300].float().transpose(1, 2), kv.float().transpose(1, 2),
                                          attn_mask=mask[:, None], scale=0.07, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # ... with the combine and the absorbed value projection fused (deepseek.ABSORB_IN_COMBINE)
    w_uv = (torch.randn(16, 256, 512, device=dev, dtype=bf, generator=g) * 0.05)[:, 128:]
    fused = decode_attention(q, kv, None, mask, 0.07, rope=(qr, kr), out_proj=w_uv)
    torch.testing.assert_close(fused.float(), torch.einsum("bthr,hvr->bthv", got.float(), w_uv.float()),
                               rtol=2e-2, atol=2e-2)
    # absorbed products over kv_b's halves
    kv_b = torch.randn(16, 256, 512, device=dev, dtype=bf, generator=g) * 0.05
    x = torch.randn(1, 16, 128, device=dev, dtype=bf, generator=g)
    torch.testing.assert_close(head_gemv(x, kv_b[:, :128], transposed=True).float(),
                               torch.einsum("mhd,hdr->mhr", x.float(), kv_b[:, :128].float()), rtol=2e-2, atol=2e-2)
    o = torch.randn(1, 16, 512, device=dev, dtype=bf, generator=g)
    torch.testing.assert_close(head_gemv(o, kv_b[:, 128:]).float(),
                               torch.einsum("mhr,hvr->mhv", o.float(), kv_b[:, 128:].float()), rtol=2e-2, atol=2e-2)
    # routing: same experts as the PyTorch route from the same logits, same weights
    moe = MoEConfig(n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                    routed_scaling_factor=2.446, norm_topk_prob=True)
    router = Router(2048, moe).to(dev)
    with torch.no_grad():
        router.weight.normal_(0, 0.02, generator=g)
    h = torch.randn(1, 2048, device=dev, dtype=bf, generator=g)
    logits = gemv(h.float(), router.weight, block_n=4)
    torch.testing.assert_close(logits, F.linear(h.float(), router.weight), rtol=1e-4, atol=1e-4)
    scores = logits.sigmoid()
    want_ids = scores.topk(6, dim=-1).indices
    weights, ids = route(logits, router.e_score_correction_bias, 6, scaling=2.446)
    assert torch.equal(ids, want_ids)
    chosen = scores.gather(1, want_ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.446)
    # routed + shared experts: the kernel pair against the PyTorch loop plus the shared SwiGLU
    experts, xe, w_e, ids_e = routed(1, e=64, k=6, hidden=2048, inner=1408, device=dev, dtype=bf)
    shared = SwiGLU(2048, 2816).to(dev, bf)
    with torch.no_grad():
        for p in shared.parameters():
            p.normal_(0, 0.02, generator=g)
    gate_up = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
    with torch.no_grad():
        got = moe_experts_gemv(xe, w_e, ids_e, experts.gate_proj, experts.up_proj, experts.down_proj,
                               shared=(gate_up, shared.down_proj.weight))
        torch_bf16 = experts.grouped(xe, w_e, ids_e) + shared(xe)
        ref = experts.float().grouped(xe.float(), w_e, ids_e) + shared.float()(xe.float())
    # bf16 rounds the inner activations (values ~100 here): no further from fp32 than PyTorch's bf16
    assert (got.float() - ref).abs().max() <= 1.5 * (torch_bf16.float() - ref).abs().max() + 1e-3
