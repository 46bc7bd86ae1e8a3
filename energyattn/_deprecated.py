"""Old public names, kept working for one release with a `DeprecationWarning` that names
the new one."""

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def __getattr__(name: str) -> Any:
    """Module `__getattr__` of `energyattn`: `ea.Descent` (descend's result type until the
    solver engine) is `ea.Solution` now."""
    if name == "Descent":
        from ._solver import Solution

        warnings.warn(
            "ea.Descent is deprecated: ea.descend and ea.sign_descend return ea.Solution "
            "(same value, energies and trajectory)",
            DeprecationWarning,
            stacklevel=2,
        )
        return Solution
    raise AttributeError(f"module 'energyattn' has no attribute {name!r}")


def renamed_keywords(where: str, **renames: str) -> Callable[[_F], _F]:
    """Decorate a function whose keyword arguments `old` were renamed `renames[old]`: a call
    with an old name still works, with a `DeprecationWarning` naming the new one (a
    `TypeError` when both are given). `where` names the function in the message."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def renamed(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{where}() got both {new!r} and its old name {old!r}")
                warnings.warn(
                    f"{where}({old}=...) is deprecated: use {new}=..., the name it has "
                    "across energyattn",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return renamed  # type: ignore[return-value]

    return wrap
