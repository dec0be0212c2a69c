"""Enumerate: the configurations a plan searches, and the micro-batches and pipeline splits of each.

The space (docs/planner.md, "The space"): every planner method that runs on the cluster, each tensor-parallel
degree that divides a node and the model, each pipeline degree whose stages keep a decoder layer; per
configuration, each micro-batch that divides the per-rank share of the global batch (gradient accumulation
fills the rest), or for a pipeline each split of its share into schedule steps. What cannot run here is
listed with why; when nothing can, :class:`~llmem_plugin.errors.ConfigError` says why for each method.
"""

from __future__ import annotations

from llmem_plugin.errors import ConfigError, LLMemError
from llmem_plugin.methods import Layout
from llmem_plugin.models.config import num_layers
from llmem_plugin.planner.candidates import _PP, _TRAITS, _Config, _Context, default_methods, planner_methods

__all__ = ["enumerate_configs"]


def enumerate_configs(ctx: _Context, methods: list[str] | None, tps: list[int] | None
                      ) -> tuple[list[_Config], list[tuple[str, str]]]:
    """The configurations to search: ``methods`` (default :func:`default_methods`) on ``ctx``'s layout, with
    the tensor-parallel degrees ``tps`` (default every divisor of a node's GPUs from 2).

    Returns:
        The configurations, in the order of the methods, and (label, reason) for what cannot run here.

    Raises:
        ConfigError: An unknown method, or none of them can run on the layout.
    """
    layout = ctx.layout
    skipped: list[tuple[str, str]] = []
    names = methods or default_methods()
    unknown = [m for m in names if m not in _TRAITS]
    if unknown:
        raise ConfigError(f"unknown method '{unknown[0]}'; valid: {', '.join(planner_methods())}. "
                          "HINT: pass --methods with names from this list")
    degrees = [d for d in range(2, layout.gpus_per_node + 1) if layout.gpus_per_node % d == 0]
    if tps is not None:
        degrees = [d for d in tps if d > 1]
    out: list[_Config] = []
    for name in names:
        t = _TRAITS[name]
        if name in _PP:
            out += _pp_configs(ctx, name, skipped, [1, *degrees] if tps is None else tps)
            continue
        if name == "single":
            if layout.num_gpus == 1:
                out.append(_Config(name, 1))
            continue
        if name == "hsdp" and layout.num_nodes == 1:
            skipped.append((name, "needs more than one node (it equals fsdp on one)"))
            continue
        if not t.tp_family:
            if layout.num_gpus == 1 and not t.offload:
                continue  # one GPU: `single` is the same step
            out.append(_Config(name, 1))
            continue
        out += _tp_configs(ctx, name, degrees, skipped)
    if not out:
        # Nothing to search: the reason is the layout, not the memory.
        raise ConfigError(_inapplicable_line(names, layout, skipped))
    return out, skipped


def _tp_configs(ctx: _Context, name: str, degrees: list[int], skipped: list[tuple[str, str]]) -> list[_Config]:
    """A tensor-parallel method's degrees: ``tp`` takes all the GPUs, the others leave data parallelism;
    each a degree the model's heads and widths divide."""
    layout = ctx.layout
    out = []
    for d in degrees:
        if name == "tp" and d != layout.num_gpus:
            continue
        if name != "tp" and d == layout.num_gpus:
            continue  # no data parallelism left: plain `tp` covers it
        try:
            Layout(num_gpus=layout.num_gpus, num_nodes=layout.num_nodes, tp=d).check_model(ctx.config)
        except ConfigError as e:
            skipped.append((f"{name} tp{d}", str(e).split(". HINT")[0]))
            continue
        out.append(_Config(name, d))
    return out


