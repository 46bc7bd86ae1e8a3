"""Pixels as unit vector spins: the invertible image embedding of the attractor network."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_image_shape, check_pixels, positive_int, shape_str
from .._dtypes import accumulation_dtype, result_dtype
from ._patches import patchify, unpatchify


def pixels_to_spins(pixels: Float[ArrayLike, "*shape"]) -> Float[Array, "*shape 2"]:
    r"""Map pixel intensities $p \in [0, 1]$ to unit vectors on the first quarter circle.

    $$p \mapsto \frac{(p,\; 1 - p)}{\sqrt{p^2 + (1-p)^2}}$$

    Black ($p=0$) is $(0, 1)$, white ($p=1$) is $(1, 0)$; the map is one-to-one and
    [`spins_to_pixels`][energyattn.data.spins_to_pixels] inverts it. Values outside
    $[0, 1]$ raise.
    """
    p = check_pixels("pixels", pixels)
    p = p.astype(accumulation_dtype(p))
    spin = jnp.stack([p, 1 - p], axis=-1)
    return spin / jnp.sqrt(jnp.sum(jnp.square(spin), axis=-1, keepdims=True))


def spins_to_pixels(spins: Float[ArrayLike, "*shape 2"]) -> Float[Array, " *shape"]:
    r"""Decode 2-d pixel spins to intensities: the exact inverse of
    [`pixels_to_spins`][energyattn.data.pixels_to_spins] on its image, extended to any vector.

    A vector $u$ at angle $\theta = \operatorname{atan2}(u_2, u_1)$ is projected onto the arc
    $\theta\in[0, \pi/2]$ that clean pixels occupy (angles outside it go to the nearer end)
    and decoded there:

    $$p = \frac{\cos\theta}{\cos\theta + \sin\theta}
      \quad\Bigl(= \frac{u_1}{u_1 + u_2} \text{ on the arc}\Bigr).$$

    The length of $u$ does not matter, the result is always in $[0, 1]$, and it is continuous
    away from the zero vector (which decodes as $p = 1$; a masked, all-zero token carries no
    pixel).
    """
    spins = jnp.asarray(spins)
    if spins.ndim < 1 or spins.shape[-1] != 2:
        raise ValueError(f"spins must have a last axis of size 2, got {shape_str(spins.shape)}")
    theta = jnp.arctan2(spins[..., 1], spins[..., 0])
    # Angles in (-pi, pi]; the arc's far side is at 5*pi/4 (= -3*pi/4): wrap, then clip.
    theta = jnp.where(theta < -0.75 * jnp.pi, theta + 2 * jnp.pi, theta)
    theta = jnp.clip(theta, 0.0, 0.5 * jnp.pi)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    return cos / (cos + sin)


class SpinPatchEmbedding(eqx.Module):
    r"""An image as $N$ unit vector spins: pixel spins per patch, then a fixed random rotation.

    $$x_i = \frac{1}{\sqrt a}\, F\, \bigl(u(p_{i1}), \dots, u(p_{ia})\bigr),
      \qquad u(p) = \frac{(p, 1-p)}{\sqrt{p^2+(1-p)^2}},$$

    where patch $i$ holds $a$ pixels $p_{ik}$ and $F \in \mathbb R^{d\times 2a}$ has
    orthonormal columns ($F^\top F = I$), drawn once at random and never trained. Each token
    has unit norm. Decoding applies the inverses: $\sqrt a\,F^\top x_i$, then
    [`spins_to_pixels`][energyattn.data.spins_to_pixels] per pixel. `decode(encode(image))`
    returns the image (up to rounding); on other vectors decoding projects onto the range
    of $F$ and onto the pixel arc.

    **Arguments:**

    - `image_shape`: `(channels, height, width)`; height and width divisible by `patch_size`.
    - `patch_size`: side of the square patches (2 or 4 in the paper).
    - `dim`: token dimension $d \ge 2a$, where $a$ = channels × patch_size² (default $2a$).
    - `key`: a JAX PRNG key for $F$.

    ??? cite "Source"

        F. D'Amico, M. Negri (2024), appendix V-A.
    """

    embedding: Float[Array, "dim spin_dim"]
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        dim: int | None = None,
        *,
        key: PRNGKeyArray,
        dtype: Any = None,
    ):
        self.image_shape, self.patch_size = check_image_shape(image_shape, patch_size)
        spin_dim = 2 * self.image_shape[0] * self.patch_size**2
        dim = spin_dim if dim is None else positive_int("dim", dim)
        if dim < spin_dim:
            raise ValueError(
                f"dim must be at least 2a = {spin_dim} (two spin components per pixel of a "
                f"{self.patch_size}x{self.patch_size} patch with {self.image_shape[0]} "
                f"channel(s)), got dim={dim}"
            )
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        q, r = jnp.linalg.qr(jr.normal(key, (dim, spin_dim), dtype))
        # Fix QR's sign ambiguity so that F is Haar-distributed (and a key gives one F).
        self.embedding = q * jnp.sign(jnp.diagonal(r))[None, :]

    @property
    def patch_dim(self) -> int:
        """$a$: pixels per patch (channels × patch_size²)."""
        return self.image_shape[0] * self.patch_size**2

    @property
    def num_tokens(self) -> int:
        """$N$: patches per image."""
        _, height, width = self.image_shape
        return (height // self.patch_size) * (width // self.patch_size)

    @property
    def dim(self) -> int:
        """$d$: the token dimension."""
        return self.embedding.shape[0]

    def _check_image(self, image: Any) -> None:
        if tuple(np.shape(image)) != self.image_shape:
            raise ValueError(
                f"image must have shape {shape_str(self.image_shape)} (channels, height, "
                f"width), got {shape_str(np.shape(image))}"
            )

    def encode(self, image: Float[ArrayLike, "channels height width"]) -> Float[Array, "N dim"]:
        """The unit tokens of an image with pixels in $[0, 1]$, shape `(N, dim)`."""
        self._check_image(image)
        patches = patchify(image, self.patch_size)  # (N, a)
        spins = pixels_to_spins(patches).reshape(self.num_tokens, 2 * self.patch_dim)
        spins = spins.astype(result_dtype(spins, self.embedding))
        return spins @ self.embedding.T / np.sqrt(self.patch_dim)

    def decode(self, tokens: Float[ArrayLike, "N dim"]) -> Float[Array, "channels height width"]:
        """The image whose encoding is (nearest to) `tokens`; pixels in $[0, 1]$."""
        tokens = jnp.asarray(tokens)
        if tokens.shape != (self.num_tokens, self.dim):
            raise ValueError(
                f"tokens must have shape (N={self.num_tokens}, dim={self.dim}), got "
                f"{shape_str(tokens.shape)}"
            )
        spins = np.sqrt(self.patch_dim) * tokens @ self.embedding
        pixels = spins_to_pixels(spins.reshape(self.num_tokens, self.patch_dim, 2))
        return unpatchify(pixels, self.image_shape, self.patch_size)
