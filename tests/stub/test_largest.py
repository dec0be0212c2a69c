"""`llmem max` on the stub CUDA device: the found value runs two optimizer steps, the next one up runs out
of memory, with the stub's capacity set to what the estimate leaves PyTorch's allocator on the GPU
(benchmarks/groundtruth/stub_max.py; results in benchmarks/results/max-stub-2026-12-07.jsonl)."""

from __future__ import annotations

import pytest

from benchmarks.groundtruth.stub_max import CONFIGS, check

# Where the answer's step ends below the capacity, one GPU's replay is the stub allocator's to the byte.
# FSDP2 at its answer frees its cache and retries at the capacity on several streams: there the verdicts
# agree and the reported reserved peak is the simulated capped replay's (see the results file).
_EXACT_RESERVED = {"full-batch", "lora-batch", "gc-batch", "varlen-batch", "eager-seq", "lora-seq"}


@pytest.mark.parametrize("config", CONFIGS, ids=[c.id for c in CONFIGS])
def test_the_answer_runs_and_one_more_runs_out_of_memory(stub, config):
    row = check(config)
    assert row["at_value"]["status"] == "ok", row["at_value"]
    assert row["at_next"]["status"] == "oom", row["at_next"]
    assert row["next_value"] == row["value"] + config.multiple_of
    assert row["at_value"]["reserved_bytes"] <= row["stub_capacity_bytes"]
    if config.id in _EXACT_RESERVED:
        assert row["at_value"]["reserved_bytes"] == row["predicted_reserved_bytes"]
        assert row["at_value"]["allocated_bytes"] == row["predicted_allocated_bytes"]


def test_the_configs_cover_the_issue_s_cases():
    # A LoRA job, a checkpointed job, an FSDP2 rank, a variable-length dataset; two sequence-length searches.
    ids = {c.id for c in CONFIGS}
    assert {"lora-batch", "gc-batch", "fsdp-batch", "varlen-batch"} <= ids
    assert sum(c.what == "seq_len" for c in CONFIGS) >= 2
