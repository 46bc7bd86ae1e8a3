"""Training an energy-based transformer through its thinking: temporary memory, blockwise vs
naive autodiff, and on the ring.

Question: a training step of `ea.models.train_ebt` differentiates through the
descent on the candidates, so it takes second derivatives of every attention layer (third of
the log-sum-exp, whose gradient is the attention output). Does it keep O(seq) memory on the
blockwise path, against plain autodiff of the `(seq, seq)` scores (`implementation="naive"`),
at sequences where that matters?

- Memory: XLA's accounting of the compiled training gradient's temporary buffers (inputs and
  outputs excluded), read after compiling (nothing runs): one sequence of `seq` tokens of 8
  features, an EBT of width 32, 2 heads, 2 blocks, 2 thinking steps both differentiated,
  float32. The naive path's scores alone are `heads x seq^2 x 4` bytes per layer and step.
- Ring: the same gradient with the sequence split over 8 host devices
  (`ea.parallel.context_parallel`), per device.
- Time (quick sizes only, one core): one training gradient, blockwise / naive, median of
  interleaved repeats.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/ebt_memory.py [--quick]
"""

import argparse
import os
import sys
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, print_row, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

MIB = 2**20
TOKEN, DIM, HEADS, DEPTH, STEPS = 8, 32, 2, 2, 2
PATHS = ("naive", "blockwise")


def model_of(seq: int, implementation: str) -> ea.models.EnergyBasedTransformer:
    return ea.models.EnergyBasedTransformer(
        TOKEN,
        seq,
        DIM,
        num_heads=HEADS,
        depth=DEPTH,
        implementation=implementation,
        key=jr.key(0),
    )


def gradient(model, x, y0):
    """The training gradient of one sequence: next-token error after each of `STEPS`
    thinking steps, differentiated through all of them."""

    def loss(model):
        predictions = ea.models.thinking_steps_for_training(model, x, y0, num_steps=STEPS)
        return ea.models.next_token_error(predictions, x)

    return eqx.filter_grad(loss)(model)


def temp_mib(fn, model, seq: int) -> float:
    x = jax.ShapeDtypeStruct((seq, TOKEN), jnp.float32)
    params, static = eqx.partition(model, eqx.is_array)
    compiled = jax.jit(lambda p, x, y0: fn(eqx.combine(p, static), x, y0)).lower(params, x, x)
    compiled = compiled.compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="seq 1024, one device, memory only (no timing)"
    )
    args = parser.parse_args(argv)
    seqs = (1024,) if args.quick else (1024, 2048, 4096, 8192)
    mesh = jax.make_mesh((8,), ("seq",), devices=jax.devices()[:8])
    ring = ea.parallel.context_parallel(gradient, mesh)
    rows = []
    for seq in seqs:
        naive = temp_mib(gradient, model_of(seq, "naive"), seq)
        blockwise = temp_mib(gradient, model_of(seq, "blockwise"), seq)
        row = {
            "seq": seq,
            "naive_mib": naive,
            "blockwise_mib": blockwise,
            "blockwise_over_naive": blockwise / naive,
        }
        if len(jax.devices()) >= 8 and not args.quick:
            # XLA accounts each device's program: the number is per device.
            row["ring_per_device_mib"] = temp_mib(ring, model_of(seq, "blockwise"), seq)
        if seq == seqs[0] and not args.quick:
            x = jr.uniform(jr.key(1), (seq, TOKEN))
            y0 = jr.normal(jr.key(2), (seq, TOKEN))
            # The same weights; only the attention's path (a static field) differs.
            params, static = eqx.partition(model_of(seq, "naive"), eqx.is_array)
            fns = {
                name: (
                    lambda p, x, y0, name=name, static=static: gradient(
                        eqx.combine(p, static).with_implementation(name), x, y0
                    )
                )
                for name in PATHS
            }
            times = interleaved(fns, params, x, y0, repeats=5)
            times = {name: t["median_s"] for name, t in times.items()}
            row["blockwise_over_naive_time"] = times["blockwise"] / times["naive"]
        print_row(row)
        rows.append(row)
    write_rows("ebt_memory_quick" if args.quick else "ebt_memory", rows)
    return rows


if __name__ == "__main__":
    main()
