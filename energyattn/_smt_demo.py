"""`energyattn spin-transformer`: a spin-model transformer classifies the shipped digits, next
to a softmax transformer and the mean-field classifier with the same front end, trained in the
same run."""

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

MODELS = ("spin_transformer", "softmax", "mean_field")
TITLES = {
    "spin_transformer": "spin-model transformer",
    "softmax": "softmax attention",
    "mean_field": "mean-field (deep implicit attention)",
}


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
    time_limit: float | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """Train each model of `models` on scikit-learn's 8x8 digits (fixed 80/20 split) with the
    same front end (convolutional patch embedding, a CLS site, a linear head on its output),
    the same optimiser, steps, batches and seed; only the token mixer differs:
    [`AttentionClassifier`][energyattn.models.AttentionClassifier] with the spin-model
    transformer or softmax attention, and the
    [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier]. Controls in the same run:
    each model untrained, and the majority class.

    Writes `metrics.json` and `training_loss.png` into `out` (checked writable before any
    training). `time_limit` caps each model's training (seconds).

    **Returns:**

    The metrics: per model the test accuracy trained and untrained, parameters, training
    time, solver iterations; the majority-class accuracy.
    """
    from . import viz
    from .data import load_digits
    from .models import (
        AttentionClassifier,
        MeanFieldClassifier,
        evaluate_classifier,
        train_classifier,
    )

    unknown = set(models) - set(MODELS)
    if unknown or not models:
        raise ValueError(f"models must be a non-empty subset of {MODELS}, got {models!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    probe = out / ".write_test"
    probe.write_text("")  # fail now, not after minutes of training
    probe.unlink()
    train, test = load_digits("train"), load_digits("test")
    train_images = np.asarray(train.images, np.float32)
    test_images = np.asarray(test.images, np.float32)
    majority = float(np.mean(test.labels == np.bincount(train.labels).argmax()))
    progress(
        f"digits (scikit-learn, 8x8): {len(train.labels)} train / {len(test.labels)} test; "
        f"majority class {majority:.3f}"
    )
    metrics: dict[str, Any] = {
        "dataset": "digits (scikit-learn, 8x8)",
        "majority_class_accuracy": majority,
        "train_steps": train_steps,
        "seed": seed,
        "models": {},
    }
    curves = {}
    for name in models:
        key = jr.PRNGKey(seed)
        if name == "mean_field":
            model = MeanFieldClassifier(patch_size=patch_size, dim=dim, key=key)
        else:
            model = AttentionClassifier(
                name, patch_size=patch_size, dim=dim, num_heads=num_heads, key=key
            )
        params = eqx.filter(model, eqx.is_inexact_array)
        num_params = int(sum(x.size for x in jax.tree.leaves(params)))
        untrained = evaluate_classifier(model, test_images, test.labels)
        progress(f"{TITLES[name]}: {num_params} parameters; training {train_steps} steps")
        began = time.perf_counter()
        result = train_classifier(
            model,
            train_images,
            train.labels,
            key=jr.PRNGKey(seed + 1),
            num_steps=train_steps,
            time_limit=time_limit,
            progress=progress_bar,
        )
        seconds = time.perf_counter() - began
        scores = evaluate_classifier(result.model, test_images, test.labels)
        losses = np.asarray(result.losses)
        progress(
            f"{TITLES[name]}: test accuracy {scores['accuracy']:.4f} "
            f"(untrained {untrained['accuracy']:.4f}), {result.step} steps in {seconds:.1f} s"
        )
        curves[TITLES[name]] = _smoothed(losses, 25)
        metrics["models"][name] = {
            "num_parameters": num_params,
            "train_steps": int(result.step),
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
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
