r"""What the spin-system figures draw: `ea.spin`'s own $\varphi$, saddle point and free
energy evaluated on grids of $t$ (no second copy of the model's numerics), compiled once per
shape."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..spin.afem import check_system, free_energy, phi, saddle_point


def spin_system(J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
    """Checked (symmetrised) couplings, fields and inverse temperature, as `ea.spin` takes."""
    return check_system(J, H, beta)


@jax.jit
def _scalar_curves(ts: Any, J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
    def f(t: Any) -> Any:
        return phi(t, J, H, beta=beta, mode="scalar")

    def one(t: Any) -> tuple[Any, Any, Any]:
        return f(t), jax.grad(f)(t), jax.grad(jax.grad(f))(t)

    return jax.vmap(one)(ts)


def phi_on_scalar_grid(J: Any, H: Any, beta: Any, ts: Any) -> dict[str, np.ndarray]:
    r"""Scalar-mode $\varphi(t)$, $\varphi'(t)$ and $\varphi''(t)$ at each $t$ of `ts` (NumPy
    arrays under `"phi"`, `"dphi"`, `"d2phi"`), NaN where $tI - J$ is not positive definite."""
    ts = jnp.asarray(np.asarray(ts), H.dtype)
    values, first, second = _scalar_curves(ts, J, H, beta)
    out = {"phi": np.asarray(values), "dphi": np.asarray(first), "d2phi": np.asarray(second)}
    domain = np.isfinite(out["phi"])
    return {name: np.where(domain, v, np.nan) for name, v in out.items()}


@jax.jit
def _scalar_saddle(J: Any, H: Any, beta: Any) -> tuple[Any, Any, Any]:
    solution = saddle_point(J, H, beta=beta, mode="scalar")
    # Warm-started at t*, the free energy's own solve stops at once.
    energy = free_energy(J, H, beta=beta, t0=jax.lax.stop_gradient(solution.value), mode="scalar")
    return solution.value, solution.stats["value"], energy


def scalar_saddle(J: Any, H: Any, beta: Any) -> tuple[float, float, float]:
    r"""The scalar-mode saddle point $t^*$, $\varphi(t^*)$ and the free energy $F$."""
    t_star, phi_star, energy = _scalar_saddle(J, H, jnp.asarray(beta, H.dtype))
    return float(t_star), float(phi_star), float(energy)


@jax.jit
def _vector_saddle(J: Any, H: Any, beta: Any) -> Any:
    return saddle_point(J, H, beta=beta).value


def vector_saddle(J: Any, H: Any, beta: Any) -> np.ndarray:
    r"""The vector-mode saddle point $t^*$, one $t_i$ per spin."""
    return np.asarray(_vector_saddle(J, H, beta), np.float64)


@jax.jit
def _landscape(ts: Any, J: Any, H: Any, beta: Any) -> Any:
    return jax.vmap(lambda t: phi(t, J, H, beta=beta))(ts)


def phi_on_vector_grid(J: Any, H: Any, beta: Any, ts: Any) -> np.ndarray:
    r"""Vector-mode $\varphi(t)$ at each row of `ts` (shape `(points, spins)`), NaN off the
    domain."""
    values = np.asarray(_landscape(jnp.asarray(np.asarray(ts), H.dtype), J, H, beta), np.float64)
    return np.where(np.isfinite(values), values, np.nan)
