"""The attractor image model: spin-embedded patches, bare self-attention dynamics,
pseudo-likelihood training, and the masked-prediction / denoising tasks of the paper."""

import dataclasses
from typing import Any, Literal, Protocol, cast, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, PyTree

from .._checks import check_image_shape, check_pixels, num_corrupted, positive_int, shape_str
from .._custom_types import Normalisation, Scalar, ScalarLike
from ..data import SpinPatchEmbedding, add_rescaled_noise, patchify, random_patch_mask, unpatchify
from ..nn import AttractorAttention
from ._training import TrainOptions, TrainResult, fit

Task = Literal["masked", "denoise"]
TASKS: tuple[Task, ...] = ("masked", "denoise")


def _check_task(task: Any) -> Task:
    if task not in TASKS:
        raise ValueError(f"task must be 'masked' or 'denoise', got {task!r}")
    return task


def corrupt_image(
    image: Float[ArrayLike, "channels height width"],
    task: Task,
    *,
    patch_size: int,
    key: PRNGKeyArray,
    mask_fraction: float = 0.3,
    noise_variance: float = 0.7,
) -> tuple[Float[Array, "channels height width"], Bool[Array, " patches"]]:
    r"""The corrupted input of one of the paper's two tasks, and which patches were masked.

    - `"masked"`: `round(mask_fraction * N)` of the $N$ patches, chosen uniformly, are set to
      zero (30% in the paper);
    - `"denoise"`: Gaussian noise of variance `noise_variance` on every pixel, then rescaled to
      the clean image's mean and variance and clipped to $[0, 1]$
      ([`add_rescaled_noise`][energyattn.data.add_rescaled_noise]); no patch is masked.

    **Returns:**

    `(corrupted_image, patch_mask)`: the image (same shape, pixels in $[0, 1]$) and a boolean
    `(N,)` mask, `True` for masked patches (all `False` for denoising).
    """
    task = _check_task(task)
    image = check_pixels("image", image)
    if image.ndim != 3:
        raise ValueError(
            f"image must have shape (channels, height, width), got {shape_str(image.shape)}"
        )
    (_, height, width), patch_size = check_image_shape(image.shape, patch_size)
    num_patches = (height // patch_size) * (width // patch_size)
    if task == "denoise":
        noisy = add_rescaled_noise(image, noise_variance, key=key)
        return noisy, jnp.zeros(num_patches, dtype=bool)
    mask = random_patch_mask(key, num_patches, num_corrupted(mask_fraction, num_patches))
    patches = patchify(image, patch_size)
    patches = jnp.where(mask[:, None], jnp.zeros((), patches.dtype), patches)
    return unpatchify(patches, image.shape, patch_size), mask


@runtime_checkable
class Reconstructor(Protocol):
    """What [`reconstruction_curves`][energyattn.models.reconstruction_curves] needs."""

    image_shape: tuple[int, int, int]
    patch_size: int

    def reconstruct(self, corrupted: Array, patch_mask: Array, num_steps: int) -> Array: ...


class AttractorImageModel(eqx.Module):
    r"""Images through self-attention as an attractor network.

    Patches become unit vector spins ([`SpinPatchEmbedding`][energyattn.data.SpinPatchEmbedding],
    fixed and random), the tokens run the bare self-attention dynamics of
    [`AttractorAttention`][energyattn.nn.AttractorAttention],

    $$x_i(t+1) = \mathcal N\Bigl(\sum_{j\ne i}\alpha_{i\leftarrow j}J_{ij}x_j(t)
      + \gamma x_i(t)\Bigr),$$

    and every state decodes back to an image. There are no other parameters than $J$, which
    [`train_attractor`][energyattn.models.train_attractor] learns by pseudo-likelihood on clean
    images, for all tasks at once.

    **Arguments:**

    - `image_shape`: `(channels, height, width)`.
    - `patch_size`: side of the square patches (2 works best for this model in the paper).
    - `dim`: token dimension $d \ge 2a$ (default 64).
    - `num_steps`, `gamma`, `lam`, `normalisation`, `coupling_norm`, `norm_scope`: of the
      [`AttractorAttention`][energyattn.nn.AttractorAttention] layer (defaults: 30 steps,
      $\gamma = 1$, $\lambda = 1$ at use, spherical normalisation, block norm 0.25).
    - `key`: PRNG key (the embedding and the initial couplings).

    ??? cite "Source"

        F. D'Amico, M. Negri, *Self-attention as an attractor network: transient memories
        without backpropagation* (2024).
    """

    embedding: SpinPatchEmbedding
    attention: AttractorAttention

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        dim: int = 64,
        *,
        num_steps: int = 30,
        gamma: float = 1.0,
        lam: float = 1.0,
        normalisation: Normalisation = "sphere",
        coupling_norm: float = 0.25,
        norm_scope: Literal["tensor", "block"] = "tensor",
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        embed_key, coupling_key = jr.split(key)
        self.embedding = SpinPatchEmbedding(
            image_shape, patch_size, dim, key=embed_key, dtype=dtype
        )
        self.attention = AttractorAttention(
            self.embedding.num_tokens,
            self.embedding.dim,
            num_steps=num_steps,
            gamma=gamma,
            lam=lam,
            normalisation=normalisation,
            coupling_norm=coupling_norm,
            norm_scope=norm_scope,
            dtype=dtype,
            key=coupling_key,
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """`(channels, height, width)`."""
        return self.embedding.image_shape

    @property
    def patch_size(self) -> int:
        """Side of the square patches."""
        return self.embedding.patch_size

    @property
    def num_tokens(self) -> int:
        """Patches (tokens) per image."""
        return self.embedding.num_tokens

    def encode(self, image: Float[ArrayLike, "channels height width"]) -> Float[Array, "N d"]:
        """The unit tokens of an image (pixels in $[0, 1]$)."""
        return self.embedding.encode(image)

    def decode(self, tokens: Float[ArrayLike, "N d"]) -> Float[Array, "channels height width"]:
        """The image of a state of the tokens."""
        return self.embedding.decode(tokens)

    def energy(
        self, image: Float[ArrayLike, "channels height width"], *, lam: ScalarLike = 5.0
    ) -> Scalar:
        r"""The pseudo-likelihood energy $E(\xi) = \sum_i e_i(\xi)$ of a clean image at
        inverse temperature `lam` (5 in the paper's training): the per-example training loss."""
        return self.attention.energy(self.encode(image), lam=lam)

    def reconstruct(
        self,
        corrupted: Float[ArrayLike, "channels height width"],
        patch_mask: Bool[ArrayLike, " N"] | None = None,
        num_steps: int | None = None,
    ) -> Float[Array, "states channels height width"]:
        """Run the dynamics from a corrupted image and decode every state.

        Masked patches (`patch_mask` True) start as zero tokens, as in the paper. Entry 0 of
        the result is `corrupted` itself; entry $t \\ge 1$ is the decoded state after $t$
        iterations.
        """
        tokens = self.encode(corrupted)
        if patch_mask is not None:
            patch_mask = jnp.asarray(patch_mask)
            if patch_mask.shape != (self.num_tokens,):
                raise ValueError(
                    f"patch_mask must have shape (N={self.num_tokens},), got "
                    f"{shape_str(patch_mask.shape)}"
                )
            tokens = jnp.where(patch_mask[:, None], jnp.zeros((), tokens.dtype), tokens)
        trajectory = self.attention(tokens, num_steps=num_steps)
        images = jax.vmap(self.decode)(trajectory[1:]).astype(jnp.asarray(corrupted).dtype)
        return jnp.concatenate([jnp.asarray(corrupted)[None], images], axis=0)


def _check_images(images: Any, image_shape: tuple[int, int, int]) -> Array:
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != image_shape:
        raise ValueError(
            f"images must have shape (n, *{image_shape}), got {shape_str(images.shape)}"
        )
    return check_pixels("images", images)


@eqx.filter_jit
def _encode_all(embedding: SpinPatchEmbedding, images: Array) -> Array:
    return jax.vmap(embedding.encode)(images)


def _pseudo_likelihood_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (tokens,) = data
    batch_size, lam = config
    layer = eqx.combine(params, static)
    chosen = jr.choice(step_key, tokens.shape[0], (batch_size,), replace=False)
    return jnp.mean(jax.vmap(lambda x: layer.energy(x, lam=lam))(tokens[chosen]))


def _project_couplings(params: PyTree, static: PyTree) -> PyTree:
    layer = eqx.combine(params, static).project()
    return eqx.filter(layer, eqx.is_inexact_array)


def train_attractor(
    model: AttractorImageModel,
    images: Float[ArrayLike, "n channels height width"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    batch_size: int = 32,
    lam: float = 5.0,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Learn the couplings by pseudo-likelihood on clean images; no backpropagation through
    the dynamics.

    $$\min_J\; \frac1B\sum_{\mu\in\text{batch}} \sum_i
      -\frac1\lambda\log\sum_{j\ne i} e^{\lambda\,\xi_i^{\mu\top} J_{ij}\,\xi_j^\mu}
      \quad\text{s.t.}\quad J_{ii} = 0,\ \lVert J\rVert \text{ fixed}$$

    The loss is lowered without bound by growing $J$, so after every optimiser step $J$ is
    projected back to its fixed norm with zero diagonal blocks
    ([`AttractorAttention.project`][energyattn.nn.AttractorAttention.project]). The optimiser is
    [`make_optimizer`][energyattn.models.make_optimizer] (Adam with global-norm gradient
    clipping, warm-up and cosine decay; no weight decay unless `options` sets one: the
    projection would undo it).
    The embedding is fixed, so the images are encoded once. The task is not part of training:
    one trained model serves masked prediction and denoising.

    **Arguments:**

    - `model`: the initial model.
    - `images`: clean training images `(n, channels, height, width)`, pixels in $[0, 1]$.
    - `key`: PRNG key for the batches (step $s$ uses `fold_in(key, s)`).
    - `train_steps`: optimisation steps (the paper: 20 epochs with batches of 32).
    - `batch_size`: images per step.
    - `lam`: inverse temperature of the training energy (5 in the paper; the dynamics keeps
      the model's own `lam`, 1 by default).
    - `options`: the optimiser, checkpoints, time limit, progress and callback, a
      [`TrainOptions`][energyattn.models.TrainOptions] (learning rate `3e-3` and weight
      decay `0` unless set).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult] whose `model` is the trained
    `AttractorImageModel`.
    """
    images = _check_images(images, model.image_shape)
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    lam = float(lam)
    if not lam > 0:
        raise ValueError(f"lam must be > 0, got {lam!r}")
    tokens = _encode_all(model.embedding, images)
    result = fit(
        model.attention.project(),
        _pseudo_likelihood_loss,
        (tokens,),
        (batch_size, lam),
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=3e-3,
        default_weight_decay=0.0,
        project=_project_couplings,
    )
    trained = eqx.tree_at(lambda m: m.attention, model, result.model)
    return dataclasses.replace(result, model=trained)


def reconstruction_curves(
    model: Reconstructor,
    images: Float[ArrayLike, "n channels height width"],
    *,
    task: Task,
    key: PRNGKeyArray,
    num_steps: int,
    mask_fraction: float = 0.3,
    noise_variance: float = 0.7,
    batch_size: int = 256,
) -> dict[str, np.ndarray]:
    r"""Mean squared error against the clean images after each iteration $t = 0..T$.

    Every image is corrupted by [`corrupt_image`][energyattn.models.corrupt_image] with the key
    `fold_in(key, i)` (so two models evaluated with the same key and patch size see the same
    corruptions), then `model.reconstruct(corrupted, patch_mask, num_steps)` gives the images
    at $t = 0$ (the corrupted input) to $T$.

    **Returns:**

    A dict of NumPy arrays of shape `(T+1,)`:

    - `"mse"`: mean over images and all pixels;
    - `"masked_mse"` (task `"masked"` only): mean over the pixels of the masked patches (the
      prediction error proper; at $t=0$ those pixels are zero);
    - and `"examples"`: the first 8 images' reconstructions, shape `(8, T+1, c, h, w)`.
    """
    task = _check_task(task)
    images = _check_images(images, model.image_shape)
    num_steps = positive_int("num_steps", num_steps, minimum=0)
    patch_size = model.patch_size

    @eqx.filter_jit
    def batch_errors(model: Any, batch: Array, indices: Array) -> tuple[Array, ...]:
        def one(image: Array, index: Array) -> tuple[Array, ...]:
            corrupted, mask = corrupt_image(
                image,
                task,
                patch_size=patch_size,
                key=jr.fold_in(key, index),
                mask_fraction=mask_fraction,
                noise_variance=noise_variance,
            )
            states = model.reconstruct(corrupted, mask, num_steps)
            errors = jnp.square(states - image[None])
            pixel_mask = unpatchify(
                jnp.broadcast_to(mask[:, None], patchify(image, patch_size).shape).astype(
                    errors.dtype
                ),
                image.shape,
                patch_size,
            )
            masked_sum = jnp.sum(errors * pixel_mask[None], axis=(1, 2, 3))
            return jnp.mean(errors, axis=(1, 2, 3)), masked_sum, jnp.sum(pixel_mask), states

        return jax.vmap(one)(batch, indices)

    # Every call has the same shapes (the last batch is padded), so it compiles once.
    num_images = images.shape[0]
    batch_size = min(positive_int("batch_size", batch_size), num_images)
    mse, masked_sum, masked_count, examples = [], [], [], None
    for start in range(0, num_images, batch_size):
        indices = jnp.arange(start, start + batch_size)
        batch = images[jnp.minimum(indices, num_images - 1)]
        a, b, c, states = batch_errors(model, batch, indices)
        keep = min(batch_size, num_images - start)
        mse.append(np.asarray(a)[:keep])
        masked_sum.append(np.asarray(b)[:keep])
        masked_count.append(np.asarray(c)[:keep])
        if examples is None:
            examples = np.asarray(states[: min(8, keep)])
    out: dict[str, np.ndarray] = {
        "mse": np.concatenate(mse).mean(axis=0),
        "examples": cast(np.ndarray, examples),  # set by the first batch (there is one)
    }
    if task == "masked":
        out["masked_mse"] = (
            np.concatenate(masked_sum).sum(axis=0) / np.concatenate(masked_count).sum()
        )
    return out
