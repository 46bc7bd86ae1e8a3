r"""Matrix-free Newton directions (Newton–Krylov), for problems too large for a dense Jacobian.

A dense Newton step builds the $n\times n$ Jacobian (or Hessian) from $n$ Jacobian-vector
products and factorises it: $O(n^2)$ memory and $O(n^3)$ time, out of reach for the state of
an attention layer ($n$ = tokens x width). These directions use only products with it:

- **roots** $F(y) = 0$: GMRES on $\partial_y F\, d = -F$ with Jacobian-vector products
  (`jax.linearize`, forward mode);
- **minima** of $E$: conjugate gradients on $\nabla^2 E\, d = -\nabla E$ with
  Hessian-vector products (forward over reverse), truncated at the first direction of
  non-positive curvature (then the step so far, or steepest descent), so every direction
  goes downhill. CG only sees the curvature along its own directions (a saddle whose
  gradient has no component along the negative curvature looks like a minimum to it):
  whether a point is a minimum is decided by a Lanczos probe from a fixed pseudo-random
  vector (`lanczos_curvature`), once, where a minimiser stops.

Each is an *inexact* Newton step: the Krylov solve stops at the relative residual
$\eta = \min(\tfrac12, \sqrt{\operatorname{rms}(r)})$, never below $\sqrt{\epsilon}$ (the
forcing term of S. C. Eisenstat and H. F. Walker, 1996), which keeps Newton's fast local
convergence. The solves run inside `jax.lax.custom_linear_solve`, so an unrolled
differentiation of the solver differentiates the step as an exact solve, not the Krylov
loop.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._linalg import eigh, solve_upper
from ._iterate import bounded_while, rms

Flat = Float[Array, " n"]


def gmres(matvec, b: Flat, *, tol: Any, atol: Any, restart: int, max_steps: int) -> Flat:
    r"""Restarted GMRES from $x = 0$: the $x$ in the Krylov space of $A$ = `matvec` and $b$
    with the smallest residual, refined cycle by cycle, until
    $\lVert b - Ax\rVert_2 \le \max(\text{tol}\,\lVert b\rVert_2, \text{atol})$ or
    `max_steps` products with $A$ (about: a cycle ends with one more for the true residual).

    Each cycle builds an orthonormal basis $V$ (Arnoldi, classical Gram-Schmidt applied
    twice, as dense products) and the Hessenberg matrix $H$ with $AV_k = V_{k+1}H_k$,
    reduced to triangular form by Givens rotations as it grows, so the residual of
    $\min_y\lVert\beta e_1 - H_k y\rVert$ is known at every step and the cycle stops as
    soon as it is small enough: no product is spent beyond the tolerance (JAX's
    `solve_method="batched"` always takes `restart`; its `"incremental"` one stops too, but
    its nested loops take longer to compile). No LAPACK call per step, which under `vmap`
    would be one call per example (the measurements are in benchmarks/README.md,
    "Spin-model transformer attention").

    ??? cite "Source"

        Y. Saad, M. H. Schultz, *GMRES: a generalized minimal residual algorithm for solving
        nonsymmetric linear systems* (1986).
    """
    n, dtype = b.shape[0], b.dtype
    m = min(restart, n)
    target = jnp.maximum(tol * jnp.linalg.norm(b), atol)

    rows = jnp.arange(m)[:, None]

    def cycle(x, residual, beta, steps):
        # m vectors: the (m+1)-th, made at a cycle's last step, only gives its norm to H.
        basis = jnp.zeros((m, n), dtype).at[0].set(residual / jnp.where(beta > 0, beta, 1))
        R = jnp.eye(m, dtype=dtype)  # the triangular factor (unused columns: identity)
        # The product of the Givens rotations so far, as a matrix: a new column of H is
        # rotated by one product with it, not by a loop over the earlier rotations, and the
        # rotated right-hand side is beta Q e1.
        Q = jnp.eye(m + 1, dtype=dtype)

        def cond(carry):
            k, _, _, Q, steps = carry  # |beta Q[k, 0]|: the residual after k steps
            return (k < m) & (jnp.abs(beta * Q[k, 0]) > target) & (steps < max_steps)

        def body(carry):
            k, basis, R, Q, steps = carry
            w = matvec(basis[k])
            h = basis @ w  # rows above k are zero, so are their coefficients
            w = w - basis.T @ h
            again = basis @ w
            w, h = w - basis.T @ again, h + again
            size = jnp.linalg.norm(w)
            # An elementwise write of row k + 1 (not a scatter at a traced index; none at the
            # last step): under vmap XLA fuses it with the batched loop's select and updates
            # the basis in place, where a scatter and the select each need a basis of their own.
            basis = jnp.where(rows == k + 1, (w / jnp.where(size > 0, size, 1))[None], basis)
            column = Q @ jnp.concatenate([h, jnp.zeros((1,), dtype)]).at[k + 1].set(size)
            # The rotation that zeroes the column below its diagonal, and the residual.
            a, c = column[k], column[k + 1]
            radius = jnp.hypot(a, c)
            safe = jnp.where(radius > 0, radius, 1)
            ck, sk = jnp.where(radius > 0, a / safe, 1), jnp.where(radius > 0, -c / safe, 0)
            R = R.at[:, k].set(column[:m].at[k].set(radius))
            Qk, Qk1 = Q[k], Q[k + 1]
            Q = Q.at[k].set(ck * Qk - sk * Qk1).at[k + 1].set(sk * Qk + ck * Qk1)
            return k + 1, basis, R, Q, steps + 1

        k, basis, R, Q, steps = jax.lax.while_loop(cond, body, (0, basis, R, Q, steps))
        g = beta * Q[:m, 0]
        y = solve_upper(R, jnp.where(jnp.arange(m) < k, g, 0))  # looped under vmap on CPU
        return x + basis.T @ y, steps

    def outer_cond(carry):
        _, _, beta, steps = carry
        return (beta > target) & (steps < max_steps)

    def outer_body(carry):
        x, residual, beta, steps = carry
        x, steps = cycle(x, residual, beta, steps)
        residual = b - matvec(x)  # the true residual: the estimate drifts in floating point
        return x, residual, jnp.linalg.norm(residual), steps + 1

    init = (jnp.zeros_like(b), b, jnp.linalg.norm(b), 0)
    x, *_ = jax.lax.while_loop(outer_cond, outer_body, init)
    return x


def forcing(residual: Flat) -> Float[Array, ""]:
    """The relative tolerance of one inexact Newton step."""
    floor = float(jnp.finfo(residual.dtype).eps) ** 0.5
    return jnp.clip(jnp.sqrt(rms(residual)), floor, 0.5)


def safe_norm(x: Flat) -> Float[Array, ""]:
    """The 2-norm of `x`, taken through its largest entry so that squares do not underflow."""
    peak = jnp.max(jnp.abs(x))
    safe = jnp.where(peak > 0, peak, 1)
    return jnp.where(peak > 0, safe * jnp.linalg.norm(x / safe), 0)


def root_direction(
    residual_fn, y: Flat, residual: Flat, max_steps: int
) -> tuple[Flat, Float[Array, ""], Bool[Array, ""]]:
    r"""`(direction, slope, solved)`: GMRES on $J d = -F$ ($J = \partial_y F$ at `y`, by
    Jacobian-vector products), or, when that is not a descent direction of
    $\tfrac12\lVert F\rVert^2$, its steepest descent $-J^\top F$. `slope` is
    $F^\top J d$; `solved`: GMRES met its tolerance and the step is Newton's."""
    _, jvp = jax.linearize(residual_fn, y)
    eta = forcing(residual)

    restart = min(20, y.shape[0], max_steps)

    def solve(matvec, b):
        return gmres(matvec, b, tol=eta, atol=0.0, restart=restart, max_steps=max_steps)

    # Solved for a unit right-hand side and scaled back, so that a residual near round-off
    # (1e-17) meets a relative tolerance, not a breakdown threshold (JAX's GMRES, used here
    # before, had absolute ones).
    # The operator is scaled as well, by its size along the right-hand side: GMRES's norms
    # square their vectors, which underflow for |F| or |J| ~ 1e-22 in float32, and a zero
    # norm is a zero step, taken for convergence.
    norm = safe_norm(residual)
    zero = norm == 0
    unit = residual / jnp.where(zero, 1, norm)
    scale = safe_norm(jvp(unit))
    scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1)
    scaled = lambda v: jvp(v) / scale  # noqa: E731
    direction = norm / scale * jax.lax.custom_linear_solve(scaled, -unit, solve, solve)
    image = jvp(direction)
    slope = jnp.dot(residual, image)
    # Measured on F's unit scale (the slope itself may underflow).
    unit_image = image / jnp.where(zero, 1, norm)
    ok = jnp.all(jnp.isfinite(direction)) & (jnp.dot(unit, unit_image) < 0)
    solved = ok & (rms(unit_image + unit) <= eta * rms(unit))
    # Not a descent direction (a singular or ill-conditioned Jacobian): steepest descent.
    (steepest,) = jax.linear_transpose(jvp, y)(residual)
    steepest = -steepest
    direction = jnp.where(ok, direction, steepest)
    slope = jnp.where(ok, slope, -jnp.sum(jnp.square(steepest)))
    return direction, slope, solved


