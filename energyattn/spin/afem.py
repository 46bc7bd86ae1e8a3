r"""The vector-spin model of AFEM (approximate free energy minimisation): its equations and
its solves, as `ea.spin.afem` (the flat names `ea.spin.phi`, `ea.spin.saddle_point`, ... are
these).

A system of $N$ vector spins $\sigma_i \in \mathbb{R}^D$, $\lVert\sigma_i\rVert^2 = D$, with
symmetric couplings $J$ in external fields $h_i$ (the rows of $H$),

$$E(\sigma) = -\sum_{i,j} J_{ij}\, \sigma_i\cdot\sigma_j - \sum_i h_i\cdot\sigma_i ,$$

has, after the spin constraints are written with auxiliary variables $t_i$ and the Gaussian
integrals are done, a partition function dominated (for large $D$) by the minimum over $t$ of

$$\varphi(t) = \beta \sum_i t_i - \tfrac12 \log\det V + \tfrac{\beta}{4}
  \operatorname{Tr}\!\left(H^\top V^{-1} H\right), \qquad V = \operatorname{diag}(t) - J .$$

Read top to bottom. **The equations:** $\varphi$, its analytic gradient and exact Hessian,
all through one Cholesky factor of $V$ (`phi`, `phi_grad`, `phi_hessian`, `PhiEnergy`,
the couplings). **The solve:** $t^* = \arg\min_t \varphi(t)$ is
[`ea.Newton`][energyattn.Newton] on $\varphi$ through the solver engine's loop
(`energyattn._solver.iterate`; its line search keeps $V \succ 0$), with the exact analytic
Hessian: the objective `_Phi` hands Newton everything through one Cholesky factor of $V$ per
trial point, $\varphi$ from the factor, then $A = V^{-1}$, $X = AH$ and $P = XX^\top$, from
which the gradient and Hessian are sums and products (`saddle_point`). Derivatives of $t^*$
come from the engine's [`ImplicitAdjoint`][energyattn.ImplicitAdjoint] (`implicit_value`),
whose solve uses the Cholesky factor of the Hessian at $t^*$ (Newton's, or made once when
needed). **What follows from $t^*$:** $\log Z = -\frac N2 (1 + \ln 2\beta) + \varphi(t^*)$
has a `custom_jvp` of its own, the envelope theorem: at the stationary point
$\frac{d}{d\theta}\varphi(t^*(\theta), \theta) = \partial_\theta\varphi$, which is a sum of
products of $A$, $X$ and $P$ with the tangents. Those three come from Newton's last iterate
(no new factorisation), through a second `custom_jvp` ($\dot A = -A\dot VA$,
$\dot X = \dot AH + A\dot H$) that makes them differentiable again, so second derivatives
(training on the magnetizations) are exact (`log_partition`, `free_energy`,
`magnetizations`).

Per call, in $N\times N$ factorisation-sized operations: each Newton pass factorises $V$,
inverts the factor, forms $A$, $X$, $P$ and factorises the Hessian, except the last, which
tests convergence with the previous Hessian factor (`chord_check`); $\log Z$ and its
gradient add no such operation, derivatives through $t^*$ (the magnetizations' gradients)
one factorisation of the Hessian at $t^*$ (see `benchmarks/README.md` for the count).

Internally $t$ is a vector `tp` of length `n`: `n = N` in vector mode (one $t_i$ per spin)
and `n = 1` in scalar mode (one shared $t$, i.e. $t_i = t$ for all $i$). Everything is
unbatched; use `jax.vmap` for batches. `check_mode` and `check_system` are the checks
`ea.nn.VectorSpinAttention` and the plots share with these functions.

??? cite "Source"

    M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import check_beta, check_finite, check_shape, keyword_arguments, positive_int
from .._custom_types import Scalar, ScalarLike
from .._dtypes import accumulation_dtype
from .._energy import AbstractEnergy
from .._linalg import upper_cholesky
from .._namespace import public_dir
from .._solver import (
    DEFAULT_MAX_STEPS,
    RESULTS,
    AbstractObjective,
    MinimiseProblem,
    Newton,
    Solution,
    Trial,
    bounded_while,
    implicit_value,
    iterate,
    no_grad,
)

__all__ = [
    "PhiEnergy",
    "free_energy",
    "input_couplings",
    "log_partition",
    "magnetizations",
    "neumann_series",
    "phi",
    "phi_grad",
    "phi_hessian",
    "saddle_point",
    "symmetric_couplings",
]

#: One auxiliary $t_i$ per spin (`"vector"`) or one shared $t$ (`"scalar"`).
Mode = Literal["vector", "scalar"]
#: Couplings `(spins, spins)`, or a function of the fields `H` that returns them.
Couplings = Float[ArrayLike, "spins spins"] | Callable[[Float[Array, "spins dim"]], Array]


# ---------------------------------------------------------------- the equations


def check_mode(mode: Any) -> Mode:
    """`mode`, checked: `"vector"` or `"scalar"` (a `ValueError` otherwise)."""
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
    beta = check_beta(beta)
    dtype = accumulation_dtype(J, H, beta, *extra)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"J, H and beta must be real floating point, got dtype {dtype}")
    J = jnp.asarray(J, dtype)
    return 0.5 * (J + J.T), jnp.asarray(H, dtype), beta.astype(dtype)


def _check_t(t: Any, num_spins: int, mode: Mode, name: str = "t") -> None:
    if mode == "vector":
        check_shape(name, t, "spins", spins=num_spins)
    elif np.shape(t) != ():
        raise ValueError(
            f"{name} must have shape () in scalar mode (one shared t), got {np.shape(t)}"
        )


def _expand(tp: Float[Array, " n"], num_spins: int) -> Float[Array, " spins"]:
    """The per-spin $t$ from the internal parameter (`n = 1` in scalar mode)."""
    return jnp.broadcast_to(tp, (num_spins,))


class _Factor(NamedTuple):
    r"""$V = U^\top U$ ($U = L^\top$, the Cholesky factor transposed) and $Y = U^{-\top}H$
    (with $U = I$ where $V$ is not positive definite).

    Kept as $U$: LAPACK writes $L$ in column-major order, which is $U$ in XLA's row-major
    order, so every consumer (the triangular solves, the blocked inverse) reads it without a
    transposing copy.
    """

    U: Float[Array, "spins spins"]
    Y: Float[Array, "spins dim"]
    ok: Bool[Array, ""]


def _factor(
    tp: Float[Array, " n"], J: Float[Array, "spins spins"], H: Float[Array, "spins dim"]
) -> _Factor:
    r"""Cholesky factor of $V = \mathrm{diag}(t) - J$; `ok` is False where it does not exist.

    A failed factorisation (JAX fills it with NaN) is the test for $V \succ 0$: no
    eigenvalues, no determinant of an indefinite matrix. The identity stands in for the
    factor there so that nothing downstream sees NaN; callers mask with `ok`.
    """
    n = J.shape[0]
    # J is symmetric (checked by the callers), as upper_cholesky requires.
    V = jnp.diag(_expand(tp, n)) - J
    U = upper_cholesky(V)
    diag = jnp.diagonal(U)
    ok = jnp.all(jnp.isfinite(diag) & (diag > 0))
    U = jnp.where(ok, U, jnp.eye(n, dtype=U.dtype))
    Y = jsl.solve_triangular(U.T, H, lower=True)
    return _Factor(U, Y, ok)


def _phi_terms(
    tp: Float[Array, " n"], fac: _Factor, beta: Float[Array, ""]
) -> tuple[Scalar, Scalar]:
    """$\\varphi$ from the factor (valid where `fac.ok`), and the size of its terms.

    $\\log\\det V = 2\\sum_i \\log U_{ii}$ and
    $\\operatorname{Tr}(H^\\top V^{-1} H) = \\lVert U^{-\\top}H \\rVert_F^2$. The second value,
    the sum of the terms' magnitudes, bounds the round-off in the first (the line search's
    slack).
    """
    n = fac.U.shape[0]
    linear = beta * jnp.sum(_expand(tp, n))
    logdet_half = jnp.sum(jnp.log(jnp.diagonal(fac.U)))
    quadratic = 0.25 * beta * jnp.sum(jnp.square(fac.Y))
    return linear - logdet_half + quadratic, jnp.abs(linear) + jnp.abs(logdet_half) + quadratic


def _grad_hess_from(
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


def _inverse_from_upper(U: Float[Array, "n n"]) -> Float[Array, "n n"]:
    r"""$V^{-1} = U^{-1} U^{-\top} = M M^\top$ from the Cholesky factor $V = U^\top U$
    ($U = L^\top$, see `upper_cholesky`), with $M = U^{-1}$ upper triangular.

    On $U$ rather than $L$ because products of the form $M M^\top$ (contracting the last
    axes of row-major arrays) run on XLA's fast CPU matrix kernels, where $L^{-\top}L^{-1}$
    would not, and because $U$ is what LAPACK writes, without a transposing copy.
    """
    return _upper_gram(_upper_inverse(U))


class _Parts(NamedTuple):
    """$A = V^{-1}$, $X = V^{-1}H$ and $P = XX^\\top$: everything $\\varphi$'s derivatives
    are made of (the magnetizations are $\\frac\\beta2 X$)."""

    A: Float[Array, "spins spins"]
    X: Float[Array, "spins dim"]
    P: Float[Array, "spins spins"]


def _parts_from(A: Float[Array, "spins spins"], H: Float[Array, "spins dim"]) -> _Parts:
    X = A @ H
    return _Parts(A, X, X @ X.T)


def _parts_from_factor(fac: _Factor, H: Float[Array, "spins dim"]) -> _Parts:
    """The parts from the Cholesky factor of $V$ (no second factorisation)."""
    return _parts_from(_inverse_from_upper(fac.U), H)


@jax.custom_jvp
def _inverse_and_logdet(
    V: Float[Array, "spins spins"],
) -> tuple[Float[Array, "spins spins"], Float[Array, ""]]:
    """$V^{-1}$ and $\\log\\det V$ through the Cholesky factor (NaN where $V \\not\\succ 0$).

    The `custom_jvp` states the derivatives as products,
    $\\dot{(V^{-1})} = -V^{-1}\\dot V V^{-1}$ and $\\dot{(\\log\\det V)} =
    \\operatorname{Tr}(V^{-1}\\dot V)$, in terms of this same function: every order of
    differentiation reuses the one factorisation instead of differentiating the Cholesky
    and triangular-solve algorithms themselves (fewer, cheaper operations to compile and run).
    `V` is symmetric by construction (its callers' couplings are), so the factorisation
    reads one triangle without symmetrising first, as `_factor` does.
    """
    U = upper_cholesky(V)
    return _inverse_from_upper(U), 2 * jnp.sum(jnp.log(jnp.diagonal(U)))


@_inverse_and_logdet.defjvp
def _inverse_and_logdet_jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    (V,), (V_dot,) = primals, tangents
    A, logdet = _inverse_and_logdet(V)
    return (A, logdet), (-A @ V_dot @ A, jnp.sum(A * V_dot.T))


def _inverse(
    tp: Float[Array, " n"], J: Float[Array, "spins spins"]
) -> tuple[Float[Array, "spins spins"], Float[Array, ""]]:
    return _inverse_and_logdet(jnp.diag(_expand(tp, J.shape[0])) - J)


def _grad_hess_tp(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> tuple[Float[Array, " n"], Float[Array, "n n"], Bool[Array, ""]]:
    """Gradient and Hessian as differentiable functions of everything, and the domain flag."""
    A, logdet = _inverse(tp, J)
    grad, hess = _grad_hess_from(tp, A, _parts_from(A, H).P, beta)
    return grad, hess, jnp.isfinite(logdet)


def _phi_tp(
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
        beta * jnp.sum(_expand(tp, J.shape[0])) - 0.5 * logdet + 0.25 * beta * jnp.sum(H * (A @ H))
    )
    finite_inputs = (
        jnp.all(jnp.isfinite(tp))
        & jnp.all(jnp.isfinite(J))
        & jnp.all(jnp.isfinite(H))
        & jnp.isfinite(beta)
    )
    return _domain_value(value, jnp.isfinite(logdet), finite_inputs)


def _domain_value(value: Scalar, ok: Bool[Array, ""], finite_inputs: Bool[Array, ""]) -> Scalar:
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
    _check_t(t, H.shape[0], mode)
    return _as_tp(t, mode, H.dtype), J, H, beta, mode


@keyword_arguments("ea.spin.phi")
def phi(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
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
    return _compiled_phi(tp, J, H, beta)


# The public functions check their arguments as they are called (a `ValueError` for a bad
# value known then), and run the computation as one compiled program: eagerly, op by op,
# a saddle point of 6 spins took seconds, compiled a tenth of a millisecond. Their arrays
# (beta included, checked into an array) are traced, so a new value compiles nothing new.
_compiled_phi = eqx.filter_jit(_phi_tp)


def _checked_grad_hess(t: Any, J: Any, H: Any, beta: Any, mode: Any) -> tuple[Array, Array]:
    tp, J, H, beta, mode = _prepare(t, J, H, beta, mode)
    return _compiled_grad_hess(tp, J, H, beta, mode)


@eqx.filter_jit
def _compiled_grad_hess(
    tp: Array, J: Array, H: Array, beta: Array, mode: Mode
) -> tuple[Array, Array]:
    grad, hess, ok = _grad_hess_tp(tp, J, H, beta)
    grad, hess = eqx.error_if(
        (grad, hess),
        ~ok,
        "V = diag(t) - J is not positive definite at this t: phi is +inf there and has no "
        "derivatives",
    )
    if mode == "scalar":
        return grad[0], hess[0, 0]
    return grad, hess


@keyword_arguments("ea.spin.phi_grad")
def phi_grad(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
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


@keyword_arguments("ea.spin.phi_hessian")
def phi_hessian(
    t: Float[ArrayLike, " spins"] | ScalarLike,
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
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

    @keyword_arguments("ea.spin.PhiEnergy")
    def __init__(
        self,
        J: Float[ArrayLike, "spins spins"],
        H: Float[ArrayLike, "spins dim"],
        *,
        beta: ScalarLike,
        mode: Mode = "vector",
    ):
        self.mode = check_mode(mode)
        self.J, self.H, self.beta = check_system(J, H, beta)

    def __call__(self, x: Float[Array, " spins"] | Float[Array, ""], args: Any = None) -> Scalar:
        return phi(x, self.J, self.H, beta=self.beta, mode=self.mode)


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


# ------------------------------------------------------- the saddle point: Newton on phi

#: The default start is shifted towards a surely feasible point by 2^-6, 2^-5, ..., 1.
_START_DOUBLINGS = 6


class _Phi(AbstractObjective):
    """$\\varphi(t)$ of `args = (J, H, beta)`, with analytic derivatives from one factor."""

    def value(self, tp, args):
        J, H, beta = args
        fac = _factor(tp, J, H)
        f, scale = _phi_terms(tp, fac, beta)
        finite = (
            jnp.all(jnp.isfinite(J))
            & jnp.all(jnp.isfinite(H))
            & jnp.isfinite(beta)
            & jnp.all(jnp.isfinite(tp))
        )
        return _domain_value(f, fac.ok, finite), scale, fac

    def gradient(self, tp, args, aux):
        return self.hessian(tp, args, aux)[0]

    def hessian(self, tp, args, aux):
        _, H, beta = args
        parts = _parts_from_factor(aux, H)
        grad, hess = _grad_hess_from(tp, parts.A, parts.P, beta)
        return grad, hess, parts

    def residual(self, tp, args):
        return _grad_hess_tp(tp, *args)[0]


def _starts(
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
    scalar: bool,
) -> tuple[Float[Array, " n"], Float[Array, " n"]]:
    """The uncoupled saddle point, and the same shifted to be surely feasible (the fallback).

    Without couplings $\\varphi$ separates and $\\partial_i\\varphi = 0$ is the quadratic
    $4\\beta t_i^2 - 2t_i - \\beta\\lVert h_i\\rVert^2 = 0$, so
    $t_i^{(0)} = (1 + \\sqrt{1 + 4\\beta^2\\lVert h_i\\rVert^2})/(4\\beta)$. Adding each
    row's Gershgorin radius $R_i = \\sum_{j\\ne i}|J_{ij}|$ (and $J_{ii}$) makes
    $V \\succeq \\mathrm{diag}(t^{(0)}) \\succ 0$ whatever $J$ is.
    """
    h2 = jnp.sum(jnp.square(H), axis=-1)
    diag = jnp.diagonal(J)
    radius = jnp.sum(jnp.abs(J), axis=-1) - jnp.abs(diag)
    if scalar:
        free = (1 + jnp.sqrt(1 + 4 * beta**2 * jnp.mean(h2))) / (4 * beta)
        return (jnp.max(diag) + free)[None], (jnp.max(diag + radius) + free)[None]
    free = (1 + jnp.sqrt(1 + 4 * beta**2 * h2)) / (4 * beta)
    return diag + free, diag + radius + free


def _feasible_start(
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
    scalar: bool,
) -> Trial:
    """The first of $t_0 + a(b - t_0)$, $a = 0, 2^{-6}, 2^{-5}, \\dots, 1$ ($t_0$ the
    uncoupled start, $b$ the fallback) where $V \\succ 0$: close to $t_0$ when a small shift
    suffices, never worse than $b$ (for which it always holds). Returned with $\\varphi$
    evaluated there, which Newton takes as its first iterate without evaluating it again."""
    start, fallback = _starts(J, H, beta, scalar)
    args = (J, H, beta)

    def evaluate(tp):
        return Trial(tp, *_PROBLEM.objective.value(tp, args))

    def cond(carry):
        k, trial = carry
        return ~jnp.isfinite(trial.f) & (k <= _START_DOUBLINGS)

    def body(carry):
        k, _ = carry
        shift = 2.0 ** (k.astype(start.dtype) - _START_DOUBLINGS)
        return k + 1, evaluate(start + shift * (fallback - start))

    _, trial = bounded_while(
        cond, body, (jnp.zeros((), jnp.int32), evaluate(start)), _START_DOUBLINGS + 1, False
    )
    return trial


class _Saddle(eqx.Module):
    """A solve, without derivatives, and what Newton's last iterate leaves for reuse."""

    solution: Solution  # value = t* (no derivatives yet; see `_attach`)
    factor: Float[Array, "n n"] | None  # Cholesky factor of the Hessian there, if Newton left it
    parts: _Parts  # A, X, P there
    phi: Float[Array, ""]  # phi there


_PROBLEM = MinimiseProblem(_Phi())


class _PhiAt(_Phi):
    """$\\nabla\\varphi$ for the adjoint, with `args = (J, H, beta, parts)`: the parts at the
    solution (Newton's cache) make the residual and its derivatives products of cached
    matrices (`_parts_at`), with no new factorisation of $V$."""

    def residual(self, tp, args):
        J, H, beta, cache = args
        A, _, P = _parts_at(tp, J, H, cache)
        return _grad_hess_from(tp, A, P, beta)[0]


_AT_SOLUTION = MinimiseProblem(_PhiAt())


def _default_solver(dtype: Any) -> Newton:
    """`ea.Newton` with tolerances `eps ** 0.75` (1.8e-12 in float64, 6.4e-6 in float32).

    Tighter than Newton's own default (`eps ** 0.6`) because $\\log Z$, its gradient and the
    magnetizations are read off the last iterate Newton evaluated (no new factorisation),
    whose error is the last step's size, not its square. With `chord_check`: the last pass
    tests convergence with the previous Hessian factor, and the Hessian at $t^*$ is
    factorised only if derivatives through $t^*$ are taken (not for $\\log Z$ and its
    gradient, which the envelope theorem gives).
    """
    tol = float(jnp.finfo(dtype).eps) ** 0.75
    return Newton(rtol=tol, atol=tol, chord_check=True, jacobian="dense")


class _System(eqx.Module):
    """The checked arguments that `saddle_point`, `log_partition`, `free_energy` and
    `magnetizations` share (`J, H, *, beta, t0, mode, solver, max_steps, throw`, documented
    once in `saddle_point` and `log_partition`), as one value for their compiled bodies."""

    J: Float[Array, "spins spins"]  # symmetrised; evaluated at H when given as a function
    H: Float[Array, "spins dim"]
    beta: Float[Array, ""]
    tp0: Float[Array, " n"] | None  # the warm start, flat, without gradient
    mode: Mode = eqx.field(static=True)
    solver: Newton | None
    max_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)


