"""Curves against a step: energies along a descent, errors against an iteration."""

import os
import pathlib
from typing import Any

import numpy as np

from ._figure import check_named_arrays, new_figure, save


def plot_energies(
    curves: dict[str, Any],
    path: str | os.PathLike,
    *,
    xlabel: str = "step",
    ylabel: str = "energy",
    title: str | None = None,
    separate: bool = False,
) -> pathlib.Path:
    """Write a PNG of energy curves, energy against step (e.g. `Solution.energies`).

    **Arguments:**

    - `curves`: an ordered dict mapping each curve's label to its values, shape `(steps,)`;
      value $t$ is drawn at step $t$ (so `energies[0]` is the initial state).
    - `path`: the file to write.
    - `xlabel`, `ylabel`: axis labels.
    - `title`: optional figure title.
    - `separate`: draw each curve in its own panel (for energies of different models, whose
      scales differ) instead of all on one set of axes.

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    curves = check_named_arrays("curves", curves, 1, "steps")
    from matplotlib.ticker import MaxNLocator

    num_panels = len(curves) if separate else 1
    figure = new_figure(figsize=(1.0 + 3.6 * num_panels, 3.4))
    axes = figure.subplots(1, num_panels, squeeze=False)[0]
    for i, (label, values) in enumerate(curves.items()):
        ax = axes[i if separate else 0]
        ax.plot(np.arange(values.shape[0]), values, marker="o", markersize=3, label=label)
        if separate:
            ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if not separate:
        axes[0].legend(fontsize=9)
    return save(figure, path, title, fontsize=11)


def plot_curves(
    panels: dict[str, dict[str, Any]],
    path: str | os.PathLike,
    *,
    xlabel: str = "iteration t",
    ylabel: str = "MSE",
    title: str | None = None,
    logy: bool = False,
) -> pathlib.Path:
    """Write a PNG with one panel per entry of `panels`, each holding labelled curves.

    A curve's value $t$ is drawn at $x = t$. A curve of a single value is drawn as a dashed
    horizontal line (a model that is not iterated, or a reference level).

    **Arguments:**

    - `panels`: an ordered dict mapping each panel's title to an ordered dict of
      label -> values of shape `(steps,)`.
    - `path`: the file to write.
    - `xlabel`, `ylabel`, `title`: labels.
    - `logy`: logarithmic y axis.

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    if not isinstance(panels, dict) or not panels:
        raise ValueError("panels must be a non-empty dict of title -> {label: values}")
    checked = {
        name: check_named_arrays(f"panels[{name!r}]", curves, 1, "steps")
        for name, curves in panels.items()
    }
    from matplotlib.ticker import MaxNLocator

    figure = new_figure(figsize=(1.0 + 4.2 * len(checked), 3.6))
    axes = figure.subplots(1, len(checked), squeeze=False)[0]
    for ax, (name, curves) in zip(axes, checked.items(), strict=True):
        longest = max(values.shape[0] for values in curves.values())
        for label, values in curves.items():
            if values.shape[0] == 1:
                ax.plot([0, max(longest - 1, 1)], [values[0], values[0]], "--", label=label)
            else:
                ax.plot(np.arange(values.shape[0]), values, marker="o", markersize=2.5, label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(figure, path, title, fontsize=11)
