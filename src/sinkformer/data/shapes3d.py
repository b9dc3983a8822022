"""Procedurally generated 3-D shapes: the embedded point-cloud dataset (no download).

Twelve classes of surfaces — sphere, cube, cylinder, cone, torus, tetrahedron, octahedron,
ellipsoid, disk, helix, dumbbell, hemisphere — each sampled uniformly (or nearly so) with
``n_points`` points, then given a random rotation, a random isotropic scale in [0.7, 1.3] and
Gaussian noise (std ``noise``), and finally centred and scaled into the unit ball like ModelNet
(so the scale changes the noise level relative to the shape). Shape ``i`` of a split is drawn from a generator seeded by
``(seed, split, i)``, so the data are the same on every machine.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import DataBundle, FixedCollate
from .point_clouds import PointCloudDataset, normalize_points, sample_surface

__all__ = ["SHAPES", "generate_shapes", "load_shapes3d"]


def _sphere(n: int, g: torch.Generator) -> Tensor:
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def _mesh(vertices, faces):
    v, f = torch.tensor(vertices, dtype=torch.float64), torch.tensor(faces)
    return lambda n, g: sample_surface(v, f, n, g)


_cube = _mesh(
    [[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)],
    [[0, 1, 3], [0, 3, 2], [4, 6, 7], [4, 7, 5], [0, 4, 5], [0, 5, 1],
     [2, 3, 7], [2, 7, 6], [0, 2, 6], [0, 6, 4], [1, 5, 7], [1, 7, 3]],
)
_tetrahedron = _mesh([[1, 1, 1], [1, -1, -1], [-1, 1, -1], [-1, -1, 1]], [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]])
_octahedron = _mesh(
    [[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]],
    [[a, b, c] for a in (0, 1) for b in (2, 3) for c in (4, 5)],
)


def _uniform(n: int, g: torch.Generator) -> Tensor:
    return torch.rand(n, generator=g, dtype=torch.float64)


def _disk_points(n: int, g: torch.Generator, radius: float = 1.0) -> Tensor:
    r, t = radius * _uniform(n, g).sqrt(), 2 * math.pi * _uniform(n, g)
    return torch.stack([r * t.cos(), r * t.sin(), torch.zeros(n, dtype=torch.float64)], dim=-1)


def _cylinder(n: int, g: torch.Generator) -> Tensor:
    # lateral area 2*pi*r*h = 4*pi (r=1, h=2) vs caps 2*pi: 2/3 of the points on the side
    side = _uniform(n, g) < 2 / 3
    t, z = 2 * math.pi * _uniform(n, g), 2 * _uniform(n, g) - 1
    caps = _disk_points(n, g)
    caps[:, 2] = torch.where(_uniform(n, g) < 0.5, -1.0, 1.0)
    lateral = torch.stack([t.cos(), t.sin(), z], dim=-1)
    return torch.where(side.unsqueeze(-1), lateral, caps)


def _cone(n: int, g: torch.Generator) -> Tensor:
    # apex at z=1, base radius 1 at z=-1: slant area pi*sqrt(5) vs base pi
    side = _uniform(n, g) < math.sqrt(5) / (1 + math.sqrt(5))
    r, t = _uniform(n, g).sqrt(), 2 * math.pi * _uniform(n, g)  # density ∝ r on the slant surface
    lateral = torch.stack([r * t.cos(), r * t.sin(), 1 - 2 * r], dim=-1)
    base = _disk_points(n, g)
    base[:, 2] = -1.0
    return torch.where(side.unsqueeze(-1), lateral, base)


def _torus(n: int, g: torch.Generator, big: float = 1.0, small: float = 0.35) -> Tensor:
    # rejection sampling: the area element is proportional to (R + r cos v)
    out = []
    while sum(len(o) for o in out) < n:
        u, v, w = (_uniform(2 * n, g) for _ in range(3))
        u, v = 2 * math.pi * u, 2 * math.pi * v
        keep = w < (big + small * v.cos()) / (big + small)
        ring = big + small * v[keep].cos()
        out.append(torch.stack([ring * u[keep].cos(), ring * u[keep].sin(), small * v[keep].sin()], dim=-1))
    return torch.cat(out)[:n]


def _ellipsoid(n: int, g: torch.Generator) -> Tensor:
    return _sphere(n, g) * torch.tensor([1.0, 0.55, 0.3], dtype=torch.float64)


def _helix(n: int, g: torch.Generator) -> Tensor:
    t = _uniform(n, g)
    angle = 6 * math.pi * t
    tube = 0.08 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    return torch.stack([angle.cos(), angle.sin(), 2 * t - 1], dim=-1) + tube


def _dumbbell(n: int, g: torch.Generator) -> Tensor:
    side = torch.where(_uniform(n, g) < 0.5, -1.0, 1.0).unsqueeze(-1)
    return 0.45 * _sphere(n, g) + side * torch.tensor([0.75, 0.0, 0.0], dtype=torch.float64)


def _hemisphere(n: int, g: torch.Generator) -> Tensor:
    x = _sphere(n, g)
    return torch.cat([x[:, :2], x[:, 2:].abs()], dim=-1)


#: class name -> sampler ``(n, generator) -> (n, 3)`` of the canonical shape.
SHAPES = {
    "sphere": _sphere,
    "cube": _cube,
    "cylinder": _cylinder,
    "cone": _cone,
    "torus": _torus,
    "tetrahedron": _tetrahedron,
    "octahedron": _octahedron,
    "ellipsoid": _ellipsoid,
    "disk": _disk_points,
    "helix": _helix,
    "dumbbell": _dumbbell,
    "hemisphere": _hemisphere,
}


def _random_rotation(g: torch.Generator) -> Tensor:
    """A uniformly random rotation: the matrix of a uniformly random unit quaternion."""
    w, x, y, z = (q := torch.randn(4, generator=g, dtype=torch.float64)) / q.norm()
    return torch.stack([
        torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)]),
        torch.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)]),
        torch.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]),
    ])


def generate_shapes(n_per_class: int, n_points: int, *, seed: int = 0, split: int = 0, noise: float = 0.02):
    """``(points (N, n_points, 3) float32, labels (N,))`` with ``N = 12 * n_per_class``, in class order."""
    clouds, rotations, labels = [], [], []
    for label, sampler in enumerate(SHAPES.values()):
        for i in range(n_per_class):
            g = torch.Generator().manual_seed(((seed * 7 + split) * 1009 + label) * 100_003 + i)
            x = sampler(n_points, g) * (0.7 + 0.6 * _uniform(1, g))
            clouds.append(x + noise * torch.randn(n_points, 3, generator=g, dtype=torch.float64))
            rotations.append(_random_rotation(g))
            labels.append(label)
    rotated = torch.stack(clouds) @ torch.stack(rotations).transpose(1, 2)  # one batched product
    return normalize_points(rotated).float(), torch.tensor(labels)


def load_shapes3d(
    *, n_points: int = 256, n_train: int = 100, n_test: int = 25, noise: float = 0.02, augment: bool = True,
    augmentation: str = "pct",
    seed: int = 0,
) -> DataBundle:
    """Generated shapes: ``n_train`` / ``n_test`` clouds per class of ``n_points`` points."""
    train_x, train_y = generate_shapes(n_train, n_points, seed=seed, split=0, noise=noise)
    test_x, test_y = generate_shapes(n_test, n_points, seed=seed, split=1, noise=noise)
    info = {"kind": "points", "n_classes": len(SHAPES), "in_features": 3, "n_points": n_points,
            "class_names": list(SHAPES)}
    return DataBundle(
        PointCloudDataset(train_x, train_y, augment=augment, augmentation=augmentation, seed=seed),
        PointCloudDataset(test_x, test_y),
        info,
        FixedCollate("points"),
    )
