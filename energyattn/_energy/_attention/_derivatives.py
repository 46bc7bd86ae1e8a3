r"""The blockwise log-sum-exp's derivatives: forward mode first, reverse mode by transposition,
any order, O(seq) memory.

The forward pass (`attention_forward`, the primitive `forward_p`, with a JVP rule and no
transpose) returns the log-sum-exp and the attention output $o_i = \sum_j p_{ij} k_j$. With
the scores' tangent $\dot s_{ij} = a_i\cdot k_j + \beta q_i\cdot\dot k_j$,
$a_i = \beta\dot q_i + \dot\beta q_i$,

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
primitives are batched by `_vprim.create_vprim` (Equinox's design, on primitives of our own),
which vmaps these rules; a vmap over heads runs head by head on a CPU when the blocks are large
(`_passes._in_turn`). They are primitives rather than `jax.custom_jvp`s because JAX then
never looks inside their implementations (the head loop is a `custom_vmap`, which partial
evaluation inside `lax.scan` rejects), and because a primitive can drop unused terms
(`_dce`, batched or not).

`jax.jvp` takes a fused pass (`forward_terms_p`): the forward and the tangent's row terms
in one online pass, with one set of exponentials. There the log-sum-exp's tangent is a term
too, $\sum_j p_{ij}\dot s_{ij}$ (the values `ONES`), so that a JVP of the log-sum-exp alone
drops $r$ and the output's tangent: it holds no attention-sized tangent.

`jax.linearize` and reverse mode take the forward and a terms pass apart
(`_forward_unfused_jvp`, a linearization rule), so that the primal stays known; under an
outer derivative the unfused pair is used too, so the fused primitive is never
differentiated in practice (its JVP is its unfused equal's). Where JAX partially evaluates a
JVP it traced earlier (linearizing a `jit`, a `jax.checkpoint` or a `custom_jvp` that holds
one), the fused pass becomes its unfused pair again (its partial-evaluation rules), so that
its primal outputs stay known.
"""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.interpreters import ad, batching, partial_eval as pe
from jax.sharding import PartitionSpec

from ... import _internals
from ..._mask import SegmentIds
from ..._vprim import create_vprim, def_dce, vprim_batch, vprim_p
from ._blocks import (
    KEYS,
    ONES,
    SCALED_KEYS,
    SCALED_QUERIES,
    SPECIAL,
    Term,
    array_roles,
    value_widths,
)
from ._passes import Config, run_forward, run_terms

closed_call_p = jex.primitives.closed_call_p


class _Arrays:
    r"""The arrays of a pass being built, by index: each added once per role (by identity),
    one row per query or one per key (`per_key`), since a pass reads each of its arrays one
    way (an array used both ways, as the queries' tangent where the keys are the queries, is
    passed twice). The keys themselves, per key, are not an operand but the index `KEYS` (so
    that the ring sends them once), and $\beta q$ and $\beta k$ are `SCALED_QUERIES` and
    `SCALED_KEYS` (formed in each pass)."""

    def __init__(self, keys):
        self.keys = keys
        self.arrays: list = []
        self._index: dict[tuple[int, bool], int] = {}

    def add(self, x, per_key: bool) -> int:
        if per_key and x is self.keys:
            return KEYS
        if (id(x), per_key) not in self._index:
            self._index[id(x), per_key] = len(self.arrays)
            self.arrays.append(x)
        return self._index[id(x), per_key]


def _rowdot(a, b):
    return jnp.einsum("sd,sd->s", a, b)


def _add(x, y):
    return y if x is None else x + y


def _scaled_rows(scale, i, arrays, q, beta):
    r"""The per-query values `i` of a column term (`SCALED_QUERIES`: $\beta q$, formed here)
    scaled row by row by `scale`, `(seq, 1)`, in the accumulation dtype."""
    acc = beta.dtype
    rows = beta * q.astype(acc) if i == SCALED_QUERIES else jnp.asarray(arrays[i]).astype(acc)
    return scale.astype(acc) * rows


