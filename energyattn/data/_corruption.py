"""Corruptions of one example (unbatched): sign flips, masking, Gaussian noise.

The number of corrupted entries is computed from `fraction` and the (static) shape of `x`,
so every function has static output shapes and works under `jax.jit` and `jax.vmap`; only
which entries are corrupted depends on the key.
"""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Shaped

from .._checks import check_values, num_corrupted


def _corruption_mask(
    key: PRNGKeyArray, shape: tuple[int, ...], count: int
) -> Bool[Array, "*shape"]:
    """A boolean array of `shape` with exactly `count` True entries, uniformly placed."""
    size = int(np.prod(shape, dtype=np.int64))
    chosen = jr.permutation(key, size)[:count]
    return jnp.zeros(size, dtype=bool).at[chosen].set(True).reshape(shape)


def flip_signs(
    x: Shaped[ArrayLike, "*shape"], fraction: float | int, *, key: PRNGKeyArray
) -> Shaped[Array, "*shape"]:
    r"""Flip the sign of a random `fraction` of the entries of `x`.

    $$\tilde x_i = \begin{cases} -x_i & i \in S \\ x_i & \text{otherwise}\end{cases},
      \qquad |S| = \mathrm{round}(\text{fraction}\cdot\text{size})$$

    with $S$ drawn uniformly without replacement. For a $\pm1$ pattern exactly $|S|$ pixels
    change (the usual corruption of classical Hopfield memories).

    **Arguments:**

    - `x`: one example of any shape, e.g. a $\pm1$ pattern of shape `(dim,)`.
    - `fraction`: fraction of entries to flip, a Python number in $[0, 1]$ (static: it fixes
      the number of flipped entries; halves round to even, as Python's `round`).
    - `key`: PRNG key choosing the entries.

    **Returns:**

    An array of the same shape and dtype as `x`.
    """
    x = jnp.asarray(x)
    count = num_corrupted(fraction, x.size)
    return jnp.where(_corruption_mask(key, x.shape, count), -x, x)


def mask_entries(
    x: Shaped[ArrayLike, "*shape"],
    fraction: float | int,
    *,
    key: PRNGKeyArray,
    fill: float | int | bool | Shaped[ArrayLike, ""] = 0.0,
) -> Shaped[Array, "*shape"]:
    r"""Replace a random `fraction` of the entries of `x` by `fill`.

    $$\tilde x_i = \begin{cases} \text{fill} & i \in S \\ x_i & \text{otherwise}\end{cases},
      \qquad |S| = \mathrm{round}(\text{fraction}\cdot\text{size})$$

    with $S$ drawn uniformly without replacement. With $\pm1$ patterns the default fill 0 is
    "unknown": it is equidistant from both signs.

    **Arguments:**

    - `x`: one example of any shape.
    - `fraction`: fraction of entries to replace, a Python number in $[0, 1]$ (static).
    - `key`: PRNG key choosing the entries.
    - `fill`: the value written into the chosen entries (cast to `x`'s dtype).

    **Returns:**

    An array of the same shape and dtype as `x`.
    """
    x = jnp.asarray(x)
    count = num_corrupted(fraction, x.size)
    return jnp.where(_corruption_mask(key, x.shape, count), jnp.asarray(fill, x.dtype), x)


def add_gaussian_noise(
    x: Float[ArrayLike, "*shape"],
    variance: float | int | Float[ArrayLike, ""],
    *,
    key: PRNGKeyArray,
) -> Float[Array, "*shape"]:
    r"""Add independent Gaussian noise of the given variance to every entry of `x`.

    $$\tilde x = x + \sigma\,\varepsilon, \qquad \varepsilon \sim \mathcal N(0, I),\quad
      \sigma^2 = \text{variance}$$

    **Arguments:**

    - `x`: one floating-point example of any shape.
    - `variance`: $\sigma^2 \ge 0$, a number or 0-d array (it may be traced; a negative traced
      value raises when the computation runs).
    - `key`: PRNG key for the noise.

    **Returns:**

    An array of the same shape and dtype as `x`.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if np.ndim(variance) != 0:
        raise ValueError(f"variance must be a real scalar, got shape {np.shape(variance)}")
    variance = check_values("variance", variance, lambda v: v >= 0, ">= 0")
    noise = jr.normal(key, x.shape, dtype=x.dtype)
    return x + jnp.sqrt(variance).astype(x.dtype) * noise


def add_rescaled_noise(
    image: Float[ArrayLike, "*shape"],
    variance: float | int | Float[ArrayLike, ""] = 0.7,
    *,
    key: PRNGKeyArray,
) -> Float[Array, "*shape"]:
    r"""The attractor paper's denoising corruption: Gaussian noise, then the original spread.

    $$\tilde x = x + \sigma\varepsilon,\qquad
      x' = \operatorname{clip}_{[0,1]}\Bigl(\bar x + (\tilde x - \bar{\tilde x})
      \frac{\operatorname{std}(x)}{\operatorname{std}(\tilde x)}\Bigr)$$

    The noisy image is shifted and rescaled so that its mean and variance (over all its
    pixels) are those of the clean image, then clipped to $[0, 1]$ so that it is again a
    valid image for [`SpinPatchEmbedding`][energyattn.data.SpinPatchEmbedding] (the clip is
    ours; the paper does not say how it kept pixels in range). A constant image (zero
    variance) stays constant.

    **Arguments:**

    - `image`: one image with pixels in $[0, 1]$ (any shape).
    - `variance`: $\sigma^2 \ge 0$ of the added noise (0.7 in the paper).
    - `key`: PRNG key for the noise.

    **Returns:**

    An array of the same shape and dtype as `image`, with values in $[0, 1]$.
    """
    image = check_values("image", image, lambda p: (p >= 0) & (p <= 1), "in [0, 1]")
    noisy = add_gaussian_noise(image, variance, key=key)
    spread = jnp.std(noisy)
    scale = jnp.where(spread > 0, jnp.std(image) / jnp.where(spread > 0, spread, 1.0), 0.0)
    return jnp.clip(jnp.mean(image) + (noisy - jnp.mean(noisy)) * scale, 0.0, 1.0)
