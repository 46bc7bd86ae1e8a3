"""`ea.nn.VectorSpinAttention` and the spin plots of `ea.viz`."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "afem_attention_N8_D16_b1.npz"


def rel(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def reference_layer(f):
    """The fixture's layer: its J_raw and LayerNorm parameters."""
    layer = ea.nn.VectorSpinAttention(8, 16, beta=1.0, dtype=jnp.float64, key=jax.random.key(0))
    params = (jnp.asarray(f["J_raw"]), jnp.asarray(f["ln_weight"]), jnp.asarray(f["ln_bias"]))
    return eqx.tree_at(lambda m: (m.J_raw, m.norm.weight, m.norm.bias), layer, params)


@eqx.filter_jit
def forward_and_gradients(layer, x):
    def loss(layer, x):
        out, solution = jax.vmap(lambda x: layer(x, return_solution=True))(x)
        return jnp.sum(out**2), (out, solution)

    (value, (out, solution)), (grad_layer, grad_x) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True
    )(layer, x)
    return out, solution, jax.vmap(layer.fields)(x), value, grad_layer, grad_x


def test_attention_fixture():
    """Output, t*, and exact gradients of sum(out^2) w.r.t. x, J_raw, LayerNorm weight/bias."""
    f = dict(np.load(FIXTURE))
    assert float(f["ln_eps"]) == 1e-5
    layer = reference_layer(f)
    out, solution, fields, value, grad_layer, grad_x = forward_and_gradients(layer, f["x"])
    out, fields = np.asarray(out), np.asarray(fields)
    assert rel(fields, f["h"]) < 1e-12
    assert rel(out, f["out_autograd"]) < 1e-9
    assert rel(solution.value, f["t_star"]) < 1e-9 and np.all(solution.converged)
    assert rel(value, f["loss_outsq"]) < 1e-9
    assert rel(grad_x, f["grad_outsq_x_autograd"]) < 1e-7
    assert rel(grad_layer.J_raw, f["grad_outsq_J_raw_autograd"]) < 1e-7
    assert rel(grad_layer.norm.weight, f["grad_outsq_ln_weight_autograd"]) < 1e-7
    assert rel(grad_layer.norm.bias, f["grad_outsq_ln_bias_autograd"]) < 1e-7
    # The output is the magnetizations of the fields: (beta/2) V^-1 H at t*.
    V = np.diag(np.asarray(solution.value)[0]) - np.asarray(ea.spin.symmetric_couplings(f["J_raw"]))
    assert rel(out[0], 0.5 * np.linalg.solve(V, fields[0])) < 1e-12


@eqx.filter_jit
def sgd_step(layer, x, target, learning_rate):
    """One training step on an attention loss: the gradient of a gradient (magnetizations).

    Returns the loss before and after the step, and the gradient.
    """
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def objective(params):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - target) ** 2)

    value, grads = jax.value_and_grad(objective)(params)
    stepped = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return value, objective(stepped), eqx.combine(grads, static)


def test_training_step_input_dependent_couplings():
    """Input-dependent couplings: train W_q, W_k and the LayerNorm through t*(x)."""
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((3, 6, 8)), 0.2 * rng.standard_normal((3, 6, 8))
    layer = ea.nn.VectorSpinAttention(
        6, 8, beta=1.0, input_dependent=True, dtype=jnp.float64, key=jax.random.key(1)
    )
    assert layer.J_raw is None and layer.query_proj is not None
    before, after, grads = sgd_step(layer, x, target, np.asarray(0.1))
    # The step lowers the loss by about learning_rate * |gradient|^2 (Armijo, c = 1/2).
    squared = sum(np.sum(g**2) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)))
    assert after < before - 0.5 * 0.1 * squared, (before, after, squared)
    # The training gradient is the derivative of the loss (central differences along W_q).
    direction = rng.standard_normal((8, 8))
    eps = 1e-6

    def shifted(s):
        moved = eqx.tree_at(lambda m: m.query_proj.weight, layer, layer.query_proj.weight + s)
        return sgd_step(moved, x, target, np.asarray(0.0))[0]  # the same program

    fd = (shifted(eps * direction) - shifted(-eps * direction)) / (2 * eps)
    exact = np.vdot(grads.query_proj.weight, direction)
    assert abs(exact - fd) < 1e-7 * abs(exact)


def test_warm_start_and_bad_input(user_mode):
    f = dict(np.load(FIXTURE))
    layer = reference_layer(f)
    call = eqx.filter_jit(lambda layer, x, t0: layer(x, t0=t0, return_solution=True))
    out, cold = call(layer, f["x"][0], np.ones(8))  # the reference module's start
    warm_out, warm = call(layer, f["x"][0], cold.value)  # same program, warm-started
    assert warm.num_steps == 0 and rel(warm_out, out) == 0 and cold.num_steps > 0
    with pytest.raises(ValueError, match=r"x must have shape \(spins=8, dim=16\), got \(8, 12\)"):
        layer(np.ones((8, 12)))
    with pytest.raises(ValueError, match="beta must be > 0"):
        ea.nn.VectorSpinAttention(8, 16, beta=0.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="mode must be 'vector'"):
        ea.nn.VectorSpinAttention(8, 16, mode="both", key=jax.random.key(0))


def test_default_initialisation():
    layer = ea.nn.VectorSpinAttention(64, 32, key=jax.random.key(0))
    J_raw = np.asarray(layer.J_raw)
    assert J_raw.dtype == jnp.result_type(float)  # float64 here (x64 on); float32 by default
    # N(0, 1/(N D)): standard deviation 1/sqrt(N D).
    assert abs(J_raw.std() * np.sqrt(64 * 32) - 1) < 0.05 and abs(J_raw.mean()) < 0.01
    J = np.asarray(layer.couplings(jnp.zeros((64, 32))))
    assert np.all(J == J.T) and np.all(np.diagonal(J) == 0)


def test_spin_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    f = dict(np.load(FIXTURE))
    J, H = np.asarray(ea.spin.symmetric_couplings(f["J_raw"])), f["h"][0]
    paths = [
        ea.viz.plot_spin_phi(J, H, tmp_path / "phi.png", beta=1.0, num_points=16, title="phi"),
        ea.viz.plot_spin_beta_sweep(J, H, [0.5, 2.0], tmp_path / "beta.png", num_points=16),
        ea.viz.plot_spin_landscape(
            J[:2, :2], H[:2], tmp_path / "landscape.png", beta=1.0, num_points=12
        ),
    ]
    for path in paths:
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert np.std(image[..., :3]) > 0.01  # something was drawn
    with pytest.raises(ValueError, match="exactly 2 spins"):
        ea.viz.plot_spin_landscape(J, H, tmp_path / "no.png", beta=1.0)
    with pytest.raises(ValueError, match="betas must be"):
        ea.viz.plot_spin_beta_sweep(J, H, [1.0, -1.0], tmp_path / "no.png")
