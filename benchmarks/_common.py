"""Shared by the benchmark scripts: timing (compile apart from run), environment, JSON rows.

Every script compares against a baseline measured in the same run, so the numbers that matter
are ratios. Times are medians of repeats after `block_until_ready()`.
"""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

#: Where the JSON rows go: `benchmarks/results/`, or the folder `run.py --results` names
#: (passed through the environment, so scripts that rerun themselves in a subprocess, like
#: `context_parallel.py`, write there too).
RESULTS = Path(os.environ.get("ENERGYATTN_BENCH_RESULTS") or Path(__file__).parent / "results")


def environment() -> dict[str, Any]:
    """The device and software versions a row was measured with."""
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
