"""Where the blockwise passes run: on one device (a vmap over heads run head by head on a
CPU), round the ring of devices, or partly in cuDNN's fused kernel.

On one device the platform the program is lowered for picks the code, not the machine that
traced it (`jax.lax.platform_dependent`): the blockwise method is the XLA loop of
`_blocks` on a CPU and the Pallas kernels of `_kernels` on a GPU; `"pallas"` takes the
kernels everywhere, in Pallas's interpret mode on a CPU. A program traced on a CPU and
lowered for `cuda` therefore holds the kernels.

`run_forward` and `run_terms` are the only entry points of the derivative rules
(`_derivatives.py`): they take whole (global) arrays, and are never differentiated
themselves -- every derivative is a rule that calls them again.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _cudnn, _kernels, _lowered
from ._blocks import (
    KEYS,
    ONES,
    SCALED_KEYS,
    SCALED_QUERIES,
    Structure,
    Term,
    forward_chunk,
    forward_finish,
    forward_init,
    terms_chunk,
    terms_init,
)
from ._policy import BlockSizes
from ._ring import RingAxis, ring_forward, ring_terms


class Config(NamedTuple):
    """The static configuration of one log-sum-exp: `method` (`"blockwise"`, `"pallas"` or
    `"cudnn"`), the structural masks (`Structure`: the excluded diagonal, the causal
    triangle), keys per block of the XLA loop's forward pass and of its derivatives' passes,
    the ring (or `None`), whether a vmap over heads runs head by head on a CPU, and the
    tiling asked for (`BlockSizes`; the kernels fill it with their platform's defaults)."""

    method: str
    structure: Structure
    block_size: int
    pass_block_size: int
    ring: RingAxis | None
    heads_in_turn: bool
    blocks: BlockSizes = BlockSizes()


def _in_turn(fn, *args):
    """`fn(*args)`, where a `jax.vmap` over it runs as a loop over the batch (the heads)
    instead of batched products: on a CPU a batched pass's `(heads, seq, block)` blocks no
    longer fit in the cache, and each elementwise step over them goes to memory
    (`benchmarks/README.md`). Arguments that are not batched are closed over, not copied per
    head. Only ever evaluated, never differentiated (`jax.custom_batching.custom_vmap` has no
    derivative rules; the derivative rules call the passes anew)."""
    leaves, tree = jax.tree.flatten(args)

    @jax.custom_batching.custom_vmap
    def looped(*leaves):
        return fn(*jax.tree.unflatten(tree, leaves))

    @looped.def_vmap
    def _(axis_size, in_batched, *leaves):
        batched = [x for x, b in zip(leaves, in_batched, strict=True) if b]

        def one(xs, run=looped):
            xs = iter(xs)
            return run(*[next(xs) if b else x for x, b in zip(leaves, in_batched, strict=True)])

        def in_turn(*batched):
            return jax.lax.map(one, batched)

        def together(*batched):
            return jax.vmap(lambda xs: one(xs, lambda *ls: fn(*jax.tree.unflatten(tree, ls))))(
                batched
            )

        # Head by head only where the program runs on a CPU.
        out = jax.lax.platform_dependent(*batched, cpu=in_turn, default=together)
        return out, jax.tree.map(lambda _: True, out)

    return looped(*leaves)


def run_forward(q, k, beta, mask, config: Config, arrays=(), terms: tuple[Term, ...] = ()):
    """The log-sum-exp rows and the attention output $\\sum_j p_{ij} k_j$; with `terms`
    (row terms over `arrays`, see `_blocks.terms_chunk`) their sums too, from the same
    online pass (one device only: the fused forward of a JVP)."""
    if config.ring is not None:
        if terms:  # the JVP rule fuses on one device only
            raise NotImplementedError("the ring's forward pass takes no terms")
        return ring_forward(config.ring, q, k, beta, mask, config.structure, config.block_size)

    def one_device(q, k, beta, mask, arrays):
        table = dict(enumerate(arrays))
        init = (
            *forward_init(q, beta.dtype),
            *terms_init(q.shape[0], table, terms, beta.dtype, k.shape[1]),
        )
        args = (q, k, beta, mask, config.structure, config.block_size, init)
        carry = forward_chunk(*args, arrays=table, terms=terms)
        lse, out, *rows = forward_finish(carry)
        if config.method == "cudnn":
            # The fused kernel's own log-sum-exp comes back in the inputs' half precision, so
            # the value is the float32 online pass's; when only the output is used, XLA drops
            # that pass's output products.
            out = _cudnn.fused_rows(q, k, beta, k)
        return (lse, out, *rows)

    def kernel(q, k, beta, mask, arrays, **how):
        table = dict(enumerate(arrays))
        return _kernels.forward(
            q, k, beta, mask, config.structure, arrays=table, terms=terms, **how
        )

    return _on_platform(config, one_device, kernel, q, k, beta, mask, tuple(arrays))


def _on_platform(config, one_device, kernel, *args):
    """`one_device(*args)` (the XLA loop, head by head on a CPU when `config` says so) or
    `kernel(*args, blocks=..., platform=..., interpret=...)`, by the platform the program is
    lowered for: for the blockwise method the kernels on GPUs and TPUs (below 64 bits:
    float64 keeps the XLA loop) and the XLA loop on a CPU; for `"pallas"` the kernels
    everywhere, the GPU's interpreted on a CPU. cuDNN's path is the XLA loop's own."""
    if config.method == "cudnn":
        return one_device(*args)

    def xla(*args):
        return _in_turn(one_device, *args) if config.heads_in_turn else one_device(*args)

    beta = args[2]

    def on(platform, interpret=False):
        built = functools.partial(
            kernel, blocks=config.blocks, platform=platform, interpret=interpret
        )
        if interpret:
            return built

        # Built when lowered, for the chip lowered for (`_lowered`).
        def at_lowering(*args):
            leaves, tree = jax.tree.flatten(args)

            def flat(*leaves, generation):
                return tuple(built(*jax.tree.unflatten(tree, leaves), generation=generation))

            return _lowered.at_lowering(flat, *leaves)

        return at_lowering

    narrow = jnp.dtype(beta.dtype).itemsize <= 4
    gpu = on("gpu") if narrow else xla
    tpu = on("tpu") if narrow else xla
    cpu = on("gpu", interpret=True) if config.method == "pallas" else xla
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=gpu, rocm=gpu, tpu=tpu, default=cpu)


