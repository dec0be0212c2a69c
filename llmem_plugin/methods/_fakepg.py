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

__all__ = ["fake_process_group", "isolated_sharding_propagation", "real_process_groups_set_aside"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make the default process group a fake one of ``world_size`` ranks, as ``rank``.

    Inside a real distributed job (after ``init_process_group``) the job's
    groups are set aside meanwhile and restored after
    (:func:`real_process_groups_set_aside`).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with real_process_groups_set_aside():
        _clear_dtensor_caches()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
            _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans.

    Their keys hold ``DTensorSpec``s, whose meshes compare equal when their
    shapes, ranks and dimension names do (torch 2.13 device_mesh.py,
    ``DeviceMesh.__eq__``), not their process groups: a plan cached under one
    fake group would name that group's communicators inside the next one
    ("Could not resolve the process group registered under the name ...")
    once the group names move (another world size in between). The caches
    are the C++ dispatch fast path's and torch/distributed/tensor/_sharding_prop.py's
    ``ShardingPropagator.propagate_op_sharding`` (both cleared by
    torch/distributed/tensor/debug's ``_clear_sharding_prop_cache``),
    ``_propagate_tensor_meta_cached``, and _redistribute.py's
    ``_gen_transform_infos`` and its planner cache.
    """
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # nothing cached yet; the import costs half a second
        return
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@contextlib.contextmanager
def real_process_groups_set_aside() -> Iterator[None]:
    """Hide a real job's process groups while an estimate runs in this process.

    ``init_process_group`` refuses to replace a default group, and the fake
    group's ``destroy_process_group()`` would shut down and unregister every
    group in c10d's tables. So the tables are emptied here and restored
    afterwards (torch 2.13 distributed_c10d.py: ``_world``,
    ``_update_default_pg``, ``_register_process_group``). No collective of the
    job may run meanwhile: the estimate is local to this process. A no-op
    when no group is initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    from torch._C._distributed_c10d import (
        _register_process_group,
        _unregister_process_group,
    )

    c10d = dist.distributed_c10d
    w = c10d._world
    tables = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "pg_coalesce_state")
    saved = {name: dict(getattr(w, name)) for name in tables}
    tags = {tag: list(pgs) for tag, pgs in w.tags_to_pg.items()}
    default, count = w.default_pg, w.group_count
    for name in saved["pg_names"].values():
        _unregister_process_group(name)
    for name in tables:
        getattr(w, name).clear()
    w.tags_to_pg.clear()
    c10d._update_default_pg(None)
    w.group_count = 0
    try:
        yield
    finally:
        if dist.is_initialized():  # a group the estimate left: not the job's to keep
            dist.destroy_process_group()
        for name in tables:
            getattr(w, name).clear()
            getattr(w, name).update(saved[name])
        w.tags_to_pg.clear()
        w.tags_to_pg.update(tags)
        w.group_count = count
        for pg, name in saved["pg_names"].items():
            _register_process_group(name, pg)
        c10d._update_default_pg(default)


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
