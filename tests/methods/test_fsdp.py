"""FSDP2 traced under a fake process group: shard bytes by closed forms, and
equal to a real two-process gloo run.

Closed forms (torch 2.13, torch/distributed/fsdp/_fully_shard/):
* _fsdp_param.py _init_sharded_param: every rank stores each parameter as a
  zero-padded shard of ceil(dim0 / S) rows (torch.chunk's chunk size), S the
  shard group's size; its own storage, rounded to 512 B by the allocator
  (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize);
* _fsdp_collectives.py foreach_reduce: the sharded gradients of one group are
  views into one reduce-scatter output of the padded shard sizes;
* torch/optim/adam.py: exp_avg and exp_avg_sq are zeros_like the local
  shard, whose rows are the rank's chunk of torch.chunk (fewer, or none, on
  the last ranks); the foreach step's _foreach_sqrt allocates one more list.
"""

from __future__ import annotations

import contextlib
import json
import textwrap

import pytest
import torch

from llmem_plugin.models import modelbuild
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import _local_step, fsdp
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import MemoryCategory as C
from llmem_plugin.trace.tracker import Phase, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.methods._gloo import run_gloo

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed")


def trace(cfg, wl=WL, *, layout, rank=0, sharding="full", reshard_after_forward=True, cpu_offload=False):
    return fsdp._trace_rank(cfg, wl, layout=layout, rank=rank, gpu=H100, sharding=sharding,
                            reshard_after_forward=reshard_after_forward, param_dtype=fsdp._param_dtype(wl, None),
                            cpu_offload=cpu_offload)


def groups_of(model):
    """FSDP parameter groups: one per decoder layer, the rest in the root's."""
    layers = [list({id(p): p for p in m.parameters()}.values()) for m in fsdp._decoder_layers(model)]
    claimed = {id(p) for g in layers for p in g}
    root = [p for p in {id(p): p for p in model.parameters()}.values() if id(p) not in claimed]
    return [root, *layers]


