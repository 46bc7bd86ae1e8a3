"""Energies and their algebra.

An energy is a pure, differentiable scalar function `E(x, args)` of a state `x` (an array or a
pytree of arrays). Every `eqx.Module` subclassing `AbstractEnergy` is one; `E1 + E2`, `c * E`
and `MixtureEnergy` build new ones, and because they are Equinox modules their parameters are
pytree leaves that `jax.grad` and optax can train.
"""

import abc
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import shape_str, signature_mismatch
from .._custom_types import Scalar, ScalarLike, State


class AbstractEnergy(eqx.Module):
    """A scalar energy `E(x, args)` of a state `x`.

    Subclasses implement `__call__(self, x, args=None)` and return a 0-d array. Everything
    else about an energy (its force `-∇E`, its descent, its stationary points) is obtained by
    JAX transformations, never written beside it.

    Energies compose:

    - `E1 + E2` is a [`SumEnergy`][energyattn.SumEnergy] whose named terms
      [`energy_tree`][energyattn.energy_tree] reports;
    - `c * E` (and `-E`, `E / c`) is a [`ScaledEnergy`][energyattn.ScaledEnergy]; `c` may be
      a trainable array;
    - `sum([E1, E2, E3])` works too.
    """

    @abc.abstractmethod
    def __call__(self, x: State, args: Any = None) -> Scalar:
        """The energy of the state `x` (a 0-d array)."""

    def __add__(self, other: Any) -> "AbstractEnergy":
        if _is_zero(other):
            return self
        if not isinstance(other, AbstractEnergy):
            return NotImplemented
        return SumEnergy([self, other])

    def __radd__(self, other: Any) -> "AbstractEnergy":
        # `sum(energies)` starts from the integer 0.
        if _is_zero(other):
            return self
        return NotImplemented

    def __sub__(self, other: Any) -> "AbstractEnergy":
        if not isinstance(other, AbstractEnergy):
            return NotImplemented
        return SumEnergy([self, ScaledEnergy(-1.0, other)])

    def __mul__(self, scale: Any) -> "AbstractEnergy":
        if isinstance(scale, AbstractEnergy) or not _is_scalar_like(scale):
            return NotImplemented
        return ScaledEnergy(scale, self)

    def __rmul__(self, scale: Any) -> "AbstractEnergy":
        return self.__mul__(scale)

    def __truediv__(self, scale: Any) -> "AbstractEnergy":
        if isinstance(scale, AbstractEnergy) or not _is_scalar_like(scale):
            return NotImplemented
        return ScaledEnergy(1.0 / jnp.asarray(scale), self)

    def __neg__(self) -> "AbstractEnergy":
        return ScaledEnergy(-1.0, self)


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def _is_scalar_like(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and np.ndim(x) == 0


def _default_name(energy: Callable) -> str:
    if isinstance(energy, FunctionEnergy):
        return energy.name
    return type(energy).__name__


def _report_names(items: Sequence[tuple[str, bool]]) -> list[str]:
    """Unique report names: user-given names are kept, generated ones numbered around them."""
    taken = {name for name, given in items if given}
    counts: dict[str, int] = {}
    out = []
    for name, given in items:
        if not given:
            counts[name] = counts.get(name, 0) + 1
            candidate = name if counts[name] == 1 else f"{name}_{counts[name]}"
            while candidate in taken:
                counts[name] += 1
                candidate = f"{name}_{counts[name]}"
            name = candidate
        taken.add(name)
        out.append(name)
    return out


class SumEnergy(AbstractEnergy):
    r"""A sum of named energies.

    $$E(x) = \sum_k E_k(x)$$

    Usually built with `+`; build it directly to name the terms, which
    [`energy_tree`][energyattn.energy_tree] then reports:

    ```python
    memory = jr.normal(jr.key(0), (16, 4))
    prior = ea.FunctionEnergy(lambda x, args: jnp.sum(x**2))
    energy = ea.SumEnergy({"hopfield": ea.HopfieldEnergy(memory), "prior": 0.1 * prior})
    terms = ea.energy_tree(energy, jnp.ones((2, 4)))  # {"hopfield": ..., "prior": ...}
    ```

    Nested sums are flattened, so `(E1 + E2) + E3` has three terms.

    **Arguments:**

    - `terms`: a sequence of energies (named after their classes, numbered when repeated) or a
      mapping from names to energies.
    """

    terms: tuple[AbstractEnergy, ...]
    names: tuple[str | None, ...] = eqx.field(static=True)

    def __init__(self, terms: Sequence[AbstractEnergy] | Mapping[str, AbstractEnergy]):
        if isinstance(terms, Mapping):
            items: list[tuple[str | None, Any]] = [
                (str(name), term) for name, term in terms.items()
            ]
        else:
            items = [(None, term) for term in terms]
        flat_terms: list[AbstractEnergy] = []
        flat_names: list[str | None] = []
        for name, term in items:
            if not isinstance(term, AbstractEnergy):
                raise ValueError(
                    "SumEnergy terms must be energies (AbstractEnergy), "
                    f"got {type(term).__name__}; "
                    "wrap a plain function with ea.FunctionEnergy"
                )
            if isinstance(term, SumEnergy) and name is None:
                flat_terms.extend(term.terms)
                flat_names.extend(term.names)
            else:
                flat_terms.append(term)
                flat_names.append(name)
        if not flat_terms:
            raise ValueError("SumEnergy needs at least one term")
        given = [name for name in flat_names if name is not None]
        if len(set(given)) != len(given):
            raise ValueError(f"energy term names must be unique, got {given}")
        self.terms = tuple(flat_terms)
        self.names = tuple(flat_names)

    def __call__(self, x: State, args: Any = None) -> Scalar:
        values = [term(x, args) for term in self.terms]
        return sum(values[1:], start=values[0])


class ScaledEnergy(AbstractEnergy):
    r"""An energy multiplied by a scalar.

    $$E_c(x) = c\,E(x)$$

    Built by `c * E`, `E * c`, `E / c` or `-E`. The scale is stored as an array, so it is a
    trainable parameter when it is floating point.

    **Arguments:**

    - `scale`: the scalar $c$.
    - `energy`: the energy $E$.
    """

    scale: Float[Array, ""]
    energy: AbstractEnergy

    def __init__(self, scale: ScalarLike, energy: AbstractEnergy):
        scale = jnp.asarray(scale)
        if scale.ndim != 0:
            raise ValueError(
                f"an energy can only be scaled by a scalar, got shape {shape_str(scale.shape)}"
            )
        if not jnp.issubdtype(scale.dtype, jnp.floating):
            scale = scale.astype(jnp.result_type(float))
        if not isinstance(energy, AbstractEnergy):
            raise ValueError(f"ScaledEnergy needs an energy, got {type(energy).__name__}")
        self.scale = scale
        self.energy = energy

    def __call__(self, x: State, args: Any = None) -> Scalar:
        return self.scale * self.energy(x, args)


class MixtureEnergy(AbstractEnergy):
    r"""The energy of a mixture of energy-based models (a soft minimum of energies).

    $$E(x) = -\log \sum_k w_k\, e^{-E_k(x)}$$

    If $p_k(x) \propto e^{-E_k(x)}$ then $e^{-E(x)} \propto \sum_k w_k e^{-E_k(x)}$ is their
    mixture. With $E_k$ the effective energies of single-hidden-unit RBMs whose hidden unit is a
    constant, this is the log-sum-exp (modern Hopfield) energy: attention as an implicit
    mixture of effective energy-based models. The force $-\nabla E = -\sum_k
    \pi_k(x)\,\nabla E_k(x)$ is the responsibility-weighted force of the components.

    **Arguments:**

    - `terms`: the component energies $E_k$.
    - `log_weights`: optional $\log w_k$, shape `(len(terms),)`; default all zero ($w_k=1$).

    ??? cite "Source"

        M. Bal, *Transformer Attention as an Implicit Mixture of Effective Energy-Based
        Models* (2020), section "Modern Hopfield networks as mixtures of effective RBMs".
    """

    terms: tuple[AbstractEnergy, ...]
    log_weights: Float[Array, " terms"] | None

    def __init__(self, terms: Sequence[AbstractEnergy], log_weights: ArrayLike | None = None):
        terms = tuple(terms)
        if not terms:
            raise ValueError("MixtureEnergy needs at least one component")
        for term in terms:
            if not isinstance(term, AbstractEnergy):
                raise ValueError(
                    f"MixtureEnergy components must be energies, got {type(term).__name__}"
                )
        if log_weights is not None:
            log_weights = jnp.asarray(log_weights)
            if log_weights.shape != (len(terms),):
                raise ValueError(
                    f"log_weights must have shape ({len(terms)},) (one per component), "
                    f"got {shape_str(log_weights.shape)}"
                )
        self.terms = terms
        self.log_weights = log_weights

    def __call__(self, x: State, args: Any = None) -> Scalar:
        neg = jnp.stack([-term(x, args) for term in self.terms])
        if self.log_weights is not None:
            neg = neg + self.log_weights
        return -jax.nn.logsumexp(neg)


class FunctionEnergy(AbstractEnergy):
    """A plain JAX function `fn(x, args) -> scalar` as a composable energy.

    `descend` and the solvers accept any such function directly; wrap it when you want to add
    or scale it together with other energies.

    **Arguments:**

    - `fn`: the function; it must return a 0-d array.
    - `name`: its name in [`energy_tree`][energyattn.energy_tree] (default `fn.__name__`).
    """

    fn: Callable[[Any, Any], Scalar]
    name: str = eqx.field(static=True)

    def __init__(self, fn: Callable[[Any, Any], Scalar], name: str | None = None):
        if not callable(fn):
            raise ValueError(f"FunctionEnergy needs a callable, got {type(fn).__name__}")
        mismatch = signature_mismatch(fn, None, None)
        if mismatch is not None:
            # Refused now: descend and the solvers call it as fn(x, args).
            raise TypeError(
                "FunctionEnergy needs a function fn(x, args) -> scalar (the state and the "
                "arguments passed to the solver; ignore args if it needs none, "
                f"lambda x, args: ...); got {fn!r}: {mismatch}"
            )
        self.fn = fn
        if name is None:
            name = fn.__name__ if isinstance(fn, types.FunctionType) else type(fn).__name__
        self.name = name

    def __call__(self, x: State, args: Any = None) -> Scalar:
        out = jnp.asarray(self.fn(x, args))
        if out.shape != ():
            raise ValueError(
                f"energy function {self.name!r} must return a scalar, "
                f"got shape {shape_str(out.shape)}"
            )
        return out


def energy_tree(energy: AbstractEnergy, x: State, args: Any = None) -> dict[str, Scalar]:
    """Each named term of an energy at `x`.

    Sums are broken into their terms (nested sums as `outer/inner`), scalings are applied to
    the terms they scale, and any other energy is a single term named after its class. The
    values always add up to `energy(x, args)`.

    **Arguments:**

    - `energy`: an [`AbstractEnergy`][energyattn.AbstractEnergy].
    - `x`: the state.
    - `args`: passed to every term.

    **Returns:**

    A dict from term name to its 0-d value, in the order of the terms.
    """
    if not isinstance(energy, AbstractEnergy):
        raise ValueError(f"energy_tree needs an AbstractEnergy, got {type(energy).__name__}")
    items = _tree_items(energy, x, args)
    names = _report_names([(name, given) for name, given, _ in items])
    return {name: value for name, (_, _, value) in zip(names, items, strict=True)}


def _tree_items(energy: AbstractEnergy, x: State, args: Any) -> list[tuple[str, bool, Scalar]]:
    """`(name, user_given, value)` for each term of `energy`."""
    if isinstance(energy, SumEnergy):
        out = []
        for name, term in zip(energy.names, energy.terms, strict=True):
            sub = _tree_items(term, x, args)
            if name is None:
                out.extend(sub)  # an unnamed term reports its own terms
            elif len(sub) == 1:
                out.append((name, True, sub[0][2]))
            else:
                sub_names = _report_names([(n, g) for n, g, _ in sub])
                out.extend(
                    (f"{name}/{n}", True, v) for n, (_, _, v) in zip(sub_names, sub, strict=True)
                )
        return out
    if isinstance(energy, ScaledEnergy):
        return [(n, g, energy.scale * v) for n, g, v in _tree_items(energy.energy, x, args)]
    return [(_default_name(energy), False, energy(x, args))]
