"""Deep implicit attention: Anderson vs Picard, and implicit vs unrolled backward passes.

Question 1 (solvers): on `ea.nn.MeanFieldAttention(variant="neural")` at its default random
init, how many iterations and how much forward time does `ea.Anderson()` (the layer's default)
save over plain `ea.Picard()`, measured in the same run? Cases: N = 17, d = 8 and N = 64,
d = 16; a batch of 64 inputs randn / sqrt(d); the raw couplings `layer.weight` multiplied by
1 (default), 2 and 3 (a spectral radius of the map closer to, or past, 1); the default
non-symmetric couplings and symmetric ones (`sym_internal=sym_sites=True`). The layer solves
to rtol 1e-5, atol 1e-6 within 200 steps, `throw=False`; reported: mean and max `num_steps`
over the batch, the fraction converged, the median time of the jitted `vmap(layer.solve)`
and the ratio time(Anderson) / time(Picard). `rho` is the spectral radius of the map's
Jacobian at the fixed point of the first input; `|dz|` the largest difference between the two
solvers' answers where both converged.

Question 2 (backward): how do time and peak memory of a gradient through `ea.fixed_point`
grow with the number of forward iterations, for `ea.ImplicitAdjoint()` (the default),
`ea.UnrolledAdjoint()` and `ea.PhantomAdjoint()` (one Jacobian-free step, for reference)?
The map is the layer's neural mean-field map (N = 64, d = 16, default init, Anderson solver)
on a batch of 16 inputs; the loss is sum(z ** 2) over the batch; the jitted
`eqx.filter_value_and_grad` with respect to all the layer's arrays. Tolerances are 0 (`rtol=0,
atol=0, throw=False`) so every forward solve runs exactly `max_steps` iterations (checked);
`ImplicitAdjoint()` inherits these limits, so its backward linear solve runs `max_steps`
iterations too. `implicit_tol` is `ImplicitAdjoint(rtol=1e-5, atol=1e-7)`, a backward
solve that stops on convergence, as it would in training. Peak memory is XLA's compiled
memory analysis, `temp_size_in_bytes` (the scratch the program allocates beyond its
arguments and outputs; outputs are the same for all adjoints and stored apart in the JSON).
`grad err` is the relative 2-norm distance of the gradient from the `implicit` one.

    python benchmarks/deq.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

BATCH = 64
RTOL, ATOL, MAX_STEPS = 1e-5, 1e-6, 200
SOLVERS = {"anderson": ea.Anderson(), "picard": ea.Picard()}
BACKWARD_SIZE = (64, 16)
BACKWARD_BATCH = 16
ADJOINTS = {
    "implicit": ea.ImplicitAdjoint(),
    "implicit_tol": ea.ImplicitAdjoint(rtol=1e-5, atol=1e-7),
    "unrolled": ea.UnrolledAdjoint(),
    "phantom": ea.PhantomAdjoint(),
}


def inputs(num_spins: int, dim: int, batch: int, seed: int = 1) -> jax.Array:
    return jr.normal(jr.key(seed), (batch, num_spins, dim)) / np.sqrt(dim)


def make_layer(num_spins: int, dim: int, scale: float, symmetric: bool, **kwargs):
    layer = ea.nn.MeanFieldAttention(
        num_spins, dim, sym_internal=symmetric, sym_sites=symmetric, key=jr.key(0), **kwargs
    )
    return eqx.tree_at(lambda m: m.weight, layer, layer.weight * scale)


def jacobian_radius(layer, z, x) -> float:
    """Spectral radius of the map's Jacobian in z at `z` (one input)."""
    jac = jax.jit(jax.jacfwd(lambda u: layer.update(u.reshape(z.shape), x).reshape(-1)))
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(jac(z.reshape(-1)), np.float64)))))


# --------------------------------------------------------------------------------------------
# Question 1: Anderson vs Picard


