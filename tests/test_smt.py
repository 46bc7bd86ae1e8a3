"""Spin-model transformers: the TAP mean-field functions, the steady state against the
reference fixture, implicit derivatives (first and second order), the attention layer."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn._linalg import product

smt = ea.spin.smt
FIXTURE = Path(__file__).parent / "fixtures" / "smt_tap_fp_N8_D16.npz"
TIGHT = ea.Anderson(rtol=0.0, atol=1e-13, history=5)
# The derivatives' linear solves as tight as the solve: the default (GMRES to eps ** 0.6,
# 4e-10 of the residual in float64) leaves errors of that order, which the 1e-10 comparison
# with unrolled iteration below would read as a difference between the two.
TIGHT_ADJOINT = ea.ImplicitAdjoint(linear_solver=ea.GMRES(rtol=1e-13, atol=1e-13))
# A point and the two points of a central difference around it (at +- h along a direction):
# one vmapped solve gives the derivative at the first and the values at the other two.
AT_AND_AROUND = np.array([0.0, 1.0, -1.0])


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files if k != "meta_json"}


def system(seed, n=5, d=6):
    """A small random system in the reference's regime: inputs of norm R, softmax couplings."""
    kx, kq, kk = jr.split(jr.key(seed), 3)
    R = np.sqrt(d / 2 - 1)
    x = jr.normal(kx, (n, d))
    x = R * x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    J = jax.nn.softmax(jr.normal(kq, (n, n)) + 0.5 * jr.normal(kk, (n, n)), axis=-1)
    return x, J, R


@jax.jit
def _row_functions(theta, beta, R):
    """phi, phi_inverse of phi, gamma of that, and gamma: one program for every (beta, R)."""
    m = smt.magnetization(theta, beta=beta, R=R)
    inverse = smt.inverse_magnetization(m, beta=beta, R=R)
    return m, inverse, smt.gamma(inverse, beta=beta, R=R), smt.gamma(theta, beta=beta, R=R)


def test_row_functions():
    """phi maps any field inside the sphere, phi_inverse undoes it, gamma of phi_inverse has
    its closed form."""
    theta = 3.0 * np.asarray(jr.normal(jr.key(0), (7, 5)))
    for beta, R in [(1.0, 1.5), (2.5, 0.7)]:
        m, inverse, g, gamma = _row_functions(theta, beta, R)
        assert np.all(np.linalg.norm(m, axis=-1) < R)
        np.testing.assert_allclose(inverse, theta, rtol=1e-12)
        m2 = np.sum(np.asarray(m) ** 2, -1)
        np.testing.assert_allclose(g, (R**2 + m2) / (R**2 - m2), rtol=1e-12)
        np.testing.assert_allclose(
            gamma, np.sqrt(1 + beta**2 * np.sum(theta**2, -1) / R**2), rtol=1e-14
        )


@jax.jit
def _products_every_way(a, b, ta, tb, w):
    """Value, gradients, a JVP, a Hessian-vector product (forward over reverse), a batch and
    a linear transpose of a loss through `matmul`, for the package's product and for `@`."""

    def every_way(matmul):
        loss = lambda a, b: jnp.sum(jnp.sin(matmul(a, b)) * w)  # noqa: E731
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(a, b)
        jvp = jax.jvp(loss, (a, b), (ta, tb))[1]
        hvp = jax.jvp(lambda a, b: jax.grad(loss, argnums=(0, 1))(a, b), (a, b), (ta, tb))[1]
        batch = jax.vmap(matmul, in_axes=(0, None))(jnp.stack([a, 2 * a]), b)
        batch_b = jax.vmap(matmul, in_axes=(None, 1), out_axes=1)(a, jnp.stack([b, -b], 1))
        (transposed,) = jax.linear_transpose(lambda b: matmul(a, b), b)(w)
        return value, grads, jvp, hvp, batch, batch_b, transposed

    return every_way(product), every_way(jnp.matmul)


