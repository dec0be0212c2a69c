"""The kind of every layer of a model, read from its config, and the shortest
repeating structure fast mode can trace.

A layer's kind is everything in the config that makes that layer's modules
(and so its memory) differ from another layer's: its attention type
(``layer_types``: sliding or full, linear attention), dense or
mixture-of-experts MLP (DeepSeek's ``first_k_dense_replace``, Qwen-MoE's
``decoder_sparse_step`` and ``mlp_only_layers``), the block type of a hybrid
(Jamba's ``attn_layer_period``/``attn_layer_offset`` and
``expert_layer_period``/``expert_layer_offset``, RecurrentGemma's
``block_types``). Each rule below restates the test the model's transformers
code makes when it builds layer ``i`` (cited per rule). A model type without a
rule here, or a config with a per-layer list this module does not read, has
kinds it cannot tell apart: :func:`layer_kinds` says why, and fast mode traces
the full model instead.

The layer sequence is then cut as ``prefix + body + suffix`` where the body
repeats a period ``p`` of layers ``m`` times (:func:`plan_layers`). Fast mode
traces the same prefix and suffix around ``a`` and ``a + 1`` periods, i.e. the
model's own layer order with whole periods taken out of its middle.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from llmem_plugin.errors import UnsupportedError

__all__ = ["LayerPlan", "layer_kinds", "plan_layers", "shortened_config"]

_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _count_key(config: Any) -> str:
    for key in _COUNT_KEYS:
        if getattr(config, key, None):
            return key
    raise UnsupportedError(f"config of type {type(config).__name__} names no layer count")


def _deepseek(cfg: Any, i: int) -> Hashable:
    # modeling_deepseek_v3.py / _v2.py: DeepseekV3MoE if layer_idx >= config.first_k_dense_replace.
    return "moe" if i >= (cfg.first_k_dense_replace or 0) else "dense"


def _qwen_moe(cfg: Any, i: int) -> Hashable:
    # modeling_qwen3_moe.py / qwen2_moe: sparse if layer_idx not in config.mlp_only_layers
    # and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0.
    sparse = i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
    return "moe" if sparse else "dense"


def _jamba(cfg: Any, i: int) -> Hashable:
    # modeling_jamba.py: ALL_DECODER_LAYER_TYPES[config.layers_block_type[i]] and
    # num_experts = config.layers_num_experts[layer_idx].
    return cfg.layers_block_type[i], cfg.layers_num_experts[i]


def _block_type(cfg: Any, i: int) -> Hashable:
    # modeling_recurrent_gemma.py: TEMPORAL_BLOCK_CLASSES[config.layers_block_type[layer_idx]];
    # falcon_h1: config.layers_block_type (every layer "hybrid").
    return cfg.layers_block_type[i]


def _none(cfg: Any, i: int) -> Hashable:
    return None


# Model types whose layers differ only as the rule (and ``layer_types``, read
# for every type) says. The uniform families were checked in transformers 5's
# modeling files: their decoder layers are built alike except for
# ``config.layer_types[layer_idx]``.
_RULES: dict[str, Callable[[Any, int], Hashable]] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2", "phi", "phi3", "gemma", "gemma2", "gemma3_text",
         "mixtral", "mamba", "mamba2", "falcon_mamba", "starcoder2", "olmo2", "granite", "gpt_neox"),
        _none,
    ),
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "jamba": _jamba,
    "recurrent_gemma": _block_type,
    "falcon_h1": _block_type,
}
# Per-layer fields the rules read (a list field of one entry per layer not
# named here is a kind this module cannot interpret).
_KNOWN_LIST_FIELDS = {"layer_types", "mlp_only_layers", "block_types", "layers_block_type"}


def layer_kinds(config: Any) -> tuple[list[Hashable] | None, str]:
    """The kind of each layer of ``config``, in the model's order.

    Returns:
        ``(kinds, "")``; or ``(None, reason)`` when the kinds cannot be told
        apart from the config (unknown model type, unread per-layer field).
    """
    model_type = getattr(config, "model_type", "") or type(config).__name__
    rule = _RULES.get(model_type)
    if rule is None:
        return None, f"model type '{model_type}' has no layer-kind rule in fast mode"
    try:
        n = getattr(config, _count_key(config))
    except UnsupportedError as e:
        return None, str(e)
    for key, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == n and n > 1 and key not in _KNOWN_LIST_FIELDS:
            return None, f"the config's per-layer field '{key}' is not read by fast mode"
    types = getattr(config, "layer_types", None)
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != n):
        return None, f"layer_types has {len(types) if isinstance(types, (list, tuple)) else '?'} entries for {n} layers"
    try:
        return [(types[i] if types is not None else None, rule(config, i)) for i in range(n)], ""
    except (AttributeError, IndexError, TypeError) as e:
        return None, f"the layer kinds of '{model_type}' could not be read ({type(e).__name__}: {e})"


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """The layer sequence as ``prefix + repeats x period + suffix``.

    Attributes:
        num_layers: Layers of the full model.
        prefix: Leading layers outside the repetition (e.g. DeepSeek-V3's
            three dense layers).
        period: Layers in one repeating unit.
        repeats: Units in the full model.
        suffix: Trailing layers after the last whole unit.
        traced: Units in the shorter traced model (the longer has one more).
    """

    num_layers: int
    prefix: int
    period: int
    repeats: int
    suffix: int
    traced: int

    def indices(self, units: int) -> list[int]:
        """Layers of the full model kept in a copy with ``units`` units."""
        body_end = self.prefix + units * self.period
        return [*range(body_end), *range(self.num_layers - self.suffix, self.num_layers)]

    @property
    def short_layers(self) -> int:
        return len(self.indices(self.traced))

    @property
    def long_layers(self) -> int:
        return len(self.indices(self.traced + 1))


def _units_traced(period: int) -> int:
    # The shorter copy holds at least 2 periods and 3 layers of the body: the
    # allocator's reserved bytes grow by a constant per period only from there
    # on. Measured (benchmarks/fast_vs_full.py, seq 2048): Llama-3.1-70B, 2 -> 3
    # layers adds 136 MiB more than each later layer (+0.68% once extrapolated
    # to 80 layers); Gemma-3 1B, 1 -> 2 periods of 6 layers adds 1.28 GiB less
    # than each later period (-7.5% at 26 layers).
    return max(2, -(-3 // period))


def plan_layers(kinds: list[Hashable]) -> LayerPlan | None:
    """The repetition with the fewest layers to trace (``short + long``).

    The body is a run ``kinds[prefix : prefix + repeats * period]`` in which
    every layer equals the one ``period`` before it; the plan keeps the whole
    prefix and suffix, so a copy's layers are the full model's in their order.
    None when no repetition makes the two copies together shorter than the
    model (tracing the model itself is then faster, and exact).
    """
    n = len(kinds)
    best: LayerPlan | None = None
    best_cost = n
    # Periods beyond 64 layers do not occur in known models; bounding them keeps
    # the search linear in depth.
    for p in range(1, min(n, 64) + 1):
        a = _units_traced(p)
        # run[i]: how far (exclusive) the p-periodic run starting at i extends.
        run = [n] * (n + 1)
        for i in range(n - p - 1, -1, -1):
            run[i] = run[i + 1] if kinds[i] == kinds[i + p] else i + p
        for q in range(0, n):
            m = (run[q] - q) // p
            if m < a + 2:
                continue
            r = n - q - m * p
            cost = 2 * q + (2 * a + 1) * p + 2 * r
            if cost < best_cost:
                best_cost = cost
                best = LayerPlan(num_layers=n, prefix=q, period=p, repeats=m, suffix=r, traced=a)
    return best


def shortened_config(config: Any, indices: list[int], kinds: list[Hashable]) -> Any:
    """A copy of ``config`` with only the layers ``indices`` of the full model.

    Per-layer lists are cut to those layers and ``mlp_only_layers`` renumbered;
    index rules (``first_k_dense_replace``, periods and offsets) hold as they
    are, because whole periods are removed after the prefix.

    Raises:
        UnsupportedError: The copy's layer kinds are not the full model's
            layers ``indices`` (a rule that removing whole periods breaks).
    """
    cfg = copy.deepcopy(config)
    setattr(cfg, _count_key(cfg), len(indices))
    fields = vars(cfg)
    n = len(kinds)
    if isinstance(fields.get("layer_types"), (list, tuple)) and len(fields["layer_types"]) == n:
        cfg.layer_types = [config.layer_types[i] for i in indices]
    if fields.get("mlp_only_layers"):
        keep = set(config.mlp_only_layers)
        cfg.mlp_only_layers = [j for j, i in enumerate(indices) if i in keep]
    got, reason = layer_kinds(cfg)
    want = [kinds[i] for i in indices]
    if got != want:
        raise UnsupportedError(
            f"a {len(indices)}-layer copy of the model does not keep its layer kinds ({reason or 'rules disagree'})"
        )
    return cfg
