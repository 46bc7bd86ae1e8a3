"""`ea.nn.SoftmaxAttention` and `ea.nn.HopfieldAttention`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import energyattn as ea


@eqx.filter_jit
def run(layer, *args, **kwargs):
    """Call a layer compiled: one XLA program per test instead of op-by-op dispatch."""
    return layer(*args, **kwargs)


@eqx.filter_jit
def run_each(layers, *args, **kwargs):
    """Call each of several layers on the same inputs, all in one compiled program."""
    return [layer(*args, **kwargs) for layer in layers]


def reference_attention(q, k, v, scale, mask=None):
    """Hand-written NumPy multi-head attention on (heads, seq, head_dim) arrays."""
    scores = scale * np.einsum("hsd,hmd->hsm", q, k)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return np.einsum("hsm,hmd->hsd", weights / weights.sum(axis=-1, keepdims=True), v)


def heads(x, n):
    return np.asarray(x).reshape(x.shape[0], n, -1).transpose(1, 0, 2)


def merge(x):
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1)


def keys_as_values(softmax_attn, hopfield_attn):
    """The softmax layer with the Hopfield layer's weights and W_V := W_K."""
    for name in ["query_proj", "key_proj", "output_proj"]:
        softmax_attn = eqx.tree_at(
            lambda m, name=name: getattr(m, name), softmax_attn, getattr(hopfield_attn, name)
        )
    return eqx.tree_at(lambda m: m.value_proj, softmax_attn, hopfield_attn.key_proj)


@pytest.fixture
def data(getkey):
    x = jr.normal(getkey(), (5, 12))
    context = jr.normal(getkey(), (7, 10))
    mask = np.array(jr.bernoulli(getkey(), 0.6, (5, 7)))
    mask[:, 2] = True
    return x, context, mask


def test_softmax_attention_matches_reference(data, getkey):
    x, context, mask = data
    attn = ea.nn.SoftmaxAttention(12, 10, num_heads=3, head_dim=4, key=getkey())
    projections = eqx.filter_jit(
        lambda attn, x, context: [
            jax.vmap(proj)(inputs)
            for proj, inputs in [
                (attn.query_proj, x),
                (attn.key_proj, context),
                (attn.value_proj, context),
            ]
        ]
    )
    q, k, v = (heads(p, 3) for p in projections(attn, x, context))
    for m in [None, mask]:
        inner = merge(reference_attention(q, k, v, 4**-0.5, m))
        expected = inner @ np.asarray(attn.output_proj.weight).T + np.asarray(attn.output_proj.bias)
        np.testing.assert_allclose(run(attn, x, context, mask=m), expected, atol=1e-12)


@pytest.mark.parametrize("num_heads", [1, 4])
@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_one_step_is_softmax_attention_with_keys_as_values(data, getkey, num_heads, cross, masked):
    x, context, mask = data
    context_dim = 10 if cross else 12
    hop = ea.nn.HopfieldAttention(12, context_dim, num_heads=num_heads, head_dim=3, key=getkey())
    soft = keys_as_values(
        ea.nn.SoftmaxAttention(12, context_dim, num_heads=num_heads, head_dim=3, key=getkey()), hop
    )
    ctx = context if cross else None
    m = (mask if cross else mask[:, :5]) if masked else None
    out_h, out_s = run_each((hop, soft), x, ctx, mask=m)
    np.testing.assert_allclose(out_h, out_s, atol=1e-12)


def test_bare_layers_match_dot_product_attention(getkey):
    """Bare multi-head energy attention = jax.nn.dot_product_attention with keys as values."""
    x = jr.normal(getkey(), (6, 16))
    context = jr.normal(getkey(), (9, 16))
    mask = np.array(jr.bernoulli(getkey(), 0.7, (6, 9)))
    mask[:, 0] = True
    hop = ea.nn.HopfieldAttention(16, num_heads=4, bare=True, key=getkey())
    soft = ea.nn.SoftmaxAttention(16, num_heads=4, bare=True, key=getkey())

    def split(t):  # (seq, heads, head_dim)
        return t.reshape(t.shape[0], 4, 4)

    @eqx.filter_jit
    def outputs(hop, soft, x, context):
        dpa = jax.nn.dot_product_attention(
            split(x), split(context), split(context), mask=mask[None], scale=4**-0.5
        ).reshape(6, 16)
        return dpa, hop(x, context, mask=mask), soft(x, context, mask=mask)

    dpa, out_h, out_s = outputs(hop, soft, x, context)
    # dot_product_attention takes its softmax in float32 whatever the input dtype.
    np.testing.assert_allclose(out_h, dpa, atol=1e-6)
    np.testing.assert_allclose(out_s, dpa, atol=1e-6)
    np.testing.assert_allclose(out_h, out_s, atol=1e-12)


