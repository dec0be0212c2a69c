"""Distributed methods on the stub CUDA device against the estimator, per rank.

One rank of each config runs on the stub (torch's CUDA build, its caching
allocator, the real DDP / FSDP2 / ColossalAI code, torch's fake process
group: benchmarks/groundtruth/stub_worker.py) while the estimator predicts
the same rank in this process; the allocated and reserved peaks must be
equal byte for byte (benchmarks/results/stub-distributed-2026-11-25.md).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.groundtruth.stub_distributed import StubConfig, measure, predict

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


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_rank_peaks_equal_the_stub(stub, name):
    config = _CONFIGS[name]
    if config.worker == "lowlevel" and not _colossal_in_stub(stub):
        msg = "ColossalAI is not installed in .stubvenv. HINT: rerun stubcuda/setup.sh"
        if os.environ.get(stub.REQUIRE_ENV):
            pytest.fail(msg)
        pytest.skip(msg)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(measure, config, 0, timeout_s=120)
        predicted = predict(config)[0]
        got = running.result()
    assert "error" not in got, f"{got['error']} at {got.get('where')}"
    measured = {k: max(s[k] for s in got["steps"]) for k in ("allocated_bytes", "reserved_bytes")}
    assert predicted == measured
