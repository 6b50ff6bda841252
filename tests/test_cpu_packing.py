"""CPU products on oneDNN-packed weights (layers.DecodeLinear, cpu_packed_linear) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsman.models import layers
from draftsman.models.layers import DecodeLinear, use_cpu_packing

pytestmark = pytest.mark.skipif(not layers.CPU_PACK, reason="oneDNN packing off (DRAFTSMAN_CPU_PACK=0 or no mkldnn)")


def frozen_linear(n: int, k: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    use_cpu_packing(lin)
    return lin


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_linear(dtype, tol, rows, bias):
    lin = frozen_linear(96, 160, bias, dtype)
    assert type(lin) is DecodeLinear
    x = torch.randn(2, rows, 160).to(dtype)
    out = lin(x)
    assert "_cpu_packed" in lin.__dict__  # the packed path ran
    assert out.shape == (2, rows, 96) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)


def test_a_weight_written_in_place_is_packed_again():
    lin = frozen_linear(32, 48, False, torch.float32)
    x = torch.randn(4, 48)
    lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_gradients_take_f_linear():
    """An input that wants a gradient runs F.linear (the packed op has no backward)."""
    lin = frozen_linear(32, 48, True, torch.float32)
    x = torch.randn(4, 48, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(4, 48))
    assert "_cpu_packed" not in lin.__dict__


def test_trainable_linears_are_left_alone():
    lin = nn.Linear(8, 8)
    use_cpu_packing(lin)
    assert type(lin) is nn.Linear


def test_unpacking_drops_the_copies():
    lin = frozen_linear(32, 48, False, torch.float32)
    lin(torch.randn(1, 48))
    use_cpu_packing(lin, on=False)
    assert type(lin) is nn.Linear and "_cpu_packed" not in lin.__dict__


def test_a_product_onednn_refuses_falls_back_to_linear(monkeypatch):
    """Where oneDNN cannot pack (some CPU or dtype it has no kernel for), F.linear, with a warning."""
    lin = frozen_linear(32, 48, True, torch.float32)

    def refuse(*args):
        raise RuntimeError("could not create a primitive descriptor")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    x = torch.randn(3, 48)
    with pytest.warns(UserWarning, match="oneDNN refused"):
        out = lin(x)
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    assert lin.__dict__["_cpu_packed"] is False
    torch.testing.assert_close(lin(x), out, rtol=0, atol=0)  # (no second try, no second warning)
