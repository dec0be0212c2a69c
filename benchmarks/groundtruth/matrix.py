"""The ground-truth workload matrix, as data.

``GPU_CASES`` are real fine-tuning runs for one 80 GB GPU (H100 class): eight
architectures from GPT-2 (124M) to Qwen3-30B-A3B (30.5B, LoRA in bf16, the
largest catalog model whose step fits), seq 512..8192, batch 1..16, fp32,
bf16 autocast and pure bf16, with and without gradient checkpointing and
LoRA, eager and SDPA attention, foreach and fused AdamW, under the plain
PyTorch loop ("torch") and HF Trainer ("hf-trainer").

``edge=True`` cases sit near the capacity of an 80 GB H100 (see ``_EDGE``).
Their ``note`` gives the estimator's prediction
(``llmem_plugin.estimate(..., fast=True).peak_allocated_bytes``, 2026-11-22)
and ``expect`` says which side of the line that puts them on.

``TECHNIQUE_CASES`` (also in ``GPU_CASES``) cover the low-memory techniques:
QLoRA (nf4 / fp4 / int8), bitsandbytes and for-loop AdamW, FlashAttention-2,
liger / chunked loss and ``logits_to_keep``, activation offload and a
reference model, each paired with a baseline that differs only by it, and a
mixture-of-experts case without checkpointing; they run the real libraries
(``techniques.py``).

``CPU_CASES`` are tiny models (catalog config + ``config_overrides``, the idea
of ``tests/conftest.py``'s TINY_CONFIGS) measured on the CPU by the project's
own tracker, for the tests and for a one-minute smoke run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.models import catalog
from llmem_plugin.workload import LoraSpec, Workload

__all__ = ["CPU_CASES", "GPU_CASES", "PUBLISHED_CASES", "RUNNERS", "STUB_CASES", "TECHNIQUE_CASES", "Case", "case_config", "find", "uses_technique"]

RUNNERS = ("torch", "hf-trainer", "tracker-cpu")
_EXPECT = (None, "fit", "oom", "boundary")
# HF Trainer's optim names for the optimizers the estimator models
# (transformers/training_args.py OptimizerNames); SGD and Adafactor there are
# not the torch implementations step.make_optimizer builds, so they are excluded.
TRAINER_OPTIM = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused"}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One ground-truth run.

    Attributes:
        id: Unique, stable name; the ``id`` of the result row.
        model: Catalog name (``llmem_plugin.models.catalog.names()``).
        workload: The training step.
        runner: "torch" (the plain loop ``llmem_plugin.trace.step`` models),
            "hf-trainer", or "tracker-cpu" (CPU cases).
        edge: Chosen near the capacity of an 80 GB GPU.
        expect: For edge cases: "fit", "oom" or "boundary" (within ~1 GiB).
        note: Why the case is in the matrix (for edge cases: the prediction).
        config_overrides: (key, value) pairs applied to the catalog config.
        seq_lens: A sample-length distribution (``llmem_plugin.techniques.varlen``
            spelling): each micro-batch is padded to its longest sample, so
            every step has its own length, up to ``workload.seq_len``.
    """

    id: str
    model: str
    workload: Workload
    runner: str = "torch"
    edge: bool = False
    expect: str | None = None
    note: str = ""
    config_overrides: tuple[tuple[str, Any], ...] = field(default=())
    seq_lens: str | None = None

    def __post_init__(self) -> None:
        if self.seq_lens is not None and self.runner != "torch":
            raise ValueError(f"case {self.id}: variable lengths run under the torch runner only")
        if catalog.lookup(self.model) != self.model:
            raise ValueError(f"case {self.id}: {self.model!r} is not a catalog name; valid: {catalog.names()}")
        if self.runner not in RUNNERS:
            raise ValueError(f"case {self.id}: runner {self.runner!r}; valid: {RUNNERS}")
        if self.runner == "hf-trainer" and self.workload.optimizer.value not in TRAINER_OPTIM:
            raise ValueError(f"case {self.id}: hf-trainer runs {sorted(TRAINER_OPTIM)} only")
        if self.runner != "torch" and uses_technique(self.workload):
            raise ValueError(f"case {self.id}: the low-memory techniques run under the torch runner only")
        if self.expect not in _EXPECT or (self.expect is not None) != self.edge:
            raise ValueError(f"case {self.id}: edge cases need expect in {_EXPECT[1:]}, others none")

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.config_overrides)

    def config(self):
        """The ``PretrainedConfig`` this case trains (see :func:`case_config`)."""
        return case_config(self.model, self.overrides)


def case_config(model: str, overrides: dict[str, Any] | None = None):
    """The catalog config of ``model`` with ``overrides`` applied.

    The config is rebuilt from the merged fields (rather than patched with
    setattr) so derived fields such as ``head_dim`` follow the overrides; a
    shorter layer count also cuts ``layer_types`` (as
    ``llmem_plugin.models.config.set_num_layers`` does). ``llmem validate`` uses
    this with a row's ``model`` and ``config_overrides``.
    """
    return catalog.load_config(model, overrides)


