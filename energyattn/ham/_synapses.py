r"""Synapses: energies of the activations of the layers they join.

A synapse is any function of activations returning a scalar; these are the common ones. A
negative energy rewards alignment: descending it moves each layer's state toward what the
other layers' activations predict.
"""

import math
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_shape, default_dtype, keyword_arguments, positive_int, shape_str
from .._custom_types import Scalar
from .._energy import transformer_attention_energy, transformer_memory_energy
from .._hyperparameters import hyperparameter, hyperparameter_fields


def _sizes(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    for n in shape:
        positive_int("shape", n)
    return shape


class BiasSynapse(eqx.Module):
    r"""A synapse on one layer: an external field (a bias) on its activations.

    $$E(g) = -\,b\cdot g$$

    **Arguments:**

    - `shape`: the shape of the layer (an int for a vector).
    - `dtype`: parameter dtype. The bias starts at zero.
    """

    bias: Float[Array, "..."]

    def __init__(self, shape: int | tuple[int, ...], *, dtype: Any = None):
        self.bias = jnp.zeros(_sizes(shape), default_dtype(dtype))

    def __call__(self, g: Float[Array, "..."]) -> Scalar:
        return -jnp.sum(self.bias * g)


class DenseSynapse(eqx.Module):
    r"""A dense (all-to-all) synapse between two layers.

    $$E(g_a, g_b) = -\,g_a^\top W\, g_b$$

    on the flattened activations. With a softmax hidden layer $g_b$ this is the modern
    Hopfield network: the rows of $W^\top$ are its stored patterns.

    **Arguments:**

    - `shape_a`, `shape_b`: the shapes of the two layers (ints for vectors).
    - `dtype`: parameter dtype; `key`: PRNG key ($W \sim \mathcal N(0, 1/(n_a + n_b))$).

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021); B. Hoover et al., HAMUX.
    """

    weight: Float[Array, "size_a size_b"]
    shape_a: tuple[int, ...] = eqx.field(static=True)
    shape_b: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        shape_a: int | tuple[int, ...],
        shape_b: int | tuple[int, ...],
        *,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.shape_a, self.shape_b = _sizes(shape_a), _sizes(shape_b)
        na, nb = math.prod(self.shape_a), math.prod(self.shape_b)
        self.weight = jr.normal(key, (na, nb), default_dtype(dtype)) / jnp.sqrt(na + nb)

    def __call__(self, g_a: Float[Array, "..."], g_b: Float[Array, "..."]) -> Scalar:
        for name, g, shape in (("g_a", g_a, self.shape_a), ("g_b", g_b, self.shape_b)):
            if jnp.size(g) != math.prod(shape):
                raise ValueError(
                    f"{name} must have the shape {shape_str(shape)} of the layer this "
                    f"DenseSynapse was built for (shape_{name[-1]}), got {shape_str(jnp.shape(g))}"
                )
        return -(g_a.reshape(-1) @ self.weight @ g_b.reshape(-1))


class ConvSynapse(eqx.Module):
    r"""A convolutional synapse between two image-shaped layers.

    $$E(g_{\text{in}}, g_{\text{out}}) = -\sum_{c,i,j} g_{\text{out}}[c,i,j]\,
      (W \star g_{\text{in}})[c,i,j]$$

    so the output layer sees the convolution of the input layer and, through the same
    weights, the input layer sees the transposed convolution of the output layer (both are
    `jax.grad` of this one energy).

    **Arguments:**

    - `in_channels`, `out_channels`, `kernel_size`, `stride`, `padding`: as
      `equinox.nn.Conv2d` (layers of shape `(channels, height, width)`).
    - `dtype`, `key`: parameter dtype and PRNG key.

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021) (convolutional synapses);
        B. Hoover et al., HAMUX.
    """

    conv: eqx.nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        *,
        stride: int | tuple[int, int] = 1,
        padding: int | str = 0,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.conv = eqx.nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            use_bias=False,
            dtype=default_dtype(dtype),
            key=key,
        )

    def __call__(self, g_in: Float[Array, "c h w"], g_out: Float[Array, "c2 h2 w2"]) -> Scalar:
        conv = self.conv
        check_shape("g_in", g_in, "channels height width", channels=conv.in_channels)
        seen = conv(g_in)
        if 0 in seen.shape:
            # Without this the energy is 0 for every state: the layers silently disconnected.
            raise ValueError(
                f"the kernel of this ConvSynapse (kernel_size={conv.kernel_size}, "
                f"stride={conv.stride}, padding={conv.padding}) leaves no output position on "
                f"g_in of shape {shape_str(jnp.shape(g_in))}: each side of g_in plus its padding "
                "must be at least the kernel size"
            )
        if jnp.shape(g_out) != seen.shape:
            raise ValueError(
                f"g_out must have shape {shape_str(seen.shape)}, that of the convolution of "
                f"g_in of shape {shape_str(jnp.shape(g_in))}, got {shape_str(jnp.shape(g_out))}"
            )
        return -jnp.sum(g_out * seen)


