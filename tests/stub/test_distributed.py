"""Distributed methods on the stub CUDA device against the estimator, per rank.

One rank of each config runs on the stub (torch's CUDA build, its caching
allocator, the real DDP / FSDP2 / ColossalAI code, torch's fake process
group: benchmarks/groundtruth/stub_worker.py) while the estimator predicts
the same rank in this process; the allocated and reserved peaks must be
equal byte for byte (benchmarks/results/stub-distributed-2026-11-25.md).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.groundtruth.stub_distributed import CONFIGS, StubConfig, measure, predict

# The tiny Llama of tests/conftest.py on the llama-3.2-1b catalog config, 2 ranks.
_TINY = {"world": 2, "ranks": (0,)}
_CONFIGS = {
    "ddp": StubConfig(id="ddp", method="ddp", worker="ddp", **_TINY),
    # The all-gather copy-in and reduce-scatter streams hold 2 MiB segments of their own.
    "fsdp": StubConfig(id="fsdp", method="fsdp", worker="fsdp", **_TINY),
    "tp": StubConfig(id="tp", method="tp", worker="tp", tp=2, **_TINY),
    # Stage 2 reduce-scatters into buffers on its communication stream.
    "lowlevel-zero2": StubConfig(id="lowlevel-zero2", method="lowlevel-zero2", worker="lowlevel",
                                 options={"stage": 2}, **_TINY),
}


def _colossal_in_stub(stub) -> bool:
    return any((stub.ROOT / ".stubvenv" / "lib").glob("python3*/site-packages/colossalai/__init__.py"))


def _needs_colossal(stub) -> None:
    if not _colossal_in_stub(stub):
        msg = "ColossalAI is not installed in .stubvenv. HINT: rerun stubcuda/setup.sh"
        if os.environ.get(stub.REQUIRE_ENV):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_rank_peaks_equal_the_stub(stub, name):
    config = _CONFIGS[name]
    if config.worker == "lowlevel":
        _needs_colossal(stub)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(measure, config, 0, timeout_s=120)
        predicted = predict(config)[0]
        got = running.result()
    assert "error" not in got, f"{got['error']} at {got.get('where')}"
    measured = {k: max(s[k] for s in got["steps"]) for k in ("allocated_bytes", "reserved_bytes")}
    assert predicted == measured


def _peaks(got: dict) -> dict[str, int]:
    assert "error" not in got, f"{got['error']} at {got.get('where')}"
    return {k: max(s[k] for s in got["steps"]) for k in ("allocated_bytes", "reserved_bytes")}


def _measure_keeping_the_cache(stub, config: StubConfig) -> dict:
    proc = stub.run_python(["-m", "tests.stub._keep_cache_worker", json.dumps(config.spec(0))], timeout_s=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-2000:]
    return json.loads(lines[-1])


def test_lowlevel_zero_reserved_with_and_without_emptying_the_cache(stub):
    """LowLevelZero stage 1 at Llama-3.2-1B's shapes (4 layers, seq 512, batch 2): its setup leaves two
    free cached segments (252 and 16 MiB). Kept, the step reuses them; emptied before the first step (the
    harness's reset), five of the step's 32 MiB fp32 gradient copies take segments of their own, +160 MiB.
    The estimate replays both (llmem_plugin/methods/_setup_cache.py) and reports the larger; each replay
    equals the stub run of its convention byte for byte."""
    from llmem_plugin.methods.base import capture, rank_memory

    _needs_colossal(stub)
    (config,) = [c for c in CONFIGS if c.id == "lowlevel-zero1-w2-mid"]
    with ThreadPoolExecutor(2) as pool:
        emptied = pool.submit(measure, config, 0, timeout_s=300)
        kept = pool.submit(_measure_keeping_the_cache, stub, config)
        with capture() as cap:
            predicted = predict(config)[0]
        emptied, kept = _peaks(emptied.result()), _peaks(kept.result())
    (trace, kw), = cap.ranks
    kept_replay = rank_memory(trace, **{**kw, "emptied_cache_bound": False})
    assert predicted == emptied
    assert kept == {"allocated_bytes": kept_replay.peak_allocated_bytes,
                    "reserved_bytes": kept_replay.peak_reserved_bytes}
    assert emptied["reserved_bytes"] - kept["reserved_bytes"] == 160 * 2**20
