"""`energyattn classify`: deep implicit attention classifies shipped digits (or local MNIST)."""

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np


def run_classify_demo(
    out: str | Path,
    *,
    mnist: str | Path | None = None,
    train_steps: int = 3000,
    time_limit: float | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """Train a [`MeanFieldClassifier`][energyattn.models.MeanFieldClassifier] and evaluate it.

    On scikit-learn's 8x8 digits by default (fixed 80/20 split of
    [`load_digits`][energyattn.data.load_digits]); with `mnist` a local folder or `.npz`
    read by [`load_mnist`][energyattn.data.load_mnist] (28x28 images, 7x7 patches: 16 sites
    plus CLS). Writes `metrics.json` and the trained parameters (`model.eqx`) into `out`.

    **Returns:**

    The metrics: test accuracy, parameter count, training time, solver iterations.
    """
    from .data import load_digits, load_mnist
    from .models import MeanFieldClassifier, evaluate_classifier, train_classifier

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if mnist is None:
        train, test = load_digits("train"), load_digits("test")
        model = MeanFieldClassifier(key=jr.PRNGKey(seed))
        dataset = "digits (scikit-learn, 8x8)"
    else:
        train, test = load_mnist(mnist, "train"), load_mnist(mnist, "test")
        height, width = train.images.shape[1:]
        model = MeanFieldClassifier((1, height, width), patch_size=7, key=jr.PRNGKey(seed))
        dataset = f"MNIST from {mnist}"
    num_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    progress(
        f"{dataset}: {len(train.labels)} train / {len(test.labels)} test; {num_params} parameters"
    )
    began = time.perf_counter()
    result = train_classifier(
        model,
        np.asarray(train.images, np.float32),
        train.labels,
        key=jr.PRNGKey(seed + 1),
        num_steps=train_steps,
        batch_size=min(64, len(train.labels)),
        time_limit=time_limit,
        progress=progress_bar,
    )
    train_seconds = time.perf_counter() - began
    progress(f"trained {result.step} steps in {train_seconds:.1f} s")
    scores = evaluate_classifier(result.model, np.asarray(test.images, np.float32), test.labels)
    eqx.tree_serialise_leaves(out / "model.eqx", result.model)
    metrics = {
        "dataset": dataset,
        "num_parameters": int(num_params),
        "train_steps": int(result.step),
        "train_seconds": train_seconds,
        "final_train_loss": float(result.losses[-1]) if result.losses.size else None,
        "test": scores,
        "seed": seed,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
