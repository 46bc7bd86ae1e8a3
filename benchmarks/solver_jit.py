"""What does `eqx.filter_jit` on the solver entry points cost under outer transformations?

The entry points (`ea.fixed_point`, `ea.root_find`, `ea.minimise`) carry `eqx.filter_jit`
(`compiled` in `energyattn/_solver/_solve.py`), as optimistix's do, so under `jit`, `grad`
or `vmap` a solve is a nested `jit` (a `pjit` equation the transformations pass through).
This script compares that with the undecorated entry point (`entry.__wrapped__`) traced
straight into the caller's program, on the same problems, in the same process:

- `inline`: the undecorated entry point;
- `filter_jit`: the entry point as shipped;

and reports, for each outer program, the time to trace and lower it (`jax.jit(f).lower`), to
compile it, and the median run time of the compiled program. Problems (float64 off:
float32, as users run):

- `deq`: the fixed point $z = \\tanh(Wz + x)$ of $n$ unknowns (Anderson), as in a deep
  equilibrium layer;
- `root`: the root of $z + \\tanh(Wz) - x$ (Newton);
- `min`: the minimum of $\\frac12\\|y\\|^2 - \\operatorname{lse}(Py) - x\\cdot y$ (BFGS).

Outer programs: `grad` (of the sum of the solution with respect to $W$ or $P$, implicit
adjoint), `vmap_grad` (the same over a batch of 16 inputs) and `hvp` (forward over reverse:
a Hessian-vector product with respect to $x$).

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/solver_jit.py [--quick]

`--quick` runs the fixed point alone (about a minute); without it, all three problems at
n = 16 and 64 (about 20 minutes on one core).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_rows  # noqa: E402

import energyattn as ea  # noqa: E402


def _problems(n: int):
    k1, k2, k3 = jr.split(jr.key(0), 3)
    W = 0.5 * jr.normal(k1, (n, n)) / jnp.sqrt(n)
    P = jr.normal(k2, (32, n)) / jnp.sqrt(n)
    x = jr.normal(k3, (n,))

    # The functions solved are made once, so the shipped entry point's `filter_jit` finds its
    # traced solve again when an outer program is traced anew (a lambda written inside the
    # call would be a new function, traced anew every time).
    def deq_map(z, a):
        return jnp.tanh(a[0] @ z + a[1])

    def root_fn(z, a):
        return z + jnp.tanh(a[0] @ z) - a[1]

    def energy(y, a):
        return 0.5 * jnp.sum(y**2) - jax.nn.logsumexp(a[0] @ y) - jnp.dot(a[1], y)

    def deq(entry, W, x):
        return entry(deq_map, jnp.zeros_like(x), (W, x)).value

    def root(entry, W, x):
        return entry(root_fn, jnp.zeros_like(x), (W, x)).value

    def minimum(entry, P, x):
        return entry(energy, jnp.zeros_like(x), (P, x)).value

    return {
        "deq": (ea.fixed_point, deq, W, x),
        "root": (ea.root_find, root, W, x),
        "min": (ea.minimise, minimum, P, x),
    }


def _outer(kind: str, solve, entry):
    """The outer program of `kind` around `solve(entry, theta, x)`."""
    if kind == "grad":
        return jax.grad(lambda theta, x: jnp.sum(solve(entry, theta, x)))
    if kind == "vmap_grad":
        grad = jax.grad(lambda theta, x: jnp.sum(solve(entry, theta, x)))
        return jax.vmap(grad, in_axes=(None, 0))
    if kind == "hvp":

        def hvp(theta, x):
            grad = jax.grad(lambda x: jnp.sum(jnp.sin(solve(entry, theta, x))))
            return jax.jvp(grad, (x,), (jnp.ones_like(x),))[1]

        return hvp
    raise ValueError(kind)


def _median_call(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(problem: str, kind: str, n: int, repeats: int) -> list[dict]:
    public, solve, theta, x = _problems(n)[problem]
    contenders = {"inline": public.__wrapped__, "filter_jit": public}
    if kind == "vmap_grad":
        x = jnp.stack([x * (1 + 0.01 * i) for i in range(16)])
    rows = []
    # Interleave: each contender traces, compiles and runs in turn, `repeats` times over
    # (tracing and compiling anew each time: a fresh jax.jit of a fresh closure).
    samples: dict[str, dict[str, list[float]]] = {
        name: {"trace_lower_s": [], "compile_s": [], "run_s": []} for name in contenders
    }
    for repeat in range(repeats):
        names = list(contenders)[repeat % 2 :] + list(contenders)[: repeat % 2]
        for name in names:
            fn = jax.jit(_outer(kind, solve, contenders[name]))
            start = time.perf_counter()
            lowered = fn.lower(theta, x)
            samples[name]["trace_lower_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            compiled = lowered.compile()
            samples[name]["compile_s"].append(time.perf_counter() - start)
            samples[name]["run_s"].append(_median_call(compiled, (theta, x), 5))
    outputs = {}
    for name, entry in contenders.items():
        outputs[name] = jax.jit(_outer(kind, solve, entry))(theta, x)
    same = bool(jnp.allclose(outputs["inline"], outputs["filter_jit"], rtol=1e-5, atol=1e-6))
    for name in contenders:
        rows.append(
            {
                "problem": problem,
                "outer": kind,
                "n": n,
                "contender": name,
                **{k: statistics.median(v) for k, v in samples[name].items()},
                "same_values": same,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fixed point, one size, 3 repeats")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 7
    rows = []
    print(f"{'problem':8} {'outer':10} {'n':>4} | trace+lower, compile, run: filter_jit / inline")
    for problem in ("deq",) if args.quick else ("deq", "root", "min"):
        for kind in ("grad", "vmap_grad", "hvp"):
            for n in (16,) if args.quick else (16, 64):
                pair = measure(problem, kind, n, repeats)
                rows += pair
                inline, nested = pair
                keys = ("trace_lower_s", "compile_s", "run_s")
                ratios = [nested[k] / inline[k] for k in keys]
                print(
                    f"{problem:8} {kind:10} {n:4} | "
                    + "  ".join(
                        f"{inline[k] * 1e3:8.1f} ms x{r:5.2f}"
                        for k, r in zip(keys, ratios, strict=True)
                    )
                    + ("" if inline["same_values"] else "  VALUES DIFFER")
                )
    path = write_rows("solver_jit" + ("_quick" if args.quick else ""), rows)
    print(f"rows: {path}")
    return rows


if __name__ == "__main__":
    main()
