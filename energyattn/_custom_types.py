"""Shared jaxtyping aliases.

One vocabulary of dimension names is used across the package:

| name       | meaning                                             |
|------------|-----------------------------------------------------|
| `seq`      | query tokens / state patterns                       |
| `mem`      | memory tokens / stored patterns / keys              |
| `dim`      | feature (latent) dimension of one token             |
| `heads`    | attention heads                                     |
| `head_dim` | feature dimension of one head                       |
| `hidden`   | hidden units of a restricted Boltzmann machine      |
| `spins`    | spins of a vector-spin model                        |
"""

from typing import Literal, TypeAlias

from jaxtyping import Array, ArrayLike, Float, PyTree

#: A scalar JAX array (the value of an energy).
Scalar: TypeAlias = Float[Array, ""]
#: Anything that converts to a real scalar: a Python float or a 0-d array.
ScalarLike: TypeAlias = float | int | Float[ArrayLike, ""]
#: The state an energy is a function of: an array or a pytree of arrays.
State: TypeAlias = PyTree[Float[Array, "..."]]

#: How the attractor network normalises its tokens.
Normalisation = Literal["sphere", "layer", "none"]
