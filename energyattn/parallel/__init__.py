"""Data- and context-parallel execution of any energyattn layer or model over devices.

Layers and models are unbatched; a batch is `jax.vmap` over examples. The **batch** axis is
split across devices in three interchangeable ways that give the same numbers as one device:

- `method="jit"`: `jax.jit` with `NamedSharding`s on a mesh of `Auto` axes; the compiler
  (GSPMD) partitions the vmapped program and inserts any communication.
- `method="shard_map"`: `jax.shard_map`; every device runs the vmapped function on its own
  shard of the batch, with the parameters replicated.
- [`pmap_apply`][energyattn.parallel.pmap_apply]: a compatibility shim for code written
  around `jax.pmap`.

[`sharded_train_step`][energyattn.parallel.sharded_train_step] is a training step whose batch
is sharded and whose parameters are replicated: the mean loss's gradient is all-reduced by the
compiler.

The **sequence** is split by [`context_parallel`][energyattn.parallel.context_parallel]
(any layer or model) and [`ring_hopfield_energy`][energyattn.parallel.ring_hopfield_energy]
(the energy): every attention log-sum-exp then passes its keys round a ring of devices.
Several hosts (processes) work the same way after
[`initialize`][energyattn.parallel.initialize]; see its docstring and the scaling-out guide.

```python
import jax.random as jr
import energyattn as ea

mesh = ea.parallel.make_mesh()  # all devices, one "batch" axis
layer = ea.nn.HopfieldAttention(16, num_heads=2, key=jr.key(0))
xs = jr.normal(jr.key(1), (2 * mesh.devices.size, 5, 16))  # batch divisible by the devices
attend = ea.parallel.data_parallel(lambda layer, x: layer(x), mesh)
out = attend(layer, xs)  # (batch, seq, dim), sharded over the devices
```
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Bool, Float, PyTree

from .._checks import positive_int, shape_str
from .._custom_types import Scalar, ScalarLike
from .._energy import BlockSizes, hopfield_energy_over
from .._sharding import sequence_parallel
from .._train import train_step

METHODS = ("jit", "shard_map")


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


def sharded_train_step(
    loss_fn: Callable[..., Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    batch_axis: str | None = None,
    sequence_axis: str | None = None,
) -> Callable:
    r"""A parallel training step: the batch (and each example's sequence) split over the
    mesh, the parameters replicated.

    $$\theta \leftarrow \mathrm{update}\Big(\nabla_\theta \frac1B\sum_{b=1}^B
      \ell(\theta; x_b)\Big)$$

    `loss_fn(model, *example)` is the loss of one example. The step vmaps it over the batch,
    takes the mean and its gradient with respect to the model's inexact arrays, and applies
    `optimizer`. The batch mean becomes a cross-device reduction, inserted by the compiler;
    the new parameters are the same on every device and equal a one-device step. It is the
    same step (`energyattn._train.train_step`) that every `ea.models.train_*` runs.

    - **Data parallel** (the default, a one-axis mesh): the batch is split over the axis.
    - **Context parallel** (`sequence_axis`): every example array's first axis after the
      batch is a sequence, split over that mesh axis; the loss is traced as in
      [`context_parallel`][energyattn.parallel.context_parallel], so every attention
      log-sum-exp over the split sequence, its gradient and its second derivatives run on
      the ring. With a two-axis mesh, `batch_axis` and `sequence_axis` split both (batch x
      sequence); with `sequence_axis` alone the batch is not split.

    **Arguments:**

    - `loss_fn`: per-example loss.
    - `optimizer`: an optax transformation (`opt_state = optimizer.init(eqx.filter(model,
      eqx.is_inexact_array))`).
    - `mesh`: a mesh from [`make_mesh`][energyattn.parallel.make_mesh] or `jax.make_mesh`
      (any axis names and types).
    - `batch_axis`: the mesh axis of the batch (default: the mesh's only axis, unless
      `sequence_axis` is given).
    - `sequence_axis`: the mesh axis of the sequences (default: none).

    **Returns:**

    `step(model, opt_state, *batch) -> (model, opt_state, loss)`.

    **Raises:** `ValueError` naming the axis when the mesh has no such axis, and naming the
    shape when a batch or sequence length does not divide over its axis.
    """
    if sequence_axis is None:
        batch_axis = _axis(mesh, batch_axis, "batch_axis")
    else:
        sequence_axis = _axis(mesh, sequence_axis, "sequence_axis")
        if batch_axis is not None:
            batch_axis = _axis(mesh, batch_axis, "batch_axis")
    mesh = _auto(mesh)
    mean_loss = _BatchMeanLoss(loss_fn, mesh, batch_axis, sequence_axis)
    spec = PartitionSpec(batch_axis, sequence_axis)

    def step(model: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Array]:
        _check_split(batch, mesh, spec)
        params, static = eqx.partition(replicate(model, mesh), eqx.is_inexact_array)
        out: tuple[Any, ...] = train_step(  # no carried state: three values
            mean_loss,
            optimizer,
            params,
            static,
            replicate(opt_state, mesh),
            *jax.device_put(batch, NamedSharding(mesh, spec)),
            mesh=mesh,
        )
        params, opt_state, loss = out
        return eqx.combine(params, static), opt_state, loss

    return step


def _check_split(tree: PyTree, mesh: Mesh, spec: PartitionSpec) -> None:
    """Every array's leading axes divide over the mesh axes of `spec` (a `ValueError`
    naming the shape otherwise)."""
    for dim, (axis, what) in enumerate(zip(spec, ("batch", "sequence"), strict=True)):
        if axis is None:
            continue
        size = mesh.shape[axis]
        for leaf in jax.tree.leaves(tree):
            shape = np.shape(leaf)
            if len(shape) <= dim or shape[dim] % size:
                raise ValueError(
                    f"{what}: every array's {what} axis (axis {dim}) must be divisible by "
                    f"the {size} devices of mesh axis {axis!r}, got an array of shape "
                    f"{shape_str(shape)}"
                )


@dataclasses.dataclass(frozen=True)
class _BatchMeanLoss:
    # The mean of a per-example loss over the batch, as `train_step` wants it. A frozen
    # dataclass compares (and hashes) by its fields, so the jitted step is compiled once per
    # loss, optimiser and mesh however often `sharded_train_step` is called. The batch
    # arrives sharded; its mean, and so the gradient, is a cross-device sum that GSPMD
    # inserts. With a sequence axis the loss is traced sequence-parallel (the ring).
    loss_fn: Callable[..., Array]
    mesh: Mesh
    batch_axis: str | None
    sequence_axis: str | None

    def __call__(self, params: Any, static: Any, *batch: Any) -> Array:
        model = eqx.combine(params, static)
        if self.sequence_axis is None:
            return jnp.mean(_vmapped(self.loss_fn, self.batch_axis)(model, *batch))
        # No `spmd_axis_name` here: the ring's `shard_map` is manual over the sequence axis
        # only, and the batch axis, which it leaves to the compiler, must not enter its specs.
        with sequence_parallel(self.mesh, self.sequence_axis):
            return jnp.mean(_vmapped(self.loss_fn)(model, *batch))


def context_parallel(fn: Callable, mesh: Mesh, *, axis: str | None = None) -> Callable:
    r"""Run an unbatched function with its sequences split over devices (context parallelism).

    `fn(module, *sequences)` is any function of a module and arrays whose leading axis is
    the sequence (tokens, queries, memories), e.g. `lambda layer, x: layer(x)`. The returned
    function takes `(module, *sequences)`, splits every sequence along its leading axis over
    the mesh axis (`seq / P` tokens per device), replicates the module, and runs `fn`
    compiled. It composes with `jax.jit`, `jax.grad`, `jax.value_and_grad` and `jax.vmap`
    (context-parallel training: differentiate through it, or use
    [`sharded_train_step`][energyattn.parallel.sharded_train_step] with a `sequence_axis`),
    and its outputs are ordinary arrays, sharded over the devices.

    Token-wise work (projections, layer norms, Hopfield memories, the quadratic terms) runs
    where the tokens are (the compiler splits it), and every attention log-sum-exp over the
    split sequence (`ea.hopfield_energy`, `ea.transformer_attention_energy`,
    `ea.attention_logsumexp` and every layer and model built on them:
    `ea.nn.HopfieldAttention`, `ea.nn.EnergyTransformer` recall, the attractor network) is
    computed by the ring: each device keeps its queries and passes key chunks to the next
    device, $P$ times, accumulating the online log-sum-exp. Its derivatives of every order
    and mode pass the keys and their running sums round the ring again, so no device ever
    holds more than $O(\mathrm{seq}/P)$ keys or a block of scores. The numbers are those of
    one device (to rounding). Attention whose queries or keys do not divide over the axis
    (a handful of learned memories, say) runs on every device as on one.

    ```python
    import jax.random as jr
    import energyattn as ea

    mesh = ea.parallel.make_mesh(axis_name="seq")  # all devices
    layer = ea.nn.EnergyTransformer(16, num_heads=2, head_dim=8, num_memories=32, key=jr.key(0))
    x = jr.normal(jr.key(1), (8 * mesh.devices.size, 16))  # tokens divisible by the devices
    recall = ea.parallel.context_parallel(lambda layer, x: layer(x), mesh)
    out = recall(layer, x)  # (seq, dim), each device holding seq / P tokens
    ```

    Inside your own `jax.jit` under `jax.set_mesh`, the same happens to any array whose type
    is split along the sequence over an `Explicit` mesh axis
    (`jax.sharding.reshard(x, P("seq"))`).

    **Arguments:**

    - `fn`: the unbatched function.
    - `mesh`: a mesh from [`make_mesh`][energyattn.parallel.make_mesh] or `jax.make_mesh`
      (any axis name and type).
    - `axis`: the mesh axis to split the sequences over (default: the mesh's only axis).

    **Returns:**

    A compiled function `(module, *sequences) -> fn's outputs`.

    **Raises:** `ValueError` naming the shape when a sequence length is not divisible by the
    number of devices along the axis.

    ??? cite "Source"

        The ring schedule is that of H. Liu, M. Zaharia, P. Abbeel, *Ring Attention with
        Blockwise Transformers for Near-Infinite Context* (2023), here applied to the
        log-sum-exp energy (M. Bal, 2020) whose gradient is attention.
    """
    axis = _axis(mesh, axis)
    run = _InSequence(fn, _auto(mesh), axis)

    def call(module: Any, *sequences: Any) -> Any:
        _check_batch(sequences, mesh.shape[axis], what="sequence")
        return _run_context_parallel(run, module, *sequences)

    return call


@dataclasses.dataclass(frozen=True)
class _InSequence:
    # `fn` traced sequence-parallel over `axis` (compared by its fields: one compilation per
    # function, mesh and axis).
    fn: Callable
    mesh: Mesh
    axis: str

    def __call__(self, module: Any, *sequences: Any) -> Any:
        split = NamedSharding(self.mesh, PartitionSpec(self.axis))
        sequences = jax.lax.with_sharding_constraint(sequences, split)
        arrays, static = eqx.partition(module, eqx.is_array)
        whole = NamedSharding(self.mesh, PartitionSpec())
        module = eqx.combine(jax.lax.with_sharding_constraint(arrays, whole), static)
        with sequence_parallel(self.mesh, self.axis):
            return self.fn(module, *sequences)


@eqx.filter_jit
def _run_context_parallel(run: _InSequence, module: Any, *sequences: Any) -> Any:
    return run(module, *sequences)


def ring_hopfield_energy(
    query: Float[ArrayLike, "seq dim"],
    memory: Float[ArrayLike, "mem dim"],
    mesh: Mesh,
    *,
    beta: ScalarLike = 1.0,
    mask: Bool[ArrayLike, "seq mem"] | None = None,
    block_size: int | BlockSizes | None = None,
) -> Scalar:
    r"""[`ea.hopfield_energy`][energyattn.hopfield_energy] with queries and memories split
    along the sequence over the devices of a one-axis mesh (ring attention).

    $$E(Q; M) = \sum_i \tfrac12\lVert q_i\rVert^2 - \frac1\beta \sum_i
      \log\sum_{p=1}^{P}\sum_{j\in\mathrm{chunk}_p} e^{\beta\, q_i\cdot m_j}$$

    Device $p$ holds queries and memories $p\,\mathrm{seq}/P, \dots$ (and those rows of
    `mask`). Each device keeps its queries and passes its memory chunk to the next device
    (`jax.lax.ppermute` inside `jax.shard_map`); after $P$ visits every query has seen every
    memory, and its running (online) log-sum-exp is that of the one-device blockwise path.
    Every derivative, in forward and reverse mode and of any order (gradients, JVPs,
    Hessian-vector products, training through a descent step, implicit solves), is a pass
    that sends the memory chunks round again, with the running sums of the memories'
    cotangents travelling home with them. Per-device memory is $O(\mathrm{seq}/P)$: a chunk
    of memories and a `(seq / P, block_size)` block of scores.

    Works eagerly and under `jax.jit`, `jax.grad`, `jax.jvp` (any number of times) and
    `jax.vmap`, with any one-axis mesh (`jax.make_mesh`'s included); the inputs may arrive on
    any devices (they are resharded).
    [`context_parallel`][energyattn.parallel.context_parallel] is the entry point for
    whole layers and models.

    **Arguments:**

    - `query`: $Q$, shape `(seq, dim)`, `seq` divisible by the number of devices.
    - `memory`: $M$, shape `(mem, dim)`, `mem` divisible by the number of devices.
    - `mesh`: a one-axis mesh ([`make_mesh`][energyattn.parallel.make_mesh]).
    - `beta`: inverse temperature $\beta > 0$.
    - `mask`: optional boolean `(seq, mem)`, `True` where query $i$ may attend to memory
      $j$ (causal, padding, ...); split by rows like the queries.
    - `block_size`: the tiling of each device's passes, a
      [`BlockSizes`][energyattn.BlockSizes] or memories per block (default: as one device
      would take for all the queries, see
      [`attention_logsumexp`][energyattn.attention_logsumexp]).

    **Returns:**

    The energy, a 0-d array equal to `ea.hopfield_energy(query, memory, ...)`.

    **Raises:** `ValueError` naming the length when `seq` or `mem` is not divisible by the
    number of devices, or when the mesh has more than one axis.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020)
        (the energy); H. Liu, M. Zaharia, P. Abbeel, *Ring Attention with Blockwise
        Transformers for Near-Infinite Context* (2023) (the ring schedule).
    """
    ring = (_auto(mesh), _axis(mesh))
    return hopfield_energy_over(query, memory, beta, mask, "blockwise", block_size, ring)


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
