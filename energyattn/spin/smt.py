r"""Spin-model transformers: vector spins with asymmetric couplings, the second-order (TAP)
mean-field theory of their non-equilibrium dynamics, and its steady state, as `ea.spin.smt`.

Vector spins on a sphere of radius $R$, inputs $x$ (fields) and **asymmetric** couplings $J$
(no energy: the dynamics is out of equilibrium). Read top to bottom. **The equations:** a
spin in a field $\theta$ has the magnetization $\varphi(\theta)$
([`magnetization`][energyattn.spin.smt.magnetization], with
[`inverse_magnetization`][energyattn.spin.smt.inverse_magnetization] and
[`gamma`][energyattn.spin.smt.gamma]); the second-order (Thouless-Anderson-Palmer)
mean-field theory of the dynamics gives the field a spin feels at the next step from the
magnetizations now and one step before, $f(m_1, m_0)$
([`tap_field`][energyattn.spin.smt.tap_field]). **The solve:** the steady state
$m^* = \varphi(f(m^*, m^*))$ is a fixed point, solved by
[`ea.fixed_point`][energyattn.fixed_point] (Anderson by default) and differentiated
implicitly ([`steady_state`][energyattn.spin.smt.steady_state]); its value
([`steady_magnetizations`][energyattn.spin.smt.steady_magnetizations]) is the output of
one head of [`ea.nn.SpinTransformerAttention`][energyattn.nn.SpinTransformerAttention].

This $\varphi$ is a magnetization map, not the AFEM free-energy function
[`ea.spin.phi`][energyattn.spin.phi]; the names here say which is which. Everything acts
row-wise on `(spins, dim)` arrays; unbatched (use `jax.vmap` for batches).

??? cite "Source"

    M. Bal, *Spin-model transformers* (2023), "Non-equilibrium vector-spin models" and its
    public JAX code (the reference of `tests/test_smt.py`'s fixture).
"""

from typing import cast

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_beta,
    check_finite,
    check_positive,
    check_shape,
    concrete_value,
    error_if,
    keyword_arguments,
    positive_int,
)
from .._custom_types import ScalarLike
from .._dtypes import accumulation_dtype
from .._linalg import product
from .._namespace import public_dir
from .._solver import (
    DEFAULT_MAX_STEPS,
    RESULTS,
    AbstractAdjoint,
    AbstractIterativeSolver,
    Anderson,
    Solution,
    fixed_point,
)

__all__ = [
    "gamma",
    "inverse_magnetization",
    "magnetization",
    "steady_magnetizations",
    "steady_state",
    "tap_field",
]

# ---------------------------------------------------------------- the equations

#: Up to this many multiply-adds a product of `_tap_field` is a broadcast multiply and a sum,
#: which XLA fuses with the elementwise work around it, instead of a matrix product (a call
#: of its own): the faster of the two on one CPU core below it, the slower above (measured
#: in benchmarks/README.md, "Spin-model transformer attention").
FUSED_PRODUCT_LIMIT = 5000


def _coupling_product(a: Float[Array, "i k"], b: Float[Array, "k j"]) -> Float[Array, "i j"]:
    """`a @ b`, fused with its neighbours when small (`FUSED_PRODUCT_LIMIT`); when large, a
    matrix product whose reverse mode reads `a` transposed (`energyattn._linalg.product`)."""
    if a.shape[0] * a.shape[1] * b.shape[1] <= FUSED_PRODUCT_LIMIT:
        return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)
    return product(a, b)


def _square_norm(v: Float[Array, "... dim"]) -> Float[Array, "... 1"]:
    return jnp.sum(jnp.square(v), axis=-1, keepdims=True)


def _gamma_of_magnetization(m_sq: Float[Array, "... 1"], R2: ScalarLike) -> Float[Array, "... 1"]:
    r"""$\gamma(\varphi^{-1}(m)) = (R^2 + \lVert m\rVert^2)/(R^2 - \lVert m\rVert^2)$ from
    $\lVert m\rVert^2$: the same value as `gamma(inverse_magnetization(m))` without the field's
    norm (a second pass over the rows) and without the square root of a number that grows
    without bound as $\lVert m\rVert \to R$."""
    # An array: `m_sq` is one (NumPy's stubs type a NumPy `R2` times it as NumPy's).
    return cast(Array, (R2 + m_sq) / (R2 - m_sq))


