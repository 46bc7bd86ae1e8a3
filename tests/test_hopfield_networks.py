"""Discrete Hopfield networks: Hebbian couplings, classical and dense energies, sign dynamics.

The spec is M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers*,
sections "Classical discrete Hopfield networks" (W = sum_mu x_mu x_mu^T,
E = -1/2 xi^T W xi + xi^T b, xi <- sgn(W xi - b), capacity C ~ 0.14 d) and "Modern discrete
Hopfield networks" (E = -sum_mu F(x_mu . xi) with F(x) = x^a, capacity ~ d^(a-1), or
F = exp, capacity ~ 2^(d/2)).

Every expected value below is computed independently in the test (by hand, in NumPy or with
an explicit loop), never pasted from a run of the code under test.

Run time is dominated by XLA compiling `sign_descend`'s nested scans (seconds per program on
a small CPU), so the sign-dynamics tests share a few jitted programs: `_async` / `_sync` run
NUM_SWEEPS sweeps from a (NUM_STARTS, DIM) batch of states, and every test that can uses
energies of the same types and shapes (classical with or without bias, x^3, exp). The
exponential memory of 1000 patterns is the exception: its sweeps (every unit's update
evaluates the energy, 1000 overlaps) run for seconds, so the tests that run it use the
`optimised_xla` fixture.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

DIM = 100
NUM_STARTS = 40  # states per batch: probes, random starts, stored patterns
NUM_SWEEPS = 5
FLIP_FRACTION = 0.1  # probes: 10 of the 100 bits of a stored pattern flipped


@eqx.filter_jit
def _async(energy, starts, keys):
    """NUM_SWEEPS asynchronous sweeps from each start; a random unit order per sweep from
    `keys` (one key per start), or the fixed order 0, 1, ..., d-1 when `keys` is None."""
    if keys is None:
        run = lambda s0: ea.sign_descend(  # noqa: E731
            energy, s0, num_sweeps=NUM_SWEEPS, return_trajectory=True
        )
        return jax.vmap(run)(starts)
    run = lambda s0, k: ea.sign_descend(  # noqa: E731
        energy, s0, num_sweeps=NUM_SWEEPS, key=k, return_trajectory=True
    )
    return jax.vmap(run)(starts, keys)


@eqx.filter_jit
def _sync(energy, starts):
    """NUM_SWEEPS synchronous sweeps from each start."""
    run = lambda s0: ea.sign_descend(  # noqa: E731
        energy, s0, num_sweeps=NUM_SWEEPS, synchronous=True, return_trajectory=True
    )
    return jax.vmap(run)(starts)


def _patterns(key, num, dim=DIM):
    """Random +-1 patterns, float64, shape (num, dim)."""
    return jr.rademacher(key, (num, dim), dtype=jnp.float64)


def _half_integer_bias(key, dim=DIM):
    """A bias b with b_i in {-2.5, ..., 2.5}: W xi - b never vanishes for integer W xi."""
    return jr.randint(key, (dim,), -3, 3).astype(jnp.float64) + 0.5


def _sign_keep_ties(h, s):
    """sgn(h), keeping the current value s where h == 0 (sign_descend's tie rule)."""
    return np.where(h > 0, 1.0, np.where(h < 0, -1.0, s))


def _assert_non_increasing(energies):
    e = np.asarray(energies)
    scale = np.max(np.abs(e), axis=-1, keepdims=True)
    assert np.all(np.diff(e, axis=-1) <= 1e-12 * scale), e


# ---------------------------------------------------------------------------------------------
# 1. Hebbian weights
# ---------------------------------------------------------------------------------------------


def test_hebbian_weights_is_sum_of_outer_products(getkey):
    x = np.asarray(_patterns(getkey(), 6, 11))
    expected = np.zeros((11, 11))
    for mu in range(6):
        expected += np.outer(x[mu], x[mu])
    # with and without the diagonal (the default zeroes it), in one program
    full, zeroed = jax.jit(
        lambda x: (ea.hebbian_weights(x, zero_diagonal=False), ea.hebbian_weights(x))
    )(x)
    np.testing.assert_array_equal(np.asarray(full), expected)
    # +-1 patterns: the diagonal of the full sum is the number of patterns.
    np.testing.assert_array_equal(np.diag(np.asarray(full)), np.full(11, 6.0))

    expected_zeroed = expected.copy()
    np.fill_diagonal(expected_zeroed, 0.0)
    np.testing.assert_array_equal(np.asarray(zeroed), expected_zeroed)
    for w in (full, zeroed):
        assert w.shape == (11, 11)
        assert w.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(w), np.asarray(w).T)


