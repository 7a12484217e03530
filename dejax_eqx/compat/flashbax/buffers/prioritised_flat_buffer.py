"""flashbax 0.1.3's `prioritised_flat_buffer`: transitions `(first, second)` of consecutive
steps, replayed by priority.

A prioritised flat buffer is a `prioritised_trajectory_buffer` of `add_batch_size` rows (one row
when steps are added one at a time) and `max_length // add_batch_size` steps per row, whose
items are the windows of two steps starting at every step: `experience.first` is a step and
`experience.second` the next one of the same row.
"""

import equinox as eqx
from jaxtyping import Array, Float, Int

from .... import Result
from .._states import (
    ExperiencePair as ExperiencePair,
    Pair,
    pairs,
    TransitionSample as TransitionSample,
    with_throw,
)
from ..utils import add_dim_to_args as add_dim_to_args
from .flat_buffer import validate_flat_buffer_args as validate_flat_buffer_args
from .prioritised_trajectory_buffer import (
    check_priority_exponent,
    Indices as Indices,
    make_prioritised_trajectory_buffer as make_prioritised_trajectory_buffer,
    PrioritisedTrajectoryBuffer as PrioritisedTrajectoryBuffer,
    PrioritisedTrajectoryBufferState as PrioritisedTrajectoryBufferState,
    Probabilities as Probabilities,
    validate_device as validate_device,
    validate_priority_exponent as validate_priority_exponent,
)
from .trajectory_buffer import check_sizes, reshaped


class PrioritisedTransitionSample(eqx.Module):
    """Sampled transitions, their sum-tree leaves (for `set_priorities`) and the probability of
    drawing each."""

    experience: Pair
    indices: Int[Array, "*batch"]
    probabilities: Float[Array, "*batch"]
    result: Result | None = None  # a `throw=False` buffer's (see `with_throw`)


def make_prioritised_flat_buffer(
    max_length: int,
    min_length: int,
    sample_batch_size: int,
    add_sequences: bool = False,
    add_batch_size: int | None = None,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    throw: bool = True,
) -> PrioritisedTrajectoryBuffer:
    """flashbax's `make_prioritised_flat_buffer`: a buffer of transitions, sampled by priority
    as `ExperiencePair`s.

    **Arguments** (flashbax's, with its defaults):

    - `max_length`: the steps kept in all (`max_length // add_batch_size` per row).
    - `min_length`: the steps added before `can_sample` is true.
    - `sample_batch_size`: the pairs per `sample`.
    - `add_sequences`: whether each `add` brings a sequence of steps per row (a time axis).
    - `add_batch_size`: the rows each `add` brings (a leading axis), or `None` for one step
        (or sequence) per `add`, without that axis.
    - `priority_exponent`: `α` in `[0, 1]`; a transition is drawn with probability
        `p ** α / Σ p ** α`.
    - `device`: accepted and checked, not used.

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    add_batches = add_batch_size is not None
    check_sizes(
        "make_prioritised_flat_buffer",
        max_length=max_length,
        min_length=min_length,
        sample_batch_size=sample_batch_size,
        add_batch_size=add_batch_size,
    )
    check_priority_exponent(priority_exponent, "make_prioritised_flat_buffer")
    rows = 1 if add_batch_size is None else add_batch_size
    validate_flat_buffer_args(max_length, min_length, sample_batch_size, rows)
    buffer = make_prioritised_trajectory_buffer(
        add_batch_size=rows,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=2,
        period=1,
        min_length_time_axis=min_length // rows + 1,
        max_length_time_axis=max_length // rows,
        priority_exponent=priority_exponent,
        device=device,
    )
    buffer = reshaped(
        buffer,
        sample_batch_size,
        add_batches=add_batches,
        add_sequences=add_sequences,
        one_row=False,
        sample=lambda windows: PrioritisedTransitionSample(
            experience=pairs(windows.experience),
            indices=windows.indices,
            probabilities=windows.probabilities,
        ),
        call="prioritised_trajectory_buffer.prioritised_add",
    )
    return with_throw(buffer, throw, "make_prioritised_flat_buffer")
