"""Primitives batched by vmapping their own rules: the design of Equinox's (internal)
`create_vprim`, on primitives of energyattn's own.

`create_vprim` makes a primitive from its implementation, abstract evaluation, JVP and
transpose. Under `vmap` an equation of it becomes one equation of `vprim_p` (itself such a
primitive), whose rules are the inner primitive's, vmapped: the whole primitive is batched
once, when it is lowered, however many times its rules would otherwise be batched to find
which outputs are. energyattn's rules for these equations (partial evaluation of the fused
attention pass, `jax.checkpoint` policies) are registered on `vprim_p`, which no other
library's equations use: importing energyattn changes no other library's rules.
"""

import functools as ft
from collections.abc import Callable

import jax
import jax.core
import jax.extend.core as jex
import jax.tree_util as jtu
from jax.interpreters import ad, batching, mlir, partial_eval as pe

from . import _internals

_impls: dict = {}
_abstract_evals: dict = {}
_jvps: dict = {}
_transposes: dict = {}


def create_vprim(
    name: str, impl: Callable, abstract_eval: Callable, jvp: Callable, transpose: Callable
) -> jex.Primitive:
    """A primitive (multiple results) with these rules, batched by `vprim_batch`."""
    prim = jex.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.axis_primitive_batchers[prim] = ft.partial(vprim_batch, prim)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=True))
    _impls[prim], _abstract_evals[prim] = impl, abstract_eval
    _jvps[prim], _transposes[prim] = jvp, transpose
    return prim


def vprim_batch(prim, axis_size, axis_name, trace_type, inputs, batch_axes, /, **params):
    """The batching rule of a `create_vprim` primitive (`batching.axis_primitive_batchers`'s
    signature): itself where nothing is batched, else one `vprim_p` equation."""
    del trace_type
    if all(b is None for b in jtu.tree_leaves(batch_axes)):
        out = prim.bind(*inputs, **params)
        return out, [None] * len(out)
    out = vprim_p.bind(
        *inputs,
        prim=prim,
        axis_size=axis_size,
        axis_name=axis_name,
        batch_axes=tuple(batch_axes),
        params=tuple(params.items()),
    )
    return out, [0] * len(out)


def _vprim_impl(*inputs, prim, axis_size, axis_name, batch_axes, params):
    impl = ft.partial(_impls[prim], **dict(params))
    return jax.vmap(impl, in_axes=batch_axes, axis_size=axis_size, axis_name=axis_name)(*inputs)


def _vprim_abstract_eval(*inputs, prim, axis_size, axis_name, batch_axes, params):
    inputs = [jex.mapped_aval(axis_size, b, x) for x, b in zip(inputs, batch_axes, strict=True)]
    outs = _abstract_evals[prim](*inputs, **dict(params))
    return [jex.unmapped_aval(axis_size, 0, x) for x in outs]


def _unmapped_zero(tangent, batch_axis):
    if type(tangent) is ad.Zero and isinstance(batch_axis, int):
        aval = tangent.aval
        shape = aval.shape[:batch_axis] + aval.shape[batch_axis + 1 :]
        return ad.Zero(jax.core.ShapedArray(shape, aval.dtype))
    return tangent


def _vprim_jvp(primals, tangents, *, prim, axis_size, axis_name, batch_axes, params):
    tangents = [_unmapped_zero(t, b) for t, b in zip(tangents, batch_axes, strict=True)]
    tangent_axes = [
        None if type(t) is ad.Zero else b for t, b in zip(tangents, batch_axes, strict=True)
    ]
    jvp = ft.partial(_jvps[prim], **dict(params))
    jvp = jax.vmap(
        jvp, in_axes=(batch_axes, tangent_axes), axis_size=axis_size, axis_name=axis_name
    )
    return jvp(primals, tangents)


def _unmapped_undefined(x, batch_axis):
    if type(x) is ad.UndefinedPrimal and isinstance(batch_axis, int):
        aval = x.aval
        shape = aval.shape[:batch_axis] + aval.shape[batch_axis + 1 :]
        return ad.UndefinedPrimal(jax.core.ShapedArray(shape, aval.dtype))
    return x


