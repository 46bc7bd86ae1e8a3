"""Self-attention as an attractor network (D'Amico & Negri 2024): token-local energies, local
forces, the dynamics, the spin embedding of images, pseudo-likelihood training, the tasks."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from _fixtures import optimised

import energyattn as ea
from energyattn.data import (
    SpinPatchEmbedding,
    add_rescaled_noise,
    load_digits,
    pixels_to_spins,
    spins_to_pixels,
)
from energyattn.models import (
    AttractorImageModel,
    PatchTransformer,
    corrupt_image,
    reconstruction_curves,
    train_attractor,
    train_reconstruction,
)
from energyattn.nn import AttractorAttention, normalise_tokens


@pytest.fixture
def rng():
    """NumPy's generator for test data: no random-number program compiled per shape."""
    return np.random.default_rng(0)


def _system(rng, num_tokens=5, dim=3, scale=1.0):
    couplings = scale * rng.standard_normal((num_tokens, num_tokens, dim, dim))
    x = rng.standard_normal((num_tokens, dim))
    return jnp.asarray(couplings), jnp.asarray(x)


def _paper_update(x, couplings, lam):
    """Eq. (1)-(2) written out: sum_{j != i} softmax_j(lam x_i J_ij x_j) J_ij x_j (NumPy)."""
    x, couplings = np.asarray(x), np.asarray(couplings)
    n = x.shape[0]
    out = np.zeros_like(x)
    for i in range(n):
        others = [j for j in range(n) if j != i]
        scores = np.array([lam * x[i] @ couplings[i, j] @ x[j] for j in others])
        alpha = np.exp(scores - scores.max())
        alpha /= alpha.sum()
        out[i] = sum(a * couplings[i, j] @ x[j] for a, j in zip(alpha, others, strict=True))
    return out


# --- energies and forces -----------------------------------------------------------------


@pytest.mark.parametrize("lam", [1.0, 5.0])
def test_local_forces_equal_the_paper_attention_update(getkey, rng, lam):
    couplings, x = _system(rng, num_tokens=6, dim=4)
    energy = ea.LocalAttentionEnergy(couplings, lam)
    forces = eqx.filter_jit(ea.local_forces)(energy.local, x)
    np.testing.assert_allclose(forces, _paper_update(x, couplings, lam), rtol=1e-12, atol=1e-13)
    layer = eqx.tree_at(
        lambda m: m.couplings,
        AttractorAttention(6, 4, lam=lam, key=getkey()),
        couplings,
    )
    layer_forces = eqx.filter_jit(AttractorAttention.forces)(layer, x)
    np.testing.assert_allclose(layer_forces, forces, rtol=1e-13, atol=1e-14)


def test_local_forces_differ_from_the_gradient_of_the_total(rng):
    # Each token differentiates only its own energy: the field is not -grad of sum_i e_i
    # (which also moves x_i to lower the other tokens' energies).
    couplings, x = _system(rng)
    local = eqx.filter_jit(ea.local_forces)(ea.LocalAttentionEnergy(couplings).local, x)
    total = -jax.jit(jax.grad(ea.pseudo_likelihood_energy))(x, couplings)
    assert np.max(np.abs(local - total)) > 1e-2


def test_local_forces_of_a_user_energy(rng):
    # A generic token-local energy, e_i = 1/2 |x_i - c * sum_{j != i} x_j|^2, whose own-token
    # derivative is known: -(x_i - c * sum_{j != i} x_j).
    x = rng.standard_normal((4, 3))

    def e(x_i, ctx, i, c):
        field = c * (jnp.sum(ctx, axis=0) - ctx[i])
        return 0.5 * jnp.sum(jnp.square(x_i - field))

    c = 0.3
    expected = -(x - c * (np.sum(x, axis=0) - x))
    forces = jax.jit(ea.local_forces, static_argnums=0)(e, jnp.asarray(x), c)
    np.testing.assert_allclose(forces, expected, rtol=1e-13)
    with pytest.raises(ValueError, match="must return a scalar"):
        ea.local_forces(lambda x_i, ctx, i: x_i, x)


