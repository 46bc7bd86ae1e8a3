"""Which implementation of the attention log-sum-exp runs, and in blocks of how many keys.

Every implementation gives the same values and derivatives; this module only decides which
one runs (`select_implementation`) and how the blockwise passes cut the keys
(`block_sizes`). The measurements behind the defaults are in `benchmarks/README.md`.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ..._checks import positive_int

Implementation = Literal["auto", "naive", "blockwise", "pallas", "cudnn"]
IMPLEMENTATIONS = ("auto", "naive", "blockwise", "pallas", "cudnn")

#: Above this many score entries (heads x seq x mem) `"auto"` takes the blockwise path: on a
#: CPU core the blockwise and naive paths cost the same near it, and the blockwise one is
#: faster and far smaller above it (`benchmarks/README.md`, the speed and memory tables).
BLOCKWISE_THRESHOLD = 2**17
#: Keys per block of the blockwise forward pass up to `LONG_SEQUENCE` queries; halved beyond,
#: where a `(seq, 256)` float32 block (8 MiB at seq 8192) is far larger than a CPU core's L2
#: cache (`benchmarks/README.md`).
DEFAULT_BLOCK_SIZE = 256
LONG_SEQUENCE = 4096
#: The passes of the derivatives (which recompute the probabilities) take blocks of
#: `1 / BACKWARD_BLOCK_DIVISOR` of the forward's keys by default: each of their blocks does
#: more products and elementwise passes over its `(seq, block)` matrix than the forward's,
#: so a smaller block stays in the cache (`benchmarks/README.md`).
BACKWARD_BLOCK_DIVISOR = 2

#: On a CPU a vmap over heads runs the blockwise passes head by head once one head's block
#: holds at least this many entries (`seq x block_size`, 128 KiB in float32): then a batch of
#: heads' blocks would not fit in the cache (`benchmarks/README.md`). Smaller blocks are
#: batched over the heads.
HEADS_IN_TURN_ENTRIES = 2**15

_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_implementation(implementation: str) -> str:
    """`implementation` if it names one (a `ValueError` listing them otherwise)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def select_implementation(
    implementation: str,
    *,
    entries: int,
    dtype: DTypeLike,
    head_dim: int,
    structured_mask: bool,
    backend: str | None = None,
    threshold: int | None = None,
) -> str:
    r"""Resolve `implementation` to `"naive"`, `"blockwise"`, `"pallas"` or `"cudnn"`.

    `"auto"` takes the blockwise path when the score matrices would hold more than
    `threshold` entries (`entries = heads * seq * mem`; default `BLOCKWISE_THRESHOLD`
    $= 2^{17}$), and the naive path below that: small problems, where both cost the same and
    the plain program is the simpler one to compile and read. The choice reads only the
    shapes, never the tracing machine's backend.

    The blockwise path is lowered per platform (`_passes`): the Pallas kernels on a GPU (for
    inputs below 64 bits; float64 keeps the XLA loop), the XLA loop of key blocks on a CPU
    and a TPU. `"pallas"` takes the kernels on every platform, in Pallas's interpret mode on
    a CPU (slow; for checking them anywhere). `"cudnn"` is cuDNN's fused attention, by name
    only: it needs an NVIDIA GPU when the program is traced, float16/bfloat16 inputs, a head
    size that is a multiple of 8 up to 128, and no mask (the fused kernel cannot reproduce
    this package's convention for rows with nothing to attend to).

    Every choice gives the same values and derivatives, in forward and reverse mode and to
    any order; only time and memory differ.

    An explicit `"cudnn"` off a GPU, or with a mask, is a `ValueError` (it would otherwise fail
    deep inside XLA).
    """
    check_implementation(implementation)
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
        return "blockwise" if entries > threshold else "naive"
    return implementation


def resolve_block_size(block_size: int | None) -> int | None:
    """A checked `block_size`, or `None`: the default for the number of queries, which
    `lse_rows` picks (`default_block_size`)."""
    return None if block_size is None else positive_int("block_size", block_size)


def default_block_size(seq: int) -> int:
    """Keys per block for `seq` queries: `DEFAULT_BLOCK_SIZE`, halved above `LONG_SEQUENCE`."""
    return DEFAULT_BLOCK_SIZE if seq <= LONG_SEQUENCE else DEFAULT_BLOCK_SIZE // 2


def block_sizes(seq: int, block_size: int | None) -> tuple[int, int]:
    """Keys per block of the forward pass and of the derivatives' passes: `block_size` for
    both when given, else `default_block_size(seq)` and `1 / BACKWARD_BLOCK_DIVISOR` of it."""
    if block_size is not None:
        return block_size, block_size
    forward = default_block_size(seq)
    return forward, max(1, forward // BACKWARD_BLOCK_DIVISOR)