def _case(model: str, precision: str, seq: int, batch: int, *, accum: int = 1, optimizer: str = "adamw",
          gc: bool = False, lora: LoraSpec | None = None, attn: str = "sdpa", runner: str = "torch",
          expect: str | None = None, note: str = "", overrides: dict[str, Any] | None = None,
          prefix: str = "", seq_lens: str | None = None, loop: str | None = None, **technique: Any) -> Case:
    """A case; ``technique`` holds Workload fields of the low-memory techniques;
    ``loop="plain-loop"`` is ``Workload.runner`` (the harness's torch loop then
    keeps each micro-step's outputs into the next).

    Their id parts come last, and only when set, so the ids of cases without
    them stay as they were.
    """
    parts = [prefix + model, precision, f"s{seq}", f"b{batch}"]
    wl = Workload(seq_len=seq, micro_batch_size=batch, grad_accum_steps=accum, precision=precision,
                  optimizer=optimizer, grad_checkpointing=gc, lora=lora, attn_implementation=attn,
                  **({"runner": loop} if loop else {}), **technique)
    parts += [f"ga{accum}"] * (accum > 1) + ["gc"] * gc + _checkpoint_parts(wl) + _lora_parts(lora)
    parts += [attn] + [optimizer] * (optimizer != "adamw") + ["trainer"] * (runner == "hf-trainer")
    parts += _technique_parts(wl) + [f"t{wl.target_len}"] * (wl.target_len is not None)
    parts += [f"img{wl.images}"] * (wl.images is not None) + ["frozen-vision"] * wl.freeze_vision
    if seq_lens is not None:
        parts.append("vlen" + seq_lens.replace(":", "_").replace(",", "+"))
    return Case(id="-".join(parts), model=model, workload=wl, runner=runner, edge=expect is not None,
                expect=expect, note=note, config_overrides=tuple(sorted((overrides or {}).items())),
                seq_lens=seq_lens)


def _lora_parts(lora: LoraSpec | None) -> list[str]:
    """"lora", or "lorabase" for adapters in the base weights' dtype (LoraSpec.adapter_dtype)."""
    if lora is None:
        return []
    return ["lorabase" if lora.adapter_dtype == "base" else "lora"]


def _checkpoint_parts(wl: Workload) -> list[str]:
    parts = ["reentrant"] * wl.checkpoint_reentrant + [f"every{wl.checkpoint_every}"] * (wl.checkpoint_every > 1)
    if wl.checkpoint_save_ops is not None:  # a preset's name, or the ops without "aten."
        parts.append("sac-" + wl.checkpoint_save_ops.replace("aten.", "").replace(",", "+"))
    return parts


def _technique_parts(wl: Workload) -> list[str]:
    parts = []
    if wl.quantize is not None:
        parts.append(wl.quantize.value + "-dq" * wl.double_quant
                     + "-kbit-off" * (wl.kbit_prepare == "off" and wl.quantize.bitsandbytes))
    if wl.loss.value != "hf":
        chunked = wl.loss.value == "chunked"
        parts.append(wl.loss.value + (f"{wl.loss_chunks}" + "-noup" * (not wl.loss_chunk_upcast) if chunked else ""))
    parts += [f"keep{wl.logits_to_keep}"] * (wl.logits_to_keep > 0)
    if wl.offload_activations is not None:
        parts.append("offload-" + wl.offload_activations.value)
    parts += ["ref"] * wl.reference_model
    parts += ["plainloop"] * (wl.runner.value == "plain-loop")
    return parts


def uses_technique(wl: Workload) -> bool:
    """Whether ``wl`` sets a technique only the torch runner implements: quantization, the loss,
    ``logits_to_keep``, activation offload or a reference model (optimizers and attention have id parts
    of their own and run under both runners)."""
    return bool(_technique_parts(wl))


LORA = LoraSpec()  # rank 16, q/k/v/o: the estimator's and the CLI's default
LORA_GPT2 = LoraSpec(target_modules=("c_attn",))
LORA_PHI3 = LoraSpec(target_modules=("qkv_proj", "o_proj"))  # Phi-3 fuses q/k/v

