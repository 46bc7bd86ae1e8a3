r"""`ea.lagrangians` and `ea.ham` against HAMUX 0.2.2 (B. Hoover, github.com/bhoov/hamux).

`fixtures/hamux_lagrangians.npz` holds HAMUX's own values, gradients (the activations) and
derivatives in `beta`, in float64, and a small HAMUX graph; `fixtures/make_hamux_fixture.py`
computed them (HAMUX is not a dependency). Where the two definitions agree, energyattn matches
to 1e-12. Where they differ, each test asserts the exact difference that
`docs/guides/hamux.md` states, so the guide cannot drift:

- `lagr_rexp` is energyattn's `rexp` plus $N/\beta$ ($N$ entries): the same activation.
- `lagr_layernorm` and `lagr_spherical_norm` add their bias term $\sum \delta\cdot x$ once per
  token ($T$ times in all): value $+ (T-1)\sum\delta\cdot x$, activation $+ (T-1)\delta$.
- `lagr_spherical_norm` is $\gamma\sqrt{\lVert x\rVert^2 + \epsilon}$ per group
  ($\epsilon = 10^{-5}$ by default); energyattn's `spherical` is $\lVert x\rVert$ (and its
  gradient at $x = 0$ is 0, not NaN).
- `lagr_tanh` and `lagr_sigmoid` overflow to `inf` where $\beta x \gtrsim 710$, and their
  derivative in `beta` is 0 (their custom JVPs drop the `beta` tangent).
- `lagr_softmax` and `lagr_ghostmax` return one value per group, not their sum; `lagr_ghostmax`
  has no `beta` and normalises over all entries by default (`axis=None`).

All of energyattn's numbers come from one compiled function.
"""

import functools
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea
from energyattn import lagrangians as L

FIXTURE = np.load(pathlib.Path(__file__).parent / "fixtures" / "hamux_lagrangians.npz")
MANIFEST = json.loads(str(FIXTURE["manifest"]))
CASES = MANIFEST["cases"]
INPUTS = {k.removeprefix("inputs/"): FIXTURE[k] for k in FIXTURE if k.startswith("inputs/")}
TOL = 1e-12
WITH_BETA = {"lagr_exp": L.exp, "lagr_rexp": L.rexp, "lagr_tanh": L.tanh, "lagr_sigmoid": L.sigmoid}


def _case_id(case):
    kwargs = ",".join(f"{k}={v}" for k, v in case["kwargs"].items())
    return f"{case['hamux']}-{case['input']}" + (f"-{kwargs}" if kwargs else "")


def _theirs(case):
    """HAMUX's value (its own shape), gradient (the input's shape) and `beta` derivative."""
    x = INPUTS[case["input"]]
    start, shape = case["value"]
    value = FIXTURE["value"][start : start + int(np.prod(shape))].reshape(shape)
    grad = FIXTURE["grad"][case["grad"] : case["grad"] + x.size].reshape(x.shape)
    dbeta = FIXTURE["dbeta"][case["dbeta"]] if "dbeta" in case else None
    return value, grad, dbeta


def _kwarg(case, name, default=None):
    value = case["kwargs"].get(name, default)
    return jnp.asarray(INPUTS[value]) if isinstance(value, str) else value


def _ours(case):
    """energyattn's Lagrangian for a HAMUX case, as a function of the state and of `beta`."""
    name = case["hamux"]
    axis = _kwarg(case, "axis", -1)
    if name == "lagr_identity":
        return lambda x, beta: L.identity(x)
    if name == "lagr_relu":
        return lambda x, beta: L.relu(x)
    if name == "lagr_repu":
        return lambda x, beta: L.repu(x, n=case["kwargs"]["n"])
    if name in WITH_BETA:
        return lambda x, beta: WITH_BETA[name](x, beta=beta)
    if name == "lagr_softmax":
        return lambda x, beta: L.softmax(x, beta=beta, axis=axis)
    if name == "lagr_ghostmax":  # HAMUX's default axis is None: all entries are one group
        axis = _kwarg(case, "axis")
        if axis is None:
            return lambda x, beta: L.ghostmax(x.reshape(-1))
        return lambda x, beta: L.ghostmax(x, axis=axis)
    if name == "lagr_spherical_norm":
        return lambda x, beta: L.spherical(x, axis=axis)
    if name == "lagr_layernorm":
        kwargs = dict(gamma=_kwarg(case, "gamma", 1.0), delta=_kwarg(case, "delta"))
        kwargs["eps"] = _kwarg(case, "eps", 1e-5)
        if axis is None:  # HAMUX's axis=None: the whole array is one token
            return lambda x, beta: L.layer_norm(x.reshape(-1), **kwargs)
        return lambda x, beta: L.layer_norm(x, axis=axis, **kwargs)
    raise AssertionError(f"no energyattn Lagrangian for {name}")


