#!/usr/bin/env bash
# Every H200 benchmark of issue 10 in one device call, each under its own deadline, results in
# $OUT (default benchmarks/results/h200-run): GPU tests first, then the figures of h200.json.
#   bash benchmarks/run_h200.sh                        (on the GPU machine, from the repository root)
#   STEPS="gpu_tests decode_8b" BUDGET=540 bash benchmarks/run_h200.sh   (only those steps, cut to
#                 fit 540 s in all: every step together takes longer than one 10-minute device call)
set -u
OUT=${OUT:-benchmarks/results/h200-run}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
H=$OUT/h200.json
# Compile caches across device calls (each call gets a fresh machine, and compiling the 8B step
# took 60-116 s per arm): a call starts from .carry/compile-cache.tgz when one is carried
# (`carry: [".carry/compile-cache.tgz"]`), and leaves the caches it ends with in
# $OUT/compile-cache.tgz: copy that to .carry/ for the next call.
CACHE=${CACHE:-/tmp/draftsman-compile-cache}
mkdir -p "$CACHE"
if [ -f .carry/compile-cache.tgz ]; then tar xzf .carry/compile-cache.tgz -C "$CACHE"; fi
export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TRITON_CACHE_DIR=$CACHE/triton
START=$(date +%s)
BUDGET=${BUDGET:-100000}  # seconds for the whole script (a device call allows 600): steps are cut to fit
step() {  # step NAME SECONDS CMD...: run with a deadline, log rc and wall time
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  local t=$(date +%s)
  local left=$(( BUDGET - (t - START) ))
  if [ "$left" -lt 30 ]; then echo "$name skipped: budget spent" | tee -a "$OUT/steps.txt"; return; fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$OUT/steps.txt"
}
# (only the files with GPU tests: the GPU machine has no server dependencies)
step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py tests/test_kernels.py tests/test_load_gpu.py
step gpu_tests_prefill 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py -k prefill
step gpu_tests_decode 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "fused_decode or greedy_argmax"
step decode_8b 240 python3 benchmarks/h200_decode.py --arms graph_compiled,graph_compiled_unchained,graph_eager \
  --profile --out "$OUT/decode_8b.json" --h200-json "$H"
step decode_8b_mlp 300 python3 benchmarks/h200_decode.py \
  --arms graph_compiled,graph_compiled_gu_none,graph_compiled_torchargmax \
  --out "$OUT/decode_8b_mlp.json" --h200-json "$H"
step gemv_fused 120 python3 benchmarks/h200_gemv.py --fused-only --out "$OUT/gemv_fused_8b.json"
step gemv 200 python3 benchmarks/h200_gemv.py --out "$OUT/gemv_8b.json"
step gemv_moonlight 200 python3 benchmarks/h200_moonlight_gemv.py --out "$OUT/gemv_moonlight.json"
step tree_attention 240 python3 benchmarks/h200_tree_attention.py --out "$OUT/tree_attention.json"
step graph_launch 120 python3 benchmarks/h200_graph_launch.py --out "$OUT/graph_launch.json"
step attention_diag 200 python3 benchmarks/h200_attention_diag.py --cache 705,4096 --used 256 --tokens 1,8,64 \
  --out "$OUT/attention_diag.json"
step attention_ncu 200 ncu --clock-control none --kernel-name regex:_decode_attention_kernel --launch-count 2 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 benchmarks/h200_attention_diag.py --tokens 64 --used 256
step batch 420 python3 benchmarks/h200_batch.py --out "$OUT/batch.json" --h200-json "$H"
step adaptive_overhead 150 python3 benchmarks/h200_adaptive_overhead.py --out "$OUT/adaptive_overhead.json"
step batch_steady 200 python3 benchmarks/h200_batch.py --steady --out "$OUT/batch_steady.json" --h200-json "$H"
step batch_eager_prefill 240 python3 benchmarks/h200_batch.py --eager-prefill --out "$OUT/batch_eager_prefill.json"
step rounds_8b 150 python3 benchmarks/h200_decode.py --arms rounds --batches 1,4,16,64 \
  --out "$OUT/rounds_8b.json" --h200-json "$H"
step gpu_tests_moe 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py -k "moonlight or moe"
step decode_moonlight 360 python3 benchmarks/h200_decode.py --geometry moonlight-16b-a3b \
  --arms graph_compiled,graph_compiled_sdpa_torchmoe --profile --out "$OUT/decode_moonlight.json" --h200-json "$H"
step decode_moonlight_default 300 python3 benchmarks/h200_decode.py --geometry moonlight-16b-a3b \
  --arms graph_compiled,graph_compiled_noabsorbcombine --profile --out "$OUT/decode_moonlight_default.json"
step rounds_moonlight 200 python3 benchmarks/h200_decode.py --geometry moonlight-16b-a3b --arms rounds \
  --out "$OUT/rounds_moonlight.json" --h200-json "$H"
step rounds_8b_compiled 500 python3 benchmarks/h200_decode.py --arms rounds --compile-rounds \
  --round-specs tree64_s4,tree64_s3,tree64 --out "$OUT/rounds_8b_compiled.json"
step round_floor 120 python3 benchmarks/h200_round_floor.py --out "$OUT/round_floor.json"
step rounds_8b_profile 300 python3 benchmarks/h200_decode.py --arms rounds --compile-rounds --round-specs tree64_s3 \
  --profile --out "$OUT/rounds_8b_profile.json"
step decode_8b_autotune 500 python3 benchmarks/h200_decode.py --arms graph_compiled_autotune \
  --out "$OUT/decode_8b_autotune.json" --h200-json "$H"
# (E2E_ARGS: e.g. "--datasets gsm8k"; HF generate takes 2-3 s a prompt, all six runs ~300 s)
step e2e 300 python3 benchmarks/h200_e2e.py --num-prompts 5 ${E2E_ARGS:-} --out "$OUT/e2e.json"
step load 200 python3 benchmarks/h200_load.py --out "$OUT/load_8b.json"
# issue 8's single-GPU baseline (carry .carry/drafter/data.jsonl.gz: the reference target's conversations,
# e.g. `draftsman prepare-data --target src/draftsman/assets/reference-target --input <512 GSM8K train
# records> --output data.jsonl --max-new-tokens 256`, gzipped); TRAIN_STEPS, TAU_PROMPTS shorten it
if [ -f .carry/drafter/data.jsonl.gz ]; then gunzip -c .carry/drafter/data.jsonl.gz > /tmp/train.jsonl; fi
step train_1x 300 python3 benchmarks/train_scaling.py --data /tmp/train.jsonl --nproc 1 \
  --steps "${TRAIN_STEPS:-30}" --tau-prompts "${TAU_PROMPTS:-10}" --out "$OUT/train_scaling_1x_h200.json"
# one archive of the logs: a device call brings back at most 8 files
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
tar czf "$OUT/compile-cache.tgz" -C "$CACHE" .
if [ "$(stat -c %s "$OUT/compile-cache.tgz")" -gt $((15 << 20)) ]; then  # a call brings back 16 MiB a file
  echo "compile-cache.tgz dropped: $(du -h "$OUT/compile-cache.tgz" | cut -f1)" | tee -a "$OUT/steps.txt"
  rm -f "$OUT/compile-cache.tgz"
fi
cat "$OUT/steps.txt" 2>/dev/null
