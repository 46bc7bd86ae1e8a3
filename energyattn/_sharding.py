"""Arrays split along their sequence over an `Explicit` mesh axis (context parallelism).

With an `Explicit` mesh axis every array's sharding is part of its type
(`jax.typeof(x).sharding`); these helpers read it so that the attention log-sum-exp can run
the ring when its keys are split along the sequence, and so that arrays mapped over together
are split alike.
"""

import math

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array


def explicit_sequence_axis(
    x: Array,
) -> tuple[AbstractMesh, str | tuple[str, ...]] | None:
    """`(mesh, axis)` when `x`'s leading (sequence) axis is split over an `Explicit` mesh
    axis in its type (`jax.typeof(x).sharding`), else `None`."""
    sharding = getattr(jax.typeof(x), "sharding", None)
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
