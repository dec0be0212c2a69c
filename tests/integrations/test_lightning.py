"""Lightning adapter: registration, methods -> strategies, the swap at fit, abort, and real DDP runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch
from lightning.pytorch import strategies as ls
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from llmem_plugin.integrations import _common
from llmem_plugin.integrations.deepspeed import to_deepspeed_config
from llmem_plugin.integrations.lightning import (
    STRATEGY_NAME,
    LLMemAutoStrategy,
    lightning_strategy,
    methods_for,
)

from llmem_plugin.errors import WontFitError
from llmem_plugin.planner.search import plan
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "lightning_fit.py")


def _example():
    spec = importlib.util.spec_from_file_location("lightning_fit", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _grad_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _rows(root) -> list[dict]:
    with open(os.path.join(root, "llmem-verify.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- registration


def test_import_works_without_lightning():
    code = textwrap.dedent("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import llmem_plugin
        from llmem_plugin.integrations import lightning
        assert not any(m.split(".")[0] in ("lightning", "pytorch_lightning") for m in sys.modules)
        print("ok", llmem_plugin.__version__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


def test_import_registers_without_importing_lightning_then_on_its_import():
    code = textwrap.dedent("""
        import sys
        import llmem_plugin
        assert "lightning.pytorch" not in sys.modules and "pytorch_lightning" not in sys.modules
        import lightning.pytorch as pl
        import pytorch_lightning as ptl
        import inspect
        assert inspect.getsource(pl)  # the package keeps its own loader
        for reg in (pl.strategies.StrategyRegistry, ptl.strategies.StrategyRegistry):
            cls = reg["llmem-auto"]["strategy"]
            print(next(k.__module__ for k in cls.__mro__ if k.__name__ == "DDPStrategy"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["lightning.pytorch.strategies.ddp", "pytorch_lightning.strategies.ddp"]


def test_registered_in_the_loaded_registry():
    assert ls.StrategyRegistry[STRATEGY_NAME]["strategy"] is LLMemAutoStrategy
    assert issubclass(LLMemAutoStrategy, ls.DDPStrategy)


# ----------------------------------------------------------------------------- methods -> strategies


def test_methods_per_accelerator():
    assert methods_for("cpu", world_size=2, tensor_parallel=True, deepspeed=True) == ["ddp"]
    assert methods_for("cpu", world_size=1, tensor_parallel=False, deepspeed=True) == ["single"]
    assert methods_for("cuda", world_size=4, tensor_parallel=False, deepspeed=False) == ["ddp", "fsdp",
                                                                                          "fsdp-offload"]
    assert set(methods_for("cuda", world_size=4, tensor_parallel=True, deepspeed=True)) == {
        "ddp", "fsdp", "fsdp-offload", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "tp", "dp-tp",
        "fsdp-tp"}


@pytest.fixture(scope="module")
def cuda_plan():
    import transformers

    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    methods = methods_for("cuda", world_size=4, tensor_parallel=True, deepspeed=True)
    p = plan(tiny_config("llama"), gpu="h100-sxm", num_gpus=4, workload=Workload(seq_len=32, micro_batch_size=2,
             precision="bf16-mixed"), global_batch=8, micro_batch=2, grad_checkpointing=False, methods=methods,
             prune=False, verify=False, suggest=False)
    return p, model


def test_every_planned_candidate_maps_to_its_lightning_strategy(cuda_plan):
    p, model = cuda_plan
    seen = set()
    for c in p.candidates:
        s = lightning_strategy(p, c, module=model)
        seen.add(c.method)
        if c.method == "ddp":
            assert type(s) is ls.DDPStrategy
        elif c.method in ("fsdp", "fsdp-offload"):
            assert type(s) is ls.FSDPStrategy
            assert s.sharding_strategy.name == "FULL_SHARD"
            assert (s.cpu_offload is not None and s.cpu_offload.offload_params) == (c.method == "fsdp-offload")
            # the estimate's per-layer sharding: the decoder layers are the wrap units
            assert {"LlamaDecoderLayer"} == {k.__name__ for k in s.kwargs["auto_wrap_policy"]._module_classes}
        elif c.method.startswith("zero"):
            assert type(s) is ls.DeepSpeedStrategy
            want = to_deepspeed_config(p, c)
            assert s.config["zero_optimization"] == want["zero_optimization"]
            assert s.config["zero_optimization"]["stage"] == int(c.method[4])
            assert ("offload_optimizer" in s.config["zero_optimization"]) == c.method.endswith("offload")
            assert s.config["train_micro_batch_size_per_gpu"] == c.micro_batch == 2
        else:
            assert type(s) is ls.ModelParallelStrategy
            assert (s._data_parallel_size, s._tensor_parallel_size) == (4 // c.tp, c.tp)
    assert seen == {"ddp", "fsdp", "fsdp-offload", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload",
                    "dp-tp", "fsdp-tp"}


# ----------------------------------------------------------------------------- fit on one CPU device


def _fit(tmp_path, *, module_cls: str = "FreeGradsAfterStep", precision: str = "32-true", steps: int = 2,
         optimizer=None, **strategy_kwargs):
    ex = _example()
    pl.seed_everything(0, verbose=False)
    cls = getattr(ex, module_cls)
    if optimizer is not None:
        cls = type("Custom", (cls,), {"configure_optimizers": lambda self: optimizer(self.parameters())})
    module = cls(ex.tiny_llama())
    data = torch.utils.data.DataLoader(ex.RandomTokens(num_samples=16, seq_len=32, vocab_size=512), batch_size=2,
                                       shuffle=True)
    strategy = LLMemAutoStrategy(compare_after_steps=steps, **strategy_kwargs)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, precision=precision,
                         default_root_dir=str(tmp_path), logger=pl.loggers.CSVLogger(str(tmp_path)),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return trainer, module, strategy


def test_one_device_trains_single_device_and_matches_the_estimate(tmp_path):
    before = dict(os.environ)
    trainer, module, _ = _fit(tmp_path, module_cls="CausalLM", gpu="h100-sxm")
    assert trainer.strategy.launcher is None and "LOCAL_RANK" not in set(os.environ) - set(before)
    assert type(trainer.strategy) is ls.SingleDeviceStrategy
    assert type(trainer.precision_plugin) is Precision
    assert trainer.global_step == 2
    (row,) = _rows(tmp_path)
    assert row["method"]["name"] == "single" and row["runner"] == "lightning" and row["device"] == "cpu"
    # the prediction is the estimate of the live model at the first batch's shape
    wl = Workload(seq_len=32, micro_batch_size=2, precision="fp32", optimizer="adamw", runner="lightning")
    live = _common.live_model(module)
    want = _common.check(live, wl, gpu=_common.resolve_target("h100-sxm", None)[0]).prediction
    assert row["predicted"]["tensor_bytes"] == want.tensor_bytes
    err = 100 * (want.tensor_bytes - row["measured"]["allocated_bytes"]) / row["measured"]["allocated_bytes"]
    # As in the two-rank test below: the meter also counts the Dataset's whole
    # int64 token tensor (host memory in a CUDA run) and self.log("loss")'s
    # four one-element tensors, which the estimate cannot see.
    like = row["measured"]["allocated_bytes"] - (-(-16 * 32 * 8 // 512) * 512) - 4 * 512
    err = 100 * (want.tensor_bytes - like) / like
    assert 0 <= err <= 3.0, err  # measured: 0.0 (-0.18% before the two are taken out)
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        logged = f.read()
    for key in ("llmem/predicted_peak_gib", "llmem/actual_peak_gib", "llmem/error_pct"):
        assert key in logged and key in trainer.callback_metrics
    raw = 100 * (want.tensor_bytes - row["measured"]["allocated_bytes"]) / row["measured"]["allocated_bytes"]
    assert float(trainer.callback_metrics["llmem/error_pct"]) == pytest.approx(raw, abs=1e-3)


def test_the_precision_plugin_is_chosen_for_the_real_strategy(tmp_path):
    trainer, _, strategy = _fit(tmp_path, gpu="h100-sxm", precision="bf16-mixed", steps=1)
    assert type(trainer.strategy) is ls.SingleDeviceStrategy
    assert type(trainer.precision_plugin) is MixedPrecision and trainer.precision_plugin.device == "cpu"
    assert strategy.decision.prediction.workload["precision"] == "bf16-mixed"


def test_nothing_fits_aborts_before_any_optimizer_step(tmp_path):
    steps = []
    ex = _example()

    class Counting(ex.CausalLM):
        def on_before_optimizer_step(self, optimizer):
            steps.append(1)

    module = Counting(ex.tiny_llama())
    data = torch.utils.data.DataLoader(ex.RandomTokens(num_samples=8, seq_len=32, vocab_size=512), batch_size=2)
    trainer = pl.Trainer(strategy=LLMemAutoStrategy(gpu="h100-sxm", gpu_memory="0.05GiB"), accelerator="cpu",
                         devices=1, max_steps=2, default_root_dir=str(tmp_path), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(WontFitError) as e:
        trainer.fit(module, data)
    assert steps == [] and trainer.global_step == 0
    assert e.value.plan is not None and e.value.plan.choice is None
    assert e.value.plan.capacity_bytes == int(0.05 * 2**30)
    # The report rides in the message: 0.05 GiB is below what any method holds (the CUDA context alone).
    assert "skipped every method" in str(e.value) and "GiB" in str(e.value)


def test_nothing_fits_with_warn_trains_anyway(tmp_path):
    with pytest.warns(UserWarning, match="training anyway with single"):
        trainer, _, _ = _fit(tmp_path, gpu="h100-sxm", gpu_memory="0.05GiB", on_wont_fit="warn", steps=1)
    assert trainer.global_step == 1 and type(trainer.strategy) is ls.SingleDeviceStrategy


def test_an_unmodelled_optimizer_warns_and_trains_unchecked(tmp_path):
    with pytest.warns(UserWarning, match="RMSprop is not modelled"):
        trainer, _, strategy = _fit(tmp_path, gpu="h100-sxm", steps=1,
                                    optimizer=lambda ps: torch.optim.RMSprop(ps, lr=1e-3))
    assert trainer.global_step == 1 and strategy.decision.prediction is None
    assert not os.path.exists(os.path.join(tmp_path, "llmem-verify.jsonl"))


def test_no_gpu_on_the_cpu_warns_once_what_to_pass_and_trains(tmp_path, monkeypatch):
    import warnings

    monkeypatch.delenv("LLMEM_GPU", raising=False)
    monkeypatch.delenv("LLMEM_STRICT", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, strategy = _fit(tmp_path, steps=1)
    ours = [str(w.message) for w in caught if str(w.message).startswith("llmem")]
    assert len(ours) == 1 and "\n" not in ours[0], ours
    assert "not checked" in ours[0] and "no CUDA device" in ours[0] and "LLMEM_GPU=h100-sxm" in ours[0]
    assert trainer.global_step == 1 and type(trainer.strategy) is ls.SingleDeviceStrategy
    assert strategy.decision.prediction is None


def test_no_gpu_on_the_cpu_stops_the_job_in_strict_mode(tmp_path, monkeypatch):
    from llmem_plugin.errors import ConfigError

    monkeypatch.delenv("LLMEM_GPU", raising=False)
    monkeypatch.setenv("LLMEM_STRICT", "1")
    with pytest.raises(ConfigError, match="no CUDA device in this process and no gpu given. HINT"):
        _fit(tmp_path, steps=1)


def test_a_bad_gpu_name_stops_when_the_strategy_is_built(monkeypatch):
    from llmem_plugin.errors import ConfigError

    monkeypatch.setenv("LLMEM_GPU", "h100-sxmm")
    with pytest.raises(ConfigError, match="h100-sxmm"):
        LLMemAutoStrategy()


def test_nothing_fits_by_name_without_bitsandbytes_still_aborts(tmp_path, monkeypatch):
    """The won't-fit path (its suggestions try 8-bit AdamW) needs no optional
    library: without bitsandbytes, a job that does not fit still stops."""
    for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setenv("LLMEM_GPU", "h100-sxm")
    monkeypatch.setenv("LLMEM_GPU_MEMORY", "100MiB")
    ex = _example()
    module = ex.CausalLM(ex.tiny_llama())
    data = torch.utils.data.DataLoader(ex.RandomTokens(num_samples=8, seq_len=32, vocab_size=512), batch_size=2)
    trainer = pl.Trainer(strategy="llmem-auto", accelerator="cpu", devices=1, max_steps=2,
                         default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(WontFitError) as e:
        trainer.fit(module, data)
    assert trainer.global_step == 0 and e.value.plan.capacity_bytes == 100 * 2**20
    assert "no method fits" in str(e.value)


# ----------------------------------------------------------------------------- two real DDP ranks


def _run_example(tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    root = tmp_path / "run"
    # a launcher's variables left in this process would make the script think it was launched already
    launched = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in launched}
    out = subprocess.run([sys.executable, EXAMPLE, "--devices", "2", "--steps", "3", "--root", str(root), *args],
                         capture_output=True, text=True, timeout=240, cwd=str(tmp_path), check=False,
                         env={**base, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    printed = [json.loads(line.split("llmem-lightning: ", 1)[1]) for line in out.stdout.splitlines()
               if line.startswith("llmem-lightning: ")]
    return printed, _rows(root)


def _ddp_prediction(runner: str) -> tuple[int, int]:
    import transformers

    live = _common.live_model(transformers.LlamaForCausalLM(tiny_config("llama")))
    wl = Workload(seq_len=32, micro_batch_size=2, precision="fp32", optimizer="adamw", runner=runner)
    gpu = _common.resolve_target("h100-sxm", None)[0]
    return _common.check(live, wl, method="ddp", num_gpus=2, gpu=gpu).prediction.tensor_bytes, _grad_bytes(live.module)


def test_two_cpu_ranks_by_name_pick_ddp_and_lightnings_loop_keeps_gradients(tmp_path):
    printed, rows = _run_example(tmp_path, "--strategy", "name", env={"LLMEM_GPU": "h100-sxm"})
    assert sorted(p["rank"] for p in printed) == [0, 1]
    assert {p["strategy"] for p in printed} == {"DDPStrategy"} and {p["global_step"] for p in printed} == {3}
    assert sorted(r["method"]["rank"] for r in rows) == [0, 1]
    predicted, grads = _ddp_prediction("lightning")
    plain, _ = _ddp_prediction("torch")
    # Lightning zeroes the gradients inside the next step's closure, after
    # training_step and before backward, so that forward runs with them
    # alive: the Lightning runner's peak is above the plain loop's, by at
    # most one set of gradients.
    assert 0 < predicted - plain <= grads, (predicted, plain, grads)
    # Two storages the CPU meter counts that the estimate leaves out, by
    # their layout (each rounded up to the allocator's 512 B block,
    # llmem_plugin.trace.tracker.round_allocation):
    # * the Dataset's whole token tensor, seen when __getitem__ takes a row
    #   view of it (examples/lightning_fit.py, RandomTokens: int64); a CUDA
    #   run keeps it in host memory and moves only the collated batch;
    # * the state of self.log("loss") in training_step: Lightning 2.6.6's
    #   _ResultMetric keeps "value" (the on_step clone of the loss) and
    #   "cumulated_batch_size", and torchmetrics' add_state a deepcopy of each
    #   default (lightning/pytorch/trainer/connectors/logger_connector/result.py,
    #   _ResultMetric.__init__/update): 4 one-element tensors, device memory
    #   on CUDA too, which the estimate does not model (it cannot see what a
    #   training_step logs).
    num_samples = 2 * 2 * (3 + 1)  # batch x devices x (steps + 1), as the example builds it
    dataset_bytes = -(-num_samples * 32 * 8 // 512) * 512
    logged_bytes = 4 * 512
    for r in rows:
        assert r["method"]["name"] == "ddp" and r["method"]["num_gpus"] == 2
        assert r["workload"]["runner"] == "lightning"
        assert r["predicted"]["tensor_bytes"] == predicted
        like = r["measured"]["allocated_bytes"] - dataset_bytes - logged_bytes
        err = 100 * (predicted - like) / like
        # measured: 4,092,416 B = predicted 4,086,272 + 4,096 + 2,048, err 0
        assert 0 <= err <= 3.0, (err, r["measured"]["allocated_bytes"], predicted)


def test_two_cpu_ranks_match_the_estimate_when_gradients_are_freed_after_the_step(tmp_path):
    printed, rows = _run_example(tmp_path, "--gpu", "h100-sxm", "--free-grads-after-step")
    assert {p["strategy"] for p in printed} == {"DDPStrategy"} and len(printed) == 2
    predicted, _ = _ddp_prediction("torch")
    assert len(rows) == 2
    for r in rows:
        err = 100 * (predicted - r["measured"]["allocated_bytes"]) / r["measured"]["allocated_bytes"]
        assert abs(err) <= 3.0, err
    rank0 = next(p for p in printed if p["rank"] == 0)
    assert set(rank0["metrics"]) == {"llmem/predicted_peak_gib", "llmem/actual_peak_gib", "llmem/error_pct"}


def test_compare_after_one_step_waits_for_the_first_steady_state_step(tmp_path):
    """Step 1 runs without the optimizer states its step() creates; the
    estimate is the steady state, so the comparison is made after step 2."""
    ex = _example()
    pl.seed_everything(0, verbose=False)
    module = ex.CausalLM(ex.tiny_llama())
    data = torch.utils.data.DataLoader(ex.RandomTokens(num_samples=16, seq_len=32, vocab_size=512), batch_size=2)
    trainer = pl.Trainer(strategy=LLMemAutoStrategy(gpu="h100-sxm", compare_after_steps=1), accelerator="cpu",
                         devices=1, max_steps=3, default_root_dir=str(tmp_path), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    (meter,) = [c for c in trainer.callbacks if type(c).__name__ == "LLMemVerify"]
    steps = meter.comparison.measurement.steps
    assert [s["step"] for s in steps] == [1, 2]
    pred = meter.comparison.prediction.tensor_bytes
    assert steps[0]["allocated_bytes"] < pred  # what a step-1 comparison would have reported as an error
    # step 2 holds what the estimate predicts plus, as in the one-device test
    # above, the Dataset's token tensor and self.log("loss")'s four scalars
    assert steps[1]["allocated_bytes"] - pred == -(-16 * 32 * 8 // 512) * 512 + 4 * 512
    (row,) = _rows(tmp_path)
    assert row["predicted"]["tensor_bytes"] == meter.comparison.prediction.tensor_bytes


def test_a_pipeline_candidate_is_reported_as_not_runnable_in_lightning(cuda_plan):
    """A plan made with the pipeline methods (llmem plan) may pick pp: Lightning has no strategy for it."""
    import dataclasses

    from llmem_plugin.errors import ConfigError

    p, model = cuda_plan
    pipeline = dataclasses.replace(p.candidates[0], method="pp", pp=2)
    with pytest.raises(ConfigError, match="pipeline parallelism does not run in Lightning's Trainer"):
        lightning_strategy(p, pipeline, module=model)
