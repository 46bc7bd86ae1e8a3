"""`energyattn spin-transformer`: a spin-model transformer classifies the shipped digits, next
to a softmax transformer and the mean-field classifier with the same front end, trained in the
same run."""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

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

MODELS = ("spin_transformer", "softmax", "mean_field")
#: An attention mixer, as `ea.models.AttentionClassifier` takes it (imported lazily).
Mixer = Literal["spin_transformer", "softmax"]
TITLES = {
    "spin_transformer": "spin-model transformer",
    "softmax": "softmax attention",
    "mean_field": "mean-field (deep implicit attention)",
}


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "spin-transformer",
        help="a spin-model transformer against softmax and mean-field attention on digits",
        description=(
            "Train three classifiers of the shipped 8x8 digits that differ only in their token "
            "mixer (the same convolutional patch embedding, CLS site, linear head, optimiser, "
            "batches and seed): the spin-model transformer (steady-state magnetizations of "
            "vector spins with softmax couplings, solved by Anderson and differentiated "
            "implicitly), softmax attention, and deep implicit attention (mean field). Prints "
            "each test accuracy next to its untrained control and the majority class; writes "
            "metrics.json and training_loss.png into --out."
        ),
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        metavar="MODEL",
        help=f"the models to train, of {', '.join(MODELS)}",
    )
    add_shared_flags(
        parser,
        train_steps=(800, "optimisation steps of each model"),
        time_limit=(None, "cap on each model's training time"),
        seed="seed of weights and batches",
        progress="the progress bars",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn spin-transformer`: run `run_smt_demo`, print one line per model."""
    print(f"energyattn spin-transformer: {len(args.models)} classifiers, seed {args.seed}")
    metrics = run(
        "spin-transformer",
        parser,
        run_smt_demo,
        args.out,
        overwrite=args.overwrite,
        train_steps=args.train_steps,
        models=tuple(args.models),
        seed=args.seed,
        options=training_options(args),
        progress=say,
    )
    if metrics is None:
        return 1
    print()
    print(f"majority class: test accuracy {metrics['majority_class_accuracy']:.4f}")
    for name, model in metrics["models"].items():
        test = model["test"]
        # Softmax attention is one pass: it has no solver, hence no solver steps to report.
        solver = "no solver" if name == "softmax" else f"solver steps mean {test['mean_steps']:.1f}"
        print(
            f"{TITLES[name]:38s} test accuracy {test['accuracy']:.4f} (untrained "
            f"{model['untrained_test']['accuracy']:.4f}), {model['num_parameters']} parameters, "
            f"{plural(model['train_steps'], 'step')} in {model['train_seconds']:.1f} s, {solver}"
        )
    print(f"files in {args.out}")
    return 0


def _smoothed(losses: np.ndarray, window: int) -> np.ndarray:
    window = max(1, min(window, losses.size))
    return np.convolve(losses, np.ones(window) / window, mode="valid")


def run_smt_demo(
    out: str | Path,
    *,
    train_steps: int = 800,
    models: tuple[str, ...] = MODELS,
    dim: int = 24,
    num_heads: int = 4,
    patch_size: int = 2,
    seed: int = 0,
    options: TrainOptions = TrainOptions(),
    progress: Callable[[str], None] = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train each model of `models` on scikit-learn's 8x8 digits (fixed 80/20 split) with the
    same front end (convolutional patch embedding, a CLS site, a linear head on its output),
    the same optimiser, steps, batches and seed; only the token mixer differs:
    [`AttentionClassifier`][energyattn.models.AttentionClassifier] with the spin-model
    transformer or softmax attention, and the
    [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier]. Controls in the same run:
    each model untrained, and the majority class.

    Writes `metrics.json` and `training_loss.png` into `out` (checked writable before any
    work, created when training starts; the files of an earlier run there are replaced
    only with `overwrite`). `options` are each model's
    [`TrainOptions`][energyattn.models.TrainOptions] (a `time_limit` caps each model's
    training).

    **Returns:**

    The metrics: per model the test accuracy trained and untrained, parameters, training
    time, solver iterations; the majority-class accuracy.
    """
    from .. import viz
    from ..data import load_digits
    from ..models import (
        AttentionClassifier,
        MeanFieldClassifier,
        evaluate_classifier,
        train_classifier,
    )

    unknown = set(models) - set(MODELS)
    if unknown or not models:
        raise ValueError(f"models must be a non-empty subset of {MODELS}, got {models!r}")
    # Before minutes of training:
    out = check_out(out, "training_loss.png", "metrics.json", overwrite=overwrite)
    train, test = load_digits("train"), load_digits("test")
    train_images = np.asarray(train.images, np.float32)
    test_images = np.asarray(test.images, np.float32)
    majority = float(np.mean(test.labels == np.argmax(np.bincount(train.labels))))
    progress(
        f"digits (scikit-learn, 8x8): {len(train.labels)} train / {len(test.labels)} test; "
        f"majority class {majority:.3f}"
    )
    metrics: dict[str, Any] = {
        "dataset": "digits (scikit-learn, 8x8)",
        "majority_class_accuracy": majority,
        "train_steps": train_steps,
        "time_limit": options.time_limit,
        "seed": seed,
        "models": {},
    }
    curves = {}
    make_out(out)
    for name in models:
        key = jr.PRNGKey(seed)
        model: MeanFieldClassifier | AttentionClassifier
        if name == "mean_field":
            model = MeanFieldClassifier(patch_size=patch_size, dim=dim, key=key)
        else:
            mixer = cast(Mixer, name)  # one of MODELS: checked above
            model = AttentionClassifier(
                mixer, patch_size=patch_size, dim=dim, num_heads=num_heads, key=key
            )
        num_params = num_parameters(model)
        untrained = evaluate_classifier(model, test_images, test.labels)
        planned = plural(train_steps, "step")
        progress(f"{TITLES[name]}: {num_params} parameters; training {planned}")
        began = time.perf_counter()
        with interrupt.training():
            result = train_classifier(
                model,
                train_images,
                train.labels,
                key=jr.PRNGKey(seed + 1),
                train_steps=train_steps,
                options=options,
            )
        seconds = time.perf_counter() - began
        scores = evaluate_classifier(result.model, test_images, test.labels)
        losses = np.asarray(result.losses)
        stopped = stop_note(result, train_steps, options.time_limit)
        done = stopped or f"trained {plural(result.step, 'step')}"
        progress(f"{TITLES[name]}: {done} ({seconds:.1f} s)")
        curves[TITLES[name]] = _smoothed(losses, 25)
        metrics["models"][name] = {
            "num_parameters": num_params,
            "train_steps": int(result.step),
            "stopped_by": stopped_by(result),
            "train_seconds": seconds,
            "final_train_loss": float(np.mean(losses[-25:])) if losses.size else None,
            "test": scores,
            "untrained_test": untrained,
        }
    curves["chance (log 10)"] = np.array([np.log(10.0)])
    viz.plot_curves(
        {"training loss (moving average of 25 steps)": curves},
        out / "training_loss.png",
        xlabel="step",
        ylabel="cross-entropy",
    )
    write_metrics(out / "metrics.json", metrics)
    return metrics
