"""The `energyattn` command, its demos and the plots they write (`energyattn.viz`)."""

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import energyattn as ea
from energyattn import viz
from energyattn._cli import main
from energyattn._cli.demo import run_demo
from energyattn._cli.hopfield import run_hopfield_demo

matplotlib_image = pytest.importorskip("matplotlib.image")

# Tiny settings of the Hopfield demo: 10 digits (one per class), 2 probes each, a couple of steps.
TINY = ["--patterns", "10", "--probes", "2", "--steps", "2", "--sweeps", "2"]
MODELS = ("corrupted", "classical", "modern")


def _check_outputs(out_dir, num_patterns=10):
    for name in ("retrieval.png", "energies.png"):
        image = matplotlib_image.imread(out_dir / name)
        assert image.ndim == 3 and image.shape[2] in (3, 4)
        assert 150 <= image.shape[0] <= 1500 and 300 <= image.shape[1] <= 2000, image.shape
        assert image.std() > 0.05  # not blank
    metrics = json.loads((out_dir / "metrics.json").read_text())
    keys = ("num_patterns", "load", "corruption", "num_probes", "criterion", "results", "files")
    assert set(keys) <= set(metrics)
    assert metrics["num_patterns"] == num_patterns
    for model in MODELS:
        scores = metrics["results"][model]
        for score in ("accuracy", "pixel_agreement", "on_stored_pattern"):
            assert 0.0 <= scores[score] <= 1.0
    assert len(metrics["results"]["classical"]["mean_energy"]) == metrics["num_sweeps"] + 1
    assert len(metrics["results"]["modern"]["mean_energy"]) == metrics["num_steps"] + 1
    return metrics


def _check_printed(text):
    assert "retrieval accuracy" in text and "classical Hopfield" in text
    assert "modern Hopfield" in text
    assert "criterion:" in text and "pixel agreement" in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), "a line is printed twice"


def test_hopfield_demo_as_module(tmp_path):
    # As users run it, in a fresh interpreter: `python -m energyattn hopfield` (one run for
    # every check of the command, since a fresh interpreter compiles everything again).
    out = tmp_path / "new" / "folder"  # created by the demo
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "energyattn", "hopfield", "--out", str(out), *TINY]
        + ["--corruption", "0.1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    _check_printed(printed)
    metrics = _check_outputs(out)
    assert metrics["corruption"] == 0.1 and metrics["flipped_pixels"] == 6
    # Ten well-separated digits and 6 flipped pixels: the modern network retrieves them.
    assert metrics["results"]["modern"]["accuracy"] >= 0.8
    assert metrics["results"]["corrupted"]["accuracy"] == 0.0  # 90% < 95% agreement
    assert f"{metrics['results']['modern']['accuracy']:.3f}" in printed


def test_run_hopfield_demo_returns_metrics(tmp_path):
    lines = []
    metrics = run_hopfield_demo(
        tmp_path,
        num_patterns=3,
        probes_per_pattern=1,
        num_steps=1,
        num_sweeps=1,
        num_examples=2,
        progress=lines.append,
    )
    assert lines and metrics["num_probes"] == 3
    assert json.loads((tmp_path / "metrics.json").read_text())["results"] == metrics["results"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_patterns": 0}, "num_patterns"),
        ({"num_patterns": 100_000}, "num_patterns"),
        ({"corruption": 1.5}, "corruption"),
        ({"beta": 0.0}, "beta"),
        ({"num_steps": -1}, "num_steps"),
    ],
)
def test_run_hopfield_demo_bad_input(user_mode, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_hopfield_demo(tmp_path, **kwargs)


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "demo" in text and "hopfield" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["hopfield", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--out",
        "--patterns",
        "--corruption",
        "--probes",
        "--steps",
        "--sweeps",
        "--beta",
        "--seed",
    ):
        assert option in text
    assert "95%" in text  # the retrieval criterion is documented
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--out",
        "--train-steps",
        "--time-limit",
        "--masked",
        "--batch-size",
        "--learning-rate",
        "--seed",
        "--no-progress",
    ):
        assert option in text
    assert "mean-patch baseline" in text


