"""Error messages and edge values that name the real cause."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea


def _runtime_message(fn):
    # A runtime error reaches the caller as EquinoxRuntimeError or, through some paths
    # (plain `jax.jit`, a transposed linear solve), as JAX's runtime error quoting it.
    with pytest.raises(Exception) as info:  # noqa: PT011
        jax.block_until_ready(fn())
    return str(info.value)


# ------------------------------------------------------------------ site indices (local)


def test_local_energy_index_out_of_range(user_mode):
    J = jr.normal(jr.key(0), (4, 4, 2, 2))
    x = jr.normal(jr.key(1), (4, 2))
    for i in (10, -1, 4):
        message = rf"i must be a token position in \[0, 4\) .*N=4 tokens\), got {i}"
        with pytest.raises(ValueError, match=message):
            ea.local_energy(x[0], x, i, J)
    with pytest.raises(ValueError, match="an integer, got 1.0"):
        ea.local_energy(x[0], x, 1.0, J)
    # A traced index is checked when the program runs.
    energy = eqx.filter_jit(lambda i: ea.local_energy(x[0], x, i, J))
    assert np.isfinite(energy(3))
    assert "i must be a token position in [0, 4)" in _runtime_message(lambda: energy(7))


# ------------------------------------------------------------------ empty memory


@jax.jit
def _empty_memory_values(q):
    """Every energy of the test below, one compiled program (not one per operation)."""
    empty = jnp.zeros((0, 3))
    out = {}
    for implementation in ("naive", "blockwise"):
        out[implementation] = (
            ea.hopfield_energy(q, empty, implementation=implementation),
            jax.grad(ea.hopfield_energy)(q, empty, implementation=implementation),
        )
    out["module"] = ea.HopfieldEnergy(empty)(q)
    out["masked"] = ea.hopfield_energy(q, jnp.ones((4, 3)), mask=jnp.zeros((2, 4), bool))
    out["logsumexp"] = ea.attention_logsumexp(q, empty)
    out["transformer"] = ea.transformer_memory_energy(q, empty, kind="softmax")
    return out


def test_empty_memory_follows_the_fully_masked_rule():
    q = np.asarray(jr.normal(jr.key(0), (2, 3)))
    quadratic = 0.5 * np.sum(q**2)
    out = _empty_memory_values(q)
    for implementation in ("naive", "blockwise"):
        energy, force = out[implementation]
        np.testing.assert_allclose(energy, quadratic, rtol=1e-12)
        np.testing.assert_allclose(force, q, rtol=1e-12)  # no attention force
    np.testing.assert_allclose(out["module"], quadratic, rtol=1e-12)
    # The same value as a memory whose every entry is masked.
    np.testing.assert_allclose(out["masked"], quadratic, rtol=1e-12)
    assert np.all(out["logsumexp"] == 0)
    assert out["transformer"] == 0


# ------------------------------------------------------------------ query vs memory dimension


def test_query_dimension_is_blamed_on_the_query(user_mode):
    query, memory = jnp.ones((2, 4)), jnp.ones((5, 3))
    message = re.escape(
        "query has dimension 4 but the patterns of memory have dimension 3 "
        "(query shape (2, 4), memory shape (5, 3))"
    )
    with pytest.raises(ValueError, match=message):
        ea.hopfield_energy(query, memory)
    message = re.escape(
        "x has dimension 4 but the patterns of this energy's memory have dimension 3: "
        "x must have shape (seq, dim=3), got (2, 4)"
    )
    with pytest.raises(ValueError, match=message):
        ea.HopfieldEnergy(memory)(query)
    with pytest.raises(ValueError, match="query has dimension 4 but the patterns of keys"):
        ea.attention_logsumexp(query, memory)
    with pytest.raises(ValueError, match="g has dimension 4 but the patterns of memories"):
        ea.transformer_memory_energy(query, memory)
    layer = ea.nn.HopfieldAttention(3, key=jr.key(0))
    message = re.escape("x has dimension 4 but the layer's query_dim is 3")
    with pytest.raises(ValueError, match=message):
        layer(query)
    message = re.escape("context has dimension 4 but the layer's context_dim is 3")
    with pytest.raises(ValueError, match=message):
        layer(jnp.ones((2, 3)), context=query)


# ------------------------------------------------------------------ NaN: parameters vs step size


def test_descend_names_nan_parameters_not_the_step_size():
    memory = jr.normal(jr.key(0), (5, 3))
    q = jr.normal(jr.key(1), (2, 3))
    poisoned = memory.at[2, 1].set(jnp.nan)

    descend = eqx.filter_jit(ea.descend)  # compiled, not op by op

    def run(energy, args=None, x0=q, step_size=0.5, num_steps=2):
        return lambda: descend(energy, x0, args, step_size=step_size, num_steps=num_steps)

    message = _runtime_message(run(ea.HopfieldEnergy(poisoned)))
    assert "energy.memory contains NaN or inf" in message
    assert "step size is" not in message
    message = _runtime_message(run(lambda x, m: ea.hopfield_energy(x, m[0]), (poisoned,)))
    assert "args[0] contains NaN or inf" in message
    message = _runtime_message(run(ea.HopfieldEnergy(memory), x0=q.at[0, 0].set(jnp.nan)))
    assert "the initial state y0 contains NaN or inf" in message
    # A finite start that blows up is the step size's fault.
    unbounded = run(lambda x, _: -jnp.sum(x**4), step_size=5.0, num_steps=30)
    message = _runtime_message(unbounded)
    assert "the descent diverged" in message and "lower step_size" in message


def test_hopfield_attention_names_a_nan_parameter():
    layer = ea.nn.HopfieldAttention(3, key=jr.key(0))
    weight = layer.key_proj.weight.at[0, 0].set(jnp.inf)
    bad = eqx.tree_at(lambda m: m.key_proj.weight, layer, weight)
    x = jr.normal(jr.key(1), (4, 3))
    message = _runtime_message(lambda: eqx.filter_jit(bad)(x))
    assert "parameter HopfieldAttention.key_proj.weight contains NaN or inf" in message


# ------------------------------------------------------------------ throw=False under vmap


def _batch(shape):
    x = jr.normal(jr.key(1), (3, *shape))
    return x.at[(1,) + (0,) * len(shape)].set(jnp.nan)


def test_implicit_layers_throw_false_are_per_example_under_vmap():
    # The bad example's input holds NaN: the mean-field solve (through ea.fixed_point) says
    # the input is to blame; the spin layer's saddle point reports its non-finite iterate.
    codes = {
        "mean field": int(ea.RESULTS.nonfinite_input._value),
        "spin": int(ea.RESULTS.nonfinite._value),
    }
    x = _batch((3, 2))
    clean = x.at[1].set(0.0)  # the same batch without the bad example: same compilation
    mean_field = ea.nn.MeanFieldAttention(3, 2, throw=False, key=jr.key(0))
    spin = ea.nn.VectorSpinAttention(3, 2, throw=False, key=jr.key(0))
    runs = {
        "mean field": lambda x: (mean_field(x), mean_field.solve(x)),
        "spin": lambda x: spin(x, return_solution=True),
    }
    for name, run in runs.items():
        run = eqx.filter_jit(jax.vmap(run))
        out, solution = run(x)  # nothing raises
        reference, _ = run(clean)
        assert solution.result._value.tolist() == [0, codes[name], 0], name
        np.testing.assert_array_equal(out[::2], reference[::2])
        # The bad example: the start (zeros: no finite iterate) for the mean-field layer,
        # NaN magnetizations for the spin layer.
        assert np.all(out[1] == 0) if name == "mean field" else np.all(np.isnan(out[1]))


# ------------------------------------------------------------------ the backward pass


def test_failing_backward_solve_says_it_was_the_backward_pass():
    A = jnp.array([[0.5, 0.2, 0.0], [0.1, 0.3, 0.2], [0.0, 0.1, 0.4]])
    gmres = ea.ImplicitAdjoint(ea.GMRES(max_steps=1, restart=1, rtol=1e-14, atol=1e-14))

    def loss(b):
        fn = lambda z, b: jnp.tanh(A @ z) + b  # noqa: E731
        return ea.fixed_point(fn, jnp.zeros(3), b, adjoint=gmres).value.sum()

    # Under eqx.filter_jit the error is a clean EquinoxRuntimeError (under jax.jit or eager
    # autodiff JAX wraps the same text in a JaxRuntimeError; the docs say to use filter_jit).
    with pytest.raises(eqx.EquinoxRuntimeError) as raised:
        eqx.filter_jit(jax.grad(loss))(jnp.ones(3))
    assert (
        "implicit differentiation failed in the backward pass (reverse mode, e.g. jax.grad): "
        "the implicit adjoint's linear solve of (I - ∂f/∂y)ᵀ v = g with ea.GMRES did not "
        "converge within max_steps=1 matrix-vector products"
    ) in str(raised.value)
    jvp = jax.jit(lambda b, t: jax.jvp(loss, (b,), (t,)))
    message = _runtime_message(lambda: jvp(jnp.ones(3), jnp.ones(3)))
    assert "failed in the forward-mode derivative" in message
    assert "(I - ∂f/∂y) u = r with ea.GMRES" in message


# ------------------------------------------------------------------ spin saddle point scale


def test_float32_saddle_point_with_huge_fields():
    J = 0.3 * jr.normal(jr.key(0), (4, 4))
    J = (J + J.T) / 2 - jnp.diag(jnp.diag(J + J.T) / 2)
    H = 1e15 * jr.normal(jr.key(1), (4, 3))
    saddle_point = eqx.filter_jit(ea.spin.saddle_point)  # compiled, not op by op
    f32 = saddle_point(J.astype(jnp.float32), H.astype(jnp.float32), beta=1.0, throw=False)
    f64 = saddle_point(J, H, beta=1.0)
    assert f32.value.dtype == jnp.float32
    assert bool(f32.converged)
    np.testing.assert_allclose(f32.value, f64.value, rtol=1e-5)


def test_the_audits_messages_name_their_cause(user_mode):
    q, m = jnp.ones((3, 4)), jnp.ones((5, 4))
    with pytest.raises(ValueError, match="query must be real, got complex dtype complex"):
        ea.hopfield_energy(q.astype(complex) + 1j, m)  # explicit: strict promotion
    with pytest.raises(ValueError, match="beta must be finite, got inf"):
        ea.hopfield_energy(q, m, beta=float("inf"))
    with pytest.raises(ValueError, match="beta must be finite, got inf"):
        ea.nn.HopfieldAttention(4, beta=float("inf"), key=jr.key(0))(q)
    with pytest.raises(ValueError, match=r"J and H disagree.*\(4, 4\).*\(5, 3\)"):
        ea.spin.saddle_point(0.1 * jnp.eye(4), jnp.ones((5, 3)), beta=1.0)
    with pytest.raises(ValueError, match=r"^input must have shape \(stored, dim=4\), got \(3, 5\)"):
        ea.nn.Hopfield(4, key=jr.key(0))(jnp.ones((3, 5)))
    solution = eqx.filter_jit(ea.minimise)(
        lambda x, a: jnp.sum((x - a) ** 2), jnp.ones(2), jnp.array([jnp.nan, 1.0]), throw=False
    )
    assert solution.result == ea.RESULTS.nonfinite_input
    # optimistix's argument order, root_find(fn, solver, y0): the solver is named as such.
    for entry in (ea.root_find, ea.fixed_point, ea.minimise):
        with pytest.raises(ValueError, match=r"y0 is a solver \(Newton\), not an init"):
            entry(lambda y, a: y, ea.Newton(), jnp.ones(2))
    # A NaN input of the spin-model transformer is named as the input (as other layers).
    layer = ea.nn.SpinTransformerAttention(8, 2, key=jr.key(0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="the input x contains NaN or inf"):
        layer(jnp.ones((3, 8)).at[0, 0].set(jnp.nan))


def test_nan_weights_and_cli_failures_are_named(tmp_path, capsys, user_mode):
    from energyattn._cli.app import main

    layer = ea.nn.Hopfield(4, key=jr.key(0))
    state = {name: np.array(value) for name, value in layer.to_state_dict().items()}
    name = next(iter(state))
    state[name].flat[0] = np.nan
    with pytest.raises(ValueError, match=f"'{name}' holds NaN or inf"):
        ea.nn.Hopfield.from_state_dict(state, input_size=4)
    # Integer flags are bounded (they become int32 arrays), not OverflowError tracebacks.
    for flag in ("--train-steps", "--seed"):
        with pytest.raises(SystemExit):
            main(["demo", flag, str(10**14), "--out", str(tmp_path)])
        assert f"argument {flag}: must be <= 2147483647" in capsys.readouterr().err
    # A run that fails numerically is one line naming the flags that set its sizes.
    argv = ["ham", "--step-size", "1000", "--train-steps", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("energyattn ham: error: ea.descend: the descent diverged"), err
    assert "(check --step-size and --learning-rate)" in err and err.count("\n") == 1


# ------------------------------------------------------------------ the audit's grid (issue 63)

_THETA = np.array([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.2]])
_R = 3**0.5


def _ebt():
    return ea.models.EnergyBasedTransformer(2, 3, 4, num_heads=1, depth=1, key=jr.key(0))


# (the call, the error type, a substring of its message): each names the user's argument.
BAD_INPUT = {
    # Every spin function checks beta (finite and > 0) by one helper, and R alike.
    "smt.magnetization beta<0": (
        lambda: ea.spin.smt.magnetization(_THETA, beta=-1.0, R=_R),
        ValueError,
        "beta must be > 0, got -1.0",
    ),
    "smt.inverse_magnetization beta=nan": (
        lambda: ea.spin.smt.inverse_magnetization(0.1 * _THETA, beta=float("nan"), R=_R),
        ValueError,
        "beta must be > 0, got nan",
    ),
    "smt.gamma beta=0": (
        lambda: ea.spin.smt.gamma(_THETA, beta=0.0, R=_R),
        ValueError,
        "beta must be > 0, got 0.0",
    ),
    "smt.tap_field beta=inf": (
        lambda: ea.spin.smt.tap_field(
            0.1 * _THETA, 0.1 * _THETA, _THETA, np.eye(3), beta=float("inf"), R=_R
        ),
        ValueError,
        "beta must be finite, got inf",
    ),
    "smt.steady_state beta<0": (
        lambda: ea.spin.smt.steady_state(_THETA, np.eye(3), beta=-2.0, R=_R),
        ValueError,
        "beta must be > 0, got -2.0",
    ),
    "smt.magnetization R<0": (
        lambda: ea.spin.smt.magnetization(_THETA, R=-1.0),
        ValueError,
        "R must be > 0, got -1.0",
    ),
    "afem beta=nan": (
        lambda: ea.spin.free_energy(np.zeros((3, 3)), _THETA, beta=float("nan")),
        ValueError,
        "beta must be > 0, got nan",
    ),
    # A NaN input of a spin solve names that input.
    "smt.steady_magnetizations NaN J": (
        lambda: ea.spin.smt.steady_magnetizations(_THETA, np.full((3, 3), np.nan), R=_R),
        eqx.EquinoxRuntimeError,
        "J (the couplings) contains NaN or inf",
    ),
    # Keyword-only arguments given by position are named.
    "smt.magnetization positional beta": (
        lambda: ea.spin.smt.magnetization(_THETA, 1.0, R=_R),
        TypeError,
        "ea.spin.smt.magnetization takes beta by keyword: pass beta=...",
    ),
    "HopfieldEnergy positional beta": (
        lambda: ea.HopfieldEnergy(np.ones((3, 2)), 1.0),
        TypeError,
        "ea.HopfieldEnergy takes beta by keyword: pass beta=... (its positional arguments "
        "are memory)",
    ),
    "hopfield_energy positional beta": (
        lambda: ea.hopfield_energy(np.ones((3, 2)), np.ones((3, 2)), 1.0),
        TypeError,
        "ea.hopfield_energy takes beta by keyword",
    ),
    "spin.saddle_point positional beta and t0": (
        lambda: ea.spin.saddle_point(np.zeros((3, 3)), np.ones((3, 2)), 0.7, np.ones(3)),
        TypeError,
        "ea.spin.saddle_point takes beta and t0 by keyword: pass beta=..., t0=... (its "
        "positional arguments are J, H)",
    ),
    "lagrangians.softmax positional beta": (
        lambda: ea.lagrangians.softmax(np.ones(3), 2.0),
        TypeError,
        "ea.lagrangians.softmax takes beta by keyword",
    ),
    # TrainOptions: keyword-only fields, each value checked when built, the callback too.
    "TrainOptions positional": (
        lambda: ea.models.TrainOptions(1e-3),
        TypeError,
        "ea.models.TrainOptions takes learning_rate by keyword: pass learning_rate=... (it "
        "takes keyword arguments only)",
    ),
    "TrainOptions time_limit": (
        lambda: ea.models.TrainOptions(time_limit="abc"),
        ValueError,
        "time_limit must be a number of seconds >= 0 (None: no limit), got 'abc'",
    ),
    "TrainOptions learning_rate": (
        lambda: ea.models.TrainOptions(learning_rate="abc"),
        ValueError,
        "learning_rate must be a real number, got 'abc'",
    ),
    "TrainOptions progress": (
        lambda: ea.models.TrainOptions(progress="yes"),
        ValueError,
        "progress must be True or False, got 'yes'",
    ),
    "TrainOptions callback": (
        lambda: ea.models.TrainOptions(callback=lambda: None),
        TypeError,
        "callback must take two positional arguments, callback(step, loss)",
    ),
    # A plain function as an energy: the (x, args) contract, when it is wrapped.
    "FunctionEnergy one argument": (
        lambda: ea.FunctionEnergy(lambda y: jnp.sum(y**2)),
        TypeError,
        "FunctionEnergy needs a function fn(x, args) -> scalar",
    ),
    # The models' inputs.
    "next_token_error shapes": (
        lambda: ea.models.next_token_error(jnp.zeros((3, 4)), jnp.zeros((5, 4))),
        ValueError,
        "got predictions (3, 4) and x (5, 4)",
    ),
    "think integer tokens": (
        lambda: _ebt().think(jnp.zeros((3, 2), jnp.int32), num_steps=1, key=jr.key(0)),
        ValueError,
        "think needs float token embeddings x of shape (seq, token_dim), got dtype int32",
    ),
    "train_ebt NaN sequences": (
        lambda: ea.models.train_ebt(
            _ebt(),
            jnp.zeros((4, 3, 2)).at[1, 2, 0].set(jnp.nan),
            key=jr.key(0),
            train_steps=1,
            batch_size=2,
            options=ea.models.TrainOptions(progress=False),
        ),
        ValueError,
        "sequences contain NaN or inf (1 entry; the first at index (1, 2, 0), in sequence 1)",
    ),
    # A batch passed to what takes one example.
    "batch to a layer": (
        lambda: ea.nn.HopfieldAttention(4, key=jr.key(0))(jnp.zeros((2, 3, 4))),
        ValueError,
        "x must have shape (seq, dim=4), got (2, 3, 4) (a batch of 2? this takes one "
        "example: map it over the batch with jax.vmap",
    ),
    "batch to an energy": (
        lambda: ea.hopfield_energy(jnp.zeros((2, 3, 4)), jnp.ones((5, 4))),
        ValueError,
        "with jax.vmap",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_names_the_argument(user_mode, case):
    call, error, message = BAD_INPUT[case]
    with pytest.raises(error) as raised:
        jax.block_until_ready(call())
    assert message in str(raised.value)


def test_spin_functions_refuse_a_traced_bad_beta():
    # Traced, the same check runs with the program.
    magnetization = eqx.filter_jit(lambda b: ea.spin.smt.magnetization(_THETA, beta=b, R=_R))
    with pytest.raises(eqx.EquinoxRuntimeError, match="beta must be > 0"):
        magnetization(jnp.asarray(-1.0))


@eqx.filter_jit
def _empty_sequence_values(empty, memory, layers):
    """Everything of the test below, one compiled program (not one per operation)."""
    out = {}
    for implementation in ("naive", "blockwise"):
        out[implementation] = (
            ea.hopfield_energy(empty, memory, implementation=implementation),
            jax.grad(ea.hopfield_energy)(empty, memory, implementation=implementation),
            ea.attention_logsumexp(empty, memory, implementation=implementation),
        )
    hopfield, transformer, spin = layers
    out["layer"] = hopfield(empty)
    out["layer, solution"] = hopfield(empty, return_solution=True)
    out["transformer"] = transformer(empty)
    out["spin"] = spin(empty)
    return out


def test_empty_sequences_give_the_naive_answer():
    memory = jr.normal(jr.key(0), (4, 8))
    empty = jnp.zeros((0, 8))
    layers = (
        ea.nn.HopfieldAttention(8, num_heads=2, num_steps=2, key=jr.key(0)),
        ea.nn.EnergyTransformer(8, num_heads=2, head_dim=4, num_memories=3, key=jr.key(0)),
        ea.nn.SpinTransformerAttention(8, 2, key=jr.key(0)),
    )
    out = _empty_sequence_values(empty, memory, layers)
    for implementation in ("naive", "blockwise"):
        energy, grad, lse = out[implementation]
        assert energy == 0.0 and energy.shape == ()
        assert grad.shape == (0, 8) and lse.shape == (0,)
    for name in ("layer", "transformer", "spin"):
        assert out[name].shape == (0, 8), name
    value, solution = out["layer, solution"]
    assert value.shape == (0, 8) and bool(jnp.all(solution.converged))
    np.testing.assert_array_equal(solution.energies, np.zeros((2, 3)))
    assert solution.trajectory.shape == (2, 3, 0, 4)


def _public_modules():
    seen = {}

    def walk(module):
        if module.__name__ in seen:
            return
        seen[module.__name__] = module
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type(ea)) and value.__name__.startswith("energyattn."):
                walk(value)

    walk(ea)
    return seen


@pytest.mark.parametrize("name", list(_public_modules()))
def test_public_namespaces_list_only_their_api(name):
    module = _public_modules()[name]
    api = module.__all__
    assert all(hasattr(module, n) for n in api), name
    # Only the API: no imports (eqx, jnp), no private helpers.
    assert dir(module) == sorted(api), sorted(set(dir(module)) ^ set(api))
    if module.__file__.endswith("__init__.py"):
        # A package re-exports its API: each of energyattn's objects it holds is listed.
        held = {
            n
            for n, obj in vars(module).items()
            if not n.startswith("_")
            and (getattr(obj, "__module__", None) or getattr(obj, "__name__", "")).startswith(
                "energyattn"
            )
        }
        assert held <= set(api), sorted(held - set(api))


def test_every_keyword_only_beta_names_itself_by_position():
    """Every public callable with a keyword-only `beta` refuses it by position with a message
    naming it: never Python's own "takes 2 positional arguments but 3 were given"."""
    import inspect

    unchecked = []
    for module in _public_modules().values():
        for name in module.__all__:
            value = getattr(module, name)
            fn = value.__init__ if inspect.isclass(value) else value
            if not callable(fn) or isinstance(value, type(ea)):
                continue
            try:
                beta = inspect.signature(fn).parameters.get("beta")
            except (TypeError, ValueError):
                continue
            if beta is not None and beta.kind == beta.KEYWORD_ONLY:
                if not hasattr(fn, "__wrapped__"):
                    unchecked.append(f"{module.__name__}.{name}")
    assert not unchecked, unchecked
