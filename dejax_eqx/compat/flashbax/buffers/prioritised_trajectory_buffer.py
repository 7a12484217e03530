"""flashbax 0.1.3's `prioritised_trajectory_buffer`, on `dx.PrioritisedTrajectoryBuffer` used in
lock-step.

An item is a window of `sample_sequence_length` steps of one row whose start is a multiple of
`period` in the row's step count; its sum-tree leaf is `row * (max_length_time_axis // period) +
(start // period) % (max_length_time_axis // period)`. When `period` divides
`max_length_time_axis` (always, through `make_prioritised_trajectory_buffer`), that is flashbax's
item index, and a window starts where flashbax's may; otherwise (`prioritised_init` alone)
flashbax aligns starts to the ring's slots, and here to the row's step count. Windows are drawn
stratified, with probability `p ** α / Σ p ** α`. A window enters when its last step is added,
with the largest priority recorded so far, and leaves (priority 0) when its first step is
overwritten.

The window length is fixed per state: `prioritised_init` has no `sample_sequence_length`, so its
state takes it from the first `prioritised_add` or `prioritised_sample` (an empty state may
change it; a state holding steps may not). The buffers made by
`make_prioritised_trajectory_buffer` have it from `init` on.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Generic

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray, PyTree, Real

from .... import PrioritisedTrajectoryBuffer as _Module, Result, Window
from ....internal import (
    as_float,
    check_faults,
    check_finite_float,
    check_index,
    check_vector,
    Prototype,
    stamps_of,
)
from .._states import (
    check_add,
    Experience,
    LockStepState,
    TrajectoryBufferSample as TrajectoryBufferSample,
    TrajectoryBufferState as TrajectoryBufferState,
    with_throw,
)
from .sum_tree import get_tree_depth as get_tree_depth, SumTreeState
from .trajectory_buffer import (
    BufferSample,
    BufferState,
    can_sample,
    check_fits,
    check_required_sizes,
    check_sizes,
    length_from_max_size,
    make_trajectory_buffer,
    TrajectoryBuffer,
    validate_trajectory_buffer_args as validate_trajectory_buffer_args,
)


__all__ = [
    "BufferSample",
    "BufferState",
    "Experience",
    "Indices",
    "Priorities",
    "PrioritisedTrajectoryBuffer",
    "PrioritisedTrajectoryBufferSample",
    "PrioritisedTrajectoryBufferState",
    "Probabilities",
    "SumTreeState",
    "TrajectoryBuffer",
    "TrajectoryBufferSample",
    "TrajectoryBufferState",
    "can_sample",
    "get_invalid_indices",
    "get_max_divisible_length",
    "get_num_items_in_row",
    "get_sum_tree_capacity",
    "get_tree_depth",
    "make_prioritised_trajectory_buffer",
    "prioritised_add",
    "prioritised_init",
    "prioritised_sample",
    "set_priorities",
    "validate_device",
    "validate_priority_exponent",
    "validate_trajectory_buffer_args",
]

# flashbax's names for the arrays of prioritised replay (p and P in the PER paper).
Priorities = Array
Probabilities = Array
Indices = Array

# The exponent of a state made by `prioritised_init`, until `set_priorities` names one. Until
# then every priority is `max_priority = 1`, whose mass is 1 for every exponent.
_DEFAULT_EXPONENT = 0.6


class PrioritisedTrajectoryBufferState(LockStepState, Generic[Experience]):
    """The state of flashbax's prioritised buffers: a `dx.PrioritisedTrajectoryBuffer`."""

    module: _Module

    @property
    def sum_tree_state(self) -> SumTreeState:
        """The priorities, as flashbax's sum tree (a read-only view)."""
        m = self.module
        return SumTreeState(m.tree, m.max_priority, m.priority_exponent)


class PrioritisedTrajectoryBufferSample(eqx.Module, Generic[Experience]):
    """Sampled windows (leaves `[batch, sequence_length, ...]`), their sum-tree leaves (the
    `indices` that `set_priorities` takes) and the probability of drawing each."""

    experience: PyTree[Array]
    indices: Int[Array, "*batch"]
    probabilities: Float[Array, "*batch"]
    result: Result | None = None  # a `throw=False` buffer's (see `with_throw`)