def test_product_with_its_transpose_equals_matmul_every_way():
    """The TAP map's large products (`energyattn._linalg.product`, a primitive whose reverse
    mode multiplies by a transposed copy of its left operand) equal `@` in value, first and
    second derivatives in both modes, under vmap of either operand, and transposed."""
    a, b, ta, tb = (jr.normal(jr.key(i), s) for i, s in enumerate([(7, 5), (5, 3)] * 2))
    w = jr.normal(jr.key(9), (7, 3))
    ours, plain = _products_every_way(a, b, ta, tb, w)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    # Mixed dtypes promote as `@` does; each operand's cotangent keeps the operand's dtype.
    b32 = b.astype(jnp.float32)
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(product(a, b)), argnums=(0, 1)))(a, b32)
    assert product(a, b32).dtype == jnp.float64 and grads[1].dtype == jnp.float32


def test_derivatives_through_the_matrix_products_equal_the_fused_ones(monkeypatch):
    """Gradients and a JVP through the TAP map (ten Picard steps, differentiated step by step)
    are the same whether the map's products are fused (small sizes) or matrix products whose
    reverse mode reads a transposed copy (large sizes; forced here at a small size): the
    product's derivative rules inside the solver's loop, in both modes (their second order:
    the product's own test above)."""
    x, J, R = system(7)
    dx, dJ = jr.normal(jr.key(17), x.shape), jr.normal(jr.key(27), J.shape)
    # Ten Picard steps, differentiated one by one: reverse mode transposes every product of
    # the map (an implicit adjoint's dense solve would not; GMRES would, but compiles longer).
    picard = dict(solver=ea.Picard(rtol=0.0, atol=0.0), adjoint=ea.UnrolledAdjoint())

    def derivatives(x, J):
        loss = lambda x, J: jnp.sum(  # noqa: E731
            smt.steady_magnetizations(x, J, R=R, max_steps=10, throw=False, **picard) ** 2
        )
        return jax.grad(loss, argnums=(0, 1))(x, J), jax.jvp(loss, (x, J), (dx, dJ))[1]

    fused = jax.jit(derivatives)(x, J)
    monkeypatch.setattr(smt, "FUSED_PRODUCT_LIMIT", 0)
    products = jax.jit(lambda x, J: derivatives(x, J))(x, J)  # traced again, with products
    for a, b in zip(jax.tree.leaves(products), jax.tree.leaves(fused), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_tap_update_matches_the_written_sums(ref, fused, monkeypatch):
    """The matrix-product form of f equals the double sums of the equation, written out per
    spin with g0 carrying the updated spin's index i (the reference's convention): with its
    small products fused (broadcast and sum, the fixture's size) and as matrix products."""
    if not fused:
        monkeypatch.setattr(smt, "FUSED_PRODUCT_LIMIT", 0)
    x, J, beta, R = ref["x"], ref["J"], float(ref["beta"]), float(ref["R"])
    m1, m0 = ref["m_star_tight"], 0.9 * ref["m0"]
    f = np.asarray(jax.jit(smt.tap_field)(m1, m0, x, J, beta=beta, R=R))
    xj, Jj = jnp.asarray(x), jnp.asarray(J)
    steady = jax.jit(lambda m: smt._tap_field(m, m, xj, Jj, jnp.square(Jj), beta=beta, R=R))
    for same in (m1, m0):  # the steady state's map: one array as both (its field computed once)
        g = steady(jnp.asarray(same))
        np.testing.assert_allclose(
            g, smt.tap_field(same, same, x, J, beta=beta, R=R), rtol=1e-13, atol=1e-14
        )

    def inv(m):
        return 2 * R**2 * m / (beta * (R**2 - np.sum(m**2)))

    def gam(t):
        return np.sqrt(1 + beta**2 * np.sum(t**2) / R**2)

    K = J**2
    for i in range(x.shape[0]):
        g0, g1 = gam(inv(m0[i])), gam(inv(m1[i]))
        v = -inv(m1[i]) + x[i] + J[i] @ m0
        a = (m1[i] @ v) ** 2 + sum(
            K[i, j] * (m1[i] @ m1[i]) / (1 + g0) - K[i, j] * (m1[i] @ m0[j]) ** 2 / (R**2 * g0)
            for j in range(x.shape[0])
        )
        b = v @ v + sum(K[i, j] * (R**2 - m0[j] @ m0[j]) for j in range(x.shape[0]))
        c = (v @ m1[i]) * v + sum(
            K[i, j] * m1[i] / (1 + g0) - K[i, j] * (m1[i] @ m0[j]) * m0[j] / (R**2 * g0)
            for j in range(x.shape[0])
        )
        delta = (
            beta**2 * (1 + 3 * g1) / (R**4 * g1**3) * a * m1[i]
            - beta**2 / (R**2 * (g1**2 + g1)) * b * m1[i]
            - 2 * beta**2 / (R**2 * (g1**2 + g1)) * c
        )
        radial = (m1[i] @ delta) / (R**2 * g1 / (1 + g1) - m1[i] @ m1[i])
        expected = x[i] + J[i] @ m0 + (1 + g1) / (2 * beta) * (delta + radial * m1[i])
        np.testing.assert_allclose(f[i], expected, rtol=1e-12, atol=1e-13)


@pytest.fixture(scope="module")
def fixture_solve(ref):
    x, J, m0 = (jnp.asarray(ref[k]) for k in ("x", "J", "m0"))
    beta, R = ref["beta"], ref["R"]

    @jax.jit
    def run(x, J):
        def loss(x, J):
            m = smt.steady_magnetizations(x, J, beta=beta, R=R, m0=m0, solver=TIGHT, max_steps=300)
            return jnp.sum(m**2), m

        (_, m), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, J)
        default = smt.steady_state(x, J, beta=beta, R=R, m0=m0)
        # The same two solves from the reference's start (one first-order step from m0).
        reference_start = [
            smt.steady_state(x, J, beta=beta, R=R, m0=m0, start_steps=1, max_steps=300, **kw)
            for kw in (dict(solver=TIGHT), {})
        ]
        return m, grads, default, reference_start

    return run(x, J)


