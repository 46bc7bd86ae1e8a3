r"""Effective energies of RBMs (`energyattn/_energy/_rbm.py`), their mixtures and the
Hopfield energies they reduce to.

Seed: M. Bal, *Transformer Attention as an Implicit Mixture of Effective Energy-Based Models*
(2020). The central claim is

$$E(v) = -\log \int \mathrm{d}h\, e^{-E(v, h)}
       = -\sum_i a_i(v_i) - \sum_\mu K_\mu\Big(\sum_i W_{i\mu} v_i\Big),$$

with $K_\mu$ the cumulant generating function of hidden unit $\mu$'s prior. Every expected value
below comes from an independent computation (quadrature or exact enumeration of the joint
energy, or a closed form written out here), never from running the code under test.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

DIM, HIDDEN = 3, 2
# Exact identities (closed forms, sums of a few terms) hold to round-off in float64.
EXACT = 1e-10


# --------------------------------------------------------------------------------------------
# Helpers


def _weights(getkey, scale=0.5, shape=(DIM, HIDDEN)):
    return scale * jr.normal(getkey(), shape)


# Inputs and expected values are built in NumPy: each eager JAX operation compiles on its own.


def _binary_states(dim=DIM, values=(0.0, 1.0)):
    """All 2**dim visible states with entries in `values`, shape (2**dim, dim)."""
    grids = np.meshgrid(*([np.asarray(values)] * dim), indexing="ij")
    return np.stack(grids, axis=-1).reshape(-1, dim)


def _grid_2d(points):
    """The tensor-product grid points x points, shape (len(points)**2, 2)."""
    a, b = np.meshgrid(points, points, indexing="ij")
    return np.stack([a.ravel(), b.ravel()], axis=-1)


def _batched(fn):
    """`fn` over a batch of states, compiled (eager dispatch with runtime checks is slow)."""
    return jax.jit(jax.vmap(fn))


@jax.jit
def _marginal_energies(vs, weights, visible, prior, h_points, log_cell):
    r"""$-\log \sum_k e^{\log w_k - E(v, h_k)}$ for each row $v$ of `vs`.

    The sum runs over the *whole* hidden vector (the rows $h_k$ of `h_points`), with quadrature
    or counting weights $w_k$ = `exp(log_cell)`; the integrand is `ea.rbm_joint_energy`.
    """

    def one(v):
        joint = jax.vmap(lambda h: ea.rbm_joint_energy(v, h, weights, visible, prior))(h_points)
        return -jax.nn.logsumexp(log_cell - joint)

    return jax.vmap(one)(vs)


@jax.jit
def _effective_energies(vs, weights, visible, prior):
    return jax.vmap(lambda v: ea.rbm_effective_energy(v, weights, visible, prior))(vs)


def _visible_cases(getkey):
    """(visible term, states): binary visible units on every state of {0,1}^3, and Gaussian
    visible units (per-dimension variances) at random continuous states."""
    binary = ea.BinaryVisible(jr.normal(getkey(), (DIM,)))
    gaussian = ea.GaussianVisible(jnp.array([0.7, 1.0, 1.6]))
    return [
        (binary, _binary_states()),
        (gaussian, jr.normal(getkey(), (5, DIM))),
    ]


# --------------------------------------------------------------------------------------------
# 1. Effective energy == marginalised joint energy, for each prior


@pytest.mark.parametrize(
    "make_prior",
    [
        lambda: ea.GaussianPrior(),
        lambda: ea.GaussianPrior(mean=0.3, variance=1.7),
        lambda: ea.GaussianPrior(mean=jnp.array([0.3, -0.5]), variance=jnp.array([0.6, 1.4])),
    ],
    ids=["standard", "mean0.3-var1.7", "per-unit"],
)
def test_gaussian_prior_matches_quadrature(getkey, make_prior):
    prior = make_prior()
    weights = _weights(getkey)
    # Trapezoid rule on a uniform 2-D grid over [-L, L]^2 with spacing d. For fixed v the
    # integrand exp(-E(v, h)) is, in each h_mu, a Gaussian of variance s2 = variance_mu centred
    # at c = mean_mu + s2 * (W^T v)_mu (here |c| < 6, s2 in [0.6, 1.7]). For such an entire,
    # Gaussian-decaying integrand the trapezoid rule is spectrally accurate: by Poisson
    # summation its relative error is ~2 exp(-2 pi^2 s2 / d^2) < 1e-30 for d = 0.4, and the
    # truncated tails add ~exp(-(L - |c|)^2 / (2 s2)) < 1e-25 for L = 20. What remains is
    # float64 round-off in a log-sum-exp over ~1e4 terms (~1e-13), so 1e-10 is a safe bound.
    spacing, half_width = 0.4, 20.0
    axis = np.arange(-half_width, half_width + spacing / 2, spacing)
    h_points = _grid_2d(axis)
    log_cell = 2 * np.log(spacing)
    for visible, vs in _visible_cases(getkey):
        t = np.asarray(vs) @ np.asarray(weights)
        centres = np.asarray(prior.mean) + np.asarray(prior.variance) * t
        assert np.max(np.abs(centres)) < 6.0  # the premise of the error bound above
        expected = _marginal_energies(vs, weights, visible, prior, h_points, log_cell)
        got = _effective_energies(vs, weights, visible, prior)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)


def _poisson_tail_bound(rate, k_max):
    """Bound on sum_{h > K} r^h / h! relative to e^r: r^{K+1}/(K+1)! / (1 - r/(K+2)) * e^{-r}
    (the terms after the first fall at least geometrically, by r/(K+2) < 1)."""
    if rate >= k_max + 2:
        return math.inf
    return math.exp((k_max + 1) * math.log(rate) - math.lgamma(k_max + 2) - rate) / (
        1 - rate / (k_max + 2)
    )


@pytest.mark.parametrize(
    "make_prior",
    [lambda: ea.PoissonPrior(1.0), lambda: ea.PoissonPrior(jnp.array([0.4, 1.8]))],
    ids=["rate1", "per-unit"],
)
def test_poisson_prior_matches_exact_sum(getkey, make_prior):
    prior = make_prior()
    weights = _weights(getkey)
    # Exact sum over h in {0, ..., K}^2. For hidden unit mu the summand is e^{-lam} r^h / h!
    # with r = lam * exp((W^T v)_mu), i.e. e^{K(t)} times a Poisson(r) mass; the truncation
    # error relative to the whole sum is the Poisson(r) tail beyond K, bounded (and asserted)
    # below 1e-13 for the largest r that occurs.
    k_max = 60
    counts = np.arange(k_max + 1, dtype=float)
    h_points = _grid_2d(counts)
    for visible, vs in _visible_cases(getkey):
        max_rate = np.max(np.asarray(prior.rate) * np.exp(np.asarray(vs) @ np.asarray(weights)))
        assert _poisson_tail_bound(max_rate, k_max) < 1e-13
        expected = _marginal_energies(vs, weights, visible, prior, h_points, 0.0)
        got = _effective_energies(vs, weights, visible, prior)
        np.testing.assert_allclose(got, expected, rtol=0, atol=EXACT)


@pytest.mark.parametrize(
    "make_prior",
    [
        lambda: ea.BernoulliPrior(),
        lambda: ea.BernoulliPrior(0.2),
        lambda: ea.BernoulliPrior(jnp.array([0.15, 0.7])),
    ],
    ids=["p0.5", "p0.2", "per-unit"],
)
def test_bernoulli_prior_matches_exact_sum(getkey, make_prior):
    prior = make_prior()
    weights = _weights(getkey, scale=1.0)
    h_points = _binary_states(HIDDEN)  # all of {0, 1}^hidden: the sum is exact
    for visible, vs in _visible_cases(getkey):
        expected = _marginal_energies(vs, weights, visible, prior, h_points, 0.0)
        got = _effective_energies(vs, weights, visible, prior)
        np.testing.assert_allclose(got, expected, rtol=0, atol=EXACT)


@pytest.mark.parametrize("value", [1.0, -0.7, (0.5, 2.0)], ids=["c1", "c-0.7", "per-unit"])
def test_constant_prior_is_the_joint_energy_at_the_point_mass(getkey, value):
    prior = ea.ConstantPrior(jnp.asarray(value))
    weights = _weights(getkey, scale=1.0)
    # The prior is a point mass at h = c: the "integral" is the single term h = c.
    h_points = np.broadcast_to(np.asarray(value, dtype=float), (HIDDEN,))[None, :]
    for visible, vs in _visible_cases(getkey):
        expected = _marginal_energies(vs, weights, visible, prior, h_points, 0.0)
        got = _effective_energies(vs, weights, visible, prior)
        np.testing.assert_allclose(got, expected, rtol=0, atol=EXACT)


# --------------------------------------------------------------------------------------------
# 2. Reductions to the named Hopfield energies


def _random_and_spin_states(getkey, dim):
    return np.concatenate([_binary_states(dim, (-1.0, 1.0)), jr.normal(getkey(), (4, dim))])


def test_gaussian_hidden_units_give_the_classical_hopfield_energy(getkey):
    # kappa_1 = 0, kappa_2 = 1: E(v) = -a.v - 1/2 v^T (W W^T) v, with the diagonal of W W^T.
    dim, hidden = 4, 3
    weights = _weights(getkey, scale=1.0, shape=(dim, hidden))
    bias = jr.normal(getkey(), (dim,))
    energy = ea.RBMEffectiveEnergy(weights, ea.BinaryVisible(bias), ea.GaussianPrior(0.0, 1.0))
    couplings = weights @ weights.T
    vs = _random_and_spin_states(getkey, dim)
    expected = _batched(lambda v: ea.classical_hopfield_energy(v, couplings, -bias))(vs)
    np.testing.assert_allclose(_batched(energy)(vs), expected, rtol=0, atol=EXACT)


def test_poisson_hidden_units_give_the_dense_exponential_memory(getkey):
    # kappa_n = 1 for all n: K(t) = e^t - 1, so E(v) = -a.v - sum_mu exp(W_mu . v) + hidden.
    dim, hidden = 4, 3
    weights = _weights(getkey, scale=0.7, shape=(dim, hidden))
    bias = jr.normal(getkey(), (dim,))
    energy = ea.RBMEffectiveEnergy(weights, ea.BinaryVisible(bias), ea.PoissonPrior(1.0))
    vs = _random_and_spin_states(getkey, dim)
    separation = ea.ExponentialSeparation()
    dense = _batched(lambda v: ea.dense_hopfield_energy(v, weights.T, separation))(vs)
    expected = -vs @ bias + dense + hidden
    np.testing.assert_allclose(_batched(energy)(vs), expected, rtol=0, atol=EXACT)


def test_bernoulli_hidden_units_give_the_binary_rbm_free_energy(getkey):
    # p = sigmoid(c): K(t) = softplus(c + t) - softplus(c), the textbook binary RBM free energy
    # F(v) = -a.v - sum_mu softplus(c_mu + (W^T v)_mu), here normalised by + sum softplus(c).
    dim, hidden = 4, 3
    weights = _weights(getkey, scale=1.0, shape=(dim, hidden))
    bias = jr.normal(getkey(), (dim,))
    hidden_bias = jr.normal(getkey(), (hidden,))
    prior = ea.BernoulliPrior(jax.nn.sigmoid(hidden_bias))
    energy = ea.RBMEffectiveEnergy(weights, ea.BinaryVisible(bias), prior)
    vs = _binary_states(dim)
    bias, weights, hidden_bias = (np.asarray(a) for a in (bias, weights, hidden_bias))
    softplus = lambda t: np.logaddexp(0.0, t)  # noqa: E731
    expected = (
        -vs @ bias
        - np.sum(softplus(hidden_bias + vs @ weights), axis=1)
        + np.sum(softplus(hidden_bias))
    )
    np.testing.assert_allclose(_batched(energy)(vs), expected, rtol=0, atol=EXACT)


def _single_unit_mixture(weights, log_weights=None):
    """The seed's mixture: one effective RBM per stored pattern, each with a single hidden
    unit frozen at 1 (ConstantPrior(1)) and unit-variance Gaussian visible units."""
    components = [
        ea.RBMEffectiveEnergy(
            weights[:, mu : mu + 1], ea.GaussianVisible(1.0), ea.ConstantPrior(1.0)
        )
        for mu in range(weights.shape[1])
    ]
    return ea.MixtureEnergy(components, log_weights)


def test_mixture_of_single_unit_rbms_is_the_log_sum_exp_energy(getkey):
    dim, mem = 4, 5
    weights = _weights(getkey, scale=1.0, shape=(dim, mem))
    mixture = _single_unit_mixture(weights)
    hopfield = lambda v: ea.hopfield_energy(v[None, :], weights.T, beta=1.0)  # noqa: E731
    vs = 2.0 * jr.normal(getkey(), (6, dim))
    np.testing.assert_allclose(_batched(mixture)(vs), _batched(hopfield)(vs), rtol=0, atol=EXACT)
    # The force of the mixture (responsibility-weighted forces of the components) is the
    # force of the Hopfield energy, i.e. the attention update.
    np.testing.assert_allclose(
        _batched(jax.grad(mixture))(vs), _batched(jax.grad(hopfield))(vs), rtol=0, atol=EXACT
    )


def test_mixture_log_weights(getkey):
    # E(v) = -log sum_k w_k exp(-E_k(v)), with E_k(v) = |v|^2/2 - W_k . v written out here.
    dim, mem = 3, 4
    weights = _weights(getkey, scale=1.0, shape=(dim, mem))
    log_weights = jr.normal(getkey(), (mem,))
    mixture = _single_unit_mixture(weights, log_weights)
    vs = np.asarray(jr.normal(getkey(), (4, dim)))
    components = 0.5 * np.sum(vs**2, axis=1, keepdims=True) - vs @ np.asarray(weights)
    expected = -np.log(np.sum(np.exp(np.asarray(log_weights) - components), axis=1))
    np.testing.assert_allclose(_batched(mixture)(vs), expected, rtol=0, atol=EXACT)


# --------------------------------------------------------------------------------------------
# 3. Cumulants


def _cumulant(prior, order):
    """`ea.cumulant`, compiled (nested JVPs are slow to dispatch eagerly)."""
    return jax.jit(ea.cumulant, static_argnums=1)(prior, order)


def test_cumulants_of_the_standard_gaussian():
    prior = ea.GaussianPrior()
    for order, expected in [(1, 0.0), (2, 1.0), (3, 0.0), (4, 0.0)]:
        np.testing.assert_allclose(_cumulant(prior, order), expected, rtol=0, atol=EXACT)


@pytest.mark.parametrize("rate", [1.0, 0.3, 2.5])
def test_all_poisson_cumulants_equal_the_rate(rate):
    prior = ea.PoissonPrior(rate)
    for order in range(1, 6):
        np.testing.assert_allclose(_cumulant(prior, order), rate, rtol=0, atol=EXACT)


@pytest.mark.parametrize("value", [1.0, -2.3])
def test_constant_has_only_a_first_cumulant(value):
    prior = ea.ConstantPrior(value)
    np.testing.assert_allclose(_cumulant(prior, 1), value, rtol=0, atol=EXACT)
    np.testing.assert_allclose(_cumulant(prior, 2), 0.0, rtol=0, atol=EXACT)


@pytest.mark.parametrize("p", [0.5, 0.2, 0.9])
def test_bernoulli_cumulants(p):
    prior = ea.BernoulliPrior(p)
    np.testing.assert_allclose(_cumulant(prior, 1), p, rtol=0, atol=EXACT)
    np.testing.assert_allclose(_cumulant(prior, 2), p * (1 - p), rtol=0, atol=EXACT)
    np.testing.assert_allclose(_cumulant(prior, 3), p * (1 - p) * (1 - 2 * p), rtol=0, atol=EXACT)


def test_per_unit_parameters_give_per_unit_cumulants():
    mean, variance = np.array([0.3, -1.2, 0.0]), np.array([0.5, 2.0, 1.0])
    rate, p = np.array([0.4, 1.0, 3.0]), np.array([0.1, 0.5, 0.8])
    value = np.array([1.0, -1.0, 2.0])
    cases = [
        (ea.GaussianPrior(mean, variance), {1: mean, 2: variance, 3: 0 * mean}),
        (ea.PoissonPrior(rate), {1: rate, 2: rate, 4: rate}),
        (ea.BernoulliPrior(p), {1: p, 2: p * (1 - p)}),
        (ea.ConstantPrior(value), {1: value, 2: 0 * value}),
    ]
    for prior, expected in cases:
        for order, want in expected.items():
            got = _cumulant(prior, order)
            assert got.shape == (3,), (type(prior).__name__, order, got.shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=EXACT)


# --------------------------------------------------------------------------------------------
# 4. The modern Hopfield partition function of the seed


def test_log_sum_exp_partition_function(getkey):
    # Z = int d xi exp(-E(xi; X)) = sum_mu int exp(-|xi|^2/2 + x_mu . xi) = (2 pi)^{n/2}
    # sum_mu exp(|x_mu|^2 / 2), in n = 2. Trapezoid rule on [-L, L]^2, spacing d: the integrand
    # is a sum of unit-variance Gaussians centred at the x_mu (|x_mu| < 2.5), so the aliasing
    # error is ~2 exp(-2 pi^2 / d^2) ~ 1e-34 for d = 0.5, the tails beyond L = 14 are
    # ~exp(-(L - 2.5)^2 / 2) ~ 1e-29, and round-off in the log-sum-exp over ~3e3 terms is
    # ~1e-13: log Z agrees to 1e-10.
    memory = jr.normal(getkey(), (3, 2))
    assert np.max(np.linalg.norm(np.asarray(memory), axis=1)) < 2.5
    spacing, half_width = 0.5, 14.0
    points = _grid_2d(np.arange(-half_width, half_width + spacing / 2, spacing))
    energies = _batched(lambda xi: ea.hopfield_energy(xi[None, :], memory, beta=1.0))(points)
    energies = np.asarray(energies)
    lowest = np.min(energies)
    log_z = -lowest + np.log(np.sum(np.exp(lowest - energies))) + 2 * np.log(spacing)
    squared_norms = np.sum(np.asarray(memory) ** 2, axis=1)
    expected = np.log(2 * np.pi) + np.log(np.sum(np.exp(0.5 * squared_norms)))
    np.testing.assert_allclose(log_z, expected, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------------------------
# 5. Descent on effective energies


@pytest.mark.parametrize(
    "make_prior",
    [
        lambda: ea.GaussianPrior(0.2, 1.5),
        lambda: ea.PoissonPrior(1.0),
        lambda: ea.BernoulliPrior(0.3),
        lambda: ea.ConstantPrior(1.0),
    ],
    ids=["gaussian", "poisson", "bernoulli", "constant"],
)
def test_descent_on_effective_energies_is_monotone(getkey, make_prior):
    # With small weights and Gaussian visible units the energy is smooth with curvature
    # O(1) near the start, so a step of 1e-2 (far below 2 / curvature) must never raise it.
    weights = _weights(getkey, scale=0.3)
    energy = ea.RBMEffectiveEnergy(weights, ea.GaussianVisible(1.0), make_prior())
    v0 = 2.0 * jr.normal(getkey(), (DIM,))

    @eqx.filter_jit
    def descend_and_evaluate(energy, v0):
        """The descent and the energy at its start and end: one compilation."""
        result = ea.descend(energy, v0, step_size=1e-2, num_steps=50)
        return result, energy(v0), energy(result.value)

    result, first, last = descend_and_evaluate(energy, v0)
    energies = np.asarray(result.energies)
    assert energies.shape == (51,)
    np.testing.assert_allclose(energies[0], first, rtol=0, atol=EXACT)
    np.testing.assert_allclose(energies[-1], last, rtol=0, atol=EXACT)
    scale = np.max(np.abs(energies))
    assert np.all(np.diff(energies) <= 1e-12 * scale), np.diff(energies)
    # ... and it actually descends (a frozen state would pass the check above).
    assert energies[-1] < energies[0] - 1e-3 * scale


# --------------------------------------------------------------------------------------------
# 6. jit, grad and trainable parameters


def test_jit_grad_matches_the_closed_form_force(getkey):
    # For GaussianVisible(s2) and PoissonPrior(lam): dE/dv = v / s2 - W lam exp(W^T v).
    weights = _weights(getkey)
    variance, rate = 1.3, 0.8
    energy = ea.RBMEffectiveEnergy(weights, ea.GaussianVisible(variance), ea.PoissonPrior(rate))
    v = jr.normal(getkey(), (DIM,))
    eager = jax.grad(energy)(v)
    jitted = jax.jit(jax.grad(energy))(v)
    v, weights = np.asarray(v), np.asarray(weights)
    closed_form = v / variance - weights @ (rate * np.exp(v @ weights))
    np.testing.assert_allclose(jitted, eager, rtol=0, atol=EXACT)
    np.testing.assert_allclose(eager, closed_form, rtol=0, atol=EXACT)


def test_parameters_are_trainable(getkey):
    # Gradients w.r.t. the module: dE/dW_{i mu} = -v_i K'(t_mu) and dE/dlam = -sum(e^t - 1).
    weights = _weights(getkey)
    rate = 0.8
    energy = ea.RBMEffectiveEnergy(weights, ea.GaussianVisible(1.0), ea.PoissonPrior(rate))
    v = jr.normal(getkey(), (DIM,))
    grads = eqx.filter_jit(eqx.filter_grad(lambda e, x: e(x)))(energy, v)
    v, t = np.asarray(v), np.asarray(v) @ np.asarray(weights)
    assert np.all(np.isfinite(grads.weights))
    np.testing.assert_allclose(grads.weights, -np.outer(v, rate * np.exp(t)), rtol=0, atol=EXACT)
    np.testing.assert_allclose(grads.prior.rate, -np.sum(np.expm1(t)), rtol=0, atol=EXACT)


# --------------------------------------------------------------------------------------------
# 7. Bad input: ValueErrors that name the shapes and values


def test_weights_with_the_wrong_first_dimension(user_mode):
    v, weights = jnp.ones(3), jnp.ones((4, 2))
    message = re.escape("weights must have shape (dim=3, hidden), got (4, 2)")
    with pytest.raises(ValueError, match=message):
        ea.rbm_effective_energy(v, weights, ea.BinaryVisible(), ea.GaussianPrior())
    with pytest.raises(ValueError, match=message):
        ea.rbm_joint_energy(v, jnp.ones(2), weights, ea.BinaryVisible(), ea.GaussianPrior())
    with pytest.raises(ValueError, match=message):
        ea.RBMEffectiveEnergy(weights)(v)


def test_visible_state_of_rank_two(user_mode):
    message = re.escape("visible state must have shape (dim), got (2, 3)")
    with pytest.raises(ValueError, match=message):
        ea.rbm_effective_energy(
            jnp.ones((2, 3)), jnp.ones((3, 2)), ea.BinaryVisible(), ea.GaussianPrior()
        )


def test_hidden_state_of_the_wrong_size(user_mode):
    # One-element shapes may be written (3) or, as Python does, (3,).
    message = re.escape("hidden state must have shape (hidden=2), got ") + r"\(3,?\)"
    with pytest.raises(ValueError, match=message):
        ea.rbm_joint_energy(
            jnp.ones(3), jnp.ones(3), jnp.ones((3, 2)), ea.BinaryVisible(), ea.GaussianPrior()
        )


def test_mixture_log_weights_of_the_wrong_length(user_mode):
    components = [ea.RBMEffectiveEnergy(jnp.ones((3, 1))), ea.RBMEffectiveEnergy(jnp.ones((3, 1)))]
    with pytest.raises(ValueError, match=r"log_weights must have shape \(2,?\).*got \(3,?\)"):
        ea.MixtureEnergy(components, log_weights=jnp.zeros(3))


def test_non_positive_gaussian_variance(user_mode):
    with pytest.raises(ValueError, match=re.escape("variance must be > 0, got 0.0")):
        ea.GaussianPrior(variance=0.0)


def test_bernoulli_probability_outside_the_unit_interval(user_mode):
    # The message must name the parameter and the offending value (as given, 1.5, or as the
    # violated bound 1 - p = -0.5).
    with pytest.raises(ValueError, match=r"probability.*(1\.5|-0\.5)"):
        ea.BernoulliPrior(probability=1.5)
    with pytest.raises(ValueError, match=r"probability.*-0\.2"):
        ea.BernoulliPrior(probability=-0.2)


def test_cumulant_of_order_zero(user_mode):
    with pytest.raises(ValueError, match=r"order must be a positive integer, got 0"):
        ea.cumulant(ea.GaussianPrior(), 0)


def test_prior_parameters_are_validated_per_unit_and_when_traced(user_mode):
    """Per-unit parameter arrays are checked entry by entry; traced ones at run time."""
    with pytest.raises(
        ValueError, match=r"probability must be in \(0, 1\), got \[1.5\] among its entries"
    ):
        ea.BernoulliPrior(jnp.array([1.5, 0.5]))
    with pytest.raises(ValueError, match=r"probability must be in \(0, 1\), got 1.5"):
        ea.BernoulliPrior(1.5)
    with pytest.raises(ValueError, match=r"variance must be > 0, got \[-1.0\] among its entries"):
        ea.GaussianPrior(variance=[-1.0, 1.0])
    with pytest.raises(ValueError, match=r"rate must be > 0, got \[0.0\] among its entries"):
        ea.PoissonPrior(jnp.array([0.0, 2.0]))
    with pytest.raises(ValueError, match=r"variance must be > 0"):
        ea.GaussianVisible(jnp.array([1.0, -2.0]))
    with pytest.raises(ValueError, match="order must be a positive integer, got True"):
        ea.cumulant(ea.GaussianPrior(), True)

    @eqx.filter_jit
    def energy(p):
        return ea.rbm_effective_energy(
            jnp.ones(3), jnp.ones((3, 2)), ea.BinaryVisible(), ea.BernoulliPrior(p)
        )

    assert np.isfinite(energy(jnp.array(0.3)))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"probability must be in \(0, 1\)"):
        energy(jnp.array(1.5))


class RademacherPrior(ea.AbstractHiddenPrior):
    """A user's own prior: h = ±1 with probability ½ each, K(t) = log cosh t."""

    def cumulant_generating_function(self, t):
        return jnp.logaddexp(t, -t) - jnp.log(2.0)

    def log_prob(self, h):
        return jnp.where(jnp.abs(h) == 1, -jnp.log(2.0), -jnp.inf)


def test_user_defined_prior_marginalises_exactly(getkey):
    """A prior written by a user plugs into the effective energy; checked by exact enumeration."""
    prior = RademacherPrior()
    weights = _weights(getkey)
    h_points = _binary_states(HIDDEN, values=(-1.0, 1.0))
    for visible, vs in _visible_cases(getkey):
        expected = _marginal_energies(vs, weights, visible, prior, h_points, 0.0)
        got = _effective_energies(vs, weights, visible, prior)
        np.testing.assert_allclose(got, expected, rtol=0, atol=EXACT)
    # Its cumulants: kappa_1 = 0, kappa_2 = 1, kappa_4 = -2 (those of log cosh).
    np.testing.assert_allclose(
        [_cumulant(prior, n) for n in (1, 2, 3, 4)], [0.0, 1.0, 0.0, -2.0], atol=EXACT
    )
