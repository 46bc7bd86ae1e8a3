"""Energy landscapes in two dimensions, and bare self-attention over d_k and beta."""

import os
import pathlib
from typing import Any

import numpy as np

from ._figure import check_named_arrays, new_figure, save


def _landscape_points(name: str, points: Any, ndim: int, dims: str) -> np.ndarray | None:
    if points is None:
        return None
    points = np.asarray(points)
    if points.ndim != ndim or points.shape[-1] != 2:
        raise ValueError(
            f"{name} must have shape ({dims}, 2): the landscape is two-dimensional, "
            f"got {points.shape}"
        )
    return points.astype(np.float64)


def _check_landscape(
    energy: Any, trajectory: Any, memory: Any, outputs: Any
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    if not callable(energy):
        raise ValueError(f"energy must be a callable of one point of shape (2,), got {energy!r}")
    trajectory = _landscape_points("trajectory", trajectory, 3, "steps + 1, seq")
    memory = _landscape_points("memory", memory, 2, "mem")
    outputs = _landscape_points("outputs", outputs, 2, "seq")
    if outputs is not None and outputs.shape != trajectory.shape[1:]:
        raise ValueError(
            f"outputs must have shape {trajectory.shape[1:]} (one per state), got {outputs.shape}"
        )
    return trajectory, memory, outputs


def _landscape_extent(*point_sets: np.ndarray | None, margin: float = 0.15) -> tuple[float, ...]:
    points = np.concatenate([p.reshape(-1, 2) for p in point_sets if p is not None])
    points = points[np.all(np.isfinite(points), axis=1)]
    low, high = points.min(axis=0), points.max(axis=0)
    centre, half = (low + high) / 2, max(float(np.max(high - low)) / 2, 0.5) * (1 + margin)
    return (centre[0] - half, centre[0] + half, centre[1] - half, centre[1] + half)


_RED, _YELLOW = "#e8202a", "#ffd400"


def _arrows(ax: Any, starts: np.ndarray, ends: np.ndarray, colour: str, *, zorder: int) -> None:
    for start, end in zip(starts, ends, strict=True):
        ax.annotate(
            "",
            xy=end,
            xytext=start,
            zorder=zorder,
            arrowprops={"arrowstyle": "->", "color": colour, "lw": 0.9},
        )


def _crosses(ax: Any, points: np.ndarray, colour: str, label: str, *, zorder: int) -> None:
    ax.scatter(
        *points.T, s=40, marker="x", color=colour, linewidths=1.6, label=label, zorder=zorder
    )


def _draw_landscape(
    figure: Any,
    ax: Any,
    energy: Any,
    trajectory: np.ndarray,
    memory: np.ndarray | None,
    outputs: np.ndarray | None,
    extent: Any,
    num_points: int,
    colorbar: bool,
) -> None:
    import jax
    import jax.numpy as jnp

    from .._checks import positive_int

    num_points = positive_int("num_points", num_points, minimum=2)
    x0, x1, y0, y1 = _landscape_extent(trajectory, memory, outputs) if extent is None else extent
    if not (x0 < x1 and y0 < y1):
        raise ValueError(f"extent must be (xmin, xmax, ymin, ymax) with min < max, got {extent!r}")
    xs, ys = np.linspace(x0, x1, num_points), np.linspace(y0, y1, num_points)
    grid = np.stack(np.meshgrid(xs, ys, indexing="xy"), axis=-1).reshape(-1, 2)
    values = np.asarray(jax.jit(jax.vmap(energy))(jnp.asarray(grid, jnp.float32)), np.float64)
    if values.shape != (grid.shape[0],):
        raise ValueError(
            f"energy must map one point of shape (2,) to a scalar, got shape {values.shape[1:]}"
        )
    values = values.reshape(num_points, num_points)
    filled = ax.contourf(xs, ys, values, levels=24, cmap="viridis")
    ax.contour(xs, ys, values, levels=12, colors="white", linewidths=0.3, alpha=0.6)
    if colorbar:
        figure.colorbar(filled, ax=ax, label="energy", shrink=0.85)
    if memory is not None:
        ax.scatter(
            *memory.T,
            s=36,
            facecolors="none",
            edgecolors="#1f5fff",
            linewidths=1.4,
            label="stored patterns",
            zorder=3,
        )
    ax.scatter(*trajectory[0].T, s=22, color=_RED, label="initial states", zorder=4)
    for step in range(trajectory.shape[0] - 1):
        _arrows(ax, trajectory[step], trajectory[step + 1], _RED, zorder=4)
    steps = trajectory.shape[0] - 1
    _crosses(ax, trajectory[-1], _RED, f"after {steps} step(s)", zorder=5)
    if outputs is not None:
        _arrows(ax, trajectory[-1], outputs, _YELLOW, zorder=5)
        _crosses(ax, outputs, _YELLOW, "value-transformed", zorder=6)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_landscape(
    energy: Any,
    trajectory: Any,
    path: str | os.PathLike,
    *,
    memory: Any = None,
    outputs: Any = None,
    extent: tuple[float, float, float, float] | None = None,
    num_points: int = 120,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of a two-dimensional energy landscape with patterns descending it.

    Filled contours of the energy of one state pattern $x \in \mathbb R^2$, e.g. the
    log-sum-exp energy against stored patterns $M$,

    $$E(x) = \tfrac12\lVert x\rVert^2 - \frac1\beta\log\sum_j e^{\beta\, x\cdot m_j},$$

    with the stored patterns as blue open circles, the initial state patterns as red dots,
    red arrows along each pattern's trajectory and red crosses at its end; optional
    value-transformed outputs are yellow crosses, with yellow arrows from the final states.
    Because the log-sum-exp energy of several queries is a sum of one such term per query,
    the landscape of one point is the landscape every query descends.

    **Arguments:**

    - `energy`: a JAX-traceable callable mapping one point of shape `(2,)` to a scalar, e.g.
      `lambda x: ea.hopfield_energy(x[None], memory, beta=beta)`; it is evaluated on the grid
      with `jax.vmap`, in float32.
    - `trajectory`: the states, shape `(steps + 1, seq, 2)`, as `ea.descend(...,
      return_trajectory=True).trajectory` returns them.
    - `path`: the file to write.
    - `memory`: optional stored patterns, shape `(mem, 2)`.
    - `outputs`: optional value-transformed outputs, shape `(seq, 2)`.
    - `extent`: `(xmin, xmax, ymin, ymax)`; default: a square around every point drawn.
    - `num_points`: grid points per axis.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021),
        "Attention in flatland".
    """
    trajectory, memory, outputs = _check_landscape(energy, trajectory, memory, outputs)
    figure = new_figure(figsize=(6.0, 5.0))
    ax = figure.subplots()
    _draw_landscape(figure, ax, energy, trajectory, memory, outputs, extent, num_points, True)
    ax.legend(fontsize=7, loc="upper left", framealpha=0.8)
    return save(figure, path, title, fontsize=11)


def plot_landscapes(
    panels: dict[str, dict[str, Any]],
    path: str | os.PathLike,
    *,
    num_cols: int = 3,
    num_points: int = 100,
    title: str | None = None,
) -> pathlib.Path:
    """Write a PNG grid of energy landscapes, one panel per entry of `panels`.

    Each panel is drawn as by [`plot_landscape`][energyattn.viz.plot_landscape].

    **Arguments:**

    - `panels`: an ordered dict mapping each panel's title to a dict with the keys of
      `plot_landscape`: `energy` and `trajectory` (required), `memory`, `outputs`, `extent`
      (optional).
    - `path`: the file to write.
    - `num_cols`: panels per row.
    - `num_points`: grid points per axis in each panel.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.
    """
    from .._checks import positive_int

    if not isinstance(panels, dict) or not panels:
        raise ValueError("panels must be a non-empty dict of title -> plot_landscape arguments")
    allowed = {"energy", "trajectory", "memory", "outputs", "extent"}
    checked = {}
    for name, panel in panels.items():
        if not isinstance(panel, dict) or not {"energy", "trajectory"} <= set(panel):
            raise ValueError(f"panels[{name!r}] must be a dict with 'energy' and 'trajectory'")
        if set(panel) - allowed:
            raise ValueError(f"panels[{name!r}] has unknown keys {sorted(set(panel) - allowed)}")
        points = _check_landscape(
            panel["energy"], panel["trajectory"], panel.get("memory"), panel.get("outputs")
        )
        checked[name] = (panel["energy"], *points, panel.get("extent"))
    num_cols = min(positive_int("num_cols", num_cols), len(checked))
    num_rows = -(-len(checked) // num_cols)
    figure = new_figure(figsize=(4.2 * num_cols, 4.0 * num_rows + (0.4 if title else 0)))
    axes = figure.subplots(num_rows, num_cols, squeeze=False).ravel()
    for ax, (name, (energy, trajectory, memory, outputs, extent)) in zip(
        axes, checked.items(), strict=False
    ):
        _draw_landscape(figure, ax, energy, trajectory, memory, outputs, extent, num_points, False)
        ax.set_title(name, fontsize=10)
        if outputs is not None and ax is not axes[0]:  # the only panel with yellow crosses
            ax.legend(fontsize=7, loc="upper left", framealpha=0.8)
    for ax in axes[len(checked) :]:
        ax.axis("off")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(handles, labels, fontsize=7, loc="upper left", framealpha=0.8)
    return save(figure, path, title, fontsize=12)


def plot_displacement_contour(
    dims: Any,
    scales: Any,
    norms: dict[str, Any],
    path: str | os.PathLike,
    *,
    marks: tuple[float | int, ...] = (2, 512),
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of $\lVert X - X'\rVert$ of bare self-attention over $d_k$ and $\beta$-scale.

    Filled log-scale contours of the norms from
    [`self_attention_displacement`][energyattn.nn.self_attention_displacement], one panel per
    entry of `norms` (e.g. float32 and float64), with red lines at the transformer default
    scale $s = 1$ ($\beta = 1/\sqrt{d_k}$) and at the dimensions in `marks`. Cells whose norm is
    exactly 0 (the step is the identity to the last bit) are left blank, and a panel that has
    any says so in its corner.

    **Arguments:**

    - `dims`: the latent dimensions, shape `(num_dims,)`.
    - `scales`: the scale factors, shape `(num_scales,)`.
    - `norms`: an ordered dict mapping each panel's title to norms of shape
      `(num_scales, num_dims)`.
    - `path`: the file to write.
    - `marks`: dimensions to mark with vertical red lines.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021),
        "Bare self-attention experiment" (contour plot).
    """
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import LogLocator

    dims = np.asarray(dims, np.float64).reshape(-1)
    scales = np.asarray(scales, np.float64).reshape(-1)
    norms = check_named_arrays("norms", norms, 2, "num_scales, num_dims")
    for name, values in norms.items():
        if values.shape != (scales.size, dims.size):
            raise ValueError(
                f"norms[{name!r}] must have shape (num_scales={scales.size}, "
                f"num_dims={dims.size}), got {values.shape}"
            )
    figure = new_figure(figsize=(0.8 + 5.4 * len(norms), 4.4))
    axes = figure.subplots(1, len(norms), squeeze=False)[0]
    levels = np.logspace(-16, 2, 19)
    for ax, (name, values) in zip(axes, norms.items(), strict=True):
        masked = np.ma.masked_where(~(values > 0), values)
        filled = ax.contourf(
            dims,
            scales,
            masked,
            levels=levels,
            norm=LogNorm(vmin=levels[0], vmax=levels[-1]),
            cmap="viridis",
            extend="both",
        )
        figure.colorbar(
            filled,
            ax=ax,
            ticks=LogLocator(base=10, numticks=10),
            format="%.0e",
            label=r"$\|X - X'\|$",
        )
        for dim in marks:
            ax.axvline(dim, color="r", linewidth=1)
        ax.axhline(1.0, color="r", linewidth=1)
        ax.set_xlabel("$d_k$")
        ax.set_ylabel(r"scale $s$ ($\beta = s/\sqrt{d_k}$)")
        ax.set_title(name, fontsize=10)
        if not np.all(values > 0):
            ax.text(
                0.98,
                0.02,
                "white: exactly 0 (X' = X to the last bit)",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "0.6", "linewidth": 0.5},
            )
    return save(figure, path, title, fontsize=11)
