"""scikit-learn's shipped 8x8 handwritten digits, with a fixed train/test split."""

import functools
import importlib.util
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
from jaxtyping import Float, Int


class Digits(NamedTuple):
    """Images and labels returned by [`load_digits`][energyattn.data.load_digits].

    A named tuple, so `images, labels = load_digits()` works.

    **Attributes:**

    - `images`: NumPy float array of shape `(n, 8, 8)`, pixel intensities in $[0, 1]$.
    - `labels`: NumPy int array of shape `(n,)`, the digit classes $0, \\dots, 9$.
    """

    images: Float[np.ndarray, "n 8 8"]
    labels: Int[np.ndarray, " n"]


def load_digits(
    split: Literal["train", "test"] | None = None,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Digits:
    r"""Load scikit-learn's 1797 handwritten 8x8 digits (shipped with scikit-learn, no download).

    Pixels are the original 17 grey levels scaled to $[0, 1]$ (`pixel / 16`). The split is a
    fixed permutation of all examples drawn with NumPy from `seed`: the first
    `round(test_fraction * n)` permuted examples are the test set, the rest the training set
    (not stratified). Within each split the examples keep their original order, so the same
    arguments always return the same arrays.

    **Arguments:**

    - `split`: `"train"`, `"test"`, or `None` for all 1797 examples.
    - `test_fraction`: the fraction of examples in the test split, in $(0, 1)$.
    - `seed`: seed of the split's permutation.

    **Returns:**

    A [`Digits`][energyattn.data.Digits] named tuple of NumPy arrays `(images, labels)`:
    `images` of shape `(n, 8, 8)` (float64 in $[0, 1]$) and `labels` of shape `(n,)` (int).
    Convert with `jnp.asarray` where needed.

    **Raises:**

    `ImportError` if scikit-learn is not installed (`pip install scikit-learn`).
    """
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if importlib.util.find_spec("sklearn") is None:
        raise ImportError(
            "energyattn.data.load_digits needs scikit-learn, which ships the digits: pip "
            "install scikit-learn (or, in a checkout of energyattn: pip install '.[examples]')"
        )
    pixels, targets = _shipped_digits()
    images = pixels.reshape(-1, 8, 8) / 16.0
    labels = targets.copy()
    if split is None:
        return Digits(images=images, labels=labels)
    n = labels.shape[0]
    permutation = np.random.default_rng(seed).permutation(n)
    num_test = round(test_fraction * n)
    chosen = permutation[:num_test] if split == "test" else permutation[num_test:]
    chosen = np.sort(chosen)
    return Digits(images=images[chosen], labels=labels[chosen])


@functools.cache
def _shipped_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn ships them: (1797, 64) grey levels 0-16 and the labels,
    read once per process (read-only: `load_digits` returns copies).

    The table is read straight from scikit-learn's `datasets/data/digits.csv.gz`, found
    without importing scikit-learn (whose import is most of a short command's start-up); the
    arrays are those of `sklearn.datasets.load_digits()`, which is the fallback should a
    scikit-learn keep the file elsewhere.
    """
    spec = importlib.util.find_spec("sklearn")  # not None: load_digits checked
    for folder in (spec.submodule_search_locations if spec is not None else None) or ():
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",", dtype=np.float64)
            pixels, targets = table[:, :-1], table[:, -1].astype(np.int64)
            break
    else:
        from sklearn import datasets

        bunch = datasets.load_digits()
        pixels = np.asarray(bunch.data, np.float64)
        targets = np.asarray(bunch.target, np.int64)
    for array in (pixels, targets):
        array.flags.writeable = False
    return pixels, targets
