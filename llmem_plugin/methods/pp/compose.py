"""A pipeline rank's step at any microbatch count, composed from short runs of a small pipeline.

Tracing a rank's whole schedule costs every one of its ``m`` microbatches
(twice: two steps), and the planner's candidates run hundreds. But a rank's
memory over a step is a sequence of actions (the step's start, each compute
action ``F``/``B``/``I``/``W`` of a stage and microbatch, what runs after it
until the next one: P2P, the loss, the end of the schedule; the optimizer
step), and what an action allocates and frees does not depend on which
microbatch it serves. It depends on:

* what the action is (kind and stage),
* whether it is its stage's first or last of its kind in the step (the first
  backward allocates the gradients, the last one under FSDP2 reduce-scatters
  them, the last action's tail concatenates the last stage's outputs),
* which compute actions come just before and after it (which P2P operations
  the runtime batches around it: torch's ``Schedule1F1B`` fuses a forward's
  send with the next backward's receive, for example),
* the step (the first allocates the receive buffers, the optimizer states),
* and, for the step's start and the last action's tail only, ``m`` (the
  receive buffers, the input rows and the output chunks are per microbatch).

So one trace of a small pipeline (``p_t`` ranks, the same stage modules, the
same FSDP2 degree) at two small microbatch counts gives every action's
template: its net change of live bytes and its highest point above where it
started, part by part. Replaying the real rank's action list
(:func:`~llmem_plugin.methods.pp.schedule.rank_actions` at the real ``p`` and
``m``) through those templates gives the live bytes at every moment, hence
the peak: the microbatches in flight add up as the real order has them.
Templates whose two runs differ are affine in ``m`` between them.

Checked against full traces of the real rank (tests/methods/pp/test_pp_compose.py);
where the real schedule needs an action context the small runs never showed,
two instances of one context end at different live bytes (their peaks may
differ: the higher is kept), or an action other than the step's start and its
last action's tail differs between the two runs, :func:`compose` returns None
and the rank is traced in full.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from llmem_plugin.methods.pp.schedule import Chunk, rank_actions, stages_of_rank

__all__ = ["Composed", "Template", "VirtualPipeline", "compose", "compose_runs", "compose_templates", "cut",
           "cut_templates", "stand_in_stages", "templates",
           "traced_accumulation", "virtual_pipeline"]

# Ranks of the small pipeline: the first, a middle one with a warm-up of three, and the last. Four is the
# fewest for which a middle rank holds two forwards between others (1F1B's warm-up F-F-F context).
_VIRTUAL_DEGREE = 4
# Compute actions on each side that an action's context names: the runtime holds a send's work until a
# later action replaces it (torch's 1F1B keeps the last warm-up send it fires, two forwards before the
# first backward, until the step ends), so what an action frees depends on its neighbours two away.
_WINDOW = 2
# Largest stand-in pipeline searched (1F1B needs 2 x _WINDOW + 1 ranks to show five forwards in a row).
_MAX_VIRTUAL_DEGREE = 8
# Longest stand-in run searched, in rounds of its pipeline degree (the interleaved schedules need five).
_MAX_ROUNDS = 8


@dataclass(frozen=True)
class VirtualPipeline:
    """The small pipeline that stands for a rank: its degree, the rank that plays it, and the two microbatch
    counts traced."""

    degree: int
    rank: int
    microbatches: tuple[int, int]


def _valid(schedule: str, p: int, m: int, v: int) -> bool:
    from llmem_plugin.errors import ConfigError

    if schedule == "1f1b" and m < p:  # torch's Schedule1F1B.__init__ refuses fewer microbatches than stages
        return False
    try:
        _actions_of(schedule, p, m, v)
    except ConfigError:
        return False
    return True


def _stage_kinds(schedule: str, p: int, rank: int, v: int) -> list[str]:
    total = p * v
    return ["first" if s == 0 else "last" if s == total - 1 else "middle"
            for s in sorted(stages_of_rank(schedule, p, rank, v))]


def _mapped(schedule: str, p: int, rank: int, v: int, pt: int, r: int) -> dict[int, int]:
    return dict(zip(sorted(stages_of_rank(schedule, p, rank, v)), sorted(stages_of_rank(schedule, pt, r, v))))


def stand_in_stages(schedule: str, p: int, rank: int, v: int, virtual: VirtualPipeline) -> dict[int, int]:
    """Each global stage of pipeline rank ``rank`` -> the stage its stand-in (``virtual``) holds in its place."""
    return _mapped(schedule, p, rank, v, virtual.degree, virtual.rank)


@functools.lru_cache(maxsize=512)
def _actions_of(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Chunk, ...], ...]:
    return tuple(tuple(a) for a in rank_actions(schedule, p, m, v))


@functools.lru_cache(maxsize=4096)
def _keys_of(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[tuple, ...]:
    return tuple(_keys(list(_actions_of(schedule, p, m, v)[rank])))


def _context_keys(schedule: str, p: int, m: int, v: int, rank: int, to: dict[int, int] | None = None) -> set[tuple]:
    keys = _keys_of(schedule, p, m, v, rank)
    return {_relabel(k, to) for k in keys} if to is not None else set(keys)


def _relabel(key: tuple | None, to: dict[int, int]) -> tuple | None:
    if key is None:
        return None
    kind, stage, first, last, prev, nxt, *fwd = key
    return (kind, to[stage], first, last, tuple((k, to[s]) for k, s in prev), tuple((k, to[s]) for k, s in nxt),
            *(_relabel(f, to) for f in fwd))


def virtual_pipeline(schedule: str, p: int, m: int, v: int, rank: int) -> VirtualPipeline | None:
    """The small pipeline for pipeline rank ``rank`` of (``p``, ``m``), or None where none is smaller than
    the real one (trace it in full).

    The stand-in is a rank of the smallest pipeline (from ``min(p, 4)`` ranks up) holding stages of the
    same kinds (first, middle, last) in the same order, at the two smallest valid microbatch counts below
    ``m`` whose runs show every action context the real rank's schedule has (:func:`_keys`); of several
    stand-ins of one degree, the one that needs the fewest microbatches. The real rank itself qualifies
    (its degree is ``p``) when fewer microbatches show all its contexts."""
    want = _stage_kinds(schedule, p, rank, v)
    best = None
    for pt in range(min(p, _VIRTUAL_DEGREE), min(p, _MAX_VIRTUAL_DEGREE) + 1):
        for r in range(pt):
            if _stage_kinds(schedule, pt, r, v) != want:
                continue
            to = _mapped(schedule, p, rank, v, pt, r)
            need = _context_keys(schedule, p, m, v, rank, to)
            counts = []
            # Contexts repeat once a small pipeline's schedule is past its first rounds: beyond a few rounds
            # of pt microbatches a longer run shows nothing new (and would save little).
            for c in range(1, min(m, _MAX_ROUNDS * pt)):
                if _valid(schedule, pt, c, v) and need <= _context_keys(schedule, pt, c, v, r):
                    counts.append(c)
                    if len(counts) == 2:
                        break
            if len(counts) == 2 and (best is None or pt * sum(counts) < best.degree * sum(best.microbatches)):
                best = VirtualPipeline(pt, r, (counts[0], counts[1]))
        if best is not None:
            break
    return best


def _keys(actions: list[Chunk]) -> list[tuple]:
    """Each compute action's context: (kind, stage, first of its kind and stage, last, the (kind, stage) of
    the :data:`_WINDOW` actions before it and after it), and for a backward the context of its microbatch's
    forward."""
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for i, a in enumerate(actions):
        first.setdefault((a.kind, a.stage), i)
        last[(a.kind, a.stage)] = i
    own = []
    for i, a in enumerate(actions):
        prev = tuple((b.kind, b.stage) for b in actions[max(i - _WINDOW, 0):i])
        nxt = tuple((b.kind, b.stage) for b in actions[i + 1:i + 1 + _WINDOW])
        own.append((a.kind, a.stage, first[(a.kind, a.stage)] == i, last[(a.kind, a.stage)] == i, prev, nxt))
    forward = {(a.stage, a.microbatch): k for a, k in zip(actions, own) if a.kind == "F"}
    # A backward's frees depend on where its microbatch's forward ran too: a send the runtime still holds
    # keeps that forward's output alive past its backward (torch's 1F1B keeps the last warm-up send it
    # fired until the step ends).
    return [k if a.kind == "F" else (*k, forward.get((a.stage, a.microbatch))) for a, k in zip(actions, own)]


@dataclass(frozen=True)
class Template:
    """One action's parts: (part name, highest live bytes above the action's start, live bytes above it at
    the part's end)."""

    parts: tuple[tuple[str, int, int], ...]

    @property
    def delta(self) -> int:
        return self.parts[-1][2] if self.parts else 0


