r"""The blockwise log-sum-exp's derivatives: forward mode first, reverse mode by transposition,
any order, O(seq) memory.

The forward pass (`attention_forward`, a `jax.custom_jvp`) returns the log-sum-exp and the
attention output $o_i = \sum_j p_{ij} k_j$. With the scores' tangent
$\dot s_{ij} = a_i\cdot k_j + \beta q_i\cdot\dot k_j$, $a_i = \beta\dot q_i + \dot\beta q_i$,

$$\dot{\operatorname{lse}}_i = \sum_j p_{ij}\dot s_{ij}
  = a_i\cdot o_i + \beta\, q_i\cdot r_i,\qquad r_i = \sum_j p_{ij}\dot k_j,$$

$$\dot o_i = r_i + \sum_j p_{ij}\,\dot s_{ij}\, k_j - \dot{\operatorname{lse}}_i\, o_i .$$

$r$ and $\sum_j p_{ij}\dot s_{ij}k_j$ are *terms* (`_blocks.py`): sums over the probabilities
weighted by bilinear factors, computed blockwise in one pass by the primitive `terms_p`.
Everything else is elementwise JAX, which JAX differentiates and transposes itself.

`terms_p` is linear in its arrays (each term in exactly one of them) and has its own rules:

- **JVP**: the probabilities' tangent $\dot p_{ij} = p_{ij}(\dot s_{ij} -
  \dot{\operatorname{lse}}_i)$ adds a factor $\dot s$ to a term (or scales it by
  $\dot{\operatorname{lse}}_i$), and an array's tangent replaces the array: more terms.
- **Transpose**: a term's cotangent $C$ pairs with its values $X$ into a new factor
  $(C, X)$, and the array the term was linear in becomes the values of a row or column term:
  more terms, in one pass.

So reverse mode is JAX transposing the forward-mode rule, every pass that appears in a
tangent or a transpose is again a `terms_p` with the same rules, and the residuals of every
order are the inputs of the passes: O(seq) arrays, never a `(seq, mem)` matrix. The
primitive is batched by `equinox.internal.create_vprim` (as lineax's linear solve is), which
vmaps these rules; a vmap over heads runs head by head on a CPU (`_passes._in_turn`).
"""

import functools as ft

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad
from jax.sharding import PartitionSpec

from ._blocks import Term, array_roles
from ._passes import Config, run_forward, run_terms


class _Arrays:
    """The arrays of a pass being built: each added once (by identity), by index."""

    def __init__(self):
        self.arrays: list = []
        self._index: dict[int, int] = {}

    def add(self, x) -> int:
        if id(x) not in self._index:
            self._index[id(x)] = len(self.arrays)
            self.arrays.append(x)
        return self._index[id(x)]


def _rowdot(a, b):
    return jnp.einsum("sd,sd->s", a, b)


def _add(x, y):
    return y if x is None else x + y


# -------------------------------------------------------------------------- the primitive


def _terms_impl(q, k, beta, lse, mask, arrays, terms, config):
    return run_terms(q, k, beta, lse, mask, arrays, terms, config)


def _terms_abstract_eval(q, k, beta, lse, mask, arrays, terms, config):
    return tuple(
        _rows_like(q if term.row else k, arrays[term.value].shape[1], beta.dtype) for term in terms
    )