def run_terms(q, k, beta, lse, mask, arrays, terms: tuple[Term, ...], config: Config):
    """The terms' sums (see `_blocks.terms_chunk`), in the order of `terms`."""
    if config.ring is not None:
        rows, cols = ring_terms(
            config.ring,
            q,
            k,
            beta,
            lse,
            mask,
            dict(enumerate(arrays)),
            terms,
            config.structure,
            config.pass_block_size,
        )
        return _in_order(terms, rows, cols)

    def one_device(q, k, beta, lse, mask, arrays):
        fused = {}
        if config.method == "cudnn":
            # Plain (unweighted) terms through the fused kernel.
            for t, term in enumerate(terms):
                if not term.factors and term.value != ONES:
                    run = _cudnn.fused_rows if term.row else _cudnn.fused_columns
                    values = {KEYS: k, SCALED_QUERIES: beta * q, SCALED_KEYS: beta * k}.get(
                        term.value
                    )
                    fused[t] = run(q, k, beta, arrays[term.value] if values is None else values)
        rest = tuple(term for t, term in enumerate(terms) if t not in fused)
        acc = beta.dtype
        table = dict(enumerate(arrays))
        init = terms_init(q.shape[0], table, rest, acc, k.shape[1])
        args = (q, k, beta, lse, mask, table, rest, config.structure, config.pass_block_size)
        rows, cols = terms_chunk(*args, init) if rest else ((), ())
        blockwise = iter(_in_order(rest, rows, cols))
        return tuple(fused[t] if t in fused else next(blockwise) for t in range(len(terms)))

    def kernel(q, k, beta, lse, mask, arrays, **how):
        table = dict(enumerate(arrays))
        return _kernels.terms(q, k, beta, lse, mask, table, terms, config.structure, **how)

    return _on_platform(config, one_device, kernel, q, k, beta, lse, mask, tuple(arrays))


def naive_on_cpu(naive, kernels, dtype):
    """The `"small"` path: `naive()` where the program is lowered for a CPU, `kernels()` (the
    blockwise path, the Pallas kernels there) where it is lowered for a GPU or TPU; `naive()`
    everywhere for 64-bit `dtype`, which the kernels do not take."""
    if jnp.dtype(dtype).itemsize > 4:
        return naive()
    return jax.lax.platform_dependent(cpu=naive, default=kernels)


def _in_order(terms, rows, cols):
    rows, cols = iter(rows), iter(cols)
    return tuple(next(rows) if t.row else next(cols) for t in terms)
