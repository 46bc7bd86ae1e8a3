"""Token-local energies of self-attention as an attractor network (pseudo-likelihood)."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, Float, Int

from .._checks import check_finite, check_positive, check_shape, concrete_value, shape_str
from .._custom_types import Scalar, ScalarLike
from .._dtypes import accumulation_dtype
from .._sharding import explicit_sequence_axis, like_rows
from ._attention import masked_logsumexp
from ._base import AbstractEnergy


def check_local_couplings(
    couplings: Any, num_tokens: int | None = None, dim: int | None = None
) -> Array:
    """`couplings` as an array of shape `(N, N, d, d)` with `N >= 2`, or a `ValueError` that
    names the shapes (`num_tokens` / `dim` pin N and d when given)."""
    shape = tuple(np.shape(couplings))
    sizes = {k: v for k, v in (("N", num_tokens), ("d", dim)) if v is not None}
    wanted = ", ".join(f"{n}={sizes[n]}" if n in sizes else n for n in ("N", "N", "d", "d"))
    ok = (
        len(shape) == 4
        and shape[0] == shape[1]
        and shape[2] == shape[3]
        and shape[0] == sizes.get("N", shape[0])
        and shape[2] == sizes.get("d", shape[2])
    )
    if not ok:
        raise ValueError(f"couplings must have shape ({wanted}), got {shape_str(shape)}")
    if shape[0] < 2:
        raise ValueError(
            "token-local energies need at least 2 tokens (each token's sum runs over the "
            f"others), got couplings of shape {shape_str(shape)}"
        )
    return jnp.asarray(couplings)


def _check_state(x: Any, couplings: Array) -> Array:
    num_tokens, _, dim, _ = couplings.shape
    check_shape("x", x, "N d", N=num_tokens, d=dim)
    return jnp.asarray(x)


def check_token_index(i: Any, num_tokens: int) -> Array:
    r"""`i` as an integer array in `[0, num_tokens)`: a `ValueError` naming the index and the
    range when `i` is known at trace time, a runtime error (`eqx.error_if`) when it is traced.

    Negative indices are refused rather than counted from the end: the mask that removes
    the term $j = i$ and the row $J_{i\cdot}$ must refer to the same token."""
    where = f"a token position in [0, {num_tokens}) (the couplings have N={num_tokens} tokens)"
    if np.ndim(i) != 0:
        raise ValueError(f"i must be {where}, a scalar, got shape {shape_str(np.shape(i))}")
    concrete = concrete_value(i)
    if concrete is not None:
        if concrete.dtype == np.bool_ or not np.issubdtype(concrete.dtype, np.integer):
            raise ValueError(f"i must be {where}, an integer, got {i!r}")
        if not 0 <= int(concrete) < num_tokens:
            raise ValueError(f"i must be {where}, got {int(concrete)}")
        return jnp.asarray(i)
    i = jnp.asarray(i)
    if not jnp.issubdtype(i.dtype, jnp.integer):
        raise ValueError(f"i must be {where}, an integer, got dtype {i.dtype}")
    return eqx.error_if(i, (i < 0) | (i >= num_tokens), f"i must be {where}")


def local_energy(
    x_i: Float[ArrayLike, " d"],
    x: Float[ArrayLike, "N d"],
    i: Int[ArrayLike, ""],
    couplings: Float[ArrayLike, "N N d d"],
    *,
    lam: ScalarLike = 1.0,
) -> Scalar:
    r"""The energy of token $i$ in the field of the other tokens.

    $$e_i(x_i, \{x_j\}) = -\frac1\lambda \log \sum_{j \ne i} e^{\lambda\, x_i^\top J_{ij} x_j}$$

    Its negative gradient with respect to its own token is the self-attention update of
    token $i$ with position-dependent couplings,
    $-\partial e_i/\partial x_i = \sum_{j\ne i} \alpha_{i\leftarrow j} J_{ij} x_j$ with
    $\alpha_{i\leftarrow j} = \mathrm{softmax}_{j\ne i}(\lambda\, x_i^\top J_{ij} x_j)$.

    The own token enters only through `x_i`; row `i` of the context `x` is excluded from the
    sum by a mask (the term $j = i$ is removed exactly, not pushed to a large negative score),
    so the diagonal block $J_{ii}$ never matters. Differentiating with respect to `x_i` alone,
    with `x` held fixed, is what [`local_forces`][energyattn.local_forces] does for every token.

    **Arguments:**

    - `x_i`: the token whose energy this is, shape `(d,)`.
    - `x`: all tokens (the context), shape `(N, d)`.
    - `i`: the position of the token, an integer in `[0, N)` (may be traced). An index
      outside that range (negative ones included) is a `ValueError` naming it when `i` is
      known at trace time, and a runtime error (`eqx.error_if`) when it is traced.
    - `couplings`: $J$, shape `(N, N, d, d)`; `couplings[i, j]` couples token $i$ to $j$.
    - `lam`: $\lambda > 0$, the inverse temperature (5 in the paper's training, 1 at use).

    **Returns:**

    $e_i$, a 0-d array.

    ??? cite "Source"

        F. D'Amico, M. Negri, *Self-attention as an attractor network: transient memories
        without backpropagation* (2024), eqs. (3)-(4).
    """
    couplings = check_local_couplings(couplings)
    x = _check_state(x, couplings)
    check_shape("x_i", x_i, "d", d=couplings.shape[2])
    i = check_token_index(i, couplings.shape[0])
    lam = check_positive("lam", lam)
    return _local_energy(jnp.asarray(x_i), x, i, couplings, lam)


def _local_energy(x_i: Array, x: Array, i: Array, couplings: Array, lam: Array) -> Scalar:
    """`local_energy` on checked inputs (`i` in range)."""
    num_tokens = couplings.shape[0]
    acc = accumulation_dtype(x_i, x, couplings)
    others = jnp.arange(num_tokens) != i
    # J_ii is zeroed before the product: its score is masked out of the sum, but in the
    # backward pass a zero cotangent times a non-finite J_ii would still give NaN.
    if explicit_sequence_axis(x) is None:
        row = jnp.take(couplings, i, axis=0)  # (N, d, d): J_ij for all j
    else:
        # Tokens split over devices (context parallelism), `i` mapped over with them: every
        # device needs all tokens, and the rows J_i of its own tokens, selected by a one-hot
        # contraction (an index mapped over a split axis is a gather whose output sharding
        # JAX cannot resolve).
        x = jax.sharding.reshard(x, PartitionSpec())
        pick = jax.nn.one_hot(i, num_tokens, dtype=couplings.dtype)
        row = jnp.einsum("n,njde->jde", pick, couplings)
    row = jnp.where(others[:, None, None], row, jnp.zeros((), row.dtype))
    scores = jnp.einsum("d,jde,je->j", x_i, row, x, preferred_element_type=acc)
    lse = masked_logsumexp((lam.astype(acc) * scores)[None], others[None])[0]
    return -lse / lam.astype(acc)


def local_energies(
    x: Float[ArrayLike, "N d"], couplings: Float[ArrayLike, "N N d d"], *, lam: ScalarLike = 1.0
) -> Float[Array, " N"]:
    r"""Every token's local energy $e_i(x_i, \{x_j\})$ at the state `x`, shape `(N,)`.

    $$e_i = -\frac1\lambda \log \sum_{j \ne i} e^{\lambda\, x_i^\top J_{ij} x_j}$$

    See [`local_energy`][energyattn.local_energy] for the arguments.
    """
    couplings = check_local_couplings(couplings)
    x = _check_state(x, couplings)
    lam = check_positive("lam", lam)
    # In range by construction: no runtime check. Split over devices like the tokens when
    # they are (context parallelism, `ea.parallel.context_parallel`).
    index = like_rows(jnp.arange(couplings.shape[0]), x)
    return jax.vmap(lambda xi, i: _local_energy(xi, x, i, couplings, lam))(x, index)


def pseudo_likelihood_energy(
    x: Float[ArrayLike, "N d"], couplings: Float[ArrayLike, "N N d d"], *, lam: ScalarLike = 1.0
) -> Scalar:
    r"""The total energy $E(x) = \sum_i e_i(x_i, \{x_j\})$: a negative log pseudo-likelihood.

    $$E(x) = -\frac1\lambda \sum_i \log \sum_{j\ne i} e^{\lambda\, x_i^\top J_{ij} x_j}$$

    Summed over clean training examples $\xi^\mu$, $\mathcal L(J) = \sum_\mu E(\xi^\mu)$ is
    the paper's training loss; it needs no backpropagation through the dynamics. Note that
    $-\nabla_x E$ is **not** the attractor dynamics: the gradient of the total also moves
    token $i$ to lower the energies of the other tokens. The dynamics descends each $e_i$ in
    its own token only ([`local_forces`][energyattn.local_forces]).

    ??? cite "Source"

        F. D'Amico, M. Negri (2024), eqs. (6)-(7).
    """
    return jnp.sum(local_energies(x, couplings, lam=lam))


def project_couplings(
    couplings: Float[ArrayLike, "N N d d"],
    norm: ScalarLike,
    *,
    scope: Literal["tensor", "block"] = "tensor",
) -> Float[Array, "N N d d"]:
    r"""Zero the diagonal blocks $J_{ii}$ and rescale $J$ to a fixed Frobenius norm.

    The pseudo-likelihood loss is lowered without bound by growing $J$, so training keeps its
    norm fixed (the paper's projection after every step). `norm` is the root-mean-square
    Frobenius norm of an off-diagonal block:

    - `scope="tensor"`: $J \leftarrow J \cdot \text{norm}\,\sqrt{N(N-1)} / \lVert J\rVert_F$
      (blocks may differ in strength);
    - `scope="block"`: every $J_{ij}$, $i\ne j$, is rescaled to $\lVert J_{ij}\rVert_F =$ norm.

    An all-zero tensor (or block) has no direction to keep and is returned as zeros.
    """
    couplings = check_local_couplings(couplings)
    if scope not in ("tensor", "block"):
        raise ValueError(f"scope must be 'tensor' or 'block', got {scope!r}")
    norm = check_positive("norm", norm)
    num_tokens = couplings.shape[0]
    off = ~jnp.eye(num_tokens, dtype=bool)[:, :, None, None]
    couplings = jnp.where(off, couplings, jnp.zeros((), couplings.dtype))
    norm = norm.astype(couplings.dtype)
    if scope == "tensor":
        current = jnp.sqrt(jnp.sum(jnp.square(couplings)))
        target = norm * np.sqrt(num_tokens * (num_tokens - 1))
    else:
        current = jnp.sqrt(jnp.sum(jnp.square(couplings), axis=(2, 3), keepdims=True))
        target = norm
    positive = current > 0
    return jnp.where(positive, couplings * (target / jnp.where(positive, current, 1.0)), 0.0)


class LocalAttentionEnergy(AbstractEnergy):
    r"""The pseudo-likelihood energy $E(x) = \sum_i e_i(x_i, \{x_j\})$ as a module.

    $$e_i = -\frac1\lambda \log \sum_{j\ne i} e^{\lambda\, x_i^\top J_{ij} x_j}$$

    Calling it gives the total ([`pseudo_likelihood_energy`][energyattn.pseudo_likelihood_energy]);
    `.local(x_i, x, i)` gives one token's energy in the signature
    [`local_forces`][energyattn.local_forces] expects:
    `ea.local_forces(energy.local, x)` is the attractor network's field
    $-\partial e_i/\partial x_i$ for all tokens.

    **Arguments:**

    - `couplings`: $J$, shape `(N, N, d, d)`.
    - `lam`: inverse temperature $\lambda > 0$.
    """

    couplings: Float[Array, "N N d d"]
    lam: Float[Array, ""]

    def __init__(self, couplings: Float[ArrayLike, "N N d d"], lam: ScalarLike = 1.0):
        self.couplings = check_local_couplings(couplings)
        self.lam = check_positive("lam", lam)

    def __call__(self, x: Float[ArrayLike, "N d"], args: Any = None) -> Scalar:
        return pseudo_likelihood_energy(check_finite("x", x), self.couplings, lam=self.lam)

    def local(self, x_i: Float[ArrayLike, " d"], x: Float[ArrayLike, "N d"], i: Any) -> Scalar:
        """Token `i`'s energy $e_i$ (see [`local_energy`][energyattn.local_energy])."""
        return local_energy(x_i, x, i, self.couplings, lam=self.lam)
