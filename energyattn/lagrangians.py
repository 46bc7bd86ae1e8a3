r"""Lagrangians of neuron layers for associative memories, as `ea.lagrangians`.

In a (hierarchical) associative memory every layer of neurons has a state $x$ and a
*Lagrangian* $L(x)$, a scalar function whose gradient is the layer's activation,
$g = \nabla L(x)$. The neurons carry the Legendre transform of $L$ as their energy,

$$E(x) = g \cdot x - L(x), \qquad g = \nabla L(x),$$

which is [`ea.legendre_energy(lagrangian, x)`][energyattn.legendre_energy]. Every
Lagrangian here is convex (the layer norm's for $\gamma \ge 0$), so its Hessian
$\partial^2 L / \partial x^2 = \partial g / \partial x$ is positive semi-definite: along the
dynamics $\tau \dot x = -\partial E_\text{total}/\partial g$ the total energy changes by
$\dot E = -\tau\,\dot x^\top (\partial^2 L/\partial x^2)\,\dot x \le 0$, the Lyapunov
argument of associative memories. Each function below returns the Lagrangian summed over all
entries (or over all groups, for the normalising ones) as a 0-d array; its `jax.grad` is
exactly the activation, and its docstring gives the lower bound of the Legendre energy.

| function | parameters | activation $g = \nabla L(x)$ | lower bound of $E(x)$ |
|---|---|---|---|
| `identity` | | $x$ | $0$ |
| `relu` | | $\max(x, 0)$ | $0$ |
| `repu` | `n` | $\max(x, 0)^{n-1}$ | $0$ |
| `exp` | `beta` | $e^{\beta x}$ | $-N/\beta$ |
| `rexp` | `beta` | $e^{\beta x} - 1$ for $x > 0$, else $0$ | $0$ |
| `tanh` | `beta` | $\tanh(\beta x)$ | $0$ |
| `sigmoid` | `beta` | $\sigma(\beta x)$ | $-N \log 2/\beta$ |
| `softmax` | `beta, axis` | $e^{\beta x_i}/\sum_j e^{\beta x_j}$ | $-G \log n/\beta$ |
| `ghostmax` | `beta, axis` | $e^{\beta x_i}/(1 + \sum_j e^{\beta x_j})$ | $-G \log(n+1)/\beta$ |
| `spherical` | `axis` | $x/\lVert x \rVert_2$ | $0$ (identically) |
| `layer_norm` | `gamma, delta, eps, axis` | $\gamma \hat x + \delta$ | $-Gn\gamma\sqrt\epsilon$ |

$N$ is the number of entries of $x$, $n$ the size of `axis` and $G = N/n$ the number of
groups (tokens) along it; $\hat x = (x - \bar x)/\sqrt{\mathrm{var}(x) + \epsilon}$, with
$\gamma \ge 0$, is the normalised token. The parameters are keyword-only. Bind constants with
`functools.partial`; bind parameters you want to learn with `equinox.Partial`, whose
keyword arguments are leaves of the pytree, so `eqx.filter_grad` differentiates them:

```python
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import energyattn as ea

x = jnp.array([0.5, -1.0, 2.0])
g = jax.grad(ea.lagrangians.softmax)(x)  # the activation: softmax(x)
energy = ea.legendre_energy(ea.lagrangians.softmax, x)  # minus the entropy of g, >= -log 3

sharp = functools.partial(ea.lagrangians.softmax, beta=4.0)  # a constant
learnable = eqx.Partial(ea.lagrangians.softmax, beta=jnp.array(4.0))  # a parameter
dbeta = eqx.filter_grad(lambda lag: ea.legendre_energy(lag, x))(learnable).keywords["beta"]
```

??? cite "Source"

    D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and Machine
    Learning* (ICLR 2021): neurons with Lagrangians and their Legendre energies.
    B. Hoover et al., *Energy Transformer* (NeurIPS 2023), and B. Hoover et al., *HAMUX*
    (github.com/bhoov/hamux): the catalogue of Lagrangians for hierarchical associative
    memories.
"""

import math
import operator

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float

from ._checks import check_positive, keyword_arguments, positive_int, shape_str
from ._custom_types import Scalar, ScalarLike
from ._energy import layer_norm_lagrangian
from ._namespace import public_dir

__all__ = [
    "exp",
    "ghostmax",
    "identity",
    "layer_norm",
    "relu",
    "repu",
    "rexp",
    "sigmoid",
    "softmax",
    "spherical",
    "tanh",
]

_LOG2 = math.log(2.0)


def _float(x):
    """`x` as a floating-point array (integers become the default float)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    return x


def _beta(beta, x):
    """`beta > 0` (a `ValueError` naming it, or a runtime error when traced), in `x`'s dtype."""
    return check_positive("beta", beta).astype(x.dtype)


