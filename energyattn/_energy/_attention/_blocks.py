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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..._dtypes import accumulation_dtype
from ..._mask import SegmentIds

Factor = tuple[tuple[int, int], ...]
#: The indices by which terms refer to the keys themselves, to the queries scaled by beta and
#: to the keys scaled by beta (not arrays of the pass: the keys travel once in the ring, and
#: beta q and beta k are formed per chunk, or, for half-precision inputs in the kernels, the
#: products are scaled instead: no float32 copy is made).
KEYS = -1
SCALED_QUERIES = -2
SCALED_KEYS = -3
#: A row term's value that sums the weights alone, $\sum_j w_{ij}$, one column per query (the
#: values of a per-key array of ones, never formed): the log-sum-exp's tangent
#: $\sum_j p_{ij}\dot s_{ij}$ without an attention-sized output.
ONES = -4
#: The special indices that are no array of the pass.
SPECIAL = frozenset({KEYS, SCALED_QUERIES, SCALED_KEYS, ONES})


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
        rows, cols = _column(rows), _row(cols)
        if self.causal:
            return cols < rows if self.exclude_self else cols <= rows
        if self.exclude_self:
            return rows != cols
        return None


class Scaled(NamedTuple):
    r"""An operand times $\beta$ ($\beta k$ in every pass, $\beta q$ for half-precision queries
    in the kernels): the `block` as it is (a half-precision block is exact in every part
    format) and the product scaled by `scale` after it, so that no scaled copy of the block
    is formed (nor, in the kernels, its float32 parts) and the scale joins the elementwise
    work that follows the product."""

    block: Any
    scale: Any


class Term(NamedTuple):
    r"""One sum over the probabilities (see the module docstring).

    - `row`: `True` for $\sum_j w_{ij} X_j$ (one row per query, $X$ one row per key),
      `False` for $\sum_i w_{ij} X_i$ (one row per key, $X$ one row per query).
    - `factors`: the weights' factors; each a tuple of `(a, b)` pairs, the indices of a
      per-query array $A$ and a per-key array $B$ in the pass's `arrays` (`KEYS`: the keys,
      `SCALED_QUERIES`: $\beta q$, `SCALED_KEYS`: $\beta k$), summed.
    - `value`: the index of $X$ in `arrays` (or `KEYS`, `SCALED_QUERIES`, `SCALED_KEYS`;
      `ONES` for a row term $\sum_j w_{ij}$, one column).
    """

    row: bool
    factors: tuple[Factor, ...]
    value: int


def _column(x):
    """A per-row vector as a column `(n, 1)` (kernels keep their vectors two-dimensional)."""
    return x if x.ndim == 2 else x[:, None]


def _row(x):
    return x if x.ndim == 2 else x[None, :]


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


def blocked_keys(per_key):
    """The per-key indices whose blocks a pass reads from an array (not the keys scaled by
    beta, formed per block, nor `ONES`, never formed)."""
    return sorted(per_key - {SCALED_KEYS, ONES})


def value_widths(arrays, dim: int) -> dict[int, int]:
    """The width of each index's values: an array's columns, the head size `dim` (the
    queries' and the keys') for `KEYS`, `SCALED_QUERIES` and `SCALED_KEYS`, one for
    `ONES`."""
    widths = {i: a.shape[1] for i, a in arrays.items() if i not in SPECIAL}
    widths.update({KEYS: dim, SCALED_QUERIES: dim, SCALED_KEYS: dim, ONES: 1})
    return widths


def _key_blocks(k, keyed, acc, block_size):
    """The keys' blocks: those of the per-key arrays when the keys are one of them in the
    same dtype (one copy in the loop, not two)."""
    if KEYS in keyed and k.dtype == acc:
        return keyed[KEYS]
    return _blocks(k, block_size)


