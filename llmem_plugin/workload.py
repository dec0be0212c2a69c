"""The fine-tuning workload to estimate: frozen, keyword-only, self-validating."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from enum import Enum

import torch

from llmem_plugin.errors import ConfigError

__all__ = [
    "ActivationOffload",
    "AttentionImpl",
    "LoraSpec",
    "LossImpl",
    "OptimizerKind",
    "Precision",
    "Quantization",
    "Runner",
    "Workload",
]


def _choice(enum_cls: type[Enum], value: object, what: str, flag: str) -> Enum:
    if isinstance(value, enum_cls):
        return value
    valid = [m.value for m in enum_cls]
    key = str(value).strip().lower()
    for m in enum_cls:
        if key == m.value:
            return m
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        f"unsupported {what} '{value}'; {hint}valid: {', '.join(valid)}. HINT: pass {flag} with one of them"
    )


class Precision(str, Enum):
    """Numeric precision of the training step."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"  # fp32 weights, torch.autocast(bfloat16)
    FP16_MIXED = "fp16-mixed"  # fp32 weights, torch.autocast(float16)
    BF16 = "bf16"  # weights, gradients and optimizer states in bfloat16

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is Precision.BF16 else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}.get(self)


class OptimizerKind(str, Enum):
    """Optimizer, with the implementation a CUDA run picks."""

    ADAMW = "adamw"  # torch.optim.AdamW, foreach=True (the CUDA default)
    ADAMW_FUSED = "adamw-fused"  # torch.optim.AdamW(fused=True)
    ADAMW_FORLOOP = "adamw-forloop"  # torch.optim.AdamW(foreach=False): the per-parameter loop
    SGD = "sgd"  # torch.optim.SGD(momentum=0.9), foreach
    ADAFACTOR = "adafactor"  # torch.optim.Adafactor, foreach
    ADAMW_8BIT = "adamw8bit"  # bitsandbytes.optim.AdamW8bit (blockwise 8-bit states)
    PAGED_ADAMW = "paged-adamw"  # bitsandbytes.optim.PagedAdamW (32-bit states in unified memory)
    PAGED_ADAMW_8BIT = "paged-adamw8bit"  # bitsandbytes.optim.PagedAdamW8bit

    @property
    def is_bitsandbytes(self) -> bool:
        return self in (OptimizerKind.ADAMW_8BIT, OptimizerKind.PAGED_ADAMW, OptimizerKind.PAGED_ADAMW_8BIT)


class AttentionImpl(str, Enum):
    """transformers ``attn_implementation``; AUTO is transformers' own default
    (sdpa where the architecture supports it, else eager)."""

    AUTO = "auto"
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH_ATTENTION_2 = "flash_attention_2"


class Quantization(str, Enum):
    """bitsandbytes weight quantization of the frozen base model (QLoRA)."""

    NF4 = "nf4"  # Linear4bit, quant_type="nf4"
    FP4 = "fp4"  # Linear4bit, quant_type="fp4"
    INT8 = "int8"  # Linear8bitLt (LLM.int8)


class LossImpl(str, Enum):
    """How the language-model loss is computed from the last hidden states.

    HF is the model's own ``loss_function`` (logits upcast to fp32, the
    transformers default); LIGER is liger-kernel's fused linear
    cross-entropy (no full logits); CHUNKED is a loss over sequence chunks of
    the logits (torchtune's ``CEWithChunkedOutputLoss``).
    """

    HF = "hf"
    LIGER = "liger"
    CHUNKED = "chunked"


class ActivationOffload(str, Enum):
    """Where saved activations go between forward and backward.

    SAVE_ON_CPU is ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
    STREAMED is the torchtune/TRL ``OffloadActivations`` context (TRL
    ``SFTConfig(activation_offloading=True)``).
    """

    SAVE_ON_CPU = "save-on-cpu"
    STREAMED = "streamed"


