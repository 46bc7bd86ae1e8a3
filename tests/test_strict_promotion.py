"""The public entry points under JAX's strict dtype promotion.

A user may set `jax_numpy_dtype_promotion` to `"strict"`, where any implicit promotion
between different dtypes (float64 with float32, bfloat16 with float32) raises
`TypePromotionError`. The library picks its own dtypes on the standard lattice
(`energyattn._dtypes`) and casts explicitly, so none of its code promotes implicitly. Each
test traces inside `jax.numpy_dtype_promotion("strict")` (a context: the mode does not leak
into other tests); the jitted functions are shared across the grid, compiled once per dtype
(jit's cache is keyed on the promotion mode too).
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea

DTYPES = [jnp.bfloat16, jnp.float32, jnp.float64]
SEQ, MEM, DIM = 5, 7, 4


def _strict():
    return jax.numpy_dtype_promotion("strict")


def _inputs(dtype, *shapes):
    keys = jr.split(jr.key(0), len(shapes))
    return [jr.normal(k, s).astype(dtype) for k, s in zip(keys, shapes, strict=True)]


@jax.jit
def _hopfield_value_and_grads(query, memory):
    def energy(q, m, implementation):
        return ea.hopfield_energy(
            q, m, beta=0.5, implementation=implementation, block_size=2
        ).astype(jnp.float32)  # the gradients of the implementations, in one program

    return {
        i: jax.value_and_grad(energy, argnums=(0, 1))(query, memory, i)
        for i in ("naive", "blockwise")
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_hopfield_energy_value_and_gradient(dtype):
    query, memory = _inputs(dtype, (SEQ, DIM), (MEM, DIM))
    with _strict():
        out = _hopfield_value_and_grads(query, memory)
    (naive, (gq, gm)), (blockwise, _) = out["naive"], out["blockwise"]
    assert gq.dtype == gm.dtype == dtype
    tol = {jnp.bfloat16: 5e-2, jnp.float32: 1e-5, jnp.float64: 1e-12}[dtype]
    np.testing.assert_allclose(naive, blockwise, rtol=tol)
    with jax.numpy_dtype_promotion("standard"):  # the same numbers in the standard mode
        standard = _hopfield_value_and_grads(query, memory)
    np.testing.assert_allclose(naive, standard["naive"][0], rtol=tol)


def test_mixed_dtypes_promote_explicitly():
    """Operands of two dtypes meet only through the library's explicit casts."""
    query, memory = _inputs(jnp.float32, (SEQ, DIM), (MEM, DIM))
    with _strict():
        out = _hopfield_value_and_grads(query.astype(jnp.bfloat16), memory)
    gq, gm = out["naive"][1]
    assert (gq.dtype, gm.dtype) == (jnp.bfloat16, jnp.float32)


@jax.jit
def _descend(query, memory):
    energy = ea.HopfieldEnergy(memory, beta=0.5)
    return ea.descend(energy, query, step_size=0.5, num_steps=2).value


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_descend(dtype):
    query, memory = _inputs(dtype, (SEQ, DIM), (MEM, DIM))
    with _strict():
        assert _descend(query, memory).dtype == dtype


@jax.jit
def _layers(x, hop, et):
    return hop(x), et(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_attention_layers(dtype):
    (x,) = _inputs(dtype, (SEQ, 8))
    hop = ea.nn.HopfieldAttention(8, num_heads=2, dtype=dtype, key=jr.key(1))
    et = ea.nn.EnergyTransformer(
        8, num_heads=2, head_dim=4, num_memories=6, num_steps=2, dtype=dtype, key=jr.key(2)
    )
    with _strict():
        a, b = _layers(x, hop, et)
    assert a.dtype == b.dtype == dtype


@jax.jit
def _afem_phi(t, J, H):
    return jax.value_and_grad(lambda t: ea.spin.phi(t, J, H, beta=1.0))(t)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: jnp.dtype(d).name)
def test_afem_phi(dtype):
    """AFEM's steepest-descent function and its gradient (Cholesky, triangular solves)."""
    (H,) = _inputs(dtype, (4, 3))
    J = (0.1 * jnp.ones((4, 4)) - 0.1 * jnp.eye(4)).astype(dtype)
    with _strict():
        value, grad = _afem_phi(jnp.full(4, 2.0, dtype), J, H / 3)
    assert value.dtype == grad.dtype == dtype and np.isfinite(value)


@jax.jit
def _solves(W, x):
    def fixed(x):  # Anderson (the default), implicit gradient
        sol = ea.fixed_point(lambda z, a: jnp.tanh(a[0] @ z + a[1]), jnp.zeros_like(x), (W, x))
        return jnp.sum(sol.value**2)

    def minimum(x):  # L-BFGS (the default)
        energy = lambda y, x: jnp.sum(y**4) / 4 + jnp.sum(y**2) / 2 - jnp.dot(x, y)  # noqa: E731
        return jnp.sum(ea.minimise(energy, jnp.zeros_like(x), x).value)

    def root(x):  # Newton (the default)
        return jnp.sum(ea.root_find(lambda y, x: y**3 + y - x, jnp.zeros_like(x), x).value)

    return [jax.value_and_grad(f)(x) for f in (fixed, minimum, root)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: jnp.dtype(d).name)
def test_solvers(dtype):
    """The fixed point, minimum and root entry points with their default solvers (Anderson's
    history, L-BFGS's ring of pairs) and implicit gradients."""
    W, x = _inputs(dtype, (3, 3), (3,))
    with _strict():
        out = _solves(0.3 * W, x)
    for value, grad in out:
        assert grad.dtype == dtype and np.isfinite(value) and np.all(np.isfinite(grad))
