"""``estimate()``: the single-GPU peak memory of one fine-tuning step."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import num_layers
from llmem_plugin.device.allocator import AllocatorConfig, AllocatorResult, CachingAllocator, SimulatedOOM, replay
from llmem_plugin.errors import ConfigError, UnsupportedError, tracing
from llmem_plugin.device.gpus import GPU, get_gpu, size_bytes
from llmem_plugin.device.host import HostCapacity, process_baseline_bytes, resolve_host_memory
from llmem_plugin.device.overheads import (
    DeviceOverheads,
    device_overheads,
    workspace_allocations,
)
from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS, NUM_ITERATIONS, STEADY_MICRO_STEPS, micro_mark, trace_step
from llmem_plugin.trace.tracker import MemoryCategory, Phase, TraceResult
from llmem_plugin.workload import LoraSpec, Workload

__all__ = [
    "DEFAULT_GPU",
    "Estimate",
    "allocator_events",
    "capacity_bytes",
    "estimate",
    "simulate_trace",
    "uses_cublaslt",
    "vocab_size_of",
]

# Points kept in an Estimate's timeline; the full event stream of an 8B step
# has tens of thousands of events.
_TIMELINE_POINTS = 512
DEFAULT_GPU = "h100-sxm"
# Where fast mode cannot build the full event stream (llmem_plugin.trace.fastsynth)
# it extrapolates the allocator's peaks per layer. That reserved peak differed
# from the full replay by -12.3% (mamba-130m) to +32.2% (llama-3.2-3b) on the
# catalog and the layer-pattern configs in
# benchmarks/results/fast-vs-full-2026-11-25.jsonl (allocated: within 0.65%):
# the caching allocator's reserved bytes do not grow by a constant per layer.
# Such a verdict is left to the full trace unless the extrapolated need is farther
# from the capacity than that range allows: fast > cap * (1 + band) can only be
# a misfit when band >= 0.323, fast < cap * (1 - band) only a fit when
# band >= 0.123.
FAST_VERDICT_BAND = 0.35
_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted peak device memory of one training step on one GPU.

    Attributes:
        model: What was estimated (catalog name, path or class name).
        workload: The workload traced.
        params: Parameter count (tied weights once).
        trainable_params: Parameters that receive gradients.
        num_layers: Transformer layers in the model.
        gpu: Catalog name of the GPU estimated for.
        capacity_bytes: Memory the GPU offers (driver-reported total where
            known, or the ``gpu_memory`` override).
        peak_tensor_bytes: Peak of live tensor storages, each 512-B rounded.
        peak_allocated_bytes: Peak allocated bytes as the caching allocator
            counts them (``torch.cuda.max_memory_allocated``): tensors, unsplit
            block slack and the cuBLAS workspaces.
        peak_reserved_bytes: Peak of segments held by the caching allocator
            (``torch.cuda.max_memory_reserved``).
        device_total_bytes: Reserved plus what lies outside the allocator
            (CUDA context, NCCL, ``paged_bytes``): the device's used memory in nvidia-smi.
        fits: Whether the step runs within ``capacity_bytes`` (the simulated
            allocator frees its cache and retries before giving up, as torch does).
        overheads: The device overheads used.
        fragmentation: ``1 - allocated / reserved`` at the reserved peak.
        alloc_conf: The ``PYTORCH_CUDA_ALLOC_CONF`` simulated ("" = defaults).
        peak_phase: Phase of the training step where the tensor peak falls.
        peak_module: Module running when the tensor peak was reached ("" if none).
        breakdown: Bytes per category live at the tensor peak.
        phase_peaks: Peak tensor bytes of each phase.
        timeline: (event index, phase, bytes), thinned to a few hundred points
            (empty when fast mode extrapolated the allocator's peaks).
        memory_timeline: (event index, phase, allocated bytes, reserved
            bytes) of the simulated allocator after each event of the replay
            that gave ``peak_allocated_bytes`` and ``peak_reserved_bytes``,
            thinned to a few hundred points that keep both peaks. The events
            are the trace's with the cuBLAS workspaces inserted
            (:func:`allocator_events`), so an index can be a few past the
            same event's index in ``timeline``. Empty when fast mode
            extrapolated the allocator's peaks (its notes say so).
        fast: Whether fast mode (shortened traces, the full stream built
            from them) produced this.
        trace_path: How the step's stream was obtained: ``full`` (the whole
            model traced), ``synthesized`` (built from two shortened copies,
            :mod:`llmem_plugin.trace.fastsynth`; the default where exact and
            cheaper) or ``extrapolated`` (fast mode's per-layer peaks where the
            stream could not be built).
        seconds: Wall time the estimate took.
        alloc_retries: Times the simulated allocator, at this capacity, freed
            its cached blocks and retried a ``cudaMalloc``
            (``torch.cuda.memory_stats()["num_alloc_retries"]``); when above
            0, the reported peaks are the replay capped at the capacity.
        model_class: The transformers class traced (the config's
            ``architectures[0]`` decides it, :mod:`llmem_plugin.models.tasks`).
    """

    model: str
    workload: Workload
    params: int
    trainable_params: int
    num_layers: int
    gpu: str
    capacity_bytes: int
    peak_tensor_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    fits: bool
    overheads: DeviceOverheads
    fragmentation: float
    alloc_conf: str
    peak_phase: Phase
    peak_module: str
    breakdown: dict[MemoryCategory, int]
    phase_peaks: dict[Phase, int]
    timeline: list[tuple[int, Phase, int]] = field(repr=False)
    fast: bool
    seconds: float
    trace_path: str = "full"
    memory_timeline: list[tuple[int, str, int, int]] = field(default_factory=list, repr=False)
    # Paged optimizer states in CUDA managed memory (llmem_plugin.techniques.optim): in
    # device_total_bytes while resident, not in allocated/reserved, and not in
    # the fits verdict (the driver evicts them to the host under pressure).
    paged_bytes: int = 0
    # One line each on how the estimate treated something the workload does
    # not fix (llmem_plugin.techniques.moe.routing_note: MoE token routing).
    notes: tuple[str, ...] = ()
    model_class: str = ""
    alloc_retries: int = 0
    # Peak of host-resident bytes the step holds (offloaded activations in
    # pinned memory, optimizer step counters); never on the device.
    host_peak_bytes: int = 0
    # Host RAM the training process needs (host_peak_bytes plus the process'
    # own baseline, llmem_plugin.device.host.process_baseline_bytes), the node's RAM
    # it is checked against, and where that figure comes from.
    host_bytes: int = 0
    host_capacity_bytes: int = 0
    host_memory_source: str = ""
    # The setup phase (llmem_plugin.trace.loading): allocated and reserved once the
    # weights are on the GPU, before step 1 (None where the trace has no
    # setup mark). The peaks above cover it: the replay starts there.
    setup_allocated_bytes: int | None = None
    setup_reserved_bytes: int | None = None
    # With estimate(keep_trace=True): the traced step and the allocator settings it was replayed
    # under, for llmem_plugin.snapshot (the predicted snapshot); None otherwise.
    trace: TraceResult | None = field(default=None, repr=False, compare=False)
    alloc_config: AllocatorConfig | None = field(default=None, repr=False, compare=False)

    @property
    def host_fits(self) -> bool:
        """The process' host RAM is within the node's (True when no capacity is known)."""
        return not self.host_capacity_bytes or self.host_bytes <= self.host_capacity_bytes

    # GiB (2**30 bytes) views of the byte fields, for reading in a session.
    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_allocated_bytes / _GIB

    @property
    def peak_reserved_gib(self) -> float:
        return self.peak_reserved_bytes / _GIB

    @property
    def device_total_gib(self) -> float:
        return self.device_total_bytes / _GIB

    @property
    def peak_tensor_gib(self) -> float:
        return self.peak_tensor_bytes / _GIB

    @property
    def capacity_gib(self) -> float:
        return self.capacity_bytes / _GIB

    @property
    def headroom_bytes(self) -> int:
        """Capacity less the device total (negative when it does not fit)."""
        return self.capacity_bytes - self.device_total_bytes

    @property
    def headroom_gib(self) -> float:
        return self.headroom_bytes / _GIB

    def __repr__(self) -> str:
        return (f"Estimate(model={self.model!r}, gpu={self.gpu!r}, peak_allocated={self.peak_allocated_gib:.2f} GiB, "
                f"peak_reserved={self.peak_reserved_gib:.2f} GiB, device_total={self.device_total_gib:.2f} GiB "
                f"of {self.capacity_gib:.2f} GiB, fits={self.fits})")

    def __str__(self) -> str:
        """The summary tables ``llmem estimate`` prints (:func:`llmem_plugin.summary.render_estimate`), as text."""
        from rich.console import Console

        from llmem_plugin.summary import render_estimate

        buf = io.StringIO()
        render_estimate(self, Console(file=buf, width=100, color_system=None, force_terminal=False))
        return buf.getvalue().rstrip("\n")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_class": self.model_class,
            "alloc_retries": self.alloc_retries,
            "workload": self.workload.to_dict(),
            "params": self.params,
            "trainable_params": self.trainable_params,
            "num_layers": self.num_layers,
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "peak_tensor_bytes": self.peak_tensor_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "fits": self.fits,
            "overheads": self.overheads.to_dict(),
            "fragmentation": round(self.fragmentation, 6),
            "alloc_conf": self.alloc_conf,
            "peak_phase": self.peak_phase.value,
            "peak_module": self.peak_module,
            "breakdown": {c.value: v for c, v in self.breakdown.items()},
            "phase_peaks": {p.value: v for p, v in self.phase_peaks.items()},
            "timeline": [[i, p.value, v] for i, p, v in self.timeline],
            "fast": self.fast,
            "trace_path": self.trace_path,
            "seconds": round(self.seconds, 4),
            "memory_timeline": [list(point) for point in self.memory_timeline],
            "paged_bytes": self.paged_bytes,
            "notes": list(self.notes),
            "host_peak_bytes": self.host_peak_bytes,
            "host_bytes": self.host_bytes,
            "host_capacity_bytes": self.host_capacity_bytes,
            "host_memory_source": self.host_memory_source,
            "host_fits": self.host_fits,
            "setup_allocated_bytes": self.setup_allocated_bytes,
            "setup_reserved_bytes": self.setup_reserved_bytes,
        }


