r"""Minima $x^* = \arg\min_x E(x, \theta)$: L-BFGS (default) and Newton, never uphill."""

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import check_positive, positive_int, python_float
from .._custom_types import State
from ._adjoint import AbstractAdjoint
from ._fixed_point import AbstractFixedPointSolver
from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    FixedPointProblem,
    Flat,
    MinimiseProblem,
    check_energy_output,
    check_initial,
    no_grad,
)
from ._linesearch import AbstractLineSearchSolver
from ._solution import RESULTS, Solution, Y
from ._solve import DEFAULT_MAX_STEPS, compiled, solve_problem, split_aux


class _Pairs(NamedTuple):
    y: Flat  # the previous iterate and its gradient
    grad: Flat
    s: Float[Array, "m n"]  # steps y_{k+1} - y_k
    t: Float[Array, "m n"]  # gradient changes g_{k+1} - g_k
    rho: Float[Array, " m"]  # 1 / (s . t)
    gamma: Float[Array, ""]  # scale of the initial inverse Hessian
    accepted: Int[Array, ""]  # pairs accepted so far (`count` would shadow tuple.count)


class LBFGS(AbstractLineSearchSolver):
    r"""Limited-memory BFGS with a backtracking Armijo line search: the default minimiser.

    The direction is $d_k = -B_k^{-1}\nabla E(x_k)$ with the L-BFGS inverse-Hessian
    approximation from the last `history` pairs $(s_i, t_i) = (x_{i+1} - x_i,\
    \nabla E_{i+1} - \nabla E_i)$ (two-loop recursion; Nocedal & Wright, Algorithm 7.4),
    initial scale $\gamma = s^\top t / t^\top t$ of the newest pair, or
    $\min(1, 1/\lVert\nabla E\rVert)$ before the first. Pairs with $s^\top t \le 0$ (negative
    curvature seen along the step) are skipped, so $B_k$ stays positive definite and $d_k$
    is a descent direction; the line search then only accepts points that decrease $E$, so
    the energy never increases. Stops when $\operatorname{rms}(d_k) \le \text{atol} +
    \text{rtol}\operatorname{rms}(x_k)$ (the quasi-Newton estimate of the distance to the
    minimum) and the point passes [`minimise`][energyattn.minimise]'s certificate, whose
    Newton step on the exact Hessian must be as small (a quasi-Newton model can be wrong
    far from the minimum: then the pairs are dropped and the search goes on). Needs only
    gradients and, once per convergence, Hessian-vector products: $O(mn)$ memory.

    (optax's `scale_by_lbfgs` computes the same direction but keeps pairs of negative
    curvature and is meant for its zoom line search, a `while_loop` that reverse mode
    cannot unroll; this one shares the package's line search.)

    **Arguments:**

    - `rtol`, `atol`: tolerances (`None`: `eps ** 0.6` of the dtype).
    - `history`: the number of pairs kept, $m \ge 1$.
    - `max_backtracks`, `armijo`: as in [`Newton`][energyattn.Newton].

    ??? cite "Source"

        D. C. Liu and J. Nocedal, *On the limited memory BFGS method for large scale
        optimization* (1989); J. Nocedal and S. J. Wright, *Numerical Optimization* (2006).
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    history: int = eqx.field(default=10, static=True)
    max_backtracks: int = eqx.field(default=40, static=True)
    armijo: float = eqx.field(default=1e-4, static=True)
    kinds: ClassVar[tuple[type[AbstractProblem], ...]] = (MinimiseProblem,)

    def __check_init__(self):
        for name in ("rtol", "atol"):
            if getattr(self, name) is not None:
                python_float(name, getattr(self, name), allow_zero=True)
        positive_int("history", self.history)
        positive_int("max_backtracks", self.max_backtracks, minimum=0)
        if not 0 < python_float("armijo", self.armijo) < 1:
            raise ValueError(f"armijo must be in (0, 1), got {self.armijo!r}")

    def init_memory(self, problem, y, args):
        m, n = self.history, y.shape[0]
        zeros = jnp.zeros((m, n), y.dtype)
        one = jnp.ones((), y.dtype)
        return _Pairs(y, y, zeros, zeros, jnp.zeros(m, y.dtype), one, jnp.zeros((), jnp.int32))

    def propose(self, problem, point, args, state, unrolled):
        m = self.history
        grad = problem.objective.gradient(point.y, args, point.aux)
        pairs = state.memory
        s, t = point.y - pairs.y, grad - pairs.grad
        st = jnp.dot(s, t)
        eps = jnp.finfo(grad.dtype).eps
        good = state.started & (st > eps * jnp.linalg.norm(s) * jnp.linalg.norm(t))
        slot = pairs.accepted % m
        keep = lambda new, old: jnp.where(good, new, old)  # noqa: E731
        pairs = _Pairs(
            y=point.y,
            grad=grad,
            s=keep(pairs.s.at[slot].set(s), pairs.s),
            t=keep(pairs.t.at[slot].set(t), pairs.t),
            rho=keep(pairs.rho.at[slot].set(1 / jnp.where(good, st, 1)), pairs.rho),
            gamma=keep(st / jnp.where(good, jnp.dot(t, t), 1), pairs.gamma),
            accepted=pairs.accepted + good.astype(jnp.int32),
        )
        first = jnp.minimum(1, 1 / jnp.maximum(jnp.linalg.norm(grad), eps))
        gamma = jnp.where(pairs.accepted > 0, pairs.gamma, first)
        used = jnp.minimum(pairs.accepted, m)
        # Two-loop recursion over the pairs, newest first (slots form a ring): one gather
        # puts them in order, and each loop is a scan, so the program does not grow with m.
        order = (pairs.accepted - 1 - jnp.arange(m)) % m
        valid = jnp.arange(m) < used
        s_new, t_new, rho_new = pairs.s[order], pairs.t[order], pairs.rho[order]

        def newest_first(q, pair):
            s_i, t_i, rho_i, valid_i = pair
            a = jnp.where(valid_i, rho_i * jnp.dot(s_i, q), 0)
            return q - a * t_i, a

        q, alphas = jax.lax.scan(newest_first, grad, (s_new, t_new, rho_new, valid))

        def oldest_first(r, pair):
            s_i, t_i, rho_i, valid_i, a = pair
            b = rho_i * jnp.dot(t_i, r)
            return r + jnp.where(valid_i, a - b, 0) * s_i, None

        pair = (s_new, t_new, rho_new, valid, alphas)
        r, _ = jax.lax.scan(oldest_first, gamma * q, pair, reverse=True)
        direction = -r
        slope = jnp.dot(grad, direction)
        # Round-off can still spoil the direction: fall back to scaled steepest descent.
        descent = slope < 0
        direction = jnp.where(descent, direction, -gamma * grad)
        slope = jnp.where(descent, slope, -gamma * jnp.dot(grad, grad))
        true = jnp.ones((), bool)
        return direction, slope, pairs, true, true

    def forget(self, memory):
        # The pairs described the way to a point that was not a minimum: start afresh.
        return memory._replace(accepted=jnp.zeros_like(memory.accepted))

    def postprocess(self, problem, y, args, state, result):
        stats = {"value": state.point.f, "backtracks": state.backtracks}
        return y, state.size, stats, {}


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
