"""The passes' kernels on GPUs (Pallas's Triton lowering): a program per block of rows,
looping over the blocks of the other sequence, whose arrays it reads from global memory.
The block arithmetic and the operands are `_kernels`'s."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._kernels import axis, causal_range, finish, gather, indices, init, step


def _origin(rank, i):
    return (0,) * rank


def _at(start, size):
    return pl.ds(pl.multiple_of(start, size), size)


def _hidden(n: int):
    """`n`, as Triton and ptxas cannot see it (an opaque `mov`): a loop of `n` trips stays
    a loop."""
    (lanes,) = plgpu.elementwise_inline_asm(
        "mov.b32 $0, $1;",
        args=[jnp.full((1,), n, jnp.int32)],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)],
    )
    return jnp.max(lanes)


def run(spec, ops, out_shapes, cost, *, interpret, name):
    """`spec`'s pass over `ops` (`_kernels.operands`), its outputs `out_shapes`."""
    tiles = spec.tiles
    outer_axis = "q" if spec.outer_is_queries else "k"
    outer_rows, inner_rows = (tiles.bq, tiles.bk) if spec.outer_is_queries else (tiles.bk, tiles.bq)

    def outer(op):
        return axis(op.side) == outer_axis

    def row(op):
        return op.side in ("qrow", "krow")

    in_specs = []
    for op in ops:
        shape = op.array.shape
        if outer(op) and row(op):
            in_specs.append(pl.BlockSpec((1, outer_rows), lambda i: (0, i)))
        elif outer(op):
            in_specs.append(pl.BlockSpec((outer_rows, shape[1]), lambda i: (i, 0)))
        else:  # the whole array, read block by block in the loop
            in_specs.append(pl.BlockSpec(shape, functools.partial(_origin, len(shape))))
    out_specs = [pl.BlockSpec((outer_rows, s.shape[1]), lambda i: (i, 0)) for s in out_shapes]
    acc = out_shapes[0].dtype

    def kernel(*refs):
        in_refs, out_refs = refs[: len(ops)], refs[len(ops) :]
        program = pl.program_id(0)
        # The program's own vectors (beta, the log-sum-exp, segment ids) are loaded once;
        # its own blocks are read again at each step (from the cache), not held across the
        # loop: laid out as every product's operand, per warp, they took most registers.
        held = [
            ref[...] if op.side == "one" or (outer(op) and 1 in op.array.shape) else None
            for op, ref in zip(ops, in_refs, strict=True)
        ]

        def body(inner, carry):
            queries, keys = indices(spec, program, inner)
            start = inner * inner_rows
            reads = []
            for op, ref, value in zip(ops, in_refs, held, strict=True):
                if value is not None:
                    reads.append(value)
                elif outer(op):
                    reads.append(lambda c, w, ref=ref: ref[:, pl.ds(c, w)])
                elif row(op):
                    reads.append(ref[:, _at(start, inner_rows)])
                elif op.side != "qk":
                    reads.append(lambda c, w, ref=ref: ref[_at(start, inner_rows), pl.ds(c, w)])
                else:  # the dense mask where it lies, a masked load beyond its edges
                    seq, mem = op.array.shape
                    q0, k0 = (program, inner) if spec.outer_is_queries else (inner, program)
                    at = ref.at[pl.ds(q0 * tiles.bq, tiles.bq), pl.ds(k0 * tiles.bk, tiles.bk)]
                    rows = q0 * tiles.bq + jax.lax.broadcasted_iota("int32", (tiles.bq, 1), 0)
                    cols = k0 * tiles.bk + jax.lax.broadcasted_iota("int32", (1, tiles.bk), 1)
                    block = plgpu.load(at, mask=(rows < seq) & (cols < mem), other=False)
                    reads.append(block if spec.outer_is_queries else block.T)
            return step(spec, carry, gather(spec, ops, reads), queries, keys)

        first, stop = causal_range(spec, program)
        if tiles.keep_loop and not spec.structure.causal and not interpret:
            stop = _hidden(stop)  # (a causal loop's bound is computed already)
        carry = jax.lax.fori_loop(first, stop, body, init(spec, acc))
        for ref, value in zip(out_refs, finish(spec, carry), strict=True):
            ref[...] = value.astype(ref.dtype)

    num = tiles.seq_p // tiles.bq if spec.outer_is_queries else tiles.mem_p // tiles.bk
    return pl.pallas_call(
        kernel,
        grid=(num,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        compiler_params=plgpu.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages
        ),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(*(op.array for op in ops))
