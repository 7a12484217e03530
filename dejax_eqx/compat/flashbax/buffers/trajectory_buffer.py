"""flashbax 0.1.3's `trajectory_buffer`, on `dx.TrajectoryBuffer` used in lock-step (WIP).

Not yet wired into a package (`__init__`s, the other modules, docs and tests are to come); see
the closing note of issue 15's first part for the design.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
from jaxtyping import Array, PRNGKeyArray, PyTree

from .... import TrajectoryBuffer as _Module
from .._states import TrajectoryBufferSample, TrajectoryBufferState


def init(
    experience: PyTree, add_batch_size: int, max_length_time_axis: int
) -> TrajectoryBufferState:
    """An empty state: `add_batch_size` rows (envs) of `max_length_time_axis` steps."""
    return TrajectoryBufferState(_Module(experience, add_batch_size, max_length_time_axis))


def add(state: TrajectoryBufferState, batch: PyTree) -> TrajectoryBufferState:
    """Append `batch` (leaves `[add_batch_size, T, ...]`, `T <= max_length_time_axis`)."""
    lengths = {x.shape[1] for x in jax.tree.leaves(batch) if x.ndim >= 2}
    if lengths and max(lengths) > state.module.max_length:
        raise ValueError(
            f"`trajectory_buffer.add`: {max(lengths)} steps per row do not fit in "
            f"max_length_time_axis = {state.module.max_length} (flashbax refuses them too)."
        )
    return TrajectoryBufferState(state.module.extend(batch))


def sample(
    state: TrajectoryBufferState,
    rng_key: PRNGKeyArray,
    batch_size: int,
    sequence_length: int,
    period: int,
) -> TrajectoryBufferSample:
    """`batch_size` whole windows of `sequence_length` steps, uniformly, starts on `period`."""
    out = state.module.sample(rng_key, batch_size, sequence_length, period=period, strict=True)
    return TrajectoryBufferSample(experience=out.items)


def can_sample(state: TrajectoryBufferState, min_length_time_axis: int) -> Array:
    """Whether `min_length_time_axis` steps have been added (or the buffer is full)."""
    return state.is_full | (state.current_index >= min_length_time_axis)


@dataclasses.dataclass(frozen=True)
class TrajectoryBuffer:
    """flashbax's container of pure functions."""

    init: Callable
    add: Callable
    sample: Callable
    can_sample: Callable

    def replace(self, **changes) -> "TrajectoryBuffer":
        return dataclasses.replace(self, **changes)


def make_trajectory_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    period: int,
    min_length_time_axis: int,
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
) -> TrajectoryBuffer:
    """flashbax's `make_trajectory_buffer`, same arguments and defaults."""
    if max_size is not None and max_length_time_axis is not None:
        raise ValueError("Cannot specify both `max_size` and `max_length_time_axis` arguments.")
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if max_length_time_axis is None:
        raise ValueError("Specify `max_size` or `max_length_time_axis`.")
    if period > sample_sequence_length:
        warnings.warn(
            f"period = {period} > sample_sequence_length = {sample_sequence_length}: some "
            "steps are never sampled.",
            stacklevel=2,
        )
    min_length_time_axis = max(min_length_time_axis, sample_sequence_length)
    if sample_sequence_length > max_length_time_axis:
        raise ValueError(
            "`sample_sequence_length` must be less than or equal to `max_length_time_axis`."
        )
    if min_length_time_axis > max_length_time_axis:
        raise ValueError(
            "`min_length_time_axis` must be less than or equal to `max_length_time_axis`."
        )
    return TrajectoryBuffer(
        init=functools.partial(
            init, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
        ),
        add=add,
        sample=functools.partial(
            sample,
            batch_size=sample_batch_size,
            sequence_length=sample_sequence_length,
            period=period,
        ),
        can_sample=functools.partial(can_sample, min_length_time_axis=min_length_time_axis),
    )
