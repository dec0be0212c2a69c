"""ColossalAI's Gemini and LowLevelZero buffers, emulated during the traced step.

Private to :mod:`llmem_plugin.methods.colossal`, whose docstring gives the
rules (ColossalAI 0.5.0) and the known limitations. Buffers are allocated
through :class:`llmem_plugin.methods._zero_buffers.Buffers` so that
:func:`~llmem_plugin.methods._zero_buffers.breakdown` splits them out.
:class:`ChunkPlan`, the chunk layout that
:func:`~llmem_plugin.methods.colossal.plan_chunks` makes and :class:`Gemini`
allocates, lives here, below the method module that imports this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.methods._zero_buffers import Buffers, ZeroCategory
from llmem_plugin.trace.tracker import MemoryCategory
from llmem_plugin.workload import OptimizerKind

__all__ = ["ChunkPlan", "Gemini", "LowLevelZero"]


@dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """One chunk: ``members`` are parameter indices (model order) with their
    ``(offset, end)`` inside it."""

    chunk_size: int
    keep_gathered: bool
    members: tuple[tuple[int, int, int], ...]

    @property
    def utilized(self) -> int:
        return self.members[-1][2]

    def shard_size(self, dp: int) -> int:
        return self.chunk_size if self.keep_gathered else self.chunk_size // dp

    def valid(self, dp: int, rank: int) -> int:
        """Elements of real parameters in ``rank``'s shard (``Chunk.close_chunk`` ``valid_end``)."""
        if self.keep_gathered:
            return self.utilized
        shard = self.chunk_size // dp
        return max(0, min(self.utilized - shard * rank, shard))


class _PreBackward(torch.autograd.Function):
    """Runs ``emu.pre_backward(module)`` when the module's output gradient
    arrives, before the module's own backward (GeminiZeROHook.pre_backward)."""

    @staticmethod
    def forward(ctx, emu: Gemini, module: nn.Module, t: torch.Tensor) -> torch.Tensor:
        ctx.emu, ctx.module = emu, module
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.emu.use(ctx.module)
        return None, None, grad


class _Chunk:
    """A 16-bit chunk's live state (chunk/chunk.py ``Chunk``)."""

    def __init__(self, plan: ChunkPlan, index: int) -> None:
        self.plan, self.index = plan, index
        self.shard: torch.Tensor | None = None  # cuda_shard
        self.full: torch.Tensor | None = None  # cuda_global_chunk
        self.arrived = 0  # tensors READY_FOR_REDUCE


