#!/usr/bin/env bash
# Build draftsman's reference target end to end: tokenizer, then the pretrained DeepSeek-V3.
#
#   bash recipes/reference/run_reference.sh [extra pretrain_target.py flags, e.g. --minutes 6]
#
# Environment (all optional):
#   REF_DATA       training JSONL folder             (default ../shared/data/train)
#   REF_OUT        output folder                     (default recipes/reference/out)
#   REF_TOKENIZER  tokenizer folder; trained there if it holds no tokenizer.json
#                  (default $REF_OUT/tokenizer)
#   PYTHON         interpreter                       (default python3)
# Outputs: $REF_TOKENIZER (tokenizer files) and $REF_OUT/target (HF checkpoint, bf16, shards
# < 12 MB, tokenizer files, generation_config.json, train_report.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
REF_DATA=${REF_DATA:-../shared/data/train}
REF_OUT=${REF_OUT:-recipes/reference/out}
REF_TOKENIZER=${REF_TOKENIZER:-$REF_OUT/tokenizer}

if [ ! -f "$REF_TOKENIZER/tokenizer.json" ]; then
    "$PYTHON" recipes/reference/train_tokenizer.py --data "$REF_DATA" --out "$REF_TOKENIZER"
else
    echo "tokenizer: using $REF_TOKENIZER"
fi
"$PYTHON" recipes/reference/pretrain_target.py --data "$REF_DATA" --tokenizer "$REF_TOKENIZER" \
    --out "$REF_OUT/target" "$@"
