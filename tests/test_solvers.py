"""The solver engine: `ea.fixed_point`, `ea.root_find`, `ea.minimise`, their solvers, result
codes, linear solvers and adjoints (first and second derivatives, forward and reverse)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg as jsl
import numpy as np
import pytest

import energyattn as ea
from energyattn._linalg import upper_cholesky
from energyattn._solver import _linear, bounded_while
from energyattn._solver._iterate import tree_where

TIGHT = dict(rtol=1e-13, atol=1e-13)
PICARD, ANDERSON = ea.Picard(**TIGHT), ea.Anderson(**TIGHT)
# A point and the two points of a central difference around it (at +- eps along a direction):
# one vmapped solve gives the gradient at the first and the values at the other two.
AT_AND_AROUND = np.array([0.0, 1.0, -1.0])


def _linear_problem(key, n=6, radius=0.5):
    ka, kb = jr.split(key)
    A = jr.normal(ka, (n, n))
    A = radius * A / np.max(np.abs(np.linalg.eigvals(np.asarray(A))))
    return A, jr.normal(kb, (n,))


def _affine(z, args):
    A, b = args
    return A @ z + b


# Solves whose closed forms the tests check, compiled: an eager solve compiles its loop anew on
# every call, and each eager operation around it is compiled on its own.
_fixed_point = eqx.filter_jit(ea.fixed_point)
_minimise = eqx.filter_jit(ea.minimise)


# --------------------------------------------------------------------------------------------
# Fixed points: values, stopping, result codes


@pytest.mark.parametrize(
    "solver", [PICARD, ea.Picard(damping=0.7, **TIGHT), ANDERSON, ea.Newton()], ids=repr
)
def test_linear_fixed_point_closed_form(getkey, solver):
    A, b = _linear_problem(getkey())
    solution = _fixed_point(_affine, jnp.zeros(6), (A, b), solver=solver, max_steps=400)
    exact = np.linalg.solve(np.eye(6) - np.asarray(A), np.asarray(b))
    assert solution.converged
    np.testing.assert_allclose(solution.value, exact, atol=1e-11)


def test_anderson_fewer_iterations_than_picard_on_linear_map(getkey):
    A, b = _linear_problem(getkey(), n=20, radius=0.9)
    run = jax.jit(lambda s: ea.fixed_point(_affine, jnp.zeros(20), (A, b), solver=s, max_steps=400))
    picard, anderson = run(PICARD), run(ANDERSON)
    np.testing.assert_allclose(anderson.value, picard.value, atol=1e-11)
    assert anderson.num_steps < picard.num_steps / 2


def test_a_longer_anderson_history_costs_no_steps_on_a_fast_contraction():
    # Each past residual's weight is regularised relative to its own size. A ridge scaled to
    # the whole history (the mean of the Gram diagonal, which the first, largest residuals
    # set) held the newest residuals back: on these maps 22 and 20 steps with a history of 8
    # against 15 and 13 with 2, and 9 instead of 7 steps for the spin-model layer at 65 tokens.
    n = 40
    A = jr.normal(jr.key(0), (n, n))
    A = 0.2 * A / np.max(np.abs(np.linalg.eigvals(np.asarray(A))))
    b = jr.normal(jr.key(1), (n,))

    @jax.jit
    def steps(A, b):
        maps = (_affine, lambda z, args: jnp.tanh(_affine(z, args)))
        return jnp.array(
            [
                [
                    ea.fixed_point(f, jnp.zeros(n), (A, b), solver=solver).num_steps
                    for solver in (ea.Anderson(1e-10, 1e-12, history=h) for h in (2, 8))
                ]
                for f in maps
            ]
        )

    short, long = np.asarray(steps(A, b)).T
    assert np.all(long <= short), (short, long)


def test_stopping_rule_and_step_count(getkey):
    A, b = _linear_problem(getkey())
    rtol, atol = 1e-4, 1e-6
    solver = ea.Picard(rtol=rtol, atol=atol)
    sol = ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=solver)
    # The residual is measured at the returned iterate's predecessor z_k: value = f(z_k).
    steps = int(sol.num_steps)
    z = jnp.zeros(6)
    for _ in range(steps - 1):
        z = _affine(z, (A, b))
    fz = _affine(z, (A, b))
    rms = lambda v: jnp.sqrt(jnp.mean(v**2))  # noqa: E731
    np.testing.assert_allclose(sol.value, fz, atol=1e-14)
    # f(z) - z cancels O(1) numbers: their round-off (1e-16) is what may differ (XLA fuses).
    np.testing.assert_allclose(sol.residual, rms(fz - z), rtol=0, atol=1e-14)
    assert rms(fz - z) <= atol + rtol * rms(fz)
    # One iteration fewer did not meet the rule.
    z_prev = jnp.zeros(6)
    for _ in range(steps - 2):
        z_prev = _affine(z_prev, (A, b))
    assert rms(_affine(z_prev, (A, b)) - z_prev) > atol + rtol * rms(_affine(z_prev, (A, b)))


def test_one_default_tolerance_policy_scales_with_the_dtype():
    # Every solver's default is eps ** 0.6 of the dtype being solved (docs/api/solvers.md);
    # the linear solvers of the adjoint apply the same `None` (see GMRES._run).
    for solver in (ea.Picard(), ea.Anderson(), ea.Newton(), ea.LBFGS()):
        for dtype in (jnp.float64, jnp.float32, jnp.bfloat16):
            expected = float(jnp.finfo(dtype).eps) ** 0.6
            assert solver.tolerances(dtype) == (expected, expected)
    for solver in (ea.Picard(), ea.Anderson(), ea.Newton(), ea.LBFGS(), ea.GMRES(), ea.CG()):
        assert solver.rtol is None and solver.atol is None


def test_default_fixed_point_tolerances_give_float64_accuracy(getkey):
    # The former fixed 1e-5 / 1e-6 left float64 solves at 1e-6; the default now reaches 1e-9.
    A, b = _linear_problem(getkey(), radius=0.5)
    exact = np.linalg.solve(np.eye(6) - np.asarray(A), np.asarray(b))
    solve = jax.jit(
        lambda A, b: [
            ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=s).value
            for s in (ea.Picard(), ea.Anderson())
        ]
    )
    for value in solve(A, b):
        np.testing.assert_allclose(value, exact, rtol=0, atol=1e-9 * np.abs(exact).max())
    for value in solve(A.astype(jnp.float32), b.astype(jnp.float32)):
        assert np.abs(np.asarray(value) - exact).max() < 1e-3 * np.abs(exact).max()


def test_result_codes_and_raises(getkey):
    A, b = _linear_problem(getkey(), radius=0.95)
    sol = ea.fixed_point(
        _affine, jnp.zeros(6), (A, b), solver=ea.Picard(), max_steps=3, throw=False
    )
    assert sol.result == ea.RESULTS.max_steps_reached and int(sol.num_steps) == 3
    with pytest.raises(eqx.EquinoxRuntimeError, match="did not converge within"):
        ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(), max_steps=3)
    # Spectral radius 2: Picard diverges, and says so.
    strong = 2 / 0.95 * A
    sol = ea.fixed_point(_affine, jnp.zeros(6), (strong, b), solver=ea.Picard(), throw=False)
    assert sol.result == ea.RESULTS.diverged and jnp.all(jnp.isfinite(sol.value))
    with pytest.raises(eqx.EquinoxRuntimeError, match="diverged"):
        eqx.filter_jit(
            lambda b: ea.fixed_point(_affine, jnp.zeros(6), (strong, b), solver=ea.Picard()).value
        )(b)

    def log_map(z, _):
        return jnp.log(z - 1.0)  # NaN below 1

    sol = ea.fixed_point(log_map, jnp.zeros(3), solver=ea.Picard(), throw=False)
    assert sol.result == ea.RESULTS.nonfinite
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-finite"):
        ea.fixed_point(log_map, jnp.zeros(3))


def test_eager_calls_compile_once_and_traced_calls_are_not_compiled_apart():
    # An eager entry point is one compiled program, reused by the next call with new values
    # (no backend compilation); a map closing over a tracer of the caller's jit is traced
    # into the caller's program and gives the same answer.
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if "backend_compile" in name else None
    )

    def fp(y, x):
        return jnp.tanh(0.5 * y + x)

    def root(y, x):
        return y**3 + y - x

    def energy(y, x):
        return jnp.sum((y - x) ** 2 + 0.1 * y**4)

    x1, x2, z = jnp.array([0.3, -1.0]), jnp.array([0.7, 0.2]), jnp.zeros(2)
    for entry, fn in ((ea.fixed_point, fp), (ea.root_find, root), (ea.minimise, energy)):
        first = entry(fn, z, x1)
        compiles.clear()
        second = entry(fn, z, x2)
        assert compiles == [], entry.__name__
        assert second.converged and not np.allclose(first.value, second.value)
    closed = jax.jit(lambda x: ea.fixed_point(lambda y, _: fp(y, x), z).value)
    np.testing.assert_allclose(closed(x2), ea.fixed_point(fp, z, x2).value, rtol=1e-12)


def test_vmap_stops_per_example_and_is_independent_of_the_batch(getkey):
    A, _ = _linear_problem(getkey())
    bs = jr.normal(getkey(), (3, 6)) * jnp.array([[1e-3], [1.0], [1e3]])

    def solve(b):
        return ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(rtol=1e-10))

    batched = jax.jit(jax.vmap(solve))
    together = batched(bs)
    alone = jax.jit(solve)  # one program for the three examples
    for i in range(3):
        single = alone(bs[i])
        assert int(together.num_steps[i]) == int(single.num_steps)
        np.testing.assert_allclose(together.value[i], single.value, rtol=1e-13, atol=1e-15)
    # A different batch around example 1 gives the same answer for it.
    other = batched(bs[np.array([1, 1])])
    np.testing.assert_allclose(other.value[0], together.value[1], rtol=1e-13)


# --------------------------------------------------------------------------------------------
# Derivatives through fixed points


@pytest.mark.parametrize(
    "adjoint",
    [
        ea.ImplicitAdjoint(),
        ea.ImplicitAdjoint(linear_solver=ea.GMRES(rtol=1e-13, atol=1e-13)),
        ea.UnrolledAdjoint(),
    ],
    ids=repr,
)
def test_linear_fixed_point_gradient_closed_form(getkey, adjoint):
    A, b = _linear_problem(getkey())

    def loss(A, b):
        solver = ea.Picard(**TIGHT)
        z = ea.fixed_point(
            _affine, jnp.zeros(6), (A, b), solver=solver, adjoint=adjoint, max_steps=400
        )
        return jnp.sum(jnp.sin(z.value))

    # Closed form: z = (I - A)^{-1} b, so db = (I - A)^{-T} cos(z) and dA = db z^T.
    gA, gb = jax.jit(jax.grad(loss, (0, 1)))(A, b)
    A, b = np.asarray(A), np.asarray(b)
    z = np.linalg.solve(np.eye(6) - A, b)
    db = np.linalg.solve((np.eye(6) - A).T, np.cos(z))
    np.testing.assert_allclose(gb, db, atol=1e-10)
    np.testing.assert_allclose(gA, np.outer(db, z), atol=1e-10)


def test_phantom_adjoint_is_jacobian_free_and_approaches_implicit(getkey):
    A, b = _linear_problem(getkey())

    @jax.jit
    def grads(b):
        def grad_b(adjoint):
            def loss(b):
                sol = ea.fixed_point(
                    _affine, jnp.zeros(6), (A, b), solver=PICARD, adjoint=adjoint, max_steps=400
                )
                return jnp.sum(jnp.sin(sol.value))

            return jax.grad(loss)(b)

        adjoints = [
            ea.PhantomAdjoint(),
            ea.PhantomAdjoint(num_steps=3),
            # Its steps are unrolled in Python, so each one adds to the compiled program: from
            # 50 steps on, the truncated series is within 1e-14 of the implicit gradient (here
            # and for other seeds of this problem).
            ea.PhantomAdjoint(num_steps=50),
            ea.ImplicitAdjoint(),
        ]
        return [grad_b(a) for a in adjoints]

    one, three, fifty, implicit = grads(b)
    A, b = np.asarray(A), np.asarray(b)
    z = np.linalg.solve(np.eye(6) - A, b)
    # One step of size 1: d/db f(z*, b) = I, so the gradient is the cotangent itself.
    np.testing.assert_allclose(one, np.cos(z), atol=1e-10)
    # k steps: the truncated Neumann series sum_{j<k} (A^T)^j cos(z).
    series = sum(np.linalg.matrix_power(A.T, j) @ np.cos(z) for j in range(3))
    np.testing.assert_allclose(three, series, atol=1e-10)
    np.testing.assert_allclose(fifty, implicit, atol=1e-10)
    with pytest.raises(ValueError, match="PhantomAdjoint differentiates steps of a fixed-point"):
        ea.root_find(lambda y, _: y, jnp.ones(2), adjoint=ea.PhantomAdjoint())


def _tanh_problem(seed, n=5):
    kw, kx, kv = jr.split(jr.key(seed), 3)
    W = jr.normal(kw, (n, n))
    W = 0.6 * W / jnp.linalg.norm(W, 2)
    return W, jr.normal(kx, (n,)), jr.normal(kv, (n,))


def _tanh(z, args):
    W, x = args
    return jnp.tanh(W @ z + x)


@jax.jit
def _tanh_derivatives(W, x, v):
    """Hessian, HVP and JVP of sum(z*^2) in x: implicit (Anderson, Newton), and 200 unrolled
    steps. Each from one forward-over-reverse pass, as `jax.hessian` computes the Hessian
    (JVPs of the gradient along the basis, vmapped), with v as one more tangent, and the
    value's own JVP alongside."""

    def implicit(x, solver):
        return jnp.sum(ea.fixed_point(_tanh, jnp.zeros_like(x), (W, x), solver=solver).value ** 2)

    def unrolled(x):
        z = jax.lax.fori_loop(0, 200, lambda _, z: _tanh(z, (W, x)), jnp.zeros_like(x))
        return jnp.sum(z**2)

    out = {}
    tangents = jnp.concatenate([jnp.eye(x.shape[0]), v[None]])
    for name, f in [
        ("anderson", lambda x: implicit(x, ANDERSON)),
        ("newton", lambda x: implicit(x, ea.Newton())),
        ("unrolled", unrolled),
    ]:
        _, (jvp, second) = jax.vmap(lambda t, f=f: jax.jvp(jax.value_and_grad(f), (x,), (t,)))(
            tangents
        )
        out[name] = (second[:-1], second[-1], jvp[-1])  # Hessian, HVP, JVP
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tanh_fixed_point_hessian_and_jvp_equal_200_unrolled_steps(seed):
    """The issue's check: z = tanh(Wz + x), second derivatives and forward mode to 1e-8."""
    out = _tanh_derivatives(*_tanh_problem(seed))
    for name in ("anderson", "newton"):
        for got, want in zip(out[name], out["unrolled"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


def test_pytree_state_closure_gradients_and_a_differentiated_initial_guess(getkey):
    A, b = _linear_problem(getkey())
    scale = jnp.array(0.5)

    def loss(scale_, b_, adjoint, start):
        def f(state, _):
            u, v = state["u"], state["v"]
            return {"u": scale_ * jnp.tanh(A @ v) + b_, "v": 0.5 * u}

        z0 = {"u": start * b_, "v": jnp.zeros(6)}  # the start may depend on the input
        out = ea.fixed_point(f, z0, adjoint=adjoint, solver=ANDERSON, max_steps=400).value
        return jnp.sum(out["u"] ** 2) + jnp.sum(jnp.cos(out["v"]))

    eps = 1e-6

    @jax.jit
    def all_gradients(scale, b):
        g = lambda adjoint, start: jax.grad(loss, (0, 1))(scale, b, adjoint, start)  # noqa: E731
        # The implicit gradients at scale, and the loss at scale +- eps: one vmapped solve.
        values, grads = jax.vmap(
            lambda s: jax.value_and_grad(loss, (0, 1))(s, b, ea.ImplicitAdjoint(), 0.0)
        )(scale + eps * AT_AND_AROUND)
        return (
            jax.tree.map(lambda g: g[0], grads),
            g(ea.ImplicitAdjoint(), 0.1),
            g(ea.UnrolledAdjoint(), 0.0),
            (values[1] - values[2]) / (2 * eps),
        )

    implicit, implicit_start, unrolled, fd = all_gradients(scale, b)
    for a, u, s in zip(implicit, unrolled, implicit_start, strict=True):
        np.testing.assert_allclose(a, u, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(a, s, rtol=1e-9, atol=1e-12)  # the start gets no gradient
    np.testing.assert_allclose(implicit[0], fd, rtol=1e-7)


def test_backward_failure_raises_and_names_the_derivative(getkey):
    A, b = _linear_problem(getkey(), radius=0.9)

    def loss(b):
        adjoint = ea.ImplicitAdjoint(
            linear_solver=ea.GMRES(rtol=1e-14, atol=0.0, restart=2, max_steps=2)
        )
        return jnp.sum(ea.fixed_point(_affine, jnp.zeros(6), (A, b), adjoint=adjoint).value)

    with pytest.raises(eqx.EquinoxRuntimeError, match="implicit differentiation failed.*ea.GMRES"):
        eqx.filter_jit(jax.grad(loss))(b)


# --------------------------------------------------------------------------------------------
# Roots


def _cubic(y, theta):
    return y**3 + theta * y - 1


@jax.jit
def _cubic_derivatives(theta, v):
    """The root; the gradient, Hessian and a JVP of a loss through it. The Hessian as
    `jax.hessian` computes it (JVPs of the gradient along the basis, vmapped), with v as one
    more tangent: the gradient is the primal output, the JVP the value's own tangent."""

    def loss(theta):
        return jnp.sum(ea.root_find(_cubic, jnp.ones(3), theta).value ** 2)

    root = ea.root_find(_cubic, jnp.ones(3), theta)
    tangents = jnp.concatenate([jnp.eye(3), v[None]])
    (_, grad), (jvp, hessian) = jax.vmap(
        lambda t: jax.jvp(jax.value_and_grad(loss), (theta,), (t,)), out_axes=(None, 0)
    )(tangents)
    return root, grad, hessian[:3], jvp[3]


def test_root_find_cubic_closed_form_derivatives():
    """y^3 + theta y - 1 = 0: y' = -y / (3y^2 + theta), y'' from differentiating that."""
    theta, v = np.array([0.5, 1.0, 2.0]), np.array([0.3, -1.0, 2.0])
    root, grad, hessian, jvp = _cubic_derivatives(theta, v)
    y = np.asarray(root.value)
    assert root.converged and root.num_steps <= 8
    np.testing.assert_allclose(_cubic(y, theta), 0, atol=1e-15)
    dy = -y / (3 * y**2 + theta)
    d2y = -(dy * (3 * y**2 + theta) - y * (6 * y * dy + 1)) / (3 * y**2 + theta) ** 2
    np.testing.assert_allclose(grad, 2 * y * dy, rtol=1e-12)
    np.testing.assert_allclose(hessian, np.diag(2 * dy**2 + 2 * y * d2y), atol=1e-12)
    np.testing.assert_allclose(jvp, np.dot(2 * y * dy, v), rtol=1e-12)


def _coupled_cubic(y, theta):
    # y^3 + theta y - 1 plus a nearest-neighbour coupling: a non-diagonal Jacobian.
    return y**3 + theta * y - 1 + 0.3 * (jnp.roll(y, 1) + jnp.roll(y, -1) - 2 * y)


@jax.jit
def _coupled_cubic_solves(theta):
    """The coupled cubic at 600 unknowns (above the dense limit) by Newton-Krylov, by dense
    Newton, and by Newton-Krylov allowed one Jacobian-vector product per step; with the
    gradient of a loss of the root (implicit, GMRES or LU)."""

    def solve(solver):
        return ea.root_find(_coupled_cubic, jnp.ones_like(theta), theta, solver=solver, throw=False)

    def grad(solver):
        return jax.grad(lambda theta: jnp.sum(jnp.sin(solve(solver).value)))(theta)

    auto, dense, starved = ea.Newton(), ea.Newton(jacobian="dense"), ea.Newton(krylov_steps=1)
    return solve(auto), solve(dense), solve(starved), grad(auto), grad(dense)


def test_newton_krylov_above_the_dense_limit_and_no_success_without_a_root():
    n = 600
    assert not ea.Newton().matrix_free(512) and ea.Newton().matrix_free(513)
    assert not ea.Newton(jacobian="dense").matrix_free(10**6)
    assert ea.Newton(jacobian="matrix-free").matrix_free(2)
    theta = np.linspace(0.5, 2.0, n)
    auto, dense, starved, grad_auto, grad_dense = _coupled_cubic_solves(theta)
    for solution in (auto, dense):
        assert solution.result == ea.RESULTS.successful
        np.testing.assert_allclose(_coupled_cubic(solution.value, theta), 0, atol=1e-12)
    np.testing.assert_allclose(auto.value, dense.value, atol=1e-12)
    np.testing.assert_allclose(grad_auto, grad_dense, rtol=1e-9, atol=1e-12)
    # One product per Krylov solve never solves the Newton system to its tolerance, so its
    # small steps are no evidence: it may say it converged only where the residual itself is
    # as small as the tolerances make it (relative to the start's).
    rtol = atol = float(np.finfo(np.float64).eps) ** 0.6
    start = np.sqrt(np.mean(np.square(_coupled_cubic(np.ones(n), theta))))
    left = np.sqrt(np.mean(np.square(_coupled_cubic(np.asarray(starved.value), theta))))
    assert starved.result != ea.RESULTS.successful or left <= atol + rtol * start
    with pytest.raises(ValueError, match="jacobian must be one of"):
        ea.Newton(jacobian="exact")


def test_root_find_solves_a_pytree_system():
    def fn(y, c):
        # x^2 + y^2 = c, x = 2 y: the root in the positive quadrant is y = sqrt(c / 5).
        return {"circle": y["x"] ** 2 + y["y"] ** 2 - c, "line": y["x"] - 2 * y["y"]}

    def solve(c):
        return ea.root_find(fn, {"x": jnp.ones(()), "y": jnp.ones(())}, c)

    @jax.jit
    def solution_and_derivatives(c):
        y = lambda c: solve(c).value["y"]  # noqa: E731
        return solve(c), jax.grad(y)(c), jax.jacfwd(jax.grad(y))(c)

    solution, dy, d2y = solution_and_derivatives(5.0)
    assert solution.converged
    np.testing.assert_allclose(solution.value["y"], 1.0, rtol=1e-14)
    np.testing.assert_allclose(solution.value["x"], 2.0, rtol=1e-14)
    # dy/dc = 1 / (2 sqrt(5 c)), d2y/dc2 = -1 / (4 sqrt(5) c^1.5)
    np.testing.assert_allclose(dy, 1 / (2 * np.sqrt(25.0)), rtol=1e-12)
    np.testing.assert_allclose(d2y, -1 / (4 * np.sqrt(5.0) * 5.0**1.5), rtol=1e-10)


def test_singular_root_converges_but_its_derivative_fails_loudly():
    """A non-isolated root (two copies of one equation): Newton's Jacobian is singular, so it
    steps along the merit's steepest descent and still gets there, but the implicit
    function theorem has no answer, and the error says it was the derivative's solve."""

    def fn(y, c):
        return jnp.stack([y[0] + y[1] - c, y[0] + y[1] - c])

    solution = eqx.filter_jit(ea.root_find)(fn, jnp.zeros(2), 1.0)
    assert solution.converged
    np.testing.assert_allclose(np.sum(solution.value), 1.0, rtol=1e-12)
    with pytest.raises(eqx.EquinoxRuntimeError, match="implicit differentiation failed.*singular"):
        eqx.filter_jit(jax.grad(lambda c: jnp.sum(ea.root_find(fn, jnp.zeros(2), c).value)))(1.0)


# --------------------------------------------------------------------------------------------
# Minima


def _quartic(x, a):
    return 0.5 * jnp.sum((x - a) ** 2) + 0.25 * jnp.sum(x**4)


@jax.jit
def _quartic_derivatives(a, v):
    """The minimiser, its Jacobian (forward and reverse mode), the Hessian of its sum and a
    JVP, with two solves per solver: each derivative program also returns what needs the
    same forward solve."""
    out = {}
    solvers = [("lbfgs", ea.LBFGS()), ("newton", ea.Newton())]
    for name, solver in solvers + [("chord", ea.Newton(chord_check=True))]:

        def argmin(a, solver=solver):
            return ea.minimise(_quartic, jnp.zeros(3), a, solver=solver).value

        # Forward mode, as `jax.jacfwd` computes it (JVPs along the basis, vmapped), with v
        # as a fourth tangent; the minimum is the primal output.
        tangents = jnp.concatenate([jnp.eye(3), v[None]])
        x, forward = jax.vmap(lambda t: jax.jvp(argmin, (a,), (t,)), out_axes=(None, 0))(tangents)

        # Reverse mode; forward over it, the Hessian of sum(argmin), as `jax.hessian`
        # computes it (the gradient of the sum is the column sum of the Jacobian).
        def reverse(a):
            jacobian = jax.jacrev(argmin)(a)
            return jnp.sum(jacobian, axis=0), jacobian

        hessian, jac_rev = jax.jacfwd(reverse, has_aux=True)(a)
        out[name] = (x, forward[:3].T, jac_rev, hessian, forward[3])
    return out


def test_minimiser_closed_form_derivatives():
    """argmin 1/2|x - a|^2 + 1/4 sum x^4: x + x^3 = a, so dx/da = 1 / (1 + 3x^2) and
    d2x/da2 = -6x / (1 + 3x^2)^3, elementwise. `chord_check` stops on the previous Hessian's
    step; its derivatives factorise the Hessian at the solution instead, so they stay exact."""
    a, v = np.array([0.5, -1.0, 2.0]), np.array([1.0, 0.5, -2.0])
    for x, jac_fwd, jac_rev, hess, jvp in _quartic_derivatives(a, v).values():
        x = np.asarray(x)
        np.testing.assert_allclose(x + x**3, a, rtol=1e-8)
        dx = 1 / (1 + 3 * x**2)
        np.testing.assert_allclose(jac_fwd, np.diag(dx), atol=1e-8)
        np.testing.assert_allclose(jac_rev, np.diag(dx), atol=1e-8)
        np.testing.assert_allclose(hess, np.diag(-6 * x / (1 + 3 * x**2) ** 3), atol=1e-8)
        np.testing.assert_allclose(jvp, dx * v, atol=1e-8)


def _double_well(x, a):
    return jnp.sum((x**2 - 1) ** 2) + 0.1 * jnp.dot(a, x)


def _unbounded(x, _):
    return -jnp.sum(x**2)


@eqx.filter_jit
def _minimum_and_unbounded(a, x0, solver):
    """A minimum of the double well (with its start energy, Hessian and gradient there) and
    the same solver on -|x|^2 from 0.5, in one compiled program."""
    solution = ea.minimise(_double_well, x0, a, solver=solver)
    curvature = jax.hessian(_double_well)(solution.value, a)
    unbounded = ea.minimise(_unbounded, jnp.full(3, 0.5), solver=solver, throw=False)
    start = _double_well(x0, a)
    return solution, start, curvature, jax.grad(_double_well)(solution.value, a), unbounded


@pytest.mark.parametrize(
    "solver",
    [ea.LBFGS(), ea.Newton(), ea.Newton(chord_check=True), ea.Newton(jacobian="matrix-free")],
    ids=repr,
)
def test_minimise_returns_minima_and_refuses_unbounded_energies(solver):
    """From near the double well's maximum, a local minimum (positive curvature, energy below
    the start); on -|x|^2 no success."""
    a, x0 = np.array([1.0, -1.0, 0.5]), np.full(3, 0.05)
    solution, start, curvature, grad, unbounded = _minimum_and_unbounded(a, x0, solver)
    assert solution.converged
    assert solution.stats["energy"] < start - 1
    assert np.all(np.linalg.eigvalsh(curvature) > 0)
    np.testing.assert_allclose(grad, 0, atol=1e-7)
    assert unbounded.result != ea.RESULTS.successful
    assert unbounded.stats["energy"] < -0.75  # it went downhill
    with pytest.raises(eqx.EquinoxRuntimeError):
        _minimise(_unbounded, np.full(3, 0.5), solver=solver)


def test_newton_walks_off_a_saddle_and_a_fixed_point_solver_reports_an_uphill_result():
    def saddle_energy(x, _):
        return 0.25 * x[0] ** 4 - 0.5 * x[0] ** 2 + 0.5 * x[1] ** 2

    # x[0] = 0 exactly: the gradient never leaves the saddle's stable manifold, so neither
    # does Newton (nor conjugate gradients' Krylov space); the certificate's Lanczos probe
    # finds the negative curvature there, and the solver walks on to a minimum (±1, 0).
    start = np.array([0.0, 1.0])
    for jacobian in ("dense", "matrix-free"):
        sol = _minimise(saddle_energy, start, solver=ea.Newton(jacobian=jacobian), throw=False)
        assert sol.result == ea.RESULTS.successful, jacobian
        np.testing.assert_allclose(np.abs(sol.value), [1.0, 0.0], atol=1e-8)
    # Anderson on the gradient map finds the maximum of the double well and says so.
    a, x0 = np.array([1.0, -1.0, 0.5]), np.full(3, 0.05)
    sol = _minimise(_double_well, x0, a, solver=ea.Anderson(), throw=False)
    assert sol.result == ea.RESULTS.increased


def test_minimise_hopfield_energy_is_iterated_softmax_attention(getkey):
    """The minimum of the log-sum-exp energy is the fixed point of softmax attention."""
    memory = jr.normal(getkey(), (5, 4))
    query = jr.normal(getkey(), (2, 4))
    beta = 2.0
    weights = jnp.arange(8.0).reshape(2, 4)

    def energy(q, mem):
        return ea.hopfield_energy(q, mem, beta=beta)

    def loss(memory, solver, adjoint, step_size=None):
        out = ea.minimise(
            energy,
            query,
            memory,
            solver=solver,
            adjoint=adjoint,
            step_size=step_size,
            max_steps=400,
        )
        return jnp.sum(out.value * weights), out

    direction = jr.normal(getkey(), memory.shape)
    eps = 1e-6

    @jax.jit
    def run(memory):
        picard = lambda adjoint: jax.grad(loss, has_aux=True)(memory, PICARD, adjoint, 0.5)  # noqa: E731
        lbfgs = lambda m: loss(m, ea.LBFGS(), ea.ImplicitAdjoint())  # noqa: E731
        # L-BFGS's gradient (and solution) at memory, and the loss at memory +- eps direction:
        # one vmapped solve.
        (values, solutions), grads = jax.vmap(
            lambda s: jax.value_and_grad(lbfgs, has_aux=True)(memory + s * eps * direction)
        )(AT_AND_AROUND)
        return (
            (grads[0], jax.tree.map(lambda leaf: leaf[0], solutions)),
            picard(ea.ImplicitAdjoint()),
            picard(ea.UnrolledAdjoint()),
            values[1:],
        )

    (lbfgs, sol), (picard, _), (unrolled, _), (plus, minus) = run(memory)
    energy_at = jax.jit(energy)(sol.value, memory)  # compiled apart from the solve
    q, memory = np.asarray(sol.value), np.asarray(memory)
    scores = beta * q @ memory.T
    softmax = np.exp(scores - scores.max(-1, keepdims=True))
    attention = softmax / softmax.sum(-1, keepdims=True) @ memory
    np.testing.assert_allclose(q, attention, atol=1e-9)
    np.testing.assert_allclose(sol.stats["energy"], energy_at, rtol=1e-14)
    np.testing.assert_allclose(lbfgs, picard, rtol=1e-7, atol=1e-9)
    # Plain gradient descent (Picard): its unrolled derivative converges to the implicit one.
    np.testing.assert_allclose(picard, unrolled, rtol=1e-8, atol=1e-11)
    np.testing.assert_allclose(np.sum(lbfgs * direction), (plus - minus) / (2 * eps), rtol=1e-6)


def test_upper_cholesky_is_the_transposed_lapack_factor_with_exact_zeros():
    """`U` with `U.T @ U = M`, zero below the diagonal (the mask is applied on `U` itself),
    NaN where `M` is not positive definite; the same under `vmap`."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 5, 5))
    spd = a @ np.swapaxes(a, 1, 2) + 5 * np.eye(5)
    indefinite = spd[0] - 20 * np.eye(5)
    batch = np.stack([spd[0], spd[1], indefinite])
    out = np.asarray(jax.jit(jax.vmap(upper_cholesky))(jnp.asarray(batch)))
    for k in range(2):
        np.testing.assert_array_equal(out[k], np.asarray(upper_cholesky(jnp.asarray(batch[k]))))
        np.testing.assert_allclose(out[k], np.linalg.cholesky(spd[k]).T, rtol=1e-13, atol=1e-13)
        assert np.all(np.tril(out[k], -1) == 0)
    assert np.all(np.isnan(out[2][np.triu_indices(5)])) and np.all(np.tril(out[2], -1) == 0)


@jax.jit
def _linear_solver_gradients(a):
    """The Hessian of a loss through the minimum with each linear solver in the implicit
    adjoint. The minimum is found by Newton (its loop compiles faster than L-BFGS's); the
    adjoint's solves do not depend on the forward solver (these four ignore its factor)."""
    solvers = [ea.LU(), ea.Cholesky(), ea.GMRES(rtol=1e-12), ea.CG(rtol=1e-12)]

    def loss(a, linear_solver):
        adjoint = ea.ImplicitAdjoint(linear_solver=linear_solver)
        x = ea.minimise(_quartic, jnp.zeros(3), a, solver=ea.Newton(), adjoint=adjoint).value
        return jnp.sum(jnp.sin(x)), x

    # Each Hessian with the minimum x it was taken at (`has_aux`: no separate solve).
    return [jax.hessian(loss, has_aux=True)(a, s) for s in solvers]


def test_every_linear_solver_gives_the_same_second_derivatives():
    a = np.array([0.5, -1.0, 2.0])
    (reference, x), *others = _linear_solver_gradients(a)
    x = np.asarray(x)
    dx, d2x = 1 / (1 + 3 * x**2), -6 * x / (1 + 3 * x**2) ** 3
    np.testing.assert_allclose(reference, np.diag(-np.sin(x) * dx**2 + np.cos(x) * d2x), atol=1e-8)
    for other, _ in others:
        np.testing.assert_allclose(other, reference, atol=1e-9)


def test_unrolled_adjoint_through_line_searches():
    """Newton and L-BFGS contain line searches; unrolled, they are scans that reverse mode
    differentiates, and the derivative of the converged iteration is the implicit one."""
    a = np.array([0.5, -1.0, 2.0])

    @jax.jit
    def grads(a):
        def g(solver, adjoint):
            def loss(a):
                return jnp.sum(
                    jnp.sin(
                        ea.minimise(
                            _quartic, jnp.zeros(3), a, solver=solver, adjoint=adjoint, max_steps=60
                        ).value
                    )
                )

            return jax.grad(loss)(a)

        # L-BFGS keeps 4 pairs, not 10: more than the 3 unknowns, and its two-loop recursion
        # (unrolled in Python, then differentiated through every pass) is a smaller program.
        return (
            g(ea.Newton(), ea.ImplicitAdjoint()),
            g(ea.Newton(), ea.UnrolledAdjoint()),
            g(ea.LBFGS(history=4), ea.UnrolledAdjoint()),
        )

    implicit, newton, lbfgs = grads(a)
    np.testing.assert_allclose(newton, implicit, rtol=1e-9)
    np.testing.assert_allclose(lbfgs, implicit, rtol=1e-6)


def _masked_scan(cond, body, init, max_passes, unrolled):
    """The unrolled loop as it was before `bounded_while` skipped finished passes: a `scan`
    of `max_passes` passes, each computing `body` and keeping the carry where `cond` fails."""

    def step(carry, _):
        return tree_where(cond(carry), body(carry), carry), None

    return jax.lax.scan(step, init, None, length=max_passes)[0]


def _loop_loss(x, y0, stop, max_passes, loop=bounded_while, calls=None):
    """`stop` passes of `y <- x sin(y) + y / 2` in a loop of at most `max_passes`; with
    `calls`, each evaluation of the body appends to it."""

    def body(carry):
        k, y = carry
        if calls is not None:  # (of y: a callback of nothing would leave the loop)
            jax.debug.callback(lambda _: calls.append(max_passes), y)
        return k + 1, x * jnp.sin(y) + 0.5 * y

    init = (jnp.zeros((), jnp.int32), y0)
    return jnp.sum(loop(lambda c: c[0] < stop, body, init, max_passes, True)[1] ** 2)


def test_unrolled_loop_is_the_masked_scan_but_skips_the_blocks_after_it_stops():
    """Unrolled, `bounded_while` gives what a `scan` of every pass up to its bound gives
    (value, gradient and JVP, per example under `vmap`; 100 passes at most: 7 groups of 8
    blocks of 2, the last cut short), but runs `body` only in the blocks the loop reaches:
    for 5 passes, 6 forward at a bound of 5 and at 49 (25 blocks, not grouped), 12 under
    `jax.grad` at 50 (the blocks that ran run again in the backward pass, from their
    checkpoints) and 18 at 100 (again for the group's checkpoint), where the masked scan
    runs 5, 49, 50 and 100."""
    calls = []

    @jax.jit
    def run(x, y0, stops):
        def derivatives(x, y0, stop, loop):
            f = lambda x, y0: _loop_loss(x, y0, stop, 100, loop)  # noqa: E731
            jvp = jax.jvp(f, (x, y0), (jnp.ones_like(x), jnp.ones_like(y0)))[1]
            return jax.value_and_grad(f, (0, 1))(x, y0), jvp

        batched = [
            jax.vmap(lambda x, y0, stop, loop=loop: derivatives(x, y0, stop, loop))(x, y0, stops)
            for loop in (bounded_while, _masked_scan)
        ]
        grads = [
            jax.value_and_grad(lambda x, m=m: _loop_loss(x, y0[1], 5, m, calls=calls))(x[1])
            for m in (50, 100)
        ]
        counted = [_loop_loss(x[1], y0[1], 5, m, calls=calls) for m in (5, 49)], grads
        return batched, counted

    x, y0, stops = jnp.array([0.7, 0.9]), jnp.array([[0.3, -1.0], [1.0, 2.0]]), jnp.array([3, 5])
    (bounded, masked), (values, grads) = jax.block_until_ready(run(x, y0, stops))
    jax.effects_barrier()
    for got, want in zip(jax.tree.leaves(bounded), jax.tree.leaves(masked), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15)
    # The second example alone, as in the batch, at every bound.
    (batched_value, (batched_grad, _)), _ = bounded
    for value, grad in grads:
        np.testing.assert_allclose([*values, value], batched_value[1], rtol=1e-15)
        np.testing.assert_allclose(grad, batched_grad[1], rtol=1e-14)
    assert {m: calls.count(m) for m in (5, 49, 50, 100)} == {5: 6, 49: 6, 50: 12, 100: 18}


def test_unrolled_fixed_point_is_the_same_whatever_max_steps_once_converged(getkey):
    """A solve that converges in k steps gives the same solution, statistics and gradient
    with max_steps=k as with 256, and at 256 evaluates the map in the blocks it reaches
    only, forward and twice more in the backward pass (256 times before the loop skipped
    finished passes)."""
    A, b = _linear_problem(getkey(), radius=0.2)
    steps = int(_fixed_point(_affine, jnp.zeros(6), (A, b), solver=PICARD).num_steps)
    calls = []

    def gradient(b, max_steps):
        def counted(z, args):  # (of z: a callback of nothing would be taken out of the loop)
            jax.debug.callback(lambda _: calls.append(max_steps), z)
            return _affine(z, args)

        def loss(b):
            sol = ea.fixed_point(
                counted,
                jnp.zeros(6),
                (A, b),
                solver=PICARD,
                adjoint=ea.UnrolledAdjoint(),
                max_steps=max_steps,
            )
            return jnp.sum(jnp.sin(sol.value)), sol

        return jax.grad(loss, has_aux=True)(b)

    both = jax.jit(lambda b: [gradient(b, m) for m in (steps, 256)])
    (grad_k, sol_k), (grad, sol) = jax.block_until_ready(both(b))
    jax.effects_barrier()
    assert sol.converged and int(sol.num_steps) == steps < 30
    # Up to one frozen pass after the last step, run three times (forward and checkpoints).
    assert calls.count(256) <= 3 * (steps + 1)
    short, default = jax.tree.leaves((grad_k, sol_k)), jax.tree.leaves((grad, sol))
    for got, want in zip(short, default, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-15)
    A, b = np.asarray(A), np.asarray(b)
    z = np.linalg.solve(np.eye(6) - A, b)
    np.testing.assert_allclose(grad, np.linalg.solve((np.eye(6) - A).T, np.cos(z)), atol=1e-10)


def test_unrolled_gradient_memory_does_not_grow_with_max_steps(getkey):
    """Reverse mode through an unrolled solve stores states per group of passes, not the
    map's constants per group or per pass: the compiled gradient's temporary memory at
    max_steps=256 is within 1.5x of that at 100 (both grouped; storing the 128x128 matrix
    per group made it 2.5x that at 16), a few copies of the matrix in all (the cotangent
    accumulators of the nested scans)."""
    n = 128
    W = jax.random.normal(getkey(), (n, n))
    W, x = 0.5 * W / jnp.linalg.norm(W, 2), jax.random.normal(getkey(), (n,))

    def temp_bytes(max_steps):
        def loss(W):
            sol = ea.fixed_point(
                lambda z, a: jnp.tanh(a[0] @ z + a[1]),
                jnp.zeros(n),
                (W, x),
                solver=ea.Picard(),
                adjoint=ea.UnrolledAdjoint(),
                max_steps=max_steps,
            )
            return jnp.sum(sol.value**2)

        return jax.jit(jax.grad(loss)).lower(W).compile().memory_analysis().temp_size_in_bytes

    short, default = temp_bytes(100), temp_bytes(256)
    assert default <= 1.5 * short, (short, default)
    assert default <= 6 * W.nbytes, default / W.nbytes


# --------------------------------------------------------------------------------------------
# Arguments


def test_bad_arguments(user_mode):
    with pytest.raises(ValueError, match="same structure and shapes"):
        ea.fixed_point(lambda z, _: jnp.zeros(4), jnp.zeros(3))
    with pytest.raises(ValueError, match="solver must be an ea solver"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), solver="anderson")
    with pytest.raises(ValueError, match="cannot use LBFGS"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), solver=ea.LBFGS())
    with pytest.raises(ValueError, match="cannot use Anderson"):
        ea.root_find(lambda z, _: z, jnp.zeros(3), solver=ea.Anderson())
    with pytest.raises(ValueError, match="adjoint must be"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), adjoint="implicit")
    with pytest.raises(ValueError, match="damping must be in"):
        ea.Picard(damping=1.5)
    with pytest.raises(ValueError, match="history must be a positive integer"):
        ea.Anderson(history=0)
    with pytest.raises(ValueError, match="mixing must be"):
        ea.Anderson(mixing=0.0)
    with pytest.raises(ValueError, match="rtol must be >= 0"):
        ea.Picard(rtol=-1.0)
    with pytest.raises(ValueError, match="divergence must be > 1"):
        ea.Anderson(divergence=0.5)
    with pytest.raises(ValueError, match="armijo must be in"):
        ea.Newton(armijo=1.0)
    with pytest.raises(ValueError, match="linear_solver=.*must be"):
        ea.ImplicitAdjoint(linear_solver="cg")
    with pytest.raises(ValueError, match="floating-point"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3, int))
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), max_steps=0)
    with pytest.raises(ValueError, match="scalar"):
        ea.minimise(lambda x, _: x, jnp.zeros(3))
    with pytest.raises(ValueError, match="scalar"):
        ea.minimise(lambda x, _: x, jnp.zeros(3), solver=ea.Picard())
    with pytest.raises(ValueError, match="step_size must be > 0"):
        ea.minimise(lambda x, _: jnp.sum(x**2), jnp.zeros(3), solver=ea.Picard(), step_size=0.0)
    with pytest.raises(ValueError, match="step_size applies to fixed-point solvers"):
        ea.minimise(lambda x, _: jnp.sum(x**2), jnp.zeros(3), step_size=0.1)