def _inverse_magnetization(
    m: Float[Array, "... dim"], m_sq: Float[Array, "... 1"], beta: ScalarLike, R2: ScalarLike
) -> Float[Array, "... dim"]:
    r"""`inverse_magnetization` from $\lVert m\rVert^2$, unchecked (inside the solves, where `m`
    comes from `magnetization` and so lies inside the sphere)."""
    return cast(Array, 2 * R2 * m / (beta * (R2 - m_sq)))  # an array, as `m` is


def _check_temperature_radius(beta: ScalarLike, R: ScalarLike) -> tuple[Array, Array]:
    """`beta` (by the spin family's one check) and `R`, each finite and > 0."""
    return check_beta(beta), check_positive("R", R)


def _gamma(theta: Array, beta: ScalarLike, R: ScalarLike) -> Array:
    return jnp.sqrt(1 + beta**2 * _square_norm(theta)[..., 0] / R**2)


def _magnetization(theta: Array, beta: ScalarLike, R: ScalarLike) -> Array:
    """`magnetization`, unchecked (inside the solves, whose `beta` and `R` were checked)."""
    return cast(Array, beta * theta / (1 + _gamma(theta, beta, R))[..., None])


@keyword_arguments("ea.spin.smt.gamma")
def gamma(
    theta: Float[ArrayLike, "... dim"], *, beta: ScalarLike = 1.0, R: ScalarLike
) -> Float[Array, "..."]:
    r"""The function $\gamma$ of a spin's field, row-wise.

    $$\gamma(\theta) = \sqrt{1 + \beta^2\lVert\theta\rVert^2 / R^2}$$

    **Arguments:**

    - `theta`: fields, shape `(..., dim)`.
    - `beta`: inverse temperature $\beta$ (default 1).
    - `R`: the radius of the spins' sphere.

    **Returns:**

    $\gamma$ of each row, shape `(...)`.

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023), its public JAX code.
    """
    beta, R = _check_temperature_radius(beta, R)
    return _gamma(jnp.asarray(theta), beta, R)


@keyword_arguments("ea.spin.smt.magnetization")
def magnetization(
    theta: Float[ArrayLike, "... dim"], *, beta: ScalarLike = 1.0, R: ScalarLike
) -> Float[Array, "... dim"]:
    r"""The magnetization of a spin on a sphere of radius $R$ in the field $\theta$, row-wise.

    $$\varphi(\theta) = \frac{\beta\,\theta}{1 + \gamma(\theta)}, \qquad
      \lVert\varphi(\theta)\rVert < R$$

    **Arguments:**

    - `theta`: fields, shape `(..., dim)`.
    - `beta`, `R`: inverse temperature (default 1) and radius.

    **Returns:**

    The magnetizations, shape `(..., dim)`.

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023), its public JAX code.
    """
    beta, R = _check_temperature_radius(beta, R)
    return _magnetization(jnp.asarray(theta), beta, R)


@keyword_arguments("ea.spin.smt.inverse_magnetization")
def inverse_magnetization(
    m: Float[ArrayLike, "... dim"], *, beta: ScalarLike = 1.0, R: ScalarLike
) -> Float[Array, "... dim"]:
    r"""The field that gives the magnetization $m$ (the inverse of
    [`magnetization`][energyattn.spin.smt.magnetization]), row-wise, for $\lVert m\rVert < R$.

    $$\varphi^{-1}(m) = \frac{2R^2\, m}{\beta\,(R^2 - \lVert m\rVert^2)}$$

    (so $\gamma(\varphi^{-1}(m)) = (R^2 + \lVert m\rVert^2)/(R^2 - \lVert m\rVert^2)$).

    **Arguments:**

    - `m`: magnetizations, shape `(..., dim)`, each row of norm below $R$.
    - `beta`, `R`: inverse temperature (default 1) and radius.

    **Returns:**

    The fields, shape `(..., dim)`.

    **Raises:**

    No field gives a row of norm $\ge R$ (the formula would return a field whose
    magnetization is not $m$): a `ValueError` when `m` and `R` are known at trace time, a
    runtime error (`eqx.error_if`) when they are traced.

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023), its public JAX code.
    """
    beta, R = _check_temperature_radius(beta, R)
    m = jnp.asarray(m)
    m_sq, R2 = _square_norm(m), R**2
    outside = m_sq >= R2  # NaN rows pass: NaN in, NaN out
    known = concrete_value(outside)
    if known is None:
        m_sq = error_if(
            m_sq, jnp.any(outside), "m must have rows of norm < R (inside the spins' sphere)"
        )
    elif np.any(known):
        largest = float(np.sqrt(np.max(np.asarray(m_sq)[known])))
        raise ValueError(
            f"m must have rows of norm < R = {float(R):g} (inside the "
            f"spins' sphere), got a row of norm {largest:g}"
        )
    return _inverse_magnetization(m, m_sq, beta, R2)


