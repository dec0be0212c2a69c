"""Start Python processes on the stub CUDA device.

The stub environment (``.stubvenv``, torch's CUDA build) and the stand-in
libraries (``stubcuda/build``) are made by ``stubcuda/setup.sh``; this module
only runs commands there through ``stubcuda/run``, so the environment a test
sees is the one a user gets from the two-line recipe in the README.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["EXIT", "REQUIRE_ENV", "ROOT", "StubUnavailable", "missing", "run_json", "run_python"]

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "stubcuda" / "run"
VENV_PYTHON = ROOT / ".stubvenv" / "bin" / "python"
BUILD = ROOT / "stubcuda" / "build"
# Set by .ci/run: a missing stub environment fails the stub tests instead of
# skipping them.
REQUIRE_ENV = "LLMEM_REQUIRE_STUB"


# End of a stub script: flush and leave without interpreter finalization. On the
# stub every kernel is instant, so a script that ends right after backward()
# can reach finalization while autograd's device thread is still releasing the
# graph; that thread then takes the GIL during finalization and the process
# aborts ("terminate called without an active exception"), after its output.
EXIT = "import os as _os, sys as _sys; _sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)"


class StubUnavailable(RuntimeError):
    """The stub environment has not been built here."""


def missing() -> str | None:
    """Why the stub device cannot run here, or None when it can."""
    if not VENV_PYTHON.exists():
        return f"{VENV_PYTHON} does not exist. HINT: run stubcuda/setup.sh"
    if not (BUILD / "libcudart.so.13").exists():
        return f"{BUILD} has no stand-in libraries. HINT: run stubcuda/setup.sh"
    return None


def run_python(args: Sequence[str], *, gpu: str = "h100-sxm", capacity: int | None = None,
               env: Mapping[str, str] | None = None, timeout_s: float = 600.0,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``python ARGS...`` on the stub device and return the finished process.

    Args:
        args: Arguments after ``python`` (``["-c", code]``, ``["-m", mod, ...]``).
        gpu: A catalog GPU name whose properties the device reports.
        capacity: Bytes cudaMalloc and cuMemCreate may hand out (default: the
            device memory).
        env: Extra environment variables (``PYTORCH_CUDA_ALLOC_CONF``...).
        timeout_s: Wall-clock limit.

    Raises:
        StubUnavailable: The stub environment is not built.
    """
    why = missing()
    if why:
        raise StubUnavailable(why)
    cmd = [str(RUN), "--gpu", gpu]
    if capacity is not None:
        cmd += ["--capacity", str(int(capacity))]
    cmd += ["--", str(VENV_PYTHON), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("STUBCUDA_")}
    full_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout_s)


def run_json(args: Sequence[str], **kwargs) -> object:
    """:func:`run_python`, then parse the last stdout line as JSON.

    Raises:
        StubUnavailable: The stub environment is not built.
        RuntimeError: The process failed; the message carries its stderr tail.
    """
    proc = run_python(args, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"stub run failed (rc {proc.returncode}): {proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines:
        raise RuntimeError(f"stub run printed nothing: {proc.stderr[-4000:]}")
    return json.loads(lines[-1])
