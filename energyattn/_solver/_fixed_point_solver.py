r"""Fixed points $z^* = f(z^*, \theta)$: the loop, stopping rule and best iterate that Picard
and Anderson iteration share (`AbstractFixedPointSolver`).

Each pass evaluates the map once at the current iterate $z_k$ and measures the residual
$g_k = f(z_k) - z_k$. A small residual alone says little about the error on a map that
contracts slowly: with $f(z) = z - 10^{-3}(z - 1)$ the residual is a thousandth of the
error. So the solvers stop on an *estimate of the error*. Near $z^*$,
$g = (\partial_z f - I)(z - z^*)$, so

$$\lVert z_k - z^*\rVert \le \lVert(I - \partial_z f)^{-1}\rVert\,\lVert g_k\rVert,$$

and for a contraction of rate $L$, $\lVert(I - \partial_z f)^{-1}\rVert \le 1/(1 - L)$:
the error bound residual / (1 - rate). The amplification $\lVert(I -
\partial_z f)^{-1}\rVert$ is estimated from successive iterates by secants,
$a_k = \operatorname{rms}(z_k - z_{k-1}) / \operatorname{rms}(g_k - g_{k-1})$ (for
Picard, $z_k - z_{k-1} = g_{k-1}$, so $a_k = \lVert g_{k-1}\rVert / \lVert g_{k-1} -
g_k\rVert = 1/(1 - \rho_k)$ with $\rho_k$ the ratio of successive residuals), and the
largest of the last four estimates is taken, at least 1. The solver stops when

$$A_k\operatorname{rms}(g_k) \le \text{atol} + \text{rtol}\,\operatorname{rms}(f(z_k)),
\qquad A_k = \max(1, a_k, \dots, a_{k-3}),$$

with rms the root-mean-square over all entries of the state (so the tolerances do not
depend on its size). A secant whose difference of residuals is at round-off carries no
information and is skipped; until one estimate is known the solver does not stop, unless
the residual itself is at round-off (an exact fixed point, which no further step can
improve). A map that contracts too slowly to certify within `max_steps` ends with
`RESULTS.max_steps_reached`. Otherwise the solver proposes $z_{k+1}$. The iterate with the
smallest residual is remembered, and the answer is the map's value there,
$f(z_{\text{best}})$ (one application closer to the fixed point than $z_{\text{best}}$ for
a contraction, and already computed).
"""

import abc
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import python_float
from ._iterate import AbstractIterativeSolver, AbstractProblem, FixedPointProblem, Flat, rms
from ._solution import RESULTS


class _Best(NamedTuple):
    fz: Flat  # f at the iterate with the smallest residual
    residual: Float[Array, ""]
    first: Float[Array, ""]  # the residual at the start
    z: Flat  # the last iterate and its residual (for the secant estimates)
    g: Flat
    gains: Float[Array, " k"]  # recent secant estimates of |(I - df/dz)^-1|, newest first (0: none)


#: How many recent secant estimates of the amplification the stopping test takes the
#: largest of.
GAIN_WINDOW = 4


#: A search that used up `max_steps` without its residual falling below this fraction of the
#: first one made no progress: `RESULTS.no_root` (there may be no fixed point).
NO_PROGRESS = 0.9


