"""The attention log-sum-exp every softmax energy is made of: the entry points."""

from typing import Any

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, ArrayLike, Bool, Float

from ..._checks import check_mask, check_matching_dim, check_positive, keyword_arguments
from ..._custom_types import ScalarLike
from ..._dtypes import accumulation_dtype, result_dtype
from ..._mask import SegmentIds
from ..._sharding import axis_size, sequence_axis, split_rows
from . import _policy
from ._blocks import Structure
from ._derivatives import attention_forward
from ._naive import naive_lse
from ._passes import Config, naive_on_cpu
from ._policy import BlockSizes, Implementation, as_block_sizes, select_implementation
from ._ring import RingAxis


def _config(method, structure, blocks: BlockSizes, seq, queries, keys, ring=None):
    # The XLA loop's blocks are set by all `seq` queries (on the ring too: the same blocks as
    # one device), and are no longer than the keys of one pass (less padding, same result).
    # Accelerators want the heads batched (more parallel work per kernel); a CPU core wants
    # one head's blocks in its cache at a time, once they are large (`_passes._in_turn`:
    # only where the program is lowered for a CPU).
    loop = blocks.on("cpu", seq)
    forward, passes = min(loop.block_k, keys), min(loop.block_k_terms, keys)
    heads_in_turn = queries * forward >= _policy.HEADS_IN_TURN_ENTRIES
    return Config(method, structure, forward, passes, ring, heads_in_turn, blocks)


def lse_rows(
    q: Float[Array, "seq dim"],
    k: Float[Array, "mem dim"],
    beta: Float[Array, ""],
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None,
    exclude_self: bool,
    method: str,
    block_size: BlockSizes,
    ring: tuple[Mesh | AbstractMesh, str | tuple[str, ...]] | None = None,
    *,
    causal: bool = False,
) -> Float[Array, " seq"]:
    """The log-sum-exp rows for an already resolved `method` (no checks; used under `vmap`
    over heads by the energies). `beta` must already be in the accumulation dtype;
    `block_size` is the tiling (`BlockSizes`, its defaults set per platform);
    `exclude_self` and `causal` are the structural masks (`attention_logsumexp`), never
    held as a `(seq, mem)` matrix on the blockwise and ring paths.

    With `ring = (mesh, axis)`, or when the sequences are split over a mesh axis (the keys'
    `Explicit` type, or an enclosing `ea.parallel.context_parallel`: `_sharding.sequence_axis`),
    the rows are computed context-parallel by `ring_lse`, whatever `method` says."""
    if k.shape[0] == 0 or q.shape[0] == 0:
        # An empty memory: every row is an empty sum, whose log-sum-exp is defined as 0 (the
        # rule of a fully masked row), not log(0) = -inf. No queries: no rows, on every
        # path (the naive answer; the blocks of the other paths need at least one query).
        return jnp.zeros((q.shape[0],), beta.dtype)
    ring = sequence_axis(q, k) if ring is None else ring
    if ring is not None:
        return ring_lse(q, k, beta, mask, exclude_self, block_size, *ring, causal=causal)
    structure = Structure(bool(exclude_self), bool(causal))
    if method == "naive":
        return naive_lse(q, k, beta, mask, structure)
    seq, mem = q.shape[0], k.shape[0]
    if method == "small":
        config = _config("blockwise", structure, block_size, seq, seq, mem)
        return naive_on_cpu(
            lambda: naive_lse(q, k, beta, mask, structure),
            lambda: attention_forward(q, k, beta, mask, config)[0],
            beta.dtype,
        )
    config = _config(method, structure, block_size, seq, seq, mem)
    return attention_forward(q, k, beta, mask, config)[0]


