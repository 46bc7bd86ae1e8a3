"""MNIST read from files the user already has (IDX or Keras's `mnist.npz`); never downloads."""

import gzip
import io
import os
import pathlib
import struct
import zlib
from typing import Literal, NamedTuple

import numpy as np
from jaxtyping import Float, Int, Shaped, UInt8


class Mnist(NamedTuple):
    """Images and labels returned by [`load_mnist`][energyattn.data.load_mnist].

    A named tuple, so `images, labels = load_mnist(path)` works.

    **Attributes:**

    - `images`: NumPy float64 array of shape `(n, height, width)` (`(n, 28, 28)` for MNIST),
        pixel intensities in $[0, 1]$.
    - `labels`: NumPy int64 array of shape `(n,)`, the digit classes $0, \\dots, 9$.
    """

    images: Float[np.ndarray, "n height width"]
    labels: Int[np.ndarray, " n"]


# The classic file names (LeCun's site and its mirrors), in the order they are looked for.
# Some mirrors and archives spell them with a dot before "idx"; either may be gzip-compressed.
_IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_NPZ_NAME = "mnist.npz"
_NPZ_KEYS = {"train": ("x_train", "y_train"), "test": ("x_test", "y_test")}
_NEVER_DOWNLOADS = (
    "energyattn never downloads data: fetch MNIST yourself (the four IDX files, optionally "
    "gzip-compressed, or Keras's mnist.npz) and pass their directory (or the .npz file) to "
    "energyattn.data.load_mnist."
)
# IDX type codes, named in the error for the ones this reader does not support.
_IDX_TYPES = {
    0x08: "unsigned byte",
    0x09: "signed byte",
    0x0B: "short",
    0x0C: "int",
    0x0D: "float",
    0x0E: "double",
}
_NUM_CLASSES = 10
# Files are read in chunks of this many bytes (see `_read_up_to`).
_CHUNK = 1 << 24


def _candidates(stem: str) -> list[str]:
    dotted = stem.replace("-idx", ".idx")
    return [stem, stem + ".gz", dotted, dotted + ".gz"]