def closed_forms(cfg, wl, *, shard_size, shard_rank):
    model = modelbuild.build_model(cfg, wl, device="meta")
    groups = groups_of(model)

    def padded(p):  # ceil(dim0 / S) rows
        return -(-p.shape[0] // shard_size) * (p.numel() // p.shape[0]) * p.element_size()

    def local(p):  # this rank's torch.chunk rows
        rows = -(-p.shape[0] // shard_size)
        return max(0, min(rows, p.shape[0] - shard_rank * rows)) * (p.numel() // p.shape[0]) * p.element_size()

    params = [p for g in groups for p in g]
    trainable = [p for p in params if p.requires_grad]
    return {
        C.PARAMETER: sum(round_allocation(padded(p)) for p in params)
        + sum(round_allocation(b.nbytes) for b in model.buffers()),
        C.GRADIENT: sum(round_allocation(sum(padded(p) for p in g if p.requires_grad)) for g in groups),
        C.OPTIMIZER_STATE: 2 * sum(round_allocation(local(p)) for p in trainable),
        C.TEMPORARY: sum(round_allocation(local(p)) for p in trainable),  # _foreach_sqrt(exp_avg_sqs)
    }


LAYOUTS = {
    "fsdp-2": ("full", Layout(num_gpus=2)),
    "fsdp-3": ("full", Layout(num_gpus=3)),  # 64 and 160 rows: uneven shards
    "hsdp-2x2": ("hybrid", Layout(num_gpus=4, num_nodes=2)),
    "hsdp-2x3": ("hybrid", Layout(num_gpus=6, num_nodes=2)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_states_equal_closed_forms_on_first_and_last_rank(name):
    sharding, layout = LAYOUTS[name]
    cfg = tiny_config("llama")
    shard_size = layout.num_gpus if sharding == "full" else layout.gpus_per_node
    for rank in (0, layout.num_gpus - 1):
        got = trace(cfg, layout=layout, rank=rank, sharding=sharding).trace.phase_breakdowns[Phase.OPTIMIZER]
        want = closed_forms(cfg, WL, shard_size=shard_size, shard_rank=rank % shard_size)
        assert {c: got[c] for c in want} == want, (name, rank)


def test_closed_forms_hold_for_every_architecture(arch):
    # Tied embeddings (gpt2, qwen2) are one parameter of the root group;
    # mixtral's experts run grouped_mm, bf16 only.
    wl = Workload(seq_len=32, micro_batch_size=1, precision="bf16" if arch == "mixtral" else "bf16-mixed")
    cfg = tiny_config(arch)
    got = trace(cfg, wl, layout=Layout(num_gpus=3), rank=2).trace.phase_breakdowns[Phase.OPTIMIZER]
    want = closed_forms(cfg, wl, shard_size=3, shard_rank=2)
    assert {c: got[c] for c in want} == want


def test_uneven_shards_trace_the_last_rank_and_report_its_padding():
    cfg = tiny_config("llama")
    est = fsdp.estimate(cfg, WL, layout=Layout(num_gpus=3), gpu=H100, preset="fsdp")
    assert [r.rank for r in est.ranks] == [0, 2]
    first, last = est.ranks
    # Same padded parameter and gradient storages, fewer optimizer-state rows.
    assert first.peak_tensor_bytes > last.peak_tensor_bytes
    model = modelbuild.build_model(cfg, WL, device="meta")
    pad = 0
    for p in {id(p): p for p in model.parameters()}.values():
        rows = -(-p.shape[0] // 3)
        missing = rows - max(0, min(rows, p.shape[0] - 2 * rows))
        pad += missing * (p.numel() // p.shape[0]) * p.element_size() * 2  # shard + gradient
    assert any(note.startswith(f"rank 2: {pad} B") for note in est.notes), est.notes
    even = fsdp.estimate(cfg, WL, layout=Layout(num_gpus=2), gpu=H100, preset="fsdp")
    assert [r.rank for r in even.ranks] == [0]


def test_first_optimizer_step_counts_no_unsharded_tensor(monkeypatch):
    """Shared FACTS, "DTensor pitfall": sharding propagation runs each op on
    fake tensors of the global shapes when DTensor's sharding cache misses
    (the first optimizer step). With a cold cache, the first step's peak must
    equal the steady-state second step's. The step runs on DTensors here, as
    it does where the local-shard step does not apply (_local_step)."""

    def step_peaks(result):
        peaks, seen = [], None
        for _, phase, nbytes in result.timeline:
            if phase is Phase.OPTIMIZER:
                if seen is not Phase.OPTIMIZER:
                    peaks.append(0)
                peaks[-1] = max(peaks[-1], nbytes)
            seen = phase
        return peaks

    cfg = tiny_config("llama")
    monkeypatch.setattr(_local_step, "_eligible", lambda optimizer: False)
    torch._C._clear_DTensor_sharding_propagator_cache()
    first, second = step_peaks(trace(cfg, layout=Layout(num_gpus=4)).trace)
    assert first == second
    # The isolation is what keeps them equal: without it the propagation's
    # scratch tensors (global shapes) run in the trace's own fake mode.
    monkeypatch.setattr(fsdp, "isolated_sharding_propagation", contextlib.nullcontext)
    torch._C._clear_DTensor_sharding_propagator_cache()
    first, second = step_peaks(trace(cfg, layout=Layout(num_gpus=4)).trace)
    assert first > second


def test_reshard_after_forward_false_keeps_the_layers_gathered():
    cfg = tiny_config("llama")
    layout = Layout(num_gpus=2)
    on = trace(cfg, layout=layout).trace
    off = trace(cfg, layout=layout, reshard_after_forward=False).trace
    # At the forward peak (the loss) every layer's unsharded parameters
    # (gathered in bf16, one storage each) are still alive.
    model = modelbuild.build_model(cfg, WL, device="meta")
    layers = [p for g in groups_of(model)[1:] for p in g]
    unsharded = sum(round_allocation(p.numel() * 2) for p in layers)
    assert off.phase_peaks[Phase.FORWARD] - on.phase_peaks[Phase.FORWARD] == unsharded
    assert (off.phase_breakdowns[Phase.FORWARD][C.COMM_BUFFER]
            - on.phase_breakdowns[Phase.FORWARD][C.COMM_BUFFER]) == unsharded


def test_lora_with_gradient_accumulation_shards_adapters_only():
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", grad_accum_steps=2,
                  lora=LoraSpec(rank=4))
    got = trace(cfg, wl, layout=Layout(num_gpus=3), rank=2).trace.phase_breakdowns[Phase.OPTIMIZER]
    want = closed_forms(cfg, wl, shard_size=3, shard_rank=2)
    assert {c: got[c] for c in want} == want
    assert want[C.GRADIENT] < want[C.PARAMETER] // 10  # adapters only


def test_communication_per_step():
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", grad_accum_steps=2)
    model = modelbuild.build_model(cfg, wl, device="meta")
    root, *layers = groups_of(model)

    def full(group, shards, itemsize):  # padded unsharded bytes of a group
        return sum(-(-p.shape[0] // shards) * shards * (p.numel() // p.shape[0]) * itemsize for p in group)

    # fsdp on 8 GPUs: forward gathers all (bf16), backward the layers again,
    # gradients reduce-scattered in fp32; (n-1)/n of each per rank; x2 micro-batches.
    est = fsdp.estimate(cfg, wl, layout=Layout(num_gpus=8), gpu=H100, preset="fsdp")
    gathered = sum(full(g, 8, 2) for g in (root, *layers)) + sum(full(g, 8, 2) for g in layers)
    reduced = sum(full(g, 8, 4) for g in (root, *layers))
    assert est.comm_intra_node_bytes == round(7 / 8 * (gathered + reduced) * 2)
    assert est.comm_inter_node_bytes == 0
    # Two nodes: the ring leaves each node on one link, a share nodes/n of the bytes.
    two = fsdp.estimate(cfg, wl, layout=Layout(num_gpus=8, num_nodes=2), gpu=H100, preset="fsdp")
    total = 7 / 8 * (gathered + reduced) * 2
    assert two.comm_inter_node_bytes == round(total * 2 / 8)
    assert two.comm_intra_node_bytes == round(total - total * 2 / 8)
    # hsdp 2 nodes x 4: gathers and reduce-scatters in the node, all-reduce of the shard across.
    hsdp = fsdp.estimate(cfg, wl, layout=Layout(num_gpus=8, num_nodes=2), gpu=H100, preset="hsdp",
                         sharding="hybrid")
    gathered4 = sum(full(g, 4, 2) for g in (root, *layers)) + sum(full(g, 4, 2) for g in layers)
    reduced4 = sum(full(g, 4, 4) for g in (root, *layers))
    assert hsdp.comm_intra_node_bytes == round(3 / 4 * (gathered4 + reduced4) * 2)
    assert hsdp.comm_inter_node_bytes == round(2 * 1 / 2 * reduced4 / 4 * 2)


def test_cpu_offload_keeps_states_on_the_host():
    cfg = tiny_config("llama")
    layout = Layout(num_gpus=2)
    dev = trace(cfg, layout=layout)
    off = trace(cfg, layout=layout, cpu_offload=True)
    # The optimizer steps on the host: no device event in its phase.
    assert Phase.OPTIMIZER not in off.trace.phase_peaks
    model = modelbuild.build_model(cfg, WL, device="meta")
    buffers = sum(round_allocation(b.nbytes) for b in model.buffers())
    for bd in off.trace.phase_breakdowns.values():
        assert bd[C.GRADIENT] == bd[C.OPTIMIZER_STATE] == 0
        assert bd[C.PARAMETER] == buffers  # buffers stay on the device
    assert off.trace.peak_bytes < dev.trace.peak_bytes
    # Host: padded parameter shards, gradients as copied (unpadded), AdamW's
    # two states and its fp32 step counters.
    params = [p for g in groups_of(model) for p in g]
    shard = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * p.element_size() for p in params)
    assert off.host_bytes == shard + shard + 2 * shard + 4 * len(params)


def test_tensor_parallel_degree_is_refused():
    with pytest.raises(ConfigError, match="--tp 2"):
        fsdp.estimate(tiny_config("llama"), WL, layout=Layout(num_gpus=4, tp=2), gpu=H100, preset="fsdp")


def test_bad_settings_are_refused():
    cfg = tiny_config("llama")
    with pytest.raises(ConfigError, match="valid: bf16, fp16, fp32, none"):
        fsdp.estimate(cfg, WL, layout=Layout(num_gpus=2), gpu=H100, preset="fsdp", mixed_precision="fp8")
    with pytest.raises(UnsupportedError, match="Adafactor"):
        fsdp.estimate(cfg, Workload(optimizer="adafactor"), layout=Layout(num_gpus=2), gpu=H100, preset="fsdp")


def test_presets():
    assert fsdp.PRESETS == {"fsdp": {"sharding": "full"}, "hsdp": {"sharding": "hybrid"}}


_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from torch.distributed.device_mesh import init_device_mesh
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import _local_step, fsdp
    from llmem_plugin.workload import LoraSpec, Workload
    from tests.conftest import tiny_config
    from tests.methods._gloo_fsdp import use_gloo_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gpu = get_gpu("h100-sxm")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = tiny_config("llama", vocab_size=int(os.environ["VOCAB"]))
    for fields in json.loads(os.environ["WORKLOADS"]):
        if "lora_rank" in fields:
            fields["lora"] = LoraSpec(rank=fields.pop("lora_rank"))
        wl = Workload(**fields)
        torch.manual_seed(0)
        model = modelbuild.build_model(cfg, wl, device="cpu")
        fsdp._apply_fsdp(model, mesh, reshard_after_forward=True, param_dtype=fsdp._param_dtype(wl, None),
                         cpu_offload=False)
        use_gloo_collectives(model)  # untracked copies (tests/methods/_gloo_fsdp.py)
        r, _ = fsdp._trace_fsdp_step(model, wl, vocab_size=cfg.vocab_size,
                                     compute_capability=gpu.compute_capability, num_sms=gpu.num_sms)
        print(json.dumps({"peak": r.peak_bytes, "breakdown": {c.value: v for c, v in r.breakdown.items()},
                          "phase_peaks": {p.value: v for p, v in r.phase_peaks.items()},
                          "events": [[e[0], e[2]] for e in r.events]}))
    dist.destroy_process_group()
""")

# Without mixed precision; FSDP2's bf16 policy; LoRA (frozen and trainable
# parameters in one group) with gradient accumulation.
REAL_RUNS = {
    "fp32": {"seq_len": 32, "micro_batch_size": 2, "precision": "fp32"},
    "bf16-mixed": {"seq_len": 32, "micro_batch_size": 2, "precision": "bf16-mixed"},
    "lora-accum": {"seq_len": 32, "micro_batch_size": 1, "precision": "bf16-mixed", "grad_accum_steps": 2,
                   "lora_rank": 4},
}


def test_fake_trace_equals_a_real_two_process_gloo_run(tmp_path):
    # An odd vocabulary makes the embedding and head shards uneven: rank 1
    # holds a padding row.
    vocab = 509
    outs = run_gloo(tmp_path, _WORKER, world=2, timeout=240,
                    env={"VOCAB": str(vocab), "WORKLOADS": json.dumps(list(REAL_RUNS.values()))})
    for rank, stdout in enumerate(outs):
        lines = stdout.strip().splitlines()[-len(REAL_RUNS):]
        for (name, fields), line in zip(REAL_RUNS.items(), lines, strict=True):
            real = json.loads(line)
            fields = dict(fields)
            lora_rank = fields.pop("lora_rank", None)
            wl = Workload(**fields, lora=LoraSpec(rank=lora_rank) if lora_rank else None)
            fake = trace(tiny_config("llama", vocab_size=vocab), wl, layout=Layout(num_gpus=2), rank=rank).trace
            assert fake.peak_bytes == real["peak"], (name, rank)
            assert {c.value: v for c, v in fake.breakdown.items()} == real["breakdown"], (name, rank)
            assert {p.value: v for p, v in fake.phase_peaks.items()} == real["phase_peaks"], (name, rank)
            assert [[sign, n] for sign, _, n in fake.events] == real["events"], (name, rank)
