"""The causal transformer over continuous tokens: causal attention as the gradient of a
log-sum-exp, the pre-norm block, the transformer (the context stream of an energy-based
transformer, and with its head the feed-forward next-token baseline) and its training."""

import dataclasses
from typing import Any, Literal, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from einops import rearrange
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

from .._checks import check_finite, check_shape, concrete_value, positive_int, shape_str
from .._dtypes import accumulation_dtype, result_dtype
from .._energy import (
    BlockSize,
    attention_logsumexp,
    check_block_size,
    naive_on_cpu,
    select_implementation,
)
from .._sharding import sequence_axis
from ._training import TrainOptions, TrainResult, fit

Implementation = Literal["auto", "naive", "blockwise", "pallas"]
_Module = TypeVar("_Module", bound=eqx.Module)


def causal_attention(
    q: Float[Array, "seq head_dim"],
    k: Float[Array, "seq head_dim"],
    v: Float[Array, "seq head_dim"],
    *,
    scale: float,
    own: tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]] | None = None,
    implementation: Implementation = "auto",
    block_size: BlockSize = None,
) -> Float[Array, "seq head_dim"]:
    r"""Causal softmax attention with values, obtained as the gradient of a log-sum-exp.

    $$o_i = \sum_{j \le i} \operatorname{softmax}_j(s\, q_i\cdot k_j)\, v_j
      = \frac1s\, \frac{\partial}{\partial u_i}
        \log\!\sum_{j\le i} e^{\,s\,[q_i, u_i]\cdot[k_j, v_j]}\Big|_{u = 0}$$

    The values ride in an auxiliary half of the keys, and the attention output is the force
    of the log-sum-exp energy on the matching half of the queries: on the blockwise and
    context-parallel paths the package's attention log-sum-exp, with its derivatives of every
    order in O(seq) memory, is all there is. The naive path (and `"auto"` on a CPU below
    `BLOCKWISE_THRESHOLD` score entries) writes the left-hand side out, the masked softmax of
    the `(seq, seq)` scores under plain autodiff, whose higher derivatives are smaller
    programs; every path gives the same values and derivatives. With `own = (k', v')` query
    $i$ also attends to one key and value of its own, $e^{s(q_i\cdot k'_i + u_i\cdot v'_i)}$
    joining the sum (an energy-based transformer's candidate attending to the context up to
    its position and to itself).
    """
    check_shape("q", q, "seq head_dim")
    seq, head_dim = q.shape
    check_shape("k", k, "seq head_dim", seq=seq, head_dim=head_dim)
    check_shape("v", v, "seq width", seq=seq)
    if own is not None:
        check_shape("own[0] (the own keys)", own[0], "seq head_dim", seq=seq, head_dim=head_dim)
        check_shape("own[1] (the own values)", own[1], "seq width", seq=seq, width=v.shape[1])
    method = select_implementation(
        implementation,
        entries=q.shape[0] * k.shape[0],
        dtype=result_dtype(q, k),
        head_dim=q.shape[-1],
        structured_mask=True,
    )
    if sequence_axis(q, k) is None:
        # The same equation written out: plain autodiff of the (seq, seq) scores is what the
        # naive path is, and its derivatives (of every order, as training through a descent
        # takes) are smaller programs than those of the log-sum-exp's gradient.
        def explicit():
            return _explicit_causal_attention(q, k, v, scale, own)

        if method == "naive":
            return explicit()
        if method == "small":
            return naive_on_cpu(
                explicit,
                lambda: _gradient_attention(q, k, v, scale, own, "blockwise", block_size),
                accumulation_dtype(q, k),
            )
    return _gradient_attention(q, k, v, scale, own, method, block_size)


def _gradient_attention(q, k, v, scale, own, method, block_size):
    """`causal_attention` as the gradient of the log-sum-exp (every path but the naive)."""
    width = v.shape[-1]

    def total(u: Array) -> Array:
        lse = attention_logsumexp(
            jnp.concatenate([q, u], axis=-1),
            jnp.concatenate([k, v], axis=-1),
            beta=scale,
            causal=True,
            implementation=method,
            block_size=block_size,
        )
        if own is not None:
            own_k, own_v = own
            mine = scale * (jnp.sum(q * own_k, axis=-1) + jnp.sum(u * own_v, axis=-1))
            lse = jnp.logaddexp(lse, mine.astype(lse.dtype))
        return jnp.sum(lse)

    u = jnp.zeros((q.shape[0], width), result_dtype(q, v))
    return (jax.grad(total)(u) / scale).astype(v.dtype)


