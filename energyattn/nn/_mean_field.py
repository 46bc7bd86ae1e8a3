"""Deep implicit attention: a layer's output is the mean-field response of a vector-spin system."""

import math
from collections.abc import Callable
from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_finite, check_shape, default_dtype, positive_int
from .._dtypes import result_dtype
from .._solver import (
    AbstractAdjoint,
    AbstractIterativeSolver,
    Anderson,
    ImplicitAdjoint,
    Solution,
    fixed_point,
)
from ..spin.mean_field import (
    attention_couplings,
    check_couplings,
    neural_mean_field,
    tap_cavity_variances,
    tap_spin_means,
    transformer_block_as_mean_field,
    vector_couplings,
)

Variant = Literal["neural", "tap"]


# max_x d/dx [x Phi(x)] = Phi(x) + x phi(x), attained at x = sqrt(2).
GELU_LIPSCHITZ = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)


def gelu(x: Array) -> Array:
    """GELU with the exact error function (not the tanh approximation)."""
    return jax.nn.gelu(x, approximate=False)


def _mlp(dim: int, hidden: int, dtype: Any, key: PRNGKeyArray) -> eqx.nn.MLP:
    return eqx.nn.MLP(dim, dim, hidden, depth=1, activation=gelu, dtype=dtype, key=key)


def _cast(dtype: Any) -> Callable[[Any], Any]:
    """Cast every floating-point array of a pytree to `dtype` (other leaves unchanged)."""
    return lambda tree: jax.tree.map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree
    )


