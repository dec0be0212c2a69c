"""The trace cache (llmem_plugin/trace/cache.py): a hit skips the trace and gives the same estimate;
another library version, a corrupt or a foreign file is a miss; concurrent writers leave whole
entries; the size bound removes the least recently used; --no-cache neither reads nor writes."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import time
from pathlib import Path

import pytest

import llmem_plugin
from llmem_plugin.trace import cache
from tests.cli._run import run
from tests.conftest import tiny_config

KiB = 1024
estimate_module = importlib.import_module("llmem_plugin.estimate")  # the module (the package exports the function)


@pytest.fixture
def on(cache_on) -> Path:
    """The caches turned on, in a fresh folder (tests/conftest.py)."""
    return cache_on


@pytest.fixture
def traces(monkeypatch) -> list[int]:
    """Counts the traces that run (a hit runs none)."""
    calls: list[int] = []
    real = estimate_module._trace_model_uncached

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(estimate_module, "_trace_model_uncached", counted)
    return calls


def _estimate(**kw):
    return llmem_plugin.estimate(tiny_config("llama"), **{"seq_len": 32, "micro_batch_size": 2, "precision": "bf16",
                                                          **kw})


def _entries(root: Path) -> list[Path]:
    return sorted((root / "traces").glob("*/*.pkl"))


def test_a_second_run_reads_the_trace_and_gives_the_same_estimate(on, traces):
    first = _estimate()
    assert len(traces) == 1 and len(_entries(on)) == 1
    second = _estimate()
    assert len(traces) == 1  # no trace ran
    assert (second.peak_allocated_bytes, second.peak_reserved_bytes, second.breakdown) == (
        first.peak_allocated_bytes, first.peak_reserved_bytes, first.breakdown)
    assert any("read from the trace cache" in n for n in second.notes)
    _estimate(micro_batch_size=4)  # another workload: another key
    assert len(traces) == 2 and len(_entries(on)) == 2


def test_another_library_version_is_a_miss(on, traces, monkeypatch):
    _estimate()
    env = cache._environment()
    monkeypatch.setattr(cache, "_environment",
                        lambda: {**env, "versions": {**env["versions"], "transformers": "0.0.1"}})
    _estimate()
    assert len(traces) == 2 and len(_entries(on)) == 2


def test_a_corrupt_or_foreign_entry_is_a_miss_and_removed(on, traces):
    expected = _estimate().peak_reserved_bytes
    (entry,) = _entries(on)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # cut short
    assert _estimate().peak_reserved_bytes == expected and len(traces) == 2
    (entry,) = _entries(on)
    store = cache.TraceCache(on)
    other = "f" * 64
    store.put(other, {"a": 1})
    os.replace(store.path(other), entry)  # another key's file under this key's name
    assert store.get(entry.stem) is None and not entry.exists()
    assert _estimate().peak_reserved_bytes == expected and len(traces) == 3


def _writer(root: str, key: str, seed: int) -> None:
    store = cache.TraceCache(Path(root))
    for i in range(20):
        store.put(key, {"writer": seed, "i": i, "blob": bytes([seed]) * (256 * KiB)})


def test_concurrent_writers_leave_a_whole_entry(tmp_path):
    key = "a" * 64
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), key, seed)) for seed in range(4)]
    for p in procs:
        p.start()
    store = cache.TraceCache(tmp_path)
    seen = 0
    while any(p.is_alive() for p in procs):
        value = store.get(key)
        if value is not None:  # never a mixed or partial value
            assert value["blob"] == bytes([value["writer"]]) * (256 * KiB)
            seen += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    final = store.get(key)
    assert final is not None and final["i"] == 19
    assert [p.name for p in (tmp_path / "traces").rglob("*")] == [key[:2], f"{key}.pkl"]  # no temporary left


def test_the_size_bound_removes_the_least_recently_used(tmp_path):
    store = cache.TraceCache(tmp_path, max_bytes=250 * KiB)
    keys = [c * 64 for c in "abc"]
    for i, key in enumerate(keys[:2]):
        store.put(key, bytes(100 * KiB))
        os.utime(store.path(key), (time.time() - 100 + i, time.time() - 100 + i))
    assert store.get(keys[0]) is not None  # used: now the most recent
    store.put(keys[2], bytes(100 * KiB))  # 300 KiB in all: the least recently used (b) goes
    assert store.get(keys[1]) is None
    assert store.get(keys[0]) is not None and store.get(keys[2]) is not None


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "llmem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "llmem"
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"


def test_a_bad_size_is_one_line(on, monkeypatch):
    monkeypatch.setenv("LLMEM_CACHE_SIZE", "lots")
    with pytest.raises(llmem_plugin.ConfigError, match="LLMEM_CACHE_SIZE"):
        cache.default_cache()
    monkeypatch.setenv("LLMEM_CACHE_SIZE", "3GiB")
    assert cache.default_cache().max_bytes == 3 << 30


def test_no_cache_neither_reads_nor_writes(on, traces, capsys):
    args = ["estimate", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16", "--fast"]
    code, _, _ = run(capsys, *args, "--no-cache")
    assert code == 0 and not _entries(on) and len(traces) == 1
    code, _, _ = run(capsys, *args)
    assert code == 0 and len(_entries(on)) == 2 and len(traces) == 2  # the trace, and the command's answer
    code, out, _ = run(capsys, *args, "--no-cache")
    assert code == 0 and len(traces) == 3 and "trace cache" not in out


def test_a_methods_estimate_is_read_back_for_the_same_layout_only(on, monkeypatch):
    import llmem_plugin.methods as methods
    from llmem_plugin.methods.layout import Layout
    from llmem_plugin.workload import Workload

    calls: list[str] = []
    real = methods._estimate_method

    def counted(mod, settings, name, *args, **kwargs):
        calls.append(name)
        return real(mod, settings, name, *args, **kwargs)

    monkeypatch.setattr(methods, "_estimate_method", counted)
    cfg, wl = tiny_config("llama"), Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")
    first = methods.estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu="h100-sxm")
    again = methods.estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu="h100-sxm")
    assert calls == ["ddp"] and again.to_dict() == first.to_dict()
    methods.estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=4), gpu="h100-sxm")
    assert calls == ["ddp", "ddp"]
