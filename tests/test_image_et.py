"""The image Energy Transformer: patches, masking, forward pass, training, checkpoints, npz."""

import dataclasses
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

FIXTURES = Path(__file__).parent / "fixtures"


def tiny_model(key, **kwargs):
    options = dict(dim=8, num_heads=2, head_dim=4, num_memories=16, num_steps=3)
    options.update(kwargs)
    return ea.models.ImageEnergyTransformer((1, 8, 8), 2, key=key, **options)


def test_patchify_order_and_round_trip(getkey):
    image = jnp.arange(2 * 4 * 6.0).reshape(2, 4, 6)
    patches = ea.data.patchify(image, 2)
    assert patches.shape == (6, 8)
    # first patch: top-left 2x2 block of channel 0 then channel 1; second: the block to its right
    np.testing.assert_array_equal(patches[0], [0, 1, 6, 7, 24, 25, 30, 31])
    np.testing.assert_array_equal(patches[1], [2, 3, 8, 9, 26, 27, 32, 33])
    np.testing.assert_array_equal(patches[3], [12, 13, 18, 19, 36, 37, 42, 43])
    np.testing.assert_array_equal(ea.data.unpatchify(patches, (2, 4, 6), 2), image)


def test_random_patch_mask(getkey):
    masks = jax.jit(jax.vmap(lambda k: ea.data.random_patch_mask(k, 16, 4)))(jr.split(getkey(), 50))
    assert masks.dtype == jnp.bool_ and masks.shape == (50, 16)
    np.testing.assert_array_equal(masks.sum(1), 4)
    assert len({tuple(m) for m in np.asarray(masks)}) > 40  # different masks per key
    with pytest.raises(ValueError, match="cannot mask num_masked=17 patches .* num_patches=16"):
        ea.data.random_patch_mask(getkey(), 16, 17)


def test_forward_pass_is_the_documented_pipeline(getkey):
    model = tiny_model(getkey())
    image = np.random.default_rng(0).uniform(size=(1, 8, 8))
    mask = ea.data.random_patch_mask(getkey(), 16, 4)
    forward = eqx.filter_jit(lambda m, x, k: m(x, k, return_solution=True))
    out, descent = forward(model, image, mask)
    assert out.shape == (1, 8, 8) and descent.energies.shape == (4,)
    # by hand
    patches = np.asarray(ea.data.patchify(image, 2))
    tokens = patches @ np.asarray(model.embed_weight) + np.asarray(model.embed_bias)
    tokens = np.where(np.asarray(mask)[:, None], np.asarray(model.mask_token), tokens)
    tokens = np.concatenate([np.asarray(model.cls_token)[None], tokens]) + np.asarray(
        model.pos_embed
    )

    @eqx.filter_jit
    def by_hand(et, x):
        for _ in range(3):
            x = x - 0.1 * jax.grad(et.energy)(et.layer_norm(x))
        return et.layer_norm(x[1:]) @ model.unembed_weight + model.unembed_bias

    expected = by_hand(model.transformer, jnp.asarray(tokens))
    np.testing.assert_allclose(model.patchify(out), expected, rtol=1e-10, atol=1e-12)
    # The content of masked patches never reaches the model (the same compiled forward pass).
    hidden = ea.data.unpatchify(np.repeat(np.asarray(mask)[:, None], 4, 1), (1, 8, 8), 2)
    scribbled = np.where(hidden, 5.0, image)
    np.testing.assert_allclose(forward(model, scribbled, mask)[0], out, rtol=1e-12)


