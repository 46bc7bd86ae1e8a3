"""Hierarchical associative memories: neuron layers defined by Lagrangians, synapses as
energies of their activations, and one energy for the whole graph (`ea.ham`)."""

from ._graph import HAM as HAM
from ._neurons import Neurons as Neurons
from ._synapses import (
    AttentionSynapse as AttentionSynapse,
    BiasSynapse as BiasSynapse,
    ConvSynapse as ConvSynapse,
    DenseSynapse as DenseSynapse,
    HopfieldSynapse as HopfieldSynapse,
)
