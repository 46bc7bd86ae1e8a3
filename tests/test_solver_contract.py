"""The solvers' contract: `successful` only where the solver's own stopping test holds for the
problem it was given, per example under `vmap`, on problems with and without a solution.

- a root: the residual, $\\operatorname{rms}(F) \\le \\text{atol} + \\text{rtol}\\,
  \\operatorname{rms}(F(y_0))$ (after a small Newton step), else `RESULTS.no_root` where
  $|F|^2$ stops falling;
- a fixed point: $\\operatorname{rms}(f(y) - y) \\le \\text{atol} + \\text{rtol}\\,
  \\operatorname{rms}(f(y))$ for Picard and Anderson (which stop on that residual times
  the estimated $\\lVert(I - \\partial f)^{-1}\\rVert$, so on a slow contraction the error
  is within the tolerance too), the root test for Newton;
- a minimum: a small gradient, the energy below the start, positive curvature; an energy
  unbounded below gives `RESULTS.unbounded`;
- exact solutions are successes (a minimum at a kink, a root where the Jacobian is
  infinite), and a derivative at a singular Jacobian is not a number (or raises).
"""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea
from energyattn._solver import DEFAULT_MAX_STEPS

N = 3
#: A batch of problems: the sign of c decides whether a solution exists (c[0] exactly 0).
C = np.concatenate([[0.0], np.random.default_rng(0).uniform(-2, 2, 15)])


def rms(x):
    return np.sqrt(np.mean(np.square(x), axis=-1))


def squares(y, c):  # roots y^2 = -c: none for c > 0, the double root 0 for c = 0
    return y**2 + c + 0.1 * jnp.roll(y, 1) * y


def square_map(y, c):  # fixed points y^2 = c: none for c < 0
    return y - 0.5 * (y**2 - c)


def quadratic(x, c):  # c x^2 + x: a minimum for c > 0, unbounded below otherwise
    return jnp.sum(c * x**2 + x + 0.1 * x * jnp.roll(x, 1) * jnp.abs(c))


ROOTS = [ea.Newton(), ea.Newton(jacobian="matrix-free")]
FIXED = [ea.Picard(), ea.Anderson(), ea.Newton()]
MINIMA = [ea.LBFGS(), ea.Newton(), ea.Newton(jacobian="matrix-free")]


@eqx.filter_jit
def solve_all(c):
    one = jnp.full(N, 0.7)

    def batch(entry, fn, solvers):
        return [
            jax.vmap(lambda c, s=s: entry(fn, one, c, solver=s, throw=False))(c) for s in solvers
        ]

    return (
        batch(ea.root_find, squares, ROOTS),
        batch(ea.fixed_point, square_map, FIXED),
        batch(ea.minimise, quadratic, MINIMA),
    )


@pytest.fixture(scope="module")
def solutions():
    return jax.device_get(solve_all(C))


def test_roots_only_where_the_residual_is_small(solutions):
    roots, _, _ = solutions
    start = rms(np.asarray(jax.vmap(squares, (None, 0))(jnp.full(N, 0.7), C)))
    for solver, sol in zip(ROOTS, roots, strict=True):
        ok = np.asarray(sol.result == ea.RESULTS.successful)
        left = rms(np.asarray(jax.vmap(squares)(sol.value, C)))
        tol = float(np.finfo(np.float64).eps) ** 0.6
        assert np.all(left[ok] <= tol + tol * start[ok]), repr(solver)
        assert not np.any(ok & (C > 0)), repr(solver)  # no real root: never a success
        assert np.all(ok[C < -0.5]), repr(solver)  # simple roots exist and are found
        assert np.all(np.asarray(sol.result == ea.RESULTS.no_root)[C > 0]), repr(solver)


def test_fixed_points_only_where_the_map_is_fixed(solutions):
    _, fixed, _ = solutions
    for solver, sol in zip(FIXED, fixed, strict=True):
        ok = np.asarray(sol.result == ea.RESULTS.successful)
        f = np.asarray(jax.vmap(square_map)(sol.value, C))
        left, size = rms(f - np.asarray(sol.value)), rms(f)
        assert np.all(left[ok] <= 1e-5 * size[ok] + 1e-6), repr(solver)
        assert not np.any(ok & (C < 0)), repr(solver)


