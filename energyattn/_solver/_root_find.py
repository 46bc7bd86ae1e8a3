r"""Roots $F(y^*, \theta) = 0$: the entry point `root_find` (by default with `Newton`)."""

from collections.abc import Callable
from typing import Any

from .._custom_types import State
from ._adjoint import AbstractAdjoint
from ._iterate import AbstractIterativeSolver, RootProblem
from ._newton import Newton
from ._solution import Solution, Y
from ._solve import DEFAULT_MAX_STEPS, compiled, solve_problem, split_aux


@compiled
def root_find(
    fn: Callable[[State, Any], State],
    y0: Y,
    args: Any = None,
    *,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    has_aux: bool = False,
) -> Solution[Y]:
    r"""Solve $F(y^*, \text{args}) = 0$, differentiably to any order.

    $$F(y^*) = 0,\qquad \dot y^* = -\left(\partial_y F\right)^{-1}\partial_{\text{args}}F\;
    \dot{\text{args}}$$

    By default [`Newton`][energyattn.Newton] with a line search on
    $\tfrac12\lVert F\rVert^2$, and implicit derivatives that reuse Newton's last LU factor.
    `y0` may be any pytree of floating-point arrays; `fn` returns the same structure.

    **Arguments:**

    - `fn`: the residual, `fn(y, args)`.
    - `y0`: the initial guess (gets no derivative, except through `UnrolledAdjoint`).
    - `args`: passed to `fn` unchanged.
    - `solver`: [`Newton`][energyattn.Newton] (default).
    - `adjoint`: [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] (default) or
      [`UnrolledAdjoint`][energyattn.UnrolledAdjoint].
    - `max_steps`: the most Newton steps (default 256).
    - `throw`: raise (at run time) unless the solve succeeded.
    - `has_aux`: `fn` returns `(output, aux)`; the solver sees the output, and
      `Solution.aux` is the aux at the solution.

    **Returns:**

    A [`Solution`][energyattn.Solution]: `value` the root, `residual` the rms size of the
    last Newton step, `num_steps` the Newton steps, `stats["value"]` the merit
    $\tfrac12\lVert F\rVert^2$ at the last iterate and `stats["backtracks"]` the step
    halvings.

    **Example:**

    ```python
    def cubic(y, theta):  # y^3 + theta y - 1 = 0, one real root for theta > 0
        return y**3 + theta * y - 1

    root = ea.root_find(cubic, jnp.ones(3), jnp.array([0.5, 1.0, 2.0])).value
    ```
    """
    fn, aux = split_aux(fn, has_aux, "ea.root_find")
    return solve_problem(
        RootProblem,
        fn,
        y0,
        args,
        solver=Newton() if solver is None else solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=throw,
        entry="ea.root_find",
        y0_name="y0",
        aux=aux,
    )
