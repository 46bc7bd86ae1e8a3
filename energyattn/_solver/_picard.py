r"""Damped Picard iteration (`Picard`), $z_{k+1} = z_k + \lambda\,(f(z_k) - z_k)$, on the
fixed-point loop of `_fixed_point_solver.py`."""

import equinox as eqx

from .._checks import python_float
from ._fixed_point_solver import AbstractFixedPointSolver, check_tolerances


class Picard(AbstractFixedPointSolver):
    r"""Damped Picard (fixed-point) iteration, $z_{k+1} = z_k + \lambda\,(f(z_k) - z_k)$.

    Converges linearly, at the rate of the spectral radius of $(1-\lambda) I + \lambda
    \partial_z f$, when that is below 1. $\lambda = 1$ is plain iteration of the map.

    **Arguments:**

    - `rtol`, `atol`: the stopping tolerances (see [`fixed_point`][energyattn.fixed_point];
      `None`: `eps ** 0.6` of the dtype, as every solver).
    - `damping`: $\lambda \in (0, 1]$.
    - `divergence`: stop with `RESULTS.diverged` when the residual exceeds this factor times
      the smallest residual seen (a map that is not a contraction); `None` never stops for
      this reason.
    """

    rtol: float | None = eqx.field(default=None, static=True)
    atol: float | None = eqx.field(default=None, static=True)
    damping: float = eqx.field(default=1.0, static=True)
    divergence: float | None = eqx.field(default=1e4, static=True)

    def __check_init__(self):
        check_tolerances(self)
        if python_float("damping", self.damping) > 1:
            raise ValueError(f"damping must be in (0, 1], got {self.damping!r}")

    def mix(self, memory, z, fz):
        return z + self.damping * (fz - z), memory
