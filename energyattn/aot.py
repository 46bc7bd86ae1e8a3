r"""Compile a program for a chip this machine does not have: deviceless ahead-of-time
compilation, with the chip's own compilers running on the CPU.

Lowering a program for `cuda` or `tpu` (`jax.jit(f).trace(x).lower(lowering_platforms=...)`)
shows what JAX builds; the last steps, where kernels fail on real hardware, are the device
compilers': on a TPU, Mosaic's layout rules and its VMEM budget; on an NVIDIA GPU, Triton
and `ptxas`, with their shared-memory, tensor-memory and register budgets. Those compilers
run on a CPU with no device attached, given a description of the chip:

```bash
JAX_PLATFORMS=cpu python - <<'EOF'
import jax, jax.numpy as jnp
import energyattn as ea

def loss(x):
    return ea.attention_logsumexp(x, x, causal=True).sum()

x = jax.ShapeDtypeStruct((65536, 128), jnp.bfloat16)
compiled = ea.aot.compile_for("v5e", jax.grad(loss), x)  # libtpu's compiler, on this CPU
print(compiled.memory_analysis().temp_size_in_bytes)
EOF
```

| chip | platform | what describes it |
| --- | --- | --- |
| `"a100"` | NVIDIA sm_80 | XLA's GPU target description (`energyattn/_targets/a100.txtpb`) |
| `"h100"` | NVIDIA sm_90 | `h100.txtpb` (the one published in jax-ml/jax issue 28376) |
| `"b200"` | NVIDIA sm_100 | `b200.txtpb` |
| `"v4"`, `"v5e"`, `"v5p"`, `"v6e"` | TPU | libtpu's topologies (`v4:2x2x1`, `v5e:2x2`, ...) |

**What it needs** (`pip install "energyattn[device-compile]"` installs it, pinned to the
installed JAX): for TPUs, libtpu (`jax[tpu]`); for NVIDIA chips, the CUDA plugin
(`jax-cuda12-plugin` and `jax-cuda12-pjrt`, the version of `jaxlib`) and `ptxas`
(`nvidia-cuda-nvcc-cu12`), with `JAX_PLATFORMS=cpu` and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`
set before JAX starts (the plugin then loads without a driver). Compile for one platform
per process: libtpu and the CUDA plugin each take the process over.

The program is traced and lowered with the chip as JAX's default device, so that code
which picks its tiling by chip generation (the attention kernels' `BlockSizes`) sees the
chip it is compiled for.
"""

import dataclasses
import functools
import glob
import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.experimental import topologies

from ._namespace import public_dir

__all__ = ["CHIPS", "Chip", "Inspection", "Kernel", "compile_for", "device", "kernels"]
__dir__ = public_dir(__all__)


@dataclasses.dataclass(frozen=True)
class Chip:
    """A chip to compile for: its `platform` (`"cuda"` or `"tpu"`), its `generation`
    (`"sm_80"`, `"sm_90"`, `"sm_100"`; `"v4"`, `"v5e"`, `"v5p"`, `"v6e"`) and what
    describes it to the compiler (`target`: a GPU target file in `energyattn/_targets`, or
    a libtpu topology name)."""

    platform: str
    generation: str
    target: str


#: The chips `compile_for` knows, by name.
CHIPS: dict[str, Chip] = {
    "a100": Chip("cuda", "sm_80", "a100.txtpb"),
    "h100": Chip("cuda", "sm_90", "h100.txtpb"),
    "b200": Chip("cuda", "sm_100", "b200.txtpb"),
    "v4": Chip("tpu", "v4", "v4:2x2x1"),
    "v5e": Chip("tpu", "v5e", "v5e:2x2"),
    "v5p": Chip("tpu", "v5p", "v5p:2x2x1"),
    "v6e": Chip("tpu", "v6e", "v6e:2x2"),
}


def _chip(name: str) -> Chip:
    if name not in CHIPS:
        raise ValueError(f"chip must be one of {sorted(CHIPS)}, got {name!r}")
    return CHIPS[name]


