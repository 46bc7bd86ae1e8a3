"""Energy Transformer recall: `ea.descend` against a hand-written `lax.scan` of the same update.

Question: does running the ET dynamics through the library's generic descent loop (input
checks, energy recording, finiteness check) cost anything over the loop one would write by
hand? Both compute, per step, `E, dE/dg = value_and_grad(E)(LN(x))` and `x <- x - alpha dE/dg`,
and both return the final tokens and the energy per step. Target: ratio <= 1.1.

    python benchmarks/et_recall.py [--quick]
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

CONFIGS = {
    # name: (dim, heads, head_dim, memories, tokens)
    "tutorial-small": (12, 2, 6, 24, 100),
    "digits-model": (32, 4, 8, 128, 17),
    "medium": (128, 4, 32, 256, 197),
}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, small configs only")
    parser.add_argument("--steps", type=int, default=12, help="descent steps T (default 12)")
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else 21
    names = ["tutorial-small", "digits-model"] if args.quick else list(CONFIGS)
    rows = []
    for name in names:
        dim, heads, head_dim, memories, tokens = CONFIGS[name]
        et = ea.nn.EnergyTransformer(
            dim, num_heads=heads, head_dim=head_dim, num_memories=memories, key=jr.key(0)
        )
        x0 = jr.normal(jr.key(1), (tokens, dim))
        alpha, steps = 0.1, args.steps

        def library(x0, et=et, alpha=alpha, steps=steps):
            descent = et.recall(x0, step_size=alpha, num_steps=steps)
            return descent.value, descent.energies

        def by_hand(x0, et=et, alpha=alpha, steps=steps):
            energy_and_grad = jax.value_and_grad(et.energy)

            def step(x, _):
                value, grad = energy_and_grad(et.layer_norm(x))
                return x - alpha * grad, value

            x, energies = jax.lax.scan(step, x0, None, length=steps)
            final = et.energy(et.layer_norm(x))
            return x, jnp.concatenate([energies, final[None]])

        times = interleaved(
            {"descend": library, "hand_scan": by_hand}, x0, repeats=repeats, number=20
        )
        # after the timing, so the compile times above are cold
        out_a, out_b = jax.jit(library)(x0), jax.jit(by_hand)(x0)
        max_diff = float(jnp.max(jnp.abs(out_a[0] - out_b[0])))
        row = {
            "benchmark": "et_recall",
            "config": name,
            "dim": dim,
            "heads": heads,
            "head_dim": head_dim,
            "memories": memories,
            "tokens": tokens,
            "steps": steps,
            "descend_median_s": times["descend"]["median_s"],
            "hand_scan_median_s": times["hand_scan"]["median_s"],
            "ratio": times["descend"]["median_s"] / times["hand_scan"]["median_s"],
            "descend_compile_s": times["descend"]["compile_s"],
            "hand_scan_compile_s": times["hand_scan"]["compile_s"],
            "max_abs_difference": max_diff,
        }
        rows.append(row)
        print(
            f"{name:15s} descend {row['descend_median_s'] * 1e3:8.3f} ms  hand scan "
            f"{row['hand_scan_median_s'] * 1e3:8.3f} ms  ratio {row['ratio']:.3f}  compile "
            f"{row['descend_compile_s']:.2f}s / {row['hand_scan_compile_s']:.2f}s  "
            f"|diff| {max_diff:.1e}"
        )
    path = write_rows("et_recall" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
