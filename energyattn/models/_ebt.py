"""Energy-based transformers: a causal transformer that scores (context, candidate) pairs with
an energy, predictions refined by descending it ("thinking"), training through the descent."""

import dataclasses
import math
from typing import Any, Literal, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from einops import rearrange
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

from .._checks import (
    check_finite,
    check_shape,
    check_values,
    default_dtype,
    positive_int,
    python_float,
    shape_str,
)
from .._deprecated import renamed_keywords
from .._energy import (
    AbstractEnergy,
    BlockSize,
    attention_logsumexp,
    check_block_size,
    naive_on_cpu,
    select_implementation,
)
from .._sharding import sequence_axis
from .._solver import descend
from ._training import TrainResult, fit

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
        dtype=jnp.result_type(q, k),
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
                jnp.promote_types(jnp.result_type(q, k), jnp.float32),
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

    u = jnp.zeros((q.shape[0], width), jnp.result_type(q, v))
    return (jax.grad(total)(u) / scale).astype(v.dtype)


def _explicit_causal_attention(q: Array, k: Array, v: Array, scale: float, own: Any) -> Array:
    """`causal_attention` on the naive path: the masked softmax of the whole score matrix."""
    acc = jnp.promote_types(jnp.result_type(q, k), jnp.float32)
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


def _with_path(model: Any, implementation: str, block_size: BlockSize) -> Any:
    implementation = _check_path(implementation)
    block_size = check_block_size(block_size)
    # Static fields are not leaves: rebuilt through the dataclass, not `eqx.tree_at`.
    target = model.transformer if isinstance(model, EnergyBasedTransformer) else model
    changed = object.__new__(type(target))
    for field in dataclasses.fields(target):
        object.__setattr__(changed, field.name, getattr(target, field.name))
    object.__setattr__(changed, "implementation", implementation)
    object.__setattr__(changed, "block_size", block_size)
    if target is model:
        return changed
    return eqx.tree_at(lambda m: m.transformer, model, changed)


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
        return _with_path(self, implementation, block_size)

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

        h0 = jax.vmap(self.embed)(x) + self.positions[: x.shape[0]]
        return jax.lax.scan(layer, h0, weights)

    def __call__(self, x: Float[ArrayLike, "seq token_dim"]) -> Float[Array, "seq token_dim"]:
        """The next-token predictions: row $t$ predicts token $t + 1$ from tokens $\\le t$."""
        h, _ = self.states(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(h))