def ring_lse(
    q: Float[Array, "seq dim"],
    k: Float[Array, "mem dim"],
    beta: Float[Array, ""],
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None,
    exclude_self: bool,
    blocks: BlockSizes,
    mesh: Mesh | AbstractMesh,
    axis: str | tuple[str, ...],
    *,
    causal: bool = False,
) -> Float[Array, " seq"]:
    """The log-sum-exp rows context-parallel: queries, keys and the mask's rows split along
    the sequence over the mesh axis `axis`, key chunks passed round the ring. The same
    derivative rules as the blockwise path, each pass a `jax.shard_map` of its ring loop:
    the same values and derivatives, in both modes and to any order, as one device. The
    structural masks (`exclude_self`, `causal`) are computed per block from the global
    positions of its queries and keys."""
    # Everything around the ring (the energy's other terms, the gradients' scalings) is
    # split along the sequence too.
    q, k = (
        split_rows(q, mesh, axis, "queries' sequence"),
        split_rows(k, mesh, axis, "keys' sequence"),
    )
    mask = None if mask is None else split_mask(mask, mesh, axis)
    size = axis_size(mesh, axis)
    ring = RingAxis(mesh, axis, size)
    structure = Structure(bool(exclude_self), bool(causal))
    seq, mem = q.shape[0], k.shape[0]
    config = _config("blockwise", structure, blocks, seq, seq // size, mem // size, ring)
    return attention_forward(q, k, beta, mask, config)[0]


def split_mask(mask, mesh: Mesh | AbstractMesh, axis) -> Any:
    """A mask split along the sequence over `axis` like its queries (a dense mask by rows,
    segment ids by their queries and their keys)."""
    if isinstance(mask, SegmentIds):
        return SegmentIds(
            split_rows(jnp.asarray(mask.query), mesh, axis, "query segment ids'"),
            split_rows(jnp.asarray(mask.keys), mesh, axis, "key segment ids'"),
        )
    return split_rows(jnp.asarray(mask), mesh, axis, "mask's query")


@keyword_arguments("ea.attention_logsumexp")
def attention_logsumexp(
    query: Float[ArrayLike, "seq dim"],
    keys: Float[ArrayLike, "mem dim"],
    *,
    beta: ScalarLike = 1.0,
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
    exclude_self: bool = False,
    causal: bool = False,
    implementation: Implementation = "auto",
    block_size: int | BlockSizes | None = None,
) -> Float[Array, " seq"]:
    r"""Row-wise attention log-sum-exp, the building block of the softmax energies.

    $$\operatorname{lse}_i = \log \sum_{j:\,\mathrm{allowed}_{ij}} e^{\beta\, q_i\cdot k_j},
      \qquad \frac{\partial \operatorname{lse}_i}{\partial q_i}
      = \beta \sum_j \mathrm{softmax}_j(\beta\, q_i\cdot k_j)\, k_j$$

    where $\mathrm{allowed}_{ij}$ holds when every constraint given holds: $\mathrm{mask}_{ij}$,
    $j \neq i$ (`exclude_self`) and $j \le i$ (`causal`; both together: $j < i$).

    All implementations give the same values and derivatives (to rounding), in forward and
    reverse mode and to any order (`jax.grad`, `jax.jvp`, `jax.linearize`, `jax.hessian`,
    and every composition); they differ in time and memory. `"blockwise"` never holds a
    `(seq, mem)` matrix: its forward is a single online pass over blocks of keys that also
    accumulates the attention output $o_i = \sum_j p_{ij} k_j$, and it is a `jax.custom_jvp`
    whose tangent

    $$\dot{\operatorname{lse}}_i = (\beta\dot q_i + \dot\beta q_i)\cdot o_i
      + \beta\, q_i\cdot \sum_j p_{ij}\, \dot k_j$$

    is another blockwise pass (attention with the keys' tangent as values). Reverse mode is
    that tangent transposed, and every pass that appears in a derivative of any order is
    again blockwise, so gradients, JVPs, Hessian-vector products and third derivatives all
    keep O(seq) memory (`_attention/_derivatives.py`).

    A row with nothing allowed has an empty sum, defined as 0 (no force); so has every row
    when there are no keys at all (`mem = 0`). Scores accumulate in at least float32.

    **Arguments:**

    - `query`: $q$, shape `(seq, dim)`.
    - `keys`: $k$, shape `(mem, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `mask`: optional boolean `(seq, mem)`, `True` where $q_i$ may attend to $k_j$; or
      [`SegmentIds`][energyattn.SegmentIds] (query $i$ attends to key $j$ where their ids
      are equal: packed sequences, padding), which no path but the naive one expands into
      a `(seq, mem)` matrix.
    - `exclude_self`: also disallow $j = i$ (self-attention energies; needs `seq == mem`),
      without building a `(seq, seq)` mask.
    - `causal`: also disallow $j > i$, so that query $i$ attends only to keys up to its own
      position (needs `seq == mem`; with `exclude_self`, only to earlier keys). Like
      `exclude_self` it is never built as a `(seq, seq)` mask on the blockwise path or the
      ring: each block computes it from its positions, and any `mask` is applied on top.
    - `implementation`: `"auto"` (default), `"naive"`, `"small"`, `"blockwise"`, `"pallas"`
      or `"cudnn"`; see [`select_implementation`][energyattn.select_implementation].
      `"auto"` takes the Pallas kernels on GPUs and TPUs; on a CPU the blockwise loop above
      `BLOCKWISE_THRESHOLD` = $2^{17}$ score entries, the naive program below.
    - `block_size`: the tiling, a [`BlockSizes`][energyattn.BlockSizes] (each platform's
      defaults for the fields left `None`) or an integer: keys per block of every pass. By
      default the CPU's loop takes 256 keys per block in the forward (128 beyond 4096
      queries) and half that in the derivatives' passes, which recompute the probabilities.

    **Returns:**

    The log-sum-exp of every query, shape `(seq,)`.

    ??? cite "Source"

        The energy is M. Bal's log-sum-exp (*An Energy-Based Perspective on Attention
        Mechanisms in Transformers*, 2020); the online log-sum-exp and recomputing passes
        follow T. Dao et al., *FlashAttention* (2022).
    """
    check_matching_dim("query", query, "seq dim", "keys", keys, "mem dim")
    seq, dim = jnp.shape(query)
    mem = jnp.shape(keys)[0]
    for name, structural in (("exclude_self", exclude_self), ("causal", causal)):
        if structural and seq != mem:
            raise ValueError(f"{name} needs as many queries as keys, got {seq} and {mem}")
    beta = check_positive("beta", beta)
    query, keys = jnp.asarray(query), jnp.asarray(keys)
    if mask is not None:
        mask = check_mask(mask, (seq, mem), "seq mem", segments=True)
    method = select_implementation(
        implementation,
        entries=seq * mem,
        dtype=result_dtype(query, keys),
        head_dim=dim,
        structured_mask=mask is not None or bool(exclude_self) or bool(causal),
    )
    acc = accumulation_dtype(query, keys)
    return lse_rows(
        query,
        keys,
        beta.astype(acc),
        mask,
        bool(exclude_self),
        method,
        as_block_sizes(block_size),
        causal=bool(causal),
    )
