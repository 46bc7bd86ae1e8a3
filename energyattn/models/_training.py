"""The training loop every task model shares: its options, optax optimisers, progress,
divergence checks and checkpoints that resume exactly."""

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._checks import (
    check_positive,
    keyword_arguments,
    positive_int,
    python_float,
    runtime_message,
    signature_mismatch,
)
from .._io import check_output_file, load_checkpoint, save_checkpoint
from .._train import train_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    r"""How a model is trained: the settings every `ea.models.train_*` shares, with their
    defaults, in one frozen (hashable) object.

    The optimiser is [`make_optimizer`][energyattn.models.make_optimizer]: AdamW after
    global-norm clipping, at the learning rate

    $$\eta_s = \eta\,\frac{s}{s_w}\ \ (s < s_w),\qquad
      \eta_s = \frac{\eta}{2}\Big(1 + \cos\frac{\pi\,(s - s_w)}{S - s_w}\Big)\ \ (s \ge s_w)$$

    at step $s$ of $S$ = `train_steps`: a linear warm-up, then a cosine decay to 0. Step $s$
    draws its batch with the key `fold_in(key, s)`, so a run stopped and resumed from its
    checkpoint follows exactly the path of an uninterrupted one. How many steps to take
    (`train_steps`) and what a step sees (`batch_size`, the task's settings) are arguments
    of each trainer.

    ```python
    digits = ea.data.load_digits("train")
    model = ea.models.AttentionClassifier(
        "softmax", dim=8, num_heads=2, conv_channels=4, key=jr.key(0)
    )
    losses = []
    options = ea.models.TrainOptions(
        learning_rate=1e-2, progress=False, callback=lambda step, loss: losses.append(loss)
    )
    result = ea.models.train_classifier(
        model, digits.images[:64], digits.labels[:64], key=jr.key(1), train_steps=3,
        batch_size=16, options=options,
    )
    assert result.finished and len(losses) == 3
    ```

    **Arguments:**

    - `learning_rate`: the peak learning rate $\eta$; `None` (default): the trainer's,
      `3e-3` for `train_inpainting`, `train_classifier` and `train_attractor`, `1e-3` for
      `train_reconstruction`, `train_ebt` and `train_next_token`.
    - `warmup_steps`: steps $s_w$ of linear warm-up; `None` (default): 5% of `train_steps`,
      at least 1 (clamped to `train_steps - 1`).
    - `weight_decay`: AdamW's decoupled weight decay; `None` (default): the trainer's,
      `1e-4`, or `0` for `train_attractor` (its projection onto couplings of fixed norm would
      undo it).
    - `clip_norm`: the largest global norm of the gradients (default 1.0).
    - `checkpoint`: an optional file. If it exists, training resumes from it (the model
      passed in only supplies the structure); it is rewritten, atomically, every
      `checkpoint_every` steps and at the end. Its folder must exist and be writable, checked
      before training starts (else an `OSError` naming it); a checkpoint of another
      configuration, or a damaged one, raises a `ValueError` naming the path and the first
      field that differs (see [`load_checkpoint`][energyattn.models.load_checkpoint]).
    - `checkpoint_every`: steps between checkpoints (default 100).
    - `time_limit`: an optional wall-clock budget of the training in seconds; training stops
      early (with a checkpoint) when it is spent, and the result says `finished=False`. The
      training step is compiled first, so compilation does not count.
    - `progress`: show a progress bar (default `True`; needs tqdm, in the `examples` extra).
    - `callback`: an optional `callback(step, loss)` called after every step, `step`
      counting the steps done; it may raise [`StopTraining`][energyattn.models.StopTraining]
      to end the training there.

    Every trainer raises `FloatingPointError` naming the step when training diverges (a NaN
    or infinite loss, or parameters): the losses are checked every few steps, before every
    checkpoint and at the end, so a checkpoint always holds the last finite state.
    """

    learning_rate: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    clip_norm: float = 1.0
    checkpoint: str | os.PathLike[str] | None = None
    checkpoint_every: int = 100
    time_limit: float | None = None
    progress: bool = True
    callback: Callable[[int, float], None] | None = None

    def __post_init__(self) -> None:
        # Python numbers, checked now: a bad setting fails where it is written, and the
        # options stay hashable.
        def number(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, python_float(name, value, allow_zero=allow_zero))

        number("learning_rate")
        number("weight_decay", allow_zero=True)
        number("clip_norm")
        if self.time_limit is not None:
            limit = self.time_limit
            try:
                # Numbers only: float() would also read the string "10".
                seconds = None if isinstance(limit, (bool, str, bytes)) else float(limit)
            except (TypeError, ValueError):
                seconds = None
            if seconds is None:
                raise ValueError(
                    f"time_limit must be a number of seconds >= 0 (None: no limit), got {limit!r}"
                )
            if not seconds >= 0:  # NaN included; inf is no limit
                raise ValueError(
                    f"time_limit must be >= 0 seconds (None: no limit), got {self.time_limit!r}"
                )
            object.__setattr__(self, "time_limit", seconds)
        if self.warmup_steps is not None:
            object.__setattr__(
                self, "warmup_steps", positive_int("warmup_steps", self.warmup_steps, minimum=0)
            )
        object.__setattr__(
            self, "checkpoint_every", positive_int("checkpoint_every", self.checkpoint_every)
        )
        if self.checkpoint is not None and not isinstance(self.checkpoint, (str, os.PathLike)):
            raise TypeError(f"checkpoint must be a path or None, got {self.checkpoint!r}")
        if not isinstance(self.progress, (bool, np.bool_)):
            raise ValueError(f"progress must be True or False, got {self.progress!r}")
        object.__setattr__(self, "progress", bool(self.progress))
        if self.callback is not None:
            _check_callback(self.callback)


