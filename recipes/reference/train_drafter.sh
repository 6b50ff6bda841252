#!/usr/bin/env bash
# Train the reference EAGLE-3 drafter with draftsman's own pipeline, on one GPU:
#   1. prompts: first user turns of ../shared/data/train, shortest first (make_drafter_prompts.py);
#   2. prepare-data: the reference target writes every answer (greedy, <= 256 tokens);
#   3. train, in the two stages the recorded run took: 365 steps of a 3000-step schedule, then a
#      fresh 2000-step schedule initialised from them (--init); default aux layers, full 8k
#      vocabulary, TTT 7;
#   4. eval-drafter: teacher-forced acceptance on 500 held-out target-written conversations;
#   5. the drafter in bf16, as the package ships it.
#
#   bash recipes/reference/train_drafter.sh TARGET_DIR OUT_DIR [DATA_DIR]
#
# DATA_DIR defaults to ../shared/data/train. NUM_RECORDS (default 28672: the length-ordered prompts
# the recorded run's time-boxed prepare-data reached) bounds the data; STAGE1_STEPS (365) and
# STEPS (2000) the two training stages.
set -euo pipefail
TARGET=$1; OUT=$2; DATA=${3:-../shared/data/train}
PY=${PYTHON:-python3}
DS="$PY -m draftsman.cli"
HERE=$(dirname "$0")
mkdir -p "$OUT"
$PY "$HERE/make_drafter_prompts.py" --data "$DATA" --out "$OUT/prompts.jsonl" --per-source 100000 --order length
$DS prepare-data --target "$TARGET" --input "$OUT/prompts.jsonl" --output "$OUT/data.jsonl" \
    --num-samples "${NUM_RECORDS:-28672}" --max-new-tokens 256 --batch-size 4096
shuf --random-source=<(yes) "$OUT/data.jsonl" > "$OUT/shuf.jsonl"
head -n -500 "$OUT/shuf.jsonl" > "$OUT/train.jsonl"
tail -n 500 "$OUT/shuf.jsonl" > "$OUT/heldout.jsonl"
COMMON=(--target "$TARGET" --data "$OUT/train.jsonl" --batch-size 64 --micro-batch-size 32 --max-length 768
        --lr 8e-4 --no-progress)
$DS train "${COMMON[@]}" --out "$OUT/stage1" --max-steps 3000 --stop-after "${STAGE1_STEPS:-365}" --save-every 100
stage1=$(ls -d "$OUT"/stage1/checkpoints/step-* | sort | tail -n 1)
$DS train "${COMMON[@]}" --out "$OUT/stage2" --init "$stage1" --max-steps "${STEPS:-2000}" --save-every 250
$DS eval-drafter --target "$TARGET" --drafter "$OUT/stage2" --data "$OUT/heldout.jsonl" --num-samples 300 \
    --ttt-steps 7 --json | tail -n 1 > "$OUT/eval.json"
$PY "$HERE/publish_drafter.py" "$OUT/stage2" "$OUT/drafter" --eval "$OUT/eval.json"
cat "$OUT/eval.json"
