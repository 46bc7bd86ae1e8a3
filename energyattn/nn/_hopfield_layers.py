r"""Modern Hopfield layers with the semantics of `hopfield-layers` (ml-jku), as energies.

`Hopfield` is the association module; `HopfieldPooling` and `HopfieldLayer` wrap it with
learned state patterns (queries) or learned stored patterns (a lookup table). Every update
of these layers is a gradient step of size 1 on the log-sum-exp energy of its head,

$$E_h(\Xi_h) = \sum_l \tfrac12 \lVert \xi_{hl}\rVert^2
  - \frac1{\beta_h} \sum_l \log \sum_{s\,\text{allowed}} e^{\beta_h\, \xi_{hl}\cdot k_{hs}},
  \qquad \xi \leftarrow \xi - \nabla_\xi E_h = \mathrm{softmax}(\beta_h\, \xi K_h^\top) K_h,$$

so `Hopfield.energy` returns that energy for the package's solvers to inspect, descend or
differentiate. The loop (initial retrieval, up to `update_steps_max` updates, per-example
early stop on the Frobenius norm of the change of the association matrix) is the package's
`bounded_while`: a `lax.scan` that reverse mode differentiates when the number of updates is
bounded, a `lax.while_loop` with implicit derivatives at the fixed point when it is not.
"""

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from einops import rearrange
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._checks import (
    check_finite,
    check_mask,
    check_shape,
    check_values,
    default_dtype,
    keyword_arguments,
    positive_int,
    shape_str,
)
from .._custom_types import Scalar
from .._energy import AbstractEnergy, hopfield_energy
from .._solver import (
    MinimiseProblem,
    bounded_while,
    flatten_problem,
    implicit_value,
    no_grad,
)
from ._hopfield_state_dict import hopfield_state_dict, load_state_dict
from ._softmax import _masked_softmax

Input = Float[ArrayLike, "seq dim"] | tuple[ArrayLike, ArrayLike, ArrayLike]

_INIT_STD = 0.02  # hopfield-layers' initialisation of every weight matrix and learned pattern


# --------------------------------------------------------------------------------- energy


class HopfieldHeadsEnergy(AbstractEnergy):
    r"""The energy one [`Hopfield`][energyattn.nn.Hopfield] layer descends, summed over heads.

    $$E(\Xi) = \sum_h \Big[\sum_l \tfrac12\lVert \xi_{hl}\rVert^2
      - \frac1{\beta_h}\sum_l \log\!\sum_{s:\,\mathrm{allowed}_{ls}} e^{\beta_h\,\xi_{hl}\cdot
      k_{hs}}\Big]$$

    on states $\Xi$ of shape `(heads, state_len, hidden_size)` (the state patterns in each
    head's Hopfield space). One gradient step of size 1 is one update of the layer.

    **Arguments:**

    - `keys`: the stored patterns in Hopfield space, shape `(heads, stored, hidden_size)`.
    - `beta`: the inverse temperature of each head, shape `(heads,)` (keyword only).
    - `mask`: optional boolean `(state_len, stored)`, `True` where attending is allowed
      (keyword only; default: everywhere).
    """

    keys: Float[Array, "heads stored dim"]
    beta: Float[Array, " heads"]
    mask: Bool[Array, "seq stored"] | None

    @keyword_arguments("ea.nn.HopfieldHeadsEnergy")
    def __init__(
        self,
        keys: Float[Array, "heads stored dim"],
        *,
        beta: Float[Array, " heads"],
        mask: Bool[Array, "seq stored"] | None = None,
    ):
        self.keys, self.beta, self.mask = keys, beta, mask

    def __call__(self, x: Float[Array, "heads seq dim"], args: Any = None) -> Scalar:
        check_shape("x", x, "heads seq dim", heads=self.keys.shape[0], dim=self.keys.shape[2])
        head = functools.partial(_head_energy, mask=self.mask)
        return jnp.sum(jax.vmap(head)(x, self.keys, self.beta))


def _head_energy(
    xi: Float[Array, "seq dim"],
    keys: Float[Array, "stored dim"],
    beta: Float[Array, ""],
    mask: Bool[Array, "seq stored"] | None,
) -> Scalar:
    """One head's energy $E_h$: the log-sum-exp energy of its stored patterns."""
    return hopfield_energy(xi, keys, beta=beta, mask=mask)


# -------------------------------------------------------------------------------- helpers


def _layer_norm(size: int, affine: bool, eps: float, dtype: Any) -> eqx.nn.LayerNorm:
    return eqx.nn.LayerNorm(size, eps=eps, use_weight=affine, use_bias=affine, dtype=dtype)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    return _INIT_STD * jr.normal(key, shape, dtype)


def _linear(n_in: int, n_out: int, bias: bool, dtype: Any, key: PRNGKeyArray) -> eqx.nn.Linear:
    """hopfield-layers' init: weights N(0, 0.02^2), biases 0."""
    layer = eqx.nn.Linear(n_in, n_out, use_bias=bias, dtype=dtype, key=key)
    layer = eqx.tree_at(lambda m: m.weight, layer, _normal(key, (n_out, n_in), dtype))
    if bias:
        layer = eqx.tree_at(lambda m: m.bias, layer, jnp.zeros((n_out,), dtype))
    return layer


def _rows(layer: Any, x: Float[Array, "n dim"]) -> Float[Array, "n out"]:
    """A per-vector layer (Linear, LayerNorm) applied to every row; `None` is the identity."""
    return x if layer is None else jax.vmap(layer)(x)


