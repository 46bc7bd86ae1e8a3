"""The public programs compiled by the chips' own compilers, on this CPU, with no device.

Question: does every program a user writes with energyattn compile on the chips the kernels
target (A100, H100, B200; TPU v4, v5e, v5p, v6e), without spilling registers on the H100
and the B200, with tensor-core instructions in every kernel, and with device memory that
grows as O(seq)?

Deviceless ahead-of-time compilation (`energyattn.aot`): libtpu's compiler for the TPU
generations, the CUDA plugin's (Triton, then `ptxas`) for the NVIDIA target descriptions
in `energyattn/_targets/`. Needs `pip install ".[device-compile]"`.

The matrix: programs x forms x dtypes x lengths x head sizes, as the accelerator issue
names them.

- programs: `attention_logsumexp` with each mask kind (none, causal, the excluded
  diagonal, a dense mask, segment ids), 8 heads under `jax.vmap`, `HopfieldAttention`,
  `EnergyTransformer` and the energy-based transformer;
- forms: value, value and gradient, JVP, HVP (forward over reverse) and linearize;
- dtypes: bfloat16, float16 (GPUs) and float32; lengths: 1000 (odd: no block
  multiple), 65536 and 131072 keys; head sizes 64, 80, 128 and 256.

`--matrix more` draws 16 cases per chip beyond it: other lengths and head sizes, queries
fewer than keys (padded by segment ids), causal with the diagonal excluded. `--matrix full`
is every cell (but the dense mask beyond 1000 keys: its own O(seq^2) input);
`--matrix ci` (what `tests/test_device_compile.py` runs, in about 3 minutes on 2 cores) is,
per chip, the five forms at 64k and 128k keys (the memory check), on GPUs a sequence
shorter than a tile, and a rotation through the attention programs such that every one
meets every form on every platform; the layers and models take their training form (value
and gradient) on a GPU and on a TPU, `HopfieldAttention` its HVP too (`MODEL_CASES`).

The chips compile at their default optimization: `default_compilers` removes the settings
that make XLA compile faster and worse (the test suite's, `tests/conftest.py`).

    python benchmarks/device_compile.py --all [--matrix full]    # every chip, a summary
    python benchmarks/device_compile.py --chip h100 [--matrix ci] # one chip, JSON lines
"""

import argparse
import concurrent.futures
import importlib.metadata
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHIPS = ("a100", "h100", "b200", "v4", "v5e", "v5p", "v6e")
GPUS = ("a100", "h100", "b200")
#: The attention programs, then the layers and models.
ATTENTION = ("lse", "lse_causal", "lse_exclude_self", "lse_dense_mask", "lse_segments", "heads")
MODELS = ("HopfieldAttention", "EnergyTransformer", "EnergyBasedTransformer")
PROGRAMS = ATTENTION + MODELS
#: Beyond the issue's matrix (`--matrix more`): queries fewer than keys, both structures.
MORE_PROGRAMS = ("lse_cross_padded", "lse_causal_exclude_self")
FORMS = ("value", "value_and_grad", "jvp", "hvp", "linearize")
LENGTHS = (1000, 65536, 131072)
HEADS = (64, 80, 128, 256)
#: `--matrix more`: lengths and head sizes the issue's matrix does not name.
MORE_LENGTHS = (1, 17, 4097, 100003)
MORE_HEADS = (16, 32, 96, 192, 512)
#: The CI matrix's cases of the layers and models, and the chip of each: the training form
#: (value and gradient) of each on a GPU and on a TPU, and `HopfieldAttention`'s HVP on a
#: TPU, in the chip's first dtype (bfloat16), head size 64. The models' HVPs took 14-46 s
#: a case (the energy-based Transformer's: 40-46 s on the A100, 20-22 s on v5p): their
#: kernels' second derivatives are the attention programs' (every form on every chip), and
#: `--matrix full` compiles every cell of them.
MODEL_CASES = {
    ("EnergyBasedTransformer", "value_and_grad"): ("a100", "v5p"),
    ("EnergyTransformer", "value_and_grad"): ("h100", "v6e"),
    ("HopfieldAttention", "value_and_grad"): ("b200", "v5e"),
    ("HopfieldAttention", "hvp"): ("v4",),
}
#: A program's name with this suffix: compiled in 64-bit mode (`jax_enable_x64`, as
#: scientific users run JAX). Every TPU kernel failed to compile there until 2026-12-02
#: (int64 block indices).
X64 = "_x64"
#: The programs whose kernels must spill nothing (the issue's zero-spill chips).
NO_SPILLS = ("h100", "b200")
#: The memory check's cases: every form of this program at 64k and 128k keys.
MEMORY_CHECK = ("lse_causal", "bfloat16", 128)
#: The libtpu option, per TPU generation, that turns off XLA's memory-space assignment
#: (which moves the buffers that fit out of HBM: into VMEM on v5e, v5p and v6e, into v4's
#: CMEM), so that every temporary is counted in HBM: the control of the memory check where
#: HBM alone grows more than 2.2x (`hbm_controls`). Set to false per compile
#: (`compiler_options`), or for a process in `LIBTPU_INIT_ARGS` (`--name=false`).
HBM_ONLY = {
    "v4": "xla_tpu_cmem_memory_space_assignment",
    "v5e": "xla_vf_vmem_memory_space_assignment",
    "v5p": "xla_vf_vmem_memory_space_assignment",
    "v6e": "xla_gf_vmem_memory_space_assignment",
}


