"""Method estimates side by side: one forked worker per core.

Each estimate is a trace under fake tensors in one Python thread, so a machine's
cores are used by running several estimates at once, each in a fork of this
process (its imported modules and built state come with it, nothing is
re-imported). The planner's screen (:mod:`llmem_plugin.planner.screen`) and
``llmem estimate --method all`` both run their estimates this way. Each worker
runs torch with one thread: the traces do no arithmetic, and one thread per
worker keeps them from competing for the cores.

Known limitations:
    Every worker holds its own trace: the peak host memory is the workers'
    count times one trace's (0.5 GB for a 70B full trace, measured in
    benchmarks/results/process-speed-2026-12-07.md); the count follows the
    cores, not the memory. Windows cannot fork: there everything runs in
    this process, one estimate at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["cores", "forked_map"]

T = TypeVar("T")


def cores() -> int:
    """The cores this process may use: its CPU affinity, less where a cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``: "QUOTA PERIOD", or "max") allows fewer (a container's CPU limit)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return n


def forked_map(fn: Callable[[Any], T], items: Sequence[Any], *, workers: int) -> list[T]:
    """``[fn(x) for x in items]``, in that order, over ``workers`` forked processes (in this process
    where one is enough, or where the platform cannot fork). ``fn`` must be a module-level function, and
    what it takes and returns must pickle: errors should come back as values. If a worker dies (killed
    for memory, say), the items run again here, one at a time."""
    import multiprocessing

    workers = min(workers, len(items))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(x) for x in items]
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_one_thread) as pool:
            return list(pool.map(fn, items))
    except BrokenProcessPool:
        return [fn(x) for x in items]


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)
