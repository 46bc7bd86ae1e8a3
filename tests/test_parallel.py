"""`ea.parallel`: data-parallel layers, models and training steps over 8 (forced CPU) devices.

Every multi-device result must equal the same computation on one device.
"""

import functools
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import energyattn as ea

BATCH = 16


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.fail(
            f"these tests need 8 devices, found {jax.device_count()}: run pytest from the "
            "repository (tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8)"
        )
    return ea.parallel.make_mesh(8)


@functools.cache
def layers():
    key = jr.key(0)
    return {
        "softmax": ea.nn.SoftmaxAttention(8, num_heads=2, key=key),
        "hopfield": ea.nn.HopfieldAttention(8, num_heads=2, num_steps=2, step_size=0.5, key=key),
        "energy_transformer": ea.nn.EnergyTransformer(
            8, num_heads=2, head_dim=4, num_memories=6, num_steps=3, key=key
        ),
    }


def apply(layer, x):
    return layer(x)


@pytest.mark.parametrize("name", ["softmax", "hopfield", "energy_transformer"])
def test_layers_on_8_devices_equal_one_device(mesh, name):
    layer = layers()[name]
    xs = jr.normal(jr.key(1), (BATCH, 5, 8))
    expected = eqx.filter_jit(jax.vmap(apply, in_axes=(None, 0)))(layer, xs)
    for method in ("jit", "shard_map"):
        out = ea.parallel.data_parallel(apply, mesh, method=method)(layer, xs)
        # Really spread over the mesh: each of the 8 devices holds 2 of the 16 examples.
        assert len(out.sharding.device_set) == 8
        assert {s.data.shape[0] for s in out.addressable_shards} == {BATCH // 8}
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    out = ea.parallel.pmap_apply(apply, layer, xs)
    assert len(out.sharding.device_set) == 8  # jax.pmap's outputs stay on its 8 devices
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_several_batch_arguments_and_a_model(mesh):
    # A task model with two batched inputs (images and patch masks).
    model = ea.models.ImageEnergyTransformer(
        image_shape=(1, 4, 4),
        patch_size=2,
        dim=8,
        num_heads=2,
        head_dim=4,
        num_memories=6,
        num_steps=1,
        key=jr.key(2),
    )
    images = np.random.default_rng(3).uniform(size=(BATCH, 1, 4, 4))
    masks = np.zeros((BATCH, model.num_patches), bool)
    masks[:, 1] = masks[::2, 2] = True
    expected = eqx.filter_jit(jax.vmap(ea.models.masked_patch_mse, in_axes=(None, 0, 0)))(
        model, images, masks
    )
    # shard_map with one in_spec per batch argument (the jit path with two batch arguments
    # is the training step's below).
    run = ea.parallel.data_parallel(ea.models.masked_patch_mse, mesh, method="shard_map")
    out = run(model, images, masks)
    assert out.shape == (BATCH,) and len(out.sharding.device_set) == 8
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def example_loss(layer, x, target):
    return jnp.mean(jnp.square(layer(x) - target))


def test_sharded_train_step_equals_one_device(mesh):
    layer = layers()["hopfield"]
    xs = jr.normal(jr.key(4), (BATCH, 5, 8))
    targets = jr.normal(jr.key(5), (BATCH, 5, 8))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(layer, eqx.is_inexact_array))

    @eqx.filter_jit
    def one_device(layer, opt_state):
        def loss(layer):
            return jnp.mean(jax.vmap(example_loss, in_axes=(None, 0, 0))(layer, xs, targets))

        value, grads = eqx.filter_value_and_grad(loss)(layer)
        updates, opt_state = optimizer.update(grads, opt_state, layer)
        return eqx.apply_updates(layer, updates), opt_state, value

    step = ea.parallel.sharded_train_step(example_loss, optimizer, mesh)
    sharded, expected = (layer, opt_state), (layer, opt_state)
    for _ in range(2):
        *sharded, loss = step(*sharded, xs, targets)
        *expected, expected_loss = one_device(*expected)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
    for a, b in zip(jax.tree.leaves(sharded[0]), jax.tree.leaves(expected[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    weight = sharded[0].query_proj.weight
    assert len(weight.sharding.device_set) == 8 and weight.sharding.is_fully_replicated


def test_bad_input(mesh, user_mode):
    layer = layers()["softmax"]
    with pytest.raises(ValueError, match=r"divisible by the 8 devices, got .* shape \(12, 5, 8\)"):
        ea.parallel.data_parallel(apply, mesh)(layer, jnp.ones((12, 5, 8)))
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        ea.parallel.pmap_apply(apply, layer, jnp.ones((12, 5, 8)))
    with pytest.raises(ValueError, match="method must be one of"):
        ea.parallel.data_parallel(apply, mesh, method="pmap")
    with pytest.raises(ValueError, match=r"got an array of shape \(12, 5, 8\)"):
        ea.parallel.shard_batch({"x": jnp.ones((16, 5)), "y": jnp.ones((12, 5, 8))}, mesh)
    with pytest.raises(ValueError, match=r"divisible by the 8 devices, got .* shape \(4,\)"):
        ea.parallel.global_batch(np.ones(4), mesh)
    with pytest.raises(ValueError, match="num_devices=9 but only 8 devices"):
        ea.parallel.make_mesh(9)
    with pytest.raises(ValueError, match="num_devices must be a positive integer, got 0"):
        ea.parallel.make_mesh(0)
    with pytest.raises(ValueError, match="process_id must be < num_processes=2"):
        ea.parallel.initialize("localhost:1", 2, 2)
    with pytest.raises(ValueError, match="together, or none of them"):
        ea.parallel.initialize("localhost:1", 2)


WORKER = textwrap.dedent(
    """
    import sys
    import equinox as eqx
    import jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax
    import energyattn as ea

    address, pid = sys.argv[1], int(sys.argv[2])
    ea.parallel.initialize(address, 2, pid)
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(1)  # the same numbers in both processes

    def report(name, value, expected):
        print("RESULT", pid, name, float(value), float(expected), flush=True)

    def local_copy(x):  # a replicated global array: this process's copy
        return np.asarray(x.addressable_data(0))

    # Data parallelism: a layer and a training step, the batch split over both processes.
    mesh = ea.parallel.make_mesh()
    layer = ea.nn.HopfieldAttention(8, num_heads=2, key=jr.key(0))
    xs = rng.normal(size=(8, 5, 8)).astype(np.float32)
    local = xs[4 * pid : 4 * (pid + 1)]  # each process loads its own half of the batch
    batch = ea.parallel.global_batch(local, mesh)

    def square_norm(layer, x):
        return jnp.sum(layer(x) ** 2)

    out = ea.parallel.data_parallel(square_norm, mesh)(layer, batch)
    assert out.shape == (8,) and len(out.sharding.device_set) == 4
    # The global sum is a cross-process reduction; replicated, so every process reads it.
    total = jax.jit(jnp.sum, out_shardings=ea.parallel.replicated(mesh))(out)
    # The same sum computed by this process alone, on one device.
    norms = eqx.filter_jit(jax.vmap(square_norm, (None, 0)))
    report("forward", total, jnp.sum(norms(layer, xs)))

    optimizer = optax.sgd(0.01)
    opt_state = optimizer.init(eqx.filter(layer, eqx.is_inexact_array))
    step = ea.parallel.sharded_train_step(square_norm, optimizer, mesh)
    trained, _, loss = step(layer, opt_state, batch)
    mean_loss = lambda layer: jnp.mean(norms(layer, xs))
    expected_loss, grads = eqx.filter_value_and_grad(mean_loss)(layer)
    expected = eqx.apply_updates(layer, optimizer.update(grads, opt_state)[0])
    report("train_loss", local_copy(loss), expected_loss)
    for name in ("query_proj", "key_proj", "output_proj"):
        got, want = getattr(trained, name).weight, getattr(expected, name).weight
        report("train_" + name, np.abs(local_copy(got) - want).max() + 1, 1)

    # Context parallelism: the sequence split over the 4 devices of both processes.
    seq_mesh = ea.parallel.make_mesh(axis_name="seq")
    q, k, w = (rng.normal(size=(16, 8)).astype(np.float32) for _ in range(3))
    mask = np.tril(np.ones((16, 16), bool))

    def energy_and_grad(energy):
        def run(q, k):
            value, (gq, gk) = jax.value_and_grad(energy, argnums=(0, 1))(q, k)
            return value, jnp.sum(gq * w) + jnp.sum(gk * w)
        return run

    ring = lambda q, k: ea.parallel.ring_hopfield_energy(q, k, seq_mesh, beta=0.5, mask=mask)
    one = lambda q, k: ea.hopfield_energy(q, k, beta=0.5, mask=mask)
    got = jax.jit(energy_and_grad(ring), out_shardings=ea.parallel.replicated(seq_mesh))(q, k)
    want = jax.jit(energy_and_grad(one))(q, k)
    report("ring_energy", local_copy(got[0]), want[0])
    report("ring_gradient", local_copy(got[1]), want[1])

    et = ea.nn.EnergyTransformer(8, num_heads=2, head_dim=4, num_memories=6, key=jr.key(1))
    recall = lambda layer, x: jnp.sum(layer(x) * w)
    got = ea.parallel.context_parallel(recall, seq_mesh)(et, q)
    report("et_recall", local_copy(got), eqx.filter_jit(recall)(et, q))
    jax.distributed.shutdown()
    """
)


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_on_loopback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # Two devices per process; the suite's other XLA flags (fast compilation, no YNN fusions:
    # tests/conftest.py) carry over.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=2".strip(),
    )
    env.pop("JAX_ENABLE_X64", None)
    address = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, str(pid)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    # One deadline for both: a process waiting for a peer that died must not hang the suite.
    deadline = time.monotonic() + 120
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"two-process run timed out after 120 s:\n{proc.communicate()[0]}")
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    results = [
        line.split()[1:]
        for output in outputs
        for line in output.splitlines()
        if line.startswith("RESULT")
    ]
    names = ["forward", "train_loss", "train_query_proj", "train_key_proj", "train_output_proj"]
    names += ["ring_energy", "ring_gradient", "et_recall"]
    assert sorted((int(pid), name) for pid, name, *_ in results) == sorted(
        (pid, name) for pid in (0, 1) for name in names
    )
    for _, name, value, expected in results:
        # float32, and sums over devices of two processes added in another order.
        np.testing.assert_allclose(float(value), float(expected), rtol=2e-5, err_msg=name)
