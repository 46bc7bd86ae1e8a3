"""Run every benchmark from one entry point and print where their JSON rows went.

    OPENBLAS_NUM_THREADS=1 taskset -c 0 python benchmarks/run.py [--quick] [--only NAME ...]
    OPENBLAS_NUM_THREADS=1 taskset -c 0 python -m benchmarks [--quick]
    energyattn bench --quick --out DIR      (the same, from the package's command)

`--quick` passes `--quick` to each script (small sizes, few repeats): the whole suite then
finishes in 5 to 15 minutes on one CPU core, by host (benchmarks/README.md, "Hosts"). Each
script compares against a baseline measured in the same run and writes
`benchmarks/results/<name>[_quick].json`.

Each script runs in a process of its own, as it would alone: scripts set XLA's flags before
JAX starts (YNN fusions off for the spin-model layer, 8 host devices for the ring), which a
shared process could not honour once the first script had started JAX's backend, and no
script inherits another's memory or allocator state.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> the question it answers (one script per question).
BENCHMARKS = {
    "attention_speed": "energy attention vs hand-written softmax vs dot_product_attention",
    "attention_memory": "temporary memory of the attention step, naive vs blockwise",
    "context_parallel": "per-device memory and time of the ring energy vs one device",
    "et_recall": "ea.descend vs a hand-written lax.scan (Energy Transformer recall)",
    "deq": "fixed-point solvers; implicit vs unrolled gradients vs number of steps",
    "deq_attention": "deep-equilibrium attention: implicit vs unrolled memory vs steps and seq",
    "derivatives": "forward mode and second derivatives of blockwise attention, before/after",
    "spin_saddle": "the vector-spin saddle point in multiples of one Cholesky",
    "smt": "spin-model transformer attention vs softmax attention; Anderson vs Picard",
    "adjoint_solve": "dense vs matrix-free implicit adjoint: where the automatic choice switches",
    "ebt_memory": "training an energy-based transformer through its thinking: memory, paths",
    "solver_jit": "filter_jit on the solver entry points vs tracing them into the caller",
    "unrolled": "ea.UnrolledAdjoint's gradient at max_steps=256 vs 16: the steps it takes",
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats (5-15 min on one core)"
    )
    parser.add_argument("--only", nargs="*", choices=list(BENCHMARKS), help="run only these")
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the JSON rows here instead of benchmarks/results/",
    )
    args = parser.parse_args(argv)
    environment = dict(os.environ)
    if args.results is not None:
        # Each script's write_rows reads it (benchmarks/_common.py).
        environment["ENERGYATTN_BENCH_RESULTS"] = str(args.results.resolve())
    names = args.only or list(BENCHMARKS)
    print(
        "Each row is printed as it is measured. Columns named 'before' are energyattn at an "
        "earlier commit (named in each benchmark's docstring, imported beside this checkout "
        "by benchmarks/_baseline.py), 'after' this checkout; ratios are after / before, "
        "times medians of interleaved repeats. benchmarks/README.md has the targets.",
        flush=True,
    )
    seconds: dict[str, float] = {}
    failed: dict[str, int] = {}
    began = time.perf_counter()
    for name in names:
        print(f"\n=== {name}: {BENCHMARKS[name]}", flush=True)
        start = time.perf_counter()
        command = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if args.quick else [])]
        done = subprocess.run(command, env=environment, check=False)
        seconds[name] = time.perf_counter() - start
        if done.returncode != 0:  # the others still run: their rows are not lost
            failed[name] = done.returncode
    total = time.perf_counter() - began
    print("\n" + "\n".join(f"{name:18s} {s:7.1f} s" for name, s in seconds.items()))
    print(f"{'total':18s} {total:7.1f} s")
    if failed:
        raise SystemExit(
            "failed: "
            + ", ".join(
                f"benchmarks/{name}.py (exit status {code})" for name, code in failed.items()
            )
        )
    return seconds


if __name__ == "__main__":
    main()
