"""The blockwise (flash-style) attention log-sum-exp and its dispatch.

Every implementation must give the naive energy's value, gradient (the attention update) and
second derivative (training through a descent step); the blockwise one must do so without
holding the `(seq, mem)` matrix.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn._energy import _attention
from energyattn._energy._attention import _cudnn, _derivatives, _policy


def lse(q, k, beta, mask, exclude_self, method, block_size=4):
    return _attention.lse_rows(q, k, beta, mask, exclude_self, method, block_size)


def assert_trees_close(a, b, rtol=1e-10, atol=1e-10):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "masked, exclude_self, block_size",
    [(False, False, 4), (True, False, 4), (False, True, 4), (True, True, 4), (True, True, None)],
)
def test_blockwise_value_gradient_and_second_derivative_equal_naive(
    getkey, monkeypatch, masked, exclude_self, block_size
):
    # 11 keys in blocks of 4: the last block is padded; row 3 has nothing to attend to. With
    # the default blocks (made 6 here) the forward takes blocks of 6 keys and the derivatives'
    # passes blocks of 3: every pass pads its last block differently.
    monkeypatch.setattr(_policy, "DEFAULT_BLOCK_SIZE", 6)
    assert _policy.block_sizes(11, block_size) == ((4, 4) if block_size else (6, 3))
    q, k = jr.normal(getkey(), (11, 5)), jr.normal(getkey(), (11, 5))
    beta = np.asarray(0.8)
    mask = None
    if masked:
        mask = np.array(jr.bernoulli(getkey(), 0.6, (11, 11)))
        mask[3] = False
        mask = jax.device_put(mask)  # the private `lse_rows` takes JAX arrays only
    weights = jr.normal(getkey(), (11,))

    def loss(q, k, beta, method):
        rows = lse(q, k, beta, mask, exclude_self, method, block_size)
        return jnp.sum(weights * jnp.sin(rows))

    def outer(q, k, beta, method):
        grads = jax.grad(loss, argnums=(0, 1))(q, k, beta, method)
        return sum(jnp.sum(jnp.cos(x)) for x in grads)

    g = jax.value_and_grad(loss, argnums=(0, 1, 2))
    g2 = jax.grad(outer, argnums=(0, 1, 2))

    @jax.jit  # one compilation for everything checked, not one per op
    def run(q, k, beta):
        # value, gradient, gradient of a function of the gradient, by each method
        results = {m: [f(q, k, beta, m) for f in (loss, g, g2)] for m in ("naive", "blockwise")}
        # the blockwise rows and the force on the queries (for the empty row)
        rows = lse(q, k, beta, mask, exclude_self, "blockwise", block_size)
        dq = jax.grad(
            lambda q: jnp.sum(lse(q, k, beta, mask, exclude_self, "blockwise", block_size))
        )(q)
        return results, rows, dq

    results, values, dq = jax.device_get(run(q, k, beta))
    for naive, block in zip(results["naive"], results["blockwise"], strict=True):
        assert_trees_close(naive, block)
    if masked:  # an empty row has log-sum-exp 0 and no force
        assert values[3] == 0
        assert np.all(np.asarray(dq[3]) == 0)


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

    @eqx.filter_value_and_grad
    def loss(layer, x):
        return jnp.mean(jnp.square(jax.vmap(layer)(x)))

    results = eqx.filter_jit(lambda layers, x: {i: loss(f, x) for i, f in layers.items()})(
        layers, x
    )
    assert_trees_close(results["naive"], results["blockwise"])


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

    @eqx.filter_value_and_grad
    def loss(model, x):
        return jnp.sum(jnp.square(model(x, mask=mask)))

    @eqx.filter_jit
    def run(models, x):
        losses = {impl: loss(model, x) for impl, model in models.items()}
        g = models["naive"].layer_norm(x)
        values = [
            ea.transformer_attention_energy(
                g, m.w_query, m.w_key, beta=m.beta, implementation=m.implementation, block_size=4
            )
            for m in models.values()
        ]
        return losses, values

    losses, values = run(models, x)
    assert_trees_close(losses["naive"], losses["blockwise"])
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


def test_fused_kernel_wiring_with_the_xla_kernel(monkeypatch, getkey):
    # cuDNN needs a GPU; the same code path (layouts, the float32 log-sum-exp, the keys'
    # cotangent through the kernel's vjp) runs here through the "xla" implementation.
    monkeypatch.setattr(_cudnn, "FUSED_KERNEL", "xla")
    q = jr.normal(getkey(), (8, 16), jnp.float32)
    k = jr.normal(getkey(), (12, 16), jnp.float32)
    beta = jnp.asarray(0.3, jnp.float32)

    def loss(q, k, beta, method):
        return jnp.sum(jnp.sin(lse(q, k, beta, None, False, method)))

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2))

    def through_step(q, k, method):  # training through the attention step
        return jnp.sum(jnp.square(jax.grad(loss)(q, k, beta, method)))

    grad_through = jax.grad(through_step, (0, 1))

    @jax.jit
    def run(q, k, beta):
        methods = ("naive", "cudnn")
        return [value_and_grad(q, k, beta, m) for m in methods], [
            grad_through(q, k, m) for m in methods
        ]

    (naive, fused), (naive_through, fused_through) = run(q, k, beta)
    assert_trees_close(naive, fused, rtol=2e-5, atol=2e-5)
    assert_trees_close(naive_through, fused_through, rtol=1e-4, atol=1e-4)


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
    q = np.ones((4, 3))
    with pytest.raises(ValueError, match="exclude_self needs as many queries as keys"):
        ea.attention_logsumexp(q, np.ones((5, 3)), exclude_self=True)
    with pytest.raises(ValueError, match=r"keys must have shape \(mem, dim=3\), got \(5, 2\)"):
        ea.attention_logsumexp(q, np.ones((5, 2)))
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        ea.attention_logsumexp(q, q, block_size=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        ea.nn.HopfieldAttention(3, implementation="fast", key=jr.key(0))
    with pytest.raises(ValueError, match="implementation must be 'auto', 'naive' or"):
        ea.nn.EnergyTransformer(
            4, num_heads=1, head_dim=2, num_memories=3, implementation="cudnn", key=jr.key(0)
        )
