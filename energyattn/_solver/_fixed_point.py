r"""Fixed points $z^* = f(z^*, \theta)$: Picard and Anderson iteration, three adjoints.

One loop body serves every solver and adjoint. Each iteration evaluates the map once at the
current iterate $z_k$, measures the residual $g_k = f(z_k) - z_k$, and stops when

$$\lVert g_k \rVert \le \text{atol} + \text{rtol}\,\lVert f(z_k) \rVert ,$$

with $\lVert\cdot\rVert$ the root-mean-square norm over all entries of the state (so the
tolerances do not depend on its size). Otherwise the solver proposes $z_{k+1}$ from the
iterates and map values it has seen. The loop remembers the iterate with the smallest residual
and returns the map's value there, $f(z_{\text{best}})$ (one application closer to the fixed
point than $z_{\text{best}}$ for a contraction, and already computed).

How derivatives flow is the adjoint's choice:

- `ImplicitAdjoint`: the implicit function theorem. For a cotangent $\bar z$ of the output,
  solve the linear fixed point $u = \bar z + (\partial_z f)^\top u$ at $z^*$ (the same family of
  solvers, or GMRES on $(I - \partial_z f^\top)\,u = \bar z$), then $\bar\theta =
  (\partial_\theta f)^\top u$. Memory does not grow with the number of forward iterations.
- `UnrolledAdjoint`: backpropagate through the iterations (a `lax.scan` of `max_steps` steps,
  frozen once converged): exact for the truncated iteration, memory grows with `max_steps`.
- `PhantomAdjoint`: solve without derivatives, then take `num_steps` damped steps
  $z \leftarrow z + \lambda (f(z) - z)$ from $z^*$ (held constant) with derivatives. One step of
  size 1 is Jacobian-free backpropagation: $\bar\theta = (\partial_\theta f)^\top \bar z$.

A `while_loop` runs per example under `vmap`: finished examples are left untouched while the
others iterate, so results and step counts do not depend on what else is in the batch.
"""

import abc
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Float, PyTree

from .._checks import check_positive, concrete_value, positive_int
from .._custom_types import State
from ._descend import check_energy_output, check_state
from ._solution import RESULTS, Solution, finish

Flat = Float[Array, " n"]


def _rms(x: Flat) -> Float[Array, ""]:
    return jnp.sqrt(jnp.mean(jnp.square(x)))


