r"""The attention log-sum-exp every softmax energy is made of, in three implementations.

$$\operatorname{lse}_i = \log \sum_{j:\,\mathrm{allowed}_{ij}} e^{\beta\, q_i\cdot k_j}$$

Its gradient with respect to $q_i$ is $\beta \sum_j p_{ij} k_j$ with
$p_{ij} = e^{\beta q_i\cdot k_j - \operatorname{lse}_i}$: softmax attention. So an energy built
from it (Hopfield, Energy Transformer) yields attention when differentiated, and the cost and
memory of that gradient are decided here:

- `"naive"`: scores, log-sum-exp and their autodiff; the `(seq, mem)` matrices are held.
- `"blockwise"`: a `jax.custom_vjp`. The forward is an online (running-max) log-sum-exp over
  blocks of `block_size` keys that also accumulates $\sum_j p_{ij} k_j$ in the same pass (flash
  attention's forward); the backward reuses that sum for the queries' cotangent and recomputes
  the probabilities block by block from the saved log-sum-exp for the keys' cotangent. The
  forward pass has a flash-style backward of its own, so second derivatives (training through
  an attention step) are blockwise as well. No `(seq, mem)` matrix is ever held, only
  `(seq, block_size)` blocks.
- `"cudnn"`: on NVIDIA GPUs the same custom_vjp, with the forward (and the keys' cotangent)
  computed by cuDNN's fused attention through `jax.nn.dot_product_attention`.

`"auto"` picks cuDNN where it applies, else blockwise above a size threshold, else naive.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import check_mask, check_matching_dim, check_positive, positive_int
from .._custom_types import ScalarLike
from .._sharding import axis_size, explicit_sequence_axis, split_rows

Implementation = Literal["auto", "naive", "blockwise", "cudnn"]
IMPLEMENTATIONS = ("auto", "naive", "blockwise", "cudnn")

#: Above this many score entries (heads x seq x mem) `"auto"` takes the blockwise path. On a
#: CPU core (head size 64, float32) it is faster than the naive one from 2^18 entries on (seq
#: 512: forward 152 vs 146 GFLOP/s, training 147 vs 131 at 1 head; 163 vs 138 and 145 vs 97
#: at 8 heads), level at 1 head x 256 x 256, and slower at 8 heads x 128 x 128 (forward 100
#: vs 119, training 116 vs 125); the memory it saves grows with the size.
BLOCKWISE_THRESHOLD = 2**17
#: Keys per block of the blockwise path by default, up to `LONG_SEQUENCE` queries; halved
#: beyond, where a `(seq, 256)` float32 block (8 MiB at seq 8192) is far larger than a CPU
#: core's L2 cache. On a CPU core, head size 64, 1 head (GFLOP/s, as counted by
#: `benchmarks/attention_speed.py`): training 146 (128) vs 151 (256) at seq 1024, 160 vs 159
#: at 2048, 159 vs 152 (512: 143) at 4096, 149 vs 138 at 8192; the forward 163 vs 167 at
#: 1024, 169 vs 168 (512: 174) at 2048, 171 vs 173 at 4096, 174 vs 167 at 8192. Blocks of
#: 1024 keys were 10-60% slower.
DEFAULT_BLOCK_SIZE = 256
LONG_SEQUENCE = 4096
#: By default the backward passes (the blockwise custom_vjps' recomputations) take blocks of
#: `1 / BACKWARD_BLOCK_DIVISOR` of the forward's keys: each backward block is three products
#: and two elementwise passes over a `(seq, block)` matrix against the forward's two and one,
#: so it holds more in the cache at once. On a CPU core (training step, head size 64, one
#: machine's matrix-product roofline measured in the same run) 128-key backward blocks took
#: seq 4096 from 80% to 85% of the roofline at 1 head and 2-4 points higher at 8 heads, 64-key
#: blocks seq 8192 1.5 points; level at seq 1024 (82%) and seq 2048 with 8 heads (85%).
BACKWARD_BLOCK_DIVISOR = 2

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
    r"""Resolve `implementation` to `"naive"`, `"blockwise"` or `"cudnn"`.

    `"auto"` takes cuDNN's fused attention when the backend is a GPU, the inputs are float16 or
    bfloat16 (the dtypes cuDNN's flash attention accepts), the head size is a multiple of 8 up
    to 128, and there is no mask (an explicit mask or the excluded diagonal): the fused kernel
    cannot reproduce this package's convention for rows with nothing to attend to. Otherwise
    it takes the blockwise path when the score matrices would hold more than `threshold`
    entries (`entries = heads * seq * mem`; default `BLOCKWISE_THRESHOLD` $= 2^{17}$), and the
    naive path below that: small problems, where both cost the same on a CPU and the plain
    program is the simpler one to compile and read.

    An explicit `"cudnn"` off a GPU, or with a mask, is a `ValueError` (it would otherwise fail
    deep inside XLA).
    """
    check_implementation(implementation)
    threshold = BLOCKWISE_THRESHOLD if threshold is None else threshold
    backend = jax.default_backend() if backend is None else backend
    cudnn_ok = (
        backend in ("gpu", "cuda")
        and jnp.dtype(dtype) in _CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= 128
        and not structured_mask
    )
    if implementation == "cudnn":
        if not cudnn_ok:
            raise ValueError(
                "implementation='cudnn' needs an NVIDIA GPU backend, float16/bfloat16 inputs, a "
                f"head size that is a multiple of 8 up to 128 and no mask; got backend "
                f"{backend!r}, dtype {jnp.dtype(dtype)}, head size {head_dim}, "
                f"mask={'yes' if structured_mask else 'no'}"
            )
        return "cudnn"
    if implementation == "auto":
        if cudnn_ok:
            return "cudnn"
        return "blockwise" if entries > threshold else "naive"
    return implementation


# ----------------------------------------------------------------------------- naive path


def _allowed_matrix(
    seq: int, mem: int, mask: Bool[Array, "seq mem"] | None, exclude_self: bool
) -> Bool[Array, "seq mem"] | None:
    allowed = None
    if exclude_self:
        allowed = ~jnp.eye(seq, mem, dtype=bool)
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    return allowed


def masked_logsumexp(
    a: Float[Array, "seq mem"], mask: Bool[Array, "seq mem"] | None
) -> Float[Array, " seq"]:
    """Row-wise log-sum-exp over the entries where `mask` is True.

    Masked entries drop out exactly (they contribute `exp(-inf) = 0`, not a large negative
    number), and neither their values nor their gradients can reach the result. A row with
    no entry left is a sum over the empty set; its log would be `-inf`, and we define it as 0
    so that energies stay finite and the force on that row vanishes. With no columns at all
    (an empty memory) every row is such an empty sum.
    """
    if a.shape[-1] == 0:
        # No entries at all (an empty memory): every row is an empty sum.
        return jnp.zeros(a.shape[:-1], a.dtype)
    if mask is None:
        return jax.nn.logsumexp(a, axis=-1)
    nonempty = jnp.any(mask, axis=-1)
    shift = jnp.max(jnp.where(mask, a, -jnp.inf), axis=-1, keepdims=True)
    # The log-sum-exp does not depend on the shift, so no gradient needs to flow through it.
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shift), shift, 0.0))
    # Double `where`: masked entries are replaced before `exp`, so a NaN/inf hiding in a masked
    # score can poison neither the value nor the gradient.
    terms = jnp.where(mask, jnp.exp(jnp.where(mask, a, shift) - shift), 0.0)
    total = jnp.sum(terms, axis=-1)
    lse = jnp.log(jnp.where(nonempty, total, 1.0)) + shift[:, 0]
    return jnp.where(nonempty, lse, 0.0)


def _naive_lse(q, k, beta, mask, exclude_self):
    scores = beta * jnp.einsum("sd,md->sm", q, k, preferred_element_type=beta.dtype)
    return masked_logsumexp(scores, _allowed_matrix(q.shape[0], k.shape[0], mask, exclude_self))


# ------------------------------------------------------------------------- blockwise path
#
# Every blockwise pass below works on one *chunk* of keys: all the keys on one device, or,
# in the ring (context-parallel) path, the keys of one device visiting another. A chunk
# knows where it sits in the whole problem through `offsets = (row0, col0)`, the global
# index of its first query and first key (0, 0 on one device), which is all that the
# excluded diagonal needs; its mask is the `(seq, chunk)` slice of the rows' mask. The
# passes that accumulate over keys take and return their running state (`carry`), so the
# ring can thread it through the chunks of every device.


def _blocks(k, mask, block_size):
    """Keys as `(blocks, block_size, dim)` (zero padded) and the mask as
    `(blocks, seq, block_size)` (padding masked), plus each block's first key index."""
    mem = k.shape[0]
    num_blocks = -(-mem // block_size)
    pad = num_blocks * block_size - mem
    k_blocks = jnp.pad(k, ((0, pad), (0, 0))).reshape(num_blocks, block_size, k.shape[1])
    if mask is not None:
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
        mask = mask.reshape(mask.shape[0], num_blocks, block_size).transpose(1, 0, 2)
    starts = jnp.arange(num_blocks) * block_size
    return k_blocks, mask, starts


def _block_allowed(seq, start, block_size, mem, mask_block, exclude_self, offsets):
    """Which entries of one `(seq, block_size)` block take part (or `None`: all of them)."""
    cols = start + jnp.arange(block_size)
    allowed = None
    if mem % block_size:  # the last block is padded with keys that must not count
        allowed = jnp.broadcast_to(cols[None, :] < mem, (seq, block_size))
    if exclude_self:
        row0, col0 = offsets
        off_diagonal = (row0 + jnp.arange(seq))[:, None] != (col0 + cols)[None, :]
        allowed = off_diagonal if allowed is None else allowed & off_diagonal
    if mask_block is not None:
        allowed = mask_block if allowed is None else allowed & mask_block
    return allowed


def _block_probs(scores, shift, allowed):
    """`exp(scores - shift)` on the allowed entries of a block, 0 elsewhere. Double `where`: a
    NaN/inf in a disallowed score cannot reach `exp` (nor its gradient)."""
    if allowed is None:
        return jnp.exp(scores - shift[:, None])
    return jnp.where(allowed, jnp.exp(jnp.where(allowed, scores, 0.0) - shift[:, None]), 0.0)


def _forward_init(q, acc):
    """The online pass's state before any key: running max, rescaled sum, rescaled output."""
    seq, dim = q.shape
    return (jnp.full((seq,), -jnp.inf, acc), jnp.zeros((seq,), acc), jnp.zeros((seq, dim), acc))


def _forward_chunk(q, k, beta, mask, exclude_self, block_size, carry, offsets=(0, 0)):
    r"""The online pass over one chunk of keys: updates the running max, the rescaled sum of
    exponentials and the rescaled $\sum_j p_{ij} k_j$."""
    seq = q.shape[0]
    mem = k.shape[0]
    acc = beta.dtype
    k_blocks, mask_blocks, starts = _blocks(k, mask, block_size)
    # beta scales the queries once rather than every block's scores (7% of the forward's
    # time at seq 2048-4096 on a CPU core); half-precision queries keep their dtype for the
    # product, and beta stays on the float32 scores.
    scale = beta
    if q.dtype == acc:
        q, scale = beta * q, 1.0

    def body(carry, xs):
        run_max, total, out = carry
        k_b, mask_b, start = xs
        scores = scale * jnp.einsum("sd,bd->sb", q, k_b, preferred_element_type=acc)
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, exclude_self, offsets)
        if allowed is None:
            new_max = jnp.maximum(run_max, jnp.max(scores, axis=1))
        else:
            new_max = jnp.maximum(run_max, jnp.max(jnp.where(allowed, scores, -jnp.inf), axis=1))
        # Rows with nothing allowed so far keep a max of -inf; shift them by 0 instead.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = _block_probs(scores, shift, allowed)
        rescale = jnp.exp(run_max - shift)
        total = total * rescale + jnp.sum(probs, axis=1)
        out = out * rescale[:, None] + jnp.einsum(
            "sb,bd->sd", probs.astype(k.dtype), k_b, preferred_element_type=acc
        )
        return (new_max, total, out), None

    carry, _ = jax.lax.scan(body, carry, (k_blocks, mask_blocks, starts))
    return carry


def _forward_finish(carry):
    """The log-sum-exp and the attention output from the online pass's final state."""
    run_max, total, out = carry
    # Every allowed row has total >= 1 (its max entry contributes exp(0)); empty rows have 0.
    nonempty = total > 0
    safe_total = jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, jnp.log(safe_total) + jnp.where(nonempty, run_max, 0.0), 0.0)
    return lse, out / safe_total[:, None]


