"""Input validation shared by the whole package (the three tiers of DESIGN.md).

1. Shapes and structure are known at trace time: a `ValueError` naming the shapes.
2. Runtime values (NaN, a traced `beta <= 0`) can only be seen inside the computation:
   `eqx.error_if`, which raises when the compiled program runs.
3. Solver failures are result codes on a `Solution` (see `energyattn._solver`).
"""

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ._mask import SegmentIds
from ._sharding import explicit_sequence_axis, in_sequence_parallel

_F = TypeVar("_F", bound=Callable[..., Any])


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
        hint = ""
        if len(shape) == len(names) + 1 and not any(
            n in sizes and s != sizes[n] for n, s in zip(names, shape[1:], strict=True)
        ):
            # One axis too many in front: a batch, where everything takes one example.
            hint = (
                f" (a batch of {shape[0]}? this takes one example: map it over the batch "
                "with jax.vmap, or eqx.filter_vmap for a module)"
            )
        raise ValueError(f"{name} must have shape ({wanted}), got {shape_str(shape)}{hint}")


def check_matching_dim(
    query_name: str,
    query: Any,
    query_dims: str,
    memory_name: str,
    memory: Any,
    memory_dims: str,
    *,
    fixed: str | None = None,
) -> None:
    """Check both ranks, then that the `dim` axis of `query` matches that of `memory`.

    A mismatch raises a `ValueError` that names both shapes and puts the blame on the query:
    `query has dimension 4 but the patterns of memory have dimension 3 (query shape (2, 4),
    memory shape (5, 3)): ...`. `fixed` (e.g. "this energy's") says that `memory` was fixed
    when the module was built, so only the query can be wrong; the message then says what
    shape it must have.
    """
    check_shape(query_name, query, query_dims)
    check_shape(memory_name, memory, memory_dims)
    for name, x in ((query_name, query), (memory_name, memory)):
        if jnp.iscomplexobj(x):
            raise ValueError(f"{name} must be real, got complex dtype {jnp.result_type(x)}")
    q_shape, m_shape = tuple(np.shape(query)), tuple(np.shape(memory))
    dq = q_shape[query_dims.split().index("dim")]
    dm = m_shape[memory_dims.split().index("dim")]
    if dq == dm:
        return
    owner = f"{fixed} " if fixed else ""
    if memory_dims.startswith("mem"):
        if memory_name == "patterns":
            subject = f"{owner or 'the '}patterns have"
        else:
            subject = f"the patterns of {owner}{memory_name} have"
    else:
        subject = f"{owner}{memory_name} expects"
    head = f"{query_name} has dimension {dq} but {subject} dimension {dm}"
    if fixed:
        wanted = ", ".join(f"dim={dm}" if n == "dim" else n for n in query_dims.split())
        raise ValueError(
            f"{head}: {query_name} must have shape ({wanted}), got {shape_str(q_shape)} "
            f"({memory_name} has shape {shape_str(m_shape)})"
        )
    wanted = ", ".join(f"dim={dq}" if n == "dim" else n for n in memory_dims.split())
    raise ValueError(
        f"{head} ({query_name} shape {shape_str(q_shape)}, {memory_name} shape "
        f"{shape_str(m_shape)}): the dimension of {query_name} must match the pattern "
        f"dimension of {memory_name} (if {query_name} is right, {memory_name} must have "
        f"shape ({wanted}), got {shape_str(m_shape)})"
    )


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
        # bfloat16 and the other ML dtypes are real numbers that NumPy does not class as such.
        real = jnp.issubdtype(concrete.dtype, jnp.integer) or jnp.issubdtype(
            concrete.dtype, jnp.floating
        )
        if not real or np.iscomplexobj(concrete):
            raise ValueError(f"{name} must be a real number, got {value!r}")
        if not np.issubdtype(concrete.dtype, np.number):
            concrete = concrete.astype(np.float32)
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
    """Require a finite scalar `value > 0`: `ValueError` when concrete, a runtime error when
    traced (an infinite inverse temperature or step size gives NaN, not a limit)."""
    if np.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {shape_str(np.shape(value))}")
    if concrete_value(value) is not None:
        # Both checked now, at trace time: no runtime check (a host callback) stays in the
        # program, which then lowers for any platform.
        check_values(name, value, lambda v: v > 0, "> 0")
        check_values(name, value, lambda v: v < np.inf, "finite")
        return jnp.asarray(value)
    value = check_values(name, value, lambda v: v > 0, "> 0")
    return check_values(name, value, lambda v: v < np.inf, "finite")