def _check_callback(callback: Any) -> None:
    """A `TypeError` now, not inside training, unless `callback(step, loss)` can be called."""
    if not callable(callback):
        raise TypeError(f"callback must be callable as callback(step, loss), got {callback!r}")
    mismatch = signature_mismatch(callback, 0, 0.0)
    if mismatch is not None:
        raise TypeError(
            "callback must take two positional arguments, callback(step, loss) (the steps "
            f"done, an int, and the loss, a float); got {callback!r}: {mismatch}"
        )


# Keyword-only fields: a value given by position is refused with a message naming the field
# (Python's own says only "takes 1 positional argument but 2 were given").
TrainOptions.__init__ = keyword_arguments("ea.models.TrainOptions")(  # type: ignore[method-assign]
    TrainOptions.__init__
)


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


class StopTraining(Exception):
    """Raised by a [`TrainOptions`][energyattn.models.TrainOptions] `callback` to end the
    training after the step it was called for, keeping that step: the trainer then saves its
    checkpoint (if it has one) and returns what it has, with `finished=False` and
    `stopped_by="callback"`, like a time limit does.

    ```python
    def enough(step, loss):
        if loss < 1.0:
            raise ea.models.StopTraining

    digits = ea.data.load_digits("train")
    model = ea.models.AttentionClassifier(
        "softmax", dim=8, num_heads=2, conv_channels=4, key=jr.key(0)
    )
    result = ea.models.train_classifier(
        model, digits.images[:64], digits.labels[:64], key=jr.key(1), train_steps=50,
        batch_size=16, options=ea.models.TrainOptions(callback=enough, progress=False),
    )
    assert result.finished or result.stopped_by == "callback"
    ```
    """