@dataclass(frozen=True)
class Traced:
    """A traced run, cut into actions: the live bytes before the first one, and each action's name and
    template in order."""

    start: int
    actions: list[tuple[str, Template]]


def cut(events: list[tuple[int, int, int]], segments: list[tuple[str, int]]) -> Traced:
    """The run's actions from its ``events`` and the positions where its segments start ("F:1:3:0|layers#1":
    action "F:1:3:0", part "layers#1"); consecutive segments of one action form its template."""
    bounds = [pos for _, pos in segments] + [len(events)]
    live = 0
    for sign, _, n in events[: bounds[0]]:
        live += sign * n
    start = live
    actions: list[tuple[str, list[tuple[str, int, int]], int]] = []
    for k, (name, pos) in enumerate(segments):
        action, _, part = name.partition("|")
        if not actions or actions[-1][0] != action:
            actions.append((action, [], live))
        base = actions[-1][2]
        peak = live
        for sign, _, n in events[pos: bounds[k + 1]]:
            live += sign * n
            peak = max(peak, live)
        actions[-1][1].append((part, peak - base, live - base))
    return Traced(start, [(a, Template(tuple(parts))) for a, parts, _ in actions])


def _label(action: str) -> tuple[str, int, int, int] | None:
    """("F", stage, microbatch, step) of a compute or after-compute action name; None for the others."""
    kind, *rest = action.split(":")
    if len(rest) != 3:
        return None
    return kind, int(rest[0]), int(rest[1]), int(rest[2])


