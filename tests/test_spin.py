"""`ea.spin`: the AFEM vector-spin model (phi, saddle point, log Z, magnetizations).

Reference numbers come from the public reference implementation (github.com/mcbal/afem, see
`tests/fixtures/README` in the shared fixtures): `afem_vector_*` (one t per spin) and
`afem_scalar_*` (one shared t), N = 8 spins, D = 16, batch 2, beta = 1.
"""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea

sp = ea.spin
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def load(name):
    return dict(np.load(FIXTURES / f"afem_{name}_N8_D16_b1.npz"))


def rel(actual, expected):
    """Largest error relative to the largest entry of `expected`."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def problem(seed=0, n=5, d=4, coupling=1.0):
    """A small random system (NumPy, so that making it compiles nothing)."""
    rng = np.random.default_rng(seed)
    raw = coupling * rng.standard_normal((n, n)) / np.sqrt(n * d)
    J = 0.5 * (raw + raw.T) * (1 - np.eye(n))
    return J, rng.standard_normal((n, d)) / np.sqrt(d)


def normal(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


def symmetric(x):
    return 0.5 * (x + x.T) * (1 - np.eye(len(x)))


# Compiled programs shared by the tests (shapes are all tiny). `beta` and `t0` always enter as
# float64 arrays, so that their values are traced, not baked into new programs.
@eqx.filter_jit
def _solve(J, H, beta, t0, kwargs):
    return sp.saddle_point(J, H, beta=beta, t0=t0, **kwargs)


def solve(J, H, beta, t0=None, **kwargs):
    t0 = None if t0 is None else np.asarray(t0, np.float64)
    return _solve(J, H, np.asarray(beta, np.float64), t0, kwargs)


magnetizations = eqx.filter_jit(sp.magnetizations)


@eqx.filter_jit
def fixture_quantities(h, J_raw, beta, mode):
    """Values and exact gradients of the reference's two losses, in one compiled program."""

    def per_example(J, H, beta):
        m, sol = sp.magnetizations(J, H, beta=beta, mode=mode, return_solution=True)
        return m, sol

    def loss_msq(h, J_raw, beta):
        J = sp.symmetric_couplings(J_raw)
        m, sol = jax.vmap(per_example, in_axes=(None, 0, None))(J, h, beta)
        return jnp.sum(m**2), (m, sol)

    def loss_afe(h, J_raw, beta):
        J = sp.symmetric_couplings(J_raw)
        afe = jax.vmap(lambda H: sp.free_energy(J, H, beta=beta, mode=mode))(h)
        return jnp.sum(afe), afe

    (msq, (m, sol)), grads_msq = jax.value_and_grad(loss_msq, (0, 1, 2), has_aux=True)(
        h, J_raw, beta
    )
    (total_afe, afe), grads_afe = jax.value_and_grad(loss_afe, (0, 1, 2), has_aux=True)(
        h, J_raw, beta
    )
    J = sp.symmetric_couplings(J_raw)
    return dict(
        J=J,
        t=sol.value,
        steps=sol.num_steps,
        phi=jax.vmap(lambda t, H: sp.phi(t, J, H, beta=beta, mode=mode))(sol.value, h),
        phi_stat=sol.stats["value"],
        hess=jax.vmap(lambda t, H: sp.phi_hessian(t, J, H, beta=beta, mode=mode))(sol.value, h),
        m=m,
        afe=afe,  # free_energy = -log_partition / beta
        msq=msq,
        total_afe=total_afe,
        grads_msq=grads_msq,
        grads_afe=grads_afe,
    )


# --------------------------------------------------------------------------------------------
# The reference fixtures


