"""Bad input found by an audit: each case raises a clear error naming the argument and what it
must be (before any compilation where the bad value is known at trace time), or gives the
correct value."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn._cli import main
from energyattn.models import ReplayBuffer

# ------------------------------------------------------------------ invalid input


def test_complex_state_dict_weight_is_named(user_mode):
    layer = ea.nn.Hopfield(4, key=jr.key(0))
    state = {name: np.asarray(value) for name, value in layer.to_state_dict().items()}
    state["association_core.in_proj_weight"] = state["association_core.in_proj_weight"] + 1j
    with pytest.raises(ValueError, match="'association_core.in_proj_weight' must be real"):
        ea.nn.Hopfield.from_state_dict(state, input_size=4)


@pytest.mark.parametrize("ratio", [1.5, -0.1, float("nan")])
def test_replay_ratio_must_be_a_probability(user_mode, ratio):
    buffer = ReplayBuffer.empty(4, 3, 2)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        buffer.starts(jr.key(0), jnp.zeros((2, 3, 2)), ratio)
    model = ea.models.EnergyBasedTransformer(2, 3, 4, num_heads=1, depth=1, key=jr.key(0))
    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\]"):
        ea.models.train_ebt(
            model,
            jnp.zeros((4, 3, 2)),
            key=jr.key(0),
            train_steps=1,
            replay_capacity=2,
            replay_ratio=ratio,
            batch_size=2,
            options=ea.models.TrainOptions(progress=False),
        )


def test_lowest_per_position_names_both_shapes(user_mode):
    with pytest.raises(ValueError, match=r"energies must have shape \(candidates=3, seq=4\).*"):
        ea.models.lowest_per_position(jnp.zeros((3, 4, 2)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"\(3, 4, 2\)"):
        ea.models.lowest_per_position(jnp.zeros((3, 4, 2)), jnp.zeros((2, 4)))


def test_conv_synapse_that_leaves_no_output_position(user_mode):
    synapse = ea.ham.ConvSynapse(1, 2, 5, key=jr.key(0))
    # (2, 1, 1) broadcast against the empty (2, 0, 0) convolution: the energy was 0.
    with pytest.raises(ValueError, match=r"leaves no output position on g_in of shape \(1, 3, 3\)"):
        synapse(jnp.ones((1, 3, 3)), jnp.ones((2, 1, 1)))
    with pytest.raises(ValueError, match=r"g_out must have shape \(2, 2, 2\).*got \(2, 3, 3\)"):
        synapse(jnp.ones((1, 6, 6)), jnp.ones((2, 3, 3)))
    with pytest.raises(ValueError, match=r"g_in must have shape \(channels=1, height, width\)"):
        synapse(jnp.ones((3, 6, 6)), jnp.ones((2, 2, 2)))
    assert jnp.isfinite(synapse(jnp.ones((1, 6, 6)), jnp.ones((2, 2, 2))))


def test_smt_inverse_magnetization_outside_its_domain():
    with pytest.raises(ValueError, match=r"m must have rows of norm < R = 2 .*got a row of norm 5"):
        ea.spin.smt.inverse_magnetization(jnp.array([[0.3, 0.4], [3.0, 4.0]]), R=2.0)
    with pytest.raises(ValueError, match="m must have rows of norm < R"):
        ea.spin.smt.inverse_magnetization(jnp.array([[1.2, 1.6]]), R=2.0)  # on the sphere: norm 2
    inverse = eqx.filter_jit(lambda m, R: ea.spin.smt.inverse_magnetization(m, beta=0.5, R=R))
    with pytest.raises(eqx.EquinoxRuntimeError, match="m must have rows of norm < R"):
        inverse(jnp.array([[3.0, 4.0]]), 2.0)
    m = jnp.array([[0.3, 0.4], [-1.0, 1.5]])
    np.testing.assert_allclose(
        ea.spin.smt.magnetization(inverse(m, 2.0), beta=0.5, R=2.0), m, rtol=1e-10
    )


# ------------------------------------------------------------------ silent NaN


def test_sweep_with_one_dimensional_spins_says_why(tmp_path, capsys):
    # LayerNorm over one entry: the fields are 0 and the response m.H/H.H was NaN, exit 0.
    argv = ["sweep", "--dim", "1", "--spins", "4", "--grid", "20", "--betas", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "dim must be >= 2" in err and "response" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_softmax_legendre_energy_of_masked_neurons():
    energy = jax.jit(jax.value_and_grad(lambda x: ea.legendre_energy(ea.lagrangians.softmax, x)))
    value, grad = energy(jnp.array([0.0, -jnp.inf]))
    assert value == 0.0  # g = (1, 0): the limit of g log g
    np.testing.assert_array_equal(grad, [0.0, 0.0])
    # A masked neuron drops out: the energy and gradient of the others are unchanged.
    value, grad = energy(jnp.array([0.3, -jnp.inf, 1.0]))
    kept_value, kept_grad = energy(jnp.array([0.3, 1.0]))
    np.testing.assert_allclose(value, kept_value, rtol=1e-12)
    np.testing.assert_allclose(grad, [kept_grad[0], 0.0, kept_grad[1]], rtol=1e-12)


# ------------------------------------------------------------------ unclear messages


def test_make_mesh_without_devices(user_mode):
    with pytest.raises(ValueError, match="devices must be a non-empty sequence of devices"):
        ea.parallel.make_mesh(devices=[])


def test_dense_synapse_that_does_not_fit_its_layers(user_mode):
    synapse = ea.ham.DenseSynapse(3, (2, 2), key=jr.key(0))
    with pytest.raises(ValueError, match=r"g_b must have the shape \(2, 2\).*got \(5,\)"):
        synapse(jnp.ones(3), jnp.ones(5))
    with pytest.raises(ValueError, match=r"g_a must have the shape \(3,\).*got \(2,\)"):
        synapse(jnp.ones(2), jnp.ones((2, 2)))


def test_causal_attention_and_replay_buffer_shapes(user_mode):
    q = jnp.zeros((4, 2))
    attend = ea.models.causal_attention
    with pytest.raises(ValueError, match=r"k must have shape \(seq=4, head_dim=2\), got \(3, 2\)"):
        attend(q, jnp.zeros((3, 2)), q, scale=1.0)
    with pytest.raises(ValueError, match=r"k must have shape \(seq=4, head_dim=2\), got \(4, 3\)"):
        attend(q, jnp.zeros((4, 3)), q, scale=1.0)
    with pytest.raises(ValueError, match=r"v must have shape \(seq=4, width\), got \(3, 2\)"):
        attend(q, q, jnp.zeros((3, 2)), scale=1.0)
    with pytest.raises(ValueError, match=r"own\[1\] \(the own values\) must have shape"):
        attend(q, q, q, scale=1.0, own=(q, jnp.zeros((4, 5))))
    buffer = ReplayBuffer.empty(4, 3, 2)
    with pytest.raises(
        ValueError, match=r"predictions must have shape \(n, seq=3, token_dim=2\), got \(2, 5, 2\)"
    ):
        buffer.add(jnp.zeros((2, 5, 2)))
    with pytest.raises(ValueError, match=r"noise must have shape \(n, seq=3, token_dim=2\)"):
        buffer.starts(jr.key(0), jnp.zeros((2, 3)), 0.5)


def test_nan_context_of_an_energy_based_transformer_is_named(user_mode):
    model = ea.models.EnergyBasedTransformer(2, 3, 4, num_heads=1, depth=1, key=jr.key(0))
    x = jnp.zeros((3, 2)).at[1, 0].set(jnp.nan)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"x \(the context tokens\) contains NaN"):
        model.context(x)


@pytest.mark.parametrize(
    "argv, sizes",
    [
        (["sweep", "--spins", "100000", "--dim", "100000"], "num_spins=100000, dim=100000"),
        (["landscape", "--grid", "1000000"], "num_points=1000000"),
        (["hopfield", "--probes", "1000000000"], "probes_per_pattern=1000000000"),
    ],
)
def test_sizes_too_large_for_the_machine(tmp_path, capsys, argv, sizes):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"energyattn {argv[0]}: error: {sizes}"), err
    assert "would need at least" in line and "of this machine" in line and "TiB" in line
    assert "Traceback" not in err
