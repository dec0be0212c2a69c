"""Variable-length runs on the stub CUDA device against the replay, byte for byte.

Each case runs 60 optimizer steps whose micro-batches have their own padded
lengths (``llmem_plugin.techniques.varlen.step_lengths``, the same seed on both sides)
through torch's real caching allocator; ``llmem validate`` replays the same
run from the derived event streams.
"""

from __future__ import annotations

import pytest

from llmem_plugin.verify.validate import validate_rows

from .conftest import run_cases

CASES = (
    "tiny4-llama-3.2-1b-bf16-mixed-s512-b4-eager-vlen16_512_120",  # autocast, eager attention, foreach AdamW
    # Accumulation of 2, LoRA, fused AdamW; mem-efficient SDPA (the stub's cuDNN is off), whose kernel choice
    # depends on the length's alignment, so most lengths are traced one by one.
    "tiny4-qwen2.5-0.5b-bf16-s384-b2-ga2-lora-sdpa-adamw-fused-vlen200_384",
)


@pytest.fixture(scope="module")
def rows(stub, tmp_path_factory):
    return run_cases(tmp_path_factory, CASES, steps=60)


def test_the_runs_change_shape_and_their_cache_grows(rows):
    for r in rows:
        assert r["status"] == "ok" and len(r["steps"]) == 60 and r["seq_lens"]
        reserved = [s["reserved_bytes"] for s in r["steps"]]
        assert reserved[-1] > reserved[0]  # the cache grows after the first step as shapes vary


def test_replay_equals_the_stub_allocator(rows):
    report = validate_rows(rows)
    for c in report.rows:
        assert c.note == "" and c.predicted["allocated"] == c.measured["allocated"], (c.id, c.diff_bytes)
        assert c.predicted["reserved"] == c.measured["reserved"], (c.id, c.diff_bytes)
    assert report.num_stub_exact == len(CASES)