def _build(
    spec: Prototype,
    add_batch_size: int,
    max_length_time_axis: int,
    window: int,
    period: int,
    priority_exponent: float,
    dtype=jnp.float32,
) -> _Module:
    return _Module(
        spec,
        add_batch_size,
        max_length_time_axis,
        Window(window, period=period, strict=True),
        priority_exponent=priority_exponent,
        stratified=True,
        dtype=dtype,
    )


def _configured(
    module: _Module,
    call: str,
    *,
    window: int | None = None,
    period: int | None = None,
    priority_exponent: float | None = None,
) -> _Module:
    """`module` with the window and exponent asked for (static fields, so a module of the
    same leaves under another tree structure). The period cannot change; the window only while
    the buffer is empty."""
    if period is not None and period != module.window.period:
        raise ValueError(
            f"`{call}`: period = {period}, but this state was initialised with period = "
            f"{module.window.period}; its sum tree has one leaf per period-aligned start. Pass the "
            "period given to `prioritised_init`."
        )
    new_window = module.window.size if window is None else window
    new_exponent = (
        module.priority_exponent
        if priority_exponent is None
        else check_finite_float(priority_exponent, f"{call}(priority_exponent=...)")
    )
    if new_window == module.window.size and new_exponent == module.priority_exponent:
        return module
    try:
        template = jax.eval_shape(
            lambda: _build(
                module.item_spec,
                module.num_envs,
                module.max_length,
                new_window,
                module.window.period,
                new_exponent,
                module.max_priority.dtype,
            )
        )
    except (TypeError, ValueError) as err:
        raise type(err)(f"`{call}`: {err}") from err
    new = jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(module))
    if new_window == module.window.size:
        return new
    step_count = check_faults(
        new.streams.step_count,
        [
            (
                module.step_count > 0,
                f"`{call}`: sample_sequence_length = {new_window}, but this state already holds "
                f"steps added with sample_sequence_length = {module.window.size}; the windows a "
                "state prioritises have one length, fixed by its first add. Use the same "
                "sample_sequence_length for every add and sample of a state",
            )
        ],
    )
    return eqx.tree_at(lambda b: b.streams.step_count, new, step_count)


def prioritised_init(
    experience: PyTree, add_batch_size: int, max_length_time_axis: int, period: int
) -> PrioritisedTrajectoryBufferState:
    """An empty state: `add_batch_size` rows of `max_length_time_axis` steps, one sum-tree leaf
    per `period` steps of each row.

    The window length is not known yet: the first `prioritised_add` (or `prioritised_sample`)
    sets it from its `sample_sequence_length`.
    """
    call = "prioritised_trajectory_buffer.prioritised_init"
    check_required_sizes(
        call,
        add_batch_size=add_batch_size,
        max_length_time_axis=max_length_time_axis,
        period=period,
    )
    check_fits(call, "period", period, max_length_time_axis)
    # A placeholder window: `period` steps always fit the module's checks (at most
    # max_length, and longer than max_length mod period).
    module = _build(
        experience, add_batch_size, max_length_time_axis, period, period, _DEFAULT_EXPONENT
    )
    return PrioritisedTrajectoryBufferState(module)


def _make_init(
    experience: PyTree,
    add_batch_size: int,
    max_length_time_axis: int,
    period: int,
    sample_sequence_length: int,
    priority_exponent: float,
) -> PrioritisedTrajectoryBufferState:
    """`prioritised_init` with the window and exponent known (`make_prioritised_...`)."""
    module = _build(
        experience,
        add_batch_size,
        max_length_time_axis,
        sample_sequence_length,
        period,
        priority_exponent,
    )
    return PrioritisedTrajectoryBufferState(module)


def prioritised_add(
    state: PrioritisedTrajectoryBufferState,
    batch: PyTree,
    sample_sequence_length: int,
    period: int,
    device: str,
) -> PrioritisedTrajectoryBufferState:
    """Append `batch` (leaves `[add_batch_size, T, ...]`, `T <= max_length_time_axis`) to the
    rows, and update the priorities of the windows that enter or leave. `device` is accepted
    for flashbax's signature and not used."""
    call = "prioritised_trajectory_buffer.prioritised_add"
    check_required_sizes(call, sample_sequence_length=sample_sequence_length, period=period)
    check_fits(call, "sample_sequence_length", sample_sequence_length, state.module.max_length)
    batch = check_add(state.module, batch, call)
    module = _configured(state.module, call, window=sample_sequence_length, period=period)
    return PrioritisedTrajectoryBufferState(module.extend(batch))


