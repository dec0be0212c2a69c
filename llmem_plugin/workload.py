"""The fine-tuning workload to estimate: frozen, keyword-only, self-validating."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from enum import Enum

import torch

from llmem_plugin.errors import ConfigError

__all__ = [
    "BNB_NEWEST_READ",
    "BNB_OLDEST_READ",
    "MAX_GRAD_ACCUM_STEPS",
    "ActivationOffload",
    "AttentionImpl",
    "LoraSpec",
    "LossImpl",
    "OptimizerKind",
    "Precision",
    "Quantization",
    "Runner",
    "Task",
    "Workload",
    "parse_precision",
    "resolve_bnb_version",
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
    """Numeric precision of the training step.

    Lightning's precision strings are accepted as Lightning defines them
    (``_PRECISION_INPUT`` in lightning/fabric/plugins/precision/precision.py
    and the alias table ``_PRECISION_INPUT_STR_ALIAS_CONVERSION`` applied by
    ``_convert_precision_to_unified_args`` in lightning/fabric/connector.py,
    2.6): see :func:`parse_precision`.
    """

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


# Lightning's precision inputs (lightning/fabric/plugins/precision/precision.py,
# 2.6) -> this project's. "bf16-true" and "16-true" are HalfPrecision: the
# module is cast to the half dtype (plugins/precision/half.py), so "bf16-true"
# is pure bf16 weights, gradients and states. The legacy aliases are resolved
# as connector.py's _PRECISION_INPUT_STR_ALIAS_CONVERSION does: 16 -> "16-mixed",
# 32 -> "32-true", 64 -> "64-true"; Lightning's legacy "bf16" alias (its
# "bf16-mixed") is not taken, as "bf16" is this project's pure-bf16 name.
_LIGHTNING_PRECISION = {
    "bf16-true": "bf16",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "fp16-mixed",
    "16": "fp16-mixed",
    "32-true": "fp32",
    "32": "fp32",
}
# Lightning precisions with no counterpart here, and why.
_LIGHTNING_UNMODELLED = {
    "16-true": "pure float16 weights (HalfPrecision(float16)); fp16 training needs fp32 master weights",
    "64-true": "float64 weights (DoublePrecision)",
    "64": "float64 weights (DoublePrecision)",
    "transformer-engine": "NVIDIA Transformer Engine's FP8 layers (TransformerEnginePrecision)",
    "transformer-engine-float16": "NVIDIA Transformer Engine's FP8 layers (TransformerEnginePrecision)",
}


def parse_precision(value: object) -> Precision:
    """A :class:`Precision` from this project's names or Lightning's.

    Args:
        value: A :class:`Precision`, one of its values (``"fp32"``,
            ``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16"``), or a Lightning
            precision (``"bf16-true"``, ``"bf16-mixed"``, ``"16-mixed"``,
            ``"32-true"``, or the legacy ``16`` / ``32``).

    Raises:
        ConfigError: Unknown name.
        UnsupportedError: A Lightning precision that is not modelled
            (``"16-true"``, ``"64-true"``, ``"transformer-engine"``...).
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"precision must be a name, got {value!r}. HINT: pass precision='bf16-mixed'")
    key = str(value).strip().lower()
    if key in _LIGHTNING_UNMODELLED:
        from llmem_plugin.errors import UnsupportedError

        raise UnsupportedError(
            f"precision {value!r} ({_LIGHTNING_UNMODELLED[key]}) is not modelled. HINT: pass one of "
            f"{', '.join(p.value for p in Precision)} (or Lightning's bf16-true, bf16-mixed, 16-mixed, 32-true)")
    return _choice(Precision, _LIGHTNING_PRECISION.get(key, value), "precision", "--precision")


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
    """Weight quantization of the frozen base model (QLoRA): bitsandbytes', or torchao's NF4."""

    NF4 = "nf4"  # Linear4bit, quant_type="nf4"
    FP4 = "fp4"  # Linear4bit, quant_type="fp4"
    INT8 = "int8"  # Linear8bitLt (LLM.int8)
    NF4_TORCHAO = "nf4-torchao"  # torchao's NF4Tensor, as torchtune's QLoRA runs it (llmem_plugin.techniques.nf4)

    @property
    def bitsandbytes(self) -> bool:
        return self is not Quantization.NF4_TORCHAO


