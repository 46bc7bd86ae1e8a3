"""Renamed arguments keep working for one release: the old name gives the new one's result,
with a `DeprecationWarning` that names the new name; both at once is a `TypeError`. The
trainers' option keywords gather into `options=ea.models.TrainOptions(...)` alike."""

import jax
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


SPIN_MODEL_TRANSFORMER = {
    "smt_gamma": "gamma",
    "smt_phi": "magnetization",
    "smt_phi_inverse": "inverse_magnetization",
    "smt_tap_update": "tap_field",
    "smt_steady_state": "steady_state",
    "smt_magnetizations": "steady_magnetizations",
}


@pytest.mark.parametrize(("old", "new"), SPIN_MODEL_TRANSFORMER.items())
def test_spin_model_transformer_functions_are_in_ea_spin_smt(old, new):
    with pytest.warns(
        DeprecationWarning, match=rf"ea\.spin\.{old} is deprecated: use ea\.spin\.smt\.{new}$"
    ):
        assert getattr(ea.spin, old) is getattr(ea.spin.smt, new)


@pytest.mark.parametrize("name", ea.spin.mean_field.__all__)
def test_mean_field_maps_are_in_ea_spin_mean_field(name):
    match = rf"ea\.{name} is deprecated: use ea\.spin\.mean_field\.{name}$"
    with pytest.warns(DeprecationWarning, match=match):
        assert getattr(ea, name) is getattr(ea.spin.mean_field, name)


def test_moved_names_import_and_unknown_names_do_not():
    with pytest.warns(DeprecationWarning, match="use ea.spin.mean_field.naive_mean_field"):
        from energyattn import naive_mean_field
    assert naive_mean_field is ea.spin.mean_field.naive_mean_field
    with pytest.raises(AttributeError, match="module 'energyattn.spin' has no attribute 'smt_x'"):
        ea.spin.smt_x  # noqa: B018


def _spin_system():
    J = jnp.array([[0.0, 0.2, -0.1], [0.2, 0.0, 0.3], [-0.1, 0.3, 0.0]])
    H = jnp.array([[0.5, -0.2], [0.1, 0.4], [-0.3, 0.2]])
    return J, H


POSITIONAL_BETA = {
    # name: (the call with beta by keyword, the same call with beta by position)
    "ea.spin.phi": (
        lambda J, H, t: ea.spin.phi(t, J, H, beta=0.7),
        lambda J, H, t: ea.spin.phi(t, J, H, 0.7),
    ),
    "ea.spin.phi_grad": (
        lambda J, H, t: ea.spin.phi_grad(t, J, H, beta=0.7, mode="vector"),
        lambda J, H, t: ea.spin.phi_grad(t, J, H, 0.7, mode="vector"),
    ),
    "ea.spin.phi_hessian": (
        lambda J, H, t: ea.spin.phi_hessian(t, J, H, beta=0.7),
        lambda J, H, t: ea.spin.phi_hessian(t, J, H, 0.7),
    ),
    "ea.spin.neumann_series": (
        lambda J, H, t: ea.spin.neumann_series(t, J, H, beta=0.7, num_terms=3),
        lambda J, H, t: ea.spin.neumann_series(t, J, H, 0.7, num_terms=3),
    ),
    "ea.spin.PhiEnergy": (
        lambda J, H, t: ea.spin.PhiEnergy(J, H, beta=0.7)(t),
        lambda J, H, t: ea.spin.PhiEnergy(J, H, 0.7)(t),
    ),
    "ea.spin.saddle_point": (
        lambda J, H, t: ea.spin.saddle_point(J, H, beta=0.7, t0=t).value,
        lambda J, H, t: ea.spin.saddle_point(J, H, 0.7, t).value,
    ),
    "ea.spin.log_partition": (
        lambda J, H, t: ea.spin.log_partition(J, H, beta=0.7, t0=t),
        lambda J, H, t: ea.spin.log_partition(J, H, 0.7, t0=t),
    ),
    "ea.spin.free_energy": (
        lambda J, H, t: ea.spin.free_energy(J, H, beta=0.7),
        lambda J, H, t: ea.spin.free_energy(J, H, 0.7),
    ),
    "ea.spin.magnetizations": (
        lambda J, H, t: ea.spin.magnetizations(J, H, beta=0.7, t0=t),
        lambda J, H, t: ea.spin.magnetizations(J, H, 0.7, t),
    ),
    "ea.nn.VectorSpinAttention": (
        lambda J, H, t: ea.nn.VectorSpinAttention(3, 2, beta=0.7, key=jr.key(0))(H),
        lambda J, H, t: ea.nn.VectorSpinAttention(3, 2, 0.7, key=jr.key(0))(H),
    ),
    "ea.nn.HopfieldHeadsEnergy": (
        lambda J, H, t: ea.nn.HopfieldHeadsEnergy(H[None], beta=jnp.ones(1), mask=None)(H[None]),
        lambda J, H, t: ea.nn.HopfieldHeadsEnergy(H[None], jnp.ones(1), None)(H[None]),
    ),
    "ea.ExponentialSeparation": (
        lambda J, H, t: ea.ExponentialSeparation(beta=0.7)(H),
        lambda J, H, t: ea.ExponentialSeparation(0.7)(H),
    ),
}


@pytest.mark.parametrize("name", POSITIONAL_BETA)
def test_beta_by_position_still_works(name):
    """`beta` is keyword-only; by position it gives the same result, with a warning."""
    J, H = _spin_system()
    t = jnp.array([1.2, 1.3, 1.1])
    new, old = POSITIONAL_BETA[name]
    expected = new(J, H, t)
    match = rf"^{name}: passing beta (and \w+ )?by position is deprecated: pass beta=\.\.\."
    with pytest.warns(DeprecationWarning, match=match):
        _same(old(J, H, t), expected)


def test_keyword_only_beta_under_jit_and_vmap():
    """The decorated functions keep their (new) signature for `jax.jit`'s static names, and
    an old positional call still works, and warns, under `jax.jit` and `jax.vmap`."""
    J, H = _spin_system()
    ts = np.array([[1.2, 1.3, 1.1], [1.4, 1.2, 1.5]])
    phi = jax.jit(ea.spin.phi, static_argnames="mode")
    expected = jax.vmap(lambda t: phi(t, J, H, beta=0.7))(ts)
    with pytest.warns(DeprecationWarning, match="pass beta=... by keyword"):
        _same(jax.vmap(lambda t: phi(t, J, H, 0.7))(ts), expected)
    with pytest.raises(TypeError, match="missing .*required .*argument: 'beta'"):
        ea.spin.phi(ts[0], J, H)
    with pytest.raises(TypeError, match="positional"):
        ea.spin.saddle_point(J, H, 0.7, beta=0.7)  # beta twice: Python's own error


def test_spin_plots_take_beta_by_keyword(tmp_path):
    pytest.importorskip("matplotlib")
    J, H = _spin_system()
    with pytest.warns(DeprecationWarning, match=r"plot_spin_phi: passing beta by position"):
        path = ea.viz.plot_spin_phi(J, H, 0.7, tmp_path / "phi.png", num_points=8)
    assert path.exists()