@pytest.mark.parametrize("mode", ["vector", "scalar"])
def test_fixtures(mode):
    """t*, phi(t*), log Z, free energy, magnetizations (1e-9) and the total derivatives
    (through t*(h, J, beta)) of both reference losses (1e-7)."""
    f = load(mode)
    out = fixture_quantities(f["h"], f["J_raw"], jnp.asarray(f["beta"]), mode)
    assert rel(out["t"], f["t_star"][:, 0] if mode == "scalar" else f["t_star"]) < 1e-9
    assert rel(out["phi"], f["phi_star"][:, 0]) < 1e-9
    assert rel(out["phi_stat"], f["phi_star"][:, 0]) < 1e-9
    assert rel(out["afe"], f["afe"][:, 0]) < 1e-9
    assert rel(-np.asarray(out["afe"]) * f["beta"], f["log_Z"][:, 0]) < 1e-9
    assert rel(out["m"], f["magnetizations"]) < 1e-9
    exact = f["hess_phi_at_t_star_exact"]
    assert rel(out["hess"], exact[:, 0, 0] if mode == "scalar" else exact) < 1e-9
    if mode == "vector":
        # The reference's analytic vector-mode Hessian is a diagonal approximation; ours is not.
        assert rel(out["hess"], f["hess_phi_at_t_star_reference"]) > 1e-3
    assert np.all(np.asarray(out["steps"]) <= 8)
    # The fixture also fixes J_eff = symmetrise(J_raw) with zero diagonal.
    np.testing.assert_array_equal(out["J"], f["J_eff"])
    suffix = "_autograd" if mode == "vector" else ""  # exact IFT gradients (fixtures README)
    assert rel(out["msq"], f[f"loss_msq{suffix}"]) < 1e-9
    assert rel(out["total_afe"], f[f"loss_afe{suffix}"]) < 1e-9
    for i, name in enumerate(["h", "J_raw", "beta"]):
        assert rel(out["grads_msq"][i], f[f"grad_msq_{name}{suffix}"]) < 1e-7, name
        assert rel(out["grads_afe"][i], f[f"grad_afe_{name}{suffix}"]) < 1e-7, name


# --------------------------------------------------------------------------------------------
# phi, its analytic gradient and exact Hessian


@eqx.filter_jit
def derivatives(t, J, H, beta, mode):
    analytic = (
        sp.phi_grad(t, J, H, beta=beta, mode=mode),
        sp.phi_hessian(t, J, H, beta=beta, mode=mode),
    )
    autodiff = (
        jax.grad(sp.phi)(t, J, H, beta=beta, mode=mode),
        jax.hessian(sp.phi)(t, J, H, beta=beta, mode=mode),
    )
    return analytic, autodiff


@pytest.mark.parametrize("mode", ["vector", "scalar"])
def test_analytic_derivatives_equal_autodiff(mode):
    J, H = problem()
    t_star = solve(J, H, 0.7, **({"mode": mode} if mode == "scalar" else {})).value
    t = t_star * (np.linspace(1.05, 1.3, 5) if mode == "vector" else 1.2)  # not stationary
    (g, h), (g_ad, h_ad) = derivatives(t, J, H, np.asarray(0.7), mode)
    assert g.shape == t.shape and h.shape == t.shape * 2
    assert rel(g, g_ad) < 1e-12 and rel(h, h_ad) < 1e-12
    assert np.all(np.linalg.eigvalsh(np.atleast_2d(h)) > 0)  # strictly convex on the domain


def test_large_systems_use_the_blocked_inverse():
    """N > 128 takes the blocked triangular inverse: gradient and Hessian still exact."""
    J, H = problem(3, n=131, d=3)
    t = 1.5 + np.linspace(0, 1, 131)
    g, h = jax.jit(
        lambda t, J, H: (sp.phi_grad(t, J, H, beta=0.8), sp.phi_hessian(t, J, H, beta=0.8))
    )(t, J, H)
    A = np.linalg.inv(np.diag(t) - J)
    X = A @ H
    assert rel(g, 0.8 - 0.5 * np.diagonal(A) - 0.2 * np.sum(X**2, -1)) < 1e-12
    assert rel(h, A * (0.5 * A + 0.4 * X @ X.T)) < 1e-12


