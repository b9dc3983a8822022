"""Where a run's numbers come from: the code, the libraries, the machine and the command.

Every run folder gets ``provenance.json`` (:func:`provenance`). Reruns of one command on one
machine give identical numbers (every random draw is seeded, data loading is single-process);
another machine may not, and :data:`WHAT_CHANGES_RESULTS` says why.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["provenance", "cpu_model", "git_commit", "WHAT_CHANGES_RESULTS"]

#: Shown in every summary report: why the same command can give other numbers elsewhere.
WHAT_CHANGES_RESULTS = (
    "Two runs of one command on one machine give identical numbers: every random draw is seeded and "
    "data loading is single-process. Another machine can give slightly different numbers, and after a "
    "few epochs different ones: the matrix products run on the BLAS kernels of its CPU (vector width, "
    "blocking, and so the order of additions, differ between CPU generations), the number of threads "
    "changes how sums are split, and other versions of torch/numpy change kernels. The paired "
    "comparisons and their intervals are what should agree between machines, not the last digit."
)


def cpu_model() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux), or what ``platform`` knows."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    match = re.search(r"model name\s*:\s*(.+)", text)
    return match.group(1).strip() if match else (platform.processor() or "unknown CPU")


def git_commit(path: str | Path | None = None) -> str:
    """The commit of the checkout holding ``path`` (default: this package), with ``-dirty`` when
    tracked files changed; ``"not a git checkout"`` for an installed wheel or without git."""
    here = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return "not a git checkout"
        status = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return commit.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def provenance(command: str | None = None) -> dict[str, Any]:
    """Package version, git commit, library versions, CPU, threads, device, command line and time."""
    import numpy
    import torch

    from .. import __version__

    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s))"
    return {
        "sinkformer": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
    }
