"""Plots written straight to image files (matplotlib is an optional extra).

matplotlib is imported lazily, inside each function, and figures are drawn on their own Agg
canvas: no `pyplot` state, no global backend switch, nothing shown on screen, so these
functions are safe in scripts, notebooks and tests alike. They take numbers and draw them;
the numbers come from the rest of the package (e.g. `ea.spin` for the spin figures).
"""

from .._namespace import public_dir as _public_dir
from ._couplings import plot_couplings as plot_couplings
from ._curves import plot_curves as plot_curves, plot_energies as plot_energies
from ._ham import plot_ham_descent as plot_ham_descent
from ._images import image_grid as image_grid
from ._landscape import (
    plot_displacement_contour as plot_displacement_contour,
    plot_landscape as plot_landscape,
    plot_landscapes as plot_landscapes,
)
from ._spin import (
    plot_spin_beta_sweep as plot_spin_beta_sweep,
    plot_spin_landscape as plot_spin_landscape,
    plot_spin_phi as plot_spin_phi,
)
from ._thinking import plot_completions as plot_completions, plot_thinking as plot_thinking

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "image_grid",
    "plot_completions",
    "plot_couplings",
    "plot_curves",
    "plot_displacement_contour",
    "plot_energies",
    "plot_ham_descent",
    "plot_landscape",
    "plot_landscapes",
    "plot_spin_beta_sweep",
    "plot_spin_landscape",
    "plot_spin_phi",
    "plot_thinking",
]
__dir__ = _public_dir(__all__)
