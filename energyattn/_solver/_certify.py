r"""Whether the point where a line-search minimiser stopped is a minimum, and the way on if not.

A first-order stopping test (a small step, a search that found no lower point) cannot tell a
minimum from a saddle, a gradient that disagrees with the energy, or a quasi-Newton model
that is wrong far from the minimum. `certify` checks a converged point once, and where it is
not a minimum returns the direction that walks on from it; `no_descent` checks a point where
the search stalled against the energy itself (a kink, where the gradient JAX gives is a
nonzero subgradient). Both decide without derivatives, on the energy and its Hessian-vector
products:

$$\lambda_{\min}(\nabla^2 E) \ge -\sqrt\epsilon\,\lvert\lambda\rvert_{\max},\qquad
E(x \pm hu) \ge E(x) - h\lvert\nabla E^\top u\rvert,\qquad
\operatorname{rms}\big((\nabla^2 E)^{-1}\nabla E\big) \le \text{atol} +
\text{rtol}\operatorname{rms}(x).$$
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._iterate import Flat, MinimiseProblem, no_grad, rms, tree_where
from ._krylov import lanczos_curvature, probe_vector, truncated_cg
from ._merit import EnergyMerit
from ._search import LineSearchState, Trial
from ._solution import RESULTS

#: The most Hessian-vector products of the certificate's Newton step (`certify`).
CERTIFY_STEPS = 100

#: Up to this many unknowns, a line search that stalled probes the energy along every
#: coordinate too before it calls the point a minimum (`no_descent`); above, along two
#: directions.
KINK_COORDINATES = 32

Scalar = Float[Array, ""]


def _curvature(
    problem: MinimiseProblem,
    args: Any,
    y: Flat,
    grad: Flat,
    u: Flat,
    tol: Array,
    *,
    exact: bool,
    known_positive: Bool[Array, ""],
    unrolled: bool,
) -> tuple[Scalar, Scalar, Flat, Flat, Bool[Array, ""]]:
    """Checks 1 and 3 of `certify`, on Hessian-vector products: `(lowest, largest, v, d,
    stationary)`, the extreme Ritz values from `u`, the Ritz vector of the lowest, the
    certificate's Newton step and whether it is within `tol` (always, for an `exact`
    solver, whose own step was Newton's). Where `known_positive` (Newton's dense Hessian was
    factorised at this point: positive definite is proved) nothing is computed."""
    dtype = y.dtype
    eps = float(jnp.finfo(dtype).eps)

    def curvature(_):
        _, hvp = jax.linearize(lambda z: problem.objective.residual(z, args), y)
        lowest, largest, v = lanczos_curvature(hvp, u, unrolled)
        if exact:
            d, stationary = jnp.zeros_like(y), jnp.ones((), bool)
        else:
            # Not through custom_linear_solve: the step is not differentiated.
            d, (curved, met) = truncated_cg(hvp, -grad, eps**0.25, CERTIFY_STEPS, unrolled)
            stationary = curved & met & (rms(d) <= tol)
        return lowest, largest, v, d, stationary

    def positive(_):
        one, zeros = jnp.ones((), dtype), jnp.zeros_like(y)
        return one, one, zeros, zeros, jnp.ones((), bool)

    skip = known_positive if exact else jnp.zeros((), bool)
    return jax.lax.cond(skip, positive, curvature, None)


def _energy_along(
    value_fn: Callable[[Flat], tuple], point: Trial, directions: Float[Array, "k n"], h: Array
) -> tuple[Float[Array, "2 k"], Scalar]:
    r"""$E(x + hv)$ (first row) and $E(x - hv)$ (second row) for each row $v$ of
    `directions` (through one traced copy of the energy, a loop, not one copy per probe),
    and the round-off slack of comparing them with $E(x)$: $16\epsilon$ times the largest
    finite scale of the energies."""
    y = point.y
    eps = float(jnp.finfo(y.dtype).eps)
    probes = jnp.concatenate([y + h * directions, y - h * directions])
    values, scales = jax.lax.map(lambda z: value_fn(z)[:2], probes)
    scales = jnp.concatenate([scales, point.scale[None]])
    slack = 16 * eps * jnp.max(jnp.where(jnp.isfinite(scales), scales, 0))
    return values.reshape(2, -1), slack


def _energy_around(
    value_fn: Callable[[Flat], tuple], point: Trial, grad: Flat, u: Flat, h: Array
) -> tuple[Bool[Array, ""], Bool[Array, ""], Scalar]:
    r"""Check 2 of `certify`: `(falls, up, lower)`, whether $E(x + hu)$ or $E(x - hu)$ falls
    below $E(x) - h\lvert\nabla E^\top u\rvert$ beyond round-off, whether the lower of the two
    is at $+hu$, and its value."""
    values, slack = _energy_along(value_fn, point, u[None], h)
    f_plus, f_minus = values[:, 0]
    floor = point.f - h * jnp.abs(jnp.dot(grad, u)) - slack
    plus, minus = f_plus < floor, f_minus < floor
    up = plus & (~minus | (f_plus <= f_minus))
    lower = jnp.where(up, f_plus, f_minus)
    return plus | minus, up, lower


def certify(
    problem: MinimiseProblem,
    args: Any,
    state: LineSearchState,
    unrolled: bool,
    *,
    tolerances: tuple[float, float],
    exact: bool,
    forget: Callable[[Any], Any],
) -> tuple[LineSearchState, Bool[Array, ""], RESULTS]:
    r"""Whether the point where a minimisation converged is a minimum, and if not, the
    state that walks on from it: `(state, minimum, verdict)`, `verdict` naming what the
    point is. Three checks, each of which a first-order stopping test cannot make:

    1. **Curvature**: a few Lanczos steps on Hessian-vector products from a fixed
       pseudo-random vector $u$; a Ritz value below $-\sqrt\epsilon$ times the largest
       is a saddle or a maximum (`indefinite`). The escape is the Ritz vector $v$,
       signed downhill, of length $\sqrt n\max(1, \operatorname{rms}(x))$. (Newton's
       dense step skips it where its Cholesky factorisation proved $H$ positive
       definite.)
    2. **The energy around the point**: $E(x \pm hu)$ with $h = \epsilon^{1/3}
       \max(1, \operatorname{rms}(x))$. At a minimum neither falls below
       $E(x) - h\lvert\nabla E^\top u\rvert$ (beyond round-off); where one does, the
       gradient the solver trusted disagrees with the energy (a gradient that
       underflowed to zero on a saturating function, a cliff to $-\infty$:
       `gradient_mismatch`, or `unbounded`). The escape is that lower point.
    3. **The distance to the minimum** (solvers whose steps are not exact Newton steps:
       L-BFGS, Newton–Krylov): conjugate gradients on the exact Hessian,
       $H d = -\nabla E$, to the relative residual $\epsilon^{1/4}$, must give
       $\operatorname{rms}(d) \le \text{atol} + \text{rtol}\operatorname{rms}(x)$ (a
       quasi-Newton model can call a point far from the minimum converged). The
       escape is that Newton step (`not_stationary`).

    The escape is decided without derivatives (an unrolled solve differentiates the
    path from the escape on). From the solver: its `(rtol, atol)` for the dtype, whether
    its steps are `exact` Newton steps, and how it `forget`s its memory on an escape.
    """
    original, state = state, no_grad(state)  # decided without derivatives
    point = state.point
    y, dtype, n = point.y, point.y.dtype, point.y.shape[0]
    eps = float(jnp.finfo(dtype).eps)
    rtol, atol = tolerances
    tol = atol + rtol * rms(y)
    length = jnp.maximum(rms(y), 1)
    grad = problem.objective.gradient(y, args, point.aux)
    u = probe_vector(n, dtype)

    lowest, largest, v, d, stationary = _curvature(
        problem,
        args,
        y,
        grad,
        u,
        tol,
        exact=exact,
        known_positive=state.positive,
        unrolled=unrolled,
    )
    size = jnp.maximum(jnp.abs(lowest), jnp.abs(largest))
    negative = lowest < -(eps**0.5) * size

    h = eps ** (1 / 3) * length
    falls, up, lower = _energy_around(EnergyMerit(problem, args).value, point, grad, u, h)

    # The escapes, in order of priority.
    sign = jnp.where(jnp.dot(grad, v) > 0, -1, 1).astype(dtype)
    span = n**0.5 * length
    along_v = (sign * span * v, -span * jnp.abs(jnp.dot(grad, v)) + 0.5 * lowest * span**2)
    drop = jnp.where(jnp.isfinite(lower), lower - point.f, -(1 + jnp.abs(point.f)))
    along_u = (jnp.where(up, h, -h) * u, drop)
    newton_slope = jnp.dot(grad, d)
    descent = newton_slope < 0
    newton = (
        jnp.where(descent, d, -grad / jnp.maximum(largest, eps)),
        jnp.where(descent, newton_slope, -jnp.dot(grad, grad) / jnp.maximum(largest, eps)),
    )
    direction, slope = tree_where(negative, along_v, tree_where(falls, along_u, newton))
    # Typed loosely: mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    where: Callable[[Any, Any, Any], RESULTS] = RESULTS.where
    verdict = where(
        negative,
        RESULTS.indefinite,
        where(
            falls,
            where(lower == -jnp.inf, RESULTS.unbounded, RESULTS.gradient_mismatch),
            where(stationary, RESULTS.successful, RESULTS.not_stationary),
        ),
    )
    minimum = ~negative & ~falls & stationary
    inf = jnp.full((), jnp.inf, dtype)
    escaped = original._replace(
        direction=direction,
        slope=slope,
        size=inf,
        memory=forget(original.memory),
        positive=jnp.zeros((), bool),
        solved=jnp.zeros((), bool),
    )
    return tree_where(minimum, original, escaped), minimum, verdict


def no_descent(
    problem: MinimiseProblem,
    args: Any,
    state: LineSearchState,
    *,
    tolerances: tuple[float, float],
) -> tuple[LineSearchState, Bool[Array, ""]]:
    r"""Whether the point where the line search found no lower point is a minimum that
    the gradient does not show (a kink: JAX's derivative of $|x|$ at 0 is 1, not 0),
    by the energy itself: $E(x \pm h v) \ge E(x)$ (up to round-off) for $h$ the
    tolerance $\text{atol} + \text{rtol}\operatorname{rms}(x)$ and unit-rms
    directions $v$: the failed step's, the fixed pseudo-random probe's, and up to
    `KINK_COORDINATES` unknowns each coordinate's. Along each such line the minimum is
    then within $h$ of $x$ (for an energy convex along it), or the energy changes by no
    more than round-off there. Where it holds, the state's step is zero (the point
    itself is the answer). `tolerances`: the solver's `(rtol, atol)` for the dtype."""
    original, state = state, no_grad(state)  # decided without derivatives
    point = state.point
    y, dtype, n = point.y, point.y.dtype, point.y.shape[0]
    rtol, atol = tolerances
    h = atol + rtol * rms(y)
    d = state.direction
    d_size = rms(d)
    usable = jnp.isfinite(d_size) & (d_size > 0)
    u = probe_vector(n, dtype)
    along = jnp.where(usable, d / jnp.where(usable, d_size, 1), u)
    directions = jnp.stack([along, u])
    if n <= KINK_COORDINATES:  # one (n, n) block: not n rows sliced out and stacked again
        directions = jnp.concatenate([directions, n**0.5 * jnp.eye(n, dtype=dtype)])
    values, slack = _energy_along(EnergyMerit(problem, args).value, point, directions, h)
    minimum = (
        jnp.isfinite(point.f)
        & jnp.all(jnp.isfinite(y))
        & jnp.all(~jnp.isnan(values) & (values >= point.f - slack))
    )
    stopped = original._replace(
        direction=jnp.zeros_like(original.direction), size=jnp.zeros_like(original.size)
    )
    return tree_where(minimum, stopped, original), minimum
