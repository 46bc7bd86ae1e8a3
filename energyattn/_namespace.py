"""What `dir()` of a public module lists: its API, not its imports and private helpers."""

from collections.abc import Callable


def public_dir(names: list[str]) -> Callable[[], list[str]]:
    """A module's `__dir__` listing `names` (its `__all__`): `__dir__ = public_dir(__all__)`.

    Tab completion and `dir(ea.spin.afem)` then show the module's API only; every other name
    still resolves (nothing is hidden from `getattr`)."""
    listed = sorted(names)

    def __dir__() -> list[str]:
        return list(listed)

    return __dir__