def check_beta(beta: Any) -> Array:
    """An inverse temperature: a finite scalar `beta > 0`, checked as `check_positive` does
    (a `ValueError` when known at trace time, a runtime error when traced). The one check of
    `beta` of every function of the spin family (`ea.spin.*`)."""
    return check_positive("beta", beta)


def keyword_arguments(where: str) -> Callable[[_F], _F]:
    """Decorate a function (or an `__init__`) with keyword-only parameters: a call that passes
    one of them by position is refused with a `TypeError` that names it, e.g.
    `ea.spin.smt.magnetization takes beta by keyword: pass beta=... (its positional
    arguments are theta)`, where Python's own message names none. Every other call passes
    straight through (`inspect.signature` reads the function's own). `where` names the
    function as users call it."""

    def wrap(fn: _F) -> _F:
        parameters = list(inspect.signature(fn).parameters.values())
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p.name for p in parameters if p.kind in kinds]
        keyword = [p.name for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY]
        shown = positional[1:] if positional[:1] == ["self"] else positional

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if len(args) > len(positional):
                free = [name for name in keyword if name not in kwargs]
                moved = free[: len(args) - len(positional)]
                if moved and len(moved) == len(args) - len(positional):
                    listed = (
                        f"its positional arguments are {', '.join(shown)}"
                        if shown
                        else "it takes keyword arguments only"
                    )
                    raise TypeError(
                        f"{where} takes {' and '.join(moved)} by keyword: pass "
                        f"{', '.join(f'{name}=...' for name in moved)} ({listed})"
                    )
            return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return wrap


def signature_mismatch(fn: Callable[..., Any], *args: Any) -> str | None:
    """Why `fn(*args)` cannot be called, from its signature (e.g. "too many positional
    arguments"), or `None` when it can, or when `fn` has no signature to read (some
    builtins): the reason to refuse a callback when it is given, not when it is first called."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args)
    except TypeError as error:
        return f"its signature is {signature}: {error}"
    return None


def _is_split(x: Any) -> bool:
    if in_sequence_parallel():
        return True
    return any(explicit_sequence_axis(leaf) is not None for leaf in jax.tree.leaves(x))


def _through_scalar(x: Any, check: Callable[[Array], Array]) -> Any:
    # Equinox's check is a callback, which runs on one device: passing arrays split over a
    # mesh through it would gather them there. Pass a scalar zero through it instead and add
    # it to every floating-point leaf, so the check stays in the computation.
    zero = check(jnp.zeros((), jnp.int32))
    return jax.tree.map(
        lambda leaf: (
            leaf + zero.astype(leaf.dtype)
            if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)
            else leaf
        ),
        x,
    )


def error_if(x: Any, failed: Array, message: str) -> Any:
    """`eqx.error_if(x, failed, message)`, also for arrays split along their sequence over
    devices (context parallelism), which it keeps split."""
    if not _is_split(x):
        return eqx.error_if(x, failed, message)
    return _through_scalar(x, lambda zero: eqx.error_if(zero, failed, message))


def branched_error_if(x: Any, failed: Array, index: Array, messages: list[str]) -> Any:
    """`eqx.branched_error_if`, also for arrays split along their sequence over devices."""
    if not _is_split(x):
        return eqx.branched_error_if(x, failed, index, messages)
    return _through_scalar(x, lambda zero: eqx.branched_error_if(zero, failed, index, messages))


def check_finite(name: str, x: ArrayLike) -> Array:
    """Runtime check that `x` holds no NaN/inf; returns `x` (as an array)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x)), f"{name} contains NaN or inf")


def error_if_nonfinite(
    x: Any,
    failed: Array,
    suspects: list[tuple[str, Any]],
    blame: str,
    otherwise: str,
) -> Any:
    """`eqx.error_if(x, failed, ...)` whose message names the cause when it can be known.

    When `failed`, the first floating-point array among the `suspects` (pairs of a name and
    a pytree, e.g. `("energy", module)`) that holds NaN or inf is named in the message
    `blame.format(name)`, e.g. `blame = "its parameters contain NaN or inf ({})"` gives
    "... (energy.memory)"; if all of them are finite the message is `otherwise`.
    """
    names, finite = [], []
    for prefix, tree in suspects:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact):
                names.append(prefix + jax.tree_util.keystr(path))
                finite.append(jnp.all(jnp.isfinite(leaf)))
    if not names:
        return error_if(x, failed, otherwise)
    bad = ~jnp.stack(finite)
    index = jnp.where(jnp.any(bad), jnp.argmax(bad), len(names))
    # Under vmap the branch index is the batch maximum: examples that did not fail vote 0.
    index = jnp.where(failed, index, 0)
    msgs = [blame.format(name) for name in names] + [otherwise]
    return branched_error_if(x, failed, index, msgs)


