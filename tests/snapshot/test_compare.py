"""`llmem compare` on predicted snapshots of jobs that differ in a known way (the stub device's real snapshots:
tests/stub/test_snapshot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.estimate import estimate
from llmem_plugin.snapshot.compare import compare_snapshots
from llmem_plugin.snapshot.predict import snapshot_of, write_snapshot

from ..cli._run import run

TINY = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tiny-llama-2l.json")


def _snap(**kw):
    base = dict(seq_len=128, micro_batch_size=2, precision="bf16-mixed", keep_trace=True)
    return snapshot_of(estimate(TINY, **{**base, **kw}))


@pytest.fixture(scope="module")
def batch2():
    return _snap()


def test_the_same_job_agrees_everywhere(batch2):
    c = compare_snapshots(batch2, batch2)
    assert c.divergence is None and not c.predicted_only and not c.real_only
    assert c.num_matched_tokens == c.num_predicted_tokens == c.num_real_tokens
    assert c.meaning.startswith("the peaks agree")


def test_a_run_at_twice_the_batch_is_named_as_scaled_activations(batch2):
    c = compare_snapshots(_snap(micro_batch_size=1), batch2)
    assert c.real_peak_allocated_bytes > c.predicted_peak_allocated_bytes
    assert c.divergence is not None and c.divergence.real_bytes > c.divergence.predicted_bytes
    assert "activations are 2x the predicted" in c.meaning and "batch 1 x 128 tokens" in c.meaning


def test_an_fp32_upcast_loss_against_a_16_bit_one_is_named_as_the_loss_path(batch2):
    c = compare_snapshots(_snap(loss="no-upcast"), batch2)
    assert "fp32 copies of 16-bit logits" in c.meaning and "try --loss hf" in c.meaning
    # The reverse: the prediction upcasts, the run does not.
    r = compare_snapshots(batch2, _snap(loss="no-upcast"))
    assert "the prediction holds" in r.meaning and "try --loss no-upcast" in r.meaning


def test_the_cli_prints_the_comparison_and_refuses_bad_input(batch2, tmp_path, capsys):
    pred, real = tmp_path / "pred.pickle", tmp_path / "real.pickle"
    write_snapshot(_snap(micro_batch_size=1), pred)
    write_snapshot(batch2, real)
    code, out, err = run(capsys, "compare", str(pred), str(real), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["real_peak_allocated_bytes"] > d["predicted_peak_allocated_bytes"] and "activations" in d["meaning"]
    code, out, _ = run(capsys, "compare", str(pred), str(real))
    assert code == 0 and "first divergence" in out and "live at the real peak only" in out
    for argv, said in ((["compare", str(tmp_path / "missing.pickle"), str(real)], "cannot read snapshot"),
                       (["compare", TINY, str(real)], "is not a memory snapshot"),
                       (["compare", str(pred), str(real), "--threshold", "2"], "--threshold 2 is outside")):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_BAD_INPUT and said in err and "Traceback" not in err
