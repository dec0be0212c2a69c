"""Errors raised by llmem_plugin.

Every user-facing error is one line that names the offending value, the valid
choices where there are some, and a hint to fix it. The CLI maps
:class:`LLMemError` to exit code 2 and prints only that line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ConfigError",
    "LLMemError",
    "TraceError",
    "UnsupportedError",
    "WontFitError",
    "tracing",
]


class LLMemError(ValueError):
    """Base class of every error caused by user input or an unsupported setup."""


class ConfigError(LLMemError):
    """A model source or workload setting is invalid (unknown name, bad value)."""


class UnsupportedError(LLMemError):
    """The request is valid but not modelled; never answered with a wrong number."""


class TraceError(LLMemError):
    """The model's training step could not be traced under fake tensors."""


class WontFitError(LLMemError):
    """No configuration of the job fits the GPUs. ``plan`` carries the full
    report: every candidate with its per-GPU memory, the closest ones, and
    the changes that were confirmed to make it fit (``plan.suggestions``);
    ``report`` carries another search's result (``llmem max``: the points
    estimated). The CLI exits with code 3 on it."""

    def __init__(self, message: str, *, plan: Any = None, report: Any = None) -> None:
        super().__init__(message)
        self.plan = plan
        self.report = report


@contextlib.contextmanager
def tracing(what: str) -> Iterator[None]:
    """Turn a failure of the model's own code under fake tensors into one
    :class:`TraceError` line naming ``what`` was traced; our own errors,
    missing packages and internal assertions pass through unchanged."""
    try:
        yield
    except (LLMemError, ImportError, AssertionError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TraceError(
            f"{what} could not be traced under fake tensors: {type(e).__name__}: {first}. HINT: CUDA-only custom "
            "ops and data-dependent shapes cannot be traced; use the model's eager/sdpa attention and a "
            "pure-PyTorch implementation"
        ) from e
