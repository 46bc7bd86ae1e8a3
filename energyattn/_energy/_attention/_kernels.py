r"""Pallas kernels for the two passes (`forward_p`, `terms_p`) on GPUs, one program per
block of rows, the keys (or the queries) visited block by block inside it.

- `forward`: the online pass (flash attention's forward), a grid over query blocks with a
  loop over key blocks, giving the log-sum-exp rows and the output $\sum_j p_{ij} k_j$.
- `terms`: the weighted sums of `_blocks.terms_chunk`. Row terms $\sum_j w_{ij} X_j$ are a
  grid over query blocks with a loop over key blocks; column terms $\sum_i w_{ij} X_i$ a
  grid over key blocks with a loop over query blocks (the shape of flash attention's
  $dK/dV$ kernel). Each kernel is specialised by the static structure of its terms.

The block arithmetic (the allowed entries, the online update, the probabilities, the
terms' weights) is `_blocks`'s, shared with the XLA loop: only the loops and the loads are
written here, once for both lowerings: Pallas's Triton lowering (`platform="gpu"`, NVIDIA
and AMD) and its Mosaic TPU lowering (`"tpu"`: every block's last two dimensions padded
to multiples of (8, 128), the keys and a row strip of the mask held in VMEM). On a CPU
either runs in Pallas's interpret mode, which is how the test suite checks them. Vectors
per row (the log-sum-exp, the running max and sum) are kept as `(rows, 1)` columns, the
layout both compilers take.

Masks: the causal triangle skips the key blocks above the diagonal (and, for column
terms, the query blocks above it); an explicit mask is loaded block by block as `int8`;
lengths that are not block multiples are padded, the padded keys (and queries) masked by
their index; rows with nothing to attend to get the package's convention (log-sum-exp 0,
output 0). The head size and every array's width are padded to a power of two, at least
16 (Triton's matrix products need it); inputs of any float dtype accumulate in the dtype
of `beta` (float32 for half precision).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as plgpu

from ._blocks import (
    Structure,
    array_roles,
    block_allowed,
    block_probs,
    forward_finish,
    key_arrays,
    online_terms,
    online_update,
    scaled_queries,
    term_weights,
)
from ._policy import BlockSizes

#: The smallest block (and array width) per platform: Triton's products want 16; a TPU's
#: vector registers are 8 x 128 (rows x lanes).
_MINIMUM = {"gpu": (16, 16), "tpu": (8, 128)}


def _pow2(n: int, least: int = 16) -> int:
    return max(least, pl.next_power_of_2(n))


def _pad(x, rows, cols=None):
    pad = [(0, rows - x.shape[0])]
    if x.ndim == 2:
        pad.append((0, (x.shape[1] if cols is None else cols) - x.shape[1]))
    return jnp.pad(x, pad)


def _precision(dtype):
    # Exact float32 products (not TF32): the derivatives' terms are differences of sums.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _dot(a, b, acc, precision):
    return jax.lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=acc
    )


def _dot_t(a, b, acc, precision):
    """`a @ b.T`."""
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=acc
    )


def _dot_tn(a, b, acc, precision):
    """`a.T @ b`."""
    return jax.lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc
    )


class _Tiles:
    """The padded sizes of one pass on `platform`: `bq` queries and `bk` keys per block,
    `seq_p` and `mem_p` the lengths padded to them, `width(n)` an array's padded width."""

    def __init__(self, seq, mem, block_q, block_k, platform):
        self.platform = platform
        self.seq, self.mem = seq, mem
        low_rows, low_lanes = _MINIMUM[platform]
        self.lanes = low_lanes
        # Sizes rounded up to powers of two (at least 16), no longer than the sequence
        # rounded up; a TPU's scores block has the keys along its lanes.
        self.bq = min(_pow2(block_q), _pow2(seq, max(16, low_rows)))
        self.bk = max(min(_pow2(block_k), _pow2(mem)), low_lanes)
        self.seq_p = pl.cdiv(seq, self.bq) * self.bq
        self.mem_p = pl.cdiv(mem, self.bk) * self.bk
        # The true lengths where padded (`_blocks.block_allowed` masks beyond them).
        self.padded_seq = seq if self.seq_p != seq else None
        self.padded_mem = mem if self.mem_p != mem else None

    def width(self, n):
        return _pow2(n, self.lanes)

    def rows(self, start, size):
        """The indices `start + (0..size)` as a column."""
        return start + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)

    def cols(self, start, size):
        return start + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)


