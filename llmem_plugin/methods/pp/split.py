"""How a pipeline splits a model's decoder layers into stages: each framework's default.

* ``torchtitan``: ``generate_llm_fqn_per_model_part`` (torchtitan/distributed/
  pipeline_parallel.py, commit 02ef790): the embedding counts as
  ``input_weight`` layers (1) and the norm plus head as ``output_weight`` (1);
  the ``L + 2`` effective layers are spread evenly, the first
  ``(L + 2) % stages`` stages taking one more, and the first and last stages
  give up their weight's worth of decoder layers;
* ``colossalai``: ``PipelineStageManager.distribute_layers``
  (colossalai/pipeline/stage_manager.py, 0.5.0): ``L // chunks`` each, the
  remainder to the middle chunks, from ``chunks // 2 - remainder // 2``;
* ``deepspeed``: ``PipelineModule(partition_method="parameters")``, its
  default (deepspeed/runtime/pipe/module.py): the layer list (embedding,
  decoder layers, norm, head) cut into contiguous parts by parameter count,
  the linear partition ``ds_utils.partition_balanced`` solves: the cut whose
  heaviest minus lightest part is smallest, ties to the later cut.
"""

from __future__ import annotations

from llmem_plugin.errors import ConfigError

__all__ = ["SPLITS", "colossalai_split", "deepspeed_split", "torchtitan_split"]

SPLITS = ("torchtitan", "colossalai", "deepspeed")


def _check(num_layers: int, stages: int) -> None:
    for name, value in (("decoder layers", num_layers), ("pipeline stages", stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def torchtitan_split(num_layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> list[int]:
    """Decoder layers per stage, torchtitan's default; stage 0 also holds the embedding, the last the norm and
    head.

    Raises:
        ConfigError: More stages than effective layers, or a weight above the layers a stage gets.
    """
    _check(num_layers, stages)
    if stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise ConfigError(f"{stages} stages over {num_layers} layers (+{input_weight} for the embedding, "
                          f"+{output_weight} for the head) leave a stage without layers (torchtitan refuses it). "
                          "HINT: use fewer stages")
    counts, left = [], num_layers
    for s in range(stages):
        take = per + (s < extra) - (input_weight if s == 0 else output_weight if s == stages - 1 else 0)
        take = min(take, left)
        counts.append(take)
        left -= take
    return counts


def colossalai_split(num_layers: int, stages: int, chunks_per_stage: int = 1) -> list[int]:
    """Decoder layers per model chunk (stage-major, ``stages x chunks_per_stage`` of them), ColossalAI's
    default."""
    _check(num_layers, stages)
    chunks = stages * chunks_per_stage
    per, remainder = divmod(num_layers, chunks)
    counts = [per] * chunks
    start = chunks // 2 - remainder // 2
    for i in range(start, start + remainder):
        counts[i] += 1
    return counts


def deepspeed_split(weights: list[int], stages: int) -> list[int]:
    """The boundaries ``[0, ..., len(weights)]`` of ``stages`` contiguous parts of the layer list, DeepSpeed's
    ``partition_balanced``: the cut minimising the heaviest minus the lightest part (ties: the later cut); with
    no more layers than stages, one layer per stage and the rest empty."""
    _check(len(weights), stages)
    n = len(weights)
    if n <= stages:
        return [min(i, n) for i in range(stages + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[i][j]: (cost, heaviest, lightest, cut) of the first i layers in j parts
    best = [[(inf, inf, inf, 0)] * (stages + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, stages) + 1):
            for k in range(i):
                cost_k, high_k, low_k, _ = best[k][j - 1]
                if cost_k == inf:
                    continue
                part = prefix[i] - prefix[k]
                high, low = max(high_k, part), min(low_k, part)
                if high - low <= best[i][j][0]:
                    best[i][j] = (high - low, high, low, k)
    bounds = [n]
    for j in range(stages, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]
