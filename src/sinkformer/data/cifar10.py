r"""Images as sequences of pixel intensities, for pixel-by-pixel generation (§5.3, Table 5).

Each image becomes ``[<start>, x_1, ..., x_D]``: its intensities in raster order with the
channels of a pixel adjacent (height, width, channel — Tensor2Tensor's flattening), preceded by
a start token so that every one of the :math:`D` values is predicted. A language model on these
sequences (kind ``"lm"``, see :mod:`sinkformer.data.text_lm`) is scored in bits per dimension,
the mean negative log-likelihood in bits per predicted value.

* **CIFAR-10**, either release (the loader tells them apart by the files present; both give the
  same tensors); 256 levels, :math:`D = 3072`, start token 256.

  - binary (``cifar-10-batches-bin``): files ``data_batch_{1..5}.bin`` and ``test_batch.bin``,
    each record one label byte then 3072 bytes (1024 red, 1024 green, 1024 blue, rows of 32);
  - Python, "pickle" (``cifar-10-batches-py``): files ``data_batch_{1..5}`` and ``test_batch``,
    each a pickled dict with ``b"data"`` ``(N, 3072)`` uint8 in the same channel-major order and
    ``b"labels"`` (a list of N ints). These are read with an unpickler that builds nothing but
    dicts, lists, bytes, numbers and numpy arrays, so a tampered file cannot run code.
* **Embedded**: scikit-learn's 8×8 digits (:func:`sinkformer.data.digits.load_digits`), whose
  intensities take the 17 values 0..16; :math:`D = 64`, start token 17. (Bits per dimension on
  17 levels are not comparable with CIFAR-10's on 256.)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .base import DataBundle, require_path
from .digits import load_digits
from .text_lm import LMCollate, LMDataset

try:  # numpy >= 2 (pickles written by numpy 1.x name it numpy.core.multiarray._reconstruct)
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct

__all__ = [
    "CIFAR_RECORD",
    "read_cifar10_batch",
    "read_cifar10_python_batch",
    "pixel_sequences",
    "load_cifar10_pixels",
    "load_digit_pixels",
]

CIFAR_RECORD = 1 + 3 * 32 * 32
INSTRUCTIONS = (
    "Download the binary release https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz or the Python release "
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extract it (`tar xzf <archive>`) and "
    "pass the cifar-10-batches-bin or cifar-10-batches-py folder (or the folder holding it)."
)


def read_cifar10_batch(file: str | Path) -> tuple[Tensor, Tensor]:
    """Images ``(N, 32, 32, 3)`` uint8 and labels ``(N,)`` of one CIFAR-10 binary batch file."""
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise ValueError(f"{file}: {raw.size} bytes is not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records")
    records = raw.reshape(-1, CIFAR_RECORD)
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(records[:, 0].astype(np.int64))


def _latin1_encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` restricted to latin-1: how Python 3 pickles ``bytes`` at protocols 0-2."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return text.encode("latin1")


class _ArrayUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds numpy arrays and plain containers, and refuses every other global."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing global {module}.{name} (only numpy arrays, dicts, lists, bytes and numbers are allowed)"
            )
        return self.ALLOWED[module, name]


def read_cifar10_python_batch(file: str | Path) -> tuple[Tensor, Tensor]:
    """Images ``(N, 32, 32, 3)`` uint8 and labels ``(N,)`` int64 of one CIFAR-10 Python-release batch.

    The file is a pickled dict (written by Python 2: keys are bytes) with ``b"data"``, an
    ``(N, 3072)`` uint8 array (1024 red, 1024 green, 1024 blue, rows of 32), and ``b"labels"``, a
    list of N ints. Any global besides numpy's array constructors is refused (``ValueError``).
    """
    with open(file, "rb") as fh:
        try:
            batch = _ArrayUnpickler(fh, encoding="bytes").load()
        except Exception as err:  # a tampered or truncated pickle can fail in many ways
            raise ValueError(f"corrupt or unsafe CIFAR-10 Python batch {file}: {err}") from None
    if not isinstance(batch, dict):
        raise ValueError(f"corrupt CIFAR-10 Python batch {file}: expected a pickled dict, got {type(batch).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    data, labels = batch.get("data"), np.asarray(batch.get("labels", []))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        found = f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"corrupt CIFAR-10 Python batch {file}: b'data' must be an (N, 3072) uint8 array, got {found}")
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise ValueError(
            f"corrupt CIFAR-10 Python batch {file}: b'labels' must be {len(data)} ints, got {labels.dtype} {labels.shape}"
        )
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))


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


# (folder name in the archive, suffix of the batch files, reader): the binary release, then the Python one
RELEASES = (
    ("cifar-10-batches-bin", ".bin", read_cifar10_batch),
    ("cifar-10-batches-py", "", read_cifar10_python_batch),
)
BatchReader = Callable[[Path], tuple[Tensor, Tensor]]


def find_cifar10_batches(root: Path) -> tuple[list[Path], BatchReader]:
    """The six batch files (five train, then test) of the release found in ``root`` or its subfolder, and their reader.

    ``root`` may be ``cifar-10-batches-bin``, ``cifar-10-batches-py`` or a folder holding either;
    the binary release wins when both are complete. Raises ``FileNotFoundError`` naming what is missing.
    """
    closest: list[Path] = []
    for folder_name, suffix, reader in RELEASES:
        for folder in (root, root / folder_name):
            files = [folder / f"data_batch_{i}{suffix}" for i in range(1, 6)] + [folder / f"test_batch{suffix}"]
            missing = [f for f in files if not f.is_file()]
            if not missing:
                return files, reader
            if len(missing) < len(files) and (not closest or len(missing) < len(closest)):
                closest = missing
    found = f"lacks {', '.join(str(f.relative_to(root)) for f in closest)}" if closest else "holds neither release"
    raise FileNotFoundError(
        f"dataset 'cifar10': {root} {found}; expected data_batch_1.bin..data_batch_5.bin and test_batch.bin "
        f"(binary release) or data_batch_1..data_batch_5 and test_batch (Python release). {INSTRUCTIONS}"
    )


def load_cifar10_pixels(path: str | Path | None = None, *, max_train: int = 0, max_test: int = 0) -> DataBundle:
    """CIFAR-10 (either release) as 3073-token sequences (the first ``max_train``/``max_test`` images; 0 = all)."""
    root = require_path(path, "cifar10", INSTRUCTIONS)
    files, read_batch = find_cifar10_batches(root)
    train = torch.cat([read_batch(f)[0] for f in files[:5]])
    test = read_batch(files[5])[0]
    train, test = train[: max_train or None], test[: max_test or None]
    return _bundle(pixel_sequences(train, 256), pixel_sequences(test, 256), 256, "cifar10")


def load_digit_pixels(*, test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """The embedded 8×8 digits as 65-token sequences of intensities 0..16 (issue 5's split)."""
    digits = load_digits(test_fraction=test_fraction, seed=seed)
    to_levels = lambda ds: torch.round(ds.tensors[0][:, 0] * 16).long()  # noqa: E731  (1, 8, 8) in [0, 1] -> 0..16
    return _bundle(pixel_sequences(to_levels(digits.train), 17), pixel_sequences(to_levels(digits.test), 17), 17, "digits")
