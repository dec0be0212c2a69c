"""Predicted snapshots against the stub device's real ones (torch's own allocator, history recorded).

The stub harness dumps each case's history from its peak reset on (benchmarks/groundtruth/cuda.py,
``LLMEM_STUB_SNAPSHOT_DIR``); the predicted snapshot starts at the same point (``after_load``: the cache
emptied once the weights are loaded). Asserted equal: every entry's action, size and stream, in order
(addresses are not compared: the real ones are the driver's); the peaks read back from each history and
the row's ``max_memory_allocated``/``max_memory_reserved``; the end state's segments (pool and size) and
the blocks they hold. One exception, by construction: where an autocast region exits, torch frees the
casts it cached in the iteration order of a C++ hash map keyed by host pointers (autocast_mode.cpp
``cached_casts``), which no trace can know; there the run of frees is compared as a set
(:data:`CACHE_RELEASE_CASES`).
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch.cuda._memory_viz as memory_viz

from benchmarks.groundtruth.stub_snapshot import free_runs_as_sets, segments_in_use
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.snapshot.compare import compare_snapshots
from llmem_plugin.snapshot.history import load_snapshot, read_history
from llmem_plugin.snapshot.predict import replay_history, snapshot_of
from llmem_plugin.verify.validate import estimate_row

from .conftest import run_cases

pytestmark = pytest.mark.xdist_group("stub-snapshot")

CASES = (
    "tiny-llama-3.2-1b-bf16-mixed-s64-b2-sdpa",  # a dense bf16-mixed step
    "tiny-gpt2-bf16-mixed-s64-b2-lora-eager",  # LoRA
    "tiny4-llama-3.2-1b-bf16-s256-b4-lora-sdpa-nf4-kbit-off",  # QLoRA (bitsandbytes' nf4 on the stub)
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-gc-every2-sdpa",  # gradient checkpointing, every second layer
    "tiny4-llama-3.2-1b-bf16-s256-b4-gc-reentrant-lora-sdpa",  # reentrant checkpointing with LoRA
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b2-sdpa",  # the run `compare` is checked against
)


# Cases where casts the autocast cache held die at the region's exit (checkpointed layers: their casts
# are kept by no saved tensor), in an order only the host's pointers decide.
CACHE_RELEASE_CASES = {"tiny4-llama-3.2-1b-bf16-mixed-s256-b4-gc-every2-sdpa"}


def _entries(snap) -> list[tuple[str, int, int]]:
    return [(e["action"], e["size"], e["stream"]) for e in snap["device_traces"][0] if e["action"] != "snapshot"]


@pytest.fixture(scope="module")
def real(stub, tmp_path_factory):
    folder = tmp_path_factory.mktemp("snapshots")
    os.environ["LLMEM_STUB_SNAPSHOT_DIR"] = str(folder)
    try:
        rows = run_cases(tmp_path_factory, CASES, steps=2)
    finally:
        del os.environ["LLMEM_STUB_SNAPSHOT_DIR"]
    return {r["id"]: (r, load_snapshot(folder / f"{r['id']}.pickle")) for r in rows}


def _end_state(snap) -> tuple[int, int]:
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    return sum(s["total_size"] for s in snap["segments"]), sum(b["size"] for b in blocks
                                                               if b["state"] == "active_allocated")


@pytest.mark.parametrize("case", CASES)
def test_the_predicted_history_is_the_stubs_event_for_event(real, case):
    row, snap = real[case]
    assert row["status"] == "ok", row["error"]
    pred = snapshot_of(estimate_row(row, keep_trace=True), after_load=True)
    a, b = _entries(pred), _entries(snap)
    assert len(a) == len(b) > 1000
    if case in CACHE_RELEASE_CASES:
        assert a != b  # the cache's release order differs (else this case needs no exception)
        a, b = free_runs_as_sets(a), free_runs_as_sets(b)
    assert a == b
    assert segments_in_use(pred) == segments_in_use(snap)
    hp, hr = read_history(pred), read_history(snap)
    measured = row["measured"]
    assert hr.peak_allocated_bytes == measured["allocated_bytes"]  # the reader, on torch's own history
    assert hp.peak_allocated_bytes == measured["allocated_bytes"]
    assert hp.peak_reserved_bytes == hr.peak_reserved_bytes == measured["reserved_bytes"]
    assert _end_state(pred) == _end_state(snap)
    assert hp.allocated_before == hr.allocated_before  # the weights, as loaded before the history starts
    for s in (pred, snap):
        memory_viz.segsum(s)  # free + allocated == reserved, per torch's own check


def test_the_allocators_actions_equal_torchs_on_the_same_requests(stub):
    code = """
