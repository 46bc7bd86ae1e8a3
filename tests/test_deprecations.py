"""Renamed arguments keep working for one release: the old name gives the new one's result,
with a `DeprecationWarning` that names the new name; both at once is a `TypeError`. The
trainers' option keywords gather into `options=ea.models.TrainOptions(...)` alike."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def _same(a, b):
    for x, y in zip(np.atleast_1d(a), np.atleast_1d(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_starts_are_y0():
    energy = ea.HopfieldEnergy(jnp.eye(3), beta=2.0)
    q = jnp.ones((2, 3)) * 0.3
    new = ea.descend(energy, y0=q, step_size=0.5, num_steps=2)
    with pytest.warns(DeprecationWarning, match=r"ea.descend\(x0=...\) is deprecated: use y0="):
        old = ea.descend(energy, x0=q, step_size=0.5, num_steps=2)
    _same(new.value, old.value)
    with pytest.raises(TypeError, match="got both 'y0' and its old name 'x0'"):
        ea.descend(energy, x0=q, y0=q, step_size=0.5, num_steps=2)

    def bowl(x, _):
        return jnp.sum((x - 1.0) ** 2)

    with pytest.warns(DeprecationWarning, match=r"ea.minimise\(x0=...\) is deprecated: use y0="):
        old = ea.minimise(bowl, x0=jnp.zeros(2))
    _same(ea.minimise(bowl, y0=jnp.zeros(2)).value, old.value)

    hopfield = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(jnp.array([[1.0, -1.0, 1.0]])))
    s = jnp.array([1.0, 1.0, 1.0])
    with pytest.warns(DeprecationWarning, match=r"sign_descend\(s0=...\) is deprecated: use y0="):
        old = ea.sign_descend(hopfield, s0=s, num_sweeps=1)
    _same(ea.sign_descend(hopfield, y0=s, num_sweeps=1).value, old.value)


@pytest.mark.parametrize("which", ["hopfield_attention", "energy_transformer"])
def test_layers_return_their_solution_under_return_solution(which):
    x = jr.normal(jr.key(0), (5, 8))
    if which == "hopfield_attention":
        layer = ea.nn.HopfieldAttention(8, num_heads=2, num_steps=2, key=jr.key(1))
    else:
        layer = ea.nn.EnergyTransformer(
            8, num_heads=2, head_dim=4, num_memories=4, num_steps=2, key=jr.key(1)
        )
    out, solution = layer(x, return_solution=True)
    with pytest.warns(DeprecationWarning, match=r"\(return_trajectory=...\) is deprecated: use "):
        old_out, old_solution = layer(x, return_trajectory=True)
    _same(out, old_out)
    _same(solution.energies, old_solution.energies)


def test_optimiser_steps_are_train_steps():
    new = ea.models.make_optimizer(1e-2, train_steps=10)
    with pytest.warns(DeprecationWarning, match=r"make_optimizer\(num_steps=...\) is deprecated"):
        old = ea.models.make_optimizer(1e-2, num_steps=10)
    assert new is old  # the same cached optimiser: the same schedule


def _trainer_call(name):
    """A call of the trainer `name` on tiny inputs, as `(function, args, kwargs)`."""
    images = jnp.zeros((4, 1, 4, 4))
    sequences = jnp.zeros((4, 3, 2))
    key = jr.key(0)
    if name == "train_inpainting":
        model = ea.models.ImageEnergyTransformer(
            (1, 4, 4), 2, dim=4, num_heads=1, head_dim=2, num_memories=3, num_steps=1, key=key
        )
        return ea.models.train_inpainting, (model, images), dict(num_masked=1)
    if name == "train_classifier":
        model = ea.models.AttentionClassifier(
            "softmax", (1, 4, 4), 2, 4, 3, num_heads=1, conv_channels=2, key=key
        )
        return ea.models.train_classifier, (model, images, jnp.arange(4) % 3), {}
    if name == "train_attractor":
        model = ea.models.AttractorImageModel((1, 4, 4), patch_size=2, dim=8, key=key)
        return ea.models.train_attractor, (model, images), {}
    if name == "train_reconstruction":
        model = ea.models.PatchTransformer((1, 4, 4), 2, 4, num_heads=1, hidden=4, key=key)
        return ea.models.train_reconstruction, (model, images), dict(task="masked")
    if name == "train_ebt":
        model = ea.models.EnergyBasedTransformer(2, 3, 4, num_heads=1, depth=1, key=key)
        return ea.models.train_ebt, (model, sequences), {}
    model = ea.models.CausalTransformer(2, 3, 4, num_heads=1, depth=1, key=key)
    return ea.models.train_next_token, (model, sequences), {}


TRAINERS = [
    "train_inpainting",
    "train_classifier",
    "train_attractor",
    "train_reconstruction",
    "train_ebt",
    "train_next_token",
]


@pytest.mark.parametrize("name", TRAINERS)
def test_every_trainer_takes_its_old_option_keywords(name):
    fn, args, kwargs = _trainer_call(name)
    # The warning comes first; the bad batch size then stops the call before any work.
    message = (
        rf"{name}\(learning_rate=..., progress=...\) is deprecated: pass "
        r"options=ea.models.TrainOptions\(learning_rate=..., progress=...\)"
    )
    with pytest.warns(DeprecationWarning, match=message) as caught:
        with pytest.raises(ValueError, match="batch_size"):
            fn(*args, key=jr.key(1), train_steps=1, batch_size=0, learning_rate=1e-2,
               progress=False, **kwargs)  # fmt: skip
    # Attributed to the caller (or the suite's type-checking wrapper), never to the decorator.
    assert not any(w.filename.endswith("_deprecated.py") for w in caught)
    options = ea.models.TrainOptions(clip_norm=2.0)
    with pytest.raises(TypeError, match="clip_norm= both as a keyword and in options="):
        fn(*args, key=jr.key(1), train_steps=1, clip_norm=3.0, options=options, **kwargs)


def test_option_keywords_give_the_options_result():
    model = ea.models.CausalTransformer(2, 3, 4, num_heads=1, depth=1, key=jr.key(0))
    sequences = jr.normal(jr.key(1), (8, 3, 2))
    settings = dict(key=jr.key(2), train_steps=2, batch_size=4)
    options = ea.models.TrainOptions(learning_rate=1e-2, progress=False)
    new = ea.models.train_next_token(model, sequences, **settings, options=options)
    with pytest.warns(DeprecationWarning, match="options=ea.models.TrainOptions"):
        old = ea.models.train_next_token(
            model, sequences, **settings, learning_rate=1e-2, progress=False
        )
    _same(new.losses, old.losses)
    # Keywords and options that set different fields combine; with num_steps= as well, each
    # old spelling warns once, neither from the decorators' file.
    with pytest.warns(DeprecationWarning) as caught:
        both = ea.models.train_next_token(
            model,
            sequences,
            key=jr.key(2),
            num_steps=2,
            batch_size=4,
            learning_rate=1e-2,
            options=ea.models.TrainOptions(progress=False),
        )
    _same(new.losses, both.losses)
    assert len(caught) == 2
    assert not any(w.filename.endswith("_deprecated.py") for w in caught)
    assert "use train_steps=" in str(caught[0].message)


def test_training_options_are_checked_and_hashable(user_mode):
    options = ea.models.TrainOptions(learning_rate=1e-2, time_limit=60)
    assert isinstance(options.time_limit, float)  # Python floats, whatever was passed
    assert options == ea.models.TrainOptions(learning_rate=0.01, time_limit=60.0)
    assert hash(options) == hash(ea.models.TrainOptions(learning_rate=0.01, time_limit=60.0))
    for bad, match in [
        (dict(learning_rate=0.0), "learning_rate must be > 0"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
        (dict(clip_norm=float("inf")), "clip_norm must be finite"),
        (dict(checkpoint_every=0), "checkpoint_every must be a positive integer"),
        (dict(warmup_steps=-1), "warmup_steps must be a non-negative integer"),
        (dict(time_limit=-1.0), "time_limit must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            ea.models.TrainOptions(**bad)
    with pytest.raises(TypeError, match="callback must be callable"):
        ea.models.TrainOptions(callback=3)
    with pytest.raises(TypeError, match="options must be an ea.models.TrainOptions"):
        model = ea.models.CausalTransformer(2, 3, 4, num_heads=1, depth=1, key=jr.key(0))
        ea.models.train_next_token(
            model,
            jnp.zeros((4, 3, 2)),
            key=jr.key(1),
            train_steps=1,
            batch_size=2,
            options={"progress": False},
        )