def test_demo_trains_evaluates_and_draws(tmp_path, capsys, monkeypatch):
    """The demo, stopped by Ctrl-C during its second training step (of 3): it saves what it
    trained, evaluated and drawn, says so in one line, and exits with 130."""
    from energyattn._cli import interrupt

    real_step_done = interrupt.step_done

    def ctrl_c_in_the_second_step():
        done = real_step_done()
        monkeypatch.setattr(interrupt, "_stop", True)  # what a Ctrl-C in the next step sets
        return done

    monkeypatch.setattr(interrupt, "step_done", ctrl_c_in_the_second_step)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--train-steps", "3", "--batch-size", "8", "--no-progress"]
    assert main(argv) == 130
    printed, err = capsys.readouterr()
    kept = "energies.png, inpainting.png, metrics.json, model.npz"
    assert err == (
        f"energyattn demo: interrupted: stopped after 2 of 3 steps: Ctrl-C; kept {kept} in "
        f"{out}; no training checkpoint is kept, so a new run starts over\n"
    )
    assert "test masked-patch MSE (Energy Transformer):" in printed
    assert "test masked-patch MSE (mean-patch baseline):" in printed
    for name in ("inpainting.png", "energies.png"):
        image = matplotlib_image.imread(out / name)
        assert image.ndim == 3 and image.std() > 0.05
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps_done"] == 2 and metrics["num_masked"] == 4
    assert metrics["stopped_by"] == "Ctrl-C" and "stopped after 2 of 3 steps: Ctrl-C" in printed
    assert metrics["compile_seconds"] > 0 and metrics["train_seconds"] > 0
    lines = [line for line in printed.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), "a line is printed twice"
    assert not list(out.glob(".*partial*")), "a temporary file was left behind"
    test = metrics["test"]
    assert test["baseline_mse"] > 0 and test["ratio"] == pytest.approx(
        test["mse"] / test["baseline_mse"]
    )
    assert f"{test['mse']:.4f}" in printed and f"{test['baseline_mse']:.4f}" in printed
    assert len(metrics["recall_energies"]) == 13
    # The model reloads with no shapes or settings to repeat.
    reloaded = ea.models.load_image_et(out / "model.npz")
    assert reloaded.image_shape == (1, 8, 8) and reloaded.patch_size == 2
    assert not reloaded.transformer.include_self and reloaded.transformer.num_steps == 12


def test_the_demo_warns_when_its_time_limit_stops_the_training():
    from energyattn._cli.demo import time_limit_warning

    metrics = {
        "stopped_by": "time limit",
        "time_limit": 300.0,
        "train_steps_done": 1200,
        "train_steps_planned": 2500,
        "train_seconds": 300.4,
    }
    assert time_limit_warning(metrics) == (
        "energyattn demo: WARNING: the 300 s time limit stopped the training after 1200 of "
        "2500 steps (0.250 s per step on this host): the MSE below is not the demo's reference "
        "result. Raise --time-limit to train every step."
    )
    for other in (None, "Ctrl-C"):
        assert time_limit_warning({**metrics, "stopped_by": other}) is None


def test_run_demo_bad_input(user_mode, tmp_path):
    with pytest.raises(ValueError, match="masked_fraction"):
        run_demo(tmp_path, masked_fraction=1.0)
    with pytest.raises(ValueError, match="hides 0 of 16 patches"):
        run_demo(tmp_path, masked_fraction=0.01)


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "required"),
        (["fly"], "invalid choice"),
        (["hopfield", "--patterns", "-3"], "--patterns: must be >= 1"),
        (["hopfield", "--patterns", "ten"], "--patterns: expected an integer"),
        (["hopfield", "--corruption", "1.5"], "--corruption: must be in"),
        (["hopfield", "--beta", "0"], "--beta: must be > 0"),
        (["hopfield", "--steps", "-1"], "--steps: must be >= 0"),
        (["hopfield", "--patterns", "100000"], "num_patterns must be in"),
        (["demo", "--masked", "1.5"], "--masked: must be in (0, 1)"),
        (["demo", "--time-limit", "0"], "--time-limit: must be > 0"),
        (["demo", "--masked", "0.01"], "hides 0 of 16 patches"),
        # Not a number a run can use: a line naming the flag, not a traceback from inside.
        (["demo", "--learning-rate", "inf"], "--learning-rate: must be finite, got inf"),
        (["ham", "--learning-rate", "inf"], "--learning-rate: must be finite, got inf"),
        (["demo", "--time-limit", "inf"], "--time-limit: must be finite, got inf"),
        (["ham", "--step-size", "1e400"], "--step-size: must be finite, got inf"),
        (["hopfield", "--beta", "nan"], "--beta: must be > 0, got nan"),
    ],
)
def test_bad_arguments_exit_cleanly(tmp_path, capsys, argv, match):
    with_out = argv[:1] in (["demo"], ["hopfield"], ["ham"])
    argv = [*argv, "--out", str(tmp_path)] if with_out else argv
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


