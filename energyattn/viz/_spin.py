"""Figures of the vector-spin model of AFEM: phi(t), a sweep over beta, two spins.

The numbers come from `energyattn.spin` (its one phi, saddle point and free energy); these
functions only draw them."""

import os
import pathlib
from typing import Any

import numpy as np

from .._checks import keyword_arguments
from ._figure import new_figure, save
from ._spin_numbers import (
    phi_on_scalar_grid,
    phi_on_vector_grid,
    scalar_saddle,
    spin_system,
    vector_saddle,
)


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


def _t_grid(J: Any, t_star: float, t_range: Any, num_points: int) -> np.ndarray:
    from .._checks import positive_int

    num_points = positive_int("num_points", num_points, minimum=2)
    if t_range is None:
        edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])  # domain: t > edge
        t_range = (min(0.0, edge), t_star + 2.0 * (t_star - edge))
    low, high = (float(v) for v in t_range)
    if not low < high:
        raise ValueError(f"t_range must be (low, high) with low < high, got {t_range!r}")
    return np.linspace(low, high, num_points)


@keyword_arguments("ea.viz.plot_spin_phi")
def plot_spin_phi(
    J: Any,
    H: Any,
    path: str | os.PathLike,
    *,
    beta: float | int,
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
    - `path`: the file to write.
    - `beta`: inverse temperature $\beta > 0$ (keyword only).
    - `t_range`: `(low, high)`; default from below the domain's edge to well past $t^*$.
    - `num_points`: grid size.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Fun with free energies" (sweep across the auxiliary variable).
    """
    J, H, beta = spin_system(J, H, beta)
    t_star, _, _ = scalar_saddle(J, H, beta)
    ts = _t_grid(J, t_star, t_range, num_points)
    curves = phi_on_scalar_grid(J, H, beta, ts)
    edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])
    figure = new_figure(figsize=(11.0, 3.4))
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
    return save(figure, path, title, fontsize=11)


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
    J, H, _ = spin_system(J, H, float(betas[0]))
    results = np.array([scalar_saddle(J, H, b) for b in betas])
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
    figure = new_figure(figsize=(10.0, 3.6))
    left, right = figure.subplots(1, 2)
    drawn = []
    for i, beta in enumerate(betas):
        phi = phi_on_scalar_grid(J, H, beta, ts)["phi"] - phi_stars[i]
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
    return save(figure, path, title, fontsize=11)


@keyword_arguments("ea.viz.plot_spin_landscape")
def plot_spin_landscape(
    J: Any,
    H: Any,
    path: str | os.PathLike,
    *,
    beta: float | int,
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
    - `path`: the file to write.
    - `beta`: inverse temperature $\beta > 0$ (keyword only).
    - `t_range`: `(low, high)` for both axes; default from 0 to a few times $t^*$.
    - `num_points`: grid points per axis.
    - `title`: optional figure title.

    **Returns:**

    `path`, as a `pathlib.Path`.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Fun with free energies" (two-dimensional auxiliary variables).
    """
    from .._checks import positive_int

    J, H, beta = spin_system(J, H, beta)
    if H.shape[0] != 2:
        raise ValueError(f"the landscape needs exactly 2 spins, got H of shape {tuple(H.shape)}")
    num_points = positive_int("num_points", num_points, minimum=2)
    t_star = vector_saddle(J, H, beta)
    low, high = (0.0, 2.5 * float(t_star.max())) if t_range is None else t_range
    if not low < high:
        raise ValueError(f"t_range must be (low, high) with low < high, got {t_range!r}")
    axis = np.linspace(low, high, num_points)
    grid = np.stack(np.meshgrid(axis, axis, indexing="xy"), axis=-1).reshape(-1, 2)
    values = phi_on_vector_grid(J, H, beta, grid).reshape(num_points, num_points)
    finite = values[np.isfinite(values)]
    figure = new_figure(figsize=(5.2, 4.4))
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
    return save(figure, path, title, fontsize=11)
