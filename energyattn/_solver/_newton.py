r"""Newton's method with a line search, for roots, fixed points and minima (`Newton`).

The step solves Newton's system at $y_k$,

$$\partial_y F(y_k)\, d_k = -F(y_k)\quad\text{(roots)},\qquad
(\nabla^2 E(y_k) + \tau I)\, d_k = -\nabla E(y_k)\quad\text{(minima)},$$

densely (LU; Cholesky with the smallest tried shift $\tau \ge 0$ that makes it positive
definite, `shifted_cholesky`) or matrix-free (Newton–Krylov: `jacobian="matrix-free"`, the
same solver with the Krylov directions of `_krylov.py`), and the line search of
`_linesearch.py` takes it.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array, Bool, Float

from .._checks import positive_int, python_float
from .._linalg import (
    cholesky_solve,
    looped_cholesky_solve,
    looped_upper_cholesky,
    lu_factor,
    lu_solve,
    upper_cholesky,
)
from ._iterate import (
    AbstractProblem,
    FixedPointProblem,
    MinimiseProblem,
    RootProblem,
    bounded_while,
    rms,
)
from ._krylov import minimum_direction, root_direction
from ._linear import DENSE_LIMIT, FACTOR_CHECK
from ._linesearch import AbstractLineSearchSolver
from ._merit import merit_of
from ._search import Trial
from ._solution import RESULTS

#: The most diagonal shifts tried when a Hessian is not positive definite.
_MAX_SHIFTS = 40
JACOBIANS = ("auto", "dense", "matrix-free")


def shifted_cholesky(
    hessian: Float[Array, "n n"], *, unrolled: bool = False
) -> tuple[Float[Array, "n n"], Bool[Array, ""], Bool[Array, ""]]:
    r"""Upper Cholesky factor $U$ ($U^\top U = H + \tau I$, see `upper_cholesky`) with the
    smallest tried $\tau \ge 0$ that makes it positive definite.

    $\tau = 0$ first (one factorisation for a convex problem); then
    $\tau_0 = \max(0, -\min_i H_{ii}) + 10^{-3}\max_i|H_{ii}|$, doubled until the factorisation
    succeeds (Nocedal & Wright, *Numerical Optimization*, Algorithm 3.3). Returns the factor,
    whether $H$ itself was positive definite, and whether any shift worked (it fails only
    for a non-finite $H$).
    """
    n = hessian.shape[0]

    # Looped under vmap on CPU (`loop_batches`), except where the step is differentiated.
    cholesky = upper_cholesky if unrolled else looped_upper_cholesky

    def factor(tau):
        # The identity made here, not captured: XLA would carry it through the loop.
        upper = cholesky(hessian + tau * jnp.eye(n, dtype=hessian.dtype))
        return upper, jnp.all(jnp.isfinite(jnp.diagonal(upper)))

    upper, positive = factor(jnp.zeros((), hessian.dtype))
    diag = jnp.diagonal(hessian)
    finfo = jnp.finfo(hessian.dtype)
    # A Hessian with a zero diagonal (a linear energy) has no scale of its own: shift by
    # multiples of 1e-3 then, not of the smallest normal number (a step of 1e300).
    top = jnp.max(jnp.abs(diag))
    size = jnp.where(top > 0, jnp.maximum(top, finfo.tiny / finfo.eps), 1.0)
    tau0 = jnp.maximum(0, -jnp.min(diag)) + 1e-3 * size

    def cond(carry):
        k, _, _, ok = carry
        return ~ok & (k < _MAX_SHIFTS)

    def body(carry):
        k, tau, _, _ = carry
        upper, ok = factor(tau)
        return k + 1, 2 * tau, upper, ok

    _, _, upper, ok = bounded_while(cond, body, (0, tau0, upper, positive), _MAX_SHIFTS, unrolled)
    return upper, positive, ok


class Newton(AbstractLineSearchSolver):
    r"""Newton's method with a backtracking line search: for roots, fixed points and minima.

    - **Roots** $F(y) = 0$ (and fixed points, $F = f(y) - y$): the step solves
      $\partial_y F\, d = -F$ and the line search decreases $\tfrac12\lVert F\rVert^2$; if
      the Jacobian is singular the step is the steepest descent of that merit,
      $-\partial_y F^\top F$.
    - **Minima** of $E$: the step solves $(\nabla^2 E + \tau I)\, d = -\nabla E$ with
      $\tau = 0$ where the Hessian is positive definite and the smallest tried shift that
      makes it so elsewhere, so every step goes downhill; the line search decreases $E$
      itself and never leaves its domain ($E = +\infty$ there). Where it converges, the
      point is certified as a minimum, or walked off (see [`minimise`][energyattn.minimise]).

    How the step is solved (`jacobian`):

    - `"dense"`: the Jacobian by `jax.jacfwd` (LU), the Hessian by `jax.hessian`
      (Cholesky, shifted as above): $n$ Jacobian-vector products, $O(n^2)$ memory, $O(n^3)$
      time. The factorisation of the last step is handed to
      [`ImplicitAdjoint`][energyattn.ImplicitAdjoint], whose linear solve reuses it.
    - `"matrix-free"` (Newton–Krylov): GMRES on Jacobian-vector products for roots,
      conjugate gradients on Hessian-vector products for minima (truncated at the first
      direction of non-positive curvature: the step so far, or steepest descent), at most
      `krylov_steps` products per step, each solved to the relative residual
      $\min(\tfrac12, \sqrt{\operatorname{rms}(r)})$ (an inexact Newton step). For minima,
      "positive definite" then means positive curvature along every Krylov direction met.
    - `"auto"` (default): dense up to 512 unknowns (`DENSE_LIMIT`), matrix-free above. An
      attention layer's state (tokens x width) is usually far above it; every product then
      goes through the blockwise attention passes in forward mode, with O(seq) memory.

    Stops when the proposed step is small, $\operatorname{rms}(d) \le \text{atol} +
    \text{rtol}\operatorname{rms}(y)$ (matrix-free: and its Krylov solve met its tolerance;
    for roots, whose inexact step may leave a component of $F$ unsolved, when $F$ itself is
    as small as the tolerances relative to $F(y_0)$), and returns $y + d$ (so the error left
    is about the square of the tolerance).

    With `chord_check=True` (minima, dense only) each pass first solves with the *previous*
    iterate's Hessian factor (a chord step, off the Newton step by a relative
    $O(\lVert d_{k-1}\rVert)$) and stops if that step is already within the tolerances:
    the last pass of a converging solve then costs one triangular solve instead of a new
    factorisation. Nothing stale reaches the derivatives: the adjoint then factorises
    the Hessian at the solution itself (only when derivatives are taken).

    **Arguments:**

    - `rtol`, `atol`: tolerances on the step (`None`: `eps ** 0.6` of the dtype, 4e-10 in
      float64, 7e-5 in float32).
    - `max_backtracks`: the most halvings of the step in one line search.
    - `armijo`: the sufficient-decrease constant $c$ of the line search.
    - `chord_check`: test convergence with the previous Hessian factor first (see above;
      default `False`).
    - `jacobian`: `"auto"`, `"dense"` or `"matrix-free"` (see above).
    - `krylov_steps`: the most Jacobian- or Hessian-vector products of one matrix-free
      step.

    ??? cite "Source"

        J. Nocedal and S. J. Wright, *Numerical Optimization* (2006), chapters 3, 7 and 11;
        S. C. Eisenstat and H. F. Walker, *Choosing the forcing terms in an inexact Newton
        method* (1996).
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    max_backtracks: int = eqx.field(default=40, static=True)
    armijo: float = eqx.field(default=1e-4, static=True)
    chord_check: bool = eqx.field(default=False, static=True)
    jacobian: str = eqx.field(default="auto", static=True)
    krylov_steps: int = eqx.field(default=100, static=True)
    kinds: ClassVar[tuple[type[AbstractProblem], ...]] = (
        RootProblem,
        FixedPointProblem,
        MinimiseProblem,
    )

    def __check_init__(self):
        for name in ("rtol", "atol"):
            if getattr(self, name) is not None:
                python_float(name, getattr(self, name), allow_zero=True)
        positive_int("max_backtracks", self.max_backtracks, minimum=0)
        if not 0 < python_float("armijo", self.armijo) < 1:
            raise ValueError(f"armijo must be in (0, 1), got {self.armijo!r}")
        if self.jacobian not in JACOBIANS:
            raise ValueError(f"jacobian must be one of {JACOBIANS}, got {self.jacobian!r}")
        positive_int("krylov_steps", self.krylov_steps)

    def matrix_free(self, n: int) -> bool:
        """Whether a problem of `n` unknowns takes matrix-free (Newton–Krylov) steps."""
        return self.jacobian == "matrix-free" or (self.jacobian == "auto" and n > DENSE_LIMIT)

    def _direction(
        self,
        problem: AbstractProblem,
        point: Trial,
        args: Any,
        unrolled: bool,
        previous: Any = None,
    ):
        """`(direction, slope, memory, positive, solved)` at `point`. `previous` (minima with
        `chord_check`): `(factor, positive, tol)` of the last pass, or `None`."""
        if self.matrix_free(point.y.shape[0]):
            return self._krylov_direction(problem, point, args, unrolled)
        true = jnp.ones((), bool)
        if isinstance(problem, MinimiseProblem):
            grad, hessian, cache = problem.objective.hessian(point.y, args, point.aux)
            solve = cholesky_solve if unrolled else looped_cholesky_solve

            def fresh(_):
                upper, positive, ok = shifted_cholesky(hessian, unrolled=unrolled)
                newton = -solve(upper, grad)
                return jnp.where(ok, newton, -grad), upper, positive

            if previous is None:
                direction, upper, positive = fresh(None)
            else:
                old_upper, old_positive, tol = previous
                chord = -solve(old_upper, grad)
                reuse = old_positive & (rms(chord) <= tol) & jnp.all(jnp.isfinite(chord))
                direction, upper, positive = jax.lax.cond(
                    reuse, lambda _: (chord, old_upper, old_positive), fresh, None
                )
            return direction, jnp.dot(grad, direction), (upper, cache), positive, true
        residual = point.aux
        jacobian = jax.jacfwd(problem.residual)(point.y, args)
        if unrolled:
            lu = jsl.lu_factor(jacobian)
            newton = -jsl.lu_solve(lu, residual)
        else:  # looped under vmap on CPU (`loop_batches`)
            lu = lu_factor(jacobian)
            newton = -lu_solve(*lu, residual)
        # The Newton step must solve J d = -F: a singular Jacobian gives inf or NaN, or a
        # finite step that leaves F's component outside J's range unsolved.
        eps = float(jnp.finfo(residual.dtype).eps)
        error = jacobian @ jnp.where(jnp.isfinite(newton), newton, 0) + residual
        ok = jnp.all(jnp.isfinite(newton)) & (rms(error) <= eps**0.5 * (rms(residual) + eps))
        # A singular Jacobian: steepest descent on the merit 1/2 |F|^2 instead.
        steepest = -(jacobian.T @ residual)
        direction = jnp.where(ok, newton, steepest)
        slope = jnp.where(ok, -jnp.sum(jnp.square(residual)), -jnp.sum(jnp.square(steepest)))
        return direction, slope, lu, true, ok

    def _krylov_direction(self, problem, point, args, unrolled):
        # No factorisation to keep: the implicit adjoint solves matrix-free as well.
        if isinstance(problem, MinimiseProblem):
            grad = problem.objective.gradient(point.y, args, point.aux)
            _, hvp = jax.linearize(lambda y: problem.objective.residual(y, args), point.y)
            direction, positive, solved = minimum_direction(hvp, grad, self.krylov_steps, unrolled)
            return direction, jnp.dot(grad, direction), (None, None), positive, solved
        direction, slope, solved = root_direction(
            lambda y: problem.residual(y, args), point.y, point.aux, self.krylov_steps
        )
        return direction, slope, None, jnp.ones((), bool), solved

    def exact_step(self, n: int) -> bool:
        """A dense step solves Newton's system exactly; a Krylov step only to its forcing
        term, so that its size does not bound the distance to the solution."""
        return not self.matrix_free(n)

    def init_memory(self, problem, y, args):
        value_fn = merit_of(problem, args).value

        def shapes(y):
            f, scale, aux = value_fn(y)
            return self._direction(problem, Trial(y, f, scale, aux), args, False)[2]

        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(shapes, y))

    def propose(self, problem, point, args, state, unrolled):
        previous = None
        dense = not self.matrix_free(point.y.shape[0])
        if self.chord_check and isinstance(problem, MinimiseProblem) and dense:
            rtol, atol = self.tolerances(point.y.dtype)
            tol = atol + rtol * rms(point.y)
            # Before the first direction the memory is zeros: never reused.
            previous = (state.memory[0], state.started & state.positive, tol)
        return self._direction(problem, point, args, unrolled, previous)

    def postprocess(self, problem, y, args, state, result):
        done = result == RESULTS.successful
        value = jnp.where(done, y + state.direction, y)
        stats = {"value": state.point.f, "backtracks": state.backtracks}
        if isinstance(problem, MinimiseProblem):
            factor, cache = state.memory
            if self.chord_check:
                factor = None  # perhaps the previous iterate's: the adjoint factorises anew
        else:
            factor, cache = state.memory, None
        extras = {"factor": factor, "cache": cache, "point": state.point}
        extras["singular"] = done & _jacobian_moves(problem, args, state.point.y, value)
        return value, state.size, stats, extras


def _jacobian_moves(problem: AbstractProblem, args: Any, y: Array, root: Array) -> Array:
    r"""Whether the residual's Jacobian changes by more than `FACTOR_CHECK` (a quarter)
    across the last step $d$ = `root - y`: $\operatorname{rms}(J(y^*)d - J(y)d) >
    \tfrac14\operatorname{rms}(J(y)d)$. Newton's last step is within the tolerance, so a
    Jacobian that moves that much within it vanishes at the root, or nearly (a multiple
    root: at the double root of $y^2 - a$, $a = 0$, each step halves $y$ and $J$): the
    implicit derivative does not exist, or is not determined by the solve
    (`ImplicitAdjoint` makes it NaN, or raises). At a simple root $J$ moves by a relative
    $O(\lVert F''\rVert\,\lVert d\rVert / \lVert J\rVert)$, far below."""
    d = jax.lax.stop_gradient(root - y)

    def along_d(z):
        return jax.jvp(lambda w: problem.residual(w, args), (z,), (d,))[1]

    before, after = along_d(jax.lax.stop_gradient(y)), along_d(jax.lax.stop_gradient(root))
    change = rms(after - before)
    return jnp.isfinite(change) & (change > FACTOR_CHECK * rms(before))
