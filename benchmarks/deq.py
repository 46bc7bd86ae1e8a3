"""Deep implicit attention: Anderson vs Picard, and implicit vs unrolled backward passes.

Question 1 (solvers): on `ea.nn.MeanFieldAttention(variant="neural")` at its default random
init, how many iterations and how much forward time does `ea.Anderson` (the layer's default)
save over plain `ea.Picard`, measured in the same run? Cases: N = 17, d = 8 and N = 64,
d = 16; a batch of 64 inputs randn / sqrt(d); the raw couplings `layer.weight` multiplied by
1 (default), 2 and 3 (a spectral radius of the map closer to, or past, 1); the default
non-symmetric couplings and symmetric ones (`sym_internal=sym_sites=True`). Both solvers
stop at rtol 1e-5, atol 1e-6 within 200 steps, `throw=False`; reported: mean and max
`num_steps` over the batch, the fraction converged, the median time of the jitted
`vmap(layer.solve)` and the ratio time(Anderson) / time(Picard). Each solver runs twice,
interleaved in the same process: with this checkout (`after`) and with the package before the
solver engine (`before`, commit 87ff9c9, extracted by `_baseline.py`); `ratio_to_before`
compares the two. `rho` is the spectral radius of the map's Jacobian at the fixed point of the
first input; `|dz|` the largest difference between Anderson's and Picard's answers where both
converged. Targets: Anderson <= 0.75x Picard on the symmetric x2 case, <= 1.1x on
the random x1 case.

Question 2 (backward): how do time and peak memory of a gradient through `ea.fixed_point`
grow with the number of forward iterations, for `ea.ImplicitAdjoint()` (the default: its
automatic linear solver runs GMRES here, 1024 unknowns being above the dense limit),
`ea.ImplicitAdjoint(ea.LU())` (the dense Jacobian, built and factorised),
`ea.UnrolledAdjoint()` and `ea.PhantomAdjoint()` (one Jacobian-free step, for reference),
and the implicit adjoint before the engine (`before_implicit`: a fixed-point iteration of the
transposed system with the forward's limits, commit 87ff9c9)? The map is the layer's neural
mean-field map (N = 64, d = 16, default init, Anderson) on a batch of 16 inputs; the loss is
sum(z ** 2) over the batch; the jitted `eqx.filter_value_and_grad` with respect to all the
layer's arrays. The forward solver's tolerances are 0 (`ea.Anderson(rtol=0, atol=0)`,
`throw=False`) so every forward solve runs exactly `max_steps` iterations (checked). Peak
memory is XLA's compiled memory analysis, `temp_size_in_bytes` (the scratch the program
allocates beyond its arguments and outputs; outputs are the same for all adjoints and stored
apart in the JSON). `grad err` is the relative 2-norm distance of the gradient from the
`implicit_lu` one (the exact implicit gradient at the forward's last iterate).

    python benchmarks/deq.py [--quick | --sizes]
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
import _baseline  # noqa: E402
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

BATCH = 64
RTOL, ATOL, MAX_STEPS = 1e-5, 1e-6, 200
BACKWARD_SIZE = (64, 16)
BACKWARD_BATCH = 16
ADJOINTS = {
    "implicit": ea.ImplicitAdjoint(),
    "implicit_lu": ea.ImplicitAdjoint(ea.LU()),
    "unrolled": ea.UnrolledAdjoint(),
    "phantom": ea.PhantomAdjoint(),
}


def inputs(num_spins: int, dim: int, batch: int, seed: int = 1) -> jax.Array:
    return jr.normal(jr.key(seed), (batch, num_spins, dim)) / np.sqrt(dim)


def make_layer(package, num_spins: int, dim: int, scale: float, symmetric: bool, **kwargs):
    layer = package.nn.MeanFieldAttention(
        num_spins, dim, sym_internal=symmetric, sym_sites=symmetric, key=jr.key(0), **kwargs
    )
    return eqx.tree_at(lambda m: m.weight, layer, layer.weight * scale)


def jacobian_radius(layer, z, x) -> float:
    """Spectral radius of the map's Jacobian in z at `z` (one input)."""
    jac = jax.jit(jax.jacfwd(lambda u: layer.update(u.reshape(z.shape), x).reshape(-1)))
    return float(np.max(np.abs(np.linalg.eigvals(np.asarray(jac(z.reshape(-1)), np.float64)))))


# --------------------------------------------------------------------------------------------
# Question 1: Anderson vs Picard


