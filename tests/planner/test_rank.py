"""Rank (llmem_plugin.planner.rank): the order is the cost model's step time (ties: less communication,
then more headroom); the runner-up is another configuration; the why line carries the model's numbers."""

from __future__ import annotations

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.planner.candidates import Candidate, _Config, _Run
from llmem_plugin.planner.cost import FlopCount, Network, Overlap, StepWork, step_time
from llmem_plugin.planner.rank import order, rank
from llmem_plugin.workload import OptimizerKind, Precision

GPU = get_gpu("h100-sxm")
NET = Network.for_gpu(GPU)
TOKENS = 8 * 1024  # global batch x sequence length
GIB = 2**30


def candidate(method: str, *, flops: float = 1e15, comm: int = 0, overlap: Overlap = Overlap.NONE,
              total: int = 10 * GIB, tp: int = 1, fits: bool = True) -> Candidate:
    """A candidate whose step time is the cost model's for this work."""
    st = step_time(StepWork(flops=FlopCount(forward=flops / 3, backward=2 * flops / 3), micro_steps=1,
                            intra_only_bytes=comm, overlap=overlap, optimizer_elements=10**8, gpus_per_node=8),
                   gpu=GPU, precision=Precision.BF16_MIXED, optimizer=OptimizerKind.ADAMW, network=NET)
    return Candidate(method=method, tp=tp, micro_batch=1, grad_accum=1, grad_checkpointing=False, offload=None,
                     device_total_bytes=total, peak_allocated_bytes=total, peak_reserved_bytes=total,
                     limit_bytes=20 * GIB, fits=fits, verified=True, time=st, tokens_per_s=TOKENS / st.total_s)


def test_the_order_is_the_step_time_then_communication_then_headroom():
    slow = candidate("ddp", flops=2e15)
    fast = candidate("zero2", flops=1e15, comm=2 * 10**9)
    fastest = candidate("zero1", flops=1e15)
    # Hidden behind compute: the same step time as `fastest`, but more link time; and a twin with less headroom.
    hidden = candidate("fsdp", flops=1e15, comm=10**9, overlap=Overlap.FORWARD_BACKWARD)
    fuller = candidate("zero3", flops=1e15, total=12 * GIB)
    assert hidden.step_time_s == fastest.step_time_s == fuller.step_time_s and hidden.time.comm_s > 0
    assert slow.step_time_s > fast.step_time_s > fastest.step_time_s
    cands = [slow, fuller, hidden, fast, fastest]
    order(cands)
    assert [c.method for c in cands] == ["zero1", "zero3", "fsdp", "zero2", "ddp"]
    assert [c.step_time_s for c in cands] == sorted(c.step_time_s for c in cands)


def test_the_runner_up_is_the_fastest_other_configuration_that_fits():
    a = candidate("fsdp", flops=1e15)
    same_config = candidate("fsdp", flops=1.1e15)  # another micro-batch of the choice's configuration
    too_big = candidate("zero3", flops=1.2e15, fits=False)
    b = candidate("dp-tp", flops=1.5e15, comm=10**10, tp=2)
    run = _Run(candidates=[a, same_config, too_big, b])
    runner, why = rank(run, a)
    assert runner is b
    x, y = a.time, b.time
    # The part that differs most: compute here (1e15 vs 1.5e15 FLOPs), over exposed communication.
    assert (y.compute_s - x.compute_s) > (y.exposed_comm_s - x.exposed_comm_s)
    assert why == (f"fsdp mb1x1 beats dp-tp tp2 mb1x1: {x.total_s:.3g} s vs {y.total_s:.3g} s per step, "
                   f"mostly compute ({x.compute_s:.3g} s vs {y.compute_s:.3g} s)")


def test_a_tie_names_the_communication_and_untraced_units_their_bound():
    a = candidate("zero3", flops=1e15, comm=10**9, overlap=Overlap.FORWARD_BACKWARD)
    b = candidate("fsdp", flops=1e15, comm=2 * 10**9, overlap=Overlap.FORWARD_BACKWARD)
    unit = (_Config("ddp", 1), False)
    run = _Run(candidates=[a, b], pending=[unit], bound={unit: 0.125})
    runner, why = rank(run, a)
    assert runner is b
    assert why == (f"zero3 mb1x1 ties with fsdp mb1x1 at {a.time.total_s:.3g} s per step (communication hidden "
                   f"behind compute); it sends less ({a.time.comm_s:.3g} s vs {b.time.comm_s:.3g} s of link time); "
                   "1 other (method, checkpointing) pairs were not traced: under the model none can beat it (their "
                   "lower bounds start at 0.125 s per step)")


def test_without_a_choice_there_is_no_runner_up_and_no_why():
    assert rank(_Run(candidates=[candidate("ddp", fits=False)]), None) == (None, "")
