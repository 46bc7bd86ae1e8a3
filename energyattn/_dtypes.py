"""Dtypes the library chooses for itself, the same under every `jax_numpy_dtype_promotion`.

A user may set `jax.config.update("jax_numpy_dtype_promotion", "strict")`, under which
`jnp.result_type` and `jnp.promote_types` raise for float64 with float32 or bfloat16 with
float32. Those are exactly the questions the library asks to pick a computation's dtype, so
they are answered here on the standard promotion lattice whatever the user's mode; the
library then casts explicitly (`x.astype(dtype)`), so strict mode never meets an implicit
promotion. This module imports nothing of the library (every other module may import it).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def result_dtype(*arrays_or_dtypes: Any) -> np.dtype:
    """`jnp.result_type` on the standard promotion lattice (whatever the user's mode): the
    dtype standard NumPy-style promotion gives these arrays, dtypes or Python scalars (weakly
    typed, as in `jnp.result_type`)."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*arrays_or_dtypes)


def accumulation_dtype(*arrays_or_dtypes: Any) -> np.dtype:
    """The dtype sums, scores and log-sum-exps of these operands accumulate in: their standard
    promotion ([`result_dtype`][]), and at least float32 (bfloat16 and float16 inputs stay
    usable; float64 stays float64)."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(jnp.result_type(*arrays_or_dtypes), jnp.float32)
