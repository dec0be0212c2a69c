"""QLoRA: bitsandbytes 4-bit base weights under LoRA, as allocation-exact stand-ins.

:func:`quantize_model` replaces the linear layers that transformers' bitsandbytes
integration replaces with :class:`Linear4bitStandIn` modules whose parameter and
buffers have exactly the shapes and dtypes bitsandbytes keeps on the GPU, then
applies what ``peft.prepare_model_for_kbit_training`` does to the parameters.
Their forward and backward allocate what bitsandbytes' CUDA path allocates
(:class:`_MatMul4Bit`).

Sources (versions installed here):

* ``[T]`` transformers 5.23 ``integrations/bitsandbytes.py`` (``replace_with_bnb_linear``:
  every ``type(m) is nn.Linear`` or ``Conv1D`` not matched by
  ``quantizers_utils.should_convert_module``) and ``quantizers/quantizer_bnb_4bit.py``
  (``modules_to_not_convert`` = ``quantizers/base.get_keys_to_not_convert``: tied
  weights, the last parameter's module, the output embeddings; plus
  ``model._keep_in_fp32_modules``); ``utils/quantization_config.py``
  ``BitsAndBytesConfig`` (quant storage uint8 by default).
* ``[B]`` bitsandbytes 0.50.2 ``functional.py`` ``quantize_4bit`` / ``quantize_blockwise``,
  ``_ops.py`` (the fake kernels give the stored shapes), ``nn/modules.py``
  ``Params4bit`` (blocksize 64 when None) and ``Linear4bit.forward``.
* ``[P]`` peft 0.21.2 ``utils/other.py`` ``prepare_model_for_kbit_training`` and
  ``tuners/lora/bnb.py`` (the LoRA layer peft puts on a ``Linear4bit``).

Versions (``Workload.bnb_version``, read in the tagged sources of [B]):

* before 0.43.2, ``MatMul4Bit.forward`` keeps its input in ``ctx.tensors = (A, B)``
  (removed by PR #1270, commit 9e753741, "fix QLoRA mem bug: delete useless
  buffered activation"). ``ctx`` is a Python attribute of the autograd node, not a
  saved tensor, so backward does not release it: every 4-bit matmul's input lives
  until the graph's root (the loss) is dropped;
* before 0.50.0 there is no fused 4-bit GEMM for more than one row (PR #1949,
  commit 5453368b): ``matmul_4bit`` runs ``MatMul4Bit`` (``dequantize_4bit`` then
  ``F.linear``) for every training matmul, and ``gemv_4bit`` only for one row
  without gradient.

Known limitations:

* 8-bit LLM.int8 (outlier columns depend on the data) is refused, not modelled.
* Only the default uint8 quant storage (no FSDP/ZeRO-3 float storage).
* Before 0.42.0 the quant state kept no per-layer 16-entry code, and before
  0.46.0 double quantization shared one 256-entry map instead of a copy per
  layer; both are kept per layer (a few hundred bytes per layer over, the safe
  side). Loading's quantize transients follow 0.50.2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import BNB_NEWEST_READ, Precision, Quantization, Workload, resolve_bnb_version

__all__ = [
    "Linear4bitStandIn",
    "QuantSpec",
    "lora_custom_modules",
    "matmul_4bit",
    "quant_spec",
    "quantize_model",
    "stored_shapes",
    "adopt_live_lora",
    "live_quantization",
    "live_standins",
    "installed_bnb_version",
    "unsupported",
    "uses_fused_kernel",
    "bnb_modelled_as",
    "bnb_tuple",
]

# The bitsandbytes releases whose 4-bit training path was read ([B] tags 0.41.0 to
# 0.50.1, and the installed 0.50.2) are llmem_plugin.workload.BNB_OLDEST_READ to
# BNB_NEWEST_READ: Workload refuses older ones (resolve_bnb_version), newer ones
# are modelled as the newest read, which the report says.
# [B] PR #1270 (commit 9e753741, first tagged 0.43.2): MatMul4Bit stops keeping A.
_BNB_DROPS_INPUT = (0, 43, 2)
# [B] PR #1949 (commit 5453368b, first tagged 0.50.0): the fused 4-bit GEMM kernels.
_BNB_FUSED_GEMM = (0, 50, 0)


def installed_bnb_version() -> str | None:
    """The installed bitsandbytes release, read from its metadata without
    importing it (None when it is not installed): what a job in this
    environment runs, for the adapters."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitsandbytes")
    except PackageNotFoundError:
        return None


def bnb_tuple(text: str) -> tuple[int, int, int]:
    """``"0.42.0"`` -> ``(0, 42, 0)`` (a version :func:`llmem_plugin.workload.resolve_bnb_version` returned)."""
    major, minor, patch = (int(x) for x in text.split("."))
    return major, minor, patch


def bnb_modelled_as(text: str) -> str | None:
    """The version whose source stands in for ``text`` when it is newer than
    the newest read (None when ``text`` was read)."""
    return resolve_bnb_version(None) if bnb_tuple(text) > BNB_NEWEST_READ else None

