r"""Images as sequences of pixel intensities, for pixel-by-pixel generation (§5.3, Table 5).

Each image becomes ``[<start>, x_1, ..., x_D]``: its intensities in raster order with the
channels of a pixel adjacent (height, width, channel — Tensor2Tensor's flattening), preceded by
a start token so that every one of the :math:`D` values is predicted. A language model on these
sequences (kind ``"lm"``, see :mod:`sinkformer.data.text_lm`) is scored in bits per dimension,
the mean negative log-likelihood in bits per predicted value.

* **CIFAR-10** binary release (``cifar-10-batches-bin``): files ``data_batch_{1..5}.bin`` and
  ``test_batch.bin``, each record one label byte then 3072 bytes (1024 red, 1024 green, 1024
  blue, rows of 32); 256 levels, :math:`D = 3072`, start token 256.
* **Embedded**: scikit-learn's 8×8 digits (:func:`sinkformer.data.digits.load_digits`), whose
  intensities take the 17 values 0..16; :math:`D = 64`, start token 17. (Bits per dimension on
  17 levels are not comparable with CIFAR-10's on 256.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .base import DataBundle, require_path
from .digits import load_digits
from .text_lm import LMCollate, LMDataset

__all__ = ["CIFAR_RECORD", "read_cifar10_batch", "pixel_sequences", "load_cifar10_pixels", "load_digit_pixels"]

CIFAR_RECORD = 1 + 3 * 32 * 32
INSTRUCTIONS = (
    "Download https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz, extract it "
    "(`tar xzf cifar-10-binary.tar.gz`) and pass the cifar-10-batches-bin folder."
)


def read_cifar10_batch(file: str | Path) -> tuple[Tensor, Tensor]:
    """Images ``(N, 32, 32, 3)`` uint8 and labels ``(N,)`` of one CIFAR-10 binary batch file."""
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise ValueError(f"{file}: {raw.size} bytes is not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records")
    records = raw.reshape(-1, CIFAR_RECORD)
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(records[:, 0].astype(np.int64))


def pixel_sequences(images: Tensor, levels: int) -> Tensor:
    """Integer images ``(N, H, W[, C])`` in ``[0, levels)`` -> ``(N, 1 + H W C)`` rows ``[levels, x...]``."""
    flat = images.reshape(len(images), -1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= levels):
        raise ValueError(f"pixel values must lie in [0, {levels}), got [{int(flat.min())}, {int(flat.max())}]")
    return torch.cat([torch.full((len(flat), 1), levels, dtype=torch.long), flat], 1)


def _bundle(train: Tensor, test: Tensor, levels: int, source: str) -> DataBundle:
    info = {"kind": "lm", "vocab_size": levels + 1, "max_len": train.shape[1] - 1, "levels": levels,
            "unit": "dimension", "source": source}
    return DataBundle(LMDataset(train), LMDataset(test), info, LMCollate())


def load_cifar10_pixels(path: str | Path | None = None, *, max_train: int = 0, max_test: int = 0) -> DataBundle:
    """CIFAR-10 as 3073-token sequences (the first ``max_train``/``max_test`` images; 0 = all)."""
    root = require_path(path, "cifar10", INSTRUCTIONS)
    if (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"
    files = [root / f"data_batch_{i}.bin" for i in range(1, 6)] + [root / "test_batch.bin"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"dataset 'cifar10': {root} lacks {', '.join(missing)}. {INSTRUCTIONS}")
    train = torch.cat([read_cifar10_batch(f)[0] for f in files[:5]])
    test = read_cifar10_batch(files[5])[0]
    train, test = train[: max_train or None], test[: max_test or None]
    return _bundle(pixel_sequences(train, 256), pixel_sequences(test, 256), 256, "cifar10")


def load_digit_pixels(*, test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """The embedded 8×8 digits as 65-token sequences of intensities 0..16 (issue 5's split)."""
    digits = load_digits(test_fraction=test_fraction, seed=seed)
    to_levels = lambda ds: torch.round(ds.tensors[0][:, 0] * 16).long()  # noqa: E731  (1, 8, 8) in [0, 1] -> 0..16
    return _bundle(pixel_sequences(to_levels(digits.train), 17), pixel_sequences(to_levels(digits.test), 17), 17, "digits")
