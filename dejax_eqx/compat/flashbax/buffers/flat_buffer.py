"""flashbax 0.1.3's `flat_buffer`: transitions `(first, second)` of consecutive steps.

A flat buffer is a `trajectory_buffer` of `add_batch_size` rows (one row when items are added
one at a time) and `max_length // add_batch_size` steps per row, sampled as whole windows of
two steps: `experience.first` is a step and `experience.second` the next one of the same row.
"""

from .._states import (
    Experience as Experience,
    ExperiencePair as ExperiencePair,
    pairs,
    TrajectoryBufferState as TrajectoryBufferState,
    TransitionSample as TransitionSample,
    with_throw,
)
from ..utils import add_dim_to_args as add_dim_to_args
from .trajectory_buffer import (
    check_required_sizes,
    check_sizes,
    make_trajectory_buffer,
    reshaped,
    TrajectoryBuffer,
)


# flashbax's checks of the sizes, with flashbax's messages; unlike flashbax's, each first
# checks that the sizes are positive Python ints (`min_length` may be 0), under its own name,
# where flashbax divided by a zero `add_batch_size` or let a negative size through.


def validate_sample_batch_size(sample_batch_size: int, max_length: int) -> None:
    """flashbax's check that a sample fits in the buffer."""
    check_required_sizes(
        "validate_sample_batch_size", sample_batch_size=sample_batch_size, max_length=max_length
    )
    if sample_batch_size > max_length:
        raise ValueError("sample_batch_size must be less than or equal to max_length")


def validate_min_length(min_length: int, add_batch_size: int, max_length: int) -> None:
    """flashbax's check that `min_length` steps (`min_length // add_batch_size + 1` per row)
    fit in the buffer."""
    check_required_sizes(
        "flat_buffer.validate_min_length",
        min_length=min_length,
        add_batch_size=add_batch_size,
        max_length=max_length,
    )
    if min_length // add_batch_size + 1 > max_length:
        raise ValueError("min_length used is too large for the buffer size.")


def validate_max_length_add_batch_size(max_length: int, add_batch_size: int) -> None:
    """flashbax's check that each row holds at least a pair of steps."""
    check_required_sizes(
        "validate_max_length_add_batch_size", max_length=max_length, add_batch_size=add_batch_size
    )
    if max_length // add_batch_size < 2:
        raise ValueError(
            "max_length//add_batch_size must be greater than 2. It is currently "
            f"{max_length}//{add_batch_size} = {max_length // add_batch_size}"
        )


def validate_flat_buffer_args(
    max_length: int, min_length: int, sample_batch_size: int, add_batch_size: int
) -> None:
    """flashbax's checks of `make_flat_buffer`'s arguments, with flashbax's messages."""
    check_required_sizes(
        "validate_flat_buffer_args",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
        add_batch_size=add_batch_size,
    )
    validate_sample_batch_size(sample_batch_size, max_length)
    validate_min_length(min_length, add_batch_size, max_length)
    validate_max_length_add_batch_size(max_length, add_batch_size)


def create_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool,
    add_batch_size: int | None,
) -> TrajectoryBuffer:
    """See `make_flat_buffer`."""
    add_batches = add_batch_size is not None
    check_sizes(
        "make_flat_buffer",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
        add_batch_size=add_batch_size,
    )
    rows = 1 if add_batch_size is None else add_batch_size
    validate_flat_buffer_args(max_length, min_length, sample_batch_size, rows)
    buffer = make_trajectory_buffer(
        add_batch_size=rows,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=min_length // rows + 1,
        max_length_time_axis=max_length // rows,
    )
    return reshaped(
        buffer,
        sample_batch_size,
        add_batches=add_batches,
        add_sequences=add_sequences,
        one_row=False,
        sample=lambda windows: TransitionSample(experience=pairs(windows.experience)),
        call="trajectory_buffer.add",
    )


def make_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batch_size: int | None = None,
    throw: bool = True,
) -> TrajectoryBuffer:
    """flashbax's `make_flat_buffer`: a buffer of transitions, sampled as `ExperiencePair`s.

    **Arguments** (flashbax's, with its defaults):

    - `max_length`: the steps kept in all (`max_length // add_batch_size` per row).
    - `min_length`: the steps added before `can_sample` is true.
    - `sample_batch_size`: the pairs per `sample`.
    - `add_sequences`: whether each `add` brings a sequence of steps per row (a time axis).
    - `add_batch_size`: the rows each `add` brings (a leading axis), or `None` for one step
        (or sequence) per `add`, without that axis.

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    buffer = create_flat_buffer(
        max_length, min_length, sample_batch_size, add_sequences, add_batch_size
    )
    return with_throw(buffer, throw, "make_flat_buffer")