# Workload.quantized_from's names for the dtypes quantize_4bit takes.
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# [B] nn/modules.py Params4bit.__new__: ``blocksize = 64`` when None, and
# transformers [T] creates Linear4bit without a blocksize.
BLOCKSIZE = 64
# [B] functional.py quantize_4bit: ``quantize_blockwise(_absmax - offset, blocksize=256)``.
NESTED_BLOCKSIZE = 256
# [B] functional.py get_4bit_type: 16 code values (fp32, ``torch.tensor`` of floats).
CODE_ENTRIES = 16
# [B] functional.py create_dynamic_map (the signed 8-bit dynamic map): 256 fp32 values,
# copied per quantization (``code.to(A.device, copy=True)`` in quantize_blockwise).
NESTED_CODE_ENTRIES = 256

# Methods that run QLoRA as the single-GPU step does: DDP replicates the
# frozen 4-bit model and all-reduces only the LoRA gradients.
_SUPPORTED_METHODS = ("single", "ddp")
_TENSOR_PARALLEL = ("tp", "dp-tp", "fsdp-tp", "hybrid")
_COLOSSAL = ("gemini", "lowlevel-zero1", "lowlevel-zero2")
_OFFLOAD = ("zero2-offload", "zero3-offload")
_FLOAT_STORAGE = ("fsdp", "hsdp", "zero3")


class QuantSpec:
    """How one workload quantizes: the bitsandbytes ``Linear4bit`` settings.

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: ``compress_statistics`` (``bnb_4bit_use_double_quant``).
        compute_dtype: ``bnb_4bit_compute_dtype``: the autocast dtype under
            mixed precision, bf16 for pure bf16, fp32 for fp32.
        quant_dtype: The dtype the weights had when quantized
            (``QuantState.dtype``, what ``dequantize_4bit`` returns). The
            QLoRA recipe loads the model in the compute dtype
            (``torch_dtype == bnb_4bit_compute_dtype``), so it is the same by
            default; Lightning's ``BitsandbytesPrecision`` quantizes from
            fp16 (``_Linear4bit.quantize``: ``weight.to(device, dtype=torch.half)``),
            so each dequantization is cast to the compute dtype.
        holds_input: The matmul keeps its input until the graph is dropped
            (bitsandbytes before 0.43.2).
        fused_kernels: The CUDA ``gemm_4bit`` may run its fused kernel
            (bitsandbytes 0.50.0 on).
    """

    def __init__(self, *, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                 bnb_version: str = resolve_bnb_version(None), quant_dtype: torch.dtype | None = None) -> None:
        self.quant_type = quant_type
        self.double_quant = double_quant
        self.compute_dtype = compute_dtype
        self.quant_dtype = compute_dtype if quant_dtype is None else quant_dtype
        v = bnb_tuple(bnb_version)
        self.holds_input = v < _BNB_DROPS_INPUT
        self.fused_kernels = v >= _BNB_FUSED_GEMM


def quant_spec(workload: Workload) -> QuantSpec:
    """The :class:`QuantSpec` of ``workload`` (which must quantize to 4 bits).

    Raises:
        ConfigError: int8, which is not modelled.
    """
    if workload.quantize is Quantization.INT8:
        raise ConfigError(_INT8_REASON)
    assert workload.quantize in (Quantization.NF4, Quantization.FP4), workload.quantize
    source = None if workload.quantized_from is None else _DTYPES[workload.quantized_from]
    return QuantSpec(quant_type=workload.quantize.value, double_quant=workload.double_quant,
                     compute_dtype=_compute_dtype(workload.precision), bnb_version=workload.bnb_version,
                     quant_dtype=source)


def _compute_dtype(p: Precision) -> torch.dtype:
    """``bnb_4bit_compute_dtype`` of a precision: its autocast dtype, bf16 for pure bf16, else fp32."""
    return p.autocast_dtype or (torch.bfloat16 if p is Precision.BF16 else torch.float32)


_INT8_REASON = (
    "--quantize int8 (bitsandbytes LLM.int8) is not modelled: its matmul splits out outlier columns "
    "whose number depends on the data. HINT: use --quantize nf4 (QLoRA) instead"
)


