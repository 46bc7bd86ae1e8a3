"""Hopfield, HopfieldPooling and HopfieldLayer: hopfield-layers' numbers, and the energy view.

The four `hfl_*.npz` fixtures were computed by hopfield-layers itself (PyTorch, float64; see
`../shared/fixtures/README.md`, section 4). Everything else is checked against independent
formulas written here or against the package's energy and solvers.
"""

import functools
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
INPUTS = ("input", "stored_pattern", "state_pattern", "pattern_projection")
MASKS = ("stored_pattern_padding_mask", "association_mask")
CASES = {
    "full_perturbed": ea.nn.Hopfield,
    "plain": ea.nn.Hopfield,
    "pooling": ea.nn.HopfieldPooling,
    "layer": ea.nn.HopfieldLayer,
}


def load_case(case):
    """The fixture's arrays, constructor arguments, parameters and inputs (NumPy arrays: jitted
    functions take them as they are, where `jnp.asarray` would compile a copy per shape)."""
    with np.load(FIXTURES / f"hfl_{case}.npz") as data:
        arrays = dict(data)
    meta = json.loads(str(arrays.pop("meta_json")))
    config = dict(meta["constructor_kwargs_passed"])
    config.pop("batch_first", None)
    skip = {*INPUTS, *MASKS, "output", "output_unfused", "association_matrix"}
    params = {
        name.replace("__", "."): value
        for name, value in arrays.items()
        if name not in skip and not name.startswith(("grad", "xi_iter"))
    }
    inputs = {name: arrays[name] for name in INPUTS if name in arrays}
    return arrays, config, params, inputs


def batched_call(model, inputs, arrays, method=None):
    """The model on the fixture's batch of 2, masks as hopfield-layers got them."""
    if "input" in inputs:
        x = inputs["input"]
    else:
        x = (inputs["stored_pattern"], inputs["state_pattern"], inputs["pattern_projection"])
    fn = model if method is None else getattr(model, method)
    extra = {}
    if "association_mask" in arrays:
        extra["association_mask"] = arrays["association_mask"]
    if "stored_pattern_padding_mask" in arrays:
        pad = arrays["stored_pattern_padding_mask"]
        return jax.vmap(lambda x, p: fn(x, stored_pattern_padding_mask=p, **extra))(x, pad)
    return jax.vmap(lambda x: fn(x, **extra))(x)


@functools.cache
def computed(name):
    """Our output, association matrix and gradients of Σ out² (parameters and inputs) on one
    fixture, in one compiled program; computed once, for every test that uses them."""
    arrays, config, params, inputs = load_case(name)
    cls = CASES[name]

    def loss(params, inputs):
        out = batched_call(cls.from_state_dict(params, **config), inputs, arrays)
        return jnp.sum(out**2), out

    @jax.jit
    def run(params, inputs):
        (g_params, g_inputs), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, inputs)
        model = cls.from_state_dict(params, **config)
        association = batched_call(model, inputs, arrays, "association_matrix")
        return out, association, {**g_params, **g_inputs}

    return arrays, *jax.device_get(run(params, inputs))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    """One fixture: its arrays, and our output, association matrix and gradients."""
    return request.param, *computed(request.param)


