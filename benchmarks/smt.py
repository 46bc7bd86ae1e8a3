"""Spin-model transformer attention: its cost against softmax attention, and its solvers.

Questions: (1) what does a forward and a forward + backward of `ea.nn.SpinTransformerAttention`
cost as a multiple of `ea.nn.SoftmaxAttention` of the same shape (tokens, dim, heads), both
jitted and vmapped over a batch, timed interleaved in one run? (2) How many map evaluations do
Anderson (the default, history 5) and Picard take to the steady state, and what does that cost?
(3) With `--per-step`: the forward's cost split into a fixed part and a cost per solver step,
from forwards that run exactly 1, 3, 5 and 9 steps (tolerances 0, `throw=False`) fitted by a
line, for each solver. Inputs randn; float32; the layer's default tolerances (rtol 1e-5,
atol 1e-6); XLA's YNN fusions off (see the known issues in the docs).

    python benchmarks/smt.py [--quick] [--per-step]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402
from energyattn._cli.common import avoid_xla_cpu_ynn_fusions as _avoid_xla_cpu_ynn_fusions  # noqa: E402

# Before JAX starts its CPU backend: XLA's YNN fusions miscompile this layer on CPU (NaN
# steady states at 65 tokens; see the docs' known issues), so both contenders run without
# them.
_avoid_xla_cpu_ynn_fusions()

BATCH = 32


def run(tokens: int, dim: int, heads: int, repeats: int) -> list[dict]:
    key = jr.PRNGKey(0)
    x = jr.normal(key, (BATCH, tokens, dim))
    solvers = {
        "anderson": ea.Anderson(rtol=1e-5, atol=1e-6),
        "picard": ea.Picard(rtol=1e-5, atol=1e-6),
    }
    layers = {
        name: ea.nn.SpinTransformerAttention(dim, heads, solver=solver, key=key)
        for name, solver in solvers.items()
    }
    softmax = ea.nn.SoftmaxAttention(dim, num_heads=heads, key=key)

    def forward(layer):
        return lambda x: jax.vmap(layer)(x)

    def backward(layer):
        def loss(layer, x):
            return jnp.sum(jax.vmap(layer)(x) ** 2)

        return lambda x: jax.grad(loss)(layer, x)

    fns = {"softmax:forward": forward(softmax), "softmax:backward": backward(softmax)}
    for name, layer in layers.items():
        fns[f"{name}:forward"] = forward(layer)
        fns[f"{name}:backward"] = backward(layer)
    times = interleaved(fns, x, repeats=repeats)
    steps = {
        name: jax.jit(jax.vmap(lambda x, layer=layer: layer(x, return_solution=True)[1]))(x)
        for name, layer in layers.items()
    }
    rows = []
    for name, timing in times.items():
        mixer, case = name.split(":")
        row = {
            "benchmark": "smt",
            "mixer": mixer,
            "case": case,
            "tokens": tokens,
            "dim": dim,
            "heads": heads,
            "batch": BATCH,
            "median_s": timing["median_s"],
            "compile_s": timing["compile_s"],
            "ratio_to_softmax": timing["median_s"] / times[f"softmax:{case}"]["median_s"],
            "repeats": repeats,
        }
        if mixer in steps:
            solution = steps[mixer]
            row["mean_steps"] = float(jnp.mean(solution.num_steps))
            row["max_steps"] = int(jnp.max(solution.num_steps))
            row["converged"] = float(jnp.mean(solution.result == ea.RESULTS.successful))
        rows.append(row)
    return rows


PER_STEP_COUNTS = (1, 3, 5, 9)


def per_step(tokens: int, dim: int, heads: int, repeats: int) -> list[dict]:
    """The forward of each solver run for exactly `PER_STEP_COUNTS` steps, and its default
    (stopping at the tolerances), against softmax: a line through the fixed-step times gives
    the fixed cost (projections, couplings, the first map) and the cost of one more step."""
    key = jr.PRNGKey(0)
    x = jr.normal(key, (BATCH, tokens, dim))
    softmax = ea.nn.SoftmaxAttention(dim, num_heads=heads, key=key)
    fns = {"softmax": lambda x: jax.vmap(softmax)(x)}
    for name, solver in (("anderson", ea.Anderson), ("picard", ea.Picard)):
        for steps in PER_STEP_COUNTS:
            layer = ea.nn.SpinTransformerAttention(
                dim, heads, solver=solver(rtol=0.0, atol=0.0), max_steps=steps, throw=False,
                key=key,
            )  # fmt: skip
            fns[f"{name}:{steps}"] = lambda x, layer=layer: jax.vmap(layer)(x)
        layer = ea.nn.SpinTransformerAttention(
            dim, heads, solver=solver(rtol=1e-5, atol=1e-6), key=key
        )
        fns[f"{name}:default"] = lambda x, layer=layer: jax.vmap(layer)(x)
    times = {name: t["median_s"] for name, t in interleaved(fns, x, repeats=repeats).items()}
    rows = []
    for name in ("anderson", "picard"):
        measured = [times[f"{name}:{steps}"] for steps in PER_STEP_COUNTS]
        slope, intercept = np.polyfit(PER_STEP_COUNTS, measured, 1)
        rows.append(
            {
                "benchmark": "smt_per_step",
                "mixer": name,
                "tokens": tokens,
                "dim": dim,
                "heads": heads,
                "batch": BATCH,
                "softmax_s": times["softmax"],
                "steps": list(PER_STEP_COUNTS),
                "fixed_steps_s": measured,
                "per_step_s": float(slope),
                "fixed_s": float(intercept),
                "default_s": times[f"{name}:default"],
                "repeats": repeats,
            }
        )
    return rows


def report_per_step(row: dict) -> None:
    print(
        f"tokens {row['tokens']:3d} dim {row['dim']:3d} heads {row['heads']} {row['mixer']:9s} "
        f"fixed {row['fixed_s'] * 1e3:6.2f} ms + {row['per_step_s'] * 1e3:5.2f} ms per step "
        f"(softmax {row['softmax_s'] * 1e3:5.2f} ms; at its tolerances "
        f"{row['default_s'] * 1e3:6.2f} ms)",
        flush=True,
    )


def report(row: dict) -> None:
    steps = ""
    if "mean_steps" in row:
        steps = f"  steps mean {row['mean_steps']:.1f} max {row['max_steps']}"
        steps += f" converged {row['converged']:.0%}"
    print(
        f"tokens {row['tokens']:3d} dim {row['dim']:3d} heads {row['heads']} {row['mixer']:9s} "
        f"{row['case']:8s} {row['median_s'] * 1e3:8.2f} ms = {row['ratio_to_softmax']:6.1f} x "
        f"softmax{steps}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, 5 repeats")
    parser.add_argument(
        "--per-step", action="store_true", help="the forward's fixed cost and cost per step"
    )
    args = parser.parse_args(argv)
    shapes = [(17, 24, 4)] if args.quick else [(17, 24, 4), (65, 64, 4)]
    if args.per_step:
        measure, show, name, repeats = per_step, report_per_step, "smt_per_step", 9
    else:
        measure, show, name, repeats = run, report, "smt", 11
    rows = []
    for tokens, dim, heads in shapes:
        new = measure(tokens, dim, heads, 5 if args.quick else repeats)
        rows.extend(new)
        for row in new:
            show(row)
    path = write_rows(name + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
