"""A repeated ``llmem estimate``, ``llmem plan`` or ``llmem max`` answered before torch is imported.

The trace cache (:mod:`llmem_plugin.trace.cache`) saves the traces, but a run
that hits it still imports torch and transformers' modeling code to build the
model and check the options: seconds on a small machine. A command run again
with the same options on the same inputs prints the same report, so the
report itself is kept, under a key of everything the command reads:

* the command line, before and after ``--config`` is expanded;
* the content of every file the command line names (``--config``,
  ``--model path``, ``litgpt:DIR``, ``--model-config``, ``--deepspeed-config``,
  ``--seq-lens`` files), and of a named folder's files (the small ones by
  content, weights by size and time); a pipe or another non-file is never
  kept (it reads differently every time). The files are hashed again after
  the run: one that changed meanwhile keeps nothing;
* the environment variables the estimate reads (``LLMEM_*`` except the
  cache's own, ``PYTORCH_CUDA_ALLOC_CONF``, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``,
  ``CUBLAS_WORKSPACE_CONFIG``) and those that decide how rich draws the
  report (``COLUMNS``, ``NO_COLOR``, ``TERM``, ...), with what rich resolves
  from them (terminal, colours, width) and rich's version;
* the versions of Python and of the libraries a trace runs, and a digest of
  every file of this package (its code and its catalogs).

A command whose answer depends on the machine it runs on is never kept:
``plan`` without ``--gpus`` or ``--gpu`` (it counts this machine's GPUs), ``--host-memory
local``, a ``--model`` that is neither a catalog name, a ``litgpt:`` name nor
an existing path (a Hub id read from the local Hub cache), and commands that
write files (``--plot``, ``--snapshot``, ``--html``). Only answers are kept (exit 0, or 3 for "does not
fit"); bad input (exit 2) is refused anew every time.

A plan whose search for changes failed part-way is not kept
(:func:`llmem_plugin.trace.cache.answer_not_kept`): that failure may not
recur. What is kept: stdout, the ``llmem:`` lines written to stderr (warnings, the
"does not fit" line; not the progress lines of a long plan), and the exit
code. A replayed answer adds one line on stderr saying so, with when it was
computed; ``--no-cache`` or ``LLMEM_NO_CACHE=1`` computes it anew.

The entries live in the trace cache's folder and share its size bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["Answer", "capture", "inputs_digest", "lookup", "replay", "result_key", "store"]

_COMMANDS = ("estimate", "plan", "max")
# Variables the estimate or the report reads, beside the LLMEM_* ones.
_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_CUDNN_SDPA_DEPRIORITIZED", "CUBLAS_WORKSPACE_CONFIG", "COLUMNS", "LINES",
        "NO_COLOR", "FORCE_COLOR", "TERM", "COLORTERM", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS")
# A folder the command line names: its small files are hashed by content, larger ones (weights) by name, size
# and modification time.
_SMALL_FILE = 1 << 20
# LLMEM_* variables that decide where and whether answers are kept, not what they are.
_CACHE_ENV = ("LLMEM_CACHE_DIR", "LLMEM_CACHE_SIZE", "LLMEM_NO_CACHE")
# A long plan's progress lines (llmem_plugin/cli/plan.py): "llmem: [12 s] ...", true of that run only.
_PROGRESS = re.compile(r"^llmem: \[\d+ s\] ")


@dataclasses.dataclass(frozen=True)
class Answer:
    """A command's answer as printed: stdout, its ``llmem:`` stderr lines, the exit code, when computed."""

    stdout: str
    stderr: str
    code: int
    computed_at: float


def result_key(raw_argv: Sequence[str], argv: Sequence[str], args) -> str | None:
    """The key of this command's answer, or None where it is not kept (see the module docstring)."""
    from llmem_plugin.trace.cache import default_cache

    if getattr(args, "command", None) not in _COMMANDS or getattr(args, "no_cache", False):
        return None
    if default_cache() is None or not _machine_free(args):
        return None
    files = inputs_digest(raw_argv, argv)
    if files is None:
        return None
    payload = {
        "kind": "answer", "raw_argv": list(raw_argv), "argv": list(argv), "files": files,
        "env": {k: v for k, v in sorted(os.environ.items())
                if (k.startswith("LLMEM_") and k not in _CACHE_ENV) or k in _ENV},
        "tty": _terminal(), "versions": _versions(), "package": _package_digest(),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def inputs_digest(raw_argv: Sequence[str], argv: Sequence[str]) -> dict[str, str] | None:
    """The digest of every file or folder the command line names, by the value naming it (``litgpt:DIR``
    names DIR); None where one is neither a file nor a folder (a pipe: read once, never the same twice)."""
    files = {}
    for token in (*raw_argv, *argv):
        value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
        value = value.removeprefix("litgpt:")
        try:
            digest = _path_digest(value)
        except _NotAFile:
            return None
        if digest is not None:
            files[value] = digest
    return files


def lookup(key: str) -> Answer | None:
    """The answer kept under ``key``, or None."""
    from llmem_plugin.trace.cache import default_cache

    cache = default_cache()
    value = cache.get(key) if cache is not None else None
    return value if isinstance(value, Answer) else None


def store(key: str, answer: Answer) -> None:
    """Keep ``answer`` under ``key`` (only answers: exit 0 or 3)."""
    from llmem_plugin.trace.cache import default_cache

    from llmem_plugin.trace.cache import answer_kept

    cache = default_cache()
    if cache is not None and answer.code in (0, 3) and answer_kept():
        cache.put(key, answer)


def replay(answer: Answer) -> int:
    """Print a kept answer as it was printed, and one line on stderr saying it was kept; its exit code."""
    sys.stdout.write(answer.stdout)
    sys.stdout.flush()
    sys.stderr.write(answer.stderr)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(answer.computed_at))
    print(f"llmem: the same command on the same inputs and versions was answered at {when}; this is that "
          "answer (--no-cache computes it anew)", file=sys.stderr)
    return answer.code


