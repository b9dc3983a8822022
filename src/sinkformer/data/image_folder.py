"""Images in folders (e.g. cats vs dogs), decoded with Pillow and resized.

Three layouts are accepted::

    root/<class>/*.jpg                      (split here: a seeded ``test_fraction``)
    root/train/<class>/*.jpg, root/test/<class>/*.jpg
    root/train/<label>.<id>.jpg             (Kaggle's dogs-vs-cats: cat.0.jpg, dog.12.jpg, ...; split here)

A folder without subfolders whose image files are all named ``<label>.<id>.<ext>``, with at least
two distinct labels, is *labelled by name* (Kaggle's ``train/``); ``root`` may be such a folder
itself. Next to one, a folder whose files carry no label (Kaggle's unlabelled ``test1/`` of
``1.jpg, 2.jpg, ...``) is never taken as a class: it is skipped and listed in ``info["ignored"]``.
Anything else beside it is ambiguous and raises ``ValueError``. Classes are sorted by name
(cat = 0, dog = 1).

Images are read lazily, converted to RGB (``channels=3``) or grey (``channels=1``), resized to
``image_size × image_size`` (bilinear) and scaled to [-1, 1]. With ``augment=True`` the training
split instead takes a random resized crop (area 80-100 %, aspect ratio 3/4-4/3) and a random
horizontal flip, drawn from torch's global generator (``torch.manual_seed`` makes runs repeat);
the test split is never augmented.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .._optional import require
from .base import DataBundle, FixedCollate, require_path, split_indices

__all__ = ["ImageFolder", "load_image_folder", "random_resized_box", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
CROP_SCALE, CROP_RATIO = (0.8, 1.0), (3 / 4, 4 / 3)
NAME_LABEL = re.compile(r"^([^.]+)\.[^.]+\.[^.]+$")  # <label>.<id>.<ext>

INSTRUCTIONS = (
    "Put the images in one folder per class, e.g. for Kaggle's dogs-vs-cats "
    "(https://www.kaggle.com/c/dogs-vs-cats/data): unzip train.zip, then "
    "`mkdir cat dog && mv cat.*.jpg cat/ && mv dog.*.jpg dog/`, and pass the folder holding cat/ and dog/ "
    "(or pass the unzipped train/ folder of cat.<id>.jpg / dog.<id>.jpg files as it is)."
)

Samples = list[tuple[Path, str]]  # (image file, class name)


def random_resized_box(width: int, height: int) -> tuple[int, int, int, int]:
    """A random crop box ``(left, top, right, bottom)`` of a ``width × height`` image.

    Its area is a uniform fraction in :data:`CROP_SCALE` of the image's and its aspect ratio
    log-uniform in :data:`CROP_RATIO` (torchvision's ``RandomResizedCrop``: 10 tries, then the
    largest central box of an allowed ratio). Draws from torch's global generator.
    """
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(10):
        area = width * height * torch.empty(1).uniform_(*CROP_SCALE).item()
        ratio = math.exp(torch.empty(1).uniform_(*log_ratio).item())
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, (1,)))
            top = int(torch.randint(0, height - h + 1, (1,)))
            return left, top, left + w, top + h
    ratio = min(max(width / height, CROP_RATIO[0]), CROP_RATIO[1])
    w, h = (width, round(width / ratio)) if width / height < ratio else (round(height * ratio), height)
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


class ImageFolder(Dataset):
    """``(image (channels, size, size) in [-1, 1], label)`` for a list of ``(file, label)``.

    ``augment``: random resized crop then random horizontal flip (see :func:`random_resized_box`).
    """

    def __init__(
        self, samples: list[tuple[Path, int]], image_size: int, channels: int, *, augment: bool = False
    ) -> None:
        self.samples, self.image_size, self.mode = samples, image_size, {1: "L", 3: "RGB"}[channels]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        Image = require("PIL.Image", "reading image folders")

        path, label = self.samples[index]
        size = (self.image_size, self.image_size)
        try:
            with Image.open(path) as img:
                img = img.convert(self.mode)
                box = random_resized_box(*img.size) if self.augment else None
                img = img.resize(size, Image.Resampling.BILINEAR, box=box)
                pixels = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot decode image {path}: {err}") from None
        x = torch.from_numpy(pixels)
        x = x.unsqueeze(0) if x.dim() == 2 else x.permute(2, 0, 1)
        if self.augment and torch.rand(()).item() < 0.5:
            x = x.flip(-1)
        return x, label


def _subfolders(root: Path) -> list[Path]:
    """The non-hidden subfolders of ``root``, sorted by name."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: Path) -> list[Path]:
    """The image files directly in ``folder``, sorted by name."""
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)


