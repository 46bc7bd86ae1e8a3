r"""Limited-memory BFGS (`LBFGS`), the default minimiser: a quasi-Newton direction,

$$d_k = -B_k^{-1}\nabla E(x_k),$$

$B_k^{-1}$ from the last `history` pairs of steps and gradient changes (the two-loop
recursion), taken by the line search of `_linesearch.py`.
"""

from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import positive_int, python_float
from ._iterate import AbstractProblem, Flat, MinimiseProblem
from ._linesearch import AbstractLineSearchSolver


class _Pairs(NamedTuple):
    y: Flat  # the previous iterate and its gradient
    grad: Flat
    s: Float[Array, "m n"]  # steps y_{k+1} - y_k
    t: Float[Array, "m n"]  # gradient changes g_{k+1} - g_k
    rho: Float[Array, " m"]  # 1 / (s . t)
    gamma: Float[Array, ""]  # scale of the initial inverse Hessian
    accepted: Int[Array, ""]  # pairs accepted so far (`count` would shadow tuple.count)


class LBFGS(AbstractLineSearchSolver):
    r"""Limited-memory BFGS with a backtracking Armijo line search: the default minimiser.

    The direction is $d_k = -B_k^{-1}\nabla E(x_k)$ with the L-BFGS inverse-Hessian
    approximation from the last `history` pairs $(s_i, t_i) = (x_{i+1} - x_i,\
    \nabla E_{i+1} - \nabla E_i)$ (two-loop recursion; Nocedal & Wright, Algorithm 7.4),
    initial scale $\gamma = s^\top t / t^\top t$ of the newest pair, or
    $\min(1, 1/\lVert\nabla E\rVert)$ before the first. Pairs with $s^\top t \le 0$ (negative
    curvature seen along the step) are skipped, so $B_k$ stays positive definite and $d_k$
    is a descent direction; the line search then only accepts points that decrease $E$, so
    the energy never increases. Stops when $\operatorname{rms}(d_k) \le \text{atol} +
    \text{rtol}\operatorname{rms}(x_k)$ (the quasi-Newton estimate of the distance to the
    minimum) and the point passes [`minimise`][energyattn.minimise]'s certificate, whose
    Newton step on the exact Hessian must be as small (a quasi-Newton model can be wrong
    far from the minimum: then the pairs are dropped and the search goes on). Needs only
    gradients and, once per convergence, Hessian-vector products: $O(mn)$ memory.

    (optax's `scale_by_lbfgs` computes the same direction but keeps pairs of negative
    curvature and is meant for its zoom line search, a `while_loop` that reverse mode
    cannot unroll; this one shares the package's line search.)

    **Arguments:**

    - `rtol`, `atol`: tolerances (`None`: `eps ** 0.6` of the dtype).
    - `history`: the number of pairs kept, $m \ge 1$.
    - `max_backtracks`, `armijo`: as in [`Newton`][energyattn.Newton].

    ??? cite "Source"

        D. C. Liu and J. Nocedal, *On the limited memory BFGS method for large scale
        optimization* (1989); J. Nocedal and S. J. Wright, *Numerical Optimization* (2006).
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    history: int = eqx.field(default=10, static=True)
    max_backtracks: int = eqx.field(default=40, static=True)
    armijo: float = eqx.field(default=1e-4, static=True)
    kinds: ClassVar[tuple[type[AbstractProblem], ...]] = (MinimiseProblem,)

    def __check_init__(self):
        for name in ("rtol", "atol"):
            if getattr(self, name) is not None:
                python_float(name, getattr(self, name), allow_zero=True)
        positive_int("history", self.history)
        positive_int("max_backtracks", self.max_backtracks, minimum=0)
        if not 0 < python_float("armijo", self.armijo) < 1:
            raise ValueError(f"armijo must be in (0, 1), got {self.armijo!r}")

    def init_memory(self, problem, y, args):
        m, n = self.history, y.shape[0]
        zeros = jnp.zeros((m, n), y.dtype)
        one = jnp.ones((), y.dtype)
        return _Pairs(y, y, zeros, zeros, jnp.zeros(m, y.dtype), one, jnp.zeros((), jnp.int32))

    def propose(self, problem, point, args, state, unrolled):
        m = self.history
        grad = problem.objective.gradient(point.y, args, point.aux)
        pairs = state.memory
        s, t = point.y - pairs.y, grad - pairs.grad
        st = jnp.dot(s, t)
        eps = jnp.finfo(grad.dtype).eps
        good = state.started & (st > eps * jnp.linalg.norm(s) * jnp.linalg.norm(t))
        slot = pairs.accepted % m
        keep = lambda new, old: jnp.where(good, new, old)  # noqa: E731
        pairs = _Pairs(
            y=point.y,
            grad=grad,
            s=keep(pairs.s.at[slot].set(s), pairs.s),
            t=keep(pairs.t.at[slot].set(t), pairs.t),
            rho=keep(pairs.rho.at[slot].set(1 / jnp.where(good, st, 1)), pairs.rho),
            gamma=keep(st / jnp.where(good, jnp.dot(t, t), 1), pairs.gamma),
            accepted=pairs.accepted + good.astype(jnp.int32),
        )
        first = jnp.minimum(1, 1 / jnp.maximum(jnp.linalg.norm(grad), eps))
        gamma = jnp.where(pairs.accepted > 0, pairs.gamma, first)
        used = jnp.minimum(pairs.accepted, m)
        # Two-loop recursion over the pairs, newest first (slots form a ring): one gather
        # puts them in order, and each loop is a scan, so the program does not grow with m.
        slots = jnp.arange(m, dtype=pairs.accepted.dtype)
        order = (pairs.accepted - 1 - slots) % m
        valid = slots < used
        s_new, t_new, rho_new = pairs.s[order], pairs.t[order], pairs.rho[order]

        def newest_first(q, pair):
            s_i, t_i, rho_i, valid_i = pair
            a = jnp.where(valid_i, rho_i * jnp.dot(s_i, q), 0)
            return q - a * t_i, a

        q, alphas = jax.lax.scan(newest_first, grad, (s_new, t_new, rho_new, valid))

        def oldest_first(r, pair):
            s_i, t_i, rho_i, valid_i, a = pair
            b = rho_i * jnp.dot(t_i, r)
            return r + jnp.where(valid_i, a - b, 0) * s_i, None

        pair = (s_new, t_new, rho_new, valid, alphas)
        r, _ = jax.lax.scan(oldest_first, gamma * q, pair, reverse=True)
        direction = -r
        slope = jnp.dot(grad, direction)
        # Round-off can still spoil the direction: fall back to scaled steepest descent.
        descent = slope < 0
        direction = jnp.where(descent, direction, -gamma * grad)
        slope = jnp.where(descent, slope, -gamma * jnp.dot(grad, grad))
        true = jnp.ones((), bool)
        return direction, slope, pairs, true, true

    def forget(self, memory):
        # The pairs described the way to a point that was not a minimum: start afresh.
        return memory._replace(accepted=jnp.zeros_like(memory.accepted))

    def postprocess(self, problem, y, args, state, result):
        stats = {"value": state.point.f, "backtracks": state.backtracks}
        return y, state.size, stats, {}
