"""The Pallas kernels of the two passes: equal to the XLA loop in interpret mode, and present
in programs lowered for a GPU from this CPU (the derivative grid's "pallas" cells check
them through every transformation)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import energyattn as ea
from energyattn._checks import check_mask
from energyattn._energy._attention import _kernels
from energyattn._energy._attention._blocks import (
    KEYS,
    SCALED_QUERIES,
    Structure,
    Term,
    forward_chunk,
    forward_finish,
    forward_init,
    terms_chunk,
    terms_init,
)
from energyattn._energy._attention._policy import Budget, kernel_tiles, target_generation

#: Row and column terms with shared, summed, repeated and distinct factors, a per-key value,
#: the keys and the scaled queries: the shapes every derivative rule makes.
TERMS = (
    Term(True, (((0, KEYS),),), KEYS),
    Term(False, (((0, KEYS), (SCALED_QUERIES, 2)),), 1),
    Term(True, (), 2),
    Term(False, (((0, KEYS),), ((0, KEYS),)), SCALED_QUERIES),
    Term(True, (((0, KEYS),), ((SCALED_QUERIES, 2),)), 2),
)

#: (seq, mem, head size, structure, explicit mask, dtype): odd lengths, several blocks, one
#: short block, head sizes off the power of two, every mask (dense, or "segments"), a row
#: with nothing allowed.
CASES = [
    (13, 13, 5, Structure(), False, "float64"),
    (37, 37, 16, Structure(causal=True), True, "float64"),
    (37, 37, 8, Structure(exclude_self=True), "segments", "float64"),
    (40, 40, 3, Structure(True, True), True, "float64"),
    (21, 35, 24, Structure(), True, "float32"),
    (30, 19, 8, Structure(), "segments", "float32"),
    (33, 33, 16, Structure(causal=True), False, "bfloat16"),
]
TOL = {"float64": 1e-12, "float32": 2e-5, "bfloat16": 2e-5}
#: The warps of a short half-precision causal forward over one block on the B200: 2 with JAX
#: 0.12's Triton, 8 with older ones (`kernel_tiles`).
B200_SHORT_HALF_WARPS = 2 if jax.__version_info__ >= (0, 12) else 8


def lowered_for(kind, fn, x, platform="cuda"):
    """The text of `jax.jit(fn)` at `x`, lowered from this CPU for the chip `kind` (a device
    kind, e.g. "NVIDIA B200"): Pallas asks the target device's kind when it lowers a kernel
    (newer JAX needs it given for a platform this machine lacks), and an abstract device
    says it. `x` is made outside the abstract mesh (JAX 0.12 refuses it there)."""
    family = "tpu" if platform == "tpu" else "gpu"
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=family)
    mesh = jax.sharding.AbstractMesh((1,), ("one",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[5]}")
def test_kernels_equal_the_xla_loop(case, platform):
    seq, mem, dim, structure, masked, dtype = case
    rng = np.random.default_rng(seq + mem + dim)
    acc = jnp.float64 if dtype == "float64" else jnp.float32
    q = jnp.asarray(rng.normal(size=(seq, dim)), dtype)
    k = jnp.asarray(rng.normal(size=(mem, dim)), dtype)
    beta = jnp.asarray(0.7, acc)
    mask = None
    if masked == "segments":
        ids = rng.integers(0, 3, size=max(seq, mem))
        mask = ea.SegmentIds(jnp.asarray(ids[:seq]).at[3].set(9), jnp.asarray(ids[:mem]))
    elif masked:
        mask = jnp.asarray(rng.random((seq, mem)) < 0.7).at[3].set(False)
    arrays = {
        0: jnp.asarray(rng.normal(size=(seq, dim)), acc),
        1: jnp.asarray(rng.normal(size=(seq, 3)), acc),
        2: jnp.asarray(rng.normal(size=(mem, dim)), acc),
    }
    # The same key blocks as the XLA loop's: in half precision the probabilities are rounded
    # relative to the running max, which depends on where the blocks fall.
    tiles = ea.BlockSizes(16, 16, 16).on(platform, seq)
    block = kernel_tiles(
        tiles, platform, kind="forward", seq=seq, mem=mem, dim=16, itemsize=2, mask=None
    )[0].bk
    # The TPU kernels run in Pallas's TPU interpreter, the GPU ones in its generic one.
    interpret = pltpu.InterpretParams() if platform == "tpu" else True
    run = dict(platform=platform, interpret=interpret)

    @jax.jit
    def both():
        init = forward_init(q, acc)
        want = forward_finish(forward_chunk(q, k, beta, mask, structure, block, init))
        got = _kernels.forward(q, k, beta, mask, structure, tiles, **run)
        init = terms_init(seq, arrays, TERMS, acc, dim)
        rows, cols = terms_chunk(q, k, beta, want[0], mask, arrays, TERMS, structure, block, init)
        rows, cols = iter(rows), iter(cols)
        want_terms = tuple(next(rows) if t.row else next(cols) for t in TERMS)
        got_terms = _kernels.terms(
            q, k, beta, want[0], mask, arrays, TERMS, structure, tiles, **run
        )
        # The fused forward (a JVP's pass): the row terms from the online pass itself, by the
        # kernel and by the XLA loop, equal the terms pass's.
        rows_only = tuple(t for t in TERMS if t.row)
        fused = _kernels.forward(
            q, k, beta, mask, structure, tiles, arrays=arrays, terms=rows_only, **run
        )
        init = (*forward_init(q, acc), *terms_init(seq, arrays, rows_only, acc, dim))
        args = (q, k, beta, mask, structure, block, init)
        fused_xla = forward_finish(forward_chunk(*args, arrays=arrays, terms=rows_only))
        want_rows = tuple(w for w, t in zip(want_terms, TERMS, strict=True) if t.row)
        got_terms = (*got_terms, *fused[2:], *fused_xla[2:])
        want_terms = (*want_terms, *want_rows, *want_rows)
        return (got, got_terms), (want, want_terms)

    got, want = jax.device_get(both())
    for have, expected in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert have.shape == expected.shape
        scale = max(1.0, float(np.max(np.abs(expected))))
        np.testing.assert_allclose(have, expected, rtol=0, atol=TOL[dtype] * scale)
    if masked:  # the empty row: log-sum-exp 0, no output, no terms
        lse, out = got[0]
        assert lse[3] == 0 and np.all(out[3] == 0)


def test_block_sizes():
    # Each platform's defaults fill the fields left None; a field given holds everywhere.
    assert ea.BlockSizes.default("gpu", 100) == ea.BlockSizes(64, 32, 64, 8, 1, "split")
    # Float32 heads above 128 step through fewer keys; on sm_100 with fewer warps.
    wide = dict(dtype="float32", head_dim=256)
    assert ea.BlockSizes.default("gpu", 100, generation="sm_90", **wide).block_k == 16
    b200 = ea.BlockSizes.default("gpu", 100, generation="sm_100", **wide)
    assert (b200.num_warps, b200.block_q) == (4, 32)  # at 64 queries vmapped heads spilled
    assert ea.BlockSizes.default("gpu", 100, generation="sm_100", head_dim=128).block_q == 64
    # So do the A100's half-precision heads above 128, in every pass, and its column
    # programs up to head size 64, and every pass up to 32 (they spilled registers with
    # the full tiles: benchmarks/README.md); the H100's keep the full tile.
    a100_tiles = {16: (32, 16, 16), 32: (32, 16, 16), 48: (64, 32, 32), 64: (64, 32, 32)}
    a100_tiles |= {128: (64, 32, 64), 192: (64, 16, 32), 256: (64, 16, 32)}
    for head, tiles in a100_tiles.items():
        half = dict(dtype="bfloat16", head_dim=head)
        a100 = ea.BlockSizes.default("gpu", 100, generation="sm_80", **half)
        assert (a100.block_q, a100.block_k, a100.block_k_terms) == tiles, head
    single = ea.BlockSizes.default("gpu", 100, generation="sm_80", head_dim=64)
    assert (single.block_q, single.block_k, single.block_k_terms) == (32, 32, 32)
    single = ea.BlockSizes.default("gpu", 100, generation="sm_80", head_dim=128)
    assert (single.block_q, single.block_k, single.block_k_terms) == (32, 32, 64)
    h100 = ea.BlockSizes.default("gpu", 100, generation="sm_90", dtype="float16", head_dim=256)
    assert (h100.block_k, h100.block_k_terms) == (32, 64)
    # The A100's column programs with a dense mask hold fewer keys (they spilled at 64).
    assert ea.BlockSizes.default("gpu", 100, generation="sm_80", mask="dense").block_k_terms == 32
    assert ea.BlockSizes.default("gpu", 100, generation="sm_90", mask="dense").block_k_terms == 64
    assert ea.BlockSizes.default("cpu", 5000) == ea.BlockSizes(5000, 128, 64)
    assert ea.BlockSizes(block_k=32).on("tpu", 10) == ea.BlockSizes(
        128, 32, 512, None, None, "split"
    )
    with pytest.raises(ValueError, match="block_q must be a positive integer, got 0"):
        ea.BlockSizes(block_q=0)
    with pytest.raises(ValueError, match="float32_products must be 'split' or 'highest'"):
        ea.BlockSizes(float32_products="tf32")
    with pytest.raises(ValueError, match="platform must be 'cpu', 'gpu' or 'tpu', got 'cuda'"):
        ea.BlockSizes.default("cuda", 10)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got -2"):
        ea.attention_logsumexp(jnp.ones((3, 2)), jnp.ones((3, 2)), block_size=-2)


def test_the_a100_column_pass_takes_fewer_keys_with_a_mask():
    # Its column programs also hold a strip of the mask, or of the segment ids: at 64 keys
    # they spilled registers (benchmarks/README.md); a size the user gives is kept.
    args = dict(kind="columns", seq=1000, mem=1000, dim=128, itemsize=2, generation="sm_80")
    for mask, blocks, keys in (
        ("dense", ea.BlockSizes(), 32),
        ("segments", ea.BlockSizes(), 32),
        (None, ea.BlockSizes(), 64),
        ("dense", ea.BlockSizes(block_k_terms=64), 64),
    ):
        assert kernel_tiles(blocks, "gpu", mask=mask, **args)[0].bk == keys
    h100 = dict(args, generation="sm_90")
    assert kernel_tiles(ea.BlockSizes(), "gpu", mask="dense", **h100)[0].bk == 64


def test_only_chips_short_of_shared_memory_narrow_float32_tiles():
    # A float32 term of two pairs that cannot be expanded narrows its tiles to fit the
    # A100's shared memory (and any chip's, where the program names none); on the H100 the
    # narrowed tiles spilled 4-20 B in the layers' HVPs and the full tiles spill nothing;
    # the B200 accumulates two pairs in tensor memory.
    args = dict(kind="rows", seq=1000, mem=1000, dim=64, itemsize=4, mask=None)
    for generation, budget in (
        ("sm_80", Budget(64, 1, narrow=True)),
        (None, Budget(64, 1, narrow=True)),
        ("sm_90", Budget(64, 1, narrow=False)),
        ("sm_100", Budget(128, 2)),
    ):
        got = kernel_tiles(ea.BlockSizes(), "gpu", generation=generation, **args)[1]
        assert got == budget, generation
    half = kernel_tiles(ea.BlockSizes(), "gpu", generation="sm_80", **dict(args, itemsize=2))
    assert half[1] == Budget(128, 2)


@pytest.mark.parametrize(
    "platform, generation, forward, columns",
    [
        # On the H100 and the B200 a short sequence is one default tile (smaller tiles
        # spilled registers on the B200: benchmarks/device_compile.py's 17-token case).
        ("gpu", "sm_90", (64, 32), (32, 64)),
        ("gpu", "sm_100", (64, 32), (32, 64)),
        # Elsewhere one block of its own length (on the A100 the full tiles spill more).
        ("gpu", "sm_80", (32, 32), (32, 32)),
        ("tpu", "v5e", (32, 128), (32, 128)),
    ],
)
def test_a_short_sequence_is_one_tile(platform, generation, forward, columns):
    args = dict(seq=17, mem=17, dim=64, itemsize=2, mask="dense", generation=generation)
    tiles = {
        kind: kernel_tiles(ea.BlockSizes(), platform, kind=kind, **args)[0]
        for kind in ("forward", "columns")
    }
    assert (tiles["forward"].bq, tiles["forward"].bk) == forward
    assert (tiles["columns"].bq, tiles["columns"].bk) == columns
    assert tiles["forward"].padded_seq == 17
    # Long sequences take the same tiles on every generation.
    longer = {**args, "seq": 1000, "mem": 1000}
    long = kernel_tiles(ea.BlockSizes(), platform, kind="forward", **longer)[0]
    assert (long.bq, long.bk) == ((64, 32) if platform == "gpu" else (128, 512))


@pytest.mark.parametrize(
    "kind, seq, hidden",
    [("NVIDIA B200", 5, 2), ("NVIDIA B200", 100, 0), ("NVIDIA H100 80GB HBM3", 5, 0)],
)
def test_the_b200_keeps_a_loop_of_one_block_a_loop(kind, seq, hidden):
    # On the B200 a kernel whose loop takes one block (a sequence shorter than a tile)
    # hides the trip count from Triton and ptxas (an opaque `mov`): unrolled, ptxas traded
    # registers for occupancy and spilled 4-8 B. Over several blocks, and on other chips
    # (the A100 spilled as loops), nothing is hidden. Here: the gradient's forward and
    # column passes, lowered for the chip from this CPU.
    tiles = {
        generation: kernel_tiles(
            ea.BlockSizes(),
            "gpu",
            kind="forward",
            seq=seq,
            mem=seq,
            dim=64,
            itemsize=4,
            mask=None,
            generation=generation,
        )[0].keep_loop
        for generation in ("sm_80", "sm_90", "sm_100", None)
    }
    assert tiles == {"sm_80": False, "sm_90": False, "sm_100": seq == 5, None: False}

    def f(q):
        return ea.attention_logsumexp(q, q, beta=1.0, implementation="pallas").sum()

    text = lowered_for(kind, jax.grad(f), jnp.ones((seq, 64), "float32"))
    assert text.count("xla.gpu.triton") == 2
    assert text.count("mov.b32 $0, $1;") == hidden


def test_the_b200_gives_a_short_causal_forward_over_one_block_fewer_warps():
    # On 8 warps such float32 forwards of 5 queries spilled 4 B on the B200 (unrolled) or
    # 8 B (kept as loops); on 4, forwards of 14 to 31 queries spilled 4-12 B (JAX 0.12), and
    # bfloat16 ones of 4 to 8 queries 4-32 B. Half precision takes 2 warps with JAX 0.12's
    # Triton (on 8 a bfloat16 JVP at 5 tokens spilled 8 B) and 8 with older ones (on 2 two
    # vmapped-heads forwards spilled). Other passes, more than 8 queries, longer sequences,
    # other chips and warps a user asks for keep theirs.
    def warps(generation="sm_100", kind="forward", causal=True, blocks=None, n=5, itemsize=4):
        shape = dict(seq=n, mem=n, dim=128, itemsize=itemsize, mask=None)
        blocks = blocks or ea.BlockSizes()
        tiles, _ = kernel_tiles(
            blocks, "gpu", kind=kind, generation=generation, causal=causal, **shape
        )
        return tiles.num_warps

    half = B200_SHORT_HALF_WARPS
    assert warps() == warps(n=1) == warps(n=8) == 4
    assert warps(itemsize=2) == warps(n=1, itemsize=2) == warps(n=8, itemsize=2) == half
    for itemsize in (2, 4):
        assert warps(n=9, itemsize=itemsize) == warps(n=31, itemsize=itemsize) == 8
        assert warps(causal=False, itemsize=itemsize) == 8
        assert warps(kind="rows", itemsize=itemsize) == 8
        assert warps(kind="columns", itemsize=itemsize) == 8
        assert warps(n=1000, itemsize=itemsize) == 8
        assert warps("sm_90", itemsize=itemsize) == warps("sm_80", itemsize=itemsize) == 8
        assert warps(blocks=ea.BlockSizes(num_warps=8), itemsize=itemsize) == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_terms_a_forward_leaves_run_tiled_as_a_row_pass(dtype):
    # The HVP's forward kernel accumulates what terms fit beside its output; the rest run in
    # row passes, which take the row passes' 8 warps, not the short causal forward's 4 or 2
    # (on 4 the energy-based Transformer's float32 HVP at 8 tokens spilled 4 B in its row
    # pass on the B200). Lowered for the chip from this CPU; each kernel's name and warps.
    def f(q):
        return ea.attention_logsumexp(q, q, beta=1.0, causal=True, implementation="pallas").sum()

    def hvp(x):
        return jax.jvp(jax.grad(f), (x,), (x,))[1]

    text = lowered_for("NVIDIA B200", hvp, jnp.ones((5, 64), dtype))
    kernel = r'name = "(energy_attention_\w+)".{0,400}?num_warps = (\d+)'
    found = re.findall(kernel, text, re.S)
    warps = {name: {int(w) for n, w in found if n == name} for name, _ in found}
    forward = 4 if dtype == "float32" else B200_SHORT_HALF_WARPS
    assert warps == {
        "energy_attention_forward": {forward},
        "energy_attention_row_terms": {8},
        "energy_attention_column_terms": {8},
    }


@pytest.mark.parametrize(
    "kind, platform, generation",
    [
        ("NVIDIA H100 80GB HBM3", "gpu", "sm_90"),
        ("NVIDIA A100-SXM4-80GB", "gpu", "sm_80"),
        ("NVIDIA B200", "gpu", "sm_100"),
        ("TPU v5 lite", "tpu", "v5e"),
        ("TPU v4", "tpu", "v4"),
    ],
)
def test_the_tiles_follow_the_chip_the_program_is_for(kind, platform, generation):
    # The chip generation comes from the device JAX traces for (here an abstract one, as a
    # program traced on this CPU for another platform would name it); a CPU names none.
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("one",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        assert target_generation(platform) == generation
    assert target_generation(platform) is None


def test_tiles_that_cannot_fit_are_refused_naming_the_limit():
    # Asked for blocks beyond the chip's on-chip memory, the kernels refuse when they are
    # built, naming the memory and tiles that would fit; the defaults and modest tiles pass.
    big = ea.BlockSizes(block_q=1024, block_k=1024)
    args = dict(seq=4096, mem=4096, dim=128, itemsize=4, mask=None)
    gpu = dict(kind="forward", generation="sm_90", **args)
    kernel_tiles(ea.BlockSizes(block_q=128, block_k=64), "gpu", **gpu)
    with pytest.raises(ValueError, match=r"shared memory per block of sm_90; block_q=\d+"):
        kernel_tiles(big, "gpu", **gpu)
    tpu = dict(kind="rows", generation="v5e", **args)
    kernel_tiles(ea.BlockSizes(), "tpu", **tpu)
    with pytest.raises(ValueError, match="16384 KiB of scoped VMEM of v5e"):
        kernel_tiles(ea.BlockSizes(block_q=4096, block_k=4096), "tpu", **tpu)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_float32_products_on_matrix_units_are_float32_accurate(platform):
    # Float32 operands split into the parts the matrix units take (GPU: two TF32 parts,
    # three products; TPU: three bfloat16 parts, six products), run in Pallas's
    # interpreters: within 2e-6 of the exact product, relative to sum_k |a_ik b_kj|. The
    # control, the products of the first parts alone (one TF32 or bfloat16 product), is
    # 100x further off.
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 96)) * np.exp(rng.uniform(-5, 5, size=(64, 1)))
    b = rng.normal(size=(48, 96)) * np.exp(rng.uniform(-5, 5, size=(1, 96)))
    exact = a @ b.T
    scale = np.abs(a) @ np.abs(b).T
    products = _kernels.Products(platform, "split")
    interpret = pltpu.InterpretParams() if platform == "tpu" else True

    def kernel(a_ref, b_ref, split_ref, first_ref):
        x, y = a_ref[...], b_ref[...]
        split_ref[...] = products.nt(x, y)
        first = products._parts(x)[0], products._parts(y)[0]
        first_ref[...] = jax.lax.dot_general(
            *first, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    out = jax.ShapeDtypeStruct(exact.shape, jnp.float32)
    split, first = pl.pallas_call(kernel, out_shape=(out, out), interpret=interpret)(
        jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    )
    # The inputs rounded to float32 are the operands: compare with their exact product.
    a32, b32 = np.asarray(a, np.float32).astype(np.float64), np.asarray(b, np.float32)
    exact = a32 @ b32.astype(np.float64).T
    error = np.max(np.abs(np.asarray(split, np.float64) - exact) / scale)
    control = np.max(np.abs(np.asarray(first, np.float64) - exact) / scale)
    assert error < 2e-6, error
    assert control > 100 * 2e-6, control


def test_a_pass_split_over_kernels_gives_the_same_sums(monkeypatch):
    # With a budget of 16 accumulated columns and one bilinear pair per kernel, the fused
    # forward keeps none of its terms, a factor of two pairs is expanded into two terms, and
    # every sum wider than 16 is computed in column chunks over several kernels, and a kernel
    # whose factors still hold two pairs steps on narrowed tiles: the same numbers as the
    # XLA loop (the GPU kernels, interpreted, in float64).
    original = _kernels.kernel_tiles

    def small(*args, **kwargs):
        tiles, _ = original(*args, **kwargs)
        return tiles, Budget(columns=16, pairs=1, narrow=True)

    monkeypatch.setattr(_kernels, "kernel_tiles", small)
    test_kernels_equal_the_xla_loop((37, 29, 24, Structure(causal=False), True, "float64"), "gpu")


def test_any_tiling_gives_the_same_numbers(getkey):
    # Sizes that are not powers of two (rounded up by the kernels), blocks longer than the
    # sequence, an integer block size: the kernels and the loop give the naive numbers.
    q, k, t = (jr.normal(getkey(), (19, 6)) for _ in range(3))
    tilings = (ea.BlockSizes(block_q=24, block_k=40, block_k_terms=17), 5, ea.BlockSizes(64))

    def derivatives(impl, block_size):
        def f(q):
            lse = ea.attention_logsumexp(
                q, k, causal=True, implementation=impl, block_size=block_size
            )
            return jnp.sum(jnp.sin(lse))

        return f(q), jax.grad(f)(q), jax.jvp(jax.grad(f), (q,), (t,))[1]

    got = jax.jit(lambda: [derivatives(i, b) for i in ("pallas", "blockwise") for b in tilings])()
    want = jax.jit(lambda: derivatives("naive", None))()
    for have in got:
        for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_half_precision_is_accepted_eagerly_as_under_jit():
    # bfloat16 values known at trace time (an eager call, a bfloat16 beta) are real numbers.
    x = jnp.ones((5, 8), jnp.bfloat16)
    beta = jnp.asarray(0.5, jnp.bfloat16)
    eager = ea.hopfield_energy(x, x, beta=beta)
    assert eager.dtype == jnp.float32
    np.testing.assert_allclose(eager, jax.jit(ea.hopfield_energy)(x, x, beta=beta))
    layer = ea.nn.EnergyTransformer(
        8, num_heads=2, head_dim=4, num_memories=4, num_steps=1, dtype=jnp.bfloat16, key=jr.key(0)
    )
    assert bool(jnp.all(jnp.isfinite(layer(x).astype(jnp.float32))))


def test_a_python_beta_leaves_no_host_callback():
    # Checked at trace time, so the program holds no runtime check (a host callback, which
    # would be a device-to-host round trip on a GPU and cannot be lowered from a CPU).
    x = jnp.ones((5, 8))
    text = jax.jit(lambda x: ea.hopfield_energy(x, x, beta=0.5)).lower(x).as_text()
    assert "callback" not in text


LOWERING = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, jax.random as jr
    import energyattn as ea

    SEQ, DIM = 520, 32  # above the blockwise threshold; not a block multiple
    key = jr.key(0)
    models = ea.models

    def programs(impl):
        # `impl` "auto" is the default; its control is "naive". Large programs are
        # (SEQ, DIM); the models' small ones (default settings: "auto" takes the naive
        # program on a CPU below the threshold, the kernels on GPUs and TPUs) are (12, 8).
        mask = jnp.arange(SEQ)[None, :] < 500
        ebt = lambda: models.EnergyBasedTransformer(8, 12, 16, implementation=impl, key=key)
        return {
            "hopfield_energy": lambda x: ea.hopfield_energy(
                x, 0.5 * x, beta=0.5, implementation=impl),
            "causal_masked_lse": lambda x: ea.attention_logsumexp(
                x, x, causal=True, mask=jnp.broadcast_to(mask, (SEQ, SEQ)),
                implementation=impl).sum(),
            "EnergyTransformer": lambda x: ea.nn.EnergyTransformer(
                DIM, num_heads=2, head_dim=16, num_memories=16, num_steps=1,
                implementation=impl, key=key)(x).sum(),
            "small HopfieldAttention": lambda x: ea.nn.HopfieldAttention(
                8, num_heads=2, implementation=impl, key=key)(x).sum(),
            "small EnergyBasedTransformer": lambda x: ebt()(x, jnp.sin(x).astype(jnp.float32)),
        }

    def transformations(f):
        return {
            "value_and_grad": jax.value_and_grad(f),
            "jvp": lambda x: jax.jvp(f, (x,), (x,)),
            "hvp": lambda x: jax.jvp(jax.grad(f), (x,), (x,))[1],
        }

    # Pallas asks the target device's kind when it lowers a kernel (newer JAX needs it to be
    # given for a platform this machine lacks): an abstract device says it.
    KINDS = {"cuda": ("NVIDIA H100 80GB HBM3", "gpu"), "tpu": ("TPU v5 lite", "tpu")}

    def shape(name):
        return (12, 8) if name.startswith("small") else (SEQ, DIM)

    def count(g, x, platform):
        kind, family = KINDS[platform]
        device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform=family)
        mesh = jax.sharding.AbstractMesh((1,), ("one",), abstract_device=device)
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = jax.jit(g).trace(x).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        kernels = text.count("xla.gpu.triton") + text.count("tpu_custom_call")
        return [kernels, text.count("stablehlo.while")]

    # (platform, program, transformation, dtypes): the forward and the terms' passes with
    # a mask, the causal triangle, the excluded diagonal and vmapped heads, in float32 and
    # bfloat16, on a GPU and a TPU.
    cells = []
    for name in programs("auto"):
        # A JVP is lowered once (its passes are the energy's wherever it sits).
        hows = {"hopfield_energy": ("value_and_grad", "jvp", "hvp"),
                "causal_masked_lse": ("value_and_grad", "hvp")}.get(name, ("value_and_grad",))
        for how in hows:
            cells.append(("cuda", name, how, ("float32", "bfloat16")[: 2 if how == "hvp" else 1]))
    cells += [
        ("tpu", "hopfield_energy", "value_and_grad", ("bfloat16",)),
        ("tpu", "causal_masked_lse", "hvp", ("float32",)),
        ("tpu", "EnergyTransformer", "value_and_grad", ("bfloat16",)),
        ("tpu", "small EnergyBasedTransformer", "value_and_grad", ("float32",)),
    ]
    found = {}
    for platform, name, how, dtypes in cells:
        # The naive program is the control: the loops it has are not attention's.
        naive = transformations(programs("naive")[name])[how]
        control = count(naive, jnp.ones(shape(name), "float32"), platform)
        for dtype in dtypes:
            g = transformations(programs("auto")[name])[how]
            got = count(g, jnp.ones(shape(name), dtype), platform)
            found[f"{platform} {dtype} {name} {how}"] = [got, control]
    print(json.dumps(found))
    """
)


