r"""The one line search: backtracking from a full step, never uphill, never out of the domain.

Trial points $y + \alpha d$, $\alpha = 1, \tfrac12, \tfrac14, \dots$, until one is in the
domain (a finite value) and satisfies Armijo's sufficient decrease with a round-off slack,

$$f(y + \alpha d) \le f(y) + c\,\alpha\,\nabla f^\top d + 16\,\epsilon\,\max(s, s_\alpha),$$

where $s$ bounds the magnitude of the terms summed into $f$ (so $\epsilon s$ is its
round-off). Newton (on the energy, or on $\tfrac12\lVert F\rVert^2$ for roots) and L-BFGS
share it.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    MinimiseProblem,
    bounded_while,
    no_grad,
    rms,
    tree_where,
)
from ._krylov import lanczos_curvature, probe_vector, truncated_cg
from ._solution import RESULTS

Flat = Float[Array, " n"]


class Trial(NamedTuple):
    """A point and what the objective said there: value, round-off scale, work to reuse."""

    y: Flat
    f: Float[Array, ""]
    scale: Float[Array, ""]
    aux: Any


class Search(NamedTuple):
    accepted: Bool[Array, ""]
    saw_nan: Bool[Array, ""]
    saw_feasible: Bool[Array, ""]
    tries: Int[Array, ""]
    trial: Trial


def placeholder(value_fn: Callable[[Flat], tuple], y: Flat) -> Trial:
    """Zeros shaped like a trial of `value_fn` at `y` (a loop carry needs its structure)."""
    shapes = jax.eval_shape(value_fn, y)
    f, scale, aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return Trial(jnp.zeros_like(y), f, scale, aux)


def backtrack(
    value_fn: Callable[[Flat], tuple[Float[Array, ""], Float[Array, ""], Any]],
    start: Trial,
    direction: Flat,
    slope: Float[Array, ""],
    *,
    max_backtracks: int,
    armijo: float,
    unrolled: bool,
    skip: Bool[Array, ""] | None = None,
) -> Search:
    """Search along `direction` from `start` (whose `f` may be $+\\infty$: then the first
    finite trial is accepted, which is how a solver evaluates its starting point).

    `slope` is the directional derivative $\\nabla f^\\top d < 0$. A value of $-\\infty$ is
    accepted (the caller reports an unbounded objective). Returns whether a trial was
    accepted, whether any trial was NaN or feasible, the number of trials, and the last one.
    With `skip` true, `start` is taken as it is (already evaluated) without any trial.
    """
    eps = float(jnp.finfo(start.y.dtype).eps)

    def cond(carry):
        k, _, accepted, *_ = carry
        return ~accepted & (k <= max_backtracks)

    def body(carry):
        k, alpha, _, saw_nan, saw_feasible, _ = carry
        y = start.y + alpha * direction
        f, scale, aux = value_fn(y)
        slack = 16 * eps * jnp.maximum(start.scale, scale)
        feasible = jnp.isfinite(f) | (f == -jnp.inf)
        accepted = feasible & (f <= start.f + armijo * alpha * slope + slack)
        return (
            k + 1,
            0.5 * alpha,
            accepted,
            saw_nan | jnp.isnan(f),
            saw_feasible | feasible,
            Trial(y, f, scale, aux),
        )

    false = jnp.zeros((), bool)
    one = jnp.ones((), start.y.dtype)
    first = placeholder(value_fn, start.y)
    if skip is None:
        skip = false
    else:
        # Only a finite start is taken as it is; anything else is evaluated (and fails) anew.
        skip = skip & jnp.isfinite(start.f)
        first = tree_where(skip, start, first)
    init = (jnp.zeros((), jnp.int32), one, skip, false, skip, first)
    k, _, accepted, saw_nan, saw_feasible, trial = bounded_while(
        cond, body, init, max_backtracks + 1, unrolled
    )
    return Search(accepted, saw_nan, saw_feasible, k, trial)


#: The most Hessian-vector products of the certificate's Newton step (`certify`).
CERTIFY_STEPS = 100

#: Up to this many unknowns, a line search that stalled probes the energy along every
#: coordinate too before it calls the point a minimum (`no_descent`); above, along two
#: directions.
KINK_COORDINATES = 32

#: The most doublings of an accepted full step (2^64: from any start, an energy unbounded
#: below along the direction falls 1/eps below it).
MAX_DOUBLINGS = 64


def expand(
    value_fn: Callable[[Flat], tuple[Float[Array, ""], Float[Array, ""], Any]],
    start: Trial,
    accepted: Trial,
    direction: Flat,
    slope: Float[Array, ""],
    *,
    unrolled: bool,
    first: Bool[Array, ""],
) -> Trial:
    """After the full step was accepted (`first`), try 2, 4, 8, ... times it while the
    objective keeps falling at least 0.9 times as fast as the slope predicts (no curvature
    yet); return the last such trial, or `accepted`. A convex model's Newton step falls at
    half the slope and is never expanded; a linear or concave direction is, until the
    objective reaches -inf or the unbounded test."""

    eps = float(jnp.finfo(start.y.dtype).eps)

    def nearly_linear(trial, alpha):
        # ... and a fall beyond round-off: next to a minimum, where the values differ by
        # round-off, noise must not look like a linear fall.
        slack = 16 * eps * jnp.maximum(start.scale, trial.scale)
        linear = trial.f <= start.f + 0.9 * alpha * slope
        return linear & (trial.f < start.f - slack) & ~jnp.isnan(trial.f)

    def cond(carry):
        k, _, _, going = carry
        return going & (k < MAX_DOUBLINGS)

    def body(carry):
        k, alpha, best, _ = carry
        alpha = 2 * alpha
        f, scale, aux = value_fn(start.y + alpha * direction)
        trial = Trial(start.y + alpha * direction, f, scale, aux)
        ok = nearly_linear(trial, alpha) & (f < best.f)
        best = tree_where(ok, trial, best)
        return k + 1, alpha, best, ok & (f > -jnp.inf)

    one = jnp.ones((), start.y.dtype)
    going = first & nearly_linear(accepted, one) & (accepted.f > -jnp.inf)
    init = (jnp.zeros((), jnp.int32), one, accepted, going)
    return bounded_while(cond, body, init, MAX_DOUBLINGS, unrolled)[2]


# --------------------------------------------------------------------------------------------
# Solvers that step along a direction with this line search: Newton and L-BFGS


class LineSearchState(NamedTuple):
    point: Trial  # the current iterate and its value
    direction: Flat  # the step proposed from it (zero before the first pass)
    slope: Float[Array, ""]  # the directional derivative along it
    size: Float[Array, ""]  # rms of the proposed step (the stopping measure)
    memory: Any  # the solver's own (L-BFGS pairs, Newton's factor and cache)
    started: Bool[Array, ""]
    evaluated: Bool[Array, ""]  # `point` was evaluated before the first pass (no search then)
    start_value: Float[Array, ""]  # f(y0), for the unbounded test
    positive: Bool[Array, ""]  # curvature positive at the current iterate (minimise)
    solved: Bool[Array, ""]  # the current direction solves its (Newton) system
    backtracks: Int[Array, ""]


def _residual_reached(point: Trial, start_value: Array, rtol: float, atol: float) -> Array:
    r"""Whether a root search's residual is as small as the tolerances make it: the rms of
    F (from the merit $\tfrac12\lVert F\rVert^2$ at `point`) against the start's."""
    n = point.y.shape[0]
    return jnp.sqrt(2 * point.f / n) <= atol + rtol * jnp.sqrt(2 * start_value / n)