import json, torch
torch.cuda.memory._record_memory_history(max_entries=1000, context=None)
a = torch.empty(4000, dtype=torch.uint8, device="cuda")
b = torch.empty(12_000_000, dtype=torch.uint8, device="cuda")
c = torch.empty(1200, dtype=torch.uint8, device="cuda")
d = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
del a, d
e = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
del b
torch.cuda.empty_cache()
print(json.dumps([(x["action"], x["size"]) for x in torch.cuda.memory._snapshot()["device_traces"][0]]))
"""
    proc = stub.run_python(["-c", code], timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_side = [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]
    sizes = [4000, 12_000_000, 1200, 5 << 20, 3 << 20]
    events = [(1, 0, 4096), (1, 1, 12_000_256), (1, 2, 1536), (1, 3, 5 << 20), (-1, 0, 0), (-1, 3, 0),
              (1, 4, 3 << 20), (-1, 1, 0)]
    requested = [sizes[0], sizes[1], sizes[2], sizes[3], 0, 0, sizes[4], 0]
    alloc, history, _, _ = replay_history(events, requested, AllocatorConfig())
    alloc.history = history
    alloc.empty_cache()
    assert [(a, s) for a, _, s, _ in history] == torch_side


def test_compare_names_a_batch_twice_the_predicted_one(real):
    row, snap = real["tiny4-llama-3.2-1b-bf16-mixed-s256-b2-sdpa"]
    c = compare_snapshots(snapshot_of(estimate_row(row, keep_trace=True, micro_batch_size=1), after_load=True), snap)
    assert c.real_peak_allocated_bytes == row["measured"]["allocated_bytes"] > c.predicted_peak_allocated_bytes
    assert c.divergence is not None
    assert "activations are 2x the predicted" in c.meaning, c.meaning


def test_compare_names_the_fp32_upcast_a_16_bit_loss_lacks(real):
    from llmem_plugin.workload import LossImpl

    row, snap = real["tiny4-llama-3.2-1b-bf16-mixed-s256-b2-sdpa"]
    est = estimate_row(row, keep_trace=True, loss=LossImpl("no-upcast"))
    c = compare_snapshots(snapshot_of(est, after_load=True), snap)
    assert "fp32 copies of 16-bit logits" in c.meaning and "try --loss hf" in c.meaning, c.meaning
    same = compare_snapshots(snapshot_of(estimate_row(row, keep_trace=True), after_load=True), snap)
    assert same.meaning.startswith("the peaks agree") and not same.real_only, same.meaning


# ------------------------------------------------------------------------------------------ the adapters

_CAPACITY = 40 << 20  # the tiny job's weights and first step fit; the backward's cuBLAS workspace does not


def _job(stub, tmp_path, kind: str, capacity: int):
    env = {"PYTHONPATH": str(stub.ROOT)}
    proc = stub.run_python([str(stub.ROOT / "tests" / "stub" / "_snapshot_job.py"), kind, str(tmp_path),
                            str(capacity)], capacity=capacity, env=env, timeout_s=420)
    return proc, tmp_path / "snaps"


@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_the_adapters_write_both_snapshots_on_oom_and_the_error_goes_on(stub, tmp_path, kind):
    proc, folder = _job(stub, tmp_path, kind, _CAPACITY)
    assert proc.returncode != 0 and "TRAINED" not in proc.stdout
    assert "torch.OutOfMemoryError" in proc.stderr  # the job's own exception reached the top
    assert "llmem: predicted at the peak: activations" in proc.stderr
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["oom-compare-rank0.json", "oom-compare-rank0.txt", "oom-predicted-rank0.pickle",
                     "oom-real-rank0.pickle"]
    real = pickle.loads((folder / "oom-real-rank0.pickle").read_bytes())
    (oom,) = [e for e in real["device_traces"][0] if e["action"] == "oom"]
    result = json.loads((folder / "oom-compare-rank0.json").read_text())
    assert result["meaning"].startswith("both run out of memory"), result["meaning"]
    # The prediction fails on the request torch failed on.
    assert f"asking for {oom['size'] >> 20}.0 MiB" in result["meaning"].split(",")[0]


def test_the_hf_adapter_writes_the_first_steps_beside_the_prediction(stub, tmp_path):
    proc, folder = _job(stub, tmp_path, "hf", 1 << 40)
    assert proc.returncode == 0 and "TRAINED" in proc.stdout, proc.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["compare-rank0.json", "compare-rank0.txt",
                                                        "predicted-rank0.pickle", "real-rank0.pickle"]
    result = json.loads((folder / "compare-rank0.json").read_text())
    real = read_history(load_snapshot(folder / "real-rank0.pickle"))
    assert result["real_peak_allocated_bytes"] == real.peak_allocated_bytes > 0
    assert "predicted vs real" in (folder / "compare-rank0.txt").read_text()


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_a_ranks_predicted_snapshot_is_the_stub_ranks_event_for_event(stub, method):
    """Rank 0 of DDP and of FSDP2 on 2 GPUs (torch's fake process group; the real Reducer, and FSDP2 with
    its all-gather and reduce-scatter streams, on the stub), as tests/stub/test_distributed.py runs them,
    the history recorded from the built model's reset (before the method wraps it) to the end of the last
    step: the predicted rank snapshot from the same point has the same allocations and frees, in order,
    on the same streams (numbered by first use: torch's are CUDA stream handles), and the stub rank's
    peaks."""
    import torch

    from benchmarks.groundtruth.matrix import case_config
    from benchmarks.groundtruth.stub_distributed import CONFIGS, measure
    from llmem_plugin.methods import Layout
    from llmem_plugin.snapshot.predict import method_snapshots
    from llmem_plugin.workload import Workload

    config = next(c for c in CONFIGS if c.id == f"{method}-w2-tiny")
    got = measure(config, 0, timeout_s=180, extra={"history": True})
    assert "error" not in got, got.get("error")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # off on the stub (its cuDNN computes nothing), as predict() does
    try:
        snaps = method_snapshots(method, case_config(config.model, config.overrides), Workload(**config.workload),
                                 layout=Layout(num_gpus=2), gpu="h100-sxm", after_load=True,
                                 **config.estimator_options)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    sign = {"alloc": 1, "free_requested": -1}
    pred = _by_first_use([[sign[e["action"]], e["size"], e["stream"]] for e in snaps[0]["device_traces"][0]
                          if e["action"] in sign])
    assert len(pred) > 1000 and pred == _by_first_use(got["history"])
    assert len({stream for _, _, stream in pred}) == (3 if method == "fsdp" else 1)
    h = read_history(snaps[0])
    assert h.peak_allocated_bytes == max(s["allocated_bytes"] for s in got["steps"])
    assert h.peak_reserved_bytes == max(s["reserved_bytes"] for s in got["steps"])


def _by_first_use(events: list) -> list[tuple[int, int, int]]:
    """``(sign, bytes, stream)`` with the streams numbered 0, 1, ... in the order they are first used."""
    order: dict[int, int] = {}
    return [(sign, size, order.setdefault(stream, len(order))) for sign, size, stream in events]
