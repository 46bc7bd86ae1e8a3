"""Fixed-step gradient descent on an energy, in `jax.lax.scan`."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_finite, check_positive, positive_int, shape_str
from .._custom_types import Scalar, ScalarLike, State


class Descent(eqx.Module):
    """The result of [`descend`][energyattn.descend] or [`sign_descend`][energyattn.sign_descend].

    **Attributes:**

    - `value`: the final state $x_T$ (same structure as the initial state).
    - `energies`: the energy before every step and after the last, shape `(num_steps + 1,)`;
      `energies[0]` is the energy of the initial state.
    - `trajectory`: the states $x_0, \\dots, x_T$ stacked on a new leading axis of length
      `num_steps + 1`, or `None` unless `save_trajectory=True`.
    """

    value: State
    energies: Float[Array, " steps"]
    trajectory: State | None


def collect_history(
    history: Any, final_state: State, final_energy: Scalar, save_trajectory: bool
) -> tuple[Float[Array, " steps"], State | None]:
    """Energies (and states) of a scan's steps, with the final ones appended.

    `history` is what the scan emitted per step: the energies, or `(energies, states)`.
    """
    if save_trajectory:
        step_energies, states = history
        trajectory = jax.tree.map(lambda xs, x: jnp.concatenate([xs, x[None]]), states, final_state)
    else:
        step_energies, trajectory = history, None
    energies = jnp.concatenate([step_energies.astype(final_energy.dtype), final_energy[None]])
    return energies, trajectory


def check_state(x0: Any, name: str = "x0") -> State:
    x0 = jax.tree.map(jnp.asarray, x0)
    leaves = jax.tree.leaves(x0)
    if not leaves:
        raise ValueError(f"{name} must contain at least one array")
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"{name} must hold floating-point arrays, got dtype {leaf.dtype}")
    return x0


def check_energy_output(energy: Callable, g: Any, args: Any) -> None:
    """Raise `ValueError` unless `energy(g, args)` is a scalar (`g` may be shape structs)."""
    out = jax.eval_shape(energy, g, args)
    if isinstance(out, jax.ShapeDtypeStruct) and out.shape == ():
        return
    got = (
        shape_str(out.shape) if isinstance(out, jax.ShapeDtypeStruct) else f"a {type(out).__name__}"
    )
    raise ValueError(f"the energy must return a scalar (a 0-d array), got {got}")


def descend(
    energy: Callable[[State, Any], Scalar],
    x0: State,
    args: Any = None,
    *,
    step_size: ScalarLike,
    num_steps: int,
    activation: Callable[[State], State] | None = None,
    save_trajectory: bool = False,
    throw: bool = True,
) -> Descent:
    r"""Fixed-step gradient descent on an energy, unrolled in `jax.lax.scan`.

    $$x_{t+1} = x_t - \alpha\, \nabla_g E(g, \text{args})\big|_{g = g(x_t)}$$

    Without `activation`, $g(x) = x$ and this is plain gradient descent. With an activation
    (Energy Transformer dynamics, e.g. a layer norm $g = \nabla L(x)$) the state $x$ moves
    along the energy's gradient with respect to the activations. The force is always
    `jax.grad` of the energy, never a formula written beside it. One step of size 1 on
    [`hopfield_energy`][energyattn.hopfield_energy] is softmax attention.

    Works under `jit`, `vmap` and `grad`; gradients flow through the unrolled steps (so the
    step size and the energy's parameters can be trained).

    **Arguments:**

    - `energy`: any function `energy(g, args) -> scalar`, e.g. an
      [`AbstractEnergy`][energyattn.AbstractEnergy].
    - `x0`: the initial state, a floating-point array or pytree of arrays.
    - `args`: passed to the energy unchanged.
    - `step_size`: $\alpha > 0$.
    - `num_steps`: number of steps $T \ge 0$ (a Python int).
    - `activation`: optional $g(x)$, returning the same structure and shapes as `x`.
    - `save_trajectory`: also return every state.
    - `throw`: raise (at run time) if the initial state or any recorded energy is NaN/inf
      (default). With `throw=False` a diverging descent returns its non-finite values.

    **Returns:**

    A [`Descent`][energyattn.Descent]: the final state, the energy at every step
    (`num_steps + 1` values, measured at $g(x_t)$) and optionally the trajectory.

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021);
        B. Hoover et al., *Energy Transformer* (2023) for the activation form.
    """
    if not callable(energy):
        raise ValueError(f"energy must be callable, got {type(energy).__name__}")
    num_steps = positive_int("num_steps", num_steps, minimum=0)
    step_size = check_positive("step_size", step_size)
    x0 = check_state(x0)
    if throw:
        x0 = jax.tree.map(lambda leaf: check_finite("the initial state x0", leaf), x0)
    to_g = activation if activation is not None else (lambda x: x)

    g0_shape = jax.eval_shape(to_g, x0)
    x0_shape = jax.eval_shape(lambda x: x, x0)
    if jax.tree.structure(g0_shape) != jax.tree.structure(x0_shape) or any(
        a.shape != b.shape
        for a, b in zip(jax.tree.leaves(g0_shape), jax.tree.leaves(x0_shape), strict=True)
    ):
        raise ValueError(
            "activation(x) must return the same structure and shapes as x: "
            f"got {jax.tree.map(lambda s: s.shape, g0_shape)} for x of "
            f"{jax.tree.map(lambda s: s.shape, x0_shape)}"
        )
    check_energy_output(energy, g0_shape, args)

    energy_and_force = jax.value_and_grad(energy)

    def step(x, _):
        value, grad = energy_and_force(to_g(x), args)
        x_next = jax.tree.map(
            lambda xi, gi: xi - step_size.astype(xi.dtype) * gi.astype(xi.dtype), x, grad
        )
        return x_next, ((value, x) if save_trajectory else value)

    x_final, history = jax.lax.scan(step, x0, None, length=num_steps)
    energies, trajectory = collect_history(
        history, x_final, energy(to_g(x_final), args), save_trajectory
    )
    if throw:
        x_final, energies, trajectory = eqx.error_if(
            (x_final, energies, trajectory),
            ~jnp.all(jnp.isfinite(energies)),
            "descend: the energy became NaN or inf; the step size is probably too large "
            "(or the energy is unbounded below). Pass throw=False to inspect the trajectory.",
        )
    return Descent(value=x_final, energies=energies, trajectory=trajectory)
