"""The stub device: a case's CUDA worker run on ``stubcuda`` (PyTorch's CUDA build, no GPU).

``python -m benchmarks.groundtruth.run --device stub`` runs the worker of
``--device cuda`` (:func:`benchmarks.groundtruth.cuda.run_case`, the same
model build, loop and optimizer) under ``stubcuda/run`` with the stub
environment's interpreter (``.stubvenv``). There torch's real caching
allocator, CUDA dispatch, autocast, SDPA backend choice and cuBLAS / cuBLASLt
workspaces run as on a GPU, but kernels do nothing and device memory reads as
zeros. So ``max_memory_allocated`` / ``max_memory_reserved`` are the
allocator's own numbers for the step, and nothing else is: the rows are stub
evidence, never GPU truth (``device_kind: "stub"``; ``llmem validate`` reports
them apart).

Two things differ from a GPU and are set here, in the worker only:

* **cuDNN attention off.** The stub's cuDNN computes nothing and allocates
  nothing, and torch picks SDPA's cuDNN backend first for bf16/fp16 on sm90;
  ``torch.backends.cuda.enable_cudnn_sdp(False)`` makes torch choose among
  flash / efficient / math as the estimator then does
  (``llmem_plugin/trace/emulation/sdpa.py`` reads ``cudnn_sdp_enabled()``;
  ``llmem validate`` predicts a stub row with the setting the row records).
* **Device reads neutralised.** A value read from the device is 0, so host
  control flow that reads one can take a path a GPU would not. Each read site
  the harness's workloads reach is given the value a GPU reads there for the
  harness's inputs (random token ids, one unpacked sequence per row), with the
  same tensor operations run first, so the allocator sees what a GPU's would
  (see ``_NEUTRALISERS``). Every device read made from Python (``.item()``,
  ``bool(t)``, ``nonzero``, boolean-mask indexing, a copy to the host, ...)
  is logged by operation and call site and written to the row
  (``stub.device_reads``), with how often each neutraliser fired
  (``stub.neutralised``): a read that no neutraliser covers is visible
  there. Reads inside C++ kernels are not logged (see :class:`_ReadLog`).

Known limitations:
    * Values are zeros: loss, gradients and optimizer states are zero, so
      data-dependent paths not listed in ``_NEUTRALISERS`` (MoE ``eager``
      routing, bitsandbytes' LLM.int8 outlier columns, GradScaler's inf
      checks) follow the all-zero data, not a real run's.
    * No CUDA context, kernels or NCCL: the device's used memory is not
      measured (``device_used_bytes`` null).
    * cuDNN SDPA cannot be checked.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.groundtruth import rows
from benchmarks.groundtruth.matrix import Case

__all__ = ["STUB_GPU", "run_case", "worker_case"]

# The GPU whose properties the stub reports (llmem_plugin/device/gpus.json);
# `llmem validate` predicts stub rows for the GPU the row names.
STUB_GPU = "h100-sxm"
_MODULE = "benchmarks.groundtruth.run"
# Tensor methods and torch functions that hand a device value to the host,
# or whose output size depends on one (``x[bool_mask]`` runs nonzero).
_READ_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "masked_select", "unique", "__bool__", "__int__",
                 "__float__", "__index__")
_READ_FUNCTIONS = ("nonzero", "masked_select", "unique", "unique_consecutive", "bincount")
_OWN_FILES = (os.sep + "torch" + os.sep, os.sep + "benchmarks" + os.sep + "groundtruth" + os.sep + "stub.py")


def _site() -> str:
    """The innermost caller outside torch and this module: ``path:line (function)``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _OWN_FILES):
            path = frame.filename
            for marker in ("site-packages" + os.sep, str(Path(__file__).resolve().parents[2]) + os.sep):
                if marker in path:
                    path = path.split(marker, 1)[1]
            return f"{path}:{frame.lineno} ({frame.name})"
    return "torch"


