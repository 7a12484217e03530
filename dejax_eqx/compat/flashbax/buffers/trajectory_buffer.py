"""flashbax 0.1.3's `trajectory_buffer`, on a `dx.TrajectoryBuffer` used in lock-step.

Row `i` of a batch is env `i`'s stream; an `add` of `[add_batch_size, T, ...]` is one
`TrajectoryBuffer.extend`. The state is a view of the module (see `_states.py`).
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, PyTree

from .... import TrajectoryBuffer as _Module, Window
from ....internal import (
    check_faults,
    check_items,
    check_nonnegative_int,
    check_positive_int,
    draw_starts,
    phase,
    read_windows,
)
from .._states import (
    check_add,
    Experience,
    TrajectoryBufferSample,
    TrajectoryBufferState,
    with_throw,
)
from ..utils import add_dim_to_args


# flashbax's type variables, bound to the drop-in's state and sample (Stoix annotates its
# learner states with `BufferState`). flashbax's prioritised state and sample are subclasses of
# these; the drop-in's are not (see docs/migration-flashbax.md).
BufferState = TypeVar("BufferState", bound=TrajectoryBufferState)
BufferSample = TypeVar("BufferSample", bound=TrajectoryBufferSample)


def check_sizes(call: str, /, **sizes: Any) -> None:
    """Each of `sizes` (flashbax's integer arguments, by name) a positive Python int, else a
    `ValueError`/`TypeError` quoting `call(name=...)`; `min_length...` may be 0, `None`
    stands for an argument not given. flashbax checked none of them, and went on to a
    `ZeroDivisionError`, an `MLIRError`, a shape error or an empty batch."""
    for name, value in sizes.items():
        if value is not None:
            _check_size(call, name, value)


def check_required_sizes(call: str, /, **sizes: Any) -> None:
    """`check_sizes` for arguments that must be given: `None` is refused like any non-int."""
    for name, value in sizes.items():
        _check_size(call, name, value)


def _check_size(call: str, name: str, value: Any) -> None:
    where = f"{call}({name}=...)"
    if name.startswith("min_length"):
        check_nonnegative_int(value, where)
    else:
        check_positive_int(value, where)


def check_fits(call: str, name: str, steps: int, max_length_time_axis: int) -> None:
    """A period or window of `steps` steps fits in a row, else a `ValueError` quoting
    `call(name=...)` (the module's own message spoke of a burn-in and a bootstrap)."""
    if steps > max_length_time_axis:
        raise ValueError(
            f"`{call}({name}=...)` must be at most max_length_time_axis = "
            f"{max_length_time_axis}, got {steps}: a row never holds more steps."
        )


def length_from_max_size(call: str, max_size: int, add_batch_size: int) -> int:
    """`max_size // add_batch_size`, the steps per row that `max_size` sets (both checked
    positive), else a `ValueError` quoting `call` when that is 0: flashbax went on to build
    rows of no steps, refused later under another argument's name."""
    length = max_size // add_batch_size
    if length == 0:
        raise ValueError(
            f"`{call}`: max_size = {max_size} is less than add_batch_size = {add_batch_size}, "
            "so the rows would hold max_size // add_batch_size = 0 steps each; give a max_size "
            "of at least add_batch_size."
        )
    return length


def init(
    experience: PyTree, add_batch_size: int, max_length_time_axis: int
) -> TrajectoryBufferState:
    """An empty state: `add_batch_size` rows (envs) of `max_length_time_axis` steps."""
    call = "trajectory_buffer.init"
    check_required_sizes(
        call, add_batch_size=add_batch_size, max_length_time_axis=max_length_time_axis
    )
    return TrajectoryBufferState(_Module(experience, add_batch_size, max_length_time_axis))


def add(state: TrajectoryBufferState, batch: PyTree) -> TrajectoryBufferState:
    """Append `batch` (leaves `[add_batch_size, T, ...]`, `T <= max_length_time_axis`)."""
    batch = check_add(state.module, batch, "trajectory_buffer.add")
    return TrajectoryBufferState(state.module.extend(batch))


def sample(
    state: TrajectoryBufferState,
    rng_key: PRNGKeyArray,
    batch_size: int,
    sequence_length: int,
    period: int,
) -> TrajectoryBufferSample:
    """`batch_size` whole windows of `sequence_length` steps, drawn uniformly over the rows and
    the starts `oldest + k * period` (as flashbax counts the period: from the oldest stored
    step, which moves once the buffer wraps).

    **Raises:** an `eqx.error_if` error if fewer than `sequence_length` steps are stored, where
    flashbax returned windows of zeros (`can_sample` tells when sampling is possible).
    """
    call = "trajectory_buffer.sample"
    check_required_sizes(
        call, batch_size=batch_size, sequence_length=sequence_length, period=period
    )
    module = state.module
    check_fits(call, "sequence_length", sequence_length, module.max_length)
    window = Window(sequence_length, period=period, strict=True)
    window.check(module.item_spec, module.max_length, call)
    lengths = module.lengths()
    # Starts `oldest + k * period`: aligned to the oldest stored step, `lengths` steps back.
    aligned = phase(lengths, period)
    starts = draw_starts(
        rng_key,
        lengths,
        aligned,
        batch_size,
        window.law,
        jnp.float32(1),
        max_length=module.max_length,
    )
    items = read_windows(module.streams, starts.env, starts.back, window).items
    fault = (
        lengths[0] < sequence_length,
        f"`{call}`: the buffer holds fewer than sequence_length = {sequence_length} steps "
        "per row; sample once `can_sample` holds",
    )
    return TrajectoryBufferSample(experience=check_faults(items, [fault], order_reads=False))


def can_sample(state: TrajectoryBufferState, min_length_time_axis: int) -> Array:
    """Whether `min_length_time_axis` steps have been added (or the buffer is full).

    **Raises:** `ValueError`/`TypeError` if `min_length_time_axis` is not a non-negative
    Python int (flashbax answered `True` for a negative one and compared against a float)."""
    check_nonnegative_int(
        min_length_time_axis, "trajectory_buffer.can_sample(min_length_time_axis=...)"
    )
    return state.is_full | (state.current_index >= min_length_time_axis)


_B = TypeVar("_B", bound="TrajectoryBuffer")


@dataclasses.dataclass(frozen=True)
class TrajectoryBuffer(Generic[Experience, BufferState, BufferSample]):
    """flashbax's container of pure functions.

    Beyond flashbax's fields, `sample_n(state, rng_key, batch_size)` is `sample` for any batch
    size, which `make_mixer` uses to draw each buffer's exact share. `replace(sample=...)`
    without a new `sample_n` drops it (`None`): it would no longer match `sample`.
    """

    init: Callable
    add: Callable
    sample: Callable
    can_sample: Callable
    sample_n: Callable | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def replace(self: _B, **changes) -> _B:
        if "sample" in changes:
            changes.setdefault("sample_n", None)
        return dataclasses.replace(self, **changes)


def validate_size(
    max_length_time_axis: int | None, max_size: int | None, add_batch_size: int
) -> None:
    """flashbax's check of how a buffer is sized: `max_size` and `max_length_time_axis` are not
    both given; warns that `max_size` sets `max_length_time_axis` to `max_size //
    add_batch_size`.

    Unlike flashbax's, each size must be a positive Python int (or `None` where flashbax lets
    it be), and `max_size` at least `add_batch_size` (flashbax divided by a zero
    `add_batch_size`, and let a `max_size` below it set rows of no steps)."""
    call = "validate_size"
    check_sizes(call, max_length_time_axis=max_length_time_axis, max_size=max_size)
    check_required_sizes(call, add_batch_size=add_batch_size)
    if max_size is not None and max_length_time_axis is not None:
        raise ValueError("Cannot specify both `max_size` and `max_length_time_axis` arguments.")
    if max_size is not None:
        length_from_max_size(call, max_size, add_batch_size)
        warnings.warn(
            f"`max_size` = {max_size} sets max_length_time_axis = max_size // add_batch_size = "
            f"{max_size // add_batch_size}, in place of the `max_length_time_axis` argument.",
            stacklevel=4,  # the caller of `make_trajectory_buffer`
        )


def validate_trajectory_buffer_args(
    max_length_time_axis: int | None,
    min_length_time_axis: int,
    add_batch_size: int,
    sample_sequence_length: int,
    period: int,
    max_size: int | None,
) -> None:
    """flashbax's checks of `make_trajectory_buffer`'s arguments, as flashbax makes them:
    `validate_size`; warns if `sample_sequence_length > min_length_time_axis` (the minimum is
    then raised to it) or `period > sample_sequence_length` (some steps are never sampled);
    refuses a window or a minimum longer than the time axis, when the axis is known.

    Unlike flashbax's, each size must be a positive Python int (`min_length_time_axis` may be
    0; `max_length_time_axis` and `max_size` may be `None`), and `max_size` at least
    `add_batch_size`."""
    call = "validate_trajectory_buffer_args"
    check_sizes(call, max_length_time_axis=max_length_time_axis, max_size=max_size)
    check_required_sizes(
        call,
        min_length_time_axis=min_length_time_axis,
        add_batch_size=add_batch_size,
        sample_sequence_length=sample_sequence_length,
        period=period,
    )
    if max_size is not None and max_length_time_axis is None:
        length_from_max_size(call, max_size, add_batch_size)
    validate_size(max_length_time_axis, max_size, add_batch_size)
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    if sample_sequence_length > min_length_time_axis:
        warnings.warn(
            f"sample_sequence_length = {sample_sequence_length} > min_length_time_axis = "
            f"{min_length_time_axis}: the minimum is raised to sample_sequence_length.",
            stacklevel=2,
        )
        min_length_time_axis = sample_sequence_length
    if period > sample_sequence_length:
        warnings.warn(
            f"period = {period} > sample_sequence_length = {sample_sequence_length}: some "
            "steps are never sampled.",
            stacklevel=3,  # the caller of `make_trajectory_buffer`
        )
    if max_length_time_axis is None:
        return
    if sample_sequence_length > max_length_time_axis:
        raise ValueError(
            "`sample_sequence_length` must be less than or equal to `max_length_time_axis`."
        )
    if min_length_time_axis > max_length_time_axis:
        raise ValueError(
            "`min_length_time_axis` must be less than or equal to `max_length_time_axis`."
        )


def make_trajectory_buffer(
    add_batch_size: int,
    sample_batch_size: int,
    sample_sequence_length: int,
    period: int,
    min_length_time_axis: int,
    max_size: int | None = None,
    max_length_time_axis: int | None = None,
    throw: bool = True,
) -> TrajectoryBuffer:
    """flashbax's `make_trajectory_buffer`, same arguments and defaults (each integer checked:
    positive, `min_length_time_axis` non-negative).

    `throw` (not flashbax's): `False` keeps every fault as a result instead of raising it (the
    state's `module.result`, a sample's `result`), with no conditional and no callback
    compiled; see `dejax_eqx.compat.flashbax` and the guide's "Faults as results".
    """
    check_sizes(
        "make_trajectory_buffer",
        add_batch_size=add_batch_size,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=sample_sequence_length,
        period=period,
        min_length_time_axis=min_length_time_axis,
        max_size=max_size,
        max_length_time_axis=max_length_time_axis,
    )
    if max_size is None and max_length_time_axis is None:
        raise ValueError("Specify `max_size` or `max_length_time_axis`.")
    if max_size is not None and max_length_time_axis is None:
        length_from_max_size("make_trajectory_buffer", max_size, add_batch_size)
    # The minimum is raised to the window silently (flashbax warns, then does the same).
    min_length_time_axis = max(min_length_time_axis, sample_sequence_length)
    validate_trajectory_buffer_args(
        max_length_time_axis,
        min_length_time_axis,
        add_batch_size,
        sample_sequence_length,
        period,
        max_size,
    )
    if max_size is not None:
        max_length_time_axis = max_size // add_batch_size
    assert max_length_time_axis is not None  # one of the two is given, as checked above
    buffer = TrajectoryBuffer(
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
        sample_n=functools.partial(sample, sequence_length=sample_sequence_length, period=period),
    )
    return with_throw(buffer, throw, "make_trajectory_buffer")


def reshaped(
    buffer: _B,
    sample_batch_size: int,
    *,
    add_batches: bool,
    add_sequences: bool,
    one_row: bool,
    sample: Callable[[Any], Any],
    call: str,
) -> _B:
    """A trajectory buffer of this layer (plain or prioritised) as a flat or item buffer.

    Its `add` takes batches without the row axis unless `add_batches`, and without the time
    axis unless `add_sequences` (flashbax's `add_dim_to_args` wrappers); with `one_row` (the
    item buffers) it adds a `[B, T, ...]` batch as one row of `B * T` steps, row-major. Its
    `sample` and `sample_n` return `sample(windows)`, `windows` being the buffer's own sample.

    A batch is checked against the experience as it is given, before an axis is added, under
    the name `call` of the add it goes to: dtypes exactly (nothing is cast), and a Python
    scalar of an item only where the leaf's dtype holds it (`check_items`).
    """
    add = buffer.add
    if one_row:
        add_row = add

        def add(state, batch):
            b, t = jax.tree.leaves(batch)[0].shape[:2]
            return add_row(state, jax.tree.map(lambda x: x.reshape(1, b * t, *x.shape[2:]), batch))

    if not add_batches:  # no row axis: give the batch one
        add = add_dim_to_args(add, axis=0, starting_arg_index=1, ending_arg_index=2)
    if not add_sequences:  # no time axis: give every row one
        add = add_dim_to_args(
            add, axis=1 if add_batches else 0, starting_arg_index=1, ending_arg_index=2
        )
    if not (add_batches and add_sequences):  # else the buffer's own add checks the batch
        add_expanded = add
        what = "item" if not (add_batches or add_sequences) else "batch of items"

        def add(state, batch):
            spec = state.module.item_spec
            one = not (add_batches or add_sequences)
            batch, _ = check_items(spec, batch, call, batched=not one, what=what)
            return add_expanded(state, batch)

    windows = buffer.sample_n
    assert windows is not None, "a buffer made by this layer's make_* functions"

    def sample_n(state, rng_key, batch_size: int):
        return sample(windows(state, rng_key, batch_size))

    def sample_batch(state, rng_key):
        return sample_n(state, rng_key, sample_batch_size)

    return buffer.replace(add=add, sample=sample_batch, sample_n=sample_n)
