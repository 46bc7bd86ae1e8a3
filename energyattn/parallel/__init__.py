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

from .._namespace import public_dir as _public_dir
from ._context import (
    context_parallel as context_parallel,
    ring_hopfield_energy as ring_hopfield_energy,
)
from ._data import (
    METHODS as METHODS,
    data_parallel as data_parallel,
    pmap_apply as pmap_apply,
)
from ._mesh import (
    batch_sharding as batch_sharding,
    make_mesh as make_mesh,
    replicate as replicate,
    replicated as replicated,
    shard_batch as shard_batch,
)
from ._multihost import global_batch as global_batch, initialize as initialize
from ._train_step import sharded_train_step as sharded_train_step

# The API, as `dir()` lists it (the constant METHODS stays importable, unlisted).
__all__ = [
    "batch_sharding",
    "context_parallel",
    "data_parallel",
    "global_batch",
    "initialize",
    "make_mesh",
    "pmap_apply",
    "replicate",
    "replicated",
    "ring_hopfield_energy",
    "shard_batch",
    "sharded_train_step",
]
__dir__ = _public_dir(__all__)