def _explicit_causal_attention(q: Array, k: Array, v: Array, scale: float, own: Any) -> Array:
    """`causal_attention` on the naive path: the masked softmax of the whole score matrix."""
    acc = accumulation_dtype(q, k)
    seq = q.shape[0]
    scores = scale * jnp.einsum("sd,md->sm", q, k, preferred_element_type=acc)
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    if own is None:
        return (jax.nn.softmax(scores, axis=-1) @ v.astype(acc)).astype(v.dtype)
    own_k, own_v = own
    mine = scale * jnp.sum(q * own_k, axis=-1, dtype=acc)
    probs = jax.nn.softmax(jnp.concatenate([scores, mine[:, None]], axis=1), axis=-1)
    out = probs[:, :seq] @ v.astype(acc) + probs[:, seq:] * own_v.astype(acc)
    return out.astype(v.dtype)


class CausalBlock(eqx.Module):
    r"""One pre-layer-norm causal transformer block (attention, then a GELU MLP).

    $$u = h + W_O\,\mathrm{Attn}(\mathrm{LN}_1(h)),\qquad
      h' = u + \mathrm{MLP}(\mathrm{LN}_2(u))$$

    Unbatched and stacked along a leading axis by the models that use it.
    """

    norm1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, hidden: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jr.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, use_bias=False, key=k1)
        self.out = eqx.nn.Linear(dim, dim, key=k2)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, hidden, depth=1, activation=jax.nn.gelu, key=k3)

    def heads(self, h: Array, num_heads: int) -> tuple[Array, Array, Array]:
        """Queries, keys and values of every head, each `(heads, seq, head_dim)`."""
        qkv = jax.vmap(self.qkv)(jax.vmap(self.norm1)(h))
        q, k, v = rearrange(qkv, "n (three h d) -> three h n d", three=3, h=num_heads)
        return q, k, v

    def finish(self, h: Array, attended: Array) -> Array:
        """The residual update from the heads' outputs `(heads, seq, head_dim)`, then the MLP."""
        u = h + jax.vmap(self.out)(rearrange(attended, "h n d -> n (h d)"))
        return u + jax.vmap(self.mlp)(jax.vmap(self.norm2)(u))


def _check_path(implementation: str) -> Implementation:
    if implementation not in ("auto", "naive", "blockwise", "pallas"):
        raise ValueError(
            "implementation must be 'auto', 'naive', 'blockwise' or 'pallas' (causal "
            f"attention: cuDNN cannot take the mask), got {implementation!r}"
        )
    return cast(Implementation, implementation)


def _stack(modules: list[_Module]) -> _Module:
    """Modules of one structure as one module whose arrays have a leading layer axis."""
    weights = [eqx.filter(m, eqx.is_array) for m in modules]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *weights)
    return eqx.combine(stacked, eqx.filter(modules[0], eqx.is_array, inverse=True))


