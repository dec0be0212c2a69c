"""Launch a real multi-process gloo run on this CPU: one Python process per
rank, with the environment torchrun would set, and collect each rank's stdout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Ranks meet at a barrier, then leave with os._exit: a normal interpreter exit
# runs C++ static destructors, and a still-joinable std::thread among them (gloo's
# or DeepSpeed's) aborts the process with "terminate called without an active
# exception" after the worker's result was already printed.
_EPILOGUE = """
import os as _os, sys as _sys
import torch.distributed as _dist
_sys.stdout.flush()
_sys.stderr.flush()
if _dist.is_initialized():
    _dist.barrier()
_os._exit(0)
"""


def run_gloo(tmp_path, worker_source: str, *, world: int, env: dict[str, str] | None = None,
             timeout: int = 300) -> list[str]:
    """Run ``worker_source`` as ``world`` ranks; return their stdouts in rank order.

    The worker finds the repository in ``$REPO``. Fails the test with the
    ranks' stderr tails if any rank exits non-zero.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(worker_source + _EPILOGUE)
    procs = []
    for rank in range(world):
        rank_env = {**os.environ, "REPO": REPO, "RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(err[-2000:] for _, err in outs)
    return [out for out, _ in outs]


def settle_functional_waits(pause_s: float = 0.003) -> None:
    """In a gloo worker: pause briefly after each functional collective's wait.

    gloo's worker thread wakes the waiter first and drops its reference to the
    finished work's tensors just after; the pause lets it, so a collective's
    buffers are freed where the main thread leaves them (as NCCL's work
    releases them at ``wait()``), not by thread timing.
    """
    import time

    import torch.distributed._functional_collectives as funcol

    wait = funcol.wait_tensor

    def wait_and_settle(t):
        out = wait(t)
        time.sleep(pause_s)
        return out

    funcol.wait_tensor = wait_and_settle