def _to_last(x, axis):
    """`x` with `axis` moved to the last position, or a `ValueError` naming the shapes."""
    if x.ndim == 0:
        raise ValueError("x must have at least one axis to normalise over, got shape ()")
    try:
        axis = operator.index(axis)
    except TypeError:
        raise ValueError(f"axis must be an integer, got {axis!r}") from None
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of bounds for x of shape {shape_str(x.shape)}")
    return jnp.moveaxis(x, axis, -1)


@jax.custom_jvp
def _log_cosh(y):
    # log cosh y = |y| + log(1 + e^{-2|y|}) - log 2: no overflow for any y.
    a = jnp.abs(y)
    return a + jnp.log1p(jnp.exp(-2 * a)) - _LOG2


@_log_cosh.defjvp
def _log_cosh_jvp(primals, tangents):
    # The derivative written out: exactly tanh, and a Hessian that is right at y = 0 too
    # (differentiating |y| there would give 0 instead of 1).
    (y,), (t,) = primals, tangents
    return _log_cosh(y), jnp.tanh(y) * t


@jax.custom_jvp
def _expm1_minus_identity(u):
    # e^u - 1 - u, whose derivative is e^u - 1.
    return jnp.expm1(u) - u


@_expm1_minus_identity.defjvp
def _expm1_minus_identity_jvp(primals, tangents):
    # The derivative as expm1, accurate for small u (autodiff would give (e^u - 1 + 1) - 1).
    (u,), (t,) = primals, tangents
    return _expm1_minus_identity(u), jnp.expm1(u) * t


def identity(x: Float[ArrayLike, "*shape"]) -> Scalar:
    r"""The Lagrangian of linear neurons, whose activation is the identity.

    $$L(x) = \tfrac12 \textstyle\sum_i x_i^2, \qquad \nabla L(x) = x$$

    The Legendre energy is $E(x) = \tfrac12 \sum_i x_i^2 \ge 0$, zero only at $x = 0$.

    **Arguments:**

    - `x`: the states (any shape).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux), the identity Lagrangian.
    """
    x = _float(x)
    return 0.5 * jnp.sum(jnp.square(x))


def relu(x: Float[ArrayLike, "*shape"]) -> Scalar:
    r"""The Lagrangian whose activation is the rectified linear unit.

    $$L(x) = \tfrac12 \textstyle\sum_i \max(x_i, 0)^2, \qquad \nabla L(x) = \max(x, 0)$$

    The Legendre energy is $E(x) = \tfrac12 \sum_i \max(x_i, 0)^2 \ge 0$, zero wherever
    $x \le 0$.

    **Arguments:**

    - `x`: the states (any shape).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux), the ReLU Lagrangian.
    """
    x = _float(x)
    return 0.5 * jnp.sum(jnp.square(jax.nn.relu(x)))


def repu(x: Float[ArrayLike, "*shape"], *, n: int = 3) -> Scalar:
    r"""The Lagrangian whose activation is the rectified polynomial $\max(x, 0)^{n-1}$.

    $$L(x) = \frac1n \textstyle\sum_i \max(x_i, 0)^n, \qquad \nabla L(x) = \max(x, 0)^{n-1}$$

    The rectified polynomial neurons of the dense associative memory. The Legendre energy is
    $E(x) = (1 - \tfrac1n) \sum_i \max(x_i, 0)^n \ge 0$, zero wherever $x \le 0$.

    **Arguments:**

    - `x`: the states (any shape).
    - `n`: the power of the Lagrangian, an integer $\ge 2$ ($n = 2$ is
      [`relu`][energyattn.lagrangians.relu]).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Dense Associative Memory for Pattern Recognition*
        (NeurIPS 2016), and *Large Associative Memory Problem in Neurobiology and Machine
        Learning* (ICLR 2021); B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    n = positive_int("n", n, minimum=2)
    x = _float(x)
    return jnp.sum(jax.nn.relu(x) ** n) / n


@keyword_arguments("ea.lagrangians.exp")
def exp(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0) -> Scalar:
    r"""The Lagrangian whose activation is the exponential $e^{\beta x}$.

    $$L(x) = \frac1\beta \textstyle\sum_i e^{\beta x_i}, \qquad \nabla L(x) = e^{\beta x}$$

    The Legendre energy is $E(x) = \frac1\beta \sum_i e^{\beta x_i} (\beta x_i - 1) \ge
    -N/\beta$ ($N$ the number of entries), attained at $x = 0$; it tends to $0$ as
    $x \to -\infty$. The values overflow (to `inf`) where $\beta x \gtrsim 88$ in float32
    ($\gtrsim 709$ in float64): that is the exponential itself, not the implementation.

    **Arguments:**

    - `x`: the states (any shape).
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and
        Machine Learning* (ICLR 2021); B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    x = _float(x)
    beta = _beta(beta, x)
    return jnp.sum(jnp.exp(beta * x)) / beta


