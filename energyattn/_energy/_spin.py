r"""Vector-spin (Ising-like) models: the steepest-descent function $\varphi(t)$ of AFEM.

A system of $N$ vector spins $\sigma_i \in \mathbb{R}^D$, $\lVert\sigma_i\rVert^2 = D$, with
symmetric couplings $J$ in external fields $h_i$ (the rows of $H$),

$$E(\sigma) = -\sum_{i,j} J_{ij}\, \sigma_i\cdot\sigma_j - \sum_i h_i\cdot\sigma_i ,$$

has, after the spin constraints are written with auxiliary variables $t_i$ and the Gaussian
integrals are done, a partition function dominated (for large $D$) by the minimum over $t$ of

$$\varphi(t) = \beta \sum_i t_i - \tfrac12 \log\det V + \tfrac{\beta}{4}
  \operatorname{Tr}\!\left(H^\top V^{-1} H\right), \qquad V = \operatorname{diag}(t) - J .$$

This module is layer 1: $\varphi$, its analytic gradient and exact Hessian, all through one
Cholesky factor of $V$. The saddle-point solve, $\log Z$ and the magnetizations live in
`energyattn._solver._saddle`.

Internally $t$ is a vector `tp` of length `n`: `n = N` in vector mode (one $t_i$ per spin)
and `n = 1` in scalar mode (one shared $t$, i.e. $t_i = t$ for all $i$).
"""

from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import check_positive, check_shape
from .._custom_types import Scalar, ScalarLike
from .._linalg import upper_cholesky
from ._base import AbstractEnergy

Mode = Literal["vector", "scalar"]


def check_mode(mode: Any) -> Mode:
    if mode not in ("vector", "scalar"):
        raise ValueError(f"mode must be 'vector' (one t per spin) or 'scalar', got {mode!r}")
    return mode


def check_system(
    J: Any, H: Any, beta: Any, extra: tuple[Any, ...] = ()
) -> tuple[Float[Array, "spins spins"], Float[Array, "spins dim"], Float[Array, ""]]:
    """Shapes (ValueError), `beta > 0`, one floating dtype (at least float32) for all.

    The couplings are symmetrised: only the symmetric part of $J$ enters the energy
    $\\sum_{ij} J_{ij}\\sigma_i\\cdot\\sigma_j$, and the Cholesky factorisation reads one
    triangle, so an asymmetric $J$ would otherwise be silently misread.
    """
    check_shape("H", H, "spins dim")
    check_shape("J", J, "spins spins")
    if np.shape(J)[0] != np.shape(H)[0]:
        # Neither is wrong alone: name both.
        raise ValueError(
            f"J and H disagree on the number of spins: J has shape {np.shape(J)} (spins "
            f"{np.shape(J)[0]}) but H has shape {np.shape(H)} (spins {np.shape(H)[0]})"
        )
    beta = check_positive("beta", beta)
    dtype = jnp.promote_types(jnp.result_type(J, H, beta, *extra), jnp.float32)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"J, H and beta must be real floating point, got dtype {dtype}")
    J = jnp.asarray(J, dtype)
    return 0.5 * (J + J.T), jnp.asarray(H, dtype), beta.astype(dtype)


def check_t(t: Any, num_spins: int, mode: Mode, name: str = "t") -> None:
    if mode == "vector":
        check_shape(name, t, "spins", spins=num_spins)
    elif np.shape(t) != ():
        raise ValueError(
            f"{name} must have shape () in scalar mode (one shared t), got {np.shape(t)}"
        )


def expand(tp: Float[Array, " n"], num_spins: int) -> Float[Array, " spins"]:
    """The per-spin $t$ from the internal parameter (`n = 1` in scalar mode)."""
    return jnp.broadcast_to(tp, (num_spins,))


