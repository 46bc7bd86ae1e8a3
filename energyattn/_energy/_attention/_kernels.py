r"""Pallas kernels for the two passes (`forward_p`, `terms_p`) on GPUs and TPUs: what both
platforms share. The loops and the loads are each platform's (`_kernels_gpu`: Triton, a
program per block of rows looping over the other sequence; `_kernels_tpu`: Mosaic, a grid
over both with the running sums in VMEM scratch); this module gives them the block
arithmetic, the operands, the products, the plan of kernels and the cost estimates.

Three kinds of kernel, each a function of one block at a time:

- `forward`: the online pass (flash attention's forward), a program per query block, the
  key blocks visited in turn: the log-sum-exp rows and the output $\sum_j p_{ij} k_j$, and
  with row terms their sums too (the fused forward of a JVP);
- `rows`: row terms $\sum_j w_{ij} X_j$, a program per query block over the key blocks;
- `columns`: column terms $\sum_i w_{ij} X_i$, a program per key block over the query
  blocks (the shape of flash attention's $dK/dV$ kernel), its blocks held transposed so
  that every product is a plain one.

The block arithmetic (the allowed entries, the online update, the probabilities, the
terms' weights) is `_blocks`'s, shared with the XLA loop.

**Products take their precision from their operands.** Half-precision operands multiply as
they are, accumulating in float32. A float32 operand is split into parts the matrix units
take exactly (once, outside the kernel, for the inputs; in the kernel for the
probabilities and weights): on a GPU two TF32 parts ($x_1$ rounded to 11 significant bits,
$x_2 = x - x_1$), three products $a_1 b_1 + a_1 b_2 + a_2 b_1$ on the tensor cores (as
Triton's `tf32x3`); on a TPU three bfloat16 parts and the six products whose parts'
orders sum to at most 2 (as XLA's HIGHEST precision there). The dropped products are
$O(2^{-22})$ of the product: float32 accuracy (`tests/test_kernels.py` measures it). A
half-precision operand is exact in either part format and is not split.
`BlockSizes(float32_products="highest")` asks for the compilers' own float32 products
instead: FMA loops on a GPU (no tensor cores), Mosaic's on a TPU.

**A pass may take several kernels.** A kernel accumulates at most the `Budget` of its chip
(columns of sums, bilinear pairs per block: `_policy`); a pass that needs more is planned
over several kernels, each recomputing the probabilities: sums wider than the budget in
column chunks, a factor that sums several pairs expanded into terms of fewer
(distributivity), terms packed in order. The products contract their operands in chunks
(`Products.chunk` columns, a loop on GPUs), so that on-chip memory holds a chunk of each.

**Masks**: the structural ones (`Structure`) are computed from the blocks' positions, and
the causal triangle skips the blocks above the diagonal; an explicit dense mask is read
block by block where it lies (never padded: $O(\mathrm{seq}\times\mathrm{mem})$ memory is
the mask's own; a TPU reads it as `int8`); segment ids (`SegmentIds`) compare a query's id
with a key's, $O(\mathrm{seq})$. Lengths that are not block multiples are padded (the
queries, keys and per-row arrays: $O(\mathrm{seq})$), the padded keys and queries masked
by their index; rows with nothing to attend to get the package's convention (log-sum-exp
0, output 0).
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._dtypes import accumulation_dtype
from ..._mask import SegmentIds
from ._blocks import (
    KEYS,
    ONES,
    SCALED_KEYS,
    SCALED_QUERIES,
    Scaled,
    Structure,
    Term,
    array_roles,
    block_allowed,
    block_probs,
    forward_finish,
    online_terms,
    online_update,
    term_weights,
    value_widths,
    weighted_sum,
)
from ._policy import BlockSizes, Budget, KernelTiles, kernel_tiles, narrow_tiles

# ---------------------------------------------------------------------------- products


class Parts(NamedTuple):
    """A float32 array as the parts a matrix unit takes exactly (split once, outside the
    kernel, where it is an input: the kernel loads the parts)."""

    parts: tuple

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)


class Block:
    """A block of an input, read in column ranges when it is used (`cols`): a product
    that contracts its columns reads them a chunk at a time, so that on-chip memory holds a
    chunk of each operand, not the block. `reads`: one reader per part, each
    `(start, width) -> array`."""

    def __init__(self, reads, width: int, split: bool):
        self.reads, self.width, self.split = tuple(reads), width, split

    def cols(self, start: int | jax.Array = 0, width: int | None = None):
        """Columns `[start, start + width)` (all by default; `start` traced in a loop over
        chunks): an array, or `Parts`."""
        span = self.width - start if width is None else width
        loaded = tuple(read(start, span) for read in self.reads)
        return Parts(loaded) if self.split else loaded[0]


def _tf32_parts(x):
    r"""$x = x_1 + x_2$ with $x_1$ rounded to TF32's 11 significant bits (bit arithmetic,
    the same on every backend); $x_2$ is exact, and a TF32 product rounds it to 11 bits:
    $|x - x_1 - \mathrm{tf32}(x_2)| \le 2^{-23}|x|$."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    high = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    return high, x - high


