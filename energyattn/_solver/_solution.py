"""What every solver returns: `Solution`, with a `RESULTS` code (tier 3 of errors)."""

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

#: The type of a solve's initial guess, which its solution's `value` has too (each solver
#: checks the guess itself: a pytree of floating-point arrays).
Y = TypeVar("Y")


class RESULTS(eqx.Enumeration):
    """Why a solver stopped. `RESULTS[code]` is the message (`successful`'s is its name).

    Solvers raise on anything but `successful` when `throw=True` (the default) and return
    the code in [`Solution.result`][energyattn.Solution] when `throw=False`.
    """

    successful = "successful"
    max_steps_reached = (
        "the solver did not converge within `max_steps` steps; raise `max_steps`, loosen the "
        "solver's tolerances (`rtol`, `atol`), or pass `throw=False` to inspect the last iterate"
    )
    nonfinite = "the iterate or its residual became non-finite (NaN or inf)"
    nonfinite_input = (
        "the initial guess or the arguments (args) hold NaN or inf, and the iterate became "
        "non-finite from them: check the inputs"
    )
    diverged = (
        "the iteration diverged: its residual grew far above the smallest one seen; the map is "
        "probably not a contraction (e.g. couplings with spectral radius above 1), so try "
        "ea.Anderson, damping, or smaller couplings"
    )
    infeasible = (
        "no feasible step: the iterate left the domain where the objective is defined (for "
        "example a matrix that should be positive definite is not) and backtracking could "
        "not bring it back"
    )
    unbounded = (
        "the energy decreased without bound (it reached -inf, or fell more than 1/eps times "
        "its starting size below the start): there is no minimum to find from this start"
    )
    indefinite = (
        "the solver stopped at a stationary point where the Hessian is not positive "
        "definite: a saddle point or a maximum, not a minimum"
    )
    increased = (
        "the returned point has a higher energy than the start: a fixed-point solver on the "
        "gradient map (ea.Picard / ea.Anderson) is not a descent method; use ea.LBFGS or "
        "ea.Newton, or a smaller step_size"
    )
    stalled = (
        "the line search found no point that decreases the objective along the step, far "
        "from convergence (round-off, or a non-smooth objective); loosen the tolerances"
    )
    gradient_mismatch = (
        "the solver stopped where the gradient is (nearly) zero, but the energy falls right "
        "next to the point: the gradient disagrees with the energy (it underflowed to zero on "
        "a saturating function, or the energy has a cliff); not a minimum. Rescale the "
        "energy or use float64"
    )
    not_stationary = (
        "the solver's steps became small, but a Newton step with the exact Hessian is not: "
        "the point is not a minimum (its quasi-Newton model was wrong, or the problem is "
        "badly scaled). Raise `max_steps`, use ea.Newton(), or rescale the unknowns"
    )
    no_root = (
        "the solver found no root (or fixed point): |F| stopped decreasing while F is not "
        "zero (a stationary point of |F|^2, or a singular Jacobian), or |F| fell only while "
        "the iterate ran off (F tends to zero at infinity, or the root is not isolated), or "
        "the residual did not fall below 0.9 of its first size in `max_steps` steps. There "
        "may be no solution near the start: try another start, check that one exists, or "
        "rescale F"
    )


class Solution(eqx.Module, Generic[Y]):
    """The result of a solver: a fixed point, root, minimum, saddle point or descent.

    **Attributes:**

    - `value`: the solution (same structure and type as the initial guess: a solve of
      `y0: jax.Array` is typed `Solution[jax.Array]`).
    - `result`: a [`RESULTS`][energyattn.RESULTS] code; `RESULTS.successful` when converged.
    - `num_steps`: the number of steps taken (an integer array; per example under `vmap`).
    - `residual`: the size of the last step or residual, in the solver's own stopping measure.
    - `stats`: solver-specific extras (a dict of arrays), possibly empty.
    - `energies`: for descent ([`descend`][energyattn.descend],
      [`sign_descend`][energyattn.sign_descend]) the energy before every step and after the
      last, shape `(num_steps + 1,)`; `None` for solvers that do not record it.
    - `trajectory`: the iterates stacked on a new leading axis, or `None` unless asked for
      (`return_trajectory=True`).
    - `aux`: with `has_aux=True`, the auxiliary output of `fn` at `value` (differentiable,
      through `value`'s implicit derivatives); `None` otherwise.
    """

    value: Y
    result: RESULTS
    num_steps: Int[Array, ""]
    residual: Float[Array, ""]
    stats: dict[str, Any] = eqx.field(default_factory=dict)
    if TYPE_CHECKING:
        # For a type checker, the documented idiom `sol.energies[-1] < sol.energies[0]` of a
        # descent (whose energies are always recorded) indexes an array, not an Optional.
        energies: Float[Array, " steps"] = eqx.field(default=None)
    else:
        energies: Float[Array, " steps"] | None = None
    trajectory: Y | None = None
    aux: Any = None

    @property
    def converged(self) -> Array:
        """A boolean array: `True` where the solver succeeded."""
        return self.result == RESULTS.successful


def finish(solution: Solution, throw: bool) -> Solution:
    """Raise (at run time, through `eqx.error_if`) unless `solution` succeeded, when `throw`.

    Returns the solution with its value routed through the check, and the value's
    derivatives too (`_checked`): a caller who only uses a derivative of the value
    (`jax.jit(jax.grad(f))`, `jax.jvp`) would otherwise let XLA drop the check, and a
    failed solve would train on without a word.
    """
    if not throw:
        return solution
    return eqx.tree_at(lambda s: s.value, solution, _checked(solution.value, solution.result))


@eqx.filter_custom_jvp
def _checked(value: Any, result: RESULTS) -> Any:
    """`value`, raising `result`'s message at run time unless it is `successful`."""
    return result.error_if(value, result != RESULTS.successful)


@_checked.def_jvp
def _checked_jvp(primals: tuple, tangents: tuple) -> tuple:
    value, result = primals
    t_value, _ = tangents
    out = _checked(value, result)
    if t_value is None:
        return out, None
    # The tangent is scaled by a checked 1: in forward mode the check runs with the tangent,
    # and in reverse mode that 1 is a residual of the forward pass, which the backward pass
    # needs, so the check runs there too: every derivative of a failed solve raises.
    one = result.error_if(jnp.ones(()), result != RESULTS.successful)
    return out, jax.tree.map(lambda t: t * one.astype(t.dtype), t_value)
