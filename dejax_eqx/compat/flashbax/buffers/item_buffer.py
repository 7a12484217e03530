"""flashbax 0.1.3's `item_buffer`: independent items, sampled uniformly.

An item buffer is a `trajectory_buffer` of one row of `max_length` steps, sampled as windows of
one step, returned without their time axis. A batch `[B, T, ...]` is added as `B * T` items in
row-major order, as flashbax does.
"""

import jax

from .._states import TrajectoryBufferSample, TrajectoryBufferState
from ..utils import add_dim_to_args
from .flat_buffer import validate_sample_batch_size
from .trajectory_buffer import make_trajectory_buffer, TrajectoryBuffer


def validate_item_buffer_args(max_length: int, min_length: int, sample_batch_size: int) -> None:
    """flashbax's checks of `make_item_buffer`'s arguments, with flashbax's messages."""
    validate_sample_batch_size(sample_batch_size, max_length)
    if min_length > max_length:
        raise ValueError("min_length used cannot be larger than max_length.")


def create_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batches: bool,
) -> TrajectoryBuffer:
    """See `make_item_buffer`."""
    validate_item_buffer_args(max_length, min_length, sample_batch_size)
    buffer = make_trajectory_buffer(
        add_batch_size=1,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=1,
        period=1,
        min_length_time_axis=min_length,
        max_length_time_axis=max_length,
    )
    add_row = buffer.add

    def add(state: TrajectoryBufferState, batch):
        """Add a `[B, T, ...]` batch as `B * T` items, in row-major order."""
        b, t = jax.tree.leaves(batch)[0].shape[:2]
        return add_row(state, jax.tree.map(lambda x: x.reshape(1, b * t, *x.shape[2:]), batch))

    if not add_batches:
        add = add_dim_to_args(add, axis=0, starting_arg_index=1, ending_arg_index=2)
    if not add_sequences:
        add = add_dim_to_args(
            add, axis=1 if add_batches else 0, starting_arg_index=1, ending_arg_index=2
        )
    sample_windows = buffer.sample_n
    assert sample_windows is not None

    def sample_n(state: TrajectoryBufferState, rng_key, batch_size: int) -> TrajectoryBufferSample:
        """`batch_size` items, uniformly."""
        windows = sample_windows(state, rng_key, batch_size).experience
        return TrajectoryBufferSample(experience=jax.tree.map(lambda x: x[:, 0], windows))

    def sample(state: TrajectoryBufferState, rng_key) -> TrajectoryBufferSample:
        """`sample_batch_size` items, uniformly."""
        return sample_n(state, rng_key, sample_batch_size)

    return buffer.replace(add=add, sample=sample, sample_n=sample_n)


def make_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
) -> TrajectoryBuffer:
    """flashbax's `make_item_buffer`: a buffer of independent items.

    **Arguments** (flashbax's, with its defaults):

    - `max_length`: the items kept.
    - `min_length`: the items added before `can_sample` is true.
    - `sample_batch_size`: the items per `sample`.
    - `add_sequences`: whether each `add` brings a time axis of items.
    - `add_batches`: whether each `add` brings a leading batch axis of items.
    """
    return create_item_buffer(max_length, min_length, sample_batch_size, add_sequences, add_batches)
