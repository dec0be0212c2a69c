"""`llmem estimate --method ...`: per-method rows, JSON keys, layout errors."""

from __future__ import annotations

import json

import pytest

from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT
from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

from ._run import run




def test_method_all_json_rows(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", "--gpus", "2", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["layout"] == {"num_gpus": 2, "num_nodes": 1, "tp": 1, "dp": 2}
    names = [r["method"] for r in d["methods"]]
    assert "ddp" in names and "single" not in names  # single needs one GPU
    assert any(s["method"] == "single" for s in d["skipped"])
    # Without --tp, 'all' tries every tensor-parallel degree that divides the
    # node (here 2) for the TP methods, instead of leaving them out at tp 1.
    # (GPT-2 has no TP plan: the TP methods are skipped with that reason at tp 2.)
    assert {"tp tp2", "dp-tp tp2", "fsdp-tp tp2", "hybrid tp2"} <= {s["method"] for s in d["skipped"]}
    for row in d["methods"]:
        for key in ("method", "tp", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "fits"):
            assert key in row
        assert row["peak_reserved_bytes"] >= row["peak_allocated_bytes"]
        assert row["device_total_bytes"] > row["peak_reserved_bytes"]


def test_method_all_tries_every_tp_degree(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 256}))
    code, out, err = run(capsys, "estimate", "--model", str(cfg), "--seq-len", "32", "--gpus", "4", "--json")
    assert code == 0, err
    rows = {(r["method"], r["tp"]) for r in json.loads(out)["methods"]}
    # The degrees that divide a 4-GPU node are 2 and 4: pure tp spans all 4
    # GPUs, dp-tp and fsdp-tp need dp >= 2, so tp 2.
    assert {("tp", 4), ("dp-tp", 2), ("fsdp-tp", 2), ("ddp", 1), ("fsdp", 1)} <= rows
    assert not any(m in ("tp", "dp-tp", "fsdp-tp") and tp == 1 for m, tp in rows)


def test_single_method_matches_plain_estimate(capsys):
    _, plain, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", "--json")
    _, meth, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", "--method", "single", "--json")
    p, m = json.loads(plain), json.loads(meth)["methods"][0]
    assert (m["peak_allocated_bytes"], m["device_total_bytes"]) == (p["peak_allocated_bytes"], p["device_total_bytes"])


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "ddp", "--gpus", "6", "--nodes", "4"], "not a multiple of --nodes"),
    (["--method", "ddp", "--gpus", "4", "--tp", "3"], "must divide the 4 GPUs of a node"),
    (["--method", "ddp", "--gpus", "8", "--nodes", "2", "--tp", "8"], "stays inside one node"),
    (["--method", "ddp", "--gpus", "2", "--tp", "2"], "--tp"),
    (["--method", "ddp", "--gpus", "2", "--offload", "optimizer"], "--offload is not modelled"),
    (["--method", "ddp", "--gpus", "0"], "argument --gpus: 0 is outside [1, 65536]"),
    (["--method", "ddp", "--gpus", "2", "--microbatches", "4"], "--microbatches applies to the pipeline methods"),
    (["--method", "pp", "--gpus", "4", "--pp-split", "x"], "--pp-split 'x' is not"),
    (["--method", "ddp", "--gpus", "2", "--no-return-outputs"], "--no-return-outputs applies to the pipeline methods"),
    (["--method", "pp", "--gpus", "4", "--pp", "1"], "argument --pp: 1 is outside"),
    (["--method", "pp", "--gpus", "4", "--precision", "bf16-mixed"], "autocast around a pipeline schedule"),
    (["--method", "pp", "--gpus", "6", "--pp", "4", "--precision", "bf16"], "pipeline degree 4 must be at least 2 "
                                                                            "and divide the 6 GPUs"),
])
def test_layout_errors_exit_2(capsys, argv, fragment):
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", *argv)
    assert code == EXIT_BAD_INPUT
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_tensor_parallel_row_and_sequence_parallel(capsys):
    argv = ["estimate", "--model", "qwen2.5-0.5b", "--seq-len", "64", "--gpus", "2", "--tp", "2", "--method", "tp"]
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    row = json.loads(out)["methods"][0]
    assert (row["method"], row["tp"]) == ("tp", 2)
    code, out, err = run(capsys, *argv, "--sequence-parallel", "--json")
    assert code == 0, err
    assert json.loads(out)["methods"][0]["peak_allocated_bytes"] <= row["peak_allocated_bytes"]
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--method", "ddp", "--gpus", "2", "--sequence-parallel")
    assert code == EXIT_BAD_INPUT and "--sequence-parallel needs a tensor-parallel method" in err


def test_method_that_does_not_fit_exits_3(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 256}))
    # Two 32 MiB cuBLAS workspaces on an H100 (overheads.py) alone exceed 8 MiB.
    code, out, err = run(capsys, "estimate", "--model", str(cfg), "--seq-len", "32", "--gpus", "2", "--method", "ddp",
                         "--gpu-memory", "8MiB", "--json")
    assert code == EXIT_WONT_FIT, err
    assert not json.loads(out)["methods"][0]["fits"]
    assert err.strip().splitlines()[-1].startswith("llmem: --method ddp does not fit 2 x h100-sxm (8 MiB each); exit code 3")