def test_minima_only_where_there_is_one_and_unbounded_energies_say_so(solutions):
    _, _, minima = solutions
    x0 = jnp.full(N, 0.7)
    start = np.asarray(jax.vmap(quadratic, (None, 0))(x0, C))
    for solver, sol in zip(MINIMA, minima, strict=True):
        ok = np.asarray(sol.result == ea.RESULTS.successful)
        grad = np.asarray(jax.vmap(jax.grad(quadratic))(sol.value, C))
        energy = np.asarray(jax.vmap(quadratic)(sol.value, C))
        assert np.all(rms(grad)[ok] <= 1e-6), repr(solver)
        assert np.all(energy[ok] <= start[ok]), repr(solver)
        assert not np.any(ok & (C <= 0)), repr(solver)
        assert np.all(np.asarray(sol.result == ea.RESULTS.unbounded)[C <= 0]), repr(solver)
        assert np.all(ok[C > 0.2]), repr(solver)


def test_the_audits_false_successes(user_mode):
    # Each of these was once reported "successful" at a point that is not a solution.
    solve = eqx.filter_jit(ea.root_find)
    sol = solve(lambda y, a: y**2 + 1, jnp.zeros(2), throw=False)
    assert sol.result == ea.RESULTS.no_root
    with pytest.raises(eqx.EquinoxRuntimeError, match="no root"):
        solve(lambda y, a: y**2 + 1, jnp.zeros(2))
    a, b = jnp.array([[1.0, 1.0], [1.0, 1.0]]), jnp.array([1.0, 2.0])
    sol = solve(lambda y, _: a @ y - b, jnp.zeros(2), throw=False)  # inconsistent
    assert sol.result == ea.RESULTS.no_root
    sol = eqx.filter_jit(ea.fixed_point)(
        lambda y, _: jnp.abs(y) + 1, jnp.ones(2), solver=ea.Newton(), throw=False
    )
    assert sol.result == ea.RESULTS.no_root
    unbounded = (lambda x, _: -jnp.sum(x**2), lambda x, _: jnp.sum(x))

    @eqx.filter_jit  # one program for the six solves
    def minimise_all():
        return [
            ea.minimise(energy, jnp.ones(2), solver=solver, throw=False).result
            for solver in MINIMA
            for energy in unbounded
        ]

    solvers = [solver for solver in MINIMA for _ in unbounded]
    for solver, result in zip(solvers, minimise_all(), strict=True):
        assert result == ea.RESULTS.unbounded, repr(solver)


@pytest.mark.parametrize("adjoint", [ea.ImplicitAdjoint(), ea.UnrolledAdjoint()], ids=repr)
def test_throw_holds_under_every_transformation(adjoint):
    # A solve cut short (3 steps, no convergence) used to raise only where its value was
    # used: under jax.jit(jax.grad(f)) or a JVP alone XLA dropped the check, and training
    # went on without a word.
    def f(x):
        map_ = lambda y, a: 0.999 * jnp.sin(y) + a  # noqa: E731
        return jnp.sum(ea.fixed_point(map_, jnp.zeros(2), x, max_steps=3, adjoint=adjoint).value)

    x = jnp.ones(2)
    transformations = {
        "jit(grad)": eqx.filter_jit(jax.grad(f)),
        "jit(jvp)": eqx.filter_jit(lambda x: jax.jvp(f, (x,), (x,))[1]),
        "jit(vmap(grad))": eqx.filter_jit(jax.vmap(jax.grad(f))),
    }
    for name, g in transformations.items():
        arg = jnp.stack([x, x]) if "vmap" in name else x
        with pytest.raises(eqx.EquinoxRuntimeError, match="did not converge"):
            jax.block_until_ready(g(arg))


