"""Checkpoints: weights in safetensors, optimiser/RNG/progress state via ``torch.save``, written atomically.

A checkpoint is a folder ``checkpoints/epoch_0007/`` holding ``model.safetensors`` (the
``state_dict``; shared tensors such as tied embeddings are stored once) and ``state.pt`` (the
optimiser's ``state_dict``, the RNG states of every process, the epoch, the global step and the
metric history). It is written into a hidden temporary folder which is then renamed — a rename
is atomic, so a run killed at any moment leaves either the previous checkpoint or the new one,
never half of one. ``state.pt`` is read back with ``torch.load(..., weights_only=True)``: no
arbitrary code is unpickled.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "save_weights",
    "load_weights",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "capture_rng",
    "restore_rng",
]

_EPOCH_DIR = re.compile(r"^epoch_(\d+)$")


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def save_weights(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s weights to ``path`` (safetensors), atomically."""
    from safetensors.torch import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_model(model, str(tmp))
    _fsync(tmp)
    os.replace(tmp, path)
    return path


def load_weights(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load safetensors weights written by :func:`save_weights` into ``model`` (strict)."""
    from safetensors.torch import load_model

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
    """Complete checkpoint folders, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _EPOCH_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``None`` if there is none)."""
    found = _checkpoints(Path(folder))
    return found[-1] if found else None


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimiser state) from checkpoint folder ``path``; returns the saved ``state``."""
    path = Path(path)
    load_weights(model, path / "model.safetensors")
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(f"cannot load training state from {path / 'state.pt'}: {err}") from None
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