class _ReadLog:
    """Counts device reads made from Python, by (operation, call site).

    The Tensor methods and torch functions of ``_READ_METHODS`` /
    ``_READ_FUNCTIONS`` (and indexing with a CUDA boolean mask, and ``.to``
    the host) are wrapped while the log is installed; the wrapper only looks
    at its arguments and calls the original, so the allocations are those of
    an unwrapped run. A ``TorchDispatchMode`` would see C++-internal reads
    too, but an active mode changes the allocations (every op is re-invoked
    from Python: 128 KiB more allocated on opt-125m, 2.2 GiB more reserved
    on gemma-2-2b, measured on the stub), so it is not used.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import torch

        saved: list[tuple[Any, str, Any]] = []

        def wrap(owner: Any, name: str, is_read) -> None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                if is_read(args, kwargs):
                    self.counts[(f"{getattr(owner, '__name__', owner)}.{name}", _site())] += 1
                return original(*args, **kwargs)

            saved.append((owner, name, original))
            setattr(owner, name, wrapper)

        def first_cuda(args, kwargs) -> bool:
            return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda

        def masked_index(args, kwargs) -> bool:
            if not first_cuda(args, kwargs) or len(args) < 2:
                return False
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx)

        def to_host(args, kwargs) -> bool:
            if not first_cuda(args, kwargs):
                return False
            dev = kwargs.get("device", args[1] if len(args) > 1 else None)
            return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"

        for name in _READ_METHODS:
            wrap(torch.Tensor, name, first_cuda)
        for name in _READ_FUNCTIONS:
            wrap(torch, name, first_cuda)
        wrap(torch.Tensor, "__getitem__", masked_index)
        wrap(torch.Tensor, "__setitem__", masked_index)
        wrap(torch.Tensor, "to", to_host)
        try:
            yield
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)

    def to_list(self) -> list[dict[str, Any]]:
        return [{"op": op, "site": site, "count": n} for (op, site), n in sorted(self.counts.items())]


def _unpacked_positions(neutralised: collections.Counter):
    """``transformers.masking_utils.find_packed_sequence_indices`` as a GPU runs it on unpacked rows.

    transformers (masking_utils.py, 5.x) diffs the position ids, cumsums the
    breaks and returns None when the last column is 0 in every row
    (``(mask[:, -1] == 0).all()``, a device read). On a GPU the positions of
    the harness's batches are 0..s-1 in every row, so it returns None and the
    mask stays causal (SDPA ``is_causal=True``). On the stub the positions
    read as zeros, every token looks like a new sequence, and transformers
    builds a 4-D packed mask (and SDPA expands K/V): +512 MiB on
    llama-3.2-1b s1024 b4. Here the same tensors are made and read, then the
    GPU's answer is returned.
    """
    import torch
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor):
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        packed_sequence_mask = (position_diff != 1).cumsum(-1)
        bool((packed_sequence_mask[:, -1] == 0).all())  # the GPU reads True here
        neutralised["transformers.masking_utils.find_packed_sequence_indices"] += 1
        return None

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    return lambda: setattr(masking_utils, "find_packed_sequence_indices", original)


# The device reads the harness's workloads reach whose all-zero value would
# change the allocations, each replaced by what a GPU reads for the harness's
# inputs.
_NEUTRALISERS = (_unpacked_positions,)


@contextlib.contextmanager
def stub_settings(info: dict[str, Any]) -> Iterator[None]:
    """In the worker: cuDNN attention off, device reads neutralised and logged; fills ``info``."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    neutralised: collections.Counter[str] = collections.Counter()
    undo = [make(neutralised) for make in _NEUTRALISERS]
    log = _ReadLog()
    info["cudnn_sdp_enabled"] = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        with log.installed():
            yield
    finally:
        for u in undo:
            u()
        info["neutralised"] = dict(neutralised)
        info["device_reads"] = log.to_list()


def _stub_info(gpu: str) -> dict[str, Any]:
    """What the row records about the stub (before the run fills in the rest)."""
    manifest = Path(__file__).resolve().parents[2] / "stubcuda" / "build" / "manifest.json"
    try:
        libraries = sorted(json.loads(manifest.read_text())["libraries"])
    except (OSError, ValueError, KeyError):
        libraries = None
    return {"gpu": gpu, "capacity_bytes": int(os.environ["STUBCUDA_CAPACITY"])
            if os.environ.get("STUBCUDA_CAPACITY") else None,
            "libraries": libraries, "cudnn_sdp_enabled": None, "neutralised": {}, "device_reads": []}


def worker_case(case: Case, *, steps: int, gpu: str, progress) -> dict:
    """In the stub process: the CUDA worker's :func:`cuda.run_case` under :func:`stub_settings`."""
    from benchmarks.groundtruth import cuda

    info = _stub_info(gpu)
    with stub_settings(info):
        row = cuda.run_case(case, steps=steps, progress=progress, stub=info)
    row["stub"] = info
    return row


def run_case(case: Case, *, steps: int, timeout_s: float, gpu: str = STUB_GPU) -> dict:
    """Run ``case``'s CUDA worker on the stub device in a fresh process; return its row.

    A crash or time-out gives an "error" row, as on CUDA.

    Raises:
        stubcuda.runner.StubUnavailable: The stub environment is not built here.
    """
    import subprocess
    import tempfile

    from stubcuda import runner

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        row_file = os.path.join(tmp, "row.json")
        args = ["-m", _MODULE, "--worker", case.id, "--worker-device", "stub", "--stub-gpu", gpu,
                "--steps", str(steps), "--row-file", row_file]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(runner.ROOT), os.environ.get("PYTHONPATH")]))}
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        try:
            proc = runner.run_python(args, gpu=gpu, env=env, timeout_s=timeout_s)
            failure = None if proc.returncode == 0 else f"worker exited with code {proc.returncode}"
            stderr = proc.stderr
        except subprocess.TimeoutExpired as e:
            failure, stderr = f"timed out after {timeout_s:g} s", e.stderr
        try:
            with open(row_file, encoding="utf-8") as f:
                row = json.load(f)
        except (OSError, json.JSONDecodeError):
            row = None
    if row is None or row.get("seconds") is None:
        if row is None:
            row = rows.new_row(case, device="stub", runner=case.runner, env=rows.environment(),
                               stub=_stub_info(gpu))
        tail = [ln for ln in (stderr if isinstance(stderr, str) else (stderr or b"").decode(errors="replace"))
                .strip().splitlines() if ln.strip()]
        error = (failure or "worker ended without a result") + (f": {tail[-1][-300:]}" if tail else "")
        rows.finish(row, status="error", error=error, seconds=time.perf_counter() - t0)
    elif row["status"] == "error" and stderr:
        print(stderr, file=sys.stderr)
    return row