class Factor(NamedTuple):
    r"""$V = U^\top U$ ($U = L^\top$, the Cholesky factor transposed) and $Y = U^{-\top}H$
    (with $U = I$ where $V$ is not positive definite).

    Kept as $U$: LAPACK writes $L$ in column-major order, which is $U$ in XLA's row-major
    order, so every consumer (the triangular solves, the blocked inverse) reads it without a
    transposing copy.
    """

    U: Float[Array, "spins spins"]
    Y: Float[Array, "spins dim"]
    ok: Bool[Array, ""]


def factor(
    tp: Float[Array, " n"], J: Float[Array, "spins spins"], H: Float[Array, "spins dim"]
) -> Factor:
    r"""Cholesky factor of $V = \mathrm{diag}(t) - J$; `ok` is False where it does not exist.

    A failed factorisation (JAX fills it with NaN) is the test for $V \succ 0$: no
    eigenvalues, no determinant of an indefinite matrix. The identity stands in for the
    factor there so that nothing downstream sees NaN; callers mask with `ok`.
    """
    n = J.shape[0]
    # J is symmetric (checked by the callers), as upper_cholesky requires.
    V = jnp.diag(expand(tp, n)) - J
    U = upper_cholesky(V)
    diag = jnp.diagonal(U)
    ok = jnp.all(jnp.isfinite(diag) & (diag > 0))
    U = jnp.where(ok, U, jnp.eye(n, dtype=U.dtype))
    Y = jsl.solve_triangular(U.T, H, lower=True)
    return Factor(U, Y, ok)


def phi_terms(tp: Float[Array, " n"], fac: Factor, beta: Float[Array, ""]) -> tuple[Scalar, Scalar]:
    """$\\varphi$ from the factor (valid where `fac.ok`), and the size of its terms.

    $\\log\\det V = 2\\sum_i \\log U_{ii}$ and
    $\\operatorname{Tr}(H^\\top V^{-1} H) = \\lVert U^{-\\top}H \\rVert_F^2$. The second value,
    the sum of the terms' magnitudes, bounds the round-off in the first (the line search's
    slack).
    """
    n = fac.U.shape[0]
    linear = beta * jnp.sum(expand(tp, n))
    logdet_half = jnp.sum(jnp.log(jnp.diagonal(fac.U)))
    quadratic = 0.25 * beta * jnp.sum(jnp.square(fac.Y))
    return linear - logdet_half + quadratic, jnp.abs(linear) + jnp.abs(logdet_half) + quadratic


def grad_hess_from(
    tp: Float[Array, " n"],
    A: Float[Array, "spins spins"],
    P: Float[Array, "spins spins"],
    beta: Float[Array, ""],
) -> tuple[Float[Array, " n"], Float[Array, "n n"]]:
    """The analytic gradient and the exact Hessian of $\\varphi$ with respect to `tp`.

    With $A = V^{-1}$, $X = V^{-1}H$ and $P = XX^\\top = V^{-1}HH^\\top V^{-1}$:

    $$\\partial_i\\varphi = \\beta - \\tfrac12 A_{ii} - \\tfrac\\beta4 P_{ii},\\qquad
      \\partial_i\\partial_j\\varphi = A_{ij}\\left(\\tfrac12 A_{ij}
      + \\tfrac\\beta2 P_{ij}\\right)$$

    ($\\partial A/\\partial t_j = -A e_j e_j^\\top A$ gives both). Scalar mode sums them:
    $\\varphi'(t) = \\sum_i \\partial_i\\varphi$, $\\varphi''(t) = \\sum_{ij}
    \\partial_i\\partial_j\\varphi$. Only products and sums: cheap to differentiate again.
    """
    n = A.shape[0]
    grad = beta - 0.5 * jnp.diagonal(A) - 0.25 * beta * jnp.diagonal(P)
    hess = A * (0.5 * A + 0.5 * beta * P)
    if tp.shape[0] == 1 and n != 1:  # scalar mode: t_i = t for every i
        return jnp.sum(grad, keepdims=True), jnp.sum(hess, keepdims=True)
    return grad, hess