def solver_layers(num_spins, dim, scale, symmetric) -> dict:
    """`version:solver` -> the layer; tolerances on the solver now, on the layer before."""
    before = _baseline.load()
    layers = {}
    for name in ("anderson", "picard"):
        solver = {"anderson": ea.Anderson, "picard": ea.Picard}[name](rtol=RTOL, atol=ATOL)
        layers[f"after:{name}"] = make_layer(
            ea, num_spins, dim, scale, symmetric, solver=solver, max_steps=MAX_STEPS, throw=False
        )
        old_solver = {"anderson": before.Anderson, "picard": before.Picard}[name]()
        layers[f"before:{name}"] = make_layer(
            before,
            num_spins,
            dim,
            scale,
            symmetric,
            solver=old_solver,
            max_steps=MAX_STEPS,
            rtol=RTOL,
            atol=ATOL,
            throw=False,
        )
    return layers


def batched_solve(name: str, layer):
    static = eqx.partition(layer, eqx.is_array)[1]
    return lambda ps, x: jax.vmap(eqx.combine(ps[name], static).solve)(x)


def run_solvers(num_spins, dim, scale, symmetric, repeats, note) -> list[dict]:
    layers = solver_layers(num_spins, dim, scale, symmetric)
    x = inputs(num_spins, dim, BATCH)
    params = {name: eqx.partition(layer, eqx.is_array)[0] for name, layer in layers.items()}
    # Every function gets all parameter sets (the versions' modules differ) and uses its own.
    fns = {name: batched_solve(name, layer) for name, layer in layers.items()}
    times = interleaved(fns, params, x, repeats=repeats)
    # `jax.jit(fn).lower(...).compile()` again is a cache hit: the programs just timed.
    solutions = {n: jax.jit(fn).lower(params, x).compile()(params, x) for n, fn in fns.items()}
    rows = []
    for version in ("after", "before"):
        anderson, picard = solutions[f"{version}:anderson"], solutions[f"{version}:picard"]
        both = anderson.converged & picard.converged
        diff = jnp.max(jnp.abs(anderson.value - picard.value), axis=(1, 2))
        max_diff = float(jnp.max(jnp.where(both, diff, 0))) if bool(jnp.any(both)) else np.nan
        layer = layers[f"{version}:anderson"]
        rho = jacobian_radius(layer, anderson.value[0], x[0])
        picard_s = times[f"{version}:picard"]["median_s"]
        for name in ("anderson", "picard"):
            key = f"{version}:{name}"
            solution, timing = solutions[key], times[key]
            steps = np.asarray(solution.num_steps)
            rows.append(
                {
                    "benchmark": "deq",
                    "part": "solver",
                    "version": version,
                    "solver": name,
                    "num_spins": num_spins,
                    "dim": dim,
                    "batch": BATCH,
                    "couplings": "symmetric" if symmetric else "random",
                    "weight_scale": scale,
                    "jacobian_spectral_radius": rho,
                    "lipschitz_bound": float(layer.lipschitz_bound()),
                    "rtol": RTOL,
                    "atol": ATOL,
                    "max_steps": MAX_STEPS,
                    "mean_steps": float(steps.mean()),
                    "max_steps_taken": int(steps.max()),
                    "converged_fraction": float(jnp.mean(solution.converged)),
                    "max_abs_diff_between_solvers": max_diff,
                    "median_s": timing["median_s"],
                    "min_s": timing["min_s"],
                    "compile_s": timing["compile_s"],
                    "ratio_to_picard": timing["median_s"] / picard_s,
                    "ratio_to_before": timing["median_s"] / times[f"before:{name}"]["median_s"],
                    "repeats": repeats,
                    "note": note,
                }
            )
    return rows


