"""The couplings between spins (tokens): a graph of the strongest and the matrix."""

import os
import pathlib
from typing import Any

import numpy as np

from ._figure import new_figure, save


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
    top_k: int | None = 2,
    title: str | None = None,
) -> pathlib.Path:
    r"""Write a PNG of the coupling strengths between spins (tokens): a graph and a matrix.

    Left: the spins as nodes (on a circle, or at `positions`, e.g. patch centres), joined by
    the strongest edges only, so that the structure shows: a pair is drawn when its strength
    $\lvert J_{ij}\rvert$ is at least `threshold` times the largest and is among the `top_k`
    strongest couplings of $i$ or of $j$. Edge width and opacity grow with the strength, from
    the weakest edge drawn (thin, faint) to the strongest (thick, opaque); edges are drawn as
    slight arcs, so that edges along a row of a grid do not hide each other. Scalar couplings
    are coloured by sign (red ferromagnetic $J_{ij} > 0$, blue antiferromagnetic). Right: the
    matrix of all strengths.
    Matrix-valued couplings $J_{ij} \in \mathbb R^{d\times d}$ (the attractor network's) are
    drawn by their Frobenius norm $\lVert J_{ij}\rVert_F$; for directed couplings the
    graph shows $\max(\lvert J_{ij}\rvert, \lvert J_{ji}\rvert)$.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)` or `(spins, spins, dim, dim)`.
    - `path`: the file to write.
    - `positions`: optional node positions, shape `(spins, 2)`.
    - `threshold`: fraction of the largest strength below which no edge is drawn, in `[0, 1)`.
    - `top_k`: edges kept per spin (its strongest), or `None` for every edge above `threshold`.
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
    if top_k is not None:
        from .._checks import positive_int

        top_k = positive_int("top_k", top_k)
    from matplotlib.patches import FancyArrowPatch

    magnitude = np.abs(values)
    np.fill_diagonal(magnitude, 0.0)
    pair = np.maximum(magnitude, magnitude.T)  # an edge's strength, either direction
    largest = float(pair.max()) if pair.size else 0.0
    keep = np.triu(pair >= threshold * largest, k=1) & (pair > 0)
    if top_k is not None and num > 1:
        ranks = np.argsort(np.argsort(-pair, axis=1, kind="stable"), axis=1)  # 0: strongest
        among = ranks < top_k
        keep &= among | among.T
    edges = np.argwhere(keep)
    figure = new_figure(figsize=(10.0, 4.6))
    graph, matrix = figure.subplots(1, 2)
    if edges.size:
        strengths = pair[keep]
        weakest, strongest = float(strengths.min()), float(strengths.max())
        # Width and opacity span their whole range over the drawn edges, so that strengths
        # close to each other (e.g. couplings of a fixed norm) still stand apart.
        shades = (strengths - weakest) / max(strongest - weakest, 1e-12 * strongest, 1e-300)
        for e in np.argsort(shades, kind="stable"):  # the strongest on top
            (i, j), shade = edges[e], shades[e]
            k = (i, j) if magnitude[i, j] >= magnitude[j, i] else (j, i)
            colour = ("#d62728" if values[k] > 0 else "#1f77b4") if scalar else "0.15"
            graph.add_patch(
                FancyArrowPatch(
                    positions[i],
                    positions[j],
                    arrowstyle="-",
                    connectionstyle="arc3,rad=0.18",
                    color=colour,
                    linewidth=0.6 + 3.4 * shade,
                    alpha=0.25 + 0.75 * shade,
                    zorder=1,
                )
            )
    graph.scatter(*positions.T, s=90, color="white", edgecolors="black", zorder=2)
    if num <= 40:
        for i, (x, y) in enumerate(positions):
            graph.text(x, y, str(i), ha="center", va="center", fontsize=6, zorder=3)
    low, high = positions.min(axis=0), positions.max(axis=0)
    pad = 0.12 * max(float(np.max(high - low)), 1e-9)
    graph.set_xlim(low[0] - pad, high[0] + pad)
    graph.set_ylim(low[1] - pad, high[1] + pad)
    graph.set_aspect("equal")
    graph.axis("off")
    graph.set_title(
        ("$J_{ij}$ (red > 0, blue < 0)" if scalar else r"$\|J_{ij}\|_F$")
        + (f", each spin's {top_k} strongest" if top_k is not None else ", edges")
        + (f" above {threshold:.0%} of the largest" if threshold > 0 else ""),
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
    return save(figure, path, title, fontsize=11)
