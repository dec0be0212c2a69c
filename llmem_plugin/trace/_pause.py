"""A process-wide switch that suspends allocation tracking.

Emulations of CUDA kernels compute real values on real CPU tensors (so that a
real CPU run still trains) with CPU kernels whose scratch memory is not what
the CUDA kernel allocates. They run that computation inside :func:`untracked`
and then allocate exactly the CUDA kernel's outputs and workspaces outside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["untracked", "is_paused"]

_depth = 0


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Within this block no storage allocated is recorded by any tracker.

    Storages allocated inside the block and still alive after it stay
    invisible to the tracker, so callers must free (or copy out of) them.
    """
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_paused() -> bool:
    """True while some caller is inside :func:`untracked`."""
    return _depth > 0
