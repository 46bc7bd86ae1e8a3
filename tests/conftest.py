"""Test configuration: float64 everywhere, deterministic keys, runtime type checking.

`pyproject.toml` installs jaxtyping's import hook with beartype for the `energyattn` package
(`--jaxtyping-packages`), so every annotated shape and dtype is checked while the suite runs.
"""

import os
import subprocess
import sys

# Before JAX starts: the CPU backend offers 8 devices, so the multi-device tests
# (tests/test_parallel.py) run anywhere. CI exports the same flag; keep any other XLA flags.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Compile fast. The suite's programs are small and each runs a few times, so most of its time
# was XLA compiling them: LLVM at -O0 and XLA's classic loop emitters (instead of the newer MLIR
# fusion emitters) take the suite from about 6.5 to 2.5 minutes on 2 cores, and no test's run
# time grows. The two go together (at -O0 alone the fusion emitters round one solver sum in
# tests/test_spin.py differently from the same sum compiled on its own, which that test checks
# bit for bit). Set in os.environ, so the subprocesses the tests start (CLI commands, the
# float32 checks) inherit them. Added only where the user has not set these flags, and only if
# this jaxlib knows them (an unknown XLA flag aborts the process), which one short subprocess
# checks; xdist workers inherit the result from the controller's environment.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "")
if not any(flag.split("=")[0] in _flags for flag in FAST_COMPILE_FLAGS):
    _fast = f"{_flags} {' '.join(FAST_COMPILE_FLAGS)}".strip()
    _probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=dict(os.environ, XLA_FLAGS=_fast, JAX_PLATFORMS="cpu"),
        capture_output=True,
    )
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] = _fast

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402

# Once, before any test: identities are checked to 1e-10 in float64. Tests that need
# float32/bfloat16 say so through explicit dtypes (or run in a subprocess).
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
