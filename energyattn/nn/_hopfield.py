"""Energy-based attention: queries descend the log-sum-exp energy of their keys."""

from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._checks import (
    default_dtype,
    error_if_nonfinite,
    keyword_arguments,
    positive_int,
    python_float,
)
from .._energy import (
    BlockSize,
    HopfieldEnergy,
    Implementation,
    check_block_size,
    check_implementation,
    select_implementation,
)
from .._hyperparameters import hyperparameter, hyperparameter_fields
from .._mask import SegmentIds
from .._solver import Solution, descend
from ._common import (
    empty_descent,
    linear,
    merge_heads,
    prepare_inputs,
    project,
    resolve_dims,
    split_heads,
)


class HopfieldAttention(eqx.Module):
    r"""Energy-based attention: each head's queries descend the modern Hopfield energy of its keys.

    $$E_h(Q_h) = \sum_i \tfrac12 \lVert q_{hi}\rVert^2
      - \frac1\beta \sum_i \log \sum_{j} e^{\beta\, q_{hi}\cdot k_{hj}},
      \qquad Q = xW_Q,\; K = cW_K,$$

    $$Q_h \leftarrow Q_h - \alpha\,\nabla_{Q_h} E_h(Q_h) \quad (\text{num\_steps times}),
      \qquad \text{output} = \mathrm{concat}_h(Q_h)\, W_O + b_O.$$

    There is no value projection: one step with $\alpha = 1$ gives
    $\mathrm{softmax}(\beta Q_h K_h^\top) K_h$, i.e. softmax attention whose values are its
    keys; the output projection plays the role of $W_V$. For self-attention the keys are
    computed once from the input and held fixed while the queries move (differentiating
    $E(x, x)$ through both arguments would be a different update). Heads are independent
    subspaces, so each head descends its own energy (a `vmap` over heads).

    **Arguments:**

    - `query_dim`, `context_dim`, `num_heads`, `head_dim`, `bare`, `dtype`, `key`: as in
      [`SoftmaxAttention`][energyattn.nn.SoftmaxAttention].
    - `beta`: inverse temperature (default $1/\sqrt{\text{head\_dim}}$).
    - `trainable_beta`: learn $\beta$ (default `False`: a fixed hyperparameter; see
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained)).
    - `step_size`: descent step $\alpha > 0$ (default 1; fixed).
    - `num_steps`: number of descent steps (default 1).
    - `implementation`: how the energy's log-sum-exp is computed: `"auto"` (default; the
      Pallas kernels on a GPU or TPU; on a CPU blockwise above $2^{17}$ score entries,
      heads x seq x mem), `"naive"`, `"blockwise"`, `"pallas"` or `"cudnn"`; see
      [`select_implementation`][energyattn.select_implementation].
    - `block_size`: the tiling of the blockwise passes, a
      [`BlockSizes`][energyattn.BlockSizes] or keys per block (default: each platform's;
      see [`attention_logsumexp`][energyattn.attention_logsumexp]).

    ??? cite "Source"

        M. Bal, *Attention as Energy Minimization: Visualizing Energy Landscapes* (2021),
        "Implicit energy-based attention".
    """

    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    output_proj: eqx.nn.Linear | None
    fixed_beta: float | None = eqx.field(static=True)
    trained_beta: Float[Array, ""] | None
    step_size: float = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    query_dim: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    bare: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)
    block_size: BlockSize = eqx.field(static=True)

    @keyword_arguments("ea.nn.HopfieldAttention")
    def __init__(
        self,
        query_dim: int,
        context_dim: int | None = None,
        *,
        num_heads: int = 1,
        head_dim: int | None = None,
        beta: float | None = None,
        trainable_beta: bool = False,
        step_size: float = 1.0,
        num_steps: int = 1,
        bare: bool = False,
        implementation: Implementation = "auto",
        block_size: BlockSize = None,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        dims = resolve_dims(query_dim, context_dim, num_heads, head_dim, bare)
        self.query_dim, self.context_dim, self.num_heads, self.head_dim = dims
        self.bare = bare
        self.fixed_beta, self.trained_beta = hyperparameter_fields(
            "beta", self.head_dim**-0.5 if beta is None else beta, trainable_beta, dtype
        )
        self.step_size = python_float("step_size", step_size)
        self.num_steps = positive_int("num_steps", num_steps, minimum=0)
        self.implementation = check_implementation(implementation)
        self.block_size = check_block_size(block_size)
        if bare:
            self.query_proj = self.key_proj = self.output_proj = None
        else:
            dtype = default_dtype(dtype)
            inner = self.num_heads * self.head_dim
            kq, kk, ko = jr.split(key, 3)
            self.query_proj = linear(self.query_dim, inner, use_bias=False, dtype=dtype, key=kq)
            self.key_proj = linear(self.context_dim, inner, use_bias=False, dtype=dtype, key=kk)
            self.output_proj = linear(inner, self.query_dim, use_bias=True, dtype=dtype, key=ko)

    @property
    def beta(self) -> float | Float[Array, ""]:
        r"""The inverse temperature $\beta$: a float, or an array leaf when trainable."""
        return hyperparameter("beta", self.fixed_beta, self.trained_beta)

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "seq query_dim"],
        context: Float[ArrayLike, "mem context_dim"] | None = None,
        *,
        mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq query_dim"]: ...

    @overload
    def __call__(
        self,
        x: Float[ArrayLike, "seq query_dim"],
        context: Float[ArrayLike, "mem context_dim"] | None = None,
        *,
        mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "seq query_dim"], Solution]: ...

    def __call__(
        self,
        x: Float[ArrayLike, "seq query_dim"],
        context: Float[ArrayLike, "mem context_dim"] | None = None,
        *,
        mask: Bool[ArrayLike, "seq mem"] | SegmentIds | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq query_dim"] | tuple[Float[Array, "seq query_dim"], Solution]:
        """**Arguments:**

        - `x`: inputs of the queries, shape `(seq, query_dim)`.
        - `context`: inputs of the keys, shape `(mem, context_dim)`; default `x`
          (self-attention, keys held fixed during the descent).
        - `mask`: optional boolean `(seq, mem)`, `True` where attending is allowed.
        - `return_solution`: also return the per-head [`Solution`][energyattn.Solution]
          of the descent.
        - `key`: unused (no randomness); accepted for Equinox layer compatibility.

        **Returns:**

        The output, shape `(seq, query_dim)`; with `return_solution=True` also the descent,
        whose leaves carry a leading `heads` axis: `energies` `(heads, num_steps + 1)` and
        `trajectory` `(heads, num_steps + 1, seq, head_dim)` (queries in head space, before
        the output projection).
        """
        del key
        x, context, mask = prepare_inputs(
            x, context, mask, self.query_dim, self.context_dim, segments=True
        )
        queries = split_heads(project(self.query_proj, x), self.num_heads)
        keys = split_heads(project(self.key_proj, context), self.num_heads)

        # The whole layer is one decision: heads x seq x mem score entries.
        method = select_implementation(
            self.implementation,
            entries=self.num_heads * x.shape[0] * context.shape[0],
            dtype=queries.dtype,
            head_dim=self.head_dim,
            structured_mask=mask is not None,
        )

        def descend_head(
            q: Float[Array, "seq head_dim"], k: Float[Array, "mem head_dim"]
        ) -> Solution:
            if q.shape[0] == 0:
                return empty_descent(q, self.num_steps, return_solution)
            energy = HopfieldEnergy(
                k, beta=self.beta, mask=mask, implementation=method, block_size=self.block_size
            )
            # Without a trajectory the energies are not returned, so the descent does not
            # check them (`throw=False`): the energy after the last step is then never
            # computed (XLA drops it), and the layer costs exactly its attention steps. The
            # output is checked instead.
            return descend(
                energy,
                q,
                step_size=self.step_size,
                num_steps=self.num_steps,
                return_trajectory=return_solution,
                throw=return_solution,
            )

        result = jax.vmap(descend_head)(queries, keys)
        out = project(self.output_proj, merge_heads(result.value))
        if return_solution:
            return out, result
        # The inputs were checked; a non-finite parameter is named rather than blamed on
        # the step size.
        return error_if_nonfinite(
            out,
            ~jnp.all(jnp.isfinite(out)),
            [("HopfieldAttention", self)],
            "HopfieldAttention: the output is NaN or inf because the layer's parameter {} "
            "contains NaN or inf (not a step-size problem)",
            "HopfieldAttention: the output became NaN or inf during the descent (inputs and "
            "parameters are finite): the step size is probably too large for num_steps > 1; "
            "call with return_solution=True to inspect the energies",
        )
