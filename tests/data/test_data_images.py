import gzip
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from sinkformer.data import load_dataset
from sinkformer.data.cifar10 import load_cifar10_pixels, read_cifar10_batch, read_cifar10_python_batch
from sinkformer.data.image_folder import CROP_RATIO, CROP_SCALE, random_resized_box
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


def _write_kaggle(folder, n_cats, n_dogs):
    """Kaggle's flat train/: red cat.<i>.jpg and blue dog.<i>.jpg."""
    folder.mkdir(parents=True)
    for i in range(n_cats):
        Image.new("RGB", (10, 8), (255, 0, 0)).save(folder / f"cat.{i}.jpg")
    for i in range(n_dogs):
        Image.new("RGB", (10, 8), (0, 0, 255)).save(folder / f"dog.{100 + i}.jpg")


def _assert_colour_matches_label(dataset):
    for i in range(len(dataset)):
        x, label = dataset[i]
        red, blue = x[0].mean().item(), x[2].mean().item()
        assert (red > 0.9 and blue < -0.9) if label == 0 else (blue > 0.9 and red < -0.9)


def test_image_folder_kaggle_layout_labels_from_names_and_ignores_test1(tmp_path):
    _write_kaggle(tmp_path / "train", 4, 6)
    (tmp_path / "test1").mkdir()
    for i in range(1, 4):
        Image.new("RGB", (10, 8), (0, 255, 0)).save(tmp_path / "test1" / f"{i}.jpg")
    (tmp_path / "sampleSubmission.csv").write_text("id,label\n")
    data = load_dataset("image_folder", tmp_path, image_size=8, test_fraction=0.2)
    assert data.info["class_names"] == ["cat", "dog"] and data.info["ignored"] == ["test1"]
    assert len(data.train) == 8 and len(data.test) == 2
    samples = data.train.samples + data.test.samples
    assert sorted(path.name for path, _ in samples) == sorted(p.name for p in (tmp_path / "train").iterdir())
    assert all(label == ("cat", "dog").index(path.name.split(".")[0]) for path, label in samples)
    _assert_colour_matches_label(data.train)
    _assert_colour_matches_label(data.test)
    direct = load_dataset("image_folder", tmp_path / "train", image_size=8, test_fraction=0.2)  # train/ itself
    assert direct.info["class_names"] == ["cat", "dog"] and direct.info["ignored"] == []
    assert direct.train.samples == data.train.samples and direct.test.samples == data.test.samples


def test_image_folder_kaggle_names_sorted_into_class_folders_stay_class_folders(tmp_path):
    # the result of INSTRUCTIONS' `mv cat.*.jpg cat/`: one label per folder, so the folders are the classes
    _write_kaggle(tmp_path / "tmp", 3, 3)
    for animal in ("cat", "dog"):
        (tmp_path / animal).mkdir()
        for file in (tmp_path / "tmp").glob(f"{animal}.*.jpg"):
            file.rename(tmp_path / animal / file.name)
    (tmp_path / "tmp").rmdir()
    data = load_dataset("image_folder", tmp_path, image_size=8, test_fraction=0.5)
    assert data.info["class_names"] == ["cat", "dog"] and data.info["ignored"] == []
    assert len(data.train) + len(data.test) == 6
    _assert_colour_matches_label(data.train)


def test_image_folder_ambiguous_kaggle_layout_says_how_to_arrange(tmp_path):
    _write_kaggle(tmp_path / "train", 2, 2)
    (tmp_path / "extra").mkdir()
    Image.new("RGB", (10, 8), (0, 255, 0)).save(tmp_path / "extra" / "bird.7.jpg")  # labelled: not test1-like
    with pytest.raises(ValueError, match=r"ambiguous: train/ holds images labelled by name .* extra/.*mkdir cat dog"):
        load_dataset("image_folder", tmp_path)


