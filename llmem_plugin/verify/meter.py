"""Predicted vs actual: measure a running job's peak and compare it with the estimate.

The adapters (``llmem_plugin.integrations``) estimate before the first step,
start a :class:`PeakMeter`, and after the first few steps compare:

* on a CUDA device the meter reads ``torch.cuda.max_memory_allocated`` and
  ``max_memory_reserved`` (peaks since :meth:`PeakMeter.start`, which resets
  them) and this process's device memory from NVML (the per-process figure
  ``nvidia-smi`` lists; the device-wide used memory when NVML cannot give it);
* on the CPU there is no caching allocator, so the meter runs the project's
  tracker on the real tensors of the job (what tests/trace/test_fake_equals_real.py
  checks the fake trace against), and the comparison is with the estimate's
  peak of live tensors (``Estimate.peak_tensor_bytes``).

:func:`append_row` writes the comparison as one line of the ground-truth
schema (benchmarks/groundtruth/README.md), with the model's config and the
method, so ``llmem validate FILE.jsonl`` re-predicts it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker

__all__ = [
    "DEFAULT_TOLERANCE_PCT",
    "Comparison",
    "Measurement",
    "PeakMeter",
    "Prediction",
    "append_row",
    "compare",
    "environment",
]

# The project's accuracy target for the device total on one GPU (README,
# "Accuracy"): the loosest of the three single-GPU targets, so a warning means
# the estimate is outside every target.
DEFAULT_TOLERANCE_PCT = 3.0
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the estimate says one GPU will hold at its peak.

    Attributes:
        tensor_bytes: Peak of live tensors (what the CPU meter measures).
        allocated_bytes: Peak ``torch.cuda.max_memory_allocated``.
        reserved_bytes: Peak ``torch.cuda.max_memory_reserved``.
        device_total_bytes: Reserved plus CUDA context and NCCL buffers.
        method: Method the job runs (``single``, ``ddp``, ``zero2``, ...).
        num_gpus: World size.
        num_nodes: Nodes.
        tp: Tensor-parallel degree.
        gpu: Catalog GPU the estimate is for.
        workload: The per-GPU workload (``Workload.to_dict()``).
        model: Catalog name or a description of the live model.
        config: The model's ``PretrainedConfig.to_dict()``, when it has one.
    """

    tensor_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    device_total_bytes: int
    method: str
    num_gpus: int
    num_nodes: int
    tp: int
    gpu: str
    workload: dict[str, Any]
    model: str
    config: dict[str, Any] | None = None

    @classmethod
    def of(cls, est: Any, *, workload: Any, model: str, config: dict[str, Any] | None = None) -> Prediction:
        """From an :class:`~llmem_plugin.estimate.Estimate`, or from a
        :class:`~llmem_plugin.methods.base.MethodEstimate` (its worst rank)
        with the per-rank ``workload`` it was estimated with."""
        if hasattr(est, "ranks"):  # MethodEstimate
            r = est.worst
            return cls(tensor_bytes=r.peak_tensor_bytes, allocated_bytes=r.peak_allocated_bytes,
                       reserved_bytes=r.peak_reserved_bytes, device_total_bytes=r.device_total_bytes,
                       method=est.method, num_gpus=est.layout.num_gpus, num_nodes=est.layout.num_nodes,
                       tp=est.layout.tp, gpu=getattr(est, "gpu", "") or "", workload=workload.to_dict(),
                       model=model, config=config)
        return cls(tensor_bytes=est.peak_tensor_bytes, allocated_bytes=est.peak_allocated_bytes,
                   reserved_bytes=est.peak_reserved_bytes, device_total_bytes=est.device_total_bytes,
                   method="single", num_gpus=1, num_nodes=1, tp=1, gpu=est.gpu, workload=est.workload.to_dict(),
                   model=model, config=config)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """Peaks measured on one process over the first steps.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        allocated_bytes: CUDA: ``max_memory_allocated``; CPU: the tracker's
            peak of live tensors.
        reserved_bytes: ``max_memory_reserved`` (None on the CPU).
        device_total_bytes: This process's device memory from NVML, or the
            device-wide used memory (None on the CPU).
        steps: One ``{"step", "allocated_bytes", "reserved_bytes",
            "device_used_bytes"}`` per step, running peaks since the start.
        gpu: ``{"name", "memory_bytes", "compute_capability", "idle_used_bytes"}`` on CUDA.
        device_total_source: ``nvml-process``, ``nvml-device``, ``cuda-mem-get-info`` or None.
        seconds: Wall time from start to stop.
        breakdown: On the CPU, tensor bytes per category at the peak.
    """

    device: str
    allocated_bytes: int
    reserved_bytes: int | None
    device_total_bytes: int | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    gpu: dict[str, Any] | None = None
    device_total_source: str | None = None
    seconds: float = 0.0
    breakdown: dict[str, int] = field(default_factory=dict)


