"""Non-conservative dynamics: every token descends its own local energy."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import shape_str
from .._custom_types import Scalar
from .._sharding import like_rows


def local_forces(
    local_energy: Callable[..., Scalar], x: Float[ArrayLike, "*tokens"], *args: Any
) -> Float[Array, "*tokens"]:
    r"""The local forces $-\partial e_i/\partial x_i$ of all tokens, each from its own energy.

    $$F_i(x) = -\left.\frac{\partial e_i(x_i', \{x_j\})}{\partial x_i'}\right|_{x_i' = x_i},
      \qquad i = 1, \dots, N$$

    Token $i$ differentiates only its own energy $e_i$, and only with respect to itself: the
    other tokens are held fixed. Unlike $-\nabla_x \sum_i e_i$, this field is in general not
    the gradient of any energy (the dynamics is non-conservative, as self-attention is). The
    derivative is `jax.grad` of `local_energy` in its first argument, vmapped over the tokens;
    no update formula is written by hand.

    **Arguments:**

    - `local_energy`: `local_energy(x_i, x, i, *args) -> scalar`, the energy of token `i`
      whose own state is `x_i` (shape `token`) in the context of all tokens `x`. The context
      is a constant for this derivative, so `x[i]` must not stand in for `x_i`.
    - `x`: the tokens, shape `(N, *token)`.
    - `*args`: passed on to `local_energy` (not vmapped).

    **Returns:**

    The forces, an array of the shape and dtype of `x`.

    **Example:**

    ```python
    couplings = jr.normal(jr.key(0), (5, 5, 3, 3))  # J_ij, one (d, d) block per pair
    x = jr.normal(jr.key(1), (5, 3))                 # 5 tokens of dimension 3
    energy = ea.LocalAttentionEnergy(couplings)
    forces = ea.local_forces(energy.local, x)  # (5, 3): the attention update of every token
    ```
    """
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"x must have a leading token axis, got shape {shape_str(x.shape)}")

    def own_energy(x_i: Array, i: Array) -> Array:
        e_i = local_energy(x_i, x, i, *args)
        if jnp.shape(e_i) != ():
            raise ValueError(
                "local_energy must return a scalar (a 0-d array), got shape "
                f"{shape_str(jnp.shape(e_i))}"
            )
        return e_i

    grads = jax.vmap(jax.grad(own_energy))(x, like_rows(jnp.arange(x.shape[0]), x))
    return -grads.astype(x.dtype)
