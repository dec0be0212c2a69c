"""llmem_plugin.methods.parallel: results in order from forked workers, and a dead worker's items run again
in this process rather than hanging the command."""

from __future__ import annotations

import os

from llmem_plugin.methods.parallel import forked_map

PARENT = os.getpid()


def _square_with_pid(x: int) -> tuple[int, bool]:
    return x * x, os.getpid() == PARENT


def _dies_in_a_worker(x: int) -> int:
    if os.getpid() != PARENT:
        os._exit(1)  # as the kernel's OOM killer ends a worker
    return -x


def test_results_come_back_in_order_from_the_workers():
    out = forked_map(_square_with_pid, list(range(6)), workers=2)
    assert [v for v, _ in out] == [x * x for x in range(6)]
    assert not any(here for _, here in out)  # each ran in a worker
    assert forked_map(_square_with_pid, [3], workers=2) == [(9, True)]  # one item: no worker started


def test_a_dead_worker_falls_back_to_this_process():
    assert forked_map(_dies_in_a_worker, [1, 2, 3], workers=2) == [-1, -2, -3]
