"""`ea.fixed_point` and `ea.minimise`: solvers, stopping rules, result codes and adjoints."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

TIGHT = dict(rtol=1e-13, atol=1e-13, max_steps=400)


def _linear_problem(key, n=6, radius=0.5):
    ka, kb = jr.split(key)
    A = jr.normal(ka, (n, n))
    A = radius * A / np.max(np.abs(np.linalg.eigvals(np.asarray(A))))
    return A, jr.normal(kb, (n,))


def _affine(z, args):
    A, b = args
    return A @ z + b


ADJOINTS = [
    ea.ImplicitAdjoint(),
    ea.ImplicitAdjoint(solver=ea.Picard()),
    ea.ImplicitAdjoint(solver="gmres"),
    ea.UnrolledAdjoint(),
]


@pytest.mark.parametrize("solver", [ea.Picard(), ea.Picard(damping=0.7), ea.Anderson()])
def test_linear_fixed_point_closed_form(getkey, solver):
    A, b = _linear_problem(getkey())
    solution = ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=solver, **TIGHT)
    exact = jnp.linalg.solve(jnp.eye(6) - A, b)
    assert solution.converged
    np.testing.assert_allclose(solution.value, exact, atol=1e-11)
    assert solution.residual <= 1e-13 * (1 + jnp.sqrt(jnp.mean(exact**2)))


@pytest.mark.parametrize("adjoint", ADJOINTS, ids=lambda a: repr(a))
def test_linear_fixed_point_gradient_closed_form(getkey, adjoint):
    A, b = _linear_problem(getkey())

    def loss(A, b):
        z = ea.fixed_point(_affine, jnp.zeros(6), (A, b), adjoint=adjoint, **TIGHT).value
        return jnp.sum(jnp.sin(z))

    def exact_loss(A, b):
        return jnp.sum(jnp.sin(jnp.linalg.solve(jnp.eye(6) - A, b)))

    # Closed form: z = (I - A)^{-1} b, so db = (I - A)^{-T} cos(z) and dA = db z^T.
    z = jnp.linalg.solve(jnp.eye(6) - A, b)
    db = jnp.linalg.solve((jnp.eye(6) - A).T, jnp.cos(z))
    gA, gb = jax.jit(jax.grad(loss, (0, 1)))(A, b)
    np.testing.assert_allclose(gb, db, atol=1e-10)
    np.testing.assert_allclose(gA, jnp.outer(db, z), atol=1e-10)
    np.testing.assert_allclose(gA, jax.grad(exact_loss)(A, b), atol=1e-10)


def test_phantom_adjoint_is_jacobian_free_and_approaches_implicit(getkey):
    A, b = _linear_problem(getkey())

    def grad_b(adjoint):
        def loss(b):
            return jnp.sum(
                jnp.sin(
                    ea.fixed_point(_affine, jnp.zeros(6), (A, b), adjoint=adjoint, **TIGHT).value
                )
            )

        return jax.grad(loss)(b)

    z = jnp.linalg.solve(jnp.eye(6) - A, b)
    # One step of size 1: d/db f(z*, b) = I, so the gradient is the cotangent itself.
    np.testing.assert_allclose(grad_b(ea.PhantomAdjoint()), jnp.cos(z), atol=1e-10)
    # k steps: the truncated Neumann series sum_{j<k} (A^T)^j cos(z).
    k = 3
    series = sum(jnp.linalg.matrix_power(A.T, j) @ jnp.cos(z) for j in range(k))
    np.testing.assert_allclose(grad_b(ea.PhantomAdjoint(num_steps=k)), series, atol=1e-10)
    implicit = grad_b(ea.ImplicitAdjoint())
    np.testing.assert_allclose(grad_b(ea.PhantomAdjoint(num_steps=80)), implicit, atol=1e-10)


def test_anderson_fewer_iterations_than_picard_on_linear_map(getkey):
    A, b = _linear_problem(getkey(), n=20, radius=0.9)
    picard = ea.fixed_point(_affine, jnp.zeros(20), (A, b), solver=ea.Picard(), **TIGHT)
    anderson = ea.fixed_point(_affine, jnp.zeros(20), (A, b), solver=ea.Anderson(), **TIGHT)
    np.testing.assert_allclose(anderson.value, picard.value, atol=1e-11)
    assert anderson.num_steps < picard.num_steps / 2


def test_stopping_rule_and_step_count(getkey):
    A, b = _linear_problem(getkey())
    rtol, atol = 1e-4, 1e-6
    sol = ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(), rtol=rtol, atol=atol)
    # The residual is measured at the returned iterate's predecessor z_k: value = f(z_k).
    steps = int(sol.num_steps)
    z = jnp.zeros(6)
    for _ in range(steps - 1):
        z = _affine(z, (A, b))
    fz = _affine(z, (A, b))
    rms = lambda v: jnp.sqrt(jnp.mean(v**2))  # noqa: E731
    np.testing.assert_allclose(sol.value, fz, atol=1e-14)
    np.testing.assert_allclose(sol.residual, rms(fz - z), rtol=1e-12)
    assert rms(fz - z) <= atol + rtol * rms(fz)
    # One iteration fewer did not meet the rule.
    z_prev = jnp.zeros(6)
    for _ in range(steps - 2):
        z_prev = _affine(z_prev, (A, b))
    assert rms(_affine(z_prev, (A, b)) - z_prev) > atol + rtol * rms(_affine(z_prev, (A, b)))


def test_max_steps_result_code_and_raise(getkey):
    A, b = _linear_problem(getkey(), radius=0.95)
    sol = ea.fixed_point(
        _affine, jnp.zeros(6), (A, b), solver=ea.Picard(), max_steps=3, throw=False
    )
    assert sol.result == ea.RESULTS.max_steps_reached
    assert int(sol.num_steps) == 3
    with pytest.raises(eqx.EquinoxRuntimeError, match="did not converge within"):
        ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(), max_steps=3)


def test_divergence_is_a_result_code(getkey):
    A, b = _linear_problem(getkey(), radius=2.0)
    sol = ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(), throw=False)
    assert sol.result == ea.RESULTS.diverged
    assert jnp.all(jnp.isfinite(sol.value))
    with pytest.raises(eqx.EquinoxRuntimeError, match="diverged"):
        eqx.filter_jit(
            lambda b: ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard()).value
        )(b)


def test_nonfinite_is_a_result_code():
    def fn(z, _):
        return jnp.log(z - 1.0)  # NaN below 1

    sol = ea.fixed_point(fn, jnp.zeros(3), solver=ea.Picard(), throw=False)
    assert sol.result == ea.RESULTS.nonfinite
    with pytest.raises(eqx.EquinoxRuntimeError, match="non-finite"):
        ea.fixed_point(fn, jnp.zeros(3))


def test_vmap_stops_per_example_and_is_independent_of_the_batch(getkey):
    A, _ = _linear_problem(getkey())
    bs = jr.normal(getkey(), (3, 6)) * jnp.array([[1e-3], [1.0], [1e3]])

    def solve(b):
        return ea.fixed_point(_affine, jnp.zeros(6), (A, b), solver=ea.Picard(), rtol=1e-10)

    batched = jax.jit(jax.vmap(solve))(bs)
    for i in range(3):
        alone = solve(bs[i])
        assert int(batched.num_steps[i]) == int(alone.num_steps)
        np.testing.assert_allclose(batched.value[i], alone.value, rtol=1e-13, atol=1e-15)
    # A different batch around example 1 gives the same answer for it.
    other = jax.vmap(solve)(bs[jnp.array([1, 1])])
    np.testing.assert_allclose(other.value[0], batched.value[1], rtol=1e-13)


def test_pytree_state_and_closure_gradients(getkey):
    A, b = _linear_problem(getkey())
    scale = jnp.array(0.5)

    def fn(state, _):
        u, v = state["u"], state["v"]
        return {"u": scale * jnp.tanh(A @ v) + b, "v": 0.5 * u}

    def loss(scale_, b_, adjoint):
        def f(state, _):
            u, v = state["u"], state["v"]
            return {"u": scale_ * jnp.tanh(A @ v) + b_, "v": 0.5 * u}

        z0 = {"u": jnp.zeros(6), "v": jnp.zeros(6)}
        out = ea.fixed_point(f, z0, adjoint=adjoint, **TIGHT).value
        return jnp.sum(out["u"] ** 2) + jnp.sum(jnp.cos(out["v"]))

    sol = ea.fixed_point(fn, {"u": jnp.zeros(6), "v": jnp.zeros(6)}, **TIGHT)
    np.testing.assert_allclose(sol.value["v"], 0.5 * sol.value["u"], atol=1e-12)
    implicit = jax.grad(loss, (0, 1))(scale, b, ea.ImplicitAdjoint())
    unrolled = jax.grad(loss, (0, 1))(scale, b, ea.UnrolledAdjoint())
    eps = 1e-6
    fd = (
        loss(scale + eps, b, ea.ImplicitAdjoint()) - loss(scale - eps, b, ea.ImplicitAdjoint())
    ) / (2 * eps)
    np.testing.assert_allclose(implicit[0], unrolled[0], rtol=1e-9)
    np.testing.assert_allclose(implicit[1], unrolled[1], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(implicit[0], fd, rtol=1e-7)


def test_backward_failure_raises(getkey):
    A, b = _linear_problem(getkey(), radius=0.9)

    def loss(b):
        adjoint = ea.ImplicitAdjoint(solver=ea.Picard(), max_steps=2)
        return jnp.sum(ea.fixed_point(_affine, jnp.zeros(6), (A, b), adjoint=adjoint).value)

    with pytest.raises(eqx.EquinoxRuntimeError, match="did not converge"):
        jax.grad(loss)(b)


def test_bad_arguments(user_mode):
    with pytest.raises(ValueError, match="same structure and shapes"):
        ea.fixed_point(lambda z, _: jnp.zeros(4), jnp.zeros(3))
    with pytest.raises(ValueError, match="solver must be"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), solver="anderson")
    with pytest.raises(ValueError, match="adjoint must be"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), adjoint="implicit")
    with pytest.raises(ValueError, match="damping must be in"):
        ea.Picard(damping=1.5)
    with pytest.raises(ValueError, match="history must be a positive integer"):
        ea.Anderson(history=0)
    with pytest.raises(ValueError, match="mixing must be"):
        ea.Anderson(mixing=0.0)
    with pytest.raises(ValueError, match="rtol must be >= 0"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), rtol=-1.0)
    with pytest.raises(ValueError, match="divergence must be > 1"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3), divergence=0.5)
    with pytest.raises(ValueError, match="ImplicitAdjoint"):
        ea.ImplicitAdjoint(solver="cg")
    with pytest.raises(ValueError, match="floating-point"):
        ea.fixed_point(lambda z, _: z, jnp.zeros(3, int))


# --------------------------------------------------------------------------------------------
# minimise


def test_minimise_hopfield_energy_is_iterated_softmax_attention(getkey):
    """The minimum of the log-sum-exp energy is the fixed point of softmax attention."""
    memory = jr.normal(getkey(), (5, 4))
    query = jr.normal(getkey(), (2, 4))
    beta = 2.0
    energy = lambda q, mem: ea.hopfield_energy(q, mem, beta=beta)  # noqa: E731
    sol = ea.minimise(energy, query, memory, step_size=0.5, **TIGHT)
    q = sol.value
    attention = jax.nn.softmax(beta * q @ memory.T, axis=-1) @ memory
    np.testing.assert_allclose(q, attention, atol=1e-11)
    np.testing.assert_allclose(jax.grad(energy)(q, memory), 0.0, atol=1e-11)
    np.testing.assert_allclose(sol.stats["energy"], energy(q, memory), rtol=1e-14)

    def loss(memory, adjoint):
        # Plain gradient descent (Picard): the derivatives of its iterates converge to the
        # implicit derivative at the same linear rate as the iterates themselves.
        out = ea.minimise(
            energy, query, memory, step_size=0.5, solver=ea.Picard(), adjoint=adjoint, **TIGHT
        ).value
        return jnp.sum(out * jnp.arange(8.0).reshape(2, 4))

    implicit = jax.grad(loss)(memory, ea.ImplicitAdjoint())
    unrolled = jax.grad(loss)(memory, ea.UnrolledAdjoint())
    np.testing.assert_allclose(implicit, unrolled, rtol=1e-8, atol=1e-11)
    direction = jr.normal(getkey(), memory.shape)
    eps = 1e-6
    fd = (
        loss(memory + eps * direction, ea.ImplicitAdjoint())
        - loss(memory - eps * direction, ea.ImplicitAdjoint())
    ) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(implicit * direction), fd, rtol=1e-6)


def test_minimise_bad_energy(user_mode):
    with pytest.raises(ValueError, match="scalar"):
        ea.minimise(lambda x, _: x, jnp.zeros(3))
    with pytest.raises(ValueError, match="step_size must be > 0"):
        ea.minimise(lambda x, _: jnp.sum(x**2), jnp.zeros(3), step_size=0.0)
