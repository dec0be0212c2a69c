"""Third-party published GPU memory figures, re-predicted.

``benchmarks/published/measurements.jsonl`` holds one row per figure a
framework's docs, a repository's result table or a tutorial published for a
named configuration: its source (URL, the table or line, the quoted text,
date), the framework and versions, the card, the metric and the value, and
the configuration transcribed into this tool's terms (catalog model, config
overrides, workload). ``status`` is ``modelled`` when the tool can estimate
the transcription, else ``unsupported`` with ``why``; ``why`` on a modelled
row names what the transcription cannot carry (the publication's own model
code, a whole-run peak), so a large error is read against it.

Metrics and what each is compared with:

==================== ========================================================
``allocated``        ``max_memory_allocated`` (also torchtune's peak *active*
                     bytes): the estimate's peak allocated
``reserved``         ``max_memory_reserved``: peak reserved
``reserved_above_init`` peak reserved minus what was reserved at a start
                     point the row gives in ``init_reserved_bytes`` (peft's
                     MetaMathQA ``accelerator_memory_max``: reserved after a
                     1x1 ``nn.Linear``, before the model loads)
``device``           NVML / nvidia-smi used memory: device total
==================== ========================================================

:func:`validate_published` predicts every modelled row (fast mode, which
equals the full trace to the byte) and reports the signed error per metric.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llmem_plugin.errors import ConfigError, LLMemError

__all__ = ["METRICS", "PublishedCheck", "default_path", "load_published", "validate_published"]

METRICS = ("allocated", "reserved", "reserved_above_init", "device")
_UNITS = {"GB": 10**9, "GiB": 2**30, "MiB": 2**20, "MB": 10**6}
_STATUSES = ("modelled", "unsupported")
_REQUIRED = ("id", "source", "metric", "value", "unit", "status", "why")


def default_path() -> Path:
    """The set shipped in a source checkout: ``benchmarks/published/measurements.jsonl``."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "measurements.jsonl"


