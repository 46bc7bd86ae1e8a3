"""cuDNN's fused attention (through `jax.nn.dot_product_attention`) for the passes it can do.

The fused kernel computes $\\sum_j p_{ij} v_j$ and, in its backward, $\\sum_i p_{ij} u_i$ for
any values $v$ and output cotangent $u$: the attention output (values = keys) and the plain
row and column terms of the derivatives, without the `(seq, mem)` matrix. Everything else
(the float32 log-sum-exp, the weighted terms) runs blockwise.
"""

import jax
import jax.numpy as jnp

#: The `jax.nn.dot_product_attention` implementation of the fused path. Tests swap in `"xla"`
#: to check this path's wiring (layouts, dtypes) on a CPU.
FUSED_KERNEL = "cudnn"


def _fused_attention(q, k, v, beta):
    # beta is folded into the queries (scale=1): the fused kernel takes its scale as a static
    # float, while beta is traced (a trainable field of the layers).
    return jax.nn.dot_product_attention(
        (beta.astype(q.dtype) * q)[None, :, None, :],
        k[None, :, None, :],
        v.astype(q.dtype)[None, :, None, :],
        scale=1.0,
        implementation=FUSED_KERNEL,
    )[0, :, 0, :]


def fused_rows(q, k, beta, values):
    """$\\sum_j p_{ij} X_j$ for per-key values $X$."""
    return _fused_attention(q, k, values, beta).astype(beta.dtype)


def fused_columns(q, k, beta, values):
    """$\\sum_i p_{ij} X_i$ for per-query values $X$: the values' cotangent of attention for
    an output cotangent $X$ (the fused backward)."""
    zeros = jnp.zeros((k.shape[0], values.shape[1]), q.dtype)
    _, vjp = jax.vjp(lambda v: _fused_attention(q, k, v, beta), zeros)
    return vjp(values.astype(q.dtype))[0].astype(beta.dtype)
