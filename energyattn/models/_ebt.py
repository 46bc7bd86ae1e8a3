"""Energy-based transformers: a causal transformer that scores (context, candidate) pairs with
an energy, predictions refined by descending it ("thinking"), training through the descent."""

import dataclasses
import math
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
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
from .._dtypes import result_dtype
from .._energy import AbstractEnergy, BlockSize
from .._solver import descend
from ._causal import (
    CausalTransformer,
    Implementation,
    _check_sequences,
    next_token_error,
)
from ._replay import ReplayBuffer
from ._training import TrainOptions, TrainResult, fit


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
        changed = self.transformer.with_implementation(implementation, block_size)
        return eqx.tree_at(lambda m: m.transformer, self, changed)

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
        if not jnp.issubdtype(x.dtype, jnp.floating):
            # The candidates start as noise of the tokens' dtype and descend continuously.
            raise ValueError(
                "think needs float token embeddings x of shape (seq, token_dim), got dtype "
                f"{x.dtype}: embed integer tokens first (e.g. one-hot or a lookup table), "
                "or cast them, x.astype(float)"
            )
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

        y = y.astype(result_dtype(y, self.model.candidate_embed.weight))  # as in `states`
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
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
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
    paths. The loop is every trainer's ([`TrainOptions`][energyattn.models.TrainOptions]):
    AdamW with warm-up and cosine decay, step $s$ keyed by `fold_in(key, s)`, checkpoints
    (the replay buffer included) that resume exactly, divergence named by its step.

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
    - `batch_size`: sequences per step.
    - `options`: the optimiser, checkpoints, time limit, progress and callback, a
      [`TrainOptions`][energyattn.models.TrainOptions] (learning rate `1e-3` unless set).

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
        options=options,
        default_learning_rate=1e-3,
        state=buffer,
    )
    if isinstance(result.state, ReplayBuffer):
        return result
    return dataclasses.replace(result, state=None)


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
