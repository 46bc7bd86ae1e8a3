"""Backpropagation-trained baselines of the attractor paper: a recycled transformer block and
a small vision transformer that map corrupted images to clean ones."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, PyTree

from .._checks import check_image_shape, positive_int
from ..data import patchify, unpatchify
from ._attractor import Task, _check_images, _check_task, corrupt_image
from ._training import TrainOptions, TrainResult, fit


class TransformerBlock(eqx.Module):
    r"""A pre-layer-norm transformer block (multi-head self-attention, then a GELU MLP).

    $$u = x + \mathrm{SA}(\mathrm{LN}(x)),\qquad x' = u + \mathrm{MLP}(\mathrm{LN}(u))$$

    **Arguments:**

    - `dim`: token dimension.
    - `num_heads`: attention heads (must divide `dim`).
    - `hidden`: width of the MLP (default `4 * dim`).
    - `key`: PRNG key.
    """

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(
        self, dim: int, num_heads: int = 4, hidden: int | None = None, *, key: PRNGKeyArray
    ):
        dim = positive_int("dim", dim)
        num_heads = positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        hidden = 4 * dim if hidden is None else positive_int("hidden", hidden)
        attention_key, mlp_key = jr.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(num_heads, dim, key=attention_key)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, hidden, depth=1, activation=jax.nn.gelu, key=mlp_key)

    def __call__(self, x: Float[Array, "N dim"]) -> Float[Array, "N dim"]:
        h = jax.vmap(self.norm1)(x)
        u = x + self.attention(h, h, h)
        return u + jax.vmap(self.mlp)(jax.vmap(self.norm2)(u))


class PatchTransformer(eqx.Module):
    r"""Corrupted image in, clean image out: patches, a stack of transformer blocks, patches.

    $$z^{(0)} = P W_{\text{in}} + \text{pos},\qquad
      z^{(t)} = \mathrm{Blocks}(z^{(t-1)}),\qquad
      \hat P^{(t)} = (z^{(t)} - \text{pos})\,W_{\text{out}}$$

    with trained linear embedding, learned positional encoding (subtracted before decoding, as
    in the paper) and a trained linear de-embedding. The two baselines of the attractor paper:

    - the **recycled block**: `depth=1`, trained with the block iterated $\tau \sim
      \mathcal U\{3..7\}$ times ([`train_reconstruction`][energyattn.models.train_reconstruction]
      with `min_iterations=3, max_iterations=7`); after training, the error is measured
      against the number of iterations;
    - the **vision transformer**: `depth=5`, applied once.

    **Arguments:**

    - `image_shape`, `patch_size`: the images and their square patches.
    - `dim`, `num_heads`, `hidden`: block sizes.
    - `depth`: blocks per iteration.
    - `key`: PRNG key.
    """

    embed: eqx.nn.Linear
    positions: Float[Array, "N dim"]
    blocks: TransformerBlock  # `depth` blocks stacked along a leading axis of every array
    unembed: eqx.nn.Linear
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        dim: int = 64,
        *,
        depth: int = 1,
        num_heads: int = 4,
        hidden: int | None = None,
        key: PRNGKeyArray,
    ):
        self.image_shape, self.patch_size = check_image_shape(image_shape, patch_size)
        channels, height, width = self.image_shape
        num_tokens = (height // patch_size) * (width // patch_size)
        patch_dim = channels * patch_size**2
        dim = positive_int("dim", dim)
        depth = positive_int("depth", depth)
        keys = jr.split(key, depth + 3)
        self.embed = eqx.nn.Linear(patch_dim, dim, key=keys[0])
        self.positions = 0.02 * jr.normal(keys[1], (num_tokens, dim))
        self.unembed = eqx.nn.Linear(dim, patch_dim, key=keys[2])
        # Stacked and applied with `lax.scan`, so a deep model compiles one block.
        blocks = [TransformerBlock(dim, num_heads, hidden, key=k) for k in keys[3:]]
        weights = [eqx.filter(block, eqx.is_array) for block in blocks]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *weights)
        self.blocks = eqx.combine(stacked, eqx.filter(blocks[0], eqx.is_array, inverse=True))

    def _embed(self, image: Array) -> Array:
        return jax.vmap(self.embed)(patchify(image, self.patch_size)) + self.positions

    def _decode(self, z: Array) -> Array:
        patches = jax.vmap(self.unembed)(z - self.positions)
        return unpatchify(patches, self.image_shape, self.patch_size)

    @property
    def depth(self) -> int:
        """Blocks per iteration."""
        return jax.tree.leaves(self.blocks)[0].shape[0]

    def _blocks(self, z: Array) -> Array:
        weights, structure = eqx.partition(self.blocks, eqx.is_array)

        def body(z: Array, block_weights: PyTree) -> tuple[Array, None]:
            return eqx.combine(block_weights, structure)(z), None

        z, _ = jax.lax.scan(body, z, weights)
        return z

    def __call__(
        self, image: Float[ArrayLike, "channels height width"], num_iterations: int = 1
    ) -> Float[Array, "channels height width"]:
        """The reconstruction after `num_iterations` passes through the stack of blocks."""
        return self.reconstruct(image, None, num_iterations)[-1]

    def reconstruct(
        self,
        corrupted: Float[ArrayLike, "channels height width"],
        patch_mask: Bool[ArrayLike, " N"] | None = None,
        num_steps: int = 1,
    ) -> Float[Array, "states channels height width"]:
        """Entry 0 is `corrupted`, entry $t$ the output after $t$ passes through the blocks.
        (`patch_mask` is accepted for a common interface and ignored: masked patches are
        already zero in `corrupted`.)"""
        corrupted = jnp.asarray(corrupted)
        num_steps = positive_int("num_steps", num_steps, minimum=0)

        def body(z: Array, _: None) -> tuple[Array, Array]:
            z = self._blocks(z)
            return z, self._decode(z)

        _, images = jax.lax.scan(body, self._embed(corrupted), None, length=num_steps)
        return jnp.concatenate([corrupted[None], images.astype(corrupted.dtype)], axis=0)

    def _random_depth(self, image: Array, num_iterations: Array, max_iterations: int) -> Array:
        def body(z: Array, t: Array) -> tuple[Array, None]:
            return jnp.where(t < num_iterations, self._blocks(z), z), None

        z, _ = jax.lax.scan(body, self._embed(image), jnp.arange(max_iterations))
        return self._decode(z)


def _reconstruction_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (images,) = data
    batch_size, task, min_iterations, max_iterations, mask_fraction, noise_variance = config
    model = eqx.combine(params, static)
    pick_key, depth_key, corrupt_key = jr.split(step_key, 3)
    chosen = jr.choice(pick_key, images.shape[0], (batch_size,), replace=False)
    batch = images[chosen]
    corrupted, _ = jax.vmap(
        lambda image, k: corrupt_image(
            image,
            task,
            patch_size=model.patch_size,
            key=k,
            mask_fraction=mask_fraction,
            noise_variance=noise_variance,
        )
    )(batch, jr.split(corrupt_key, batch_size))
    tau = jr.randint(depth_key, (), min_iterations, max_iterations + 1)
    outputs = jax.vmap(lambda image: model._random_depth(image, tau, max_iterations))(corrupted)
    return jnp.mean(jnp.square(outputs - batch))


def train_reconstruction(
    model: PatchTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    task: Task,
    key: PRNGKeyArray,
    train_steps: int,
    min_iterations: int = 1,
    max_iterations: int = 1,
    batch_size: int = 64,
    mask_fraction: float = 0.3,
    noise_variance: float = 0.7,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Train a [`PatchTransformer`][energyattn.models.PatchTransformer] by backpropagation to
    undo one task's corruption.

    $$\min_\theta\; \mathbb E\, \bigl\lVert f_\theta^{\,\tau}(\tilde x) - x\bigr\rVert^2 / n,
      \qquad \tau\sim\mathcal U\{\text{min\_iterations}..\text{max\_iterations}\}$$

    Each step draws a batch, corrupts it ([`corrupt_image`][energyattn.models.corrupt_image])
    and one $\tau$ for the whole batch (AlphaFold's recycling; the paper uses 3..7 for the
    recycled block and 1 for the vision transformer). Unlike the attractor network, the model
    is trained for one task.

    **Arguments:** as [`train_attractor`][energyattn.models.train_attractor] (but no `lam`),
    plus `task` (`"masked"` or `"denoise"`), the range of $\tau$ (`min_iterations`,
    `max_iterations`) and the corruption's `mask_fraction` and `noise_variance`. Unless
    `options` sets them, the learning rate is `1e-3` and the weight decay `1e-4`.

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].
    """
    task = _check_task(task)
    images = _check_images(images, model.image_shape)
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    min_iterations = positive_int("min_iterations", min_iterations)
    max_iterations = positive_int("max_iterations", max_iterations)
    if max_iterations < min_iterations:
        raise ValueError(
            f"max_iterations={max_iterations} is below min_iterations={min_iterations}"
        )
    config = (
        batch_size,
        task,
        min_iterations,
        max_iterations,
        float(mask_fraction),
        float(noise_variance),
    )
    return fit(
        model,
        _reconstruction_loss,
        (images,),
        config,
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=1e-3,
    )
