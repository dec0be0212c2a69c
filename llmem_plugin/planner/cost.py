"""Step-time model: how long one optimizer step takes on each GPU, and why.

A step is ``A`` micro-steps (gradient accumulation) of forward and backward,
the gradient/parameter communication of the method, and the optimizer step
(on the GPU, or on the host for CPU offload)::

    compute   = A * (forward_flops + backward_flops) / (peak * efficiency)
    comm      = what the method sends, over the link each collective crosses
    exposed   = max(0, comm - the compute it can hide behind)
    optimizer = bytes the update touches / HBM bandwidth   (on the GPU)
    offload   = PCIe transfers + host update over host memory bandwidth
    bubble    = compute * (p - 1) / (v * m)   (pipeline parallel: p ranks, v stages
                per rank, m microbatches; Narayanan et al., SC'21, "Efficient
                Large-Scale Language Model Training on GPU Clusters Using
                Megatron-LM", sections 2.2.1-2.2.2)
    step      = compute + exposed + optimizer + offload + bubble

FLOPs are counted on the traced step itself (:class:`StepFlopCounter`):
``torch.utils.flop_counter``'s formulas for every matmul the model runs,
forward and backward, including the recomputation of gradient checkpointing;
fused attention kernels, which run no aten matmul, are counted from their
shapes with the same module's SDPA formulas (causal attention at half, as
the kernels skip fully masked tiles).

Constants and their sources:

* ``DEFAULT_EFFICIENCY = 0.40``: model FLOPs utilisation of a well-tuned
  dense bf16 training step. The Llama 3 report (Dubey et al., 2024, Table 4)
  gives 38-43 % BF16 MFU on H100s. No GPU has been measured in this project
  yet, so it is not calibrated; ``efficiency=`` overrides it.
* Peak throughput: the GPU catalog's dense tensor-core bf16/fp16 figure, or
  non-tensor fp32 for fp32 training (PyTorch leaves TF32 matmuls off by
  default: ``torch.backends.cuda.matmul.allow_tf32 = False`` since 1.12).
* Intra-node link: the catalog's ``link_bandwidth_gbps`` / 2 (it is quoted
  bidirectional).
* ``DEFAULT_INTER_NODE_GBPS = 50``: one 400 Gb/s NDR InfiniBand adapter per
  GPU (NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s for 8 GPUs). A ring
  collective that spans nodes runs at the slowest hop, the network, for all
  its bytes (NCCL's ring algorithm moves every chunk through every rank).
* PCIe: per direction, x16, after 128b/130b encoding (PCI-SIG base specs:
  Gen3 15.75, Gen4 31.5, Gen5 63 GB/s).
* ``DEFAULT_HOST_MEMORY_GBPS = 614``: a DGX H100's two Xeon 8480C sockets,
  8 channels of DDR5-4800 each (2 x 8 x 38.4 GB/s), shared by the node's GPUs.
* Overlap, per engine: PyTorch DDP launches each bucket's all-reduce during
  backward (Li et al., VLDB 2020, "PyTorch Distributed"); FSDP2 prefetches
  all-gathers in forward and backward and reduce-scatters during backward;
  DeepSpeed overlaps only when ``overlap_comm`` is on, whose default is on
  for stage 3 and off for stages 1 and 2 (deepspeed/runtime/zero/config.py,
  ``overlap_comm_valid``); tensor-parallel activation collectives sit on the
  critical path and are not hidden.
* Optimizer traffic per trainable element (fp32 states): AdamW reads
  parameter, gradient, m, v and writes parameter, m, v (7 x 4 B); SGD with
  momentum reads 3 and writes 2 (5 x 4 B); Adafactor's factored state is
  negligible (3 x 4 B); the per-parameter AdamW loop moves AdamW's bytes;
  bitsandbytes' 8-bit AdamW moves 1-byte states (16 B). Memory-bound
  kernels, at the catalog's HBM bandwidth.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.device.gpus import GPU
from llmem_plugin.workload import OptimizerKind, Precision

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_HOST_MEMORY_GBPS",
    "DEFAULT_INTER_NODE_GBPS",
    "FlopCount",
    "Network",
    "Overlap",
    "StepFlopCounter",
    "StepTime",
    "StepWork",
    "flops_of_step",
    "optimizer_bytes_per_element",
    "pcie_gbps",
    "peak_flops",
    "pipeline_bubble_s",
    "step_time",
]

DEFAULT_EFFICIENCY = 0.40
DEFAULT_INTER_NODE_GBPS = 50.0
DEFAULT_HOST_MEMORY_GBPS = 614.0
_PCIE_X16_GBPS = {"pcie3": 15.75, "pcie4": 31.5, "pcie5": 63.0}
_OPTIMIZER_ELEMENT_BYTES = {
    OptimizerKind.ADAMW: 7 * 4,
    OptimizerKind.ADAMW_FUSED: 7 * 4,
    OptimizerKind.SGD: 5 * 4,
    OptimizerKind.ADAFACTOR: 3 * 4,
    OptimizerKind.ADAMW_FORLOOP: 7 * 4,
    # bitsandbytes 8-bit AdamW: parameter and gradient in 4 B, m and v in 1 B
    # each (blockwise uint8 states, bitsandbytes/optim/optimizer.py), read and
    # written as for AdamW: 4 + 4 + 1 + 1 read, 4 + 1 + 1 written.
    OptimizerKind.ADAMW_8BIT: 16,
    # Paged states are the same bytes, resident on the device while they fit.
    OptimizerKind.PAGED_ADAMW: 7 * 4,
    OptimizerKind.PAGED_ADAMW_8BIT: 16,
}


class Overlap(str, Enum):
    """What compute a method's communication can hide behind."""

    NONE = "none"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward+backward"