@keyword_arguments("ea.spin.smt.tap_field")
def tap_field(
    m1: Float[ArrayLike, "spins dim"],
    m0: Float[ArrayLike, "spins dim"],
    x: Float[ArrayLike, "spins dim"],
    J: Float[ArrayLike, "spins spins"],
    *,
    beta: ScalarLike = 1.0,
    R: ScalarLike,
) -> Float[Array, "spins dim"]:
    r"""The second-order (TAP) mean-field field $f(m_1, m_0)$ of vector spins with asymmetric
    couplings: the effective field at the next step given the magnetizations $m_1$ now and
    $m_0$ one step before.

    With $g_0 = \gamma(\varphi^{-1}(m_0))$, $g_1 = \gamma(\varphi^{-1}(m_1))$ (per spin),
    $v = -\varphi^{-1}(m_1) + x + J m_0$ and $K = J \circ J$:

    $$\begin{aligned}
    \Delta_i ={}& \frac{\beta^2(1 + 3g_{1i})}{R^4 g_{1i}^3}\Big[(m_{1i}\cdot v_i)^2
      + \sum_j K_{ij}\frac{\lVert m_{1i}\rVert^2}{1 + g_{0i}}
      - \sum_j K_{ij}\frac{(m_{1i}\cdot m_{0j})^2}{R^2 g_{0i}}\Big] m_{1i} \\
    &- \frac{\beta^2}{R^2(g_{1i}^2 + g_{1i})}\Big[\lVert v_i\rVert^2
      + \sum_j K_{ij}(R^2 - \lVert m_{0j}\rVert^2)\Big] m_{1i} \\
    &- \frac{2\beta^2}{R^2(g_{1i}^2 + g_{1i})}\Big[(v_i\cdot m_{1i})\, v_i
      + \sum_j K_{ij}\frac{m_{1i}}{1 + g_{0i}}
      - \sum_j K_{ij}\frac{(m_{1i}\cdot m_{0j})\, m_{0j}}{R^2 g_{0i}}\Big], \\
    f_i ={}& x_i + (J m_0)_i + \frac{1 + g_{1i}}{2\beta}\left(\Delta_i
      + \frac{m_{1i}\cdot\Delta_i}{R^2 g_{1i}/(1 + g_{1i}) - \lVert m_{1i}\rVert^2}\,
      m_{1i}\right).
    \end{aligned}$$

    **Indexing.** Inside the sums over $j$, $g_0$ carries the index $i$ of the *updated*
    spin, not $j$: this is what the reference code computes (and what the fixture of
    `tests/test_smt.py` checks), kept here as is. No derivation in this package decides the
    other indexing; it is not offered.

    The sums are computed as matrix products ($K$, $K \circ (m_1 m_0^\top)$,
    $K(R^2 - \lVert m_0\rVert^2)$), in $O(N^2 D)$, with
    $\sum_j K_{ij}(m_{1i}\cdot m_{0j})^2 = m_{1i}\cdot\sum_j K_{ij}(m_{1i}\cdot m_{0j})\,m_{0j}$
    read off the last sum; $K(R^2 - \lVert m_0\rVert^2)$ is a matrix-vector product, and a
    small product of the others (at most `FUSED_PRODUCT_LIMIT` multiply-adds) a broadcast
    multiply and a sum that XLA fuses with its neighbours, so an $N \times N \times D$
    intermediate appears only at small sizes. $g = \gamma(\varphi^{-1}(m))$ is read off
    $\lVert m\rVert^2$ in closed form, $(R^2 + \lVert m\rVert^2)/(R^2 - \lVert m\rVert^2)$.

    **Arguments:**

    - `m1`, `m0`: magnetizations now and one step before, shape `(spins, dim)`, rows of
      norm below $R$.
    - `x`: inputs (external fields), shape `(spins, dim)`.
    - `J`: couplings, shape `(spins, spins)` (any; asymmetric in the model).
    - `beta`, `R`: inverse temperature (default 1) and radius.

    **Returns:**

    The fields $f(m_1, m_0)$, shape `(spins, dim)`.

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023), its public JAX code.
    """
    beta, R = _check_temperature_radius(beta, R)
    m1, m0, x, J = (jnp.asarray(a) for a in (m1, m0, x, J))
    return _tap_field(m1, m0, x, J, jnp.square(J), beta=beta, R=R)


