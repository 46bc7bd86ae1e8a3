"""Figures of energy-based transformers: error against thinking steps, completions with the
energy of each generated token along its descent."""

import os
import pathlib
from typing import Any

import numpy as np

from ._figure import new_figure, save


def plot_thinking(
    panels: dict[str, dict[str, Any]],
    path: str | os.PathLike,
    *,
    trained_steps: int | None = None,
    title: str | None = "does more thinking lower the error?",
) -> pathlib.Path:
    """Write a PNG of held-out error against thinking steps, one panel per task.

    Each panel's dict holds (the layout of `energyattn ebt`'s `metrics.json`): `"ebt"` and
    `"ebt_untrained"`, each `{steps: error}`; optionally `"ebt_verified"`, `{candidates:
    error}` (the best is drawn as a star at `trained_steps`); and reference levels drawn as
    horizontal lines, `"feed_forward"` and `"mean_row"`. Both axes are logarithmic.

    **Arguments:**

    - `panels`: panel title -> numbers, as above.
    - `path`: the file to write.
    - `trained_steps`: the steps used in training, shaded (optional).
    - `title`: the figure's title.

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    if not isinstance(panels, dict) or not panels:
        raise ValueError("panels must be a non-empty dict of title -> numbers")
    for name, numbers in panels.items():
        for needed in ("ebt", "ebt_untrained"):
            if not isinstance(numbers.get(needed), dict) or not numbers[needed]:
                raise ValueError(f"panels[{name!r}] needs {needed!r}: a dict of steps -> error")
    figure = new_figure(figsize=(1.0 + 4.3 * len(panels), 3.8))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (name, numbers) in zip(axes, panels.items(), strict=True):
        steps = sorted(int(s) for s in numbers["ebt"])
        value = {int(s): v for s, v in numbers["ebt"].items()}
        untrained = {int(s): v for s, v in numbers["ebt_untrained"].items()}
        ax.plot(steps, [value[s] for s in steps], "o-", label="EBT (trained)")
        ax.plot(
            steps,
            [untrained[s] for s in steps if s in untrained],
            "s:",
            color="grey",
            label="EBT (untrained)",
        )
        verified = numbers.get("ebt_verified")
        if verified and trained_steps is not None:
            best = min(verified, key=verified.get)
            ax.plot(
                [trained_steps],
                [verified[best]],
                "*",
                markersize=11,
                label=f"EBT, best of {best} candidates",
            )
        if "feed_forward" in numbers:
            ax.axhline(numbers["feed_forward"], color="C3", ls="--", label="feed-forward")
        if "mean_row" in numbers:
            ax.axhline(numbers["mean_row"], color="k", ls="-.", label="mean training row")
        if trained_steps is not None:
            ax.axvline(trained_steps, color="C0", alpha=0.25, lw=6, label="steps in training")
        ax.set_xscale("log", base=2)
        ax.set_xticks(steps, [str(s) for s in steps])
        ax.set_yscale("log")
        ax.set_xlabel("thinking steps")
        ax.set_ylabel("held-out MSE per pixel")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="upper right")
    return save(figure, path, title, fontsize=11)


def plot_completions(
    rows: dict[str, Any],
    energies: Any,
    path: str | os.PathLike,
    *,
    given: int,
    title: str | None = None,
) -> pathlib.Path:
    """Write a PNG of completed images, one column per example, with the energy of each
    generated row along its thinking below.

    **Arguments:**

    - `rows`: label -> images `(n, height, width)` in [0, 1] (e.g. the held-out digits and
      two models' completions); a red line marks the first `given` rows.
    - `energies`: `(n, generated rows, steps + 1)`, the energy of each generated row at every
      thinking step.
    - `path`: the file to write.
    - `given`: how many rows were given.
    - `title`: the figure's title (default: says what is drawn).

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    images = {label: np.asarray(a, np.float64) for label, a in rows.items()}
    energies = np.asarray(energies, np.float64)
    n = energies.shape[0]
    if energies.ndim != 3 or any(a.ndim != 3 or a.shape[0] != n for a in images.values()):
        raise ValueError(
            "rows must hold (n, height, width) images and energies (n, rows, steps) for the "
            f"same n, got {[a.shape for a in images.values()]} and {energies.shape}"
        )
    figure = new_figure(figsize=(1.35 * n + 0.8, 1.55 * (len(images) + 1.3)))
    ratios = [1] * len(images) + [1.3]
    axes = figure.subplots(len(images) + 1, n, squeeze=False, gridspec_kw={"height_ratios": ratios})
    for c in range(n):
        for r, (label, stack) in enumerate(images.items()):
            ax = axes[r, c]
            ax.imshow(stack[c], cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            ax.axhline(given - 0.5, color="#e8202a", lw=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(label, fontsize=9)
        ax = axes[-1, c]
        for i, curve in enumerate(energies[c]):
            ax.plot(curve, lw=1, label=f"row {given + i}")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=6)
        if c == 0:
            ax.set_ylabel("energy $e_t$", fontsize=9)
    axes[-1, -1].legend(fontsize=6)
    if title is None:
        title = (
            f"rows {given} onwards completed from the rows above the red line; below, each "
            "generated row's energy while thinking"
        )
    return save(figure, path, title, fontsize=10)