def stored_shapes(out_features: int, in_features: int, *, double_quant: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What bitsandbytes stores on the GPU for one 4-bit ``(out, in)`` weight.

    Every tensor lives on the GPU in a CUDA run (``Params4bit._quantize``
    moves the weight to the device and quantizes it there, so the
    ``QuantState`` tensors are created on the device too).

    Args:
        out_features: Rows of the weight.
        in_features: Columns of the weight.
        double_quant: Whether the absmax statistics are quantized too.

    Returns:
        Name -> (shape, dtype), with the names of the stand-in's tensors.
    """
    n = out_features * in_features
    blocks = math.ceil(n / BLOCKSIZE)
    # [B] _ops.py quantize_4bit fake: ((n + 1) // (itemsize * 2), 1) of quant_storage
    # (uint8: two 4-bit values per byte), absmax fp32 of ceil(n / blocksize).
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"weight": (((n + 1) // 2, 1), torch.uint8)}
    shapes["quant_code"] = ((CODE_ENTRIES,), torch.float32)
    if not double_quant:
        shapes["absmax"] = ((blocks,), torch.float32)
        return shapes
    # [B] _ops.py quantize_blockwise fake: out = empty_like(A, uint8), absmax fp32
    # of ceil(blocks / 256); functional.py: offset = _absmax.mean() (0-dim fp32).
    shapes["absmax"] = ((blocks,), torch.uint8)
    shapes["nested_absmax"] = ((math.ceil(blocks / NESTED_BLOCKSIZE),), torch.float32)
    shapes["nested_code"] = ((NESTED_CODE_ENTRIES,), torch.float32)
    shapes["absmax_offset"] = ((), torch.float32)
    return shapes


class Linear4bitStandIn(nn.Linear):
    """A ``bitsandbytes.nn.Linear4bit`` with its device tensors as parameter and buffers.

    Subclasses ``nn.Linear`` as ``Linear4bit`` does (peft's ``all-linear``
    and target checks see a linear layer). ``weight`` is the packed frozen
    ``Params4bit``; the ``QuantState`` tensors are buffers so that the trace
    registers them as model memory.

    Known limitations:
        The bias, when present, is kept in the compute dtype: ``Linear4bit.forward``
        casts ``bias.data`` to the input's compute dtype in place on its first call.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, spec: QuantSpec,
                 device: torch.device | str) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.quant_type = spec.quant_type
        self.double_quant = spec.double_quant
        self.compute_dtype = spec.compute_dtype
        self.quant_dtype = spec.quant_dtype
        self.holds_input = spec.holds_input
        self.fused_kernels = spec.fused_kernels
        self.blocksize = BLOCKSIZE
        shapes = stored_shapes(out_features, in_features, double_quant=spec.double_quant)
        weight_shape, weight_dtype = shapes.pop("weight")
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=weight_dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=spec.compute_dtype, device=device),
                                  requires_grad=False) if bias else None)
        for name, (shape, dtype) in shapes.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))

    @classmethod
    def from_linear(cls, module: nn.Module, spec: QuantSpec) -> Linear4bitStandIn:
        """Replace ``module`` (``nn.Linear`` or transformers ``Conv1D``); a real
        weight is quantized with bitsandbytes, a meta one only shaped."""
        weight = module.weight
        if isinstance(module, nn.Linear):
            in_features, out_features = module.in_features, module.out_features
        else:  # Conv1D stores (in, out); [T] transposes it before quantizing.
            in_features, out_features = weight.shape
            weight = weight.t()
        new = cls(in_features, out_features, bias=module.bias is not None, spec=spec, device=weight.device)
        if weight.device.type != "meta":
            new._quantize_from(weight.detach(), module.bias)
        return new

    def _quantize_from(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        try:
            import bitsandbytes.functional as bnbf
        except ImportError:
            raise ImportError("quantizing real weights needs bitsandbytes: pip install bitsandbytes") from None
        packed, state = bnbf.quantize_4bit(
            weight.contiguous().to(self.quant_dtype), blocksize=self.blocksize,
            compress_statistics=self.double_quant, quant_type=self.quant_type,
        )
        with torch.no_grad():
            self.weight.copy_(packed)
            self.quant_code.copy_(state.code)
            self.absmax.copy_(state.absmax)
            if self.double_quant:
                self.nested_absmax.copy_(state.state2.absmax)
                self.nested_code.copy_(state.state2.code)
                self.absmax_offset.copy_(state.offset)
            if bias is not None:
                self.bias.copy_(bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [B] nn/modules.py Linear4bit.forward: input cast to compute_dtype,
        # matmul_4bit, output cast back to the input's dtype.
        inp_dtype = x.dtype
        out = matmul_4bit(x.to(self.compute_dtype), self)
        return out.to(inp_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"quant_type={self.quant_type}, double_quant={self.double_quant}")


def _keys_to_not_convert(model: nn.Module, *, quantize_lm_head: bool = False) -> list[str]:
    """transformers' own ``modules_to_not_convert`` for ``model`` ([T]).

    With ``quantize_lm_head`` the default skips (tied weights, the last
    module, the output embeddings) are dropped, as ``llm_int8_skip_modules=[]``
    does in ``get_modules_to_not_convert``; ``_keep_in_fp32_modules`` stay.
    """
    from transformers import PreTrainedModel
    from transformers.quantizers.base import get_keys_to_not_convert

    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            f"--quantize needs a transformers model (bitsandbytes quantization is applied by "
            f"from_pretrained), not {type(model).__name__}. HINT: pass a catalog name or a config.json"
        )
    if quantize_lm_head:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if type(head) is not nn.Linear:
            raise ConfigError(f"--quantize-lm-head: {type(model).__name__} has no nn.Linear output head to "
                              "quantize. HINT: drop --quantize-lm-head")
        if embed is not None and head.weight is getattr(embed, "weight", None):
            raise ConfigError(f"--quantize-lm-head: {type(model).__name__}'s head shares its weight with the input "
                              "embeddings (tie_word_embeddings), which stay 16-bit. HINT: set tie_word_embeddings "
                              "false in the config (a recipe whose head is a separate matrix), or drop "
                              "--quantize-lm-head")
        keys = []
    else:
        keys = list(get_keys_to_not_convert(model))
    keys.extend(getattr(model, "_keep_in_fp32_modules", None) or [])
    return sorted(set(keys))


def quantize_model(model: nn.Module, workload: Workload) -> nn.Module:
    """Quantize ``model``'s linear layers as transformers + bitsandbytes do,
    then apply ``prepare_model_for_kbit_training``'s parameter changes
    (``workload.kbit_prepare``: all of them, or none when the recipe skips it).

    Called on the meta model (or a real CPU model, whose weights are then
    really quantized), before gradient checkpointing and LoRA.

    ``prepare_model_for_kbit_training`` ([P]) freezes every parameter and
    casts every fp16/bf16 parameter that is not a ``Params4bit`` to fp32
    (embeddings, norms, the LM head: why QLoRA can hold more than LoRA in
    pure bf16). Its gradient-checkpointing default is not applied:
    ``workload.grad_checkpointing`` stays the switch, as when a trainer
    passes its own setting (TRL's ``SFTTrainer`` passes
    ``args.gradient_checkpointing``); with the non-reentrant checkpointing
    used here peft adds no input-gradient hook either ([P]: only when
    ``use_reentrant`` is unset or True).

    Args:
        model: A transformers causal LM.
        workload: Its ``quantize``, ``double_quant`` and ``precision``.

    Returns:
        The same model, modified in place.

    Raises:
        ConfigError: int8, a non-transformers model, or no linear layer to quantize.
    """
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = _keys_to_not_convert(model, quantize_lm_head=workload.quantize_lm_head)
    targets = [(name, m) for name, m in model.named_modules()
               if (type(m) is nn.Linear or isinstance(m, Conv1D)) and should_convert_module(name, skip)]
    if not targets:
        raise ConfigError(f"{type(model).__name__} has no linear layer to quantize. HINT: drop --quantize")
    if workload.quantize is Quantization.NF4_TORCHAO:
        # torchtune quantizes the decoder's linear layers and keeps the output projection (and
        # everything else) in the model's dtype: the same set transformers' skip list leaves.
        from llmem_plugin.techniques.nf4 import quantize_nf4_torchao

        quantize_nf4_torchao(model, targets)
        return model
    spec = quant_spec(workload)
    for name, m in targets:
        model.set_submodule(name, Linear4bitStandIn.from_linear(m, spec))
    # A 4-bit layer's bias is upcast too, but Linear4bit.forward casts it back
    # to the compute dtype on the first call: the stand-in keeps that steady state.
    kept = {id(m.bias) for m in model.modules() if isinstance(m, Linear4bitStandIn) and m.bias is not None}
    upcast = _upcast_parameters(model, workload.kbit_prepare)
    for p in model.parameters():
        p.requires_grad_(False)
        if p.dtype in (torch.float16, torch.bfloat16) and id(p) not in kept and id(p) in upcast:
            p.data = p.data.to(torch.float32)
    # peft checks these to treat the model as a k-bit one ([P]).
    model.is_loaded_in_4bit = True
    return model


def _upcast_parameters(model: nn.Module, prepare: str) -> set[int]:
    """The parameters k-bit preparation casts to fp32 (by ``id``).

    ``on``: all of them, as ``prepare_model_for_kbit_training`` does ([P]);
    ``off``: none (a recipe that skips it keeps the loaded dtype);
    ``norms-only``: the parameters of the normalization layers (modules whose
    class name ends in ``Norm``: ``LlamaRMSNorm``, ``LayerNorm``, ...).
    """
    if prepare == "on":
        return {id(p) for p in model.parameters()}
    if prepare == "norms-only":
        return {id(p) for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
    return set()


def _is_norm(m: nn.Module) -> bool:
    """A normalization layer, for ``norms-only`` preparation (``LlamaRMSNorm``, ``LayerNorm``, ...)."""
    return type(m).__name__.endswith("Norm")


# ----------------------------------------------------------------------------- a live quantized model



def _is_live_4bit(m: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` (or a subclass: Lightning's) with its weight
    quantized: the module that owns the ``Params4bit`` (not a peft layer that reaches it)."""
    weight = m._parameters.get("weight")
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def live_quantization(model: nn.Module) -> dict | None:
    """The :class:`~llmem_plugin.workload.Workload` fields a live model's
    bitsandbytes 4-bit layers imply, read from their quant states, or None
    when it has none.

    ``quantize`` and ``double_quant`` from ``QuantState.quant_type`` and
    ``nested``; ``quantized_from`` from ``QuantState.dtype`` where it is not
    the layer's compute dtype; ``quantize_lm_head`` when the output head is
    one of them; ``kbit_prepare`` from the other parameters' dtypes (all
    fp32: ``on``; only the norms': ``norms-only``; else ``off``); and
    ``bnb_version``, the installed release (the live model runs it).
    """
    layers = [m for m in model.modules() if _is_live_4bit(m)]
    if not layers:
        return None
    states = [m.weight.quant_state for m in layers]
    kinds = {(qs.quant_type, bool(qs.nested), qs.dtype) for qs in states}
    if len(kinds) > 1:
        from llmem_plugin.errors import UnsupportedError

        raise UnsupportedError(f"the live model's 4-bit layers mix quantizations {sorted(map(str, kinds))}; "
                               "one per model is modelled. HINT: estimate the recipe from its config")
    quant_type, nested, source = kinds.pop()
    compute = layers[0].compute_dtype
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None and hasattr(model, "get_base_model"):
        head = getattr(model.get_base_model(), "get_output_embeddings", lambda: None)()
    head = getattr(head, "base_layer", head)  # peft wraps a targeted head
    packed = {id(m.weight) for m in layers}
    lora = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    others = [(mod, p) for mod in model.modules() for p in mod.parameters(recurse=False)
              if p.is_floating_point() and id(p) not in packed and id(p) not in lora]
    fp32 = [(mod, p) for mod, p in others if p.dtype == torch.float32]
    if others and len(fp32) == len(others) and source != torch.float32:
        prepare = "on"
    elif fp32 and all(_is_norm(mod) for mod, _ in fp32):
        prepare = "norms-only"
    else:
        prepare = "off"
    return {"quantize": quant_type, "double_quant": nested, "quantize_lm_head": head is not None and _is_live_4bit(head),
            "quantized_from": None if compute is None or source == compute else _DTYPE_NAMES.get(source),
            "kbit_prepare": prepare, "bnb_version": installed_bnb_version()}


def live_standins(model: nn.Module, workload: Workload) -> dict[int, nn.Module]:
    """``id(layer) -> stand-in on the meta device`` for every bitsandbytes
    4-bit layer of a live model (a ``copy.deepcopy`` memo): the stand-in
    stores what the layer's quant state stores, in its compute dtype (the
    workload's where bitsandbytes has not set one yet, as ``Linear4bit``
    sets it from the first input), for the workload's bitsandbytes release."""
    standins = {}
    for m in model.modules():
        if not _is_live_4bit(m):
            continue
        qs = m.weight.quant_state
        out_features, in_features = qs.shape
        compute = m.compute_dtype or _compute_dtype(workload.precision)
        spec = QuantSpec(quant_type=qs.quant_type, double_quant=bool(qs.nested), compute_dtype=compute,
                         bnb_version=workload.bnb_version or resolve_bnb_version(None), quant_dtype=qs.dtype)
        new = Linear4bitStandIn(in_features, out_features, bias=m.bias is not None, spec=spec, device="meta")
        if m.bias is not None:
            new.bias = nn.Parameter(torch.empty(m.bias.shape, dtype=m.bias.dtype, device="meta"),
                                    requires_grad=m.bias.requires_grad)
        standins[id(m)] = new
    return standins


def adopt_live_lora(model: nn.Module) -> None:
    """Give the peft LoRA layers of a live 4-bit model (peft's
    ``tuners/lora/bnb.py`` ``Linear4bit``, whose base is now a stand-in) the
    stand-ins' LoRA forward, which asks the input's device for autocast as
    the trace runs it (peft asks CUDA's)."""
    import types

    for m in model.modules():
        if isinstance(getattr(m, "base_layer", None), Linear4bitStandIn) and hasattr(m, "lora_A"):
            m.forward = types.MethodType(_lora_forward, m)


def lora_custom_modules(model: nn.Module) -> dict[type[nn.Module], type[nn.Module]]:
    """The peft ``LoraConfig._register_custom_module`` mapping ``model`` needs:
    stand-ins take the LoRA layer peft gives a bitsandbytes ``Linear4bit``."""
    if not any(isinstance(m, Linear4bitStandIn) for m in model.modules()):
        return {}
    return {Linear4bitStandIn: _lora_layer_class()}


def unsupported(method: str, workload: Workload) -> str | None:
    """Why ``method`` cannot run ``workload``'s quantization, or None.

    Args:
        method: ``"single"`` or a ``methods.method_names()`` entry.
        workload: The workload.

    Returns:
        One sentence with a HINT, or None when the combination is modelled.
    """
    if workload.quantize is None:
        return None
    q = workload.quantize.value
    if workload.quantize is Quantization.INT8:
        return _INT8_REASON
    if workload.quantize is Quantization.NF4_TORCHAO:
        return None if method == "single" else (
            f"--quantize {q} with --method {method} is not modelled: torchtune's distributed QLoRA shards "
            "NF4 weights with FSDP2, which this estimate does not. HINT: estimate one GPU (no --method)")
    if method in _SUPPORTED_METHODS:
        return None
    if method in _TENSOR_PARALLEL:
        return (f"--quantize {q} with --method {method} is not supported: tensor parallelism cannot split "
                "bitsandbytes' packed 4-bit weights. HINT: use --method ddp, or drop --quantize")
    if method in _COLOSSAL:
        return (f"--quantize {q} with --method {method} is not supported: ColossalAI plugins do not shard "
                "bitsandbytes 4-bit weights. HINT: use --method ddp, or drop --quantize")
    if method in _OFFLOAD:
        return (f"--quantize {q} with --method {method} is not modelled: offloading a QLoRA model moves only "
                "the small LoRA optimizer states. HINT: use --method ddp")
    if method in _FLOAT_STORAGE:
        return (f"--quantize {q} with --method {method} is not modelled: sharding QLoRA needs a float quant "
                "storage (bnb_4bit_quant_storage=bf16) that this estimate does not shard. HINT: use --method ddp")
    return (f"--quantize {q} with --method {method} is not modelled (only single-GPU and DDP QLoRA are). "
            "HINT: use --method ddp, or drop --quantize")


# ----------------------------------------------------------------------------- the CUDA matmul

# [B] backends/cuda/ops.py (CUDA builds): gemm_4bit takes the dequantize +
# F.linear fallback past ``_gemm_4bit_custom_max_m`` rows, and always runs the
# fused kernel up to ``_GEMM_4BIT_CUSTOM_FLOOR_M`` rows; in between
# ``_gemm_4bit_use_custom_cuda`` decides, with the small-weight tiers below
# ``N * K < 4 * 1024 * 1024``.
_CUSTOM_MAX_M = 1536
_CUSTOM_FLOOR_M = 4
_SMALL_WEIGHT = 4 * 1024 * 1024
_N_TILE = 64  # n_blocks = (N + 63) // 64


def uses_fused_kernel(m: int, n: int, k: int, dtype: torch.dtype, *, compute_capability: tuple[int, int],
                      num_sms: int) -> bool:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` runs its fused kernel (which
    allocates only its output) instead of dequantize + ``F.linear``.

    Follows ``_gemm_4bit_use_custom_cuda`` ([B] backends/cuda/ops.py) for
    sm80, sm90 and sm100.

    Args:
        m: Rows of the input (tokens), ``n``/``k``: the weight's (out, in).
        dtype: The compute dtype.
        compute_capability: The GPU's ``(major, minor)``.
        num_sms: Its multiprocessor count.

    Raises:
        UnsupportedError: another GPU, at 5-1536 rows (its tiers are not modelled).
    """
    from llmem_plugin.errors import UnsupportedError

    if m > _CUSTOM_MAX_M or k % BLOCKSIZE:
        return False
    if m <= _CUSTOM_FLOOR_M:
        return True
    major, minor = compute_capability
    if dtype == torch.float32:  # no MMA kernel in fp32: SIMT wins below 8 rows only
        return m < 8
    n_blocks = (n + _N_TILE - 1) // _N_TILE
    if major == 10:
        if n_blocks >= num_sms * 3:
            return m <= 32
        if n_blocks >= num_sms:
            return False if k >= n else m <= 8
        return False
    sm80 = (major, minor) == (8, 0)
    if not (sm80 or major == 9):
        raise UnsupportedError(
            f"bitsandbytes' 4-bit matmul kernel choice is not modelled for compute capability "
            f"{major}.{minor} at {m} tokens. HINT: use an A100, H100/H200 or B200, or seq_len*batch > {_CUSTOM_MAX_M}")
    if n * k < _SMALL_WEIGHT:
        if 2 * k < n:  # very short K: calibrated M caps, by wave occupancy
            low_wave = n_blocks * 3 < num_sms
            if sm80:
                return m <= (1536 if low_wave else 512)
            return m <= (512 if low_wave else 320)
        quarter_wave = n_blocks * 4 <= num_sms
        if sm80 and quarter_wave:
            if k >= n:
                return m <= (32 if n_blocks * 8 <= num_sms else 128)
            return m <= 384
        if quarter_wave:
            return m <= 32
        if n_blocks * 2 <= num_sms:
            return m <= 16
        return False
    if m > 512:
        return False
    if m < 8:  # SIMT wins, except some HBM occupancy bands at 6-7 rows
        if m >= 6 and n_blocks >= (48 if sm80 else 36):
            lt_75, lt_60 = n_blocks * 4 < num_sms * 3, n_blocks * 5 < num_sms * 3
            if k > n and lt_75:
                return False
            if k == n and ((sm80 and lt_60) or (not sm80 and lt_75 and not lt_60)):
                return False
        return True
    if sm80:  # 8-512 rows: the A100 ladder
        if n_blocks >= num_sms * 3:
            return m <= 128
        if n_blocks >= num_sms:
            return m <= (64 if k < n else 32)
        if k >= n * 3 and n_blocks * 4 > num_sms:
            return False
        if k == n and n_blocks >= 48 and n_blocks * 5 < num_sms * 3:
            return False
        if n_blocks * 2 < num_sms:
            if k <= n:
                return m <= 128
            if n_blocks * 3 >= num_sms:
                return False
        if n_blocks >= num_sms // 2 and k < n:
            return m <= 128
        return m <= 16
    # 8-512 rows: the H100/H200 ladder.
    for waves, cap in ((3, 64), (2, 48), (1, 32)):
        if n_blocks >= num_sms * waves:
            return m <= cap
    if n_blocks >= num_sms // 2:
        if k >= n and n_blocks * 4 < num_sms * 3:
            return False
        return m <= 16
    return False


def _target() -> tuple[tuple[int, int], int]:
    """The emulated GPU's compute capability and SM count (set by the trace)."""
    from llmem_plugin.trace.emulation import sdpa

    t = sdpa._active_target
    return t.compute_capability, t.num_sms


def _dequantized(layer: Linear4bitStandIn) -> torch.Tensor:
    """The real dequantized weight (for values only: call untracked)."""
    import bitsandbytes.functional as bnbf

    state2 = None
    if layer.double_quant:
        state2 = bnbf.QuantState(absmax=layer.nested_absmax, code=layer.nested_code,
                                 blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
    state = bnbf.QuantState(
        absmax=layer.absmax, shape=torch.Size((layer.out_features, layer.in_features)), code=layer.quant_code,
        blocksize=layer.blocksize, quant_type=layer.quant_type, dtype=layer.quant_dtype,
        offset=layer.absmax_offset if layer.double_quant else None, state2=state2,
    )
    return bnbf.dequantize_4bit(layer.weight, state)


def _cublas_call() -> None:
    """The emulated kernel calls cuBLAS here, after its output: a thread's first call creates the
    handle's workspace there (:func:`llmem_plugin.trace.emulation.kernels.cublas_call`)."""
    from llmem_plugin.trace.emulation.kernels import cublas_call

    cublas_call()


def _fill(out: torch.Tensor, compute) -> None:
    """On real tensors, copy the untracked ``compute()`` into ``out``."""
    from torch._subclasses.fake_tensor import FakeTensor

    from llmem_plugin.trace._pause import untracked

    if isinstance(out, FakeTensor):
        return
    with untracked():
        value = compute()
    out.copy_(value)
    del value


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` ([B] autograd/_functions.py) with the CUDA
    kernels' allocations: nothing is saved for backward but the packed weight
    (a parameter), and, before 0.43.2, the input in ``ctx`` (see the module
    docstring); the backward dequantizes again for the input gradient."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, layer: Linear4bitStandIn) -> torch.Tensor:
        ctx.layer = layer
        if layer.holds_input and not isinstance(ctx, _NoCtx):
            # [B] < 0.43.2: ``ctx.tensors = (A, B)`` when an input needs a gradient
            # (the only case a graph node, and so this ctx, outlives the call).
            ctx.held_input = a
        if not layer.fused_kernels:
            return _dequantize_then_linear(a, layer)
        n, k = layer.out_features, layer.in_features
        cc, sms = _target()
        shape = (*a.shape[:-1], n)
        bias = layer.bias
        if uses_fused_kernel(a.numel() // k, n, k, a.dtype, compute_capability=cc, num_sms=sms):
            a = a.contiguous()  # _gemm_4bit_kernel_impl reads A row-major
            out = torch.empty(shape, dtype=a.dtype, device=a.device)
            _fill(out, lambda: torch.nn.functional.linear(a, _dequantized(layer).to(a.dtype), bias))
            return out
        # _dequant_linear_fallback: rebuild the nested absmax (fp32, then + offset),
        # dequantize into B_dq (N, K) of A's dtype, F.linear; all freed on return.
        blocks = layer.absmax.numel()
        nested = []
        if layer.double_quant:
            nested = [torch.empty(blocks, dtype=torch.float32, device=a.device) for _ in range(2)]
        w = torch.empty((n, k), dtype=a.dtype, device=a.device)
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
        _cublas_call()  # F.linear's
        _fill(out, lambda: torch.nn.functional.linear(a, _dequantized(layer).to(a.dtype), bias))
        del w, nested
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        layer = ctx.layer
        w = _dequantize_4bit_to(layer, grad_output.dtype, grad_output.device)
        g = grad_output.contiguous()  # matmul folds a contiguous (.., N) grad into one mm
        grad_a = torch.empty((*g.shape[:-1], layer.in_features), dtype=g.dtype, device=g.device)
        _cublas_call()  # the matmul's
        _fill(grad_a, lambda: torch.matmul(g, _dequantized(layer).to(g.dtype)))
        del w
        return grad_a, None


def _dequantize_4bit_to(layer: Linear4bitStandIn, dtype: torch.dtype, device) -> torch.Tensor:
    """``F.dequantize_4bit(B, state).to(dtype)`` ([B] functional.py, every release
    read): the nested absmax dequantized into one fp32 tensor
    (``dequantize_blockwise``, then ``+= offset`` in place), freed when it
    returns; the weight in ``QuantState.dtype``; ``.to`` copies it when that
    is not ``dtype`` (the dequantized one is released as ``.to`` returns)."""
    absmax = (torch.empty(layer.absmax.numel(), dtype=torch.float32, device=device)
              if layer.double_quant else None)
    w = torch.empty((layer.out_features, layer.in_features), dtype=layer.quant_dtype, device=device)
    del absmax
    if w.dtype != dtype:
        w = torch.empty(w.shape, dtype=dtype, device=device)
    return w


def _dequantize_then_linear(a: torch.Tensor, layer: Linear4bitStandIn) -> torch.Tensor:
    """bitsandbytes before 0.50.0 ([B] 0.41.0-0.49.2 ``MatMul4Bit.forward``):
    ``F.linear(A, F.dequantize_4bit(B, state).to(A.dtype).t(), bias)``; the
    weight is freed once ``F.linear`` returns."""
    w = _dequantize_4bit_to(layer, a.dtype, a.device)
    out = torch.empty((*a.shape[:-1], layer.out_features), dtype=a.dtype, device=a.device)
    _cublas_call()  # F.linear's
    _fill(out, lambda: torch.nn.functional.linear(a, _dequantized(layer).to(a.dtype), layer.bias))
    del w
    return out


def matmul_4bit(a: torch.Tensor, layer: Linear4bitStandIn) -> torch.Tensor:
    """``bitsandbytes.matmul_4bit(a, layer.weight, quant_state)`` with its CUDA allocations.

    Without a gradient to track ([B] matmul_4bit ``needs_grad``) the same
    ``gemm_4bit`` runs outside autograd; the allocations are the forward's.
    Before 0.50.0 one row without gradient runs ``gemv_4bit`` (the nested
    absmax dequantized, then the output); everything else ``MatMul4Bit``.
    """
    if torch.is_grad_enabled() and a.requires_grad:
        return _MatMul4Bit.apply(a, layer)
    if not layer.fused_kernels and a.numel() == a.shape[-1] and a.shape[-1] % layer.blocksize == 0:
        absmax = (torch.empty(layer.absmax.numel(), dtype=torch.float32, device=a.device)
                  if layer.double_quant else None)
        out = torch.empty((*a.shape[:-1], layer.out_features), dtype=a.dtype, device=a.device)
        _fill(out, lambda: torch.nn.functional.linear(a, _dequantized(layer).to(a.dtype), layer.bias))
        del absmax
        return out
    with torch.no_grad():
        return _MatMul4Bit.forward(_NoCtx(), a, layer)


class _NoCtx:
    """A stand-in ``ctx`` for the no-grad call of the forward."""


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's LoRA forward on a bitsandbytes ``Linear4bit`` ([P] tuners/lora/bnb.py).

    The base output is cloned (peft does it defensively for 4-bit); inputs are
    cast to the adapter dtype, and the adapter output back, only outside
    autocast. peft asks ``torch.is_autocast_enabled()`` (CUDA's region); the
    trace's region is CPU autocast, so the input's device type is asked.
    """
    from llmem_plugin.errors import UnsupportedError

    self._check_forward_args(x, *args, **kwargs)
    if kwargs.get("adapter_names") is not None:
        raise UnsupportedError("mixed-adapter batches on 4-bit layers are not modelled. HINT: use one adapter")
    if self.disable_adapters or self.merged:
        return self.base_layer(x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs).clone()
    convert = not torch.is_autocast_enabled(x.device.type)
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        if name in self.lora_variant:
            raise UnsupportedError("LoRA variants (DoRA, aLoRA) on 4-bit layers are not modelled. HINT: plain LoRA")
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if convert:
            expected = result.dtype
            x = self._cast_input_dtype(x, lora_a.weight.dtype)
        output = lora_b(lora_a(self.lora_dropout[name](x))) * self.scaling[name]
        if convert:
            output = output.to(expected)
        result = result + output
    return result


_LORA_CLASS: list[type[nn.Module]] = []


def _lora_layer_class() -> type[nn.Module]:
    """peft's default LoRA ``Linear`` with the 4-bit forward (built once)."""
    if not _LORA_CLASS:
        from peft.tuners.lora.layer import Linear as LoraLinear

        _LORA_CLASS.append(type("Lora4bitLinear", (LoraLinear,), {"forward": _lora_forward,
                                                                 "__module__": __name__}))
    return _LORA_CLASS[0]
