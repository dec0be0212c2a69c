"""Layout rules and the method registry."""

from __future__ import annotations

import pytest

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods import Layout, MethodEstimate, RankMemory, method_names

from tests.conftest import tiny_config


def test_layout_degrees():
    lay = Layout(num_gpus=16, num_nodes=2, tp=4)
    assert (lay.gpus_per_node, lay.dp) == (8, 4)
    with pytest.raises(ConfigError, match="not a multiple of --nodes"):
        Layout(num_gpus=12, num_nodes=5)
    with pytest.raises(ConfigError, match="inside one node"):
        Layout(num_gpus=16, num_nodes=4, tp=8)  # 4 GPUs per node < tp


def test_tp_must_divide_heads_kv_heads_and_intermediate():
    cfg = tiny_config("llama")  # 4 heads, 2 kv heads, intermediate 160
    Layout(num_gpus=2, tp=2).check_model(cfg)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Layout(num_gpus=4, tp=4).check_model(cfg)
    with pytest.raises(ConfigError, match="intermediate_size"):
        Layout(num_gpus=4, tp=4).check_model(tiny_config("llama", num_key_value_heads=4, intermediate_size=162))


def test_registry_names_exactly():
    assert method_names() == ["single", "ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload",
                              "fsdp", "hsdp", "tp", "dp-tp", "fsdp-tp", "gemini", "lowlevel-zero1",
                              "lowlevel-zero2", "hybrid", "pp", "pp-gpipe", "pp-interleaved", "pp-zbv",
                              "pp-dualpipev", "pp-interleaved-zb"]


def test_host_bytes_per_node_and_worst_rank():
    lay = Layout(num_gpus=8, num_nodes=2)
    ranks = [RankMemory(rank=0, peak_tensor_bytes=1, peak_allocated_bytes=1, peak_reserved_bytes=2,
                        device_total_bytes=10, fits=True, host_bytes=100),
             RankMemory(rank=7, peak_tensor_bytes=1, peak_allocated_bytes=1, peak_reserved_bytes=2,
                        device_total_bytes=12, fits=False, host_bytes=90)]
    est = MethodEstimate(method="x", layout=lay, ranks=ranks)
    assert est.host_bytes_per_node == 100 * 4
    assert est.worst.rank == 7 and est.to_dict()["fits"] is False