# -------------------------------------------------------------------------- the primitive
#
# The primitive's operands are flat: `q, k, beta, lse, [mask,] *arrays`, with the terms, the
# configuration and whether there is a mask as static parameters. Operands may reach the
# rules as Python scalars (JAX inlines scalar constants as literals), hence `jnp.asarray`.


def _mask_leaves(mask) -> tuple:
    """A mask's operands: none, the dense mask, or the query and key segment ids."""
    if mask is None:
        return ()
    return (mask.query, mask.keys) if isinstance(mask, SegmentIds) else (mask,)


def _mask_kind(mask) -> str | None:
    """The static kind of a mask: `None`, `"dense"` or `"segments"`."""
    if mask is None:
        return None
    return "segments" if isinstance(mask, SegmentIds) else "dense"


def _mask_size(mask_kind) -> int:
    return {None: 0, "dense": 1, "segments": 2}[mask_kind]


def _split_mask(rest, mask_kind):
    """`(mask, rest)`: the mask rebuilt from the first operands of `rest`, and the others."""
    n = _mask_size(mask_kind)
    leaves, rest = tuple(rest[:n]), tuple(rest[n:])
    if mask_kind is None:
        return None, rest
    return (SegmentIds(*leaves) if mask_kind == "segments" else leaves[0]), rest


def _operands(args, mask_kind):
    q, k, beta, lse, *rest = (jnp.asarray(a) for a in args)
    mask, arrays = _split_mask(rest, mask_kind)
    return q, k, beta, lse, mask, arrays


def _terms_impl(*args, terms, config, mask_kind):
    q, k, beta, lse, mask, arrays = _operands(args, mask_kind)
    return run_terms(q, k, beta, lse, mask, arrays, terms, config)


def _terms_abstract_eval(*avals, terms, config, mask_kind):
    q, k, beta, _, *rest = avals
    widths = value_widths(dict(enumerate(rest[_mask_size(mask_kind) :])), k.shape[1])
    return [_rows_like(q if term.row else k, widths[term.value], beta.dtype) for term in terms]


def _rows_like(aval, width, dtype):
    """The abstract value of `(len(aval), width)` rows (`(len(aval),)` for `width=None`)
    split like `aval`'s rows (their sharding is part of the type when a mesh axis is
    `Explicit`)."""
    shape = (aval.shape[0],) if width is None else (aval.shape[0], width)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        split = PartitionSpec(spec[0] if len(spec) else None, *([None] * (len(shape) - 1)))
        return aval.update(shape=shape, dtype=dtype, sharding=sharding.update(spec=split))
    return aval.update(shape=shape, dtype=dtype)


def attention_terms(q, k, beta, lse, mask, arrays, terms, config):
    """The terms (`_blocks.Term`) over the probabilities given by `(q, k, beta, lse, mask)`,
    one output per term, as the differentiable primitive `terms_p`."""
    if not terms:
        return ()
    flat = (q, k, beta, lse, *_mask_leaves(mask), *arrays)
    params = dict(terms=tuple(terms), config=config, mask_kind=_mask_kind(mask))
    return tuple(terms_p.bind(*flat, **params))


