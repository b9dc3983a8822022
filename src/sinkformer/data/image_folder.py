"""Images stored one folder per class (e.g. cats vs dogs), decoded with Pillow and resized.

Two layouts are accepted::

    root/<class>/*.jpg                      (split here: a seeded ``test_fraction``)
    root/train/<class>/*.jpg, root/test/<class>/*.jpg

Images are read lazily, converted to RGB (``channels=3``) or grey (``channels=1``), resized to
``image_size × image_size`` (bilinear) and scaled to [-1, 1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .base import DataBundle, FixedCollate, require_path, split_indices

__all__ = ["ImageFolder", "load_image_folder", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")

INSTRUCTIONS = (
    "Put the images in one folder per class, e.g. for Kaggle's dogs-vs-cats "
    "(https://www.kaggle.com/c/dogs-vs-cats/data): unzip train.zip, then "
    "`mkdir cat dog && mv cat.*.jpg cat/ && mv dog.*.jpg dog/`, and pass the folder holding cat/ and dog/."
)


class ImageFolder(Dataset):
    """``(image (channels, size, size) in [-1, 1], label)`` for a list of ``(file, label)``."""

    def __init__(self, samples: list[tuple[Path, int]], image_size: int, channels: int) -> None:
        self.samples, self.image_size, self.mode = samples, image_size, {1: "L", 3: "RGB"}[channels]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                img = img.convert(self.mode).resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
                pixels = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot decode image {path}: {err}") from None
        x = torch.from_numpy(pixels)
        return (x.unsqueeze(0) if x.dim() == 2 else x.permute(2, 0, 1)), label


def _class_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _samples(folders: list[Path], classes: list[str]) -> list[tuple[Path, int]]:
    out = []
    for folder in folders:
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS)
        out += [(f, classes.index(folder.name)) for f in files]
    return out


def load_image_folder(
    path: str | Path | None = None,
    *,
    image_size: int = 224,
    channels: int = 3,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> DataBundle:
    """Images from class folders (see the module docstring), resized to ``image_size``."""
    root = require_path(path, "image_folder", INSTRUCTIONS)
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if (root / "train").is_dir() and (root / "test").is_dir():
        classes = [p.name for p in _class_folders(root / "train")]
        train = _samples(_class_folders(root / "train"), classes)
        test = _samples([root / "test" / c for c in classes if (root / "test" / c).is_dir()], classes)
    else:
        folders = _class_folders(root)
        classes = [p.name for p in folders]
        everything = _samples(folders, classes)
        train_idx, test_idx = split_indices(len(everything), test_fraction, seed)
        train, test = [everything[i] for i in train_idx], [everything[i] for i in test_idx]
    if len(classes) < 2 or not train or not test:
        raise FileNotFoundError(
            f"dataset 'image_folder': {root} holds {len(classes)} class folder(s) and {len(train) + len(test)} "
            f"images; expected at least 2 classes with images. {INSTRUCTIONS}"
        )
    info = {"kind": "images", "n_classes": len(classes), "image_size": image_size, "channels": channels,
            "class_names": classes}
    return DataBundle(
        ImageFolder(train, image_size, channels), ImageFolder(test, image_size, channels), info, FixedCollate("images")
    )