def test_has_aux_on_every_entry_point(user_mode):
    # fn returns (output, aux): the solver sees the output; Solution.aux is the aux at the
    # solution, and differentiates through the solution's implicit derivatives.
    def cubic(y, a):
        return y**3 + a * y - 1, {"scaled": a * y}

    def map_(y, a):
        return 0.5 * jnp.tanh(y) + a, a * y

    def energy(x, a):
        return jnp.sum((x - a) ** 2 + x**4), jnp.sum(a * x)

    a = jnp.array([0.5, 1.0])
    cases = [(ea.root_find, cubic, lambda s: s.aux["scaled"]), (ea.fixed_point, map_, None)]
    cases += [(ea.minimise, energy, None)]
    for entry, fn, pick in cases:
        pick = pick or (lambda s: s.aux)

        def with_aux(a, entry=entry, fn=fn, pick=pick):
            return jnp.sum(pick(entry(fn, jnp.ones(2), a, has_aux=True)))

        def by_hand(a, entry=entry, fn=fn, pick=pick):
            value = entry(lambda y, a, fn=fn: fn(y, a)[0], jnp.ones(2), a).value
            return jnp.sum(
                pick(ea.Solution(value, ea.RESULTS.successful, 0, 0.0, aux=fn(value, a)[1]))
            )

        # Both in one compiled program.
        got, want = eqx.filter_jit(
            lambda a, f=with_aux, g=by_hand: (jax.value_and_grad(f)(a), jax.value_and_grad(g)(a))
        )(a)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-8)
    with pytest.raises(
        ValueError, match=r"has_aux=True, fn must return a pair \(output, aux\), got an array"
    ):
        ea.root_find(lambda y, a: y - 1, jnp.ones(2), has_aux=True)
    assert ea.root_find(lambda y, a: y - 1, jnp.ones(2)).aux is None


# --------------------------------------------------------------------------------------------
# Minima are minima: every minimiser on problems where a first-order
# stopping test is fooled, in one compiled program, under vmap, with `throw` both ways.