def test_whole_model_jit_vmap_grad(getkey):
    rng = np.random.default_rng(0)
    model = tiny_model(getkey())
    images = rng.uniform(size=(3, 1, 8, 8))
    masks = jax.jit(jax.vmap(lambda k: ea.data.random_patch_mask(k, 16, 4)))(jr.split(getkey(), 3))

    def loss(model, images, masks):
        return jnp.mean(
            jax.vmap(ea.models.masked_patch_mse, in_axes=(None, 0, 0))(model, images, masks)
        )

    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = value_and_grad(model, images, masks)
    one = eqx.filter_jit(ea.models.masked_patch_mse)  # unbatched; compiled once, not op by op
    single = [one(model, images[i], masks[i]) for i in range(3)]
    np.testing.assert_allclose(value, np.mean(single), rtol=1e-12)

    def jit_loss(model, images, masks):  # the loss from the program compiled above
        return value_and_grad(model, images, masks)[0]

    for path in (lambda m: m.transformer.w_key, lambda m: m.mask_token, lambda m: m.embed_weight):
        direction = rng.standard_normal(path(model).shape)
        eps = 1e-6
        plus = eqx.tree_at(path, model, path(model) + eps * direction)
        minus = eqx.tree_at(path, model, path(model) - eps * direction)
        fd = (jit_loss(plus, images, masks) - jit_loss(minus, images, masks)) / (2 * eps)
        np.testing.assert_allclose(np.sum(path(grads) * direction), fd, rtol=1e-6)


def test_lyapunov_decreases_for_image_model_config(getkey):
    model = ea.models.ImageEnergyTransformer((1, 8, 8), 2, key=getkey())  # the default config
    image = jnp.asarray(ea.data.load_digits("test").images[0])[None]
    mask = ea.data.random_patch_mask(getkey(), 16, 4)
    tokens = model.prepare(model.encode(image), mask)
    et = model.transformer

    @eqx.filter_jit
    def run(et, tokens):
        descent = et.recall(tokens, num_steps=300, return_trajectory=True)  # alpha = 0.1
        return jax.vmap(et.lyapunov)(descent.trajectory)

    lyapunov = np.asarray(run(et, tokens))
    assert np.all(np.diff(lyapunov) <= 1e-9 * np.abs(lyapunov).max())
    assert lyapunov[-1] < lyapunov[0]


# The training of the resume test and of the held-out test below: the same model, data and
# settings, so a process that runs both compiles the training step once.
TRAINING = dict(train_steps=60, num_masked=4, batch_size=16)
OPTIONS = ea.models.TrainOptions(learning_rate=1e-2, progress=False)


def _training_images():
    return jnp.asarray(ea.data.load_digits("train").images[:256, None])