def _per_head(name: str, value: Any, num_heads: int, convert: Callable[[Any], Any]) -> tuple:
    """One value for every head, from a scalar or a sequence of `num_heads` values."""
    if isinstance(value, Sequence | np.ndarray | jax.Array) and np.ndim(value) == 1:
        values = tuple(convert(v) for v in np.asarray(value).tolist())
        if len(values) != num_heads:
            raise ValueError(
                f"{name} has {len(values)} entries, but there are num_heads={num_heads} heads"
            )
        return values
    return (convert(value),) * num_heads


def _steps_max(value: Any) -> int | None:
    if value is None or (isinstance(value, int | np.integer) and value < 0):
        return None  # hopfield-layers' "no limit" (None, or -1 in a tensor)
    return positive_int("update_steps_max", value, minimum=0)


def _steps_eps(value: Any) -> float:
    value = float(value)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"update_steps_eps must be a finite float > 0, got {value!r}")
    return value


def _activation(value: str | Callable | None) -> Callable | None:
    if value is None or callable(value):
        return value
    for namespace in (jax.nn, jnp):
        fn = getattr(namespace, value, None)
        if callable(fn):
            return fn
    raise ValueError(
        f"association_activation={value!r} is not a function in jax.nn or jax.numpy; pass "
        "its name (e.g. 'tanh', 'relu') or a callable"
    )


def _check_excluded(name: str, mask: Any, shape: tuple[int, ...], dims: str) -> Array:
    """A hopfield-layers mask: boolean, `True` = masked out."""
    if tuple(np.shape(mask)) != shape:
        raise ValueError(
            f"{name} must have shape ({dims}) = {shape}, got {shape_str(np.shape(mask))}"
        )
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(
            f"{name} must be boolean (True = masked out, as in hopfield-layers), got dtype "
            f"{mask.dtype}"
        )
    return mask


# ------------------------------------------------------------------------------- Hopfield


