"""Errors raised by llmem_plugin.

Every user-facing error is one line that names the offending value, the valid
choices where there are some, and a hint to fix it. The CLI maps
:class:`LLMemError` to exit code 2 and prints only that line.
"""

from __future__ import annotations

__all__ = [
    "LLMemError",
    "ConfigError",
    "UnsupportedError",
    "TraceError",
]


class LLMemError(ValueError):
    """Base class of every error caused by user input or an unsupported setup."""


class ConfigError(LLMemError):
    """A model source or workload setting is invalid (unknown name, bad value)."""


class UnsupportedError(LLMemError):
    """The request is valid but not modelled; never answered with a wrong number."""


class TraceError(LLMemError):
    """The model's training step could not be traced under fake tensors."""