_BASE = [
    # GPT-2 (124M; n_positions 1024) and OPT (learned positions up to 2048).
    _case("gpt2", "fp32", 1024, 8),
    _case("gpt2", "bf16-mixed", 1024, 16, attn="eager"),
    _case("gpt2", "bf16-mixed", 512, 4, lora=LORA_GPT2, runner="hf-trainer"),
    _case("opt-125m", "fp32", 2048, 4, attn="eager"),
    _case("opt-125m", "bf16-mixed", 512, 16, optimizer="adamw-fused"),
    _case("opt-1.3b", "bf16-mixed", 2048, 8, gc=True),
    # Qwen2.5-0.5B: tied embeddings, 152k vocabulary (the loss dominates).
    _case("qwen2.5-0.5b", "bf16-mixed", 2048, 4),
    _case("qwen2.5-0.5b", "bf16", 4096, 2, optimizer="adamw-fused"),
    _case("qwen2.5-0.5b", "fp32", 8192, 1, gc=True),
    _case("qwen2.5-0.5b", "bf16-mixed", 1024, 8, attn="eager", runner="hf-trainer"),
    # Llama-3.2-1B: the attention / runner / optimizer comparisons at one size.
    _case("llama-3.2-1b", "fp32", 1024, 2),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, attn="eager"),  # s x s scores per head: 92 GiB at s2048
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, runner="hf-trainer"),
    _case("llama-3.2-1b", "bf16", 4096, 4, gc=True, optimizer="adamw-fused"),
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, lora=LORA),
    _case("llama-3.2-1b", "bf16-mixed", 2048, 16, gc=True),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 2, accum=4),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, optimizer="sgd"),
    _case("llama-3.2-1b", "bf16", 1024, 4, optimizer="adafactor"),
    # Llama-3.2-3B.
    _case("llama-3.2-3b", "bf16-mixed", 2048, 1),
    _case("llama-3.2-3b", "bf16", 8192, 2, gc=True),
    _case("llama-3.2-3b", "bf16-mixed", 8192, 2, gc=True, lora=LORA, runner="hf-trainer"),
    _case("llama-3.2-3b", "fp32", 2048, 2, lora=LORA),
    # Gemma-2 (256k vocabulary, logit soft-capping; transformers has no SDPA path for it).
    _case("gemma-2-2b", "bf16-mixed", 1024, 2, attn="eager"),
    _case("gemma-2-2b", "bf16", 4096, 1, gc=True, attn="eager", optimizer="adamw-fused"),
    _case("gemma-2-2b", "bf16-mixed", 1024, 4, lora=LORA, attn="eager", runner="hf-trainer"),
    _case("gemma-2-9b", "bf16", 2048, 4, gc=True, lora=LORA, attn="eager"),
    # Phi-3-mini (fused qkv and gate_up projections; 4096 positions).
    _case("phi-3-mini", "bf16", 2048, 2, optimizer="adamw-fused"),
    _case("phi-3-mini", "bf16-mixed", 4096, 2, gc=True, lora=LORA_PHI3),
    # 7-8B: LoRA, and pure-bf16 full fine-tuning with fused AdamW.
    _case("mistral-7b", "bf16", 4096, 4, gc=True, lora=LORA),
    _case("mistral-7b", "bf16-mixed", 1024, 1, lora=LORA, attn="eager"),
    _case("qwen2.5-7b", "bf16", 1024, 2, lora=LORA, attn="eager"),
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, lora=LORA),
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, lora=LORA, runner="hf-trainer"),
    _case("llama-3.1-8b", "bf16", 8192, 1, gc=True, optimizer="adamw-fused"),
    # Larger models, LoRA only: 13B dense, and a 30B MoE (61 GiB of bf16 weights).
    _case("llama-2-13b", "bf16", 4096, 4, gc=True, lora=LORA),
    _case("qwen3-30b-a3b", "bf16", 2048, 1, gc=True, lora=LORA),
]

# Near the capacity of an 80 GB H100, in pairs a step apart where possible.
# `expect` is the intent of the pair (from the tensor peak alone); what the
# GPU does is in the row's status, and `llmem validate` scores the estimator's
# fits verdict (which includes allocator fragmentation, the CUDA context and
# the device's real capacity) against it. No figure here is a measurement.
_EDGE = [
    _case("llama-3.1-8b", "bf16", 512, 1, expect="fit",
          note="optimizer step: 2+2+4 B/param of states + 2 B/param foreach temporary"),
    _case("llama-3.1-8b", "bf16", 512, 1, runner="hf-trainer", expect="fit",
          note="as the torch case; Trainer splits decay/no-decay groups, so foreach temporaries come per group"),
    _case("llama-3.1-8b", "bf16", 4096, 1, optimizer="adamw-fused", expect="fit",
          note="backward peak (no foreach temporary); activations of 4096 tokens"),
    _case("llama-3.1-8b", "bf16", 5120, 1, optimizer="adamw-fused", expect="oom",
          note="1024 tokens more than the fitting case"),
    _case("llama-3.1-8b", "bf16-mixed", 8192, 3, gc=True, lora=LORA, expect="boundary",
          note="fp32 weights + fp32 logits of 3 x 8192 tokens x 128k vocabulary"),
    _case("llama-3.2-3b", "bf16-mixed", 2048, 3, expect="fit",
          note="20 B/param of model states + 6144 tokens of activations"),
    _case("llama-3.2-3b", "bf16-mixed", 3584, 2, expect="oom",
          note="7168 tokens, 1024 more than the fitting case"),
    _case("mistral-7b", "bf16", 8192, 7, gc=True, optimizer="adamw-fused", expect="fit",
          note="8 B/param + checkpointed activations of 7 x 8192 tokens"),
    _case("mistral-7b", "bf16", 8192, 8, gc=True, optimizer="adamw-fused", expect="oom",
          note="one sequence more than the fitting case"),
    _case("qwen2.5-7b", "bf16", 8192, 2, gc=True, expect="fit",
          note="fp32 logits of 2 x 8192 tokens x 152k vocabulary (9.3 GiB each) against cached blocks"),
]

