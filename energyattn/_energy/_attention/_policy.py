"""Which implementation of the attention log-sum-exp runs, and in blocks of how many keys.

Every implementation gives the same values and derivatives; this module only decides which
one runs (`select_implementation`) and how the blockwise passes cut the sequences
(`BlockSizes`, per platform). The measurements behind the defaults are in
`benchmarks/README.md`.
"""

import dataclasses
from typing import Literal, cast

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
    r"""How the blockwise passes cut the sequences, per platform: the tiling of the XLA loop
    (on a CPU, in float64 anywhere, on the ring) and of the Pallas kernels (GPUs, TPUs).

    Every field left `None` takes its platform's default (`BlockSizes.default`); a field
    given applies on every platform. An integer `block_size=n` where the API takes a
    `BlockSizes` means `BlockSizes(block_k=n, block_k_terms=n)`: `n` keys per block in
    every pass.

    | field | CPU (XLA loop) | GPU kernels | TPU kernels |
    | --- | --- | --- | --- |
    | `block_q`: queries per block | every query at once | 64 | 128 |
    | `block_k`: keys per block of the forward | 256 (128 above 4096 queries) | 64 | 128 |
    | `block_k_terms`: keys per block of the derivatives' passes | half of `block_k` | 64 | 128 |
    | `num_warps` (Triton) | - | 4 up to head size 64, else 8 | - |
    | `num_stages` (Triton) | - | 2 | - |

    The kernels round each size up to a power of two, at least 16 (and 128 keys on a TPU:
    the lanes of its vector registers), and a sequence shorter than a block is one block
    of its own length rounded up. Column terms (the derivatives' $\sum_i w_{ij} X_i$) take
    `block_k_terms` keys per program and `block_q` queries per step.

    Why these defaults: on a CPU a `(seq, 256)` float32 block of scores stays in a core's
    cache up to 4096 queries, and the derivatives' passes, which do more work per block,
    want half as many keys (`benchmarks/README.md`); on a GPU 64 x 64 blocks keep a
    weighted pass's several `(64, 64)` weights in registers at head size 128; a TPU's
    matrix unit is 128 x 128.

    Every tiling gives the same values and derivatives; only time and memory differ.
    """

    block_q: int | None = None
    block_k: int | None = None
    block_k_terms: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                object.__setattr__(self, field.name, positive_int(field.name, value))

    @classmethod
    def default(cls, platform: str, seq: int) -> "BlockSizes":
        """The defaults of `platform` (`"cpu"`, `"gpu"` or `"tpu"`) for `seq` queries, every
        field set (`block_q=seq` on a CPU: the XLA loop takes every query at once)."""
        if platform == "cpu":
            keys = 256 if seq <= 4096 else 128
            return cls(seq, keys, keys // 2, None, None)
        if platform == "gpu":
            return cls(64, 64, 64, None, 2)
        if platform == "tpu":
            return cls(128, 128, 128, None, None)
        raise ValueError(f"platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")

    def on(self, platform: str, seq: int) -> "BlockSizes":
        """These sizes, the fields left `None` filled with `platform`'s defaults for `seq`
        queries (`num_warps` stays `None` on a GPU: the kernel picks it by the head size)."""
        default = BlockSizes.default(platform, seq)
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
