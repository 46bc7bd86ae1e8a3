"""hopfield-layers' PyTorch `state_dict()` names for the layers of `_hopfield_layers`.

The translation both ways: `load_state_dict` builds a `Hopfield`, `HopfieldPooling` or
`HopfieldLayer` from a state dict (checking every name, shape and value), and
`hopfield_state_dict` writes a `Hopfield`'s parameters back under those names. The layers'
`from_state_dict` / `to_state_dict` methods are the public entry points.
"""

import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array

from .._checks import check_finite, concrete_value
from .._dtypes import result_dtype

if TYPE_CHECKING:
    from ._hopfield_layers import Hopfield

_LN_PARTS = ("weight", "bias")  # the parameters of a PyTorch LayerNorm


def _hopfield_names(hop: "Hopfield", prefix: str) -> dict[str, Callable[["Hopfield"], Any]]:
    """hopfield-layers' name of every parameter of `hop`, with how to reach it."""
    names: dict[str, Callable[["Hopfield"], Any]] = {}
    core = prefix + "association_core."
    for field in ("norm_stored_pattern", "norm_state_pattern", "norm_pattern_projection"):
        norm = getattr(hop, field)
        if norm is not None and norm.weight is not None:
            for part in _LN_PARTS:
                names[f"{prefix}{field}.{part}"] = operator.attrgetter(f"{field}.{part}")
    if hop.norm_hopfield_space is not None and hop.norm_hopfield_space.weight is not None:
        names[core + "p_norm_weight"] = operator.attrgetter("norm_hopfield_space.weight")
        names[core + "p_norm_bias"] = operator.attrgetter("norm_hopfield_space.bias")
    if hop.out_proj is not None:
        names[core + "out_proj.weight"] = operator.attrgetter("out_proj.weight")
        if hop.out_proj.bias is not None:
            names[core + "out_proj.bias"] = operator.attrgetter("out_proj.bias")
    return names


def _projections(hop: "Hopfield") -> list[tuple[str, eqx.nn.Linear]]:
    return [
        (letter, layer)
        for letter, layer in (("q", hop.query_proj), ("k", hop.key_proj), ("v", hop.value_proj))
        if layer is not None
    ]


def hopfield_state_dict(hop: "Hopfield", prefix: str) -> dict[str, Array]:
    if hop.bias_key is not None:
        raise ValueError(
            "this layer has a bias pattern (concat_bias_pattern=True), which hopfield-layers "
            "ignores: it cannot be exported without changing its output"
        )
    core = prefix + "association_core."
    out = {name: get(hop) for name, get in _hopfield_names(hop, prefix).items()}
    projections = _projections(hop)
    if projections:
        if hop.fused_in_proj:
            out[core + "in_proj_weight"] = jnp.concatenate([p.weight for _, p in projections])
        else:
            for letter, p in projections:
                out[f"{core}{letter}_proj_weight"] = p.weight
        if projections[0][1].bias is not None:
            # All the projections have a bias or none has (one `input_bias`).
            biases = [cast(Array, p.bias) for _, p in projections]
            out[core + "in_proj_bias"] = jnp.concatenate(biases)
    return out


def load_state_dict(cls, state, config, dtype, *, prefix, patterns=()):
    config = dict(config)
    concat = config.get("concat_bias_pattern", False)
    if concat:
        # hopfield-layers creates bias_k / bias_v but never uses them (its concat branch needs
        # `key_as_static is None`, never true for a bool): the layer that reproduces its
        # numbers has no bias pattern.
        warnings.warn(
            "concat_bias_pattern=True has no effect in hopfield-layers (bias_k and bias_v are "
            "never used); the loaded layer has no bias pattern, so its outputs match",
            stacklevel=3,
        )
        config["concat_bias_pattern"] = False
    state = {name: value for name, value in state.items()}
    for name in (prefix + "association_core.bias_k", prefix + "association_core.bias_v"):
        if concat:
            state.pop(name, None)
    arrays = {name: jnp.asarray(value) for name, value in state.items()}
    if dtype is None:
        floats = [a.dtype for a in arrays.values() if jnp.issubdtype(a.dtype, jnp.floating)]
        dtype = result_dtype(*floats) if floats else None
    model = cls(**config, dtype=dtype, key=jr.PRNGKey(0))
    hop = model.hopfield if prefix else model

    def take(name: str, shape: tuple[int, ...]) -> Array:
        if name not in arrays:
            raise ValueError(f"the state dict has no {name!r} (expected shape {shape})")
        value = arrays.pop(name)
        if value.shape != shape:
            raise ValueError(f"{name!r} has shape {tuple(value.shape)}, expected {shape}")
        if jnp.iscomplexobj(value):
            # Casting to the real parameter dtype would drop the imaginary part silently.
            raise ValueError(f"{name!r} must be real, got complex dtype {value.dtype}")
        # NaN weights would make every output NaN without a word: name the weight.
        known = concrete_value(value)
        if known is not None and not np.all(np.isfinite(known)):
            raise ValueError(f"{name!r} holds NaN or inf")
        return check_finite(name, value).astype(dtype)

    wheres, values = [], []
    for name, get in _hopfield_names(hop, prefix).items():
        wheres.append(lambda m, g=get: g(m.hopfield if prefix else m))
        values.append(take(name, get(hop).shape))
    core = prefix + "association_core."
    projections = _projections(hop)
    if projections:
        if hop.fused_in_proj:
            rows = [p.weight.shape[0] for _, p in projections]
            weight = take(core + "in_proj_weight", (sum(rows), hop.input_size))
            weights = jnp.split(weight, np.cumsum(rows)[:-1])
        else:
            weights = [take(f"{core}{c}_proj_weight", p.weight.shape) for c, p in projections]
        biases = [None] * len(projections)
        if projections[0][1].bias is not None:
            rows = [p.bias.shape[0] for _, p in projections]
            bias = take(core + "in_proj_bias", (sum(rows),))
            biases = jnp.split(bias, np.cumsum(rows)[:-1])
        for (letter, _), w, b in zip(projections, weights, biases, strict=True):
            field = {"q": "query_proj", "k": "key_proj", "v": "value_proj"}[letter]
            wheres.append(lambda m, f=field: getattr(m.hopfield if prefix else m, f).weight)
            values.append(w)
            if b is not None:
                wheres.append(lambda m, f=field: getattr(m.hopfield if prefix else m, f).bias)
                values.append(b)
    for name in patterns:
        current = getattr(model, name)
        wheres.append(lambda m, n=name: getattr(m, n))
        values.append(take(name, (1, *current.shape))[0])
    if arrays:
        raise ValueError(
            f"the state dict has parameters this {cls.__name__} configuration does not have: "
            f"{sorted(arrays)}; check the constructor arguments"
        )
    return eqx.tree_at(lambda m: [w(m) for w in wheres], model, values)
