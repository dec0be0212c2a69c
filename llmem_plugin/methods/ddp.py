"""``ddp``: ``torch.nn.parallel.DistributedDataParallel``, traced under a fake process group.

The real DDP wrapper runs: its Reducer allocates the gradient buckets
(``bucket_cap_mb``, 25 MiB by default, the first bucket 1 MiB:
torch/nn/parallel/distributed.py, ``dist._DEFAULT_FIRST_BUCKET_BYTES``), copies
gradients into them in backward and back out after the all-reduce, or, with
``gradient_as_bucket_view``, makes the gradients views of the buckets. Under a
fake process group three things cannot run and are replaced by what they do to
memory:

* ``_verify_param_shape_across_processes`` reads the gathered parameter
  counts and shapes back (fake tensors have no data); it is skipped, and its
  few small metadata tensors (freed at once) with it.
* ``_sync_module_states`` broadcasts the parameters and buffers from rank 0:
  the broadcast moves no data here, but what it allocates is allocated
  (:func:`broadcast_allocations`): one flat copy per 250 MiB bucket of
  several tensors, two in flight. Those copies are freed before the first
  step, but the blocks they leave in the allocator's cache change where the
  step's tensors land (measured on the stub CUDA device:
  benchmarks/results/stub-distributed-2026-11-25.md).
* The fake group's all-reduce future carries no tensor; a comm hook returns the
  bucket itself, as the default hook does after its in-place all-reduce
  (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py,
  ``_allreduce_fut``).
* Bucket rebuilding at the second iteration broadcasts bucket indices and
  reads them back; it is skipped, so the buckets keep their construction-time
  grouping (reverse parameter order). The rebuilt buckets hold the same
  gradients in readiness order, with the same total size.

Known limitations:
    * ``find_unused_parameters`` and ``static_graph`` are not offered.
    * The plain loop all-reduces every micro-batch (no ``no_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.workload import Workload

__all__ = ["PRESETS", "NoRebuild", "broadcast_allocations", "bucket_passthrough", "estimate", "no_data_reads"]

# torch/nn/parallel/distributed.py: DistributedDataParallel(bucket_cap_mb=None)
# means 25 MiB; gradient_as_bucket_view defaults to False.
PRESETS: dict[str, dict[str, Any]] = {"ddp": {"bucket_cap_mb": 25, "gradient_as_bucket_view": False}}
# torch/csrc/distributed/c10d/comm.cpp, broadcast_coalesced: "We maintain a
# maximum of 2 in flight broadcast operations".
_BROADCASTS_IN_FLIGHT = 2


class NoRebuild:
    """The Reducer, with bucket rebuilding switched off (see the module docstring)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def bucket_passthrough(state: Any, bucket: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP._check_comm_hook inspects the annotations as objects, not the strings
# `from __future__ import annotations` leaves.
bucket_passthrough.__annotations__ = {
    "state": object, "bucket": torch.distributed.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def broadcast_allocations(module: nn.Module, process_group: Any, broadcast_bucket_size: int, src: int,
                          params_and_buffers_to_ignore: Any, broadcast_buffers: bool = True) -> None:
    """What DDP's ``_sync_module_states`` allocates on this rank, without the broadcast.

    torch/distributed/utils.py ``_sync_module_states`` lists the parameters
    (``named_parameters``: tied ones once), then the buffers, and calls
    ``dist._broadcast_coalesced``; torch/csrc/distributed/c10d/comm.cpp
    ``broadcast_coalesced`` groups them with ``compute_bucket_assignment_by_size``
    (one limit, DDP's ``broadcast_bucket_size`` of 250 MiB) and, per bucket,
    flattens it (torch/csrc/utils/tensor_flatten.h ``flatten_dense_tensors``:
    a view for a single contiguous tensor, else ``cat``), keeping at most two
    buckets in flight: before the third, the oldest finishes (its flat copy
    is copied back in place and freed).
    """
    import torch.distributed as dist

    states = [p.detach() for n, p in module.named_parameters() if n not in params_and_buffers_to_ignore]
    if broadcast_buffers:
        states += [b.detach() for n, b in module.named_buffers() if n not in params_and_buffers_to_ignore]
    if not states:
        return
    buckets, _ = dist._compute_bucket_assignment_by_size(states, [broadcast_bucket_size])
    in_flight: list[torch.Tensor] = []
    with torch.no_grad():
        for bucket in buckets:
            if len(in_flight) >= _BROADCASTS_IN_FLIGHT:
                del in_flight[0]
            in_flight.append(torch._utils._flatten_dense_tensors([states[i] for i in bucket]))
        while in_flight:  # oldest first (list.clear() would free the newest first)
            del in_flight[0]


@contextlib.contextmanager
def no_data_reads() -> Iterator[None]:
    """DDP's construction without the reads of broadcast data (see the module docstring)."""
    from torch.nn.parallel import distributed as ddp_mod

    saved = ddp_mod._verify_param_shape_across_processes, ddp_mod._sync_module_states
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None
    ddp_mod._sync_module_states = broadcast_allocations
    try:
        yield
    finally:
        ddp_mod._verify_param_shape_across_processes, ddp_mod._sync_module_states = saved


def _wrapper(bucket_cap_mb: float, gradient_as_bucket_view: bool):
    def wrap(model: nn.Module) -> nn.Module:
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view
        )
        ddp.register_comm_hook(None, bucket_passthrough)
        ddp.reducer = NoRebuild(ddp.reducer)
        return ddp

    return wrap


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: a
    reduce-scatter then an all-gather, each moving (n-1)/n of the data
    (NCCL's ring algorithm, NCCL user guide "Collective Operations")."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def estimate(
    model: Any,
    workload: Workload,
    *,
    layout: Layout,
    gpu: GPU,
    alloc_conf: AllocatorConfig | str | None = None,
    torch_version: str | None = None,
    preset: str = "ddp",
    bucket_cap_mb: float = 25,
    gradient_as_bucket_view: bool = False,
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory of DDP over ``layout.num_gpus`` ranks (all alike: rank 0 is traced).

    Raises:
        ConfigError: ``layout.tp`` is not 1.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.models import modelbuild
    from llmem_plugin.estimate import uses_cublaslt, vocab_size_of
    from llmem_plugin.methods._fakepg import fake_process_group
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.trace.step import trace_step

    if layout.tp != 1:
        raise ConfigError(f"--method {preset} replicates the whole model; got --tp {layout.tp}. HINT: use --tp 1 "
                          "or --method dp-tp")
    config = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
              else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    net = modelbuild.build_model(model, workload, device="meta")
    if getattr(net, "config", None) is not None:
        layout.check_model(net.config)
    uses_lt = uses_cublaslt(net)
    vocab = vocab_size_of(net)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    tracker = reference = None
    if workload.reference_model:
        # TRL prepares the reference with evaluation_mode=True: not DDP-wrapped.
        from llmem_plugin.techniques.reference import build_reference
        from llmem_plugin.trace.tracker import MemoryTracker

        tracker = MemoryTracker()
        reference = build_reference(net, workload, tracker=tracker, fake_mode=fake_mode)
    modelbuild.fakeify(net, fake_mode)
    with fake_process_group(layout.num_gpus, 0), no_data_reads():
        trace = trace_step(net, workload, vocab_size=vocab, fake_mode=fake_mode,
                           compute_capability=gpu.compute_capability, num_sms=gpu.num_sms,
                           wrap=_wrapper(bucket_cap_mb, gradient_as_bucket_view), tracker=tracker,
                           reference=reference)
    overheads = device_overheads(gpu.compute_capability, torch_version=torch_version, uses_cublaslt=uses_lt,
                                 nccl_world_sizes=(layout.num_gpus,))
    # Pinned host copies of offloaded activations (llmem_plugin.techniques.actoffload).
    host = trace.host_peak_bytes if workload.offload_activations is not None else 0
    rank = rank_memory(trace, rank=0, gpu=gpu, overheads=overheads, alloc_conf=config, host_bytes=host)
    sent = workload.grad_accum_steps * ring_allreduce_bytes(grad_bytes, layout.num_gpus)
    notes = [f"buckets of {bucket_cap_mb} MiB (first 1 MiB), gradient_as_bucket_view={gradient_as_bucket_view}",
             "all-reduce every micro-batch (no no_sync)"]
    # NCCL lays rings out node by node, so of the n hops of a ring, one per
    # node crosses between nodes: num_nodes / n of a rank's bytes on average
    # (the convention fsdp.py and tp.py use too).
    inter = sent * layout.num_nodes // layout.num_gpus if layout.num_nodes > 1 else 0
    return MethodEstimate(
        method=preset,
        layout=layout,
        ranks=[rank],
        comm_intra_node_bytes=sent - inter,
        comm_inter_node_bytes=inter,
        notes=notes,
    )
