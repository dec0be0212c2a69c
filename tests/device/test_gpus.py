"""Tests of the GPU catalog (llmem_plugin.device.gpus) against datasheet facts."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest

from llmem_plugin.device import gpus
from llmem_plugin.errors import ConfigError
from llmem_plugin.device.gpus import (
    GPU,
    get_gpu,
    gpu_names,
    match_device_name,
    parse_memory,
    resolve_gpu,
)

GIB = 2**30

EXPECTED_NAMES = {
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "l4",
    "a10g",
    "l40s",
    "v100-16gb",
    "v100-32gb",
    "rtx-3090",
    "rtx-4090",
}

FIELDS = {f.name for f in dataclasses.fields(GPU)}


def _raw() -> dict:
    path = resources.files("llmem_plugin.device").joinpath("gpus.json")
    return json.loads(path.read_text(encoding="utf-8"))["gpus"]


def test_registry_names_are_exactly_the_expected_set():
    assert set(gpu_names()) == EXPECTED_NAMES
    assert gpu_names() == sorted(gpu_names())


def test_every_json_entry_has_every_field():
    for name, entry in _raw().items():
        assert set(entry) | {"name"} == FIELDS, name


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_every_entry_is_complete_and_typed(name):
    gpu = get_gpu(name)
    assert gpu.name == name
    assert isinstance(gpu.memory_bytes, int) and gpu.memory_bytes % GIB == 0
    assert isinstance(gpu.compute_capability, tuple) and len(gpu.compute_capability) == 2
    assert gpu.display_name and gpu.source and gpu.link and gpu.pcie.endswith("x16")
    for value in (gpu.fp16_tflops, gpu.fp32_tflops, gpu.memory_bandwidth_gbps, gpu.link_bandwidth_gbps):
        assert isinstance(value, float) and value > 0
    # Tensor-core half precision is always faster than plain FP32.
    assert gpu.fp16_tflops > gpu.fp32_tflops
    d = gpu.to_dict()
    assert set(d) == FIELDS
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize(
    "name, gib, cc, arch",
    [
        ("v100-16gb", 16, (7, 0), "volta"),
        ("v100-32gb", 32, (7, 0), "volta"),
        ("a100-40gb", 40, (8, 0), "ampere"),
        ("a100-80gb", 80, (8, 0), "ampere"),
        ("a10g", 24, (8, 6), "ampere"),
        ("rtx-3090", 24, (8, 6), "ampere"),
        ("l4", 24, (8, 9), "ada"),
        ("l40s", 48, (8, 9), "ada"),
        ("rtx-4090", 24, (8, 9), "ada"),
        ("h100-pcie", 80, (9, 0), "hopper"),
        ("h100-sxm", 80, (9, 0), "hopper"),
        ("h200", 141, (9, 0), "hopper"),
    ],
)
def test_memory_and_compute_capability_match_datasheets(name, gib, cc, arch):
    gpu = get_gpu(name)
    assert gpu.memory_bytes == gib * GIB
    assert gpu.compute_capability == cc
    assert gpu.architecture == arch


def test_h100_sxm_datasheet_figures():
    h100 = get_gpu("h100-sxm")
    assert h100.memory_bytes == 80 * GIB
    assert h100.compute_capability == (9, 0)
    # Datasheet: 1,979 TFLOPS BF16 *with sparsity*; the catalog stores dense.
    assert h100.bf16_tflops == pytest.approx(1979 / 2, rel=1e-3)
    assert h100.memory_bandwidth_gbps == 3350
    assert (h100.link, h100.link_bandwidth_gbps) == ("nvlink4", 900)


def test_a100_40_and_80_differ_only_in_memory_and_bandwidth():
    a40, a80 = get_gpu("a100-40gb").to_dict(), get_gpu("a100-80gb").to_dict()
    naming = {"name", "display_name", "aliases", "source"}
    differing = {k for k in FIELDS - naming if a40[k] != a80[k]}
    assert differing == {"memory_bytes", "driver_memory_bytes", "memory_bandwidth_gbps"}
    assert (a40["memory_bandwidth_gbps"], a80["memory_bandwidth_gbps"]) == (1555, 2039)


def test_h200_is_h100_sxm_compute_with_more_memory():
    h100, h200 = get_gpu("h100-sxm"), get_gpu("h200")
    assert (h200.bf16_tflops, h200.fp32_tflops, h200.link_bandwidth_gbps) == (
        h100.bf16_tflops, h100.fp32_tflops, h100.link_bandwidth_gbps)
    assert h200.memory_bytes > h100.memory_bytes and h200.memory_bandwidth_gbps == 4800


def test_volta_has_no_bf16_and_others_match_fp16():
    for name in gpu_names():
        gpu = get_gpu(name)
        if gpu.architecture == "volta":
            assert gpu.bf16_tflops is None
        else:
            assert gpu.bf16_tflops == gpu.fp16_tflops


def test_geforce_uses_fp32_accumulate_rate():
    # GA102 / Ada whitepapers: FP16 tensor with FP32 accumulate is 71 / 165.2
    # dense TFLOPS (half the FP16-accumulate rate).
    assert get_gpu("rtx-3090").bf16_tflops == 71.0
    assert get_gpu("rtx-4090").bf16_tflops == 165.2


def test_keys_are_unique_across_entries():
    owner: dict[str, str] = {}
    for name in gpu_names():
        gpu = get_gpu(name)
        # The device name may equal the key ("NVIDIA L4" -> "l4"); an alias must add a new spelling.
        own = {gpus._normalize(gpu.name), gpus._normalize(gpu.display_name)}
        aliases = [gpus._normalize(a) for a in gpu.aliases]
        assert len(aliases) == len(set(aliases)) and not own & set(aliases), f"{name} repeats a key"
        for key in own | set(aliases):
            assert owner.setdefault(key, name) == name, f"{key!r} names {owner[key]!r} and {name!r}"


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("A100-SXM-80GB", "a100-80gb"),  # older drivers
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("GeForce RTX 3090", "rtx-3090"),  # older drivers drop the "NVIDIA " prefix
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("  nvidia   l40s ", "l40s"),
    ],
)
def test_match_device_name(device_name, expected):
    gpu = match_device_name(device_name)
    assert gpu is not None and gpu.name == expected


@pytest.mark.parametrize("device_name", ["NVIDIA H100 NVL", "NVIDIA A100-PCIE-40GB", "NVIDIA A10", "Tesla T4", ""])
def test_match_device_name_misses_other_cards(device_name):
    assert match_device_name(device_name) is None


def test_get_gpu_is_case_insensitive_and_accepts_aliases():
    assert get_gpu("H100-SXM") is get_gpu("h100-sxm") is get_gpu("nvidia h100 80gb hbm3")
    assert get_gpu("RTX4090").name == "rtx-4090"


def test_unknown_gpu_lists_valid_names_and_hints():
    with pytest.raises(ConfigError) as info:
        get_gpu("h10")
    msg = str(info.value)
    assert "\n" not in msg and "'h10'" in msg
    assert "did you mean 'h100-pcie', 'h100-sxm'?" in msg
    assert all(name in msg for name in EXPECTED_NAMES)
    assert msg.endswith("HINT: run 'llmem gpus' for the catalog")


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("80GiB", 80 * 2**30),
        ("40GB", 40 * 10**9),
        ("81920MiB", 80 * 2**30),
        ("80", 80 * 2**30),
        ("80 gib", 80 * 2**30),
        ("79.5GiB", 159 * 2**29),
        ("0.1GB", 10**8),
        ("1TiB", 2**40),
        ("500MB", 5 * 10**8),
    ],
)
def test_parse_memory(text, nbytes):
    assert parse_memory(text) == nbytes


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "", "-4GiB", "0", "0GiB", "8e1GiB", "80KiB"])
def test_parse_memory_rejects_bad_text(text):
    with pytest.raises(ConfigError) as info:
        parse_memory(text)
    msg = str(info.value)
    assert repr(text) in msg and "\n" not in msg and "HINT" in msg


def test_resolve_gpu_default_and_memory_override():
    assert resolve_gpu(None, None) is get_gpu("h100-sxm")
    assert resolve_gpu(None, None, default="l4").name == "l4"
    small = resolve_gpu("a100-80gb", "40GiB")
    assert small.memory_bytes == small.capacity_bytes == 40 * GIB  # the override is the capacity
    a80 = get_gpu("a100-80gb")
    assert a80.capacity_bytes == 81920 * 2**20  # nvidia-smi's total, cited in the entry
    assert dataclasses.replace(small, memory_bytes=80 * GIB, driver_memory_bytes=a80.driver_memory_bytes) == a80
    with pytest.raises(ConfigError):
        resolve_gpu("a100", None)
    with pytest.raises(ConfigError):
        resolve_gpu("a100-80gb", "lots")


def test_spec_validates_itself():
    h100 = get_gpu("h100-sxm")
    with pytest.raises(ValueError, match="memory_bytes"):
        dataclasses.replace(h100, memory_bytes=0)
    with pytest.raises(ValueError, match="compute capability"):
        dataclasses.replace(h100, compute_capability=(8, 0))
    with pytest.raises(ValueError, match="architecture"):
        dataclasses.replace(h100, architecture="blackwell")
    with pytest.raises(dataclasses.FrozenInstanceError):
        h100.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPU("h100-sxm")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    "typed, name",
    [
        ("A100 40GB", "a100-40gb"),
        ("a100-40g", "a100-40gb"),
        ("A100 80GB", "a100-80gb"),
        ("RTX 4090", "rtx-4090"),
        ("4090", "rtx-4090"),
        ("GeForce RTX 3090", "rtx-3090"),
        ("H100 PCIe", "h100-pcie"),
        ("h100 sxm", "h100-sxm"),
        ("nvidia l4", "l4"),
    ],
)
def test_typed_spellings_that_name_one_entry(typed, name):
    # Every word of the typed name is a word of exactly one entry's names
    # (catalog/gpus.json: key, device name, aliases).
    assert get_gpu(typed).name == name


@pytest.mark.parametrize(
    "typed, candidates",
    [
        ("H100", ["h100-pcie", "h100-sxm"]),  # both are H100 80GB parts
        ("h100-80gb", ["h100-pcie", "h100-sxm"]),
        ("A100", ["a100-40gb", "a100-80gb"]),
        ("rtx", ["rtx-3090", "rtx-4090"]),
    ],
)
def test_ambiguous_spelling_lists_candidates(typed, candidates):
    with pytest.raises(ConfigError) as info:
        get_gpu(typed)
    msg = str(info.value)
    assert f"GPU {typed!r} is ambiguous: it names {', '.join(candidates)}." in msg
    assert "HINT" in msg and "\n" not in msg


def test_spelling_match_does_not_guess_other_models():
    # "l40" is a word of no entry (l40s is another card): refused, with suggestions.
    with pytest.raises(ConfigError, match="unknown GPU 'l40'; did you mean 'l40s'"):
        get_gpu("l40")
