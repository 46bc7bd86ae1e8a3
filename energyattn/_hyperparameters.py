"""Scalar hyperparameters of layers (inverse temperatures), fixed or trained, by one convention.

A fixed value is a Python float in a static field: no leaf of the module, so `jax.grad`,
`eqx.filter_grad` and optax never see it. A trainable one is a float array leaf. A layer
keeps the two fields this module makes and reads its value through `hyperparameter`
(docs/api/nn.md, "Hyperparameters: fixed or trained").
"""

from typing import Any, cast

import jax.numpy as jnp
from jaxtyping import Array

from ._checks import check_positive, default_dtype, python_float


def hyperparameter_fields(
    name: str, value: Any, trainable: bool, dtype: Any = None
) -> tuple[float | None, Array | None]:
    """A positive scalar of a layer (an inverse temperature) as the two fields that hold it,
    `(fixed, trained)`, by the convention above: fixed, a Python float
    in a static field, which is no leaf of the layer (`jax.grad`, `eqx.filter_grad` and optax
    never see it, and a new value compiles a new program); with `trainable`, a float array
    leaf that training updates."""
    value = python_float(name, value)
    if trainable:
        return None, jnp.asarray(value, default_dtype(dtype))
    return value, None


def hyperparameter(name: str, fixed: float | None, trained: Array | None) -> float | Array:
    """The value of a hyperparameter held by `hyperparameter_fields`; a trained one is checked
    to be finite and > 0 at run time (training can drive it anywhere)."""
    # One of the two is set (`hyperparameter_fields`): without a trained value, the fixed one.
    return cast(float, fixed) if trained is None else check_positive(name, trained)
