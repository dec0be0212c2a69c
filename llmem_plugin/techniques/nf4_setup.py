"""The setup phase of torchtune's QLoRA: torchao's ``to_nf4`` as torchtune builds and loads the model.

torchtune makes the model on the GPU in the training dtype and only then
loads the checkpoint, so every NF4 weight is quantized on the GPU at least
twice, and each quantization's temporaries pass through the caching
allocator. Two flows are read (``Workload.load``):

``direct`` (torchtune 0.6.1 with torchao 0.18.0, the newest read)
    ``lora_finetune_single_device.py _setup_model``: under
    ``set_default_dtype(bf16)`` and the device, the builder makes each decoder
    layer in a loop (``lora_llama2``: attention q, k, v, output, then MLP w1
    (gate), w2 (down), w3 (up), then the two norms), then the embeddings, the
    output projection and the final norm. ``LoRALinear.__init__`` makes a
    16-bit ``nn.Linear``, quantizes its weight with ``to_nf4``, makes the
    adapters, and drops the 16-bit weight when it returns. Then
    ``model.load_state_dict`` (the checkpoint on the CPU): torchao's NF4
    ``copy_`` quantizes ``copy_in.to(device)`` into a new ``NF4Tensor`` and
    copies its tensors into the weight's own; the 16-bit copy and the new
    tensor are released.
``torchtune-0.1`` (torchtune 0.1.x, which pins torchao 0.1)
    The builder makes ONE decoder layer and ``TransformerDecoder`` deep-copies
    it per layer (``_get_clones``); copying an NF4 parameter runs torchtune's
    ``clone`` override, ``to_nf4(get_original_weight())``: each copy
    dequantizes and re-quantizes. The prototype layer is dropped when the
    builder returns. ``load_state_dict`` runs torchtune's ``inplace_copy``
    override: ``to_nf4(src.to(device))``, whose tensors then replace the
    weight's own (the old ones released). torchao 0.1's ``to_nf4`` compares
    every element with the 16 NF4 values at once (no chunks): two
    ``numel x 16`` temporaries, 32 bytes per bf16 weight element each, and
    its ``quantization_factor`` is a view of the full per-block tensor.

Sources:

* [A] torchao 0.18.0 ``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py``
  (``from_tensor``, ``double_quantize_scalers``, ``get_block_absmax``,
  ``convert_to_norm_float_weight``, ``quantize_tensor_nearest``, ``copy_``,
  ``CHUNK_SIZE = 1024**2``).
* [A01] torchao v0.1 (tag, ff28895) ``torchao/dtypes/nf4tensor.py``: the same
  functions without chunks (chunks came with ao #196, 2024-05-01, torchao 0.2)
  and without ``.contiguous()`` on the factor (ao #298, 2024-05-31).
* [T] torchtune 0.6.1 ``recipes/lora_finetune_single_device.py``,
  ``torchtune/models/llama2/_component_builders.py``,
  ``torchtune/modules/peft/lora.py``.
* [T01] torchtune at 0914d5cf (the QLoRA tutorial, before v0.1.0; ``torchao==0.1``
  in its pyproject.toml): ``torchtune/utils/_register_nf4_dispatch_ops.py``
  (``clone``, ``inplace_copy``), ``torchtune/modules/transformer.py``
  (``_get_clones``: ``copy.deepcopy``), ``torchtune/modules/peft/lora.py``
  (``_create_weight_and_bias``: the 16-bit ``nn.Linear`` is a local, dropped
  before the adapters are made).

Checks: tests/techniques/test_nf4_setup.py (the replay against torchao
0.18.0's and torchao 0.1's own conversion on real CPU tensors, event for
event; the closed forms of both releases' peaks; the stored bytes; the
torchtune QLoRA tutorial's 9.13 GB after init), tests/stub/test_nf4_setup.py
(torchao's ``to_nf4`` and torchtune 0.6.1's own builder and
``load_state_dict`` on the stub device, both peaks to the byte).

The model is transformers' class of the architecture; torchtune's own RoPE
module and its buffers (``theta`` and a fp32 cos/sin cache of
``max_position_embeddings x head_dim/2 x 2``: 2 MiB per layer for Llama-2-7B)
are made here too, per layer or, with llama3 rope scaling, once (the
builders differ: see :func:`_rope_layout`), and live as long as the model.

Known limitations: the RoPE module's own operations are torchtune's
``RotaryPositionalEmbeddings`` for every family (``Llama3ScaledRoPE`` and
Qwen2's make the same buffers with a few more small temporaries); the
checkpoint is taken to hold the training dtype (a 16-bit checkpoint of the
other 16-bit dtype has the same size); models whose layers torchtune names
differently keep transformers' order for the extra modules.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch
from torch import nn

from llmem_plugin.techniques.nf4 import BLOCK_SIZE, SCALER_BLOCK_SIZE, NF4LinearStandIn, original_weight

__all__ = ["CHUNK_SIZE", "STORED", "TORCHTUNE_LOADS", "from_tensor", "place_nf4_weights"]

# [A] "Note: Quantize in Chunks": elements compared with the NF4 table at once.
CHUNK_SIZE = 1024**2
# The ``load`` values this module traces, and the torchao release each runs.
TORCHTUNE_LOADS = {"direct": "torchao 0.18.0", "torchtune-0.1": "torchao 0.1"}
# [A] NF4Tensor.__init__: the stored tensors, in the order the instance sets
# them (the order its __dict__ releases them, and inplace_copy [T01] replaces them).
STORED = ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4")
# [A] from_tensor's nf4 table (the 16 NormalFloat4 values of the QLoRA paper).
_NF4_VALUES = [-1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000,
               0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0000]


def _block_absmax(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A] get_block_absmax."""
    n_blocks = t.numel() // block_size
    return t.view(n_blocks, block_size).abs().max(dim=1).values


