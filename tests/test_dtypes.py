"""float32 and bfloat16, checked with JAX's default config (x64 off).

The rest of the suite runs in float64 (conftest); these checks turn x64 off for their test
(the `jax_defaults` fixture, as the documentation's examples run): the identities must hold
to 1e-6 in float32, the precision users actually get.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import energyattn as ea


def test_float32_and_bfloat16_in_default_config(jax_defaults):
    assert jnp.zeros(()).dtype == jnp.float32  # the default config: no x64
    k = iter(jr.split(jr.key(0), 16))

    # Each computation is compiled whole (jit), once per dtype, not op by op.
    # The seed's check: 8 state patterns, 32 stored patterns, d = 512, beta = 1/sqrt(d).
    q = jr.normal(next(k), (8, 512))
    m = jr.normal(next(k), (32, 512))
    beta = 512**-0.5
    assert q.dtype == jnp.float32

    @jax.jit
    def step(q, m):
        energy = ea.HopfieldEnergy(m, beta=beta)
        return ea.descend(energy, q, step_size=1.0, num_steps=1).value

    @jax.jit
    def softmax_attention(q, m):
        return jax.nn.softmax(beta * q @ m.T, axis=-1) @ m

    cross = step(q, m)
    assert cross.dtype == jnp.float32
    ref = softmax_attention(q, m)
    np.testing.assert_allclose(cross, ref, rtol=0, atol=1e-6)
    dpa = jax.jit(jax.nn.dot_product_attention, static_argnames="scale")(
        q[:, None], m[:, None], m[:, None], scale=beta
    )[:, 0]
    np.testing.assert_allclose(cross, dpa, rtol=0, atol=1e-6)
    # Bare self-attention, context held fixed.
    self_ = step(q, q)
    self_ref = softmax_attention(q, q)
    np.testing.assert_allclose(self_, self_ref, rtol=0, atol=1e-6)

    # Layers in float32: energy attention = softmax attention with keys as values.
    x = jr.normal(next(k), (6, 32))
    hop = ea.nn.HopfieldAttention(32, num_heads=4, key=next(k))
    soft = ea.nn.SoftmaxAttention(32, num_heads=4, key=next(k))
    for name in ["query_proj", "key_proj", "output_proj"]:
        soft = eqx.tree_at(lambda layer, name=name: getattr(layer, name), soft, getattr(hop, name))
    soft = eqx.tree_at(lambda layer: layer.value_proj, soft, hop.key_proj)
    mask = jr.bernoulli(next(k), 0.7, (6, 6)).at[:, 0].set(True)
    attend = eqx.filter_jit(lambda layer, x, mask: layer(x, mask=mask))
    out = attend(hop, x, mask)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, attend(soft, x, mask), rtol=0, atol=1e-6)

    # bfloat16 inputs: scores and log-sum-exp accumulate in float32, so results stay finite and
    # close to the float32 computation (to bfloat16's ~3 significant digits).
    qb, mb = q.astype(jnp.bfloat16), m.astype(jnp.bfloat16)
    energy_fn = jax.jit(ea.hopfield_energy)
    energy = energy_fn(qb, mb, beta=beta)
    assert energy.dtype == jnp.float32, energy.dtype
    energy32 = energy_fn(qb.astype(jnp.float32), mb.astype(jnp.float32), beta=beta)
    np.testing.assert_allclose(energy, energy32, rtol=1e-5)
    grad = jax.jit(jax.grad(ea.hopfield_energy))(qb, mb, beta=beta)
    assert grad.dtype == jnp.bfloat16
    outb = step(qb, mb)
    assert outb.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(outb)))
    np.testing.assert_allclose(outb.astype(jnp.float32), ref, rtol=0, atol=3e-2)
    layer_b = attend(hop, x.astype(jnp.bfloat16), mask)
    assert bool(jnp.all(jnp.isfinite(layer_b)))
    np.testing.assert_allclose(layer_b.astype(jnp.float32), out, rtol=0, atol=5e-2)
