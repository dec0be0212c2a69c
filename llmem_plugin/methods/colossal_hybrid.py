"""``hybrid``: ColossalAI's HybridParallelPlugin (tensor parallel x data parallel) per rank.

ColossalAI 0.5.0 cannot run here (its Shardformer needs transformers 4.51 and
a GPU), so each rank's step is traced the way :mod:`.tp` traces one, in the
plugin's 16-bit dtype, with what differs from torchtitan's plan replaced by
ports of ColossalAI's own layers, and the plugin's optimizer buffers modelled
as :mod:`.colossal` models LowLevelZero. Rules, file and function named beside
each (``colossalai/`` prefix left out; booster/plugin/hybrid_parallel_plugin.py
is "hpp.py"):

* Groups (hpp.py ``HybridParallelPlugin.__init__``, ``dp_outside=True``):
  ``dp = world / (tp * pp)``, mesh ``(dp, pp, tp, sp)``: TP groups are
  consecutive ranks, inside a node. ``pp_size = 1``, ``sp_size = 1`` here.
* Dtype (hpp.py ``HybridParallelModule.__init__``): after Shardformer, the
  model is cast with ``module.to(torch.bfloat16 / float16)`` per
  ``precision`` (default "fp16"); here the workload's precision picks it
  (bf16-mixed / bf16 -> bf16, fp16-mixed -> fp16, traced in bf16; fp32 ->
  fp32). No autocast.
* Shardformer's Llama policy (shardformer/policies/llama.py
  ``LlamaPolicy.module_policy``): q/k/v/gate/up ``Linear1D_Col``, o/down
  ``Linear1D_Row``, norms replicated: the same local shards as
  :func:`.tp.tp_plan`, which is applied to the decoder layers. The ends differ
  from torchtitan's plan and are ported instead:
    - ``embed_tokens`` -> ``VocabParallelEmbedding1D`` (shardformer/layer/
      embedding.py): vocabulary padded to a multiple of
      ``make_vocab_size_divisible_by * tp`` (64 * tp), ``V_pad / tp`` rows per
      rank; masked lookup, output all-reduced in place (``reduce_forward``).
      Its weight gradient is the local ``V_pad / tp x h`` only (torchtitan's
      DTensor embedding makes a full ``V x h`` one, see :mod:`.tp`).
    - ``lm_head`` -> ``VocabParallelLMHead1D`` with ``gather_output = not
      parallel_output`` (default ``parallel_output=True``): logits stay
      vocab-sharded, ``b x s x V_pad/tp`` in 16 bits; the input gradient is
      all-reduced (``Linear1D_Col``, ``linear_with_async_comm``).
    - Loss: ``LlamaPipelineForwards.llama_for_causal_lm_forward`` calls
      ``dist_cross_entropy`` (shardformer/layer/loss.py), whose
      ``DistCrossEntropy`` works on the local logits in the model dtype (no
      fp32 upcast of the full logits, unlike transformers' loss), ported
      op for op (:class:`_DistCrossEntropy`).
* ``zero_stage=0`` (hpp.py ``configure``): ``use_ddp`` is true when ``pp == 1``
  (``dp > 1``, or ``dp == 1``), so the 16-bit model is wrapped by torch DDP over
  the dp group with the plugin's ``ddp_config`` (``bucket_cap_mb=25``,
  ``gradient_as_bucket_view=False``, ``broadcast_buffers=True``); it runs
  here as in :mod:`.ddp`. The optimizer is ``HybridParallelAMPOptimizer``
  (amp/naive_amp/mixed_precision_optimizer.py ``MixedPrecisionOptimizer``):
  an fp32 master ``p.detach().float()`` of each trainable local shard at
  boost; at ``step`` each 16-bit gradient becomes an fp32 ``p.grad`` of its
  master (``working_param.grad.data.float()``, the 16-bit one dropped), the
  wrapped optimizer steps the masters (Adam m and v in fp32, lazily), and
  ``working_param.data.copy_`` writes back. ``max_norm=0``: no norm.
  ``precision="fp32"``: ``HybridParallelNaiveOptimizer``, no masters.
* ``zero_stage=1``: ``HybridParallelZeroOptimizer`` (a ``LowLevelZeroOptimizer``)
  over the dp group with ``reduce_bucket_size = zero_bucket_size_in_m * 2**20``
  (12 M elements) and ``overlap_communication=True``; no DDP when ``dp > 1``.
  Its buffers over the local TP shards are :class:`.colossal`'s LowLevelZero
  emulation (padding to ``dp``, fp32 slice masters, flat reduced gradient
  buffers, the all-gather bucket).
* LoRA: refused (hpp.py ``enable_lora``: ``assert self.tp_size == 1``).
* Gradient accumulation: the plain loop syncs every micro-batch (DDP, or
  LowLevelZero's reduction); ``plugin.no_sync`` is not modelled.

Communication: TP collectives as the traced step issues them (NCCL ring
volumes, :func:`.tp.comm_bytes`); the dp gradient all-reduce of DDP, per
micro-batch, ``2(d-1)/d`` of the local 16-bit gradient bytes; LowLevelZero's
dp collectives as :mod:`.colossal` counts them. A dp ring spans
``num_nodes`` nodes: ``num_nodes / d`` of its bytes go between nodes.

Known limitations:
    * Llama, Mistral and Qwen2 decoders (the ColossalAI 0.5.0 policies that
      match :func:`.tp.tp_plan`); Shardformer's own attention and decoder
      forwards (``llama_model_forward``) are replaced by transformers'; the
      kernels (SDPA vs. its ``ColoAttention``) may allocate differently.
    * Tied embeddings share one local weight (the policy's
      ``tie_weight_check``); the padded vocabulary rows are counted.
    * ``zero_stage=2``, ``pp_size > 1``, sequence parallelism, fused
      normalization / flash attention / fp8, CPU offload and other non-default
      plugin arguments are refused; ``zero_stage=1`` with ``dp == 1`` too
      (the plugin then also wraps DDP; not modelled).
    * One stream; NCCL's buffers sit outside the allocator (the overheads);
      the loss scaler's scalars are left out.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import MemoryCategory, Phase, TraceResult
from llmem_plugin.workload import Precision, Workload

__all__ = ["PRESETS", "SUPPORTED_MODEL_TYPES", "estimate", "padded_vocab"]

# HybridParallelPlugin(zero_stage=0) is the plugin's default (hpp.py).
PRESETS: dict[str, dict[str, Any]] = {"hybrid": {"zero_stage": 0}}

# shardformer/policies/auto_policy.py (0.5.0): Llama, Mistral and Qwen2 have
# policies with the column/row layout of tp.tp_plan; Qwen3's came later.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# HybridParallelPlugin.__init__ defaults that change memory; any other value
# is refused. tp_size comes from the layout, zero_stage from the preset.
_DEFAULTS: dict[str, Any] = {
    "pp_size": 1, "sp_size": None, "enable_all_optimization": False, "enable_fused_normalization": False,
    "enable_flash_attention": False, "enable_jit_fused": False, "enable_sequence_parallelism": False,
    "parallel_output": True, "max_norm": 0, "ddp_bucket_cap_mb": 25, "gradient_as_bucket_view": False,
    "find_unused_parameters": False, "static_graph": False, "cpu_offload": False, "communication_dtype": None,
    "custom_policy": None, "gradient_checkpoint_config": None, "overlap_allgather": False,
    "fp8_communication": False, "use_fp8": False,
}
# Modelled at any value.
_FREE = {"make_vocab_size_divisible_by": 64, "zero_bucket_size_in_m": 12, "overlap_communication": True}
_IGNORE_INDEX = -100  # shardformer/layer/loss.py _IGNORE_IDX


def padded_vocab(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 64) -> int:
    """VocabParallelEmbedding1D.__init__ / VocabParallelLMHead1D: the vocabulary
    padded to a multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = make_vocab_size_divisible_by * tp
    return vocab_size + (-vocab_size % multiple)


