"""n-step returns from windows of steps: a pure function, no storage.

A window holds steps `t, t + 1, ..., t + n` of one env's stream. Step `t + i` carries the
reward `r_{t+i}` for the action taken at step `t + i`, and two flags that say whether the
episode ended with that reward: `terminated` (a true end: nothing follows) and `truncated` (a
time limit: the episode could have gone on). The transition from `t` adds up the rewards up to
the first step that ends the episode, or `n` rewards if none does, and bootstraps from the step
after the last reward it took:

    k = min(n, 1 + the first i with terminated or truncated at t + i)
    R = sum_{i < k} gamma**i r_{t+i}
    discount = 0 if step t + k - 1 terminated, else gamma**k
    next = step t + k

A step that is both terminated and truncated counts as terminated.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


class NStep(NamedTuple):
    """`returns[b] = R`, `discount[b]`, and `taken[b] = k`, the number of rewards summed (the
    position of the bootstrap step in the window)."""

    returns: Float[Array, " batch"]
    discount: Float[Array, " batch"]
    taken: Int[Array, " batch"]


def n_step(
    rewards: Float[Array, "batch n"],
    terminated: Bool[Array, "batch n"],
    truncated: Bool[Array, "batch n"],
    gamma: Float[Array, ""],
) -> NStep:
    """The n-step return of each row of a batch of windows (see the module's docstring).

    **Arguments:**

    - `rewards`: the rewards of the first `n` steps of each window (a floating dtype, kept).
    - `terminated`, `truncated`: the end flags of those steps.
    - `gamma`: the per-step discount, a scalar in `[0, 1]` (converted to the rewards' dtype).

    **Returns:** an `NStep` of arrays of shape `(batch,)`; `returns` and `discount` in the
    rewards' dtype, `taken` int32 in `[1, n]`.
    """
    n = rewards.shape[1]
    gamma = gamma.astype(rewards.dtype)
    ends = terminated | truncated
    # Reward i is taken when no step before it ended the episode.
    ended_before = jnp.cumsum(ends, axis=1, dtype=jnp.int32) - ends.astype(jnp.int32)
    taken_mask = ended_before == 0
    taken = jnp.sum(taken_mask, axis=1, dtype=jnp.int32)
    powers = gamma ** jnp.arange(n, dtype=rewards.dtype)
    returns = jnp.sum(jnp.where(taken_mask, rewards, 0) * powers[None, :], axis=1)
    last = jnp.take_along_axis(terminated, (taken - 1)[:, None], axis=1)[:, 0]
    discount = jnp.where(last, jnp.zeros((), rewards.dtype), gamma ** taken.astype(rewards.dtype))
    return NStep(returns, discount, taken)
