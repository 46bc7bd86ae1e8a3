"""The passes' kernels on TPUs (Pallas's Mosaic lowering): a grid over the blocks of rows
and the blocks they visit, the second axis sequential (`"arbitrary"`), so that the
pipeline brings each block into VMEM while the last one computes and the running sums
stay in VMEM scratch: VMEM holds O(block), whatever the lengths. Under the causal triangle
the blocks above the diagonal are skipped, and their index maps repeat the last block
needed, so that nothing is fetched for them. The block arithmetic and the operands are
`_kernels`'s."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._kernels import axis, causal_range, finish, gather, indices, init, step


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
            spec_ = pl.BlockSpec(
                (tiles.bq, tiles.bk), lambda i, j: (query_block(i, j), key_block(i, j))
            )
        elif side == "one":
            spec_ = pl.BlockSpec((1, 1), lambda i, j: (0, 0))
        else:
            rows, block = (tiles.bq, query_block) if axis(side) == "q" else (tiles.bk, key_block)
            if side in ("qrow", "krow"):
                spec_ = pl.BlockSpec((1, rows), lambda i, j, b=block: (0, b(i, j)))
            else:
                spec_ = pl.BlockSpec((rows, op.array.shape[1]), lambda i, j, b=block: (b(i, j), 0))
        in_specs.append(spec_)
    outer_rows = tiles.bq if by_queries else tiles.bk
    out_specs = [pl.BlockSpec((outer_rows, s.shape[1]), lambda i, j: (i, 0)) for s in out_shapes]
    acc = out_shapes[0].dtype
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
                elif op.side in ("one", "qrow", "krow") or op.array.shape[1] == 1:
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
                ref[...] = value.astype(ref.dtype)

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(n_outer, n_inner),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(shape, acc) for shape in carry_shapes],
        ),
        out_shape=out_shapes,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(*(op.array for op in ops))


__all__ = ["run"]