def _blockwise_forward(q, k, beta, mask, exclude_self, block_size):
    r"""One pass over key blocks: the log-sum-exp and the attention output
    $\sum_j p_{ij} k_j$ (running max, rescaled partial sums)."""
    init = _forward_init(q, beta.dtype)
    return _forward_finish(_forward_chunk(q, k, beta, mask, exclude_self, block_size, init))


def _key_rows(dk_t, mem):
    """The keys' cotangent `(mem, dim)` from its blocks, accumulated transposed as
    `(blocks, dim, block_size)` (see `_forward_cotangents_chunk`)."""
    return dk_t.transpose(0, 2, 1).reshape(-1, dk_t.shape[1])[:mem]


def _forward_cotangents_chunk(
    q, k, beta, mask, exclude_self, block_size, lse, row_term, d_out, carry, offsets=(0, 0)
):
    r"""One chunk of the cotangents of the online pass's outputs `(lse, out)` with respect to
    `(q, k, beta)`, recomputing the probabilities block by block (flash attention's backward,
    with the keys also the values):

    $$dS_{ij} = p_{ij}\,(\bar o_i\cdot k_j - \bar o_i\cdot o_i + \bar l_i),\quad
      \bar q_i = \beta\sum_j dS_{ij} k_j,\quad
      \bar k_j = \beta\sum_i dS_{ij} q_i + \sum_i p_{ij}\bar o_i,\quad
      \bar\beta = \sum_{ij} dS_{ij}\, q_i\cdot k_j,$$

    with `row_term` $= \bar l_i - \bar o_i\cdot o_i$. `carry` accumulates
    $(\bar q, \bar\beta)$; the chunk's keys' cotangent is returned.

    The keys' cotangent is a sum over the queries, per block
    $\bar k_b^\top = \beta\, q^\top dS_b + \bar o^\top p_b$, taken against the transposed
    queries and accumulated transposed: XLA's CPU matrix product is 2.3x slower with the
    contracted axis (the queries) leading both operands (83 vs 196 GFLOP/s for a
    `(2048, 256)` block, head_dim 64), which had cost the backward a third of its time.
    """
    seq = q.shape[0]
    mem = k.shape[0]
    acc = beta.dtype
    k_blocks, mask_blocks, starts = _blocks(k, mask, block_size)

    def body(carry, xs):
        dq, dbeta = carry
        k_b, mask_b, start = xs
        qk = jnp.einsum("sd,bd->sb", q, k_b, preferred_element_type=acc)
        scores = beta * qk
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, exclude_self, offsets)
        probs = _block_probs(scores, lse, allowed)
        if allowed is not None:
            qk = jnp.where(allowed, qk, 0.0)
        d_scores = probs * (jnp.einsum("sd,bd->sb", d_out, k_b) + row_term[:, None])
        dq = dq + beta * jnp.einsum("sb,bd->sd", d_scores, k_b)
        dk_t = beta * jnp.einsum("ds,sb->db", q_t, d_scores)
        dk_t = dk_t + jnp.einsum("ds,sb->db", d_out_t, probs)
        return (dq, dbeta + jnp.sum(d_scores * qk)), dk_t

    q_t, d_out_t = q.T, d_out.T
    carry, dk_t = jax.lax.scan(body, carry, (k_blocks, mask_blocks, starts))
    return carry, _key_rows(dk_t, mem)