def test_training_reduces_loss_and_resumes_identically(tmp_path):
    images = _training_images()
    model = tiny_model(jr.key(0))
    settings = TRAINING
    straight = ea.models.train_inpainting(model, images, key=jr.key(1), **settings, options=OPTIONS)
    assert straight.finished and straight.step == 60 and straight.losses.shape == (60,)

    # stop after 3 steps (a callback raising stands in for a crash), then resume
    checkpoint = tmp_path / "et.eqx"

    def crash(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ea.models.train_inpainting(
            model,
            images,
            key=jr.key(1),
            **settings,
            options=dataclasses.replace(
                OPTIONS, checkpoint=checkpoint, checkpoint_every=1, callback=crash
            ),
        )
    assert checkpoint.exists()
    resumed = ea.models.train_inpainting(
        tiny_model(jr.key(5)),
        images,
        key=jr.key(1),
        **settings,
        options=dataclasses.replace(OPTIONS, checkpoint=checkpoint),
    )
    assert resumed.step == 60 and resumed.losses.shape == (57,)
    np.testing.assert_array_equal(resumed.losses, straight.losses[3:])
    for a, b in zip(jax.tree.leaves(resumed.model), jax.tree.leaves(straight.model), strict=True):
        np.testing.assert_array_equal(a, b)
    # A finished checkpoint resumes to nothing left to do.
    again = ea.models.train_inpainting(
        model,
        images,
        key=jr.key(1),
        **settings,
        options=dataclasses.replace(OPTIONS, checkpoint=checkpoint),
    )
    assert again.losses.shape == (0,) and again.finished


def test_time_limit_stops_early(tmp_path):
    # The settings of the tests above: the step is compiled (before the clock starts) once.
    result = ea.models.train_inpainting(
        tiny_model(jr.key(0)),
        _training_images(),
        key=jr.key(1),
        **TRAINING,
        options=dataclasses.replace(OPTIONS, time_limit=0.0, checkpoint=tmp_path / "c.eqx"),
    )
    assert not result.finished and result.step == 0 and (tmp_path / "c.eqx").exists()


def _quadratic_loss(params, static, step_key, data, config):
    return jnp.sum(jnp.square(eqx.combine(params, static)["w"] - data[0]))


@pytest.mark.parametrize("time_limit", [60.0, None])
def test_time_limit_counts_training_not_compilation(monkeypatch, time_limit):
    """The training loops compile the step before the clock starts (`energyattn ebt
    --time-limit 20` spent its 20 s compiling and reported a model trained 1 step), with or
    without a time limit, and the result reports the two times apart."""
    from energyattn.models import _training

    compiles, clock_calls = [], []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name", ""))

    def clock():  # 0, 1, 2, ... seconds: the time limit never runs out
        clock_calls.append(len(compiles))
        return float(len(clock_calls) - 1)

    size = 3 if time_limit is None else 4  # a program of its own for each case: compiled
    monkeypatch.setattr(_training, "time", types.SimpleNamespace(perf_counter=clock))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = _training.fit(
            {"w": jnp.zeros(size)},
            _quadratic_loss,
            (jnp.ones(size),),
            (),
            key=jr.key(0),
            train_steps=3,
            options=ea.models.TrainOptions(time_limit=time_limit, progress=False),
            default_learning_rate=0.1,
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert result.step == 3 and result.finished and result.stopped_by is None
    # The first reading starts the compilation, the second the training, the last ends it.
    before, began = clock_calls[0], clock_calls[1]
    assert any("train_step" in name for name in compiles[before:began]), compiles
    assert not any("train_step" in name for name in compiles[began:]), compiles
    assert result.compile_seconds == 1.0
    assert result.train_seconds == len(clock_calls) - 2


def test_a_callback_stops_training_with_stop_training(tmp_path):
    """`StopTraining` from the callback ends the training after that step: the result and
    the checkpoint keep it, as after a time limit; raised after the last step it changes
    nothing."""
    checkpoint = tmp_path / "stopped.eqx"

    def stop_at(when):
        def callback(step, loss):
            if step == when:
                raise ea.models.StopTraining

        return callback

    def train(when, **options):
        return _training_fit(
            train_steps=5, options=ea.models.TrainOptions(callback=stop_at(when), **options)
        )

    stopped = train(2, checkpoint=checkpoint)
    assert (stopped.step, stopped.finished, stopped.stopped_by) == (2, False, "callback")
    assert stopped.losses.shape == (2,)
    resumed = train(None, checkpoint=checkpoint)  # the checkpoint holds step 2
    assert resumed.step == 5 and resumed.losses.shape == (3,) and resumed.stopped_by is None
    last = train(5)
    assert (last.step, last.finished, last.stopped_by) == (5, True, None)


def _training_fit(**kwargs):
    from energyattn.models import _training

    options = dataclasses.replace(kwargs.pop("options"), progress=False)
    return _training.fit(
        {"w": jnp.zeros(3)},
        _quadratic_loss,
        (jnp.ones(3),),
        (),
        key=jr.key(0),
        default_learning_rate=0.1,
        options=options,
        **kwargs,
    )


def test_optimizer_schedule():
    optimizer = ea.models.make_optimizer(
        1.0, train_steps=100, warmup_steps=10, clip_norm=1e9, weight_decay=0.0
    )
    params = {"w": jnp.zeros(())}
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)  # one compiled update, not op by op
    sizes = []
    for _ in range(100):
        updates, state = update({"w": jnp.ones(())}, state, params)
        sizes.append(-float(updates["w"]))
    # Adam's first step has unit size times the learning rate: warm-up from 0, peak, cosine to 0.
    assert sizes[0] == 0.0 and sizes[10] == pytest.approx(1.0, rel=1e-3)
    assert sizes[55] == pytest.approx(0.5, rel=0.05) and sizes[-1] < 1e-3


def write_checkpoint_like_npz(path, rng, *, heads=2, head_dim=3, dim=6, mem=10):
    """Arrays in the public ET checkpoint's layout, for 1x8x8 images in 4x4 patches: `Xi` is
    `(D, M)` in the file; the returned dict holds the memories `(M, D)` as "memories"."""
    arrays = {
        "Wq": rng.normal(size=(heads, head_dim, dim)),
        "Wk": rng.normal(size=(heads, head_dim, dim)),
        "Xi": rng.normal(size=(dim, mem)),
        "Wenc": rng.normal(size=(16, dim)),
        "Benc": rng.normal(size=(dim,)),
        "Wdec": rng.normal(size=(dim, 16)),
        "Bdec": rng.normal(size=(16,)),
        "LNORM_gamma": np.asarray(1.3),
        "LNORM_bias": rng.normal(size=(dim,)),
        "CLS_token": rng.normal(size=(dim,)),
        "MASK_token": rng.normal(size=(dim,)),
        "POS_embed": rng.normal(size=(5, dim)),
    }
    np.savez(path, **arrays)
    return dict(arrays, memories=arrays["Xi"].T)


# mem == dim: a square Xi, which the old loader (transposing only when M != D) read wrongly.
@pytest.mark.parametrize("mem", [10, 6])
def test_load_npz_checkpoint_layout(tmp_path, mem):
    rng = np.random.default_rng(0)
    arrays = write_checkpoint_like_npz(tmp_path / "et.npz", rng, mem=mem)
    model = ea.models.load_image_et(tmp_path / "et.npz", image_shape=(1, 8, 8), patch_size=4)
    et = model.transformer
    assert et.include_self and et.beta == pytest.approx(3**-0.5)
    np.testing.assert_array_equal(et.w_query, arrays["Wq"])
    np.testing.assert_array_equal(et.memories, arrays["Xi"].T)  # (M, D), also when M == D
    np.testing.assert_array_equal(model.pos_embed, arrays["POS_embed"])
    np.testing.assert_array_equal(et.layer_norm.gamma, 1.3)
    # The energy of the loaded model, written from the raw arrays: memory k is Xi[:, k].
    g = rng.normal(size=(5, 6))
    value = 0.0
    for h in range(2):
        scores = (g @ arrays["Wq"][h].T) @ (g @ arrays["Wk"][h].T).T / np.sqrt(3)
        value -= np.sqrt(3) * np.log(np.exp(scores).sum(1)).sum()  # self term included
    value -= 0.5 * np.sum(np.maximum(g @ arrays["Xi"], 0) ** 2)
    np.testing.assert_allclose(et.energy(g), value, rtol=1e-12)
    # encode uses patches @ Wenc + Benc
    image = rng.uniform(size=(1, 8, 8))
    np.testing.assert_allclose(
        model.encode(image),
        ea.data.patchify(image, 4) @ arrays["Wenc"] + arrays["Benc"],
        rtol=1e-12,
    )
    # A model saved in the layout has Xi as (D, M), and loads back identically.
    ea.models.save_image_et(tmp_path / "again.npz", model)
    with np.load(tmp_path / "again.npz") as saved:
        assert saved["Xi"].shape == (6, mem)
        np.testing.assert_array_equal(saved["Xi"], arrays["Xi"])
    again = ea.models.load_image_et(tmp_path / "again.npz", image_shape=(1, 8, 8), patch_size=4)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_image_et_writes_exactly_the_path_atomically(tmp_path, getkey):
    model = tiny_model(getkey(), num_memories=5)
    ea.models.save_image_et(tmp_path / "weights.bin", model)  # no ".npz" appended
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]
    with np.load(tmp_path / "weights.bin") as saved:
        assert saved["Xi"].shape == (8, 5)  # (D, M)
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        ea.models.save_image_et(tmp_path / "no-such-folder" / "m.npz", model)
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        ea.models.save_image_et(tmp_path, model)