class AbstractFixedPointSolver(AbstractIterativeSolver):
    r"""A rule proposing $z_{k+1}$ from $z_k$ and $f(z_k)$ (and its own memory).

    Subclasses implement `init_mixing(z)` (the memory of past iterates they keep, from the
    start $z_0$) and `mix(memory, z, fz)` (the next iterate and memory), on flat vectors,
    and carry `rtol`, `atol` and `divergence`. The loop, stopping rule and best-iterate
    bookkeeping are shared.

    The stopping rule bounds the error, not the residual: with $g_k = f(z_k) - z_k$,

    $$A_k\operatorname{rms}(g_k) \le \text{atol} + \text{rtol}\operatorname{rms}(f(z_k)),
    \qquad A_k = \max\Bigl(1, \max_{j \in \text{last }4}
    \frac{\operatorname{rms}(z_j - z_{j-1})}{\operatorname{rms}(g_j - g_{j-1})}\Bigr),$$

    secant estimates of $\lVert(I - \partial_z f)^{-1}\rVert$, which is $1/(1 - L)$ for
    a contraction of rate $L$ (for Picard the secant is $1/(1 - \rho)$, $\rho$ the ratio
    of successive residuals). Secants at round-off are skipped; until one is known only a
    residual at round-off (an exact fixed point) stops, so a solve takes at least two
    evaluations of the map unless its start is exact. A map that contracts too slowly to
    certify within `max_steps` reports `RESULTS.max_steps_reached`.
    """

    divergence: eqx.AbstractVar[float | None]
    kinds: ClassVar[tuple[type[AbstractProblem], ...]] = (FixedPointProblem,)

    def init_mixing(self, z: Flat) -> Any:
        """The memory before the first pass (none by default)."""
        return None

    @abc.abstractmethod
    def mix(self, memory: Any, z: Flat, fz: Flat) -> tuple[Flat, Any]:
        """`(z_next, memory)` from the iterate $z_k$ and the map's value $f(z_k)$ there."""

    def init(self, problem, y, args, start=None):
        inf = jnp.full((), jnp.inf, y.dtype)
        gains = jnp.zeros((GAIN_WINDOW,), y.dtype)
        return _Best(y, inf, inf, y, jnp.zeros_like(y), gains), self.init_mixing(y)

    def step(self, problem, y, args, state, unrolled):
        (best, memory) = state
        rtol, atol = self.tolerances(y.dtype)
        eps = float(jnp.finfo(y.dtype).eps)
        fz = problem.fn(y, args)
        g = fz - y
        res = rms(g)
        finite = jnp.isfinite(res)
        better = finite & (res < best.residual)
        diverged = jnp.zeros((), bool)
        if self.divergence is not None:
            diverged = finite & (res > self.divergence * best.residual)
        started = best.first < jnp.inf
        first = jnp.where(started, best.first, res)
        # The secant from the last iterate: g_k - g_{k-1} = (df/dz - I)(z_k - z_{k-1}), so
        # rms(dz) / rms(dg) estimates |(I - df/dz)^-1| (1 / (1 - rate) for a contraction)
        # along the step; a difference of residuals at round-off says nothing.
        dz, dg = rms(y - best.z), rms(g - best.g)
        size = rms(fz) + rms(y)
        informative = started & finite & (dg > 16 * eps * size) & (dz > 0)
        gain = dz / jnp.where(informative, dg, 1)
        gains = jnp.where(informative, jnp.concatenate([gain[None], best.gains[:-1]]), best.gains)
        best = _Best(
            jnp.where(better, fz, best.fz),
            jnp.where(better, res, best.residual),
            first,
            y,
            g,
            gains,
        )
        # The error estimate A rms(g) within the tolerance; with no estimate of A yet, only
        # a residual at round-off (an exact fixed point as computed) stops.
        amplification = jnp.maximum(1, jnp.max(gains))
        known = jnp.any(gains > 0)
        exact = res <= 4 * eps * rms(fz)
        converged = finite & (known | exact) & (amplification * res <= atol + rtol * rms(fz))
        where = RESULTS.where
        result = where(
            ~finite, RESULTS.nonfinite, where(diverged, RESULTS.diverged, RESULTS.successful)
        )
        z_next, memory = self.mix(memory, y, fz)
        return z_next, (best, memory), jnp.ones((), bool), converged, result

    def exhausted(self, problem, args, state):
        best, _ = state
        return best.residual > NO_PROGRESS * best.first

    def postprocess(self, problem, y, args, state, result):
        best, _ = state
        return best.fz, best.residual, {}, {}


def check_tolerances(solver: Any) -> None:
    for name in ("rtol", "atol"):
        if getattr(solver, name) is not None:
            python_float(name, getattr(solver, name), allow_zero=True)
    if solver.divergence is not None and python_float("divergence", solver.divergence) <= 1:
        raise ValueError(f"divergence must be > 1 (a growth factor), got {solver.divergence!r}")
