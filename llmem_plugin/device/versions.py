"""Torch versions whose device overheads are modelled, and the check of a
user-given version. Imports no torch, so the CLI can refuse a bad value
before it loads torch."""

from __future__ import annotations

import re

from llmem_plugin.errors import ConfigError

__all__ = ["TORCH_VERSIONS_MODELLED", "check_torch_version", "torch_minor"]

# pyproject's floor (torch>=2.6) to the installed line read for the allocator
# and workspaces (docs/allocator.md: cuBLAS workspace rows cover 2.6 to 2.13).
TORCH_VERSIONS_MODELLED = ((2, 6), (2, 13))

_VERSION = re.compile(r"(\d{1,3})\.(\d{1,3})(?:\.\d{1,3})?(?:[+.a-z0-9]*)?", re.IGNORECASE)


def check_torch_version(text: str, *, name: str = "--torch-version") -> tuple[int, int]:
    """``(major, minor)`` of ``text``, a torch version inside the modelled range.

    Raises:
        ConfigError: Not a version, or outside ``TORCH_VERSIONS_MODELLED``.
    """
    low, high = (".".join(map(str, v)) for v in TORCH_VERSIONS_MODELLED)
    m = _VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"{name} {text!r} is not a torch version. HINT: e.g. {name} 2.13.0 "
                          f"(modelled: {low} to {high})")
    version = (int(m.group(1)), int(m.group(2)))
    if not TORCH_VERSIONS_MODELLED[0] <= version <= TORCH_VERSIONS_MODELLED[1]:
        raise ConfigError(f"{name} {text} is outside the modelled range {low} to {high}: its allocator "
                          f"and workspace sizes are not modelled. HINT: pass a version from {low} to {high}")
    return version


def torch_minor(text: str | None) -> tuple[int, int]:
    """``(major, minor)`` of the torch the job runs: ``text`` checked as :func:`check_torch_version`
    checks a user's value (``torch_version``), or the installed torch's where None."""
    if text is not None:
        return check_torch_version(text, name="torch_version")
    import torch

    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    assert m, f"unparseable installed torch version {torch.__version__!r}"
    return int(m.group(1)), int(m.group(2))