def _write_noise(folder, n, seed):
    """PNGs of random noise, 20 wide and 14 high: no allowed crop (ratio <= 4/3) is the whole image."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (14, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def _items(dataset):
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def test_image_folder_augmentation_train_only_seeded(tmp_path):
    _write_noise(tmp_path / "a", 5, 0)
    _write_noise(tmp_path / "b", 5, 1)
    plain = load_dataset("image_folder", tmp_path, image_size=8)
    augmented = load_dataset("image_folder", tmp_path, image_size=8, augment=True)
    assert augmented.train.samples == plain.train.samples and augmented.test.samples == plain.test.samples
    torch.manual_seed(0)
    first = _items(augmented.train)
    torch.manual_seed(0)
    again = _items(augmented.train)
    torch.manual_seed(1)
    other = _items(augmented.train)
    reference = _items(plain.train)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == reference.shape == (8, 3, 8, 8)
    assert first.min() >= -1 and first.max() <= 1
    assert all(not torch.equal(a, b) for a, b in zip(first, reference))  # every item is a strict crop
    torch.manual_seed(2)
    assert torch.equal(_items(augmented.test), _items(plain.test))


def test_random_resized_box_respects_scale_and_ratio():
    torch.manual_seed(0)
    for width, height in ((200, 150), (150, 200), (300, 100)):
        for _ in range(50):
            left, top, right, bottom = random_resized_box(width, height)
            w, h = right - left, bottom - top
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            if (width, height) != (300, 100):  # 3:1 admits no box of ratio <= 4/3 and area >= 80%: central fallback
                assert CROP_SCALE[0] - 0.02 <= w * h / (width * height) <= CROP_SCALE[1]
                assert CROP_RATIO[0] - 0.02 <= w / h <= CROP_RATIO[1] + 0.02
            else:
                assert (w, h, left, top) == (133, 100, 83, 0)


# --- CIFAR-10: the binary and the Python (pickle) release ------------------------------------------


class _Python2Pickler(pickle._Pickler):
    """Writes ``bytes`` as Python 2 ``str`` (BINSTRING), as cPickle wrote the CIFAR-10 release."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _write_cifar_releases(root, python2_style=False):
    """The same tiny CIFAR-10 (2 images per train batch, 3 test images) in both releases."""
    bin_dir, py_dir = root / "bin" / "cifar-10-batches-bin", root / "py" / "cifar-10-batches-py"
    bin_dir.mkdir(parents=True)
    py_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = 3 if name == "test_batch" else 2
        images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, n)
        channel_major = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # 1024 red, 1024 green, 1024 blue
        records = np.concatenate([labels[:, None].astype(np.uint8), channel_major], axis=1)
        (bin_dir / f"{name}.bin").write_bytes(records.tobytes())
        batch = {b"batch_label": name.encode(), b"labels": labels.tolist(), b"data": channel_major,
                 b"filenames": [f"img_{i}.png".encode() for i in range(n)]}
        with open(py_dir / name, "wb") as fh:
            if python2_style:
                _Python2Pickler(fh, protocol=2).dump(batch)
            else:
                pickle.dump(batch, fh, protocol=2)  # Python 3 writes bytes through _codecs.encode
        written[name] = (images, labels)
    return bin_dir, py_dir, written


@pytest.mark.parametrize("python2_style", [False, True])
def test_cifar10_python_release_equals_binary_release(tmp_path, python2_style):
    bin_dir, py_dir, written = _write_cifar_releases(tmp_path, python2_style)
    images, labels = read_cifar10_python_batch(py_dir / "data_batch_3")
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64
    assert torch.equal(images, torch.from_numpy(written["data_batch_3"][0]))
    assert labels.tolist() == written["data_batch_3"][1].tolist()
    for a, b in zip(read_cifar10_batch(bin_dir / "test_batch.bin"), read_cifar10_python_batch(py_dir / "test_batch")):
        assert torch.equal(a, b)
    from_bin = load_cifar10_pixels(bin_dir)
    from_py = load_cifar10_pixels(tmp_path / "py")  # the folder holding cifar-10-batches-py
    assert torch.equal(from_bin.train.rows, from_py.train.rows) and torch.equal(from_bin.test.rows, from_py.test.rows)
    assert from_py.info == from_bin.info and from_py.train.rows.shape == (10, 3073)
    expected = torch.from_numpy(written["data_batch_2"][0][1].reshape(-1)).long()  # image 4 = batch 2's second
    assert from_py.train.rows[3, 0] == 256 and torch.equal(from_py.train.rows[3, 1:], expected)


def test_cifar10_missing_or_corrupt_python_release(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds neither release.*binary release.*Python release"):
        load_cifar10_pixels(tmp_path / "empty")
    _, py_dir, _ = _write_cifar_releases(tmp_path)
    (py_dir / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="lacks cifar-10-batches-py/test_batch;.*cifar-10-python.tar.gz"):
        load_cifar10_pixels(tmp_path / "py")
    with open(py_dir / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}, fh, protocol=2)
    with pytest.raises(ValueError, match=r"test_batch: b'data' must be an \(N, 3072\) uint8 array, got uint8 array"):
        load_cifar10_pixels(tmp_path / "py")
    (py_dir / "test_batch").write_bytes(b"\x80\x02}q\x00")  # truncated
    with pytest.raises(ValueError, match="corrupt or unsafe CIFAR-10 Python batch .*test_batch"):
        read_cifar10_python_batch(py_dir / "test_batch")


def test_cifar10_python_batch_refuses_code_in_the_pickle(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil").write_bytes(f"cos\nsystem\n(Vtouch {marker}\ntR.".encode())  # os.system("touch ...")
    with pytest.raises(ValueError, match="unsafe CIFAR-10 Python batch .*evil: refusing global os.system"):
        read_cifar10_python_batch(tmp_path / "evil")
    assert not marker.exists()
    (tmp_path / "codec").write_bytes(b"c_codecs\nencode\n(Vx\nVrot13\ntR.")  # bytes only via latin-1
    with pytest.raises(ValueError, match="encoding 'rot13' is not allowed"):
        read_cifar10_python_batch(tmp_path / "codec")


def test_digits_is_embedded():
    data = load_dataset("digits")
    assert len(data.train) + len(data.test) == 1797
    x, y = data.train[0]
    assert x.shape == (1, 8, 8) and 0.0 <= x.min() and x.max() <= 1.0 and 0 <= y < 10
    with pytest.raises(ValueError, match="embedded and takes no path"):
        load_dataset("digits", "/some/where")
