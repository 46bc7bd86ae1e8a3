"""MNIST from local files (`energyattn.data.load_mnist`), on tiny files written by the tests."""

import gzip
import pathlib
import struct

import numpy as np
import pytest

import energyattn as ea

STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _idx_bytes(array, *, type_code=8, dims=None):
    """IDX encoding written from the format's description, independently of the loader."""
    dims = array.shape if dims is None else dims
    header = struct.pack(">HBB", 0, type_code, len(dims))
    header += struct.pack(f">{len(dims)}I", *dims)
    return header + np.asarray(array, dtype=np.uint8).tobytes()


def _fake(num, height=28, width=28, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(num, height, width), dtype=np.uint8)
    pixels[0, 0, 0], pixels[0, 0, 1] = 0, 255  # both extremes, for the exact /255 check
    labels = rng.integers(0, 10, size=num, dtype=np.uint8)
    return pixels, labels


def _write(path, data, compress=False):
    path = pathlib.Path(path)
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def _write_split(directory, split, pixels, labels, *, compress=False, dotted=False):
    paths = []
    for stem, array in zip(STEMS[split], (pixels, labels), strict=True):
        name = stem.replace("-idx", ".idx") if dotted else stem
        paths.append(_write(directory / name, _idx_bytes(array), compress))
    return paths


@pytest.fixture
def mnist_dir(tmp_path):
    """A directory with 5 training and 3 test 28x28 examples as raw IDX files."""
    train = _fake(5, seed=1)
    test = _fake(3, seed=2)
    _write_split(tmp_path, "train", *train)
    _write_split(tmp_path, "test", *test)
    return tmp_path, {"train": train, "test": test}


def _assert_round_trip(mnist, pixels, labels):
    assert isinstance(mnist, ea.data.Mnist)
    images, got_labels = mnist  # a named tuple unpacks
    assert images.dtype == np.float64 and got_labels.dtype == np.int64
    assert images.shape == pixels.shape and got_labels.shape == labels.shape
    np.testing.assert_array_equal(images, pixels.astype(np.float64) / 255.0)
    np.testing.assert_array_equal(got_labels, labels.astype(np.int64))
    assert np.all((images >= 0.0) & (images <= 1.0))


# ---------------------------------------------------------------- IDX round trips


@pytest.mark.parametrize("split", ["train", "test"])
def test_raw_idx_round_trip(mnist_dir, split):
    directory, data = mnist_dir
    mnist = ea.data.load_mnist(directory, split)
    _assert_round_trip(mnist, *data[split])
    assert mnist.images.shape[0] == {"train": 5, "test": 3}[split]
    assert mnist.images[0, 0, 0] == 0.0 and mnist.images[0, 0, 1] == 1.0


def test_default_split_is_train_and_str_path(mnist_dir):
    directory, data = mnist_dir
    _assert_round_trip(ea.data.load_mnist(str(directory)), *data["train"])


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dotted", [False, True])
def test_gzip_and_dotted_names(tmp_path, compress, dotted):
    train, test = _fake(5, seed=3), _fake(3, seed=4)
    _write_split(tmp_path, "train", *train, compress=compress, dotted=dotted)
    _write_split(tmp_path, "test", *test, compress=compress, dotted=dotted)
    _assert_round_trip(ea.data.load_mnist(tmp_path, "train"), *train)
    _assert_round_trip(ea.data.load_mnist(tmp_path, "test"), *test)


def test_image_size_comes_from_the_file(tmp_path):
    pixels, labels = _fake(4, height=4, width=6, seed=5)
    _write_split(tmp_path, "train", pixels, labels)
    mnist = ea.data.load_mnist(tmp_path)
    assert mnist.images.shape == (4, 4, 6)
    _assert_round_trip(mnist, pixels, labels)


