"""ModelNet40: the HDF5 point-cloud releases and the raw ``.off`` meshes.

* **HDF5** (``modelnet40_ply_hdf5_2048``, Qi et al.'s release used by PCT): files
  ``ply_data_train*.h5`` / ``ply_data_test*.h5`` holding ``data (N, 2048, 3)`` float32 and
  ``label (N, 1)``, plus ``shape_names.txt`` (one class name per line).
* **Sinkformers' cloud file** (``ModelNet40_cloud.h5``, the file the official Sinkformers and Set
  Transformer code read): one HDF5 file holding ``tr_cloud (N, P, 3)`` and ``test_cloud (M, P, 3)``
  float (P = 10000 points sampled uniformly on each mesh), ``tr_label (N,)`` and ``test_label (M,)``
  ints (the Set Transformer's version names them ``tr_labels`` / ``test_labels``). Classes are the
  ModelNet40 folders in sorted order; the file holds no names, so they are ``class_<i>``.
* **Meshes** (``ModelNet40/<class>/{train,test}/*.off``, Wu et al.): each mesh is sampled once,
  uniformly on its surface (area-weighted, see :mod:`sinkformer.data.point_clouds`), to
  ``n_points`` points — the Set Transformer experiment uses 5000 — and the samples are cached
  as an HDF5 file in the same layout, which is then read like the release.

Clouds are centred and scaled into the unit ball; the training split gets a random augmentation
(``augment=True``): ``augmentation="pct"`` (PCT's scale/translation, the HDF5 release's default) or
``"rotate_scale"`` (the Set Transformer authors' rotation + scaling, the meshes' default, as the
Sinkformers authors' ModelNet code uses).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .._optional import require
from .base import DataBundle, FixedCollate, require_path
from .point_clouds import PointCloudDataset, normalize_points, sample_surface

__all__ = [
    "read_off",
    "read_modelnet_h5",
    "read_modelnet_cloud_h5",
    "meshes_to_hdf5",
    "load_modelnet40",
    "load_modelnet40_off",
]

HDF5_INSTRUCTIONS = (
    "Download modelnet40_ply_hdf5_2048.zip (the PointNet/PCT release, "
    "https://shapenet.cs.stanford.edu/media/modelnet40_ply_hdf5_2048.zip or a mirror), unzip it and pass "
    "the modelnet40_ply_hdf5_2048 folder; or pass the ModelNet40_cloud.h5 file of the Sinkformers / "
    "Set Transformer code (https://github.com/michaelsdr/sinkformers)."
)
CLOUD_FILE = "ModelNet40_cloud.h5"
# (train labels, test labels): the official Sinkformers file, then the Set Transformer's spelling
CLOUD_LABEL_KEYS = (("tr_label", "test_label"), ("tr_labels", "test_labels"))
OFF_INSTRUCTIONS = (
    "Download ModelNet40.zip (https://modelnet.cs.princeton.edu/, http://modelnet.cs.princeton.edu/ModelNet40.zip), "
    "unzip it and pass the ModelNet40 folder (holding <class>/train/*.off and <class>/test/*.off)."
)


def read_off(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read an OFF mesh: ``(vertices (V, 3) float64, triangles (F, 3) long)``; polygons are fan-triangulated.

    Accepts ModelNet's quirk of counts glued to the header (``OFF490 518 0``) and ``#`` comments.
    """
    path = Path(path)
    try:
        lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read OFF file {path}: {err}") from None
    lines = [ln for ln in lines if ln]
    try:
        if not lines or not lines[0].startswith("OFF"):
            raise ValueError("missing OFF header")
        head = lines[0][3:].split()
        body = lines[1:] if head else lines[2:]
        n_vertices, n_faces = (int(x) for x in (head or lines[1].split())[:2])
        vertices = np.array(" ".join(body[:n_vertices]).split(), dtype=np.float64).reshape(n_vertices, 3)
        triangles = []
        for line in body[n_vertices : n_vertices + n_faces]:
            idx = [int(x) for x in line.split()]
            k, poly = idx[0], idx[1 : idx[0] + 1]
            if k < 3 or len(poly) != k:
                raise ValueError(f"bad face line {line!r}")
            triangles += [(poly[0], poly[i], poly[i + 1]) for i in range(1, k - 1)]
        if len(body) < n_vertices + n_faces:
            raise ValueError(f"expected {n_vertices} vertices and {n_faces} faces, file is shorter")
        faces = torch.tensor(triangles, dtype=torch.long).reshape(-1, 3)
        if faces.numel() and (int(faces.max()) >= n_vertices or int(faces.min()) < 0):
            raise ValueError("face index out of range")
    except ValueError as err:
        raise ValueError(f"corrupt OFF file {path}: {err}") from None
    return torch.from_numpy(vertices), faces


