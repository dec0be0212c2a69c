"""The fake trace allocates, byte for byte, what a real CPU run of the same step allocates.

Both runs go through the same tracker, the same CUDA emulation and the same
training step; only the tensors differ (fake vs real CPU). Any allocation that
fake tensors add, drop or resize shows up as a difference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.models import modelbuild
from llmem_plugin.estimate import vocab_size_of
from llmem_plugin.trace.step import trace_step
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config


def fake_and_real(cfg, wl: Workload):
    """The step traced on fake tensors and run for real on the CPU, both by the tracker."""
    fake_model = modelbuild.build_model(cfg, wl, device="meta")
    fake_mode = FakeTensorMode()
    modelbuild.fakeify(fake_model, fake_mode)
    fake = trace_step(fake_model, wl, vocab_size=vocab_size_of(fake_model), fake_mode=fake_mode)
    torch.manual_seed(0)
    real_model = modelbuild.build_model(cfg, wl, device="cpu")
    real = trace_step(real_model, wl, vocab_size=vocab_size_of(real_model))
    return fake, real


WORKLOADS = {
    "fp32": Workload(seq_len=64, micro_batch_size=2, precision="fp32"),
    "bf16-mixed": Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed"),
    "bf16": Workload(seq_len=64, micro_batch_size=2, precision="bf16"),
    "fp16-mixed-fused": Workload(seq_len=32, micro_batch_size=1, precision="fp16-mixed", optimizer="adamw-fused"),
    "bf16-mixed-gc": Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", grad_checkpointing=True),
    # LLaMA-Factory's default: reentrant checkpointing (each layer's forward reruns inside its backward)
    "bf16-lora-gc-reentrant": Workload(seq_len=64, micro_batch_size=2, precision="bf16", grad_checkpointing=True,
                                       checkpoint_reentrant=True, lora=LoraSpec(rank=4)),
    "bf16-mixed-lora": Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", lora=LoraSpec(rank=4)),
    # adapters in the base dtype: each LoRA branch runs on the bf16 input itself, no fp32 copy
    "bf16-lora-base": Workload(seq_len=64, micro_batch_size=2, precision="bf16",
                               lora=LoraSpec(rank=4, dropout=0.1, adapter_dtype="base")),
    "sgd-accum": Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", optimizer="sgd",
                          grad_accum_steps=2),
    "eager-adafactor": Workload(seq_len=32, micro_batch_size=1, precision="fp32", optimizer="adafactor",
                                attn_implementation="eager"),
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_fake_trace_equals_real_cpu_run(arch, name):
    wl = WORKLOADS[name]
    if arch == "gpt2" and wl.lora is not None:
        wl = Workload(**{**wl.__dict__, "lora": dataclasses.replace(wl.lora, target_modules=("c_attn",))})
    if arch == "opt" and wl.lora is not None:
        wl = Workload(**{**wl.__dict__, "lora": dataclasses.replace(wl.lora, target_modules=("q_proj", "v_proj"))})
    if arch == "mixtral" and wl.precision.value != "bf16":
        # grouped_mm experts take bf16 only on CUDA (see modelbuild._check_moe_dtype).
        wl = Workload(**{**wl.__dict__, "precision": "bf16"})
    fake, real = fake_and_real(tiny_config(arch), wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_phase == real.peak_phase
    assert fake.breakdown == real.breakdown
    assert fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]
