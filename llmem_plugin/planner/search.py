"""Pick the fastest fine-tuning method that fits, or refuse with a report.

The space: every method that runs on the cluster (``llmem_plugin.methods``),
each tensor-parallel degree that divides a node and the model, CPU offload,
gradient checkpointing on and off, and each micro-batch that divides the
per-rank share of the global batch (gradient accumulation fills the rest).

The cost of searching it is bounded by traces, not candidates
(docs/planner.md). :func:`plan` runs these steps in order, each a module:

1. **Enumerate** (:mod:`~llmem_plugin.planner.space`): the configurations
   (method, TP degree, pipeline degree) that run here, and what does not.
2. **Bound** (:mod:`~llmem_plugin.planner.bounds`): configurations whose
   parameter and optimizer-state shards, or host needs, exceed the limits
   are skipped; then the single-GPU step is profiled in fast mode at
   micro-batch 1 and 2, with checkpointing off and on
   (:mod:`~llmem_plugin.planner.profiles`), and each unit (configuration,
   checkpointing) gets a memory bound (skipped over the limit) and a
   step-time bound (the screen's order).
3. **Screen** (:mod:`~llmem_plugin.planner.screen`): units are traced in
   the methods' fast mode at micro-batch 1, over all cores, while their
   bound could beat the fastest fitting candidate so far; each candidate's
   allocated peak is its unit's, phase by phase, plus the profile's growth
   of the forward-phase peak with the micro-batch (times the TP share); its
   step time comes from :mod:`llmem_plugin.planner.cost`.
4. **Verify** (:mod:`~llmem_plugin.planner.verify`): the fastest candidate
   under the limit is traced in full with its exact micro-batch,
   accumulation and checkpointing (the estimate ``llmem estimate --method``
   gives). If it does not fit, the next is tried. The choice is always a
   verified one.
5. **Rank** (:mod:`~llmem_plugin.planner.rank`): fastest first, the
   runner-up, and why the choice beats it.
6. **Explain** (:mod:`~llmem_plugin.planner.explain`): what was left out and
   why; when nothing fits, the report and the changes that fit.

Kept candidates: device total at most ``capacity * (1 - margin)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmem_plugin.device.gpus import GPU
from llmem_plugin.device.host import HostCapacity, resolve_host_memory
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.methods import Layout
from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import resolve_config
from llmem_plugin.planner.bounds import bound_configs, bound_units, fixed_bytes
from llmem_plugin.planner.candidates import Candidate, Plan, _Context, _Options, _Run
from llmem_plugin.planner.cost import DEFAULT_EFFICIENCY, Network
from llmem_plugin.planner.explain import explain, explain_skipped
from llmem_plugin.planner.profiles import _Profiles
from llmem_plugin.planner.rank import order, rank
from llmem_plugin.planner.screen import _Search, screen
from llmem_plugin.planner.space import enumerate_configs
from llmem_plugin.planner.verify import verify_choice
from llmem_plugin.workload import LossImpl, Workload

__all__ = ["DEFAULT_MARGIN", "DEFAULT_MAX_PIPELINES", "DPO_NOT_SEARCHED", "gpus_on_this_machine", "plan"]

DEFAULT_MARGIN = 0.05
# Without --global-batch: this many sequences per GPU per optimizer step.
DEFAULT_SEQUENCES_PER_GPU = 8


# TRL DPO with its fused head (--reference-model --loss trl-fused) needs whole chosen/rejected pairs per
# micro-batch; the search profiles 1 and 2 rows and extrapolates.
DPO_NOT_SEARCHED = ("llmem plan does not search TRL DPO's paired rows yet (its micro-batch profiles are 1 and 2 rows; "
                    "DPO needs whole chosen/rejected pairs). HINT: llmem estimate with --method and an even "
                    "--batch-size for each layout to compare")


# Pipeline configurations the planner traces by default (plan(max_pipelines=...)): one costs about 50 s at
# 405B on a 2-core machine, the other methods' seconds each (benchmarks/results/plan-speed-2026-12-01.json:
# 103 s in all with one; -2026-11-28.json: 68 s with none).
DEFAULT_MAX_PIPELINES = 1


def plan(
    model: Any,
    *,
    gpu: GPU | str,
    num_gpus: int = 1,
    num_nodes: int = 1,
    workload: Workload | None = None,
    global_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    methods: list[str] | None = None,
    tps: list[int] | None = None,
    micro_batch: int | None = None,
    grad_checkpointing: bool | None = None,
    gpu_memory: int | None = None,
    alloc_conf: Any = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    inter_node_gbps: float | None = None,
    verify: bool = True,
    max_verify: int = 6,
    suggest: bool = True,
    prune: bool = True,
    host_memory: int | str | None = None,
    max_pipelines: int | None = DEFAULT_MAX_PIPELINES,
    progress: Callable[[str], None] | None = None,
    _profiles: dict | None = None,
) -> Plan:
    """Search the methods for ``model`` on ``num_gpus`` GPUs and pick the fastest that fits.

    Args:
        model: Catalog name, config path or ``PretrainedConfig``.
        gpu: Catalog GPU.
        num_gpus: GPUs over all nodes.
        num_nodes: Nodes.
        workload: Sequence length, precision, optimizer, LoRA (micro-batch,
            accumulation and checkpointing are searched unless pinned).
        global_batch: Sequences per optimizer step (default 8 per GPU).
        margin: Fraction of the capacity to keep free (default 5%).
        methods: Restrict to these planner methods (:func:`planner_methods`).
        tps: Restrict the tensor-parallel degrees.
        micro_batch: Pin the micro-batch.
        grad_checkpointing: Pin checkpointing (None: search both).
        gpu_memory: Override the GPU's capacity in bytes.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` to simulate.
        efficiency: Model FLOPs utilisation for the step-time model.
        inter_node_gbps: Network GB/s per GPU between nodes.
        verify: Trace the choice in full before returning it.
        max_verify: Candidates to trace in full before giving up.
        suggest: When nothing fits, search for changes that make it fit.
        prune: Skip tracing a (method, checkpointing) whose step-time lower
            bound cannot beat the fastest fitting candidate found so far;
            off, every candidate is screened (the full table).
        host_memory: Host RAM per node: bytes, a size string ("2TiB"),
            "local" (this machine's RAM), or None for the catalog's cloud
            instance with ``num_gpus / num_nodes`` of this GPU
            (:func:`llmem_plugin.device.host.resolve_host_memory`). A candidate
            whose host memory per node exceeds it less the margin does not fit.
        max_pipelines: Pipeline configurations (degrees) to trace at most, those with the best step-time
            bounds first; the rest are listed as skipped with that reason. A pipeline configuration's
            trace costs minutes on a large model (every rank's stages run under the schedule), the other
            methods' seconds. None (or ``prune=False``): all.
        progress: Called with one line (seconds since the start, then what the search traces next) before
            each batch of screening traces and each verification: a plan of a large model runs for minutes.

    Returns:
        The :class:`Plan`.

    Raises:
        WontFitError: Nothing fits; carries the plan (with suggestions).
        ConfigError: Bad input.
    """
    t0 = time.perf_counter()
    _check_search(margin=margin, max_pipelines=max_pipelines, efficiency=efficiency)
    ctx, host_cap = _context(model, gpu=gpu, gpu_memory=gpu_memory, num_gpus=num_gpus, num_nodes=num_nodes,
                             workload=workload, global_batch=global_batch, margin=margin, alloc_conf=alloc_conf,
                             efficiency=efficiency, inter_node_gbps=inter_node_gbps, host_memory=host_memory)
    cache = _profiles if _profiles is not None else {}
    profiles = _cached_profiles(cache, ctx)
    gcs = [grad_checkpointing] if grad_checkpointing is not None else [False, True]
    opts = _Options(gcs=gcs, micro_batch=micro_batch, prune=prune, max_pipelines=max_pipelines, verify=verify,
                    max_verify=max_verify, progress=progress, t0=t0)

    configs, skipped = enumerate_configs(ctx, methods, tps)
    run = _Run(skipped=skipped)
    todo = bound_configs(ctx, configs, run, host_cap)
    t_screen = time.perf_counter()
    search = _Search(ctx, profiles, gcs, micro_batch)
    bound_units(ctx, opts, todo, search, run)
    screen(ctx, opts, run, search)
    order(run.candidates)
    choice = verify_choice(ctx, opts, run, rescreen=lambda: screen(ctx, opts, run, search))
    explain_skipped(run, choice, gcs)
    runner, why = rank(run, choice)
    t_end = time.perf_counter()
    result = _plan_of(model, ctx, run, choice, runner, why, margin=margin, host_cap=host_cap,
                      seconds=t_end - t0, screen_s=t_end - t_screen)
    if choice is None and result.fixed_bytes > result.limit_bytes:  # no change of the job can fit
        suggest = False
    if choice is None:
        same = {"gpu": gpu, "gpu_memory": gpu_memory, "global_batch": ctx.global_batch, "margin": margin,
                "methods": methods, "tps": tps, "micro_batch": micro_batch,
                "grad_checkpointing": grad_checkpointing, "alloc_conf": alloc_conf, "efficiency": efficiency,
                "inter_node_gbps": inter_node_gbps, "verify": verify, "max_verify": max_verify,
                "host_memory": host_memory, "max_pipelines": max_pipelines}
        raise explain(result, model=model, same=same if suggest else None, cache=cache, replan=plan, t0=t0,
                      t_end=t_end)
    return result


def _check_search(*, margin: float, max_pipelines: int | None, efficiency: float) -> None:
    """The search's own settings, each in its range.

    Raises:
        ConfigError: One is not, named with its range and a fix.
    """
    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. --margin 0.05 for 5%")
    if max_pipelines is not None and (isinstance(max_pipelines, bool) or not isinstance(max_pipelines, int)
                                      or max_pipelines < 0):
        raise ConfigError(f"max_pipelines must be a count of at least 0 (or None for all), got {max_pipelines!r}. "
                          "HINT: e.g. --max-pipelines 2")
    if efficiency <= 0 or efficiency > 1:
        raise ConfigError(f"efficiency must be in (0, 1], got {efficiency!r}. HINT: e.g. --efficiency 0.4")


def _context(model: Any, *, gpu: GPU | str, gpu_memory: int | None, num_gpus: int, num_nodes: int,
             workload: Workload | None, global_batch: int | None, margin: float, alloc_conf: Any,
             efficiency: float, inter_node_gbps: float | None, host_memory: int | str | None
             ) -> tuple[_Context, HostCapacity]:
    """What every step reads, resolved and checked: the GPU, the layout, the workload, the global batch
    (default :data:`DEFAULT_SEQUENCES_PER_GPU` per GPU), the model's config and sizes, and the GPU and host
    limits less the margin; with the node's host RAM and where the figure comes from.

    Raises:
        ConfigError: A bad GPU, layout, global batch or model.
        UnsupportedError: TRL DPO's paired rows (:data:`DPO_NOT_SEARCHED`).
    """
    from llmem_plugin.estimate import _resolve_gpu
    from llmem_plugin.models.config import require_causal_lm

    target = _resolve_gpu(gpu, gpu_memory)
    layout = Layout(num_gpus=num_gpus, num_nodes=num_nodes)
    wl = workload or Workload()
    if wl.reference_model and wl.loss is LossImpl.TRL_FUSED:
        raise UnsupportedError(DPO_NOT_SEARCHED)
    if global_batch is None:
        global_batch = DEFAULT_SEQUENCES_PER_GPU * num_gpus
    if global_batch <= 0:
        raise ConfigError(f"global batch must be a positive number of sequences, got {global_batch}")
    config = resolve_config(model)
    require_causal_lm(config, "llmem plan", wl.task)
    limit = int(target.capacity_bytes * (1 - margin))
    params = trainable = 0
    if fixed_bytes(target, layout) <= limit:  # else nothing is screened (bounds.bound_configs): no model to build
        meta = modelbuild.build_model(config, wl, device="meta")
        params = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values())
        trainable = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values() if p.requires_grad)
    host_cap = resolve_host_memory(host_memory, gpu=target, gpus_per_node=layout.gpus_per_node)
    host_limit = int(host_cap.node_bytes * (1 - margin))
    ctx = _Context(model=model, config=config, workload=wl, layout=layout, gpu=target,
                   network=Network.for_gpu(target, inter_node_gbps=inter_node_gbps), global_batch=global_batch,
                   limit=limit, alloc_conf=alloc_conf, efficiency=efficiency, params=params, trainable=trainable,
                   host_limit=host_limit)
    return ctx, host_cap


def _cached_profiles(cache: dict, ctx: _Context) -> _Profiles:
    """The single-GPU profiles of ``ctx``'s model, workload and GPU: ``cache``'s (a plan's suggestions share
    them), or new ones kept there."""
    config = ctx.config
    pkey = (repr(config.to_dict()) if hasattr(config, "to_dict") else repr(config), ctx.workload, ctx.gpu.name)
    return cache.setdefault(pkey, _Profiles(ctx.model, ctx.workload, ctx.gpu, ctx.alloc_conf))


def _plan_of(model: Any, ctx: _Context, run: _Run, choice: Candidate | None, runner: Candidate | None, why: str, *,
             margin: float, host_cap: HostCapacity, seconds: float, screen_s: float) -> Plan:
    """The :class:`Plan` of a finished search (``screen_s``: seconds from the profile to the end, of which
    ``run.verify_s`` verified)."""
    from llmem_plugin.estimate import _describe

    timings = {"screen": screen_s - run.verify_s, "verify": run.verify_s}
    if run.beside_s:  # worker seconds, inside the screen's wall time
        timings["verify_beside_screen"] = run.beside_s
    return Plan(model=_describe(model), gpu=ctx.gpu, layout=ctx.layout, workload=ctx.workload,
                global_batch=ctx.global_batch, capacity_bytes=ctx.gpu.capacity_bytes, margin=margin,
                candidates=run.candidates, choice=choice, runner_up=runner, why=why, skipped=run.skipped,
                seconds=seconds, timings=timings, host_memory=host_cap,
                host_refused_bytes=min([*run.host_needs, *(c.host_bytes_per_node for c in run.candidates
                                                           if not c.host_fits)], default=0),
                fixed_bytes=fixed_bytes(ctx.gpu, ctx.layout))


def gpus_on_this_machine() -> tuple[str, int]:
    """(catalog GPU name, count) of the CUDA devices here.

    Raises:
        ConfigError: No CUDA device, or one the catalog does not know.
    """
    import torch

    from llmem_plugin.device.gpus import match_device_name

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError("no GPU found on this machine (torch.cuda.device_count() == 0). "
                          "HINT: pass --gpu NAME --gpus N to plan for the machine the job will run on")
    name = torch.cuda.get_device_name(0)
    gpu = match_device_name(name)
    if gpu is None:
        raise ConfigError(f"this machine's GPU '{name}' is not in the catalog. "
                          "HINT: pass --gpu with a similar one from `llmem gpus` and --gpu-memory")
    return gpu.name, n
