r"""The line-search solvers' pass: a direction, searched along, then a convergence test.

`AbstractLineSearchSolver` composes three parts: the solver's **direction** (`propose`:
Newton's, L-BFGS's), the **search** along it (`backtrack`, `expand` in `_search.py`), and the
problem's **merit** (`_merit.py`: the energy for a minimisation, $\tfrac12\lVert F\rVert^2$
for a root), which reads the search and the step for its kind of problem. The pass stops
on the estimated error of the proposed step (the rule is `AbstractLineSearchSolver`'s), and
a converged minimisation is certified (`_certify.py`).
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._certify import certify, no_descent
from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    Flat,
    MinimiseProblem,
    rms,
    tree_where,
)
from ._merit import AbstractMerit, merit_of, residual_reached
from ._search import LineSearchState, Search, Trial, backtrack, placeholder
from ._solution import RESULTS


def small_step(state: LineSearchState, point: Trial, size: Array, tol: Array) -> Bool[Array, ""]:
    """Whether the step of rms `size` proposed at `point` (after `state`) is within `tol`, as
    an estimate of the error left."""
    # Quadratic (or superlinear) convergence that has hit round-off stops shrinking, and
    # its steps no longer lower the merit beyond round-off. (Small steps that grow while
    # the merit falls are Newton leaving the wall of a barrier, far from the solution:
    # spin.saddle_point started 0.01 from the edge of its domain had stopped there.)
    roundoff = jnp.sqrt(float(jnp.finfo(point.y.dtype).eps))
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
    return (error <= tol) | (state.started & floor)


def judge(
    merit: AbstractMerit,
    state: LineSearchState,
    search: Search,
    point: Trial,
    size: Array,
    solved: Bool[Array, ""],
    start_value: Array,
    tolerances: tuple[float, float],
    exact: bool,
) -> tuple[Bool[Array, ""], RESULTS]:
    """`(converged, result)` of a pass whose `search` from `state` ended at `point`, where
    the next step (of rms `size`) was proposed, `solved` if it solves its system."""
    rtol, atol = tolerances
    tol = atol + rtol * rms(point.y)
    small = small_step(state, point, size, tol)
    # Only a step that solves its system measures the distance to the solution (the merit
    # says what else does, and what a small step that does not marks).
    near, stuck = merit.converged(small, solved, point, start_value, tolerances, exact)
    finite = jnp.isfinite(size) & jnp.all(jnp.isfinite(point.y))
    # A failed search next to the solution is round-off, not failure.
    stalled_near = (state.size <= jnp.sqrt(tol)) & state.solved
    converged = finite & jnp.where(search.accepted, near, stalled_near)
    # Typed loosely: mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    where: Callable[[Any, Any, Any], RESULTS] = RESULTS.where
    result = where(
        merit.unbounded(point, start_value),
        RESULTS.unbounded,
        where(
            ~search.accepted & ~converged,
            merit.failed(search),
            where(
                ~finite,
                RESULTS.nonfinite,
                where(stuck & search.accepted, RESULTS.no_root, RESULTS.successful),
            ),
        ),
    )
    return converged, result


class AbstractLineSearchSolver(AbstractIterativeSolver):
    """A solver that proposes a direction at each iterate and takes it with `backtrack`.

    One pass: search along the current direction (the first pass only evaluates the start),
    then propose the next direction at the accepted point (`propose`, the solver's own) and
    test convergence on its size,

    $$\\operatorname{rms}(d_k)\\,\\max\\Big(1, \\frac{\\rho_k}{1 - \\rho_k}\\Big) \\le
      \\text{atol} + \\text{rtol}\\,\\operatorname{rms}(y_k),\\qquad
      \\rho_k = \\frac{\\operatorname{rms}(d_k)}{\\operatorname{rms}(d_{k-1})}$$

    (the estimated error left where the steps shrink linearly, as Newton's do at a multiple
    root; $\\rho_k \\ge 1$ never stops this way),

    or, when round-off stops the steps from shrinking, $\\operatorname{rms}(d_k) \\le
    \\sqrt{\\text{tol}}$ without having halved since the last pass. Minimisation is on the
    energy; roots and fixed points on the merit $\\tfrac12\\lVert F\\rVert^2$ (`merit_of`
    chooses the merit once per problem; it reads the search and the step for that kind of
    problem, so a pass is the same for all).
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
        return residual_reached(state.point, state.start_value, rtol, atol)

    def certify(
        self, problem: MinimiseProblem, args: Any, state: LineSearchState, unrolled: bool
    ) -> tuple[LineSearchState, Bool[Array, ""], RESULTS]:
        """See `_certify.certify`."""
        n = state.point.y.shape[0]
        tolerances = self.tolerances(state.point.y.dtype)
        return certify(
            problem,
            args,
            state,
            unrolled,
            tolerances=tolerances,
            exact=self.exact_step(n),
            forget=self.forget,
        )

    def no_descent(
        self, problem: MinimiseProblem, args: Any, state: LineSearchState
    ) -> tuple[LineSearchState, Bool[Array, ""]]:
        """See `_certify.no_descent`."""
        return no_descent(problem, args, state, tolerances=self.tolerances(state.point.y.dtype))

    def init(self, problem, y, args, start: Trial | None = None):
        """The state before the first pass; `start`: `y` already evaluated (the objective's
        `value` there), which the first pass then takes without evaluating it again."""
        value_fn = merit_of(problem, args).value
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
        tolerances = self.tolerances(y.dtype)
        merit = merit_of(problem, args)
        # Search along the direction proposed last pass (the first pass evaluates the start).
        search = backtrack(
            merit.value,
            state.point,
            state.direction,
            state.slope,
            max_backtracks=self.max_backtracks,
            armijo=self.armijo,
            unrolled=unrolled,
            skip=~state.started & state.evaluated,
        )
        point = tree_where(search.accepted, search.trial, state.point)
        point = merit.extend(state, search, point, unrolled)
        # Propose the next direction at the accepted point.
        direction, slope, memory, positive, solved = self.propose(
            problem, point, args, state, unrolled
        )
        start_value = jnp.where(state.started, state.start_value, point.f)
        direction, slope, solved = merit.settle(
            point, start_value, direction, slope, solved, tolerances
        )
        # Test convergence on the proposed step's size.
        size = rms(direction)
        exact = self.exact_step(y.shape[0])
        converged, result = judge(
            merit, state, search, point, size, solved, start_value, tolerances, exact
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
