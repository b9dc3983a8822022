"""MNIST from its IDX files (LeCun's original format, optionally gzipped).

An IDX file is a 4-byte magic number ``0 0 <type> <ndim>``, ``ndim`` big-endian uint32 sizes,
then the data in big-endian order (type ``0x08`` = uint8, ``0x09`` int8, ``0x0B`` int16,
``0x0C`` int32, ``0x0D`` float32, ``0x0E`` float64).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .base import DataBundle, FixedCollate, require_path

__all__ = ["read_idx", "load_mnist", "MNIST_FILES"]

_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

#: split -> (images, labels) file names (each may also end in ``.gz``).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

INSTRUCTIONS = (
    "Download the four MNIST IDX files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
    "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz, e.g. from "
    "https://ossci-datasets.s3.amazonaws.com/mnist/) into one folder and pass that folder."
)

#: The usual MNIST normalisation (mean, std) of pixel values in [0, 1].
MNIST_MEAN_STD = (0.1307, 0.3081)


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (``.gz`` allowed) into a NumPy array; a malformed file raises naming it."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except OSError as err:
        raise ValueError(f"cannot read IDX file {path}: {err}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"corrupt IDX file {path}: bad magic number {raw[:4].hex()!r}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"corrupt IDX file {path}: truncated header")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"corrupt IDX file {path}: header says shape {shape} ({expected} bytes), found {len(raw) - header} bytes"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def _find(root: Path, name: str) -> Path:
    for folder in (root, root / "raw", root / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.exists():
                return candidate
    raise FileNotFoundError(f"dataset 'mnist': {name}[.gz] not found in {root}. {INSTRUCTIONS}")


def _split(root: Path, split: str) -> TensorDataset:
    image_file, label_file = (_find(root, name) for name in MNIST_FILES[split])
    images, labels = read_idx(image_file), read_idx(label_file)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(
            f"MNIST files {image_file} and {label_file} do not match: images {images.shape}, labels {labels.shape}"
        )
    mean, std = MNIST_MEAN_STD
    x = (torch.from_numpy(images.astype(np.float32)).unsqueeze(1) / 255.0 - mean) / std
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def load_mnist(path: str | Path | None = None) -> DataBundle:
    """MNIST from a folder holding the IDX files (also ``raw/`` or ``MNIST/raw/`` below it).

    Images are ``(1, 28, 28)``, normalised with mean 0.1307 and std 0.3081.
    """
    root = require_path(path, "mnist", INSTRUCTIONS)
    train, test = _split(root, "train"), _split(root, "test")
    size = train.tensors[0].shape[-1]
    info = {"kind": "images", "n_classes": 10, "image_size": size, "channels": 1,
            "class_names": [str(d) for d in range(10)]}
    return DataBundle(train, test, info, FixedCollate("images"))
