"""flashbax 0.1.3's `prioritised_item_buffer`: independent items, replayed by priority.

A prioritised item buffer is a `prioritised_trajectory_buffer` of one row of `max_length` steps
whose items are the windows of one step, returned without their time axis. A batch `[B, T,
...]` is added as `B * T` items in row-major order, as flashbax does.
"""

from .._states import Experience as Experience, first_steps, with_throw
from ..utils import add_dim_to_args as add_dim_to_args
from .item_buffer import validate_item_buffer_args as validate_item_buffer_args
from .prioritised_trajectory_buffer import (
    check_priority_exponent,
    make_prioritised_trajectory_buffer as make_prioritised_trajectory_buffer,
    PrioritisedTrajectoryBuffer as PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferSample as PrioritisedTrajectoryBufferSample,
    PrioritisedTrajectoryBufferState as PrioritisedTrajectoryBufferState,
    validate_device as validate_device,
    validate_priority_exponent as validate_priority_exponent,
)
from .trajectory_buffer import check_sizes, reshaped


def create_prioritised_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batches: bool,
    priority_exponent: float,
    device: str,
) -> PrioritisedTrajectoryBuffer:
    """See `make_prioritised_item_buffer`."""
    check_sizes(
        "make_prioritised_item_buffer",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
    )
    check_priority_exponent(priority_exponent, "make_prioritised_item_buffer")
    validate_item_buffer_args(max_length, min_length, sample_batch_size)
    buffer = make_prioritised_trajectory_buffer(
        add_batch_size=1,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=1,
        period=1,
        min_length_time_axis=min_length,
        max_length_time_axis=max_length,
        priority_exponent=priority_exponent,
        device=device,
    )
    return reshaped(
        buffer,
        sample_batch_size,
        add_batches=add_batches,
        add_sequences=add_sequences,
        one_row=True,
        sample=lambda windows: PrioritisedTrajectoryBufferSample(
            experience=first_steps(windows.experience),
            indices=windows.indices,
            probabilities=windows.probabilities,
        ),
        call="prioritised_trajectory_buffer.prioritised_add",
    )


def make_prioritised_item_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batches: bool = False,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    throw: bool = True,
) -> PrioritisedTrajectoryBuffer:
    """flashbax's `make_prioritised_item_buffer`: a buffer of independent items, sampled by
    priority.

    **Arguments** (flashbax's, with its defaults):

    - `max_length`: the items kept.
    - `min_length`: the items added before `can_sample` is true.
    - `sample_batch_size`: the items per `sample`.
    - `add_sequences`: whether each `add` brings a time axis of items.
    - `add_batches`: whether each `add` brings a leading batch axis of items.
    - `priority_exponent`: `α` in `[0, 1]`; an item is drawn with probability
        `p ** α / Σ p ** α`.
    - `device`: accepted and checked, not used.

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    buffer = create_prioritised_item_buffer(
        max_length,
        min_length,
        sample_batch_size,
        add_sequences,
        add_batches,
        priority_exponent,
        device,
    )
    return with_throw(buffer, throw, "make_prioritised_item_buffer")
