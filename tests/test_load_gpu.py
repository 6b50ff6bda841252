"""Checkpoint loading onto CUDA through pinned buffers (weights.PinnedStager) fills every tensor
exactly as the tensor-by-tensor path does. GPU only (-m gpu)."""

from __future__ import annotations

import pytest
import torch

import draftsman
from draftsman.models import load_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_load_equals_direct_load(monkeypatch, dtype):
    target_dir, drafter_dir = draftsman.reference_pair()
    loaded = []
    for staged in ("1", "0"):
        monkeypatch.setenv("DRAFTSMAN_STAGED_LOAD", staged)
        target = load_target(target_dir, device="cuda", dtype=dtype, fuse=False)
        drafter = draftsman.load_drafter(drafter_dir, device="cuda", dtype=dtype)
        loaded.append({**{f"t.{k}": v for k, v in target.state_dict().items()},
                       **{f"d.{k}": v for k, v in drafter.state_dict().items()}})
    staged, direct = loaded
    assert staged.keys() == direct.keys()
    for name, t in staged.items():
        assert t.dtype == direct[name].dtype and torch.equal(t, direct[name]), name


def test_staged_load_moves_pieces_larger_than_its_buffer():
    from draftsman.weights import PinnedStager

    dest = torch.empty(3000, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(3000).to(torch.bfloat16)
    stager = PinnedStager(workers=2, buffer_bytes=1000)
    stager.submit(dest, lambda: src, "x", "[3000]")
    half = torch.empty(10, 10, dtype=torch.bfloat16, device="cuda")  # dtype change on the GPU
    stager.submit(half, lambda: torch.arange(100.0).view(10, 10), "y", "[10, 10]")
    stager.close()
    assert torch.equal(dest.cpu(), src)
    assert torch.equal(half.cpu(), torch.arange(100.0).view(10, 10).to(torch.bfloat16))
