import h5py
import numpy as np
import pytest
import torch

from sinkformer.data import load_dataset
from sinkformer.data.modelnet import read_off
from sinkformer.data.point_clouds import normalize_points, sample_surface
from sinkformer.data.shapes3d import SHAPES

CUBE_OFF = """OFF
# a unit cube with quad faces
8 6 0
-1 -1 -1
1 -1 -1
1 1 -1
-1 1 -1
-1 -1 1
1 -1 1
1 1 1
-1 1 1
4 0 3 2 1
4 4 5 6 7
4 0 1 5 4
4 2 3 7 6
4 0 4 7 3
4 1 2 6 5
"""
# ModelNet's quirk: the counts glued to the header
TETRA_OFF = "OFF4 4 0\n0 0 0\n1 0 0\n0 1 0\n0 0 1\n3 0 1 2\n3 0 1 3\n3 0 2 3\n3 1 2 3\n"


def test_read_off_triangulates_and_accepts_glued_header(tmp_path):
    (tmp_path / "cube.off").write_text(CUBE_OFF)
    (tmp_path / "tetra.off").write_text(TETRA_OFF)
    vertices, faces = read_off(tmp_path / "cube.off")
    assert vertices.shape == (8, 3) and faces.shape == (12, 3)
    vertices, faces = read_off(tmp_path / "tetra.off")
    assert vertices.shape == (4, 3) and faces.tolist()[0] == [0, 1, 2]


def test_read_off_errors_name_the_file(tmp_path):
    (tmp_path / "bad.off").write_text("OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 7\n")
    with pytest.raises(ValueError, match="corrupt OFF file .*bad.off.*out of range"):
        read_off(tmp_path / "bad.off")
    (tmp_path / "short.off").write_text("OFF\n3 1 0\n0 0 0\n")
    with pytest.raises(ValueError, match="corrupt OFF file .*short.off"):
        read_off(tmp_path / "short.off")
    (tmp_path / "ply.off").write_text("ply\nformat ascii 1.0\n")
    with pytest.raises(ValueError, match="corrupt OFF file .*ply.off.*header"):
        read_off(tmp_path / "ply.off")


def test_surface_sampling_is_area_weighted_and_on_the_surface(tmp_path):
    # two triangles in the plane z=0: areas 1/2 (x+y<=1, x,y>=0) and 3/2 (shifted to x>=2)
    vertices = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [2, 0, 0], [5, 0, 0], [2, 1, 0]], dtype=torch.float64)
    faces = torch.tensor([[0, 1, 2], [3, 4, 5]])
    points = sample_surface(vertices, faces, 40_000, torch.Generator().manual_seed(0))
    first = points[:, 0] < 1.5
    assert first.double().mean().item() == pytest.approx(0.25, abs=0.01)
    p = points[first]
    assert bool((p[:, :2] >= 0).all() and (p[:, 0] + p[:, 1] <= 1 + 1e-12).all() and (points[:, 2] == 0).all())
    # uniform within a triangle: the fraction below y = 1/2 in the first one is 3/4
    assert (p[:, 1] < 0.5).double().mean().item() == pytest.approx(0.75, abs=0.015)
    (tmp_path / "cube.off").write_text(CUBE_OFF)
    cube = sample_surface(*read_off(tmp_path / "cube.off"), 1000)
    torch.testing.assert_close(cube.abs().amax(-1), torch.ones(1000, dtype=torch.float64))


def _write_h5(path, n, points, classes, seed):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as h5:
        h5["data"] = rng.normal(size=(n, points, 3)).astype(np.float32)
        h5["label"] = rng.integers(0, classes, (n, 1)).astype(np.uint8)
        h5["normal"] = np.zeros((n, points, 3), dtype=np.float32)