def check_mask(
    mask: Any, shape: tuple[int | None, ...], dims: str, *, segments: bool = False
) -> Any:
    """A boolean mask of `shape` (`None` = any size), or a `ValueError` naming both shapes.

    With `segments`, `SegmentIds` are taken too (ids of shapes `(shape[0],)` and
    `(shape[1],)`), and returned with their ids as int32; without, they are refused with a
    message that says how to make them dense."""
    if isinstance(mask, SegmentIds):
        names = dims.split()
        if not segments:
            raise ValueError(
                "this mask must be a boolean matrix: a layer that holds its (seq, mem) scores "
                "takes no SegmentIds (pass mask.dense())"
            )
        checked = []
        for field, ids, size, name in zip(("query", "keys"), mask, shape, names, strict=True):
            ids_shape = tuple(np.shape(ids))
            if len(ids_shape) != 1 or (size is not None and ids_shape[0] != size):
                wanted = name if size is None else f"{name}={size}"
                raise ValueError(
                    f"SegmentIds.{field} must have shape ({wanted},), got {shape_str(ids_shape)}"
                )
            ids = jnp.asarray(ids)
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(f"SegmentIds.{field} must be integers, got dtype {ids.dtype}")
            checked.append(ids.astype(jnp.int32))
        return SegmentIds(*checked)
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
    if not np.issubdtype(concrete.dtype, np.number) or np.iscomplexobj(concrete):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    ok = concrete >= 0 if allow_zero else concrete > 0
    if not ok:  # NaN included
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    if not np.isfinite(concrete):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(concrete)


def check_image_shape(image_shape: Any, patch_size: Any) -> tuple[tuple[int, int, int], int]:
    """Validated `((channels, height, width), patch_size)` with the sides divisible."""
    patch_size = positive_int("patch_size", patch_size)
    if len(tuple(image_shape)) != 3:
        raise ValueError(
            f"image_shape must be (channels, height, width), got {shape_str(tuple(image_shape))}"
        )
    channels, height, width = (
        positive_int(name, n)
        for name, n in zip(("channels", "height", "width"), image_shape, strict=True)
    )
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"image of shape {shape_str((channels, height, width))} (channels, height, width) "
            f"does not split into {patch_size}x{patch_size} patches: height and width must be "
            f"divisible by patch_size={patch_size}"
        )
    return (channels, height, width), patch_size


def check_pixels(name: str, pixels: Any) -> Array:
    """`pixels` as an array, or an error unless every value is finite and in $[0, 1]$
    (`ValueError` when the values are known at trace time, a runtime error under `jit`)."""
    return check_values(name, pixels, lambda p: (p >= 0) & (p <= 1), "in [0, 1]")


def num_corrupted(fraction: Any, size: int) -> int:
    """`round(fraction * size)` for a concrete `fraction` in [0, 1], else a `ValueError`."""
    if isinstance(fraction, bool):
        raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
    known = concrete_value(fraction)
    if known is None:
        raise ValueError(
            "fraction must be a concrete Python number (it fixes how many entries are "
            "corrupted, a static shape); got a traced value: close over it instead of "
            "passing it through jit/vmap"
        )
    if np.ndim(fraction) != 0:
        raise ValueError(f"fraction must be a number in [0, 1], got shape {np.shape(fraction)}")
    check_values("fraction", fraction, lambda f: (f >= 0) & (f <= 1), "in [0, 1]")
    # The count is static: take it from the concrete value (under jit, jnp.asarray of a
    # Python float is staged as a tracer).
    return round(float(known) * size)


def default_dtype(dtype: Any) -> Any:
    """`dtype`, or JAX's default float dtype (float64 under x64) when it is `None`."""
    return jnp.result_type(float) if dtype is None else dtype


def runtime_message(error: Exception) -> str:
    """The message an `eqx.error_if` check carried, without Equinox's stack notes (its text
    follows the last "EquinoxRuntimeError: " of the exception's string)."""
    text = str(error)
    marker = "EquinoxRuntimeError: "
    if marker in text:
        text = text[text.rindex(marker) + len(marker) :]
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
