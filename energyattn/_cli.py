"""The `energyattn` command (also `python -m energyattn`)."""

import argparse
import sys
import time
from collections.abc import Sequence


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _number(check, requirement: str):
    """An argparse type: a float for which `check(value)` holds, else "must be <requirement>"."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not check(value):  # NaN fails every check
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="energyattn",
        description="energyattn: attention as energy minimisation in JAX and Equinox.",
    )
    parser.add_argument("--version", action="version", version=f"energyattn {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="store shipped digits in classical and modern Hopfield networks and retrieve them",
        description=(
            "Store binarised 8x8 digits (shipped with scikit-learn) in a classical Hopfield "
            "network (Hebbian weights, asynchronous sign updates) and in a modern continuous "
            "Hopfield network (log-sum-exp energy; one gradient step of size 1 is "
            "xi <- X^T softmax(beta X xi)); corrupt them by flipping pixels, retrieve, and report "
            "retrieval accuracy. A probe counts as retrieved when the final state overlaps "
            "most with its original digit and its signs match it on >= 95% of the pixels. "
            "Writes retrieval.png, energies.png and metrics.json into --out. "
            "Needs the extras: pip install 'energyattn[examples]'."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--out", default="energyattn-demo", metavar="DIR", help="output folder (created if needed)"
    )
    demo.add_argument(
        "--patterns",
        type=_int_at_least(1),
        default=30,
        metavar="N",
        help="number of stored digits, taken class by class in turn (load N/64)",
    )
    demo.add_argument(
        "--corruption",
        type=_number(lambda v: 0 <= v <= 1, "in [0, 1]"),
        default=0.2,
        metavar="FRAC",
        help="fraction of the 64 pixels flipped in each probe",
    )
    demo.add_argument(
        "--probes",
        type=_int_at_least(1),
        default=10,
        metavar="R",
        help="corrupted probes per stored digit",
    )
    demo.add_argument(
        "--steps",
        type=_int_at_least(0),
        default=3,
        metavar="T",
        help="gradient steps (size 1) of the modern Hopfield network",
    )
    demo.add_argument(
        "--sweeps",
        type=_int_at_least(0),
        default=5,
        metavar="S",
        help="asynchronous sweeps of the classical Hopfield network",
    )
    demo.add_argument(
        "--beta",
        type=_number(lambda v: v > 0, "> 0"),
        default=0.5,
        help="inverse temperature of the modern Hopfield network",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the corruptions and sweep orders"
    )
    demo.set_defaults(run=lambda args: _demo(args, demo))
    return parser


def _print_table(metrics: dict) -> None:
    results = metrics["results"]
    rows = [
        ("corrupted probes (no retrieval)", results["corrupted"]),
        (f"classical Hopfield ({metrics['num_sweeps']} sweeps)", results["classical"]),
        (
            f"modern Hopfield ({metrics['num_steps']} steps, beta={metrics['beta']:g})",
            results["modern"],
        ),
    ]
    width = max(len(name) for name, _ in rows)
    header = f"{'model':<{width}}  accuracy  pixel agreement  on a stored pattern"
    print()
    print(header)
    print("-" * len(header))
    for name, scores in rows:
        print(
            f"{name:<{width}}  {scores['accuracy']:>8.3f}  {scores['pixel_agreement']:>15.3f}"
            f"  {scores['on_stored_pattern']:>19.3f}"
        )
    print()
    print(f"retrieval accuracy (classical): {results['classical']['accuracy']:.3f}")
    print(f"retrieval accuracy (modern):    {results['modern']['accuracy']:.3f}")
    print(f"criterion: {metrics['criterion']}.")
    print("pixel agreement: mean fraction of pixels whose sign matches the original digit.")


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._demo import run_demo

    start = time.perf_counter()
    print(
        f"energyattn demo: {args.patterns} digits, {args.probes} probes each, "
        f"{args.corruption:.0%} of pixels flipped, seed {args.seed}"
    )
    try:
        metrics = run_demo(
            args.out,
            num_patterns=args.patterns,
            corruption=args.corruption,
            probes_per_pattern=args.probes,
            num_steps=args.steps,
            num_sweeps=args.sweeps,
            beta=args.beta,
            seed=args.seed,
            progress=lambda line: print(f"  {line}", flush=True),
        )
    except ImportError as error:
        print(f"energyattn demo: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # settings argparse cannot check alone, e.g. too many patterns
        parser.error(str(error))
    _print_table(metrics)
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `energyattn` command line with `argv` (default: `sys.argv[1:]`).

    **Returns:**

    The exit status (0 on success). Bad arguments exit through argparse (`SystemExit(2)`).
    """
    args = _parser().parse_args(argv)
    return args.run(args)