def _system(
    J: Any, H: Any, beta: Any, t0: Any, mode: Any, solver: Any, max_steps: Any, throw: Any
) -> _System:
    """The shared arguments, checked (a `ValueError` naming the bad one), in one place."""
    if solver is not None and not isinstance(solver, Newton):
        raise ValueError(f"solver must be ea.Newton(...) (with its tolerances), got {solver!r}")
    mode, max_steps = check_mode(mode), positive_int("max_steps", max_steps)
    check_shape("H", H, "spins dim")
    if callable(J):
        J = J(jnp.asarray(H, accumulation_dtype(H)))
    # A warm start does not decide the dtype (a float64 guess must not promote a float32 solve).
    J, H, beta = check_system(J, H, beta)
    tp0 = None
    if t0 is not None:
        _check_t(t0, H.shape[0], mode, "t0")
        tp0 = jax.lax.stop_gradient(jnp.asarray(t0).astype(H.dtype).reshape(-1))
    return _System(J, H, beta, tp0, mode, solver, max_steps, bool(throw))


def _saddle(system: _System) -> _Saddle:
    """The checked solve through the engine's loop; no derivatives flow through it."""
    J, H, beta, tp0, mode = system.J, system.H, system.beta, system.tp0, system.mode
    solver, max_steps, throw = system.solver, system.max_steps, system.throw
    if throw:
        J, H, beta = check_finite("J", J), check_finite("H", H), check_finite("beta", beta)
        if tp0 is not None:
            tp0 = check_finite("t0", tp0)
    J, H, beta = no_grad((J, H, beta))
    solver = _default_solver(H.dtype) if solver is None else solver
    start = None
    if tp0 is None:
        start = _feasible_start(J, H, beta, mode == "scalar")
        tp0 = start.y
    if solver.matrix_free(tp0.shape[0]):
        # log Z, its gradient and the magnetizations are read off the dense Hessian's
        # cached products (A, X, P) at t*, which matrix-free steps never form.
        raise ValueError(
            f"saddle_point needs Newton's dense Hessian, but ea.Newton(jacobian="
            f"{solver.jacobian!r}) takes matrix-free steps for {tp0.shape[0]} unknowns; "
            "pass ea.Newton(..., jacobian='dense')"
        )
    solution, extras = iterate(solver, _PROBLEM, tp0, (J, H, beta), max_steps, start=start)
    # t* is the last iterate Newton evaluated, not that plus its last (tiny) step: the
    # cached A, X, P, phi and the Hessian's factor are then exact at the t* returned.
    last = extras["point"]
    solution = eqx.tree_at(lambda s: s.value, solution, last.y)
    if throw:
        # Only an infeasible start fails before any step.
        bad_start = (solution.result == RESULTS.infeasible) & (solution.num_steps == 0)
        solution = eqx.tree_at(
            lambda s: s.value,
            solution,
            eqx.error_if(
                solution.value,
                bad_start,
                "saddle_point: V = diag(t0) - J is not positive definite at the given t0, "
                "so Newton cannot start there; start further right (larger t0) or pass "
                "t0=None for the feasible default start",
            ),
        )
    saddle = _Saddle(solution, extras["factor"], extras["cache"], last.f)
    if throw:
        # Route everything read off the solve through the check: log Z uses phi and the
        # parts, not t* itself.
        failed = solution.result != RESULTS.successful
        saddle = solution.result.error_if(saddle, failed)
    return saddle


