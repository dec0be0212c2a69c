"""The result cache (llmem_plugin/cli/resultcache.py): a repeated command prints the same answer and exit code
without running the estimate, and without importing torch; a changed input file, another library version, bad
input and machine-dependent commands are never answered from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llmem_plugin.cli.app as app
from llmem_plugin.cli import resultcache
from tests.cli._run import run

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ["estimate", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16", "--fast", "--gpu", "h100-sxm"]


@pytest.fixture
def on(cache_on) -> Path:
    """The caches turned on, in a fresh folder (tests/conftest.py)."""
    return cache_on


@pytest.fixture
def runs(monkeypatch) -> list[str]:
    """The commands that really ran (a replayed answer runs none)."""
    calls: list[str] = []
    real = app._run

    def counted(args):
        calls.append(args.command)
        return real(args)

    monkeypatch.setattr(app, "_run", counted)
    return calls


def test_a_repeated_estimate_prints_the_same_answer_without_running(on, runs, capsys):
    code, out, err = run(capsys, *GPT2, "--json")
    assert code == 0 and runs == ["estimate"]
    again_code, again_out, again_err = run(capsys, *GPT2, "--json")
    assert runs == ["estimate"] and (again_code, again_out) == (code, out)
    assert json.loads(again_out)["peak_reserved_bytes"] == json.loads(out)["peak_reserved_bytes"]
    assert "answered at" in again_err and "--no-cache" in again_err
    run(capsys, *GPT2, "--json", "--no-cache")
    assert runs == ["estimate", "estimate"]  # --no-cache computes anew
    run(capsys, *GPT2, "--json", "--batch-size", "2")
    assert runs == ["estimate", "estimate", "estimate"]  # another option, another answer


def test_does_not_fit_is_replayed_with_its_exit_code_and_line(on, runs, capsys):
    args = [*GPT2, "--gpu-memory", "1GB"]
    code, out, err = run(capsys, *args)
    assert code == 3 and "llmem:" in err
    again = run(capsys, *args)
    assert runs == ["estimate"] and again[0] == 3 and again[1] == out
    assert again[2].startswith(err.strip().splitlines()[-1])


def test_bad_input_is_refused_anew_every_time(on, runs, capsys):
    for _ in range(2):
        code, _, err = run(capsys, "estimate", "--model", "gpt2", "--lora-rank", "16", "--quantize", "nf5")
        assert code == 2 and "nf5" in err
    assert runs == ["estimate", "estimate"]


def test_a_changed_config_file_is_a_miss(on, runs, capsys, tmp_path):
    import transformers

    path = tmp_path / "config.json"
    cfg = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    path.write_text(cfg.to_json_string())
    args = ["estimate", "--model", str(path), "--seq-len", "64", "--precision", "bf16", "--json"]
    first = json.loads(run(capsys, *args)[1])
    cfg.n_layer = 4  # same path, same options: the file's content decides
    path.write_text(cfg.to_json_string())
    second = json.loads(run(capsys, *args)[1])
    assert runs == ["estimate", "estimate"]
    assert second["peak_allocated_bytes"] > first["peak_allocated_bytes"]
    run(capsys, *args)
    assert runs == ["estimate", "estimate"]


def test_another_library_version_is_a_miss(on, runs, capsys, monkeypatch):
    run(capsys, *GPT2)
    versions = {**resultcache._versions(), "transformers": "0.0.1"}
    monkeypatch.setattr(resultcache, "_versions", lambda: versions)
    run(capsys, *GPT2)
    assert runs == ["estimate", "estimate"]


def test_machine_dependent_commands_are_not_kept(on, runs, capsys, tmp_path):
    plot = tmp_path / "m.png"
    for _ in range(2):
        run(capsys, *GPT2, "--plot", str(plot))  # writes a file: the file must be written each time
        run(capsys, *GPT2, "--host-memory", "local")  # reads this machine's RAM
    assert runs == ["estimate"] * 4
    parser = app.build_parser()
    args = parser.parse_args(["plan", "--model", "gpt2"])  # counts this machine's GPUs (cli/plan._plan_target)
    assert resultcache.result_key(["plan"], ["plan"], args) is None
    args = parser.parse_args(["plan", "--model", "gpt2", "--gpu", "h100-sxm"])  # one h100-sxm, wherever it runs
    assert resultcache.result_key(["plan"], ["plan"], args) is not None
    args = parser.parse_args(["estimate", "--model", "someone/some-model"])  # a Hub id: the local Hub cache
    assert resultcache.result_key([], [], args) is None


def test_a_replayed_answer_imports_no_torch(tmp_path):
    """In fresh processes, as a user runs it: the second run answers before torch is imported."""
    env = {**os.environ, "LLMEM_NO_CACHE": "0", "LLMEM_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys; from llmem_plugin.cli.app import main; c = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(c)")
    outs = [subprocess.run([sys.executable, "-c", code, *GPT2], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    assert [p.returncode for p in outs] == [0, 0]
    assert outs[0].stdout.endswith("torch imported: True\n") and outs[1].stdout.endswith("torch imported: False\n")
    assert outs[0].stdout.rsplit("torch imported", 1)[0] == outs[1].stdout.rsplit("torch imported", 1)[0]


def _key(*argv: str) -> str | None:
    args = app.build_parser().parse_args(list(argv))
    return resultcache.result_key(list(argv), list(argv), args)


def test_what_the_key_reads_beyond_the_options(on, monkeypatch, tmp_path):
    base = _key(*GPT2)
    assert base is not None and _key(*GPT2) == base
    # The cuBLAS workspaces every trace replays (llmem_plugin/device/overheads.py) follow this variable.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    assert _key(*GPT2) != base
    # A litgpt:DIR model reads DIR's model_config.yaml: its content is in the key.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model_config.yaml").write_text("n_layer: 2\n")
    first = resultcache.inputs_digest([f"litgpt:{folder}"], [])
    (folder / "model_config.yaml").write_text("n_layer: 4\n")
    assert resultcache.inputs_digest([f"litgpt:{folder}"], []) != first


def test_any_spelling_of_local_host_memory_and_a_pipe_are_not_kept(on, tmp_path):
    for spelling in ("LOCAL", " Local"):  # as llmem_plugin.device.host.resolve_host_memory reads it
        assert _key(*GPT2, "--host-memory", spelling) is None
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)  # --deepspeed-config <(...): read once, different every time
    assert _key(*GPT2, "--deepspeed-config", str(fifo)) is None


def test_an_answer_marked_not_kept_is_not_kept(on, runs, capsys, monkeypatch):
    """A plan whose search for changes failed part-way says so and is computed again next time."""
    from llmem_plugin.trace import cache

    real = app._run

    def failing_search(args):
        code = real(args)
        cache.answer_not_kept()
        return code

    monkeypatch.setattr(app, "_run", failing_search)
    run(capsys, *GPT2)
    run(capsys, *GPT2)
    assert runs == ["estimate", "estimate"]  # the second ran again
    assert not [p for p in (on / "traces").glob("*/*.pkl") if b"resultcache" in p.read_bytes()[:400]]


def test_a_repeated_max_is_answered_from_the_cache(on, runs, capsys):
    args = ["max", "batch-size", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16", "--gpu-memory",
            "2GiB", "--json"]
    code, out, _ = run(capsys, *args)
    again_code, again_out, again_err = run(capsys, *args)
    assert runs == ["max"] and (again_code, again_out) == (code, out) and "answered at" in again_err