class Hopfield(eqx.Module):
    r"""A modern Hopfield association layer: hopfield-layers' `Hopfield`, as an energy.

    Given stored patterns $Y$ `(stored, stored_pattern_size)`, state patterns $R$
    `(state_len, input_size)` and the pattern projection $P$ `(stored,
    pattern_projection_size)` (one array `x` means $Y = R = P = x$):

    $$\hat Y, \hat R, \hat P = \mathrm{LN}_Y(Y), \mathrm{LN}_R(R), \mathrm{LN}_P(P),\qquad
      Q_h = \hat R W_{Q,h}^\top + c_{Q,h},\; K_h = \hat Y W_{K,h}^\top + c_{K,h},\;
      V_h = \hat P W_{V,h}^\top + c_{V,h},$$

    each head runs $\xi^{(0)} = Q_h$, then $T_h \le$ `update_steps_max` updates

    $$\xi^{(t+1)} = \mathrm{softmax}\!\big(\beta_h\, \xi^{(t)} K_h^\top\big)\, K_h
      = \xi^{(t)} - \nabla E_h(\xi^{(t)}),$$

    gradient steps of size 1 on the log-sum-exp energy $E_h$ of its stored patterns
    ([`HopfieldHeadsEnergy`][energyattn.nn.HopfieldHeadsEnergy], returned by
    [`energy`][energyattn.nn.Hopfield.energy]), stopping early once the association matrix
    $A^{(t)} = \mathrm{softmax}(\beta_h \xi^{(t)} K_h^\top)$ changes by at most
    `update_steps_eps` in Frobenius norm, and outputs

    $$Z = \mathrm{act}\Big(\big[\,\mathrm{dropout}(A_h^{(T_h)})\, V_h\,\big]_h\, W_O^\top
      + b_O\Big).$$

    Defaults and argument names are hopfield-layers' (see the guide "Coming from
    hopfield-layers" for every argument and each place where we deliberately differ). The
    layer is unbatched: `jax.vmap` it over a batch, and early stopping is then per example.

    **Arguments:**

    - `input_size`: size of the state patterns (and of the other inputs unless given).
    - `hidden_size`: per-head size of the Hopfield (association) space; default
      `input_size // num_heads`.
    - `output_size`: size of the output; default `input_size`.
    - `pattern_size`: per-head size of the projected values; default `hidden_size`.
    - `num_heads`: number of heads.
    - `scaling`: the inverse temperature $\beta$, a float or one per head; default
      $1/\sqrt{\text{hidden\_size}}$.
    - `trainable_scaling`: learn $\beta$ (default `False`, as hopfield-layers, whose scaling is
      a constant): fixed, it is no leaf of the layer, by
      [the convention](../api/nn.md#hyperparameters-fixed-or-trained) of `ea.nn`.
    - `update_steps_max`: the most state updates $T$ after the initial retrieval (0 =
      one-step attention, `None` = until converged), an int or one per head.
    - `update_steps_eps`: the early-stopping threshold on $\lVert A^{(t)} - A^{(t-1)}\rVert_F$,
      a float or one per head.
    - `normalize_stored_pattern`, `normalize_state_pattern`, `normalize_pattern_projection`
      (default `True`) and their `_affine` (default `True`) and `_eps` (default 1e-5): a
      layer norm on each input.
    - `normalize_hopfield_space`, `normalize_hopfield_space_affine`,
      `normalize_hopfield_space_eps`: a layer norm of $Q_h$ and $K_h$ over their
      `hidden_size` features, one $(\gamma, b)$ shared by both and all heads (default off).
    - `stored_pattern_as_static`, `state_pattern_as_static`, `pattern_projection_as_static`:
      use that input as it is in every head, without a projection (its size must then be
      `hidden_size`, or `pattern_size` for the projection).
    - `pattern_projection_as_connected`: the values are computed from the pattern projection
      through the key projection and then the value projection (`pattern_size` must equal
      `hidden_size`).
    - `stored_pattern_size`, `pattern_projection_size`: input sizes of $Y$ and $P$ (default
      `input_size`).
    - `association_activation`: a function applied to the output (a callable, or the name
      of one in `jax.nn` / `jax.numpy`, e.g. `"tanh"`).
    - `dropout`: dropout probability on the final association matrix (inverted dropout,
      active unless the layer is in inference mode, see `eqx.nn.inference_mode`; the call
      then needs a `key`).
    - `input_bias`: biases $c$ on the projections and $b_O$ on the output.
    - `concat_bias_pattern`: append one learned stored pattern (key and value, after the
      projections) to every input. This is a real bias pattern; in hopfield-layers the flag
      has no effect (see the guide).
    - `add_zero_association`: append one all-zero key and value, which every state pattern
      may attend to (logit 0).
    - `disable_out_projection`: no output projection ($Z$ is the concatenated heads).
    - `batch_first`: accepted for hopfield-layers compatibility; must be `True` (the layer
      is unbatched).
    - `dtype`: parameter dtype (default: JAX's default float).
    - `key`: PRNG key for the initial parameters (keyword only).

    ??? cite "Source"

        H. Ramsauer et al., *Hopfield Networks is All You Need* (ICLR 2021), eqs. (3)
        (energy), (10) (update) and section 3 (layers `Hopfield`, `HopfieldPooling`,
        `HopfieldLayer`); the semantics of github.com/ml-jku/hopfield-layers (1.0.2).
    """

    norm_stored_pattern: eqx.nn.LayerNorm | None
    norm_state_pattern: eqx.nn.LayerNorm | None
    norm_pattern_projection: eqx.nn.LayerNorm | None
    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    value_proj: eqx.nn.Linear | None
    norm_hopfield_space: eqx.nn.LayerNorm | None
    bias_key: Float[Array, " inner"] | None
    bias_value: Float[Array, " inner_values"] | None
    out_proj: eqx.nn.Linear | None
    fixed_scaling: tuple[float, ...] | None = eqx.field(static=True)
    trained_scaling: Float[Array, " heads"] | None
    dropout: eqx.nn.Dropout
    input_size: int = eqx.field(static=True)
    stored_pattern_size: int = eqx.field(static=True)
    pattern_projection_size: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    pattern_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    update_steps_max: tuple[int | None, ...] = eqx.field(static=True)
    update_steps_eps: tuple[float, ...] = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    pattern_projection_as_connected: bool = eqx.field(static=True)
    add_zero_association: bool = eqx.field(static=True)
    association_activation: Callable | None = eqx.field(static=True)
    fused_in_proj: bool = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        hidden_size: int | None = None,
        output_size: int | None = None,
        pattern_size: int | None = None,
        num_heads: int = 1,
        scaling: float | Sequence[float] | None = None,
        update_steps_max: int | Sequence[int | None] | None = 0,
        update_steps_eps: float | Sequence[float] = 1e-4,
        normalize_stored_pattern: bool = True,
        normalize_stored_pattern_affine: bool = True,
        normalize_stored_pattern_eps: float = 1e-5,
        normalize_state_pattern: bool = True,
        normalize_state_pattern_affine: bool = True,
        normalize_state_pattern_eps: float = 1e-5,
        normalize_pattern_projection: bool = True,
        normalize_pattern_projection_affine: bool = True,
        normalize_pattern_projection_eps: float = 1e-5,
        normalize_hopfield_space: bool = False,
        normalize_hopfield_space_affine: bool = False,
        normalize_hopfield_space_eps: float = 1e-5,
        stored_pattern_as_static: bool = False,
        state_pattern_as_static: bool = False,
        pattern_projection_as_static: bool = False,
        pattern_projection_as_connected: bool = False,
        stored_pattern_size: int | None = None,
        pattern_projection_size: int | None = None,
        batch_first: bool = True,
        association_activation: str | Callable | None = None,
        dropout: float = 0.0,
        input_bias: bool = True,
        concat_bias_pattern: bool = False,
        add_zero_association: bool = False,
        disable_out_projection: bool = False,
        *,
        trainable_scaling: bool = False,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        if batch_first is not True:
            raise ValueError(
                "batch_first must be True: energyattn layers are unbatched (jax.vmap them over "
                "a batch), so there is no batch axis to put second"
            )
        for flag, on, affine in (
            ("normalize_stored_pattern", normalize_stored_pattern, normalize_stored_pattern_affine),
            ("normalize_state_pattern", normalize_state_pattern, normalize_state_pattern_affine),
            (
                "normalize_pattern_projection",
                normalize_pattern_projection,
                normalize_pattern_projection_affine,
            ),
            ("normalize_hopfield_space", normalize_hopfield_space, normalize_hopfield_space_affine),
        ):
            if affine and not on:
                raise ValueError(f"{flag}_affine=True needs {flag}=True (an affine map of no norm)")
        dtype = default_dtype(dtype)
        self.num_heads = heads = positive_int("num_heads", num_heads)
        self.input_size = positive_int("input_size", input_size)
        self.stored_pattern_size = positive_int(
            "stored_pattern_size",
            input_size if stored_pattern_size is None else stored_pattern_size,
        )
        self.pattern_projection_size = positive_int(
            "pattern_projection_size",
            input_size if pattern_projection_size is None else pattern_projection_size,
        )
        if hidden_size is None:
            if input_size % heads:
                raise ValueError(
                    f"input_size={input_size} does not split into num_heads={heads} heads; "
                    "pass hidden_size (the per-head size) explicitly"
                )
            hidden_size = input_size // heads
        self.hidden_size = d = positive_int("hidden_size", hidden_size)
        self.pattern_size = p = (
            d if pattern_size is None else positive_int("pattern_size", pattern_size)
        )
        self.output_size = positive_int(
            "output_size", input_size if output_size is None else output_size
        )
        if disable_out_projection:
            self.output_size = heads * p
        if pattern_projection_as_connected and p != d:
            raise ValueError(
                f"pattern_projection_as_connected needs pattern_size == hidden_size, got "
                f"pattern_size={p}, hidden_size={d}"
            )
        if pattern_projection_as_connected and stored_pattern_as_static:
            raise ValueError(
                "pattern_projection_as_connected routes the values through the key projection, "
                "which stored_pattern_as_static removes"
            )
        for static, size, name, want in (
            (state_pattern_as_static, self.input_size, "input_size", d),
            (stored_pattern_as_static, self.stored_pattern_size, "stored_pattern_size", d),
            (
                pattern_projection_as_static and not pattern_projection_as_connected,
                self.pattern_projection_size,
                "pattern_projection_size",
                p,
            ),
        ):
            if static and size != want:
                raise ValueError(
                    f"a static input is used as it is in every head, so {name}={size} must "
                    f"equal the per-head size {want}"
                )
        self.update_steps_max = _per_head("update_steps_max", update_steps_max, heads, _steps_max)
        if len({m is None for m in self.update_steps_max}) > 1:
            raise ValueError(
                "update_steps_max mixes unlimited (None or -1) and limited heads; give every "
                "head a limit, or none"
            )
        self.update_steps_eps = _per_head("update_steps_eps", update_steps_eps, heads, _steps_eps)
        default_beta = 1.0 / math.sqrt(d)
        betas = _per_head("scaling", default_beta if scaling is None else scaling, heads, float)
        if not all(b > 0 and math.isfinite(b) for b in betas):
            raise ValueError(f"scaling must be finite and > 0, got {scaling!r}")
        self.dtype = np.dtype(dtype).name
        if trainable_scaling:
            self.fixed_scaling, self.trained_scaling = None, jnp.asarray(betas, dtype)
        else:
            self.fixed_scaling, self.trained_scaling = tuple(betas), None
        self.pattern_projection_as_connected = bool(pattern_projection_as_connected)
        self.add_zero_association = bool(add_zero_association)
        self.association_activation = _activation(association_activation)
        probability = float(dropout)
        if not 0.0 <= probability < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout = eqx.nn.Dropout(probability)
        # hopfield-layers keeps one `in_proj_weight` when every input has `input_size` and no
        # `pattern_size` was given; `to_state_dict` writes that layout back.
        self.fused_in_proj = (
            self.stored_pattern_size == self.input_size
            and self.pattern_projection_size == self.input_size
            and pattern_size is None
            and not pattern_projection_as_connected
        )

        k = iter(jr.split(key, 6))
        self.norm_stored_pattern = self.norm_state_pattern = self.norm_pattern_projection = None
        if normalize_stored_pattern:
            self.norm_stored_pattern = _layer_norm(
                self.stored_pattern_size,
                normalize_stored_pattern_affine,
                normalize_stored_pattern_eps,
                dtype,
            )
        if normalize_state_pattern:
            self.norm_state_pattern = _layer_norm(
                self.input_size, normalize_state_pattern_affine, normalize_state_pattern_eps, dtype
            )
        if normalize_pattern_projection:
            self.norm_pattern_projection = _layer_norm(
                self.pattern_projection_size,
                normalize_pattern_projection_affine,
                normalize_pattern_projection_eps,
                dtype,
            )
        inner = heads * d
        self.query_proj = (
            None
            if state_pattern_as_static
            else _linear(input_size, inner, input_bias, dtype, next(k))
        )
        self.key_proj = (
            None
            if stored_pattern_as_static
            else _linear(self.stored_pattern_size, inner, input_bias, dtype, next(k))
        )
        value_in = inner if pattern_projection_as_connected else self.pattern_projection_size
        self.value_proj = (
            None
            if pattern_projection_as_static
            else _linear(value_in, heads * p, input_bias, dtype, next(k))
        )
        self.norm_hopfield_space = (
            _layer_norm(d, normalize_hopfield_space_affine, normalize_hopfield_space_eps, dtype)
            if normalize_hopfield_space
            else None
        )
        if concat_bias_pattern:
            kk, kv = jr.split(next(k))
            self.bias_key = _normal(kk, (inner,), dtype)
            self.bias_value = _normal(kv, (heads * p,), dtype)
        else:
            self.bias_key = self.bias_value = None
        self.out_proj = (
            None
            if disable_out_projection
            else _linear(heads * p, self.output_size, input_bias, dtype, next(k))
        )

    # ------------------------------------------------------------------------- the pieces

    def _inputs(self, input: Input) -> tuple[Array, Array, Array]:
        if isinstance(input, tuple | list):
            if len(input) != 3:
                raise ValueError(
                    "input must be one (seq, input_size) array or the tuple (stored_pattern, "
                    f"state_pattern, pattern_projection), got a sequence of {len(input)}"
                )
            stored, state, projection = input
            names = ("stored_pattern", "state_pattern", "pattern_projection")
        else:
            # One array is all three: errors name it as the caller passed it.
            stored = state = projection = input
            names = ("input",) * 3
        check_shape(names[0], stored, "stored dim", dim=self.stored_pattern_size)
        check_shape(names[1], state, "state_len dim", dim=self.input_size)
        check_shape(
            names[2],
            projection,
            "stored dim",
            stored=np.shape(stored)[0],
            dim=self.pattern_projection_size,
        )
        if names[0] == "input":
            checked = check_finite("input", stored)
            return checked, checked, checked
        return (
            check_finite(names[0], stored),
            check_finite(names[1], state),
            check_finite(names[2], projection),
        )

    def _allowed(
        self,
        state_len: int,
        stored: int,
        mask: Any,
        stored_pattern_padding_mask: Any,
        association_mask: Any,
    ) -> Bool[Array, "seq stored_plus"] | None:
        """The one mask of the energy, `True` = may attend, including appended patterns."""
        allowed = None
        if mask is not None:
            allowed = check_mask(mask, (state_len, stored), "state_len stored")
        if association_mask is not None:
            excluded = _check_excluded(
                "association_mask", association_mask, (state_len, stored), "state_len, stored"
            )
            allowed = ~excluded if allowed is None else allowed & ~excluded
        if stored_pattern_padding_mask is not None:
            padding = _check_excluded(
                "stored_pattern_padding_mask", stored_pattern_padding_mask, (stored,), "stored"
            )
            keep = jnp.broadcast_to(~padding, (state_len, stored))
            allowed = keep if allowed is None else allowed & keep
        extra = int(self.bias_key is not None) + int(self.add_zero_association)
        if allowed is not None and extra:
            allowed = jnp.concatenate([allowed, jnp.ones((state_len, extra), bool)], axis=1)
        return allowed

    def _project(
        self, stored: Array, state: Array, projection: Array
    ) -> tuple[
        Float[Array, "heads seq d"], Float[Array, "heads mem d"], Float[Array, "heads mem p"]
    ]:
        heads = self.num_heads
        y = _rows(self.norm_stored_pattern, stored)
        r = _rows(self.norm_state_pattern, state)
        v = _rows(self.norm_pattern_projection, projection)

        def split(x: Array, static: bool) -> Array:
            if static:  # the same raw pattern in every head
                return jnp.broadcast_to(x, (heads, *x.shape))
            return rearrange(x, "n (h d) -> h n d", h=heads)

        q = split(_rows(self.query_proj, r), self.query_proj is None)
        k = split(_rows(self.key_proj, y), self.key_proj is None)
        if self.pattern_projection_as_connected:
            v = _rows(self.key_proj, v)
        v = split(
            _rows(self.value_proj, v),
            self.value_proj is None and not self.pattern_projection_as_connected,
        )
        if self.norm_hopfield_space is not None:
            q = jax.vmap(_rows, (None, 0))(self.norm_hopfield_space, q)
            k = jax.vmap(_rows, (None, 0))(self.norm_hopfield_space, k)
        appended_k: list[Array] = []
        appended_v: list[Array] = []
        if self.bias_key is not None:
            bias_value = cast(Array, self.bias_value)  # set with bias_key
            appended_k.append(rearrange(self.bias_key, "(h d) -> h 1 d", h=heads))
            appended_v.append(rearrange(bias_value, "(h p) -> h 1 p", h=heads))
        if self.add_zero_association:
            appended_k.append(jnp.zeros((heads, 1, k.shape[2]), k.dtype))
            appended_v.append(jnp.zeros((heads, 1, v.shape[2]), v.dtype))
        if appended_k:
            k = jnp.concatenate([k, *appended_k], axis=1)
            v = jnp.concatenate([v, *appended_v], axis=1)
        return q, k, v

    @property
    def trainable_scaling(self) -> bool:
        return self.trained_scaling is not None

    @property
    def scaling(self) -> Float[Array, " heads"]:
        r"""$\beta$ of each head (a leaf of the layer only with `trainable_scaling`)."""
        if self.trained_scaling is None:
            return jnp.asarray(self.fixed_scaling, self.dtype)
        return check_values(
            "scaling", self.trained_scaling, lambda b: (b > 0) & (b < np.inf), "finite and > 0"
        )

    def _retrieve(
        self,
        q: Float[Array, "heads seq d"],
        k: Float[Array, "heads mem d"],
        allowed: Bool[Array, "seq mem"] | None,
    ) -> tuple[Float[Array, "heads seq mem"], Int[Array, " heads"]]:
        """Every head's final association matrix and its number of updates."""
        beta = self.scaling
        limits = jnp.asarray([-1 if m is None else m for m in self.update_steps_max], jnp.int32)
        eps = jnp.asarray(self.update_steps_eps, q.dtype)
        unlimited = self.update_steps_max[0] is None

        def association(xi, keys, b):
            return _masked_softmax(b * xi @ keys.T, allowed)

        force = jax.grad(functools.partial(_head_energy, mask=allowed))

        def head(xi0, keys, b, limit, tol):
            a0 = association(xi0, keys, b)

            def active(carry):
                t, _, _, changed = carry
                return ((t < limit) | (limit < 0)) & changed

            def update(carry):
                t, xi, a, _ = carry
                xi = xi - force(xi, keys, b)  # one gradient step of size 1: softmax(...) K
                a_next = association(xi, keys, b)
                change = jnp.sqrt(jnp.sum(jnp.square(jax.lax.stop_gradient(a_next - a))))
                return t + 1, xi, a_next, change > tol

            init = (jnp.zeros((), jnp.int32), xi0, a0, jnp.ones((), bool))
            bound = 0 if unlimited else max(self.update_steps_max)
            t, xi, a, _ = bounded_while(active, update, init, bound, unrolled=not unlimited)
            return t, xi, a

        if not unlimited:
            steps, _, a = jax.vmap(head)(q, k, beta, limits, eps)
            return a, steps
        # `lax.while_loop` has no reverse mode: the loop runs without derivatives, and the
        # converged states are differentiated as the stationary point of the heads' energy
        # (implicit function theorem).
        q_const, k_const, beta_const = no_grad((q, k, beta))
        steps, xi, _ = jax.vmap(head)(q_const, k_const, beta_const, limits, eps)
        energy = HopfieldHeadsEnergy(k, beta=beta, mask=allowed)
        problem, flat, unravel = flatten_problem(MinimiseProblem, energy, xi, None)
        xi = unravel(implicit_value(flat, problem, None))
        return jax.vmap(association)(xi, k, beta), steps

    # --------------------------------------------------------------------------- public

    def __call__(
        self,
        input: Input,
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " stored"] | None = None,
        association_mask: Bool[ArrayLike, "state_len stored"] | None = None,
        mask: Bool[ArrayLike, "state_len stored"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "state_len output_size"]:
        """**Arguments:**

        - `input`: one array `(seq, input_size)` used as stored patterns, state patterns and
          pattern projection, or the tuple `(stored_pattern, state_pattern,
          pattern_projection)` of shapes `(stored, stored_pattern_size)`, `(state_len,
          input_size)` and `(stored, pattern_projection_size)`.
        - `stored_pattern_padding_mask`: optional boolean `(stored,)`, **`True` = masked
          out** (hopfield-layers' name and meaning).
        - `association_mask`: optional boolean `(state_len, stored)`, **`True` = masked out**
          (hopfield-layers' name and meaning).
        - `mask`: optional boolean `(state_len, stored)`, **`True` = may attend** (the
          convention of every other energyattn layer). All given masks are combined; a
          state pattern with nothing left to attend to gets a zero association row (no NaN).
        - `key`: PRNG key for dropout (needed when `dropout > 0` outside inference mode).

        **Returns:**

        The output, shape `(state_len, output_size)`.
        """
        association, v = self._associate(input, stored_pattern_padding_mask, association_mask, mask)
        association = self.dropout(association, key=key)
        out = rearrange(jnp.einsum("hls,hsp->hlp", association, v), "h l p -> l (h p)")
        out = _rows(self.out_proj, out)
        if self.association_activation is not None:
            out = self.association_activation(out)
        return out

    def _prepare(self, input, padding, association_mask, mask):
        """Queries, keys and values of every head, and the combined mask."""
        stored, state, projection = self._inputs(input)
        q, k, v = self._project(stored, state, projection)
        allowed = self._allowed(state.shape[0], stored.shape[0], mask, padding, association_mask)
        return q, k, v, allowed

    def _associate(self, input, padding, association_mask, mask):
        q, k, v, allowed = self._prepare(input, padding, association_mask, mask)
        association, _ = self._retrieve(q, k, allowed)
        return association, v

    def association_matrix(
        self,
        input: Input,
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " stored"] | None = None,
        association_mask: Bool[ArrayLike, "state_len stored"] | None = None,
        mask: Bool[ArrayLike, "state_len stored"] | None = None,
    ) -> Float[Array, "heads state_len stored"]:
        """The final association matrix of every head (before dropout): hopfield-layers'
        `get_association_matrix`. Arguments as for the call; appended patterns
        (`concat_bias_pattern`, `add_zero_association`) are its last columns."""
        association, _ = self._associate(input, stored_pattern_padding_mask, association_mask, mask)
        return association

    def num_updates(
        self,
        input: Input,
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " stored"] | None = None,
        association_mask: Bool[ArrayLike, "state_len stored"] | None = None,
        mask: Bool[ArrayLike, "state_len stored"] | None = None,
    ) -> Int[Array, " heads"]:
        """How many state updates each head made before it stopped (0 to
        `update_steps_max`). Arguments as for the call."""
        q, k, _, allowed = self._prepare(input, stored_pattern_padding_mask, association_mask, mask)
        return self._retrieve(q, k, allowed)[1]

    def energy(
        self,
        input: Input,
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " stored"] | None = None,
        association_mask: Bool[ArrayLike, "state_len stored"] | None = None,
        mask: Bool[ArrayLike, "state_len stored"] | None = None,
    ) -> tuple[HopfieldHeadsEnergy, Float[Array, "heads state_len hidden_size"]]:
        """The energy this layer descends on `input`, and the state it starts from.

        **Returns:**

        `(energy, state)`: a [`HopfieldHeadsEnergy`][energyattn.nn.HopfieldHeadsEnergy] of
        the projected stored patterns, and the projected state patterns
        `(heads, state_len, hidden_size)`. `ea.descend(energy, state, step_size=1.0,
        num_steps=T)` makes the layer's $T$ updates; `ea.minimise` finds the fixed point.
        """
        q, k, _, allowed = self._prepare(input, stored_pattern_padding_mask, association_mask, mask)
        return HopfieldHeadsEnergy(k, beta=self.scaling, mask=allowed), q

    # ------------------------------------------------------------------ PyTorch weights

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, ArrayLike], *, dtype: Any = None, **config: Any
    ) -> "Hopfield":
        """A layer with the weights of a hopfield-layers `Hopfield`.

        **Arguments:**

        - `state`: its `state_dict()`, a mapping from the PyTorch parameter names (e.g.
          `association_core.in_proj_weight`, `norm_state_pattern.bias`) to arrays (NumPy,
          JAX, or anything `jnp.asarray` takes; JAX arrays are used as they are, so
          gradients with respect to them flow through the layer).
        - `config`: the hopfield-layers constructor arguments (`input_size=...,
          num_heads=..., scaling=..., update_steps_max=...`).
        - `dtype`: the parameter dtype (default: that of the arrays).

        **Returns:**

        A `Hopfield` whose outputs and gradients equal hopfield-layers' (see the guide for
        the few documented exceptions).
        """
        return load_state_dict(cls, state, config, dtype, prefix="")

    def to_state_dict(self) -> dict[str, Array]:
        """The parameters under hopfield-layers' `state_dict()` names (the inverse of
        [`from_state_dict`][energyattn.nn.Hopfield.from_state_dict])."""
        return hopfield_state_dict(self, "")


