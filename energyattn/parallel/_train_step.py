"""The parallel training step: a per-example loss's batch mean, its batch (and each
example's sequence) split over a mesh, the parameters replicated."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from .._checks import shape_str
from .._sharding import sequence_parallel
from .._train import train_step
from ._data import _vmapped
from ._mesh import _auto, _axis, replicate


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