def test_local_energy_closed_forms(rng):
    # Compiled once per shape (lam is an argument), not op by op.
    local_energies = jax.jit(ea.local_energies)
    couplings, x = map(np.asarray, _system(rng, num_tokens=2, dim=3))
    # Two tokens: each sum has a single term, so e_i = -x_i J_ij x_j for any lambda.
    energies = local_energies(x, couplings, lam=3.0)
    np.testing.assert_allclose(energies[0], -x[0] @ couplings[0, 1] @ x[1], rtol=1e-13)
    np.testing.assert_allclose(energies[1], -x[1] @ couplings[1, 0] @ x[0], rtol=1e-13)
    couplings, x = map(np.asarray, _system(rng, num_tokens=5, dim=3))
    scores = np.einsum("id,ijde,je->ij", x, couplings, x)
    for lam in (0.5, 1.0, 5.0):
        masked = np.where(np.eye(5, dtype=bool), -np.inf, lam * scores)
        high = masked.max(axis=1)
        expected = -(high + np.log(np.exp(masked - high[:, None]).sum(axis=1))) / lam
        np.testing.assert_allclose(local_energies(x, couplings, lam=lam), expected, rtol=1e-12)
        np.testing.assert_allclose(
            jax.jit(ea.pseudo_likelihood_energy)(x, couplings, lam=lam),
            expected.sum(),
            rtol=1e-12,
        )
    # Large lambda: the log-sum-exp tends to the best score.
    big = local_energies(x, couplings, lam=1e4)
    np.testing.assert_allclose(
        big, -np.where(np.eye(5, dtype=bool), -np.inf, scores).max(1), atol=1e-3
    )


def test_diagonal_blocks_never_matter(rng):
    couplings, x = _system(rng)
    diagonal = (np.arange(5), np.arange(5))
    poisoned, clean = np.array(couplings), np.array(couplings)
    poisoned[diagonal], clean[diagonal] = np.nan, 0.0
    # Each compiled once (the same program for every J), not op by op.
    energies = jax.jit(ea.local_energies)
    forces = eqx.filter_jit(lambda c, x: ea.local_forces(ea.LocalAttentionEnergy(c).local, x))
    for c in (poisoned, couplings):
        np.testing.assert_allclose(energies(x, c), energies(x, clean), rtol=0)
        np.testing.assert_allclose(forces(c, x), forces(clean, x), rtol=0)
    grads = jax.jit(jax.grad(ea.pseudo_likelihood_energy, argnums=(0, 1)))(x, poisoned)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_project_couplings(rng):
    couplings, _ = _system(rng, num_tokens=4, dim=3)
    project = jax.jit(ea.project_couplings, static_argnames="scope")
    for scope in ("tensor", "block"):
        projected = np.asarray(project(couplings, 0.7, scope=scope))
        diag = projected[np.arange(4), np.arange(4)]
        assert float(np.max(np.abs(diag))) == 0.0
        block_norms = np.sqrt(np.sum(projected**2, axis=(2, 3)))
        off = ~np.eye(4, dtype=bool)
        np.testing.assert_allclose(np.sqrt(np.mean(block_norms[off] ** 2)), 0.7, rtol=1e-12)
        if scope == "block":
            np.testing.assert_allclose(block_norms[off], 0.7, rtol=1e-12)
        # Idempotent, and it keeps the direction.
        np.testing.assert_allclose(project(projected, 0.7, scope=scope), projected)
    np.testing.assert_array_equal(project(np.zeros((3, 3, 2, 2)), 1.0), 0.0)


