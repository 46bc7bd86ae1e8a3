"""`ea.lagrangians`: each gradient is its activation, each Legendre energy is bounded below
by the stated bound (and reaches it), each Hessian is PSD, float32 is stable, and parameters
are validated and learnable.

Each check runs all the Lagrangians in one compiled program (compiling is most of the cost),
and names the Lagrangian when it fails.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea
from energyattn import lagrangians as L


def _softmax(u, axis):
    e = np.exp(u - u.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _ghostmax(u, axis):
    e = np.exp(u)
    return e / (1 + e.sum(axis=axis, keepdims=True))


def _layer_norm(x, gamma, delta, eps, axis):
    centred = x - x.mean(axis=axis, keepdims=True)
    out = gamma * centred / np.sqrt(np.mean(centred**2, axis=axis, keepdims=True) + eps)
    return out + np.expand_dims(delta, 1 - axis % 2)  # x is 2-d: delta runs along `axis`


DELTA2, DELTA3 = np.array([0.3, -0.2]), np.array([0.5, -1.0, 0.25])
P = functools.partial

# name: (Lagrangian with bound parameters, shape, activation in NumPy written out)
ACTIVATIONS = {
    "identity": (L.identity, (3, 2), lambda x: x),
    "relu": (L.relu, (5,), lambda x: np.maximum(x, 0)),
    "repu-2": (P(L.repu, n=2), (4,), lambda x: np.maximum(x, 0)),
    "repu-3": (L.repu, (2, 3), lambda x: np.maximum(x, 0) ** 2),
    "repu-5": (P(L.repu, n=5), (4,), lambda x: np.maximum(x, 0) ** 4),
    "exp": (P(L.exp, beta=0.7), (4,), lambda x: np.exp(0.7 * x)),
    "rexp": (P(L.rexp, beta=1.3), (2, 3), lambda x: np.where(x > 0, np.exp(1.3 * x) - 1, 0)),
    "tanh": (P(L.tanh, beta=0.5), (2, 3), lambda x: np.tanh(0.5 * x)),
    "sigmoid": (P(L.sigmoid, beta=2.0), (4,), lambda x: 1 / (1 + np.exp(-2.0 * x))),
    "softmax": (P(L.softmax, beta=1.5), (2, 3), lambda x: _softmax(1.5 * x, -1)),
    "softmax-axis0": (P(L.softmax, beta=1.5, axis=0), (2, 3), lambda x: _softmax(1.5 * x, 0)),
    "softmax-3d": (P(L.softmax, axis=1), (2, 3, 2), lambda x: _softmax(x, 1)),
    "ghostmax": (P(L.ghostmax, beta=0.8), (2, 3), lambda x: _ghostmax(0.8 * x, -1)),
    "ghostmax-axis0": (P(L.ghostmax, axis=0), (2, 3), lambda x: _ghostmax(x, 0)),
    "spherical": (L.spherical, (2, 3), lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)),
    "spherical-axis0": (
        P(L.spherical, axis=0),
        (2, 3),
        lambda x: x / np.linalg.norm(x, axis=0, keepdims=True),
    ),
    "layer_norm": (
        P(L.layer_norm, gamma=1.7, delta=DELTA3, eps=1e-3),
        (2, 3),
        lambda x: _layer_norm(x, 1.7, DELTA3, 1e-3, -1),
    ),
    "layer_norm-axis0": (
        P(L.layer_norm, gamma=0.6, delta=DELTA2, axis=0),
        (2, 3),
        lambda x: _layer_norm(x, 0.6, DELTA2, 1e-5, 0),
    ),
}


def test_gradients_are_the_activations():
    rng = np.random.default_rng(0)
    xs = {name: 2 * rng.standard_normal(shape) for name, (_, shape, _) in ACTIVATIONS.items()}
    results = jax.jit(
        lambda xs: {name: jax.value_and_grad(ACTIVATIONS[name][0])(x) for name, x in xs.items()}
    )(xs)
    for name, (_, shape, activation) in ACTIVATIONS.items():
        value, grad = results[name]
        assert value.shape == () and grad.shape == shape, name
        np.testing.assert_allclose(grad, activation(xs[name]), rtol=0, atol=1e-10, err_msg=name)


def test_values_are_the_lagrangians():
    """Spot checks of the values themselves (the gradients fix them up to a constant)."""
    x = np.array([[-1.2, 0.4, 2.0], [0.3, -0.1, 0.7]])
    relu = np.maximum(x, 0)
    values = jax.jit(
        lambda x: [
            L.identity(x),
            L.repu(x, n=4),
            L.rexp(x, beta=2.0),
            L.tanh(x, beta=3.0),
            L.sigmoid(x, beta=0.5),
            L.softmax(x, axis=0),
            L.ghostmax(x, beta=2.0),
            L.spherical(x),
            L.layer_norm(x, axis=0),
        ]
    )(x)
    centred = x - x.mean(axis=0)
    expected = [
        0.5 * np.sum(x**2),
        np.sum(relu**4) / 4,
        np.sum(np.exp(2 * relu) - 1) / 2 - relu.sum(),
        np.sum(np.log(np.cosh(3 * x))) / 3,
        np.sum(np.log1p(np.exp(0.5 * x))) / 0.5,
        np.sum(np.log(np.exp(x).sum(axis=0))),
        np.sum(np.log1p(np.exp(2 * x).sum(axis=1))) / 2,
        np.linalg.norm(x, axis=1).sum(),
        2 * np.sum(np.sqrt(np.mean(centred**2, axis=0) + 1e-5)),
    ]
    np.testing.assert_allclose(values, expected, rtol=1e-12, atol=1e-14)


BETA = 0.7
ZEROS, NEGATIVE = np.zeros((2, 3)), -np.ones((2, 3))
# name: (Lagrangian, lower bound of the Legendre energy for x of shape (2, 3), where attained)
BOUNDS = {
    "identity": (L.identity, 0.0, ZEROS),
    "relu": (L.relu, 0.0, NEGATIVE),
    "repu": (L.repu, 0.0, NEGATIVE),
    "repu-2": (P(L.repu, n=2), 0.0, NEGATIVE),
    "exp": (P(L.exp, beta=BETA), -6 / BETA, ZEROS),
    "rexp": (P(L.rexp, beta=BETA), 0.0, NEGATIVE),
    "tanh": (P(L.tanh, beta=BETA), 0.0, ZEROS),
    "sigmoid": (P(L.sigmoid, beta=BETA), -6 * math.log(2) / BETA, ZEROS),
    # constant along the axis
    "softmax": (P(L.softmax, beta=BETA), -2 * math.log(3) / BETA, np.array([[1.7] * 3, [-4] * 3])),
    "softmax-axis0": (P(L.softmax, beta=BETA, axis=0), -3 * math.log(2) / BETA, ZEROS),
    "ghostmax": (P(L.ghostmax, beta=BETA), -2 * math.log(4) / BETA, ZEROS),
    "spherical": (L.spherical, 0.0, np.ones((2, 3))),
    # each token constant: -tokens * gamma * dim * sqrt(eps)
    "layer_norm": (
        P(L.layer_norm, gamma=2.0, delta=DELTA3, eps=1e-2),
        -2 * 2.0 * 3 * math.sqrt(1e-2),
        np.array([[0.5] * 3, [-3.0] * 3]),
    ),
}


def test_legendre_energies_are_bounded_below_and_reach_the_bound():
    rng = np.random.default_rng(1)
    random = [s * rng.standard_normal((2, 3)) for s in (0.1, 1.0, 4.0)]
    extreme = [np.array([[-30.0, 0.0, 30.0], [-1e-3, 1e-3, 20.0]]), np.full((2, 3), -25.0)]
    xs = {
        name: np.stack([attained, *random, *extreme]) for name, (_, _, attained) in BOUNDS.items()
    }
    energies = jax.jit(
        lambda xs: {
            name: jax.vmap(P(ea.legendre_energy, BOUNDS[name][0]))(x) for name, x in xs.items()
        }
    )(xs)
    for name, (_, bound, _) in BOUNDS.items():
        assert np.all(energies[name] >= bound - 1e-10 * (1 + abs(bound))), (name, energies[name])
        np.testing.assert_allclose(energies[name][0], bound, rtol=1e-12, atol=1e-12, err_msg=name)


def test_legendre_energies_closed_forms():
    """tanh's in [0, N log 2/beta), the normalised ones' <= 0, softmax's = -entropy/beta,
    spherical's = 0."""
    x = 3 * np.random.default_rng(2).standard_normal((2, 3))
    lagrangians = [P(L.tanh, beta=BETA), L.sigmoid, L.ghostmax, L.layer_norm]
    lagrangians += [L.spherical, P(L.softmax, beta=BETA)]
    tanh, *negative, spherical, softmax = jax.jit(
        lambda x: [ea.legendre_energy(lagrangian, x) for lagrangian in lagrangians]
    )(x)
    assert 0 < tanh < 6 * math.log(2) / BETA
    assert all(e < 0 for e in negative)
    np.testing.assert_allclose(spherical, 0, atol=1e-12)
    p = _softmax(BETA * x, -1)
    np.testing.assert_allclose(softmax, np.sum(p * np.log(p)) / BETA, rtol=1e-12)


