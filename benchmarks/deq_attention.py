"""Deep-equilibrium attention at scale: implicit vs unrolled gradients of a fixed point of
attention, memory against iterations and sequence length.

Question: the fixed point $z^* = x + \\tfrac12\\,\\mathrm{attention}(z^*, M)$ of an
attention map (the gradient step of `ea.hopfield_energy`, so blockwise above 2^17 score
entries) differentiated implicitly (`ea.fixed_point` with `ea.ImplicitAdjoint`: the adjoint
linearises the map through the attention's forward-mode rule and solves with GMRES on its
transpose) against backpropagation through the unrolled iterations (`ea.UnrolledAdjoint`,
Picard with zero tolerances, so exactly `max_steps` steps). How does the gradient's
temporary memory grow with the number of iterations (10, 20, 40, 80 at seq 2048) and with the
sequence (1024 to 16384 at 40 iterations), and do the gradients agree where both run?

Memory is XLA's accounting of the compiled gradient (`memory_analysis().temp_size_in_bytes`,
inputs and outputs excluded), read after compiling; the naive score matrix of one attention
(seq x mem x 4 bytes) is given for scale. Programs up to `--run-up-to` are run once: their
time, Anderson's steps, and the relative 2-norm distance between the implicit and unrolled
gradients. dim 64, memories = tokens, beta = 1/dim, float32.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/deq_attention.py [--quick]
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_row, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

DIM = 64
MIB = 2**20


def attention_map(z, args):
    x, memory = args
    force = jax.grad(ea.hopfield_energy)(z, memory, beta=1.0 / DIM)  # z - attention(z)
    return x + 0.5 * (z - force)


def gradient(adjoint: str, max_steps: int):
    """The gradient of a loss of the fixed point with respect to the input and the memory,
    and the number of steps the forward solve took."""

    def loss(x, memory):
        if adjoint == "implicit":
            solver, how, throw = ea.Anderson(rtol=1e-6, atol=1e-6), ea.ImplicitAdjoint(), True
        else:
            solver, how, throw = ea.Picard(rtol=0.0, atol=0.0), ea.UnrolledAdjoint(), False
        fixed = ea.fixed_point(
            attention_map,
            jnp.zeros_like(x),
            (x, memory),
            solver=solver,
            adjoint=how,
            max_steps=max_steps,
            throw=throw,
        )
        return jnp.mean(jnp.square(fixed.value)), fixed.num_steps

    return jax.grad(loss, argnums=(0, 1), has_aux=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq up to 4096, iterations 10/40")
    parser.add_argument("--run-up-to", type=int, default=4096, help="also run up to this seq")
    args = parser.parse_args(argv)
    iterations = [10, 40] if args.quick else [10, 20, 40, 80]
    seqs = [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    cases = [(2048, n) for n in iterations] + [(s, 40) for s in seqs if s != 2048]
    rows = []
    for seq, steps in cases:
        x, memory = jr.normal(jr.key(seq), (2, seq, DIM), jnp.float32)
        row = {"seq": seq, "max_steps": steps, "score_matrix_mib": seq * seq * 4 / MIB}
        compiled = {}
        for adjoint in ("implicit", "unrolled"):
            compiled[adjoint] = jax.jit(gradient(adjoint, steps)).lower(x, memory).compile()
            row[f"{adjoint}_mib"] = compiled[adjoint].memory_analysis().temp_size_in_bytes / MIB
        if seq <= args.run_up_to:
            out = {}
            for adjoint, fn in compiled.items():
                jax.block_until_ready(fn(x, memory))  # warm
                start = time.perf_counter()
                out[adjoint] = jax.block_until_ready(fn(x, memory))
                row[f"{adjoint}_s"] = time.perf_counter() - start
            (implicit, anderson_steps), (unrolled, _) = out["implicit"], out["unrolled"]
            row["anderson_steps"] = int(anderson_steps)
            row["gradient_difference"] = max(
                float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
                for a, b in zip(implicit, unrolled, strict=True)
            )
        rows.append(row)
        print_row(row)
    path = write_rows("deq_attention_quick" if args.quick else "deq_attention", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
