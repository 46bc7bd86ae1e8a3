"""Energy-based transformers: a causal energy of candidates, thinking by descent, training
through the descent, on every attention path."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import energyattn as ea
from energyattn.models import EnergyBasedTransformer

SEQ, TOKEN = 8, 3  # 8: one token per device on the ring


def make(implementation="naive", block_size=None, seq=SEQ, step_size=0.1):
    return EnergyBasedTransformer(
        TOKEN,
        seq,
        8,
        num_heads=2,
        depth=1,
        hidden=8,
        step_size=step_size,
        implementation=implementation,
        block_size=block_size,
        key=jr.key(0),
    )


def tokens(seq=SEQ, key=1):
    x = jr.uniform(jr.key(key), (seq, TOKEN))
    y = jr.normal(jr.key(key + 1), (seq, TOKEN))
    return x, y


def max_difference(a, b):
    """The largest difference of two trees' leaves (in NumPy: no program compiled per shape)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in pairs)


def test_causal_attention_is_softmax_attention_with_values():
    q, k, v, k_own, v_own = jr.normal(jr.key(0), (5, 9, 4))
    causal = jnp.tril(jnp.ones((9, 9), bool))
    scores = jnp.where(causal, 0.5 * q @ k.T, -jnp.inf)
    expected = jax.nn.softmax(scores, axis=-1) @ v
    own = 0.5 * jnp.sum(q * k_own, axis=-1, keepdims=True)
    both = jax.nn.softmax(jnp.concatenate([scores, own], axis=1), axis=-1)
    expected_own = both[:, :9] @ v + both[:, 9:] * v_own
    for implementation, block_size in (("naive", None), ("blockwise", 4)):

        @jax.jit
        def attend(q, k, v, k_own, v_own, implementation=implementation, block_size=block_size):
            options = dict(scale=0.5, implementation=implementation, block_size=block_size)
            return (
                ea.models.causal_attention(q, k, v, **options),
                ea.models.causal_attention(q, k, v, own=(k_own, v_own), **options),
            )

        got, got_own = attend(q, k, v, k_own, v_own)
        assert jnp.max(jnp.abs(got - expected)) < 1e-13
        assert jnp.max(jnp.abs(got_own - expected_own)) < 1e-13


def test_position_energy_sees_the_context_up_to_it_and_its_own_candidate():
    model = make()
    x, y = tokens()

    @jax.jit
    def changes(x, y):
        # Row s: how every position's energy moves when token s (of x, or of y) moves.
        def moved(dx, dy):
            return model.energies(y + dy, x + dx) - model.energies(y, x)

        bumps = jnp.eye(SEQ)[:, :, None] * jnp.ones(TOKEN)
        by_context = jax.vmap(lambda b: moved(b, 0.0 * b))(bumps)
        by_candidate = jax.vmap(lambda b: moved(0.0 * b, b))(bumps)
        return jnp.abs(by_context).T, jnp.abs(by_candidate).T, model(y, x), (2.0 * model)(y, x)

    by_context, by_candidate, energy, doubled = changes(x, y)  # [t, s]
    later = np.triu(np.ones((SEQ, SEQ), bool), 1)  # s > t
    assert float(jnp.max(by_context[later])) < 1e-14  # rounding of the recomputed energies
    assert float(jnp.min(by_context[~later])) > 1e-6
    off_diagonal = ~np.eye(SEQ, dtype=bool)
    assert float(jnp.max(by_candidate[off_diagonal])) < 1e-14
    assert float(jnp.min(jnp.diagonal(by_candidate))) > 1e-6
    # The energy is the sum of the positions', and composes like any energy.
    assert jnp.allclose(energy, jnp.sum(model.energies(y, x)), rtol=1e-14)
    assert jnp.allclose(doubled, 2.0 * energy, rtol=1e-14)


def test_thinking_lowers_the_energy_and_verification_keeps_the_lowest():
    model = make(step_size=0.05)
    x, _ = tokens()

    @eqx.filter_jit
    def think(model, x):
        thought = model.think(
            x, num_steps=12, key=jr.key(3), num_candidates=4, return_trajectory=True
        )
        direct = ea.descend(
            model, thought.trajectory[0, 0], x, step_size=model.step_size, num_steps=12
        )
        return thought, model.energies(thought.prediction, x), direct.value

    thought, chosen, direct = think(model, x)
    assert thought.energies.shape == (4, 13)
    assert thought.trajectory.shape == (4, 13, SEQ, TOKEN)
    assert bool(jnp.all(jnp.diff(thought.energies, axis=1) < 0))
    # e_t depends on the candidate at t only, so the per-position choice has the per-position
    # minimum energies.
    assert jnp.allclose(chosen, thought.final_energies.min(axis=0), rtol=1e-12)
    assert bool(jnp.all(chosen <= thought.final_energies + 1e-12))
    # Thinking is ea.descend on the model: the same steps from the same start.
    assert jnp.allclose(direct, thought.candidates[0], atol=1e-12)


def frozen(model):
    arrays, rest = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.lax.stop_gradient(arrays), rest)