def test_save_image_et_stores_the_settings_load_image_et_needs_none(tmp_path, getkey):
    """The demo's `model.npz` reloads with no shapes to repeat: the file carries the
    constructor's hyperparameters next to the weights; given ones still override them."""
    model = tiny_model(
        getkey(), beta=0.7, include_self=True, memory="softmax", step_size=0.05, num_steps=4
    )
    ea.models.save_image_et(tmp_path / "model.npz", model)
    back = ea.models.load_image_et(tmp_path / "model.npz")
    assert bool(eqx.tree_equal(back, model))  # the weights and the static settings
    assert back.transformer.beta == 0.7 and back.transformer.memory == "softmax"
    assert ea.models.load_image_et(tmp_path / "model.npz", num_steps=2).transformer.num_steps == 2
    # A file without them (the public layout, older files) takes the released model's.
    with np.load(tmp_path / "model.npz") as saved:
        np.savez(tmp_path / "old.npz", **{k: saved[k] for k in saved.files if k[0].isupper()})
    with pytest.raises(ValueError, match=r"Wenc must have shape \(768, 8\) for \(3, 224, 224\)"):
        ea.models.load_image_et(tmp_path / "old.npz")  # (3, 224, 224) in 16x16 patches
    old = ea.models.load_image_et(tmp_path / "old.npz", image_shape=(1, 8, 8), patch_size=2)
    assert old.transformer.include_self and old.transformer.num_steps == 12
    with np.load(tmp_path / "model.npz") as saved:
        np.savez(tmp_path / "bad.npz", **dict(saved, hyperparameters=np.asarray("[1, 2]")))
    with pytest.raises(ValueError, match="bad.npz'?: hyperparameters must be a JSON object"):
        ea.models.load_image_et(tmp_path / "bad.npz")