class Runner(str, Enum):
    """The training loop around the model.

    TORCH is the plain loop (forward with labels under autocast, backward,
    ``optimizer.step()``, ``zero_grad``). LIGHTNING zeroes gradients between
    the forward and the backward instead (see below). HF_TRAINER adds what ``transformers.Trainer``
    does around it: under mixed precision accelerate wraps the forward so
    its fp16/bf16 outputs (the logits) are converted to fp32 after the
    autocast region (accelerate ``Accelerator.prepare_model``,
    ``convert_outputs_to_fp32``), and gradients are clipped to
    ``max_grad_norm`` (1.0 by default, ``TrainingArguments``) with
    ``torch.nn.utils.clip_grad_norm_`` before the optimizer step.
    """

    TORCH = "torch"
    HF_TRAINER = "hf-trainer"
    # Lightning's automatic optimization (loops/optimization/automatic.py,
    # 2.6): the closure runs training_step, then zero_grad (on the first
    # micro-batch of an accumulation window only), then backward, so the
    # previous step's gradients live through the next forward.
    LIGHTNING = "lightning"


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """peft LoRA settings.

    Attributes:
        rank: LoRA rank ``r``.
        alpha: ``lora_alpha``; defaults to ``2 * rank`` when None.
        target_modules: Module name suffixes to adapt, or ``("all-linear",)``.
        dropout: ``lora_dropout``.
    """

    rank: int = 16
    alpha: float | None = None
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}. HINT: e.g. --lora-rank 16")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ConfigError("LoRA target modules are empty. HINT: e.g. --lora-targets q_proj,v_proj")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training configuration on one device.

    Attributes:
        seq_len: Tokens per sequence.
        micro_batch_size: Sequences per forward/backward.
        grad_accum_steps: Micro-batches whose gradients accumulate before a step.
        precision: See :class:`Precision`.
        optimizer: See :class:`OptimizerKind`.
        grad_checkpointing: transformers' non-reentrant gradient checkpointing.
        lora: LoRA settings, or None for full fine-tuning.
        attn_implementation: See :class:`AttentionImpl`.
        runner: See :class:`Runner`.
        quantize: bitsandbytes quantization of the base model's linear
            layers (needs ``lora``), or None.
        double_quant: Quantize the 4-bit absmax statistics too
            (``bnb_4bit_use_double_quant``).
        loss: See :class:`LossImpl`.
        logits_to_keep: Compute logits and loss for only the last this many
            tokens of each sequence (0: all), as ``logits_to_keep`` does.
        loss_chunks: Chunks of the sequence for ``loss="chunked"``.
        offload_activations: See :class:`ActivationOffload`, or None.
        reference_model: Also run a frozen reference model's forward under
            ``no_grad`` after each policy forward, as DPO does (TRL): a
            frozen copy of the model in the parameter dtype, or with LoRA the
            same model with its adapters disabled.
    """

    seq_len: int = 2048
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    precision: Precision = Precision.BF16_MIXED
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    grad_checkpointing: bool = False
    lora: LoraSpec | None = None
    attn_implementation: AttentionImpl = AttentionImpl.AUTO
    runner: Runner = Runner.TORCH
    quantize: Quantization | None = None
    double_quant: bool = False
    loss: LossImpl = LossImpl.HF
    logits_to_keep: int = 0
    loss_chunks: int = 8
    offload_activations: ActivationOffload | None = None
    reference_model: bool = False

    def __post_init__(self) -> None:
        for name, flag in (("seq_len", "--seq-len"), ("micro_batch_size", "--batch-size"),
                           ("grad_accum_steps", "--grad-accum")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}. HINT: pass {flag} N with N >= 1")
        object.__setattr__(self, "precision", _choice(Precision, self.precision, "precision", "--precision"))
        object.__setattr__(self, "optimizer", _choice(OptimizerKind, self.optimizer, "optimizer", "--optimizer"))
        object.__setattr__(
            self, "attn_implementation", _choice(AttentionImpl, self.attn_implementation, "attention", "--attn")
        )
        object.__setattr__(self, "runner", _choice(Runner, self.runner, "runner", "--runner"))
        object.__setattr__(self, "loss", _choice(LossImpl, self.loss, "loss", "--loss"))
        if self.quantize is not None:
            object.__setattr__(self, "quantize", _choice(Quantization, self.quantize, "quantization", "--quantize"))
            if self.lora is None:
                raise ConfigError(
                    f"--quantize {self.quantize.value} freezes the base weights (bitsandbytes weights take no "
                    "gradient), so it trains LoRA adapters only. HINT: add --lora-rank 16 (QLoRA)"
                )
        if self.double_quant and self.quantize not in (Quantization.NF4, Quantization.FP4):
            raise ConfigError("--double-quant applies to 4-bit weights only. HINT: pass --quantize nf4 or fp4")
        if self.offload_activations is not None:
            object.__setattr__(self, "offload_activations", _choice(
                ActivationOffload, self.offload_activations, "activation offload", "--offload-activations"))
        for name, flag, low in (("logits_to_keep", "--logits-to-keep", 0), ("loss_chunks", "--loss-chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}. HINT: pass {flag} N")
        if self.logits_to_keep > self.seq_len:
            raise ConfigError(f"logits_to_keep {self.logits_to_keep} exceeds seq_len {self.seq_len}. "
                              "HINT: pass --logits-to-keep N with N <= --seq-len, or 0 for all tokens")

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "precision": self.precision.value,
            "optimizer": self.optimizer.value,
            "grad_checkpointing": self.grad_checkpointing,
            "lora": None if self.lora is None else {
                "rank": self.lora.rank,
                "alpha": self.lora.lora_alpha,
                "target_modules": list(self.lora.target_modules),
                "dropout": self.lora.dropout,
            },
            "attn_implementation": self.attn_implementation.value,
            "runner": self.runner.value,
            "quantize": None if self.quantize is None else self.quantize.value,
            "double_quant": self.double_quant,
            "loss": self.loss.value,
            "logits_to_keep": self.logits_to_keep,
            "loss_chunks": self.loss_chunks,
            "offload_activations": None if self.offload_activations is None else self.offload_activations.value,
            "reference_model": self.reference_model,
        }
