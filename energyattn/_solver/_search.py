r"""The search of the line-search solvers: backtracking from a full step, never uphill, never
out of the domain.

Trial points $y + \alpha d$, $\alpha = 1, \tfrac12, \tfrac14, \dots$, until one is in the
domain (a finite value) and satisfies Armijo's sufficient decrease with a round-off slack,

$$f(y + \alpha d) \le f(y) + c\,\alpha\,\nabla f^\top d + 16\,\epsilon\,\max(s, s_\alpha),$$

where $s$ bounds the magnitude of the terms summed into $f$ (so $\epsilon s$ is its
round-off). Newton (on the energy, or on $\tfrac12\lVert F\rVert^2$ for roots) and L-BFGS
share it (`backtrack`); a minimisation whose full step fell as if the energy had no curvature
along it tries 2, 4, 8, ... times that step (`expand`). The function searched, $f$, is the
problem's merit (`_merit.py`); the direction $d$ is the solver's (`_linesearch.py`). Also
here: the state a line-search solver carries from pass to pass.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._iterate import Flat, bounded_while, tree_where


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
