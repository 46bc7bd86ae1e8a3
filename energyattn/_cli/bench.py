"""`energyattn bench`: the benchmarks of a source checkout, run with this Python."""

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import add_command, check_out, fail


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
        "--quick", action="store_true", help="small sizes, few repeats (under 5 min on a core)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these benchmarks (default: all)",
    )
    parser.add_argument(
        "--benchmarks",
        default=None,
        metavar="DIR",
        help="the benchmarks folder (default: ./benchmarks, else the one beside the package)",
    )
    parser.set_defaults(run=main)


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


def main(args: argparse.Namespace) -> int:
    """`energyattn bench`: run benchmarks/run.py in a subprocess; its exit status."""
    folder = find_benchmarks(args.benchmarks)
    if folder is None:
        where = args.benchmarks or "./benchmarks or beside the installed package"
        return fail(
            "bench",
            f"no benchmarks/run.py found ({where}). The benchmarks ship with the source, not "
            "the wheel: run this from a checkout of energyattn, or pass --benchmarks DIR.",
        )
    try:
        out = check_out(args.out).resolve()
    except OSError as error:
        return fail("bench", str(error))
    command = [sys.executable, str(folder / "run.py"), "--results", str(out)]
    command += ["--quick"] if args.quick else []
    command += ["--only", *args.only] if args.only else []
    print(f"energyattn bench: {' '.join(command[1:])}", flush=True)
    # Unpinned BLAS threads make CPU linear algebra much slower; keep the user's choice if any.
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    status = subprocess.run(command, env=env, check=False).returncode
    if status == 0:
        print(f"results in {out}")
    return status
