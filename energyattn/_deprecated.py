"""Old public names, kept working for one release with a `DeprecationWarning` that names
the new one."""

import dataclasses
import functools
import sys
import types
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


def options_keywords(where: str, options: type, public: str) -> Callable[[_F], _F]:
    """Decorate a function whose keyword arguments named like the fields of the frozen
    dataclass `options` (public name `public`, e.g. `"ea.models.TrainOptions"`) moved into
    its one `options=` argument: a call with such keywords still works, with a
    `DeprecationWarning` naming `options=public(...)`, and runs with those fields replaced in
    the `options` given (default: `options()`). A field given both ways (as a keyword, and
    in `options=` with a value other than its default) is a `TypeError`. `where` names the
    function in the messages."""
    fields = {field.name: field.default for field in dataclasses.fields(options)}

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def gathered(*args: Any, **kwargs: Any) -> Any:
            moved = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
            if not moved:
                return fn(*args, **kwargs)
            given = kwargs.get("options")
            if given is None:
                given = options()
            for name in moved:
                if getattr(given, name) != fields[name]:
                    raise TypeError(
                        f"{where}() got {name}= both as a keyword and in options=; give it "
                        "once, in options="
                    )
            listed = ", ".join(f"{name}=..." for name in moved)
            _warn(
                f"{where}({listed}) is deprecated: pass options={public}({listed}); the "
                "training options are one object across energyattn's trainers"
            )
            kwargs["options"] = dataclasses.replace(given, **moved)
            return fn(*args, **kwargs)

        return gathered  # type: ignore[return-value]

    return wrap


def _warn(message: str) -> None:
    """A `DeprecationWarning` attributed to the first caller outside this file (the user's
    line, however many of these decorators wrap the function)."""
    level = 2
    frame: types.FrameType | None = sys._getframe(1)  # the decorator's wrapper
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