def hand_unrolled(model, x, y0, num_steps, backprop_steps, detach):
    """Backpropagation through a Python loop of y <- y - alpha grad E, written out."""
    y, predictions = y0, []
    for step in range(num_steps):
        differentiated = step >= num_steps - backprop_steps
        m = model if differentiated else frozen(model)
        if detach or not differentiated:
            y = jax.lax.stop_gradient(y)
        y = y - m.step_size * jax.grad(m.context(x))(y)
        if differentiated:
            predictions.append(y)
    return ea.models.next_token_error(jnp.stack(predictions), x)


def training_loss(model, x, y0, num_steps=2, backprop_steps=2, detach=False):
    predictions = ea.models.thinking_steps_for_training(
        model, x, y0, num_steps=num_steps, backprop_steps=backprop_steps, detach=detach
    )
    return ea.models.next_token_error(predictions, x)


training_gradient = eqx.filter_jit(eqx.filter_value_and_grad(training_loss))


@pytest.fixture(scope="module")
def naive_gradient():
    """The training gradient through 2 thinking steps on the naive path: the reference."""
    x, y0 = tokens()
    return training_gradient(make("naive"), x, y0)


def test_training_through_thinking_is_backpropagation_through_the_unrolled_loop(naive_gradient):
    model = make()
    x, y0 = tokens()
    hand = eqx.filter_jit(eqx.filter_value_and_grad(hand_unrolled))
    assert max_difference(naive_gradient, hand(model, x, y0, 2, 2, False)) < 1e-12
    assert float(jnp.abs(naive_gradient[1].log_step_size)) > 0  # the step size is trained
    # Truncated to the last step, the first run without derivatives: the loss of one
    # differentiated step from where the first step lands. Detached before every step: the
    # mean of the two steps' losses, each through its own step alone.
    y1 = eqx.filter_jit(lambda m, y: y - m.step_size * jax.grad(m.context(x))(y))(model, y0)
    first = training_gradient(model, x, y0, 1, 1)
    second = training_gradient(model, x, y1, 1, 1)
    truncated = training_gradient(model, x, y0, 2, 1)
    detached = training_gradient(model, x, y0, 2, 2, True)
    assert max_difference(truncated, second) < 1e-12
    mean = jax.tree.map(
        lambda a, b: (a + b) / 2, eqx.filter(first, eqx.is_array), eqx.filter(second, eqx.is_array)
    )
    assert max_difference(eqx.filter(detached, eqx.is_array), mean) < 1e-12
    assert max_difference(detached, naive_gradient) > 1e-6


def test_second_derivatives_through_the_blockwise_path_equal_the_naive_path(naive_gradient):
    # Training through a descent differentiates the energy's gradient: the blockwise passes'
    # derivatives (here third order in the log-sum-exp) against plain autodiff.
    x, y0 = tokens()
    blockwise = training_gradient(make().with_implementation("blockwise", 4), x, y0)
    assert max_difference(naive_gradient, blockwise) < 1e-12


def test_training_through_thinking_on_the_ring_equals_one_device():
    model = make("blockwise", block_size=4)  # one token per device
    x, y0 = tokens()
    mesh = jax.make_mesh((8,), ("seq",), devices=jax.devices()[:8])
    # One thinking step, differentiated: second derivatives of every layer on the ring.
    one_step = ea.parallel.context_parallel(
        lambda m, x, y0: training_gradient(m, x, y0, 1, 1), mesh
    )
    on_ring = one_step(model, x, y0)
    one_device = training_gradient(make("naive"), x, y0, 1, 1)  # compiled above too
    assert max_difference(on_ring, one_device) < 1e-12


def constant_sequences(n, seq, key):
    """Each sequence repeats one random token."""
    return jnp.broadcast_to(jr.uniform(key, (n, 1, TOKEN)), (n, seq, TOKEN))


def test_training_resumes_exactly_with_its_replay_buffer(tmp_path):
    data = constant_sequences(32, SEQ, jr.key(5))
    model = make(step_size=0.5)
    kwargs = dict(
        key=jr.key(6),
        train_steps=4,
        batch_size=8,
        init_scale=0.5,
        replay_capacity=16,
    )
    quiet = ea.models.TrainOptions(progress=False)
    # Stopped at step 2 (after its checkpoint) and resumed: the same model and buffer as one
    # uninterrupted run; nothing is lost.
    path = tmp_path / "ebt.eqx"

    def stop(step, loss):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ea.models.train_ebt(
            model,
            data,
            **kwargs,
            options=dataclasses.replace(quiet, checkpoint=path, checkpoint_every=2, callback=stop),
        )
    resumed = ea.models.train_ebt(
        model, data, **kwargs, options=dataclasses.replace(quiet, checkpoint=path)
    )
    assert resumed.step == 4 and resumed.losses.shape == (2,)
    straight = ea.models.train_ebt(model, data, **kwargs, options=quiet)
    assert (
        max_difference(
            eqx.filter((straight.model, straight.state), eqx.is_array),
            eqx.filter((resumed.model, resumed.state), eqx.is_array),
        )
        == 0.0
    )
    assert int(straight.state.count) == 4 * 8  # the replay buffer saw every prediction
    assert not jnp.allclose(straight.state.samples[:8], straight.state.samples[8:16])


