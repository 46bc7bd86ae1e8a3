r"""The blockwise passes over one chunk of keys: everything the blockwise, ring and cuDNN paths
compute is one of these two passes.

Both recompute the probabilities $p_{ij} = e^{\beta q_i\cdot k_j - \operatorname{lse}_i}$
(allowed entries only) block by block, so no `(seq, mem)` matrix is ever held, only
`(seq, block_size)` blocks:

- `forward_chunk`, the online pass (running max, rescaled sums) that gives the log-sum-exp
  and the attention output $o_i = \sum_j p_{ij} k_j$ (flash attention's forward);
- `terms_chunk`, which evaluates *terms*: sums over the probabilities weighted by products of
  bilinear factors,

  $$\text{row: } \sum_j w_{ij} X_j, \qquad \text{column: } \sum_i w_{ij} X_i, \qquad
    w_{ij} = p_{ij} \prod_f \Big(\sum_{(A, B) \in f} A_i\cdot B_j\Big).$$

  Every derivative of the log-sum-exp, of any order and in either mode, is a sum of such
  terms (`_derivatives.py`), and so is the transpose of each: this one pass is all the
  derivatives need.

A chunk is all the keys on one device, or, in the ring (context-parallel) path, the keys of
one device visiting another. It knows where it sits in the whole problem through
`offsets = (row0, col0)`, the global index of its first query and first key (0, 0 on one
device), which is all that the structural masks (`Structure`: the excluded diagonal, the
causal triangle) need; its mask is the `(seq, chunk)` slice of the rows' mask. Row terms
accumulate over the chunks (`carry`); column terms are returned per chunk.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

Factor = tuple[tuple[int, int], ...]
#: The indices by which terms refer to the keys themselves and to the queries scaled by beta
#: (not arrays of the pass: the keys travel once in the ring, and beta q is formed per chunk).
KEYS = -1
SCALED_QUERIES = -2


class Structure(NamedTuple):
    r"""The masks given by the positions alone, never held as a `(seq, mem)` matrix: each
    block computes its part from the global indices $i$ of its queries and $j$ of its keys.

    - `exclude_self`: disallow $j = i$;
    - `causal`: disallow $j > i$ (with `exclude_self`: allow only $j < i$).
    """

    exclude_self: bool = False
    causal: bool = False

    def allowed(self, rows, cols):
        """Which pairs of the global query indices `rows` and key indices `cols` the structure
        allows, `(len(rows), len(cols))` (or `None`: all of them)."""
        rows, cols = rows[:, None], cols[None, :]
        if self.causal:
            return cols < rows if self.exclude_self else cols <= rows
        if self.exclude_self:
            return rows != cols
        return None


class Term(NamedTuple):
    r"""One sum over the probabilities (see the module docstring).

    - `row`: `True` for $\sum_j w_{ij} X_j$ (one row per query, $X$ one row per key),
      `False` for $\sum_i w_{ij} X_i$ (one row per key, $X$ one row per query).
    - `factors`: the weights' factors; each a tuple of `(a, b)` pairs, the indices of a
      per-query array $A$ and a per-key array $B$ in the pass's `arrays` (`KEYS`: the keys,
      `SCALED_QUERIES`: $\beta q$), summed.
    - `value`: the index of $X$ in `arrays` (or `KEYS`, `SCALED_QUERIES`).
    """

    row: bool
    factors: tuple[Factor, ...]
    value: int


def array_roles(terms: tuple[Term, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """The indices of the arrays the terms use per query and per key."""
    per_query, per_key = set(), set()
    for term in terms:
        for factor in term.factors:
            for a, b in factor:
                per_query.add(a)
                per_key.add(b)
        (per_key if term.row else per_query).add(term.value)
    return frozenset(per_query), frozenset(per_key)


def _blocks(x, block_size):
    """Per-key rows as `(blocks, block_size, ...)`, zero padded."""
    mem = x.shape[0]
    num_blocks = -(-mem // block_size)
    pad = [(0, num_blocks * block_size - mem)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape(num_blocks, block_size, *x.shape[1:])


def _mask_blocks(mask, mem, block_size):
    """The mask's columns as `(blocks, seq, block_size)` (padding masked)."""
    if mask is None:
        return None
    num_blocks = -(-mem // block_size)
    mask = jnp.pad(mask, ((0, 0), (0, num_blocks * block_size - mem)))
    return mask.reshape(mask.shape[0], num_blocks, block_size).transpose(1, 0, 2)


def _block_allowed(seq, start, block_size, mem, mask_block, structure, offsets):
    """Which entries of one `(seq, block_size)` block take part (or `None`: all of them)."""
    cols = start + jnp.arange(block_size)
    allowed = None
    if mem % block_size:  # the last block is padded with keys that must not count
        allowed = jnp.broadcast_to(cols[None, :] < mem, (seq, block_size))
    row0, col0 = offsets
    structured = structure.allowed(row0 + jnp.arange(seq), col0 + cols)
    if structured is not None:
        allowed = structured if allowed is None else allowed & structured
    if mask_block is not None:
        allowed = mask_block if allowed is None else allowed & mask_block
    return allowed


def _block_probs(scores, shift, allowed):
    """`exp(scores - shift)` on the allowed entries of a block, 0 elsewhere. Double `where`: a
    NaN/inf in a disallowed score cannot reach `exp`."""
    if allowed is None:
        return jnp.exp(scores - shift[:, None])
    return jnp.where(allowed, jnp.exp(jnp.where(allowed, scores, 0.0) - shift[:, None]), 0.0)


def _scaled_queries(q, beta):
    """`(q', scale)` with `scale * q' k^T = beta q k^T`: beta is folded into the queries once
    rather than into every block's scores; half-precision queries keep their dtype for the
    product and beta stays on the float32 scores."""
    if q.dtype == beta.dtype:
        return beta * q, 1.0
    return q, beta


# ------------------------------------------------------------------------- the online pass


def forward_init(q, acc):
    """The online pass's state before any key: running max, rescaled sum, rescaled output."""
    seq, dim = q.shape
    return (jnp.full((seq,), -jnp.inf, acc), jnp.zeros((seq,), acc), jnp.zeros((seq, dim), acc))


def forward_chunk(q, k, beta, mask, structure, block_size, carry, offsets=(0, 0)):
    r"""The online pass over one chunk of keys: updates the running max, the rescaled sum of
    exponentials and the rescaled $\sum_j p_{ij} k_j$."""
    seq, mem = q.shape[0], k.shape[0]
    acc = beta.dtype
    q, scale = _scaled_queries(q, beta)
    starts = jnp.arange(-(-mem // block_size)) * block_size

    def body(carry, xs):
        run_max, total, out = carry
        k_b, mask_b, start = xs
        scores = scale * jnp.einsum("sd,bd->sb", q, k_b, preferred_element_type=acc)
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, structure, offsets)
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

    xs = (_blocks(k, block_size), _mask_blocks(mask, mem, block_size), starts)
    carry, _ = jax.lax.scan(body, carry, xs)
    return carry


def forward_finish(carry):
    """The log-sum-exp and the attention output from the online pass's final state."""
    run_max, total, out = carry
    # Every allowed row has total >= 1 (its max entry contributes exp(0)); empty rows have 0.
    nonempty = total > 0
    safe_total = jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, jnp.log(safe_total) + jnp.where(nonempty, run_max, 0.0), 0.0)
    return lse, out / safe_total[:, None]


# ----------------------------------------------------------------------------- the terms


def terms_init(seq, arrays, terms, acc, dim):
    """The row terms' sums before any key (`dim`: the keys' and queries' width)."""
    widths = {**{i: a.shape[1] for i, a in arrays.items()}, KEYS: dim, SCALED_QUERIES: dim}
    return tuple(jnp.zeros((seq, widths[t.value]), acc) for t in terms if t.row)


def terms_chunk(q, k, beta, lse, mask, arrays, terms, structure, block_size, carry, offsets=(0, 0)):
    r"""The terms over one chunk of keys (see the module docstring), block by block.

    `arrays` maps an index to its array: a per-query array is whole, a per-key array holds the
    chunk's rows (`array_roles`); `KEYS` is the chunk's keys. Returns the row terms' running
    sums (`carry`, in the order of the row terms) and the column terms' rows for this chunk's
    keys.

    A column term is a sum over the queries, per block $X^\top w_b$; it is taken as
    `(dim, seq) x (seq, block)`, against the transposed per-query array, and accumulated
    transposed: XLA's CPU matrix product is far slower with the contracted axis leading
    both operands (`benchmarks/README.md`).
    """
    seq, mem = q.shape[0], k.shape[0]
    acc = beta.dtype
    per_query, per_key = array_roles(terms)
    sq, scale = _scaled_queries(q, beta)
    scaled = sq if q.dtype == acc else beta * q.astype(acc)
    arrays = {**arrays, KEYS: k, SCALED_QUERIES: scaled}
    # Per-query arrays in the accumulation dtype (transposed for the column terms' values).
    rows = {i: arrays[i].astype(acc) for i in per_query}
    cols_t = {t.value: rows[t.value].T for t in terms if not t.row}
    keyed = {i: _blocks(arrays[i].astype(acc), block_size) for i in sorted(per_key)}
    starts = jnp.arange(-(-mem // block_size)) * block_size

    def body(carry, xs):
        k_b, keyed_b, mask_b, start = xs
        scores = scale * jnp.einsum("sd,bd->sb", sq, k_b, preferred_element_type=acc)
        allowed = _block_allowed(seq, start, block_size, mem, mask_b, structure, offsets)
        probs = _block_probs(scores, lse, allowed)
        # Products shared between terms are formed once per block.
        factors, weights = {}, {(): probs}

        def factor(f):
            if f not in factors:
                total = 0.0
                for a, b in f:
                    total = total + jnp.einsum(
                        "sf,bf->sb", rows[a], keyed_b[b], preferred_element_type=acc
                    )
                factors[f] = total
            return factors[f]

        def weight(fs):
            if fs not in weights:
                weights[fs] = weight(fs[:-1]) * factor(fs[-1])
            return weights[fs]

        sums, col_out = list(carry), []
        r = 0
        for term in terms:
            w = weight(term.factors)
            if term.row:
                sums[r] = sums[r] + jnp.einsum("sb,bd->sd", w, keyed_b[term.value])
                r += 1
            else:
                col_out.append(jnp.einsum("ds,sb->db", cols_t[term.value], w))
        return tuple(sums), tuple(col_out)

    xs = (_blocks(k, block_size), keyed, _mask_blocks(mask, mem, block_size), starts)
    carry, col_t = jax.lax.scan(body, carry, xs)
    # (blocks, dim, block_size) -> (mem, dim)
    cols = tuple(c.transpose(0, 2, 1).reshape(-1, c.shape[1])[:mem] for c in col_t)
    return carry, cols
