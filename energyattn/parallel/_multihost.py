"""Several processes (hosts): joining the job, and a global batch from each process's rows."""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._checks import positive_int
from ._mesh import _check_batch, batch_sharding


def global_batch(local_batch: PyTree, mesh: Mesh) -> PyTree:
    """Assemble a batch sharded over every process's devices from each process's own part.

    On one process this is [`shard_batch`][energyattn.parallel.shard_batch]; on several, each
    process passes its local rows (`B / num_processes` of them, in process order) and gets
    a global array of `B` rows (`jax.make_array_from_process_local_data`).

    **Raises:** `ValueError` naming the shape when a local batch size is not divisible by
    this process's number of devices in the mesh.
    """
    _check_batch(local_batch, len(mesh.local_devices))
    sharding = batch_sharding(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch
    )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str | None = None,
) -> None:
    """Join a multi-process (multi-host) JAX job; call it first, before any computation.

    Multi-host set-up: start the same program once per host (process), each with the same
    `coordinator_address` (`"host0:port"`, a port on process 0 every process can reach), the
    total `num_processes` and its own `process_id` in `0 .. num_processes - 1`. Afterwards
    `jax.devices()` lists every process's devices: build the mesh over all of them with
    [`make_mesh`][energyattn.parallel.make_mesh], let each process load its own slice of the
    data and assemble the global batch with
    [`global_batch`][energyattn.parallel.global_batch]; then
    [`data_parallel`][energyattn.parallel.data_parallel] and
    [`sharded_train_step`][energyattn.parallel.sharded_train_step] work unchanged, and so do
    [`context_parallel`][energyattn.parallel.context_parallel] and
    [`ring_hopfield_energy`][energyattn.parallel.ring_hopfield_energy] over a mesh of every
    process's devices. Under a scheduler JAX recognises (SLURM, Open MPI, Cloud TPU, ...)
    call `initialize()` without arguments: they are read from the job's environment. The
    [scaling-out guide](../guides/scaling-out.md) shows a SLURM launch.

    Every process must run the same sharded computations in the same order (SPMD). A
    result sharded over the mesh holds only this process's rows; reduce it with an output
    sharding of [`replicated`][energyattn.parallel.replicated] to read a global value on
    every process.

    ```python
    # (not run by the tests as written; tests/test_parallel.py runs the same steps
    # with two processes on loopback)
    # on host i of n (same script everywhere), before anything else touches JAX:
    ea.parallel.initialize("host0:1234", n, i)
    mesh = ea.parallel.make_mesh()  # all devices of all hosts
    xs = ea.parallel.global_batch(my_rows, mesh)  # this host's B / n examples
    out = ea.parallel.data_parallel(lambda layer, x: layer(x), mesh)(layer, xs)
    total = jax.jit(jnp.sum, out_shardings=ea.parallel.replicated(mesh))(out)
    jax.distributed.shutdown()
    ```

    **Arguments:**

    - `coordinator_address`: `"host:port"` of process 0.
    - `num_processes`: the number of processes.
    - `process_id`: this process's index. Give all three, or none (detected from the
      cluster's scheduler by `jax.distributed.initialize`).
    - `local_device_ids`: restrict this process to some of its local devices.
    - `cpu_collectives`: the CPU backend's cross-process collectives, `"gloo"` or `"mpi"`
      (`jax_cpu_collectives_implementation`). The default `None` keeps JAX's setting, which
      is `"gloo"` unless changed (JAX 0.10 to 0.12), and gloo is what CPU processes need to
      exchange data; only CPU devices are affected.
    """
    given = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise ValueError(
            "give coordinator_address, num_processes and process_id together, or none of "
            "them (detected from the cluster's scheduler)"
        )
    if all(given):
        num_processes = positive_int("num_processes", num_processes)
        process_id = positive_int("process_id", process_id, minimum=0)
        if process_id >= num_processes:
            raise ValueError(
                f"process_id must be < num_processes={num_processes}, got {process_id}"
            )
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
