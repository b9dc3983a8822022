import gzip
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from sinkformer.data import load_dataset
from sinkformer.data.mnist import MNIST_MEAN_STD, read_idx


def write_idx(path, array: np.ndarray, type_code: int = 0x08) -> None:
    dtype = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[type_code]
    raw = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw += array.astype(dtype).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(raw)


def test_read_idx_types_and_gzip(tmp_path):
    ints = np.arange(24, dtype=np.int64).reshape(2, 3, 4) - 5
    write_idx(tmp_path / "a.idx", ints, 0x0C)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.idx"), ints)
    floats = np.linspace(-1, 1, 6).reshape(6)
    write_idx(tmp_path / "b.idx.gz", floats, 0x0D)
    np.testing.assert_allclose(read_idx(tmp_path / "b.idx.gz"), floats, rtol=1e-6)


def test_mnist_from_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) for s, n in (("train", 6), ("t10k", 3))}
    labels = {s: rng.integers(0, 10, len(images[s]), dtype=np.uint8) for s in images}
    for split in images:  # one split gzipped, one plain, as found in the wild
        suffix = ".gz" if split == "train" else ""
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", images[split])
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", labels[split])
    data = load_dataset("mnist", tmp_path)
    assert data.info == {"kind": "images", "n_classes": 10, "image_size": 28, "channels": 1,
                         "class_names": [str(d) for d in range(10)]}
    x, y = data.train[4]
    mean, std = MNIST_MEAN_STD
    torch.testing.assert_close(x[0], (torch.from_numpy(images["train"][4]).float() / 255 - mean) / std)
    assert y == labels["train"][4] and len(data.test) == 3
    inputs, targets = data.collate([data.train[i] for i in range(4)])
    assert inputs["images"].shape == (4, 1, 28, 28) and targets.tolist() == labels["train"][:4].tolist()


def test_mnist_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="Download the four MNIST IDX files"):
        load_dataset("mnist", tmp_path / "nowhere")
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28), dtype=np.uint8))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))  # 5 labels promised
    with pytest.raises(ValueError, match="corrupt IDX file .*train-labels-idx1-ubyte.*5 bytes.*found 2"):
        read_idx(tmp_path / "train-labels-idx1-ubyte")
    (tmp_path / "junk").write_bytes(b"PK\x03\x04")
    with pytest.raises(ValueError, match="corrupt IDX file .*junk: bad magic"):
        read_idx(tmp_path / "junk")


def _write_images(folder, colour, n):
    folder.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (20 + i, 12), colour).save(folder / f"{folder.name}.{i}.jpg" if i % 2 else folder / f"{i}.png")


def test_image_folder_per_class_resized(tmp_path):
    _write_images(tmp_path / "cat", (255, 0, 0), 5)
    _write_images(tmp_path / "dog", (0, 0, 255), 5)
    (tmp_path / "notes.txt").write_text("not an image folder")
    data = load_dataset("image_folder", tmp_path, image_size=16, test_fraction=0.2)
    assert data.info["class_names"] == ["cat", "dog"] and data.info["n_classes"] == 2
    assert len(data.train) == 8 and len(data.test) == 2
    for dataset in (data.train, data.test):
        for i in range(len(dataset)):
            x, label = dataset[i]
            assert x.shape == (3, 16, 16)
            red, blue = x[0].mean().item(), x[2].mean().item()
            assert (red > 0.9 and blue < -0.9) if label == 0 else (blue > 0.9 and red < -0.9)


def test_image_folder_train_test_layout_grey_and_corrupt_file(tmp_path):
    for split, n in (("train", 3), ("test", 2)):
        _write_images(tmp_path / split / "cat", (200, 200, 200), n)
        _write_images(tmp_path / split / "dog", (10, 10, 10), n)
    data = load_dataset("image_folder", tmp_path, image_size=8, channels=1)
    assert len(data.train) == 6 and len(data.test) == 4
    assert data.train[0][0].shape == (1, 8, 8)
    (tmp_path / "train" / "dog" / "broken.jpg").write_bytes(b"not a jpeg")
    data = load_dataset("image_folder", tmp_path, image_size=8)
    broken = [i for i, (path, _) in enumerate(data.train.samples) if path.name == "broken.jpg"][0]
    with pytest.raises(ValueError, match="cannot decode image .*broken.jpg"):
        data.train[broken]


def test_image_folder_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="dogs-vs-cats"):
        load_dataset("image_folder", tmp_path / "missing")
    (tmp_path / "cat").mkdir()
    with pytest.raises(FileNotFoundError, match="1 class folder"):
        load_dataset("image_folder", tmp_path)


def test_digits_is_embedded():
    data = load_dataset("digits")
    assert len(data.train) + len(data.test) == 1797
    x, y = data.train[0]
    assert x.shape == (1, 8, 8) and 0.0 <= x.min() and x.max() <= 1.0 and 0 <= y < 10
    with pytest.raises(ValueError, match="embedded and takes no path"):
        load_dataset("digits", "/some/where")
