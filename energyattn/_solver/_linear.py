r"""Linear solves for the implicit adjoint: $A x = b$, $A = \partial F/\partial y$ at the solution.

Every solve is one primitive (`linear_solve`) with the rules of `jax.lax.custom_linear_solve`:
JAX differentiates it (the tangent of $x$ solves $A\dot x = \dot b - \dot A x$ with the same
solver) and transposes it for reverse mode (a solve with $A^\top$), to any order. The
operator is only ever given as a function $v \mapsto Av$ (a Jacobian-vector product): dense
solvers build the matrix from it once per call, Krylov solvers never do.

Why a primitive of our own: under `vmap`, `custom_linear_solve`'s batching rule batches the
solve and its transpose several times over to find which of their outputs are batched, with
GMRES's nested loops inside each time; this one is batched by
`_vprim.create_vprim` (Equinox's design, on a primitive of our own; as the attention passes
are), so
the solve is vmapped once, when it is lowered (the vmapped gradient of a spin-model
transformer layer traces and lowers faster, to the same gradient). Why not lineax itself:
the dense factorisations, JAX's CG and a short GMRES of our own (`_krylov.py`) cover the
sizes we meet, and one fewer dependency is one fewer thing that can break with a JAX
release.
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jaxtyping import Array, Float

from .._checks import positive_int, python_float
from .._linalg import (
    looped_cholesky_solve,
    looped_upper_cholesky,
    lu_factor,
    lu_solve,
    lu_solve_transposed,
)
from .._vprim import create_vprim
from ._iterate import AbstractProblem, default_tolerance, rms
from ._krylov import gmres

Flat = Float[Array, " n"]
MatVec = Callable[[Flat], Flat]
ProblemType = type[AbstractProblem]

#: Up to this many unknowns a dense Newton step of the forward solvers builds the Jacobian
#: (`Newton(jacobian="auto")`): it is built at every step anyway, and factorised once.
DENSE_LIMIT = 512

#: Up to this many unknowns the implicit adjoint's automatic choice builds the matrix (n
#: Jacobian-vector products) and factorises it, for a general (LU) and a symmetric
#: (Cholesky) system; above, matrix-free GMRES / CG. (general, symmetric) per platform: where
#: the two cost the same on the package's implicit layers, measured on one CPU core and on
#: one GPU by benchmarks/adjoint_solve.py (the tables are in benchmarks/README.md, "Dense or
#: matrix-free implicit adjoint"); a TPU is taken to be like a GPU (not measured).
DENSE_ADJOINT_LIMITS = {"cpu": (16, 8), "accelerator": (128, 64)}


def dense_adjoint_limit(symmetric: bool) -> int:
    """Up to how many unknowns the automatic adjoint solve is dense, on the default backend."""
    platform = "cpu" if jax.default_backend() == "cpu" else "accelerator"
    return DENSE_ADJOINT_LIMITS[platform][int(symmetric)]


#: The system a failed solve names when the problem is not known: A is the Jacobian of the
#: residual at the solution.
_GENERIC = ("A u = r", "Aᵀ v = g")

_FAILED = (
    "implicit differentiation failed in {which}: the implicit adjoint's linear solve of "
    "{system} with {name} {why}. The solution may be singular (a degenerate or non-isolated "
    "root, a flat minimum) or not converged; give the linear solver more steps or looser "
    "tolerances, try another ea.ImplicitAdjoint(linear_solver=...), or pass throw=False to "
    "skip this check"
)


def _message(name: str, why: str, transpose: bool, problem: ProblemType | None) -> str:
    """The error of a failed solve: which pass, which system (that of the `problem` type
    whose derivative is solved for, when given) and why."""
    system = (_GENERIC if problem is None else problem.systems)[int(transpose)]
    which = (
        "the backward pass (reverse mode, e.g. jax.grad)"
        if transpose
        else "the forward-mode derivative (jax.jvp / jacfwd)"
    )
    return _FAILED.format(which=which, system=system, name=name, why=why)


def linear_solve(
    matvec: MatVec, b: Flat, solve: Callable, transpose_solve: Callable, symmetric: bool
) -> Flat:
    """$A^{-1}b$ by `solve(matvec, b)`, with the rules of `jax.lax.custom_linear_solve` (the
    same arguments; `transpose_solve(vecmat, r)` solves with $A^\\top$), as a primitive
    batched by `_vprim.create_vprim`: under `vmap` the solve is vmapped once, where
    JAX's rule batches the solve and its transpose several times over to find which outputs
    are batched (with GMRES's nested loops each time)."""
    if symmetric:
        vecmat = matvec
    else:
        transposed = jax.linear_transpose(matvec, jax.ShapeDtypeStruct(b.shape, b.dtype))
        vecmat = lambda v: transposed(v)[0]  # noqa: E731
    functions = (
        matvec,
        vecmat,
        lambda r: solve(matvec, r),
        lambda r: transpose_solve(vecmat, r),
    )
    groups = [_flat_function(f, b) for f in functions]
    (x,) = _solve_p.bind(
        *[c for consts, _ in groups for c in consts],
        b,
        structures=tuple(structure for _, structure in groups),
        counts=tuple(len(consts) for consts, _ in groups),
    )
    return x


class _Structure:
    """A function of a vector without the arrays it closes over (`_flat_function`): a
    primitive's parameter, equal to itself only."""

    def __init__(self, treedef, static):
        self.treedef, self.static = treedef, static

    def __call__(self, consts):
        return eqx.combine(jax.tree.unflatten(self.treedef, consts), self.static)


def _flat_function(fn: Callable, b: Flat) -> tuple[list, _Structure]:
    """The arrays `fn` (of a vector like `b`) closes over, and the rest."""
    dynamic, static = eqx.partition(eqx.filter_closure_convert(fn, b), eqx.is_array)
    consts, treedef = jax.tree.flatten(dynamic)
    return consts, _Structure(treedef, static)


def _split(arrays, counts):
    groups, start = [], 0
    for n in counts:
        groups.append(list(arrays[start : start + n]))
        start += n
    return groups, arrays[start]


def _solve_impl(*arrays, structures, counts):
    groups, b = _split(arrays, counts)
    return [structures[2](groups[2])(b)]


def _solve_abstract_eval(*avals, structures, counts):
    return [avals[-1]]


def _solve_jvp(primals, tangents, *, structures, counts):
    # x = A^-1 b: dx = A^-1 (db - dA x), solved the same way. Only the operator's arrays
    # carry the derivative; those of the solves (factorisations of A) and of the transposed
    # operator are the same matrix, and differentiating them too would count it twice.
    groups, _ = _split(primals, counts)
    t_groups, t_b = _split(tangents, counts)
    params = dict(structures=structures, counts=counts)
    (x,) = _solve_p.bind(*primals, **params)
    rhs = jnp.zeros_like(x) if type(t_b) is ad.Zero else t_b
    moving = [i for i, t in enumerate(t_groups[0]) if type(t) is not ad.Zero]
    if moving:
        # Differentiated in the arrays that move only: a zero tangent made an array would
        # enter the tangent's terms as a constant where a transpose expects none.
        def operator_at_x(*arrays):
            consts = list(groups[0])
            for i, array in zip(moving, arrays, strict=True):
                consts[i] = array
            return structures[0](consts)(x)

        primal = [groups[0][i] for i in moving]
        _, dA_x = jax.jvp(operator_at_x, primal, [t_groups[0][i] for i in moving])
        rhs = rhs - dA_x
    (t_x,) = _solve_p.bind(*primals[:-1], rhs, **params)
    return [x], [t_x]


def _solve_transpose(cts, *args, structures, counts):
    # Linear in b only: b_bar = A^-T x_bar, the same primitive with the roles swapped.
    groups, _ = _split(args, counts)
    if any(ad.is_undefined_primal(c) for group in groups for c in group):
        raise NotImplementedError("a linear solve is not linear in its operator")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * len(args)
    order = (1, 0, 3, 2)
    (x,) = _solve_p.bind(
        *[c for i in order for c in groups[i]],
        ct,
        structures=tuple(structures[i] for i in order),
        counts=tuple(counts[i] for i in order),
    )
    return [None] * (len(args) - 1) + [x]


_solve_p = create_vprim(
    "energyattn_linear_solve", _solve_impl, _solve_abstract_eval, _solve_jvp, _solve_transpose
)


def _dense_matrix(matvec: MatVec, b: Flat) -> Float[Array, "n n"]:
    """The matrix of a linear map, from one vmapped product per unit vector."""
    eye = jnp.eye(b.shape[0], dtype=b.dtype)
    return jax.vmap(matvec, out_axes=1)(eye)


#: The largest relative residual, rms(A x - b) / rms(b), that a factored solve of the
#: implicit adjoint accepts (`_factored_solve`).
FACTOR_CHECK = 0.25


def _checked(x: Flat, ok: Array, message: str, throw: bool) -> Flat:
    if not throw:
        return x
    return eqx.error_if(x, ~ok, message)


class AbstractLinearSolver(eqx.Module):
    """How [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] solves its linear systems."""

    @abc.abstractmethod
    def solve(
        self,
        matvec: MatVec,
        b: Flat,
        *,
        symmetric: bool,
        factor: Any,
        throw: bool,
        problem: ProblemType | None = None,
    ) -> Flat:
        """$A^{-1}b$ for $A$ = `matvec` (differentiable and transposable). `factor` is a
        factorisation of $A$ the forward solver left behind (or `None`). With `throw`, a
        failed solve raises at run time; `problem` is the type of problem whose derivative
        this solve gives (e.g. `FixedPointProblem`), so that the error names its system."""


def _factored_solve(
    matvec: MatVec,
    b: Flat,
    apply: Callable,
    apply_t: Callable | None,
    name: str,
    throw: bool,
    problem: ProblemType | None,
) -> Flat:
    """Solve with a factorisation: `apply` is $A^{-1}$, `apply_t` is $A^{-\\top}$ (`None`
    for a symmetric $A$).

    The solution is checked against the operator itself: $\\operatorname{rms}(Ax - b) \\le
    \\tfrac14\\operatorname{rms}(b)$ (`FACTOR_CHECK`). A factor of a Jacobian that is
    singular or nearly so (a condition beyond about $1/\\epsilon$) fails it, and so does the
    forward solver's factor from its last iterate where the Jacobian changes by a large
    fraction within the solve's own error: at a root where $F'$ vanishes (the double root
    of $y^2 - a$ at $a = 0$, whose derivative $1/(2\\sqrt a)$ is infinite) Newton's
    Jacobian halves at every step, and the derivative a solve would give is set by its
    tolerance, not by the problem. Such a derivative does not exist (or is not determined
    by the solve): the solve raises with `throw`, and is NaN without."""

    why = (
        "failed: the matrix is singular or nearly so (the solve gave NaN or inf, or does "
        "not solve the system at the solution: a Jacobian that vanishes at a multiple root, "
        "or is singular to working precision), so the derivative does not exist or is not "
        "determined by the solve"
    )

    def checked(apply, transpose):
        message = _message(name, why, transpose, problem)

        def solve(operator, rhs):
            x = apply(rhs)
            finite = jnp.all(jnp.isfinite(x))
            left = rms(operator(jnp.where(jnp.isfinite(x), x, 0)) - rhs)
            ok = finite & (left <= FACTOR_CHECK * rms(rhs))
            if throw:
                return _checked(x, ok, message, throw)
            return jnp.where(ok, x, jnp.nan)

        return solve

    symmetric = apply_t is None
    # A symmetric matrix solves its transpose with the same factor; the error still says
    # which pass failed.
    transpose_solve = checked(apply if symmetric else apply_t, True)
    return linear_solve(matvec, b, checked(apply, False), transpose_solve, symmetric)


def _lu_solve(
    matvec: MatVec, b: Flat, lu: Any, name: str, throw: bool, problem: ProblemType | None
) -> Flat:
    # Loops under vmap on CPU (`loop_batches`); custom_linear_solve differentiates the solve
    # through `matvec`, never through these.
    apply_t = lambda r: lu_solve_transposed(*lu, r)  # noqa: E731
    apply = lambda r: lu_solve(*lu, r)  # noqa: E731
    return _factored_solve(matvec, b, apply, apply_t, name, throw, problem)


def _cholesky_solve(
    matvec: MatVec,
    b: Flat,
    upper: Float[Array, "n n"],
    name: str,
    throw: bool,
    problem: ProblemType | None,
) -> Flat:
    apply = lambda r: looped_cholesky_solve(upper, r)  # noqa: E731
    return _factored_solve(matvec, b, apply, None, name, throw, problem)


class LU(AbstractLinearSolver):
    """Dense LU: build the $n\\times n$ Jacobian ($n$ Jacobian-vector products) and factorise
    it. Exact and robust for small systems; $O(n^3)$."""

    def solve(self, matvec, b, *, symmetric, factor, throw, problem=None):
        # The factor is only the solve's (its derivatives go through `matvec`).
        lu = lu_factor(jax.lax.stop_gradient(_dense_matrix(matvec, b)))
        return _lu_solve(matvec, b, lu, "ea.LU", throw, problem)


class Cholesky(AbstractLinearSolver):
    """Dense Cholesky for symmetric positive definite systems (the Hessian at a minimum):
    half the work of LU. Fails loudly when the matrix is not positive definite."""

    def solve(self, matvec, b, *, symmetric, factor, throw, problem=None):
        matrix = jax.lax.stop_gradient(_dense_matrix(matvec, b))
        upper = looped_upper_cholesky(0.5 * (matrix + matrix.T))
        return _cholesky_solve(matvec, b, upper, "ea.Cholesky", throw, problem)


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

    def solve(self, matvec, b, *, symmetric, factor, throw, problem=None):
        rtol = default_tolerance(self.rtol, b.dtype)
        atol = default_tolerance(self.atol, b.dtype)
        name = f"ea.{type(self).__name__}"
        why = (
            f"did not converge within max_steps={self.max_steps} matrix-vector products "
            f"(rtol={rtol:.3g}, atol={atol:.3g}), or gave NaN or inf"
        )

        def runner(transpose):
            message = _message(name, why, transpose, problem)

            def run(operator, rhs):
                # Solved for the right-hand side scaled to rms 1, and scaled back. The scale
                # of a gradient is arbitrary (a loss in other units, a mean over many
                # entries): against an absolute tolerance a small cotangent would "solve" as
                # zero, a silently zero gradient.
                size = rms(rhs)
                scale = jnp.where(size > 0, size, 1)
                unit = rhs / scale
                x = self._run(operator, unit, rtol, atol)
                # The recomputed residual may exceed the running estimate by round-off.
                ok = rms(operator(x) - unit) <= 2 * (atol + rtol * rms(unit))
                return _checked(scale * x, ok & jnp.all(jnp.isfinite(x)), message, throw)

            return run

        return linear_solve(matvec, b, runner(False), runner(True), symmetric)


class GMRES(_Krylov):
    """Restarted GMRES: matrix-free, for large systems. It stops as soon as the residual is
    small enough, inside a restart cycle too.

    Solves for $b$ scaled to $\\operatorname{rms}(b) = 1$ (and scales back), and stops when
    $\\operatorname{rms}(Ax - b) \\le (\\text{atol} + \\text{rtol})
    \\operatorname{rms}(b)$ (`None`: `eps ** 0.6` of the dtype), after at most about
    `max_steps` products with $A$. Both tolerances are relative: a gradient's scale is
    arbitrary, and an absolute tolerance would return zero for a small cotangent.

    `restart` is the size of the Krylov basis (products per cycle). The basis is allocated
    whole, each step orthogonalises against all of it, and it is the largest buffer of a
    backward pass through a batched implicit layer, so a larger one costs time and memory even
    where the solve stops early; 8 holds every adjoint solve of the spin-model layer at the
    benchmark's sizes (the same gradient as 10 or 20, to the bit) and is as fast as 10 on
    deep implicit attention (`benchmarks/README.md`, "GMRES's restart"). A solve that needs
    more steps restarts, which GMRES handles at some cost in steps.

    `max_steps` (default 200) counts products with $A$, not the iterations that the solver
    entry points' `max_steps` (default 256) counts.
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    restart: int = eqx.field(default=8, static=True)
    max_steps: int = eqx.field(default=200, static=True)

    def __check_init__(self):
        positive_int("restart", self.restart)

    def _run(self, operator, rhs, rtol, atol):
        # The test ||r||_2 <= max(rtol ||b||_2, atol'): in rms terms atol' is atol * sqrt(n).
        n = rhs.shape[0]
        return gmres(
            operator,
            rhs,
            tol=rtol,
            atol=atol * float(np.sqrt(n)),
            restart=self.restart,
            max_steps=self.max_steps,
        )


class CG(_Krylov):
    """Conjugate gradients (`jax.scipy.sparse.linalg.cg`): matrix-free, for symmetric
    positive definite systems (the Hessian at a minimum). Tolerances and `max_steps` as
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
    Cholesky or LU at its last iterate); else dense ([`LU`][energyattn.LU]) up to 16
    unknowns and matrix-free ([`GMRES`][energyattn.GMRES]) above, or for the symmetric
    Hessian of a minimum dense ([`Cholesky`][energyattn.Cholesky]) up to 8 unknowns and
    [`CG`][energyattn.CG] above, when JAX's default backend is the CPU; on a GPU (or TPU),
    where the products that build a dense matrix run in parallel, up to 128 and 64.

    The limits are where the two cost the same on the package's implicit layers: building a
    dense matrix takes $n$ products with the operator and $O(n^3)$ to factorise, a Krylov
    solve takes as many products as its iterations, about as many as the forward solve's.
    The measurements behind the limits (spin-model transformer heads, minima, on one CPU core
    and on a GPU) are in `benchmarks/README.md`, "Dense or matrix-free implicit adjoint".
    Pass `ea.LU()` or `ea.Cholesky()` for exact solves at any size."""

    def solve(self, matvec, b, *, symmetric, factor, throw, problem=None):
        if factor is not None:
            if symmetric:
                return _cholesky_solve(matvec, b, factor, "a Cholesky factor", throw, problem)
            return _lu_solve(matvec, b, factor, "an LU factor", throw, problem)
        if b.shape[0] <= dense_adjoint_limit(symmetric):
            dense = Cholesky() if symmetric else LU()
            return dense.solve(
                matvec, b, symmetric=symmetric, factor=None, throw=throw, problem=problem
            )
        krylov = CG() if symmetric else GMRES()
        return krylov.solve(
            matvec, b, symmetric=symmetric, factor=None, throw=throw, problem=problem
        )
