"""Attention layers (unbatched Equinox modules; use `jax.vmap` for batches)."""

from ._attractor import (
    AttractorAttention as AttractorAttention,
    normalise_tokens as normalise_tokens,
)
from ._displacement import self_attention_displacement as self_attention_displacement
from ._energy_transformer import (
    EnergyLayerNorm as EnergyLayerNorm,
    EnergyTransformer as EnergyTransformer,
)
from ._hopfield import HopfieldAttention as HopfieldAttention
from ._hopfield_layers import (
    Hopfield as Hopfield,
    HopfieldHeadsEnergy as HopfieldHeadsEnergy,
    HopfieldLayer as HopfieldLayer,
    HopfieldPooling as HopfieldPooling,
)
from ._mean_field import (
    MeanFieldAttention as MeanFieldAttention,
    MeanFieldTransformerBlock as MeanFieldTransformerBlock,
)
from ._smt import SpinTransformerAttention as SpinTransformerAttention
from ._softmax import SoftmaxAttention as SoftmaxAttention
from ._spin import VectorSpinAttention as VectorSpinAttention