def test_outputs_and_association_matrices_equal_hopfield_layers(case):
    name, arrays, out, association, _ = case
    np.testing.assert_allclose(out, arrays["output"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(association, arrays["association_matrix"], rtol=1e-10, atol=1e-12)
    if name == "full_perturbed":  # the perturbed weights make the association sharp
        assert float(np.max(association)) > 0.9


def test_gradients_equal_hopfield_layers(case):
    """Every parameter and input gradient of Σ out². Where hopfield-layers took a fused
    branch (quirk 1), the comparison is with its general branch (`grad_unfused__*`)."""
    name, arrays, _, _, grads = case
    assert len(grads) == sum(k.startswith("grad__") for k in arrays)
    for param, grad in grads.items():
        key = param.replace(".", "__")
        ref = arrays.get("grad_unfused__" + key, arrays["grad__" + key])
        # Quirk 2: with one retrieval the key bias and the stored-pattern norm's bias
        # cannot change the softmax; the files hold round-off there (<= 4e-16).
        atol = 1e-14 * max(1.0, float(np.max(np.abs(ref))))
        np.testing.assert_allclose(grad, ref, rtol=1e-10, atol=atol, err_msg=f"{name}: {param}")


def test_the_fused_branch_gives_the_used_norm_the_sum_of_the_three_gradients():
    """hopfield-layers' fused self-attention branch (quirk 1) uses LN_state for all three
    inputs: its gradient is the sum of our three separate ones, the others get none."""
    arrays, _, _, grads = computed("plain")  # the parameter gradients of Σ out²
    norms = ("norm_stored_pattern", "norm_state_pattern", "norm_pattern_projection")
    for part in ("weight", "bias"):
        total = sum(grads[f"{n}.{part}"] for n in norms)
        np.testing.assert_allclose(total, arrays[f"grad__norm_state_pattern__{part}"], atol=1e-14)
        assert not np.any(arrays[f"grad__norm_stored_pattern__{part}"])


def test_state_dict_round_trip_and_bad_state_dicts(user_mode):
    arrays, config, params, inputs = load_case("full_perturbed")
    params = jax.device_put(params)  # JAX arrays (no copy compiled per shape)
    model = ea.nn.Hopfield.from_state_dict(params, **config)
    back = model.to_state_dict()
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])
    pooling = ea.nn.HopfieldPooling(6, quantity=2, num_heads=2, key=jr.PRNGKey(0))
    again = ea.nn.HopfieldPooling.from_state_dict(
        pooling.to_state_dict(), input_size=6, quantity=2, num_heads=2
    )
    assert eqx.tree_equal(pooling, again)

    missing = {k: v for k, v in params.items() if k != "association_core.in_proj_bias"}
    with pytest.raises(ValueError, match="no 'association_core.in_proj_bias'"):
        ea.nn.Hopfield.from_state_dict(missing, **config)
    wrong = {**params, "norm_state_pattern.bias": np.zeros(5)}
    with pytest.raises(ValueError, match=r"'norm_state_pattern.bias' has shape \(5,\)"):
        ea.nn.Hopfield.from_state_dict(wrong, **config)
    with pytest.raises(ValueError, match="does not have: \\['extra'\\]"):
        ea.nn.Hopfield.from_state_dict({**params, "extra": np.zeros(1)}, **config)
    with pytest.raises(ValueError, match="batch_first must be True"):
        ea.nn.Hopfield.from_state_dict(params, **config, batch_first=False)


