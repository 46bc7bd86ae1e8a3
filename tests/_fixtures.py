"""The suite's shared fixtures (tests/conftest.py makes them available to every test)."""

import contextlib

import equinox as eqx
import jax
import jax.random as jr
import jaxtyping
import pytest


@pytest.fixture
def jax_defaults():
    """JAX's default 32-bit mode for one test; float64 is restored afterwards."""
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", True)


@contextlib.contextmanager
def optimised():
    """XLA's optimisations on for a block (long training loops, also in module fixtures):
    conftest.py compiles at -O0; -O1 runs them as fast as -O3 and compiles faster."""
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture
def optimised_xla():
    """`optimised()` for one test."""
    with optimised():
        yield


@pytest.fixture
def user_mode():
    """The runtime type checker off, as in a user's program: bad-input tests see
    energyattn's own `ValueError`s, not jaxtyping's `TypeCheckError`."""
    previous = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", previous)


@pytest.fixture
def getkey():
    """A function that gives a fresh, deterministic PRNG key on every call."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


@pytest.fixture
def train_in_scan():
    """`train(loss, model, optim, num_steps)`: optax steps on `loss(model)` in one `lax.scan`."""

    def train(loss, model, optim, num_steps):
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

    return train
