r"""The `energyattn landscape` command: attention in flatland and the β–d_k contour.

Sixteen state patterns and thirty-two stored patterns in two dimensions descend the
log-sum-exp energy $E(x) = \frac12\lVert x\rVert^2 - \beta^{-1}\log\sum_j e^{\beta x\cdot m_j}$
(one gradient step of size 1 is softmax attention) in the seed's seven scenarios, and one bare
self-attention step is measured over latent dimension and inverse temperature.
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

import energyattn as ea

from .._io import atomic_output
from .common import (
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


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
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
            "Needs the extras: pip install '.[examples]' in a checkout."
        ),
    )
    parser.add_argument(
        "--states", type=int_at_least(1), default=16, metavar="N", help="state patterns"
    )
    parser.add_argument(
        "--memories", type=int_at_least(1), default=32, metavar="M", help="stored patterns"
    )
    parser.add_argument(
        "--max-dim", type=int_at_least(2), default=1024, metavar="D", help="largest d_k"
    )
    parser.add_argument(
        "--num-dims", type=int_at_least(2), default=100, metavar="K", help="d_k values"
    )
    parser.add_argument(
        "--num-scales", type=int_at_least(2), default=50, metavar="K", help="scale values"
    )
    parser.add_argument(
        "--grid", type=int_at_least(2), default=120, metavar="P", help="landscape grid points"
    )
    add_shared_flags(parser, seed="seed of patterns and maps")
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn landscape`: run `run_landscape_demo`, print the norm at d_k = 512."""
    start = time.perf_counter()
    print(f"energyattn landscape: attention in flatland, seed {args.seed}")
    metrics = run(
        "landscape",
        parser,
        run_landscape_demo,
        args.out,
        overwrite=args.overwrite,
        num_states=args.states,
        num_memories=args.memories,
        max_dim=args.max_dim,
        num_dims=args.num_dims,
        num_scales=args.num_scales,
        num_points=args.grid,
        seed=args.seed,
        progress=say,
    )
    if metrics is None:
        return 1
    print(
        f"done in {time.perf_counter() - start:.1f} s; {len(metrics['files'])} files in {args.out}"
    )
    return 0


#: The transformer default scale in two dimensions, beta = 1/sqrt(d_k).
BASE_BETA = 2**-0.5

#: name -> (title, beta, step size, steps, self-attention?, Q/K/V maps?), as in the seed.
SCENARIOS: dict[str, tuple[str, float, float, int, bool, bool]] = {
    "cross_attention": ("bare cross-attention (1 step of size 1)", BASE_BETA, 1.0, 1, False, False),
    "small_steps": ("small steps go nowhere (1 step of size 0.1)", BASE_BETA, 0.1, 1, False, False),
    "many_big_steps": ("many big steps (10 steps of size 1)", BASE_BETA, 1.0, 10, False, False),
    "low_beta": ("low beta = 0.1/sqrt(2): smooth landscape", 0.1 * BASE_BETA, 1.0, 1, False, False),
    "high_beta": (
        "high beta = 10/sqrt(2): separate valleys (5 steps)",
        10 * BASE_BETA,
        1.0,
        5,
        False,
        False,
    ),
    "qkv": ("Q/K/V-transformed (beta = 2/sqrt(2))", 2 * BASE_BETA, 1.0, 1, False, True),
    "self_attention": ("bare self-attention (1 step of size 1)", BASE_BETA, 1.0, 1, True, False),
}


def _linear_2d(key: Any) -> Any:
    """A bias-free 2x2 linear map with the usual fan-in initialisation, U(-1/sqrt2, 1/sqrt2)."""
    return jr.uniform(key, (2, 2), minval=-BASE_BETA, maxval=BASE_BETA)