def _tap_field(
    m1: Float[Array, "spins dim"],
    m0: Float[Array, "spins dim"],
    x: Float[Array, "spins dim"],
    J: Float[Array, "spins spins"],
    K: Float[Array, "spins spins"],
    *,
    beta: ScalarLike,
    R: ScalarLike,
) -> Float[Array, "spins dim"]:
    r"""[`tap_field`][energyattn.spin.smt.tap_field] given $K = J \circ J$, which a
    fixed-point solve computes once instead of at every step. When `m1` and `m0` are the
    same array (the steady state's map), its field and $\gamma$ are computed once."""
    R2 = R**2
    m1_sq = _square_norm(m1)
    field1 = _inverse_magnetization(m1, m1_sq, beta, R2)
    g1 = _gamma_of_magnetization(m1_sq, R2)
    g0 = g1 if m0 is m1 else _gamma_of_magnetization(_square_norm(m0), R2)
    coupled = x + _coupling_product(J, m0)
    v = coupled - field1
    row_k = jnp.sum(K, axis=-1, keepdims=True)
    overlap = _coupling_product(m1, m0.T)  # (m1_i . m0_j)
    m1_v = jnp.sum(m1 * v, axis=-1, keepdims=True)
    # sum_j K_ij (m1_i . m0_j)^2 = m1_i . sum_j K_ij (m1_i . m0_j) m0_j: the second sum is
    # needed anyway, so the first costs no (spins x spins) pass of its own.
    weighted = _coupling_product(K * overlap, m0)
    first = (
        jnp.square(m1_v)
        + row_k * m1_sq / (1 + g0)
        - jnp.sum(m1 * weighted, axis=-1, keepdims=True) / (R2 * g0)
    )
    # A matrix-vector product: as a dot at every size (as a broadcast multiply and a sum, the
    # form of `_coupling_product` below its limit, XLA's CPU backend splits the sum into a
    # separate pass over an (N, N) intermediate, measurably slower at both benchmark sizes).
    second = _square_norm(v) + (K @ (R2 - _square_norm(m0)[:, 0]))[:, None]
    third = m1_v * v + row_k * m1 / (1 + g0) - weighted / (R2 * g0)
    damping = beta**2 / (R2 * (g1**2 + g1))
    delta = (
        beta**2 * (1 + 3 * g1) / (R2**2 * g1**3) * first * m1
        - damping * second * m1
        - 2 * damping * third
    )
    radial = jnp.sum(m1 * delta, axis=-1, keepdims=True) / (R2 * g1 / (1 + g1) - m1_sq)
    return coupled + (1 + g1) / (2 * beta) * (delta + radial * m1)


# ---------------------------------------------------------------- the steady state

#: The module's default solver: Anderson with the reference's history (5) and mixing (1).
_DEFAULT_SOLVER = Anderson(rtol=1e-5, atol=1e-6, history=5)
#: Iterations of the first-order mean-field map that place the start (`_mean_field_start`).
_START_STEPS = 5


def _mean_field_start(
    x: Float[Array, "spins dim"],
    J: Float[Array, "spins spins"],
    m0: Float[Array, "spins dim"],
    *,
    beta: Array,
    R: Array,
    steps: int,
) -> Float[Array, "spins dim"]:
    r"""`steps` iterations of the first-order (naive) mean-field map
    $m \leftarrow \varphi(x + J m)$ from $m_0$: the TAP map without its second-order terms,
    one matrix product per iteration (the TAP map takes three and their elementwise work).
    Every iterate is inside the sphere ($\lVert\varphi\rVert < R$), wherever the map
    converges or not."""
    m = m0
    for _ in range(steps):
        m = _magnetization(x + _coupling_product(J, m), beta, R)
    return m


