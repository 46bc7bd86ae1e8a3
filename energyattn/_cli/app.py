"""The `energyattn` command (also `python -m energyattn`): one subcommand per module."""

import argparse
from collections.abc import Sequence

from . import (
    attractor,
    bench,
    classify,
    common,
    demo,
    ebt,
    ham,
    hopfield,
    interrupt,
    landscape,
    spin_transformer,
    sweep,
)
from .common import avoid_xla_cpu_ynn_fusions, interrupted, output_files

#: In the order of `energyattn --help`.
COMMANDS = (
    demo,
    hopfield,
    classify,
    ham,
    spin_transformer,
    ebt,
    attractor,
    landscape,
    sweep,
    bench,
)


def parser() -> argparse.ArgumentParser:
    from .. import __version__

    top = argparse.ArgumentParser(
        prog="energyattn",
        description="energyattn: attention as energy minimisation in JAX and Equinox.",
    )
    top.add_argument("--version", action="version", version=f"energyattn {__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `energyattn` command line with `argv` (default: `sys.argv[1:]`).

    **Returns:**

    The exit status: 0 on success, 1 when the command cannot run here (its output folder
    cannot be written or holds an earlier run's files and `--overwrite` is not given, an
    extra or a data file is missing: one line on stderr says which), 130 when Ctrl-C stopped
    it (one line on stderr says after which step, and which output files it had written: a
    Ctrl-C during training stops it after the step, and the command saves what was trained).
    Bad arguments exit through argparse (`SystemExit(2)`). Run as `python -m energyattn` (or
    the `energyattn` script), Ctrl-C is handled as `interrupt` describes: it stops training
    after a step, and anything else at once.
    """
    args = parser().parse_args(argv)
    avoid_xla_cpu_ynn_fusions()
    before = output_files(args.out)
    common.last_said = common.last_stop = None
    interrupt.describe(lambda: interrupted(args.command, args.out, before))
    try:
        status = args.run(args)
        if interrupt.stop_requested():  # the training stopped early; its results are saved
            interrupt.report()
            return interrupt.STATUS
        return status
    except KeyboardInterrupt:
        # One line instead of a traceback through JAX and Equinox.
        interrupt.report()
        return interrupt.STATUS