class CausalTransformer(eqx.Module):
    r"""A causal transformer over continuous tokens: embedding, learned positions, `depth`
    pre-norm blocks with causal softmax attention
    ([`causal_attention`][energyattn.models.causal_attention]).

    It is the context stream of
    [`EnergyBasedTransformer`][energyattn.models.EnergyBasedTransformer] and, with its
    `head`, the feed-forward next-token baseline: $\hat x_{t+1} = W\,\mathrm{LN}(h_t) + b$.

    **Arguments:**

    - `token_dim`: size of a token (e.g. 8 pixels of a digit row).
    - `max_len`: the longest sequence (learned positions).
    - `dim`, `num_heads`, `depth`, `hidden`: model width, heads, blocks and MLP width
      (default `4 * dim`).
    - `out_dim`: outputs per position of the head (default `token_dim`: a next-token
      prediction; an energy-based transformer's head gives 1, the energy).
    - `implementation`: the attention's path, `"auto"`, `"naive"`, `"blockwise"` or
      `"pallas"` (the same numbers; a sequence split over devices by
      `ea.parallel.context_parallel` runs the ring).
    - `block_size`: the tiling of the blockwise passes, a
      [`BlockSizes`][energyattn.BlockSizes] or keys per block (default: each platform's).
    - `key`: PRNG key.
    """

    embed: eqx.nn.Linear
    positions: Float[Array, "max_len dim"]
    blocks: CausalBlock
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)
    block_size: BlockSize = eqx.field(static=True)

    def __init__(
        self,
        token_dim: int,
        max_len: int,
        dim: int = 32,
        *,
        num_heads: int = 2,
        depth: int = 2,
        hidden: int | None = None,
        out_dim: int | None = None,
        implementation: Implementation = "auto",
        block_size: BlockSize = None,
        key: PRNGKeyArray,
    ):
        token_dim, max_len = positive_int("token_dim", token_dim), positive_int("max_len", max_len)
        dim, depth = positive_int("dim", dim), positive_int("depth", depth)
        self.num_heads = positive_int("num_heads", num_heads)
        if dim % self.num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        hidden = 4 * dim if hidden is None else positive_int("hidden", hidden)
        self.implementation = _check_path(implementation)
        self.block_size = check_block_size(block_size)
        keys = jr.split(key, depth + 3)
        self.embed = eqx.nn.Linear(token_dim, dim, key=keys[0])
        self.positions = 0.02 * jr.normal(keys[1], (max_len, dim))
        self.blocks = _stack([CausalBlock(dim, hidden, key=k) for k in keys[3:]])
        self.norm = eqx.nn.LayerNorm(dim)
        out_dim = token_dim if out_dim is None else positive_int("out_dim", out_dim)
        self.head = eqx.nn.Linear(dim, out_dim, key=keys[2])

    @property
    def token_dim(self) -> int:
        return cast(int, self.embed.in_features)  # built from an int, never "scalar"

    @property
    def max_len(self) -> int:
        return self.positions.shape[0]

    @property
    def depth(self) -> int:
        return jax.tree.leaves(self.blocks)[0].shape[0]

    def with_implementation(
        self, implementation: Implementation, block_size: BlockSize = None
    ) -> "CausalTransformer":
        """The same model (the same weights) with its attention on another path."""
        implementation = _check_path(implementation)
        block_size = check_block_size(block_size)
        # Static fields are not leaves: rebuilt through the dataclass, not `eqx.tree_at`.
        changed = object.__new__(CausalTransformer)
        for field in dataclasses.fields(self):
            object.__setattr__(changed, field.name, getattr(self, field.name))
        object.__setattr__(changed, "implementation", implementation)
        object.__setattr__(changed, "block_size", block_size)
        return changed

    def attend(self, q: Array, k: Array, v: Array, own: tuple | None = None) -> Array:
        """Every head's causal attention (`(heads, seq, head_dim)` each)."""
        scale = q.shape[-1] ** -0.5
        attention = jax.vmap(
            lambda q, k, v, own: causal_attention(
                q,
                k,
                v,
                scale=scale,
                own=own,
                implementation=self.implementation,
                block_size=self.block_size,
            )
        )
        return attention(q, k, v, own)

    def check_tokens(self, name: str, x: Any) -> Array:
        x = jnp.asarray(x)
        check_shape(name, x, "seq token_dim", token_dim=self.token_dim)
        if x.shape[0] > self.max_len:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens, more than the model's max_len={self.max_len}"
            )
        return x

    def states(self, x: Float[ArrayLike, "seq token_dim"]) -> tuple[Array, tuple[Array, Array]]:
        """The last block's output and every block's keys and values (`(depth, heads, seq,
        head_dim)`: the cache a candidate stream attends to)."""
        x = self.check_tokens("x", x)
        weights, structure = eqx.partition(self.blocks, eqx.is_array)

        def layer(h: Array, block_weights: PyTree) -> tuple[Array, tuple[Array, Array]]:
            block = eqx.combine(block_weights, structure)
            q, k, v = block.heads(h, self.num_heads)
            return block.finish(h, self.attend(q, k, v)), (k, v)

        # Tokens narrower than the weights (float32 data, a float64 model) are cast as standard
        # promotion would, explicitly: strict promotion refuses the implicit cast.
        x = x.astype(result_dtype(x, self.embed.weight))
        h0 = jax.vmap(self.embed)(x) + self.positions[: x.shape[0]]
        return jax.lax.scan(layer, h0, weights)

    def __call__(self, x: Float[ArrayLike, "seq token_dim"]) -> Float[Array, "seq token_dim"]:
        """The next-token predictions: row $t$ predicts token $t + 1$ from tokens $\\le t$."""
        h, _ = self.states(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(h))