def prioritised_sample(
    state: PrioritisedTrajectoryBufferState,
    rng_key: PRNGKeyArray,
    batch_size: int,
    sequence_length: int,
    period: int,
) -> PrioritisedTrajectoryBufferSample:
    """`batch_size` windows of `sequence_length` steps, drawn stratified in proportion to
    `priority ** α`, with their sum-tree leaves and probabilities.

    **Raises:** an `eqx.error_if` error if no window is stored yet (flashbax returns zeros).
    """
    call = "prioritised_trajectory_buffer.prioritised_sample"
    check_required_sizes(
        call, batch_size=batch_size, sequence_length=sequence_length, period=period
    )
    check_fits(call, "sequence_length", sequence_length, state.module.max_length)
    module = _configured(state.module, call, window=sequence_length, period=period)
    out = module.sample(rng_key, batch_size)
    return PrioritisedTrajectoryBufferSample(
        experience=out.sample.items, indices=out.indices, probabilities=out.probabilities
    )


def set_priorities(
    state: PrioritisedTrajectoryBufferState,
    indices: Integer[ArrayLike, " n"],
    priorities: Real[ArrayLike, " n"],
    priority_exponent: float,
    device: str,
) -> PrioritisedTrajectoryBufferState:
    """Set the priorities of the windows at sum-tree leaves `indices` (a sample's `indices`);
    each leaf gets `priority ** priority_exponent`. Of repeated indices the last wins. An index
    whose window has left the buffer (its first step overwritten) and whose leaf holds no newer
    window yet is dropped. `device` is accepted for flashbax's signature and not used.

    **Raises:** an `eqx.error_if` error for an index outside `[0, capacity)` or whose leaf
    never held a window, or a priority that is negative, infinite, NaN or too large for the
    sum tree's dtype. Indices and priorities are checked in their own dtype: an int64 index
    or priority is not wrapped to int32 first, as `jnp.asarray` would wrap it.
    """
    call = "prioritised_trajectory_buffer.set_priorities"
    module = _configured(state.module, call, priority_exponent=priority_exponent)
    capacity = module.tree.capacity
    # Each checked in its own dtype (an int64 index or priority is not wrapped to int32 on
    # the way), then flattened: flashbax takes any shape.
    leaves, outside = check_index(indices, capacity, f"{call}(indices=...)")
    leaves, outside = leaves.reshape(-1), outside.reshape(-1)
    if isinstance(priorities, jax.Array | np.ndarray):
        priorities = priorities.reshape(-1)
    priorities = check_vector(priorities, leaves.shape[0], call, "priorities")
    dtype = module.max_priority.dtype
    priorities, faults = as_float(priorities, dtype, call, "priorities")
    env, start = stamps_of(module, jnp.where(outside, 0, leaves))
    bad = outside | (start < 0)
    env, start, priorities = check_faults(
        (env, start, priorities),
        [
            (
                bad,
                f"`{call}`: an index names no window: indices must be sum-tree leaves in "
                f"[0, {capacity}) whose window has been stored, as `sample` returns them",
            ),
            *faults,
            (
                ~(jnp.isfinite(priorities) & (priorities >= 0)),
                f"`{call}`: priorities must be finite and non-negative",
            ),
        ],
    )
    return PrioritisedTrajectoryBufferState(module.set_priorities(env, start, priorities))


@dataclasses.dataclass(frozen=True)
class PrioritisedTrajectoryBuffer(TrajectoryBuffer[Experience, BufferState, BufferSample]):
    """flashbax's container of pure functions, with `set_priorities(state, indices,
    priorities)`."""

    set_priorities: Callable


def validate_priority_exponent(priority_exponent: float) -> None:
    """flashbax's check: `0 <= priority_exponent <= 1`, a real Python number (flashbax let a
    bool through and raised Python's own `TypeError` for a string)."""
    check_priority_exponent(priority_exponent, "validate_priority_exponent")