def _call(
    kernel, grid, inputs, in_specs, out_shape, out_specs, blocks, tiles, head, interpret, name
):
    if tiles.platform == "gpu":
        warps = blocks.num_warps if blocks.num_warps is not None else (4 if head <= 64 else 8)
        stages = 2 if blocks.num_stages is None else blocks.num_stages
        params = plgpu.CompilerParams(num_warps=warps, num_stages=stages)
    else:
        params = pltpu.CompilerParams()
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(*inputs)


def _term_operands(arrays, terms, tiles, widths, acc, queries, keys):
    """The terms' per-query and per-key arrays (sorted by index), padded, and their block
    specs: `queries` and `keys` are `(rows per block, index map)`."""
    inputs, specs = [], []
    roles = zip(array_roles(terms), (tiles.seq_p, tiles.mem_p), (queries, keys), strict=True)
    for indices, length, (rows, where) in roles:
        for i in sorted(indices):
            inputs.append(_pad(arrays[i].astype(acc), length, widths[i]))
            specs.append(pl.BlockSpec((rows, widths[i]), where))
    return inputs, specs


def _term_refs(refs, terms, has_mask):
    """`(mask_ref, query_refs, key_refs, rest)` from a kernel's refs after its fixed ones,
    in `_term_operands`'s order (the mask first, if any)."""
    per_query, per_key = array_roles(terms)
    refs = list(refs)
    mask_ref = refs.pop(0) if has_mask else None
    query_refs = {i: refs.pop(0) for i in sorted(per_query)}
    key_refs = {i: refs.pop(0) for i in sorted(per_key)}
    return mask_ref, query_refs, key_refs, refs


def _causal_key_blocks(structure, row0, bq, bk, num):
    """The key blocks a query block starting at `row0` needs: all, or under the causal
    triangle those up to its last query."""
    if not structure.causal:
        return num
    # lax.div: non-negative operands, and no sign correction (which Mosaic lowers per chip).
    end = row0 + bq + bk - 1
    return jnp.minimum(num, jax.lax.div(end, jnp.asarray(bk, end.dtype)))


def _at(start, size):
    return pl.ds(pl.multiple_of(start, size), size)


# ------------------------------------------------------------------------- the forward pass


