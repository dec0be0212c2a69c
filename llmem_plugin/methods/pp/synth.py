"""A pipeline rank's action templates from placeholder stages and one small real run of its kind of rank.

The composition (:mod:`llmem_plugin.methods.pp.compose`) replays a rank's
schedule from action templates keyed by context. Tracing a stand-in's
schedule with the real stages costs every one of its chunks through the
model's layers, and a stand-in needs many chunks to show every context. But
what depends on the context is the schedule's machinery, not the stage:

* a compute action (``F``, ``B``, ``I``, ``W``) runs the stage's forward or
  backward, whose allocations depend on the stage, its kind of action, whether
  it is the stage's first or last of that kind in the schedule step (FSDP2
  gathers at the first forward, the first backward allocates the gradients,
  the last reduces them) and the step; its context (the actions around it)
  only decides whether the boundary tensors the schedule still holds (the
  stage's output a held send keeps) go at its end;
* what runs between compute actions (P2P, the loss, the step's start and
  end) handles boundary tensors of one microbatch's shapes: the activations
  ``b x s x h``, the logits, the ids.

So a :class:`PlaceholderStage` (no layers: it turns its input into an output
of the stage's shape and dtype, with an autograd path back) runs the
stand-in's schedule at the cost of a few operations per chunk and gives every
context's machinery. One real run of a small pipeline whose rank holds
stages of the same kinds (:func:`class_pipeline`) gives each compute class's
template, which :func:`synthesise` places in every context: the real
template, its end moved by what the placeholder's template in that context
frees more or less than in the real run's context. Between-action templates
and the step's start come from the placeholder runs, the optimizer step from
the real one.

Checked where it runs: the real run's own contexts are synthesised from its
placeholder twin (the same pipeline and microbatches) and must equal what it
traced, template for template; otherwise, or where a context or class is
missing, :func:`synthesise` returns None and the rank is composed from real
stand-in runs instead. Against full traces in tests/methods/pp/test_pp_synth.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from llmem_plugin.methods.pp.compose import Template, Traced, VirtualPipeline, _keys_of, _stage_kinds, _valid
from llmem_plugin.methods.pp.schedule import stages_of_rank
from llmem_plugin.methods.pp.stage import StageSpec, action_segments, run_rank

__all__ = ["PlaceholderStage", "RealRun", "class_pipeline", "synthesise", "trace_placeholder_rank"]

# Largest pipeline searched for a rank kind's real run, and its longest schedule in rounds of its degree
# (as pp_compose's stand-in search).
_MAX_CLASS_DEGREE = 8
_MAX_CLASS_ROUNDS = 4


class PlaceholderStage(nn.Module):
    """A stage with no layers: its output has the real stage's shape and dtype (``b x s x h``, the logits
    ``b x s x vocab`` on the last stage), computed from its input through one scalar parameter so that a
    backward reaches the input (a non-first stage's input gradient, ``b x s x h``, as the real one's)."""

    def __init__(self, spec: StageSpec, *, hidden: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec, self.hidden, self.vocab = spec, hidden, vocab
        self.scale = nn.Parameter(torch.ones((), dtype=dtype, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.first:
            h = self.scale.expand(*x.shape, self.hidden) * 2
        else:
            h = x * self.scale
        if self.spec.last:
            h = (h[..., :1] * 2).expand(*h.shape[:-1], self.vocab).contiguous()
        return h


def trace_placeholder_rank(config: Any, loss_function: Any, specs: list[StageSpec], *, rank: int,
                           pipeline_degree: int, schedule: str, microbatches: int, micro_batch_size: int,
                           seq_len: int, dtype: torch.dtype, gpu: Any, return_outputs: bool,
                           accumulation: int) -> tuple[list[tuple[int, int, int]], list[tuple[str, int]]]:
    """Pipeline rank ``rank``'s two training steps with :class:`PlaceholderStage` stages, under the same
    schedule, fake process group and CUDA emulation as :func:`~llmem_plugin.methods.pp.rank.trace_rank`:
    (events, segments) as it names them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.emulation import cuda_emulation
    from llmem_plugin.methods._fakepg import fake_process_group
    from llmem_plugin.trace.tracker import MemoryTracker

    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    with fake_process_group(world_size=pipeline_degree, rank=rank):
        modules = [PlaceholderStage(sp, hidden=hidden, vocab=vocab, dtype=dtype) for sp in specs]
        fake_mode = FakeTensorMode()
        for m in modules:
            modelbuild.fakeify(m, fake_mode)
        tracker = MemoryTracker()
        on_action, segments_of = action_segments(tracker)
        emulation = cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability,
                                   num_sms=gpu.num_sms, mark=tracker.mark)
        model = SimpleNamespace(config=config, loss_function=loss_function)
        result = run_rank(model, specs, schedule=schedule, microbatches=microbatches,
                          micro_batch_size=micro_batch_size, seq_len=seq_len,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), tracker=tracker, fake_mode=fake_mode,
                          contexts=(emulation,), return_outputs=return_outputs, modules=modules,
                          on_action=on_action, accumulation=accumulation, activation_dtype=dtype)
        return result.events, segments_of(result)


def _positions(schedule: str, p: int, rank: int, v: int) -> dict[int, int]:
    """Each stage of the rank -> its position among the rank's stages."""
    return {s: i for i, s in enumerate(sorted(stages_of_rank(schedule, p, rank, v)))}


