"""Peak temporary memory of energy attention (forward + backward): naive autodiff vs blockwise.

Question: how much memory does the attention step `value_and_grad(E)(q)` of the Hopfield
energy need as the sequence grows, with naive autodiff of the log-sum-exp and with the
blockwise custom_vjp? And the Energy Transformer's attention energy (heads, keys = queries'
tokens, diagonal excluded)? The number is XLA's own accounting of the compiled program's
temporary buffers (`memory_analysis().temp_size_in_bytes`; inputs and outputs excluded), read
after compiling, so sizes that could never run are still measured. Blockwise programs up to
`--run-up-to` are also run once, timed, to show they do run; naive ones run only where they
fit comfortably (`--naive-run-up-to`). For the Hopfield energy the memory of training through
the step (the gradient of a loss of `q - grad E(q)`: second derivatives) is measured too.
head_dim 64, float32, keys = queries' length.

Targets: blockwise at seq 8192 <= 10% of naive; blockwise runs at seq 32768 (8 heads) on a
24 GiB machine, where naive autodiff needs more memory than the machine has.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/attention_memory.py [--quick]
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
MIB = 2**20


def hopfield_step(implementation: str):
    """Energy and attention update of every head: `value_and_grad` of the Hopfield energy."""

    def step(q, k):
        def one_head(q, k):
            energy = ea.HopfieldEnergy(k, beta=HEAD_DIM**-0.5, implementation=implementation)
            return jax.value_and_grad(energy)(q)

        return jax.vmap(one_head)(q, k)

    return step


def hopfield_training(implementation: str):
    """Training through the attention step: gradient of `sum(out ** 2)` with respect to the
    queries and keys, where `out = q - grad E(q)` (second derivatives of the energy)."""
    step = hopfield_step(implementation)

    def train(q, k):
        return jax.grad(lambda q, k: jnp.sum(jnp.square(q - step(q, k)[1])), (0, 1))(q, k)

    return train


def transformer_step(implementation: str):
    """Energy and gradient of the ET attention energy (tokens of width 64 per head)."""

    def step(g, w):
        def energy(g):
            return ea.transformer_attention_energy(
                g, w, w, beta=HEAD_DIM**-0.5, implementation=implementation
            )

        return jax.value_and_grad(energy)(g)

    return step


def inputs(energy: str, heads: int, seq: int):
    kq, kk = jr.split(jr.key(seq))
    if energy == "hopfield":
        shape = (heads, seq, HEAD_DIM)
        return jr.normal(kq, shape, jnp.float32), jr.normal(kk, shape, jnp.float32)
    dim = HEAD_DIM
    g = jr.normal(kq, (seq, dim), jnp.float32)
    w = jr.normal(kk, (heads, HEAD_DIM, dim), jnp.float32) / dim**0.5
    return g, w


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq <= 8192, runs up to 4096")
    parser.add_argument("--run-up-to", type=int, help="run blockwise programs up to this seq")
    parser.add_argument("--naive-run-up-to", type=int, default=4096)
    args = parser.parse_args(argv)
    seqs = [1024, 2048, 4096, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    run_up_to = args.run_up_to or (4096 if args.quick else 32768)
    rows = []
    cases = [("hopfield", 1), ("hopfield", 8), ("transformer", 8)]
    for energy, heads in cases:
        make = hopfield_step if energy == "hopfield" else transformer_step
        for seq in seqs:
            if energy == "transformer" and seq > 8192 and args.quick:
                continue
            row = {
                "benchmark": "attention_memory",
                "energy": energy,
                "heads": heads,
                "seq": seq,
                "head_dim": HEAD_DIM,
                "dtype": "float32",
                "score_matrix_mib": heads * seq * seq * 4 / MIB,
            }
            args_ = inputs(energy, heads, seq)
            for impl in ("naive", "blockwise"):
                compiled = jax.jit(make(impl)).lower(*args_).compile()
                row[f"{impl}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / MIB
                limit = run_up_to if impl == "blockwise" else args.naive_run_up_to
                # Only the Hopfield case with 8 heads is run at the longest sequences.
                if seq <= limit and (seq <= 8192 or (energy, heads) == ("hopfield", 8)):
                    start = time.perf_counter()
                    value, grad = jax.block_until_ready(compiled(*args_))
                    row[f"{impl}_run_s"] = time.perf_counter() - start
                    row[f"{impl}_finite"] = bool(
                        jnp.all(jnp.isfinite(value)) & jnp.all(jnp.isfinite(grad))
                    )
                    del value, grad
            row["blockwise_over_naive"] = row["blockwise_temp_mib"] / row["naive_temp_mib"]
            if energy == "hopfield":  # training through the step (compiled, not run)
                for impl in ("naive", "blockwise"):
                    compiled = jax.jit(hopfield_training(impl)).lower(*args_).compile()
                    temp = compiled.memory_analysis().temp_size_in_bytes / MIB
                    row[f"training_{impl}_temp_mib"] = temp
            rows.append(row)
            ran = f"ran {row['blockwise_run_s']:.1f} s" if "blockwise_run_s" in row else ""
            print(
                f"{energy:11s} heads {heads} seq {seq:5d}  naive {row['naive_temp_mib']:10.1f} MiB"
                f"  blockwise {row['blockwise_temp_mib']:8.1f} MiB"
                f"  ({100 * row['blockwise_over_naive']:.1f}%)  {ran}"
                + (
                    f"  | training naive {row['training_naive_temp_mib']:.1f} MiB, blockwise "
                    f"{row['training_blockwise_temp_mib']:.1f} MiB"
                    if "training_naive_temp_mib" in row
                    else ""
                ),
                flush=True,
            )
    path = write_rows("attention_memory" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
