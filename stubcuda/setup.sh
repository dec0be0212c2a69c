#!/usr/bin/env bash
# Build the stub CUDA device and its environment:
#   .stubvenv/      a second venv with torch 2.13.0's CUDA 13.0 build (installed
#                   --no-deps: no nvidia-* wheels), the project and the model
#                   libraries at the versions of the calling environment
#   stubcuda/build/ the stand-in CUDA libraries (stubcuda/build.py)
# Usage: stubcuda/setup.sh [PYTHON]   (PYTHON: the main environment's
# interpreter, default `python`; its transformers/peft/accelerate versions are
# copied so both environments run the same model code.)
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_PY="${1:-python}"
VENV=.stubvenv
TORCH_VERSION="${STUBCUDA_TORCH_VERSION:-2.13.0}"

version_of() {
    "$MAIN_PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

[ -x "$VENV/bin/python" ] || "$MAIN_PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# torch's CUDA build from PyPI. The machine's pip configuration offers a local
# +cpu wheel (find-links) and caps torch: bypass both for this one install.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('torch') == '$TORCH_VERSION'" 2>/dev/null; then
    env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
        "${PIP[@]}" --no-deps --index-url https://pypi.org/simple "torch==$TORCH_VERSION"
fi
# torch's own pure-Python dependencies (none of them pulls a torch).
"${PIP[@]}" typing_extensions filelock sympy networkx jinja2 fsspec numpy rich psutil pyyaml

# The model stack, pinned to the main environment's versions. transformers
# does not depend on torch; peft and accelerate do, so they go in --no-deps.
pin() { local v; v="$(version_of "$1")"; if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi; }
"${PIP[@]}" "$(pin transformers)"
"${PIP[@]}" --no-deps "$(pin peft)" "$(pin accelerate)" "$(pin safetensors)"
"${PIP[@]}" --no-deps -e .
# Lightning for the llmem-auto strategy's snapshots on the stub (tests/stub/test_snapshot.py); it and
# torchmetrics depend on torch, so --no-deps, with their pure-Python imports.
"${PIP[@]}" --no-deps "$(pin lightning)" "$(pin lightning-utilities)" "$(pin torchmetrics)"
"${PIP[@]}" packaging tqdm

# bitsandbytes' CUDA build before the stand-ins are built: build.py adds its library's imports to
# theirs, so that it loads here (its kernels launch into the stub and compute nothing, as torch's do).
"${PIP[@]}" --no-deps "bitsandbytes==0.50.2"
# torchao's NF4 (torchtune's QLoRA) is pure PyTorch ops; no dependencies of its own.
"${PIP[@]}" --no-deps "$(pin torchao)"
"$VENV/bin/python" stubcuda/build.py --python "$VENV/bin/python"
stubcuda/run python -c "import torch; assert torch.cuda.is_available(); print('stub CUDA device:', torch.cuda.get_device_name(0), torch.__version__)"
# ColossalAI for tests/stub/test_distributed.py (LowLevelZero on the stub), as .ci/run installs it: --no-deps, no kernels built; einops is the one more import it needs here.
BUILD_EXT=0 "${PIP[@]}" --no-deps "colossalai==0.5.0" "galore_torch==1.0" "$(pin einops)"