# ------------------------------------------------ ColossalAI layers, ported
class _ReduceForward(torch.autograd.Function):
    """shardformer/layer/_operation.py ``_ReduceForward``: all-reduce in place, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ReduceBackward(torch.autograd.Function):
    """The input side of ``linear_with_async_comm``: identity forward, the input
    gradient all-reduced over TP in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _VocabParallelEmbedding(nn.Module):
    """VocabParallelEmbedding1D.forward (rank 0's shard: rows ``[0, V_pad/tp)``)."""

    def __init__(self, weight: nn.Parameter, group: Any, start: int) -> None:
        super().__init__()
        self.weight, self.group, self.start = weight, group, start
        self.num_embeddings = weight.shape[0]

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        mask = (input_ < self.start) | (input_ >= self.start + self.weight.shape[0])
        masked = input_.clone() - self.start
        masked.masked_fill_(mask, 0)  # masked_input[input_mask] = 0
        out = F.embedding(masked, self.weight).clone()
        out.masked_fill_(mask.unsqueeze(-1), 0.0)  # embedding_output[input_mask, :] = 0.0
        return _ReduceForward.apply(out, self.group)


class _VocabParallelLMHead(nn.Module):
    """VocabParallelLMHead1D with ``gather_output=False``: local logits."""

    def __init__(self, weight: nn.Parameter, group: Any) -> None:
        super().__init__()
        self.weight, self.group = weight, group
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_ReduceBackward.apply(x, self.group), self.weight)