@jax.jit
def phi_checks(t, J, H, beta):
    skew = jnp.triu(jnp.ones_like(J), 1)
    energy = sp.PhiEnergy(J, H, beta=beta)
    return dict(
        phi=sp.phi(t, J, H, beta=beta),
        scalar=sp.phi(t[0], J, H, beta=beta, mode="scalar"),
        broadcast=sp.phi(jnp.full_like(t, t[0]), J, H, beta=beta),
        energy=energy(t),
        energy_grad=jax.grad(2.0 * energy)(t),
        grad=sp.phi_grad(t, J, H, beta=beta),
        skew=sp.phi(t, J + 0.1 * (skew - skew.T), H, beta=beta),
        outside=sp.phi(jnp.zeros_like(t), J, H, beta=beta),
        nan=sp.phi(jnp.full_like(t, jnp.nan), J, H, beta=beta),
    )


def test_saddle_point_above_newtons_dense_limit():
    """Above 512 unknowns Newton's `jacobian="auto"` takes matrix-free steps, which keep no
    Hessian products; the saddle point reads log Z off them, so it solves dense at every size
    (at N = 1024 it raised AttributeError in `_attach` before)."""
    J, H = problem(2, n=520, d=2)
    solution = sp.saddle_point(J, H, beta=1.0)
    assert solution.result == ea.RESULTS.successful
    assert np.max(np.abs(sp.phi_grad(solution.value, J, H, beta=1.0))) < 1e-9  # stationary
    with pytest.raises(ValueError, match=r"dense Hessian.*'auto'.*520 unknowns"):
        sp.saddle_point(J, H, beta=1.0, solver=ea.Newton())


def test_phi_formula_modes_and_domain():
    J, H = problem()
    t = np.linspace(1.1, 1.6, 5)
    V = np.diag(np.asarray(t)) - np.asarray(J)
    expected = (
        0.7 * np.sum(t)
        - 0.5 * np.linalg.slogdet(V)[1]
        + 0.7 / 4 * np.trace(np.asarray(H).T @ np.linalg.solve(V, H))
    )
    out = phi_checks(t, J, H, np.asarray(0.7))
    assert abs(out["phi"] - expected) < 1e-12 * abs(expected)
    # Scalar mode is vector mode on t * ones; the module form is the function.
    assert out["scalar"] == out["broadcast"] and out["energy"] == out["phi"]
    np.testing.assert_allclose(out["energy_grad"], 2 * out["grad"], rtol=1e-12)
    # Only the symmetric part of J enters: an antisymmetric part changes nothing.
    assert abs(out["skew"] - out["phi"]) < 1e-14 * abs(out["phi"])
    # Outside the domain phi is +inf (V = -J is indefinite: J is traceless); NaN stays NaN.
    assert out["outside"] == jnp.inf and np.isnan(out["nan"])
    with pytest.raises(eqx.EquinoxRuntimeError, match="not positive definite"):
        eqx.filter_jit(sp.phi_grad)(np.zeros(5), J, H, beta=np.asarray(1.0))
    # bfloat16 inputs work (computed in float32).
    bf16 = eqx.filter_jit(sp.phi)(
        jnp.full(5, 2, jnp.bfloat16), J.astype(jnp.bfloat16), H.astype(jnp.bfloat16), beta=1.0
    )
    assert bf16.dtype == jnp.float32 and np.isfinite(bf16)


# --------------------------------------------------------------------------------------------
# The saddle point