def _row_term(res, cot):
    # d lse_i enters every score of row i with weight p_ij, like -(d out_i . out_i).
    (_, out), (d_lse, d_out) = res, cot
    return d_lse - jnp.einsum("sd,sd->s", d_out, out)


def _blockwise_forward_cotangents(q, k, beta, mask, exclude_self, block_size, res, cot):
    """Cotangents of `_blockwise_forward`'s outputs `(lse, out)` with respect to
    `(q, k, beta)` (see `_forward_cotangents_chunk`)."""
    acc = beta.dtype
    init = (jnp.zeros(q.shape, acc), jnp.zeros((), acc))
    (dq, dbeta), dk = _forward_cotangents_chunk(
        q, k, beta, mask, exclude_self, block_size, res[0], _row_term(res, cot), cot[1], init
    )
    return dq, dk, dbeta


def _key_cotangent_chunk(q, k, beta, mask, exclude_self, block_size, lse, weights, offsets=(0, 0)):
    r"""$\sum_i w_i\, p_{ij}\, q_i$ for every key $j$ of a chunk, recomputing $p$ block by
    block (against the transposed queries, as in `_forward_cotangents_chunk`)."""
    seq = q.shape[0]
    mem = k.shape[0]
    acc = beta.dtype
    k_blocks, mask_blocks, starts = _blocks(k, mask, block_size)
    weighted_q_t = (weights[:, None] * q).astype(acc).T

    def one_block(xs):
        k_b, mask_b, start = xs
        scores = beta * jnp.einsum("sd,bd->sb", q, k_b, preferred_element_type=acc)
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, exclude_self, offsets)
        probs = _block_probs(scores, lse, allowed)
        return jnp.einsum("ds,sb->db", weighted_q_t, probs)

    return _key_rows(jax.lax.map(one_block, (k_blocks, mask_blocks, starts)), mem)


