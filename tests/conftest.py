"""Test configuration: float64, 8 CPU devices, fast compiles (fixtures: `_fixtures.py`).

Environment variables read before JAX starts, public `jax.config` options and pytest hooks;
one patch, where no option exists. Each speed setting says what it was measured at.
`pyproject.toml` adds jaxtyping's import hook with beartype (`--jaxtyping-packages`).
"""

import atexit
import gc
import logging
import os
import pathlib
import subprocess
import sys

# Before JAX starts, in os.environ so subprocesses (CLI tests, tests/test_parallel.py) and
# xdist workers inherit it; nothing the user set is overridden. The CPU backend offers 8
# devices, so the multi-device tests run anywhere; JAX skips probing other backends (0.7 s a
# process); lowering skips Python tracebacks as MLIR locations (a tenth of the suite).
_env = os.environ
if "xla_force_host_platform_device_count" not in _env.get("XLA_FLAGS", ""):
    _env["XLA_FLAGS"] = f"{_env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
_env.setdefault("JAX_PLATFORMS", "cpu")
_env.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
_env.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

# Compile fast: most of the suite's time is XLA compiling small programs. LLVM at -O0
# (JAX_DISABLE_MOST_OPTIMIZATIONS), XLA's classic loop emitters (which go with -O0: the fusion
# emitters round one solver sum in tests/test_spin.py differently from the same sum compiled
# alone, which that test checks bit for bit), and no while-loop invariant code motion (it
# clones each loop; re-compiling 37 of the largest programs took 32.8 s without it, 37.4 s
# with it). When introduced these took the suite from 6.5 to 2.5 minutes on 2 cores. Tests
# marked `optimised_xla` (long training loops) compile at -O1 instead, below. The last flag
# turns XNNPACK's YNN fusions off: they can compile into wrong kernels (_cli/common.py).
# XLA versions drop flags (JAX 0.12 has no xla_cpu_use_fusion_emitters) and an unknown one
# aborts the process, so each is tried in a subprocess while this file imports JAX.
_FAST = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_backend_optimization_level=1",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_disable_hlo_passes=while-loop-invariant-code-motion",
)
_flags, _probes = _env["XLA_FLAGS"].strip(), {}
_NO_OPT = "JAX_DISABLE_MOST_OPTIMIZATIONS"
if _NO_OPT not in _env and not any(f.split("=")[0] in _flags for f in _FAST):
    _env[_NO_OPT] = "1"
    for _flag in _FAST:
        _probes[_flag] = subprocess.Popen(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env=dict(_env, XLA_FLAGS=f"{_flags} {_flag}"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

import jax  # noqa: E402
import pytest  # noqa: E402
from _fixtures import getkey, jax_defaults, train_in_scan, user_mode  # noqa: E402, F401

# XLA reads its flags when the first backend starts, which nothing has done yet.
_env["XLA_FLAGS"] = " ".join([_flags, *(f for f, p in _probes.items() if p.wait() == 0)])
jax.config.update("jax_enable_x64", True)  # identities are checked to 1e-10

# The one patch left: no configuration turns it off. Every `eqx.error_if` traced walks the
# stack asking JAX, per frame, whether the file is one of its excluded paths (system calls,
# ~70 ms per error_if); the answer depends only on the file name and the exclusions, so it
# is remembered. Measured: test_solver_contract.py and test_spin.py took 147 and 150 s with
# it, 158 and 166 s without; test_descend.py, test_hopfield_energy.py and test_mean_field.py
# (one shared core) 159 s with it, 177 s without.
try:
    from jax._src import traceback_util as _tb
except ImportError:  # a JAX without it: nothing to speed up
    _tb = None
if _tb is not None and hasattr(_tb, "include_filename"):
    _include, _seen = _tb.include_filename, {}

    def _include_filename(filename: str) -> bool:
        key = (filename, len(_tb._exclude_paths))
        if key not in _seen:
            _seen[key] = _include(filename)
        return _seen[key]

    _tb.include_filename = _include_filename

# Tracing makes many short-lived objects: the cyclic collector ran every 700 allocations,
# about 7% of a test (6.5 of 90 s in test_solvers.py and test_smt.py, by gc.callbacks).
gc.freeze()
gc.set_threshold(10_000, 10, 10)

# Every CPU program XLA compiled keeps ~9 memory mappings while JAX caches it; past
# vm.max_map_count (65,530) the compiler segfaults (docs/known-issues.md). Every 100
# compilations, a process over half the limit clears JAX's caches between tests.
_MAPS, _LIMIT = pathlib.Path("/proc/self/maps"), pathlib.Path("/proc/sys/vm/max_map_count")
_MAP_LIMIT = int(_LIMIT.read_text()) if _LIMIT.exists() else 65_530
_compiles = [0]


def _count(event: str, duration: float, **kwargs) -> None:
    _compiles[0] += event == "/jax/core/compile/backend_compile_duration"


if _MAPS.exists():
    jax.monitoring.register_event_duration_secs_listener(_count)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _compiles[0] >= 100:
        _compiles[0] = 0
        if _MAPS.read_bytes().count(b"\n") > _MAP_LIMIT // 2:
            jax.clear_caches()


def _leave() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker that has sent its results exits at once (speed, not a crash): tearing
    down JAX's CPU client (thousands of compiled programs) and every object took 10-14 s at
    the end of the suite while the controller waited. Registered last, this exit handler runs
    first. Not under coverage, whose exit handler writes its data."""
    if _env.get("PYTEST_XDIST_WORKER") and "coverage" not in sys.modules:
        atexit.register(_leave)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "optimised_xla: compile at -O1, not -O0, in setup and call (long loops)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked `optimised_xla` (long training loops, also those of module fixtures built
    in their setup) compile at -O1: they run as fast as at -O3 and compile faster."""
    marked = item.get_closest_marker("optimised_xla") is not None
    if not marked or not jax.config.values["jax_disable_most_optimizations"]:
        return (yield)
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        return (yield)
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