def target_config(name: str) -> str:
    """The text of XLA's GPU target description of NVIDIA chip `name`."""
    chip = _chip(name)
    if chip.platform != "cuda":
        raise ValueError(f"{name!r} is a TPU: it has a topology, not a GPU target description")
    return importlib.resources.files("energyattn").joinpath("_targets", chip.target).read_text()


def _installed(module: str) -> bool:
    """Whether `module` can be imported (`False` also where a parent package is missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _missing(chip: Chip) -> str | None:
    """Why this process cannot compile for `chip` (or `None`)."""
    install = 'install them with `pip install "energyattn[device-compile]"`'
    if chip.platform == "tpu":
        if not _installed("libtpu"):
            return f"compiling for a TPU needs libtpu (`jax[tpu]`): {install}"
        return None
    if not _installed("jax_plugins.xla_cuda12"):
        return (
            "compiling for an NVIDIA GPU needs the CUDA plugin (jax-cuda12-plugin and "
            f"jax-cuda12-pjrt, at jaxlib's version) and ptxas (nvidia-cuda-nvcc-cu12): {install}"
        )
    unset = [
        f"{name}={value}"
        for name, value in (("JAX_PLATFORMS", "cpu"), ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1"))
        if os.environ.get(name) != value and not _has_gpu()
    ]
    if unset:
        return (
            "on a machine without an NVIDIA GPU the CUDA plugin loads only with "
            f"{' and '.join(unset)} set before JAX starts"
        )
    return None


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


@functools.cache
def device(name: str) -> jax.Device:
    """The device that stands for chip `name` (one of `CHIPS`) in a compilation: the first
    device of its topology (for a TPU, of a 4-chip slice). A `RuntimeError` says what is
    missing when this process cannot compile for it."""
    chip = _chip(name)
    missing = _missing(chip)
    if missing is not None:
        raise RuntimeError(f"cannot compile for {name!r}: {missing}")
    if chip.platform == "tpu":
        topology = topologies.get_topology_desc(topology_name=chip.target, platform="tpu")
    else:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(name), topology="1x1x1"
        )
    return topology.devices[0]


def _abstract(args, target):
    sharding = jax.sharding.SingleDeviceSharding(target)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)


def compile_for(chip: str, fn: Callable[..., Any], *args: Any, **jit_kwargs: Any):
    """`jax.jit(fn, **jit_kwargs)` compiled for `chip` (a name in `CHIPS`) by the chip's
    own compiler, on this machine.

    `args` are pytrees of arrays or `jax.ShapeDtypeStruct`s (only their shapes and dtypes
    are used: nothing is allocated). Returns the `jax.stages.Compiled`, whose
    `memory_analysis()` gives the device memory the program needs and `as_text()` its
    optimised HLO; `fn` traces with the chip as JAX's default device. The compiler's own
    error (a Mosaic layout failure, VMEM or shared memory exhausted) propagates.
    """
    return _compile(chip, fn, args, jit_kwargs)


def _compile(chip, fn, args, jit_kwargs, options=None):
    target = device(chip)
    with jax.default_device(target):
        lowered = jax.jit(fn, **jit_kwargs).lower(*_abstract(args, target))
        return lowered.compile(compiler_options=options)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One device kernel of a compiled program, as its chip's compiler built it.

    - `name`: the kernel's name (a Pallas kernel's is its `pallas_call`'s `name`).
    - GPUs: `threads` per block, `shared_memory` (bytes, Triton's dynamic allocation),
      `tensor_memory` (columns allocated on sm_100, of 512), `registers` per thread and
      `spill_bytes` (`ptxas -v`: spill stores), and `matrix_instructions`: the distinct
      tensor-core instructions in its PTX (`"wgmma m64n128k16 bf16"`, `"mma m16n8k8
      tf32"`, `"tcgen05 kind::f16"`); empty when the kernel uses no tensor core.
    - TPUs: `vmem`, the scoped VMEM (bytes) the compiled kernel uses.
    """

    name: str
    threads: int | None = None
    shared_memory: int | None = None
    tensor_memory: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    matrix_instructions: tuple[str, ...] = ()
    vmem: int | None = None


