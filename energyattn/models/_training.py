"""Training loops: optax optimisers, vmapped batches, progress, checkpoints that resume exactly."""

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

from .._checks import check_positive, positive_int, shape_str
from ..data._patches import random_patch_mask
from ._image_et import ImageEnergyTransformer, masked_patch_error, masked_patch_mse


def make_optimizer(
    learning_rate: float,
    *,
    num_steps: int,
    warmup_steps: int | None = None,
    weight_decay: float = 1e-4,
    clip_norm: float = 1.0,
) -> optax.GradientTransformation:
    r"""AdamW with a warm-up-cosine learning rate and global-norm gradient clipping.

    The learning rate rises linearly from 0 to `learning_rate` over `warmup_steps` (default
    5% of `num_steps`), then decays along a cosine to 0 at `num_steps`. Gradients are clipped
    to a global norm of `clip_norm` first.

    **Arguments:**

    - `learning_rate`: peak learning rate.
    - `num_steps`: total number of optimisation steps.
    - `warmup_steps`: steps of linear warm-up.
    - `weight_decay`: AdamW's decoupled weight decay.
    - `clip_norm`: maximum global norm of the gradients.

    **Returns:**

    An `optax.GradientTransformation`.
    """
    num_steps = positive_int("num_steps", num_steps)
    warmup_steps = max(1, num_steps // 20) if warmup_steps is None else warmup_steps
    warmup_steps = positive_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_steps > num_steps:
        raise ValueError(f"warmup_steps={warmup_steps} exceeds num_steps={num_steps}")
    return _optimizer(
        float(check_positive("learning_rate", learning_rate)),
        num_steps,
        warmup_steps,
        float(weight_decay),
        float(check_positive("clip_norm", clip_norm)),
    )


@functools.lru_cache(maxsize=32)
def _optimizer(
    learning_rate: float, num_steps: int, warmup_steps: int, weight_decay: float, clip_norm: float
) -> optax.GradientTransformation:
    # Cached: the same settings give the same (hashable) optimiser object, so a compiled
    # training step is reused across calls of `train_inpainting` instead of recompiled.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=num_steps,
        end_value=0.0,
    )
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, weight_decay=weight_decay),
    )