def _graph(neurons, weight, bias):
    """The fixture's HAMUX graph in energyattn: the same layers, synapses and weights."""
    graph = ea.ham.HAM(
        neurons=neurons,
        synapses={
            "memory": ea.ham.DenseSynapse(4, 3, key=jax.random.key(0)),
            "field": ea.ham.BiasSynapse(4),
        },
        connections={"memory": ("visible", "hidden"), "field": "visible"},
    )
    return eqx.tree_at(
        lambda g: (g.synapses["memory"].weight, g.synapses["field"].bias), graph, (weight, bias)
    )


@functools.cache
def ours():
    """energyattn's numbers for every case and for the graph, from one compiled function.

    Per case: the value, the gradient and the derivative in `beta` (where HAMUX has one).
    For the graph (see `test_graph_against_hamux`): the energy and `dE/dg` at the start, and five
    Euler steps.
    """

    @eqx.filter_jit
    def run(xs, betas, weights, x0):
        cases = []
        for case, x, beta in zip(CASES, xs, betas, strict=True):
            lagrangian = _ours(case)
            if "dbeta" in case:
                value, (grad, dbeta) = jax.value_and_grad(lagrangian, argnums=(0, 1))(x, beta)
                result = {"value": value, "grad": grad, "dbeta": dbeta}
            else:
                value, grad = jax.value_and_grad(lagrangian)(x, beta)
                result = {"value": value, "grad": grad}
            cases.append(result)
        graph = _graph(neurons, *weights)  # the synapses are made here: nothing runs eagerly
        steps = graph.descend(x0, step_size=0.1, num_steps=5)
        graph_result = {
            "energy": graph.energy(x0),
            "dEdg": graph.energy_gradient(x0),
            "x5": steps.value,
            "energies": steps.energies,
        }
        return cases, graph_result

    xs = [jnp.asarray(INPUTS[case["input"]]) for case in CASES]
    # A traced beta only where its derivative is wanted (checking a traced beta costs time).
    betas = [
        jnp.asarray(beta) if "dbeta" in case else beta
        for case in CASES
        for beta in [float(case["kwargs"].get("beta", 1.0))]
    ]
    x0 = {k: jnp.asarray(FIXTURE[f"graph/x0/{k}"]) for k in ("visible", "hidden")}
    weights = (jnp.asarray(FIXTURE["graph/W"]), jnp.asarray(FIXTURE["graph/b"]))
    neurons = {  # outside the compiled function: `Neurons` checks its time constant eagerly
        "visible": ea.ham.Neurons(L.tanh, (4,)),
        "hidden": ea.ham.Neurons(functools.partial(L.softmax, beta=2.0), (3,)),
    }
    return jax.tree.map(np.asarray, run(xs, betas, weights, x0))


def _close(actual, expected):
    """Equal to 1e-12, relative to the size of the numbers (absolute below 1)."""
    actual, expected = np.broadcast_arrays(np.asarray(actual), np.asarray(expected))
    error = np.abs(actual - expected) / np.maximum(1.0, np.abs(expected))
    assert error.size == 0 or np.max(error) <= TOL, f"max error {np.max(error):.3g}"


