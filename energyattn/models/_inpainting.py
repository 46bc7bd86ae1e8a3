"""Training and evaluating the image Energy Transformer on masked-patch inpainting: the
loss (mean squared error on the masked patches), `train_inpainting`, and
`evaluate_inpainting` against the mean-patch baseline."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, PyTree

from .._checks import (
    positive_int,
    shape_str,
)
from .._custom_types import Scalar
from ..data import random_patch_mask
from ._image_et import ImageEnergyTransformer
from ._training import TrainOptions, TrainResult, fit


def masked_patch_mse(
    model: ImageEnergyTransformer,
    image: Float[ArrayLike, "channels height width"],
    mask: Bool[ArrayLike, " patches"],
) -> Scalar:
    r"""Mean squared error of the reconstruction on the masked patches only.

    $$\ell = \frac{1}{|S|\,Z} \sum_{n \in S} \lVert \hat P_n - P_n \rVert^2,
      \qquad S = \{n : \mathrm{mask}_n\},\; Z = \text{pixels per patch}$$

    (0 when nothing is masked). Average it over a batch with `jax.vmap`.
    """
    mask = model._check_mask(mask)
    return masked_patch_error(model.patchify(model(image, mask)), model.patchify(image), mask)


def masked_patch_error(
    predicted: Float[Array, "patches patch_dim"],
    target: Float[Array, "patches patch_dim"],
    mask: Bool[Array, " patches"],
) -> Scalar:
    """Mean squared error over the pixels of the masked patches (0 when none is masked)."""
    per_patch = jnp.mean(jnp.square(predicted - target), axis=-1)
    return jnp.sum(jnp.where(mask, per_patch, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _inpainting_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (images,) = data
    batch_size, num_masked = config
    model = eqx.combine(params, static)
    pick_key, mask_key = jr.split(step_key)
    chosen = jr.choice(pick_key, images.shape[0], (batch_size,), replace=False)
    masks = jax.vmap(lambda k: random_patch_mask(k, model.num_patches, num_masked))(
        jr.split(mask_key, batch_size)
    )
    losses = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, images[chosen], masks)
    return jnp.mean(losses)


def train_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    num_masked: int,
    batch_size: int = 64,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Train an image Energy Transformer to inpaint randomly masked patches.

    $$\min_\theta\; \mathbb E_{\text{image},\,S}\;
      \frac{1}{|S|Z}\sum_{n\in S}\lVert \hat P_n(\theta) - P_n\rVert^2$$

    Each step draws `batch_size` training images and, for each, a random set $S$ of
    `num_masked` patches; the loss ([`masked_patch_mse`][energyattn.models.masked_patch_mse])
    is vmapped over the batch and differentiated through the unrolled descent.

    **Arguments:**

    - `model`: the initial model.
    - `images`: training images, shape `(n, channels, height, width)`.
    - `key`: a JAX PRNG key (batches and masks).
    - `train_steps`: total optimisation steps (the schedule's length); any number `>= 1`.
    - `num_masked`: patches masked per image.
    - `batch_size`: images per step.
    - `options`: the optimiser, checkpoints, time limit, progress and callback, a
      [`TrainOptions`][energyattn.models.TrainOptions] (learning rate `3e-3` unless set).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        channels, height, width = model.image_shape
        raise ValueError(
            f"images must have shape (n, channels={channels}, height={height}, width={width}), "
            f"got {shape_str(images.shape)}"
        )
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    random_patch_mask(key, model.num_patches, num_masked)  # validates num_masked early
    return fit(
        model,
        _inpainting_loss,
        (images,),
        (batch_size, num_masked),
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=3e-3,
    )


def evaluate_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    num_masked: int,
    key: PRNGKeyArray,
    mean_image: Float[ArrayLike, "channels height width"],
    batch_size: int = 256,
) -> dict[str, float]:
    r"""Masked-patch MSE of the model and of the mean-patch baseline on the same masks.

    The baseline fills each masked patch with the mean training patch *at that position*
    (the patch of `mean_image`, usually the training set's mean image), the best prediction
    that ignores the visible patches.

    **Arguments:**

    - `model`: the model to evaluate.
    - `images`: held-out images, shape `(n, channels, height, width)`.
    - `num_masked`: patches masked per image.
    - `key`: a JAX PRNG key for the masks (image `i` uses `fold_in(key, i)`).
    - `mean_image`: the baseline's prediction for every image.
    - `batch_size`: images per compiled call (memory only; results do not depend on it).

    **Returns:**

    `{"mse": ..., "baseline_mse": ..., "ratio": mse / baseline_mse}` as Python floats.
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        raise ValueError(
            f"images must have shape (n, *{model.image_shape}), got {shape_str(images.shape)}"
        )
    mean_patches = model.patchify(mean_image)

    @eqx.filter_jit
    def errors(model: ImageEnergyTransformer, batch: Array, indices: Array) -> tuple:
        masks = jax.vmap(
            lambda i: random_patch_mask(jr.fold_in(key, i), model.num_patches, num_masked)
        )(indices)
        ours = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, batch, masks)

        def baseline(image: Array, mask: Array) -> Array:
            return masked_patch_error(mean_patches, model.patchify(image), mask)

        return ours, jax.vmap(baseline)(batch, masks)

    ours, base = [], []
    # Every call has the same shape, so `errors` compiles once: the last batch is padded
    # (with blank images whose errors are dropped).
    size = max(1, min(batch_size, images.shape[0]))
    for start in range(0, images.shape[0], size):
        batch = images[start : start + size]
        count = batch.shape[0]
        batch = jnp.pad(batch, ((0, size - count), (0, 0), (0, 0), (0, 0)))
        a, b = errors(model, batch, jnp.arange(start, start + size))
        ours.append(np.asarray(a)[:count])
        base.append(np.asarray(b)[:count])
    mse = float(np.mean(np.concatenate(ours)))
    baseline_mse = float(np.mean(np.concatenate(base)))
    return {"mse": mse, "baseline_mse": baseline_mse, "ratio": mse / baseline_mse}
