"""Energy Transformer: the layer norm's Lagrangian, the ET energy and its Lyapunov dynamics."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def small_et(key, **kwargs):
    # The tutorial's small configuration.
    return ea.nn.EnergyTransformer(12, num_heads=2, head_dim=6, num_memories=24, key=key, **kwargs)


def reference_layer_norm(x, gamma, delta, eps):
    centred = x - x.mean(-1, keepdims=True)
    return gamma * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) + delta


def test_layer_norm_is_gradient_of_lagrangian(getkey):
    ln = ea.nn.EnergyLayerNorm(7, eps=1e-3)
    ln = eqx.tree_at(lambda m: (m.gamma, m.delta), ln, (np.asarray(1.7), jr.normal(getkey(), (7,))))
    x = 3.0 * np.asarray(jr.normal(getkey(), (5, 7))) + 2.0

    @eqx.filter_jit
    def run(ln, x):
        return dict(
            tokens=ln(x),
            token=ln(x[2]),
            lagrangian=ln.lagrangian(x),
            per_token=[ln.lagrangian(t) for t in x],
            grad=jax.grad(ea.layer_norm_lagrangian)(x, 1.7, ln.delta, eps=1e-3),
        )

    got = jax.device_get(run(ln, x))
    expected = reference_layer_norm(x, 1.7, np.asarray(ln.delta), 1e-3)
    np.testing.assert_allclose(got["tokens"], expected, rtol=1e-12, atol=1e-12)
    # One token at a time gives the same; the Lagrangian of tokens is the sum of theirs.
    np.testing.assert_allclose(got["token"], expected[2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["lagrangian"], sum(got["per_token"]), rtol=1e-12)
    # And the gradient of the pure Lagrangian is the same map.
    np.testing.assert_allclose(got["grad"], expected, rtol=1e-12, atol=1e-12)


def test_layer_norm_lagrangian_value_and_legendre_energy(getkey):
    x = np.asarray(jr.normal(getkey(), (4, 6)))
    delta = np.asarray(jr.normal(getkey(), (6,)))
    ln = eqx.tree_at(
        lambda m: (m.gamma, m.delta), ea.nn.EnergyLayerNorm(6), (np.asarray(0.5), delta)
    )
    value, energy = eqx.filter_jit(
        lambda ln, x, delta: (ea.layer_norm_lagrangian(x, 0.5, delta), ln.energy(x))
    )(ln, x, delta)
    centred = x - x.mean(-1, keepdims=True)
    spread = np.sqrt((centred**2).mean(-1) + 1e-5)
    lagrangian = 6 * 0.5 * spread.sum() + float(np.sum(x * delta))
    np.testing.assert_allclose(value, lagrangian, rtol=1e-12)
    g = reference_layer_norm(x, 0.5, delta, 1e-5)
    np.testing.assert_allclose(energy, np.sum(g * x) - lagrangian, rtol=1e-10)
    # For the layer norm the Legendre energy has a closed form: -D*gamma*eps/sqrt(var + eps).
    np.testing.assert_allclose(energy, np.sum(-6 * 0.5 * 1e-5 / spread), rtol=1e-6)


def test_layer_norm_lagrangian_is_convex(getkey):
    # The Lyapunov argument needs a positive semi-definite Hessian of L.
    x = jr.normal(getkey(), (8,))
    hessian = jax.jit(jax.hessian(ea.layer_norm_lagrangian))(x, 2.0)
    assert np.linalg.eigvalsh(np.asarray(hessian)).min() > -1e-12


def hand_derived_update(et, g):
    """-dE/dg written out by hand: the attention (as query and as key) and the MLP."""
    g = np.asarray(g)
    wq, wk, xi = (np.asarray(a) for a in (et.w_query, et.w_key, et.memories))
    beta = et.beta
    n = g.shape[0]
    force = np.zeros_like(g)
    for h in range(wq.shape[0]):
        q = g @ wq[h].T  # (seq, head_dim)
        k = g @ wk[h].T
        scores = beta * q @ k.T  # scores[C, B]: query C, key B
        np.fill_diagonal(scores, -np.inf)
        p = np.exp(scores - scores.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        # token A as a query: sum_B p[A, B] W_Q^T k_B; as a key: sum_C p[C, A] W_K^T q_C.
        force += (p @ k) @ wq[h] + (p.T @ q) @ wk[h]
    hidden = g @ xi.T
    force += np.maximum(hidden, 0.0) @ xi
    assert force.shape == (n, g.shape[1])
    return force


def test_energy_gradient_is_attention_plus_memory_update(getkey):
    et = small_et(getkey())

    @eqx.filter_jit
    def run(et, x):
        g = et.layer_norm(x)
        terms = ea.energy_tree(et.as_energy(), g)
        named = (et.attention_energy(g), et.memory_energy(g), et.energy(g))
        return g, jax.grad(et.energy)(g), terms, named

    g, grad, terms, (attention, memory, total) = jax.device_get(
        run(et, jr.normal(getkey(), (9, 12)))
    )
    np.testing.assert_allclose(-grad, hand_derived_update(et, g), rtol=1e-10, atol=1e-10)
    # The total is the sum of the named terms.
    assert set(terms) == {"attention", "memory"}
    np.testing.assert_allclose(terms["attention"], attention, rtol=1e-14)
    np.testing.assert_allclose(terms["memory"], memory, rtol=1e-14)
    np.testing.assert_allclose(total, terms["attention"] + terms["memory"], rtol=1e-14)


def test_attention_energy_value_self_term_and_mask(getkey):
    g = jr.normal(getkey(), (5, 4))
    wq = jr.normal(getkey(), (3, 2, 4))
    wk = jr.normal(getkey(), (3, 2, 4))
    beta = 0.7
    g_, wq_, wk_ = np.asarray(g), np.asarray(wq), np.asarray(wk)
    # scores[h, C, B] = beta * (W_Q g_C) . (W_K g_B)
    scores = np.stack([beta * (g_ @ wq_[h].T) @ (g_ @ wk_[h].T).T for h in range(3)])

    def lse(a, axis):
        m = a.max(axis, keepdims=True)
        return (m + np.log(np.exp(a - m).sum(axis, keepdims=True))).squeeze(axis)

    with_self = -lse(scores, -1).sum() / beta
    off = np.where(np.eye(5, dtype=bool), -np.inf, scores)
    without_self = -lse(off, -1).sum() / beta
    energy = ea.transformer_attention_energy
    mask = np.eye(5, dtype=bool)

    @jax.jit
    def run(g, wq, wk):
        return (
            energy(g, wq, wk, beta=beta),
            energy(g, wq, wk, beta=beta, include_self=True),
            energy(g, wq, wk, beta=beta, mask=mask, include_self=True),
            energy(g, wq, wk, beta=beta, mask=mask),
            jax.grad(energy)(g, wq, wk, beta=beta, mask=mask),
        )

    plain, including_self, masked_self, masked, masked_force = run(g, wq, wk)
    np.testing.assert_allclose(plain, without_self, rtol=1e-12)
    np.testing.assert_allclose(including_self, with_self, rtol=1e-12)
    # A mask drops pairs exactly; with every other token masked each query sees only itself.
    np.testing.assert_allclose(masked_self, -np.einsum("hcc->", scores) / beta, rtol=1e-12)
    # ... and without the self term nothing is left: zero energy, zero force.
    assert masked == 0.0
    np.testing.assert_array_equal(masked_force, np.zeros((5, 4)))


def test_softmax_memory_energy(getkey):
    g = jr.normal(getkey(), (6, 5))
    xi = jr.normal(getkey(), (7, 5))
    et = ea.nn.EnergyTransformer(
        5, num_heads=1, head_dim=3, num_memories=7, memory="softmax", memory_beta=2.0, key=getkey()
    )
    et = eqx.tree_at(lambda m: m.memories, et, xi)

    @eqx.filter_jit
    def run(et, g, xi):
        value, grad = jax.value_and_grad(ea.transformer_memory_energy)(
            g, xi, kind="softmax", beta=2.0
        )
        return value, grad, et.memory_energy(g)

    value, grad, layer_value = run(et, g, xi)
    hidden = 2.0 * np.asarray(g) @ np.asarray(xi).T
    expected = -np.log(np.exp(hidden).sum(-1)).sum() / 2.0
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    # -grad is the softmax-weighted memory.
    p = np.exp(hidden) / np.exp(hidden).sum(-1, keepdims=True)
    np.testing.assert_allclose(-grad, p @ np.asarray(xi), rtol=1e-10)
    np.testing.assert_allclose(layer_value, expected, rtol=1e-12)


def energy_lower_bound(et, num_tokens):
    """A bound below the ET energy for any g on the layer norm's image (|g_B| <= |gamma| sqrt(D)
    + |delta|): each score is at most |W_Q g||W_K g|, each memory overlap at most |xi||g|."""
    radius = abs(float(et.layer_norm.gamma)) * np.sqrt(et.dim) + np.linalg.norm(
        np.asarray(et.layer_norm.delta)
    )
    wq_norm = max(np.linalg.norm(np.asarray(w), 2) for w in et.w_query)
    wk_norm = max(np.linalg.norm(np.asarray(w), 2) for w in et.w_key)
    heads = et.w_query.shape[0]
    max_score = wq_norm * wk_norm * radius**2
    attention = -heads * num_tokens * (np.log(num_tokens) / et.beta + max_score)
    memory = (
        -0.5 * num_tokens * np.sum((np.linalg.norm(np.asarray(et.memories), axis=1) * radius) ** 2)
    )
    return attention + memory


# 3000 descent steps: the run, not the compilation, dominates.
@pytest.mark.usefixtures("optimised_xla")
@pytest.mark.parametrize("include_self", [False, True])
def test_lyapunov_energy_decreases_and_is_bounded_tutorial_config(getkey, include_self):
    # The tutorial's check: small config, 100 tokens, 3000 steps of size 0.5, random weights.
    et = small_et(getkey(), include_self=include_self)
    x0 = jr.normal(getkey(), (100, 12))

    @eqx.filter_jit
    def run(et, x0):
        descent = et.recall(x0, step_size=0.5, num_steps=3000, return_trajectory=True)
        # One state at a time: a vmap over the 3001 states runs twice as long (its batched
        # (3001, heads, 100, 100) score arrays do not stay in cache).
        return descent.energies, jax.lax.map(et.lyapunov, descent.trajectory)

    energies, lyapunov = (np.asarray(a) for a in run(et, x0))
    assert lyapunov.shape == (3001,)
    assert np.all(np.diff(lyapunov) <= 1e-9 * np.abs(lyapunov).max())
    assert lyapunov[-1] < lyapunov[0] - 1.0  # it really moved
    assert lyapunov.min() >= energy_lower_bound(et, 100)
    # The recorded descent energies are E(g_t); the Lyapunov adds the layer norm's Legendre
    # energy -D gamma eps / sqrt(var + eps) per token, at most D gamma sqrt(eps) in size.
    assert np.all(np.abs(lyapunov - energies) <= 100 * 12 * np.sqrt(1e-5))


def test_recall_is_descend_with_layer_norm_activation(getkey):
    et = small_et(getkey(), step_size=0.2, num_steps=5)
    x0 = jr.normal(getkey(), (7, 12))
    mask = jr.bernoulli(getkey(), 0.7, (7, 7))

    @eqx.filter_jit
    def run(et, x0, mask):
        direct = ea.descend(
            et.as_energy(), x0, mask, step_size=0.2, num_steps=5, activation=et.layer_norm
        )
        out, descent = et(x0, mask=mask, return_solution=True)
        # by hand: x <- x - alpha * dE/dg at g = LN(x)
        x = x0
        for _ in range(5):
            x = x - 0.2 * jax.grad(et.energy)(et.layer_norm(x), mask)
        return direct, out, descent, x

    direct, out, descent, x = run(et, x0, mask)
    np.testing.assert_allclose(out, direct.value, rtol=1e-12)
    np.testing.assert_allclose(descent.energies, direct.energies, rtol=1e-12)
    np.testing.assert_allclose(out, x, rtol=1e-10, atol=1e-12)


def test_layer_jit_vmap_grad(getkey):
    """Under jit, vmap over a batch gives each example's output, and the gradient agrees
    with a finite difference (all in one compiled program)."""
    et = small_et(getkey(), num_steps=3)
    xs = jr.normal(getkey(), (4, 6, 12))
    direction = np.asarray(jr.normal(getkey(), et.memories.shape))
    eps = 1e-6

    def loss(et, x):
        return jnp.sum(et.layer_norm(et(x)) ** 2 * jnp.arange(12.0))

    def shift(et, s):
        return eqx.tree_at(lambda m: m.memories, et, et.memories + s * direction)

    @eqx.filter_jit
    def run(et, xs):
        batched = eqx.filter_vmap(lambda m, x: m(x), in_axes=(None, 0))(et, xs)
        grads = eqx.filter_grad(loss)(et, xs[0])
        # finite difference along a random direction in the memories
        up, down = jax.vmap(lambda s: loss(shift(et, s), xs[0]))(jnp.array([eps, -eps]))
        return batched, et(xs[1]), grads, (up - down) / (2 * eps)

    batched, single, grads, fd = jax.device_get(run(et, xs))
    np.testing.assert_allclose(batched[1], single, rtol=1e-10)
    np.testing.assert_allclose(np.sum(grads.memories * direction), fd, rtol=1e-6)
    assert np.all(np.isfinite(grads.layer_norm.gamma))


def test_bad_inputs(user_mode, getkey):
    et = small_et(getkey())
    with pytest.raises(ValueError, match=r"x must have shape \(seq, dim=12\), got \(5, 8\)"):
        et(np.zeros((5, 8)))
    with pytest.raises(ValueError, match=r"mask must have shape \(seq=5, seq=5\), got \(5, 4\)"):
        et(np.ones((5, 12)), mask=np.ones((5, 4), bool))
    with pytest.raises(ValueError, match="memory must be 'relu' or 'softmax'"):
        ea.nn.EnergyTransformer(
            4, num_heads=1, head_dim=2, num_memories=3, memory="tanh", key=getkey()
        )
    with pytest.raises(ValueError, match="w_key must have shape"):
        ea.transformer_attention_energy(
            np.zeros((3, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 5)), beta=1.0
        )
    with pytest.raises(ValueError, match="beta must be > 0"):
        ea.transformer_attention_energy(
            np.zeros((3, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4)), beta=0.0
        )
    with pytest.raises(ValueError, match=r"x must have shape \(dim=6,\) or \(seq, dim=6\)"):
        ea.nn.EnergyLayerNorm(6)(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="eps must be > 0"):
        ea.nn.EnergyLayerNorm(6, eps=0.0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="x contains NaN"):
        eqx.filter_jit(et)(np.full((3, 12), np.nan))
