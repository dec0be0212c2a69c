#!/usr/bin/env bash
# Installs everything the test suite needs; the README's test command and
# .ci/run both run `tests/setup.sh && python -m pytest -q`.
#   - the project with its test extra (pyproject.toml: pytest, hypothesis, the
#     adapters' frameworks, deepspeed, bitsandbytes, matplotlib);
#   - ColossalAI 0.5.0 without its dependencies: it pins torch<=2.5.1 and
#     transformers==4.51.3 (its setup.py/requirements), so a resolver would
#     replace the installed torch. Importing its booster and plugins needs only
#     galore_torch besides the test extra. BUILD_EXT=0 (its setup.py default):
#     no kernel is compiled;
#   - litgpt 0.4.13 without its dependencies (below), whose own model class
#     `llmem estimate --model litgpt:NAME` traces;
#   - the fine-tuning frameworks whose own config loaders check `--config`'s
#     mapping (tests/recipes/), without their dependencies, to .frameworks/
#     (not the project's environment: omegaconf needs antlr4 4.9, and Axolotl
#     and LLaMA-Factory pin other transformers); the probes put it on
#     PYTHONPATH in a subprocess; TRL's trainers run live there too, with
#     datasets 5.2.0 and what it imports (trl 1.16.0 and datasets METADATA:
#     dill<0.4.2, multiprocess<0.70.20, pandas, pyarrow>=24, xxhash);
#   - the stub CUDA device (stubcuda/setup.sh: a second venv with torch's CUDA
#     build, installed --no-deps, and the C stand-ins);
#   - Debian's chromium, which renders the --html report headless and offline
#     (tests/cli/test_html.py), where apt-get can install it (root, or sudo
#     without a password); elsewhere those tests skip, unless LLMEM_REQUIRE_BROWSER is set.
# Usage: tests/setup.sh [PYTHON]   (default: python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

"${PIP[@]}" -e ".[test]"
BUILD_EXT=0 "${PIP[@]}" --no-deps "colossalai==0.5.0" "galore_torch==1.0"
# litgpt 0.4.13 without its dependencies: it pins lightning==2.4.0.dev20240728 and numpy<2
# (its METADATA), which a resolver would force; what its model, LoRA and utils modules import
# (Lightning, transformers' tokenizers and hub client, PyYAML) the test extra brings.
"${PIP[@]}" --no-deps "litgpt==0.4.13"
rm -rf .frameworks
# torchtune's package import also loads its tokenizers (sentencepiece, tiktoken).
"${PIP[@]}" --no-deps --target .frameworks "torchtune==0.6.1" "omegaconf==2.3.0" "antlr4-python3-runtime==4.9.3" \
    "sentencepiece==0.2.1" "tiktoken==0.12.0" \
    "axolotl==0.19.0" "addict==2.4.0" "llamafactory==0.9.5" "trl==1.16.0" \
    "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "pandas==3.1.1" "pyarrow==26.0.1" "xxhash==4.1.0"
stubcuda/setup.sh "$PY"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } \
        || echo "tests/setup.sh: chromium not installed; the --html report tests will skip" >&2
fi