def _workload_from(workload: Workload | dict | None, kwargs: dict[str, Any]) -> Workload:
    if workload is not None:
        if kwargs:
            raise ConfigError(f"pass either workload= or workload fields, not both (got {sorted(kwargs)})")
        if isinstance(workload, Workload):
            return workload
        if not isinstance(workload, dict):
            raise ConfigError(
                f"workload must be a llmem_plugin.Workload or a dict of its fields, got {type(workload).__name__} "
                f"{workload!r:.60}. HINT: estimate(model, seq_len=2048, batch_size=1, precision='bf16-mixed')")
        kwargs = dict(workload)
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


def vocab_size_of(model: nn.Module) -> int:
    """Token ids are drawn below this: the input embedding's rows, or the text
    vocabulary when the embedding has more (Mllama's holds 8 extra rows past
    ``text_config.vocab_size``, MllamaTextModel, that the LM head has no logit
    for)."""
    from llmem_plugin.models import litgpt

    if litgpt.is_litgpt_model(model):
        return litgpt.vocab_size(model)
    rows = int(model.get_input_embeddings().num_embeddings)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    vocab = getattr(text, "vocab_size", None)
    return min(rows, vocab) if isinstance(vocab, int) and vocab > 0 else rows


def _trace(model: nn.Module, workload: Workload, gpu: GPU | None = None, *, tracker: Any = None,
           contexts: tuple = (), max_micro_steps: int | None = None, tag_layers: bool = False) -> TraceResult:
    """The single-GPU step of ``model`` (made fake here) on ``gpu``; ``tracker``,
    ``contexts`` and ``max_micro_steps`` as for :func:`trace_step` (e.g. a FLOP counter).
    ``tag_layers``: record each event's decoder layer (fast mode's stream synthesis)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if tag_layers and tracker is None:
        from llmem_plugin.trace.layertags import LayerTaggingTracker

        tracker = LayerTaggingTracker()

    gpu = gpu or get_gpu(DEFAULT_GPU)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    vocab = vocab_size_of(model)
    # Eager MoE experts loops get their worst-case routing (llmem_plugin.techniques.moe).
    from llmem_plugin.techniques.moe import bound_eager_routing

    bound_eager_routing(model)
    reference = None
    if workload.reference_model:
        # Built before the policy is made fake: a frozen copy is copied from meta.
        from llmem_plugin.techniques.reference import build_reference
        from llmem_plugin.trace.tracker import MemoryTracker

        tracker = tracker if tracker is not None else MemoryTracker()
        reference = build_reference(model, workload, tracker=tracker, fake_mode=fake_mode)
    modelbuild.fakeify(model, fake_mode)
    with tracing(f"the training step of {type(model).__name__}"):
        return trace_step(
            model, workload, vocab_size=vocab, fake_mode=fake_mode,
            compute_capability=gpu.compute_capability, num_sms=gpu.num_sms, tracker=tracker, contexts=contexts,
            reference=reference, max_micro_steps=max_micro_steps,
        )


# Micro-steps traced at most while waiting for the allocator to settle, and
# the longest window traced in full when it does not (step.MAX_TRACED_MICRO_STEPS).
_MAX_SETTLING_MICRO_STEPS = 32
_MAX_FULL_WINDOW = MAX_TRACED_MICRO_STEPS


def _allocator_state(alloc: CachingAllocator) -> tuple:
    """Everything the simulated allocator's next decisions depend on (no GC
    ages: ``estimate`` sets no memory fraction): the reserved bytes and every
    block's segment, offset, size, allocation and mapping. Segments are
    numbered in address order: the allocator only compares addresses, and a
    segment freed and made again (under a cap) gets a new, higher one."""
    blocks = [b for pool in (alloc.small, alloc.large) for b in (*pool.blocks.values(), *pool.unmapped_blocks.values())]
    blocks += alloc._live.values()
    rank = {base: i for i, base in enumerate(sorted({b.segment.base for b in blocks}))}
    return alloc.stats.reserved, sorted((rank[b.segment.base], b.addr - b.segment.base, b.size, b.allocated, b.mapped)
                                        for b in blocks)

def _micro_steps_repeat(trace: TraceResult, accum: int, config: AllocatorConfig, overheads: DeviceOverheads,
                        capacity: int | None, traced: int) -> bool:
    """Whether the micro-steps a shortened trace left out repeat its last
    middle one exactly (see ``llmem_plugin.trace.step.STEADY_MICRO_STEPS``): in each
    iteration the allocator is in the same state before and after that
    micro-step, in the replay without a cap and, where the step exceeds the
    capacity, in the capped one. A state that repeats stays repeating (the
    replay is deterministic and the micro-steps run the same ops), so the
    full window's peaks and final state are the shortened trace's."""
    events, _ = allocator_events(trace, overheads)
    at = [j for j, ev in enumerate(events) if ev[1] >= 0]  # trace event -> index (workspaces have keys < 0)
    at.append(len(events))
    middle = traced - 2  # the last middle micro-step traced
    keys = [micro_mark(it, mb) for it in range(NUM_ITERATIONS) for mb in (middle, accum - 1)]
    if not all(k in trace.marks for k in keys):  # a mark shared an event with another: no check, no shortcut
        return False
    bounds = [(at[trace.marks[micro_mark(it, middle)]], at[trace.marks[micro_mark(it, accum - 1)]])
              for it in range(NUM_ITERATIONS)]
    caps: list[int | None] = [None]
    for cap in caps:
        alloc = CachingAllocator(config, capacity_bytes=cap)
        handles: dict[int, int] = {}
        want = {i for pair in bounds for i in pair}
        states: dict[int, tuple] = {}
        oom = False
        for j, (sign, key, nbytes) in enumerate(events + [(0, 0, 0)]):
            if j in want:
                states[j] = _allocator_state(alloc)
            if sign > 0 and nbytes > 0:
                try:
                    handles[key] = alloc.malloc(nbytes)
                except SimulatedOOM:
                    oom = True
                    break
            elif sign < 0 and key in handles:
                alloc.free(handles.pop(key))
        for start, end in bounds:
            if start not in states or end not in states:
                # Out of memory before this iteration's repetition: in the
                # part the full window shares, so it runs out there too.
                assert oom
                break
            if states[start] != states[end]:
                return False
        over = capacity is not None and alloc.stats.peak_reserved + overheads.outside_allocator_bytes > capacity
        if cap is None and over:  # the verdict comes from the capped replay (simulate_trace): check it too
            caps.append(max(capacity - overheads.outside_allocator_bytes, 0))
    return True


def _steady_trace(model: nn.Module, workload: Workload, gpu: GPU, *, config: AllocatorConfig,
                  overheads: DeviceOverheads, capacity: int | None, notes: list[str],
                  tag_layers: bool = False) -> TraceResult:
    """The step of ``model`` with only the first micro-steps and the last of a
    long accumulation window traced, the others repeating the last middle one
    exactly (checked on the replay). :data:`STEADY_MICRO_STEPS` are tried
    first; where the allocator has not settled by then (a capacity that makes
    it free its cache and retry can take longer), twice as many, up to
    :data:`_MAX_SETTLING_MICRO_STEPS`; then every micro-step. Appends a line
    on what was done to ``notes``.

    Raises:
        UnsupportedError: The allocator does not settle and the window is
            too long to trace every micro-step.
    """
    accum = workload.grad_accum_steps
    if accum <= STEADY_MICRO_STEPS:
        return _trace(model, workload, gpu, tag_layers=tag_layers)
    pristine = copy.deepcopy(model)  # tracing makes a model fake
    limit = STEADY_MICRO_STEPS
    while limit < accum and limit <= _MAX_SETTLING_MICRO_STEPS:
        short = _trace(model, workload, gpu, max_micro_steps=limit, tag_layers=tag_layers)
        last = limit - 1
        if _micro_steps_repeat(short, accum, config, overheads, capacity, limit):
            notes.append(f"gradient accumulation: micro-steps 1-{last} and {accum} of {accum} traced; "
                         f"micro-steps {last + 1}-{accum - 1} repeat micro-step {last} exactly (the simulated "
                         f"allocator's state is the same before and after it)")
            return short
        model = copy.deepcopy(pristine)
        limit *= 2
    if accum > _MAX_FULL_WINDOW:
        raise UnsupportedError(
            f"grad_accum_steps {accum}: the simulated allocator has not settled after "
            f"{_MAX_SETTLING_MICRO_STEPS} micro-steps, and tracing all {accum} is refused (above "
            f"{_MAX_FULL_WINDOW}), as it would take hours. HINT: estimate with --grad-accum {_MAX_FULL_WINDOW} or "
            "fewer (or a larger gpu_memory, if the allocator frees its cache and retries at this capacity)")
    notes.append(f"gradient accumulation: the simulated allocator did not settle within "
                 f"{min(limit // 2, accum)} micro-steps, so all {accum} were traced")
    return _trace(model, workload, gpu, tag_layers=tag_layers)


def _describe(source: Any) -> str:
    if isinstance(source, nn.Module):
        return type(source).__name__
    if isinstance(source, str):
        return source
    return getattr(source, "_name_or_path", None) or type(source).__name__


def uses_cublaslt(model: nn.Module) -> bool:
    """Whether a Linear with bias runs (addmm's cuBLASLt path); transformers'
    GPT-2-style Conv1D calls addmm with its bias too."""
    return any(
        getattr(m, "bias", None) is not None and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
        for m in model.modules()
    )


def allocator_events(trace: TraceResult, overheads: DeviceOverheads) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The trace's event stream with the cuBLAS workspaces inserted where a
    CUDA run creates them: each phase's thread (forward: the main thread;
    backward: the autograd engine's) makes its own on its first cuBLAS call,
    after that call's output (the trace's ``cublas:<phase>`` mark,
    :mod:`llmem_plugin.trace.emulation.kernels`); at the start of the phase in
    traces without the mark.

    Returns:
        The events and, aligned with them, each event's phase. (``trace.timeline``
        holds one entry per event of ``trace.events``, so it gives the phases.)
    """
    pending = {Phase(k): v for k, v in workspace_allocations(overheads).items()}
    at: dict[int, list[tuple[Phase, list[int]]]] = {}
    for phase in list(pending):
        pos = trace.marks.get(f"cublas:{phase.value}")
        if pos is not None:
            at.setdefault(pos, []).append((phase, pending.pop(phase)))
    out: list[tuple[int, int, int]] = []
    phases: list[str] = []
    key = -1

    def insert(phase: Phase, sizes: list[int]) -> None:
        nonlocal key
        for nbytes in sizes:
            out.append((1, key, nbytes))  # never freed
            phases.append(phase.value)
            key -= 1

    for i, (ev, (_, phase, _)) in enumerate(zip(trace.events, trace.timeline, strict=True)):
        for ph, sizes in at.pop(i, ()):
            insert(ph, sizes)
        insert(phase, pending.pop(phase, []))
        out.append(ev)
        phases.append(phase.value)
    for pos in sorted(at):  # marks after the last event
        for ph, sizes in at[pos]:
            insert(ph, sizes)
    return out, phases


def capacity_bytes(gpu_memory: int | str | None) -> int | None:
    """A ``gpu_memory`` override as bytes.

    Args:
        gpu_memory: Bytes (an int of at least 1 MiB), a size with its unit
            (``"80GiB"``, ``"40GB"``, ``"81920MiB"``; a bare number in a
            string is GiB, as :func:`llmem_plugin.device.gpus.parse_memory` reads
            it), or None.

    Raises:
        ConfigError: Another type, a size that does not parse, or an int
            below 1 MiB (almost surely meant in GiB).
    """
    if gpu_memory is None:
        return None
    return size_bytes(gpu_memory, name="gpu_memory", what="GPU memory", example="80GiB")


def _resolve_gpu(gpu: GPU | str | None, gpu_memory: int | str | None) -> GPU:
    import dataclasses

    if gpu is not None and not isinstance(gpu, (GPU, str)):
        raise ConfigError(f"gpu must be a catalog name or a llmem_plugin.GPU, got {type(gpu).__name__} {gpu!r:.60}. "
                          "HINT: gpu='h100-sxm' (any name `llmem gpus` lists); the capacity goes in gpu_memory=")
    g = get_gpu(DEFAULT_GPU if gpu is None else gpu) if not isinstance(gpu, GPU) else gpu
    memory = capacity_bytes(gpu_memory)
    if memory is not None:
        g = dataclasses.replace(g, memory_bytes=memory, driver_memory_bytes=None)
    return g


def _check_source(model: Any) -> None:
    """Refuse, in one line, a model source the step cannot be traced for:
    a module that is not a causal LM, or a path that does not exist."""
    if isinstance(model, nn.Module):
        # trace_step runs model(input_ids=..., labels=...) and reads the loss
        # it returns; get_input_embeddings() gives the vocabulary to draw from.
        if not callable(getattr(model, "get_input_embeddings", None)):
            raise UnsupportedError(
                f"{type(model).__name__} is not a causal language model: the traced step calls "
                "model(input_ids=..., labels=...) for its loss and reads the vocabulary from get_input_embeddings(); "
                "no other step or input spec is modelled. HINT: pass a transformers causal LM "
                "(AutoModelForCausalLM), a peft model of one, or its config")
        from llmem_plugin.models.tasks import model_task

        model_task(model)  # refuses a seq2seq, vision-language, ... module in one line
        return
    if not isinstance(model, (str, os.PathLike)):
        return
    text = os.fspath(model)
    from llmem_plugin.models import catalog
    from llmem_plugin.models.config import is_litgpt_source

    if is_litgpt_source(text):  # llmem_plugin.models.litgpt checks its name or file
        return

    looks_like_path = text.startswith((".", "/", "~")) or text.endswith(".json") or text.count("/") > 1 or "\\" in text
    if looks_like_path and catalog.lookup(text) is None and not os.path.exists(os.path.expanduser(text)):
        raise ConfigError(f"model path {text!r} does not exist. HINT: pass an existing config.json (or its folder), "
                          "or a catalog name from `llmem models`")


_peaks_after_load = [False]


@contextlib.contextmanager
def peaks_after_load() -> Iterator[None]:
    """Within this block :func:`simulate_trace` calls ``torch.cuda.empty_cache()`` and
    ``torch.cuda.reset_peak_memory_stats()`` at the trace's ``loaded`` mark, so its peaks are those
    of the steps after a setup whose cached blocks were released, as a job that does so reads them
    (benchmarks/groundtruth's harness does, before step 1: ``_Recorder.reset``)."""
    _peaks_after_load.append(True)
    try:
        yield
    finally:
        _peaks_after_load.pop()


def simulate_trace(
    trace: TraceResult,
    config: AllocatorConfig,
    overheads: DeviceOverheads,
    capacity: int | None,
    *,
    timeline_points: int = 0,
) -> tuple[AllocatorResult, bool]:
    """Replay without a cap; when the result exceeds the GPU, replay again
    under it, where the allocator frees its cache and retries before OOM.

    Args:
        trace: The traced step.
        config: The allocator settings simulated.
        overheads: Device overheads (cuBLAS workspaces, CUDA context).
        capacity: Device bytes available; None = unlimited.
        timeline_points: Passed to both replays (see :func:`replay`): the
            returned result carries the thinned timeline of its own replay.

    Returns:
        The result reported (the capped replay's when it ran and fit) and
        whether the step fits.
    """
    events, phases = allocator_events(trace, overheads)
    events, phases = settled_events(trace, events, phases, config)
    from llmem_plugin.trace.loading import LOADED_MARK

    loaded = trace.marks.get(f"{LOADED_MARK}:{Phase.SETUP.value}") if _peaks_after_load[-1] else None
    reset = None if loaded is None else trace_positions(events)[loaded]
    free = replay(events, config, labels=phases, timeline_points=timeline_points, empty_cache_at=reset)
    if capacity is None:
        return free, True
    if free.peak_reserved_bytes + overheads.outside_allocator_bytes <= capacity:
        return free, True
    capped = replay(
        events, config, capacity_bytes=max(capacity - overheads.outside_allocator_bytes, 0),
        labels=phases, timeline_points=timeline_points, empty_cache_at=reset,
    )
    if capped.oom:
        return free, False
    return capped, True


# Steps played past the traced ones at most, looking for the step after which reserved stops growing.
_MAX_EXTRA_STEPS = 4


def settled_events(trace: TraceResult, events: list[tuple[int, int, int]], phases: list[str],
                   config: AllocatorConfig) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The stream replayed for the steady state: as traced, or, where ties between equal-size free
    blocks go to the newest segment (``config.large_segments_descend``), with the last traced step
    played again until reserved stops growing (:mod:`llmem_plugin.device.steady`)."""
    from llmem_plugin.device.steady import repeat_last_iteration
    from llmem_plugin.trace.step import NUM_ITERATIONS, micro_mark

    pos = trace.marks.get(micro_mark(NUM_ITERATIONS - 1, 0))
    if not config.large_segments_descend or pos is None:
        return events, phases
    start = trace_positions(events)[pos]
    best, reserved = (events, phases), replay(events, config).peak_reserved_bytes
    for times in range(1, _MAX_EXTRA_STEPS + 1):
        longer = repeat_last_iteration(events, start, times)
        if longer is None:
            break
        more = replay(longer, config).peak_reserved_bytes
        if more == reserved:
            break
        best, reserved = (longer, phases + phases[start:] * times), more
    return best


def trace_positions(events: list[tuple[int, int, int]]) -> list[int]:
    """Where each trace event lies in :func:`allocator_events`' output, plus its length at the end.

    allocator_events keeps the trace's events in order and only inserts
    workspace allocations (negative keys): the k-th event with a key >= 0 is
    the trace's event k.
    """
    return [j for j, (_, key, _) in enumerate(events) if key >= 0] + [len(events)]


def setup_peaks(trace: TraceResult, config: AllocatorConfig, overheads: DeviceOverheads) -> tuple[int, int] | None:
    """Peak allocated and reserved of the setup phase: the replay up to the
    trace's ``loaded`` mark (:data:`llmem_plugin.trace.step.LOADED_MARK`), or None without it."""
    from llmem_plugin.trace.loading import LOADED_MARK

    pos = trace.marks.get(f"{LOADED_MARK}:{Phase.SETUP.value}")
    if pos is None:
        return None
    events, _ = allocator_events(trace, overheads)
    res = replay(events[:trace_positions(events)[pos]], config)
    return res.peak_allocated_bytes, res.peak_reserved_bytes


def _extrapolated_simulation(ext: Any, config: AllocatorConfig, overheads: DeviceOverheads) -> AllocatorResult:
    """Allocator peaks of the full depth from the two shortened traces.

    As for the tensor breakdown, each phase is extrapolated on its own (its
    peak allocated, and the reserved bytes held by its end) and the largest
    phase wins: the global peak can move between phases with depth.
    """
    short, long = (simulate_trace(r, config, overheads, None)[0] for r in (ext.short, ext.long))

    def per_phase(attr: str) -> int:
        values = []
        for phase, v2 in getattr(long, attr).items():
            v1 = getattr(short, attr).get(phase, v2)
            values.append(v1 + round(ext.scale * (v2 - v1)))
        return max(values, default=0)

    allocated = per_phase("phase_allocated_bytes")
    reserved = max(per_phase("phase_reserved_bytes"), allocated)
    return AllocatorResult(
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        peak_requested_bytes=ext.extrapolate(lambda r: r.peak_bytes),
        reserved_at_end_bytes=reserved,
        fragmentation=long.fragmentation,
        num_segments=long.num_segments,
        num_alloc_retries=0,
    )


def estimate(
    model: Any,
    workload: Workload | None = None,
    *,
    fast: bool = False,
    full: bool = False,
    gpu: GPU | str | None = None,
    gpu_memory: int | str | None = None,
    alloc_conf: AllocatorConfig | str | None = None,
    torch_version: str | None = None,
    host_memory: int | str | None = None,
    keep_trace: bool = False,
    **workload_fields: Any,
) -> Estimate:
    """Trace a fine-tuning step of ``model`` under fake tensors and report its peak.

    By default (neither ``fast`` nor ``full``) the step's event stream is built
    from two shortened copies of the model where that is exact and cheaper
    (:mod:`llmem_plugin.trace.fastsynth`: the copies together hold fewer layers
    than the model, and the stream can be built), else the whole model is
    traced; ``Estimate.trace_path`` says which.

    Args:
        model: Catalog name, config.json path, cached Hub id,
            ``PretrainedConfig`` or ``nn.Module`` (real or meta; its storage
            is never read).
        workload: The workload (or a dict of its fields); or give its
            fields as keywords instead (``seq_len=2048, batch_size=1,
            precision="bf16-mixed", lora={"rank": 16}, ...``). Lightning's
            precision names are accepted (``"bf16-true"`` is ``"bf16"``).
        fast: Trace two shortened models, extrapolate the tensor breakdown
            per layer and build the full model's event stream from the longer
            copy's (:mod:`llmem_plugin.trace.fastsynth`), replayed like a full
            trace: the same peaks and verdict (config sources only; modules
            are traced in full). Where the stream cannot be built (a note
            says why), the allocator's peaks are extrapolated per layer
            too, and within ``FAST_VERDICT_BAND`` of the capacity the full
            trace runs instead (``Estimate.fast`` is then False).
        full: Trace the whole model, never a shortened copy.
        gpu: Catalog GPU (name or :class:`GPU`); default H100 SXM. Sets the
            kernel choices emulated, the workspace sizes and the capacity.
        gpu_memory: Capacity overriding the catalog's: bytes (an int of at
            least 1 MiB) or a size with its unit (``"80GiB"``, ``"40GB"``).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` (string or parsed); the
            environment's if None.
        torch_version: Torch the job will run, for version-dependent overheads;
            the installed one if None.
        host_memory: The node's host RAM to check the process' host memory
            against: bytes, a size string ("64GiB"), "local" (this machine's
            RAM), or None for the catalog's instance with this GPU
            (:func:`llmem_plugin.device.host.resolve_host_memory`).
        keep_trace: Keep the traced step on the estimate (``Estimate.trace``), from which
            :func:`llmem_plugin.snapshot.predict.snapshot_of` makes the predicted memory snapshot.

    Returns:
        The :class:`Estimate`.

    Raises:
        ConfigError: Bad model source (e.g. a path that does not exist),
            workload, GPU or allocator option.
        UnsupportedError: A module that is not a causal LM, or a setting not
            modelled.
        TraceError: The model's step cannot run under fake tensors.
    """
    t0 = time.perf_counter()
    inputs = _resolve_inputs(model, workload, workload_fields, gpu=gpu, gpu_memory=gpu_memory, alloc_conf=alloc_conf,
                             host_memory=host_memory)
    inputs = dataclasses.replace(inputs, alloc_config=inputs.alloc_config.for_torch(torch_version))
    if fast and full:
        raise ConfigError("fast and full both set: fast mode traces shortened copies, full the whole model. "
                          "HINT: pass one of --fast and --full")
    built = _build(model, inputs, torch_version=torch_version)
    traced = _trace_model(model, inputs, built, mode="fast" if fast else "full" if full else "auto")
    replayed = _replay(traced, inputs, built)
    est = _assemble(model, inputs, built, traced, replayed, seconds=time.perf_counter() - t0)
    if keep_trace:
        if traced.extrapolated is not None:
            raise UnsupportedError("the predicted snapshot needs the step's event stream, and fast mode "
                                   "extrapolated the peaks instead of building it. HINT: drop --fast")
        est = dataclasses.replace(est, trace=traced.result, alloc_config=inputs.alloc_config)
    return est


# The steps of estimate(), in the order it runs them: resolve the inputs, build
# the model on the meta device, trace its step, replay the trace through the
# caching allocator, and assemble the Estimate.


@dataclass(frozen=True, kw_only=True)
class _Inputs:
    """The estimate's inputs, checked and resolved (:func:`_resolve_inputs`)."""

    workload: Workload
    gpu: GPU  # with the gpu_memory override applied
    host: HostCapacity  # the node's host RAM
    alloc_config: AllocatorConfig


def _resolve_inputs(model: Any, workload: Workload | dict | None, workload_fields: dict[str, Any], *,
                    gpu: GPU | str | None, gpu_memory: int | str | None, alloc_conf: AllocatorConfig | str | None,
                    host_memory: int | str | None) -> _Inputs:
    """Step 1: refuse a model source that cannot be traced, build the workload
    and check its techniques, and resolve the GPU, the host RAM and the allocator settings.

    Raises:
        ConfigError, UnsupportedError: As :func:`estimate`.
    """
    _check_source(model)
    wl = _workload_from(workload, dict(workload_fields))
    from llmem_plugin.techniques import check_supported

    check_supported("single", wl)
    target = _resolve_gpu(gpu, gpu_memory)
    host = resolve_host_memory(host_memory, gpu=target, gpus_per_node=1)
    config = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
    return _Inputs(workload=wl, gpu=target, host=host, alloc_config=config)


@dataclass(frozen=True, kw_only=True)
class _Built:
    """The model on the meta device, and what it tells before any trace (:func:`_build`)."""

    model: nn.Module  # made fake when the full step is traced
    config: Any  # its config (None for a module without one)
    params: int
    trainable_params: int
    paged_bytes: int  # paged optimizer states (llmem_plugin.techniques.optim)
    num_layers: int
    overheads: DeviceOverheads


def _build(model: Any, inputs: _Inputs, *, torch_version: str | None) -> _Built:
    """Step 2: the model on the meta device with the workload's adapters and
    quantization, its parameter counts, its paged optimizer states, its depth
    and the device overheads (the cuBLASLt workspace where a Linear has a bias)."""
    wl = inputs.workload
    full = modelbuild.build_model(model, wl, device="meta")
    params, trainable = _count_params(full)
    from llmem_plugin.techniques.optim import paged_state_bytes

    paged = paged_state_bytes([p for p in full.parameters() if p.requires_grad], wl.optimizer)
    model_config = getattr(full, "config", None)
    depth = num_layers(model_config) if model_config is not None else 0
    overheads = device_overheads(inputs.gpu.compute_capability, torch_version=torch_version,
                                 uses_cublaslt=uses_cublaslt(full))
    return _Built(model=full, config=model_config, params=params, trainable_params=trainable, paged_bytes=paged,
                  num_layers=depth, overheads=overheads)


@dataclass(frozen=True, kw_only=True)
class _Traced:
    """The traced step (:func:`_trace_model`).

    Attributes:
        result: The trace replayed; where fast mode extrapolated the
            allocator's peaks, the extrapolated trace whose tensor figures are reported.
        fast: Whether fast mode produced it.
        host_peak_bytes: Peak of host-resident bytes (fast mode: extrapolated per layer).
        extrapolated: Fast mode's allocator peaks and verdict, extrapolated
            per layer where the full event stream could not be built (the
            trace is then not replayed); None otherwise.
        notes: Lines on what fast mode and the accumulation window did.
        path: ``Estimate.trace_path``.
    """

    result: TraceResult
    fast: bool
    host_peak_bytes: int
    extrapolated: tuple[AllocatorResult, bool] | None = None
    notes: tuple[str, ...] = ()
    path: str = "full"


def _trace_model(model: Any, inputs: _Inputs, built: _Built, *, mode: str) -> _Traced:
    """Step 3: the step of the built model under fake tensors, a long
    accumulation window shortened where it repeats (:func:`_steady_trace`);
    with ``fast``, built from two shortened copies instead where it can be
    (:func:`_fast_trace`). Read from the trace cache where an earlier run
    traced the same step (:mod:`llmem_plugin.trace.cache`)."""
    from llmem_plugin.trace.cache import default_cache

    cache = default_cache()
    key = _trace_key(model, inputs, built, mode=mode) if cache is not None else None
    hit = cache.get(key) if key is not None else None
    if isinstance(hit, _Traced):
        return dataclasses.replace(hit, notes=hit.notes + (
            f"the step's trace was read from the trace cache ({cache.root}); --no-cache traces it anew",))
    traced = _trace_model_uncached(model, inputs, built, mode=mode)
    if key is not None:
        cache.put(key, traced)
    return traced


def _trace_key(model: Any, inputs: _Inputs, built: _Built, *, mode: str) -> str | None:
    """The trace cache's key for this step, or None where no config names the model (a module given
    as such, a config without a JSON form)."""
    if isinstance(model, nn.Module) or not hasattr(built.config, "to_json_string"):
        return None
    from llmem_plugin.trace.cache import make_key

    cls = type(built.model)
    return make_key("single", {
        "source": model if isinstance(model, (str, os.PathLike)) else None,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": built.config.to_json_string(use_diff=False),
        "workload": inputs.workload, "gpu": inputs.gpu, "alloc": inputs.alloc_config, "overheads": built.overheads,
        "mode": mode,
    })


def _trace_model_uncached(model: Any, inputs: _Inputs, built: _Built, *, mode: str) -> _Traced:
    """:func:`_trace_model` without the cache. ``mode``: ``fast`` (shortened copies; where the stream
    cannot be built, extrapolated peaks), ``auto`` (shortened copies only where the built stream is
    exact and they trace fewer layers than the model; else the whole model) or ``full``."""
    notes: list[str] = []  # fast mode's lines
    accum_notes: list[str] = []  # the accumulation window's, one per trace

    def trace(m: nn.Module, w: Workload, *, tag_layers: bool = False) -> TraceResult:
        return _steady_trace(m, w, inputs.gpu, config=inputs.alloc_config, overheads=built.overheads,
                             capacity=inputs.gpu.capacity_bytes, notes=accum_notes, tag_layers=tag_layers)

    from llmem_plugin.models.config import is_litgpt_source

    if mode != "full" and is_litgpt_source(model):  # fast mode builds shortened transformers configs
        if mode == "fast":
            notes.append("fast mode does not apply to a litgpt model: its step was traced in full")
        mode = "full"
    traced = None
    if mode != "full" and not isinstance(model, nn.Module):
        traced = _fast_trace(model, inputs, built, trace, notes, exact_only=mode == "auto")
        if mode == "auto":  # the shortened copies were not asked for: their fallback lines are not news
            notes.clear()
    if traced is None:
        result = trace(built.model, inputs.workload)
        traced = _Traced(result=result, fast=False, host_peak_bytes=result.host_peak_bytes)
    return dataclasses.replace(traced, notes=tuple(notes) + tuple(dict.fromkeys(accum_notes)))


def _fast_trace(model: Any, inputs: _Inputs, built: _Built, trace: Any, notes: list[str], *,
                exact_only: bool = False) -> _Traced | None:
    """Fast mode: the full step's event stream built from two shortened
    copies (:mod:`llmem_plugin.trace.fastsynth`); where it cannot be built,
    the allocator's peaks extrapolated per layer, unless the verdict is within
    :data:`FAST_VERDICT_BAND` of the capacity. Appends its lines to ``notes``.

    With ``exact_only`` (the default path of :func:`estimate`), only a built
    stream is taken, and only from copies that together hold fewer layers
    than the model.

    Returns:
        The traced step, or None where the full trace is to run instead
        (layer kinds unknown, or a verdict too close to call; with
        ``exact_only``, no cheaper copies or no built stream).
    """
    from llmem_plugin.trace import loading
    from llmem_plugin.trace.fast import extrapolated_trace
    from llmem_plugin.trace.fastsynth import SynthesisError, full_depth_trace

    wl = inputs.workload
    splice_setup = loading.has_transients(wl)  # the copies load directly; the full model's setup is spliced in
    with loading.direct_only() if splice_setup else contextlib.nullcontext():
        ext = extrapolated_trace(model, wl, depth=built.num_layers, trace=lambda m, w: trace(m, w, tag_layers=True),
                                 trace_full=trace, cheaper_only=exact_only)
    result = ext.result
    notes.extend([ext.note] if ext.note else [])
    if result is None:  # layer kinds unknown: the full trace
        return None
    extrapolated = None
    if ext.short is None and splice_setup:  # the model itself was traced, loading directly
        result = loading.splice(loading.load_trace(modelbuild.build_model(model, wl, device="meta"), wl), result)
    elif ext.short is not None:
        try:
            result = full_depth_trace(ext.short, ext.long, ext.plan, result)
            if splice_setup:
                result = loading.splice(loading.load_trace(modelbuild.build_model(model, wl, device="meta"), wl),
                                        result)
        except SynthesisError as e:
            if splice_setup or exact_only:
                # Extrapolated peaks leave the setup phase out, and it can be the peak (torchao's to_nf4,
                # an fp32 cast): a verdict on the step alone could say "fits" wrongly. The full trace decides.
                return None
            sim = _extrapolated_simulation(ext, inputs.alloc_config, built.overheads)
            total = sim.peak_reserved_bytes + built.overheads.outside_allocator_bytes
            capacity = inputs.gpu.capacity_bytes
            # Too close to call from an extrapolation: the full trace decides.
            if abs(total - capacity) <= FAST_VERDICT_BAND * capacity:
                return None
            extrapolated = sim, total <= capacity
            notes.append(f"fast mode extrapolated the allocator's peaks per layer, as the full event "
                         f"stream could not be built ({e}): reserved may be off by up to "
                         f"{FAST_VERDICT_BAND:.0%}; drop --fast for the exact figure")
    path = "extrapolated" if extrapolated is not None else "synthesized" if ext.short is not None else "full"
    return _Traced(result=result, fast=True, host_peak_bytes=ext.extrapolate(lambda r: r.host_peak_bytes),
                   extrapolated=extrapolated, path=path)


@dataclass(frozen=True, kw_only=True)
class _Replayed:
    """The traced step through the simulated caching allocator (:func:`_replay`)."""

    sim: AllocatorResult
    fits: bool
    timeline: list[tuple[int, Phase, int]]  # the trace's, thinned
    memory_timeline: list[tuple[int, str, int, int]]  # the replay's, thinned
    setup: tuple[int, int] | None  # allocated and reserved at the end of the setup phase


def _replay(traced: _Traced, inputs: _Inputs, built: _Built) -> _Replayed:
    """Step 4: the trace's events (the cuBLAS workspaces inserted) through
    the caching allocator, replayed again under the capacity where it
    exceeds it (:func:`simulate_trace`), and the setup phase's peaks; fast
    mode's extrapolated peaks as they are."""
    if traced.extrapolated is not None:
        sim, fits = traced.extrapolated
        return _Replayed(sim=sim, fits=fits, timeline=[], memory_timeline=[], setup=None)
    sim, fits = simulate_trace(traced.result, inputs.alloc_config, built.overheads, inputs.gpu.capacity_bytes,
                               timeline_points=_TIMELINE_POINTS)
    return _Replayed(sim=sim, fits=fits, timeline=_thin(traced.result.timeline, _TIMELINE_POINTS),
                     memory_timeline=sim.timeline,
                     setup=setup_peaks(traced.result, inputs.alloc_config, built.overheads))


def _assemble(model: Any, inputs: _Inputs, built: _Built, traced: _Traced, replayed: _Replayed, *,
              seconds: float) -> Estimate:
    """Step 5: the :class:`Estimate` from the steps' results: the device total
    is the reserved peak, plus the overheads outside the allocator, plus the
    paged optimizer states; the host total adds the process' own baseline."""
    full, result, sim, overheads, wl = built.model, traced.result, replayed.sim, built.overheads, inputs.workload
    return Estimate(
        model=_describe(model),
        model_class=type(full.get_base_model() if hasattr(full, "get_base_model") else full).__name__,
        workload=wl,
        params=built.params,
        trainable_params=built.trainable_params,
        num_layers=built.num_layers,
        gpu=inputs.gpu.name,
        capacity_bytes=inputs.gpu.capacity_bytes,
        peak_tensor_bytes=result.peak_bytes,
        peak_allocated_bytes=sim.peak_allocated_bytes,
        peak_reserved_bytes=sim.peak_reserved_bytes,
        device_total_bytes=sim.peak_reserved_bytes + overheads.outside_allocator_bytes + built.paged_bytes,
        fits=replayed.fits,
        overheads=overheads,
        fragmentation=sim.fragmentation,
        alloc_retries=sim.num_alloc_retries,
        alloc_conf=inputs.alloc_config.to_env(),
        peak_phase=result.peak_phase,
        peak_module=result.peak_module,
        breakdown=result.breakdown,
        phase_peaks=result.phase_peaks,
        timeline=replayed.timeline,
        fast=traced.fast,
        trace_path=traced.path,
        seconds=seconds,
        memory_timeline=replayed.memory_timeline,
        paged_bytes=built.paged_bytes,
        host_peak_bytes=traced.host_peak_bytes,
        host_bytes=traced.host_peak_bytes + process_baseline_bytes(),
        host_capacity_bytes=inputs.host.node_bytes,
        host_memory_source=inputs.host.source,
        notes=_notes(built.config, wl) + traced.notes,
        setup_allocated_bytes=None if replayed.setup is None else replayed.setup[0],
        setup_reserved_bytes=None if replayed.setup is None else replayed.setup[1],
    )


def _notes(model_config: Any, workload: Workload) -> tuple[str, ...]:
    from llmem_plugin.techniques.moe import routing_note
    from llmem_plugin.models.tasks import image_note

    return tuple(n for n in (routing_note(model_config, workload), image_note(model_config, workload),
                             _adapter_note(workload)) if n)


def _adapter_note(workload: Workload) -> str | None:
    """Say so when ``--lora-adapter-dtype base`` changes nothing: fp32 weights make fp32 adapters."""
    lora = workload.lora
    if lora is not None and lora.adapter_dtype == "base" and workload.precision.param_dtype == torch.float32:
        return (f"LoRA adapter dtype 'base': the weights are fp32 under {workload.precision.value}, "
                "so the adapters are fp32 as with peft's default")
    return None


def _thin(timeline: list[tuple[int, Phase, int]], n: int) -> list[tuple[int, Phase, int]]:
    """Keep about ``n`` points, always including the global maximum."""
    if len(timeline) <= n:
        return list(timeline)
    stride = len(timeline) / n
    keep = {int(k * stride) for k in range(n)} | {len(timeline) - 1}
    keep.add(max(range(len(timeline)), key=lambda i: timeline[i][2]))
    return [timeline[i] for i in sorted(keep)]
