"""`--html`: the report renders in headless Chromium with the network off, and shows the estimate's numbers.

Chromium is Debian's package (``apt-get install chromium``; .ci/run installs it and sets
LLMEM_REQUIRE_BROWSER, so the tests fail there instead of skipping)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ._run import run

TINY = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tiny-llama-2l.json")
MiB = 1 << 20
# No network: every host resolves to nothing and any proxy use fails (Chromium's own switches).
_OFFLINE = ["--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking"]


@pytest.fixture(scope="module")
def chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("LLMEM_REQUIRE_BROWSER"):
            pytest.fail("chromium is required (LLMEM_REQUIRE_BROWSER is set). HINT: apt-get install chromium")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return exe


def _render(exe: str, page: Path) -> tuple[str, str]:
    """The DOM after the page's scripts ran, and Chromium's log (console messages appear as CONSOLE lines)."""
    proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", *_OFFLINE, "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=30000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


def _embedded(page: str, element_id: str):
    m = re.search(rf"<script type='application/json' id='{element_id}'>(.*?)</script>", page, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_the_estimate_report_renders_offline_with_the_estimates_peak(chromium, tmp_path, capsys):
    page = tmp_path / "report.html"
    code, out, err = run(capsys, "estimate", "--model", TINY, "--seq-len", "64", "--json", "--html", str(page))
    assert code == 0, err
    est = json.loads(out)
    html = page.read_text()
    assert "https://" not in html.split("<script type='application/octet-stream'")[0]  # no CDN, no fetch
    dom, log = _render(chromium, page)
    assert "CONSOLE" not in log, [ln for ln in log.splitlines() if "CONSOLE" in ln]
    assert 'data-rendered="1"' in dom and dom.count("main-svg") >= 2  # both charts drawn by plotly
    figures = {f["id"]: f["fig"] for f in _embedded(html, "llmem-figures")}
    (allocated,) = [t for t in figures["reserved"]["data"] if t["name"] == "allocated"]
    assert round(max(allocated["y"]) * MiB) == est["peak_allocated_bytes"]
    stacked = figures["timeline"]["data"]  # the categories, stacked: their sum peaks at the history's peak
    totals = [sum(t["y"][i] for t in stacked) for i in range(len(stacked[0]["y"]))]
    assert round(max(totals) * MiB) == est["peak_allocated_bytes"]
    assert "peak allocated" in dom and "The step fits" in dom


def test_the_plan_report_lists_every_candidate(chromium, tmp_path, capsys):
    page = tmp_path / "plan.html"
    code, out, err = run(capsys, "plan", "--model", TINY, "--seq-len", "64", "--gpus", "2", "--gpu", "h100-sxm",
                         "--json", "--html", str(page))
    assert code == 0, err
    plan = json.loads(out)
    dom, log = _render(chromium, page)
    assert "CONSOLE" not in log and 'data-rendered="1"' in dom
    table = dom.split("id=\"candidates\"")[1].split("</table>")[0]
    rows = re.findall(r"<tr class=\"(chosen|)\">", table)
    assert len(rows) == len(plan["candidates"]) and rows.count("chosen") == 1
    memory = [int(v) for v in re.findall(r'<td class="mem" data-v="(\d+)">', table)]
    assert memory == [c["device_total_bytes"] for c in plan["candidates"]]


def test_an_output_file_that_cannot_be_written_is_refused_before_the_trace(tmp_path, capsys):
    from llmem_plugin.cli.options import EXIT_BAD_INPUT

    for flag, path, said in (("--html", tmp_path / "missing" / "r.html", "does not exist"),
                             ("--html", tmp_path / "r.png", "no known suffix"),
                             ("--snapshot", tmp_path / "missing" / "p.pickle", "does not exist")):
        code, _, err = run(capsys, "estimate", "--model", TINY, flag, str(path))
        assert code == EXIT_BAD_INPUT and said in err and "Traceback" not in err


def test_a_pipeline_snapshot_is_refused_before_the_trace(tmp_path, capsys, monkeypatch):
    """A pipeline schedule's ranks have no snapshot: one line, exit 2, and no estimate run first."""
    from llmem_plugin.cli import estimate as cli_estimate
    from llmem_plugin.cli.options import EXIT_BAD_INPUT

    def traced(*a, **k):
        raise AssertionError("the methods were estimated before the refusal")

    monkeypatch.setattr(cli_estimate, "_estimate_methods", traced)
    code, out, err = run(capsys, "estimate", "--model", TINY, "--method", "pp", "--gpus", "2", "--pp", "2",
                         "--precision", "bf16", "--snapshot", str(tmp_path / "p.pickle"))
    assert code == EXIT_BAD_INPUT and "pipeline schedule" in err and "HINT:" in err and "Traceback" not in err
    assert out == "" and not list(tmp_path.iterdir())
