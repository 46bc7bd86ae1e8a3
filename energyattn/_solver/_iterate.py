r"""The one loop of the package: `init -> step -> ... -> postprocess` on a solver object.

Every iterative solver (Picard, Anderson, Newton, L-BFGS, and through them fixed points,
roots, minima and the vector-spin saddle point) is a small object with three methods; this
module runs them. Solvers see flat vectors: the state pytree is raveled once here, and the
function is closure-converted once here, so a closed-over array (an Equinox module's
parameter) is an explicit input whose derivatives the adjoints can take.

One pass of the loop is one call of `solver.step`. Under `vmap` the loop is a
`lax.while_loop` whose finished examples are left untouched while the others iterate, so
results and step counts do not depend on what else is in the batch. With `unrolled=True`
it is a loop of at most `max_steps` passes made of `lax.scan` and `lax.cond`
(`bounded_while`: finished examples frozen, finished passes skipped), which reverse mode
can differentiate.
"""

import abc
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.tree_util import PyTreeDef
from jaxtyping import Array, Bool, Float, PyTree

from .._checks import shape_str
from .._custom_types import State
from ._solution import RESULTS, Solution

Flat = Float[Array, " n"]


def rms(x: Array) -> Float[Array, ""]:
    """Root-mean-square of all entries: a size that does not grow with the number of entries."""
    return jnp.sqrt(jnp.mean(jnp.square(x)))


def tree_where(pred: Bool[Array, ""], a: Any, b: Any) -> Any:
    """`jnp.where(pred, a, b)` leaf by leaf."""
    return jax.tree.map(lambda u, v: jnp.where(pred, u, v), a, b)


def no_grad(tree: Any) -> Any:
    """`stop_gradient` on every floating-point array of a pytree (other leaves kept).

    The result stays an array: the primal of a tracer made from a Python float (as in
    `jax.grad(f)(5.0)`) is that Python float, which would otherwise change the pytree's
    arrays-versus-constants split."""
    return jax.tree.map(_no_grad_leaf, tree)


def _no_grad_leaf(x: Any) -> Any:
    return jnp.asarray(jax.lax.stop_gradient(x)) if eqx.is_inexact_array(x) else x


def ok_result() -> RESULTS:
    """`RESULTS.successful` as a traced code (so it can sit in a loop carry)."""
    # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    return RESULTS.where(True, RESULTS.successful, RESULTS.successful)  # type: ignore[arg-type]


