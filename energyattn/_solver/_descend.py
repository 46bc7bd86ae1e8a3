"""Fixed-step gradient descent on an energy, in `jax.lax.scan`.

Descent is not a solve: it runs a fixed number of steps and never tests convergence, so it
does not go through the package's solver loop (whose per-pass bookkeeping it would pay for
nothing); it returns the same [`Solution`][energyattn.Solution], with the energy of every
step in `Solution.energies`.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
from jax.flatten_util import ravel_pytree
from jax.tree_util import PyTreeDef
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._checks import (
    check_finite,
    check_positive,
    check_values,
    error_if,
    error_if_nonfinite,
    positive_int,
)
from .._custom_types import Scalar, ScalarLike, State
from .._dtypes import result_dtype
from ._iterate import check_energy_output, check_initial, rms
from ._solution import RESULTS, Solution, Y


def collect_history(
    history: Any, final_state: State, final_energy: Scalar, return_trajectory: bool
) -> tuple[Float[Array, " steps"], State | None]:
    """Energies (and states) of a scan's steps, with the final ones appended.

    `history` is what the scan emitted per step: the energies, or `(energies, states)`.
    """
    if return_trajectory:
        step_energies, states = history
        trajectory = jax.tree.map(lambda xs, x: jnp.concatenate([xs, x[None]]), states, final_state)
    else:
        step_energies, trajectory = history, None
    energies = jnp.concatenate([step_energies.astype(final_energy.dtype), final_energy[None]])
    return energies, trajectory


def descend(
    energy: Callable[..., Scalar],
    y0: Y,
    args: Any = None,
    *,
    step_size: ScalarLike | PyTree[ScalarLike],
    num_steps: int,
    activation: Callable[[State], State] | None = None,
    with_state: bool = False,
    return_trajectory: bool = False,
    throw: bool = True,
    noise_scale: ScalarLike | None = None,
    key: PRNGKeyArray | None = None,
) -> Solution[Y]:
    r"""Fixed-step gradient descent on an energy, unrolled in `jax.lax.scan`.

    $$x_{t+1} = x_t - \alpha\, \nabla_g E(g, \text{args})\big|_{g = g(x_t)}
      \;\big[+\, \sigma\, \xi_t,\quad \xi_t \sim \mathcal N(0, I)\big]$$

    Without `activation`, $g(x) = x$ and this is plain gradient descent. With an activation
    (Energy Transformer dynamics, e.g. a layer norm $g = \nabla L(x)$) the state $x$ moves
    along the energy's gradient with respect to the activations. The force is always
    `jax.grad` of the energy, never a formula written beside it. One step of size 1 on
    [`hopfield_energy`][energyattn.hopfield_energy] is softmax attention.

    With `with_state=True` the energy is a function $E(x, g)$ of the states and their
    activations, and the force is its partial derivative in $g$ at fixed $x$: the dynamics
    $\tau\,\dot x = -\partial E/\partial g$ of associative memories whose neurons carry the
    Legendre energy $g\cdot x - L(x)$ (whose $\partial/\partial g$ is the leak $x$); see
    [`ea.ham.HAM`][energyattn.ham.HAM]. A step size per leaf of the state (a pytree like
    `y0`) gives each part its own time constant, $\alpha_\ell = \Delta t/\tau_\ell$.

    With `noise_scale` $\sigma$ (and a `key`) every step adds Gaussian noise: Langevin
    dynamics, which samples $\propto e^{-E/T}$ at temperature $T = \sigma^2 / (2\alpha)$ for
    small steps (the noisy "thinking" of energy-based transformers). Step $t$ draws its noise
    with `jr.fold_in(key, t)`.

    Works under `jit`, `vmap`, `grad` and `jvp`; derivatives flow through the unrolled steps
    (so the step size, the noise scale and the energy's parameters can be trained).

    **Arguments:**

    - `energy`: any function `energy(g, args) -> scalar`, e.g. an
      [`AbstractEnergy`][energyattn.AbstractEnergy].
    - `y0`: the initial state, a floating-point array or pytree of arrays.
    - `args`: passed to the energy unchanged.
    - `step_size`: $\alpha > 0$, or a pytree with the structure of `y0` holding one
      $\alpha > 0$ per leaf.
    - `num_steps`: number of steps $T \ge 0$ (a Python int).
    - `activation`: optional $g(x)$, returning the same structure and shapes as `x`.
    - `with_state`: call the energy as `energy(x, g, args)` and descend its partial
      derivative in `g` (default `False`: `energy(g, args)`).
    - `return_trajectory`: also return every state (`Solution.trajectory`).
    - `throw`: raise (at run time) if the initial state or any recorded energy is NaN/inf
      (default). The message names the cause: a NaN/inf initial state; an energy already
      NaN/inf at the start, naming the first non-finite parameter of the energy or array in
      `args` (e.g. `energy.memory`); or a descent that diverged from a finite start (the
      step size). With `throw=False` a diverging descent returns its non-finite values and
      `RESULTS.nonfinite`.
    - `noise_scale`: optional $\sigma \ge 0$ of Langevin noise added after every step
      (default none: plain descent); needs `key`.
    - `key`: a JAX PRNG key for the noise (only with `noise_scale`).

    **Returns:**

    A [`Solution`][energyattn.Solution]: `value` the final state $x_T$, `energies` the energy
    at every step (`num_steps + 1` values, measured at $g(x_t)$), `num_steps` $T$,
    `residual` the rms size of the last step, and `trajectory` the states
    $x_0, \dots, x_T$ (stacked) when asked for.

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021);
        B. Hoover et al., *Energy Transformer* (2023) for the activation form; the noise is
        Langevin dynamics as in A. Gladstone et al., *Energy-Based Transformers are Scalable
        Learners and Thinkers* (2025).
    """
    if not callable(energy):
        raise ValueError(f"energy must be callable, got {type(energy).__name__}")
    num_steps = positive_int("num_steps", num_steps, minimum=0)
    y0 = check_initial(y0, "y0")
    step_size = _step_sizes(step_size, y0)
    if throw:
        y0 = jax.tree.map(lambda leaf: check_finite("the initial state y0", leaf), y0)
    if (noise_scale is None) != (key is None):
        raise ValueError(
            "Langevin noise needs both noise_scale and key (a JAX PRNG key), got "
            f"noise_scale={noise_scale!r} and key={'None' if key is None else 'a key'}"
        )
    if noise_scale is not None:
        noise_scale = check_values(
            "noise_scale", noise_scale, lambda s: (s >= 0) & (s < jnp.inf), "finite and >= 0"
        )
    to_g = activation if activation is not None else (lambda x: x)

    g0_shape = jax.eval_shape(to_g, y0)
    y0_shape = jax.eval_shape(lambda x: x, y0)
    # Annotated: jaxlib has no stubs, so mypy cannot compare the treedefs it returns.
    g0_structure: PyTreeDef = jax.tree.structure(g0_shape)
    if g0_structure != jax.tree.structure(y0_shape) or any(
        a.shape != b.shape
        for a, b in zip(jax.tree.leaves(g0_shape), jax.tree.leaves(y0_shape), strict=True)
    ):
        raise ValueError(
            "activation(x) must return the same structure and shapes as x: "
            f"got {jax.tree.map(lambda s: s.shape, g0_shape)} for x of "
            f"{jax.tree.map(lambda s: s.shape, y0_shape)}"
        )

    def energy_at(g, x):
        return energy(x, g, args) if with_state else energy(g, args)

    check_energy_output(lambda g, args: energy_at(g, y0), g0_shape, args)
    value_and_force = jax.value_and_grad(energy_at)

    def step(carry, t):
        x, _ = carry
        value, grad = value_and_force(to_g(x), x)
        update = jax.tree.map(_scaled, x, step_size, grad)
        if noise_scale is not None:
            noise = _normal_like(jr.fold_in(key, t), x)
            update = jax.tree.map(lambda u, n: u - _scaled(u, noise_scale, n), update, noise)
        x_next = jax.tree.map(lambda xi, ui: xi - ui, x, update)
        size = rms(ravel_pytree(update)[0])
        return (x_next, size), ((value, x) if return_trajectory else value)

    zero = jnp.zeros((), result_dtype(*jax.tree.leaves(y0)))
    (x_final, size), history = jax.lax.scan(step, (y0, zero), jnp.arange(num_steps))
    energies, trajectory = collect_history(
        history, x_final, energy_at(to_g(x_final), x_final), return_trajectory
    )
    finite = jnp.all(jnp.isfinite(energies))
    if throw:
        # Name the cause: a non-finite parameter or argument of the energy, or an energy
        # that is already NaN/inf at the (finite, checked) start, is not the step size's fault.
        start_ok = jnp.isfinite(energies[0])
        x_final, energies, trajectory = error_if(
            (x_final, energies, trajectory),
            ~finite & start_ok,
            "ea.descend: the descent diverged: the energy was finite at y0 and became NaN or "
            "inf during the descent; the step size is probably too large (lower step_size), "
            "or the energy is unbounded below. Pass throw=False to inspect "
            "Solution.energies.",
        )
        x_final, energies, trajectory = error_if_nonfinite(
            (x_final, energies, trajectory),
            ~start_ok,
            [("energy", energy), ("args", args)],
            "ea.descend: the energy is NaN or inf at the initial state, before any step: "
            "{} contains NaN or inf (not a step-size problem)",
            "ea.descend: the energy is NaN or inf at the initial state y0 (which is finite), "
            "before any step: y0 lies outside the energy's domain, or arrays the energy "
            "closes over contain NaN or inf (not a step-size problem)",
        )
    # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    result = RESULTS.where(finite, RESULTS.successful, RESULTS.nonfinite)  # type: ignore[arg-type]
    return Solution(
        value=x_final,
        result=result,
        num_steps=jnp.full((), num_steps, jnp.int32),
        residual=size,
        energies=energies,
        trajectory=trajectory,
    )


def _scaled(like: Array, a: Any, x: Array) -> Array:
    """`a * x` in `like`'s dtype, multiplied in their standard result dtype (explicit, so
    that strict dtype promotion accepts a float64 step size with a float32 state)."""
    dtype = result_dtype(a, x)
    return (jnp.asarray(a).astype(dtype) * x.astype(dtype)).astype(like.dtype)


def _normal_like(key: PRNGKeyArray, x: State) -> State:
    """Standard normal noise with the structure, shapes and dtypes of `x`."""
    leaves, treedef = jax.tree.flatten(x)
    keys = jr.split(key, len(leaves))
    noise = [
        jr.normal(k, jnp.shape(leaf), jnp.result_type(leaf))
        for k, leaf in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, noise)


def _step_sizes(step_size: Any, y0: State) -> State:
    """One positive step size per leaf of `y0`, from a scalar or a pytree like `y0`."""
    # Annotated: jaxlib has no stubs, so mypy cannot compare the treedefs it returns.
    structure: PyTreeDef = jax.tree.structure(step_size)
    if structure == jax.tree.structure(0.0):
        step_size = check_positive("step_size", step_size)
        return jax.tree.map(lambda _: step_size, y0)
    if structure != jax.tree.structure(y0):
        raise ValueError(
            "step_size must be a scalar or a pytree with the structure of y0 (one step size "
            f"per leaf), got {jax.tree.structure(step_size)} for y0 of "
            f"{jax.tree.structure(y0)}"
        )
    return jax.tree.map(lambda a: check_positive("step_size", a), step_size)
