r"""How derivatives flow through a solve: implicit, unrolled, or phantom.

The implicit adjoint is one `custom_jvp`. At a solution $y^*(\theta)$ of $F(y, \theta) = 0$
(the residual of the problem: $f(y) - y$ for a fixed point, $F$ for a root, $\nabla_y E$ for
a minimum) the implicit function theorem gives the tangent

$$\partial_y F\;\dot y^* = -\,\partial_\theta F\;\dot\theta ,$$

a linear solve (a primitive with the rules of `jax.lax.custom_linear_solve`, see
`_linear.py`). Forward mode is this rule; reverse mode is its transpose, which JAX derives (a
solve with $(\partial_y F)^\top$); and
because the rule is written in differentiable JAX operations and re-enters itself for the
primal, `jax.hessian`, `jax.jacfwd` of `jax.grad`, and any other composition work to any
order. The solve itself runs with every input cut from differentiation, so the loop is
never differentiated, and the initial guess gets no derivative (it may depend on
differentiated inputs).
"""

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import positive_int, python_float
from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    FixedPointProblem,
    Flat,
    iterate,
    no_grad,
)
from ._linear import AbstractLinearSolver, AutoLinearSolver
from ._solution import Solution


class AbstractAdjoint(eqx.Module):
    """How derivatives flow through a solve (see
    [`ImplicitAdjoint`][energyattn.ImplicitAdjoint],
    [`UnrolledAdjoint`][energyattn.UnrolledAdjoint],
    [`PhantomAdjoint`][energyattn.PhantomAdjoint])."""

    @abc.abstractmethod
    def solve(
        self,
        solver: AbstractIterativeSolver,
        problem: AbstractProblem,
        y0: Flat,
        args: Any,
        *,
        max_steps: int,
        throw: bool,
    ) -> tuple[Solution, dict[str, Any]]:
        """Solve, with this adjoint's derivative rule attached to `Solution.value`; also
        return the solver's extras (factorisations, caches)."""


class ImplicitAdjoint(AbstractAdjoint):
    r"""Implicit differentiation (the implicit function theorem) at the solution.

    $$\dot y^* = -\left(\partial_y F\right)^{-1}\partial_\theta F\;\dot\theta$$

    A `custom_jvp` over a linear solve (with the rules of `jax.lax.custom_linear_solve`):
    `jax.grad`, `jax.jvp`, `jax.jacfwd`, `jax.hessian` and `jax.vmap` compose, to any order.
    Memory and time do not depend on how many iterations the forward solve took.

    **Arguments:**

    - `linear_solver`: how to solve with $\partial_y F$ (an
      [`ea.LU`][energyattn.LU], [`ea.Cholesky`][energyattn.Cholesky],
      [`ea.GMRES`][energyattn.GMRES] or [`ea.CG`][energyattn.CG]); the default reuses the
      forward solver's factorisation when there is one (Newton) and otherwise picks dense
      or matrix-free by size ([`AutoLinearSolver`][energyattn.AutoLinearSolver]).

    With `throw=True` in the solve, a linear solve that fails raises and says which pass
    failed (the backward pass of reverse mode, or forward mode), which system it solved
    (e.g. $(I - \partial f/\partial y)^\top v = g$ for a fixed point) and with which
    linear solver, e.g. "implicit differentiation failed in the backward pass (reverse
    mode, e.g. jax.grad): the implicit adjoint's linear solve of (I - ∂f/∂y)ᵀ v = g with
    ea.GMRES did not converge within max_steps=1 matrix-vector products ...". Compile the
    step that differentiates with `eqx.filter_jit` to get it as a clean
    `eqx.EquinoxRuntimeError`: a backward pass runs outside the solve's own call, so under
    `jax.jit` or eager `jax.grad` JAX reports the same text inside a `JaxRuntimeError`
    ("CpuCallback error").

    ??? cite "Source"

        S. Bai, J. Z. Kolter, V. Koltun, *Deep Equilibrium Models* (2019); M. Blondel et al.,
        *Efficient and Modular Implicit Differentiation* (2022).
    """

    linear_solver: AbstractLinearSolver = AutoLinearSolver()

    def __check_init__(self):
        if not isinstance(self.linear_solver, AbstractLinearSolver):
            raise ValueError(
                "ImplicitAdjoint(linear_solver=...) must be ea.LU(), ea.Cholesky(), "
                f"ea.GMRES() or ea.CG(), got {self.linear_solver!r}"
            )

    def solve(self, solver, problem, y0, args, *, max_steps, throw):
        solution, extras = iterate(solver, no_grad(problem), no_grad(y0), no_grad(args), max_steps)
        # Only the value carries derivatives (result codes and statistics do not).
        solution = no_grad(solution)
        value = implicit_value(
            solution.value,
            problem,
            args,
            extras.get("factor"),
            linear_solver=self.linear_solver,
            throw=throw,
            singular=extras.get("singular"),
        )
        return eqx.tree_at(lambda s: s.value, solution, value), extras


def implicit_value(
    root: Flat,
    problem: AbstractProblem,
    args: Any,
    factor: Any = None,
    *,
    linear_solver: AbstractLinearSolver | None = None,
    throw: bool = True,
    singular: Any = None,
) -> Flat:
    """`root` (a solution computed without derivatives) as a differentiable function of the
    problem's arrays and `args`, by the implicit function theorem. `factor`: a factorisation
    of the residual's Jacobian at `root` to reuse, or `None`. `singular`: a boolean the
    forward solver set where the Jacobian vanishes at `root` as far as it can tell (Newton
    at a multiple root), or `None`: there the derivative is NaN, or raises with `throw`."""
    linear_solver = AutoLinearSolver() if linear_solver is None else linear_solver
    return _implicit(
        no_grad(root),
        (problem, args),
        no_grad((factor, singular)),
        linear_solver=linear_solver,
        throw=throw,
    )


