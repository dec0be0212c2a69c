"""What --snapshot and --html add to an estimate: wall time and file sizes.

    python -m benchmarks.snapshot_cost [--model llama-3.1-8b] [--repeats 3] [--out FILE.json]

Two measurements, the trace and result caches off (``LLMEM_NO_CACHE=1``):

* the command as a user runs it: ``llmem estimate ...`` against the same
  command with ``--snapshot FILE --html FILE``, each a fresh process, in
  alternating order (the wall time the target is about: at most 10% more);
* in one process, after a warm-up: the estimate, then the parts the views add
  (keeping the trace, the snapshot written as a pickle, the report as HTML).

The HTML file must stay under 5 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _one(model: str, wl: dict, folder: Path) -> dict:
    from llmem_plugin.cli.html import estimate_page, write_page
    from llmem_plugin.estimate import estimate
    from llmem_plugin.snapshot.predict import snapshot_of, write_snapshot

    t0 = time.perf_counter()
    estimate(model, **wl)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    est = estimate(model, keep_trace=True, **wl)
    traced = time.perf_counter() - t0
    t1 = time.perf_counter()
    snap = snapshot_of(est)
    snap_path = write_snapshot(snap, folder / "pred.pickle")
    t2 = time.perf_counter()
    html_path = write_page(estimate_page(est, snap), folder / "report.html")
    t3 = time.perf_counter()
    return {"plain_s": plain, "with_views_s": traced + (t3 - t1), "estimate_kept_s": traced,
            "snapshot_s": t2 - t1, "html_s": t3 - t2, "entries": len(snap["device_traces"][0]),
            "snapshot_bytes": snap_path.stat().st_size, "html_bytes": html_path.stat().st_size,
            "trace_path": est.trace_path}


def _cli(args: list[str]) -> float:
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llmem_plugin.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "LLMEM_NO_CACHE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ["LLMEM_NO_CACHE"] = "1"
    wl = {"seq_len": args.seq_len, "micro_batch_size": 1, "precision": "bf16-mixed", "lora": {"rank": 16}}
    runs, cli = [], {"plain": [], "views": []}
    base = ["estimate", "--model", args.model, "--seq-len", str(args.seq_len), "--precision", "bf16-mixed",
            "--lora-rank", "16"]
    with tempfile.TemporaryDirectory() as tmp:
        views_args = base + ["--snapshot", f"{tmp}/cli.pickle", "--html", f"{tmp}/cli.html"]
        for i in range(args.repeats):
            for kind in (("plain", "views") if i % 2 == 0 else ("views", "plain")):
                cli[kind].append(_cli(base if kind == "plain" else views_args))
            print(json.dumps({k: v[-1] for k, v in cli.items()}), file=sys.stderr)
        _one(args.model, wl, Path(tmp))  # warm-up: imports, model classes
        for _ in range(args.repeats):
            runs.append(_one(args.model, wl, Path(tmp)))
            print(json.dumps(runs[-1]), file=sys.stderr)
    plain = statistics.median(cli["plain"])
    views = statistics.median(cli["views"])
    import torch
    import transformers

    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "model": args.model, "workload": wl, "cli_s": cli, "in_process": runs,
        "median_cli_plain_s": plain, "median_cli_with_views_s": views, "added_fraction": views / plain - 1,
        "median_in_process_estimate_s": statistics.median(r["plain_s"] for r in runs),
        "median_in_process_views_s": statistics.median(r["snapshot_s"] + r["html_s"] for r in runs),
        "html_bytes": max(r["html_bytes"] for r in runs), "snapshot_bytes": max(r["snapshot_bytes"] for r in runs),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
