"""The blockwise (flash-style) attention log-sum-exp and its dispatch.

Every implementation gives the naive energy's value and every derivative (checked as a grid
in `test_derivative_grid.py`); here: the dispatch, the public function, masks, dtypes, and
that the blockwise derivatives, of every mode, never hold the `(seq, mem)` matrix.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn._energy._attention import _derivatives, _logsumexp, _policy


def assert_trees_close(a, b, rtol=1e-10, atol=1e-10):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_public_function_matches_a_numpy_reference(getkey):
    q, k = jr.normal(getkey(), (6, 3)), jr.normal(getkey(), (9, 3))
    qs = jr.normal(getkey(), (7, 3))

    @jax.jit
    def run(q, k, qs):
        got = {
            impl: ea.attention_logsumexp(q, k, beta=0.5, implementation=impl, block_size=2)
            for impl in ("naive", "blockwise")
        }
        a = ea.attention_logsumexp(
            qs, qs, exclude_self=True, implementation="blockwise", block_size=3
        )
        b = ea.attention_logsumexp(qs, qs, mask=~np.eye(7, dtype=bool), implementation="naive")
        return got, a, b

    got, a, b = run(q, k, qs)
    scores = 0.5 * np.asarray(q) @ np.asarray(k).T
    expected = np.log(np.exp(scores).sum(axis=1))
    for impl in ("naive", "blockwise"):
        np.testing.assert_allclose(got[impl], expected, rtol=1e-12)
    # Excluding the diagonal without a mask equals the explicit mask.
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_causal_structure_equals_an_explicit_triangle(monkeypatch, getkey):
    # `causal` (alone, and strictly with `exclude_self` under a mask that allows everything
    # above the diagonal) equals the explicit triangle on the naive and blockwise paths:
    # values, gradients, a JVP and a Hessian-vector product (forward over reverse). 13 keys
    # in blocks of 4: several blocks, the last padded; row 0 is empty when strictly causal.
    seq = 13
    q, k, tq, tk = (jr.normal(getkey(), (seq, 3)) for _ in range(4))
    tril = np.tril(np.ones((seq, seq), bool))
    mask = np.ones((seq, seq), bool)
    mask[:, 9] = mask[5] = False  # a column nobody attends to, a row attending to nothing
    cases = {  # (mask, exclude_self) and the explicit triangle they amount to with causal
        "causal": (None, False, tril),
        "strict_masked": (mask, True, np.tril(tril, -1) & mask),
    }
    flags = []
    select = _logsumexp.select_implementation
    monkeypatch.setattr(
        _logsumexp,
        "select_implementation",
        lambda *a, **kw: flags.append(kw["structured_mask"]) or select(*a, **kw),
    )

    def derivatives(mask, exclude_self, causal, impl):
        def loss(q, k):
            lse = ea.attention_logsumexp(
                q, k, beta=0.8, mask=mask, exclude_self=exclude_self, causal=causal,
                implementation=impl, block_size=4,
            )  # fmt: skip
            return jnp.sum(jnp.sin(lse)), lse

        grad = lambda q, k: jax.grad(loss, (0, 1), has_aux=True)(q, k)[0]  # noqa: E731
        (_, lse), tangent = jax.jvp(loss, (q, k), (tq, tk))
        hvp = jax.jvp(grad, (q, k), (tq, tk))[1]
        return lse, grad(q, k), tangent, hvp

    @jax.jit
    def run():
        return {
            name: {
                "triangle": derivatives(triangle, False, False, "naive"),
                **{impl: derivatives(m, ex, True, impl) for impl in ("naive", "blockwise")},
            }
            for name, (m, ex, triangle) in cases.items()
        }

    got = run()
    assert flags and all(flags)  # causal alone counts as a mask: never cuDNN
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got))
    for paths in got.values():
        for impl in ("naive", "blockwise"):
            assert_trees_close(paths[impl], paths["triangle"])
    assert float(got["strict_masked"]["blockwise"][0][0]) == 0.0  # nothing allowed: 0


def test_hopfield_step_through_blockwise_is_softmax_attention(getkey):
    q, m = jr.normal(getkey(), (10, 4)), jr.normal(getkey(), (13, 4))

    @jax.jit
    def run(q, m):
        energy = ea.HopfieldEnergy(m, beta=0.7, implementation="blockwise", block_size=4)
        value, grad = jax.value_and_grad(energy)(q)
        expected = jax.nn.softmax(0.7 * q @ m.T, axis=-1) @ m
        naive = ea.hopfield_energy(q, m, beta=0.7, implementation="naive")
        return q - grad, expected, value, naive

    step, expected, value, naive = run(q, m)
    np.testing.assert_allclose(step, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(value, naive, rtol=1e-12)


def test_garbage_in_masked_out_memory_stays_out(getkey):
    # A memory no query may attend to (padding) holding NaN: the blockwise energy and its
    # gradient ignore it exactly like the naive one.
    q, m = jr.normal(getkey(), (5, 3)), np.array(jr.normal(getkey(), (9, 3)))
    m[7] = np.nan
    mask = np.ones((5, 9), bool)
    mask[:, 7] = False

    def value_and_grad(q, impl):
        def energy(q):
            return ea.hopfield_energy(q, m, mask=mask, implementation=impl, block_size=4)

        return jax.value_and_grad(energy)(q)

    values = jax.jit(lambda q: {i: value_and_grad(q, i) for i in ("naive", "blockwise")})(q)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(values))
    assert_trees_close(values["naive"], values["blockwise"])


def test_auto_dispatch():
    select = ea.select_implementation
    common = dict(dtype=jnp.float32, head_dim=64, structured_mask=False, backend="cpu")
    assert select("auto", entries=ea.BLOCKWISE_THRESHOLD, **common) == "small"
    assert select("auto", entries=ea.BLOCKWISE_THRESHOLD + 1, **common) == "blockwise"
    # The choice reads the shapes, never the backend: the platform the program is lowered
    # for picks the kernels, the XLA loop or the naive program (`_passes`, `lse_rows`).
    gpu = dict(common, backend="gpu")
    assert select("auto", entries=10, **dict(gpu, dtype=jnp.bfloat16)) == "small"
    assert select("small", entries=2**30, **common) == "small"
    assert select("auto", entries=2**30, **dict(gpu, dtype=jnp.bfloat16)) == "blockwise"
    assert select("auto", entries=2**30, **dict(gpu, structured_mask=True)) == "blockwise"
    assert select("pallas", entries=10, **common) == "pallas"
    assert select("cudnn", entries=10, **dict(gpu, dtype=jnp.bfloat16)) == "cudnn"
    assert select("naive", entries=2**30, **gpu) == "naive"
    with pytest.raises(ValueError, match="needs an NVIDIA GPU backend.*got backend 'cpu'"):
        select("cudnn", entries=10, **dict(common, dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="implementation must be one of"):
        select("flash", entries=10, **common)


def test_layers_pick_blockwise_above_the_threshold(monkeypatch, getkey):
    calls = []
    original = _derivatives.run_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(_derivatives, "run_forward", spy)
    x = jr.normal(getkey(), (16, 4))
    layer = ea.nn.HopfieldAttention(4, num_heads=2, key=getkey())
    # The implementation is picked while the layer is traced: each call traces it anew.
    eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
    assert calls == []  # 2 x 16 x 16 = 512 entries: naive
    monkeypatch.setattr(_policy, "BLOCKWISE_THRESHOLD", 511)
    eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
    assert calls and set(calls) == {(16, 2)}  # one head's queries, traced under vmap


def test_bfloat16_inputs_accumulate_in_float32(getkey):
    q = jr.normal(getkey(), (9, 4)).astype(jnp.bfloat16)
    m = jr.normal(getkey(), (11, 4)).astype(jnp.bfloat16)

    @jax.jit
    def run(q, m):
        value, grad = jax.value_and_grad(
            lambda q: ea.hopfield_energy(q, m, implementation="blockwise", block_size=4)
        )(q)
        return value, grad, ea.hopfield_energy(q.astype(jnp.float32), m.astype(jnp.float32))

    value, grad, reference = run(q, m)
    assert value.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(value, reference, rtol=1e-5)


def test_blockwise_derivatives_of_every_mode_do_not_hold_the_score_matrix(getkey):
    # XLA's own accounting of the compiled programs (compiled, not run): the naive path holds
    # (seq, mem) matrices, the blockwise one (seq, block) blocks, in reverse mode, forward
    # mode and both Hessian-vector products.
    seq, dim = 1024, 16
    q = jr.normal(getkey(), (seq, dim), jnp.float32)
    m = jr.normal(getkey(), (seq, dim), jnp.float32)

    def energy(q, m, impl):
        return ea.hopfield_energy(q, m, beta=0.25, implementation=impl, block_size=64)

    def step(q, m, impl):  # the attention step: energy and gradient
        return jax.value_and_grad(energy)(q, m, impl)

    def train(q, m, impl):  # training through the step: its second derivatives
        return jax.grad(lambda q, m: jnp.sum(jnp.square(step(q, m, impl)[1])), (0, 1))(q, m)

    def temp_bytes(fn, impl, *args):
        args = args or (q, m)
        compiled = jax.jit(fn, static_argnums=2).lower(*args, impl).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    def train_transformer(w, g, impl):  # the ET's keys move too: the keys' cotangent's VJP
        def energy(g, w):
            return ea.transformer_attention_energy(
                g, w, w, beta=0.25, implementation=impl, block_size=64
            )

        return jax.grad(lambda w: jnp.sum(jnp.square(jax.grad(energy)(g, w))))(w)

    v = jr.normal(getkey(), (seq, dim), jnp.float32)

    def jvp(q, m, impl):  # forward mode
        return jax.jvp(lambda q, m: energy(q, m, impl), (q, m), (v, v))

    def hvp_forward(q, m, impl):  # forward over reverse
        return jax.jvp(lambda q: jax.grad(energy)(q, m, impl), (q,), (v,))

    def hvp_reverse(q, m, impl):  # reverse over reverse
        return jax.grad(lambda q: jnp.vdot(jax.grad(energy)(q, m, impl), v))(q)

    matrix = seq * seq * 4
    for fn in (step, train, jvp, hvp_forward, hvp_reverse):
        assert temp_bytes(fn, "naive") >= matrix
        assert temp_bytes(fn, "blockwise") < matrix / 4
    w = jr.normal(getkey(), (2, 8, dim), jnp.float32) / dim
    naive = temp_bytes(train_transformer, "naive", w, q)
    assert naive >= 2 * matrix  # at least one matrix per head
    assert temp_bytes(train_transformer, "blockwise", w, q) < naive / 8


def test_bad_arguments(user_mode):
    q = np.ones((4, 3))
    with pytest.raises(ValueError, match="exclude_self needs as many queries as keys"):
        ea.attention_logsumexp(q, np.ones((5, 3)), exclude_self=True)
    with pytest.raises(ValueError, match="causal needs as many queries as keys, got 4 and 5"):
        ea.attention_logsumexp(q, np.ones((5, 3)), causal=True)
    with pytest.raises(ValueError, match=r"keys must have shape \(mem, dim=3\), got \(5, 2\)"):
        ea.attention_logsumexp(q, np.ones((5, 2)))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        ea.attention_logsumexp(q, q, block_size=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        ea.nn.HopfieldAttention(3, implementation="fast", key=jr.key(0))
    with pytest.raises(ValueError, match="implementation must be one of"):
        ea.nn.EnergyTransformer(
            4, num_heads=1, head_dim=2, num_memories=3, implementation="fast", key=jr.key(0)
        )
    # cuDNN is taken by name, and refused where it cannot serve (here: no GPU, a mask).
    et = ea.nn.EnergyTransformer(
        4, num_heads=1, head_dim=2, num_memories=3, implementation="cudnn", key=jr.key(0)
    )
    with pytest.raises(ValueError, match="needs an NVIDIA GPU backend.*mask=yes"):
        et(np.ones((3, 4), np.float32))


def test_heads_in_turn_equals_batched_heads_through_a_descent(monkeypatch, getkey):
    # On a CPU, large blocks run a vmap over heads head by head (a custom_vmap inside the
    # passes). Through a descent (lax.scan) under vmap, to the Hessian-vector product reverse
    # over reverse (which once failed partial evaluation there), it equals batched heads.
    q, k, v = (jr.normal(getkey(), (2, 8, 3)) for _ in range(3))

    def loss(q):
        def step(x, _):
            energy = lambda x: jnp.sum(  # noqa: E731
                jax.vmap(
                    lambda a, b: ea.hopfield_energy(a, b, implementation="blockwise", block_size=3)
                )(x, k)
            )
            return x - 0.5 * jax.grad(energy)(x), None

        return jnp.sum(jnp.sin(jax.lax.scan(step, q, None, length=2)[0]))

    def derivatives(q):
        hvp = jax.grad(lambda q: jnp.vdot(jax.grad(loss)(q), v))(q)
        return loss(q), jax.grad(loss)(q), hvp, jax.jvp(jax.grad(loss), (q,), (v,))[1]

    batched = jax.jit(derivatives)(q)
    monkeypatch.setattr(_policy, "HEADS_IN_TURN_ENTRIES", 0)  # every block is "large"
    in_turn = jax.jit(derivatives)(q)
    assert_trees_close(in_turn, batched, rtol=1e-12, atol=1e-12)


def test_mixed_precision_queries_and_keys_every_mode(getkey):
    # float32 queries against float64 keys (accumulation in float64): the blockwise path's
    # derivatives scale the queries by beta themselves, in the accumulation dtype.
    q = jr.normal(getkey(), (9, 4)).astype(jnp.float32)
    m = jr.normal(getkey(), (11, 4))

    def derivatives(impl):
        def energy(q):
            return ea.hopfield_energy(q, m, beta=0.5, implementation=impl, block_size=4)

        v = jnp.ones_like(q)
        return jax.grad(energy)(q), jax.jvp(jax.grad(energy), (q,), (v,))[1]

    got, expected = jax.jit(lambda: (derivatives("blockwise"), derivatives("naive")))()
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-6)
