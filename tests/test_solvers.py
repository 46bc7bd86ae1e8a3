"""The solver engine: `ea.fixed_point`, `ea.root_find`, `ea.minimise`, their solvers, result
codes, linear solvers and adjoints (first and second derivatives, forward and reverse)."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

TIGHT = dict(rtol=1e-13, atol=1e-13)
PICARD, ANDERSON = ea.Picard(**TIGHT), ea.Anderson(**TIGHT)


def _linear_problem(key, n=6, radius=0.5):
    ka, kb = jr.split(key)
    A = jr.normal(ka, (n, n))
    A = radius * A / np.max(np.abs(np.linalg.eigvals(np.asarray(A))))
    return A, jr.normal(kb, (n,))


def _affine(z, args):
    A, b = args
    return A @ z + b


# --------------------------------------------------------------------------------------------
# Fixed points: values, stopping, result codes


@pytest.mark.parametrize(
    "solver", [PICARD, ea.Picard(damping=0.7, **TIGHT), ANDERSON, ea.Newton()], ids=repr
)
def test_linear_fixed_point_closed_form(getkey, solver):
    A, b = _linear_problem(getkey())
    solution = ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=solver, max_steps=400)
    exact = jnp.linalg.solve(jnp.eye(6) - A, b)
    assert solution.converged
    np.testing.assert_allclose(solution.value, exact, atol=1e-11)


def test_anderson_fewer_iterations_than_picard_on_linear_map(getkey):
    A, b = _linear_problem(getkey(), n=20, radius=0.9)
    run = jax.jit(lambda s: ea.fixed_point(_affine, jnp.zeros(20), (A, b), solver=s, max_steps=400))
    picard, anderson = run(PICARD), run(ANDERSON)
    np.testing.assert_allclose(anderson.value, picard.value, atol=1e-11)
    assert anderson.num_steps < picard.num_steps / 2


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


def test_vmap_stops_per_example_and_is_independent_of_the_batch(getkey):
    A, _ = _linear_problem(getkey())
    bs = jr.normal(getkey(), (3, 6)) * jnp.array([[1e-3], [1.0], [1e3]])

    def solve(b):
        return ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(rtol=1e-10))

    batched = jax.jit(jax.vmap(solve))(bs)
    for i in range(3):
        alone = solve(bs[i])
        assert int(batched.num_steps[i]) == int(alone.num_steps)
        np.testing.assert_allclose(batched.value[i], alone.value, rtol=1e-13, atol=1e-15)
    # A different batch around example 1 gives the same answer for it.
    other = jax.vmap(solve)(bs[jnp.array([1, 1])])
    np.testing.assert_allclose(other.value[0], batched.value[1], rtol=1e-13)


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
    z = jnp.linalg.solve(jnp.eye(6) - A, b)
    db = jnp.linalg.solve((jnp.eye(6) - A).T, jnp.cos(z))
    gA, gb = jax.jit(jax.grad(loss, (0, 1)))(A, b)
    np.testing.assert_allclose(gb, db, atol=1e-10)
    np.testing.assert_allclose(gA, jnp.outer(db, z), atol=1e-10)


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
            ea.PhantomAdjoint(num_steps=80),
            ea.ImplicitAdjoint(),
        ]
        return [grad_b(a) for a in adjoints]

    one, three, eighty, implicit = grads(b)
    z = jnp.linalg.solve(jnp.eye(6) - A, b)
    # One step of size 1: d/db f(z*, b) = I, so the gradient is the cotangent itself.
    np.testing.assert_allclose(one, jnp.cos(z), atol=1e-10)
    # k steps: the truncated Neumann series sum_{j<k} (A^T)^j cos(z).
    series = sum(jnp.linalg.matrix_power(A.T, j) @ jnp.cos(z) for j in range(3))
    np.testing.assert_allclose(three, series, atol=1e-10)
    np.testing.assert_allclose(eighty, implicit, atol=1e-10)
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
    """Hessian and JVP of sum(z*^2) in x: implicit (Anderson, Newton), and 200 unrolled steps."""

    def implicit(x, solver):
        return jnp.sum(ea.fixed_point(_tanh, jnp.zeros_like(x), (W, x), solver=solver).value ** 2)

    def unrolled(x):
        z = jax.lax.fori_loop(0, 200, lambda _, z: _tanh(z, (W, x)), jnp.zeros_like(x))
        return jnp.sum(z**2)

    out = {}
    for name, f in [
        ("anderson", lambda x: implicit(x, ANDERSON)),
        ("newton", lambda x: implicit(x, ea.Newton())),
        ("unrolled", unrolled),
    ]:
        out[name] = (
            jax.hessian(f)(x),
            jax.jvp(jax.grad(f), (x,), (v,))[1],
            jax.jvp(f, (x,), (v,))[1],
        )
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

    @jax.jit
    def all_gradients(scale, b):
        g = lambda adjoint, start: jax.grad(loss, (0, 1))(scale, b, adjoint, start)  # noqa: E731
        return (
            g(ea.ImplicitAdjoint(), 0.0),
            g(ea.ImplicitAdjoint(), 0.1),
            g(ea.UnrolledAdjoint(), 0.0),
        )

    implicit, implicit_start, unrolled = all_gradients(scale, b)
    eps = 1e-6
    fd = (
        loss(scale + eps, b, ea.ImplicitAdjoint(), 0.0)
        - loss(scale - eps, b, ea.ImplicitAdjoint(), 0.0)
    ) / (2 * eps)
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
    def loss(theta):
        return jnp.sum(ea.root_find(_cubic, jnp.ones(3), theta).value ** 2)

    root = ea.root_find(_cubic, jnp.ones(3), theta)
    return root, jax.grad(loss)(theta), jax.hessian(loss)(theta), jax.jvp(loss, (theta,), (v,))[1]


def test_root_find_cubic_closed_form_derivatives():
    """y^3 + theta y - 1 = 0: y' = -y / (3y^2 + theta), y'' from differentiating that."""
    theta, v = jnp.array([0.5, 1.0, 2.0]), jnp.array([0.3, -1.0, 2.0])
    root, grad, hessian, jvp = _cubic_derivatives(theta, v)
    y = root.value
    assert root.converged and root.num_steps <= 8
    np.testing.assert_allclose(_cubic(y, theta), 0, atol=1e-15)
    dy = -y / (3 * y**2 + theta)
    d2y = -(dy * (3 * y**2 + theta) - y * (6 * y * dy + 1)) / (3 * y**2 + theta) ** 2
    np.testing.assert_allclose(grad, 2 * y * dy, rtol=1e-12)
    np.testing.assert_allclose(hessian, jnp.diag(2 * dy**2 + 2 * y * d2y), atol=1e-12)
    np.testing.assert_allclose(jvp, jnp.dot(2 * y * dy, v), rtol=1e-12)


