"""Where a result file's predictions came from: the checkout's commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["checkout_commit"]


def checkout_commit(repo: Path) -> str | None:
    """The commit of the checkout at ``repo`` (predictions change with the estimator), "+dirty" with
    uncommitted changes to tracked files; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")
