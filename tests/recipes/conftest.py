"""Run a framework's own config loader in a subprocess (tests/recipes/probes/).

The frameworks (torchtune 0.6.1, TRL 1.16.0, Axolotl 0.19.0, ...) are
installed without their dependencies to .frameworks/ by tests/setup.sh, away
from the project's environment: their pins (omegaconf's antlr4 4.9, Axolotl's
transformers) would otherwise replace what the project runs with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ROOT / ".frameworks"
PROBES = Path(__file__).parent / "probes"
EXAMPLES = ROOT / "examples" / "recipes"


def run_probe(script: str, *args: str, env: dict | None = None) -> dict:
    """The JSON a probe prints about a config, from the framework's own code."""
    if not FRAMEWORKS.is_dir():
        if os.environ.get("LLMEM_REQUIRE_FRAMEWORKS"):
            pytest.fail(f"{FRAMEWORKS} is missing: run tests/setup.sh")
        pytest.skip("the frameworks' own loaders are not installed (tests/setup.sh installs them to .frameworks/)")
    full_env = {**os.environ, "PYTHONPATH": str(FRAMEWORKS), **(env or {})}
    done = subprocess.run([sys.executable, str(PROBES / script), *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
