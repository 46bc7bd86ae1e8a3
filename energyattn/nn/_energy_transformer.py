"""The Energy Transformer: one energy whose gradient descent is a recurrent transformer block."""

from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import (
    check_finite,
    check_mask,
    check_shape,
    default_dtype,
    keyword_arguments,
    positive_int,
    python_float,
)
from .._custom_types import Scalar
from .._energy import (
    Implementation,
    SumEnergy,
    TransformerAttentionEnergy,
    TransformerMemoryEnergy,
    check_implementation,
    layer_norm_lagrangian,
    legendre_energy,
    transformer_attention_energy,
    transformer_memory_energy,
)
from .._hyperparameters import hyperparameter, hyperparameter_fields
from .._mask import SegmentIds
from .._solver import Solution, descend
from ._common import empty_descent


class EnergyLayerNorm(eqx.Module):
    r"""Layer normalisation as the gradient of a convex Lagrangian (scalar gain).

    $$L(x) = D\,\gamma\sqrt{\tfrac1D\textstyle\sum_i (x_i-\bar x)^2 + \epsilon}
      + \delta\cdot x, \qquad
      g = \nabla L(x) = \gamma\,\frac{x - \bar x}{\sqrt{\mathrm{var}(x)+\epsilon}} + \delta,
      \qquad E^{\mathrm{LN}}(x) = g\cdot x - L(x).$$

    Calling the module returns $g = \nabla L(x)$, obtained with `jax.grad` of
    [`lagrangian`][energyattn.nn.EnergyLayerNorm.lagrangian] (it equals the usual layer norm
    with a scalar gain). [`energy`][energyattn.nn.EnergyLayerNorm.energy] is the Legendre
    energy of the neurons. Works on one token `(dim,)` or on tokens `(seq, dim)`.

    **Arguments:**

    - `dim`: the token dimension $D$.
    - `use_bias`: learn the per-dimension bias $\delta$ (default `True`).
    - `eps`: $\epsilon > 0$.
    - `gamma`: the initial scalar gain.
    - `dtype`: parameter dtype (default float32, float64 under `jax_enable_x64`).

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), the tutorial's
        `EnergyLayerNorm`.
    """

    gamma: Float[Array, ""]
    delta: Float[Array, " dim"] | None
    eps: float = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        use_bias: bool = True,
        eps: float = 1e-5,
        gamma: float = 1.0,
        dtype: Any = None,
    ):
        dtype = default_dtype(dtype)
        self.dim = positive_int("dim", dim)
        self.eps = python_float("eps", eps)
        self.gamma = jnp.asarray(gamma, dtype)
        self.delta = jnp.zeros(self.dim, dtype) if use_bias else None

    def _check(self, x: Any) -> Array:
        shape = jnp.shape(x)
        if len(shape) not in (1, 2) or shape[-1] != self.dim:
            raise ValueError(
                f"x must have shape (dim={self.dim},) or (seq, dim={self.dim}), got {tuple(shape)}"
            )
        return jnp.asarray(x)

    def lagrangian(self, x: Float[ArrayLike, "*seq dim"]) -> Scalar:
        """The Lagrangian $L(x)$, summed over tokens."""
        return layer_norm_lagrangian(self._check(x), self.gamma, self.delta, eps=self.eps)

    def __call__(self, x: Float[ArrayLike, "*seq dim"]) -> Float[Array, "*seq dim"]:
        """The layer norm $g = \\nabla L(x)$, same shape as `x`."""
        return jax.grad(self.lagrangian)(self._check(x))

    def energy(self, x: Float[ArrayLike, "*seq dim"]) -> Scalar:
        """The Legendre energy $g\\cdot x - L(x)$, summed over tokens."""
        return legendre_energy(self.lagrangian, self._check(x))


