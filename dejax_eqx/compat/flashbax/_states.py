"""flashbax 0.1.3's states and samples, as views of dejax_eqx's modules, and the check every
`add` shares.

Each state holds one dejax_eqx module (`module`, its only field, so the state's array leaves
are exactly the module's) and computes flashbax's fields from it. Every field is written with
`[..., 0]` rather than `[0]` so that it also reads a stack of states (flashbax's tests call
`can_sample` outside `pmap` on per-device states).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Int, PyTree

from ... import AbstractTrajectoryBuffer, Result, TrajectoryBuffer
from ...internal import check_bool, check_sequences, recording, result_of


# flashbax's type variable for the experience a buffer holds (one step: any pytree); its states
# and samples are generic in it, so `TrajectoryBufferState[Transition]` is a type, as in
# flashbax (flashbax binds it to `chex.ArrayTree`; the drop-in does not depend on chex).
Experience = TypeVar("Experience", bound=PyTree)


def check_add(
    trajectories: AbstractTrajectoryBuffer, batch: PyTree, call: str, what: str = "buffer"
) -> PyTree:
    """`batch` (leaves `[add_batch_size, T, ...]`), checked against the prototype as
    `TrajectoryBuffer.extend` checks it, and to have one row per env and at most
    `max_length_time_axis` steps, as flashbax requires (the module would keep the last ones)."""
    batch, rows, length = check_sequences(trajectories.item_spec, batch, call)
    if rows != trajectories.num_envs:
        raise ValueError(
            f"`{call}`: the batch has {rows} rows, but the {what} was initialised with "
            f"add_batch_size = {trajectories.num_envs}; every add brings one sequence per row."
        )
    if length > trajectories.max_length:
        raise ValueError(
            f"`{call}`: {length} steps per row do not fit in max_length_time_axis = "
            f"{trajectories.max_length} (flashbax refuses them too)."
        )
    return batch


class LockStepState(eqx.Module):
    """flashbax's fields of a trajectory buffer's state, read from `module`, a trajectory
    buffer that every add advances in lock-step (all envs share one step count). The states of
    the plain and the prioritised buffers both derive them here."""

    module: eqx.AbstractVar[AbstractTrajectoryBuffer]

    @property
    def running_index(self) -> Int[Array, "*d"]:
        """The steps added to each row so far (never wrapped)."""
        return self.module.step_count[..., 0]

    @property
    def experience(self) -> PyTree[Array]:
        """The slots, leaves `[add_batch_size, max_length_time_axis, ...]`."""
        return self.module.data

    @property
    def current_index(self) -> Int[Array, "*d"]:
        """The time index the next add writes."""
        return self.running_index % self.module.max_length

    @property
    def is_full(self) -> Bool[Array, "*d"]:
        """Whether every slot has been written."""
        return self.running_index >= self.module.max_length


class TrajectoryBufferState(LockStepState, Generic[Experience]):
    """The state of flashbax's trajectory, item and flat buffers: a `dx.TrajectoryBuffer`."""

    module: TrajectoryBuffer


class TrajectoryBufferSample(eqx.Module, Generic[Experience]):
    experience: PyTree[Array]
    result: Result | None = None  # a `throw=False` buffer's (see `with_throw`)


class ExperiencePair(NamedTuple, Generic[Experience]):
    first: PyTree[Array]
    second: PyTree[Array]


# What annotations say for an `ExperiencePair`: beartype cannot check a generic NamedTuple, and
# the jaxtyping hook of the tests has it check every annotation of the package.
Pair = tuple[PyTree[Array], PyTree[Array]]


class TransitionSample(eqx.Module, Generic[Experience]):
    experience: Pair
    result: Result | None = None  # a `throw=False` buffer's (see `with_throw`)


def pairs(windows: PyTree[Array]) -> Pair:
    """Windows of two steps (leaves `[batch, 2, ...]`) as `(first, second)`."""
    return ExperiencePair(
        first=jax.tree.map(lambda x: x[:, 0], windows),
        second=jax.tree.map(lambda x: x[:, 1], windows),
    )


def first_steps(windows: PyTree[Array]) -> PyTree[Array]:
    """Windows of one step (leaves `[batch, 1, ...]`) without their time axis."""
    return jax.tree.map(lambda x: x[:, 0], windows)


_C = TypeVar("_C")


def with_throw(buffer: _C, throw: Any, call: str) -> _C:
    """A buffer of this layer (its container of functions) whose faults are reported as
    `throw` says: raised (`True`, flashbax's behaviour and the default), or, with `False`,
    kept as the state's `module.result` (the first fault of the calls that returned the
    state) and as the `result` of what `sample` returns: no conditional and no callback is
    compiled. `state.module.check()` and `sample.result.check()` raise them on the host."""
    if check_bool(throw, f"{call}(throw=...)"):
        return buffer
    changes: dict[str, Any] = {"init": _init_recording(buffer.init)}  # pyright: ignore
    for name in ("add", "sample", "sample_n", "set_priorities"):
        fn = getattr(buffer, name, None)
        if fn is not None:
            changes[name] = _recorded(fn)
    return dataclasses.replace(buffer, **changes)  # pyright: ignore


def _init_recording(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def call(*args: Any, **kwargs: Any) -> Any:
        state = init(*args, **kwargs)
        return eqx.tree_at(lambda s: s.module, state, state.module.with_throw(False))

    return call


def _recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(state, ...)` with its faults recorded: on the state it returns (first fault
    wins), or as the `result` of the sample it returns."""

    @functools.wraps(fn)
    def call(state: Any, *args: Any, **kwargs: Any) -> Any:
        out, faults = recording(lambda: fn(state, *args, **kwargs), record=True)
        if faults is None:  # inside another recording call
            return out
        result = result_of(faults)

        def handed(x: Any) -> Any:
            if hasattr(x, "module"):  # a state
                kept = state.module.result.first(result)
                return eqx.tree_at(lambda s: s.module, x, x.module.with_result(kept))
            return eqx.tree_at(lambda s: s.result, x, result, is_leaf=lambda r: r is None)

        return tuple(handed(x) for x in out) if isinstance(out, tuple) else handed(out)

    return call
