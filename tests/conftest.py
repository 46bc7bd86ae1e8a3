"""Test configuration: float64 everywhere, deterministic keys, runtime type checking.

`pyproject.toml` installs jaxtyping's import hook with beartype for the `energyattn` package
(`--jaxtyping-packages`), so every annotated shape and dtype is checked while the suite runs.
"""

import os

# Before JAX starts: the CPU backend offers 8 devices, so the multi-device tests
# (tests/test_parallel.py) run anywhere. CI exports the same flag; keep any other XLA flags.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

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