class _Nvml:
    """This process's memory on the GPU torch calls ``cuda:<index>``, through NVML."""

    def __init__(self, index: int) -> None:
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            if uuid:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid.removeprefix("GPU-"))
        except Exception:  # noqa: BLE001 - no pynvml, no driver library, a MIG slice: fall back
            self.handle = None

    def used(self) -> tuple[int | None, str | None]:
        if self.handle is None:
            return None, None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
            if mine:
                return int(sum(mine)), "nvml-process"
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used), "nvml-device"
        except Exception:  # noqa: BLE001 - containers often hide the process list
            return None, None


class PeakMeter:
    """Measure the peak memory of the steps run between :meth:`start` and :meth:`stop`.

    Args:
        device: ``"cuda"``/``"cuda:N"`` or ``"cpu"``; the CUDA device in use
            when one is available, else the CPU.
        emulate: On the CPU, run the measured steps under
            :func:`llmem_plugin.trace.emulation.cuda_emulation` (CUDA's autocast op
            policy, SDPA kernels, dropout), so that the real CPU tensors are
            allocated as a CUDA run allocates them, which is what the
            estimate predicts. A trainer's own ``torch.autocast("cpu")`` then
            follows the CUDA policy.
        autocast_dtype: The run's mixed-precision dtype (None for none).
        compute_capability: GPU generation whose kernel choices to emulate.
    """

    def __init__(self, device: str | torch.device | None = None, *, emulate: bool = True,
                 autocast_dtype: torch.dtype | None = None,
                 compute_capability: tuple[int, int] | None = None) -> None:
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self._emulate = emulate
        self._autocast_dtype = autocast_dtype
        self._cc = compute_capability
        self._emulation: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._tracker: MemoryTracker | None = None
        self._steps: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._nvml: _Nvml | None = None
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def start(self, live: Iterable[torch.Tensor] = (), optimizer: torch.optim.Optimizer | None = None) -> None:
        """Start measuring here.

        Args:
            live: Tensors alive before the start that the peak must count
                (parameters, buffers, optimizer states). On CUDA the
                allocator already counts them; on the CPU they are registered
                with the tracker.
            optimizer: The job's optimizer. On the CPU, the state a CUDA run
                keeps on the host (AdamW's ``step`` counters,
                :func:`llmem_plugin.trace.step.host_resident_state`) is not counted.
        """
        self._optimizer = optimizer
        self._t0 = time.perf_counter()
        self._steps = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._nvml = _Nvml(self.device.index or 0)
        else:
            if self._emulate:
                from llmem_plugin.trace.emulation import (
                    DEFAULT_COMPUTE_CAPABILITY,
                    cuda_emulation,
                )

                self._emulation = cuda_emulation(autocast_dtype=self._autocast_dtype,
                                                 compute_capability=self._cc or DEFAULT_COMPUTE_CAPABILITY)
                self._emulation.__enter__()
            self._tracker = MemoryTracker()
            self._tracker.__enter__()
            self._tracker.register([t for t in live if isinstance(t, torch.Tensor)], MemoryCategory.PARAMETER)
        self._running = True

    def step_end(self, step: int) -> None:
        """Record the running peaks after ``step`` (1-based) finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            used, _ = self._nvml.used() if self._nvml else (None, None)
            if used is None:
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
            self._steps.append({"step": step, "allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                                "reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
                                "device_used_bytes": int(used)})
        else:
            assert self._tracker is not None, "step_end() before start()"
            self._label_host_state()
            peak = max((cur for _, _, cur in self._tracker.result().timeline), default=0)
            self._steps.append({"step": step, "allocated_bytes": int(peak), "reserved_bytes": None,
                                "device_used_bytes": None})

    def stop(self) -> Measurement:
        """Stop measuring and return the peaks over the recorded steps."""
        assert self._running, "stop() before start()"
        self._running = False
        seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            if not self._steps:
                self.step_end(0)
            _, source = self._nvml.used() if self._nvml else (None, None)
            if source is None:
                source = "cuda-mem-get-info"
            props = torch.cuda.get_device_properties(self.device)
            gpu = {"name": torch.cuda.get_device_name(self.device), "memory_bytes": int(props.total_memory),
                   "compute_capability": list(torch.cuda.get_device_capability(self.device)),
                   "idle_used_bytes": None}
            return Measurement(device="cuda", allocated_bytes=max(s["allocated_bytes"] for s in self._steps),
                               reserved_bytes=max(s["reserved_bytes"] for s in self._steps),
                               device_total_bytes=max(s["device_used_bytes"] for s in self._steps),
                               steps=list(self._steps), gpu=gpu, device_total_source=source, seconds=seconds)
        tracker, self._tracker = self._tracker, None
        assert tracker is not None
        if not self._steps:
            self.step_end(0)
        self._label_host_state(tracker)
        tracker.__exit__(None, None, None)
        self._exit_emulation()
        result = tracker.result()
        return Measurement(device="cpu", allocated_bytes=result.peak_bytes, reserved_bytes=None,
                           device_total_bytes=None, steps=list(self._steps), seconds=seconds,
                           breakdown={c.value: n for c, n in result.breakdown.items()})

    def abandon(self) -> None:
        """Stop without a result (training ended before the comparison)."""
        if self._running and self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None
        self._exit_emulation()
        self._running = False

    def _label_host_state(self, tracker: MemoryTracker | None = None) -> None:
        from llmem_plugin.trace.step import host_resident_state

        tracker = tracker or self._tracker
        if self._optimizer is not None and tracker is not None:
            tracker.label(host_resident_state(self._optimizer), MemoryCategory.HOST)

    def _exit_emulation(self) -> None:
        if self._emulation is not None:
            emulation, self._emulation = self._emulation, None
            emulation.__exit__(None, None, None)


def _pct(pred: int | None, meas: int | None) -> float | None:
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """A prediction against a measurement.

    The headline ("peak") is the allocated peak: the one number measured on
    the CPU as well as on CUDA. On CUDA reserved and device total follow.
    Errors are signed, ``(predicted - actual) / actual`` in percent; negative
    is an under-estimate, the direction that causes OOM.
    """

    prediction: Prediction
    measurement: Measurement

    def _pairs(self) -> dict[str, tuple[int | None, int | None]]:
        p, m = self.prediction, self.measurement
        if m.device == "cpu":
            return {"peak": (p.tensor_bytes, m.allocated_bytes)}
        return {"peak": (p.allocated_bytes, m.allocated_bytes), "reserved": (p.reserved_bytes, m.reserved_bytes),
                "device_total": (p.device_total_bytes, m.device_total_bytes)}

    @property
    def error_pct(self) -> dict[str, float | None]:
        """Signed % error per compared metric (``peak`` always)."""
        return {k: _pct(pred, meas) for k, (pred, meas) in self._pairs().items()}

    def metrics(self) -> dict[str, float]:
        """Scalars to log: ``llmem/predicted_peak_gib``, ``llmem/actual_peak_gib``,
        ``llmem/error_pct``, and on CUDA the same three for ``reserved`` and
        ``device_total``."""
        out: dict[str, float] = {}
        errors = self.error_pct
        for key, (pred, meas) in self._pairs().items():
            if pred is None or meas is None:
                continue
            if key == "peak":
                out.update({"llmem/predicted_peak_gib": pred / _GIB, "llmem/actual_peak_gib": meas / _GIB})
                if errors[key] is not None:
                    out["llmem/error_pct"] = errors[key]
            else:
                out.update({f"llmem/predicted_{key}_gib": pred / _GIB, f"llmem/actual_{key}_gib": meas / _GIB})
                if errors[key] is not None:
                    out[f"llmem/{key}_error_pct"] = errors[key]
        return out

    def outside(self, tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> dict[str, float]:
        """The metrics whose |error| exceeds ``tolerance_pct``."""
        return {k: v for k, v in self.error_pct.items() if v is not None and abs(v) > tolerance_pct}

    def summary(self) -> str:
        """One line: predicted, actual and error of each metric."""
        parts = []
        for key, (pred, meas) in self._pairs().items():
            err = _pct(pred, meas)
            if pred is None or meas is None:
                continue
            name = "allocated" if key == "peak" and self.measurement.device == "cuda" else (
                "tensor peak" if key == "peak" else key.replace("_", " "))
            parts.append(f"{name} predicted {pred / _GIB:.3f} GiB, actual {meas / _GIB:.3f} GiB "
                         f"({err:+.2f}%)" if err is not None else f"{name} actual {meas / _GIB:.3f} GiB")
        return "; ".join(parts)

    def to_row(self, *, run_id: str, runner: str, rank: int = 0) -> dict[str, Any]:
        """The comparison as a ground-truth row that ``llmem validate`` reads."""
        p, m = self.prediction, self.measurement
        return {
            "id": f"{run_id}-rank{rank}",
            "model": p.model,
            "config": p.config,
            "config_overrides": None,
            "runner": runner,
            "device": m.device,
            "edge": False,
            "workload": p.workload,
            "method": {"name": p.method, "num_gpus": p.num_gpus, "num_nodes": p.num_nodes, "tp": p.tp,
                       "rank": rank},
            "status": "ok",
            "error": None,
            "steps": m.steps,
            "measured": {"allocated_bytes": m.allocated_bytes, "reserved_bytes": m.reserved_bytes,
                         "device_total_bytes": m.device_total_bytes},
            "predicted": {"tensor_bytes": p.tensor_bytes, "allocated_bytes": p.allocated_bytes,
                          "reserved_bytes": p.reserved_bytes, "device_total_bytes": p.device_total_bytes,
                          "gpu": p.gpu},
            "gpu": m.gpu,
            "env": environment(nvml_source=m.device_total_source),
            "seconds": round(m.seconds, 2),
        }


def compare(prediction: Prediction, measurement: Measurement) -> Comparison:
    """Pair a prediction with what was measured."""
    return Comparison(prediction=prediction, measurement=measurement)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment(*, driver: str | None = None, nvml_source: str | None = None) -> dict[str, Any]:
    """Versions and host facts recorded with every measurement; touches no CUDA device."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "driver": driver,
        "python": platform.python_version(),
        "nvml_source": nvml_source,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "date": dt.date.today().isoformat(),
        "host": platform.node(),
    }


def append_row(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line (the file and its folder are created)."""
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