@keyword_arguments("ea.lagrangians.rexp")
def rexp(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0) -> Scalar:
    r"""The Lagrangian whose activation is the rectified exponential $e^{\beta x} - 1$ ($x > 0$).

    $$L(x) = \frac1\beta \textstyle\sum_i \bigl(e^{\beta \max(x_i, 0)} - 1\bigr)
      - \sum_i \max(x_i, 0), \qquad
      \nabla L(x) = \begin{cases} e^{\beta x} - 1 & x > 0 \\ 0 & x \le 0 \end{cases}$$

    $L$ is zero for $x \le 0$ and convex (its derivative is continuous and non-decreasing).
    The Legendre energy is $E(x) = \frac1\beta \sum_{i: x_i > 0} \bigl[(\beta x_i - 1)
    e^{\beta x_i} + 1\bigr] \ge 0$, zero wherever $x \le 0$ and increasing in each $x_i > 0$.
    Like [`exp`][energyattn.lagrangians.exp], the values overflow where $\beta x \gtrsim 88$
    in float32.

    **Arguments:**

    - `x`: the states (any shape).
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux), the rectified exponential
        Lagrangian.
    """
    x = _float(x)
    beta = _beta(beta, x)
    return jnp.sum(_expm1_minus_identity(beta * jax.nn.relu(x))) / beta


@keyword_arguments("ea.lagrangians.tanh")
def tanh(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0) -> Scalar:
    r"""The Lagrangian whose activation is $\tanh(\beta x)$.

    $$L(x) = \frac1\beta \textstyle\sum_i \log\cosh(\beta x_i), \qquad
      \nabla L(x) = \tanh(\beta x)$$

    $\log\cosh y$ is computed as $|y| + \log(1 + e^{-2|y|}) - \log 2$, finite for every
    finite $y$. The Legendre energy is $E(x) = \frac1\beta \sum_i \bigl[\beta x_i
    \tanh(\beta x_i) - \log\cosh(\beta x_i)\bigr]$, with $0 \le E < N \log 2/\beta$ ($N$ the
    number of entries), zero only at $x = 0$.

    **Arguments:**

    - `x`: the states (any shape).
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and
        Machine Learning* (ICLR 2021); B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    x = _float(x)
    beta = _beta(beta, x)
    return jnp.sum(_log_cosh(beta * x)) / beta


@keyword_arguments("ea.lagrangians.sigmoid")
def sigmoid(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0) -> Scalar:
    r"""The Lagrangian whose activation is the logistic sigmoid $\sigma(\beta x)$.

    $$L(x) = \frac1\beta \textstyle\sum_i \log(1 + e^{\beta x_i}), \qquad
      \nabla L(x) = \sigma(\beta x) = \frac{1}{1 + e^{-\beta x}}$$

    The softplus is computed stably. The Legendre energy is minus the binary entropy of the
    activation over $\beta$, $E(x) = \frac1\beta \sum_i \bigl[g_i \log g_i + (1 - g_i)
    \log(1 - g_i)\bigr]$, so $-N \log 2/\beta \le E < 0$ ($N$ the number of entries), the
    minimum attained at $x = 0$.

    **Arguments:**

    - `x`: the states (any shape).
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and
        Machine Learning* (ICLR 2021); B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    x = _float(x)
    beta = _beta(beta, x)
    return jnp.sum(jax.nn.softplus(beta * x)) / beta


