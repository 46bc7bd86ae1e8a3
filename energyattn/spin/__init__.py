"""The vector-spin family, as `ea.spin`: one module each with its equations and its solves.

- `ea.spin.afem`: the equilibrium model of AFEM (approximate free energy minimisation):
  couplings `J` (spins, spins) and fields `H` (spins, dim) at inverse temperature `beta`,
  the steepest-descent function `phi(t)` of its auxiliary variables, the saddle point `t*`
  (`ea.Newton` through the solver engine, differentiated implicitly), `log_partition`,
  `free_energy` and `magnetizations` (`jax.grad` of `log_partition` with respect to `H`).
  Its names are also `ea.spin.*` (`ea.spin.phi`, `ea.spin.saddle_point`, ...), the
  package's primary interface.
- `ea.spin.smt`: spin-model transformers, the second-order (TAP) mean-field theory of vector
  spins with asymmetric couplings and its steady state, the output of
  `ea.nn.SpinTransformerAttention`.
- `ea.spin.mean_field`: deep implicit attention's mean-field maps (naive, adaptive TAP,
  neural) of vector spins with block couplings, which `ea.nn.MeanFieldAttention` solves.

`beta` is keyword-only. Everything is unbatched; use `jax.vmap` for batches.
"""

from .._namespace import public_dir as _public_dir
from . import afem as afem, mean_field as mean_field, smt as smt
from .afem import (
    PhiEnergy as PhiEnergy,
    free_energy as free_energy,
    input_couplings as input_couplings,
    log_partition as log_partition,
    magnetizations as magnetizations,
    neumann_series as neumann_series,
    phi as phi,
    phi_grad as phi_grad,
    phi_hessian as phi_hessian,
    saddle_point as saddle_point,
    symmetric_couplings as symmetric_couplings,
)

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "PhiEnergy",
    "afem",
    "free_energy",
    "input_couplings",
    "log_partition",
    "magnetizations",
    "mean_field",
    "neumann_series",
    "phi",
    "phi_grad",
    "phi_hessian",
    "saddle_point",
    "smt",
    "symmetric_couplings",
]
__dir__ = _public_dir(__all__)
