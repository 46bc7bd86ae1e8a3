r"""The steady state of a spin-model transformer: $m^* = \varphi(f(m^*, m^*))$, implicitly
differentiated through the solver engine."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_positive, check_shape, positive_int
from .._custom_types import ScalarLike
from .._energy import coupling_product, smt_phi, tap_field
from .._solver import (
    RESULTS,
    AbstractAdjoint,
    AbstractIterativeSolver,
    Anderson,
    Solution,
    fixed_point,
)

#: The module's default solver: Anderson with the reference's history (5) and mixing (1).
DEFAULT_SOLVER = Anderson(rtol=1e-5, atol=1e-6, history=5)
#: Iterations of the first-order mean-field map that place the start (`mean_field_start`).
START_STEPS = 5


def mean_field_start(
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
        m = smt_phi(x + coupling_product(J, m), beta=beta, R=R)
    return m


def _tap_map(m: Array, args: tuple) -> Array:
    r"""$\varphi(f(m, m))$; `args` carries $K = J \circ J$, computed once per solve."""
    x, J, K, beta, R = args
    return smt_phi(tap_field(m, m, x, J, K, beta=beta, R=R), beta=beta, R=R)


def smt_steady_state(
    x: Float[ArrayLike, "spins dim"],
    J: Float[ArrayLike, "spins spins"],
    *,
    beta: ScalarLike = 1.0,
    R: ScalarLike,
    m0: Float[ArrayLike, "spins dim"] | None = None,
    start_steps: int = START_STEPS,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = 100,
    throw: bool = True,
) -> Solution:
    r"""The steady-state magnetizations of vector spins with asymmetric couplings, in the
    second-order (TAP) mean-field theory of their non-equilibrium dynamics.

    $$m^* = \varphi\big(f(m^*, m^*;\, x, J, \beta, R)\big)$$

    with $\varphi$ = [`smt_phi`][energyattn.spin.smt_phi] and $f$ =
    [`smt_tap_update`][energyattn.spin.smt_tap_update], solved by
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
    - `max_steps`: the most evaluations of the map (default 100).
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
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x, J = x.astype(dtype), jnp.asarray(J).astype(dtype)
    beta = check_positive("beta", beta).astype(dtype)
    R = check_positive("R", R).astype(dtype)
    if m0 is None:
        m0 = jnp.full((num_spins, dim), 1 / jnp.sqrt(dim), dtype)
    else:
        check_shape("m0", m0, "spins dim", spins=num_spins, dim=dim)
        m0 = jnp.asarray(m0).astype(dtype)
    max_steps = positive_int("max_steps", max_steps)
    start_steps = positive_int("start_steps", start_steps)
    start = mean_field_start(x, J, m0, beta=beta, R=R, steps=start_steps)
    solution = fixed_point(
        _tap_map,
        start,
        (x, J, jnp.square(J), beta, R),
        solver=DEFAULT_SOLVER if solver is None else solver,
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


def smt_magnetizations(
    x: Float[ArrayLike, "spins dim"],
    J: Float[ArrayLike, "spins spins"],
    *,
    beta: ScalarLike = 1.0,
    R: ScalarLike,
    m0: Float[ArrayLike, "spins dim"] | None = None,
    start_steps: int = START_STEPS,
    solver: AbstractIterativeSolver | None = None,
    adjoint: AbstractAdjoint | None = None,
    max_steps: int = 100,
    throw: bool = True,
) -> Float[Array, "spins dim"]:
    r"""The steady-state magnetizations $m^*$ of
    [`smt_steady_state`][energyattn.spin.smt_steady_state]: the output of one head of a
    spin-model transformer module.

    $$m^* = \varphi\big(f(m^*, m^*;\, x, J, \beta, R)\big)$$

    **Arguments:**

    As [`smt_steady_state`][energyattn.spin.smt_steady_state].

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
    magnetizations = jax.jit(ea.spin.smt_magnetizations, static_argnames="R")
    m = magnetizations(x, J, R=R)  # compiled once: the solve and its checks in one program
    grad_J = jax.jit(jax.grad(lambda J: jnp.sum(magnetizations(x, J, R=R) ** 2)))(J)
    ```

    ??? cite "Source"

        M. Bal, *Spin-model transformers* (2023).
    """
    return smt_steady_state(
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