# The low-memory techniques, each paired with a case without it (a baseline here or above).
# They run the real libraries (benchmarks/groundtruth/techniques.py); a case
# whose library is not installed gives a "skipped" row (README, "Wheels").
_QLORA_8B = "packed 4-bit weights and absmax, non-quantized weights upcast to fp32 by prepare_model_for_kbit_training"
_TECH = [
    # QLoRA: bitsandbytes weights under LoRA (pairs: llama-3.1-8b-bf16-mixed-s2048-b1-lora-sdpa and below).
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, lora=LORA, quantize="nf4", double_quant=True,
          note=f"QLoRA nf4 + double quant: {_QLORA_8B}; a dequantized bf16 weight per matmul"),
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, gc=True, lora=LORA, note="baseline of the checkpointed QLoRA case"),
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, gc=True, lora=LORA, quantize="nf4", double_quant=True,
          note="QLoRA nf4 + double quant with checkpointing: recomputation dequantizes the weights again"),
    _case("llama-3.1-8b", "bf16-mixed", 2048, 1, lora=LORA, quantize="fp4",
          note="QLoRA fp4 without double quant: fp32 absmax per 64 weights instead of 8-bit"),
    _case("llama-3.2-3b", "bf16-mixed", 2048, 1, lora=LORA, note="baseline of the int8 case"),
    _case("llama-3.2-3b", "bf16-mixed", 2048, 1, lora=LORA, quantize="int8",
          note="LLM.int8 (Linear8bitLt, threshold 6.0): int8 weights + fp32 row scales; outlier columns are data-dependent"),
    # bitsandbytes and for-loop AdamW, full fine-tuning (pair: llama-3.2-1b-bf16-mixed-s1024-b4-sdpa).
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, optimizer="adamw8bit",
          note="8-bit blockwise states (2 x 1 B/param + absmax) instead of 2 x 4 B/param; tensors < 4096 elements keep 32-bit"),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, optimizer="paged-adamw8bit",
          note="paged 8-bit states live in CUDA unified memory: whether max_memory_allocated counts them"),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, optimizer="paged-adamw",
          note="paged 32-bit states in unified memory: NVML vs allocator view of 8 B/param"),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 4, optimizer="adamw-forloop",
          note="per-parameter AdamW loop: no foreach temporary the size of the states"),
    # FlashAttention-2 (pairs: llama-3.2-1b-bf16-s4096-b4-gc-sdpa-adamw-fused and the baseline below).
    _case("llama-3.2-1b", "bf16", 4096, 4, gc=True, attn="flash_attention_2", optimizer="adamw-fused",
          note="flash-attn kernel: out + fp32 softmax_lse saved; backward dq_accum in fp32"),
    _case("llama-3.2-1b", "bf16", 2048, 2, note="baseline of the flash-attn case without checkpointing"),
    _case("llama-3.2-1b", "bf16", 2048, 2, attn="flash_attention_2",
          note="flash-attn without checkpointing: every layer's q, k, v, out and lse kept for backward"),
    # The loss at 4096 tokens of a 128k vocabulary: HF, liger, chunked, logits_to_keep.
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2,
          note="baseline of the loss and offload cases: bf16 logits + fp32 upcast and its gradient (8 x 128k x 4 B/token)"),
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, loss="liger",
          note="liger fused linear cross-entropy: logits one chunk at a time, no full logits"),
    _case("llama-3.2-1b", "bf16", 4096, 2, note="baseline of the cce case: pure bf16 (cce takes bf16 hidden states)"),
    _case("llama-3.2-1b", "bf16", 4096, 2, loss="cce",
          note="Cut Cross-Entropy: no logits; lse and positions per token, the vocabulary order"),
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, loss="chunked",
          note="torchtune chunked CE, 8 chunks: all bf16 logit chunks kept, one fp32 upcast at a time"),
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, logits_to_keep=1024,
          note="logits for the last 1024 tokens only: loss terms scale by 1024/4096"),
    # Activation offload (pairs: the baseline above; llama-3.2-1b-bf16-s4096-b4-gc-sdpa-adamw-fused).
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, offload_activations="save-on-cpu",
          note="save_on_cpu(pin_memory=True): saved tensors (weights included) go to pinned host memory"),
    _case("llama-3.2-1b", "bf16-mixed", 4096, 2, offload_activations="streamed",
          note="TRL OffloadActivations: tensors >= 1024 B offloaded, up to 5 kept on device, lm_head not offloaded"),
    _case("llama-3.2-1b", "bf16", 4096, 4, gc=True, optimizer="adamw-fused", offload_activations="save-on-cpu",
          note="save_on_cpu with non-reentrant checkpointing: only the checkpoint inputs are offloaded"),
    # DPO-style reference forward (pairs: the cases without it).
    _case("qwen2.5-0.5b", "bf16-mixed", 2048, 2, lora=LORA,
          note="baseline of the LoRA reference case"),
    _case("qwen2.5-0.5b", "bf16-mixed", 2048, 2, lora=LORA, reference_model=True,
          note="reference = the policy with adapters disabled, no_grad: a transient of 152k-vocabulary logits"),
    _case("qwen2.5-0.5b", "bf16", 2048, 2, note="baseline of the frozen-copy reference case"),
    _case("qwen2.5-0.5b", "bf16", 2048, 2, reference_model=True,
          note="reference = a frozen copy of the model: its bf16 weights resident, plus the no_grad transient"),
    # Mixture of experts without checkpointing (pair: qwen3-30b-a3b-bf16-s2048-b1-gc-lora-sdpa).
    _case("qwen3-30b-a3b", "bf16", 1024, 1, lora=LORA,
          note="MoE experts (128, top-8) through grouped_mm: expert activations of every layer kept"),
]

