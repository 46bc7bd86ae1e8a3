"""The entry point of the `energyattn` command: `main` loads the commands (and JAX) only when
called, so that importing `energyattn._cli` stays cheap and `interrupt` can be installed
before JAX is imported."""

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `energyattn` command line: see `energyattn._cli.app.main`."""
    from .app import main as run

    return run(argv)
