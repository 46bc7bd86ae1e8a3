"""Arrays split along their sequence over a mesh axis (context parallelism).

A sequence is known to be split in one of two ways. Inside
[`ea.parallel.context_parallel`][energyattn.parallel.context_parallel] (and the
sequence-parallel training step), a context (`sequence_parallel`) names the mesh axis while
the function is traced: every attention log-sum-exp whose queries and keys divide evenly
over it runs on the ring, and the compiler (GSPMD, `Auto` axes) splits everything else. With
an `Explicit` mesh axis, in the user's own code under `jax.set_mesh`, every array's sharding
is part of its type (`jax.typeof(x).sharding`), and the helpers here read it.
"""

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

# The mesh axis the sequences are split over while a context-parallel function is traced.
_SEQUENCE_AXIS: contextvars.ContextVar[tuple[Mesh, str | tuple[str, ...]] | None] = (
    contextvars.ContextVar("sequence_axis", default=None)
)


@contextlib.contextmanager
def sequence_parallel(mesh: Mesh, axis: str | tuple[str, ...]) -> Iterator[None]:
    """While tracing within this block, attention over sequences that divide evenly over the
    mesh axis `axis` runs on the ring (context parallelism)."""
    token = _SEQUENCE_AXIS.set((mesh, axis))
    try:
        yield
    finally:
        _SEQUENCE_AXIS.reset(token)


def in_sequence_parallel() -> bool:
    """Whether a context-parallel function is being traced (`sequence_parallel`)."""
    return _SEQUENCE_AXIS.get() is not None


def sequence_axis(
    *arrays: Array,
) -> tuple[Mesh | AbstractMesh, str | tuple[str, ...]] | None:
    """`(mesh, axis)` when the arrays' sequences are split over a mesh axis: from the last
    array's `Explicit` type, or from an enclosing `sequence_parallel` when every array's
    leading length divides evenly over the axis; else `None`."""
    found = explicit_sequence_axis(arrays[-1])
    if found is not None:
        return found
    context = _SEQUENCE_AXIS.get()
    if context is None:
        return None
    size = axis_size(*context)
    return context if all(a.shape[0] % size == 0 for a in arrays) else None


def explicit_sequence_axis(
    x: Array,
) -> tuple[AbstractMesh, str | tuple[str, ...]] | None:
    """`(mesh, axis)` when `x`'s leading (sequence) axis is split over an `Explicit` mesh
    axis in its type (`jax.typeof(x).sharding`), else `None`."""
    sharding: Any = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return None
    return sharding.mesh, spec[0]


def like_rows(a: Array, like: Array) -> Array:
    """`a` split along its leading axis like `like`'s rows when those are split over an
    `Explicit` mesh axis (so that the two can be mapped over together), else `a`."""
    found = explicit_sequence_axis(like)
    return a if found is None else split_rows(a, *found)


def axis_size(mesh: Mesh | AbstractMesh, axis: str | tuple[str, ...]) -> int:
    """The number of devices along `axis` (the product, for several axes)."""
    return math.prod(mesh.shape[name] for name in (axis if isinstance(axis, tuple) else (axis,)))


def split_rows(
    a: Array, mesh: Mesh | AbstractMesh, axis: str | tuple[str, ...], what: str = "sequence"
) -> Array:
    """`a` placed split along its leading axis over the mesh axis `axis`: a `reshard` when the
    axis is `Explicit` (the type changes), a sharding constraint for the compiler otherwise.

    **Raises:** `ValueError` naming `what` and its length when the devices do not divide it.
    """
    size = axis_size(mesh, axis)
    if a.shape[0] % size:
        raise ValueError(
            f"context parallelism: the {what} length {a.shape[0]} must be divisible by the "
            f"{size} devices of mesh axis {axis!r}"
        )
    sharding = NamedSharding(mesh, PartitionSpec(axis, *([None] * (a.ndim - 1))))
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)
