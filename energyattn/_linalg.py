"""Dense linear algebra shared by the energies and the solvers."""

import jax
import jax.numpy as jnp
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


def solve(matrix: Float[Array, "n n"], b: Float[Array, "n ..."]) -> Float[Array, "n ..."]:
    r"""$M^{-1}b$ for a square $M$ (LU with partial pivoting), differentiable to any order,
    whose batches (under `vmap`) run as a loop of unbatched LAPACK calls.

    Why: jaxlib 0.10's batched LAPACK kernels split a batch over XLA's intra-op thread
    pool and block that pool's thread until the pieces finish; when a program runs as many
    batched LAPACK calls at once as the pool has threads, every thread waits and the process
    hangs (seen as `jax.jit(jax.hessian(...))` of `MeanFieldAttention(variant="tap")` on 2
    cores; README, "A known jaxlib hang on CPU"). One example per call never splits. JAX
    differentiates and transposes the solve through `lax.custom_linear_solve`.
    """
    matvec = lambda x: matrix @ x  # noqa: E731
    return jax.lax.custom_linear_solve(
        matvec,
        b,
        lambda _, r: _unbatched_solve(matrix, r),
        lambda _, r: _unbatched_solve(matrix.T, r),
    )


def inverse(matrix: Float[Array, "*batch n n"]) -> Float[Array, "*batch n n"]:
    """$M^{-1}$ of each matrix of a stack, by `solve` (no batched LAPACK call)."""
    eye = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
    one = lambda m: solve(m, eye)  # noqa: E731
    for _ in range(matrix.ndim - 2):
        one = jax.vmap(one)
    return one(matrix)


@jax.custom_batching.custom_vmap
def _unbatched_solve(matrix: Array, b: Array) -> Array:
    return jnp.linalg.solve(matrix, b)


@_unbatched_solve.def_vmap
def _solve_one_at_a_time(axis_size, in_batched, matrix, b):
    matrix_batched, b_batched = in_batched
    if not matrix_batched:
        matrix = jnp.broadcast_to(matrix, (axis_size, *matrix.shape))
    if not b_batched:
        b = jnp.broadcast_to(b, (axis_size, *b.shape))
    return jax.lax.map(lambda pair: _unbatched_solve(*pair), (matrix, b)), True