def test_hebbian_weights_real_valued_patterns(getkey):
    x = jr.normal(getkey(), (4, 5), dtype=jnp.float64)
    xn = np.asarray(x)
    expected = sum(np.outer(r, r) for r in xn)
    np.testing.assert_allclose(ea.hebbian_weights(x, zero_diagonal=False), expected, rtol=1e-13)
    np.testing.assert_allclose(
        ea.hebbian_weights(x), expected - np.diag(np.diag(expected)), rtol=1e-13, atol=1e-14
    )


# ---------------------------------------------------------------------------------------------
# 2. The seed's update rule xi <- sgn(W xi - b)
# ---------------------------------------------------------------------------------------------


def test_synchronous_sweeps_are_seed_sign_rule(getkey):
    """Synchronous sweeps on the classical energy are xi <- sgn(W xi - b), iterated.

    W xi is an integer vector for +-1 patterns and states and the bias is an integer + 1/2,
    so W xi - b never vanishes and sgn is unambiguous.
    """
    x = _patterns(getkey(), 7)
    w = ea.hebbian_weights(x)
    b = _half_integer_bias(getkey())
    starts = _patterns(getkey(), NUM_STARTS)
    out = jax.device_get(_sync(ea.ClassicalHopfieldEnergy(w, b), starts))

    wn, bn = np.asarray(w), np.asarray(b)
    states = [np.asarray(starts)]
    for _ in range(NUM_SWEEPS):
        h = states[-1] @ wn - bn  # W symmetric: row k is (W xi_k - b)^T
        assert np.all(h != 0)
        states.append(np.sign(h))
    expected = np.stack(states, axis=1)  # (starts, sweeps + 1, dim)
    # One sweep ...
    np.testing.assert_array_equal(np.asarray(out.trajectory[:, 1]), expected[:, 1])
    assert np.any(expected[:, 1] != expected[:, 0])
    # ... and every further one.
    np.testing.assert_array_equal(np.asarray(out.trajectory), expected)
    np.testing.assert_array_equal(np.asarray(out.value), expected[:, -1])
    hand_energies = -0.5 * np.einsum("ktd,de,kte->kt", expected, wn, expected) + expected @ bn
    np.testing.assert_allclose(np.asarray(out.energies), hand_energies, rtol=1e-12)


def test_asynchronous_sweeps_are_sequential_seed_rule(getkey):
    """Fixed-order asynchronous sweeps apply xi_i <- sgn((W xi - b)_i) for i = 0, 1, ..., d-1,
    each unit seeing the units before it already updated."""
    w = np.asarray(ea.hebbian_weights(_patterns(getkey(), 7)))
    b = np.asarray(_half_integer_bias(getkey()))
    starts = _patterns(getkey(), NUM_STARTS)
    out = _async(ea.ClassicalHopfieldEnergy(w, b), starts, None)

    xi = np.array(starts)
    expected = [xi.copy()]
    for _ in range(NUM_SWEEPS):
        for i in range(DIM):
            xi[:, i] = np.sign(xi @ w[i] - b[i])
        expected.append(xi.copy())
    expected = np.stack(expected, axis=1)
    np.testing.assert_array_equal(np.asarray(out.trajectory), expected)
    # Sequential and synchronous updates differ after one sweep from the same states.
    sync_one = np.sign(np.asarray(starts) @ w - b)
    assert np.any(sync_one != expected[:, 1])


def test_ties_keep_current_value(getkey):
    """Ties (W xi)_i - b_i = 0 keep xi_i (the seed's sgn(0) = 0 would leave the +-1 states).

    With b = 0, two patterns and d even, (W xi)_i = x_1i (x_1 . xi) + x_2i (x_2 . xi) - 2 xi_i
    can vanish only when x_1 and x_2 differ in an odd number of bits; we make them so.
    """
    x = np.array(_patterns(getkey(), 2))
    if np.sum(x[0] != x[1]) % 2 == 0:
        x[1, 0] = -x[1, 0]
    w = ea.hebbian_weights(jnp.asarray(x))
    zero_bias = jnp.zeros(DIM)
    starts = _patterns(getkey(), NUM_STARTS)
    out = _sync(ea.ClassicalHopfieldEnergy(w, zero_bias), starts)

    wn = np.asarray(w)
    xi = np.asarray(starts)
    h = xi @ wn
    assert np.sum(h == 0) > 0, "the test must exercise ties"
    expected = [xi]
    for _ in range(NUM_SWEEPS):
        expected.append(_sign_keep_ties(expected[-1] @ wn, expected[-1]))
    np.testing.assert_array_equal(np.asarray(out.trajectory), np.stack(expected, axis=1))

    # All ties: W = 0, b = 0 leaves every state where it is, in both modes.
    zero = ea.ClassicalHopfieldEnergy(jnp.zeros((DIM, DIM)), zero_bias)
    np.testing.assert_array_equal(_sync(zero, starts).value, starts)
    np.testing.assert_array_equal(_async(zero, starts, None).value, starts)


