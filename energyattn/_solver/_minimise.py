r"""Minima $x^* = \arg\min_x E(x, \theta)$: the entry point `minimise` (L-BFGS by default, or
Newton), never uphill."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_positive
from .._custom_types import State
from ._adjoint import AbstractAdjoint
from ._fixed_point_solver import AbstractFixedPointSolver
from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    FixedPointProblem,
    MinimiseProblem,
    check_energy_output,
    check_initial,
    no_grad,
)
from ._lbfgs import LBFGS
from ._solution import RESULTS, Solution, Y
from ._solve import DEFAULT_MAX_STEPS, compiled, solve_problem, split_aux


@compiled
def minimise(
    energy: Callable[[State, Any], Float[Array, ""]],
    y0: Y,
    args: Any = None,
    *,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    step_size: float | None = None,
    throw: bool = True,
    has_aux: bool = False,
) -> Solution[Y]:
    r"""Minimise an energy, $x^* = \arg\min_x E(x, \text{args})$, differentiably to any order.

    By default with [`LBFGS`][energyattn.LBFGS]; [`Newton`][energyattn.Newton] uses the
    exact Hessian (shifted where it is not positive definite). Both step downhill only: the
    energy at the returned point is never above the start, and a minimiser that heads to
    $-\infty$ stops with `RESULTS.unbounded`.

    **Success means a minimum.** Where a solver converges, the point is certified once: no
    negative curvature (a few Lanczos steps on Hessian-vector products), no lower energy
    right next to it than its gradient allows (an underflowed gradient, a cliff), and for
    L-BFGS and Newton–Krylov a small Newton step on the exact Hessian. From a saddle or a
    maximum the solver walks on along the negative curvature, and from the other failures
    to the lower point or along the Newton step, to a minimum; only where no escape leads
    anywhere does it report `RESULTS.indefinite`, `RESULTS.unbounded`,
    `RESULTS.gradient_mismatch` or `RESULTS.not_stationary`. The implicit
    adjoint solves with the Hessian at $x^*$ (the implicit function theorem at
    $\nabla E = 0$), so a layer defined as a minimiser costs one solve to differentiate,
    however many steps the minimisation took.

    A fixed-point solver ([`Picard`][energyattn.Picard], [`Anderson`][energyattn.Anderson])
    instead iterates the gradient step $x \leftarrow x - \alpha\nabla E(x)$ (`step_size`
    $\alpha$, default 0.1). That finds *stationary points*, which may be maxima or saddles,
    and can step uphill; it is kept for the seeds' mean-field iterations. A result whose
    energy is above the start is then reported as `RESULTS.increased`.

    **Arguments:**

    - `energy`: `energy(x, args) -> scalar`, e.g. an
      [`AbstractEnergy`][energyattn.AbstractEnergy].
    - `y0`: the start, a floating-point array or pytree of arrays.
    - `args`: passed to the energy unchanged.
    - `solver`: [`LBFGS`][energyattn.LBFGS] (default), [`Newton`][energyattn.Newton], or a
      fixed-point solver on the gradient map.
    - `adjoint`, `throw`: as in [`fixed_point`][energyattn.fixed_point].
    - `max_steps`: the most iterations of the solver (default 256).
    - `step_size`: $\alpha > 0$, for fixed-point solvers only.
    - `has_aux`: `energy` returns `(energy, aux)`; `Solution.aux` is the aux at the
      minimum.

    **Returns:**

    A [`Solution`][energyattn.Solution] whose `stats["energy"]` is $E(x^*)$ (differentiable).

    **Example:**

    ```python
    def energy(x, a):  # a double well, tilted
        return jnp.sum((x**2 - 1) ** 2) + 0.1 * jnp.dot(a, x)

    a = jnp.array([1.0, -1.0, 0.5])
    solution = ea.minimise(energy, 0.05 * jnp.ones(3), a)  # a minimum, energy below the start
    curvature = jax.hessian(energy)(solution.value, a)     # positive definite there
    ```

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021) and *Attention as Energy Minimization*
        (2021): attention as the response of a system that settles into its energy minimum.
    """
    solver = LBFGS() if solver is None else solver
    y0 = check_initial(y0, "y0")
    energy, aux = split_aux(energy, has_aux, "ea.minimise")

    def check(solution: Solution) -> Solution:
        # Measured outside the solver, so it holds for every solver (and differentiates).
        value = energy(solution.value, args)
        start = no_grad(energy(y0, args))
        eps = jnp.finfo(value.dtype).eps
        slack = 16 * eps * (jnp.abs(start) + jnp.abs(value))
        uphill = (solution.result == RESULTS.successful) & ~(value <= start + slack)
        # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
        result = RESULTS.where(uphill, RESULTS.increased, solution.result)  # type: ignore[arg-type]
        stats = dict(solution.stats, energy=value)
        return eqx.tree_at(lambda s: (s.result, s.stats), solution, (result, stats))

    kind: type[AbstractProblem]
    if isinstance(solver, AbstractFixedPointSolver):
        alpha = check_positive("step_size", 0.1 if step_size is None else step_size)
        grad = jax.grad(energy)

        def gradient_step(x, args):
            g = grad(x, args)
            return jax.tree.map(lambda xi, gi: xi - alpha.astype(xi.dtype) * gi, x, g)

        kind, fn = FixedPointProblem, gradient_step
        check_energy_output(energy, y0, args)
    else:
        if step_size is not None:
            raise ValueError(
                "step_size applies to fixed-point solvers on the gradient map (ea.Picard, "
                f"ea.Anderson); {type(solver).__name__} chooses its steps by line search"
            )
        kind, fn = MinimiseProblem, energy
    return solve_problem(
        kind,
        fn,
        y0,
        args,
        solver=solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=throw,
        entry="ea.minimise",
        y0_name="y0",
        check=check,
        aux=aux,
    )
