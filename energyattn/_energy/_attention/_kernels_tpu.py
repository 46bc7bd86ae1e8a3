"""The passes' kernels on TPUs (Pallas's Mosaic lowering): a grid over the blocks of rows
and the blocks they visit, the second axis sequential (`"arbitrary"`), so that the
pipeline brings each block into VMEM while the last one computes and the running sums
stay in VMEM scratch: VMEM holds O(block), whatever the lengths. Under the causal triangle
the blocks above the diagonal are skipped, and their index maps repeat the last block
needed, so that nothing is fetched for them. The block arithmetic and the operands are
`_kernels`'s.

Per-row vectors (the log-sum-exp, segment ids) travel lane-dense, as `(1, n)` rows: a TPU
lays a `(n, 1)` float32 array out in `(8, 128)` tiles, 128 times its size in HBM (32 MiB
for the log-sum-exp of 64k queries). The kernels turn the row blocks into the columns
their arithmetic takes, and the forward's log-sum-exp column back into a row (through a
`(rows, 128)` transpose: v4 gathers no sublanes)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._dtypes import accumulation_dtype
from ._kernels import axis, causal_range, finish, gather, indices, init, step


def _is_column(op) -> bool:
    """A per-row vector, `(n, 1)` (carried as a `(1, n)` row)."""
    return op.side in ("q", "k") and op.array.shape[1] == 1


def _as_row(column):
    """A `(rows, 1)` column as a `(1, rows)` row, in the kernel."""
    wide = column.astype(accumulation_dtype(column.dtype))
    wide = jnp.broadcast_to(wide, (column.shape[0], 128))
    return wide.T[:1]


def _block_spec(shape, index_map):
    """A `BlockSpec` whose block indices are int32, as Mosaic takes them: with 64-bit mode
    on (`jax_enable_x64`) a literal `0` or the causal triangle's arithmetic is int64, and
    Mosaic failed to compile every kernel ("failed to legalize operation 'func.return'")."""
    return pl.BlockSpec(
        shape, lambda *grid: tuple(jnp.asarray(b, jnp.int32) for b in index_map(*grid))
    )


def run(spec, ops, out_shapes, cost, *, interpret, name):
    """`spec`'s pass over `ops` (`_kernels.operands`), its outputs `out_shapes`."""
    tiles = spec.tiles
    by_queries = spec.outer_is_queries
    causal = spec.structure.causal
    n_queries, n_keys = tiles.seq_p // tiles.bq, tiles.mem_p // tiles.bk
    n_outer, n_inner = (n_queries, n_keys) if by_queries else (n_keys, n_queries)

    def inner_block(i, j):
        """The inner block to fetch at step `(i, j)`: past the causal triangle's edge the
        last (or, for column terms, first) block needed, already in VMEM."""
        if not causal:
            return j
        first, stop = causal_range(spec, i)
        return jnp.minimum(j, stop - 1) if by_queries else jnp.maximum(j, first)

    def query_block(i, j):
        return i if by_queries else inner_block(i, j)

    def key_block(i, j):
        return inner_block(i, j) if by_queries else i

    in_specs = []
    for op in ops:
        side = op.side
        if side == "qk":
            spec_ = _block_spec(
                (tiles.bq, tiles.bk), lambda i, j: (query_block(i, j), key_block(i, j))
            )
        elif side == "one":
            spec_ = _block_spec((1, 1), lambda i, j: (0, 0))
        else:
            rows, block = (tiles.bq, query_block) if axis(side) == "q" else (tiles.bk, key_block)
            if side in ("qrow", "krow") or _is_column(op):
                spec_ = _block_spec((1, rows), lambda i, j, b=block: (0, b(i, j)))
            else:
                spec_ = _block_spec((rows, op.array.shape[1]), lambda i, j, b=block: (b(i, j), 0))
        in_specs.append(spec_)
    outer_rows = tiles.bq if by_queries else tiles.bk
    out_specs = [
        _block_spec((1, outer_rows), lambda i, j: (0, i))
        if s.shape[1] == 1
        else _block_spec((outer_rows, s.shape[1]), lambda i, j: (i, 0))
        for s in out_shapes
    ]
    acc = out_shapes[-1].dtype
    carry_shapes = [x.shape for x in jax.eval_shape(lambda: init(spec, acc))]

    def kernel(*refs):
        in_refs = refs[: len(ops)]
        out_refs = refs[len(ops) : len(ops) + len(out_shapes)]
        scratch = refs[len(ops) + len(out_shapes) :]
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _():
            for ref, value in zip(scratch, init(spec, acc), strict=True):
                ref[...] = value

        def visit():
            reads = []
            for op, ref in zip(ops, in_refs, strict=True):
                if op.side == "qk":
                    # int8 compared as int32: Mosaic relayouts int8 predicates on no chip
                    # and v4 compares no int8 vectors. The column pass's blocks are
                    # transposed.
                    block = ref[...].astype(jnp.int32)
                    reads.append((block if by_queries else block.T) != 0)
                elif _is_column(op):
                    reads.append(jnp.expand_dims(ref[0], -1))
                elif op.side in ("one", "qrow", "krow"):
                    reads.append(ref[...])
                else:
                    reads.append(lambda c, w, ref=ref: ref[:, pl.ds(c, w)])
            queries, keys = indices(spec, i, j)
            carry = tuple(ref[...] for ref in scratch)
            new = step(spec, carry, gather(spec, ops, reads), queries, keys)
            for ref, value in zip(scratch, new, strict=True):
                ref[...] = value

        if causal:
            first, stop = causal_range(spec, i)
            pl.when((j >= first) & (j < stop))(visit)
        else:
            visit()

        @pl.when(j == n_inner - 1)
        def _():
            outs = finish(spec, tuple(ref[...] for ref in scratch))
            for ref, value in zip(out_refs, outs, strict=True):
                row = ref.shape[0] == 1 and value.shape[1] == 1
                ref[...] = (_as_row(value) if row else value).astype(ref.dtype)

    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(n_outer, n_inner),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(shape, acc) for shape in carry_shapes],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((1, s.shape[0]), s.dtype) if s.shape[1] == 1 else s
            for s in out_shapes
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(*(op.array.reshape(1, -1) if _is_column(op) else op.array for op in ops))
    return [o.reshape(s.shape) for o, s in zip(outs, out_shapes, strict=True)]


__all__ = ["run"]