def test_steady_state_matches_the_reference(ref, fixture_solve):
    """m* to 1e-9 of the reference's tight solve; the exact implicit gradients of sum(m*^2)
    to 1e-7 of its dense implicit-function-theorem ones; the default tolerances within what
    the reference's own defaults (tol 1e-3) allow."""
    m, (gx, gJ), default, _ = fixture_solve
    default = default.value
    np.testing.assert_allclose(m, ref["m_star_tight"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(gx, ref["grad_msq_x_denseIFT"], rtol=0, atol=1e-7)
    np.testing.assert_allclose(gJ, ref["grad_msq_J_denseIFT"], rtol=0, atol=1e-7)
    # The reference's loose solve stopped with a residual of 1.4e-4, ours at rtol 1e-5.
    np.testing.assert_allclose(default, ref["m_star_default"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(default, ref["m_star_tight"], rtol=0, atol=1e-5)
    # The reference's own (CG, tol 1e-5) gradients carry ~2e-6 of error.
    np.testing.assert_allclose(gx, ref["grad_msq_x_tight"], rtol=0, atol=1e-5)


def test_the_start_changes_the_iterations_not_the_steady_state(ref, fixture_solve):
    """From the reference's start (one step of the first-order map) and from the default
    (five), the tight solves agree to round-off and the default-tolerance ones to the
    tolerance; the default start takes fewer evaluations of the TAP map (11 -> 9 here, a
    system with contraction 0.56; 7 -> 4 in the benchmark's)."""
    m, _, default, (tight, loose) = fixture_solve
    np.testing.assert_allclose(tight.value, m, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tight.value, ref["m_star_tight"], rtol=0, atol=1e-12)
    for solution in (default, loose):
        np.testing.assert_allclose(solution.value, ref["m_star_tight"], rtol=0, atol=1e-5)
    assert int(default.num_steps) < int(loose.num_steps)
    with pytest.raises(ValueError, match="start_steps"):
        smt.steady_state(ref["x"], ref["J"], R=ref["R"], start_steps=0)


def _loss(x, J, beta, unrolled=False):
    """A loss through m*: implicit (tight Anderson and linear solves) or exactly 200 unrolled
    Picard steps (tolerance 0, so it never stops early)."""
    m = smt.steady_state(
        x,
        J,
        beta=beta,
        R=np.sqrt(6 / 2 - 1),
        solver=ea.Picard(rtol=0.0, atol=0.0) if unrolled else TIGHT,
        adjoint=ea.UnrolledAdjoint() if unrolled else TIGHT_ADJOINT,
        max_steps=200,
        throw=not unrolled,
    ).value
    return jnp.sum(m**2) + jnp.sum(m[0] * x[1])


@jax.jit
def _derivatives(x, J, dx, dJ):
    """Gradients (x, J, beta), a JVP and an HVP, implicit and unrolled; a central difference
    of the implicit one. Module level: compiled once for every seed."""
    h = 1e-5

    def derivatives_of(f):
        # The HVP is the JVP of the gradient along dx: its primal output is the gradient.
        grad = lambda t: jax.grad(f, argnums=(0, 1, 2))(x + t * dx, J, 1.3)  # noqa: E731
        grad, hvp = jax.jvp(grad, (0.0,), (1.0,))
        # The JVP along (dx, dJ) at t = 0, and f at t = +-h: one vmapped solve.
        along = lambda t0: jax.jvp(lambda t: f(x + t * dx, J + t * dJ, 1.3), (t0,), (1.0,))  # noqa: E731
        values, jvps = jax.vmap(along)(h * AT_AND_AROUND)
        derivatives = dict(grad=grad, jvp=jvps[0], hvp=hvp[0])  # the HVP's x part
        return derivatives, (values[1] - values[2]) / (2 * h)

    implicit, fd = derivatives_of(_loss)
    unrolled, _ = derivatives_of(lambda x, J, b: _loss(x, J, b, unrolled=True))
    return dict(implicit=implicit, unrolled=unrolled, fd=fd)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_implicit_equals_unrolled_and_finite_differences(seed):
    """Gradients (x, J, beta), a JVP and a Hessian-vector product through m* agree between
    the implicit adjoint, 200 unrolled Picard steps and central finite differences."""
    x, J, _ = system(seed)
    dx, dJ = jr.normal(jr.key(10 + seed), x.shape), jr.normal(jr.key(20 + seed), J.shape)
    out = _derivatives(x, J, dx, dJ)
    imp, unr = out["implicit"], out["unrolled"]
    for a, b in zip(jax.tree.leaves(imp), jax.tree.leaves(unr), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(imp["jvp"], out["fd"], rtol=1e-7)
    directional = np.sum(imp["grad"][0] * dx) + np.sum(imp["grad"][1] * dJ)
    np.testing.assert_allclose(directional, imp["jvp"], rtol=1e-10)


def test_failures_are_loud(user_mode):
    """Too few steps raise with the solver's message; with throw=False the result says why;
    bad shapes and parameters fail at trace time naming the argument."""
    x, J, R = system(4)
    with pytest.raises(Exception, match="did not converge within `max_steps`"):
        jax.block_until_ready(smt.steady_magnetizations(x, J, R=R, max_steps=2))
    sol = smt.steady_state(x, J, R=R, max_steps=2, throw=False)
    assert sol.result == ea.RESULTS.max_steps_reached
    with pytest.raises(ValueError, match="J"):
        smt.steady_magnetizations(x, J[:3], R=R)
    with pytest.raises(ValueError, match="R"):
        smt.steady_magnetizations(x, J, R=-1.0)
    with pytest.raises(ValueError, match="m0"):
        smt.steady_magnetizations(x, J, R=R, m0=jnp.ones((2, 2)))


@eqx.filter_jit
def _layer_outputs(layer, scaled, x, mask):
    """The layer (masked) and its couplings, the scaled layer's couplings, the layer on a
    batch (vmapped), and the gradient of a loss through the layer with its output (unmasked,
    unbatched): one compilation."""

    def loss(layer):
        out = layer(x)
        return jnp.sum(out**2), out

    return (
        layer(x, mask=mask),
        layer.couplings(x, mask=mask),
        scaled.couplings(x),
        jax.vmap(layer)(jnp.stack([x, 2 * x])),
        jax.grad(loss, has_aux=True)(layer),
    )


@jax.jit
def _head_magnetizations(x, J, R, m0):
    return smt.steady_magnetizations(x, J, R=R, m0=m0)


def test_layer_follows_the_reference_conventions():
    """Per-head normalisation to R = sqrt(d/2 - 1), one (2 dim, dim) projection split into
    [q | k] in merged-head layout, row softmax of q k^T (no 1/sqrt(d)), m0 = 1/sqrt(d): the
    layer equals the steady state of each head computed by hand from its weight."""
    dim, heads, tokens = 12, 3, 5
    layer = ea.nn.SpinTransformerAttention(dim, heads, key=jr.key(0))
    x = jr.normal(jr.key(1), (tokens, dim))
    mask = np.tril(np.ones((tokens, tokens), bool))
    d = dim // heads
    R = np.sqrt(d / 2 - 1)
    W = np.asarray(layer.to_qk.weight)
    assert W.shape == (2 * dim, dim) and layer.to_qk.bias is None
    xh = np.asarray(x).reshape(tokens, heads, d)
    xh = R * xh / np.linalg.norm(xh, axis=-1, keepdims=True)
    qk = xh.reshape(tokens, dim) @ W.T
    q, k = qk[:, :dim].reshape(tokens, heads, d), qk[:, dim:].reshape(tokens, heads, d)
    scaled = ea.nn.SpinTransformerAttention(dim, heads, scale_couplings=True, key=jr.key(0))
    # Compiled, not op by op: everything the layers compute, and one head's solve.
    out, couplings, scaled_couplings, batch, (grad, forward) = _layer_outputs(
        layer, scaled, x, mask
    )
    out, couplings = np.asarray(out), np.asarray(couplings)
    assert out.shape == (tokens, dim)
    for h in range(heads):
        scores = q[:, h] @ k[:, h].T
        scores = np.where(mask, scores, np.finfo(scores.dtype).min)
        J = np.exp(scores - scores.max(-1, keepdims=True))
        J /= J.sum(-1, keepdims=True)
        np.testing.assert_allclose(couplings[h], J, rtol=1e-12)
        m = _head_magnetizations(xh[:, h], J, R, np.ones((tokens, d)) / np.sqrt(d))
        np.testing.assert_allclose(out[:, h * d : (h + 1) * d], m, rtol=1e-10, atol=1e-12)
    scores = q[:, 0] @ k[:, 0].T / np.sqrt(d)
    softmax = np.exp(scores - scores.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    np.testing.assert_allclose(scaled_couplings[0], softmax, rtol=1e-12)
    # Batches by vmap, and the gradient reaches the projection.
    np.testing.assert_allclose(batch[1], forward, rtol=1e-10)  # normalisation: scale-free
    assert np.all(np.isfinite(grad.to_qk.weight)) and np.any(grad.to_qk.weight != 0)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ea.nn.SpinTransformerAttention(10, 3, key=jr.key(0))
    with pytest.raises(ValueError, match="at least 3"):
        ea.nn.SpinTransformerAttention(8, 4, key=jr.key(0))
    with pytest.raises(ValueError, match="start_steps"):
        ea.nn.SpinTransformerAttention(8, 2, start_steps=0, key=jr.key(0))


def test_attention_classifier_and_command(tmp_path, capsys, user_mode):
    """Both token mixers train and evaluate in the mean-field classifier's skeleton; the
    command writes its metrics (with the untrained and majority-class controls) and figure."""
    import json

    from energyattn._cli import main

    images = jr.uniform(jr.key(0), (6, 1, 8, 8))
    labels = jnp.arange(6) % 3
    for mixer in ("spin_transformer", "softmax"):
        model = ea.models.AttentionClassifier(mixer, dim=12, num_classes=3, key=jr.key(1))
        solution = eqx.filter_jit(model.solve)(images[0])
        assert solution.value.shape == (17, 12) and solution.result == ea.RESULTS.successful
        assert (solution.num_steps > 0) == (mixer == "spin_transformer")
        result = ea.models.train_classifier(
            model,
            images,
            labels,
            key=jr.key(2),
            train_steps=2,
            batch_size=4,
            options=ea.models.TrainOptions(progress=False),
        )
        scores = ea.models.evaluate_classifier(result.model, images, labels)
        assert 0 <= scores["accuracy"] <= 1 and scores["converged"] == 1.0
    with pytest.raises(ValueError, match="mixer"):
        ea.models.AttentionClassifier("hopfield", key=jr.key(0))
    out = tmp_path / "out"
    argv = ["spin-transformer", "--train-steps", "2", "--out", str(out), "--no-progress"]
    # The spin transformer's training is checked above; the command with the fast mixer.
    assert main([*argv, "--models", "softmax"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["models"]) == {"softmax"}
    assert 0 < metrics["majority_class_accuracy"] < 1
    for model in metrics["models"].values():
        assert model["train_steps"] == 2 and 0 <= model["untrained_test"]["accuracy"] <= 1
    assert (out / "training_loss.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "majority class" in printed
    # Softmax attention has no solver: no "solver steps mean 0.0".
    assert "2 steps in" in printed and "no solver" in printed and "solver steps" not in printed


def _layer_loss(layer, W, x):
    layer = eqx.tree_at(lambda m: m.to_qk.weight, layer, W)
    return jnp.sum(jnp.sin(layer(x)))


@eqx.filter_jit
def _layer_gradients(tight, unrolled, W, x, dW, dx):
    """Gradients (W, x) of both layers and a central difference of the tight one along
    (dW, dx). Module level: compiled once for every seed."""
    h = 1e-5
    # The tight layer's gradient at (W, x) and its loss at (W, x) +- h (dW, dx): one vmapped
    # solve.
    values, tight_grads = jax.vmap(
        lambda t: jax.value_and_grad(_layer_loss, argnums=(1, 2))(tight, W + t * dW, x + t * dx)
    )(h * AT_AND_AROUND)
    grads = [
        jax.tree.map(lambda g: g[0], tight_grads),
        jax.grad(_layer_loss, argnums=(1, 2))(unrolled, W, x),
    ]
    return grads, (values[1] - values[2]) / (2 * h)


@pytest.mark.parametrize("seed", [0, 1])
def test_layer_gradients_implicit_unrolled_finite_differences(seed):
    """The layer's gradient with respect to its projection and its inputs: implicit adjoint =
    200 unrolled Picard steps = central finite differences (float64)."""
    key = jr.key(10 + seed)
    tight = ea.nn.SpinTransformerAttention(8, 2, solver=TIGHT, max_steps=200, key=key)
    unrolled = ea.nn.SpinTransformerAttention(
        8,
        2,
        solver=ea.Picard(rtol=0.0, atol=0.0),
        adjoint=ea.UnrolledAdjoint(),
        max_steps=200,
        throw=False,
        key=key,
    )
    x = jr.normal(jr.key(20 + seed), (5, 8))
    dW = jr.normal(jr.key(30 + seed), tight.to_qk.weight.shape)
    dx = jr.normal(jr.key(40 + seed), x.shape)
    (implicit, unrolled_grads), fd = _layer_gradients(
        tight, unrolled, tight.to_qk.weight, x, dW, dx
    )
    for a, b in zip(implicit, unrolled_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-11)
    directional = np.sum(implicit[0] * dW) + np.sum(implicit[1] * dx)
    np.testing.assert_allclose(directional, fd, rtol=1e-7)
