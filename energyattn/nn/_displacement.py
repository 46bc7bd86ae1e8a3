r"""One bare self-attention step, measured: how far it moves its inputs (a numerical
experiment of the seed on visualising energy landscapes, drawn by
`ea.viz.plot_displacement_contour`)."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._checks import positive_int
from .._energy import HopfieldEnergy
from .._solver import descend


@functools.cache
def _displacement_program(num_patterns: int, max_dim: int, dtype_name: str) -> Any:
    """One compiled program for the whole sweep: patterns padded to `max_dim` with zeros."""
    dtype = jnp.dtype(dtype_name)

    def one(key: Any, dim: Any, scale: Any) -> Any:
        # Zero padding beyond `dim` changes no dot product and no norm.
        keep = jnp.arange(max_dim) < dim
        x = jnp.where(keep, jr.normal(key, (num_patterns, max_dim), dtype), 0)
        beta = (scale / jnp.sqrt(dim.astype(dtype))).astype(dtype)
        # Bare self-attention: the inputs are the stored patterns (held fixed) and the state.
        out = descend(HopfieldEnergy(x, beta=beta), x, step_size=1.0, num_steps=1).value
        return jnp.linalg.norm(x - out)

    def sweep(keys: Any, dims: Any, scales: Any) -> Any:
        per_dim = jax.vmap(one, in_axes=(0, None, 0))  # over scales
        return jax.lax.map(lambda a: per_dim(a[0], a[1], scales), (keys, dims))

    return jax.jit(sweep)


def self_attention_displacement(
    dims: Any,
    scales: Any,
    *,
    num_patterns: int = 32,
    key: Any,
    dtype: Any = np.float32,
) -> np.ndarray:
    r"""Norm $\lVert X - X'\rVert$ between the inputs and outputs of one bare self-attention step.

    For every latent dimension $d_k$ in `dims` and scale $s$ in `scales`, sample
    `num_patterns` patterns $X \sim \mathcal N(0, 1)^{n\times d_k}$ and take one gradient
    step of size 1 of the log-sum-exp energy with the patterns as their own stored patterns
    at $\beta = s/\sqrt{d_k}$,

    $$X' = X - \nabla_X E(X; M{=}X) = \mathrm{softmax}\!\left(\tfrac{s}{\sqrt{d_k}}
      XX^\top\right) X,$$

    through [`ea.descend`][energyattn.descend] and
    [`ea.HopfieldEnergy`][energyattn.HopfieldEnergy], in `dtype`. Each pattern's overlap
    with itself, $\beta\lVert x_i\rVert^2 \approx s\sqrt{d_k}$, dominates the others (of
    order $s$), so the output is the input up to $e^{-s\sqrt{d_k}}$: at $d_k = 512$ and the
    transformer default $s = 1$ that is far below float32's resolution, and the measured
    norm is the rounding error of $x - (x - \mathrm{softmax}\cdot X)$, a few $10^{-6}$.
    In float64 the same step moves the patterns by the true, much smaller amount.

    **Arguments:**

    - `dims`: latent dimensions $d_k \ge 1$, a 1-d sequence of ints.
    - `scales`: scale factors $s > 0$ relative to $1/\sqrt{d_k}$, a 1-d sequence.
    - `num_patterns`: patterns per sample (the seed uses 32 for the contour, 8 in the text).
    - `key`: a JAX PRNG key; every `(d_k, s)` cell gets fresh patterns.
    - `dtype`: `float32` (as the seed computed it) or `float64` (needs
      `jax.enable_x64(True)`, e.g. as a context manager).

    **Returns:**

    A NumPy array of shape `(len(scales), len(dims))` (rows: scales, columns: dimensions).

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021),
        "Bare self-attention: on the importance of scale and why multiple heads".
    """
    dims_ = np.asarray(dims).reshape(-1)
    scales_ = np.asarray(scales, np.float64).reshape(-1)
    if dims_.size == 0 or not np.issubdtype(dims_.dtype, np.integer) or np.any(dims_ < 1):
        raise ValueError(f"dims must be a non-empty sequence of integers >= 1, got {dims!r}")
    if scales_.size == 0 or not np.all(scales_ > 0):
        raise ValueError(f"scales must be a non-empty sequence of values > 0, got {scales!r}")
    num_patterns = positive_int("num_patterns", num_patterns, minimum=2)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if dtype == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            "dtype float64 needs 64-bit JAX: wrap the call in `with jax.enable_x64(True):`"
        )
    keys = jr.split(key, (dims_.size, scales_.size))
    program = _displacement_program(num_patterns, int(dims_.max()), dtype.name)
    norms = program(keys, jnp.asarray(dims_, jnp.int32), jnp.asarray(scales_, dtype))
    return np.asarray(norms, np.float64).T
