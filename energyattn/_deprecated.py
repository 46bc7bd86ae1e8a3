"""Old public names, kept working for one release with a `DeprecationWarning` that names
the new one: moved names (module `__getattr__`s), renamed keywords, and arguments that are
keyword-only now."""

import dataclasses
import functools
import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def _short(path: str) -> str:
    """`energyattn.spin.smt.magnetization` as users write it: `ea.spin.smt.magnetization`."""
    return "ea" + path.removeprefix("energyattn")


def moved_names(module: str, moves: dict[str, str | tuple[str, str]]) -> Callable[[str], Any]:
    """The `__getattr__` of `module`: each old name in `moves` still resolves, to the object
    at its new dotted path `moves[old]` (or `(path, note)`, the note added to the message),
    with a `DeprecationWarning` naming that path."""

    def __getattr__(name: str) -> Any:
        if name not in moves:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        entry = moves[name]
        new, note = entry if isinstance(entry, tuple) else (entry, "")
        warnings.warn(
            f"{_short(module)}.{name} is deprecated: use {_short(new)}{note}",
            DeprecationWarning,
            stacklevel=2,
        )
        home, _, attribute = new.rpartition(".")
        return getattr(importlib.import_module(home), attribute)

    return __getattr__


# The names that were `ea.*` before the move: a record of the old API, so written out rather
# than read from `ea.spin.mean_field.__all__` (a name added there later never was `ea.*`; and
# importing that module here would be an import cycle through `_energy`).
_MEAN_FIELD = (
    "GaussianSpinEnergy",
    "apply_couplings",
    "attention_couplings",
    "gaussian_spin_energy",
    "naive_mean_field",
    "neural_mean_field",
    "tap_cavity_variances",
    "tap_mean_field",
    "tap_spin_means",
    "transformer_block_as_mean_field",
    "vector_couplings",
)

#: `energyattn`'s `__getattr__`: `ea.Descent` (descend's result type until the solver
#: engine) is `ea.Solution`; the mean-field maps live with the rest of the spin family.
__getattr__ = moved_names(
    "energyattn",
    {
        "Descent": (
            "energyattn.Solution",
            " (ea.descend and ea.sign_descend return it: same value, energies and trajectory)",
        ),
        **{name: f"energyattn.spin.mean_field.{name}" for name in _MEAN_FIELD},
    },
)

#: `energyattn.spin`'s `__getattr__`: the spin-model transformer's functions are in
#: `ea.spin.smt`, under names that do not clash with AFEM's (`smt_phi` is a magnetization,
#: `ea.spin.phi` a free-energy function).
spin_getattr = moved_names(
    "energyattn.spin",
    {
        "smt_gamma": "energyattn.spin.smt.gamma",
        "smt_phi": "energyattn.spin.smt.magnetization",
        "smt_phi_inverse": "energyattn.spin.smt.inverse_magnetization",
        "smt_tap_update": "energyattn.spin.smt.tap_field",
        "smt_steady_state": "energyattn.spin.smt.steady_state",
        "smt_magnetizations": "energyattn.spin.smt.steady_magnetizations",
    },
)


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
                _warn(
                    f"{where}({old}=...) is deprecated: use {new}=..., the name it has "
                    "across energyattn"
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


def keyword_only(where: str, *names: str) -> Callable[[_F], _F]:
    """Decorate a function (or an `__init__`) whose parameters `names` were positional and
    are keyword-only now: a call that still passes them by position works, with a
    `DeprecationWarning` ("pass beta=... by keyword").

    `names` are the parameters old calls passed by position, in their old order, after the
    positional parameters both signatures share (those before the first of `names`):
    `keyword_only("ea.spin.saddle_point", "beta", "t0")` for `saddle_point(J, H, beta, t0)`
    that is now `saddle_point(J, H, *, beta, t0)`. One of `names` may still be positional
    (a plot's `path`, once after `beta`, now after `H`). Calls that bind to the new
    signature pass straight through (those with no more than the shared positional
    arguments without even a check), so `jax.jit`, `jax.vmap` and Equinox's module
    initialisation see the function as it is (`inspect.signature` reads the new one)."""

    def wrap(fn: _F) -> _F:
        signature = inspect.signature(fn)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p.name for p in signature.parameters.values() if p.kind in kinds]
        shared = next((i for i, p in enumerate(positional) if p in names), len(positional))

        @functools.wraps(fn)
        def positional_compatible(*args: Any, **kwargs: Any) -> Any:
            if len(args) <= shared or len(args) > shared + len(names):
                return fn(*args, **kwargs)
            try:
                signature.bind(*args, **kwargs)
            except TypeError:
                old = dict(zip(names, args[shared:], strict=False))
                if old.keys() & kwargs.keys():
                    return fn(*args, **kwargs)  # Python's own error names the clash
                try:
                    signature.bind(*args[:shared], **old, **kwargs)
                except TypeError:
                    return fn(*args, **kwargs)  # wrong either way: Python's error
                moved = [name for name in old if name not in positional]
                _warn(
                    f"{where}: passing {' and '.join(moved)} by position is deprecated: pass "
                    f"{', '.join(f'{name}=...' for name in moved)} by keyword"
                )
                return fn(*args[:shared], **old, **kwargs)
            return fn(*args, **kwargs)

        return positional_compatible  # type: ignore[return-value]

    return wrap
