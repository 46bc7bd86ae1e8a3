"""Old public names, kept working for a while with a `DeprecationWarning`."""

import warnings
from typing import Any

from ._solver import Solution


def __getattr__(name: str) -> Any:
    """Module `__getattr__` of `energyattn`: `ea.Descent` (descend's result type until the
    solver engine) is `ea.Solution` now."""
    if name == "Descent":
        warnings.warn(
            "ea.Descent is deprecated: ea.descend and ea.sign_descend return ea.Solution "
            "(same value, energies and trajectory)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Solution
    raise AttributeError(f"module 'energyattn' has no attribute {name!r}")