def test_hessians_are_symmetric_psd():
    x = 1.5 * np.random.default_rng(3).standard_normal((2, 3))
    hessians = jax.jit(lambda x: {name: jax.hessian(c[0])(x) for name, c in BOUNDS.items()})(x)
    for name, hessian in hessians.items():
        hessian = np.asarray(hessian).reshape(6, 6)
        assert np.all(np.isfinite(hessian)), name
        np.testing.assert_allclose(hessian, hessian.T, rtol=0, atol=1e-12, err_msg=name)
        assert np.linalg.eigvalsh(hessian).min() >= -1e-10, name


def test_derivatives_at_zero():
    """At 0, where |y| or a norm could have hidden the derivatives: tanh's and sigmoid's
    Hessians are right, spherical's value and gradient are 0 (not NaN)."""
    x = np.array([[0.0, 0.0, 0.0], [3.0, 0.0, -4.0]])

    def derivatives(z, x):
        tanh = jax.hessian(P(L.tanh, beta=2.0))(z)
        sigmoid = jax.hessian(L.sigmoid)(z)
        return tanh, sigmoid, jax.value_and_grad(L.spherical)(x), jax.hessian(L.spherical)(x)

    tanh, sigmoid, (value, grad), hessian = jax.jit(derivatives)(np.zeros(3), x)
    np.testing.assert_allclose(tanh, 2 * np.eye(3))
    np.testing.assert_allclose(sigmoid, 0.25 * np.eye(3))
    assert float(value) == 5.0
    np.testing.assert_allclose(grad, [[0, 0, 0], [0.6, 0, -0.8]], atol=1e-15)
    assert np.all(np.isfinite(hessian))