def dtypes(chip: str) -> tuple[str, ...]:
    return ("bfloat16", "float16", "float32") if chip in GPUS else ("bfloat16", "float32")


#: The control (GPUs): a Pallas kernel that spills registers and uses no tensor core, so
#: that the checks of spills and tensor cores are seen to fail where they should.
CONTROL = "control_spills"


def control(x):
    """A `(128, 128)` float32 accumulator carried through a loop on one warp (512 registers
    a thread, of 255): it spills."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        def step(i, acc):
            return acc * x_ref[...] + i.astype(jnp.float32)

        o_ref[...] = jax.lax.fori_loop(0, 4, step, x_ref[...])

    params = plgpu.CompilerParams(num_warps=1, num_stages=1)
    out = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    return pl.pallas_call(kernel, out_shape=out, compiler_params=params, name=CONTROL)(x).sum()


def program(name: str, seq: int, head: int):
    """`f(x) -> scalar` for `x` of shape `(seq, width(name, head))`."""
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    import energyattn as ea

    if name == CONTROL:
        return control
    if name.endswith(X64):
        return program(name.removesuffix(X64), seq, head)
    key = jr.key(0)
    if name.startswith("lse"):
        if name == "lse_dense_mask":
            mask = (jnp.arange(seq)[:, None] + jnp.arange(seq)[None, :]) % 3 != 0
        elif name == "lse_segments":
            ids = jnp.arange(seq) // 300  # packed sequences of 300 tokens
            mask = ea.SegmentIds(ids, ids)
        elif name == "lse_cross_padded":  # a third as many queries; the last keys padding
            mask = ea.SegmentIds.padding(max(1, seq // 3), seq, key_length=seq - seq // 7)
        else:
            mask = None
        causal = name in ("lse_causal", "lse_causal_exclude_self")
        self_ = name in ("lse_exclude_self", "lse_causal_exclude_self")
        queries = max(1, seq // 3) if name == "lse_cross_padded" else seq
        return lambda x: ea.attention_logsumexp(
            x[:queries], x, mask=mask, causal=causal, exclude_self=self_, beta=head**-0.5
        ).sum()
    if name == "heads":

        def heads(x):
            xs = x.reshape(seq, 8, head).transpose(1, 0, 2)
            lse = jax.vmap(lambda h: ea.attention_logsumexp(h, h, causal=True))(xs)
            return lse.sum()

        return heads
    if name == "HopfieldAttention":
        layer = ea.nn.HopfieldAttention(2 * head, num_heads=2, key=key)
        return lambda x: layer(x).astype(jnp.float32).sum()
    if name == "EnergyTransformer":
        layer = ea.nn.EnergyTransformer(
            2 * head, num_heads=2, head_dim=head, num_memories=64, num_steps=1, key=key
        )
        return lambda x: layer(x).astype(jnp.float32).sum()
    if name == "EnergyBasedTransformer":
        model = ea.models.EnergyBasedTransformer(head, seq, dim=2 * head, num_heads=2, key=key)
        return lambda x: model(x, jnp.sin(x))
    raise ValueError(name)


def width(name: str, head: int) -> int:
    return {"heads": 8 * head, "HopfieldAttention": 2 * head, "EnergyTransformer": 2 * head}.get(
        name, head
    )


def form(name: str, f):
    import jax

    return {
        "value": f,
        "value_and_grad": jax.value_and_grad(f),
        "jvp": lambda x: jax.jvp(f, (x,), (x,)),
        "hvp": lambda x: jax.jvp(jax.grad(f), (x,), (x,))[1],
        "linearize": lambda x: jax.linearize(f, x)[1](x),
    }[name]


def matrix(chip: str, which: str) -> list[tuple]:
    """The cases `(program, form, dtype, seq, head)` of `which` matrix for `chip`."""
    if which == "full":
        cases = itertools.product(PROGRAMS, FORMS, dtypes(chip), LENGTHS, HEADS)
        return [c for c in cases if not (c[0] == "lse_dense_mask" and c[3] > 1000)]
    if which == "more":
        return more(chip)
    # The memory check: every form at 64k and 128k keys.
    prog, dtype_, head = MEMORY_CHECK
    cases = [(prog, f, dtype_, n, head) for f in FORMS for n in LENGTHS[1:]]
    cases.append(("lse_causal" + X64, "value_and_grad", "float32", LENGTHS[0], 128))
    if chip in GPUS:
        cases.append((CONTROL, "value", "float32", 128, 128))
    if chip in NO_SPILLS:
        # Spills the zero-spill chips had. A sequence shorter than a tile: the float32 HVP
        # with a dense mask at 17 tokens spilled 532 B on the B200 while its tile shrank to
        # the sequence.
        cases.append(("lse_dense_mask", "hvp", "float32", 17, 32))
        # A loop of one block (5 tokens): its forward spilled 4 B on the B200 unrolled.
        cases.append(("lse_exclude_self", "jvp", "float32", 5, 128))
        # A causal forward over one block: on 8 warps it spilled 4 B on the B200 in float32,
        # on 4 warps 32 B in bfloat16.
        cases.append(("lse_causal_exclude_self", "value_and_grad", "float32", 5, 128))
        cases.append(("lse_causal_exclude_self", "jvp", "bfloat16", 8, 64))
    # A rotation: each attention program with each form once per platform, the chips of a
    # platform taking turns, the dtypes, lengths and head sizes cycling.
    same = [c for c in CHIPS if (c in GPUS) == (chip in GPUS)]
    turn = same.index(chip)
    for i, (prog, form_) in enumerate(itertools.product(ATTENTION, FORMS)):
        if i % len(same) == turn:
            n = i // len(same) + turn
            seq = LENGTHS[0] if prog == "lse_dense_mask" else LENGTHS[n % len(LENGTHS)]
            cases.append(
                (prog, form_, dtypes(chip)[n % len(dtypes(chip))], seq, HEADS[n % len(HEADS)])
            )
    # The layers and models (`MODEL_CASES`): one per chip. Their kernels are the
    # attention programs' (above, on every chip), their other programs (MLPs, position
    # tables, the layers' scan) take up to 45 s a case to compile, and at 1000 tokens as at
    # 128k.
    for (prog, form_), chips in MODEL_CASES.items():
        if chip in chips:
            cases.append((prog, form_, dtypes(chip)[0], LENGTHS[0], HEADS[0]))
    return cases


def more(chip: str, per_chip: int = 16) -> list[tuple]:
    """`per_chip` cases beyond the issue's matrix, drawn for `chip` (seeded by its name):
    other lengths (1 token, 17, 4097, 100003) and head sizes (16 to 512), every mask,
    queries fewer than keys; the models at 1 and 17 tokens, head size 96."""
    import random

    draw = random.Random(f"more-{chip}")
    cases = []
    for _ in range(per_chip):
        prog = draw.choice(PROGRAMS + MORE_PROGRAMS)
        model = prog in MODELS
        seq = draw.choice(MORE_LENGTHS[:2] if model or prog == "lse_dense_mask" else MORE_LENGTHS)
        head = 96 if model else draw.choice(MORE_HEADS)
        cases.append((prog, draw.choice(FORMS), draw.choice(dtypes(chip)), seq, head))
    return list(dict.fromkeys(cases))


def compile_case(chip: str, case: tuple, hbm_only: bool = False) -> dict:
    """One case compiled for `chip`: whether it compiled, its temporary device memory, and
    its kernels (`energyattn.aot.Kernel`, the energy attention's only); `hbm_only`: with
    XLA's memory-space assignment off (`HBM_ONLY`), the row marked so."""
    import jax
    import jax.numpy as jnp

    import energyattn as ea

    name, how, dtype, seq, head = case
    row = dict(chip=chip, program=name, form=how, dtype=dtype, seq=seq, head=head)
    # `jax.jit`'s compiler options, which libtpu reads as its own flags.
    options = {"compiler_options": {HBM_ONLY[chip]: False}} if hbm_only else {}
    if hbm_only:
        row["hbm_only"] = True
    start = time.perf_counter()
    x64 = jax.config.values["jax_enable_x64"]
    try:
        jax.config.update("jax_enable_x64", x64 or name.endswith(X64))
        x = jax.ShapeDtypeStruct((seq, width(name, head)), jnp.dtype(dtype))
        fn = form(how, program(name, seq, head))
        names = ("energy_attention", CONTROL)
        compiled, kernels, spaces = ea.aot.kernels(chip, fn, x, names=names, **options)
        row["ok"] = True
        row["optimised"] = not jax.config.values["jax_disable_most_optimizations"] and not any(
            f.startswith(SPEED_FLAGS) for f in os.environ.get("XLA_FLAGS", "").split()
        )
        row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
        # All of it, on TPUs the buffers XLA moved into VMEM too (`ea.aot.Inspection`).
        row["temp_bytes_all_spaces"] = sum(spaces.values())
        row["kernels"] = [
            {k: v for k, v in vars(kernel).items() if v not in (None, ())} for kernel in kernels
        ]
    except Exception as error:  # the compiler's own message is the result
        row["ok"] = False
        row["error"] = " ".join(str(error).split())[:500]
    finally:
        jax.config.update("jax_enable_x64", x64)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def run_chip(chip: str, cases: list[tuple]) -> None:
    """The cases, then the memory check's controls they call for (`hbm_controls`)."""
    rows = []
    for case in cases:
        rows.append(compile_case(chip, case))
        print(json.dumps(rows[-1]), flush=True)
    for case in hbm_controls(chip, rows):
        print(json.dumps(compile_case(chip, case, hbm_only=True)), flush=True)


#: Settings that make XLA compile faster and worse, which the test suite sets for its CPU
#: programs (`tests/conftest.py`) and its subprocesses inherit. The chips' compilers must not
#: see them: at `JAX_DISABLE_MOST_OPTIMIZATIONS` with XLA's backend at level 1, B200 kernels
#: came out at 128 registers and spilled 4-16 B that default compiles do not spill.
SPEED_FLAGS = ("--xla_backend_optimization_level", "--xla_disable_hlo_passes", "--xla_cpu_")
#: The suite's settings that change what the compiled program holds: without Python
#: tracebacks as locations a TPU kernel's custom call loses its name (`ea.aot.kernels`
#: then finds no kernel).
SPEED_SETTINGS = (
    "JAX_DISABLE_MOST_OPTIMIZATIONS",
    "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS",
    "JAX_TRACEBACK_IN_LOCATIONS_LIMIT",
)


def default_compilers(env: dict[str, str]) -> dict[str, str]:
    """`env` without the suite's settings (`SPEED_FLAGS`, `SPEED_SETTINGS`): the chips'
    compilers as a user's program meets them."""
    env = {k: v for k, v in env.items() if k not in SPEED_SETTINGS}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(SPEED_FLAGS)]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def environment_for(chip: str) -> dict[str, str]:
    """The environment a chip's subprocess needs (set before JAX starts)."""
    env = dict(os.environ)  # the subprocess drops the speed settings itself (`main`)
    env["JAX_PLATFORMS"] = "cpu"
    env["EQX_ON_ERROR"] = "nan"  # Equinox's runtime checks as NaN: no host callbacks
    if chip in GPUS:
        env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    else:
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # TPU compilations in parallel processes
        env["TPU_SKIP_MDS_QUERY"] = "1"
    return env