def truncated_cg(
    matvec, b: Flat, eta: Any, max_steps: int, unrolled: bool
) -> tuple[Flat, tuple[Bool[Array, ""], Bool[Array, ""]]]:
    r"""Conjugate gradients on $A x = b$ from $x = 0$ to $\lVert b - Ax\rVert \le
    \eta\lVert b\rVert$, stopped at the first direction of non-positive curvature (then the
    step so far, or $b$ itself at the first): `(x, (curved, met))`, `curved` when no such
    direction was met, `met` when the tolerance was."""
    target = eta * jnp.linalg.norm(b)

    def cond(carry):
        k, _, _, _, rr, stop, _ = carry
        return ~stop & (k < max_steps) & (jnp.sqrt(rr) > target)

    def body(carry):
        k, x, r, p, rr, _, curved = carry
        hp = matvec(p)
        curvature = jnp.dot(p, hp)
        bent = curvature <= 0
        alpha = rr / jnp.where(bent, 1, curvature)
        x_next = x + alpha * p
        r_next = r - alpha * hp
        rr_next = jnp.dot(r_next, r_next)
        p_next = r_next + rr_next / jnp.where(rr == 0, 1, rr) * p
        # Non-positive curvature: keep the step so far (or steepest descent at first).
        x_next = jnp.where(bent, jnp.where(k == 0, b, x), x_next)
        keep = lambda new, old: jnp.where(bent, old, new)  # noqa: E731
        return (
            k + 1,
            x_next,
            keep(r_next, r),
            keep(p_next, p),
            keep(rr_next, rr),
            bent,
            curved & ~bent,
        )

    zero = jnp.zeros_like(b)
    init = (0, zero, b, b, jnp.dot(b, b), jnp.zeros((), bool), jnp.ones((), bool))
    _, x, r, _, _, _, curved = bounded_while(cond, body, init, max_steps, unrolled)
    met = jnp.linalg.norm(r) <= target
    return x, (curved, met)