@dataclass(frozen=True, kw_only=True)
class FlopCount:
    """FLOPs of one micro-step of the whole (unsharded) model.

    Attributes:
        forward: FLOPs of the forward pass (matmuls and attention).
        backward: FLOPs of the backward pass, with any recomputation.
    """

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def scaled(self, factor: float) -> FlopCount:
        return FlopCount(forward=self.forward * factor, backward=self.backward * factor)


class _PhaseFlopCounter(TorchDispatchMode):
    """``torch.utils.flop_counter``'s formulas, attributed to the tracker's phase."""

    def __init__(self, tracker: Any) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._registry = flop_registry
        self._tracker = tracker
        self.by_phase: dict[str, float] = {}

    def add(self, phase: str, flops: float) -> None:
        self.by_phase[phase] = self.by_phase.get(phase, 0.0) + flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fn = self._registry.get(func._overloadpacket)
        if fn is not None:
            self.add(self._tracker.phase.value, float(fn(*args, **kwargs, out_val=out)))
        return out


def _attention_flops(which: str, q: tuple, k: tuple, v: tuple, is_causal: bool) -> float:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if which == "forward":
        flops = sdpa_flop_count(q, k, v)
    else:
        flops = sdpa_backward_flop_count(q[:-1] + (v[-1],), q, k, v)
    # Causal: the kernels skip the tiles above the diagonal (FlashAttention-2,
    # Dao 2023, section 3.1.1), about half the work when s_q == s_k.
    return flops / 2 if is_causal and q[-2] == k[-2] else flops


class StepFlopCounter(contextlib.AbstractContextManager):
    """Counts the FLOPs of a traced step by phase. Enter it inside the
    tracker (as one of :func:`llmem_plugin.trace.step.trace_step`'s ``contexts``);
    ``by_phase`` maps phase values to FLOPs."""

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self._counter = _PhaseFlopCounter(tracker)
        self._stack = contextlib.ExitStack()
        self.by_phase = self._counter.by_phase

    def _on_attention(self, which: str, q: tuple, k: tuple, v: tuple, is_causal: bool) -> None:
        self._counter.add(self._tracker.phase.value, _attention_flops(which, q, k, v, is_causal))

    def __enter__(self) -> StepFlopCounter:  # noqa: PYI034 (typing.Self needs 3.11)
        from llmem_plugin.trace.emulation.sdpa import observe_attention

        self._stack.enter_context(self._counter)
        self._stack.enter_context(observe_attention(self._on_attention))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def peak_flops(gpu: GPU, precision: Precision) -> float:
    """Dense peak FLOP/s of the matmuls a step in ``precision`` runs."""
    if precision in (Precision.BF16_MIXED, Precision.BF16):
        tflops = gpu.bf16_tflops if gpu.bf16_tflops is not None else gpu.fp32_tflops
    elif precision is Precision.FP16_MIXED:
        tflops = gpu.fp16_tflops
    else:
        tflops = gpu.fp32_tflops
    return tflops * 1e12


def pcie_gbps(gpu: GPU) -> float:
    """Host link GB/s per direction (x16 assumed for the lane count)."""
    gen = gpu.pcie.split()[0].lower()
    lanes = int(gpu.pcie.split()[1].lstrip("x")) if len(gpu.pcie.split()) > 1 else 16
    return _PCIE_X16_GBPS.get(gen, _PCIE_X16_GBPS["pcie4"]) * lanes / 16


def optimizer_bytes_per_element(optimizer: OptimizerKind) -> int:
    return _OPTIMIZER_ELEMENT_BYTES[optimizer]