def _mask_blocks(mask, mem, block_size):
    """The mask's per-block pieces, as a scan takes them: a dense mask's columns as
    `(blocks, seq, block_size)`, segment ids' key ids as `(blocks, block_size)` (padding
    masked by index)."""
    if mask is None:
        return None
    num_blocks = -(-mem // block_size)
    if isinstance(mask, SegmentIds):
        return _blocks(mask.keys, block_size)
    mask = jnp.pad(mask, ((0, 0), (0, num_blocks * block_size - mem)))
    return mask.reshape(mask.shape[0], num_blocks, block_size).transpose(1, 0, 2)


def _block_mask(mask, piece):
    """One block's mask from its piece (`_mask_blocks`): the dense block, or the segment
    ids compared."""
    if mask is None:
        return None
    if isinstance(mask, SegmentIds):
        return mask.query[:, None] == piece[None, :]
    return piece


def block_allowed(rows, cols, structure, mask_block, *, offsets=(0, 0), mem=None, seq=None):
    """Which entries of one block take part (or `None`: all of them).

    `rows`, `cols`: the block's query and key indices within the chunk, flat (the block is
    `(queries, keys)`) or two-dimensional, a column and a row in either order (a block
    `(keys, queries)` takes the keys as a column and the queries as a row); `offsets`: the
    chunk's place in the whole problem (for the structural masks); `mem`, `seq`: the true
    numbers of keys and queries where the chunk is padded beyond them (`None`: not padded);
    `mask_block`: the block of an explicit mask, in the block's orientation (or `None`)."""
    queries = offsets[0] + (_column(rows) if rows.ndim == 1 else rows)
    keys = offsets[1] + (_row(cols) if cols.ndim == 1 else cols)
    conditions = []
    if mem is not None:  # padded keys must not count
        conditions.append(keys - offsets[1] < mem)
    if seq is not None:  # nor padded queries (in a column term's sum over them)
        conditions.append(queries - offsets[0] < seq)
    structured = structure.allowed(queries, keys)
    if structured is not None:
        conditions.append(structured)
    if mask_block is not None:
        conditions.append(mask_block)
    if not conditions:
        return None
    allowed = conditions[0]
    for condition in conditions[1:]:
        allowed = allowed & condition
    return jnp.broadcast_to(allowed, jnp.broadcast_shapes(queries.shape, keys.shape))


def block_probs(scores, shift, allowed):
    """`exp(scores - shift)` on the allowed entries of a block, 0 elsewhere. Double `where`: a
    NaN/inf in a disallowed score cannot reach `exp`."""
    if allowed is None:
        return jnp.exp(scores - _column(shift))
    return jnp.where(allowed, jnp.exp(jnp.where(allowed, scores, 0.0) - _column(shift)), 0.0)


def scaled_queries(q, beta):
    """`(q', scale)` with `scale * q' k^T = beta q k^T`: beta is folded into the queries once
    rather than into every block's scores; half-precision queries keep their dtype for the
    product and beta stays on the float32 scores."""
    if q.dtype == beta.dtype:
        return beta * q, 1.0
    return q, beta


def _matmul(a, b):
    """`a @ b`, accumulated in the dtype of the wider operand (at least float32); a `Scaled`
    `b` is scaled after the product."""
    if isinstance(b, Scaled):
        return b.scale * _matmul(a, b.block)
    acc = accumulation_dtype(a.dtype, b.dtype)
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc)


def weighted_sum(w, x, matmul=_matmul):
    r"""A block's row sums $\sum_j w_{ij} X_j$, `matmul(w, x)`, or $\sum_j w_{ij}$ where `x`
    is `None` (the values `ONES`)."""
    if x is None:
        return jnp.sum(w, axis=1, keepdims=True)
    return matmul(w, x)


def online_update(carry, scores, allowed, k_block, matmul=_matmul):
    r"""One block of the online pass: the running max, the rescaled sum of exponentials and
    the rescaled $\sum_j p_{ij} k_j$ after the block's `(rows, keys)` scores. `matmul(a, b)`
    is `a @ b` (the kernels' takes its precision from the operands)."""
    run_max, total, out = carry
    acc = scores.dtype
    keep = run_max.ndim == 2  # the vectors as columns (the kernels') or flat
    masked = scores if allowed is None else jnp.where(allowed, scores, -jnp.inf)
    new_max = jnp.maximum(run_max, jnp.max(masked, axis=1, keepdims=keep))
    # Rows with nothing allowed so far keep a max of -inf; shift them by 0 instead.
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = block_probs(scores, shift, allowed)
    rescale = jnp.exp(run_max - shift)
    total = total * rescale + jnp.sum(probs, axis=1, keepdims=keep)
    # Probabilities in the keys' dtype: half-precision keys take a half-precision product.
    product = matmul(probs.astype(k_block.dtype), k_block).astype(acc)
    return new_max, total, out * _column(rescale) + product