X32 = np.array([-1e4, -3.0, 0.0, 2.5, 1e4], np.float32)
STABLE = [L.identity, L.relu, L.repu, L.tanh, L.sigmoid, L.softmax, L.ghostmax, L.spherical,
          L.layer_norm]  # fmt: skip


def test_float32_is_stable_at_large_inputs():
    """All but the exponentials: finite values, gradients and energies at |x| = 1e4."""

    def run(x):
        return [jax.value_and_grad(f)(x) for f in STABLE]

    for f, (value, grad) in zip(STABLE, jax.jit(run)(X32), strict=True):
        energy = np.sum(grad * X32) - value  # the Legendre energy
        assert value.dtype == grad.dtype == energy.dtype == jnp.float32, f.__name__
        assert np.isfinite(value) and np.all(np.isfinite(grad)), f.__name__
        assert np.isfinite(energy), f.__name__


def test_exponentials_overflow_only_above_88_in_float32():
    """`exp` and `rexp` overflow above beta x ~ 88 in float32, as documented; not below."""
    below = np.array([-1e4, -3.0, 0.0, 2.5, 80.0], np.float32)

    def run(below, above):
        return [(jax.value_and_grad(f)(below), f(above)) for f in (L.exp, L.rexp)]

    for (value, grad), overflow in jax.jit(run)(below, X32):
        assert np.isfinite(value) and np.all(np.isfinite(grad))
        assert not np.isfinite(overflow)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: L.exp(x, beta=0.0), "beta must be > 0"),
        (lambda x: L.rexp(x, beta=-1.0), "beta must be > 0"),
        (lambda x: L.tanh(x, beta=jnp.array(-2.0)), "beta must be > 0"),
        (lambda x: L.sigmoid(x, beta=0), "beta must be > 0"),
        (lambda x: L.softmax(x, beta=-0.5), "beta must be > 0"),
        (lambda x: L.ghostmax(x, beta=0.0), "beta must be > 0"),
        (lambda x: L.softmax(x, beta=np.ones(2)), "beta must be a scalar"),
        (lambda x: L.repu(x, n=1), "n must be an integer >= 2"),
        (lambda x: L.repu(x, n=2.5), "n must be an integer >= 2"),
        (lambda x: L.layer_norm(x, eps=0.0), "eps must be > 0"),
        (lambda x: L.layer_norm(x, gamma=np.ones(3)), r"gamma must be a scalar.*got shape \(3,\)"),
        (lambda x: L.layer_norm(x, gamma=-1.0), r"gamma must be >= 0 \(L is convex only then\)"),
        (lambda x: L.softmax(x, axis=2), "axis 2 is out of bounds for x of shape \\(2, 3\\)"),
        (lambda x: L.spherical(x[0, 0]), "x must have at least one axis"),
    ],
)
def test_bad_parameters_raise(user_mode, call, match):
    with pytest.raises(ValueError, match=match):
        call(np.ones((2, 3)))


