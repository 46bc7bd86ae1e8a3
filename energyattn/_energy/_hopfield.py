"""The Hopfield family: classical, dense (discrete) and modern continuous energies."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float

from .._checks import (
    check_mask,
    check_matching_dim,
    check_positive,
    check_shape,
    keyword_arguments,
    positive_int,
)
from .._custom_types import Scalar, ScalarLike
from .._dtypes import accumulation_dtype, result_dtype
from .._mask import SegmentIds
from .._sharding import split_rows
from ._attention import (
    BlockSize,
    Implementation,
    as_block_sizes,
    check_block_size,
    check_implementation,
    lse_rows,
    select_implementation,
    split_mask,
)
from ._base import AbstractEnergy


@keyword_arguments("ea.hopfield_energy")
def hopfield_energy(
    query: Float[ArrayLike, "seq dim"],
    memory: Float[ArrayLike, "mem dim"],
    *,
    beta: ScalarLike = 1.0,
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
    implementation: Implementation = "auto",
    block_size: BlockSize = None,
) -> Scalar:
    r"""Log-sum-exp energy of modern continuous Hopfield networks.

    $$E(Q; M) = \sum_{i} \tfrac12 \lVert q_i\rVert^2
      - \frac{1}{\beta} \sum_i \log \sum_{j:\,\mathrm{mask}_{ij}} e^{\beta\, q_i \cdot m_j}$$

    Its gradient is $\nabla_{q_i} E = q_i - \sum_j \mathrm{softmax}_j(\beta\, q_i\cdot m_j)\, m_j$,
    so one gradient step of size 1 is softmax attention with the memories as keys and values:
    $q_i \leftarrow \mathrm{softmax}(\beta\, q_i M^\top) M$.

    Masked entries are removed from the sum exactly (no large negative fill value that would
    leak probability), and a memory that no query may attend to (padding) affects neither the
    energy nor any gradient, whatever it holds. A query whose every memory is masked has an
    empty sum; its log-sum-exp is taken to be 0, so its energy is just
    $\frac12\lVert q_i\rVert^2$ and its attention force is zero. An empty memory
    (shape `(0, dim)`) follows the same rule for every query: the energy is
    $\sum_i \frac12\lVert q_i\rVert^2$ (finite, not $+\infty$), and one step of size 1
    maps every query to 0. Scores and the log-sum-exp
    are accumulated in at least float32 (bfloat16 inputs work). A NaN in an unmasked entry gives
    a NaN energy; `descend` and the layers check for it.

    Above $2^{17}$ score entries (seq x mem) the log-sum-exp is computed blockwise by
    [`attention_logsumexp`][energyattn.attention_logsumexp]: same value and gradient, but the
    gradient (the attention update) never holds the `(seq, mem)` matrix, so it scales to long
    sequences; on NVIDIA GPUs with half-precision inputs it runs through cuDNN's fused
    attention.

    **Arguments:**

    - `query`: state patterns $Q$, shape `(seq, dim)`.
    - `memory`: stored patterns $M$, shape `(mem, dim)`.
    - `beta`: inverse temperature $\beta > 0$ (attention's `scale`, usually $1/\sqrt{d}$).
    - `mask`: optional boolean `(seq, mem)`; `True` where query $i$ may attend to memory $j$.
    - `implementation`: `"auto"`, `"naive"`, `"small"`, `"blockwise"`, `"pallas"` or
      `"cudnn"`, as in [`attention_logsumexp`][energyattn.attention_logsumexp].
    - `block_size`: the tiling of the blockwise passes, a
      [`BlockSizes`][energyattn.BlockSizes] or keys per block (default: each platform's;
      see [`attention_logsumexp`][energyattn.attention_logsumexp]).

    **Returns:**

    The energy, a 0-d array.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020),
        eq. "energyfunc", and *Attention as Energy Minimization: Visualizing Energy Landscapes*
        (2021); H. Ramsauer et al., *Hopfield Networks is All You Need* (2020).
    """
    return hopfield_energy_over(query, memory, beta, mask, implementation, block_size, ring=None)


def hopfield_energy_over(
    query: Float[ArrayLike, "seq dim"],
    memory: Float[ArrayLike, "mem dim"],
    beta: ScalarLike,
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None,
    implementation: Implementation,
    block_size: BlockSize,
    ring: tuple[Any, str] | None,
) -> Scalar:
    """`hopfield_energy`, and with `ring = (mesh, axis)` context-parallel over that mesh axis
    (`ea.parallel.ring_hopfield_energy`)."""
    check_matching_dim("query", query, "seq dim", "memory", memory, "mem dim")
    beta = check_positive("beta", beta)
    query = jnp.asarray(query)
    memory = jnp.asarray(memory)
    if ring is not None:
        # Split along the sequence before anything is computed from them (the quadratic
        # term, the padding), not only inside the ring.
        query = split_rows(query, *ring, "queries' sequence")
        memory = split_rows(memory, *ring, "memories' sequence")
        mask = None if mask is None else split_mask(mask, *ring)
    if mask is not None:
        mask = check_mask(mask, (query.shape[0], memory.shape[0]), "seq mem", segments=True)
        # A memory no query may attend to (padding) is zeroed before the product: in the
        # backward pass its zero cotangent would otherwise multiply its values, and 0 * NaN
        # from garbage padding would reach the queries' gradient.
        attended = mask.attended() if isinstance(mask, SegmentIds) else jnp.any(mask, axis=0)
        memory = jnp.where(attended[:, None], memory, jnp.zeros((), memory.dtype))
    method = select_implementation(
        implementation,
        entries=query.shape[0] * memory.shape[0],
        dtype=result_dtype(query, memory),
        head_dim=query.shape[1],
        structured_mask=mask is not None,
    )
    acc = accumulation_dtype(query, memory)
    beta = beta.astype(acc)
    lse = lse_rows(query, memory, beta, mask, False, method, as_block_sizes(block_size), ring)
    quadratic = 0.5 * jnp.sum(jnp.square(query.astype(acc)))
    return quadratic - jnp.sum(lse) / beta


class HopfieldEnergy(AbstractEnergy):
    r"""Module form of [`hopfield_energy`][energyattn.hopfield_energy]: a state's energy
    against fixed stored patterns.

    $$E(Q) = \sum_i \tfrac12\lVert q_i\rVert^2
      - \frac1\beta\sum_i \log\sum_j e^{\beta q_i\cdot m_j}$$

    `ea.descend(HopfieldEnergy(memory, beta=beta), query, step_size=1.0, num_steps=1)` is the
    modern Hopfield update $\xi \leftarrow M^\top\mathrm{softmax}(\beta M\xi)$ (softmax
    attention); more steps retrieve a stored pattern.

    **Arguments:**

    - `memory`: stored patterns, shape `(mem, dim)`.
    - `beta`: inverse temperature (> 0).
    - `mask`: optional boolean `(seq, mem)` mask for the states this energy will be called on.
    - `implementation`, `block_size`: how the log-sum-exp is computed, as in
      [`hopfield_energy`][energyattn.hopfield_energy].

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020).
    """

    memory: Float[Array, "mem dim"]
    beta: Float[Array, ""]
    mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None
    implementation: Implementation = eqx.field(static=True)
    block_size: BlockSize = eqx.field(static=True)

    @keyword_arguments("ea.HopfieldEnergy")
    def __init__(
        self,
        memory: Float[ArrayLike, "mem dim"],
        *,
        beta: ScalarLike = 1.0,
        mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
        implementation: Implementation = "auto",
        block_size: BlockSize = None,
    ):
        check_shape("memory", memory, "mem dim")
        self.memory = jnp.asarray(memory)
        self.beta = check_positive("beta", beta)
        if mask is not None:
            mask = check_mask(mask, (None, self.memory.shape[0]), "seq mem", segments=True)
        self.mask = mask
        self.implementation = check_implementation(implementation)
        self.block_size = check_block_size(block_size)

    def __call__(self, x: Float[Array, "seq dim"], args: Any = None) -> Scalar:
        check_matching_dim(
            "x", x, "seq dim", "memory", self.memory, "mem dim", fixed="this energy's"
        )
        return hopfield_energy(
            x,
            self.memory,
            beta=self.beta,
            mask=self.mask,
            implementation=self.implementation,
            block_size=self.block_size,
        )


def hebbian_weights(
    patterns: Float[ArrayLike, "mem dim"], *, zero_diagonal: bool = True
) -> Float[Array, "dim dim"]:
    r"""Hebbian couplings of a classical Hopfield network.

    $$W = \sum_{\mu} x_\mu x_\mu^\top$$

    **Arguments:**

    - `patterns`: the stored ±1 patterns $x_\mu$, shape `(mem, dim)`.
    - `zero_diagonal`: set $W_{ii}=0$ (default, as Hopfield 1982). On ±1 states the diagonal
      only adds a constant to the energy, so [`sign_descend`][energyattn.sign_descend], which
      works from the energy, is unaffected by it; in the literal update
      $\mathrm{sgn}(W\xi - b)$ it is a self-coupling $N\xi_i$ that freezes states once $N$ is
      large.

    **Returns:**

    The symmetric matrix $W$, shape `(dim, dim)`.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020),
        "Classical discrete Hopfield networks"; J. Hopfield (1982).
    """
    check_shape("patterns", patterns, "mem dim")
    patterns = jnp.asarray(patterns)
    weights = patterns.T @ patterns
    if zero_diagonal:
        weights = weights * (1 - jnp.eye(weights.shape[0], dtype=weights.dtype))
    return weights


def classical_hopfield_energy(
    state: Float[ArrayLike, " dim"],
    weights: Float[ArrayLike, "dim dim"],
    bias: Float[ArrayLike, " dim"] | None = None,
) -> Scalar:
    r"""Energy of a classical (Ising-like) Hopfield network.

    $$E(\xi) = -\tfrac12\, \xi^\top W \xi + \xi^\top b$$

    With ±1 states, the sign update $\xi \leftarrow \mathrm{sgn}(W\xi - b)$ is what
    [`sign_descend`][energyattn.sign_descend] derives from this energy.

    **Arguments:**

    - `state`: the state pattern $\xi$, shape `(dim,)`.
    - `weights`: symmetric couplings $W$, shape `(dim, dim)` (see
      [`hebbian_weights`][energyattn.hebbian_weights]).
    - `bias`: optional $b$, shape `(dim,)`.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020),
        eq. "ising".
    """
    check_shape("state", state, "dim")
    dim = jnp.shape(state)[0]
    check_shape("weights", weights, "dim dim", dim=dim)
    state = jnp.asarray(state)
    energy = -0.5 * state @ (jnp.asarray(weights) @ state)
    if bias is not None:
        check_shape("bias", bias, "dim", dim=dim)
        energy = energy + state @ jnp.asarray(bias)
    return energy


class ClassicalHopfieldEnergy(AbstractEnergy):
    r"""Module form of [`classical_hopfield_energy`][energyattn.classical_hopfield_energy].

    $$E(\xi) = -\tfrac12\, \xi^\top W \xi + \xi^\top b$$

    **Arguments:**

    - `weights`: symmetric couplings, shape `(dim, dim)`, e.g. `ea.hebbian_weights(patterns)`.
    - `bias`: optional bias, shape `(dim,)`.
    """

    weights: Float[Array, "dim dim"]
    bias: Float[Array, " dim"] | None

    def __init__(
        self, weights: Float[ArrayLike, "dim dim"], bias: Float[ArrayLike, " dim"] | None = None
    ):
        check_shape("weights", weights, "dim dim")
        check_shape("weights", weights, "dim dim", dim=jnp.shape(weights)[0])
        self.weights = jnp.asarray(weights)
        if bias is not None:
            check_shape("bias", bias, "dim", dim=self.weights.shape[0])
            bias = jnp.asarray(bias)
        self.bias = bias

    def __call__(self, x: Float[Array, " dim"], args: Any = None) -> Scalar:
        return classical_hopfield_energy(x, self.weights, self.bias)


class PolynomialSeparation(eqx.Module):
    r"""Polynomial separation function of a dense associative memory.

    $$F(x) = x^n \quad\text{or, rectified,}\quad F(x) = \max(x, 0)^n$$

    Degree $n=2$ recovers the classical Hopfield energy (up to the diagonal); the low-error
    capacity grows like $d^{\,n-1}$.

    **Arguments:**

    - `degree`: the integer power $n \ge 1$.
    - `rectified`: use $\max(x,0)^n$ (Krotov & Hopfield's rectified polynomial).
    """

    degree: int = eqx.field(static=True)
    rectified: bool = eqx.field(static=True)

    def __init__(self, degree: int | np.integer, *, rectified: bool = False):
        self.degree = positive_int("degree", degree)
        self.rectified = rectified

    def __call__(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        if self.rectified:
            x = jnp.maximum(x, 0)
        return x**self.degree


class ExponentialSeparation(eqx.Module):
    r"""Exponential separation function of a dense associative memory.

    $$F(x) = e^{\beta x}$$

    The capacity grows exponentially in the dimension ($\approx 2^{d/2}$ at $\beta = 1$).
    Overlaps of ±1 patterns reach $d$, so float32 overflows once $\beta d \gtrsim 88$: lower
    $\beta$ or use float64 for large patterns.

    **Arguments:**

    - `beta`: the rate $\beta > 0$ (default 1, the seed's $e^{x}$; keyword only).
    """

    beta: Float[Array, ""]

    @keyword_arguments("ea.ExponentialSeparation")
    def __init__(self, *, beta: ScalarLike = 1.0):
        self.beta = check_positive("beta", beta)

    def __call__(self, x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
        return jnp.exp(self.beta * x)


def dense_hopfield_energy(
    state: Float[ArrayLike, " dim"],
    patterns: Float[ArrayLike, "mem dim"],
    separation: Callable[[Array], Array],
) -> Scalar:
    r"""Energy of a dense associative memory (modern discrete Hopfield network).

    $$E(\xi) = -\sum_{\mu} F\!\left(x_\mu^\top \xi\right)$$

    **Arguments:**

    - `state`: the state pattern $\xi$, shape `(dim,)`.
    - `patterns`: stored patterns $x_\mu$, shape `(mem, dim)`.
    - `separation`: the separation function $F$, applied elementwise:
      [`PolynomialSeparation`][energyattn.PolynomialSeparation],
      [`ExponentialSeparation`][energyattn.ExponentialSeparation] or any JAX function.

    ??? cite "Source"

        M. Bal, *An Energy-Based Perspective on Attention Mechanisms in Transformers* (2020),
        "Modern discrete Hopfield networks"; D. Krotov & J. Hopfield (2016); M. Demircigil et
        al. (2017).
    """
    check_matching_dim("state", state, "dim", "patterns", patterns, "mem dim")
    overlaps = jnp.asarray(patterns) @ jnp.asarray(state)
    values = jnp.asarray(separation(overlaps))
    if values.shape != overlaps.shape:
        raise ValueError(
            f"the separation function must act elementwise: it mapped overlaps of shape "
            f"{overlaps.shape} to shape {values.shape}"
        )
    return -jnp.sum(values)


class DenseHopfieldEnergy(AbstractEnergy):
    r"""Module form of [`dense_hopfield_energy`][energyattn.dense_hopfield_energy].

    $$E(\xi) = -\sum_{\mu} F\!\left(x_\mu^\top \xi\right)$$

    **Arguments:**

    - `patterns`: stored patterns, shape `(mem, dim)`.
    - `separation`: the separation function $F$ (a module or any JAX function).
    """

    patterns: Float[Array, "mem dim"]
    separation: Callable[[Array], Array]

    def __init__(self, patterns: Float[ArrayLike, "mem dim"], separation: Callable[[Array], Array]):
        check_shape("patterns", patterns, "mem dim")
        if not callable(separation):
            raise ValueError(f"separation must be callable, got {type(separation).__name__}")
        self.patterns = jnp.asarray(patterns)
        self.separation = separation

    def __call__(self, x: Float[Array, " dim"], args: Any = None) -> Scalar:
        return dense_hopfield_energy(x, self.patterns, self.separation)