def test_sync_two_cycle_versus_async_convergence():
    """W = [[0, 1], [1, 0]] from (1, -1): synchronous sweeps oscillate, asynchronous converge.

    (Also the one test that runs `sign_descend` eagerly, outside jit.)
    """
    w = jnp.array([[0.0, 1.0], [1.0, 0.0]])
    energy = ea.ClassicalHopfieldEnergy(w)
    s0 = jnp.array([1.0, -1.0])
    sync = ea.sign_descend(energy, s0, num_sweeps=4, synchronous=True, return_trajectory=True)
    np.testing.assert_array_equal(sync.trajectory, [[1, -1], [-1, 1], [1, -1], [-1, 1], [1, -1]])
    np.testing.assert_array_equal(sync.energies, np.ones(5))  # -xi_1 xi_2 = 1 throughout
    # In order: unit 0 sees field xi_1 = -1 -> -1; unit 1 then sees -1 -> -1.
    asyn = ea.sign_descend(energy, s0, num_sweeps=2, return_trajectory=True)
    np.testing.assert_array_equal(asyn.trajectory, [[1, -1], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(asyn.energies, [1.0, -1.0, -1.0])
    assert asyn.value.shape == (2,)
    # Zero sweeps: the initial state and its energy.
    zero = ea.sign_descend(energy, s0, num_sweeps=0, return_trajectory=True)
    np.testing.assert_array_equal(zero.value, s0)
    np.testing.assert_array_equal(zero.trajectory, s0[None])
    np.testing.assert_array_equal(zero.energies, [1.0])


def test_diagonal_does_not_change_sign_dynamics(getkey):
    """On +-1 states the diagonal of W only adds the constant -1/2 sum_i W_ii to the energy,
    so the energy-derived sign dynamics are identical with and without it (unlike the literal
    sgn(W xi - b), where W_ii xi_i is a self-coupling)."""
    x = _patterns(getkey(), 30)
    full = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(x, zero_diagonal=False))
    zeroed = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(x))
    starts = _patterns(getkey(), NUM_STARTS)
    keys = jr.split(getkey(), NUM_STARTS)
    a, b = _async(full, starts, keys), _async(zeroed, starts, keys)
    np.testing.assert_array_equal(a.trajectory, b.trajectory)
    np.testing.assert_allclose(a.energies, b.energies - 0.5 * 30 * DIM, rtol=1e-12)
    # The literal seed formula with the diagonal kept differs from it here.
    h_full = np.asarray(starts) @ np.asarray(full.weights)
    h_zero = np.asarray(starts) @ np.asarray(zeroed.weights)
    assert np.any(np.sign(h_full) != np.sign(h_zero))


def test_sign_rule_for_dense_memory_is_krotov_hopfield_update(getkey):
    """For E = -sum_mu F(x_mu . xi) the asynchronous rule is
    xi_i <- sgn(sum_mu F(x_mu,i + r_mu,i) - F(-x_mu,i + r_mu,i)), r_mu,i = sum_{j != i} x_mu,j xi_j.
    """
    x = np.asarray(_patterns(getkey(), DIM))
    starts = _patterns(getkey(), NUM_STARTS)
    energy = ea.DenseHopfieldEnergy(jax.device_put(x), ea.PolynomialSeparation(3))
    out = jax.device_get(_async(energy, starts, None))
    starts = np.asarray(starts)

    def f(z):
        return z**3

    for k in range(3):  # the first sweep of a few starts, by hand
        xi = np.array(starts[k])
        for i in range(DIM):
            rest = x @ xi - x[:, i] * xi[i]
            xi[i] = _sign_keep_ties(np.sum(f(x[:, i] + rest) - f(-x[:, i] + rest)), xi[i])
        np.testing.assert_array_equal(np.asarray(out.trajectory[k, 1]), xi)
        assert np.any(xi != np.asarray(starts[k]))


# ---------------------------------------------------------------------------------------------
# 3. Asynchronous sweeps never increase the energy (stored patterns as fixed points: see
#    `_assert_fixed_points`, used by every capacity test below)
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _case_arrays(keys, with_bias):
    """The arrays of `_energy_cases`, drawn and multiplied out in one compiled program."""
    x40 = _patterns(keys[0], 40)  # load 0.4 d: above the classical capacity, so not trivial
    x100 = _patterns(keys[1], DIM)
    x1000 = _patterns(keys[2], 10 * DIM)
    bias = (0.5 * jr.normal(keys[3], (DIM,), dtype=jnp.float64),) if with_bias else ()
    couplings = jr.normal(keys[-1], (DIM, DIM), dtype=jnp.float64)
    return ea.hebbian_weights(x40), ea.hebbian_weights(couplings), bias, x100, x1000


