"""The blockwise (flash-style) attention log-sum-exp and its dispatch.

Every implementation must give the naive energy's value, gradient (the attention update) and
second derivative (training through a descent step); the blockwise one must do so without
holding the `(seq, mem)` matrix.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn._energy import _attention_lse


def lse(q, k, beta, mask, exclude_self, method, block_size=4):
    return _attention_lse.lse_rows(q, k, beta, mask, exclude_self, method, block_size)


def assert_trees_close(a, b, rtol=1e-10, atol=1e-10):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("exclude_self", [False, True])
def test_blockwise_value_gradient_and_second_derivative_equal_naive(getkey, masked, exclude_self):
    # 11 keys in blocks of 4: the last block is padded; row 3 has nothing to attend to.
    q, k = jr.normal(getkey(), (11, 5)), jr.normal(getkey(), (11, 5))
    beta = jnp.asarray(0.8)
    mask = jr.bernoulli(getkey(), 0.6, (11, 11)).at[3].set(False) if masked else None
    weights = jr.normal(getkey(), (11,))

    @functools.partial(jax.jit, static_argnums=3)  # one compilation per method, not per op
    def loss(q, k, beta, method):
        return jnp.sum(weights * jnp.sin(lse(q, k, beta, mask, exclude_self, method)))

    def outer(q, k, beta, method):
        grads = jax.grad(loss, argnums=(0, 1))(q, k, beta, method)
        return sum(jnp.sum(jnp.cos(x)) for x in grads)

    g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    g2 = jax.jit(jax.grad(outer, argnums=(0, 1, 2)), static_argnums=3)
    for f in (loss, g, g2):  # value, gradient, gradient of a function of the gradient
        naive, block = (f(q, k, beta, m) for m in ("naive", "blockwise"))
        assert_trees_close(naive, block)
    if masked:  # an empty row has log-sum-exp 0 and no force
        values = lse(q, k, beta, mask, exclude_self, "blockwise")
        assert values[3] == 0
        dq = jax.grad(lambda q: jnp.sum(lse(q, k, beta, mask, exclude_self, "blockwise")))(q)
        assert np.all(np.asarray(dq[3]) == 0)


def test_public_function_matches_a_numpy_reference(getkey):
    q, k = jr.normal(getkey(), (6, 3)), jr.normal(getkey(), (9, 3))
    scores = 0.5 * np.asarray(q) @ np.asarray(k).T
    expected = np.log(np.exp(scores).sum(axis=1))
    for impl in ("naive", "blockwise"):
        got = ea.attention_logsumexp(q, k, beta=0.5, implementation=impl, block_size=2)
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    # Excluding the diagonal without a mask equals the explicit mask.
    qs = jr.normal(getkey(), (7, 3))
    a = ea.attention_logsumexp(qs, qs, exclude_self=True, implementation="blockwise", block_size=3)
    b = ea.attention_logsumexp(qs, qs, mask=~jnp.eye(7, dtype=bool), implementation="naive")
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_hopfield_step_through_blockwise_is_softmax_attention(getkey):
    q, m = jr.normal(getkey(), (10, 4)), jr.normal(getkey(), (13, 4))
    energy = ea.HopfieldEnergy(m, beta=0.7, implementation="blockwise", block_size=4)
    step = q - jax.jit(jax.grad(energy))(q)
    expected = jax.nn.softmax(0.7 * q @ m.T, axis=-1) @ m
    np.testing.assert_allclose(step, expected, rtol=1e-10, atol=1e-12)
    naive = ea.hopfield_energy(q, m, beta=0.7, implementation="naive")
    np.testing.assert_allclose(energy(q), naive, rtol=1e-12)


def test_garbage_in_masked_out_memory_stays_out(getkey):
    # A memory no query may attend to (padding) holding NaN: the blockwise energy and its
    # gradient ignore it exactly like the naive one.
    q, m = jr.normal(getkey(), (5, 3)), jr.normal(getkey(), (9, 3))
    m = m.at[7].set(jnp.nan)
    mask = jnp.ones((5, 9), bool).at[:, 7].set(False)
    values = {
        impl: jax.jit(
            jax.value_and_grad(
                lambda q, impl=impl: ea.hopfield_energy(
                    q, m, mask=mask, implementation=impl, block_size=4
                )
            )
        )(q)
        for impl in ("naive", "blockwise")
    }
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(values))
    assert_trees_close(values["naive"], values["blockwise"])


def test_training_through_hopfield_attention_steps_equals_naive(getkey):
    x = jr.normal(getkey(), (3, 9, 8))  # a batch of 3
    layers = {
        impl: ea.nn.HopfieldAttention(
            8,
            num_heads=2,
            num_steps=2,
            step_size=0.5,
            implementation=impl,
            block_size=4,
            key=jr.key(1),
        )
        for impl in ("naive", "blockwise")
    }

    @eqx.filter_jit
    @eqx.filter_value_and_grad
    def loss(layer, x):
        return jnp.mean(jnp.square(jax.vmap(layer)(x)))

    assert_trees_close(loss(layers["naive"], x), loss(layers["blockwise"], x))


def test_energy_transformer_heads_blockwise_equals_naive(getkey):
    # Queries and keys both come from g, so the keys' cotangent of the custom_vjp matters.
    models = {
        impl: ea.nn.EnergyTransformer(
            6,
            num_heads=2,
            head_dim=3,
            num_memories=5,
            num_steps=2,
            implementation=impl,
            key=jr.key(2),
        )
        for impl in ("naive", "blockwise")
    }
    x = jr.normal(getkey(), (9, 6))
    mask = jr.bernoulli(getkey(), 0.7, (9, 9))

    @eqx.filter_jit
    @eqx.filter_value_and_grad
    def loss(model, x):
        return jnp.sum(jnp.square(model(x, mask=mask)))

    assert_trees_close(loss(models["naive"], x), loss(models["blockwise"], x))
    g = models["naive"].layer_norm(x)
    values = [
        ea.transformer_attention_energy(
            g, m.w_query, m.w_key, beta=m.beta, implementation=m.implementation, block_size=4
        )
        for m in models.values()
    ]
    np.testing.assert_allclose(values[0], values[1], rtol=1e-12)


def test_auto_dispatch():
    select = ea.select_implementation
    common = dict(dtype=jnp.float32, head_dim=64, structured_mask=False, backend="cpu")
    assert select("auto", entries=ea.BLOCKWISE_THRESHOLD, **common) == "naive"
    assert select("auto", entries=ea.BLOCKWISE_THRESHOLD + 1, **common) == "blockwise"
    gpu = dict(common, backend="gpu")
    assert select("auto", entries=10, **dict(gpu, dtype=jnp.bfloat16)) == "cudnn"
    assert select("auto", entries=10, **dict(gpu, dtype=jnp.float16)) == "cudnn"
    # float32, a head size cuDNN does not take, or a mask: the portable paths.
    assert select("auto", entries=2**30, **gpu) == "blockwise"
    assert select("auto", entries=2**30, **dict(gpu, dtype=jnp.bfloat16, head_dim=12)) == (
        "blockwise"
    )
    assert select("auto", entries=10, **dict(gpu, dtype=jnp.bfloat16, structured_mask=True)) == (
        "naive"
    )
    assert select("naive", entries=2**30, **gpu) == "naive"
    with pytest.raises(ValueError, match="needs an NVIDIA GPU backend.*got backend 'cpu'"):
        select("cudnn", entries=10, **dict(common, dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="implementation must be one of"):
        select("flash", entries=10, **common)


def test_layers_pick_blockwise_above_the_threshold(monkeypatch, getkey):
    calls = []
    original = _attention_lse._blockwise_forward

    def spy(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(_attention_lse, "_blockwise_forward", spy)
    monkeypatch.setattr(_attention_lse, "_FUSED", {})
    x = jr.normal(getkey(), (16, 4))
    layer = ea.nn.HopfieldAttention(4, num_heads=2, key=getkey())
    layer(x)
    assert calls == []  # 2 x 16 x 16 = 512 entries: naive
    monkeypatch.setattr(_attention_lse, "BLOCKWISE_THRESHOLD", 511)
    layer(x)
    assert calls and set(calls) == {(16, 2)}  # one head's queries, traced under vmap


def test_fused_kernel_wiring_with_the_xla_kernel(monkeypatch, getkey):
    # cuDNN needs a GPU; the same code path (layouts, the float32 log-sum-exp, the keys'
    # cotangent through the kernel's vjp) runs here through the "xla" implementation.
    monkeypatch.setattr(_attention_lse, "_FUSED_KERNEL", "xla")
    monkeypatch.setattr(_attention_lse, "_FUSED", {})
    q = jr.normal(getkey(), (8, 16), jnp.float32)
    k = jr.normal(getkey(), (12, 16), jnp.float32)
    beta = jnp.asarray(0.3, jnp.float32)

    def loss(q, k, beta, method):
        return jnp.sum(jnp.sin(lse(q, k, beta, None, False, method)))

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    naive, fused = (value_and_grad(q, k, beta, m) for m in ("naive", "cudnn"))
    assert_trees_close(naive, fused, rtol=2e-5, atol=2e-5)

    def through_step(q, k, method):  # training through the attention step
        return jnp.sum(jnp.square(jax.grad(loss)(q, k, beta, method)))

    grad_through = jax.jit(jax.grad(through_step, (0, 1)), static_argnums=2)
    naive, fused = (grad_through(q, k, m) for m in ("naive", "cudnn"))
    assert_trees_close(naive, fused, rtol=1e-4, atol=1e-4)


def test_bfloat16_inputs_accumulate_in_float32(getkey):
    q = jr.normal(getkey(), (9, 4)).astype(jnp.bfloat16)
    m = jr.normal(getkey(), (11, 4)).astype(jnp.bfloat16)
    value, grad = jax.jit(
        jax.value_and_grad(
            lambda q: ea.hopfield_energy(q, m, implementation="blockwise", block_size=4)
        )
    )(q)
    assert value.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    reference = ea.hopfield_energy(q.astype(jnp.float32), m.astype(jnp.float32))
    np.testing.assert_allclose(value, reference, rtol=1e-5)


def test_blockwise_gradient_does_not_hold_the_score_matrix(getkey):
    # XLA's own accounting of the compiled attention step (value and gradient): the naive
    # path holds (seq, mem) matrices, the blockwise one (seq, block) blocks.
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

    matrix = seq * seq * 4
    for fn in (step, train):
        assert temp_bytes(fn, "naive") >= matrix
        assert temp_bytes(fn, "blockwise") < matrix / 4
    w = jr.normal(getkey(), (2, 8, dim), jnp.float32) / dim
    naive = temp_bytes(train_transformer, "naive", w, q)
    assert naive >= 2 * matrix  # at least one matrix per head
    assert temp_bytes(train_transformer, "blockwise", w, q) < naive / 8


def test_bad_arguments(user_mode):
    q = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="exclude_self needs as many queries as keys"):
        ea.attention_logsumexp(q, jnp.ones((5, 3)), exclude_self=True)
    with pytest.raises(ValueError, match=r"keys must have shape \(mem, dim=3\), got \(5, 2\)"):
        ea.attention_logsumexp(q, jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        ea.attention_logsumexp(q, q, block_size=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        ea.nn.HopfieldAttention(3, implementation="fast", key=jr.key(0))
    with pytest.raises(ValueError, match="implementation must be 'auto', 'naive' or"):
        ea.nn.EnergyTransformer(
            4, num_heads=1, head_dim=2, num_memories=3, implementation="cudnn", key=jr.key(0)
        )