def _double_quantize_scalers(flat: torch.Tensor, *, legacy: bool):
    """[A] double_quantize_scalers, expression for expression ([A01] without the final contiguous)."""
    scalers_1 = _block_absmax(flat, BLOCK_SIZE)
    scalers_1_mean = scalers_1.mean()
    scalers_1 = scalers_1 - scalers_1_mean
    n_scaler_blocks = scalers_1.numel() // SCALER_BLOCK_SIZE
    scaler_blocks = scalers_1.view(n_scaler_blocks, SCALER_BLOCK_SIZE)
    scaler_absmax = _block_absmax(scalers_1, SCALER_BLOCK_SIZE)
    scaler_absmax = scaler_absmax.unsqueeze(-1).expand(n_scaler_blocks, SCALER_BLOCK_SIZE)
    quantization_factor = 256 / (2 * scaler_absmax)  # Tensor.__rtruediv__: reciprocal(), then * 256
    quantized_scaler_blocks = scaler_blocks * quantization_factor
    quantized_scaler_blocks = quantized_scaler_blocks.round()
    quantized_scaler_blocks = quantized_scaler_blocks.clamp(-128, 127)
    quantization_factor = quantization_factor[:, 0]
    factor = quantization_factor.view(n_scaler_blocks)
    return (quantized_scaler_blocks.flatten().to(torch.int8),
            factor if legacy else factor.contiguous(),
            scalers_1_mean)


def _nearest(value: torch.Tensor, nf4: torch.Tensor) -> torch.Tensor:
    """[A] quantize_tensor_nearest: a ``numel x 16`` difference, its abs, the argmin (int64)."""
    value = value.unsqueeze(-1)
    diff = (value - nf4).abs()
    closest_nf4 = diff.min(dim=-1).indices
    return closest_nf4


def _chunks(numel: int, every_chunk: bool) -> list[int]:
    """The chunks [A]'s loop runs; without ``every_chunk`` the first full chunk and the last
    partial one. Each chunk frees all it allocates, and the full chunks allocate the same sizes in
    the same order, so after the first of them the caching allocator's state repeats: the
    others change neither allocated nor reserved (tests/techniques/test_nf4_setup.py replays both)."""
    num = math.ceil(numel / CHUNK_SIZE)
    if every_chunk or num <= 2:
        return list(range(num))
    return [0, num - 1] if numel % CHUNK_SIZE else [0]