def test_modelnet40_hdf5_release(tmp_path):
    for i, n in enumerate((5, 4)):
        _write_h5(tmp_path / f"ply_data_train{i}.h5", n, 64, 3, i)
    _write_h5(tmp_path / "ply_data_test0.h5", 3, 64, 3, 9)
    (tmp_path / "shape_names.txt").write_text("airplane\nbathtub\nbed\n")
    data = load_dataset("modelnet40", tmp_path, n_points=32, augment=False)
    assert data.info == {"kind": "points", "n_classes": 3, "in_features": 3, "n_points": 32,
                         "class_names": ["airplane", "bathtub", "bed"]}
    assert len(data.train) == 9 and len(data.test) == 3
    x, y = data.train[5]
    with h5py.File(tmp_path / "ply_data_train1.h5") as h5:
        raw, label = torch.from_numpy(h5["data"][0, :32]), int(h5["label"][0, 0])
    torch.testing.assert_close(x, normalize_points(raw))
    assert y == label and x.norm(dim=-1).max().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n_points=100 exceeds the 64 points"):
        load_dataset("modelnet40", tmp_path, n_points=100)
    (tmp_path / "ply_data_test1.h5").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt ModelNet HDF5 file .*ply_data_test1.h5"):
        load_dataset("modelnet40", tmp_path)
    with pytest.raises(FileNotFoundError, match="modelnet40_ply_hdf5_2048"):
        load_dataset("modelnet40", tmp_path / "nothing")


@pytest.mark.parametrize("label_keys", [("tr_label", "test_label"), ("tr_labels", "test_labels")])
def test_modelnet40_sinkformers_cloud_file_matches_the_hdf5_folder(tmp_path, label_keys):
    rng = np.random.default_rng(0)
    clouds = {"tr": rng.normal(size=(6, 50, 3)), "test": rng.normal(size=(4, 50, 3))}  # float64, as written there
    labels = {"tr": np.array([0, 1, 2, 0, 1, 2]), "test": np.array([2, 1, 0, 0])}
    with h5py.File(tmp_path / "ModelNet40_cloud.h5", "w") as h5:
        for split, key in zip(("tr", "test"), label_keys):
            h5[f"{split}_cloud"], h5[key] = clouds[split], labels[split]
    folder = tmp_path / "modelnet40_ply_hdf5_2048"  # the same shapes in the PointNet release's layout
    folder.mkdir()
    for split, name in (("tr", "train"), ("test", "test")):
        with h5py.File(folder / f"ply_data_{name}0.h5", "w") as h5:
            h5["data"], h5["label"] = clouds[split].astype(np.float32), labels[split].reshape(-1, 1).astype(np.uint8)
    data = load_dataset("modelnet40", tmp_path / "ModelNet40_cloud.h5", n_points=20, augment=False)
    assert data.info == {"kind": "points", "n_classes": 3, "in_features": 3, "n_points": 20,
                         "class_names": ["class_0", "class_1", "class_2"]}
    assert len(data.train) == 6 and len(data.test) == 4
    x, y = data.test[1]
    torch.testing.assert_close(x, normalize_points(torch.from_numpy(clouds["test"][1, :20]).float()))
    assert y == 1 and [data.train[i][1] for i in range(6)] == labels["tr"].tolist()
    same = load_dataset("modelnet40", folder, n_points=20, augment=False)
    assert same.info == data.info
    for a, b in ((data.train, same.train), (data.test, same.test)):
        assert torch.equal(a.points, b.points) and torch.equal(a.labels, b.labels)
    holder = load_dataset("modelnet40", tmp_path, n_points=20, augment=False)  # the folder holding the file
    assert torch.equal(holder.train.points, data.train.points)
    with pytest.raises(ValueError, match="n_points=60 exceeds the 50 points"):
        load_dataset("modelnet40", tmp_path / "ModelNet40_cloud.h5", n_points=60)


def test_modelnet40_cloud_file_with_unknown_keys_lists_them(tmp_path):
    with h5py.File(tmp_path / "clouds.h5", "w") as h5:
        h5["tr_cloud"], h5["test_cloud"] = np.zeros((2, 5, 3)), np.zeros((1, 5, 3))
        h5["tr_y"], h5["test_y"] = np.zeros(2), np.zeros(1)
    with pytest.raises(ValueError, match="clouds.h5: expected datasets .*; found test_cloud, test_y, tr_cloud, tr_y"):
        load_dataset("modelnet40", tmp_path / "clouds.h5")
    with h5py.File(tmp_path / "clouds.h5", "a") as h5:
        h5["tr_label"], h5["test_label"] = np.array([0.0, 1.5]), np.array([1.0])
    with pytest.raises(ValueError, match="clouds.h5: tr labels are not integers"):
        load_dataset("modelnet40", tmp_path / "clouds.h5")
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match="corrupt ModelNet40 cloud file .*garbage.h5"):
        load_dataset("modelnet40", tmp_path / "garbage.h5")


