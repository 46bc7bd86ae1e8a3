"""Meshes and placement: a one-axis device mesh, the batch and replicated shardings, and
arrays placed by them."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._checks import positive_int, shape_str


def make_mesh(
    num_devices: int | None = None,
    *,
    axis_name: str = "batch",
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """A one-axis device mesh for data parallelism, with an `Auto` axis type.

    **Arguments:**

    - `num_devices`: how many devices (default: all of `devices`).
    - `axis_name`: the name of the batch axis.
    - `devices`: the devices to use (default `jax.devices()`, every process's devices when
      several processes were [initialised][energyattn.parallel.initialize]).

    **Returns:**

    A `jax.sharding.Mesh` of shape `(num_devices,)`.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must be a non-empty sequence of devices, got an empty one")
    n = len(devices) if num_devices is None else positive_int("num_devices", num_devices)
    if n > len(devices):
        raise ValueError(f"num_devices={n} but only {len(devices)} devices are available")
    return jax.make_mesh(
        (n,), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n]
    )


def _auto(mesh: Mesh) -> Mesh:
    # The same devices and axes typed `Auto` (`jax.make_mesh` makes `Explicit` ones by
    # default): the compiler places everything from sharding annotations, eagerly or inside
    # any `jax.jit` or `jax.grad`, with no mesh context to enter.
    return Mesh(
        mesh.devices,
        mesh.axis_names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names),
    )


def _axis(mesh: Mesh, axis: str | None = None, what: str = "axis") -> str:
    """`axis` when the mesh has it, else the mesh's only axis."""
    if axis is not None:
        if axis not in mesh.axis_names:
            raise ValueError(
                f"{what}={axis!r} is not an axis of the mesh, whose axes are "
                f"{tuple(mesh.axis_names)}"
            )
        return axis
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"expected a one-axis mesh, got axes {tuple(mesh.axis_names)}: name the {what}"
        )
    return mesh.axis_names[0]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding that splits an array's leading (batch) axis over a one-axis mesh."""
    return NamedSharding(_auto(mesh), PartitionSpec(_axis(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of the mesh."""
    return NamedSharding(_auto(mesh), PartitionSpec())


def _check_batch(tree: PyTree, num_devices: int, what: str = "batch") -> None:
    for leaf in jax.tree.leaves(tree):
        shape = np.shape(leaf)
        if not shape or shape[0] % num_devices:
            raise ValueError(
                f"{what}: every array's leading ({what}) axis must be divisible by the "
                f"{num_devices} devices, got an array of shape {shape_str(shape)}"
            )


def shard_batch(tree: PyTree, mesh: Mesh) -> PyTree:
    """Place every array of `tree` split along its leading (batch) axis over the mesh.

    **Raises:** `ValueError` naming the shape when a batch size is not divisible by the
    number of devices.
    """
    _check_batch(tree, mesh.devices.size)
    return jax.device_put(tree, batch_sharding(mesh))


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """Place a full copy of every array of `tree` (a model, parameters, optimiser state) on
    every device of the mesh; non-array leaves (static fields) are left alone."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, replicated(mesh)), static)
