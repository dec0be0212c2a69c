"""Traces kept on disk between runs, keyed by everything that decides them.

A trace is the slow part of an estimate (seconds to minutes under fake
tensors); the same model, workload and GPU trace the same stream every time.
:class:`TraceCache` keeps each traced result in one file under the user's
cache directory, named by a SHA-256 key over:

* what the caller traced (the model's config as JSON, the workload, the GPU,
  the allocator settings, the device overheads, fast mode, ...);
* the global switches a trace reads (SDPA's backend flags,
  :func:`llmem_plugin.trace.loading.direct_only`, and the environment
  variables in :data:`_TRACE_ENV`);
* the versions of the libraries whose code runs in the trace (torch,
  transformers, peft, bitsandbytes, torchao, litgpt, accelerate) and of
  Python;
* this package's own code: a digest of every ``.py`` file under
  ``llmem_plugin`` (a checkout's edits change no version number).

Where: ``$LLMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmem``, else
``~/.cache/llmem`` (the XDG base-directory default). ``LLMEM_NO_CACHE=1`` or
:func:`disabled` (``--no-cache``) turns it off. The files' total size is kept
under ``$LLMEM_CACHE_SIZE`` (default :data:`DEFAULT_MAX_BYTES`), the least
recently used removed first.

A file that cannot be read back, was cut short, or holds another key is a
miss (and is removed); it can never be taken for the entry asked for. Writes
go to a temporary file in the same folder, then ``os.replace``: two writers
of one key each leave a whole file, never a mixed one.

Known limitations:
    Only the caller's key decides a hit: a value that changes a trace and is
    not in the key (a monkeypatched function, an environment variable the
    model code reads) gives a stale entry. The test suite turns the cache off
    (tests/conftest.py) for that reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "LIBRARIES", "TraceCache", "answer_kept", "answer_not_kept", "cache_dir", "default_cache",
           "disabled", "library_versions", "make_key"]

# The files' total size kept by default: a full 8B trace takes about 2 MiB, a 70B one about 20 MiB.
DEFAULT_MAX_BYTES = 2 << 30
# The first bytes of every entry, with the format's version: another file is a miss.
_MAGIC = b"LLMEM-TRACE-1\n"
# Libraries whose code runs inside a trace: their versions are part of every key.
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "torchao", "litgpt", "accelerate")
# Environment variables a trace reads (llmem_plugin/trace/emulation/sdpa.py: torch's SDPA backend order).
# CUBLAS_WORKSPACE_CONFIG: the workspaces replayed into every trace (llmem_plugin/device/overheads.py).
_TRACE_ENV = ("TORCH_CUDNN_SDPA_DEPRIORITIZED", "CUBLAS_WORKSPACE_CONFIG")

_disabled = [False]
_answer_unkept = [False]


def answer_not_kept() -> None:
    """The command's answer this time depends on a failure that may not recur (a plan's search for changes
    failed part-way): :mod:`llmem_plugin.cli.resultcache` must not keep it."""
    _answer_unkept[0] = True


def answer_kept(*, reset: bool = False) -> bool:
    """Whether the command's answer may be kept (see :func:`answer_not_kept`); ``reset``: start a new command."""
    if reset:
        _answer_unkept[0] = False
    return not _answer_unkept[0]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block :func:`default_cache` is None: nothing is read or written (``--no-cache``)."""
    _disabled.append(True)
    try:
        yield
    finally:
        _disabled.pop()


def cache_dir() -> Path:
    """``$LLMEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmem``, else ``~/.cache/llmem``."""
    explicit = os.environ.get("LLMEM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmem"


def default_cache() -> TraceCache | None:
    """The user's cache, or None where it is turned off (``LLMEM_NO_CACHE``, :func:`disabled`).

    Raises:
        ConfigError: ``LLMEM_CACHE_SIZE`` is not a size.
    """
    if _disabled[-1] or os.environ.get("LLMEM_NO_CACHE", "").strip() not in ("", "0"):
        return None
    size = os.environ.get("LLMEM_CACHE_SIZE")
    if size is None:
        return TraceCache(cache_dir())
    from llmem_plugin.device.gpus import size_bytes

    max_bytes = size_bytes(size, name="LLMEM_CACHE_SIZE", what="LLMEM_CACHE_SIZE (the trace cache's size)",
                           example="4GiB")
    return TraceCache(cache_dir(), max_bytes=max_bytes)


def make_key(kind: str, parts: dict[str, Any]) -> str:
    """The SHA-256 key of a trace: ``kind``, the caller's ``parts``, the SDPA switches, the library
    versions and this package's code (see the module docstring)."""
    from llmem_plugin.trace.loading import direct_only_active

    payload = {"kind": kind, "parts": parts, "sdpa": _sdpa_switches(), "env": _environment(),
               "variables": {name: os.environ.get(name) for name in _TRACE_ENV},
               "direct_only": direct_only_active()}
    text = json.dumps(payload, sort_keys=True, default=_plain, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> Any:
    """JSON for what the key's parts hold: dataclasses, enums, dtypes, tuples, sets."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    return repr(value)


def _sdpa_switches() -> list[bool]:
    """torch.backends.cuda's SDPA backend flags: the trace's attention follows them."""
    import torch

    b = torch.backends.cuda
    return [b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled()]


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str | None]:
    """The installed versions of :data:`LIBRARIES` (None: not installed)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.lru_cache(maxsize=1)
def _environment() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "versions": library_versions(), "code": _code_digest()}


def _code_digest() -> str:
    """SHA-256 over this package's ``.py`` files, by relative path and content."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


class TraceCache:
    """Pickled trace results in ``root``, one file per key, at most ``max_bytes`` in all.

    Args:
        root: The folder (made on the first write).
        max_bytes: The files' total size kept; past it the least recently used go.

    Known limitations:
        Entries are pickles, read back only from the user's own cache folder;
        a folder others can write to should not be used.
    """

    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        return self.root / "traces" / key[:2] / f"{key}.pkl"

    def get(self, key: str) -> Any | None:
        """The value stored under ``key``, or None (a miss: absent, unreadable, or another key's)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                if f.read(len(_MAGIC)) != _MAGIC or f.read(len(key) + 1) != key.encode() + b"\n":
                    raise ValueError("not this key's entry")
                value = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:  # cut short, another format, a class that no longer unpickles: a miss
            _remove(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the size bound removes others first
        return value

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key`` (atomically), then keep the folder under ``max_bytes``.
        A folder that cannot be written is skipped: the cache only ever saves time."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_MAGIC + key.encode() + b"\n")
                    pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, path)
            except BaseException:
                _remove(Path(tmp))
                raise
        except OSError:
            return
        self.trim()

    def trim(self) -> None:
        """Remove the least recently used entries until the total is at most ``max_bytes``."""
        entries = []
        for p in (self.root / "traces").glob("*/*.pkl"):
            with contextlib.suppress(OSError):
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            _remove(p)
            total -= size


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
