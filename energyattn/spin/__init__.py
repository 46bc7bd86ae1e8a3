"""The vector-spin model of AFEM (approximate free energy minimisation), as `ea.spin`.

A system of vector spins with couplings `J` (spins, spins) in fields `H` (spins, dim) at inverse
temperature `beta`: the steepest-descent function `phi(t)` of its auxiliary variables, the
saddle point `t*` (`ea.Newton` through the solver engine, differentiated implicitly),
`log_partition`, `free_energy` and `magnetizations` (`jax.grad` of `log_partition` with
respect to `H`).
Everything is unbatched; use `jax.vmap` for batches.
"""

from .._energy._spin import (
    PhiEnergy as PhiEnergy,
    input_couplings as input_couplings,
    phi as phi,
    phi_grad as phi_grad,
    phi_hessian as phi_hessian,
    symmetric_couplings as symmetric_couplings,
)
from ._afem import (
    free_energy as free_energy,
    log_partition as log_partition,
    magnetizations as magnetizations,
    neumann_series as neumann_series,
    saddle_point as saddle_point,
)