def _rosenbrock(x, _):
    return (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2


def _saddle(x, _):  # unbounded below along x1
    return x[0] ** 2 - x[1] ** 2


def _saddle_quartic(x, _):  # a saddle at 0, minima at (0, ±1/√2)
    return x[0] ** 2 - x[1] ** 2 + x[1] ** 4


def _maximum(x, _):  # a maximum at 0, minima at ±1/√2
    return jnp.sum(-(x**2) + x**4)


def _log_cosh(x, _):  # unbounded below; in float32 its gradient underflows to 0 near x = 88
    return -jnp.sum(jnp.log(jnp.cosh(x)))


F32 = jnp.float32
TRAPS = {
    # name: (energy, batch of starts, the minima (None: unbounded below), solvers)
    # Every minimiser on the two traps no first-order test sees (a saddle, an underflowed
    # gradient); the quasi-Newton-only traps with L-BFGS (each solve compiles for seconds).
    "saddle_quartic": (
        _saddle_quartic,
        jnp.array([[1.0, 0.0], [0.0, 0.0]]),
        [[0, 0.5**0.5]],
        range(len(MINIMA)),
    ),
    "log_cosh_f32": (_log_cosh, jnp.ones((2, 3), F32), None, range(len(MINIMA))),
    "rosenbrock_f32": (_rosenbrock, jnp.array([[-30.0, 30.0], [-1.2, 1.0]], F32), [[1, 1]], [0]),
    "saddle": (_saddle, jnp.array([[0.0, 0.0], [0.3, 0.0]]), None, [0]),
}


@eqx.filter_jit
def _solve_traps():
    return {
        (name, i): jax.vmap(lambda x0, f=f, s=MINIMA[i]: ea.minimise(f, x0, solver=s, throw=False))(
            starts
        )
        for name, (f, starts, _, solvers) in TRAPS.items()
        for i in solvers
    }


@pytest.fixture(scope="module")
def traps():
    return jax.device_get(_solve_traps())


@pytest.mark.parametrize("name", TRAPS)
def test_minimisers_walk_off_saddles_and_report_only_minima(traps, name):
    energy, starts, minima, solvers = TRAPS[name]
    for i in solvers:
        solver, sol = MINIMA[i], traps[name, i]
        ok = np.asarray(sol.result == ea.RESULTS.successful)
        if minima is None:  # unbounded below: said so, from every start
            assert np.all(np.asarray(sol.result == ea.RESULTS.unbounded)), (name, solver)
            continue
        value = np.asarray(sol.value, np.float64)
        # Success only at a minimum (up to the sign of each coordinate: the energies are even).
        distance = np.abs(np.abs(value[:, None]) - np.abs(np.asarray(minima))[None]).max(-1)
        tol = 1e-2 if starts.dtype == F32 else 1e-6
        assert np.all(distance.min(1)[ok] <= tol), (name, solver, value)
        assert np.all(ok), (name, solver, sol.result)


def test_minimise_throws_where_it_found_no_minimum(user_mode):
    with pytest.raises(eqx.EquinoxRuntimeError, match="without bound"):
        eqx.filter_jit(ea.minimise)(_log_cosh, jnp.ones(3, F32))
    sol = eqx.filter_jit(ea.minimise)(_maximum, jnp.zeros(1))  # walks to a minimum: no raise
    np.testing.assert_allclose(np.abs(sol.value), 0.5**0.5, rtol=1e-8)


def test_newton_krylov_converges_on_the_residual_of_f():
    # GMRES's inexact step leaves F's component along the small singular value of J
    # unsolved while its size is within the tolerance: no success before F itself is small.
    def fn(y, _):
        return jnp.array([1.0, 1e-6], F32) * y - 1

    for solver in ROOTS:
        sol = eqx.filter_jit(ea.root_find)(fn, jnp.zeros(2, F32), solver=solver, throw=False)
        left = np.asarray(fn(sol.value, None))
        assert sol.result == ea.RESULTS.successful, repr(solver)
        assert rms(left) <= 2 * float(np.finfo(np.float32).eps) ** 0.6, (repr(solver), left)


def test_searches_with_no_solution_say_so_and_tiny_residuals_are_solved():
    # No fixed point of y + 1, no finite root of exp(y): `no_root`, whose advice fits, not
    # `max_steps_reached`, whose advice ("raise max_steps") cannot help. (Within 50 steps:
    # Newton walks exp's y down by 1 a step, and near y = -88 exp(y) underflows in float32,
    # a root of F as computed, which the default 256 steps would reach.) A slow contraction
    # that ran out of steps while making progress keeps `max_steps_reached` (the control).
    # And F = 1e-22 (y - 1) in float32, whose squares underflow, is solved, not "converged"
    # at the start by a zero Krylov step.
    @eqx.filter_jit  # one program
    def solve():
        y0 = jnp.zeros(2, F32)
        return (
            [ea.fixed_point(lambda y, _: y + 1, y0, solver=s, throw=False) for s in FIXED],
            [
                ea.root_find(lambda y, _: jnp.exp(y), y0, solver=s, max_steps=50, throw=False)
                for s in ROOTS
            ],
            [
                ea.fixed_point(lambda y, _: 0.5 * y + 1, y0, solver=s, max_steps=3, throw=False)
                for s in FIXED[:1]
            ],
            [ea.root_find(lambda y, _: 1e-22 * (y - 1), y0, solver=s, throw=False) for s in ROOTS],
        )

    none, off, slow, tiny = solve()
    for solver, sol in zip(FIXED + ROOTS, none + off, strict=True):
        assert sol.result == ea.RESULTS.no_root, repr(solver)
    assert slow[0].result == ea.RESULTS.max_steps_reached
    for solver, sol in zip(ROOTS, tiny, strict=True):
        assert sol.result == ea.RESULTS.successful, repr(solver)
        np.testing.assert_allclose(sol.value, 1.0, rtol=1e-5, err_msg=repr(solver))


def test_one_max_steps_default_across_the_entry_points():
    # One bound for every solve, stated as a number in each docstring the reference renders.
    for entry in (ea.fixed_point, ea.root_find, ea.minimise):
        default = inspect.signature(entry).parameters["max_steps"].default
        assert default == DEFAULT_MAX_STEPS == 256, entry.__name__
        assert f"default {DEFAULT_MAX_STEPS}" in " ".join(entry.__doc__.split()), entry.__name__


def test_solver_arguments_are_checked_with_their_names():
    with pytest.raises(ValueError, match="restart must be a positive integer, got 0"):
        ea.GMRES(restart=0)
    with pytest.raises(ValueError, match="max_steps must be at most 2147483646"):
        ea.fixed_point(lambda y, a: 0.5 * y, jnp.ones(2), max_steps=10**12)
    with pytest.raises(ValueError, match="y0 of dtype bfloat16.*astype"):
        ea.root_find(lambda y, a: y - 1, jnp.zeros(2, jnp.bfloat16))
    with pytest.raises(ValueError, match=r"y0 must hold at least one number, got shapes \(0,\)"):
        ea.minimise(lambda x, a: jnp.sum(x**2), jnp.zeros(0))
    assert str(ea.RESULTS.successful).endswith("<successful>")


def test_dense_linear_algebra_makes_no_batched_lapack_call():
    # jaxlib 0.10's batched LAPACK kernels deadlock when a program runs as many of them at
    # once as XLA's pool has threads (README, "A known jaxlib hang on CPU"): a jit of several
    # gradients of SpinTransformerAttention(adjoint=ImplicitAdjoint(LU())) hung. Newton's
    # factorisations and the dense adjoints run their batches as loops of unbatched calls.
    import re

    def root(c):
        return ea.root_find(lambda y, c: y**3 + c * y - 1, jnp.ones(3), c).value

    def minimum(c, linear_solver):
        adjoint = ea.ImplicitAdjoint(linear_solver)
        energy = lambda x, c: jnp.sum(c * x**2 + x**4 - x)  # noqa: E731
        return ea.minimise(energy, jnp.ones(3), c, solver=ea.Newton(), adjoint=adjoint).value

    def fixed(c):
        map_ = lambda y, c: 0.5 * jnp.tanh(y + c)  # noqa: E731
        return ea.fixed_point(map_, jnp.zeros(3), c, adjoint=ea.ImplicitAdjoint(ea.LU())).value

    def programs(c):
        outs = [jax.jacrev(root)(c), jax.jacfwd(fixed)(c)]
        for linear_solver in (ea.LU(), ea.Cholesky(), ea.GMRES()):
            outs.append(jax.jacrev(lambda c, s=linear_solver: minimum(c, s))(c))
        return outs

    c = jnp.full((4, 3), 0.5)
    text = jax.jit(jax.vmap(programs)).lower(c).as_text()
    calls = re.findall(r'@(lapack_\w+)\(.*?num_batch_dims = "(\d+)"', text)
    assert calls and all(batch == "0" for _, batch in calls), sorted(set(calls))


def test_a_type_checker_sees_a_descents_energies_as_an_array():
    # The documented idiom `sol.energies[-1] < sol.energies[0]` must pass mypy/pyright, so
    # the field is declared as an array where a type checker reads it (under TYPE_CHECKING)
    # and Optional only at run time (checked with mypy by hand: "Value of type
    # 'Array | None' is not indexable" before, no error after).
    import ast
    import inspect

    source = inspect.getsource(ea.Solution)
    checker_view = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    assert checker_view, "Solution has no TYPE_CHECKING declarations"
    declared = {
        stmt.target.id: ast.unparse(stmt.annotation)
        for stmt in checker_view[0].body
        if isinstance(stmt, ast.AnnAssign)
    }
    assert declared.get("energies") == "Float[Array, ' steps']"
    # At run time a solver that records no energies still returns None.
    sol = ea.fixed_point(lambda y, _: 0.5 * y, jnp.ones(2))
    assert sol.energies is None


# --------------------------------------------------------------------------------------------
# Success means a solution, a derivative that does not exist is not a number, and exact
# solutions are successes (the audit of issue 63).


def _slow_map(y, _):  # contracts at rate 0.999: the residual is a thousandth of the error
    return y - 1e-3 * (y - 1)


def _double_root(y, a):  # the root sqrt(a): F' = 0 at a = 0, dy*/da = 1 / (2 sqrt(a))
    return y**2 - a


def _kinks(x, c):
    # c = 0: sum |x|, the minimum at 0, where JAX's derivative of |x| is 1, not 0.
    # c = 1: a kink at 0 that is not the minimum ((0.5, 0) is).
    return jnp.sum(jnp.abs(x)) + c * (x[0] ** 2 - 2 * x[0])


def _signed_sqrt(y, _):  # the exact root 0, where the Jacobian is infinite
    return jnp.sign(y) * jnp.sqrt(jnp.abs(y))


def _cube(y, _):  # a triple root: Newton's steps shrink by 2/3, the error is twice the step
    return y**3


def _fifth(y, _):  # rate 4/5; F (1e-20) and the merit (1e-40) reach round-off first
    return y**5


@eqx.filter_jit  # one program for the solves
def _edge_solves():
    y0 = jnp.zeros(2, F32)
    fixed = [ea.fixed_point(_slow_map, y0, solver=s, throw=False) for s in FIXED[:2]]
    # Both kinks in one L-BFGS program (each minimisation compiles for seconds).
    kinks = jax.vmap(lambda c: ea.minimise(_kinks, y0, c, throw=False))(jnp.array([0, 1], F32))
    roots = [ea.root_find(_signed_sqrt, jnp.ones(2, F32), solver=s, throw=False) for s in ROOTS]
    multiple = [ea.root_find(f, jnp.ones(2, F32), throw=False) for f in (_cube, _fifth)]
    return fixed, kinks, roots, multiple


def test_success_only_at_solutions_and_exact_solutions_succeed(user_mode):
    fixed, kinks, roots, multiple = _edge_solves()
    # A slow contraction: success only where the error (not the residual) is within the
    # tolerance, else `max_steps_reached` (Anderson once stopped at an error of 2.3e-3).
    tol = 2 * float(np.finfo(np.float32).eps) ** 0.6
    for solver, sol in zip(FIXED, fixed, strict=False):
        ok = sol.result == ea.RESULTS.successful
        assert ok or sol.result == ea.RESULTS.max_steps_reached, repr(solver)
        if ok:
            assert np.max(np.abs(np.asarray(sol.value) - 1)) <= tol, repr(solver)
    assert fixed[1].result == ea.RESULTS.successful  # Anderson extrapolates to it
    # A minimum at a kink (no descent, yet a nonzero subgradient) is a minimum; a kink with
    # a descent direction is not.
    ok = np.asarray(kinks.result == ea.RESULTS.successful)
    assert ok[0]
    np.testing.assert_array_equal(kinks.value[0], 0)
    assert not (ok[1] and np.all(np.asarray(kinks.value[1]) == 0)), kinks.value[1]
    # A root reached exactly where the Jacobian is infinite.
    for solver, sol in zip(ROOTS, roots, strict=True):
        assert sol.result == ea.RESULTS.successful, repr(solver)
        np.testing.assert_allclose(sol.value, 0, atol=1e-10, err_msg=repr(solver))
    # Newton at a multiple root converges linearly: it stops on the error its step rate
    # implies, not on the step (which once left an error of 1.3e-4 at y**3, 2.6e-4 at
    # y**5). The fifth power stops on round-off of the merit, within 1.5 times.
    tol = float(np.finfo(np.float32).eps) ** 0.6
    for sol, bound in zip(multiple, (tol, 1.5 * tol), strict=True):
        assert sol.result == ea.RESULTS.successful
        assert np.max(np.abs(np.asarray(sol.value))) <= bound, sol.value


def _root_of(a, solver=None, adjoint=None, throw=False):
    y0 = jnp.asarray(1.0, F32)
    return ea.root_find(_double_root, y0, a, solver=solver, adjoint=adjoint, throw=throw).value


@eqx.filter_jit  # one program for the derivatives
def _singular_derivatives():
    zero, one = jnp.asarray(0.0, F32), jnp.asarray(1.0, F32)
    lu = ea.ImplicitAdjoint(ea.LU())
    singular = {
        # Newton's LU factor; at a = 1e-12 too (the root 1e-6 is far below the tolerance).
        "Newton, its LU factor": jax.vmap(jax.grad(_root_of))(jnp.array([0.0, 1e-12], F32)),
        "Newton-Krylov, GMRES": jax.grad(lambda a: _root_of(a, ROOTS[1]))(zero),
        "ea.LU at the root": jax.grad(lambda a: _root_of(a, adjoint=lu))(zero),
        "forward mode": jax.jvp(_root_of, (zero,), (jnp.ones_like(zero),))[1],
    }
    return singular, jax.grad(_root_of)(one)


def test_derivatives_at_a_singular_jacobian_are_not_numbers(user_mode):
    # d sqrt(a)/da at a = 0 does not exist (+inf), and at a = 1e-12 the solve's tolerance,
    # not the problem, would set it: it once came out 4096.0 (Newton stops near y = 6e-5,
    # and the implicit derivative divided by the Jacobian 1.2e-4 there).
    singular, control = _singular_derivatives()
    for name, g in singular.items():
        assert not np.any(np.isfinite(g)), (name, g)
    np.testing.assert_allclose(control, 0.5, rtol=1e-4)
    with pytest.raises(eqx.EquinoxRuntimeError, match="does not exist"):
        grad = eqx.filter_jit(jax.grad(lambda a: _root_of(a, throw=True)))
        jax.block_until_ready(grad(jnp.asarray(0.0, F32)))