def test_saddle_point_is_stationary_and_warm_start():
    J, H = problem()
    sol = solve(J, H, 1.3)
    assert sol.result == ea.RESULTS.successful and sol.converged
    assert rel(sol.stats["value"], phi_checks(sol.value, J, H, np.asarray(1.3))["phi"]) < 1e-15
    # |g| <= decrement * sqrt(largest Hessian eigenvalue): ~1e-12 at the default tolerance.
    assert np.max(np.abs(phi_checks(sol.value, J, H, np.asarray(1.3))["grad"])) < 1e-11
    assert sol.residual < 1e-10 and 2 <= sol.num_steps <= 8
    # A warm start at t* needs no step; a nearby one fewer than a cold start.
    warm = solve(J, H, 1.3, sol.value)
    assert warm.num_steps == 0 and rel(warm.value, sol.value) == 0
    near = solve(J, H, 1.3, sol.value * 1.01)
    # (t* agrees to the stopping tolerance: a decrement below ~1e-11 leaves t within ~1e-12.)
    assert 1 <= near.num_steps < sol.num_steps and rel(near.value, sol.value) < 1e-12
    # A far, feasible warm start needs damping (backtracking) and still converges.
    far = solve(J, H, 1.3, np.full(5, 50.0))
    assert far.converged and far.stats["backtracks"] > 0 and rel(far.value, sol.value) < 1e-12


def test_default_start_is_feasible_for_strong_couplings():
    """The uncoupled start is infeasible here; the default start backs off towards the
    Gershgorin point, where V is positive definite whatever J is."""
    J, H = problem(coupling=40.0)
    free = (1 + np.sqrt(1 + 4 * np.sum(np.asarray(H) ** 2, -1))) / 4
    assert np.linalg.eigvalsh(np.diag(free) - np.asarray(J))[0] < 0
    sol = solve(J, H, 1.0)
    assert sol.converged
    assert np.max(np.abs(phi_checks(sol.value, J, H, np.asarray(1.0))["grad"])) < 1e-12
    assert np.linalg.eigvalsh(np.diag(np.asarray(sol.value)) - np.asarray(J))[0] > 0
    scalar = solve(J, H, 1.0, mode="scalar")
    assert scalar.converged
    assert abs(phi_checks(scalar.value * np.ones(5), J, H, np.asarray(1.0))["grad"].sum()) < 1e-12


def test_vmapped_solves_stop_per_example():
    """Each example takes its own number of steps, the same as alone, whatever its batch."""
    J, H = problem()
    starts = np.array([50.0, 3.0, 1.2, 8.0])[:, None] * np.ones(5)
    betas = np.array([1.0, 0.5, 2.0, 1.0])
    batched = jax.jit(jax.vmap(lambda t0, b: sp.saddle_point(J, H, beta=b, t0=t0)))
    together = batched(starts, betas)
    alone = [solve(J, H, betas[i], starts[i]) for i in range(4)]
    steps = [int(s.num_steps) for s in alone]
    assert len(set(steps)) > 1  # the examples really differ
    np.testing.assert_array_equal(together.num_steps, steps)
    assert np.all(together.converged)
    for i in range(4):
        np.testing.assert_allclose(together.value[i], alone[i].value, rtol=1e-14)
    # Other companions, same example 0.
    other = batched(starts[[0, 2, 2, 2]], betas[[0, 2, 2, 2]])
    np.testing.assert_allclose(other.value[0], together.value[0], rtol=1e-14)
    assert other.num_steps[0] == together.num_steps[0]


# --------------------------------------------------------------------------------------------
# Implicit differentiation


def unrolled_saddle(J, H, beta, num_steps=10):
    """Plain Newton from the uncoupled start, differentiated through its iterations."""
    J = 0.5 * (J + J.T)  # as ea.spin does: only the symmetric part of J enters
    t = (1 + jnp.sqrt(1 + 4 * beta**2 * jnp.sum(H**2, -1))) / (4 * beta)

    def step(_, t):
        A = jnp.linalg.inv(jnp.diag(t) - J)
        X = A @ H
        grad = beta - 0.5 * jnp.diagonal(A) - 0.25 * beta * jnp.sum(X**2, -1)
        return t - jnp.linalg.solve(A * (0.5 * A + 0.5 * beta * X @ X.T), grad)

    return jax.lax.fori_loop(0, num_steps, step, t)


