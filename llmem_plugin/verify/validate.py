"""``llmem validate``: re-predict measured runs and report the error.

Reads the JSONL rows of the ground-truth harness (benchmarks/groundtruth,
schema in its README), predicts each row's workload on the row's own GPU,
torch version and ``PYTORCH_CUDA_ALLOC_CONF``, and compares:

* **allocated** with ``torch.cuda.max_memory_allocated`` (on CPU rows: the
  tracker's peak of live tensors, compared with the estimate's tensor peak);
* **reserved** with ``torch.cuda.max_memory_reserved``;
* **device total** with the device's used memory from NVML, less what the
  device used before the run started (``gpu.idle_used_bytes``).

Single-GPU rows of the harness (GPU and stub) are predicted as the harness
ran them: ``torch.cuda.empty_cache()`` and a peak reset after the model is
built, and bitsandbytes' QLoRA built as a 16-bit model on the device, then
quantized (``--load device-quantize``; see :func:`_harness_loading`).

Errors are signed, ``(predicted - measured) / measured`` in percent; a
negative error is an under-estimate, the direction that causes OOM. Rows run
at the edge of capacity (``edge``) also score the fits/OOM verdict.

Rows are evidence of three kinds (``device_kind``; rows written before it
existed are "gpu" on ``device`` "cuda", "cpu" on "cpu"):

* **gpu**: a real GPU. The summary and the fits/OOM score are theirs (and
  the CPU rows' tensor peaks).
* **stub**: the stub CUDA device (``stubcuda``): torch's CUDA build and its
  real caching allocator with no GPU, no kernels and no CUDA context. Its
  allocated and reserved peaks are the allocator's own for the step, and the
  estimate should equal them byte for byte; its device total is not
  measured. Stub rows are summarised apart (``stub_summary``) and never
  counted as GPU truth or scored for fits. They are predicted with SDPA's
  cuDNN backend as the row records it (off on the stub, whose cuDNN computes
  nothing), since torch's backend choice changes the attention's memory.
* **cpu**: the tracker on real CPU tensors (allocated only).

A row names its distributed method as ``method: {name, num_gpus, num_nodes,
tp, rank, options}`` (rows of :mod:`llmem_plugin.verify.meter`), or, as the
stub's distributed runner writes it (``runner: "stub-distributed"``,
benchmarks/groundtruth/stub_distributed.py), as the preset's name beside
``world_size``, ``tp``, ``rank`` and ``options``; both are predicted with
``estimate_method`` for that rank, as the runner predicted them. Rows that
differ only in their rank share one prediction.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.errors import ConfigError, LLMemError, UnsupportedError

__all__ = ["DEVICE_KINDS", "METRICS", "MetricSummary", "RowCheck", "ValidationReport", "check_row", "device_kind",
           "estimate_row", "load_rows", "method_row", "validate_rows"]

METRICS = ("allocated", "reserved", "device_total")
# benchmarks/groundtruth/rows.py DEVICE_KINDS: the evidence a row is.
DEVICE_KINDS = ("gpu", "stub", "cpu")
_MEASURED_KEY = {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "device_total": "device_total_bytes"}


@dataclass(frozen=True, kw_only=True)
class RowCheck:
    """One measured row against its prediction.

    Attributes:
        id: The row's id.
        runner: ``torch``, ``hf-trainer``, ``tracker-cpu`` or ``stub-distributed``.
        kind: The evidence: ``gpu``, ``stub`` or ``cpu`` (see the module docstring).
        status: The run's outcome: ``ok``, ``oom``, ``error`` or ``skipped`` (a library it needs was missing).
        edge: Whether the row was run at the edge of capacity.
        measured: Bytes per metric (None where not measured).
        predicted: Bytes per metric (None where not predicted).
        error_pct: Signed % error per metric, on ``ok`` rows with both numbers.
        diff_bytes: Predicted minus measured bytes per metric, where ``error_pct`` is set.
        fits_predicted: The estimate's verdict (None if not predicted).
        fits_measured: True for ``ok``, False for ``oom``, None otherwise.
        note: Why a row was skipped or not predicted ("" if it was).
    """

    id: str
    runner: str
    kind: str
    status: str
    edge: bool
    measured: dict[str, int | None]
    predicted: dict[str, int | None]
    error_pct: dict[str, float | None]
    diff_bytes: dict[str, int | None]
    fits_predicted: bool | None
    fits_measured: bool | None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class MetricSummary:
    """Error statistics of one metric over the rows that have it.

    Attributes:
        num_rows: Rows compared.
        mean_abs_pct: Mean absolute % error.
        max_abs_pct: Largest absolute % error.
        max_under_pct: Largest under-estimate, as a positive % (0 if none).
        mean_signed_pct: Mean signed % error (negative: under on average).
        num_under: Rows under-estimated.
    """

    num_rows: int
    mean_abs_pct: float | None
    max_abs_pct: float | None
    max_under_pct: float | None
    mean_signed_pct: float | None
    num_under: int

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, kw_only=True)
class ValidationReport:
    """All rows checked, and the summary.

    Attributes:
        rows: One :class:`RowCheck` per input row, in order.
        summary: A :class:`MetricSummary` per metric of :data:`METRICS`, over
            the GPU and CPU rows (measurements).
        fits_accuracy: Fraction of GPU edge rows whose fits/OOM verdict was
            right (None without edge rows).
        num_edge_rows: Edge rows scored.
        skipped: Ids of the rows not compared (failed, skipped, not predicted).
        stub_summary: A :class:`MetricSummary` per metric over the stub rows
            alone (their device total is not measured: ``num_rows`` 0).
        num_stub_exact: Stub rows whose allocated and reserved peaks both
            equal the prediction byte for byte.
    """

    rows: list[RowCheck]
    summary: dict[str, MetricSummary]
    fits_accuracy: float | None
    num_edge_rows: int = 0
    skipped: list[str] = field(default_factory=list)
    stub_summary: dict[str, MetricSummary] = field(default_factory=dict)
    num_stub_exact: int = 0

    @property
    def stub_rows(self) -> list[RowCheck]:
        return [r for r in self.rows if r.kind == "stub"]

    def to_dict(self) -> dict[str, Any]:
        summary: dict[str, Any] = {m: s.to_dict() for m, s in self.summary.items()}
        summary["fits_accuracy"] = self.fits_accuracy
        summary["num_edge_rows"] = self.num_edge_rows
        stub: dict[str, Any] = {m: s.to_dict() for m, s in self.stub_summary.items()}
        stub["num_rows"] = len(self.stub_rows)
        stub["num_exact"] = self.num_stub_exact
        return {"rows": [r.to_dict() for r in self.rows], "summary": summary, "stub_summary": stub}


# The row schema load_rows checks (benchmarks/groundtruth/README.md): the
# type of each required key, and of each optional one when present.
_ROW_REQUIRED = {"id": str, "model": str, "workload": dict, "status": str, "device": str}
_ROW_OPTIONAL = {"measured": dict, "config_overrides": dict, "config": dict, "method": dict, "gpu": dict,
                 "env": dict, "runner": str, "stub": dict, "device_kind": str}
_ROW_STATUSES = ("ok", "oom", "error", "skipped")
_SCHEMA_HINT = "HINT: rows follow the schema in benchmarks/groundtruth/README.md"


def read_jsonl(path: str | os.PathLike, *, hint: str, schema_hint: str) -> list[tuple[str, Any]]:
    """The JSON values of a JSONL file's non-blank lines, each with its ``path:line``.

    Raises:
        ConfigError: The file is missing, unreadable or not UTF-8, or a line
            is not JSON; ``hint`` and ``schema_hint`` end the message.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read '{path}': {e.strerror}. HINT: {hint}") from None
    except (ValueError, UnicodeDecodeError) as e:  # a NUL in the path; bytes that are not UTF-8
        reason = "it is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)
        raise ConfigError(f"cannot read {str(path)!r}: {reason}. HINT: {hint}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n} is not valid JSON ({e.msg}). HINT: one JSON object per line") from None
        except RecursionError:
            raise ConfigError(f"{path}:{n} is nested too deeply to read. {schema_hint}") from None
    return out


