"""The Python API as a new user calls it: sizes with units, one-line errors for
wrong types, Lightning's precision names, and an Estimate that reads well."""

from __future__ import annotations

import pytest
from torch import nn

import llmem_plugin
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.estimate import capacity_bytes
from llmem_plugin.workload import LoraSpec, Precision

from tests.conftest import tiny_config

KW = {"seq_len": 32, "batch_size": 1}


@pytest.fixture(scope="module")
def cfg():
    return tiny_config("llama")


@pytest.fixture(scope="module")
def est(cfg):
    return llmem_plugin.estimate(cfg, gpu="a100-40gb", **KW)


@pytest.mark.parametrize("given, expected", [
    ("80GiB", 80 * 2**30),
    ("40GB", 40 * 10**9),
    ("81920MiB", 80 * 2**30),
    ("80", 80 * 2**30),  # a bare number in a string is GiB, as the CLI reads --gpu-memory
    (80 * 2**30, 80 * 2**30),
    (2**20, 2**20),
    (None, None),
])
def test_capacity_takes_sizes_with_units_and_bytes(given, expected):
    assert capacity_bytes(given) == expected


@pytest.mark.parametrize("given, message", [
    (80, r"gpu_memory=80 is read as 80 bytes, below 1 MiB.*HINT: pass gpu_memory='80GiB'"),
    (2**20 - 1, "below 1 MiB"),
    (0, "must be a positive number of bytes"),
    (80.0, "must be bytes \\(an int\\) or a size string, got float"),
    (True, "got bool"),
    ("eighty", "not understood"),
])
def test_capacity_that_is_surely_wrong_is_refused(given, message):
    with pytest.raises(ConfigError, match=message):
        capacity_bytes(given)


def test_gpu_memory_string_sets_the_capacity(cfg):
    e = llmem_plugin.estimate(cfg, gpu_memory="40GB", **KW)
    assert e.capacity_bytes == 40 * 10**9 and e.fits


def test_gpu_memory_in_gib_as_a_bare_int_is_refused_not_read_as_bytes(cfg):
    with pytest.raises(ConfigError, match="read as 80 bytes"):
        llmem_plugin.estimate(cfg, gpu_memory=80, **KW)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"gpu": 80}, ConfigError, "gpu must be a catalog name or a llmem_plugin.GPU, got int 80"),
    ({"workload": "seq_len=32"}, ConfigError, "workload must be a llmem_plugin.Workload or a dict"),
    ({"lora": "q_proj"}, ConfigError, "lora must be a LoraSpec, a dict or a peft LoraConfig"),
    ({"precision": "16-true"}, UnsupportedError, "is not modelled"),
])
def test_wrong_types_are_one_line_errors(cfg, kwargs, error, message):
    fields = {} if "workload" in kwargs else KW
    with pytest.raises(error, match=message) as info:
        llmem_plugin.estimate(cfg, **fields, **kwargs)
    assert "\n" not in str(info.value) and "HINT" in str(info.value)


def test_dict_lora_and_dict_workload_are_the_same_estimate_as_the_spec(cfg):
    spec = llmem_plugin.estimate(cfg, lora=LoraSpec(rank=4, target_modules=("q_proj", "v_proj")), **KW)
    as_dict = llmem_plugin.estimate(cfg, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, **KW)
    as_workload = llmem_plugin.estimate(cfg, workload={"seq_len": 32, "lora": {"rank": 4, "target_modules":
                                                                               "q_proj,v_proj"}})
    assert as_dict.workload == spec.workload == as_workload.workload
    assert as_dict.peak_reserved_bytes == spec.peak_reserved_bytes == as_workload.peak_reserved_bytes
    # 2 layers x (q: 64x4 + 4x64, v: 64x4 + 4x32) adapter weights
    assert spec.trainable_params == 2 * ((64 * 4 + 4 * 64) + (64 * 4 + 4 * 32))


def test_lightning_bf16_true_is_pure_bf16(cfg):
    e = llmem_plugin.estimate(cfg, precision="bf16-true", **KW)
    assert e.workload.precision is Precision.BF16
    # Pure bf16: the parameters are 2 bytes each, as Lightning's HalfPrecision casts them.
    assert e.breakdown[llmem_plugin.MemoryCategory.PARAMETER] == pytest.approx(2 * e.params, rel=0.01)


def test_plain_module_is_refused_with_what_is_needed():
    with pytest.raises(UnsupportedError, match="Sequential is not a causal language model.*HINT") as info:
        llmem_plugin.estimate(nn.Sequential(nn.Linear(4, 4)), **KW)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("path", ["./no/such/config.json", "/no/such/dir", "missing-config.json"])
def test_missing_path_is_said_to_be_missing(path):
    with pytest.raises(ConfigError, match=f"model path '{path}' does not exist"):
        llmem_plugin.estimate(path, **KW)


def test_unknown_name_is_still_an_unknown_model():
    with pytest.raises(ConfigError, match="unknown model 'lama-3.1-8b'"):
        llmem_plugin.estimate("lama-3.1-8b", **KW)


def test_repr_is_short_and_str_is_the_summary_table(est):
    r = repr(est)
    assert len(r) < 200 and "\n" not in r
    assert r.startswith("Estimate(model='LlamaConfig'") or r.startswith("Estimate(model=")
    assert f"peak_reserved={est.peak_reserved_bytes / 2**30:.2f} GiB" in r and f"fits={est.fits}" in r
    s = str(est)
    assert s != r and s.count("\n") > 10
    for row in ("torch.cuda.max_memory_allocated", "nvidia-smi used memory", "verdict", "peak tensors"):
        assert row in s
    assert f"per GPU (a100-40gb, {est.capacity_bytes / 2**30:,.2f} GiB)" in s


def test_gib_helpers_are_the_byte_fields_over_2_30(est):
    assert est.peak_allocated_gib == est.peak_allocated_bytes / 2**30
    assert est.peak_reserved_gib == est.peak_reserved_bytes / 2**30
    assert est.device_total_gib == est.device_total_bytes / 2**30
    assert est.capacity_gib == est.capacity_bytes / 2**30
    assert est.headroom_bytes == est.capacity_bytes - est.device_total_bytes
    assert est.headroom_gib == est.headroom_bytes / 2**30


@pytest.mark.parametrize("version, match", [("abc", r"torch_version 'abc' is not a torch version"),
                                            ("2.1.0", r"torch_version 2\.1\.0 is outside the modelled range 2\.6 "
                                                      r"to 2\.13")])
def test_torch_version_outside_the_modelled_range_is_refused(version, match):
    with pytest.raises(ConfigError, match=match):
        llmem_plugin.estimate(tiny_config("llama"), seq_len=16, torch_version=version)
