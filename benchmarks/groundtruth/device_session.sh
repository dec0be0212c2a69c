#!/usr/bin/env bash
# One call of the device tool: record the machine, install the project and the
# carried wheels, then run ground-truth cases until a deadline.
#
#   benchmarks/groundtruth/device_session.sh OUT_DIR DEADLINE_S CASE_ID...
#   benchmarks/groundtruth/device_session.sh OUT_DIR DEADLINE_S @IDS_FILE   (one id per line)
#
# Run from the repository root on the GPU machine, with the wheels of
# benchmarks/groundtruth/README.md ("Wheels") in .whl/ (carried). Rows go to
# OUT_DIR/rows.jsonl as each case ends, so a run stopped at the deadline keeps
# the cases it finished; OUT_DIR/env.txt records the machine and versions.
set -u
out=$1
deadline=$2
shift 2
if [ $# -eq 1 ] && [ "${1#@}" != "$1" ]; then
    set -- $(grep -v "^#" "${1#@}")
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 \
    || { echo "project install failed"; tail -20 "$out/install.txt"; exit 1; }
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__)'
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|accelerate|bitsandbytes|trl|liger|triton|nvidia-ml-py) '
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
timeout "$deadline" python3 -m benchmarks.groundtruth.run --device cuda --out "$out/rows.jsonl" --timeout-s 150 --only "$@"
echo "run exit: $?"
