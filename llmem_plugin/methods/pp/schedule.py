"""Pipeline-parallel schedules: the order each rank runs its stages' microbatches, and how many it holds.

A stage keeps what a microbatch's forward saved until that microbatch's
backward has used it, so a rank's activation memory at its peak is the sum
over the (stage, microbatch) chunks in flight then. Which chunks those are
depends on the schedule. Sources, torch 2.13 ``torch/distributed/pipelining``:

* ``schedules.py`` ``Schedule1F1B._step_microbatches`` (the runtime loop):
  ``min(m, p - s)`` warm-up forwards on stage ``s``, then backward-forward
  pairs ("1B1F"), then the remaining backwards. The action list its IR builds
  (``_get_pipeline_order``) gives the last rank one more forward in flight than
  the loop runs, so 1F1B is built here from the loop;
* every other schedule: its own action list, as
  ``_schedule_visualizer.get_schedule_ops`` builds it without a process group
  (``PipelineScheduleMulti`` subclasses run exactly that list; built here the
  same way, the schedule class given stand-in stages, but with a plain object
  where ``get_schedule_ops`` makes a ``mock.create_autospec`` of
  ``PipelineStage`` per call, which dominated the stand-in search's time). An
  ``OVERLAP_F_B`` action (DualPipeV) runs its sub-actions in order, forward
  first, when no overlap callback is registered (``_PipelineScheduleRuntime``,
  ``for sub_a in action.sub_actions: _perform_action(sub_a)``).

A chunk enters with its forward (``F``) and leaves with its full backward
(``B``) or, for the zero-bubble schedules that split the backward, with its
weight gradient (``W``): the input gradient (``I``) frees the activations only
the input gradient needs, while the weight gradient's inputs stay until ``W``.
"""

from __future__ import annotations

import dataclasses

from llmem_plugin.errors import ConfigError

__all__ = ["SCHEDULES", "SINGLE_STAGE", "SPLIT_BACKWARD", "V_SHAPED", "Chunk", "in_flight", "rank_actions",
           "stages_of_rank"]

# llmem's names -> torch's (torch.distributed.pipelining.schedules.get_schedule_class)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
             "dualpipev": "DualPipeV", "interleaved-zb": "InterleavedZeroBubble"}
# One stage per rank (PipelineScheduleSingle); the V schedules place two stages per rank, r and 2p - 1 - r.
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
# Schedules that split each backward into input and weight gradients (torch.autograd.grad over parts of
# the graph), or overlap forward and backward.
SPLIT_BACKWARD = ("zbv", "dualpipev", "interleaved-zb")


@dataclasses.dataclass(frozen=True, order=True)
class Chunk:
    """One action of a rank: ``kind`` F (forward), B (full backward), I (input gradient) or W (weight
    gradient) of ``microbatch`` on global stage ``stage``."""

    kind: str
    stage: int
    microbatch: int


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}. HINT: pick one")
    for name, value, low in (("pipeline degree", p, 2), ("microbatches", m, 1), ("stages per rank", v, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(f"{schedule} runs one stage per rank, got {v}. HINT: use interleaved-1f1b or "
                          "interleaved-zb for several")
    if schedule in V_SHAPED and v != 2:
        raise ConfigError(f"{schedule} runs two stages per rank (a V), got {v}. HINT: pass 2 stages per rank")


def stages_of_rank(schedule: str, p: int, rank: int, v: int = 1) -> list[int]:
    """The global stages ``rank`` holds: ``rank + k * p`` (loop placement), or ``rank`` and ``2p - 1 - rank``
    for the V schedules (``_utils.generate_stage_to_rank_mapping``, style "v")."""
    _check(schedule, p, 1, v)
    if schedule in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return list(range(rank, p * v, p))


def _one_f_one_b(p: int, m: int) -> list[list[Chunk]]:
    ranks = []
    for s in range(p):
        warmup = min(m, p - s)
        actions = [Chunk("F", s, i) for i in range(warmup)]
        fwd = warmup
        for bwd in range(m):
            actions.append(Chunk("B", s, bwd))
            if fwd < m:
                actions.append(Chunk("F", s, fwd))
                fwd += 1
        ranks.append(actions)
    return ranks


class _StageStandIn:
    """What a schedule's constructor reads of its stages when it only builds the action lists: the rank's
    place in its group and the stage count (``get_schedule_ops`` sets the same on its mock). Anything else
    raises, so a schedule that reads more fails loudly instead of reading a mock's default."""

    def __init__(self, p: int, stages: int) -> None:
        self.group_rank, self.group_size, self.num_stages, self.submod = 0, p, stages, None


def _schedule_ops(schedule: str, p: int, m: int, v: int) -> list[list]:
    """torch's action list of every rank, as ``_schedule_visualizer.get_schedule_ops(name, p, m, v)``
    returns it (checked equal in tests/methods/pp/test_pp_schedule.py)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(SCHEDULES[schedule])
    stages = _StageStandIn(p, p) if issubclass(cls, PipelineScheduleSingle) else [
        _StageStandIn(p, p * v) for _ in range(v)]
    order = cls(stages, m).pipeline_order
    return [list(order[rank]) for rank in range(p)]


def rank_actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[Chunk]]:
    """Each rank's compute actions in the order it runs them.

    Args:
        schedule: One of :data:`SCHEDULES`.
        p: Pipeline degree (ranks).
        m: Microbatches per step.
        v: Stages per rank (1 for gpipe and 1f1b, 2 for zbv and dualpipev).

    Raises:
        ConfigError: An unknown schedule or a degree, count or placement it does not take.
    """
    _check(schedule, p, m, v)
    if schedule == "1f1b":
        return _one_f_one_b(p, m)
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
             _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}
    try:
        schedule_ops = _schedule_ops(schedule, p, m, v)
    except ValueError as e:  # the schedule's own check (DualPipeV: at least as many microbatches as stages)
        raise ConfigError(f"{schedule} with {p} ranks, {m} microbatches and {v} stages per rank: "
                          f"{' '.join(str(e).split()).rstrip('.')}. HINT: pass more microbatches") from None
    ranks = []
    for ops in schedule_ops:
        actions = []
        for op in ops:
            for a in (op.sub_actions or [op]) if op is not None else ():
                if a.computation_type in kinds:
                    actions.append(Chunk(kinds[a.computation_type], a.stage_index, a.microbatch_index))
        ranks.append(actions)
    return ranks


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple[int, int]]]:
    """For each rank, the (stage, microbatch) chunks it holds at its fullest moment: those whose forward ran
    and whose full backward, or weight gradient, has not (the first such moment).

    Raises:
        ConfigError: See :func:`rank_actions`.
    """
    peaks = []
    for actions in rank_actions(schedule, p, m, v):
        live: dict[tuple[int, int], None] = {}
        best: list[tuple[int, int]] = []
        for a in actions:
            key = (a.stage, a.microbatch)
            if a.kind == "F":
                live[key] = None
                if len(live) > len(best):
                    best = list(live)
            elif a.kind in ("B", "W"):
                live.pop(key, None)
        peaks.append(best)
    return peaks
