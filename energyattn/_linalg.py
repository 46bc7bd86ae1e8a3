"""Dense linear algebra shared by the energies and the solvers."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax.interpreters import ad
from jaxtyping import Array, Float

from ._dtypes import result_dtype
from ._vprim import create_vprim


def upper_cholesky(matrix: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$U$ with $U^\top U = M$ for symmetric positive definite $M$ (NaN where it is not).

    Written for XLA's layouts on CPU, where LAPACK takes and returns column-major arrays
    and everything else is row-major: LAPACK gets $M^\top$ (the same matrix, as $M$ is
    symmetric: callers pass matrices symmetric by construction; one triangle is read, with
    no symmetrising pass), whose column-major order is $M$'s row-major one, and returns
    $L = U^\top$ in column-major order, which is $U$ in row-major order. Keeping $U$ (in
    loop states, caches) and solving with `U.T` (`cholesky_solve`) moves no data, where
    factorising $M$ and keeping $L$ costs a transposing copy of the whole matrix at each
    end (measured in `benchmarks/README.md`, "Vector-spin saddle point").

    The zeros below the diagonal are set here, on $U$ in row-major order, not by
    `jax.lax.linalg.cholesky` on $L$: its mask, written for $L$, made XLA lay the factor
    out column-major around it and pay two transposing copies of the whole matrix per
    factorisation where the factor is carried through a loop (the saddle point's Newton
    Hessian; `benchmarks/README.md`, "Vector-spin saddle point"). Same values, bit for bit.
    """
    return jnp.triu(jax.lax.linalg.cholesky_p.bind(matrix.T).T)


def cholesky_solve(upper: Float[Array, "n n"], b: Float[Array, " n"]) -> Float[Array, " n"]:
    r"""$M^{-1}b$ from the factor $U^\top U = M$ of `upper_cholesky`."""
    return jsl.cho_solve((upper.T, True), b)


def loop_batches(fn: Callable) -> Callable:
    """`fn` (a LAPACK call: a factorisation, a triangular or LU solve, an eigendecomposition),
    whose batches under `vmap` run on CPU as a loop of unbatched calls, and batched on
    other platforms (chosen when the program is lowered).

    Why: jaxlib 0.10's batched LAPACK kernels split a batch over XLA's intra-op thread
    pool and block that pool's thread until the pieces finish; when a program runs as many
    batched LAPACK calls at once as the pool has threads, every thread waits and the
    process hangs (the docs' known issues, "Batched LAPACK calls can hang jaxlib 0.10 on
    CPU"). One example per call never splits. Not differentiable in reverse mode
    (`custom_vmap`): for factors that are not differentiated (the solvers' steps outside an
    unrolled solve, the implicit adjoint's factor) and for the solves of
    `lax.custom_linear_solve`, whose derivatives go through its matrix-vector product.
    """
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        args = jax.tree.map(
            lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)),
            args,
            tuple(in_batched),
        )

        def looped(*args):
            return jax.lax.map(lambda xs: wrapped(*xs), args)

        out = jax.lax.platform_dependent(*args, cpu=looped, default=jax.vmap(fn))
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


def solve(matrix: Float[Array, "n n"], b: Float[Array, "n ..."]) -> Float[Array, "n ..."]:
    r"""$M^{-1}b$ for a square $M$ (LU with partial pivoting), differentiable to any order,
    whose batches (under `vmap`) run on CPU as a loop of unbatched LAPACK calls
    (`loop_batches`; the hang was seen as `jax.jit(jax.hessian(...))` of
    `MeanFieldAttention(variant="tap")` on 2 cores). JAX differentiates and transposes the
    solve through `lax.custom_linear_solve`.
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


#: LAPACK calls, looped under `vmap` on CPU (`loop_batches`): `solve`'s, the solvers' and
#: the adjoints'.
_unbatched_solve = loop_batches(lambda matrix, b: jnp.linalg.solve(matrix, b))
lu_factor = loop_batches(lambda matrix: jsl.lu_factor(matrix))
lu_solve = loop_batches(lambda lu, piv, b: jsl.lu_solve((lu, piv), b))
lu_solve_transposed = loop_batches(lambda lu, piv, b: jsl.lu_solve((lu, piv), b, trans=1))
looped_upper_cholesky = loop_batches(upper_cholesky)
looped_cholesky_solve = loop_batches(cholesky_solve)
solve_upper = loop_batches(lambda upper, b: jsl.solve_triangular(upper, b))
eigh = loop_batches(lambda matrix: jnp.linalg.eigh(matrix))


def product(a: Float[Array, "i k"], b: Float[Array, "k j"]) -> Float[Array, "i j"]:
    r"""$AB$, whose reverse mode multiplies by a transposed copy of $A$.

    The transpose of $x \mapsto Ax$ (reverse mode's product, e.g. $A^\top\bar u$ in a
    vector-Jacobian product) contracts $A$ over its rows, which XLA's CPU backend runs
    much more slowly than a plain product (a spin-model transformer's backward pass,
    `benchmarks/README.md`, "Spin-model transformer attention"). Here the product is a
    primitive that carries $A^\top$ beside $A$ and transposes to itself with the two
    swapped, so both directions are plain products; where $A$ is fixed during an iterative
    solve (an implicit adjoint's linear solve), $A^\top$ is made once, before the loop, and
    where reverse mode is not taken it is never made (XLA drops the unused operand).
    Forward mode is $\dot A B + A\dot B$, the second term this same primitive. Linear in
    $B$ only: a product whose left operand is itself a tangent has no transpose here (write
    `@` there). The operands are promoted to one dtype first, as `@` does.
    """
    dtype = result_dtype(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    return _product_p.bind(a, a.T, b)[0]


def _product_impl(a, a_t, b):
    return [a @ b]


def _product_abstract_eval(a, a_t, b):
    return [b.update(shape=(a.shape[0], b.shape[1]))]


def _product_jvp(primals, tangents):
    # Only A's own tangent enters: A^T is A, transposed (counting it too would count A twice).
    a, a_t, b = primals
    t_a, _, t_b = tangents
    (out,) = _product_p.bind(a, a_t, b)
    tangent = jnp.zeros_like(out)
    if type(t_b) is not ad.Zero:
        tangent = tangent + _product_p.bind(a, a_t, t_b)[0]
    if type(t_a) is not ad.Zero:
        tangent = tangent + t_a @ b
    return [out], [tangent]


def _product_transpose(cts, a, a_t, b):
    # Linear in B only (A's tangent enters through a plain product, transposed by JAX).
    if ad.is_undefined_primal(a) or ad.is_undefined_primal(a_t):
        raise NotImplementedError("energyattn's product is linear in its right operand only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, None, None]
    return [None, None, _product_p.bind(a_t, a, ct)[0]]


_product_p = create_vprim(
    "energyattn_product",
    _product_impl,
    _product_abstract_eval,
    _product_jvp,
    _product_transpose,
)