def test_completion_feeds_each_prediction_back():
    x, _ = tokens()
    baseline = ea.models.CausalTransformer(TOKEN, SEQ, 8, num_heads=2, depth=1, key=jr.key(2))

    @eqx.filter_jit
    def run(baseline, x):
        filled = ea.models.complete(baseline, x, 3)
        return filled, baseline(filled)

    filled, again = run(baseline, x)
    assert jnp.array_equal(filled[:3], x[:3])
    assert jnp.allclose(filled[3:], again[2:-1], atol=1e-14)  # token t from tokens < t


def test_clear_errors(user_mode):
    model = make()
    x, y = tokens()
    with pytest.raises(ValueError, match="call it as energy"):
        model(y)
    with pytest.raises(ValueError, match="init must have shape"):
        model.think(x, num_steps=1, key=jr.key(0), num_candidates=2, init=y)
    with pytest.raises(ValueError, match="backprop_steps=3 exceeds thinking_steps=2"):
        ea.models.train_ebt(
            model,
            x[None].repeat(4, 0),
            key=jr.key(0),
            train_steps=1,
            thinking_steps=2,
            backprop_steps=3,
            batch_size=2,
        )
    with pytest.raises(ValueError, match=f"max_len={SEQ}"):
        model.energies(jnp.zeros((SEQ + 1, TOKEN)), jnp.zeros((SEQ + 1, TOKEN)))
    with pytest.raises(ValueError, match="pass key="):
        ea.models.complete(model, x, 2)


def test_the_ebt_command_trains_evaluates_and_draws(tmp_path, capsys):
    import json

    from matplotlib import image as matplotlib_image

    from energyattn._cli.ebt import run_ebt_demo

    out = tmp_path / "ebt"
    # The command's own code on small sizes (its full run is in the README).
    metrics = run_ebt_demo(
        out,
        train_steps=24,
        dim=8,
        depth=1,
        batch_size=8,
        thinking_grid=(1, 2),
        candidates=(1, 2),
        num_test=4,
        options=ea.models.TrainOptions(learning_rate=3e-2, progress=False),
    )
    for kind in ("next_row_mse", "completion_mse"):
        numbers = metrics[kind]
        assert set(numbers["ebt"]) == set(numbers["ebt_untrained"]) == {1, 2}
        assert set(numbers["ebt_verified"]) == {1, 2}
        assert all(v > 0 for v in numbers["ebt"].values())
        assert numbers["feed_forward"] > 0 and numbers["mean_row"] > 0
    # A short training run beats its untrained self on held-out digits, after 2 thinking steps
    # (measured: next row 0.147 against 0.452, completion 0.133 against 0.434).
    for kind in ("next_row_mse", "completion_mse"):
        numbers = metrics[kind]
        assert numbers["ebt"][2] < 0.5 * numbers["ebt_untrained"][2], numbers
    flops = metrics["flops_per_sequence"]
    assert flops["ebt_2_steps"] > flops["ebt_1_steps"] > flops["feed_forward"] > 0
    assert json.loads((out / "metrics.json").read_text())["train_steps"] == 24
    assert metrics["num_test"] == 4
    for name in ("thinking.png", "completions.png"):
        image = matplotlib_image.imread(out / name)
        assert image.ndim == 3 and image.std() > 0.05


def test_the_ebt_command_sizes_its_evaluation_and_prints_honest_labels(
    tmp_path, monkeypatch, capsys
):
    """`--test-digits` reaches the evaluation (default: every held-out digit); one thinking
    step and one candidate are singular."""
    from energyattn._cli import ebt, main

    with pytest.raises(ValueError, match="there are 359 held-out digits; cannot evaluate on 400"):
        ebt.run_ebt_demo(tmp_path, num_test=400)
    seen = {}

    def fake_run(out, **kwargs):
        seen.update(kwargs)
        grid = {1: 0.5, 2: 0.25}
        numbers = dict(ebt=grid, ebt_untrained=grid, ebt_verified=grid, mean_row=0.1)
        return {"num_test": 7, "completion_mse": dict(numbers, feed_forward=0.2)}

    monkeypatch.setattr(ebt, "run_ebt_demo", fake_run)
    assert main(["ebt", "--test-digits", "7"]) == 0 and seen["num_test"] == 7
    printed = capsys.readouterr().out
    assert "7 held-out digits" in printed
    assert "  EBT,  1 thinking step       0.5000" in printed
    assert "  EBT,  2 thinking steps      0.2500" in printed
    assert "  EBT, best of  1 candidate   0.5000" in printed
    assert "  EBT, best of  2 candidates  0.2500" in printed
    assert main(["ebt"]) == 0 and seen["num_test"] is None  # all of them
    with pytest.raises(SystemExit):
        main(["ebt", "--test-digits", "0"])
    assert "--test-digits: must be >= 1" in capsys.readouterr().err