def memory(rows: list[dict], chip: str, key: str, hbm_only: bool = False) -> dict:
    """`{(form, seq): bytes}` of `chip`'s memory-check cases that compiled (`key`: the
    rows' count, `temp_bytes` or `temp_bytes_all_spaces`), or of their controls."""
    return {
        (r["form"], r["seq"]): r[key]
        for r in rows
        if r["chip"] == chip
        and r["ok"]
        and (r["program"], r["dtype"], r["head"]) == MEMORY_CHECK
        and r.get("hbm_only", False) == hbm_only
    }


def superlinear(by: dict) -> list[str]:
    """The forms whose memory at 128k keys is more than 2.2x that at 64k (both measured)."""
    small, large = LENGTHS[1:]
    both = [f for f in FORMS if (f, small) in by and (f, large) in by]
    return [f for f in both if by[f, large] > 2.2 * by[f, small] + 1]


def hbm_controls(chip: str, rows: list[dict]) -> list[tuple]:
    """The memory-check cases to compile again with every buffer in HBM (`HBM_ONLY`): on a
    TPU, those of the forms whose HBM alone grows more than 2.2x. XLA moves the buffers
    that fit into VMEM (or v4's CMEM), which `memory_analysis()` does not count, so HBM at
    64k keys can be a small part of what the program holds; the control says whether the
    program's own HBM grows faster than the sequence."""
    if chip not in HBM_ONLY:
        return []
    prog, dtype_, head = MEMORY_CHECK
    forms = superlinear(memory(rows, chip, "temp_bytes"))
    return [(prog, f, dtype_, n, head) for f in forms for n in LENGTHS[1:]]


