r"""Fixed points $z^* = f(z^*, \theta)$: Picard and Anderson iteration.

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
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import positive_int, python_float
from .._custom_types import State
from ._adjoint import AbstractAdjoint
from ._iterate import AbstractIterativeSolver, AbstractProblem, FixedPointProblem, Flat, rms
from ._solution import RESULTS, Solution, Y
from ._solve import DEFAULT_MAX_STEPS, compiled, solve_problem, split_aux


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


def _check_tolerances(solver: Any) -> None:
    for name in ("rtol", "atol"):
        if getattr(solver, name) is not None:
            python_float(name, getattr(solver, name), allow_zero=True)
    if solver.divergence is not None and python_float("divergence", solver.divergence) <= 1:
        raise ValueError(f"divergence must be > 1 (a growth factor), got {solver.divergence!r}")


class Picard(AbstractFixedPointSolver):
    r"""Damped Picard (fixed-point) iteration, $z_{k+1} = z_k + \lambda\,(f(z_k) - z_k)$.

    Converges linearly, at the rate of the spectral radius of $(1-\lambda) I + \lambda
    \partial_z f$, when that is below 1. $\lambda = 1$ is plain iteration of the map.

    **Arguments:**

    - `rtol`, `atol`: the stopping tolerances (see [`fixed_point`][energyattn.fixed_point];
      `None`: `eps ** 0.6` of the dtype, as every solver).
    - `damping`: $\lambda \in (0, 1]$.
    - `divergence`: stop with `RESULTS.diverged` when the residual exceeds this factor times
      the smallest residual seen (a map that is not a contraction); `None` never stops for
      this reason.
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    damping: float = eqx.field(default=1.0, static=True)
    divergence: float | None = eqx.field(default=1e4, static=True)

    def __check_init__(self):
        _check_tolerances(self)
        if python_float("damping", self.damping) > 1:
            raise ValueError(f"damping must be in (0, 1], got {self.damping!r}")

    def mix(self, memory, z, fz):
        return z + self.damping * (fz - z), memory


class _History(NamedTuple):
    zs: Float[Array, "m n"]  # past iterates, newest first
    gs: Float[Array, "m n"]  # their residuals f(z) - z
    gram: Float[Array, "m m"]  # gs @ gs.T, kept up to date one row at a time
    pushed: Int[Array, ""]  # residuals pushed so far (`count` would shadow tuple.count)


def _spd_solve_small(matrix: Float[Array, "m m"], rhs: Float[Array, " m"]) -> Float[Array, " m"]:
    """$M^{-1}b$ for a small symmetric positive definite $M$, by Gauss-Jordan elimination
    without pivoting on $[M \\mid b]$, unrolled over the static size.

    Each step is one elementwise update of the augmented matrix, which XLA compiles to a
    fused kernel (and `vmap` batches), so the solve costs a handful of kernels per iteration
    instead of a LAPACK call per example.
    """
    m = matrix.shape[0]
    augmented = jnp.concatenate([matrix, rhs[:, None]], axis=1)
    rows = jnp.arange(m)[:, None]
    for k in range(m):
        pivot_row = augmented[k] / augmented[k, k]
        eliminated = augmented - augmented[:, k : k + 1] * pivot_row[None, :]
        augmented = jnp.where(rows == k, pivot_row[None, :], eliminated)
    return augmented[:, m]