def _tap_map(m: Array, args: tuple) -> Array:
    r"""$\varphi(f(m, m))$; `args` carries $K = J \circ J$, computed once per solve."""
    x, J, K, beta, R = args
    return _magnetization(_tap_field(m, m, x, J, K, beta=beta, R=R), beta, R)


@keyword_arguments("ea.spin.smt.steady_state")
def steady_state(
    x: Float[ArrayLike, "spins dim"],
    J: Float[ArrayLike, "spins spins"],
    *,
    beta: ScalarLike = 1.0,
    R: ScalarLike,
    m0: Float[ArrayLike, "spins dim"] | None = None,
    start_steps: int = _START_STEPS,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
) -> Solution:
    r"""The steady-state magnetizations of vector spins with asymmetric couplings, in the
    second-order (TAP) mean-field theory of their non-equilibrium dynamics.

    $$m^* = \varphi\big(f(m^*, m^*;\, x, J, \beta, R)\big)$$

    with $\varphi$ = [`magnetization`][energyattn.spin.smt.magnetization] and $f$ =
    [`tap_field`][energyattn.spin.smt.tap_field], solved by
    [`ea.fixed_point`][energyattn.fixed_point] and differentiated implicitly
    ([`ImplicitAdjoint`][energyattn.ImplicitAdjoint] by default: gradients with respect to
    `x`, `J`, `beta` and `R`, in forward and reverse mode, to any order; the start gets none).
    There is no energy behind this fixed point (the couplings are asymmetric), so no
    minimiser applies; see the theory page.

    **The start.** The solve starts near the first-order (naive) mean-field solution, after
    `start_steps` iterations of $m \leftarrow \varphi(x + J m)$ from $m_0$: the TAP map
    without its second-order terms, one matrix product per iteration where the TAP map takes
    three. The second-order terms are a small correction, so the TAP iteration then has less
    far to go: at the layer's tolerances, from 7 evaluations of the TAP map to 4-5 at the
    benchmark's sizes, 1-3 fewer wherever it converges (`benchmarks/README.md`). The answer
    is the same fixed point. `start_steps=1` is the reference's start, $\varphi(x + J m_0)$.

    **Arguments:**

    - `x`: inputs (external fields), shape `(spins, dim)`.
    - `J`: couplings, shape `(spins, spins)`, e.g. `softmax(q k^T)` per row.
    - `beta`: inverse temperature $\beta > 0$ (default 1).
    - `R`: radius of the spins' sphere, $R > 0$.
    - `m0`: the magnetizations the start is computed from (default `ones / sqrt(dim)`, as
      the reference module).
    - `start_steps`: iterations of the first-order map that place the start (default 5,
      at least 1; each is a step of the compiled program, so keep it to a few).
    - `solver`: a fixed-point solver carrying the tolerances (default
      `ea.Anderson(rtol=1e-5, atol=1e-6, history=5)`; `ea.Picard(...)` or `ea.Newton()`
      also work).
    - `adjoint`: how derivatives pass through $m^*$ (default implicit).
    - `max_steps`: the most evaluations of the map (default 256, the package's one bound for
      every solve; the default solver takes 4 to 10). With `ea.UnrolledAdjoint()` the loop
      stops when the solve does too (reverse mode stores a state per two steps, about
      `2 sqrt(max_steps / 2)` beyond 64 steps).
    - `throw`: raise (at run time) unless the solve succeeded (default). With `False` the
      failure is in `result`: `RESULTS.max_steps_reached`, `RESULTS.diverged`,
      `RESULTS.nonfinite` (a magnetization reached the sphere, $\lVert m_i\rVert \to R$,
      where $\varphi^{-1}$ is infinite), or `RESULTS.infeasible` (a returned
      magnetization is not inside the sphere).

    **Returns:**

    A [`Solution`][energyattn.Solution] whose `value` is $m^*$, shape `(spins, dim)`.

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023): the steady state of the mean-field
        dynamics as the output of a transformer module.
    """
    check_shape("x", x, "spins dim")
    num_spins, dim = np.shape(x)
    check_shape("J", J, "spins spins", spins=num_spins)
    x = jnp.asarray(x)
    dtype = accumulation_dtype(x)
    x, J = x.astype(dtype), jnp.asarray(J).astype(dtype)
    beta, R = _check_temperature_radius(beta, R)
    beta, R = beta.astype(dtype), R.astype(dtype)
    if m0 is None:
        m0 = jnp.full((num_spins, dim), 1 / jnp.sqrt(dim), dtype)
    else:
        check_shape("m0", m0, "spins dim", spins=num_spins, dim=dim)
        m0 = jnp.asarray(m0).astype(dtype)
    max_steps = positive_int("max_steps", max_steps)
    start_steps = positive_int("start_steps", start_steps)
    if throw:
        # Name the input that holds NaN or inf (with `throw=False` the result code reports
        # it, per example under vmap).
        x, J = check_finite("x", x), check_finite("J (the couplings)", J)
    if num_spins == 0:
        # No spins: the empty steady state, at once (the solvers need at least one number).
        return Solution(
            value=x,
            result=RESULTS.where(jnp.bool_(True), RESULTS.successful, RESULTS.successful),  # type: ignore[arg-type]
            num_steps=jnp.zeros((), jnp.int32),
            residual=jnp.zeros((), dtype),
        )
    return _compiled_steady_state(
        x, J, beta, R, m0, start_steps, solver, adjoint, max_steps, bool(throw)
    )