class AbstractLineSearchSolver(AbstractIterativeSolver):
    """A solver that proposes a direction at each iterate and takes it with `backtrack`.

    One pass: search along the current direction (the first pass only evaluates the start),
    then propose the next direction at the accepted point and test convergence on its size,

    $$\\operatorname{rms}(d_k)\\,\\max\\Big(1, \\frac{\\rho_k}{1 - \\rho_k}\\Big) \\le
      \\text{atol} + \\text{rtol}\\,\\operatorname{rms}(y_k),\\qquad
      \\rho_k = \\frac{\\operatorname{rms}(d_k)}{\\operatorname{rms}(d_{k-1})}$$

    (the estimated error left where the steps shrink linearly, as Newton's do at a multiple
    root; $\\rho_k \\ge 1$ never stops this way),

    or, when round-off stops the steps from shrinking, $\\operatorname{rms}(d_k) \\le
    \\sqrt{\\text{tol}}$ without having halved since the last pass. Minimisation is on the
    energy; roots and fixed points on the merit $\\tfrac12\\lVert F\\rVert^2$.
    """

    max_backtracks: eqx.AbstractVar[int]
    armijo: eqx.AbstractVar[float]
    start_pass: ClassVar[bool] = True
    certifies: ClassVar[bool] = True

    @abc.abstractmethod
    def init_memory(self, problem: AbstractProblem, y: Flat, args: Any) -> Any:
        """The solver's memory before the first direction."""

    @abc.abstractmethod
    def propose(
        self,
        problem: AbstractProblem,
        point: Trial,
        args: Any,
        state: LineSearchState,
        unrolled: bool,
    ) -> tuple[Flat, Float[Array, ""], Any, Bool[Array, ""], Bool[Array, ""]]:
        """`(direction, slope, memory, positive, solved)` at the accepted `point`
        (`positive`: the curvature there is positive, for minimisation; `solved`: the
        direction solves its system to the solver's tolerance, so that its size may decide
        convergence: an inexact Newton step that fell short may not)."""

    def exact_step(self, n: int) -> bool:
        """Whether a direction that `propose` calls solved is the exact Newton step (so that
        its size bounds the distance to the solution). Default: no."""
        return False

    def forget(self, memory: Any) -> Any:
        """The memory after an escape from a point that was not a minimum (L-BFGS drops its
        pairs). Default: kept."""
        return memory

    def exhausted(self, problem, args, state):
        # |F| is as small as the tolerances make it, yet the steps did not shrink: the
        # iterate runs off while F tends to zero (exp(y) has no root), or the root is not
        # isolated. Either way more steps cannot help.
        rtol, atol = self.tolerances(state.point.y.dtype)
        return _residual_reached(state.point, state.start_value, rtol, atol)

    def certify(
        self, problem: MinimiseProblem, args: Any, state: LineSearchState, unrolled: bool
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
        path from the escape on).
        """
        original, state = state, no_grad(state)  # decided without derivatives
        point = state.point
        y, dtype, n = point.y, point.y.dtype, point.y.shape[0]
        eps = float(jnp.finfo(dtype).eps)
        rtol, atol = self.tolerances(dtype)
        tol = atol + rtol * rms(y)
        length = jnp.maximum(rms(y), 1)
        grad = problem.objective.gradient(y, args, point.aux)
        u = probe_vector(n, dtype)
        exact = self.exact_step(n)

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

        def known_positive(_):
            one, zeros = jnp.ones((), dtype), jnp.zeros_like(y)
            return one, one, zeros, zeros, jnp.ones((), bool)

        # Newton's dense Hessian was factorised at this point: positive definite is proved.
        skip = state.positive if exact else jnp.zeros((), bool)
        lowest, largest, v, d, stationary = jax.lax.cond(skip, known_positive, curvature, None)
        size = jnp.maximum(jnp.abs(lowest), jnp.abs(largest))
        negative = lowest < -(eps**0.5) * size

        value_fn = self.merit(problem, args)
        h = eps ** (1 / 3) * length
        # Both probes through one traced copy of the energy (a loop of two), not two.
        probes = jax.lax.map(lambda z: value_fn(z)[:2], jnp.stack([y + h * u, y - h * u]))
        (f_plus, f_minus), (s_plus, s_minus) = probes
        scales = jnp.stack([point.scale, s_plus, s_minus])
        slack = 16 * eps * jnp.max(jnp.where(jnp.isfinite(scales), scales, 0))
        floor = point.f - h * jnp.abs(jnp.dot(grad, u)) - slack
        plus, minus = f_plus < floor, f_minus < floor
        up = plus & (~minus | (f_plus <= f_minus))
        lower = jnp.where(up, f_plus, f_minus)
        falls = plus | minus

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
            memory=self.forget(original.memory),
            positive=jnp.zeros((), bool),
            solved=jnp.zeros((), bool),
        )
        return tree_where(minimum, original, escaped), minimum, verdict

    def no_descent(
        self, problem: MinimiseProblem, args: Any, state: LineSearchState
    ) -> tuple[LineSearchState, Bool[Array, ""]]:
        r"""Whether the point where the line search found no lower point is a minimum that
        the gradient does not show (a kink: JAX's derivative of $|x|$ at 0 is 1, not 0),
        by the energy itself: $E(x \pm h v) \ge E(x)$ (up to round-off) for $h$ the
        tolerance $\text{atol} + \text{rtol}\operatorname{rms}(x)$ and unit-rms
        directions $v$: the failed step's, the fixed pseudo-random probe's, and up to
        `KINK_COORDINATES` unknowns each coordinate's. Along each such line the minimum is
        then within $h$ of $x$ (for an energy convex along it), or the energy changes by no
        more than round-off there. Where it holds, the state's step is zero (the point
        itself is the answer)."""
        original, state = state, no_grad(state)  # decided without derivatives
        point = state.point
        y, dtype, n = point.y, point.y.dtype, point.y.shape[0]
        eps = float(jnp.finfo(dtype).eps)
        rtol, atol = self.tolerances(dtype)
        h = atol + rtol * rms(y)
        d = state.direction
        d_size = rms(d)
        usable = jnp.isfinite(d_size) & (d_size > 0)
        u = probe_vector(n, dtype)
        along = jnp.where(usable, d / jnp.where(usable, d_size, 1), u)
        directions = [along, u]
        if n <= KINK_COORDINATES:
            directions += list(n**0.5 * jnp.eye(n, dtype=dtype))
        v = jnp.stack(directions)
        value_fn = self.merit(problem, args)
        probes = jnp.concatenate([y + h * v, y - h * v])
        values, scales = jax.lax.map(lambda z: value_fn(z)[:2], probes)
        all_scales = jnp.concatenate([scales, point.scale[None]])
        slack = 16 * eps * jnp.max(jnp.where(jnp.isfinite(all_scales), all_scales, 0))
        minimum = (
            jnp.isfinite(point.f)
            & jnp.all(jnp.isfinite(y))
            & jnp.all(~jnp.isnan(values) & (values >= point.f - slack))
        )
        stopped = original._replace(
            direction=jnp.zeros_like(original.direction), size=jnp.zeros_like(original.size)
        )
        return tree_where(minimum, stopped, original), minimum

    def merit(self, problem: AbstractProblem, args: Any) -> Callable[[Flat], tuple]:
        if isinstance(problem, MinimiseProblem):
            return lambda y: problem.objective.value(y, args)

        def half_square(y):
            residual = problem.residual(y, args)
            value = 0.5 * jnp.sum(jnp.square(residual))
            return value, value, residual

        return half_square

    def init(self, problem, y, args, start: Trial | None = None):
        """The state before the first pass; `start`: `y` already evaluated (the objective's
        `value` there), which the first pass then takes without evaluating it again."""
        value_fn = self.merit(problem, args)
        zero = jnp.zeros((), y.dtype)
        inf = jnp.full((), jnp.inf, y.dtype)
        false = jnp.zeros((), bool)
        point = placeholder(value_fn, y)._replace(y=y, f=inf) if start is None else start
        return LineSearchState(
            point=point,
            direction=jnp.zeros_like(y),
            slope=zero,
            size=inf,
            memory=self.init_memory(problem, y, args),
            started=false,
            evaluated=jnp.asarray(start is not None),
            start_value=inf,
            positive=false,
            solved=false,
            backtracks=jnp.zeros((), jnp.int32),
        )

    def step(self, problem, y, args, state, unrolled):
        rtol, atol = self.tolerances(y.dtype)
        value_fn = self.merit(problem, args)
        search = backtrack(
            value_fn,
            state.point,
            state.direction,
            state.slope,
            max_backtracks=self.max_backtracks,
            armijo=self.armijo,
            unrolled=unrolled,
            skip=~state.started & state.evaluated,
        )
        point = tree_where(search.accepted, search.trial, state.point)
        if isinstance(problem, MinimiseProblem):
            # A full step that fell as if the energy had no curvature along it is tried
            # longer and longer: an energy unbounded below then reaches the unbounded test
            # (1/eps below the start) in one pass instead of creeping down to max_steps.
            point = expand(
                value_fn,
                state.point,
                point,
                state.direction,
                state.slope,
                unrolled=unrolled,
                first=search.accepted & (search.tries == 1) & state.started,
            )
        direction, slope, memory, positive, solved = self.propose(
            problem, point, args, state, unrolled
        )
        if not isinstance(problem, MinimiseProblem):
            # An exact root (F = 0 in every entry: nothing left to solve), or a residual
            # within the tolerances where the step is not finite (an infinite Jacobian, as
            # that of sign(y) sqrt|y| at its root): the point itself is the solution.
            start_f = jnp.where(state.started, state.start_value, point.f)
            within = _residual_reached(point, start_f, rtol, atol)
            at_root = jnp.all(point.aux == 0) | (within & ~jnp.all(jnp.isfinite(direction)))
            direction = jnp.where(at_root, 0, direction)
            slope = jnp.where(at_root, 0, slope)
            solved = solved | at_root
        size = rms(direction)
        tol = atol + rtol * rms(point.y)
        # Quadratic (or superlinear) convergence that has hit round-off stops shrinking, and
        # its steps no longer lower the merit beyond round-off. (Small steps that grow while
        # the merit falls are Newton leaving the wall of a barrier, far from the solution:
        # spin.saddle_point started 0.01 from the edge of its domain had stopped there.)
        roundoff = jnp.sqrt(float(jnp.finfo(y.dtype).eps))
        flat = state.point.f - point.f <= roundoff * jnp.maximum(state.point.scale, point.scale)
        floor = (size <= jnp.sqrt(tol)) & (size > 0.5 * state.size) & flat
        # A linearly converging iteration leaves an error of about rate / (1 - rate) times
        # its last step, not the step's size: Newton at a root of multiplicity p shrinks its
        # steps by the rate (p - 1) / p, so y**3 = 0 stopped on a step of 4e-5 with the
        # error twice that. The rate is estimated from the last two steps (0 before there
        # are two: quadratic convergence gives about 0 too).
        rate = jnp.where(state.started & (state.size > 0), size / state.size, 0)
        tail = jnp.where(rate < 1, rate / jnp.where(rate < 1, 1 - rate, 1), jnp.inf)
        error = jnp.where(size > 0, size * jnp.maximum(1, tail), 0)
        small = (error <= tol) | (state.started & floor)
        # Only a step that solves its system measures the distance to the solution: a small
        # steepest-descent step (a singular Jacobian) or a Krylov step that fell short does
        # not. For a root, a small step that is not Newton's marks a stationary point of
        # |F|^2 that is not a root.
        if isinstance(problem, MinimiseProblem):
            near, stuck = small & solved, jnp.zeros((), bool)
        else:
            # Or the residual itself is as small as the tolerances make it, relative to the
            # start's (steepest descent reaches a non-isolated root, where J is singular).
            # An inexact (Krylov) step solves J d = -F only to a relative residual: a small
            # one may leave F's component along a small singular value of J unsolved, so it
            # converges on F's own residual, and while it is a Newton step it is no sign
            # of a stalled search either.
            start_value = jnp.where(state.started, state.start_value, point.f)
            n = y.shape[0]
            reached = _residual_reached(point, start_value, rtol, atol)
            exact = self.exact_step(n)
            near = small & (reached | (solved & exact))
            stuck = small & ~reached & ~solved
        finite = jnp.isfinite(size) & jnp.all(jnp.isfinite(point.y))
        start_value = jnp.where(state.started, state.start_value, point.f)
        where = RESULTS.where
        if isinstance(problem, MinimiseProblem):
            eps = float(jnp.finfo(y.dtype).eps)
            unbounded = (point.f == -jnp.inf) | (
                point.f < start_value - (1 + jnp.abs(start_value)) / eps
            )
        else:
            unbounded = jnp.zeros((), bool)
        # A failed search next to the solution is round-off, not failure.
        stalled_near = (state.size <= jnp.sqrt(tol)) & state.solved
        # For a root, no decrease of |F|^2 along Newton's step means a Jacobian that does not
        # describe F there: a singular one, at a stationary point of |F|^2 that is no root.
        no_decrease = RESULTS.stalled if isinstance(problem, MinimiseProblem) else RESULTS.no_root
        failed = where(
            search.saw_nan,
            RESULTS.nonfinite,
            where(search.saw_feasible, no_decrease, RESULTS.infeasible),
        )
        converged = finite & jnp.where(search.accepted, near, stalled_near)
        result = where(
            unbounded,
            RESULTS.unbounded,
            where(
                ~search.accepted & ~converged,
                failed,
                where(
                    ~finite,
                    RESULTS.nonfinite,
                    where(stuck & search.accepted, RESULTS.no_root, RESULTS.successful),
                ),
            ),
        )
        took_step = state.started & search.accepted
        new_state = LineSearchState(
            point=point,
            direction=direction,
            slope=slope,
            size=size,
            memory=memory,
            started=jnp.ones((), bool),
            evaluated=state.evaluated,
            start_value=start_value,
            positive=positive,
            solved=solved,
            backtracks=state.backtracks + jnp.where(state.started, search.tries - 1, 0),
        )
        return point.y, new_state, took_step, converged, result
