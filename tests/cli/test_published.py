"""The published set (benchmarks/published) and ``llmem validate --published``."""

from __future__ import annotations

import json
import re

import pytest

from llmem_plugin.models import catalog
from llmem_plugin.cli.app import main
from llmem_plugin.errors import ConfigError
from llmem_plugin.verify.published import METRICS, check_published, default_path, load_published, validate_published

_UNIT = {"GB": 10**9, "GiB": 2**30, "MiB": 2**20}


def _quote_carries(row) -> bool:
    """The quote holds the figure as printed, or as raw bytes that convert to it."""
    quote, value = row["source"]["quote"], row["value"]
    if str(value).rstrip("0").rstrip(".") in quote:
        return True
    raw = [int(x) for x in re.findall(r"\d{7,}", quote)]
    return any(abs(x / _UNIT[row["unit"]] - value) < 0.001 for x in raw)


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
        assert r["metric"] in METRICS
        if r["model"].startswith("litgpt:"):  # litgpt's own class, from litgpt's config table
            litgpt_config = pytest.importorskip("litgpt.config")
            assert litgpt_config.Config.from_name(r["model"].removeprefix("litgpt:")).name == r["model"][7:]
        else:
            assert catalog.lookup(r["model"]) == r["model"]
        assert _quote_carries(r), r["id"]


def _row(**kw):
    base = {"id": "t", "source": {"url": "https://example.org", "quote": "x"}, "status": "modelled", "why": "",
            "model": "gpt2", "gpu": "h100-sxm", "unit": "GB", "metric": "allocated", "value": 1.0,
            "workload": {"seq_len": 64, "precision": "bf16"}}
    return {**base, **kw}


def test_units_the_signed_error_and_the_start_point_of_reserved_above_init():
    gb, mib = check_published(_row(value=1.0, unit="GB")), check_published(_row(value=1000.0, unit="MiB"))
    assert gb.measured == 10**9 and mib.measured == 1000 * 2**20
    assert gb.predicted == mib.predicted  # the same prediction, compared in bytes
    assert gb.error_pct == pytest.approx(100 * (gb.predicted - 10**9) / 10**9)
    reserved = check_published(_row(metric="reserved"))
    above = check_published(_row(metric="reserved_above_init", init_reserved_bytes=2 * 2**20))
    assert reserved.predicted - above.predicted == 2 * 2**20
    result = validate_published([_row(metric="reserved"), _row(metric="reserved_above_init", init_reserved_bytes=0,
                                                                value=2.0)])
    pooled = result["reserved_pooled"]  # both reserved metrics together: the same prediction against 1 and 2 GB
    assert pooled["rows"] == 2
    assert pooled["mean_abs_pct"] == pytest.approx((abs(reserved.error_pct) + abs(reserved.predicted / 2e7 - 100)) / 2)


def test_a_row_with_a_lengths_file_replays_a_run_of_those_lengths(tmp_path):
    (tmp_path / "lengths").mkdir()
    (tmp_path / "lengths" / "one.txt").write_text("64\n" * 5)
    fixed = _row(metric="reserved")
    path = tmp_path / "pub.jsonl"
    path.write_text(json.dumps({**fixed, "seq_lens": "lengths/one.txt"}) + "\n")
    row = load_published(path)[0]
    assert row["seq_lens"] == str(tmp_path / "lengths" / "one.txt")  # resolved beside the set
    # Every batch the same length: the run replays as the fixed-shape estimate (tests/techniques/test_varlen.py).
    assert check_published(row).predicted == check_published(fixed).predicted
    # Batches of 128 of the 512 tokens a sample may hold: the activations of 128-token steps.
    (tmp_path / "lengths" / "short.txt").write_text("128\n")
    long = _row(workload={"seq_len": 512, "micro_batch_size": 4, "precision": "bf16"})
    short = _row(workload={"seq_len": 128, "micro_batch_size": 4, "precision": "bf16"})
    path.write_text(json.dumps({**long, "seq_lens": "lengths/short.txt"}) + "\n")
    assert check_published(load_published(path)[0]).predicted == check_published(short).predicted
    assert check_published(short).predicted < check_published(long).predicted


def test_cli_published_on_a_small_file(tmp_path, capsys):
    rows = [r for r in load_published() if r["id"] in ("rt-lora-llama2-7b-mb1-bf16", "tt-readme-3b-compile")]
    path = tmp_path / "pub.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["validate", "--published", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["unsupported"] == 1 and out["summary"]["allocated"]["rows"] == 1
    assert main(["validate", "--published", str(path)]) == 0
    assert "allocated: 1 rows" in capsys.readouterr().out


@pytest.mark.parametrize(("fields", "match"), [
    ({"value": "abc"}, "not a positive number"),
    ({"value": 0}, "not a positive number"),
    ({"model": "no-such-model"}, "not in the catalog"),
    ({"source": "x"}, "source needs url and quote"),
    ({"metric": "reserved_above_init"}, "init_reserved_bytes"),
    ({"seq_lens": "lengths/none.txt"}, "not a file beside"),
])
def test_bad_rows_are_one_line(tmp_path, fields, match):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row(**fields)) + "\n")
    with pytest.raises(ConfigError, match=match):
        load_published(bad)


def test_bad_published_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["validate", "--published", str(bad)]) == 2
    assert main(["validate", "--published", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["validate"]) == 2
    assert main(["validate", "--published", "--gpu", "a10g"]) == 2
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps(_row(workload={"seq_len": 64, "no_such_field": 1})) + "\n")
    assert main(["validate", "--published", str(unknown)]) == 2
    err = capsys.readouterr().err
    assert err.count("HINT") >= 4 and "Traceback" not in err
    assert default_path().name == "measurements.jsonl"
