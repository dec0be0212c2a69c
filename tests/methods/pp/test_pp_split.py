"""Pipeline stage splits against each framework's own code (ColossalAI 0.5.0 and DeepSpeed, installed) or,
for torchtitan (not installed), its source's rule worked by hand."""

from __future__ import annotations

import random
import types

import pytest

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods.pp.split import colossalai_split, deepspeed_split, torchtitan_split


@pytest.mark.parametrize("layers,stages,want", [
    (32, 8, [4, 5, 4, 4, 4, 4, 4, 3]),  # 34 effective: 4 each, the first two +1; embedding and head take 1
    (32, 4, [8, 9, 8, 7]),  # 34: 8 each, the first two +1
    (16, 2, [8, 8]),  # 18: 9 each
    (28, 1, [28]),
])
def test_torchtitan(layers, stages, want):
    got = torchtitan_split(layers, stages)
    assert got == want and sum(got) == layers


def test_torchtitan_refuses_empty_stages():
    with pytest.raises(ConfigError, match="leave a stage without layers.*HINT"):
        torchtitan_split(2, 8)


@pytest.mark.parametrize("layers,stages,chunks", [(32, 4, 1), (30, 4, 1), (30, 4, 2), (7, 3, 2), (80, 8, 1)])
def test_colossalai_equals_its_stage_manager(layers, stages, chunks):
    from colossalai.pipeline.stage_manager import PipelineStageManager

    manager = types.SimpleNamespace(num_layers_per_stage=None, num_stages=stages, num_model_chunks=chunks)
    assert colossalai_split(layers, stages, chunks) == PipelineStageManager.distribute_layers(manager, layers)


@pytest.mark.parametrize("seed", range(6))
def test_deepspeed_equals_partition_balanced(seed):
    from deepspeed.runtime.utils import partition_balanced

    rng = random.Random(seed)
    n = rng.randint(3, 14)
    weights = [rng.choice([10, 10, 10, 7, 3, 25]) for _ in range(n)]
    for stages in range(1, 6):
        assert deepspeed_split(weights, stages) == list(partition_balanced(weights, stages)), (weights, stages)
