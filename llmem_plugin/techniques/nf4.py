"""torchao's NF4 weights, as torchtune's QLoRA runs them (``--quantize nf4-torchao``).

torchtune quantizes the frozen base weight of every attention and MLP linear
layer with torchao's ``to_nf4`` (``torchtune/modules/peft/lora.py``
``LoRALinear(quantize_base=True)``; ``FrozenNF4Linear`` for the layers
without an adapter) and runs each of them through ``linear_nf4``. The other
weights (embeddings, norms, the output projection) keep the model's dtype; no
k-bit preparation runs. Sources, torchao 0.18.0
``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py`` ([A]):

* ``NF4Tensor.from_tensor`` (block 64, scaler block 256) stores
  ``quantized_data`` (uint8, two 4-bit codes per byte: numel / 2),
  ``quantized_scalers`` (int8, one per 64-element block),
  ``quantization_factor`` (the weight's dtype, one per 256 blocks),
  ``scaler_mean`` (0-dim, the weight's dtype) and the 16-entry ``nf4`` table
  (the weight's dtype). ``double_quantize_scalers`` and
  ``get_block_absmax`` assert that the element count divides by 64 and the
  block count by 256.
* ``LinearNF4.forward``: ``F.linear(input, weight.to(input.dtype))``; the
  NF4 ``to`` is ``get_original_weight().to(dtype)``. ``backward``:
  ``grad_output @ weight.to(grad_output.dtype)``. The weight takes no
  gradient.
* ``get_original_weight``: the high and low codes each as int64
  (``(quantized_data >> 4).to(torch.long)``, ``(quantized_data & 0b1111)
  .to(torch.long)``), each looked up in the table (the weight's dtype), the
  scalers dequantized (``quantized_scalers / quantization_factor``, then
  ``+ scaler_mean``), each half multiplied by the scalers repeated over its
  32 codes per block (``expand(...).flatten()``, a copy), and the halves
  stacked into the weight. Every one of them is a local of that function, so
  all live until it returns: about 6.5 bf16 weights' worth at its peak.

:class:`NF4LinearStandIn` holds those tensors and replays that sequence on
them, so the trace allocates what torchao allocates; tests/techniques/test_nf4.py
checks it against torchao's own ``NF4Tensor`` and ``linear_nf4`` on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from llmem_plugin.errors import ConfigError

__all__ = ["BLOCK_SIZE", "SCALER_BLOCK_SIZE", "NF4LinearStandIn", "quantize_nf4_torchao"]

# [A] to_nf4(tensor, block_size=64, scaler_block_size=256), torchtune's defaults
# (LoRALinear passes no quantization_kwargs unless the recipe sets them).
BLOCK_SIZE = 64
SCALER_BLOCK_SIZE = 256
_CODES = 16  # [A] from_tensor's nf4 table


class NF4LinearStandIn(nn.Linear):
    """A frozen linear layer whose weight is a torchao ``NF4Tensor``.

    Subclasses ``nn.Linear`` (peft wraps it with its plain LoRA ``Linear``, as
    torchtune's ``LoRALinear`` adds its adapter to ``linear_nf4``'s output).
    ``weight`` is ``quantized_data``; the other stored tensors are buffers, so
    the trace registers them as model memory.
    """

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 device: torch.device | str, name: str = "") -> None:
        nn.Module.__init__(self)
        numel = in_features * out_features
        blocks = numel // BLOCK_SIZE
        if numel % BLOCK_SIZE or blocks % SCALER_BLOCK_SIZE:
            raise ConfigError(
                f"torchao's to_nf4 cannot quantize {name or 'a'} {out_features}x{in_features} weight: it needs the "
                f"element count to divide by {BLOCK_SIZE * SCALER_BLOCK_SIZE} ({BLOCK_SIZE}-element blocks, "
                f"{SCALER_BLOCK_SIZE} block scalers per group; nf4_tensor.py double_quantize_scalers). "
                "HINT: torchtune's QLoRA fails on this model too; use --quantize nf4 (bitsandbytes)"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(numel // 2, dtype=torch.uint8, device=device), requires_grad=False)
        self.bias = None
        self.register_buffer("quantized_scalers", torch.empty(blocks, dtype=torch.int8, device=device))
        self.register_buffer("quantization_factor",
                             torch.empty(blocks // SCALER_BLOCK_SIZE, dtype=dtype, device=device))
        self.register_buffer("scaler_mean", torch.empty((), dtype=dtype, device=device))
        self.register_buffer("nf4", torch.empty(_CODES, dtype=dtype, device=device))

    @classmethod
    def from_linear(cls, module: nn.Linear, name: str = "") -> NF4LinearStandIn:
        """Replace ``module``; a real weight takes torchao's own quantized tensors."""
        if module.bias is not None:
            raise ConfigError(f"{name or 'a linear layer'} has a bias; torchtune's NF4 layers are bias-free "
                              "(FrozenNF4Linear, LoRALinear with quantize_base). HINT: use --quantize nf4 "
                              "(bitsandbytes) for this model")
        weight = module.weight
        new = cls(module.in_features, module.out_features, dtype=weight.dtype, device=weight.device, name=name)
        if weight.device.type != "meta":
            new._quantize_from(weight.detach())
        return new

    def _quantize_from(self, weight: torch.Tensor) -> None:
        try:
            from torchao.quantization import to_nf4
        except ImportError:
            raise ImportError("quantizing real weights to NF4 needs torchao: pip install torchao") from None
        q = to_nf4(weight.contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        with torch.no_grad():
            self.weight.copy_(q.quantized_data)
            self.quantized_scalers.copy_(q.quantized_scalers)
            self.quantization_factor.copy_(q.quantization_factor)
            self.scaler_mean.copy_(q.scaler_mean)
            self.nf4.copy_(q.nf4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearNF4.apply(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4 (torchao)"


def original_weight(layer: NF4LinearStandIn) -> torch.Tensor:
    """[A] ``get_original_weight``, op for op: every intermediate stays bound
    until the function returns, as there."""
    high = (layer.weight >> 4).to(torch.long)
    low = (layer.weight & 0b1111).to(torch.long)
    high_values = layer.nf4[high]
    low_values = layer.nf4[low]
    groups = layer.quantized_scalers.numel() // SCALER_BLOCK_SIZE
    scalers = (layer.quantized_scalers.view(groups, SCALER_BLOCK_SIZE)
               / layer.quantization_factor.unsqueeze(-1)).flatten().to(layer.dtype) + layer.scaler_mean
    per_code = scalers.unsqueeze(-1).expand(scalers.size(0), BLOCK_SIZE // 2)
    high_scaled = high_values * per_code.flatten()
    low_scaled = low_values * per_code.flatten()
    high_scaled = high_scaled.unsqueeze(-1).transpose(0, 1)
    low_scaled = low_scaled.unsqueeze(-1).transpose(0, 1)
    return torch.stack([high_scaled, low_scaled], dim=-1).reshape(layer.out_features, layer.in_features)


def _weight_as(layer: NF4LinearStandIn, dtype: torch.dtype) -> torch.Tensor:
    # [A] nf4_to: get_original_weight().to(dtype); the dequantized weight is
    # released when the cast returns a copy.
    return original_weight(layer).to(dtype)


class _LinearNF4(torch.autograd.Function):
    """[A] ``LinearNF4``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: NF4LinearStandIn) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return nn.functional.linear(x, _weight_as(layer, x.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        return grad_output @ _weight_as(ctx.layer, grad_output.dtype), None


def quantize_nf4_torchao(model: nn.Module, targets: list[tuple[str, nn.Module]]) -> None:
    """Replace ``targets`` (name, ``nn.Linear``) of ``model`` in place, and freeze every parameter."""
    for name, m in targets:
        if type(m) is not nn.Linear:
            raise ConfigError(f"{name} is a {type(m).__name__}; torchtune's NF4 layers replace nn.Linear only. "
                              "HINT: use --quantize nf4 (bitsandbytes) for this model")
        model.set_submodule(name, NF4LinearStandIn.from_linear(m, name))
    for p in model.parameters():
        p.requires_grad_(False)
