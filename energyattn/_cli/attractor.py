"""`energyattn attractor`: self-attention as an attractor network on shipped digits, against
its own untrained initialisation, a trivial baseline and the paper's backpropagation-trained
baselines."""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array

from ..models import TrainOptions
from . import interrupt
from .common import (
    add_command,
    add_shared_flags,
    check_out,
    int_at_least,
    make_out,
    plural,
    run,
    say,
    training_options,
    write_metrics,
)

TASKS = ("masked", "denoise")
#: A task, as `ea.models.train_reconstruction` takes it (the models are imported lazily).
Task = Literal["masked", "denoise"]


def add_parser(commands: Any) -> None:
    parser = add_command(
        commands,
        "attractor",
        help="self-attention as an attractor network: transient memories on shipped digits",
        description=(
            "Train bare self-attention as an attractor network by pseudo-likelihood on clean "
            "digits (no backpropagation through the dynamics, one model for both tasks), and "
            "the paper's baselines by backpropagation, per task: one transformer block "
            "iterated 3..7 times and a 5-layer ViT. Measures the held-out MSE against the "
            "iteration t for masked prediction (30% of patches zeroed) and denoising "
            "(Gaussian noise of variance 0.7, rescaled). Writes metrics.json, "
            "mse_vs_iteration.png, reconstructions_<task>.png and couplings.png (the strongest "
            "learnt couplings between patches, as a graph on the patch grid) into --out."
        ),
    )
    parser.add_argument(
        "--baseline-steps",
        type=int_at_least(1),
        default=1500,
        metavar="N",
        help="backpropagation steps of each baseline (batches of 64)",
    )
    parser.add_argument(
        "--iterations",
        type=int_at_least(1),
        default=30,
        metavar="T",
        help="iterations of the recurrent models at evaluation",
    )
    parser.add_argument(
        "--patch-size", type=int, choices=(2, 4), default=2, help="side of the square patches"
    )
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="the tasks to evaluate"
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="train and evaluate the attractor only"
    )
    add_shared_flags(
        parser,
        train_steps=(1000, "pseudo-likelihood steps of the attractor network (batches of 32)"),
        seed="seed of weights, batches and noise",
        progress="the progress bars",
    )
    parser.set_defaults(run=lambda args: main(args, parser))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`energyattn attractor`: `run_attractor_demo`, which checks `--out` before any work and
    prints each curve's summary."""
    print(f"energyattn attractor: tasks {', '.join(args.tasks)}, seed {args.seed}")
    metrics = run(
        "attractor",
        parser,
        run_attractor_demo,
        args.out,
        overwrite=args.overwrite,
        train_steps=args.train_steps,
        baseline_steps=args.baseline_steps,
        num_iterations=args.iterations,
        patch_size=args.patch_size,
        tasks=tuple(args.tasks),
        baselines=not args.no_baselines,
        seed=args.seed,
        options=training_options(args),
        progress=say,
    )
    if metrics is None:
        return 1
    print(f"files in {Path(args.out)}")
    return 0


TASK_TITLES = {"masked": "masked prediction (30% of patches)", "denoise": "denoising (var 0.7)"}
TRAINED = "bare self-attention (attractor)"
UNTRAINED = "bare self-attention (untrained)"
# The trivial baseline of each task: no model, only the mean training image.
TRIVIAL = {"masked": "mean training patch (trivial)", "denoise": "mean training image (trivial)"}


class _MeanImage(eqx.Module):
    """The trivial reconstruction: masked patches filled with the mean training pixels at
    their position (the rest of the input kept), or, with `replace_all`, the mean training
    image whatever the input (denoising). Constant in $t$; follows the `Reconstructor`
    protocol of `reconstruction_curves`, so it sees the same corruptions as the models."""

    mean: Array
    patch_size: int = eqx.field(static=True)
    replace_all: bool = eqx.field(static=True)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.mean.shape)  # type: ignore[return-value]

    def reconstruct(self, corrupted: Array, patch_mask: Array, num_steps: int) -> Array:
        from ..data import patchify, unpatchify

        mean = self.mean.astype(corrupted.dtype)
        if self.replace_all:
            prediction = mean
        else:
            masked = jnp.broadcast_to(
                patch_mask[:, None], patchify(corrupted, self.patch_size).shape
            )
            masked = unpatchify(masked, corrupted.shape, self.patch_size)
            prediction = jnp.where(masked, mean, corrupted)
        return jnp.concatenate(
            [corrupted[None], jnp.broadcast_to(prediction, (num_steps, *corrupted.shape))]
        )


def _summary(curve: np.ndarray, iterated: bool = True) -> dict[str, Any]:
    """Where a curve of errors over t = 0..T is lowest (t >= 1), and how it ends. A model that
    is not iterated (T = 1: the ViT, the trivial baseline) has no `best_t`."""
    best = int(np.argmin(curve[1:])) + 1
    summary = {
        "t0": float(curve[0]),
        "best_t": best,
        "best": float(curve[best]),
        "final": float(curve[-1]),
        "curve": [float(v) for v in curve],
    }
    if not iterated:
        del summary["best_t"]
    return summary