@contextlib.contextmanager
def capture() -> Iterator[list[str]]:
    """Copy what the block writes to stdout and stderr; yields ``[stdout, stderr]``, filled on exit.

    The writes still reach the terminal as they happen. Only stderr lines that
    start with ``llmem:`` are kept, less a plan's progress lines: third-party
    libraries' import-time warnings are not part of the answer.
    """
    from llmem_plugin.trace.cache import answer_kept

    answer_kept(reset=True)
    out, err = _Tee(sys.stdout), _Tee(sys.stderr)
    result = ["", ""]
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield result
    finally:
        sys.stdout, sys.stderr = old
        result[0] = out.copy.getvalue()
        lines = err.copy.getvalue().splitlines(keepends=True)
        result[1] = "".join(line for line in lines if line.startswith("llmem:") and not _PROGRESS.match(line))


class _Tee(io.TextIOBase):
    """Writes go to ``stream`` and to ``copy``; a terminal stays a terminal (``isatty``)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        with contextlib.suppress(ValueError):  # a stream closed under us: nothing left to flush
            self.stream.flush()

    def close(self) -> None:  # the real stream is not ours to close
        pass

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self):  # rich and print read it
        return getattr(self.stream, "encoding", "utf-8")

    def fileno(self) -> int:
        return self.stream.fileno()


def _machine_free(args) -> bool:
    """Whether the command's answer is independent of this machine (see the module docstring)."""
    host = getattr(args, "host_memory", None)
    if getattr(args, "plot", None) or getattr(args, "snapshot", None) or getattr(args, "html", None) \
            or (isinstance(host, str) and host.strip().lower() == "local"):
        return False  # the same test as llmem_plugin.device.host.resolve_host_memory's
    if args.command == "plan" and getattr(args, "gpus", None) is None and getattr(args, "gpu", None) is None:
        return False  # this machine's GPUs (llmem_plugin/cli/plan.py, _plan_target)
    model = getattr(args, "model", None)
    if model is None:
        return True
    from llmem_plugin.models.catalog import lookup as catalog_lookup

    return (catalog_lookup(model) is not None or model.startswith("litgpt:")
            or os.path.exists(os.path.expanduser(model)))


class _NotAFile(Exception):
    """A path the command line names that is neither a regular file nor a folder."""


def _path_digest(value: str) -> str | None:
    """SHA-256 of the file ``value`` names, or of the folder's files (see ``_SMALL_FILE``); None where it
    names nothing.

    Raises:
        _NotAFile: It names a pipe, a device or a socket.
    """
    if not value or value.startswith("-") or len(value) > 4096:
        return None
    path = Path(os.path.expanduser(value))
    try:
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest()
        if path.is_dir():
            h = hashlib.sha256()
            for p in sorted(path.iterdir()):
                st = p.stat()
                h.update(p.name.encode() + b"\0")
                if p.is_file() and st.st_size <= _SMALL_FILE:
                    h.update(p.read_bytes())
                else:
                    h.update(f"{st.st_size}:{st.st_mtime_ns}:{p.is_dir()}".encode())
            return h.hexdigest()
        if path.exists():
            raise _NotAFile(value)
    except (OSError, ValueError):
        return None
    return None


def _terminal() -> list:
    """How rich draws the report here: whether it writes to a terminal, its colours and width
    (rich reads the size from stdin, stdout or stderr), and rich's version."""
    from importlib import metadata

    from rich.console import Console

    console = Console()
    try:
        rich_version = metadata.version("rich")
    except metadata.PackageNotFoundError:
        rich_version = None
    return [console.is_terminal, console.color_system, console.width, sys.stdout.isatty(), rich_version]


def _versions() -> dict[str, str | None]:
    """Python's and the traced libraries' versions (:func:`llmem_plugin.trace.cache.library_versions`)."""
    from llmem_plugin.trace.cache import library_versions

    return {"python": sys.version, **library_versions()}


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    """SHA-256 over every file of this package (code, catalogs, data) by relative path and content."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()