def test_bad_shapes_raise(getkey, rng, user_mode):
    couplings, x = _system(rng, num_tokens=5, dim=3)
    with pytest.raises(ValueError, match=r"x must have shape \(N=5, d=3\), got \(4, 3\)"):
        ea.local_energies(x[:4], couplings)
    with pytest.raises(ValueError, match=r"x must have shape \(N=5, d=3\), got \(5, 2\)"):
        ea.pseudo_likelihood_energy(x[:, :2], couplings)
    with pytest.raises(ValueError, match=r"couplings must have shape \(N, N, d, d\)"):
        ea.local_energies(x, couplings[:, :4])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ea.local_energies(x[:1], couplings[:1, :1])
    with pytest.raises(ValueError, match="lam must be > 0"):
        ea.local_energies(x, couplings, lam=0.0)
    layer = AttractorAttention(5, 3, key=getkey())
    with pytest.raises(ValueError, match=r"x must have shape \(N=5, d=3\), got \(6, 3\)"):
        layer(jnp.zeros((6, 3)))
    with pytest.raises(ValueError, match=r"x must have shape \(N=5, d=3\), got \(5, 4\)"):
        layer.step(jnp.zeros((5, 4)))
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 2"):
        AttractorAttention(1, 3, key=getkey())
    with pytest.raises(ValueError, match="normalisation"):
        AttractorAttention(3, 3, normalisation="batch", key=getkey())
    with pytest.raises(RuntimeError, match="NaN or inf"):
        layer(jnp.full((5, 3), jnp.nan))


# --- the layer ---------------------------------------------------------------------------


def test_dynamics_is_eq1_then_normalisation(getkey, rng):
    key = getkey()

    def make(normalisation):
        return AttractorAttention(
            5, 3, num_steps=4, gamma=0.7, coupling_norm=2.0, normalisation=normalisation, key=key
        )

    layer = make("sphere")
    x = normalise_tokens(jnp.asarray(rng.standard_normal((5, 3))), "sphere")
    trajectory = layer(x)
    assert trajectory.shape == (5, 5, 3)
    np.testing.assert_array_equal(trajectory[0], x)
    state = np.asarray(x)
    for t in range(1, 5):
        update = _paper_update(state, layer.couplings, 1.0) + 0.7 * state
        state = update / np.linalg.norm(update, axis=1, keepdims=True)
        np.testing.assert_allclose(trajectory[t], state, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(trajectory[1:], axis=-1), 1.0, rtol=1e-12)
    # Other normalisations (one step each, compiled whole rather than op by op).
    step = eqx.filter_jit(AttractorAttention.step)
    y = np.asarray(step(make("layer"), x))
    np.testing.assert_allclose(np.mean(y, axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), 1.0, rtol=1e-12)
    forces = eqx.filter_jit(AttractorAttention.forces)(layer, x)
    np.testing.assert_allclose(step(make("none"), x), forces + 0.7 * np.asarray(x), rtol=1e-13)
    # A zero token stays finite (it is what masking produces).
    assert bool(jnp.all(jnp.isfinite(normalise_tokens(jnp.zeros((2, 3)), "sphere"))))


def test_layer_jit_vmap_grad(getkey, rng):
    layer = AttractorAttention(4, 3, num_steps=3, key=getkey())
    xs = jnp.asarray(rng.standard_normal((2, 4, 3)))
    eager = jax.vmap(layer)(xs)
    jitted = eqx.filter_jit(jax.vmap(layer))(xs)
    np.testing.assert_allclose(jitted, eager, rtol=1e-12)

    def loss(model, x):
        return jnp.sum(model(x)[-1] ** 2 * jnp.arange(3.0))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(layer, xs[0])
    direction = rng.standard_normal(layer.couplings.shape)
    eps = 1e-6
    shifted = [
        eqx.tree_at(lambda m: m.couplings, layer, layer.couplings + s * eps * direction)
        for s in (1, -1)
    ]
    jit_loss = eqx.filter_jit(loss)  # one program for both evaluations
    fd = (jit_loss(shifted[0], xs[0]) - jit_loss(shifted[1], xs[0])) / (2 * eps)
    np.testing.assert_allclose(np.sum(grads.couplings * direction), fd, rtol=1e-6)
    # The pseudo-likelihood energy has a gradient in J (what training uses).
    g = jax.jit(jax.grad(lambda c: ea.pseudo_likelihood_energy(xs[0], c, lam=5.0)))(layer.couplings)
    assert g.shape == layer.couplings.shape and bool(jnp.all(jnp.isfinite(g)))


# --- data path ---------------------------------------------------------------------------