def _terms_jvp(primals, tangents, *, terms, config, mask_kind):
    q, k, beta, lse, mask, arrays = _operands(primals, mask_kind)
    tangents = [None if type(t) is ad.Zero else t for t in tangents]
    t_q, t_k, t_beta, t_lse, *t_rest = tangents
    t_arrays = t_rest[_mask_size(mask_kind) :]
    out = attention_terms(q, k, beta, lse, mask, arrays, terms, config)
    acc = beta.dtype
    a = _scaled_tangent(q, beta, t_q, t_beta)  # also the tangent of beta q
    arrays = {**dict(enumerate(arrays)), KEYS: k, SCALED_QUERIES: None, SCALED_KEYS: None}
    t_arrays = {**dict(enumerate(t_arrays)), KEYS: t_k, SCALED_QUERIES: a, ONES: None}
    keyed = array_roles(terms)[1]  # (every index a term reads per key)
    if SCALED_KEYS in keyed:
        t_arrays[SCALED_KEYS] = _scaled_tangent(k, beta, t_k, t_beta)
    new = _Arrays(k)
    index = {i: new.add(x, i in keyed) for i, x in arrays.items() if i >= 0}
    index.update({i: i for i in SPECIAL})

    def tangent(i):  # added to the pass where a term uses it
        t = t_arrays.get(i)
        return None if t is None else new.add(t, i in keyed)

    # The scores' tangent as one factor: a_i . k_j + beta q_i . k'_j.
    score_pairs = [_query_pair(t_q, t_beta, a, new.add)] if a is not None else []
    if t_k is not None:
        score_pairs.append((SCALED_QUERIES, new.add(t_k, True)))
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
                if (t_a := tangent(a)) is not None:
                    pairs.append((t_a, index[b]))
                if (t_b := tangent(b)) is not None:
                    pairs.append((index[a], t_b))
            if pairs:
                changed = factors[:f] + (tuple(pairs),) + factors[f + 1 :]
                t_terms.append(Term(term.row, changed, index[term.value]))
                owner.append(t)
        values = t_arrays[term.value]
        if not term.row and t_lse is not None:
            # Column terms sum over the rows: -lse'_i enters as a scaling of the values.
            shifted = _scaled_rows(-t_lse[:, None], term.value, arrays, q, beta)
            values = shifted if values is None else values.astype(acc) + shifted
        if values is not None:
            t_terms.append(Term(term.row, factors, new.add(values, term.row)))
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
    t_out = [jnp.zeros_like(o) if t is None else t for o, t in zip(out, t_out, strict=True)]
    return list(out), t_out


def _terms_transpose(cts_out, *args, terms, config, mask_kind):
    q, k, beta, lse, *rest = args
    for name, x in (("queries", q), ("keys", k), ("beta", beta), ("log-sum-exp", lse)):
        if isinstance(x, ad.UndefinedPrimal):
            raise NotImplementedError(f"the attention terms are not linear in the {name}")
    q, k, beta, lse = (jnp.asarray(x) for x in (q, k, beta, lse))
    n = _mask_size(mask_kind)
    mask, _ = _split_mask([jnp.asarray(x) for x in rest[:n]], mask_kind)
    arrays = rest[n:]
    undefined = {i: isinstance(x, ad.UndefinedPrimal) for i, x in enumerate(arrays)}
    undefined.update(dict.fromkeys(SPECIAL, False))
    keyed = array_roles(terms)[1]
    new = _Arrays(k)
    index = {
        i: None if undefined[i] else new.add(jnp.asarray(x), i in keyed)
        for i, x in enumerate(arrays)
    }
    index.update({i: i for i in SPECIAL})

    def defined(f):
        return tuple((index[a], index[b]) for a, b in f)

    t_terms, dest, scales = [], [], []  # (scales: of the results' rows, or None)
    for term, ct in zip(terms, cts_out, strict=True):
        if type(ct) is ad.Zero or ct is None:
            continue
        linear = [f for f, factor in enumerate(term.factors) if _undefined_in(factor, undefined)]
        slots = len(linear) + undefined[term.value]
        if slots == 0:
            continue
        if slots > 1:
            raise NotImplementedError("an attention term is not linear in its arrays")
        if undefined[term.value]:
            # sum_j w_ij X_j transposes to sum_i w_ij C_i, and back.
            factors = tuple(defined(f) for f in term.factors)
            t_terms.append(Term(not term.row, factors, new.add(ct, not term.row)))
            scales.append(None)
            dest.append(term.value)
            continue
        (f,) = linear
        others = tuple(defined(g) for i, g in enumerate(term.factors) if i != f)
        if term.value == ONES:
            # sum_j w_ij (A_i . B_j): the cotangent c_i scales the rows, the values of B's
            # column term and the sums of A's row term (after the pass).
            paired, scale = others, ct
        else:
            # <C, term> pairs the cotangent with the values: a factor (per query, per key).
            c, x = new.add(ct, not term.row), index[term.value]  # (C: shaped like the term)
            paired, scale = others + ((((c, x),) if term.row else ((x, c),)),), None
        for a, b in term.factors[f]:
            if undefined[a] == undefined[b]:
                raise NotImplementedError("an attention term's factor is not linear")
            if undefined[a]:
                t_terms.append(Term(True, paired, index[b]))
                scales.append(scale)
                dest.append(a)
                continue
            values = index[a]
            if scale is not None:
                values = new.add(_scaled_rows(scale, a, arrays, q, beta), False)
            t_terms.append(Term(False, paired, values))
            scales.append(None)
            dest.append(b)

    cts = [None] * len(arrays)
    results = attention_terms(q, k, beta, lse, mask, new.arrays, t_terms, config)
    for i, scale, result in zip(dest, scales, results, strict=True):
        cts[i] = _add(cts[i], result if scale is None else scale * result)
    # No cotangent (`None`) for what the terms are not linear in, and for an array no term
    # reached: JAX takes it as zero.
    cts = [None if c is None else c.astype(x.aval.dtype) for c, x in zip(cts, arrays, strict=True)]
    return [None] * (len(args) - len(arrays)) + cts


