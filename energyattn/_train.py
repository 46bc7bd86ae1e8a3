"""THE training step: one optimiser update of the parameters on a scalar loss.

Both training loops use it: `energyattn.models`' `fit` (one device, every `train_*`) and
`energyattn.parallel.sharded_train_step` (batch sharded over a mesh, parameters replicated).
It is jitted once per set-up: `loss_fn`, `optimizer`, `project` and `mesh` are hashable static
arguments (module-level functions, a cached optax optimiser, a mesh), and so are any
non-array leaves of the other arguments (a tuple of Python numbers for the loss's settings).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree


@eqx.filter_jit
def train_step(
    loss_fn: Callable[..., Array],
    optimizer: optax.GradientTransformation,
    params: PyTree,
    static: PyTree,
    opt_state: PyTree,
    *args: Any,
    project: Callable[[PyTree, PyTree], PyTree] | None = None,
    mesh: Mesh | None = None,
    has_state: bool = False,
) -> tuple[PyTree, PyTree, Array] | tuple[PyTree, PyTree, Array, PyTree]:
    r"""One step $\theta \leftarrow \theta + \mathrm{update}(\nabla_\theta \ell(\theta))$.

    `loss_fn(params, static, *args)` is the scalar loss, differentiated with respect to
    `params` (the inexact arrays of a model, `eqx.partition(model, eqx.is_inexact_array)`;
    `static` is the rest). `project(params, static)`, if given, maps the updated parameters
    back onto their constraint set (projected gradient descent). With a `mesh`, the new
    parameters and optimiser state are pinned to be replicated over it (the arguments
    arrive sharded; the compiler inserts the cross-device reductions).

    With `has_state=True` the first of `args` is a state the loss carries from step to step
    without differentiating it (a replay buffer): `loss_fn(params, static, state, *rest)`
    returns `(loss, new_state)`, and the step returns `(params, opt_state, loss, new_state)`.

    Returns `(params, opt_state, loss)`, the loss being that of the parameters passed in.
    """
    if has_state:
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, static, *args)
    else:
        loss, grads = jax.value_and_grad(loss_fn)(params, static, *args)
    # optax's own arithmetic is not strict-promotion clean (Adam's bias correction raises a
    # Python float to an int32 step count): the update runs in the standard mode whatever the
    # user's, and gives back the dtypes it always does.
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if project is not None:
        params = project(params, static)
    if mesh is not None:
        # Pinned, so the compiler cannot leave the new parameters sharded.
        params, opt_state = jax.lax.with_sharding_constraint(
            (params, opt_state), NamedSharding(mesh, PartitionSpec())
        )
    if has_state:
        return params, opt_state, loss, state
    return params, opt_state, loss