def load_published(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The rows of a published set, checked.

    Raises:
        ConfigError: The file is missing or a row breaks the schema.
    """
    p = Path(path) if path is not None else default_path()
    if not p.is_file():
        raise ConfigError(f"no published set at {p}. HINT: run from a source checkout, or pass --published FILE")
    from llmem_plugin.verify.validate import read_jsonl

    rows = []
    for n, row in read_jsonl(p, hint="pass --published FILE, a JSONL file of published figures",
                             schema_hint="HINT: see benchmarks/published/README.md"):
        if not isinstance(row, dict):
            raise ConfigError(f"{n}: not a JSON object. HINT: one JSON object per line")
        missing = [k for k in _REQUIRED if k not in row]
        if missing:
            raise ConfigError(f"{n}: row lacks {', '.join(missing)}. HINT: see llmem_plugin/verify/published.py")
        if row["status"] not in _STATUSES:
            raise ConfigError(f"{n}: status {row['status']!r}; valid: {', '.join(_STATUSES)}")
        if row["status"] == "modelled":
            if row["metric"] not in METRICS:
                raise ConfigError(f"{n}: metric {row['metric']!r}; valid: {', '.join(METRICS)}")
            if row["unit"] not in _UNITS:
                raise ConfigError(f"{n}: unit {row['unit']!r}; valid: {', '.join(_UNITS)}")
            if not row.get("model") or not isinstance(row.get("workload"), dict):
                raise ConfigError(f"{n}: a modelled row needs model and workload")
            if isinstance(row["value"], bool) or not isinstance(row["value"], (int, float)) or row["value"] <= 0:
                raise ConfigError(f"{n}: value {row['value']!r} is not a positive number. HINT: the figure as "
                                  "published, in unit")
            if row["metric"] == "reserved_above_init" and not isinstance(row.get("init_reserved_bytes"), int):
                raise ConfigError(f"{n}: metric reserved_above_init needs init_reserved_bytes (an integer)")
            from llmem_plugin.models import catalog
            from llmem_plugin.verify.validate import _workload

            from llmem_plugin.models.config import is_litgpt_source

            if not is_litgpt_source(row["model"]) and catalog.lookup(row["model"]) is None:
                raise ConfigError(f"{n}: model {row['model']!r} is not in the catalog. HINT: llmem models, or "
                                  "litgpt:NAME for litgpt's own class")
            try:
                _workload(row["workload"])
            except TypeError as e:  # an unknown Workload field
                raise ConfigError(f"{n}: workload {e}. HINT: the fields of llmem_plugin.workload.Workload") from None
            if row.get("seq_lens") is not None:  # batches of varying length: the lengths file beside the set
                lengths = p.parent / str(row["seq_lens"])
                if not isinstance(row["seq_lens"], str) or not lengths.is_file():
                    raise ConfigError(f"{n}: seq_lens {row['seq_lens']!r} is not a file beside {p.name}. HINT: a "
                                      "path relative to the set's folder, one sample length per line")
                row = {**row, "seq_lens": str(lengths)}
        if not isinstance(row["source"], dict) or not row["source"].get("url") or not row["source"].get("quote"):
            raise ConfigError(f"{n}: source needs url and quote")
        rows.append(row)
    return rows


@dataclass
class PublishedCheck:
    """One published figure against its prediction (bytes; error in percent, signed)."""

    id: str
    metric: str
    status: str
    measured: int | None = None
    predicted: int | None = None
    error_pct: float | None = None
    why: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "metric": self.metric, "status": self.status, "measured": self.measured,
                "predicted": self.predicted, "error_pct": self.error_pct, "why": self.why, "error": self.error}


def _predict(row: dict[str, Any]) -> int:
    from llmem_plugin.models import catalog
    from llmem_plugin.estimate import estimate
    from llmem_plugin.verify.validate import _workload

    from llmem_plugin.models.config import is_litgpt_source

    if is_litgpt_source(row["model"]):  # litgpt's own model class, built from litgpt's config table
        source = row["model"]
    else:
        source = catalog.load_config(row["model"], row.get("config_overrides") or None)
    gpu = row.get("gpu") or "h100-sxm"
    if row.get("seq_lens") is not None:  # a run of varying lengths replayed until reserved settles
        from llmem_plugin.techniques.varlen import estimate_variable_length

        v = estimate_variable_length(source, _workload(row["workload"]), row["seq_lens"], fast=True, gpu=gpu)
        est = SimpleNamespace(peak_allocated_bytes=v.peak_allocated_bytes, peak_reserved_bytes=v.peak_reserved_bytes,
                              device_total_bytes=v.device_total_bytes)
    else:
        est = estimate(source, _workload(row["workload"]), fast=True, gpu=gpu)
    metric = row["metric"]
    if metric == "allocated":
        return est.peak_allocated_bytes
    if metric == "reserved":
        return est.peak_reserved_bytes
    if metric == "reserved_above_init":
        return est.peak_reserved_bytes - row["init_reserved_bytes"]
    return est.device_total_bytes


def check_published(row: dict[str, Any]) -> PublishedCheck:
    """Predict one row (unsupported rows come back with their reason only)."""
    check = PublishedCheck(id=row["id"], metric=row["metric"], status=row["status"], why=row.get("why", ""))
    if row["status"] != "modelled":
        return check
    check.measured = round(float(row["value"]) * _UNITS[row["unit"]])
    try:
        check.predicted = _predict(row)
    except LLMemError as e:  # the transcription is refused: say so, do not estimate something else
        check.error = str(e)
        return check
    check.error_pct = 100.0 * (check.predicted - check.measured) / check.measured
    return check


def _stats(errs: list[float]) -> dict[str, Any]:
    return {"rows": len(errs), "mean_abs_pct": sum(map(abs, errs)) / len(errs),
            "mean_signed_pct": sum(errs) / len(errs), "max_abs_pct": max(map(abs, errs)),
            "within_10pct": sum(abs(e) <= 10 for e in errs)}


# Reserved memory, whichever start point: reserved_above_init subtracts a few MiB held before the model loads.
RESERVED_METRICS = ("reserved", "reserved_above_init")


def validate_published(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every row checked; per metric, and for reserved memory over both of its
    metrics (``reserved_pooled``), the count, mean |error|, mean signed error
    and max |error|."""
    checks = [check_published(r) for r in rows]
    summary = {}
    for metric in METRICS:
        errs = [c.error_pct for c in checks if c.metric == metric and c.error_pct is not None]
        if errs:
            summary[metric] = _stats(errs)
    pooled = [c.error_pct for c in checks if c.metric in RESERVED_METRICS and c.error_pct is not None]
    return {"rows": [c.to_dict() for c in checks], "summary": summary,
            "reserved_pooled": _stats(pooled) if pooled else None,
            "unsupported": sum(c.status == "unsupported" for c in checks)}
