"""Input validation shared by the whole package (the three tiers of DESIGN.md).

1. Shapes and structure are known at trace time: a `ValueError` naming the shapes.
2. Runtime values (NaN, a traced `beta <= 0`) can only be seen inside the computation:
   `eqx.error_if`, which raises when the compiled program runs.
3. Solver failures are result codes on a `Solution` (see `energyattn._solver`).
"""

import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike


def shape_str(shape: tuple[int, ...]) -> str:
    """A shape as Python writes it: `(3,)`, `(32, 8)`, `()`."""
    return str(tuple(int(s) for s in shape))


def check_shape(name: str, x: Any, dims: str, **sizes: int) -> None:
    """Raise `ValueError` unless `x` has one axis per name in `dims` with the given `sizes`.

    `check_shape("memory", m, "mem dim", dim=16)` accepts any `(M, 16)` array and otherwise
    says `memory must have shape (mem, dim=16), got (32, 8)`.
    """
    names = dims.split()
    shape = tuple(np.shape(x))
    wanted = ", ".join(f"{n}={sizes[n]}" if n in sizes else n for n in names)
    bad = len(shape) != len(names) or any(
        n in sizes and s != sizes[n] for n, s in zip(names, shape, strict=False)
    )
    if bad:
        raise ValueError(f"{name} must have shape ({wanted}), got {shape_str(shape)}")


def positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as a Python int `>= minimum` (NumPy integers welcome; bools and floats are not)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return n


def concrete_value(x: Any) -> np.ndarray | None:
    """The value of `x` as a NumPy array when it is known at trace time, else `None`."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_values(name: str, value: Any, condition: Callable[[Any], Any], requirement: str) -> Array:
    """Require `condition(value)` everywhere (`requirement` says what it means, e.g. "> 0").

    Works for scalars and arrays: a `ValueError` quoting the offending values when they are
    known at trace time, a runtime error (`eqx.error_if`) when they are traced. Returns `value`
    as an array; use the returned array, so the runtime check stays in the computation.
    `condition` may only use operators that NumPy and JAX share (`>`, `<`, `&`, ...).
    """
    concrete = concrete_value(value)
    if concrete is not None:
        if not np.issubdtype(concrete.dtype, np.number) or np.iscomplexobj(concrete):
            raise ValueError(f"{name} must be a real number, got {value!r}")
        ok = np.asarray(condition(concrete))  # NaN fails every comparison, so it is rejected
        if not np.all(ok):
            got = (
                float(concrete)
                if concrete.ndim == 0
                else f"{concrete[~ok].tolist()} among its entries"
            )
            raise ValueError(f"{name} must be {requirement}, got {got}")
        return jnp.asarray(value)
    value = jnp.asarray(value)
    return eqx.error_if(value, ~jnp.all(condition(value)), f"{name} must be {requirement}")


def check_positive(name: str, value: Any) -> Array:
    """Require a scalar `value > 0`: `ValueError` when concrete, a runtime error when traced."""
    if np.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {shape_str(np.shape(value))}")
    return check_values(name, value, lambda v: v > 0, "> 0")


def check_finite(name: str, x: ArrayLike) -> Array:
    """Runtime check that `x` holds no NaN/inf; returns `x` (as an array)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return eqx.error_if(x, ~jnp.all(jnp.isfinite(x)), f"{name} contains NaN or inf")


def check_mask(mask: Any, shape: tuple[int | None, ...], dims: str) -> Array:
    """A boolean mask of `shape` (`None` = any size), or a `ValueError` naming both shapes."""
    mask_shape = tuple(np.shape(mask))
    ok = len(mask_shape) == len(shape) and all(
        want is None or got == want for got, want in zip(mask_shape, shape, strict=True)
    )
    if not ok:
        wanted = ", ".join(
            name if size is None else f"{name}={size}"
            for name, size in zip(dims.split(), shape, strict=True)
        )
        raise ValueError(f"mask must have shape ({wanted}), got {shape_str(mask_shape)}")
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    return mask


def python_float(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """A tolerance or constant fixed at trace time, as a finite Python float `> 0` (`>= 0`
    with `allow_zero`), or a `ValueError` naming it."""
    concrete = concrete_value(value)
    if concrete is None or np.ndim(concrete) != 0:
        raise ValueError(
            f"{name} must be a Python float (it is fixed at trace time), got {value!r}"
        )
    ok = concrete >= 0 if allow_zero else concrete > 0
    if not (np.isfinite(concrete) and ok):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(concrete)