class Gemini:
    """GeminiDDP + GeminiOptimizer with the static placement policy (shard_param_frac=1.0)."""

    def __init__(self, buf: Buffers, model: nn.Module, params: list[nn.Parameter], *, chunks: list[ChunkPlan],
                 dp: int, rank: int) -> None:
        self.b, self.model, self.dp, self.rank = buf, model, dp, rank
        self.chunks = [_Chunk(c, i) for i, c in enumerate(chunks)]
        self.of = {id(params[i]): self.chunks[k] for k, c in enumerate(chunks) for i, _, _ in c.members}
        self.mchunks: dict[int, list[_Chunk]] = {}
        for m in model.modules():
            own = [self.of[id(p)] for p in m.parameters(recurse=False) if id(p) in self.of]
            if own:
                self.mchunks[id(m)] = list(dict.fromkeys(own))
        self.hooks: list[Any] = []
        self.states: list[torch.Tensor] = []

    def setup(self) -> None:
        b, dp = self.b, self.dp
        self.master = []
        for c in self.chunks:
            n = c.plan.shard_size(dp)
            # _init_chunks: fp16 and fp32 chunks, closed and scattered (Chunk.close_chunk);
            # a kept-gathered chunk keeps its cuda_global_chunk.
            if c.plan.keep_gathered:
                c.full = b.new(n, MemoryCategory.PARAMETER)
            else:
                c.shard = b.new(n, MemoryCategory.PARAMETER)
            self.master.append(b.new(n, ZeroCategory.MASTER_WEIGHTS, torch.float32))
        for m in self.model.modules():
            if id(m) in self.mchunks:
                self.hooks += [m.register_forward_pre_hook(lambda mod, a: self.use(mod)),
                               m.register_forward_hook(self._post_forward)]
        self.hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self.model.parameters() if id(p) in self.of]

    def begin_micro(self, micro: int) -> None:
        pass

    def _post_forward(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return _PreBackward.apply(self, module, out)
        return out

    # ---------------------------------------------------------- chunk moves
    def use(self, module: nn.Module) -> None:
        """GeminiZeROHook.pre_op: the op's chunks to COMPUTE, every other
        releasable chunk released (StaticPlacementPolicy.evict_tensors), then
        the op's chunks gathered (ChunkManager.access_chunk)."""
        need = self.mchunks[id(module)]
        for c in self.chunks:
            # Chunk.can_release: not kept gathered, no tensor READY_FOR_REDUCE.
            if c.full is not None and c not in need and not c.plan.keep_gathered and c.arrived == 0:
                self._scatter(c, MemoryCategory.PARAMETER)
        for c in need:
            self._gather(c)

    def _gather(self, c: _Chunk) -> None:
        """Chunk.__gather: alloc_storage(cuda_global_chunk), all_gather_into_tensor, shard dropped."""
        if c.full is not None:
            return
        c.full = self.b.new(c.plan.chunk_size, ZeroCategory.GATHERED_PARAMS)
        self.b.send((self.dp - 1) * c.plan.shard_size(self.dp) * self.b.plan.es)
        c.shard = None

    def _scatter(self, c: _Chunk, cat: MemoryCategory) -> None:
        """Chunk.__scatter: a new shard, copied out of the global chunk, whose storage is freed."""
        c.shard = self.b.new(c.plan.shard_size(self.dp), cat)
        c.full = None

    def _on_grad(self, p: nn.Parameter) -> None:
        """GeminiDDP.grad_handle (reuse_fp16_chunk): the gradient is copied into
        the gathered 16-bit chunk; a chunk whose gradients are all in is reduced."""
        c = self.of[id(p)]
        self._gather(c)
        p.grad = None  # the hook hands autograd a freed empty_like(grad)
        c.arrived += 1
        if c.arrived < len(c.plan.members):
            return
        es, dp, n = self.b.plan.es, self.dp, c.plan.chunk_size
        c.arrived = 0
        if c.plan.keep_gathered:  # Chunk.reduce: all_reduce in place
            self.b.send(2 * (dp - 1) / dp * n * es)
        else:  # Chunk.reduce: reduce_scatter_tensor into a new cuda_shard (dp == 1: __scatter)
            self.b.send((dp - 1) / dp * n * es)
            self._scatter(c, MemoryCategory.GRADIENT)

    def end_backward(self) -> None:
        pass

    def step(self) -> None:
        """GeminiOptimizer.step: HybridAdam's state is created at the first
        step per parameter slice in the rank's fp32 shard (``zeros_like``);
        the update and ``optim_update`` run in place."""
        if self.states:
            return
        for c in self.chunks:
            plan = c.plan
            lo = 0 if plan.keep_gathered else plan.shard_size(self.dp) * self.rank
            hi = lo + plan.shard_size(self.dp)
            for _, off, end in plan.members:
                n = min(end, hi) - max(off, lo)
                if n > 0:
                    for _ in range(2):  # exp_avg, exp_avg_sq
                        self.states.append(self.b.new(n, MemoryCategory.OPTIMIZER_STATE, torch.float32))


class LowLevelZero:
    """LowLevelZeroOptimizer (zero/low_level/low_level_optim.py), stage 1 or 2."""

    def __init__(self, buf: Buffers, model: nn.Module, params: list[nn.Parameter], *, stage: int, dp: int,
                 bucket: int, overlap: bool, optimizer: OptimizerKind, grad_accum_steps: int) -> None:
        self.b, self.model, self.stage, self.dp = buf, model, stage, dp
        self.bucket_size, self.overlap, self.kind = bucket, overlap, optimizer
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self.pad = {id(p): -p.numel() % dp for p in self.trainable}
        self.hooks: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.in_bucket: list[nn.Parameter] = []
        self.elems = 0
        self.stored: dict[int, list[torch.Tensor]] = {}  # grad store: reduced buffers, by param id
        self.buffers: list[torch.Tensor] = []
        # bucket_store.comm_stream: with overlap_communication, _run_reduction
        # reduces inside get_accelerator().stream(comm_stream), so stage 2's
        # reduce-scatter output (empty_like) is that stream's memory.
        self.comm_stream = torch.cpu.Stream() if overlap else None

    def part(self, p: nn.Parameter) -> int:
        return (p.numel() + self.pad[id(p)]) // self.dp

    def setup(self) -> None:
        from llmem_plugin.trace.step import make_optimizer

        b = self.b
        # LowLevelZeroModel: module.to(dtype).to(device).
        working = {id(p): b.new(p.numel(), MemoryCategory.PARAMETER) for p in self.params}
        self.master = []
        for p in self.trainable:
            if self.pad[id(p)]:  # F.pad(param.view(-1)) -> the param views the padded tensor
                working[id(p)] = b.new(p.numel() + self.pad[id(p)], MemoryCategory.PARAMETER)
            # splited_params.detach().clone().float()
            self.master.append(b.fp32_copy(self.part(p), ZeroCategory.MASTER_WEIGHTS).requires_grad_(True))
        self.working = working
        self.optimizer = make_optimizer(self.master, self.kind)
        if self.overlap or self.stage == 2:  # _attach_reduction_hook
            self.hooks = [p.register_post_accumulate_grad_hook(self._add_to_bucket) for p in self.trainable]

    def begin_micro(self, micro: int) -> None:
        pass

    def _add_to_bucket(self, p: nn.Parameter) -> None:
        if self.elems + p.numel() > self.bucket_size:
            self._run_reduction()
        self.in_bucket.append(p)
        self.elems += p.numel() + self.pad[id(p)]

    def _run_reduction(self) -> None:
        """_run_reduction: padded grads (build_grad_in_bucket), one flat copy
        (get_flatten_grad); all_reduce (stage 1, every rank's slices kept in
        the flat buffer) or reduce_scatter into a 1/dp buffer (stage 2)."""
        if not self.in_bucket:
            return
        b, dp, es = self.b, self.dp, self.b.plan.es
        held = []
        for p in self.in_bucket:
            if self.pad[id(p)]:
                held.append(b.new(p.numel() + self.pad[id(p)], MemoryCategory.TEMPORARY))
                p.grad = None  # the padded copy replaces it
            else:
                held.append(p.grad)
                p.grad = None  # the slices still view it
        # Stage 1 keeps the flat buffer as the gradient store; stage 2 drops it.
        flat = b.new(self.elems, MemoryCategory.GRADIENT if self.stage == 1 else ZeroCategory.BUCKETS)
        if self.stage == 1:
            b.send(2 * (dp - 1) / dp * self.elems * es)
            kept = flat
        else:
            with torch.cpu.stream(self.comm_stream):  # None: the current stream
                kept = b.new(self.elems // dp, MemoryCategory.GRADIENT)
            b.send((dp - 1) / dp * self.elems * es)
        held.clear()  # sync_tensor: the slices now view the reduced buffer; bucket_store.reset
        first = not any(id(p) in self.stored for p in self.in_bucket)
        for p in self.in_bucket:  # _add_grad: append on the first micro-batch, add later
            self.stored.setdefault(id(p), [kept])
        if first:
            self.buffers.append(kept)
        del flat, kept
        self.in_bucket, self.elems = [], 0

    def end_backward(self) -> None:
        """_reduce_grad: stage 1 without overlap syncs every grad now (_sync_grad)."""
        if not self.overlap and self.stage == 1:
            for p in self.trainable:
                if p.grad is not None:
                    self._add_to_bucket(p)
        self._run_reduction()

    def step(self) -> None:
        """step(): fp32 slice grads, float64 norms, the optimizer, the
        16-bit all-gather through a TensorBucket; then zero_grad frees the store."""
        from llmem_plugin.trace.step import state_tensors

        b, dp, es = self.b, self.dp, self.b.plan.es
        grads32 = []
        for p, m in zip(self.trainable, self.master):
            if es != 4:  # grad.to(master_param.dtype): an fp32 copy of the slice
                m.grad = b.new(self.part(p), ZeroCategory.FP32_GRADIENTS, torch.float32)
            else:  # fp32 training: the stored slice itself
                m.grad = self.stored[id(p)][0].narrow(0, 0, self.part(p))
            grads32.append(m.grad)
        # _compute_grad_norm: grad.data.double().norm(2), one at a time, over
        # the grad store's gradients in the order they were stored
        # (GradientStore.get_working_grads_by_group_id: a dict filled as
        # buckets are reduced, i.e. in backward order), not parameter order.
        by_id = {id(p): p for p in self.trainable}
        for pid in list(self.stored):
            t = b.new(self.part(by_id[pid]), MemoryCategory.TEMPORARY, torch.float64)
            del t
        before = {id(t) for t in state_tensors(self.optimizer)}
        self.optimizer.step()
        for t in state_tensors(self.optimizer):
            if id(t) not in before:
                b.tracker.label([t], MemoryCategory.OPTIMIZER_STATE)
        # step()'s loop variable ``grad`` keeps the last parameter's fp32
        # gradient until step() returns, after the all-gather.
        grad = grads32[-1] if grads32 else None
        grads32.clear()  # grad_partition_groups = []: the masters' .grad still hold them
        for m in self.master:  # release_param_grad: freed in master order
            m.grad = None
        # All-gather (overlap_allgather=False): per master, in order,
        # param_to_gather = master.to(device).to(dtype), rebound each
        # iteration (the previous copy is dropped once the next exists);
        # above the bucket's max size straight into the padded parameter
        # (all_gather_into_flat_tensor_nd), else into a reduce_bucket_size
        # TensorBucket, all-gathered when the next copy would overflow it.
        bucket: list[torch.Tensor | None] = []
        size = 0
        to_gather = None
        for p, m in zip(self.trainable, self.master):
            n = self.part(p)
            to_gather = b.new(n, MemoryCategory.TEMPORARY) if es != 4 else m
            if n > self.bucket_size:
                b.send((dp - 1) * n * es)
                continue
            if size + n > self.bucket_size:
                self._all_gather(bucket, size)
                size = 0
            bucket.append(to_gather)
            size += n
        if bucket:
            self._all_gather(bucket, size)
        del grad  # step()'s locals, in order
        del to_gather
        # optimizer.zero_grad() -> zero_grad_stores: GradientStore._grads_of_params
        # is dropped in insertion order, so each reduced buffer goes when its
        # last gradient does: in the order the buffers were made.
        self.stored.clear()
        while self.buffers:
            del self.buffers[0]

    def _all_gather(self, bucket: list[torch.Tensor | None], size: int) -> None:
        """TensorBucket.all_gather (bookkeeping/tensor_bucket.py), emptying ``bucket``.

        ``flatten()`` (a view when the bucket holds one tensor), a world-size
        buffer, then per tensor a re-flattened copy of its ``dp`` shards
        written back (``rec_tensor``, rebound per tensor). ``self.empty()``
        then drops the bucket's tensors in order (``_write_back_pairs``),
        all but the loop's last (still the local ``tensor``); the frame's
        locals go last, in order: ``flat``, ``buffer`` (with the views of it
        in ``unflat_shards``), ``tensor``, ``rec_tensor``.
        """
        b, dp, es = self.b, self.dp, self.b.plan.es
        flat = b.new(size, ZeroCategory.BUCKETS) if len(bucket) > 1 else None
        gathered = b.new(size * dp, ZeroCategory.BUCKETS)
        b.send((dp - 1) * size * es)
        rec = None
        for t in bucket:
            rec = b.new(t.numel() * dp, MemoryCategory.TEMPORARY)
        last = bucket[-1]
        for i in range(len(bucket)):
            bucket[i] = None
        bucket.clear()
        del t
        del flat
        del gathered
        del last
        del rec