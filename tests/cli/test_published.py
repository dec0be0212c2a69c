"""The published set (benchmarks/published) and ``llmem validate --published``."""

from __future__ import annotations

import json

import pytest

from llmem_plugin import catalog
from llmem_plugin.cli import main
from llmem_plugin.errors import ConfigError
from llmem_plugin.estimate import estimate
from llmem_plugin.published import METRICS, check_published, default_path, load_published
from llmem_plugin.validate import _workload


def test_shipped_set_has_sources_and_enough_modelled_rows():
    rows = load_published()
    assert len(rows) >= 30
    assert len({r["id"] for r in rows}) == len(rows)
    modelled = [r for r in rows if r["status"] == "modelled"]
    assert len(modelled) >= 20
    for r in rows:
        assert r["source"]["url"].startswith("https://") and r["source"]["quote"]
        assert r["status"] == "modelled" or r["why"]  # every row the tool cannot estimate says why
    for r in modelled:
        assert r["metric"] in METRICS and catalog.lookup(r["model"]) == r["model"]
        # The quoted source text carries the figure (as printed, or as raw bytes converted).
        assert str(r["value"]).rstrip("0").rstrip(".") in r["source"]["quote"] or r["unit"] == "GiB"


def test_a_row_is_predicted_by_estimate_and_the_error_is_signed(tmp_path):
    row = next(r for r in load_published() if r["id"] == "rt-lora-llama2-7b-mb1-bf16")
    check = check_published(row)
    est = estimate(catalog.load_config(row["model"]), _workload(row["workload"]), fast=True, gpu=row["gpu"])
    assert check.predicted == est.peak_allocated_bytes
    assert check.measured == round(row["value"] * 10**9)  # lit-gpt prints max_memory_allocated() / 1e9
    assert check.error_pct == pytest.approx(100 * (check.predicted - check.measured) / check.measured)


def test_cli_published_on_a_small_file(tmp_path, capsys):
    rows = [r for r in load_published() if r["id"] in ("rt-lora-llama2-7b-mb1-bf16", "tt-readme-3b-compile")]
    path = tmp_path / "pub.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["validate", "--published", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unsupported"] == 1 and out["summary"]["allocated"]["rows"] == 1
    assert main(["validate", "--published", str(path)]) == 0
    assert "allocated: 1 rows" in capsys.readouterr().out


def test_bad_published_input_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ConfigError, match="lacks"):
        load_published(bad)
    assert main(["validate", "--published", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["validate"]) == 2
    assert "HINT" in capsys.readouterr().err
    assert default_path().name == "measurements.jsonl"
