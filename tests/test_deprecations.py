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
