"""What the adapters read back from a live peft model."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from llmem_plugin.integrations._common import live_model

from tests.conftest import tiny_config


@pytest.mark.parametrize("autocast", [True, False])
def test_live_peft_model_reports_its_adapter_dtype(autocast):
    """A live bf16 peft model: peft's default fp32 adapters read back as "fp32",
    adapters made with autocast_adapter_dtype=False (bf16) as "base"."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]),
                                autocast_adapter_dtype=autocast)
    live = live_model(model)
    assert live.lora.adapter_dtype == ("fp32" if autocast else "base")
    assert live.param_dtype == torch.bfloat16