def _energy_cases(getkey, random_order):
    """Energies of the shared programs' types and shapes. Fixed-order runs use a classical
    energy with a bias, random-order runs one without (the shape the capacity tests use)."""
    keys = [getkey() for _ in range(4 if random_order else 5)]  # random order: no bias key
    w40, w_couplings, bias, x100, x1000 = _case_arrays(keys, not random_order)
    cases = {
        "classical": ea.ClassicalHopfieldEnergy(w40, *bias),
        "classical-random-couplings": ea.ClassicalHopfieldEnergy(w_couplings, *bias),
        "x^3": ea.DenseHopfieldEnergy(x100, ea.PolynomialSeparation(3)),
        "exp": ea.DenseHopfieldEnergy(x1000, ea.ExponentialSeparation()),
        "exp-beta-0.2": ea.DenseHopfieldEnergy(x1000, ea.ExponentialSeparation(beta=0.2)),
    }
    if random_order:
        rectified = ea.PolynomialSeparation(3, rectified=True)
        cases["max(x,0)^3"] = ea.DenseHopfieldEnergy(x100, rectified)
    return cases


@eqx.filter_jit
def _energies_and_single_flips(energy, trajectory, final):
    """The energy of every recorded state, shape (starts, sweeps + 1), and of every final state
    with one unit flipped, for each unit, shape (starts, dim)."""
    flip_all = 1 - 2 * jnp.eye(final.shape[-1])
    neighbours = jax.vmap(lambda s: jax.vmap(energy)(s[None, :] * flip_all))(final)
    return jax.vmap(jax.vmap(energy))(trajectory), neighbours


# The exponential memories' sweeps (1000 patterns) run for seconds at -O0.
@pytest.mark.usefixtures("optimised_xla")
@pytest.mark.parametrize("random_order", [False, True], ids=["fixed-order", "random-order"])
def test_async_sweeps_never_increase_energy(getkey, random_order):
    starts = _patterns(getkey(), NUM_STARTS)
    for name, energy in _energy_cases(getkey, random_order).items():
        keys = jr.split(getkey(), NUM_STARTS) if random_order else None
        out = _async(energy, starts, keys)
        recomputed, neighbours = _energies_and_single_flips(energy, out.trajectory, out.value)
        e = np.asarray(out.energies)
        assert e.shape == (NUM_STARTS, NUM_SWEEPS + 1)
        assert np.all(np.abs(np.asarray(out.trajectory)) == 1)
        # The reported energies are those of the recorded states.
        np.testing.assert_allclose(e, np.asarray(recomputed), rtol=1e-12, err_msg=name)
        _assert_non_increasing(e)
        assert np.all(e[:, -1] < e[:, 0]), (name, e)  # a random start is not already a minimum
        # Once the energy stops changing the state is a local minimum: no single flip lowers
        # the energy (brute force over all d neighbours).
        converged = e[:, -1] == e[:, -2]
        assert converged.sum() >= 5, (name, converged.sum())
        neighbours = np.asarray(neighbours)[converged]
        scale = np.abs(e[converged, -1:])
        assert np.all(neighbours >= e[converged, -1:] - 1e-12 * scale), name
        if random_order and name == "classical":
            # The key sets the order: other keys take other paths; the same keys, the same.
            other = _async(energy, starts, jr.split(getkey(), NUM_STARTS))
            assert np.any(np.asarray(other.trajectory) != np.asarray(out.trajectory)), name
            again = _async(energy, starts, keys)
            np.testing.assert_array_equal(again.trajectory, out.trajectory)


# ---------------------------------------------------------------------------------------------
# 4. Capacity: classical ~0.14 d versus dense polynomial and exponential memories
# ---------------------------------------------------------------------------------------------


@jax.jit
def _make_probes(key, patterns):
    num, dim = patterns.shape
    k_target, k_flip = jr.split(key)
    if num >= NUM_STARTS:
        index = jr.permutation(k_target, num)[:NUM_STARTS]
    else:
        index = jnp.arange(NUM_STARTS) % num
    targets = patterns[index]
    num_flips = round(FLIP_FRACTION * dim)

    def corrupt(x, k):
        where = jnp.zeros(dim, bool).at[jr.permutation(k, dim)[:num_flips]].set(True)
        return jnp.where(where, -x, x)

    return targets, jax.vmap(corrupt)(targets, jr.split(k_flip, NUM_STARTS))


def _probes(key, patterns):
    """NUM_STARTS probes, each a stored pattern with exactly FLIP_FRACTION * d bits flipped."""
    targets, probes = _make_probes(key, patterns)
    num_flips = round(FLIP_FRACTION * patterns.shape[1])
    np.testing.assert_array_equal(np.sum(probes != targets, axis=1), num_flips)
    return targets, probes