def check_priority_exponent(priority_exponent: float, call: str) -> float:
    """`priority_exponent` as a float in `[0, 1]`, else a `TypeError` quoting
    `call(priority_exponent=...)` for a non-real (or bool) or a `ValueError` for one out of
    range (NaN included)."""
    where = f"{call}(priority_exponent=...)"
    value = check_finite_float(priority_exponent, where)
    if not 0 <= value <= 1:
        raise ValueError(f"`{where}` must be in [0, 1], got {priority_exponent}.")
    return value


def validate_device(device: str) -> bool:
    """Whether `device` is one of flashbax's names ('cpu', 'gpu', 'tpu') and JAX has that
    backend here, as flashbax answers it; warns if not.

    flashbax picks its sum-tree update by device, falling back to its CPU one when this is
    `False`; dejax_eqx has one for every device, so the answer changes nothing."""
    if device not in ("cpu", "gpu", "tpu"):
        warnings.warn(
            f"device must be 'cpu', 'gpu' or 'tpu', got {device!r}; it is ignored (dejax_eqx "
            "uses one implementation on every device).",
            stacklevel=2,
        )
        return False
    try:
        jax.devices(device)
    except RuntimeError:
        warnings.warn(
            f"device = {device!r}, but JAX has no {device!r} backend here; it is ignored "
            "(dejax_eqx uses one implementation on every device).",
            stacklevel=2,
        )
        return False
    return True


# The sizes of the sum tree. Unlike flashbax's, each function checks that its arguments are
# positive Python ints (at most 2**31 - 1, as every size of a buffer), where flashbax raised a
# bare `ZeroDivisionError` for a zero period and returned negative or zero sizes for negative or
# zero ones. A period longer than the time axis is flashbax's answer, 0 (no whole period fits).


def get_max_divisible_length(max_length_time_axis: int, period: int) -> int:
    """flashbax's `max_length_time_axis` cut down to a multiple of `period`: the time axis
    `make_prioritised_trajectory_buffer` uses."""
    check_required_sizes(
        "get_max_divisible_length", max_length_time_axis=max_length_time_axis, period=period
    )
    return int(max_length_time_axis - max_length_time_axis % period)


