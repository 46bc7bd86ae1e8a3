"""Vanilla softmax attention: the explicit reference the energy-based layers are checked against."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import default_dtype, python_float
from .._dtypes import accumulation_dtype
from ._common import linear, merge_heads, prepare_inputs, project, resolve_dims, split_heads


def _masked_softmax(
    scores: Float[Array, "*heads seq mem"], mask: Bool[ArrayLike, "seq mem"] | None
) -> Float[Array, "*heads seq mem"]:
    """Softmax over the unmasked entries; a row with none left is all zeros (no NaN)."""
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    nonempty = jnp.any(mask, axis=-1, keepdims=True)
    # Fully masked rows see zeros instead of -inf (whose softmax is NaN) and are zeroed below.
    safe = jnp.where(nonempty, jnp.where(mask, scores, -jnp.inf), 0.0)
    return jnp.where(mask, jax.nn.softmax(safe, axis=-1), 0.0)


class SoftmaxAttention(eqx.Module):
    r"""Multi-head (scaled dot-product) softmax attention.

    $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(s\, Q K^\top\right) V,
      \qquad Q = x W_Q,\; K = c W_K,\; V = c W_V,$$

    per head, followed by an output projection that mixes the heads. With `bare=True` there
    are no projections at all: raw queries attend to raw context patterns, which act as keys
    and values (the module the energy-based layers are compared with).

    Masked entries are excluded exactly; a query with every entry masked outputs zeros, the
    same convention as [`hopfield_energy`][energyattn.hopfield_energy] (zero attention force).

    **Arguments:**

    - `query_dim`: feature size of the inputs `x`.
    - `context_dim`: feature size of the context (default `query_dim`).
    - `num_heads`: number of heads.
    - `head_dim`: size of each head (default `query_dim // num_heads`, which must divide).
    - `scale`: the softmax scale $s$ (default $1/\sqrt{\text{head\_dim}}$).
    - `bare`: no projections (keys = values = context, one or more heads slicing the features).
    - `dtype`: parameter dtype (default: JAX's default float).
    - `key`: PRNG key for the initial weights (keyword only).

    ??? cite "Source"

        A. Vaswani et al., *Attention Is All You Need* (2017); M. Bal, *Attention as Energy
        Minimization: Visualizing Energy Landscapes* (2021), "Explicit vanilla softmax
        attention".
    """

    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    value_proj: eqx.nn.Linear | None
    output_proj: eqx.nn.Linear | None
    scale: float = eqx.field(static=True)
    query_dim: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    bare: bool = eqx.field(static=True)

    def __init__(
        self,
        query_dim: int,
        context_dim: int | None = None,
        *,
        num_heads: int = 1,
        head_dim: int | None = None,
        scale: float | None = None,
        bare: bool = False,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dims = resolve_dims(query_dim, context_dim, num_heads, head_dim, bare)
        self.query_dim, self.context_dim, self.num_heads, self.head_dim = dims
        self.bare = bare
        self.scale = python_float("scale", self.head_dim**-0.5 if scale is None else scale)
        if bare:
            self.query_proj = self.key_proj = self.value_proj = self.output_proj = None
        else:
            dtype = default_dtype(dtype)
            inner = self.num_heads * self.head_dim
            kq, kk, kv, ko = jr.split(key, 4)
            self.query_proj = linear(self.query_dim, inner, use_bias=False, dtype=dtype, key=kq)
            self.key_proj = linear(self.context_dim, inner, use_bias=False, dtype=dtype, key=kk)
            self.value_proj = linear(self.context_dim, inner, use_bias=False, dtype=dtype, key=kv)
            self.output_proj = linear(inner, self.query_dim, use_bias=True, dtype=dtype, key=ko)

    def __call__(
        self,
        x: Float[ArrayLike, "seq query_dim"],
        context: Float[ArrayLike, "mem context_dim"] | None = None,
        *,
        mask: Bool[ArrayLike, "seq mem"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq query_dim"]:
        """**Arguments:**

        - `x`: queries' inputs, shape `(seq, query_dim)`.
        - `context`: keys' and values' inputs, shape `(mem, context_dim)`; default `x`
          (self-attention).
        - `mask`: optional boolean `(seq, mem)`, `True` where attending is allowed.
        - `key`: unused (no randomness); accepted for Equinox layer compatibility.

        **Returns:**

        Shape `(seq, query_dim)`.
        """
        del key
        x, context, mask = prepare_inputs(x, context, mask, self.query_dim, self.context_dim)
        q = split_heads(project(self.query_proj, x), self.num_heads)
        k = split_heads(project(self.key_proj, context), self.num_heads)
        v = split_heads(project(self.value_proj, context), self.num_heads)
        acc = accumulation_dtype(q, k)
        scores = jnp.einsum("hsd,hmd->hsm", q, k, preferred_element_type=acc) * self.scale
        probs = _masked_softmax(scores, mask)
        out = merge_heads(jnp.einsum("hsm,hmd->hsd", probs.astype(v.dtype), v))
        return project(self.output_proj, out)
