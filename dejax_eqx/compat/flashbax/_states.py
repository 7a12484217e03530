"""flashbax 0.1.3's states and samples, as views of dejax_eqx's modules (WORK IN PROGRESS).

Each state holds one dejax_eqx module (`module`, its only field, so the state's array leaves
are exactly the module's) and computes flashbax's fields from it. Every field is written with
`[..., 0]` rather than `[0]` so that it also reads a stack of states (flashbax's tests call
`can_sample` outside `pmap` on per-device states).
"""

from typing import NamedTuple

import equinox as eqx
from jaxtyping import Array, Bool, Int, PyTree

from ... import PrioritisedTrajectoryBuffer, TrajectoryBuffer, TrajectoryQueue


def _lock_step_count(trajectories: TrajectoryBuffer) -> Int[Array, "*d"]:
    # Every compat add is lock-step: all envs share one step count.
    return trajectories.step_count[..., 0]


class TrajectoryBufferState(eqx.Module):
    """The state of flashbax's trajectory, item and flat buffers: a `dx.TrajectoryBuffer`."""

    module: TrajectoryBuffer

    @property
    def experience(self) -> PyTree[Array]:
        """The slots, leaves `[add_batch_size, max_length_time_axis, ...]`."""
        return self.module.data

    @property
    def current_index(self) -> Int[Array, "*d"]:
        """The time index the next add writes."""
        return _lock_step_count(self.module) % self.module.max_length

    @property
    def is_full(self) -> Bool[Array, "*d"]:
        """Whether every slot has been written."""
        return _lock_step_count(self.module) >= self.module.max_length


class PrioritisedTrajectoryBufferState(eqx.Module):
    """The state of flashbax's prioritised buffers: a `dx.PrioritisedTrajectoryBuffer`."""

    module: PrioritisedTrajectoryBuffer

    @property
    def experience(self) -> PyTree[Array]:
        return self.module.trajectories.data

    @property
    def current_index(self) -> Int[Array, "*d"]:
        return _lock_step_count(self.module.trajectories) % self.module.trajectories.max_length

    @property
    def running_index(self) -> Int[Array, "*d"]:
        return _lock_step_count(self.module.trajectories)

    @property
    def is_full(self) -> Bool[Array, "*d"]:
        t = self.module.trajectories
        return _lock_step_count(t) >= t.max_length

    # TODO: sum_tree_state, a view with flashbax's node layout (root at index 0) and
    # max_recorded_priority = priority_mass(max_priority, alpha).


class TrajectoryQueueState(eqx.Module):
    """The state of flashbax's trajectory queue: a `dx.TrajectoryQueue`."""

    module: TrajectoryQueue

    @property
    def experience(self) -> PyTree[Array]:
        return self.module.trajectories.data

    @property
    def write_index(self) -> Int[Array, "*d"]:
        t = self.module.trajectories
        return _lock_step_count(t) % t.max_length

    @property
    def read_index(self) -> Int[Array, "*d"]:
        t = self.module.trajectories
        return (_lock_step_count(t) - t.online_length[..., 0]) % t.max_length

    @property
    def is_full(self) -> Bool[Array, "*d"]:
        t = self.module.trajectories
        return t.online_length[..., 0] == t.max_length


class TrajectoryBufferSample(eqx.Module):
    experience: PyTree[Array]


class PrioritisedTrajectoryBufferSample(eqx.Module):
    experience: PyTree[Array]
    indices: Array
    probabilities: Array


class ExperiencePair(NamedTuple):
    first: PyTree[Array]
    second: PyTree[Array]


class TransitionSample(eqx.Module):
    experience: ExperiencePair


class TrajectoryQueueSample(eqx.Module):
    experience: PyTree[Array]
