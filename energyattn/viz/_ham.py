"""A hierarchical associative memory's descent: its energy against the step, and its layers."""

import os
import pathlib
from typing import Any

import numpy as np

from .._checks import positive_int
from ._figure import check_named_arrays, new_figure, save


def _check_activations(activations: Any) -> dict[str, np.ndarray]:
    if not isinstance(activations, dict) or not activations:
        raise ValueError("activations must be a non-empty dict of layer name -> array")
    out = {}
    for name, array in activations.items():
        array = np.asarray(array, dtype=np.float64)
        if array.ndim not in (1, 2, 3) or array.size == 0:
            raise ValueError(
                f"activations[{name!r}] must have shape (units,), (height, width) or "
                f"(channels, height, width), got {array.shape}"
            )
        out[str(name)] = array
    return out


def plot_ham_descent(
    energies: dict[str, Any],
    activations: dict[str, Any],
    path: str | os.PathLike,
    *,
    max_maps: int = 4,
    xlabel: str = "descent step",
    ylabel: str = "energy",
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of a hierarchical associative memory's descent: left, the energy
    against the step for a few inputs; right, one row per layer, its activations
    $g_\ell = \nabla L_\ell(x_\ell)$ (e.g. at the end of the descent).

    A layer's activations are drawn by their shape: a vector `(units,)` as a bar chart (a
    label layer: its bars are the class probabilities of a softmax layer, the largest one
    red, as its legend says), an image `(height, width)` as one grey-scale image, and
    `(channels, height, width)` as its first `max_maps` channels (one grey scale per layer,
    so the maps of a layer compare by brightness).

    **Arguments:**

    - `energies`: an ordered dict mapping each curve's label (e.g. an input) to the energy
      at every step, shape `(steps,)`, such as
      [`Solution.energies`][energyattn.Solution] of
      [`HAM.descend`][energyattn.ham.HAM.descend]; value $t$ is drawn at step $t$.
    - `activations`: an ordered dict mapping each layer's name to its activations, e.g.
      `ham.activations(solution.value)`.
    - `path`: the file to write.
    - `max_maps`: the most channels drawn per layer (default 4).
    - `xlabel`, `ylabel`, `title`: labels.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021); B. Hoover et al., HAMUX
        (github.com/bhoov/hamux).
    """
    curves = check_named_arrays("energies", energies, 1, "steps")
    layers = _check_activations(activations)
    max_maps = positive_int("max_maps", max_maps)
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    # Columns on the right: the most maps of any layer (at least 2, for the bar charts).
    columns = max([2, *(min(a.shape[0], max_maps) for a in layers.values() if a.ndim == 3)])
    height = max(3.4, 1.35 * len(layers) + (0.3 if title else 0))
    figure = new_figure(figsize=(4.4 + 1.3 * columns, height))
    # One grid (spans, no nested grids: tight_layout lays it out): the energy on the left
    # across every row, then per layer one row of `columns` cells.
    grid = figure.add_gridspec(len(layers), 1 + columns, width_ratios=[2.6, *[1.0] * columns])

    ax = figure.add_subplot(grid[:, 0])
    for label, values in curves.items():
        ax.plot(np.arange(values.shape[0]), values, marker="o", markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    for row, (name, array) in enumerate(layers.items()):
        if array.ndim == 1:
            bars = figure.add_subplot(grid[row, 1:])
            colours = ["#1f77b4"] * array.shape[0]
            colours[int(np.argmax(array))] = "#d62728"
            bars.bar(np.arange(array.shape[0]), array, color=colours)
            bars.legend(
                handles=[Patch(color="#d62728", label="largest")], fontsize=7, loc="upper right"
            )
            bars.set_xticks(np.arange(array.shape[0]))
            bars.tick_params(labelsize=7)
            bars.set_ylabel(name, fontsize=9)
            if np.all(array >= 0) and np.max(array) <= 1:
                bars.set_ylim(0, 1)
            continue
        maps = array[None] if array.ndim == 2 else array[:max_maps]
        finite = maps[np.isfinite(maps)]
        low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        for c in range(maps.shape[0]):
            image = figure.add_subplot(grid[row, 1 + c])
            image.imshow(maps[c], cmap="gray", vmin=low, vmax=high, interpolation="nearest")
            image.set_xticks([])
            image.set_yticks([])
            if array.ndim == 3 and array.shape[0] > 1:
                image.set_title(f"{name}[{c}]", fontsize=8)
            elif c == 0:
                image.set_title(name, fontsize=8)
    return save(figure, path, title, fontsize=11)
