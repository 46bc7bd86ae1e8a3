"""Renamed arguments keep working for one release: the old name gives the new one's result,
with a `DeprecationWarning` that names the new name; both at once is a `TypeError`."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def _same(a, b):
    for x, y in zip(np.atleast_1d(a), np.atleast_1d(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_starts_are_y0():
    energy = ea.HopfieldEnergy(jnp.eye(3), beta=2.0)
    q = jnp.ones((2, 3)) * 0.3
    new = ea.descend(energy, y0=q, step_size=0.5, num_steps=2)
    with pytest.warns(DeprecationWarning, match=r"ea.descend\(x0=...\) is deprecated: use y0="):
        old = ea.descend(energy, x0=q, step_size=0.5, num_steps=2)
    _same(new.value, old.value)
    with pytest.raises(TypeError, match="got both 'y0' and its old name 'x0'"):
        ea.descend(energy, x0=q, y0=q, step_size=0.5, num_steps=2)

    def bowl(x, _):
        return jnp.sum((x - 1.0) ** 2)

    with pytest.warns(DeprecationWarning, match=r"ea.minimise\(x0=...\) is deprecated: use y0="):
        old = ea.minimise(bowl, x0=jnp.zeros(2))
    _same(ea.minimise(bowl, y0=jnp.zeros(2)).value, old.value)

    hopfield = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(jnp.array([[1.0, -1.0, 1.0]])))
    s = jnp.array([1.0, 1.0, 1.0])
    with pytest.warns(DeprecationWarning, match=r"sign_descend\(s0=...\) is deprecated: use y0="):
        old = ea.sign_descend(hopfield, s0=s, num_sweeps=1)
    _same(ea.sign_descend(hopfield, y0=s, num_sweeps=1).value, old.value)


@pytest.mark.parametrize("which", ["hopfield_attention", "energy_transformer"])
def test_layers_return_their_solution_under_return_solution(which):
    x = jr.normal(jr.key(0), (5, 8))
    if which == "hopfield_attention":
        layer = ea.nn.HopfieldAttention(8, num_heads=2, num_steps=2, key=jr.key(1))
    else:
        layer = ea.nn.EnergyTransformer(
            8, num_heads=2, head_dim=4, num_memories=4, num_steps=2, key=jr.key(1)
        )
    out, solution = layer(x, return_solution=True)
    with pytest.warns(DeprecationWarning, match=r"\(return_trajectory=...\) is deprecated: use "):
        old_out, old_solution = layer(x, return_trajectory=True)
    _same(out, old_out)
    _same(solution.energies, old_solution.energies)


def test_optimiser_steps_are_train_steps():
    new = ea.models.make_optimizer(1e-2, train_steps=10)
    with pytest.warns(DeprecationWarning, match=r"make_optimizer\(num_steps=...\) is deprecated"):
        old = ea.models.make_optimizer(1e-2, num_steps=10)
    assert new is old  # the same cached optimiser: the same schedule


SPIN_MODEL_TRANSFORMER = {
    "smt_gamma": "gamma",
    "smt_phi": "magnetization",
    "smt_phi_inverse": "inverse_magnetization",
    "smt_tap_update": "tap_field",
    "smt_steady_state": "steady_state",
    "smt_magnetizations": "steady_magnetizations",
}


@pytest.mark.parametrize(("old", "new"), SPIN_MODEL_TRANSFORMER.items())
def test_spin_model_transformer_functions_are_in_ea_spin_smt(old, new):
    with pytest.warns(
        DeprecationWarning, match=rf"ea\.spin\.{old} is deprecated: use ea\.spin\.smt\.{new}$"
    ):
        assert getattr(ea.spin, old) is getattr(ea.spin.smt, new)


@pytest.mark.parametrize("name", ea.spin.mean_field.__all__)
def test_mean_field_maps_are_in_ea_spin_mean_field(name):
    match = rf"ea\.{name} is deprecated: use ea\.spin\.mean_field\.{name}$"
    with pytest.warns(DeprecationWarning, match=match):
        assert getattr(ea, name) is getattr(ea.spin.mean_field, name)


def test_moved_names_import_and_unknown_names_do_not():
    with pytest.warns(DeprecationWarning, match="use ea.spin.mean_field.naive_mean_field"):
        from energyattn import naive_mean_field
    assert naive_mean_field is ea.spin.mean_field.naive_mean_field
    with pytest.raises(AttributeError, match="module 'energyattn.spin' has no attribute 'smt_x'"):
        ea.spin.smt_x  # noqa: B018