def _errors(summary: dict[str, Any], steps: int) -> str:
    """A summary's errors in words: along t for an iterated model; a model that is not
    iterated (the ViT, the trivial baseline) has one output, next to the corrupted input."""
    if steps == 1:
        return f"{summary['final']:.4f} (corrupted input {summary['t0']:.4f})"
    return (
        f"{summary['t0']:.4f} at t=0, best {summary['best']:.4f} at t={summary['best_t']}, "
        f"{summary['final']:.4f} at t={steps}"
    )


def _percent_below(value: float, reference: float) -> float:
    """How far `value` is below `reference`, in percent of `reference` (negative: above)."""
    return 100.0 * (1.0 - value / reference)


def _relative(percent_below: float) -> str:
    return f"{abs(percent_below):.0f}% {'below' if percent_below >= 0 else 'above'}"


def _controls(task: str, task_metrics: dict[str, Any]) -> dict[str, Any]:
    """The trained attractor's best error against its untrained initialisation and the trivial
    baseline, on each measure (the masked task: whole image and masked patches only)."""
    measures = {"image": lambda summary: summary}
    if task == "masked":
        measures["masked_region"] = lambda summary: summary["masked_region"]
    controls: dict[str, Any] = {}
    for measure, pick in measures.items():
        trained = pick(task_metrics[TRAINED])
        untrained = pick(task_metrics[UNTRAINED])["best"]
        trivial = pick(task_metrics[TRIVIAL[task]])["best"]
        curve = np.asarray(trained["curve"])
        controls[measure] = {
            "trained_best": trained["best"],
            "untrained_best": untrained,
            "trivial": trivial,
            "percent_below_untrained": _percent_below(trained["best"], untrained),
            "percent_below_trivial": _percent_below(trained["best"], trivial),
            # A transient memory: the error falls below the corrupted input, then rises again.
            "transient": bool(
                trained["best"] < curve[0] and curve[-1] > trained["best"] * (1 + 1e-3)
            ),
        }
    return controls


