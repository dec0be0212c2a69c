"""``benchmarks.groundtruth.stub_worker`` with a peak reset that keeps the allocator's cache.

The worker's ``_reset`` empties the cache before it resets the peaks
(``torch.cuda.empty_cache()``, as ``benchmarks/groundtruth/cuda.py`` does); a
training script usually does not. This entry point runs the same rank with
only ``gc.collect()``, ``synchronize()`` and ``reset_peak_memory_stats()``
(tests/stub/test_distributed.py: LowLevelZero's reserved peak either way).
Run in the stub environment: ``python -m tests.stub._keep_cache_worker SPEC``.
"""
from __future__ import annotations

import gc

from benchmarks.groundtruth import stub_worker


def _reset_keeping_the_cache() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    stub_worker._reset = _reset_keeping_the_cache
    stub_worker.main()
