"""Whole-process wall time of ``llmem`` commands, as a user feels them (imports included).

Each command runs ``--repeat`` times (default 5) as a fresh ``python -m llmem_plugin.cli``
process; the median is the figure. The trace cache is off (``LLMEM_NO_CACHE=1``) except for the
rows marked ``warm cache``, which run once to fill a fresh cache folder and then are timed.
Run on an idle machine: the figures are for the machine they were taken on.

    python benchmarks/process_speed.py                 # writes benchmarks/results/process-speed-<date>.json
    python benchmarks/process_speed.py --repeat 3 --only 8b
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_8B = ["estimate", "--model", "llama-3.1-8b", "--seq-len", "2048", "--precision", "bf16", "--gpu", "h100-sxm"]
# (name, argv, cache): the table (issue 46) where a command runs in seconds.
CASES = [
    ("8b", _8B, False),
    ("8b-full", [*_8B, "--full"], False),
    ("8b-second-run", _8B, True),
    ("70b-fast", ["estimate", "--model", "llama-3.1-70b", "--precision", "bf16", "--fast", "--gpu", "h100-sxm"],
     False),
    ("8b-grad-accum-1", [*_8B, "--grad-accum", "1"], False),
    ("8b-grad-accum-32", [*_8B, "--grad-accum", "32"], False),
    ("help", ["--help"], False),
]


def _time(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmem_plugin.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"llmem {' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds


def _commit() -> str | None:
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's benchmarks package
    from benchmarks.groundtruth.provenance import checkout_commit

    return checkout_commit(ROOT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", nargs="*", help="case names (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for name, cmd, warm in CASES:
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "LLMEM_CACHE_DIR": cache, "LLMEM_NO_CACHE": "0" if warm else "1"}
            if warm:
                _time(cmd, env)  # fills the cache
            times = [_time(cmd, env) for _ in range(args.repeat)]
        rows.append({"name": name, "argv": cmd, "warm_cache": warm, "median_s": round(statistics.median(times), 2),
                     "times_s": [round(t, 2) for t in times]})
        print(f"{name:20s} median {rows[-1]['median_s']:7.2f} s  {rows[-1]['times_s']}", flush=True)
    import torch
    import transformers

    out = {"date": datetime.date.today().isoformat(), "commit": _commit(),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__},
           "repeat": args.repeat, "rows": rows}
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"process-speed-{out['date']}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
