"""The `landscape`, `sweep` and `bench` commands and the plots behind them (`ea.viz`)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn import viz
from energyattn._cli import main

matplotlib_image = pytest.importorskip("matplotlib.image")
ROOT = pathlib.Path(__file__).parents[1]


def _check_png(path, min_size=150):
    image = matplotlib_image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    assert min(image.shape[:2]) >= min_size, image.shape
    assert image[..., :3].std() > 0.05  # something was drawn
    return image


def test_landscape_command_end_to_end(tmp_path, capsys):
    """Tiny contour grid; the flatland scenarios at the seed's sizes (16 states, 32 memories)."""
    out = tmp_path / "landscape"
    argv = ["landscape", "--out", str(out), "--max-dim", "64", "--num-dims", "3"]
    assert main([*argv, "--num-scales", "2", "--grid", "16"]) == 0
    printed = capsys.readouterr().out
    # The seed's check is printed once (the audit saw it twice), with both precisions.
    assert printed.count("d_k = 512") == 1 and "in float32 (seed: 5.55e-06)" in printed
    assert (out / "metrics.json").stat().st_size < 20_000  # the grid is in its own file
    metrics = json.loads((out / "metrics.json").read_text())
    scenarios = metrics["scenarios"]
    names = [f"flatland_{name}" for name in scenarios] + ["flatland", "flatland_energies"]
    for name in [*names, "contour"]:
        _check_png(metrics["files"][name])
    assert len(scenarios) == 7 and len(list(out.glob("*.png"))) == 10

    # Every scenario descends: the log-sum-exp energy never rises along the trajectory.
    for name, numbers in scenarios.items():
        energies = np.asarray(numbers["energies"])
        assert energies.shape == (numbers["num_steps"] + 1,)
        assert np.all(np.diff(energies) <= 1e-9 * np.abs(energies[:-1])), name
    # The seed's observations, as numbers:
    # a step of size 0.1 moves patterns a tenth as far as one of size 1;
    cross, small = scenarios["cross_attention"], scenarios["small_steps"]
    assert small["mean_displacement"] == pytest.approx(0.1 * cross["mean_displacement"])
    # many big steps (repeated softmax) make all patterns identical;
    many = scenarios["many_big_steps"]
    assert many["spread_after"] < 0.02 * many["spread_before"]
    # a low beta smooths the landscape: one step already gathers the patterns together;
    assert scenarios["low_beta"]["spread_after"] < 0.25 * cross["spread_after"]
    # a high beta makes stored patterns attractors: states end on them;
    assert scenarios["high_beta"]["distance_to_nearest_memory"] < 0.05
    assert cross["distance_to_nearest_memory"] > 0.2
    # in two dimensions bare self-attention moves the patterns visibly.
    assert scenarios["self_attention"]["mean_displacement"] > 0.1

    contour = metrics["contour"]
    with np.load(metrics["files"]["contour_data"]) as saved:
        norms = saved["float64"]
        assert saved["dims"].tolist() == contour["dims"] == [2, 33, 64]
    assert norms.shape == (2, 3) and contour["range"]["float64"] == [norms.min(), norms.max()]
    # At fixed d_k a larger scale means deeper valleys: patterns move less.
    assert np.all(norms[1] < norms[0])