def _blockwise_key_cotangent(q, k, beta, mask, exclude_self, block_size, lse, weights):
    r"""$\sum_i w_i\, p_{ij}\, q_i$ for every key $j$, recomputing $p$ block by block."""
    return _key_cotangent_chunk(q, k, beta, mask, exclude_self, block_size, lse, weights)


def _key_cotangent_vjp_chunk(
    q, k, g, beta, mask, exclude_self, block_size, lse, weights, carry, offsets=(0, 0)
):
    r"""One chunk of the cotangents of $T_j = \sum_i w_i\, p_{ij}\, q_i$
    (`_key_cotangent_chunk`) with respect to `(q, k, beta, lse, weights)` for an output
    cotangent $G$ (`g`, one row per key of the chunk), block by block. With
    $u_{ij} = G_j\cdot q_i$ and $A_{ij} = w_i\, u_{ij}\, p_{ij}$:

    $$\bar q_i = \sum_j w_i p_{ij} G_j + \beta\sum_j A_{ij} k_j,\quad
      \bar k_j = \beta\sum_i A_{ij} q_i,\quad \bar\beta = \sum_{ij} A_{ij}\, q_i\cdot k_j,\quad
      \bar l_i = -\sum_j A_{ij},\quad \bar w_i = \sum_j p_{ij} u_{ij}.$$

    `carry` accumulates $(\bar q, \bar l, \bar w, \bar\beta)$; the chunk's keys' cotangent
    is returned.
    """
    seq, dim = q.shape
    mem = k.shape[0]
    acc = beta.dtype
    k_blocks, mask_blocks, starts = _blocks(k, mask, block_size)
    g_blocks = jnp.pad(g, ((0, k_blocks.shape[0] * block_size - mem), (0, 0))).reshape(
        k_blocks.shape
    )

    def body(carry, xs):
        dq, dlse, dw, dbeta = carry
        k_b, g_b, mask_b, start = xs
        qk = jnp.einsum("sd,bd->sb", q, k_b, preferred_element_type=acc)
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, exclude_self, offsets)
        probs = _block_probs(beta * qk, lse, allowed)
        if allowed is not None:
            qk = jnp.where(allowed, qk, 0.0)
        u = jnp.einsum("sd,bd->sb", q, g_b, preferred_element_type=acc)
        a = weights[:, None] * u * probs
        dq = dq + jnp.einsum("sb,bd->sd", weights[:, None] * probs, g_b)
        dq = dq + beta * jnp.einsum("sb,bd->sd", a, k_b)
        dk_t = beta * jnp.einsum("ds,sb->db", q_t, a)
        carry = (
            dq,
            dlse - jnp.sum(a, axis=1),
            dw + jnp.sum(probs * u, axis=1),
            dbeta + jnp.sum(a * qk),
        )
        return carry, dk_t

    q_t = q.T
    carry, dk_t = jax.lax.scan(body, carry, (k_blocks, g_blocks, mask_blocks, starts))
    return carry, _key_rows(dk_t, mem)


def _key_cotangent_vjp_init(q, acc):
    zeros = jnp.zeros((q.shape[0],), acc)
    return (jnp.zeros(q.shape, acc), zeros, zeros, jnp.zeros((), acc))


def _blockwise_key_cotangent_vjp(q, k, beta, mask, exclude_self, block_size, lse, weights, g):
    """Cotangents of `_blockwise_key_cotangent` (see `_key_cotangent_vjp_chunk`)."""
    init = _key_cotangent_vjp_init(q, beta.dtype)
    (dq, dlse, dw, dbeta), dk = _key_cotangent_vjp_chunk(
        q, k, g, beta, mask, exclude_self, block_size, lse, weights, init
    )
    return dq, dk, dbeta, dlse, dw


# ----------------------------------------------------------------------------- ring path
#
# Context parallelism: queries and keys are split along the sequence over a mesh axis of P
# devices, and these functions run inside `jax.shard_map` on one device's shard. Each device
# keeps its queries (and their rows of the mask) and the key chunks go round the ring
# (`jax.lax.ppermute` to the next device), P visits in all; at every visit the device runs
# the one-device chunk pass above on the visiting chunk, with the chunk's global offsets. A
# pass that produces the keys' cotangent sends a running sum along with the keys, which
# comes home after the P-th hop. Per-device memory is O(seq / P): one chunk of keys (and of
# its cotangent) at a time, plus the blocks of the chunk pass.


class RingAxis(NamedTuple):
    """The mesh, and the axis of it (or several, flattened) that the sequence is split over,
    with its size."""

    mesh: Mesh | AbstractMesh
    name: str | tuple[str, ...]
    size: int


#: Keys per piece of the ring: a device's chunk goes round in pieces of at least this many
#: keys (one full turn per piece), so that what is in flight (a piece of keys, and of their
#: cotangent, sent and received) stays small beside the device's own share of the sequence.
#: At seq 64k on 8 devices with head size 64 a piece is 0.25 MiB against 2 MiB per chunk.
RING_PIECE = 512