def _attach(saddle: _Saddle, J: Array, H: Array, beta: Array, throw: bool) -> Array:
    """$t^*$ as a differentiable function of `J`, `H`, `beta` (implicit function theorem,
    solving with Newton's last Cholesky factor of the Hessian, or one made here at $t^*$ when
    Newton's last pass reused an older one: XLA drops it when no derivative needs it)."""
    tp, factor = saddle.solution.value, saddle.factor
    if factor is None:
        parts = saddle.parts
        hess = _grad_hess_from(tp, parts.A, parts.P, no_grad(beta))[1]
        factor = upper_cholesky(hess)
    args = (J, H, beta, no_grad(saddle.parts))
    return implicit_value(tp, _AT_SOLUTION, args, factor, throw=throw)


def _public(solution: Solution, mode: Mode) -> Solution:
    """The solution with `value` in the public shape: `(spins,)`, or `()` in scalar mode."""
    if mode == "scalar":
        return eqx.tree_at(lambda s: s.value, solution, solution.value[0])
    return solution


# ---------------------------------------------------- what follows from t*: log Z, F, m


@jax.custom_jvp
def _parts_at(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    cache: _Parts,
) -> _Parts:
    """$A, X, P$ at `tp` (given by `cache`, computed by Newton) as differentiable functions.

    $\\dot A = -A\\dot V A$ with $\\dot V = \\operatorname{diag}(\\dot t) - \\dot J$,
    $\\dot X = \\dot A H + A\\dot H = A(\\dot H - \\dot V X)$ (no $N^3$ product),
    $\\dot P = \\dot X X^\\top + X\\dot X^\\top$: products of this same function's outputs, so
    every order of derivatives reuses the cache.
    """
    return cache