def _vprim_transpose(cts, *inputs, prim, axis_size, axis_name, batch_axes, params):
    mapped = [_unmapped_undefined(x, b) for x, b in zip(inputs, batch_axes, strict=True)]
    axes = [
        None if type(x) is ad.UndefinedPrimal else b
        for x, b in zip(inputs, batch_axes, strict=True)
    ]

    def transpose(cts, *args):
        outs = _transposes[prim](cts, *args, **dict(params))
        # `Zero` is no JAX type: it does not cross a `vmap` boundary, `None` does.
        return tuple(None if type(o) is ad.Zero else o for o in outs)

    transpose = jax.vmap(
        transpose,
        in_axes=(0, *axes),
        out_axes=tuple(batch_axes),
        axis_size=axis_size,
        axis_name=axis_name,
    )
    cts = tuple(None if type(c) is ad.Zero else c for c in cts)
    return transpose(cts, *mapped)


# `vprim_p` is itself such a primitive: a vmap of a batched equation nests.
vprim_p = create_vprim(
    "energyattn_vprim", _vprim_impl, _vprim_abstract_eval, _vprim_jvp, _vprim_transpose
)

_dce_params: dict = {}


def def_dce(prim: jex.Primitive, rule: Callable) -> None:
    """Dead-code elimination for `prim`'s equations, batched (`vprim_p`) or not:
    `rule(used_outputs, params) -> (params, kept)` gives the parameters of an equation that
    computes only the outputs `kept` (a mask over the outputs, covering every used one).
    JAX's own rule keeps a whole equation when any output is used."""
    _dce_params[prim] = rule
    pe.dce_rules[prim] = _dce


def _dce(used_outputs, *rest):
    # (The rule's signature gained `live_inputs` in JAX 0.11: the equation is the last
    # argument.)
    eqn = rest[-1]
    inputs = len(eqn.invars)
    if not any(used_outputs):
        return [False] * inputs, None
    batched = eqn.primitive is vprim_p
    prim = eqn.params["prim"] if batched else eqn.primitive
    if all(used_outputs) or prim not in _dce_params:
        return [True] * inputs, eqn
    inner = dict(eqn.params["params"]) if batched else eqn.params
    params, kept = _dce_params[prim](list(used_outputs), inner)
    if batched:
        params = {**eqn.params, "params": tuple(params.items())}
    outvars = [v for v, keep in zip(eqn.outvars, kept, strict=True) if keep]
    return [True] * inputs, eqn.replace(params=params, outvars=outvars)


pe.dce_rules[vprim_p] = _dce


def _checkpoint_rule(saveable, unks_in, inst_in, eqn):
    """`partial_eval_jaxpr_custom` (`jax.checkpoint`) for a `vprim_p` equation: staged whole
    when an input is unknown; otherwise known, and recomputed in the staged jaxpr where the
    checkpoint policy does not save it. The policy sees the inner primitive and its
    parameters (JAX would pass `vprim_p`'s, whose `prim` clashes with the policies' first
    argument)."""
    n = len(eqn.outvars)
    unsaved = [
        v
        for v, inst in zip(eqn.invars, inst_in, strict=True)
        if isinstance(v, jex.Var) and not inst
    ]
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, unsaved
    avals = [v.aval for v in eqn.invars]
    policy = _internals.checkpoint_policy(
        saveable, eqn.params["prim"], avals, dict(eqn.params["params"])
    )
    if policy == "save":
        return eqn, None, [False] * n, [False] * n, []
    if policy == "recompute":
        return eqn, eqn, [False] * n, [True] * n, unsaved
    raise NotImplementedError(  # pragma: no cover
        "energyattn: a checkpoint policy that offloads is not supported for its batched "
        "primitives (the attention passes, the linear solve)"
    )


pe.partial_eval_jaxpr_custom_rules[vprim_p] = _checkpoint_rule
