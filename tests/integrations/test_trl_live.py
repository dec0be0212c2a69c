"""LLMemCallback on TRL 1.16.0's own SFTTrainer and DPOTrainer, run live on the CPU
(tests/recipes/probes/trl_sft_live.py, trl_dpo_live.py).

Both trainers patch the model with TRL's fused LM head, which never builds the
logits; the callback must recognise it and estimate that head
(``--loss trl-fused``), not the model's own loss, and for DPO the concatenated
chosen and rejected rows and the reference's no_grad forward. The measured side
is the real run under the CUDA emulation, where TRL's own Python allocates
every buffer of the head (statistics, the 4096 x 32768 tile, casts, gathers,
fp32 gradient accumulators) and only the Triton folds are replaced by TRL's
torch folds run without their temporaries. What stays outside the estimate is
the Trainer's own handful of 512-byte scalars (the loss accumulator, the
gradient norm, the token count) and the collator's attention mask: a few KiB,
under 0.1% of these peaks.
"""

from __future__ import annotations

import pytest

from tests.recipes.conftest import run_probe


def _within_1pct(out: dict) -> None:
    assert out["warnings"] == [] and out["steps"] == 3, out["warnings"]
    pred, meas = out["predicted"], out["measured"]
    assert abs(pred - meas) <= 0.01 * meas, (pred, meas)


@pytest.mark.parametrize("packing,dtype,gc,tuning", [("wrapped", "fp32", "0", "lora"), ("wrapped", "bf16", "1", "lora"),
                                                     ("none", "bf16", "0", "lora"), ("wrapped", "bf16", "0", "full")])
def test_sft_trainer_is_estimated_within_1pct_of_the_measured_peak(packing, dtype, gc, tuning):
    out = run_probe("trl_sft_live.py", packing, dtype, gc, tuning)
    _within_1pct(out)
    wl = out["workload"]
    assert wl["loss"] == "trl-fused" and wl["grad_checkpointing"] == (gc == "1") and not wl["reference_model"]
    # bf16 weights with peft's fp32 adapters are not cast to bf16 (the Trainer trains them as they are)
    assert wl["precision"] == ("bf16" if dtype == "bf16" else "fp32")


def test_sft_trainer_with_padding_free_packing_on_sdpa_warns_once_and_trains():
    # TRL's default packing ("bfd") is padding-free; without flash attention transformers builds a block mask
    # over the packed row, which is not modelled: one warning, and training goes on.
    out = run_probe("trl_sft_live.py", "bfd", "fp32", "0", "lora")
    assert out["steps"] == 3 and out["predicted"] is None
    assert len(out["warnings"]) == 1 and "packed-docs with --attn sdpa is not modelled" in out["warnings"][0]


@pytest.mark.parametrize("reference,dtype", [("lora", "fp32"), ("lora", "bf16"), ("copy", "bf16")])
def test_dpo_trainer_with_its_reference_is_estimated_within_1pct_of_the_measured_peak(reference, dtype):
    out = run_probe("trl_dpo_live.py", reference, dtype)
    _within_1pct(out)
    wl = out["workload"]
    # two pairs per device: the chosen and rejected rows of both, one prompt token + 40 completion tokens each
    assert (wl["loss"], wl["reference_model"], wl["micro_batch_size"], wl["seq_len"]) == ("trl-fused", True, 4, 41)


def _trainer_of(name: str, module: str, base: type = object, **args):
    """An object whose class looks like a TRL trainer to the adapter (no TRL import)."""
    import types

    import torch

    cls = type(name, (base,), {"__module__": module})
    trainer = cls()
    trainer.args = types.SimpleNamespace(**args)
    trainer.model = torch.nn.Linear(2, 2)
    trainer.ref_model = None
    return trainer


def _step(trainer, **live_fields):
    import dataclasses

    from llmem_plugin.integrations import _common
    from llmem_plugin.integrations.hf import _trl_step

    return _trl_step(trainer, dataclasses.replace(_common.live_model(trainer.model), **live_fields))


@pytest.mark.parametrize("name,module", [("GRPOTrainer", "trl.trainer.grpo_trainer"),
                                         ("KTOTrainer", "trl.trainer.kto_trainer"),
                                         ("RLOOTrainer", "trl.trainer.rloo_trainer")])
def test_trl_trainers_other_than_sft_and_dpo_are_refused_in_one_line(name, module):
    from llmem_plugin.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=f"TRL's {name} is not modelled") as e:
        _step(_trainer_of(name, module))
    assert "\n" not in str(e.value)


def test_an_sft_subclass_in_trl_with_a_teacher_is_refused_and_a_user_subclass_is_sft():
    from llmem_plugin.errors import UnsupportedError

    sft = type(_trainer_of("SFTTrainer", "trl.trainer.sft_trainer"))
    with pytest.raises(UnsupportedError, match="TRL's GKDTrainer is not modelled"):
        _step(_trainer_of("GKDTrainer", "trl.experimental.gkd.gkd_trainer", base=sft))
    assert _step(_trainer_of("MySFT", "my_project.train", base=sft)) == "sft"


def test_sft_with_a_full_logits_loss_is_refused():
    from llmem_plugin.errors import UnsupportedError

    trainer = _trainer_of("SFTTrainer", "trl.trainer.sft_trainer")
    trainer.label_smoother = object()
    with pytest.raises(UnsupportedError, match="label_smoothing_factor or compute_loss_func.*HINT"):
        _step(trainer)


@pytest.mark.parametrize("key", ["precompute_ref_log_probs", "use_weighting"])
def test_dpo_settings_that_change_the_step_are_refused(key):
    from llmem_plugin.errors import UnsupportedError

    args = {"precompute_ref_log_probs": False, "use_weighting": False, key: True}
    with pytest.raises(UnsupportedError, match=f"DPOConfig {key}=True is not modelled.*HINT: set {key}=False"):
        _step(_trainer_of("DPOTrainer", "trl.trainer.dpo_trainer", **args))
    ok = _trainer_of("DPOTrainer", "trl.trainer.dpo_trainer", precompute_ref_log_probs=False, use_weighting=False)
    assert _step(ok) == "dpo"
    assert _step(_trainer_of("SFTTrainer", "trl.trainer.sft_trainer")) == "sft"
    assert _step(_trainer_of("Trainer", "transformers.trainer")) is None


def test_a_separate_reference_beside_a_lora_policy_is_refused():
    # TRL uses a given ref_model even for a peft policy (dpo_trainer.py); the estimate would disable adapters
    import copy

    from llmem_plugin.errors import UnsupportedError
    from llmem_plugin.workload import LoraSpec

    trainer = _trainer_of("DPOTrainer", "trl.trainer.dpo_trainer", precompute_ref_log_probs=False, use_weighting=False)
    trainer.ref_model = copy.deepcopy(trainer.model)
    with pytest.raises(UnsupportedError, match="separate ref_model beside a LoRA policy.*HINT: pass ref_model=None"):
        _step(trainer, lora=LoraSpec(rank=4))