def _forward_kernel(q_ref, k_ref, beta_ref, *refs, tiles, structure, has_mask, terms, precision):
    """The online pass of one query block; with `terms` (row terms) their sums too, in the
    same pass (the fused forward of a JVP). `refs`: the mask (if any), the terms' per-query
    and per-key arrays (by index, sorted), the log-sum-exp, the output, the terms' sums."""
    mask_ref, query_refs, key_refs, refs = _term_refs(refs, terms, has_mask)
    lse_ref, out_ref, *sum_refs = refs
    bq, bk = tiles.bq, tiles.bk
    acc = beta_ref.dtype
    row0 = pl.program_id(0) * bq
    rows = tiles.rows(row0, bq)
    q, scale = scaled_queries(q_ref[...], beta_ref[...])
    queried = {i: r[...] for i, r in query_refs.items()}

    def body(block, carry):
        start = block * bk
        k_b = k_ref[_at(start, bk), :]
        scores = scale * _dot_t(q, k_b, acc, precision)
        mask_b = None if mask_ref is None else mask_ref[:, _at(start, bk)] != 0
        cols = tiles.cols(start, bk)
        allowed = block_allowed(rows, cols, structure, mask_b, mem=tiles.padded_mem)
        run_max, total, out, *sums = carry
        new = online_update((run_max, total, out), scores, allowed, k_b, precision)
        if not terms:
            return new
        shift = jnp.where(jnp.isfinite(new[0]), new[0], 0.0)
        probs = block_probs(scores, shift, allowed)
        keyed = {i: r[_at(start, bk), :] for i, r in key_refs.items()}
        sums = online_terms(
            sums,
            jnp.exp(run_max - shift),
            probs,
            terms,
            lambda a, b: _dot_t(queried[a], keyed[b], acc, precision),
            lambda t: keyed[t.value],
            precision,
        )
        return (*new, *sums)

    init = (
        jnp.full((bq, 1), -jnp.inf, acc),
        jnp.zeros((bq, 1), acc),
        jnp.zeros((bq, q_ref.shape[1]), acc),
        *(jnp.zeros(r.shape, acc) for r in sum_refs),
    )
    num = _causal_key_blocks(structure, row0, bq, bk, tiles.mem_p // bk)
    lse, *outs = forward_finish(jax.lax.fori_loop(0, num, body, init))
    lse_ref[...] = lse
    for ref, value in zip((out_ref, *sum_refs), outs, strict=True):
        ref[...] = value.astype(ref.dtype)


def forward(
    q,
    k,
    beta,
    mask,
    structure: Structure,
    blocks: BlockSizes,
    *,
    arrays=None,
    terms=(),
    platform="gpu",
    interpret=False,
):
    """The log-sum-exp rows and the output $\\sum_j p_{ij} k_j$ of one head, as
    `_blocks.forward_chunk` + `forward_finish` give them; with `terms` (row terms over
    `arrays`, as `terms` takes them) their sums too, from the same pass."""
    (seq, dim), mem = q.shape, k.shape[0]
    acc = beta.dtype
    tiles = _Tiles(seq, mem, blocks.block_q, blocks.block_k, platform)
    bq, dp = tiles.bq, tiles.width(dim)
    mine, whole = (lambda i: (i, 0)), (lambda i: (0, 0))
    inputs = [_pad(q, tiles.seq_p, dp), _pad(k, tiles.mem_p, dp), beta.reshape(1, 1)]
    in_specs = [
        pl.BlockSpec((bq, dp), mine),
        pl.BlockSpec((tiles.mem_p, dp), whole),
        pl.BlockSpec((1, 1), whole),
    ]
    if mask is not None:
        inputs.append(_pad(mask.astype(jnp.int8), tiles.seq_p, tiles.mem_p))
        in_specs.append(pl.BlockSpec((bq, tiles.mem_p), mine))
    arrays = key_arrays(q, k.astype(acc), beta, arrays or {})
    widths = {i: tiles.width(a.shape[1]) for i, a in arrays.items()}
    more, specs = _term_operands(
        arrays, terms, tiles, widths, acc, (bq, mine), (tiles.mem_p, whole)
    )
    inputs, in_specs = inputs + more, in_specs + specs
    kernel = functools.partial(
        _forward_kernel,
        tiles=tiles,
        structure=structure,
        has_mask=mask is not None,
        terms=tuple(terms),
        precision=_precision(q.dtype),
    )
    sums = [(tiles.seq_p, widths[t.value]) for t in terms]
    lse, out, *rows = _call(
        kernel,
        (tiles.seq_p // bq,),
        inputs,
        in_specs,
        [
            jax.ShapeDtypeStruct((tiles.seq_p, 1), acc),
            jax.ShapeDtypeStruct((tiles.seq_p, dp), acc),
            *(jax.ShapeDtypeStruct(shape, acc) for shape in sums),
        ],
        [
            pl.BlockSpec((bq, 1), mine),
            pl.BlockSpec((bq, dp), mine),
            *(pl.BlockSpec((bq, w), mine) for _, w in sums),
        ],
        blocks,
        tiles,
        dim,
        interpret,
        "energy_attention_forward",
    )
    rows = [r[:seq, : arrays[t.value].shape[1]] for r, t in zip(rows, terms, strict=True)]
    return (lse[:seq, 0], out[:seq, :dim], *rows)


# ------------------------------------------------------------------------------- the terms


def _terms_kernel(
    q_ref, k_ref, beta_ref, lse_ref, *refs, tiles, structure, has_mask, terms, row, precision
):
    """Row terms (`row`: a program per query block, a loop over key blocks) or column terms
    (a program per key block, a loop over query blocks). `refs`: the mask (if any), the
    per-query arrays, the per-key arrays (by index, in sorted order), then one output per
    term."""
    mask_ref, query_refs, key_refs, outs = _term_refs(refs, terms, has_mask)
    bq, bk = tiles.bq, tiles.bk
    acc = beta_ref.dtype
    beta = beta_ref[...]
    here = pl.program_id(0)

    def weights(row0, col0, q, k, queried, keyed, lse, mask_b):
        sq, scale = scaled_queries(q, beta)
        scores = scale * _dot_t(sq, k, acc, precision)
        rows, cols = tiles.rows(row0, bq), tiles.cols(col0, bk)
        allowed = block_allowed(
            rows, cols, structure, mask_b, mem=tiles.padded_mem, seq=tiles.padded_seq
        )
        probs = block_probs(scores, lse, allowed)
        return term_weights(probs, terms, lambda a, b: _dot_t(queried[a], keyed[b], acc, precision))

    init = tuple(jnp.zeros(o.shape, acc) for o in outs)
    if row:
        row0 = here * bq
        q, lse = q_ref[...], lse_ref[...]
        queried = {i: r[...] for i, r in query_refs.items()}

        def body(b, sums):
            start = b * bk
            keyed = {i: r[_at(start, bk), :] for i, r in key_refs.items()}
            mask_b = None if mask_ref is None else mask_ref[:, _at(start, bk)] != 0
            k = k_ref[_at(start, bk), :]
            ws = weights(row0, start, q, k, queried, keyed, lse, mask_b)
            return tuple(
                s + _dot(w, keyed[t.value], acc, precision)
                for s, w, t in zip(sums, ws, terms, strict=True)
            )

        num = _causal_key_blocks(structure, row0, bq, bk, tiles.mem_p // bk)
        sums = jax.lax.fori_loop(0, num, body, init)
    else:
        col0 = here * bk
        k = k_ref[...]
        keyed = {i: r[...] for i, r in key_refs.items()}

        def body(b, sums):
            start = b * bq
            q, lse = q_ref[_at(start, bq), :], lse_ref[_at(start, bq), :]
            queried = {i: r[_at(start, bq), :] for i, r in query_refs.items()}
            mask_b = None if mask_ref is None else mask_ref[_at(start, bq), :] != 0
            ws = weights(start, col0, q, k, queried, keyed, lse, mask_b)
            return tuple(
                s + _dot_tn(w, queried[t.value], acc, precision)
                for s, w, t in zip(sums, ws, terms, strict=True)
            )

        # Under the causal triangle the queries before this key block see none of it.
        first = jax.lax.div(col0, jnp.asarray(bq, col0.dtype)) if structure.causal else 0
        sums = jax.lax.fori_loop(first, tiles.seq_p // bq, body, init)
    for o, s in zip(outs, sums, strict=True):
        o[...] = s.astype(o.dtype)


def terms(
    q, k, beta, lse, mask, arrays, terms_, structure, blocks, *, platform="gpu", interpret=False
):
    """The terms' sums of one head, in the order of `terms_` (`_blocks.terms_chunk`'s
    values: rows `(seq, width)` for row terms, `(mem, width)` for column terms). `arrays`
    maps an index to a per-query or per-key array; `KEYS` and `SCALED_QUERIES` are added."""
    (seq, dim), mem = q.shape, k.shape[0]
    acc = beta.dtype
    tiles = _Tiles(seq, mem, blocks.block_q, blocks.block_k_terms, platform)
    arrays = key_arrays(q, k.astype(acc), beta, arrays)
    widths = {i: tiles.width(a.shape[1]) for i, a in arrays.items()}
    dp = tiles.width(dim)
    shared = [
        _pad(q, tiles.seq_p, dp),
        _pad(k, tiles.mem_p, dp),
        beta.reshape(1, 1),
        _pad(lse[:, None], tiles.seq_p),
    ]
    padded_mask = None if mask is None else _pad(mask.astype(jnp.int8), tiles.seq_p, tiles.mem_p)
    bq, bk = tiles.bq, tiles.bk
    whole = lambda i: (0, 0)  # noqa: E731
    results = {}
    for row in (True, False):
        chosen = tuple(t for t in terms_ if t.row == row)
        if not chosen:
            continue
        mine = lambda i: (i, 0)  # noqa: E731
        if row:  # a program per query block: its queries, every key
            grid, queries, keys = (tiles.seq_p // bq,), (bq, mine), (tiles.mem_p, whole)
            mask_spec = pl.BlockSpec((bq, tiles.mem_p), mine)
        else:  # a program per key block: every query, its keys
            grid, queries, keys = (tiles.mem_p // bk,), (tiles.seq_p, whole), (bk, mine)
            mask_spec = pl.BlockSpec((tiles.seq_p, bk), lambda i: (0, i))
        in_specs = [
            pl.BlockSpec((queries[0], dp), queries[1]),
            pl.BlockSpec((keys[0], dp), keys[1]),
            pl.BlockSpec((1, 1), whole),
            pl.BlockSpec((queries[0], 1), queries[1]),
        ]
        inputs = list(shared)
        if mask is not None:
            inputs.append(padded_mask)
            in_specs.append(mask_spec)
        more, specs = _term_operands(arrays, chosen, tiles, widths, acc, queries, keys)
        inputs, in_specs = inputs + more, in_specs + specs
        length, block = (tiles.seq_p, queries) if row else (tiles.mem_p, keys)
        out_shape = [jax.ShapeDtypeStruct((length, widths[t.value]), acc) for t in chosen]
        out_specs = [pl.BlockSpec((block[0], widths[t.value]), block[1]) for t in chosen]
        kernel = functools.partial(
            _terms_kernel,
            tiles=tiles,
            structure=structure,
            has_mask=mask is not None,
            terms=chosen,
            row=row,
            precision=_precision(acc),
        )
        name = "energy_attention_row_terms" if row else "energy_attention_column_terms"
        outs = _call(
            kernel,
            grid,
            inputs,
            in_specs,
            out_shape,
            out_specs,
            blocks,
            tiles,
            dim,
            interpret,
            name,
        )
        results[row] = iter(outs)
    out = []
    for t in terms_:
        value = next(results[t.row])
        out.append(value[: seq if t.row else mem, : arrays[t.value].shape[1]])
    return tuple(out)
