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
    count times one trace's (about 1.5 GB for a 70B full trace).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["cores", "forked_map"]

T = TypeVar("T")


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forked_map(fn: Callable[[Any], T], items: Sequence[Any], *, workers: int) -> list[T]:
    """``[fn(x) for x in items]``, in that order, over ``workers`` forked processes (in this process
    where one is enough). ``fn`` must be a module-level function, and what it takes and returns must
    pickle: errors should come back as values, since not every exception type crosses a process."""
    workers = min(workers, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, initializer=_one_thread) as pool:
        return pool.map(fn, items, chunksize=1)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)
