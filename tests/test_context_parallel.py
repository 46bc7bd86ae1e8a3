"""Context parallelism: attention energies with the sequence split over 2, 4 and 8 (forced CPU)
devices, the keys passed round a ring. Every number must equal one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import energyattn as ea
from energyattn._energy._attention import _logsumexp

SEQ, DIM = 16, 4


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    if jax.device_count() < 8:
        pytest.fail(
            f"these tests need 8 devices, found {jax.device_count()}: run pytest from the "
            "repository (tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )


def mesh_of(num_devices, axis_types=AxisType.Auto):
    return jax.make_mesh(
        (num_devices,), ("seq",), axis_types=(axis_types,), devices=jax.devices()[:num_devices]
    )


def max_difference(a, b):
    # In NumPy: eager jnp arithmetic on arrays split over devices compiles a program per op.
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def inputs(dtype):
    rng = np.random.default_rng(0)
    q, k, vq, vk = (jnp.asarray(rng.normal(size=(SEQ, DIM)), dtype) for _ in range(4))
    # Causal and padding at once (the last three memories are padding), and one query that
    # may attend to nothing (its log-sum-exp is defined as 0, as on one device).
    mask = np.tril(np.ones((SEQ, SEQ), bool))
    mask[:, -3:] = False
    mask[0] = False
    return q, k, vq, vk, jnp.asarray(mask)


def test_jit_grad_of_hopfield_energy_on_sequence_split_inputs():
    # A user's call: inputs split along the sequence over an Explicit mesh
    # axis used to fail in the blockwise path's lax.scan ("0th dimension of all xs should be
    # replicated"); the log-sum-exp now sees the split in the keys' type and runs the ring.
    q, k, *_ = inputs(jnp.float64)
    q, k = jnp.tile(q, (64, 1)), jnp.tile(k, (64, 1)) * 0.5  # 1024 x 1024: the blockwise path
    mesh = mesh_of(8, AxisType.Explicit)
    split = NamedSharding(mesh, PartitionSpec("seq"))
    grad = jax.jit(jax.grad(ea.hopfield_energy, argnums=(0, 1)))
    got = grad(jax.device_put(q, split), jax.device_put(k, split))
    assert got[0].sharding.spec[0] == "seq"
    assert max_difference(got, grad(q, k)) < 1e-12


def test_causal_attention_context_parallel(monkeypatch):
    # `causal` and `exclude_self` on the ring of 8 devices (2 queries and keys each, in
    # blocks of 3: padded): every block takes the triangle from its global positions. Values,
    # gradients and a JVP equal one device's explicit triangle (and padding, and row 0 empty).
    q, k, vq, vk, mask = inputs(jnp.float64)
    rest = mask | ~np.tril(np.ones((SEQ, SEQ), bool))  # the triangle left to `causal`
    rings = []
    ring_lse = _logsumexp.ring_lse
    monkeypatch.setattr(
        _logsumexp, "ring_lse", lambda *a, **kw: rings.append(kw) or ring_lse(*a, **kw)
    )

    def derivatives(q, k, vq, vk, mask, causal, impl):
        def loss(q, k):
            lse = ea.attention_logsumexp(
                q, k, mask=mask, exclude_self=True, causal=causal, implementation=impl,
                block_size=3,
            )  # fmt: skip
            return jnp.sum(jnp.sin(lse)), lse

        (_, lse), tangent = jax.jvp(loss, (q, k), (vq, vk))
        return lse, jax.grad(loss, (0, 1), has_aux=True)(q, k)[0], tangent

    got = ea.parallel.context_parallel(
        lambda _, *args: derivatives(*args, True, "blockwise"), mesh_of(8)
    )(None, q, k, vq, vk, rest)
    expected = jax.jit(derivatives, static_argnums=(5, 6))(q, k, vq, vk, mask, False, "naive")
    assert rings and all(kw["causal"] for kw in rings)  # really the ring
    assert max_difference(got, expected) < 1e-12


def layer_cases():
    key = jr.key(0)
    return {
        "hopfield_attention": ea.nn.HopfieldAttention(
            DIM, num_heads=2, num_steps=2, step_size=0.5, key=key
        ),
        "energy_transformer": ea.nn.EnergyTransformer(
            DIM, num_heads=2, head_dim=3, num_memories=5, num_steps=2, key=key
        ),
    }


def test_energy_transformer_recall_trajectory_context_parallel():
    layer = layer_cases()["energy_transformer"]
    x = jr.normal(jr.key(3), (SEQ, DIM))

    def recall(layer, x):
        out, solution = layer(x, return_solution=True)
        return out, solution.energies

    expected = eqx.filter_jit(recall)(layer, x)
    got = ea.parallel.context_parallel(recall, ea.parallel.make_mesh(8, axis_name="seq"))(layer, x)
    # float32: the sums over tokens are added in another order across devices.
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert bool(jnp.all(jnp.diff(got[1]) <= 1e-5))  # recall still descends the energy


def test_attractor_network_context_parallel():
    layer = ea.nn.AttractorAttention(SEQ, DIM, num_steps=3, key=jr.key(4))
    x = jr.normal(jr.key(5), (SEQ, DIM))
    run = lambda layer, x: (layer(x), layer.energy(x))  # noqa: E731
    expected = eqx.filter_jit(run)(layer, x)
    got = ea.parallel.context_parallel(run, ea.parallel.make_mesh(4, axis_name="seq"))(layer, x)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ring_memory_per_device_is_a_chunk():
    # Compiled (not run): the ring's temporaries on each of 8 devices against the one-device
    # blockwise program. An implementation that gathered the keys (or held a score matrix)
    # would need about as much as one device.
    seq, dim = 4096, 16
    q = jax.ShapeDtypeStruct((seq, dim), jnp.float32)
    mesh = mesh_of(8)

    def temp_bytes(fn):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(q, q).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one = temp_bytes(lambda q, k: ea.hopfield_energy(q, k, implementation="blockwise"))
    ring = temp_bytes(lambda q, k: ea.parallel.ring_hopfield_energy(q, k, mesh))
    # An even share of the blockwise temporaries plus a few chunk buffers (the keys and
    # their gradients in flight): measured one/8 + 3.5 chunks with JAX 0.10 and one/8 + 4.5
    # with JAX 0.12, whose ring holds one more chunk (746544 bytes against 713392). Keys
    # gathered on each device would add 14 chunks (the other 7 chunks of keys and of their
    # gradients); a score matrix, all of `one`.
    chunk = seq // 8 * dim * 4
    assert ring <= one / 8 + 6 * chunk, (ring, one, chunk)


def test_context_parallel_errors():
    mesh = mesh_of(4)
    q = jnp.ones((10, DIM))
    with pytest.raises(
        ValueError, match="queries. sequence length 10 must be divisible by the 4 devices"
    ):
        ea.parallel.ring_hopfield_energy(q, q, mesh)
    layer = layer_cases()["hopfield_attention"]
    with pytest.raises(ValueError, match=r"sequence: .* divisible by the 4 devices.*\(10, 4\)"):
        ea.parallel.context_parallel(lambda layer, x: layer(x), mesh)(layer, q)
    two_axes = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="one-axis"):
        ea.parallel.ring_hopfield_energy(jnp.ones((8, DIM)), jnp.ones((8, DIM)), two_axes)


def test_parallel_entry_points_compose_with_any_mesh_and_transformation():
    # Each call here once failed as a new user wrote it: a plain `jax.make_mesh` mesh
    # (Explicit axes by default), jit and grad of context_parallel, indexing its output, and
    # meshes whose axis is not called "batch".
    q, k, vq, _, mask = inputs(jnp.float64)
    plain = jax.make_mesh((4,), ("seq",), devices=jax.devices()[:4])
    ring = lambda q, k: ea.parallel.ring_hopfield_energy(q, k, plain, mask=mask)  # noqa: E731
    one = lambda q, k: ea.hopfield_energy(q, k, mask=mask)  # noqa: E731
    # Eagerly (as the failing call was made), and forward mode under jit.
    expected = jax.jit(jax.grad(one, (0, 1)))(q, k)
    assert max_difference(jax.grad(ring, (0, 1))(q, k), expected) < 1e-12
    forward = jax.jit(lambda q, k, v: (jax.jvp(ring, (q, k), (v, v)), jax.jvp(one, (q, k), (v, v))))
    assert max_difference(*forward(q, k, vq)) < 1e-12

    layer = jax.tree.map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a,
        ea.nn.HopfieldAttention(DIM, num_heads=2, head_dim=2, key=jr.key(0)),
    )
    attend = ea.parallel.context_parallel(lambda layer, x: layer(x), plain)

    def loss(layer, x, run):
        return jnp.sum(jnp.sin(run(layer, x)))

    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(layer, q, attend)
    expected = eqx.filter_jit(eqx.filter_value_and_grad(loss))(layer, q, lambda m, x: m(x))
    assert max_difference(got, expected) < 1e-12
    out = attend(layer, q)
    assert {s.data.shape[0] for s in out.addressable_shards} == {SEQ // 4}  # really split
    one_device = eqx.filter_jit(lambda layer, x: layer(x))(layer, q)
    assert max_difference(out[3], one_device[3]) < 1e-12  # an ordinary array: indexing works

    # Data parallelism over a mesh whose axis has another name.
    data = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    xs = jnp.stack([q, k, vq, -q])
    batched = ea.parallel.data_parallel(lambda layer, x: layer(x), data)(layer, xs)
    expected = eqx.filter_jit(lambda layer, xs: jax.vmap(layer)(xs))(layer, xs)
    assert max_difference(batched, expected) < 1e-12


def test_sequence_parallel_training_steps_equal_one_device():
    # A training step with the sequence split (the ring inside the loss, its gradient and the
    # optimiser update), and with batch x sequence on a 2-D mesh, equal one device's.
    import optax

    layer = ea.nn.HopfieldAttention(DIM, num_heads=2, head_dim=2, num_steps=2, key=jr.key(1))
    xs = jr.normal(jr.key(2), (4, SEQ, DIM))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(layer, eqx.is_inexact_array))

    def loss(layer, x):
        return jnp.mean(jnp.square(layer(x) - x))

    one = jax.make_mesh((1,), ("batch",), devices=jax.devices()[:1])
    expected = ea.parallel.sharded_train_step(loss, optimizer, one)(layer, opt_state, xs)
    meshes = {
        "sequence": (jax.make_mesh((4,), ("seq",), devices=jax.devices()[:4]), None),
        "batch x sequence": (jax.make_mesh((2, 4), ("batch", "seq")), "batch"),
    }
    for name, (mesh, batch_axis) in meshes.items():
        step = ea.parallel.sharded_train_step(
            loss, optimizer, mesh, batch_axis=batch_axis, sequence_axis="seq"
        )
        got = step(layer, opt_state, xs)
        # float32: the ring adds the sums over keys in another order.
        for a, b in zip(
            jax.tree.leaves(eqx.filter(got, eqx.is_array)),
            jax.tree.leaves(eqx.filter(expected, eqx.is_array)),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=name)
