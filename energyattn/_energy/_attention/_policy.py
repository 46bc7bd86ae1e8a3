"""Which implementation of the attention log-sum-exp runs, and in blocks of how many keys.

Every implementation gives the same values and derivatives; this module only decides which
one runs (`select_implementation`) and how the blockwise passes cut the sequences
(`BlockSizes`, per platform). The measurements behind the defaults are in
`benchmarks/README.md`.
"""

import dataclasses
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ..._checks import positive_int

Implementation = Literal["auto", "naive", "blockwise", "pallas", "cudnn", "small"]
IMPLEMENTATIONS = ("auto", "naive", "blockwise", "pallas", "cudnn", "small")

#: Above this many score entries (heads x seq x mem) `"auto"` takes the blockwise loop where
#: the program is lowered for a CPU (on GPUs and TPUs it takes the kernels at every size): on a
#: CPU core the blockwise and naive paths cost the same near it, and the blockwise one is
#: faster and far smaller above it (`benchmarks/README.md`, the speed and memory tables).
BLOCKWISE_THRESHOLD = 2**17
#: On a CPU a vmap over heads runs the blockwise passes head by head once one head's block
#: holds at least this many entries (`seq x block_size`, 128 KiB in float32): then a batch of
#: heads' blocks would not fit in the cache (`benchmarks/README.md`). Smaller blocks are
#: batched over the heads.
HEADS_IN_TURN_ENTRIES = 2**15

