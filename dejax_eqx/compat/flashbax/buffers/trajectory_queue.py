"""flashbax 0.1.3's `trajectory_queue`, on `dx.TrajectoryQueue` used in lock-step.

Every row (env) of the queue holds a stream of at most `max_length_time_axis` unread steps;
`sample` returns the oldest `sample_sequence_length` unread steps of every row and removes
them, so each step is read once, in order. flashbax's ring indices are computed from the
module: the write index is the step count modulo the length, the read index lies `unread`
steps behind it.

Stricter than flashbax: an `add` that would overwrite unread steps, and a `sample` of more
steps than are unread, raise (an `eqx.error_if` error, eagerly and under `jit` alike) where
flashbax overwrote them or returned stale steps; `can_add` and `can_sample` tell beforehand.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import equinox as eqx
from jaxtyping import Array, Bool, Int, PyTree

from .... import Result, TrajectoryQueue as _Module
from ....internal import extend_queue, pop_queue
from .._states import check_add, with_throw
from .trajectory_buffer import check_required_sizes, check_sizes, length_from_max_size


# flashbax's queue has a type variable of its own (the buffers' is `trajectory_buffer`'s).
Experience = TypeVar("Experience", bound=PyTree)


class TrajectoryQueueState(eqx.Module, Generic[Experience]):
    """The state of flashbax's trajectory queue: a `dx.TrajectoryQueue`.

    Its fields are those of flashbax's state, computed from the module (`module`, the only
    field). Each reads one row: compat adds are lock-step, so all rows agree.
    """

    module: _Module

    @property
    def experience(self) -> PyTree[Array]:
        """The slots, leaves `[add_batch_size, max_length_time_axis, ...]`."""
        return self.module.data

    @property
    def write_index(self) -> Int[Array, "*d"]:
        """The time index the next add writes."""
        return _step_count(self) % self.module.max_length

    @property
    def read_index(self) -> Int[Array, "*d"]:
        """The time index of the oldest unread step (the next `sample` starts there)."""
        return (_step_count(self) - _unread(self)) % self.module.max_length

    @property
    def is_full(self) -> Bool[Array, "*d"]:
        """Whether every slot holds an unread step."""
        return _unread(self) == self.module.max_length


class TrajectoryQueueSample(eqx.Module, Generic[Experience]):
    """What `sample` returns: `experience`, leaves `[add_batch_size, sequence_length, ...]`."""

    experience: PyTree[Array]
    result: Result | None = None  # a `throw=False` queue's (see `with_throw`)


# `[..., 0]` rather than `[0]`: the same fields then read a stack of states, as `pmap` returns.
def _step_count(state: TrajectoryQueueState) -> Int[Array, "*d"]:
    return state.module.step_count[..., 0]


def _unread(state: TrajectoryQueueState) -> Int[Array, "*d"]:
    return state.module.unread[..., 0]


def _check_length(state: TrajectoryQueueState, max_length_time_axis: int, call: str) -> None:
    check_required_sizes(f"trajectory_queue.{call}", max_length_time_axis=max_length_time_axis)
    if max_length_time_axis != state.module.max_length:
        raise ValueError(
            f"`trajectory_queue.{call}`: max_length_time_axis = {max_length_time_axis}, but the "
            f"state's queue holds {state.module.max_length} steps per row; pass the length the "
            "state was initialised with."
        )


def init(
    experience: PyTree, add_batch_size: int, max_length_time_axis: int
) -> TrajectoryQueueState:
    """An empty queue of `add_batch_size` rows of at most `max_length_time_axis` unread steps;
    `experience` is one step, whose structure, shapes and dtypes the queue takes."""
    call = "trajectory_queue.init"
    check_required_sizes(
        call, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
    )
    return TrajectoryQueueState(_Module(experience, add_batch_size, max_length_time_axis))


def add(state: TrajectoryQueueState, batch: PyTree) -> TrajectoryQueueState:
    """Append `batch` (leaves `[add_batch_size, T, ...]`, oldest step first) to every row.

    **Raises:** `ValueError` at once if `T > max_length_time_axis`; an `eqx.error_if` error if
    a row has fewer than `T` free slots, so that the add would overwrite unread steps (where
    flashbax overwrote them). `can_add` tells whether an add fits.
    """
    call = "trajectory_queue.add"
    module = state.module
    batch = check_add(module, batch, call, "queue")
    # The queue's own extend, under flashbax's name: it refuses to overwrite unread steps.
    return TrajectoryQueueState(extend_queue(module, batch, None, call, sequences=True))


def sample(
    state: TrajectoryQueueState, sequence_length: int
) -> tuple[TrajectoryQueueState, TrajectoryQueueSample]:
    """Remove and return the oldest `sequence_length` unread steps of every row.

    **Returns:** `(state, sample)`, `sample.experience` with leaves
    `[add_batch_size, sequence_length, ...]`, oldest step first.

    **Raises:** `ValueError` at once if `sequence_length` is not in `[1,
    max_length_time_axis]`; an `eqx.error_if` error if a row holds fewer than
    `sequence_length` unread steps (where flashbax returned stale steps). `can_sample` tells
    whether they are there.
    """
    steps, module = pop_queue(state.module, sequence_length, "trajectory_queue.sample")
    return TrajectoryQueueState(module), TrajectoryQueueSample(experience=steps)


def can_add(
    state: TrajectoryQueueState, add_sequence_length: int, max_length_time_axis: int
) -> Bool[Array, "*d"]:
    """Whether `add_sequence_length` more steps fit without overwriting unread ones.

    **Raises:** `ValueError`/`TypeError` if `add_sequence_length` is not a positive Python int
    (flashbax answered `True` for 0 or a negative one), or if `max_length_time_axis` is not the
    state's."""
    check_required_sizes("trajectory_queue.can_add", add_sequence_length=add_sequence_length)
    _check_length(state, max_length_time_axis, "can_add")
    return _unread(state) <= max_length_time_axis - add_sequence_length


