"""`energyattn classify`: deep implicit attention classifies shipped digits (or local MNIST)."""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.random as jr
import numpy as np

from ..models import TrainOptions
from . import interrupt
from .common import (
    add_command,
    add_shared_flags,
    check_out,
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


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "classify",
        help="classify shipped digits (or local MNIST) with deep implicit attention",
        description=(
            "Train a MeanFieldClassifier (convolutional patch embedding, a CLS site, a neural "
            "mean-field fixed point solved by Anderson and differentiated implicitly, a linear "
            "head) on scikit-learn's shipped 8x8 digits, or on MNIST files you downloaded "
            "yourself (--mnist PATH: IDX files or mnist.npz; nothing is ever downloaded). Prints "
            "test accuracy, parameter count, training time and solver iterations; writes "
            "metrics.json and model.eqx into --out."
        ),
    )
    parser.add_argument(
        "--mnist",
        default=None,
        metavar="PATH",
        help="a local MNIST folder (IDX files) or mnist.npz (default: the shipped 8x8 digits)",
    )
    add_shared_flags(
        parser,
        train_steps=(3000, "optimisation steps"),
        time_limit=(None, "stop training after this many seconds"),
        seed="seed of weights and batches",
        progress="the progress bar",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn classify`: run `run_classify_demo`, print the scores."""
    print(f"energyattn classify: deep implicit attention, seed {args.seed}")
    metrics = run(
        "classify",
        parser,
        run_classify_demo,
        args.out,
        mnist=args.mnist,
        overwrite=args.overwrite,
        train_steps=args.train_steps,
        seed=args.seed,
        options=training_options(args),
        progress=say,
    )
    if metrics is None:
        return 1
    test = metrics["test"]
    print()
    print(f"test accuracy: {test['accuracy']:.4f} ({metrics['num_parameters']} parameters)")
    print(
        f"fixed-point iterations: mean {test['mean_steps']:.1f}, max {test['max_steps']:.0f}; "
        f"converged {test['converged']:.1%}"
    )
    print(f"training: {plural(metrics['train_steps'], 'step')} in {metrics['train_seconds']:.1f} s")
    print(f"files in {args.out}")
    return 0


def run_classify_demo(
    out: str | Path,
    *,
    mnist: str | Path | None = None,
    train_steps: int = 3000,
    seed: int = 0,
    options: TrainOptions = TrainOptions(),
    progress: Callable[[str], None] = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train a [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier] and evaluate it.

    On scikit-learn's 8x8 digits by default (fixed 80/20 split of
    [`load_digits`][energyattn.data.load_digits]); with `mnist` a local folder or `.npz`
    read by [`load_mnist`][energyattn.data.load_mnist] (28x28 images, 7x7 patches: 16 sites
    plus CLS). Writes `metrics.json` and the trained parameters (`model.eqx`) into `out`
    (checked writable before the data are read, created when training starts; the files of
    an earlier run there are replaced only with `overwrite`). `options` are the training's
    [`TrainOptions`][energyattn.models.TrainOptions].

    **Returns:**

    The metrics: test accuracy, parameter count, training time, solver iterations.
    """
    from .._io import atomic_output
    from ..data import Digits, Mnist, load_digits, load_mnist
    from ..models import MeanFieldClassifier, evaluate_classifier, train_classifier

    out = check_out(out, "model.eqx", "metrics.json", overwrite=overwrite)
    train: Digits | Mnist
    test: Digits | Mnist
    if mnist is None:
        train, test = load_digits("train"), load_digits("test")
        model = MeanFieldClassifier(key=jr.PRNGKey(seed))
        dataset = "digits (scikit-learn, 8x8)"
    else:
        train, test = load_mnist(mnist, "train"), load_mnist(mnist, "test")
        height, width = train.images.shape[1:]
        model = MeanFieldClassifier((1, height, width), patch_size=7, key=jr.PRNGKey(seed))
        dataset = f"MNIST from {mnist}"
    num_params = num_parameters(model)
    progress(
        f"{dataset}: {len(train.labels)} train / {len(test.labels)} test; {num_params} parameters"
    )
    make_out(out)
    began = time.perf_counter()
    with interrupt.training():
        result = train_classifier(
            model,
            np.asarray(train.images, np.float32),
            train.labels,
            key=jr.PRNGKey(seed + 1),
            train_steps=train_steps,
            batch_size=min(64, len(train.labels)),
            options=options,
        )
    train_seconds = time.perf_counter() - began
    stopped = stop_note(result, train_steps, options.time_limit)
    if stopped:
        progress(stopped)
    scores = evaluate_classifier(result.model, np.asarray(test.images, np.float32), test.labels)
    with atomic_output(out / "model.eqx") as partial:
        eqx.tree_serialise_leaves(partial, result.model)
    metrics = {
        "dataset": dataset,
        "num_parameters": int(num_params),
        "train_steps_planned": train_steps,
        "train_steps": int(result.step),
        "stopped_by": stopped_by(result),
        "time_limit": options.time_limit,
        "train_seconds": train_seconds,
        "final_train_loss": float(result.losses[-1]) if result.losses.size else None,
        "test": scores,
        "seed": seed,
    }
    write_metrics(out / "metrics.json", metrics)
    return metrics