class LossImpl(str, Enum):
    """How the language-model loss is computed from the last hidden states.

    HF is the model's own ``loss_function`` (logits upcast to fp32, the
    transformers default); NO_UPCAST is the same cross-entropy on the logits
    in the dtype the model produced them (trainers that call
    ``F.cross_entropy`` on bf16 logits); LIGER is liger-kernel's fused linear
    cross-entropy (no full logits); CHUNKED is a loss over sequence chunks of
    the logits (torchtune's ``CEWithChunkedOutputLoss``); CCE is Cut
    Cross-Entropy (``cut-cross-entropy``, no logits at all); TRL_FUSED is TRL
    1.16's fused LM head (``ChunkedLogProbFunction`` over 4096 x 32768 tiles,
    as SFTTrainer scores the valid labels).
    """

    HF = "hf"
    NO_UPCAST = "no-upcast"
    LIGER = "liger"
    TRL_FUSED = "trl-fused"  # TRL 1.16's fused LM head (llmem_plugin.techniques.trl_head)
    CHUNKED = "chunked"
    CCE = "cce"


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
    PLAIN_LOOP is the loop written out by hand, ``outputs = model(...)``,
    ``loss = outputs.loss``, ``loss.backward()``, ``optimizer.step()``, with
    no ``del``: the previous micro-step's outputs (its logits) and loss (the
    root of its autograd graph, and everything the graph's nodes still hold)
    stay referenced through the optimizer step and the next forward, and are
    released when the next forward's outputs are assigned (litgpt
    ``finetune/lora.py`` ``fit``; peft ``method_comparison/MetaMathQA/run.py``).
    """

    TORCH = "torch"
    HF_TRAINER = "hf-trainer"
    # Lightning's automatic optimization (loops/optimization/automatic.py,
    # 2.6): the closure runs training_step, then zero_grad (on the first
    # micro-batch of an accumulation window only), then backward, so the
    # previous step's gradients live through the next forward.
    LIGHTNING = "lightning"
    PLAIN_LOOP = "plain-loop"


class Task(str, Enum):
    """What the model is trained for (``Workload.task``); which class each
    task builds and what its batch holds is :mod:`llmem_plugin.models.tasks`."""

    CAUSAL_LM = "causal-lm"
    SEQ_CLS = "seq-cls"
    TOKEN_CLS = "token-cls"
    SEQ2SEQ = "seq2seq"
    IMAGE_TEXT = "image-text-to-text"
    MASKED_LM = "masked-lm"


# peft's LoraConfig field names -> LoraSpec's.
_LORA_KEYS = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "targets": "target_modules"}
# LoraSpec.adapter_dtype: peft's autocast_adapter_dtype on (fp32) or off (base).
_ADAPTER_DTYPES = ("fp32", "base")


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """peft LoRA settings.

    Attributes:
        rank: LoRA rank ``r``.
        alpha: ``lora_alpha``; defaults to ``2 * rank`` when None.
        target_modules: Module name suffixes to adapt, or ``("all-linear",)``.
        dropout: ``lora_dropout``.
        adapter_dtype: ``"fp32"``: the adapters of a 16-bit model are fp32,
            and each adapted layer runs its LoRA branch on an fp32 copy of
            its input (peft ``get_peft_model``'s default
            ``autocast_adapter_dtype=True``, peft/tuners/tuners_utils.py
            ``_cast_adapter_dtype``; ``lora/layer.py`` ``_cast_input_dtype``).
            ``"base"``: the adapters keep the base layer's dtype
            (``autocast_adapter_dtype=False``; litgpt's ``LoRALinear`` and
            torchtune's ``LoRALinear`` are created in the model's dtype; over
            bitsandbytes 4-bit weights, which have no float dtype, peft keeps
            them as created, fp32, so "base" casts them:
            ``modelbuild.adapters_to``). Identical when the weights are fp32.
    """

    rank: int = 16
    alpha: float | None = None
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0
    adapter_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}. HINT: e.g. --lora-rank 16")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                                       or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise ConfigError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}. "
                              "HINT: e.g. --lora-alpha 32, or leave it out for 2 x rank")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise ConfigError(f"LoRA dropout must be a number in [0, 1), got {self.dropout!r}. HINT: e.g. 0.05")
        targets = self.target_modules
        if isinstance(targets, str):  # "q_proj,v_proj", as the CLI and peft's single-name form take it
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        if not isinstance(targets, (list, tuple, set, frozenset)) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"LoRA target modules must be module names, got {self.target_modules!r}. "
                              "HINT: e.g. target_modules=('q_proj', 'v_proj')")
        if not targets:
            raise ConfigError("LoRA target modules are empty. HINT: e.g. --lora-targets q_proj,v_proj")
        object.__setattr__(self, "target_modules", tuple(sorted(targets) if isinstance(targets, (set, frozenset))
                                                         else targets))
        if self.adapter_dtype not in _ADAPTER_DTYPES:
            raise ConfigError(f"LoRA adapter dtype must be one of {', '.join(_ADAPTER_DTYPES)}, got "
                              f"{self.adapter_dtype!r}. HINT: fp32 (peft's default) or base (litgpt, torchtune)")

    @classmethod
    def coerce(cls, value: object) -> LoraSpec | None:
        """A :class:`LoraSpec` from a spec, a dict, or a peft ``LoraConfig``.

        A dict takes this class's field names or peft's (``r``, ``lora_alpha``,
        ``lora_dropout``, ``target_modules``); a ``LoraConfig`` maps the same
        four fields, and its adapters are "fp32" (the adapter dtype is
        ``get_peft_model``'s ``autocast_adapter_dtype``, not a config field).

        Raises:
            ConfigError: Another type, or a dict with keys that are neither.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            fields = {_LORA_KEYS.get(k, k): v for k, v in value.items()}
            unknown = sorted(set(fields) - {"rank", "alpha", "target_modules", "dropout", "adapter_dtype"}, key=str)
            if unknown:
                raise ConfigError(f"lora keys {unknown} not understood; valid: rank (r), alpha (lora_alpha), "
                                  "target_modules, dropout (lora_dropout), adapter_dtype. "
                                  "HINT: e.g. lora={'rank': 16}")
            if len(fields) != len(value):
                raise ConfigError(f"lora {value!r} gives a field twice (under its name and peft's). "
                                  "HINT: keep one of rank/r, alpha/lora_alpha, dropout/lora_dropout")
            return cls(**fields)
        if type(value).__name__ == "LoraConfig" and hasattr(value, "r"):  # peft.LoraConfig
            targets = value.target_modules
            # peft fills None from its per-architecture table and reads a
            # string other than "all-linear" as a regular expression
            # (peft/tuners/tuners_utils.py check_target_module_exists).
            if targets is None or (isinstance(targets, str) and targets != "all-linear"):
                raise ConfigError(f"LoraConfig target_modules={targets!r} is resolved by peft per model; not "
                                  "modelled here. HINT: give the module names, "
                                  "e.g. target_modules=['q_proj', 'v_proj']")
            return cls(rank=value.r, alpha=value.lora_alpha, dropout=value.lora_dropout,
                       target_modules=(targets,) if isinstance(targets, str) else targets)
        raise ConfigError(f"lora must be a LoraSpec, a dict or a peft LoraConfig, got {type(value).__name__}. "
                          "HINT: lora=llmem_plugin.LoraSpec(rank=16), or lora_rank=16")

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)