@_parts_at.defjvp
def _parts_at_jvp(primals: tuple, tangents: tuple) -> tuple[_Parts, _Parts]:
    tp, J, H, cache = primals
    tp_dot, J_dot, H_dot, _ = tangents
    A, X, P = parts = _parts_at(tp, J, H, cache)
    V_dot = jnp.diag(_expand(tp_dot, J.shape[0])) - J_dot
    A_dot = -A @ V_dot @ A  # N^3: dropped by XLA where only X and P are used
    X_dot = A @ (H_dot - V_dot @ X)  # = A_dot H + A H_dot, in N^2 D
    cross = X_dot @ X.T
    return parts, _Parts(A_dot, X_dot, cross + cross.T)


@jax.custom_jvp
def _phi_at(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
    phi: Float[Array, ""],
    cache: _Parts,
) -> Scalar:
    """$\\varphi(t^*)$ (the value Newton computed) whose first derivative skips $t^*$
    (envelope theorem) and is read off $A, X, P$:

    $$\\dot\\varphi = \\sum_{ij}\\left(\\tfrac12 A + \\tfrac\\beta4 P\\right)_{ij}\\dot J_{ij}
      + \\tfrac\\beta2\\sum X\\circ\\dot H + \\dot\\beta\\left(\\sum_i t_i
      + \\tfrac14\\sum H\\circ X\\right).$$
    """
    return phi


