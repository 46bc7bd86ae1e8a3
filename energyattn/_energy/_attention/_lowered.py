"""The kernels are built when the program is lowered, for the chip it is lowered for.

A pass's kernels (`_kernels.forward`, `_kernels.terms`) take their tiles from the chip
generation: an H100's (`sm_90`) are not an A100's, and a TPU v6e's VMEM is not a v4's. JAX
knows the chip only when it lowers a program, not when it traces it: a program traced on
this machine may be compiled for another (`jax.jit(f).lower(x)` with `x` placed on a
device of a TPU topology, a real GPU, ...). So the kernels enter the traced program as one
primitive, `kernel_p`, with their output shapes; its lowering rule reads the generation of
the device the program is lowered for (the lowering's client, `ctx.module_context.backend`)
and lowers the kernels built for it (`mlir.lower_fun`). Batching is the kernels' own:
each `jax.vmap` over the primitive is recorded, and applied to the kernels when they are
built (Pallas adds the batch to the kernel's grid).
"""

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from ._policy import generation_of

kernel_p = Primitive("energy_attention_kernels")
kernel_p.multiple_results = True


def _build(fn, vmaps, generation):
    """`fn` for `generation`, under the recorded vmaps (innermost first)."""
    built = functools.partial(fn, generation=generation)
    for in_axes in vmaps:
        built = jax.vmap(built, in_axes=in_axes)
    return built


@kernel_p.def_abstract_eval
def _abstract_eval(*avals, fn, vmaps):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(_build(fn, vmaps, None), *shapes)
    return [jax.core.ShapedArray(o.shape, o.dtype) for o in out]


def _lowering(ctx, *args, fn, vmaps):
    backend = ctx.module_context.backend
    devices = backend.devices() if backend is not None else ()
    generation = generation_of(devices[0]) if devices else None
    return mlir.lower_fun(_build(fn, vmaps, generation), multiple_results=True)(ctx, *args)


def _batch(args, dims, *, fn, vmaps):
    out = kernel_p.bind(*args, fn=fn, vmaps=(*vmaps, tuple(dims)))
    return out, [0] * len(out)


mlir.register_lowering(kernel_p, _lowering)
batching.primitive_batchers[kernel_p] = _batch


def at_lowering(fn, *args):
    """`fn(*args, generation=...)` (flat arrays in, a tuple of arrays out), built when the
    program is lowered, for the generation of the chip it is lowered for."""
    return tuple(kernel_p.bind(*args, fn=fn, vmaps=()))