def _convert_to_norm_float_weight(t: torch.Tensor, n_blocks: int, nf4: torch.Tensor, *,
                                  legacy: bool, every_chunk: bool = True) -> torch.Tensor:
    """[A] convert_to_norm_float_weight ([A01]: one comparison over the whole weight)."""
    flattened_tensor = t.flatten()
    numel = t.numel()
    blocks = flattened_tensor.view(n_blocks, BLOCK_SIZE)
    scalers = _block_absmax(t.flatten(), BLOCK_SIZE)
    scales = scalers.unsqueeze(-1).expand(n_blocks, BLOCK_SIZE)
    scaled_blocks = blocks / scales
    if legacy:
        quantized_blocks = _nearest(scaled_blocks.flatten(), nf4)
    else:
        quantized_blocks = torch.empty(numel, dtype=torch.uint8, device=t.device)
        flattened = scaled_blocks.flatten()
        for chunk_num in _chunks(numel, every_chunk):
            start = chunk_num * CHUNK_SIZE
            end = min(start + CHUNK_SIZE, numel)
            quantized_blocks[start:end] = _nearest(flattened[start:end], nf4).to(torch.uint8)
    combined_blocks = quantized_blocks[::2] << 4 | quantized_blocks[1::2]
    return combined_blocks.to(torch.uint8)


def from_tensor(weight: torch.Tensor, *, legacy: bool = False, every_chunk: bool = True) -> dict[str, torch.Tensor]:
    """torchao's ``NF4Tensor.from_tensor(weight, 64, 256)``, op for op.

    Args:
        weight: The 16-bit (or fp32) weight, contiguous.
        legacy: torchao 0.1 ([A01]) instead of 0.18.0 ([A]).
        every_chunk: Run every chunk of the comparison; False: only those that can change
            the allocator's state (:func:`_chunks`; the trace's setup, a 7B model's
            conversions have up to 44 chunks each). The stored tensors' values are then
            not all computed.

    Returns:
        The stored tensors by name, in :data:`STORED` order.
    """
    nf4 = torch.tensor(_NF4_VALUES, device=weight.device, dtype=weight.dtype)
    n_blocks = weight.numel() // BLOCK_SIZE
    quantized_scalers, quantization_factor, scaler_mean = _double_quantize_scalers(weight.flatten(), legacy=legacy)
    quantized_data = _convert_to_norm_float_weight(weight, n_blocks, nf4, legacy=legacy, every_chunk=every_chunk)
    return {"quantized_scalers": quantized_scalers, "quantization_factor": quantization_factor,
            "scaler_mean": scaler_mean, "quantized_data": quantized_data, "nf4": nf4}


def _bind(layer: NF4LinearStandIn, stored: dict[str, torch.Tensor]) -> None:
    """Make ``stored`` the layer's NF4 tensors, in :data:`STORED` order (the old ones released as
    each is replaced, as [T01] inplace_copy's attribute assignments release them)."""
    for name in STORED:
        t = stored.pop(name)
        if name == "quantized_data":
            layer.weight.data = t
        else:
            setattr(layer, name, t)
        del t


def _release(stored: dict[str, torch.Tensor]) -> None:
    for name in STORED:  # [A] the NF4Tensor's __dict__, released in the order it was set
        del stored[name]


# transformers' module names -> torchtune's, in the order [T]'s builder makes a decoder layer
# (lora_llama2_self_attention: q, k, v, output; lora_llama2_mlp: w1 gate, w2 down, w3 up; then
# TransformerSelfAttentionLayer's sa_norm and mlp_norm).
# The attention's RoPE module comes after its four projections in both (_ROPE).
_BUILD_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "gate_proj", "down_proj", "up_proj",
                "input_layernorm", "post_attention_layernorm")
# The order the layer registers them (TransformerDecoderLayer: sa_norm, attn, mlp_norm, mlp), which
# deepcopy and load_state_dict follow.
_MODULE_ORDER = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "rope", "post_attention_layernorm",
                 "gate_proj", "down_proj", "up_proj")
_ROPE = "rope"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class _Unit:
    """One torchtune module's parameters: an NF4 layer with its adapters, a plain module, or
    torchtune's RoPE module (``rope``: head dim and positions; its buffers made here)."""

    def __init__(self, name: str, params: list[torch.Tensor], nf4: NF4LinearStandIn | None,
                 rope: tuple[int, int] | None = None) -> None:
        self.name, self.params, self.nf4, self.rope = name, params, nf4, rope


def _rope_buffers(head_dim: int, max_seq_len: int) -> list[torch.Tensor]:
    """[T] ``RotaryPositionalEmbeddings.rope_init`` and ``build_rope_cache``
    (``torchtune/modules/position_embeddings.py``, the same at [T01]): ``theta`` (fp32, head_dim/2)
    and the ``max_seq_len x head_dim/2 x 2`` fp32 cos/sin cache, both buffers of the module."""
    base = 10_000  # its value changes no size
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].float() / head_dim))
    seq_idx = torch.arange(max_seq_len, dtype=theta.dtype, device=theta.device)
    idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    return [theta, cache]


