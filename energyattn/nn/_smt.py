"""Spin-model transformer attention: the output is the steady state of vector spins with
asymmetric couplings softmax(q k^T), in the TAP mean-field theory of their dynamics."""

from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import (
    check_finite,
    check_mask,
    check_shape,
    default_dtype,
    keyword_arguments,
    positive_int,
)
from .._custom_types import ScalarLike
from .._hyperparameters import hyperparameter, hyperparameter_fields
from .._solver import DEFAULT_MAX_STEPS, AbstractAdjoint, AbstractIterativeSolver, Solution
from ..spin.smt import steady_state
from ._common import linear


class SpinTransformerAttention(eqx.Module):
    r"""Attention as the steady state of a non-equilibrium vector-spin system (spin-model
    transformers).

    Per head $h$ (head dimension $d$, radius $R = \sqrt{d/2 - 1}$): the head's slice of each
    token is normalised to norm $R$, $\hat x_{ih} = R\, x_{ih} / \lVert x_{ih}\rVert$;
    queries and keys are one linear map of the normalised tokens,
    $[q \mid k] = \hat x\, W^\top$ with $W$ of shape `(2 dim, dim)` (no bias; $q$ the first
    `dim` outputs, $k$ the rest, head $h$ in columns $hd$ to $(h+1)d$); the couplings are
    $J_h = \operatorname{softmax}(q_h k_h^\top)$ row-wise (asymmetric; no $1/\sqrt d$ unless
    `scale_couplings=True`); the output is the heads' steady-state magnetizations
    ([`ea.spin.smt.steady_magnetizations`][energyattn.spin.smt.steady_magnetizations] with inputs
    $\hat x_h$, couplings $J_h$ and $m_0 = \mathbf 1/\sqrt d$), concatenated, shape
    `(tokens, dim)`. There is no value or output projection. The steady state is found by
    Anderson acceleration and differentiated implicitly, so the layer trains with
    `jax.grad`.

    **Arguments:**

    - `dim`: token dimension.
    - `num_heads`: number of heads; `dim / num_heads` must be an integer of at least 3 (so
      that $R > 0$).
    - `beta`: inverse temperature $\beta$ (default 1).
    - `trainable_beta`: learn $\beta$ (default `False`: a fixed hyperparameter; see
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `scale_couplings`: divide $q_h k_h^\top$ by $\sqrt d$ before the softmax (default
      `False`, as the reference).
    - `solver`, `adjoint`, `max_steps`, `start_steps`, `throw`: passed to
      [`ea.spin.smt.steady_state`][energyattn.spin.smt.steady_state] (default
      `ea.Anderson(rtol=1e-5, atol=1e-6, history=5)`, implicit derivatives, 256 steps (the
      package's one bound), a start after 5 iterations of the first-order mean-field map,
      raise when a head does not converge).
    - `dtype`: parameter dtype; `key`: PRNG key (keyword only).

    !!! warning "On CPU"

        XLA's XNNPACK (YNN) fusions can miscompile programs built on this layer (NaN steady
        states, wrong losses, depending on the compilation; jaxlib 0.10.2 and 0.12). Run with
        `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` set before JAX starts, as the
        `energyattn` commands and tests do (see the known issues in the docs).

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023), its transformer module (normalisation to
        $R$ per head, one query-key projection, softmax couplings).
    """

    to_qk: eqx.nn.Linear
    solver: AbstractIterativeSolver | None  # None: steady_state's default
    adjoint: AbstractAdjoint | None
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    scale_couplings: bool = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    start_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    @keyword_arguments("ea.nn.SpinTransformerAttention")
    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        beta: ScalarLike = 1.0,
        trainable_beta: bool = False,
        scale_couplings: bool = False,
        solver: AbstractIterativeSolver | None = None,
        adjoint: AbstractAdjoint | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        start_steps: int = 5,  # as steady_state's default
        throw: bool = True,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.dim = positive_int("dim", dim)
        self.num_heads = positive_int("num_heads", num_heads)
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({dim}) must be a multiple of num_heads ({num_heads})")
        self.head_dim = self.dim // self.num_heads
        if self.head_dim < 3:
            raise ValueError(
                f"the head dimension dim / num_heads must be at least 3 (the radius "
                f"sqrt(head_dim / 2 - 1) must be positive), got {self.head_dim}"
            )
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", beta, trainable_beta, dtype
        )
        self.scale_couplings = bool(scale_couplings)
        self.solver = solver
        self.adjoint = adjoint
        self.max_steps = positive_int("max_steps", max_steps)
        self.start_steps = positive_int("start_steps", start_steps)
        self.throw = bool(throw)
        self.to_qk = linear(
            self.dim, 2 * self.dim, use_bias=False, dtype=default_dtype(dtype), key=key
        )

    @property
    def radius(self) -> float:
        """$R = \\sqrt{d/2 - 1}$, the radius of every head's spins."""
        return float(np.sqrt(self.head_dim / 2 - 1))

    def inputs(self, x: Float[ArrayLike, "tokens dim"]) -> Float[Array, "heads tokens head_dim"]:
        """The heads' inputs: each head's slice of each token, normalised to norm $R$."""
        check_shape("x", x, "tokens dim", dim=self.dim)
        x = jnp.asarray(x)
        heads = x.reshape(x.shape[0], self.num_heads, self.head_dim).transpose(1, 0, 2)
        norm = jnp.linalg.norm(heads, axis=-1, keepdims=True)
        # A zero slice stays zero instead of becoming NaN.
        return self.radius * heads / jnp.maximum(norm, jnp.finfo(heads.dtype).tiny)

    def couplings(
        self,
        x: Float[ArrayLike, "tokens dim"],
        *,
        mask: Bool[ArrayLike, "tokens tokens"] | None = None,
    ) -> Float[Array, "heads tokens tokens"]:
        r"""The couplings $J_h = \operatorname{softmax}(q_h k_h^\top)$ of each head
        (`mask`: `True` where token $i$ may couple to token $j$)."""
        return self._couplings(self.inputs(x), mask)

    def _couplings(
        self, inputs: Float[Array, "heads tokens head_dim"], mask: Any
    ) -> Float[Array, "heads tokens tokens"]:
        tokens = inputs.shape[1]
        merged = inputs.transpose(1, 0, 2).reshape(tokens, self.dim)
        qk = jax.vmap(self.to_qk)(merged)
        q, k = (
            part.reshape(tokens, self.num_heads, self.head_dim).transpose(1, 0, 2)
            for part in jnp.split(qk, 2, axis=-1)
        )
        scores = jnp.einsum("hid,hjd->hij", q, k)
        if self.scale_couplings:
            scores = scores / np.sqrt(self.head_dim)
        if mask is not None:
            mask = check_mask(mask, (tokens, tokens), "tokens tokens")
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        return jax.nn.softmax(scores, axis=-1)

    @property
    def beta(self) -> float | Float[Array, ""]:
        """The inverse temperature $\\beta$: a float, or an array leaf when trainable."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "tokens dim"],
        *,
        mask: Bool[ArrayLike, "tokens tokens"] | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "tokens dim"]: ...

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "tokens dim"],
        *,
        mask: Bool[ArrayLike, "tokens tokens"] | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "tokens dim"], Solution]: ...

    def __call__(
        self,
        x: Float[ArrayLike, "tokens dim"],
        *,
        mask: Bool[ArrayLike, "tokens tokens"] | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "tokens dim"] | tuple[Float[Array, "tokens dim"], Solution]:
        """**Arguments:**

        - `x`: the tokens, shape `(tokens, dim)`.
        - `mask`: optional boolean `(tokens, tokens)`, `True` where token $i$ may couple to
          token $j$ (masked scores are set to the dtype's minimum before the softmax, as
          the reference).
        - `return_solution`: also return the heads' [`Solution`][energyattn.Solution]
          (batched over heads: `value` `(heads, tokens, head_dim)`, `num_steps` `(heads,)`).
        - `key`: unused (no randomness); accepted for Equinox layer compatibility.

        **Returns:**

        The steady-state magnetizations of the heads, concatenated, shape `(tokens, dim)`;
        with `return_solution=True` also the solution.
        """
        del key
        check_shape("x", x, "tokens dim", dim=self.dim)
        # As the other implicit layers: with `throw`, a NaN or inf input is named as such;
        # with `throw=False` each example's result code reports it (per example under vmap).
        x = check_finite("the input x", x) if self.throw else jnp.asarray(x)
        inputs = self.inputs(x)
        J = self._couplings(inputs, mask)

        def head(x_h, J_h):
            return steady_state(
                x_h,
                J_h,
                beta=self.beta,
                R=self.radius,
                solver=self.solver,
                adjoint=self.adjoint,
                max_steps=self.max_steps,
                start_steps=self.start_steps,
                throw=self.throw,
            )

        solution = jax.vmap(head)(inputs, J)
        out = solution.value.transpose(1, 0, 2).reshape(inputs.shape[1], self.dim)
        return (out, solution) if return_solution else out
