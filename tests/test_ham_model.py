"""`ea.models.HAMClassifier` (a hierarchical associative memory on digits), its same-size
feedforward baseline, the `energyattn ham` command and its figure.

The models here have the configuration of the command's tiny run below (2 channels, 2
descent steps, float32), so the programs compiled for the first tests are reused by it.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import energyattn as ea
from energyattn import viz
from energyattn._cli import main
from energyattn._cli.ham import _descents
from energyattn.data import load_digits

# The command's tiny run below: 2 feature channels, 2 descent steps, float32, seed 0, a
# learning rate large enough that one step shows. The first tests use exactly its models and
# settings, so the command reuses the programs they compiled (the file's time budget is tight).
TINY = dict(channels=2, num_steps=2, dtype=jnp.float32)
CLI_TINY = ["--train-steps", "2", "--channels", "2", "--descent-steps", "2"]
CLI_TINY += ["--learning-rate", "0.1", "--no-progress"]


def _num_params(model):
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def _rises(energies):
    """The step changes of an energy beyond rounding (positive where it rose)."""
    energies = np.asarray(energies, np.float64)
    return np.diff(energies) - 1e-5 * (1 + np.abs(energies[..., :-1]))


@pytest.fixture(scope="module")
def digits():
    train, test = load_digits("train"), load_digits("test")
    return (
        np.asarray(train.images, np.float32)[:, None],
        train.labels,
        np.asarray(test.images, np.float32)[:, None],
        test.labels,
    )


def test_shapes_same_size_and_a_descending_energy(digits):
    model = ea.models.HAMClassifier(key=jr.PRNGKey(0), **TINY)
    baseline = ea.models.FeedforwardClassifier(channels=2, dtype=jnp.float32, key=jr.PRNGKey(0))
    assert model.ham.neurons["features"].shape == (2, 4, 4)
    assert model.image_shape == baseline.image_shape == (1, 8, 8)
    assert model.num_classes == baseline.num_classes == 10
    assert _num_params(model) == _num_params(baseline) == 2 * 16 + 2 * 16 * 10 + 2 * 16 + 10
    # The same key, the same initial weights.
    np.testing.assert_array_equal(model.ham.synapses["dense"].weight, baseline.dense.weight)
    images = digits[2][:4]
    for net in (model, baseline):
        assert jax.eval_shape(net, images[0]).shape == (10,)
    solutions = _descents(model, images)
    assert set(solutions.value) == {"image", "features", "label"}
    np.testing.assert_array_equal(solutions.value["image"], images)  # clamped
    assert solutions.energies.shape == (4, 3)
    assert np.all(_rises(solutions.energies) <= 0)
    # The logits (beta x the label state) are the log of the label layer's activation.
    first = jax.tree.map(lambda x: x[0], solutions.value)
    g = model.ham.activations(first)["label"]
    np.testing.assert_allclose(jax.nn.softmax(model.beta * first["label"]), g, rtol=1e-6)

    # On every test digit (the command's evaluation).
    scores = ea.models.evaluate_ham_classifier(model, digits[2], digits[3])
    assert scores["non_increasing"] == 1.0 and scores["max_energy_increase"] < 0
    assert scores["mean_energy_drop"] > 0 and 0 <= scores["accuracy"] <= 0.3


@eqx.filter_jit
def _loss(model, images, labels):
    logits = jax.vmap(model)(images)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_training_through_the_descent_lowers_the_loss(digits):
    images, labels = digits[0], digits[1]
    model = ea.models.HAMClassifier(key=jr.PRNGKey(0), **TINY)
    result = ea.models.train_classifier(
        model,
        images,
        labels,
        key=jr.PRNGKey(1),
        train_steps=2,
        options=ea.models.TrainOptions(learning_rate=0.1, progress=False),
    )
    assert result.finished and result.losses.shape == (2,)
    # The first step is the warm-up's (learning rate 0), the second moves every weight.
    before = _loss(model, images[:64], labels[:64])
    after = _loss(result.model, images[:64], labels[:64])
    assert float(after) < float(before) - 0.01  # 2.300 -> 2.273 (2 descent steps: small logits)
    # Trained weights, the energy still falls at every step.
    assert np.all(_rises(_descents(result.model, digits[2][:4]).energies) <= 0)


def test_bad_input(user_mode):
    model = ea.models.HAMClassifier(key=jr.PRNGKey(0), **TINY)
    with pytest.raises(ValueError, match=r"image must have shape \(1, 8, 8\), got \(8, 8\)"):
        model(np.zeros((8, 8)))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        ea.models.evaluate_ham_classifier(model, np.zeros((2, 8, 8)), np.array([0, 10]))
    with pytest.raises(ValueError, match="images must have shape"):
        ea.models.train_classifier(
            model, np.zeros((2, 9, 9)), np.zeros(2, int), key=jr.PRNGKey(0), train_steps=1
        )
    with pytest.raises(ValueError, match="batch_size=8 exceeds"):
        ea.models.train_classifier(
            model,
            np.zeros((4, 8, 8)),
            np.zeros(4, int),
            key=jr.PRNGKey(0),
            train_steps=1,
            batch_size=8,
        )
    for kwargs, match in [
        ({"kernel_size": 12}, "does not fit"),
        ({"num_steps": 0}, "num_steps"),
        ({"step_size": 0.0}, "step_size"),
        ({"channels": 0}, "channels"),
        ({"image_shape": (8, 8)}, "image_shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            ea.models.HAMClassifier(key=jr.PRNGKey(0), **kwargs)
    with pytest.raises(ValueError, match="activations"):
        viz.plot_ham_descent({"a": np.zeros(3)}, {"x": np.zeros((1, 1, 1, 1))}, "unused.png")


def test_cli_ham_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    out = tmp_path / "ham"
    assert main(["ham", "--out", str(out), *CLI_TINY]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["test"]) == {"ham", "feedforward", "untrained_ham", "majority"}
    counts = metrics["num_parameters"]
    assert counts["ham"] == counts["feedforward"] == counts["untrained_ham"] == 394
    assert metrics["train_steps"] == {"ham": 2, "feedforward": 2}
    assert metrics["test"]["ham"]["non_increasing"] == 1.0
    for name, scores in metrics["test"].items():
        assert 0 <= scores["accuracy"] <= 1
        assert f"{scores['accuracy']:.4f}" in printed, name
    assert "majority class" in printed and "energy fell at every descent step" in printed
    figure = imread(out / "descent.png")
    assert figure.ndim == 3 and figure.shape[1] > figure.shape[0] and figure.std() > 0.05
    for name in ("ham.eqx", "feedforward.eqx"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob(".*partial*"))