def test_derivatives_with_respect_to_python_floats():
    """`jax.grad(f)(5.0)` traces a Python float; its derivative must not be lost, whether it
    reaches the solve through `args` or through a closure."""
    grads = [
        jax.grad(lambda c: ea.fixed_point(lambda z, _: 0.5 * z + c, jnp.zeros(2)).value.sum()),
        jax.grad(lambda c: ea.root_find(lambda y, c: y - c, jnp.zeros(2), c).value.sum()),
        jax.grad(
            lambda c: ea.minimise(lambda x, _: jnp.sum((x - c) ** 2), jnp.zeros(2)).value.sum()
        ),
    ]
    for grad, want in zip(grads, [4.0, 2.0, 2.0], strict=True):
        np.testing.assert_allclose(grad(5.0), want, rtol=1e-9)


def test_matrix_free_adjoint_is_relative_to_the_gradients_scale():
    # A mean over 600 float32 entries makes the cotangent of the implicit solve tiny (1e-7):
    # against an absolute tolerance GMRES "solved" it with zero, a silently zero gradient.
    n = 600
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)) / np.sqrt(n), jnp.float32)
    x = jnp.linspace(-1, 1, n, dtype=jnp.float32)

    def loss(x, scale):
        fixed = ea.fixed_point(lambda z, x: x + 0.5 * jnp.tanh(a @ z), jnp.zeros_like(x), x)
        return scale * jnp.mean(jnp.square(fixed.value))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    small, unit = grad(x, 1e-6), grad(x, 1.0)
    assert float(jnp.linalg.norm(unit)) > 1e-4
    np.testing.assert_allclose(small, 1e-6 * unit, rtol=1e-3, atol=1e-12)


