"""What every command shares: argument types, the help formatter, the output folder, the
flags several commands take (and the training options they set), and the way a command runs
(output checked first, errors as one line, the time-limit note, the line printed on Ctrl-C)."""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..models import TrainOptions
from . import interrupt

#: Every command writes into its own folder under this one unless given `--out`.
OUT_ROOT = "energyattn-out"


#: The largest integer a flag takes: counts and seeds become int32 arrays (a larger one
#: ended in an OverflowError traceback).
INT_MAX = 2**31 - 1


def int_at_least(low: int, high: int = INT_MAX) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    return parse


def number(check: Callable[[float], bool], requirement: str) -> Callable[[str], float]:
    """An argparse type: a finite float for which `check(value)` holds, else "must be
    <requirement>" (or "must be finite": no flag takes inf or NaN)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not check(value):  # NaN fails every check
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {value}")
        return value

    return parse


POSITIVE = number(lambda v: v > 0, "> 0")
#: A PRNG seed: any int32.
SEED = int_at_least(-(2**31))


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help shows its default once: appended as "(default: X)" unless the help
    text already says what the default is, and never for flags (whose default is "off")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            or not action.option_strings
        ):
            return action.help
        shown = action.default
        if isinstance(shown, (list, tuple)):
            shown = " ".join(str(v) for v in shown)
        shown = str(shown).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def add_command(
    commands: Any, name: str, *, help: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand with the shared formatter and its `--out` and `--overwrite` options."""
    parser = commands.add_parser(
        name, help=help, description=description, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--out",
        default=f"{OUT_ROOT}/{name}",
        metavar="DIR",
        help="output folder; checked before any work, created when the work starts",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the files of an earlier run in --out (without it, the command refuses)",
    )
    return parser


def add_shared_flags(
    parser: argparse.ArgumentParser,
    *,
    seed: str,
    train_steps: tuple[int, str] | None = None,
    time_limit: tuple[float | None, str] | None = None,
    batch_size: tuple[int, str] | None = None,
    learning_rate: tuple[float, str] | None = None,
    progress: str | None = None,
) -> None:
    """Add the flags commands share, after the command's own: `--train-steps`,
    `--time-limit`, `--batch-size`, `--learning-rate` (each given as `(default, help)`, left
    out when `None`), `--seed` (`seed` is its help: what the seed draws) and `--no-progress`
    (`progress` names what it hides; left out when `None`). The training flags'
    `training_options` reads back."""
    if train_steps is not None:
        steps, text = train_steps
        parser.add_argument(
            "--train-steps", type=int_at_least(1), default=steps, metavar="N", help=text
        )
    if time_limit is not None:
        limit, text = time_limit
        unlimited = "; default: no limit" if limit is None else ""
        parser.add_argument(
            "--time-limit",
            type=POSITIVE,
            default=limit,
            metavar="SECONDS",
            help=f"{text} (compilation, done first, does not count{unlimited})",
        )
    if batch_size is not None:
        size, text = batch_size
        parser.add_argument(
            "--batch-size", type=int_at_least(1), default=size, metavar="B", help=text
        )
    if learning_rate is not None:
        rate, text = learning_rate
        parser.add_argument("--learning-rate", type=POSITIVE, default=rate, metavar="LR", help=text)
    parser.add_argument("--seed", type=SEED, default=0, help=seed)
    if progress is not None:
        parser.add_argument("--no-progress", action="store_true", help=f"hide {progress}")


def training_options(args: argparse.Namespace, base: TrainOptions = TrainOptions()) -> TrainOptions:
    """The [`TrainOptions`][energyattn.models.TrainOptions] of a command: `base` (the
    command's own defaults) with what its flags set, `--learning-rate`, `--time-limit` and
    `--no-progress`, where it has them, and a callback (after `base`'s own) that stops the
    training after the step in which Ctrl-C came (inside `interrupt.training`)."""
    flags = vars(args)
    first = base.callback

    def callback(step: int, loss: float) -> None:
        if first is not None:
            first(step, loss)
        if interrupt.step_done():
            from ..models import StopTraining

            raise StopTraining

    given: dict[str, Any] = {"callback": callback}
    if "learning_rate" in flags:
        given["learning_rate"] = flags["learning_rate"]
    if "time_limit" in flags:
        given["time_limit"] = flags["time_limit"]
    if "no_progress" in flags:
        given["progress"] = not flags["no_progress"]
    return dataclasses.replace(base, **given)