def _undefined_in(factor, undefined):
    return any(undefined[a] or undefined[b] for a, b in factor)


terms_p = create_vprim(
    "attention_terms", _terms_impl, _terms_abstract_eval, _terms_jvp, _terms_transpose
)


# ------------------------------------------------------------------------ the forward pass


def _scaled_tangent(x, beta, t_x, t_beta):
    r"""The tangent of $\beta x$, $\beta\dot x + \dot\beta x$ (or `None` when both tangents
    are zero). For the queries it is $a$, the scores' tangent $a_i\cdot k_j$ from the
    queries and the inverse temperature; for the keys, that of `SCALED_KEYS`."""
    acc = beta.dtype
    t = None
    if t_x is not None:
        t = beta * t_x.astype(acc)
    if t_beta is not None:
        t = _add(t, t_beta * x.astype(acc))
    return t


def _query_pair(t_q, t_beta, a, add):
    r"""The scores' tangent from the queries and beta, $a_i\cdot k_j$, as a bilinear pair
    (`add` gives an array's index): with beta constant, $\dot q_i\cdot(\beta k_j)$, so that
    the tangent of half-precision queries enters the products as it is (one product on
    the matrix units, not the three or six of a float32 copy $\beta\dot q$ split into
    parts, and no such copy in memory)."""
    if t_beta is None:
        return (add(t_q, False), SCALED_KEYS)
    return (add(a, False), KEYS)


def attention_forward(q, k, beta, mask, config: Config):
    r"""The log-sum-exp rows and the attention output $o_i = \sum_j p_{ij} k_j$, one online
    pass over blocks of keys, as the primitive `forward_p`; differentiable in both modes to
    any order (module docstring)."""
    flat = (q, k, beta, *_mask_leaves(mask))
    lse, out = forward_p.bind(*flat, config=config, mask_kind=_mask_kind(mask))
    return lse, out


def _forward_impl(*args, config, mask_kind):
    q, k, beta, *rest = (jnp.asarray(a) for a in args)
    return list(run_forward(q, k, beta, _split_mask(rest, mask_kind)[0], config))


def _forward_abstract_eval(*avals, config, mask_kind):
    q, k, beta = avals[:3]
    return [
        _rows_like(q, None, beta.dtype),
        _rows_like(q, q.shape[1], beta.dtype),
    ]