def bounded_while(
    cond: Callable[[Any], Bool[Array, ""]],
    body: Callable[[Any], Any],
    init: Any,
    max_passes: int,
    unrolled: bool,
) -> Any:
    """`lax.while_loop(cond, body, init)`, or with `unrolled` a loop of at most `max_passes`
    passes made of `lax.scan` and `lax.cond`, which reverse mode differentiates and which
    pays for the passes it runs, not for `max_passes`.

    Used for the outer loop and for inner loops such as line searches, so that an unrolled
    solve never contains a `while_loop`. The caller guarantees that `cond` turns false
    within `max_passes` passes.

    Unrolled, its value and every derivative are those of a `scan` of `max_passes` passes
    of `where(cond(c), body(c), c)`. The passes run in blocks of `BLOCK_PASSES`, and beyond
    `MAX_UNGROUPED` blocks the blocks run in groups of about `sqrt(max_passes /
    BLOCK_PASSES)`; a block or a group runs under a `lax.cond` on `cond` at its start, so a
    loop that has stopped skips the rest at the cost of one test per block or group. A loop
    that stops after `k` passes evaluates `body` `k + BLOCK_PASSES - 1` times at most,
    whatever `max_passes`.

    Blocks and groups are checkpointed (`jax.checkpoint`). Reverse mode stores the carry at
    the start of each block (of each group, when grouped); in the backward pass it runs
    each group that ran again, storing its blocks' carries, then each of those blocks once
    more, storing one block's residuals at a time. A gradient therefore costs about two
    forward passes (three when grouped) and one backward pass over the passes run, and its
    memory is at most `MAX_UNGROUPED` carries (about `2 sqrt(max_passes / 2)` when grouped)
    plus one block of residuals. (Without the group checkpoint the residuals of a group's
    `lax.cond`, which include the arrays `body` closes over, would be stored once per
    group.) Within a block the passes keep `where`: under `vmap` a finished example is
    frozen by it, and a block or group is skipped once every example of the batch has
    finished (`_any_example`), so a batch costs the passes its slowest example needs.
    """
    if not unrolled:
        return jax.lax.while_loop(cond, body, init)
    if max_passes <= 0:
        return init
    size = min(BLOCK_PASSES, max_passes)
    blocks = -(-max_passes // size)
    # ceil(sqrt(blocks)) blocks per group; one group (no group level) for a few blocks.
    group = blocks if blocks <= MAX_UNGROUPED else math.isqrt(blocks - 1) + 1
    groups = -(-blocks // group)
    ragged = groups * group * size != max_passes  # passes beyond max_passes at the end

    def one_pass(carry, index):
        go = cond(carry)
        if ragged:
            go = go & (index < max_passes)
        return tree_where(go, body(carry), carry), None

    def unless_stopped(run: Callable[[Any, Array], Any]) -> Callable:
        """A checkpointed scan step that calls `run(carry, first_pass)` unless stopped."""

        @functools.partial(jax.checkpoint, prevent_cse=False)  # in a scan: no CSE to prevent
        def step(carry, first):
            return jax.lax.cond(_any_example(cond(carry)), run, _same, carry, first), None

        return step

    def passes(carry, first):
        return jax.lax.scan(one_pass, carry, first + jnp.arange(size, dtype=jnp.int32))[0]

    block = unless_stopped(passes)

    def blocks_of_group(carry, first):
        starts = first + size * jnp.arange(group, dtype=jnp.int32)
        return jax.lax.scan(block, carry, starts)[0]

    if groups == 1:
        return blocks_of_group(init, jnp.zeros((), jnp.int32))
    starts = jnp.arange(0, groups * group * size, group * size, dtype=jnp.int32)
    return jax.lax.scan(unless_stopped(blocks_of_group), init, starts)[0]


#: Passes per block of an unrolled `bounded_while`: the most it runs after its loop stops,
#: plus one.
BLOCK_PASSES = 2
#: The most blocks an unrolled `bounded_while` runs without grouping them: up to this many
#: it stores a carry per block, and compiles its body three times (forward, checkpoint,
#: backward) instead of four.
MAX_UNGROUPED = 32


def _same(carry: Any, first: Array) -> Any:
    del first
    return carry


@jax.custom_batching.custom_vmap
def _any_example(pred: Bool[Array, ""]) -> Bool[Array, ""]:
    """`pred`; under `vmap`, whether it holds for any example (an unbatched boolean), so
    that a `lax.cond` on it stays a branch instead of becoming a `select` of both."""
    return pred


@_any_example.def_vmap
def _any_example_vmap(axis_size: int, in_batched: list[bool], pred: Any) -> tuple[Any, bool]:
    del axis_size
    if in_batched[0]:
        # Again through `_any_example`: under nested `vmap`s every level reduces its axis.
        pred = _any_example(jnp.any(pred, axis=0))
    return pred, False


class AbstractObjective(eqx.Module):
    """What Newton and L-BFGS need of an energy $E(y)$ on a flat vector (internal interface).

    The default, [`EnergyObjective`][], takes everything from autodiff; a model with
    analytic derivatives sharing one factorisation (the vector-spin $\\varphi$) implements
    its own. `aux` carries work from `value` to the derivatives at the same point.
    """

    @abc.abstractmethod
    def value(self, y: Flat, args: Any) -> tuple[Float[Array, ""], Float[Array, ""], Any]:
        """$(E(y), s, \\text{aux})$: $E = +\\infty$ outside the domain (NaN only for poisoned
        inputs) and $s$ bounds the magnitude of the terms summed into $E$ (its round-off is
        about $\\epsilon s$)."""

    @abc.abstractmethod
    def gradient(self, y: Flat, args: Any, aux: Any) -> Flat:
        """$\\nabla E(y)$ at a point where `value` returned `aux`."""

    @abc.abstractmethod
    def hessian(self, y: Flat, args: Any, aux: Any) -> tuple[Flat, Float[Array, "n n"], Any]:
        """$(\\nabla E, \\nabla^2 E, \\text{aux}')$ at a point where `value` returned `aux`;
        `aux'` is kept by the solver (a cache of the last point's derivatives)."""

    @abc.abstractmethod
    def residual(self, y: Flat, args: Any) -> Flat:
        """$\\nabla E(y)$ as a differentiable function of `y` and `args` (for the adjoint)."""


class EnergyObjective(AbstractObjective):
    """An energy `fn(y, args) -> scalar`, differentiated by `jax.grad` and `jax.hessian`."""

    fn: Callable[[Flat, Any], Float[Array, ""]]

    def value(self, y, args):
        energy, grad = jax.value_and_grad(self.fn)(y, args)
        return energy, jnp.abs(energy), grad

    def gradient(self, y, args, aux):
        return aux

    def hessian(self, y, args, aux):
        return aux, jax.hessian(self.fn)(y, args), aux

    def residual(self, y, args):
        return jax.grad(self.fn)(y, args)


class AbstractProblem(eqx.Module):
    """A problem on flat vectors: what a solver is asked to solve, and what the implicit
    adjoint linearises (`residual`, zero at the solution).

    Each kind of problem is a type, so solvers declare the kinds they solve as types
    (`AbstractIterativeSolver.kinds`) and branch on `isinstance`, never on a string.
    """

    #: What messages call a problem of this kind ("fixed-point", "root", "minimisation").
    name: ClassVar[str]
    #: The implicit adjoint's linear systems, as an error names them: (forward mode, reverse
    #: mode). $u$, $v$: the unknowns; $r$, $g$: the right-hand sides.
    systems: ClassVar[tuple[str, str]]
    #: Whether the residual's Jacobian is symmetric (a Hessian).
    symmetric: ClassVar[bool] = False

    @abc.abstractmethod
    def residual(self, y: Flat, args: Any) -> Flat:
        """The function that is zero at the solution."""


class FixedPointProblem(AbstractProblem):
    """$y = f(y)$, with `fn` the map $f$; the residual is $f(y) - y$."""

    fn: Callable[[Flat, Any], Flat]
    name: ClassVar[str] = "fixed-point"
    systems: ClassVar[tuple[str, str]] = ("(I - ∂f/∂y) u = r", "(I - ∂f/∂y)ᵀ v = g")

    def residual(self, y, args):
        return self.fn(y, args) - y


class RootProblem(AbstractProblem):
    """$F(y) = 0$, with `fn` the residual $F$."""

    fn: Callable[[Flat, Any], Flat]
    name: ClassVar[str] = "root"
    systems: ClassVar[tuple[str, str]] = ("(∂F/∂y) u = r", "(∂F/∂y)ᵀ v = g")

    def residual(self, y, args):
        return self.fn(y, args)


class MinimiseProblem(AbstractProblem):
    """$\\min_y E(y)$, with the energy carried by `objective`; the residual is $\\nabla E$."""

    objective: AbstractObjective
    name: ClassVar[str] = "minimisation"
    systems: ClassVar[tuple[str, str]] = (
        "∇²E u = r (the Hessian at the minimum)",
        "∇²E v = g (the Hessian at the minimum)",
    )
    symmetric: ClassVar[bool] = True

    def residual(self, y, args):
        return self.objective.residual(y, args)


class AbstractIterativeSolver(eqx.Module):
    """A solver the loop runs: `init`, then `step` until converged, then `postprocess`.

    Subclasses declare the problem types they solve (`kinds`) and whether their first pass
    only evaluates the start (`start_pass`: Newton and L-BFGS evaluate the derivatives at
    $y_0$ in the loop's first pass, so each compiled function is traced once).
    """

    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    kinds: ClassVar[tuple[type[AbstractProblem], ...]]
    start_pass: ClassVar[bool] = False

    @abc.abstractmethod
    def init(self, problem: AbstractProblem, y: Flat, args: Any, start: Any = None) -> PyTree:
        """The solver's state before the first pass. `start`: what the objective's `value`
        returned at `y`, when the caller already evaluated it (a solver that evaluates the
        start itself may take it instead); `None` otherwise."""

    @abc.abstractmethod
    def step(
        self, problem: AbstractProblem, y: Flat, args: Any, state: PyTree, unrolled: bool
    ) -> tuple[Flat, PyTree, Bool[Array, ""], Bool[Array, ""], RESULTS]:
        """One pass: `(y_next, state, took_step, converged, result)`. `result` is
        `successful` unless the pass failed (the loop adds `max_steps_reached`)."""

    @abc.abstractmethod
    def postprocess(
        self, problem: AbstractProblem, y: Flat, args: Any, state: PyTree, result: RESULTS
    ) -> tuple[Flat, Float[Array, ""], dict[str, Any], dict[str, Any]]:
        """`(value, residual, stats, extras)`: `extras` is for the adjoint (e.g. a factor of
        the Jacobian at the solution) and is not part of the public `Solution`."""

    def exhausted(self, problem: AbstractProblem, args: Any, state: PyTree) -> Bool[Array, ""]:
        """Whether a search that used up `max_steps` shows no solution in sight (then it
        ends in `RESULTS.no_root`, not `max_steps_reached`, whose advice could not help).
        By default, never."""
        return jnp.zeros((), bool)

    #: Whether a converged minimisation is checked by `certify` (line-search solvers).
    certifies: ClassVar[bool] = False

    def certify(
        self, problem: MinimiseProblem, args: Any, state: PyTree, unrolled: bool
    ) -> tuple[PyTree, Bool[Array, ""], RESULTS]:
        """`(state, minimum, verdict)`: whether the converged `state` is at a minimum; if
        not, a state that walks on from it and a code naming what the point is."""
        raise NotImplementedError

    def no_descent(
        self, problem: MinimiseProblem, args: Any, state: PyTree
    ) -> tuple[PyTree, Bool[Array, ""]]:
        """`(state, minimum)` for a minimisation whose line search `stalled`: whether no
        direction lowers the energy there (a minimum where the gradient is not zero, a
        kink such as that of $|x|$ at 0), and the state that then returns the point
        itself. By default, never."""
        return state, jnp.zeros((), bool)

    def tolerances(self, dtype: Any) -> tuple[float, float]:
        """`(rtol, atol)`, with `None` replaced by the solver's default for `dtype`."""
        return default_tolerance(self.rtol, dtype), default_tolerance(self.atol, dtype)


def default_tolerance(tol: float | None, dtype: Any) -> float:
    """A tolerance, or for `None` `eps ** 0.6` of the dtype (4e-10 in float64, 7e-5 in
    float32): well above round-off, and the error left after one more Newton-like step from
    there is at round-off."""
    if tol is not None:
        return float(tol)
    return float(jnp.finfo(dtype).eps) ** 0.6


def iterate(
    solver: AbstractIterativeSolver,
    problem: AbstractProblem,
    y0: Flat,
    args: Any,
    max_steps: int,
    *,
    unrolled: bool = False,
    start: Any = None,
) -> tuple[Solution, dict[str, Any]]:
    """Run `solver` on `problem` from `y0`: THE loop. Returns the solution (no runtime check
    yet: the caller decides whether to raise) and the solver's `extras`. `start`: what the
    objective's `value` returned at `y0`, when the caller already evaluated it (line-search
    solvers then skip that evaluation)."""

    def body(carry):
        y, state, k, _, _, _ = carry
        y, state, took_step, converged, result = solver.step(problem, y, args, state, unrolled)
        k = k + took_step.astype(k.dtype)
        ok = result == RESULTS.successful
        result = RESULTS.where(
            ok & ~converged & (k >= max_steps), RESULTS.max_steps_reached, result
        )
        running = (result == RESULTS.successful) & ~converged
        return y, state, k, result, converged, running

    def run(y, state, k):
        init = (y, state, k, ok_result(), jnp.zeros((), bool), jnp.ones((), bool))
        return bounded_while(lambda c: c[-1], body, init, passes, unrolled)[:5]

    state = solver.init(problem, y0, args, start)
    passes = max_steps + int(solver.start_pass)
    if solver.certifies and isinstance(problem, MinimiseProblem):
        y, state, k, result = certified(solver, problem, args, unrolled, run, y0, state)
    else:
        y, state, k, result, _ = run(y0, state, jnp.zeros((), jnp.int32))
    if not isinstance(problem, MinimiseProblem):
        exhausted = (result == RESULTS.max_steps_reached) & solver.exhausted(problem, args, state)
        # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
        result = RESULTS.where(exhausted, RESULTS.no_root, result)  # type: ignore[arg-type]
    value, residual, stats, extras = solver.postprocess(problem, y, args, state, result)
    solution = Solution(value=value, result=result, num_steps=k, residual=residual, stats=stats)
    return solution, extras


#: The most escapes from a stationary point that is not a minimum, in one minimisation.
MAX_ESCAPES = 3


def certified(solver, problem, args, unrolled, run, y0, state):
    """A minimisation whose every convergence is checked by `solver.certify`: from a point
    that is not a minimum the solver walks on (`run`, the loop, with the steps left), at
    most `MAX_ESCAPES` times; where no escape leads anywhere, the result names the point.

    The check runs once per convergence, outside the loop (which is traced once): under
    `vmap`, where a branch inside the loop would run on every pass, it costs one check per
    escape, not per step.
    """

    def body(c):
        y, state, k, verdict, escapes, _ = c
        y, state, k1, result, converged = run(y, state, k)
        # An escape whose first search found no lower point: what the point is stands.
        stuck = (escapes > 0) & (result != RESULTS.successful) & (k1 == k)
        result = RESULTS.where(stuck, verdict, result)
        ok = (result == RESULTS.successful) & converged

        # A search that found no lower point where no direction lowers the energy (a kink
        # at the minimum, where the gradient JAX gives is a nonzero subgradient): a minimum.
        def kink(_):
            return solver.no_descent(no_grad(problem), no_grad(args), state)

        def smooth(_):
            return state, jnp.zeros((), bool)

        stalled = result == RESULTS.stalled
        state, kinked = jax.lax.cond(stalled, kink, smooth, None)
        result = RESULTS.where(stalled & kinked, RESULTS.successful, result)

        def certify(_):
            return solver.certify(no_grad(problem), no_grad(args), state, unrolled)

        def skip(_):
            return state, jnp.ones((), bool), ok_result()

        state, minimum, verdict = jax.lax.cond(ok, certify, skip, None)
        result = RESULTS.where(ok & ~minimum, verdict, result)
        again = ok & ~minimum & (escapes < MAX_ESCAPES)
        return y, state, k1, result, escapes + 1, again

    zero = jnp.zeros((), jnp.int32)
    init = (y0, state, zero, ok_result(), zero, jnp.ones((), bool))
    y, state, k, result, _, _ = bounded_while(
        lambda c: c[-1], body, init, MAX_ESCAPES + 1, unrolled
    )
    return y, state, k, result


# --------------------------------------------------------------------------------------------
# Problems from user functions on pytrees


def flatten_problem(
    kind: type[AbstractProblem], fn: Callable, y0: State, args: Any
) -> tuple[AbstractProblem, Flat, Callable[[Flat], State]]:
    """The user's `fn(y, args)` on a pytree `y0` as a problem of type `kind` on flat vectors.

    Closure conversion turns arrays that `fn` closes over (e.g. an Equinox module's
    parameters) into explicit leaves of the problem, which the adjoints differentiate.
    """
    flat0, unravel = ravel_pytree(y0)
    want = jax.eval_shape(lambda y: y, y0)
    if kind is MinimiseProblem:
        check_energy_output(fn, want, args)

        def flat_energy(y, args):
            return fn(unravel(y), args).astype(y.dtype)

        converted = as_arrays(eqx.filter_closure_convert(flat_energy, flat0, args))
        return MinimiseProblem(EnergyObjective(converted)), flat0, unravel
    out = jax.eval_shape(fn, y0, args)
    if kind is RootProblem:
        # As many equations as unknowns, in any structure.
        size = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(out))
        if size != flat0.shape[0]:
            raise ValueError(
                f"fn(y, args) must return as many equations as there are unknowns: got {size} "
                f"for {flat0.shape[0]} (shapes {jax.tree.map(lambda s: s.shape, out)} for "
                f"{jax.tree.map(lambda s: s.shape, want)})"
            )
    else:
        # Annotated: jaxlib has no stubs, so mypy cannot compare the treedefs it returns.
        structure: PyTreeDef = jax.tree.structure(out)
        same = structure == jax.tree.structure(want) and all(
            a.shape == b.shape
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True)
        )
        if not same:
            raise ValueError(
                "fn(y, args) must return the same structure and shapes as the initial guess: "
                f"got {jax.tree.map(lambda s: s.shape, out)} for "
                f"{jax.tree.map(lambda s: s.shape, want)}"
            )

    def flat_fn(y, args):
        return ravel_pytree(fn(unravel(y), args))[0].astype(y.dtype)

    converted = as_arrays(eqx.filter_closure_convert(flat_fn, flat0, args))
    return kind(converted), flat0, unravel


