r"""Mean-field equations of vector-spin (Ising-like) systems, as `ea.spin.mean_field`: the
deep-implicit-attention maps.

$N$ sites carry spins $S_i \in \mathbb R^d$ coupled by $d\times d$ blocks $J_{ij}$ (zero on
the diagonal) and probed by input fields $x_i$. Attention is the collective response: the
spin means $m_i = \langle S_i\rangle$ at a fixed point of the maps below, which
[`ea.nn.MeanFieldAttention`][energyattn.nn.MeanFieldAttention] solves and differentiates with
[`ea.fixed_point`][energyattn.fixed_point] (or, for the Gaussian energy, `ea.minimise`).
Conventions: $(Jm)_i^a = \sum_j\sum_b J_{ij}^{ab} m_j^b$, every block array is indexed
`[i, j, a, b]`, and everything is unbatched.

??? cite "Source"

    M. Bal, *Deep Implicit Attention: A Mean-Field Theory Perspective on Attention
    Mechanisms* (2021).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_shape
from .._energy import AbstractEnergy
from .._linalg import inverse, solve
from .._namespace import public_dir

__all__ = [
    "GaussianSpinEnergy",
    "apply_couplings",
    "attention_couplings",
    "gaussian_spin_energy",
    "naive_mean_field",
    "neural_mean_field",
    "tap_cavity_variances",
    "tap_mean_field",
    "tap_spin_means",
    "transformer_block_as_mean_field",
    "vector_couplings",
]

Couplings = Float[Array, "spins spins dim dim"]
Spins = Float[Array, "spins dim"]
Blocks = Float[Array, "spins dim dim"]


def check_couplings(J: ArrayLike, num_spins: int | None = None, dim: int | None = None) -> None:
    """`ValueError` unless `J` has shape `(spins, spins, dim, dim)` (with the given sizes)."""
    shape = jnp.shape(J)
    sizes = {}
    if num_spins is not None:
        sizes["spins"] = num_spins
    if dim is not None:
        sizes["dim"] = dim
    check_shape("couplings", J, "spins spins dim dim", **sizes)
    if shape[0] != shape[1] or shape[2] != shape[3]:
        raise ValueError(
            f"couplings must have shape (spins, spins, dim, dim), got {tuple(shape)}: "
            "a (d, d) block for every ordered pair of sites"
        )


def _check_system(x: ArrayLike, J: ArrayLike, name: str = "x") -> None:
    check_couplings(J)
    n, _, d, _ = jnp.shape(J)
    if jnp.shape(x) != (n, d):
        raise ValueError(
            f"{name} must have shape (spins={n}, dim={d}) to match the couplings "
            f"{tuple(jnp.shape(J))}, got {tuple(jnp.shape(x))}"
        )


def vector_couplings(
    weight: Float[ArrayLike, "spins spins dim dim"],
    *,
    sym_internal: bool = False,
    sym_sites: bool = False,
) -> Couplings:
    r"""Coupling blocks $J_{ij}$ from a raw weight tensor: symmetrise, then zero the diagonal.

    In this order: with `sym_internal`, $W_{ij} \leftarrow \frac12(W_{ij} + W_{ij}^\top)$;
    with `sym_sites`, $W_{ij} \leftarrow \frac12(W_{ij} + W_{ji})$; finally $W_{ii} = 0$ (no
    self-coupling). With both, $J$ is a symmetric $(Nd)\times(Nd)$ matrix with
    $N(N-1)/2 \cdot d(d+1)/2$ free parameters. Differentiable: train the raw `weight`.

    **Arguments:**

    - `weight`: shape `(spins, spins, dim, dim)`.
    - `sym_internal`, `sym_sites`: the symmetrisations.

    **Returns:**

    The couplings, same shape.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention: A Mean-Field Theory Perspective on Attention
        Mechanisms* (2021), "Generalizing spin models to vector degrees of freedom".
    """
    check_couplings(weight)
    W = jnp.asarray(weight)
    if sym_internal:
        W = 0.5 * (W + jnp.swapaxes(W, 2, 3))
    if sym_sites:
        W = 0.5 * (W + jnp.swapaxes(W, 0, 1))
    n = W.shape[0]
    off_diagonal = 1 - jnp.eye(n, dtype=W.dtype)
    return W * off_diagonal[:, :, None, None]


def apply_couplings(J: Couplings, m: Spins) -> Spins:
    r"""$(Jm)_i = \sum_j J_{ij}\, m_j$ for blocks `J (spins, spins, dim, dim)`, `m (spins, dim)`."""
    _check_system(m, J, "m")
    return jnp.einsum("ijab,jb->ia", J, m)


def _prior(prior_inv_var: ArrayLike | None, n: int, d: int, dtype) -> Blocks:
    if prior_inv_var is None:
        return jnp.broadcast_to(jnp.eye(d, dtype=dtype), (n, d, d))
    check_shape("prior_inv_var", prior_inv_var, "spins dim dim", spins=n, dim=d)
    return jnp.asarray(prior_inv_var, dtype)


def gaussian_spin_energy(
    s: Spins,
    x: Spins,
    J: Couplings,
    prior_inv_var: Float[ArrayLike, "spins dim dim"] | None = None,
) -> Float[Array, ""]:
    r"""Energy of Gaussian vector spins with couplings and fields (the vector random Ising model).

    $$E(S) = \tfrac12\sum_i S_i^\top\Sigma_i^{-1}S_i - \tfrac12\sum_{i,j} S_i^\top J_{ij} S_j
    - \sum_i x_i\cdot S_i ,$$

    the negative log-weight of $\rho(S)\exp(\frac12 S^\top J S + x\cdot S)$ with the Gaussian
    prior $\rho = \mathcal N(0, \Sigma_i)$. For symmetric couplings its stationary point solves
    the naive mean-field equations $S_i = \Sigma_i\,((JS)_i + x_i)$, and, the model being
    Gaussian, that is also the exact mean $(\Sigma^{-1} - J)^{-1}x$ and the adaptive-TAP fixed
    point: minimising this energy with `ea.minimise` is mean-field attention.

    **Arguments:**

    - `s`: spins `(spins, dim)`; `x`: fields `(spins, dim)`; `J`: couplings.
    - `prior_inv_var`: $\Sigma_i^{-1}$, shape `(spins, dim, dim)` (default the identity).

    **Returns:**

    A scalar.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), the vector generalisation of the random
        Ising model (there written with the opposite sign, as a log-weight, without the
        prior term).
    """
    _check_system(x, J)
    _check_system(s, J, "s")
    n, d = s.shape
    inv_var = _prior(prior_inv_var, n, d, s.dtype)
    self_term = 0.5 * jnp.einsum("ia,iab,ib->", s, inv_var, s)
    coupling_term = -0.5 * jnp.sum(s * apply_couplings(J, s))
    return self_term + coupling_term - jnp.sum(x * s)


class GaussianSpinEnergy(AbstractEnergy):
    """Module form of
    [`gaussian_spin_energy`][energyattn.spin.mean_field.gaussian_spin_energy]: the
    couplings and fields are fields of the module, the spins the state."""

    couplings: Couplings
    fields: Spins
    prior_inv_var: Blocks | None = None

    def __check_init__(self):
        _check_system(self.fields, self.couplings, "fields")

    def __call__(self, x: Spins, args: Any = None) -> Float[Array, ""]:
        return gaussian_spin_energy(x, self.fields, self.couplings, self.prior_inv_var)


def naive_mean_field(m: Spins, x: Spins, J: Couplings) -> Spins:
    r"""One naive mean-field update with a unit Gaussian prior, $m_i' = \sum_j J_{ij} m_j + x_i$.

    Softmax attention with its residual connection is exactly this step, with couplings
    computed from the input
    ([`attention_couplings`][energyattn.spin.mean_field.attention_couplings]): the residual
    is the source term $x_i$.
    """
    _check_system(x, J)
    return apply_couplings(J, m) + x


def neural_mean_field(
    z: Spins, x: Spins, J: Couplings, correction: Callable[[Float[Array, " dim"]], Array]
) -> Spins:
    r"""The "fast and neural" deep-implicit-attention map, an amortised Onsager correction.

    $$z_i' = \sum_j J_{ij}\, z_j - f_\theta(z_i) + x_i$$

    where $f_\theta$ (a small MLP, applied to every site) stands in for the self-consistent
    Onsager term $V_i^* m_i^*$ of adaptive TAP.

    **Arguments:**

    - `z`: current spin means `(spins, dim)`; `x`: the input fields; `J`: couplings.
    - `correction`: $f_\theta$, mapping one site's `(dim,)` vector to `(dim,)`.

    **Returns:**

    $z'$, shape `(spins, dim)`.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "Fast and neural: parametrizing the Onsager
        self-correction term".
    """
    _check_system(x, J)
    return apply_couplings(J, z) - jax.vmap(correction)(z) + x


def tap_spin_means(
    m: Spins,
    V: Blocks,
    x: Spins,
    J: Couplings,
    prior_inv_var: Float[ArrayLike, "spins dim dim"] | None = None,
) -> Spins:
    r"""Adaptive-TAP update of the spin means with a Gaussian prior $\mathcal N(0, \Sigma_i)$.

    $$a_i = \sum_j J_{ij} m_j - V_i m_i, \qquad
      m_i' = (\Sigma_i^{-1} - V_i)^{-1} (a_i + x_i),$$

    the cavity mean $a_i$ with its Onsager self-correction, and the mean of the single-site
    Gaussian $Z_0^{(i)} = \int\!\rho_i(S)\, e^{S\cdot(a_i + x_i) + \frac12 S^\top V_i S}dS$.

    **Arguments:**

    - `m`: spin means `(spins, dim)`; `V`: cavity variances `(spins, dim, dim)`; `x`: fields;
      `J`: couplings; `prior_inv_var`: $\Sigma_i^{-1}$ (default identity).

    **Returns:**

    $m'$, shape `(spins, dim)`.

    ??? cite "Source"

        M. Opper and O. Winther, *Adaptive and self-averaging TAP mean-field theory* (2001);
        M. Bal, *Deep Implicit Attention* (2021), "Slow and explicit".
    """
    _check_system(x, J)
    n, d = x.shape
    check_shape("V", V, "spins dim dim", spins=n, dim=d)
    inv_var = _prior(prior_inv_var, n, d, m.dtype)
    cavity_mean = apply_couplings(J, m) - jnp.einsum("iab,ib->ia", V, m)
    return jax.vmap(solve)(inv_var - V, cavity_mean + x)


def tap_cavity_variances(
    V: Blocks,
    J: Couplings,
    prior_inv_var: Float[ArrayLike, "spins dim dim"] | None = None,
) -> Blocks:
    r"""Adaptive-TAP update of the cavity variances by linear response (a dense solve).

    With spin variances $S_i = (\Sigma_i^{-1} - V_i)^{-1}$, the susceptibilities solve

    $$\sum_k\big(\delta_{ik} I - S_i J_{ik} + \delta_{ik} S_i V_i\big)\,\chi_{kj} =
      \delta_{ij} S_i ,$$

    an $(Nd)\times(Nd)$ linear system, and self-consistency of the diagonal blocks gives

    $$V_i' = \Lambda_i - \chi_{ii}^{-1}, \qquad \Lambda_i = V_i + S_i^{-1}.$$

    Cost $O(N^3 d^3)$ time and $O(N^2 d^2)$ memory per update: use it for small systems, and
    the neural variant otherwise. For this Gaussian prior $\chi = (\Sigma^{-1} - J)^{-1}$ is
    exact whatever $V$ is, so one update already gives the fixed point $V^*$.

    **Arguments:**

    - `V`: cavity variances `(spins, dim, dim)`; `J`: couplings; `prior_inv_var`:
      $\Sigma_i^{-1}$ (default identity).

    **Returns:**

    $V'$, shape `(spins, dim, dim)`.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "Generalizing the cavity variance
        calculation"; M. Opper and O. Winther (2001).
    """
    check_couplings(J)
    n, _, d, _ = J.shape
    check_shape("V", V, "spins dim dim", spins=n, dim=d)
    inv_var = _prior(prior_inv_var, n, d, V.dtype)
    # LAPACK through _linalg (no batched calls: see `solve`).
    spin_var = inverse(inv_var - V)
    eye_n = jnp.eye(n, dtype=V.dtype)
    # Rows and columns ordered (site, component): index i * d + a.
    coupled = jnp.einsum("iab,ikbc->iakc", spin_var, J)
    local = jnp.einsum("ik,iab,ibc->iakc", eye_n, spin_var, V)
    lhs = jnp.eye(n * d, dtype=V.dtype) - (coupled - local).reshape(n * d, n * d)
    rhs = jnp.einsum("ik,iab->iakb", eye_n, spin_var).reshape(n * d, n * d)
    chi = solve(lhs, rhs).reshape(n, d, n, d)
    chi_diag = jnp.einsum("iaib->iab", chi)
    # Lambda_i = V_i + S_i^{-1} = Sigma_i^{-1}, since S_i = (Sigma_i^{-1} - V_i)^{-1}: no
    # second inverse of S_i.
    return inv_var - inverse(chi_diag)


def tap_mean_field(
    state: tuple[Spins, Blocks],
    x: Spins,
    J: Couplings,
    prior_inv_var: Float[ArrayLike, "spins dim dim"] | None = None,
) -> tuple[Spins, Blocks]:
    r"""One adaptive-TAP update of $(m, V)$:
    [`tap_spin_means`][energyattn.spin.mean_field.tap_spin_means] and
    [`tap_cavity_variances`][energyattn.spin.mean_field.tap_cavity_variances], both from the
    current state."""
    m, V = state
    return tap_spin_means(m, V, x, J, prior_inv_var), tap_cavity_variances(V, J, prior_inv_var)


def attention_couplings(
    x: Float[Array, "seq dim"],
    w_query: Float[Array, "heads head_dim dim"],
    w_key: Float[Array, "heads head_dim dim"],
    w_value: Float[Array, "heads head_dim dim"],
    w_out: Float[Array, "heads dim head_dim"],
) -> Couplings:
    r"""Couplings computed from the input: multi-head softmax attention as a coupling tensor.

    $$J_{ij}(X) = \sum_h \big[\operatorname{softmax}_j\big(q^h_i\cdot k^h_j/\sqrt{Y}\big)
      \big]\; W_O^h W_V^h, \qquad q^h_i = W_Q^h x_i,\; k^h_j = W_K^h x_j,$$

    so that $\sum_j J_{ij}(X)\,x_j$ is multi-head attention (values $W_V^h x_j$, output
    projection $W_O^h$). Heads are a block structure of the couplings' internal dimensions;
    the softmax is the couplings' sparsity. Unlike learned couplings these have self-terms
    ($J_{ii} \ne 0$), as attention does.

    **Arguments:**

    - `x`: tokens `(seq, dim)`.
    - `w_query`, `w_key`, `w_value`: `(heads, head_dim, dim)`.
    - `w_out`: `(heads, dim, head_dim)`.

    **Returns:**

    $J(X)$, shape `(seq, seq, dim, dim)`.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "Parametrizing the couplings: sparse graph
        structure from inputs".
    """
    check_shape("x", x, "seq dim")
    _, dim = x.shape
    check_shape("w_query", w_query, "heads head_dim dim", dim=dim)
    heads, head_dim, _ = w_query.shape
    for name, w in (("w_key", w_key), ("w_value", w_value)):
        check_shape(name, w, "heads head_dim dim", heads=heads, head_dim=head_dim, dim=dim)
    check_shape("w_out", w_out, "heads dim head_dim", heads=heads, dim=dim, head_dim=head_dim)
    q = jnp.einsum("hyd,id->hiy", w_query, x)
    k = jnp.einsum("hyd,jd->hjy", w_key, x)
    scores = jnp.einsum("hiy,hjy->hij", q, k) / jnp.sqrt(jnp.asarray(head_dim, x.dtype))
    weights = jax.nn.softmax(scores, axis=-1)
    value_out = jnp.einsum("hay,hyb->hab", w_out, w_value)
    return jnp.einsum("hij,hab->ijab", weights, value_out)


def transformer_block_as_mean_field(
    x: Float[Array, "seq dim"],
    J: Couplings,
    correction: Callable[[Float[Array, " dim"]], Array],
) -> Float[Array, "seq dim"]:
    r"""One naive mean-field step with the Onsager correction taken at the naive value.

    $$X_i' = \sum_j J_{ij}(X)\,X_j + X_i, \qquad \text{out}_i = X_i' - f_\theta(X_i'),$$

    the neural mean-field map started at $z = X$ with $f_\theta$ evaluated at the naive
    update. With [`attention_couplings`][energyattn.spin.mean_field.attention_couplings] and
    $f_\theta = -\mathrm{FeedForward}$ this is a (norm-free) transformer block,
    $X' + \mathrm{FF}(X')$ with $X' = X + \mathrm{Attention}(X)$: softmax attention does one
    naive mean-field step and the feed-forward layer corrects it.

    ??? cite "Source"

        M. Bal, *Deep Implicit Attention* (2021), "A mean-field theory perspective on
        transformers".
    """
    naive = naive_mean_field(x, x, J)
    return naive - jax.vmap(correction)(naive)


__dir__ = public_dir(__all__)
