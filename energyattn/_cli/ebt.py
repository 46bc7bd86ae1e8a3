"""`energyattn ebt`: an energy-based transformer completes the shipped digits row by row by
thinking (descending its energy), next to a feed-forward transformer of the same size trained
in the same run, the untrained model and the mean training row."""

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..models import TrainOptions
from . import interrupt
from .common import (
    add_command,
    add_shared_flags,
    check_out,
    int_at_least,
    make_out,
    num_parameters,
    plural,
    run,
    say,
    stop_note,
    stopped_by,
    training_options,
    write_metrics,
)

#: The command's training options where its flags do not set them.
OPTIONS = TrainOptions(learning_rate=3e-3)
#: Thinking steps and candidates the evaluation reports (the issue's grid).
THINKING_STEPS = (1, 2, 4, 8, 16)
CANDIDATES = (1, 4, 16)
#: The digits' upper half is given, the lower half completed.
GIVEN_ROWS = 4


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "ebt",
        help="an energy-based transformer that thinks: digit completion row by row",
        description=(
            "Train an energy-based transformer on the shipped 8x8 digits read as sequences of "
            "8 rows: it gives every (rows <= t, candidate row t+1) pair an energy, predicts by "
            "descending it from noise (thinking) and is trained through that descent. A "
            "feed-forward causal transformer with the same blocks is trained with the same "
            "budget. On held-out digits, the lower half is completed from the upper half; "
            "prints the error after 1-16 thinking steps, with self-verification over 1, 4 and "
            "16 candidates, next to the feed-forward model, the untrained EBT and the mean "
            "training row. Writes thinking.png, completions.png and metrics.json into --out."
        ),
    )
    parser.add_argument(
        "--thinking-steps",
        type=int_at_least(1),
        default=2,
        metavar="S",
        help="descent steps per prediction in training",
    )
    parser.add_argument(
        "--test-digits",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="evaluate on the first N held-out digits only (the evaluation takes most of a short "
        "run; default: all of them)",
    )
    add_shared_flags(
        parser,
        train_steps=(600, "steps per model"),
        time_limit=(None, "cap on each model's training time"),
        seed="seed of weights, batches, noise",
        progress="the progress bars",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn ebt`: run `run_ebt_demo`, print the table."""
    print(f"energyattn ebt: digit completion by thinking, seed {args.seed}")
    metrics = run(
        "ebt",
        parser,
        run_ebt_demo,
        args.out,
        overwrite=args.overwrite,
        train_steps=args.train_steps,
        thinking_steps=args.thinking_steps,
        num_test=args.test_digits,
        seed=args.seed,
        options=training_options(args, OPTIONS),
        progress=say,
        flags="--train-steps",
    )
    if metrics is None:
        return 1
    completion = metrics["completion_mse"]
    print()
    print(
        f"{metrics['num_test']} held-out digits, lower half completed from the upper half (MSE "
        "per pixel):"
    )
    for steps, value in completion["ebt"].items():
        untrained = completion["ebt_untrained"][steps]
        label = f"EBT, {steps:>2} thinking step{'' if steps == 1 else 's'}"
        print(f"  {label:<28}{value:.4f}   (untrained {untrained:.4f})")
    for n, value in completion["ebt_verified"].items():
        label = f"EBT, best of {n:>2} candidate{'' if n == 1 else 's'}"
        print(f"  {label:<28}{value:.4f}")
    print(f"  {'feed-forward transformer':<28}{completion['feed_forward']:.4f}")
    print(f"  {'mean training row':<28}{completion['mean_row']:.4f}")
    print(f"files in {args.out}")
    return 0


def _rows(images: np.ndarray) -> np.ndarray:
    """8x8 digits as sequences of 8 rows of 8 pixels."""
    return np.asarray(images, np.float32).reshape(-1, 8, 8)


def run_ebt_demo(
    out: str | Path,
    *,
    train_steps: int = 600,
    thinking_steps: int = 2,
    dim: int = 32,
    num_heads: int = 2,
    depth: int = 2,
    init_scale: float = 0.3,
    batch_size: int = 64,
    thinking_grid: tuple[int, ...] = THINKING_STEPS,
    candidates: tuple[int, ...] = CANDIDATES,
    num_test: int | None = None,
    seed: int = 0,
    options: TrainOptions = OPTIONS,
    progress: Callable[[str], None] = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train an [`EnergyBasedTransformer`][energyattn.models.EnergyBasedTransformer] and a
    feed-forward [`CausalTransformer`][energyattn.models.CausalTransformer] with the same
    blocks, optimiser, steps, batches and seed on scikit-learn's 8x8 digits (fixed 80/20
    split) read as sequences of 8 rows, then evaluate both on the held-out digits.

    Reported, in the same run: the next-row error (every row predicted from the true rows
    above it) and the completion error (rows 4-7 generated one by one from rows 0-3, each
    prediction fed back) of the EBT after 1, 2, 4, 8 and 16 thinking steps, with
    self-verification over 1, 4 and 16 candidates, of the untrained EBT, of the feed-forward
    model and of the mean training row (the best prediction that ignores the rows above);
    the parameters and the floating-point operations per sequence (XLA's count).

    Writes `thinking.png` (error against thinking steps), `completions.png` (completed digits
    and the energy of each generated row along its descent) and `metrics.json` into `out`
    (created when training starts; the files of an earlier run there are replaced only with
    `overwrite`).
    `thinking_grid`, `candidates` and `num_test` (the first held-out digits only; the
    command's `--test-digits`) shrink the evaluation (the tests' quick run). `options` are
    both models' [`TrainOptions`][energyattn.models.TrainOptions] (the learning rate is
    `3e-3` unless they set one; a `time_limit` caps each model's training).
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    from .._checks import positive_int
    from ..data import load_digits
    from ..models import (
        CausalTransformer,
        EnergyBasedTransformer,
        complete,
        train_ebt,
        train_next_token,
    )
    from ..viz import plot_completions, plot_thinking

    out = check_out(out, "thinking.png", "completions.png", "metrics.json", overwrite=overwrite)
    train = _rows(load_digits("train").images)
    test = _rows(load_digits("test").images)
    if num_test is not None:
        num_test = positive_int("num_test", num_test)
        if num_test > len(test):
            raise ValueError(
                f"there are {len(test)} held-out digits; cannot evaluate on {num_test}"
            )
        test = test[:num_test]
    thinking_grid = tuple(positive_int("thinking steps", s) for s in thinking_grid)
    candidates = tuple(positive_int("candidates", n) for n in candidates)
    progress(
        f"digits (scikit-learn, 8x8) as sequences of 8 rows: {len(train)} train / {len(test)} test"
    )
    sizes: dict[str, Any] = dict(dim=dim, num_heads=num_heads, depth=depth)
    ebt0 = EnergyBasedTransformer(8, 8, init_scale=init_scale, key=jr.key(seed), **sizes)
    ff0 = CausalTransformer(8, 8, key=jr.key(seed), **sizes)
    if options.learning_rate is None:  # the command's, not each trainer's
        options = dataclasses.replace(options, learning_rate=OPTIONS.learning_rate)
    settings: dict[str, Any] = dict(
        key=jr.key(seed + 1), train_steps=train_steps, batch_size=batch_size, options=options
    )
    trained = {}
    make_out(out)
    runs: tuple[tuple[str, Any, Callable[..., Any], dict[str, Any]], ...] = (
        (
            "ebt",
            ebt0,
            train_ebt,
            dict(thinking_steps=thinking_steps),
        ),
        ("feed_forward", ff0, train_next_token, {}),
    )
    for name, model, fn, extra in runs:
        planned = plural(train_steps, "step")
        progress(f"{name}: {num_parameters(model)} parameters; training {planned}")
        began = time.perf_counter()
        with interrupt.training():
            result = fn(model, train, **settings, **extra)
        seconds = time.perf_counter() - began
        stopped = stop_note(result, train_steps, options.time_limit)
        done = stopped or f"trained {plural(result.step, 'step')}"
        progress(f"{name}: {done} ({seconds:.1f} s)")
        trained[name] = (result, seconds)
    ebt, ff = trained["ebt"][0].model, trained["feed_forward"][0].model

    x = jnp.asarray(test)
    keys = jr.split(jr.key(seed + 2), x.shape[0])
    mean_row = jnp.asarray(train.mean(axis=0))

    progress("evaluating on held-out digits")
    metrics: dict[str, Any] = {
        "dataset": "digits (scikit-learn, 8x8), 8 rows of 8 pixels per sequence",
        "task": f"rows {GIVEN_ROWS}-7 completed from rows 0-{GIVEN_ROWS - 1}, one row at a time",
        "seed": seed,
        "train_steps": train_steps,
        "thinking_steps_in_training": thinking_steps,
        "num_test": len(test),
        "models": {},
    }
    for name, (result, seconds) in trained.items():
        losses = np.asarray(result.losses)
        metrics["models"][name] = {
            "num_parameters": num_parameters(result.model),
            "train_steps": int(result.step),
            "stopped_by": stopped_by(result),
            "train_seconds": seconds,
            "final_train_loss": float(np.mean(losses[-25:])) if losses.size else None,
        }
    metrics["models"]["ebt"]["step_size"] = float(ebt.step_size)

    evaluate = eqx.filter_jit(_evaluate_ebt)
    grids = (thinking_grid, candidates)
    ebt_numbers = evaluate(ebt, x, keys, thinking_steps, *grids)
    untrained_numbers = evaluate(ebt0, x, keys, thinking_steps, *grids)
    ff_numbers = eqx.filter_jit(_evaluate_feed_forward)(ff, x)
    ff0_numbers = eqx.filter_jit(_evaluate_feed_forward)(ff0, x)

    def table(kind: str) -> dict[str, Any]:
        curve, verified = ebt_numbers[kind]
        return {
            "ebt": dict(zip(thinking_grid, map(float, curve), strict=True)),
            "ebt_untrained": dict(
                zip(thinking_grid, map(float, untrained_numbers[kind][0]), strict=True)
            ),
            "ebt_verified": dict(zip(candidates, map(float, verified), strict=True)),
            "feed_forward": float(ff_numbers[kind]),
            "feed_forward_untrained": float(ff0_numbers[kind]),
        }

    metrics["next_row_mse"] = dict(
        table("next_row"), mean_row=float(jnp.mean(jnp.square(mean_row[None, 1:] - x[:, 1:])))
    )
    metrics["completion_mse"] = dict(
        table("completion"),
        mean_row=float(jnp.mean(jnp.square(mean_row[None, GIVEN_ROWS:] - x[:, GIVEN_ROWS:]))),
    )
    metrics["flops_per_sequence"] = _flops(ebt, ff, x[0], thinking_steps, thinking_grid)

    plot_thinking(
        {
            "next row, from the true rows above": metrics["next_row_mse"],
            "lower half, completed row by row": metrics["completion_mse"],
        },
        out / "thinking.png",
        trained_steps=thinking_steps,
    )
    shown = x[:8]
    ebt_filled, paths = eqx.filter_jit(jax.vmap(_energy_paths, in_axes=(None, 0, 0, None)))(
        ebt, shown, keys[:8], max(thinking_grid)
    )
    ff_filled = jax.vmap(lambda x: complete(ff, x, GIVEN_ROWS))(shown)
    plot_completions(
        {"held out": shown, "EBT": ebt_filled, "feed-forward": ff_filled},
        paths,
        out / "completions.png",
        given=GIVEN_ROWS,
    )
    write_metrics(out / "metrics.json", metrics)
    return metrics


def _chosen(energy: Any, states: Any, candidates: Any) -> Any:
    """Per position, the state of lowest energy among the first `candidates` of `states`
    `(max_candidates, seq, token_dim)` (self-verification; `candidates` may be traced)."""
    import jax
    import jax.numpy as jnp

    from ..models import lowest_per_position

    energies = jax.vmap(energy.energies)(states)
    energies = jnp.where(jnp.arange(states.shape[0])[:, None] < candidates, energies, jnp.inf)
    return lowest_per_position(states, energies)


def _evaluate_ebt(
    model: Any,
    x: Any,
    keys: Any,
    thinking_steps: int,
    thinking_grid: tuple[int, ...],
    candidates: tuple[int, ...],
) -> dict[str, Any]:
    """The held-out errors of an EBT: after each of `thinking_grid` steps (one candidate) and
    with self-verification over `candidates` at `thinking_steps`, for the next row and for the
    completion. A prediction after `s` steps is step `s` of one longer descent (the same noise
    draws), so each grid is one program: one descent per row and sequence, indexed."""
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    longest, most = max(thinking_grid), max(candidates)

    def descents(x: Any, key: Any, steps: int, candidates: int) -> Any:
        thought = model.think(
            x,
            num_steps=steps,
            key=key,
            num_candidates=candidates,
            return_trajectory=True,
        )
        return thought.trajectory  # (candidates, steps + 1, seq, token_dim)

    def next_rows(x: Any, key: Any) -> tuple[Any, Any]:
        curve = descents(x, key, longest, 1)[0]
        many = descents(x, jr.fold_in(key, 1), thinking_steps, most)[:, -1]
        energy = model.context(x)
        verified = [_chosen(energy, many, n) for n in candidates]
        return curve[jnp.asarray(thinking_grid)], jnp.stack(verified)

    def completed(x: Any, key: Any, step: Any, candidates: Any, steps: int, most: int) -> Any:
        def fill(t: Any, x: Any) -> Any:
            states = descents(x, jr.fold_in(key, t), steps, most)[:, step]
            prediction = _chosen(model.context(x), states, candidates)
            return x.at[t].set(prediction[t - 1].astype(x.dtype))

        return jax.lax.fori_loop(GIVEN_ROWS, x.shape[0], fill, x)

    def completions(x: Any, key: Any) -> tuple[Any, Any]:
        curve = jax.vmap(completed, in_axes=(None, None, 0, None, None, None))(
            x, key, jnp.asarray(thinking_grid), 1, longest, 1
        )
        verified = jax.vmap(completed, in_axes=(None, None, None, 0, None, None))(
            x, jr.fold_in(key, 1), thinking_steps, jnp.asarray(candidates), thinking_steps, most
        )
        return curve, verified

    curve, verified = jax.vmap(next_rows)(x, keys)  # (n, grid, seq, token_dim)
    x_ = x[:, None]
    next_row = (
        jnp.mean(jnp.square(curve[:, :, :-1] - x_[:, :, 1:]), axis=(0, 2, 3)),
        jnp.mean(jnp.square(verified[:, :, :-1] - x_[:, :, 1:]), axis=(0, 2, 3)),
    )
    curve, verified = jax.vmap(completions)(x, keys)
    lower = slice(GIVEN_ROWS, None)
    completion = (
        jnp.mean(jnp.square(curve[:, :, lower] - x_[:, :, lower]), axis=(0, 2, 3)),
        jnp.mean(jnp.square(verified[:, :, lower] - x_[:, :, lower]), axis=(0, 2, 3)),
    )
    return {"next_row": next_row, "completion": completion}


def _evaluate_feed_forward(model: Any, x: Any) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from ..models import complete, next_token_error

    filled = jax.vmap(lambda x: complete(model, x, GIVEN_ROWS))(x)
    return {
        "next_row": next_token_error(jax.vmap(model)(x), x),
        "completion": jnp.mean(jnp.square(filled[:, GIVEN_ROWS:] - x[:, GIVEN_ROWS:])),
    }


def _energy_paths(model: Any, x: Any, key: Any, steps: int) -> tuple[Any, Any]:
    """`complete(model, x, GIVEN_ROWS, ...)` with one candidate, and the energy of each
    generated row at every thinking step, `(rows, steps + 1)`."""
    import jax
    import jax.numpy as jnp
    import jax.random as jr

    def fill(t: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        x, paths = carry
        thought = model.think(
            x,
            num_steps=steps,
            key=jr.fold_in(key, t),
            return_trajectory=True,
        )
        energies = jax.vmap(model.context(x).energies)(thought.trajectory[0])[:, t - 1]
        return (
            x.at[t].set(thought.prediction[t - 1].astype(x.dtype)),
            paths.at[t - GIVEN_ROWS].set(energies.astype(paths.dtype)),
        )

    paths = jnp.zeros((x.shape[0] - GIVEN_ROWS, steps + 1), x.dtype)
    return jax.lax.fori_loop(GIVEN_ROWS, x.shape[0], fill, (x, paths))


def _matmul_flops(fn: Callable, *args: Any) -> float:
    """Floating-point operations of the matrix products of `fn(*args)`, counted in its jaxpr:
    each `dot_general` (2 x output size x contracted size) times the trip counts of the scans
    around it (descent steps, layers); branches count their largest, `while` bodies once."""
    import jax
    import numpy as np

    def walk(jaxpr: Any) -> float:
        total = 0.0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                out = eqn.outvars[0].aval.shape
                total += 2.0 * np.prod(out) * np.prod([lhs[d] for d in contract])
                continue
            inner = [walk(sub) for sub in _sub_jaxprs(eqn.params)]
            if not inner:
                continue
            if name == "cond":
                total += max(inner)
            elif name == "scan":
                total += eqn.params["length"] * sum(inner)
            else:
                total += sum(inner)
        return total

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def _sub_jaxprs(params: dict) -> list[Any]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr
            if hasattr(item, "eqns"):
                found.append(item)
    return found


def _flops(
    ebt: Any, ff: Any, x: Any, thinking_steps: int, grid: tuple[int, ...]
) -> dict[str, float]:
    """Matrix-product flops to predict every next row of one sequence (`_matmul_flops`)."""
    import jax.random as jr

    counts = {"feed_forward": float(_matmul_flops(lambda x: ff(x), x))}
    for steps in sorted({1, thinking_steps, max(grid)}):

        def think(x: Any, steps: int = steps) -> Any:
            return ebt.think(x, num_steps=steps, key=jr.key(0)).prediction

        counts[f"ebt_{steps}_steps"] = float(_matmul_flops(think, x))
    return counts
