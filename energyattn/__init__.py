"""energyattn: attention as energy minimisation in JAX and Equinox.

Energies, solvers and results live at `energyattn.*`, layers at `energyattn.nn.*`, data at
`energyattn.data.*`.
"""

from importlib import metadata as _metadata

from . import (
    aot as aot,
    data as data,
    ham as ham,
    lagrangians as lagrangians,
    models as models,
    nn as nn,
    parallel as parallel,
    spin as spin,
    viz as viz,
)
from ._deprecated import __getattr__ as __getattr__
from ._energy import (
    BLOCKWISE_THRESHOLD as BLOCKWISE_THRESHOLD,
    AbstractEnergy as AbstractEnergy,
    AbstractHiddenPrior as AbstractHiddenPrior,
    BernoulliPrior as BernoulliPrior,
    BinaryVisible as BinaryVisible,
    BlockSizes as BlockSizes,
    ClassicalHopfieldEnergy as ClassicalHopfieldEnergy,
    ConstantPrior as ConstantPrior,
    DenseHopfieldEnergy as DenseHopfieldEnergy,
    ExponentialSeparation as ExponentialSeparation,
    FunctionEnergy as FunctionEnergy,
    GaussianPrior as GaussianPrior,
    GaussianVisible as GaussianVisible,
    HopfieldEnergy as HopfieldEnergy,
    LocalAttentionEnergy as LocalAttentionEnergy,
    MixtureEnergy as MixtureEnergy,
    PoissonPrior as PoissonPrior,
    PolynomialSeparation as PolynomialSeparation,
    RBMEffectiveEnergy as RBMEffectiveEnergy,
    ScaledEnergy as ScaledEnergy,
    SumEnergy as SumEnergy,
    TransformerAttentionEnergy as TransformerAttentionEnergy,
    TransformerMemoryEnergy as TransformerMemoryEnergy,
    attention_logsumexp as attention_logsumexp,
    classical_hopfield_energy as classical_hopfield_energy,
    cumulant as cumulant,
    dense_hopfield_energy as dense_hopfield_energy,
    energy_tree as energy_tree,
    hebbian_weights as hebbian_weights,
    hopfield_energy as hopfield_energy,
    layer_norm_lagrangian as layer_norm_lagrangian,
    legendre_energy as legendre_energy,
    local_energies as local_energies,
    local_energy as local_energy,
    project_couplings as project_couplings,
    pseudo_likelihood_energy as pseudo_likelihood_energy,
    rbm_effective_energy as rbm_effective_energy,
    rbm_joint_energy as rbm_joint_energy,
    select_implementation as select_implementation,
    transformer_attention_energy as transformer_attention_energy,
    transformer_memory_energy as transformer_memory_energy,
)
from ._mask import SegmentIds as SegmentIds
from ._solver import (
    CG as CG,
    GMRES as GMRES,
    LBFGS as LBFGS,
    LU as LU,
    RESULTS as RESULTS,
    AbstractAdjoint as AbstractAdjoint,
    AbstractFixedPointSolver as AbstractFixedPointSolver,
    AbstractIterativeSolver as AbstractIterativeSolver,
    AbstractLinearSolver as AbstractLinearSolver,
    Anderson as Anderson,
    AutoLinearSolver as AutoLinearSolver,
    Cholesky as Cholesky,
    ImplicitAdjoint as ImplicitAdjoint,
    Newton as Newton,
    PhantomAdjoint as PhantomAdjoint,
    Picard as Picard,
    Solution as Solution,
    UnrolledAdjoint as UnrolledAdjoint,
    descend as descend,
    fixed_point as fixed_point,
    local_forces as local_forces,
    minimise as minimise,
    root_find as root_find,
    sign_descend as sign_descend,
)

try:
    __version__ = _metadata.version("energyattn")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
