"""The adapters' snapshots: the real allocator history of the first steps beside the predicted one.

With ``snapshot_dir`` set (off by default: recording the history slows
every allocation), the HF callback and the Lightning strategy

* turn on ``torch.cuda.memory._record_memory_history()`` before the first
  forward and, after the steps they compare, dump the real snapshot and stop
  recording;
* write the predicted snapshot of the same job beside it
  (:func:`llmem_plugin.snapshot.predict.snapshot_of`; a distributed method's:
  this rank's, :func:`llmem_plugin.snapshot.predict.method_snapshots`) and the comparison of the
  two (:func:`llmem_plugin.snapshot.compare.compare_snapshots`), as text and JSON;
* on ``torch.OutOfMemoryError`` during training, dump what the allocator
  held (with the history, if still recording), write the predicted snapshot
  and the comparison, and print the predicted breakdown next to what was
  live. The exception is then raised on, unchanged: the job fails as it would have.

Files, in ``snapshot_dir``: ``real-rank{R}.pickle``, ``predicted-rank{R}.pickle``,
``compare-rank{R}.txt`` and ``compare-rank{R}.json`` (``oom-`` before each
name when written on an out-of-memory error).

Under a distributed method the predicted snapshot is this rank's
(:func:`llmem_plugin.integrations._common.predicted_snapshot`: the method traced
again, its ranks' histories).

Known limitations:
    * Where the method traces several distinct ranks and this one is not
      among them, no predicted snapshot is written (the real one is): which
      traced rank it is alike to is not reported.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_ENTRIES", "SnapshotRecorder"]

log = logging.getLogger("llmem_plugin")

# Entries the real history keeps (a ring buffer: the oldest go first; torch's own default keeps all).
# An 8B LoRA step makes about 18,500 (the predicted history of 2 steps holds 37,038:
# benchmarks/results/snapshot-cost-2026-12-07.md): 2,000,000 keeps dozens of such steps, and a few
# of a model ten times as large, with bounded memory for the stacks.
MAX_ENTRIES = 2_000_000


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


class SnapshotRecorder:
    """Records the real history of the first steps and writes it with the prediction and their comparison.

    Args:
        folder: Where the files go (made if missing).
        rank: This process's rank (in the file names).
        predicted: Returns the predicted snapshot, or None where none can be made (then only the real
            one is written); called once, when the files are written.
        breakdown: The predicted bytes per category at the peak, printed on an out-of-memory error.

    Its public methods warn instead of raising: the recorder never stops a job or replaces its error.
    """

    def __init__(self, folder: str | os.PathLike[str], *, rank: int = 0,
                 predicted: Callable[[], dict[str, Any] | None] = lambda: None,
                 breakdown: dict[str, int] | None = None) -> None:
        self.folder = Path(folder)
        self.rank = rank
        self.predicted = predicted
        self.breakdown = dict(breakdown or {})
        self.recording = False
        self.written: list[Path] = []
        self.comparison: Any = None

    def start(self) -> None:
        """Turn the history on (CUDA only; elsewhere there is nothing to record)."""
        import torch

        if self.recording or not torch.cuda.is_available():
            return
        try:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True
        except Exception as e:  # noqa: BLE001 - the recorder never stops a job
            warnings.warn(f"llmem: the allocator history could not be recorded ({type(e).__name__}: {e}); "
                          "no snapshot will be written", stacklevel=2)

    def finish(self) -> Path | None:
        """After the compared steps: dump the real snapshot, stop recording, write the prediction and the
        comparison. Returns the comparison's text file, or None when nothing was recorded."""
        if not self.recording:
            return None
        return self._write("")

    def on_oom(self, error: BaseException) -> None:
        """On ``torch.OutOfMemoryError``: write what there is and print the predicted breakdown next to
        what was live. The caller raises ``error`` on; nothing here raises."""
        try:
            self._report_oom()
        except Exception as e:  # noqa: BLE001 - the job's own error must be the one that leaves
            warnings.warn(f"llmem: the out-of-memory report failed ({type(e).__name__}: {e})", stacklevel=2)

    def _report_oom(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        lines = [f"llmem: out of memory on rank {self.rank}: {_mib(allocated)} allocated, "
                 f"{_mib(reserved)} reserved when it failed"]
        if self.breakdown:
            lines.append("llmem: predicted at the peak: " + ", ".join(
                f"{k} {_mib(v)}" for k, v in sorted(self.breakdown.items(), key=lambda kv: -kv[1]) if v))
        text = self._write("oom-")
        if text is not None:
            lines.append(f"llmem: snapshots and their comparison in {self.folder} ({text.name}); "
                         "`python -m torch.cuda._memory_viz trace_plot` draws them")
        print("\n".join(lines), file=sys.stderr)

    def _write(self, prefix: str) -> Path | None:
        import torch

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            real_path = self.folder / f"{prefix}real-rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(real_path))
            if self.recording:
                torch.cuda.memory._record_memory_history(enabled=None)
                self.recording = False
            self.written.append(real_path)
            return self._compare(prefix, real_path)
        except Exception as e:  # noqa: BLE001 - the recorder never stops a job
            warnings.warn(f"llmem: the snapshots could not be written to {self.folder} "
                          f"({type(e).__name__}: {e})", stacklevel=3)
            return None

    def _compare(self, prefix: str, real_path: Path) -> Path:
        from llmem_plugin.snapshot.compare import compare_snapshots
        from llmem_plugin.snapshot.history import load_snapshot
        from llmem_plugin.snapshot.predict import write_snapshot

        text_path = self.folder / f"{prefix}compare-rank{self.rank}.txt"
        predicted = self.predicted()
        if predicted is None:
            text_path.write_text(f"no predicted snapshot of rank {self.rank}: the estimate did not run, or its "
                                 "method traces several distinct ranks and not this one\n", encoding="utf-8")
            return text_path
        pred_path = write_snapshot(predicted, self.folder / f"{prefix}predicted-rank{self.rank}.pickle")
        self.written.append(pred_path)
        try:
            self.comparison = compare_snapshots(predicted, load_snapshot(real_path))
        except Exception as e:  # noqa: BLE001 - e.g. no history recorded before the error
            text_path.write_text(f"not compared: {e}\n", encoding="utf-8")
            return text_path
        from rich.console import Console

        from llmem_plugin.cli.compare import render_comparison

        with open(text_path, "w", encoding="utf-8") as f:
            render_comparison(self.comparison, Console(file=f, width=120, color_system=None))
        (self.folder / f"{prefix}compare-rank{self.rank}.json").write_text(
            json.dumps(self.comparison.to_dict()), encoding="utf-8")
        self.written.append(text_path)
        log.info("llmem: %s", self.comparison.meaning)
        return text_path