# The step divides each micro-batch's loss by grad_accum_steps, a Python int
# that torch takes as a c10::Scalar, whose integer is int64_t
# (c10/core/Scalar.h); a larger value fails inside torch. The traced step
# itself does not grow with it (llmem_plugin.trace.step.traced_micro_steps).
MAX_GRAD_ACCUM_STEPS = 2**63 - 1
# What peft's prepare_model_for_kbit_training does to a QLoRA model's other
# parameters, as recipes run it (llmem_plugin.techniques.quant._upcast_parameters).
_KBIT_PREPARE = ("on", "off", "norms-only")
# The dtypes bitsandbytes' quantize_4bit takes (functional.py: fp16, bf16, fp32).
_QUANTIZED_FROM = ("fp16", "bf16", "fp32")
# How the weights reach the GPU (llmem_plugin.trace.loading models each).
_LOADS = ("direct", "fp32-cast", "torchtune-0.1", "device-quantize")
# The 16-bit dtypes ``--load fp32-cast`` casts to.
_HALF = (torch.float16, torch.bfloat16)

# The bitsandbytes releases whose 4-bit training path was read (the tags 0.41.0 to
# 0.50.1 and the installed 0.50.2 of the sources llmem_plugin.techniques.quant
# cites as [B]): older ones are refused, newer ones are modelled as the newest
# read, which the report says.
BNB_OLDEST_READ = (0, 41, 0)
BNB_NEWEST_READ = (0, 50, 2)

