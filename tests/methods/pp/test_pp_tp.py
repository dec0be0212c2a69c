"""Tensor parallel inside pipeline stages (torchtitan's PP x TP and PP x FSDP2 x TP): each rank's fake trace
against a real gloo run on CPU of the same stages, TP plan, FSDP2 grouping and schedule, byte for byte."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods.pp.method import stage_specs
from llmem_plugin.methods.pp.rank import trace_rank
from tests.conftest import tiny_config

from tests.methods._gloo import run_gloo
from tests.methods.pp.test_pp import WL

H100 = get_gpu("h100-sxm")
P, TP, M = 2, 2, 4
WL_3D = dataclasses.replace(WL, precision="bf16-mixed")
# (data-parallel shard degree, workload): PP x TP in fp32; PP x FSDP2 x TP with FSDP2's bf16 policy.
CASES = {"pp2-tp2": (1, WL), "pp2-dp2-tp2": (2, WL_3D)}


def _config():
    return tiny_config("llama", num_hidden_layers=4)


_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods.pp.method import stage_specs
    from llmem_plugin.methods.pp.rank import pipeline_mesh, trace_rank
    from tests.methods._gloo_fsdp import use_gloo_collectives
    from tests.methods.pp.test_pp_tp import CASES, M, P, TP, _config

    from tests.methods._gloo import settle_functional_waits
    settle_functional_waits()  # buffers freed where the program leaves them, not by gloo's thread timing

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp, wl = CASES[os.environ["CASE"]]
    mesh = pipeline_mesh(P, dp, TP)
    specs = stage_specs(4, P)
    torch.manual_seed(0)
    model = modelbuild.build_model(_config(), wl, device="cpu")
    t = trace_rank(model, wl, [specs[rank // (dp * TP)]], rank=rank, pipeline_degree=P, schedule="1f1b",
                   microbatches=M, gpu=get_gpu("h100-sxm"), fake=False, dp_shard=dp, tp=TP, mesh=mesh,
                   prepare=(lambda modules: use_gloo_collectives(*modules)) if dp > 1 else None)
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"peak": t.peak_bytes, "events": [[s, n] for s, _, n in t.events]}, f)
""")


def _fake(case: str, rank: int):
    dp, wl = CASES[case]
    return trace_rank(_config(), wl, [stage_specs(4, P)[rank // (dp * TP)]], rank=rank, pipeline_degree=P,
                      schedule="1f1b", microbatches=M, gpu=H100, dp_shard=dp, tp=TP)


@pytest.mark.parametrize("case", list(CASES))
def test_tp_inside_stages_equals_a_real_gloo_run(tmp_path, case):
    """Every rank of the real run allocates and frees what its fake trace says, in order (a run is repeated
    at most twice more where gloo's thread timing moved one buffer: an exact match in any run shows the
    trace right, a systematic difference fails every attempt)."""
    dp, _ = CASES[case]
    world = P * dp * TP
    fake = {r: _fake(case, r) for r in range(world)}
    for _ in range(3):
        run_gloo(tmp_path, _WORKER, world=world, timeout=900, env={"OUT": str(tmp_path), "CASE": case})
        real = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}
        if all(real[r]["events"] == [[s, n] for s, _, n in fake[r].events] for r in range(world)):
            break
    for r in range(world):
        assert fake[r].peak_bytes == real[r]["peak"], (case, r)
        assert real[r]["events"] == [[s, n] for s, _, n in fake[r].events], (case, r)