def implicit_saddle(J, H, beta):
    return sp.saddle_point(J, H, beta=beta).value


@jax.jit
def first_order(J, H, beta, direction, cotangent):
    """Forward (jvp) and reverse (its transpose) derivatives of t*, implicit and unrolled."""
    t, linear = jax.linearize(implicit_saddle, J, H, beta)
    forward = linear(*direction)
    reverse = jax.linear_transpose(linear, J, H, beta)(cotangent)
    unrolled_value, unrolled_vjp = jax.vjp(unrolled_saddle, J, H, beta)
    return t, forward, reverse, unrolled_value, unrolled_vjp(cotangent)


def test_implicit_equals_unrolled_and_finite_differences():
    J, H = problem()
    beta = np.asarray(1.3)
    direction = (symmetric(normal(1, 5, 5)), normal(2, 5, 4), np.asarray(0.7))
    cotangent = normal(3, 5)
    t, forward, reverse, unrolled_value, unrolled = first_order(J, H, beta, direction, cotangent)
    assert rel(unrolled_value, t) < 1e-13
    for r, u in zip(reverse, unrolled, strict=True):
        assert rel(r, u) < 1e-10
    # Forward and reverse mode agree: <w, J v> = <J^T w, v>.
    pairing = sum(np.vdot(r, v) for r, v in zip(reverse, direction, strict=True))
    assert abs(np.vdot(cotangent, forward) - pairing) < 1e-12 * abs(pairing)
    # Central differences along the direction.
    eps = 1e-5

    def t_at(s):
        return solve(*(x + s * v for x, v in zip((J, H, beta), direction, strict=True))).value

    assert rel(forward, (t_at(eps) - t_at(-eps)) / (2 * eps)) < 1e-8


@jax.jit
def second_order(J, H, beta, direction):
    """Derivatives of the magnetizations, which are themselves a gradient (of log Z): forward
    over reverse (jvp) and reverse over reverse (its transpose: the gradient of sum(sin m))."""
    m, linear = jax.linearize(lambda J, H, b: sp.magnetizations(J, H, beta=b), J, H, beta)
    grads = jax.linear_transpose(linear, J, H, beta)(jnp.cos(m))
    return jnp.sum(jnp.sin(m)), grads, m, linear(*direction)


def test_grad_of_grad_forward_over_reverse():
    """Checked against central differences here (and the fixtures' grad_msq, computed by an
    independent implementation, in test_fixture_gradients)."""
    J, H = problem()
    beta = np.asarray(1.3)
    direction = (symmetric(normal(1, 5, 5)), normal(2, 5, 4), np.asarray(0.7))
    loss, grads, m, dm = second_order(J, H, beta, direction)
    eps = 1e-5
    plus, minus = (
        [x + s * v for x, v in zip((J, H, beta), direction, strict=True)] for s in (eps, -eps)
    )
    m_plus, m_minus = (magnetizations(J, H, beta=beta) for J, H, beta in (plus, minus))
    assert rel(dm, (m_plus - m_minus) / (2 * eps)) < 1e-8
    assert rel(loss, np.sum(np.sin(m))) < 1e-14
    pairing = sum(np.vdot(g, v) for g, v in zip(grads, direction, strict=True))
    fd = (np.sum(np.sin(m_plus)) - np.sum(np.sin(m_minus))) / (2 * eps)
    assert abs(pairing - fd) < 1e-8 * abs(pairing)
    # Reverse-over-reverse and forward-over-reverse agree exactly: <cos m, dm> = <grad, v>.
    assert abs(np.vdot(np.cos(m), dm) - pairing) < 1e-12 * abs(pairing)


# --------------------------------------------------------------------------------------------
# Magnetizations


