"""Shipped digits and corruptions (`energyattn.data`)."""

import collections
import importlib.machinery
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

# ---------------------------------------------------------------- digits


def _multiset(digits):
    return collections.Counter(
        (image.tobytes(), int(label))
        for image, label in zip(digits.images, digits.labels, strict=True)
    )


def test_load_digits_all():
    digits = ea.data.load_digits()
    assert isinstance(digits, ea.data.Digits)
    images, labels = digits  # a named tuple unpacks
    assert isinstance(images, np.ndarray) and isinstance(labels, np.ndarray)
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert np.issubdtype(images.dtype, np.floating) and np.issubdtype(labels.dtype, np.integer)
    assert images.min() == 0.0 and images.max() == 1.0
    # pixels / 16: the 17 original grey levels
    np.testing.assert_array_equal(np.unique(images * 16), np.arange(17))
    assert set(labels.tolist()) == set(range(10))


def test_load_digits_split_is_a_fixed_partition():
    everything = ea.data.load_digits()
    train = ea.data.load_digits("train")
    test = ea.data.load_digits("test")
    assert len(test.labels) == round(0.2 * 1797) and len(train.labels) == 1797 - len(test.labels)
    assert _multiset(train) + _multiset(test) == _multiset(everything)
    # Deterministic per seed, different across seeds; test_fraction sets the size.
    again = ea.data.load_digits("test")
    np.testing.assert_array_equal(again.images, test.images)
    other = ea.data.load_digits("test", seed=1)
    assert not np.array_equal(other.labels, test.labels)
    assert len(ea.data.load_digits("test", test_fraction=0.5).labels) == round(0.5 * 1797)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"split": "validation"}, "split"),
        ({"split": "train", "test_fraction": 0.0}, "test_fraction"),
        ({"split": "test", "test_fraction": 1.5}, "test_fraction"),
    ],
)
def test_load_digits_bad_input(user_mode, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ea.data.load_digits(**kwargs)


def test_load_digits_reads_what_scikit_learn_ships(tmp_path, monkeypatch):
    # The file is read without importing scikit-learn; the arrays are its loader's, and so
    # are those of the fallback, used where the file is not found.
    from sklearn import datasets

    from energyattn.data import _digits

    shipped = datasets.load_digits()
    images, labels = ea.data.load_digits()
    np.testing.assert_array_equal(images * 16, shipped.images)
    np.testing.assert_array_equal(labels, shipped.target)
    elsewhere = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    elsewhere.submodule_search_locations = [str(tmp_path)]  # no datasets/data/digits.csv.gz
    monkeypatch.setattr(_digits.importlib.util, "find_spec", lambda name: elsewhere)
    _digits._shipped_digits.cache_clear()
    try:
        images, labels = ea.data.load_digits()
    finally:
        _digits._shipped_digits.cache_clear()
    np.testing.assert_array_equal(images * 16, shipped.images)
    np.testing.assert_array_equal(labels, shipped.target)


def test_load_digits_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` fail
    # The package is not on PyPI: the hint installs scikit-learn itself, or the extra from a
    # checkout, never 'energyattn[examples]' from the index.
    with pytest.raises(ImportError, match=r"pip install scikit-learn") as raised:
        ea.data.load_digits()
    assert "energyattn[examples]" not in str(raised.value)


# ---------------------------------------------------------------- corruptions


def _pattern(getkey, shape=(64,)):
    return jnp.where(jr.bernoulli(getkey(), 0.5, shape), 1.0, -1.0)


@pytest.mark.parametrize("fraction, count", [(0.0, 0), (0.2, 13), (0.5, 32), (1.0, 64), (1, 64)])
def test_flip_signs_flips_exactly(getkey, fraction, count):
    x = _pattern(getkey)
    y = ea.data.flip_signs(x, fraction, key=getkey())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert int(jnp.sum(y != x)) == count
    np.testing.assert_array_equal(jnp.abs(y), 1.0)


def test_flip_signs_any_shape(getkey):
    x = _pattern(getkey, (8, 8))
    y = ea.data.flip_signs(x, 0.25, key=getkey())
    assert y.shape == (8, 8) and int(jnp.sum(y != x)) == 16


@pytest.mark.parametrize("fraction, count", [(0.0, 0), (0.3, 19), (1.0, 64)])
def test_mask_entries_masks_exactly(getkey, fraction, count):
    x = _pattern(getkey)
    y = ea.data.mask_entries(x, fraction, key=getkey())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert int(jnp.sum(y == 0.0)) == count
    np.testing.assert_array_equal(jnp.where(y == 0.0, x, y), x)  # the rest is untouched


def test_mask_entries_fill_and_dtype(getkey):
    x = jnp.arange(1, 21, dtype=jnp.int32).reshape(4, 5)
    y = ea.data.mask_entries(x, 0.5, key=getkey(), fill=-7)
    assert y.dtype == jnp.int32 and int(jnp.sum(y == -7)) == 10


def test_add_gaussian_noise(getkey):
    x = jnp.linspace(-1.0, 1.0, 20_000)
    np.testing.assert_array_equal(ea.data.add_gaussian_noise(x, 0.0, key=getkey()), x)
    y = ea.data.add_gaussian_noise(x, 0.25, key=getkey())
    assert y.shape == x.shape and y.dtype == x.dtype
    assert abs(float(jnp.var(y - x)) - 0.25) < 0.02
    assert abs(float(jnp.mean(y - x))) < 0.02


def test_corruptions_jit_vmap_and_keys(getkey):
    x = _pattern(getkey)
    keys = jr.split(getkey(), 5)
    flip = jax.jit(jax.vmap(lambda k: ea.data.flip_signs(x, 0.2, key=k)))
    flipped = flip(keys)
    assert flipped.shape == (5, 64)
    np.testing.assert_array_equal(jnp.sum(flipped != x, axis=1), 13)
    # Same key, same corruption (also eagerly); different keys, different corruptions.
    np.testing.assert_array_equal(flipped[0], ea.data.flip_signs(x, 0.2, key=keys[0]))
    np.testing.assert_array_equal(flip(keys), flipped)
    assert not jnp.array_equal(flipped[0], flipped[1])

    masked = jax.jit(jax.vmap(lambda y, k: ea.data.mask_entries(y, 0.5, key=k, fill=0.0)))(
        flipped, keys
    )
    np.testing.assert_array_equal(jnp.sum(masked == 0.0, axis=1), 32)

    noisy = jax.jit(jax.vmap(lambda k, v: ea.data.add_gaussian_noise(x, v, key=k)))(
        keys, jnp.linspace(0.0, 1.0, 5)
    )
    np.testing.assert_array_equal(noisy[0], x)  # variance 0 (traced) leaves x as it is
    assert not jnp.array_equal(noisy[1], noisy[2])


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), True, "0.2"])
def test_bad_fraction(user_mode, getkey, fraction):
    x = jnp.ones(10)
    with pytest.raises(ValueError, match="fraction"):
        ea.data.flip_signs(x, fraction, key=getkey())
    with pytest.raises(ValueError, match="fraction"):
        ea.data.mask_entries(x, fraction, key=getkey())


def test_traced_fraction_is_refused(user_mode, getkey):
    key = getkey()
    with pytest.raises(ValueError, match="concrete Python number"):
        jax.jit(lambda f: ea.data.flip_signs(jnp.ones(10), f, key=key))(0.2)


def test_bad_variance(user_mode, getkey):
    x = jnp.ones(10)
    with pytest.raises(ValueError, match="variance must be >= 0, got -1.0"):
        ea.data.add_gaussian_noise(x, -1.0, key=getkey())
    with pytest.raises(ValueError, match="variance must be a real scalar"):
        ea.data.add_gaussian_noise(x, jnp.ones(2), key=getkey())
    with pytest.raises(ValueError, match="floating-point"):
        ea.data.add_gaussian_noise(jnp.arange(3), 1.0, key=getkey())
    key = getkey()
    with pytest.raises(eqx.EquinoxRuntimeError, match="variance must be >= 0"):
        eqx.filter_jit(lambda v: ea.data.add_gaussian_noise(x, v, key=key))(jnp.asarray(-1.0))