def test_save_image_et_names_what_it_saves(tmp_path, user_mode):
    with pytest.raises(TypeError, match="saves an energyattn.models.ImageEnergyTransformer, got"):
        ea.models.save_image_et(tmp_path / "x.npz", object())
    assert not (tmp_path / "x.npz").exists()


def test_load_npz_errors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = write_checkpoint_like_npz(tmp_path / "et.npz", rng)
    del arrays["memories"]
    with pytest.raises(ValueError, match=r"POS_embed must have shape \(17, 6\) .* got \(5, 6\)"):
        ea.models.load_image_et(tmp_path / "et.npz", image_shape=(4, 8, 8), patch_size=2)
    with pytest.raises(ValueError, match=r"et.npz'?: Wenc must have shape \(48, 6\)"):
        ea.models.load_image_et(tmp_path / "et.npz", image_shape=(3, 8, 8), patch_size=4)
    # The memories stored (M, D) instead of the public (D, M).
    np.savez(tmp_path / "mxd.npz", **dict(arrays, Xi=arrays["Xi"].T))
    with pytest.raises(ValueError, match=r"mxd.npz'?: Xi must have shape \(dim=6, memories\)"):
        ea.models.load_image_et(tmp_path / "mxd.npz", image_shape=(1, 8, 8), patch_size=4)
    # A bad Wq is named, not the arrays it disagrees with (D is what most arrays agree on).
    np.savez(tmp_path / "wq.npz", **dict(arrays, Wq=arrays["Wq"][..., :5]))
    with pytest.raises(ValueError, match=r"wq.npz'?: Wq must have shape \(\d+, \d+, 6\) .* got"):
        ea.models.load_image_et(tmp_path / "wq.npz", image_shape=(1, 8, 8), patch_size=4)
    del arrays["MASK_token"]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"bad.npz'? is missing the arrays \['MASK_token'\]"):
        ea.models.load_image_et(tmp_path / "bad.npz", image_shape=(1, 8, 8), patch_size=4)
    # Not an npz at all: a text file (np.load would try to unpickle it), a lone array.
    (tmp_path / "notes.npz").write_text("hello\n")
    with pytest.raises(ValueError, match=r"notes.npz'? is not an .npz file of Energy"):
        ea.models.load_image_et(tmp_path / "notes.npz", image_shape=(1, 8, 8), patch_size=4)
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"one.npy'? is not an .npz file .* single array"):
        ea.models.load_image_et(tmp_path / "one.npy", image_shape=(1, 8, 8), patch_size=4)