def _forward_tangent(primals, tangents, config, mask_kind, forward, fused=False):
    r"""The forward pass's primal and tangent outputs. `forward(q, k, beta, mask, arrays,
    terms)` gives `(lse, out, *row_terms)`: the fused pass (`fused`), or the forward pass
    followed by a terms pass (`_unfused`).

    Fused, the log-sum-exp's tangent is a term of the pass, $\sum_j p_{ij}\dot s_{ij}$ (the
    values `ONES`: the weights of $\dot o$'s first term, summed), so that a JVP of the
    log-sum-exp alone keeps no attention-sized tangent ($r$ and $\sum_j p_{ij}\dot s_{ij}
    k_j$, dropped by dead-code elimination). Unfused (linearized, then transposed), it is
    $a_i\cdot o_i + \beta q_i\cdot r_i$, whose transpose reads the output $o$ for the
    queries' cotangent instead of a second product."""
    q, k, beta, *rest = (jnp.asarray(a) for a in primals)
    mask, _ = _split_mask(rest, mask_kind)
    t_q, t_k, t_beta = (None if type(t) is ad.Zero else t for t in tangents[:3])
    a = _scaled_tangent(q, beta, t_q, t_beta)
    if a is None and t_k is None:
        # Re-enter for the primal: an outer derivative of this rule differentiates it again.
        lse, out = attention_forward(q, k, beta, mask, config)
        return [lse, out], [jnp.zeros_like(lse), jnp.zeros_like(out)]
    acc = beta.dtype
    arrays = _Arrays(k)
    score = [] if a is None else [_query_pair(t_q, t_beta, a, arrays.add)]
    if t_k is not None:
        score.append((SCALED_QUERIES, arrays.add(t_k, True)))
    terms = [Term(True, (tuple(score),), KEYS)]  # sum_j p_ij s'_ij k_j
    if fused:
        terms.append(Term(True, (tuple(score),), ONES))  # lse'_i = sum_j p_ij s'_ij
    if t_k is not None:
        terms.append(Term(True, (), arrays.add(t_k, True)))  # r_i = sum_j p_ij k'_j
    lse, out, weighted, *r = forward(q, k, beta, mask, arrays.arrays, tuple(terms))
    if fused:
        t_lse, *r = r
        t_lse = t_lse[:, 0]
    else:
        t_lse = None if a is None else _rowdot(a, out)
        if r:
            t_lse = _add(t_lse, beta * _rowdot(q.astype(acc), r[0]))
    # A batch-only product, not a broadcast: its transpose is then a row dot ("sd,sd->s"),
    # which XLA's CPU backend reduces 6x faster than the broadcast's transpose (a reduction
    # of a 3-d array under `vmap`; 0.35 against 0.05 ms at 1024 queries, 1.7% of a training
    # step: `benchmarks/derivatives.py`).
    t_out = weighted - jnp.einsum("s,sd->sd", t_lse, out)
    if r:
        t_out = t_out + r[0]
    return [lse, out], [t_lse, t_out]


def _forward_jvp(primals, tangents, *, config, mask_kind):
    """`jax.jvp`: one fused pass for the primal and the tangent (one set of exponentials),
    where the pass is on one device; `jax.linearize` and reverse mode take
    `_forward_unfused_jvp` instead, which splits it into the forward and a terms pass."""
    # Fused only where nothing outside differentiates this JVP: under an outer derivative
    # (a JVP inside a linearization, reverse over forward; a third derivative) the fused
    # pass would be differentiated in turn, and under partial evaluation its primal outputs
    # would be as unknown as its tangents. There the unfused pair is the one to transform.
    nested = any(_differentiated(x) for x in (*primals, *tangents))
    # A vmap over the tangents alone (`jax.jacfwd`) wants the primal outputs unbatched.
    primal_axes = set().union(*(_unbatched(x)[0] for x in primals[:3]))
    tangent_only = any(_unbatched(t)[0] - primal_axes for t in tangents)
    if nested or tangent_only or config.ring is not None or config.method == "cudnn":
        return _forward_tangent(primals, tangents, config, mask_kind, _unfused(config))

    def fused(q, k, beta, mask, arrays, terms):
        return attention_forward_terms(q, k, beta, mask, arrays, terms, config)

    return _forward_tangent(primals, tangents, config, mask_kind, fused, fused=True)


