"""``estimate()``: the single-GPU peak memory of one fine-tuning step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from llmem_plugin import modelbuild
from llmem_plugin.errors import ConfigError, LLMemError, TraceError
from llmem_plugin.step import trace_step
from llmem_plugin.tracker import MemoryCategory, Phase, TraceResult
from llmem_plugin.workload import LoraSpec, Workload

__all__ = ["Estimate", "estimate"]

# Points kept in an Estimate's timeline; the full event stream of an 8B step
# has tens of thousands of events.
_TIMELINE_POINTS = 512


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted peak device memory of one training step on one GPU.

    Attributes:
        model: What was estimated (catalog name, path or class name).
        workload: The workload traced.
        params: Parameter count (tied weights once).
        trainable_params: Parameters that receive gradients.
        num_layers: Transformer layers in the model.
        peak_allocated_bytes: Peak of live tensor bytes, 512-B rounded.
        peak_phase: Phase of the training step where the peak falls.
        peak_module: Module running when the peak was reached ("" if none).
        breakdown: Bytes per category live at the peak.
        phase_peaks: Peak bytes of each phase.
        timeline: (event index, phase, bytes), thinned to a few hundred points
            (empty in fast mode, which traces a shortened model).
        fast: Whether the layer-extrapolating fast mode produced this.
        seconds: Wall time the estimate took.
    """

    model: str
    workload: Workload
    params: int
    trainable_params: int
    num_layers: int
    peak_allocated_bytes: int
    peak_phase: Phase
    peak_module: str
    breakdown: dict[MemoryCategory, int]
    phase_peaks: dict[Phase, int]
    timeline: list[tuple[int, Phase, int]] = field(repr=False)
    fast: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "workload": self.workload.to_dict(),
            "params": self.params,
            "trainable_params": self.trainable_params,
            "num_layers": self.num_layers,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_phase": self.peak_phase.value,
            "peak_module": self.peak_module,
            "breakdown": {c.value: v for c, v in self.breakdown.items()},
            "phase_peaks": {p.value: v for p, v in self.phase_peaks.items()},
            "timeline": [[i, p.value, v] for i, p, v in self.timeline],
            "fast": self.fast,
            "seconds": round(self.seconds, 4),
        }


def _workload_from(workload: Workload | None, kwargs: dict[str, Any]) -> Workload:
    if workload is not None:
        if kwargs:
            raise ConfigError(f"pass either workload= or workload fields, not both (got {sorted(kwargs)})")
        return workload
    if "batch_size" in kwargs:
        kwargs["micro_batch_size"] = kwargs.pop("batch_size")
    lora_rank = kwargs.pop("lora_rank", None)
    if lora_rank is not None and "lora" not in kwargs:
        kwargs["lora"] = LoraSpec(rank=lora_rank)
    try:
        return Workload(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{e}. HINT: see help(llmem_plugin.Workload) for the fields") from None


def _count_params(model: nn.Module) -> tuple[int, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def _vocab_size(model: nn.Module) -> int:
    emb = model.get_input_embeddings()
    return int(emb.num_embeddings)


def _trace(model: nn.Module, workload: Workload) -> TraceResult:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    vocab = _vocab_size(model)
    modelbuild.fakeify(model, fake_mode)
    try:
        return trace_step(model, workload, vocab_size=vocab, fake_mode=fake_mode)
    except (LLMemError, ImportError, AssertionError):
        raise
    except Exception as e:  # the model's own code failed under fake tensors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TraceError(
            f"the training step of {type(model).__name__} could not be traced under fake tensors: "
            f"{type(e).__name__}: {first}. HINT: CUDA-only custom ops and data-dependent shapes cannot be "
            "traced; use the model's eager/sdpa attention and a pure-PyTorch implementation"
        ) from e


def _describe(source: Any) -> str:
    if isinstance(source, nn.Module):
        return type(source).__name__
    if isinstance(source, str):
        return source
    return getattr(source, "_name_or_path", None) or type(source).__name__


def estimate(model: Any, workload: Workload | None = None, *, fast: bool = False, **workload_fields: Any) -> Estimate:
    """Trace a fine-tuning step of ``model`` under fake tensors and report its peak.

    Args:
        model: Catalog name, config.json path, cached Hub id,
            ``PretrainedConfig`` or ``nn.Module`` (real or meta; its storage
            is never read).
        workload: The workload; or give its fields as keywords instead
            (``seq_len=2048, batch_size=1, precision="bf16-mixed", ...``).
        fast: Trace two shortened models and extrapolate per layer to the full
            depth (config sources only; modules are traced in full).

    Returns:
        The :class:`Estimate`.

    Raises:
        ConfigError: Bad model source or workload value.
        TraceError: The model's step cannot run under fake tensors.
    """
    t0 = time.perf_counter()
    wl = _workload_from(workload, dict(workload_fields))
    full = modelbuild.build_model(model, wl, device="meta")
    params, trainable = _count_params(full)
    config = getattr(full, "config", None)
    depth = modelbuild.num_layers(config) if config is not None else 0
    if fast and not isinstance(model, nn.Module):
        from llmem_plugin.fast import extrapolated_trace

        result = extrapolated_trace(model, wl, depth=depth, trace=_trace)
        timeline: list[tuple[int, Phase, int]] = []
    else:
        fast = False
        result = _trace(full, wl)
        timeline = _thin(result.timeline, _TIMELINE_POINTS)
    return Estimate(
        model=_describe(model),
        workload=wl,
        params=params,
        trainable_params=trainable,
        num_layers=depth,
        peak_allocated_bytes=result.peak_bytes,
        peak_phase=result.peak_phase,
        peak_module=result.peak_module,
        breakdown=result.breakdown,
        phase_peaks=result.phase_peaks,
        timeline=timeline,
        fast=fast,
        seconds=time.perf_counter() - t0,
    )


def _thin(timeline: list[tuple[int, Phase, int]], n: int) -> list[tuple[int, Phase, int]]:
    """Keep about ``n`` points, always including the global maximum."""
    if len(timeline) <= n:
        return list(timeline)
    stride = len(timeline) / n
    keep = {int(k * stride) for k in range(n)} | {len(timeline) - 1}
    keep.add(max(range(len(timeline)), key=lambda i: timeline[i][2]))
    return [timeline[i] for i in sorted(keep)]
