r"""Linear solves for the implicit adjoint: $A x = b$, $A = \partial F/\partial y$ at the solution.

Every solve goes through `jax.lax.custom_linear_solve`, so JAX differentiates it (the
tangent of $x$ solves $A\dot x = \dot b - \dot A x$ with the same solver) and transposes it
for reverse mode (a solve with $A^\top$), to any order. The operator is only ever given as
a function $v \mapsto Av$ (a Jacobian-vector product): dense solvers build the matrix from
it once per call, Krylov solvers never do.

Why not lineax: `lax.custom_linear_solve` is core JAX and does everything the adjoint
needs (differentiation, transposition, `vmap`); the dense factorisations and JAX's own
GMRES and CG cover the sizes we meet, and one fewer dependency is one fewer thing that can
break with a JAX release.
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, Float

from .._checks import positive_int, python_float
from .._linalg import cholesky_solve, upper_cholesky
from ._iterate import default_tolerance, rms

Flat = Float[Array, " n"]
MatVec = Callable[[Flat], Flat]

#: Up to this many unknowns the automatic choice builds the matrix and factorises it.
DENSE_LIMIT = 512

_FAILED = (
    "implicit differentiation failed: the linear system of the implicit function theorem "
    "(the Jacobian of the residual at the solution, or its transpose in reverse mode) could "
    "not be solved by {name}{why}. The solution may be singular (a degenerate or "
    "non-isolated root, a flat minimum) or not converged; pass throw=False to get the "
    "solution without this check, or try another ea.ImplicitAdjoint(linear_solver=...)"
)


def _dense_matrix(matvec: MatVec, b: Flat) -> Float[Array, "n n"]:
    """The matrix of a linear map, from one vmapped product per unit vector."""
    eye = jnp.eye(b.shape[0], dtype=b.dtype)
    return jax.vmap(matvec, out_axes=1)(eye)


def _checked(x: Flat, ok: Array, name: str, why: str, throw: bool) -> Flat:
    if not throw:
        return x
    return eqx.error_if(x, ~ok, _FAILED.format(name=name, why=why))


class AbstractLinearSolver(eqx.Module):
    """How [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] solves its linear systems."""

    @abc.abstractmethod
    def solve(self, matvec: MatVec, b: Flat, *, symmetric: bool, factor: Any, throw: bool) -> Flat:
        """$A^{-1}b$ for $A$ = `matvec` (differentiable and transposable). `factor` is a
        factorisation of $A$ the forward solver left behind (or `None`)."""


def _factored_solve(
    matvec: MatVec, b: Flat, apply: Callable, apply_t: Callable | None, name: str, throw: bool
) -> Flat:
    """Solve with a factorisation: `apply` is $A^{-1}$, `apply_t` is $A^{-\\top}$ (`None`
    for a symmetric $A$)."""

    def checked(apply):
        def solve(_, rhs):
            x = apply(rhs)
            ok = jnp.all(jnp.isfinite(x))
            return _checked(x, ok, name, " (the matrix is singular)", throw)

        return solve

    symmetric = apply_t is None
    transpose_solve = None if symmetric else checked(apply_t)
    return jax.lax.custom_linear_solve(
        matvec, b, checked(apply), transpose_solve, symmetric=symmetric
    )


def _lu_solve(matvec: MatVec, b: Flat, lu: Any, name: str, throw: bool) -> Flat:
    apply_t = lambda r: jsl.lu_solve(lu, r, trans=1)  # noqa: E731
    return _factored_solve(matvec, b, lambda r: jsl.lu_solve(lu, r), apply_t, name, throw)


def _cholesky_solve(
    matvec: MatVec, b: Flat, upper: Float[Array, "n n"], name: str, throw: bool
) -> Flat:
    return _factored_solve(matvec, b, lambda r: cholesky_solve(upper, r), None, name, throw)


class LU(AbstractLinearSolver):
    """Dense LU: build the $n\\times n$ Jacobian ($n$ Jacobian-vector products) and factorise
    it. Exact and robust for small systems; $O(n^3)$."""

    def solve(self, matvec, b, *, symmetric, factor, throw):
        return _lu_solve(matvec, b, jsl.lu_factor(_dense_matrix(matvec, b)), "ea.LU", throw)


class Cholesky(AbstractLinearSolver):
    """Dense Cholesky for symmetric positive definite systems (the Hessian at a minimum):
    half the work of LU. Fails loudly when the matrix is not positive definite."""

    def solve(self, matvec, b, *, symmetric, factor, throw):
        matrix = _dense_matrix(matvec, b)
        upper = upper_cholesky(0.5 * (matrix + matrix.T))
        return _cholesky_solve(matvec, b, upper, "ea.Cholesky", throw)


class _Krylov(AbstractLinearSolver):
    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    max_steps: eqx.AbstractVar[int]

    def __check_init__(self):
        positive_int("max_steps", self.max_steps)
        for name in ("rtol", "atol"):
            if getattr(self, name) is not None:
                python_float(name, getattr(self, name), allow_zero=True)

    @abc.abstractmethod
    def _run(self, operator: MatVec, rhs: Flat, rtol: float, atol: float) -> Flat: ...

    def solve(self, matvec, b, *, symmetric, factor, throw):
        rtol = default_tolerance(self.rtol, b.dtype)
        atol = default_tolerance(self.atol, b.dtype)
        name = type(self).__name__

        def run(operator, rhs):
            x = self._run(operator, rhs, rtol, atol)
            # The recomputed residual may exceed the solver's running estimate by round-off.
            ok = rms(operator(x) - rhs) <= 2 * (atol + rtol * rms(rhs))
            why = f" within max_steps={self.max_steps} products"
            return _checked(x, ok & jnp.all(jnp.isfinite(x)), f"ea.{name}", why, throw)

        return jax.lax.custom_linear_solve(
            matvec, b, run, None if symmetric else run, symmetric=symmetric
        )


class GMRES(_Krylov):
    """Restarted GMRES (`jax.scipy.sparse.linalg.gmres`): matrix-free, for large systems.

    Stops when $\\operatorname{rms}(Ax - b) \\le \\text{atol} + \\text{rtol}
    \\operatorname{rms}(b)$ (`None`: `eps ** 0.6` of the dtype), after at most about
    `max_steps` products with $A$.
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    restart: int = eqx.field(default=20, static=True)
    max_steps: int = eqx.field(default=200, static=True)

    def _run(self, operator, rhs, rtol, atol):
        n = rhs.shape[0]
        restart = min(self.restart, n)
        # GMRES's own test is ||r||_2 <= max(tol ||b||_2, atol'): in rms terms atol' is
        # atol * sqrt(n). `maxiter` counts restarts.
        x, _ = jax.scipy.sparse.linalg.gmres(
            operator,
            rhs,
            tol=rtol,
            atol=atol * float(np.sqrt(n)),
            restart=restart,
            maxiter=max(1, -(-self.max_steps // restart)),
            solve_method="batched",
        )
        return x


class CG(_Krylov):
    """Conjugate gradients (`jax.scipy.sparse.linalg.cg`): matrix-free, for symmetric
    positive definite systems (the Hessian at a minimum). Tolerances as
    [`GMRES`][energyattn.GMRES]."""

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    max_steps: int = eqx.field(default=200, static=True)

    def _run(self, operator, rhs, rtol, atol):
        n = rhs.shape[0]
        x, _ = jax.scipy.sparse.linalg.cg(
            operator, rhs, tol=rtol, atol=atol * float(np.sqrt(n)), maxiter=self.max_steps
        )
        return x


class AutoLinearSolver(AbstractLinearSolver):
    """The default: reuse the forward solver's factorisation when it left one (Newton's
    Cholesky or LU at its last iterate), else dense ([`Cholesky`][energyattn.Cholesky] for
    minima, [`LU`][energyattn.LU] otherwise) up to `DENSE_LIMIT` = 512 unknowns, else
    matrix-free ([`CG`][energyattn.CG] / [`GMRES`][energyattn.GMRES])."""

    def solve(self, matvec, b, *, symmetric, factor, throw):
        if factor is not None:
            if symmetric:
                return _cholesky_solve(matvec, b, factor, "a Cholesky factor", throw)
            return _lu_solve(matvec, b, factor, "an LU factor", throw)
        if b.shape[0] <= DENSE_LIMIT:
            dense = Cholesky() if symmetric else LU()
            return dense.solve(matvec, b, symmetric=symmetric, factor=None, throw=throw)
        krylov = CG() if symmetric else GMRES()
        return krylov.solve(matvec, b, symmetric=symmetric, factor=None, throw=throw)