def test_only_the_requested_split_is_needed(tmp_path):
    test = _fake(3, seed=6)
    _write_split(tmp_path, "test", *test)
    _assert_round_trip(ea.data.load_mnist(tmp_path, "test"), *test)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        ea.data.load_mnist(tmp_path, "train")


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("limit", [0, 1, 2, 5, 100])
def test_limit(tmp_path, compress, limit):
    pixels, labels = _fake(5, seed=7)
    _write_split(tmp_path, "train", pixels, labels, compress=compress)
    mnist = ea.data.load_mnist(tmp_path, limit=limit)
    _assert_round_trip(mnist, pixels[:limit], labels[:limit])


# ---------------------------------------------------------------- npz


def _keras_arrays(seed=8):
    (x_train, y_train), (x_test, y_test) = _fake(5, seed=seed), _fake(3, seed=seed + 1)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


@pytest.mark.parametrize("split", ["train", "test"])
def test_npz_file_round_trip(tmp_path, split):
    arrays = _keras_arrays()
    np.savez(tmp_path / "whatever.npz", **arrays)
    mnist = ea.data.load_mnist(tmp_path / "whatever.npz", split)
    x, y = ("x_train", "y_train") if split == "train" else ("x_test", "y_test")
    _assert_round_trip(mnist, arrays[x], arrays[y])


def test_npz_in_directory_and_limit(tmp_path):
    arrays = _keras_arrays()
    np.savez_compressed(tmp_path / "mnist.npz", **arrays)
    _assert_round_trip(ea.data.load_mnist(tmp_path, "test"), arrays["x_test"], arrays["y_test"])
    limited = ea.data.load_mnist(tmp_path, limit=2)
    _assert_round_trip(limited, arrays["x_train"][:2], arrays["y_train"][:2])


def test_npz_float_images_are_kept(tmp_path):
    arrays = _keras_arrays()
    scaled = arrays["x_train"].astype(np.float32) / 255.0
    np.savez(tmp_path / "mnist.npz", **{**arrays, "x_train": scaled})
    mnist = ea.data.load_mnist(tmp_path)
    assert mnist.images.dtype == np.float64
    np.testing.assert_array_equal(mnist.images, scaled.astype(np.float64))
    np.testing.assert_array_equal(mnist.labels, arrays["y_train"])


def test_idx_files_take_precedence_over_npz(mnist_dir):
    directory, data = mnist_dir
    np.savez(directory / "mnist.npz", **_keras_arrays(seed=20))
    _assert_round_trip(ea.data.load_mnist(directory), *data["train"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"y_train": None}, "y_train"),
        ({"x_train": np.full((5, 28, 28), 2.0)}, r"\[0, 1\]"),
        ({"x_train": np.full((5, 28, 28), np.nan)}, r"\[0, 1\]"),
        ({"x_train": np.full((5, 28, 28), 256, dtype=np.int64)}, "0..255"),
        ({"x_train": np.zeros((5, 784), dtype=np.uint8)}, "3-D"),
        ({"y_train": np.zeros(4, dtype=np.uint8)}, "5 images"),
        ({"y_train": np.full(5, 10, dtype=np.uint8)}, "label 10"),
        ({"y_train": np.zeros(5, dtype=np.float32)}, "integers"),
    ],
)
def test_npz_bad_contents(user_mode, tmp_path, change, match):
    arrays = {**_keras_arrays(), **change}
    np.savez(tmp_path / "mnist.npz", **{k: v for k, v in arrays.items() if v is not None})
    with pytest.raises(ValueError, match=match):
        ea.data.load_mnist(tmp_path / "mnist.npz")


def test_a_file_that_is_not_npz(user_mode, mnist_dir):
    directory, _ = mnist_dir
    with pytest.raises(ValueError, match="not an .npz file"):
        ea.data.load_mnist(directory / "train-images-idx3-ubyte")


# ---------------------------------------------------------------- missing files


