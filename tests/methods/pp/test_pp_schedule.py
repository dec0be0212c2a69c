"""Pipeline schedules: the chunks each rank holds at its peak, against closed forms and torch's own runtime.

Closed forms (p ranks, rank s, m microbatches, v stages per rank), read from
torch 2.13's torch/distributed/pipelining/schedules.py: GPipe holds all m;
1F1B's runtime loop warms up min(m, p - s) forwards and then alternates;
interleaved 1F1B holds min((v - 1) * mpr + 2 * (p - 1 - s), m * v) + 1 chunks,
mpr = m // max(1, m // p) (its warm-up count plus the one in steady state);
the zero-bubble schedules keep a chunk until its weight gradient: 2p on every
rank for ZB-V and interleaved zero bubble; DualPipeV runs each overlapped
forward before its backward, 2p + 1.
"""

from __future__ import annotations

import pytest

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods.pp.schedule import SCHEDULES, in_flight, rank_actions, stages_of_rank

CASES = [(2, 4), (4, 8), (4, 16), (8, 16)]


def _counts(schedule, p, m, v=1):
    return [len(chunks) for chunks in in_flight(schedule, p, m, v)]


@pytest.mark.parametrize("p,m", CASES + [(4, 2)])
def test_gpipe_and_1f1b(p, m):
    assert _counts("gpipe", p, m) == [m] * p
    assert _counts("1f1b", p, m) == [min(m, p - s) for s in range(p)]


@pytest.mark.parametrize("p,m", CASES)
def test_interleaved_1f1b(p, m):
    v = 2
    mpr = m // max(1, m // p)
    assert _counts("interleaved-1f1b", p, m, v) == [min((v - 1) * mpr + 2 * (p - 1 - s), m * v) + 1 for s in range(p)]


def test_interleaved_1f1b_example_of_the_issue():
    assert _counts("interleaved-1f1b", 4, 8, 2) == [11, 9, 7, 5]


@pytest.mark.parametrize("p,m", CASES)
def test_zero_bubble_schedules_hold_chunks_until_their_weight_gradient(p, m):
    assert _counts("zbv", p, m, 2) == [2 * p] * p
    assert _counts("interleaved-zb", p, m, 2) == [2 * p] * p
    assert _counts("dualpipev", p, max(m, 2 * p), 2) == [2 * p + 1] * p


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_chunk_runs_forward_then_leaves_once(schedule):
    p, m = 4, 8
    v = 2 if schedule not in ("gpipe", "1f1b") else 1
    for rank, actions in enumerate(rank_actions(schedule, p, m, v)):
        stages = stages_of_rank(schedule, p, rank, v)
        for stage in stages:
            for mb in range(m):
                kinds = [a.kind for a in actions if (a.stage, a.microbatch) == (stage, mb)]
                assert kinds[0] == "F" and kinds[-1] in ("B", "W") and kinds.count("F") == 1, (stage, mb, kinds)
        assert {a.stage for a in actions} == set(stages)


def test_1f1b_follows_the_runtime_loop_not_the_ir_on_the_last_rank():
    """The IR's action list (get_schedule_ops) runs the last rank's second forward before its first backward;
    Schedule1F1B._step_microbatches runs one forward first (warm-up min(m, p - s) = 1)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ir = [str(a) for a in get_schedule_ops("1F1B", 4, 8)[3] if a is not None]
    assert ir.index("3F1") < ir.index("3B0")
    ours = [a.kind for a in rank_actions("1f1b", 4, 8)[3]]
    assert ours[:4] == ["F", "B", "F", "B"]


def test_v_placement():
    assert [stages_of_rank("zbv", 4, r, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stages_of_rank("interleaved-1f1b", 4, 1, 2) == [1, 5]


@pytest.mark.parametrize("args,needle", [
    (("pp", 4, 8), "not one of"),
    (("1f1b", 4, 8, 2), "one stage per rank"),
    (("zbv", 4, 8, 3), "two stages per rank"),
    (("dualpipev", 4, 3, 2), "at least as many microbatches"),
    (("gpipe", 1, 8), "pipeline degree must be an integer >= 2"),
])
def test_bad_schedules_are_one_line_errors(args, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        rank_actions(*args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("v", [2, 3])
def test_first_stage_equals_megatron_schedule_factors(p, k, v):
    """Megatron-LM's compute_activation_memory (megatron/training/theoretical_memory_usage.py) gives the first
    stage min(m, p) microbatches in flight without interleaving, and p x (1 + (p - 1) / (p v)) stage-sized
    microbatches with v virtual stages, i.e. p v + p - 1 chunks of 1/v stage, for m a multiple of p from 2p
    (at m = p every chunk is in flight: m v, which that formula does not discount)."""
    m = k * p
    assert len(in_flight("1f1b", p, m)[0]) == min(m, p)
    assert len(in_flight("interleaved-1f1b", p, p, v)[0]) == p * v
    penalty = 1 + (p - 1) / (p * v)
    assert len(in_flight("interleaved-1f1b", p, m, v)[0]) == round(penalty * p * v) == p * v + p - 1


@pytest.mark.parametrize("schedule", sorted(set(SCHEDULES) - {"1f1b"}))
def test_action_lists_are_torchs_own(schedule):
    """The action lists are what torch's _schedule_visualizer.get_schedule_ops builds (with a mocked stage),
    for each schedule over a grid of degrees, microbatch counts and stages per rank."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from llmem_plugin.methods.pp.schedule import _schedule_ops

    grid = [1] if schedule == "gpipe" else [2, 3] if schedule.startswith("interleaved") else [2]
    for v in grid:
        for p in (2, 4, 8):
            for m in (p, 2 * p, 3 * p):
                if schedule == "dualpipev" and m < 2 * p:
                    continue  # torch refuses fewer microbatches than stages
                want = get_schedule_ops(SCHEDULES[schedule], p, m, num_stages_per_rank=None if v == 1 else v)
                assert _schedule_ops(schedule, p, m, v) == want, (p, m, v)