class EnergyBasedTransformer(AbstractEnergy):
    r"""An energy-based transformer: a causal transformer that gives every position an energy
    $e_t(x_{\le t}, \hat y_t)$ judging a candidate $\hat y_t$ for the next token $x_{t+1}$.

    $$E_\theta(\hat y;\, x) = \sum_t e_t,\qquad
      e_t = w\cdot \mathrm{LN}\big(h^{(L)}_t\big) + b$$

    Two streams run through the same blocks (the paper's autoregressive EBT). The **context**
    stream is a causal transformer over the observed tokens $x$. The **candidate** stream
    starts from the embedded candidates $h^{(0)}_t = W_c \hat y_t + p_t$; in every block the
    candidate at position $t$ attends to the context's keys and values at positions $\le t$
    and to its own, so $e_t$ depends on $x_{\le t}$ and $\hat y_t$ only, and every prediction
    is made in parallel. The context never sees a candidate: its keys and values are computed
    once ([`context`][energyattn.models.EnergyBasedTransformer.context], a cache like a
    language model's) and a descent on the candidates runs the candidate stream alone.

    It is an [`AbstractEnergy`][energyattn.AbstractEnergy] of the candidates, `E(y, x)`, so
    [`ea.descend`][energyattn.descend], [`ea.minimise`][energyattn.minimise] and
    [`ea.energy_tree`][energyattn.energy_tree] apply. **Thinking**
    ([`think`][energyattn.models.EnergyBasedTransformer.think]) is the descent
    $\hat y \leftarrow \hat y - \alpha\, \nabla_{\hat y} E_\theta(\hat y; x)$ from noise with
    a learned step size $\alpha = e^{a}$; training
    ([`train_ebt`][energyattn.models.train_ebt]) backpropagates through it, which takes
    second derivatives of every attention layer.

    **Arguments:**

    - `token_dim`, `max_len`, `dim`, `num_heads`, `depth`, `hidden`, `implementation`,
      `block_size`: as for [`CausalTransformer`][energyattn.models.CausalTransformer].
    - `step_size`: the initial thinking step size $\alpha$ (trained; default 1.0).
    - `init_scale`: the standard deviation of the noise thinking starts from (default 1.0;
      the default of `think`, `train_ebt` and `complete`).
    - `key`: PRNG key.

    ??? cite "Source"

        A. Gladstone et al., *Energy-Based Transformers are Scalable Learners and Thinkers*
        (2025), the autoregressive EBT with its observed and predicted streams.
    """

    transformer: CausalTransformer
    candidate_embed: eqx.nn.Linear
    log_step_size: Float[Array, ""]
    init_scale: float = eqx.field(static=True)

    def __init__(
        self,
        token_dim: int,
        max_len: int,
        dim: int = 32,
        *,
        num_heads: int = 2,
        depth: int = 2,
        hidden: int | None = None,
        step_size: float = 1.0,
        init_scale: float = 1.0,
        implementation: Implementation = "auto",
        block_size: BlockSize = None,
        key: PRNGKeyArray,
    ):
        tkey, ckey = jr.split(key)
        self.init_scale = python_float("init_scale", init_scale)
        self.transformer = CausalTransformer(
            token_dim,
            max_len,
            dim,
            num_heads=num_heads,
            depth=depth,
            hidden=hidden,
            out_dim=1,
            implementation=implementation,
            block_size=block_size,
            key=tkey,
        )
        self.candidate_embed = eqx.nn.Linear(token_dim, dim, key=ckey)
        # A strongly typed float: optax's update keeps its type, so the training step is
        # compiled once (a weakly typed leaf became strong after the first step: recompiled).
        self.log_step_size = jnp.asarray(
            math.log(python_float("step_size", step_size)), default_dtype(None)
        )

    def with_implementation(
        self, implementation: Implementation, block_size: BlockSize = None
    ) -> "EnergyBasedTransformer":
        """The same model (the same weights) with its attention on another path."""
        return _with_path(self, implementation, block_size)

    @property
    def step_size(self) -> Float[Array, ""]:
        r"""The thinking step size $\alpha = e^{a}$ (trained through `log_step_size`)."""
        return jnp.exp(self.log_step_size)

    def context(self, x: Float[ArrayLike, "seq token_dim"]) -> "EBTContext":
        """The energy of candidates for this context: the context stream run once, its keys
        and values cached."""
        # NaN in the context reaches the candidates through the cache: name the tokens, not
        # the cache (descend would blame `energy.cache[0]`).
        x = check_finite("x (the context tokens)", self.transformer.check_tokens("x", x))
        _, cache = self.transformer.states(x)
        return EBTContext(self, cache)

    def energies(
        self, y: Float[ArrayLike, "seq token_dim"], x: Float[ArrayLike, "seq token_dim"]
    ) -> Float[Array, " seq"]:
        """The energy $e_t$ of every position's candidate."""
        return self.context(x).energies(y)

    def __call__(self, y: Float[ArrayLike, "seq token_dim"], args: Any = None) -> Float[Array, ""]:
        r"""$E_\theta(\hat y; x) = \sum_t e_t$, with the context tokens `x` as `args`."""
        if args is None:
            raise ValueError(
                "an EnergyBasedTransformer is an energy of the candidates given a context: "
                "call it as energy(y, x) (args = the context tokens, shape (seq, token_dim))"
            )
        return self.context(args)(y)

    def think(
        self,
        x: Float[ArrayLike, "seq token_dim"],
        *,
        num_steps: int,
        key: PRNGKeyArray,
        num_candidates: int = 1,
        init: Float[ArrayLike, "candidates seq token_dim"] | None = None,
        init_scale: float | None = None,
        noise_scale: float | None = None,
        return_trajectory: bool = False,
    ) -> "Thought":
        r"""Predict every next token by descending the energy ("System 2 thinking").

        $$\hat y^{(s+1)} = \hat y^{(s)} - \alpha\,\nabla_{\hat y} E_\theta(\hat y^{(s)}; x)
          \;[+\,\sigma\,\xi_s],\qquad \hat y^{(0)} \sim \mathcal N(0, \text{init\_scale}^2)$$

        run by [`ea.descend`][energyattn.descend] for each of `num_candidates` starting
        points; **self-verification** keeps, at every position, the candidate whose final
        energy $e_t$ is lowest.

        **Arguments:**

        - `x`: the context tokens, shape `(seq, token_dim)`.
        - `num_steps`: descent steps (0 returns the starting points).
        - `key`: PRNG key (starting points and Langevin noise).
        - `num_candidates`: candidates per position (1: no verification).
        - `init`: optional starting points `(num_candidates, seq, token_dim)`, e.g. samples of
          a replay buffer (default: Gaussian noise of scale `init_scale`, by default the
          model's).
        - `noise_scale`: optional Langevin noise $\sigma$ added after every step.
        - `return_trajectory`: also return every candidate's states along the descent.

        **Returns:**

        A [`Thought`][energyattn.models.Thought].
        """
        x = self.transformer.check_tokens("x", x)
        num_steps = positive_int("num_steps", num_steps, minimum=0)
        num_candidates = positive_int("num_candidates", num_candidates)
        init_key, noise_key = jr.split(key)
        shape = (num_candidates, *x.shape)
        if init is None:
            scale = self.init_scale if init_scale is None else init_scale
            init = python_float("init_scale", scale) * jr.normal(init_key, shape, x.dtype)
        else:
            init = jnp.asarray(init, x.dtype)
            if init.shape != shape:
                raise ValueError(
                    f"init must have shape (num_candidates={num_candidates}, seq, token_dim) = "
                    f"{shape_str(shape)}, got {shape_str(init.shape)}"
                )
        energy = self.context(x)

        def one(y0: Array, k: Array) -> tuple[Array, Array, Array, Array | None]:
            noise: dict[str, Any] = {}
            if noise_scale is not None:
                noise = {"noise_scale": noise_scale, "key": k}
            solution = descend(
                energy,
                y0,
                step_size=self.step_size,
                num_steps=num_steps,
                return_trajectory=return_trajectory,
                **noise,
            )
            y = solution.value
            return y, energy.energies(y), solution.energies, solution.trajectory

        candidates, final, energies, trajectory = jax.vmap(one)(
            init, jr.split(noise_key, num_candidates)
        )
        prediction = lowest_per_position(candidates, final)
        return Thought(prediction, candidates, final, energies, trajectory)


