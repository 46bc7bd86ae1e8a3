r"""Hierarchical associative memories: layers of neurons joined by synapses, one energy."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._custom_types import Scalar, ScalarLike
from .._energy import FunctionEnergy, SumEnergy, energy_tree
from .._solver import Solution, descend
from ._neurons import Neurons

States = dict[str, Float[Array, "..."]]


class HAM(eqx.Module):
    r"""A hierarchical associative memory: a graph of neuron layers and synapses.

    $$E(x) = \sum_{\ell} \big(g_\ell\cdot x_\ell - L_\ell(x_\ell)\big)
      + \sum_{s} E_s\big(g_{\ell_1(s)}, g_{\ell_2(s)}, \dots\big),
      \qquad g_\ell = \nabla L_\ell(x_\ell),$$

    the Legendre energies of the layers (those with `legendre=True`) plus one energy per
    synapse, a function of the activations of the layers it joins. The states evolve by

    $$\tau_\ell\, \dot x_\ell = -\frac{\partial E}{\partial g_\ell}
      = -x_\ell - \sum_s \frac{\partial E_s}{\partial g_\ell},$$

    the partial derivative taken at fixed $x$ (the first term is the leak of a Legendre
    layer). Along these dynamics $\dot E = -\sum_\ell \tau_\ell^{-1}\,
    \partial_{g_\ell}E^\top\, \nabla^2 L_\ell(x_\ell)\, \partial_{g_\ell}E \le 0$ whenever
    every Lagrangian is convex, so the energy is a Lyapunov function, and its fixed points
    are the stationary points of $E$. States are dicts of arrays (pytrees), so every solver
    of the package applies to `energy`.

    **Arguments:**

    - `neurons`: a dict from layer names to [`Neurons`][energyattn.ham.Neurons].
    - `synapses`: a dict from synapse names to synapses: any function of activations
      returning a scalar ([`DenseSynapse`][energyattn.ham.DenseSynapse],
      [`ConvSynapse`][energyattn.ham.ConvSynapse],
      [`AttentionSynapse`][energyattn.ham.AttentionSynapse],
      [`HopfieldSynapse`][energyattn.ham.HopfieldSynapse], an Equinox module or a plain
      function).
    - `connections`: a dict from synapse names to the names of the layers it joins, in the
      order of its arguments (a single name for a synapse on one layer).

    ??? cite "Source"

        D. Krotov, *Hierarchical Associative Memory* (2021); D. Krotov & J. Hopfield, *Large
        Associative Memory Problem in Neurobiology and Machine Learning* (ICLR 2021);
        B. Hoover et al., HAMUX (github.com/bhoov/hamux) and *Energy Transformer* (2023).
    """

    neurons: dict[str, Neurons]
    synapses: dict[str, Callable[..., Scalar]]
    connections: dict[str, tuple[str, ...]] = eqx.field(static=True)

    def __init__(
        self,
        neurons: Mapping[str, Neurons],
        synapses: Mapping[str, Callable[..., Scalar]],
        connections: Mapping[str, str | Sequence[str]],
    ):
        for name, layer in neurons.items():
            if not isinstance(layer, Neurons):
                raise ValueError(
                    f"neurons[{name!r}] must be an ea.ham.Neurons, got {type(layer).__name__}"
                )
        if set(synapses) != set(connections):
            raise ValueError(
                "every synapse needs one entry in connections and every connection a synapse; "
                f"synapses without connections: {sorted(set(synapses) - set(connections))}, "
                f"connections without synapses: {sorted(set(connections) - set(synapses))}"
            )
        joined = {}
        for name, layers in connections.items():
            layers = (layers,) if isinstance(layers, str) else tuple(layers)
            unknown = [layer for layer in layers if layer not in neurons]
            if not layers or unknown:
                raise ValueError(
                    f"connections[{name!r}] must name layers of the graph {sorted(neurons)}, "
                    f"got {layers}"
                )
            if not callable(synapses[name]):
                raise ValueError(f"synapses[{name!r}] must be callable")
            joined[name] = layers
        self.neurons = dict(neurons)
        self.synapses = dict(synapses)
        self.connections = joined

    # ------------------------------------------------------------------------- states

    def init_states(self, key: PRNGKeyArray | None = None, *, dtype: Any = None) -> States:
        """Initial states of every layer: zeros, or small noise with a `key`."""
        keys = jr.split(key, len(self.neurons)) if key is not None else [None] * len(self.neurons)
        return {
            name: layer.init_state(k, dtype=dtype)
            for (name, layer), k in zip(self.neurons.items(), keys, strict=True)
        }

    def _check(self, states: Mapping[str, Any], names: Any = None) -> States:
        names = set(self.neurons) if names is None else set(names)
        if not isinstance(states, Mapping) or set(states) != names:
            got = sorted(states) if isinstance(states, Mapping) else type(states).__name__
            raise ValueError(f"states must be a dict with the layers {sorted(names)}, got {got}")
        for name in names:
            self.neurons[name].check(name, states[name])
        return {name: jnp.asarray(states[name]) for name in self.neurons if name in names}

    def activations(self, states: Mapping[str, Float[Array, "..."]]) -> States:
        """$g_\\ell = \\nabla L_\\ell(x_\\ell)$ of every layer."""
        states = self._check(states)
        return {name: self.neurons[name].activation(x) for name, x in states.items()}

    # ------------------------------------------------------------------------- energy

    def _synapse_energy(self, name: str, g: States) -> Scalar:
        value = jnp.asarray(self.synapses[name](*(g[layer] for layer in self.connections[name])))
        if value.shape != ():
            raise ValueError(f"synapse {name!r} must return a scalar, got shape {value.shape}")
        return value

    def _joint_energy(self, x: States, g: States) -> Scalar:
        """$E(x, g)$ with $x$ and $g$ independent: its $\\partial/\\partial g$ drives the
        dynamics."""
        total = sum(
            jnp.sum(g[name] * x[name]) - layer.lagrangian(x[name])
            for name, layer in self.neurons.items()
            if layer.legendre
        )
        # mypy types `sum` as `Array | int` (the int 0 of no terms).
        return cast(Scalar, total + sum(self._synapse_energy(name, g) for name in self.synapses))

    def energy(self, states: Mapping[str, Float[Array, "..."]], args: Any = None) -> Scalar:
        """$E(x)$ at the states (a dict of arrays); `args` is ignored (the energy protocol)."""
        states = self._check(states)
        return self._joint_energy(states, self.activations(states))

    def as_energy(self) -> SumEnergy:
        """$E(x)$ as a [`SumEnergy`][energyattn.SumEnergy] with one term per Legendre layer
        (`neurons/<name>`) and per synapse (`synapses/<name>`), for
        [`energy_tree`][energyattn.energy_tree] and the solvers."""
        terms = {}
        for name, layer in self.neurons.items():
            if layer.legendre:

                def neuron_energy(x: Any, args: Any, n: str = name) -> Array:
                    return self.neurons[n].energy(self._check(x)[n])

                terms[f"neurons/{name}"] = FunctionEnergy(neuron_energy, name)
        for name in self.synapses:

            def synapse_energy(x: Any, args: Any, n: str = name) -> Array:
                return self._synapse_energy(n, self.activations(x))

            terms[f"synapses/{name}"] = FunctionEnergy(synapse_energy, name)
        return SumEnergy(terms)

    def energy_tree(self, states: Mapping[str, Float[Array, "..."]]) -> dict[str, Scalar]:
        """Each term of the energy at the states: `neurons/<layer>` (Legendre energies) and
        `synapses/<synapse>`; they add up to `energy(states)`."""
        return energy_tree(self.as_energy(), dict(states))

    def energy_gradient(self, states: Mapping[str, Float[Array, "..."]]) -> States:
        """$\\partial E/\\partial g_\\ell$ at fixed $x$ for every layer: minus $\\tau_\\ell
        \\dot x_\\ell$. It vanishes at the fixed points of the dynamics."""
        states = self._check(states)
        return jax.grad(lambda g: self._joint_energy(states, g))(self.activations(states))

    # ------------------------------------------------------------------------- dynamics

    def descend(
        self,
        states: Mapping[str, Float[Array, "..."]],
        *,
        step_size: ScalarLike,
        num_steps: int,
        clamp: Sequence[str] = (),
        return_trajectory: bool = False,
        throw: bool = True,
    ) -> Solution:
        r"""Run the dynamics of all unclamped layers jointly with
        [`ea.descend`][energyattn.descend]: $x_\ell \leftarrow x_\ell - (\Delta t/\tau_\ell)\,
        \partial E/\partial g_\ell$.

        **Arguments:**

        - `states`: the initial states, a dict with every layer.
        - `step_size`: the time step $\Delta t > 0$; layer $\ell$ moves by
          $\Delta t/\tau_\ell$ times its force.
        - `num_steps`: number of steps.
        - `clamp`: names of layers held at their initial states (inputs).
        - `return_trajectory`, `throw`: as for `ea.descend`.

        **Returns:**

        A [`Solution`][energyattn.Solution] whose `value` holds the final states of every
        layer (clamped ones unchanged) and whose `energies` are $E$ at every step; with
        `return_trajectory=True` its `trajectory` holds the states of the free layers.
        """
        states = self._check(states)
        clamp = (clamp,) if isinstance(clamp, str) else tuple(clamp)
        unknown = [name for name in clamp if name not in self.neurons]
        if unknown:
            raise ValueError(f"clamp names layers {unknown} that the graph does not have")
        fixed = {name: states[name] for name in clamp}
        fixed_g = {name: self.neurons[name].activation(x) for name, x in fixed.items()}
        free = {name: x for name, x in states.items() if name not in fixed}
        if not free:
            raise ValueError("every layer is clamped: nothing to descend")

        def joint(x, g, args):
            return self._joint_energy({**fixed, **x}, {**fixed_g, **g})

        def activation(x):
            return {name: self.neurons[name].activation(v) for name, v in x.items()}

        solution = descend(
            joint,
            free,
            step_size={name: step_size / self.neurons[name].tau for name in free},
            num_steps=num_steps,
            activation=activation,
            with_state=True,
            return_trajectory=return_trajectory,
            throw=throw,
        )
        final = {**fixed, **solution.value}
        return eqx.tree_at(lambda s: s.value, solution, {n: final[n] for n in self.neurons})