def test_bad_inputs(user_mode, getkey):
    with pytest.raises(
        ValueError, match=r"image of shape \(1, 8, 6\) .* divisible by patch_size=4"
    ):
        ea.models.ImageEnergyTransformer((1, 8, 6), 4, key=getkey())
    model = tiny_model(getkey())
    mask = jnp.zeros(16, bool)
    with pytest.raises(
        ValueError,
        match=r"image must have shape \(channels=1, height=8, width=8\), got \(3, 8, 8\)",
    ):
        model(jnp.zeros((3, 8, 8)), mask)
    with pytest.raises(ValueError, match=r"image must have shape .* got \(8, 8\)"):
        model(jnp.zeros((8, 8)), mask)
    with pytest.raises(ValueError, match=r"mask must have shape \(patches=16,\)"):
        model(jnp.zeros((1, 8, 8)), jnp.zeros(15, bool))
    with pytest.raises(ValueError, match="mask must be boolean"):
        model(jnp.zeros((1, 8, 8)), jnp.zeros(16, jnp.uint8))
    with pytest.raises(
        ValueError, match=r"image must have shape \(channels, height, width\), got \(8, 8\)"
    ):
        ea.data.patchify(jnp.zeros((8, 8)), 2)
    with pytest.raises(ValueError, match=r"image of shape \(1, 9, 8\)"):
        ea.data.patchify(jnp.zeros((1, 9, 8)), 2)
    images = jnp.zeros((10, 1, 8, 8))
    with pytest.raises(ValueError, match="cannot mask num_masked=20 patches"):
        ea.models.train_inpainting(
            model, images, key=getkey(), train_steps=1, num_masked=20, batch_size=2
        )
    with pytest.raises(
        ValueError, match=r"images must have shape \(n, channels=1, height=8, width=8\)"
    ):
        ea.models.train_inpainting(model, images[:, 0], key=getkey(), train_steps=1, num_masked=2)


def test_training_improves_held_out_inpainting():
    train = _training_images()
    test = jnp.asarray(ea.data.load_digits("test").images[:100, None])
    model = tiny_model(jr.key(0))
    settings = dict(num_masked=4, key=jr.key(2), mean_image=jnp.mean(train, axis=0))
    # Before: batches of 64, the last one padded; after: one batch of 100. The masks, so the
    # baseline, do not depend on the batches.
    before = ea.models.evaluate_inpainting(model, test, **settings, batch_size=64)
    trained = ea.models.train_inpainting(model, train, key=jr.key(1), **TRAINING, options=OPTIONS)
    after = ea.models.evaluate_inpainting(trained.model, test, **settings)
    assert after["baseline_mse"] == pytest.approx(before["baseline_mse"], rel=1e-6)
    assert after["mse"] < 0.5 * before["mse"]
    assert np.mean(trained.losses[-10:]) < np.mean(trained.losses[:10])


def test_shipped_trained_model_beats_mean_patch_baseline():
    """The demo's model trained longer (`python -m energyattn demo --train-steps 2500
    --batch-size 64`, seed 0), saved as tests/fixtures/et_digits.npz: on held-out digits
    with 4 of 16 patches masked its MSE is >= 30% below the baseline."""
    model = ea.models.load_image_et(
        FIXTURES / "et_digits.npz", image_shape=(1, 8, 8), patch_size=2, include_self=False
    )
    train = jnp.asarray(ea.data.load_digits("train").images[:, None])
    test = jnp.asarray(ea.data.load_digits("test").images[:, None])
    scores = ea.models.evaluate_inpainting(
        model,
        test,
        num_masked=4,
        key=jr.key(7),
        mean_image=jnp.mean(train, axis=0),
        batch_size=len(test),  # one compiled call (the scores do not depend on it)
    )
    print(scores)
    assert scores["ratio"] <= 0.7