def lowest_per_position(
    candidates: Float[Array, "candidates seq token_dim"], energies: Float[Array, "candidates seq"]
) -> Float[Array, "seq token_dim"]:
    """Self-verification: at every position, the candidate of lowest energy $e_t$ (one choice
    per position, valid because $e_t$ depends on the candidate at $t$ alone)."""
    check_shape("candidates", candidates, "candidates seq token_dim")
    num, seq = jnp.shape(candidates)[:2]
    if jnp.shape(energies) != (num, seq):
        raise ValueError(
            f"energies must have shape (candidates={num}, seq={seq}), one per candidate and "
            f"position of candidates (shape {shape_str(jnp.shape(candidates))}), got "
            f"{shape_str(jnp.shape(energies))}"
        )
    best = jnp.argmin(energies, axis=0)
    return jnp.take_along_axis(candidates, best[None, :, None], axis=0)[0]


class EBTContext(AbstractEnergy):
    r"""The energy of candidates $\hat y$ for one context: $E_\theta(\hat y; x) = \sum_t
    e_t$, with the context stream's keys and values cached
    ([`EnergyBasedTransformer.context`][energyattn.models.EnergyBasedTransformer.context])."""

    model: EnergyBasedTransformer
    cache: tuple[Float[Array, "depth heads seq head_dim"], Float[Array, "depth heads seq head_dim"]]

    def energies(self, y: Float[ArrayLike, "seq token_dim"]) -> Float[Array, " seq"]:
        """The energy $e_t$ of every position's candidate."""
        transformer = self.model.transformer
        y = transformer.check_tokens("y", y)
        seq = self.cache[0].shape[2]
        if y.shape[0] != seq:
            raise ValueError(f"y must have the context's {seq} positions, got {shape_str(y.shape)}")
        weights, structure = eqx.partition(transformer.blocks, eqx.is_array)

        def layer(h: Array, xs: tuple) -> tuple[Array, None]:
            block_weights, k, v = xs
            block = eqx.combine(block_weights, structure)
            q_own, k_own, v_own = block.heads(h, transformer.num_heads)
            return block.finish(h, transformer.attend(q_own, k, v, own=(k_own, v_own))), None

        h0 = jax.vmap(self.model.candidate_embed)(y) + transformer.positions[:seq]
        h, _ = jax.lax.scan(layer, h0, (weights, *self.cache))
        return jax.vmap(transformer.head)(jax.vmap(transformer.norm)(h))[:, 0]

    def __call__(self, y: Float[ArrayLike, "seq token_dim"], args: Any = None) -> Float[Array, ""]:
        del args
        return jnp.sum(self.energies(y))