def _rows_like(aval, width, dtype):
    """The abstract value of `(len(aval), width)` rows split like `aval`'s rows (their
    sharding is part of the type when a mesh axis is `Explicit`)."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        sharding = sharding.update(spec=PartitionSpec(spec[0] if len(spec) else None, None))
        return aval.update(shape=(aval.shape[0], width), dtype=dtype, sharding=sharding)
    return aval.update(shape=(aval.shape[0], width), dtype=dtype)


def attention_terms(q, k, beta, lse, mask, arrays, terms, config):
    """The terms (`_blocks.Term`) over the probabilities given by `(q, k, beta, lse, mask)`,
    one output per term, as the differentiable primitive `terms_p`."""
    if not terms:
        return ()
    args = (q, k, beta, lse, mask, tuple(arrays), tuple(terms), config)
    return eqxi.filter_primitive_bind(terms_p, *args)


@eqxi.filter_primitive_jvp
def _terms_jvp(primals, tangents):
    q, k, beta, lse, mask, arrays, terms, config = primals
    t_q, t_k, t_beta, t_lse, _, t_arrays, _, _ = tangents
    out = attention_terms(q, k, beta, lse, mask, arrays, terms, config)
    acc = beta.dtype
    new = _Arrays()
    index = [new.add(x) for x in arrays]
    tangent = [None if t is None else new.add(t) for t in t_arrays]
    # The scores' tangent as one factor: a_i . k_j + beta q_i . k'_j.
    score_pairs = []
    a = _query_tangent(q, beta, t_q, t_beta)
    if a is not None:
        score_pairs.append((new.add(a), new.add(k)))
    if t_k is not None:
        score_pairs.append((new.add(beta * q.astype(acc)), new.add(t_k)))
    score = tuple(score_pairs)

    t_terms, owner = [], []
    for t, term in enumerate(terms):
        factors = tuple(tuple((index[a], index[b]) for a, b in f) for f in term.factors)
        if score:
            t_terms.append(Term(term.row, factors + (score,), index[term.value]))
            owner.append(t)
        for f, factor in enumerate(term.factors):
            pairs = []
            for a, b in factor:
                if tangent[a] is not None:
                    pairs.append((tangent[a], index[b]))
                if tangent[b] is not None:
                    pairs.append((index[a], tangent[b]))
            if pairs:
                changed = factors[:f] + (tuple(pairs),) + factors[f + 1 :]
                t_terms.append(Term(term.row, changed, index[term.value]))
                owner.append(t)
        values = t_arrays[term.value]
        if not term.row and t_lse is not None:
            # Column terms sum over the rows: -lse'_i enters as a scaling of the values.
            shifted = -t_lse[:, None] * arrays[term.value].astype(acc)
            values = shifted if values is None else values.astype(acc) + shifted
        if values is not None:
            t_terms.append(Term(term.row, factors, new.add(values)))
            owner.append(t)

    t_out = [None] * len(terms)
    results = attention_terms(q, k, beta, lse, mask, new.arrays, t_terms, config)
    for t, result in zip(owner, results, strict=True):
        t_out[t] = _add(t_out[t], result)
    if t_lse is not None:
        # Row terms: -lse'_i scales the row's whole sum.
        for t, term in enumerate(terms):
            if term.row:
                t_out[t] = _add(t_out[t], -t_lse[:, None] * out[t])
    return out, tuple(t_out)


@eqxi.filter_primitive_transpose
def _terms_transpose(inputs, cts_out):
    q, k, beta, lse, mask, arrays, terms, config = inputs
    for name, x in (("queries", q), ("keys", k), ("beta", beta), ("log-sum-exp", lse)):
        if isinstance(x, ad.UndefinedPrimal):
            raise NotImplementedError(f"the attention terms are not linear in the {name}")
    undefined = [isinstance(x, ad.UndefinedPrimal) for x in arrays]
    new = _Arrays()
    index = [None if u else new.add(x) for x, u in zip(arrays, undefined, strict=True)]

    def defined(f):
        return tuple((index[a], index[b]) for a, b in f)

    t_terms, dest = [], []
    for term, ct in zip(terms, cts_out, strict=True):
        if ct is None:
            continue
        linear = [f for f, factor in enumerate(term.factors) if _undefined_in(factor, undefined)]
        slots = len(linear) + undefined[term.value]
        if slots == 0:
            continue
        if slots > 1:
            raise NotImplementedError("an attention term is not linear in its arrays")
        c = new.add(ct)
        if undefined[term.value]:
            # sum_j w_ij X_j transposes to sum_i w_ij C_i, and back.
            factors = tuple(defined(f) for f in term.factors)
            t_terms.append(Term(not term.row, factors, c))
            dest.append(term.value)
            continue
        (f,) = linear
        others = tuple(defined(g) for i, g in enumerate(term.factors) if i != f)
        x = index[term.value]
        # <C, term> pairs the cotangent with the values: a factor (per query, per key).
        paired = others + ((((c, x),) if term.row else ((x, c),)),)
        for a, b in term.factors[f]:
            if undefined[a] == undefined[b]:
                raise NotImplementedError("an attention term's factor is not linear")
            if undefined[a]:
                t_terms.append(Term(True, paired, index[b]))
                dest.append(a)
            else:
                t_terms.append(Term(False, paired, index[a]))
                dest.append(b)

    cts = [None] * len(arrays)
    results = attention_terms(q, k, beta, lse, mask, new.arrays, t_terms, config)
    for i, result in zip(dest, results, strict=True):
        cts[i] = _add(cts[i], result)
    # Every undefined array gets a cotangent, zeros where no term reached it. The zeros are
    # rows of the queries' or the keys' (so that a split sequence stays split: Equinox's
    # vmap of this rule drops the abstract values' shardings).
    per_query, _ = array_roles(terms)
    cts = tuple(
        None
        if not u
        else c.astype(x.aval.dtype)
        if c is not None
        else _zero_rows(lse if i in per_query else k[:, 0], x.aval.shape[1], x.aval.dtype)
        for i, (c, x, u) in enumerate(zip(cts, arrays, undefined, strict=True))
    )
    nothing = jax.tree.map(lambda _: None, (q, k, beta, lse, mask))
    static = jax.tree.map(lambda _: None, (terms, config))
    return (*nothing, cts, *static)


def _zero_rows(like, width, dtype):
    """Zeros of shape `(len(like), width)`, split like `like`."""
    return jnp.broadcast_to(jnp.zeros_like(like, dtype)[:, None], (like.shape[0], width))


def _undefined_in(factor, undefined):
    return any(undefined[a] or undefined[b] for a, b in factor)


terms_p = eqxi.create_vprim(
    "attention_terms",
    eqxi.filter_primitive_def(_terms_impl),
    eqxi.filter_primitive_def(_terms_abstract_eval),
    _terms_jvp,
    _terms_transpose,
)


# ------------------------------------------------------------------------ the forward pass


def _query_tangent(q, beta, t_q, t_beta):
    r"""$a = \beta\dot q + \dot\beta q$ (or `None` when both tangents are zero): the scores'
    tangent from the queries and the inverse temperature, $a_i\cdot k_j$."""
    acc = beta.dtype
    a = None
    if t_q is not None:
        a = beta * t_q.astype(acc)
    if t_beta is not None:
        a = _add(a, t_beta * q.astype(acc))
    return a


@ft.partial(jax.custom_jvp, nondiff_argnums=(4,))
def attention_forward(q, k, beta, mask, config: Config):
    r"""The log-sum-exp rows and the attention output $o_i = \sum_j p_{ij} k_j$, one online
    pass over blocks of keys; differentiable in both modes to any order (module docstring)."""
    return run_forward(q, k, beta, mask, config)


@ft.partial(attention_forward.defjvp, symbolic_zeros=True)
def _forward_jvp(config, primals, tangents):
    q, k, beta, mask = primals
    t_q, t_k, t_beta, _ = (None if isinstance(t, SymbolicZero) else t for t in tangents)
    # Re-enter for the primal: an outer derivative of this rule differentiates it again.
    lse, out = attention_forward(q, k, beta, mask, config)
    a = _query_tangent(q, beta, t_q, t_beta)
    if a is None and t_k is None:
        return (lse, out), (jnp.zeros_like(lse), jnp.zeros_like(out))
    acc = beta.dtype
    arrays = _Arrays()
    score = []
    if a is not None:
        score.append((arrays.add(a), arrays.add(k)))
    if t_k is not None:
        bq = beta * q.astype(acc)
        score.append((arrays.add(bq), arrays.add(t_k)))
    terms = [Term(True, (tuple(score),), arrays.add(k))]  # sum_j p_ij s'_ij k_j
    if t_k is not None:
        terms.append(Term(True, (), arrays.add(t_k)))  # r_i = sum_j p_ij k'_j
    weighted, *r = attention_terms(q, k, beta, lse, mask, arrays.arrays, terms, config)
    t_lse = None if a is None else _rowdot(a, out)
    if r:
        t_lse = _add(t_lse, _rowdot(bq, r[0]))
    t_out = weighted - t_lse[:, None] * out
    if r:
        t_out = t_out + r[0]
    return (lse, out), (t_lse, t_out)
