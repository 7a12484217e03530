"""flashbax 0.1.3's `item_buffer`: independent items, sampled uniformly.

An item buffer is a `trajectory_buffer` of one row of `max_length` steps, sampled as windows of
one step, returned without their time axis. A batch `[B, T, ...]` is added as `B * T` items in
row-major order, as flashbax does.
"""

from .._states import (
    Experience as Experience,
    first_steps,
    TrajectoryBufferSample as TrajectoryBufferSample,
    TrajectoryBufferState as TrajectoryBufferState,
    with_throw,
)
from ..utils import add_dim_to_args as add_dim_to_args
from .flat_buffer import validate_sample_batch_size as validate_sample_batch_size
from .trajectory_buffer import (
    check_required_sizes,
    check_sizes,
    make_trajectory_buffer,
    reshaped,
    TrajectoryBuffer,
)


# flashbax's checks, with flashbax's messages, after a check that the sizes are positive Python
# ints (`min_length` may be 0), which flashbax did not make (see flat_buffer.py).


def validate_min_length(min_length: int, max_length: int) -> None:
    """flashbax's check that `min_length` items fit in the buffer."""
    check_required_sizes(
        "item_buffer.validate_min_length", min_length=min_length, max_length=max_length
    )
    if min_length > max_length:
        raise ValueError("min_length used cannot be larger than max_length.")


def validate_item_buffer_args(max_length: int, min_length: int, sample_batch_size: int) -> None:
    """flashbax's checks of `make_item_buffer`'s arguments, with flashbax's messages."""
    check_required_sizes(
        "validate_item_buffer_args",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
    )
    validate_sample_batch_size(sample_batch_size, max_length)
    validate_min_length(min_length, max_length)


def create_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batches: bool,
) -> TrajectoryBuffer:
    """See `make_item_buffer`."""
    check_sizes(
        "make_item_buffer",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
    )
    validate_item_buffer_args(max_length, min_length, sample_batch_size)
    buffer = make_trajectory_buffer(
        add_batch_size=1,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=1,
        period=1,
        min_length_time_axis=min_length,
        max_length_time_axis=max_length,
    )
    return reshaped(
        buffer,
        sample_batch_size,
        add_batches=add_batches,
        add_sequences=add_sequences,
        one_row=True,
        sample=lambda windows: TrajectoryBufferSample(experience=first_steps(windows.experience)),
        call="trajectory_buffer.add",
    )


def make_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
    throw: bool = True,
) -> TrajectoryBuffer:
    """flashbax's `make_item_buffer`: a buffer of independent items.

    **Arguments** (flashbax's, with its defaults):

    - `max_length`: the items kept.
    - `min_length`: the items added before `can_sample` is true.
    - `sample_batch_size`: the items per `sample`.
    - `add_sequences`: whether each `add` brings a time axis of items.
    - `add_batches`: whether each `add` brings a leading batch axis of items.

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    buffer = create_item_buffer(
        max_length, min_length, sample_batch_size, add_sequences, add_batches
    )
    return with_throw(buffer, throw, "make_item_buffer")
