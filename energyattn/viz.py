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
    vmin: float | int | None = None,
    vmax: float | int | None = None,
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


def _spin_system(J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
    """Checked couplings, fields and inverse temperature (see `energyattn.spin`)."""
    from ._energy._spin import check_system

    return check_system(J, H, beta)


_SPIN_PROGRAMS: dict[str, Any] = {}


def _spin_programs() -> dict[str, Any]:
    """The compiled computations behind the spin plots, built once (jit caches by shape)."""
    if _SPIN_PROGRAMS:
        return _SPIN_PROGRAMS
    import jax
    import jax.numpy as jnp

    from ._energy._spin import phi
    from .spin import saddle_point

    def curves(t: Any, J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
        def f(t: Any) -> Any:
            return phi(t, J, H, beta, mode="scalar")

        return f(t), jax.grad(f)(t), jax.grad(jax.grad(f))(t)

    def scalar_saddle(J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
        solution = saddle_point(J, H, beta, mode="scalar")
        phi_star = solution.stats["value"]
        # F = -log Z / beta with log Z = -(N/2)(1 + ln 2 beta) + phi(t*) (free_energy's formula,
        # without solving a second time).
        log_z = -0.5 * H.shape[0] * (1 + jnp.log(2 * beta)) + phi_star
        return solution.value, phi_star, -log_z / beta

    _SPIN_PROGRAMS.update(
        curves=jax.jit(jax.vmap(curves, in_axes=(0, None, None, None))),
        scalar_saddle=jax.jit(scalar_saddle),
        vector_saddle=jax.jit(lambda J, H, beta: saddle_point(J, H, beta).value),
        landscape=jax.jit(jax.vmap(phi, in_axes=(0, None, None, None))),
    )
    return _SPIN_PROGRAMS


def _phi_on_scalar_grid(J: Any, H: Any, beta: Any, ts: np.ndarray) -> dict[str, np.ndarray]:
    """Scalar-mode $\\varphi(t)$ and its first two derivatives on a grid (NaN off the domain)."""
    ts = np.asarray(ts, np.asarray(H).dtype)
    values, first, second = _spin_programs()["curves"](ts, J, H, beta)
    out = {"phi": np.asarray(values), "dphi": np.asarray(first), "d2phi": np.asarray(second)}
    domain = np.isfinite(out["phi"])
    return {name: np.where(domain, v, np.nan) for name, v in out.items()}


def _clip_ylim(ax: Any, *curves: np.ndarray, upper: float = 0.85) -> None:
    """Limit the y-axis to the bulk of the curves: near the edge of the domain they blow up."""
    values = np.concatenate([np.ravel(c) for c in curves])
    values = values[np.isfinite(values)]
    if values.size < 2:
        return
    low, high = (
        np.quantile(values, [1 - upper, upper])
        if np.min(values) < 0
        else (
            np.min(values),
            np.quantile(values, upper),
        )
    )
    pad = 0.08 * max(high - low, 1e-12)
    ax.set_ylim(low - pad, high + pad)


def _scalar_saddle(J: Any, H: Any, beta: Any) -> tuple[float, float, float]:
    """$t^*$, $\\varphi(t^*)$ and the free energy, in scalar mode."""
    t_star, phi_star, energy = _spin_programs()["scalar_saddle"](J, H, beta)
    return float(t_star), float(phi_star), float(energy)


def _t_grid(J: Any, t_star: float, t_range: Any, num_points: int) -> np.ndarray:
    from ._checks import positive_int

    num_points = positive_int("num_points", num_points, minimum=2)
    if t_range is None:
        edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])  # domain: t > edge
        t_range = (min(0.0, edge), t_star + 2.0 * (t_star - edge))
    low, high = (float(v) for v in t_range)
    if not low < high:
        raise ValueError(f"t_range must be (low, high) with low < high, got {t_range!r}")
    return np.linspace(low, high, num_points)


def plot_spin_phi(
    J: Any,
    H: Any,
    beta: float | int,
    path: str | os.PathLike,
    *,
    t_range: tuple[float, float] | None = None,
    num_points: int = 400,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of the AFEM function $\varphi(t)$ along one shared $t$, with its derivatives.

    $$\varphi(t) = \beta N t - \tfrac12\log\det(t I - J) + \tfrac\beta4
      \operatorname{Tr}\!\left(H^\top (tI - J)^{-1} H\right)$$

    Three panels: $\varphi$, $\varphi'$ and $\varphi''$ against $t$ (scalar mode of
    [`ea.spin.phi`][energyattn.spin.phi], derivatives by `jax.grad`). The saddle point $t^*$
    is marked, and so is the edge of the domain, $t = \lambda_{\max}(J)$: to its left
    $tI - J$ is not positive definite and $\varphi = +\infty$ (nothing is drawn), where the
    seed's plot shows the "terrifying" region near $t = 0$.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)`.
    - `H`: fields, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `path`: the file to write.
    - `t_range`: `(low, high)`; default from below the domain's edge to well past $t^*$.
    - `num_points`: grid size.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Fun with free energies" (sweep across the auxiliary variable).
    """
    J, H, beta = _spin_system(J, H, beta)
    t_star, _, _ = _scalar_saddle(J, H, beta)
    ts = _t_grid(J, t_star, t_range, num_points)
    curves = _phi_on_scalar_grid(J, H, beta, ts)
    edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])
    figure = _figure(figsize=(11.0, 3.4))
    axes = figure.subplots(1, 3)
    labels = {"phi": r"$\varphi(t)$", "dphi": r"$\varphi'(t)$", "d2phi": r"$\varphi''(t)$"}
    for ax, (name, label) in zip(axes, labels.items(), strict=True):
        ax.plot(ts, curves[name], color="C0")
        ax.axvline(t_star, color="C3", linestyle="--", linewidth=1, label=f"$t^*$ = {t_star:.3g}")
        ax.axvline(edge, color="0.5", linestyle=":", linewidth=1, label=r"$\lambda_{\max}(J)$")
        if name == "dphi":
            ax.axhline(0.0, color="0.7", linewidth=0.8)
        ax.set_xlabel("$t$")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        _clip_ylim(ax, curves[name])
    axes[0].legend(fontsize=8)
    return _save(figure, path, title, fontsize=11)


def plot_spin_beta_sweep(
    J: Any,
    H: Any,
    betas: Any,
    path: str | os.PathLike,
    *,
    t_range: tuple[float, float] | None = None,
    num_points: int = 400,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of a sweep over inverse temperature: $\varphi(t)$ per $\beta$, $t^*$ and $F$.

    $$\varphi_\beta(t) = \beta N t - \tfrac12\log\det(tI - J) + \tfrac\beta4
      \operatorname{Tr}\!\left(H^\top (tI - J)^{-1} H\right),
      \qquad F(\beta) = -\frac1\beta \log Z$$

    Left: one curve of $\varphi(t) - \varphi(t^*)$ (scalar mode) per $\beta$, shifted so that
    each curve's minimum, at $t^*(\beta)$ (marked), is 0: at small $\beta$ (high
    temperature) the entropy term $-\frac12\log\det$ dominates and $t^*$ is large, at large
    $\beta$ the energy terms take over. Right: $t^*$ and the free energy
    [`ea.spin.free_energy`][energyattn.spin.free_energy] (scalar mode) against $\beta$.
    Axes spanning more than a factor of 20 ($t$ on the left, $\beta$ on the right) are
    logarithmic.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)`.
    - `H`: fields, shape `(spins, dim)`.
    - `betas`: the inverse temperatures, a sequence of values $> 0$.
    - `path`: the file to write.
    - `t_range`: `(low, high)` for the left panel; default covers every $t^*(\beta)$.
    - `num_points`: grid size.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Fun with free energies" (sweep across inverse temperature).
    """
    betas = np.asarray(betas, np.float64).reshape(-1)
    if betas.size == 0 or not np.all(betas > 0):
        raise ValueError(f"betas must be a non-empty sequence of values > 0, got {betas}")
    J, H, _ = _spin_system(J, H, float(betas[0]))
    results = np.array([_scalar_saddle(J, H, np.asarray(b, H.dtype)) for b in betas])
    t_stars, phi_stars, energies = results.T
    if t_range is None:
        edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])
        t_range = (edge, float(t_stars.max()) + 2.0 * float(t_stars.max() - edge))
    low, high = (float(v) for v in t_range)
    if low > 0 and high / low > 20:  # t* spans decades: sample and draw t logarithmically
        if not low < high:
            raise ValueError(f"t_range must be (low, high) with low < high, got {t_range!r}")
        ts = np.geomspace(low, high, num_points)
    else:
        ts = _t_grid(J, float(t_stars.max()), t_range, num_points)
    figure = _figure(figsize=(10.0, 3.6))
    left, right = figure.subplots(1, 2)
    drawn = []
    for i, beta in enumerate(betas):
        phi = _phi_on_scalar_grid(J, H, np.asarray(beta, H.dtype), ts)["phi"] - phi_stars[i]
        left.plot(ts, phi, color=f"C{i % 10}", label=rf"$\beta$ = {beta:.3g}")
        left.plot(t_stars[i], 0.0, "o", color=f"C{i % 10}", markersize=4)
        drawn.append(phi)
    _clip_ylim(left, *drawn)
    if ts[0] > 0 and ts[-1] / ts[0] > 20:
        left.set_xscale("log")
    left.set_xlabel("$t$")
    left.set_ylabel(r"$\varphi(t) - \varphi(t^*)$")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.plot(betas, t_stars, marker="o", markersize=3, color="C0", label="$t^*$")
    right.set_xlabel(r"$\beta$")
    right.set_ylabel("$t^*$", color="C0")
    twin = right.twinx()
    twin.plot(betas, energies, marker="s", markersize=3, color="C3", label="$F$")
    twin.set_ylabel(r"free energy $F$", color="C3")
    if betas.min() > 0 and betas.max() / betas.min() > 20:
        right.set_xscale("log")
    right.grid(alpha=0.3)
    return _save(figure, path, title, fontsize=11)


