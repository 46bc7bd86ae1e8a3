r"""Fixed points $z^* = f(z^*, \theta)$: the entry point `fixed_point` (Anderson by default,
Picard, or Newton on $f(z) - z$)."""

from collections.abc import Callable
from typing import Any

from .._custom_types import State
from ._adjoint import AbstractAdjoint
from ._anderson import Anderson
from ._fixed_point_solver import AbstractFixedPointSolver
from ._iterate import AbstractIterativeSolver, FixedPointProblem
from ._solution import Solution, Y
from ._solve import DEFAULT_MAX_STEPS, compiled, solve_problem, split_aux


@compiled
def fixed_point(
    fn: Callable[[State, Any], State],
    y0: Y,
    args: Any = None,
    *,
    solver: AbstractFixedPointSolver | AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    has_aux: bool = False,
) -> Solution[Y]:
    r"""Solve $y^* = f(y^*, \text{args})$, differentiably to any order.

    [`Anderson`][energyattn.Anderson] (default) and [`Picard`][energyattn.Picard] stop when
    the estimated error is within the tolerances,

    $$A_k\operatorname{rms}(f(y_k) - y_k) \le \text{atol} + \text{rtol}\cdot
    \operatorname{rms}(f(y_k)),$$

    the residual times $A_k \approx \lVert(I - \partial_y f)^{-1}\rVert$, estimated from
    successive iterates (for a contraction of rate $L$, $1/(1 - L)$; see
    [`AbstractFixedPointSolver`][energyattn.AbstractFixedPointSolver]), so a map that
    contracts slowly is not stopped by its small residual, and one too slow to certify
    within `max_steps` reports `RESULTS.max_steps_reached` (tolerances on the solver,
    `ea.Anderson(rtol=1e-8)`; by default $\epsilon^{0.6}$ of the dtype, 4.1e-10 in float64
    and 7.0e-5 in float32); [`Newton`][energyattn.Newton]
    solves $f(y) - y = 0$ with the Jacobian. Derivatives with respect to `args` and to any
    arrays `fn` closes over (e.g. the parameters of an Equinox module) follow the `adjoint`:
    by default the implicit function theorem, in forward and reverse mode and to any order.
    The result does not depend on `y0`, which gets no derivative (except through
    `UnrolledAdjoint`), so it may be computed from differentiated inputs.

    **Arguments:**

    - `fn`: the map, `fn(y, args)`, returning the structure and shapes of `y`.
    - `y0`: the initial iterate, a floating-point array or pytree of arrays.
    - `args`: passed to `fn` unchanged.
    - `solver`: [`Anderson`][energyattn.Anderson] (default), [`Picard`][energyattn.Picard]
      or [`Newton`][energyattn.Newton].
    - `adjoint`: [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] (default),
      [`UnrolledAdjoint`][energyattn.UnrolledAdjoint] or
      [`PhantomAdjoint`][energyattn.PhantomAdjoint].
    - `max_steps`: the most evaluations of `fn` (Newton: the most Newton steps); default
      256.
    - `throw`: raise (at run time) unless the solve succeeded; with `False` inspect
      `Solution.result`.
    - `has_aux`: `fn` returns `(output, aux)`; the solver iterates the output, and
      `Solution.aux` is the aux at the solution.

    **Returns:**

    A [`Solution`][energyattn.Solution]. For Anderson and Picard `value` is $f(y_b)$ at the
    iterate $y_b$ with the smallest residual, `residual` that residual (rms), `num_steps` the
    evaluations of `fn`. Non-convergence is `RESULTS.max_steps_reached`, a NaN/inf iterate
    `RESULTS.nonfinite`, a growing residual `RESULTS.diverged`.

    **Example:**

    ```python
    def fn(z, x):
        return jnp.tanh(0.5 * z + x)

    x = jnp.array([0.3, -1.0])
    z = ea.fixed_point(fn, jnp.zeros(2), x).value

    def loss(x):
        return jnp.sum(ea.fixed_point(fn, jnp.zeros(2), x).value ** 2)

    hessian = jax.jit(jax.hessian(loss))(x)  # compiled: one program, not op by op
    ```

    ??? cite "Source"

        S. Bai, J. Z. Kolter, V. Koltun, *Deep Equilibrium Models* (2019); M. Bal, *Deep
        Implicit Attention: A Mean-Field Theory Perspective on Attention Mechanisms* (2021).
    """
    fn, aux = split_aux(fn, has_aux, "ea.fixed_point")
    return solve_problem(
        FixedPointProblem,
        fn,
        y0,
        args,
        solver=Anderson() if solver is None else solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=throw,
        entry="ea.fixed_point",
        y0_name="y0",
        aux=aux,
    )