COMMANDS = ("demo", "hopfield", "classify", "spin-transformer", "ebt", "attractor", "ham")
COMMANDS += ("landscape", "sweep", "bench")


def _subparsers():
    import argparse

    from energyattn._cli.app import parser

    top = parser()
    (action,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_help_shows_each_default_once_and_no_escaped_percent(capsys):
    subparsers = _subparsers()
    assert set(subparsers) == set(COMMANDS)
    for name, sub in subparsers.items():
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert "%%" not in text, name
        assert f"(default:energyattn-out/{name})" in "".join(text.split()), name
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0:  # --help and on/off flags
                continue
            shown = formatter._expand_help(action) if action.help else ""
            assert shown.count("default") == 1, (name, action.option_strings, shown)


@pytest.mark.parametrize("command", ["demo", "classify", "attractor", "ham"])
def test_bad_output_folder_fails_at_once(tmp_path, capsys, monkeypatch, command):
    """Before any data, compilation or training: one line naming the path, status 1."""

    def no_data(*args, **kwargs):
        raise AssertionError("the data were loaded before the output folder was checked")

    monkeypatch.setattr(ea.data, "load_digits", no_data)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out in (a_file, a_file / "below", pathlib.Path("/proc/energyattn-out")):
        assert main([command, "--out", str(out), "--train-steps", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"energyattn {command}: error: ") and str(out) in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert a_file.read_text() == ""


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a command: no traceback through JAX and Equinox, but one line saying
    after which progress line it stopped and which outputs it had written; status 130."""
    from energyattn._cli import ebt
    from energyattn._cli.common import check_out, say, write_metrics

    def interrupted_run(out, *, write, **kwargs):
        say("ebt: 26146 parameters; training 600 steps")
        if write:
            write_metrics(check_out(out) / "metrics.json", {})
        raise KeyboardInterrupt

    out = tmp_path / "ebt"
    out.mkdir()
    (out / "thinking.png").write_bytes(b"from an earlier run")  # not written by this one
    for write in (False, True):
        monkeypatch.setattr(ebt, "run_ebt_demo", functools.partial(interrupted_run, write=write))
        assert main(["ebt", "--out", str(out)]) == 130
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("energyattn ebt: interrupted after 'ebt: 26146 parameters; "), err
        kept = f"kept metrics.json in {out};" if write else f"wrote nothing to {out};"
        assert kept in err and "no training checkpoint is kept" in err, err


# Each command, with what it writes into --out (bench: the benchmark it is asked to run).
EARLIER = {command: "metrics.json" for command in COMMANDS}
EARLIER["bench"] = "et_recall_quick.json"
# The commands that read the digits first: a missing scikit-learn stops them early.
READ_DIGITS = ("demo", "hopfield", "classify", "spin-transformer", "ebt", "attractor", "ham")


@pytest.mark.parametrize("command", COMMANDS)
def test_an_earlier_run_is_replaced_only_with_overwrite(tmp_path, capsys, monkeypatch, command):
    """A run into a folder holding an earlier run's files refuses at once, naming
    --overwrite (status 1); with --overwrite it goes on. A run that fails before its work
    starts (here: no scikit-learn) leaves no folder behind."""

    def no_scikit_learn(*args, **kwargs):
        raise ImportError("load_digits needs scikit-learn (test)")

    monkeypatch.setattr(ea.data, "load_digits", no_scikit_learn)
    monkeypatch.chdir(pathlib.Path(__file__).parents[1])  # bench: ./benchmarks
    extra = ["--quick", "--only", "et_recall"] if command == "bench" else []
    out = tmp_path / "out"
    out.mkdir()
    earlier = out / EARLIER[command]
    earlier.write_text("an earlier run")
    assert main([command, "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"energyattn {command}: error: {str(out)!r} holds an earlier run's "), err
    assert EARLIER[command] in err and "pass --overwrite" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert earlier.read_text() == "an earlier run"
    if command in READ_DIGITS:
        # --overwrite passes the check; the run then stops early, and replaced nothing.
        assert main([command, "--out", str(out), "--overwrite", *extra]) == 1
        assert "needs scikit-learn (test)" in capsys.readouterr().err
        assert earlier.read_text() == "an earlier run"
        # A new folder is made only when the work starts.
        new = tmp_path / "new" / "folder"
        assert main([command, "--out", str(new)]) == 1
        assert "needs scikit-learn (test)" in capsys.readouterr().err
        assert not (tmp_path / "new").exists()


def test_metrics_json_is_strict_json(tmp_path):
    """No NaN or Infinity (which Python's json writes and strict readers refuse): null."""
    from energyattn._cli.common import write_metrics

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    metrics = {"limit": float("inf"), "losses": [float("nan"), 1.5], "nested": {"a": (2, -1e999)}}
    write_metrics(tmp_path / "metrics.json", metrics)
    read = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=refuse)
    assert read == {"limit": None, "losses": [None, 1.5], "nested": {"a": [2, None]}}


# ---------------------------------------------------------------- Ctrl-C in a process of its own


def _ctrl_c_blocked(pid):
    """Whether the process `pid` has SIGINT blocked: energyattn's handling has started."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return bool(int(status.split("SigBlk:")[1].split()[0], 16) & (1 << (signal.SIGINT - 1)))


def _jax_loaded(pid):
    return "libjax" in pathlib.Path(f"/proc/{pid}/maps").read_text()


needs_proc = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the signal mask in /proc"
)


@needs_proc
def test_ctrl_c_while_starting_exits_130_with_one_line(tmp_path):
    """`python -m energyattn demo` stopped by Ctrl-C as soon as it handles it (while it
    imports JAX, with energyattn's first import in place): status 130 and one line, no
    traceback, no crash, no folder."""
    out = tmp_path / "demo"
    process = subprocess.Popen(
        [sys.executable, "-m", "energyattn", "demo", "--out", str(out), "--train-steps", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )
    try:
        while not _ctrl_c_blocked(process.pid):
            assert process.poll() is None, process.communicate()
            time.sleep(0.002)
        during_import = not _jax_loaded(process.pid)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("energyattn"), stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists()
    if not during_import:  # (checked above all the same, after the import)
        pytest.skip("the import ended before the signal was sent: not the import-time path")


# A training loop as the commands run it, without JAX (fast): the interrupt module loaded
# from its file, steps of 10 ms, or a step that never ends (argv[1] == "long").
FAKE_TRAINING = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("interrupt", sys.argv[2])
interrupt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupt)
interrupt.install()
interrupt.describe(lambda: "energyattn fake: interrupted")
if sys.argv[1] == "compiling":
    print("compiling", flush=True)
    time.sleep(60)
with interrupt.training():
    for step in range(1, 100_000):
        time.sleep(60 if sys.argv[1] == "long" and step == 2 else 0.01)
        if interrupt.step_done():
            break
        if step == 1:
            print("training", flush=True)
print(f"stopped after step {step}; saving", flush=True)
try:
    with interrupt.training():  # a second model: not trained after a Ctrl-C
        print("trained another model", flush=True)
except KeyboardInterrupt:
    pass
if interrupt.stop_requested():
    interrupt.report()
    sys.exit(interrupt.STATUS)
"""


@needs_proc
@pytest.mark.parametrize("case", ["step", "long", "compiling"])
def test_ctrl_c_stops_training_after_a_step_and_twice_at_once(case):
    """Between training steps the first Ctrl-C stops the run after the step (it says so;
    the command then saves what it has, trains no other model and prints its line); a
    second one, or one outside the steps (compilation), ends the process at once, with one
    line and status 130."""
    from energyattn._cli import interrupt

    process = subprocess.Popen(
        [sys.executable, "-c", FAKE_TRAINING, case, interrupt.__file__],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() in ("training\n", "compiling\n")
        process.send_signal(signal.SIGINT)
        if case == "long":  # inside a step that does not end: a second Ctrl-C
            time.sleep(0.2)
            assert process.poll() is None
            process.send_signal(signal.SIGINT)
        # A hang is a failure: `communicate` raises `TimeoutExpired` past 10 s.
        stdout, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 130
    stopping = "energyattn: Ctrl-C: stopping after this training step, then saving what was "
    stopping += "trained (Ctrl-C again to quit at once)\n"
    assert stderr == (stopping if case != "compiling" else "") + "energyattn fake: interrupted\n"
    assert ("stopped after step" in stdout) == (case == "step"), stdout
    assert "trained another model" not in stdout


def test_stop_note():
    from energyattn._cli.common import stop_note, stopped_by

    def result(step, stopped):
        return types.SimpleNamespace(step=step, stopped_by=stopped)

    note = "stopped after 412 of 1000 steps: 300 s time limit"
    assert stop_note(result(412, "time_limit"), 1000, 300.0) == note
    assert stop_note(result(3, "callback"), 1000, 300.0) == "stopped after 3 of 1000 steps: Ctrl-C"
    assert stop_note(result(1000, None), 1000, 300.0) is None
    assert [stopped_by(result(1, why)) for why in ("time_limit", "callback", None)] == [
        "time limit",
        "Ctrl-C",
        None,
    ]


# ---------------------------------------------------------------- viz


def test_image_grid_and_plot_energies(tmp_path):
    rows = {"a": np.zeros((3, 8, 8)), "b": np.random.default_rng(0).random((2, 5, 4))}
    path = viz.image_grid(rows, tmp_path / "grid.png", title="grid")
    assert path == tmp_path / "grid.png"
    assert matplotlib_image.imread(path).ndim == 3
    curves = {"one": np.linspace(1.0, 0.0, 5), "two": np.array([3.0, 1.0])}
    for separate in (False, True):
        path = tmp_path / f"energies-{separate}.png"
        assert viz.plot_energies(curves, path, separate=separate, title="t") == path
        image = matplotlib_image.imread(path)
        assert image.shape[1] > image.shape[0]


def test_viz_bad_input(tmp_path):
    message = r"rows\['x'\] must have shape \(n, height, width\), got \(8, 8\)"
    with pytest.raises(ValueError, match=message):
        viz.image_grid({"x": np.zeros((8, 8))}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="non-empty dict"):
        viz.image_grid({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"curves\['c'\] must have shape \(steps\)"):
        viz.plot_energies({"c": np.zeros((2, 3))}, tmp_path / "x.png")


def test_image_grid_draws_nan_pixels_in_a_colour(tmp_path):
    image = np.zeros((1, 4, 4))
    image[0, :2, :2] = np.nan  # a hidden patch
    path = viz.image_grid({"masked": image}, tmp_path / "m.png", vmin=0.0, vmax=1.0)
    pixels = matplotlib_image.imread(path)[..., :3]
    reddish = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)
    assert reddish.any()  # the hidden patch is red, not black on black
    assert not list(tmp_path.glob(".*partial*"))


def test_plot_couplings_draws_only_the_strongest_edges(tmp_path):
    J = np.zeros((6, 6))
    J[0, 1] = J[1, 0] = 1.0  # one strong pair among weak ones
    J[2:, 2:] = 0.01
    np.fill_diagonal(J, 0.0)
    path = viz.plot_couplings(J, tmp_path / "c.png", threshold=0.0, top_k=1)
    assert matplotlib_image.imread(path).ndim == 3
    with pytest.raises(ValueError, match="top_k"):
        viz.plot_couplings(J, tmp_path / "c.png", top_k=0)


def test_viz_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        viz.plot_energies({"c": np.zeros(3)}, tmp_path / "x.png")


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"bench"}))
def test_an_output_file_that_cannot_be_written_fails_before_any_work(
    tmp_path, capsys, monkeypatch, command
):
    """A folder where the command will write metrics.json: one line naming that path, before
    any data are loaded (it used to fail after the whole run). An empty --out is an error."""

    def no_data(*args, **kwargs):
        raise AssertionError("the data were loaded before the outputs were checked")

    monkeypatch.setattr(ea.data, "load_digits", no_data)
    (tmp_path / "metrics.json").mkdir()
    assert main([command, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"energyattn {command}: error: "), err
    assert str(tmp_path / "metrics.json") in err and "is a folder" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(SystemExit):
        main([command, "--out", ""])
    assert "--out must name a folder" in capsys.readouterr().err