@eqx.filter_jit
def _compiled_steady_state(
    x: Array,
    J: Array,
    beta: Array,
    R: Array,
    m0: Array,
    start_steps: int,
    solver: AbstractIterativeSolver | None,
    adjoint: AbstractAdjoint | None,
    max_steps: int,
    throw: bool,
) -> Solution:
    """`steady_state` after its checks, as one compiled program (the start, the solve and
    the checks of its result; eagerly, each operation ran on its own)."""
    start = _mean_field_start(x, J, m0, beta=beta, R=R, steps=start_steps)
    solution = fixed_point(
        _tap_map,
        start,
        (x, J, jnp.square(J), beta, R),
        solver=_DEFAULT_SOLVER if solver is None else solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=False,
    )
    norms = jnp.linalg.norm(solution.value, axis=-1)
    outside = (solution.result == RESULTS.successful) & ~jnp.all(norms < R)
    # mypy reads eqx.Enumeration items as str (equinox types them for pyright).
    result = RESULTS.where(outside, RESULTS.infeasible, solution.result)  # type: ignore[arg-type]
    solution = eqx.tree_at(lambda s: s.result, solution, result)
    if throw:
        value = solution.result.error_if(solution.value, solution.result != RESULTS.successful)
        solution = eqx.tree_at(lambda s: s.value, solution, value)
    return solution


@keyword_arguments("ea.spin.smt.steady_magnetizations")
def steady_magnetizations(
    x: Float[ArrayLike, "spins dim"],
    J: Float[ArrayLike, "spins spins"],
    *,
    beta: ScalarLike = 1.0,
    R: ScalarLike,
    m0: Float[ArrayLike, "spins dim"] | None = None,
    start_steps: int = _START_STEPS,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    throw: bool = True,
) -> Float[Array, "spins dim"]:
    r"""The steady-state magnetizations $m^*$ of
    [`steady_state`][energyattn.spin.smt.steady_state]: the output of one head of a
    spin-model transformer module.

    $$m^* = \varphi\big(f(m^*, m^*;\, x, J, \beta, R)\big)$$

    **Arguments:**

    As [`steady_state`][energyattn.spin.smt.steady_state].

    **Returns:**

    $m^*$, shape `(spins, dim)`.

    **Example:**

    ```python
    kx, kq, kk = jr.split(jr.PRNGKey(0), 3)
    R = (16 / 2 - 1) ** 0.5
    x = jr.normal(kx, (8, 16))
    x = R * x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # inputs of norm R
    q, k = jr.normal(kq, (8, 16)), jr.normal(kk, (8, 16))
    J = jax.nn.softmax(q @ k.T / 4, axis=-1)  # asymmetric couplings
    magnetizations = jax.jit(ea.spin.smt.steady_magnetizations, static_argnames="R")
    m = magnetizations(x, J, R=R)  # compiled once: the solve and its checks in one program
    grad_J = jax.jit(jax.grad(lambda J: jnp.sum(magnetizations(x, J, R=R) ** 2)))(J)
    ```

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023).
    """
    return steady_state(
        x,
        J,
        beta=beta,
        R=R,
        m0=m0,
        start_steps=start_steps,
        solver=solver,
        adjoint=adjoint,
        max_steps=max_steps,
        throw=throw,
    ).value


__dir__ = public_dir(__all__)
