"""Hierarchical associative memories (`ea.ham`): one energy for a graph, and its dynamics."""

import functools

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn import ham

L = ea.lagrangians


def random_graph(key, lagrangians):
    """Pixels -conv- features -dense- tokens (attention + memory) -dense- label."""
    k = jr.split(key, 6)
    pixels, features, tokens, label = lagrangians
    neurons = {
        "pixels": ham.Neurons(pixels, (1, 6, 6)),
        "features": ham.Neurons(features, (2, 4, 4), tau=0.5),
        "tokens": ham.Neurons(tokens, (4, 5), tau=2.0),
        "label": ham.Neurons(label, (3,)),
    }
    synapses = {
        "conv": ham.ConvSynapse(1, 2, 3, key=k[0]),
        "to_tokens": ham.DenseSynapse((2, 4, 4), (4, 5), key=k[1]),
        "attention": ham.AttentionSynapse(5, num_heads=2, head_dim=3, key=k[2]),
        "memory": ham.HopfieldSynapse(5, 6, key=k[3]),
        "readout": ham.DenseSynapse((4, 5), 3, key=k[4]),
    }
    connections = {
        "conv": ("pixels", "features"),
        "to_tokens": ("features", "tokens"),
        "attention": "tokens",
        "memory": "tokens",
        "readout": ("tokens", "label"),
    }
    return ham.HAM(neurons, synapses, connections)


GRAPHS = {
    "sigmoid-relu-layernorm-softmax": (L.sigmoid, L.relu, L.layer_norm, L.softmax),
    "tanh-repu-spherical-ghostmax": (
        functools.partial(L.tanh, beta=2.0),
        functools.partial(L.repu, n=3),
        L.spherical,
        L.ghostmax,
    ),
    "sigmoid-rexp-layernorm-identity": (
        functools.partial(L.sigmoid, beta=3.0),
        functools.partial(L.rexp, beta=0.5),
        functools.partial(L.layer_norm, gamma=0.7),
        L.identity,
    ),
}


@eqx.filter_jit
def settle(graph, states):
    """300 steps of the dynamics, then the fixed point of one step (Anderson) from there."""
    descent = graph.descend(states, step_size=0.05, num_steps=300)

    def step(x, args):
        force = graph.energy_gradient(x)
        return {n: x[n] - 0.05 / graph.neurons[n].tau * force[n] for n in x}

    solver = ea.Anderson(rtol=1e-12, atol=1e-12)
    final = ea.fixed_point(step, descent.value, solver=solver, max_steps=500).value
    return descent.energies, final, graph.energy_gradient(final), jax.grad(graph.energy)(final)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_energy_never_increases_and_fixed_points_are_stationary(name):
    """Several neuron types, dense + conv + attention + memory synapses, three seeds: the
    energy does not increase along the joint descent with a small step, and at the fixed
    point of the dynamics (the force dE/dg vanishes) the energy's gradient with respect to
    every layer's state vanishes too: dE/dx = Hessian(L) dE/dg."""
    for seed in range(3):
        graph = random_graph(jr.PRNGKey(seed), GRAPHS[name])
        states = graph.init_states(jr.PRNGKey(100 + seed))
        states["pixels"] = jr.uniform(jr.PRNGKey(200 + seed), (1, 6, 6))
        energies, final, force, grad = jax.device_get(settle(graph, states))
        scale = np.max(np.abs(energies))
        assert np.all(np.diff(energies) <= 1e-12 * scale), (name, seed)
        assert float(energies[-1]) < float(energies[0]) - 1e-3
        for layer in graph.neurons:
            np.testing.assert_allclose(force[layer], 0.0, atol=1e-9, err_msg=(name, seed, layer))
            np.testing.assert_allclose(grad[layer], 0.0, atol=1e-9, err_msg=(name, seed, layer))