def load_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSONL file of harness rows, checking each row's schema.

    Raises:
        ConfigError: The file is missing or unreadable, holds no rows, or a
            line is not a JSON object with the schema's keys and types.
    """
    rows = []
    for where, row in read_jsonl(path, hint="pass a JSONL file of the ground-truth harness, e.g. "
                                 "tests/fixtures/groundtruth-cpu.jsonl", schema_hint=_SCHEMA_HINT):
        row = method_row(row, where)
        _check_row_schema(row, where)
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no rows. HINT: pass a JSONL file of the ground-truth harness, e.g. "
                          "tests/fixtures/groundtruth-cpu.jsonl")
    return rows


def _check_row_schema(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a JSON {type(row).__name__}, not a row object. {_SCHEMA_HINT}")
    missing = [k for k in _ROW_REQUIRED if k not in row]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}. {_SCHEMA_HINT}")
    for key, kind in (*_ROW_REQUIRED.items(), *_ROW_OPTIONAL.items()):
        value = row.get(key)
        if value is not None and not isinstance(value, kind) or (value is None and key in _ROW_REQUIRED):
            raise ConfigError(f"{where}: {key} is {value!r:.60}, not a JSON {_JSON_NAMES[kind]}. {_SCHEMA_HINT}")
    if row["status"] not in _ROW_STATUSES:
        raise ConfigError(f"{where}: status {row['status']!r}; valid: {', '.join(_ROW_STATUSES)}. {_SCHEMA_HINT}")
    try:
        _workload(row["workload"])
    except LLMemError as e:
        raise ConfigError(f"{where}: workload: {e}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}: workload {row['workload']!r:.80} is not a Workload ({type(e).__name__}: "
                          f"{e}). {_SCHEMA_HINT}") from None


_JSON_NAMES = {str: "string", dict: "object"}
# The per-rank fields of a stub-distributed row (benchmarks/groundtruth/stub_distributed.py run_config).
_RANK_FIELDS = {"world_size": int, "tp": int, "rank": int, "options": dict}


def method_row(row: Any, where: str = "row") -> Any:
    """``row`` with its method as a ``{name, num_gpus, num_nodes, tp, rank, options}`` object.

    A row of benchmarks/groundtruth/stub_distributed.py names its preset in
    ``method`` and its rank's place in ``world_size``, ``tp``, ``rank`` and
    ``options``; any other row comes back as it is.

    Raises:
        ConfigError: A stub-distributed row lacks one of those fields or has one of the wrong type.
    """
    if not isinstance(row, dict) or row.get("runner") != "stub-distributed" or isinstance(row.get("method"), dict):
        return row
    hint = "HINT: rows of the stub's distributed runner follow benchmarks/groundtruth/stub_distributed.py"
    if not isinstance(row.get("method"), str):
        raise ConfigError(f"{where}: method is {row.get('method')!r:.60}, not a method name. {hint}")
    for key, kind in _RANK_FIELDS.items():
        value = row.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} is {value!r:.60}, not a JSON "
                              f"{'integer' if kind is int else 'object'}. {hint}")
    return {**row, "method": {"name": row["method"], "num_gpus": row["world_size"], "num_nodes": 1, "tp": row["tp"],
                              "rank": row["rank"], "options": dict(row["options"])}}


def _workload(d: dict[str, Any]):
    from llmem_plugin.workload import LoraSpec, Workload

    d = dict(d)
    lora = d.pop("lora", None)
    if lora:
        lora = LoraSpec(
            rank=lora["rank"], alpha=lora.get("alpha"), dropout=lora.get("dropout", 0.0),
            target_modules=tuple(lora.get("target_modules") or LoraSpec().target_modules),
            adapter_dtype=lora.get("adapter_dtype", "fp32"),
        )
    return Workload(**d, lora=lora)


def _model_config(row: dict[str, Any]) -> Any:
    """The row's model: a catalog name with overrides, or the full config of
    a live model (rows written by :mod:`llmem_plugin.verify.meter`)."""
    from llmem_plugin.models import catalog

    config = row.get("config")
    if isinstance(config, dict):
        import transformers

        d = dict(config)
        model_type = d.pop("model_type", None)
        if not model_type:
            raise ConfigError(f"row '{row['id']}': its config has no model_type. HINT: rows follow the schema in "
                              "benchmarks/groundtruth/README.md")
        try:
            return transformers.AutoConfig.for_model(model_type, **d)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"row '{row['id']}': cannot build its {model_type} config: {e}") from None
    return catalog.load_config(row["model"], row.get("config_overrides") or None)


def _estimate_row(row: dict[str, Any], config: Any, wl: Any, *, cache: dict[str, Any] | None = None,
                  **kw: Any) -> dict[str, int]:
    """Predict with the row's method (``single`` when it names none); ``cache`` holds the
    method estimates already made, keyed by everything but the rank."""
    from llmem_plugin.estimate import estimate

    method = row.get("method") or {}
    if row.get("seq_lens") is not None:  # steps of varying length: the same run replayed
        from llmem_plugin.techniques.varlen import estimate_variable_length

        if method.get("name", "single") != "single" or method.get("num_gpus", 1) != 1:
            raise UnsupportedError(f"row '{row['id']}': variable lengths are modelled on one GPU only")
        v = estimate_variable_length(config, wl, row["seq_lens"], steps=max(len(row.get("steps") or ()), 1), **kw)
        return {"tensor": v.peak_allocated_bytes, "allocated": v.peak_allocated_bytes,
                "reserved": v.peak_reserved_bytes, "device_total": v.device_total_bytes, "fits": v.fits}
    if method.get("name", "single") == "single" and method.get("num_gpus", 1) == 1:
        est = estimate(config, wl, **kw)
        return {"tensor": est.peak_tensor_bytes, "allocated": est.peak_allocated_bytes,
                "reserved": est.peak_reserved_bytes, "device_total": est.device_total_bytes, "fits": est.fits}
    key = json.dumps([{k: v for k, v in row.items() if k in _SAME_ESTIMATE}, {k: v for k, v in method.items()
                      if k != "rank"}, repr(kw.get("gpu")), kw.get("alloc_conf"), kw.get("torch_version"),
                      kw.get("fast"), _cudnn_sdp()], sort_keys=True, default=str)
    est = cache.get(key) if cache is not None else None
    if est is None:
        est = _estimate_method(row, method, config, wl, **kw)
        if cache is not None:
            cache[key] = est
    r = _rank(est, method.get("rank", 0))
    return {"tensor": r.peak_tensor_bytes, "allocated": r.peak_allocated_bytes, "reserved": r.peak_reserved_bytes,
            "device_total": r.device_total_bytes, "fits": all(x.fits for x in est.ranks)}


# The row fields one method estimate depends on (beside the method less its rank and the GPU, allocator
# setting, torch version and mode): rows that differ elsewhere share it.
_SAME_ESTIMATE = ("model", "config", "config_overrides", "workload", "runner", "seq_lens")


def _cudnn_sdp() -> bool:
    import torch

    return torch.backends.cuda.cudnn_sdp_enabled()


def _estimate_method(row: dict[str, Any], method: dict[str, Any], config: Any, wl: Any, **kw: Any) -> Any:
    """The row's method estimate, with the row's options less those its preset fixes."""
    from llmem_plugin.methods import estimate_method, preset_settings
    from llmem_plugin.methods.layout import Layout

    fixed = preset_settings(method["name"])
    options = dict(method.get("options") or {})
    for name in [k for k in options if k in fixed]:
        # The runner passes such an option to the engine only (stub_distributed._WORKER_ONLY); the preset carries it.
        if options[name] != fixed[name]:
            raise ConfigError(f"row '{row['id']}': option {name}={options[name]!r} contradicts method "
                              f"'{method['name']}', which fixes {name}={fixed[name]!r}. HINT: name the preset that "
                              "sets it, or drop the option")
        del options[name]
    layout = Layout(num_gpus=method.get("num_gpus", 1), num_nodes=method.get("num_nodes", 1),
                    tp=method.get("tp", 1))
    try:
        return estimate_method(method["name"], config, wl, layout=layout, gpu=kw.get("gpu"),
                               alloc_conf=kw.get("alloc_conf"), torch_version=kw.get("torch_version"),
                               fast=bool(kw.get("fast")), **options)
    except TypeError as e:  # an option the method's estimate does not take
        raise ConfigError(f"row '{row['id']}': method '{method['name']}' options {options}: {e}. HINT: rows follow "
                          "the schema in benchmarks/groundtruth/README.md") from None


def _rank(est: Any, rank: int) -> Any:
    """Rank ``rank`` of ``est``, or the reported rank alike to it.

    A method estimate reports one rank where its rules make the others alike
    (DDP, TP), or rank 0 and the last (uneven FSDP shards): an unreported
    rank is the highest reported rank below it, as
    benchmarks/groundtruth/stub_distributed.py ``_predicted_for`` reads it.
    """
    ranks = {r.rank: r for r in est.ranks}
    if rank in ranks:
        return ranks[rank]
    below = [r for r in ranks if r <= rank]
    return ranks[max(below)] if below else est.worst


def device_kind(row: dict[str, Any]) -> str:
    """The evidence ``row`` is: ``gpu``, ``stub`` or ``cpu`` (see the module docstring).

    Raises:
        ConfigError: ``device_kind`` is not one of :data:`DEVICE_KINDS`.
    """
    kind = row.get("device_kind") or {"cpu": "cpu", "stub": "stub"}.get(row.get("device"), "gpu")
    if kind not in DEVICE_KINDS:
        raise ConfigError(f"row '{row.get('id')}': device_kind {kind!r}; valid: {', '.join(DEVICE_KINDS)}. "
                          "HINT: rows follow the schema in benchmarks/groundtruth/README.md")
    return kind


@contextlib.contextmanager
def _sdpa_backends(row: dict[str, Any]) -> Iterator[None]:
    """SDPA's cuDNN backend as the stub row ran it (off unless the row says otherwise)."""
    import torch

    if device_kind(row) != "stub":
        yield
        return
    enabled = bool((row.get("stub") or {}).get("cudnn_sdp_enabled") or False)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def _predict(row: dict[str, Any], *, fast: bool, gpu_name: str | None,
             cache: dict[str, Any] | None) -> tuple[dict[str, int | None], bool | None]:
    with _sdpa_backends(row), _harness_loading(row):
        return _predict_as_run(_as_harness_built(row), fast=fast, gpu_name=gpu_name, cache=cache)


