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
    from ._solver._saddle import saddle_point

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
    beta: float,
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

    Left: one curve of $\varphi$ (scalar mode) per $\beta$, each with its minimum $t^*(\beta)$
    marked: at small $\beta$ (high temperature) the entropy term $-\frac12\log\det$ dominates
    and $t^*$ is large, at large $\beta$ the energy terms take over. Right: $t^*$ and the
    free energy [`ea.spin.free_energy`][energyattn.spin.free_energy] (scalar mode) against
    $\beta$.

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
    ts = _t_grid(J, float(t_stars.max()), t_range, num_points)
    figure = _figure(figsize=(10.0, 3.6))
    left, right = figure.subplots(1, 2)
    drawn = []
    for i, beta in enumerate(betas):
        phi = _phi_on_scalar_grid(J, H, np.asarray(beta, H.dtype), ts)["phi"]
        left.plot(ts, phi, color=f"C{i % 10}", label=rf"$\beta$ = {beta:.3g}")
        left.plot(t_stars[i], phi_stars[i], "o", color=f"C{i % 10}", markersize=4)
        drawn.append(phi)
    _clip_ylim(left, *drawn)
    left.set_xlabel("$t$")
    left.set_ylabel(r"$\varphi(t)$")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.plot(betas, t_stars, marker="o", markersize=3, color="C0", label="$t^*$")
    right.set_xlabel(r"$\beta$")
    right.set_ylabel("$t^*$", color="C0")
    twin = right.twinx()
    twin.plot(betas, energies, marker="s", markersize=3, color="C3", label="$F$")
    twin.set_ylabel(r"free energy $F$", color="C3")
    right.grid(alpha=0.3)
    return _save(figure, path, title, fontsize=11)


def plot_spin_landscape(
    J: Any,
    H: Any,
    beta: float,
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
