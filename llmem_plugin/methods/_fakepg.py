"""Run distributed wrappers (FSDP2, tensor parallel, DDP) in one process, with
no GPU and no real collectives: a fake process group for rank ``r`` of ``n``.

torch.testing._internal.distributed.fake_pg registers the "fake" backend: every
collective returns at once and leaves its output tensors as allocated. So the
wrappers allocate exactly what rank ``r`` allocates, which the tracker records.
Shared FACTS ("Distributed under a fake process group") gives the recipe and
its pitfalls: build device meshes outside ``FakeTensorMode``; and DTensor's
sharding propagation reuses the active fake mode, so its scratch tensors (full,
unsharded shapes) would be counted; :func:`isolated_sharding_propagation`
gives it a fake mode of its own, and the tracing tracker must also skip ops
that run under a fake mode other than the trace's (that fresh mode sits below
the tracker on the mode stack, so the tracker still sees its ops; see
``fsdp._ShardTracker``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["fake_process_group", "isolated_sharding_propagation"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make the default process group a fake one of ``world_size`` ranks, as ``rank``.

    Raises:
        RuntimeError: A default process group already exists (e.g. inside a
            real distributed job); the fake one would replace it.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized; estimate before init_process_group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def isolated_sharding_propagation() -> Iterator[None]:
    """Give DTensor's sharding propagation a private fake mode.

    ``ShardingPropagator._propagate_tensor_meta_non_cached`` (torch 2.13,
    torch/distributed/tensor/_sharding_prop.py) runs each op on fake copies of
    the *global* shapes under ``detect_fake_mode() or FakeTensorMode()``. Under
    our tracing fake mode those scratch tensors would be recorded as this
    rank's allocations; with detection disabled it makes a fresh mode, whose
    ops the tracker can then tell apart and skip.
    """
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original
