"""Training workflows that never lose work: any step count, divergence named, outputs checked
before training, checkpoints that refuse to load into the wrong model."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def tiny_et():
    return ea.models.ImageEnergyTransformer(
        (1, 4, 4), 2, dim=4, num_heads=1, head_dim=2, num_memories=3, num_steps=1, key=jr.key(0)
    )


def tiny_images(n=4, size=4):
    return jr.uniform(jr.key(9), (n, 1, size, size))


def train_tiny(name, num_steps, **options):
    options = ea.models.TrainOptions(progress=False, **options)
    settings = dict(key=jr.key(1), train_steps=num_steps, batch_size=2, options=options)
    if name == "inpainting":
        return ea.models.train_inpainting(tiny_et(), tiny_images(), num_masked=1, **settings)
    if name == "classifier":
        model = ea.models.AttentionClassifier(
            "softmax", (1, 4, 4), 2, 4, 3, num_heads=1, conv_channels=2, key=jr.key(0)
        )
        labels = jnp.arange(4) % 3
        return ea.models.train_classifier(model, tiny_images(), labels, **settings)
    model = ea.models.PatchTransformer((1, 4, 4), 2, 4, num_heads=1, hidden=4, key=jr.key(0))
    return ea.models.train_reconstruction(model, tiny_images(), task="masked", **settings)


# Two steps of train_inpainting run in the divergence test below (each step count compiles
# its own training step, so the slowest model is not compiled twice here).
@pytest.mark.parametrize(
    "name, num_steps",
    [("inpainting", 1), ("classifier", 1), ("classifier", 2), ("reconstruction", 1),
     ("reconstruction", 2)],
)  # fmt: skip
def test_one_and_two_steps_work(name, num_steps):
    result = train_tiny(name, num_steps)
    assert result.finished and result.step == num_steps
    assert result.losses.shape == (num_steps,)
    assert np.all(np.isfinite(result.losses))


def test_schedule_is_valid_for_every_step_count():
    for num_steps, warmup in [(1, None), (1, 5), (2, None), (3, 3)]:
        optimizer = ea.models.make_optimizer(
            1.0, train_steps=num_steps, warmup_steps=warmup, clip_norm=1e9, weight_decay=0.0
        )
        params = {"w": jnp.zeros(())}
        state = optimizer.init(params)
        update = jax.jit(optimizer.update)  # one compiled update, not op by op
        sizes = []
        for _ in range(num_steps):
            updates, state = update({"w": jnp.ones(())}, state, params)
            sizes.append(-float(updates["w"]))
        # The warm-up is clamped below num_steps: the peak is reached, one step runs at it.
        assert max(sizes) == pytest.approx(1.0, rel=1e-3), (num_steps, warmup, sizes)


def test_divergence_names_the_step_and_keeps_the_checkpoint(tmp_path):
    checkpoint = tmp_path / "run.eqx"
    images = tiny_images()
    first = ea.models.train_inpainting(
        tiny_et(), images, key=jr.key(1), train_steps=2, num_masked=1, batch_size=2,
        options=ea.models.TrainOptions(learning_rate=1e-2, checkpoint=checkpoint, progress=False),
    )  # fmt: skip
    assert first.finished and first.losses.shape == (2,)  # two steps work
    before = checkpoint.read_bytes()
    diverged = r"training diverged at step \d+ of 40: .* lower the learning rate"
    with pytest.raises(FloatingPointError, match=diverged):
        ea.models.train_inpainting(
            tiny_et(), images, key=jr.key(1), train_steps=40, num_masked=1, batch_size=2,
            options=ea.models.TrainOptions(learning_rate=1e6, clip_norm=1e30, progress=False),
        )  # fmt: skip
    # Resuming the finished 2-step checkpoint into a 40-step run that diverges: the
    # checkpoint (written at every step) is never replaced by NaN parameters.
    with pytest.raises(FloatingPointError, match="keeps the last finite state") as error:
        ea.models.train_inpainting(
            tiny_et(), images, key=jr.key(1), train_steps=40, num_masked=1, batch_size=2,
            options=ea.models.TrainOptions(
                learning_rate=1e6, clip_norm=1e30, checkpoint=checkpoint, checkpoint_every=1,
                progress=False,
            ),
        )  # fmt: skip
    assert "run.eqx" in str(error.value)
    state = ea.models.load_checkpoint(
        checkpoint,
        {
            "model": eqx.filter(first.model, eqx.is_inexact_array),
            "opt_state": ea.models.make_optimizer(1.0, train_steps=2).init(
                eqx.filter(first.model, eqx.is_inexact_array)
            ),
            "step": jnp.zeros((), jnp.int32),
        },
    )
    assert checkpoint.read_bytes() != before  # finite steps after the resume were saved
    assert int(state["step"]) > 2
    for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(leaf))


def test_bad_checkpoint_path_fails_before_training(tmp_path):
    steps = []

    def record(step, loss):
        steps.append(step)

    with pytest.raises(FileNotFoundError, match="/nonexistent-folder/x.eqx"):
        ea.models.train_inpainting(
            tiny_et(), tiny_images(), key=jr.key(1), train_steps=5, num_masked=1, batch_size=2,
            options=ea.models.TrainOptions(
                checkpoint="/nonexistent-folder/x.eqx", progress=False, callback=record
            ),
        )  # fmt: skip
    with pytest.raises(IsADirectoryError, match="is a folder"):
        train_tiny("classifier", 5, checkpoint=tmp_path, callback=record)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="file/x.eqx"):
        train_tiny("reconstruction", 5, checkpoint=tmp_path / "file" / "x.eqx")
    assert steps == []  # no training step ran before the path was refused
    with pytest.raises(FileNotFoundError, match="no-folder"):
        ea.models.save_checkpoint(tmp_path / "no-folder" / "c.eqx", {"w": jnp.ones(2)})


def test_checkpoint_round_trip_is_exact_and_atomic(tmp_path):
    tree = {"model": tiny_et(), "step": jnp.asarray(3, jnp.int32), "scale": 0.5}
    path = tmp_path / "ckpt"  # no suffix: written and read at exactly this path
    ea.models.save_checkpoint(path, tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    back = ea.models.load_checkpoint(path, tree)
    assert back["scale"] == 0.5 and int(back["step"]) == 3
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)


def test_mismatched_or_truncated_checkpoint_is_named(tmp_path):
    path = tmp_path / "run.eqx"
    small = {"model": tiny_et(), "step": jnp.asarray(1, jnp.int32)}
    ea.models.save_checkpoint(path, small)
    other = ea.models.ImageEnergyTransformer(
        (1, 4, 4), 2, dim=4, num_heads=1, head_dim=2, num_memories=5, num_steps=1, key=jr.key(0)
    )
    with pytest.raises(
        ValueError,
        match=r"run.eqx'? does not fit this model: model.transformer.memories has shape "
        r"\(3, 4\) and dtype float64 in the checkpoint but shape \(5, 4\) and dtype float64 here",
    ):
        ea.models.load_checkpoint(path, {"model": other, "step": jnp.asarray(0, jnp.int32)})
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, small)
    dtype_differs = r"model.embed_weight has shape \(4, 4\) and dtype float64 .* float32 here"
    with pytest.raises(ValueError, match=dtype_differs):
        ea.models.load_checkpoint(path, f32)
    with pytest.raises(ValueError, match="holds more arrays than the 1 expected"):
        ea.models.load_checkpoint(path, [jnp.zeros_like(small["model"].embed_weight)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"run.eqx'? is truncated or not a checkpoint"):
        ea.models.load_checkpoint(path, small)
    path.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match="is truncated or not a checkpoint"):
        ea.models.load_checkpoint(path, small)
    # The resume path of every train_* reports the same.
    with pytest.raises(ValueError, match="is truncated or not a checkpoint"):
        train_tiny("inpainting", 1, checkpoint=path)


def test_a_checkpoint_that_could_not_be_read_never_replaces_a_good_one(tmp_path, user_mode):
    path = tmp_path / "run.eqx"
    good = {"w": np.ones(3), "step": np.asarray(7)}
    ea.models.save_checkpoint(path, good)
    before = path.read_bytes()
    bad = {"w": np.array([object(), None], dtype=object), "step": np.asarray(8)}
    with pytest.raises(ValueError, match=r"cannot save w in a checkpoint.*dtype object"):
        ea.models.save_checkpoint(path, bad)
    assert path.read_bytes() == before
    assert int(ea.models.load_checkpoint(path, good)["step"]) == 7
    assert [p.name for p in tmp_path.iterdir()] == ["run.eqx"]  # no partial file left


def test_written_files_get_the_users_umask(tmp_path):
    # The atomic write goes through a private temporary file (mode 0600); the file it becomes
    # has the mode any new file of the user has.
    previous = os.umask(0o022)
    try:
        ea.models.save_checkpoint(tmp_path / "run.eqx", {"w": np.ones(2)})
    finally:
        os.umask(previous)
    assert (tmp_path / "run.eqx").stat().st_mode & 0o777 == 0o644
