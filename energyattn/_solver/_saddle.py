r"""The vector-spin saddle point $t^*$, differentiated implicitly, and what follows from it.

$t^* = \arg\min_t \varphi(t; J, H, \beta)$ is found by `safeguarded_newton` (a
`lax.while_loop`, which reverse-mode autodiff cannot enter). Its derivatives come from the
implicit function theorem instead: $\nabla_t\varphi(t^*(\theta), \theta) = 0$ for all
$\theta = (J, H, \beta)$, so

$$\dot t^* = -\left(\nabla_t^2\varphi\right)^{-1} \,\partial_\theta \nabla_t\varphi\;\dot\theta ,$$

a `jax.custom_jvp` whose tangent solves with the Cholesky factor of the exact analytic
Hessian. Forward mode is the rule itself; reverse mode transposes it (it is linear in
$\dot\theta$); and because the rule is written in differentiable JAX operations and calls
itself for the primal, grad-of-grad and forward-over-reverse work to any order.

$\log Z = -\frac N2 (1 + \ln 2\beta) + \varphi(t^*)$ uses a second `custom_jvp`, the envelope
theorem: at the stationary point $\frac{d}{d\theta}\varphi(t^*(\theta), \theta) =
\partial_\theta\varphi$, so a first derivative of $\log Z$ (the magnetizations) needs no
Hessian solve at all. Differentiating that rule once more goes through $t^*$'s implicit rule,
which gives the exact second derivatives training needs.
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_finite, check_positive, check_shape, concrete_value, positive_int
from .._custom_types import Scalar, ScalarLike
from .._energy._spin import (
    Mode,
    check_mode,
    check_system,
    check_t,
    domain_value,
    factor,
    grad_hess,
    grad_hess_tp,
    phi_terms,
    phi_tp,
)
from ._newton import safeguarded_newton, spd_solve
from ._solution import RESULTS, Solution, finish

Couplings = Float[ArrayLike, "spins spins"] | Callable[[Float[Array, "spins dim"]], Array]


class _Options(NamedTuple):
    mode: Mode
    tol: float | None
    max_steps: int
    max_backtracks: int
    throw: bool


def _options(mode: Any, tol: Any, max_steps: Any, max_backtracks: Any, throw: Any) -> _Options:
    if tol is not None:
        value = concrete_value(tol)
        if value is None:
            raise ValueError("tol must be a Python float (it is fixed at trace time)")
        tol = float(check_positive("tol", value))
    return _Options(
        check_mode(mode),
        tol,
        positive_int("max_steps", max_steps, minimum=0),
        positive_int("max_backtracks", max_backtracks, minimum=0),
        bool(throw),
    )


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


def _solve(
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
    tp0: Float[Array, " n"] | None,
    options: _Options,
) -> Solution:
    """Run the Newton loop (no derivatives flow through it; see `_implicit`)."""
    finite = jnp.all(jnp.isfinite(J)) & jnp.all(jnp.isfinite(H)) & jnp.isfinite(beta)

    def value_fn(tp):
        fac = factor(tp, J, H)
        f, scale = phi_terms(tp, fac, beta)
        return domain_value(f, fac.ok, finite & jnp.all(jnp.isfinite(tp))), scale, fac

    def derivatives_fn(tp, fac):
        return grad_hess(tp, fac, H, beta)

    if tp0 is None:
        tp0, fallback = _starts(J, H, beta, options.mode == "scalar")
    else:
        fallback = None
    return safeguarded_newton(
        value_fn,
        derivatives_fn,
        tp0,
        fallback=fallback,
        tol=options.tol,
        max_steps=options.max_steps,
        max_backtracks=options.max_backtracks,
    )


@jax.custom_jvp
def _implicit(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> Float[Array, " n"]:
    """`tp`, a root of $\\nabla_t\\varphi$, as a differentiable function of $J, H, \\beta$."""
    return tp


@_implicit.defjvp
def _implicit_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    tp_raw, J, H, beta = primals
    _, J_dot, H_dot, beta_dot = tangents
    # Calling the rule's own function for the primal makes the tangent below differentiable
    # again (its dependence on t* goes through this same rule): grad-of-grad works.
    tp = _implicit(tp_raw, J, H, beta)

    def grad_and_hess(J, H, beta):
        return grad_hess_tp(tp, J, H, beta)[:2]

    (_, hess), (grad_dot, _) = jax.jvp(grad_and_hess, (J, H, beta), (J_dot, H_dot, beta_dot))
    return tp, -spd_solve(hess, grad_dot)


@jax.custom_jvp
def _phi_at_saddle(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> Scalar:
    """$\\varphi(t^*)$ whose first derivative skips $t^*$ (envelope theorem)."""
    return phi_tp(tp, J, H, beta)


@_phi_at_saddle.defjvp
def _phi_at_saddle_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
    tp, J, H, beta = primals
    _, J_dot, H_dot, beta_dot = tangents
    # d/dθ φ(t*(θ), θ) = ∂_θ φ + ∂_t φ · dt*/dθ, and ∂_t φ = 0 at t*. `tp` still carries its
    # tangent into any outer differentiation of this rule, through `_implicit`.
    return jax.jvp(
        lambda J, H, beta: phi_tp(tp, J, H, beta), (J, H, beta), (J_dot, H_dot, beta_dot)
    )


def _system(
    J: Any, H: Any, beta: Any, t0: Any, options: _Options
) -> tuple[Array, Array, Array, Array | None]:
    """Checked, symmetrised `J` (evaluated at `H` if callable), `H`, `beta` and `tp0`."""
    check_shape("H", H, "spins dim")
    if callable(J):
        J = J(jnp.asarray(H, jnp.promote_types(jnp.result_type(H), jnp.float32)))
    # A warm start does not decide the dtype (a float64 guess must not promote a float32 solve).
    J, H, beta = check_system(J, H, beta)
    tp0 = None
    if t0 is not None:
        check_t(t0, H.shape[0], options.mode, "t0")
        tp0 = jax.lax.stop_gradient(jnp.asarray(t0).astype(H.dtype).reshape(-1))
    return J, H, beta, tp0


def _saddle(
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
    tp0: Float[Array, " n"] | None,
    options: _Options,
) -> Solution:
    """The checked solve; `value` is the internal `tp`, differentiable through `_implicit`."""
    if options.throw:
        J = check_finite("J", J)
        H = check_finite("H", H)
        beta = check_finite("beta", beta)
        if tp0 is not None:
            tp0 = check_finite("t0", tp0)
    stop = jax.lax.stop_gradient
    raw = _solve(stop(J), stop(H), stop(beta), tp0, options)
    if options.throw and tp0 is not None:
        # No decrement exists (residual = inf) only when the start itself is infeasible.
        bad_start = (raw.result == RESULTS.infeasible) & jnp.isinf(raw.residual)
        raw = eqx.tree_at(
            lambda s: s.value,
            raw,
            eqx.error_if(
                raw.value,
                bad_start,
                "saddle_point: V = diag(t0) - J is not positive definite at the given t0, "
                "so Newton cannot start there; start further right (larger t0) or pass "
                "t0=None for the feasible default start",
            ),
        )
    raw = finish(raw, options.throw)
    return eqx.tree_at(lambda s: s.value, raw, _implicit(raw.value, J, H, beta))


def _public(solution: Solution, mode: Mode) -> Solution:
    """The solution with `value` in the public shape: `(spins,)`, or `()` in scalar mode."""
    if mode == "scalar":
        return eqx.tree_at(lambda s: s.value, solution, solution.value[0])
    return solution


def saddle_point(
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
    throw: bool = True,
) -> Solution:
    r"""The saddle point $t^*$ of a vector-spin model's partition function, by safeguarded Newton.

    $$t^* = \arg\min_{t:\ V \succ 0} \varphi(t), \qquad \nabla_t \varphi(t^*) = 0,
      \qquad V = \operatorname{diag}(t) - J$$

    Damped Newton with the exact Hessian in a `lax.while_loop`: each step solves with the
    Cholesky factor of $\nabla^2\varphi$; a backtracking line search rejects trial points
    where $V$ is not positive definite (its Cholesky factorisation fails) and requires
    Armijo's sufficient decrease up to round-off; it stops on the Newton decrement. The
    default start is the uncoupled saddle point
    $t_i = (1 + \sqrt{1 + 4\beta^2\lVert h_i\rVert^2})/(4\beta)$ (plus $J_{ii}$); when that
    is not feasible it is shifted by $a R_i$, with $R_i = \sum_{j\ne i}|J_{ij}|$ each row's
    Gershgorin radius and $a = 2^{-6}, 2^{-5}, \dots, 1$ the first that makes $V \succ 0$
    ($a = 1$ always does, for any $J$). A warm start `t0` (e.g. the previous $t^*$) must
    itself be feasible.

    The returned value is differentiable with respect to `J`, `H` and `beta` by the implicit
    function theorem (a `custom_jvp` that solves with the Hessian's Cholesky factor), to
    any order, in forward and reverse mode; `t0` gets no gradient. Under `vmap` every
    example stops on its own, and its result does not depend on the rest of the batch.

    **Arguments:**

    - `J`: couplings, shape `(spins, spins)` (only the symmetric part enters).
    - `H`: fields, shape `(spins, dim)`.
    - `beta`: inverse temperature $\beta > 0$.
    - `t0`: optional warm start: shape `(spins,)`, or `()` in scalar mode.
    - `mode`: `"vector"` (default; one $t_i$ per spin) or `"scalar"` (one shared $t$).
    - `tol`: stop when the Newton decrement is below `tol` (default: a little above
      round-off for the dtype, `eps**0.85 * sqrt(n)`).
    - `max_steps`: the most Newton steps (default 50; convergence typically takes 4 to 8).
    - `max_backtracks`: the most step halvings per line search (default 40).
    - `throw`: raise (at run time) when the solve fails (default). With `throw=False` the
      failure is reported in `result` instead: `RESULTS.infeasible` when $V$ cannot be made
      positive definite from `t0` (or a line search finds no point where it is),
      `RESULTS.nonfinite` for NaN/inf inputs, `RESULTS.max_steps_reached` when it does not
      converge.

    **Returns:**

    A [`Solution`][energyattn.Solution]: `value` is $t^*$ (shape `(spins,)`, or `()` in scalar
    mode), `result` the [`RESULTS`][energyattn.RESULTS] code, `num_steps` the Newton steps,
    `residual` the final Newton decrement, and `stats` holds `"value"` ($\varphi(t^*)$) and
    `"backtracks"` (step halvings in total).

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        "Steepest descent: hunting for the saddle" and "Implicit layers for steepest-descent
        root-finding".
    """
    options = _options(mode, tol, max_steps, max_backtracks, throw)
    J, H, beta, tp0 = _system(J, H, beta, t0, options)
    return _public(_saddle(J, H, beta, tp0, options), options.mode)


def _log_z(
    tp: Float[Array, " n"],
    J: Float[Array, "spins spins"],
    H: Float[Array, "spins dim"],
    beta: Float[Array, ""],
) -> Scalar:
    num_spins = H.shape[0]
    return -0.5 * num_spins * (1 + jnp.log(2 * beta)) + _phi_at_saddle(tp, J, H, beta)


def log_partition(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
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
    - `t0`, `mode`, `tol`, `max_steps`, `max_backtracks`, `throw`: as in
      [`saddle_point`][energyattn.spin.saddle_point].

    **Returns:**

    $\log Z$, a 0-d array.

    ??? cite "Source"

        M. Bal, *Transformers from Spin Models: Approximate Free Energy Minimization* (2021),
        eq. "afe".
    """
    options = _options(mode, tol, max_steps, max_backtracks, throw)
    J, H, beta, tp0 = _system(J, H, beta, t0, options)
    return _log_z(_saddle(J, H, beta, tp0, options).value, J, H, beta)


def free_energy(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
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
        beta,
        t0,
        mode=mode,
        tol=tol,
        max_steps=max_steps,
        max_backtracks=max_backtracks,
        throw=throw,
    )
    return -log_z / check_positive("beta", beta).astype(log_z.dtype)


@overload
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
    throw: bool = True,
    return_solution: Literal[False] = False,
) -> Float[Array, "spins dim"]: ...