def minimum_direction(
    hvp,
    grad: Flat,
    max_steps: int,
    unrolled: bool,
    eta: Float[Array, ""] | None = None,
) -> tuple[Flat, Bool[Array, ""], Bool[Array, ""]]:
    r"""`(direction, positive, solved)`: conjugate gradients on $H d = -\nabla E$ (`hvp`:
    $v \mapsto Hv$ with the Hessian at the point) to the relative residual `eta` (default:
    the forcing term), stopped at the first direction $p$ with $p^\top H p \le 0$
    (truncated CG): the step so far, or $-\nabla E$ if that was the first. `positive`: no
    non-positive curvature met along the Krylov directions; `solved`: CG met its tolerance
    without meeting any. CG sees the curvature only along its own directions: whether a
    point is a minimum is decided once, where a minimiser stops (`lanczos_curvature`)."""
    eta = forcing(grad) if eta is None else eta

    def solve(matvec, b):
        return truncated_cg(matvec, b, eta, max_steps, unrolled)

    direction, (positive, met) = jax.lax.custom_linear_solve(
        hvp, -grad, solve, symmetric=True, has_aux=True
    )
    # A truncated step is not Newton's (not solved).
    return direction, positive, positive & met


#: Lanczos steps of the curvature probe (at most the number of unknowns).
PROBE_STEPS = 16


