r"""The `energyattn sweep` command: sweeps of the vector-spin model of AFEM.

A `VectorSpinAttention` layer (the seed's set-up: 32 spins of dimension 128, inputs
$x \sim \mathcal N(0, 1/D)$) gives the couplings $J$ and fields $H$ of a vector-spin system.
The command sweeps the auxiliary variable $t$ of
$\varphi(t) = \beta N t - \frac12\log\det(tI - J) + \frac\beta4\operatorname{Tr}(H^\top (tI -
J)^{-1}H)$ and the inverse temperature $\beta$, solving the saddle point $t^*$ at each and
reporting $\log Z$, the free energy and the magnetizations $m = \partial\log Z/\partial H$.
"""

import argparse
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import energyattn as ea

from .common import (
    POSITIVE,
    add_command,
    add_shared_flags,
    check_out,
    int_at_least,
    make_out,
    run,
    say,
    write_metrics,
)
from .memory import check_memory

#: Inverse temperatures swept by default (log-spaced, high to low temperature).
DEFAULT_BETAS = tuple(float(b) for b in np.geomspace(0.05, 20.0, 13))


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "sweep",
        help="sweep the vector-spin model of AFEM: phi(t), inverse temperature, couplings",
        description=(
            "Build a vector-spin system from a VectorSpinAttention layer (couplings J, fields "
            "H = LayerNorm(x)/sqrt(D) of inputs x ~ N(0, 1/D)), sweep the auxiliary variable t "
            "of phi(t) and the inverse temperature beta, solve the saddle point t* (safeguarded "
            "Newton) at each beta, and report t*, log Z, the free energy F = -log Z / beta and "
            "the magnetizations m = d log Z / dH. Writes phi.png, beta_sweep.png, "
            "landscape.png (two spins), couplings.png and metrics.json into --out. "
            "Needs the extras: pip install '.[examples]' in a checkout."
        ),
    )
    parser.add_argument(
        "--spins", type=int_at_least(2), default=32, metavar="N", help="number of spins"
    )
    parser.add_argument(
        "--dim", type=int_at_least(1), default=128, metavar="D", help="dimension of each spin"
    )
    parser.add_argument(
        "--betas",
        type=POSITIVE,
        nargs="+",
        default=None,
        metavar="BETA",
        help="inverse temperatures of the sweep (default: 13 values from 0.05 to 20, log-spaced)",
    )
    parser.add_argument(
        "--beta",
        type=POSITIVE,
        default=1.0,
        help="inverse temperature of phi.png and landscape.png",
    )
    parser.add_argument(
        "--input-dependent", action="store_true", help="couplings J(H) from query/key maps"
    )
    parser.add_argument(
        "--grid", type=int_at_least(2), default=400, metavar="P", help="points of the t sweeps"
    )
    add_shared_flags(parser, seed="seed of the layer and its inputs")
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn sweep`: run `run_sweep_demo`, print the table over beta."""
    start = time.perf_counter()
    print(f"energyattn sweep: vector-spin model, {args.spins} spins of dimension {args.dim}")
    metrics = run(
        "sweep",
        parser,
        run_sweep_demo,
        args.out,
        overwrite=args.overwrite,
        flags="--beta and --betas",
        num_spins=args.spins,
        dim=args.dim,
        betas=args.betas or DEFAULT_BETAS,
        beta=args.beta,
        input_dependent=args.input_dependent,
        num_points=args.grid,
        seed=args.seed,
        progress=say,
    )
    if metrics is None:
        return 1
    print()
    print(f"{'beta':>9s} {'t* (mean)':>10s} {'Newton':>6s} {'log Z':>11s} {'F':>11s} {'|m|':>9s}")
    for row in metrics["sweep"]:
        print(
            f"{row['beta']:9.4f} {row['t_star_mean']:10.4f} {row['newton_steps']:6d} "
            f"{row['log_partition']:11.4f} {row['free_energy']:11.4f} "
            f"{row['magnetization_norm']:9.4f}"
        )
    print(f"done in {time.perf_counter() - start:.1f} s; files in {args.out}")
    return 0


def run_sweep_demo(
    out_dir: str | pathlib.Path,
    *,
    num_spins: int = 32,
    dim: int = 128,
    betas: Sequence[float] = DEFAULT_BETAS,
    beta: float = 1.0,
    input_dependent: bool = False,
    num_points: int = 400,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    r"""Sweep $\varphi(t)$ and $\beta$ for one vector-spin system; write PNGs and `metrics.json`.

    **Arguments:**

    - `out_dir`: output folder (checked first, created when the work starts).
    - `num_spins`, `dim`: the system's size $N$ and spin dimension $D$ (at least 2 of each:
      the fields of spins of dimension 1, a layer norm over one entry, are all zero).
    - `betas`: the inverse temperatures of the sweep, values $> 0$.
    - `beta`: the inverse temperature of the $\varphi(t)$ figure and the two-spin landscape.
    - `input_dependent`: couplings $J(H)$ from query/key maps instead of a coupling matrix.
    - `num_points`: grid points of the $t$ sweeps.
    - `seed`: seed of the layer's parameters and the inputs.
    - `progress`: called with one line of text per stage.
    - `overwrite`: replace the files of an earlier run in `out_dir` (else a
      `FileExistsError` before any work).

    **Returns:**

    The metrics written to `metrics.json`.
    """
    from .._checks import positive_int

    say = progress or (lambda line: None)
    num_spins = positive_int("num_spins", num_spins, minimum=2)
    dim = positive_int("dim", dim)
    if dim == 1:
        raise ValueError(
            "dim must be >= 2: the fields H = LayerNorm(x)/sqrt(D) of spins of dimension 1 "
            "are all zero (a layer norm over one entry), so the response m.H/H.H is undefined"
        )
    betas_ = np.asarray(betas, np.float64).reshape(-1)
    if betas_.size == 0 or not np.all(betas_ > 0):
        raise ValueError(f"betas must be a non-empty sequence of values > 0, got {betas!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    num_points = positive_int("num_points", num_points, minimum=2)
    # The largest arrays, in float32 (a lower bound): the inputs and fields (N, D), the
    # couplings (N, N) and their float64 copy for the spectrum, the (num_points, N, N)
    # matrices tI - J of the phi(t) curves, and the two-spin landscape's grid of points.
    side = max(num_points // 4, 2)
    check_memory(
        4 * (2 * num_spins * dim + num_spins**2 * (3 + num_points)) + 32 * side**2,
        f"num_spins={num_spins}, dim={dim} and num_points={num_points}",
    )
    names = ("phi.png", "beta_sweep.png", "landscape.png", "couplings.png", "metrics.json")
    out = check_out(out_dir, *names, overwrite=overwrite)
    make_out(out)
    start = time.perf_counter()
    k_layer, k_x = jr.split(jr.key(seed))
    layer = ea.nn.VectorSpinAttention(
        num_spins, dim, beta=beta, input_dependent=input_dependent, key=k_layer
    )
    x = jr.normal(k_x, (num_spins, dim)) / np.sqrt(dim)
    H = layer.fields(x)
    J = layer.couplings(H)
    edge = float(np.linalg.eigvalsh(np.asarray(J, np.float64))[-1])
    say(
        f"{num_spins} vector spins of dimension {dim}, "
        f"{'input-dependent' if input_dependent else 'fixed'} couplings, "
        f"largest eigenvalue of J {edge:.4f}"
    )

    @jax.jit
    def solve(b: Any) -> dict[str, Any]:
        m, solution = ea.spin.magnetizations(J, H, beta=b, return_solution=True)
        log_z = ea.spin.log_partition(J, H, beta=b, t0=solution.value)
        return {
            "t_star": solution.value,
            "steps": solution.num_steps,
            "residual": solution.residual,
            "log_partition": log_z,
            "free_energy": -log_z / b,
            "magnetization_norm": jnp.linalg.norm(m, axis=-1).mean(),
            "response": jnp.vdot(m, H) / jnp.vdot(H, H),
        }

    say(f"solving the saddle point t* at {betas_.size} inverse temperatures")
    rows = []
    for b in betas_:
        result = jax.tree.map(np.asarray, solve(jnp.asarray(b, H.dtype)))
        rows.append(
            {
                "beta": float(b),
                "t_star_mean": float(result["t_star"].mean()),
                "t_star_min": float(result["t_star"].min()),
                "newton_steps": int(result["steps"]),
                "residual": float(result["residual"]),
                "log_partition": float(result["log_partition"]),
                "free_energy": float(result["free_energy"]),
                "magnetization_norm": float(result["magnetization_norm"]),
                "response": float(result["response"]),
            }
        )

    shown = betas_[np.unique(np.linspace(0, betas_.size - 1, min(6, betas_.size)).astype(int))]
    files = {
        "phi": ea.viz.plot_spin_phi(
            J,
            H,
            out / "phi.png",
            beta=beta,
            num_points=num_points,
            title=f"phi(t) of {num_spins} spins (scalar t), beta = {beta:g}",
        ),
        "beta_sweep": ea.viz.plot_spin_beta_sweep(
            J,
            H,
            shown,
            out / "beta_sweep.png",
            num_points=num_points,
            title="sweep across inverse temperature",
        ),
        "landscape": ea.viz.plot_spin_landscape(
            J[:2, :2],
            H[:2],
            out / "landscape.png",
            beta=beta,
            num_points=max(num_points // 4, 2),
            title="two spins: phi(t1, t2)",
        ),
        "couplings": ea.viz.plot_couplings(
            J,
            out / "couplings.png",
            threshold=0.5,
            title=f"couplings of the {num_spins} spins",
        ),
        "metrics": out / "metrics.json",
    }
    metrics = {
        "num_spins": num_spins,
        "dim": dim,
        "input_dependent": input_dependent,
        "beta": beta,
        "seed": seed,
        "largest_coupling_eigenvalue": edge,
        "sweep": rows,
        "files": {name: str(path) for name, path in files.items()},
        "seconds": time.perf_counter() - start,
    }
    write_metrics(files["metrics"], metrics)
    return metrics