class Thought(eqx.Module):
    """What [`EnergyBasedTransformer.think`][energyattn.models.EnergyBasedTransformer.think]
    returns.

    **Attributes:**

    - `prediction`: `(seq, token_dim)`, at every position the candidate of lowest final energy.
    - `candidates`: `(candidates, seq, token_dim)`, every candidate after the descent.
    - `final_energies`: `(candidates, seq)`, their energies $e_t$.
    - `energies`: `(candidates, steps + 1)`, each candidate's total energy at every step.
    - `trajectory`: `(candidates, steps + 1, seq, token_dim)` with `return_trajectory`, else
      `None`.
    """

    prediction: Float[Array, "seq token_dim"]
    candidates: Float[Array, "candidates seq token_dim"]
    final_energies: Float[Array, "candidates seq"]
    energies: Float[Array, "candidates steps"]
    trajectory: Float[Array, "candidates steps seq token_dim"] | None


# --------------------------------------------------------------------------- training


class ReplayBuffer(eqx.Module):
    """A ring buffer of past predictions, starting points for new descents (the replay
    buffer of energy-based models): functional, carried by the training loop and
    checkpointed with the model.

    **Attributes:**

    - `samples`: `(capacity, seq, token_dim)`.
    - `count`: how many predictions were ever added (the buffer holds the last `capacity`).
    """

    samples: Float[Array, "capacity seq token_dim"]
    count: Array

    @staticmethod
    def empty(capacity: int, seq: int, token_dim: int) -> "ReplayBuffer":
        """A buffer with room for `capacity` predictions of `(seq, token_dim)`."""
        capacity = positive_int("capacity", capacity)
        return ReplayBuffer(jnp.zeros((capacity, seq, token_dim)), jnp.zeros((), jnp.int32))

    def add(self, predictions: Float[Array, "n seq token_dim"]) -> "ReplayBuffer":
        """The buffer with `predictions` written over its oldest entries."""
        capacity, seq, token_dim = self.samples.shape
        check_shape("predictions", predictions, "n seq token_dim", seq=seq, token_dim=token_dim)
        slots = (self.count + jnp.arange(predictions.shape[0])) % capacity
        samples = self.samples.at[slots].set(predictions.astype(self.samples.dtype))
        return ReplayBuffer(samples, self.count + predictions.shape[0])

    def starts(self, key: PRNGKeyArray, noise: Array, ratio: float) -> Array:
        """`noise` `(n, seq, token_dim)` with each entry replaced, with probability `ratio`, by
        a uniformly drawn stored prediction (none while the buffer is empty); `ratio` is a
        probability, in $[0, 1]$."""
        _, seq, token_dim = self.samples.shape
        check_shape("noise", noise, "n seq token_dim", seq=seq, token_dim=token_dim)
        checked = check_values("ratio", ratio, lambda r: (r >= 0) & (r <= 1), "in [0, 1]")
        pick_key, use_key = jr.split(key)
        filled = jnp.minimum(self.count, self.samples.shape[0])
        index = jr.randint(pick_key, (noise.shape[0],), 0, jnp.maximum(filled, 1))
        use = (jr.uniform(use_key, (noise.shape[0],)) < checked) & (filled > 0)
        return jnp.where(use[:, None, None], self.samples[index].astype(noise.dtype), noise)


