"""The vector-spin model of AFEM (approximate free energy minimisation), as `ea.spin`.

A system of vector spins with couplings `J` (spins, spins) in fields `H` (spins, dim) at inverse
temperature `beta`: the steepest-descent function `phi(t)` of its auxiliary variables, the
saddle point `t*` (`ea.Newton` through the solver engine, differentiated implicitly),
`log_partition`, `free_energy` and `magnetizations` (`jax.grad` of `log_partition` with
respect to `H`). And the spin-model transformer's non-equilibrium (TAP) mean-field
functions `smt_*`, whose steady state `smt_magnetizations` is the output of
`ea.nn.SpinTransformerAttention`.
Everything is unbatched; use `jax.vmap` for batches.
"""

from .._energy import (
    PhiEnergy as PhiEnergy,
    input_couplings as input_couplings,
    phi as phi,
    phi_grad as phi_grad,
    phi_hessian as phi_hessian,
    smt_gamma as smt_gamma,
    smt_phi as smt_phi,
    smt_phi_inverse as smt_phi_inverse,
    smt_tap_update as smt_tap_update,
    symmetric_couplings as symmetric_couplings,
)
from .afem import (
    free_energy as free_energy,
    log_partition as log_partition,
    magnetizations as magnetizations,
    neumann_series as neumann_series,
    saddle_point as saddle_point,
)
from .smt import smt_magnetizations as smt_magnetizations, smt_steady_state as smt_steady_state