def as_arrays(tree: Any) -> Any:
    """Arrays as JAX arrays: a value traced from a Python float (`jax.grad(f)(5.0)`) has a
    Python float as its primal, which `eqx.filter_custom_jvp` would take for a constant and
    drop its derivative."""
    return jax.tree.map(lambda x: jnp.asarray(x) if eqx.is_array(x) else x, tree)


def check_energy_output(energy: Callable, x: Any, args: Any) -> None:
    """Raise `ValueError` unless `energy(x, args)` is a scalar (`x` may be shape structs)."""
    out = jax.eval_shape(energy, x, args)
    if isinstance(out, jax.ShapeDtypeStruct) and out.shape == ():
        return
    got = (
        shape_str(out.shape) if isinstance(out, jax.ShapeDtypeStruct) else f"a {type(out).__name__}"
    )
    raise ValueError(f"the energy must return a scalar (a 0-d array), got {got}")


def check_initial(y0: Any, name: str) -> State:
    """The initial guess as a pytree of floating-point arrays, or a `ValueError` naming it."""
    if isinstance(y0, AbstractIterativeSolver) or type(y0).__module__.startswith(
        ("optimistix", "lineax")
    ):
        # optimistix's order is root_find(fn, solver, y0, args); energyattn's is not.
        raise ValueError(
            f"{name} is a solver ({type(y0).__name__}), not an initial guess: energyattn "
            f"takes the solver by keyword, e.g. ea.root_find(fn, {name}, args, solver=...)"
        )
    y0 = jax.tree.map(jnp.asarray, y0)
    leaves = jax.tree.leaves(y0)
    if not leaves:
        raise ValueError(f"{name} must contain at least one array")
    if sum(leaf.size for leaf in leaves) == 0:
        shapes = jax.tree.map(lambda leaf: leaf.shape, y0)
        raise ValueError(f"{name} must hold at least one number, got shapes {shapes}")
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"{name} must hold floating-point arrays, got dtype {leaf.dtype}")
    return y0
