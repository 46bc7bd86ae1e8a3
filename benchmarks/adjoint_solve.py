"""Dense or matrix-free: where the implicit adjoint's automatic linear solve switches.

Question: for the package's implicit layers, at how many unknowns does building the dense
Jacobian ($n$ Jacobian-vector products, then LU / Cholesky) cost as much as a Krylov solve
(GMRES / CG, stopped at its tolerance)? `ea.AutoLinearSolver` switches there
(`DENSE_ADJOINT_LIMIT`, `DENSE_ADJOINT_LIMIT_SYMMETRIC` in `energyattn/_solver/_linear.py`).
Each row: the gradient of a sum of squares of the layer's output with respect to its input,
jitted and vmapped over a batch of 32, the two linear solvers timed interleaved in one run;
float32; XLA's YNN fusions off (see the known issues in the docs).

- `smt`: `ea.nn.SpinTransformerAttention(24, 4)` (head dimension 6), n = tokens x 6 per head;
- `mean_field`: `ea.nn.MeanFieldAttention(tokens, 4)` (deep implicit attention, neural
  mean field), n = tokens x 4;
- `minimum`: `ea.minimise` of a modern Hopfield energy of n unknowns (64 patterns, beta 1),
  Cholesky against CG.

    python benchmarks/adjoint_solve.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402
from energyattn._cli.common import avoid_xla_cpu_ynn_fusions  # noqa: E402

avoid_xla_cpu_ynn_fusions()

BATCH = 32


class _Minimum(eqx.Module):
    """The minimum of a modern Hopfield energy tilted by the input."""

    patterns: jax.Array
    linear_solver: ea.AbstractLinearSolver

    def __call__(self, x):
        def energy(y, x):
            lse = jax.nn.logsumexp(self.patterns @ y)
            return 0.5 * jnp.sum(y**2) - lse - jnp.dot(x, y)

        adjoint = ea.ImplicitAdjoint(linear_solver=self.linear_solver)
        return ea.minimise(energy, x, x, adjoint=adjoint).value


def layer(kind: str, tokens: int, linear_solver, key):
    """The layer, the shape of one input, and the unknowns of one of its implicit solves."""
    adjoint = ea.ImplicitAdjoint(linear_solver=linear_solver)
    if kind == "smt":  # 4 heads of dimension 6, solved per head
        smt = ea.nn.SpinTransformerAttention(24, 4, adjoint=adjoint, key=key)
        return smt, (tokens, 24), tokens * smt.head_dim
    if kind == "mean_field":
        return (
            ea.nn.MeanFieldAttention(tokens, 4, adjoint=adjoint, key=key),
            (tokens, 4),
            tokens * 4,
        )
    n = tokens * 4
    patterns = jr.normal(key, (64, n)) / n**0.5
    return _Minimum(patterns, linear_solver), (n,), n


def run(kind: str, tokens: int, repeats: int) -> dict:
    key = jr.PRNGKey(0)
    symmetric = kind == "minimum"
    solvers = {"dense": ea.Cholesky() if symmetric else ea.LU()}
    solvers["krylov"] = ea.CG() if symmetric else ea.GMRES()
    fns = {}
    for name, linear_solver in solvers.items():
        module, shape, unknowns = layer(kind, tokens, linear_solver, key)
        fns[name] = lambda x, m=module: jax.grad(lambda x: jnp.sum(jax.vmap(m)(x) ** 2))(x)
    x = jr.normal(jr.PRNGKey(1), (BATCH, *shape))
    times = interleaved(fns, x, repeats=repeats)
    dense, krylov = times["dense"]["median_s"], times["krylov"]["median_s"]
    return {
        "benchmark": "adjoint_solve",
        "layer": kind,
        "unknowns": unknowns,
        "batch": BATCH,
        "dense_s": dense,
        "krylov_s": krylov,
        "dense_over_krylov": dense / krylov,
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes per layer, 3 repeats")
    args = parser.parse_args(argv)
    sizes = {
        "smt": [4, 8] if args.quick else [2, 4, 8, 17, 33],
        "mean_field": [8, 16] if args.quick else [2, 4, 8, 16, 32],
        "minimum": [2, 4] if args.quick else [2, 4, 8, 16, 32, 64],
    }
    rows = []
    for kind, token_counts in sizes.items():
        for tokens in token_counts:
            row = run(kind, tokens, 3 if args.quick else 7)
            rows.append(row)
            print(
                f"{kind:10s} n = {row['unknowns']:4d}: dense {row['dense_s'] * 1e3:8.2f} ms, "
                f"matrix-free {row['krylov_s'] * 1e3:8.2f} ms, dense / matrix-free "
                f"{row['dense_over_krylov']:5.2f}",
                flush=True,
            )
    path = write_rows("adjoint_solve" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
