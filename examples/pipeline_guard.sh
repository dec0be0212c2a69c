#!/usr/bin/env bash
# A job script that plans before it trains: `llmem plan` exits 0 when a method
# fits (and prints it), 3 when none does (the memory report and the changes
# that would fit are printed), 2 for bad input. The job stops unless it fits.
#
#   MODEL=llama-3.1-8b GPUS=8 GPU=h100-sxm SEQ_LEN=4096 examples/pipeline_guard.sh
#   PLAN=plan.json ... keeps the plan's JSON in plan.json
set -uo pipefail

MODEL=${MODEL:-llama-3.1-8b}
GPUS=${GPUS:-8}
NODES=${NODES:-1}
GPU=${GPU:-h100-sxm}
GPU_MEMORY=${GPU_MEMORY:-}          # optional capacity override, e.g. 20GiB
SEQ_LEN=${SEQ_LEN:-2048}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
# Where the plan's JSON goes. Unset: a temporary file, removed on exit, so the
# script leaves nothing behind in the directory it was started from.
if [ -z "${PLAN:-}" ]; then
    PLAN="$(mktemp "${TMPDIR:-/tmp}/llmem-plan.XXXXXX.json")"
    trap 'rm -f "$PLAN"' EXIT
fi

llmem plan --model "$MODEL" --gpus "$GPUS" --nodes "$NODES" --gpu "$GPU" ${GPU_MEMORY:+--gpu-memory "$GPU_MEMORY"} \
    --seq-len "$SEQ_LEN" --global-batch "$GLOBAL_BATCH" --json > "$PLAN" || exit

# It fits: read the choice and hand it to the launcher.
python - "$PLAN" <<'PY'
import json, sys
choice = json.load(open(sys.argv[1]))["choice"]
print(f"method={choice['method']} tp={choice['tp']} micro_batch={choice['micro_batch']} "
      f"grad_accum={choice['grad_accum']} grad_checkpointing={choice['grad_checkpointing']}")
PY
# ... launch the training job with those settings here.