def test_pipeline_rows_every_rank(capsys, tmp_path):
    """--method pp reports every pipeline rank; --method all leaves the pipeline methods out."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 256}))
    argv = ["estimate", "--model", str(cfg), "--seq-len", "32", "--gpus", "2", "--precision", "bf16", "--json"]
    code, out, err = run(capsys, *argv, "--method", "pp-gpipe", "--microbatches", "3", "--pp-split", "1,3")
    assert code == 0, err
    row = json.loads(out)["methods"][0]
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    assert "3 microbatches" in row["notes"][0] and "[1, 3] (given)" in row["notes"][0]
    # As torchtitan's trainer steps it: the last rank drops the logits the default keeps (at this tiny vocabulary
    # its peak is elsewhere), the first is unchanged.
    code, out, err = run(capsys, *argv, "--method", "pp-gpipe", "--microbatches", "3", "--pp-split", "1,3",
                         "--no-return-outputs")
    assert code == 0, err
    dropped = json.loads(out)["methods"][0]
    assert "step(return_outputs=False)" in dropped["notes"][0]
    assert dropped["ranks"][0]["peak_tensor_bytes"] == row["ranks"][0]["peak_tensor_bytes"]
    assert dropped["ranks"][1]["peak_tensor_bytes"] <= row["ranks"][1]["peak_tensor_bytes"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    names = {r["method"] for r in json.loads(out)["methods"]} | {s["method"] for s in json.loads(out)["skipped"]}
    assert not any(n.startswith("pp") for n in names)


def test_pipeline_microbatches_beyond_a_traced_step(capsys, tmp_path):
    """More microbatches than the estimate traces one by one (step.MAX_TRACED_MICRO_STEPS): composed when every
    rank is (return_outputs=False); refused in one line naming the flag when the last rank keeps its outputs."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 256}))
    m = MAX_TRACED_MICRO_STEPS + 1
    argv = ["estimate", "--model", str(cfg), "--seq-len", "32", "--gpus", "2", "--precision", "bf16", "--json",
            "--method", "pp", "--microbatches", str(m)]
    code, _, err = run(capsys, *argv)
    assert code == EXIT_BAD_INPUT and "--no-return-outputs" in err and err.count("\n") == 1, err
    code, out, err = run(capsys, *argv, "--no-return-outputs")
    assert code == 0, err
    row = json.loads(out)["methods"][0]
    assert f"{m} microbatches" in row["notes"][0] and any(n.startswith("composed: ranks [0, 1]") for n in row["notes"])


def test_method_zero3_builds_its_stream_by_default_and_full_traces(capsys, tmp_path):
    """--method zero3 takes the built stream where DeepSpeed's windows stay inside a layer; its figures are
    --full's (the full trace), and the note says which path each took."""
    import transformers

    model = tmp_path / "config.json"
    model.write_text(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=10, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512).to_json_string())
    ds = tmp_path / "ds.json"  # every window inside one layer's 43,136 parameters (tests/methods/test_zero_synthesis)
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": 20_000, "stage3_prefetch_bucket_size": 20_000,
        "stage3_max_live_parameters": 20_000, "stage3_max_reuse_distance": 20_000,
        "stage3_param_persistence_threshold": 1_000}}))
    args = ["estimate", "--model", str(model), "--seq-len", "64", "--batch-size", "2", "--gpus", "4", "--method",
            "zero3", "--deepspeed-config", str(ds), "--json"]
    rows = []
    for extra in ([], ["--full"]):
        code, out, err = run(capsys, *args, *extra)
        assert code == 0, err
        rows.append(json.loads(out)["methods"][0])
    built, full = rows
    assert any("event stream was built from" in n for n in built["notes"])
    assert not any("event stream was built from" in n for n in full["notes"])
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        assert built[key] == full[key], key


def test_method_all_side_by_side_gives_what_one_process_gives(capsys, monkeypatch):
    """--method all runs its estimates in forked workers, one per core (llmem_plugin.methods.parallel): the rows,
    their order and the skipped methods are those of the same run in this process alone."""
    import llmem_plugin.methods.parallel as parallel

    args = ["estimate", "--model", "gpt2", "--seq-len", "64", "--gpus", "2", "--json"]
    outs = []
    for n in (2, 1):
        monkeypatch.setattr(parallel, "cores", lambda n=n: n)
        code, out, err = run(capsys, *args)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0] == outs[1]
    assert len(outs[0]["methods"]) > 2


def test_a_refusal_crosses_the_process_boundary_as_its_own_error():
    from llmem_plugin import errors
    from llmem_plugin.cli.estimate import _method_task, _Refusal
    from llmem_plugin.methods import Layout
    from llmem_plugin.workload import Workload

    out = _method_task(("tp", "gpt2", Workload(seq_len=64), Layout(num_gpus=2, tp=2), "h100-sxm", None, None, {}))
    # The TP plans cover llama-style model types only (llmem_plugin.methods.tp): GPT-2 is refused, by type.
    assert out == _Refusal("UnsupportedError", out.message) and issubclass(errors.UnsupportedError, errors.LLMemError)
    assert "not 'gpt2'" in out.message
