"""``tp``, ``dp-tp``, ``fsdp-tp``: tensor parallel, alone or under data parallel.

Each rank's step is traced as it runs: the model is built on meta, wrapped by
``parallelize_module`` with the Llama-family plan below (then by FSDP2's
``replicate`` or ``fully_shard`` over the ``dp`` mesh dimension), and its
training step runs under fake tensors and a fake process group
(:mod:`._fakepg`) while :class:`RankTracker` records the storages this rank
allocates: DTensors' local shards, never their global shapes.

The plan (:func:`tp_plan`), after torchtitan's ``apply_tp``
(torchtitan/models/llama3/infra/parallelize.py):

* ``q/k/v/gate/up_proj``: ``ColwiseParallel`` (weight ``out/tp x in``);
  ``o_proj``/``down_proj``: ``RowwiseParallel`` (weight ``out x in/tp``).
  Attention and MLP take their input once through ``PrepareModuleInput``,
  so q/k/v (gate/up) share one backward all-reduce (SP: one all-gather and
  one reduce-scatter), as Megatron's ``f`` operator does.
* ``embed_tokens``: ``RowwiseParallel`` (``V/tp x h``), as torchtitan shards
  ``tok_embeddings``. DTensor computes its weight gradient replicated, at
  the full ``V x h``, on every rank (_ops/_embedding_ops.py: with replicated
  grad_out and indices the all-replicate strategy needs no communication and
  wins); a real gloo run shows the same.
* ``lm_head``: ``ColwiseParallel`` with the logits gathered (``Replicate``):
  torchtitan's layout with loss parallel off, and transformers' own
  ``colwise_gather_output``; the model's own loss runs on full logits.
  Tied embeddings stay tied (both are ``Shard(0)`` on the vocabulary).
* LoRA (:func:`_lora_plan`): peft wraps a target Linear as ``lora.Linear``
  (``base_layer``, ``lora_A.<adapter>``, ``lora_B.<adapter>``). The frozen
  ``base_layer`` takes the target's style; of the two adapters, the one that
  meets the base's sharded dimension is sharded with the base's own style and
  the other is replicated: colwise targets keep ``lora_A`` (``r x in``)
  replicated, on the replicated input, and shard ``lora_B`` (``out/tp x r``),
  whose output adds to the base's local columns; rowwise targets shard
  ``lora_A`` (``r x in/tp``) on the local input, all-reduced (SP:
  reduce-scattered) like the base's output, and keep ``lora_B`` (``out x r``)
  replicated (SP: ``SequenceParallel`` on the sequence-sharded stream).
  peft's forward (``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``)
  then adds local tensors of one shape; the adapters stay in fp32 as peft
  keeps them. Replicated adapters are DTensors, as the norms are.
* Norms: replicated DTensors (torchtitan's ``NoParallel``), since foreach
  AdamW refuses a group that mixes DTensors and plain tensors; with sequence
  parallel, ``SequenceParallel``. Qwen3's per-head ``q_norm``/``k_norm`` see
  the local heads: their input is ``Shard`` on the heads dimension, so their
  weight gradient is summed over the TP group.
* Attention needs no config change: transformers 5 reshapes with ``-1``
  heads and keeps only the ratio ``num_key_value_groups``, so each rank's
  attention runs on its ``heads/tp`` local heads.

Data parallel (:func:`_parallelize`) groups parameters as torchtitan does
(torchtitan/distributed/fsdp.py): embeddings, each decoder layer, norm with
lm_head, root. ``dp-tp`` uses FSDP2's ``replicate``, which in torch 2.13 also
copies each group's parameters into unsharded ones from forward through
backward (FSDPParamGroup.wait_for_unshard, world size 1). Gradients are
synced on the last micro-batch only (``set_requires_gradient_sync``, as
accelerate accumulates). Mixed precision stays the workload's autocast over
fp32 shards; no FSDP2 ``MixedPrecisionPolicy`` is set.

Known limitations:
    * Llama-family decoders only (:data:`SUPPORTED_MODEL_TYPES`); LoRA on the
      plan's projections only (:data:`_LORA_TARGETS`), and not on
      ``down_proj`` with gradient checkpointing (see :func:`_check`).
    * One rank is traced: TP ranks are symmetric when ``tp`` divides heads,
      kv heads and the intermediate size (checked), and dp ranks are alike.
      When ``tp`` does not divide the vocabulary, rank 0 holds the larger
      vocabulary shard and is the one traced.
    * A collective's buffers are freed where the program drops them; NCCL
      keeps an asynchronous collective's inputs until ``wait()`` (SP's
      all-gathers), which is not modelled.
    * Communication volumes are the collectives the traced step issues; the
      ring factors and the split between links are modelled
      (:func:`_ring_bytes`, :func:`comm_bytes`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import resolve_config
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU, get_gpu
from llmem_plugin.methods._fakepg import (
    fake_process_group,
    isolated_sharding_propagation,
)
from llmem_plugin.methods._local_step import LocalShardStep
from llmem_plugin.methods._rank_tracker import Collective, RankTracker, local
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.device.overheads import device_overheads
from llmem_plugin.trace.step import NUM_ITERATIONS, StepHooks, trace_step
from llmem_plugin.trace.tracker import TraceResult
from llmem_plugin.workload import Workload

__all__ = ["PRESETS", "SUPPORTED_MODEL_TYPES", "comm_bytes", "estimate", "fakeify_sharded", "tp_plan"]

PRESETS: dict[str, dict[str, Any]] = {
    "tp": {"data_parallel": "none"},
    # Gradients all-reduced over dp by FSDP2's `replicate`
    # (torch/distributed/_composable/replicate_with_fsdp.py), as torchtitan's
    # apply_replicate does; torchtitan refuses DDP beside any other
    # parallelism ("DDP has not supported > 1D parallelism").
    "dp-tp": {"data_parallel": "replicate"},
    # FSDP2 `fully_shard` over dp, TP inside a node (torchtitan's 2-D layout).
    "fsdp-tp": {"data_parallel": "fully_shard"},
}

# Decoders whose modules the plan names (transformers 5.23: LlamaDecoderLayer
# and its Mistral/Qwen2/Qwen3 copies share the q/k/v/o and gate/up/down names).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# The Linear modules the plan shards, the only LoRA targets modelled (peft's
# "all-linear" is these: it leaves out the output layer).
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tp_plan(config: Any, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a Llama-family causal LM (see the module docstring).

    Args:
        config: The model's config (Qwen3 adds its per-head norms).
        sequence_parallel: Shard the norms' activations on the sequence
            (Korthikanti et al. 2022; torchtitan's default).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    # Residual stream: replicated local tensors, or (SP) DTensors sharded on the
    # sequence. SP keeps them DTensors so that transformers derives positions
    # and masks from the global sequence length.
    stream = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel if sequence_parallel else _replicated
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "model.layers.*.input_layernorm": norm(),
        "model.layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": stream},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(
            output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "model.layers.*.post_attention_layernorm": norm(),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel),
        "model.norm": norm(),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if getattr(config, "model_type", None) == "qwen3":
        # Qwen3Attention applies q_norm/k_norm to (b, s, heads, head_dim) views
        # of the local projections: heads are dim 2.
        for name in ("q_norm", "k_norm"):
            plan[f"model.layers.*.self_attn.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _lora_plan(model: nn.Module, plan: dict[str, Any], *, sequence_parallel: bool) -> dict[str, Any]:
    """``plan`` with each peft LoRA layer of ``model`` split into its base
    layer and adapters (see the module docstring).

    A wildcard key that matches a LoRA layer is expanded into one key per
    module it matches, so that targets need not cover every layer.

    Args:
        model: The transformers model (peft's base model), LoRA applied.
        plan: :func:`tp_plan` of ``model``'s config.
        sequence_parallel: As for :func:`tp_plan`.

    Raises:
        UnsupportedError: A LoRA layer the plan does not shard column- or
            row-wise (e.g. on ``lm_head`` or ``embed_tokens``).
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    names = [n for n, _ in model.named_modules()]
    lora = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not lora:
        return plan
    out: dict[str, Any] = {}
    placed: set[str] = set()
    for key, style in plan.items():
        hits = [n for n in names if _matches(key, n)]
        if not any(n in lora for n in hits):
            out[key] = style
            continue
        for name in hits:
            if name not in lora:
                out[name] = style
                continue
            if name.rsplit(".", 1)[-1] not in _LORA_TARGETS or not isinstance(lora[name], LoraLinear):
                continue  # refused below
            assert type(style) in (ColwiseParallel, RowwiseParallel), (name, style)
            out[f"{name}.base_layer"] = style
            for adapter in lora[name].lora_A:
                if type(style) is ColwiseParallel:  # A sees the replicated input, B the base's output columns
                    out[f"{name}.lora_A.{adapter}"] = _replicated()
                    out[f"{name}.lora_B.{adapter}"] = style
                else:  # A sees the base's input shard, B the reduced output
                    out[f"{name}.lora_A.{adapter}"] = style
                    out[f"{name}.lora_B.{adapter}"] = (
                        SequenceParallel(use_local_output=False) if sequence_parallel else _replicated()
                    )
            placed.add(name)
    others = sorted({n.rsplit(".", 1)[-1] for n in lora if n not in placed})
    if others:
        raise UnsupportedError(
            f"tensor parallel does not model LoRA on {', '.join(others)}: the plan shards LoRA targets "
            f"{', '.join(_LORA_TARGETS)} only. HINT: pass --lora-targets with some of those"
        )
    return out


def _matches(key: str, name: str) -> bool:
    """Whether plan key ``key`` names module ``name`` (as ``parallelize_module`` matches, atom by atom)."""
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


@functools.cache
def _replicated_style_cls() -> type:
    # Built on first use: torch.distributed.tensor costs half a second to
    # import, and the method registry imports this module for PRESETS only.
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class Replicated(ParallelStyle):
        """torchtitan's ``NoParallel`` (torchtitan/distributed/tensor_parallel.py):
        parameters become replicated DTensors, the input a replicated DTensor
        and the output a local tensor again."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def wrap_input(mod, inputs, mesh):
                x = inputs[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                return (x, *inputs[1:])

            def unwrap_output(mod, output, mesh):
                return output.to_local() if isinstance(output, DTensor) else output

            return distribute_module(module, device_mesh, None, wrap_input, unwrap_output)

    return Replicated


def _replicated():
    return _replicated_style_cls()()


def fakeify_sharded(model: nn.Module, fake_mode: Any) -> None:
    """:func:`modelbuild.fakeify` for a model holding DTensors: each local
    shard becomes a fake tensor, wrapped again with the same mesh, placements
    and global shape. Tied parameters stay tied."""
    from torch.distributed.tensor import DTensor

    done: dict[int, torch.Tensor] = {}

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        shard = local(t)
        with fake_mode:
            fake = torch.empty(shard.shape, dtype=shard.dtype, device="cpu")
        if isinstance(t, DTensor):
            fake = DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        return fake

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in done:
                    done[id(b)] = fake_like(b)
                mod._buffers[name] = done[id(b)]


# ------------------------------------------------------------------- tracing
def _trace_rank(
    model: nn.Module, workload: Workload, *, vocab_size: int, fake_mode: Any, gpu: GPU, grad_sync: bool = False,
    streams: dict[int, int] | None = None,
) -> tuple[TraceResult, list[Collective]]:
    """:func:`llmem_plugin.trace.step.trace_step` with a :class:`RankTracker`,
    logging the collectives of the last optimizer step.

    Args:
        grad_sync: The model is an FSDP2 module: sync gradients on the last
            micro-batch only, as accelerate's gradient accumulation does
            (``set_requires_gradient_sync``).
        streams: Filled with the side stream of each allocation made off the
            default stream (FSDP2's all-gather and reduce-scatter streams),
            by trace record index (see :mod:`._streams`).
    """
    tracker = RankTracker(fake_mode)
    num_micro = workload.grad_accum_steps
    local_step = LocalShardStep()  # the DTensor step's allocations, without its sharding propagation

    class Hooks(StepHooks):
        def begin_micro(self, iteration: int, micro: int) -> None:
            tracker.record_collectives = iteration == NUM_ITERATIONS - 1
            if grad_sync:
                model.set_requires_gradient_sync(micro == num_micro - 1)

        def step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            return local_step(optimizer)

    contexts = [isolated_sharding_propagation(), _no_view_warnings()]
    if grad_sync:  # FSDP2 frees and re-allocates by resizing storages; see fsdp.fsdp_instrumented
        from llmem_plugin.methods.fsdp import fsdp_instrumented

        contexts.append(fsdp_instrumented(tracker, cpu_offload=False))
    trace = trace_step(model, workload, vocab_size=vocab_size, fake_mode=fake_mode,
                       compute_capability=gpu.compute_capability, num_sms=gpu.num_sms, tracker=tracker,
                       contexts=contexts, hooks=Hooks())
    if streams is not None:
        streams.update(tracker.stream_of)
    return trace, tracker.collectives


@contextlib.contextmanager
def _no_view_warnings() -> Iterator[None]:
    # FSDP2 warns when a wrapped module returns a view (the TP styles'
    # to_local outputs), in case a caller modifies it in place; the
    # Llama-family forward never does.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
        yield


def _parallelize(model: nn.Module, *, layout: Layout, data_parallel: str, sequence_parallel: bool,
                 device_type: str = "cpu") -> tuple[Any, Any]:
    """Apply TP (and FSDP2 over dp) to ``model`` in place, in torchtitan's
    order: TP first, then data parallel over the TP-sharded DTensors.
    ``device_type`` is the meshes' ("cuda" where the step runs on a CUDA
    build, as benchmarks/groundtruth/stub_worker.py runs it).

    Must run inside a (fake) process group of ``layout.num_gpus`` ranks and
    outside any FakeTensorMode (shared FACTS: device meshes fail under it).

    Returns:
        The TP mesh and the dp mesh (None without data parallel).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if data_parallel == "none":
        tp_mesh = init_device_mesh(device_type, (layout.tp,), mesh_dim_names=("tp",))
        dp_mesh = None
    else:
        mesh = init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    # peft's PeftModel wraps the transformers model; the plan names the latter's modules.
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    inp, out = base.get_input_embeddings(), base.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    plan = tp_plan(base.config, sequence_parallel=sequence_parallel)
    if base is not model:
        plan = _lora_plan(base, plan, sequence_parallel=sequence_parallel)
    frozen = {n for n, p in base.named_parameters() if not p.requires_grad}
    parallelize_module(base, tp_mesh, plan)
    # SequenceParallel re-registers the norms' weights as new Parameters,
    # trainable (torch/distributed/tensor/parallel/style.py,
    # _replicate_module_fn): LoRA's frozen norms stay frozen.
    for n, p in base.named_parameters():
        p.requires_grad_(n not in frozen)
    if tied:
        # Each style replaced its own module's parameter; both are Shard(0) on
        # the vocabulary, so one DTensor serves both again.
        assert out.weight.placements == inp.weight.placements
        out.weight = inp.weight
    if dp_mesh is not None:
        if data_parallel == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import (
                replicate as wrap,
            )
        else:
            from torch.distributed.fsdp import fully_shard as wrap
        # torchtitan's grouping (torchtitan/distributed/fsdp.py,
        # apply_replicate_to_model / apply_fsdp_to_model): embeddings, each
        # decoder layer, norm + lm_head, then the root. Tied embeddings share
        # one group with the norm and lm_head.
        groups: list[Any] = [[inp, base.model.norm, out]] if tied else [inp]
        groups += list(base.model.layers)
        if not tied:
            groups.append([base.model.norm, out])
        for group in groups:
            wrap(group, mesh=dp_mesh)
        wrap(model, mesh=dp_mesh)
    return tp_mesh, dp_mesh


# ------------------------------------------------------------ communication
def _ring_bytes(c: Collective) -> int:
    """Bytes one rank sends for ``c`` with NCCL's ring algorithm
    (nccl-tests doc/PERFORMANCE.md, "bus bandwidth"): all-reduce moves
    2(n-1)/n of the buffer, all-gather, reduce-scatter and all-to-all (n-1)/n
    of the full-size buffer."""
    n = c.group_size
    if n <= 1:
        return 0
    factor = 2 if c.op == "all_reduce" else 1
    return c.payload_bytes * factor * (n - 1) // n


def comm_bytes(collectives: list[Collective], *, layout: Layout, tp_group: str) -> tuple[int, int]:
    """(intra-node, inter-node) bytes one rank sends per optimizer step.

    The TP group stays inside a node (:class:`Layout` enforces it). Any other
    group (dp) holds one rank per TP slot of each node: when it spans
    ``num_nodes > 1`` nodes, its ring of ``n`` ranks crosses a node boundary
    ``num_nodes`` times, so ``num_nodes / n`` of the bytes go between nodes
    (averaged over the ring's ranks).
    """
    intra = inter = 0
    for c in collectives:
        sent = _ring_bytes(c)
        if c.group_name == tp_group or layout.num_nodes == 1:
            intra += sent
        else:
            across = sent * min(layout.num_nodes, c.group_size) // c.group_size
            inter += across
            intra += sent - across
    return intra, inter


# ------------------------------------------------------------------ estimate
def _check(model_config: Any, workload: Workload, *, layout: Layout, preset: str, data_parallel: str) -> None:
    if layout.tp < 2:
        raise ConfigError(
            f"--method {preset} needs a tensor-parallel degree of at least 2, got --tp {layout.tp}. "
            "HINT: pass --tp 2 or more, or pick a data-parallel --method"
        )
    if data_parallel == "none" and layout.dp != 1:
        raise ConfigError(
            f"--method tp runs on the {layout.tp} GPUs of its TP group, got --gpus {layout.num_gpus}. "
            "HINT: use --method dp-tp or fsdp-tp to run data parallel over the other GPUs, or --gpus equal to --tp"
        )
    if data_parallel != "none" and layout.dp == 1:
        raise ConfigError(
            f"--method {preset} needs more GPUs than --tp {layout.tp} for its data-parallel dimension, "
            f"got --gpus {layout.num_gpus}. HINT: use --method tp"
        )
    lora = workload.lora
    if lora is not None and lora.target_modules != ("all-linear",):
        others = [t for t in lora.target_modules if t.rsplit(".", 1)[-1] not in _LORA_TARGETS]
        if others:
            raise UnsupportedError(
                f"--method {preset} does not model LoRA on {', '.join(others)}: the TP plan shards LoRA targets "
                f"{', '.join(_LORA_TARGETS)} only. HINT: pass --lora-targets with some of those, "
                "or use a data-parallel --method"
            )
    if lora is not None and workload.grad_checkpointing and any(
        t == "all-linear" or t.rsplit(".", 1)[-1] == "down_proj" for t in lora.target_modules
    ):
        # Non-reentrant recomputation stops once the last saved tensor is
        # recomputed (torch/utils/checkpoint.py, early stop): after down_proj's
        # adapters, before its base output's all-reduce is waited. The
        # un-waited collective stays in torch's work registry
        # (torch/csrc/distributed/c10d/Functional.cpp) with its output: a real
        # 2-process gloo run keeps b x s x h per layer and micro-batch, which
        # the fake process group does not.
        raise UnsupportedError(
            f"--method {preset} does not model LoRA on down_proj with gradient checkpointing: the recomputation "
            "leaves down_proj's all-reduce un-waited, and torch keeps its output alive. "
            "HINT: leave down_proj out of --lora-targets, or drop --grad-checkpointing"
        )
    model_type = getattr(model_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedError(
            f"--method {preset} has a tensor-parallel plan for model types {', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"not '{model_type}'. HINT: use a data-parallel --method (ddp, fsdp) for this model"
        )
    layout.check_model(model_config)


def estimate(
    model: Any,
    workload: Workload | None,
    *,
    layout: Layout,
    gpu: GPU | str | None,
    alloc_conf: AllocatorConfig | str | None = None,
    torch_version: str | None = None,
    preset: str = "tp",
    data_parallel: str = "none",
    sequence_parallel: bool = False,
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory of a TP (or 2-D dp x TP) fine-tuning step.

    Args:
        model: A source :func:`llmem_plugin.models.modelbuild.build_model` accepts.
        workload: The step each rank runs (its micro-batch; TP ranks share it).
        layout: ``tp`` GPUs per TP group inside a node; ``dp = num_gpus / tp``.
        gpu: Catalog GPU (name or :class:`GPU`); the default GPU if None.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF``; the environment's if None.
        torch_version: Torch the job will run (overheads); installed if None.
        preset: Registry name (``tp``, ``dp-tp``, ``fsdp-tp``).
        data_parallel: ``none``, ``replicate`` (FSDP2 replicate: gradient
            all-reduce) or ``fully_shard`` (FSDP2 over dp); from the preset.
        sequence_parallel: Shard norms and residual activations on the sequence.

    Returns:
        One traced rank (ranks are symmetric) and the bytes it sends per step.

    Raises:
        ConfigError: ``tp`` < 2, a world size the preset cannot use, or a
            ``tp`` that does not divide heads, kv heads or intermediate size.
        UnsupportedError: A model type with no plan here, LoRA on modules
            the plan does not shard, or on down_proj with checkpointing.
        TraceError: The step could not be traced.
    """
    from llmem_plugin.estimate import DEFAULT_GPU

    wl = workload if workload is not None else Workload()
    if data_parallel not in ("none", "replicate", "fully_shard"):
        raise ConfigError(f"unknown data_parallel '{data_parallel}'; valid: none, replicate, fully_shard")
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
              else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    # The plan is checked before building: other architectures may not even
    # build in this workload (e.g. MoE experts in bf16-mixed).
    model_config = getattr(model, "config", None) if isinstance(model, nn.Module) else resolve_config(model)
    _check(model_config, wl, layout=layout, preset=preset, data_parallel=data_parallel)
    built = modelbuild.build_model(model, wl, device="meta")
    vocab = int(built.config.vocab_size)
    uses_cublaslt = any(isinstance(m, nn.Linear) and m.bias is not None for m in built.modules())
    rank = 0
    streams: dict[int, int] = {}
    trace, collectives, tp_group = _trace_one(
        built, wl, layout=layout, rank=rank, gpu=target, data_parallel=data_parallel,
        sequence_parallel=sequence_parallel, streams=streams,
    )
    intra, inter = comm_bytes(collectives, layout=layout, tp_group=tp_group)
    nccl = (layout.tp,) if data_parallel == "none" else (layout.tp, layout.dp)
    overheads = device_overheads(
        target.compute_capability, torch_version=torch_version, uses_cublaslt=uses_cublaslt, nccl_world_sizes=nccl
    )
    mem = rank_memory(trace, rank=rank, gpu=target, overheads=overheads, alloc_conf=config, streams=streams)
    notes = [
        f"tensor parallel {layout.tp}-way"
        + (" with sequence parallel" if sequence_parallel else "")
        + ": q/k/v/gate/up column-wise, o/down row-wise, embeddings vocab-sharded, lm_head column-wise "
        "with gathered logits, norms replicated",
        f"traced rank {rank}; TP ranks are symmetric",
        "DTensor computes the vocab-sharded embedding's gradient replicated: a full V x h gradient on every rank",
    ]
    if data_parallel == "replicate":
        notes.append(f"data parallel {layout.dp}-way: FSDP2 replicate all-reduces the TP-sharded gradients "
                     "on the last micro-batch")
    elif data_parallel == "fully_shard":
        notes.append(f"FSDP2 fully_shard {layout.dp}-way over the dp mesh dimension, gradients reduced on the "
                     "last micro-batch")
    if wl.lora is not None:
        notes.append("LoRA: column-wise targets keep lora_A replicated and shard lora_B column-wise, row-wise "
                     "targets shard lora_A row-wise and keep lora_B replicated; frozen bases sharded as above")
    if vocab % layout.tp:
        notes.append(f"--tp {layout.tp} does not divide the vocabulary ({vocab}): rank 0 holds the larger shard")
    notes.append("communication: collectives counted from the traced step, NCCL ring volumes")
    return MethodEstimate(
        method=preset, layout=layout, ranks=[mem], comm_intra_node_bytes=intra, comm_inter_node_bytes=inter,
        notes=notes,
    )


def _trace_one(
    model: nn.Module, workload: Workload, *, layout: Layout, rank: int, gpu: GPU, data_parallel: str,
    sequence_parallel: bool, streams: dict[int, int] | None = None,
) -> tuple[TraceResult, list[Collective], str]:
    """Trace rank ``rank`` of ``model`` (built on meta; parallelized here, in place).

    Returns:
        The trace, its last step's collectives and the TP group's name.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_process_group(world_size=layout.num_gpus, rank=rank):
        tp_mesh, _ = _parallelize(model, layout=layout, data_parallel=data_parallel,
                                  sequence_parallel=sequence_parallel)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        fakeify_sharded(model, fake_mode)
        trace, collectives = _traced(model, workload, vocab_size=int(model.config.vocab_size),
                                     fake_mode=fake_mode, gpu=gpu, grad_sync=data_parallel != "none",
                                     streams=streams)
        return trace, collectives, tp_mesh.get_group().group_name


def _traced(model: nn.Module, workload: Workload, **kwargs: Any) -> tuple[TraceResult, list[Collective]]:
    from llmem_plugin.errors import LLMemError, TraceError

    try:
        return _trace_rank(model, workload, **kwargs)
    except (LLMemError, ImportError, AssertionError):
        raise
    except Exception as e:  # the model's own code failed under fake tensors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TraceError(
            f"the tensor-parallel step of {type(model).__name__} could not be traced: {type(e).__name__}: {first}"
        ) from e