def test_root_find_solves_a_pytree_system():
    def fn(y, c):
        # x^2 + y^2 = c, x = 2 y: the root in the positive quadrant is y = sqrt(c / 5).
        return {"circle": y["x"] ** 2 + y["y"] ** 2 - c, "line": y["x"] - 2 * y["y"]}

    def solve(c):
        return ea.root_find(fn, {"x": jnp.ones(()), "y": jnp.ones(())}, c)

    solution = jax.jit(solve)(jnp.asarray(5.0))
    assert solution.converged
    np.testing.assert_allclose(solution.value["y"], 1.0, rtol=1e-14)
    np.testing.assert_allclose(solution.value["x"], 2.0, rtol=1e-14)
    # dy/dc = 1 / (2 sqrt(5 c)), d2y/dc2 = -1 / (4 sqrt(5) c^1.5)
    dy = jax.jit(jax.grad(lambda c: solve(c).value["y"]))(5.0)
    d2y = jax.jit(jax.jacfwd(jax.grad(lambda c: solve(c).value["y"])))(5.0)
    np.testing.assert_allclose(dy, 1 / (2 * np.sqrt(25.0)), rtol=1e-12)
    np.testing.assert_allclose(d2y, -1 / (4 * np.sqrt(5.0) * 5.0**1.5), rtol=1e-10)