def save_checkpoint(path: str | Path, tree: PyTree) -> None:
    """Write the arrays of a pytree (model, optimiser state, step, ...) to `path` with
    `eqx.tree_serialise_leaves`; the file is replaced atomically."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    eqx.tree_serialise_leaves(partial, tree)
    partial.replace(path)


def load_checkpoint(path: str | Path, like: PyTree) -> PyTree:
    """Read a checkpoint written by [`save_checkpoint`][energyattn.models.save_checkpoint] into
    a pytree with the structure, shapes and dtypes of `like`."""
    return eqx.tree_deserialise_leaves(Path(path), like)


class TrainResult(eqx.Module):
    """What [`train_inpainting`][energyattn.models.train_inpainting] returns.

    **Attributes:**

    - `model`: the trained model.
    - `losses`: the training loss of every step run in this call, shape `(steps_run,)`.
    - `step`: the number of optimisation steps done in total (including resumed ones).
    - `finished`: whether `step == num_steps` (`False` when the time limit stopped it).
    """

    model: Any
    losses: Float[Array, " steps"]
    step: int
    finished: bool


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the `examples` extra; training works without it
        return None
    return tqdm(total=total, initial=initial, desc="training", unit="step")


def _inpainting_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (images,) = data
    batch_size, num_masked = config
    model = eqx.combine(params, static)
    pick_key, mask_key = jr.split(step_key)
    chosen = jr.choice(pick_key, images.shape[0], (batch_size,), replace=False)
    masks = jax.vmap(lambda k: random_patch_mask(k, model.num_patches, num_masked))(
        jr.split(mask_key, batch_size)
    )
    losses = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, images[chosen], masks)
    return jnp.mean(losses)


@eqx.filter_jit
def _train_step(
    params: PyTree,
    static: PyTree,
    opt_state: PyTree,
    step_key: PRNGKeyArray,
    data: Any,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable,
    config: tuple,
    project: Callable | None = None,
) -> tuple[PyTree, PyTree, Array]:
    # Module-level and keyed on hashable arguments (a module-level `loss_fn` and `project`, a
    # cached optimiser, a tuple of numbers), so repeated training calls reuse one compilation.
    loss, grads = jax.value_and_grad(loss_fn)(params, static, step_key, data, config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    if project is not None:
        params = project(params, static)
    return params, opt_state, loss


def fit(
    model: Any,
    loss_fn: Callable,
    data: Any,
    config: tuple,
    *,
    key: PRNGKeyArray,
    num_steps: int,
    learning_rate: float,
    warmup_steps: int | None,
    weight_decay: float,
    clip_norm: float,
    checkpoint: str | Path | None,
    checkpoint_every: int,
    time_limit: float | None,
    progress: bool,
    callback: Callable[[int, float], None] | None,
    project: Callable | None = None,
) -> TrainResult:
    """The training loop every task model shares (see `train_inpainting` for the semantics):
    `loss_fn(params, static, step_key, data, config)` is a module-level function giving the
    loss of one step's batch, `config` a tuple of Python numbers. `project(params, static)`,
    also module-level, maps the parameters back onto their constraint set after every
    optimiser step (projected gradient descent)."""
    num_steps = positive_int("num_steps", num_steps)
    checkpoint_every = positive_int("checkpoint_every", checkpoint_every)
    optimizer = make_optimizer(
        learning_rate,
        num_steps=num_steps,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    start = 0
    if checkpoint is not None and Path(checkpoint).exists():
        params, opt_state, saved_step = load_checkpoint(
            checkpoint, (params, opt_state, jnp.zeros((), jnp.int32))
        )
        start = int(saved_step)

    def save(step: int) -> None:
        if checkpoint is not None:
            save_checkpoint(checkpoint, (params, opt_state, jnp.asarray(step, jnp.int32)))

    began = time.perf_counter()
    bar = _progress(num_steps, start, progress)
    losses: list[Array] = []
    step = start
    try:
        while step < num_steps:
            if time_limit is not None and time.perf_counter() - began > time_limit:
                break
            params, opt_state, loss = _train_step(
                params,
                static,
                opt_state,
                jr.fold_in(key, step),
                data,
                optimizer,
                loss_fn,
                config,
                project,
            )
            losses.append(loss)
            step += 1
            if bar is not None:
                bar.update(1)
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{float(loss):.4f}")
            if step % checkpoint_every == 0:
                save(step)
            if callback is not None:
                callback(step, float(loss))
    finally:
        if bar is not None:
            bar.close()
    done = step
    save(done)
    history = jnp.stack(losses) if losses else jnp.zeros((0,))
    if not bool(jnp.all(jnp.isfinite(history))):
        raise FloatingPointError(
            "training diverged: the loss became NaN or inf; lower the learning rate (or the "
            "model's step size)"
        )
    return TrainResult(
        model=eqx.combine(params, static), losses=history, step=done, finished=done == num_steps
    )


def train_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    key: PRNGKeyArray,
    num_steps: int,
    num_masked: int,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 1e-4,
    clip_norm: float = 1.0,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 100,
    time_limit: float | None = None,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
) -> TrainResult:
    r"""Train an image Energy Transformer to inpaint randomly masked patches.

    $$\min_\theta\; \mathbb E_{\text{image},\,S}\;
      \frac{1}{|S|Z}\sum_{n\in S}\lVert \hat P_n(\theta) - P_n\rVert^2$$

    Each step draws `batch_size` training images and, for each, a random set $S$ of
    `num_masked` patches; the loss ([`masked_patch_mse`][energyattn.models.masked_patch_mse])
    is vmapped over the batch and differentiated through the unrolled descent. The optimiser
    is [`make_optimizer`][energyattn.models.make_optimizer]. Step $s$ uses the key
    `fold_in(key, s)`, so a run stopped and resumed from its checkpoint follows exactly the
    same path as an uninterrupted one.

    **Arguments:**

    - `model`: the initial model.
    - `images`: training images, shape `(n, channels, height, width)`.
    - `key`: a JAX PRNG key (batches and masks).
    - `num_steps`: total optimisation steps (the schedule's length).
    - `num_masked`: patches masked per image.
    - `batch_size`, `learning_rate`, `warmup_steps`, `weight_decay`, `clip_norm`: the
      optimisation settings.
    - `checkpoint`: optional file; if it exists, training resumes from it (the model passed
      in only supplies the structure), and it is rewritten every `checkpoint_every` steps and
      at the end.
    - `time_limit`: optional wall-clock budget in seconds (compilation included); training
      stops early (with a checkpoint) when it is spent.
    - `progress`: show a progress bar (needs tqdm, in the `examples` extra).
    - `callback`: optional `callback(step, loss)` after every step (`step` counts the
      steps done).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        channels, height, width = model.image_shape
        raise ValueError(
            f"images must have shape (n, channels={channels}, height={height}, width={width}), "
            f"got {shape_str(images.shape)}"
        )
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    random_patch_mask(key, model.num_patches, num_masked)  # validates num_masked early
    return fit(
        model,
        _inpainting_loss,
        (images,),
        (batch_size, num_masked),
        key=key,
        num_steps=num_steps,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        time_limit=time_limit,
        progress=progress,
        callback=callback,
    )


def evaluate_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    num_masked: int,
    key: PRNGKeyArray,
    mean_image: Float[ArrayLike, "channels height width"],
    batch_size: int = 256,
) -> dict[str, float]:
    r"""Masked-patch MSE of the model and of the mean-patch baseline on the same masks.

    The baseline fills each masked patch with the mean training patch *at that position*
    (the patch of `mean_image`, usually the training set's mean image), the best prediction
    that ignores the visible patches.

    **Arguments:**

    - `model`: the model to evaluate.
    - `images`: held-out images, shape `(n, channels, height, width)`.
    - `num_masked`: patches masked per image.
    - `key`: a JAX PRNG key for the masks (image `i` uses `fold_in(key, i)`).
    - `mean_image`: the baseline's prediction for every image.
    - `batch_size`: images per compiled call (memory only; results do not depend on it).

    **Returns:**

    `{"mse": ..., "baseline_mse": ..., "ratio": mse / baseline_mse}` as Python floats.
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        raise ValueError(
            f"images must have shape (n, *{model.image_shape}), got {shape_str(images.shape)}"
        )
    mean_patches = model.patchify(mean_image)

    @eqx.filter_jit
    def errors(model: ImageEnergyTransformer, batch: Array, indices: Array) -> tuple:
        masks = jax.vmap(
            lambda i: random_patch_mask(jr.fold_in(key, i), model.num_patches, num_masked)
        )(indices)
        ours = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, batch, masks)

        def baseline(image: Array, mask: Array) -> Array:
            return masked_patch_error(mean_patches, model.patchify(image), mask)

        return ours, jax.vmap(baseline)(batch, masks)

    ours, base = [], []
    for start in range(0, images.shape[0], batch_size):
        batch = images[start : start + batch_size]
        a, b = errors(model, batch, jnp.arange(start, start + batch.shape[0]))
        ours.append(np.asarray(a))
        base.append(np.asarray(b))
    mse = float(np.mean(np.concatenate(ours)))
    baseline_mse = float(np.mean(np.concatenate(base)))
    return {"mse": mse, "baseline_mse": baseline_mse, "ratio": mse / baseline_mse}