def term_weights(probs, terms, pair):
    r"""The weights $w_{ij} = p_{ij} \prod_f \sum_{(a, b) \in f} A_i\cdot B_j$ of a block, one
    per term, each product shared between terms formed once. `pair(a, b)`: the block's
    `(rows, keys)` matrix $A_i\cdot B_j$ of per-query array `a` and per-key array `b`."""
    factors, weights = {}, {(): probs}

    def factor(f):
        if f not in factors:
            total = pair(*f[0])
            for a, b in f[1:]:
                total = total + pair(a, b)
            factors[f] = total
        return factors[f]

    def weight(fs):
        if fs not in weights:
            weights[fs] = weight(fs[:-1]) * factor(fs[-1])
        return weights[fs]

    return [weight(term.factors) for term in terms]


# ------------------------------------------------------------------------- the online pass


def forward_init(q, acc):
    """The online pass's state before any key: running max, rescaled sum, rescaled output
    (the fused forward's row terms follow, from `terms_init`)."""
    seq, dim = q.shape
    return (jnp.full((seq,), -jnp.inf, acc), jnp.zeros((seq,), acc), jnp.zeros((seq, dim), acc))


def key_arrays(q, k, beta, arrays):
    r"""`arrays` with the keys (`KEYS`) and the queries scaled by beta (`SCALED_QUERIES`), as
    the terms take them ($\beta k$, `SCALED_KEYS`, is taken block by block: `_scaled_keys`)."""
    acc = beta.dtype
    sq, _ = scaled_queries(q, beta)
    scaled = sq if q.dtype == acc else beta * q.astype(acc)
    return {**arrays, KEYS: k, SCALED_QUERIES: scaled}


def _scaled_keys(keyed_b, k_b, beta, per_key):
    r"""A block's per-key arrays with $\beta k$ (`SCALED_KEYS`, `Scaled`) where a term uses
    it."""
    if SCALED_KEYS not in per_key:
        return keyed_b
    return {**keyed_b, SCALED_KEYS: Scaled(k_b.astype(beta.dtype), beta)}


def _pair(a, b, acc):
    r"""A block's `(rows, keys)` matrix $A_i \cdot B_j$ of a per-query array `a` and a
    per-key array `b` (a `Scaled` one scaled after the product)."""
    if isinstance(b, Scaled):
        return b.scale * _pair(a, b.block, acc)
    return jnp.einsum("sf,bf->sb", a, b, preferred_element_type=acc)


def online_terms(sums, rescale, probs, terms, pair, values, matmul=_matmul):
    r"""The fused forward's row terms after one block: each running sum rescaled like the
    output, plus the block's $\sum_j w_{ij} X_j$ with the block's unnormalised
    probabilities (the weights are linear in them; `forward_finish` divides by the sum).
    `values`: per term, the block's rows of its per-key array."""
    weights = term_weights(probs, terms, pair)
    return tuple(
        s * _column(rescale) + weighted_sum(w, x, matmul).astype(s.dtype)
        for s, w, x in zip(sums, weights, values, strict=True)
    )


