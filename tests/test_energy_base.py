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
    assert isinstance(total, ea.SumEnergy) and len(total.terms) == 3  # nested sums flatten
    composed = (total, -lse, lse * 3.0, sum([lse, quad, lse]))
    values = jax.jit(lambda x: ([e(x) for e in composed], lse(x), quad(x)))  # one program
    (v_total, v_neg, v_times_3, v_sum), v_lse, v_quad = values(x)
    expected = v_lse + 2.5 * v_quad - v_lse / 4.0
    np.testing.assert_allclose(v_total, expected, rtol=1e-14)
    np.testing.assert_allclose(v_neg, -v_lse, rtol=1e-14)
    np.testing.assert_allclose(v_times_3, 3.0 * v_lse, rtol=1e-14)
    np.testing.assert_allclose(v_sum, 2 * v_lse + v_quad, rtol=1e-14)


def test_energy_tree_names_and_total(parts):
    memory, x, lse, quad = parts
    total = lse + quad + 0.5 * lse
    named = ea.SumEnergy({"attention": lse, "memory": quad})
    nested = 2.0 * named + lse
    outer = ea.SumEnergy({"block": named, "extra": quad})

    @eqx.filter_jit
    def run(x):
        """The trees, their names (a static output, in each tree's own order: a returned
        dict's keys come back sorted) and the values to compare with, in one program."""
        trees = [ea.energy_tree(energy, x) for energy in (total, nested, outer, lse)]
        return [list(tree) for tree in trees], trees, (lse(x), total(x), nested(x))

    names, trees, (v_lse, v_total, v_nested) = run(x)
    assert names[0] == ["HopfieldEnergy", "quartic", "HopfieldEnergy_2"]
    np.testing.assert_allclose(trees[0]["HopfieldEnergy_2"], 0.5 * v_lse, rtol=1e-14)
    np.testing.assert_allclose(sum(trees[0].values()), v_total, rtol=1e-14)

    assert names[1] == ["attention", "memory", "HopfieldEnergy"]
    np.testing.assert_allclose(trees[1]["attention"], 2.0 * v_lse, rtol=1e-14)
    np.testing.assert_allclose(sum(trees[1].values()), v_nested, rtol=1e-14)

    assert names[2] == ["block/attention", "block/memory", "extra"]
    assert names[3] == ["HopfieldEnergy"]


def test_gradient_of_sum_is_sum_of_gradients(parts):
    memory, x, lse, quad = parts
    total = 0.3 * lse + quad
    grad, g_lse, g_quad = jax.jit(lambda x: [jax.grad(e)(x) for e in (total, lse, quad)])(x)
    np.testing.assert_allclose(grad, 0.3 * g_lse + g_quad, rtol=1e-13)


def test_mixture_energy_is_soft_minimum(parts):
    memory, x, lse, quad = parts
    log_w = np.array([0.2, -1.0])
    mix = ea.MixtureEnergy([lse, quad], log_weights=log_w)
    # Value and force of the mixture and of its components, in one program.
    (v_mix, g_mix), (v_lse, g_lse), (v_quad, g_quad) = jax.device_get(
        jax.jit(lambda x: [jax.value_and_grad(e)(x) for e in (mix, lse, quad)])(x)
    )
    expected = -np.log(np.exp(0.2 - v_lse) + np.exp(-1.0 - v_quad))
    np.testing.assert_allclose(v_mix, expected, rtol=1e-13)
    # The force is the responsibility-weighted force of the components.
    logits = np.array([0.2 - v_lse, -1.0 - v_quad])
    resp = np.exp(logits - logits.max()) / np.sum(np.exp(logits - logits.max()))
    np.testing.assert_allclose(g_mix, resp[0] * g_lse + resp[1] * g_quad, rtol=1e-12)


def test_composed_energies_are_pytrees_under_jit_vmap_grad(parts, getkey):
    memory, x, lse, quad = parts
    total = lse + 2.0 * quad

    @eqx.filter_jit  # a FunctionEnergy holds a Python function: Equinox's filtered jit
    def value(energy, x):
        return energy(x)

    arrays_only = lse + 2.0 * ea.HopfieldEnergy(memory[:3], beta=2.0)
    xs = jr.normal(getkey(), (5, 3, 4))

    # The references in one program that closes over the energies (they are no arguments).
    @jax.jit
    def references(x, xs):
        return total(x), arrays_only(x), jnp.stack([total(xi) for xi in xs]), quad(x)

    v_total, v_arrays_only, v_batch, v_quad = references(x, xs)
    np.testing.assert_allclose(value(total, x), v_total, rtol=1e-14)
    np.testing.assert_allclose(
        jax.jit(lambda e, x: e(x))(arrays_only, x), v_arrays_only, rtol=1e-14
    )
    np.testing.assert_allclose(eqx.filter_jit(eqx.filter_vmap(total))(xs), v_batch, rtol=1e-13)
    # Gradient with respect to the parameters: the memory and the scale are leaves.
    grads = eqx.filter_jit(eqx.filter_grad(lambda e: e(x)))(total)
    assert grads.terms[0].memory.shape == memory.shape
    np.testing.assert_allclose(grads.terms[1].scale, v_quad, rtol=1e-13)