class Anderson(AbstractFixedPointSolver):
    r"""Anderson acceleration (Anderson mixing) with a history of $m$ iterates.

    With the last $m_k = \min(k+1, m)$ iterates $z_i$, map values $f_i = f(z_i)$ and residuals
    $g_i = f_i - z_i$ as the rows of $G$, it finds the affine combination with the smallest
    residual,

    $$\alpha = \arg\min_{\mathbf 1^\top\alpha = 1} \lVert G^\top\alpha\rVert^2
    + \lambda \sum_i \lVert g_i\rVert^2 \alpha_i^2,$$

    i.e. $\alpha \propto (GG^\top + \lambda \operatorname{diag}(GG^\top))^{-1}\mathbf 1$, and
    mixes $z_{k+1} = \sum_i \alpha_i z_i + \beta \sum_i \alpha_i g_i$. Each residual's weight
    is regularised relative to that residual's own size, so the ridge means the same thing at
    every scale: an absolute ridge would dominate near convergence and stall it, and so does
    one scaled to the whole history (e.g. $\lambda\operatorname{tr}(GG^\top)/m_k$), which
    the oldest, largest residuals set, so the newest, smallest is held back the more, the
    longer the history. The first
    step ($m_k = 1$) is a damped Picard step. The Gram matrix is updated one row per
    iteration ($O(mn)$, not $O(m^2n)$) and the $m\times m$ system is solved by unrolled
    elimination, so an iteration costs little more than Picard's.

    **Arguments:**

    - `rtol`, `atol`, `divergence`: as in [`Picard`][energyattn.Picard].
    - `history`: $m \ge 1$, the number of past iterates used.
    - `ridge`: $\lambda > 0$, relative Tikhonov regularisation of the least-squares problem.
    - `mixing`: $\beta \in (0, 1]$.

    ??? cite "Source"

        D. G. Anderson, *Iterative procedures for nonlinear integral equations* (1965);
        H. F. Walker and P. Ni, *Anderson acceleration for fixed-point iterations* (2011).
        M. Bal, *Deep Implicit Attention* (2021) solves its mean-field equations this way.
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    history: int = eqx.field(default=5, static=True)
    ridge: float = eqx.field(default=1e-4, static=True)
    mixing: float = eqx.field(default=1.0, static=True)
    divergence: float | None = eqx.field(default=1e4, static=True)

    def __check_init__(self):
        _check_tolerances(self)
        positive_int("history", self.history)
        python_float("ridge", self.ridge)
        if python_float("mixing", self.mixing) > 1:
            raise ValueError(f"mixing must be in (0, 1], got {self.mixing!r}")

    def init_mixing(self, z):
        m = self.history
        zeros = jnp.zeros((m, z.shape[0]), z.dtype)
        return _History(zeros, zeros, jnp.zeros((m, m), z.dtype), jnp.zeros((), jnp.int32))

    def mix(self, memory, z, fz):
        m = self.history
        g = fz - z
        # Newest first. The inner products and the mixing read the whole old history, the
        # oldest slot (which leaves it) weighted 0: a slice without it would be copied out
        # first (under vmap each example's rows are a strided block), one more pass per step.
        # The history then shifts by static slices (a scatter at a traced slot is slow under
        # vmap).
        pushed = memory.pushed + 1
        index = jnp.arange(m)
        valid = index < pushed
        # The new residual's inner products are the new first row and column of the Gram
        # matrix; the rest is the old one, shifted.
        inner = jnp.where(valid, jnp.concatenate([jnp.dot(g, g)[None], (memory.gs @ g)[:-1]]), 0)
        shifted = jnp.pad(memory.gram[:-1, :-1], ((1, 0), (1, 0)))
        first_row, first_column = index[:, None] == 0, index[None, :] == 0
        gram = jnp.where(
            first_row, inner[None, :], jnp.where(first_column, inner[:, None], shifted)
        )
        # Each slot's ridge is relative to its own residual (floored where a residual is
        # exactly zero). Unused slots have zero rows and columns and a unit diagonal, so their
        # equation reads w_i = 0.
        ridge = jnp.maximum(self.ridge * jnp.diagonal(gram), jnp.finfo(z.dtype).tiny)
        ridge = jnp.where(valid, ridge, 1)
        weights = _spd_solve_small(gram + jnp.diag(ridge), valid.astype(z.dtype))
        alpha = weights / jnp.sum(weights)
        # The old slots' weights, in the old history's order (its oldest slot gets 0).
        old = jnp.concatenate([alpha[1:], jnp.zeros((1,), alpha.dtype)])
        mixed_old = old @ memory.zs + self.mixing * (old @ memory.gs)
        z_next = alpha[0] * (z + self.mixing * g) + mixed_old
        zs = jnp.concatenate([z[None], memory.zs[:-1]])
        gs = jnp.concatenate([g[None], memory.gs[:-1]])
        return z_next, _History(zs, gs, gram, pushed)


@compiled
def fixed_point(
    fn: Callable[[State, Any], State],
    y0: Y,
    args: Any = None,
    *,
    solver: AbstractFixedPointSolver | AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    has_aux: bool = False,
) -> Solution[Y]:
    r"""Solve $y^* = f(y^*, \text{args})$, differentiably to any order.

    [`Anderson`][energyattn.Anderson] (default) and [`Picard`][energyattn.Picard] stop when
    the estimated error is within the tolerances,

    $$A_k\operatorname{rms}(f(y_k) - y_k) \le \text{atol} + \text{rtol}\cdot
    \operatorname{rms}(f(y_k)),$$

    the residual times $A_k \approx \lVert(I - \partial_y f)^{-1}\rVert$, estimated from
    successive iterates (for a contraction of rate $L$, $1/(1 - L)$; see
    [`AbstractFixedPointSolver`][energyattn.AbstractFixedPointSolver]), so a map that
    contracts slowly is not stopped by its small residual, and one too slow to certify
    within `max_steps` reports `RESULTS.max_steps_reached` (tolerances on the solver,
    `ea.Anderson(rtol=1e-8)`; by default $\epsilon^{0.6}$ of the dtype, 4.1e-10 in float64
    and 7.0e-5 in float32); [`Newton`][energyattn.Newton]
    solves $f(y) - y = 0$ with the Jacobian. Derivatives with respect to `args` and to any
    arrays `fn` closes over (e.g. the parameters of an Equinox module) follow the `adjoint`:
    by default the implicit function theorem, in forward and reverse mode and to any order.
    The result does not depend on `y0`, which gets no derivative (except through
    `UnrolledAdjoint`), so it may be computed from differentiated inputs.

    **Arguments:**

    - `fn`: the map, `fn(y, args)`, returning the structure and shapes of `y`.
    - `y0`: the initial iterate, a floating-point array or pytree of arrays.
    - `args`: passed to `fn` unchanged.
    - `solver`: [`Anderson`][energyattn.Anderson] (default), [`Picard`][energyattn.Picard]
      or [`Newton`][energyattn.Newton].
    - `adjoint`: [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] (default),
      [`UnrolledAdjoint`][energyattn.UnrolledAdjoint] or
      [`PhantomAdjoint`][energyattn.PhantomAdjoint].
    - `max_steps`: the most evaluations of `fn` (Newton: the most Newton steps); default
      256.
    - `throw`: raise (at run time) unless the solve succeeded; with `False` inspect
      `Solution.result`.
    - `has_aux`: `fn` returns `(output, aux)`; the solver iterates the output, and
      `Solution.aux` is the aux at the solution.

    **Returns:**

    A [`Solution`][energyattn.Solution]. For Anderson and Picard `value` is $f(y_b)$ at the
    iterate $y_b$ with the smallest residual, `residual` that residual (rms), `num_steps` the
    evaluations of `fn`. Non-convergence is `RESULTS.max_steps_reached`, a NaN/inf iterate
    `RESULTS.nonfinite`, a growing residual `RESULTS.diverged`.

    **Example:**

    ```python
    def fn(z, x):
        return jnp.tanh(0.5 * z + x)

    x = jnp.array([0.3, -1.0])
    z = ea.fixed_point(fn, jnp.zeros(2), x).value

    def loss(x):
        return jnp.sum(ea.fixed_point(fn, jnp.zeros(2), x).value ** 2)

    hessian = jax.jit(jax.hessian(loss))(x)  # compiled: one program, not op by op
    ```

    ??? cite "Source"

        S. Bai, J. Z. Kolter, V. Koltun, *Deep Equilibrium Models* (2019); M. Bal, *Deep
        Implicit Attention: A Mean-Field Theory Perspective on Attention Mechanisms* (2021).
    """
    fn, aux = split_aux(fn, has_aux, "ea.fixed_point")
    return solve_problem(
        FixedPointProblem,
        fn,
        y0,
        args,
        solver=Anderson() if solver is None else solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=throw,
        entry="ea.fixed_point",
        y0_name="y0",
        aux=aux,
    )