def _pp_configs(ctx: _Context, name: str, skipped: list[tuple[str, str]], tps: list[int]) -> list[_Config]:
    """Pipeline degrees for ``name``: every divisor of the GPU count from 2 whose stages each keep a decoder
    layer (``p * v`` stages over the model's layers), on a model the stages run; each with every degree of
    ``tps`` (1: none) that divides a node's GPUs and the model's heads and widths, and leaves ``p x tp``
    dividing the GPUs (FSDP2 over the rest)."""
    from llmem_plugin.methods.pp.stage import check_model

    try:
        check_model(ctx.config, ctx.workload.seq_len)
    except LLMemError as e:
        skipped.append((name, str(e).split(". HINT")[0]))
        return []
    _, v = _PP[name]
    layers = num_layers(ctx.config)
    layout = ctx.layout
    n = layout.num_gpus
    degrees = []
    for d in sorted(set(tps)):
        if d == 1:
            degrees.append(d)
            continue
        try:
            Layout(num_gpus=n, num_nodes=layout.num_nodes, tp=d).check_model(ctx.config)
        except ConfigError as e:
            skipped.append((f"{name} tp{d}", str(e).split(". HINT")[0]))
            continue
        degrees.append(d)
    return [_Config(name, d, p) for d in degrees for p in range(2, n // d + 1)
            if n % (p * d) == 0 and p * v <= layers]


def _inapplicable_line(names: list[str], layout: Layout, skipped: list[tuple[str, str]]) -> str:
    """Why none of ``names`` can run on ``layout`` (:func:`enumerate_configs` left none),
    one line with the values and the fix."""
    gpus = f"{layout.num_gpus} GPU{'s' if layout.num_gpus > 1 else ''}" + (
        f" on {layout.num_nodes} nodes" if layout.num_nodes > 1 else "")
    said = {label.split(" ")[0]: why for label, why in skipped}
    reasons = []
    for name in names:
        t = _TRAITS[name]
        if name in said:
            why = said[name]
        elif name == "single":
            why = f"runs on one GPU, not {layout.num_gpus}"
        elif name in _PP:
            why = (f"has no pipeline degree for {layout.num_gpus} GPU(s) (a divisor from 2 with at least one decoder "
                   "layer per stage)")
        elif layout.num_gpus == 1:
            why = ("needs at least 2 GPUs (on one GPU its step is the single-GPU step)" if not t.tp_family
                   else "needs at least 2 GPUs to split the layers over")
        else:
            why = (f"has no tensor-parallel degree for this layout (tp takes all {layout.num_gpus} GPUs within "
                   f"one node; dp-tp and fsdp-tp take a degree that divides a node's {layout.gpus_per_node} GPUs "
                   "and leaves data parallelism)")
        reasons.append(f"{name} {why}")
    offload = [m for m in planner_methods() if _TRAITS[m].offload]
    if layout.num_gpus == 1:
        hint = (f"pass --gpus 2 or more (num_gpus=), or --methods single (or an offload method: "
                f"{', '.join(offload)})")
    else:
        hint = "pass --methods with one that applies (e.g. ddp, fsdp), or --gpus 1 for single"
    return (f"no method of --methods {','.join(names)} applies to {gpus}: {'; '.join(reasons)}. HINT: {hint}")


# ----------------------------------------------------------------------------- micro-batches and splits


class _BatchError(ConfigError):
    """The global batch does not split over a configuration's ranks (``hint``: the fix, when not the
    data-parallel split's)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _micro_batches(per_rank: int, pinned: int | None) -> list[int]:
    if pinned is not None:
        return [pinned] if per_rank % pinned == 0 else []
    out = [m for m in (2**k for k in range(16)) if m <= per_rank and per_rank % m == 0]
    return out + ([per_rank] if per_rank not in out else [])


def _pipeline_microbatches(ctx: _Context, cfg: _Config, pinned: int | None) -> int:
    """A pipeline configuration's microbatches per optimizer step: its data-parallel rank's share of the
    global batch, one row each (:data:`~llmem_plugin.planner.candidates._PP`)."""
    schedule, _ = _PP[cfg.method]
    dp = ctx.layout.num_gpus // (cfg.pp * cfg.tp)
    if ctx.global_batch % dp:
        raise _BatchError(f"global batch {ctx.global_batch} is not a multiple of the {dp} data-parallel ranks")
    if pinned not in (None, 1):
        raise _BatchError(f"pipeline candidates run one-row microbatches, not --micro-batch {pinned}",
                          "leave --micro-batch out (or 1) to plan pipeline methods")
    m = ctx.global_batch // dp
    if m < cfg.pp:
        raise _BatchError(f"{m} microbatches per step are fewer than the {cfg.pp} pipeline stages",
                          f"pass a --global-batch of at least {cfg.pp * dp} ({cfg.pp} per data-parallel rank)")
    if schedule == "interleaved-1f1b" and m % cfg.pp:
        raise _BatchError(f"{m} microbatches per step are not a multiple of the {cfg.pp} pipeline ranks")
    return m


# Schedule steps per optimizer step searched for a pipeline: powers of two up to this many.
_MAX_SCHEDULE_STEPS = 64


def _pipeline_splits(ctx: _Context, cfg: _Config) -> list[tuple[int, int]]:
    """The (microbatches per schedule step, schedule steps per optimizer step) a pipeline configuration is
    planned at, all of its rank's share: the whole share in one schedule step, and torchtitan's gradient
    accumulation over 2, 4, ... steps (``num_tokens_per_train_step`` over a step's tokens x dp) while each step
    keeps at least two microbatches per stage (a shorter step is mostly bubble). Fewer microbatches per step
    hold fewer receive buffers; more have a smaller bubble and fewer FSDP2 gathers and reductions."""
    share = _pipeline_microbatches(ctx, cfg, None)
    out = [(share, 1)]
    k = 2
    while k <= _MAX_SCHEDULE_STEPS and share % k == 0 and share // k >= 2 * cfg.pp:
        out.append((share // k, k))
        k *= 2
    return out


def _micro_batch_plan(ctx: _Context, cfg: _Config, pinned: int | None) -> tuple[int, list[int]]:
    if cfg.pp > 1:
        return _pipeline_microbatches(ctx, cfg, pinned), [1]
    dp = ctx.layout.num_gpus // cfg.tp
    if ctx.global_batch % dp:
        raise _BatchError(f"global batch {ctx.global_batch} is not a multiple of the {dp} data-parallel ranks")
    per_rank = ctx.global_batch // dp
    mbs = _micro_batches(per_rank, pinned)
    if not mbs:
        raise _BatchError(f"micro-batch {pinned} does not divide the {per_rank} sequences per rank")
    return per_rank, mbs