def _num_pieces(length: int) -> int:
    """The most pieces of at least `RING_PIECE` keys (or one) that divide `length`."""
    most = max(1, length // RING_PIECE)
    return next(n for n in range(most, 0, -1) if length % n == 0)


def _ring_pass(ring, step, carry, travel, total=None):
    """Run `step(carry, piece, first_key) -> (carry, contribution)` on every piece of keys of
    every device of the ring, `first_key` being the global index of the piece's first key.
    Each device's chunk `travel` (a pytree of per-key arrays) is cut into pieces, and each
    piece makes one turn of the ring. With `total` (per-key running sums that travel with
    the keys) the contributions are summed and come back to the keys' own device."""
    me = jax.lax.axis_index(ring.name)
    perm = [(i, (i + 1) % ring.size) for i in range(ring.size)]
    mem = jax.tree.leaves(travel)[0].shape[0]
    num_pieces = _num_pieces(mem)
    size = mem // num_pieces

    def send(tree):
        return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.name, perm), tree)

    def cut(tree):
        return jax.tree.map(lambda x: x.reshape(num_pieces, size, *x.shape[1:]), tree)

    def first_key(t, piece):
        # After t hops this device holds the piece of device me - t.
        return ((me - t) % ring.size) * mem + piece * size

    if total is None:

        def one_piece(carry, xs):
            piece, travel = xs

            # The next piece is sent while this one is worked on (neither waits for the other).
            def body(state, t):
                carry, travel = state
                carry, _ = step(carry, travel, first_key(t, piece))
                return (carry, send(travel)), None

            (carry, travel), _ = jax.lax.scan(body, (carry, travel), jnp.arange(ring.size - 1))
            return step(carry, travel, first_key(ring.size - 1, piece))[0], None

        carry, _ = jax.lax.scan(one_piece, carry, (jnp.arange(num_pieces), cut(travel)))
        return carry, None

    def one_piece(carry, xs):
        piece, travel, total = xs

        def body(state, t):
            carry, travel, total = state
            carry, contribution = step(carry, travel, first_key(t, piece))
            total = jax.tree.map(jnp.add, total, contribution)
            return (carry, send(travel), send(total)), None

        (carry, _, total), _ = jax.lax.scan(body, (carry, travel, total), jnp.arange(ring.size))
        return carry, total

    carry, total = jax.lax.scan(one_piece, carry, (jnp.arange(num_pieces), cut(travel), cut(total)))
    return carry, jax.tree.map(lambda x: x.reshape(mem, *x.shape[2:]), total)


def _ring_chunk(ring, q, k, mask, first_key):
    """The visiting piece's mask columns and its `(row0, col0)` offsets."""
    mem = k.shape[0]
    if mask is not None:
        mask = jax.lax.dynamic_slice_in_dim(mask, first_key, mem, axis=1)
    return mask, (jax.lax.axis_index(ring.name) * q.shape[0], first_key)


def _ring_forward(ring, q, k, beta, mask, exclude_self, block_size):
    def step(carry, k_chunk, first_key):
        mask_c, offsets = _ring_chunk(ring, q, k_chunk, mask, first_key)
        args = (q, k_chunk, beta, mask_c, exclude_self, block_size, carry, offsets)
        return _forward_chunk(*args), None

    carry, _ = _ring_pass(ring, step, _forward_init(q, beta.dtype), k)
    return _forward_finish(carry)


def _ring_forward_cotangents(ring, q, k, beta, mask, exclude_self, block_size, res, cot):
    row_term = _row_term(res, cot)

    def step(carry, k_chunk, first_key):
        mask_c, offsets = _ring_chunk(ring, q, k_chunk, mask, first_key)
        return _forward_cotangents_chunk(
            q,
            k_chunk,
            beta,
            mask_c,
            exclude_self,
            block_size,
            res[0],
            row_term,
            cot[1],
            carry,
            offsets,
        )

    acc = beta.dtype
    init = (jnp.zeros(q.shape, acc), jnp.zeros((), acc))
    (dq, dbeta), dk = _ring_pass(ring, step, init, k, jnp.zeros(k.shape, acc))
    return dq, dk, jax.lax.psum(dbeta, ring.name)


def _ring_key_cotangent(ring, q, k, beta, mask, exclude_self, block_size, lse, weights):
    def step(carry, k_chunk, first_key):
        mask_c, offsets = _ring_chunk(ring, q, k_chunk, mask, first_key)
        return carry, _key_cotangent_chunk(
            q, k_chunk, beta, mask_c, exclude_self, block_size, lse, weights, offsets
        )

    return _ring_pass(ring, step, (), k, jnp.zeros(k.shape, beta.dtype))[1]


def _ring_key_cotangent_vjp(ring, q, k, beta, mask, exclude_self, block_size, lse, weights, g):
    def step(carry, chunk, first_key):
        k_chunk, g_chunk = chunk
        mask_c, offsets = _ring_chunk(ring, q, k_chunk, mask, first_key)
        return _key_cotangent_vjp_chunk(
            q,
            k_chunk,
            g_chunk,
            beta,
            mask_c,
            exclude_self,
            block_size,
            lse,
            weights,
            carry,
            offsets,
        )

    init = _key_cotangent_vjp_init(q, beta.dtype)
    carry, dk = _ring_pass(ring, step, init, (k, g), jnp.zeros(k.shape, beta.dtype))
    dq, dlse, dw, dbeta = carry
    return dq, dk, jax.lax.psum(dbeta, ring.name), dlse, dw


