"""`energyattn attractor`: self-attention as an attractor network on shipped digits."""

import argparse
from pathlib import Path
from typing import Any

from .common import (
    add_command,
    add_progress_flag,
    check_out,
    fail,
    int_at_least,
    run,
    say,
)

TASKS = ("masked", "denoise")


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "attractor",
        help="self-attention as an attractor network: transient memories on shipped digits",
        description=(
            "Train bare self-attention as an attractor network by pseudo-likelihood on clean "
            "digits (no backpropagation through the dynamics, one model for both tasks), and "
            "the paper's baselines by backpropagation, per task: one transformer block "
            "iterated 3..7 times and a 5-layer ViT. Measures the held-out MSE against the "
            "iteration t for masked prediction (30% of patches zeroed) and denoising "
            "(Gaussian noise of variance 0.7, rescaled). Writes metrics.json, "
            "mse_vs_iteration.png, reconstructions_<task>.png and couplings.png (the strongest "
            "learnt couplings between patches, as a graph on the patch grid) into --out."
        ),
    )
    parser.add_argument(
        "--train-steps",
        type=int_at_least(1),
        default=1000,
        metavar="N",
        help="pseudo-likelihood steps of the attractor network (batches of 32)",
    )
    parser.add_argument(
        "--baseline-steps",
        type=int_at_least(1),
        default=1500,
        metavar="N",
        help="backpropagation steps of each baseline (batches of 64)",
    )
    parser.add_argument(
        "--iterations",
        type=int_at_least(1),
        default=30,
        metavar="T",
        help="iterations of the recurrent models at evaluation",
    )
    parser.add_argument(
        "--patch-size", type=int, choices=(2, 4), default=2, help="side of the square patches"
    )
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="the tasks to evaluate"
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="train and evaluate the attractor only"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, batches and noise")
    add_progress_flag(parser, "the progress bars")
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn attractor`: check `--out`, run `run_attractor_demo`, print the curves' ends."""
    from .._attractor_demo import run_attractor_demo

    try:
        check_out(args.out)
    except OSError as error:
        return fail("attractor", str(error))
    print(f"energyattn attractor: tasks {', '.join(args.tasks)}, seed {args.seed}")
    metrics = run(
        "attractor",
        parser,
        run_attractor_demo,
        args.out,
        train_steps=args.train_steps,
        baseline_steps=args.baseline_steps,
        num_iterations=args.iterations,
        patch_size=args.patch_size,
        tasks=tuple(args.tasks),
        baselines=not args.no_baselines,
        seed=args.seed,
        progress=say,
        progress_bar=not args.no_progress,
    )
    if metrics is None:
        return 1
    print()
    for task, models in metrics["tasks"].items():
        for name, summary in models.items():
            print(
                f"{task:8s} {name:32s} MSE t=0 {summary['t0']:.4f}  best {summary['best']:.4f} "
                f"(t={summary['best_t']})  last {summary['final']:.4f}"
            )
    print(f"files in {Path(args.out)}")
    return 0