def test_the_energy_transformer_is_a_graph():
    """One layer-norm layer without its Legendre term (no leak), an attention synapse and a
    Hopfield-memory synapse: ea.nn.EnergyTransformer's energy and trajectory, to 1e-12."""
    et = ea.nn.EnergyTransformer(
        16, num_heads=2, head_dim=4, num_memories=12, num_steps=6, key=jr.PRNGKey(0)
    )
    delta = 0.1 * jr.normal(jr.PRNGKey(1), (16,))
    et = eqx.tree_at(lambda m: (m.layer_norm.gamma, m.layer_norm.delta), et, (1.3, delta))
    attention = ham.AttentionSynapse(16, num_heads=2, head_dim=4, beta=et.beta, key=jr.PRNGKey(2))
    attention = eqx.tree_at(lambda s: (s.w_query, s.w_key), attention, (et.w_query, et.w_key))
    memory = eqx.tree_at(
        lambda s: s.memories, ham.HopfieldSynapse(16, 12, key=jr.PRNGKey(3)), et.memories
    )
    lagrangian = functools.partial(
        L.layer_norm, gamma=et.layer_norm.gamma, delta=et.layer_norm.delta, eps=et.layer_norm.eps
    )
    graph = ham.HAM(
        {"tokens": ham.Neurons(lagrangian, (5, 16), legendre=False)},
        {"attention": attention, "memory": memory},
        {"attention": "tokens", "memory": "tokens"},
    )
    x = jr.normal(jr.PRNGKey(4), (5, 16))

    @eqx.filter_jit
    def run(graph, et, x):
        terms = graph.energy_tree({"tokens": x})
        return dict(
            energy=(graph.energy({"tokens": x}), et.energy(et.layer_norm(x))),
            ours=graph.descend({"tokens": x}, step_size=0.1, num_steps=6, return_trajectory=True),
            theirs=et.recall(x, return_trajectory=True),
            # the names as a static output, in the tree's own order (a returned dict's keys
            # come back sorted)
            names=list(terms),
            terms=terms,
            memory=et.memory_energy(et.layer_norm(x)),
        )

    got = run(graph, et, x)
    np.testing.assert_allclose(*got["energy"], rtol=1e-12, atol=1e-12)
    ours, theirs = got["ours"], got["theirs"]
    np.testing.assert_allclose(ours.trajectory["tokens"], theirs.trajectory, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.energies, theirs.energies, rtol=1e-12, atol=1e-12)
    assert got["names"] == ["synapses/attention", "synapses/memory"]
    np.testing.assert_allclose(got["terms"]["synapses/memory"], got["memory"])


def test_clamping_time_constants_and_solvers():
    graph = random_graph(jr.PRNGKey(5), GRAPHS["sigmoid-relu-layernorm-softmax"])
    states = graph.init_states(jr.PRNGKey(6))

    @eqx.filter_jit
    def run(graph, states):
        clamped = graph.descend(states, step_size=0.1, num_steps=3, clamp=["pixels"])
        one = graph.descend(states, step_size=0.1, num_steps=1).value
        force, terms = graph.energy_gradient(states), graph.energy_tree(states)
        return clamped.value, one, force, terms, graph.energy(states)

    clamped, one, force, terms, energy = jax.device_get(run(graph, states))
    states = jax.device_get(states)
    np.testing.assert_array_equal(clamped["pixels"], states["pixels"])
    assert not np.allclose(clamped["label"], states["label"])
    # One step moves each layer by (dt / tau) times its force.
    for name, layer in graph.neurons.items():
        expected = states[name] - 0.1 / layer.tau * force[name]
        np.testing.assert_allclose(one[name], expected, rtol=1e-12, atol=1e-15)
    # The energy is a function of a dict of arrays: the package's minimiser applies as is.
    small = ham.HAM(
        {"a": ham.Neurons(L.identity, 3), "b": ham.Neurons(L.tanh, 2)},
        {"w": ham.DenseSynapse(3, 2, key=jr.PRNGKey(7))},
        {"w": ("a", "b")},
    )
    start = small.init_states(jr.PRNGKey(8))
    minimum = eqx.filter_jit(lambda m, x: m.energy_gradient(ea.minimise(m.energy, x).value))
    for value in minimum(small, start).values():
        np.testing.assert_allclose(value, 0.0, atol=1e-6)
    assert len(terms) == 4 + 5
    np.testing.assert_allclose(sum(terms.values()), energy, rtol=1e-12)


def test_bad_graphs_and_states_name_the_cause(user_mode):
    neurons = {"a": ham.Neurons(L.identity, 3), "b": ham.Neurons(L.relu, (2,))}
    dense = ham.DenseSynapse(3, 2, key=jr.PRNGKey(0))
    with pytest.raises(ValueError, match="connections without synapses: \\['extra'\\]"):
        ham.HAM(neurons, {"w": dense}, {"w": ("a", "b"), "extra": "a"})
    with pytest.raises(ValueError, match="must name layers of the graph"):
        ham.HAM(neurons, {"w": dense}, {"w": ("a", "c")})
    with pytest.raises(ValueError, match="must be an ea.ham.Neurons"):
        ham.HAM({"a": L.identity}, {}, {})
    with pytest.raises(ValueError, match="shape must be a tuple of positive ints"):
        ham.Neurons(L.identity, (0, 2))
    graph = ham.HAM(neurons, {"w": dense}, {"w": ("a", "b")})
    with pytest.raises(ValueError, match="states must be a dict with the layers \\['a', 'b'\\]"):
        graph.energy({"a": np.zeros(3)})
    with pytest.raises(ValueError, match="layer 'b' must have shape \\(2,\\), got \\(3,\\)"):
        graph.energy({"a": np.zeros(3), "b": np.zeros(3)})
    with pytest.raises(ValueError, match="clamp names layers \\['c'\\]"):
        graph.descend(graph.init_states(), step_size=0.1, num_steps=1, clamp=["c"])
    bad = ham.HAM(neurons, {"w": lambda a: a}, {"w": "a"})
    with pytest.raises(ValueError, match="synapse 'w' must return a scalar"):
        bad.energy(graph.init_states())