def test_optax_trains_composed_energy_parameters(getkey, train_in_scan):
    """An optax optimiser fits the parameters of a composed energy (scale and memories)."""
    target_memory = jr.normal(getkey(), (4, 3))
    queries = jr.normal(getkey(), (16, 3))

    energy = ea.SumEnergy(
        {
            "hopfield": ea.HopfieldEnergy(jr.normal(getkey(), (4, 3))),
            "ridge": 0.1 * ea.FunctionEnergy(lambda x, args: 0.5 * jnp.sum(x**2), name="ridge"),
        }
    )
    optim = optax.adam(5e-2)

    @eqx.filter_jit
    def train(energy, target_memory, queries):
        """The loss before and after 150 optimiser steps, all in one compiled program."""
        # Retrieval targets: one modern-Hopfield step on the target memory.
        targets = ea.descend(
            ea.HopfieldEnergy(target_memory), queries, step_size=1.0, num_steps=1
        ).value

        def loss(energy):
            out = ea.descend(energy, queries, step_size=0.5, num_steps=3).value
            return jnp.mean((out - targets) ** 2)

        trained = train_in_scan(loss, energy, optim, 150)
        return loss(energy), trained, loss(trained)

    first, energy, last = train(energy, target_memory, queries)
    assert last < 0.2 * first
    # The scale of the ridge term was trained too (it started at 0.1).
    assert not np.isclose(energy.terms[1].scale, 0.1)


def test_function_energy_must_return_scalar(user_mode):
    bad = ea.FunctionEnergy(lambda x, args: x, name="identity")
    with pytest.raises(ValueError, match="identity.*scalar.*\\(3,\\)"):
        bad(np.ones(3))


def test_bad_compositions(parts, user_mode):
    memory, x, lse, quad = parts
    with pytest.raises(TypeError):
        lse * lse  # products of energies are not energies
    with pytest.raises(TypeError):
        lse + 1.0  # only 0 (for sum()) can be added
    with pytest.raises(ValueError, match="scalar.*\\(2,\\)"):
        ea.ScaledEnergy(np.ones(2), lse)
    with pytest.raises(ValueError, match="must be energies"):
        ea.SumEnergy([lse, lambda x, args: 0.0])
    with pytest.raises(ValueError, match="at least one"):
        ea.SumEnergy([])
    with pytest.raises(ValueError, match="log_weights must have shape \\(2,\\).*\\(3,\\)"):
        ea.MixtureEnergy([lse, quad], log_weights=np.zeros(3))
    with pytest.raises(ValueError, match="callable"):
        ea.FunctionEnergy(3.0)
    with pytest.raises(ValueError, match="unique"):
        ea.SumEnergy([ea.SumEnergy({"a": lse}), ea.SumEnergy({"a": quad})])


def test_generated_names_avoid_user_names(parts):
    memory, x, lse, quad = parts
    energy = ea.SumEnergy([ea.SumEnergy({"HopfieldEnergy_2": quad}), lse, lse])
    block = ea.SumEnergy({"block": lse + lse, "other": quad})

    @eqx.filter_jit
    def run(x):  # the names as static outputs, in each tree's own order
        tree = ea.energy_tree(energy, x)
        return list(tree), tree["HopfieldEnergy_2"], quad(x), list(ea.energy_tree(block, x))

    names, value, expected, block_names = run(x)
    assert names == ["HopfieldEnergy_2", "HopfieldEnergy", "HopfieldEnergy_3"]
    np.testing.assert_allclose(value, expected, rtol=1e-14)
    assert block_names == [
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
    well = HarmonicWell(centre=jr.normal(getkey(), (3, 4)), stiffness=np.array(2.0))
    energy = lse + well

    @eqx.filter_jit
    def run(energy, well, x):
        names = list(ea.energy_tree(energy, x))  # a static output, in the tree's own order
        out = ea.descend(well, x, step_size=0.1, num_steps=200).value
        return names, out, eqx.filter_grad(lambda e: e(x))(energy), well(x)

    names, out, grads, value = run(energy, well, x)
    assert names == ["HopfieldEnergy", "HarmonicWell"]
    # Descent on the well alone converges to its centre (contraction factor 1 - αk = 0.8).
    np.testing.assert_allclose(out, well.centre, atol=1e-12)
    np.testing.assert_allclose(grads.terms[1].stiffness, value / 2.0, rtol=1e-13)
