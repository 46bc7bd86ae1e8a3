"""Context parallelism: per-device memory and time of the ring log-sum-exp energy vs one device.

Question: with the sequence split over P devices (`ea.parallel.ring_hopfield_energy`: keys
passed round a ring), how much temporary memory does each device need for the attention step
(the energy and its gradient in queries and keys), against the one-device blockwise path, at
seq 8k-64k and P = 1, 2, 4, 8? And in forward mode (`jax.jvp` of the energy) and for second
order (a Hessian-vector product of the energy, forward over reverse and reverse over
reverse), which fused attention kernels do not offer? Memory is XLA's accounting
of each device's compiled program (`memory_analysis().temp_size_in_bytes`; inputs and outputs
excluded), read after compiling. Times are medians of interleaved repeats of the compiled
programs. One head, head_dim 64, float32, beta = 1/8, keys = queries' length.

Targets: per-device temporary memory at seq 64k on 8 devices <= 1.2 / 8 of the one-device
blockwise path for the energy and its gradient, in every mode <= 0.15.

On a CPU the script gives itself 8 virtual devices (`--xla_force_host_platform_device_count`),
which share the cores: their memory is what one device of a real 8-device machine would
need, their time is not a speed-up. On a GPU machine it uses the GPUs JAX finds (P up to
their number) and adds the cuDNN path (bfloat16, `jax.nn.dot_product_attention`) to the
one-device rows; every row is tagged with the device.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/context_parallel.py [--quick]
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Before JAX starts: 8 virtual CPU devices (GPUs and TPUs are unaffected).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, print_row, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEAD_DIM = 64
BETA = HEAD_DIM**-0.5
MIB = 2**20


def one_device(implementation: str):
    def energy(q, k):
        return ea.hopfield_energy(q, k, beta=BETA, implementation=implementation)

    return energy


def ring(num_devices: int):
    mesh = ea.parallel.make_mesh(num_devices, axis_name="seq")

    def energy(q, k):
        return ea.parallel.ring_hopfield_energy(q, k, mesh, beta=BETA)

    return energy


def attention_step(energy):
    """The energy and its gradient in the queries and keys (the attention update and the
    keys' cotangent)."""
    return jax.value_and_grad(energy, argnums=(0, 1))


def hessian_vector(energy):
    """$H v$ for the queries and keys, reverse over reverse, in the direction (q, k)."""

    def directional(q, k):
        gq, gk = jax.grad(energy, argnums=(0, 1))(q, k)
        return jnp.sum(gq * q) + jnp.sum(gk * k)

    return jax.grad(directional, argnums=(0, 1))


def forward_mode(energy):
    """The energy and its directional derivative in the direction (q, k): `jax.jvp`."""
    return lambda q, k: jax.jvp(energy, (q, k), (q, k))


def hessian_vector_forward(energy):
    """$H v$ for the queries and keys, forward over reverse (the standard HVP)."""
    return lambda q, k: jax.jvp(jax.grad(energy, argnums=(0, 1)), (q, k), (q, k))[1]


#: The programs measured: name -> how it is made from an energy.
MODES = {
    "step": attention_step,
    "jvp": forward_mode,
    "hvp_forward": hessian_vector_forward,
    "hvp": hessian_vector,
}


def temp_mib(fn, seq: int, dtype=jnp.float32) -> float:
    shape = jax.ShapeDtypeStruct((seq, HEAD_DIM), dtype)
    compiled = jax.jit(fn).lower(shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def inputs(seq: int, dtype=jnp.float32):
    kq, kk = jax.random.split(jax.random.key(0))
    return (
        jax.random.normal(kq, (seq, HEAD_DIM), dtype),
        jax.random.normal(kk, (seq, HEAD_DIM), dtype),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 8k, 3 repeats")
    parser.add_argument("--seqs", type=int, nargs="*", help="sequence lengths (memory rows)")
    parser.add_argument(
        "--time-up-to", type=int, default=16384, help="also time the programs up to this seq"
    )
    parser.add_argument("--repeats", type=int, help="interleaved repeats (median reported)")
    args = parser.parse_args(argv)
    seqs = args.seqs or ([8192] if args.quick else [8192, 16384, 32768, 65536])
    repeats = args.repeats or (3 if args.quick else 5)
    counts = [p for p in (1, 2, 4, 8) if p <= jax.device_count()]
    gpu = jax.default_backend() == "gpu"
    rows = []

    def add(row):
        rows.append(row)
        print_row(row)

    for seq in seqs:
        base = {mode: temp_mib(make(one_device("blockwise")), seq) for mode, make in MODES.items()}
        for p in counts:
            mib = {
                mode: base[mode] if p == 1 else temp_mib(make(ring(p)), seq)
                for mode, make in MODES.items()
            }
            row = {"kind": "memory", "seq": seq, "devices": p, "target": 1.2 / p}
            for mode in MODES:
                row[f"{mode}_mib"] = mib[mode]
                row[f"{mode}_of_one_device"] = mib[mode] / base[mode]
            add(row)
        if gpu:
            add(
                {
                    "kind": "memory",
                    "seq": seq,
                    "devices": 1,
                    "implementation": "cudnn (bfloat16)",
                    "step_mib": temp_mib(attention_step(one_device("cudnn")), seq, jnp.bfloat16),
                }
            )

    for seq in [s for s in seqs if s <= args.time_up_to]:
        q, k = inputs(seq)
        contenders = {}
        for mode, make in MODES.items():
            contenders[f"{mode} one device"] = make(one_device("blockwise"))
            contenders[f"{mode} ring x{counts[-1]}"] = make(ring(counts[-1]))
        timings = interleaved(contenders, q, k, repeats=repeats)
        if gpu:
            qh, kh = inputs(seq, jnp.bfloat16)
            timings.update(interleaved({"cudnn": attention_step(one_device("cudnn"))}, qh, kh))
        base = timings["step one device"]["median_s"]
        for name, t in timings.items():
            add(
                {
                    "kind": "time",
                    "seq": seq,
                    "contender": name,
                    "median_ms": 1e3 * t["median_s"],
                    "of_one_device_step": t["median_s"] / base,
                    "compile_s": t["compile_s"],
                }
            )

    path = write_rows("context_parallel_quick" if args.quick else "context_parallel", rows)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