def num_parameters(model: Any) -> int:
    """The number of trainable (floating-point) parameters of an Equinox model."""
    import equinox as eqx  # not at import time: `--help` and early failures stay fast
    import jax

    return int(sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))))


def plural(n: int, word: str) -> str:
    """`n` and `word`, in the plural unless `n` is 1: "1 step", "2 steps"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


#: The last progress line of the running command (`say`): where Ctrl-C stopped it.
last_said: str | None = None


def say(line: str) -> None:
    """Progress of a command, one indented line at a time."""
    global last_said
    last_said = line
    print(f"  {line}", flush=True)


def output_files(out: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """The files in a command's output folder, each with its modification time and size (none
    when there is no folder); temporary files (hidden) are left out."""
    try:
        entries = list(os.scandir(out))
    except OSError:
        return {}
    stamps = {}
    for entry in entries:
        if entry.is_file() and not entry.name.startswith("."):
            info = entry.stat()
            stamps[entry.name] = (info.st_mtime_ns, info.st_size)
    return stamps


def interrupted(command: str, out: str | os.PathLike, before: dict[str, tuple[int, int]]) -> str:
    """The one line printed when Ctrl-C stops a command: after which of its progress lines,
    and which output files it wrote (whole ones: every file is written atomically), given the
    folder's `output_files` before it started. No command checkpoints its training."""
    written = sorted(name for name, stamp in output_files(out).items() if before.get(name) != stamp)
    if last_stop is not None:  # the training stopped after a step; the command saved it
        where = f": {last_stop}"
    else:
        where = f" after {last_said.strip()!r}" if last_said else ""
    kept = f"kept {', '.join(written)} in {out}" if written else f"wrote nothing to {out}"
    return (
        f"energyattn {command}: interrupted{where}; {kept}; no training checkpoint is kept, so a "
        "new run starts over"
    )


def fail(command: str, message: str) -> int:
    """Print `energyattn COMMAND: error: MESSAGE` on one line of stderr; the exit status 1."""
    print(f"energyattn {command}: error: {message}", file=sys.stderr, flush=True)
    return 1


def check_out(out: str | os.PathLike, *names: str, overwrite: bool = False) -> Path:
    """Check, before any work, that a command can write the files `names` into its output
    folder `out`, without creating anything (`make_out` does, when the work starts).

    An `OSError` naming the path when one cannot be written: `NotADirectoryError` (the folder,
    or a part of its path, is a file), `PermissionError` (the folder, or the existing folder
    it would be made in, is not writable), `IsADirectoryError` (a file's name is a folder);
    and, unless `overwrite`, `FileExistsError` naming `--overwrite` when some of `names`
    exist (an earlier run's files, never replaced without consent). An empty `--out` is a
    `ValueError` (it would write into the current folder)."""
    from .._io import check_output_dir, check_output_file, probe_writable

    if not str(out).strip():
        raise ValueError("--out must name a folder, got an empty path")
    folder = Path(out)
    if not folder.exists():
        # The nearest existing folder above it, where it would be created, must be writable.
        above = next(p for p in folder.absolute().parents if p.exists() or p == p.parent)
        if not above.is_dir():
            raise NotADirectoryError(
                f"cannot create the output folder {str(folder)!r}: a part of the path is a file"
            )
        probe_writable(above, "output folder", folder)
        return folder
    check_output_dir(folder)  # a folder, writable (it exists: nothing is created)
    for name in names:
        check_output_file(folder / name, what="output file")
    earlier = [name for name in names if (folder / name).is_file()]
    if earlier and not overwrite:
        raise FileExistsError(
            f"{str(folder)!r} holds an earlier run's {', '.join(earlier)}; pass --overwrite to "
            "replace them, or choose another --out"
        )
    return folder