def test_bare_self_attention_norm_at_512():
    """The seed's ~5.6e-6 at d_k = 512 and the default scale is float32 rounding: one step of
    8 patterns moves them by much less in float64."""
    keys = jr.split(jr.key(3), 5)
    # Each float32 sweep also measures d_k = 2 (its patterns zero-padded to 512): the same
    # compiled program, checked at the end.
    f32_both = np.array(
        [ea.nn.self_attention_displacement([512, 2], [1.0], num_patterns=8, key=k)[0] for k in keys]
    )
    f32 = f32_both[:, 0]
    f64 = [
        ea.nn.self_attention_displacement([512], [1.0], num_patterns=8, key=k, dtype=jnp.float64)[
            0, 0
        ]
        for k in keys
    ]
    assert 2e-6 < np.median(f32) < 2e-5, f32
    assert np.median(f64) < 0.25 * np.median(f32), (f32, f64)
    # In float64 the energy route resolves this tiny step: it agrees with softmax attention
    # written out, and both are of the size the sweep measured.
    x = jr.normal(keys[0], (8, 512), jnp.float64)
    step = ea.descend(ea.HopfieldEnergy(x, beta=512**-0.5), x, step_size=1.0, num_steps=1)
    by_energy = float(jnp.linalg.norm(x - step.value))
    written_out = float(jnp.linalg.norm(x - jax.nn.softmax(x @ x.T / np.sqrt(512)) @ x))
    assert by_energy == pytest.approx(written_out, rel=1e-5)
    assert 0.1 * min(f64) < by_energy < 10 * max(f64)
    # At d_k = 2 the patterns move by order one.
    assert np.all(f32_both[:, 1] > 0.1), f32_both


def test_sweep_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--out", str(out), "--spins", "4", "--dim", "8", "--grid", "16"]
    assert main([*argv, "--betas", "0.05", "0.5", "2"]) == 0
    printed = capsys.readouterr().out
    assert "log Z" in printed and "t* (mean)" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    for name in ("phi", "beta_sweep", "landscape", "couplings"):
        _check_png(metrics["files"][name])
    rows = metrics["sweep"]
    assert [row["beta"] for row in rows] == [0.05, 0.5, 2.0]
    for row in rows:
        assert f"{row['log_partition']:11.4f}" in printed
        assert row["free_energy"] == pytest.approx(-row["log_partition"] / row["beta"])
        assert row["residual"] < 1e-4 and row["t_star_min"] > metrics["largest_coupling_eigenvalue"]
    # High temperature: the entropy term pushes t* up; low temperature: the energy terms win.
    t_stars = [row["t_star_mean"] for row in rows]
    assert t_stars[0] > t_stars[1] > t_stars[2]


def test_bench_command_runs_the_benchmark_entry_point(tmp_path, monkeypatch, capfd):
    out = tmp_path / "bench"
    monkeypatch.chdir(ROOT)  # run from a checkout: ./benchmarks (the wheel does not ship them)
    # The command runs benchmarks/run.py in a subprocess of its own: no second one around it.
    assert main(["bench", "--quick", "--only", "et_recall", "--out", str(out)]) == 0
    printed = capfd.readouterr()
    assert "ratio" in printed.out and "results in" in printed.out, printed.err
    rows = json.loads((out / "et_recall_quick.json").read_text())
    assert rows and all("device" in row and "cpu" in row and row["ratio"] > 0 for row in rows)


def test_bench_command_finds_the_benchmarks(tmp_path, monkeypatch, capsys):
    from energyattn._cli.bench import find_benchmarks

    assert find_benchmarks(str(ROOT / "benchmarks")) == ROOT / "benchmarks"
    monkeypatch.chdir(ROOT)
    assert (find_benchmarks(None) / "run.py").samefile(ROOT / "benchmarks" / "run.py")
    assert main(["bench", "--benchmarks", str(tmp_path / "nowhere"), "--quick"]) == 1
    assert "no benchmarks/run.py found" in capsys.readouterr().err


def test_bench_checks_its_names_before_running_a_script(monkeypatch, capsys):
    """`bench --only foo`: the command's own error, listing the names, and no script run."""
    import subprocess

    def no_script(*args, **kwargs):
        raise AssertionError("a benchmark script ran")

    monkeypatch.setattr(subprocess, "run", no_script)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--benchmarks", str(ROOT / "benchmarks"), "--only", "foo", "et_recall"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "energyattn bench: error: argument --only: unknown benchmark 'foo'; choose from " in err
    assert "et_recall, deq" in err and "run.py" not in err, err


