"""The result row: one JSON object per run, one per line of the output file.

The schema (README.md repeats it) is what ``llmem validate`` reads::

    id, model, config_overrides, runner, device, device_kind, edge, workload, status, error,
    steps[{step, allocated_bytes, reserved_bytes, device_used_bytes}],
    measured{allocated_bytes, reserved_bytes, device_total_bytes},
    gpu{name, memory_bytes, compute_capability, idle_used_bytes} | null,
    env{torch, transformers, peft, cuda, cudnn, driver, python, nvml_source,
        PYTORCH_CUDA_ALLOC_CONF, date, host},
    seconds,
    stub{gpu, capacity_bytes, libraries, cudnn_sdp_enabled, neutralised, device_reads} | null

``device_kind`` says what kind of evidence the row is: "gpu" (a real GPU,
``device`` "cuda"), "stub" (the stub CUDA device, ``device`` "stub": the
caching allocator's numbers for a step whose kernels did nothing; never GPU
truth) or "cpu" (the tracker on the CPU).
"""

from __future__ import annotations

import json
import os
from typing import Any

from benchmarks.groundtruth.matrix import Case
from llmem_plugin.verify.meter import (
    environment,  # the same environment record as the adapters' rows
)

__all__ = [
    "DEVICE_KINDS",
    "ENV_KEYS",
    "GPU_KEYS",
    "MEASURED_KEYS",
    "ROW_KEYS",
    "STATUSES",
    "STEP_KEYS",
    "append_row",
    "environment",
    "error_text",
    "finish",
    "new_row",
    "step_record",
]

ROW_KEYS = ("id", "model", "config_overrides", "runner", "device", "device_kind", "edge", "workload", "status",
            "error", "steps", "measured", "gpu", "env", "seconds", "stub")
STEP_KEYS = ("step", "allocated_bytes", "reserved_bytes", "device_used_bytes")
MEASURED_KEYS = ("allocated_bytes", "reserved_bytes", "device_total_bytes")
GPU_KEYS = ("name", "memory_bytes", "compute_capability", "idle_used_bytes")
ENV_KEYS = ("torch", "transformers", "peft", "cuda", "cudnn", "driver", "python", "nvml_source",
            "PYTORCH_CUDA_ALLOC_CONF", "date", "host")
# "skipped": the case needs a library the machine lacks (techniques.Skipped); ``error`` names it.
STATUSES = ("ok", "oom", "error", "skipped")
# The kind of evidence per ``device`` value.
DEVICE_KINDS = {"cuda": "gpu", "stub": "stub", "cpu": "cpu"}


def new_row(case: Case, *, device: str, runner: str, env: dict[str, Any], gpu: dict | None = None,
            stub: dict | None = None) -> dict:
    """A row for ``case`` with no measurement yet (status "error" until finished).

    ``device`` is "cuda", "stub" or "cpu"; ``stub`` what a stub row records
    about the stub device (``benchmarks.groundtruth.stub``).
    """
    assert device in DEVICE_KINDS, device
    return {
        "id": case.id,
        "model": case.model,
        "config_overrides": case.overrides,
        "runner": runner,
        "device": device,
        "device_kind": DEVICE_KINDS[device],
        "edge": case.edge,
        "workload": case.workload.to_dict(),
        **({"seq_lens": case.seq_lens} if case.seq_lens is not None else {}),
        "status": "error",
        "error": "did not finish",
        "steps": [],
        "measured": dict.fromkeys(MEASURED_KEYS),
        "gpu": gpu,
        "env": env,
        "seconds": None,
        "stub": stub,
    }


def step_record(step: int, allocated: int, reserved: int | None, device_used: int | None) -> dict[str, Any]:
    """One entry of ``steps``: peaks since the run started, read after ``step`` (1-based)."""
    return {"step": step, "allocated_bytes": int(allocated),
            "reserved_bytes": None if reserved is None else int(reserved),
            "device_used_bytes": None if device_used is None else int(device_used)}


def _max(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def finish(row: dict, *, status: str, error: str | None, seconds: float) -> dict:
    """Set the outcome and derive ``measured`` (max over ``steps``) in place; returns ``row``."""
    assert status in STATUSES, status
    steps = row["steps"]
    row["status"] = status
    row["error"] = error
    row["measured"] = {
        "allocated_bytes": _max([s["allocated_bytes"] for s in steps]),
        "reserved_bytes": _max([s["reserved_bytes"] for s in steps]),
        "device_total_bytes": _max([s["device_used_bytes"] for s in steps]),
    }
    row["seconds"] = round(seconds, 2)
    return row


def append_row(path: str | os.PathLike, row: dict) -> None:
    """Append ``row`` as one JSON line and flush it to disk (a later time-out keeps it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def error_text(e: BaseException) -> str:
    """``Type: first line of the message``, at most 500 characters."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:500]
