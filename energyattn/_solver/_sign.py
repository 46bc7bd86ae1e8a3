"""Discrete (±1) dynamics of Hopfield networks, derived from the energy."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_shape, concrete_value, positive_int
from .._custom_types import Scalar
from ._descend import collect_history
from ._iterate import check_energy_output, ok_result
from ._solution import Solution


def _flip_choice(energy: Callable, s: Array, i: Array, args: Any) -> Array:
    """The better of s_i = +1 and s_i = -1 for the energy (ties keep the current value)."""
    e_plus, e_minus = jax.vmap(lambda v: energy(s.at[i].set(v), args))(
        jnp.array([1.0, -1.0], s.dtype)
    )
    return jnp.where(e_plus < e_minus, 1.0, jnp.where(e_minus < e_plus, -1.0, s[i])).astype(s.dtype)


def sign_descend(
    energy: Callable[[Float[Array, " dim"], Any], Scalar],
    y0: Float[Array, " dim"],
    args: Any = None,
    *,
    num_sweeps: int,
    synchronous: bool = False,
    key: PRNGKeyArray | None = None,
    return_trajectory: bool = False,
) -> Solution[Float[Array, " dim"]]:
    r"""Sign dynamics of a discrete Hopfield network on ±1 states.

    Each unit takes the sign that gives the lower energy, everything else fixed:

    $$s_i \leftarrow \mathrm{sgn}\big(E(s\,|\,s_i{=}{-1}) - E(s\,|\,s_i{=}{+1})\big)$$

    (a tie keeps $s_i$). The rule is read off the energy, so it applies to any energy: for
    the classical energy $-\frac12 s^\top W s + s^\top b$ with zero diagonal it is exactly
    $s \leftarrow \mathrm{sgn}(W s - b)$, and for dense associative memories it is the
    update of Krotov & Hopfield and Demircigil et al.

    - Asynchronous (default): units update one at a time, in order or in a random order per
      sweep when `key` is given. The energy never increases.
    - Synchronous: all units update at once from the same state. Faster, but it can fall
      into 2-cycles, and the energy is not guaranteed to decrease.

    **Arguments:**

    - `energy`: any `energy(s, args) -> scalar` of a state `s` of shape `(dim,)`.
    - `y0`: the initial ±1 state, shape `(dim,)`, floating point.
    - `args`: passed to the energy.
    - `num_sweeps`: number of sweeps (each updates every unit once), $\ge 0$.
    - `synchronous`: update all units at once.
    - `key`: optional PRNG key for a random unit order in each asynchronous sweep.
    - `return_trajectory`: also return the state after every sweep.

    **Returns:**

    A [`Solution`][energyattn.Solution]: the final state, `energies` (before each sweep and
    after the last), `num_steps` the sweeps, `residual` the fraction of units that flipped in
    the last sweep (0 at a fixed point of the dynamics), and optionally the states.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020),
        "Classical discrete Hopfield networks" and "Modern discrete Hopfield networks".
    """
    if not callable(energy):
        raise ValueError(f"energy must be callable, got {type(energy).__name__}")
    num_sweeps = positive_int("num_sweeps", num_sweeps, minimum=0)
    check_shape("y0", y0, "dim")
    y0 = jnp.asarray(y0)
    if not jnp.issubdtype(y0.dtype, jnp.floating):
        y0 = y0.astype(jnp.result_type(float))
    concrete = concrete_value(y0)
    if concrete is not None:
        bad = concrete[np.abs(concrete) != 1]
        if bad.size:
            raise ValueError(f"y0 must hold only -1 and +1, got {bad[:5].tolist()}")
    else:
        y0 = eqx.error_if(y0, ~jnp.all(jnp.abs(y0) == 1), "y0 must hold only -1 and +1")
    check_energy_output(energy, y0, args)
    if synchronous and key is not None:
        raise ValueError(
            "key sets the unit order of asynchronous sweeps; synchronous sweeps have none"
        )
    dim = y0.shape[0]
    indices = jnp.arange(dim)

    def sweep(carry, sweep_key):
        s, _ = carry
        if synchronous:
            s_next = jax.vmap(lambda i: _flip_choice(energy, s, i, args))(indices)
        else:
            order = indices if sweep_key is None else jr.permutation(sweep_key, dim)

            def unit(state, i):
                return state.at[i].set(_flip_choice(energy, state, i, args)), None

            s_next, _ = jax.lax.scan(unit, s, order)
        flipped = jnp.mean((s_next != s).astype(s.dtype))
        return (s_next, flipped), ((energy(s, args), s) if return_trajectory else energy(s, args))

    sweep_keys = None if key is None else jr.split(key, num_sweeps)
    zero = jnp.zeros((), y0.dtype)
    (s_final, flipped), history = jax.lax.scan(sweep, (y0, zero), sweep_keys, length=num_sweeps)
    energies, trajectory = collect_history(
        history, s_final, energy(s_final, args), return_trajectory
    )
    return Solution(
        value=s_final,
        result=ok_result(),
        num_steps=jnp.full((), num_sweeps, jnp.int32),
        residual=flipped,
        energies=energies,
        trajectory=trajectory,
    )
