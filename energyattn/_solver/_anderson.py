r"""Anderson acceleration (`Anderson`), on the fixed-point loop of `_fixed_point_solver.py`: the
affine combination of the last $m$ iterates with the smallest (regularised) residual,

$$\alpha = \arg\min_{\mathbf 1^\top\alpha = 1} \lVert G^\top\alpha\rVert^2
+ \lambda \sum_i \lVert g_i\rVert^2 \alpha_i^2,\qquad
z_{k+1} = \sum_i \alpha_i z_i + \beta \sum_i \alpha_i g_i.$$
"""

from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import positive_int, python_float
from ._fixed_point_solver import AbstractFixedPointSolver, check_tolerances


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
        check_tolerances(self)
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
        index = jnp.arange(m, dtype=pushed.dtype)
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