# ------------------------------------------------------------------ pooling and lookup


class HopfieldPooling(eqx.Module):
    r"""Hopfield pooling: `quantity` learned state patterns retrieve from the input.

    $$Z = \mathrm{Hopfield}\big((Y, R_{\text{learned}}, P)\big) \in
      \mathbb{R}^{\text{quantity}\times\text{output\_size}},\qquad\text{flattened},$$

    with $Y = P =$ `input` (or the pair `(stored_pattern, pattern_projection)`). A set of
    any size is pooled into `quantity * output_size` features; each learned query descends
    the log-sum-exp energy of the set. Arguments as [`Hopfield`][energyattn.nn.Hopfield]
    (with `update_steps_max=0` by default), plus:

    - `quantity`: number of learned state patterns.
    - `trainable`: learn them (default `True`; when `False` they receive no gradient).

    ??? cite "Source"

        H. Ramsauer et al., *Hopfield Networks is All You Need* (ICLR 2021), layer
        `HopfieldPooling`; github.com/ml-jku/hopfield-layers.
    """

    hopfield: Hopfield
    pooling_weights: Float[Array, "quantity dim"]
    trainable: bool = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        *args: Any,
        quantity: int = 1,
        trainable: bool = True,
        key: PRNGKeyArray,
        **kwargs: Any,
    ):
        kh, kp = jr.split(key)
        self.hopfield = Hopfield(input_size, *args, key=kh, **kwargs)
        size = self.hopfield.hidden_size if self.hopfield.query_proj is None else input_size
        quantity = positive_int("quantity", quantity)
        self.pooling_weights = _normal(kp, (quantity, size), self.hopfield.dtype)
        self.trainable = bool(trainable)

    def _input(self, input: Any) -> tuple[Array, Array, Array]:
        if isinstance(input, tuple | list):
            if len(input) != 2:
                raise ValueError(
                    "HopfieldPooling takes one (seq, input_size) array or the pair "
                    f"(stored_pattern, pattern_projection), got a sequence of {len(input)}"
                )
            stored, projection = input
        else:
            stored = projection = input
        weights = self.pooling_weights
        return stored, weights if self.trainable else jax.lax.stop_gradient(weights), projection

    def __call__(
        self,
        input: Float[ArrayLike, "seq dim"] | tuple[ArrayLike, ArrayLike],
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " stored"] | None = None,
        association_mask: Bool[ArrayLike, "quantity stored"] | None = None,
        mask: Bool[ArrayLike, "quantity stored"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " quantity_times_output"]:
        """The pooled features, shape `(quantity * output_size,)` (pattern-major, as
        hopfield-layers' flatten). Masks and `key` as for [`Hopfield`][energyattn.nn.Hopfield]."""
        out = self.hopfield(
            self._input(input),
            stored_pattern_padding_mask=stored_pattern_padding_mask,
            association_mask=association_mask,
            mask=mask,
            key=key,
        )
        return out.reshape(-1)

    def association_matrix(self, input: Any, **masks: Any) -> Float[Array, "heads quantity stored"]:
        """The final association matrix of every head, as `Hopfield.association_matrix`."""
        return self.hopfield.association_matrix(self._input(input), **masks)

    def energy(self, input: Any, **masks: Any) -> tuple[HopfieldHeadsEnergy, Array]:
        """The energy the learned queries descend and their start, as `Hopfield.energy`."""
        return self.hopfield.energy(self._input(input), **masks)

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, ArrayLike], *, dtype: Any = None, **config: Any
    ) -> "HopfieldPooling":
        """A layer with the weights of a hopfield-layers `HopfieldPooling` (`pooling_weights`
        and the `hopfield.*` parameters); arguments as `Hopfield.from_state_dict`."""
        return load_state_dict(
            cls, state, config, dtype, prefix="hopfield.", patterns=("pooling_weights",)
        )

    def to_state_dict(self) -> dict[str, Array]:
        """The parameters under hopfield-layers' names."""
        return {
            "pooling_weights": self.pooling_weights[None],
            **hopfield_state_dict(self.hopfield, "hopfield."),
        }


