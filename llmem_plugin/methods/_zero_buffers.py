"""DeepSpeed ZeRO's buffers and hooks, emulated during the traced step.

Private to :mod:`llmem_plugin.methods.zero`, whose docstring gives the rules
(DeepSpeed 0.19.8, ``deepspeed/runtime/zero/``) and its known limitations.
:class:`Buffers` allocates DeepSpeed's buffers as fake tensors under the
tracker and remembers their categories; :class:`Zero12` and :class:`Zero3`
place hooks where DeepSpeed places its own (``stage_1_and_2.py``;
``stage3.py``, ``parameter_offload.py``, ``partitioned_param_coordinator.py``)
and allocate, reduce, gather and release in program order; :func:`breakdown`
splits the buffers back out of the PARAMETER bucket at the peak.

It also holds what the method module and the emulators share: the plan the
buffers are sized from (``_Plan``, made by :mod:`~llmem_plugin.methods.zero`)
and :class:`ZeroCategory`, the buffers' categories (ColossalAI's emulators
label theirs with it too).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, TraceResult
from llmem_plugin.workload import OptimizerKind

__all__ = ["Buffers", "Zero3", "Zero12", "ZeroCategory", "breakdown"]


class ZeroCategory(str, Enum):
    """DeepSpeed's own buffers, beside :class:`MemoryCategory`."""

    MASTER_WEIGHTS = "fp32_master_weights"
    FP32_GRADIENTS = "fp32_gradients"
    BUCKETS = "buckets"
    GATHERED_PARAMS = "gathered_parameters"


# ----------------------------------------------------------------- the plan the buffers are sized from
@dataclass
class _Group:
    """One ZeRO-1/2 flat group (stage_1_and_2.py, the per-group loop of __init__)."""

    params: list[nn.Parameter]
    aligned: int  # elements incl. padding
    partition: int  # aligned // dp
    in_partition: list[nn.Parameter]  # get_partition_info, for this rank