_BNB_VERSION = re.compile(r"(\d{1,3})\.(\d{1,3})(?:\.(\d{1,3}))?(?:[.+-]?[a-z0-9.+-]*)?", re.IGNORECASE)


def _version_text(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def resolve_bnb_version(text: str | None) -> str:
    """The bitsandbytes version a QLoRA workload runs, as ``"X.Y.Z"``.

    Args:
        text: A version (``"0.42.0"``); None: the newest read. The default
            does not follow the installed release, so an estimate (and a
            re-validation of a recorded row) is the same on every machine;
            the adapters pass :func:`llmem_plugin.techniques.quant.installed_bnb_version`
            for the job they run in.

    Raises:
        ConfigError: Not a version, or older than the oldest read.
    """
    if text is None:
        return _version_text(BNB_NEWEST_READ)
    m = _BNB_VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"--bnb-version {text!r} is not a bitsandbytes version. HINT: e.g. --bnb-version 0.45.5")
    v = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
    if v < BNB_OLDEST_READ:
        raise ConfigError(f"--bnb-version {text} is older than {_version_text(BNB_OLDEST_READ)}, the oldest "
                          "bitsandbytes whose 4-bit path is modelled. HINT: pass a version from "
                          f"{_version_text(BNB_OLDEST_READ)} on")
    return _version_text(v)


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
        kbit_prepare: With ``quantize``, what peft's
            ``prepare_model_for_kbit_training`` does to the other parameters:
            ``on`` (it runs: every 16-bit parameter becomes fp32), ``off``
            (the recipe skips it) or ``norms-only`` (only the normalization
            layers' parameters become fp32). None: ``on`` for bitsandbytes,
            ``off`` for ``nf4-torchao`` (torchtune runs no preparation).
        quantize_lm_head: With ``quantize``, quantize the output head too
            (Lightning's ``BitsandbytesPrecision`` converts every
            ``nn.Linear``; transformers does with ``llm_int8_skip_modules=[]``).
        quantized_from: With ``quantize``, the dtype the base weights had
            when bitsandbytes quantized them (``QuantState.dtype``, what each
            dequantization returns before the cast to the compute dtype):
            ``fp16``, ``bf16`` or ``fp32``; None: the compute dtype
            (transformers' QLoRA recipe loads in it). Lightning's
            ``BitsandbytesPrecision`` quantizes from fp16.
        bnb_version: With ``quantize``, the bitsandbytes release the job runs
            (``"0.42.0"``); None: the newest read, 0.50.2 (the adapters pass
            the installed one; :func:`resolve_bnb_version`).
        loss: See :class:`LossImpl`.
        logits_to_keep: Compute logits and loss for only the last this many
            tokens of each sequence (0: all), as ``logits_to_keep`` does.
        loss_chunks: Chunks of the sequence for ``loss="chunked"``.
        loss_chunk_upcast: With ``loss="chunked"``, upcast each chunk's
            logits to fp32 before its cross-entropy (torchtune; True) or keep
            the logits' own dtype (False).
        outputs_to_fp32: The loop's model wrapper casts every floating
            tensor of the model's output to fp32 before the loop computes
            its loss: Lightning Fabric's ``_FabricModule.forward`` runs
            ``precision.convert_output``, ``tensor.to(torch.get_default_dtype())``,
            under every precision plugin but 32-true (Lightning 2.1-2.4
            ``fabric/wrappers.py``; ``plugins/precision/half.py``,
            ``bitsandbytes.py``, ``amp.py``): litgpt's scripts. A loss the
            loop computes on the returned logits (``chunked``, ``no-upcast``)
            then runs on the fp32 copies; a loss the model computes itself
            (``hf``) runs first and the copy is made afterwards.
        offload_activations: See :class:`ActivationOffload`, or None.
        reference_model: Also run a frozen reference model's forward under
            ``no_grad`` after each policy forward, as DPO does (TRL): a
            frozen copy of the model in the parameter dtype, or with LoRA the
            same model with its adapters disabled. With ``loss="trl-fused"``
            the step is DPOTrainer 1.16's: both the policy and the reference
            score through TRL's fused head, and the policy's loss is DPO's
            (:func:`llmem_plugin.techniques.trl_head.fused_dpo_loss`).
        target_len: Tokens per target sequence of an encoder-decoder
            (seq2seq) model, whose ``seq_len`` is the source length; None:
            ``seq_len``. Other models have no target sequence.
        task: What the model is trained for (:class:`Task`:
            ``causal-lm``, ``seq-cls``, ``token-cls``, ``seq2seq``,
            ``image-text-to-text``, ``masked-lm``); None: the class the
            config's ``architectures`` names.
        checkpoint_reentrant: With ``grad_checkpointing``, torch's reentrant
            variant (``use_reentrant=True``: each checkpointed layer's
            forward reruns in full inside its backward, which runs as a
            nested ``torch.autograd.backward``), as LLaMA-Factory runs it by
            default (``use_reentrant_gc``).
        checkpoint_every: With ``grad_checkpointing``, checkpoint every this
            many-th decoder layer only (torchtitan's layer-level selective
            AC: layers ``k-1, 2k-1, ...``; 1: every layer).
        load: How the weights reach the GPU before step 1
            (:mod:`llmem_plugin.trace.loading`): ``direct`` (each tensor once, in
            its training dtype) or ``fp32-cast`` (materialised in fp32, then
            cast to the 16-bit training dtype). QLoRA loads as bitsandbytes
            quantizes on load (``direct``), or, with ``device-quantize``, from
            the whole model first materialised on the GPU in its 16-bit dtype;
            ``nf4-torchao`` as torchtune
            0.6.1 builds and loads it (``direct``) or as torchtune 0.1 did
            with torchao 0.1 (``torchtune-0.1``).
        checkpoint_save_ops: With ``grad_checkpointing``, op-level selective
            checkpointing: the checkpointed layers keep these ops' outputs
            and recompute the rest (:mod:`llmem_plugin.techniques.checkpointing`): a
            preset (``torchtitan``) or comma-separated ops (``aten.mm``);
            None: keep nothing (full recompute).
        images: Images per sample of a vision-language model (None: 1).
        freeze_vision: Keep a vision-language model's vision tower frozen
            (no gradients or optimizer states for it).
        packed_docs: A padding-free packed batch (:mod:`llmem_plugin.techniques.packing`):
            each micro-batch's ``micro_batch_size`` x ``seq_len`` tokens
            flattened into one row holding this many documents, their
            boundaries among the inputs for flash attention's varlen kernel
            (TRL's padding-free collator); None: a padded ``[micro_batch_size,
            seq_len]`` batch.
        packed_boundaries: With ``packed_docs``, how the model gets the
            documents' boundaries: ``collator`` (among the inputs, TRL's
            padding-free collator) or ``positions`` (found from the position
            ids in every attention call: transformers'
            ``DataCollatorWithFlattening``).
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
    kbit_prepare: str | None = None
    quantize_lm_head: bool = False
    bnb_version: str | None = None
    quantized_from: str | None = None
    loss: LossImpl = LossImpl.HF
    logits_to_keep: int = 0
    loss_chunks: int = 8
    loss_chunk_upcast: bool = True
    outputs_to_fp32: bool = False
    offload_activations: ActivationOffload | None = None
    reference_model: bool = False
    target_len: int | None = None
    task: str | None = None
    checkpoint_every: int = 1
    checkpoint_reentrant: bool = False
    checkpoint_save_ops: str | None = None
    load: str = "direct"
    images: int | None = None
    freeze_vision: bool = False
    packed_docs: int | None = None
    packed_boundaries: str = "collator"

    def __post_init__(self) -> None:
        # The order of the steps is the order of the checks: a workload with
        # several bad options is refused for the first of them.
        self._check_packing()
        self._check_sizes()
        self._check_checkpointing()
        self._check_task_inputs()
        self._check_accumulation_limit()
        self._coerce_choices()
        self._check_quantization()
        self._check_cross_options()
        self._check_step_options()
        self._check_load()

    def _check_packing(self) -> None:
        """The packed-batch options: a known boundary source, and a document count the batch can hold."""
        from llmem_plugin.techniques.packing import BOUNDARIES

        if self.packed_boundaries not in BOUNDARIES:
            raise ConfigError(f"packed boundaries {self.packed_boundaries!r}; valid: {', '.join(BOUNDARIES)}. "
                              "HINT: pass --packed-boundaries collator or positions")
        if self.packed_boundaries != "collator" and self.packed_docs is None:
            raise ConfigError("--packed-boundaries applies to packed batches. HINT: add --packed-docs N, or drop "
                              "--packed-boundaries")
        if self.packed_docs is not None and (
                isinstance(self.packed_docs, bool) or not isinstance(self.packed_docs, int)
                or not 1 <= self.packed_docs <= self.micro_batch_size * self.seq_len):
            raise ConfigError(f"packed_docs must be an integer from 1 to the micro-batch's {self.micro_batch_size} x "
                              f"{self.seq_len} tokens, got {self.packed_docs!r}. HINT: pass --packed-docs N, the "
                              "documents in one packed micro-batch")

    def _check_sizes(self) -> None:
        """The counts that shape the step are positive integers."""
        for name, flag in (("seq_len", "--seq-len"), ("micro_batch_size", "--batch-size"),
                           ("grad_accum_steps", "--grad-accum")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}. HINT: pass {flag} N with N >= 1")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every <= 0:
            raise ConfigError(f"checkpoint_every must be a positive integer, got {self.checkpoint_every!r}. "
                              "HINT: pass --checkpoint-every K with K >= 1 (1: every layer)")

    def _check_checkpointing(self) -> None:
        """The checkpointing options need checkpointing on, and agree with each other;
        the save-ops spec is normalised (:mod:`llmem_plugin.techniques.checkpointing`)."""
        if self.checkpoint_every > 1 and not self.grad_checkpointing:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every} picks which layers gradient checkpointing "
                              "recomputes, but checkpointing is off. HINT: add --grad-checkpointing")
        if self.checkpoint_reentrant and not self.grad_checkpointing:
            raise ConfigError("--checkpoint-reentrant picks how checkpointed layers recompute, but checkpointing is "
                              "off. HINT: add --grad-checkpointing")
        if self.checkpoint_reentrant and self.checkpoint_save_ops is not None:
            # torch.utils.checkpoint: "Passing context_fn or debug is only supported when use_reentrant=False"
            raise ConfigError("--checkpoint-save-ops needs non-reentrant checkpointing (torch passes a context_fn "
                              "only with use_reentrant=False). HINT: drop --checkpoint-reentrant")
        if self.checkpoint_save_ops is not None:
            from llmem_plugin.techniques.checkpointing import parse_save_ops

            object.__setattr__(self, "checkpoint_save_ops", parse_save_ops(self.checkpoint_save_ops).spec)
            if not self.grad_checkpointing:
                raise ConfigError(f"--checkpoint-save-ops {self.checkpoint_save_ops} picks what checkpointed layers "
                                  "keep, but checkpointing is off. HINT: add --grad-checkpointing")

    def _check_task_inputs(self) -> None:
        """The image count and target length are positive; the task is one of :class:`Task`'s."""
        if self.images is not None and (
                isinstance(self.images, bool) or not isinstance(self.images, int) or self.images <= 0):
            raise ConfigError(f"images must be a positive integer, got {self.images!r}. "
                              "HINT: pass --images N with N >= 1 (vision-language models only)")
        if self.target_len is not None and (
                isinstance(self.target_len, bool) or not isinstance(self.target_len, int) or self.target_len <= 0):
            raise ConfigError(f"target_len must be a positive integer, got {self.target_len!r}. "
                              "HINT: pass --target-len N with N >= 1 (seq2seq models only)")
        if self.task is not None:
            object.__setattr__(self, "task", _choice(Task, self.task, "task", "--task").value)

    def _check_accumulation_limit(self) -> None:
        """``grad_accum_steps`` fits the int64 the loss is divided by (:data:`MAX_GRAD_ACCUM_STEPS`)."""
        if self.grad_accum_steps > MAX_GRAD_ACCUM_STEPS:
            raise ConfigError(
                f"grad_accum_steps {self.grad_accum_steps} exceeds {MAX_GRAD_ACCUM_STEPS:,}: the loss is divided "
                "by it as a 64-bit integer scalar. HINT: pass --grad-accum N with N <= 2**63 - 1")

    def _coerce_choices(self) -> None:
        """The LoRA spec and the named choices, from the names and forms the API takes."""
        object.__setattr__(self, "lora", LoraSpec.coerce(self.lora))
        object.__setattr__(self, "precision", parse_precision(self.precision))
        object.__setattr__(self, "optimizer", _choice(OptimizerKind, self.optimizer, "optimizer", "--optimizer"))
        object.__setattr__(
            self, "attn_implementation", _choice(AttentionImpl, self.attn_implementation, "attention", "--attn")
        )
        object.__setattr__(self, "runner", _choice(Runner, self.runner, "runner", "--runner"))
        object.__setattr__(self, "loss", _choice(LossImpl, self.loss, "loss", "--loss"))

    def _check_quantization(self) -> None:
        """The quantization options: LoRA over quantized weights, the k-bit preparation
        (filled in per recipe), the options of quantized weights only, the bitsandbytes release."""
        if self.quantize is not None:
            object.__setattr__(self, "quantize", _choice(Quantization, self.quantize, "quantization", "--quantize"))
            if self.lora is None:
                raise ConfigError(
                    f"--quantize {self.quantize.value} freezes the base weights (quantized weights take no "
                    "gradient), so it trains LoRA adapters only. HINT: add --lora-rank 16 (QLoRA)"
                )
        torchao = self.quantize is Quantization.NF4_TORCHAO
        if self.kbit_prepare is None:  # peft's QLoRA recipe prepares; torchtune's (torchao NF4) does not
            object.__setattr__(self, "kbit_prepare", "off" if torchao else "on")
        if torchao:
            self._check_torchao()
        if self.kbit_prepare not in _KBIT_PREPARE:
            raise ConfigError(f"unsupported k-bit preparation {self.kbit_prepare!r}; valid: "
                              f"{', '.join(_KBIT_PREPARE)}. HINT: pass --kbit-prepare with one of them")
        if self.kbit_prepare != "on" and self.quantize is None:
            raise ConfigError(f"--kbit-prepare {self.kbit_prepare} applies to quantized base weights. "
                              "HINT: add --quantize nf4 (QLoRA), or drop --kbit-prepare")
        if self.quantize is None:
            for name, flag, unset in (("quantize_lm_head", "--quantize-lm-head", False),
                                      ("quantized_from", "--quantized-from", None)):
                if getattr(self, name) != unset:
                    raise ConfigError(f"{flag} applies to quantized base weights. HINT: add --quantize nf4 "
                                      f"(QLoRA), or drop {flag}")
            # The release only matters with 4-bit weights (it is filled in when they are set, so a copy
            # of a QLoRA workload without them drops it); the CLI refuses --bnb-version alone.
            object.__setattr__(self, "bnb_version", None)
        elif not torchao:
            object.__setattr__(self, "bnb_version", resolve_bnb_version(self.bnb_version))
            if self.quantized_from is not None and self.quantized_from not in _QUANTIZED_FROM:
                raise ConfigError(f"--quantized-from {self.quantized_from!r} is not a dtype bitsandbytes quantizes "
                                  f"from; valid: {', '.join(_QUANTIZED_FROM)}. HINT: e.g. --quantized-from fp16")

    def _check_cross_options(self) -> None:
        """Options valid alone but not together: a quantized head under a loss that reads its
        weight, TRL's fused DPO loss on an odd batch, double quantization without 4-bit weights."""
        if self.quantize_lm_head and self.loss in (LossImpl.LIGER, LossImpl.CCE, LossImpl.TRL_FUSED):
            raise ConfigError(f"--loss {self.loss.value} multiplies by lm_head.weight itself, which --quantize-lm-head "
                              "packs into 4 bits. HINT: use --loss chunked or hf, or drop --quantize-lm-head")
        if self.reference_model and self.loss is LossImpl.TRL_FUSED and self.micro_batch_size % 2:
            raise ConfigError(f"--batch-size {self.micro_batch_size} is odd, but with --reference-model --loss "
                              "trl-fused it counts each pair's chosen and rejected rows (TRL's DPOTrainer). "
                              "HINT: pass --batch-size 2 x pairs")
        if self.double_quant and self.quantize not in (Quantization.NF4, Quantization.FP4):
            raise ConfigError("--double-quant applies to 4-bit weights only. HINT: pass --quantize nf4 or fp4")

    def _check_step_options(self) -> None:
        """What the forward keeps and returns: the activation offload, the loss's options,
        the output cast, the logits kept."""
        if self.offload_activations is not None:
            object.__setattr__(self, "offload_activations", _choice(
                ActivationOffload, self.offload_activations, "activation offload", "--offload-activations"))
        for name, flag, low in (("logits_to_keep", "--logits-to-keep", 0), ("loss_chunks", "--loss-chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}. HINT: pass {flag} N")
        if not self.loss_chunk_upcast and self.loss is not LossImpl.CHUNKED:
            raise ConfigError(f"--loss-chunk-upcast off applies to --loss chunked, not --loss {self.loss.value}. "
                              "HINT: add --loss chunked, or use --loss no-upcast for unchunked logits")
        if self.outputs_to_fp32 and self.runner in (Runner.HF_TRAINER, Runner.LIGHTNING):
            raise ConfigError(f"--outputs-to-fp32 models Lightning Fabric's output cast in a hand-written loop, not "
                              f"--runner {self.runner.value} (which casts as its own code does). "
                              "HINT: use --runner torch or plain-loop with --outputs-to-fp32")
        if self.logits_to_keep > self.seq_len:
            raise ConfigError(f"logits_to_keep {self.logits_to_keep} exceeds seq_len {self.seq_len}. "
                              "HINT: pass --logits-to-keep N with N <= --seq-len, or 0 for all tokens")

    def _check_load(self) -> None:
        """The load settings the setup phase models (:mod:`llmem_plugin.trace.loading`)."""
        if self.load not in _LOADS:
            raise ConfigError(f"unsupported load {self.load!r}; valid: {', '.join(_LOADS)}. HINT: pass --load with "
                              "one of them")
        if self.load == "fp32-cast" and self.quantize is not None:
            raise ConfigError("--load fp32-cast with --quantize: quantized models load through their quantizer, "
                              "not a cast. HINT: drop --load")
        if self.load == "torchtune-0.1" and self.quantize is not Quantization.NF4_TORCHAO:
            raise ConfigError("--load torchtune-0.1 is torchtune 0.1's QLoRA setup (torchao NF4). "
                              "HINT: add --quantize nf4-torchao, or drop --load")
        if self.load == "device-quantize" and (self.quantize is None or not self.quantize.bitsandbytes):
            raise ConfigError("--load device-quantize quantizes a 16-bit model on the GPU with bitsandbytes. "
                              "HINT: add --quantize nf4 or fp4, or drop --load")
        if self.load == "fp32-cast" and self.precision.param_dtype not in _HALF:
            raise ConfigError(f"--load fp32-cast casts the weights to a 16-bit dtype, but --precision "
                              f"{self.precision.value} trains in fp32. HINT: --precision bf16, or drop --load")

    def _check_torchao(self) -> None:
        """What torchtune's QLoRA (torchao NF4, llmem_plugin.techniques.nf4) does not take, refused in one line."""
        given = [flag for flag, on in (
            ("--double-quant", self.double_quant),  # to_nf4 always quantizes its block scalers
            (f"--kbit-prepare {self.kbit_prepare}", self.kbit_prepare != "off"),
            ("--quantize-lm-head", self.quantize_lm_head),  # the output projection stays nn.Linear
            (f"--quantized-from {self.quantized_from}", self.quantized_from is not None),
            (f"--bnb-version {self.bnb_version}", self.bnb_version is not None),
        ) if on]
        if given:
            raise ConfigError(
                f"{', '.join(given)} with --quantize nf4-torchao: torchtune's QLoRA quantizes the attention and "
                "MLP weights from the model's dtype with torchao's to_nf4 (its scalers quantized too), keeps the "
                "other weights in that dtype and runs no bitsandbytes. HINT: drop them")

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
                "adapter_dtype": self.lora.adapter_dtype,
            },
            "attn_implementation": self.attn_implementation.value,
            "runner": self.runner.value,
            "quantize": None if self.quantize is None else self.quantize.value,
            "double_quant": self.double_quant,
            "kbit_prepare": self.kbit_prepare,
            "quantize_lm_head": self.quantize_lm_head,
            "bnb_version": self.bnb_version,
            "quantized_from": self.quantized_from,
            "loss": self.loss.value,
            "logits_to_keep": self.logits_to_keep,
            "loss_chunks": self.loss_chunks,
            "loss_chunk_upcast": self.loss_chunk_upcast,
            "outputs_to_fp32": self.outputs_to_fp32,
            "offload_activations": None if self.offload_activations is None else self.offload_activations.value,
            "reference_model": self.reference_model,
            "target_len": self.target_len,
            "task": self.task,
            "checkpoint_every": self.checkpoint_every,
            "checkpoint_reentrant": self.checkpoint_reentrant,
            "checkpoint_save_ops": self.checkpoint_save_ops,
            "load": self.load,
            "images": self.images,
            "freeze_vision": self.freeze_vision,
            "packed_docs": self.packed_docs,
            "packed_boundaries": self.packed_boundaries,
        }
