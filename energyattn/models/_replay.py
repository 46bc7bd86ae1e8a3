"""The replay buffer of energy-based models: past predictions as starting points of new
descents."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._checks import check_shape, check_values, positive_int


class ReplayBuffer(eqx.Module):
    """A ring buffer of past predictions, starting points for new descents (the replay
    buffer of energy-based models): functional, carried by the training loop and
    checkpointed with the model.

    **Attributes:**

    - `samples`: `(capacity, seq, token_dim)`.
    - `count`: how many predictions were ever added (the buffer holds the last `capacity`).
    """

    samples: Float[Array, "capacity seq token_dim"]
    count: Array

    @staticmethod
    def empty(capacity: int, seq: int, token_dim: int) -> "ReplayBuffer":
        """A buffer with room for `capacity` predictions of `(seq, token_dim)`."""
        capacity = positive_int("capacity", capacity)
        return ReplayBuffer(jnp.zeros((capacity, seq, token_dim)), jnp.zeros((), jnp.int32))

    def add(self, predictions: Float[Array, "n seq token_dim"]) -> "ReplayBuffer":
        """The buffer with `predictions` written over its oldest entries."""
        capacity, seq, token_dim = self.samples.shape
        check_shape("predictions", predictions, "n seq token_dim", seq=seq, token_dim=token_dim)
        slots = (self.count + jnp.arange(predictions.shape[0], dtype=self.count.dtype)) % capacity
        samples = self.samples.at[slots].set(predictions.astype(self.samples.dtype))
        return ReplayBuffer(samples, self.count + predictions.shape[0])

    def starts(self, key: PRNGKeyArray, noise: Array, ratio: float) -> Array:
        """`noise` `(n, seq, token_dim)` with each entry replaced, with probability `ratio`, by
        a uniformly drawn stored prediction (none while the buffer is empty); `ratio` is a
        probability, in $[0, 1]$."""
        _, seq, token_dim = self.samples.shape
        check_shape("noise", noise, "n seq token_dim", seq=seq, token_dim=token_dim)
        checked = check_values("ratio", ratio, lambda r: (r >= 0) & (r <= 1), "in [0, 1]")
        pick_key, use_key = jr.split(key)
        filled = jnp.minimum(self.count, self.samples.shape[0])
        index = jr.randint(pick_key, (noise.shape[0],), 0, jnp.maximum(filled, 1))
        use = (jr.uniform(use_key, (noise.shape[0],)) < checked) & (filled > 0)
        return jnp.where(use[:, None, None], self.samples[index].astype(noise.dtype), noise)
