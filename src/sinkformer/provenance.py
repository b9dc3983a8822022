"""Where a run's numbers come from: the code, the libraries, the machine and the command.

Every run folder gets ``provenance.json`` (:func:`provenance`): those of ``sinkformer run`` and of
``sinkformer train``. The code is named by sinkformer's version and — only when the package runs
from its own source checkout (an editable install, or ``src/`` on the path) — by that checkout's
commit, with ``-dirty`` when tracked files have uncommitted changes (:func:`library_commit`). An
installed wheel records no commit, even inside someone else's git repository. Reruns of one
command on one machine give identical numbers (every random draw is seeded, data loading is
single-process); another machine may not, and :data:`WHAT_CHANGES_RESULTS` says why.
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

__all__ = ["provenance", "cpu_model", "cpu_vendor", "git_commit", "library_commit", "source_checkout",
           "require_clean_source", "NOT_A_CHECKOUT", "WHAT_CHANGES_RESULTS"]

#: The package's folder (``src/sinkformer`` in a source checkout, ``site-packages/sinkformer`` when installed).
PACKAGE_DIR = Path(__file__).resolve().parent
#: :func:`library_commit` of a package that does not run from its source checkout.
NOT_A_CHECKOUT = "not a source checkout (an installed package)"

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


def cpu_vendor() -> str:
    """The CPU's vendor string (``"GenuineIntel"``, ``"AuthenticAMD"``, ...: ``vendor_id`` of ``/proc/cpuinfo``
    on Linux, else found in what ``platform`` knows), or ``""`` when unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    match = re.search(r"vendor_id\s*:\s*(\S+)", text) or re.search(r"GenuineIntel|AuthenticAMD", text)
    return (match.group(1) if match.re.groups else match.group(0)) if match else ""


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess | None:
    """``git -C folder ARGS`` (``None`` when git cannot run)."""
    try:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(path: str | Path | None = None) -> str:
    """The commit of the git checkout holding ``path``, with ``-dirty`` when tracked files changed;
    ``"not a git checkout"`` when there is none (or no git). Without ``path``: :func:`library_commit`."""
    if path is None:
        return library_commit()
    commit = _git(Path(path), "rev-parse", "HEAD")
    if commit is None or commit.returncode != 0:
        return "not a git checkout"
    status = _git(Path(path), "status", "--porcelain", "--untracked-files=no")
    dirty = status is None or status.returncode != 0 or bool(status.stdout.strip())
    return commit.stdout.strip() + ("-dirty" if dirty else "")


def source_checkout(package_dir: str | Path = PACKAGE_DIR) -> Path | None:
    """The root of sinkformer's own git checkout when ``package_dir`` is its ``src/sinkformer`` folder
    and git tracks its ``__init__.py`` there; ``None`` otherwise — an installed wheel, also one whose
    ``site-packages`` lies inside another project's git repository."""
    package_dir = Path(package_dir).resolve()
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0:
        return None
    root = Path(top.stdout.strip()).resolve()
    if package_dir != root / "src" / "sinkformer":
        return None
    tracked = _git(root, "ls-files", "--error-unmatch", "src/sinkformer/__init__.py")
    return root if tracked is not None and tracked.returncode == 0 else None


def library_commit(package_dir: str | Path = PACKAGE_DIR) -> str:
    """The commit the package runs from (``-dirty`` with uncommitted changes to tracked files) when it
    runs from its own source checkout (:func:`source_checkout`), else :data:`NOT_A_CHECKOUT`."""
    root = source_checkout(package_dir)
    return NOT_A_CHECKOUT if root is None else git_commit(root)


def require_clean_source(facts: dict[str, Any], what: str) -> None:
    """Refuse (``ValueError``) to make ``what`` — something to commit, such as the quick-run digest —
    from a run whose :func:`provenance` ``facts`` do not name one clean commit of sinkformer's source."""
    commit = str(facts.get("git_commit", ""))
    if commit.endswith("-dirty"):
        raise ValueError(f"{what}: the run was made from a source tree with uncommitted changes ({commit}), so no "
                         f"commit holds the code that made it; commit the changes, run `sinkformer run` again from "
                         f"the clean tree, and make {what} from that run")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"{what}: the run does not name a commit of sinkformer's source ({commit or 'no git_commit'}); "
                         f"run `sinkformer run` from a clean git checkout of sinkformer and make {what} from that run")


def provenance(command: str | None = None) -> dict[str, Any]:
    """Package version, its commit (:func:`library_commit`), library versions, CPU, threads, device,
    command line and time."""
    import numpy
    import torch

    from . import __version__

    device = "cpu"
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s))"
    return {
        "sinkformer": __version__,
        "git_commit": library_commit(),
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