def _frozen(tree: PyTree) -> PyTree:
    """`tree` with no derivative through its arrays."""
    arrays, rest = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.lax.stop_gradient(arrays), rest)


def _backprop_steps(backprop_steps: int | None, steps: int, name: str) -> int:
    """The differentiated steps, from 1 to all `steps` (the default); `name` is the caller's
    name for `steps`."""
    if backprop_steps is None:
        return steps
    backprop_steps = positive_int("backprop_steps", backprop_steps)
    if backprop_steps > steps:
        raise ValueError(f"backprop_steps={backprop_steps} exceeds {name}={steps}")
    return backprop_steps


def thinking_steps_for_training(
    model: EnergyBasedTransformer,
    x: Float[Array, "seq token_dim"],
    y0: Float[Array, "seq token_dim"],
    *,
    num_steps: int,
    backprop_steps: int | None = None,
    detach: bool = False,
    noise_scale: float | None = None,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "backprop_steps seq token_dim"]:
    r"""The predictions after each of the last `backprop_steps` descent steps, the ones the
    training loss sees and differentiates through.

    The first `num_steps - backprop_steps` steps run without derivatives (truncation). With
    `detach`, each differentiated step starts from a detached candidate, so its loss
    differentiates through that step alone (the authors' example configuration's default);
    without, through every
    differentiated step before it (backpropagation through the unrolled descent, second
    derivatives of the energy at every step). `backprop_steps` defaults to all the steps;
    `key` is needed only with Langevin `noise_scale`. This is the loss's inside of
    [`train_ebt`][energyattn.models.train_ebt], public to build other losses on.
    """
    num_steps = positive_int("num_steps", num_steps)
    backprop_steps = _backprop_steps(backprop_steps, num_steps, "num_steps")
    energy = model.context(x)
    early = num_steps - backprop_steps
    if noise_scale is not None and key is None:
        raise ValueError("Langevin noise (noise_scale) needs a key")
    # A key whenever there is noise (checked above).
    early_key, late_key = (None, None) if noise_scale is None or key is None else jr.split(key)

    def noise(k: Array | None) -> dict:
        return {} if noise_scale is None else {"noise_scale": noise_scale, "key": k}

    y = y0
    if early:
        frozen = _frozen(energy)
        alpha = jax.lax.stop_gradient(model.step_size)
        y = descend(frozen, y, step_size=alpha, num_steps=early, **noise(early_key)).value
        y = jax.lax.stop_gradient(y)
    if not detach:
        solution = descend(
            energy,
            y,
            step_size=model.step_size,
            num_steps=backprop_steps,
            return_trajectory=True,
            **noise(late_key),
        )
        return cast(Array, solution.trajectory)[1:]  # recorded: return_trajectory=True

    def step(y: Array, k: Array | None) -> tuple[Array, Array]:
        y = descend(
            energy, jax.lax.stop_gradient(y), step_size=model.step_size, num_steps=1, **noise(k)
        ).value
        return y, y

    keys = None if late_key is None else jr.split(late_key, backprop_steps)
    _, predictions = jax.lax.scan(step, y, keys, length=backprop_steps)
    return predictions


def next_token_error(predictions: Array, x: Array) -> Array:
    """Mean squared error of the predictions of positions `0..seq-2` against tokens `1..seq-1`
    (the last position has no next token)."""
    return jnp.mean(jnp.square(predictions[..., :-1, :] - x[..., 1:, :]))