def templates(run: Traced, schedule: str, p: int, m: int, v: int, rank: int) -> dict[tuple, Template] | None:
    """Each action context's template in one traced run of pipeline rank ``rank`` of (``p``, ``m``); None
    when the run's compute actions are not the schedule's, or two instances of one context differ."""
    expected = list(_actions_of(schedule, p, m, v)[rank])
    keys = list(_keys_of(schedule, p, m, v, rank))
    out: dict[tuple, Template] = {}
    i_of_step: dict[int, int] = {}
    for action, tpl in run.actions:
        label = _label(action)
        if label is None:
            key: tuple = (action,)  # "step:0", "optimizer:1"
        else:
            kind, stage, mb, it = label
            base = kind.removeprefix("after-")
            if base == kind:
                i = i_of_step.get(it, 0)
                i_of_step[it] = i + 1
            else:
                i = i_of_step.get(it, 0) - 1
            if not 0 <= i < len(expected) or expected[i] != Chunk(base, stage, mb):
                return None
            key = (kind, it, *keys[i][1:])
        seen = out.setdefault(key, tpl)
        if seen != tpl:
            if [(n, e) for n, _, e in seen.parts] != [(n, e) for n, _, e in tpl.parts]:
                return None
            out[key] = Template(tuple((n, max(a, b), e) for (n, a, e), (_, b, _) in zip(seen.parts, tpl.parts)))
    if any(i_of_step.get(it) != len(expected) for it in i_of_step):
        return None
    return out


def _between(a: Template, b: Template, m_a: int, m_b: int, m: int, per_microbatch: bool, slack: int = 0
             ) -> Template | None:
    """The template at ``m`` from its values at ``m_a`` and ``m_b``: equal ones as they are; affine (rounded
    up) only where the action handles every microbatch at once (``per_microbatch``: the step's start, the
    step's last action's tail), raised by ``slack`` bytes there; None otherwise."""
    if per_microbatch and slack:
        a = Template(tuple((n, h + slack, e + slack) for n, h, e in a.parts))
        b = Template(tuple((n, h + slack, e + slack) for n, h, e in b.parts))
    if a == b:
        return a
    if not per_microbatch or [n for n, _, _ in a.parts] != [n for n, _, _ in b.parts]:
        return None

    def at(x: int, y: int) -> int:
        return x + math.ceil((y - x) * (m - m_a) / (m_b - m_a))

    return Template(tuple((n, at(pa, pb), at(ea, eb)) for (n, pa, ea), (_, pb, eb) in zip(a.parts, b.parts)))


