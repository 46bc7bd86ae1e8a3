"""Test configuration (fixtures: `_fixtures.py`): environment set before JAX starts, `jax.config`
options, pytest hooks; one patch where no option exists. Each speed setting is measured."""

import atexit
import gc
import logging
import os
import pathlib
import subprocess
import sys

# In os.environ, so subprocesses and xdist workers inherit them; nothing the user set is
# overridden. 8 CPU devices for the multi-device tests; no probing of other backends (0.7 s
# a process); no Python tracebacks as MLIR locations (a tenth of the suite's lowering time).
_env = os.environ
if "xla_force_host_platform_device_count" not in _env.get("XLA_FLAGS", ""):
    _env["XLA_FLAGS"] = f"{_env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
_env.setdefault("JAX_PLATFORMS", "cpu")
_env.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
_env.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

# Most of the suite's time is XLA compiling small programs: LLVM at -O0
# (JAX_DISABLE_MOST_OPTIMIZATIONS) with XLA's classic loop emitters (the fusion emitters
# round a solver sum in test_spin.py differently from the same sum compiled alone), no YNN
# fusions (they can compile into wrong kernels: _cli/common.py), no while-loop invariant
# code motion (37 of the largest programs: 32.8 s without, 37.4 s with), and each LLVM module
# in one piece, not split over threads the busy cores cannot run (the suite 404 and 390 s
# against 436 and 443, interleaved, 2 Zen 4 cores; the first four: 6.5 to 2.5 minutes). XLA
# aborts on a flag it lacks (0.12: fusion emitters): all are tried in a subprocess, then, if
# that fails, each in its own (five at once held up the suite's start by 3 s).
_FAST = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_backend_optimization_level=1",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_disable_hlo_passes=while-loop-invariant-code-motion",
    "--xla_cpu_parallel_codegen_split_count=1",
)
_flags, _probes, _ALL = _env["XLA_FLAGS"].strip(), {}, " ".join(_FAST)


def _probe(flags: str) -> subprocess.Popen:
    command = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    env = dict(_env, XLA_FLAGS=f"{_flags} {flags}")
    return subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)


if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in _env and not any(
    f.split("=")[0] in _flags for f in _FAST
):
    _env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    _probes = {_ALL: _probe(_ALL)}

import jax  # noqa: E402
import pytest  # noqa: E402
from _fixtures import getkey, jax_defaults, optimised_xla, train_in_scan, user_mode  # noqa: E402, F401

# XLA reads its flags when the first backend starts, which nothing has done yet.
if _probes and _probes[_ALL].wait() != 0:
    _probes = {flag: _probe(flag) for flag in _FAST}
_env["XLA_FLAGS"] = " ".join([_flags, *(f for f, p in _probes.items() if p.wait() == 0)])
jax.config.update("jax_enable_x64", True)  # identities are checked to 1e-10
if _env.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1":  # read when JAX is imported: a plugin
    jax.config.update("jax_disable_most_optimizations", True)  # may have imported it first

# The patch: every `eqx.error_if` traced asks JAX, per stack frame, whether the file is
# excluded from tracebacks (system calls). The answer depends only on the name and the
# exclusions, so it is remembered. Unpatched, the question took 0.9 s of 40 s in
# test_solver_contract.py and 2.4 of 71 s in test_spin.py and test_messages.py (one core).
from jax._src import traceback_util as _tb  # noqa: E402

if hasattr(_tb, "include_filename"):
    _include, _seen = _tb.include_filename, {}

    def _include_filename(filename: str) -> bool:
        key = (filename, len(_tb._exclude_paths))
        if key not in _seen:
            _seen[key] = _include(filename)
        return _seen[key]

    _tb.include_filename = _include_filename

# Tracing makes many short-lived objects: the cyclic collector at its default threshold took
# about 7% of a test (6.5 of 90 s in test_solvers.py and test_smt.py, by gc.callbacks).
gc.freeze()
gc.set_threshold(10_000, 10, 10)

# Each program XLA compiled keeps ~9 memory mappings while JAX caches it; past
# vm.max_map_count the compiler segfaults (docs/known-issues.md; at about 59,000 of 65,530).
# Every 100 compilations, a process over three quarters of the limit clears JAX's caches
# between tests (at half, each worker cleared once near its end, for 7 s).
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
        if _MAPS.read_bytes().count(b"\n") > _MAP_LIMIT * 3 // 4:
            jax.clear_caches()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker that has sent its results exits at once: tearing down JAX's CPU
    client and its thousands of programs took 10-14 s at the end of the suite while the
    controller waited. Registered last, this handler runs first; not under coverage."""
    if _env.get("PYTEST_XDIST_WORKER") and "coverage" not in sys.modules:
        atexit.register(os._exit, 0)  # (atexit runs its handlers last first)
        for flush in (sys.stderr.flush, sys.stdout.flush, logging.shutdown):
            atexit.register(flush)
