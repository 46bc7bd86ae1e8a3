"""Plots written straight to image files (matplotlib is an optional extra).

matplotlib is imported lazily, inside each function, and figures are drawn on their own Agg
canvas: no `pyplot` state, no global backend switch, nothing shown on screen, so these
functions are safe in scripts, notebooks and tests alike.
"""

import os
import pathlib
from typing import Any

import numpy as np


def _figure(**kwargs: Any) -> Any:
    """A matplotlib `Figure` on its own Agg canvas, or an `ImportError` saying what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "energyattn.viz needs matplotlib: pip install 'energyattn[examples]'"
        ) from error
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def _save(
    figure: Any, path: str | os.PathLike, title: str | None, *, fontsize: int
) -> pathlib.Path:
    """Title, lay out and write a figure as PNG; return the path."""
    if title:
        figure.suptitle(title, fontsize=fontsize)
    figure.tight_layout()
    path = pathlib.Path(path)
    figure.savefig(path, dpi=100)
    return path


def _check_named_arrays(what: str, arrays: Any, ndim: int, dims: str) -> dict[str, np.ndarray]:
    if not isinstance(arrays, dict) or not arrays:
        raise ValueError(f"{what} must be a non-empty dict of name -> array")
    out = {}
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.ndim != ndim:
            raise ValueError(f"{what}[{name!r}] must have shape ({dims}), got {array.shape}")
        out[str(name)] = array.astype(np.float64)
    return out


def image_grid(
    rows: dict[str, Any],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str = "gray",
) -> pathlib.Path:
    """Write a PNG grid of small images: one labelled row per entry of `rows`.

    Useful to compare, column by column, stored patterns with their corrupted and retrieved
    versions. Rows may hold different numbers of images (missing cells stay blank).

    **Arguments:**

    - `rows`: an ordered dict mapping each row's label to images of shape `(n, height, width)`
      (NumPy or JAX arrays).
    - `path`: the file to write (its suffix picks the format, e.g. `.png`).
    - `title`: optional figure title.
    - `vmin`, `vmax`: the grey-scale range shared by all images. Leave them `None` to scale each
      row to its own range; set them (e.g. `-1, 1` for $\\pm1$ patterns) so that rows can be
      compared by brightness.
    - `cmap`: matplotlib colour map.

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    rows = _check_named_arrays("rows", rows, 3, "n, height, width")
    num_cols = max(images.shape[0] for images in rows.values())
    if num_cols == 0:
        raise ValueError("rows must hold at least one image")
    figure = _figure(figsize=(1.0 + 0.9 * num_cols, 0.3 + 0.95 * len(rows) + (0.3 if title else 0)))
    axes = figure.subplots(len(rows), num_cols, squeeze=False)
    for r, (label, images) in enumerate(rows.items()):
        low = np.min(images) if vmin is None else vmin
        high = np.max(images) if vmax is None else vmax
        for c in range(num_cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < images.shape[0]:
                ax.imshow(images[c], cmap=cmap, vmin=low, vmax=high, interpolation="nearest")
            else:
                ax.axis("off")
        axes[r, 0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
    return _save(figure, path, title, fontsize=10)


def plot_energies(
    curves: dict[str, Any],
    path: str | os.PathLike,
    *,
    xlabel: str = "step",
    ylabel: str = "energy",
    title: str | None = None,
    separate: bool = False,
) -> pathlib.Path:
    """Write a PNG of energy curves, energy against step (e.g. `Descent.energies`).

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
    curves = _check_named_arrays("curves", curves, 1, "steps")
    from matplotlib.ticker import MaxNLocator

    num_panels = len(curves) if separate else 1
    figure = _figure(figsize=(1.0 + 3.6 * num_panels, 3.4))
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
    return _save(figure, path, title, fontsize=11)
