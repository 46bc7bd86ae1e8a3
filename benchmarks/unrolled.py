"""Does an unrolled solve cost the steps it takes, or its `max_steps`?

`ea.UnrolledAdjoint` differentiates through every pass of the solver's loop, which is a loop
of at most `max_steps` passes. This script times the compiled gradient
`jax.jit(jax.grad(loss))` of a loss through a solve that converges in a few steps, at
`max_steps=256` (the entry points' default) and at `max_steps=16`, in the same run, and
prints the ratio time(256) / time(16): the same steps are taken and the same gradient comes
out (checked), so a loop that pays only for the steps taken gives a ratio near 1, and one
that runs every pass up to `max_steps` about 256/16 times the work. Target (issue 64):
<= 2. Problems (float32, as users run; n = 32 unknowns):

- `fixed_point`: $z = \\tanh(Wz + x)$, $\\lVert W\\rVert_2 = 0.5$, Anderson (the default);
- `root_find`: $z + \\tanh(Wz) - x = 0$, Newton (the default; a line search in every step,
  itself a bounded loop);
- `minimise`: $\\frac12\\lVert y\\rVert^2 - \\operatorname{lse}(Py) - x\\cdot y$, L-BFGS (the
  default; line searches, and the check of the minimum it stops at).

Outer programs: `grad` (with respect to $W$ or $P$ and $x$), and `vmap_grad` (the same over
a batch of 16 inputs $x$; under `vmap` a block of passes is skipped only once every example
of the batch has finished). Each contender runs twice, interleaved: with this checkout
(`after`) and with the package at `--before` (default: the commit before the loop skipped
finished passes, extracted by `_baseline.py`); `after_over_before_256` compares the two at
256. `steps`: the solver's `num_steps` (the mean over the batch); `same`: the largest
difference between the gradients at 16 and at 256 (0, or round-off where the two programs
group the passes differently).

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/unrolled.py [--quick] [--before REV]

`--quick` times the fixed point alone, 5 repeats (about a minute on one core); without it
all three problems, 9 repeats.
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baseline  # noqa: E402
from _common import interleaved, print_row, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

#: The last commit whose unrolled loop ran every pass up to `max_steps`.
BEFORE_BOUNDED = "bba9f1b"
N, BATCH = 32, 16
BOUNDS = (16, 256)


def _inputs(n: int):
    k1, k2, k3 = jr.split(jr.key(0), 3)
    W = jr.normal(k1, (n, n))
    W = 0.5 * W / jnp.linalg.norm(W, 2)
    P = jr.normal(k2, (64, n)) / jnp.sqrt(n)
    x = jr.normal(k3, (n,))
    return W, P, x


def _map(z, a):
    return jnp.tanh(a[0] @ z + a[1])


def _root(z, a):
    return z + jnp.tanh(a[0] @ z) - a[1]


def _energy(y, a):
    return 0.5 * jnp.sum(y**2) - jax.nn.logsumexp(a[0] @ y) - jnp.dot(a[1], y)


def problems(package):
    """name -> (solve(theta, x, max_steps) -> Solution, theta)."""
    W, P, x = _inputs(N)
    adjoint = package.UnrolledAdjoint()

    def fixed_point(theta, x, max_steps):
        return package.fixed_point(
            _map, jnp.zeros_like(x), (theta, x), adjoint=adjoint, max_steps=max_steps
        )

    def root_find(theta, x, max_steps):
        return package.root_find(
            _root, jnp.zeros_like(x), (theta, x), adjoint=adjoint, max_steps=max_steps
        )

    def minimise(theta, x, max_steps):
        return package.minimise(
            _energy, jnp.zeros_like(x), (theta, x), adjoint=adjoint, max_steps=max_steps
        )

    return {
        "fixed_point": (fixed_point, W, x),
        "root_find": (root_find, W, x),
        "minimise": (minimise, P, x),
    }


def _outer(kind: str, solve, max_steps: int):
    def loss(theta, x):
        return jnp.sum(solve(theta, x, max_steps).value ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    if kind == "grad":
        return grad
    if kind == "vmap_grad":
        return jax.vmap(grad, in_axes=(None, 0))
    raise ValueError(kind)


def measure(problem: str, kind: str, versions: dict, repeats: int) -> list[dict]:
    fns, solves = {}, {}
    theta = x = None
    for version, package in versions.items():
        solve, theta, x = problems(package)[problem]
        if kind == "vmap_grad":
            x = x * (1 + 0.1 * jnp.arange(BATCH, dtype=x.dtype))[:, None]
        for bound in BOUNDS:
            fns[f"{version}:{bound}"] = _outer(kind, solve, bound)
            solves[f"{version}:{bound}"] = (solve, bound)
    # Compiled (and its compile timed) here first, before any other call of the same program.
    times = interleaved(fns, theta, x, repeats=repeats, warm=True)
    steps, grads = {}, {}
    for name, (solve, bound) in solves.items():
        forward = lambda t, x, s=solve, b=bound: s(t, x, b).num_steps  # noqa: E731
        if kind == "vmap_grad":
            forward = jax.vmap(forward, in_axes=(None, 0))
        steps[name] = float(np.mean(jax.jit(forward)(theta, x)))
        grads[name] = jax.jit(fns[name])(theta, x)
    rows = []
    for version in versions:
        short, long = (f"{version}:{b}" for b in BOUNDS)
        differ = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(grads[short]), jax.tree.leaves(grads[long]), strict=True
            )
        )
        rows.append(
            {
                "problem": problem,
                "outer": kind,
                "n": N,
                "version": version,
                "steps": steps[short],
                "steps_at_256": steps[long],
                **{f"run_s_{b}": times[f"{version}:{b}"]["median_s"] for b in BOUNDS},
                **{f"compile_s_{b}": times[f"{version}:{b}"]["compile_s"] for b in BOUNDS},
                "ratio": times[long]["median_s"] / times[short]["median_s"],
                "same": differ,
            }
        )
    if "before" in versions:
        for row in rows:
            row["after_over_before_256"] = (
                times[f"after:{BOUNDS[1]}"]["median_s"] / times[f"before:{BOUNDS[1]}"]["median_s"]
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the fixed point alone, 5 repeats")
    parser.add_argument(
        "--before",
        default=BEFORE_BOUNDED,
        metavar="REV",
        help="the git revision timed as `before` ('none': this checkout alone)",
    )
    args = parser.parse_args(argv)
    versions = {"after": ea}
    if args.before != "none":
        versions["before"] = _baseline.load(args.before)
    repeats = 5 if args.quick else 9
    rows = []
    for problem in ("fixed_point",) if args.quick else ("fixed_point", "root_find", "minimise"):
        for kind in ("grad", "vmap_grad"):
            for row in measure(problem, kind, versions, repeats):
                print_row(row)
                rows.append(row)
    print("time(max_steps=256) / time(max_steps=16), target <= 2:")
    for row in rows:
        print(
            f"  {row['problem']:12} {row['outer']:10} {row['version']:7} "
            f"steps {row['steps']:5.1f}  {row['run_s_16'] * 1e3:7.2f} ms -> "
            f"{row['run_s_256'] * 1e3:7.2f} ms  x{row['ratio']:5.2f}"
            + ("" if row["same"] == 0 else f"  (gradients differ by {row['same']:.1e})")
        )
    path = write_rows("unrolled" + ("_quick" if args.quick else ""), rows)
    print(f"rows: {path}")
    return rows


if __name__ == "__main__":
    main()