def run_solvers(num_spins, dim, scale, symmetric, repeats, note) -> list[dict]:
    base = make_layer(
        num_spins, dim, scale, symmetric, max_steps=MAX_STEPS, rtol=RTOL, atol=ATOL, throw=False
    )
    x = inputs(num_spins, dim, BATCH)
    params, static = eqx.partition(base, eqx.is_array)

    def forward(solver):
        def fn(params, x):
            layer = eqx.tree_at(lambda m: m.solver, eqx.combine(params, static), solver)
            return jax.vmap(layer.solve)(x)

        return fn

    fns = {name: forward(solver) for name, solver in SOLVERS.items()}
    times = interleaved(fns, params, x, repeats=repeats)
    # `jax.jit(fn).lower(...).compile()` again is a cache hit: the programs just timed.
    solutions = {n: jax.jit(fn).lower(params, x).compile()(params, x) for n, fn in fns.items()}
    both = solutions["anderson"].converged & solutions["picard"].converged
    diff = jnp.max(jnp.abs(solutions["anderson"].value - solutions["picard"].value), axis=(1, 2))
    max_diff = float(jnp.max(jnp.where(both, diff, 0))) if bool(jnp.any(both)) else float("nan")
    rho = jacobian_radius(base, solutions["anderson"].value[0], x[0])
    picard_s = times["picard"]["median_s"]
    rows = []
    for name, solution in solutions.items():
        steps = np.asarray(solution.num_steps)
        rows.append(
            {
                "benchmark": "deq",
                "part": "solver",
                "solver": name,
                "num_spins": num_spins,
                "dim": dim,
                "batch": BATCH,
                "couplings": "symmetric" if symmetric else "random",
                "weight_scale": scale,
                "jacobian_spectral_radius": rho,
                "lipschitz_bound": float(base.lipschitz_bound()),
                "rtol": RTOL,
                "atol": ATOL,
                "max_steps": MAX_STEPS,
                "mean_steps": float(steps.mean()),
                "max_steps_taken": int(steps.max()),
                "converged_fraction": float(jnp.mean(solution.converged)),
                "max_abs_diff_between_solvers": max_diff,
                "median_s": times[name]["median_s"],
                "min_s": times[name]["min_s"],
                "compile_s": times[name]["compile_s"],
                "ratio_to_picard": times[name]["median_s"] / picard_s,
                "repeats": repeats,
                "note": note,
            }
        )
    return rows


