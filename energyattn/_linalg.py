"""Dense linear algebra shared by the energies and the solvers."""

import jax
import jax.scipy.linalg as jsl
from jaxtyping import Array, Float


def upper_cholesky(matrix: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$U$ with $U^\top U = M$ for symmetric positive definite $M$ (NaN where it is not).

    Written for XLA's layouts on CPU, where LAPACK takes and returns column-major arrays
    and everything else is row-major: LAPACK gets $M^\top$ (the same matrix, as $M$ is
    symmetric: callers pass matrices symmetric by construction; one triangle is read, with
    no symmetrising pass), whose column-major order is $M$'s row-major one, and returns
    $L = U^\top$ in column-major order, which is $U$ in row-major order. Keeping $U$ (in
    loop states, caches) and solving with `U.T` (`cholesky_solve`) moves no data, where
    factorising $M$ and keeping $L$ costs a transposing copy of the whole matrix at each
    end (about a fifth of a factorisation each, at N = 1024 on CPU).
    """
    return jax.lax.linalg.cholesky(matrix.T, symmetrize_input=False).T


def cholesky_solve(upper: Float[Array, "n n"], b: Float[Array, " n"]) -> Float[Array, " n"]:
    r"""$M^{-1}b$ from the factor $U^\top U = M$ of `upper_cholesky`."""
    return jsl.cho_solve((upper.T, True), b)
