"""Screen: trace the units in order of their time bound, over the machine's cores, and build their candidates.

A unit is a (configuration, checkpointing) pair. Its traces are the method's fast mode
(``estimate_method(..., fast=True)``: shortened runs extrapolated per layer) at micro-batch 1 with that
checkpointing; tensor-parallel methods also take the plain run and one micro-batch-2 run per TP plan and degree
(the share of the activations and of their collectives a TP rank holds). Each candidate's allocated peak is
its unit's, phase by phase, plus the profile's growth of the forward-phase peak with the micro-batch (times the
TP share); its step time comes from :mod:`llmem_plugin.planner.cost`. A pipeline configuration's candidates
are its method's estimate at exactly each split. Branch and bound: units are traced while one could still
beat the fastest fitting candidate screened so far (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmem_plugin.errors import ConfigError, LLMemError
from llmem_plugin.methods import Layout, MethodEstimate
from llmem_plugin.methods.parallel import cores as _cores
from llmem_plugin.methods.parallel import forked_map
from llmem_plugin.models.config import num_layers
from llmem_plugin.planner.candidates import (
    _PP,
    _TRAITS,
    Candidate,
    _activation_bytes,
    _cfg_label,
    _Config,
    _Context,
    _Options,
    _registry_call,
    _Run,
    _segments,
    _shard,
    _Traits,
    _unit_label,
)
from llmem_plugin.planner.cost import Overlap, StepTime, StepWork, pipeline_bubble_s, step_time
from llmem_plugin.planner.profiles import _Profiles
from llmem_plugin.planner.rank import _best_time, order
from llmem_plugin.planner.space import _micro_batch_plan, _pipeline_splits
from llmem_plugin.planner.verify import _timed_verify
from llmem_plugin.trace.tracker import MemoryCategory
from llmem_plugin.workload import Workload

__all__ = ["screen"]

_FWD, _BWD = "forward", "backward"


def screen(ctx: _Context, opts: _Options, run: _Run, search: _Search) -> None:
    """Trace ``run.pending`` in order of the units' time bounds, as many at a time as there are cores, while
    one could still beat the fastest fitting candidate screened so far (all of them without ``opts.prune``),
    and add their candidates to ``run.candidates`` (a unit whose trace fails: to ``run.failed``)."""
    # Branch and bound: trace units in order of their time bound, while
    # one could still beat the fastest fitting candidate screened so far.
    while True:
        ready = _ready(opts, run)
        if not ready:
            return
        batch, beside = _batch(opts, run, ready)
        opts.say("screening " + ", ".join(_unit_label(*u, opts.gcs) for u in batch)
                 + (" (a pipeline configuration: minutes on a large model)" if any(u[0].pp > 1 for u in batch)
                    else "")
                 + (f", and verifying {beside.label()} at full depth beside it" if beside is not None else ""))
        run.traced_pipelines.update(u[0] for u in batch if u[0].pp > 1)
        built, verified = search.expand(batch, beside)
        if beside is not None:
            run.done_beside[beside.key] = verified
        for u, out in built:
            run.pending.remove(u)
            if isinstance(out, LLMemError):
                run.failed.setdefault(_cfg_label(u[0]), str(out).split(". HINT")[0])
            else:
                run.candidates.extend(out)


def _ready(opts: _Options, run: _Run) -> list[tuple[_Config, bool]]:
    """The pending units whose bound could still beat the fastest fitting candidate, within the pipeline
    budget: pipeline units past it leave ``run.pending`` for ``run.skipped``, and a batch takes no more new
    pipeline configurations than the budget has left."""
    limit_s = _best_time(run.candidates, run.rejected) if opts.prune else float("inf")
    ready = [u for u in run.pending if run.bound[u] < limit_s * (1 - 1e-9)]
    for u in [u for u in ready if _over_budget(opts, run, u)]:
        run.pending.remove(u)
        ready.remove(u)
        run.skipped.append((_unit_label(u[0], u[1], opts.gcs),
                            f"not traced: the plan traces the {opts.max_pipelines} pipeline configuration(s) with "
                            f"the best step-time bounds (at least {run.bound[u]:.3g} s per step here)"))
    budget = (max(opts.max_pipelines - len(run.traced_pipelines), 0) if opts.prune and opts.max_pipelines is not None
              else None)
    if budget is not None:  # a batch takes no more new pipeline configurations than the budget has left
        fresh = list(dict.fromkeys(u[0] for u in ready if u[0].pp > 1 and u[0] not in run.traced_pipelines))
        ready = [u for u in ready if u[0].pp == 1 or u[0] in run.traced_pipelines or u[0] in fresh[:budget]]
    return ready


def _over_budget(opts: _Options, run: _Run, u: tuple[_Config, bool]) -> bool:
    """Whether ``u`` is a new pipeline configuration past the plan's ``max_pipelines``."""
    cfg = u[0]
    if cfg.pp == 1 or not opts.prune or opts.max_pipelines is None or cfg in run.traced_pipelines:
        return False
    return len(run.traced_pipelines) >= opts.max_pipelines


