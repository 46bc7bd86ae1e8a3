"""What a type checker sees of the public API: `mypy` checks this file too (`files` in
pyproject.toml), and `typing.assert_type` fails it where a result is typed `Any`. At run
time the same calls run as a test."""

from typing import assert_type

import jax
import jax.numpy as jnp

import energyattn as ea


def test_a_solution_has_the_type_of_its_initial_guess() -> None:
    y0 = jnp.zeros(3)
    descent = ea.descend(lambda x, a: jnp.sum(x**2), y0, step_size=0.1, num_steps=2)
    assert_type(descent, ea.Solution[jax.Array])
    assert_type(descent.value, jax.Array)
    root = ea.root_find(lambda y, a: y - 1.0, y0)
    assert_type(root.value, jax.Array)
    fixed = ea.fixed_point(lambda y, a: 0.5 * y, y0)
    assert_type(fixed.value, jax.Array)
    minimum = ea.minimise(lambda y, a: jnp.sum((y - 1.0) ** 2), y0)
    assert_type(minimum.value, jax.Array)
    tree = ea.fixed_point(lambda y, a: {"u": 0.5 * y["u"]}, {"u": y0})
    assert_type(tree.value, dict[str, jax.Array])
    for solution in (descent, root, fixed, minimum):
        assert isinstance(solution.value, jax.Array) and solution.value.shape == (3,)
    assert isinstance(tree.value, dict) and set(tree.value) == {"u"}
