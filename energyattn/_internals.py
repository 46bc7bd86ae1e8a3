"""Every use of JAX's private API (`jax._src`) in energyattn, in one place (DESIGN.md).

Each function names the public API it waits for; where JAX versions differ the use is gated
on what the running JAX has. Everything here acts on energyattn's own primitives and on
tracers; nothing registers a rule on another library's primitive.
"""

from collections.abc import Callable
from typing import Any

from jax._src import api_util, core as _core, linear_util as _lu
from jax._src.interpreters import (
    ad as _ad,
    batching as _batching,
    partial_eval as _pe,
)


def unbatched(x: Any) -> tuple[set[int], Any]:
    """`(vmaps, x)`: the vmaps `x` is batched by (their traces' identities) and the value
    inside them.

    Waits for: a public way for a rule to ask which `vmap`s a value is batched by (JAX
    exposes no tracer types or `Tracer._trace`)."""
    vmaps = set()
    while isinstance(x, _batching.BatchTracer):
        vmaps.add(id(x._trace))
        x = x.val
    return vmaps, x


def differentiated(x: Any) -> bool:
    """Whether `x` is being differentiated (or partially evaluated) by a transformation
    outside the current one, through any `vmap`s.

    Waits for: public tracer types (or a query) for JVP, linearization and partial
    evaluation."""
    traced: tuple[type, ...] = (_ad.JVPTracer, _pe.JaxprTracer)
    if hasattr(_ad, "LinearizeTracer"):  # direct linearization (JAX 0.4.36 and later)
        traced = (*traced, _ad.LinearizeTracer)
    return isinstance(unbatched(x)[1], traced)


def eval_jaxpr_in(trace: Any, closed: Any, *args: Any) -> list:
    """`closed` evaluated on `args` by `trace` (a partial-evaluation rule's trace).

    Waits for: a public `set_current_trace` (or custom partial-evaluation rules that may
    return a jaxpr to evaluate)."""
    with _core.set_current_trace(trace):
        return _core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def checkpoint_policy(saveable: Callable, primitive: Any, avals: Any, params: dict) -> str:
    """What a `jax.checkpoint` policy says of an equation: `"save"`, `"recompute"` or
    `"offload"`.

    Waits for: public `jax.checkpoint` policy result types (`SaveableType`, `RecomputeType`,
    `ensure_enum`)."""
    policy = _pe.ensure_enum(saveable(primitive, *avals, **params))
    if isinstance(policy, _pe.SaveableType):
        return "save"
    if isinstance(policy, _pe.RecomputeType):
        return "recompute"
    return "offload"  # pragma: no cover


def register_linearization(primitive: Any, jvp: Callable, name: str) -> bool:
    """Linearize `primitive` by `jvp` (its JVP rule's signature) instead of its JVP rule,
    where JAX has linearization rules (`jax_use_direct_linearize`, the default since 0.7);
    `False` where it has not (then linearization partially evaluates the JVP rule).

    Waits for: a public linearization-rule table (`ad.primitive_linearizations`) and
    `linearize_from_jvp`."""
    if not (hasattr(_ad, "primitive_linearizations") and hasattr(_ad, "linearize_from_jvp")):
        return False  # pragma: no cover

    def rule(is_vjp, nonzeros, *primals, **params):
        del is_vjp
        info = api_util.debug_info(name, jvp, primals, {})
        wrapped = _lu.wrap_init(jvp, debug_info=info)
        return _ad.linearize_from_jvp(wrapped, True, nonzeros, False, False, primals, params)

    _ad.primitive_linearizations[primitive] = rule
    return True
