r"""The `energyattn hopfield` demo: classical vs modern Hopfield retrieval of shipped digits.

Both networks store the same binarised digits $x_\mu \in \{-1,+1\}^{64}$ and are probed with
the same corrupted copies:

- classical: $E(\xi) = -\frac12 \xi^\top W \xi$ with Hebbian $W = \sum_\mu x_\mu x_\mu^\top$
  (zero diagonal), asynchronous sign updates; it stores about $0.14\,d$ random patterns and
  fewer correlated ones;
- modern: $E(\xi) = \frac12\lVert\xi\rVert^2 - \beta^{-1}\log\sum_\mu e^{\beta x_\mu\cdot\xi}$,
  whose gradient step of size 1 is $\xi \leftarrow X^\top \mathrm{softmax}(\beta X \xi)$.
"""

import argparse
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import ArrayLike, Float, Int

import energyattn as ea

from .common import (
    POSITIVE,
    add_command,
    add_shared_flags,
    check_out,
    int_at_least,
    make_out,
    number,
    run,
    say,
    write_metrics,
)
from .memory import check_memory


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
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
            "Needs the extras: pip install '.[examples]' in a checkout."
        ),
    )
    parser.add_argument(
        "--patterns",
        type=int_at_least(1),
        default=30,
        metavar="N",
        help="number of stored digits, taken class by class in turn (load N/64)",
    )
    parser.add_argument(
        "--corruption",
        type=number(lambda v: 0 <= v <= 1, "in [0, 1]"),
        default=0.2,
        metavar="FRAC",
        help="fraction of the 64 pixels flipped in each probe",
    )
    parser.add_argument(
        "--probes", type=int_at_least(1), default=10, metavar="R", help="corrupted probes per digit"
    )
    parser.add_argument(
        "--steps",
        type=int_at_least(0),
        default=3,
        metavar="T",
        help="gradient steps (size 1) of the modern Hopfield network",
    )
    parser.add_argument(
        "--sweeps",
        type=int_at_least(0),
        default=5,
        metavar="S",
        help="asynchronous sweeps of the classical Hopfield network",
    )
    parser.add_argument(
        "--beta", type=POSITIVE, default=0.5, help="inverse temperature of the modern network"
    )
    add_shared_flags(parser, seed="seed of the corruptions and sweeps")
    parser.set_defaults(run=lambda args: main(args, parser))


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
    header = f"{'model':<{width}}  retrieval accuracy  pixel agreement  on a stored pattern"
    print()
    print(header)
    print("-" * len(header))
    for name, scores in rows:
        print(
            f"{name:<{width}}  {scores['accuracy']:>18.3f}  {scores['pixel_agreement']:>15.3f}"
            f"  {scores['on_stored_pattern']:>19.3f}"
        )
    print()
    print(f"criterion: {metrics['criterion']}.")
    print("pixel agreement: mean fraction of pixels whose sign matches the original digit.")


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn hopfield`: run `run_hopfield_demo`, print the table of scores."""
    start = time.perf_counter()
    print(
        f"energyattn hopfield: {args.patterns} digits, {args.probes} probes each, "
        f"{args.corruption:.0%} of pixels flipped, seed {args.seed}"
    )
    metrics = run(
        "hopfield",
        parser,
        run_hopfield_demo,
        args.out,
        flags="--beta",
        overwrite=args.overwrite,
        num_patterns=args.patterns,
        corruption=args.corruption,
        probes_per_pattern=args.probes,
        num_steps=args.steps,
        num_sweeps=args.sweeps,
        beta=args.beta,
        seed=args.seed,
        progress=say,
    )
    if metrics is None:
        return 1
    _print_table(metrics)
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


#: A probe counts as retrieved when its sign pattern matches the original on this fraction.
MATCH_THRESHOLD = 0.95

CRITERION = (
    "a probe is retrieved when the final state's largest overlap is with its original stored "
    f"digit AND its signs match that digit on >= {MATCH_THRESHOLD:.0%} of the pixels"
)


def stored_digits(num_patterns: int) -> tuple[Float[np.ndarray, "mem 64"], Int[np.ndarray, " mem"]]:
    r"""The first `num_patterns` digits, taken class by class in turn, binarised to ±1.

    Pattern $\mu$ is the $(\mu \,\mathrm{div}\, 10)$-th example of class $\mu \bmod 10$
    in scikit-learn's order, so any prefix of the stored set is balanced over the classes.
    Pixels above one half become $+1$, the rest $-1$.

    **Returns:**

    `(patterns, labels)`: ±1 patterns of shape `(num_patterns, 64)` and their classes.
    """
    images, labels = ea.data.load_digits()
    by_class = [np.flatnonzero(labels == c) for c in range(10)]
    most = 10 * min(len(indices) for indices in by_class)
    if not 1 <= num_patterns <= most:
        raise ValueError(f"num_patterns must be in [1, {most}], got {num_patterns}")
    chosen = np.array([by_class[mu % 10][mu // 10] for mu in range(num_patterns)])
    patterns = np.where(images[chosen].reshape(num_patterns, -1) > 0.5, 1.0, -1.0)
    return patterns, labels[chosen]


def retrieval_scores(
    retrieved: Float[ArrayLike, "probes dim"],
    patterns: Float[ArrayLike, "mem dim"],
    targets: Int[ArrayLike, " probes"],
) -> dict[str, float]:
    r"""Accuracy, mean pixel agreement and how often any stored pattern was reached.

    - `accuracy`: the fraction of probes whose final state $\xi$ has its largest overlap
      $x_\mu\cdot\xi$ with the original pattern AND whose signs $\mathrm{sgn}(\xi)$ match it
      on at least `MATCH_THRESHOLD` of the pixels;
    - `pixel_agreement`: the mean fraction of pixels where $\mathrm{sgn}(\xi)$ equals the
      original;
    - `on_stored_pattern`: the fraction of final states matching *some* stored pattern (right
      or wrong) on at least `MATCH_THRESHOLD` of the pixels; the rest are spurious states.
    """
    retrieved, patterns, targets = np.asarray(retrieved), np.asarray(patterns), np.asarray(targets)
    signs = np.sign(retrieved)
    nearest = np.argmax(retrieved @ patterns.T, axis=1)
    agreement = np.mean(signs == patterns[targets], axis=1)
    best_any = np.max(np.mean(signs[:, None, :] == patterns[None, :, :], axis=2), axis=1)
    return {
        "accuracy": float(np.mean((nearest == targets) & (agreement >= MATCH_THRESHOLD))),
        "pixel_agreement": float(np.mean(agreement)),
        "on_stored_pattern": float(np.mean(best_any >= MATCH_THRESHOLD)),
    }


def run_hopfield_demo(
    out_dir: str | pathlib.Path = "energyattn-out/hopfield",
    *,
    num_patterns: int = 30,
    corruption: float = 0.2,
    probes_per_pattern: int = 10,
    num_steps: int = 3,
    num_sweeps: int = 5,
    beta: float = 0.5,
    seed: int = 0,
    num_examples: int = 10,
    progress: Callable[[str], Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    r"""Store digits in a classical and a modern Hopfield network, corrupt them, retrieve.

    The stored set is `num_patterns` shipped 8x8 digits (see `stored_digits`), binarised to
    $\pm1$. Each is corrupted `probes_per_pattern` times by flipping the signs of
    `round(corruption * 64)` random pixels; both networks get the same probes:

    - classical: `ea.sign_descend(ea.ClassicalHopfieldEnergy(ea.hebbian_weights(P)), probe,
      num_sweeps=num_sweeps, key=...)` (asynchronous, random unit order per sweep);
    - modern: `ea.descend(ea.HopfieldEnergy(P, beta=beta), probe[None], step_size=1.0,
      num_steps=num_steps)`, i.e. $\xi \leftarrow P^\top\mathrm{softmax}(\beta P\xi)$ per step.

    A probe is *retrieved* when the final state's largest overlap is with its original
    pattern and its signs match the original on at least 95% of the pixels.

    With the defaults (load $N/d \approx 0.47$, 13 of 64 pixels flipped) the classical network
    ends every probe in a spurious state (binarised digits share most background pixels, so
    even a few of them exceed its capacity), while the modern one retrieves about nine probes
    in ten; its misses end near another stored digit. Below $\beta \approx 0.1$ the modern
    network's fixed points become averages of many digits and it stops retrieving.

    Writes into `out_dir` (checked first, created once the digits are read):
    `retrieval.png` (rows stored, corrupted, classical, modern), `energies.png` (mean energy
    per sweep / step) and `metrics.json`.

    **Arguments:**

    - `out_dir`: the output folder.
    - `num_patterns`: number of stored digits $N$ (the load is $N/64$).
    - `corruption`: fraction of pixels flipped in each probe, in $[0, 1]$.
    - `probes_per_pattern`: corrupted probes per stored digit.
    - `num_steps`: gradient steps of the modern network.
    - `num_sweeps`: asynchronous sweeps of the classical network.
    - `beta`: inverse temperature $\beta > 0$ of the modern network.
    - `seed`: seed of the corruptions and of the sweep orders.
    - `num_examples`: columns of `retrieval.png`.
    - `progress`: optional callback receiving one line of text per stage.
    - `overwrite`: replace the files of an earlier run in `out_dir` (else a
      `FileExistsError` before any work).

    **Returns:**

    The metrics written to `metrics.json`: the settings, and for `"corrupted"` (the probes
    themselves), `"classical"` and `"modern"` the `accuracy`, `pixel_agreement` and
    `on_stored_pattern` scores (see `retrieval_scores`); the two networks also carry
    `mean_energy`, the mean energy over probes before each sweep/step and after the last.
    """
    for name, value, low in [
        ("num_patterns", num_patterns, 1),
        ("probes_per_pattern", probes_per_pattern, 1),
        ("num_steps", num_steps, 0),
        ("num_sweeps", num_sweeps, 0),
        ("num_examples", num_examples, 1),
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not 0.0 <= corruption <= 1.0:
        raise ValueError(f"corruption must be in [0, 1], got {corruption!r}")
    say = progress if progress is not None else (lambda line: None)
    out = check_out(out_dir, "retrieval.png", "energies.png", "metrics.json", overwrite=overwrite)
    start = time.perf_counter()

    patterns_np, labels = stored_digits(num_patterns)
    patterns = jnp.asarray(patterns_np)
    dim = patterns.shape[1]
    num_probes = num_patterns * probes_per_pattern
    # Per probe: the probe and the two networks' final states, their energies per sweep and
    # step, the modern network's scores, and the scores' comparisons with every pattern.
    check_memory(
        num_probes * (12 * dim + 4 * (num_sweeps + num_steps + 2) + num_patterns * (12 + dim)),
        f"probes_per_pattern={probes_per_pattern} with num_patterns={num_patterns} "
        f"({num_probes} probes)",
    )
    make_out(out)
    say(
        f"storing {num_patterns} binarised digits of {dim} pixels: load N/d = "
        f"{num_patterns / dim:.2f} (classical capacity ~0.14 d = {0.14 * dim:.0f} random patterns)"
    )

    targets = np.repeat(np.arange(num_patterns), probes_per_pattern)
    classical = ea.ClassicalHopfieldEnergy(ea.hebbian_weights(patterns))
    modern = ea.HopfieldEnergy(patterns, beta=beta)

    # One compiled program for all probes: corrupt, then run both networks (vmap over probes).
    @jax.jit
    def corrupt_and_retrieve(key):
        corrupt_key, sweep_key = jr.split(key)
        probes = jax.vmap(lambda x, k: ea.data.flip_signs(x, corruption, key=k))(
            patterns[targets], jr.split(corrupt_key, num_probes)
        )
        classical_out = jax.vmap(
            lambda s, k: ea.sign_descend(classical, s, num_sweeps=num_sweeps, key=k)
        )(probes, jr.split(sweep_key, num_probes))
        modern_out = jax.vmap(
            lambda q: ea.descend(modern, q[None], step_size=1.0, num_steps=num_steps)
        )(probes)
        return probes, classical_out, modern_out

    say(
        f"corrupting {num_probes} probes ({round(corruption * dim)} of {dim} pixels flipped in "
        f"each); retrieving with {num_sweeps} asynchronous sweeps (classical) and {num_steps} "
        f"steps xi <- X^T softmax(beta X xi), beta = {beta:g} (modern)"
    )
    probes, classical_out, modern_out = corrupt_and_retrieve(jr.key(seed))
    modern_final = modern_out.value[:, 0]
    say(f"retrieved in {time.perf_counter() - start:.1f} s (including compilation)")

    results: dict[str, dict[str, Any]] = {
        "corrupted": retrieval_scores(probes, patterns_np, targets),
        "classical": retrieval_scores(classical_out.value, patterns_np, targets),
        "modern": retrieval_scores(modern_final, patterns_np, targets),
    }
    classical_energy = np.mean(np.asarray(classical_out.energies), axis=0)
    modern_energy = np.mean(np.asarray(modern_out.energies), axis=0)
    results["classical"]["mean_energy"] = classical_energy.tolist()
    results["modern"]["mean_energy"] = modern_energy.tolist()

    # One column per stored digit (the first ones cover every class), its first probe.
    shown = np.arange(min(num_examples, num_patterns)) * probes_per_pattern
    as_images = lambda states: np.asarray(states)[shown].reshape(-1, 8, 8)  # noqa: E731
    files = {
        "retrieval": ea.viz.image_grid(
            {
                "stored": as_images(patterns_np[targets]),
                f"corrupted\n({corruption:.0%} flipped)": as_images(probes),
                f"classical\n({num_sweeps} sweeps)": as_images(classical_out.value),
                f"modern\n({num_steps} steps)": as_images(modern_final),
            },
            out / "retrieval.png",
            title=f"{num_patterns} stored digits: classical vs modern Hopfield retrieval",
            vmin=-1.0,
            vmax=1.0,
        ),
        "energies": ea.viz.plot_energies(
            {
                f"classical: energy per sweep ({num_probes} probes)": classical_energy,
                f"modern: energy per step (beta = {beta:g})": modern_energy,
            },
            out / "energies.png",
            xlabel="sweep / step",
            ylabel="mean energy",
            separate=True,
        ),
        "metrics": out / "metrics.json",
    }
    metrics = {
        "num_patterns": num_patterns,
        "dim": dim,
        "load": num_patterns / dim,
        "stored_labels": labels.tolist(),
        "corruption": corruption,
        "flipped_pixels": round(corruption * dim),
        "probes_per_pattern": probes_per_pattern,
        "num_probes": num_probes,
        "num_sweeps": num_sweeps,
        "num_steps": num_steps,
        "beta": beta,
        "seed": seed,
        "criterion": CRITERION,
        "results": results,
        "files": {name: str(path) for name, path in files.items()},
        "seconds": time.perf_counter() - start,
    }
    write_metrics(files["metrics"], metrics)
    say(f"wrote {', '.join(metrics['files'].values())}")
    return metrics
