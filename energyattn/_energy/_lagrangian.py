"""Lagrangians of activation functions and their Legendre energies.

In an associative memory each activation is the gradient of a convex Lagrangian,
$g = \\nabla L(x)$, and the neurons carry the Legendre energy $g\\cdot x - L(x)$. This is
what lets a non-linearity such as the layer norm sit inside an energy-based model.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_positive, check_values, shape_str
from .._custom_types import Scalar, ScalarLike
from .._dtypes import result_dtype


def layer_norm_lagrangian(
    x: Float[ArrayLike, "*seq dim"],
    gamma: ScalarLike = 1.0,
    delta: Float[ArrayLike, " dim"] | None = None,
    *,
    eps: ScalarLike = 1e-5,
) -> Scalar:
    r"""The Lagrangian whose gradient is the (energy) layer norm, summed over tokens.

    $$L(x) = D\,\gamma\,\sqrt{\tfrac1D \textstyle\sum_i (x_i - \bar x)^2 + \epsilon}
      \;+\; \sum_i \delta_i x_i$$

    Its gradient is the layer norm with a *scalar* gain, $\nabla L(x) = \gamma\,(x - \bar
    x)/\sqrt{\mathrm{var}(x) + \epsilon} + \delta$. $L$ is convex for $\gamma \ge 0$, which is
    what the Energy Transformer's Lyapunov argument needs (a per-dimension gain would make the
    layer norm a non-gradient map).

    **Arguments:**

    - `x`: one token `(dim,)` or tokens `(seq, dim)`; the Lagrangians of the tokens add.
    - `gamma`: the scalar gain $\gamma$.
    - `delta`: optional per-dimension bias $\delta$, shape `(dim,)`.
    - `eps`: $\epsilon > 0$, keeps the square root smooth.

    **Returns:**

    $\sum_{\text{tokens}} L(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), the tutorial's
        `EnergyLayerNorm`.
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must have shape (..., dim), got {tuple(x.shape)}")
    eps = check_positive("eps", eps)
    if np.ndim(gamma) != 0:
        raise ValueError(
            f"gamma must be a scalar (a float or a 0-d array), got shape "
            f"{shape_str(np.shape(gamma))}: a per-dimension gain makes the layer norm the "
            "gradient of no Lagrangian"
        )
    # L is convex (and the Energy Transformer's energy bounded) only for gamma >= 0.
    gamma = check_values("gamma", gamma, lambda g: g >= 0, ">= 0 (L is convex only then)")
    dim = x.shape[-1]
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    spread = jnp.sqrt(jnp.mean(jnp.square(centred), axis=-1) + eps.astype(x.dtype))
    value = dim * jnp.asarray(gamma, x.dtype) * jnp.sum(spread)
    if delta is not None:
        delta = jnp.asarray(delta)
        if delta.shape != (dim,):
            raise ValueError(f"delta must have shape (dim={dim},), got {tuple(delta.shape)}")
        dtype = result_dtype(x, delta)  # explicit, as strict dtype promotion wants
        value = value.astype(dtype) + jnp.sum(x.astype(dtype) * delta.astype(dtype))
    return value


def legendre_energy(lagrangian: Callable[[Array], Scalar], x: Float[ArrayLike, "..."]) -> Scalar:
    r"""The Legendre energy of neurons whose activation is the gradient of `lagrangian`.

    $$E(x) = g \cdot x - L(x), \qquad g = \nabla L(x)$$

    The activation is obtained with `jax.grad`, so any convex Lagrangian works. An infinite
    state whose activation is 0 (a masked neuron, e.g. a `-inf` logit of the softmax)
    contributes the limit of $g_i x_i$, 0, to the energy and to its gradient.

    **Arguments:**

    - `lagrangian`: $L$, a function from the states to a scalar.
    - `x`: the states (any shape).

    **Returns:**

    $E(x)$, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023): the layer norm's energy
        `(g * x).sum() - lagrangian(x)` in the tutorial.
    """
    x = jnp.asarray(x)
    value, g = jax.value_and_grad(lagrangian)(x)
    # A masked neuron (x = -inf, the usual masking value) has g = 0, and g * x is NaN where
    # its limit is 0 (g log g -> 0 for the softmax): take the limit, through a finite x so
    # that the gradient is not NaN either.
    limit = jnp.isinf(x) & (g == 0)
    return jnp.sum(g * jnp.where(limit, 0, x)) - value
