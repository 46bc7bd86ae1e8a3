r"""Effective energies of restricted Boltzmann machines.

Integrating out the hidden units of an RBM with joint energy

$$E(v, h) = -\sum_i a_i(v_i) - \sum_\mu b_\mu(h_\mu) - \sum_{i\mu} W_{i\mu} v_i h_\mu$$

leaves an effective energy of the visible units written with the cumulant generating function
$K_\mu(t) = \log \mathbb{E}_{q_\mu}[e^{t h_\mu}]$ of each hidden unit's prior
$q_\mu(h) = e^{b_\mu(h)}$:

$$E(v) = -\sum_i a_i(v_i) - \sum_\mu K_\mu\Big(\sum_i W_{i\mu} v_i\Big).$$

The $n$-th cumulant of $q_\mu$ weights the $n$-th order interaction between visible units.
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_shape, check_values, positive_int
from .._custom_types import Scalar, ScalarLike
from ._base import AbstractEnergy

# --------------------------------------------------------------------------------------------
# Hidden-unit priors


class AbstractHiddenPrior(eqx.Module):
    r"""The prior $q(h) = e^{b(h)}$ of a hidden unit, known through its cumulant generating
    function $K(t) = \log \mathbb{E}_q[e^{th}] = \sum_n \kappa^{(n)} t^n / n!$.

    Both methods act elementwise; parameters may be arrays of shape `(hidden,)` (one prior per
    hidden unit) or scalars (shared).
    """

    @abc.abstractmethod
    def cumulant_generating_function(self, t: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        """$K(t) = \\log \\mathbb{E}_q[e^{th}]$, elementwise."""

    @abc.abstractmethod
    def log_prob(self, h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        """$b(h) = \\log q(h)$ (density for continuous priors, mass for discrete ones)."""


class GaussianPrior(AbstractHiddenPrior):
    r"""Gaussian hidden units, $h \sim \mathcal N(\mu, \sigma^2)$.

    $$K(t) = \mu t + \tfrac12 \sigma^2 t^2$$

    Only two cumulants are non-zero, so only linear and pairwise interactions appear: with
    $\mu=0$, $\sigma=1$ the effective energy is the classical Hopfield energy with couplings
    $W W^\top$.

    **Arguments:**

    - `mean`: $\mu$ (default 0).
    - `variance`: $\sigma^2 > 0$ (default 1).
    """

    mean: Float[Array, "*hidden"]
    variance: Float[Array, "*hidden"]

    def __init__(self, mean: ScalarLike | ArrayLike = 0.0, variance: ScalarLike | ArrayLike = 1.0):
        self.mean = jnp.asarray(mean, dtype=jnp.result_type(float))
        variance = jnp.asarray(variance, dtype=jnp.result_type(float))
        self.variance = check_values("variance", variance, lambda v: v > 0, "> 0")

    def cumulant_generating_function(self, t: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return self.mean * t + 0.5 * self.variance * t**2

    def log_prob(self, h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return -0.5 * (h - self.mean) ** 2 / self.variance - 0.5 * jnp.log(
            2 * jnp.pi * self.variance
        )


class PoissonPrior(AbstractHiddenPrior):
    r"""Poisson hidden units, $h \sim \mathrm{Pois}(\lambda)$, $h \in \{0, 1, 2, \dots\}$.

    $$K(t) = \lambda\,(e^{t} - 1)$$

    Every cumulant equals $\lambda$, so interactions of all orders appear; at $\lambda = 1$ the
    effective energy is, up to the constant $\sum_\mu \lambda$, the dense associative memory
    with exponential separation $-\sum_\mu \exp(\sum_i W_{i\mu} v_i)$.

    **Arguments:**

    - `rate`: $\lambda > 0$ (default 1).
    """

    rate: Float[Array, "*hidden"]

    def __init__(self, rate: ScalarLike | ArrayLike = 1.0):
        rate = jnp.asarray(rate, dtype=jnp.result_type(float))
        self.rate = check_values("rate", rate, lambda r: r > 0, "> 0")

    def cumulant_generating_function(self, t: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return self.rate * jnp.expm1(t)

    def log_prob(self, h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return h * jnp.log(self.rate) - self.rate - jax.scipy.special.gammaln(h + 1)


class BernoulliPrior(AbstractHiddenPrior):
    r"""Binary hidden units, $h \in \{0, 1\}$ with $P(h = 1) = p$.

    $$K(t) = \log\left(1 - p + p\, e^{t}\right)$$

    With $p = \sigma(c)$ this is $\mathrm{softplus}(t + c) - \mathrm{softplus}(c)$: the usual
    binary RBM's free energy with hidden biases $c$.

    **Arguments:**

    - `probability`: $p \in (0, 1)$ (default ½).
    """

    probability: Float[Array, "*hidden"]

    def __init__(self, probability: ScalarLike | ArrayLike = 0.5):
        p = jnp.asarray(probability, dtype=jnp.result_type(float))
        self.probability = check_values("probability", p, lambda p: (p > 0) & (p < 1), "in (0, 1)")

    def cumulant_generating_function(self, t: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        p = self.probability
        return jnp.logaddexp(jnp.log1p(-p), jnp.log(p) + t)

    def log_prob(self, h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        p = self.probability
        return h * jnp.log(p) + (1 - h) * jnp.log1p(-p)


class ConstantPrior(AbstractHiddenPrior):
    r"""A hidden unit frozen at a constant value $c$ (a point mass).

    $$K(t) = c\, t$$

    Its only non-zero cumulant is $\kappa^{(1)} = c$. An RBM with one such hidden unit
    ($c = 1$) and Gaussian visible units has the effective energy
    $E_\mu(v) = \frac12\lVert v\rVert^2 - W_\mu\cdot v$, and the log-sum-exp energy is the
    mixture of these (see [`MixtureEnergy`][energyattn.MixtureEnergy]).

    **Arguments:**

    - `value`: $c$ (default 1).
    """

    value: Float[Array, "*hidden"]

    def __init__(self, value: ScalarLike | ArrayLike = 1.0):
        self.value = jnp.asarray(value, dtype=jnp.result_type(float))

    def cumulant_generating_function(self, t: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return self.value * t

    def log_prob(self, h: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        # A point mass: log 1 at h = c, log 0 elsewhere.
        return jnp.where(h == self.value, 0.0, -jnp.inf)


def cumulant(prior: AbstractHiddenPrior, order: int) -> Float[Array, "*hidden"]:
    r"""The cumulant $\kappa^{(n)} = \partial_t^n K(t)\rvert_{t=0}$ of a hidden prior.

    Obtained by differentiating the cumulant generating function `order` times with JAX.

    **Arguments:**

    - `prior`: an [`AbstractHiddenPrior`][energyattn.AbstractHiddenPrior].
    - `order`: $n \ge 1$.
    """
    order = positive_int("order", order)

    def k(t):
        return prior.cumulant_generating_function(t)

    fn = k
    for _ in range(order):
        fn = _elementwise_derivative(fn)
    # Differentiate at t = 0 of the parameters' broadcast shape: per-unit parameters give
    # per-unit cumulants, and K keeps the shape of its argument.
    shape = jnp.broadcast_shapes(*(jnp.shape(leaf) for leaf in jax.tree.leaves(prior)))
    return fn(jnp.zeros(shape, jnp.result_type(float)))


def _elementwise_derivative(fn: Callable[[Array], Array]) -> Callable[[Array], Array]:
    def derivative(t: Array) -> Array:
        _, tangent = jax.jvp(fn, (t,), (jnp.ones_like(t),))
        return tangent

    return derivative


# --------------------------------------------------------------------------------------------
# Visible self-terms a_i(v_i)


class BinaryVisible(eqx.Module):
    r"""Linear self-term of binary (Bernoulli) visible units, $a_i(v_i) = a_i v_i$.

    **Arguments:**

    - `bias`: $a_i$, a scalar or shape `(dim,)` (default 0).
    """

    bias: Float[Array, "*dim"]

    def __init__(self, bias: ScalarLike | ArrayLike = 0.0):
        self.bias = jnp.asarray(bias, dtype=jnp.result_type(float))

    def __call__(self, v: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.bias * v


class GaussianVisible(eqx.Module):
    r"""Quadratic self-term of continuous (Gaussian) visible units,
    $a_i(v_i) = -\dfrac{v_i^2}{2\sigma_i^2}$.

    The seed writes the magnitude $v_i^2/2\sigma_i^2$; the sign here is the one that makes
    $e^{a_i(v_i)}$ a normalisable Gaussian weight (it gives the $+\frac12\lVert v\rVert^2$ of the
    log-sum-exp energy).

    **Arguments:**

    - `variance`: $\sigma_i^2 > 0$, scalar or shape `(dim,)` (default 1).
    """

    variance: Float[Array, "*dim"]

    def __init__(self, variance: ScalarLike | ArrayLike = 1.0):
        variance = jnp.asarray(variance, dtype=jnp.result_type(float))
        self.variance = check_values("variance", variance, lambda v: v > 0, "> 0")

    def __call__(self, v: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return -0.5 * v**2 / self.variance


# --------------------------------------------------------------------------------------------
# Energies


def _check_rbm(v: Any, weights: Any) -> None:
    check_shape("visible state", v, "dim")
    check_shape("weights", weights, "dim hidden", dim=jnp.shape(v)[0])


def rbm_effective_energy(
    v: Float[ArrayLike, " dim"],
    weights: Float[ArrayLike, "dim hidden"],
    visible: Callable[[Array], Array],
    prior: AbstractHiddenPrior,
) -> Scalar:
    r"""Effective energy of an RBM's visible units, hidden units integrated out.

    $$E(v) = -\sum_i a_i(v_i) - \sum_\mu K_\mu\Big(\sum_i W_{i\mu} v_i\Big)$$

    Exactly $-\log \int \mathrm{d}h\, e^{-E(v, h)}$ for the joint energy of
    [`rbm_joint_energy`][energyattn.rbm_joint_energy] with normalised priors.

    **Arguments:**

    - `v`: visible state, shape `(dim,)`.
    - `weights`: couplings $W$, shape `(dim, hidden)`.
    - `visible`: the self-term $a(v)$ (elementwise), e.g.
      [`BinaryVisible`][energyattn.BinaryVisible] or
      [`GaussianVisible`][energyattn.GaussianVisible].
    - `prior`: the hidden units' prior, an [`AbstractHiddenPrior`][energyattn.AbstractHiddenPrior].

    ??? cite "Source"

        M. Bal, *Transformer Attention as an Implicit Mixture of Effective Energy-Based Models*
        (2020), eq. "effectivenergy"; P. Mehta et al., *A high-bias, low-variance introduction to
        Machine Learning for physicists* (2019).
    """
    _check_rbm(v, weights)
    v = jnp.asarray(v)
    fields = v @ jnp.asarray(weights)
    return -jnp.sum(visible(v)) - jnp.sum(prior.cumulant_generating_function(fields))


def rbm_joint_energy(
    v: Float[ArrayLike, " dim"],
    h: Float[ArrayLike, " hidden"],
    weights: Float[ArrayLike, "dim hidden"],
    visible: Callable[[Array], Array],
    prior: AbstractHiddenPrior,
) -> Scalar:
    r"""Joint energy of an RBM with hidden prior $q_\mu(h) = e^{b_\mu(h)}$.

    $$E(v, h) = -\sum_i a_i(v_i) - \sum_\mu b_\mu(h_\mu) - \sum_{i\mu} W_{i\mu} v_i h_\mu$$

    **Arguments:**

    - `v`: visible state, shape `(dim,)`.
    - `h`: hidden state, shape `(hidden,)`.
    - `weights`, `visible`, `prior`: as in
      [`rbm_effective_energy`][energyattn.rbm_effective_energy].
    """
    _check_rbm(v, weights)
    check_shape("hidden state", h, "hidden", hidden=jnp.shape(weights)[1])
    v, h = jnp.asarray(v), jnp.asarray(h)
    return -jnp.sum(visible(v)) - jnp.sum(prior.log_prob(h)) - v @ jnp.asarray(weights) @ h


class RBMEffectiveEnergy(AbstractEnergy):
    r"""Module form of [`rbm_effective_energy`][energyattn.rbm_effective_energy].

    $$E(v) = -\sum_i a_i(v_i) - \sum_\mu K_\mu\Big(\sum_i W_{i\mu} v_i\Big)$$

    | hidden prior | $K(t)$ | effective energy |
    |---|---|---|
    | `GaussianPrior()` | $t^2/2$ | classical Hopfield, couplings $WW^\top$ |
    | `PoissonPrior(1)` | $e^t - 1$ | dense memory with $F = \exp$ (+ const.) |
    | `BernoulliPrior(σ(c))` | $\log(1-p+pe^t)$ | binary RBM free energy |
    | `ConstantPrior(1)` | $t$ | one component of the log-sum-exp mixture |

    **Arguments:**

    - `weights`: couplings $W$, shape `(dim, hidden)`.
    - `visible`: the visible self-term (default `GaussianVisible()`).
    - `prior`: the hidden prior (default `GaussianPrior()`).
    """

    weights: Float[Array, "dim hidden"]
    visible: Callable[[Array], Array]
    prior: AbstractHiddenPrior

    def __init__(
        self,
        weights: Float[ArrayLike, "dim hidden"],
        visible: Callable[[Array], Array] | None = None,
        prior: AbstractHiddenPrior | None = None,
    ):
        check_shape("weights", weights, "dim hidden")
        self.weights = jnp.asarray(weights)
        self.visible = visible if visible is not None else GaussianVisible()
        self.prior = prior if prior is not None else GaussianPrior()

    def __call__(self, x: Float[Array, " dim"], args: Any = None) -> Scalar:
        return rbm_effective_energy(x, self.weights, self.visible, self.prior)