def flatland(name: str, states: Any, stored: Any, *, key: Any) -> dict[str, Any]:
    """Run one scenario of `SCENARIOS`: the panel `ea.viz.plot_landscape` draws, and numbers."""
    _, beta, step_size, num_steps, self_attention, qkv = SCENARIOS[name]
    outputs = None
    if qkv:
        w_q, w_k, w_v = (_linear_2d(k) for k in jr.split(key, 3))
        queries, memory = states @ w_q.T, stored @ w_k.T
    else:
        queries, memory = states, stored
    if self_attention:
        memory = queries  # the inputs are their own stored patterns, held fixed during the step
    energy = ea.HopfieldEnergy(memory, beta=beta)
    descent = ea.descend(
        energy, queries, step_size=step_size, num_steps=num_steps, return_trajectory=True
    )
    if qkv:
        outputs = descent.value @ w_v.T  # values act after the descent (W_V applied to the result)
    moved = jnp.linalg.norm(descent.value - queries, axis=-1)
    to_memory = jnp.linalg.norm(descent.value[:, None] - memory[None], axis=-1).min(axis=1)
    return {
        "panel": {
            "energy": lambda x: ea.hopfield_energy(x[None], memory, beta=beta),
            "trajectory": np.asarray(descent.trajectory),
            "memory": np.asarray(memory),
            **({"outputs": np.asarray(outputs)} if outputs is not None else {}),
        },
        "numbers": {
            "beta": beta,
            "step_size": step_size,
            "num_steps": num_steps,
            "energies": np.asarray(descent.energies).tolist(),
            "mean_displacement": float(moved.mean()),
            "distance_to_nearest_memory": float(to_memory.mean()),
            "spread_before": float(jnp.linalg.norm(queries - queries.mean(0), axis=-1).mean()),
            "spread_after": float(
                jnp.linalg.norm(descent.value - descent.value.mean(0), axis=-1).mean()
            ),
        },
    }


def _in_both_precisions(dims: Any, scales: Any, **kwargs: Any) -> dict[str, np.ndarray]:
    """`ea.nn.self_attention_displacement` in float32 (as the seed ran it) and float64."""
    norms = {"float32": ea.nn.self_attention_displacement(dims, scales, **kwargs)}
    with jax.enable_x64(True):
        norms["float64"] = ea.nn.self_attention_displacement(
            dims, scales, dtype=jnp.float64, **kwargs
        )
    return norms