def _on_ring(local, ring, out_specs):
    """A ring pass `local(ring, q, k, beta, mask, exclude_self, block_size, *rows)` as a
    function of the whole (global) arrays: `jax.shard_map` over the ring's axis, with `q`,
    `k`, the mask's rows and every array of `rows` (per-query or per-key arrays) split along
    their leading axis and `beta` replicated. The custom_vjps that use it see only global
    arrays, so their residuals never cross a `shard_map` boundary."""
    split = PartitionSpec(ring.name)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in ring.mesh.axis_types)

    def run(q, k, beta, mask, exclude_self, block_size, *rows):
        def body(q, k, beta, mask, rows):
            return local(ring, q, k, beta, mask, exclude_self, block_size, *rows)

        args = (q, k, beta, mask, rows)
        specs = (split, split, PartitionSpec(), PartitionSpec(ring.name, None), split)
        if explicit:
            # Explicit sharding types must match the specs exactly (queries may arrive whole).
            args = jax.tree.map(
                lambda spec, tree: jax.tree.map(
                    lambda a: jax.sharding.reshard(a, NamedSharding(ring.mesh, spec)), tree
                ),
                specs,
                args,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        return jax.shard_map(
            body, mesh=ring.mesh, in_specs=specs, out_specs=out_specs, check_vma=False
        )(*args)

    return run


#: The `jax.nn.dot_product_attention` implementation of the fused path. Tests swap in `"xla"`
#: to check this path's wiring (layouts, cotangents) on a CPU.
_FUSED_KERNEL = "cudnn"


def _fused_attention(q, k, v, beta, **kwargs):
    # beta is folded into the queries (scale=1): the fused kernel takes its scale as a static
    # float, while beta is traced (a trainable field of the layers).
    return jax.nn.dot_product_attention(
        (beta.astype(q.dtype) * q)[None, :, None, :],
        k[None, :, None, :],
        v[None, :, None, :],
        scale=1.0,
        implementation=_FUSED_KERNEL,
        **kwargs,
    )


def _cudnn_forward(q, k, beta, block_size):
    # The fused kernel's own log-sum-exp comes back cast to the inputs' half precision, so the
    # energy's value is taken from the float32 online pass instead; when only the gradient
    # (the attention output) is used, XLA drops that pass.
    lse = _blockwise_forward(q, k, beta, None, False, block_size)[0]
    out = _fused_attention(q, k, k, beta)
    return lse, out[0, :, 0, :].astype(beta.dtype)


def _cudnn_key_cotangent(q, k, beta, weights):
    # sum_i w_i p_ij q_i is the value cotangent of attention(q, k, v) for an output cotangent
    # w_i q_i; the fused backward computes it without the (seq, mem) matrix.
    _, vjp = jax.vjp(lambda v: _fused_attention(q, k, v, beta), k)
    (cotangent,) = vjp((weights[:, None] * q).astype(q.dtype)[None, :, None, :])
    return cotangent.astype(beta.dtype)


def _heads_in_turn(pass_fn):
    """`pass_fn` (a blockwise pass, `(q, k, beta, mask, exclude_self, block_size, *rest)`)
    batched by `jax.vmap` as a loop over the batch (the heads) rather than as batched matrix
    products. On a CPU a batched pass's `(heads, seq, block)` blocks no longer fit in the
    cache, and each elementwise step over them goes to memory: at 8 heads, seq 2048 the loop
    takes the forward from 89 to 53 ms and training from 252 to 162 ms (one core).

    `sequential_vmap` has no reverse-mode rule, so differentiating the pass itself (a third
    derivative of the energy) takes the plain pass's VJP, batched as usual."""

    def wrapped(q, k, beta, mask, exclude_self, block_size, *rest):
        def plain(q, k, beta, mask, *rest):
            return pass_fn(q, k, beta, mask, exclude_self, block_size, *rest)

        looped = jax.custom_batching.sequential_vmap(plain)

        @jax.custom_vjp
        def run(*args):
            return looped(*args)

        def run_fwd(*args):
            return looped(*args), args

        def run_bwd(args, cotangent):
            grads = jax.vjp(plain, *args)[1](cotangent)
            return grads[:3] + (None,) + grads[4:]  # the mask takes no cotangent

        run.defvjp(run_fwd, run_bwd)
        return run(q, k, beta, mask, *rest)

    return wrapped


def _make_fused(
    method: str,
    exclude_self: bool,
    block_size: int,
    backward_block_size: int,
    ring: RingAxis | None,
    heads_in_turn: bool,
):
    """The log-sum-exp as a `custom_vjp` (one per static configuration): its forward pass in
    blocks of `block_size` keys, every pass of its derivatives (which recompute the
    probabilities) in blocks of `backward_block_size`. With `ring` it is
    the context-parallel log-sum-exp of one device's shard (inside `jax.shard_map`): the same
    custom_vjps around the ring passes. With `heads_in_turn` (on a CPU) a batch of heads runs
    the blockwise passes one head after another (`_heads_in_turn`)."""
    if ring is None:
        forward_pass = _blockwise_forward
        forward_cotangents = _blockwise_forward_cotangents
        key_cotangent_pass = _blockwise_key_cotangent
        key_cotangent_vjp = _blockwise_key_cotangent_vjp
        if heads_in_turn:
            forward_pass = _heads_in_turn(forward_pass)
            forward_cotangents = _heads_in_turn(forward_cotangents)
            key_cotangent_pass = _heads_in_turn(key_cotangent_pass)
            key_cotangent_vjp = _heads_in_turn(key_cotangent_vjp)
    else:
        split, whole = PartitionSpec(ring.name), PartitionSpec()
        forward_pass = _on_ring(_ring_forward, ring, (split, split))
        forward_cotangents = _on_ring(_ring_forward_cotangents, ring, (split, split, whole))
        key_cotangent_pass = _on_ring(_ring_key_cotangent, ring, split)
        key_cotangent_vjp = _on_ring(
            _ring_key_cotangent_vjp, ring, (split, split, whole, split, split)
        )

    # The forward pass (log-sum-exp and attention output) has a custom_vjp of its own, so
    # that differentiating the energy's gradient again -- training through a descent step --
    # also runs block by block instead of storing every block's probabilities.
    @jax.custom_vjp
    def blockwise_forward(q, k, beta, mask):
        return forward_pass(q, k, beta, mask, exclude_self, block_size)

    def blockwise_forward_fwd(q, k, beta, mask):
        res = forward_pass(q, k, beta, mask, exclude_self, block_size)
        return res, (q, k, beta, mask, res)

    def blockwise_forward_bwd(saved, cot):
        q, k, beta, mask, res = saved
        dq, dk, dbeta = forward_cotangents(
            q, k, beta, mask, exclude_self, backward_block_size, res, cot
        )
        return dq.astype(q.dtype), dk.astype(k.dtype), dbeta.astype(beta.dtype), None

    blockwise_forward.defvjp(blockwise_forward_fwd, blockwise_forward_bwd)

    # Likewise the keys' cotangent, which the Energy Transformer differentiates again (its
    # keys are functions of the state).
    @jax.custom_vjp
    def key_cotangent(q, k, beta, mask, lse, weights):
        return key_cotangent_pass(q, k, beta, mask, exclude_self, backward_block_size, lse, weights)

    def key_cotangent_fwd(q, k, beta, mask, lse, weights):
        out = key_cotangent_pass(q, k, beta, mask, exclude_self, backward_block_size, lse, weights)
        return out, (q, k, beta, mask, lse, weights)

    def key_cotangent_bwd(saved, g):
        q, k, beta, mask, lse, weights = saved
        dq, dk, dbeta, dlse, dw = key_cotangent_vjp(
            q, k, beta, mask, exclude_self, backward_block_size, lse, weights, g
        )
        return (
            dq.astype(q.dtype),
            dk.astype(k.dtype),
            dbeta.astype(beta.dtype),
            None,
            dlse.astype(lse.dtype),
            dw.astype(weights.dtype),
        )

    key_cotangent.defvjp(key_cotangent_fwd, key_cotangent_bwd)

    def forward(q, k, beta, mask):
        if method == "cudnn":
            return _cudnn_forward(q, k, beta, block_size)
        return blockwise_forward(q, k, beta, mask)

    @jax.custom_vjp
    def lse_fn(q, k, beta, mask):
        return forward(q, k, beta, mask)[0]

    def fwd(q, k, beta, mask):
        lse, out = forward(q, k, beta, mask)
        return lse, (q, k, beta, mask, lse, out)

    def bwd(residuals, cotangent):
        q, k, beta, mask, lse, out = residuals
        # d lse_i / d q_i = beta sum_j p_ij k_j = beta out_i: the attention output of the
        # forward pass, so the queries' cotangent costs no second pass. Written through `out`,
        # its own derivative (training through a descent step) is the forward pass's
        # blockwise custom_vjp above.
        dq = (beta * cotangent)[:, None] * out
        # d lse_i / d beta = sum_j p_ij q_i . k_j = q_i . out_i
        dbeta = jnp.sum(cotangent * jnp.einsum("sd,sd->s", q.astype(out.dtype), out))
        if method == "cudnn":
            dk = beta * _cudnn_key_cotangent(q, k, beta, cotangent)
        else:
            dk = beta * key_cotangent(q, k, beta, mask, lse, cotangent)
        return dq.astype(q.dtype), dk.astype(k.dtype), dbeta.astype(beta.dtype), None

    lse_fn.defvjp(fwd, bwd)
    return lse_fn


_FUSED: dict[tuple, object] = {}


def _fused(
    method: str,
    exclude_self: bool,
    block_sizes: tuple[int, int],
    keys: int,
    ring: RingAxis | None = None,
):
    """The log-sum-exp of `_make_fused` for `(forward, backward)` block sizes, none longer
    than the `keys` of one pass (less padding, same result)."""
    blocks = tuple(min(size, keys) for size in block_sizes)
    # Accelerators want the heads batched (more parallel work per kernel); a CPU core wants
    # one head's blocks in its cache at a time.
    key = (method, exclude_self, *blocks, ring, jax.default_backend() == "cpu")
    if key not in _FUSED:
        _FUSED[key] = _make_fused(*key)
    return _FUSED[key]


# ---------------------------------------------------------------------------- public API


def resolve_block_size(block_size: int | None) -> int | None:
    """A checked `block_size`, or `None`: the default for the number of queries, which
    `lse_rows` picks (`default_block_size`)."""
    return None if block_size is None else positive_int("block_size", block_size)


def default_block_size(seq: int) -> int:
    """Keys per block for `seq` queries: `DEFAULT_BLOCK_SIZE`, halved above `LONG_SEQUENCE`."""
    return DEFAULT_BLOCK_SIZE if seq <= LONG_SEQUENCE else DEFAULT_BLOCK_SIZE // 2


def block_sizes(seq: int, block_size: int | None) -> tuple[int, int]:
    """Keys per block of the forward pass and of the backward passes: `block_size` for both
    when given, else `default_block_size(seq)` and `1 / BACKWARD_BLOCK_DIVISOR` of it."""
    if block_size is not None:
        return block_size, block_size
    forward = default_block_size(seq)
    return forward, max(1, forward // BACKWARD_BLOCK_DIVISOR)


def lse_rows(
    q: Float[Array, "seq dim"],
    k: Float[Array, "mem dim"],
    beta: Float[Array, ""],
    mask: Bool[Array, "seq mem"] | None,
    exclude_self: bool,
    method: str,
    block_size: int | None,
    ring: tuple[Mesh | AbstractMesh, str | tuple[str, ...]] | None = None,
) -> Float[Array, " seq"]:
    """The log-sum-exp rows for an already resolved `method` (no checks; used under `vmap`
    over heads by the energies). `beta` must already be in the accumulation dtype;
    `block_size=None` picks the blocks by the number of queries (`block_sizes`).

    With `ring = (mesh, axis)`, or when the keys arrive split along their sequence over an
    `Explicit` mesh axis (`jax.typeof(k).sharding`), the rows are computed context-parallel
    by [`ring_lse`](#energyattn._energy._attention_lse.ring_lse), whatever `method` says."""
    if k.shape[0] == 0:
        # An empty memory: every row is an empty sum, whose log-sum-exp is defined as 0 (the
        # rule of a fully masked row), not log(0) = -inf.
        return jnp.zeros((q.shape[0],), beta.dtype)
    ring = explicit_sequence_axis(k) if ring is None else ring
    # The default is set by all the queries, on the ring too: the same blocks as one device.
    blocks = block_sizes(q.shape[0], block_size)
    if ring is not None:
        return ring_lse(q, k, beta, mask, exclude_self, blocks, *ring)
    if method == "naive":
        return _naive_lse(q, k, beta, mask, exclude_self)
    return _fused(method, exclude_self, blocks, k.shape[0])(q, k, beta, mask)


def ring_lse(
    q: Float[Array, "seq dim"],
    k: Float[Array, "mem dim"],
    beta: Float[Array, ""],
    mask: Bool[Array, "seq mem"] | None,
    exclude_self: bool,
    blocks: tuple[int, int],
    mesh: Mesh | AbstractMesh,
    axis: str | tuple[str, ...],
) -> Float[Array, " seq"]:
    """The log-sum-exp rows context-parallel: queries, keys and the mask's rows split along
    the sequence over the mesh axis `axis`, key chunks passed round the ring. The blockwise
    path's custom_vjps, each pass a `jax.shard_map` of its ring loop: the same value and
    derivatives (to every order the blockwise path has) as one device."""
    # Everything around the ring (the energy's other terms, the gradients' scalings) is
    # split along the sequence too.
    q, k = (
        split_rows(q, mesh, axis, "queries' sequence"),
        split_rows(k, mesh, axis, "keys' sequence"),
    )
    mask = None if mask is None else split_rows(mask, mesh, axis, "mask's query")
    size = axis_size(mesh, axis)
    ring = RingAxis(mesh, axis, size)
    return _fused("blockwise", exclude_self, blocks, k.shape[0] // size, ring)(q, k, beta, mask)


def attention_logsumexp(
    query: Float[ArrayLike, "seq dim"],
    keys: Float[ArrayLike, "mem dim"],
    *,
    beta: ScalarLike = 1.0,
    mask: Bool[ArrayLike, "seq mem"] | None = None,
    exclude_self: bool = False,
    implementation: Implementation = "auto",
    block_size: int | None = None,
) -> Float[Array, " seq"]:
    r"""Row-wise attention log-sum-exp, the building block of the softmax energies.

    $$\operatorname{lse}_i = \log \sum_{j:\,\mathrm{allowed}_{ij}} e^{\beta\, q_i\cdot k_j},
      \qquad \frac{\partial \operatorname{lse}_i}{\partial q_i}
      = \beta \sum_j \mathrm{softmax}_j(\beta\, q_i\cdot k_j)\, k_j$$

    All implementations give the same values and gradients (to rounding); they differ in time
    and memory. `"blockwise"` never holds a `(seq, mem)` matrix: its forward is a single online
    pass over blocks of keys that also accumulates the attention output, and its backward
    (a `jax.custom_vjp`) recomputes the probabilities block by block from the saved
    log-sum-exp, flash-attention style. Differentiating it again (training through an
    attention step) is blockwise too: the forward pass has a flash-style `custom_vjp` of its
    own.

    A row with nothing allowed has an empty sum, defined as 0 (no force); so has every row
    when there are no keys at all (`mem = 0`). Scores accumulate in at least float32.

    **Arguments:**

    - `query`: $q$, shape `(seq, dim)`.
    - `keys`: $k$, shape `(mem, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `mask`: optional boolean `(seq, mem)`, `True` where $q_i$ may attend to $k_j$.
    - `exclude_self`: also disallow $j = i$ (self-attention energies; needs `seq == mem`),
      without building a `(seq, seq)` mask.
    - `implementation`: `"auto"` (default), `"naive"`, `"blockwise"` or `"cudnn"`; see
      [`select_implementation`](#energyattn._energy._attention_lse.select_implementation).
      `"auto"` uses cuDNN's fused attention on NVIDIA GPUs (float16/bfloat16, no mask), the
      blockwise path above `BLOCKWISE_THRESHOLD` = $2^{17}$ score entries, naive below.
    - `block_size`: keys per block of every blockwise pass. By default the forward takes
      256 (128 beyond 4096 queries) and the passes of the derivatives, which recompute the
      probabilities, half that (`block_sizes`).

    **Returns:**

    The log-sum-exp of every query, shape `(seq,)`.

    ??? cite "Source"

        The energy is M. Bal's log-sum-exp (*An Energy-Based Perspective on Attention
        Mechanisms in Transformers*, 2020); the online log-sum-exp and recomputing backward
        follow T. Dao et al., *FlashAttention* (2022).
    """
    check_matching_dim("query", query, "seq dim", "keys", keys, "mem dim")
    seq, dim = jnp.shape(query)
    mem = jnp.shape(keys)[0]
    if exclude_self and seq != mem:
        raise ValueError(f"exclude_self needs as many queries as keys, got {seq} and {mem}")
    beta = check_positive("beta", beta)
    query, keys = jnp.asarray(query), jnp.asarray(keys)
    if mask is not None:
        mask = check_mask(mask, (seq, mem), "seq mem")
    method = select_implementation(
        implementation,
        entries=seq * mem,
        dtype=jnp.result_type(query, keys),
        head_dim=dim,
        structured_mask=mask is not None or exclude_self,
    )
    acc = jnp.promote_types(jnp.result_type(query, keys), jnp.float32)
    return lse_rows(
        query,
        keys,
        beta.astype(acc),
        mask,
        bool(exclude_self),
        method,
        resolve_block_size(block_size),
    )