def _assert_fixed_points(energy, patterns, key):
    """Stored patterns themselves (NUM_STARTS of them) do not move, nor does their energy."""
    targets, _ = _probes(key, patterns)
    out = _async(energy, targets, jr.split(key, NUM_STARTS))
    np.testing.assert_array_equal(np.asarray(out.value), np.asarray(targets))
    e = np.asarray(out.energies)
    np.testing.assert_array_equal(e, np.broadcast_to(e[:, :1], e.shape))


def _retrieval_fraction(energy, patterns, key, label):
    """Fraction of probes that end exactly on the stored pattern they were made from, after
    NUM_SWEEPS asynchronous sweeps in a random order."""
    k_probe, k_order = jr.split(key)
    targets, probes = _probes(k_probe, patterns)
    out = _async(energy, probes, jr.split(k_order, NUM_STARTS))
    _assert_non_increasing(out.energies)  # the energy guarantee holds along the way
    exact = np.all(np.asarray(out.value) == np.asarray(targets), axis=1)
    errors = np.mean(np.sum(np.asarray(out.value) != np.asarray(targets), axis=1))
    num, dim = patterns.shape
    print(
        f"\n[capacity] {label}: d={dim}, N={num} (load {num / dim:g} d), "
        f"{round(FLIP_FRACTION * dim)} bits flipped, {NUM_SWEEPS} async sweeps: "
        f"exact retrieval {exact.mean():.3f} ({exact.sum()}/{exact.size}), "
        f"mean final Hamming distance {errors:.2f}"
    )
    return float(exact.mean())


def _classical(patterns):
    return ea.ClassicalHopfieldEnergy(ea.hebbian_weights(patterns))


def test_classical_retrieves_below_capacity_load_0p05d(getkey):
    """Classical Hopfield, N = 0.05 d = 5 (well below C ~ 0.14 d): essentially all probes."""
    x = _patterns(getkey(), 5)
    _assert_fixed_points(_classical(x), x, getkey())
    assert _retrieval_fraction(_classical(x), x, getkey(), "classical") >= 0.95


def test_classical_fails_above_capacity_load_0p4d(getkey):
    """Classical Hopfield, N = 0.4 d = 40 (well above C ~ 0.14 d): most probes fail."""
    x = _patterns(getkey(), 40)
    assert _retrieval_fraction(_classical(x), x, getkey(), "classical") <= 0.2


@pytest.mark.parametrize("rectified", [False, True], ids=["x^3", "max(x,0)^3"])
def test_dense_polynomial_retrieves_load_1d(getkey, rectified):
    """Dense memory F(x) = x^3 (or max(x, 0)^3), N = d = 100: about 7x the classical capacity
    0.14 d. The polynomial memory retrieves nearly every probe; the classical network with
    the same patterns, on the same probes, retrieves almost none.
    """
    x = _patterns(getkey(), DIM)
    key = getkey()  # the same probes and unit orders for both networks
    label = "dense x^3" + (" rectified" if rectified else "")
    dense = ea.DenseHopfieldEnergy(x, ea.PolynomialSeparation(3, rectified=rectified))
    _assert_fixed_points(dense, x, getkey())
    assert _retrieval_fraction(dense, x, key, label) >= 0.95
    assert _retrieval_fraction(_classical(x), x, key, "classical, same load") <= 0.05


# 1000 patterns: the exponential memory's sweeps run for seconds.
@pytest.mark.usefixtures("optimised_xla")
def test_dense_exponential_retrieves_load_10d(getkey):
    """Dense memory F(x) = exp(x), N = 10 d = 1000: about 70x the classical capacity (and far
    below 2^(d/2)). The exponential memory retrieves nearly every probe; the classical network
    fails on the same probes. (Overlaps reach d = 100: exp(100) ~ 3e43 is fine in float64.)
    """
    x = _patterns(getkey(), 10 * DIM)
    key = getkey()
    dense = ea.DenseHopfieldEnergy(x, ea.ExponentialSeparation())
    _assert_fixed_points(dense, x, getkey())
    assert _retrieval_fraction(dense, x, key, "dense exp") >= 0.95
    assert _retrieval_fraction(_classical(x), x, key, "classical, same load") <= 0.05


# ---------------------------------------------------------------------------------------------
# 5. Dense energies: formulas, degree 2 is classical, user separation functions
# ---------------------------------------------------------------------------------------------