def run_attractor_demo(
    out: str | Path,
    *,
    train_steps: int = 1000,
    baseline_steps: int = 1500,
    num_iterations: int = 30,
    patch_size: int = 2,
    tasks: tuple[str, ...] = ("masked", "denoise"),
    baselines: bool = True,
    seed: int = 0,
    options: TrainOptions = TrainOptions(),
    progress: Callable[[str], None] = print,
    overwrite: bool = False,
) -> dict[str, Any]:
    r"""Train the attractor network (pseudo-likelihood, task-agnostic) and, per task, the
    recycled transformer block and the 5-layer vision transformer (backpropagation); measure
    the test MSE against the iteration $t$ for both tasks, next to two controls of the same
    run: the attractor network at its initialisation (the same model before training,
    `"bare self-attention (untrained)"`) and a trivial baseline that uses no model (masked
    prediction: each masked patch filled with the mean training patch at its position;
    denoising: the mean training image).

    Writes `metrics.json`, `mse_vs_iteration.png`, `reconstructions_<task>.png` and
    `couplings.png` into `out` (checked before any work, created when training starts; the
    files of an earlier run there are replaced only with `overwrite`).
    `tasks` picks the tasks, `baselines=False` skips the backpropagation baselines (the
    attractor network and the controls alone take seconds; each baseline minutes on a CPU
    core). `options` are every model's [`TrainOptions`][energyattn.models.TrainOptions]
    (each trainer's learning rate unless they set one).

    **Returns:**

    The metrics: per task and model the curve over $t = 0..T$ (whole-image MSE; for masked
    prediction also `"masked_region"`, the MSE over the masked patches only), its minimum
    over $t \ge 1$ and, for the iterated models, where it is (`best_t`); and under
    `"controls"`, per task and measure, the trained attractor's best error against the
    untrained one and the trivial baseline.
    """
    from .. import viz
    from ..data import load_digits
    from ..models import (
        AttractorImageModel,
        PatchTransformer,
        reconstruction_curves,
        train_attractor,
        train_reconstruction,
    )

    tasks = tuple(tasks)
    if not tasks or any(task not in TASK_TITLES for task in tasks):
        raise ValueError(f"tasks must be a non-empty subset of {tuple(TASK_TITLES)}, got {tasks}")
    figures = [f"reconstructions_{task}.png" for task in tasks]
    names = ("couplings.png", "mse_vs_iteration.png", "metrics.json", *figures)
    out = check_out(out, *names, overwrite=overwrite)  # before any data or compilation
    train = np.asarray(load_digits("train").images, np.float32)[:, None]
    test = np.asarray(load_digits("test").images, np.float32)[:, None]
    eval_key = jr.PRNGKey(seed + 100)
    progress(f"digits (scikit-learn, 8x8): {len(train)} train / {len(test)} test images")
    metrics: dict[str, Any] = {"patch_size": patch_size, "seed": seed, "tasks": {}}

    began = time.perf_counter()
    untrained = AttractorImageModel(
        patch_size=patch_size, num_steps=num_iterations, key=jr.PRNGKey(seed), dtype=jnp.float32
    )
    make_out(out)
    with interrupt.training():
        result = train_attractor(
            untrained, train, key=jr.PRNGKey(seed + 1), train_steps=train_steps, options=options
        )
    attractor = result.model
    metrics["attractor_train_seconds"] = time.perf_counter() - began
    metrics["attractor_train_steps"] = result.step
    progress(
        f"attractor network: {result.step} pseudo-likelihood steps in "
        f"{metrics['attractor_train_seconds']:.1f} s (final loss {float(result.losses[-1]):.3f})"
    )

    # The learnt couplings J_ij (d x d blocks) as a graph on the patch grid: each patch at its
    # place in the image, edges as strong as ||J_ij||_F.
    side = train.shape[-1] // patch_size
    grid = np.stack(np.divmod(np.arange(side * side), side), axis=1)
    viz.plot_couplings(
        attractor.attention.couplings,
        out / "couplings.png",
        positions=np.stack([grid[:, 1], -grid[:, 0]], axis=1),
        threshold=0.9,  # the couplings have a fixed overall norm: show the strongest pairs
        title="learnt couplings between patches (pseudo-likelihood)",
    )

    mean_image = jnp.asarray(train.mean(axis=0))
    curves: dict[str, dict[str, np.ndarray]] = {}
    examples: dict[str, dict[str, np.ndarray]] = {}
    metrics["controls"] = {}
    for task in cast(tuple[Task, ...], tasks):  # checked above
        task_metrics: dict[str, Any] = {}
        # name -> (model, iterations); iterations 1: a model that is not iterated.
        models: dict[str, tuple[Any, int]] = {
            TRAINED: (attractor, num_iterations),
            UNTRAINED: (untrained, num_iterations),
            TRIVIAL[task]: (_MeanImage(mean_image, patch_size, task == "denoise"), 1),
        }
        baseline_specs = (
            ("recycled transformer block", 1, 3, 7),
            ("5-layer ViT", 5, 1, 1),
        )
        for name, depth, low, high in baseline_specs if baselines else ():
            began = time.perf_counter()
            baseline = PatchTransformer(
                patch_size=patch_size, depth=depth, key=jr.PRNGKey(seed + 2)
            )
            with interrupt.training():
                trained = train_reconstruction(
                    baseline,
                    train,
                    task=task,
                    key=jr.PRNGKey(seed + 3),
                    train_steps=baseline_steps,
                    min_iterations=low,
                    max_iterations=high,
                    options=options,
                ).model
            seconds = time.perf_counter() - began
            progress(
                f"{task}: {name} trained ({plural(baseline_steps, 'step')}) in {seconds:.1f} s"
            )
            models[name] = (trained, num_iterations if depth == 1 else 1)
        panel: dict[str, np.ndarray] = {}
        rows: dict[str, np.ndarray] = {}
        for name, (model, steps) in models.items():
            result_curves = reconstruction_curves(
                model, test, task=task, key=eval_key, num_steps=steps
            )
            curve = result_curves["mse"]
            summary = _summary(curve, steps > 1)
            if task == "masked":
                summary["masked_region"] = _summary(result_curves["masked_mse"], steps > 1)
            task_metrics[name] = summary
            # t = 0 is the corrupted input; the ViT and the trivial baseline are not iterated:
            # horizontal lines.
            panel[name] = curve if steps > 1 else curve[1:2]
            states = result_curves["examples"]  # (8, T+1, c, h, w)
            rows.setdefault("clean", test[:8, 0])
            rows.setdefault("corrupted", states[:, 0, 0])
            if steps > 1:
                rows[f"{name} (t={summary['best_t']})"] = states[:, summary["best_t"], 0]
                if name != UNTRAINED:
                    rows[f"{name} (t={steps})"] = states[:, -1, 0]
            else:
                rows[name] = states[:, 1, 0]
            line = f"{task}: {name}: MSE {_errors(summary, steps)}"
            if task == "masked":
                line += f"; masked patches {_errors(summary['masked_region'], steps)}"
            progress(line)
        metrics["tasks"][task] = task_metrics
        metrics["controls"][task] = _controls(task, task_metrics)
        for measure, control in metrics["controls"][task].items():
            progress(
                f"{task} ({measure.replace('_', ' ')}): trained attractor best "
                f"{control['trained_best']:.4f}, "
                f"{_relative(control['percent_below_untrained'])} untrained "
                f"({control['untrained_best']:.4f}), "
                f"{_relative(control['percent_below_trivial'])} the trivial baseline "
                f"({control['trivial']:.4f})"
            )
        curves[task] = panel
        examples[task] = rows
        viz.image_grid(
            rows, out / f"reconstructions_{task}.png", title=TASK_TITLES[task], vmin=0.0, vmax=1.0
        )
    viz.plot_curves(
        {TASK_TITLES[task]: curves[task] for task in curves},
        out / "mse_vs_iteration.png",
        title="test MSE against iteration (digits, held out)",
    )
    write_metrics(out / "metrics.json", metrics)
    return metrics
