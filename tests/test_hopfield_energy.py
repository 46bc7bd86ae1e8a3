"""The log-sum-exp (modern continuous Hopfield) energy and its identity with softmax attention."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def softmax_attention(q, k, v, scale, mask=None):
    """Hand-written reference, independent of the package."""
    scores = scale * q @ k.T
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@jax.jit
def one_step(query, memory, beta, mask=None):
    energy = ea.HopfieldEnergy(memory, beta=beta, mask=mask)
    return ea.descend(energy, query, step_size=1.0, num_steps=1).value


@eqx.filter_jit
def descend_energies(energy, x0, step_size, num_steps):
    return ea.descend(energy, x0, step_size=step_size, num_steps=num_steps).energies


# The seed's sizes: 8 state patterns, 32 stored patterns, latent dimension 512, beta = 1/sqrt(d).
SEQ, MEM, DIM = 8, 32, 512


def test_bare_cross_attention_is_one_descent_step_float64(getkey):
    q = jr.normal(getkey(), (SEQ, DIM))
    m = jr.normal(getkey(), (MEM, DIM))
    beta = DIM**-0.5
    out = one_step(q, m, beta)
    expected = softmax_attention(np.asarray(q), np.asarray(m), np.asarray(m), beta)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    # jax.nn.dot_product_attention as a second baseline. It always takes its softmax in float32
    # (see its source), so it agrees only to float32 precision even on float64 inputs.
    dpa = jax.jit(
        lambda q, m: jax.nn.dot_product_attention(
            q[:, None, :], m[:, None, :], m[:, None, :], scale=beta
        )[:, 0]
    )(q, m)
    np.testing.assert_allclose(out, dpa, rtol=0, atol=1e-6)


def test_gradient_is_query_minus_attention(getkey):
    r"""$\nabla_{q_i} E = q_i - \sum_j \mathrm{softmax}_j(\beta q_i\cdot m_j)\, m_j$."""
    q = jr.normal(getkey(), (5, 7))
    m = jr.normal(getkey(), (9, 7))
    beta = 1.7
    grad = jax.jit(jax.grad(lambda q, m: ea.hopfield_energy(q, m, beta=beta)))(q, m)
    expected = np.asarray(q) - softmax_attention(np.asarray(q), np.asarray(m), np.asarray(m), beta)
    np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-13)


def test_energy_value_matches_formula(getkey):
    q = jr.normal(getkey(), (4, 3))
    m = jr.normal(getkey(), (6, 3))
    beta = 0.8
    scores = beta * np.asarray(q) @ np.asarray(m).T
    lse = np.log(np.exp(scores).sum(axis=-1))
    expected = 0.5 * np.sum(np.asarray(q) ** 2) - lse.sum() / beta
    value = jax.jit(lambda q, m: ea.hopfield_energy(q, m, beta=beta))(q, m)
    np.testing.assert_allclose(value, expected, rtol=1e-14)


def test_bare_self_attention_with_context_held_fixed(getkey):
    x = jr.normal(getkey(), (SEQ, DIM))
    beta = DIM**-0.5
    out = one_step(x, x, beta)  # memory = the inputs, held fixed while the queries move
    expected = softmax_attention(np.asarray(x), np.asarray(x), np.asarray(x), beta)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_self_attention_footnote_both_arguments_differ(getkey):
    """The seed's footnote: differentiating E(x, x) through both arguments is another update.

    The memory path adds $-P^\\top x$ to the gradient ($P$ the attention matrix), so the full
    derivative is $x - Px - P^\\top x$ and one step of size 1 gives $Px + P^\\top x$, not
    softmax attention $Px$. The seed's "missing factor of 2" holds only where $P^\\top x
    \\approx Px$: bare self-attention in high dimension, where every token attends mostly to
    itself.
    """
    beta_scale = 1.0

    @functools.partial(jax.jit, static_argnums=1)
    def attention_and_gradients(x, beta):
        p = jax.nn.softmax(beta * x @ x.T, axis=-1)
        fixed = jax.grad(ea.hopfield_energy, argnums=0)(x, x, beta=beta)
        full = jax.grad(lambda y: ea.hopfield_energy(y, y, beta=beta))(x)
        return p, fixed, full

    for dim, factor_two_holds in [(2, False), (512, True)]:
        x = jr.normal(getkey(), (SEQ, dim))
        beta = beta_scale * dim**-0.5
        p, fixed, full = attention_and_gradients(x, beta)
        x, p = np.asarray(x), np.asarray(p)
        np.testing.assert_allclose(fixed, x - p @ x, atol=1e-12)
        np.testing.assert_allclose(full, x - p @ x - p.T @ x, atol=1e-12)
        full_step = x - full
        softmax = softmax_attention(x, x, x, beta)
        assert not np.allclose(full_step, softmax, atol=1e-3)  # the two updates differ
        # Potential part of the gradient: exactly twice the fixed-context one iff P^T x = P x.
        ratio_error = np.linalg.norm((x - full) - 2 * (x - fixed)) / np.linalg.norm(x - fixed)
        assert (ratio_error < 1e-3) == factor_two_holds, (dim, ratio_error)


def test_mask_drops_entries_exactly(getkey):
    q = np.asarray(jr.normal(getkey(), (4, 5)))
    m = np.asarray(jr.normal(getkey(), (7, 5)))
    mask = np.array(jr.bernoulli(getkey(), 0.5, (4, 7)))
    mask[:, 0] = True
    beta = 1.3
    energy = jax.jit(lambda q, m, mask: ea.hopfield_energy(q, m, beta=beta, mask=mask))(q, m, mask)
    # Reference: each row's log-sum-exp over its own subset of memories only.
    expected = 0.0
    for i in range(4):
        subset = m[mask[i]]
        expected += 0.5 * np.sum(q[i] ** 2)
        expected -= np.log(np.sum(np.exp(beta * subset @ q[i]))) / beta
    np.testing.assert_allclose(energy, expected, rtol=1e-14)
    out = one_step(q, m, beta, mask=mask)
    np.testing.assert_allclose(out, softmax_attention(q, m, m, beta, mask), atol=1e-13)


def test_masked_memories_cannot_leak(getkey):
    """Values hidden behind the mask (even inf/NaN, even huge) change neither energy nor force."""
    q = jr.normal(getkey(), (3, 4))
    m = np.asarray(jr.normal(getkey(), (5, 4)))
    mask = np.ones((3, 5), bool)
    mask[:, 3] = False
    poisoned = m.copy()
    poisoned[3] = [np.nan, np.inf, -np.inf, 1e300]

    @jax.jit
    def run(q, m, poisoned, removed, mask):
        clean = jax.value_and_grad(ea.hopfield_energy)(q, m, mask=mask)
        poison = jax.value_and_grad(ea.hopfield_energy, argnums=(0, 1))(q, poisoned, mask=mask)
        return clean, poison, ea.hopfield_energy(q, removed)

    (e_clean, g_clean), (e_poison, (g_q, g_m)), e_removed = jax.device_get(
        run(q, m, poisoned, np.delete(m, 3, axis=0), mask)
    )
    np.testing.assert_allclose(e_poison, e_clean, rtol=1e-15)
    np.testing.assert_allclose(g_q, g_clean, rtol=1e-15)
    assert np.all(g_m[3] == 0)
    # Removing the masked memory altogether gives the same energy.
    np.testing.assert_allclose(e_removed, e_clean, rtol=1e-14)


def test_fully_masked_row_is_finite_with_zero_force(getkey):
    q = np.asarray(jr.normal(getkey(), (3, 4)))
    m = jr.normal(getkey(), (5, 4))
    mask = np.ones((3, 5), bool)
    mask[1] = False

    @jax.jit
    def run(q, m, mask):
        energy, grads = jax.value_and_grad(ea.hopfield_energy, argnums=(0, 1))(q, m, mask=mask)
        rest = ea.hopfield_energy(q[np.array([0, 2])], m, mask=mask[np.array([0, 2])])
        hess = jax.hessian(lambda x: ea.hopfield_energy(x, m, mask=mask))(q)
        return energy, grads, one_step(q, m, 1.0, mask=mask), rest, hess

    energy, (grad_q, grad_m), step, rest, hess = jax.device_get(run(q, m, mask))
    assert np.isfinite(energy) and np.all(np.isfinite(grad_q)) and np.all(np.isfinite(grad_m))
    # Row 1 only feels its quadratic term: gradient q_1, attention force 0.
    np.testing.assert_allclose(grad_q[1], q[1], rtol=1e-15)
    np.testing.assert_allclose(step[1], 0.0, atol=0)
    # Its energy is the quadratic term alone; the other rows are unaffected.
    # (absolute tolerance: the total is a small difference of O(1) terms)
    np.testing.assert_allclose(energy, rest + 0.5 * np.sum(q[1] ** 2), rtol=0, atol=1e-13)
    # Second derivatives are finite too (training through a masked update).
    assert np.all(np.isfinite(hess))


def test_extreme_scores_are_stable(getkey):
    """Log-sum-exp is shifted: scores of order 1e4 neither overflow nor underflow."""
    q = 100.0 * np.asarray(jr.normal(getkey(), (3, 4)))
    m = 100.0 * np.asarray(jr.normal(getkey(), (6, 4)))
    energy, grad = jax.jit(jax.value_and_grad(lambda q, m: ea.hopfield_energy(q, m, beta=1.0)))(
        q, m
    )
    assert np.isfinite(energy) and np.all(np.isfinite(grad))
    # At such low temperature the update snaps to the best-matching memory.
    best = np.asarray(m)[np.argmax(np.asarray(q) @ np.asarray(m).T, axis=1)]
    np.testing.assert_allclose(np.asarray(q) - grad, best, atol=1e-6)


def test_modern_hopfield_update_is_descent(getkey):
    r"""$\xi \leftarrow X\,\mathrm{softmax}(\beta X^\top \xi)$ is descent with step 1.

    Iterated, it retrieves a stored pattern.
    """
    patterns = np.sign(jr.normal(getkey(), (20, 64)))  # 20 random +-1 patterns, d = 64
    beta = 0.5
    probe = patterns[7].copy()
    probe[:12] *= -1  # 12 of 64 components flipped

    @jax.jit
    def run(patterns, probe):
        xi = probe
        for _ in range(3):
            xi = patterns.T @ jax.nn.softmax(beta * patterns @ xi)
        descent = ea.descend(
            ea.HopfieldEnergy(patterns, beta=beta), probe[None], step_size=1.0, num_steps=3
        )
        return descent.value[0], xi

    retrieved, xi = run(patterns, probe)
    np.testing.assert_allclose(retrieved, xi, atol=1e-12)
    np.testing.assert_allclose(retrieved, patterns[7], atol=1e-6)  # retrieved


def test_unit_step_never_increases_energy(getkey):
    """Step size 1 is the concave-convex procedure for this energy, so the energy decreases.

    (Yuille & Rangarajan's CCCP, used by Ramsauer et al. for the modern Hopfield update.)
    """
    for beta in [0.1, 1.0, 8.0]:
        q = jr.normal(getkey(), (6, 5))
        m = jr.normal(getkey(), (12, 5))
        energies = descend_energies(ea.HopfieldEnergy(m, beta=beta), q, 1.0, 20)
        assert np.all(np.diff(energies) <= 1e-12 * np.abs(energies[:-1]).max()), beta


def test_small_steps_never_increase_energy(getkey):
    m = jr.normal(getkey(), (10, 3))
    mask = jr.bernoulli(getkey(), 0.7, (4, 10))
    for step in [1e-3, 0.1, 0.5]:
        q = jr.normal(getkey(), (4, 3))
        energy = ea.HopfieldEnergy(m, beta=2.0, mask=mask)
        # The step size as an array: one compiled program serves all three.
        energies = descend_energies(energy, q, np.asarray(step), 40)
        assert np.all(np.diff(energies) <= 1e-12 * np.abs(energies).max()), step
        assert energies[-1] < energies[0]


def test_bad_input(user_mode):
    q = np.ones((5, 16))
    message = r"query has dimension 16 but the patterns of memory have dimension 8"
    with pytest.raises(ValueError, match=message):
        ea.hopfield_energy(q, np.ones((32, 8)))
    with pytest.raises(ValueError, match=r"query must have shape \(seq, dim\), got \(16,\)"):
        ea.hopfield_energy(np.ones(16), np.ones((32, 16)))
    with pytest.raises(ValueError, match=r"mask must have shape \(seq=5, mem=32\), got \(32, 5\)"):
        ea.hopfield_energy(q, np.ones((32, 16)), mask=np.ones((32, 5), bool))
    with pytest.raises(ValueError, match="mask must be boolean"):
        ea.hopfield_energy(q, np.ones((32, 16)), mask=np.ones((5, 32)))
    for beta in [0.0, -1.0, float("nan")]:
        with pytest.raises(ValueError, match="beta must be > 0"):
            ea.hopfield_energy(q, np.ones((32, 16)), beta=beta)
    with pytest.raises(ValueError, match="beta must be a scalar"):
        ea.HopfieldEnergy(np.ones((3, 16)), beta=np.ones(2))
    with pytest.raises(ValueError, match=r"mask must have shape \(seq, mem=3\), got \(5, 4\)"):
        ea.HopfieldEnergy(np.ones((3, 16)), mask=np.ones((5, 4), bool))


def test_traced_nonpositive_beta_is_a_runtime_error():
    """A learnable (traced) beta cannot be checked at trace time: error_if raises at run time."""
    q, m = jnp.ones((2, 3)), jnp.ones((4, 3))
    f = eqx.filter_jit(lambda beta: ea.hopfield_energy(q, m, beta=beta))
    assert np.isfinite(f(jnp.array(2.0)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="beta must be > 0"):
        f(jnp.array(-1.0))