def test_modelnet40_meshes_are_sampled_and_cached(tmp_path):
    for cls, text in (("cube", CUBE_OFF), ("tetra", TETRA_OFF)):
        for split, n in (("train", 2), ("test", 1)):
            (tmp_path / cls / split).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (tmp_path / cls / split / f"{cls}_{i:04d}.off").write_text(text)
    data = load_dataset("modelnet40_off", tmp_path, n_points=2000, augment=False)
    assert data.info["class_names"] == ["cube", "tetra"] and len(data.train) == 4 and len(data.test) == 2
    assert [data.train[i][1] for i in range(4)] == [0, 0, 1, 1]
    cube = data.train[0][0]  # on the surface of a cube centred (up to sampling) at 0: |coord|max is constant
    side = cube.abs().amax(-1)
    assert (side.max() - side.min()).item() < 0.08 and side.mean().item() == pytest.approx(3 ** -0.5, abs=0.03)
    cache = sorted(p.name for p in tmp_path.glob("sinkformer_*.h5"))
    assert cache == ["sinkformer_test_2000pts_seed0.h5", "sinkformer_train_2000pts_seed0.h5"]
    again = load_dataset("modelnet40_off", tmp_path, n_points=2000, augment=False)  # from the cache
    torch.testing.assert_close(again.train.points, data.train.points)
    (tmp_path / "cube" / "test" / "cube_0000.off").write_text("OFF\n1 1 0\n0 0 0\n3 0 0 9\n")
    with pytest.raises(ValueError, match="corrupt OFF file .*cube_0000.off"):
        load_dataset("modelnet40_off", tmp_path, n_points=60)


def test_shapes3d_is_deterministic_with_random_poses():
    data = load_dataset("shapes3d", n_points=64, n_train=3, n_test=1)
    assert data.info["n_classes"] == len(SHAPES) >= 10 and len(data.train) == 3 * len(SHAPES)
    again = load_dataset("shapes3d", n_points=64, n_train=3, n_test=1)
    torch.testing.assert_close(again.train.points, data.train.points)
    cubes = data.train.points[data.train.labels == list(SHAPES).index("cube")]
    assert not torch.allclose(cubes[0], cubes[1])  # different pose, scale and noise
    norms = data.train.points.norm(dim=-1).amax(-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))  # scaled into the unit ball
    assert not torch.allclose(data.train.points[:3], data.test.points[:3])


def test_point_augmentation_depends_on_epoch_only():
    data = load_dataset("shapes3d", n_points=16, n_train=1, n_test=1, augment=True)
    data.train.set_epoch(3)
    a = data.train[2][0]
    data.train.set_epoch(4)
    b = data.train[2][0]
    data.train.set_epoch(3)
    torch.testing.assert_close(data.train[2][0], a)
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, data.train.points[2])


def test_rotate_scale_augmentation_is_the_set_transformer_authors():
    """A rotation about z by at most 0.15 pi, then a per-axis scale in [0.8, 1.25]; seeded per (epoch, index)."""
    import math

    from sinkformer.data.point_clouds import PointCloudDataset

    points = torch.eye(3).repeat(8, 1, 1)  # clouds of the three unit vectors: e_x, e_y, e_z
    data = PointCloudDataset(points, torch.zeros(8, dtype=torch.long), augment=True, augmentation="rotate_scale")
    for index in range(8):
        x, _ = data[index]  # rows: (c sx, s sy, 0), (-s sx, c sy, 0), (0, 0, sz)
        sx, sy, sz = math.hypot(x[0, 0], x[1, 0]), math.hypot(x[0, 1], x[1, 1]), float(x[2, 2])
        theta = math.atan2(-float(x[1, 0]), float(x[0, 0]))
        assert all(0.8 <= s <= 1.25 for s in (sx, sy, sz)) and abs(theta) <= 0.15 * math.pi
        assert x[0, 1] == pytest.approx(math.sin(theta) * sy, abs=1e-6)
        assert x[1, 1] == pytest.approx(math.cos(theta) * sy, abs=1e-6)
        assert torch.count_nonzero(x[2, :2]) == 0 and torch.count_nonzero(x[:2, 2]) == 0  # z only scaled
    first = data[3][0]
    data.set_epoch(1)
    assert not torch.equal(data[3][0], first)
    data.set_epoch(0)
    assert torch.equal(data[3][0], first)
    with pytest.raises(ValueError, match="augmentation must be one of"):
        PointCloudDataset(points, torch.zeros(8), augmentation="jitter")