def rounding_slack(proportional: int, m_a: int, m_b: int, m: int, *, unit_bytes: int) -> int:
    """Bytes that cover the allocator's rounding of ``proportional`` tensors whose size is ``m x unit_bytes``
    (the step's input ids, targets, the merged outputs) when extrapolated from ``m_a`` and ``m_b``.

    Each is held in a block of ``ceil(m x unit / 512) x 512`` bytes (CUDACachingAllocator.cpp,
    ``kMinBlockSize``), which is affine in ``m`` only when ``unit`` is a multiple of 512. Otherwise the line
    through the rounded sizes at ``m_a`` and ``m_b`` runs below the size at ``m`` by less than
    ``512 x (m - m_a) / (m_b - m_a)`` (its slope is off by up to 512 / (m_b - m_a) per microbatch, and the
    size at ``m`` is up to 512 over ``m x unit``): that much is added per tensor, so the step is never
    under."""
    from llmem_plugin.device.allocator_config import MIN_BLOCK_SIZE

    if not proportional or unit_bytes % MIN_BLOCK_SIZE == 0 or m_a == m_b:  # m_a == m_b == m: nothing extrapolated
        return 0
    return proportional * MIN_BLOCK_SIZE * math.ceil((m - m_a) / (m_b - m_a))


@dataclass(frozen=True)
class Composed:
    """The composed run: its highest live bytes, each action part's highest (named as a full trace of the
    real rank names them), and each phase's highest."""

    peak: int
    segment_peaks: dict[str, int]
    phase_peaks: dict[str, int]


def _phase(kind: str) -> str:
    base = kind.removeprefix("after-")
    return {"F": "forward", "B": "backward", "I": "backward", "W": "backward", "step": "setup",
            "optimizer": "optimizer"}[base]


def compose(runs: tuple[tuple[Traced, dict[tuple, Template]], tuple[Traced, dict[tuple, Template]]],
            virtual: VirtualPipeline, schedule: str, p: int, m: int, v: int, rank: int,
            iterations: int = 2, slack: tuple[int, int] = (0, 0), accumulation: int = 1,
            traced_steps: int | None = None) -> Composed | None:
    """Replay pipeline rank ``rank`` of (``p``, ``m``) from its stand-in's two runs (:func:`templates` of
    each, at ``virtual.microbatches``); None where a context of the real schedule is missing from them or
    the runs start apart. ``slack``: bytes added to the step's start and to its last action's tail
    (:func:`rounding_slack`).

    ``accumulation``: schedule steps per optimizer step. The runs take ``traced_steps`` of them (default
    :func:`traced_accumulation`): the first schedule step of an optimizer step (no gradients yet: the first
    reduction allocates them) and a later one (it adds to them); every later one starts from the same live
    tensors and runs the same actions, so the real rank's third and later steps replay the runs' second,
    and a rank without accumulation replays only their first steps."""
    (run_a, tpl_a), (run_b, tpl_b) = runs
    if run_a.start != run_b.start:
        return None
    m_a, m_b = virtual.microbatches
    to_virtual = stand_in_stages(schedule, p, rank, v, virtual)
    to_real = {b: a for a, b in to_virtual.items()}
    actions = _actions_of(schedule, p, m, v)[rank]
    keys = _keys_of(schedule, p, m, v, rank)

    live = run_b.start
    peak = live
    segments: dict[str, int] = {}
    phases: dict[str, int] = {}
    made: dict[tuple, Template | None] = {}  # a template at ``m``, by (key, per_microbatch, extra)
    real_part: dict[str, str] = {}  # a part's name as the real rank names it

    def renamed(part: str) -> str:
        out = real_part.get(part)
        if out is None:
            head, hash_, count = part.partition("#")
            if head[:1] == "s" and head[1:].isdigit():  # an allocation at a stage's root: "s1#1" names its stage
                out = f"s{to_real[int(head[1:])]}{hash_}{count}"
            else:
                out = part
            real_part[part] = out
        return out

    def play(name: str, key: tuple, phase: str, per_microbatch: bool = False, extra: int = 0, settle: int = 0
             ) -> bool:
        nonlocal live, peak
        made_key = (key, per_microbatch, extra)
        if made_key in made:
            tpl = made[made_key]
        else:
            a, b = tpl_a.get(key), tpl_b.get(key)
            # A context both runs must show, to tell a constant from a trend.
            tpl = None if a is None or b is None else _between(a, b, m_a, m_b, m, per_microbatch, extra)
            made[made_key] = tpl
        if tpl is None:
            return False
        if tpl.parts:
            top = phases.get(phase, -1)
            for part, high, _ in tpl.parts:
                at = live + high
                segments[f"{name}|{renamed(part)}" if part else name] = at
                if at > top:
                    top = at
            phases[phase] = top
            if top > peak:
                peak = top
        live += tpl.delta - settle
        return True

    # Each action's two parts (its own, then what follows it), worked out once: the name's head, the
    # key's tail in the stand-in's stage numbers, the phase, and (per_microbatch, extra, settle), which only
    # the step's tail sets. The tail frees the step's inputs and merged outputs, whose slack then goes with
    # them: the start's and its own are taken back (each freed as extrapolated, exactly what was allocated
    # less its slack), so the live bytes do not drift up a slack per step.
    plan = []
    for i, (a, key) in enumerate(zip(actions, keys)):
        vk_tail = _relabel(key, to_virtual)[1:]
        for kind in (a.kind, f"after-{a.kind}"):
            tail = kind.startswith("after-") and i == len(actions) - 1
            plan.append((f"{kind}:{a.stage}:{a.microbatch}:", kind, vk_tail, _phase(kind),
                         (True, slack[1], slack[0] + slack[1]) if tail else (False, 0, 0)))

    traced = traced_steps if traced_steps is not None else traced_accumulation(accumulation)
    for it in range(iterations):
        for k in range(accumulation):
            n, nv = it * accumulation + k, it * traced + min(k, traced - 1)  # the real step, the run's
            # Added at every step (a step's new inputs may be allocated while the last step's are still held).
            if not play(f"step:{n}", (f"step:{nv}",), "setup", per_microbatch=True, extra=slack[0]):
                return None
            for head, kind, vk_tail, phase, (per_microbatch, extra, settle) in plan:
                if not play(f"{head}{n}", (kind, nv, *vk_tail), phase, per_microbatch, extra, settle):
                    return None
        if not play(f"optimizer:{it}", (f"optimizer:{it}",), "optimizer"):
            return None
    return Composed(peak, segments, phases)