@pytest.mark.parametrize("patch_size", [2, 4])
def test_spin_embedding_is_exactly_invertible(getkey, patch_size):
    images = load_digits("test").images[:5, None]
    embedding = SpinPatchEmbedding((1, 8, 8), patch_size, 40, key=getkey())
    a = patch_size**2
    assert embedding.num_tokens == (8 // patch_size) ** 2 and embedding.patch_dim == a
    matrix = np.asarray(embedding.embedding)
    np.testing.assert_allclose(matrix.T @ matrix, np.eye(2 * a), atol=1e-12)
    # Compiled whole, not op by op.
    encode = eqx.filter_jit(lambda embedding, images: jax.vmap(embedding.encode)(images))
    decode = eqx.filter_jit(lambda embedding, tokens: jax.vmap(embedding.decode)(tokens))
    tokens = np.asarray(encode(embedding, images))
    assert tokens.shape == (5, embedding.num_tokens, 40)
    np.testing.assert_allclose(np.linalg.norm(tokens, axis=-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(decode(embedding, tokens), images, atol=1e-12)
    # Patch k of the image is the pixels of token k: changing one pixel moves one token.
    changed = images[:1].copy()
    changed[0, 0, 0, 0] = 1.0 - images[0, 0, 0, 0]
    moved = np.any(np.abs(encode(embedding, changed)[0] - tokens[0]) > 0, axis=1)
    assert moved.tolist() == [True] + [False] * (embedding.num_tokens - 1)


def test_pixel_spins(rng):
    to_pixels = jax.jit(spins_to_pixels)  # one program per shape, not op by op
    p = np.linspace(0, 1, 11)
    u = np.asarray(jax.jit(pixels_to_spins)(p))
    np.testing.assert_allclose(u[0], [0, 1])
    np.testing.assert_allclose(u[-1], [1, 0])
    np.testing.assert_allclose(np.linalg.norm(u, axis=-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(to_pixels(u), p, atol=1e-14)
    np.testing.assert_allclose(to_pixels(3.0 * u), p, atol=1e-14)  # length is ignored
    # Any vector decodes into [0, 1], through the nearest end of the arc.
    decoded = np.asarray(to_pixels(rng.standard_normal((1000, 2))))
    assert decoded.min() >= 0.0 and decoded.max() <= 1.0
    np.testing.assert_allclose(
        to_pixels(np.array([[-1.0, 0.1], [0.1, -1.0]])), [0.0, 1.0], atol=1e-15
    )


def test_bad_images_raise(getkey, user_mode):
    with pytest.raises(ValueError, match="does not split into 3x3 patches"):
        SpinPatchEmbedding((1, 8, 8), 3, key=getkey())
    with pytest.raises(ValueError, match="does not split into 2x2 patches"):
        AttractorImageModel((1, 7, 8), 2, key=getkey())
    with pytest.raises(ValueError, match="dim must be at least 2a = 32"):
        SpinPatchEmbedding((1, 8, 8), 4, 16, key=getkey())
    embedding = SpinPatchEmbedding((1, 8, 8), 2, key=getkey())
    image = jnp.full((1, 8, 8), 0.5)
    with pytest.raises(ValueError, match=r"pixels must be in \[0, 1\], got \[1.5\]"):
        embedding.encode(image.at[0, 3, 3].set(1.5))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        embedding.encode(image.at[0, 0, 0].set(-0.1))
    with pytest.raises(RuntimeError, match=r"in \[0, 1\]"):
        eqx.filter_jit(embedding.encode)(image.at[0, 0, 0].set(-0.1))
    with pytest.raises(ValueError, match=r"image must have shape \(1, 8, 8\)"):
        embedding.encode(jnp.zeros((8, 8)))
    with pytest.raises(ValueError, match=r"images must be in \[0, 1\]"):
        train_attractor(
            AttractorImageModel(key=getkey()),
            2 * jnp.ones((4, 1, 8, 8)),
            key=getkey(),
            train_steps=1,
            batch_size=2,
            options=ea.models.TrainOptions(progress=False),
        )


def test_corruptions(getkey, rng, user_mode):
    image = load_digits("test").images[0][None]
    # Compiled whole, not op by op.
    corrupt = jax.jit(corrupt_image, static_argnames=("task", "patch_size"))
    corrupted, mask = map(np.asarray, corrupt(image, "masked", patch_size=2, key=getkey()))
    assert int(mask.sum()) == 5  # round(0.3 * 16)
    patches = np.asarray(ea.data.patchify(corrupted, 2))
    np.testing.assert_array_equal(patches[mask], 0.0)
    np.testing.assert_array_equal(patches[~mask], ea.data.patchify(image, 2)[~mask])
    noisy, mask = map(np.asarray, corrupt(image, "denoise", patch_size=2, key=getkey()))
    assert not mask.any() and noisy.min() >= 0 and noisy.max() <= 1
    # Before the clip, the rescaled noisy image has the clean image's mean and variance.
    mid = 0.5 + 0.1 * rng.uniform(-1, 1, (1, 8, 8))
    rescaled = np.asarray(jax.jit(add_rescaled_noise)(mid, 0.01, key=getkey()))
    assert rescaled.min() > 0 and rescaled.max() < 1  # nothing clipped
    np.testing.assert_allclose(np.mean(rescaled), np.mean(mid), rtol=1e-12)
    np.testing.assert_allclose(np.std(rescaled), np.std(mid), rtol=1e-12)
    assert np.max(np.abs(rescaled - mid)) > 1e-3
    with pytest.raises(ValueError, match="task must be"):
        corrupt_image(image, "inpaint", patch_size=2, key=getkey())


# --- training and the paper's claims -----------------------------------------------------


@pytest.fixture(scope="module")
def trained_attractor():
    """A small attractor network trained by pseudo-likelihood on the training digits
    (float32, a few seconds), and its held-out curves for both tasks."""
    train = np.asarray(load_digits("train").images, np.float32)[:, None]
    test = np.asarray(load_digits("test").images[:200], np.float32)[:, None]
    model = AttractorImageModel(dim=32, num_steps=20, key=jr.key(0), dtype=jnp.float32)
    with optimised():  # 300 training steps
        options = ea.models.TrainOptions(progress=False)
        result = train_attractor(model, train, key=jr.key(1), train_steps=300, options=options)
        curves = {
            task: reconstruction_curves(result.model, test, task=task, key=jr.key(2), num_steps=20)
            for task in ("masked", "denoise")
        }
    return model, result, curves


def test_training_keeps_the_constraints_and_lowers_the_energy(trained_attractor):
    initial, result, _ = trained_attractor
    couplings = result.model.attention.couplings
    n = couplings.shape[0]
    assert float(jnp.max(jnp.abs(couplings[jnp.arange(n), jnp.arange(n)]))) == 0.0
    rms = jnp.sqrt(jnp.sum(couplings**2) / (n * (n - 1)))
    np.testing.assert_allclose(rms, initial.attention.coupling_norm, rtol=1e-5)
    # The embedding is fixed; only J is learned.
    np.testing.assert_array_equal(result.model.embedding.embedding, initial.embedding.embedding)
    losses = np.asarray(result.losses)
    assert losses[-50:].mean() < losses[:10].mean() - 1.0


def test_transient_memories_on_held_out_digits(trained_attractor):
    # Masked prediction: the error is lowest at an intermediate iteration (after the corrupted
    # input at t = 0, before the end at t = 20) and rises afterwards towards the global
    # attractor; the same network (trained once, without a task) improves on the corrupted
    # input in both tasks.
    _, _, curves = trained_attractor
    # (curve, how much the end must exceed the minimum); measured on two seeds: the masked
    # image error ends ~3x above its minimum, the masked-patch error ~2% above, denoising
    # ~10% above.
    checks = {
        ("masked", "mse"): 2.0,
        ("masked", "masked_mse"): 1.005,
        ("denoise", "mse"): 1.05,
    }
    for (task, key), rise in checks.items():
        curve = curves[task][key]
        best = int(np.argmin(curve))
        assert 1 <= best < len(curve) - 1, (task, key, curve)
        assert curve[best] < 0.7 * curve[0], (task, key, curve)
        assert curve[-1] > rise * curve[best], (task, key, curve)
    # Denoising needs several iterations (the paper: about ten).
    assert int(np.argmin(curves["denoise"]["mse"])) >= 3


def test_baselines_train_and_iterate(getkey):
    train = np.asarray(load_digits("train").images[:256], np.float32)[:, None]
    model = PatchTransformer(dim=16, depth=1, num_heads=2, key=getkey())
    result = train_reconstruction(
        model,
        train,
        task="denoise",
        key=getkey(),
        train_steps=40,
        min_iterations=2,
        max_iterations=3,
        batch_size=32,
        options=ea.models.TrainOptions(learning_rate=3e-3, progress=False),
    )
    losses = np.asarray(result.losses)
    assert losses[-10:].mean() < losses[:5].mean()
    trained = result.model
    image = jnp.asarray(train[0])
    states = trained.reconstruct(image, None, 3)
    assert states.shape == (4, 1, 8, 8)
    np.testing.assert_array_equal(states[0], image)
    np.testing.assert_allclose(trained(image, 2), states[2], rtol=1e-6)
    # Recycling with a random number of iterations applies the block exactly tau times.
    for tau in (2, 3):
        np.testing.assert_allclose(
            trained._random_depth(image, jnp.asarray(tau), 3), states[tau], rtol=1e-6
        )
    curves = reconstruction_curves(trained, train[:16], task="masked", key=getkey(), num_steps=2)
    assert curves["mse"].shape == (3,) and curves["masked_mse"].shape == (3,)
    with pytest.raises(ValueError, match="max_iterations=1 is below min_iterations=3"):
        train_reconstruction(
            model,
            train,
            task="masked",
            key=getkey(),
            train_steps=1,
            min_iterations=3,
            max_iterations=1,
            options=ea.models.TrainOptions(progress=False),
        )


# --- the command line and the figure -----------------------------------------------------


def test_cli_attractor_end_to_end(tmp_path, capsys):
    from matplotlib import image as matplotlib_image

    from energyattn._cli import main

    base = ["attractor", "--train-steps", "3", "--iterations", "3", "--no-progress"]
    base += ["--patch-size", "4"]  # 4 tokens compile faster (the next test runs the default, 2)
    # Denoising with both baselines (masked prediction without them: the next test).
    runs = {"denoise": ["--tasks", "denoise", "--baseline-steps", "2"]}
    for task, extra in runs.items():
        out = tmp_path / task
        assert main([*base, "--out", str(out), *extra]) == 0
        printed = capsys.readouterr().out
        models = json.loads((out / "metrics.json").read_text())["tasks"][task]
        expected = {"bare self-attention (attractor)", "bare self-attention (untrained)"}
        expected.add(
            "mean training image (trivial)"
            if task == "denoise"
            else "mean training patch (trivial)"
        )
        if task == "denoise":
            expected |= {"recycled transformer block", "5-layer ViT"}
            assert len(models["5-layer ViT"]["curve"]) == 2
        assert set(models) == expected
        attractor = models["bare self-attention (attractor)"]
        assert len(attractor["curve"]) == 4
        assert attractor["best"] == min(attractor["curve"][1:])
        assert f"{attractor['best']:.4f}" in printed
        assert ("masked_region" in attractor) == (task == "masked")
        # The controls: the untrained network, and the mean training image whatever the
        # input (its error is that of the mean image), from the same corruptions (same t0).
        assert len(models["bare self-attention (untrained)"]["curve"]) == 4
        t0 = [model["t0"] for model in models.values()]
        np.testing.assert_allclose(t0, t0[0], rtol=1e-6)
        train = np.asarray(load_digits("train").images, np.float32)[:, None]
        test = np.asarray(load_digits("test").images, np.float32)[:, None]
        np.testing.assert_allclose(
            models["mean training image (trivial)"]["best"],
            np.mean((test - train.mean(axis=0)) ** 2),
            rtol=1e-5,
        )
        assert set(json.loads((out / "metrics.json").read_text())["controls"][task]) == {"image"}
        for name in ("mse_vs_iteration.png", f"reconstructions_{task}.png", "couplings.png"):
            image = matplotlib_image.imread(out / name)
            assert image.ndim == 3 and image.std() > 0.05
    with pytest.raises(SystemExit):
        main(["attractor", "--patch-size", "3", "--out", str(tmp_path)])
    assert "invalid choice" in capsys.readouterr().err


def test_demo_reports_the_untrained_model_and_a_trivial_baseline(tmp_path):
    # The controls: the same attractor network before training and a baseline
    # without a model, per task, in the same run and the same metrics.json.
    from energyattn._cli.attractor import TRAINED, TRIVIAL, UNTRAINED, run_attractor_demo

    # Masked prediction here; denoising's controls are checked by the command's test above.
    said = []
    metrics = run_attractor_demo(
        tmp_path,
        train_steps=2,
        num_iterations=2,
        tasks=("masked",),
        baselines=False,
        progress=said.append,
        options=ea.models.TrainOptions(progress=False),
    )
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    for name in ("mse_vs_iteration.png", "reconstructions_masked.png", "couplings.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "masked_region" in metrics["tasks"]["masked"][TRAINED]
    train = np.asarray(load_digits("train").images, np.float32)[:, None]
    test = np.asarray(load_digits("test").images, np.float32)[:, None]
    mean = train.mean(axis=0)
    for task in ("masked",):
        models = metrics["tasks"][task]
        assert set(models) == {TRAINED, UNTRAINED, TRIVIAL[task]}
        assert len(models[UNTRAINED]["curve"]) == len(models[TRAINED]["curve"]) == 3
        # Same corruptions for every model: the same error at t = 0.
        t0 = [models[name]["t0"] for name in models]
        np.testing.assert_allclose(t0, t0[0], rtol=1e-6)
        trivial = models[TRIVIAL[task]]
        assert len(trivial["curve"]) == 2
        # The trivial baseline is not iterated: no t to report, printed or written.
        assert "best_t" not in trivial and "best_t" not in trivial["masked_region"]
        (line,) = [line for line in said if line.startswith(f"{task}: {TRIVIAL[task]}:")]
        assert "t=" not in line and "corrupted input" in line, line
        assert "best_t" in models[TRAINED] and any("at t=" in line for line in said)
        controls = metrics["controls"][task]
        assert set(controls) == ({"image", "masked_region"} if task == "masked" else {"image"})
        for control in controls.values():
            expected = 100 * (1 - control["trained_best"] / control["untrained_best"])
            np.testing.assert_allclose(control["percent_below_untrained"], expected)
        assert any(f"{task} (image): trained attractor best" in line for line in said)
    # Masked prediction's fills the masked patches with the mean training pixels there: on
    # the masked patches its error is that of the mean image, elsewhere zero.
    key = jr.PRNGKey(100)  # the demo's evaluation key for seed 0
    masks = jax.jit(
        jax.vmap(
            lambda image, i: corrupt_image(image, "masked", patch_size=2, key=jr.fold_in(key, i))[1]
        )
    )(test, np.arange(len(test)))
    pixel_masks = np.asarray(masks).reshape(-1, 4, 4)
    pixel_masks = np.repeat(np.repeat(pixel_masks, 2, axis=1), 2, axis=2)[:, None]
    errors = (test - mean) ** 2 * pixel_masks
    trivial = metrics["tasks"]["masked"][TRIVIAL["masked"]]
    np.testing.assert_allclose(trivial["best"], errors.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        trivial["masked_region"]["best"], errors.sum() / pixel_masks.sum(), rtol=1e-5
    )


def test_plot_curves(tmp_path):
    from energyattn import viz

    path = viz.plot_curves(
        {"a": {"iterated": np.linspace(1, 0, 5), "once": np.array([0.3])}, "b": {"x": [1, 2]}},
        tmp_path / "curves.png",
        logy=True,
    )
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="non-empty dict"):
        viz.plot_curves({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"must have shape \(steps\)"):
        viz.plot_curves({"a": {"x": np.zeros((2, 2))}}, tmp_path / "x.png")