def _rope_layout(model: nn.Module) -> tuple[tuple[int, int], bool] | None:
    """(head dim, positions) of torchtune's RoPE cache, and whether each layer has its own
    ([T] lora_llama2/lora_llama3/lora_mistral/lora_qwen2 make one per attention;
    lora_llama3_1/lora_llama3_2, the configs with llama3 rope scaling, one shared), or None
    without a config."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "max_position_embeddings", None):
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scaling = getattr(cfg, "rope_scaling", None) or {}
    shared = (scaling.get("rope_type") or scaling.get("type")) == "llama3"
    return (head_dim, cfg.max_position_embeddings), not shared


def _units(model: nn.Module, params: list[torch.Tensor], adapters: set[int]):
    """The model's parameters grouped per torchtune module: per decoder layer in :data:`_MODULE_ORDER`,
    and the rest (embeddings, final norm, output projection, anything unknown) in model order."""
    by_id = {id(p): p for p in params}
    layers: dict[int, dict[str, _Unit]] = {}
    rest: list[_Unit] = []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) in by_id]
        if isinstance(m, NF4LinearStandIn):
            wrapper = name[: -len(".base_layer")] if name.endswith(".base_layer") else None
            lora = [p for n, p in model.get_submodule(wrapper).named_parameters()
                    if "lora_" in n and id(p) in adapters] if wrapper else []
            unit = _Unit(name, lora, m)
        elif own and not any(id(p) in adapters for p in own):
            unit = _Unit(name, own, None)
        else:
            continue
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[name.removesuffix(".base_layer").rsplit(".", 1)[-1]] = unit
        else:
            rest.append(unit)
    layout = _rope_layout(model)
    if layout is not None:
        dims, per_layer = layout
        if per_layer:
            for i in layers:
                layers[i][_ROPE] = _Unit(f"layers.{i}.rope", [], None, dims)
        else:  # one module, made before the layers (lora_llama3_1: `rope = Llama3ScaledRoPE(...)` first)
            rest.insert(0, _Unit(_ROPE, [], None, dims))
    return [layers[i] for i in sorted(layers)], rest


def _in_order(layer: dict[str, _Unit], order: tuple[str, ...]) -> list[tuple[str, _Unit]]:
    """A layer's units in ``order``, then any other (a name torchtune's llama builders do not
    make, e.g. a fused projection) in model order."""
    return [(k, layer[k]) for k in order if k in layer] + [(k, u) for k, u in layer.items() if k not in order]


def place_nf4_weights(tracker, model: nn.Module, params: list[torch.Tensor], workload, put,
                      adapters: set[int]) -> None:
    """Record torchtune's QLoRA setup (:data:`TORCHTUNE_LOADS`); every parameter is put by the end.

    Args:
        tracker: The step's tracker (inside its fake mode when tracing).
        model: The model, its NF4 layers :class:`NF4LinearStandIn` (their tensors are
            replaced by the ones the replay makes).
        params: The parameters, in order.
        workload: Its ``load`` picks the flow.
        put: Registers parameters not registered yet.
        adapters: ``id`` of the LoRA adapter parameters.
    """
    layers, rest = _units(model, params, adapters)
    legacy = workload.load == "torchtune-0.1"
    dtype = next(m.dtype for m in model.modules() if isinstance(m, NF4LinearStandIn))
    # torchtune's RoPE buffers live as long as the model; transformers' class has none like them.
    keep: list[torch.Tensor] = []
    model.__dict__["_torchtune_rope_buffers"] = keep
    if legacy:
        _build_cloned(tracker, layers, rest, dtype, put, keep)
    else:
        _build_each(tracker, layers, rest, dtype, put, keep)
    _load_state_dict(tracker, layers, rest, dtype, legacy=legacy)
    put(params)


def _weight16(tracker, layer: NF4LinearStandIn, dtype: torch.dtype) -> torch.Tensor:
    with tracker.owned_by(layer.weight):
        return torch.empty((layer.out_features, layer.in_features), dtype=dtype)


def _build_each(tracker, layers, rest, dtype, put, keep) -> None:
    """[T] each layer made in turn: per ``LoRALinear``, the 16-bit weight, ``to_nf4``, the
    adapters, the 16-bit weight dropped; then the embeddings, output projection, final norm
    (a RoPE module shared by the layers first)."""
    for unit in rest:
        if unit.rope is not None:
            _make(tracker, unit, dtype, put, keep)
    for layer in layers:
        for _, unit in _in_order(layer, _BUILD_ORDER):
            _make(tracker, unit, dtype, put, keep)
    for unit in rest:
        if unit.rope is None:
            _make(tracker, unit, dtype, put, keep)


def _make(tracker, unit: _Unit, dtype: torch.dtype, put, keep: list, *, legacy: bool = False) -> None:
    """One module made on the device: a plain one's parameters; an NF4 one's 16-bit weight,
    ``to_nf4`` of it, its adapters, the 16-bit weight dropped ([T] ``LoRALinear.__init__``)."""
    if unit.rope is not None:
        kept = _rope_buffers(*unit.rope)
        keep.extend(kept)  # the module's buffers: live from here on
        put(kept)
        return
    if unit.nf4 is None:
        put(unit.params)
        return
    w = _weight16(tracker, unit.nf4, dtype)
    with tracker.owned_by(unit.nf4.weight):
        _bind(unit.nf4, from_tensor(w, legacy=legacy, every_chunk=False))
    put(unit.params)  # lora_a, lora_b
    del w


def _build_cloned(tracker, layers, rest, dtype, put, keep) -> None:
    """[T01] one prototype layer, the embeddings, output projection and final norm, then
    ``copy.deepcopy`` of the prototype per layer (NF4: ``to_nf4(get_original_weight())``),
    the prototype dropped when the builder returns."""
    proto: dict[str, object] = {}
    for kind, unit in _in_order(layers[0] if layers else {}, _BUILD_ORDER):
        if unit.nf4 is not None:
            w = _weight16(tracker, unit.nf4, dtype)
            stored = from_tensor(w, legacy=True)
            del w  # _create_weight_and_bias returns: its nn.Linear is released before the adapters
            proto[kind] = SimpleNamespace(weight=stored.pop("quantized_data"), dtype=dtype,
                                          out_features=unit.nf4.out_features, in_features=unit.nf4.in_features,
                                          **stored)
            del stored
        if unit.rope is not None:
            proto[kind] = _rope_buffers(*unit.rope)
        proto[kind + ".params"] = [torch.empty_like(p) for p in unit.params]
    for unit in rest:  # tok_embeddings, output, then the final norm (an argument of TransformerDecoder)
        _make(tracker, unit, dtype, put, keep, legacy=True)
    for layer in layers:
        for kind, unit in _in_order(layer, _MODULE_ORDER):  # deepcopy follows the registration order
            if unit.nf4 is not None and kind in proto:
                with tracker.owned_by(unit.nf4.weight):
                    full = original_weight(proto[kind])  # [T01] clone: to_nf4(get_original_weight())
                    _bind(unit.nf4, from_tensor(full, legacy=True))
                    del full
                put(unit.params)  # Parameter.__deepcopy__: a clone of each
            elif unit.rope is not None and kind in proto:  # Tensor.__deepcopy__: theta, then the cache
                kept = [torch.empty_like(b) for b in proto[kind]]
                keep.extend(kept)
                put(kept)
            else:
                _make(tracker, unit, dtype, put, keep, legacy=True)
    for key in list(proto):  # lora_llama2 returns: the prototype layer is released
        del proto[key]


def _load_state_dict(tracker, layers, rest, dtype, *, legacy: bool) -> None:
    """``model.load_state_dict`` from a CPU checkpoint: the 16-bit tensors copy in place (no
    device allocation); each NF4 weight quantizes ``src.to(device)`` ([A] copy_, [T01] inplace_copy)."""
    units = [u for layer in layers for _, u in _in_order(layer, _MODULE_ORDER)] + rest
    for unit in units:
        if unit.nf4 is None:
            continue
        with tracker.owned_by(unit.nf4.weight):
            src = _weight16(tracker, unit.nf4, dtype)
            stored = from_tensor(src, legacy=legacy, every_chunk=False)
            del src  # the .to(device) copy, released when from_tensor returns
            if legacy:
                _bind(unit.nf4, stored)  # inplace_copy: the new tensors replace the old
            else:
                _release(stored)  # copy_ into the weight's own tensors, then the new NF4Tensor released