class EnergyTransformer(eqx.Module):
    r"""The Energy Transformer: attention and a Hopfield memory as one energy of the tokens.

    $$E(g) = -\frac1\beta \sum_{h}\sum_{C} \log \sum_{B\ne C} e^{\beta\,K_{hB}\cdot Q_{hC}}
      \;-\; \tfrac12 \sum_{B,\mu} \mathrm{ReLU}(\xi_\mu\cdot g_B)^2,
      \qquad g = \mathrm{LN}(x),$$

    $$x_{t+1} = x_t - \alpha\, \frac{\partial E}{\partial g}\Big|_{g = \mathrm{LN}(x_t)}.$$

    One descent step looks like a transformer block (attention + MLP with tied weights,
    layer norm, residual); the whole "depth" is `num_steps` steps of the same block, run by
    [`descend`][energyattn.descend] in `lax.scan`. Along these dynamics the Lyapunov function
    [`lyapunov`][energyattn.nn.EnergyTransformer.lyapunov] $E^{\mathrm{LN}}(x) + E(g)$ does not
    increase: in continuous time $\dot E = -\partial_g E^\top\, \nabla^2 L\, \partial_g E
    + O(\epsilon)$, with $\nabla^2 L \succeq 0$ because the Lagrangian is convex (the
    $O(\epsilon)$ term is the layer norm's departure from scale invariance, of order $\epsilon$).

    **Arguments:**

    - `dim`: token dimension $D$.
    - `num_heads`: $H$; `head_dim`: $Y$; `num_memories`: $M$ (rows of $\xi$).
    - `beta`: attention inverse temperature (default $1/\sqrt{Y}$).
    - `trainable_beta`: learn $\beta$ and `memory_beta` (default `False`: fixed
      hyperparameters; see [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `include_self`: let each token attend to itself too (the released ImageNet weights were
      trained with it).
    - `memory`: `"relu"` (rectified quadratic, default) or `"softmax"` memory energy;
      `memory_beta` is the softmax form's inverse temperature.
    - `step_size`: $\alpha$ (default 0.1; fixed); `num_steps`: $T$ (default 12).
    - `eps`, `use_bias`: of the [`EnergyLayerNorm`][energyattn.nn.EnergyLayerNorm].
    - `implementation`: how the attention energy's log-sum-exp is computed: `"auto"` (the
      Pallas kernels on a GPU or TPU; on a CPU blockwise above $2^{17}$ score entries,
      heads x seq x seq),
      `"naive"`, `"blockwise"`, `"pallas"` (the kernels everywhere) or `"cudnn"` (only with
      `include_self=True` and no mask, on a GPU in half precision); see
      [`select_implementation`][energyattn.select_implementation].
    - `dtype`: parameter dtype; `key`: a JAX PRNG key for the initial weights
      ($W^Q, W^K, \xi$ drawn from $\mathcal N(0, 1/D)$, so scores start of order one).

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023), and the Energy Transformer
        tutorial.
    """

    w_query: Float[Array, "heads head_dim dim"]
    w_key: Float[Array, "heads head_dim dim"]
    memories: Float[Array, "mem dim"]
    layer_norm: EnergyLayerNorm
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    fixed_memory_beta: float | None = eqx.field(static=True)
    trained_memory_beta: Float[Array, ""] | None
    step_size: float = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    include_self: bool = eqx.field(static=True)
    memory: Literal["relu", "softmax"] = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)

    @keyword_arguments("ea.nn.EnergyTransformer")
    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        head_dim: int,
        num_memories: int,
        beta: float | None = None,
        trainable_beta: bool = False,
        include_self: bool = False,
        memory: Literal["relu", "softmax"] = "relu",
        memory_beta: float = 1.0,
        step_size: float = 0.1,
        num_steps: int = 12,
        eps: float = 1e-5,
        use_bias: bool = True,
        implementation: Implementation = "auto",
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dim = positive_int("dim", dim)
        check_implementation(implementation)
        num_heads = positive_int("num_heads", num_heads)
        head_dim = positive_int("head_dim", head_dim)
        num_memories = positive_int("num_memories", num_memories)
        if memory not in ("relu", "softmax"):
            raise ValueError(f"memory must be 'relu' or 'softmax', got {memory!r}")
        dtype = default_dtype(dtype)
        kq, kk, km = jr.split(key, 3)
        scale = dim**-0.5
        self.w_query = scale * jr.normal(kq, (num_heads, head_dim, dim), dtype)
        self.w_key = scale * jr.normal(kk, (num_heads, head_dim, dim), dtype)
        self.memories = scale * jr.normal(km, (num_memories, dim), dtype)
        self.layer_norm = EnergyLayerNorm(dim, use_bias=use_bias, eps=eps, dtype=dtype)
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", head_dim**-0.5 if beta is None else beta, trainable_beta, dtype
        )
        self.fixed_memory_beta, self.trained_memory_beta = hyperparameter_fields(
            "memory_beta", memory_beta, trainable_beta, dtype
        )
        self.step_size = python_float("step_size", step_size)
        self.num_steps = positive_int("num_steps", num_steps, minimum=0)
        self.include_self = bool(include_self)
        self.memory = memory
        self.implementation = implementation

    @property
    def dim(self) -> int:
        return self.w_query.shape[-1]

    @property
    def beta(self) -> float | Float[Array, ""]:
        """The attention's inverse temperature: a float, or an array leaf when trainable."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    @property
    def memory_beta(self) -> float | Float[Array, ""]:
        """The softmax memory's inverse temperature (as `beta`)."""
        return hyperparameter("memory_beta", self.fixed_memory_beta, self.trained_memory_beta)

    def as_energy(self) -> SumEnergy:
        """The energy $E(g)$ as a composable [`SumEnergy`][energyattn.SumEnergy] with terms
        `"attention"` and `"memory"` (call it as `energy(g, mask)`; see
        [`energy_tree`][energyattn.energy_tree])."""
        return SumEnergy(
            {
                "attention": TransformerAttentionEnergy(
                    self.w_query,
                    self.w_key,
                    beta=self.beta,
                    include_self=self.include_self,
                    implementation=self.implementation,
                ),
                "memory": TransformerMemoryEnergy(
                    self.memories, kind=self.memory, beta=self.memory_beta
                ),
            }
        )

    def attention_energy(
        self,
        g: Float[ArrayLike, "seq dim"],
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
    ) -> Scalar:
        """$E^{\\mathrm{ATT}}(g)$; `mask[C, B]` is `True` where token C may attend to B."""
        return transformer_attention_energy(
            g,
            self.w_query,
            self.w_key,
            beta=self.beta,
            mask=mask,
            include_self=self.include_self,
            implementation=self.implementation,
        )

    def memory_energy(self, g: Float[ArrayLike, "seq dim"]) -> Scalar:
        """$E^{\\mathrm{HN}}(g)$, the Hopfield-network (MLP) energy."""
        return transformer_memory_energy(g, self.memories, kind=self.memory, beta=self.memory_beta)

    def energy(
        self,
        g: Float[ArrayLike, "seq dim"],
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
    ) -> Scalar:
        """$E(g) = E^{\\mathrm{ATT}}(g) + E^{\\mathrm{HN}}(g)$ at the activations `g`."""
        return self.as_energy()(jnp.asarray(g), mask)

    def lyapunov(
        self,
        x: Float[ArrayLike, "seq dim"],
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
    ) -> Scalar:
        """$E^{\\mathrm{LN}}(x) + E(\\mathrm{LN}(x))$, non-increasing along the dynamics."""
        x = jnp.asarray(x)
        return self.layer_norm.energy(x) + self.energy(self.layer_norm(x), mask)

    def _inputs(self, x: Any, mask: Any) -> tuple[Array, Array | SegmentIds | None]:
        check_shape("x", x, "seq dim", dim=self.dim)
        x = check_finite("x", x)
        if mask is not None:
            mask = check_mask(mask, (x.shape[0], x.shape[0]), "seq seq", segments=True)
        return x, mask

    def recall(
        self,
        x: Float[ArrayLike, "seq dim"],
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_trajectory: bool = False,
    ) -> Solution:
        """Run the dynamics with [`descend`][energyattn.descend] (activation = the layer norm).

        **Arguments:**

        - `x`: initial tokens $x_0$, shape `(seq, dim)`.
        - `mask`: optional boolean `(seq, seq)` attention mask.
        - `step_size`, `num_steps`: override the module's $\\alpha$ and $T$.
        - `return_trajectory`: keep every state $x_t$.

        **Returns:**

        A [`Solution`][energyattn.Solution]: final tokens $x_T$, the energy $E(g_t)$ at every
        step (`energies`), and optionally the states (`trajectory`).
        """
        x, mask = self._inputs(x, mask)
        num_steps = self.num_steps if num_steps is None else num_steps
        if x.shape[0] == 0:
            return empty_descent(
                x, positive_int("num_steps", num_steps, minimum=0), return_trajectory
            )
        return descend(
            self.as_energy(),
            x,
            mask,
            step_size=self.step_size if step_size is None else step_size,
            num_steps=num_steps,
            activation=self.layer_norm,
            return_trajectory=return_trajectory,
        )

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "seq dim"],
        *,
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq dim"]: ...

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "seq dim"],
        *,
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "seq dim"], Solution]: ...

    def __call__(
        self,
        x: Float[ArrayLike, "seq dim"],
        *,
        mask: Bool[ArrayLike, "seq seq"] | SegmentIds | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq dim"] | tuple[Float[Array, "seq dim"], Solution]:
        """**Arguments:**

        - `x`: tokens, shape `(seq, dim)`.
        - `mask`: optional boolean `(seq, seq)` attention mask.
        - `return_solution`: also return the descent's [`Solution`][energyattn.Solution]
          (`energies` and `trajectory`).
        - `key`: unused (no randomness); accepted for Equinox layer compatibility.

        **Returns:**

        The tokens after `num_steps` steps, $x_T$ (read them out through `layer_norm`); with
        `return_solution=True` also the descent.
        """
        descent = self.recall(x, mask, return_trajectory=return_solution)
        return (descent.value, descent) if return_solution else descent.value
