"""Grids of small images."""

import os
import pathlib
from typing import Any

import numpy as np

from ._figure import check_named_arrays, new_figure, save


def image_grid(
    rows: dict[str, Any],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    vmin: float | int | None = None,
    vmax: float | int | None = None,
    cmap: str = "gray",
    missing_color: str = "#e8202a",
) -> pathlib.Path:
    """Write a PNG grid of small images: one labelled row per entry of `rows`.

    Useful to compare, column by column, stored patterns with their corrupted and retrieved
    versions. Rows may hold different numbers of images (missing cells stay blank). NaN
    pixels (e.g. the hidden patches of a masked image) are drawn in `missing_color`, a colour
    that no value of a grey-scale map takes.

    **Arguments:**

    - `rows`: an ordered dict mapping each row's label to images of shape `(n, height, width)`
      (NumPy or JAX arrays).
    - `path`: the file to write (its suffix picks the format, e.g. `.png`).
    - `title`: optional figure title.
    - `vmin`, `vmax`: the grey-scale range shared by all images. Leave them `None` to scale each
      row to its own range; set them (e.g. `-1, 1` for $\\pm1$ patterns) so that rows can be
      compared by brightness.
    - `cmap`: matplotlib colour map.
    - `missing_color`: the colour of NaN pixels (any matplotlib colour).

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    rows = check_named_arrays("rows", rows, 3, "n, height, width")
    num_cols = max(images.shape[0] for images in rows.values())
    if num_cols == 0:
        raise ValueError("rows must hold at least one image")
    height = 0.3 + 0.95 * len(rows) + (0.3 if title else 0)
    figure = new_figure(figsize=(1.0 + 0.9 * num_cols, height))
    axes = figure.subplots(len(rows), num_cols, squeeze=False)
    from matplotlib import colormaps

    colours = colormaps[cmap].with_extremes(bad=missing_color)
    for r, (label, images) in enumerate(rows.items()):
        finite = images[np.isfinite(images)]
        low = (np.min(finite) if finite.size else 0.0) if vmin is None else vmin
        high = (np.max(finite) if finite.size else 1.0) if vmax is None else vmax
        for c in range(num_cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < images.shape[0]:
                ax.imshow(images[c], cmap=colours, vmin=low, vmax=high, interpolation="nearest")
            else:
                ax.axis("off")
        axes[r, 0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize=9)
    return save(figure, path, title, fontsize=10)
