"""``llmem validate`` on stub-device rows: their own kind of evidence.

Rows of ``python -m benchmarks.groundtruth.run --device stub`` carry
``device_kind: "stub"``: the caching allocator's peaks for a step whose
kernels did nothing. They are reported apart from GPU rows, never counted in
the GPU summary or the fits/OOM score, their device total is "not measured",
and they are predicted with SDPA's cuDNN backend as the row ran it (off).
The rows here are synthetic (measured = predicted + known offsets), as in
test_validate.py: they test the plumbing.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from llmem_plugin.models import catalog
from llmem_plugin.cli.app import main
from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.errors import ConfigError
from llmem_plugin.estimate import estimate
from llmem_plugin.verify.validate import check_row, device_kind, load_rows, validate_rows
from llmem_plugin.workload import Workload

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
H100 = "NVIDIA H100 80GB HBM3"
MEMORY = 85520809984  # what the stub's torch.cuda.get_device_properties reports for h100-sxm
WL = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", attn_implementation="sdpa")


@pytest.fixture(scope="module")
def prediction() -> tuple[int, int, int]:
    cfg = catalog.load_config("llama-3.2-1b", TINY)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        est = estimate(cfg, WL, gpu="h100-sxm", gpu_memory=MEMORY, alloc_conf="", torch_version="2.13.0")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    return est.peak_allocated_bytes, est.peak_reserved_bytes, est.device_total_bytes


def _row(row_id: str, pred: tuple[int, int, int], *, kind: str = "stub", offsets: tuple[int, int] = (0, 0),
         edge: bool = False, status: str = "ok") -> dict:
    stub = kind == "stub"
    return {
        "id": row_id, "model": "llama-3.2-1b", "config_overrides": TINY, "runner": "torch",
        "device": "stub" if stub else "cuda", "device_kind": kind, "edge": edge, "workload": WL.to_dict(),
        "status": status, "error": None, "steps": [],
        "measured": {"allocated_bytes": pred[0] + offsets[0], "reserved_bytes": pred[1] + offsets[1],
                     "device_total_bytes": None if stub else pred[2]},
        "gpu": {"name": H100, "memory_bytes": MEMORY, "compute_capability": [9, 0], "idle_used_bytes": None},
        "env": {"torch": "2.13.0+cu130", "PYTORCH_CUDA_ALLOC_CONF": ""}, "seconds": 1.0,
        "stub": {"gpu": "h100-sxm", "cudnn_sdp_enabled": False, "neutralised": {}, "device_reads": []}
        if stub else None,
    }


def test_stub_rows_are_summarised_apart_from_gpu_rows(prediction):
    exact = _row("stub-exact", prediction)
    off = _row("stub-off", prediction, offsets=(-2**20, 2 * 2**20))  # stub 1 MiB under, 2 MiB over the estimate
    gpu = _row("gpu", prediction, kind="gpu")
    report = validate_rows([exact, off, gpu])
    kinds = {c.id: c.kind for c in report.rows}
    assert kinds == {"stub-exact": "stub", "stub-off": "stub", "gpu": "gpu"}
    # The GPU summary holds the GPU row only; the stub summary the two stub rows.
    assert report.summary["allocated"].num_rows == 1 and report.summary["reserved"].num_rows == 1
    assert report.stub_summary["allocated"].num_rows == 2 and report.stub_summary["reserved"].num_rows == 2
    assert report.stub_summary["device_total"].num_rows == 0  # not measured on the stub
    assert report.stub_summary["reserved"].num_under == 1
    e, o, _ = report.rows
    assert e.diff_bytes["allocated"] == 0 and e.diff_bytes["reserved"] == 0
    assert o.diff_bytes["allocated"] == 2**20 and o.diff_bytes["reserved"] == -2 * 2**20
    assert e.measured["device_total"] is None and e.error_pct["device_total"] is None
    assert e.predicted["device_total"] is not None
    assert report.num_stub_exact == 1 and [r.id for r in report.stub_rows] == ["stub-exact", "stub-off"]
    d = report.to_dict()
    assert d["stub_summary"]["num_rows"] == 2 and d["stub_summary"]["num_exact"] == 1
    assert d["summary"]["allocated"]["num_rows"] == 1
    assert {r["kind"] for r in d["rows"]} == {"stub", "gpu"}


def test_stub_edge_rows_are_not_scored_for_fits(prediction):
    report = validate_rows([_row("stub-edge", prediction, edge=True)])
    assert report.fits_accuracy is None and report.num_edge_rows == 0


def test_stub_rows_are_predicted_with_cudnn_attention_off(prediction, monkeypatch):
    est_mod = sys.modules["llmem_plugin.estimate"]  # the package re-exports the function under the same name
    seen = []
    real = est_mod.estimate

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(est_mod, "estimate", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    check_row(_row("stub", prediction))
    check_row(_row("gpu", prediction, kind="gpu"))
    assert seen == [False, before]  # the stub row's setting, then the process's own for the GPU row
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_device_kind_of_old_and_bad_rows(prediction):
    old = _row("old", prediction, kind="gpu")
    del old["device_kind"]
    assert device_kind(old) == "gpu"
    assert device_kind({**old, "device": "cpu"}) == "cpu"
    assert device_kind({**old, "device": "stub"}) == "stub"
    bad = copy.deepcopy(old)
    bad["device_kind"] = "tpu"
    with pytest.raises(ConfigError, match="device_kind 'tpu'; valid: gpu, stub, cpu"):
        check_row(bad)


def test_cli_reports_stub_rows_in_their_own_section(prediction, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    rows = [_row("gpu-row", prediction, kind="gpu"), _row("stub-row", prediction, offsets=(512, 0))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["validate", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stub_summary"]["num_rows"] == 1 and d["stub_summary"]["num_exact"] == 0
    assert d["summary"]["allocated"]["num_rows"] == 1
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    gpu_part, stub_part = out.split("stub device", 1)
    assert "gpu-row" in gpu_part and "stub-row" not in gpu_part
    assert "stub-row" in stub_part and "not measured" in stub_part and "-512" in stub_part
    assert "equal to the estimate byte for byte (allocated and reserved): 0 of 1" in stub_part
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "device_kind": "tpu"}) + "\n")
    assert main(["validate", str(bad)]) == EXIT_BAD_INPUT


# Rows of the stub's distributed runner (benchmarks/groundtruth/stub_distributed.py): the preset's name in
# ``method`` beside world_size, tp, rank and options. Their measured peaks are the stub's own.
DIST = Path(__file__).resolve().parents[2] / "benchmarks" / "groundtruth" / "data" / \
    "stub-distributed-h100-2026-11-25.jsonl"


def test_stub_distributed_rows_are_predicted_rank_by_rank(monkeypatch):
    import llmem_plugin.methods as methods

    rows = {r["id"]: r for r in load_rows(DIST)}
    assert len(rows) == 38
    assert rows["lowlevel-zero2-w2-tiny-r1"]["method"] == {"name": "lowlevel-zero2", "num_gpus": 2, "num_nodes": 1,
                                                           "tp": 1, "rank": 1, "options": {"stage": 2}}
    calls = []
    real = methods.estimate_method
    monkeypatch.setattr(methods, "estimate_method", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    # stage 2 is the preset's own (the runner passes it to the plugin only); rank 3 of dp x tp is not
    # reported by the estimate and reads as the reported rank alike to it.
    picked = [rows[i] for i in ("lowlevel-zero2-w2-tiny-r0", "lowlevel-zero2-w2-tiny-r1", "dp-tp2-w4-tiny-r3")]
    report = validate_rows(picked)
    assert calls == ["lowlevel-zero2", "dp-tp"]  # one estimate for both ranks of a config
    for c, row in zip(report.rows, picked, strict=True):
        assert c.kind == "stub" and c.runner == "stub-distributed" and c.note == ""
        # The stub's allocator peaks (73,400,320 B reserved on both LowLevelZero ranks), byte for byte.
        assert (c.predicted["allocated"], c.predicted["reserved"]) == (
            row["measured"]["allocated_bytes"], row["measured"]["reserved_bytes"])
    assert report.rows[0].measured["reserved"] == 73400320
    assert report.num_stub_exact == 3


def test_stub_distributed_rows_that_cannot_be_read(tmp_path):
    row = json.loads(DIST.read_text().splitlines()[2])  # ddp-w2-tiny-r0
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({**row, "world_size": None}) + "\n")
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: world_size is None, not a JSON integer\. HINT: rows of "
                                          "the stub's distributed runner"):
        load_rows(path)
    low = {**row, "id": "zero1-stage2", "method": "lowlevel-zero1", "options": {"stage": 2}}
    c = check_row(low)
    assert c.predicted["allocated"] is None and c.note == (
        "not predicted: row 'zero1-stage2': option stage=2 contradicts method 'lowlevel-zero1', which fixes "
        "stage=1. HINT: name the preset that sets it, or drop the option")


def test_cli_validates_stub_distributed_rows(tmp_path, capsys):
    lines = DIST.read_text().splitlines()
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines[2:4]) + "\n")  # ddp-w2-tiny, ranks 0 and 1
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ddp-w2-tiny-r0" in out and "ddp-w2-tiny-r1" in out
    assert "equal to the estimate byte for byte (allocated and reserved): 2 of 2" in out
