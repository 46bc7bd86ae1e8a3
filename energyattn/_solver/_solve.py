r"""The entry points' common path: `solve_problem` checks the arguments once, flattens the
problem, solves it with the chosen adjoint, unflattens and raises; `compiled` puts an entry
point under `eqx.filter_jit`, and `split_aux` reads `has_aux`."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import positive_int
from .._custom_types import State
from ._adjoint import AbstractAdjoint, ImplicitAdjoint
from ._iterate import (
    AbstractIterativeSolver,
    AbstractProblem,
    as_arrays,
    check_initial,
    flatten_problem,
)
from ._solution import RESULTS, Solution, Y, finish


def check_adjoint(adjoint: Any) -> AbstractAdjoint:
    adjoint = ImplicitAdjoint() if adjoint is None else adjoint
    if not isinstance(adjoint, AbstractAdjoint):
        raise ValueError(
            "adjoint must be ea.ImplicitAdjoint(), ea.UnrolledAdjoint() or "
            f"ea.PhantomAdjoint(), got {adjoint!r}"
        )
    return adjoint


def check_solver(solver: Any, kind: type[AbstractProblem], entry: str) -> AbstractIterativeSolver:
    if not isinstance(solver, AbstractIterativeSolver):
        raise ValueError(f"{entry}: solver must be an ea solver object, got {solver!r}")
    if not issubclass(kind, solver.kinds):
        names = " / ".join(k.name for k in solver.kinds)
        raise ValueError(
            f"{entry} cannot use {type(solver).__name__}: it solves {names} problems, "
            f"not {kind.name} problems"
        )
    return solver


#: The largest `max_steps`: the loop counts steps in int32.
MAX_STEPS_LIMIT = 2**31 - 2

#: Every solver entry point's default `max_steps` (one value across the package).
DEFAULT_MAX_STEPS = 256


def solve_problem(
    kind: type[AbstractProblem],
    fn: Callable,
    y0: Y,
    args: Any,
    *,
    solver: AbstractIterativeSolver,
    adjoint: Any,
    max_steps: Any,
    throw: bool,
    entry: str,
    y0_name: str,
    check: Callable[[Solution], Solution] | None = None,
    aux: Callable[[State, Any], Any] | None = None,
) -> Solution[Y]:
    """The public entry points' common path: check once, flatten, solve, unflatten, raise.

    `check` may amend the unflattened solution (its result code) before the runtime raise;
    `aux(value, args)` (from `split_aux`) fills `Solution.aux`."""
    if not callable(fn):
        raise ValueError(f"{entry}: fn must be callable, got {type(fn).__name__}")
    solver = check_solver(solver, kind, entry)
    adjoint = check_adjoint(adjoint)
    max_steps = positive_int("max_steps", max_steps)
    if max_steps > MAX_STEPS_LIMIT:
        raise ValueError(
            f"max_steps must be at most {MAX_STEPS_LIMIT} (the step counter is a 32-bit "
            f"integer), got {max_steps}"
        )
    y0 = check_initial(y0, y0_name)
    for leaf in jax.tree.leaves(y0):
        if jnp.finfo(leaf.dtype).bits < 32:
            raise ValueError(
                f"{entry} solves in float32 or float64, got {y0_name} of dtype {leaf.dtype}: "
                "LAPACK (Newton's steps, the dense adjoints) has no half-precision kernels, "
                f"and half precision is coarser than the solvers' tolerances; pass "
                f"{y0_name}.astype(jnp.float32) and cast the solution back"
            )
    # Python floats (and arrays traced from them, whose primal is still a Python float) in
    # `args` become JAX arrays: otherwise a derivative with respect to them is lost.
    args = as_arrays(jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, float) else x, args))
    problem, flat0, unravel = flatten_problem(kind, fn, y0, args)
    solution, _ = adjoint.solve(solver, problem, flat0, args, max_steps=max_steps, throw=throw)
    solution = eqx.tree_at(lambda s: s.value, solution, unravel(solution.value))
    # A non-finite iterate that came from non-finite inputs says so (not "the iterate").
    inputs = [x for x in jax.tree.leaves((flat0, args)) if eqx.is_inexact_array(x)]
    if inputs:
        bad = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in inputs]))
        blamed = (solution.result == RESULTS.nonfinite) & bad
        # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
        result = RESULTS.where(
            blamed,
            RESULTS.nonfinite_input,  # type: ignore[arg-type]
            solution.result,
        )
        solution = eqx.tree_at(lambda s: s.result, solution, result)
    if check is not None:
        solution = check(solution)
    solution = finish(solution, bool(throw))
    if aux is not None:  # at the checked value: its derivatives are the implicit ones
        found = aux(solution.value, args)
        solution = eqx.tree_at(lambda s: s.aux, solution, found, is_leaf=lambda x: x is None)
    return solution


def split_aux(fn: Callable, has_aux: bool, entry: str) -> tuple[Callable, Callable | None]:
    """With `has_aux`, `fn(y, args)` returns `(output, aux)`: the function the solver sees
    (the output alone) and the one that gives the auxiliary output at a point."""
    if not has_aux:
        return fn, None

    def pair(y: State, args: Any) -> tuple[Any, Any]:
        out = fn(y, args)
        if not (isinstance(out, tuple) and len(out) == 2):
            got = "an array" if eqx.is_array(out) else f"a {type(out).__name__}"
            raise ValueError(
                f"{entry}: with has_aux=True, fn must return a pair (output, aux), got {got}"
            )
        return out

    return (lambda y, args: pair(y, args)[0]), (lambda y, args: pair(y, args)[1])


Entry = TypeVar("Entry", bound=Callable[..., Solution])


def compiled(entry: Entry) -> Entry:
    """The entry point `entry(fn, y0, args, **options)` under `eqx.filter_jit`, as
    optimistix's are: one compiled program, reused by a second call with the same `fn`
    (and options, shapes and dtypes); eagerly, a failed solve raises a clean
    `eqx.EquinoxRuntimeError` naming its cause. Under an outer `jit`, `grad` or `vmap` it is
    a nested `jit`, which costs nothing there (`benchmarks/solver_jit.py`: the same compile
    and run times, a faster trace). Python floats in `args` become arrays: inputs of the
    program, not constants of it (a new value would compile a new program)."""
    jitted = eqx.filter_jit(entry)

    @functools.wraps(entry)
    def run(fn: Any, y0: Any, args: Any = None, **options: Any) -> Solution:
        args = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, float) else x, args)
        return jitted(fn, y0, args, **options)

    return run  # type: ignore[return-value]
