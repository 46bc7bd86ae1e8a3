"""Attention layers (unbatched Equinox modules; use `jax.vmap` for batches)."""

from .._namespace import public_dir as _public_dir
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

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "AttractorAttention",
    "EnergyLayerNorm",
    "EnergyTransformer",
    "Hopfield",
    "HopfieldAttention",
    "HopfieldHeadsEnergy",
    "HopfieldLayer",
    "HopfieldPooling",
    "MeanFieldAttention",
    "MeanFieldTransformerBlock",
    "SoftmaxAttention",
    "SpinTransformerAttention",
    "VectorSpinAttention",
    "normalise_tokens",
    "self_attention_displacement",
]
__dir__ = _public_dir(__all__)
