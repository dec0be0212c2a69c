"""LLMemBatchSizeFinder (Lightning) and the HF Trainer's find_batch_size: the batch size set before the
first step, equal to the search API's answer for the same job, with no trial step."""

from __future__ import annotations

import warnings

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch
from torch.utils.data import DataLoader

from llmem_plugin.integrations import _common
from llmem_plugin.integrations.lightning import LLMemBatchSizeFinder
from llmem_plugin.planner.largest import max_batch_size
from llmem_plugin.workload import Workload

from tests.conftest import room, tiny_config
from tests.integrations.test_lightning import _example

_SEQ = 64
_MEMORY = room(0.5)


def _module(where: str):
    ex = _example()

    class Counted(ex.CausalLM):
        def __init__(self) -> None:
            super().__init__(tiny_config("llama"))
            self.steps = 0
            if where == "module":
                self.batch_size = 1
            elif where == "hparams":
                self.save_hyperparameters({"batch_size": 1})

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return super().training_step(batch, batch_idx)

        def train_dataloader(self):
            size = self.batch_size if where == "module" else self.hparams.batch_size
            return DataLoader(ex.RandomTokens(num_samples=4096, seq_len=_SEQ, vocab_size=512), batch_size=size)

    return Counted()


def _fit(module, finder) -> "pl.Trainer":
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[finder], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("where", ["module", "hparams"])
def test_the_finder_sets_the_api_s_answer_before_the_first_step(where):
    module = _module(where)
    finder = LLMemBatchSizeFinder(gpu="h100-sxm", gpu_memory=_MEMORY, margin=0.0)
    _fit(module, finder)
    live = _common.live_model(module)
    wl = Workload(seq_len=_SEQ, micro_batch_size=2, precision="fp32", runner="lightning")
    expected = max_batch_size(live.module, wl, gpu=_target(), headroom=0.04)
    assert finder.optimal_batch_size == expected.value > 2
    got = module.batch_size if where == "module" else module.hparams.batch_size
    assert got == expected.value
    assert module.steps == 2  # the two steps of max_steps; none was run to find the size


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_the_margin_reduces_the_found_size_in_binsearch_mode_as_lightning_s_finder_does(mode):
    # lightning/pytorch/tuner/batch_size_scaling.py applies `margin` after its binary search only.
    module = _module("module")
    finder = LLMemBatchSizeFinder(mode=mode, gpu="h100-sxm", gpu_memory=_MEMORY, margin=0.25)
    _fit(module, finder)
    assert module.batch_size == (int(finder.result.value * 0.75) if mode == "binsearch" else finder.result.value)


def test_a_machine_without_a_gpu_name_warns_once_and_trains_with_the_batch_as_it_was():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: its own device is estimated")
    module = _module("module")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(module, LLMemBatchSizeFinder())
    lines = [str(w.message) for w in caught if "LLMemBatchSizeFinder" in str(w.message)]
    assert len(lines) == 1 and "training goes on" in lines[0]
    assert module.batch_size == 1 and module.steps == 2


def test_a_missing_batch_attribute_is_named():
    module = _module("module")
    with pytest.raises(Exception, match="Field batch_sz not found"):
        _fit(module, LLMemBatchSizeFinder(batch_arg_name="batch_sz", gpu="h100-sxm"))


def _target():
    import dataclasses

    from llmem_plugin.device.gpus import get_gpu

    return dataclasses.replace(get_gpu("h100-sxm"), memory_bytes=_MEMORY, driver_memory_bytes=None)


# ----------------------------------------------------------------------------- HF Trainer

def test_the_hf_callback_sets_the_per_device_batch_before_the_dataloader_is_built(tmp_path):
    import transformers
    from transformers import Trainer, TrainingArguments

    from llmem_plugin.integrations.hf import LLMemCallback, largest_batch
    from tests.integrations.test_hf import SEQ, _CountSteps, _model, _Tokens

    model = _model()
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                              use_cpu=True, report_to=[], save_strategy="no", dataloader_num_workers=0,
                              optim="adamw_torch")
    # The callback keeps its check's 5% margin free (more than the default 4% headroom).
    expected = largest_batch(model, targs, seq_len=SEQ, gpu="h100-sxm", gpu_memory=_MEMORY, headroom=0.05)
    count = _CountSteps()
    cb = LLMemCallback(find_batch_size=True, seq_len=SEQ, gpu="h100-sxm", gpu_memory=_MEMORY, compare_after_steps=0)
    trainer = Trainer(model=model, args=targs, train_dataset=_Tokens(model.config.vocab_size, n=4096),
                      callbacks=[cb, count])
    assert trainer.args.per_device_train_batch_size == expected.value > 2
    seen = []
    trainer.add_callback(type("Seen", (transformers.TrainerCallback,), {
        "on_step_begin": lambda self, *a, **k: seen.append(trainer._train_batch_size)})())
    trainer.train()
    assert seen == [expected.value] * 2 and count.optimizer_steps == 2  # no step at another size


def test_find_batch_size_needs_the_sequence_length():
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.integrations.hf import LLMemCallback

    with pytest.raises(ConfigError, match="seq_len"):
        LLMemCallback(find_batch_size=True)


def test_a_callback_added_after_the_trainer_is_built_says_it_had_no_effect(tmp_path):
    from transformers import Trainer, TrainingArguments

    from llmem_plugin.integrations.hf import LLMemCallback
    from tests.integrations.test_hf import _model, _Tokens

    model = _model()
    targs = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1,
                              use_cpu=True, report_to=[], save_strategy="no", optim="adamw_torch")
    trainer = Trainer(model=model, args=targs, train_dataset=_Tokens(model.config.vocab_size, n=8))
    trainer.add_callback(LLMemCallback(find_batch_size=True, seq_len=64, gpu="h100-sxm", gpu_memory=_MEMORY,
                                       compare_after_steps=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert any("find_batch_size=True had no effect" in str(w.message) for w in caught)
    assert trainer.args.per_device_train_batch_size == 2
