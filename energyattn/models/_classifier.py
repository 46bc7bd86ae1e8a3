"""Image classification with deep implicit attention: a CLS site reads out a mean-field response."""

from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from einops import rearrange
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, PyTree

from .._checks import check_finite, check_image_shape, positive_int, shape_str
from .._solver import RESULTS, Solution, ok_result
from ..nn import MeanFieldAttention, SoftmaxAttention, SpinTransformerAttention
from ._training import TrainOptions, TrainResult, fit


def _patch_sites(model: Any, image: Any) -> Float[Array, "sites dim"]:
    """The classifiers' shared front end: CLS token, then one embedded patch per site."""
    image = jnp.asarray(image)
    if image.shape != model.image_shape:
        raise ValueError(f"image must have shape {model.image_shape}, got {shape_str(image.shape)}")
    # Images come as whatever NumPy gives (often float64): compute in the model's dtype.
    image = check_finite("the image", image.astype(model.conv.weight.dtype))
    features = jax.nn.relu(model.conv(image))
    p = model.patch_size
    pooled = rearrange(features, "c (gh h) (gw w) -> (gh gw) c (h w)", h=p, w=p).max(-1)
    return jnp.concatenate([model.cls_token[None], jax.vmap(model.embed)(pooled)])


def _front_end(
    image_shape: Any, patch_size: int, dim: int, conv_channels: int, keys: Any
) -> tuple[tuple[int, int, int], int, int, eqx.nn.Conv2d, eqx.nn.Linear, Array]:
    """Checked shapes, the number of patches, and the front end's initial parameters (from
    the keys of the convolution, the embedding and the CLS token)."""
    image_shape, patch_size = check_image_shape(image_shape, patch_size)
    channels, height, width = image_shape
    conv_channels = positive_int("conv_channels", conv_channels)
    num_patches = (height // patch_size) * (width // patch_size)
    kc, ke, kt = keys
    conv = eqx.nn.Conv2d(channels, conv_channels, 3, padding=1, key=kc)
    embed = eqx.nn.Linear(conv_channels, dim, key=ke)
    cls_token = jr.normal(kt, (dim,)) / np.sqrt(dim)
    return image_shape, patch_size, num_patches, conv, embed, cls_token


class MeanFieldClassifier(eqx.Module):
    r"""A classifier whose only token mixing is a deep-implicit-attention fixed point.

    1. Patch embedding: a $3\times3$ convolution (ReLU, same padding), max-pooled over each
       `patch_size` patch, then a linear map to `dim`: one site per patch.
    2. A learnable CLS site is prepended: an input injection shared by all images.
    3. [`MeanFieldAttention`][energyattn.nn.MeanFieldAttention] (neural variant, Anderson,
       implicit backward) solves $z_i = \sum_j J_{ij}z_j - f_\theta(z_i) + x_i$ over the
       sites.
    4. A linear head reads the CLS site's response $z_0$.

    The system has to organise its couplings so that the CLS site receives what it needs.
    By default the map is kept a contraction (`contraction=0.9`, see `MeanFieldAttention`):
    without it, training drives the couplings out of the contractive regime within a few
    hundred steps and the solves stop converging.

    **Arguments:**

    - `image_shape`: `(channels, height, width)` (default `(1, 8, 8)`, the shipped digits).
    - `patch_size`: side of the square patches (default 4: a 2x2 grid of sites plus CLS).
    - `dim`: $d$, the spin dimension (default 24).
    - `num_classes`: default 10.
    - `conv_channels`: channels of the convolution (default 16).
    - `key`: PRNG key (keyword only); other keywords go to `MeanFieldAttention` (e.g.
      `solver`, `adjoint`, `max_steps`, `contraction`, `sym_internal`).

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "Simple example: MNIST" (a convolutional
        feature extractor, a CLS site and a deep implicit attention layer).
    """

    conv: eqx.nn.Conv2d
    embed: eqx.nn.Linear
    cls_token: Float[Array, " dim"]
    attention: MeanFieldAttention
    head: eqx.nn.Linear
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 4,
        dim: int = 24,
        num_classes: int = 10,
        *,
        conv_channels: int = 16,
        key: PRNGKeyArray,
        **attention_kwargs: Any,
    ):
        dim = positive_int("dim", dim)
        num_classes = positive_int("num_classes", num_classes)
        kc, ke, kt, ka, kh = jr.split(key, 5)
        front = _front_end(image_shape, patch_size, dim, conv_channels, (kc, ke, kt))
        self.image_shape, self.patch_size, num_patches, self.conv, self.embed, self.cls_token = (
            front
        )
        attention_kwargs.setdefault("sym_internal", True)
        attention_kwargs.setdefault("contraction", 0.9)
        attention_kwargs.setdefault("throw", False)
        self.attention = MeanFieldAttention(num_patches + 1, dim, key=ka, **attention_kwargs)
        self.head = eqx.nn.Linear(dim, num_classes, key=kh)

    @property
    def num_classes(self) -> int:
        return cast(int, self.head.out_features)  # built from an int, never "scalar"

    def sites(self, image: Float[ArrayLike, "channels height width"]) -> Float[Array, "sites dim"]:
        """The input fields: the CLS token, then one embedded patch per site (row by row)."""
        return _patch_sites(self, image)

    def solve(self, image: Float[ArrayLike, "channels height width"]) -> Solution:
        """The mean-field solve for one image (steps, residual, result code, site responses)."""
        return self.attention.solve(self.sites(image))

    def __call__(
        self, image: Float[ArrayLike, "channels height width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        """Class logits for one image. (`key` is unused.)"""
        return self.head(self.attention(self.sites(image))[0])


Mixer = Literal["spin_transformer", "softmax"]


class AttentionClassifier(eqx.Module):
    r"""The [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier]'s skeleton with
    another token mixer: the same convolutional patch embedding, CLS site and linear head
    on the CLS output, with

    - `"spin_transformer"`: [`SpinTransformerAttention`][energyattn.nn.SpinTransformerAttention]
      (the heads' steady-state magnetizations; Anderson, implicit backward), or
    - `"softmax"`: [`SoftmaxAttention`][energyattn.nn.SoftmaxAttention] (multi-head, query,
      key, value and output projections), the explicit baseline.

    **Arguments:**

    - `mixer`: `"spin_transformer"` (default) or `"softmax"`.
    - `image_shape`, `patch_size`, `dim`, `num_classes`, `conv_channels`: as in
      `MeanFieldClassifier` (default patch size 2 here: a 4x4 grid of sites plus CLS).
    - `num_heads`: heads of the mixer (default 4).
    - `key`: PRNG key (keyword only); other keywords go to the mixer (e.g. `beta`,
      `solver`, `max_steps` for the spin transformer).
    """

    conv: eqx.nn.Conv2d
    embed: eqx.nn.Linear
    cls_token: Float[Array, " dim"]
    attention: SpinTransformerAttention | SoftmaxAttention
    head: eqx.nn.Linear
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)
    mixer: str = eqx.field(static=True)

    def __init__(
        self,
        mixer: Mixer = "spin_transformer",
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        dim: int = 24,
        num_classes: int = 10,
        *,
        num_heads: int = 4,
        conv_channels: int = 16,
        key: PRNGKeyArray,
        **mixer_kwargs: Any,
    ):
        if mixer not in ("spin_transformer", "softmax"):
            raise ValueError(f"mixer must be 'spin_transformer' or 'softmax', got {mixer!r}")
        self.mixer = mixer
        dim = positive_int("dim", dim)
        num_classes = positive_int("num_classes", num_classes)
        kc, ke, kt, ka, kh = jr.split(key, 5)
        front = _front_end(image_shape, patch_size, dim, conv_channels, (kc, ke, kt))
        self.image_shape, self.patch_size, _, self.conv, self.embed, self.cls_token = front
        if mixer == "spin_transformer":
            mixer_kwargs.setdefault("throw", False)
            self.attention = SpinTransformerAttention(dim, num_heads, key=ka, **mixer_kwargs)
        else:
            self.attention = SoftmaxAttention(dim, num_heads=num_heads, key=ka, **mixer_kwargs)
        self.head = eqx.nn.Linear(dim, num_classes, key=kh)

    @property
    def num_classes(self) -> int:
        return cast(int, self.head.out_features)  # built from an int, never "scalar"

    def sites(self, image: Float[ArrayLike, "channels height width"]) -> Float[Array, "sites dim"]:
        """The input tokens: the CLS token, then one embedded patch per site (row by row)."""
        return _patch_sites(self, image)

    def solve(self, image: Float[ArrayLike, "channels height width"]) -> Solution:
        """The mixer's output for one image as a [`Solution`][energyattn.Solution]: for the
        spin transformer the largest step count and the first failing head's result; the
        softmax mixer has no solver (0 steps, always successful)."""
        sites = self.sites(image)
        if isinstance(self.attention, SpinTransformerAttention):
            out, heads = self.attention(sites, return_solution=True)
            failing = jnp.argmax(heads.result != RESULTS.successful)
            result = jax.tree.map(lambda code: code[failing], heads.result)
            return Solution(out, result, jnp.max(heads.num_steps), jnp.max(heads.residual))
        out = self.attention(sites)
        zero = jnp.zeros((), out.dtype)
        return Solution(out, ok_result(), jnp.zeros((), jnp.int32), zero)

    def __call__(
        self, image: Float[ArrayLike, "channels height width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        """Class logits for one image. (`key` is unused.)"""
        return self.head(self.attention(self.sites(image))[0])


Classifier = MeanFieldClassifier | AttentionClassifier


def _classification_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    images, labels = data
    (batch_size,) = config
    model = eqx.combine(params, static)
    chosen = jr.choice(step_key, images.shape[0], (batch_size,), replace=False)
    logits = jax.vmap(model)(images[chosen])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels[chosen]))


def _check_images(
    model: Any, images: Any, labels: Any
) -> tuple[Float[Array, "n c h w"], Int[Array, " n"]]:
    """Images `(n, *model.image_shape)` (or grey `(n, h, w)`) and integer labels in
    `[0, model.num_classes)`, for any classifier with those two attributes."""
    images = jnp.asarray(images)
    if images.ndim == 3 and model.image_shape[0] == 1:
        images = images[:, None]  # (n, height, width) grey images
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        raise ValueError(
            f"images must have shape (n, *{model.image_shape}), got {shape_str(images.shape)}"
        )
    labels = jnp.asarray(labels)
    if labels.shape != (images.shape[0],) or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"labels must be integers of shape ({images.shape[0]},), got "
            f"{labels.dtype} {shape_str(labels.shape)}"
        )
    bad = np.asarray((labels < 0) | (labels >= model.num_classes))
    if bad.any():
        raise ValueError(
            f"labels must be in [0, {model.num_classes}), got {np.asarray(labels)[bad][:5]}"
        )
    return images, labels


def train_classifier(
    model: eqx.Module,
    images: Float[ArrayLike, "n ..."],
    labels: Int[ArrayLike, " n"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    batch_size: int = 64,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Train a [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier], an
    [`AttentionClassifier`][energyattn.models.AttentionClassifier], or any classifier module
    with `image_shape`, `num_classes` and `model(image) -> logits`, by cross-entropy.

    $$\min_\theta\; \mathbb E_{(x, c)}\; -\log \operatorname{softmax}(f_\theta(x))_c$$

    Each step draws `batch_size` training examples (without replacement). Gradients flow
    through the fixed point by the layer's adjoint (implicit by default).

    **Arguments:**

    - `model`: the initial model.
    - `images`: `(n, channels, height, width)`, or `(n, height, width)` for one channel.
    - `labels`: integer classes, shape `(n,)`.
    - `key`: PRNG key (the batches).
    - `train_steps`: optimisation steps (the schedule's length); any number `>= 1`.
    - `batch_size`: examples per step.
    - `options`: the optimiser, checkpoints, time limit, progress and callback, a
      [`TrainOptions`][energyattn.models.TrainOptions] (learning rate `3e-3` unless set).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].
    """
    images, labels = _check_images(model, images, labels)
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    return fit(
        model,
        _classification_loss,
        (images, labels),
        (batch_size,),
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=3e-3,
    )


@eqx.filter_jit
def _evaluate_batch(model: Classifier, images: Array) -> tuple[Array, Array, Array]:
    def one(image: Array) -> tuple[Array, Array, Array]:
        solution = model.solve(image)
        logits = model.head(solution.value[0])
        return jnp.argmax(logits), solution.num_steps, solution.result == RESULTS.successful

    return jax.vmap(one)(images)


def evaluate_classifier(
    model: Classifier,
    images: Float[ArrayLike, "n ..."],
    labels: Int[ArrayLike, " n"],
    *,
    batch_size: int = 512,
) -> dict[str, float]:
    """Accuracy and solver statistics on held-out data.

    **Returns:**

    `{"accuracy", "mean_steps", "max_steps", "converged"}` as Python floats: the fraction
    classified correctly, the mean and largest number of fixed-point iterations, and the
    fraction of solves that met the tolerance.
    """
    images, labels = _check_images(model, images, labels)
    batch_size = positive_int("batch_size", batch_size)
    predictions, steps, converged = [], [], []
    for start in range(0, images.shape[0], batch_size):
        p, s, c = _evaluate_batch(model, images[start : start + batch_size])
        predictions.append(np.asarray(p))
        steps.append(np.asarray(s))
        converged.append(np.asarray(c))
    predicted, taken = np.concatenate(predictions), np.concatenate(steps)
    return {
        "accuracy": float(np.mean(predicted == np.asarray(labels))),
        "mean_steps": float(np.mean(taken)),
        "max_steps": float(np.max(taken)),
        "converged": float(np.mean(np.concatenate(converged))),
    }