def _batch(opts: _Options, run: _Run, ready: list[tuple[_Config, bool]]
           ) -> tuple[list[tuple[_Config, bool]], Candidate | None]:
    """The units to trace next, as many as there are cores, and the candidate to verify beside them (None)."""
    batch = ready[: max(_cores(), 1)]
    beside = None
    if any(u[0].pp > 1 for u in batch) and _cores() > 1:
        # A pipeline configuration's screen runs for minutes at scale, the other units' for seconds:
        # the other cores take every ready unit meanwhile, then the verification of the fastest fitting
        # candidate screened so far (at full depth, the plan's other long trace), which the
        # verification below would otherwise run after the screen. Units that a candidate of this
        # batch would have pruned only add screened rows: the choice is the same.
        batch += [u for u in ready if u[0].pp == 1 and u not in batch]
        order(run.candidates)
        beside = next((c for c in run.candidates if c.fits and not c.verified and id(c) not in run.rejected
                       and c.key not in run.done_beside), None) if opts.verify else None
    return batch, beside


# ----------------------------------------------------------------------------- the traces


# Methods sharing a tensor-parallel plan: their TP activations and collectives
# are the same, so one micro-batch-2 run per (plan, degree) serves them all.
_TP_PLAN = {"tp": "torchtitan", "dp-tp": "torchtitan", "fsdp-tp": "torchtitan", "hybrid": "shardformer",
            "hybrid-zero1": "shardformer"}