class _DistCrossEntropy(torch.autograd.Function):
    """shardformer/layer/loss.py ``DistCrossEntropy`` (mode "sum"), op for op;
    boolean-index writes become ``masked_fill_`` (same memory, no data-dependent shapes)."""

    @staticmethod
    def forward(ctx, vocab_logits, target, group, vocab_size, dtype):
        logits_max = torch.max(vocab_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        delta = (vocab_size + world - 1) // world
        down, up = rank * delta, min(rank * delta + delta, vocab_size)
        mask = (target < down) | (target >= up)
        masked_target = target.clone() - down
        masked_target.masked_fill_(mask, 0)
        masked_target_1d = masked_target.view(-1).contiguous()
        vocab_logits = vocab_logits - logits_max.unsqueeze(dim=-1)
        logits_2d = vocab_logits.view(-1, vocab_logits.size(-1))
        idx = torch.arange(start=0, end=logits_2d.shape[0])
        pred_logits = logits_2d[idx, masked_target_1d].contiguous().view_as(target)
        pred_logits.masked_fill_(mask, 0.0)
        dist.all_reduce(pred_logits, group=group)
        exp_logits = vocab_logits
        torch.exp(vocab_logits, out=exp_logits)
        sum_exp_logits = torch.sum(exp_logits, dim=-1, dtype=torch.float32)
        dist.all_reduce(sum_exp_logits, group=group)
        loss = torch.sum(torch.where(target == _IGNORE_INDEX, 0.0, torch.log(sum_exp_logits) - pred_logits))
        exp_logits = exp_logits.div(sum_exp_logits.unsqueeze(dim=-1)).to(dtype)
        exp_logits.masked_fill_((target == _IGNORE_INDEX).unsqueeze(-1), 0.0)
        ctx.save_for_backward(exp_logits, mask, masked_target_1d)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp_logits, mask, masked_target_1d = ctx.saved_tensors
        grad_logits = exp_logits
        grad_2d = grad_logits.view(-1, grad_logits.shape[-1])
        update = 1.0 - mask.view(-1).float().to(ctx.dtype)
        grad_2d[torch.arange(0, grad_2d.shape[0]), masked_target_1d] -= update
        grad_logits.mul_(grad_output.unsqueeze(dim=-1))
        return grad_logits, None, None, None, None


def _dist_cross_entropy(logits, labels, vocab_size=None, *, group, padded: int, dtype, **_):
    """shardformer/layer/loss.py ``dist_cross_entropy`` without SP, as the model's ``loss_function``."""
    labels = labels[..., 1:].contiguous()
    logits = logits[..., :-1, :].contiguous()
    num_nonzero = (labels != _IGNORE_INDEX).sum()
    labels = labels.view(-1)
    logits = logits.view(-1, logits.shape[-1])
    loss = _DistCrossEntropy.apply(logits, labels, group, padded, dtype)
    return (loss / num_nonzero).squeeze()


# ------------------------------------------------------------ parallelize
def _shard(model: nn.Module, tp_mesh: Any, *, padded: int) -> None:
    """Shardformer on meta: :func:`.tp.tp_plan` on the decoder layers and norm,
    the ported vocab-parallel ends (rank 0's shards)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from llmem_plugin.methods.tp import tp_plan

    group = tp_mesh.get_group()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    plan = {k: v for k, v in tp_plan(model.config).items() if k not in ("model.embed_tokens", "lm_head")}
    parallelize_module(model, tp_mesh, plan)
    shape = (padded // tp_mesh.size(), inp.weight.shape[1])
    emb_w = nn.Parameter(torch.empty(shape, dtype=inp.weight.dtype, device="meta"),
                         requires_grad=inp.weight.requires_grad)
    model.model.embed_tokens = _VocabParallelEmbedding(emb_w, group, start=0)
    head_w = emb_w if tied else nn.Parameter(torch.empty(shape, dtype=out.weight.dtype, device="meta"),
                                             requires_grad=out.weight.requires_grad)
    model.lm_head = _VocabParallelLMHead(head_w, group)


def _localize(model: nn.Module) -> None:
    """Make every DTensor parameter a plain local-shard parameter, as
    Shardformer's layers hold them (and as DDP and the optimizers see them);
    each module rebuilds its DTensors from them for its own forward, so the TP
    styles run unchanged and gradients land on the local parameters."""
    from torch.distributed.tensor import DTensor

    def to_dtensor(specs, mod, args):
        for name, (loc, mesh, placements, shape, stride) in specs.items():
            mod._parameters[name] = DTensor.from_local(loc, mesh, placements, run_check=False, shape=shape,
                                                       stride=stride)

    def to_local(specs, mod, args, output):
        for name, (loc, *_) in specs.items():
            mod._parameters[name] = loc

    for mod in model.modules():
        specs = {}
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                loc = nn.Parameter(p._local_tensor, requires_grad=p.requires_grad)
                specs[name] = (loc, p.device_mesh, p.placements, p.shape, p.stride())
                mod._parameters[name] = loc
        if specs:
            mod.register_forward_pre_hook(functools.partial(to_dtensor, specs))
            mod.register_forward_hook(functools.partial(to_local, specs))


# ----------------------------------------------------- zero_stage 0 buffers
class _AmpOptimizer:
    """HybridParallelAMPOptimizer / MixedPrecisionOptimizer (see the module docstring)."""

    def __init__(self, buf: Any, params: list[nn.Parameter], kind: Any) -> None:
        self.b, self.kind = buf, kind
        self.trainable = [p for p in params if p.requires_grad]
        self.hooks: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self) -> None:
        from llmem_plugin.methods._zero_buffers import ZeroCategory
        from llmem_plugin.trace.step import make_optimizer

        if self.b.plan.es == 4:  # HybridParallelNaiveOptimizer: the params themselves
            self.master = self.trainable
        else:  # master_p = p.detach().float()
            self.master = [self.b.make(lambda p=p: p.detach().float(), ZeroCategory.MASTER_WEIGHTS)
                           for p in self.trainable]
        self.optimizer = make_optimizer(self.master, self.kind)

    def begin_micro(self, micro: int) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def step(self) -> None:
        from llmem_plugin.methods._zero_buffers import ZeroCategory
        from llmem_plugin.trace.step import state_tensors

        if self.master is not self.trainable:
            for p, m in zip(self.trainable, self.master, strict=True):
                if p.grad is not None:  # p.grad = working_param.grad.data.float(); working_param.grad = None
                    m.grad = self.b.make(lambda p=p: p.grad.float(), ZeroCategory.FP32_GRADIENTS)
                    p.grad = None
        before = {id(t) for t in state_tensors(self.optimizer)}
        self.optimizer.step()
        self.b.tracker.label([t for t in state_tensors(self.optimizer) if id(t) not in before],
                             MemoryCategory.OPTIMIZER_STATE)
        with torch.no_grad():
            if self.master is not self.trainable:
                for p, m in zip(self.trainable, self.master, strict=True):
                    p.copy_(m)  # working_param.data.copy_(p.data)
        self.optimizer.zero_grad(set_to_none=True)  # the loop's optimizer.zero_grad()
        for p in self.trainable:
            p.grad = None


# ------------------------------------------------------------------ tracing
def _wrap_ddp(model: nn.Module, dp_group: Any) -> nn.Module:
    """HybridParallelModule's ``DDP(module, process_group=dp_group, **ddp_config)``,
    run under the fake group as :mod:`.ddp` runs it."""
    from llmem_plugin.methods.ddp import NoRebuild, bucket_passthrough

    # broadcast_buffers=True is torch's default (passing it warns in torch 2.13).
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_group, bucket_cap_mb=25,
                                              gradient_as_bucket_view=False)
    ddp.register_comm_hook(None, bucket_passthrough)
    ddp.reducer = NoRebuild(ddp.reducer)
    return ddp


def _trace_rank(model: nn.Module, workload: Workload, *, layout: Layout, zero_stage: int, dtype: torch.dtype,
                gpu: GPU, capacity: int, options: dict[str, Any]) -> tuple[TraceResult, Any, list[Any], str]:
    """Trace rank 0 of the plugin: shard (meta), fakeify, localize, then two
    steps with the plugin's wrapper and optimizer buffers.

    Returns:
        The trace, the :class:`Buffers` (labels, dp bytes of LowLevelZero),
        the last step's collectives and the TP group's name.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from llmem_plugin.trace.emulation import cuda_emulation
    from llmem_plugin.methods._colossal_buffers import LowLevelZero
    from llmem_plugin.methods._fakepg import (
        fake_process_group,
        isolated_sharding_propagation,
    )
    from llmem_plugin.methods._rank_tracker import RankTracker
    from llmem_plugin.methods._zero_buffers import Buffers
    from llmem_plugin.methods.colossal import bucket_elems, unique_params
    from llmem_plugin.methods.ddp import no_data_reads
    from llmem_plugin.methods.tp import fakeify_sharded
    from llmem_plugin.trace.step import NUM_ITERATIONS, host_resident_state

    vocab = int(model.config.vocab_size)
    padded = padded_vocab(vocab, layout.tp, options.get("make_vocab_size_divisible_by", 64))
    trace_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    with fake_process_group(world_size=layout.num_gpus, rank=0):
        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_group = mesh["tp"], mesh["dp"].get_group()
        _shard(model, tp_mesh, padded=padded)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        fakeify_sharded(model, fake_mode)
        _localize(model)
        model.loss_function = functools.partial(_dist_cross_entropy, group=tp_mesh.get_group(), padded=padded,
                                                dtype=trace_dtype)
        params = unique_params(model)
        tracker = RankTracker(fake_mode)
        tracker.watch_modules(model)
        buf = Buffers(tracker, SimpleNamespace(dtype=trace_dtype, es=trace_dtype.itemsize), capacity=capacity)
        if zero_stage == 0:
            emu: Any = _AmpOptimizer(buf, params, workload.optimizer)
        else:
            emu = LowLevelZero(buf, model, params, stage=1, dp=layout.dp, bucket=bucket_elems(
                {"reduce_bucket_size_in_m": options.get("zero_bucket_size_in_m", 12)}),
                overlap=options.get("overlap_communication", True), optimizer=workload.optimizer,
                grad_accum_steps=workload.grad_accum_steps)
        b, s, ga = workload.micro_batch_size, workload.seq_len, workload.grad_accum_steps
        try:
            with fake_mode, tracker, isolated_sharding_propagation(), no_data_reads():
                tracker.register(list(model.buffers()), MemoryCategory.PARAMETER)
                # zero_stage 1: LowLevelZero allocates the working params itself
                # (the model's stand for views into them: HOST, never counted).
                tracker.register(params, MemoryCategory.PARAMETER if zero_stage == 0 else MemoryCategory.HOST)
                with cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability,
                                    num_sms=gpu.num_sms):
                    emu.setup()
                    net = model
                    if zero_stage == 0:
                        start = tracker.num_records
                        net = _wrap_ddp(model, dp_group)
                        tracker.label_live_since(start, MemoryCategory.TEMPORARY, MemoryCategory.COMM_BUFFER)
                    for it in range(NUM_ITERATIONS):
                        buf.counting = tracker.record_collectives = it == NUM_ITERATIONS - 1
                        for micro in range(ga):
                            tracker.set_phase(Phase.SETUP)
                            input_ids = torch.randint(0, vocab, (b, s))
                            labels = input_ids.clone()
                            tracker.register([input_ids, labels], MemoryCategory.INPUT)
                            emu.begin_micro(micro)
                            tracker.set_phase(Phase.FORWARD)
                            start = tracker.num_records
                            loss = net(input_ids=input_ids, labels=labels, use_cache=False).loss / ga
                            tracker.label_live_since(start, MemoryCategory.TEMPORARY, MemoryCategory.ACTIVATION)
                            tracker.set_phase(Phase.BACKWARD)
                            loss.backward()
                            tracker.backward_returned()  # frees from here on belong to no module's backward
                            del loss, input_ids, labels
                            tracker.label([p.grad for p in params if p.grad is not None], MemoryCategory.GRADIENT)
                            emu.end_backward()
                        tracker.set_phase(Phase.OPTIMIZER)
                        emu.step()
                        # AdamW's `step` counters stay on the host unless fused (step.host_resident_state).
                        tracker.label(host_resident_state(emu.optimizer), MemoryCategory.HOST)
                tracker.set_phase(Phase.SETUP)
        finally:
            for h in emu.hooks:
                h.remove()
        return tracker.result(), buf, tracker.collectives, tp_mesh.get_group().group_name


