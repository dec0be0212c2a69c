"""DDP traced under a fake process group: bucket bytes by rule, and equal to a real gloo run."""

from __future__ import annotations

import json
import textwrap

import pytest

from llmem_plugin.errors import ConfigError
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.methods.ddp import ring_allreduce_bytes
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config
from tests.methods._gloo import run_gloo

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")


def _round(n: int) -> int:
    return -(-n // 512) * 512


def _grad_bytes(cfg) -> int:
    from llmem_plugin.models import modelbuild

    m = modelbuild.build_model(cfg, WL, device="meta")
    return sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)


def test_buckets_hold_every_gradient_once():
    cfg = tiny_config("llama")
    est = estimate_method("ddp", cfg, WL, layout=Layout(num_gpus=2), gpu=H100)
    single = estimate_method("single", cfg, WL, layout=Layout(), gpu=H100)
    bd, base = est.ranks[0].breakdown, single.ranks[0].breakdown
    # Under 1 MiB of gradients: one bucket (the first bucket's cap), one flat storage.
    assert bd["comm_buffers"] == _round(_grad_bytes(cfg))
    for cat in ("parameters", "gradients", "optimizer_states"):
        assert bd[cat] == base[cat]
    assert est.ranks[0].peak_tensor_bytes == single.ranks[0].peak_tensor_bytes + bd["comm_buffers"]


def test_gradient_as_bucket_view_drops_the_copy():
    cfg = tiny_config("llama")
    view = estimate_method("ddp", cfg, WL, layout=Layout(num_gpus=2), gpu=H100, gradient_as_bucket_view=True)
    copy = estimate_method("ddp", cfg, WL, layout=Layout(num_gpus=2), gpu=H100)
    assert view.ranks[0].breakdown["comm_buffers"] == 0  # the bucket is the gradients' storage
    assert view.ranks[0].peak_tensor_bytes < copy.ranks[0].peak_tensor_bytes


def test_communication_is_a_ring_allreduce_of_the_gradients():
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=1, grad_accum_steps=2)
    est = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=8, num_nodes=2), gpu=H100)
    g = _grad_bytes(cfg)
    assert ring_allreduce_bytes(g, 8) == 2 * 7 * g // 8
    sent = 2 * ring_allreduce_bytes(g, 8)  # every micro-batch
    assert est.comm_inter_node_bytes == sent * 2 // 8  # one hop per node of the 8-hop ring crosses nodes
    assert est.comm_intra_node_bytes + est.comm_inter_node_bytes == sent
    one_node = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=8), gpu=H100)
    assert one_node.comm_inter_node_bytes == 0
    # NCCL ring buffers count outside the allocator, per communicator.
    assert est.ranks[0].device_total_bytes > one_node.ranks[0].peak_reserved_bytes


def test_tp_is_refused():
    with pytest.raises(ConfigError, match="--tp"):
        estimate_method("ddp", tiny_config("llama"), WL, layout=Layout(num_gpus=4, tp=2), gpu=H100)


_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.step import trace_step
    from llmem_plugin.workload import Workload
    from tests.conftest import tiny_config
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")
    cfg = tiny_config("llama")
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    r = trace_step(model, wl, vocab_size=cfg.vocab_size, wrap=lambda m: DistributedDataParallel(m))
    if dist.get_rank() == 0:
        print(json.dumps({"peak": r.peak_bytes, "breakdown": {c.value: v for c, v in r.breakdown.items()}}))
    dist.destroy_process_group()
""")


def test_fake_trace_equals_a_real_two_process_gloo_run(tmp_path):
    outs = run_gloo(tmp_path, _WORKER, world=2, timeout=240)
    real = json.loads(outs[0].strip().splitlines()[-1])
    fake = estimate_method("ddp", tiny_config("llama"), WL, layout=Layout(num_gpus=2), gpu=H100).ranks[0]
    assert fake.peak_tensor_bytes == real["peak"]
    assert fake.breakdown == real["breakdown"]


def test_lora_buckets_hold_only_the_adapters():
    from llmem_plugin.models import modelbuild
    from llmem_plugin.workload import LoraSpec

    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=1, grad_accum_steps=2, lora=LoraSpec(rank=4))
    est = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu=H100)
    m = modelbuild.build_model(cfg, wl, device="meta")
    adapters = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
    assert est.ranks[0].breakdown["comm_buffers"] == _round(adapters)  # frozen weights get no bucket