GPU_CASES: list[Case] = _BASE + _EDGE + _TECH
TECHNIQUE_CASES: list[Case] = list(_TECH)


def _gpu(case_id: str) -> Case:
    (case,) = [c for c in GPU_CASES if c.id == case_id]
    return case


# The stub device's whole-step checks (benchmarks/groundtruth/stub.py): one
# GPU, the allocator's peaks against the estimate's. GPU cases where one
# fits, so a GPU run of the same ids sits beside them; new ones (fp16
# autocast, accumulation 2, a small MoE) where the GPU matrix has none.
# Nothing is computed on the stub, so sizes cost only host time.
_QWEN3_MOE_SMALL = {"num_hidden_layers": 4}  # 128 experts, top-8, as the full model; 4 of its 48 layers
# As _tiny() below, with 4 layers.
_TINY4 = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512}
STUB_CASES: list[Case] = [
    _gpu("gpt2-fp32-s1024-b8-sdpa"),
    _gpu("gpt2-bf16-mixed-s1024-b16-eager"),
    _gpu("opt-125m-fp32-s2048-b4-eager"),
    _gpu("opt-125m-bf16-mixed-s512-b16-sdpa-adamw-fused"),
    _gpu("qwen2.5-0.5b-bf16-mixed-s2048-b4-sdpa"),
    _gpu("qwen2.5-0.5b-bf16-s4096-b2-sdpa-adamw-fused"),
    _case("qwen2.5-0.5b", "fp16-mixed", 1024, 4),
    _gpu("llama-3.2-1b-fp32-s1024-b2-sdpa"),
    _gpu("llama-3.2-1b-bf16-mixed-s1024-b4-sdpa"),
    _gpu("llama-3.2-1b-bf16-mixed-s1024-b4-eager"),
    _gpu("llama-3.2-1b-bf16-mixed-s1024-b4-sdpa-trainer"),
    _gpu("llama-3.2-1b-bf16-s4096-b4-gc-sdpa-adamw-fused"),
    _case("llama-3.2-1b", "bf16-mixed", 2048, 8, gc=True),  # b16 (a GPU case) runs out of the stub's 79.6 GiB
    _gpu("llama-3.2-1b-bf16-mixed-s4096-b2-lora-sdpa"),
    _case("llama-3.2-1b", "fp16-mixed", 2048, 2, lora=LORA),
    _case("llama-3.2-1b", "bf16-mixed", 1024, 2, accum=2),
    _gpu("llama-3.2-1b-bf16-mixed-s1024-b4-sdpa-sgd"),
    _gpu("llama-3.2-1b-bf16-s1024-b4-sdpa-adafactor"),
    _gpu("llama-3.2-1b-bf16-s2048-b2-flash_attention_2"),
    _gpu("gemma-2-2b-bf16-mixed-s1024-b2-eager"),
    _gpu("phi-3-mini-bf16-s2048-b2-sdpa-adamw-fused"),
    _gpu("llama-3.1-8b-bf16-s512-b1-sdpa"),
    _gpu("llama-3.1-8b-bf16-mixed-s2048-b1-lora-sdpa"),
    _case("qwen3-30b-a3b", "bf16", 1024, 2, lora=LORA, overrides=_QWEN3_MOE_SMALL, prefix="l4-"),
    # Variable-length batches (llmem_plugin.techniques.varlen): every micro-batch padded to its longest sample, tiny
    # 4-layer models; run with --steps 60 or more (tests/stub/test_varlen.py).
    _case("llama-3.2-1b", "bf16-mixed", 512, 4, attn="eager", overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", seq_lens="16:512:120"),
    _case("qwen2.5-0.5b", "bf16", 384, 2, accum=2, optimizer="adamw-fused", lora=LoraSpec(rank=4),
          overrides=_TINY4, prefix="tiny4-", seq_lens="200:384"),
    # The plain loop (Workload.runner "plain-loop"): each micro-step's outputs live into the next forward;
    # the model's own loss, and litgpt's chunked head whose chunk logits the loop keeps.
    _case("llama-3.2-1b", "bf16-mixed", 256, 4, accum=2, overrides={**_TINY4, "head_dim": 16}, prefix="tiny4-",
          loop="plain-loop"),
    _case("llama-3.2-1b", "bf16", 256, 4, accum=2, lora=LoraSpec(rank=4), overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", loop="plain-loop", loss="chunked", loss_chunks=4, loss_chunk_upcast=False),
    _case("llama-3.2-1b", "bf16", 256, 4, accum=2, lora=LoraSpec(rank=4), overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", loss="chunked", loss_chunks=4, loss_chunk_upcast=False),
    # The plain step, the real run `llmem compare` is checked against (tests/stub/test_snapshot.py): predicted
    # at batch 1, or with the 16-bit loss, it names the difference.
    _case("llama-3.2-1b", "bf16-mixed", 256, 2, overrides={**_TINY4, "head_dim": 16}, prefix="tiny4-"),
    # Reentrant checkpointing (LLaMA-Factory's default): each layer's forward reruns inside a nested backward.
    _case("llama-3.2-1b", "bf16", 256, 4, gc=True, lora=LoraSpec(rank=4), overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", checkpoint_reentrant=True),
    # LoRA adapters in the base weights' dtype (peft autocast_adapter_dtype=False; litgpt, torchtune), with
    # dropout: each adapted layer's branch runs on its bf16 input, not an fp32 copy.
    _case("llama-3.2-1b", "bf16", 256, 4, overrides={**_TINY4, "head_dim": 16}, prefix="tiny4-",
          lora=LoraSpec(rank=4, dropout=0.05, adapter_dtype="base", target_modules=("q_proj", "v_proj", "up_proj"))),
    # QLoRA with bitsandbytes' own CUDA library loaded on the stub (stubcuda/build.py adds its imports):
    # packed 4-bit weights, each matmul's dequantized weight, peft's k-bit preparation on and off.
    _case("llama-3.2-1b", "bf16-mixed", 256, 4, lora=LoraSpec(rank=4), overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", quantize="nf4", double_quant=True),
    _case("llama-3.2-1b", "bf16", 256, 4, lora=LoraSpec(rank=4), overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-", quantize="nf4", kbit_prepare="off"),
    # bitsandbytes' paged optimizers (managed memory, host memory on the stub): what goes through
    # PyTorch's allocator; the paged states lie outside it. Alone, and as litgpt's QLoRA recipe runs them.
    _case("llama-3.2-1b", "bf16-mixed", 256, 4, optimizer="paged-adamw", overrides={**_TINY4, "head_dim": 16},
          prefix="tiny4-"),
    _case("llama-3.2-1b", "bf16", 256, 4, lora=LoraSpec(rank=4, dropout=0.05, adapter_dtype="base"),
          optimizer="paged-adamw", overrides={**_TINY4, "head_dim": 16}, prefix="tiny4-", quantize="nf4",
          kbit_prepare="off", loss="chunked", loss_chunks=4, loss_chunk_upcast=False, loop="plain-loop"),
    # torchao's NF4 as torchtune runs it (FrozenNF4Linear: torchao's own NF4Tensor and linear_nf4), bf16
    # adapters, checkpointing; the widths are multiples torchao's to_nf4 takes (64 x 256 elements).
    _case("llama-3.2-1b", "bf16", 256, 4, gc=True, prefix="tiny4-", quantize="nf4-torchao",
          lora=LoraSpec(rank=4, dropout=0.05, adapter_dtype="base", target_modules=("q_proj", "v_proj")),
          overrides={**_TINY4, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                     "num_key_value_heads": 4, "head_dim": 32}),
]


def _tiny(**extra: Any) -> dict[str, Any]:
    # As tests/conftest.py TINY_CONFIGS: 2 layers, hidden 64, GQA 4/2 heads, vocab 512.
    return {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 512, **extra}


_TINY = {
    "llama-3.2-1b": _tiny(head_dim=16),
    "qwen2.5-0.5b": _tiny(),
    "mistral-7b": _tiny(head_dim=16),
    "gemma-2-2b": _tiny(head_dim=16),
    # The published special-token ids (32000, 50256) lie past the tiny vocabulary.
    "phi-3-mini": _tiny(pad_token_id=0, eos_token_id=0),
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 0},
    "opt-125m": {"num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4,
                 "word_embed_proj_dim": 64, "vocab_size": 512},
    # The other tasks (llmem_plugin.models.tasks): a sequence classifier and two seq2seq models.
    "distilbert-sst2": {"n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4, "vocab_size": 512},
    "bert-base-uncased": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "vocab_size": 512},
    "roberta-base": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                     "vocab_size": 512},
    "t5-base": {"num_layers": 2, "d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "vocab_size": 512},
    # Llama 3.2 Vision's structure (as tests/models/test_tasks.py's tiny Mllama): 4 tiles of 56 px.
    "llama-3.2-11b-vision": {
        "image_token_index": 500,
        "text_config": {"model_type": "mllama_text_model", **_tiny(head_dim=16), "num_hidden_layers": 4,
                        "cross_attention_layers": [1, 3], "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
                        "max_position_embeddings": 1024,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2, "image_size": 56,
                          "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 96,
                          "intermediate_layers_indices": [0, 1],
                          "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]},
    },
    "bart-base": {"num_hidden_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "d_model": 64,
                  "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_attention_heads": 4,
                  "decoder_attention_heads": 4, "vocab_size": 512},
}


def _cpu(model: str, precision: str, seq: int, batch: int, *, overrides_extra: dict[str, Any] | None = None,
         **kw: Any) -> Case:
    prefix = "tiny-" if not overrides_extra else f"tiny{overrides_extra.get('num_hidden_layers', '')}-"
    return _case(model, precision, seq, batch, runner="tracker-cpu", overrides={**_TINY[model], **(overrides_extra or {})},
                 prefix=prefix, **kw)


CPU_CASES: list[Case] = [
    _cpu("llama-3.2-1b", "bf16-mixed", 64, 2),
    _cpu("llama-3.2-1b", "bf16", 64, 2, gc=True, optimizer="adamw-fused"),
    # Checkpointing policies on 4 layers, sized so that activations set the peak: every second layer,
    # torchtitan's op-level SAC (with and without LoRA), and a saved-op set.
    *(_cpu(m, p, 256, 4, gc=True, overrides_extra={"num_hidden_layers": 4}, **kw) for m, p, kw in (
        ("llama-3.2-1b", "bf16-mixed", {"checkpoint_every": 2}),
        ("llama-3.2-1b", "bf16-mixed", {"checkpoint_save_ops": "torchtitan"}),
        ("llama-3.2-1b", "bf16", {"checkpoint_save_ops": "torchtitan", "lora": LoraSpec(rank=4)}),
        ("qwen2.5-0.5b", "bf16-mixed", {"checkpoint_save_ops": "aten.mm,aten._scaled_dot_product_efficient_attention"}),
    )),
    _cpu("qwen2.5-0.5b", "fp32", 64, 2, lora=LoraSpec(rank=4)),
    _cpu("gpt2", "bf16-mixed", 64, 2, attn="eager", lora=LoraSpec(rank=4, target_modules=("c_attn",))),
    _cpu("opt-125m", "fp32", 32, 2, accum=2),
    _cpu("mistral-7b", "bf16", 64, 1, gc=True, lora=LoraSpec(rank=4)),
    _cpu("gemma-2-2b", "bf16-mixed", 64, 1, attn="eager"),
    _cpu("phi-3-mini", "fp32", 32, 2, lora=LoraSpec(rank=4, target_modules=("qkv_proj", "o_proj"))),
    _cpu("distilbert-sst2", "bf16-mixed", 64, 2),
    _cpu("t5-base", "bf16-mixed", 64, 2, target_len=16),
    _cpu("bart-base", "fp32", 32, 2, target_len=16, lora=LoraSpec(rank=4, target_modules=("q_proj", "v_proj"))),
    _cpu("bart-base", "fp32", 32, 2, target_len=16),
    _cpu("llama-3.2-11b-vision", "bf16-mixed", 32, 2),
    _cpu("llama-3.2-11b-vision", "bf16", 32, 1, images=2, freeze_vision=True),
    # BERT and RoBERTa fine-tuned as classifiers (3 labels), and BERT's own masked-LM head.
    _case("bert-base-uncased", "bf16-mixed", 64, 2, runner="tracker-cpu", prefix="tiny-seqcls-",
          overrides={**_TINY["bert-base-uncased"], "architectures": ["BertForSequenceClassification"]}),
    _case("roberta-base", "fp32", 64, 2, runner="tracker-cpu", prefix="tiny-seqcls-",
          overrides={**_TINY["roberta-base"], "architectures": ["RobertaForSequenceClassification"], "num_labels": 3}),
    _cpu("bert-base-uncased", "bf16-mixed", 64, 2),
    # Llama 3.2 1B saved as a sequence classifier (its config's architectures).
    _case("llama-3.2-1b", "bf16-mixed", 64, 2, runner="tracker-cpu", prefix="tiny-seqcls-",
          overrides={**_TINY["llama-3.2-1b"], "architectures": ["LlamaForSequenceClassification"], "pad_token_id": 0}),
]


# Published configurations (benchmarks/published/measurements.jsonl, field
# "reproduction") run as the estimator models them: the model class is
# transformers', the recipe's memory-relevant settings are the publication's.
# Where these measurements agree with the prediction but not with the
# publication, the publication's setup differs from its transcription (its own
# model code, a whole-run peak); where they disagree, the model of the recipe
# is wrong. Sequence lengths are the publication's maximum (its data padded to
# the longest sample, which the peak step reaches).
_QV = ("q_proj", "v_proj")
PUBLISHED_CASES = [
    # huggingface/peft method_comparison/MetaMathQA (default_training_params.json): Llama-3.2-3B loaded in
    # bf16 (pure bf16 AdamW), max_seq_length 768, batch 4, model(**batch).loss; adapters fp32 (autocast_adapter_dtype).
    _case("llama-3.2-3b", "bf16", 768, 4, lora=LoraSpec(rank=32, alpha=64, target_modules=_QV), prefix="pub-peft-",
          note="peft MetaMathQA lora/llama-3.2-3B-rank32"),
    _case("llama-3.2-3b", "bf16", 768, 4, prefix="pub-peft-", note="peft MetaMathQA full-finetuning/llama-3.2-3B"),
    # Lightning-AI/litgpt config_hub/finetune/*.yaml (precision bf16-true, max_seq_length 512, LoRA on query and
    # value r 32 alpha 16 dropout 0.05); litgpt's chunked_cross_entropy on bf16 logits (no upcast).
    _case("llama-3.2-1b", "bf16", 512, 4, loss="no-upcast", prefix="pub-litgpt-",
          note="litgpt config_hub llama-3.2-1B/full.yaml"),
    _case("llama-3.2-3b", "bf16", 512, 1, lora=LoraSpec(rank=32, alpha=16, target_modules=_QV, dropout=0.05),
          loss="no-upcast", prefix="pub-litgpt-", note="litgpt config_hub llama-3.2-3B/lora.yaml"),
    _case("llama-3.1-8b", "bf16", 512, 1, lora=LoraSpec(rank=32, alpha=16, target_modules=_QV, dropout=0.05),
          loss="no-upcast", prefix="pub-litgpt-", note="litgpt config_hub llama-3.1-8b/lora.yaml"),
    _case("llama-3.1-8b", "bf16", 512, 2, lora=LoraSpec(rank=32, alpha=16, target_modules=_QV, dropout=0.05),
          quantize="nf4", kbit_prepare="off", optimizer="paged-adamw", loss="no-upcast", prefix="pub-litgpt-",
          note="litgpt config_hub llama-3.1-8b/qlora.yaml: bnb.nf4, no k-bit preparation, bnb PagedAdamW"),
    _case("mistral-7b", "bf16", 512, 2, lora=LoraSpec(rank=32, alpha=16, target_modules=_QV, dropout=0.05),
          loss="no-upcast", prefix="pub-litgpt-", note="litgpt config_hub mistral-7b/lora.yaml"),
    # pytorch/torchtune docs, LoRA tutorial (Llama-2-7B, lora_finetune_single_device): bf16, batch 2,
    # max_seq_len 512, activation checkpointing, LoRA r 8 alpha 16 on q/v, nn.CrossEntropyLoss on bf16 logits.
    _case("llama-2-7b", "bf16", 512, 2, gc=True, lora=LoraSpec(rank=8, alpha=16, target_modules=_QV),
          loss="no-upcast", prefix="pub-torchtune-", note="torchtune LoRA tutorial, Llama-2-7B q/v rank 8"),
]


def find(ids: list[str], cases: list[Case]) -> list[Case]:
    """The cases named by ``ids``, in that order.

    Raises:
        ValueError: An id names no case; the message lists the valid ones.
    """
    by_id = {c.id: c for c in cases}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(f"unknown case id(s) {', '.join(unknown)}; valid: {', '.join(by_id)}. "
                         "HINT: python -m benchmarks.groundtruth.run --list")
    return [by_id[i] for i in ids]


def _check_unique(cases: list[Case]) -> None:
    seen: set[str] = set()
    for c in cases:
        assert c.id not in seen, f"duplicate case id {c.id}"
        seen.add(c.id)


_check_unique(GPU_CASES + CPU_CASES)
_check_unique(STUB_CASES)
_check_unique(GPU_CASES + [c for c in STUB_CASES if c not in GPU_CASES] + CPU_CASES + PUBLISHED_CASES)