def report_solvers(rows: list[dict]) -> None:
    a, p = rows
    print(
        f"N={a['num_spins']:3d} d={a['dim']:2d} {a['couplings']:9s} x{a['weight_scale']:g} "
        f"rho={a['jacobian_spectral_radius']:.2f} | "
        + " | ".join(
            f"{r['solver']:8s} {r['mean_steps']:6.1f}/{r['max_steps_taken']:3d} "
            f"{100 * r['converged_fraction']:5.1f}% {r['median_s'] * 1e3:8.2f} ms"
            for r in rows
        )
        + f" | A/P time {a['ratio_to_picard']:.2f} |dz| {a['max_abs_diff_between_solvers']:.1e}",
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# Question 2: implicit vs unrolled backward


def run_backward(max_steps: int, repeats: int, note: str) -> list[dict]:
    num_spins, dim = BACKWARD_SIZE
    layer = make_layer(num_spins, dim, 1.0, False)
    x = inputs(num_spins, dim, BACKWARD_BATCH)
    params, static = eqx.partition(layer, eqx.is_array)

    def value_and_grad(adjoint):
        def loss(params, x):
            layer = eqx.combine(params, static)
            J = layer.couplings()

            def fn(z, xi):
                return ea.neural_mean_field(z, xi, J, layer.correction)

            def solve(xi):
                return ea.fixed_point(
                    fn,
                    jnp.zeros_like(xi),
                    xi,
                    solver=layer.solver,
                    adjoint=adjoint,
                    max_steps=max_steps,
                    rtol=0.0,
                    atol=0.0,
                    throw=False,
                )

            solution = jax.vmap(solve)(x)
            return jnp.sum(solution.value**2), solution.num_steps

        grad = eqx.filter_value_and_grad(loss, has_aux=True)
        return lambda params, x: grad(params, x)  # a plain function: `jax.jit` hashes it

    fns = {name: value_and_grad(adjoint) for name, adjoint in ADJOINTS.items()}
    times = interleaved(fns, params, x, repeats=repeats)
    results, memory = {}, {}
    for name, fn in fns.items():
        compiled = jax.jit(fn).lower(params, x).compile()  # cached: compiled by `interleaved`
        memory[name] = compiled.memory_analysis()
        results[name] = compiled(params, x)
    flat = {
        n: jnp.concatenate([g.ravel() for g in jax.tree.leaves(r[1])]) for n, r in results.items()
    }
    ref = flat["implicit"]
    rows = []
    for name in fns:
        steps = np.asarray(results[name][0][1])
        stats = memory[name]
        temp = None if stats is None else int(stats.temp_size_in_bytes)
        base_temp = None if memory["implicit"] is None else memory["implicit"].temp_size_in_bytes
        rows.append(
            {
                "benchmark": "deq",
                "part": "backward",
                "adjoint": name,
                "solver": type(layer.solver).__name__.lower(),
                "num_spins": num_spins,
                "dim": dim,
                "batch": BACKWARD_BATCH,
                "max_steps": max_steps,
                "num_steps_min": int(steps.min()),
                "num_steps_max": int(steps.max()),
                "exact_steps": bool(np.all(steps == max_steps)),
                "median_s": times[name]["median_s"],
                "min_s": times[name]["min_s"],
                "compile_s": times[name]["compile_s"],
                "ratio_to_implicit": times[name]["median_s"] / times["implicit"]["median_s"],
                "temp_bytes": temp,
                "output_bytes": None if stats is None else int(stats.output_size_in_bytes),
                "argument_bytes": None if stats is None else int(stats.argument_size_in_bytes),
                "temp_ratio_to_implicit": None if temp is None else temp / base_temp,
                "grad_rel_diff_to_implicit": float(
                    jnp.linalg.norm(flat[name] - ref) / jnp.linalg.norm(ref)
                ),
                "repeats": repeats,
                "note": note,
            }
        )
    return rows


def report_backward(row: dict) -> None:
    temp = "n/a" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2**20:8.1f} MiB"
    mem_ratio = row["temp_ratio_to_implicit"]
    print(
        f"steps {row['max_steps']:3d} {row['adjoint']:12s} {row['median_s'] * 1e3:9.2f} ms "
        f"(x{row['ratio_to_implicit']:5.2f})  temp {temp} "
        f"(x{'n/a' if mem_ratio is None else f'{mem_ratio:5.2f}'})  "
        f"grad err {row['grad_rel_diff_to_implicit']:.1e}  "
        f"steps {row['num_steps_min']}-{row['num_steps_max']}"
        + ("" if row["exact_steps"] else "  (NOT max_steps)")
        + f"  compile {row['compile_s']:.2f}s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="solvers: N = 17, random x1 and symmetric x2 only; backward: max_steps 10 and 40; "
        "5 repeats",
    )
    parser.add_argument("--repeats", type=int, help="timed repeats per case (median reported)")
    parser.add_argument("--note", default="", help="free text stored with each row")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    if args.quick:
        cases = [(False, 17, 8, 1.0), (True, 17, 8, 2.0)]
    else:
        cases = [
            (symmetric, num_spins, dim, scale)
            for symmetric in (False, True)
            for num_spins, dim in [(17, 8), (64, 16)]
            for scale in [1.0, 2.0, 3.0]
        ]
    backward_steps = [10, 40] if args.quick else [10, 20, 40, 80]
    rows = []
    print(f"Anderson vs Picard: batch {BATCH}, rtol {RTOL}, atol {ATOL}, max_steps {MAX_STEPS}")
    print("steps mean/max, converged, median forward time")
    for symmetric, num_spins, dim, scale in cases:
        new = run_solvers(num_spins, dim, scale, symmetric, repeats, args.note)
        rows.extend(new)
        report_solvers(new)
    n, d = BACKWARD_SIZE
    print(f"\nBackward through ea.fixed_point: N={n} d={d}, batch {BACKWARD_BATCH}, Anderson")
    for max_steps in backward_steps:
        new = run_backward(max_steps, repeats, args.note)
        rows.extend(new)
        for row in new:
            report_backward(row)
    path = write_rows("deq" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