def _name_label(file: Path) -> str | None:
    """``"cat"`` for ``cat.123.jpg``; ``None`` when the name is not ``<label>.<id>.<ext>``."""
    match = NAME_LABEL.match(file.name)
    return match.group(1) if match else None


def _labelled_by_name(folder: Path) -> bool:
    """Whether ``folder`` is flat and its images are all ``<label>.<id>.<ext>`` with >= 2 labels."""
    if _subfolders(folder):
        return False
    labels = [_name_label(f) for f in _image_files(folder)]
    return None not in labels and len(set(labels)) >= 2


def _unlabelled(folder: Path) -> bool:
    """Whether ``folder`` is flat and none of its images carries a label prefix (Kaggle's ``test1/``)."""
    return not _subfolders(folder) and all(_name_label(f) is None for f in _image_files(folder))


def _by_name(folder: Path) -> Samples:
    """Samples of a folder labelled by name."""
    return [(f, _name_label(f)) for f in _image_files(folder)]


def _by_folder(folders: list[Path]) -> Samples:
    """Samples of class folders: the class is the folder's name."""
    return [(f, folder.name) for folder in folders for f in _image_files(folder)]


def _kaggle_pool(root: Path) -> tuple[Samples, list[str]] | None:
    """The samples of a Kaggle-style layout (``root`` or one subfolder labelled by name) and the ignored folders.

    ``None`` when there is no folder labelled by name; ``ValueError`` when its siblings are not all unlabelled.
    """
    if _labelled_by_name(root):
        return _by_name(root), []
    folders = _subfolders(root)
    named = [f for f in folders if _labelled_by_name(f)]
    if not named:
        return None
    others = [f for f in folders if f not in named]
    unclear = named[1:] + [f for f in others if not _unlabelled(f)]
    if unclear:
        raise ValueError(
            f"dataset 'image_folder': {root} is ambiguous: {named[0].name}/ holds images labelled by name "
            f"(<label>.<id>.<ext>) but {', '.join(f.name + '/' for f in unclear)} also holds labelled images or "
            f"subfolders. {INSTRUCTIONS}"
        )
    return _by_name(named[0]), [f.name for f in others]


def _split(samples: Samples, test_fraction: float, seed: int) -> tuple[Samples, Samples]:
    """A seeded random train/test split of ``samples``."""
    train_idx, test_idx = split_indices(len(samples), test_fraction, seed)
    return [samples[i] for i in train_idx], [samples[i] for i in test_idx]


def _find_samples(root: Path, test_fraction: float, seed: int) -> tuple[Samples, Samples, list[str], list[str]]:
    """Train and test samples of any accepted layout (module docstring), the sorted class names, the ignored folders."""
    kaggle = _kaggle_pool(root)
    if kaggle is not None:
        pool, ignored = kaggle
        return *_split(pool, test_fraction, seed), sorted({name for _, name in pool}), ignored
    if (root / "train").is_dir() and (root / "test").is_dir():
        folders = _subfolders(root / "train")
        test_folders = [root / "test" / f.name for f in folders if (root / "test" / f.name).is_dir()]
        return _by_folder(folders), _by_folder(test_folders), [f.name for f in folders], []
    folders = _subfolders(root)
    return *_split(_by_folder(folders), test_fraction, seed), [f.name for f in folders], []


def _indexed(samples: Samples, classes: list[str]) -> list[tuple[Path, int]]:
    """``(file, class index)`` pairs."""
    index = {name: i for i, name in enumerate(classes)}
    return [(f, index[name]) for f, name in samples]


def load_image_folder(
    path: str | Path | None = None,
    *,
    image_size: int = 224,
    channels: int = 3,
    test_fraction: float = 0.2,
    seed: int = 0,
    augment: bool = False,
) -> DataBundle:
    """Images from class folders or Kaggle's dogs-vs-cats (see the module docstring), resized to ``image_size``.

    ``augment``: random resized crop and horizontal flip on the training split only.
    ``info["ignored"]`` lists the folders skipped as unlabelled (Kaggle's ``test1``).
    """
    root = require_path(path, "image_folder", INSTRUCTIONS)
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive int, got {image_size!r}")
    train, test, classes, ignored = _find_samples(root, test_fraction, seed)
    if len(classes) < 2 or not train or not test:
        raise FileNotFoundError(
            f"dataset 'image_folder': {root} holds {len(classes)} class folder(s) and {len(train) + len(test)} "
            f"images; expected at least 2 classes with images. {INSTRUCTIONS}"
        )
    info = {"kind": "images", "n_classes": len(classes), "image_size": image_size, "channels": channels,
            "class_names": classes, "ignored": ignored}
    return DataBundle(
        ImageFolder(_indexed(train, classes), image_size, channels, augment=augment),
        ImageFolder(_indexed(test, classes), image_size, channels),
        info,
        FixedCollate("images"),
    )
