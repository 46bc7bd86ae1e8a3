"""The naive attention log-sum-exp: the `(seq, mem)` scores, their log-sum-exp, plain autodiff."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..._mask import SegmentIds
from ._blocks import Structure


def allowed_matrix(
    seq: int, mem: int, mask: Bool[Array, "seq mem"] | None, structure: Structure
) -> Bool[Array, "seq mem"] | None:
    """Which scores take part: the mask and the `structure` (no diagonal, the causal
    triangle) together (or `None`: all of them)."""
    allowed = structure.allowed(jnp.arange(seq), jnp.arange(mem))
    if isinstance(mask, SegmentIds):
        mask = mask.dense()
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    return allowed


def masked_logsumexp(
    a: Float[Array, "seq mem"], mask: Bool[Array, "seq mem"] | None
) -> Float[Array, " seq"]:
    """Row-wise log-sum-exp over the entries where `mask` is True.

    Masked entries drop out exactly (they contribute `exp(-inf) = 0`, not a large negative
    number), and neither their values nor their gradients can reach the result. A row with
    no entry left is a sum over the empty set; its log would be `-inf`, and we define it as 0
    so that energies stay finite and the force on that row vanishes. With no columns at all
    (an empty memory) every row is such an empty sum.
    """
    if a.shape[-1] == 0:
        # No entries at all (an empty memory): every row is an empty sum.
        return jnp.zeros(a.shape[:-1], a.dtype)
    if mask is None:
        return jax.nn.logsumexp(a, axis=-1)
    nonempty = jnp.any(mask, axis=-1)
    shift = jnp.max(jnp.where(mask, a, -jnp.inf), axis=-1, keepdims=True)
    # The log-sum-exp does not depend on the shift, so no gradient needs to flow through it.
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shift), shift, 0.0))
    # Double `where`: masked entries are replaced before `exp`, so a NaN/inf hiding in a masked
    # score can poison neither the value nor the gradient.
    terms = jnp.where(mask, jnp.exp(jnp.where(mask, a, shift) - shift), 0.0)
    total = jnp.sum(terms, axis=-1)
    lse = jnp.log(jnp.where(nonempty, total, 1.0)) + shift[:, 0]
    return jnp.where(nonempty, lse, 0.0)


def naive_lse(q, k, beta, mask, structure: Structure):
    """The log-sum-exp rows from the whole score matrix."""
    scores = beta * jnp.einsum("sd,md->sm", q, k, preferred_element_type=beta.dtype)
    return masked_logsumexp(scores, allowed_matrix(q.shape[0], k.shape[0], mask, structure))
