"""Shared by the benchmark scripts: timing (compile apart from run), environment, JSON rows.

Every script compares against a baseline measured in the same run, so the numbers that matter
are ratios. Times are medians of repeats after `block_until_ready()`.
"""

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

#: Where the JSON rows go: `benchmarks/results/`, or the folder `run.py --results` names
#: (passed through the environment to each script's process).
RESULTS = Path(os.environ.get("ENERGYATTN_BENCH_RESULTS") or Path(__file__).parent / "results")


def host_cpu() -> dict[str, Any]:
    """The host's CPU, to tell hosts apart: on the CPU backend JAX names every device `cpu`,
    and the project's hosts have differed by 3x in speed under one name ("AMD EPYC"). Linux's
    `/proc/cpuinfo` gives the vendor's family and model numbers, the clock and the widest
    vector extension; elsewhere only what `platform` knows."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    # x86's "flags", ARM's "Features" (where NEON is "asimd"): the widest one named.
    words = set(fields.get("flags", "").split()) | set(fields.get("Features", "").split())
    vectors = next((n for n in ("avx512f", "avx2", "avx", "sse4_2", "asimd") if n in words), None)
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_family_model": f"{fields['cpu family']}/{fields['model']}"
        if "cpu family" in fields and "model" in fields
        else None,
        "cpu_mhz": float(fields["cpu MHz"]) if "cpu MHz" in fields else None,
        "cpu_vectors": vectors,
        "cpu_cores": os.cpu_count(),
        # The cores this process may run on (its affinity, where the system tells it).
        "cpu_cores_usable": len(affinity(0)) if affinity else os.cpu_count(),
    }


def environment() -> dict[str, Any]:
    """The device, host CPU and software versions a row was measured with."""
    import equinox
    import jaxlib

    import energyattn

    device = jax.devices()[0]
    return {
        "device": f"{device.platform}: {device.device_kind}",
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "equinox": equinox.__version__,
        "energyattn": energyattn.__version__,
        "python": platform.python_version(),
        **host_cpu(),
    }


def interleaved(
    fns: dict[str, Callable],
    *args: Any,
    repeats: int = 7,
    number: int = 1,
    warm: bool = False,
    args_for: dict[str, tuple] | None = None,
) -> dict:
    """Time several compiled functions of the same `args`, interleaving their repeats (in a
    rotating order) so that drifting machine load hits all of them alike. Returns per-name
    timing dicts. `args_for` gives some contenders arguments of their own (the same values
    in another layout, say).

    With `warm`, every sample is preceded by one untimed call of the same function. The
    rotation keeps each contender's predecessor (it shifts a cycle), and a fast program timed
    right after one with large buffers pays for them: with 5 attention contenders, the
    blockwise energy after `jax.nn.dot_product_attention` took 9.9 ms instead of 6.3 (seq
    2048, one head, one CPU core), and 6.4 again with the warm-up call."""
    arguments = {name: (args_for or {}).get(name, args) for name in fns}
    compiled, compile_s = {}, {}
    for name, fn in fns.items():
        start = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*arguments[name]).compile()
        compile_s[name] = time.perf_counter() - start
        jax.block_until_ready(compiled[name](*arguments[name]))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(compiled)
    for repeat in range(repeats):
        # Rotate the order every repeat: whichever runs right after another contender's
        # large buffers pays for it, so no one should always be in that place.
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            fn, fn_args = compiled[name], arguments[name]
            if warm:
                jax.block_until_ready(fn(*fn_args))
            start = time.perf_counter()
            for _ in range(number):
                out = fn(*fn_args)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / number)
    return {
        name: {
            "compile_s": compile_s[name],
            "median_s": statistics.median(samples[name]),
            "min_s": min(samples[name]),
        }
        for name in fns
    }


#: A float32 FMA loop over `ACC` independent accumulators of `BYTES` bytes each (enough to
#: keep two pipelines of 4-cycle FMAs busy), compiled for the host (`-march=native`). It prints
#: the best GFLOP/s of 5 timed runs. The width and count are compile-time macros because the
#: best pair depends on the vector registers: 16 of 64 bytes fill AVX-512's 32 registers, but
#: on an AVX2 core (16 registers of 32 bytes) they spill to memory and measured 7.5 GFLOP/s
#: where 12 of 32 bytes reach the core's peak.
_FMA_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef float vec __attribute__((vector_size(BYTES)));
#define LANES (BYTES / 4)
#define STEP(x) x = x * a + b;
#if ACC == 16
#define ALL(f) f(c0) f(c1) f(c2) f(c3) f(c4) f(c5) f(c6) f(c7) \
               f(c8) f(c9) f(c10) f(c11) f(c12) f(c13) f(c14) f(c15)
#else
#define ALL(f) f(c0) f(c1) f(c2) f(c3) f(c4) f(c5) f(c6) f(c7) f(c8) f(c9) f(c10) f(c11)
#endif
int main(int argc, char **argv) {
    long iters = atol(argv[1]);
    vec a, b, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15;
    for (int j = 0; j < LANES; j++) {
        a[j] = 0.999999f; b[j] = 1e-7f;
        c0[j] = c1[j] = c2[j] = c3[j] = c4[j] = c5[j] = c6[j] = c7[j] = (float)j;
        c8[j] = c9[j] = c10[j] = c11[j] = c12[j] = c13[j] = c14[j] = c15[j] = (float)-j;
    }
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long n = 0; n < iters; n++) { ALL(STEP) }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
        double rate = 2.0 * LANES * ACC * (double)iters / s / 1e9;
        if (rate > best) best = rate;
    }
    vec sum = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11 + c12 + c13 + c14 + c15;
    float total = 0;
    for (int j = 0; j < LANES; j++) total += sum[j];
    printf("%.3f %g\n", best, total);  /* the sum keeps the loop from being optimised away */
    return 0;
}
"""

#: (bytes per vector, accumulators) tried by `fma_peak_gflops`: AVX-512, AVX/AVX2, SSE/NEON.
_FMA_SHAPES = ((64, 16), (32, 12), (16, 12))


def fma_peak_gflops(iterations: int = 20_000_000) -> float | None:
    """One core's float32 peak in GFLOP/s, measured: an FMA loop compiled with the system's C
    compiler for this CPU and run in this process's CPU affinity (pin the process first), at
    each vector width of `_FMA_SHAPES`; the fastest. `None` when there is no C compiler or no
    loop can be built or run."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    rates = []
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "fma.c"
        source.write_text(_FMA_SOURCE)
        for width, accumulators in _FMA_SHAPES:
            binary = Path(folder) / f"fma{width}"
            flags = ["-O2", "-march=native", "-ffp-contract=fast"]
            macros = [f"-DBYTES={width}", f"-DACC={accumulators}"]
            try:
                subprocess.run(
                    [compiler, *flags, *macros, "-o", str(binary), str(source)],
                    check=True,
                    capture_output=True,
                    timeout=60,
                )
                done = subprocess.run(
                    [str(binary), str(iterations)], check=True, capture_output=True, timeout=120
                )
            except (OSError, subprocess.SubprocessError):
                continue
            rates.append(float(done.stdout.split()[0]))
    return max(rates, default=None)


def print_row(row: dict[str, Any]) -> None:
    """One JSON row on one line, floats to four significant digits."""
    text = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(", ".join(text), flush=True)


def write_rows(name: str, rows: list[dict[str, Any]]) -> Path:
    """Save rows (each with the environment added) to `benchmarks/results/<name>.json`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = environment()
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps([dict(env, **row) for row in rows], indent=2) + "\n")
    return path