def test_traced_bad_beta_raises_at_runtime(user_mode):
    with pytest.raises(Exception, match="beta must be > 0"):
        jax.jit(lambda b: L.softmax(np.ones(3), beta=b))(-1.0)


LEARNABLE = [(f, "beta") for f in (L.exp, L.rexp, L.tanh, L.sigmoid, L.softmax, L.ghostmax)]
LEARNABLE += [(L.layer_norm, "gamma"), (L.layer_norm, "eps")]


def test_parameters_bound_with_equinox_partial_are_learnable():
    """d(energy)/d(parameter) through `eqx.Partial` equals a central finite difference."""
    x = np.random.default_rng(4).standard_normal((2, 3))
    h = 1e-5

    def energy(lagrangian):
        return ea.legendre_energy(lagrangian, x)

    def grad_and_difference(lagrangian, name, value):
        grad = eqx.filter_grad(energy)(eqx.Partial(lagrangian, **{name: value})).keywords[name]
        up, down = jax.vmap(lambda v: energy(P(lagrangian, **{name: v})))(value + np.array([h, -h]))
        return grad, (up - down) / (2 * h)

    values = [0.3 if name == "eps" else 1.4 for _, name in LEARNABLE]
    results = jax.jit(
        lambda values: [grad_and_difference(*c, v) for c, v in zip(LEARNABLE, values, strict=True)]
    )(values)
    for (f, name), (grad, difference) in zip(LEARNABLE, results, strict=True):
        assert np.isfinite(grad), (f.__name__, name)
        np.testing.assert_allclose(
            grad, difference, rtol=1e-6, atol=1e-9, err_msg=f"{f.__name__} {name}"
        )


def test_jit_and_vmap_over_beta():
    x = np.random.default_rng(5).standard_normal(4)
    betas = np.array([0.5, 1.0, 3.0])
    energies = jax.jit(jax.vmap(lambda b: ea.legendre_energy(eqx.Partial(L.softmax, beta=b), x)))
    p = _softmax(betas[:, None] * x, -1)  # minus the entropy over beta
    np.testing.assert_allclose(energies(betas), np.sum(p * np.log(p), axis=1) / betas, rtol=1e-12)