@dataclass(frozen=True, kw_only=True)
class Network:
    """Links between GPUs and to the host.

    Attributes:
        intra_node_gbps: GB/s per direction between GPUs of a node.
        inter_node_gbps: GB/s per direction per GPU between nodes.
        pcie_gbps: GB/s per direction between a GPU and its host.
        host_memory_gbps: Host memory bandwidth per node.
    """

    intra_node_gbps: float
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    pcie_gbps: float
    host_memory_gbps: float = DEFAULT_HOST_MEMORY_GBPS

    @classmethod
    def for_gpu(cls, gpu: GPU, *, inter_node_gbps: float | None = None,
                host_memory_gbps: float | None = None) -> Network:
        return cls(
            intra_node_gbps=gpu.link_bandwidth_gbps / 2,
            inter_node_gbps=DEFAULT_INTER_NODE_GBPS if inter_node_gbps is None else inter_node_gbps,
            pcie_gbps=pcie_gbps(gpu),
            host_memory_gbps=DEFAULT_HOST_MEMORY_GBPS if host_memory_gbps is None else host_memory_gbps,
        )


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one rank does in one optimizer step.

    Attributes:
        flops: FLOPs of one micro-step on this rank.
        micro_steps: Micro-batches per optimizer step (gradient accumulation).
        intra_only_bytes: Bytes sent per step in collectives inside a node.
        cross_node_bytes: Bytes sent per step in collectives spanning nodes.
        overlap: The compute the communication can hide behind.
        optimizer_elements: Trainable elements this rank updates on the GPU.
        host_optimizer_elements: Elements it updates on the host (offload).
        pcie_bytes: Bytes moved between GPU and host per step (offload).
        gpus_per_node: GPUs sharing the host's memory bandwidth.
    """

    flops: FlopCount
    micro_steps: int
    intra_only_bytes: int = 0
    cross_node_bytes: int = 0
    overlap: Overlap = Overlap.NONE
    optimizer_elements: int = 0
    host_optimizer_elements: int = 0
    pcie_bytes: int = 0
    gpus_per_node: int = 1


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted time of one optimizer step, by part (seconds)."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    offload_s: float
    bubble_s: float = 0.0  # pipeline ranks idle while the schedule fills and drains

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.optimizer_s + self.offload_s + self.bubble_s

    def to_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s,
                "optimizer_s": self.optimizer_s, "offload_s": self.offload_s, "bubble_s": self.bubble_s,
                "total_s": self.total_s}


def step_time(
    work: StepWork,
    *,
    gpu: GPU,
    precision: Precision,
    optimizer: OptimizerKind,
    network: Network,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> StepTime:
    """Time of one optimizer step on one rank (see the module docstring)."""
    rate = peak_flops(gpu, precision) * efficiency
    fwd = work.micro_steps * work.flops.forward / rate
    bwd = work.micro_steps * work.flops.backward / rate
    comm = work.intra_only_bytes / (network.intra_node_gbps * 1e9) + work.cross_node_bytes / (
        network.inter_node_gbps * 1e9)
    window = {Overlap.NONE: 0.0, Overlap.BACKWARD: bwd, Overlap.FORWARD_BACKWARD: fwd + bwd}[work.overlap]
    per_element = optimizer_bytes_per_element(optimizer)
    opt = work.optimizer_elements * per_element / (gpu.memory_bandwidth_gbps * 1e9)
    host_bw = network.host_memory_gbps * 1e9 / max(work.gpus_per_node, 1)
    offload = work.pcie_bytes / (network.pcie_gbps * 1e9) + work.host_optimizer_elements * per_element / host_bw
    return StepTime(compute_s=fwd + bwd, comm_s=comm, exposed_comm_s=max(0.0, comm - window), optimizer_s=opt,
                    offload_s=offload)


def flops_of_step(trace_flops: dict[str, float], iterations: int, micro_steps: int) -> FlopCount:
    """Per micro-step FLOPs from a trace's per-phase totals (the trace runs
    ``iterations`` steps of ``micro_steps`` micro-batches)."""
    n = max(iterations * micro_steps, 1)
    return FlopCount(forward=trace_flops.get("forward", 0.0) / n, backward=trace_flops.get("backward", 0.0) / n)


def pipeline_bubble_s(compute_s: float, *, degree: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle time of a pipeline rank per step: ``compute * (p - 1) / (v * m)`` (Narayanan et al., SC'21,
    sections 2.2.1 and 2.2.2: GPipe and 1F1B leave ``p - 1`` microbatch slots idle while the pipeline
    fills and drains; interleaving ``v`` stages per rank shrinks each slot ``v`` times)."""
    return compute_s * (degree - 1) / (stages_per_rank * microbatches)