_BLOCK = 128


def _upper_inverse(U: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$U^{-1}$ for upper-triangular $U$, by 2 x 2 blocks down to `_BLOCK`.

    $\begin{pmatrix} P & Q \\ 0 & R \end{pmatrix}^{-1} = \begin{pmatrix} P^{-1} &
    -P^{-1} Q R^{-1} \\ 0 & R^{-1} \end{pmatrix}$: a third of the flops of a triangular
    solve against the identity, mostly in matrix products (measured: the saddle point's section
    of `benchmarks/README.md`).
    """
    n = U.shape[0]
    if n <= _BLOCK:
        # (L^-1)^T with L = U^T: LAPACK reads U^T in column-major order, U's own bytes.
        return jsl.solve_triangular(U.T, jnp.eye(n, dtype=U.dtype), lower=True).T
    m = n // 2
    top, bottom = _upper_inverse(U[:m, :m]), _upper_inverse(U[m:, m:])
    corner = -(top @ U[:m, m:]) @ bottom
    return jnp.block([[top, corner], [jnp.zeros((n - m, m), U.dtype), bottom]])


def _upper_gram(M: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$M M^\top$ for upper-triangular $M$, by blocks (skipping the zero half)."""
    n = M.shape[0]
    if n <= _BLOCK:
        return M @ M.T
    m = n // 2
    P, Q, R = M[:m, :m], M[:m, m:], M[m:, m:]
    off = Q @ R.T
    return jnp.block([[_upper_gram(P) + Q @ Q.T, off], [off.T, _upper_gram(R)]])


def inverse_from_upper(U: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$V^{-1} = U^{-1} U^{-\top} = M M^\top$ from the Cholesky factor $V = U^\top U$
    ($U = L^\top$, see `upper_cholesky`), with $M = U^{-1}$ upper triangular.

    On $U$ rather than $L$ because products of the form $M M^\top$ (contracting the last
    axes of row-major arrays) run on XLA's fast CPU matrix kernels, where $L^{-\top}L^{-1}$
    would not, and because $U$ is what LAPACK writes, without a transposing copy.
    """
    return _upper_gram(_upper_inverse(U))


class Parts(NamedTuple):
    """$A = V^{-1}$, $X = V^{-1}H$ and $P = XX^\\top$: everything $\\varphi$'s derivatives
    are made of (the magnetizations are $\\frac\\beta2 X$)."""

    A: Float[Array, "spins spins"]
    X: Float[Array, "spins dim"]
    P: Float[Array, "spins spins"]


def parts_from(A: Float[Array, "spins spins"], H: Float[Array, "spins dim"]) -> Parts:
    X = A @ H
    return Parts(A, X, X @ X.T)


def parts_from_factor(fac: Factor, H: Float[Array, "spins dim"]) -> Parts:
    """The parts from the Cholesky factor of $V$ (no second factorisation)."""
    return parts_from(inverse_from_upper(fac.U), H)


@jax.custom_jvp
def inverse_and_logdet(
    V: Float[Array, "spins spins"],
) -> tuple[Float[Array, "spins spins"], Float[Array, ""]]:
    """$V^{-1}$ and $\\log\\det V$ through the Cholesky factor (NaN where $V \\not\\succ 0$).

    The `custom_jvp` states the derivatives as products,
    $\\dot{(V^{-1})} = -V^{-1}\\dot V V^{-1}$ and $\\dot{(\\log\\det V)} =
    \\operatorname{Tr}(V^{-1}\\dot V)$, in terms of this same function: every order of
    differentiation reuses the one factorisation instead of differentiating the Cholesky
    and triangular-solve algorithms themselves (fewer, cheaper operations to compile and run).
    `V` is symmetric by construction (its callers' couplings are), so the factorisation
    reads one triangle without symmetrising first, as `factor` does.
    """
    U = upper_cholesky(V)
    return inverse_from_upper(U), 2 * jnp.sum(jnp.log(jnp.diagonal(U)))


@inverse_and_logdet.defjvp
def _inverse_and_logdet_jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    (V,), (V_dot,) = primals, tangents
    A, logdet = inverse_and_logdet(V)
    return (A, logdet), (-A @ V_dot @ A, jnp.sum(A * V_dot.T))


def _inverse(
    tp: Float[Array, " n"], J: Float[Array, "spins spins"]
) -> tuple[Float[Array, "spins spins"], Float[Array, ""]]:
    return inverse_and_logdet(jnp.diag(expand(tp, J.shape[0])) - J)


def grad_hess_tp(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> tuple[Float[Array, " n"], Float[Array, "n n"], Bool[Array, ""]]:
    """Gradient and Hessian as differentiable functions of everything, and the domain flag."""
    A, logdet = _inverse(tp, J)
    grad, hess = grad_hess_from(tp, A, parts_from(A, H).P, beta)
    return grad, hess, jnp.isfinite(logdet)


def phi_tp(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> Scalar:
    """$\\varphi$ of the internal parameter: $+\\infty$ outside the domain $V \\succ 0$.

    NaN inputs give NaN (never $+\\infty$): a poisoned input must not look like a point
    outside the domain.
    """
    A, logdet = _inverse(tp, J)
    value = (
        beta * jnp.sum(expand(tp, J.shape[0])) - 0.5 * logdet + 0.25 * beta * jnp.sum(H * (A @ H))
    )
    finite_inputs = (
        jnp.all(jnp.isfinite(tp))
        & jnp.all(jnp.isfinite(J))
        & jnp.all(jnp.isfinite(H))
        & jnp.isfinite(beta)
    )
    return domain_value(value, jnp.isfinite(logdet), finite_inputs)


def domain_value(value: Scalar, ok: Bool[Array, ""], finite_inputs: Bool[Array, ""]) -> Scalar:
    """`value` inside the domain, $+\\infty$ outside it, NaN for non-finite inputs.

    Non-finite inputs must never look like "outside the domain" (or, with an infinite
    $\\beta$, like a legitimate infinite value): they are NaN, whatever the factorisation
    says.
    """
    inf, nan = jnp.asarray(jnp.inf, value.dtype), jnp.asarray(jnp.nan, value.dtype)
    return jnp.where(finite_inputs, jnp.where(ok, value, inf), nan)


def _as_tp(t: Any, mode: Mode, dtype: Any) -> Float[Array, " n"]:
    t = jnp.asarray(t, dtype)
    return t[None] if mode == "scalar" else t


def _prepare(
    t: Any, J: Any, H: Any, beta: Any, mode: Any
) -> tuple[Array, Array, Array, Array, Mode]:
    mode = check_mode(mode)
    J, H, beta = check_system(J, H, beta, extra=(t,))
    check_t(t, H.shape[0], mode)
    return _as_tp(t, mode, H.dtype), J, H, beta, mode


def phi(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    *,
    mode: Mode = "vector",
) -> Scalar:
    r"""The AFEM steepest-descent function $\varphi(t)$ of a vector-spin model.

    $$\varphi(t) = \beta \sum_{i} t_i - \tfrac12 \log\det V
      + \tfrac{\beta}{4} \operatorname{Tr}\!\left(H^\top V^{-1} H\right),
      \qquad V = \operatorname{diag}(t) - J$$

    There is no $1/D$ in the last term: the fields are normalised as $H = \mathrm{LN}(x)/\sqrt{D}$
    (the seed's convention). Computed through the Cholesky factor $V = LL^\top$:
    $\log\det V = 2\sum_i\log L_{ii}$ and $\operatorname{Tr}(H^\top V^{-1}H) =
    \lVert L^{-1}H\rVert_F^2$. Where $V$ is not positive definite the Gaussian integrals behind
    $\varphi$ diverge and $\varphi = +\infty$ (it has no gradient there); NaN inputs give NaN.
    On its domain $\varphi$ is strictly convex, so it has at most one minimum $t^*$, the
    saddle point of the partition function (see [`saddle_point`][energyattn.spin.saddle_point]).

    **Arguments:**

    - `t`: the auxiliary variables: shape `(spins,)` in vector mode, shape `()` in scalar mode.
    - `J`: couplings, shape `(spins, spins)`; only the symmetric part $\frac12(J + J^\top)$
      enters.
    - `H`: the external fields $h_i$ as rows, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `mode`: `"vector"` (default; one $t_i$ per spin) or `"scalar"` ($t_i = t$ for all $i$).

    **Returns:**

    $\varphi(t)$, a 0-d array (float32 at least).
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eq. "varphinorm".
    """
    tp, J, H, beta, _ = _prepare(t, J, H, beta, mode)
    return phi_tp(tp, J, H, beta)


def _checked_grad_hess(t: Any, J: Any, H: Any, beta: Any, mode: Any) -> tuple[Array, Array]:
    tp, J, H, beta, mode = _prepare(t, J, H, beta, mode)
    grad, hess, ok = grad_hess_tp(tp, J, H, beta)
    grad, hess = eqx.error_if(
        (grad, hess),
        ~ok,
        "V = diag(t) - J is not positive definite at this t: phi is +inf there and has no "
        "derivatives",
    )
    if mode == "scalar":
        return grad[0], hess[0, 0]
    return grad, hess


def phi_grad(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    *,
    mode: Mode = "vector",
) -> Float[Array, " spins"] | Float[Array, ""]:
    r"""The analytic gradient of [`phi`][energyattn.spin.phi] with respect to $t$.

    $$\frac{\partial\varphi}{\partial t_i} = \beta - \tfrac12 \left[V^{-1}\right]_{ii}
      - \tfrac\beta4 \left[V^{-1} H H^\top V^{-1}\right]_{ii}$$

    In scalar mode it is the sum over $i$. It equals `jax.grad(phi)` (tested) and is what the
    Newton solver uses. Raises (at run time) where $V$ is not positive definite.

    **Arguments:**

    As [`phi`][energyattn.spin.phi].

    **Returns:**

    The gradient: shape `(spins,)` in vector mode, `()` in scalar mode.
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Implicit layers for steepest-descent root-finding" (the gradient vector).
    """
    return _checked_grad_hess(t, J, H, beta, mode)[0]


def phi_hessian(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    *,
    mode: Mode = "vector",
) -> Float[Array, "spins spins"] | Float[Array, ""]:
    r"""The exact Hessian of [`phi`][energyattn.spin.phi] with respect to $t$.

    $$\nabla^2\varphi = V^{-1} \circ \left(\tfrac12 V^{-1}
      + \tfrac\beta2\, V^{-1} H H^\top V^{-1}\right)$$

    ($\circ$ is the elementwise product), positive definite wherever $V \succ 0$ (Schur
    product theorem), so $\varphi$ is strictly convex there. The reference implementation's
    vector-mode Hessian keeps only a diagonal approximation of the second term; this one is
    exact and equals `jax.hessian(phi)` (tested). In scalar mode it is the sum of all entries.
    Raises (at run time) where $V$ is not positive definite.

    **Arguments:**

    As [`phi`][energyattn.spin.phi].

    **Returns:**

    The Hessian: shape `(spins, spins)` in vector mode, `()` in scalar mode.
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Implicit layers for steepest-descent root-finding" (the Hessian, here exact).
    """
    return _checked_grad_hess(t, J, H, beta, mode)[1]


class PhiEnergy(AbstractEnergy):
    r"""Module form of [`phi`][energyattn.spin.phi]: the energy of the auxiliary variables $t$.

    $$E(t) = \varphi(t; J, H, \beta)$$

    A composable [`AbstractEnergy`][energyattn.AbstractEnergy] whose minimum is the saddle
    point $t^*$; `jax.grad` of it is the gradient of the stationarity conditions.

    **Arguments:**

    - `J`, `H`, `beta`, `mode`: as in [`phi`][energyattn.spin.phi].
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eq. "varphinorm".
    """

    J: Float[Array, "spins spins"]
    H: Float[Array, "spins dim"]
    beta: Float[Array, ""]
    mode: Mode = eqx.field(static=True)

    def __init__(
        self,
        J: Float[ArrayLike, "spins spins"],
        H: Float[ArrayLike, "spins dim"],
        beta: ScalarLike,
        *,
        mode: Mode = "vector",
    ):
        self.mode = check_mode(mode)
        self.J, self.H, self.beta = check_system(J, H, beta)

    def __call__(self, x: Float[Array, " spins"] | Float[Array, ""], args: Any = None) -> Scalar:
        return phi(x, self.J, self.H, self.beta, mode=self.mode)


def symmetric_couplings(J_raw: Float[ArrayLike, "spins spins"]) -> Float[Array, "spins spins"]:
    r"""Symmetrised couplings with zero diagonal, from an unconstrained parameter.

    $$J = \tfrac12\left(J_{\mathrm{raw}} + J_{\mathrm{raw}}^\top\right) \circ (1 - I)$$

    **Arguments:**

    - `J_raw`: any square matrix, shape `(spins, spins)`.

    **Returns:**

    The symmetric, traceless couplings $J$, shape `(spins, spins)`.
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Initialization and normalization" (couplings symmetric and traceless).
    """
    check_shape("J_raw", J_raw, "spins spins")
    check_shape("J_raw", J_raw, "spins spins", spins=np.shape(J_raw)[0])
    J_raw = jnp.asarray(J_raw)
    off_diagonal = 1 - jnp.eye(J_raw.shape[0], dtype=J_raw.dtype)
    return 0.5 * (J_raw + J_raw.T) * off_diagonal


def input_couplings(
    H: Float[ArrayLike, "spins dim"],
    W_q: Float[ArrayLike, "dim dim"],
    W_k: Float[ArrayLike, "dim dim"],
) -> Float[Array, "spins spins"]:
    r"""Input-dependent couplings $J(H)$, symmetrised with zero diagonal.

    $$J(H) = \frac{\tanh\!\left(\sqrt{D}\, q k^\top\right)}{\sqrt{N D}},
      \qquad q = H W_q^\top,\; k = H W_k^\top,$$

    then $\frac12(J + J^\top)$ with the diagonal set to zero. Pass the function
    `lambda H: input_couplings(H, W_q, W_k)` as the couplings of
    [`log_partition`][energyattn.spin.log_partition] or
    [`magnetizations`][energyattn.spin.magnetizations]: the magnetizations then include the
    $\partial J/\partial H$ terms (the seed's "channel-mixing" contributions) automatically.

    **Arguments:**

    - `H`: the fields, shape `(spins, dim)`.
    - `W_q`, `W_k`: query and key weights, shape `(dim, dim)` (the `y = x Wᵀ` convention).

    **Returns:**

    The couplings, shape `(spins, spins)`.
    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Input-dependent couplings"; and *Transformers Are Secretly Collectives of Spin
        Systems* (2021).
    """
    check_shape("H", H, "spins dim")
    num_spins, dim = np.shape(H)
    check_shape("W_q", W_q, "dim dim", dim=dim)
    check_shape("W_k", W_k, "dim dim", dim=dim)
    H = jnp.asarray(H)
    q = H @ jnp.asarray(W_q).T
    k = H @ jnp.asarray(W_k).T
    raw = jnp.tanh(np.sqrt(dim) * (q @ k.T)) / np.sqrt(num_spins * dim)
    return symmetric_couplings(raw)
