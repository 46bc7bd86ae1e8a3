"""Training loops: optax optimisers, vmapped batches, progress, checkpoints that resume exactly."""

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

from .._checks import check_positive, positive_int, runtime_message, shape_str
from .._deprecated import renamed_keywords
from .._io import atomic_output, check_output_file
from .._train import train_step
from ..data import random_patch_mask
from ._image_et import ImageEnergyTransformer, masked_patch_error, masked_patch_mse


@renamed_keywords("ea.models.make_optimizer", num_steps="train_steps")
def make_optimizer(
    learning_rate: float,
    *,
    train_steps: int,
    warmup_steps: int | None = None,
    weight_decay: float = 1e-4,
    clip_norm: float = 1.0,
) -> optax.GradientTransformation:
    r"""AdamW with a warm-up-cosine learning rate and global-norm gradient clipping.

    The learning rate rises linearly from 0 to `learning_rate` over `warmup_steps` (default
    5% of `train_steps`, at least 1), then decays along a cosine to 0 at `train_steps`. Gradients
    are clipped to a global norm of `clip_norm` first. Every `train_steps >= 1` is valid: the
    warm-up is clamped to `train_steps - 1` steps, so the schedule always reaches its peak and
    a single step (`train_steps=1`) runs at `learning_rate`.

    **Arguments:**

    - `learning_rate`: peak learning rate.
    - `train_steps`: total number of optimisation steps.
    - `warmup_steps`: steps of linear warm-up (clamped to `train_steps - 1`).
    - `weight_decay`: AdamW's decoupled weight decay.
    - `clip_norm`: maximum global norm of the gradients.

    **Returns:**

    An `optax.GradientTransformation`.
    """
    train_steps = positive_int("train_steps", train_steps)
    warmup_steps = max(1, train_steps // 20) if warmup_steps is None else warmup_steps
    warmup_steps = positive_int("warmup_steps", warmup_steps, minimum=0)
    # optax needs a cosine part of at least one step (`decay_steps > warmup_steps`).
    warmup_steps = min(warmup_steps, train_steps - 1)
    return _optimizer(
        float(check_positive("learning_rate", learning_rate)),
        train_steps,
        warmup_steps,
        float(weight_decay),
        float(check_positive("clip_norm", clip_norm)),
    )


@functools.lru_cache(maxsize=32)
def _optimizer(
    learning_rate: float, train_steps: int, warmup_steps: int, weight_decay: float, clip_norm: float
) -> optax.GradientTransformation:
    # Cached: the same settings give the same (hashable) optimiser object, so a compiled
    # training step is reused across calls of `train_inpainting` instead of recompiled.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=train_steps,
        end_value=0.0,
    )
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, weight_decay=weight_decay),
    )


def save_checkpoint(path: str | Path, tree: PyTree) -> None:
    """Write the arrays of a pytree (model, optimiser state, step, ...) to `path`.

    The format is `eqx.tree_serialise_leaves`'s, written to exactly `path` (no suffix is
    added). The path is checked first: its folder must exist and be writable and `path` must
    not be a folder, else an `OSError` naming it is raised before anything is written. The
    file is replaced atomically, so an interrupted save leaves the previous checkpoint intact.

    ```python
    import tempfile
    from pathlib import Path

    import jax.numpy as jnp
    import energyattn as ea

    tree = {"w": jnp.ones((2, 3)), "step": jnp.asarray(7)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.eqx"
        ea.models.save_checkpoint(path, tree)
        back = ea.models.load_checkpoint(path, tree)
    assert int(back["step"]) == 7
    ```
    """
    path = check_output_file(path, what="checkpoint")
    for keypath, leaf in jtu.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and np.dtype(dtype).kind not in "biufc":
            raise ValueError(
                f"cannot save {_leaf_name(keypath)} in a checkpoint: an array of dtype "
                f"{np.dtype(dtype)}; a checkpoint holds numbers (bool, int, float, complex)"
            )
    with atomic_output(path) as partial:
        with open(partial, "wb") as file:
            eqx.tree_serialise_leaves(file, tree)
        # Read back before it replaces the old file: a checkpoint that cannot be loaded never
        # replaces one that can.
        try:
            with open(partial, "rb") as file:
                eqx.tree_deserialise_leaves(file, tree)
        except Exception as error:
            raise ValueError(
                f"the checkpoint written for {str(path)!r} could not be read back ({error}); "
                "the previous file, if any, is left as it was"
            ) from None


def _leaf_name(keypath: tuple) -> str:
    # `model.layers[0].weight` rather than keystr's `['model'].layers[0].weight`.
    parts = []
    for key in keypath:
        name = key.name if isinstance(key, jtu.GetAttrKey) else None
        if isinstance(key, jtu.DictKey) and isinstance(key.key, str) and key.key.isidentifier():
            name = key.key
        if name is None:
            parts.append(jtu.keystr((key,)))
        else:
            parts.append(f".{name}" if parts else name)
    return "".join(parts) or "the root"


def _describe(shape: tuple, dtype: Any) -> str:
    return f"shape {shape_str(shape)} and dtype {np.dtype(dtype).name}"