def can_sample(
    state: TrajectoryQueueState, sample_sequence_length: int, max_length_time_axis: int
) -> Bool[Array, "*d"]:
    """Whether at least `sample_sequence_length` steps are unread.

    **Raises:** `ValueError`/`TypeError` if `sample_sequence_length` is not a positive Python
    int (flashbax answered `True` for 0 or a negative one), or if `max_length_time_axis` is not
    the state's."""
    check_required_sizes(
        "trajectory_queue.can_sample", sample_sequence_length=sample_sequence_length
    )
    _check_length(state, max_length_time_axis, "can_sample")
    return _unread(state) >= sample_sequence_length


@dataclasses.dataclass(frozen=True)
class TrajectoryQueue(Generic[Experience]):
    """flashbax's container of pure functions for a trajectory queue: `init(experience)`,
    `add(state, batch)`, `sample(state) -> (state, sample)`, `can_sample(state)` and
    `can_add(state)`."""

    init: Callable
    add: Callable
    sample: Callable
    can_sample: Callable
    can_add: Callable

    def replace(self, **changes) -> "TrajectoryQueue":
        return dataclasses.replace(self, **changes)


def validate_trajectory_queue_args(
    max_length_time_axis: int,
    add_batch_size: int,
    sample_sequence_length: int,
    max_size: int | None,
) -> None:
    """flashbax's checks of `make_trajectory_queue`'s arguments: warns that `max_size`, when
    given, sets `max_length_time_axis`, and refuses samples longer than the queue.

    Unlike flashbax's, each size must be a positive Python int (`max_size` may be `None`), and
    `max_size` at least `add_batch_size` (flashbax divided by a zero `add_batch_size`)."""
    call = "validate_trajectory_queue_args"
    check_required_sizes(
        call,
        max_length_time_axis=max_length_time_axis,
        add_batch_size=add_batch_size,
        sample_sequence_length=sample_sequence_length,
    )
    check_sizes(call, max_size=max_size)
    if max_size is not None:
        max_length_time_axis = length_from_max_size(call, max_size, add_batch_size)
        warnings.warn(
            f"`max_size` = {max_size} sets max_length_time_axis = max_size // add_batch_size = "
            f"{max_length_time_axis}, in place of the `max_length_time_axis` argument.",
            stacklevel=3,
        )
    if sample_sequence_length > max_length_time_axis:
        raise ValueError(
            f"`sample_sequence_length` = {sample_sequence_length} must be at most "
            f"`max_length_time_axis` = {max_length_time_axis}: a row never holds more steps."
        )


def make_trajectory_queue(
    max_length_time_axis: int,
    add_batch_size: int,
    add_sequence_length: int,
    sample_sequence_length: int,
    max_size: int | None = None,
    throw: bool = True,
) -> TrajectoryQueue:
    """flashbax's `make_trajectory_queue`: a consume-once queue of trajectories.

    **Arguments** (flashbax's, with its defaults):

    - `max_length_time_axis`: the most unread steps each row holds.
    - `add_batch_size`: the rows; each `add` brings one sequence per row.
    - `add_sequence_length`: the steps per row of each `add`, which `can_add` checks room for.
    - `sample_sequence_length`: the steps per row each `sample` removes and returns.
    - `max_size`: if given, the steps kept in all; it sets `max_length_time_axis` to
        `max_size // add_batch_size` (with a warning).

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    check_sizes(
        "make_trajectory_queue",
        max_length_time_axis=max_length_time_axis,
        add_batch_size=add_batch_size,
        add_sequence_length=add_sequence_length,
        sample_sequence_length=sample_sequence_length,
        max_size=max_size,
    )
    if max_size is not None:
        length_from_max_size("make_trajectory_queue", max_size, add_batch_size)
    validate_trajectory_queue_args(
        max_length_time_axis, add_batch_size, sample_sequence_length, max_size
    )
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    buffer = TrajectoryQueue(
        init=functools.partial(
            init, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
        ),
        add=add,
        sample=functools.partial(sample, sequence_length=sample_sequence_length),
        can_sample=functools.partial(
            can_sample,
            sample_sequence_length=sample_sequence_length,
            max_length_time_axis=max_length_time_axis,
        ),
        can_add=functools.partial(
            can_add,
            add_sequence_length=add_sequence_length,
            max_length_time_axis=max_length_time_axis,
        ),
    )
    return with_throw(buffer, throw, "make_trajectory_queue")