def _ebt_loss(
    params: PyTree, static: PyTree, buffer: Any, step_key: PRNGKeyArray, data: Any, config: tuple
) -> tuple[Array, Any]:
    (sequences,) = data
    batch_size, num_steps, backprop_steps, detach, init_scale, noise_scale, replay_ratio = config
    model = eqx.combine(params, static)
    pick_key, init_key, buffer_key, think_key = jr.split(step_key, 4)
    chosen = jr.choice(pick_key, sequences.shape[0], (batch_size,), replace=False)
    x = sequences[chosen]
    y0 = init_scale * jr.normal(init_key, x.shape, x.dtype)
    replay = isinstance(buffer, ReplayBuffer)  # else `()`: no buffer
    if replay:
        y0 = buffer.starts(buffer_key, y0, replay_ratio)

    def think(x: Array, y0: Array, key: Array) -> Array:
        return thinking_steps_for_training(
            model,
            x,
            y0,
            num_steps=num_steps,
            backprop_steps=backprop_steps,
            detach=detach,
            noise_scale=noise_scale,
            key=key,
        )

    predictions = jax.vmap(think)(x, y0, jr.split(think_key, batch_size))
    loss = next_token_error(predictions, x[:, None])
    if replay:
        buffer = buffer.add(jax.lax.stop_gradient(predictions[:, -1]))
    return loss, buffer


def _probability(name: str, value: Any) -> float:
    """A Python float in $[0, 1]$ fixed at trace time, or a `ValueError` naming it."""
    check_values(name, value, lambda p: (p >= 0) & (p <= 1), "in [0, 1]")
    return python_float(name, value, allow_zero=True)


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
    return sequences


