"""Checkpoints: weights in safetensors, optimiser/RNG/progress state via ``torch.save``, written atomically.

A checkpoint is a folder ``checkpoints/epoch_0007/`` holding ``model.safetensors`` (the
``state_dict``; shared tensors such as tied embeddings are stored once) and ``state.pt`` (the
optimiser's ``state_dict``, the RNG states of every process, the epoch, the global step and the
metric history). It is written into a hidden temporary folder which is then renamed — a rename
is atomic, so a run killed at any moment leaves either the previous checkpoint or the new one,
never half of one. ``state.pt`` is read back with ``torch.load(..., weights_only=True)``: no
arbitrary code is unpickled.

A file can still end up empty or cut short (a full disk, a copy that stopped, a file system
that lost unsynced data): :func:`file_problem` recognises such files from their own structure
(a safetensors header states the size of the data; ``state.pt`` is a zip archive whose
directory is at its end), and loading one fails with a message naming the file and saying it
is incomplete. :func:`latest_checkpoint` skips an incomplete newest checkpoint with a warning
(falling back to the newest complete one) and refuses when every checkpoint is incomplete.
:func:`remove_partial_checkpoints` deletes the ``.tmp-epoch_*`` folders of killed writes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._optional import require

__all__ = [
    "save_weights",
    "load_weights",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "capture_rng",
    "restore_rng",
    "file_problem",
    "checkpoint_problem",
    "remove_partial_checkpoints",
    "IncompleteCheckpointWarning",
]

_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-epoch_\d+")
_INCOMPLETE = "incomplete (the write was interrupted or the file was cut short)"


class IncompleteCheckpointWarning(UserWarning):
    """An incomplete newest checkpoint was skipped in favour of an older complete one."""


def _safetensors_problem(path: Path, size: int) -> str | None:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{_INCOMPLETE}: {size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:  # safetensors' own limit on the header
            return "not a safetensors file (invalid header size)"
        if 8 + n > size:
            return f"{_INCOMPLETE}: {size} bytes, but its header alone needs {8 + n}"
        try:
            header = json.loads(fh.read(n))
            end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"], default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "not a safetensors file (unreadable header)"
    if 8 + n + end > size:
        return f"{_INCOMPLETE}: {size} of {8 + n + end} bytes"
    return None


def _state_problem(path: Path, size: int) -> str | None:
    if zipfile.is_zipfile(path):
        return None
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"PK\x03\x04":  # the start of a zip archive without its end
        return f"{_INCOMPLETE}: {size} bytes, the end of the archive is missing"
    return "not a training state file written by torch.save"


def _reason(path: Path) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size == 0:
        return f"{_INCOMPLETE}: it is empty (0 bytes)"
    return _safetensors_problem(path, size) if path.suffix == ".safetensors" else _state_problem(path, size)


def file_problem(path: str | Path) -> str | None:
    """Why the weights (``*.safetensors``) or training state (``state.pt``) file ``path`` cannot be
    complete — missing, empty, cut short — or ``None`` when it looks whole: one line naming the file."""
    reason = _reason(Path(path))
    return None if reason is None else f"{path} is {reason}"


def checkpoint_problem(path: str | Path) -> str | None:
    """Why checkpoint folder ``path`` is incomplete (see :func:`file_problem`), or ``None``."""
    path = Path(path)
    for name in ("model.safetensors", "state.pt"):
        problem = file_problem(path / name)
        if problem is not None:
            return problem
    return None


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def save_weights(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s weights to ``path`` (safetensors), atomically."""
    save_model = require("safetensors.torch", "saving weights").save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_model(model, str(tmp))
    _fsync(tmp)
    os.replace(tmp, path)
    return path


def load_weights(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load safetensors weights written by :func:`save_weights` into ``model`` (strict)."""
    load_model = require("safetensors.torch", "loading weights").load_model

    reason = _reason(Path(path))
    if reason is not None:
        raise ValueError(f"cannot load weights from {path}: the file is {reason}")
    try:
        load_model(model, str(path), device=str(next(model.parameters()).device))
    except Exception as err:  # safetensors raises several error types for a bad file
        raise ValueError(f"cannot load weights from {path}: {err}") from None
    return model


def capture_rng() -> dict[str, Any]:
    """The state of torch's (CPU and CUDA), NumPy's and Python's global generators."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": [py_version, list(py_state), py_gauss],
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Undo :func:`capture_rng`: set every global generator back to ``state``."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))


def save_checkpoint(
    folder: str | Path, epoch: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
    *, keep: int = 1,
) -> Path:
    """Write ``folder/epoch_{epoch:04d}/`` atomically and delete all but the ``keep`` newest checkpoints.

    ``state`` holds plain Python values and tensors (RNG states, history, step, ...); the
    optimiser's state is added under ``"optimizer"`` and ``epoch`` under ``"epoch"``.
    """
    folder = Path(folder)
    final = folder / f"epoch_{epoch:04d}"
    tmp = folder / f".tmp-epoch_{epoch:04d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(model, tmp / "model.safetensors")
    torch.save({**state, "epoch": epoch, "optimizer": optimizer.state_dict()}, tmp / "state.pt")
    _fsync(tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in _checkpoints(folder)[:-keep]:
        shutil.rmtree(old)
    return final


def _checkpoints(folder: Path) -> list[Path]:
    """Checkpoint folders (renamed into place, so written to the end), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _EPOCH_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def list_checkpoints(folder: str | Path) -> list[Path]:
    """The ``epoch_NNNN`` checkpoint folders in ``folder``, oldest first (complete or not)."""
    return _checkpoints(Path(folder))


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``None`` if there is none).

    Newer checkpoints whose files are incomplete (:func:`checkpoint_problem`) are skipped with an
    :class:`IncompleteCheckpointWarning` naming the file; if every checkpoint is incomplete this
    raises ``ValueError`` rather than letting a resume silently start from scratch.
    """
    found = _checkpoints(Path(folder))
    problems = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            for skipped in problems:
                warnings.warn(f"skipping an incomplete checkpoint: {skipped}; resuming from the older {path.name}",
                              IncompleteCheckpointWarning, stacklevel=2)
            return path
        problems.append(problem)
    if problems:
        raise ValueError(f"no complete checkpoint in {folder}: {'; '.join(problems)}")
    return None


def remove_partial_checkpoints(folder: str | Path) -> list[Path]:
    """Delete the ``.tmp-epoch_*`` folders that killed checkpoint writes left in ``folder``; returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    leftovers = sorted(p for p in folder.iterdir() if _TMP_DIR.match(p.name))
    for path in leftovers:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return leftovers


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimiser state) from checkpoint folder ``path``; returns the saved ``state``."""
    path = Path(path)
    load_weights(model, path / "model.safetensors")
    reason = _reason(path / "state.pt")
    if reason is not None:
        raise ValueError(f"cannot load training state from {path / 'state.pt'}: the file is {reason}")
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(f"cannot load training state from {path / 'state.pt'}: {err}") from None
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