def _python_float(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """A tolerance or constant fixed at trace time, as a Python float."""
    concrete = concrete_value(value)
    if concrete is None or np.ndim(concrete) != 0:
        raise ValueError(
            f"{name} must be a Python float (it is fixed at trace time), got {value!r}"
        )
    ok = concrete >= 0 if allow_zero else concrete > 0
    if not (np.isfinite(concrete) and ok):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(concrete)


# --------------------------------------------------------------------------------------------
# Solvers


class AbstractFixedPointSolver(eqx.Module):
    """A rule proposing the next iterate from the current one and the map's value there.

    Subclasses implement `init(z)` (the solver's memory) and `step(memory, z, fz)`, which
    returns `(z_next, memory)`. Both see flat vectors. `step` must be differentiable if the
    solver is used with [`UnrolledAdjoint`][energyattn.UnrolledAdjoint].
    """

    @abc.abstractmethod
    def init(self, z: Flat) -> PyTree[Array]:
        """The solver's memory before the first iteration."""

    @abc.abstractmethod
    def step(self, memory: PyTree[Array], z: Flat, fz: Flat) -> tuple[Flat, PyTree[Array]]:
        """The next iterate from $z_k$ and $f(z_k)$, and the updated memory."""


class Picard(AbstractFixedPointSolver):
    r"""Damped Picard (fixed-point) iteration, $z_{k+1} = z_k + \lambda\,(f(z_k) - z_k)$.

    Converges linearly, at the rate of the spectral radius of $(1-\lambda) I + \lambda
    \partial_z f$, when that is below 1. $\lambda = 1$ is plain iteration of the map.

    **Arguments:**

    - `damping`: $\lambda \in (0, 1]$.
    """

    damping: float = 1.0

    def __check_init__(self):
        damping = _python_float("damping", self.damping)
        if damping > 1:
            raise ValueError(f"damping must be in (0, 1], got {self.damping!r}")

    def init(self, z: Flat) -> PyTree[Array]:
        return None

    def step(self, memory: PyTree[Array], z: Flat, fz: Flat) -> tuple[Flat, PyTree[Array]]:
        return z + self.damping * (fz - z), memory


class Anderson(AbstractFixedPointSolver):
    r"""Anderson acceleration (Anderson mixing) with a history of $m$ iterates.

    With the last $m_k = \min(k+1, m)$ iterates $z_i$, map values $f_i = f(z_i)$ and residuals
    $g_i = f_i - z_i$ as the rows of $G$, it finds the affine combination with the smallest
    residual,

    $$\alpha = \arg\min_{\mathbf 1^\top\alpha = 1} \lVert G^\top\alpha\rVert^2 + r\lVert\alpha
    \rVert^2, \qquad r = \lambda\,\tfrac{1}{m_k}\operatorname{tr}(G G^\top),$$

    i.e. $\alpha \propto (GG^\top + rI)^{-1}\mathbf 1$, and mixes
    $z_{k+1} = \beta \sum_i \alpha_i f_i + (1-\beta) \sum_i \alpha_i z_i$. The ridge $r$ is
    scaled to the residual Gram matrix, so the regularisation means the same thing at every
    scale of the residual (an absolute ridge would dominate near convergence and stall it).
    The first step ($m_k = 1$) is a damped Picard step.

    **Arguments:**

    - `history`: $m \ge 1$, the number of past iterates used.
    - `ridge`: $\lambda > 0$, relative Tikhonov regularisation of the least-squares problem.
    - `mixing`: $\beta \in (0, 1]$.

    ??? cite "Source"

        D. G. Anderson, *Iterative procedures for nonlinear integral equations* (1965);
        H. F. Walker and P. Ni, *Anderson acceleration for fixed-point iterations* (2011).
        M. Bal, *Deep Implicit Attention* (2021) solves its mean-field equations this way.
    """

    history: int = eqx.field(default=5, static=True)
    ridge: float = 1e-4
    mixing: float = 1.0

    def __check_init__(self):
        positive_int("history", self.history)
        _python_float("ridge", self.ridge)
        if _python_float("mixing", self.mixing) > 1:
            raise ValueError(f"mixing must be in (0, 1], got {self.mixing!r}")

    def init(self, z: Flat) -> PyTree[Array]:
        m = self.history
        zeros = jnp.zeros((m, z.shape[0]), z.dtype)
        return zeros, zeros, jnp.zeros((), jnp.int32)

    def step(self, memory: PyTree[Array], z: Flat, fz: Flat) -> tuple[Flat, PyTree[Array]]:
        zs, fs, count = memory
        m = self.history
        slot = count % m
        zs = zs.at[slot].set(z)
        fs = fs.at[slot].set(fz)
        count = count + 1
        valid = jnp.arange(m) < count
        gs = jnp.where(valid[:, None], fs - zs, 0)
        gram = gs @ gs.T
        used = jnp.minimum(count, m).astype(z.dtype)
        tiny = jnp.finfo(z.dtype).tiny
        ridge = jnp.maximum(self.ridge * jnp.trace(gram) / used, tiny)
        # Unused slots have zero rows and columns, so their equation reads ridge * w_i = 0.
        weights = jnp.linalg.solve(gram + ridge * jnp.eye(m, dtype=z.dtype), valid.astype(z.dtype))
        alpha = weights / jnp.sum(weights)
        z_next = self.mixing * (alpha @ fs) + (1 - self.mixing) * (alpha @ zs)
        return z_next, (zs, fs, count)


# --------------------------------------------------------------------------------------------
# The loop


class _Options(eqx.Module):
    max_steps: int = eqx.field(static=True)
    rtol: float = eqx.field(static=True)
    atol: float = eqx.field(static=True)
    divergence: float | None = eqx.field(static=True)


def _iterate(
    fn: Callable[[Flat, Any], Flat],
    z0: Flat,
    args: Any,
    solver: AbstractFixedPointSolver,
    options: _Options,
    *,
    unrolled: bool = False,
) -> Solution:
    """Run `solver` on `fn` from `z0`: a `while_loop`, or a `scan` when `unrolled`."""
    dtype = z0.dtype
    inf = jnp.array(jnp.inf, dtype)

    def body(carry):
        z, memory, k, z_best, fz_best, res_best, result, running = carry
        fz = fn(z, args)
        res = _rms(fz - z)
        finite = jnp.isfinite(res)
        better = finite & (res < res_best)
        z_best = jnp.where(better, z, z_best)
        fz_best = jnp.where(better, fz, fz_best)
        diverged = jnp.zeros((), bool)
        if options.divergence is not None:
            diverged = finite & (res > options.divergence * res_best)
        res_best = jnp.where(better, res, res_best)
        converged = finite & (res <= options.atol + options.rtol * _rms(fz))
        k = k + 1
        where = RESULTS.where
        result = where(
            ~finite,
            RESULTS.nonfinite,
            where(
                diverged,
                RESULTS.diverged,
                where(~converged & (k >= options.max_steps), RESULTS.max_steps_reached, result),
            ),
        )
        z_next, memory = solver.step(memory, z, fz)
        running = (result == RESULTS.successful) & ~converged
        return z_next, memory, k, z_best, fz_best, res_best, result, running

    ok = RESULTS.where(True, RESULTS.successful, RESULTS.successful)
    init = (
        z0,
        solver.init(z0),
        jnp.zeros((), jnp.int32),
        z0,
        z0,
        inf,
        ok,
        jnp.array(options.max_steps > 0),
    )
    if unrolled:
        # A fixed number of steps that reverse mode can differentiate; a finished example
        # keeps its carry (the `where`), so the unrolled result equals the while loop's.
        def scan_body(carry, _):
            new = body(carry)
            running = carry[-1]
            kept = jax.tree.map(lambda a, b: jnp.where(running, a, b), new, carry)
            return kept, None

        final, _ = jax.lax.scan(scan_body, init, None, length=options.max_steps)
    else:
        final = jax.lax.while_loop(lambda carry: carry[-1], body, init)
    _, _, k, _, fz_best, res_best, result, _ = final
    if options.max_steps == 0:
        result = RESULTS.where(True, RESULTS.max_steps_reached, RESULTS.max_steps_reached)
    return Solution(value=fz_best, result=result, num_steps=k, residual=res_best)


# --------------------------------------------------------------------------------------------
# Adjoints


def _no_grad(tree: Any) -> Any:
    """`stop_gradient` on every floating-point array of a pytree (other leaves kept)."""
    return jax.tree.map(lambda x: jax.lax.stop_gradient(x) if eqx.is_inexact_array(x) else x, tree)


class AbstractAdjoint(eqx.Module):
    """How derivatives flow through a fixed-point solve (see `ea.fixed_point`)."""

    @abc.abstractmethod
    def solve(
        self,
        fn: Callable[[Flat, Any], Flat],
        z0: Flat,
        args: Any,
        solver: AbstractFixedPointSolver,
        options: _Options,
        throw: bool,
    ) -> Solution:
        """Solve, with this adjoint's derivative rule attached to `Solution.value`."""


class UnrolledAdjoint(AbstractAdjoint):
    """Differentiate through every iteration of the solver (backpropagation through time).

    The loop becomes a `lax.scan` of exactly `max_steps` steps (finished examples are frozen),
    so the backward pass stores every iterate: memory and time grow linearly with `max_steps`.
    The gradient is that of the truncated iteration, which equals the implicit gradient only
    once the iteration has converged.
    """

    def solve(self, fn, z0, args, solver, options, throw):
        return _iterate(fn, z0, args, solver, options, unrolled=True)


class PhantomAdjoint(AbstractAdjoint):
    r"""Solve without derivatives, then differentiate a few damped steps taken from $z^*$.

    $$z_0 = \operatorname{stop\_gradient}(z^*),\qquad z_{j+1} = z_j + \lambda\,(f(z_j) - z_j),
    \quad j < k ,$$

    and the output is $z_k$. With $k = 1$, $\lambda = 1$ this is Jacobian-free backpropagation:
    the gradient $(\partial_\theta f)^\top\bar z$ skips the inverse $(I - \partial_z f)^{-\top}$,
    a cheap preconditioned descent direction rather than the true gradient. Larger $k$ and
    smaller $\lambda$ approach the implicit gradient (a truncated Neumann series).

    **Arguments:**

    - `num_steps`: $k \ge 1$.
    - `damping`: $\lambda \in (0, 1]$.

    ??? cite "Source"

        S. W. Fung et al., *JFB: Jacobian-free backpropagation for implicit networks* (2022);
        Z. Geng et al., *On training implicit models* (phantom gradients, 2021).
    """

    num_steps: int = eqx.field(default=1, static=True)
    damping: float = 1.0

    def __check_init__(self):
        positive_int("num_steps", self.num_steps)
        if _python_float("damping", self.damping) > 1:
            raise ValueError(f"damping must be in (0, 1], got {self.damping!r}")

    def solve(self, fn, z0, args, solver, options, throw):
        # The while loop cannot be reverse-differentiated: no derivative may reach it.
        solution = _iterate(_no_grad(fn), _no_grad(z0), _no_grad(args), solver, options)
        z = jax.lax.stop_gradient(solution.value)
        for _ in range(self.num_steps):
            z = z + self.damping * (fn(z, args) - z)
        return eqx.tree_at(lambda s: s.value, solution, z)


class ImplicitAdjoint(AbstractAdjoint):
    r"""Implicit differentiation: the backward pass solves a linear fixed point at $z^*$.

    $$u = \bar z + (\partial_z f)^\top u, \qquad \bar\theta = (\partial_\theta f)^\top u ,$$

    the implicit function theorem for $z^* = f(z^*, \theta)$. Memory is independent of the
    number of forward iterations. The backward solve converges whenever the forward
    iteration is locally contractive (same spectrum).

    **Arguments:**

    - `solver`: `None` (default) reuses the forward solver on the linear fixed point;
      another [`Picard`][energyattn.Picard] / [`Anderson`][energyattn.Anderson]; or `"gmres"`
      for a Krylov solve (`jax.scipy.sparse.linalg.gmres`) of $(I - \partial_z f^\top)u =
      \bar z$.
    - `max_steps`, `rtol`, `atol`: the backward solve's limits; `None` reuses the forward
      ones. With `throw=True` in `fixed_point`, a backward solve that does not converge raises.

    Reverse mode only (it is a `custom_vjp`); differentiating the backward pass again
    (grad-of-grad) is not supported.
    """

    solver: AbstractFixedPointSolver | Literal["gmres"] | None = None
    max_steps: int | None = eqx.field(default=None, static=True)
    rtol: float | None = None
    atol: float | None = None

    def __check_init__(self):
        if not (
            self.solver is None
            or self.solver == "gmres"
            or isinstance(self.solver, AbstractFixedPointSolver)
        ):
            raise ValueError(
                "ImplicitAdjoint(solver=...) must be None, 'gmres' or a fixed-point solver "
                f"such as ea.Anderson(), got {self.solver!r}"
            )
        if self.max_steps is not None:
            positive_int("max_steps", self.max_steps)
        for name in ("rtol", "atol"):
            if getattr(self, name) is not None:
                _python_float(name, getattr(self, name), allow_zero=True)

    def solve(self, fn, z0, args, solver, options, throw):
        backward = _Options(
            max_steps=options.max_steps if self.max_steps is None else self.max_steps,
            rtol=options.rtol if self.rtol is None else float(self.rtol),
            atol=options.atol if self.atol is None else float(self.atol),
            divergence=options.divergence,
        )
        back_solver = solver if self.solver is None else self.solver
        value, solution = _implicit_solve(
            (fn, args), z0, solver, options, back_solver, backward, throw
        )
        # Only the value carries derivatives; the integer codes must not carry tangents (the
        # runtime check in `finish` cannot be differentiated).
        solution = jax.tree.map(jax.lax.stop_gradient, solution)
        return eqx.tree_at(lambda s: s.value, solution, value)


@eqx.filter_custom_vjp
def _implicit_solve(fn_args, z0, solver, options, back_solver, backward, throw):
    fn, args = fn_args
    solution = _iterate(fn, z0, args, solver, options)
    return solution.value, solution


@_implicit_solve.def_fwd
def _implicit_solve_fwd(perturbed, fn_args, z0, solver, options, back_solver, backward, throw):
    value, solution = _implicit_solve(fn_args, z0, solver, options, back_solver, backward, throw)
    return (value, solution), value


def _linear_solve(transpose, cotangent, back_solver, backward, throw):
    """Solve $u = \\bar z + A^\\top u$ with `transpose(u)` $= A^\\top u$."""
    if back_solver == "gmres":
        # GMRES stops on the 2-norm, ||r|| <= max(tol ||b||, atol); in rms terms that is
        # rms(r) <= max(rtol rms(b), atol) with atol scaled by sqrt(n). `maxiter` counts
        # restarts, so the matrix-vector products stay within about `max_steps`.
        n = cotangent.shape[0]
        restart = min(20, n)
        u, _ = jax.scipy.sparse.linalg.gmres(
            lambda v: v - transpose(v),
            cotangent,
            tol=backward.rtol,
            atol=backward.atol * float(np.sqrt(n)),
            restart=restart,
            maxiter=max(1, -(-backward.max_steps // restart)),
            solve_method="batched",
        )
        res = _rms(u - transpose(u) - cotangent)
        # The recomputed residual may exceed GMRES's running estimate by round-off.
        ok = res <= 2 * (backward.atol + backward.rtol * _rms(cotangent))
        result = RESULTS.where(ok, RESULTS.successful, RESULTS.max_steps_reached)
        solution = Solution(
            value=u, result=result, num_steps=jnp.zeros((), jnp.int32), residual=res
        )
    else:
        solution = _iterate(
            lambda v, _: cotangent + transpose(v), cotangent, None, back_solver, backward
        )
    if throw:
        return solution.result.error_if(solution.value, solution.result != RESULTS.successful)
    return solution.value


@_implicit_solve.def_bwd
def _implicit_solve_bwd(
    z_star, grad_obj, perturbed, fn_args, z0, solver, options, back_solver, backward, throw
):
    cotangent, _ = grad_obj
    fn, args = fn_args
    if cotangent is None:
        return jax.tree.map(lambda _: None, fn_args)
    _, vjp_z = jax.vjp(lambda z: fn(z, args), z_star)
    u = _linear_solve(lambda v: vjp_z(v)[0], cotangent, back_solver, backward, throw)
    _, vjp_theta = eqx.filter_vjp(lambda fa: fa[0](z_star, fa[1]), fn_args)
    (grads,) = vjp_theta(u)
    return grads


# --------------------------------------------------------------------------------------------
# Public entry points


def _flatten_map(fn: Callable, z0: State, args: Any) -> tuple[Callable, Flat, Callable]:
    """`fn` on flat vectors (closed-over arrays become pytree leaves), and how to unflatten."""
    flat0, unravel = ravel_pytree(z0)
    out = jax.eval_shape(fn, z0, args)
    want = jax.eval_shape(lambda z: z, z0)
    same = jax.tree.structure(out) == jax.tree.structure(want) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True)
    )
    if not same:
        raise ValueError(
            "fn(z, args) must return the same structure and shapes as z0: got "
            f"{jax.tree.map(lambda s: s.shape, out)} for z0 of "
            f"{jax.tree.map(lambda s: s.shape, want)}"
        )

    def flat_fn(z, args):
        out = fn(unravel(z), args)
        return ravel_pytree(out)[0].astype(z.dtype)

    return eqx.filter_closure_convert(flat_fn, flat0, args), flat0, unravel


def fixed_point(
    fn: Callable[[State, Any], State],
    z0: State,
    args: Any = None,
    *,
    solver: AbstractFixedPointSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = 100,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    divergence: float | None = 1e4,
    throw: bool = True,
) -> Solution:
    r"""Solve $z^* = f(z^*, \text{args})$ by iteration, differentiably.

    Each iteration evaluates `fn` once and stops when

    $$\operatorname{rms}(f(z_k) - z_k) \le \text{atol} + \text{rtol}\cdot\operatorname{rms}
    (f(z_k)).$$

    Derivatives with respect to `args` and to any arrays `fn` closes over (e.g. the
    parameters of an Equinox module) follow the `adjoint`; the result does not depend on
    `z0`, which gets no gradient except through `UnrolledAdjoint`.

    **Arguments:**

    - `fn`: the map, `fn(z, args)`, returning the structure and shapes of `z`.
    - `z0`: the initial iterate, a floating-point array or pytree of arrays.
    - `args`: passed to `fn` unchanged.
    - `solver`: [`Anderson`][energyattn.Anderson] (default) or [`Picard`][energyattn.Picard].
    - `adjoint`: [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] (default),
      [`UnrolledAdjoint`][energyattn.UnrolledAdjoint] or
      [`PhantomAdjoint`][energyattn.PhantomAdjoint].
    - `max_steps`: the most evaluations of `fn`.
    - `rtol`, `atol`: the stopping tolerances above.
    - `divergence`: stop with `RESULTS.diverged` when the residual exceeds this factor times
      the smallest residual seen (a map that is not a contraction, e.g. couplings with
      spectral radius above 1 under Picard); `None` never stops for this reason.
    - `throw`: raise (at run time) unless the solve succeeded; with `False` inspect
      `Solution.result`.

    **Returns:**

    A [`Solution`][energyattn.Solution]: `value` is $f(z_b)$ at the iterate $z_b$ with the
    smallest residual, `residual` that residual (rms), `num_steps` the evaluations of `fn`.
    Non-convergence is `RESULTS.max_steps_reached`, a NaN/inf iterate `RESULTS.nonfinite`.

    ??? cite "Source"

        S. Bai, J. Z. Kolter, V. Koltun, *Deep Equilibrium Models* (2019); M. Bal, *Deep
        Implicit Attention: A Mean-Field Theory Perspective on Attention Mechanisms* (2021).
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    solver = Anderson() if solver is None else solver
    adjoint = ImplicitAdjoint() if adjoint is None else adjoint
    if not isinstance(solver, AbstractFixedPointSolver):
        raise ValueError(f"solver must be ea.Picard(...) or ea.Anderson(...), got {solver!r}")
    if not isinstance(adjoint, AbstractAdjoint):
        raise ValueError(
            "adjoint must be ea.ImplicitAdjoint(), ea.UnrolledAdjoint() or "
            f"ea.PhantomAdjoint(), got {adjoint!r}"
        )
    options = _Options(
        max_steps=positive_int("max_steps", max_steps, minimum=0),
        rtol=_python_float("rtol", rtol, allow_zero=True),
        atol=_python_float("atol", atol, allow_zero=True),
        divergence=None if divergence is None else _python_float("divergence", divergence),
    )
    if options.divergence is not None and options.divergence <= 1:
        raise ValueError(f"divergence must be > 1 (a growth factor), got {divergence!r}")
    z0 = check_state(z0)
    flat_fn, flat0, unravel = _flatten_map(fn, z0, args)
    solution = adjoint.solve(flat_fn, flat0, args, solver, options, bool(throw))
    solution = eqx.tree_at(lambda s: s.value, solution, unravel(solution.value))
    return finish(solution, bool(throw))


def minimise(
    energy: Callable[[State, Any], Float[Array, ""]],
    x0: State,
    args: Any = None,
    *,
    step_size: float = 0.1,
    solver: AbstractFixedPointSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = 200,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    throw: bool = True,
) -> Solution:
    r"""Minimise an energy to stationarity, $\nabla_x E(x^*, \text{args}) = 0$, differentiably.

    The stationary point is the fixed point of a gradient step,

    $$x^* = x^* - \alpha\,\nabla_x E(x^*, \text{args}),$$

    solved by [`fixed_point`][energyattn.fixed_point] (Anderson-accelerated gradient descent by
    default; [`Picard`][energyattn.Picard] is plain gradient descent). With the implicit
    adjoint the backward pass solves $\nabla_x^2 E\, u = \bar x$ (the implicit function
    theorem at $\nabla E = 0$), so an attention layer defined as the minimiser of an energy
    costs one solve to differentiate, however many steps the minimisation took. The
    stopping rule is `fixed_point`'s, on the step $\alpha\nabla E$.

    Anderson finds stationary points, not necessarily minima: for an energy with saddles use
    `Picard` (gradient descent) or check `stats["energy"]`.

    **Arguments:**

    - `energy`: `energy(x, args) -> scalar`, e.g. an
      [`AbstractEnergy`][energyattn.AbstractEnergy].
    - `x0`: the start.
    - `step_size`: $\alpha > 0$; gradient descent is stable for $\alpha < 2/L$ ($L$ the
      largest curvature).
    - `solver`, `adjoint`, `max_steps`, `rtol`, `atol`, `throw`: as in `fixed_point`.

    **Returns:**

    A [`Solution`][energyattn.Solution] whose `stats["energy"]` is $E(x^*)$.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021) and *Attention as Energy Minimization*
        (2021): attention as the response of a system that settles into its energy minimum.
    """

    if not callable(energy):
        raise ValueError(f"energy must be callable, got {type(energy).__name__}")
    step_size = check_positive("step_size", step_size)
    x0 = check_state(x0)
    check_energy_output(energy, jax.eval_shape(lambda x: x, x0), args)
    grad = jax.grad(energy)

    def gradient_step(x, args):
        g = grad(x, args)
        return jax.tree.map(lambda xi, gi: xi - step_size.astype(xi.dtype) * gi, x, g)

    solution = fixed_point(
        gradient_step,
        x0,
        args,
        solver=solver,
        adjoint=adjoint,
        max_steps=max_steps,
        rtol=rtol,
        atol=atol,
        throw=throw,
    )
    stats = dict(solution.stats, energy=energy(solution.value, args))
    return eqx.tree_at(lambda s: s.stats, solution, stats)
