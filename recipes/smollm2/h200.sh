#!/usr/bin/env bash
# SmolLM2-135M-Instruct's EAGLE-3 drafter on one H200, with draftsman's own pipeline, in stages
# that each fit a device call (STAGES picks them; each runs under its own deadline, in seconds):
#   convert  the GGUF (sent ahead in parts into $W: recipes/smollm2/README.md) -> $W/target (fp32)
#   data     prepare-data: the target answers the prompts greedily (<= 256 tokens), DATA_S seconds;
#            resumable, so a second `data` stage continues where the first stopped
#   sampled  prepare-data on a second prompt file (SAMPLED_PROMPTS, if given), answers sampled at
#            temperature 1 (top-p 1, seed SEED), SAMPLED_S seconds, into data_sampled.jsonl; the
#            split then pools both data files before it shuffles and holds out
#   train    500 conversations held out; train (draft vocabulary 16384, TTT 7, eval every EVAL_EVERY
#            steps: the tau curve) for TRAIN_S seconds; a rerun resumes from its last checkpoint
#   collect  eval-drafter on 300 held-out conversations; the drafter in bf16, split into parts
#            for the trip back
#   pair     benchmarks/reference_pair.py with this pair (tau, acceptance per position, speed-up
#            over plain: MT-bench, HumanEval, GSM8K, T=0 and 1)
#   e2e      benchmarks/h200_e2e.py with this pair: draftsman plain and speculative against HF
#            generate on the same weights (not run yet)
#
#   STAGES="convert data" bash recipes/smollm2/h200.sh      (on the GPU machine, repository root)
#
# Inputs in .carry/smol2: smollm2.gguf.part-ab, prompts.jsonl.gz (make_drafter_prompts.py of the
# reference recipe), the gguf wheel; PROMPTS / SAMPLED_PROMPTS name other prompt files (the
# sampled-share run: alternate prompts, recipes/smollm2/README.md). Work in $W (default /tmp/smol:
# kept while the machine is held).
set -u
W=${W:-/tmp/smol}
OUT=${OUT:-$W/out}  # what comes back: logs.tgz, drafter.tar.part-*, pair_h200.json, e2e_h200.json (<= 8 files a call)
L=$W/logs
mkdir -p "$W" "$OUT" "$L"
export PYTHONPATH=$PWD/src:/tmp/site:${PYTHONPATH:-}
DS="python3 -m draftsman.cli"
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
run() {  # run NAME SECONDS CMD...: under a deadline (SIGTERM: the trainer checkpoints and stops)
  local name=$1 limit=$2; shift 2
  if [[ " ${STAGES:-convert data sampled train collect pair e2e} " != *" ${name%%_*} "* ]]; then return; fi
  local t=$(date +%s)
  if declare -F "$1" > /dev/null; then "$@" >> "$L/$name.log" 2>&1  # (short shell steps: no deadline)
  else timeout -k 60 "$limit" "$@" >> "$L/$name.log" 2>&1; fi
  echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$L/steps.txt"
}

convert() {
  for f in .carry/smol*/smollm2.gguf.part-*; do cp "$f" "$W/"; done
  cat "$W"/smollm2.gguf.part-* > "$W/smollm2.gguf"
  echo "$GGUF_SHA256  $W/smollm2.gguf" | sha256sum -c - || return 1
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/smol2/gguf-*.whl
  $DS convert --gguf "$W/smollm2.gguf" --out "$W/target" --json
  gunzip -c "${PROMPTS:-.carry/smol2/prompts.jsonl.gz}" > "$W/prompts.jsonl"
  if [ -n "${SAMPLED_PROMPTS:-}" ]; then gunzip -c "$SAMPLED_PROMPTS" > "$W/prompts_sampled.jsonl"; fi
}
run convert 300 convert

run data "${DATA_S:-300}" $DS prepare-data --target "$W/target" --input "$W/prompts.jsonl" \
  --output "$W/data.jsonl" --max-new-tokens 256 --batch-size "${DATA_BATCH:-2048}" ${DATA_ARGS:-}
if [ -f "$W/prompts_sampled.jsonl" ]; then
  run sampled "${SAMPLED_S:-300}" $DS prepare-data --target "$W/target" --input "$W/prompts_sampled.jsonl" \
    --output "$W/data_sampled.jsonl" --max-new-tokens 256 --batch-size "${DATA_BATCH:-2048}" \
    --temperature 1 --top-p 1 --seed "${SEED:-0}"
fi

split_data() {
  [ -f "$W/heldout.jsonl" ] && return 0
  cat "$W/data.jsonl" $(ls "$W/data_sampled.jsonl" 2>/dev/null) | shuf --random-source=<(yes) > "$W/shuf.jsonl"
  head -n -500 "$W/shuf.jsonl" > "$W/train.jsonl"
  tail -n 500 "$W/shuf.jsonl" > "$W/heldout.jsonl"
  wc -l "$W/train.jsonl" "$W/heldout.jsonl"
}
run train_split 60 split_data
resume=""
if ls -d "$W"/drafter/checkpoints/step-* > /dev/null 2>&1; then resume=--resume; fi
run train "${TRAIN_S:-400}" $DS train --target "$W/target" --data "$W/train.jsonl" --out "$W/drafter" \
  --eval-data "$W/heldout.jsonl" --eval-samples 128 --eval-every "${EVAL_EVERY:-100}" --save-every 100 \
  --draft-vocab-size 16384 --batch-size 64 --micro-batch-size 32 --max-length 1024 --lr "${LR:-5e-4}" \
  --max-steps "${STEPS:-3000}" --no-progress $resume ${TRAIN_ARGS:-}
collect() {
  local d=$W/drafter
  [ -f "$d/model.safetensors" ] || d=$(ls -d "$W"/drafter/checkpoints/step-* | sort | tail -n 1)
  $DS eval-drafter --target "$W/target" --drafter "$d" --data "$W/heldout.jsonl" --num-samples 300 \
    --ttt-steps 7 --json | tail -n 1 > "$L/eval.json"
  python3 recipes/reference/publish_drafter.py "$d" "$W/published" --eval "$L/eval.json"
  tar cf - -C "$W" published | split -b 15000000 - "$OUT/drafter.tar.part-"
}
run collect 200 collect
run pair "${PAIR_S:-300}" python3 benchmarks/reference_pair.py --device cuda --target "$W/target" \
  --drafter "$W/published" --datasets "${PAIR_SETS:-mt-bench,humaneval,gsm8k}" --temperatures 0,1 \
  --num-prompts "${PAIR_PROMPTS:-20}" --out "$OUT/pair_h200.json"
run e2e "${E2E_S:-300}" python3 benchmarks/h200_e2e.py --target "$W/target" --drafter "$W/published" \
  --num-prompts "${PAIR_PROMPTS:-10}" --datasets "${PAIR_SETS:-mt-bench,humaneval,gsm8k}" --out "$OUT/e2e_h200.json"
cp "$W"/drafter/*log.jsonl "$L/" 2>/dev/null
[ -f "$W/data.jsonl" ] && wc -l "$W"/data*.jsonl "$W/train.jsonl" "$W/heldout.jsonl" > "$L/data_lines.txt" 2>/dev/null
[ -f "$W/heldout.jsonl" ] && cp "$W/heldout.jsonl" "$L/"
tar czf "$OUT/logs.tgz" -C "$W" logs
cat "$L/steps.txt"