def load_checkpoint(path: str | Path, like: PyTree) -> PyTree:
    """Read a checkpoint written by [`save_checkpoint`][energyattn.models.save_checkpoint] into
    a pytree with the structure, shapes and dtypes of `like`.

    Every leaf is checked against `like` before anything is accepted.

    **Raises:**

    - `ValueError` naming `path` and the first field (its pytree path, e.g.
      `model.transformer.w_query`) whose shape or dtype differs, when the checkpoint was
      written for another configuration;
    - `ValueError` saying the checkpoint is truncated or not a checkpoint, when the file ends
      early or holds something else;
    - `FileNotFoundError` when there is no file.
    """
    path = Path(path)
    flat, treedef = jtu.tree_flatten_with_path(like)
    leaves = []
    with open(path, "rb") as file:
        for index, (keypath, leaf) in enumerate(flat):
            if not eqx.is_array_like(leaf):
                leaves.append(leaf)  # not stored (the serialiser skips it)
                continue
            name = _leaf_name(keypath)
            try:
                stored = np.load(file, allow_pickle=False)
                if not isinstance(stored, np.ndarray):
                    raise ValueError("found an npz archive, not an array")
            except (ValueError, EOFError, OSError) as error:
                raise ValueError(
                    f"checkpoint {str(path)!r} is truncated or not a checkpoint: reading "
                    f"{name} (array {index + 1} of {len(flat)}) failed ({error})"
                ) from None
            want = leaf if isinstance(leaf, (jax.Array, np.ndarray)) else np.asarray(leaf)
            if stored.dtype.kind == "V" and stored.dtype.itemsize == want.dtype.itemsize:
                stored = stored.view(want.dtype)  # bfloat16 is stored as raw bytes
            # A Python scalar's dtype depends on the platform; only its kind must match.
            same_dtype = (
                stored.dtype == want.dtype if want is leaf else stored.dtype.kind == want.dtype.kind
            )
            if stored.shape != want.shape or not same_dtype:
                raise ValueError(
                    f"checkpoint {str(path)!r} does not fit this model: {name} has "
                    f"{_describe(stored.shape, stored.dtype)} in the checkpoint but "
                    f"{_describe(want.shape, want.dtype)} here; it was written for another "
                    "configuration (pass another checkpoint path, or delete it, to start afresh)"
                )
            if isinstance(leaf, jax.Array):
                leaves.append(jnp.asarray(stored))
            elif isinstance(leaf, np.ndarray):
                leaves.append(stored)
            else:  # a Python or NumPy scalar
                leaves.append(type(leaf)(stored.item()))
        if file.read(1):
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit this model: it holds more arrays than "
                f"the {len(flat)} expected; it was written for another configuration (pass "
                "another checkpoint path, or delete it, to start afresh)"
            )
    return jtu.tree_unflatten(treedef, leaves)