def run_landscape_demo(
    out_dir: str | pathlib.Path,
    *,
    num_states: int = 16,
    num_memories: int = 32,
    max_dim: int = 1024,
    num_dims: int = 100,
    num_scales: int = 50,
    num_points: int = 120,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    r"""Draw the seed's flatland figures and its β–d_k contour; write PNGs and `metrics.json`.

    **Arguments:**

    - `out_dir`: output folder (checked first, created when the work starts).
    - `num_states`, `num_memories`: two-dimensional state and stored patterns (seed: 16, 32).
    - `max_dim`, `num_dims`, `num_scales`: the contour's grid, $d_k$ from 2 to `max_dim` and
      scale from 0.2 to 2 (seed: 1024, 100, 50).
    - `num_points`: grid points per axis of each landscape.
    - `seed`: seed of every pattern and linear map.
    - `progress`: called with one line of text per stage.
    - `overwrite`: replace the files of an earlier run in `out_dir` (else a
      `FileExistsError` before any work).

    **Returns:**

    The metrics written to `metrics.json`.
    """
    from .._checks import positive_int

    say = progress or (lambda line: None)
    num_states = positive_int("num_states", num_states)
    num_memories = positive_int("num_memories", num_memories)
    max_dim = positive_int("max_dim", max_dim, minimum=2)
    num_dims = positive_int("num_dims", num_dims, minimum=2)
    num_scales = positive_int("num_scales", num_scales, minimum=2)
    num_points = positive_int("num_points", num_points, minimum=2)
    # Each landscape evaluates the energy on num_points^2 points: their coordinates (float64,
    # then float32) and, per point, the scores against every stored pattern and the energy.
    check_memory(
        num_points**2 * (52 + 4 * num_memories),
        f"num_points={num_points} (a {num_points} x {num_points} grid) with "
        f"num_memories={num_memories}",
    )
    figures = [f"flatland_{name}.png" for name in SCENARIOS]
    names = ("flatland.png", "flatland_energies.png", "self_attention_contour.png", *figures)
    names += ("self_attention_contour.npz",)
    out = check_out(out_dir, *names, "metrics.json", overwrite=overwrite)
    make_out(out)
    start = time.perf_counter()
    k_states, k_stored, k_qkv, k_contour, k_check = jr.split(jr.key(seed), 5)
    states = jr.normal(k_states, (num_states, 2))
    stored = jr.normal(k_stored, (num_memories, 2))

    files: dict[str, pathlib.Path] = {}
    panels, numbers = {}, {}
    for name, (title, *_rest) in SCENARIOS.items():
        result = flatland(name, states, stored, key=k_qkv)
        panels[title], numbers[name] = result["panel"], result["numbers"]
        files[f"flatland_{name}"] = ea.viz.plot_landscape(
            **result["panel"],
            path=out / f"flatland_{name}.png",
            num_points=num_points,
            title=title,
        )
        n = result["numbers"]
        say(
            f"{name}: energy {n['energies'][0]:.3f} -> {n['energies'][-1]:.3f}, "
            f"mean move {n['mean_displacement']:.3f}, spread {n['spread_before']:.3f} -> "
            f"{n['spread_after']:.3f}"
        )
    files["flatland"] = ea.viz.plot_landscapes(
        panels,
        out / "flatland.png",
        num_cols=4,
        num_points=max(num_points // 2, 2),
        title=f"attention in flatland: {num_states} state and {num_memories} stored patterns",
    )
    files["flatland_energies"] = ea.viz.plot_energies(
        {
            f"{SCENARIOS[name][0]}": np.asarray(numbers[name]["energies"])
            for name in ("many_big_steps", "high_beta")
        },
        out / "flatland_energies.png",
        ylabel="energy (sum over state patterns)",
        separate=True,
    )

    dims = np.unique(np.linspace(2, max_dim, num_dims).astype(np.int64))
    scales = np.linspace(0.2, 2.0, num_scales)
    say(f"bare self-attention: ||X - X'|| over {dims.size} d_k x {scales.size} scales")
    norms = _in_both_precisions(dims, scales, key=k_contour)
    files["contour"] = ea.viz.plot_displacement_contour(
        dims,
        scales,
        {f"{k} (32 patterns)": v for k, v in norms.items()},
        out / "self_attention_contour.png",
        marks=(2, 512),
        title="bare self-attention: ||X - softmax(s/sqrt(d_k) X X^T) X||",
    )
    # The seed's check in the text: 8 patterns of dimension 512 at the default scale, here
    # over 20 fresh draws (every cell of the sweep gets its own patterns) in both precisions.
    at_512 = _in_both_precisions([512] * 20, [1.0], key=k_check, num_patterns=8)
    summary = {
        dtype: {"median": float(np.median(v)), "min": float(np.min(v)), "max": float(np.max(v))}
        for dtype, v in at_512.items()
    }
    say(
        "d_k = 512, default scale, 8 patterns (20 draws): ||X - X'|| median "
        f"{summary['float32']['median']:.2e} in float32 (seed: 5.55e-06), "
        f"{summary['float64']['median']:.2e} in float64"
    )
    # The sweep's grid of norms (100 x 50 per precision by default) goes to its own file;
    # metrics.json keeps the summaries (a few KB, not 300).
    files["contour_data"] = out / "self_attention_contour.npz"
    # Any: NumPy's stubs check `**` arrays against savez's `allow_pickle: bool`.
    grids: dict[str, Any] = norms
    with atomic_output(files["contour_data"]) as tmp:
        np.savez(tmp, dims=dims, scales=scales, **grids)
    files["metrics"] = out / "metrics.json"
    metrics = {
        "seed": seed,
        "num_states": num_states,
        "num_memories": num_memories,
        "scenarios": numbers,
        "contour": {
            "dims": dims.tolist(),
            "scales": scales.tolist(),
            "norms": f"{files['contour_data'].name}: (scales, dims) per precision",
            "range": {k: [float(v.min()), float(v.max())] for k, v in norms.items()},
        },
        "displacement_at_512": summary,
        "files": {name: str(path) for name, path in files.items()},
        "seconds": time.perf_counter() - start,
    }
    write_metrics(files["metrics"], metrics)
    return metrics