def reference_retrieval(q, k, beta, allowed, steps_max, eps):
    """hopfield-layers' loop for one head and one example, written out in NumPy."""
    q, k = np.asarray(q), np.asarray(k)

    def softmax(s):
        s = np.where(allowed, s, -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    xi, t = softmax(beta * q @ k.T), 0
    while t < steps_max:
        new = softmax(beta * (xi @ k) @ k.T)
        change = np.linalg.norm(new - xi)
        xi, t = new, t + 1
        if change <= eps:
            break
    return xi, t


def test_early_stopping_is_per_example_under_vmap():
    """Two examples that need different numbers of updates: each stops on its own (no batch
    coupling, unlike hopfield-layers), and each equals the example run alone and the loop
    written out in NumPy."""
    layer = ea.nn.Hopfield(
        4,
        update_steps_max=12,
        update_steps_eps=1e-6,
        normalize_stored_pattern=False,
        normalize_stored_pattern_affine=False,
        normalize_state_pattern=False,
        normalize_state_pattern_affine=False,
        state_pattern_as_static=True,
        stored_pattern_as_static=True,
        scaling=2.0,
        key=jr.PRNGKey(0),
    )
    stored = jr.normal(jr.PRNGKey(1), (5, 4))
    # A state near a stored pattern and one between two patterns converge at different speeds.
    states = jnp.stack([stored[:1] * 3.0, 0.5 * (stored[1:2] + stored[2:3])])

    def run(state):
        x = (stored, state, stored)
        return layer(x), layer.association_matrix(x), layer.num_updates(x)

    @jax.jit
    def batched_and_alone(states):
        # lax.map: one example after the other, each unbatched
        return jax.vmap(run)(states), jax.lax.map(lambda state: run(state)[0], states)

    (outs, assoc, steps), alone = jax.device_get(batched_and_alone(states))
    assert steps[0, 0] != steps[1, 0]
    for b in range(2):
        np.testing.assert_allclose(outs[b], alone[b], rtol=1e-13, atol=1e-15)
        xi, t = reference_retrieval(states[b], stored, 2.0, True, 12, 1e-6)
        assert int(steps[b, 0]) == t
        np.testing.assert_allclose(assoc[b, 0], xi, rtol=1e-10, atol=1e-14)


def test_each_update_is_a_gradient_step_on_the_layers_energy():
    """T updates of the layer = `ea.descend` of its energy, T steps of size 1 (no early stop),
    and its final association matrix is the softmax at the descended state."""
    key = jr.PRNGKey(2)
    layer = ea.nn.Hopfield(
        6, num_heads=2, update_steps_max=3, update_steps_eps=1e-300, scaling=[0.7, 1.3], key=key
    )
    x = jr.normal(jr.PRNGKey(3), (5, 6))
    association_mask = jr.bernoulli(jr.PRNGKey(4), 0.3, (5, 5))

    @eqx.filter_jit
    def run(layer, x, association_mask):
        energy, start = layer.energy(x, association_mask=association_mask)
        solution = ea.descend(energy, start, step_size=1.0, num_steps=3, return_trajectory=True)
        final = solution.value
        allowed = ~association_mask
        expected = jnp.stack(
            [
                jax.nn.softmax(jnp.where(allowed, b * f @ k.T, -jnp.inf), axis=-1)
                for f, k, b in zip(final, energy.keys, (0.7, 1.3), strict=True)
            ]
        )
        got = layer.association_matrix(x, association_mask=association_mask)
        steps = layer.num_updates(x, association_mask=association_mask)
        return solution.energies, expected, got, steps

    energies, expected, got, steps = jax.device_get(run(layer, x, association_mask))
    assert np.all(np.diff(energies) <= 1e-12)  # the energy never rises
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(steps, [3, 3])


def test_unlimited_updates_converge_and_differentiate_at_the_fixed_point():
    """`update_steps_max=None`: the loop runs until converged and its derivatives are the
    fixed point's (implicit function theorem), which a long unrolled run approaches."""
    kw = dict(num_heads=2, scaling=3.0, update_steps_eps=1e-12, key=jr.PRNGKey(5))
    free = ea.nn.Hopfield(8, update_steps_max=None, **kw)
    long = ea.nn.Hopfield(8, update_steps_max=60, **kw)
    x = jr.normal(jr.PRNGKey(6), (6, 8))

    def loss(layer, x):
        out = layer(x)
        return jnp.sum(jnp.sin(out)), out

    @eqx.filter_jit
    def run(free, long, x):
        energy, start = free.energy(x)
        minimum = ea.minimise(energy, start).value
        scores = jnp.einsum("hld,hsd->hls", minimum, energy.keys) * energy.beta[:, None, None]
        # Each layer's output comes with its gradient (one forward pass each).
        (_, out_free), g_free = eqx.filter_value_and_grad(loss, has_aux=True)(free, x)
        (_, out_long), g_long = eqx.filter_value_and_grad(loss, has_aux=True)(long, x)
        return (
            free.num_updates(x),
            out_free,
            out_long,
            jax.nn.softmax(scores, axis=-1),
            free.association_matrix(x),
            g_free,
            g_long,
        )

    steps, out_free, out_long, at_minimum, association, g_free, g_long = run(free, long, x)
    assert int(np.max(steps)) < 60
    np.testing.assert_allclose(out_free, out_long, rtol=1e-10, atol=1e-12)
    # The converged states minimise the layer's energy: ea.minimise finds the same association.
    np.testing.assert_allclose(at_minimum, association, rtol=1e-6, atol=1e-9)
    for a, b in zip(jax.tree.leaves(g_free), jax.tree.leaves(g_long), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_mask_polarities_and_empty_rows():
    """hopfield-layers' masks are True = masked out; `mask` is True = may attend. A state
    pattern with nothing to attend to gets a zero association row (hopfield-layers: NaN)."""
    layer = ea.nn.Hopfield(4, update_steps_max=2, key=jr.PRNGKey(7))
    x = jr.normal(jr.PRNGKey(8), (3, 4))
    allowed = np.array([[True, False, True], [True, True, False], [False, False, False]])
    padding = np.array([False, True, False])

    @eqx.filter_jit
    def run(layer, x):
        return (
            layer.association_matrix(x, mask=allowed),
            layer.association_matrix(x, association_mask=~allowed),
            layer(x, mask=allowed),
            layer.association_matrix(x, stored_pattern_padding_mask=padding),
            layer.association_matrix(x, mask=np.broadcast_to(~padding, (3, 3))),
        )

    by_mask, by_association, out, by_padding, by_padding_as_mask = jax.device_get(run(layer, x))
    np.testing.assert_array_equal(by_mask, by_association)
    np.testing.assert_array_equal(by_mask[0, 2], 0.0)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(by_padding, by_padding_as_mask)
    np.testing.assert_allclose(np.sum(by_mask[0, :2], axis=-1), 1.0, rtol=1e-14)


def test_zero_association_and_bias_pattern():
    key = jr.PRNGKey(9)
    x = jr.normal(jr.PRNGKey(10), (4, 6))
    zero = ea.nn.Hopfield(6, add_zero_association=True, key=key)
    biased = ea.nn.Hopfield(6, concat_bias_pattern=True, key=key)

    @eqx.filter_jit
    def run(zero, biased, x):
        energy, q = zero.energy(x)
        logits = zero.scaling[0] * q[0] @ energy.keys[0, :4].T
        return zero.association_matrix(x), logits, biased.energy(x)[0].keys

    assoc, logits, biased_keys = jax.device_get(run(zero, biased, x))
    assert assoc.shape == (1, 4, 5)
    # The appended key is zero, so its logit is 0: its weight is 1 / (1 + sum_s e^{logit_s}).
    np.testing.assert_allclose(assoc[0, :, 4], 1 / (1 + np.sum(np.exp(logits), -1)), rtol=1e-12)

    np.testing.assert_array_equal(biased_keys[0, -1], biased.bias_key)
    # hopfield-layers ignores its bias patterns (quirk 6): loading one drops them, with a
    # warning, so the numbers match hopfield-layers.
    plain = ea.nn.Hopfield(6, key=key)
    state = {
        **plain.to_state_dict(),
        "association_core.bias_k": np.ones((1, 1, 6)),
        "association_core.bias_v": np.ones((1, 1, 6)),
    }
    with pytest.warns(UserWarning, match="no effect in hopfield-layers"):
        loaded = ea.nn.Hopfield.from_state_dict(state, input_size=6, concat_bias_pattern=True)
    call = eqx.filter_jit(lambda layer, x: layer(x))  # one program for both layers
    np.testing.assert_array_equal(call(loaded, x), call(plain, x))
    with pytest.raises(ValueError, match="hopfield-layers ignores"):
        biased.to_state_dict()


def test_static_inputs_and_hopfield_space_norm_against_explicit_formulas():
    """Static patterns skip their projection: the same as an identity projection. The
    Hopfield-space norm normalises the projected queries and keys over each head."""
    key = jr.PRNGKey(11)
    flags = dict(
        normalize_stored_pattern=False,
        normalize_stored_pattern_affine=False,
        normalize_state_pattern=False,
        normalize_state_pattern_affine=False,
        normalize_pattern_projection=False,
        normalize_pattern_projection_affine=False,
        input_bias=False,
    )
    static = ea.nn.Hopfield(
        4, state_pattern_as_static=True, stored_pattern_as_static=True, key=key, **flags
    )
    identity = ea.nn.Hopfield(4, key=key, **flags)
    identity = eqx.tree_at(
        lambda m: (m.query_proj.weight, m.key_proj.weight, m.value_proj.weight, m.out_proj.weight),
        identity,
        (jnp.eye(4), jnp.eye(4), static.value_proj.weight, static.out_proj.weight),
    )
    x = jr.normal(jr.PRNGKey(12), (5, 4))
    normed = ea.nn.Hopfield(8, num_heads=2, normalize_hopfield_space=True, key=key)
    y = jr.normal(jr.PRNGKey(13), (3, 8))

    @eqx.filter_jit
    def run(static, identity, normed, x, y):
        _, q = normed.energy(y)
        raw = jax.vmap(normed.query_proj)(jax.vmap(normed.norm_state_pattern)(y))
        return static(x), identity(x), q, raw.reshape(3, 2, 4)

    by_static, by_identity, q, raw = jax.device_get(run(static, identity, normed, x, y))
    np.testing.assert_allclose(by_static, by_identity, rtol=1e-13)
    centred = raw - np.mean(raw, -1, keepdims=True)
    expected = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(q, np.swapaxes(expected, 0, 1), rtol=1e-12, atol=1e-14)


def test_scaling_dropout_and_trainable_flags(user_mode):
    key = jr.PRNGKey(14)
    x = jr.normal(jr.PRNGKey(15), (5, 8))
    k = jr.PRNGKey(16)
    layer = ea.nn.Hopfield(8, num_heads=2, scaling=[0.5, 2.0], key=key)
    trainable = ea.nn.Hopfield(8, num_heads=2, trainable_scaling=True, key=key)
    pooling = ea.nn.HopfieldPooling(8, quantity=3, trainable=False, key=key)
    dropped = ea.nn.Hopfield(8, dropout=0.5, key=key)
    plain = ea.nn.Hopfield(8, key=key)
    lookup = ea.nn.HopfieldLayer(8, quantity=4, lookup_weights_as_separated=True, key=key)

    @eqx.filter_jit
    def run(layer, trainable, pooling, dropped, plain, lookup, x, k):
        energy, q = layer.energy(x)
        expected = [  # each head its own beta (hopfield-layers tiles)
            jax.nn.softmax(beta * q[h] @ energy.keys[h].T, axis=-1)
            for h, beta in enumerate((0.5, 2.0))
        ]
        grads = eqx.filter_grad(lambda ms: sum(jnp.sum(m(x) ** 2) for m in ms))(
            (layer, trainable, pooling)
        )
        kept = eqx.nn.Dropout(0.5)(dropped.association_matrix(x)[0], key=k)
        values = jax.vmap(dropped.value_proj)(jax.vmap(dropped.norm_pattern_projection)(x))
        return dict(
            association=layer.association_matrix(x),
            expected=expected,
            grads=grads,
            inference=eqx.nn.inference_mode(dropped)(x),
            no_dropout=plain(x),
            dropped=dropped(x, key=k),
            dropped_expected=jax.vmap(dropped.out_proj)(kept @ values),
            pooled=pooling(x),
            lookup=lookup(x),
            lookup_association=lookup.association_matrix(x),
        )

    got = jax.device_get(run(layer, trainable, pooling, dropped, plain, lookup, x, k))
    for h in range(2):
        np.testing.assert_allclose(got["association"][h], got["expected"][h], rtol=1e-12)
    grads = got["grads"]
    # A fixed scaling is no leaf at all (static), a trainable one gets its gradient.
    assert grads[0].trained_scaling is None and layer.fixed_scaling == (0.5, 2.0)
    assert np.all(grads[1].trained_scaling != 0)
    assert not np.any(grads[2].pooling_weights)  # trainable=False
    assert np.any(grads[2].hopfield.query_proj.weight)

    # Inverted dropout on the final association matrix, and none in inference mode.
    with pytest.raises(RuntimeError, match="key"):
        eqx.filter_jit(dropped)(x)  # raised while tracing: nothing runs
    np.testing.assert_array_equal(got["inference"], got["no_dropout"])
    np.testing.assert_allclose(got["dropped"], got["dropped_expected"], rtol=1e-12, atol=1e-14)

    assert got["pooled"].shape == (24,)
    assert got["lookup"].shape == (5, 8)
    assert got["lookup_association"].shape == (1, 5, 4)


def test_bad_arguments_name_the_cause(user_mode):
    key = jr.PRNGKey(0)
    x = np.ones((3, 4))
    with pytest.raises(ValueError, match="does not split into num_heads=3"):
        ea.nn.Hopfield(4, num_heads=3, key=key)
    with pytest.raises(ValueError, match="update_steps_max has 1 entries"):
        ea.nn.Hopfield(4, num_heads=2, update_steps_max=[1], key=key)
    with pytest.raises(ValueError, match="mixes unlimited"):
        ea.nn.Hopfield(4, num_heads=2, update_steps_max=[None, 2], key=key)
    with pytest.raises(ValueError, match="update_steps_eps must be a finite float > 0"):
        ea.nn.Hopfield(4, update_steps_eps=0.0, key=key)
    with pytest.raises(ValueError, match="normalize_state_pattern_affine=True needs"):
        ea.nn.Hopfield(4, normalize_state_pattern=False, key=key)
    with pytest.raises(ValueError, match="not a function in jax.nn"):
        ea.nn.Hopfield(4, association_activation="nope", key=key)
    layer = ea.nn.Hopfield(4, key=key)
    with pytest.raises(ValueError, match="True = masked out"):
        layer(x, association_mask=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="True = may attend"):
        layer(x, mask=np.zeros((3, 3)))
    with pytest.raises(ValueError, match=r"stored_pattern_padding_mask must have shape"):
        layer(x, stored_pattern_padding_mask=np.zeros(2, bool))
    with pytest.raises(ValueError, match="a sequence of 2"):
        layer((x, x))
    tanh = ea.nn.Hopfield(4, association_activation="tanh", key=key)
    assert np.max(eqx.filter_jit(tanh)(x)) < 1


def test_values_heads_and_output_options_against_explicit_formulas():
    """The read-out after retrieval, written out: values through the key projection
    (`pattern_projection_as_connected`), per-head value size, head concatenation, output
    projection or none, and the activation; the separate-weights layout round-trips."""
    key = jr.PRNGKey(16)
    stored = jr.normal(jr.PRNGKey(17), (5, 6))
    state = jr.normal(jr.PRNGKey(18), (3, 4))
    x = (stored, state, stored)
    common = dict(stored_pattern_size=6, pattern_projection_size=6, num_heads=2, hidden_size=3)
    connected = ea.nn.Hopfield(
        4, pattern_projection_as_connected=True, association_activation="tanh", key=key, **common
    )
    state_dict = connected.to_state_dict()
    assert state_dict["association_core.v_proj_weight"].shape == (6, 6)  # (H p, H d)
    assert "association_core.in_proj_weight" not in state_dict
    config = dict(common, input_size=4, pattern_projection_as_connected=True)
    loaded = ea.nn.Hopfield.from_state_dict(state_dict, association_activation="tanh", **config)
    bare = ea.nn.Hopfield(4, pattern_size=2, disable_out_projection=True, key=key, **common)

    @eqx.filter_jit
    def run(connected, loaded, bare, x):
        association = connected.association_matrix(x)  # (2, 3, 5)
        normed = jax.vmap(connected.norm_pattern_projection)(stored)
        values = jax.vmap(connected.value_proj)(jax.vmap(connected.key_proj)(normed))  # (5, 2*3)
        heads = jnp.einsum("hls,shp->lhp", association, values.reshape(5, 2, 3)).reshape(3, 6)
        expected = jnp.tanh(jax.vmap(connected.out_proj)(heads))

        bare_association = bare.association_matrix(x)
        bare_values = jax.vmap(bare.value_proj)(jax.vmap(bare.norm_pattern_projection)(stored))
        bare_heads = jnp.einsum("hls,shp->lhp", bare_association, bare_values.reshape(5, 2, 2))
        return connected(x), expected, loaded(x), bare(x), bare_heads.reshape(3, 4)

    out, expected, out_loaded, out_bare, bare_heads = run(connected, loaded, bare, x)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(out_loaded, out)
    np.testing.assert_allclose(out_bare, bare_heads, rtol=1e-12, atol=1e-14)
    assert bare.out_proj is None and bare.output_size == 4