_unbatched = _internals.unbatched
_differentiated = _internals.differentiated


def _unfused(config):
    def forward(q, k, beta, mask, arrays, terms):
        # Re-enter for the primal: an outer derivative of this rule differentiates it again.
        lse, out = attention_forward(q, k, beta, mask, config)
        return (lse, out, *attention_terms(q, k, beta, lse, mask, arrays, terms, config))

    return forward


def _forward_unfused_jvp(primals, tangents, *, config, mask_kind):
    return _forward_tangent(primals, tangents, config, mask_kind, _unfused(config))


def _forward_transpose(cts, *args, config, mask_kind):
    raise NotImplementedError("the attention forward pass is not linear")


# The online pass is a primitive, not a custom_jvp: JAX never looks inside it (its impl
# loops over heads through a custom_vmap, which partial evaluation inside `lax.scan` would
# reject), and its batching comes from vmapping the rules, as for `terms_p`.
forward_p = create_vprim(
    "attention_forward", _forward_impl, _forward_abstract_eval, _forward_jvp, _forward_transpose
)


# Linearization (`jax.linearize`, and reverse mode) takes the unfused JVP, so that the primal
# (the forward pass) stays known and only the terms pass is staged into the linear function:
# the fused pass's outputs would all depend on the tangents. JAX's linearization rules
# (`jax_use_direct_linearize`, the default since 0.7) are private (`_internals`); without
# them linearize falls back to the JVP rule under partial evaluation, which the fused pass
# would defeat, so the JVP rule is then the unfused one.
if not _internals.register_linearization(forward_p, _forward_unfused_jvp, "attention_forward"):
    ad.primitive_jvps[forward_p] = _forward_unfused_jvp  # pragma: no cover


# ------------------------------------------------ the fused forward: forward + row terms


def attention_forward_terms(q, k, beta, mask, arrays, terms, config: Config):
    r"""`(lse, out, *row_terms)`: the forward pass and row terms (`terms`, over `arrays` as
    `attention_terms` takes them) in one online pass, as the primitive `forward_terms_p`
    (the JVP's fused pass). Differentiated as its unfused equal, `attention_forward` then
    `attention_terms`."""
    flat = (q, k, beta, *_mask_leaves(mask), *arrays)
    params = dict(terms=tuple(terms), config=config, mask_kind=_mask_kind(mask))
    return tuple(forward_terms_p.bind(*flat, **params))


def _num_primal(mask_kind):
    """How many of the fused pass's operands its log-sum-exp and output read: the queries,
    keys, inverse temperature and mask; the terms' arrays follow."""
    return 3 + _mask_size(mask_kind)


def _fused_operands(args, mask_kind):
    q, k, beta, *rest = (jnp.asarray(a) for a in args)
    mask, arrays = _split_mask(rest, mask_kind)
    return q, k, beta, mask, arrays


def _fused_impl(*args, terms, config, mask_kind):
    q, k, beta, mask, arrays = _fused_operands(args, mask_kind)
    return list(run_forward(q, k, beta, mask, config, arrays, terms))


def _fused_abstract_eval(*avals, terms, config, mask_kind):
    q, k, beta, *rest = avals
    widths = value_widths(dict(enumerate(rest[_mask_size(mask_kind) :])), k.shape[1])
    return [
        *_forward_abstract_eval(q, k, beta, config=config, mask_kind=None),
        *(_rows_like(q, widths[t.value], beta.dtype) for t in terms),
    ]


