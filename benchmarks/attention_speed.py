"""Energy attention vs hand-written softmax attention vs `jax.nn.dot_product_attention`.

Question: does obtaining attention as `jax.grad` of an energy cost anything over writing
softmax attention by hand? "Energy" is one descent step of size 1 on
`ea.hopfield_energy`, `q - jax.grad(E)(q) = softmax(beta q k^T) k`, vmapped over heads, with
the library's automatic choice of implementation (`auto`) and, for reference, each one forced
(`naive` autodiff of the log-sum-exp, `blockwise`). The baselines compute the same thing:
`softmax(beta q k^T) k` written out (`hand`) and `jax.nn.dot_product_attention` with values =
keys (`dpa`; XLA's implementation on a CPU). Forward = the attention output; training step =
value and gradient of `sum(out ** 2)` with respect to queries and keys. head_dim 64, float32.
Medians of interleaved repeats, each after an untimed call of the same function.

Targets (same device, same run, seq 1024-4096): forward <= 1.05x and training <= 1.1x `hand`.

Roofline: the rate of XLA's matrix product of two 2048 x 2048 float32 matrices (`jnp.dot`,
2 * 2048^3 flops), measured in the same run (before and after the table; the median of all
its repeats). Every row gives the `auto` energy's rate, counting 4 * seq^2 * head_dim flops
per head for the forward (scores and output) and 12 * seq^2 * head_dim for the training step
(forward and the backward's five products, without the probabilities' recomputation), and
its fraction of the roofline. Targets at seq >= 2048: forward >= 75%, training >= 70%.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
BETA = HEAD_DIM**-0.5
ROOFLINE_SIZE = 2048
#: Flops per head and per score entry (seq x seq) over head_dim, as counted for each mode.
FLOPS_PER_ENTRY = {"forward": 4, "training": 12}


def roofline_samples(repeats: int) -> list[float]:
    """Seconds per `jnp.dot` of two `ROOFLINE_SIZE`-square float32 matrices (compiled, after a
    warm-up run), `repeats` times."""
    x, y = jr.normal(jr.key(0), (2, ROOFLINE_SIZE, ROOFLINE_SIZE), jnp.float32)
    dot = jax.jit(jnp.dot).lower(x, y).compile()
    jax.block_until_ready(dot(x, y))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(dot(x, y))
        samples.append(time.perf_counter() - start)
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


def hand_attention(q, k):
    scores = BETA * jnp.einsum("hsd,hmd->hsm", q, k)
    return jnp.einsum("hsm,hmd->hsd", jax.nn.softmax(scores, axis=-1), k)


def dpa_attention(q, k):
    # (heads, seq, dim) -> (seq, heads, dim), the layout jax.nn takes.
    out = jax.nn.dot_product_attention(
        q.transpose(1, 0, 2), k.transpose(1, 0, 2), k.transpose(1, 0, 2), scale=BETA
    )
    return out.transpose(1, 0, 2)


def training_step(attend):
    return jax.value_and_grad(lambda q, k: jnp.sum(jnp.square(attend(q, k))), argnums=(0, 1))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq <= 2048, 3 repeats")
    parser.add_argument("--seqs", type=int, nargs="*", help="sequence lengths")
    parser.add_argument("--heads", type=int, nargs="*", help="numbers of heads")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (median reported)")
    args = parser.parse_args(argv)
    seqs = args.seqs or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    heads_list = args.heads or [1, 8]
    repeats = args.repeats or (3 if args.quick else 5)
    # The roofline before the table (and again after it: the machine's load drifts).
    roofline_before = roofline_samples(2 * repeats + 1)
    flops_roofline = 2 * ROOFLINE_SIZE**3
    print(
        f"roofline (before): {gflops(statistics.median(roofline_before), flops_roofline):.1f} "
        f"GFLOP/s ({ROOFLINE_SIZE}^3 float32 matrix product)",
        flush=True,
    )
    contenders = {
        "energy": energy_attention("auto"),
        "energy_naive": energy_attention("naive"),
        "energy_blockwise": energy_attention("blockwise"),
        "hand": hand_attention,
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
            chosen = ea.select_implementation(
                "auto",
                entries=heads * seq * seq,
                dtype=jnp.float32,
                head_dim=HEAD_DIM,
                structured_mask=False,
            )
            outs = {name: jax.jit(fn)(q, k) for name, fn in contenders.items()}
            error = max(float(jnp.max(jnp.abs(out - outs["hand"]))) for out in outs.values())
            number = max(1, 2048 // seq)
            for mode, wrap in (("forward", lambda f: f), ("training", training_step)):
                timing = interleaved(
                    {name: wrap(fn) for name, fn in contenders.items()},
                    q,
                    k,
                    repeats=repeats,
                    number=number,
                    warm=True,
                )
                base = timing["hand"]["median_s"]
                flops = FLOPS_PER_ENTRY[mode] * heads * seq * seq * HEAD_DIM
                row = {
                    "benchmark": "attention_speed",
                    "mode": mode,
                    "heads": heads,
                    "seq": seq,
                    "head_dim": HEAD_DIM,
                    "dtype": "float32",
                    "auto_implementation": chosen,
                    "max_abs_difference_to_hand": error,
                    "repeats": repeats,
                    "timing": timing,
                    "ratio_to_hand": {name: t["median_s"] / base for name, t in timing.items()},
                    "flops": flops,
                    "gflops": {name: gflops(t["median_s"], flops) for name, t in timing.items()},
                }
                rows.append(row)
                ratios = "  ".join(f"{n} {r:.2f}" for n, r in row["ratio_to_hand"].items())
                print(
                    f"{mode:8s} heads {heads} seq {seq:5d} hand {base * 1e3:8.2f} ms  "
                    f"[auto={chosen}]  {ratios}  auto {row['gflops']['energy']:.1f} GFLOP/s",
                    flush=True,
                )
    roofline_after = roofline_samples(2 * repeats + 1)
    roofline = gflops(statistics.median(roofline_before + roofline_after), flops_roofline)
    print(
        f"roofline: {roofline:.1f} GFLOP/s (before "
        f"{gflops(statistics.median(roofline_before), flops_roofline):.1f}, after "
        f"{gflops(statistics.median(roofline_after), flops_roofline):.1f})"
    )
    for row in rows:
        row["roofline_gflops"] = roofline
        row["roofline_gflops_before_after"] = [
            gflops(statistics.median(samples), flops_roofline)
            for samples in (roofline_before, roofline_after)
        ]
        row["fraction_of_roofline"] = {
            name: rate / roofline for name, rate in row["gflops"].items()
        }
        auto = row["gflops"]["energy"]
        print(
            f"{row['mode']:8s} heads {row['heads']} seq {row['seq']:5d}  auto {auto:6.1f} "
            f"GFLOP/s  {auto / roofline:4.0%} of roofline  (hand "
            f"{row['fraction_of_roofline']['hand']:4.0%})"
        )
    path = write_rows("attention_speed" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