class TrainResult(eqx.Module):
    """What every `ea.models.train_*` returns.

    **Attributes:**

    - `model`: the trained model.
    - `losses`: the training loss of every step run in this call, shape `(steps_run,)`.
    - `step`: the number of optimisation steps done in total (including resumed ones).
    - `finished`: whether `step == train_steps`.
    - `state`: what the loss carried from step to step (e.g. an energy-based transformer's
      replay buffer), or `None`.
    - `stopped_by`: why training ended before `train_steps`: `"time_limit"` (the options'
      `time_limit` was spent) or `"callback"` (the callback raised
      [`StopTraining`][energyattn.models.StopTraining]); `None` when it finished.
    - `compile_seconds`: the wall-clock seconds spent compiling the training step (done
      before the first step; 0 when no step was left to run).
    - `train_seconds`: the wall-clock seconds of the training steps, compilation excluded
      (what `time_limit` counts).
    """

    model: Any
    losses: Float[Array, " steps"]
    step: int
    finished: bool
    state: Any = None
    stopped_by: str | None = None
    compile_seconds: float = 0.0
    train_seconds: float = 0.0


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the `examples` extra; training works without it
        return None
    return tqdm(total=total, initial=initial, desc="training", unit="step")


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
    options: TrainOptions,
    default_learning_rate: float,
    default_weight_decay: float = 1e-4,
    project: Callable | None = None,
    state: PyTree | None = None,
) -> TrainResult:
    """The training loop every task model shares, as
    [`TrainOptions`][energyattn.models.TrainOptions] describes it.

    `loss_fn(params, static, step_key, data, config)` is a module-level function giving the
    loss of one step's batch, `config` a tuple of Python numbers. `default_learning_rate` and
    `default_weight_decay` are the trainer's, for the options left `None`. With a `state`
    (arrays the loss carries from step to step, e.g. a replay buffer) the loss is
    `loss_fn(params, static, state, step_key, data, config) -> (loss, new_state)`; the state
    is checkpointed with the model, so a resumed run continues exactly, and returned in
    `TrainResult.state`. `project(params, static)`, also module-level, maps the parameters
    back onto their constraint set after every optimiser step (projected gradient descent).
    Each step is `energyattn._train.train_step`.

    The checkpoint path is checked before anything else (`OSError` naming it). The losses are
    checked for NaN or inf every few steps, before every checkpoint and at the end: the first
    non-finite loss raises `FloatingPointError` naming its step, and a checkpoint is never
    overwritten by a diverged state.
    """
    if not isinstance(options, TrainOptions):
        raise TypeError(f"options must be an ea.models.TrainOptions, got {type(options).__name__}")
    checkpoint = options.checkpoint
    if checkpoint is not None:
        checkpoint = check_output_file(checkpoint, what="checkpoint")
    train_steps = positive_int("train_steps", train_steps)
    learning_rate = (
        default_learning_rate if options.learning_rate is None else options.learning_rate
    )
    weight_decay = default_weight_decay if options.weight_decay is None else options.weight_decay
    time_limit, callback = options.time_limit, options.callback
    optimizer = make_optimizer(
        learning_rate,
        train_steps=train_steps,
        warmup_steps=options.warmup_steps,
        weight_decay=weight_decay,
        clip_norm=options.clip_norm,
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

    compiling = time.perf_counter()
    if start < train_steps:
        # The time limit counts training, not compilation: compile the step ahead of time
        # (JAX keeps the executable for the calls below), then start the clock.
        args, kwargs = step_arguments(start)
        # eqx.filter_jit's wrapper has `lower`; its annotation is the wrapped function's.
        train_step.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
    began = time.perf_counter()
    bar = _progress(train_steps, start, options.progress)
    step = start
    stopped_by = None
    try:
        while step < train_steps:
            if time_limit is not None and time.perf_counter() - began > time_limit:
                stopped_by = "time_limit"
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
            if step % options.checkpoint_every == 0:
                save(step)
            if callback is not None:
                try:
                    callback(step, float(loss))
                except StopTraining:
                    stopped_by = "callback" if step < train_steps else None
                    break
    finally:
        if bar is not None:
            bar.close()
    ended = time.perf_counter()
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
        stopped_by=stopped_by,
        compile_seconds=began - compiling,
        train_seconds=ended - began,
    )