def traced_accumulation(accumulation: int) -> int:
    """Schedule steps per optimizer step that a stand-in run takes for a rank that accumulates
    ``accumulation`` (:func:`compose`): the first and one later."""
    return min(accumulation, 2)


def cut_templates(runs: list[tuple[list[tuple[int, int, int]], list[tuple[str, int]]]], virtual: VirtualPipeline,
                  schedule: str, v: int) -> list[tuple[Traced, dict[tuple, Template] | None]]:
    """Each of the stand-in's traced runs (events, segment starts) cut into actions, with its templates
    (None where its compute actions are not the schedule's)."""
    out = []
    for (events, segments), mx in zip(runs, virtual.microbatches):
        run = cut(events, segments)
        out.append((run, templates(run, schedule, virtual.degree, mx, v, virtual.rank)))
    return out


def compose_runs(runs: list[tuple[list[tuple[int, int, int]], list[tuple[str, int]]]], virtual: VirtualPipeline,
                 schedule: str, p: int, m: int, v: int, rank: int, *, input_bytes: int = 0, output_bytes: int = 0,
                 return_outputs: bool = True, accumulation: int = 1, traced_steps: int | None = None
                 ) -> Composed | None:
    """:func:`compose` from the stand-in's two traced runs, each as (events, segment starts).

    ``input_bytes`` and ``output_bytes``: one microbatch's bytes in the tensors that hold every microbatch,
    for :func:`rounding_slack`: the step's int64 ids (the first stage's rank) and targets (the last's), and
    with ``return_outputs`` the last stage's merged logits."""
    return compose_templates(cut_templates(runs, virtual, schedule, v), virtual, schedule, p, m, v, rank,
                             input_bytes=input_bytes, output_bytes=output_bytes, return_outputs=return_outputs,
                             accumulation=accumulation, traced_steps=traced_steps)


def compose_templates(runs: list[tuple[Traced, dict[tuple, Template] | None]], virtual: VirtualPipeline, schedule: str,
                      p: int, m: int, v: int, rank: int, *, input_bytes: int = 0, output_bytes: int = 0,
                      return_outputs: bool = True, accumulation: int = 1, traced_steps: int | None = None
                      ) -> Composed | None:
    """:func:`compose_runs` from runs already cut (:func:`cut_templates`, or synthesised)."""
    if any(tpl is None for _, tpl in runs):
        return None
    held = stages_of_rank(schedule, p, rank, v)
    first, last = 0 in held, p * v - 1 in held
    m_a, m_b = virtual.microbatches
    slack = (rounding_slack(first + last, m_a, m_b, m, unit_bytes=input_bytes),
             rounding_slack(int(last and return_outputs), m_a, m_b, m, unit_bytes=output_bytes))
    return compose((runs[0], runs[1]), virtual, schedule, p, m, v, rank, slack=slack,
                   accumulation=accumulation, traced_steps=traced_steps)
