"""Parameter, gradient and optimizer-state bytes equal closed forms.

The closed forms come from the documented rules, not from the trace:
* every tensor is a separate CUDA allocation rounded up to 512 B
  (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize);
* gradients have their parameter's dtype (AccumulateGrad);
* torch/optim/adam.py: AdamW keeps exp_avg and exp_avg_sq like the parameter,
  and `step` on the host unless fused; its foreach path allocates one
  temporary list the size of the states (`_foreach_sqrt(exp_avg_sqs)`);
* torch/optim/sgd.py: one momentum buffer like the parameter;
* torch/optim/_adafactor.py: a row and a column factor for matrices, a full
  variance for vectors;
* peft get_peft_model(autocast_adapter_dtype=True), its default: adapters of
  a 16-bit model in fp32; autocast_adapter_dtype=False (LoraSpec.adapter_dtype
  "base"): adapters in the base weights' dtype.
"""

from __future__ import annotations

import math

import pytest

from llmem_plugin.models import modelbuild
from llmem_plugin.estimate import _trace
from llmem_plugin.trace.tracker import MemoryCategory as C
from llmem_plugin.trace.tracker import Phase, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config


def rounded(tensors, itemsize=None) -> int:
    return sum(round_allocation(t.numel() * (itemsize or t.element_size())) for t in tensors)


def optimizer_phase(arch: str, wl: Workload, **cfg):
    model = modelbuild.build_model(tiny_config(arch, **cfg), wl)
    params = list({id(p): p for p in model.parameters()}.values())
    buffers = list(model.buffers())
    result = _trace(model, wl)
    return params, buffers, result


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "sgd", "adafactor"])
def test_model_state_bytes(precision, optimizer):
    wl = Workload(seq_len=32, micro_batch_size=1, precision=precision, optimizer=optimizer)
    params, buffers, result = optimizer_phase("llama", wl)
    bd = result.phase_breakdowns[Phase.OPTIMIZER]
    p_bytes = rounded(params)
    assert bd[C.PARAMETER] == p_bytes + rounded(buffers)
    assert bd[C.GRADIENT] == p_bytes
    if optimizer == "adamw":
        assert bd[C.OPTIMIZER_STATE] == 2 * p_bytes
        assert bd[C.TEMPORARY] == p_bytes  # the _foreach_sqrt list
    elif optimizer == "adamw-fused":
        # fused keeps a 0-dim fp32 `step` per parameter on the device
        assert bd[C.OPTIMIZER_STATE] == 2 * p_bytes + len(params) * round_allocation(4)
        assert bd[C.TEMPORARY] == 0
    elif optimizer == "sgd":
        assert bd[C.OPTIMIZER_STATE] == p_bytes
    else:
        factors = 0
        for p in params:
            if p.dim() > 1:
                factors += round_allocation(math.prod(p.shape[:-1]) * p.element_size())
                factors += round_allocation(math.prod(p.shape[:-2] + p.shape[-1:]) * p.element_size())
            else:
                factors += round_allocation(p.numel() * p.element_size())
        assert bd[C.OPTIMIZER_STATE] == factors
    # AdamW/SGD/Adafactor in pure bf16 keep states in the parameter dtype.
    assert {p.element_size() for p in params} == {2 if precision == "bf16" else 4}


@pytest.mark.parametrize("adapter_dtype", ["fp32", "base"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_lora_adds_adapters_and_only_they_train(precision, adapter_dtype):
    base = Workload(seq_len=32, micro_batch_size=1, precision=precision)
    lora = Workload(seq_len=32, micro_batch_size=1, precision=precision,
                    lora=LoraSpec(rank=8, target_modules=("q_proj", "v_proj"), adapter_dtype=adapter_dtype))
    params, _, full = optimizer_phase("llama", base)
    lparams, _, lres = optimizer_phase("llama", lora)
    cfg = tiny_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # q_proj: hidden -> heads*head_dim, v_proj: hidden -> kv_heads*head_dim; A is r x in, B is out x r
    shapes = []
    for _ in range(cfg.num_hidden_layers):
        for out in (cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim):
            shapes += [(8, cfg.hidden_size), (out, 8)]
    # fp32 adapters, except "base" adapters of a pure-bf16 model (bf16-mixed weights are fp32 anyway)
    itemsize = 2 if (adapter_dtype, precision) == ("base", "bf16") else 4
    adapter_bytes = sum(round_allocation(a * b * itemsize) for a, b in shapes)
    assert {p.element_size() for p in lparams if p.requires_grad} == {itemsize}
    bd, lbd = full.phase_breakdowns[Phase.OPTIMIZER], lres.phase_breakdowns[Phase.OPTIMIZER]
    assert lbd[C.PARAMETER] - bd[C.PARAMETER] == adapter_bytes
    assert lbd[C.GRADIENT] == adapter_bytes
    assert lbd[C.OPTIMIZER_STATE] == 2 * adapter_bytes
    assert lbd[C.GRADIENT] < bd[C.GRADIENT] and lres.peak_bytes < full.peak_bytes


def test_gradient_checkpointing_keeps_one_layer_input_per_layer():
    """Non-reentrant checkpointing keeps each layer's input and nothing else it saved.

    Under bf16 autocast the residual stream is fp32 (fp32 embedding weights),
    so one more layer keeps exactly one more b*s*h*4-byte tensor at the end of
    the forward, and parameters, gradients and states do not move.
    """
    b, s = 2, 64
    res = {}
    for gc in (False, True):
        for layers in (2, 3):
            wl = Workload(seq_len=s, micro_batch_size=b, precision="bf16-mixed", grad_checkpointing=gc)
            _, _, r = optimizer_phase("llama", wl, num_hidden_layers=layers)
            res[gc, layers] = r
    hidden = tiny_config("llama").hidden_size
    act = {k: r.phase_breakdowns[Phase.FORWARD][C.ACTIVATION] for k, r in res.items()}
    assert act[True, 3] - act[True, 2] == round_allocation(b * s * hidden * 4)
    assert act[True, 3] < act[False, 3]
    for layers in (2, 3):
        on, off = res[True, layers].phase_breakdowns, res[False, layers].phase_breakdowns
        for cat in (C.PARAMETER, C.GRADIENT, C.OPTIMIZER_STATE):
            assert on[Phase.OPTIMIZER][cat] == off[Phase.OPTIMIZER][cat]
        assert res[True, layers].peak_bytes <= res[False, layers].peak_bytes


def test_gradient_accumulation_keeps_gradients_between_micro_steps():
    one = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed")
    four = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", grad_accum_steps=4)
    params, _, r1 = optimizer_phase("llama", one)
    _, _, r4 = optimizer_phase("llama", four)
    # From the second micro-step on, the forward runs with all gradients alive.
    assert r4.phase_breakdowns[Phase.FORWARD][C.GRADIENT] == rounded(params)
    assert r1.phase_breakdowns[Phase.FORWARD][C.GRADIENT] == 0
