"""Context parallelism: sequences split over a mesh axis, every attention log-sum-exp over
them computed by the ring."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import ArrayLike, Bool, Float

from .._checks import keyword_arguments
from .._custom_types import Scalar, ScalarLike
from .._energy import BlockSizes, hopfield_energy_over
from .._sharding import sequence_parallel
from ._mesh import _auto, _axis, _check_batch


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


@keyword_arguments("ea.parallel.ring_hopfield_energy")
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
