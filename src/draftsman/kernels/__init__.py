"""Triton kernels for the GPU hot paths. Each has a PyTorch reference it is tested against
(tests run them in Triton's interpreter on CPU where Triton is installed, and on CUDA with -m gpu)."""

from __future__ import annotations

import importlib.util
import os

# Decided once, at import: forwards that torch.compile traces read it as a constant (the
# import machinery itself cannot be traced).
TRITON = os.environ.get("DRAFTSMAN_TRITON", "1") != "0" and importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton importable and not disabled (DRAFTSMAN_TRITON=0 when the process started)."""
    return TRITON