@dataclass
class _Plan:
    """One rank's ZeRO plan (:func:`llmem_plugin.methods.zero._plan`): its groups, partitions and settings."""

    stage: int
    dp: int
    rank: int
    dtype: torch.dtype
    cfg: Any  # the method's ZeroConfig (llmem_plugin.methods.zero, which imports this module)
    optimizer: OptimizerKind
    params: list[nn.Parameter]  # unique, model order
    trainable: list[nn.Parameter]
    groups: list[_Group]
    persistent: set[int]  # ids of params kept whole (ZeRO-3)
    sub_groups: list[list[nn.Parameter]]
    decay_groups: list[list[nn.Parameter]] = dataclasses.field(default_factory=list)  # ZeRO-3 param groups

    @property
    def es(self) -> int:
        return self.dtype.itemsize  # no tensor: under the tracer an empty one would count as an allocation

    def part(self, p: nn.Parameter) -> int:
        """ZeRO-3 partition elements (partition_parameters.py ``_aligned_size // world``)."""
        return -(-p.numel() // self.dp)

    def in_numel(self) -> int:
        return sum(p.numel() for g in self.groups for p in g.in_partition)


class Buffers:
    """Allocates DeepSpeed's buffers as fake tensors under the tracker.

    Each is labelled PARAMETER in the tracker (so the forward's activation
    relabelling leaves it alone) and remembered here by record index with its
    real category, which :func:`breakdown` splits back out.
    """

    def __init__(self, tracker: MemoryTracker, plan: _Plan, *, capacity: int) -> None:
        self.tracker, self.plan, self.capacity = tracker, plan, capacity
        self.labels: dict[int, Enum] = {}
        self.counting = False
        self.sent_bytes = 0

    def new(self, numel: int, cat: Enum, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.make(lambda: torch.empty(max(int(numel), 0), dtype=dtype or self.plan.dtype), cat)

    def make(self, fn: Any, cat: Enum) -> torch.Tensor:
        """Run ``fn`` (one allocation) and label what it allocated."""
        start = self.tracker.num_records
        t = fn()
        if self.tracker.num_records > start:
            self.labels.update(dict.fromkeys(range(start, self.tracker.num_records), cat))
            self.tracker.label([t], MemoryCategory.PARAMETER)
        return t

    def fp32_copy(self, numel: int, cat: Enum) -> torch.Tensor:
        """A 16-bit tensor cast to fp32 (``.clone().float()``, ``flatten(...).to(fp32)``):
        two allocations, the 16-bit one dropped; one when training in fp32."""
        if self.plan.dtype == torch.float32:
            return self.new(numel, cat, torch.float32)
        tmp = self.new(numel, MemoryCategory.TEMPORARY)
        return self.make(lambda: tmp.to(torch.float32), cat)

    def send(self, nbytes: float) -> None:
        if self.counting:
            self.sent_bytes += int(nbytes)


def _step_group(optimizer: torch.optim.Optimizer, master: torch.Tensor, grad: torch.Tensor) -> None:
    """One group's step, as ``_optimizer_step`` runs it (param_groups narrowed to it)."""
    saved = optimizer.param_groups
    optimizer.param_groups = [{**saved[0], "params": [master]}]
    master.grad = grad
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved
        master.grad = None


class Zero12:
    """ZeRO-1/2 buffers (stage_1_and_2.py, DeepSpeedZeroOptimizer)."""

    def __init__(self, buf: Buffers, model: nn.Module) -> None:
        self.b, self.plan, self.cfg = buf, buf.plan, buf.plan.cfg
        self.in_part = {id(p) for g in self.plan.groups for p in g.in_partition}
        self.share = _shares(self.plan)
        self.bucket: list[torch.Tensor] = []
        self.index = self.elems = 0
        self.bucket_params: list[nn.Parameter] = []
        self.extra: torch.Tensor | None = None
        self.gip: torch.Tensor | None = None  # grads_in_partition
        self.accum: torch.Tensor | None = None  # all_grad_tensors / averaged_gradients
        self.boundary = True
        self.optimizer: torch.optim.Optimizer | None = None
        self.hooks: list[Any] = []

    def setup(self) -> None:
        from llmem_plugin.trace.step import make_optimizer

        b, plan, es = self.b, self.plan, self.plan.es
        # engine._configure_distributed_model: the cast module moves to the GPU.
        orig = {id(p): b.new(p.numel(), MemoryCategory.PARAMETER) for p in plan.params}
        self.flat: list[torch.Tensor] = []
        self.master: list[torch.Tensor] = []
        for g in plan.groups:
            olds = [orig.pop(id(p)) for p in g.params]
            # "Flatten on accelerator device if we have enough memory for the
            # flat buffer"; otherwise the params go to the CPU first.
            if b.capacity - b.tracker.live_bytes() < g.aligned * es:
                olds.clear()
            self.flat.append(b.new(g.aligned, MemoryCategory.PARAMETER))
            olds.clear()  # _update_model_bit16_weights: params become views of the flat buffer
            if not self.cfg.offload_optimizer:  # partition .clone().to(fp32)
                self.master.append(b.fp32_copy(g.partition, ZeroCategory.MASTER_WEIGHTS).requires_grad_(True))
        self.frozen = list(orig.values())
        if self.cfg.offload_optimizer:
            # temp_grad_buffer_for_gpu_offload: one 16-bit buffer of the largest param.
            self.offload_buf = b.new(max(p.numel() for p in plan.trainable), ZeroCategory.BUCKETS)
        else:
            # initialize_optimizer_states: a zero fp32 grad per group, dropped again.
            tmp_grads = [b.new(g.partition, ZeroCategory.FP32_GRADIENTS, torch.float32) for g in plan.groups]
            del tmp_grads
            self.optimizer = make_optimizer(self.master, plan.optimizer)
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in plan.trainable]

    def begin_micro(self, boundary: bool) -> None:
        self.boundary = boundary

    def _on_grad(self, p: nn.Parameter) -> None:
        # process_gradients -> setup_buckets, then reduce in the hook for stage 2
        # (and for stage 1 with overlap_comm, at the boundary).
        if not self.bucket:
            n = 2 if self.cfg.overlap_comm else 1  # "double buffers ... when overlap_comm"
            self.bucket = [self.b.new(self.cfg.reduce_bucket_size, ZeroCategory.BUCKETS) for _ in range(n)]
            self.index = 0
        if self.plan.stage == 2 or (self.cfg.overlap_comm and self.boundary):
            self._reduce_param(p)

    def _reduce_param(self, p: nn.Parameter) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads."""
        n = p.numel()
        if self.elems and self.elems + n > self.cfg.reduce_bucket_size:
            self._reduce_ipg()
            if self.cfg.overlap_comm:
                self.index = 1 - self.index
        if n > self.cfg.reduce_bucket_size:
            self.extra = p.grad  # extra_large_param_to_reduce: reduced in place
        else:
            self.bucket[self.index].narrow(0, self.elems, n).copy_(p.grad.reshape(-1))
        p.grad = None  # grad.data now views the bucket: the autograd buffer is freed
        self.bucket_params.append(p)
        self.elems += n

    def _reduce_ipg(self) -> None:
        """reduce_ipg_grads: average_tensor flattens the bucket (allreduce_bucket)
        and all-reduces it; the rank's own grads go to grads_in_partition."""
        if not self.bucket_params:
            return
        b, plan = self.b, self.plan
        tmp = b.new(self.elems, ZeroCategory.BUCKETS)
        del tmp
        ring = 2 if self.cfg.use_multi_rank_bucket_allreduce else 1  # all-reduce vs reduce to owner
        b.send(ring * (plan.dp - 1) / plan.dp * self.elems * plan.es)
        for p in self.bucket_params:
            if id(p) not in self.in_part:
                continue
            if self.cfg.offload_optimizer:
                # async_inplace_copy_grad_to_fp32_buffer_from_gpu: .to(fp32), copy to the host
                tmp32 = b.new(self.share[id(p)], ZeroCategory.FP32_GRADIENTS, torch.float32)
                del tmp32
            elif self.gip is None:
                self.gip = b.new(plan.in_numel(), MemoryCategory.GRADIENT)
        self.extra = None
        self.bucket_params, self.elems = [], 0

    def end_backward(self, boundary: bool) -> None:
        if self.plan.stage == 1:
            if not boundary:
                return  # stage 1 reduces only at the boundary (engine.allreduce_gradients)
            if not self.cfg.overlap_comm:  # reduce_gradients
                for g in self.plan.groups:
                    for p in g.params:
                        if p.grad is not None:
                            self._reduce_param(p)
        # independent_gradient_partition_epilogue
        self._reduce_ipg()
        if self.accum is None:
            self.accum = self.gip
        elif self.gip is not None:
            self.accum.add_(self.gip)
        self.gip = None
        self.bucket = []  # _release_ipg_buffers

    def step(self) -> None:
        b, plan = self.b, self.plan
        for i, g in enumerate(plan.groups):
            if not self.cfg.offload_optimizer:
                g32 = b.fp32_copy(g.partition, ZeroCategory.FP32_GRADIENTS)  # flatten(averaged_gradients)
                if i == len(plan.groups) - 1:
                    self.accum = None  # the last view of grads_in_partition is dropped
                _step_group(self.optimizer, self.master[i], g32)
                del g32
            # all_gather_dp_groups -> all_gather_into_tensor into the flat buffer, in place.
            b.send((plan.dp - 1) * g.partition * plan.es)
        self.accum = None


def _shares(plan: _Plan) -> dict[int, int]:
    """Elements of each param inside the rank's partition (grad_position)."""
    out = {}
    for g in plan.groups:
        start, end, cur = g.partition * plan.rank, g.partition * (plan.rank + 1), 0
        for p in g.params:
            out[id(p)] = max(0, min(end, cur + p.numel()) - max(start, cur))
            cur += p.numel()
    return out


class _PreBackward(torch.autograd.Function):
    """parameter_offload.py PreBackwardFunctionForModule: fetch before a module's backward."""

    @staticmethod
    def forward(ctx, z3: Zero3, module: nn.Module, t: torch.Tensor) -> torch.Tensor:
        ctx.z3, ctx.module = z3, module
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.z3.fetch(ctx.module, forward=False)
        return None, None, grad


class _PostBackward(torch.autograd.Function):
    """parameter_offload.py PostBackwardFunctionModule: release once every input's grad is done."""

    @staticmethod
    def forward(ctx, z3: Zero3, module: nn.Module, t: torch.Tensor) -> torch.Tensor:
        ctx.z3, ctx.module = z3, module
        z3.grads_remaining[id(module)] += 1
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        z3 = ctx.z3
        z3.grads_remaining[id(ctx.module)] -= 1
        if z3.grads_remaining[id(ctx.module)] == 0:
            z3.release(ctx.module, forward=False)
        return None, None, grad


_NOT_AVAILABLE, _INFLIGHT, _AVAILABLE = 0, 1, 2


@dataclass(eq=False)
class _Handle:
    flat: torch.Tensor | None
    params: list[nn.Parameter]
    sequential: bool
    done: bool = False


class Zero3:
    """ZeRO-3 buffers and the parameter coordinator (stage3.py,
    parameter_offload.py, partitioned_param_coordinator.py)."""

    def __init__(self, buf: Buffers, model: nn.Module) -> None:
        self.b, self.plan, self.cfg = buf, buf.plan, buf.plan.cfg
        self.model = model
        self.pid = {id(p): i for i, p in enumerate(self.plan.params)}  # ds_id
        self.mparams: dict[int, list[nn.Parameter]] = {}
        for m in model.modules():
            direct = {id(p): p for p in m.parameters(recurse=False)}
            if direct:
                self.mparams[id(m)] = sorted(direct.values(), key=lambda p: self.pid[id(p)])
        self.status = dict.fromkeys(self.pid, _NOT_AVAILABLE)
        self.full: dict[int, torch.Tensor] = {}
        self.inflight: dict[int, _Handle] = {}
        self.active: dict[int, set[int]] = defaultdict(set)
        self.active_bwd: dict[int, nn.Module] = {}
        self.grads_remaining: dict[int, int] = defaultdict(int)
        self.mode = "invalid"  # ZeRoTraceMode
        self.order: list[nn.Module] = []
        self.param_order: list[tuple[nn.Parameter, int]] = []
        self.queue: deque = deque()
        self.most_recent: dict[int, int] = defaultdict(lambda: -10**10)
        self.step_id = self.n_available = 0
        self.bucket_params: list[nn.Parameter] = []
        self.pending: list[torch.Tensor] = []
        self.elems = 0
        self.hooks: list[Any] = []

    # ------------------------------------------------------------ setup
    def setup(self) -> None:
        from llmem_plugin.trace.step import make_optimizer

        b, plan, cfg = self.b, self.plan, self.cfg
        P = MemoryCategory.PARAMETER
        # zero.Init (_partition_param): a ceil(numel/dp) partition per param,
        # on the host with offload_param unless persistent.
        self.parts = {}
        for p in plan.params:
            if not cfg.offload_param or id(p) in plan.persistent:
                with b.tracker.owned_by(p):  # the layer of the parameter (fast mode's stream synthesis)
                    self.parts[id(p)] = b.new(plan.part(p), P)
        if not cfg.offload_param:  # _create_fp16_partitions_with_defragmentation
            self.lp = b.new(sum(plan.part(p) for p in plan.trainable), P)
            for p in plan.trainable:
                self.parts.pop(id(p), None)
        self.master: list[torch.Tensor] = []
        if not cfg.offload_optimizer:
            sizes = [sum(plan.part(p) for p in sg) for sg in plan.sub_groups]
            for n in sizes:  # _create_fp32_partitions: .clone().float()
                self.master.append(b.fp32_copy(n, ZeroCategory.MASTER_WEIGHTS).requires_grad_(True))
            gbuf = b.new(max(sizes), ZeroCategory.FP32_GRADIENTS, torch.float32)  # initialize_optimizer_states
            del gbuf
            self.optimizer = make_optimizer(self.master, plan.optimizer)
        # _setup_for_real_optimizer: the IPG bucket and the gradient partitions.
        self.bucket = b.new(cfg.reduce_bucket_size, ZeroCategory.BUCKETS)
        if not cfg.offload_optimizer:
            self.grad_parts = b.new(sum(plan.part(p) for p in plan.trainable), MemoryCategory.GRADIENT)
        self.hooks = [self.model.register_forward_pre_hook(lambda m, a: self.reset_step())]
        for m in self.model.modules():
            if id(m) in self.mparams:
                self.hooks += [m.register_forward_pre_hook(self._pre_forward), m.register_forward_hook(self._post_forward)]
        self.hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in plan.trainable]

    def begin_micro(self, boundary: bool) -> None:
        pass

    # ------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: tuple) -> tuple:
        self.fetch(module, forward=True)
        self.grads_remaining[id(module)] = 0
        return tuple(_PostBackward.apply(self, module, a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                     for a in args)

    def _post_forward(self, module: nn.Module, args: tuple, out: Any) -> Any:
        self.release(module, forward=True)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return _PreBackward.apply(self, module, out)
        return out

    def reset_step(self) -> None:
        """PartitionedParameterCoordinator.reset_step, at the start of every forward."""
        if self.mode == "record":
            self.param_order = [(p, i) for i, m in enumerate(self.order) for p in self.mparams[id(m)]]
            self.mode = "complete"
        elif self.mode == "invalid":
            self.mode, self.order = "record", []
        self.queue = deque(self.param_order)
        self.most_recent = defaultdict(lambda: -10**10)
        self.step_id = self.n_available = 0

    # -------------------------------------------------------- coordinator
    def fetch(self, module: nn.Module, *, forward: bool) -> None:
        """fetch_sub_module: gather, wait, prefetch from the recorded trace."""
        if self.mode == "complete" and (self.step_id >= len(self.order) or self.order[self.step_id] is not module):
            self.mode, self.order, self.param_order = "invalid", [], []  # trace_prologue invalidates
        if self.mode == "record":
            self.order.append(module)
        if not forward:
            self.active_bwd[id(module)] = module
        params = self.mparams[id(module)]
        need = [p for p in params if self.status[id(p)] == _NOT_AVAILABLE]
        if need:
            self._all_gather(need)
        for p in params:
            self.active[id(p)].add(id(module))
            if id(p) in self.inflight:
                self._wait(p)
        if self.mode == "complete":
            fresh = {id(p) for p in params if self.most_recent[id(p)] < self.step_id}
            popped: set[int] = set()
            while self.queue and len(popped) < len(fresh):
                q, s = self.queue.popleft()
                self.most_recent[id(q)] = s
                popped.add(id(q))
            assert popped == fresh, "ZeRO-3 emulation: prefetch queue out of step with the trace"
            limit = min(self.cfg.max_live_parameters - self.n_available, self.cfg.prefetch_bucket_size)
            pre: dict[int, nn.Parameter] = {}
            numel = 0
            while self.cfg.prefetch_bucket_size > 0 and self.queue and numel < limit:
                q, s = self.queue.popleft()
                if self.status[id(q)] == _NOT_AVAILABLE and id(q) not in pre:
                    pre[id(q)] = q
                    numel += q.numel()
                self.most_recent[id(q)] = max(self.most_recent[id(q)], s)
            if pre:
                self._all_gather(sorted(pre.values(), key=lambda p: self.pid[id(p)]))
        self.step_id += 1

    def _all_gather(self, params: list[nn.Parameter]) -> None:
        """all_gather_coalesced: one flat buffer for several params (each copied
        out with torch.cat on wait), or a padded buffer per param
        (_all_gather_sequential) that the param views."""
        b, plan = self.b, self.plan
        self.n_available += sum(p.numel() for p in params)
        b.send((plan.dp - 1) * sum(plan.part(p) for p in params) * plan.es)
        host = {id(p) for p in params if self.cfg.offload_param and id(p) not in plan.persistent}
        sequential = self.cfg.allgather_sequential or len(params) == 1
        groups = [[p] for p in params] if sequential else [params]
        for ps in groups:
            flat = b.new(sum(plan.part(p) for p in ps) * plan.dp, ZeroCategory.GATHERED_PARAMS)
            copies = [b.new(plan.part(p), MemoryCategory.TEMPORARY) for p in ps if id(p) in host]  # ds_tensor.to(device)
            del copies
            h = _Handle(flat, ps, sequential)
            for p in ps:
                self.status[id(p)] = _INFLIGHT
                self.inflight[id(p)] = h

    def _wait(self, p: nn.Parameter) -> None:
        h = self.inflight.pop(id(p))
        if not h.done:
            h.done = True
            for q in h.params:
                if h.sequential:
                    self.full[id(q)] = h.flat  # param.data = narrow view of the buffer
                else:
                    self.full[id(q)] = self.b.new(q.numel(), ZeroCategory.GATHERED_PARAMS)
                self.status[id(q)] = _AVAILABLE
        if not any(id(q) in self.inflight for q in h.params):
            h.flat = None

    def _release_param(self, p: nn.Parameter) -> None:
        if self.status[id(p)] == _AVAILABLE and not self.active[id(p)]:
            self.full.pop(id(p))
            self.status[id(p)] = _NOT_AVAILABLE
            self.n_available -= p.numel()

    def release(self, module: nn.Module, *, forward: bool) -> None:
        """release_sub_module; with a complete trace only params not reused
        within max_reuse_distance (``__params_to_release``)."""
        params = self.mparams[id(module)]
        if self.mode == "complete":
            drop = {id(p) for p in params if id(p) not in self.plan.persistent
                    and self.most_recent[id(p)] <= self.step_id}
            seen = 0
            for m in self.order[self.step_id:]:
                if seen >= self.cfg.max_reuse_distance or not drop:
                    break
                for q in self.mparams[id(m)]:
                    drop.discard(id(q))
                    seen += q.numel()
        else:
            drop = {id(p) for p in params}
        if not forward:
            self.active_bwd.pop(id(module), None)
        for p in params:
            self.active[id(p)].discard(id(module))
            if id(p) in drop:
                self._release_param(p)

    # ---------------------------------------------------------- gradients
    def _on_grad(self, p: nn.Parameter) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads / __add_grad_to_ipg_bucket."""
        n = p.numel()
        if self.elems and self.elems + n > self.cfg.reduce_bucket_size:
            self._reduce_bucket()
        if self.elems + n <= self.cfg.reduce_bucket_size:
            self.bucket.narrow(0, self.elems, n).copy_(p.grad.reshape(-1))
        else:
            self.pending.append(p.grad)
        p.grad = None
        self.bucket_params.append(p)
        self.elems += n

    def _reduce_bucket(self) -> None:
        """__reduce_and_partition_ipg_grads: reduce_scatter_coalesced interleaves
        padded partitions into one buffer (none for one divisible tensor);
        partition_grads copies or adds them into the partition buffer."""
        if not self.bucket_params:
            return
        b, plan = self.b, self.plan
        padded = sum(plan.part(p) * plan.dp for p in self.bucket_params)
        single = len(self.bucket_params) == 1 and self.bucket_params[0].numel() % plan.dp == 0
        tmp = None if single else b.new(padded, ZeroCategory.BUCKETS)
        b.send((plan.dp - 1) / plan.dp * padded * plan.es)
        if self.cfg.offload_optimizer:  # grad_buffer.to(device) per param on its way to the host
            for p in self.bucket_params:
                t = b.new(plan.part(p), MemoryCategory.TEMPORARY)
                del t
        del tmp
        self.pending, self.bucket_params, self.elems = [], [], 0

    def end_backward(self, boundary: bool) -> None:
        self._reduce_bucket()  # independent_gradient_partition_epilogue
        # backward_epilogue -> release_backward_leftovers (persistent params stay).
        while self.active_bwd:
            _, m = self.active_bwd.popitem()
            for p in self.mparams[id(m)]:
                self.active[id(p)].discard(id(m))
                if id(p) not in self.plan.persistent:
                    self._release_param(p)

    def step(self) -> None:
        b, plan = self.b, self.plan
        # _partition_all_parameters -> release_and_reset_all (persistent too).
        for p in plan.params:
            if id(p) in self.inflight:
                self._wait(p)
            self.active[id(p)].clear()
            self._release_param(p)
        for i, sg in enumerate(plan.sub_groups if not self.cfg.offload_optimizer else []):
            n = sum(plan.part(p) for p in sg)  # _prepare_fp32_grad_for_sub_group: flatten(...).to(fp32)
            g32 = b.fp32_copy(n, ZeroCategory.FP32_GRADIENTS)
            _step_group(self.optimizer, self.master[i], g32)
            del g32
        # _post_step: persistent params gathered again (_allgather_params_coalesced, a buffer each).
        for p in (q for q in plan.params if id(q) in plan.persistent):
            with b.tracker.owned_by(p):
                self.full[id(p)] = b.new(plan.part(p) * plan.dp, ZeroCategory.GATHERED_PARAMS)
            self.status[id(p)] = _AVAILABLE
            b.send((plan.dp - 1) * plan.part(p) * plan.es)


def breakdown(trace: TraceResult, buf: Buffers) -> TraceResult:
    """Split DeepSpeed's buffers out of the PARAMETER bucket at the peak."""
    peak_pos = max(range(len(trace.timeline)), key=lambda i: (trace.timeline[i][2], -i), default=-1)
    mine: dict[Enum, int] = defaultdict(int)
    for sign, idx, nbytes in trace.events[: peak_pos + 1]:
        if idx in buf.labels:
            mine[buf.labels[idx]] += sign * nbytes
    out: dict[Any, int] = dict(trace.breakdown)
    out[MemoryCategory.PARAMETER] = out.get(MemoryCategory.PARAMETER, 0) - sum(mine.values())
    for cat, v in mine.items():
        out[cat] = out.get(cat, 0) + v
    return dataclasses.replace(trace, breakdown={k: v for k, v in out.items() if v})