def test_gmres_stops_as_soon_as_the_residual_is_small():
    """Issue 34: GMRES spends no product beyond its tolerance (JAX's batched GMRES took
    `restart` products per cycle whatever the system). On I + a rank-3 matrix the Krylov
    space holds the solution after 4 products; with restart 3 it converges by cycles;
    under vmap each example gets its own solution; `max_steps` caps the products."""
    from energyattn._solver._krylov import gmres

    rng = np.random.default_rng(0)
    A = jnp.eye(40) + jnp.asarray(rng.normal(size=(40, 3)) @ rng.normal(size=(3, 40)) / 3)
    b = jnp.asarray(rng.normal(size=(3, 40)))
    products = []

    def matvec(v):
        jax.debug.callback(lambda: products.append(1))
        return A @ v

    @jax.jit
    def solve(b):
        return gmres(matvec, b, tol=1e-12, atol=0.0, restart=20, max_steps=100)

    x = solve(b[0])
    np.testing.assert_allclose(A @ x, b[0], atol=1e-12)
    assert len(products) <= 5  # 4 Arnoldi steps and the true residual
    B = 3 * jnp.eye(40) + jnp.asarray(rng.normal(size=(40, 40)) / np.sqrt(40))
    x = jax.vmap(lambda b: gmres(B.__matmul__, b, tol=1e-12, atol=0.0, restart=3, max_steps=200))(b)
    np.testing.assert_allclose(x, np.linalg.solve(B, b.T).T, atol=1e-10)
    products.clear()
    slow = jnp.linspace(0.01, 1.0, 100)  # a spread spectrum: slow convergence

    def slow_matvec(v):
        jax.debug.callback(lambda: products.append(1))
        return slow * v

    gmres(slow_matvec, jnp.ones(100), tol=1e-12, atol=0.0, restart=5, max_steps=12)
    assert len(products) <= 12 + 3  # the cap, and the true residual after each cycle


