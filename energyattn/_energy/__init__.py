# The energies' interface to the rest of the package (solvers, spin model, layers); not
# re-exported by `energyattn` itself.
from ._attention import (
    BLOCKWISE_THRESHOLD as BLOCKWISE_THRESHOLD,
    BlockSize as BlockSize,
    BlockSizes as BlockSizes,
    Implementation as Implementation,
    as_block_sizes as as_block_sizes,
    attention_logsumexp as attention_logsumexp,
    check_block_size as check_block_size,
    check_implementation as check_implementation,
    naive_on_cpu as naive_on_cpu,
    select_implementation as select_implementation,
)
from ._base import (
    AbstractEnergy as AbstractEnergy,
    FunctionEnergy as FunctionEnergy,
    MixtureEnergy as MixtureEnergy,
    ScaledEnergy as ScaledEnergy,
    SumEnergy as SumEnergy,
    energy_tree as energy_tree,
)
from ._hopfield import (
    ClassicalHopfieldEnergy as ClassicalHopfieldEnergy,
    DenseHopfieldEnergy as DenseHopfieldEnergy,
    ExponentialSeparation as ExponentialSeparation,
    HopfieldEnergy as HopfieldEnergy,
    PolynomialSeparation as PolynomialSeparation,
    classical_hopfield_energy as classical_hopfield_energy,
    dense_hopfield_energy as dense_hopfield_energy,
    hebbian_weights as hebbian_weights,
    hopfield_energy as hopfield_energy,
    hopfield_energy_over as hopfield_energy_over,
)
from ._lagrangian import (
    layer_norm_lagrangian as layer_norm_lagrangian,
    legendre_energy as legendre_energy,
)
from ._local import (
    LocalAttentionEnergy as LocalAttentionEnergy,
    local_energies as local_energies,
    local_energy as local_energy,
    project_couplings as project_couplings,
    pseudo_likelihood_energy as pseudo_likelihood_energy,
)
from ._rbm import (
    AbstractHiddenPrior as AbstractHiddenPrior,
    BernoulliPrior as BernoulliPrior,
    BinaryVisible as BinaryVisible,
    ConstantPrior as ConstantPrior,
    GaussianPrior as GaussianPrior,
    GaussianVisible as GaussianVisible,
    PoissonPrior as PoissonPrior,
    RBMEffectiveEnergy as RBMEffectiveEnergy,
    cumulant as cumulant,
    rbm_effective_energy as rbm_effective_energy,
    rbm_joint_energy as rbm_joint_energy,
)
from ._transformer import (
    TransformerAttentionEnergy as TransformerAttentionEnergy,
    TransformerMemoryEnergy as TransformerMemoryEnergy,
    transformer_attention_energy as transformer_attention_energy,
    transformer_memory_energy as transformer_memory_energy,
)