def run_all(which: str, workers: int = 2) -> list[dict]:
    """Every chip's matrix, one subprocess per chip, `workers` at a time (with, on a TPU,
    the memory check's controls: `run_chip`)."""

    def one(chip):
        cases = json.dumps(matrix(chip, which))
        command = [sys.executable, __file__, "--chip", chip, "--cases", cases]
        done = subprocess.run(command, env=environment_for(chip), capture_output=True, text=True)
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 and not rows:
            rows = [dict(chip=chip, ok=False, error=done.stderr[-2000:])]
        return rows

    # The chips in an order whose two workers end together by the CI matrix's costs on
    # 2026-12-02 (about A100 56 s, H100 61, B200 50, v4 37, v5e 24, v5p 34, v6e 29 on the
    # Zen 4 class host, each within 15% from run to run): 161 s by them, against 159.5 for
    # an even split and 172 for the longest first.
    order = ("a100", "b200", "v4", "h100", "v5e", "v5p", "v6e")
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        done = dict(zip(order, pool.map(one, order), strict=True))
    return [row for chip in CHIPS for row in done[chip]]


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for chip in CHIPS:
        everything = [r for r in rows if r["chip"] == chip]
        mine = [r for r in everything if not r.get("hbm_only")]
        kernels = [k for r in mine if r.get("program") != CONTROL for k in r.get("kernels", ())]
        spills = sum(k.get("spill_bytes", 0) for k in kernels)
        bare = sum(1 for k in kernels if chip in GPUS and not k.get("matrix_instructions"))
        controls = [k for r in mine if r.get("program") == CONTROL for k in r.get("kernels", ())]
        seen = "".join(f"; the control spills {k.get('spill_bytes', 0)} bytes" for k in controls)
        lines.append(
            f"{chip:5s} {sum(r['ok'] for r in mine):4d}/{len(mine):<4d} compile; "
            f"{len(kernels)} kernels, {spills} spill bytes, {bare} without matrix units"
            f"{seen}; {sum(r['seconds'] for r in mine):.0f} s"
        )
        for hbm_only in (False, True):
            by = memory(everything, chip, "temp_bytes", hbm_only)
            ratios = ", ".join(
                f"{f} {by[f, LENGTHS[2]] / by[f, LENGTHS[1]]:.2f}"
                for f in FORMS
                if by.get((f, LENGTHS[1])) and (f, LENGTHS[2]) in by
            )
            if ratios:
                which = "every buffer in HBM" if hbm_only else "HBM"
                lines.append(f"    {which}, 128k / 64k keys: {ratios}")
        for r in everything:
            if not r["ok"]:
                control = " (every buffer in HBM)" if r.get("hbm_only") else ""
                lines.append(
                    f"    FAIL {r.get('program')} {r.get('form')} {r.get('dtype')} "
                    f"{r.get('seq')}x{r.get('head')}{control}: {r['error'][:200]}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", choices=CHIPS)
    parser.add_argument("--all", action="store_true", help="every chip, in subprocesses")
    parser.add_argument("--matrix", choices=("ci", "full", "more"), default="ci")
    parser.add_argument("--cases", help="a JSON list of cases (for --chip)")
    args = parser.parse_args()
    if args.all:
        rows = run_all(args.matrix)
        print("\n".join(summary(rows)))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import write_rows

        jax_version = importlib.metadata.version("jax")
        print(write_rows(f"device_compile_{args.matrix}_jax{jax_version}", rows))
    elif args.chip:
        env = default_compilers(dict(os.environ))  # before JAX starts
        os.environ.clear()
        os.environ.update(env)
        cases = json.loads(args.cases) if args.cases else matrix(args.chip, args.matrix)
        run_chip(args.chip, [tuple(c) for c in cases])
    else:
        parser.error("give --chip or --all")


if __name__ == "__main__":
    main()
