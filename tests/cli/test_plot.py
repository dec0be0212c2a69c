"""The `plot` extra: the step picture of an estimate, the plan picture, and the
allocator timeline they draw (``Estimate.memory_timeline``)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import pytest

import llmem_plugin
from llmem_plugin.errors import ConfigError
from llmem_plugin.trace.tracker import Phase

from tests.conftest import tiny_config

pytest.importorskip("matplotlib")

from matplotlib import image as mpl_image
from matplotlib._pylab_helpers import Gcf

from llmem_plugin.cli import plot

GiB = 1 << 30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def est() -> llmem_plugin.Estimate:
    return llmem_plugin.estimate(tiny_config("llama"), seq_len=32, batch_size=2)


def png_shape(path) -> tuple[int, ...]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    return mpl_image.imread(path).shape


def test_memory_timeline_holds_the_reported_peaks(est):
    tl = est.memory_timeline
    assert 0 < len(tl) <= 512 + 8
    assert [p[0] for p in tl] == sorted({p[0] for p in tl})
    assert {p[1] for p in tl} <= {p.value for p in Phase}
    assert max(p[2] for p in tl) == est.peak_allocated_bytes
    assert max(p[3] for p in tl) == est.peak_reserved_bytes
    assert all(a <= r for _, _, a, r in tl)
    # Independent of the allocator: the allocated peak holds at least the live tensors' peak.
    at_peak = max(tl, key=lambda p: p[2])
    assert at_peak[2] >= est.peak_tensor_bytes
    d = json.loads(json.dumps(est.to_dict()))
    assert d["memory_timeline"] == [list(p) for p in tl]


def test_memory_timeline_comes_from_the_capped_replay_when_it_is_reported():
    cfg = tiny_config("llama", hidden_size=256, intermediate_size=640, num_hidden_layers=4)
    roomy = llmem_plugin.estimate(cfg, seq_len=1024, batch_size=2)
    # 2 MiB short: the free replay no longer fits, the capped one frees cache, retries and fits.
    tight = llmem_plugin.estimate(cfg, seq_len=1024, batch_size=2, gpu_memory=roomy.device_total_bytes - 2 * 2**20)
    assert tight.fits and tight.peak_reserved_bytes < roomy.peak_reserved_bytes
    assert max(p[3] for p in tight.memory_timeline) == tight.peak_reserved_bytes
    assert max(p[2] for p in tight.memory_timeline) == tight.peak_allocated_bytes


def test_plot_estimate_writes_a_png(est, tmp_path):
    figures = Gcf.get_num_fig_managers()
    out = tmp_path / "step.png"
    plot.plot_estimate(est, out)
    w, h = plot._ESTIMATE_SIZE_IN
    assert png_shape(out) == (round(h * 120), round(w * 120), 4)
    assert Gcf.get_num_fig_managers() == figures  # nothing left open in pyplot


def test_plot_estimate_is_deterministic(est, tmp_path):
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    plot.plot_estimate(est, a)
    plot.plot_estimate(est, b)
    assert a.read_bytes() == b.read_bytes()
    ET.parse(a)  # well-formed


def test_fast_estimate_plots_its_built_stream_and_refuses_without_one(tmp_path, monkeypatch):
    cfg = tiny_config("llama", num_hidden_layers=9)
    fast = llmem_plugin.estimate(cfg, seq_len=32, fast=True)
    full = llmem_plugin.estimate(cfg, seq_len=32)
    # The replay of the built stream is the full trace's, point for point.
    assert fast.fast and fast.memory_timeline == full.memory_timeline != []
    plot.plot_estimate(fast, tmp_path / "step.png")
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from llmem_plugin.trace import fastsynth

    def fail(*args, **kwargs):
        raise fastsynth.SynthesisError("test")

    monkeypatch.setattr(fastsynth, "full_depth_trace", fail)
    extrapolated = llmem_plugin.estimate(cfg, seq_len=32, fast=True)
    assert extrapolated.fast and extrapolated.memory_timeline == []
    with pytest.raises(ConfigError, match="HINT: drop --fast"):
        plot.plot_estimate(extrapolated, tmp_path / "other.png")
    assert not (tmp_path / "other.png").exists()


ROWS = [
    ("ddp x8", {"parameters": 16 * GiB, "gradients": 16 * GiB, "optimizer_states": 64 * GiB, "activations": 9 * GiB}),
    ("zero2 x8", {"parameters": 16 * GiB, "gradients": 2 * GiB, "optimizer_states": 8 * GiB, "activations": 9 * GiB,
                  "allocator_slack": GiB, "context_nccl": GiB}),
    ("fsdp x8", {"parameters": 2 * GiB, "temporaries": 3 * GiB}),
]


def test_plot_plan_writes_png_and_svg(tmp_path):
    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"
    for path in (png, svg):
        plot.plot_plan(ROWS, capacity_bytes=80 * GiB, margin=0.1, chosen=1, path=path, title="three options")
    assert png_shape(png) == (round(plot._plan_height_in(3) * 120), round(plot._PLAN_WIDTH_IN * 120), 4)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert "zero2 x8" in svg.read_text()  # labels are drawn as glyph paths, but the SVG names its text


def test_plot_plan_grows_with_its_rows(tmp_path):
    many = [(f"option {i}", {"parameters": (i + 1) * GiB}) for i in range(60)]
    plot.plot_plan(many, capacity_bytes=80 * GiB, margin=0.0, chosen=None, path=tmp_path / "many.png")
    assert png_shape(tmp_path / "many.png")[0] > 4 * round(plot._plan_height_in(3) * 120)


def test_plot_plan_refuses_bad_input(tmp_path):
    ok = {"capacity_bytes": 80 * GiB, "margin": 0.1, "chosen": None, "path": tmp_path / "p.png"}
    with pytest.raises(AssertionError, match="outside PLAN_SEGMENTS"):
        plot.plot_plan([("x", {"weights": GiB})], **ok)
    with pytest.raises(ConfigError, match="margin"):
        plot.plot_plan(ROWS, **{**ok, "margin": 1.0})
    with pytest.raises(ConfigError, match="png, svg, pdf"):
        plot.plot_plan(ROWS, **{**ok, "path": tmp_path / "p.jpg"})
    with pytest.raises(ConfigError, match="no rows"):
        plot.plot_plan([], **ok)


def test_missing_matplotlib_says_what_to_install(monkeypatch, est, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'llmem_plugin\[plot\]'"):
        plot.plot_estimate(est, tmp_path / "step.png")
