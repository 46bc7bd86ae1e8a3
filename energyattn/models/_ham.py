"""An image classifier that is a hierarchical associative memory: image, convolutional
features and labels as neuron layers of one energy, trained through its unrolled descent."""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .. import lagrangians
from .._checks import check_finite, check_positive, keyword_arguments, positive_int, shape_str
from .._solver import Solution
from ..ham import HAM, BiasSynapse, ConvSynapse, DenseSynapse, Neurons
from ._classifier import _check_images


def _parts(
    image_shape: Any,
    num_classes: Any,
    channels: Any,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dtype: Any,
    key: PRNGKeyArray,
) -> tuple[
    tuple[int, int, int], tuple[int, int, int], ConvSynapse, DenseSynapse, BiasSynapse, BiasSynapse
]:
    """Checked shapes and the weights both classifiers share (the same for the same key):
    the convolution, the dense feature-to-label weights and the two biases."""
    image_shape = tuple(image_shape)
    if len(image_shape) != 3:
        raise ValueError(
            f"image_shape must be (channels, height, width), got {shape_str(image_shape)}"
        )
    in_channels, height, width = (
        positive_int(name, n)
        for name, n in zip(("image channels", "height", "width"), image_shape, strict=True)
    )
    num_classes = positive_int("num_classes", num_classes)
    channels = positive_int("channels", channels)
    kernel_size = positive_int("kernel_size", kernel_size)
    stride = positive_int("stride", stride)
    padding = positive_int("padding", padding, minimum=0)
    sides = [(n + 2 * padding - kernel_size) // stride + 1 for n in (height, width)]
    if min(sides) < 1:
        raise ValueError(
            f"a {kernel_size}x{kernel_size} kernel (padding {padding}) does not fit an image of "
            f"height {height} and width {width}"
        )
    feature_shape = (channels, *sides)
    kc, kd = jr.split(key)
    conv = ConvSynapse(
        in_channels, channels, kernel_size, stride=stride, padding=padding, dtype=dtype, key=kc
    )
    dense = DenseSynapse(feature_shape, num_classes, dtype=dtype, key=kd)
    dtype = dense.weight.dtype
    feature_bias = BiasSynapse(feature_shape, dtype=dtype)
    label_bias = BiasSynapse(num_classes, dtype=dtype)
    return (in_channels, height, width), feature_shape, conv, dense, feature_bias, label_bias


def _check_image(model: Any, image: Any) -> Float[Array, "channels height width"]:
    image = jnp.asarray(image)
    if image.shape != model.image_shape:
        raise ValueError(f"image must have shape {model.image_shape}, got {shape_str(image.shape)}")
    # Images come as whatever NumPy gives (often float64): compute in the model's dtype.
    return check_finite("the image", image.astype(model.dtype))


class HAMClassifier(eqx.Module):
    r"""An image classifier that is a hierarchical associative memory (HAM).

    Three layers of neurons, each with its state $x_\ell$, Lagrangian $L_\ell$ and
    activation $g_\ell = \nabla L_\ell(x_\ell)$, and one energy for the whole graph:

    $$E = \sum_{\ell} \big(g_\ell\cdot x_\ell - L_\ell(x_\ell)\big)
      - \sum_{c,i,j} g_f[c,i,j]\,(K \star g_v)[c,i,j] - g_f^\top W g_y
      - b_f\cdot g_f - b_y\cdot g_y$$

    - `"image"` $v$, shape `image_shape`: identity Lagrangian, clamped to the pixels.
    - `"features"` $f$, shape `(channels, h, w)`: ReLU Lagrangian
      ($g_f = \max(x_f, 0)$), joined to the image by a
      [`ConvSynapse`][energyattn.ham.ConvSynapse] with kernel $K$.
    - `"label"` $y$, shape `(num_classes,)`: softmax Lagrangian
      ($g_y = \mathrm{softmax}(\beta x_y)$), joined to the features by a
      [`DenseSynapse`][energyattn.ham.DenseSynapse] $W$.
    - The biases $b_f, b_y$ are one-layer synapses (external fields).

    A forward pass clamps the image, starts the other layers at zero and runs `num_steps`
    Euler steps of the HAM's dynamics
    $x_\ell \leftarrow x_\ell - \Delta t\,\partial E/\partial g_\ell$
    ([`HAM.descend`][energyattn.ham.HAM.descend], all time constants 1), so the features
    feel both the image (bottom-up, $K \star g_v$) and the current label guess
    (top-down, $W g_y$). Every Lagrangian is convex, so the energy is a Lyapunov function of
    the continuous dynamics; with the default $\Delta t = 1/2$ it also decreased at every
    step on every test digit, before and after training (measured by
    [`evaluate_ham_classifier`][energyattn.models.evaluate_ham_classifier]). The class is
    the energy's, not a transient of the unrolled steps: descending the trained default
    model 200 steps instead of 10, to its fixed point (last steps of rms size below $10^{-7}$),
    gave the same test accuracy on the digits.

    **The logits are $\beta x_y$, the label layer's state** (times $\beta$) at the end of
    the descent. The label layer's activation is $g_y = \mathrm{softmax}(\beta x_y)$: the
    HAM's own class probabilities. With logits $\beta x_y$ the cross-entropy is
    $-\log g_y[\text{class}]$, the negative log activation of the correct label neuron, so
    training makes the memory's label layer itself settle on the right class; the
    predicted class $\arg\max x_y = \arg\max g_y$ is the same either way. Reading $g_y$ as
    logits would apply a second softmax to probabilities; reading $\log g_y$ would compute
    in a numerically worse form what $\beta x_y$ gives exactly.

    Training backpropagates through the unrolled descent (a `jax.lax.scan`) with
    [`train_classifier`][energyattn.models.train_classifier]. The same-size
    feedforward baseline is [`FeedforwardClassifier`][energyattn.models.FeedforwardClassifier].

    **Arguments:**

    - `image_shape`: `(channels, height, width)` (default `(1, 8, 8)`, the shipped digits).
    - `num_classes`: default 10.
    - `channels`, `kernel_size`, `stride`, `padding`: the convolution from the image to the
      features (default 16 channels, a $4\times4$ kernel, stride 2, padding 1: features of
      shape `(16, 4, 4)` on 8x8 digits).
    - `num_steps`: descent steps of a forward pass (default 10).
    - `step_size`: $\Delta t > 0$ (default 0.5).
    - `beta`: the label softmax's inverse temperature $\beta$ (default 1).
    - `dtype`: parameter dtype (default JAX's default float).
    - `key`: PRNG key of the initial weights (keyword only).

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021), arXiv:2107.06446 (layers of
        neurons with Lagrangians, convolutional synapses, a label layer read out after
        the dynamics); B. Hoover et al., HAMUX (github.com/bhoov/hamux): hierarchical
        associative memories as graphs of neuron layers and synapses.
    """

    ham: HAM
    num_steps: int = eqx.field(static=True)
    step_size: float = eqx.field(static=True)
    beta: float = eqx.field(static=True)

    @keyword_arguments("ea.models.HAMClassifier")
    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        num_classes: int = 10,
        *,
        channels: int = 16,
        kernel_size: int = 4,
        stride: int = 2,
        padding: int = 1,
        num_steps: int = 10,
        step_size: float = 0.5,
        beta: float = 1.0,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.num_steps = positive_int("num_steps", num_steps)
        self.step_size = float(check_positive("step_size", step_size))
        self.beta = float(check_positive("beta", beta))
        image_shape, feature_shape, conv, dense, feature_bias, label_bias = _parts(
            image_shape, num_classes, channels, kernel_size, stride, padding, dtype, key
        )
        label_lagrangian = lagrangians.softmax
        if self.beta != 1.0:
            label_lagrangian = eqx.Partial(lagrangians.softmax, beta=self.beta)
        self.ham = HAM(
            neurons={
                "image": Neurons(lagrangians.identity, image_shape),
                "features": Neurons(lagrangians.relu, feature_shape),
                "label": Neurons(label_lagrangian, (dense.shape_b[0],)),
            },
            synapses={
                "conv": conv,
                "dense": dense,
                "feature_bias": feature_bias,
                "label_bias": label_bias,
            },
            connections={
                "conv": ("image", "features"),
                "dense": ("features", "label"),
                "feature_bias": "features",
                "label_bias": "label",
            },
        )

    @property
    def image_shape(self) -> tuple[int, ...]:
        return self.ham.neurons["image"].shape

    @property
    def num_classes(self) -> int:
        return self.ham.neurons["label"].shape[0]

    @property
    def dtype(self) -> Any:
        return cast(DenseSynapse, self.ham.synapses["dense"]).weight.dtype

    def init_states(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> dict[str, Float[Array, "..."]]:
        """The initial states of a descent: the image layer at the pixels, the features and
        the label at zero (so the untrained label activation is uniform)."""
        states = self.ham.init_states(dtype=self.dtype)
        states["image"] = _check_image(self, image)
        return states

    def descend(
        self,
        image: Float[ArrayLike, "channels height width"],
        *,
        num_steps: int | None = None,
        return_trajectory: bool = False,
        throw: bool = True,
    ) -> Solution:
        """The descent of one image, clamped, from
        [`init_states`][energyattn.models.HAMClassifier.init_states].

        **Arguments:**

        - `image`: shape `image_shape`.
        - `num_steps`: descent steps (default: the model's `num_steps`).
        - `return_trajectory`, `throw`: as for [`HAM.descend`][energyattn.ham.HAM.descend].

        **Returns:**

        A [`Solution`][energyattn.Solution]: `value` the final states of the three layers
        (a dict), `energies` the graph's energy before every step and after the last
        (`num_steps + 1` values), `residual` the rms size of the last step, and with
        `return_trajectory=True` the states of the free layers at every step.
        """
        steps = self.num_steps if num_steps is None else positive_int("num_steps", num_steps)
        return self.ham.descend(
            self.init_states(image),
            step_size=self.step_size,
            num_steps=steps,
            clamp=("image",),
            return_trajectory=return_trajectory,
            throw=throw,
        )

    def __call__(
        self, image: Float[ArrayLike, "channels height width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        """Class logits for one image: $\\beta x_y$, the label layer's state after the
        descent times $\\beta$ (`softmax` of them is the label activation). (`key` is
        unused.)"""
        return self.beta * self.descend(image).value["label"]


class FeedforwardClassifier(eqx.Module):
    r"""The same-size feedforward baseline of a [`HAMClassifier`][energyattn.models.HAMClassifier].

    $$\text{logits} = W^\top \max(K \star v + b_f,\, 0) + b_y$$

    The HAM's own weights used once, bottom-up: the convolution $K$ (no bias), the ReLU, the
    dense weights $W$ and the biases $b_f, b_y$, so the parameter count is the HAM's
    exactly, and with the same `key` the initial weights are the HAM's too. It is where the
    HAM's dynamics settle when the label layer's top-down feedback $W g_y$ into the
    features is cut ($\beta = 1$): what the HAM adds is that feedback and the descent.

    **Arguments:**

    As for `HAMClassifier`: `image_shape`, `num_classes`, `channels`, `kernel_size`,
    `stride`, `padding`, `dtype`, `key`.

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021), arXiv:2107.06446; B. Hoover et
        al., HAMUX (github.com/bhoov/hamux).
    """

    conv: ConvSynapse
    dense: DenseSynapse
    feature_bias: BiasSynapse
    label_bias: BiasSynapse
    image_shape: tuple[int, int, int] = eqx.field(static=True)

    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        num_classes: int = 10,
        *,
        channels: int = 16,
        kernel_size: int = 4,
        stride: int = 2,
        padding: int = 1,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.image_shape, _, self.conv, self.dense, self.feature_bias, self.label_bias = _parts(
            image_shape, num_classes, channels, kernel_size, stride, padding, dtype, key
        )

    @property
    def num_classes(self) -> int:
        return self.dense.shape_b[0]

    @property
    def dtype(self) -> Any:
        return self.dense.weight.dtype

    def features(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> Float[Array, "features h w"]:
        """The hidden activations $\\max(K\\star v + b_f, 0)$."""
        image = _check_image(self, image)
        return jax.nn.relu(self.conv.conv(image) + self.feature_bias.bias)

    def __call__(
        self, image: Float[ArrayLike, "channels height width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        """Class logits for one image. (`key` is unused.)"""
        return self.features(image).reshape(-1) @ self.dense.weight + self.label_bias.bias


Model = HAMClassifier | FeedforwardClassifier


# An energy "rises" at a step when it grows by more than this many float epsilons of its
# size: rounding in the sums of a few thousand terms stays well below it.
_RISE_EPS = 64


@eqx.filter_jit
def _evaluate_batch(model: Model, images: Array) -> tuple[Array, ...]:
    if isinstance(model, FeedforwardClassifier):
        return (jnp.argmax(jax.vmap(model)(images), axis=-1),)

    def one(image: Array) -> tuple[Array, ...]:
        solution = model.descend(image)
        energies = solution.energies
        rises = jnp.diff(energies)
        tolerance = _RISE_EPS * jnp.finfo(energies.dtype).eps * (1 + jnp.abs(energies[:-1]))
        return (
            jnp.argmax(solution.value["label"]),
            jnp.all(rises <= tolerance),
            jnp.max(rises),
            energies[0] - energies[-1],
            solution.residual,
        )

    return jax.vmap(one)(images)


def evaluate_ham_classifier(
    model: Model,
    images: Float[ArrayLike, "n ..."],
    labels: Int[ArrayLike, " n"],
    *,
    batch_size: int = 512,
) -> dict[str, float]:
    r"""Accuracy on held-out data and, for a HAM, how its energy behaved along the descents.

    **Arguments:**

    - `model`: a [`HAMClassifier`][energyattn.models.HAMClassifier] or a
      [`FeedforwardClassifier`][energyattn.models.FeedforwardClassifier].
    - `images`: `(n, channels, height, width)`, or `(n, height, width)` for one channel.
    - `labels`: integer classes, shape `(n,)`.
    - `batch_size`: images per compiled call (memory only; results do not depend on it).

    **Returns:**

    `{"accuracy": ...}` as a Python float, the fraction classified correctly; for a
    `HAMClassifier` also

    - `"non_increasing"`: the fraction of images whose energy never rose along the
      descent (no step raised it by more than $64\,\epsilon\,(1 + |E_t|)$, $\epsilon$ the
      dtype's machine epsilon: rounding only);
    - `"max_energy_increase"`: the largest change $E_{t+1} - E_t$ of any step on any image
      (negative when the energy fell at every step);
    - `"mean_energy_drop"`: the mean of $E_0 - E_T$;
    - `"mean_last_step"`: the mean rms size of the last step (zero at a fixed point).
    """
    images, labels = _check_images(model, images, labels)
    batch_size = positive_int("batch_size", batch_size)
    parts: list[list[np.ndarray]] = []
    for start in range(0, images.shape[0], batch_size):
        outputs = _evaluate_batch(model, images[start : start + batch_size])
        parts = parts or [[] for _ in outputs]
        for store, value in zip(parts, outputs, strict=True):
            store.append(np.asarray(value))
    columns = [np.concatenate(store) for store in parts]
    scores = {"accuracy": float(np.mean(columns[0] == np.asarray(labels)))}
    if isinstance(model, HAMClassifier):
        _, monotone, rises, drops, last = columns
        scores.update(
            non_increasing=float(np.mean(monotone)),
            max_energy_increase=float(np.max(rises)),
            mean_energy_drop=float(np.mean(drops)),
            mean_last_step=float(np.mean(last)),
        )
    return scores