def make_out(folder: Path) -> Path:
    """Create the output folder `folder` (checked by `check_out`), when a command's work
    starts: a command that fails before (a missing extra or data file, a bad setting)
    leaves no empty folder behind."""
    from .._io import check_output_dir

    return check_output_dir(folder)


def run(
    command: str,
    parser: argparse.ArgumentParser,
    fn: Callable[..., dict],
    *args: Any,
    errors: tuple[type[Exception], ...] = (ImportError,),
    flags: str = "",
    **kwargs: Any,
) -> dict | None:
    """Run a command's `fn`; `None` (after saying why, on one line) when the environment lacks
    something (`errors`, e.g. an optional dependency or a data file), an output cannot be
    written, or the run itself fails numerically (training diverged, a descent blew up: the
    line then names the command's `flags` that set its sizes, e.g. "--learning-rate").

    Settings that argparse cannot check alone raise `ValueError` in `fn`; they exit through
    `parser.error` (status 2) like any bad argument.
    """
    import equinox as eqx

    from .._checks import runtime_message

    caught: tuple[type[Exception], ...] = (OSError, *errors)
    try:
        return fn(*args, **kwargs)
    except caught as error:
        fail(command, str(error))
        return None
    except (FloatingPointError, eqx.EquinoxRuntimeError) as error:
        message = str(error) if isinstance(error, FloatingPointError) else runtime_message(error)
        fail(command, f"{message}" + (f" (check {flags})" if flags else ""))
        return None
    except ValueError as error:
        parser.error(str(error))


def stopped_by(result: Any) -> str | None:
    """What cut a training (a [`TrainResult`][energyattn.models.TrainResult]) short, as
    metrics.json says it: `"time limit"`, `"Ctrl-C"` (the commands' only callback that stops
    training), or `None` when it finished."""
    return {None: None, "time_limit": "time limit", "callback": "Ctrl-C"}[result.stopped_by]


#: The running command's `stop_note` for a training that Ctrl-C stopped (its `interrupted`
#: line says it).
last_stop: str | None = None


def stop_note(result: Any, planned: int, time_limit: float | None) -> str | None:
    """The line saying what cut a training (a [`TrainResult`][energyattn.models.TrainResult])
    short, a time limit or Ctrl-C, or `None` when it finished."""
    global last_stop
    if result.stopped_by is None:
        return None
    if result.stopped_by == "callback":
        last_stop = f"stopped after {result.step} of {planned} steps: Ctrl-C"
        return last_stop
    return f"stopped after {result.step} of {planned} steps: {time_limit:g} s time limit"


def strict_json(value: Any) -> Any:
    """`value` (nested dicts, lists and tuples) with every non-finite float replaced by
    `None`: JSON has no NaN or infinity (Python writes `NaN` and `Infinity`, which strict
    readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def write_metrics(path: str | os.PathLike, metrics: dict[str, Any]) -> Path:
    """Write `metrics` as indented, strict JSON (a non-finite number is `null`),
    atomically."""
    from .._io import atomic_write_text

    text = json.dumps(strict_json(metrics), indent=2, allow_nan=False)
    return atomic_write_text(path, text + "\n")


def elapsed(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


#: The XLA flag that picks which operations XLA's CPU backend hands to XNNPACK's YNN kernels.
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def avoid_xla_cpu_ynn_fusions() -> None:
    """Run the commands' programs without XNNPACK's YNN fusions.

    XLA's CPU backend (jaxlib 0.10.2 and 0.12) can compile fusions into YNN kernels that
    return wrong values, depending on the program and differently at each compilation:
    training the spin-model transformer gave first losses of 2.35 or 2.42 instead of 2.32
    and NaN gradients in some compilations; its layer at 65 tokens, dim 64, batch 32 returns
    NaN with JAX 0.12's defaults. Every fusion type (dot, reduce, eltwise) failed on one of
    these programs; none did with YNN fusions off. Commands run in their own process, so they
    set the flag before JAX starts its CPU backend, unless `XLA_FLAGS` already chooses. Code
    that imports energyattn keeps JAX's defaults (they are faster: see the docs' known
    issues).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if YNN_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}=".strip()
