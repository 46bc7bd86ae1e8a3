"""The `energyattn` command (also `python -m energyattn`)."""

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


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
        help="train an Energy Transformer to inpaint masked patches of shipped digits (main job)",
        description=(
            "Train a small Energy Transformer on scikit-learn's shipped 8x8 digits to fill in "
            "masked 2x2 patches (the model descends one energy for 12 steps; its gradient is the "
            "attention + Hopfield-memory update). Training stops after --train-steps or "
            "--time-limit seconds, whichever comes first, with a progress bar. Prints the test "
            "masked-patch MSE next to the mean-patch baseline (each masked patch predicted by the "
            "mean training patch at its position) and writes inpainting.png (original / masked / "
            "reconstructed), energies.png (energy against descent step) and metrics.json into "
            "--out. Needs the extras: pip install 'energyattn[examples]'."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--out", default="energyattn-demo", metavar="DIR", help="output folder (created if needed)"
    )
    demo.add_argument(
        "--train-steps",
        type=_int_at_least(1),
        default=2000,
        metavar="N",
        help="optimisation steps (length of the learning-rate schedule)",
    )
    demo.add_argument(
        "--time-limit",
        type=_number(lambda v: v > 0, "> 0"),
        default=150.0,
        metavar="SECONDS",
        help="stop training after this many seconds (compilation included)",
    )
    demo.add_argument(
        "--masked",
        type=_number(lambda v: 0 < v < 1, "in (0, 1)"),
        default=0.25,
        metavar="FRAC",
        help="fraction of the 16 patches hidden in each image",
    )
    demo.add_argument(
        "--batch-size", type=_int_at_least(1), default=64, metavar="B", help="images per step"
    )
    demo.add_argument(
        "--learning-rate",
        type=_number(lambda v: v > 0, "> 0"),
        default=3e-3,
        metavar="LR",
        help="peak AdamW learning rate (warm-up, then cosine decay)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of weights, batches and masks")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(run=lambda args: _demo(args, demo))

    hopfield = commands.add_parser(
        "hopfield",
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
    hopfield.add_argument(
        "--out",
        default="energyattn-hopfield",
        metavar="DIR",
        help="output folder (created if needed)",
    )
    hopfield.add_argument(
        "--patterns",
        type=_int_at_least(1),
        default=30,
        metavar="N",
        help="number of stored digits, taken class by class in turn (load N/64)",
    )
    hopfield.add_argument(
        "--corruption",
        type=_number(lambda v: 0 <= v <= 1, "in [0, 1]"),
        default=0.2,
        metavar="FRAC",
        help="fraction of the 64 pixels flipped in each probe",
    )
    hopfield.add_argument(
        "--probes",
        type=_int_at_least(1),
        default=10,
        metavar="R",
        help="corrupted probes per stored digit",
    )
    hopfield.add_argument(
        "--steps",
        type=_int_at_least(0),
        default=3,
        metavar="T",
        help="gradient steps (size 1) of the modern Hopfield network",
    )
    hopfield.add_argument(
        "--sweeps",
        type=_int_at_least(0),
        default=5,
        metavar="S",
        help="asynchronous sweeps of the classical Hopfield network",
    )
    hopfield.add_argument(
        "--beta",
        type=_number(lambda v: v > 0, "> 0"),
        default=0.5,
        help="inverse temperature of the modern Hopfield network",
    )
    hopfield.add_argument(
        "--seed", type=int, default=0, help="seed of the corruptions and sweep orders"
    )
    hopfield.set_defaults(run=lambda args: _hopfield(args, hopfield))

    classify = commands.add_parser(
        "classify",
        help="classify shipped digits (or local MNIST) with deep implicit attention",
        description=(
            "Train a MeanFieldClassifier (convolutional patch embedding, a CLS site, a neural "
            "mean-field fixed point solved by Anderson and differentiated implicitly, a linear "
            "head) on scikit-learn's shipped 8x8 digits, or on MNIST files you downloaded "
            "yourself (--mnist DIR: IDX files or mnist.npz; nothing is ever downloaded). Prints "
            "test accuracy, parameter count, training time and solver iterations; writes "
            "metrics.json and model.eqx into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    classify.add_argument(
        "--out",
        default="energyattn-classify",
        metavar="DIR",
        help="output folder (created if needed)",
    )
    classify.add_argument("--mnist", default=None, metavar="PATH", help="local MNIST folder/npz")
    classify.add_argument("--train-steps", type=_int_at_least(1), default=3000, metavar="N")
    classify.add_argument(
        "--time-limit", type=_number(lambda v: v > 0, "> 0"), default=None, metavar="SECONDS"
    )
    classify.add_argument("--seed", type=int, default=0)
    classify.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    classify.set_defaults(run=lambda args: _classify(args, classify))

    smt = commands.add_parser(
        "spin-transformer",
        help="a spin-model transformer against softmax and mean-field attention on digits",
        description=(
            "Train three classifiers of the shipped 8x8 digits that differ only in their token "
            "mixer (the same convolutional patch embedding, CLS site, linear head, optimiser, "
            "batches and seed): the spin-model transformer (steady-state magnetizations of "
            "vector spins with softmax couplings, solved by Anderson and differentiated "
            "implicitly), softmax attention, and deep implicit attention (mean field). Prints "
            "each test accuracy next to its untrained control and the majority class; writes "
            "metrics.json and training_loss.png into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    smt.add_argument(
        "--out", default="energyattn-spin-transformer", metavar="DIR", help="output folder"
    )
    smt.add_argument("--train-steps", type=_int_at_least(1), default=800, metavar="N")
    smt.add_argument(
        "--models",
        nargs="+",
        choices=["spin_transformer", "softmax", "mean_field"],
        default=["spin_transformer", "softmax", "mean_field"],
    )
    smt.add_argument(
        "--time-limit",
        type=_number(lambda v: v > 0, "> 0"),
        default=None,
        metavar="SECONDS",
        help="cap on each model's training time",
    )
    smt.add_argument("--seed", type=int, default=0)
    smt.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    smt.set_defaults(run=lambda args: _spin_transformer(args, smt))

    attractor = commands.add_parser(
        "attractor",
        help="self-attention as an attractor network: transient memories on shipped digits",
        description=(
            "Train bare self-attention as an attractor network by pseudo-likelihood on clean "
            "digits (no backpropagation through the dynamics, one model for both tasks), and "
            "the paper's baselines by backpropagation, per task: one transformer block "
            "iterated 3..7 times and a 5-layer ViT. Measures the held-out MSE against the "
            "iteration t for masked prediction (30%% of patches zeroed) and denoising "
            "(Gaussian noise of variance 0.7, rescaled). Writes metrics.json, "
            "mse_vs_iteration.png, reconstructions_<task>.png and couplings.png (the learnt "
            "couplings between patches, as a graph on the patch grid) into --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    attractor.add_argument(
        "--out",
        default="energyattn-attractor",
        metavar="DIR",
        help="output folder (created if needed)",
    )
    attractor.add_argument(
        "--train-steps",
        type=_int_at_least(1),
        default=1000,
        metavar="N",
        help="pseudo-likelihood steps of the attractor network (batches of 32)",
    )
    attractor.add_argument(
        "--baseline-steps",
        type=_int_at_least(1),
        default=1500,
        metavar="N",
        help="backpropagation steps of each baseline (batches of 64)",
    )
    attractor.add_argument(
        "--iterations",
        type=_int_at_least(1),
        default=30,
        metavar="T",
        help="iterations of the recurrent models at evaluation",
    )
    attractor.add_argument("--patch-size", type=int, choices=(2, 4), default=2)
    attractor.add_argument(
        "--tasks", nargs="+", choices=("masked", "denoise"), default=["masked", "denoise"]
    )
    attractor.add_argument(
        "--no-baselines", action="store_true", help="train and evaluate the attractor only"
    )
    attractor.add_argument("--seed", type=int, default=0)
    attractor.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    attractor.set_defaults(run=lambda args: _attractor(args, attractor))

    landscape = commands.add_parser(
        "landscape",
        help="draw attention in flatland: 2-D energy landscapes and the beta-d_k contour",
        description=(
            "Attention as energy minimisation in two dimensions: 16 state patterns descend the "
            "log-sum-exp energy of 32 stored patterns (one gradient step of size 1 is softmax "
            "attention) in seven scenarios: bare cross-attention, small steps, many big steps, "
            "low and high beta, Q/K/V-transformed, bare self-attention. Writes one "
            "flatland_<scenario>.png each, flatland.png (all panels), flatland_energies.png "
            "(energy against step), and self_attention_contour.png: the norm ||X - X'|| of one "
            "bare self-attention step of 32 patterns over d_k in [2, --max-dim] and "
            "beta = s/sqrt(d_k), s in [0.2, 2], in float32 and float64. Prints and saves "
            "(metrics.json) the norm at d_k = 512, s = 1 for 8 patterns (the seed's 5.6e-6). "
            "Needs the extras: pip install 'energyattn[examples]'."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    landscape.add_argument(
        "--out",
        default="energyattn-landscape",
        metavar="DIR",
        help="output folder (created if needed)",
    )
    landscape.add_argument(
        "--states", type=_int_at_least(1), default=16, metavar="N", help="state patterns"
    )
    landscape.add_argument(
        "--memories", type=_int_at_least(1), default=32, metavar="M", help="stored patterns"
    )
    landscape.add_argument(
        "--max-dim", type=_int_at_least(2), default=1024, metavar="D", help="largest d_k"
    )
    landscape.add_argument(
        "--num-dims", type=_int_at_least(2), default=100, metavar="K", help="d_k values"
    )
    landscape.add_argument(
        "--num-scales", type=_int_at_least(2), default=50, metavar="K", help="scale values"
    )
    landscape.add_argument(
        "--grid", type=_int_at_least(2), default=120, metavar="P", help="landscape grid points"
    )
    landscape.add_argument("--seed", type=int, default=0, help="seed of patterns and maps")
    landscape.set_defaults(run=lambda args: _landscape(args, landscape))

    sweep = commands.add_parser(
        "sweep",
        help="sweep the vector-spin model of AFEM: phi(t), inverse temperature, couplings",
        description=(
            "Build a vector-spin system from a VectorSpinAttention layer (couplings J, fields "
            "H = LayerNorm(x)/sqrt(D) of inputs x ~ N(0, 1/D)), sweep the auxiliary variable t "
            "of phi(t) and the inverse temperature beta, solve the saddle point t* (safeguarded "
            "Newton) at each beta, and report t*, log Z, the free energy F = -log Z / beta and "
            "the magnetizations m = d log Z / dH. Writes phi.png, beta_sweep.png, "
            "landscape.png (two spins), couplings.png and metrics.json into --out. "
            "Needs the extras: pip install 'energyattn[examples]'."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sweep.add_argument(
        "--out", default="energyattn-sweep", metavar="DIR", help="output folder (created if needed)"
    )
    sweep.add_argument("--spins", type=_int_at_least(2), default=32, metavar="N")
    sweep.add_argument("--dim", type=_int_at_least(1), default=128, metavar="D")
    sweep.add_argument(
        "--betas",
        type=_number(lambda v: v > 0, "> 0"),
        nargs="+",
        default=None,
        metavar="BETA",
        help="inverse temperatures of the sweep (default: 13 values from 0.05 to 20, log-spaced)",
    )
    sweep.add_argument(
        "--beta",
        type=_number(lambda v: v > 0, "> 0"),
        default=1.0,
        help="inverse temperature of phi.png and landscape.png",
    )
    sweep.add_argument(
        "--input-dependent", action="store_true", help="couplings J(H) from query/key maps"
    )
    sweep.add_argument(
        "--grid", type=_int_at_least(2), default=400, metavar="P", help="points of the t sweeps"
    )
    sweep.add_argument("--seed", type=int, default=0)
    sweep.set_defaults(run=lambda args: _sweep(args, sweep))

    bench = commands.add_parser(
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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument(
        "--out", default="energyattn-bench", metavar="DIR", help="output folder (created if needed)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats (under 5 min on a core)"
    )
    bench.add_argument(
        "--only", nargs="+", default=None, metavar="NAME", help="run only these benchmarks"
    )
    bench.add_argument(
        "--benchmarks",
        default=None,
        metavar="DIR",
        help="the benchmarks folder (default: ./benchmarks, else the one beside the package)",
    )
    bench.set_defaults(run=lambda args: _bench(args, bench))
    return parser


def _say(line: str) -> None:
    """Progress of a command, one indented line at a time."""
    print(f"  {line}", flush=True)


def _run(
    command: str,
    parser: argparse.ArgumentParser,
    fn: Callable[..., dict],
    *args: Any,
    errors: tuple[type[Exception], ...] = (ImportError,),
    **kwargs: Any,
) -> dict | None:
    """Run a command's `fn`; `None` (after saying why) when the environment lacks something.

    Settings that argparse cannot check alone raise `ValueError` in `fn`; they exit through
    `parser.error` (status 2) like any bad argument.
    """
    try:
        return fn(*args, **kwargs)
    except errors as error:  # e.g. a missing optional dependency or data file
        print(f"energyattn {command}: {error}", file=sys.stderr)
        return None
    except ValueError as error:
        parser.error(str(error))


def _landscape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._landscape_demo import run_landscape_demo

    start = time.perf_counter()
    print(f"energyattn landscape: attention in flatland, seed {args.seed}")
    metrics = _run(
        "landscape",
        parser,
        run_landscape_demo,
        args.out,
        num_states=args.states,
        num_memories=args.memories,
        max_dim=args.max_dim,
        num_dims=args.num_dims,
        num_scales=args.num_scales,
        num_points=args.grid,
        seed=args.seed,
        progress=_say,
    )
    if metrics is None:
        return 1
    at_512 = metrics["displacement_at_512"]
    print()
    print(
        f"||X - X'|| at d_k=512, beta=1/sqrt(512), 8 patterns: float32 median "
        f"{at_512['float32']['median']:.2e}, float64 median {at_512['float64']['median']:.2e}"
    )
    print(
        f"done in {time.perf_counter() - start:.1f} s; {len(metrics['files'])} files in {args.out}"
    )
    return 0


def _sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._sweep_demo import DEFAULT_BETAS, run_sweep_demo

    start = time.perf_counter()
    print(f"energyattn sweep: vector-spin model, {args.spins} spins of dimension {args.dim}")
    metrics = _run(
        "sweep",
        parser,
        run_sweep_demo,
        args.out,
        num_spins=args.spins,
        dim=args.dim,
        betas=args.betas or DEFAULT_BETAS,
        beta=args.beta,
        input_dependent=args.input_dependent,
        num_points=args.grid,
        seed=args.seed,
        progress=_say,
    )
    if metrics is None:
        return 1
    print()
    print(f"{'beta':>9s} {'t* (mean)':>10s} {'log Z':>11s} {'F':>11s} {'|m|':>9s}")
    for row in metrics["sweep"]:
        print(
            f"{row['beta']:9.4f} {row['t_star_mean']:10.4f} {row['log_partition']:11.4f} "
            f"{row['free_energy']:11.4f} {row['magnetization_norm']:9.4f}"
        )
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


def _find_benchmarks(given: str | None) -> Path | None:
    if given is not None:
        candidates = [Path(given)]
    else:
        from . import __file__ as package_file

        candidates = [
            Path.cwd() / "benchmarks",
            Path(package_file).resolve().parents[1] / "benchmarks",
        ]
    return next((c for c in candidates if (c / "run.py").is_file()), None)


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os
    import subprocess

    folder = _find_benchmarks(args.benchmarks)
    if folder is None:
        where = args.benchmarks or "./benchmarks or beside the installed package"
        print(
            f"energyattn bench: no benchmarks/run.py found ({where}). The benchmarks ship with "
            "the source, not the wheel: run this from a checkout of energyattn, or pass "
            "--benchmarks DIR.",
            file=sys.stderr,
        )
        return 1
    out = Path(args.out).resolve()
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


def _attractor(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._attractor_demo import run_attractor_demo

    metrics = _run(
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
        progress=_say,
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
    print(f"wrote {Path(args.out) / 'metrics.json'} and the figures")
    return 0


def _spin_transformer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._smt_demo import TITLES, run_smt_demo

    metrics = _run(
        "spin-transformer",
        parser,
        run_smt_demo,
        args.out,
        train_steps=args.train_steps,
        models=tuple(args.models),
        time_limit=args.time_limit,
        seed=args.seed,
        progress=_say,
        progress_bar=not args.no_progress,
        errors=(ImportError, OSError),
    )
    if metrics is None:
        return 1
    print()
    print(f"majority class: test accuracy {metrics['majority_class_accuracy']:.4f}")
    for name, model in metrics["models"].items():
        test = model["test"]
        print(
            f"{TITLES[name]:38s} test accuracy {test['accuracy']:.4f} (untrained "
            f"{model['untrained_test']['accuracy']:.4f}), {model['num_parameters']} parameters, "
            f"{model['train_steps']} steps in {model['train_seconds']:.1f} s, solver steps "
            f"mean {test['mean_steps']:.1f}"
        )
    print(f"wrote {Path(args.out) / 'metrics.json'} and {Path(args.out) / 'training_loss.png'}")
    return 0


def _classify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._classify_demo import run_classify_demo

    metrics = _run(
        "classify",
        parser,
        run_classify_demo,
        args.out,
        mnist=args.mnist,
        train_steps=args.train_steps,
        time_limit=args.time_limit,
        seed=args.seed,
        progress=_say,
        progress_bar=not args.no_progress,
        errors=(ImportError, FileNotFoundError),
    )
    if metrics is None:
        return 1
    test = metrics["test"]
    print()
    print(f"test accuracy: {test['accuracy']:.4f} ({metrics['num_parameters']} parameters)")
    print(
        f"fixed-point iterations: mean {test['mean_steps']:.1f}, max {test['max_steps']:.0f}; "
        f"converged {test['converged']:.1%}"
    )
    print(f"training: {metrics['train_steps']} steps in {metrics['train_seconds']:.1f} s")
    return 0


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


def _hopfield(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._hopfield_demo import run_hopfield_demo

    start = time.perf_counter()
    print(
        f"energyattn hopfield: {args.patterns} digits, {args.probes} probes each, "
        f"{args.corruption:.0%} of pixels flipped, seed {args.seed}"
    )
    metrics = _run(
        "hopfield",
        parser,
        run_hopfield_demo,
        args.out,
        num_patterns=args.patterns,
        corruption=args.corruption,
        probes_per_pattern=args.probes,
        num_steps=args.steps,
        num_sweeps=args.sweeps,
        beta=args.beta,
        seed=args.seed,
        progress=_say,
    )
    if metrics is None:
        return 1
    _print_table(metrics)
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._demo import run_demo

    start = time.perf_counter()
    print(
        f"energyattn demo: Energy Transformer inpainting of shipped digits, {args.masked:.0%} of "
        f"patches masked, seed {args.seed}"
    )
    metrics = _run(
        "demo",
        parser,
        run_demo,
        args.out,
        train_steps=args.train_steps,
        time_limit=args.time_limit,
        masked_fraction=args.masked,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        progress=_say,
        progress_bar=not args.no_progress,
    )
    if metrics is None:
        return 1
    test = metrics["test"]
    print()
    print(f"test masked-patch MSE (Energy Transformer): {test['mse']:.4f}")
    print(f"test masked-patch MSE (mean-patch baseline): {test['baseline_mse']:.4f}")
    print(f"ratio: {test['ratio']:.3f} ({1 - test['ratio']:.0%} below the baseline)")
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `energyattn` command line with `argv` (default: `sys.argv[1:]`).

    **Returns:**

    The exit status (0 on success). Bad arguments exit through argparse (`SystemExit(2)`).
    """
    args = _parser().parse_args(argv)
    _avoid_xla_cpu_ynn_fusions()
    return args.run(args)


#: The XLA flag that picks which operations XLA's CPU backend hands to XNNPACK's YNN kernels.
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def _avoid_xla_cpu_ynn_fusions() -> None:
    """Run the commands' programs without XNNPACK's YNN fusions.

    XLA's CPU backend (jaxlib 0.10.2 and 0.12) can compile fusions into YNN kernels that
    return wrong values, depending on the program and differently at each compilation:
    training the spin-model transformer gave first losses of 2.35 or 2.42 instead of 2.32
    and NaN gradients in some compilations; its layer at 65 tokens, dim 64, batch 32 returns
    NaN with JAX 0.12's defaults. Every fusion type (dot, reduce, eltwise) failed on one of
    these programs; none did with YNN fusions off. Commands run in their own process, so they
    set the flag before JAX starts its CPU backend, unless `XLA_FLAGS` already chooses. Code
    that imports energyattn keeps JAX's defaults (they are faster: see the README).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if YNN_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}=".strip()