_SINGULAR = (
    "implicit differentiation failed: the Jacobian of the residual vanishes at the "
    "solution, or nearly (it changed by more than a quarter across the solver's last step, "
    "as at a multiple root where F' = 0), so the derivative does not exist or is not "
    "determined by the solve. Pass throw=False to get NaN instead"
)


@eqx.filter_custom_jvp
def _implicit(root, inputs, known, *, linear_solver, throw):
    """The identity on the (already computed) root, whose derivatives are the IFT's.
    `known`: `(factor, singular)` from the forward solve."""
    return root


@_implicit.def_jvp
def _implicit_jvp(primals, tangents, *, linear_solver, throw):
    root, inputs, known = primals
    _, t_inputs, _ = tangents
    factor, singular = known
    # Re-enter for the primal: an outer derivative of this rule differentiates y* again.
    root = _implicit(root, inputs, known, linear_solver=linear_solver, throw=throw)
    problem = inputs[0]

    def residual(y, inputs):
        problem, args = inputs
        return problem.residual(y, args)

    if t_inputs is None:
        return root, jnp.zeros_like(root)
    _, rhs = eqx.filter_jvp(lambda inputs: residual(root, inputs), (inputs,), (t_inputs,))
    _, matvec = jax.linearize(lambda y: residual(y, inputs), root)
    t_root = linear_solver.solve(
        matvec,
        -rhs,
        symmetric=problem.symmetric,
        factor=factor,
        throw=throw,
        problem=type(problem),  # an error names the system and the pass
    )
    if singular is not None:
        # A scale that depends on primals only keeps the tangent linear (and transposable):
        # NaN where the derivative does not exist; with `throw` a checked 1, which reverse
        # mode keeps as a residual of the forward pass, so the check runs there too.
        if throw:
            scale = eqx.error_if(jnp.ones((), root.dtype), singular, _SINGULAR)
        else:
            scale = jnp.where(singular, jnp.nan, 1).astype(root.dtype)
        t_root = t_root * scale
    return root, t_root


class UnrolledAdjoint(AbstractAdjoint):
    """Differentiate through every iteration of the solver (backpropagation through time).

    The derivative is that of the truncated iteration (including its dependence on the
    initial guess), which equals the implicit one only once the iteration has converged.
    Forward mode, higher orders and `vmap` work too.

    The loop, and the solvers' line searches inside it, become loops of at most
    `max_steps` passes made of `lax.scan` and `lax.cond` that skip the passes after the
    solve has converged: time grows with the steps taken, not with `max_steps` (a gradient
    at the default 256 costs 1.1-1.7 times what it does at 16 for a solve of a
    few steps, `benchmarks/unrolled.py`), and the result, its statistics and its
    derivatives are the same for any `max_steps` above the steps taken. `k` steps cost at
    most `k + 1` passes (blocks of two). Reverse mode checkpoints the blocks (and, beyond
    64 steps, groups of them): it stores a state per block (about `2 sqrt(max_steps / 2)`
    when grouped) and one block's intermediate values at a time, and runs the passes taken
    twice forward (three times when grouped) and once backward. Under `vmap` a finished
    example waits for the others (frozen), and the loop stops when all have finished.
    """

    def solve(self, solver, problem, y0, args, *, max_steps, throw):
        return iterate(solver, problem, y0, args, max_steps, unrolled=True)


class PhantomAdjoint(AbstractAdjoint):
    r"""Solve without derivatives, then differentiate a few damped steps taken from $z^*$.

    $$z_0 = \operatorname{stop\_gradient}(z^*),\qquad z_{j+1} = z_j + \lambda\,(f(z_j) - z_j),
    \quad j < k ,$$

    and the output is $z_k$. With $k = 1$, $\lambda = 1$ this is Jacobian-free backpropagation:
    the gradient $(\partial_\theta f)^\top\bar z$ skips the inverse $(I - \partial_z f)^{-\top}$,
    a cheap preconditioned descent direction rather than the true gradient. Larger $k$ and
    smaller $\lambda$ approach the implicit gradient (a truncated Neumann series). For
    fixed points only ([`ea.fixed_point`][energyattn.fixed_point], and
    [`ea.minimise`][energyattn.minimise] with a fixed-point solver on its gradient map).

    **Arguments:**

    - `num_steps`: $k \ge 1$.
    - `damping`: $\lambda \in (0, 1]$.

    ??? cite "Source"

        S. W. Fung et al., *JFB: Jacobian-free backpropagation for implicit networks* (2022);
        Z. Geng et al., *On training implicit models* (phantom gradients, 2021).
    """

    num_steps: int = eqx.field(default=1, static=True)
    damping: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        positive_int("num_steps", self.num_steps)
        if python_float("damping", self.damping) > 1:
            raise ValueError(f"damping must be in (0, 1], got {self.damping!r}")

    def solve(self, solver, problem, y0, args, *, max_steps, throw):
        if not isinstance(problem, FixedPointProblem):
            raise ValueError(
                "ea.PhantomAdjoint differentiates steps of a fixed-point map: use it with "
                "ea.fixed_point, or ea.minimise with ea.Picard / ea.Anderson"
            )
        solution, extras = iterate(solver, no_grad(problem), no_grad(y0), no_grad(args), max_steps)
        solution = no_grad(solution)
        z = solution.value
        for _ in range(self.num_steps):
            z = z + self.damping * (problem.fn(z, args) - z)
        return eqx.tree_at(lambda s: s.value, solution, z), extras
