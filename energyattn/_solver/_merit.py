r"""What a line-search solver searches on, and what its steps mean, per kind of problem.

A line-search solver is the same loop for every problem: search along the direction, propose
the next one, test convergence. What differs between a minimisation and a root (or fixed
point) is chosen once per problem, here, as a *merit*:

- **minima** of $E$ (`EnergyMerit`): the search decreases $E$ itself; a full step that fell
  as if $E$ had no curvature along it is tried longer (`expand`); a value $1/\epsilon$
  below the start's (or $-\infty$) is `unbounded`; a search that finds no lower point has
  `stalled`, and a small step converges only if it solves its Newton system.
- **roots** $F(y) = 0$ and fixed points ($F = f(y) - y$) (`ResidualMerit`): the search
  decreases $\tfrac12\lVert F\rVert^2$; an exact root, or a residual within the tolerances
  where the step is not finite, is the answer itself; a residual as small as the
  tolerances relative to the start's converges too,

  $$\operatorname{rms}(F(y_k)) \le \text{atol} + \text{rtol}\operatorname{rms}(F(y_0)),$$

  and a search that finds no lower point, or a small step that is not Newton's, finds no
  root (`no_root`).
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ._iterate import AbstractProblem, Flat, MinimiseProblem
from ._search import LineSearchState, Search, Trial, expand
from ._solution import RESULTS


def residual_reached(point: Trial, start_value: Array, rtol: float, atol: float) -> Array:
    r"""Whether a root search's residual is as small as the tolerances make it: the rms of
    F (from the merit $\tfrac12\lVert F\rVert^2$ at `point`) against the start's."""
    n = point.y.shape[0]
    return jnp.sqrt(2 * point.f / n) <= atol + rtol * jnp.sqrt(2 * start_value / n)


class AbstractMerit(abc.ABC):
    """The function a line-search solver searches on, for one problem and its `args`, and
    the problem kind's reading of the search and of the step (`merit_of` chooses it)."""

    #: The result of a search that found feasible points but none low enough.
    no_decrease: ClassVar[RESULTS]

    def __init__(self, problem: AbstractProblem, args: Any):
        self.problem = problem
        self.args = args

    @abc.abstractmethod
    def value(self, y: Flat) -> tuple[Float[Array, ""], Float[Array, ""], Any]:
        """`(f, scale, aux)` at `y`: the merit, a bound on the magnitude of the terms summed
        into it (its round-off is about `eps * scale`), and work to reuse (`Trial.aux`)."""

    def extend(self, state: LineSearchState, search: Search, point: Trial, unrolled: bool) -> Trial:
        """The point a pass goes on from, after `search` from `state` accepted `point` (or
        kept the old one). Default: `point`."""
        return point

    def settle(
        self,
        point: Trial,
        start_value: Array,
        direction: Flat,
        slope: Array,
        solved: Bool[Array, ""],
        tolerances: tuple[float, float],
    ) -> tuple[Flat, Array, Bool[Array, ""]]:
        """`(direction, slope, solved)` once the solver proposed them at `point`: zero where
        the point itself is the answer. Default: as proposed."""
        return direction, slope, solved

    @abc.abstractmethod
    def converged(
        self,
        small: Bool[Array, ""],
        solved: Bool[Array, ""],
        point: Trial,
        start_value: Array,
        tolerances: tuple[float, float],
        exact: bool,
    ) -> tuple[Bool[Array, ""], Bool[Array, ""]]:
        """`(near, stuck)` after a search that took a step: whether a `small` step measures
        a distance to the solution within the tolerances, and whether it marks a point the
        search cannot leave that is no solution."""

    def unbounded(self, point: Trial, start_value: Array) -> Bool[Array, ""]:
        """Whether the merit fell without bound. Default: never."""
        return jnp.zeros((), bool)

    def failed(self, search: Search) -> RESULTS:
        """The result of a search that accepted no point."""
        # Typed loosely: mypy reads eqx.Enumeration items as str (equinox types them for pyright).
        where: Callable[[Any, Any, Any], RESULTS] = RESULTS.where
        return where(
            search.saw_nan,
            RESULTS.nonfinite,
            where(search.saw_feasible, self.no_decrease, RESULTS.infeasible),
        )


class EnergyMerit(AbstractMerit):
    """Minimisation: the energy itself."""

    # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    no_decrease = RESULTS.stalled  # type: ignore[assignment]

    def value(self, y):
        return self.problem.objective.value(y, self.args)

    def extend(self, state, search, point, unrolled):
        # A full step that fell as if the energy had no curvature along it is tried
        # longer and longer: an energy unbounded below then reaches the unbounded test
        # (1/eps below the start) in one pass instead of creeping down to max_steps.
        return expand(
            self.value,
            state.point,
            point,
            state.direction,
            state.slope,
            unrolled=unrolled,
            first=search.accepted & (search.tries == 1) & state.started,
        )

    def converged(self, small, solved, point, start_value, tolerances, exact):
        # Only a step that solves its system measures the distance to the solution: a small
        # steepest-descent step or a Krylov step that fell short does not.
        return small & solved, jnp.zeros((), bool)

    def unbounded(self, point, start_value):
        eps = float(jnp.finfo(point.y.dtype).eps)
        return (point.f == -jnp.inf) | (point.f < start_value - (1 + jnp.abs(start_value)) / eps)


class ResidualMerit(AbstractMerit):
    r"""Roots and fixed points: $\tfrac12\lVert F\rVert^2$, with $F$ as the work to reuse."""

    # For a root, no decrease of |F|^2 along Newton's step means a Jacobian that does not
    # describe F there: a singular one, at a stationary point of |F|^2 that is no root.
    # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    no_decrease = RESULTS.no_root  # type: ignore[assignment]

    def value(self, y):
        residual = self.problem.residual(y, self.args)
        value = 0.5 * jnp.sum(jnp.square(residual))
        return value, value, residual

    def settle(self, point, start_value, direction, slope, solved, tolerances):
        # An exact root (F = 0 in every entry: nothing left to solve), or a residual
        # within the tolerances where the step is not finite (an infinite Jacobian, as
        # that of sign(y) sqrt|y| at its root): the point itself is the solution.
        rtol, atol = tolerances
        within = residual_reached(point, start_value, rtol, atol)
        at_root = jnp.all(point.aux == 0) | (within & ~jnp.all(jnp.isfinite(direction)))
        direction = jnp.where(at_root, 0, direction)
        slope = jnp.where(at_root, 0, slope)
        return direction, slope, solved | at_root

    def converged(self, small, solved, point, start_value, tolerances, exact):
        # Or the residual itself is as small as the tolerances make it, relative to the
        # start's (steepest descent reaches a non-isolated root, where J is singular).
        # An inexact (Krylov) step solves J d = -F only to a relative residual: a small
        # one may leave F's component along a small singular value of J unsolved, so it
        # converges on F's own residual, and while it is a Newton step it is no sign
        # of a stalled search either. A small step that is not Newton's (a singular
        # Jacobian's steepest descent) marks a stationary point of |F|^2 that is not a root.
        rtol, atol = tolerances
        reached = residual_reached(point, start_value, rtol, atol)
        near = small & (reached | (solved & exact))
        stuck = small & ~reached & ~solved
        return near, stuck


def merit_of(problem: AbstractProblem, args: Any) -> AbstractMerit:
    """The merit of `problem` (with `args`): the energy for a minimisation,
    $\\tfrac12\\lVert F\\rVert^2$ for a root or a fixed point."""
    if isinstance(problem, MinimiseProblem):
        return EnergyMerit(problem, args)
    return ResidualMerit(problem, args)