@renamed_keywords("ea.models.train_ebt", num_steps="train_steps")
def train_ebt(
    model: EnergyBasedTransformer,
    sequences: Float[ArrayLike, "n seq token_dim"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    thinking_steps: int = 2,
    backprop_steps: int | None = None,
    detach_steps: bool = False,
    init_scale: float | None = None,
    noise_scale: float | None = None,
    replay_capacity: int = 0,
    replay_ratio: float = 0.5,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 1e-4,
    clip_norm: float = 1.0,
    checkpoint: Any = None,
    checkpoint_every: int = 100,
    time_limit: float | None = None,
    progress: bool = True,
    callback: Any = None,
) -> Any:
    r"""Train an energy-based transformer to predict every next token by thinking, through the
    thinking.

    $$\min_\theta\; \mathbb E_x\, \frac1K \sum_{s = S - K + 1}^{S}
      \big\lVert \hat y^{(s)}_{<T}(\theta) - x_{>1} \big\rVert^2,\qquad
      \hat y^{(s+1)} = \hat y^{(s)} - \alpha\,\nabla_{\hat y} E_\theta(\hat y^{(s)}; x)$$

    Each step draws `batch_size` sequences, starts every candidate from Gaussian noise (or,
    with a replay buffer, from a past prediction with probability `replay_ratio`), descends
    `thinking_steps` $= S$ steps and averages the next-token error of the predictions after
    the last `backprop_steps` $= K$ of them. The gradient flows through those steps: a
    derivative of $\nabla_{\hat y} E_\theta$, i.e. second derivatives of every attention
    layer, which energyattn's attention computes in O(seq) memory on the blockwise and ring
    paths. The loop is [`fit`][energyattn.models.train_inpainting]'s: AdamW with warm-up and
    cosine decay, step $s$ keyed by `fold_in(key, s)`, checkpoints (the replay buffer
    included) that resume exactly, divergence named by its step.

    **Arguments:**

    - `model`: the initial model.
    - `sequences`: training sequences `(n, seq, token_dim)`.
    - `key`: PRNG key (batches, starting points, noise).
    - `train_steps`: optimisation steps.
    - `thinking_steps`: descent steps per prediction ($S \ge 1$).
    - `backprop_steps`: the last $K$ steps are differentiated (default: all); the earlier
      ones run without derivatives (truncated backpropagation).
    - `detach_steps`: detach the candidate before every differentiated step, so each step's
      loss differentiates through that step alone (the default of the authors' example
      configuration, `no_mcmc_detach=False`).
    - `init_scale`: standard deviation of the starting noise (default: the model's).
    - `noise_scale`: optional Langevin noise $\sigma$ per step.
    - `replay_capacity`: size of the replay buffer (0: none); `replay_ratio`: the probability
      that a candidate starts from it.
    - the optimisation settings and `checkpoint`, `checkpoint_every`, `time_limit`,
      `progress`, `callback`: as for [`train_inpainting`][energyattn.models.train_inpainting].

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult] whose `state` is the replay buffer
    (or `None`).

    ??? cite "Source"

        A. Gladstone et al., *Energy-Based Transformers are Scalable Learners and Thinkers*
        (2025).
    """
    sequences = _check_sequences(model.transformer, sequences, batch_size)
    thinking_steps = positive_int("thinking_steps", thinking_steps)
    backprop_steps = _backprop_steps(backprop_steps, thinking_steps, "thinking_steps")
    noise = (
        None if noise_scale is None else python_float("noise_scale", noise_scale, allow_zero=True)
    )
    buffer: ReplayBuffer | tuple[()] = ()  # the loss's carried state: nothing, or the buffer
    if positive_int("replay_capacity", replay_capacity, minimum=0):
        buffer = ReplayBuffer.empty(replay_capacity, *sequences.shape[1:])
    config = (
        batch_size,
        thinking_steps,
        backprop_steps,
        bool(detach_steps),
        python_float("init_scale", model.init_scale if init_scale is None else init_scale),
        noise,
        _probability("replay_ratio", replay_ratio),
    )
    result = fit(
        model,
        _ebt_loss,
        (sequences,),
        config,
        key=key,
        train_steps=train_steps,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        time_limit=time_limit,
        progress=progress,
        callback=callback,
        state=buffer,
    )
    if isinstance(result.state, ReplayBuffer):
        return result
    return TrainResult(result.model, result.losses, result.step, result.finished, None)


def _next_token_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (sequences,) = data
    (batch_size,) = config
    model = eqx.combine(params, static)
    chosen = jr.choice(step_key, sequences.shape[0], (batch_size,), replace=False)
    x = sequences[chosen]
    return next_token_error(jax.vmap(model)(x), x)


@renamed_keywords("ea.models.train_next_token", num_steps="train_steps")
def train_next_token(
    model: CausalTransformer,
    sequences: Float[ArrayLike, "n seq token_dim"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int | None = None,
    weight_decay: float = 1e-4,
    clip_norm: float = 1.0,
    checkpoint: Any = None,
    checkpoint_every: int = 100,
    time_limit: float | None = None,
    progress: bool = True,
    callback: Any = None,
) -> Any:
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
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        clip_norm=clip_norm,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        time_limit=time_limit,
        progress=progress,
        callback=callback,
    )


def complete(
    model: EnergyBasedTransformer | CausalTransformer,
    x: Float[ArrayLike, "seq token_dim"],
    start: int,
    *,
    key: PRNGKeyArray | None = None,
    **thinking: Any,
) -> Float[Array, "seq token_dim"]:
    r"""Complete a sequence autoregressively: tokens `start..seq-1` are replaced, one after
    the other, by the model's prediction from the tokens before them (the given ones and the
    ones it predicted). An energy-based transformer thinks for every token
    (`thinking` are [`think`][energyattn.models.EnergyBasedTransformer.think]'s keyword
    arguments; `key` is needed); a `CausalTransformer` predicts in one pass."""
    x = jnp.asarray(x)
    seq = x.shape[0]
    if not 1 <= start < seq:
        raise ValueError(f"start must be from 1 to seq - 1 = {seq - 1}, got {start}")
    if isinstance(model, EnergyBasedTransformer) and key is None:
        raise ValueError("an EnergyBasedTransformer thinks with noise: pass key=")

    def fill(t: Any, x: Array) -> Array:
        if isinstance(model, EnergyBasedTransformer) and key is not None:  # (key: checked)
            predicted = model.think(x, key=jr.fold_in(key, t), **thinking).prediction
        else:
            predicted = model(x)
        return x.at[t].set(predicted[t - 1].astype(x.dtype))

    return jax.lax.fori_loop(start, seq, fill, x)
