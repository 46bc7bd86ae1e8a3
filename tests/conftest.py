"""Test configuration: float64 everywhere, deterministic keys, runtime type checking.

`pyproject.toml` installs jaxtyping's import hook with beartype for the `energyattn` package
(`--jaxtyping-packages`), so every annotated shape and dtype is checked while the suite runs.
"""

import atexit
import contextlib
import gc
import logging
import os
import pathlib
import subprocess
import sys

# Before JAX starts: the CPU backend offers 8 devices, so the multi-device tests
# (tests/test_parallel.py) run anywhere. CI exports the same flag; keep any other XLA flags.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Compile fast. The suite's programs are small and most run a few times, so most of its time
# was XLA compiling them. Tests compile with LLVM at -O0 (JAX's jax_disable_most_optimizations)
# and XLA's classic CPU loop emitters instead of the newer MLIR fusion emitters: when this was
# introduced (a smaller suite) it took 2.5 minutes on 2 cores instead of 6.5. Tests whose
# programs run long (training loops) are marked `optimised_xla` and compile at -O1 (see
# below), which runs them as fast as the default -O3 and compiles faster. The emitter flag
# goes with -O0: at -O0 the fusion emitters round one solver sum in tests/test_spin.py
# differently from the same sum compiled on its own, which that test checks bit for bit.
# Both are set in os.environ, so the subprocesses the tests start (CLI commands, the processes
# of tests/test_parallel.py) inherit them, and so do the xdist workers from the controller.
# Nothing is added where the user set any of these.
# The third flag turns XNNPACK's YNN fusions off: XLA can compile them into kernels that
# compute wrong values, differently at each compilation (see `energyattn/_cli/common.py`).
FAST_COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_backend_optimization_level=1",
    "--xla_cpu_experimental_ynn_fusion_type=",
)
# Each flag is checked on its own, in short subprocesses that run while this file imports
# JAX and the rest (importing this file took 1.4 s with a check first, 0.8 s with both at
# once): an unknown XLA flag aborts the process, and XLA versions drop flags (JAX 0.12's has
# no `xla_cpu_use_fusion_emitters`, its CPU backend always uses the fusion emitters). A flag
# this XLA lacks is left out, not the whole set: when one unknown flag made the set fail, the
# suite compiled everything at -O3 and took twice as long on JAX 0.12. The answers are
# applied below, before anything starts a JAX backend.
_NO_OPT = "jax_disable_most_optimizations"
_flags = os.environ.get("XLA_FLAGS", "")
_probes: dict[str, subprocess.Popen] = {}
if _NO_OPT.upper() not in os.environ and not any(
    flag.split("=")[0] in _flags for flag in FAST_COMPILE_FLAGS
):
    for _flag in FAST_COMPILE_FLAGS:
        _probes[_flag] = subprocess.Popen(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env=dict(os.environ, XLA_FLAGS=f"{_flags} {_flag}".strip(), JAX_PLATFORMS="cpu"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

# Lower fast. Lowering to MLIR attaches each operation's Python traceback as its location,
# which costs about a tenth of the suite (path checks per frame); the locations only label
# XLA's own dumps and profiles, never an energyattn or Equinox error message. Set before JAX
# is imported, so the subprocesses the tests start inherit it too; a user's setting wins.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# The suite runs on the CPU (its multi-device tests on 8 host devices): JAX skips probing
# for other backends, 0.7 s in each of the suite's processes. Set JAX_PLATFORMS to test
# elsewhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402

if _probes:
    # No backend has started: XLA reads its flags when the first one does. JAX read its own
    # environment variable on import, so this process's configuration is set too.
    _known = [flag for flag, probe in _probes.items() if probe.wait() == 0]
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_known]).strip()
    if _NO_OPT in jax.config.values:
        os.environ[_NO_OPT.upper()] = "1"
        jax.config.update(_NO_OPT, True)


def _memoise_jax_frame_filter():
    """Every `eqx.error_if` traced walks the Python stack and asks JAX, frame by frame,
    whether the file is one of its ~30 excluded paths: three system calls per pair, about
    70 ms per `error_if`. The answer depends only on the file name and the exclusions, so the
    tests remember it (keyed on both); nothing else changes. Measured: tests/test_solver_contract.py
    and test_spin.py on one core each, paired with the unpatched conftest on the other core,
    took 147 and 150 s with this patch, 158 and 166 s without it."""
    try:
        from jax._src import traceback_util
    except ImportError:  # a JAX without this module: nothing to speed up
        return
    original = getattr(traceback_util, "include_filename", None)
    if original is None:
        return
    seen: dict[tuple[str, int], bool] = {}

    def include_filename(filename: str) -> bool:
        key = (filename, len(traceback_util._exclude_paths))
        if key not in seen:
            seen[key] = original(filename)
        return seen[key]

    traceback_util.include_filename = include_filename


_memoise_jax_frame_filter()


