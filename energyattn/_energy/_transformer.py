"""The Energy Transformer's two energies: multi-head attention and the Hopfield memory."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import check_mask, check_matching_dim, check_positive, check_shape, keyword_arguments
from .._custom_types import Scalar, ScalarLike
from .._dtypes import accumulation_dtype, result_dtype
from .._mask import SegmentIds
from ._attention import (
    BlockSize,
    Implementation,
    as_block_sizes,
    check_block_size,
    check_implementation,
    lse_rows,
    masked_logsumexp,
    select_implementation,
)
from ._base import AbstractEnergy

MemoryKind = Literal["relu", "softmax"]


@keyword_arguments("ea.transformer_attention_energy")
def transformer_attention_energy(
    g: Float[ArrayLike, "seq dim"],
    w_query: Float[ArrayLike, "heads head_dim dim"],
    w_key: Float[ArrayLike, "heads head_dim dim"],
    *,
    beta: ScalarLike,
    mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
    include_self: bool = False,
    implementation: Implementation = "auto",
    block_size: BlockSize = None,
) -> Scalar:
    r"""The Energy Transformer's multi-head attention energy.

    $$E^{\mathrm{ATT}}(g) = -\frac1\beta \sum_{h=1}^{H}\sum_{C=1}^{N}
      \log \sum_{B \ne C} \exp\!\big(\beta\, K_{hB}\cdot Q_{hC}\big),
      \qquad K_{hB} = W^K_h g_B,\; Q_{hC} = W^Q_h g_C$$

    Every token $C$ is a query attending to the keys of the other tokens $B$. Its gradient with
    respect to $g$ is an attention update whose values are tied to the queries and keys (there
    is no value matrix): both the query token and the key tokens move.

    A query with no key left (one token, or all masked) has an empty sum, taken as
    $\log 1 = 0$ (no energy, no force), as in [`hopfield_energy`][energyattn.hopfield_energy].

    **Arguments:**

    - `g`: the (layer-normalised) tokens, shape `(seq, dim)`.
    - `w_query`, `w_key`: $W^Q, W^K$, shape `(heads, head_dim, dim)` (the layout of the
      public ET checkpoint).
    - `beta`: inverse temperature $\beta > 0$ (usually $1/\sqrt{\text{head\_dim}}$).
    - `mask`: optional boolean `(seq, seq)`; `mask[C, B]` is `True` where token $C$ may attend
      to token $B$.
    - `include_self`: also sum over $B = C$ (the released ImageNet weights were trained so).
    - `implementation`: `"auto"` (the kernels on a GPU or TPU; on a CPU blockwise above
      $2^{17}$ score entries, heads x seq x seq), `"naive"`, `"small"`, `"blockwise"`,
      `"pallas"` or `"cudnn"`, as in
      [`attention_logsumexp`][energyattn.attention_logsumexp]: the blockwise path never holds
      a `(seq, seq)` matrix, and excludes the diagonal without building a mask.
    - `block_size`: the tiling of the blockwise passes, a
      [`BlockSizes`][energyattn.BlockSizes] or keys per block (default: each platform's;
      see [`attention_logsumexp`][energyattn.attention_logsumexp]).

    **Returns:**

    The energy, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), eq. (1) of the tutorial.
    """
    check_shape("g", g, "seq dim")
    seq, dim = jnp.shape(g)
    check_shape("w_query", w_query, "heads head_dim dim", dim=dim)
    check_shape("w_key", w_key, "heads head_dim dim", dim=dim)
    if jnp.shape(w_key) != jnp.shape(w_query):
        raise ValueError(
            "w_query and w_key must have the same shape (heads, head_dim, dim), got "
            f"{tuple(jnp.shape(w_query))} and {tuple(jnp.shape(w_key))}"
        )
    beta = check_positive("beta", beta)
    if mask is not None:
        mask = check_mask(mask, (seq, seq), "seq seq", segments=True)
    heads, head_dim, _ = jnp.shape(w_query)
    method = select_implementation(
        implementation,
        entries=heads * seq * seq,
        dtype=result_dtype(g, w_query, w_key),
        head_dim=head_dim,
        structured_mask=mask is not None or not include_self,
    )
    g, w_query, w_key = jnp.asarray(g), jnp.asarray(w_query), jnp.asarray(w_key)
    acc = accumulation_dtype(g, w_query, w_key)
    queries = jnp.einsum("cd,hyd->hcy", g, w_query, preferred_element_type=acc)
    keys = jnp.einsum("bd,hyd->hby", g, w_key, preferred_element_type=acc)
    beta = beta.astype(acc)
    block_size = as_block_sizes(block_size)

    def head_lse(q: Float[Array, "seq head_dim"], k: Float[Array, "seq head_dim"]) -> Array:
        return lse_rows(q, k, beta, mask, not include_self, method, block_size)

    lse = jax.vmap(head_lse)(queries, keys)
    return -jnp.sum(lse) / beta


@keyword_arguments("ea.transformer_memory_energy")
def transformer_memory_energy(
    g: Float[ArrayLike, "seq dim"],
    memories: Float[ArrayLike, "mem dim"],
    *,
    kind: MemoryKind = "relu",
    beta: ScalarLike = 1.0,
) -> Scalar:
    r"""The Energy Transformer's Hopfield-network (memory) energy, the MLP's counterpart.

    $$E^{\mathrm{HN}}(g) = -\tfrac12 \sum_{B,\mu} \mathrm{ReLU}(\xi_\mu\cdot g_B)^2
      \quad(\texttt{"relu"}), \qquad
      E^{\mathrm{HN}}(g) = -\frac1\beta \sum_B \log\sum_\mu e^{\beta\,\xi_\mu\cdot g_B}
      \quad(\texttt{"softmax"})$$

    The ReLU form's negative gradient is the two-layer MLP
    $\sum_\mu \xi_\mu \mathrm{ReLU}(\xi_\mu\cdot g_B)$ with tied weights; the softmax form is a
    modern Hopfield network whose memories are the rows of $\xi$.

    **Arguments:**

    - `g`: the (layer-normalised) tokens, shape `(seq, dim)`.
    - `memories`: $\xi$, shape `(mem, dim)`.
    - `kind`: `"relu"` (rectified quadratic, the ET default) or `"softmax"`.
    - `beta`: inverse temperature of the softmax form (ignored by `"relu"`).

    With no memories (`(0, dim)`) both forms are 0: the softmax form's empty sum has a
    log-sum-exp of 0, the rule of a fully masked attention row.

    **Returns:**

    The energy, a 0-d array.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), "Memory Energy" in the tutorial.
    """
    check_matching_dim("g", g, "seq dim", "memories", memories, "mem dim")
    g, memories = jnp.asarray(g), jnp.asarray(memories)
    acc = accumulation_dtype(g, memories)
    hidden = jnp.einsum("bd,md->bm", g, memories, preferred_element_type=acc)
    if kind == "relu":
        return -0.5 * jnp.sum(jnp.square(jax.nn.relu(hidden)))
    if kind == "softmax":
        beta = check_positive("beta", beta).astype(acc)
        return -jnp.sum(masked_logsumexp(beta * hidden, None)) / beta
    raise ValueError(f"kind must be 'relu' or 'softmax', got {kind!r}")


class TransformerAttentionEnergy(AbstractEnergy):
    r"""Module form of
    [`transformer_attention_energy`][energyattn.transformer_attention_energy].

    $$E^{\mathrm{ATT}}(g) = -\frac1\beta \sum_{h}\sum_{C}
      \log \sum_{B \ne C} e^{\beta\, K_{hB}\cdot Q_{hC}}$$

    Called as `energy(g, mask)`: the `args` of the energy protocol is the optional boolean
    `(seq, seq)` attention mask.

    **Arguments:**

    - `w_query`, `w_key`: shape `(heads, head_dim, dim)`.
    - `beta`: inverse temperature (> 0).
    - `include_self`: also let each token attend to itself.
    - `implementation`, `block_size`: how the log-sum-exp is computed, as in
      [`transformer_attention_energy`][energyattn.transformer_attention_energy].

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023).
    """

    w_query: Float[Array, "heads head_dim dim"]
    w_key: Float[Array, "heads head_dim dim"]
    beta: Float[Array, ""]
    include_self: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)
    block_size: BlockSize = eqx.field(static=True)

    @keyword_arguments("ea.TransformerAttentionEnergy")
    def __init__(
        self,
        w_query: Float[ArrayLike, "heads head_dim dim"],
        w_key: Float[ArrayLike, "heads head_dim dim"],
        *,
        beta: ScalarLike,
        include_self: bool = False,
        implementation: Implementation = "auto",
        block_size: BlockSize = None,
    ):
        check_shape("w_query", w_query, "heads head_dim dim")
        check_shape("w_key", w_key, "heads head_dim dim")
        self.w_query = jnp.asarray(w_query)
        self.w_key = jnp.asarray(w_key)
        self.beta = check_positive("beta", beta)
        self.include_self = bool(include_self)
        self.implementation = check_implementation(implementation)
        self.block_size = check_block_size(block_size)

    def __call__(self, x: Float[Array, "seq dim"], args: Any = None) -> Scalar:
        check_matching_dim(
            "x", x, "seq dim", "w_query", self.w_query, "heads head_dim dim", fixed="this energy's"
        )
        return transformer_attention_energy(
            x,
            self.w_query,
            self.w_key,
            beta=self.beta,
            mask=args,
            include_self=self.include_self,
            implementation=self.implementation,
            block_size=self.block_size,
        )


class TransformerMemoryEnergy(AbstractEnergy):
    r"""Module form of [`transformer_memory_energy`][energyattn.transformer_memory_energy].

    $$E^{\mathrm{HN}}(g) = -\tfrac12 \sum_{B,\mu} \mathrm{ReLU}(\xi_\mu\cdot g_B)^2$$

    (or the softmax form). The `args` of the energy protocol are ignored.

    **Arguments:**

    - `memories`: $\xi$, shape `(mem, dim)`.
    - `kind`: `"relu"` or `"softmax"`.
    - `beta`: inverse temperature of the softmax form.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023).
    """

    memories: Float[Array, "mem dim"]
    beta: Float[Array, ""]
    kind: MemoryKind = eqx.field(static=True)

    @keyword_arguments("ea.TransformerMemoryEnergy")
    def __init__(
        self,
        memories: Float[ArrayLike, "mem dim"],
        *,
        kind: MemoryKind = "relu",
        beta: ScalarLike = 1.0,
    ):
        check_shape("memories", memories, "mem dim")
        if kind not in ("relu", "softmax"):
            raise ValueError(f"kind must be 'relu' or 'softmax', got {kind!r}")
        self.memories = jnp.asarray(memories)
        self.beta = check_positive("beta", beta)
        self.kind = kind

    def __call__(self, x: Float[Array, "seq dim"], args: Any = None) -> Scalar:
        check_matching_dim(
            "x", x, "seq dim", "memories", self.memories, "mem dim", fixed="this energy's"
        )
        return transformer_memory_energy(x, self.memories, kind=self.kind, beta=self.beta)