def test_magnetizations_closed_form_and_neumann_series():
    J, H = problem()
    m, sol = magnetizations(J, H, beta=np.asarray(0.9)), solve(J, H, 0.9)
    t = np.asarray(sol.value)
    V = np.diag(t) - np.asarray(J)
    assert rel(m, 0.45 * np.linalg.solve(V, H)) < 1e-12
    # Neumann series: term 0 is the residual-like (beta/2) h_i / t_i, the sum converges to m
    # at the rate of the spectral radius of T^-1 J.
    terms = np.asarray(
        jax.jit(sp.neumann_series, static_argnames="num_terms")(t, J, H, beta=0.9, num_terms=40)
    )
    assert terms.shape == (40, 5, 4)
    np.testing.assert_allclose(terms[0], 0.45 * np.asarray(H) / t[:, None], rtol=1e-15)
    rho = np.max(np.abs(np.linalg.eigvals(np.asarray(J) / t[:, None])))
    assert 0.05 < rho < 1
    errors = [rel(np.sum(terms[:k], 0), m) for k in (1, 10, 40)]
    assert errors[0] > 1e-2  # the couplings matter: the residual term alone is not m
    assert errors[1] < 10 * rho**10 and errors[2] < 1e-12


@jax.jit
def input_dependent(H, W_q, W_k):
    def couplings(H, W_q=W_q):
        return sp.input_couplings(H, W_q, W_k)

    m, sol = sp.magnetizations(couplings, H, beta=1.0, return_solution=True)
    # Envelope: at t*, the total derivative equals the partial one at fixed t.
    t_fixed = jax.lax.stop_gradient(sol.value)
    partial = jax.grad(lambda H: sp.phi(t_fixed, couplings(H), H, beta=1.0))(H)
    log_z = -0.5 * H.shape[0] * (1 + np.log(2.0)) + sol.stats["value"]  # log Z at beta = 1
    return m, sol, couplings(H), partial, log_z


def test_input_dependent_couplings():
    """With J(H), the magnetizations include dJ/dH terms; still = d log Z/dH (envelope)."""
    n, d = 5, 4
    H, W_q, W_k = normal(1, n, d) / np.sqrt(d), normal(2, d, d), normal(3, d, d)
    m, sol, J, partial, _ = input_dependent(H, W_q, W_k)
    q, k = np.asarray(H) @ np.asarray(W_q).T, np.asarray(H) @ np.asarray(W_k).T
    raw = np.tanh(np.sqrt(d) * q @ k.T) / np.sqrt(n * d)
    np.testing.assert_allclose(J, 0.5 * (raw + raw.T) * (1 - np.eye(n)), rtol=1e-12)
    assert np.all(np.diagonal(J) == 0) and np.allclose(J, J.T, rtol=0, atol=1e-16)
    fixed_j = 0.5 * np.linalg.solve(np.diag(np.asarray(sol.value)) - np.asarray(J), H)
    assert rel(m, fixed_j) > 1e-3  # the dJ/dH contribution is really there
    assert rel(m, partial) < 1e-12
    # Central differences of log Z along a direction of H. (Training W_q through these
    # magnetizations, a second derivative, is checked in test_spin_nn.)
    eps, dH = 1e-6, normal(4, n, d)
    fd = input_dependent(H + eps * dH, W_q, W_k)[4] - input_dependent(H - eps * dH, W_q, W_k)[4]
    assert abs(np.vdot(m, dH) - fd / (2 * eps)) < 1e-8 * abs(np.vdot(m, dH))


# --------------------------------------------------------------------------------------------
# Loud failures: a clear error with throw=True, a result code with throw=False

# One compiled program for every result-code check: one Newton step at most, no halving (the
# failures below happen at the start or at the first step).
NO_THROW = dict(max_steps=1, solver=ea.Newton(max_backtracks=0), throw=False)