class _Search:
    """The traces behind the candidates, run on demand and kept.

    A unit is a (configuration, checkpointing) pair: its candidates need the
    method's fast-mode run at micro-batch 1 with that checkpointing (TP
    methods also the plain run, and one micro-batch-2 run per TP plan and
    degree). :meth:`expand` runs what a list of units still needs, over the
    machine's cores, and builds their candidates.
    """

    def __init__(self, ctx: _Context, profiles: _Profiles, gcs: list[bool], pinned: int | None) -> None:
        self.ctx, self.profiles, self.gcs, self.pinned = ctx, profiles, gcs, pinned
        self.results: dict[tuple, Any] = {}
        self.rep: dict[tuple[str, int], _Config] = {}
        wl1 = dataclasses.replace(ctx.workload, micro_batch_size=1, grad_accum_steps=1, grad_checkpointing=False)
        self._wl = {"one": wl1, "ckpt": dataclasses.replace(wl1, grad_checkpointing=True),
                    "two": dataclasses.replace(wl1, micro_batch_size=2)}

    def profile(self) -> None:
        """The single-GPU profile points, traced in parallel."""
        need = [(mb, g) for g in self.gcs for mb in (1, 2) if not self.profiles.has(mb, g)]
        for (mb, g), value in zip(need, _map([("profile", self.profiles, mb, g) for mb, g in need]), strict=True):
            if isinstance(value, LLMemError):
                raise value  # the model's own step cannot be traced: nothing to plan
            self.profiles.put(mb, g, value)

    def _needs(self, cfg: _Config, gc: bool) -> list[tuple[str, _Config]]:
        if cfg.pp > 1:
            return [("pp-ckpt" if gc else "pp-one", cfg)]
        t = _TRAITS[cfg.method]
        keys = []
        if not gc or t.tp_family:
            keys.append(("one", cfg))
        if gc:
            keys.append(("ckpt", cfg))
        if t.tp_family:
            r = self.rep.setdefault((_TP_PLAN[cfg.method], cfg.tp), cfg)
            keys += [("one", r), ("two", r)]
        return keys

    def expand(self, units: list[tuple[_Config, bool]], verify: Candidate | None = None
               ) -> tuple[list[tuple[tuple[_Config, bool], Any]], Any]:
        """Run what ``units`` still need and build their candidates; with ``verify``, that candidate's
        :func:`_verify` runs in the same pool after them (a (candidate or error, seconds) pair comes back,
        else None)."""
        todo = list(dict.fromkeys(k for u in units for k in self._needs(*u) if k not in self.results))
        # Slowest first: pipelines (every rank's stages under the schedule), then the TP methods (three runs).
        todo.sort(key=lambda k: (k[1].pp == 1, not _TRAITS[k[1].method].tp_family))
        tasks = [("pipeline", self.ctx, cfg, self._workload(kind, cfg), _pipeline_splits(self.ctx, cfg))
                 if cfg.pp > 1 else ("run", self.ctx, cfg, self._workload(kind, cfg)) for kind, cfg in todo]
        if verify is not None:
            tasks.append(("verify", self.ctx, verify))
        out = _map(tasks)
        self.results.update(zip(todo, out[:len(todo)], strict=True))
        return [(u, self._build(*u)) for u in units], (out[-1] if verify is not None else None)

    def _workload(self, kind: str, cfg: _Config) -> Workload:
        if kind.startswith("pp-"):  # one-row microbatches; the splits come with the task
            return dataclasses.replace(self._wl["one"], grad_checkpointing=kind == "pp-ckpt")
        return self._wl[kind]

    def _build(self, cfg: _Config, gc: bool) -> Any:
        t = _TRAITS[cfg.method]
        got = {k: self.results[(k, c)] for k, c in self._needs(cfg, gc)}
        err = next((v for v in got.values() if isinstance(v, LLMemError)), None)
        if err is not None:
            return err
        if cfg.pp > 1:
            runs = next(iter(got.values()))
            out = [_pp_candidate(self.ctx, cfg, est, self.profiles, gc, split) for split, est in runs.items()
                   if not isinstance(est, LLMemError)]
            if not out:
                return next(iter(runs.values()))  # no split could be estimated: the first one's reason
            return out
        one = self.results.get(("one", cfg))
        base = _Base(one if one is not None else self.results[("ckpt", cfg)], ckpt=self.results.get(("ckpt", cfg)))
        if t.tp_family:
            r = self.rep[(_TP_PLAN[cfg.method], cfg.tp)]
            r_one, r_two = self.results[("one", r)], self.results[("two", r)]
            base.tp_alloc_per_sample = (r_two.worst.phase_allocated.get(_FWD, 0)
                                        - r_one.worst.phase_allocated.get(_FWD, 0))
            base.tp_comm_per_sample = (r_two.comm_intra_node_bytes - r_one.comm_intra_node_bytes,
                                       r_two.comm_inter_node_bytes - r_one.comm_inter_node_bytes)
        per_rank, mbs = _micro_batch_plan(self.ctx, cfg, self.pinned)
        return [_candidate(self.ctx, cfg, base, self.profiles, mb, gc, per_rank // mb) for mb in mbs]


def _run_task(task: tuple) -> Any:
    """One trace of the screen: a profile point or a method's fast-mode run.
    Errors come back as values (they cross a process boundary)."""
    kind = task[0]
    try:
        if kind == "profile":
            _, profiles, mb, gc = task
            return profiles.compute(mb, gc)
        if kind == "pipeline":  # every split of one configuration, their composition's runs shared
            _, ctx, cfg, wl, splits = task
            shared: dict = {}
            out = {}
            for split in splits:
                try:
                    out[split] = _registry_call(cfg, ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf, fast=True,
                                                split=split, stand_ins=shared)
                except LLMemError as e:
                    out[split] = ConfigError(str(e))
            return out
        if kind == "verify":  # beside a pipeline's screen: the candidate and the seconds it took
            _, ctx, c = task
            v, seconds = _timed_verify(ctx, c)
            return (ConfigError(str(v)) if isinstance(v, LLMemError) else v), seconds
        _, ctx, cfg, wl = task
        return _registry_call(cfg, ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf, fast=True)
    except LLMemError as e:
        return ConfigError(str(e))


def _map(tasks: list[tuple]) -> list[Any]:
    """Run the tasks over the machine's cores: each worker is a fork of this
    process (imported modules and built state come with it)."""
    return forked_map(_run_task, tasks, workers=_cores())


# ----------------------------------------------------------------------------- candidates from the traces


@dataclass
class _Base:
    """A method's fast-mode estimates, the anchor of its candidates.

    one: micro-batch 1, no checkpointing (the checkpointed run when only
        checkpointing is searched).
    ckpt: micro-batch 1, checkpointing.
    tp_alloc_per_sample / tp_comm_per_sample: for TP methods, what one more
        sequence adds to the forward-phase allocated peak and to the
        (intra, inter)-node bytes per micro-step: the activation share a TP
        rank holds and their collectives, measured between micro-batch 1 and
        2 runs of the same TP plan and degree.
    """

    one: MethodEstimate
    ckpt: MethodEstimate | None = None
    tp_alloc_per_sample: float | None = None
    tp_comm_per_sample: tuple[float, float] | None = None


def _candidate(ctx: _Context, cfg: _Config, base: _Base, profiles: _Profiles, mb: int, gc: bool,
               accum: int) -> Candidate:
    """A candidate of a configuration without pipeline: its memory scaled from its unit's base
    (:func:`_screened_memory`), its step time under the cost model (:func:`_screened_time`)."""
    t = _TRAITS[cfg.method]
    anchor = base.ckpt if gc else base.one
    assert anchor is not None
    deltas, allocated, reserved, total = _screened_memory(t, cfg, base, anchor, profiles, mb, gc, accum)
    st = _screened_time(ctx, t, cfg, base, anchor, profiles, mb, gc, accum)
    act_delta = deltas.get(_BWD, 0.0)
    host = anchor.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return Candidate(
        method=cfg.method, tp=cfg.tp, micro_batch=mb, grad_accum=accum, grad_checkpointing=gc, offload=t.offload,
        device_total_bytes=total, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        limit_bytes=ctx.limit, fits=total <= ctx.limit and host_fits, verified=False, time=st,
        tokens_per_s=ctx.global_batch * ctx.workload.seq_len / st.total_s,
        segments=_segments(anchor, allocated, reserved, act_delta),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )


def _screened_memory(t: _Traits, cfg: _Config, base: _Base, anchor: MethodEstimate, profiles: _Profiles, mb: int,
                     gc: bool, accum: int) -> tuple[dict[str, float], int, int, int]:
    """(each phase's bytes over the base, allocated peak, reserved peak, device total) of a candidate at
    micro-batch ``mb`` and ``accum`` micro-steps, from its unit's base run ``anchor``."""
    w = anchor.worst
    phases = dict(w.phase_allocated) or {_FWD: w.peak_allocated_bytes}
    # Activations grow linearly with the micro-batch: the profile's slope of
    # its forward-phase peak (activations and temporaries alive at the end of
    # forward) at the same checkpointing, times the share a TP rank holds
    # (measured between the method's micro-batch 1 and 2 runs). The single-GPU
    # backward peak is no guide: with unsharded states it falls at the end of
    # backward, when every gradient is alive and most activations are gone.
    k = 1.0
    if t.tp_family and base.tp_alloc_per_sample is not None:
        d_single = profiles.phase(2, False, _FWD) - profiles.phase(1, False, _FWD)
        k = min(max(base.tp_alloc_per_sample / d_single, 1.0 / cfg.tp), 1.0) if d_single > 0 else 1.0 / cfg.tp
    d = k * (profiles.phase(mb, gc, _FWD) - profiles.phase(1, gc, _FWD))
    deltas = {_FWD: d, _BWD: d}
    if accum > 1:
        # From the second micro-step on, the accumulated gradients stay alive
        # through forward and backward (the base ran one micro-step, after
        # which the step frees them): add what the step held as gradients.
        held = w.phase_breakdowns.get("optimizer", {}).get(MemoryCategory.GRADIENT.value, 0)
        deltas = {p: v + held for p, v in deltas.items()}
    allocated = _phase_peak(phases, deltas)
    ratio = w.peak_reserved_bytes / max(w.peak_allocated_bytes, 1)
    reserved = max(round(allocated * ratio), allocated)
    outside = w.device_total_bytes - w.peak_reserved_bytes
    total = reserved + outside
    return deltas, allocated, reserved, total


def _screened_time(ctx: _Context, t: _Traits, cfg: _Config, base: _Base, anchor: MethodEstimate,
                   profiles: _Profiles, mb: int, gc: bool, accum: int) -> StepTime:
    """A candidate's step time: the profile's FLOPs at its micro-batch, its unit's communication scaled to
    its micro-batch and micro-steps, its optimizer and offload terms (:func:`~llmem_plugin.planner.cost.step_time`)."""
    one = base.one
    # Communication: per-sample (TP activations) and per-step parts; with
    # checkpointing, recomputation repeats the forward's TP collectives
    # (measured: the checkpointed base's volume over the plain one's).
    intra1, inter1 = anchor.comm_intra_node_bytes, anchor.comm_inter_node_bytes
    act_intra = act_inter = 0.0
    if t.tp_family and base.tp_comm_per_sample is not None:
        act_intra, act_inter = base.tp_comm_per_sample
        if gc:
            act_intra += anchor.comm_intra_node_bytes - one.comm_intra_node_bytes
            act_inter += anchor.comm_inter_node_bytes - one.comm_inter_node_bytes
    fixed_intra, fixed_inter = intra1 - act_intra, inter1 - act_inter
    reps = accum if t.per_micro_comm else 1
    intra = accum * mb * act_intra + reps * fixed_intra
    inter = accum * mb * act_inter + reps * fixed_inter
    intra_only, cross = _comm_split(intra, inter, cfg, ctx.layout)
    flops = profiles.flops(mb, gc).scaled(1.0 / cfg.tp)
    state_shard = _shard(t.state_shard, ctx.layout, cfg.tp)
    elems = ctx.trainable // state_shard
    es = _activation_bytes(ctx.workload)
    pcie = 0
    if t.offload:
        pcie = accum * es * elems + es * elems  # gradients down each micro-step, parameters up once
        if t.offload == "params":
            pcie += accum * 2 * es * ctx.params // _shard("dp", ctx.layout, cfg.tp)  # gathered in fwd and bwd
    work = StepWork(
        flops=flops, micro_steps=accum, intra_only_bytes=round(intra_only), cross_node_bytes=round(cross),
        overlap=t.overlap, optimizer_elements=0 if t.offload else elems,
        host_optimizer_elements=elems if t.offload else 0, pcie_bytes=pcie,
        gpus_per_node=ctx.layout.gpus_per_node,
    )
    return step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                     network=ctx.network, efficiency=ctx.efficiency)


def _phase_peak(base: dict[str, int], deltas: dict[str, float]) -> int:
    return max((v + deltas.get(p, 0.0) for p, v in base.items()), default=0)


def _comm_split(intra: float, inter: float, cfg: _Config, layout: Layout) -> tuple[float, float]:
    """(intra-only, cross-node) bytes. The methods report bytes by link with
    a ring's inter-node share taken as nodes/ring size; a ring that spans
    nodes runs every byte at the network's pace, so its full volume is
    ``inter * ranks per node of the ring``."""
    if layout.num_nodes == 1 or inter <= 0:
        return intra, 0.0
    per_node = 1 if cfg.method == "hsdp" else max(layout.gpus_per_node // cfg.tp, 1)
    cross = inter * per_node
    return max(intra + inter - cross, 0.0), cross


def _pp_candidate(ctx: _Context, cfg: _Config, est: MethodEstimate, profiles: _Profiles, gc: bool,
                  split: tuple[int, int]) -> Candidate:
    """A pipeline candidate from its method's estimate at exactly its configuration (the microbatches
    composed; fast mode, the stages at 1 and 2 layers extrapolated, unless :func:`_screened_at_full_depth`:
    then the estimate is the one verification would make, and the candidate is verified)."""
    from llmem_plugin.methods.pp.method import pipeline_across_nodes

    m, k = split
    # The method reports its P2P volume and TP's (inside a node) with the FSDP2 ring's, the P2P on the link
    # pipeline neighbours share: what is left is FSDP2's, overlapped with compute.
    p2p, tp_bytes = _pp_path_bytes(ctx, cfg, gc, split)
    if pipeline_across_nodes(ctx.layout):
        fsdp_intra, fsdp_cross = max(est.comm_intra_node_bytes - tp_bytes, 0), max(est.comm_inter_node_bytes - p2p, 0)
    else:
        fsdp_intra, fsdp_cross = max(est.comm_intra_node_bytes - p2p - tp_bytes, 0), est.comm_inter_node_bytes
    st, _ = _pp_work(ctx, cfg, profiles, gc, fsdp_intra, fsdp_cross, split)
    w = est.worst
    host = est.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return Candidate(
        method=cfg.method, tp=cfg.tp, pp=cfg.pp, micro_batch=1, grad_accum=m, schedule_steps=k,
        grad_checkpointing=gc, offload=None,
        device_total_bytes=w.device_total_bytes, peak_allocated_bytes=w.peak_allocated_bytes,
        peak_reserved_bytes=w.peak_reserved_bytes, limit_bytes=ctx.limit,
        fits=w.device_total_bytes <= ctx.limit and w.fits and host_fits,
        verified=_screened_at_full_depth(ctx, cfg), time=st,
        tokens_per_s=ctx.global_batch * ctx.workload.seq_len / st.total_s,
        segments=_segments(est, w.peak_allocated_bytes, w.peak_reserved_bytes, 0.0),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )


def _pp_work(ctx: _Context, cfg: _Config, profiles: _Profiles, gc: bool, fsdp_intra: float, fsdp_cross: float,
             split: tuple[int, int]) -> tuple[StepTime, int]:
    """A pipeline candidate's step time: each rank computes its stage for its data-parallel share (one-row
    microbatches), idles for the schedule's bubble (:func:`llmem_plugin.planner.cost.pipeline_bubble_s`), waits
    for each microbatch's activations and input gradients from its neighbours (P2P on the critical path:
    not hidden), and overlaps FSDP2's one gather and one reduction per step with compute. TP inside the
    stages splits each stage's compute tp ways and adds its collectives on the critical path (each layer's
    all-reduces wait for the matmul before them and gate the one after). ``split``: (microbatches per
    schedule step, schedule steps per optimizer step); each schedule step has its own bubble, (p - 1) / m
    of its compute, and its own FSDP2 gather and reduction (counted by the method)."""
    _, v = _PP[cfg.method]
    m, k = split
    p2p, tp_bytes = _pp_path_bytes(ctx, cfg, gc, split)
    work = StepWork(flops=profiles.flops(1, gc).scaled(m * k / (cfg.pp * cfg.tp)), micro_steps=1,
                    intra_only_bytes=round(fsdp_intra),
                    cross_node_bytes=round(fsdp_cross), overlap=Overlap.FORWARD_BACKWARD,
                    optimizer_elements=ctx.trainable // ctx.layout.num_gpus, gpus_per_node=ctx.layout.gpus_per_node)
    st = step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                   network=ctx.network, efficiency=ctx.efficiency)
    from llmem_plugin.methods.pp.method import pipeline_across_nodes

    across = pipeline_across_nodes(ctx.layout)
    p2p_s = p2p / ((ctx.network.inter_node_gbps if across else ctx.network.intra_node_gbps) * 1e9)
    tp_s = tp_bytes / (ctx.network.intra_node_gbps * 1e9)  # the TP group stays inside a node
    bubble = pipeline_bubble_s(st.compute_s, degree=cfg.pp, microbatches=m, stages_per_rank=v)
    return dataclasses.replace(st, comm_s=st.comm_s + p2p_s + tp_s, exposed_comm_s=st.exposed_comm_s + p2p_s + tp_s,
                               bubble_s=bubble), p2p + tp_bytes


def _pp_path_bytes(ctx: _Context, cfg: _Config, gc: bool, split: tuple[int, int]) -> tuple[int, int]:
    """(P2P, TP) bytes a pipeline candidate's rank sends per step on the critical path: each microbatch's
    activations and input gradients per stage, and TP's collectives over the deepest rank's decoder layers
    under torchtitan's split, as the method counts them (:func:`llmem_plugin.methods.pp.method.tensor_parallel_bytes`)."""
    from llmem_plugin.methods.pp.method import rank_layers, stage_specs, tensor_parallel_bytes

    schedule, v = _PP[cfg.method]
    microbatches = split[0] * split[1]  # over all the optimizer step's schedule steps
    es = _activation_bytes(ctx.workload)
    p2p = 2 * microbatches * v * ctx.workload.seq_len * int(ctx.config.hidden_size) * es
    # The rank's stages run one after another: its TP collectives cover all of their layers.
    layers = rank_layers(schedule, cfg.pp, v, stage_specs(num_layers(ctx.config), cfg.pp * v))
    tp_bytes = tensor_parallel_bytes(micro_batch=1, seq_len=ctx.workload.seq_len, hidden=int(ctx.config.hidden_size),
                                     vocab=int(ctx.config.vocab_size), layers=layers, microbatches=microbatches,
                                     tp=cfg.tp, bytes_per=es, recompute=gc)
    return p2p, tp_bytes


def _screened_at_full_depth(ctx: _Context, cfg: _Config) -> bool:
    """Whether a pipeline configuration's fast-mode screen is its full-depth estimate: every stage has at
    most :data:`~llmem_plugin.methods.pp.method.FAST_FULL_DEPTH_LAYERS` layers, which fast mode traces whole. Its
    candidates are then verified by the screen (a second trace would repeat the same one)."""
    from llmem_plugin.methods.pp.method import FAST_FULL_DEPTH_LAYERS, stage_specs

    v = _PP[cfg.method][1]
    specs = stage_specs(num_layers(ctx.config), cfg.pp * v)
    return max(sp.stop - sp.start for sp in specs) <= FAST_FULL_DEPTH_LAYERS
