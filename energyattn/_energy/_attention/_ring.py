"""Context parallelism: the blockwise passes lifted onto a ring of devices.

Queries and keys are split along the sequence over a mesh axis of P devices. Each device
keeps its queries (and their rows of the mask) and the key chunks go round the ring
(`jax.lax.ppermute` to the next device), P visits in all; at every visit the device runs the
one-device chunk pass (`_blocks.py`) on the visiting chunk, with the chunk's global offsets.
One driver (`ring_pass`) does this for any chunk pass: per-query results accumulate on
their device, and per-key results (column terms) travel with their keys as running sums
and come home after the P-th hop. Per-device memory is O(seq / P): one piece of keys (and of
its running sums) in flight at a time, plus the blocks of the chunk pass.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ..._mask import SegmentIds
from ._blocks import (
    KEYS,
    array_roles,
    blocked_keys,
    forward_chunk,
    forward_finish,
    forward_init,
    terms_chunk,
    terms_init,
    value_widths,
)


class RingAxis(NamedTuple):
    """The mesh, and the axis of it (or several, flattened) that the sequence is split over,
    with its size."""

    mesh: Mesh | AbstractMesh
    name: str | tuple[str, ...]
    size: int


#: Keys per piece of the ring: a device's chunk goes round in pieces of at least this many
#: keys (one full turn per piece), so that what is in flight (a piece of keys, and of their
#: running sums, sent and received) stays small beside the device's own share of the
#: sequence. At seq 64k on 8 devices with head size 64 a piece is 0.25 MiB against 2 MiB per
#: chunk.
RING_PIECE = 512


def _num_pieces(length: int) -> int:
    """The most pieces of at least `RING_PIECE` keys (or one) that divide `length`."""
    most = max(1, length // RING_PIECE)
    return next(n for n in range(most, 0, -1) if length % n == 0)


def ring_pass(ring, step, carry, travel, total=None):
    """Run `step(carry, piece, first_key) -> (carry, contribution)` on every piece of keys of
    every device of the ring, `first_key` being the global index of the piece's first key.
    Each device's chunk `travel` (a pytree of per-key arrays) is cut into pieces, and each
    piece makes one turn of the ring. With `total` (per-key running sums that travel with
    the keys) the contributions are summed and come back to the keys' own device."""
    me = _device_index(ring)
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


def _device_index(ring):
    """This device's place on the ring, as an index of the default integer dtype (that of
    `jnp.arange`, the blocks' indices): `axis_index` is int32, and strict dtype promotion
    refuses int32 with x64's int64."""
    return jax.lax.axis_index(ring.name).astype(jnp.result_type(int))


def _chunk_view(ring, seq, mask, key_ids, first_key, length):
    """The visiting piece's mask (a dense mask's columns; segment ids with the piece's key
    ids, which travel with the keys) and its `(row0, col0)` offsets."""
    if isinstance(mask, SegmentIds):
        mask = SegmentIds(mask.query, key_ids)
    elif mask is not None:
        mask = jax.lax.dynamic_slice_in_dim(mask, first_key, length, axis=1)
    return mask, (_device_index(ring) * seq, first_key)


def _key_ids(mask):
    """What of the mask travels with the keys: the keys' segment ids (or nothing)."""
    return mask.keys if isinstance(mask, SegmentIds) else None


def _local_forward(ring, q, k, beta, mask, structure, block_size):
    def step(carry, travel, first_key):
        k_piece, ids = travel
        mask_c, offsets = _chunk_view(ring, q.shape[0], mask, ids, first_key, k_piece.shape[0])
        args = (q, k_piece, beta, mask_c, structure, block_size, carry, offsets)
        return forward_chunk(*args), None

    carry, _ = ring_pass(ring, step, forward_init(q, beta.dtype), (k, _key_ids(mask)))
    return forward_finish(carry)


def _local_terms(ring, q, k, beta, lse, mask, arrays, terms, structure, block_size):
    acc = beta.dtype
    _, per_key = array_roles(terms)
    keyed = {i: arrays[i] for i in blocked_keys(per_key) if i != KEYS}
    whole = {i: a for i, a in arrays.items() if i not in per_key}
    widths = value_widths(arrays, k.shape[1])

    def step(carry, travel, first_key):
        k_piece, keyed_piece, ids = travel
        mask_c, offsets = _chunk_view(ring, q.shape[0], mask, ids, first_key, k_piece.shape[0])
        pieces = {**whole, **keyed_piece}
        args = (q, k_piece, beta, lse, mask_c, pieces, terms, structure, block_size, carry)
        return terms_chunk(*args, offsets)

    total = tuple(jnp.zeros((k.shape[0], widths[t.value]), acc) for t in terms if not t.row)
    init = terms_init(q.shape[0], arrays, terms, acc, k.shape[1])
    # The keys (and the arrays per key) travel; per-query arrays stay.
    return ring_pass(ring, step, init, (k, keyed, _key_ids(mask)), total or None)


def _on_ring(ring, local, split, whole, out_specs):
    """`local(*split, *whole)` (a function of one device's shard) as a function of the global
    arrays: `jax.shard_map` over the ring's axis, with every array of `split` (a pytree of
    per-query or per-key arrays, or `None`) split along its leading axis and `whole`
    replicated."""
    spec = PartitionSpec(ring.name)
    specs = (jax.tree.map(lambda _: spec, split), jax.tree.map(lambda _: PartitionSpec(), whole))
    args = (split, whole)
    if any(t == jax.sharding.AxisType.Explicit for t in ring.mesh.axis_types):
        # Explicit sharding types must match the specs exactly (queries may arrive whole).
        args = jax.tree.map(
            lambda spec, a: jax.sharding.reshard(a, NamedSharding(ring.mesh, spec)),
            specs,
            args,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
    out_specs = jax.tree.map(lambda split: spec if split else PartitionSpec(), out_specs)
    names = ring.name if isinstance(ring.name, tuple) else (ring.name,)
    return jax.shard_map(
        lambda split, whole: local(split, whole),
        mesh=ring.mesh,
        in_specs=specs,
        out_specs=out_specs,
        # Only the ring's axis is manual: the mesh's other axes (a batch split over devices
        # around it) stay with the compiler.
        axis_names=set(names),
        check_vma=False,
    )(*args)


def ring_forward(ring, q, k, beta, mask, structure, block_size):
    """The online pass round the ring: `(lse, out)`, split like the queries."""

    def local(split, whole):
        q, k, mask = split
        return _local_forward(ring, q, k, whole, mask, structure, block_size)

    return _on_ring(ring, local, (q, k, mask), beta, (True, True))


def ring_terms(ring, q, k, beta, lse, mask, arrays, terms, structure, block_size):
    """The terms round the ring: row terms split like the queries, column terms like the
    keys (every array is split along its leading axis, per query or per key)."""

    def local(split, whole):
        q, k, lse, mask, arrays = split
        args = (ring, q, k, whole, lse, mask, arrays, terms, structure, block_size)
        rows, cols = _local_terms(*args)
        return rows, () if cols is None else cols

    out = (tuple(True for t in terms if t.row), tuple(True for t in terms if not t.row))
    return _on_ring(ring, local, (q, k, lse, mask, arrays), beta, out)
