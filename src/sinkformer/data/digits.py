"""scikit-learn's bundled 8×8 handwritten digits: the embedded image dataset (no download).

1797 grey-scale images of the digits 0–9 (pixel values 0–16, scaled here to [0, 1]) shipped
inside scikit-learn; split into train/test with a seeded random split.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from .._optional import require
from .base import DataBundle, FixedCollate, split_indices

__all__ = ["load_digits"]


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> DataBundle:
    """The digits as ``(1, 8, 8)`` float images in [0, 1] and labels 0–9."""
    raw = require("sklearn.datasets", "the embedded digits").load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target, dtype=torch.long)
    train, test = split_indices(len(labels), test_fraction, seed)
    info = {"kind": "images", "n_classes": 10, "image_size": 8, "channels": 1,
            "class_names": [str(d) for d in range(10)]}
    return DataBundle(
        TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test]), info,
        FixedCollate("images"),
    )
