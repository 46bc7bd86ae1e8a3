"""`energyattn ham`: a hierarchical associative memory classifies shipped digits, next to a
feedforward network of the same size, its own untrained initialisation and the majority
class."""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ..models import TrainOptions
from . import interrupt
from .common import (
    POSITIVE,
    add_command,
    add_shared_flags,
    check_out,
    int_at_least,
    make_out,
    num_parameters,
    plural,
    run,
    say,
    stop_note,
    stopped_by,
    training_options,
    write_metrics,
)

#: The rows of the printed table and the keys of metrics.json's "test", in order.
MODELS = ("ham", "feedforward", "untrained_ham", "majority")
TITLES = {
    "ham": "HAM (trained through its descent)",
    "feedforward": "feedforward baseline, same size",
    "untrained_ham": "HAM, untrained (control)",
    "majority": "majority class (trivial)",
}


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "ham",
        help="a hierarchical associative memory classifies shipped digits",
        description=(
            "Train a HAMClassifier on scikit-learn's shipped 8x8 digits: an image layer "
            "clamped to the pixels, a convolutional ReLU feature layer and a softmax label "
            "layer, one energy, trained by backpropagating through a fixed number of descent "
            "steps. In the same run, with the same batches: a feedforward network with the "
            "same weights (conv, ReLU, dense: the same parameter count), the HAM at its "
            "initialisation and the majority class. Prints test accuracies, parameter counts "
            "and times, and whether the energy fell at every descent step; writes "
            "metrics.json, ham.eqx, feedforward.eqx and descent.png (energy against descent "
            "step; the layers' activations) into --out."
        ),
    )
    parser.add_argument(
        "--descent-steps",
        type=int_at_least(1),
        default=10,
        metavar="T",
        help="descent steps of the HAM's forward pass (backpropagated through)",
    )
    parser.add_argument(
        "--step-size", type=POSITIVE, default=0.5, metavar="DT", help="the descent's time step"
    )
    parser.add_argument(
        "--channels", type=int_at_least(1), default=16, metavar="C", help="feature channels"
    )
    add_shared_flags(
        parser,
        train_steps=(2000, "optimisation steps of each model"),
        time_limit=(None, "stop training each model after this many seconds"),
        batch_size=(64, "examples per step"),
        learning_rate=(3e-3, "peak learning rate"),
        seed="seed of weights and batches",
        progress="the progress bars",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn ham`: run `run_ham_demo`, print the scores."""
    print(f"energyattn ham: a hierarchical associative memory on digits, seed {args.seed}")
    metrics = run(
        "ham",
        parser,
        run_ham_demo,
        args.out,
        flags="--step-size and --learning-rate",
        overwrite=args.overwrite,
        train_steps=args.train_steps,
        descent_steps=args.descent_steps,
        step_size=args.step_size,
        channels=args.channels,
        batch_size=args.batch_size,
        seed=args.seed,
        options=training_options(args),
        progress=say,
    )
    if metrics is None:
        return 1
    test = metrics["test"]
    print()
    print(f"test accuracy ({metrics['num_test']} held-out digits):")
    for name in MODELS:
        parameters = metrics["num_parameters"].get(name)
        size = f"{parameters} parameters" if parameters is not None else "no model"
        print(f"  {TITLES[name]:<36} {test[name]['accuracy']:.4f}  ({size})")
    ham = test["ham"]
    print(
        f"energy fell at every descent step on {ham['non_increasing']:.1%} of the test digits "
        f"(largest step change {ham['max_energy_increase']:.3g}); "
        f"{metrics['descent_steps']} steps of size {metrics['step_size']:g}"
    )
    seconds = metrics["train_seconds"]
    print(
        f"training: {plural(metrics['train_steps']['ham'], 'step')} in {seconds['ham']:.1f} s "
        f"(HAM), {plural(metrics['train_steps']['feedforward'], 'step')} in "
        f"{seconds['feedforward']:.1f} s (feedforward)"
    )
    print(f"files in {args.out}")
    return 0


@eqx.filter_jit
def _descents(model: Any, images: Any) -> Any:
    """The descents of a batch of images (`Solution`s stacked)."""
    return jax.vmap(model.descend)(images)


def run_ham_demo(
    out: str | Path,
    *,
    train_steps: int = 2000,
    descent_steps: int = 10,
    step_size: float = 0.5,
    channels: int = 16,
    batch_size: int = 64,
    seed: int = 0,
    options: TrainOptions = TrainOptions(),
    progress: Callable[[str], None] = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train a [`HAMClassifier`][energyattn.models.HAMClassifier] and its same-size
    [`FeedforwardClassifier`][energyattn.models.FeedforwardClassifier] on the shipped digits
    (fixed 80/20 split of [`load_digits`][energyattn.data.load_digits]), with the same
    initial weights, batches and optimiser (`options`, a
    [`TrainOptions`][energyattn.models.TrainOptions]), and evaluate them next to two controls
    of the same run: the HAM at its initialisation and the training set's majority class.

    Writes `metrics.json`, the trained models (`ham.eqx`, `feedforward.eqx`) and
    `descent.png` (the energy against the descent step for four test digits; the layers'
    activations at the end of the first one's descent) into `out`, checked writable before
    the data are read and created when training starts (the files of an earlier run there
    are replaced only with `overwrite`).

    **Returns:**

    The metrics: per model the test accuracy (for the HAMs also how the energy behaved
    along the descents, see [`evaluate_ham_classifier`][energyattn.models.evaluate_ham_classifier]),
    parameter counts, training steps and times.
    """
    from .. import viz
    from .._io import atomic_output
    from ..data import load_digits
    from ..models import (
        FeedforwardClassifier,
        HAMClassifier,
        evaluate_ham_classifier,
        train_classifier,
    )

    names = ("ham.eqx", "feedforward.eqx", "descent.png", "metrics.json")
    out = check_out(out, *names, overwrite=overwrite)  # before any data or compilation
    train, test = load_digits("train"), load_digits("test")
    train_images = np.asarray(train.images, np.float32)[:, None]
    test_images = np.asarray(test.images, np.float32)[:, None]
    shape: dict[str, Any] = dict(channels=channels, dtype=jnp.float32, key=jr.PRNGKey(seed))
    untrained = HAMClassifier(num_steps=descent_steps, step_size=step_size, **shape)
    models = {"ham": untrained, "feedforward": FeedforwardClassifier(**shape)}
    counts = {name: num_parameters(model) for name, model in models.items()}
    counts["untrained_ham"] = counts["ham"]
    progress(
        f"digits (scikit-learn, 8x8): {len(train.labels)} train / {len(test.labels)} test; "
        f"{counts['ham']} parameters in each model"
    )

    metrics: dict[str, Any] = {
        "dataset": "digits (scikit-learn, 8x8)",
        "num_train": len(train.labels),
        "num_test": len(test.labels),
        "feature_shape": list(untrained.ham.neurons["features"].shape),
        "descent_steps": descent_steps,
        "step_size": step_size,
        "num_parameters": counts,
        "train_steps_planned": train_steps,
        "time_limit": options.time_limit,
        "seed": seed,
        "train_steps": {},
        "train_seconds": {},
        "final_train_loss": {},
        "stopped_by": {},
        "test": {},
    }
    trained = {}
    make_out(out)
    for name, model in models.items():
        began = time.perf_counter()
        with interrupt.training():
            result = train_classifier(
                model,
                train_images,
                train.labels,
                key=jr.PRNGKey(seed + 1),  # the same batches for both models
                train_steps=train_steps,
                batch_size=min(batch_size, len(train.labels)),
                options=options,
            )
        seconds = time.perf_counter() - began
        trained[name] = result.model
        stopped = stop_note(result, train_steps, options.time_limit)
        metrics["train_steps"][name] = int(result.step)
        metrics["train_seconds"][name] = seconds
        metrics["final_train_loss"][name] = float(result.losses[-1]) if result.losses.size else None
        metrics["stopped_by"][name] = stopped_by(result)
        progress(f"{TITLES[name]}: {plural(result.step, 'step')} in {seconds:.1f} s")
        if stopped:
            progress(stopped)
        with atomic_output(out / f"{name}.eqx") as partial:
            eqx.tree_serialise_leaves(partial, result.model)

    test_metrics = metrics["test"]
    test_metrics["ham"] = evaluate_ham_classifier(trained["ham"], test_images, test.labels)
    test_metrics["feedforward"] = evaluate_ham_classifier(
        trained["feedforward"], test_images, test.labels
    )
    test_metrics["untrained_ham"] = evaluate_ham_classifier(untrained, test_images, test.labels)
    majority = int(np.argmax(np.bincount(train.labels)))
    test_metrics["majority"] = {
        "accuracy": float(np.mean(test.labels == majority)),
        "class": majority,
    }

    # The figure: the trained HAM's energy along the descents of four test digits, and the
    # layers' activations at the end of the first one's.
    ham = trained["ham"]
    shown = test_images[:4]
    solutions = _descents(ham, shown)
    energies = np.asarray(solutions.energies)
    first = ham.ham.activations(jax.tree.map(lambda x: x[0], solutions.value))
    activations = {  # bottom-up; the image layer has one channel
        f"image (test 0, a {int(test.labels[0])})": np.asarray(first["image"][0]),
        "features": np.asarray(first["features"]),
        "label (red: the prediction)": np.asarray(first["label"]),
    }
    curves = {
        f"digit {int(label)} (test {i})": energies[i] for i, label in enumerate(test.labels[:4])
    }
    viz.plot_ham_descent(
        curves,
        activations,
        out / "descent.png",
        title=(
            f"HAM descent on test digits ({descent_steps} steps of size {step_size:g}); "
            "right: the layers after test 0's descent"
        ),
    )
    metrics["figure_energies"] = {name: [float(v) for v in curve] for name, curve in curves.items()}
    write_metrics(out / "metrics.json", metrics)
    return metrics