def test_fully_masked_query_outputs_zero_in_both_layers(data, getkey):
    x, context, mask = data
    mask[2] = False
    hop = ea.nn.HopfieldAttention(12, 10, num_heads=2, bare=False, key=getkey())
    soft = keys_as_values(ea.nn.SoftmaxAttention(12, 10, num_heads=2, key=getkey()), hop)
    out_h, out_s = jax.device_get(run_each((hop, soft), x, context, mask=mask))
    assert np.all(np.isfinite(out_h)) and np.all(np.isfinite(out_s))
    np.testing.assert_allclose(out_h, out_s, atol=1e-12)
    np.testing.assert_allclose(
        out_h[2], hop.output_proj.bias, atol=1e-14
    )  # zero attention, bias only


def test_trajectory_and_monotone_energy(data, getkey):
    x, context, _ = data
    hop = ea.nn.HopfieldAttention(
        12, 10, num_heads=2, head_dim=6, step_size=0.2, num_steps=15, key=getkey()
    )

    @eqx.filter_jit
    def outputs(hop, x, context):
        out, descent = hop(x, context, return_solution=True)
        return out, descent, hop(x, context), jax.vmap(hop.query_proj)(x)

    out, descent, out_plain, queries = jax.device_get(outputs(hop, x, context))
    assert descent.energies.shape == (2, 16)
    assert descent.trajectory.shape == (2, 16, 5, 6)
    np.testing.assert_allclose(descent.trajectory[:, 0], heads(queries, 2), atol=1e-14)
    np.testing.assert_allclose(out, out_plain, atol=1e-14)
    assert np.all(np.diff(descent.energies, axis=1) <= 1e-12)


@pytest.mark.parametrize("cls", [ea.nn.HopfieldAttention, ea.nn.SoftmaxAttention])
def test_jit_vmap_and_no_retracing(data, getkey, cls):
    x, context, mask = data
    if cls is ea.nn.HopfieldAttention:
        hop = cls(12, 10, num_heads=2, num_steps=2, step_size=0.5, key=getkey())
    else:
        hop = cls(12, 10, num_heads=2, key=getkey())
    traces = 0

    @eqx.filter_jit
    def batched(model, xs, context, mask):
        nonlocal traces
        traces += 1
        return jax.vmap(lambda xi: model(xi, context, mask=mask))(xs)

    xs = jr.normal(getkey(), (3, 5, 12))
    out = batched(hop, xs, context, mask)
    np.testing.assert_allclose(out[1], run(hop, xs[1], context, mask=mask), atol=1e-13)
    # New values of the same shapes, and a model whose weights an optimiser changed, reuse
    # the compiled trace.
    batched(hop, xs + 1.0, context, mask)
    updated = eqx.apply_updates(
        hop, jax.tree.map(lambda p: 0.1 * p, eqx.filter(hop, eqx.is_inexact_array))
    )
    batched(updated, xs, context, mask)
    assert traces == 1


