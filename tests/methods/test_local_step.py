"""The optimizer step on local shards (methods._local_step) records what the
DTensor step records, event for event, and computes the same update.

The reference is the DTensor step itself: ``_local_step._eligible`` patched
to refuse makes :class:`LocalShardStep` run ``optimizer.step()`` on the
DTensor parameters, the path the real gloo comparisons in test_fsdp.py and
test_tp.py were first checked on.

LoRA with sequence parallel is left out: the first such trace in a process
records a few more small scratch tensors in the forward than later ones
(DTensor's uncached propagation of a ``_StridedShard`` layout builds index
tensors under the trace's fake mode), whichever step runs.
"""

from __future__ import annotations

import pytest
import torch

from llmem_plugin.models import modelbuild
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import _local_step, fsdp, tp
from llmem_plugin.methods.layout import Layout
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
_NO_DOWN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


def _fsdp(arch="llama", *, num_gpus=3, rank=2, sharding="full", num_nodes=1, cpu_offload=False, **wl):
    workload = Workload(**{"seq_len": 32, "micro_batch_size": 1, "precision": "bf16-mixed", **wl})
    r = fsdp._trace_rank(tiny_config(arch), workload, layout=Layout(num_gpus=num_gpus, num_nodes=num_nodes),
                         rank=rank, gpu=H100, sharding=sharding, reshard_after_forward=True,
                         param_dtype=fsdp._param_dtype(workload, None), cpu_offload=cpu_offload)
    return r.trace, {"host_bytes": r.host_bytes}


def _tp(arch="llama", *, preset="tp", num_gpus=2, sequence_parallel=False, **wl):
    workload = Workload(**{"seq_len": 32, "micro_batch_size": 2, "precision": "bf16-mixed", **wl})
    model = modelbuild.build_model(tiny_config(arch), workload, device="meta")
    result, colls, _ = tp._trace_one(model, workload, layout=Layout(num_gpus=num_gpus, tp=2), rank=0, gpu=H100,
                                     data_parallel=tp.PRESETS[preset]["data_parallel"],
                                     sequence_parallel=sequence_parallel)
    return result, {"collectives": [(c.op, c.group_name, c.group_size, c.payload_bytes) for c in colls]}


# name -> (trace, whether the local step applies)
CASES = {
    "fsdp-uneven-last-rank": (lambda: _fsdp(), True),
    "fsdp-pure-bf16-fused": (lambda: _fsdp(precision="bf16", optimizer="adamw-fused"), True),
    "fsdp-sgd-checkpointing": (lambda: _fsdp("qwen2", optimizer="sgd", grad_checkpointing=True), True),
    "fsdp-lora-accum": (lambda: _fsdp(lora=LoraSpec(rank=4), grad_accum_steps=2), True),
    "fsdp-offload": (lambda: _fsdp(num_gpus=2, rank=1, cpu_offload=True), True),
    "hsdp-2x3": (lambda: _fsdp(num_gpus=6, rank=5, sharding="hybrid", num_nodes=2), True),
    "dp-tp": (lambda: _tp(preset="dp-tp", num_gpus=4, grad_accum_steps=2), True),
    "fsdp-tp-sp": (lambda: _tp(preset="fsdp-tp", num_gpus=4, sequence_parallel=True), True),
    "fsdp-tp-lora": (lambda: _tp("qwen2", preset="fsdp-tp", num_gpus=4, lora=LoraSpec(rank=4)), True),
    "tp-lora": (lambda: _tp(lora=LoraSpec(rank=4, target_modules=_NO_DOWN), grad_checkpointing=True), True),
    # The replicated embedding gradient against the vocabulary-sharded weight:
    # DTensor redistributes inside the step, so the DTensor step runs.
    "tp": (lambda: _tp(), False),
    "tp-sp-sgd": (lambda: _tp(sequence_parallel=True, optimizer="sgd"), False),
}


def _as_dict(result, extra) -> dict:
    return {
        "events": result.events, "timeline": result.timeline, "peak": result.peak_bytes,
        "peak_phase": result.peak_phase, "peak_module": result.peak_module, "breakdown": result.breakdown,
        "phase_peaks": result.phase_peaks, "phase_breakdowns": result.phase_breakdowns,
        "num_events": result.num_events, **extra,
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_step_records_the_dtensor_steps_events(name, monkeypatch):
    run, applies = CASES[name]
    eligible = _local_step._eligible
    decisions = []

    def spy(optimizer):
        decisions.append(eligible(optimizer))
        return decisions[-1]

    monkeypatch.setattr(_local_step, "_eligible", spy)
    fast = _as_dict(*run())
    assert decisions and set(decisions) == {applies}, decisions
    monkeypatch.setattr(_local_step, "_eligible", lambda optimizer: False)
    reference = _as_dict(*run())
    for key in reference:
        assert fast[key] == reference[key], (name, key)


@pytest.mark.parametrize(("kind", "swap"), [("adamw", False), ("adamw-fused", False), ("sgd", False),
                                          ("adamw", True)])
def test_local_step_updates_as_the_dtensor_step(kind, swap):
    """Real tensors: the twin steps the local shards with the DTensor
    optimizer's hyperparameters, so parameters and states come out bitwise
    equal over two steps; uneven shards included. ``swap``: the parameters'
    local tensors are replaced between the steps (as a wrapper re-padding
    its shards would), and the states follow them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from llmem_plugin.methods._fakepg import fake_process_group
    from llmem_plugin.trace.step import make_optimizer, state_tensors
    from llmem_plugin.workload import OptimizerKind

    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (4,), (2, 6)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,))

        def dtensor(t):
            return DTensor.from_local(t.clone(), mesh, (Shard(0),), run_check=False)

        runs = []
        for local in (True, False):
            params = [torch.nn.Parameter(dtensor(v)) for v in values]
            optimizer = make_optimizer(params, OptimizerKind(kind))
            step = _local_step.LocalShardStep()
            for i, g in enumerate(grads):
                for p, gi in zip(params, g, strict=True):
                    if swap and i:
                        p._local_tensor = p._local_tensor.clone()
                    p.grad = dtensor(gi)
                stepped = step(optimizer) if local else (optimizer.step(), optimizer)[1]
                assert (stepped is not optimizer) == local
                optimizer.zero_grad(set_to_none=True)
            runs.append(([p._local_tensor for p in params],
                         [_local_of(t) for t in state_tensors(stepped)]))
    (fast_params, fast_states), (ref_params, ref_states) = runs
    assert all(torch.equal(a, b) for a, b in zip(fast_params, ref_params, strict=True))
    assert len(fast_states) == len(ref_states)
    assert all(torch.equal(a, b) for a, b in zip(fast_states, ref_states, strict=True))


def _local_of(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def test_a_gradient_sharded_unlike_its_parameter_steps_on_dtensors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from llmem_plugin.methods._fakepg import fake_process_group
    from llmem_plugin.trace.step import make_optimizer
    from llmem_plugin.workload import OptimizerKind

    with fake_process_group(world_size=2, rank=0):
        mesh = init_device_mesh("cpu", (2,))
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 3), mesh, (Shard(0),), run_check=False))
        p.grad = DTensor.from_local(torch.ones(4, 3), mesh, (Replicate(),), run_check=False)
        optimizer = make_optimizer([p], OptimizerKind.ADAMW)
        assert _local_step.LocalShardStep()(optimizer) is optimizer
        assert set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
