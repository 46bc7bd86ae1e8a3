"""Energy attention vs hand-written softmax attention vs `jax.nn.dot_product_attention`.

Question: does obtaining attention as `jax.grad` of an energy cost anything over writing
softmax attention by hand? "Energy" is one descent step of size 1 on
`ea.hopfield_energy`, `q - jax.grad(E)(q) = softmax(beta q k^T) k`, vmapped over heads, with
the library's automatic choice of implementation (`auto`) and, for reference, each one forced
(`naive` autodiff of the log-sum-exp, `blockwise`). The baselines compute the same thing:
`softmax(beta q k^T) k` written out, as one 3-D einsum over heads (`hand_3d`) and as 2-D
matrix products head by head (`hand_2d`); `hand` in the ratios is the faster of the two in
each row. `jax.nn.dot_product_attention` with values = keys takes its own
(seq, heads, dim) layout, prepared outside the timed call (`dpa`; XLA's implementation on a
CPU). Forward = the attention output; training step = value and gradient of `sum(out ** 2)`
with respect to queries and keys. head_dim 64, float32. Medians of interleaved repeats, each
after an untimed call of the same function (every contender alike).

Roofline, measured in the same process before and after the table: the fastest of OpenBLAS's
`sgemm` (NumPy's float32 `matmul`) and XLA's `jnp.dot` with its YNN (XNNPACK) fusions off and
at its default, each on two 2048 x 2048 float32 matrices (2 * 2048^3 flops). The core's
physical float32 peak is measured in the same run by an FMA loop compiled for this CPU
(`_common.fma_peak_gflops`; `benchmarks/README.md` gives the peaks of the cores measured;
`--peak-gflops` gives it where no C compiler is found) and printed next to it. The run checks
that it is pinned to one core (`taskset`) and stops if any measured rate is above the peak
of the cores it may use. Every row gives the
`auto` energy's rate, counting 4 * seq^2 * head_dim flops per head for the forward (scores
and output) and 12 * seq^2 * head_dim for the training step (forward and the backward's five
products, without the probabilities' recomputation), and its fraction of the roofline.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/attention_speed.py [--quick]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fma_peak_gflops, host_cpu, interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
BETA = HEAD_DIM**-0.5
ROOFLINE_SIZE = 2048
#: Flops per head and per score entry (seq x seq) over head_dim, as counted for each mode.
FLOPS_PER_ENTRY = {"forward": 4, "training": 12}
#: XLA's option that picks which operations its CPU backend hands to XNNPACK's YNN kernels.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


def roofline_samples(repeats: int) -> dict[str, list[float]]:
    """Seconds per product of two `ROOFLINE_SIZE`-square float32 matrices by OpenBLAS
    (`numpy.matmul`) and by XLA (`jnp.dot`, YNN fusions off and at XLA's default), each
    after a warm-up call, `repeats` times, interleaved."""
    x, y = jr.normal(jr.key(0), (2, ROOFLINE_SIZE, ROOFLINE_SIZE), jnp.float32)
    a, b = np.asarray(x), np.asarray(y)
    ynn_off = jax.jit(jnp.dot).lower(x, y).compile({YNN_OPTION: ""})
    xla_default = jax.jit(jnp.dot).lower(x, y).compile()
    products = {
        "openblas_sgemm": lambda: np.matmul(a, b),
        "xla_dot_ynn_off": lambda: ynn_off(x, y),
        "xla_dot_default": lambda: xla_default(x, y),
    }
    samples: dict[str, list[float]] = {name: [] for name in products}
    for product in products.values():
        jax.block_until_ready(product())
    for _ in range(repeats):
        for name, product in products.items():
            start = time.perf_counter()
            jax.block_until_ready(product())
            samples[name].append(time.perf_counter() - start)
    return samples


def gflops(seconds: float, flops: float) -> float:
    return flops / seconds / 1e9


def energy_attention(implementation: str):
    """One unit descent step on the Hopfield energy per head, as `ea.nn.HopfieldAttention`
    takes it: the implementation is decided once for all heads (heads x seq x mem entries)."""

    def attend(q, k):
        method = ea.select_implementation(
            implementation,
            entries=q.shape[0] * q.shape[1] * k.shape[1],
            dtype=q.dtype,
            head_dim=HEAD_DIM,
            structured_mask=False,
        )

        def one_head(q, k):
            return q - jax.grad(ea.HopfieldEnergy(k, beta=BETA, implementation=method))(q)

        return jax.vmap(one_head)(q, k)

    return attend


def hand_attention_3d(q, k):
    scores = BETA * jnp.einsum("hsd,hmd->hsm", q, k)
    return jnp.einsum("hsm,hmd->hsd", jax.nn.softmax(scores, axis=-1), k)


def hand_attention_2d(q, k):
    """Head by head, each a 2-D `softmax(beta q k^T) k`: plain matrix products."""
    heads = [jax.nn.softmax(BETA * q[h] @ k[h].T, axis=-1) @ k[h] for h in range(q.shape[0])]
    return jnp.stack(heads)


def dpa_attention(q, k):
    """`jax.nn.dot_product_attention` on (seq, heads, dim) inputs, its own layout."""
    return jax.nn.dot_product_attention(q, k, k, scale=BETA)


def training_step(attend):
    return jax.value_and_grad(lambda q, k: jnp.sum(jnp.square(attend(q, k))), argnums=(0, 1))


def check_rate(name: str, rate: float, limit: float, cores: int) -> None:
    """Stop the run when a measured rate is above what its cores can do."""
    if rate > limit:
        raise SystemExit(
            f"{name} measured {rate:.1f} GFLOP/s, above the float32 peak of the {cores} "
            f"core(s) this process may run on ({limit:.1f} GFLOP/s): the run is not what it "
            "claims (pin it with taskset -c 0, or give --peak-gflops)"
        )


def roofline_rates(repeats: int) -> dict[str, float]:
    """GFLOP/s of each roofline product, medians of `repeats` interleaved samples."""
    flops = 2 * ROOFLINE_SIZE**3
    return {
        name: gflops(statistics.median(times), flops)
        for name, times in roofline_samples(repeats).items()
    }


def best_product(before: dict[str, float], after: dict[str, float]) -> tuple[str, float]:
    """The roofline: the product with the highest mean of its rates before and after."""
    rates = {name: (before[name] + after[name]) / 2 for name in before}
    best = max(rates, key=rates.get)
    return best, rates[best]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq <= 2048, one head, 3 repeats")
    parser.add_argument("--seqs", type=int, nargs="*", help="sequence lengths")
    parser.add_argument("--heads", type=int, nargs="*", help="numbers of heads")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (median reported)")
    parser.add_argument(
        "--peak-gflops",
        type=float,
        help="one core's float32 peak (default: measured by an FMA loop compiled for this CPU)",
    )
    args = parser.parse_args(argv)
    if args.peak_gflops is None:
        args.peak_gflops = fma_peak_gflops()
        if args.peak_gflops is None:
            raise SystemExit(
                "could not measure the core's float32 peak (no C compiler, or the FMA loop "
                "did not build): give it with --peak-gflops"
            )
    seqs = args.seqs or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    heads_list = args.heads or ([1] if args.quick else [1, 8])
    repeats = args.repeats or (3 if args.quick else 5)
    cores = host_cpu()["cpu_cores_usable"]
    limit = args.peak_gflops * cores
    if cores != 1:
        print(
            f"WARNING: this process may run on {cores} cores; the fractions below are not of "
            "one core's roofline (pin it: taskset -c 0)",
            flush=True,
        )
    # The roofline before the table and again after it (the machine's load drifts).
    before = roofline_rates(2 * repeats + 1)
    print(
        "roofline products (before), GFLOP/s: "
        + ", ".join(f"{name} {rate:.1f}" for name, rate in before.items())
        + f"; physical peak {args.peak_gflops:.1f} per core, {cores} core(s)",
        flush=True,
    )
    for name, rate in before.items():
        check_rate(name, rate, limit, cores)
    contenders = {
        "energy": energy_attention("auto"),
        "energy_naive": energy_attention("naive"),
        "energy_blockwise": energy_attention("blockwise"),
        "hand_3d": hand_attention_3d,
        "hand_2d": hand_attention_2d,
        "dpa": dpa_attention,
    }
    rows = []
    for heads in heads_list:
        for seq in seqs:
            if heads * seq * seq > 8 * 4096 * 4096:  # over a minute per repeat on one core
                continue
            kq, kk = jr.split(jr.key(seq + heads))
            q = jr.normal(kq, (heads, seq, HEAD_DIM), jnp.float32)
            k = jr.normal(kk, (heads, seq, HEAD_DIM), jnp.float32)
            dpa_layout = (q.transpose(1, 0, 2), k.transpose(1, 0, 2))
            chosen = ea.select_implementation(
                "auto",
                entries=heads * seq * seq,
                dtype=jnp.float32,
                head_dim=HEAD_DIM,
                structured_mask=False,
            )
            outs = {name: jax.jit(fn)(q, k) for name, fn in contenders.items() if name != "dpa"}
            outs["dpa"] = jax.jit(dpa_attention)(*dpa_layout).transpose(1, 0, 2)
            error = max(float(jnp.max(jnp.abs(out - outs["hand_3d"]))) for out in outs.values())
            number = max(1, 2048 // seq)
            for mode, wrap in (("forward", lambda f: f), ("training", training_step)):
                timing = interleaved(
                    {name: wrap(fn) for name, fn in contenders.items()},
                    q,
                    k,
                    repeats=repeats,
                    number=number,
                    warm=True,
                    args_for={"dpa": dpa_layout},
                )
                hand = min(("hand_2d", "hand_3d"), key=lambda n: timing[n]["median_s"])
                base = timing[hand]["median_s"]
                flops = FLOPS_PER_ENTRY[mode] * heads * seq * seq * HEAD_DIM
                row = {
                    "benchmark": "attention_speed",
                    "mode": mode,
                    "heads": heads,
                    "seq": seq,
                    "head_dim": HEAD_DIM,
                    "dtype": "float32",
                    "cores": cores,
                    "auto_implementation": chosen,
                    "max_abs_difference_to_hand": error,
                    "repeats": repeats,
                    "timing": timing,
                    "hand": hand,
                    "ratio_to_hand": {name: t["median_s"] / base for name, t in timing.items()},
                    "flops": flops,
                    "gflops": {name: gflops(t["median_s"], flops) for name, t in timing.items()},
                }
                for name, rate in row["gflops"].items():
                    check_rate(f"{mode} {name} (heads {heads}, seq {seq})", rate, limit, cores)
                rows.append(row)
                ratios = "  ".join(f"{n} {r:.2f}" for n, r in row["ratio_to_hand"].items())
                print(
                    f"{mode:8s} heads {heads} seq {seq:5d} hand ({hand}) {base * 1e3:8.2f} ms  "
                    f"[auto={chosen}]  {ratios}  auto {row['gflops']['energy']:.1f} GFLOP/s",
                    flush=True,
                )
    after = roofline_rates(2 * repeats + 1)
    for name, rate in after.items():
        check_rate(name, rate, limit, cores)
    best, roofline = best_product(before, after)
    print(
        f"roofline: {roofline:.1f} GFLOP/s ({best}; mean of before and after), "
        + ", ".join(f"{n} {before[n]:.1f} / {after[n]:.1f}" for n in before)
        + f" before / after; physical peak {args.peak_gflops:.1f} GFLOP/s per core"
    )
    for row in rows:
        row["roofline_gflops"] = roofline
        row["roofline_product"] = best
        row["roofline_products_before_after"] = {n: [before[n], after[n]] for n in before}
        row["peak_gflops_per_core"] = args.peak_gflops
        row["fraction_of_roofline"] = {
            name: rate / roofline for name, rate in row["gflops"].items()
        }
        row["fraction_of_peak"] = {
            name: rate / (args.peak_gflops * cores) for name, rate in row["gflops"].items()
        }
        auto = row["gflops"]["energy"]
        print(
            f"{row['mode']:8s} heads {row['heads']} seq {row['seq']:5d}  auto {auto:6.1f} "
            f"GFLOP/s  {auto / roofline:4.0%} of roofline, "
            f"{row['fraction_of_peak']['energy']:4.0%} of peak  (hand "
            f"{row['fraction_of_roofline'][row['hand']]:4.0%})"
        )
    path = write_rows("attention_speed" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
