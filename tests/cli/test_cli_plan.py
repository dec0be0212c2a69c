"""`llmem plan`: the candidate table, JSON keys, exit codes 0/2/3, pictures."""

from __future__ import annotations

import json

import pytest
import transformers

from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT

from ._run import run

PNG = b"\x89PNG\r\n\x1a\n"
CANDIDATE_KEYS = ("method", "tp", "micro_batch", "grad_checkpointing", "offload", "fits", "device_total_bytes",
                  "step_time_s", "tokens_per_s")

from tests.conftest import room


def _mib(gib: float) -> str:
    return f"{room(gib) // 2**20}MiB"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096,
    ).save_pretrained(d)
    return str(d / "config.json")




BASE = ("plan", "--gpus", "2", "--gpu", "h100-sxm", "--seq-len", "512", "--methods", "ddp,fsdp")


def test_fits_exit_0_json_has_the_choice_and_every_candidate(capsys, model, tmp_path):
    png = tmp_path / "plan.png"
    code, out, err = run(capsys, *BASE, "--model", model, "--gpu-memory", _mib(1.458), "--json", "--plot", str(png))
    assert code == 0, err
    d = json.loads(out)
    assert d["choice"] is not None and d["choice"]["fits"]
    assert d["candidates"]
    for c in d["candidates"] + [d["choice"]]:
        for key in CANDIDATE_KEYS:
            assert key in c
    assert d["choice"]["device_total_bytes"] <= d["limit_bytes"]
    fitting = [c for c in d["candidates"] if c["fits"]]
    assert max(c["tokens_per_s"] for c in fitting) == d["choice"]["tokens_per_s"]
    assert png.read_bytes()[:8] == PNG


def test_table_marks_the_choice_and_says_why(capsys, model):
    code, out, err = run(capsys, *BASE, "--model", model, "--gpu-memory", _mib(1.458))
    assert code == 0, err
    assert "choice:" in out and ("beats" in out or "ties with" in out or "only method" in out)
    assert "fsdp" in out


def test_nothing_fits_exit_3_with_the_report(capsys, model):
    code, out, err = run(capsys, *BASE, "--model", model, "--gpu-memory", _mib(0.658), "--global-batch", "2")
    assert code == EXIT_WONT_FIT
    assert "no method fits" in err and len(err.strip().splitlines()) == 1
    assert "nothing fits" in out and "fits with" in out  # the suggestions, confirmed by re-planning
    code, out, _ = run(capsys, *BASE, "--model", model, "--gpu-memory", _mib(0.658), "--global-batch", "2", "--json")
    assert code == EXIT_WONT_FIT
    d = json.loads(out)
    assert d["choice"] is None and d["suggestions"] and all(s["choice"]["fits"] for s in d["suggestions"])


@pytest.mark.parametrize(("argv", "fragment"), [
    (("--methods", "zero9"), "unknown method 'zero9'"),
    (("--margin", "2"), "margin"),
    (("--tp", "two"), "comma-separated"),
    (("--global-batch", "3", "--methods", "ddp"), "not a multiple"),
])
def test_bad_input_exit_2_one_line(capsys, model, argv, fragment):
    code, _, err = run(capsys, "plan", "--model", model, "--gpus", "2", "--gpu", "h100-sxm", *argv)
    assert code == EXIT_BAD_INPUT
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_without_gpu_flags_it_plans_for_this_machine_or_says_none_was_found(capsys, model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message is for machines without one")
    code, _, err = run(capsys, "plan", "--model", model)
    assert code == EXIT_BAD_INPUT
    assert "no GPU found on this machine" in err and "--gpu" in err


def test_estimate_plot_draws_each_rank_of_a_pipeline(capsys, tmp_path, monkeypatch):
    """One bar per pipeline rank (TP inside the stages), the worst framed: the picture's data is each rank's
    own numbers. The notes quote torchtitan's TOML sections as written ("[parallelism]" is not markup)."""
    import llmem_plugin.methods as methods
    import llmem_plugin.cli.plot as plot

    drawn, made = {}, []
    real_plot, real_estimate = plot.plot_plan, methods.estimate_method

    def spy_plot(rows, **kwargs):
        drawn.update(rows=rows, **kwargs)
        return real_plot(rows, **kwargs)

    def spy_estimate(*args, **kwargs):
        made.append(real_estimate(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plot, "plot_plan", spy_plot)
    monkeypatch.setattr(methods, "estimate_method", spy_estimate)
    png = tmp_path / "ranks.png"
    code, out, err = run(capsys, "estimate", "--model", "qwen2.5-0.5b", "--seq-len", "64", "--gpus", "4", "--tp", "2",
                         "--method", "pp", "--precision", "bf16", "--fast", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == PNG
    ranks = made[0].ranks
    assert [label for label, _ in drawn["rows"]] == [f"rank {r.rank}" for r in ranks] == ["rank 0", "rank 2"]
    assert [sum(seg.values()) for _, seg in drawn["rows"]] == [r.device_total_bytes for r in ranks]
    assert drawn["chosen"] == max(range(len(ranks)), key=lambda i: ranks[i].device_total_bytes)
    text = " ".join(out.split())
    assert "torchtitan (b5bcd76): parallelism.pipeline_parallel_degree = 2," in text
    assert ("parallelism.tensor_parallel_degree = 2, parallelism.enable_sequence_parallel = false, "
            "training.num_tokens_per_microbatch_per_dp_rank = 64") in text


def test_estimate_plot_draws_the_step(capsys, model, tmp_path):
    png = tmp_path / "step.png"
    code, _, err = run(capsys, "estimate", "--model", model, "--seq-len", "256", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == PNG
    # Fast mode replays the full step's event stream (llmem_plugin.trace.fastsynth): it has the timeline too.
    png.unlink()
    code, _, err = run(capsys, "estimate", "--model", model, "--seq-len", "256", "--fast", "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == PNG



def test_the_table_names_a_pipeline_by_degree_and_schedule(capsys, tmp_path):
    """A pipeline row: its degree and schedule in the method column (`pp2 interleaved`), and its microbatches
    per schedule step x its schedule steps in the accumulation column (4x2: torchtitan's accumulation)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 256}))
    code, out, err = run(capsys, "plan", "--model", str(cfg), "--seq-len", "32", "--gpus", "4", "--gpu", "h100-sxm",
                         "--methods", "pp-interleaved", "--tp", "1", "--global-batch", "16", "--precision", "fp32",
                         "--grad-checkpointing", "off", "--no-prune")
    assert code == 0, err
    rows = [line for line in out.splitlines() if "pp2" in line]
    assert rows and all("pp-interleaved" not in line for line in out.splitlines())
    assert any("4x2" in line for line in rows) and any(" 8 " in line for line in rows)
    assert "choice: pp2 interleaved mb1x" in out
