"""`ea.descend`: fixed-step gradient descent in lax.scan."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def quadratic(x, args):
    """E = ½ (x - c)ᵀ A (x - c) with A = args["A"] positive definite, c = args["c"]."""
    d = x - args["c"]
    return 0.5 * d @ args["A"] @ d


# Compiled descents: an eager one compiles its loop and each operation around it on its own.
descend = eqx.filter_jit(ea.descend)


@pytest.fixture
def problem(getkey):
    b = jr.normal(getkey(), (4, 4))
    return {"A": b @ b.T / 4 + jnp.eye(4), "c": jr.normal(getkey(), (4,))}, jr.normal(
        getkey(), (4,)
    )


def test_matches_hand_written_loop(problem):
    args, x0 = problem
    descent = descend(quadratic, x0, args, step_size=0.1, num_steps=7, return_trajectory=True)

    @jax.jit
    def hand_written(x, args):  # compiled as one program, not op by op
        states, energies = [x], []
        for _ in range(7):
            energies.append(quadratic(x, args))
            x = x - 0.1 * jax.grad(quadratic)(x, args)
            states.append(x)
        energies.append(quadratic(x, args))
        return x, jnp.stack(energies), jnp.stack(states)

    x, energies, states = hand_written(x0, args)
    np.testing.assert_allclose(descent.value, x, rtol=1e-14)
    np.testing.assert_allclose(descent.energies, energies, rtol=1e-14)
    np.testing.assert_allclose(descent.trajectory, states, rtol=1e-14)
    assert descent.energies.shape == (8,) and descent.trajectory.shape == (8, 4)


def test_langevin_noise_is_the_hand_written_loop_plus_keyed_gaussians(problem):
    args, x0 = problem
    alpha, sigma, key = 0.1, 0.3, jr.key(4)
    descent = descend(quadratic, x0, args, step_size=alpha, num_steps=5, noise_scale=sigma, key=key)
    x = x0
    for t in range(5):
        noise = jr.normal(jr.split(jr.fold_in(key, t), 1)[0], x.shape, x.dtype)
        x = x - alpha * jax.grad(quadratic)(x, args) + sigma * noise
    np.testing.assert_allclose(descent.value, x, rtol=1e-13)
    # Differentiable in the noise scale (a trained Langevin temperature).
    grad = jax.grad(
        lambda s: jnp.sum(
            ea.descend(
                quadratic, x0, args, step_size=alpha, num_steps=5, noise_scale=s, key=key
            ).value
        )
    )(sigma)
    assert np.isfinite(grad) and grad != 0
    with pytest.raises(ValueError, match="needs both noise_scale and key"):
        ea.descend(quadratic, x0, args, step_size=alpha, num_steps=1, noise_scale=sigma)
    with pytest.raises(ValueError, match="noise_scale must be finite and >= 0"):
        ea.descend(quadratic, x0, args, step_size=alpha, num_steps=1, noise_scale=-1.0, key=key)


def test_closed_form_on_a_quadratic(problem):
    """For E = ½(x-c)ᵀA(x-c): x_T - c = (I - αA)^T (x_0 - c)."""
    args, x0 = problem
    alpha, steps = 0.2, 25
    out = descend(quadratic, x0, args, step_size=alpha, num_steps=steps).value
    A, c, x0 = (np.asarray(a) for a in (args["A"], args["c"], x0))
    propagator = np.linalg.matrix_power(np.eye(4) - alpha * A, steps)
    np.testing.assert_allclose(out, c + propagator @ (x0 - c), rtol=1e-12)


def test_zero_steps(problem):
    args, x0 = problem
    descent = descend(quadratic, x0, args, step_size=0.1, num_steps=0, return_trajectory=True)
    np.testing.assert_array_equal(descent.value, x0)
    np.testing.assert_allclose(descent.energies, quadratic(x0, args)[None])
    assert descent.trajectory.shape == (1, 4)


def test_solution_fields(problem):
    args, x0 = problem
    descent = descend(quadratic, x0, args, step_size=0.1, num_steps=3)
    assert descent.result == ea.RESULTS.successful and int(descent.num_steps) == 3
    assert descent.trajectory is None
    # The residual is the size (rms) of the last step.
    x2 = descend(quadratic, x0, args, step_size=0.1, num_steps=2).value
    step = np.asarray(descent.value) - np.asarray(x2)
    np.testing.assert_allclose(descent.residual, np.sqrt(np.mean(step**2)))


def test_activation_steps_in_x_with_gradient_at_g(problem):
    """x ← x − α ∂E/∂g at g = g(x), energy recorded at g(x_t)."""
    args, x0 = problem
    activation = jnp.tanh
    descent = descend(quadratic, x0, args, step_size=0.3, num_steps=5, activation=activation)

    @jax.jit
    def hand_written(x, args):  # compiled as one program, not op by op
        energies = []
        for _ in range(5):
            g = activation(x)
            energies.append(quadratic(g, args))
            x = x - 0.3 * jax.grad(quadratic)(g, args)
        energies.append(quadratic(activation(x), args))
        return x, jnp.stack(energies)

    x, energies = hand_written(x0, args)
    np.testing.assert_allclose(descent.value, x, rtol=1e-14)
    np.testing.assert_allclose(descent.energies, energies, rtol=1e-14)


def test_pytree_state(getkey):
    """States may be pytrees (e.g. tokens and auxiliary variables)."""
    memory = jr.normal(getkey(), (6, 3))

    def energy(state, args):
        return ea.hopfield_energy(state["q"], memory) + 0.5 * jnp.sum((state["h"] - 1.0) ** 2)

    x0 = {"q": jr.normal(getkey(), (2, 3)), "h": jnp.zeros(5)}
    out = descend(energy, x0, step_size=0.5, num_steps=40).value
    np.testing.assert_allclose(out["h"], 1.0, atol=1e-10)
    np.testing.assert_allclose(
        out["q"], descend(ea.HopfieldEnergy(memory), x0["q"], step_size=0.5, num_steps=40).value
    )


def test_jit_vmap_grad(problem, getkey):
    args, x0 = problem
    run = jax.jit(
        lambda x, a, alpha: ea.descend(quadratic, x, a, step_size=alpha, num_steps=6).value
    )
    np.testing.assert_allclose(
        run(x0, args, 0.1), ea.descend(quadratic, x0, args, step_size=0.1, num_steps=6).value
    )

    xs = jr.normal(getkey(), (5, 4))
    batched = jax.vmap(run, in_axes=(0, None, None))(xs, args, 0.1)
    np.testing.assert_allclose(batched, jnp.stack([run(x, args, 0.1) for x in xs]), rtol=1e-14)

    # Gradients flow through the unrolled steps: to the initial state, the parameters of the
    # energy and the step size; checked against central finite differences.
    @jax.jit  # compiled once for every finite-difference point
    def loss(x0, c, alpha):
        out = ea.descend(
            quadratic, x0, {"A": args["A"], "c": c}, step_size=alpha, num_steps=6
        ).value
        return jnp.sum(jnp.sin(out))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x0, args["c"], 0.1)
    eps = 1e-6
    direction = jr.normal(getkey(), (4,))
    for i, (point, grad) in enumerate(zip((x0, args["c"]), grads[:2], strict=True)):
        plus = [x0, args["c"], 0.1]
        minus = [x0, args["c"], 0.1]
        plus[i] = point + eps * direction
        minus[i] = point - eps * direction
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(np.asarray(grad) @ np.asarray(direction), fd, rtol=1e-7)
    fd_alpha = (loss(x0, args["c"], 0.1 + eps) - loss(x0, args["c"], 0.1 - eps)) / (2 * eps)
    np.testing.assert_allclose(grads[2], fd_alpha, rtol=1e-7)


def test_energy_module_and_function_agree(getkey):
    memory = jr.normal(getkey(), (5, 3))
    q = jr.normal(getkey(), (4, 3))
    a = descend(ea.HopfieldEnergy(memory, beta=2.0), q, step_size=0.4, num_steps=5)
    b = descend(
        lambda x, m: ea.hopfield_energy(x, m, beta=2.0), q, memory, step_size=0.4, num_steps=5
    )
    np.testing.assert_allclose(a.value, b.value, rtol=1e-14)
    np.testing.assert_allclose(a.energies, b.energies, rtol=1e-14)


def test_divergence_is_reported():
    """A step size that makes the descent blow up raises instead of returning inf/NaN."""
    energy = ea.FunctionEnergy(lambda x, args: jnp.sum(x**4), name="quartic")
    x0 = jnp.array([3.0])
    run = eqx.filter_jit(
        lambda x, throw: ea.descend(energy, x, step_size=1.0, num_steps=12, throw=throw)
    )
    with pytest.raises(eqx.EquinoxRuntimeError, match="NaN or inf"):
        run(x0, True)
    # throw=False hands back the non-finite trajectory for inspection.
    descent = run(x0, False)
    assert not np.all(np.isfinite(descent.energies))
    assert descent.result == ea.RESULTS.nonfinite


def test_nan_initial_state_is_reported():
    run = eqx.filter_jit(
        lambda x: ea.descend(ea.HopfieldEnergy(jnp.ones((2, 2))), x, step_size=0.1, num_steps=2)
    )
    with pytest.raises(eqx.EquinoxRuntimeError, match="y0 contains NaN"):
        run(jnp.array([[0.0, jnp.nan]]))


def test_bad_input(problem, user_mode):
    args, x0 = problem
    with pytest.raises(ValueError, match="step_size must be > 0, got 0.0"):
        ea.descend(quadratic, x0, args, step_size=0.0, num_steps=3)
    with pytest.raises(ValueError, match="step_size must be > 0, got -0.1"):
        ea.descend(quadratic, x0, args, step_size=-0.1, num_steps=3)
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer, got -1"):
        ea.descend(quadratic, x0, args, step_size=0.1, num_steps=-1)
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer, got 2.5"):
        ea.descend(quadratic, x0, args, step_size=0.1, num_steps=2.5)
    with pytest.raises(ValueError, match=r"scalar.*got \(4,\)"):
        ea.descend(lambda x, a: x**2, x0, step_size=0.1, num_steps=1)
    with pytest.raises(ValueError, match="same structure and shapes as x"):
        ea.descend(quadratic, x0, args, step_size=0.1, num_steps=1, activation=lambda x: x[:2])
    with pytest.raises(ValueError, match="floating-point"):
        ea.descend(quadratic, jnp.arange(4), args, step_size=0.1, num_steps=1)
    with pytest.raises(ValueError, match="energy must be callable"):
        ea.descend(3.0, x0, step_size=0.1, num_steps=1)
    # A traced step size cannot be checked at trace time: it is a runtime error instead.
    run = eqx.filter_jit(
        lambda alpha: ea.descend(quadratic, x0, args, step_size=alpha, num_steps=1).value
    )
    with pytest.raises(eqx.EquinoxRuntimeError, match="step_size must be > 0"):
        run(jnp.array(-0.5))
