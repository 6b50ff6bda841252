#!/usr/bin/env bash
# The issue-28 grid on a GPU in device calls of at most 10 minutes: the `-m gpu` tests of
# tests/test_graphs.py, the adaptive-overhead arms (OVERHEAD_BATCH, OVERHEAD_T), then one never_slower.py run per (set, T)
# cell while the call's budget lasts; every result under $OUT (default
# benchmarks/results/never-slower-gpu). From the repository root, on the GPU machine:
#   bash benchmarks/run_never_slower_gpu.sh                           (tests, overhead at batch 4, 3 T=0 cells)
#   TESTS=0 OVERHEAD=0 CELLS="mt-bench:1 gsm8k:1 humaneval:1" bash benchmarks/run_never_slower_gpu.sh
#   TARGET=DIR DRAFTER=DIR ...                                        (another pair: the real one)
# then, here: python benchmarks/never_slower.py --merge ns_*.json --out ... --plot ...
# (session 28 ran this grid as three calls on one warm H100: 494, 551 and 247 s).
set -u
OUT=${OUT:-benchmarks/results/never-slower-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
START=$(date +%s)
LIMIT=${LIMIT:-575}  # seconds for the whole script (a device call allows 600)
REPEATS=${REPEATS:-1}  # never_slower --repeats (timed runs per arm: batch-64 runs last ~0.1 s each)
PAIR=()
if [ -n "${TARGET:-}" ]; then PAIR=(--target "$TARGET" --drafter "$DRAFTER"); fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu_tests rc=$? $(( $(date +%s) - START ))s" >> "$OUT/steps.txt"
  tail -3 "$OUT/gpu_tests.log" >> "$OUT/steps.txt"
fi
if [ "${OVERHEAD:-1}" = 1 ]; then
  timeout 100 python3 benchmarks/h200_adaptive_overhead.py --device cuda --batch "${OVERHEAD_BATCH:-4}" \
    --temperature "${OVERHEAD_T:-0}" --out "$OUT/overhead_b${OVERHEAD_BATCH:-4}_t${OVERHEAD_T:-0}.json" \
    > "$OUT/overhead.log" 2>&1
  echo "overhead rc=$? $(( $(date +%s) - START ))s" >> "$OUT/steps.txt"
fi
for cell in ${CELLS:-mt-bench:0 gsm8k:0 humaneval:0}; do
  set_=${cell%%:*} t=${cell##*:}
  left=$(( LIMIT - ($(date +%s) - START) ))
  if [ "$left" -lt 60 ]; then echo "ns_${set_}_$t skipped: budget spent" >> "$OUT/steps.txt"; continue; fi
  began=$(date +%s)
  timeout "$left" python3 benchmarks/never_slower.py --device cuda "${PAIR[@]}" --datasets "$set_" --temperatures "$t" \
    --batch-sizes "${BATCH_SIZES:-1,4,16,64}" --num-prompts 64 --max-new-tokens 32 --warmup 64 --warmup-passes 3 \
    --repeats "$REPEATS" --out "$OUT/ns_${set_}_$t.json" > "$OUT/ns_${set_}_$t.log" 2>&1
  echo "ns_${set_}_$t rc=$? $(( $(date +%s) - began ))s" >> "$OUT/steps.txt"
done
# (a device call brings back at most 8 files: the logs travel as one archive)
touch "$OUT/steps.txt"
(cd "$OUT" && shopt -s nullglob && tar czf logs.tgz ./*.log gpu.txt && rm -f ./*.log gpu.txt)
cat "$OUT/steps.txt"
