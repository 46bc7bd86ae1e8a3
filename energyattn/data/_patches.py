"""Images as sequences of patches, and random patch masks with a static count."""

from typing import Any

import jax.numpy as jnp
from einops import rearrange
from jaxtyping import Array, ArrayLike, Bool, PRNGKeyArray, Shaped

from .._checks import check_image_shape, positive_int, shape_str
from ._corruption import _corruption_mask


def patchify(
    image: Shaped[ArrayLike, "channels height width"], patch_size: int
) -> Shaped[Array, "patches patch_dim"]:
    r"""Cut an image into non-overlapping square patches, one flattened patch per row.

    Patches are ordered row by row (left to right, top to bottom) and each is flattened in
    (channel, row, column) order, so a patch's length is `channels * patch_size**2`.

    **Arguments:**

    - `image`: one image, channels first: shape `(channels, height, width)`.
    - `patch_size`: side $p$ of the square patches; must divide height and width.

    **Returns:**

    The patches, shape `(height/p * width/p, channels * p * p)`.
    """
    (channels, height, width), p = _image_and_patch(image, patch_size)
    return rearrange(jnp.asarray(image), "c (kh h) (kw w) -> (kh kw) (c h w)", h=p, w=p)


def unpatchify(
    patches: Shaped[ArrayLike, "patches patch_dim"],
    image_shape: tuple[int, ...],
    patch_size: int,
) -> Shaped[Array, "channels height width"]:
    """Inverse of [`patchify`][energyattn.data.patchify]: reassemble `(channels, height,
    width)` from patches of shape `(num_patches, channels * patch_size**2)`."""
    (channels, height, width), p = check_image_shape(image_shape, patch_size)
    expected = ((height // p) * (width // p), channels * p * p)
    if tuple(jnp.shape(patches)) != expected:
        raise ValueError(
            f"patches of a {shape_str((channels, height, width))} image in {p}x{p} patches "
            f"must have shape {shape_str(expected)}, got {shape_str(jnp.shape(patches))}"
        )
    return rearrange(
        jnp.asarray(patches),
        "(kh kw) (c h w) -> c (kh h) (kw w)",
        kh=height // p,
        c=channels,
        h=p,
        w=p,
    )


def _image_and_patch(image: Any, patch_size: Any) -> tuple[tuple[int, int, int], int]:
    shape = tuple(jnp.shape(image))
    if len(shape) != 3:
        raise ValueError(
            f"image must have shape (channels, height, width), got {shape_str(shape)}; add a "
            "channel axis to a grey-scale image (image[None])"
        )
    return check_image_shape(shape, patch_size)


def random_patch_mask(
    key: PRNGKeyArray, num_patches: int, num_masked: int
) -> Bool[Array, " patches"]:
    """A boolean mask with exactly `num_masked` of `num_patches` entries `True`, uniformly.

    Both counts are static Python ints, so the mask has a static shape and works under
    `jit` and `vmap` (one mask per key).

    **Arguments:**

    - `key`: a JAX PRNG key.
    - `num_patches`: length of the mask.
    - `num_masked`: how many entries are `True` ($0 \\le$ `num_masked` $\\le$ `num_patches`).

    **Returns:**

    A boolean array of shape `(num_patches,)`.
    """
    num_patches = positive_int("num_patches", num_patches)
    num_masked = positive_int("num_masked", num_masked, minimum=0)
    if num_masked > num_patches:
        raise ValueError(
            f"cannot mask num_masked={num_masked} patches of an image with only "
            f"num_patches={num_patches}"
        )
    return _corruption_mask(key, (num_patches,), num_masked)