def test_public_programs_lowered_for_gpus_and_tpus_hold_the_kernels():
    # Traced on this CPU, lowered for cuda and for tpu: every attention pass is a kernel
    # (Triton's, Mosaic's), and the program has no loop the naive program lacks (no XLA
    # loop over key blocks). Equinox's runtime checks are host callbacks, which lower only
    # for a platform this machine has, so the layers' programs are lowered with
    # EQX_ON_ERROR=nan (in a fresh process: the setting is read at import).
    env = dict(os.environ, EQX_ON_ERROR="nan")
    run = subprocess.run([sys.executable, "-c", LOWERING], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(found) == 14
    for where, ((kernels, loops), (naive_kernels, naive_loops)) in found.items():
        # A JVP is one fused pass; the other programs have a forward and a terms pass.
        assert kernels >= (1 if where.endswith("jvp") else 2) and naive_kernels == 0, where
        assert loops == naive_loops, where


def test_a_jvp_is_one_fused_pass_and_linearize_splits_it():
    # jax.jvp runs the forward and the tangent's row terms in one pass (one set of
    # exponentials); jax.linearize and reverse mode keep the primal pass apart from the
    # linear terms pass, so that the primal is known and nothing is recomputed.
    q = jnp.asarray(np.random.default_rng(0).normal(size=(7, 3)), jnp.float32)

    def f(q):
        return jnp.sum(ea.attention_logsumexp(q, q, beta=0.8, implementation="blockwise"))

    def fused(g):
        return str(jax.make_jaxpr(g)(q)).count("attention_forward_terms")

    assert fused(lambda q: jax.jvp(f, (q,), (q,))) == 1
    assert fused(lambda q: jax.jvp(jax.grad(f), (q,), (q,))) == 1  # forward over reverse
    assert fused(jax.grad(f)) == 0
    assert fused(lambda q: jax.linearize(f, q)[1](q)) == 0


def test_a_jvp_of_the_log_sum_exp_alone_keeps_no_attention_sized_tangent():
    # Its tangent is a term of the fused pass (sum_j p_ij s'_ij, one column per query); the
    # output's tangent and r = sum_j p_ij k'_j, unused, are dropped by dead-code elimination
    # (as `jax.jit` does before lowering), one head or vmapped over heads.
    from jax.interpreters import partial_eval as pe

    rng = np.random.default_rng(0)
    q, t = (jnp.asarray(rng.normal(size=(2, 7, 3)), jnp.float32) for _ in range(2))

    def f(q):
        return jnp.sum(ea.attention_logsumexp(q, q, beta=0.8, implementation="blockwise"))

    for g, x, tx in ((f, q[0], t[0]), (jax.vmap(f), q, t)):
        closed = jax.make_jaxpr(lambda x, tx, g=g: jax.jvp(g, (x,), (tx,)))(x, tx)
        jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True, True])
        fused = [e for e in jaxpr.eqns if "forward_terms" in str(e.params.get("prim", e.primitive))]
        assert len(fused) == 1
        # The log-sum-exp, the output (the forward's own), and the tangent: one column.
        lse, out, tangent = (v.aval.shape[-2:] for v in fused[0].outvars)
        assert out == (7, 3) and tangent == (7, 1)
    # And the same tangent as the naive path's.
    want = jax.jvp(lambda x: jnp.sum(ea.attention_logsumexp(x, x, beta=0.8)), (q[0],), (t[0],))
    np.testing.assert_allclose(jax.jvp(f, (q[0],), (t[0],)), want, rtol=1e-5)