def test_infeasible_start():
    J, H = problem()
    bad = np.zeros(5)  # V = -J is indefinite
    sol = solve(J, H, 1.0, bad, **NO_THROW)
    assert sol.result == ea.RESULTS.infeasible and sol.num_steps == 0 and not sol.converged
    with pytest.raises(eqx.EquinoxRuntimeError, match="not positive definite at the given t0"):
        solve(J, H, 1.0, bad)
    # A feasible start whose full Newton step leaves the domain, with backtracking disabled.
    far = solve(J, H, 1.0, np.full(5, 50.0), **NO_THROW)
    assert far.result == ea.RESULTS.infeasible and far.num_steps == 0 and far.residual < np.inf


def test_nonconvergence():
    J, H = problem()
    t0 = 1.3 * solve(J, H, 1.0).value  # the first, undamped step stays feasible from here
    sol = solve(J, H, 1.0, t0, **NO_THROW)
    assert sol.result == ea.RESULTS.max_steps_reached and sol.num_steps == 1
    assert sol.residual > 1e-6 and np.all(np.isfinite(sol.value))
    with pytest.raises(eqx.EquinoxRuntimeError, match="did not converge within `max_steps`"):
        eqx.filter_jit(lambda J, H: sp.log_partition(J, H, beta=1.0, max_steps=1))(J, H)


def test_nonfinite_inputs():
    J, H = problem()
    t0, t0_nan, J_inf, H_nan = np.full(5, 1.5), np.full(5, 1.5), J.copy(), H.copy()
    t0_nan[0], J_inf[0, 1], H_nan[1, 2] = np.nan, np.inf, np.nan
    assert solve(J, H_nan, 1.0, t0, **NO_THROW).result == ea.RESULTS.nonfinite
    assert solve(J, H, 1.0, t0_nan, **NO_THROW).result == ea.RESULTS.nonfinite
    with pytest.raises(eqx.EquinoxRuntimeError, match="beta must be finite"):
        solve(J, H, np.inf, t0, **NO_THROW)  # a bad argument, not a solver result
    with pytest.raises(eqx.EquinoxRuntimeError, match="H contains NaN or inf"):
        solve(J, H_nan, 1.0, t0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="J contains NaN or inf"):
        solve(J_inf, H, 1.0, t0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="t0 contains NaN or inf"):
        solve(J, H, 1.0, t0_nan)
    with pytest.raises(eqx.EquinoxRuntimeError, match="H contains NaN or inf"):
        magnetizations(J, H_nan, beta=np.asarray(1.0))


def test_bad_beta_and_shapes(user_mode):
    J, H = problem()
    for beta in [0.0, -1.0]:
        with pytest.raises(ValueError, match="beta must be > 0"):
            sp.saddle_point(J, H, beta=beta)
        with pytest.raises(ValueError, match="beta must be > 0"):
            sp.magnetizations(J, H, beta=beta)
    with pytest.raises(eqx.EquinoxRuntimeError, match="beta must be > 0"):  # traced beta
        solve(J, H, -1.0, np.full(5, 1.5))
    with pytest.raises(ValueError, match=r"J and H disagree.*J has shape \(4, 4\).*\(5, 4\)"):
        sp.phi(np.ones(5), J[:4, :4], H, beta=1.0)
    with pytest.raises(ValueError, match=r"t must have shape \(spins=5\), got \(4,\)"):
        sp.phi(np.ones(4), J, H, beta=1.0)
    with pytest.raises(ValueError, match=r"t must have shape \(\) in scalar mode"):
        sp.phi(np.ones(5), J, H, beta=1.0, mode="scalar")
    with pytest.raises(ValueError, match=r"t0 must have shape \(spins=5\), got \(\)"):
        sp.saddle_point(J, H, beta=1.0, t0=1.0)
    with pytest.raises(ValueError, match="mode must be 'vector'"):
        sp.saddle_point(J, H, beta=1.0, mode="matrix")
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        sp.saddle_point(J, H, beta=1.0, max_steps=2.5)
    with pytest.raises(ValueError, match="solver must be ea.Newton"):
        sp.saddle_point(J, H, beta=1.0, solver=ea.Anderson())
    with pytest.raises(ValueError, match="rtol must be >= 0"):
        sp.saddle_point(J, H, beta=1.0, solver=ea.Newton(rtol=-1.0))
    with pytest.raises(ValueError, match=r"needs Newton's dense Hessian.*'matrix-free'"):
        sp.saddle_point(J, H, beta=1.0, solver=ea.Newton(jacobian="matrix-free"))