def test_the_fixture_is_hamux_0_2_2():
    assert MANIFEST["hamux"] == "0.2.2"
    assert {c["hamux"] for c in CASES} == {
        "lagr_identity", "lagr_relu", "lagr_repu", "lagr_exp", "lagr_rexp", "lagr_tanh",
        "lagr_sigmoid", "lagr_softmax", "lagr_ghostmax", "lagr_spherical_norm",
        "lagr_layernorm",
    }  # fmt: skip


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_lagrangian_against_hamux(index):
    case = CASES[index]
    name, kwargs = case["hamux"], case["kwargs"]
    x = INPUTS[case["input"]]
    value, grad, dbeta = _theirs(case)
    mine = ours()[0][index]
    beta = kwargs.get("beta", 1.0)

    if name in ("lagr_softmax", "lagr_ghostmax"):
        # HAMUX returns one log-sum-exp per group (a scalar only for one group).
        axis = kwargs.get("axis", -1 if name == "lagr_softmax" else None)
        groups = () if axis is None else np.delete(np.array(x.shape), axis)
        assert value.shape == tuple(groups)
        value = value.sum()

    if name == "lagr_rexp":
        # The same activation; HAMUX's Lagrangian is larger by N/beta (it is not 0 at x <= 0).
        _close(value - mine["value"], x.size / beta)
        _close(mine["grad"], grad)
        if dbeta is not None:
            _close(dbeta - mine["dbeta"], -x.size / beta**2)
        return

    if name in ("lagr_tanh", "lagr_sigmoid"):
        # HAMUX's custom JVPs drop the beta tangent: its derivative in beta is exactly 0.
        # energyattn's is the true one, L(x) = F(beta x)/beta gives dL/dbeta = E(x)/beta
        # with E the Legendre energy.
        if dbeta is not None:
            assert dbeta == 0.0
            _close(mine["dbeta"], (np.sum(mine["grad"] * x) - mine["value"]) / beta)
            assert mine["dbeta"] != 0.0
        if case["input"] == "huge":
            # log(cosh(800)) and log(exp(800) + 1) overflow in HAMUX; energyattn is finite.
            assert np.isposinf(value)
            u = beta * x
            exact = np.logaddexp(u, -u) - np.log(2) if name == "lagr_tanh" else np.logaddexp(0, u)
            _close(mine["value"], np.sum(exact) / beta)
        else:
            _close(mine["value"], value)
        _close(mine["grad"], grad)
        return

    if name == "lagr_spherical_norm":
        gamma, eps = kwargs.get("gamma", 1.0), kwargs.get("eps", 1e-5)
        delta = INPUTS[kwargs["delta"]] if "delta" in kwargs else np.zeros(x.shape[-1])
        # The norm of each group from energyattn: g.x = |x| for its activation g = x/|x|.
        norms = np.sum(np.moveaxis(mine["grad"] * x, kwargs.get("axis", -1), -1), axis=-1)
        tokens = x.size // x.shape[-1]
        if eps == 0 and gamma == 1 and "delta" not in kwargs:
            _close(mine["value"], value)
            zero = np.moveaxis(np.isnan(grad), kwargs.get("axis", -1), -1).all(-1)
            assert np.array_equal(zero, norms == 0)  # NaN only where x = 0 ...
            _close(mine["grad"][~np.isnan(grad)], grad[~np.isnan(grad)])
            assert np.all(mine["grad"][np.isnan(grad)] == 0)  # ... where energyattn gives 0
            return
        # HAMUX: gamma sqrt(|x|^2 + eps) per group, plus its bias once per token.
        assert kwargs.get("axis", -1) == -1
        _close(value, gamma * np.sum(np.sqrt(norms**2 + eps)) + tokens * np.sum(delta * x))
        scale = (norms / np.sqrt(norms**2 + eps))[..., None]
        _close(grad, gamma * mine["grad"] * scale + tokens * delta)
        return

    if name == "lagr_layernorm" and "delta" in kwargs:
        # HAMUX adds sum(delta * x) over the whole array to every token: T times in all.
        delta = INPUTS[kwargs["delta"]]
        tokens = x.size // x.shape[-1]
        _close(value - mine["value"], (tokens - 1) * np.sum(delta * x))
        _close(grad - mine["grad"], (tokens - 1) * np.broadcast_to(delta, x.shape))
        if tokens == 1:
            _close(mine["value"], value)
            _close(mine["grad"], grad)
        return

    # Everything else: the same definition, the same numbers.
    _close(mine["value"], value)
    _close(mine["grad"], grad)
    if dbeta is not None:
        _close(mine["dbeta"], dbeta)


@pytest.mark.parametrize(
    "name", ["lagr_rexp", "lagr_tanh", "lagr_sigmoid", "lagr_spherical_norm", "lagr_layernorm"]
)
def test_the_differences_are_real(name):
    """Each documented difference is far above round-off somewhere in the fixture."""
    gaps = []
    for index, case in enumerate(CASES):
        if case["hamux"] != name:
            continue
        value, grad, dbeta = _theirs(case)
        mine = ours()[0][index]
        if name == "lagr_rexp":
            gaps.append(abs(value - mine["value"]))
        elif dbeta is not None:  # tanh, sigmoid
            gaps.append(abs(dbeta - mine["dbeta"]))
        elif name in ("lagr_spherical_norm", "lagr_layernorm"):
            gaps.append(np.max(np.abs(np.nan_to_num(grad) - mine["grad"])))
    assert max(gaps) > 1e-6


@pytest.mark.usefixtures("user_mode")
def test_repu_needs_an_integer_power():
    """HAMUX's `lagr_repu` takes any float `n`; energyattn's `repu` an integer `n >= 2`."""
    with pytest.raises(ValueError, match="n"):
        L.repu(jnp.ones(3), n=2.5)


def test_graph_against_hamux():
    """HAMUX's `HAM(neurons, hypersynapses, connections)` and `ea.ham.HAM` give the same energy,
    the same `dE/dg` (HAMUX's `dEdact`) and the same five Euler steps `x <- x - 0.1 dE/dg`."""
    mine = ours()[1]
    _close(mine["energy"], FIXTURE["graph/energy"])
    _close(mine["energies"], FIXTURE["graph/energies"])
    for k in ("visible", "hidden"):
        _close(mine["dEdg"][k], FIXTURE[f"graph/dEdg/{k}"])
        _close(mine["x5"][k], FIXTURE[f"graph/x5/{k}"])