def test_singular_root_converges_but_its_derivative_fails_loudly():
    """A non-isolated root (two copies of one equation): Newton's Jacobian is singular, so it
    steps along the merit's steepest descent and still gets there, but the implicit
    function theorem has no answer, and the error says it was the derivative's solve."""

    def fn(y, c):
        return jnp.stack([y[0] + y[1] - c, y[0] + y[1] - c])

    solution = ea.root_find(fn, jnp.zeros(2), 1.0)
    assert solution.converged
    np.testing.assert_allclose(jnp.sum(solution.value), 1.0, rtol=1e-12)
    with pytest.raises(eqx.EquinoxRuntimeError, match="implicit differentiation failed.*singular"):
        eqx.filter_jit(jax.grad(lambda c: jnp.sum(ea.root_find(fn, jnp.zeros(2), c).value)))(1.0)


# --------------------------------------------------------------------------------------------
# Minima


def _quartic(x, a):
    return 0.5 * jnp.sum((x - a) ** 2) + 0.25 * jnp.sum(x**4)


@jax.jit
def _quartic_derivatives(a, v):
    out = {}
    solvers = [("lbfgs", ea.LBFGS()), ("newton", ea.Newton())]
    for name, solver in solvers + [("chord", ea.Newton(chord_check=True))]:

        def argmin(a, solver=solver):
            return ea.minimise(_quartic, jnp.zeros(3), a, solver=solver).value

        out[name] = (
            argmin(a),
            jax.jacfwd(argmin)(a),
            jax.jacrev(argmin)(a),
            jax.hessian(lambda a: jnp.sum(argmin(a)))(a),
            jax.jvp(argmin, (a,), (v,))[1],
        )
    return out


def test_minimiser_closed_form_derivatives():
    """argmin 1/2|x - a|^2 + 1/4 sum x^4: x + x^3 = a, so dx/da = 1 / (1 + 3x^2) and
    d2x/da2 = -6x / (1 + 3x^2)^3, elementwise. `chord_check` stops on the previous Hessian's
    step; its derivatives factorise the Hessian at the solution instead, so they stay exact."""
    a, v = jnp.array([0.5, -1.0, 2.0]), jnp.array([1.0, 0.5, -2.0])
    for x, jac_fwd, jac_rev, hess, jvp in _quartic_derivatives(a, v).values():
        np.testing.assert_allclose(x + x**3, a, rtol=1e-8)
        dx = 1 / (1 + 3 * x**2)
        np.testing.assert_allclose(jac_fwd, jnp.diag(dx), atol=1e-8)
        np.testing.assert_allclose(jac_rev, jnp.diag(dx), atol=1e-8)
        np.testing.assert_allclose(hess, jnp.diag(-6 * x / (1 + 3 * x**2) ** 3), atol=1e-8)
        np.testing.assert_allclose(jvp, dx * v, atol=1e-8)


def _double_well(x, a):
    return jnp.sum((x**2 - 1) ** 2) + 0.1 * jnp.dot(a, x)


@pytest.mark.parametrize("solver", [ea.LBFGS(), ea.Newton(), ea.Newton(chord_check=True)], ids=repr)
def test_minimise_returns_minima_and_refuses_unbounded_energies(solver):
    """From near the double well's maximum, a local minimum (positive curvature, energy below
    the start); on -|x|^2 no success."""
    a, x0 = jnp.array([1.0, -1.0, 0.5]), 0.05 * jnp.ones(3)
    solution = ea.minimise(_double_well, x0, a, solver=solver)
    assert solution.converged
    assert solution.stats["energy"] < _double_well(x0, a) - 1
    assert np.all(np.linalg.eigvalsh(jax.hessian(_double_well)(solution.value, a)) > 0)
    np.testing.assert_allclose(jax.grad(_double_well)(solution.value, a), 0, atol=1e-7)
    unbounded = ea.minimise(
        lambda x, _: -jnp.sum(x**2), 0.5 * jnp.ones(3), solver=solver, throw=False
    )
    assert unbounded.result != ea.RESULTS.successful
    assert unbounded.stats["energy"] < -0.75  # it went downhill
    with pytest.raises(eqx.EquinoxRuntimeError):
        ea.minimise(lambda x, _: -jnp.sum(x**2), 0.5 * jnp.ones(3), solver=solver)


