"""What the attention layers share: head bookkeeping, projections and input checks."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import check_finite, check_mask, check_shape, positive_int, shape_str
from .._mask import SegmentIds
from .._solver import RESULTS, Solution


def resolve_dims(
    query_dim: Any, context_dim: Any, num_heads: Any, head_dim: Any, bare: bool
) -> tuple[int, int, int, int]:
    """Validated `(query_dim, context_dim, num_heads, head_dim)`."""
    query_dim = positive_int("query_dim", query_dim)
    context_dim = query_dim if context_dim is None else positive_int("context_dim", context_dim)
    num_heads = positive_int("num_heads", num_heads)
    if bare:
        # No projections: heads are slices of the raw features, so everything must line up.
        if context_dim != query_dim:
            raise ValueError(
                f"bare attention has no projections, so context_dim must equal query_dim; "
                f"got query_dim={query_dim}, context_dim={context_dim}"
            )
        if query_dim % num_heads:
            raise ValueError(
                f"bare attention splits query_dim={query_dim} into num_heads={num_heads} "
                f"heads, which does not divide evenly"
            )
        if head_dim is not None and positive_int("head_dim", head_dim) != query_dim // num_heads:
            raise ValueError(
                f"bare attention has head_dim = query_dim / num_heads = {query_dim // num_heads}, "
                f"got head_dim={head_dim}"
            )
        return query_dim, context_dim, num_heads, query_dim // num_heads
    if head_dim is None:
        if query_dim % num_heads:
            raise ValueError(
                f"query_dim={query_dim} does not split into num_heads={num_heads} heads; "
                "pass head_dim explicitly or choose a divisor"
            )
        head_dim = query_dim // num_heads
    return query_dim, context_dim, num_heads, positive_int("head_dim", head_dim)


def linear(
    in_features: int, out_features: int, *, use_bias: bool, dtype: Any, key: PRNGKeyArray
) -> eqx.nn.Linear:
    return eqx.nn.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype, key=key)


def project(layer: eqx.nn.Linear | None, x: Float[Array, "seq dim"]) -> Float[Array, "seq out"]:
    return x if layer is None else jax.vmap(layer)(x)


def _check_layer_dim(name: str, x: Any, length: str, dim: int, attribute: str) -> None:
    """Rank first, then the feature dimension against the layer's, naming both."""
    shape = np.shape(x)
    if len(shape) == 2 and shape[1] != dim:
        raise ValueError(
            f"{name} has dimension {shape[1]} but the layer's {attribute} is {dim}: {name} "
            f"must have shape ({length}, dim={dim}), got {shape_str(shape)}"
        )
    check_shape(name, x, f"{length} dim", dim=dim)


def prepare_inputs(
    x: Float[ArrayLike, "seq query_dim"],
    context: Float[ArrayLike, "mem context_dim"] | None,
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None,
    query_dim: int,
    context_dim: int,
    *,
    segments: bool = False,
) -> tuple[Float[Array, "seq query_dim"], Float[Array, "mem context_dim"], Any]:
    """Check shapes (ValueError) and finiteness (runtime error); self-attention if no context.
    `segments`: the layer takes `SegmentIds` as its mask too."""
    _check_layer_dim("x", x, "seq", query_dim, "query_dim")
    x = check_finite("x", x)
    if context is None:
        if context_dim != query_dim:
            raise ValueError(
                f"self-attention (no context) needs context_dim == query_dim, got "
                f"query_dim={query_dim}, context_dim={context_dim}"
            )
        context = x
    else:
        _check_layer_dim("context", context, "mem", context_dim, "context_dim")
        context = check_finite("context", context)
    if mask is not None:
        mask = check_mask(mask, (x.shape[0], context.shape[0]), "seq mem", segments=segments)
    return x, context, mask


def split_heads(x: Float[Array, "seq inner"], num_heads: int) -> Float[Array, "heads seq head_dim"]:
    return rearrange(x, "s (h d) -> h s d", h=num_heads)


def merge_heads(x: Float[Array, "heads seq head_dim"]) -> Float[Array, "seq inner"]:
    return rearrange(x, "h s d -> s (h d)")


def empty_descent(x: Float[Array, "0 dim"], num_steps: int, trajectory: bool) -> Solution:
    """The descent of no tokens (`seq = 0`), as `ea.descend` would report it if it took an
    empty state (it refuses one): nothing moves, and the energy of no tokens is 0 at every
    step."""
    return Solution(
        value=x,
        # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
        result=RESULTS.where(jnp.bool_(True), RESULTS.successful, RESULTS.successful),  # type: ignore[arg-type]
        num_steps=jnp.full((), num_steps, jnp.int32),
        residual=jnp.zeros((), x.dtype),
        energies=jnp.zeros((num_steps + 1,), x.dtype),
        trajectory=jnp.broadcast_to(x, (num_steps + 1, *x.shape)) if trajectory else None,
    )
