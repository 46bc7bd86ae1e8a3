"""Self-attention as an attractor network: each token descends its own local energy."""

import functools
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_finite, check_positive, check_shape, default_dtype, positive_int
from .._custom_types import Normalisation, Scalar, ScalarLike
from .._energy import local_energies, local_energy, project_couplings, pseudo_likelihood_energy
from .._solver import local_forces


def normalise_tokens(x: Float[Array, "N d"], kind: Normalisation) -> Float[Array, "N d"]:
    r"""Put every token back on the unit sphere after an update.

    - `"sphere"`: $x_i \leftarrow x_i / \lVert x_i\rVert$;
    - `"layer"`: layer normalisation without learnable parameters, scaled by $1/\sqrt d$ so
      that tokens keep unit norm: $x_i \leftarrow (x_i - \bar x_i)/\lVert x_i - \bar x_i\rVert$;
    - `"none"`: unchanged.

    A zero token (nothing to normalise) stays zero.
    """
    if kind == "none":
        return x
    if kind == "layer":
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
    positive = norm > 0
    return jnp.where(positive, x / jnp.where(positive, norm, 1.0), 0.0)


class AttractorAttention(eqx.Module):
    r"""Bare self-attention run as a recurrent attractor network of $N$ vector spins.

    $$x_i(t+1) = \mathcal N\Bigl(-\frac{\partial e_i}{\partial x_i}\Big|_{x(t)}
      + \gamma\, x_i(t)\Bigr),\qquad
      e_i = -\frac1\lambda\log\sum_{j\ne i} e^{\lambda\, x_i^\top J_{ij} x_j},$$

    so $-\partial e_i/\partial x_i = \sum_{j\ne i}\alpha_{i\leftarrow j} J_{ij} x_j$ with
    $\alpha_{i\leftarrow j} = \mathrm{softmax}_{j\ne i}(\lambda\, x_i^\top J_{ij} x_j)$: the
    self-attention update with position-dependent couplings $J_{ij} = \sum_k W^Q_k\otimes
    W^K_k$ (and values $J_{ij}x_j$). The field is obtained by `jax.grad` of each token's own
    energy ([`local_forces`][energyattn.local_forces]); $\mathcal N$ is the normalisation
    ([`normalise_tokens`][energyattn.nn.normalise_tokens]). The dynamics is not the descent
    of any single energy. Training minimises the pseudo-likelihood
    $\sum_\mu \sum_i e_i(\xi^\mu)$ ([`energy`][energyattn.nn.AttractorAttention.energy])
    on clean examples, without backpropagating through the dynamics; see
    [`train_attractor`][energyattn.models.train_attractor].

    **Arguments:**

    - `num_tokens`: $N \ge 2$ (the sequence length is fixed: couplings depend on positions).
    - `dim`: token dimension $d$.
    - `num_steps`: default number $T$ of iterations of `__call__`.
    - `gamma`: self-coupling $\gamma$ (1 in the paper).
    - `lam`: inverse temperature $\lambda$ of the dynamics (1 in the paper's evaluation).
    - `normalisation`: `"sphere"` (default), `"layer"` or `"none"`.
    - `coupling_norm`: root-mean-square Frobenius norm of the off-diagonal blocks $J_{ij}$,
      kept fixed in training (see [`project_couplings`][energyattn.project_couplings]).
    - `norm_scope`: `"tensor"` (the whole $J$ has the fixed norm) or `"block"` (each $J_{ij}$).
    - `dtype`, `key`: parameter dtype and the PRNG key of the random initial $J$.

    ??? cite "Source"

        F. D'Amico, M. Negri, *Self-attention as an attractor network: transient memories
        without backpropagation* (2024), eqs. (1)-(4).
    """

    couplings: Float[Array, "N N d d"]
    gamma: float = eqx.field(static=True)
    lam: float = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    normalisation: Normalisation = eqx.field(static=True)
    coupling_norm: float = eqx.field(static=True)
    norm_scope: Literal["tensor", "block"] = eqx.field(static=True)

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        *,
        num_steps: int = 10,
        gamma: float = 1.0,
        lam: float = 1.0,
        normalisation: Normalisation = "sphere",
        coupling_norm: float = 1.0,
        norm_scope: Literal["tensor", "block"] = "tensor",
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        num_tokens = positive_int("num_tokens", num_tokens, minimum=2)
        dim = positive_int("dim", dim)
        self.num_steps = positive_int("num_steps", num_steps, minimum=0)
        if normalisation not in ("sphere", "layer", "none"):
            raise ValueError(
                f"normalisation must be 'sphere', 'layer' or 'none', got {normalisation!r}"
            )
        if norm_scope not in ("tensor", "block"):
            raise ValueError(f"norm_scope must be 'tensor' or 'block', got {norm_scope!r}")
        self.gamma = float(gamma)
        if not np.isfinite(self.gamma):
            raise ValueError(f"gamma must be finite, got {gamma!r}")
        self.lam = float(check_positive("lam", lam))
        self.coupling_norm = float(check_positive("coupling_norm", coupling_norm))
        self.normalisation = normalisation
        self.norm_scope = norm_scope
        raw = jr.normal(key, (num_tokens, num_tokens, dim, dim), default_dtype(dtype))
        self.couplings = project_couplings(raw, self.coupling_norm, scope=norm_scope)

    @property
    def num_tokens(self) -> int:
        """$N$."""
        return self.couplings.shape[0]

    @property
    def dim(self) -> int:
        """$d$."""
        return self.couplings.shape[2]

    def _check(self, x: Any) -> Array:
        check_shape("x", x, "N d", N=self.num_tokens, d=self.dim)
        return check_finite("x", x)

    def _lam(self, lam: ScalarLike | None) -> ScalarLike:
        return self.lam if lam is None else lam

    def local_energy(
        self,
        x_i: Float[ArrayLike, " d"],
        x: Float[ArrayLike, "N d"],
        i: Any,
        *,
        lam: ScalarLike | None = None,
    ) -> Scalar:
        """Token `i`'s energy $e_i(x_i, \\{x_j\\})$ ([`local_energy`][energyattn.local_energy])."""
        return local_energy(x_i, x, i, self.couplings, lam=self._lam(lam))

    def local_energies(
        self, x: Float[ArrayLike, "N d"], *, lam: ScalarLike | None = None
    ) -> Float[Array, " N"]:
        """All tokens' energies $e_i$, shape `(N,)`."""
        return local_energies(self._check(x), self.couplings, lam=self._lam(lam))

    def energy(self, x: Float[ArrayLike, "N d"], *, lam: ScalarLike | None = None) -> Scalar:
        r"""The pseudo-likelihood energy $E(x) = \sum_i e_i$, the training loss of one example
        (use `lam=5.0` as in the paper's training)."""
        return pseudo_likelihood_energy(self._check(x), self.couplings, lam=self._lam(lam))

    def _forces(self, x: Array, lam: ScalarLike | None) -> Array:
        return local_forces(functools.partial(self.local_energy, lam=lam), x)

    def _step(self, x: Array, lam: ScalarLike | None) -> Array:
        update = self._forces(x, lam) + self.gamma * x
        return normalise_tokens(update, self.normalisation).astype(x.dtype)

    def forces(
        self, x: Float[ArrayLike, "N d"], *, lam: ScalarLike | None = None
    ) -> Float[Array, "N d"]:
        r"""$-\partial e_i/\partial x_i$ for every token (the attention update), by `jax.grad`."""
        return self._forces(self._check(x), lam)

    def step(
        self, x: Float[ArrayLike, "N d"], *, lam: ScalarLike | None = None
    ) -> Float[Array, "N d"]:
        r"""One iteration $x \leftarrow \mathcal N(F(x) + \gamma x)$."""
        return self._step(self._check(x), lam)

    def __call__(
        self,
        x: Float[ArrayLike, "N d"],
        *,
        num_steps: int | None = None,
        lam: ScalarLike | None = None,
    ) -> Float[Array, "states N d"]:
        """Run the dynamics for `num_steps` iterations (default `self.num_steps`) in
        `lax.scan`.

        **Returns:**

        The trajectory, shape `(num_steps + 1, N, d)`: entry `t` is $x(t)$, entry 0 the
        input (not normalised).
        """
        x = self._check(x)
        num_steps = (
            self.num_steps if num_steps is None else positive_int("num_steps", num_steps, minimum=0)
        )

        def body(state: Array, _: None) -> tuple[Array, Array]:
            new = self._step(state, lam)
            return new, new

        _, states = jax.lax.scan(body, x, None, length=num_steps)
        return jnp.concatenate([x[None], states], axis=0)

    def project(self) -> "AttractorAttention":
        """The same layer with $J$ projected back to its fixed norm and zero diagonal blocks
        (what training does after every optimiser step)."""
        couplings = project_couplings(self.couplings, self.coupling_norm, scope=self.norm_scope)
        return eqx.tree_at(lambda m: m.couplings, self, couplings)
