"""Energy attention vs hand-written softmax attention vs `jax.nn.dot_product_attention`.

Question: does obtaining attention as `jax.grad` of an energy cost anything over writing
softmax attention by hand? "Energy" is one descent step of size 1 on
`ea.hopfield_energy`, `q - jax.grad(E)(q) = softmax(beta q k^T) k`, vmapped over heads, with
the library's automatic choice of implementation (`auto`) and, for reference, each one forced
(`naive` autodiff of the log-sum-exp, `blockwise`). The baselines compute the same thing:
`softmax(beta q k^T) k` written out (`hand`) and `jax.nn.dot_product_attention` with values =
keys (`dpa`; XLA's implementation on a CPU). Forward = the attention output; training step =
value and gradient of `sum(out ** 2)` with respect to queries and keys. head_dim 64, float32.

Targets (same device, same run, seq 1024-4096): forward <= 1.05x and training <= 1.1x `hand`.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/attention_speed.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
BETA = HEAD_DIM**-0.5


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
                )
                base = timing["hand"]["median_s"]
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
                }
                rows.append(row)
                ratios = "  ".join(f"{n} {r:.2f}" for n, r in row["ratio_to_hand"].items())
                print(
                    f"{mode:8s} heads {heads} seq {seq:5d} hand {base * 1e3:8.2f} ms  "
                    f"[auto={chosen}]  {ratios}",
                    flush=True,
                )
    path = write_rows("attention_speed" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