@pytest.mark.parametrize("layer", ["hopfield", "softmax"])
def test_gradients_and_grad_of_grad(data, getkey, layer):
    """First and second derivatives through the layer (training through an update).

    Both are checked against central finite differences.
    """
    x, context, mask = data
    if layer == "hopfield":
        model = ea.nn.HopfieldAttention(
            12, 10, num_heads=2, num_steps=3, step_size=0.5, key=getkey()
        )
    else:
        model = ea.nn.SoftmaxAttention(12, 10, num_heads=2, key=getkey())
    direction = jr.normal(getkey(), model.query_proj.weight.shape)

    def loss(t):
        """A scalar path through parameter space: W_Q + t D."""
        m = eqx.tree_at(
            lambda m: m.query_proj.weight, model, model.query_proj.weight + t * direction
        )
        return jnp.sum(jnp.tanh(m(x, context, mask=mask)))

    eps = 1e-5

    @jax.jit  # one program; each function is vmapped over the points it is needed at
    def derivatives(x):
        value = jax.vmap(loss)(jnp.array([eps, -eps]))
        first = jax.vmap(jax.grad(loss))(jnp.array([0.0, eps, -eps]))
        second = jax.grad(jax.grad(loss))(0.0)
        # Gradient with respect to the inputs too.
        gx = jax.grad(lambda x: jnp.sum(jnp.tanh(model(x, context, mask=mask))))(x)
        return value, first, second, gx

    value, first, second, gx = jax.device_get(derivatives(x))
    np.testing.assert_allclose(first[0], (value[0] - value[1]) / (2 * eps), rtol=1e-7)
    np.testing.assert_allclose(second, (first[1] - first[2]) / (2 * eps), rtol=1e-6)
    assert gx.shape == x.shape and np.all(np.isfinite(gx))


def test_training_step_with_optax(data, getkey, train_in_scan):
    """A few AdamW steps on a regression target decrease the loss (jit, vmap over a batch)."""
    x, context, _ = data
    model = ea.nn.HopfieldAttention(12, 10, num_heads=2, num_steps=2, step_size=0.5, key=getkey())
    xs = jr.normal(getkey(), (8, 5, 12))
    targets = np.tanh(np.asarray(xs)[..., ::-1])
    optim = optax.adamw(1e-2)

    def loss(model):
        return jnp.mean((jax.vmap(lambda xi: model(xi, context))(xs) - targets) ** 2)

    @eqx.filter_jit
    def train(model):
        """The loss before and after 30 steps, in one compiled program."""
        return loss(model), loss(train_in_scan(loss, model, optim, 30))

    start, end = train(model)
    assert end < 0.8 * start


def test_parameter_dtype(getkey):
    hop = ea.nn.HopfieldAttention(8, num_heads=2, dtype=jnp.float32, key=getkey())
    soft = ea.nn.SoftmaxAttention(8, num_heads=2, dtype=jnp.float32, key=getkey())
    outputs = run_each((hop, soft), np.ones((3, 8), np.float32))
    for layer, out in zip((hop, soft), outputs, strict=True):
        assert {p.dtype for p in jax.tree.leaves(eqx.filter(layer, eqx.is_array))} == {
            jnp.dtype("float32")
        }
        assert out.dtype == jnp.float32


def test_nan_input_is_reported(getkey):
    hop = ea.nn.HopfieldAttention(4, key=getkey())
    soft = ea.nn.SoftmaxAttention(4, key=getkey())
    x = jnp.ones((2, 4)).at[0, 1].set(jnp.nan)
    for layer in (hop, soft):
        with pytest.raises(eqx.EquinoxRuntimeError, match="x contains NaN or inf"):
            eqx.filter_jit(layer)(x)
        with pytest.raises(eqx.EquinoxRuntimeError, match="context contains NaN or inf"):
            eqx.filter_jit(layer)(jnp.ones((2, 4)), x)


@pytest.mark.parametrize("cls", [ea.nn.HopfieldAttention, ea.nn.SoftmaxAttention])
def test_bad_input(cls, getkey, user_mode):
    key = getkey()
    layer = cls(12, 10, num_heads=3, key=key)
    x, context = jnp.ones((5, 12)), jnp.ones((7, 10))
    with pytest.raises(ValueError, match=r"x must have shape \(seq, dim=12\), got \(5, 8\)"):
        layer(jnp.ones((5, 8)), context)
    with pytest.raises(ValueError, match=r"x must have shape \(seq, dim=12\), got \(12,\)"):
        layer(jnp.ones(12), context)
    with pytest.raises(ValueError, match=r"context must have shape \(mem, dim=10\), got \(7, 12\)"):
        layer(x, jnp.ones((7, 12)))
    with pytest.raises(ValueError, match=r"mask must have shape \(seq=5, mem=7\), got \(7, 5\)"):
        layer(x, context, mask=jnp.ones((7, 5), bool))
    with pytest.raises(ValueError, match="self-attention.*context_dim == query_dim"):
        layer(x)
    with pytest.raises(ValueError, match="query_dim=10 does not split into num_heads=3"):
        cls(10, num_heads=3, key=key)
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 2.5"):
        cls(10, num_heads=2.5, key=key)
    with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
        cls(10, num_heads=0, key=key)
    with pytest.raises(ValueError, match="bare attention.*context_dim must equal query_dim"):
        cls(12, 10, bare=True, key=key)
    with pytest.raises(ValueError, match="bare attention splits query_dim=10 into num_heads=4"):
        cls(10, num_heads=4, bare=True, key=key)