class AttentionSynapse(eqx.Module):
    r"""The Energy Transformer's attention energy on one layer of tokens.

    $$E(g) = -\frac1\beta\sum_h\sum_C \log\sum_{B\ne C} e^{\beta\, K_{hB}\cdot Q_{hC}},
      \qquad Q_{hC} = W^Q_h g_C,\; K_{hB} = W^K_h g_B$$

    ([`transformer_attention_energy`][energyattn.transformer_attention_energy]) on a layer
    of shape `(seq, dim)`.

    **Arguments:**

    - `dim`, `num_heads`, `head_dim`: token size, heads and head size.
    - `beta`: inverse temperature (default $1/\sqrt{\text{head\_dim}}$);
      `trainable_beta`: learn it (default `False`; see
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `include_self`: let each token attend to itself.
    - `dtype`, `key`: $W^Q, W^K \sim \mathcal N(0, 1/\text{dim})$.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023).
    """

    w_query: Float[Array, "heads head_dim dim"]
    w_key: Float[Array, "heads head_dim dim"]
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    include_self: bool = eqx.field(static=True)

    @keyword_arguments("ea.ham.AttentionSynapse")
    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        head_dim: int,
        beta: float | None = None,
        trainable_beta: bool = False,
        include_self: bool = False,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dim, num_heads, head_dim = (
            positive_int(n, v)
            for n, v in (("dim", dim), ("num_heads", num_heads), ("head_dim", head_dim))
        )
        dtype = default_dtype(dtype)
        kq, kk = jr.split(key)
        self.w_query = jr.normal(kq, (num_heads, head_dim, dim), dtype) / jnp.sqrt(dim)
        self.w_key = jr.normal(kk, (num_heads, head_dim, dim), dtype) / jnp.sqrt(dim)
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", head_dim**-0.5 if beta is None else beta, trainable_beta, dtype
        )
        self.include_self = bool(include_self)

    @property
    def beta(self) -> float | Float[Array, ""]:
        """The inverse temperature: a float, or an array leaf when trainable."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    def __call__(self, g: Float[Array, "seq dim"]) -> Scalar:
        return transformer_attention_energy(
            g, self.w_query, self.w_key, beta=self.beta, include_self=self.include_self
        )


class HopfieldSynapse(eqx.Module):
    r"""A Hopfield memory on one layer: stored patterns $\xi_\mu$ attract its activations.

    $$E(g) = -\tfrac12\sum_{B,\mu}\mathrm{ReLU}(\xi_\mu\cdot g_B)^2 \quad(\texttt{"relu"}),
      \qquad E(g) = -\frac1\beta\sum_B\log\sum_\mu e^{\beta\,\xi_\mu\cdot g_B}
      \quad(\texttt{"softmax"})$$

    ([`transformer_memory_energy`][energyattn.transformer_memory_energy]) on a layer of
    shape `(seq, dim)` or `(dim,)`. It is the memory with its hidden layer integrated out:
    a [`DenseSynapse`][energyattn.ham.DenseSynapse] to a hidden layer with a ReLU or softmax
    Lagrangian has the same stationary points.

    **Arguments:**

    - `dim`: the size of each token; `num_memories`: the number of stored patterns.
    - `kind`: `"relu"` (default) or `"softmax"`; `beta`: the softmax form's inverse
      temperature; `trainable_beta`: learn it (default `False`; see
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `dtype`, `key`: $\xi \sim \mathcal N(0, 1/\text{dim})$.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023); H. Ramsauer et al., *Hopfield
        Networks is All You Need* (2020).
    """

    memories: Float[Array, "mem dim"]
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    kind: Literal["relu", "softmax"] = eqx.field(static=True)

    @keyword_arguments("ea.ham.HopfieldSynapse")
    def __init__(
        self,
        dim: int,
        num_memories: int,
        *,
        kind: Literal["relu", "softmax"] = "relu",
        beta: float = 1.0,
        trainable_beta: bool = False,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dim, num_memories = positive_int("dim", dim), positive_int("num_memories", num_memories)
        if kind not in ("relu", "softmax"):
            raise ValueError(f"kind must be 'relu' or 'softmax', got {kind!r}")
        self.memories = jr.normal(key, (num_memories, dim), default_dtype(dtype)) / jnp.sqrt(dim)
        self.kind = kind
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", beta, trainable_beta, dtype
        )

    @property
    def beta(self) -> float | Float[Array, ""]:
        """The softmax form's inverse temperature (as `AttentionSynapse.beta`)."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    def __call__(self, g: Float[Array, "*seq dim"]) -> Scalar:
        tokens = jnp.atleast_2d(g)
        return transformer_memory_energy(tokens, self.memories, kind=self.kind, beta=self.beta)
