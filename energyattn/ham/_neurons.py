"""A layer of neurons: a state, its activation (the gradient of a Lagrangian) and its energy."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import default_dtype, python_float, shape_str
from .._custom_types import Scalar
from .._energy import legendre_energy


class Neurons(eqx.Module):
    r"""A layer of neurons of an associative memory, defined by its Lagrangian.

    $$g = \nabla L(x), \qquad E_{\text{neurons}}(x) = g\cdot x - L(x),$$

    the state $x$ (the neurons' internal states, any shape), the activation $g$ (what the
    synapses see) and the layer's Legendre energy. A convex $L$ (a positive semi-definite
    Hessian) is what makes the graph's energy decrease along its dynamics; the library of
    [`ea.lagrangians`](../api/lagrangians.md) provides the usual ones.

    **Arguments:**

    - `lagrangian`: $L$, a function from a state of shape `shape` to a scalar, e.g.
      `ea.lagrangians.softmax` or `functools.partial(ea.lagrangians.tanh, beta=2.0)`
      (`equinox.Partial` makes array parameters learnable).
    - `shape`: the shape of the layer's state, e.g. `(10,)` or `(channels, height, width)`.
    - `tau`: the time constant $\tau > 0$ of the layer's dynamics
      $\tau\,\dot x = -\partial E/\partial g$ (default 1).
    - `legendre`: whether the layer's Legendre energy is a term of the graph's energy
      (default `True`, as in hierarchical associative memories: its $\partial/\partial g$ is
      the leak $x$, which keeps states bounded). With `False` only the synapses make the
      energy and the dynamics have no leak, as in the Energy Transformer, whose tokens sit
      behind a scale-invariant layer norm.

    ??? cite "Source"

        D. Krotov & J. Hopfield, *Large Associative Memory Problem in Neurobiology and
        Machine Learning* (ICLR 2021); D. Krotov, *Hierarchical Associative Memory* (2021);
        B. Hoover et al., HAMUX (github.com/bhoov/hamux).
    """

    lagrangian: Callable[[Array], Scalar]
    shape: tuple[int, ...] = eqx.field(static=True)
    tau: float = eqx.field(static=True)
    legendre: bool = eqx.field(static=True)

    def __init__(
        self,
        lagrangian: Callable[[Array], Scalar],
        shape: int | tuple[int, ...],
        *,
        tau: float = 1.0,
        legendre: bool = True,
    ):
        if not callable(lagrangian):
            raise ValueError(f"lagrangian must be callable, got {type(lagrangian).__name__}")
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        if not shape or any(not isinstance(n, int | np.integer) or n < 1 for n in shape):
            raise ValueError(f"shape must be a tuple of positive ints, got {shape!r}")
        self.lagrangian = lagrangian
        self.shape = tuple(int(n) for n in shape)
        self.tau = python_float("tau", tau)
        self.legendre = bool(legendre)

    def check(self, name: str, x: Any) -> None:
        """`ValueError` unless `x` has this layer's shape."""
        if tuple(np.shape(x)) != self.shape:
            raise ValueError(
                f"the state of layer {name!r} must have shape {self.shape}, got "
                f"{shape_str(np.shape(x))}"
            )

    def activation(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """$g = \\nabla L(x)$, by `jax.grad`."""
        return jax.grad(self.lagrangian)(x)

    def energy(self, x: Float[Array, "..."]) -> Scalar:
        """The Legendre energy $g\\cdot x - L(x)$."""
        return legendre_energy(self.lagrangian, x)

    def init_state(self, key: PRNGKeyArray | None = None, *, dtype: Any = None) -> Array:
        """Zeros, or with a `key` small normal noise (standard deviation 0.01)."""
        dtype = default_dtype(dtype)
        if key is None:
            return jnp.zeros(self.shape, dtype)
        return 0.01 * jr.normal(key, self.shape, dtype)
