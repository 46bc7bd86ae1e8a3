"""AFEM vector-spin saddle point: the cost of t*, log Z value+grad and a training step.

Question: what does the safeguarded Newton solve (and what is built on it) cost, as a multiple
of one N x N Cholesky factorisation (the floor: every Newton step factorises V once), measured
in the same run? Cases, each at N spins, D = 128, beta = 1, couplings at the seed's scale
(std 1/sqrt(N D), symmetrised, zero diagonal), fields randn / sqrt(D):

- `solve`: `ea.spin.saddle_point` (t* only);
- `logz_value_grad`: `jax.value_and_grad(ea.spin.log_partition)` with respect to J and H;
- `train_step`: the gradient with respect to J_raw of sum(magnetizations ** 2) (a gradient of
  a gradient, through the implicit t*);

each from the default (cold) start and warm-started from the t* of a nearby input
(H + 0.01 * noise, as in consecutive training steps). Each case runs twice in the same
process, interleaved: with this checkout (`after`) and with the package as it was before the
solver engine (`before`, commit 87ff9c9, extracted from git by `_baseline.py`). Target:
at N = 1024 in float64, log Z value+grad <= 15x a Cholesky warm. The unit is
timed twice: XLA's `jnp.linalg.cholesky` compiled in the same program set, and LAPACK's
`potrf` called from SciPy on the same matrix (before and after the cases, median of both);
the ratios are given against each (XLA's in-process Cholesky ran 30-60% slower than
LAPACK's next to the saddle-point programs, so only the LAPACK unit is a fixed yardstick).

`--count` also prints the large linear algebra each program compiles to (`_flops.py`: from
the optimised HLO, in units of one N x N Cholesky, outside loops and per pass of each loop).

    python benchmarks/spin_saddle.py [--quick] [--sizes 64 256] [--dtypes float32] [--count]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _baseline  # noqa: E402
import _flops  # noqa: E402
from _common import interleaved, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 is one of the dtypes compared

DIM = 128
BETA = 1.0


def problem(num_spins: int, dim: int, dtype: str, coupling: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    J_raw = coupling * rng.standard_normal((num_spins, num_spins)) / np.sqrt(num_spins * dim)
    H = rng.standard_normal((num_spins, dim)) / np.sqrt(dim)
    H_near = H + 0.01 * rng.standard_normal((num_spins, dim)) / np.sqrt(dim)
    return (jnp.asarray(a, dtype) for a in (J_raw, H, H_near))


def cases(package) -> dict:
    """The benchmarked functions of `package` (this checkout, or the baseline)."""
    sp = package.spin

    def solve_cold(V, J_raw, H, t0):
        return sp.saddle_point(sp.symmetric_couplings(J_raw), H, beta=BETA).value

    def solve_warm(V, J_raw, H, t0):
        return sp.saddle_point(sp.symmetric_couplings(J_raw), H, beta=BETA, t0=t0).value

    def log_z(J_raw, H, t0):
        return sp.log_partition(sp.symmetric_couplings(J_raw), H, beta=BETA, t0=t0)

    def logz_value_grad_cold(V, J_raw, H, t0):
        return jax.value_and_grad(log_z, argnums=(0, 1))(J_raw, H, None)

    def logz_value_grad_warm(V, J_raw, H, t0):
        return jax.value_and_grad(log_z, argnums=(0, 1))(J_raw, H, t0)

    def train_loss(J_raw, H, t0):
        return jnp.sum(sp.magnetizations(sp.symmetric_couplings(J_raw), H, beta=BETA, t0=t0) ** 2)

    def train_step_cold(V, J_raw, H, t0):
        return jax.grad(train_loss)(J_raw, H, None)

    def train_step_warm(V, J_raw, H, t0):
        return jax.grad(train_loss)(J_raw, H, t0)

    return {
        "solve_cold": solve_cold,
        "solve_warm": solve_warm,
        "logz_value_grad_cold": logz_value_grad_cold,
        "logz_value_grad_warm": logz_value_grad_warm,
        "train_step_cold": train_step_cold,
        "train_step_warm": train_step_warm,
    }


def run(num_spins: int, dtype: str, coupling: float, repeats: int, note: str, count: bool):
    sp = ea.spin
    before = _baseline.load()
    J_raw, H, H_near = problem(num_spins, DIM, dtype, coupling)
    J = sp.symmetric_couplings(J_raw)
    solve = jax.jit(lambda J, H, t0: sp.saddle_point(J, H, beta=BETA, t0=t0))
    cold = solve(J, H, None)
    t0 = solve(J, H_near, None).value  # the warm start: t* of a nearby input
    warm = solve(J, H, t0)
    solve_before = jax.jit(lambda J, H, t0: before.spin.saddle_point(J, H, beta=BETA, t0=t0))
    steps_before = {"cold": solve_before(J, H, None), "warm": solve_before(J, H, t0)}
    V = jnp.diag(cold.value) - J  # a positive definite N x N matrix of the problem's own scale

    # Every case is a function of the same arrays; the couplings are built from J_raw inside
    # (an O(N^2) symmetrisation), as a layer would.
    def cholesky(V, J_raw, H, t0):
        return jnp.linalg.cholesky(V)

    fns = {"cholesky": cholesky}
    for version, package in (("after", ea), ("before", before)):
        fns.update({f"{version}:{name}": fn for name, fn in cases(package).items()})
    potrf = lapack_potrf_samples(V, repeats)
    times = interleaved(fns, V, J_raw, H, t0, repeats=repeats)
    potrf += lapack_potrf_samples(V, repeats)
    base = times["cholesky"]["median_s"]
    lapack = statistics.median(potrf)
    steps = {"after": {"cold": cold, "warm": warm}, "before": steps_before}
    unit = num_spins**3 / 3
    rows = []
    for name, timing in times.items():
        if name == "cholesky":
            continue
        version, case_start = name.split(":")
        case, start = case_start.rsplit("_", 1)
        solution = steps[version][start]
        row = {
            "benchmark": "spin_saddle",
            "version": version,
            "case": case,
            "start": start,
            "num_spins": num_spins,
            "dim": DIM,
            "dtype": dtype,
            "coupling_scale": coupling,
            "median_s": timing["median_s"],
            "cholesky_median_s": base,
            "ratio_to_cholesky": timing["median_s"] / base,
            "lapack_potrf_median_s": lapack,
            "ratio_to_lapack_potrf": timing["median_s"] / lapack,
            "ratio_to_before": timing["median_s"] / times[f"before:{case_start}"]["median_s"],
            "compile_s": timing["compile_s"],
            "newton_steps": int(solution.num_steps),
            "backtracks": int(solution.stats["backtracks"]),
            "repeats": repeats,
            "note": note,
        }
        if count:
            text = jax.jit(fns[name]).lower(V, J_raw, H, t0).compile().as_text()
            ops = _flops.count(text, min_flops=0.01 * unit)
            row["cholesky_units_outside_loops"] = _flops.in_units(ops.outside, unit)
            row["cholesky_units_per_loop_pass"] = [
                _flops.in_units(loop, unit) for loop in ops.loops
            ]
            row["operations"] = {
                "outside": _flops.describe(ops.outside, unit),
                "loops": [_flops.describe(loop, unit) for loop in ops.loops],
            }
        rows.append(row)
    return rows


def lapack_potrf_samples(V, repeats: int) -> list[float]:
    """Seconds per LAPACK Cholesky factorisation (`?potrf`, through SciPy) of `V`, each on a
    fresh Fortran-ordered copy made outside the timing, after one untimed call."""
    matrix = np.asarray(V)
    (potrf,) = scipy.linalg.get_lapack_funcs(("potrf",), (matrix,))
    samples = []
    for i in range(repeats + 1):
        a = np.array(matrix, order="F")
        start = time.perf_counter()
        _, info = potrf(a, lower=True, overwrite_a=True, clean=False)
        if i:  # the first call warms up
            samples.append(time.perf_counter() - start)
        if info != 0:
            raise SystemExit(f"LAPACK potrf failed (info {info}): the matrix is not SPD")
    return samples


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 256, float32, 5 repeats")
    parser.add_argument("--sizes", type=int, nargs="+", help="numbers of spins N")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "float64"])
    parser.add_argument(
        "--couplings",
        type=float,
        nargs="+",
        help="coupling scales, in units of the seed's 1/sqrt(N D) (default 1, and 8 in the "
        "full run: stronger couplings, a harder saddle point)",
    )
    parser.add_argument("--repeats", type=int, help="timed repeats per case (median reported)")
    parser.add_argument("--note", default="", help="free text stored with each row")
    parser.add_argument(
        "--count", action="store_true", help="also count each program's large linear algebra"
    )
    args = parser.parse_args(argv)
    sizes = args.sizes or ([256] if args.quick else [64, 256, 512, 1024])
    dtypes = args.dtypes or (["float32"] if args.quick else ["float32", "float64"])
    repeats = args.repeats or (5 if args.quick else 11)
    couplings = args.couplings or ([1.0] if args.quick else [1.0, 8.0])
    rows = []
    for coupling in couplings:
        for dtype in dtypes:
            for num_spins in sizes:
                new = run(num_spins, dtype, coupling, repeats, args.note, args.count)
                rows.extend(new)
                for row in new:
                    report(row)
    path = write_rows("spin_saddle" + ("_quick" if args.quick else ""), rows)
    print(f"wrote {path}")
    return rows


def report(row: dict) -> None:
    print(
        f"{row['dtype']} x{row['coupling_scale']:g} N={row['num_spins']:5d} {row['version']:6s} "
        f"{row['case']:16s} {row['start']:4s} {row['median_s'] * 1e3:9.3f} ms = "
        f"{row['ratio_to_cholesky']:6.1f} x Cholesky ({row['cholesky_median_s'] * 1e3:.3f} ms), "
        f"{row['ratio_to_lapack_potrf']:6.1f} x LAPACK potrf "
        f"({row['lapack_potrf_median_s'] * 1e3:.3f} ms), "
        f"{row['ratio_to_before']:5.2f} x before  steps {row['newton_steps']}  "
        f"compile {row['compile_s']:.2f}s",
        flush=True,
    )
    if "operations" in row:
        print(f"    outside loops: {row['operations']['outside']}")
        for i, loop in enumerate(row["operations"]["loops"]):
            print(f"    loop {i}, per pass: {loop}")


if __name__ == "__main__":
    main()