def forward_chunk(
    q, k, beta, mask, structure, block_size, carry, offsets=(0, 0), arrays=None, terms=()
):
    r"""The online pass over one chunk of keys: updates the running max, the rescaled sum of
    exponentials and the rescaled $\sum_j p_{ij} k_j$, and with `terms` (row terms only,
    over `arrays` as in `terms_chunk`) their rescaled sums in the same pass: the fused
    forward of a JVP, one set of exponentials for the primal and the tangent."""
    seq, mem = q.shape[0], k.shape[0]
    acc = beta.dtype
    sq, scale = scaled_queries(q, beta)
    starts = jnp.arange(-(-mem // block_size)) * block_size
    padded = mem if mem % block_size else None
    per_query, per_key = array_roles(terms)
    arrays = key_arrays(q, k, beta, arrays or {})
    rows = {i: arrays[i].astype(acc) for i in per_query}
    keyed = {i: _blocks(arrays[i].astype(acc), block_size) for i in blocked_keys(per_key)}

    def body(carry, xs):
        k_b, keyed_b, mask_b, start = xs
        keyed_b = _scaled_keys(keyed_b, k_b, beta, per_key)
        scores = scale * jnp.einsum("sd,bd->sb", sq, k_b, preferred_element_type=acc)
        indices = jnp.arange(seq), start + jnp.arange(block_size)
        allowed = block_allowed(
            *indices, structure, _block_mask(mask, mask_b), offsets=offsets, mem=padded
        )
        run_max, total, out, *sums = carry
        new_max, total, out = online_update((run_max, total, out), scores, allowed, k_b)
        if not terms:
            return (new_max, total, out), None
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = block_probs(scores, shift, allowed)

        def pair(a, b):
            return _pair(rows[a], keyed_b[b], acc)

        rescale = jnp.exp(run_max - shift)
        values = [keyed_b.get(t.value) for t in terms]  # (None: ONES)
        sums = online_terms(sums, rescale, probs, terms, pair, values)
        return (new_max, total, out, *sums), None

    xs = (
        _key_blocks(k, keyed, acc, block_size),
        keyed,
        _mask_blocks(mask, mem, block_size),
        starts,
    )
    carry, _ = jax.lax.scan(body, carry, xs)
    return carry


def forward_finish(carry):
    """The log-sum-exp and the attention output (and the fused row terms) from the online
    pass's final state."""
    run_max, total, out, *sums = carry
    # Every allowed row has total >= 1 (its max entry contributes exp(0)); empty rows have 0.
    nonempty = total > 0
    safe_total = jnp.where(nonempty, total, 1.0)
    lse = jnp.where(nonempty, jnp.log(safe_total) + jnp.where(nonempty, run_max, 0.0), 0.0)
    return (lse, *(x / _column(safe_total) for x in (out, *sums)))


# ----------------------------------------------------------------------------- the terms


def terms_init(seq, arrays, terms, acc, dim):
    """The row terms' sums before any key (`dim`: the keys' and queries' width)."""
    widths = value_widths(arrays, dim)
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
    sq, scale = scaled_queries(q, beta)
    arrays = key_arrays(q, k, beta, arrays)
    # Per-query arrays in the accumulation dtype (transposed for the column terms' values).
    rows = {i: arrays[i].astype(acc) for i in per_query}
    cols_t = {t.value: rows[t.value].T for t in terms if not t.row}
    keyed = {i: _blocks(arrays[i].astype(acc), block_size) for i in blocked_keys(per_key)}
    starts = jnp.arange(-(-mem // block_size)) * block_size
    padded = mem if mem % block_size else None

    def body(carry, xs):
        k_b, keyed_b, mask_b, start = xs
        keyed_b = _scaled_keys(keyed_b, k_b, beta, per_key)
        scores = scale * jnp.einsum("sd,bd->sb", sq, k_b, preferred_element_type=acc)
        indices = jnp.arange(seq), start + jnp.arange(block_size)
        allowed = block_allowed(
            *indices, structure, _block_mask(mask, mask_b), offsets=offsets, mem=padded
        )
        probs = block_probs(scores, lse, allowed)

        def pair(a, b):
            return _pair(rows[a], keyed_b[b], acc)

        sums, col_out = list(carry), []
        r = 0
        for term, w in zip(terms, term_weights(probs, terms, pair), strict=True):
            if term.row:
                sums[r] = sums[r] + weighted_sum(w, keyed_b.get(term.value))
                r += 1
            else:
                col_out.append(jnp.einsum("ds,sb->db", cols_t[term.value], w))
        return tuple(sums), tuple(col_out)

    xs = (
        _key_blocks(k, keyed, acc, block_size),
        keyed,
        _mask_blocks(mask, mem, block_size),
        starts,
    )
    carry, col_t = jax.lax.scan(body, carry, xs)
    # (blocks, dim, block_size) -> (mem, dim)
    cols = tuple(c.transpose(0, 2, 1).reshape(-1, c.shape[1])[:mem] for c in col_t)
    return carry, cols