@overload
def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
    throw: bool = True,
    return_solution: Literal[True],
) -> tuple[Float[Array, "spins dim"], Solution]: ...


def magnetizations(
    J: Couplings,
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    t0: Float[ArrayLike, " spins"] | ScalarLike | None = None,
    *,
    mode: Mode = "vector",
    tol: float | None = None,
    max_steps: int = 50,
    max_backtracks: int = 40,
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

    - `J`, `H`, `beta`, `t0`, `mode`, `tol`, `max_steps`, `max_backtracks`, `throw`: as in
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
    options = _options(mode, tol, max_steps, max_backtracks, throw)
    couplings_fn = J if callable(J) else None
    J, H, beta, tp0 = _system(J, H, beta, t0, options)
    solution = _saddle(J, H, beta, tp0, options)
    tp_raw = jax.lax.stop_gradient(solution.value)

    def log_z(H_: Float[Array, "spins dim"]) -> Scalar:
        J_ = J if couplings_fn is None else check_system(couplings_fn(H_), H_, beta)[0]
        # Re-attach t*'s implicit dependence on everything, now including this H_.
        return _log_z(_implicit(tp_raw, J_, H_, beta), J_, H_, beta)

    m = jax.grad(log_z)(H)
    if return_solution:
        return m, _public(solution, options.mode)
    return m


def neumann_series(
    t: Float[ArrayLike, " spins"],
    J: Float[ArrayLike, "spins spins"],
    H: Float[ArrayLike, "spins dim"],
    beta: ScalarLike,
    *,
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

    - `t`: the auxiliary variables, shape `(spins,)` (e.g. `saddle_point(J, H, beta).value`).
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
    check_t(t, H.shape[0], "vector")
    t = jnp.asarray(t, H.dtype)

    def step(term, _):
        return (J @ term) / t[:, None], term

    first = 0.5 * beta * H / t[:, None]
    _, terms = jax.lax.scan(step, first, None, length=num_terms)
    return terms