class TrainResult(eqx.Module):
    """What [`train_inpainting`][energyattn.models.train_inpainting] returns.

    **Attributes:**

    - `model`: the trained model.
    - `losses`: the training loss of every step run in this call, shape `(steps_run,)`.
    - `step`: the number of optimisation steps done in total (including resumed ones).
    - `finished`: whether `step == train_steps` (`False` when the time limit stopped it).
    - `state`: what the loss carried from step to step (e.g. an energy-based transformer's
      replay buffer), or `None`.
    """

    model: Any
    losses: Float[Array, " steps"]
    step: int
    finished: bool
    state: Any = None


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
def _all_finite(tree: PyTree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# Without a callback (which reads every loss anyway), the losses are checked for NaN or inf
# every this many steps, so the loop rarely waits for the device.
_CHECK_EVERY = 10


def fit(
    model: Any,
    loss_fn: Callable,
    data: Any,
    config: tuple,
    *,
    key: PRNGKeyArray,
    train_steps: int,
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
    state: PyTree | None = None,
) -> TrainResult:
    """The training loop every task model shares (see `train_inpainting` for the semantics):
    `loss_fn(params, static, step_key, data, config)` is a module-level function giving the
    loss of one step's batch, `config` a tuple of Python numbers. With a `state` (arrays the
    loss carries from step to step, e.g. a replay buffer) the loss is
    `loss_fn(params, static, state, step_key, data, config) -> (loss, new_state)`; the state is
    checkpointed with the model, so a resumed run continues exactly, and returned in
    `TrainResult.state`. `project(params, static)`,
    also module-level, maps the parameters back onto their constraint set after every
    optimiser step (projected gradient descent). Each step is `energyattn._train.train_step`.

    The checkpoint path is checked before anything else (`OSError` naming it). The losses are
    checked for NaN or inf every few steps, before every checkpoint and at the end: the first
    non-finite loss raises `FloatingPointError` naming its step, and a checkpoint is never
    overwritten by a diverged state.
    """
    if checkpoint is not None:
        checkpoint = check_output_file(checkpoint, what="checkpoint")
    train_steps = positive_int("train_steps", train_steps)
    checkpoint_every = positive_int("checkpoint_every", checkpoint_every)
    optimizer = make_optimizer(
        learning_rate,
        train_steps=train_steps,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        like = {"model": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
        if state is not None:
            like["state"] = state
        saved = load_checkpoint(checkpoint, like)
        params, opt_state, start = saved["model"], saved["opt_state"], int(saved["step"])
        state = saved.get("state")

    losses: list[Array] = []
    checked = 0  # losses[:checked] are known to be finite
    saved_step = start if checkpoint is not None and checkpoint.exists() else None

    def diverged(step: int, what: str) -> FloatingPointError:
        kept = (
            ""
            if saved_step is None
            else f"; the checkpoint {str(checkpoint)!r} keeps the last finite state (step "
            f"{saved_step})"
        )
        return FloatingPointError(
            f"training diverged at step {step} of {train_steps}: {what}; lower the learning "
            f"rate (learning_rate={learning_rate}) or the model's step size{kept}"
        )

    def verify(step: int, *, parameters: bool) -> None:
        # Raise if a loss since the last check (or, with `parameters`, a parameter after
        # `step` steps) is not finite.
        nonlocal checked
        for index in range(checked, len(losses)):
            try:
                value = float(losses[index])
            except eqx.EquinoxRuntimeError as error:  # raised late (asynchronously)
                message = runtime_message(error)
                raise diverged(start + index + 1, f"the model failed: {message}") from error
            if not math.isfinite(value):
                raise diverged(start + index + 1, f"the loss is {value}")
        checked = len(losses)
        if parameters and not bool(_all_finite(params)):
            raise diverged(step, "its update made the parameters NaN or inf")

    def save(step: int) -> None:
        nonlocal saved_step
        if checkpoint is not None:
            verify(step, parameters=True)
            saved = {"model": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)}
            if state is not None:
                saved["state"] = state
            save_checkpoint(checkpoint, saved)
            saved_step = step

    def step_arguments(step: int) -> tuple[tuple, dict]:
        carried = () if state is None else (state,)
        args = (loss_fn, optimizer, params, static, opt_state, *carried, jr.fold_in(key, step))
        return (*args, data, config), dict(project=project, has_state=state is not None)

    if time_limit is not None and start < train_steps:
        # The time limit counts training, not compilation: compile the step ahead of time
        # (JAX keeps the executable for the calls below), then start the clock.
        args, kwargs = step_arguments(start)
        # eqx.filter_jit's wrapper has `lower`; its annotation is the wrapped function's.
        train_step.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
    began = time.perf_counter()
    bar = _progress(train_steps, start, progress)
    step = start
    try:
        while step < train_steps:
            if time_limit is not None and time.perf_counter() - began > time_limit:
                break
            try:
                args, kwargs = step_arguments(step)
                out: tuple[Any, ...] = train_step(*args, **kwargs)
                if state is None:
                    params, opt_state, loss = out
                else:
                    params, opt_state, loss, state = out
            except eqx.EquinoxRuntimeError as error:
                # A check inside the model ("x contains NaN") failed. After an update, that
                # is divergence: name the step that made the parameters non-finite, or, when
                # they are finite but too large (the model's energy overflows), this step.
                if step > start:
                    try:
                        verify(step, parameters=True)
                    except FloatingPointError as divergence:
                        raise divergence from error
                    message = runtime_message(error)
                    raise diverged(step + 1, f"the model failed: {message}") from error
                raise
            losses.append(loss)
            step += 1
            if callback is not None or (step - start) % _CHECK_EVERY == 0:
                verify(step, parameters=False)
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
    if checkpoint is None:
        verify(done, parameters=True)
    save(done)  # verifies first
    history = jnp.stack(losses) if losses else jnp.zeros((0,))
    return TrainResult(
        model=eqx.combine(params, static),
        losses=history,
        step=done,
        finished=done == train_steps,
        state=state,
    )


@renamed_keywords("ea.models.train_inpainting", num_steps="train_steps")
def train_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
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
    - `train_steps`: total optimisation steps (the schedule's length); any number `>= 1`.
    - `num_masked`: patches masked per image.
    - `batch_size`, `learning_rate`, `warmup_steps`, `weight_decay`, `clip_norm`: the
      optimisation settings.
    - `checkpoint`: optional file; if it exists, training resumes from it (the model passed
      in only supplies the structure), and it is rewritten (atomically) every
      `checkpoint_every` steps and at the end. The path is checked before training starts:
      its folder must exist and be writable, else an `OSError` naming it. A checkpoint of
      another configuration, or a damaged one, raises a `ValueError` naming the path and the
      first field that differs (see [`load_checkpoint`][energyattn.models.load_checkpoint]).
    - `time_limit`: optional wall-clock budget of the training in seconds; training stops
      early (with a checkpoint) when it is spent. The training step is compiled first, so
      compilation does not count.
    - `progress`: show a progress bar (needs tqdm, in the `examples` extra).
    - `callback`: optional `callback(step, loss)` after every step (`step` counts the
      steps done).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].

    **Raises:**

    `FloatingPointError` naming the step when training diverges (a NaN or infinite loss, or
    parameters); the losses are checked every few steps, before every checkpoint and at the
    end, so a checkpoint always holds the last finite state.
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
        train_steps=train_steps,
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