def _pass_operands(g, *args):
    """The operands `(shape, dtype)` of every attention pass (forward, fused, terms) in the
    jaxpr of `g(*args)`."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("attention_"):
                found.append([(v.aval.shape, str(v.aval.dtype)) for v in eqn.invars])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(g)(*args).jaxpr)
    return found


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_jvp_takes_the_query_tangent_as_it_is(dtype):
    # The scores' tangent from the queries, beta q'_i . k_j, is q'_i . (beta k_j): the
    # tangent enters the pass in its own dtype (a half-precision one is one product on the
    # matrix units, not the three or six of a float32 copy of beta q' split into parts; at
    # 128k keys in bfloat16 on a TPU v5e, the JVP's temporaries fell from 224 to 128 MiB).
    # The control: a JVP that also moves beta forms a_i = beta q'_i + beta' q_i.
    q = jnp.asarray(np.random.default_rng(0).normal(size=(7, 3)), dtype)

    def f(q, beta):
        return jnp.sum(ea.attention_logsumexp(q, q, beta=beta, implementation="blockwise"))

    def float32_rows(g, *args):
        passes = _pass_operands(g, *args)
        assert passes
        return sum(op == ((7, 3), "float32") for ops in passes for op in ops)

    beta = jnp.asarray(0.8, jnp.float32)
    fixed = float32_rows(lambda q: jax.jvp(lambda q: f(q, beta), (q,), (q,)), q)
    moving = float32_rows(lambda q: jax.jvp(f, (q, beta), (q, beta)), q)
    assert fixed == 0 and moving == 1


def test_reverse_over_a_vmapped_jvp_equals_the_naive_path():
    # jax.jacrev(jax.jacfwd(f)): the transpose of a pass batched over tangents returns an
    # array's cotangent per batch entry (it once failed in the vprim's transpose: "got axis
    # spec None but output was batched"), with the fused forward and the kernels too.
    q = jnp.asarray(np.random.default_rng(0).normal(size=(7, 3)))
    mask = jnp.asarray(np.random.default_rng(1).random((7, 7)) < 0.7).at[2].set(False)

    def f(q, impl):
        lse = ea.attention_logsumexp(q, q, beta=0.8, mask=mask, causal=True, implementation=impl)
        return jnp.sum(jnp.sin(lse))

    @jax.jit
    def both():
        return {i: jax.jacrev(jax.jacfwd(f))(q, i) for i in ("naive", "blockwise", "pallas")}

    got = both()
    assert got["naive"].dtype == jnp.float64
    for impl in ("blockwise", "pallas"):
        np.testing.assert_allclose(got[impl], got["naive"], rtol=1e-10, atol=1e-10)


def _importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_aot_names_what_it_needs():
    # Without the device-compile extra (the suite's own environment), asking for a chip
    # says what to install; an unknown chip lists the known ones.
    with pytest.raises(ValueError, match=r"chip must be one of \['a100', 'b200', 'h100'"):
        ea.aot.device("h200")
    needs = {"v5e": "libtpu", "h100": "jax_plugins.xla_cuda12"}
    for chip in [chip for chip, module in needs.items() if not _importable(module)]:
        with pytest.raises(RuntimeError, match="device-compile"):
            ea.aot.device(chip)


def test_aot_finds_tpu_kernels_by_name_under_vmap_and_refuses_nameless_ones(tmp_path):
    # The compiler's dump names a kernel by its pallas_call, "vmap_" + it when batched; a
    # kernel named by no location ("tpu_custom_call") cannot be found by name: an error.
    from energyattn import aot

    call = ' = (f32[8]) custom-call(%p), custom_call_target="tpu_custom_call", backend_config='
    used = '{"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"4096"}]}'
    dump = tmp_path / "module_0001.jit_f.after_codegen.txt"
    names = ("energy_attention_forward.1", "vmap_vmap_energy_attention_row_terms.2", "other.3")
    dump.write_text("".join(f"  %{name}{call}{used}\n" for name in names))
    found = aot._tpu_kernels(str(tmp_path), ("energy_attention",))
    assert [(k.name, k.vmem) for k in found] == [
        ("energy_attention_forward", 4096),
        ("vmap_vmap_energy_attention_row_terms", 4096),
    ]
    assert len(aot._tpu_kernels(str(tmp_path), None)) == 3
    dump.write_text(f"  %tpu_custom_call.1{call}{used}\n")
    with pytest.raises(RuntimeError, match="JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS"):
        aot._tpu_kernels(str(tmp_path), ("energy_attention",))


def test_tpu_block_indices_are_int32_in_64_bit_mode():
    # Mosaic takes int32 block indices; in 64-bit mode (the suite's) a literal or the causal
    # triangle's arithmetic is int64, and every TPU kernel failed to compile on the chips
    # (tests/test_device_compile.py compiles a 64-bit program on each).
    from energyattn._energy._attention import _kernels_tpu

    assert jax.config.values["jax_enable_x64"]
    spec = _kernels_tpu._block_spec((8, 128), lambda i, j: (0, jnp.minimum(j + i, 3)))
    i = jnp.int32(1)
    assert [b.dtype for b in jax.eval_shape(spec.index_map, i, i)] == [jnp.int32] * 2


def test_segment_ids_are_checked_and_make_padding():
    # Padding from lengths: keys beyond 3 are attended by no query, queries beyond 2 attend
    # to nothing; `attended` finds the keys some query attends without a (seq, mem) matrix.
    seg = ea.SegmentIds.padding(4, 5, key_length=3, query_length=2)
    np.testing.assert_array_equal(
        seg.dense(), np.array([[1, 1, 1, 0, 0]] * 2 + [[0] * 5] * 2, bool)
    )
    np.testing.assert_array_equal(seg.attended(), [True, True, True, False, False])
    q = jnp.ones((4, 2))
    with pytest.raises(ValueError, match=r"SegmentIds.keys must have shape \(mem=4,\)"):
        ea.attention_logsumexp(q, q, mask=ea.SegmentIds(jnp.zeros(4, int), jnp.zeros(3, int)))
    with pytest.raises(ValueError, match="SegmentIds.query must be integers"):
        ea.attention_logsumexp(q, q, mask=ea.SegmentIds(jnp.zeros(4), jnp.zeros(4, int)))
    # A layer that holds its scores (here SoftmaxAttention's check) takes a dense mask.
    with pytest.raises(ValueError, match=r"takes no SegmentIds \(pass mask.dense\(\)\)"):
        check_mask(seg, (4, 5), "seq mem")