def test_newton_reports_a_saddle_and_a_fixed_point_solver_an_uphill_result():
    def saddle_energy(x, _):
        return 0.25 * x[0] ** 4 - 0.5 * x[0] ** 2 + 0.5 * x[1] ** 2

    # x[0] = 0 exactly: the gradient never leaves the saddle's stable manifold.
    sol = ea.minimise(saddle_energy, jnp.array([0.0, 1.0]), solver=ea.Newton(), throw=False)
    assert sol.result == ea.RESULTS.indefinite
    with pytest.raises(eqx.EquinoxRuntimeError, match="not a minimum"):
        ea.minimise(saddle_energy, jnp.array([0.0, 1.0]), solver=ea.Newton())
    # Anderson on the gradient map finds the maximum of the double well and says so.
    a, x0 = jnp.array([1.0, -1.0, 0.5]), 0.05 * jnp.ones(3)
    sol = ea.minimise(_double_well, x0, a, solver=ea.Anderson(), throw=False)
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

    @jax.jit
    def run(memory):
        picard = lambda adjoint: jax.grad(loss, has_aux=True)(memory, PICARD, adjoint, 0.5)  # noqa: E731
        return (
            jax.grad(loss, has_aux=True)(memory, ea.LBFGS(), ea.ImplicitAdjoint()),
            picard(ea.ImplicitAdjoint()),
            picard(ea.UnrolledAdjoint()),
        )

    (lbfgs, sol), (picard, _), (unrolled, _) = run(memory)
    q = sol.value
    attention = jax.nn.softmax(beta * q @ memory.T, axis=-1) @ memory
    np.testing.assert_allclose(q, attention, atol=1e-9)
    np.testing.assert_allclose(sol.stats["energy"], energy(q, memory), rtol=1e-14)
    np.testing.assert_allclose(lbfgs, picard, rtol=1e-7, atol=1e-9)
    # Plain gradient descent (Picard): its unrolled derivative converges to the implicit one.
    np.testing.assert_allclose(picard, unrolled, rtol=1e-8, atol=1e-11)
    direction = jr.normal(getkey(), memory.shape)
    eps = 1e-6
    plus = loss(memory + eps * direction, ea.LBFGS(), ea.ImplicitAdjoint())[0]
    minus = loss(memory - eps * direction, ea.LBFGS(), ea.ImplicitAdjoint())[0]
    np.testing.assert_allclose(jnp.sum(lbfgs * direction), (plus - minus) / (2 * eps), rtol=1e-6)


@jax.jit
def _linear_solver_gradients(a):
    solvers = [ea.LU(), ea.Cholesky(), ea.GMRES(rtol=1e-12), ea.CG(rtol=1e-12)]

    def loss(a, linear_solver):
        adjoint = ea.ImplicitAdjoint(linear_solver=linear_solver)
        return jnp.sum(jnp.sin(ea.minimise(_quartic, jnp.zeros(3), a, adjoint=adjoint).value))

    return [jax.hessian(loss)(a, s) for s in solvers]


def test_every_linear_solver_gives_the_same_second_derivatives():
    a = jnp.array([0.5, -1.0, 2.0])
    reference, *others = _linear_solver_gradients(a)
    x = ea.minimise(_quartic, jnp.zeros(3), a).value
    dx, d2x = 1 / (1 + 3 * x**2), -6 * x / (1 + 3 * x**2) ** 3
    np.testing.assert_allclose(
        reference, jnp.diag(-jnp.sin(x) * dx**2 + jnp.cos(x) * d2x), atol=1e-8
    )
    for other in others:
        np.testing.assert_allclose(other, reference, atol=1e-9)


def test_unrolled_adjoint_through_line_searches():
    """Newton and L-BFGS contain line searches; unrolled, they are scans that reverse mode
    differentiates, and the derivative of the converged iteration is the implicit one."""
    a = jnp.array([0.5, -1.0, 2.0])

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

        return (
            g(ea.Newton(), ea.ImplicitAdjoint()),
            g(ea.Newton(), ea.UnrolledAdjoint()),
            g(ea.LBFGS(), ea.UnrolledAdjoint()),
        )

    implicit, newton, lbfgs = grads(a)
    np.testing.assert_allclose(newton, implicit, rtol=1e-9)
    np.testing.assert_allclose(lbfgs, implicit, rtol=1e-6)


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


def test_descent_is_a_deprecated_alias_of_solution():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ea.Descent is ea.Solution
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


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
