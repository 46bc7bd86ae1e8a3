"""What every plot shares: a figure on its own Agg canvas, an atomic save, input checks."""

import os
import pathlib
from typing import Any

import numpy as np


def new_figure(**kwargs: Any) -> Any:
    """A matplotlib `Figure` on its own Agg canvas, or an `ImportError` saying what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "energyattn.viz needs matplotlib: pip install matplotlib (or, in a checkout of "
            "energyattn: pip install '.[examples]')"
        ) from error
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def save(figure: Any, path: str | os.PathLike, title: str | None, *, fontsize: int) -> pathlib.Path:
    """Title, lay out and write a figure (format from the suffix of `path`, PNG without one),
    atomically: an interrupted save never leaves a truncated file at `path`."""
    from .._io import atomic_output

    if title:
        figure.suptitle(title, fontsize=fontsize)
    figure.tight_layout()
    path = pathlib.Path(path)
    with atomic_output(path) as partial:
        figure.savefig(
            partial,
            dpi=100,
            format=path.suffix.lstrip(".").lower() or "png",
            bbox_inches="tight",  # never clip a label that tight_layout left outside
            pad_inches=0.08,
        )
    return path


def check_named_arrays(what: str, arrays: Any, ndim: int, dims: str) -> dict[str, np.ndarray]:
    if not isinstance(arrays, dict) or not arrays:
        raise ValueError(f"{what} must be a non-empty dict of name -> array")
    out = {}
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.ndim != ndim:
            raise ValueError(f"{what}[{name!r}] must have shape ({dims}), got {array.shape}")
        out[str(name)] = array.astype(np.float64)
    return out
