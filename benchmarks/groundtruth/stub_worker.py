"""One rank of a distributed fine-tuning step on the stub CUDA device.

Run inside the stub environment (``stubcuda/run -- .stubvenv/bin/python -m
benchmarks.groundtruth.stub_worker SPEC_JSON``); :mod:`.stub_distributed`
starts it once per rank and reads the JSON line it prints last.

The rank is one process on ``cuda:0`` with torch's fake process group
(``FakeStore`` + ``init_process_group("fake")``): the real wrappers (DDP's
Reducer, FSDP2, DTensor TP, ColossalAI's plugins) run their real CUDA code
and the real caching allocator, and every collective returns at once with its
output buffers as allocated. The step is ``llmem_plugin.trace.step.trace_step``'s
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


# Set by run_rank when the spec asks for the history: recording starts at the first reset (the model
# built, the cache emptied), before the method wraps it.
_RECORD_FROM_RESET = {"pending": False}


def _reset() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if _RECORD_FROM_RESET["pending"]:
        _RECORD_FROM_RESET["pending"] = False
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")


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
        self.noop_mode = False


# ------------------------------------------------------------------ methods
def _single(spec, config, wl) -> _Rank:
    from llmem_plugin.models import modelbuild

    model = modelbuild.build_model(config, wl, device="cuda")
    _reset()
    return _Rank(model)


def _ddp(spec, config, wl) -> _Rank:
    import torch

    from llmem_plugin.models import modelbuild
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

    from llmem_plugin.models import modelbuild
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
    from llmem_plugin.models import modelbuild
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


def _colossal(spec, config, wl) -> _Rank:
    """A ColossalAI plugin's boosted model and optimizer (the plugin's own
    ``backward``, ``step`` and ``zero_grad``)."""
    import dataclasses

    import torch
    from colossalai.booster import Booster
    from colossalai.booster import plugin as plugins

    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.step import make_optimizer
    from llmem_plugin.workload import Precision

    opts = dict(spec.get("options") or {})
    name = spec["method"]
    precision = {Precision.BF16_MIXED: "bf16", Precision.BF16: "bf16", Precision.FP16_MIXED: "fp16",
                 Precision.FP32: "fp32"}[wl.precision]
    # The plugin casts the model to its precision: build it there (as the estimate does).
    build_precision = Precision.FP32 if precision == "fp32" else Precision.BF16
    if name == "lowlevel":
        plugin = plugins.LowLevelZeroPlugin(precision=precision, **opts)
    elif name == "gemini":
        plugin = plugins.GeminiPlugin(precision=precision, **opts)
    else:  # hybrid
        plugin = plugins.HybridParallelPlugin(precision=precision, tp_size=spec["tp"], pp_size=1, **opts)
    booster = Booster(plugin=plugin)
    model = modelbuild.build_model(config, dataclasses.replace(wl, precision=build_precision), device="cuda")
    if name == "gemini":
        from colossalai.nn.optimizer import HybridAdam

        optimizer = HybridAdam(model.parameters(), lr=5e-5)
    else:
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], wl.optimizer)
    model, optimizer, *_ = booster.boost(model, optimizer)
    _reset()
    del torch
    return _Rank(model, autocast=False, optimizer=optimizer,
                 backward=lambda loss: booster.backward(loss, optimizer),
                 zero_grad=lambda opt: opt.zero_grad())


_METHODS = {"single": _single, "ddp": _ddp, "fsdp": _fsdp, "tp": _tp, "lowlevel": _colossal, "gemini": _colossal,
            "hybrid": _colossal}


# ---------------------------------------------------------------- the step
def _loop(rank: _Rank, wl, *, vocab: int, steps: int, lengths: list[list[int]] | None = None,
          on_end=None) -> list[dict[str, int]]:
    """``steps`` optimizer steps; ``lengths``: each micro-batch's padded length (variable-length batches,
    ``llmem_plugin.techniques.varlen.step_lengths``), else ``wl.seq_len``. ``on_end`` is called after the
    last step, while the loop still holds its optimizer."""
    import torch

    from llmem_plugin.trace.step import make_optimizer
    from llmem_plugin.models.tasks import extra_inputs, make_labels

    model = rank.model
    optimizer = rank.optimizer or make_optimizer([p for p in model.parameters() if p.requires_grad], wl.optimizer)
    dtype = wl.precision.autocast_dtype if rank.autocast else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for step in range(1, steps + 1):
        for micro in range(wl.grad_accum_steps):
            seq = lengths[step - 1][micro] if lengths is not None else wl.seq_len
            input_ids = torch.randint(0, vocab, (wl.micro_batch_size, seq), device="cuda", generator=gen)
            labels = make_labels(model, input_ids, wl).to("cuda")  # the task's labels (llmem_plugin.models.tasks)
            extra = {k: v.to("cuda") for k, v in extra_inputs(model, input_ids, wl).items()}
            ctx = torch.autocast("cuda", dtype=dtype) if dtype is not None else _null()
            with ctx:
                loss = model(input_ids=input_ids, labels=labels, use_cache=False, **extra).loss / wl.grad_accum_steps
            with _mode_if(rank.noop_mode):
                if rank.backward is not None:
                    rank.backward(loss)
                else:
                    loss.backward()
            del loss, input_ids, labels, extra
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
    if on_end is not None:
        on_end()
    return out


def _mode_if(on: bool):
    """A do-nothing TorchDispatchMode (diagnostics: the estimator traces under
    modes, and autograd sums a tensor's incoming gradients out of place
    whenever one is active)."""
    if not on:
        return _null()
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return _Noop()


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
        _RECORD_FROM_RESET["pending"] = bool(spec.get("history"))
        rank = _METHODS[spec["method"]](spec, config, wl)
        rank.noop_mode = bool(spec.get("noop_mode"))
        if _RECORD_FROM_RESET["pending"]:  # a method that never resets: from here
            _RECORD_FROM_RESET["pending"] = False
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        # The history: from the built model's reset (before the method wraps it) to the end of the last step.
        history: list | None = [] if spec.get("history") else None
        steps = _loop(rank, wl, vocab=int(config.vocab_size), steps=spec.get("steps", 2), lengths=_lengths(spec, wl),
                      on_end=(lambda: history.extend(_history())) if history is not None else None)
    finally:
        dist.destroy_process_group()
    out = {"steps": steps, "segments": _segments(), "seconds": round(time.perf_counter() - t0, 2)}
    if history is not None:
        out["history"] = history
    return out


def _lengths(spec: dict[str, Any], wl) -> list[list[int]] | None:
    """Each micro-batch's padded length where ``spec["seq_lens"]`` gives a sample-length distribution: drawn
    as ``llmem_plugin.techniques.varlen.estimate_variable_length`` draws them (seed 0), ``wl.seq_len`` the
    truncation."""
    if spec.get("seq_lens") is None:
        return None
    from llmem_plugin.techniques.varlen import parse_lengths, step_lengths

    return step_lengths(parse_lengths(spec["seq_lens"]), micro_batch_size=wl.micro_batch_size,
                        grad_accum_steps=wl.grad_accum_steps, max_len=wl.seq_len, steps=spec.get("steps", 2))


def _history() -> list[list[Any]]:
    """The step's allocator events, ``[+1 | -1, block bytes, stream]`` in order
    (to line up with the estimator's event stream)."""
    import torch

    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sign = {"alloc": 1, "free_requested": -1}
    return [[sign[e["action"]], int(e["size"]), int(e["stream"])] for e in snap["device_traces"][0]
            if e["action"] in sign]


def _segments() -> list[dict[str, Any]]:
    """Reserved segments at the end, per (stream, pool): which streams' pools
    hold the reserved bytes (the caching allocator keeps one per stream)."""
    import torch

    out: dict[tuple[int, str], dict[str, Any]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = (int(seg["stream"]), seg["segment_type"])
        row = out.setdefault(key, {"stream": key[0], "pool": key[1], "segments": 0, "bytes": 0})
        row["segments"] += 1
        row["bytes"] += int(seg["total_size"])
    return sorted(out.values(), key=lambda r: (r["stream"], r["pool"]))


def _where(e: BaseException) -> str:
    """Where ``e`` came from: the innermost frame outside this module, and the
    innermost ColossalAI frame when that is another (the plugin line that led
    there), and a compiler's "fatal error" line when a kernel build failed."""
    import re
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.endswith("stub_worker.py")]
    frames = frames or traceback.extract_tb(e.__traceback__)

    def show(f) -> str:
        return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name}): {(f.line or '').strip()}"

    parts = [show(frames[-1])]
    plugin = [f for f in frames if "site-packages/colossalai/" in f.filename]
    if plugin and plugin[-1] is not frames[-1]:
        parts.append("from " + show(plugin[-1]))
    fatal = re.search(r"fatal error: .*?(?:No such file or directory|$)", str(e), re.MULTILINE)
    if fatal:
        parts.append(fatal.group(0))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.groundtruth.rows import error_text

    spec = json.loads((argv or sys.argv[1:])[0])
    try:
        out = run_rank(spec)
    except Exception as e:  # noqa: BLE001 - reported in the row
        out = {"error": error_text(e), "where": _where(e)}
    out["adjustments"] = _ADJUSTMENTS_BY_METHOD.get(spec["method"], []) + ["packed_sequence", "cudnn_sdpa"]
    out["env"], out["gpu"] = _environment()
    print(json.dumps(out))


# Which STUB_ADJUSTMENTS each method's run makes (besides the model-wide ones).
_ADJUSTMENTS_BY_METHOD = {"ddp": ["ddp_verify", "ddp_comm_hook", "ddp_rebuild"]}


def _environment() -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from llmem_plugin.verify.meter import environment

    props = torch.cuda.get_device_properties(0)
    gpu = {"name": torch.cuda.get_device_name(0), "memory_bytes": int(props.total_memory),
           "compute_capability": [props.major, props.minor], "idle_used_bytes": None}
    env = environment(driver="stubcuda", nvml_source=None)
    try:
        import importlib.metadata as md

        env["colossalai"] = md.version("colossalai")
    except Exception:  # noqa: BLE001 - not installed
        env["colossalai"] = None
    return env, gpu


if __name__ == "__main__":
    main()
