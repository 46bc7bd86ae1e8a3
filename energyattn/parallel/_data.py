"""Data parallelism: an unbatched function vmapped over a batch split across devices, by
`jax.jit` with shardings or by `jax.shard_map`, and the `jax.pmap`-style shim."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec

from ._mesh import _auto, _axis, batch_sharding, make_mesh, replicate, shard_batch

METHODS = ("jit", "shard_map")


def _vmapped(fn: Callable, axis: str | None = None) -> Callable:
    # `spmd_axis_name`: the batch's own axis stays split over the mesh axis inside, also
    # under the sharding annotations of the function (the ring of a sequence-parallel loss).
    def batched(module: Any, *batch: Any) -> Any:
        return jax.vmap(lambda *example: fn(module, *example), spmd_axis_name=axis)(*batch)

    return batched


def data_parallel(fn: Callable, mesh: Mesh, *, method: str = "jit") -> Callable:
    """Run an unbatched function data-parallel: vmapped over a batch split across devices.

    `fn(module, *example)` computes one example (e.g. `lambda layer, x: layer(x)`); the
    returned function takes `(module, *batch)`, each batch argument with a leading batch axis
    divisible by the number of devices, and returns the outputs with that axis, sharded over
    the mesh. The module (any pytree: an Equinox layer or model, parameters) is replicated.
    The results equal `jax.vmap` on one device.

    **Arguments:**

    - `fn`: the per-example function.
    - `mesh`: a one-axis mesh from [`make_mesh`][energyattn.parallel.make_mesh].
    - `method`: `"jit"` (`jax.jit` with `NamedSharding`s; the compiler partitions the
      program) or `"shard_map"` (`jax.shard_map`; each device runs the vmapped function on
      its shard).

    **Returns:**

    A compiled function `(module, *batch) -> batched outputs`. Compilations are cached on
    `(fn, mesh, method)` and the argument structure, so wrapping the same module-level `fn`
    again reuses them.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _axis(mesh, what="batch axis")
    mesh = _auto(mesh)
    run = _run_jit if method == "jit" else _run_shard_map

    def call(module: Any, *batch: Any) -> Any:
        return run(fn, mesh, replicate(module, mesh), *shard_batch(batch, mesh))

    return call


# Module-level and jitted with `fn` and `mesh` as static (hashable) arguments: one compilation
# per function, mesh and argument structure, however often `data_parallel` is called.
@eqx.filter_jit
def _run_jit(fn: Callable, mesh: Mesh, module: Any, *batch: Any) -> Any:
    # The inputs arrive sharded (batch) and replicated (module); the constraint pins the
    # outputs' batch axis to the mesh too, and GSPMD partitions everything in between.
    out = _vmapped(fn, _axis(mesh))(module, *batch)
    return jax.lax.with_sharding_constraint(out, batch_sharding(mesh))


@eqx.filter_jit
def _run_shard_map(fn: Callable, mesh: Mesh, module: Any, *batch: Any) -> Any:
    axis = _axis(mesh)
    params, static = eqx.partition(module, eqx.is_array)

    def local(params: Any, *shard: Any) -> Any:
        return _vmapped(fn)(eqx.combine(params, static), *shard)

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(),) + (PartitionSpec(axis),) * len(batch),
        out_specs=PartitionSpec(axis),
        # The per-example function has no collectives. Equinox's runtime checks
        # (`eqx.error_if`, used for NaN checks) are a `lax.cond` whose branches the
        # varying-axes type check would reject inside shard_map.
        check_vma=False,
    )
    return sharded(params, *batch)


def pmap_apply(fn: Callable, module: Any, *batch: Any, devices: Sequence[Any] | None = None) -> Any:
    """Compatibility shim for code written around `jax.pmap`: it is
    [`data_parallel`][energyattn.parallel.data_parallel]`(fn, mesh, method="shard_map")` over
    a mesh of `devices` (default `jax.local_devices()`, as `jax.pmap` maps over).

    `jax.pmap` is in maintenance mode (since JAX 0.8 it is itself implemented with
    `jax.shard_map`); new code should call `data_parallel` directly.

    **Arguments:**

    - `fn`: the per-example function `fn(module, *example)`.
    - `module`: replicated on every device.
    - `batch`: arrays whose leading axis is divisible by the number of devices.
    - `devices`: the devices to map over (default `jax.local_devices()`).

    **Returns:**

    The batched outputs, leading axis `B`, sharded over the devices.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    return data_parallel(fn, make_mesh(devices=devices), method="shard_map")(module, *batch)
