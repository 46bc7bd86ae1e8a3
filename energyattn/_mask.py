"""Masks of the attention log-sum-exp that are not a `(seq, mem)` matrix."""

from typing import Any, NamedTuple

import jax.numpy as jnp


class SegmentIds(NamedTuple):
    r"""A mask given by segment ids, in $O(\mathrm{seq})$ memory: query $i$ may attend to
    key $j$ where `query[i] == keys[j]` (packed sequences, padding), never held as a
    `(seq, mem)` matrix by the blockwise passes or the kernels.

    - `query`: integer ids, shape `(seq,)`;
    - `keys`: integer ids, shape `(mem,)`.

    Pass it wherever a `mask` is taken. `SegmentIds.padding` builds the padding of a
    padded batch from lengths.
    """

    query: Any
    keys: Any

    @classmethod
    def padding(cls, seq: int, mem: int, key_length, query_length=None) -> "SegmentIds":
        """Padding from lengths: keys from `key_length` on are attended by no query (id -1);
        queries from `query_length` on (if given) attend to nothing, so that their rows are
        empty (id -2). The lengths may be traced (one per example under `jax.vmap`)."""
        keys = jnp.where(jnp.arange(mem) < key_length, 0, -1).astype(jnp.int32)
        query = jnp.zeros((seq,), jnp.int32)
        if query_length is not None:
            query = jnp.where(jnp.arange(seq) < query_length, 0, -2).astype(jnp.int32)
        return cls(query, keys)

    def dense(self):
        """The mask as a boolean `(seq, mem)` matrix (what the naive path holds)."""
        return self.query[:, None] == self.keys[None, :]

    def attended(self):
        """Which keys some query attends to, `(mem,)` booleans, in $O((\\mathrm{seq} +
        \\mathrm{mem})\\log\\mathrm{seq})$ (a sort and a search, no `(seq, mem)` matrix)."""
        ids = jnp.sort(self.query)
        where = jnp.clip(jnp.searchsorted(ids, self.keys), 0, ids.shape[0] - 1)
        return ids[where] == self.keys