def read_modelnet_h5(files: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``data`` ``(N, n, 3)`` and ``label`` ``(N,)`` of ModelNet HDF5 files."""
    h5py = require("h5py", "reading ModelNet40 HDF5 files")

    points, labels = [], []
    for file in files:
        try:
            with h5py.File(file, "r") as h5:
                data, label = np.asarray(h5["data"], dtype=np.float32), np.asarray(h5["label"]).reshape(-1)
        except (OSError, KeyError) as err:
            raise ValueError(
                f"corrupt ModelNet HDF5 file {file} (expected datasets 'data' and 'label'): {err}"
            ) from None
        if data.ndim != 3 or data.shape[-1] != 3 or len(data) != len(label):
            raise ValueError(f"corrupt ModelNet HDF5 file {file}: data {data.shape}, label {label.shape}")
        points.append(torch.from_numpy(data))
        labels.append(torch.from_numpy(label.astype(np.int64)))
    return torch.cat(points), torch.cat(labels)


def read_modelnet_cloud_h5(
    file: str | Path, n_points: int | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both splits of a ``ModelNet40_cloud.h5`` file: ``((train (N, n, 3) float32, labels (N,)), (test, labels))``.

    Only the first ``n_points`` points of each cloud are read (all when ``None``): the stored points
    are independent uniform samples, so a prefix is a uniform subsample, and reading it spares memory.
    """
    h5py = require("h5py", "reading ModelNet40 HDF5 files")

    try:
        with h5py.File(file, "r") as h5:
            keys = sorted(h5.keys())
            labels = next((pair for pair in CLOUD_LABEL_KEYS if set(pair) <= set(keys)), None)
            if "tr_cloud" not in keys or "test_cloud" not in keys or labels is None:
                raise ValueError(
                    f"expected datasets tr_cloud, test_cloud and tr_label, test_label (or tr_labels, test_labels); "
                    f"found {', '.join(keys) or 'none'}"
                )
            splits = [
                (np.asarray(h5[cloud][:, :n_points], dtype=np.float32), np.asarray(h5[label]).reshape(-1))
                for cloud, label in zip(("tr_cloud", "test_cloud"), labels)
            ]
    except (OSError, KeyError, IndexError, ValueError, TypeError) as err:
        raise ValueError(f"corrupt ModelNet40 cloud file {file}: {err}") from None
    for name, (points, label) in zip(("tr", "test"), splits):
        if points.ndim != 3 or points.shape[-1] != 3 or len(points) != len(label):
            raise ValueError(f"corrupt ModelNet40 cloud file {file}: {name}_cloud {points.shape}, labels {label.shape}")
        if label.dtype.kind not in "iuf" or not np.array_equal(label, np.round(label)):
            raise ValueError(f"corrupt ModelNet40 cloud file {file}: {name} labels are not integers ({label.dtype})")
    return tuple((torch.from_numpy(points), torch.from_numpy(label.astype(np.int64))) for points, label in splits)


def _bundle(train, test, class_names, n_points, augment, augmentation, seed) -> DataBundle:
    """Turn ``train``/``test`` = ``(points (N, n_stored, 3), labels (N,))`` into a ``points`` bundle."""
    (train_x, train_y), (test_x, test_y) = train, test
    stored = train_x.shape[1]
    if n_points < 1:
        raise ValueError(f"n_points must be >= 1, got {n_points}")
    if n_points > stored:
        raise ValueError(f"n_points={n_points} exceeds the {stored} points stored per shape")
    n_classes = len(class_names) if class_names else int(max(train_y.max(), test_y.max())) + 1
    info = {"kind": "points", "n_classes": n_classes, "in_features": 3, "n_points": n_points,
            "class_names": class_names or [f"class_{i}" for i in range(n_classes)]}
    return DataBundle(
        PointCloudDataset(normalize_points(train_x[:, :n_points]), train_y, augment=augment, augmentation=augmentation,
                          seed=seed),
        PointCloudDataset(normalize_points(test_x[:, :n_points]), test_y),
        info,
        FixedCollate("points"),
    )


def load_modelnet40(
    path: str | Path | None = None, *, n_points: int = 1024, augment: bool = True, augmentation: str = "pct",
    seed: int = 0,
) -> DataBundle:
    """ModelNet40 point clouds: the first ``n_points`` points of each shape.

    ``path`` is the ``modelnet40_ply_hdf5_2048`` folder (2048 points per shape) or a
    ``ModelNet40_cloud.h5`` file (10000 points per shape), or a folder holding that file.
    """
    root = require_path(path, "modelnet40", HDF5_INSTRUCTIONS)
    if root.is_dir() and not any(root.glob("ply_data_*.h5")) and (root / CLOUD_FILE).is_file():
        root = root / CLOUD_FILE
    if root.is_file():
        train, test = read_modelnet_cloud_h5(root, n_points)
        return _bundle(train, test, None, n_points, augment, augmentation, seed)
    train, test = sorted(root.glob("ply_data_train*.h5")), sorted(root.glob("ply_data_test*.h5"))
    if not train or not test:
        raise FileNotFoundError(
            f"dataset 'modelnet40': no ply_data_train*.h5 / ply_data_test*.h5 (nor {CLOUD_FILE}) in {root}. "
            f"{HDF5_INSTRUCTIONS}"
        )
    names_file = root / "shape_names.txt"
    names = names_file.read_text().split() if names_file.exists() else None
    return _bundle(read_modelnet_h5(train), read_modelnet_h5(test), names, n_points, augment, augmentation, seed)


def meshes_to_hdf5(root: str | Path, split: str, n_points: int, out: str | Path, *, seed: int = 0) -> Path:
    """Sample every ``root/<class>/<split>/*.off`` mesh to ``n_points`` points; write ``out`` (HDF5, atomically).

    The file holds ``data (N, n_points, 3)`` float32, ``label (N, 1)`` and the class names as
    attribute ``class_names``. Mesh ``i`` is sampled with seed ``seed + i`` (reproducible).
    """
    h5py = require("h5py", "reading ModelNet40 HDF5 files")

    root, out = Path(root), Path(out)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / split).is_dir())
    files = [(f, c) for c, name in enumerate(classes) for f in sorted((root / name / split).glob("*.off"))]
    if not files:
        raise FileNotFoundError(
            f"dataset 'modelnet40_off': no <class>/{split}/*.off meshes in {root}. {OFF_INSTRUCTIONS}"
        )
    data = np.empty((len(files), n_points, 3), dtype=np.float32)
    tqdm = require("tqdm.auto", "progress bars").tqdm
    for i, (file, _) in enumerate(tqdm(files, desc=f"sampling {split} meshes", unit="mesh", leave=False)):
        vertices, faces = read_off(file)
        try:
            points = sample_surface(vertices, faces, n_points, torch.Generator().manual_seed(seed + i))
        except ValueError as err:
            raise ValueError(f"cannot sample OFF file {file}: {err}") from None
        data[i] = normalize_points(points).float().numpy()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with h5py.File(tmp, "w") as h5:
        h5["data"] = data
        h5["label"] = np.array([c for _, c in files], dtype=np.uint8).reshape(-1, 1)
        h5.attrs["class_names"] = " ".join(classes)
    os.replace(tmp, out)
    return out


def load_modelnet40_off(
    path: str | Path | None = None,
    *,
    n_points: int = 5000,
    augment: bool = True,
    augmentation: str = "rotate_scale",
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> DataBundle:
    """ModelNet40 meshes sampled to ``n_points`` points per shape (cached in ``cache_dir``, default ``path``)."""
    h5py = require("h5py", "reading ModelNet40 HDF5 files")

    root = require_path(path, "modelnet40_off", OFF_INSTRUCTIONS)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else root
    cache.mkdir(parents=True, exist_ok=True)
    files = []
    for split in ("train", "test"):
        file = cache / f"sinkformer_{split}_{n_points}pts_seed{seed}.h5"
        if not file.exists():
            meshes_to_hdf5(root, split, n_points, file, seed=seed)
        files.append([file])
    with h5py.File(files[0][0], "r") as h5:
        names = str(h5.attrs["class_names"]).split()
    return _bundle(read_modelnet_h5(files[0]), read_modelnet_h5(files[1]), names, n_points, augment, augmentation, seed)