def test_missing_files_never_download(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        ea.data.load_mnist(tmp_path, "test")
    message = str(info.value)
    for name in [
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
        "t10k-images.idx3-ubyte.gz",
        "mnist.npz",
        str(tmp_path),
    ]:
        assert name in message
    assert "never downloads" in message
    assert list(tmp_path.iterdir()) == []  # nothing was fetched or created


def test_missing_labels_file_is_named(tmp_path):
    pixels, _ = _fake(5)
    _write(tmp_path / "train-images-idx3-ubyte", _idx_bytes(pixels))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte") as info:
        ea.data.load_mnist(tmp_path)
    assert "found train-images-idx3-ubyte" in str(info.value)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="download"):
        ea.data.load_mnist(tmp_path / "nowhere")


# ---------------------------------------------------------------- malformed IDX files


def _write_pair(directory, images_bytes, labels_bytes, compress=False):
    images_stem, labels_stem = STEMS["train"]
    _write(directory / images_stem, images_bytes, compress)
    _write(directory / labels_stem, labels_bytes, compress)


def test_bad_magic(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, b"\x01\x02" + _idx_bytes(pixels)[2:], _idx_bytes(labels))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.*magic"):
        ea.data.load_mnist(tmp_path)


def test_unsupported_type_code(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, _idx_bytes(pixels), _idx_bytes(labels, type_code=0x0D))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.*0x0d"):
        ea.data.load_mnist(tmp_path)


def test_wrong_number_of_dimensions(user_mode, tmp_path):
    pixels, labels = _fake(5)
    flat = _idx_bytes(pixels.reshape(5, -1))
    _write_pair(tmp_path, flat, _idx_bytes(labels))
    with pytest.raises(ValueError, match="3-D"):
        ea.data.load_mnist(tmp_path)


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_data(user_mode, tmp_path, compress):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, _idx_bytes(pixels)[:-1], _idx_bytes(labels), compress)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.*truncated"):
        ea.data.load_mnist(tmp_path)
    # The first examples are still all there, so a small `limit` reads them.
    mnist = ea.data.load_mnist(tmp_path, limit=4)
    _assert_round_trip(mnist, pixels[:4], labels[:4])


def test_truncated_header(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, _idx_bytes(pixels)[:10], _idx_bytes(labels))
    with pytest.raises(ValueError, match="truncated"):
        ea.data.load_mnist(tmp_path)


def test_header_claiming_huge_dimensions(user_mode, tmp_path):
    pixels, labels = _fake(5)
    huge = _idx_bytes(pixels, dims=(5, 2**31, 2**31))
    _write_pair(tmp_path, huge, _idx_bytes(labels))
    with pytest.raises(ValueError, match="truncated"):
        ea.data.load_mnist(tmp_path)


def test_trailing_data(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, _idx_bytes(pixels), _idx_bytes(labels) + b"\x00")
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.*more data"):
        ea.data.load_mnist(tmp_path)


def test_count_mismatch(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write_pair(tmp_path, _idx_bytes(pixels), _idx_bytes(labels[:4]))
    with pytest.raises(ValueError, match="5 images.*4 labels"):
        ea.data.load_mnist(tmp_path)
    # Compared from the headers, so a `limit` does not hide it.
    with pytest.raises(ValueError, match="5 images.*4 labels"):
        ea.data.load_mnist(tmp_path, limit=2)


def test_labels_out_of_range(user_mode, tmp_path):
    pixels, labels = _fake(5)
    labels[3] = 10
    _write_pair(tmp_path, _idx_bytes(pixels), _idx_bytes(labels))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.*label 10 at index 3"):
        ea.data.load_mnist(tmp_path)


def test_corrupt_gzip(user_mode, tmp_path):
    pixels, labels = _fake(5)
    _write(tmp_path / "train-images-idx3-ubyte.gz", b"not gzip at all")
    _write(tmp_path / "train-labels-idx1-ubyte", _idx_bytes(labels))
    with pytest.raises(ValueError, match="gzip"):
        ea.data.load_mnist(tmp_path)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"split": "validation"}, "split"), ({"split": "train", "limit": -1}, "limit")],
)
def test_bad_arguments(user_mode, mnist_dir, kwargs, match):
    directory, _ = mnist_dir
    with pytest.raises(ValueError, match=match):
        ea.data.load_mnist(directory, **kwargs)
