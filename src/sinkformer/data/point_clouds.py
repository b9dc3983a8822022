r"""Point clouds: uniform sampling of triangle meshes, normalisation, and the training dataset.

Area-weighted uniform surface sampling: pick triangle :math:`t` with probability
:math:`A_t / \sum A`, then the point

.. math::

    p = (1 - \sqrt{r_1})\,a + \sqrt{r_1}(1 - r_2)\,b + \sqrt{r_1}\,r_2\,c,\qquad r_1, r_2 \sim U[0, 1],

which is uniform on the triangle :math:`(a, b, c)` — hence uniform on the surface.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .base import item_seed

__all__ = ["sample_surface", "normalize_points", "PointCloudDataset", "AUGMENTATIONS"]


def sample_surface(vertices: Tensor, faces: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` points uniform on the surface of a triangle mesh.

    Args:
        vertices: ``(V, 3)`` float. faces: ``(F, 3)`` vertex indices of triangles.
        n: number of points. generator: torch RNG (reproducible sampling).
    Returns:
        ``(n, 3)`` points, dtype of ``vertices``.
    """
    a, b, c = (vertices[faces[:, i]] for i in range(3))
    areas = 0.5 * torch.linalg.cross(b - a, c - a).norm(dim=-1)
    if not bool(areas.sum() > 0):
        raise ValueError("mesh has zero surface area; cannot sample points on it")
    face = torch.multinomial(areas.double(), n, replacement=True, generator=generator)
    r1 = torch.rand(n, 1, generator=generator, dtype=vertices.dtype).sqrt()
    r2 = torch.rand(n, 1, generator=generator, dtype=vertices.dtype)
    return (1 - r1) * a[face] + r1 * (1 - r2) * b[face] + r1 * r2 * c[face]


def normalize_points(points: Tensor) -> Tensor:
    """Centre each cloud ``(..., n, 3)`` at the origin and scale it into the unit ball."""
    centred = points - points.mean(dim=-2, keepdim=True)
    radius = centred.norm(dim=-1).amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return centred / radius.unsqueeze(-1)


#: Training augmentations of point clouds: PCT's, and the Set Transformer authors' (used by the
#: Sinkformers authors' ModelNet code).
AUGMENTATIONS = ("pct", "rotate_scale")


class PointCloudDataset(Dataset):
    """``(points (n, 3), label)`` items, with a training augmentation when ``augment``.

    ``augmentation="pct"`` (PCT): anisotropic scale in [2/3, 3/2] per axis and a translation in
    [-0.2, 0.2]. ``"rotate_scale"`` (Lee et al.'s ``ModelFetcher``, the Sinkformers authors'
    ModelNet loader): a rotation about the z axis by an angle in [-0.15π, 0.15π], then an
    anisotropic scale in [0.8, 1.25] per axis. Draws come from a generator seeded by
    ``(seed, epoch, index)``: the trainer calls :meth:`set_epoch`, and a resumed run sees exactly
    the same data.
    """

    def __init__(self, points: Tensor, labels: Tensor, *, augment: bool = False, augmentation: str = "pct",
                 seed: int = 0) -> None:
        if augmentation not in AUGMENTATIONS:
            raise ValueError(f"augmentation must be one of {list(AUGMENTATIONS)}, got {augmentation!r}")
        self.points, self.labels, self.augment, self.seed, self.epoch = points, labels, augment, seed, 0
        self.augmentation = augmentation

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        x = self.points[index]
        if self.augment:
            gen = torch.Generator().manual_seed(item_seed(self.seed, self.epoch, index))
            x = (_pct if self.augmentation == "pct" else _rotate_scale)(x, gen)
        return x, int(self.labels[index])


def _pct(x: Tensor, gen: torch.Generator) -> Tensor:
    scale = torch.empty(3).uniform_(2 / 3, 3 / 2, generator=gen)
    shift = torch.empty(3).uniform_(-0.2, 0.2, generator=gen)
    return x * scale + shift


def _rotate_scale(x: Tensor, gen: torch.Generator) -> Tensor:
    theta = float(torch.empty(()).uniform_(-0.15, 0.15, generator=gen)) * math.pi
    c, s = math.cos(theta), math.sin(theta)
    rotation = torch.tensor([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]], dtype=x.dtype)  # x' = c x - s y, y' = s x + c y
    scale = torch.empty(3).uniform_(0.8, 1.25, generator=gen).to(x.dtype)
    return (x @ rotation) * scale