# --------------------------------------------------------------------------- training


def next_token_error(predictions: Array, x: Array) -> Array:
    """Mean squared error of the predictions of positions `0..seq-2` against tokens `1..seq-1`
    (the last position has no next token).

    `predictions` and the tokens `x` are `(..., seq, token_dim)` with the same last two axes
    (leading axes broadcast: a batch, candidates); anything else is a `ValueError` naming both
    shapes."""
    p_shape, x_shape = np.shape(predictions), np.shape(x)
    wrong = len(p_shape) < 2 or len(x_shape) < 2 or p_shape[-2:] != x_shape[-2:]
    if not wrong:
        try:
            np.broadcast_shapes(p_shape[:-2], x_shape[:-2])
        except ValueError:
            wrong = True
    if wrong:
        raise ValueError(
            "next_token_error needs predictions and tokens x of shape (..., seq, token_dim) "
            "with the same seq and token_dim (and leading axes that broadcast), got "
            f"predictions {shape_str(p_shape)} and x {shape_str(x_shape)}"
        )
    dtype = result_dtype(predictions, x)  # explicit, as strict dtype promotion wants
    error = jnp.asarray(predictions, dtype)[..., :-1, :] - jnp.asarray(x, dtype)[..., 1:, :]
    return jnp.mean(jnp.square(error))


def _check_sequences(model: CausalTransformer, sequences: Any, batch_size: int) -> Array:
    sequences = jnp.asarray(sequences)
    if sequences.ndim != 3 or sequences.shape[2] != model.token_dim:
        raise ValueError(
            f"sequences must have shape (n, seq, token_dim={model.token_dim}), got "
            f"{shape_str(sequences.shape)}"
        )
    if not 2 <= sequences.shape[1] <= model.max_len:
        raise ValueError(
            f"sequences must have 2 to max_len={model.max_len} tokens (a next token to "
            f"predict), got {sequences.shape[1]}"
        )
    if positive_int("batch_size", batch_size) > sequences.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {sequences.shape[0]} sequences")
    if not jnp.issubdtype(sequences.dtype, jnp.floating):
        raise ValueError(
            "sequences must hold float token embeddings (n, seq, token_dim), got dtype "
            f"{sequences.dtype}"
        )
    known = concrete_value(sequences)
    if known is None:
        return check_finite("sequences", sequences)
    bad = ~np.isfinite(known)
    if np.any(bad):
        # Named here, before training: inside the loss they would be the context tokens x.
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        count = int(bad.sum())
        raise ValueError(
            f"sequences contain NaN or inf ({count} {'entry' if count == 1 else 'entries'}; "
            f"the first at index {index}, in sequence {index[0]})"
        )
    return sequences


def _next_token_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (sequences,) = data
    (batch_size,) = config
    model = eqx.combine(params, static)
    chosen = jr.choice(step_key, sequences.shape[0], (batch_size,), replace=False)
    x = sequences[chosen]
    return next_token_error(jax.vmap(model)(x), x)


def train_next_token(
    model: CausalTransformer,
    sequences: Float[ArrayLike, "n seq token_dim"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    batch_size: int = 64,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Train a feed-forward causal transformer to predict every next token (the baseline of
    an energy-based transformer): $\min_\theta \mathbb E_x \lVert f_\theta(x)_{<T} -
    x_{>1}\rVert^2$, on the loop and with the arguments of
    [`train_ebt`][energyattn.models.train_ebt]."""
    sequences = _check_sequences(model, sequences, batch_size)
    return fit(
        model,
        _next_token_loss,
        (sequences,),
        (batch_size,),
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=1e-3,
    )