def _fused_jvp(primals, tangents, *, terms, config, mask_kind):
    """The fused pass's derivative is its unfused equal's (whose JVP is fused again), in the
    operands whose tangents are not zero: a zero made concrete would enter the terms'
    factors as a constant pair, which no transpose can take (the log-sum-exp's tangent term
    has the JVP's own tangents in its factor)."""
    positions = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]

    def unfused(*moving):
        args = list(primals)
        for i, x in zip(positions, moving, strict=True):
            args[i] = x
        q, k, beta, mask, arrays = _fused_operands(args, mask_kind)
        return _unfused(config)(q, k, beta, mask, arrays, terms)

    moving = [primals[i] for i in positions]
    out, t_out = jax.jvp(unfused, moving, [tangents[i] for i in positions])
    return list(out), list(t_out)


def _fused_transpose(cts, *args, terms, config, mask_kind):
    raise NotImplementedError("the fused attention forward pass is not linear")


forward_terms_p = create_vprim(
    "attention_forward_terms", _fused_impl, _fused_abstract_eval, _fused_jvp, _fused_transpose
)


def _fused_batch(axis_size, axis_name, trace_type, vals, dims, *, terms, config, mask_kind):
    """The vprim's batching, except that where only the terms' arrays are batched (a vmap
    over tangents: `jax.jacfwd`), the log-sum-exp and the output are not: they are the
    same in every batch entry, and `jax.jacfwd` requires its primal outputs unbatched."""
    params = dict(terms=terms, config=config, mask_kind=mask_kind)
    out, axes = vprim_batch(forward_terms_p, axis_size, axis_name, trace_type, vals, dims, **params)
    if all(d is None for d in dims[: _num_primal(mask_kind)]) and axes[0] is not None:
        out = [out[0][0], out[1][0], *out[2:]]
        axes = [None, None, *axes[2:]]
    return out, axes


batching.axis_primitive_batchers[forward_terms_p] = _fused_batch


# ----------------------------- partial evaluation: the fused pass splits where it must
#
# The fused pass's log-sum-exp and output depend on the queries, keys, inverse temperature
# and mask alone, but as outputs of one primitive they would be as unknown as its terms
# whenever a terms array is (a tangent). JAX partially evaluates JVPs it traced earlier as
# jaxprs, where the JVP rule could not see it coming: the linearization of a `jax.jit`,
# `jax.checkpoint` or `jax.custom_jvp` (the implicit adjoint's) that holds a `jax.jvp` of
# attention. There the fused equation becomes its unfused equal (forward, then a terms
# pass), whose forward stays known and whose terms pass is linear in the tangents.


def _unfused_jaxpr(avals, params, batching=None):
    """The closed jaxpr of the fused pass's unfused equal over `avals` (flat operands), or
    of its vmap for `vprim_p`'s `batching = (axis_size, axis_name, batch_axes)`."""
    terms, config, mask_kind = params["terms"], params["config"], params["mask_kind"]

    def unfused(*args):
        q, k, beta, mask, arrays = _fused_operands(args, mask_kind)
        return list(_unfused(config)(q, k, beta, mask, arrays, terms))

    if batching is not None:
        size, name, axes = batching
        unfused = jax.vmap(unfused, in_axes=tuple(axes), axis_size=size, axis_name=name)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    return jax.make_jaxpr(unfused)(*shapes)


def _fused_equation(primitive, params):
    """`(params, batching)` when an equation is the fused pass (batched or not), else
    `None`."""
    if primitive is forward_terms_p:
        return params, None
    if primitive is vprim_p and params["prim"] is forward_terms_p:
        axes = (params["axis_size"], params["axis_name"], params["batch_axes"])
        return dict(params["params"]), axes
    return None


