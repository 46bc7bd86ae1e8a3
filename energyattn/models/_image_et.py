"""Masked-image inpainting with an Energy Transformer: the model (its loss, training and
evaluation live in `_inpainting`, its `.npz` files in `_image_et_io`)."""

from typing import Any, Literal, overload

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import (
    check_finite,
    check_image_shape,
    default_dtype,
    keyword_arguments,
    positive_int,
    shape_str,
)
from .._solver import Solution
from ..data import patchify, unpatchify
from ..nn import EnergyTransformer


class ImageEnergyTransformer(eqx.Module):
    r"""An Energy Transformer that inpaints masked image patches.

    $$x^{(0)} = \big[\mathrm{CLS};\; \mathrm{MASK}\ \text{or}\ P W_{\mathrm{emb}} + b_{\mathrm{emb}}
      \big] + \mathrm{POS}, \qquad x^{(T)} = \text{$T$ steps of }
      x \leftarrow x - \alpha\,\partial_g E(g)\big|_{g=\mathrm{LN}(x)},$$

    $$\hat P = \mathrm{LN}(x^{(T)}_{1:})\, W_{\mathrm{unemb}} + b_{\mathrm{unemb}}.$$

    The image (channels first) is cut into `patch_size` patches $P$; each patch is embedded
    linearly, masked patches are replaced by the learned MASK token, a CLS token is prepended
    and learned position embeddings are added. The tokens then descend the
    [`EnergyTransformer`][energyattn.nn.EnergyTransformer]'s energy for $T$ steps (default
    $\alpha = 0.1$, $T = 12$) and are decoded back into patches, and the patches into an image.

    **Arguments:**

    - `image_shape`: `(channels, height, width)` of the images (default `(1, 8, 8)`, the
      shipped digits).
    - `patch_size`: side of the square patches (default 2); must divide height and width.
    - `dim`, `num_heads`, `head_dim`, `num_memories`, `beta`, `include_self`, `memory`,
      `step_size`, `num_steps`: of the [`EnergyTransformer`][energyattn.nn.EnergyTransformer].
    - `dtype`: parameter dtype; `key`: a JAX PRNG key.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023); the tutorial's
        "Image-compatible ET".
    """

    embed_weight: Float[Array, "patch_dim dim"]
    embed_bias: Float[Array, " dim"]
    unembed_weight: Float[Array, "dim patch_dim"]
    unembed_bias: Float[Array, " patch_dim"]
    cls_token: Float[Array, " dim"]
    mask_token: Float[Array, " dim"]
    pos_embed: Float[Array, "tokens dim"]
    transformer: EnergyTransformer
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    @keyword_arguments("ea.models.ImageEnergyTransformer")
    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        *,
        dim: int = 32,
        num_heads: int = 4,
        head_dim: int = 8,
        num_memories: int = 128,
        beta: float | None = None,
        include_self: bool = False,
        memory: Literal["relu", "softmax"] = "relu",
        step_size: float = 0.1,
        num_steps: int = 12,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.image_shape, self.patch_size = check_image_shape(image_shape, patch_size)
        dim = positive_int("dim", dim)
        dtype = default_dtype(dtype)
        channels, height, width = self.image_shape
        patch_dim = channels * self.patch_size**2
        num_patches = (height // self.patch_size) * (width // self.patch_size)
        k_emb, k_unemb, k_cls, k_mask, k_pos, k_et = jr.split(key, 6)
        self.embed_weight = patch_dim**-0.5 * jr.normal(k_emb, (patch_dim, dim), dtype)
        self.embed_bias = jnp.zeros(dim, dtype)
        self.unembed_weight = dim**-0.5 * jr.normal(k_unemb, (dim, patch_dim), dtype)
        self.unembed_bias = jnp.zeros(patch_dim, dtype)
        self.cls_token = 0.02 * jr.normal(k_cls, (dim,), dtype)
        self.mask_token = 0.02 * jr.normal(k_mask, (dim,), dtype)
        self.pos_embed = 0.02 * jr.normal(k_pos, (num_patches + 1, dim), dtype)
        self.transformer = EnergyTransformer(
            dim,
            num_heads=num_heads,
            head_dim=head_dim,
            num_memories=num_memories,
            beta=beta,
            include_self=include_self,
            memory=memory,
            step_size=step_size,
            num_steps=num_steps,
            dtype=dtype,
            key=k_et,
        )

    @property
    def num_patches(self) -> int:
        """Number of patches (tokens without the CLS token)."""
        _, height, width = self.image_shape
        return (height // self.patch_size) * (width // self.patch_size)

    def _check_image(self, image: Any) -> Array:
        channels, height, width = self.image_shape
        if tuple(jnp.shape(image)) != self.image_shape:
            raise ValueError(
                f"image must have shape (channels={channels}, height={height}, width={width}), "
                f"got {shape_str(jnp.shape(image))}"
            )
        return check_finite("image", image)

    def _check_mask(self, mask: Any) -> Array:
        if tuple(jnp.shape(mask)) != (self.num_patches,):
            raise ValueError(
                f"mask must have shape (patches={self.num_patches},), one entry per patch, got "
                f"{shape_str(jnp.shape(mask))}"
            )
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be boolean (True = masked patch), got dtype {mask.dtype}")
        return mask

    def patchify(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> Float[Array, "patches patch_dim"]:
        """The image's patches, shape `(num_patches, channels * patch_size**2)`."""
        return patchify(self._check_image(image), self.patch_size)

    def unpatchify(
        self, patches: Float[ArrayLike, "patches patch_dim"]
    ) -> Float[Array, "channels height width"]:
        """Inverse of [`patchify`][energyattn.models.ImageEnergyTransformer.patchify]."""
        return unpatchify(patches, self.image_shape, self.patch_size)

    def encode(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> Float[Array, "patches dim"]:
        """Embed the patches linearly: one token per patch, shape `(num_patches, dim)`."""
        return self.patchify(image) @ self.embed_weight + self.embed_bias

    def decode(
        self, tokens: Float[ArrayLike, "patches dim"]
    ) -> Float[Array, "channels height width"]:
        """Read patch tokens out through the layer norm and the linear unembedding."""
        g = self.transformer.layer_norm(tokens)
        return self.unpatchify(g @ self.unembed_weight + self.unembed_bias)

    def prepare(
        self, tokens: Float[ArrayLike, "patches dim"], mask: Bool[ArrayLike, " patches"]
    ) -> Float[Array, "tokens dim"]:
        """Replace masked tokens by the MASK token, prepend CLS, add position embeddings."""
        mask = self._check_mask(mask)
        tokens = jnp.where(mask[:, None], self.mask_token, jnp.asarray(tokens))
        return jnp.concatenate([self.cls_token[None], tokens]) + self.pos_embed

    @overload
    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "channels height width"]: ...

    @overload
    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "channels height width"], Solution]: ...

    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> (
        Float[Array, "channels height width"]
        | tuple[Float[Array, "channels height width"], Solution]
    ):
        """Reconstruct an image whose masked patches are hidden from the model.

        **Arguments:**

        - `image`: shape `(channels, height, width)`.
        - `mask`: boolean `(num_patches,)`, `True` for the patches to hide (see
          [`random_patch_mask`][energyattn.data.random_patch_mask]).
        - `step_size`, `num_steps`: override the transformer's $\\alpha$ and $T$.
        - `return_solution`: also return the descent's [`Solution`][energyattn.Solution]
          (energies per step in `energies`, the tokens of every step in `trajectory`).
        - `key`: unused; accepted for Equinox compatibility.

        **Returns:**

        The reconstructed image, same shape as `image` (every patch is decoded; the masked
        ones are the inpainting); with `return_solution=True` also the descent.
        """
        tokens = self.prepare(self.encode(image), mask)
        descent = self.transformer.recall(
            tokens, step_size=step_size, num_steps=num_steps, return_trajectory=return_solution
        )
        reconstruction = self.decode(descent.value[1:])
        return (reconstruction, descent) if return_solution else reconstruction