def test_public_names_are_documented():
    """Every public function of `ea.spin` (AFEM's) and `ea.spin.smt` has its equation, its
    arguments and its source, and lives in the module that holds its family."""
    for module in (sp, sp.smt):
        for name in getattr(module, "__all__", [n for n in dir(module) if n[0] != "_"]):
            obj = getattr(module, name)
            if callable(obj) and getattr(obj, "__module__", "").startswith("energyattn"):
                doc = obj.__doc__ or ""
                assert "$$" in doc and "**Arguments:**" in doc and "??? cite" in doc, name
                assert obj.__module__ in ("energyattn.spin.afem", "energyattn.spin.smt"), name


@jax.jit
def float32_batch(J, H):
    solution = jax.vmap(lambda J, H: sp.saddle_point(J, H, beta=1.0))(J, H)
    return solution.value, solution.num_steps, solution.result == ea.RESULTS.successful


def test_float32_converges_with_default_tolerance():
    """float32 inputs stay float32 and converge with the default tolerance: the Newton step
    left at the returned t*, computed in float64, is below eps32 ** 0.75 relative to t."""
    n, d, batch = 32, 16, 8
    problems = [problem(seed, n, d) for seed in range(batch)]
    J = np.stack([p[0] for p in problems]).astype(np.float32)
    H = np.stack([p[1] for p in problems]).astype(np.float32)
    t, steps, ok = float32_batch(J, H)
    assert t.dtype == jnp.float32 and np.all(ok) and np.all(np.asarray(steps) <= 10)
    tol = np.finfo(np.float32).eps ** 0.75  # the default stopping tolerance
    for b in range(batch):
        t64, J64, H64 = (np.asarray(a, np.float64) for a in (t[b], J[b], H[b]))
        A = np.linalg.inv(np.diag(t64) - J64)
        X = A @ H64
        grad = 1.0 - 0.5 * np.diagonal(A) - 0.25 * np.sum(X**2, -1)
        step = np.linalg.solve(A * (0.5 * A + 0.5 * X @ X.T), grad)
        assert np.sqrt(np.mean(step**2)) < 1.5 * tol * np.sqrt(np.mean(t64**2))
        assert np.max(np.abs(grad)) < 5e-5  # measured in float64


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_start_at_the_wall_of_the_domain_still_reaches_the_saddle(dtype):
    """Started where V = diag(t0) - J has its smallest eigenvalue at 1e-3, phi is far above
    its saddle value and Newton's first steps are tiny but growing (the barrier pushes it
    out). They are not round-off: the solve must go on to t*, not stop
    there and call it converged (float32 had stopped after one step).
    The default start of the docs' 4-spin example at beta = 1.4 is 0.012 from the wall."""
    J, H = problem(seed=0)
    t_star = np.asarray(solve(J, H, 1.0).value)
    wall = np.linalg.eigvalsh(J)[-1] + 1e-3  # V = (wall) I - J: smallest eigenvalue 1e-3
    J, H = J.astype(dtype), H.astype(dtype)
    sol = eqx.filter_jit(sp.saddle_point)(J, H, beta=dtype(1.0), t0=np.full(5, wall, dtype))
    assert sol.value.dtype == dtype and sol.result == ea.RESULTS.successful
    assert sol.num_steps > 5  # it had to walk away from the wall
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(sol.value, t_star, rtol=tol)