@_phi_at.defjvp
def _phi_at_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    tp, J, H, beta, phi, cache = primals
    _, J_dot, H_dot, beta_dot, _, _ = tangents
    # `tp` still carries its (implicit) tangent into any outer derivative of this rule.
    A, X, P = _parts_at(tp, J, H, cache)
    t = _expand(tp, J.shape[0])
    tangent = (
        jnp.sum((0.5 * A + 0.25 * beta * P) * J_dot)
        + 0.5 * beta * jnp.sum(X * H_dot)
        + beta_dot * (jnp.sum(t) + 0.25 * jnp.sum(H * X))
    )
    return _phi_at(tp, J, H, beta, phi, cache), tangent


def _log_z(saddle: _Saddle, J: Array, H: Array, beta: Array, throw: bool) -> Scalar:
    num_spins = H.shape[0]
    tp = _attach(saddle, J, H, beta, throw)
    phi = _phi_at(tp, J, H, beta, saddle.phi, saddle.parts)
    return -0.5 * num_spins * (1 + jnp.log(2 * beta)) + phi


@keyword_arguments("ea.spin.saddle_point")
def saddle_point(
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
) -> Solution:
    r"""The saddle point $t^*$ of a vector-spin model's partition function, by safeguarded Newton.

    $$t^* = \arg\min_{t:\ V \succ 0} \varphi(t), \qquad \nabla_t \varphi(t^*) = 0,
      \qquad V = \operatorname{diag}(t) - J$$

    [`ea.Newton`][energyattn.Newton] on $\varphi$ with the exact Hessian, through the
    package's solver loop: each step solves with the Cholesky factor of
    $\nabla^2\varphi$; the line search rejects trial points where $V$ is not positive
    definite (its Cholesky factorisation fails) and requires Armijo's sufficient decrease up
    to round-off; it stops when the Newton step is below the solver's tolerances. The
    default start is the uncoupled saddle point
    $t_i = (1 + \sqrt{1 + 4\beta^2\lVert h_i\rVert^2})/(4\beta)$ (plus $J_{ii}$); when that
    is not feasible it is shifted by $a R_i$, with $R_i = \sum_{j\ne i}|J_{ij}|$ each row's
    Gershgorin radius and $a = 2^{-6}, 2^{-5}, \dots, 1$ the first that makes $V \succ 0$
    ($a = 1$ always does, for any $J$). A warm start `t0` (e.g. the previous $t^*$) must
    itself be feasible.

    The returned value is differentiable with respect to `J`, `H` and `beta` by the implicit
    function theorem ([`ImplicitAdjoint`][energyattn.ImplicitAdjoint], solving with the
    Cholesky factor of the Hessian at $t^*$), to any order, in forward and reverse mode; `t0`
    gets no gradient. Under `vmap` every example stops on its own, and its result does not
    depend on the rest of the batch.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)` (only the symmetric part enters).
    - `H`: fields, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `t0`: optional warm start: shape `(spins,)`, or `()` in scalar mode.
    - `mode`: `"vector"` (default; one $t_i$ per spin) or `"scalar"` (one shared $t$).
    - `solver`: an [`ea.Newton`][energyattn.Newton] carrying the tolerances and the most
      step halvings per line search (default:
      `ea.Newton(rtol=tol, atol=tol, chord_check=True, jacobian="dense")` with
      `tol = eps ** 0.75`, 1.8e-12 in float64 and 6.4e-6 in float32). The saddle point
      needs Newton's dense Hessian at every size: a solver that takes matrix-free steps
      (`jacobian="matrix-free"`, or `"auto"` above 512 unknowns) is refused.
    - `max_steps`: the most Newton steps (default 256, the package's one bound for every
      solve; convergence typically takes 2 to 5).
    - `throw`: raise (at run time) when the solve fails (default). With `throw=False` the
      failure is reported in `result` instead: `RESULTS.infeasible` when $V$ cannot be made
      positive definite from `t0` (or a line search finds no point where it is),
      `RESULTS.nonfinite` for NaN/inf inputs, `RESULTS.max_steps_reached` when it does not
      converge.

    **Returns:**

    A [`Solution`][energyattn.Solution]: `value` is $t^*$ (shape `(spins,)`, or `()` in scalar
    mode), `result` the [`RESULTS`][energyattn.RESULTS] code, `num_steps` the Newton steps,
    `residual` the rms size of the last Newton step, and `stats` holds `"value"`
    ($\varphi(t^*)$) and `"backtracks"` (step halvings in total).

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Steepest descent: hunting for the saddle" and "Implicit layers for steepest-descent
        root-finding".
    """
    return _compiled_saddle_point(_system(J, H, beta, t0, mode, solver, max_steps, throw))


