"""Op-level selective activation checkpointing, traced for real.

The policy runs inside ``torch.utils.checkpoint`` (``context_fn``); the fake
trace must equal a real CPU run measured by the same tracker, with each SDPA
kernel's emulation standing in for the ATen op the policy names. The stub
CUDA device checks the same policy against torch's real CUDA SDPA op
(tests/stub/test_wholestep.py, the ``tiny4-...-sac-...`` cases).
"""

from __future__ import annotations

import pytest
import torch

import llmem_plugin
from llmem_plugin.techniques import checkpointing
from llmem_plugin.models import modelbuild
from llmem_plugin.trace.step import trace_step
from llmem_plugin.estimate import vocab_size_of
from llmem_plugin.trace.tracker import Phase
from llmem_plugin.workload import LoraSpec, Workload

from tests.cli._run import run
from tests.conftest import tiny_config

_TITAN = "torchtitan"
# compute capability -> the SDPA kernel the emulation picks for bf16 at head_dim 16 (torch 2.13):
# cuDNN on sm90, flash on sm80.
_KERNELS = {(9, 0): "aten._scaled_dot_product_cudnn_attention", (8, 0): "aten._scaled_dot_product_flash_attention"}


def wl(save_ops: str | None, **kw) -> Workload:
    return Workload(seq_len=128, micro_batch_size=2, precision=kw.pop("precision", "bf16"), grad_checkpointing=True,
                    checkpoint_save_ops=save_ops, attn_implementation="sdpa", **kw)


def fake_and_real(cfg, workload: Workload, cc):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_model = modelbuild.build_model(cfg, workload, device="meta")
    fake_mode = FakeTensorMode()
    modelbuild.fakeify(fake_model, fake_mode)
    fake = trace_step(fake_model, workload, vocab_size=vocab_size_of(fake_model), fake_mode=fake_mode,
                      compute_capability=cc)
    torch.manual_seed(0)
    real_model = modelbuild.build_model(cfg, workload, device="cpu")
    real = trace_step(real_model, workload, vocab_size=vocab_size_of(real_model), compute_capability=cc)
    return fake, real


@pytest.mark.parametrize("cc", sorted(_KERNELS))
@pytest.mark.parametrize("save_ops", [_TITAN, "aten.mm"])
def test_fake_equals_a_real_cpu_run(cc, save_ops):
    cfg = tiny_config("llama", num_hidden_layers=3)
    fake, real = fake_and_real(cfg, wl(save_ops, lora=LoraSpec(rank=4)), cc)
    assert fake.peak_bytes == real.peak_bytes and fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def _policy_log(monkeypatch):
    """(op, saved) per policy call, as torch's SAC asks it."""
    log = []
    call = checkpointing._Policy.__call__

    def spy(self, ctx, func, *args, **kwargs):
        decision = call(self, ctx, func, *args, **kwargs)
        name = checkpointing._emulated[-1] if checkpointing._emulated else checkpointing._op_name(func)
        log.append((name, decision.name == "MUST_SAVE"))
        return decision

    monkeypatch.setattr(checkpointing._Policy, "__call__", spy)
    return log


@pytest.mark.parametrize("cc", sorted(_KERNELS))
def test_torchtitan_saves_every_other_mm_and_the_attention_kernel(monkeypatch, cc):
    # torchtitan's rule: the 1st, 3rd, 5th ... aten.mm of each layer saved, every SDPA kernel output saved.
    # A Llama layer runs 7 mm (q, k, v, o, gate, up, down): 4 saved, 3 recomputed.
    log = _policy_log(monkeypatch)
    cfg = tiny_config("llama", num_hidden_layers=2)
    fake_and_real(cfg, wl(_TITAN), cc)
    mm = [saved for name, saved in log if name == "aten.mm"]
    assert len(mm) == 2 * 2 * 2 * 7  # fake + real, 2 steps, 2 layers
    assert mm == [i % 2 == 0 for i in range(7)] * 8
    kernel = [saved for name, saved in log if name == _KERNELS[cc]]
    assert kernel and all(kernel)
    others = {name for name, saved in log if saved} - {"aten.mm", _KERNELS[cc]}
    assert not others


def test_saved_outputs_sit_between_full_checkpointing_and_none():
    cfg = tiny_config("llama", num_hidden_layers=6)
    fwd = {}
    for name, kw in (("none", {"grad_checkpointing": False}), ("full", {}), (_TITAN, {"checkpoint_save_ops": _TITAN}),
                     ("mm", {"checkpoint_save_ops": "aten.mm"})):
        base = {"grad_checkpointing": True, **kw}
        w = Workload(seq_len=256, micro_batch_size=4, precision="bf16", attn_implementation="sdpa", **base)
        fwd[name] = llmem_plugin.estimate(cfg, w).phase_peaks[Phase.FORWARD]
    assert fwd["full"] < fwd[_TITAN] < fwd["mm"] < fwd["none"]
    # Closed form for what torchtitan's policy adds per layer over full checkpointing, bf16, cuDNN (sm90):
    # mm outputs q (h), v (kv), gate and down... saved: 1st q [h], 3rd v [kv], 5th gate [i], 7th down [h]
    # plus the attention output [h] (bf16) and its fp32 softmax stats [heads] per token, and cuDNN's
    # seed and offset (two 512-byte blocks).
    cfg_h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    tokens = 256 * 4
    per_layer = tokens * (cfg_h + kv + cfg.intermediate_size + cfg_h + cfg_h) * 2 + tokens * cfg.num_attention_heads * 4
    per_layer += 2 * 512
    layers = cfg.num_hidden_layers
    # The forward peak comes at the last layer; all earlier layers' saved outputs are held.
    assert (layers - 1) * per_layer <= fwd[_TITAN] - fwd["full"] <= layers * per_layer


def test_fast_mode_equals_the_full_trace():
    cfg = tiny_config("llama", num_hidden_layers=10)
    w = wl(_TITAN)
    full, fast = (llmem_plugin.estimate(cfg, w, fast=f) for f in (False, True))
    assert fast.fast and not fast.notes
    assert (fast.peak_allocated_bytes, fast.peak_reserved_bytes) == (full.peak_allocated_bytes,
                                                                     full.peak_reserved_bytes)


def test_policies_parse_and_bad_values_are_one_line_errors(capsys):
    assert checkpointing.parse_save_ops(_TITAN) is checkpointing.PRESETS[_TITAN]
    ops = checkpointing.parse_save_ops(" aten.mm.default, aten._scaled_dot_product_flash_attention ")
    assert ops.ops == {"aten.mm", "aten._scaled_dot_product_flash_attention"} and not ops.every_other_mm
    assert Workload(grad_checkpointing=True, checkpoint_save_ops="aten.mm.default").checkpoint_save_ops == "aten.mm"
    for bad, match in (("aten.no_such_op", "not an op this torch has"), ("mm", "not a torch op name"),
                       (" , ", "names no op"), ("", "must be a preset")):
        with pytest.raises(llmem_plugin.ConfigError, match=match):
            Workload(grad_checkpointing=True, checkpoint_save_ops=bad)
    with pytest.raises(llmem_plugin.ConfigError, match="add --grad-checkpointing"):
        Workload(checkpoint_save_ops=_TITAN)
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "16", "--grad-checkpointing",
                       "--checkpoint-save-ops", "aten.nope")
    assert code == 2 and err.count("\n") == 1 and "aten.nope" in err
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "16", "--grad-checkpointing",
                       "--checkpoint-save-ops", _TITAN)
    assert code == 0 and "op-level SAC (torchtitan)" in out