class MeanFieldAttention(eqx.Module):
    r"""Deep implicit attention: the spin means of a vector-spin system probed by the inputs.

    The inputs $x_i$ are the external fields on $N$ sites of $d$-dimensional spins with
    learned couplings $J_{ij}$
    ([`ea.spin.mean_field.vector_couplings`][energyattn.spin.mean_field.vector_couplings] of
    the raw `weight`); the output is a fixed point of mean-field equations, found by
    [`ea.fixed_point`][energyattn.fixed_point] and differentiated implicitly. Two variants:

    - `"neural"` (fast): $z_i = \sum_j J_{ij} z_j - f_\theta(z_i) + x_i$, with an MLP
      $f_\theta$ ($d \to$ `hidden` $\to d$, exact GELU) amortising the Onsager correction
      ([`ea.spin.mean_field.neural_mean_field`][energyattn.spin.mean_field.neural_mean_field]).
      State $z$, `(spins, dim)`.
    - `"tap"` (slow and explicit): adaptive TAP with a unit Gaussian prior, state $(m, V)$ of
      spin means and $d\times d$ cavity variances
      ([`ea.spin.mean_field.tap_spin_means`][energyattn.spin.mean_field.tap_spin_means]);
      with `lin_response=True` the cavity variances follow the linear-response
      self-consistency
      ([`tap_cavity_variances`][energyattn.spin.mean_field.tap_cavity_variances]), a dense
      $(Nd)\times(Nd)$ solve per iteration, $O(N^3d^3)$; with `lin_response=False` they stay
      0 and this is naive mean field, $m = (I - J)^{-1}x$.

    The output is the spin means, `(spins, dim)`. [`solve`][energyattn.nn.MeanFieldAttention.solve]
    returns the whole [`Solution`][energyattn.Solution] (steps, residual, and for `"tap"` the
    cavity variances).

    **Arguments:**

    - `num_spins`: $N$, the number of sites (sequence length; fixed, the couplings are
      per pair of sites).
    - `dim`: $d$.
    - `variant`: `"neural"` (default) or `"tap"`.
    - `sym_internal`, `sym_sites`: symmetrise the couplings (default: off for `"neural"`, on
      for `"tap"`, where the linear response assumes symmetric couplings).
    - `lin_response`: `"tap"` only, see above.
    - `hidden`: width of $f_\theta$ (default $4d$; `"neural"` only).
    - `weight_std`: standard deviation of the initial raw couplings (default
      $1/\sqrt{N d^2}$, so $\lVert J\rVert = O(1)$, as the seed recommends).
    - `solver`, `adjoint`, `max_steps`: passed to `ea.fixed_point`; the solver carries the
      tolerances (defaults like the seed's: `ea.Anderson(rtol=1e-4, atol=1e-6)`, implicit
      backward, 40 steps). The 40 is the seed's forward budget (its DEQ's
      `solver_fwd_max_iter=40`), kept as part of the model the seed describes (a layer
      trained at a bounded cost per step) instead of the package's default of 256.
    - `contraction`: `"neural"` only. When set to $c \in (0, 1)$, the couplings and the
      correction are shrunk together (by $\min(1, c/B)$, $B$ the
      [`lipschitz_bound`][energyattn.nn.MeanFieldAttention.lipschitz_bound]) so the map is a
      contraction with constant at most $c$: the fixed point exists, is unique and every
      solver reaches it. Training without it can drive the map out of the contractive
      regime, where solves stop converging (a reparametrisation, not part of the seed).
    - `throw`: whether calling the layer raises when the input is NaN/inf or the solver
      does not converge (default). With `False` nothing raises: the layer returns the best
      iterate found, like the seed's DEQ, and `solve` reports the result code; training
      loops that must not stop use this. Under `jax.vmap` each example gets its own
      answer and code: a NaN example returns the start (zeros: no finite iterate was
      found) with `RESULTS.nonfinite`, and the other examples are unaffected.
      bfloat16 and float16 layers or inputs are solved in float32 (the output keeps the
      half-precision dtype): in 8 or 11 bits the solver's own arithmetic fails.
    - `dtype`: parameter dtype; `key`: PRNG key (keyword only).

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention: A Mean-Field Theory Perspective on Attention
        Mechanisms* (2021).
    """

    weight: Float[Array, "spins spins dim dim"]
    correction: eqx.nn.MLP | None
    solver: AbstractIterativeSolver
    adjoint: AbstractAdjoint
    num_spins: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    variant: str = eqx.field(static=True)
    sym_internal: bool = eqx.field(static=True)
    sym_sites: bool = eqx.field(static=True)
    lin_response: bool = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)
    contraction: float | None = eqx.field(static=True)

    def __init__(
        self,
        num_spins: int,
        dim: int,
        *,
        variant: Variant = "neural",
        sym_internal: bool | None = None,
        sym_sites: bool | None = None,
        lin_response: bool = True,
        hidden: int | None = None,
        weight_std: float | None = None,
        solver: AbstractIterativeSolver | None = None,
        adjoint: AbstractAdjoint | None = None,
        max_steps: int = 40,
        throw: bool = True,
        contraction: float | None = None,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        if variant not in ("neural", "tap"):
            raise ValueError(f"variant must be 'neural' or 'tap', got {variant!r}")
        self.num_spins = positive_int("num_spins", num_spins)
        self.dim = positive_int("dim", dim)
        self.variant = variant
        tap = variant == "tap"
        self.sym_internal = tap if sym_internal is None else bool(sym_internal)
        self.sym_sites = tap if sym_sites is None else bool(sym_sites)
        self.lin_response = bool(lin_response)
        dtype = default_dtype(dtype)
        std = float(1 / np.sqrt(num_spins * dim**2) if weight_std is None else weight_std)
        wkey, mkey = jr.split(key)
        self.weight = (std * jr.normal(wkey, (num_spins, num_spins, dim, dim), dtype)).astype(dtype)
        if tap:
            self.correction = None
        else:
            hidden = 4 * self.dim if hidden is None else positive_int("hidden", hidden)
            self.correction = _mlp(self.dim, hidden, dtype, mkey)
        self.solver = Anderson(rtol=1e-4, atol=1e-6) if solver is None else solver
        self.adjoint = ImplicitAdjoint() if adjoint is None else adjoint
        self.max_steps = positive_int("max_steps", max_steps)
        self.throw = bool(throw)
        if contraction is not None:
            if tap:
                raise ValueError("contraction applies to the 'neural' variant only")
            if not 0 < float(contraction) < 1:
                raise ValueError(f"contraction must be in (0, 1), got {contraction!r}")
        self.contraction = None if contraction is None else float(contraction)

    def __check_init__(self):
        check_couplings(self.weight, self.num_spins, self.dim)

    def couplings(self) -> Float[Array, "spins spins dim dim"]:
        """The effective couplings $J_{ij}$ (symmetrised as configured, zero diagonal)."""
        return vector_couplings(
            self.weight, sym_internal=self.sym_internal, sym_sites=self.sym_sites
        )

    def lipschitz_bound(self) -> Float[Array, ""]:
        r"""An upper bound on the Lipschitz constant of the neural mean-field map in $z$:
        $\lVert J\rVert_2 + \lVert W_2\rVert_2 \lVert W_1\rVert_2 \max|\mathrm{GELU}'|$
        (spectral norms; $J$ as an $(Nd)\times(Nd)$ matrix). Below 1 the map is a contraction:
        its fixed point is unique and Picard iteration converges to it from anywhere."""
        if self.variant != "neural":
            raise ValueError("lipschitz_bound is defined for the 'neural' variant only")
        return self._bounds(self.couplings())[0]

    def _bounds(self, J: Array) -> tuple[Array, Array]:
        n, d = self.num_spins, self.dim
        coupling = jnp.linalg.norm(jnp.swapaxes(J, 1, 2).reshape(n * d, n * d), ord=2)
        first, second = cast(eqx.nn.MLP, self.correction).layers  # the neural variant's
        correction = (
            jnp.linalg.norm(second.weight, ord=2)
            * jnp.linalg.norm(first.weight, ord=2)
            * GELU_LIPSCHITZ
        )
        return coupling + correction, coupling

    def _map(self) -> Callable[[Any, Array], Any]:
        """The mean-field map with everything that does not depend on the state computed once
        (the couplings, and with `contraction` their rescaling), not once per iteration."""
        J = self.couplings()
        if self.variant == "neural":
            mlp = cast(eqx.nn.MLP, self.correction)  # set in the neural variant
            correction: Callable[[Array], Array] = mlp
            if self.contraction is not None:
                # Shrink J and f together so the bound on the map's Lipschitz constant is at
                # most `contraction`: the fixed point exists, is unique, and is reached.
                scale = jnp.minimum(1.0, self.contraction / self._bounds(J)[0])
                J = scale * J
                correction = lambda u: scale * mlp(u)  # noqa: E731
            return lambda z, x: neural_mean_field(z, x, J, correction)
        if self.lin_response:
            return lambda state, x: (
                tap_spin_means(state[0], state[1], x, J),
                tap_cavity_variances(state[1], J),
            )
        zero = jnp.zeros((self.num_spins, self.dim, self.dim), J.dtype)
        return lambda m, x: tap_spin_means(m, zero, x, J)

    def update(self, state: Any, x: Float[Array, "spins dim"]) -> Any:
        """One application of the mean-field map to `state` (`z`, or `(m, V)` for `"tap"` with
        linear response, or `m`)."""
        return self._map()(state, x)

    def init_state(self, x: Float[Array, "spins dim"]) -> Any:
        """The solver's start: zeros (spin means, and cavity variances for `"tap"`)."""
        zeros = jnp.zeros_like(x)
        if self.variant == "tap" and self.lin_response:
            return zeros, jnp.zeros((self.num_spins, self.dim, self.dim), x.dtype)
        return zeros

    def solve(
        self, x: Float[ArrayLike, "spins dim"], *, state0: Any = None, throw: bool | None = None
    ) -> Solution:
        """Solve the mean-field equations for input fields `x`.

        **Arguments:**

        - `x`: the inputs, shape `(spins, dim)`.
        - `state0`: optional start (default: `init_state(x)`, zeros).
        - `throw`: raise unless the solver converged; `False` returns the result code
          (default: the layer's `throw`).

        **Returns:**

        The [`Solution`][energyattn.Solution]; its `value` is `z` (`"neural"`), `(m, V)`
        (`"tap"` with linear response) or `m`.
        """
        check_shape("x", x, "spins dim", spins=self.num_spins, dim=self.dim)
        floats = [a.dtype for a in jax.tree.leaves((x, self)) if eqx.is_inexact_array(a)]
        if min(jnp.finfo(d).bits for d in floats) < 32:
            # bfloat16/float16: Anderson's least squares and the stopping test need more
            # than 8 or 11 bits (in bfloat16 the iterate becomes NaN), so the fixed point is
            # solved in float32 and the value is given back in the inputs' dtype.
            up = _cast(jnp.float32)
            solution = up(self).solve(up(x), state0=up(state0), throw=throw)
            dtype = result_dtype(*floats)
            return eqx.tree_at(lambda s: s.value, solution, _cast(dtype)(solution.value))
        throw = self.throw if throw is None else bool(throw)
        # The input check raises for a whole vmapped batch if one example is bad: with
        # `throw=False` the solver's per-example result code reports it instead.
        x = check_finite("the input x", x) if throw else jnp.asarray(x)
        state0 = self.init_state(x) if state0 is None else state0
        return fixed_point(
            self._map(),
            state0,
            x,
            solver=self.solver,
            adjoint=self.adjoint,
            max_steps=self.max_steps,
            throw=throw,
        )

    def __call__(
        self, x: Float[ArrayLike, "spins dim"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "spins dim"]:
        """The spin means at the fixed point, shape `(spins, dim)`. (`key` is unused.)"""
        value = self.solve(x).value
        if self.variant == "tap" and self.lin_response:
            return value[0]
        return value


class MeanFieldTransformerBlock(eqx.Module):
    r"""A (norm-free) transformer block written as one naive mean-field step.

    $$J_{ij}(X) = \sum_h \operatorname{softmax}_j(q^h_i\cdot k^h_j/\sqrt Y)\, W_O^hW_V^h,\quad
      X' = J(X)X + X,\quad \text{out} = X' - f_\theta(X'),\; f_\theta = -\mathrm{FF},$$

    (`ea.spin.mean_field`'s
    [`attention_couplings`][energyattn.spin.mean_field.attention_couplings] and
    [`transformer_block_as_mean_field`][energyattn.spin.mean_field.transformer_block_as_mean_field]):
    the residual connection is the source term and the feed-forward layer the amortised
    Onsager correction. [`fixed_point`][energyattn.nn.MeanFieldTransformerBlock.fixed_point] instead
    solves $z = J(X)z + \mathrm{FF}(z) + X$ with the couplings frozen at $J(X)$: the same
    block, made deep and implicit.

    **Arguments:**

    - `dim`, `num_heads`, `head_dim` (default `dim // num_heads`), `hidden` (default
      `4 * dim`); `dtype`; `key`.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "A mean-field theory perspective on
        transformers".
    """

    w_query: Float[Array, "heads head_dim dim"]
    w_key: Float[Array, "heads head_dim dim"]
    w_value: Float[Array, "heads head_dim dim"]
    w_out: Float[Array, "heads dim head_dim"]
    feed_forward: eqx.nn.MLP

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        head_dim: int | None = None,
        hidden: int | None = None,
        *,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dim = positive_int("dim", dim)
        num_heads = positive_int("num_heads", num_heads)
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} does not split into num_heads={num_heads} heads")
            head_dim = dim // num_heads
        head_dim = positive_int("head_dim", head_dim)
        hidden = 4 * dim if hidden is None else positive_int("hidden", hidden)
        dtype = default_dtype(dtype)
        kq, kk, kv, ko, kf = jr.split(key, 5)
        shape = (num_heads, head_dim, dim)
        self.w_query = jr.normal(kq, shape, dtype) / np.sqrt(dim)
        self.w_key = jr.normal(kk, shape, dtype) / np.sqrt(dim)
        self.w_value = jr.normal(kv, shape, dtype) / np.sqrt(dim)
        self.w_out = jr.normal(ko, (num_heads, dim, head_dim), dtype) / np.sqrt(
            num_heads * head_dim
        )
        self.feed_forward = _mlp(dim, hidden, dtype, kf)

    def couplings(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq seq dim dim"]:
        """$J(X)$, shape `(seq, seq, dim, dim)`."""
        return attention_couplings(x, self.w_query, self.w_key, self.w_value, self.w_out)

    def _correction(self, u: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return -self.feed_forward(u)

    def __call__(
        self, x: Float[ArrayLike, "seq dim"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq dim"]:
        """One naive mean-field step: $X' + \\mathrm{FF}(X')$, $X' = X + \\mathrm{Attention}(X)$."""
        x = check_finite("the input x", jnp.asarray(x))
        return transformer_block_as_mean_field(x, self.couplings(x), self._correction)

    def fixed_point(self, x: Float[ArrayLike, "seq dim"], **kwargs: Any) -> Solution:
        """Solve $z = J(X) z - f_\\theta(z) + X$ (couplings frozen at $J(X)$); `kwargs` go to
        [`ea.fixed_point`][energyattn.fixed_point] (with `throw=False` a NaN input is
        reported by the result code, per example under `vmap`, instead of raising)."""
        x = check_finite("the input x", x) if kwargs.get("throw", True) else jnp.asarray(x)
        J = self.couplings(x)
        return fixed_point(
            lambda z, inputs: neural_mean_field(z, inputs, J, self._correction), x, x, **kwargs
        )