@pytest.mark.parametrize("symmetric, limit", [(False, 16), (True, 8)])
def test_the_automatic_adjoint_is_dense_up_to_its_measured_limit(symmetric, limit):
    """Issue 34: the default linear solve of the implicit adjoint builds the n x n matrix
    (LU / Cholesky) up to the limit measured on the CPU, and is matrix-free (GMRES / CG)
    above (on a GPU the limits are larger: `DENSE_ADJOINT_LIMITS`)."""
    assert _linear.dense_adjoint_limit(symmetric) == limit

    def program(n):
        matvec = lambda v: 2 * v + 0.1 * (jnp.roll(v, 1) + jnp.roll(v, -1))  # noqa: E731
        solve = lambda b: ea.AutoLinearSolver().solve(  # noqa: E731
            matvec, b, symmetric=symmetric, factor=None, throw=False
        )
        b = jnp.linspace(0.1, 0.2, n)
        np.testing.assert_allclose(matvec(jax.jit(solve)(b)), b, rtol=1e-6)
        return jax.jit(solve).lower(b).as_text()  # the solve is a primitive: its lowering

    factorise = "potrf" if symmetric else "getrf"  # LAPACK's Cholesky / LU, in the program
    dense, matrix_free = program(limit), program(limit + 1)
    # No Krylov loop in the dense solve: its only loops are those of the factorisation's own
    # lowering (LU turns its pivots into a permutation in a loop; Cholesky has none).
    factor = jsl.cho_factor if symmetric else jsl.lu_factor
    solve_with = jsl.cho_solve if symmetric else jsl.lu_solve
    alone = jax.jit(lambda a, b: solve_with(factor(a), b)).lower(jnp.eye(limit), jnp.ones(limit))
    loops = alone.as_text().count("stablehlo.while")
    assert factorise in dense and dense.count("stablehlo.while") == loops
    assert factorise not in matrix_free and "stablehlo.while" in matrix_free
