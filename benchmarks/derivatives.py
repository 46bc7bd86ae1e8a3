"""Forward mode and second derivatives of the blockwise attention energy: time and memory.

Question: the attention log-sum-exp's blockwise path became a forward-mode rule
(`jax.custom_jvp`-style primitives) whose transpose gives reverse mode, instead of
`custom_vjp`s. What do value + gradient, the JVP, the Hessian-vector products (forward over
reverse, reverse over reverse) and a training step through the attention step cost now,
against the package before the change (`before`, commit 32fcd46, extracted by
`_baseline.py`, where only reverse mode existed), measured in the same run?

- Time: medians of interleaved repeats of the compiled programs, each sample after an untimed
  call, one CPU core pinned (`taskset -c 0`). `ea.hopfield_energy` per head (vmapped over
  heads), blockwise, head_dim 64, float32, beta = 1/8, keys as long as the queries. The
  training step is `value_and_grad` of `sum((q - grad E(q)) ** 2)` in queries and keys, as in
  `attention_speed.py`, whose flop count (12 seq^2 d per head) and roofline (the fastest of
  OpenBLAS `sgemm` and XLA's `jnp.dot` with YNN off and on, 2048-square float32 matrices,
  timed before and after in the same run) give its fraction of the roofline.
- Memory: XLA's accounting of each compiled program's temporary buffers (inputs and outputs
  excluded), read after compiling, at seq 8192, one head, against naive autodiff of the
  score matrix.

Targets: value + gradient <= 1.05 x before; no training-step roofline fraction more than 5 points
below before; JVP <= 2 x the value (see `benchmarks/README.md` for why the value alone cannot be the
unit); forward-over-reverse HVP <= 3 x value + gradient; at seq 8192 value + gradient, JVP and both
HVPs each <= 5% of naive autodiff's temporary memory.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/derivatives.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baseline  # noqa: E402
from _common import interleaved, print_row, write_rows  # noqa: E402
from attention_speed import FLOPS_PER_ENTRY, best_product, gflops, roofline_rates  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
BETA = HEAD_DIM**-0.5
MIB = 2**20
#: The last commit whose blockwise path was custom_vjps (reverse mode only).
BEFORE = "32fcd46"


def energy_of(package, implementation: str):
    """Sum over heads of the Hopfield energy, `(heads, seq, dim)` queries and keys."""

    def energy(q, k):
        def one_head(q, k):
            return package.hopfield_energy(q, k, beta=BETA, implementation=implementation)

        return jnp.sum(jax.vmap(one_head)(q, k))

    return energy


def programs(energy, *, forward_mode: bool = True) -> dict:
    """The programs timed and measured, as functions of `(q, k)`; the direction is `(q, k)`."""

    def hvp_reverse(q, k):
        def directional(q, k):
            gq, gk = jax.grad(energy, argnums=(0, 1))(q, k)
            return jnp.sum(gq * q) + jnp.sum(gk * k)

        return jax.grad(directional, argnums=(0, 1))(q, k)

    def train(q, k):
        def loss(q, k):
            return jnp.sum(jnp.square(q - jax.grad(energy)(q, k)))

        return jax.value_and_grad(loss, argnums=(0, 1))(q, k)

    out = {
        "value": energy,
        "value_grad": jax.value_and_grad(energy, argnums=(0, 1)),
        "hvp_reverse": hvp_reverse,
        "train": train,
    }
    if forward_mode:
        out["jvp"] = lambda q, k: jax.jvp(energy, (q, k), (q, k))
        out["hvp_forward"] = lambda q, k: jax.jvp(jax.grad(energy, argnums=(0, 1)), (q, k), (q, k))[
            1
        ]
    return out


def temp_mib(fn, shape) -> float:
    struct = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.jit(fn).lower(struct, struct).compile().memory_analysis().temp_size_in_bytes / MIB


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 1024 and 2048, 3 repeats")
    parser.add_argument("--seqs", type=int, nargs="*", help="sequence lengths (time)")
    parser.add_argument("--heads", type=int, nargs="*", help="numbers of heads (time)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (median reported)")
    parser.add_argument("--memory-seq", type=int, default=8192, help="seq of the memory rows")
    args = parser.parse_args(argv)
    seqs = args.seqs or ([1024, 2048] if args.quick else [1024, 2048, 4096])
    heads_list = args.heads or ([1] if args.quick else [1, 8])
    repeats = args.repeats or (3 if args.quick else 7)
    before = _baseline.load(BEFORE)
    print(
        f"columns: 'after' = this checkout, 'before' = energyattn at commit {BEFORE} (blockwise "
        "attention as custom_vjps, reverse mode only, so it has no jvp or forward-over-reverse "
        "rows); times in ms, medians of interleaved repeats"
    )
    rows = []

    def add(row):
        rows.append(row)
        print_row(row)

    roofline_before = roofline_rates(2 * repeats + 1)
    for heads in heads_list:
        for seq in seqs:
            q, k = jr.normal(jr.key(seq), (2, heads, seq, HEAD_DIM), jnp.float32)
            contenders = {f"after {n}": f for n, f in programs(energy_of(ea, "blockwise")).items()}
            old = programs(energy_of(before, "blockwise"), forward_mode=False)
            contenders.update({f"before {n}": f for n, f in old.items()})
            timings = interleaved(contenders, q, k, repeats=repeats, warm=True)
            ms = {name: 1e3 * t["median_s"] for name, t in timings.items()}
            add(
                {
                    "kind": "time",
                    "heads": heads,
                    "seq": seq,
                    **{f"{n} ms": v for n, v in ms.items()},
                }
            )
            add(
                {
                    "kind": "ratios",
                    "heads": heads,
                    "seq": seq,
                    "value_grad after/before": ms["after value_grad"] / ms["before value_grad"],
                    "train after/before": ms["after train"] / ms["before train"],
                    "hvp_reverse after/before": ms["after hvp_reverse"] / ms["before hvp_reverse"],
                    "jvp / value": ms["after jvp"] / ms["after value"],
                    "jvp / value_grad": ms["after jvp"] / ms["after value_grad"],
                    "hvp_forward / value_grad": ms["after hvp_forward"] / ms["after value_grad"],
                    "hvp_reverse / value_grad": ms["after hvp_reverse"] / ms["after value_grad"],
                    "train_gflops_after": gflops(
                        ms["after train"] / 1e3,
                        FLOPS_PER_ENTRY["training"] * heads * seq**2 * HEAD_DIM,
                    ),
                    "train_gflops_before": gflops(
                        ms["before train"] / 1e3,
                        FLOPS_PER_ENTRY["training"] * heads * seq**2 * HEAD_DIM,
                    ),
                }
            )
    roofline_after = roofline_rates(2 * repeats + 1)
    _, roofline = best_product(roofline_before, roofline_after)
    for row in rows:
        if row["kind"] == "ratios":
            row["roofline_gflops"] = roofline
            for when in ("after", "before"):
                row[f"train_of_roofline_{when}"] = row[f"train_gflops_{when}"] / roofline
    print(f"roofline {roofline:.1f} GFLOP/s")

    shape = (1, args.memory_seq, HEAD_DIM)
    naive = {n: temp_mib(f, shape) for n, f in programs(energy_of(ea, "naive")).items()}
    blockwise = {n: temp_mib(f, shape) for n, f in programs(energy_of(ea, "blockwise")).items()}
    old = {
        n: temp_mib(f, shape)
        for n, f in programs(energy_of(before, "blockwise"), forward_mode=False).items()
    }
    for name in naive:
        add(
            {
                "kind": "memory",
                "seq": args.memory_seq,
                "program": name,
                "naive_mib": naive[name],
                "blockwise_mib": blockwise[name],
                "of_naive": blockwise[name] / naive[name],
                "before_mib": old.get(name, float("nan")),
            }
        )
    path = write_rows("derivatives_quick" if args.quick else "derivatives", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