_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_implementation(implementation: str) -> Implementation:
    """`implementation` if it names one (a `ValueError` listing them otherwise)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return cast(Implementation, implementation)


def select_implementation(
    implementation: str,
    *,
    entries: int,
    dtype: DTypeLike,
    head_dim: int,
    structured_mask: bool,
    backend: str | None = None,
    threshold: int | None = None,
) -> Implementation:
    r"""Resolve `implementation` to `"naive"`, `"small"`, `"blockwise"`, `"pallas"` or
    `"cudnn"`: which program computes the log-sum-exp.

    - `"naive"`: the whole `(seq, mem)` score matrix, on every platform (the reference).
    - `"blockwise"`: never a `(seq, mem)` matrix. Where the program is lowered for a GPU or
      a TPU, the Pallas kernels (for inputs below 64 bits; float64 keeps the XLA loop);
      where it is lowered for a CPU, the XLA loop over blocks of keys.
    - `"small"`: the naive program on a CPU, the kernels on GPUs and TPUs.
    - `"pallas"`: the kernels on every platform, the GPU's in Pallas's interpret mode on a
      CPU (slow; for checking them anywhere).
    - `"cudnn"`: cuDNN's fused attention for the plain passes, by name only. It needs an
      NVIDIA GPU when the program is traced, float16/bfloat16 inputs, a head size that is
      a multiple of 8 up to 128, and no mask (the fused kernel cannot reproduce this
      package's convention for rows with nothing to attend to); anything else is a
      `ValueError` (it would otherwise fail deep inside XLA).

    `"auto"` takes the kernels on GPUs and TPUs for every dtype and mask. On a CPU it takes
    the blockwise loop when the score matrices would hold more than `threshold` entries
    (`entries = heads * seq * mem`; default `BLOCKWISE_THRESHOLD` $= 2^{17}$) and the naive
    program below (`"small"`): there both cost the same and the plain program is the
    simpler one to compile. The choice reads the shapes, never the tracing machine's
    backend: the platform the program is lowered for picks the code, so a program traced on
    a CPU and lowered for `cuda` holds the kernels.

    Every choice gives the same values and derivatives, in forward and reverse mode and to
    any order; only time and memory differ.
    """
    implementation = check_implementation(implementation)
    threshold = BLOCKWISE_THRESHOLD if threshold is None else threshold
    if implementation == "cudnn":
        backend = jax.default_backend() if backend is None else backend
        cudnn_ok = (
            backend in ("gpu", "cuda")
            and jnp.dtype(dtype) in _CUDNN_DTYPES
            and head_dim % 8 == 0
            and head_dim <= 128
            and not structured_mask
        )
        if not cudnn_ok:
            raise ValueError(
                "implementation='cudnn' needs an NVIDIA GPU backend, float16/bfloat16 inputs, a "
                f"head size that is a multiple of 8 up to 128 and no mask; got backend "
                f"{backend!r}, dtype {jnp.dtype(dtype)}, head size {head_dim}, "
                f"mask={'yes' if structured_mask else 'no'}"
            )
        return "cudnn"
    if implementation == "auto":
        return "blockwise" if entries > threshold else "small"
    return implementation


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    r"""How the blockwise passes cut the sequences, per platform and chip generation: the
    tiling of the XLA loop (on a CPU, in float64 anywhere, on the ring) and of the Pallas
    kernels (GPUs, TPUs), and how the kernels multiply float32.

    Every field left `None` takes its platform's default (`BlockSizes.default`), chosen
    for the chip the program is compiled for; a field given applies on every platform. An
    integer `block_size=n` where the API takes a `BlockSizes` means
    `BlockSizes(block_k=n, block_k_terms=n)`: `n` keys per block in every pass.

    | field | CPU (XLA loop) | GPU kernels | TPU kernels |
    | --- | --- | --- | --- |
    | `block_q`: queries per block | every query | 64 ¹ | 128 |
    | `block_k`: keys per step of the forward and row passes | 256 ² | 32 ³ | 512 ³ |
    | `block_k_terms`: keys per column program (CPU: per block) | `block_k / 2` | 64 ⁵ | 512 ³ |
    | `num_warps` (Triton) | - | 8 ⁴ | - |
    | `num_stages` (Triton) | - | 1 | - |
    | `float32_products` | exact | `"split"` | `"split"` |

    ¹ 32 on sm_80 for float32 and for head sizes up to 32, and on sm_100 for float32 heads
    above 128. ² 128 above 4096 queries.
    ³ Halved for float32 heads above 128, and on GPUs for sm_80's half-precision heads
    above 128 and its head sizes up to 32. ⁴ 4 on sm_100 for float32 heads above 128, and
    for a float32 causal forward of at most 8 queries over one block.
    ⁵ On sm_80: 16 for head sizes up to 32; 32 up to 64, for half-precision heads above
    128 and with a mask (dense or segment ids).

    The kernels round each size up to a power of two, at least 16 (and 128 keys on a TPU:
    the lanes of its vector registers), and a sequence shorter than a block is one block:
    of its own length rounded up (on the H100 and the B200 of the default tile at least:
    smaller tiles spilled registers on the B200). The column pass (the derivatives' sums
    $\sum_i w_{ij} X_i$) holds `block_k_terms` keys per program and steps through the
    queries, half of `block_q` at a time on a GPU (a quarter for float32 at head size 256
    and above). A pass whose sums would not fit a kernel's registers (or tensor memory)
    is split over several kernels, each recomputing the probabilities; the budget is per
    chip generation (`_kernels`).

    `float32_products`: `"split"` multiplies float32 on the tensor cores (GPUs: three TF32
    products; TPUs: six bfloat16 products) at float32 accuracy; `"highest"` asks for the
    compilers' own float32 products (FMA loops on a GPU, without tensor cores).

    Why these defaults: on a CPU a `(seq, 256)` float32 block of scores stays in a core's
    cache up to 4096 queries, and the derivatives' passes, which do more work per block,
    want half as many keys (`benchmarks/README.md`); on GPUs the sizes compile without
    spilling a register (`ptxas -v`) on an H100 and a B200 for every pass of every
    derivative, at head sizes up to 256, with `wgmma` tiles of 64 rows on the H100
    (`benchmarks/README.md`, the kernel report); a TPU's blocks are pipelined through
    VMEM, so the scores of a `(128, 512)` block and their temporaries are what it holds
    (a pass of many terms split over kernels, as on GPUs).

    Every tiling gives the same values and derivatives; only time and memory differ.
    """

    block_q: int | None = None
    block_k: int | None = None
    block_k_terms: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    float32_products: str | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "float32_products":
                if value not in (None, "split", "highest"):
                    raise ValueError(
                        f"float32_products must be 'split' or 'highest', got {value!r}"
                    )
            elif value is not None:
                object.__setattr__(self, field.name, positive_int(field.name, value))

    @classmethod
    def default(
        cls,
        platform: str,
        seq: int,
        *,
        generation: str | None = None,
        dtype: DTypeLike = jnp.float32,
        head_dim: int = 128,
        mask: str | None = None,
    ) -> "BlockSizes":
        """The defaults of `platform` (`"cpu"`, `"gpu"` or `"tpu"`) for `seq` queries of
        `dtype` and head size `head_dim`, on chip `generation` (`"sm_80"`, `"sm_90"`,
        `"sm_100"`, ...; `"v4"`, `"v5e"`, `"v5p"`, `"v6e"`; `None`: any), with a `mask`
        of that kind (`"dense"`, `"segments"` or `None`), every field set (`block_q=seq` on a
        CPU: the XLA loop takes every query at once)."""
        if platform == "cpu":
            keys = 256 if seq <= 4096 else 128
            return cls(seq, keys, keys // 2, None, None, None)
        single = jnp.dtype(dtype).itemsize >= 4
        wide = single and head_dim > 128
        if platform == "gpu":
            a100, b200 = generation == "sm_80", generation == "sm_100"
            # Each exception to the full tile removed register spills (`ptxas -v`,
            # benchmarks/README.md). On the A100: float32 operands (two TF32 parts) take half
            # the queries into its 163 KiB of shared memory; head sizes up to 32 take half the
            # queries and keys per step and 16 keys per column program (5 of 50 such programs
            # spilled 8-40 B); half-precision heads above 128 take half the keys per step and
            # per column program (5 of 7 HVPs and gradients at head sizes 192 and 256 spilled
            # 40-164 B); column programs of heads up to 64, or with a mask (a strip of which, or
            # of whose segment ids, they also hold), take 32 keys (7 half-precision HVPs at head
            # sizes 48 and 64 came out at 32 registers with 7.6-8.4 KB of spills, 3 float32 ones
            # spilled 16-24 B; with a dense mask HVPs up to head size 128 spilled 44-7816 B,
            # with segment ids 28-84 B). On the B200 float32 heads above 128 take 4 warps and 32
            # queries (at 64 the row terms of vmapped heads' JVPs and HVPs, 7 of 93 float32
            # programs at head sizes 192 to 512, came out at 96 registers with 16 B).
            small = a100 and head_dim <= 32
            wide_half = a100 and not single and head_dim > 128
            queries = 32 if (a100 and (single or small)) or (b200 and wide) else 64
            keys = 16 if wide or wide_half or small else 32
            if small:
                columns = 16
            elif a100 and (wide_half or mask is not None or head_dim <= 64):
                columns = 32
            else:
                columns = 64
            warps = 4 if b200 and wide else 8
            return cls(queries, keys, columns, warps, 1, "split")
        if platform == "tpu":
            return cls(128, 256 if wide else 512, 256 if wide else 512, None, None, "split")
        raise ValueError(f"platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")

    def on(self, platform: str, seq: int, **target) -> "BlockSizes":
        """These sizes, the fields left `None` filled with `platform`'s defaults for `seq`
        queries (`target`: `BlockSizes.default`'s keywords)."""
        default = BlockSizes.default(platform, seq, **target)
        return BlockSizes(
            *(
                getattr(default, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                for f in dataclasses.fields(self)
            )
        )


#: What the API's `block_size` arguments take.
BlockSize = int | BlockSizes | None


def check_block_size(block_size: BlockSize) -> BlockSize:
    """`block_size` itself once it is a valid `BlockSize` (for a module's static field)."""
    as_block_sizes(block_size)
    return block_size


def as_block_sizes(block_size: BlockSize) -> BlockSizes:
    """`block_size` as a `BlockSizes`: `None` the platforms' defaults, an integer `n` keys
    per block in every pass (a `TypeError` for anything else)."""
    if block_size is None:
        return BlockSizes()
    if isinstance(block_size, BlockSizes):
        return block_size
    if not hasattr(block_size, "__index__"):
        raise TypeError(
            f"block_size must be an int, an energyattn.BlockSizes or None, got {block_size!r}"
        )
    n = positive_int("block_size", block_size)
    return BlockSizes(block_k=n, block_k_terms=n)


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """The tiling of one kernel: `bq` queries and `bk` keys per block, the lengths padded to
    them (`seq_p`, `mem_p`), the true lengths where padded (`padded_seq`, `padded_mem`,
    else `None`), Triton's warps and stages, the float32 products, the columns a product
    contracts at once, and whether its loop, over one block, stays a loop (`keep_loop`)."""

    bq: int
    bk: int
    seq_p: int
    mem_p: int
    padded_seq: int | None
    padded_mem: int | None
    num_warps: int | None
    num_stages: int | None
    float32_products: str
    contraction: int | None = None
    keep_loop: bool = False


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one kernel may accumulate: `columns` of sums (the accumulators, in registers
    or tensor memory) and `pairs` distinct bilinear products per block (the terms'
    factors). A pass that needs more is split over several kernels; with `narrow`, a
    kernel that still holds more pairs (a term whose factors cannot be expanded) steps
    through fewer keys (or queries) at a time."""

    columns: int
    pairs: int
    narrow: bool = False


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


#: NVIDIA compute capabilities by the names of the chips' devices, where a device does not
#: say (a topology's description of a chip, for one).
_GPU_NAMES = {
    "A100": "sm_80",
    "A800": "sm_80",
    "H100": "sm_90",
    "H200": "sm_90",
    "H800": "sm_90",
    "GH200": "sm_90",
    "B200": "sm_100",
    "B100": "sm_100",
    "GB200": "sm_100",
}
#: TPU generations by device kind.
_TPU_KINDS = {
    "TPU v4": "v4",
    "TPU v4 lite": "v4i",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "v7x",
}


def generation_of(device) -> str | None:
    """The chip generation of a JAX device: `"sm_90"` (from a GPU's compute capability, or
    its name), `"v5e"` (a TPU's kind); `None` for anything else (a CPU)."""
    kind = str(getattr(device, "device_kind", ""))
    if kind in _TPU_KINDS:
        return _TPU_KINDS[kind]
    if getattr(device, "platform", "") in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None)
        if capability:
            return "sm_" + str(capability).replace(".", "")
        for name, generation in _GPU_NAMES.items():
            if name in kind:
                return generation
    return None


def target_generation(platform: str) -> str | None:
    """The generation of the `platform` chip (`"gpu"` or `"tpu"`) a program is for, where
    JAX says so when it traces: the abstract mesh's device, else the default device
    (`jax.default_device`), else the first device. The kernels ask the lowering first (the
    device it lowers for: `_lowered`), and this where it names none; `None` when nothing
    names such a chip: the kernels then take tiles that fit every generation."""
    candidates = []
    mesh = jax.sharding.get_abstract_mesh()
    if getattr(mesh, "abstract_device", None) is not None:
        candidates.append(mesh.abstract_device)
    default = getattr(jax.config, "jax_default_device", None)
    if default is not None and not isinstance(default, str):
        candidates.append(default)
    try:
        candidates.append(jax.devices()[0])
    except RuntimeError:  # pragma: no cover - no backend at all
        pass
    for device in candidates:
        generation = generation_of(device)
        family = "tpu" if generation and generation.startswith("v") else "gpu"
        if generation is not None and family == platform:
            return generation
    return None


def kernel_tiles(
    blocks: BlockSizes,
    platform: str,
    *,
    kind: str,
    seq: int,
    mem: int,
    dim: int,
    itemsize: int,
    mask: str | None,
    generation: str | None = None,
    causal: bool = False,
) -> tuple[KernelTiles, Budget]:
    """The tiling of one kernel on `platform` (`"gpu"` or `"tpu"`) and what it may
    accumulate: `kind` is the pass (`"forward"`, `"rows"`, `"columns"`), `dim` the padded
    head size, `itemsize` the inputs', `generation` the chip's (`None`: as
    `target_generation` finds it), `causal` whether the pass is under the causal
    triangle."""
    if generation is None:
        generation = target_generation(platform)
    wide = itemsize >= 4 and dim > 128
    dtype = "float32" if itemsize >= 4 else "bfloat16"
    target: dict[str, Any] = dict(generation=generation, dtype=dtype, head_dim=dim, mask=mask)
    sizes = blocks.on(platform, seq, **target)
    least_rows = 16 if platform == "gpu" else (32 if mask == "dense" else 16)
    least_keys = 16 if platform == "gpu" else 128

    def blocks_of(sizes: BlockSizes) -> tuple[int, int]:
        # The row passes step through the keys as the forward does; the column pass's
        # programs hold `block_k_terms` keys each.
        block_k = sizes.block_k_terms if kind == "columns" else sizes.block_k
        block_q = cast(int, sizes.block_q)
        if platform == "gpu" and kind == "columns":
            # The column pass's programs hold keys and step through the queries: half a
            # query block per step (a quarter for wide float32 heads) keeps its transposed
            # blocks as small as the row passes'.
            block_q = max(least_rows, block_q // (4 if wide else 2))
        return _pow2(block_q, least_rows), _pow2(cast(int, block_k), least_keys)

    block_q, block_k = blocks_of(sizes)
    # A sequence shorter than a block is one block: of its own length (rounded up), but on
    # the H100 and the B200 of the default tile at least, the tile measured to spill no
    # register there: smaller tiles change Triton's layouts (on the B200 a float32 HVP at 17
    # tokens, tiled 32 x 32 on 8 warps, spilled 532 B; padded to the 64 x 32 tile it
    # spills nothing, as at 1000 tokens). On the A100 the padded tiles spill more.
    floor_q, floor_k = least_rows, least_keys
    if platform == "gpu" and generation in _FULL_TILES:
        floor_q, floor_k = blocks_of(BlockSizes.default(platform, seq, **target))
    bq = min(block_q, _pow2(max(seq, floor_q), least_rows))
    bk = min(block_k, _pow2(max(mem, floor_k), least_keys))
    seq_p = -(-seq // bq) * bq
    mem_p = -(-mem // bk) * bk
    warps = sizes.num_warps
    b200 = platform == "gpu" and generation == "sm_100"
    one_block = (seq_p // bq if kind == "columns" else mem_p // bk) == 1
    short_forward = seq <= _FEW_QUERIES and causal and kind == "forward"
    if b200 and one_block and short_forward and blocks.num_warps is None:
        if itemsize >= 4:
            # A float32 causal forward of at most 8 queries over one block takes 4 warps on
            # the B200: on 8, programs at 5 tokens spilled 4 B at 80 registers (8 B at 128
            # as loops; JAX 0.10 and 0.12). Longer ones keep 8: on 4, under JAX 0.12, the
            # energy-based Transformer's float32 forwards at 14 to 31 tokens (head size 48)
            # spilled 4-12 B at 168 registers, and none did on 8. Not the other passes: on 4
            # warps the energy-based Transformer's bfloat16 HVP at 2 tokens spilled 4-32 B.
            warps = 4
        elif _TRITON_OF_JAX_0_12:
            # Half precision there takes 2 warps with JAX 0.12's Triton, and keeps 8 with
            # older ones: the bfloat16 JVP of the causal log-sum-exp without the diagonal
            # (head size 64) at 5 tokens spilled 8 B at 48 registers on 8 warps under JAX
            # 0.12, where `ptxas` could have taken 255; on 2 it spills nothing, nor do 118
            # short half-precision programs (1-8 tokens, head sizes 16-256, every form).
            # Under JAX 0.10 those 118 spill nothing on 8 warps and two on 2 (the vmapped
            # heads' forward: 16 B at 80 registers, 4 B at 255). On 4 warps that JVP spilled
            # 16-32 B at 4 to 8 tokens (4-24 B under 0.12). benchmarks/README.md, "The chips'
            # own compilers on a CPU".
            warps = 2
    tiles = KernelTiles(
        bq,
        bk,
        seq_p,
        mem_p,
        seq if seq_p != seq else None,
        mem if mem_p != mem else None,
        warps,
        sizes.num_stages,
        sizes.float32_products or "split",
        # Products contract at most this many columns of their operands at once: 32 for
        # float32 (two TF32 parts each), whose 64-column chunks spilled registers on the
        # H100 and the B200 (`ptxas -v`: up to 1.2 KB a kernel).
        None if platform == "tpu" else _contraction(itemsize),
        # On the B200 a kernel whose loop takes one block (a sequence shorter than a tile)
        # keeps it a loop, its trip count hidden from the compilers: unrolled to straight-line
        # code, ptxas traded registers for occupancy and spilled 4-8 B (6 of 43 programs of 1
        # to 63 tokens, 0 as loops). On the A100 the loops spilled instead (2 of 36), and on
        # the H100 neither did.
        keep_loop=b200 and one_block,
    )
    asked = (blocks.block_q, blocks.block_k_terms if kind == "columns" else blocks.block_k)
    if any(size is not None for size in asked):
        _check_fits(tiles, platform, generation, kind, dim, itemsize, blocks)
    if platform == "tpu":
        # VMEM holds a pass's sums and its `(bq, bk)` temporaries (scores, probabilities,
        # each pair's product and each term's weights): a pass of many terms (the layers'
        # second and third derivatives) is split at 512 columns of sums and 4 pairs.
        return tiles, Budget(columns=512, pairs=4)
    return tiles, gpu_budget(generation, itemsize)


#: The most queries of a causal forward over one block that takes fewer warps on the B200.
_FEW_QUERIES = 8

#: Whether the GPU kernels compile with the Triton of JAX 0.12 or later, whose register
#: allocation for short half-precision forwards on the B200 differs from older ones'.
_TRITON_OF_JAX_0_12 = jax.__version_info__ >= (0, 12)

#: The GPU generations on which a short sequence still takes the default tile.
_FULL_TILES = ("sm_90", "sm_100")


def _contraction(itemsize: int) -> int:
    """Columns a GPU product contracts at once (operands of `itemsize` bytes)."""
    return 32 if itemsize >= 4 else 64


def gpu_budget(generation: str | None, itemsize: int) -> Budget:
    """What one GPU kernel may accumulate: 128 columns of sums and 2 bilinear pairs, but
    for float32 (operands in two TF32 parts, products in three) off sm_100, whose sums sit
    in tensor memory rather than registers: 64 columns and 1 pair. A term of two pairs that
    cannot be expanded narrows its tiles (`narrow_tiles`) to fit the A100's shared memory,
    and any chip's the program does not name; not on the H100, where the narrowed tiles
    spilled 4-20 B in the layers' HVPs (the full ones spill nothing). Measured with
    `ptxas -v` (`benchmarks/device_compile.py`, the accelerators guide's matrix)."""
    if itemsize < 4 or generation == "sm_100":
        return Budget(columns=128, pairs=2)
    return Budget(columns=64, pairs=1, narrow=generation != "sm_90")


def narrow_tiles(tiles: KernelTiles) -> KernelTiles:
    """`tiles` with half the rows and half the keys (at least 16 each): for a
    kernel whose products would not fit otherwise (float32 terms of two unexpandable pairs:
    on an A100 the full tiles ask for 196 KiB of shared memory, 163 KiB fit)."""
    return dataclasses.replace(
        tiles,
        bq=max(16, tiles.bq // 2),
        bk=max(16, tiles.bk // 2),
    )


#: Shared memory per block (bytes, opt-in) by NVIDIA generation; scoped VMEM (bytes, the
#: compiler's default limit) by TPU generation. Unknown generations are not checked.
_SHARED_MEMORY = {
    "sm_80": 166912,
    "sm_86": 101376,
    "sm_89": 101376,
    "sm_90": 232448,
    "sm_100": 232448,
    "sm_120": 101376,
}
_VMEM = {"v4": 16 << 20, "v5e": 16 << 20, "v5p": 16 << 20, "v6e": 32 << 20}


def _on_chip_bytes(platform: str, bq: int, bk: int, dim: int, itemsize: int, stages) -> int:
    """About the on-chip memory one kernel's blocks take: on a GPU its operands' blocks (one
    contraction chunk, float32 as two TF32 parts) per pipeline stage and two
    `(bq, bk)` float32 blocks; on a TPU its double-buffered operand blocks (float32 as three
    bfloat16 parts), its running sums and eight `(bq, bk)` float32 temporaries. An
    estimate, for the error below: the compilers decide."""
    element = itemsize * 2 if itemsize >= 4 else itemsize
    if platform == "gpu":
        chunk = min(dim, _contraction(itemsize))
        return max(1, stages or 1) * (bq + bk) * chunk * element + 2 * bq * bk * 4
    element = 6 if itemsize >= 4 else itemsize
    return 2 * (bq + bk) * dim * element + 3 * bq * dim * 4 + 8 * bq * bk * 4


def _check_fits(tiles, platform, generation, kind, dim, itemsize, blocks) -> None:
    """A `ValueError` when tiles a user asked for cannot fit the chip's on-chip memory,
    naming the limit and tiles that would fit."""
    limit = (_SHARED_MEMORY if platform == "gpu" else _VMEM).get(generation or "")
    if limit is None:
        return
    rows, keys = (tiles.bk, tiles.bq) if kind == "columns" else (tiles.bq, tiles.bk)
    stages = tiles.num_stages

    def need(rows, keys):
        return _on_chip_bytes(platform, rows, keys, dim, itemsize, stages)

    if need(rows, keys) <= limit:
        return
    fit_rows, fit_keys = rows, keys
    while need(fit_rows, fit_keys) > limit and max(fit_rows, fit_keys) > 16:
        if fit_rows >= fit_keys:
            fit_rows //= 2
        else:
            fit_keys //= 2
    memory = "shared memory per block" if platform == "gpu" else "scoped VMEM"
    if kind == "columns":
        fit = f"block_k_terms={fit_rows} with {fit_keys} queries per step"
    else:
        fit = f"block_q={fit_rows}, block_k={fit_keys}"
    raise ValueError(
        f"{blocks} asks the {platform.upper()} kernels for {rows} x {keys} blocks ({kind} "
        f"pass), about {need(rows, keys) / 1024:.0f} KiB of on-chip memory at head size "
        f"{dim} ({8 * itemsize}-bit inputs), more than the {limit / 1024:.0f} KiB of {memory} "
        f"of {generation}; {fit} would fit"
    )