def _harness_loading(row: dict[str, Any]):
    """The setup phase of the harness that measured ``row``, where it differs from the job's.

    On the GPU and the stub device the harness empties the cache and resets the peaks before
    step 1 (benchmarks/groundtruth/cuda.py ``_Recorder.reset``, ``stub_worker._reset``): the
    replay does the same at the trace's loaded mark (:func:`llmem_plugin.estimate.peaks_after_load`).
    For torchao's NF4 the harness quantizes each linear weight in place with ``to_nf4``
    (benchmarks/groundtruth/techniques.py: ``_build_torchao``): what it measures starts from the
    NF4 weights placed, not from torchtune's build-and-load setup the estimate models for a job
    (llmem_plugin.techniques.nf4_setup).
    """
    import contextlib

    from llmem_plugin.estimate import peaks_after_load
    from llmem_plugin.trace.loading import direct_only

    if row.get("device") == "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(peaks_after_load())
    if (row.get("workload") or {}).get("quantize") == "nf4-torchao":
        stack.enter_context(direct_only())
    return stack


def _as_harness_built(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the load its harness ran: bitsandbytes' QLoRA is built as a 16-bit model on
    the device, then quantized layer by layer (benchmarks/groundtruth/techniques.py
    ``_build_quantized``: ``--load device-quantize``)."""
    wl = row.get("workload") or {}
    if row.get("device") == "cpu" or wl.get("quantize") not in ("nf4", "fp4"):
        return row
    return {**row, "workload": {**wl, "load": "device-quantize"}}


def _predict_as_run(row: dict[str, Any], *, fast: bool, gpu_name: str | None,
                    cache: dict[str, Any] | None) -> tuple[dict[str, int | None], bool | None]:
    config = _model_config(row)
    wl = _workload(row["workload"])
    if row.get("runner") == "hf-trainer":  # rows written before Workload.runner existed
        import dataclasses

        wl = dataclasses.replace(wl, runner="hf-trainer")
    env = row.get("env") or {}
    if row["device"] == "cpu":
        p = _estimate_row(row, config, wl, cache=cache, fast=fast, torch_version=env.get("torch"))
        return {"allocated": p["tensor"], "reserved": None, "device_total": None}, None
    gpu = _row_gpu(row, gpu_name)
    p = _estimate_row(row, config, wl, cache=cache, fast=fast, gpu=gpu,
                      alloc_conf=env.get("PYTORCH_CUDA_ALLOC_CONF", ""), torch_version=env.get("torch"))
    return {"allocated": p["allocated"], "reserved": p["reserved"], "device_total": p["device_total"]}, p["fits"]


def _row_gpu(row: dict[str, Any], gpu_name: str | None = None) -> Any:
    """The catalog GPU the row ran on (or ``gpu_name``), with the memory its process could use."""
    import dataclasses

    from llmem_plugin.device.gpus import get_gpu, match_device_name

    info = row.get("gpu") or {}
    gpu = get_gpu(gpu_name) if gpu_name else match_device_name(info.get("name", ""))
    if gpu is None:
        raise ConfigError(
            f"row '{row['id']}': GPU '{info.get('name')}' is not in the catalog. HINT: pass --gpu with the closest entry"
        )
    capacity = info.get("memory_bytes")
    if capacity is not None:
        capacity -= info.get("idle_used_bytes") or 0
        gpu = dataclasses.replace(gpu, memory_bytes=capacity, driver_memory_bytes=None)
    return gpu


def estimate_row(row: dict[str, Any], *, keep_trace: bool = False, **changes: Any) -> Any:
    """The single-GPU estimate of a GPU or stub row, as :func:`validate_rows` makes it (the harness's
    SDPA backends and loading), with ``changes`` to its workload (``micro_batch_size=1``: what a job that
    differs from the run predicts); ``keep_trace`` as for :func:`llmem_plugin.estimate.estimate`.

    Raises:
        UnsupportedError: A distributed or variable-length row.
    """
    import dataclasses

    from llmem_plugin.estimate import estimate

    if (row.get("method") or {}).get("name", "single") != "single" or row.get("seq_lens") is not None:
        raise UnsupportedError(f"row '{row['id']}': estimate_row covers single-GPU, fixed-shape rows. HINT: "
                               "validate_rows predicts distributed and variable-length rows")
    with _sdpa_backends(row), _harness_loading(row):
        built = _as_harness_built(row)
        wl = dataclasses.replace(_workload(built["workload"]), **changes)
        env = row.get("env") or {}
        return estimate(_model_config(built), wl, gpu=_row_gpu(row), alloc_conf=env.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                        torch_version=env.get("torch"), keep_trace=keep_trace)


def _measured(row: dict[str, Any]) -> dict[str, int | None]:
    m = row.get("measured") or {}
    out = {k: m.get(v) for k, v in _MEASURED_KEY.items()}
    idle = (row.get("gpu") or {}).get("idle_used_bytes")
    if out["device_total"] is not None and idle:
        out["device_total"] -= idle  # what the device held before the run is not the run's
    return out


def _pct(pred: int | None, meas: int | None) -> float | None:
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def check_row(row: dict[str, Any], *, fast: bool = False, gpu_name: str | None = None,
              cache: dict[str, Any] | None = None) -> RowCheck:
    """Predict one row and compare (see :func:`validate_rows`).

    Args:
        cache: Method estimates made for earlier rows (:func:`validate_rows` passes one dict to every row).

    Raises:
        ConfigError: The row's ``device_kind`` is unknown, or a stub-distributed row lacks a rank field.
    """
    row = method_row(row, f"row '{row.get('id')}'")
    status = row["status"]
    kind = device_kind(row)
    measured = _measured(row)
    if kind == "stub":
        measured["device_total"] = None  # the stub has no CUDA context: its used memory is not a GPU's
    fits_measured = {"ok": True, "oom": False}.get(status)
    base = {"id": row["id"], "runner": row.get("runner", ""), "kind": kind, "status": status,
            "edge": bool(row.get("edge")), "measured": measured, "fits_measured": fits_measured}
    none = dict.fromkeys(METRICS)
    if status in ("error", "skipped"):  # nothing was measured (skipped: a library the case needs was missing)
        what = "run failed" if status == "error" else "run skipped"
        return RowCheck(**base, predicted=none, error_pct=none, diff_bytes=none, fits_predicted=None,
                        note=f"{what}: {row.get('error') or row.get('reason') or 'unknown'}")
    try:
        predicted, fits = _predict(row, fast=fast, gpu_name=gpu_name, cache=cache)
    except LLMemError as e:
        return RowCheck(**base, predicted=none, error_pct=none, diff_bytes=none, fits_predicted=None,
                        note=f"not predicted: {e}")
    # An OOM row's peaks stop where the run died: they score only the verdict.
    errors = {m: _pct(predicted[m], measured[m]) if status == "ok" else None for m in METRICS}
    diffs = {m: predicted[m] - measured[m] if errors[m] is not None else None for m in METRICS}
    return RowCheck(**base, predicted=predicted, error_pct=errors, diff_bytes=diffs, fits_predicted=fits)


def _summary(values: list[float]) -> MetricSummary:
    if not values:
        return MetricSummary(num_rows=0, mean_abs_pct=None, max_abs_pct=None, max_under_pct=None,
                             mean_signed_pct=None, num_under=0)
    under = [-v for v in values if v < 0]
    return MetricSummary(
        num_rows=len(values),
        mean_abs_pct=sum(abs(v) for v in values) / len(values),
        max_abs_pct=max(abs(v) for v in values),
        max_under_pct=max(under, default=0.0),
        mean_signed_pct=sum(values) / len(values),
        num_under=len(under),
    )


def validate_rows(rows: Iterable[dict[str, Any]], *, fast: bool = False, gpu: str | None = None) -> ValidationReport:
    """Re-predict every row and summarise the errors.

    Args:
        rows: Harness rows (see :func:`load_rows`).
        fast: Predict with the layer-extrapolating fast mode.
        gpu: Catalog GPU to predict CUDA rows for, instead of matching each
            row's device name.

    Returns:
        The :class:`ValidationReport`.
    """
    cache: dict[str, Any] = {}  # one method estimate for the ranks of a config
    checks = [check_row(r, fast=fast, gpu_name=gpu, cache=cache) for r in rows]
    measured = [c for c in checks if c.kind != "stub"]
    stub = [c for c in checks if c.kind == "stub"]
    summary = {m: _summary([c.error_pct[m] for c in measured if c.error_pct[m] is not None]) for m in METRICS}
    stub_summary = {m: _summary([c.error_pct[m] for c in stub if c.error_pct[m] is not None]) for m in METRICS}
    scored = [c for c in measured if c.edge and c.fits_measured is not None and c.fits_predicted is not None]
    accuracy = sum(c.fits_measured == c.fits_predicted for c in scored) / len(scored) if scored else None
    exact = sum(c.diff_bytes["allocated"] == 0 and c.diff_bytes["reserved"] == 0 for c in stub)
    return ValidationReport(rows=checks, summary=summary, fits_accuracy=accuracy, num_edge_rows=len(scored),
                            skipped=[c.id for c in checks if c.note], stub_summary=stub_summary,
                            num_stub_exact=exact)