@eqx.filter_jit
def _compiled_saddle_point(system: _System) -> Solution:
    saddle = _saddle(system)
    tp = _attach(saddle, system.J, system.H, system.beta, system.throw)
    return _public(eqx.tree_at(lambda s: s.value, saddle.solution, tp), system.mode)


@keyword_arguments("ea.spin.log_partition")
def log_partition(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
) -> Scalar:
    r"""The steepest-descent (large-$D$) log-partition function of a vector-spin model.

    $$\log Z = -\frac{N}{2}\left(1 + \ln 2\beta\right) + \varphi(t^*)$$

    per unit of spin dimension ($\lim_{D\to\infty} D^{-1}\ln(Z/Z_0)$, i.e. $-\beta f$). The
    saddle point $t^*$ comes from [`saddle_point`][energyattn.spin.saddle_point]; the
    first derivatives use the envelope theorem ($\partial_t\varphi = 0$ at $t^*$, so no
    Hessian is needed), second derivatives the implicit $t^*(J, H, \beta)$.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)`, or a function `J(H)` returning them
      (input-dependent couplings, e.g. [`input_couplings`][energyattn.spin.input_couplings]);
      only the symmetric part enters.
    - `H`: fields, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `t0`, `mode`, `solver`, `max_steps`, `throw`: as in
      [`saddle_point`][energyattn.spin.saddle_point].

    **Returns:**

    $\log Z$, a 0-d array.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eq. "afe".
    """
    return _compiled_log_partition(_system(J, H, beta, t0, mode, solver, max_steps, throw))