@keyword_arguments("ea.lagrangians.softmax")
def softmax(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0, axis: int = -1) -> Scalar:
    r"""The Lagrangian whose activation is the softmax of $\beta x$ along `axis`.

    $$L(x) = \frac1\beta \sum_\text{groups} \log \sum_i e^{\beta x_i}, \qquad
      \nabla L(x) = \mathrm{softmax}(\beta x)$$

    The sum over $i$ runs along `axis`; the groups are all the other entries. The Legendre
    energy is minus the entropy of the activation over $\beta$, $E(x) = \frac1\beta
    \sum_\text{groups} \sum_i g_i \log g_i$, so $-G \log n/\beta \le E \le 0$ ($n$ the size of
    `axis`, $G$ the number of groups), the minimum attained where $x$ is constant along
    `axis` (e.g. $x = 0$).

    **Arguments:**

    - `x`: the states, with at least one axis.
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).
    - `axis`: the axis the softmax normalises over.

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and
        Machine Learning* (ICLR 2021), the model B of the modern Hopfield network;
        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    x = _float(x)
    beta = _beta(beta, x)
    logits = beta * _to_last(x, axis)
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1)) / beta


@keyword_arguments("ea.lagrangians.ghostmax")
def ghostmax(x: Float[ArrayLike, "*shape"], *, beta: ScalarLike = 1.0, axis: int = -1) -> Scalar:
    r"""The Lagrangian of the softmax with an extra zero logit (a "ghost" neuron).

    $$L(x) = \frac1\beta \sum_\text{groups} \log \Bigl(1 + \sum_i e^{\beta x_i}\Bigr), \qquad
      \nabla L(x)_i = \frac{e^{\beta x_i}}{1 + \sum_j e^{\beta x_j}}$$

    The activations along `axis` sum to less than one: the rest goes to the implicit neuron
    whose logit is $0$, so a group can attend to nothing. The log-sum-exp includes that zero
    logit and is computed stably. The Legendre energy is minus the entropy of the $n + 1$
    probabilities (ghost included) over $\beta$, so $E(x) \ge -G \log(n + 1)/\beta$ ($n$ the
    size of `axis`, $G$ the number of groups), attained at $x = 0$.

    **Arguments:**

    - `x`: the states, with at least one axis.
    - `beta`: the inverse temperature $\beta > 0$ (a float or a 0-d array).
    - `axis`: the axis the ghostmax normalises over.

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        E. Miller, *Attention Is Off By One* (2023), the softmax with a zero logit;
        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux), its Lagrangian.
    """
    x = _float(x)
    beta = _beta(beta, x)
    logits = beta * _to_last(x, axis)
    ghost = jnp.zeros((*logits.shape[:-1], 1), logits.dtype)
    logits = jnp.concatenate([logits, ghost], axis=-1)
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1)) / beta


def spherical(x: Float[ArrayLike, "*shape"], *, axis: int = -1) -> Scalar:
    r"""The Lagrangian whose activation projects onto the unit sphere along `axis`.

    $$L(x) = \sum_\text{groups} \lVert x \rVert_2, \qquad \nabla L(x) = \frac{x}{\lVert x
      \rVert_2}$$

    At $x = 0$ the value is $0$ and the gradient is $0$ (not NaN). $L$ is positively
    homogeneous of degree one, so the Legendre energy is $E(x) = 0$ identically. The norm is
    computed after scaling by the largest $|x_i|$, so it does not overflow.

    **Arguments:**

    - `x`: the states, with at least one axis.
    - `axis`: the axis the norm is taken over.

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux), the spherical-norm Lagrangian;
        B. Hoover et al., *Energy Transformer* (NeurIPS 2023).
    """
    x = _to_last(_float(x), axis)
    # Scale by the largest entry (a constant for the derivatives, which do not depend on it).
    scale = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    scale = jnp.where(scale > 0, scale, 1)
    squares = jnp.sum(jnp.square(x / scale), axis=-1, keepdims=True)
    # The double `where`: sqrt is never differentiated at 0, so the gradient there is 0.
    nonzero = squares > 0
    norms = jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, squares, 1)), 0)
    return jnp.sum(scale * norms)


def layer_norm(
    x: Float[ArrayLike, "*shape"],
    *,
    gamma: ScalarLike = 1.0,
    delta: Float[ArrayLike, " dim"] | None = None,
    eps: ScalarLike = 1e-5,
    axis: int = -1,
) -> Scalar:
    r"""The Lagrangian whose activation is the layer norm along `axis` (a scalar gain).

    $$L(x) = \sum_\text{tokens} \Bigl[D\,\gamma\,\sqrt{\tfrac1D \textstyle\sum_i (x_i -
      \bar x)^2 + \epsilon} + \sum_i \delta_i x_i\Bigr], \qquad
      \nabla L(x) = \gamma\,\frac{x - \bar x}{\sqrt{\mathrm{var}(x) + \epsilon}} + \delta$$

    The tokens are the groups along `axis`, $D$ its size. This is
    [`ea.layer_norm_lagrangian`][energyattn.layer_norm_lagrangian] with `axis` moved last.
    $L$ is convex for $\gamma \ge 0$. The Legendre energy is $E(x) = -\gamma D \epsilon
    \sum_\text{tokens} (\mathrm{var}(x) + \epsilon)^{-1/2}$ ($\delta$ drops out), so for
    $\gamma \ge 0$, $-T \gamma D \sqrt\epsilon \le E \le 0$ ($T$ the number of tokens), the
    minimum attained where each token is constant along `axis`.

    **Arguments:**

    - `x`: the states, with at least one axis.
    - `gamma`: the scalar gain $\gamma$ (a float or a 0-d array).
    - `delta`: optional bias $\delta$, shape `(D,)`.
    - `eps`: $\epsilon > 0$, keeps the square root smooth.
    - `axis`: the axis the layer norm normalises over.

    **Returns:**

    $L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), the `EnergyLayerNorm`;
        B. Hoover et al., *HAMUX* (github.com/bhoov/hamux).
    """
    x = _to_last(_float(x), axis)
    return layer_norm_lagrangian(x, gamma, delta, eps=eps)


__dir__ = public_dir(__all__)