def _classes(schedule: str, p: int, m: int, v: int, rank: int) -> set[tuple]:
    pos = _positions(schedule, p, rank, v)
    return {(k[0], pos[k[1]], k[2], k[3]) for k in _keys_of(schedule, p, m, v, rank)}


def class_pipeline(schedule: str, p: int, m: int, v: int, rank: int) -> VirtualPipeline | None:
    """The small pipeline whose real run gives pipeline rank ``rank``'s compute templates: a rank holding
    stages of the same kinds (first, middle, last) in the same order, at the fewest microbatches whose
    schedule shows every (kind, stage, first, last of its kind) the real rank's has; the smallest such
    pipeline and count. None if none up to :data:`_MAX_CLASS_DEGREE` ranks does."""
    want = _stage_kinds(schedule, p, rank, v)
    need = _classes(schedule, p, m, v, rank)
    best = None
    for pt in range(2, min(p, _MAX_CLASS_DEGREE) + 1):
        for r in range(pt):
            if _stage_kinds(schedule, pt, r, v) != want:
                continue
            for c in range(1, min(m, _MAX_CLASS_ROUNDS * pt) + 1):
                if _valid(schedule, pt, c, v) and need <= _classes(schedule, pt, c, v, r):
                    if best is None or pt * c < best.degree * best.microbatches[0]:
                        best = VirtualPipeline(pt, r, (c, c))
                    break
        if best is not None:
            break
    return best


def _moved(real: Template, was: Template, now: Template) -> Template | None:
    """``real`` in the context where the placeholder's template is ``now`` instead of ``was``: unchanged where
    those are equal; its end moved by theirs where they differ only in their last part's end (a boundary
    tensor freed at the action's end, or not); None otherwise."""
    if was == now:
        return real
    if len(was.parts) != len(now.parts) or was.parts[:-1] != now.parts[:-1] or was.parts[-1][:2] != now.parts[-1][:2]:
        return None
    shift = now.parts[-1][2] - was.parts[-1][2]
    name, high, end = real.parts[-1]
    return Template(real.parts[:-1] + ((name, max(high, end + shift), end + shift),))


def _renamed(tpl: Template, to: dict[int, int]) -> Template:
    """Part names at a stage's root ("s2#1") renamed to the stage the template now serves."""
    parts = []
    for name, high, end in tpl.parts:
        head, hash_, count = name.partition("#")
        if head[:1] == "s" and head[1:].isdigit():
            name = f"s{to[int(head[1:])]}{hash_}{count}"
        parts.append((name, high, end))
    return Template(tuple(parts))


@dataclass(frozen=True)
class RealRun:
    """A rank kind's real run (:func:`class_pipeline`), cut and keyed, with its placeholder twin's keys."""

    start: int
    templates: dict[tuple, Template]
    twin: dict[tuple, Template]
    positions: dict[int, int]  # its stages -> their position on the rank


def synthesise(real: RealRun, stand_ins: list[dict[tuple, Template]], positions: dict[int, int]
               ) -> list[tuple[Traced, dict[tuple, Template]]] | None:
    """The stand-in's templates at each of its placeholder runs (``stand_ins``, keyed as
    :func:`~llmem_plugin.methods.pp.compose.templates` keys them, its stages at ``positions``) with the real
    stages' compute: each compute class's template from ``real`` moved into the context (:func:`_moved`),
    the rest the placeholder's, the optimizer step the real run's. None where the real run's own templates
    are not what its twin and its classes give, or a class or a step is missing."""
    def cls(key: tuple, at: dict[int, int]) -> tuple:
        return key[0], key[1], at[key[2]], key[3], key[4]

    # Classes the real stages shape: every compute action's, and a between-action's where the real run's
    # differs from its twin's (FSDP2's reduction of the last backward's gradients runs in the step's tail).
    shaped = set()
    for key, tpl in real.templates.items():
        twin = real.twin.get(key)
        if twin is None:
            return None
        if len(key) == 1:
            if not key[0].startswith("optimizer:") and twin != tpl:  # the step's start: its inputs and buffers
                return None
        elif not key[0].startswith("after-") or twin != tpl:
            shaped.add(cls(key, real.positions))
    refs: dict[tuple, tuple[Template, Template]] = {}
    for key, tpl in real.templates.items():
        if len(key) == 1 or cls(key, real.positions) not in shaped:
            continue
        c, twin = cls(key, real.positions), real.twin[key]
        if c not in refs:
            refs[c] = (tpl, twin)
        elif _moved(*refs[c], twin) != tpl:
            return None
    to_stand_in = {s: next(t for t, q in positions.items() if q == pos) for s, pos in real.positions.items()}
    to_real = {t: s for s, t in to_stand_in.items()}
    out = []
    for placeholder in stand_ins:
        tpls: dict[tuple, Template] = {}
        for key, tpl in placeholder.items():
            if len(key) == 1:
                if key[0].startswith("optimizer:"):
                    if key not in real.templates:
                        return None
                    tpls[key] = _renamed(real.templates[key], to_stand_in)
                else:
                    tpls[key] = tpl
                continue
            ref = refs.get(cls(key, positions))
            if ref is None:
                if not key[0].startswith("after-"):
                    return None
                tpls[key] = tpl
                continue
            moved = _moved(ref[0], ref[1], _renamed(tpl, to_real))
            if moved is None:
                return None
            tpls[key] = _renamed(moved, to_stand_in)
        out.append((Traced(real.start, []), tpls))
    return out