# ----------------------------------------------------------------- settings
def _dtype(workload: Workload, zero_stage: int) -> torch.dtype:
    """The plugin's ``precision`` for the workload's (SUPPORTED_PRECISION: fp16, bf16, fp32)."""
    dtype = {Precision.BF16_MIXED: torch.bfloat16, Precision.BF16: torch.bfloat16,
             Precision.FP16_MIXED: torch.float16, Precision.FP32: torch.float32}[workload.precision]
    if dtype == torch.float32 and zero_stage > 0:
        raise ConfigError("HybridParallelPlugin with zero_stage=1 needs fp16 or bf16 (configure: \"Please set "
                          "precision to 'fp16' or 'bf16' when using ZeRO\"), got --precision fp32. "
                          "HINT: pass --precision bf16-mixed, or zero_stage=0")
    return dtype


def _check(config: Any, workload: Workload, *, layout: Layout, preset: str, zero_stage: int,
           options: dict[str, Any]) -> None:
    if layout.tp < 2:
        raise ConfigError(
            f"--method {preset} (HybridParallelPlugin) models tensor parallel with tp_size = --tp >= 2, got "
            f"--tp {layout.tp}. HINT: pass --tp 2 or more, or use --method lowlevel-zero1 / ddp for pure data "
            "parallel")
    if zero_stage not in (0, 1):
        if zero_stage == 2:
            raise UnsupportedError(f"--method {preset} models zero_stage 0 and 1, not 2 (ZeRO-2 over TP shards is "
                                   "not modelled). HINT: pass zero_stage=0 or 1")
        raise ConfigError(f"zero_stage must be 0, 1 or 2 (HybridParallelPlugin asserts it), got {zero_stage!r}")
    if zero_stage == 1 and layout.dp == 1:
        raise UnsupportedError(
            f"zero_stage=1 with dp = 1 (--gpus {layout.num_gpus} = --tp {layout.tp}) is not modelled: the plugin "
            "then wraps DDP as well as the ZeRO optimizer (configure: use_ddp when dp_size == 1). "
            "HINT: use zero_stage=0, or more GPUs than --tp")
    for name, value in options.items():
        if name in _FREE:
            continue
        if name not in _DEFAULTS:
            raise ConfigError(f"unknown hybrid option '{name}'; valid: "
                              f"{', '.join(sorted({*_DEFAULTS, *_FREE, 'zero_stage'}))}")
        if value != _DEFAULTS[name]:
            raise UnsupportedError(f"hybrid option {name}={value!r} is not modelled (only the default "
                                   f"{_DEFAULTS[name]!r}). HINT: drop it to estimate the plugin's default")
    if workload.lora is not None:
        raise UnsupportedError("HybridParallelPlugin refuses LoRA with tensor parallel (enable_lora asserts "
                               "tp_size == 1). HINT: drop --lora-rank, or use --method lowlevel-zero1/2")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(
            f"--method {preset} models ColossalAI's Shardformer policies for {', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"not '{model_type}'. HINT: use a data-parallel --method for this model")
    layout.check_model(config)


# --------------------------------------------------------------- interface
def estimate(
    model: Any, workload: Workload, *, layout: Layout, gpu: GPU, alloc_conf: Any = None,
    torch_version: str | None = None, preset: str = "hybrid", zero_stage: int = 0, **options: Any,
) -> MethodEstimate:
    """Per-rank memory and communication of HybridParallelPlugin(tp_size=layout.tp, pp_size=1).

    Args:
        model: A source :func:`llmem_plugin.models.modelbuild.build_model` accepts.
        workload: The per-rank micro-batch (TP ranks share it).
        layout: ``tp`` >= 2 inside a node; ``dp = num_gpus / tp``.
        gpu: The GPU of every rank.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` (string or parsed).
        torch_version: Torch of the job, for the overheads.
        preset: Registry name, reported as the method.
        zero_stage: 0 (the plugin's default: DDP + fp32 masters) or 1
            (LowLevelZero over dp).
        options: Plugin arguments: ``make_vocab_size_divisible_by``,
            ``zero_bucket_size_in_m``, ``overlap_communication`` (modelled);
            the others only at their defaults.

    Returns:
        Rank 0 (TP ranks are symmetric when ``tp`` divides heads, kv heads and
        the intermediate size; dp ranks are alike).

    Raises:
        ConfigError: ``tp`` < 2, a ``tp`` that does not divide what TP splits,
            fp32 with ZeRO, an unknown option.
        UnsupportedError: LoRA, a model type without a policy here,
            ``zero_stage=2``, ``zero_stage=1`` with ``dp == 1``, a non-default
            plugin argument.
        TraceError: The step could not be traced.
    """
    from llmem_plugin.models.config import resolve_config
    from llmem_plugin.device.allocator_config import AllocatorConfig
    from llmem_plugin.errors import LLMemError, TraceError
    from llmem_plugin.methods._zero_buffers import breakdown
    from llmem_plugin.methods.ddp import ring_allreduce_bytes
    from llmem_plugin.methods.tp import comm_bytes
    from llmem_plugin.methods.zero import build_training_model
    from llmem_plugin.device.overheads import device_overheads

    config = getattr(model, "config", None) if isinstance(model, nn.Module) else resolve_config(model)
    _check(config, workload, layout=layout, preset=preset, zero_stage=zero_stage, options=options)
    dtype = _dtype(workload, zero_stage)
    meta = build_training_model(model, workload, dtype)
    conf = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
            else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    uses_lt = any(isinstance(m, nn.Linear) and m.bias is not None for m in meta.modules())
    overheads = device_overheads(gpu.compute_capability, torch_version=torch_version, uses_cublaslt=uses_lt,
                                 nccl_world_sizes=(layout.tp, layout.dp))
    try:
        trace, buf, collectives, tp_group = _trace_rank(
            meta, workload, layout=layout, zero_stage=zero_stage, dtype=dtype, gpu=gpu,
            capacity=gpu.capacity_bytes - overheads.outside_allocator_bytes, options=options)
    except (LLMemError, ImportError, AssertionError):
        raise
    except Exception as e:  # the model's own code failed under fake tensors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TraceError(f"the HybridParallelPlugin step could not be traced: {type(e).__name__}: {first}") from e
    rank = rank_memory(breakdown(trace, buf), rank=0, gpu=gpu, overheads=overheads, alloc_conf=conf)
    intra, inter = comm_bytes(collectives, layout=layout, tp_group=tp_group)
    es = 4 if dtype == torch.float32 else 2
    local_grad_bytes = es * sum(p.numel() for p in _local_trainable(meta))
    if zero_stage == 0:  # DDP: one all-reduce of the local grads per micro-batch
        dp_sent = workload.grad_accum_steps * ring_allreduce_bytes(local_grad_bytes, layout.dp)
    else:
        dp_sent = buf.sent_bytes
    dp_inter = dp_sent * min(layout.num_nodes, layout.dp) // layout.dp if layout.num_nodes > 1 else 0
    padded = padded_vocab(int(meta.config.vocab_size), layout.tp, options.get("make_vocab_size_divisible_by", 64))
    notes = [
        (f"HybridParallelPlugin tp_size={layout.tp} pp_size=1 zero_stage={zero_stage} (dp={layout.dp}) modelled "
         f"from ColossalAI 0.5.0 over a traced {dtype} step"),
        (f"Shardformer layout: decoder layers as torchtitan's TP plan; vocab-parallel embedding and lm_head "
         f"(vocabulary padded to {padded}, {padded // layout.tp} rows per rank), distributed cross-entropy on "
         "local 16-bit logits"),
        ("DDP over dp (bucket_cap_mb=25) + fp32 master weights (HybridParallelAMPOptimizer)" if zero_stage == 0
         else "LowLevelZero stage 1 over dp on the local TP shards (HybridParallelZeroOptimizer)"),
        "communication: TP collectives from the traced step; dp gradient sync every micro-batch (no no_sync)",
    ]
    if dtype == torch.float16:
        notes.append("fp16 traced in bf16 (same element size)")
    return MethodEstimate(method=preset, layout=layout, ranks=[rank], comm_intra_node_bytes=intra + dp_sent - dp_inter,
                          comm_inter_node_bytes=inter + dp_inter, notes=notes)


def _local_trainable(meta: nn.Module) -> list[torch.Tensor]:
    """The trainable local shards after :func:`_shard` + :func:`_localize` (``meta`` is traced in place)."""
    seen: set[int] = set()
    return [p for p in meta.parameters() if p.requires_grad and not (id(p) in seen or seen.add(id(p)))]