class HopfieldLayer(eqx.Module):
    r"""A Hopfield lookup layer: the input's state patterns retrieve from `quantity` learned
    stored patterns.

    $$Z = \mathrm{Hopfield}\big((Y_{\text{learned}}, R, P_{\text{learned}})\big),\qquad
      R = \texttt{input},$$

    with $P = Y$ (`lookup_weights`), or separate learned targets (`target_weights`) when
    `lookup_weights_as_separated`. Both pass through the stored-pattern and projection
    layer norms. Arguments as [`Hopfield`][energyattn.nn.Hopfield], plus:

    - `quantity`: number of learned stored patterns.
    - `trainable`: learn them (default `True`).
    - `lookup_weights_as_separated`: separate learned targets as the pattern projection.
    - `lookup_targets_as_trainable`: learn the targets (default `True`).

    ??? cite "Source"

        H. Ramsauer et al., *Hopfield Networks is All You Need* (ICLR 2021), layer
        `HopfieldLayer`; github.com/ml-jku/hopfield-layers.
    """

    hopfield: Hopfield
    lookup_weights: Float[Array, "quantity dim"]
    target_weights: Float[Array, "quantity dim"] | None
    trainable: bool = eqx.field(static=True)
    lookup_targets_as_trainable: bool = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        *args: Any,
        quantity: int = 1,
        trainable: bool = True,
        lookup_weights_as_separated: bool = False,
        lookup_targets_as_trainable: bool = True,
        key: PRNGKeyArray,
        **kwargs: Any,
    ):
        kh, kl, kt = jr.split(key, 3)
        self.hopfield = hop = Hopfield(input_size, *args, key=kh, **kwargs)
        quantity = positive_int("quantity", quantity)
        size = hop.hidden_size if hop.key_proj is None else hop.stored_pattern_size
        dtype = hop.dtype
        self.lookup_weights = _normal(kl, (quantity, size), dtype)
        self.target_weights = None
        if lookup_weights_as_separated:
            self.target_weights = _normal(kt, (quantity, hop.pattern_projection_size), dtype)
        elif hop.pattern_projection_size != size:
            raise ValueError(
                f"without lookup_weights_as_separated the stored patterns (size {size}) are "
                f"also the pattern projection, whose size is {hop.pattern_projection_size}"
            )
        self.trainable = bool(trainable)
        self.lookup_targets_as_trainable = bool(lookup_targets_as_trainable)

    def _input(self, input: Any) -> tuple[Array, Any, Array]:
        stored = self.lookup_weights
        if not self.trainable:
            stored = jax.lax.stop_gradient(stored)
        projection = stored
        if self.target_weights is not None:
            projection = self.target_weights
            if not self.lookup_targets_as_trainable:
                projection = jax.lax.stop_gradient(projection)
        return stored, input, projection

    def __call__(
        self,
        input: Float[ArrayLike, "seq input_size"],
        *,
        stored_pattern_padding_mask: Bool[ArrayLike, " quantity"] | None = None,
        association_mask: Bool[ArrayLike, "seq quantity"] | None = None,
        mask: Bool[ArrayLike, "seq quantity"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq output_size"]:
        """The retrieved patterns, shape `(seq, output_size)`. Masks and `key` as for
        [`Hopfield`][energyattn.nn.Hopfield]."""
        return self.hopfield(
            self._input(input),
            stored_pattern_padding_mask=stored_pattern_padding_mask,
            association_mask=association_mask,
            mask=mask,
            key=key,
        )

    def association_matrix(self, input: Any, **masks: Any) -> Float[Array, "heads seq quantity"]:
        """The final association matrix of every head, as `Hopfield.association_matrix`."""
        return self.hopfield.association_matrix(self._input(input), **masks)

    def energy(self, input: Any, **masks: Any) -> tuple[HopfieldHeadsEnergy, Array]:
        """The energy the input's state patterns descend and their start, as
        `Hopfield.energy`."""
        return self.hopfield.energy(self._input(input), **masks)

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, ArrayLike], *, dtype: Any = None, **config: Any
    ) -> "HopfieldLayer":
        """A layer with the weights of a hopfield-layers `HopfieldLayer` (`lookup_weights`,
        `target_weights` and the `hopfield.*` parameters); arguments as
        `Hopfield.from_state_dict`."""
        patterns: tuple[str, ...] = ("lookup_weights",)
        if config.get("lookup_weights_as_separated", False):
            patterns += ("target_weights",)
        return load_state_dict(cls, state, config, dtype, prefix="hopfield.", patterns=patterns)

    def to_state_dict(self) -> dict[str, Array]:
        """The parameters under hopfield-layers' names."""
        out = {"lookup_weights": self.lookup_weights[None]}
        if self.target_weights is not None:
            out["target_weights"] = self.target_weights[None]
        return {**out, **hopfield_state_dict(self.hopfield, "hopfield.")}
