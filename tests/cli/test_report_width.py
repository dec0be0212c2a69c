"""Every table the CLI prints fits 80 columns with its names whole (llmem_plugin.cli.columns), and the
column fitting itself against closed forms."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

import llmem_plugin
from llmem_plugin.cli import report
from llmem_plugin.cli.columns import Column, fit_columns, fitted_table, table_width
from llmem_plugin.device.gpus import get_gpu, gpu_names
from llmem_plugin.summary import render_estimate

from ._run import run

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "benchmarks" / "tiny-llama-2l.json")  # a 2-layer llama config
# The narrowest terminal the tables are made for (a VT100's 80 columns), and a wide one.
NARROW, WIDE = 80, 200


def _render(draw, width: int = NARROW) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    draw(console)
    return console.export_text()


def _fits(text: str, width: int = NARROW) -> None:
    too_wide = [line for line in text.splitlines() if cell_len(line) > width]
    assert not too_wide, f"{len(too_wide)} lines over {width} cells:\n" + "\n".join(too_wide)
    assert "…" not in text, "rich cut a cell"


def _table_lines(text: str) -> str:
    """Only the table rows (the lines between borders), so that a name found there was not found in prose."""
    return "\n".join(line for line in text.splitlines() if line.startswith(("│", "┃")))


def _column(text: str, index: int) -> str:
    """The text of a table's column ``index``, its lines joined with their spaces taken out (so that a cell
    wrapped over several lines reads as one)."""
    return "".join("".join(line.split("│")[index + 1].split()) for line in text.splitlines()
                   if line.startswith("│"))


# --- columns.py against closed forms -------------------------------------------------------------------------

def test_a_table_is_its_widest_lines_plus_three_cells_a_column_and_one():
    cols = [Column(header="name", cells=["a100-40gb", "l4"]), Column(header="GiB", cells=["40.00", "24.00"])]
    shown, left_out, broken = fit_columns(cols, 80)
    assert shown == cols and not left_out and not broken
    assert table_width([9, 5]) == 9 + 5 + 3 * 2 + 1
    table, gone = fitted_table(cols, 80)
    text = _render(lambda c: c.print(table))
    assert {cell_len(line) for line in text.splitlines()} == {table_width([9, 5])} and gone == []


def test_headers_break_at_spaces_first_the_one_that_saves_most():
    cols = [Column(header="name", cells=["x"]), Column(header="bf16 TFLOP/s", cells=["1.0"]),
            Column(header="mem GB/s", cells=["9"])]
    whole = table_width([4, 12, 8])
    # One cell short: breaking "bf16 TFLOP/s" (12 -> 7) saves 5, "mem GB/s" (8 -> 4) saves 4.
    shown, left_out, broken = fit_columns(cols, whole - 1)
    assert shown == cols and not left_out and broken == {id(cols[1])}
    table, _ = fitted_table(cols, whole - 1)
    text = _render(lambda c: c.print(table))
    assert max(map(cell_len, text.splitlines())) == table_width([4, 7, 8])
    assert "TFLOP/s" in text and "bf16 " in text
    # Narrower still: both break; narrower than that, nothing is optional, so nothing more is done.
    assert fit_columns(cols, table_width([4, 7, 8]) - 1)[2] == {id(cols[1]), id(cols[2])}


def test_optional_columns_go_empty_first_then_highest_drop_and_are_named_left_to_right():
    cols = [Column(header="name", cells=["zero3-offload"]),
            Column(header="a", cells=["1234567"], drop=1),
            Column(header="b", cells=["1234567"], drop=3),
            Column(header="c", cells=[""], drop=1),
            Column(header="d", cells=["1234567"], drop=2)]
    everything = table_width([13, 7, 7, 1, 7])
    assert fit_columns(cols, everything)[1] == []
    assert fit_columns(cols, everything - 1)[1] == [cols[3]]  # the empty one, though its drop is lowest
    assert fit_columns(cols, table_width([13, 7, 7, 7]) - 1)[1] == [cols[3], cols[2]]
    shown, left_out, _ = fit_columns(cols, table_width([13]))
    assert shown == [cols[0]] and left_out == [cols[3], cols[2], cols[4], cols[1]]
    _, named = fitted_table(cols, table_width([13, 7]))
    assert named == ["b", "c", "d"]  # table order, not the order they went


def test_a_header_broken_for_an_optional_column_is_joined_again_once_that_column_is_gone():
    cols = [Column(header="name", cells=["n"]), Column(header="long header", cells=["1"]),
            Column(header="x", cells=["1234567890"], drop=1)]
    width = table_width([4, 11])
    shown, left_out, broken = fit_columns(cols, width)
    assert shown == cols[:2] and left_out == [cols[2]] and broken == set()


def test_a_wrapping_column_takes_the_room_left_and_breaks_at_spaces_and_dashes_not_inside_numbers():
    text = "tiny-llama-3.2-1b-bf16-mixed some words 1,234.56 -0.5%"
    cols = [Column(header="name", cells=["h100-sxm"]), Column(header="why", cells=[text], wrap=True)]
    width = table_width([8, 14])
    table, _ = fitted_table(cols, width)
    out = _render(lambda c: c.print(table), width)
    _fits(out, width)
    assert max(map(cell_len, out.splitlines())) == width
    pieces = [line.split("│")[2].strip() for line in _table_lines(out).splitlines()[1:]]
    assert pieces == ["tiny-", "llama-3.2-1b-", "bf16-mixed", "some words", "1,234.56 -0.5%"]
    # Wide: one line, as wide as the text.
    table, _ = fitted_table(cols, WIDE)
    assert text in _render(lambda c: c.print(table), WIDE)


def test_a_wrapping_column_is_never_narrower_than_its_minimum_nor_its_longest_header_word():
    cols = [Column(header="n", cells=["x" * 40]), Column(header="measured GiB", cells=["1 2 3 4 5 6 7 8 9"],
                                                         wrap=True)]
    shown, left_out, broken = fit_columns(cols, 60)
    assert shown == cols
    table, _ = fitted_table(cols, table_width([40, 12]))
    out = _render(lambda c: c.print(table), 80)
    assert "measured" in out and max(map(cell_len, out.splitlines())) == table_width([40, 12])


def test_a_word_wider_than_the_wrapping_column_is_cut_into_pieces_and_keeps_its_space():
    cols = [Column(header="v", cells=["abcdefghijklmnopqrstuvwxyz x"], wrap=True)]
    table, _ = fitted_table(cols, table_width([12]))
    out = _table_lines(_render(lambda c: c.print(table), 80))
    assert [line.strip("│ ") for line in out.splitlines()[1:]] == ["abcdefghijkl", "mnopqrstuvwx", "yz x"]


# --- every table the CLI prints, at 80 columns ---------------------------------------------------------------

def test_models_table(capsys):
    code, out, _ = run(capsys, "models", "--json")
    rows = json.loads(out)
    assert code == 0
    for width in (NARROW, WIDE):
        text = _render(lambda c: report.render_models(rows, c), width)
        _fits(text, width)
        table = _table_lines(text)
        assert all(f" {r['name']} " in table and f"{r['params']:,}" in table for r in rows)


def test_gpus_table_keeps_every_name_and_names_what_it_left_out():
    rows = [get_gpu(n).to_dict() for n in gpu_names()]
    text = _render(lambda c: report.render_gpus(rows, c))
    _fits(text)
    table = _table_lines(text)
    for r in rows:
        assert f" {r['name']} " in table and f" {r['display_name']} " in table
    assert "left out at 80 columns: " in text and "--json" in text
    wide = _render(lambda c: report.render_gpus(rows, c), WIDE)
    assert "left out" not in wide and "fp32 TFLOP/s" in wide and "nvlink4" in wide


@pytest.fixture(scope="module")
def tiny_estimate():
    return llmem_plugin.estimate(TINY, seq_len=128, fast=True)


def test_estimate_tables(tiny_estimate):
    long = dataclasses.replace(tiny_estimate,
                               peak_module="base_model.model.model.layers.31.self_attn.q_proj.lora_A.default")
    for est in (tiny_estimate, long):
        text = _render(lambda c: render_estimate(est, c))
        _fits(text)
        assert "torch.cuda.max_memory_allocated" in "".join(text.split())  # wrapped, not cut
        for cat in ("parameters", "optimizer_states", "peak tensors", "device total", "verdict"):
            assert cat in _table_lines(text)
    assert "layers.31.self_attn" in "".join(_render(lambda c: render_estimate(long, c)).split())
    assert "torch.cuda.max_memory_allocated" in str(tiny_estimate)  # Estimate.__str__: 100 columns


@pytest.fixture(scope="module")
def method_rows():
    from llmem_plugin.device.host import resolve_host_memory
    from llmem_plugin.methods import Layout, estimate_method

    wl = llmem_plugin.Workload(seq_len=128)
    gpu = get_gpu("h100-sxm")
    rows = [estimate_method(name, TINY, wl, layout=Layout(num_gpus=8, tp=tp), gpu=gpu, fast=True)
            for name, tp in (("ddp", 1), ("zero3-offload", 1), ("lowlevel-zero2", 1), ("fsdp-tp", 2))]
    host = resolve_host_memory(None, gpu=gpu, gpus_per_node=8)
    return rows, gpu, host


def test_methods_table(method_rows):
    rows, gpu, host = method_rows
    skipped = [("single", "--method single runs on one GPU, got --gpus 8")]
    text = _render(lambda c: report.render_methods(rows, skipped, gpu, c, host=host))
    _fits(text)
    table = _table_lines(text)
    for est in rows:
        assert f" {est.method} " in table
    assert "left out at 80 columns: comm/step intra, inter (--json has them all)" in " ".join(text.split())
    wide = _render(lambda c: report.render_methods(rows, skipped, gpu, c, host=host), WIDE)
    assert "comm/step intra" in wide and "left out" not in wide


@pytest.fixture(scope="module")
def tiny_plan():
    return llmem_plugin.plan(TINY, gpu="h100-sxm", num_gpus=2, workload=llmem_plugin.Workload(seq_len=128),
                             verify=False)


@pytest.mark.parametrize("show_all", [False, True])
def test_plan_table(tiny_plan, show_all):
    text = _render(lambda c: report.render_plan(tiny_plan, c, show_all=show_all))
    _fits(text)
    table = _table_lines(text)
    rows = report.plan_rows(tiny_plan, show_all)
    assert rows and all(f" {c.method_label} " in table for c in rows)
    assert "tokens/s" in table
    wide = _render(lambda c: report.render_plan(tiny_plan, c, show_all=show_all), WIDE)
    assert "host GiB/node" in wide and "screened" in wide and "left out" not in wide


def test_validation_tables_wrap_their_long_row_ids():
    from llmem_plugin.verify.validate import load_rows, validate_rows

    base = validate_rows(load_rows(ROOT / "tests" / "fixtures" / "groundtruth-cpu.jsonl")[:1], fast=True)
    # Real ids from the committed data, the longest an 81-character one (wider than the terminal).
    ids = ["pub-litgpt-llama-3.1-8b-bf16-s512-b2-lora-sdpa-paged-adamw-nf4-kbit-off-no-upcast",
           "llama-3.2-1b-bf16-s4096-b4-gc-sdpa-adamw-fused"]
    measured = [dataclasses.replace(base.rows[0], id=ids[0], edge=True)]
    stub = [dataclasses.replace(base.rows[0], id=ids[1], kind="stub")]
    rep = dataclasses.replace(base, rows=measured + stub, stub_summary=base.summary)
    text = _render(lambda c: report.render_validation(rep, c))
    _fits(text)
    rows = _column(text, 0)
    assert ids[0] + "(edge)" in rows and ids[1] in rows
    wide = _render(lambda c: report.render_validation(rep, c), WIDE)
    assert f"{ids[0]} (edge)" in wide and "fits meas/pred" in wide and "device total" in wide


def test_published_tables():
    from llmem_plugin.verify.published import load_published, validate_published

    rows = load_published()
    pick = [r for r in rows if r["id"] in ("peft-mmqa-lora-rank10-target-mlp", "hf-perf1gpu-bertl-bs1-ga4-gc-fp32")]
    pick += [r for r in rows if r["status"] != "modelled"][:2]
    result = validate_published(pick)
    text = _render(lambda c: report.render_published(result, c))
    _fits(text)
    assert "peft-mmqa-lora-rank10-target-mlp" in _table_lines(text)


def test_varlen_table():
    from llmem_plugin.techniques.varlen import estimate_variable_length

    wl = llmem_plugin.Workload(seq_len=512, micro_batch_size=4, precision="bf16-mixed", attn_implementation="sdpa")
    v = estimate_variable_length(TINY, wl, "16:512:150", steps=8)
    text = _render(lambda c: report.render_varlen(v, wl, "h100-sxm", c))
    _fits(text)
    assert "".join(f"fixed shape at the longest micro-batch ({v.longest} tokens)".split()) in _column(text, 0)
    wide = _render(lambda c: report.render_varlen(v, wl, "h100-sxm", c), WIDE)
    assert f"fixed shape at the longest micro-batch ({v.longest} tokens)" in wide


@pytest.mark.parametrize("path", ["axolotl/llama3_2_1b_qlora.yaml", "llamafactory/llama3_2_3b_full_sft_ds3.yaml",
                                  "trl/qwen2_5_0_5b_dpo_lora.yaml"])
def test_recipe_table_keeps_every_key(path):
    from llmem_plugin.recipes import read_recipe

    recipe = read_recipe(str(ROOT / "examples" / "recipes" / path))
    text = _render(lambda c: report.render_recipe(recipe, c))
    _fits(text)
    table = _table_lines(text)
    assert all(f" {m.key} " in table for m in recipe.mapped)


@pytest.mark.parametrize("command", ["gpus", "models"])
def test_the_cli_fits_the_terminal_it_is_given(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", str(NARROW))
    code, out, _ = run(capsys, command)
    assert code == 0
    _fits(out)
    names = gpu_names() if command == "gpus" else [r["name"] for r in json.loads(run(capsys, "models", "--json")[1])]
    assert all(f" {n} " in _table_lines(out) for n in names)


def test_columns_imports_nothing_of_the_package():
    # llmem_plugin.summary (below the CLI) lays its tables out with it: an import of the package would be a circle.
    import ast

    tree = ast.parse((ROOT / "llmem_plugin" / "cli" / "columns.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("llmem_plugin")]