def report_solvers(rows: list[dict]) -> None:
    for version in ("after", "before"):
        a, p = (r for r in rows if r["version"] == version)
        print(
            f"N={a['num_spins']:3d} d={a['dim']:2d} {a['couplings']:9s} x{a['weight_scale']:g} "
            f"rho={a['jacobian_spectral_radius']:.2f} {version:6s} | "
            + " | ".join(
                f"{r['solver']:8s} {r['mean_steps']:6.1f}/{r['max_steps_taken']:3d} "
                f"{100 * r['converged_fraction']:5.1f}% {r['median_s'] * 1e3:8.2f} ms"
                for r in (a, p)
            )
            + f" | A/P time {a['ratio_to_picard']:.2f} |dz| "
            f"{a['max_abs_diff_between_solvers']:.1e}"
            + (
                ""
                if version == "before"
                else f" | after/before A {a['ratio_to_before']:.2f} P {p['ratio_to_before']:.2f}"
            ),
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# Question 2: implicit vs unrolled backward


def run_backward(max_steps: int, repeats: int, note: str) -> list[dict]:
    num_spins, dim = BACKWARD_SIZE
    layer = make_layer(ea, num_spins, dim, 1.0, False)
    x = inputs(num_spins, dim, BACKWARD_BATCH)
    params, static = eqx.partition(layer, eqx.is_array)
    before = _baseline.load()

    def value_and_grad(solve):
        def loss(params, x):
            layer = eqx.combine(params, static)
            J = layer.couplings()
            solution = jax.vmap(lambda xi: solve(J, layer.correction, xi))(x)
            return jnp.sum(solution.value**2), solution.num_steps

        grad = eqx.filter_value_and_grad(loss, has_aux=True)
        return lambda params, x: grad(params, x)  # a plain function: `jax.jit` hashes it

    def after(adjoint):
        solver = ea.Anderson(rtol=0.0, atol=0.0)

        def solve(J, correction, xi):
            fn = lambda z, xi: ea.spin.mean_field.neural_mean_field(z, xi, J, correction)  # noqa: E731
            return ea.fixed_point(
                fn, jnp.zeros_like(xi), xi, solver=solver, adjoint=adjoint,
                max_steps=max_steps, throw=False,
            )  # fmt: skip

        return value_and_grad(solve)

    def solve_before(J, correction, xi):
        fn = lambda z, xi: before.neural_mean_field(z, xi, J, correction)  # noqa: E731
        return before.fixed_point(
            fn, jnp.zeros_like(xi), xi, solver=before.Anderson(), adjoint=before.ImplicitAdjoint(),
            max_steps=max_steps, rtol=0.0, atol=0.0, throw=False,
        )  # fmt: skip

    fns = {name: after(adjoint) for name, adjoint in ADJOINTS.items()}
    fns["before_implicit"] = value_and_grad(solve_before)
    times = interleaved(fns, params, x, repeats=repeats)
    results, memory = {}, {}
    for name, fn in fns.items():
        compiled = jax.jit(fn).lower(params, x).compile()  # cached: compiled by `interleaved`
        memory[name] = compiled.memory_analysis()
        results[name] = compiled(params, x)
    flat = {
        n: jnp.concatenate([g.ravel() for g in jax.tree.leaves(r[1])]) for n, r in results.items()
    }
    ref = flat["implicit_lu"]
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
                "solver": "anderson",
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
                "grad_rel_diff_to_implicit_lu": float(
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
        f"grad err {row['grad_rel_diff_to_implicit_lu']:.1e}  "
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
    parser.add_argument(
        "--sizes",
        action="store_true",
        help="solvers only: the random x1 case at N, d = 17, 8 / 64, 16 / 128, 32 / 256, 32, "
        "where Anderson's fixed cost per step stops mattering against the map's",
    )
    parser.add_argument("--repeats", type=int, help="timed repeats per case (median reported)")
    parser.add_argument("--note", default="", help="free text stored with each row")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    if args.quick:
        cases = [(False, 17, 8, 1.0), (True, 17, 8, 2.0)]
    elif args.sizes:
        cases = [(False, n, d, 1.0) for n, d in [(17, 8), (64, 16), (128, 32), (256, 32)]]
    else:
        cases = [
            (symmetric, num_spins, dim, scale)
            for symmetric in (False, True)
            for num_spins, dim in [(17, 8), (64, 16)]
            for scale in [1.0, 2.0, 3.0]
        ]
    backward_steps = [] if args.sizes else [10, 40] if args.quick else [10, 20, 40, 80]
    rows = []
    print(f"Anderson vs Picard: batch {BATCH}, rtol {RTOL}, atol {ATOL}, max_steps {MAX_STEPS}")
    print("steps mean/max, converged, median forward time")
    for symmetric, num_spins, dim, scale in cases:
        new = run_solvers(num_spins, dim, scale, symmetric, repeats, args.note)
        rows.extend(new)
        report_solvers(new)
    n, d = BACKWARD_SIZE
    if backward_steps:
        print(f"\nBackward through ea.fixed_point: N={n} d={d}, batch {BACKWARD_BATCH}, Anderson")
    for max_steps in backward_steps:
        new = run_backward(max_steps, repeats, args.note)
        rows.extend(new)
        for row in new:
            report_backward(row)
    path = write_rows("deq" + ("_quick" if args.quick else "_sizes" if args.sizes else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