def plot_spin_landscape(
    J: Any,
    H: Any,
    beta: float | int,
    path: str | os.PathLike,
    *,
    t_range: tuple[float, float] | None = None,
    num_points: int = 120,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of the two-spin landscape $\varphi(t_1, t_2)$ (vector mode).

    $$\varphi(t_1, t_2) = \beta (t_1 + t_2) - \tfrac12 \log\det V
      + \tfrac\beta4 \operatorname{Tr}\!\left(H^\top V^{-1}H\right),
      \qquad V = \begin{pmatrix} t_1 & -J_{12} \\ -J_{12} & t_2 \end{pmatrix}$$

    Filled contours of $\varphi$ over the region where $V \succ 0$ (blank elsewhere: the
    boundary is the hyperbola $t_1 t_2 = J_{12}^2$), with the saddle point $t^*$ from
    [`ea.spin.saddle_point`][energyattn.spin.saddle_point] marked.

    **Arguments:**

    - `J`: couplings of two spins, shape `(2, 2)`.
    - `H`: fields, shape `(2, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `path`: the file to write.
    - `t_range`: `(low, high)` for both axes; default from 0 to a few times $t^*$.
    - `num_points`: grid points per axis.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Fun with free energies" (two-dimensional auxiliary variables).
    """
    from ._checks import positive_int

    J, H, beta = _spin_system(J, H, beta)
    if H.shape[0] != 2:
        raise ValueError(f"the landscape needs exactly 2 spins, got H of shape {tuple(H.shape)}")
    num_points = positive_int("num_points", num_points, minimum=2)
    t_star = np.asarray(_spin_programs()["vector_saddle"](J, H, beta), np.float64)
    low, high = (0.0, 2.5 * float(t_star.max())) if t_range is None else t_range
    if not low < high:
        raise ValueError(f"t_range must be (low, high) with low < high, got {t_range!r}")
    axis = np.linspace(low, high, num_points)
    grid = np.stack(np.meshgrid(axis, axis, indexing="xy"), axis=-1).reshape(-1, 2)
    values = _spin_programs()["landscape"](grid.astype(H.dtype), J, H, beta)
    values = np.asarray(values, np.float64).reshape(num_points, num_points)
    values = np.where(np.isfinite(values), values, np.nan)
    finite = values[np.isfinite(values)]
    figure = _figure(figsize=(5.2, 4.4))
    ax = figure.subplots()
    if finite.size:
        # The landscape shoots up near the boundary of the domain: colour the bulk of it
        # (values above the 80th percentile share the top colour).
        low, high = float(finite.min()), float(np.quantile(finite, 0.8))
        levels = np.linspace(low, max(high, low + 1e-9), 21)
        clipped = np.minimum(values, levels[-1])
        filled = ax.contourf(axis, axis, clipped, levels=levels, cmap="viridis")
        ax.contour(axis, axis, clipped, levels=levels[::2], colors="white", linewidths=0.4)
        figure.colorbar(filled, ax=ax, label=r"$\varphi(t_1, t_2)$ (clipped)")
    ax.plot(*t_star, marker="*", color="C3", markersize=12, linestyle="none", label="$t^*$")
    ax.set_xlabel("$t_1$")
    ax.set_ylabel("$t_2$")
    ax.set_aspect("equal")
    ax.legend(fontsize=8, loc="upper right")
    return _save(figure, path, title, fontsize=11)


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
        name: _check_named_arrays(f"panels[{name!r}]", curves, 1, "steps")
        for name, curves in panels.items()
    }
    from matplotlib.ticker import MaxNLocator

    figure = _figure(figsize=(1.0 + 4.2 * len(checked), 3.6))
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
    return _save(figure, path, title, fontsize=11)


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

    from ._checks import positive_int

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
    figure = _figure(figsize=(6.0, 5.0))
    ax = figure.subplots()
    _draw_landscape(figure, ax, energy, trajectory, memory, outputs, extent, num_points, True)
    ax.legend(fontsize=7, loc="upper left", framealpha=0.8)
    return _save(figure, path, title, fontsize=11)


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
    from ._checks import positive_int

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
    figure = _figure(figsize=(4.2 * num_cols, 4.0 * num_rows + (0.4 if title else 0)))
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
    return _save(figure, path, title, fontsize=12)


_DISPLACEMENT: dict[Any, Any] = {}


def _displacement_program(num_patterns: int, max_dim: int, dtype: Any) -> Any:
    """One compiled program for the whole sweep: patterns padded to `max_dim` with zeros."""
    cache_key = (num_patterns, max_dim, np.dtype(dtype).name)
    if cache_key in _DISPLACEMENT:
        return _DISPLACEMENT[cache_key]
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    from ._energy._hopfield import HopfieldEnergy
    from ._solver._descend import descend

    def one(key: Any, dim: Any, scale: Any) -> Any:
        # Zero padding beyond `dim` changes no dot product and no norm.
        keep = jnp.arange(max_dim) < dim
        x = jnp.where(keep, jr.normal(key, (num_patterns, max_dim), dtype), 0)
        beta = (scale / jnp.sqrt(dim.astype(dtype))).astype(dtype)
        # Bare self-attention: the inputs are the stored patterns (held fixed) and the state.
        out = descend(HopfieldEnergy(x, beta=beta), x, step_size=1.0, num_steps=1).value
        return jnp.linalg.norm(x - out)

    def sweep(keys: Any, dims: Any, scales: Any) -> Any:
        per_dim = jax.vmap(one, in_axes=(0, None, 0))  # over scales
        return jax.lax.map(lambda a: per_dim(a[0], a[1], scales), (keys, dims))

    _DISPLACEMENT[cache_key] = jax.jit(sweep)
    return _DISPLACEMENT[cache_key]


def self_attention_displacement(
    dims: Any,
    scales: Any,
    *,
    num_patterns: int = 32,
    key: Any,
    dtype: Any = np.float32,
) -> np.ndarray:
    r"""Norm $\lVert X - X'\rVert$ between the inputs and outputs of one bare self-attention step.

    For every latent dimension $d_k$ in `dims` and scale $s$ in `scales`, sample
    `num_patterns` patterns $X \sim \mathcal N(0, 1)^{n\times d_k}$ and take one gradient
    step of size 1 of the log-sum-exp energy with the patterns as their own stored patterns
    at $\beta = s/\sqrt{d_k}$,

    $$X' = X - \nabla_X E(X; M{=}X) = \mathrm{softmax}\!\left(\tfrac{s}{\sqrt{d_k}}
      XX^\top\right) X,$$

    through [`ea.descend`][energyattn.descend] and
    [`ea.HopfieldEnergy`][energyattn.HopfieldEnergy], in `dtype`. Each pattern's overlap
    with itself, $\beta\lVert x_i\rVert^2 \approx s\sqrt{d_k}$, dominates the others (of
    order $s$), so the output is the input up to $e^{-s\sqrt{d_k}}$: at $d_k = 512$ and the
    transformer default $s = 1$ that is far below float32's resolution, and the measured
    norm is the rounding error of $x - (x - \mathrm{softmax}\cdot X)$, a few $10^{-6}$.
    In float64 the same step moves the patterns by the true, much smaller amount.

    **Arguments:**

    - `dims`: latent dimensions $d_k \ge 1$, a 1-d sequence of ints.
    - `scales`: scale factors $s > 0$ relative to $1/\sqrt{d_k}$, a 1-d sequence.
    - `num_patterns`: patterns per sample (the seed uses 32 for the contour, 8 in the text).
    - `key`: a JAX PRNG key; every `(d_k, s)` cell gets fresh patterns.
    - `dtype`: `float32` (as the seed computed it) or `float64` (needs
      `jax.enable_x64(True)`, e.g. as a context manager).

    **Returns:**

    A NumPy array of shape `(len(scales), len(dims))` (rows: scales, columns: dimensions).

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021),
        "Bare self-attention: on the importance of scale and why multiple heads".
    """
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    from ._checks import positive_int

    dims_ = np.asarray(dims).reshape(-1)
    scales_ = np.asarray(scales, np.float64).reshape(-1)
    if dims_.size == 0 or not np.issubdtype(dims_.dtype, np.integer) or np.any(dims_ < 1):
        raise ValueError(f"dims must be a non-empty sequence of integers >= 1, got {dims!r}")
    if scales_.size == 0 or not np.all(scales_ > 0):
        raise ValueError(f"scales must be a non-empty sequence of values > 0, got {scales!r}")
    num_patterns = positive_int("num_patterns", num_patterns, minimum=2)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if dtype == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "dtype float64 needs 64-bit JAX: wrap the call in `with jax.enable_x64(True):`"
        )
    keys = jr.split(key, (dims_.size, scales_.size))
    program = _displacement_program(num_patterns, int(dims_.max()), dtype)
    norms = program(keys, jnp.asarray(dims_, jnp.int32), jnp.asarray(scales_, dtype))
    return np.asarray(norms, np.float64).T


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
    [`self_attention_displacement`][energyattn.viz.self_attention_displacement], one panel per
    entry of `norms` (e.g. float32 and float64), with red lines at the transformer default
    scale $s = 1$ ($\beta = 1/\sqrt{d_k}$) and at the dimensions in `marks`. Cells whose norm is
    exactly 0 (the step is the identity to the last bit) are left blank.

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
    norms = _check_named_arrays("norms", norms, 2, "num_scales, num_dims")
    for name, values in norms.items():
        if values.shape != (scales.size, dims.size):
            raise ValueError(
                f"norms[{name!r}] must have shape (num_scales={scales.size}, "
                f"num_dims={dims.size}), got {values.shape}"
            )
    figure = _figure(figsize=(0.8 + 5.4 * len(norms), 4.4))
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
    return _save(figure, path, title, fontsize=11)


def _coupling_strengths(J: Any) -> tuple[np.ndarray, bool]:
    J = np.asarray(J, np.float64)
    if J.ndim == 2 and J.shape[0] == J.shape[1]:
        return J, True
    if J.ndim == 4 and J.shape[0] == J.shape[1] and J.shape[2] == J.shape[3]:
        return np.sqrt(np.sum(J**2, axis=(2, 3))), False
    raise ValueError(
        "J must have shape (spins, spins) or (spins, spins, dim, dim), got " + str(J.shape)
    )


def plot_couplings(
    J: Any,
    path: str | os.PathLike,
    *,
    positions: Any = None,
    threshold: float | int = 0.1,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of the coupling strengths between spins (tokens): a graph and a matrix.

    Left: the spins as nodes (on a circle, or at `positions`, e.g. patch centres), joined by an
    edge for every pair whose strength $\lvert J_{ij}\rvert$ is at least `threshold` times the
    largest; edge width and opacity grow with it, from the threshold (thin, faint) to the
    largest (thick, opaque), and scalar couplings are coloured by sign
    (red ferromagnetic $J_{ij} > 0$, blue antiferromagnetic). Right: the matrix of strengths.
    Matrix-valued couplings $J_{ij} \in \mathbb R^{d\times d}$ (the attractor network's) are
    drawn by their Frobenius norm $\lVert J_{ij}\rVert_F$; for directed couplings the
    graph shows $\max(\lvert J_{ij}\rvert, \lvert J_{ji}\rvert)$.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)` or `(spins, spins, dim, dim)`.
    - `path`: the file to write.
    - `positions`: optional node positions, shape `(spins, 2)`.
    - `threshold`: fraction of the largest strength below which no edge is drawn, in `[0, 1)`.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers Are Secretly Collectives of Spin Systems* (2021) (couplings
        between spins); T. D'Amico et al., *Self-attention as an attractor network* (2024)
        (matrix-valued couplings $J_{ij}$).
    """
    values, scalar = _coupling_strengths(J)
    num = values.shape[0]
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
    if positions is None:
        angles = np.pi / 2 - 2 * np.pi * np.arange(num) / num
        positions = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    positions = np.asarray(positions, np.float64)
    if positions.shape != (num, 2):
        raise ValueError(f"positions must have shape (spins={num}, 2), got {positions.shape}")
    magnitude = np.abs(values)
    np.fill_diagonal(magnitude, 0.0)
    largest = float(magnitude.max()) if magnitude.size else 0.0
    figure = _figure(figsize=(10.0, 4.6))
    graph, matrix = figure.subplots(1, 2)
    for i in range(num):
        for j in range(i + 1, num):
            k = (i, j) if magnitude[i, j] >= magnitude[j, i] else (j, i)
            strength = magnitude[k] / largest if largest > 0 else 0.0
            if largest == 0 or strength < threshold:
                continue
            # Width and opacity span their whole range over the drawn edges, so that strengths
            # close to each other (e.g. couplings of a fixed norm) still stand apart.
            shade = (strength - threshold) / (1 - threshold)
            colour = ("#d62728" if values[k] > 0 else "#1f77b4") if scalar else "0.25"
            graph.plot(
                *positions[[i, j]].T,
                color=colour,
                linewidth=0.4 + 3.6 * shade,
                alpha=0.2 + 0.8 * shade,
                zorder=1,
            )
    graph.scatter(*positions.T, s=90, color="white", edgecolors="black", zorder=2)
    if num <= 40:
        for i, (x, y) in enumerate(positions):
            graph.text(x, y, str(i), ha="center", va="center", fontsize=6, zorder=3)
    graph.set_aspect("equal")
    graph.axis("off")
    graph.set_title(
        ("$J_{ij}$ (red > 0, blue < 0)" if scalar else r"$\|J_{ij}\|_F$")
        + f", edges above {threshold:.0%} of the largest",
        fontsize=9,
    )
    if scalar:
        bound = max(float(np.abs(values).max()), 1e-12)
        image = matrix.imshow(values, cmap="RdBu_r", vmin=-bound, vmax=bound)
    else:  # norms: colour the off-diagonal range (the diagonal, J_ii = 0, is left blank)
        off_diagonal = ~np.eye(num, dtype=bool)
        shown = np.where(off_diagonal, values, np.nan)
        low = float(values[off_diagonal].min()) if num > 1 else 0.0
        image = matrix.imshow(shown, cmap="magma", vmin=low, vmax=max(float(values.max()), low))
    figure.colorbar(image, ax=matrix, shrink=0.85)
    matrix.set_xlabel("$j$")
    matrix.set_ylabel("$i$")
    matrix.set_title("coupling matrix", fontsize=9)
    return _save(figure, path, title, fontsize=11)