def _split_where_unknown(primitive, previous):
    """The partial-evaluation rule (`JaxprTrace`): the unfused equal, traced, where a
    terms array is unknown and the primal operands are known; otherwise `previous` (the
    default: every output known or every output unknown)."""

    def rule(trace, *tracers, **params):
        fused = _fused_equation(primitive, params)
        known = [t.pval.is_known() for t in tracers]
        if fused is None or all(known) or not all(known[: _num_primal(fused[0]["mask_kind"])]):
            if previous is not None:
                return previous(trace, *tracers, **params)
            return trace.default_process_primitive(primitive, tracers, params)
        closed = _unfused_jaxpr([t.aval for t in tracers], *fused)
        return _internals.eval_jaxpr_in(trace, closed, *tracers)

    return rule


def _split_equation(primitive, previous):
    """The jaxpr-level rule (`partial_eval_jaxpr_custom`, as `jax.checkpoint` uses): the
    equation as a call of its unfused equal, which JAX's call rule splits (saving or
    recomputing the forward as the checkpoint policy says)."""

    def rule(saveable, unks_in, inst_in, eqn):
        fused = _fused_equation(primitive, eqn.params)
        if fused is None:
            return previous(saveable, unks_in, inst_in, eqn)
        closed = _unfused_jaxpr([v.aval for v in eqn.invars], *fused)
        call = eqn.replace(primitive=closed_call_p, params=dict(call_jaxpr=closed))
        return pe.partial_eval_jaxpr_custom_rules[closed_call_p](saveable, unks_in, inst_in, call)

    return rule


pe.custom_partial_eval_rules[forward_terms_p] = _split_where_unknown(forward_terms_p, None)
pe.partial_eval_jaxpr_custom_rules[forward_terms_p] = _split_equation(forward_terms_p, None)
# Batched, the fused pass is an equation of `vprim_p` (`create_vprim`'s batching, our own
# primitive), whose rules chain to the ones before (its `jax.checkpoint` rule).
pe.custom_partial_eval_rules[vprim_p] = _split_where_unknown(
    vprim_p, pe.custom_partial_eval_rules.get(vprim_p)
)
pe.partial_eval_jaxpr_custom_rules[vprim_p] = _split_equation(
    vprim_p, pe.partial_eval_jaxpr_custom_rules[vprim_p]
)


def _terms_batch(axis_size, axis_name, trace_type, vals, dims, *, terms, config, mask_kind):
    """The vprim's batching, with the arrays the terms are linear in batched whenever
    anything is: a transpose of the batched pass (reverse over a vmap: `jax.jacrev` of
    `jax.jacfwd`) gives an array's cotangent per batch entry, which `vmap` cannot return
    for an unbatched input; broadcast, JAX's transpose of the broadcast sums them."""
    first = 4 + _mask_size(mask_kind)
    if any(d is not None for d in dims):
        vals, dims = list(vals), list(dims)
        for i in range(first, len(vals)):
            if dims[i] is None:
                x = vals[i]
                vals[i] = jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
                dims[i] = 0
        vals, dims = tuple(vals), tuple(dims)
    params = dict(terms=terms, config=config, mask_kind=mask_kind)
    return vprim_batch(terms_p, axis_size, axis_name, trace_type, vals, dims, **params)


batching.axis_primitive_batchers[terms_p] = _terms_batch


def _dce(fixed):
    """Dead-code elimination of unused terms, batched or not (`def_dce`; JAX's rule would keep
    or drop the whole pass), after `fixed` outputs that are always computed (the fused
    pass's log-sum-exp and output). A forward-mode derivative of the energy alone uses
    neither the attention output's tangent nor its terms: they are dropped before they are
    compiled."""

    def rule(used_outputs, params):
        kept = [True] * fixed + used_outputs[fixed:]
        terms = tuple(t for t, keep in zip(params["terms"], kept[fixed:], strict=True) if keep)
        return {**params, "terms": terms}, kept

    return rule


def_dce(terms_p, _dce(0))
def_dce(forward_terms_p, _dce(2))
