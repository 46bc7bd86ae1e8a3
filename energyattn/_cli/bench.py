"""`energyattn bench`: the benchmarks of a source checkout, run with this Python."""

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import interrupt
from .common import add_command, check_out, fail, make_out


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "bench",
        help="run the benchmarks (ratios against baselines measured in the same run)",
        description=(
            "Run benchmarks/run.py of a source checkout with this Python: energy attention vs "
            "hand-written softmax attention and dot_product_attention, the memory of the "
            "attention step, ea.descend vs a hand-written lax.scan, fixed-point solvers and "
            "implicit gradients, and the spin saddle point vs one Cholesky. The JSON rows go "
            "to --out. The benchmarks are not installed with the package: run this from a "
            "checkout (or give --benchmarks). Pin it to one core for stable numbers: "
            "OPENBLAS_NUM_THREADS=1 taskset -c 0 energyattn bench --quick."
        ),
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats (5-15 min on one core)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these benchmarks, by name (benchmarks/run.py's; default: all)",
    )
    parser.add_argument(
        "--benchmarks",
        default=None,
        metavar="DIR",
        help="the benchmarks folder (default: ./benchmarks, else the one beside the package)",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def find_benchmarks(given: str | None) -> Path | None:
    """The folder holding `run.py`: `given`, else ./benchmarks, else the one beside the
    package (a source checkout); `None` when there is none."""
    if given is not None:
        candidates = [Path(given)]
    else:
        from .. import __file__ as package_file

        candidates = [
            Path.cwd() / "benchmarks",
            Path(package_file).resolve().parents[1] / "benchmarks",
        ]
    return next((c for c in candidates if (c / "run.py").is_file()), None)


def benchmark_names(folder: Path) -> tuple[str, ...] | None:
    """The names `run.py` in `folder` can run (the keys of its `BENCHMARKS`), read without
    running it; `None` when it has no such literal (the script then checks its `--only`)."""
    tree = ast.parse((folder / "run.py").read_text(), str(folder / "run.py"))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "BENCHMARKS" for target in targets):
            try:
                return tuple(ast.literal_eval(value))
            except ValueError:
                return None
    return None


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn bench`: run benchmarks/run.py in a subprocess; its exit status. Unknown
    `--only` names exit through `parser.error` (status 2) before any benchmark runs."""
    folder = find_benchmarks(args.benchmarks)
    if folder is None:
        where = args.benchmarks or "./benchmarks or beside the installed package"
        return fail(
            "bench",
            f"no benchmarks/run.py found ({where}). The benchmarks ship with the source, not "
            "the wheel: run this from a checkout of energyattn, or pass --benchmarks DIR.",
        )
    names = benchmark_names(folder)
    unknown = [name for name in args.only or () if names is not None and name not in names]
    if unknown:
        parser.error(
            f"argument --only: unknown benchmark{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; choose from {', '.join(names or ())}"
        )
    # benchmarks/run.py writes <name>[_quick].json per benchmark run: those of an earlier run
    # are replaced only with --overwrite.
    suffix = "_quick" if args.quick else ""
    written = [f"{name}{suffix}.json" for name in args.only or names or ()]
    try:
        out = make_out(check_out(args.out, *written, overwrite=args.overwrite)).resolve()
    except OSError as error:
        return fail("bench", str(error))
    except ValueError as error:  # an empty --out
        parser.error(str(error))
    command = [sys.executable, str(folder / "run.py"), "--results", str(out)]
    command += ["--quick"] if args.quick else []
    command += ["--only", *args.only] if args.only else []
    print(f"energyattn bench: {' '.join(command[1:])}", flush=True)
    # Unpinned BLAS threads make CPU linear algebra much slower; keep the user's choice if any.
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    with interrupt.for_children():  # Ctrl-C reaches the benchmarks as usual
        child = subprocess.Popen(command, env=env)
    status = child.wait()
    if status == 0:
        print(f"results in {out}")
    return status