def probe_vector(n: int, dtype: Any) -> Flat:
    """A fixed pseudo-random vector of unit rms: the start of every curvature probe and the
    direction of the energy probe (fixed, so that a solve is reproducible)."""
    return jax.random.normal(jax.random.key(0), (n,), dtype)


def lanczos_curvature(
    hvp, start: Flat, unrolled: bool
) -> tuple[Float[Array, ""], Float[Array, ""], Flat]:
    r"""`(lowest, largest, vector)`: the extreme Ritz values of the Hessian after a few Lanczos
    steps (full reorthogonalisation) from `start`, and the unit Ritz vector of the lowest.
    Extreme eigenvalues are the first that Lanczos finds; a negative one is seen from any
    start with a component along its eigenvector (a random start has one)."""
    n, dtype = start.shape[0], start.dtype
    m = min(n, PROBE_STEPS)
    start = start / jnp.linalg.norm(start)
    basis = jnp.zeros((m, n), dtype).at[0].set(start)
    zeros = jnp.zeros((m,), dtype)

    def cond(carry):
        j, *_, broke = carry
        return (j < m) & ~broke

    def body(carry):
        j, basis, alphas, betas, _ = carry
        w = hvp(basis[j])
        alpha = jnp.dot(w, basis[j])
        # Against every earlier vector (twice: Gram-Schmidt in finite precision).
        for _ in range(2):
            w = w - basis.T @ (basis @ w)
        beta = jnp.linalg.norm(w)
        broke = beta <= jnp.finfo(dtype).eps * (jnp.abs(alpha) + 1)
        nxt = jnp.minimum(j + 1, m - 1)
        basis = jnp.where(
            (j + 1 < m) & ~broke, basis.at[nxt].set(w / jnp.where(broke, 1, beta)), basis
        )
        return j + 1, basis, alphas.at[j].set(alpha), betas.at[j].set(beta), broke

    init = (0, basis, zeros, zeros, jnp.zeros((), bool))
    steps, basis, alphas, betas, _ = bounded_while(cond, body, init, m, unrolled)
    # The tridiagonal matrix of the steps taken (unused rows padded far above the rest).
    used = jnp.arange(m) < steps
    top = jnp.max(jnp.abs(alphas)) + 2 * jnp.max(betas) + 1
    tri = jnp.diag(jnp.where(used, alphas, 4 * top))
    off = jnp.where(jnp.arange(m - 1) + 1 < steps, betas[:-1], 0)
    tri = tri + jnp.diag(off, 1) + jnp.diag(off, -1)
    ritz, vectors = eigh(tri)  # looped under vmap on CPU
    largest = jnp.max(jnp.where(used, ritz, -jnp.inf))
    vector = basis.T @ jnp.where(used, vectors[:, 0], 0)
    vector = vector / jnp.maximum(jnp.linalg.norm(vector), jnp.finfo(dtype).tiny)
    return ritz[0], largest, vector
