"""Hierarchical associative memories: neuron layers defined by Lagrangians, synapses as
energies of their activations, and one energy for the whole graph (`ea.ham`)."""

from .._namespace import public_dir as _public_dir
from ._graph import HAM as HAM
from ._neurons import Neurons as Neurons
from ._synapses import (
    AttentionSynapse as AttentionSynapse,
    BiasSynapse as BiasSynapse,
    ConvSynapse as ConvSynapse,
    DenseSynapse as DenseSynapse,
    HopfieldSynapse as HopfieldSynapse,
)

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "AttentionSynapse",
    "BiasSynapse",
    "ConvSynapse",
    "DenseSynapse",
    "HAM",
    "HopfieldSynapse",
    "Neurons",
]
__dir__ = _public_dir(__all__)
