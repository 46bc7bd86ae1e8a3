"""The energy algebra: sums, scalings, mixtures, wrapped functions, energy_tree, training."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import energyattn as ea


@pytest.fixture
def parts(getkey):
    memory = jr.normal(getkey(), (6, 4))
    x = jr.normal(getkey(), (3, 4))
    lse = ea.HopfieldEnergy(memory, beta=0.7)
    quad = ea.FunctionEnergy(lambda x, args: jnp.sum(x**4), name="quartic")
    return memory, x, lse, quad


def test_sum_and_scale_values(parts):
    memory, x, lse, quad = parts
    total = lse + 2.5 * quad - lse / 4.0
    expected = lse(x) + 2.5 * quad(x) - lse(x) / 4.0
    np.testing.assert_allclose(total(x), expected, rtol=1e-14)
    assert isinstance(total, ea.SumEnergy) and len(total.terms) == 3  # nested sums flatten
    np.testing.assert_allclose((-lse)(x), -lse(x), rtol=1e-14)
    np.testing.assert_allclose((lse * 3.0)(x), 3.0 * lse(x), rtol=1e-14)
    np.testing.assert_allclose(sum([lse, quad, lse])(x), 2 * lse(x) + quad(x), rtol=1e-14)


def test_energy_tree_names_and_total(parts):
    memory, x, lse, quad = parts
    total = lse + quad + 0.5 * lse
    tree = ea.energy_tree(total, x)
    assert list(tree) == ["HopfieldEnergy", "quartic", "HopfieldEnergy_2"]
    np.testing.assert_allclose(tree["HopfieldEnergy_2"], 0.5 * lse(x), rtol=1e-14)
    np.testing.assert_allclose(sum(tree.values()), total(x), rtol=1e-14)

    named = ea.SumEnergy({"attention": lse, "memory": quad})
    nested = 2.0 * named + lse
    tree = ea.energy_tree(nested, x)
    assert list(tree) == ["attention", "memory", "HopfieldEnergy"]
    np.testing.assert_allclose(tree["attention"], 2.0 * lse(x), rtol=1e-14)
    np.testing.assert_allclose(sum(tree.values()), nested(x), rtol=1e-14)

    outer = ea.SumEnergy({"block": named, "extra": quad})
    tree = ea.energy_tree(outer, x)
    assert list(tree) == ["block/attention", "block/memory", "extra"]
    assert list(ea.energy_tree(lse, x)) == ["HopfieldEnergy"]


def test_gradient_of_sum_is_sum_of_gradients(parts):
    memory, x, lse, quad = parts
    total = 0.3 * lse + quad
    grad = jax.grad(total)(x)
    np.testing.assert_allclose(grad, 0.3 * jax.grad(lse)(x) + jax.grad(quad)(x), rtol=1e-13)


def test_mixture_energy_is_soft_minimum(parts):
    memory, x, lse, quad = parts
    log_w = jnp.array([0.2, -1.0])
    mix = ea.MixtureEnergy([lse, quad], log_weights=log_w)
    expected = -np.log(np.exp(0.2 - lse(x)) + np.exp(-1.0 - quad(x)))
    np.testing.assert_allclose(mix(x), expected, rtol=1e-13)
    # The force is the responsibility-weighted force of the components.
    resp = jax.nn.softmax(jnp.stack([0.2 - lse(x), -1.0 - quad(x)]))
    np.testing.assert_allclose(
        jax.grad(mix)(x), resp[0] * jax.grad(lse)(x) + resp[1] * jax.grad(quad)(x), rtol=1e-12
    )


def test_composed_energies_are_pytrees_under_jit_vmap_grad(parts, getkey):
    memory, x, lse, quad = parts
    total = lse + 2.0 * quad

    @eqx.filter_jit  # a FunctionEnergy holds a Python function: Equinox's filtered jit
    def value(energy, x):
        return energy(x)

    np.testing.assert_allclose(value(total, x), total(x), rtol=1e-14)
    arrays_only = lse + 2.0 * ea.HopfieldEnergy(memory[:3], beta=2.0)
    np.testing.assert_allclose(
        jax.jit(lambda e, x: e(x))(arrays_only, x), arrays_only(x), rtol=1e-14
    )
    xs = jr.normal(getkey(), (5, 3, 4))
    np.testing.assert_allclose(
        eqx.filter_vmap(total)(xs), jnp.stack([total(xi) for xi in xs]), rtol=1e-13
    )
    # Gradient with respect to the parameters: the memory and the scale are leaves.
    grads = eqx.filter_grad(lambda e: e(x))(total)
    assert grads.terms[0].memory.shape == memory.shape
    np.testing.assert_allclose(grads.terms[1].scale, quad(x), rtol=1e-13)


def test_optax_trains_composed_energy_parameters(getkey):
    """An optax optimiser fits the parameters of a composed energy (scale and memories)."""
    target_memory = jr.normal(getkey(), (4, 3))
    queries = jr.normal(getkey(), (16, 3))
    # Retrieval targets: one modern-Hopfield step on the target memory.
    targets = ea.descend(
        ea.HopfieldEnergy(target_memory), queries, step_size=1.0, num_steps=1
    ).value

    energy = ea.SumEnergy(
        {
            "hopfield": ea.HopfieldEnergy(jr.normal(getkey(), (4, 3))),
            "ridge": 0.1 * ea.FunctionEnergy(lambda x, args: 0.5 * jnp.sum(x**2), name="ridge"),
        }
    )

    def loss(energy):
        out = ea.descend(energy, queries, step_size=0.5, num_steps=3).value
        return jnp.mean((out - targets) ** 2)

    optim = optax.adam(5e-2)
    state = optim.init(eqx.filter(energy, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(energy, state):
        value, grads = eqx.filter_value_and_grad(loss)(energy)
        updates, state = optim.update(grads, state, eqx.filter(energy, eqx.is_inexact_array))
        return eqx.apply_updates(energy, updates), state, value

    first = loss(energy)
    for _ in range(150):
        energy, state, _ = step(energy, state)
    assert loss(energy) < 0.2 * first
    # The scale of the ridge term was trained too (it started at 0.1).
    assert not np.isclose(energy.terms[1].scale, 0.1)


def test_function_energy_must_return_scalar(user_mode):
    bad = ea.FunctionEnergy(lambda x, args: x, name="identity")
    with pytest.raises(ValueError, match="identity.*scalar.*\\(3,\\)"):
        bad(jnp.ones(3))


def test_bad_compositions(parts, user_mode):
    memory, x, lse, quad = parts
    with pytest.raises(TypeError):
        lse * lse  # products of energies are not energies
    with pytest.raises(TypeError):
        lse + 1.0  # only 0 (for sum()) can be added
    with pytest.raises(ValueError, match="scalar.*\\(2,\\)"):
        ea.ScaledEnergy(jnp.ones(2), lse)
    with pytest.raises(ValueError, match="must be energies"):
        ea.SumEnergy([lse, lambda x, args: 0.0])
    with pytest.raises(ValueError, match="at least one"):
        ea.SumEnergy([])
    with pytest.raises(ValueError, match="log_weights must have shape \\(2,\\).*\\(3,\\)"):
        ea.MixtureEnergy([lse, quad], log_weights=jnp.zeros(3))
    with pytest.raises(ValueError, match="callable"):
        ea.FunctionEnergy(3.0)
    with pytest.raises(ValueError, match="unique"):
        ea.SumEnergy([ea.SumEnergy({"a": lse}), ea.SumEnergy({"a": quad})])


def test_generated_names_avoid_user_names(parts):
    memory, x, lse, quad = parts
    energy = ea.SumEnergy([ea.SumEnergy({"HopfieldEnergy_2": quad}), lse, lse])
    tree = ea.energy_tree(energy, x)
    assert list(tree) == ["HopfieldEnergy_2", "HopfieldEnergy", "HopfieldEnergy_3"]
    np.testing.assert_allclose(tree["HopfieldEnergy_2"], quad(x), rtol=1e-14)
    block = ea.SumEnergy({"block": lse + lse, "other": quad})
    assert list(ea.energy_tree(block, x)) == [
        "block/HopfieldEnergy",
        "block/HopfieldEnergy_2",
        "other",
    ]


@pytest.mark.parametrize("kind", ["sum", "scaled", "mixture", "difference-of-copies"])
def test_descent_on_composed_energies_never_increases(parts, kind):
    """Small steps never raise a composed energy: composition keeps energies energies."""
    memory, x, lse, quad = parts
    other = ea.HopfieldEnergy(-memory[:4], beta=2.0)
    energy = {
        "sum": lse + 0.2 * quad + other,
        "scaled": 3.0 * (lse + other),
        "mixture": ea.MixtureEnergy(
            [lse, other, 0.5 * quad], log_weights=jnp.array([0.0, -1.0, 0.3])
        ),
        # E - c E' is still an energy (here bounded below: the quartic dominates).
        "difference-of-copies": quad + lse - 0.5 * other,
    }[kind]
    run = eqx.filter_jit(lambda e, x: ea.descend(e, x, step_size=1e-2, num_steps=60).energies)
    energies = run(energy, x)
    assert np.all(np.diff(energies) <= 1e-12 * np.abs(energies).max())
    assert energies[-1] < energies[0]


class HarmonicWell(ea.AbstractEnergy):
    """A user's own energy: E(x) = ½ k |x - c|²."""

    centre: jax.Array
    stiffness: jax.Array

    def __call__(self, x, args=None):
        return 0.5 * self.stiffness * jnp.sum((x - self.centre) ** 2)


def test_user_defined_energy_composes_descends_and_trains(parts, getkey):
    memory, x, lse, quad = parts
    well = HarmonicWell(centre=jr.normal(getkey(), (3, 4)), stiffness=jnp.array(2.0))
    energy = lse + well
    assert list(ea.energy_tree(energy, x)) == ["HopfieldEnergy", "HarmonicWell"]
    # Descent on the well alone converges to its centre (contraction factor 1 - αk = 0.8).
    out = ea.descend(well, x, step_size=0.1, num_steps=200).value
    np.testing.assert_allclose(out, well.centre, atol=1e-12)
    grads = eqx.filter_grad(lambda e: e(x))(energy)
    np.testing.assert_allclose(grads.terms[1].stiffness, well(x) / 2.0, rtol=1e-13)
