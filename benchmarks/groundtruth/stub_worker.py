"""One rank of a distributed fine-tuning step on the stub CUDA device.

Run inside the stub environment (``stubcuda/run -- .stubvenv/bin/python -m
benchmarks.groundtruth.stub_worker SPEC_JSON``); :mod:`.stub_distributed`
starts it once per rank and reads the JSON line it prints last.

The rank is one process on ``cuda:0`` with torch's fake process group
(``FakeStore`` + ``init_process_group("fake")``): the real wrappers (DDP's
Reducer, FSDP2, DTensor TP, ColossalAI's plugins) run their real CUDA code
and the real caching allocator, and every collective returns at once with its
output buffers as allocated. The step is ``llmem_plugin.step.trace_step``'s
plain loop (two optimizer steps; per micro-batch inputs, forward with labels
under the workload's autocast, backward outside it), and the peaks are read
after each step from ``torch.cuda.max_memory_allocated`` / ``_reserved``,
reset once the model is built (as ``benchmarks/groundtruth/cuda.py``).

What the stub cannot do as a GPU does, and how the worker stands in
(``STUB_ADJUSTMENTS`` lists them in each row):

* Device memory reads as zeros. transformers' ``find_packed_sequence_indices``
  reads ``.all()`` of the position diffs to tell packed batches; a GPU sees
  arange positions and returns None, the stub sees zeros and builds a 4-D
  mask. The worker runs the function (its temporaries are allocated) and
  returns None.
* DDP's bucket rebuild (``Reducer::rebuild_buckets`` -> ``sync_bucket_indices``)
  copies the broadcast indices back to the host; on the stub they read as
  zeros (no buckets). The worker switches the rebuild off, as the estimator
  does (``llmem_plugin.methods.ddp.NoRebuild``); the buckets keep their
  construction-time grouping on both sides.
* cuDNN computes nothing: its SDPA backend is disabled here and in the estimate.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

__all__ = ["STUB_ADJUSTMENTS", "main", "run_rank"]

STUB_ADJUSTMENTS = {
    "packed_sequence": "find_packed_sequence_indices runs and returns None (a GPU reads arange positions; "
                       "the stub reads zeros)",
    "ddp_rebuild": "DDP bucket rebuild off (the stub reads the broadcast bucket indices back as zeros); "
                   "the estimator skips it too",
    "ddp_verify": "DDP's _verify_param_shape_across_processes skipped (it reads the gathered shapes back as "
                  "zeros); a GPU allocates a few small metadata tensors there, freed at once",
    "ddp_comm_hook": "the fake group's all-reduce future carries no tensor; a comm hook returns the bucket, "
                     "as the default hook does after NCCL's in-place all-reduce (the estimator's too)",
    "cudnn_sdpa": "cuDNN SDPA disabled (stub cuDNN computes nothing); the estimate disables it too",
}


def _patch_masking() -> None:
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids):
        original(position_ids)  # the GPU's temporaries; its answer for unpacked rows is None
        return None

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def _workload(spec: dict[str, Any]):
    from llmem_plugin.workload import Workload

    return Workload(**spec["workload"])


def _config(spec: dict[str, Any]):
    from benchmarks.groundtruth.matrix import case_config

    return case_config(spec["model"], spec.get("overrides") or {})


def _reset() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


class _Rank:
    """The wrapped model and how its step differs from the plain loop."""

    def __init__(self, model, *, autocast: bool = True, step=None, backward=None, zero_grad=None,
                 optimizer=None) -> None:
        self.model = model
        self.autocast = autocast
        self.step = step
        self.backward = backward
        self.zero_grad = zero_grad
        self.optimizer = optimizer


# ------------------------------------------------------------------ methods
def _ddp(spec, config, wl) -> _Rank:
    import torch

    from llmem_plugin import modelbuild
    from llmem_plugin.methods.ddp import NoRebuild, bucket_passthrough

    model = modelbuild.build_model(config, wl, device="cuda")
    opts = spec.get("options") or {}
    _reset()
    from torch.nn.parallel import distributed as ddp_mod

    # Reads the all-gathered parameter counts back from the device: zeros here.
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=opts.get("bucket_cap_mb", 25),
        gradient_as_bucket_view=opts.get("gradient_as_bucket_view", False))
    ddp.register_comm_hook(None, bucket_passthrough)
    ddp.reducer = NoRebuild(ddp.reducer)
    return _Rank(ddp)


def _fsdp(spec, config, wl) -> _Rank:
    import torch

    from llmem_plugin import modelbuild
    from llmem_plugin.methods import fsdp
    from llmem_plugin.methods.layout import Layout

    opts = spec.get("options") or {}
    layout = Layout(num_gpus=spec["world"])
    mesh = fsdp._device_mesh(layout, "full", device_type="cuda")
    model = modelbuild.build_model(config, wl, device="meta")
    fsdp._apply_fsdp(model, mesh, reshard_after_forward=opts.get("reshard_after_forward", True),
                     param_dtype=fsdp._param_dtype(wl, opts.get("mixed_precision")), cpu_offload=False)
    model.to_empty(device="cuda")
    model._get_fsdp_state()._lazy_init()
    _reset()
    del torch
    return _Rank(model, autocast=False)


def _tp(spec, config, wl) -> _Rank:
    from llmem_plugin import modelbuild
    from llmem_plugin.methods import tp
    from llmem_plugin.methods.layout import Layout

    opts = spec.get("options") or {}
    layout = Layout(num_gpus=spec["world"], tp=spec["tp"])
    model = modelbuild.build_model(config, wl, device="meta")
    tp._parallelize(model, layout=layout, data_parallel=opts.get("data_parallel", "none"),
                    sequence_parallel=opts.get("sequence_parallel", False), device_type="cuda")
    model.to_empty(device="cuda")
    _reset()
    return _Rank(model)


_METHODS = {"ddp": _ddp, "fsdp": _fsdp, "tp": _tp}


# ---------------------------------------------------------------- the step
def _loop(rank: _Rank, wl, *, vocab: int, steps: int) -> list[dict[str, int]]:
    import torch

    from llmem_plugin.step import make_optimizer

    model = rank.model
    optimizer = rank.optimizer or make_optimizer([p for p in model.parameters() if p.requires_grad], wl.optimizer)
    dtype = wl.precision.autocast_dtype if rank.autocast else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for step in range(1, steps + 1):
        for _ in range(wl.grad_accum_steps):
            input_ids = torch.randint(0, vocab, (wl.micro_batch_size, wl.seq_len), device="cuda", generator=gen)
            labels = input_ids.clone()
            ctx = torch.autocast("cuda", dtype=dtype) if dtype is not None else _null()
            with ctx:
                loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss / wl.grad_accum_steps
            if rank.backward is not None:
                rank.backward(loss)
            else:
                loss.backward()
            del loss, input_ids, labels
        if rank.step is not None:
            rank.step(optimizer)
        else:
            optimizer.step()
        if rank.zero_grad is not None:
            rank.zero_grad(optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out.append({"step": step, "allocated_bytes": torch.cuda.max_memory_allocated(),
                    "reserved_bytes": torch.cuda.max_memory_reserved()})
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` (method, options, world, rank, model, overrides, workload,
    steps) as one rank; returns the per-step peaks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.perf_counter()
    torch.backends.cuda.enable_cudnn_sdp(False)
    _patch_masking()
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"], world_size=spec["world"])
    try:
        config = _config(spec)
        wl = _workload(spec)
        rank = _METHODS[spec["method"]](spec, config, wl)
        steps = _loop(rank, wl, vocab=int(config.vocab_size), steps=spec.get("steps", 2))
    finally:
        dist.destroy_process_group()
    return {"steps": steps, "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> None:
    spec = json.loads((argv or sys.argv[1:])[0])
    print(json.dumps(run_rank(spec)))


if __name__ == "__main__":
    main()
