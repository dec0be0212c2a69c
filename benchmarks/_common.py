"""What every benchmark script shares: one fresh process per case, and a
result file that records the machine, the versions and the commit."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment() -> dict:
    """Date, commit (``-dirty`` when the package differs from it) and machine."""
    import torch
    import transformers

    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=here).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--", "../llmem_plugin"], capture_output=True, text=True,
                      check=False, cwd=here).stdout.strip():
        commit += "-dirty"
    return {
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
    }


def run_cases(script: str, cases: list[dict], one: Callable[[dict], dict]) -> list[dict] | None:
    """In a case's own process (``script --case JSON``) print ``one(case)`` and
    return None; otherwise run every case in a fresh process and return
    their rows, printing each as it comes."""
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print(json.dumps(one(json.loads(sys.argv[2]))))
        return None
    rows = []
    for case in cases:
        out = subprocess.run([sys.executable, script, "--case", json.dumps(case)], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def write(name: str, record: dict, path: str | None = None) -> str:
    """Write ``record`` with the environment to ``results/<name>-<date>.json`` (or ``path``)."""
    env = environment()
    path = path or os.path.join(RESULTS, f"{name}-{env['date']}.json")
    with open(path, "w") as f:
        json.dump({**env, **record}, f, indent=1)
    print("wrote", path)
    return path
