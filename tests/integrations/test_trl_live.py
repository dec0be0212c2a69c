"""LLMemCallback on TRL 1.16.0's own SFTTrainer, run live on the CPU (tests/recipes/probes/trl_sft_live.py).

SFTTrainer patches the model with its fused LM head, which never builds the
logits; the callback must recognise it and estimate that head
(``--loss trl-fused``), not the model's own loss. The measured side is the real
run under the CUDA emulation, where TRL's own Python allocates every buffer of
the head (statistics, the 4096 x 32768 tile, casts, gathers, fp32 gradient
accumulators) and only the Triton folds are replaced by TRL's torch folds run
without their temporaries. What stays outside the estimate is the Trainer's
own handful of 512-byte scalars (the loss accumulator, the gradient norm, the
token count) and the collator's attention mask: a few KiB, under 0.1% here.
"""

from __future__ import annotations

import pytest

from ..recipes.conftest import run_probe


@pytest.mark.parametrize("packing,dtype,gc", [("wrapped", "fp32", "0"), ("wrapped", "bf16", "1"),
                                              ("none", "bf16", "0")])
def test_sft_trainer_with_lora_is_estimated_within_1pct_of_the_measured_peak(packing, dtype, gc):
    out = run_probe("trl_sft_live.py", packing, dtype, gc)
    assert out["warnings"] == [] and out["steps"] == 3, out["warnings"]
    wl = out["workload"]
    assert wl["loss"] == "trl-fused" and wl["grad_checkpointing"] == (gc == "1")
    # bf16 weights with peft's fp32 adapters are not cast to bf16 (the Trainer trains them as they are)
    assert wl["precision"] == ("bf16" if dtype == "bf16" else "fp32")
    pred, meas = out["predicted"], out["measured"]
    assert abs(pred - meas) <= 0.01 * meas, (pred, meas)


def test_sft_trainer_with_padding_free_packing_on_sdpa_warns_once_and_trains():
    # TRL's default packing ("bfd") is padding-free; without flash attention transformers builds a block mask
    # over the packed row, which is not modelled: one warning, and training goes on.
    out = run_probe("trl_sft_live.py", "bfd", "fp32", "0")
    assert out["steps"] == 3 and out["predicted"] is None
    assert len(out["warnings"]) == 1 and "packed-docs with --attn sdpa is not modelled" in out["warnings"][0]
