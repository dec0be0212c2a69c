"""Whole-process wall time of ``llmem`` commands, as a user feels them (imports included).

Each command runs ``--repeat`` times (default 5) as a fresh ``python -m llmem_plugin.cli``
process; the median is the figure. The caches are off (``LLMEM_NO_CACHE=1``) except where a row's
``cache`` says "answer" (the same command ran once before in a fresh cache folder: the result cache
answers) or "trace" (the command without ``--json`` ran once before: its traces are kept, the answer
is not). The plans and ``--method all`` run at most once (minutes each).
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
_TINY = str(Path(__file__).resolve().parent / "tiny-llama-2l.json")
# (name, argv, cache, repeat): the table (issue 46). cache: "off" (LLMEM_NO_CACHE=1), "answer" (the same
# command run once before: the result cache answers), "trace" (the command without --json run once before: the
# trace cache holds its traces, the result cache misses). repeat: None for --repeat, else at most this many (the
# plans and --method all take minutes per run).
CASES = [
    ("8b", _8B, "off", None),
    ("8b-full", [*_8B, "--full"], "off", None),
    ("8b-second-run", _8B, "answer", None),
    ("8b-trace-cache-hit", [*_8B, "--json"], "trace", None),
    ("70b-fast", ["estimate", "--model", "llama-3.1-70b", "--precision", "bf16", "--fast", "--gpu", "h100-sxm"],
     "off", None),
    ("8b-grad-accum-1", [*_8B, "--grad-accum", "1"], "off", None),
    ("8b-grad-accum-32", [*_8B, "--grad-accum", "32"], "off", None),
    ("tiny-plan-margin-0.99", ["plan", "--model", _TINY, "--gpus", "2", "--seq-len", "128", "--no-verify",
                               "--margin", "0.99", "--gpu", "h100-sxm"], "off", None),
    ("70b-plan-64", ["plan", "--model", "llama-3.1-70b", "--gpus", "64", "--nodes", "8", "--gpu", "h100-sxm"],
     "off", 1),
    ("405b-plan-512", ["plan", "--model", "llama-3.1-405b", "--gpus", "512", "--nodes", "64", "--gpu", "h100-sxm"],
     "off", 1),
    ("8b-method-all", ["estimate", "--model", "llama-3.1-8b", "--grad-checkpointing", "--method", "all", "--gpus",
                       "8", "--gpu", "h100-sxm"], "off", 1),
    ("help", ["--help"], "off", None),
    # `llmem max` (issue 48): its cost against full 8B traces on the same GPU (target: at most 3 of them).
    ("max-8b", ["max", "batch-size", "--model", "llama-3.1-8b", "--gpu", "a100-80gb"], "off", None),
    ("max-8b-lora", ["max", "batch-size", "--model", "llama-3.1-8b", "--lora-rank", "16", "--gpu", "a100-80gb"],
     "off", None),
    ("8b-full-a100", ["estimate", "--model", "llama-3.1-8b", "--full", "--gpu", "a100-80gb"], "off", None),
    ("8b-lora-full-a100", ["estimate", "--model", "llama-3.1-8b", "--lora-rank", "16", "--full", "--gpu",
                           "a100-80gb"], "off", None),
]


def _time(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmem_plugin.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"llmem {' '.join(argv)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds


def _is_answer(path: Path) -> bool:
    """Whether a cache entry is a kept answer (llmem_plugin.cli.resultcache.Answer), not a trace: its pickle
    names that class first, after the entry's magic and key lines (llmem_plugin.trace.cache)."""
    with open(path, "rb") as f:
        f.readline()
        f.readline()
        return b"llmem_plugin.cli.resultcache" in f.read(300)


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
    for name, cmd, cache, most in CASES:
        if args.only and name not in args.only:
            continue
        repeat = args.repeat if most is None else min(args.repeat, most)
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "LLMEM_CACHE_DIR": folder, "LLMEM_NO_CACHE": "1" if cache == "off" else "0"}
            if cache != "off":  # fills the cache: the command itself, or its run without --json
                _time(cmd if cache == "answer" else [a for a in cmd if a != "--json"], env)
            times = []
            for _ in range(repeat):
                if cache == "trace":  # each timed run must miss the result cache again
                    for answer in Path(folder).glob("traces/*/*.pkl"):
                        if _is_answer(answer):
                            answer.unlink()
                times.append(_time(cmd, env))
        rows.append({"name": name, "argv": cmd, "cache": cache, "repeat": repeat,
                     "median_s": round(statistics.median(times), 2), "times_s": [round(t, 2) for t in times]})
        print(f"{name:22s} median {rows[-1]['median_s']:7.2f} s  {rows[-1]['times_s']}", flush=True)
    import torch
    import transformers

    out = {"date": datetime.date.today().isoformat(), "commit": _commit(),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__},
           "rows": rows}
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"process-speed-{out['date']}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
