#!/usr/bin/env bash
# Train the reference EAGLE-3 drafter with draftsman's own pipeline (run on one GPU):
#   1. prepare-data: the reference target writes the answers to ShareGPT / GPTeacher / GSM8K-train
#      prompts (self-distillation; resumable, so a time-boxed run keeps what it wrote);
#   2. train: EAGLE-3 training-time test, default aux layers [2, L//2, L-3], full 8k vocabulary;
#   3. eval-drafter: teacher-forced acceptance on held-out target-written answers.
#
#   bash recipes/reference/train_drafter.sh TARGET_DIR PROMPTS.jsonl OUT_DIR
#
# PROMPTS.jsonl comes from make_drafter_prompts.py. Time boxes (seconds, env): PREP_SECONDS
# (default 240) and TRAIN_SECONDS (default 300): on expiry each phase stops cleanly (SIGINT) and
# the run goes on with what was written.
set -uo pipefail
TARGET=$1; PROMPTS=$2; OUT=$3
PY=${PYTHON:-python3}
mkdir -p "$OUT"
DS="$PY -m draftsman.cli"
timeout -s INT "${PREP_SECONDS:-240}" $DS prepare-data --target "$TARGET" --input "$PROMPTS" \
    --output "$OUT/data.jsonl" --max-new-tokens 256 --batch-size "${PREP_BATCH:-512}"
echo "prepare-data exit $?; $(wc -l < "$OUT/data.jsonl") conversations"
head -n -500 "$OUT/data.jsonl" > "$OUT/train.jsonl"
tail -n 500 "$OUT/data.jsonl" > "$OUT/heldout.jsonl"
timeout -s INT "${TRAIN_SECONDS:-300}" $DS train --target "$TARGET" --data "$OUT/train.jsonl" \
    --out "$OUT/drafter" --epochs "${EPOCHS:-3}" --batch-size 64 --micro-batch-size 32 --max-length 1024 \
    --lr "${LR:-5e-4}" --ttt-steps 7 --eval-data "$OUT/heldout.jsonl" --eval-samples 200 --eval-every 100 \
    --no-progress
echo "train exit $?"
if [ ! -f "$OUT/drafter/model.safetensors" ]; then  # time box hit: use the last checkpoint
    last=$(ls -d "$OUT"/drafter/checkpoints/step-* | sort | tail -n 1)
    echo "using checkpoint $last"
    mkdir -p "$OUT/final" && cp "$last"/config.json "$last"/model.safetensors "$OUT/final/"
else
    mkdir -p "$OUT/final" && cp "$OUT"/drafter/config.json "$OUT"/drafter/model.safetensors "$OUT/final/"
fi
$DS eval-drafter --target "$TARGET" --drafter "$OUT/final" --data "$OUT/heldout.jsonl" --num-samples 300 \
    --ttt-steps 7 --json | tail -n 1 > "$OUT/eval.json"
cat "$OUT/eval.json"