def test_dense_energy_formulas(getkey):
    x = _patterns(getkey(), 7, 13)
    xi = jr.normal(getkey(), (13,), dtype=jnp.float64)
    m = np.asarray(x) @ np.asarray(xi)
    cases = [
        (ea.PolynomialSeparation(3), -np.sum(m**3)),
        (ea.PolynomialSeparation(3, rectified=True), -np.sum(np.maximum(m, 0) ** 3)),
        (ea.PolynomialSeparation(1), -np.sum(m)),
        (ea.ExponentialSeparation(), -np.sum(np.exp(m))),
        (ea.ExponentialSeparation(beta=0.5), -np.sum(np.exp(0.5 * m))),
    ]
    for separation, expected in cases:
        value = ea.dense_hopfield_energy(xi, x, separation)
        np.testing.assert_allclose(value, expected, rtol=1e-12)
        np.testing.assert_allclose(ea.DenseHopfieldEnergy(x, separation)(xi), expected, rtol=1e-12)


def test_classical_energy_formula(getkey):
    d = 9
    w = jr.normal(getkey(), (d, d), dtype=jnp.float64)
    w = w + w.T
    b = jr.normal(getkey(), (d,), dtype=jnp.float64)
    xi = jr.normal(getkey(), (d,), dtype=jnp.float64)
    wn, bn, xn = map(np.asarray, (w, b, xi))
    expected = -0.5 * sum(wn[i, j] * xn[i] * xn[j] for i in range(d) for j in range(d)) + bn @ xn
    np.testing.assert_allclose(ea.classical_hopfield_energy(xi, w, b), expected, rtol=1e-12)
    np.testing.assert_allclose(ea.ClassicalHopfieldEnergy(w, b)(xi), expected, rtol=1e-12)
    np.testing.assert_allclose(ea.ClassicalHopfieldEnergy(w)(xi), expected - bn @ xn, rtol=1e-12)


def test_degree_two_dense_memory_is_classical_hopfield(getkey):
    """-sum_mu (x_mu . xi)^2 = 2 * (-1/2 xi^T W xi) with W = sum x x^T (diagonal kept)."""
    d, n = 16, 5
    x = _patterns(getkey(), n, d)
    real_states = jr.normal(getkey(), (5, d), dtype=jnp.float64)
    spin_states = _patterns(getkey(), 5, d)

    @jax.jit
    def energies(x, real_states, spin_states):
        """Each energy on each state (state by state), and the function form on one."""
        dense = ea.DenseHopfieldEnergy(x, ea.PolynomialSeparation(2))
        full = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(x, zero_diagonal=False))
        zeroed = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(x))
        real = [(dense(xi), full(xi)) for xi in real_states]
        spin = [(dense(xi), zeroed(xi)) for xi in spin_states]
        function = ea.dense_hopfield_energy(real_states[0], x, ea.PolynomialSeparation(2))
        return real, spin, function

    real, spin, function = energies(x, real_states, spin_states)
    for dense, full in real:
        np.testing.assert_allclose(dense, 2 * full, rtol=1e-12)
    # On +-1 states the diagonal adds the constant 1/2 * N * d: the zero-diagonal energy is
    # shifted by it (so both have the same sign dynamics).
    for dense, zeroed in spin:
        np.testing.assert_allclose(dense, 2 * zeroed - n * d, rtol=1e-12)
    # Degree 2 through the function form, too.
    xi = np.asarray(real_states[0])
    np.testing.assert_allclose(function, -np.sum((np.asarray(x) @ xi) ** 2), rtol=1e-12)


def test_user_separation_function_under_jit(getkey):
    x = _patterns(getkey(), 6, 10)
    xi = jr.normal(getkey(), (10,), dtype=jnp.float64)
    m = np.asarray(x) @ np.asarray(xi)
    expected = -np.sum(np.log1p(np.exp(m)))
    expected_grad = -np.asarray(x).T @ (1 / (1 + np.exp(-m)))  # softplus' = sigmoid

    energy = ea.DenseHopfieldEnergy(x, lambda z: jnp.log1p(jnp.exp(z)))
    np.testing.assert_allclose(jax.jit(lambda s: energy(s))(xi), expected, rtol=1e-12)
    np.testing.assert_allclose(eqx.filter_jit(lambda e, s: e(s))(energy, xi), expected, rtol=1e-12)
    np.testing.assert_allclose(
        jax.jit(lambda p, s: ea.dense_hopfield_energy(s, p, jax.nn.softplus))(x, xi),
        expected,
        rtol=1e-12,
    )
    np.testing.assert_allclose(jax.jit(jax.grad(energy))(xi), expected_grad, rtol=1e-12)

    # The sign dynamics accept it too (any energy of a +-1 state).
    start = _patterns(getkey(), 1, 10)[0]
    out = eqx.filter_jit(lambda e, s: ea.sign_descend(e, s, num_sweeps=2))(energy, start)
    assert out.energies.shape == (3,)
    _assert_non_increasing(out.energies)
    np.testing.assert_allclose(out.energies[-1], energy(out.value), rtol=1e-12)