def test_hopfield_hyperparameters_are_checked(getkey, user_mode):
    key = getkey()
    for beta in [0.0, -2.0]:
        with pytest.raises(ValueError, match=f"beta must be > 0, got {beta}"):
            ea.nn.HopfieldAttention(8, beta=beta, key=key)
    with pytest.raises(ValueError, match="step_size must be > 0, got 0.0"):
        ea.nn.HopfieldAttention(8, step_size=0.0, key=key)
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer, got -1"):
        ea.nn.HopfieldAttention(8, num_steps=-1, key=key)
    with pytest.raises(ValueError, match="scale must be > 0"):
        ea.nn.SoftmaxAttention(8, scale=-1.0, key=key)


LAYERS_WITH_BETA = {
    "HopfieldAttention": lambda key, **kw: ea.nn.HopfieldAttention(8, num_heads=2, key=key, **kw),
    "EnergyTransformer": lambda key, **kw: ea.nn.EnergyTransformer(
        8, num_heads=2, head_dim=4, num_memories=6, key=key, **kw
    ),
    "VectorSpinAttention": lambda key, **kw: ea.nn.VectorSpinAttention(4, 8, key=key, **kw),
    "SpinTransformerAttention": lambda key, **kw: ea.nn.SpinTransformerAttention(
        8, 2, key=key, **kw
    ),
    "AttentionSynapse": lambda key, **kw: ea.ham.AttentionSynapse(
        8, num_heads=2, head_dim=4, key=key, **kw
    ),
    "HopfieldSynapse": lambda key, **kw: ea.ham.HopfieldSynapse(8, 6, key=key, **kw),
}


@pytest.mark.parametrize("name", LAYERS_WITH_BETA)
def test_beta_is_fixed_or_trained_by_one_convention(name, getkey):
    # Fixed (default): a static float, no leaf, so no gradient and no optimiser sees it;
    # trainable_beta=True: a float array leaf. layer.beta reads the value either way.
    make = LAYERS_WITH_BETA[name]
    fixed = make(getkey(), beta=0.7)
    assert fixed.beta == 0.7 and isinstance(fixed.beta, float) and fixed.trained_beta is None
    assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(fixed))
    learned = make(getkey(), beta=0.7, trainable_beta=True)
    assert learned.fixed_beta is None and learned.trained_beta.shape == ()
    assert any(leaf is learned.trained_beta for leaf in jax.tree.leaves(learned))
    np.testing.assert_allclose(learned.beta, 0.7, rtol=1e-6)


def test_unfiltered_optax_trains_beta_only_when_asked(data, getkey):
    # The audit's case: optax.adamw over the whole module (not filtered) and jax.grad over
    # the whole module. A fixed beta is not among the leaves, so weight decay cannot touch it.
    x, context, _ = data
    key = getkey()
    layers = [
        ea.nn.HopfieldAttention(12, 10, num_heads=2, key=key),
        ea.nn.HopfieldAttention(12, 10, num_heads=2, trainable_beta=True, key=key),
    ]
    optimiser = optax.adamw(1e-2, weight_decay=0.5)

    @jax.jit
    def step(layer):
        grads = jax.grad(lambda m: jnp.sum(m(x, context) ** 2))(layer)
        updates, _ = optimiser.update(grads, optimiser.init(layer), layer)
        return optax.apply_updates(layer, updates), grads

    (fixed, fixed_grads), (learned, learned_grads) = (step(m) for m in layers)
    assert fixed.beta == layers[0].beta and fixed_grads.trained_beta is None
    assert learned_grads.trained_beta != 0 and learned.beta != layers[1].beta
