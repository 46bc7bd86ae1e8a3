"""Vector-spin attention: a layer's output is the magnetizations of a spin system it probes."""

from typing import Any, Literal, cast, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import (
    check_finite,
    check_shape,
    default_dtype,
    keyword_arguments,
    positive_int,
)
from .._custom_types import ScalarLike
from .._hyperparameters import hyperparameter, hyperparameter_fields
from .._solver import DEFAULT_MAX_STEPS, Newton, Solution
from ..spin.afem import Mode, check_mode, input_couplings, magnetizations, symmetric_couplings
from ._common import linear


class VectorSpinAttention(eqx.Module):
    r"""Attention as the response of a vector-spin system to its inputs (AFEM).

    $$H = \frac{\mathrm{LayerNorm}(x)}{\sqrt{D}}, \qquad
      \text{output} = m = \frac{\partial \log Z(J, H, \beta)}{\partial H}, \qquad
      \log Z = -\frac N2(1 + \ln 2\beta) + \min_t \varphi(t)$$

    The inputs become the external fields of $N$ vector spins; the output is their
    magnetizations ([`ea.spin.magnetizations`][energyattn.spin.magnetizations]), which for
    fixed couplings are $\frac\beta2 V^{-1}H$ with $V = \operatorname{diag}(t^*) - J$: a
    residual term $\frac\beta2 h_i/t_i^*$ plus token mixing. The couplings are either a
    parameter $J = \frac12(J_{\mathrm{raw}} + J_{\mathrm{raw}}^\top)\circ(1 - I)$,
    $J_{\mathrm{raw}} \sim \mathcal N(0, 1/(N D))$ (standard deviation $1/\sqrt{ND}$), or
    input-dependent, $J(H) = \tanh(\sqrt D\, qk^\top)/\sqrt{ND}$ with $q = HW_q^\top$,
    $k = HW_k^\top$ (symmetrised, zero diagonal), whose $\partial J/\partial H$ then adds
    channel-mixing terms to the output. There is no value or output projection and no
    residual connection beyond the one the magnetizations contain. The saddle point is
    solved by safeguarded Newton and differentiated implicitly, so the layer trains with
    ordinary `jax.grad` (a gradient of the gradient that defines its output).

    **Arguments:**

    - `num_spins`: the number of spins $N$ (the sequence length; with input-dependent
      couplings any length works).
    - `dim`: the feature size $D$ of each input.
    - `beta`: inverse temperature $\beta > 0$ (default 1; keyword only).
    - `trainable_beta`: learn $\beta$ (default `False`: a fixed hyperparameter; see
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `input_dependent`: use the couplings $J(H)$ (parameters $W_q$, $W_k$) instead of a
      coupling matrix.
    - `mode`: `"vector"` (default; one auxiliary $t_i$ per spin) or `"scalar"`.
    - `solver`: the [`ea.Newton`][energyattn.Newton] that finds the saddle point (its
      tolerances), and `max_steps` its most steps (default 256, the package's one bound), as
      in [`ea.spin.saddle_point`][energyattn.spin.saddle_point].
    - `throw`: raise (at run time) when the input is NaN/inf or the saddle point is not
      found (default). With `False` nothing raises, and under `jax.vmap` every example
      keeps its own answer: a failed example's magnetizations are NaN and its result code
      (`return_solution=True`) says why, while the other examples are unaffected.
    - `dtype`: parameter dtype (default: JAX's default float).
    - `key`: PRNG key for the initial parameters (keyword only).

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "The attention module: probing spins with data"; *Transformers Are Secretly
        Collectives of Spin Systems* (2021).
    """

    norm: eqx.nn.LayerNorm
    J_raw: Float[Array, "spins spins"] | None
    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    num_spins: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    solver: Newton
    mode: Mode = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    @keyword_arguments("ea.nn.VectorSpinAttention")
    def __init__(
        self,
        num_spins: int,
        dim: int,
        *,
        beta: ScalarLike = 1.0,
        trainable_beta: bool = False,
        input_dependent: bool = False,
        mode: Mode = "vector",
        solver: Newton | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        throw: bool = True,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.num_spins = positive_int("num_spins", num_spins)
        self.dim = positive_int("dim", dim)
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", beta, trainable_beta, dtype
        )
        self.mode = check_mode(mode)
        self.solver = Newton() if solver is None else solver
        if not isinstance(self.solver, Newton):
            raise ValueError(f"solver must be ea.Newton(...), got {solver!r}")
        self.max_steps = positive_int("max_steps", max_steps)
        self.throw = bool(throw)
        dtype = default_dtype(dtype)
        self.norm = eqx.nn.LayerNorm(self.dim, eps=1e-5, dtype=dtype)
        if input_dependent:
            kq, kk = jr.split(key)
            self.J_raw = None
            self.query_proj = linear(self.dim, self.dim, use_bias=False, dtype=dtype, key=kq)
            self.key_proj = linear(self.dim, self.dim, use_bias=False, dtype=dtype, key=kk)
        else:
            scale = 1.0 / np.sqrt(self.num_spins * self.dim)
            self.J_raw = scale * jr.normal(key, (self.num_spins, self.num_spins), dtype)
            self.query_proj = self.key_proj = None

    def couplings(self, H: Float[Array, "spins dim"]) -> Float[Array, "spins spins"]:
        """The symmetric, zero-diagonal couplings $J$ (at fields $H$ when input-dependent)."""
        if self.query_proj is None or self.key_proj is None:
            return symmetric_couplings(cast(Array, self.J_raw))  # set without projections
        return input_couplings(H, self.query_proj.weight, self.key_proj.weight)

    def fields(self, x: Float[ArrayLike, "spins dim"]) -> Float[Array, "spins dim"]:
        """The external fields $H = \\mathrm{LayerNorm}(x)/\\sqrt{D}$ of the inputs."""
        return jax.vmap(self.norm)(jnp.asarray(x)) / np.sqrt(self.dim)

    @property
    def beta(self) -> float | Float[Array, ""]:
        """The inverse temperature $\\beta$: a float, or an array leaf when trainable."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "spins dim"],
        *,
        t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "spins dim"]: ...

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "spins dim"],
        *,
        t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "spins dim"], Solution]: ...

    def __call__(
        self,
        x: Float[ArrayLike, "spins dim"],
        *,
        t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "spins dim"] | tuple[Float[Array, "spins dim"], Solution]:
        """**Arguments:**

        - `x`: the inputs, shape `(num_spins, dim)` (any number of rows with input-dependent
          couplings).
        - `t0`: optional warm start for the saddle point, e.g. the `value` of a previous
          call's solution; it must be feasible ($\\operatorname{diag}(t_0) - J \\succ 0$).
        - `return_solution`: also return the saddle point's
          [`Solution`][energyattn.Solution].
        - `key`: unused (no randomness); accepted for Equinox layer compatibility.

        **Returns:**

        The magnetizations, shape `(num_spins, dim)`; with `return_solution=True` also the
        solution (its `value` is $t^*$).
        """
        del key
        if self.J_raw is not None:
            check_shape("x", x, "spins dim", spins=self.num_spins, dim=self.dim)
        else:
            check_shape("x", x, "spins dim", dim=self.dim)
        H = self.fields(check_finite("x", x) if self.throw else jnp.asarray(x))
        couplings = self.couplings(H) if self.J_raw is not None else self.couplings
        return magnetizations(
            couplings,
            H,
            beta=self.beta,
            t0=t0,
            mode=self.mode,
            solver=self.solver,
            max_steps=self.max_steps,
            throw=self.throw,
            return_solution=return_solution,
        )