def test_exponential_separation_traced_beta(getkey):
    x = _patterns(getkey(), 4, 8)
    xi = _patterns(getkey(), 1, 8)[0]
    m = np.asarray(x) @ np.asarray(xi)

    @jax.jit
    def f(beta):
        return ea.dense_hopfield_energy(xi, x, ea.ExponentialSeparation(beta=beta))

    np.testing.assert_allclose(f(0.3), -np.sum(np.exp(0.3 * m)), rtol=1e-12)
    # d/dbeta of -sum exp(beta m) = -sum m exp(beta m)
    np.testing.assert_allclose(jax.grad(f)(0.3), -np.sum(m * np.exp(0.3 * m)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# 6. Continuous gradient descent on the discrete energies
# ---------------------------------------------------------------------------------------------


_descend = eqx.filter_jit(ea.descend)


def _check_descent(energy, x0, step_size):
    """20 steps; returns the Descent (its trajectory holds the state after the first step)."""
    out = jax.device_get(
        _descend(energy, x0, step_size=step_size, num_steps=20, return_trajectory=True)
    )
    e = np.asarray(out.energies)
    assert e.shape == (21,)
    assert np.all(np.isfinite(e))
    assert np.all(np.diff(e) <= 1e-12 * np.max(np.abs(e))), e
    assert e[-1] < e[0]
    return out


def test_descend_decreases_classical_energy(getkey):
    d = 20
    x = _patterns(getkey(), 3, d)
    w = ea.hebbian_weights(x)
    b = 0.5 * jr.normal(getkey(), (d,), dtype=jnp.float64)
    energy = ea.ClassicalHopfieldEnergy(w, b)
    x0 = jr.normal(getkey(), (d,), dtype=jnp.float64)
    out = _check_descent(energy, x0, 1e-3)
    # The first step is x0 - a * grad E = x0 + a (W x0 - b).
    np.testing.assert_allclose(
        out.trajectory[1],
        np.asarray(x0) + 1e-3 * (np.asarray(w) @ np.asarray(x0) - np.asarray(b)),
        rtol=1e-12,
    )
    assert out.value.shape == (d,)


def test_descend_decreases_dense_polynomial_energy(getkey):
    d = 16
    x = _patterns(getkey(), 8, d)
    energy = ea.DenseHopfieldEnergy(x, ea.PolynomialSeparation(3))
    x0 = jr.normal(getkey(), (d,), dtype=jnp.float64)  # overlaps of order sqrt(d)
    out = _check_descent(energy, x0, 1e-4)
    # The force is 3 X^T (X x)^2.
    m = np.asarray(x) @ np.asarray(x0)
    expected = np.asarray(x0) + 1e-4 * 3 * np.asarray(x).T @ m**2
    np.testing.assert_allclose(out.trajectory[1], expected, rtol=1e-12)


def test_descend_decreases_dense_exponential_energy(getkey):
    d = 16
    x = _patterns(getkey(), 8, d)
    energy = ea.DenseHopfieldEnergy(x, ea.ExponentialSeparation(beta=0.25))
    x0 = jr.normal(getkey(), (d,), dtype=jnp.float64)
    _check_descent(energy, x0, 1e-3)


# ---------------------------------------------------------------------------------------------
# 7. Bad input: our ValueErrors, with the offending shapes/values in the message
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("user_mode")
class TestBadInput:
    def test_polynomial_degree(self):
        with pytest.raises(ValueError, match=r"degree must be a positive integer, got 0"):
            ea.PolynomialSeparation(0)
        with pytest.raises(ValueError, match=r"degree must be a positive integer, got 2\.5"):
            ea.PolynomialSeparation(2.5)
        with pytest.raises(ValueError, match=r"degree must be a positive integer, got True"):
            ea.PolynomialSeparation(True)

    def test_exponential_beta(self):
        with pytest.raises(ValueError, match=r"beta must be > 0, got 0"):
            ea.ExponentialSeparation(beta=0)
        with pytest.raises(ValueError, match=r"beta must be > 0, got -1"):
            ea.ExponentialSeparation(beta=-1.0)
        with pytest.raises(ValueError, match=r"beta must be a scalar, got shape \(2,?\)"):
            ea.ExponentialSeparation(beta=np.ones(2))

    def test_hebbian_weights_rank(self):
        with pytest.raises(ValueError, match=r"patterns must have shape \(mem, dim\), got \(5,?\)"):
            ea.hebbian_weights(np.ones(5))
        with pytest.raises(
            ValueError, match=r"patterns must have shape \(mem, dim\), got \(2, 3, 4\)"
        ):
            ea.hebbian_weights(np.ones((2, 3, 4)))

    def test_classical_shapes(self):
        with pytest.raises(
            ValueError, match=r"weights must have shape \(dim=3, dim=3\), got \(4, 4\)"
        ):
            ea.classical_hopfield_energy(np.ones(3), np.eye(4))
        with pytest.raises(ValueError, match=r"bias must have shape \(dim=3\), got \(4,?\)"):
            ea.classical_hopfield_energy(np.ones(3), np.eye(3), np.ones(4))
        with pytest.raises(ValueError, match=r"state must have shape \(dim\), got \(1, 3\)"):
            ea.classical_hopfield_energy(np.ones((1, 3)), np.eye(3))
        with pytest.raises(
            ValueError, match=r"weights must have shape \(dim=3, dim=3\), got \(3, 4\)"
        ):
            ea.ClassicalHopfieldEnergy(np.ones((3, 4)))
        with pytest.raises(ValueError, match=r"bias must have shape \(dim=4\), got \(3,?\)"):
            ea.ClassicalHopfieldEnergy(np.eye(4), np.ones(3))
        with pytest.raises(
            ValueError, match=r"weights must have shape \(dim=3, dim=3\), got \(4, 4\)"
        ):
            ea.ClassicalHopfieldEnergy(np.eye(4))(np.ones(3))

    def test_dense_shapes_and_separation(self):
        with pytest.raises(
            ValueError, match=r"patterns must have shape \(mem, dim=3\), got \(5, 4\)"
        ):
            ea.dense_hopfield_energy(np.ones(3), np.ones((5, 4)), ea.PolynomialSeparation(3))
        with pytest.raises(
            ValueError, match=r"patterns must have shape \(mem, dim=3\), got \(5, 4\)"
        ):
            ea.DenseHopfieldEnergy(np.ones((5, 4)), ea.ExponentialSeparation())(np.ones(3))
        with pytest.raises(ValueError, match=r"separation must be callable, got str"):
            ea.DenseHopfieldEnergy(np.ones((5, 4)), "exp")
        with pytest.raises(ValueError, match=r"elementwise.*\(5,?\) to shape \(\)"):
            ea.dense_hopfield_energy(np.ones(4), np.ones((5, 4)), jnp.sum)

    def test_sign_descend_state(self):
        energy = ea.ClassicalHopfieldEnergy(np.zeros((3, 3)))
        with pytest.raises(ValueError, match=r"y0 must hold only -1 and \+1"):
            ea.sign_descend(energy, np.array([1.0, 0.5, -1.0]), num_sweeps=1)
        with pytest.raises(ValueError, match=r"y0 must hold only -1 and \+1"):
            ea.sign_descend(energy, np.array([1.0, 0.0, -1.0]), num_sweeps=1)
        with pytest.raises(ValueError, match=r"y0 must have shape \(dim\), got \(1, 3\)"):
            ea.sign_descend(energy, np.ones((1, 3)), num_sweeps=1)

    def test_sign_descend_state_traced(self):
        """Under jit the +-1 check can only run with the values: a runtime error."""
        energy = ea.ClassicalHopfieldEnergy(np.zeros((3, 3)))
        run = jax.jit(lambda s: ea.sign_descend(energy, s, num_sweeps=1).value)
        np.testing.assert_array_equal(run(np.array([1.0, -1.0, 1.0])), [1.0, -1.0, 1.0])
        with pytest.raises(Exception, match=r"y0 must hold only -1 and \+1"):
            jax.block_until_ready(run(np.array([1.0, 0.5, -1.0])))

    def test_sign_descend_options(self, getkey):
        energy = ea.ClassicalHopfieldEnergy(np.zeros((3, 3)))
        s0 = np.ones(3)
        with pytest.raises(ValueError, match=r"num_sweeps must be a non-negative integer, got -1"):
            ea.sign_descend(energy, s0, num_sweeps=-1)
        with pytest.raises(
            ValueError, match=r"num_sweeps must be a non-negative integer, got 2\.0"
        ):
            ea.sign_descend(energy, s0, num_sweeps=2.0)
        with pytest.raises(ValueError, match=r"key sets the unit order of asynchronous sweeps"):
            ea.sign_descend(energy, s0, num_sweeps=1, synchronous=True, key=getkey())
        with pytest.raises(
            ValueError, match=r"energy must return a scalar \(a 0-d array\), got \(3,?\)"
        ):
            ea.sign_descend(lambda s, args: s, s0, num_sweeps=1)
        with pytest.raises(ValueError, match=r"energy must be callable, got int"):
            ea.sign_descend(3, s0, num_sweeps=1)


def test_polynomial_degree_accepts_numpy_integers():
    """Degrees computed with NumPy (e.g. `np.int64(3)`) are accepted as Python ints."""
    separation = ea.PolynomialSeparation(np.int64(3))
    assert separation.degree == 3 and type(separation.degree) is int
    np.testing.assert_allclose(separation(jnp.array([2.0, -1.0])), [8.0, -1.0])