@eqx.filter_jit
def _compiled_log_partition(system: _System) -> Scalar:
    return _log_z(_saddle(system), system.J, system.H, system.beta, system.throw)


@keyword_arguments("ea.spin.free_energy")
def free_energy(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
) -> Scalar:
    r"""The approximate free energy (AFEM) of a vector-spin model.

    $$F = -\frac{1}{\beta}\log Z = \frac{1}{\beta}\left(\frac{N}{2}(1 + \ln 2\beta)
      - \varphi(t^*)\right)$$

    **Arguments:**

    As [`log_partition`][energyattn.spin.log_partition].

    **Returns:**

    $F$, a 0-d array.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eq. "afe".
    """
    log_z = log_partition(
        J,
        H,
        beta=beta,
        t0=t0,
        mode=mode,
        solver=solver,
        max_steps=max_steps,
        throw=throw,
    )
    return -log_z / check_beta(beta).astype(log_z.dtype)


@overload
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    return_solution: Literal[False] = False,
) -> Float[Array, "spins dim"]: ...


@overload
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    return_solution: Literal[True],
) -> tuple[Float[Array, "spins dim"], Solution]: ...


@overload
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    return_solution: bool = False,
) -> Float[Array, "spins dim"] | tuple[Float[Array, "spins dim"], Solution]: ...


