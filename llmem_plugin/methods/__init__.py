"""Distributed fine-tuning methods: per-rank memory and communication.

In: a model, a workload and a Layout. Out: a MethodEstimate, every rank's three numbers and its traffic.

One module per method family, all with the same signature::

    estimate(model, workload, *, layout, gpu, alloc_conf, torch_version,
             preset, **options) -> MethodEstimate

Each module's ``PRESETS`` maps the registry names it serves to their settings
(the Lightning style: ``zero3_offload`` -> ZeRO stage 3 + optimizer offload).
:func:`method_names` lists every name; an unknown one is an error that lists
them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.base import MethodEstimate, RankMemory
from llmem_plugin.methods.layout import Layout

__all__ = ["Layout", "MethodEstimate", "RankMemory", "estimate_method", "extrapolated", "method_names",
           "preset_settings"]

# Method-family modules, in the order `--method all` reports them: the family's
# name, and its module under llmem_plugin.methods (pipeline parallelism is a subpackage).
_MODULES = {"single": "single", "ddp": "ddp", "zero": "zero", "fsdp": "fsdp", "tp": "tp", "colossal": "colossal",
            "colossal_hybrid": "colossal_hybrid", "pp": "pp.method"}


def _registry() -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for mod in _MODULES:
        presets = importlib.import_module(f"llmem_plugin.methods.{_MODULES[mod]}").PRESETS
        for name, settings in presets.items():
            assert name not in out, f"method {name} registered twice"
            out[name] = (mod, settings)
    return out


def method_names() -> list[str]:
    """Every registered method name."""
    return list(_registry())


def preset_settings(name: str) -> dict[str, Any]:
    """The options preset ``name`` fixes (``lowlevel-zero1``: ``{"plugin": "lowlevel", "stage": 1}``).

    Raises:
        ConfigError: Unknown method (the message lists the valid ones).
    """
    reg = _registry()
    if name not in reg:
        raise ConfigError(f"unknown method '{name}'; valid: {', '.join(reg)}. HINT: pass --method with one of them")
    return dict(reg[name][1])


def estimate_method(
    name: str,
    model: Any,
    workload: Any,
    *,
    layout: Layout,
    gpu: Any,
    alloc_conf: Any = None,
    torch_version: str | None = None,
    fast: bool = False,
    stream_synthesis: bool = False,
    **options: Any,
) -> MethodEstimate:
    """Per-rank memory of ``model`` trained with method ``name`` on ``layout``.

    Args:
        fast: Trace the method on two shortened copies of the model and
            extrapolate per layer to the full depth (:func:`extrapolated`);
            config sources only (a module is traced in full).
        stream_synthesis: With ``fast`` False: the figures of the full trace,
            from every rank's full event stream built from two shortened
            runs (:func:`synthesized`) where the method supports it and the
            guard holds, else from the full trace itself (a note says why).

    Raises:
        ConfigError: Unknown method (the message lists the valid ones), or a
            layout the method cannot run on.
    """
    reg = _registry()
    if name not in reg:
        raise ConfigError(f"unknown method '{name}'; valid: {', '.join(reg)}. HINT: pass --method with one of them")
    mod, settings = reg[name]
    from llmem_plugin.techniques import check_supported

    check_supported(name, workload)
    if mod != "single":
        from llmem_plugin.models.config import require_causal_lm

        require_causal_lm(model, f"--method {name}", workload.task)
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

    if mod != "single" and workload.grad_accum_steps > MAX_TRACED_MICRO_STEPS:
        # The methods trace every micro-step; only the single-GPU estimate
        # shortens the window (llmem_plugin.estimate._steady_trace).
        raise UnsupportedError(
            f"--method {name} traces every micro-step of the accumulation window, and grad_accum_steps "
            f"{workload.grad_accum_steps} is above {MAX_TRACED_MICRO_STEPS}. HINT: estimate it with --grad-accum "
            f"{MAX_TRACED_MICRO_STEPS} or fewer, or with --method single")
    if not isinstance(gpu, GPU):
        from llmem_plugin.estimate import _resolve_gpu

        gpu = _resolve_gpu(gpu, None)  # a catalog name (or None: the default GPU)
    from llmem_plugin.trace.cache import default_cache

    cache = default_cache()
    key = _method_key(name, model, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf,
                      torch_version=torch_version, fast=fast, stream_synthesis=stream_synthesis,
                      options=options) if cache is not None else None
    hit = cache.get(key) if key is not None else None
    if isinstance(hit, MethodEstimate):
        return hit
    est = _estimate_method(mod, settings, name, model, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf,
                           torch_version=torch_version, fast=fast, stream_synthesis=stream_synthesis, **options)
    if key is not None:
        cache.put(key, est)
    return est


def _method_key(name: str, model: Any, workload: Any, **parts: Any) -> str | None:
    """The trace cache's key for a method's estimate, or None where no config names the model (a module)."""
    import os

    from llmem_plugin.trace.cache import make_key

    if isinstance(model, nn.Module):
        return None
    from llmem_plugin.models.config import resolve_config

    try:
        config = resolve_config(model).to_json_string(use_diff=False)
    except Exception:  # not a transformers config (litgpt, ...): no cache, the method says what it refuses
        return None
    return make_key("method", {"name": name, "source": model if isinstance(model, (str, os.PathLike)) else None,
                               "config": config, "workload": workload, **parts,
                               "alloc_env": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})


def _estimate_method(mod: str, settings: dict[str, Any], name: str, model: Any, workload: Any, *, layout: Layout,
                     gpu: GPU, alloc_conf: Any, torch_version: str | None, fast: bool, stream_synthesis: bool,
                     **options: Any) -> MethodEstimate:
    """:func:`estimate_method` without the cache."""
    module = importlib.import_module(f"llmem_plugin.methods.{_MODULES[mod]}")
    fn = module.estimate

    def run(source: Any) -> MethodEstimate:
        return fn(source, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf, torch_version=torch_version,
                  preset=name, **{**settings, **options})

    if mod == "pp":  # its fast mode shortens each stage, not the model (llmem_plugin.methods.pp.method)
        return fn(model, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf, torch_version=torch_version,
                  preset=name, fast=fast and not isinstance(model, nn.Module), **{**settings, **options})
    if not fast and stream_synthesis and not isinstance(model, nn.Module) and hasattr(module, "synthesis_blocker"):
        # The module traces with methods.base.new_tracker and says where its rules carry state across layers.
        why = module.synthesis_blocker(model, workload, layout=layout, **{**settings, **options})
        est = why or synthesized(model, run, capacity_bytes=gpu.capacity_bytes,
                                 min_layers=_FAST_MIN_LAYERS.get(mod, 2), growing_buffers=True)
        if isinstance(est, str):
            full = run(model)
            return dataclasses.replace(full, notes=[*full.notes, f"traced in full: the full event stream could not "
                                                                 f"be built from shortened runs ({est})"])
        return _full_depth_host(est, mod, model, workload, layout, {**settings, **options})
    if not fast or isinstance(model, nn.Module):
        return run(model)
    if mod == "single":
        return fn(model, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf, torch_version=torch_version,
                  preset=name, fast=True, **{**settings, **options})
    est = extrapolated(model, run, capacity_bytes=gpu.capacity_bytes, min_layers=_FAST_MIN_LAYERS.get(mod, 2))
    return _full_depth_host(est, mod, model, workload, layout, {**settings, **options})


def _full_depth_host(est: MethodEstimate, mod: str, model: Any, workload: Any, layout: Layout,
                     settings: dict[str, Any]) -> MethodEstimate:
    """A depth-extrapolated estimate with the host figures of the full depth where they are not affine."""
    if mod == "zero" and est.worst.host_bytes:
        # DeepSpeed's offload buffers are whole-model flat buffers: their
        # pinned rounding is not affine in depth; take the full depth's host figures.
        from llmem_plugin.methods.base import host_overheads
        from llmem_plugin.methods.zero import host_memory

        host, rounding = host_memory(model, workload, layout=layout, **settings, rank=est.worst.rank)
        rank = dataclasses.replace(est.worst, host_bytes=host, host_overheads=host_overheads(rounding))
        est = dataclasses.replace(est, ranks=[rank])
    return est


# Shortest model the fast mode traces, per method family. Measured on
# Llama-3.1-8B over 16 GPUs (benchmarks/results/method-fast-depth-2026-11-22.jsonl):
# extrapolating the allocated peak from 2 and 3 layers is within 0.3% of the
# full trace for every method but DeepSpeed's, whose stage 3 is 12-95% under
# (its prefetch and persistence treat the first layers apart); from 3 and 4
# layers DeepSpeed's are within 0.05%, except stage 2 without checkpointing
# (+9%: where the reduce buckets' boundaries fall).
_FAST_MIN_LAYERS = {"zero": 3}


def _affine(v1: int, v2: int, scale: float) -> int:
    return v1 + round(scale * (v2 - v1))


def _per_phase(d1: dict[str, int], d2: dict[str, int], scale: float) -> dict[str, int]:
    return {p: _affine(d1.get(p, v), v, scale) for p, v in d2.items()}


def _shortened(config: Any, min_layers: int) -> tuple[Any, Any, Any, str | None]:
    """The layer plan and the two shortened configs; (None, None, None, note)
    when the model itself is to run (the note says why, where it is worth saying)."""
    from llmem_plugin.models.config import num_layers
    from llmem_plugin.trace.fast import fallback_note
    from llmem_plugin.models.layerkinds import layer_kinds, plan_layers, shortened_config

    depth = num_layers(config)
    # The same cut as the single-GPU fast mode: the model's own prefix and
    # suffix around a and a + 1 repeating periods (llmem_plugin.models.layerkinds).
    kinds, reason = layer_kinds(config)
    if kinds is None or len(kinds) != depth:
        return None, None, None, fallback_note(reason or f"the config lists {len(kinds or [])} layers, "
                                                         f"the model {depth}")
    plan = plan_layers(kinds)
    while plan is not None and plan.prefix + plan.traced * plan.period + plan.suffix < min_layers:
        plan = dataclasses.replace(plan, traced=plan.traced + 1)
    if plan is None or plan.traced + 2 > plan.repeats:
        return None, None, None, None
    try:
        c1, c2 = (shortened_config(config, plan.indices(u), kinds) for u in (plan.traced, plan.traced + 1))
    except UnsupportedError as e:
        return None, None, None, fallback_note(str(e))
    return plan, c1, c2, None


def extrapolated(model: Any, run: Callable[[Any], MethodEstimate], *, capacity_bytes: int,
                 min_layers: int = 2) -> MethodEstimate:
    """A method's estimate at full depth from runs on two shortened models.

    As the single-GPU fast mode (:mod:`llmem_plugin.trace.fast`), the model is cut
    to its prefix and suffix around ``a`` and ``a + 1`` repeating periods of
    layer kinds (:mod:`llmem_plugin.models.layerkinds`: dense/expert, sliding/global,
    hybrid blocks) and every per-rank quantity is taken as affine in the
    number of periods; where the kinds cannot be told apart the full model
    runs and a note says so. The shorter copy has at least ``min_layers`` (3 for DeepSpeed,
    whose 2-layer ZeRO-3 run is not yet on the line: its prefetch and
    persistence rules treat the first layers apart). The allocator's allocated peak is extrapolated phase
    by phase and the largest phase wins, since the peak moves between phases
    with depth. The reserved peak is NOT affine in depth (which cached block
    a request reuses depends on the whole stream: 2- to 4-layer runs put it
    22% under to 24% over the full replay on Llama-3.1-8B), so it is taken as
    the allocated peak times the longer run's reserved/allocated ratio: an
    approximation for screening, never a substitute for the full trace
    (:func:`synthesized` builds the full event stream instead, where it can).
    Communication volumes and host bytes are affine. The reported rank is
    the longer run's worst rank, extrapolated with the same rank of the
    shorter run.
    """
    from llmem_plugin.models.config import num_layers, resolve_config

    config = resolve_config(model)
    plan, c1, c2, note = _shortened(config, min_layers)
    if plan is None:
        full = run(config)
        return dataclasses.replace(full, notes=[*full.notes, note]) if note else full
    short = run(c1)
    long = run(c2)
    return _combined(short, long, plan, num_layers(config), capacity_bytes=capacity_bytes)


def _combined(short: MethodEstimate, long: MethodEstimate, plan: Any, depth: int, *, capacity_bytes: int,
              rank: int | None = None) -> MethodEstimate:
    """The full depth from the two copies' estimates, affine per period, for
    ``rank`` (default: the longer copy's worst), with the ratio rule for reserved."""
    n1, n2 = plan.short_layers, plan.long_layers
    scale = plan.repeats - plan.traced
    w2 = long.worst if rank is None else next(r for r in long.ranks if r.rank == rank)
    w1 = next((r for r in short.ranks if r.rank == w2.rank), short.worst)
    outside = w2.device_total_bytes - w2.peak_reserved_bytes  # context + NCCL: independent of depth
    if w1.phase_allocated and w2.phase_allocated:
        allocated = max(_per_phase(w1.phase_allocated, w2.phase_allocated, scale).values())
    else:  # a capped replay (no per-phase peaks): the totals
        allocated = _affine(w1.peak_allocated_bytes, w2.peak_allocated_bytes, scale)
    reserved = max(round(allocated * w2.peak_reserved_bytes / max(w2.peak_allocated_bytes, 1)), allocated)
    phase_bd = {p: {c: _affine(w1.phase_breakdowns.get(p, {}).get(c, 0), v, scale) for c, v in bd.items()}
                for p, bd in w2.phase_breakdowns.items()}
    peak_phase = max(phase_bd, key=lambda p: sum(phase_bd[p].values())) if phase_bd else None
    mem = RankMemory(
        rank=w2.rank,
        peak_tensor_bytes=_affine(w1.peak_tensor_bytes, w2.peak_tensor_bytes, scale),
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        device_total_bytes=reserved + outside,
        fits=reserved + outside <= capacity_bytes,
        breakdown=dict(phase_bd[peak_phase]) if peak_phase else _per_phase(w1.breakdown, w2.breakdown, scale),
        host_bytes=_affine(w1.host_bytes, w2.host_bytes, scale),
        host_overheads=_per_phase(w1.host_overheads, w2.host_overheads, scale),
        phase_allocated=_per_phase(w1.phase_allocated, w2.phase_allocated, scale),
        phase_breakdowns=phase_bd,
    )
    return MethodEstimate(
        method=long.method,
        layout=long.layout,
        ranks=[mem],
        comm_intra_node_bytes=_affine(short.comm_intra_node_bytes, long.comm_intra_node_bytes, scale),
        comm_inter_node_bytes=_affine(short.comm_inter_node_bytes, long.comm_inter_node_bytes, scale),
        notes=[*long.notes, f"fast: extrapolated from {n1}- and {n2}-layer traces to {depth} layers"],
    )


def synthesized(model: Any, run: Callable[[Any], MethodEstimate], *, capacity_bytes: int, min_layers: int = 2,
                growing_buffers: bool = False) -> MethodEstimate | str:
    """A method's estimate at full depth with every rank's full event stream
    built from two shortened runs and replayed, as the single-GPU fast mode
    builds its own (:mod:`llmem_plugin.trace.fastsynth`, with its guard): the
    allocated and reserved peaks are then those of the full trace, without
    tracing it. Breakdowns, host bytes and communication are affine, as in
    :func:`extrapolated` (a flat buffer's share of the breakdown within the
    allocator's 512-B rounding per extrapolated layer).

    Args:
        growing_buffers: The method vouches that its buffers outside the
            layers are the full model's with bytes affine in depth (flat
            buffers over all parameters); else none may grow.

    Returns:
        The estimate, or why the stream could not be built (the caller then
        traces the model in full).
    """
    from llmem_plugin.models.config import num_layers, resolve_config
    from llmem_plugin.trace.fastsynth import SynthesisError, full_depth_trace
    from llmem_plugin.methods.base import capture, rank_memory

    config = resolve_config(model)
    plan, c1, c2, note = _shortened(config, min_layers)
    if plan is None:
        return note or "the model is too short to shorten"
    with capture() as cap1:
        short = run(c1)
    with capture() as cap2:
        long = run(c2)
    if [k["rank"] for _, k in cap1.ranks] != [k["rank"] for _, k in cap2.ranks] or not cap2.ranks:
        return "the shortened runs traced different ranks"
    built: list[RankMemory] = []
    for (t1, _), (t2, kw) in zip(cap1.ranks, cap2.ranks):
        if kw["streams"]:
            return "a rank allocates on side streams, which the stream synthesis does not follow"
        if t1.layer_tags is None or t2.layer_tags is None:
            return "the method's trace has no layer tags"
        try:
            full = full_depth_trace(t1, t2, plan, None, growing_buffers=growing_buffers)
        except SynthesisError as e:
            return str(e)
        built.append(rank_memory(full, **kw))
    worst = max(built, key=lambda r: (r.device_total_bytes, -r.rank))
    est = _combined(short, long, plan, num_layers(config), capacity_bytes=capacity_bytes, rank=worst.rank)
    # The breakdown at the peak, affine per period as the rest (the method's own categories: rank_memory's).
    w1, w2 = (next(r for r in e.ranks if r.rank == worst.rank) for e in (short, long))
    breakdown = _per_phase(w1.breakdown, w2.breakdown, plan.repeats - plan.traced)
    mem = dataclasses.replace(
        est.ranks[0], breakdown={c: v for c, v in breakdown.items() if v}, peak_tensor_bytes=worst.peak_tensor_bytes, peak_allocated_bytes=worst.peak_allocated_bytes,
        peak_reserved_bytes=worst.peak_reserved_bytes, device_total_bytes=worst.device_total_bytes, fits=worst.fits,
        phase_allocated=worst.phase_allocated, phase_reserved=worst.phase_reserved)
    n1, n2 = plan.short_layers, plan.long_layers
    notes = [n for n in est.notes if not n.startswith("fast: extrapolated")]
    notes.append(f"every rank's event stream was built from {n1}- and {n2}-layer traces to "
                 f"{num_layers(config)} layers and replayed (guarded as the single-GPU fast mode)")
    return dataclasses.replace(est, ranks=[mem], notes=notes)
