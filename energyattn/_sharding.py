"""Arrays split along their sequence over an `Explicit` mesh axis (context parallelism).

With an `Explicit` mesh axis every array's sharding is part of its type
(`jax.typeof(x).sharding`); these helpers read it so that the attention log-sum-exp can run
the ring when its keys are split along the sequence, and so that arrays mapped over together
are split alike.
"""

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
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
    if found is None:
        return a
    mesh, axis = found
    spec = PartitionSpec(axis, *([None] * (a.ndim - 1)))
    return jax.sharding.reshard(a, NamedSharding(mesh, spec))