@keyword_arguments("ea.spin.magnetizations")
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    mode: Mode = "vector",
    solver: Newton | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
    return_solution: bool = False,
) -> Float[Array, "spins dim"] | tuple[Float[Array, "spins dim"], Solution]:
    r"""Magnetizations: the response of the spins to the fields, by `jax.grad` of $\log Z$.

    $$m_i = \langle\sigma_i\rangle = \frac{\partial \log Z}{\partial h_i}
      \;\overset{J\ \text{fixed}}{=}\; \frac{\beta}{2}\sum_j \left[V^{-1}\right]_{ij} h_j ,
      \qquad V = \operatorname{diag}(t^*) - J$$

    Always computed as `jax.grad` of [`log_partition`][energyattn.spin.log_partition] with
    respect to $H$, so input-dependent couplings (pass `J` as a function of $H$) add their
    $\partial J/\partial H$ terms automatically. $V^{-1} = \sum_k (T^{-1}J)^k T^{-1}$,
    $T = \operatorname{diag}(t^*)$, shows the zeroth-order term $\frac\beta2 h_i / t_i$ as a
    residual connection and the rest as token mixing (see
    [`neumann_series`][energyattn.spin.neumann_series]). Differentiable to any order (a
    training loss on the magnetizations is a gradient of a gradient).

    **Arguments:**

    - `J`, `H`, `beta`, `t0`, `mode`, `solver`, `max_steps`, `throw`: as in
      [`log_partition`][energyattn.spin.log_partition].
    - `return_solution`: also return the saddle point's [`Solution`][energyattn.Solution]
      (e.g. to warm-start the next call with its `value`).

    **Returns:**

    The magnetizations, shape `(spins, dim)`; with `return_solution=True` also the solution.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eqs. "spinevgeneral" and "spinev"; *Transformers Are Secretly Collectives of Spin
        Systems* (2021), eq. "magnetization".
    """
    couplings_fn = J if callable(J) else None
    system = _system(J, H, beta, t0, mode, solver, max_steps, throw)
    return _compiled_magnetizations(couplings_fn, system, bool(return_solution))


@eqx.filter_jit
def _compiled_magnetizations(
    couplings_fn: Callable[[Array], Array] | None, system: _System, return_solution: bool
) -> Float[Array, "spins dim"] | tuple[Float[Array, "spins dim"], Solution]:
    saddle = _saddle(system)
    beta = system.beta

    def log_z(H_: Float[Array, "spins dim"]) -> Scalar:
        J_ = system.J if couplings_fn is None else check_system(couplings_fn(H_), H_, beta)[0]
        # t*'s implicit dependence on everything, now including this H_.
        return _log_z(saddle, J_, H_, beta, system.throw)

    m = jax.grad(log_z)(system.H)
    if return_solution:
        return m, _public(saddle.solution, system.mode)
    return m


@keyword_arguments("ea.spin.neumann_series")
def neumann_series(
    t: Float[ArrayLike, " spins"],
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    *,
    beta: ScalarLike,
    num_terms: int,
) -> Float[Array, "terms spins dim"]:
    r"""The terms of the Neumann series of the magnetizations $\frac\beta2 V^{-1}H$.

    $$\frac{\beta}{2} V^{-1} H = \sum_{k \ge 0} \frac{\beta}{2}\left(T^{-1}J\right)^k T^{-1} H,
      \qquad T = \operatorname{diag}(t)$$

    which converges when the spectral radius of $T^{-1}J$ is below 1. Term 0,
    $\frac\beta2 h_i/t_i$, is proportional to the input (a residual connection); the higher
    terms mix the fields of different spins (attention-like token mixing). At $t = t^*$ the
    sum is the magnetizations (for couplings that do not depend on $H$).

    **Arguments:**

    - `t`: the auxiliary variables, shape `(spins,)` (e.g. `saddle_point(J, H, beta=beta).value`).
    - `J`: couplings, shape `(spins, spins)` (only the symmetric part enters).
    - `H`: fields, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `num_terms`: how many terms ($\ge 1$).

    **Returns:**

    The terms, shape `(num_terms, spins, dim)`; their sum over the first axis is the partial
    sum.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        footnote 7 (Neumann series of $V^{-1}$).
    """
    num_terms = positive_int("num_terms", num_terms)
    J, H, beta = check_system(J, H, beta, extra=(t,))
    _check_t(t, H.shape[0], "vector")
    t = jnp.asarray(t, H.dtype)

    def step(term, _):
        return (J @ term) / t[:, None], term

    first = 0.5 * beta * H / t[:, None]
    _, terms = jax.lax.scan(step, first, None, length=num_terms)
    return terms


__dir__ = public_dir(__all__)
