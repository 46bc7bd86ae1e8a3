r"""Safeguarded (damped) Newton minimisation of a convex function on an open domain.

The function is given by two callables on a flat vector $x$ of length `n`:

- `value_fn(x) -> (f, scale, aux)`: the value, $f = +\infty$ outside the domain (NaN only for
  poisoned inputs), an upper bound `scale` on the magnitude of the terms summed into $f$ (the
  round-off in $f$ is about `eps * scale`), and any `aux` (e.g. a Cholesky factor) reused by
- `derivatives_fn(x, aux) -> (gradient, hessian)`.

Each step solves $\nabla^2 f\, d = -\nabla f$ through a Cholesky factor of the Hessian,
backtracks $x + \alpha d$ ($\alpha = 1, \frac12, \frac14, \dots$) until the trial point is in
the domain and satisfies Armijo's condition with a round-off slack,

$$f(x + \alpha d) \le f(x) - c\,\alpha\,\lambda^2 + 16\,\epsilon\,\mathrm{scale},$$

and stops on the Newton decrement $\lambda = \sqrt{\nabla f^\top (\nabla^2 f)^{-1} \nabla f}$
(affine invariant; $\lambda^2/2$ estimates $f(x) - f^*$). Everything runs in one
`lax.while_loop`, so under `vmap` every example stops on its own and finished examples are
left untouched by the others' iterations.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, Bool, Float

from .._custom_types import Scalar
from ._solution import RESULTS, Solution

ValueFn = Callable[[Float[Array, " n"]], tuple[Scalar, Scalar, Any]]
DerivativesFn = Callable[[Float[Array, " n"], Any], tuple[Float[Array, " n"], Float[Array, "n n"]]]


_START_DOUBLINGS = 6


def default_tol(dtype: Any, n: int) -> float:
    """A Newton-decrement tolerance a little above the round-off floor of the gradient.

    The decrement is computed from a gradient carrying at least `eps * sqrt(n)` of
    round-off (times the conditioning), so it cannot reliably go below that;
    `eps ** 0.85 * sqrt(n)` leaves a factor of about 250 (float64) or 10 (float32) for
    conditioning, and a stall rule in the solver stops cleanly if round-off is reached first
    (about 6e-14 sqrt(n) in float64, 1.5e-6 sqrt(n) in float32).
    """
    return float(np.finfo(dtype).eps ** 0.85 * np.sqrt(n))


def newton_direction(
    grad: Float[Array, " n"], hess: Float[Array, "n n"]
) -> tuple[Float[Array, " n"], Float[Array, ""]]:
    """The Newton step $d = -H^{-1} g$ (by Cholesky) and the squared decrement $-g^\\top d$.

    If the Hessian's factorisation fails (it cannot for a strictly convex function, but
    round-off can make a nearly singular Hessian look indefinite) the diagonally scaled
    gradient is used instead, which is still a descent direction.
    """
    n = grad.shape[0]
    factor = jnp.linalg.cholesky(hess)
    ok = jnp.all(jnp.isfinite(jnp.diagonal(factor)))
    factor = jnp.where(ok, factor, jnp.eye(n, dtype=factor.dtype))
    newton = -jsl.cho_solve((factor, True), grad)
    scaled = -grad / jnp.diagonal(hess)
    direction = jnp.where(ok, newton, scaled)
    return direction, -jnp.dot(grad, direction)


@jax.custom_jvp
def spd_solve(matrix: Float[Array, "n n"], rhs: Float[Array, " n"]) -> Float[Array, " n"]:
    """$M^{-1} b$ for a symmetric positive definite $M$, through its Cholesky factor.

    Its `custom_jvp`, $\\dot x = M^{-1}(\\dot b - \\dot M x)$, is stated with this same
    function, so derivatives of any order reuse a factorisation of $M$ rather than
    differentiate the factorisation algorithm.
    """
    factor = jnp.linalg.cholesky(matrix)
    return jsl.cho_solve((factor, True), rhs)


@spd_solve.defjvp
def _spd_solve_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    (matrix, rhs), (matrix_dot, rhs_dot) = primals, tangents
    x = spd_solve(matrix, rhs)
    return x, spd_solve(matrix, rhs_dot - matrix_dot @ x)


def _where(pred: Bool[Array, ""], a: Any, b: Any) -> Any:
    return jax.tree.map(lambda u, v: jnp.where(pred, u, v), a, b)


def safeguarded_newton(
    value_fn: ValueFn,
    derivatives_fn: DerivativesFn,
    x0: Float[Array, " n"],
    *,
    fallback: Float[Array, " n"] | None = None,
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
    armijo: float = 1e-4,
) -> Solution:
    """Minimise a convex function by damped Newton steps that never leave its domain.

    **Arguments:**

    - `value_fn`, `derivatives_fn`: the function, as in the module docstring.
    - `x0`: the start, shape `(n,)`.
    - `fallback`: optional point known to lie in the domain. If `x0` does not, Newton starts
      from the first of $x_0 + a(b - x_0)$, $a = 2^{-6}, 2^{-5}, \\dots, 1$ ($b$ =
      `fallback`) that does: close to `x0` when a small shift suffices, never worse than $b$.
      Without it an infeasible `x0` gives `RESULTS.infeasible` at once.
    - `tol`: stop when the Newton decrement $\\lambda \\le$ `tol` (default
      `default_tol`), or when $\\lambda \\le \\sqrt{\\text{tol}}$ has stopped shrinking
      (quadratic convergence has hit round-off).
    - `max_steps`: the most Newton steps (`RESULTS.max_steps_reached` beyond).
    - `max_backtracks`: the most halvings of the step in one line search.
    - `armijo`: the sufficient-decrease constant $c$.

    **Returns:**

    A [`Solution`][energyattn.Solution] (not yet checked: the caller decides whether to
    raise): `value` the last iterate, `residual` its Newton decrement ($+\\infty$ when no start
    is in the domain), `num_steps` the Newton steps taken (accepted), `stats` with `"value"`
    ($f$ there) and `"backtracks"` (halvings in total).
    A line search that cannot find a point in the domain gives `RESULTS.infeasible`; one
    that meets NaN gives `RESULTS.nonfinite`; one whose trial points are in the domain but
    never decrease $f$ enough (a round-off stall) gives `RESULTS.max_steps_reached`.
    """
    dtype = x0.dtype
    eps = float(np.finfo(dtype).eps)
    tol = default_tol(dtype, x0.shape[-1]) if tol is None else float(tol)
    stall_tol = float(np.sqrt(tol))
    where = RESULTS.where

    # The loop body is "line search, then derivatives at the new point": one trace of each
    # callable (compile time), one factorisation per trial point (run time). Its first pass
    # is the start: a "line search" that only asks for a point in the domain (f = +inf, so
    # Armijo holds for any finite value), trying x0 and then x0 + a (fallback - x0) for
    # a = 2^-6, 2^-5, ..., 1: small shifts first, the fallback itself last.
    if fallback is None:
        to_fallback, start_trials = jnp.zeros_like(x0), 0
    else:
        to_fallback, start_trials = fallback - x0, _START_DOUBLINGS + 1
    placeholder = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(value_fn, x0))
    inf = jnp.full((), jnp.inf, dtype)
    first_shift = float(2.0**-_START_DOUBLINGS)

    def line_search(x, f, scale, d, lam2, alpha, growth, limit):
        """Trial points x + alpha d, alpha <- alpha * growth (a = 0 is followed by 2^-6),
        until one is in the domain and decreases f enough, or `limit` more trials are spent."""

        def cond(carry):
            k, _, accept, *_ = carry
            return ~accept & (k <= limit)

        def body(carry):
            k, alpha, _, saw_nan, saw_feasible, _ = carry
            x_t = x + alpha * d
            f_t, scale_t, aux_t = value_fn(x_t)
            slack = 16 * eps * jnp.maximum(scale, scale_t)
            accept = jnp.isfinite(f_t) & (f_t <= f - armijo * alpha * lam2 + slack)
            return (
                k + 1,
                jnp.where(alpha == 0, first_shift, alpha * growth),
                accept,
                saw_nan | jnp.isnan(f_t),
                saw_feasible | jnp.isfinite(f_t),
                (x_t, f_t, scale_t, aux_t),
            )

        false = jnp.zeros((), bool)
        init = (jnp.zeros((), jnp.int32), alpha, false, false, false, (x, *placeholder))
        k, _, accept, saw_nan, saw_feasible, point = jax.lax.while_loop(cond, body, init)
        return accept, saw_nan, saw_feasible, k - 1, point

    def body(carry):
        x, f, scale, _ = carry["point"]
        started = carry["started"]
        accept, saw_nan, saw_feasible, k, point = line_search(
            x,
            f,
            scale,
            carry["d"],
            carry["lam2"],
            jnp.where(started, 1.0, 0.0).astype(dtype),
            jnp.where(started, 0.5, 2.0).astype(dtype),
            jnp.where(started, max_backtracks, start_trials),
        )
        point = _where(accept, point, carry["point"])
        grad, hess = derivatives_fn(point[0], point[3])
        d, lam2 = newton_direction(grad, hess)
        lam = jnp.sqrt(jnp.maximum(lam2, 0))
        lam = jnp.where(accept, lam, carry["lam"])
        steps = carry["steps"] + (accept & started).astype(jnp.int32)
        finite = jnp.isfinite(lam2)
        stalled = started & (lam <= stall_tol) & (lam > 0.5 * carry["lam"])
        converged = finite & ((lam <= tol) | stalled)
        failed_search = where(
            saw_nan,
            RESULTS.nonfinite,
            where(saw_feasible, RESULTS.max_steps_reached, RESULTS.infeasible),
        )
        result = where(
            ~accept,
            failed_search,
            where(
                ~finite,
                RESULTS.nonfinite,
                where(
                    ~converged & (steps >= max_steps),
                    RESULTS.max_steps_reached,
                    RESULTS.successful,
                ),
            ),
        )
        return dict(
            point=point,
            d=d,
            lam2=lam2,
            lam=lam,
            steps=steps,
            backtracks=carry["backtracks"] + jnp.where(started, k, 0),
            started=jnp.ones((), bool),
            result=result,
            running=(result == RESULTS.successful) & ~converged,
        )

    init = dict(
        point=(x0, inf, jnp.zeros((), dtype), placeholder[2]),
        d=to_fallback,
        lam2=jnp.zeros((), dtype),
        lam=inf,
        steps=jnp.zeros((), jnp.int32),
        backtracks=jnp.zeros((), jnp.int32),
        started=jnp.zeros((), bool),
        result=RESULTS.where(True, RESULTS.successful, RESULTS.successful),
        running=jnp.ones((), bool),
    )
    final = jax.lax.while_loop(lambda carry: carry["running"], body, init)
    x, f, _, _ = final["point"]
    return Solution(
        value=x,
        result=final["result"],
        num_steps=final["steps"],
        residual=final["lam"],
        stats={"value": f, "backtracks": final["backtracks"]},
    )