def test_help_documents_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    commands = ("demo", "landscape", "sweep", "bench", "hopfield", "classify", "attractor")
    for command in (*commands, "spin-transformer"):
        assert command in text
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "--out" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["landscape", "--max-dim", "1"], "--max-dim: must be >= 2"),
        (["sweep", "--betas", "1", "-2"], "--betas: must be > 0"),
        (["sweep", "--spins", "1"], "--spins: must be >= 2"),
    ],
)
def test_new_commands_reject_bad_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


# ---------------------------------------------------------------- viz


def test_plot_landscape_and_grid(tmp_path):
    rng = np.random.default_rng(0)  # test data without a random-number program per shape
    memory = jnp.asarray(rng.standard_normal((5, 2)))
    energy = ea.HopfieldEnergy(memory, beta=2.0)
    descent = ea.descend(
        energy,
        jnp.asarray(rng.standard_normal((3, 2))),
        step_size=1.0,
        num_steps=2,
        return_trajectory=True,
    )
    panel = {
        "energy": lambda x: ea.hopfield_energy(x[None], memory, beta=2.0),
        "trajectory": descent.trajectory,
        "memory": memory,
    }
    _check_png(viz.plot_landscape(**panel, path=tmp_path / "one.png", num_points=10))
    panels = {"a": panel, "b": dict(panel, outputs=np.asarray(descent.value)[:, ::-1])}
    image = _check_png(viz.plot_landscapes(panels, tmp_path / "grid.png", num_points=10))
    assert image.shape[1] > 1.5 * image.shape[0]  # two panels side by side


def test_plot_couplings(tmp_path):
    rng = np.random.default_rng(0)
    J = np.asarray(ea.spin.symmetric_couplings(jnp.asarray(rng.standard_normal((6, 6)))))
    _check_png(viz.plot_couplings(J, tmp_path / "scalar.png"))
    blocks = rng.standard_normal((4, 4, 3, 3))  # matrix-valued, like the attractor network's
    grid = np.array([[0, 0], [1, 0], [0, 1], [1, 1]])
    _check_png(viz.plot_couplings(blocks, tmp_path / "blocks.png", positions=grid, threshold=0))


def test_viz_landscape_bad_input(user_mode, tmp_path):
    energy = lambda x: jnp.sum(x**2)  # noqa: E731
    with pytest.raises(ValueError, match=r"trajectory must have shape \(steps \+ 1, seq, 2\)"):
        viz.plot_landscape(energy, np.zeros((3, 2)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="two-dimensional"):
        viz.plot_landscape(energy, np.zeros((2, 3, 3)), tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"outputs must have shape \(3, 2\)"):
        viz.plot_landscape(
            energy, np.zeros((2, 3, 2)), tmp_path / "x.png", outputs=np.zeros((4, 2))
        )
    with pytest.raises(ValueError, match="energy must be a callable"):
        viz.plot_landscape(None, np.zeros((2, 3, 2)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="to a scalar"):
        viz.plot_landscape(lambda x: x, np.ones((2, 3, 2)), tmp_path / "x.png", num_points=4)
    with pytest.raises(ValueError, match="'energy' and 'trajectory'"):
        viz.plot_landscapes({"a": {"energy": energy}}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="J must have shape"):
        viz.plot_couplings(np.zeros((3, 4)), tmp_path / "x.png")
    with pytest.raises(ValueError, match="threshold"):
        viz.plot_couplings(np.zeros((3, 3)), tmp_path / "x.png", threshold=1.0)
    with pytest.raises(ValueError, match="dims must be"):
        ea.nn.self_attention_displacement([0, 4], [1.0], key=jr.key(0))
    with pytest.raises(ValueError, match="scales must be"):
        ea.nn.self_attention_displacement([4], [-1.0], key=jr.key(0))
    with pytest.raises(ValueError, match=r"norms\['a'\] must have shape"):
        viz.plot_displacement_contour([2, 4], [1.0], {"a": np.ones((2, 2))}, tmp_path / "x.png")
