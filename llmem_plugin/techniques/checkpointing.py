"""Op-level selective activation checkpointing (SAC), traced for real.

A checkpointed layer normally keeps only its inputs and recomputes its whole
forward during backward. With an op-level policy, ``torch.utils.checkpoint``
(``create_selective_checkpoint_contexts``) keeps the outputs of chosen ATen ops
from the forward and hands them back during the recompute instead of running
those ops again. The estimator applies such a policy to transformers'
per-layer checkpointing (``context_fn`` in ``gradient_checkpointing_kwargs``)
and traces the step with it, so what is kept and what is recomputed is
torch's own doing.

A policy is a set of saved ops, or the ``torchtitan`` preset: torchtitan's
"selective op" AC (``torchtitan/models/llama3/infra/parallelize.py``
``_op_sac_save_list`` and ``torchtitan/distributed/activation_checkpoint.py``
``_apply_op_sac``, commit 018740b7): save the outputs of ``aten.mm``, the
flash / mem-efficient / cuDNN SDPA ops, ``_c10d_functional.reduce_scatter_tensor``
and ``aten.max``, except every second ``aten.mm`` of each layer, which is
recomputed. (That commit's ``per_op_sac_force_recompute_mm_shapes_by_fqns``
touches MoE router gates only; the name-based lists of later torchtitan
commits are per model and not a preset here.)

The estimator emulates CUDA's SDPA kernels on CPU (:mod:`.emulation.sdpa`),
so the policy would see the emulation's allocations, not the ATen SDPA op. The
emulation therefore marks the allocations of the op's outputs
(:func:`emulated_outputs`): the policy treats them as outputs of the ATen op
they stand for. When the op is saved, its recompute must not run the kernel's
workspace again; :func:`skip_workspace` tells the emulation so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from llmem_plugin.errors import ConfigError

__all__ = ["PRESETS", "SavePolicy", "emulated_outputs", "parse_save_ops", "policy_of", "skip_workspace"]

_MM = "aten.mm"
_TORCHTITAN_OPS = frozenset({
    _MM,
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
})


@dataclasses.dataclass(frozen=True)
class SavePolicy:
    """Which op outputs a checkpointed layer keeps.

    Attributes:
        name: The preset's name, or ``"ops"`` for a user's set.
        ops: Saved ops as ``namespace.op`` (the default overload).
        every_other_mm: Recompute every second ``aten.mm`` of each layer
            (torchtitan's rule: "saves output of all compute ops, except
            every second mm").
    """

    name: str
    ops: frozenset[str]
    every_other_mm: bool = False

    @property
    def spec(self) -> str:
        return self.name if self.name in PRESETS else ",".join(sorted(self.ops))

    def describe(self) -> str:
        ops = ", ".join(sorted(self.ops))
        if self.every_other_mm:
            return f"{self.name}: saves the outputs of {ops} (every second aten.mm recomputed)"
        return f"saves the outputs of {ops}"

    def context_fn(self) -> Callable[[], tuple]:
        """``context_fn`` for ``torch.utils.checkpoint``: fresh counters per checkpointed call.

        A job that checkpoints with it (e.g. ``TrainingArguments(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn":
        ...})``) has its policy read back by the adapters (:func:`policy_of`).
        """
        return _ContextFn(self)


class _ContextFn:
    def __init__(self, policy: SavePolicy) -> None:
        self.llmem_policy = policy

    def __call__(self) -> tuple:
        return _contexts(self.llmem_policy)

    def __repr__(self) -> str:
        return f"llmem_plugin.techniques.checkpointing context_fn ({self.llmem_policy.spec})"


def policy_of(checkpoint_kwargs: dict | None) -> str | None:
    """The save-ops spec of a job's checkpoint kwargs (None: no ``context_fn``, full recompute).

    Raises:
        UnsupportedError: A ``context_fn`` that is not one of this module's,
            whose policy cannot be read.
    """
    fn = (checkpoint_kwargs or {}).get("context_fn")
    if fn is None:
        return None
    policy = getattr(fn, "llmem_policy", None)
    if not isinstance(policy, SavePolicy):
        from llmem_plugin.errors import UnsupportedError

        raise UnsupportedError(f"the checkpointing context_fn {fn!r} is a policy the estimator cannot read. "
                               "HINT: build it with llmem_plugin.techniques.checkpointing.parse_save_ops('torchtitan')"
                               ".context_fn() (or your op list) so the estimate traces the same policy")
    return policy.spec


PRESETS = {"torchtitan": SavePolicy("torchtitan", _TORCHTITAN_OPS, every_other_mm=True)}


def _resolve(name: str) -> str:
    """``namespace.op`` of a torch op, or ConfigError."""
    parts = name.split(".")
    if len(parts) == 3 and parts[2] == "default":
        parts = parts[:2]
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"checkpoint save op {name!r} is not a torch op name. HINT: write it as namespace.op, "
                          f"e.g. aten.mm or aten._scaled_dot_product_flash_attention, or use a preset: "
                          f"{', '.join(PRESETS)}")
    namespace, op = parts
    try:
        getattr(getattr(torch.ops, namespace), op).default
    except (AttributeError, RuntimeError):
        raise ConfigError(f"checkpoint save op {name!r} is not an op this torch has (no torch.ops.{namespace}.{op}"
                          ".default). HINT: check the spelling, e.g. aten.mm") from None
    return f"{namespace}.{op}"


def parse_save_ops(spec: str | SavePolicy) -> SavePolicy:
    """A preset name or a comma-separated op list, as a :class:`SavePolicy`.

    Raises:
        ConfigError: Empty, unknown preset, or an op torch does not have.
    """
    if isinstance(spec, SavePolicy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"checkpoint save ops must be a preset ({', '.join(PRESETS)}) or a comma-separated op "
                          f"list, got {spec!r}. HINT: pass --checkpoint-save-ops torchtitan")
    spec = spec.strip()
    if spec in PRESETS:
        return PRESETS[spec]
    ops = frozenset(_resolve(part.strip()) for part in spec.split(",") if part.strip())
    if not ops:
        raise ConfigError(f"checkpoint save ops {spec!r} names no op. HINT: pass --checkpoint-save-ops torchtitan")
    return SavePolicy("ops", ops)


# ----------------------------------------------------------------------------- policy

_emulated: list[str] = []  # ATen ops whose outputs an emulation is allocating now
_recomputing: list[frozenset[str]] = []  # saved-op sets of the regions being recomputed


def _op_name(func) -> str:
    name = getattr(func, "name", None)  # OpOverload.name(): "aten::mm"
    if callable(name):
        return name().replace("::", ".")
    return str(func)


class _Policy:
    """torch's SAC policy: called per op of a checkpointed forward."""

    def __init__(self, policy: SavePolicy) -> None:
        self.policy = policy
        self.mm = {"forward": 0, "recompute": 0}  # torchtitan counts per mode

    def __call__(self, ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        name = _emulated[-1] if _emulated else _op_name(func)
        mode = "recompute" if getattr(ctx, "is_recompute", False) else "forward"
        if name == _MM:
            self.mm[mode] += 1
        save = name in self.policy.ops and not (
            self.policy.every_other_mm and name == _MM and self.mm[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


class _Recompute:
    """The recompute context, noting which ops come from the cache meanwhile."""

    def __init__(self, inner, ops: frozenset[str]) -> None:
        self.inner, self.ops = inner, ops

    def __enter__(self):
        _recomputing.append(self.ops)
        try:
            return self.inner.__enter__()
        except BaseException:
            _recomputing.pop()
            raise

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            _recomputing.pop()


def _contexts(policy: SavePolicy) -> tuple:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, recompute = create_selective_checkpoint_contexts(_Policy(policy))
    return forward, _Recompute(recompute, policy.ops)


@contextlib.contextmanager
def emulated_outputs(op: str) -> Iterator[None]:
    """Within this block, allocations are outputs of the ATen op ``op`` (``namespace.op``)."""
    _emulated.append(op)
    try:
        yield
    finally:
        _emulated.pop()


def skip_workspace(op: str) -> bool:
    """True while recomputing a checkpointed layer whose policy saves ``op``.

    The real op is then not run at all (its outputs come from the cache), so
    an emulation allocates its workspaces with zero size: the same ops in the
    same order, which SAC's per-op cache indices rely on, and no bytes.
    """
    return bool(_recomputing) and op in _recomputing[-1]
