"""dejax's `uniform_replay`: a FIFO replay sampled uniformly, on `dx.UniformReplay`."""

from ..._checks import check_positive_int
from ..._uniform import UniformReplay
from .base import Item, replay_buffer, ReplayBuffer


# The state `uniform_replay(...).init_fn` returns.
UniformReplayBufferState = UniformReplay


def uniform_replay(max_size: int) -> ReplayBuffer:
    """A FIFO replay of `max_size` items sampled uniformly with replacement.

    The state is a `dx.UniformReplay`.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx.compat.dejax as dejax

        buffer = dejax.uniform_replay(max_size=100)
        state = buffer.init_fn({"obs": jnp.zeros(4)})
        state = buffer.add_fn(state, {"obs": jnp.ones(4)})
        batch = buffer.sample_fn(state, jax.random.key(0), 8)
        assert batch["obs"].shape == (8, 4)
        ```
    """
    max_size = check_positive_int(max_size, "uniform_replay(max_size=...)")

    def init_fn(item_prototype: Item) -> UniformReplay:
        return UniformReplay(item_prototype, max_size)

    return replay_buffer(init_fn)