def _ptxas() -> str | None:
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = os.path.join(location, "bin", "ptxas")
            if os.path.exists(path):
                return path
    return shutil.which("ptxas")


@functools.cache
def _ptxas_report(ptxas: str, arch: str, ptx: str) -> dict[str, tuple[int | None, int | None]]:
    """`{entry: (registers, spill bytes)}`, as `ptxas -v` reports them for the PTX text
    `ptx` on `arch`: remembered by the text, which programs of one process often repeat
    (15 of the 117 PTX modules of the A100's CI matrix)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        run = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", file.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
    stats: dict[str, tuple[int | None, int | None]] = {}
    for block in run.stderr.split("Compiling entry function")[1:]:
        entry_name = re.search(r"'([^']+)'", block)
        used = re.search(r"Used (\d+) registers", block)
        stores = re.search(r"(\d+) bytes spill stores", block)
        if entry_name:
            stats[entry_name.group(1)] = (
                int(used.group(1)) if used else None,
                int(stores.group(1)) if stores else None,
            )
    return stats


def _matrix_instruction(text: str) -> str:
    shape = re.search(r"m\d+n\d+k\d+", text)
    if text.startswith("tcgen05"):
        kind = re.search(r"kind::(\w+)", text)
        return "tcgen05 kind::" + (kind.group(1) if kind else "?")
    types = re.findall(r"\.(bf16|f16|tf32|f32|f64|e4m3|e5m2|s8)", text)
    operand = types[-2] if len(types) >= 2 else (types[-1] if types else "?")
    family = "wgmma" if text.startswith("wgmma") else "mma"
    return f"{family} {shape.group(0) if shape else '?'} {operand}"


def _gpu_kernels(dump: str, names: tuple[str, ...] | None) -> list[Kernel]:
    launches: dict[str, tuple[int, int]] = {}
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
        for line in Path(path).read_text().splitlines():
            found = re.search(
                r"\]\s+(\S+) grid: \[[^]]*\] threads: \[(\d+)[^]]*\]\s+shared_memory: (\d+)", line
            )
            if found:
                launches[found.group(1)] = (int(found.group(2)), int(found.group(3)))
    ptxas = _ptxas()
    if ptxas is None:
        raise RuntimeError(
            "no ptxas to read the kernels' registers and spills: "
            'pip install "energyattn[device-compile]" (nvidia-cuda-nvcc-cu12)'
        )
    kernels = []
    for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = Path(path).read_text()
        entries = re.findall(r"\.visible \.entry (\w+)", text)
        if not entries or (names is not None and not any(e.startswith(names) for e in entries)):
            continue
        target = re.search(r"\.target\s+(\S+)", text)
        stats = _ptxas_report(ptxas, target.group(1), text) if target is not None else {}
        for entry in re.split(r"\.visible \.entry ", text)[1:]:
            name = entry.split("(", 1)[0].strip()
            if names is not None and not name.startswith(names):
                continue
            instructions = re.findall(r"((?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)\S*)", entry)
            tmem = [int(n) for n in re.findall(r"tcgen05\.alloc\S*\s+\[[^]]*\],\s*(\d+)", entry)]
            threads, shared = launches.get(name, (None, None))
            registers, spills = stats.get(name, (None, None))
            kernels.append(
                Kernel(
                    name,
                    threads=threads,
                    shared_memory=shared,
                    tensor_memory=sum(tmem) if tmem else None,
                    registers=registers,
                    spill_bytes=spills,
                    matrix_instructions=tuple(
                        sorted({_matrix_instruction(i) for i in instructions})
                    ),
                )
            )
    return kernels


def _tpu_kernels(dump: str, names: tuple[str, ...] | None) -> list[Kernel]:
    kernels = []
    for path in glob.glob(os.path.join(dump, "*after_codegen.txt")):
        for line in Path(path).read_text().splitlines():
            found = re.search(r"%(\S+) = .*custom_call_target=\"tpu_custom_call\"", line)
            if not found:
                continue
            used = re.findall(r'"memory_space":"1","offset":"\d+","size":"(\d+)"', line)
            name = found.group(1).rsplit(".", 1)[0]
            if name == "tpu_custom_call" and names is not None:
                raise RuntimeError(
                    "the compiled program's TPU kernels have lost their names, so none can "
                    f"be found by name ({names}): JAX names them by their MLIR locations, "
                    "which JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=0 removes; unset it, or "
                    "pass names=None"
                )
            # Pallas names a kernel batched by `jax.vmap` "vmap_" + its name, once per vmap.
            if names is not None and not re.sub(r"^(vmap_)+", "", name).startswith(names):
                continue
            kernels.append(Kernel(name, vmem=sum(int(u) for u in used) if used else None))
    return kernels


def _temp_bytes(dump: str) -> dict[int, int]:
    """The program's temporary allocations by memory space (XLA's buffer assignment of the
    entry module: the one with most parameters' and temporaries' allocations)."""
    best: dict[int, int] = {}
    for path in glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")):
        spaces: dict[int, int] = {}
        for line in Path(path).read_text().splitlines():
            # "allocation 4: size 7356416, color 1, page 0, preallocated-temp:" (JAX 0.12;
            # 0.10 writes no page)
            found = re.match(r"allocation \d+: size (\d+),(.*)\bpreallocated-temp", line)
            if found:
                color = re.search(r"\bcolor (\d+)", found.group(2))
                space = int(color.group(1)) if color else 0
                spaces[space] = spaces.get(space, 0) + int(found.group(1))
        if sum(spaces.values()) > sum(best.values()):
            best = spaces
    return best


class Inspection(NamedTuple):
    """What `kernels` found: the `compiled` program, its `kernels` and `temp_bytes`, its
    temporary allocations by memory space (`0`: the device's HBM, what
    `compiled.memory_analysis().temp_size_in_bytes` counts; on TPUs `1`: the VMEM into
    which XLA's memory-space assignment moves the buffers that fit, 128 MiB on v5e and v6e
    and `2`: semaphores)."""

    compiled: Any
    kernels: list[Kernel]
    temp_bytes: dict[int, int]


def kernels(
    chip: str,
    fn: Callable[..., Any],
    *args: Any,
    names: str | tuple[str, ...] | None = None,
    **jit_kwargs: Any,
):
    """`(compiled, kernels, temp_bytes)` (an `Inspection`): `fn` compiled for `chip` as
    `compile_for` does, the device kernels the chip's compiler built for it (`Kernel`s):
    those whose names start with `names` (a Pallas kernel's name is its `pallas_call`'s; on
    TPUs a kernel batched by `jax.vmap` is named `vmap_` and its name, and found by it),
    or all of them, XLA's own fusions among them (`names=None`), and the program's
    temporary memory in each memory space.

    On TPUs `memory_analysis().temp_size_in_bytes` counts HBM only: the buffers XLA moves
    into VMEM (space 1) are not in it, so that a program whose buffers fit there at one
    length and not at the next seems to grow faster than it does; the sum over the spaces
    is what the program holds.

    On NVIDIA chips each kernel's registers and spills are `ptxas -v`'s, run on the PTX
    XLA compiled (the `ptxas` of `nvidia-cuda-nvcc-cu12`, or on the `PATH`; about a second
    per kernel): XLA itself reports no spill it does not fail on."""
    gpu = _chip(chip).platform == "cuda"
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump}
        if gpu:  # the PTX of every module (JAX 0.10 dumps it anyway, 0.12 when asked)
            options["xla_dump_emitter_re"] = "ptx"
        compiled = _compile(chip, fn, args, jit_kwargs, options=options)
        prefixes = (names,) if isinstance(names, str) else names
        found = _gpu_kernels(dump, prefixes) if gpu else _tpu_kernels(dump, prefixes)
        temp = _temp_bytes(dump)
    return Inspection(compiled, found, temp)
