"""Run the ground-truth matrix and append one JSON line per case.

From the repository root::

    python -m benchmarks.groundtruth.run --device cuda --out benchmarks/groundtruth/data/groundtruth-h100-80gb-DATE.jsonl
    python -m benchmarks.groundtruth.run --device cuda --out rows.jsonl --only llama-3.1-8b-bf16-s512-b1-sdpa
    python -m benchmarks.groundtruth.run --device cpu --out rows.jsonl
    python -m benchmarks.groundtruth.run --device stub --out benchmarks/groundtruth/data/stub-h100-DATE.jsonl
    python -m benchmarks.groundtruth.run --list

On CUDA every case runs in its own worker process (this module with the
hidden ``--worker`` flag), under ``--timeout-s``; the parent never touches the
GPU, so the workers' numbers include exactly one CUDA context. On the stub
device (``stubcuda``: torch's CUDA build with no GPU) the same worker runs
under ``stubcuda/run`` with the stub environment's interpreter
(:mod:`benchmarks.groundtruth.stub`); its rows are stub evidence. On the CPU
the cases run in this process. Rows are appended (and flushed) as each case ends.

Exit codes: 0 when every row has status "ok", "oom" or "skipped" (a library
the case needs is not installed; the row says which); 1 when some row has
status "error"; 2 for bad arguments, ``--device cuda`` without a GPU or
``--device stub`` without the stub environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.groundtruth import rows
from benchmarks.groundtruth.matrix import CPU_CASES, GPU_CASES, PUBLISHED_CASES, STUB_CASES, Case, find

__all__ = ["EXIT_BAD_INPUT", "EXIT_ERROR_ROWS", "main", "select_cases"]

EXIT_ERROR_ROWS = 1
EXIT_BAD_INPUT = 2
DEFAULT_STEPS = 3
# Per-case limit: an 8B step at seq 8192 takes seconds on an H100; most of a
# case is interpreter start, imports and random init (about 30-60 s).
DEFAULT_TIMEOUT_S = 240.0
_REPO_ROOT = Path(__file__).resolve().parents[2]
_MODULE = "benchmarks.groundtruth.run"
_GiB = 2**30


def select_cases(device: str, ids: Sequence[str] | None) -> list[Case]:
    """The cases to run on ``device``: all of its matrix, or those named by ``ids``.

    On CUDA, ids of the tiny CPU cases are accepted too and run under the
    "torch" runner (a quick smoke test of the GPU path). On the stub device
    the default is ``STUB_CASES``, and any GPU or CPU case id is accepted
    too (``--device cuda`` accepts the stub ids as well, so a GPU can run
    the stub's configurations side by side).

    Raises:
        ValueError: An id names no case of ``device``.
    """
    if device == "cpu":
        return find(list(ids), CPU_CASES) if ids else list(CPU_CASES)
    if not ids:
        return list(STUB_CASES if device == "stub" else GPU_CASES)
    cpu_ids = {c.id for c in CPU_CASES}
    gpu_ids = {c.id for c in GPU_CASES}
    picked = find(list(ids), GPU_CASES + [c for c in STUB_CASES if c.id not in gpu_ids] + CPU_CASES + PUBLISHED_CASES)
    return [dataclasses.replace(c, runner="torch") if c.id in cpu_ids else c for c in picked]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "stub", "cpu"),
                   help="cuda: real GPU runs; stub: the CUDA worker on stubcuda (no GPU); cpu: tiny models, tracker")
    p.add_argument("--out", help="JSONL file to append rows to")
    p.add_argument("--only", nargs="+", metavar="ID", help="run only these case ids (see --list)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per case on CUDA (default {DEFAULT_STEPS}); the CPU tracker always runs 2")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"per-case limit on CUDA, seconds (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    p.add_argument("--worker", metavar="ID", help=argparse.SUPPRESS)
    p.add_argument("--worker-device", choices=("cuda", "stub"), default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--stub-gpu", default=None,
                   help="stub device: the catalog GPU it reports (default h100-sxm)")
    p.add_argument("--row-file", help=argparse.SUPPRESS)
    return p


def _list_cases() -> None:
    gpu_ids = {c.id for c in GPU_CASES}
    for title, cases in (("GPU cases", GPU_CASES), ("Stub cases (--device stub; [gpu]: also a GPU case)", STUB_CASES),
                         ("CPU cases", CPU_CASES), ("Published configurations (--only)", PUBLISHED_CASES)):
        print(f"{title} ({len(cases)}):")
        for c in cases:
            edge = f"  [edge: {c.expect}]" * c.edge + f"  {c.note}" * bool(c.note)
            if cases is STUB_CASES:
                edge = "  [gpu]" * (c.id in gpu_ids)
            print(f"  {c.id:58s} {c.runner}{edge}")


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _tail(text: str | bytes | None, limit: int = 300) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][-limit:] if lines else ""


def _run_worker(case_id: str, steps: int, row_file: str, device: str = "cuda", stub_gpu: str | None = None) -> int:
    (case,) = select_cases(device, [case_id])
    progress = lambda r: _write_json_atomic(row_file, r)  # noqa: E731
    if device == "stub":
        from benchmarks.groundtruth import stub

        row = stub.worker_case(case, steps=steps, gpu=stub_gpu or stub.STUB_GPU, progress=progress)
        _write_json_atomic(row_file, row)
        # On the stub every kernel is instant: leave before interpreter
        # finalization, which can race autograd's device thread and abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from benchmarks.groundtruth import cuda

    row = cuda.run_case(case, steps=steps, progress=progress)
    _write_json_atomic(row_file, row)
    return 0


def _run_in_worker(case: Case, *, steps: int, timeout_s: float) -> dict:
    """Run ``case`` in a fresh process; a crash or time-out becomes an "error" row."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        row_file = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", _MODULE, "--worker", case.id, "--steps", str(steps), "--row-file", row_file]
        path = os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        try:
            proc = subprocess.run(cmd, check=False, cwd=_REPO_ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
            failure = None if proc.returncode == 0 else f"worker exited with code {proc.returncode}"
            stderr = proc.stderr
        except subprocess.TimeoutExpired as e:
            failure, stderr = f"timed out after {timeout_s:g} s", e.stderr
        row = _read_json(row_file)
    finished = row is not None and row.get("seconds") is not None
    if not finished:
        if row is None:  # the worker died before it could describe the GPU
            row = rows.new_row(case, device="cuda", runner=case.runner, env=rows.environment())
        detail = _tail(stderr)
        error = (failure or "worker ended without a result") + (f": {detail}" if detail else "")
        rows.finish(row, status="error", error=error, seconds=time.perf_counter() - t0)
    elif row["status"] == "error" and stderr:
        print(stderr, file=sys.stderr)
    return row


def _summary(i: int, n: int, row: dict) -> str:
    alloc = row["measured"]["allocated_bytes"]
    if alloc is None:
        peak = "no measurement"
    else:
        peak = f"{alloc / _GiB:.2f} GiB" if alloc >= _GiB else f"{alloc / 2**20:.2f} MiB"
    err = f" ({row['error']})" if row["status"] in ("error", "skipped") else ""
    return f"[{i}/{n}] {row['id']}: {row['status']}, {peak} allocated, {row['seconds']} s{err}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases and append their rows to ``--out``. See the module docstring."""
    args = _parser().parse_args(argv)
    if args.list:
        _list_cases()
        return 0
    if args.worker:
        return _run_worker(args.worker, args.steps or DEFAULT_STEPS, args.row_file, args.worker_device, args.stub_gpu)
    if args.device is None or args.out is None:
        print("error: --device and --out are required. HINT: python -m "
              f"{_MODULE} --device cpu --out rows.jsonl", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps must be >= 1, got {args.steps}. HINT: the default is {DEFAULT_STEPS}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cases = select_cases(args.device, args.only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.device == "cuda":
        import torch

        # cudaGetDeviceCount only: this process creates no CUDA context.
        if not torch.cuda.is_available():
            print(f"error: --device cuda needs a CUDA GPU, and torch {torch.__version__} sees none on this machine. "
                  "HINT: use --device cpu", file=sys.stderr)
            return EXIT_BAD_INPUT
    elif args.device == "stub":
        from stubcuda import runner

        why = runner.missing()
        if why:
            print(f"error: --device stub needs the stub CUDA device: {why}", file=sys.stderr)
            return EXIT_BAD_INPUT
    elif args.steps is not None:
        print(f"warning: --steps {args.steps} ignored on the CPU: the tracker runs llmem_plugin.trace.step.NUM_ITERATIONS "
              "steps", file=sys.stderr)
    if args.device == "cuda":
        def run_one(case: Case) -> dict:
            return _run_in_worker(case, steps=args.steps or DEFAULT_STEPS, timeout_s=args.timeout_s)
    elif args.device == "stub":
        from benchmarks.groundtruth import stub

        def run_one(case: Case) -> dict:
            return stub.run_case(case, steps=args.steps or DEFAULT_STEPS, timeout_s=args.timeout_s,
                                 gpu=args.stub_gpu or stub.STUB_GPU)
    else:
        from benchmarks.groundtruth.cpu import run_case as run_one
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    num_errors = 0
    for i, case in enumerate(cases, 1):
        row = run_one(case)
        rows.append_row(args.out, row)
        num_errors += row["status"] == "error"
        print(_summary(i, len(cases), row), file=sys.stderr, flush=True)
    return EXIT_ERROR_ROWS if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