def _bf16_parts(x):
    """$x = x_1 + x_2 + x_3$, each part bfloat16 (8 significant bits each)."""
    first = x.astype(jnp.bfloat16)
    rest = x - first.astype(x.dtype)
    second = rest.astype(jnp.bfloat16)
    third = (rest - second.astype(x.dtype)).astype(jnp.bfloat16)
    return first, second, third


#: Per platform: the dtype parts are held in, the split into them and how many it makes
#: (Triton takes TF32 parts as float32 operands of a TF32 product).
_PART_FORMATS = {"gpu": (jnp.float32, _tf32_parts, 2), "tpu": (jnp.bfloat16, _bf16_parts, 3)}


def _exact_in_parts(dtype, platform) -> bool:
    """Whether `dtype`'s values are exact in the platform's part format (TF32 on a GPU,
    bfloat16 on a TPU): such an operand is one part."""
    dtype = jnp.dtype(dtype)
    if platform == "tpu":
        return dtype == jnp.bfloat16
    return dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Products:
    """The matrix products of a kernel on `platform`, each accumulating in float32 (float64
    for float64 operands, which only Pallas's interpreters take). `mode`: `"split"` or
    `"highest"` for float32 operands (module docstring). An operand is an array or `Parts`."""

    platform: str
    mode: str = "split"
    chunk: int | None = None

    def splits(self, dtype) -> bool:
        """Whether an operand of `dtype` is split into parts."""
        dtype = jnp.dtype(dtype)
        return (
            self.mode == "split"
            and dtype.itemsize == 4
            and not _exact_in_parts(dtype, self.platform)
        )

    def split(self, x):
        """`x` as `Parts` where it is split, else itself."""
        if isinstance(x, Parts) or not self.splits(x.dtype):
            return x
        return Parts(tuple(_PART_FORMATS[self.platform][1](x)))

    def _parts(self, x):
        part_dtype = _PART_FORMATS[self.platform][0]
        if isinstance(x, Parts):
            return x.parts
        if self.splits(x.dtype):
            return _PART_FORMATS[self.platform][1](x)
        return (x.astype(part_dtype),)  # exact as one part

    def __call__(self, a, b, dims):
        def dot(x, y, acc, precision=None):
            return jax.lax.dot_general(
                x, y, (dims, ((), ())), precision=precision, preferred_element_type=acc
            )

        plain = not isinstance(a, Parts) and not isinstance(b, Parts)
        if plain:
            acc = accumulation_dtype(a.dtype, b.dtype)
            if acc.itemsize > 4:  # float64: interpreters only
                return dot(a.astype(acc), b.astype(acc), acc, jax.lax.Precision.HIGHEST)
            if a.dtype == b.dtype and a.dtype.itemsize < 4:
                return dot(a, b, acc)  # half precision: what the matrix units take
            if self.mode == "highest":
                return dot(a.astype(acc), b.astype(acc), acc, jax.lax.Precision.HIGHEST)
        parts = self._parts(a), self._parts(b)
        # The products whose parts' orders sum to at most (parts - 1), smallest first.
        order = _PART_FORMATS[self.platform][2] - 1
        pairs = [
            (i, j) for i in range(len(parts[0])) for j in range(len(parts[1])) if i + j <= order
        ]
        total = None
        for i, j in sorted(pairs, key=lambda p: -(p[0] + p[1])):
            term = dot(parts[0][i], parts[1][j], jnp.float32)
            total = term if total is None else total + term
        return total

    def nt(self, a, b):
        """`a @ b.T`. `Block`s are read `chunk` columns at a time (their contraction)."""
        if isinstance(a, Scaled):
            return self.nt(a.block, b) * a.scale
        if isinstance(b, Scaled):
            return self.nt(a, b.block) * b.scale
        if not isinstance(a, Block):
            return self(a, b, ((1,), (1,)))
        chunk = a.width if self.chunk is None else min(self.chunk, a.width)
        first = self(a.cols(0, chunk), b.cols(0, chunk), ((1,), (1,)))
        if chunk == a.width:
            return first

        # A loop, not an unrolled sum: the compiler then holds one chunk of each operand.
        def more(c, total):
            start = pl.multiple_of(c * chunk, chunk)
            return total + self(a.cols(start, chunk), b.cols(start, chunk), ((1,), (1,)))

        return jax.lax.fori_loop(1, a.width // chunk, more, first)

    def nn(self, a, b):
        """`a @ b`."""
        if isinstance(b, Scaled):
            return self.nn(a, b.block) * b.scale
        return self(a, b, ((1,), (0,)))

    def pieces(self, dtype) -> int:
        """How many products one product of a `dtype` operand costs (for the estimates)."""
        if not self.splits(dtype):
            return 1
        return {"gpu": 3, "tpu": 6}[self.platform]


# ------------------------------------------------------------------------- a pass's spec


class Output(NamedTuple):
    """One accumulated output of a kernel: columns `start` to `start + width` of a sum
    whose values are `terms[term]`'s (`term=None`: the forward pass's output, whose values
    are the keys)."""

    term: int | None
    start: int
    width: int


class Pass(NamedTuple):
    """The static description of one kernel: `kind` (`"forward"`, `"rows"` or
    `"columns"`), its `terms` and the `outputs` it accumulates, the structural masks, the
    explicit mask's kind (`None`, `"dense"` or `"segments"`), the tiling and the
    products."""

    kind: str
    terms: tuple[Term, ...]
    outputs: tuple[Output, ...]
    structure: Structure
    mask: str | None
    tiles: KernelTiles
    products: Products

    @property
    def outer_is_queries(self) -> bool:
        """Whether a program holds a block of queries (and visits the key blocks)."""
        return self.kind != "columns"

    def value(self, output: Output) -> int:
        """The index of `output`'s values among the arrays (`KEYS` for the forward's)."""
        return KEYS if output.term is None else self.terms[output.term].value


def _allowed(spec: Pass, blocks, queries, keys):
    """Which entries of the block take part (`None`: all of them)."""
    tiles = spec.tiles
    mask_block = None
    if spec.mask == "dense":
        mask_block = blocks["mask"]
    elif spec.mask == "segments":
        mask_block = blocks["qseg"] == blocks["kseg"]
    # Padded queries must not count in a column term's sum; in the row passes their rows
    # are cut off.
    seq = tiles.padded_seq if spec.kind == "columns" else None
    return block_allowed(queries, keys, spec.structure, mask_block, mem=tiles.padded_mem, seq=seq)


def step(spec: Pass, carry, blocks, queries, keys):
    """One block of `spec`'s pass: the carried sums after it, one per output (the forward
    pass's running max and sum first).

    `blocks` holds the block's `beta`, its queries (`q`, half precision only) and
    $\\beta q$ (`sq`, in float32, where the pass uses it), its keys `k`, `lse` (terms
    passes), the mask's block (`mask`, or `qseg` and `kseg`), the terms' `arrays` by index
    and each output's `values` (its columns of its values' rows), each float32 input as
    its `Parts`; `queries` and `keys` are its indices.

    The row passes hold `(queries, keys)` blocks; the column pass holds every block
    transposed, `(keys, queries)` (its scores $k q^\\top$, its log-sum-exp and query ids
    as rows, the mask's block transposed), so that each of its sums
    $\\sum_i w_{ij} X_i$ is a plain product $w^\\top X$, like every other product."""
    beta = blocks["beta"]
    products = spec.products
    k = blocks["k"]
    forward = spec.kind != "columns"
    q = blocks["q"] if "q" in blocks else blocks["sq"]
    # (`q`, `k` and the arrays are `Block`s: read where a product contracts them.)
    scale = beta if "q" in blocks else 1.0  # half-precision queries: beta on the scores
    scores = scale * (products.nt(q, k) if forward else products.nt(k, q))
    allowed = _allowed(spec, blocks, queries, keys)
    arrays = {**blocks["arrays"], KEYS: k, SCALED_QUERIES: _scaled_queries(blocks)}
    arrays[SCALED_KEYS] = Scaled(k, beta)  # the keys' products scaled: no float32 copy
    values = blocks["values"]

    def pair(a, b):
        return products.nt(arrays[a], arrays[b]) if forward else products.nt(arrays[b], arrays[a])

    terms = [spec.terms[o.term] for o in spec.outputs if o.term is not None]
    if spec.kind == "forward":
        run_max, total, out, *sums = carry
        new = online_update((run_max, total, out), scores, allowed, values[0], products.nn)
        if not terms:
            return new
        shift = jnp.where(jnp.isfinite(new[0]), new[0], 0.0)
        probs = block_probs(scores, shift, allowed)
        rescale = jnp.exp(run_max - shift)
        sums = online_terms(sums, rescale, probs, terms, pair, values[1:], products.nn)
        return (*new, *sums)
    probs = block_probs(scores, blocks["lse"], allowed)
    weights = term_weights(probs, terms, pair)
    return tuple(
        s + weighted_sum(w, x, products.nn) for s, w, x in zip(carry, weights, values, strict=True)
    )


def init(spec: Pass, acc) -> tuple:
    """The carried sums before any block: one per output (the forward pass's running max
    and sum first)."""
    tiles = spec.tiles
    rows = tiles.bq if spec.outer_is_queries else tiles.bk
    sums = tuple(jnp.zeros((rows, o.width), acc) for o in spec.outputs)
    if spec.kind != "forward":
        return sums
    return (jnp.full((rows, 1), -jnp.inf, acc), jnp.zeros((rows, 1), acc), *sums)


def finish(spec: Pass, carry) -> tuple:
    """The kernel's outputs from its final carry: `(lse, *sums)` for the forward pass (the
    sums normalised), the sums for the terms passes."""
    if spec.kind == "forward":
        return forward_finish(carry)
    return carry


# ----------------------------------------------------------------------- the blocks' range


def causal_range(spec: Pass, outer):
    """`(first, stop)`: the inner blocks that program `outer` needs (all of them, or under
    the causal triangle those that hold an allowed entry). `lax.div`: non-negative operands,
    no sign correction (which Mosaic lowers per chip)."""
    tiles = spec.tiles
    if spec.outer_is_queries:
        num = tiles.mem_p // tiles.bk
        if not spec.structure.causal:
            return 0, num
        end = outer * tiles.bq + tiles.bq + tiles.bk - 1
        return 0, jnp.minimum(num, jax.lax.div(end, jnp.asarray(tiles.bk, end.dtype)))
    num = tiles.seq_p // tiles.bq
    if not spec.structure.causal:
        return 0, num
    # Under the causal triangle the queries before this key block see none of it.
    start = outer * tiles.bk
    return jax.lax.div(start, jnp.asarray(tiles.bq, start.dtype)), num


def indices(spec: Pass, outer, inner):
    """The query and key indices of block `(outer, inner)`: a column of queries and a row
    of keys, or for the column pass (whose blocks are transposed) a row of queries and a
    column of keys."""
    tiles = spec.tiles
    if spec.outer_is_queries:
        queries = outer * tiles.bq + jax.lax.broadcasted_iota(jnp.int32, (tiles.bq, 1), 0)
        keys = inner * tiles.bk + jax.lax.broadcasted_iota(jnp.int32, (1, tiles.bk), 1)
    else:
        queries = inner * tiles.bq + jax.lax.broadcasted_iota(jnp.int32, (1, tiles.bq), 1)
        keys = outer * tiles.bk + jax.lax.broadcasted_iota(jnp.int32, (tiles.bk, 1), 0)
    return queries, keys


# ----------------------------------------------------------------------------- operands


class Operand(NamedTuple):
    """One input of a kernel: `name` (`"q"`, `"sq"`, `"k"`, `"beta"`, `"lse"`, `"mask"`,
    `"qseg"`, `"kseg"`, or an array index), the array, its `side` (`"q"`: one row per
    query, `"k"`: one row per key, `"qrow"` and `"krow"`: one column per query or key,
    `"qk"`: the dense mask, `"one"`), and which of its `Parts` it is (`None`: whole)."""

    name: Any
    array: Any
    side: str
    part: int | None = None


def axis(side: str) -> str | None:
    """The sequence an operand's `side` runs along: `"q"` (queries), `"k"` (keys), or
    `None` (the dense mask, `beta`)."""
    return {"q": "q", "qrow": "q", "k": "k", "krow": "k"}.get(side)


def _pad_rows(x, rows, cols=None):
    pad = [(0, rows - x.shape[0])]
    if x.ndim == 2:
        pad.append((0, (x.shape[1] if cols is None else cols) - x.shape[1]))
    if all(p == (0, 0) for p in pad):
        return x
    return jnp.pad(x, pad)


def operands(spec: Pass, q, k, beta, lse, mask, arrays, dim_p, widths, platform):
    """The kernel's inputs, padded to the tiles (the dense mask never is), each float32
    array that enters a product split into its `Parts`."""
    tiles = spec.tiles
    ops = []

    def add(name, x, side):
        x = spec.products.split(x)
        if isinstance(x, Parts):
            ops.extend(Operand(name, part, side, i) for i, part in enumerate(x.parts))
        else:
            ops.append(Operand(name, x, side))

    acc = beta.dtype
    per_query, per_key = array_roles(spec.terms)
    if q.dtype != acc:
        add("q", _pad_rows(q, tiles.seq_p, dim_p), "q")
    if q.dtype == acc:  # (half-precision queries stand for beta q themselves: `Scaled`)
        add("sq", _pad_rows(beta * q.astype(acc), tiles.seq_p, dim_p), "q")
    add("k", _pad_rows(k, tiles.mem_p, dim_p), "k")
    ops.append(Operand("beta", beta.reshape(1, 1), "one"))
    by_queries = spec.outer_is_queries
    if lse is not None:
        lse = _pad_rows(lse, tiles.seq_p)
        ops.append(
            Operand("lse", lse[:, None], "q")
            if by_queries
            else Operand("lse", lse[None, :], "qrow")
        )
    if spec.mask == "dense":
        # A GPU loads the boolean mask where it lies (masked loads beyond its edges); a
        # TPU's kernels take no booleans (Pallas would widen them to int32): int8 blocks.
        dense = mask if platform == "gpu" else mask.astype(jnp.int8)
        if platform == "tpu" and (dense.shape[0] < tiles.bq or dense.shape[1] < tiles.bk):
            # Shorter than one block: padded to it (the ragged edges of longer masks are
            # the pipeline's own partial blocks).
            dense = jnp.pad(
                dense,
                ((0, max(0, tiles.bq - dense.shape[0])), (0, max(0, tiles.bk - dense.shape[1]))),
            )
        ops.append(Operand("mask", dense, "qk"))
    elif spec.mask == "segments":
        # A column and a row, in the blocks' orientation.
        query_ids = _pad_rows(mask.query.astype(jnp.int32), tiles.seq_p)
        key_ids = _pad_rows(mask.keys.astype(jnp.int32), tiles.mem_p)
        if by_queries:
            ops += [
                Operand("qseg", query_ids[:, None], "q"),
                Operand("kseg", key_ids[None], "krow"),
            ]
        else:
            ops += [
                Operand("qseg", query_ids[None], "qrow"),
                Operand("kseg", key_ids[:, None], "k"),
            ]
    for indices_, length, side in ((per_query, tiles.seq_p, "q"), (per_key, tiles.mem_p, "k")):
        for i in sorted(i for i in indices_ if i >= 0):
            add(i, _pad_rows(arrays[i], length, widths[i]), side)
    return ops


def gather(spec: Pass, ops, reads) -> dict:
    """The step's `blocks` from `reads` (per operand in `ops`: a loaded array for the
    vectors, the mask and `beta`; a reader `(start, width) -> array` for the blocks of
    rows): the vectors by name, the blocks as `Block`s (their parts together), the terms'
    blocks under `"arrays"`, each output's values under `"values"`."""
    blocks: dict = {"arrays": {}}
    readers: dict = {}
    for op, read in zip(ops, reads, strict=True):
        if not callable(read):
            blocks[op.name] = read
            continue
        readers.setdefault(op.name, []).append(read)
    for name, rs in readers.items():
        first = next(op for op in ops if op.name == name)
        block = Block(rs, first.array.shape[1], first.part is not None)
        (blocks["arrays"] if isinstance(name, int) else blocks)[name] = block
    blocks["values"] = []
    for output in spec.outputs:
        index = spec.value(output)
        if index == SCALED_QUERIES and "sq" not in blocks:
            values = Scaled(blocks["q"].cols(output.start, output.width), blocks["beta"])
        elif index == SCALED_KEYS:
            values = Scaled(blocks["k"].cols(output.start, output.width), blocks["beta"])
        elif index == ONES:
            values = None  # the weights' row sums: `weighted_sum`
        else:
            named = {KEYS: "k", SCALED_QUERIES: "sq"}
            held = blocks[named[index]] if index in named else blocks["arrays"][index]
            values = held.cols(output.start, output.width)
        blocks["values"].append(values)
    return blocks


def _scaled_queries(blocks):
    """$\\beta q$ of a step: the float32 block, or the half-precision queries `Scaled`."""
    return blocks["sq"] if "sq" in blocks else Scaled(blocks["q"], blocks["beta"])


# --------------------------------------------------------------------------- cost estimate


def cost_estimate(spec: Pass, ops, out_shapes, dim_p, widths, acc, input_dtype) -> pl.CostEstimate:
    """What one call costs, for XLA's scheduling around it: the products' flops (each float32
    product counted as the products it is split into), one exponential per score, and the
    bytes moved (the inner sequence's blocks read once per program)."""
    tiles = spec.tiles
    pairs = tiles.seq_p * tiles.mem_p
    if spec.structure.causal:
        pairs = pairs // 2 + tiles.seq_p * max(tiles.bq, tiles.bk) // 2
    pieces = spec.products.pieces(acc)
    per_pair = 2 * dim_p * spec.products.pieces(input_dtype)  # the scores
    factors = {pair for term in spec.terms for factor in term.factors for pair in factor}
    per_pair += sum(2 * widths[a] * pieces for a, _ in factors)
    per_pair += sum(2 * o.width * pieces for o in spec.outputs)
    outer = tiles.seq_p // tiles.bq if spec.outer_is_queries else tiles.mem_p // tiles.bk
    inner_axis = "k" if spec.outer_is_queries else "q"
    moved = 0
    for op in ops:
        size = op.array.size * op.array.dtype.itemsize
        moved += size * (outer if axis(op.side) == inner_axis else 1)
    moved += sum(int(s.size) * jnp.dtype(s.dtype).itemsize for s in out_shapes)
    return pl.CostEstimate(
        flops=int(pairs * per_pair), transcendentals=int(pairs), bytes_accessed=int(moved)
    )


# ---------------------------------------------------------------------------- planning


class _Unit(NamedTuple):
    """A piece of work: columns `[start, start + width)` of term `term` (an index into the
    caller's terms, or `None` for the forward's output), through `piece`, the term or one
    of the terms it expands into."""

    term: int
    piece: Term
    start: int
    width: int


def _pairs(term: Term) -> frozenset:
    return frozenset(pair for factor in term.factors for pair in factor)


def _expand(term: Term, max_pairs: int) -> list[Term]:
    """`term` as terms of at most `max_pairs` distinct bilinear pairs each, whose sum it is:
    a factor that is a sum of pairs distributes over them."""
    if len(_pairs(term)) <= max_pairs or all(len(f) == 1 for f in term.factors):
        return [term]
    f = max(range(len(term.factors)), key=lambda i: len(term.factors[i]))
    pieces = []
    for pair in term.factors[f]:
        factors = term.factors[:f] + ((pair,),) + term.factors[f + 1 :]
        pieces += _expand(Term(term.row, factors, term.value), max_pairs)
    return pieces


def _units(terms, widths, budget: Budget) -> list[_Unit]:
    units = []
    for t, term in enumerate(terms):
        width = widths[term.value]
        chunk = min(width, budget.columns)
        for piece in _expand(term, budget.pairs):
            units += [_Unit(t, piece, c, min(chunk, width - c)) for c in range(0, width, chunk)]
    return units


def _pack(units: list[_Unit], budget: Budget, columns: int = 0):
    """The first units, in order, that fit one kernel beside `columns` columns already
    accumulated (an empty kernel takes its first unit whatever it costs), and the rest."""
    taken: list[_Unit] = []
    pairs: frozenset = frozenset()
    for i, unit in enumerate(units):
        more = pairs | _pairs(unit.piece)
        fits = columns + unit.width <= budget.columns and len(more) <= budget.pairs
        if not fits and (taken or columns):
            return taken, units[i:]
        taken.append(unit)
        columns, pairs = columns + unit.width, more
    return taken, []


def _kernel_spec(
    base: Pass, kind: str, units: list[_Unit], budget: Budget, forward_out=None
) -> Pass:
    """One kernel's `Pass`: the terms of `units` and their outputs; on tiles whose inner
    step is narrowed (`narrow_tiles`) where its terms hold more pairs than the budget (a
    term whose factors are each one pair cannot be expanded)."""
    pieces = tuple(dict.fromkeys(u.piece for u in units))
    outputs = [] if forward_out is None else [forward_out]
    outputs += [Output(pieces.index(u.piece), u.start, u.width) for u in units]
    tiles = base.tiles
    if budget.narrow and len(frozenset().union(*map(_pairs, pieces))) > budget.pairs:
        tiles = narrow_tiles(tiles)
    return base._replace(kind=kind, terms=pieces, outputs=tuple(outputs), tiles=tiles)


# ---------------------------------------------------------------------------- entry points


def _pow2(n: int, least: int) -> int:
    return max(least, pl.next_power_of_2(n))


def _call(spec: Pass, q, k, beta, lse, mask, arrays, dim_p, widths, platform, interpret):
    """One kernel: its outputs (the forward's `(lse, *sums)`, the terms passes' sums), as
    many rows as the queries (or keys), the columns padded."""
    tiles, acc = spec.tiles, beta.dtype
    ops = operands(spec, q, k, beta, lse, mask, arrays, dim_p, widths, platform)
    length = tiles.seq_p if spec.outer_is_queries else tiles.mem_p
    out_shapes = [jax.ShapeDtypeStruct((length, o.width), acc) for o in spec.outputs]
    if spec.kind == "forward":
        out_shapes.insert(0, jax.ShapeDtypeStruct((length, 1), acc))
    cost = cost_estimate(spec, ops, out_shapes, dim_p, widths, acc, q.dtype)
    name = {
        "forward": "energy_attention_forward",
        "rows": "energy_attention_row_terms",
        "columns": "energy_attention_column_terms",
    }[spec.kind]
    from . import _kernels_gpu, _kernels_tpu  # (they import this module)

    driver = _kernels_gpu if platform == "gpu" else _kernels_tpu
    outs = driver.run(spec, ops, out_shapes, cost, interpret=interpret, name=name)
    # The true rows only: kernels of one pass may pad differently.
    return [o[: q.shape[0] if spec.outer_is_queries else k.shape[0]] for o in outs]


def _assemble(terms, widths, results) -> list:
    """Each term's sum, `(rows, width)`, from `(unit, value)` results: the pieces of a
    term added, its column chunks put side by side."""
    out = []
    for t in range(len(terms)):
        chunks: dict[int, Any] = {}
        for unit, value in results:
            if unit.term == t:
                chunks[unit.start] = (
                    value if unit.start not in chunks else chunks[unit.start] + value
                )
        out.append(jnp.concatenate([chunks[c] for c in sorted(chunks)], axis=1))
    return out


def forward(
    q,
    k,
    beta,
    mask,
    structure: Structure,
    blocks: BlockSizes,
    *,
    arrays=None,
    terms=(),
    platform="gpu",
    interpret=False,
    generation=None,
):
    """The log-sum-exp rows and the output $\\sum_j p_{ij} k_j$ of one head, as
    `_blocks.forward_chunk` + `forward_finish` give them; with `terms` (row terms over
    `arrays`, as `terms` takes them) their sums too, accumulated in the forward's kernel
    as far as its budget allows and by a row-terms pass after it otherwise. `mask`: `None`,
    a boolean `(seq, mem)` array or `SegmentIds`."""
    arrays = dict(arrays or {})
    terms = tuple(terms)
    base, dim_p, widths, budget = _spec(
        "forward", q, k, beta, mask, arrays, terms, structure, blocks, platform, generation
    )
    seq, dim = q.shape
    true_widths = value_widths(arrays, dim)
    run = functools.partial(
        _call,
        q=q,
        k=k,
        beta=beta,
        mask=mask,
        arrays=arrays,
        dim_p=dim_p,
        widths=widths,
        platform=platform,
        interpret=interpret,
    )
    # The output's column chunks: the first with as many of the terms as fit beside it.
    chunk = min(dim_p, budget.columns)
    units = _units(terms, widths, budget)
    first = Output(None, 0, chunk)
    fused, rest = _pack(units, budget, columns=chunk)
    lse, out, *sums = run(_kernel_spec(base, "forward", fused, budget, first), lse=None)
    outs = [out]
    for c in range(chunk, dim_p, chunk):
        more = Output(None, c, min(chunk, dim_p - c))
        outs.append(run(_kernel_spec(base, "forward", [], budget, more), lse=None)[1])
    results = list(zip(fused, sums, strict=True))
    lse = lse[:, 0]
    if rest:
        # The terms left over run in row passes, tiled as row passes (not as the forward:
        # on the B200 a short causal forward's 4 warps made the energy-based Transformer's
        # float32 HVP at 8 tokens spill 4 B at 128 registers in its row pass).
        base = _spec(
            "rows", q, k, beta, mask, arrays, terms, structure, blocks, platform, generation
        )[0]
    while rest:
        taken, rest = _pack(rest, budget)
        spec = _kernel_spec(base, "rows", taken, budget)
        results += list(zip(taken, run(spec, lse=lse), strict=True))
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    rows = _assemble(terms, widths, results)
    rows = [r[:seq, : true_widths[t.value]] for r, t in zip(rows, terms, strict=True)]
    return (lse[:seq], out[:seq, :dim], *rows)


def terms(
    q,
    k,
    beta,
    lse,
    mask,
    arrays,
    terms_,
    structure,
    blocks,
    *,
    platform="gpu",
    interpret=False,
    generation=None,
):
    """The terms' sums of one head, in the order of `terms_` (`_blocks.terms_chunk`'s
    values: rows `(seq, width)` for row terms, `(mem, width)` for column terms). `arrays`
    maps an index to a per-query or per-key array; `KEYS`, `SCALED_QUERIES` and `SCALED_KEYS`
    are added.
    The terms are split over as many kernels as their budget asks."""
    arrays = dict(arrays)
    seq, mem = q.shape[0], k.shape[0]
    true_widths = value_widths(arrays, k.shape[1])
    by_row: dict[bool, Any] = {}
    for kind, row in (("rows", True), ("columns", False)):
        chosen = tuple(t for t in terms_ if t.row == row)
        if not chosen:
            continue
        base, dim_p, widths, budget = _spec(
            kind, q, k, beta, mask, arrays, chosen, structure, blocks, platform, generation
        )
        units, results = _units(chosen, widths, budget), []
        while units:
            taken, units = _pack(units, budget)
            spec = _kernel_spec(base, kind, taken, budget)
            outs = _call(spec, q, k, beta, lse, mask, arrays, dim_p, widths, platform, interpret)
            results += list(zip(taken, outs, strict=True))
        by_row[row] = iter(_assemble(chosen, widths, results))
    out = []
    for t in terms_:
        value = next(by_row[t.row])
        out.append(value[: seq if t.row else mem, : true_widths[t.value]])
    return tuple(out)


def mask_kind(mask) -> str | None:
    if mask is None:
        return None
    return "segments" if isinstance(mask, SegmentIds) else "dense"


def _spec(kind, q, k, beta, mask, arrays, terms_, structure, blocks, platform, generation):
    """A `Pass` of `kind` over `terms_` (its outputs to be planned), the padded head size,
    the padded widths of the arrays and the kernels' budget."""
    seq, dim = q.shape
    mem = k.shape[0]
    lanes = 128 if platform == "tpu" else 16
    dim_p = _pow2(dim, lanes)
    widths = {i: _pow2(a.shape[1], lanes) for i, a in arrays.items()}
    widths.update({KEYS: dim_p, SCALED_QUERIES: dim_p, SCALED_KEYS: dim_p, ONES: 1})
    tiles, budget = kernel_tiles(
        blocks,
        platform,
        kind=kind,
        seq=seq,
        mem=mem,
        dim=dim_p,
        itemsize=jnp.dtype(q.dtype).itemsize,
        mask=mask_kind(mask),
        generation=generation,
        causal=structure.causal,
    )
    products = Products(platform, tiles.float32_products, tiles.contraction)
    spec = Pass(kind, terms_, (), structure, mask_kind(mask), tiles, products)
    return spec, dim_p, widths, budget
