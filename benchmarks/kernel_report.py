"""What the chips' compilers make of the kernels: registers, spills, on-chip memory, threads
and tensor-core instructions, per kernel and chip, beside JAX's own Pallas attention.

Question: at the default tiles, does every kernel of the energy attention fit its chip
(no spilled register, shared / tensor memory / VMEM within the chip's), and do its
products run on the tensor cores (float32 included)? And how does it compare with JAX's
own Pallas attention compiled the same way (`jax.experimental.pallas.ops.gpu.attention`'s
`mha` on GPUs, `jax.experimental.pallas.ops.tpu.flash_attention` on TPUs)?

Deviceless ahead-of-time compilation (`energyattn.aot.kernels`): nothing runs, so there
are no times here; `benchmarks/accelerator.py` times the kernels on a device.

Programs, per chip and dtype (bfloat16, float32), seq 4096, one head of size 128 (and 64
and 256 with `--heads`), causal: the energy's value (the forward kernel), value and
gradient, JVP and forward-over-reverse HVP; JAX's `mha` (forward, and value and gradient:
its backward kernels) and TPU `flash_attention` (the same), half precision only where
they take nothing else.

    python benchmarks/kernel_report.py [--chips h100 v5e ...] [--heads 64 128 256]

Prints a Markdown table per chip (the one in `benchmarks/README.md`) and writes
`results/kernel_report.json`.
"""

import argparse
import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_compile import CHIPS, GPUS, environment_for  # noqa: E402

SEQ = 4096


def programs(chip: str, dtype: str, head: int) -> dict:
    """`name: (fn, args)` for one chip."""
    import jax
    import jax.numpy as jnp

    import energyattn as ea

    x = jax.ShapeDtypeStruct((SEQ, head), jnp.dtype(dtype))

    def energy(x):
        return ea.attention_logsumexp(x, x, causal=True, beta=head**-0.5).sum()

    out = {
        "energy value": (energy, x),
        "energy value+grad": (jax.value_and_grad(energy), x),
        "energy JVP": (lambda x: jax.jvp(energy, (x,), (x,)), x),
        "energy HVP": (lambda x: jax.jvp(jax.grad(energy), (x,), (x,))[1], x),
    }
    if chip in GPUS:
        from jax.experimental.pallas.ops.gpu import attention

        qkv = jax.ShapeDtypeStruct((1, SEQ, 1, head), jnp.dtype(dtype))

        def mha(q):
            return attention.mha(q, q, q, None, sm_scale=head**-0.5, causal=True)

        out["jax mha forward"] = (mha, qkv)
        out["jax mha value+grad"] = (jax.value_and_grad(lambda q: mha(q).sum()), qkv)
    else:
        from jax.experimental.pallas.ops.tpu import flash_attention as flash

        qkv = jax.ShapeDtypeStruct((1, 1, SEQ, head), jnp.dtype(dtype))

        def tpu_flash(q):
            return flash.flash_attention(q, q, q, causal=True, sm_scale=head**-0.5)

        out["jax flash forward"] = (tpu_flash, qkv)
        out["jax flash value+grad"] = (jax.value_and_grad(lambda q: tpu_flash(q).sum()), qkv)
    return out


def report_chip(chip: str, dtypes: list[str], heads: list[int]) -> list[dict]:
    import energyattn as ea

    rows = []
    for dtype in dtypes:
        for head in heads:
            for name, (fn, args) in programs(chip, dtype, head).items():
                row = dict(chip=chip, dtype=dtype, head=head, program=name)
                try:
                    kernels = ea.aot.kernels(chip, fn, args).kernels
                except Exception as error:
                    rows.append(dict(row, error=" ".join(str(error).split())[:300]))
                    continue
                for kernel in kernels:
                    # XLA's own fusions are not attention kernels.
                    if chip in GPUS and not (
                        kernel.name.startswith("energy_attention")
                        or kernel.matrix_instructions
                        or "mha" in kernel.name
                    ):
                        continue
                    rows.append(dict(row, **{k: v for k, v in vars(kernel).items()}))
    return rows


def table(rows: list[dict], chip: str) -> list[str]:
    gpu = chip in GPUS
    head = (
        "| program | dtype | head | kernel | threads | regs | spill B | smem KiB | TMEM cols "
        "| tensor-core instructions |"
        if gpu
        else "| program | dtype | head | kernel | VMEM KiB |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["chip"] != chip:
            continue
        if "error" in r:
            lines.append(
                f"| {r['program']} | {r['dtype']} | {r['head']} | fails: {r['error'][:80]} |"
            )
            continue
        if gpu:
            smem = "" if r["shared_memory"] is None else f"{r['shared_memory'] / 1024:.0f}"
            lines.append(
                f"| {r['program']} | {r['dtype']} | {r['head']} | {r['name']} | {r['threads']} "
                f"| {r['registers']} | {r['spill_bytes']} | {smem} | {r['tensor_memory'] or ''} "
                f"| {', '.join(r['matrix_instructions']) or 'none'} |"
            )
        else:
            vmem = "" if r["vmem"] is None else f"{r['vmem'] / 1024:.0f}"
            lines.append(f"| {r['program']} | {r['dtype']} | {r['head']} | {r['name']} | {vmem} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=CHIPS)
    parser.add_argument("--heads", nargs="+", type=int, default=[128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--chip", help=argparse.SUPPRESS)  # one chip, in a subprocess
    args = parser.parse_args()
    if args.chip:
        print(json.dumps(report_chip(args.chip, args.dtypes, args.heads)))
        return

    def one(chip):
        command = [sys.executable, __file__, "--chip", chip, "--heads", *map(str, args.heads)]
        command += ["--dtypes", *args.dtypes]
        done = subprocess.run(command, env=environment_for(chip), capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
        if not lines:
            return [dict(chip=chip, program="all", dtype="", head=0, error=done.stderr[-300:])]
        return json.loads(lines[-1])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rows = [row for rows in pool.map(one, args.chips) for row in rows]
    for chip in args.chips:
        print(f"\n### {chip}\n")
        print("\n".join(table(rows, chip)))
    from _common import write_rows

    print(write_rows("kernel_report", rows))


if __name__ == "__main__":
    main()