def _skip_loop_hoisting_at_o0():
    """At -O0 (the suite's default), XLA's while-loop invariant code motion is skipped too:
    it clones each loop to find its trip count and was about a tenth of the suite's compile
    time (re-compiling 37 of its largest programs, interleaved: 32.8 s without the pass,
    37.4 s with it). The pass only moves loop-invariant operations out of loops; the values
    are the same. Tests marked `optimised_xla` (long loops that run) keep it."""
    try:
        from jax._src import compiler
    except ImportError:  # a JAX without this module: nothing to skip
        return
    original = getattr(compiler, "get_compile_options", None)
    if original is None:
        return

    def get_compile_options(*args, **kwargs):
        options = original(*args, **kwargs)
        if jax.config.values.get(_NO_OPT):
            debug = options.executable_build_options.debug_options
            passes = [p for p in debug.xla_disable_hlo_passes.split(",") if p]
            debug.xla_disable_hlo_passes = ",".join([*passes, "while-loop-invariant-code-motion"])
        return options

    compiler.get_compile_options = get_compile_options


_skip_loop_hoisting_at_o0()


# Python's cyclic garbage collector: tracing makes many short-lived objects, and the default
# thresholds ran a collection every 700 allocations, about 7% of a test's time (6.5 of 90 s
# in tests/test_solvers.py and test_smt.py, measured with gc.callbacks). The objects alive
# after the imports are frozen out of every collection, and collections run 14x less often.
gc.freeze()
gc.set_threshold(10_000, 10, 10)

# Once, before any test: identities are checked to 1e-10 in float64. Tests that need
# float32/bfloat16 say so through explicit dtypes (or run in a subprocess).
jax.config.update("jax_enable_x64", True)


def _leave_without_tearing_down():
    """Flush, then end the process without the other exit handlers and finalisation."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker that has sent its results leaves at once. Its normal exit tore down
    what the tests left behind: JAX's exit handler destroys the CPU client with its thousands
    of compiled programs, then the interpreter collects and frees every object, 10-14 s at
    the end of the suite while the controller waited. Registered last, this exit handler runs
    first. Not under coverage, whose exit handler writes its data."""
    if os.environ.get("PYTEST_XDIST_WORKER") and "coverage" not in sys.modules:
        atexit.register(_leave_without_tearing_down)


# A process may hold at most `vm.max_map_count` memory mappings (65,530 by default on Linux),
# and every program XLA compiled for the CPU keeps about 9 while JAX caches it. A process that
# compiles ~7,000 programs fails in the compiler ("LLVM compilation error: Cannot allocate
# memory", then a segmentation fault), with jaxlib 0.10.2 and 0.12 alike: that was the crash
# of every long Python 3.12 run (5 of 5; the process at 59,000 mappings shortly before), and
# it reproduces in a script that fills the mappings first. So between tests, once this process
# holds over half the limit, JAX's caches are cleared (`jax.clear_caches()` frees the compiled
# programs' mappings; later tests compile what they need again). The count of mappings is read
# after every 100 compilations. docs/known-issues.md tells users the same.
_MAPS = pathlib.Path("/proc/self/maps")
_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")
_MAP_LIMIT = int(_LIMIT.read_text()) if _LIMIT.exists() else 65_530
_compiles = [0]


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


if _MAPS.exists():
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _compiles[0] < 100:
        return
    _compiles[0] = 0
    if _MAPS.read_bytes().count(b"\n") > _MAP_LIMIT // 2:
        jax.clear_caches()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "optimised_xla: compile with XLA's optimisations (-O1, not -O0) in the test's setup and "
        "call: for tests whose compiled programs run long (training loops)",
    )


@contextlib.contextmanager
def _optimised_xla(item):
    """Around a marked test's phase, JAX's `disable_most_optimizations` is off."""
    if item.get_closest_marker("optimised_xla") is None or not jax.config.values.get(_NO_OPT):
        yield
        return
    jax.config.update(_NO_OPT, False)
    try:
        yield
    finally:
        jax.config.update(_NO_OPT, True)


# The setup phase too: a module-scoped fixture that trains is built in its first test's setup.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _optimised_xla(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _optimised_xla(item):
        return (yield)


@pytest.fixture
def jax_defaults():
    """JAX's default 32-bit mode for one test (code it runs may turn x64 on itself, as a
    reader's would); the suite's float64 mode is restored afterwards."""
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.fixture
def getkey():
    """Return a function that gives a fresh, deterministic PRNG key on every call."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


def _train_in_scan(loss, model, optim, num_steps):
    """`num_steps` steps of the optax optimiser `optim` on `loss(model)`, all inside one
    `lax.scan` (one compiled loop when called under `eqx.filter_jit`); the trained model."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(carry, _):
        params, state = carry
        model = eqx.combine(params, static)
        grads = eqx.filter_grad(loss)(model)
        updates, state = optim.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return (eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), state), None

    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    (params, _), _ = jax.lax.scan(step, (params, state), length=num_steps)
    return eqx.combine(params, static)


@pytest.fixture
def train_in_scan():
    """Return a function that trains a model with optax in one `lax.scan`."""
    return _train_in_scan


@pytest.fixture
def user_mode():
    """Switch off the test-only runtime type checker, as in a user's program.

    Bad-input tests use it to see exactly what users see: energyattn's own `ValueError`s,
    not the jaxtyping checker's `TypeCheckError`.
    """
    previous = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", previous)