def _read_up_to(file: io.BufferedIOBase, size: int) -> bytes:
    # In chunks rather than one `file.read(size)`: a corrupt header can claim terabytes, and a
    # single read would try to allocate all of it before noticing that the file is short.
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = file.read(min(remaining, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_idx_header(file: io.BufferedIOBase, path: pathlib.Path) -> tuple[int, ...]:
    magic = file.read(4)
    # Two zero bytes, the type code, the number of dimensions.
    if len(magic) < 4 or magic[:2] != b"\x00\x00":
        raise ValueError(
            f"{path} is not an IDX file: its magic number {magic.hex() or '(empty)'} does not "
            "start with two zero bytes"
        )
    type_code, ndim = magic[2], magic[3]
    if type_code != 0x08:
        kind = _IDX_TYPES.get(type_code, "unknown")
        raise ValueError(
            f"{path} holds IDX type 0x{type_code:02x} ({kind}); only 0x08 (unsigned byte), "
            "the type of MNIST's files, is supported"
        )
    raw_dims = file.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise ValueError(f"{path} is truncated: its header ends before its {ndim} dimensions")
    return struct.unpack(f">{ndim}I", raw_dims)


def _open(path: pathlib.Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_idx(path: pathlib.Path, count: int, dims: tuple[int, ...]) -> UInt8[np.ndarray, "..."]:
    """Read the first `count` items of the IDX file `path`, whose header says `dims`."""
    shape = (count, *dims[1:])
    size = int(np.prod(shape, dtype=np.int64))
    complete = count == dims[0]
    try:
        with _open(path) as file:
            _read_idx_header(file, path)
            data = _read_up_to(file, size)
            # Only a complete read can check the file's end: with `limit` the rest is skipped.
            extra = complete and len(data) == size and file.read(1) != b""
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise ValueError(f"{path} is not a valid gzip file: {error}") from error
    if len(data) < size:
        raise ValueError(
            f"{path} is truncated: dimensions {dims} need {size} bytes of data for the first "
            f"{count} items, found {len(data)}"
        )
    if extra:
        raise ValueError(
            f"{path} has more data than its dimensions {dims} describe ({size} bytes expected)"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _idx_dims(path: pathlib.Path, expected_ndim: int, what: str) -> tuple[int, ...]:
    try:
        with _open(path) as file:
            dims = _read_idx_header(file, path)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise ValueError(f"{path} is not a valid gzip file: {error}") from error
    if len(dims) != expected_ndim:
        raise ValueError(
            f"{path} should hold {what} ({expected_ndim}-D) but its header has {len(dims)} "
            f"dimensions {dims}"
        )
    return dims


def _check_labels(labels: Shaped[np.ndarray, " n"], source: str) -> None:
    out_of_range = (labels < 0) | (labels >= _NUM_CLASSES)
    if np.any(out_of_range):
        index = int(np.argmax(out_of_range))
        raise ValueError(
            f"{source}: label {labels[index]} at index {index} is not a digit class "
            f"0..{_NUM_CLASSES - 1}"
        )


def _load_idx(images_path: pathlib.Path, labels_path: pathlib.Path, limit: int | None) -> Mnist:
    image_dims = _idx_dims(images_path, 3, "images")
    label_dims = _idx_dims(labels_path, 1, "labels")
    # Compared from the headers alone, so a mismatch is found even when `limit` reads less.
    if image_dims[0] != label_dims[0]:
        raise ValueError(
            f"{images_path} holds {image_dims[0]} images but {labels_path} holds "
            f"{label_dims[0]} labels"
        )
    count = image_dims[0] if limit is None else min(limit, image_dims[0])
    pixels = _read_idx(images_path, count, image_dims)
    labels = _read_idx(labels_path, count, label_dims)
    _check_labels(labels, str(labels_path))
    return Mnist(images=pixels.astype(np.float64) / 255.0, labels=labels.astype(np.int64))


def _load_npz(path: pathlib.Path, split: str, limit: int | None) -> Mnist:
    with open(path, "rb") as file:
        signature = file.read(4)
    # Checked before `np.load`, which would otherwise report a non-zip file (an IDX file
    # passed by mistake, say) as "pickled data", a confusing message.
    if signature != b"PK\x03\x04":
        raise ValueError(
            f"{path} is not an .npz file; pass an .npz file with keys x_train, y_train, x_test, "
            "y_test, or the directory holding the IDX files"
        )
    images_key, labels_key = _NPZ_KEYS[split]
    with np.load(path, allow_pickle=False) as data:
        missing = [key for key in (images_key, labels_key) if key not in data.files]
        if missing:
            raise ValueError(
                f"{path} lacks the key(s) {', '.join(missing)} (has {', '.join(data.files)}); "
                "expected Keras's layout x_train, y_train, x_test, y_test"
            )
        images = data[images_key]
        labels = data[labels_key]
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(
            f"{path}: {images_key} must be 3-D (n, height, width) and {labels_key} 1-D (n,), "
            f"got shapes {images.shape} and {labels.shape}"
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{path} holds {images.shape[0]} images ({images_key}) but {labels.shape[0]} labels "
            f"({labels_key})"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: {labels_key} must be integers, got dtype {labels.dtype}")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    _check_labels(labels, f"{path} ({labels_key})")
    if np.issubdtype(images.dtype, np.integer):
        if images.size and (images.min() < 0 or images.max() > 255):
            raise ValueError(f"{path}: integer {images_key} must be pixel values 0..255")
        images = images.astype(np.float64) / 255.0
    elif np.issubdtype(images.dtype, np.floating):
        # Already scaled: kept as they are, but they must honour `Mnist`'s [0, 1] contract
        # (floats in 0..255 would otherwise pass silently as very bright images).
        images = images.astype(np.float64)
        # Written so that NaN fails too.
        if not np.all((images >= 0.0) & (images <= 1.0)):
            raise ValueError(f"{path}: float {images_key} must be in [0, 1]")
    else:
        raise ValueError(f"{path}: {images_key} must be integers or floats, got {images.dtype}")
    return Mnist(images=images, labels=labels.astype(np.int64))


def _find_first(directory: pathlib.Path, names: list[str]) -> pathlib.Path | None:
    for name in names:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    return None


def load_mnist(
    path: str | os.PathLike[str],
    split: Literal["train", "test"] = "train",
    *,
    limit: int | None = None,
) -> Mnist:
    r"""Load MNIST from files already on disk (energyattn never downloads anything).

    `path` is either a directory or an `.npz` file:

    - A directory holding the classic IDX files `train-images-idx3-ubyte`,
        `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each
        optionally gzip-compressed (`.gz`) and optionally spelled with a dot
        (`train-images.idx3-ubyte`). Only the two files of `split` need to be present.
    - Otherwise, a directory holding `mnist.npz`, or an `.npz` file itself, in Keras's layout:
        keys `x_train`, `y_train`, `x_test`, `y_test`, images as integers $0, \dots, 255$ or as
        floats already in $[0, 1]$.

    Pixels are scaled to $[0, 1]$ (`pixel / 255`); the image size is whatever the file says
    (28x28 for MNIST). The examples keep the files' order.

    **Arguments:**

    - `path`: the directory, or the `.npz` file (a `str` or any path-like).
    - `split`: `"train"` (the 60000 training examples) or `"test"` (the 10000 `t10k` ones).
    - `limit`: if given, read only the first `limit` examples (fewer if the split has fewer),
        for quick runs. IDX files are then only read as far as needed, so their headers are
        validated but the rest of each file is not.

    **Returns:**

    An [`Mnist`][energyattn.data.Mnist] named tuple of NumPy arrays `(images, labels)`:
    `images` of shape `(n, height, width)` (float64 in $[0, 1]$) and `labels` of shape `(n,)`
    (int64). Convert with `jnp.asarray` where needed.

    **Raises:**

    - `FileNotFoundError` if `path` does not exist, or if a directory holds neither the split's
        two IDX files nor `mnist.npz`; the message lists the file names looked for.
    - `ValueError` for a bad `split` or `limit`, or a malformed file: wrong IDX magic number or
        type (only unsigned bytes, type `0x08`), images not 3-D or labels not 1-D, data shorter
        or longer than the header's dimensions, different numbers of images and labels, labels
        outside $0, \dots, 9$, a corrupt gzip stream, or an `.npz` file without the keys.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    path = pathlib.Path(path)
    if path.is_file():
        return _load_npz(path, split, limit)
    if not path.is_dir():
        raise FileNotFoundError(f"MNIST not found: {path} does not exist. {_NEVER_DOWNLOADS}")
    image_names, label_names = (_candidates(stem) for stem in _IDX_STEMS[split])
    images_path = _find_first(path, image_names)
    labels_path = _find_first(path, label_names)
    if images_path is not None and labels_path is not None:
        return _load_idx(images_path, labels_path, limit)
    if (path / _NPZ_NAME).is_file():
        return _load_npz(path / _NPZ_NAME, split, limit)

    def status(found: pathlib.Path | None) -> str:
        return "none found" if found is None else f"found {found.name}"

    raise FileNotFoundError(
        f"MNIST {split} split not found in directory {path}: looked for the images as one of "
        f"{', '.join(image_names)} ({status(images_path)}), the labels as one of "
        f"{', '.join(label_names)} ({status(labels_path)}), or {_NPZ_NAME} (not found). "
        f"{_NEVER_DOWNLOADS}"
    )
