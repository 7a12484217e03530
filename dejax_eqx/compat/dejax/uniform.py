"""dejax's `uniform_replay`: a FIFO replay sampled uniformly, on `dx.UniformReplay`."""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray, PyTree

from ... import CircularBuffer as EqxCircularBuffer, UniformReplay
from ...internal import check_positive_int, is_concrete
from ._states import (
    buffer_of,
    CircularBuffer,
    module_of,
    UniformReplayBufferState as UniformReplayBufferState,
)
from .base import Item, replay_buffer, ReplayBuffer


@dataclasses.dataclass(frozen=True)
class _Init:
    # A value rather than a closure: two `uniform_replay(m)` buffers compare equal, so jitted
    # code that takes the buffer as an argument does not retrace, and the `cluster_buffer` that
    # a clustered state rebuilds equals the one it was given.
    max_size: int

    def __call__(self, item_prototype: Item) -> UniformReplayBufferState:
        return UniformReplayBufferState(UniformReplay(item_prototype, self.max_size))


def uniform_replay(max_size: int) -> ReplayBuffer:
    """A FIFO replay of `max_size` items sampled uniformly with replacement.

    The state is a `UniformReplayBufferState`: dejax's `storage` field (a circular-buffer state
    with `data`, `head`, `tail`, `full`), and the `dx.UniformReplay` behind it as `module`.

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
        assert int(state.storage.head) == 1 and state.storage.data["obs"].shape == (100, 4)
        ```
    """
    return replay_buffer(_Init(check_positive_int(max_size, "uniform_replay(max_size=...)")))


@buffer_of.register(UniformReplay)
def _buffer_of_uniform(replay: UniformReplay) -> ReplayBuffer:
    return uniform_replay(replay.max_size)


def uniform_sample(
    buffer: CircularBuffer | EqxCircularBuffer, rng: PRNGKeyArray, batch_size: int
) -> PyTree[jax.Array]:
    """`batch_size` items drawn uniformly, with replacement, from a circular-buffer state."""
    ring = module_of(buffer, EqxCircularBuffer, "uniform_sample")
    batch_size = check_positive_int(batch_size, "uniform_sample(batch_size=...)")
    if is_concrete(ring.size) and int(ring.size) == 0:
        raise ValueError("Cannot sample from an empty buffer")
    index = jax.random.randint(rng, (batch_size,), 0, ring.size, dtype=jnp.int32)
    # Under a transformation an empty buffer is reported by `get`'s own range check.
    return jax.vmap(ring.get)(index)