def get_num_items_in_row(max_length_time_axis: int, period: int) -> int:
    """The windows (sum-tree leaves) of one row: `max_length_time_axis // period`."""
    check_required_sizes(
        "get_num_items_in_row", max_length_time_axis=max_length_time_axis, period=period
    )
    return int(max_length_time_axis // period)


def get_sum_tree_capacity(max_length_time_axis: int, period: int, add_batch_size: int) -> int:
    """The sum tree's leaves: `get_num_items_in_row(...)` for each of `add_batch_size` rows."""
    check_required_sizes(
        "get_sum_tree_capacity",
        max_length_time_axis=max_length_time_axis,
        period=period,
        add_batch_size=add_batch_size,
    )
    return get_num_items_in_row(int(max_length_time_axis), int(period)) * int(add_batch_size)


def get_invalid_indices(
    state: LockStepState,
    sample_sequence_length: int,
    period: int,
    add_batch_size: int,
    max_length_time_axis: int,
) -> Int[Array, "rows items"]:
    """The sum-tree leaves that flashbax counts as unsafe to sample, given the write position
    `state.current_index`: per row, the `sample_sequence_length // period + 1` leaves after
    that of the newest window ending before the write position (flashbax's comment: often one
    of them is still whole). `[add_batch_size, sample_sequence_length // period + 1]`,
    computed as flashbax computes it. flashbax 0.1.3 no longer calls it; nor do the drop-in's
    buffers, whose sum tree holds exactly the windows that are stored.

    Leaves are numbered as flashbax numbers its items, `row * (max_length_time_axis //
    period) + slot // period`: the drop-in's leaves when `period` divides
    `max_length_time_axis` (always, through `make_prioritised_trajectory_buffer`).

    **Raises:** `ValueError`/`TypeError` if a size is not a positive Python int, if
    `add_batch_size` or `max_length_time_axis` is not the state's, or if `period` or
    `sample_sequence_length` is longer than `max_length_time_axis` (flashbax divided by a zero
    period, took a modulo by zero items per row, or answered for a buffer of another shape)."""
    call = "get_invalid_indices"
    check_required_sizes(
        call,
        sample_sequence_length=sample_sequence_length,
        period=period,
        add_batch_size=add_batch_size,
        max_length_time_axis=max_length_time_axis,
    )
    module = state.module
    for name, value, own in [
        ("add_batch_size", add_batch_size, module.num_envs),
        ("max_length_time_axis", max_length_time_axis, module.max_length),
    ]:
        if value != own:
            raise ValueError(
                f"`{call}({name}=...)` must be the state's, {own}, got {value}: the indices "
                "are those of the state's rows and slots."
            )
    check_fits(call, "period", period, max_length_time_axis)
    check_fits(call, "sample_sequence_length", sample_sequence_length, max_length_time_axis)
    items_in_row = max_length_time_axis // period
    last_start = get_max_divisible_length(max_length_time_axis, period) - 1
    newest_whole = jnp.minimum(
        (state.current_index - sample_sequence_length) % max_length_time_axis, last_start
    )
    first_broken = (newest_whole // period + 1) % items_in_row
    broken = (jnp.arange(sample_sequence_length // period + 1) + first_broken) % items_in_row
    rows = jnp.arange(add_batch_size) * items_in_row
    return broken[None, :] + rows[:, None]


def make_prioritised_trajectory_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    period: int,
    min_length_time_axis: int,
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
    priority_exponent: float = 0.6,
    device: str = "cpu",
    throw: bool = True,
) -> PrioritisedTrajectoryBuffer:
    """flashbax's `make_prioritised_trajectory_buffer`, same arguments and defaults.

    As flashbax does, `max_length_time_axis` (or `max_size // add_batch_size`) is cut down to a
    multiple of `period`, with a printed note when that loses capacity. `device` is only
    checked (see `validate_device`).

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    call = "make_prioritised_trajectory_buffer"
    check_sizes(
        call,
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=sample_sequence_length,
        period=period,
        min_length_time_axis=min_length_time_axis,
        max_size=max_size,
        max_length_time_axis=max_length_time_axis,
    )
    if max_size is not None and max_length_time_axis is None:
        length_from_max_size(call, max_size, add_batch_size)
    # The trajectory buffer's checks and warnings, and its `can_sample` (which raises
    # min_length_time_axis to sample_sequence_length), are the same as flashbax's here.
    base = make_trajectory_buffer(
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=sample_sequence_length,
        period=period,
        min_length_time_axis=min_length_time_axis,
        max_size=max_size,
        max_length_time_axis=max_length_time_axis,
    )
    check_priority_exponent(priority_exponent, call)
    validate_device(device)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    assert max_length_time_axis is not None  # checked by make_trajectory_buffer
    aligned = get_max_divisible_length(max_length_time_axis, period)
    if aligned == 0:  # flashbax built a time axis of no steps; the module's `init` refused it
        given = " (max_size // add_batch_size)" if max_size is not None else ""
        raise ValueError(
            f"`{call}(period=...)` must be at most max_length_time_axis = "
            f"{max_length_time_axis}{given}, got {period}: no row would hold a whole period, "
            "and the sum tree no window."
        )
    if aligned != max_length_time_axis:
        print(
            f"max_length_time_axis = {max_length_time_axis} is not a multiple of period = "
            f"{period}: using {aligned}, {(max_length_time_axis - aligned) * add_batch_size} "
            "fewer steps in all."
        )
    buffer = PrioritisedTrajectoryBuffer(
        init=functools.partial(
            _make_init,
            add_batch_size=add_batch_size,
            max_length_time_axis=aligned,
            period=period,
            sample_sequence_length=sample_sequence_length,
            priority_exponent=priority_exponent,
        ),
        add=functools.partial(
            prioritised_add,
            sample_sequence_length=sample_sequence_length,
            period=period,
            device=device,
        ),
        sample=functools.partial(
            prioritised_sample,
            batch_size=sample_batch_size,
            sequence_length=sample_sequence_length,
            period=period,
        ),
        sample_n=functools.partial(
            prioritised_sample, sequence_length=sample_sequence_length, period=period
        ),
        can_sample=base.can_sample,
        set_priorities=functools.partial(
            set_priorities, priority_exponent=priority_exponent, device=device
        ),
    )
    return with_throw(buffer, throw, "make_prioritised_trajectory_buffer")
