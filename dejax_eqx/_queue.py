"""TrajectoryQueue: per-env streams read once, oldest first."""

from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PyTree, Shaped

from ._checks import check_faults, check_positive_int, plural, Prototype
from ._storage import ring_add, ring_sub
from ._trajectory import TrajectoryBuffer


_Q = TypeVar("_Q", bound="TrajectoryQueue")


class TrajectoryQueue(eqx.Module):
    """A consume-once queue of per-env streams: `pop` returns the oldest unread steps of every
    env and removes them, so each step is read exactly once, in order.

    For on-policy learners that consume rollouts in fixed-length chunks (IMPALA, PPO with a
    separate actor, Muesli's online part) and for anyone who wants each step trained on once.
    Each of `num_envs` envs keeps a stream of at most `max_length` unread steps. Adding to an
    env whose unread steps would not fit is an error, never a silent overwrite: pop first
    (`can_add` tells when an add fits).

    Built on a `TrajectoryBuffer`, `trajectories`: the unread steps of an env are its online
    window, and `pop` shortens that window from its oldest end.

    `TrajectoryQueue` is final: it is not meant to be subclassed.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        q = dx.TrajectoryQueue({"obs": jnp.zeros(3)}, num_envs=2, max_length=8)
        rollout = {"obs": jnp.ones((2, 5, 3))}  # 5 steps of each env
        q = q.extend(rollout)
        chunk, q = q.pop(4)  # the 4 oldest unread steps of every env
        assert chunk["obs"].shape == (2, 4, 3)
        assert q.unread.tolist() == [1, 1] and not bool(q.can_add(8))
        ```
    """

    trajectories: TrajectoryBuffer

    def __init__(self, prototype: Prototype, num_envs: int, max_length: int):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars); only its
            structure, shapes and dtypes are used.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the most unread steps each env holds, a positive Python int below
            `2**31`. Storage is `num_envs · max_length` steps.
        """
        self.trajectories = TrajectoryBuffer(prototype, num_envs, max_length)

    @property
    def num_envs(self) -> int:
        """The number of envs (a static Python int)."""
        return self.trajectories.num_envs

    @property
    def max_length(self) -> int:
        """The most unread steps each env holds (a static Python int)."""
        return self.trajectories.max_length

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return self.trajectories.item_spec

    @property
    def unread(self) -> Int[Array, " num_envs"]:
        """The number of unread steps of each env, an int32 array in `[0, max_length]`."""
        return self.trajectories.online_length

    def can_add(self, length: int = 1) -> Bool[Array, ""]:
        """Whether `length` more steps fit in every env's queue without overwriting unread
        steps (a traced boolean scalar)."""
        length = check_positive_int(length, "TrajectoryQueue.can_add(length=...)")
        return jnp.all(self.unread <= self.max_length - length)

    def can_pop(self, length: int) -> Bool[Array, ""]:
        """Whether every env holds at least `length` unread steps, so that `pop(length)` may
        run (a traced boolean scalar)."""
        length = check_positive_int(length, "TrajectoryQueue.can_pop(length=...)")
        return jnp.all(self.unread >= length)

    def add(
        self: _Q, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _Q:
        """Append one step to the queue of each listed env (as `TrajectoryBuffer.add`).

        **Raises:** as `TrajectoryBuffer.add`, and an `eqx.error_if` error if a listed env
        already holds `max_length` unread steps.
        """
        call = "TrajectoryQueue.add"
        return self._with(self.trajectories._add(items, env_ids, call, keep_unread=True))

    def extend(
        self: _Q, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _Q:
        """Append `T` consecutive steps to the queue of each listed env (as
        `TrajectoryBuffer.extend`; leaves `[n, T, ...]`, oldest step first).

        **Raises:** `ValueError` at once if `T > max_length`; as `TrajectoryBuffer.extend`;
        and an `eqx.error_if` error if a listed env holds more than `max_length - T` unread
        steps (the add would overwrite some).
        """
        call = "TrajectoryQueue.extend"
        return self._with(self.trajectories._extend(items, env_ids, call, keep_unread=True))

    def _with(self: _Q, trajectories: TrajectoryBuffer) -> _Q:
        return eqx.tree_at(lambda q: q.trajectories, self, trajectories)

    def pop(self: _Q, sequence_length: int) -> tuple[PyTree[Shaped[Array, "num_envs seq ..."]], _Q]:
        """Remove and return the `sequence_length` oldest unread steps of every env.

        **Arguments:**

        - `sequence_length`: a positive Python int (static), at most `max_length`.

        **Returns:** `(items, queue)`: `items` has the prototype's structure, each leaf of
        shape `(num_envs, sequence_length, *leaf_shape)`, oldest step first.

        **Raises:** `ValueError` at once for a bad `sequence_length`; an `eqx.error_if` error
        if an env holds fewer than `sequence_length` unread steps.
        """
        return self._pop(sequence_length, "TrajectoryQueue.pop")

    def _pop(
        self: _Q, sequence_length: int, call: str
    ) -> tuple[PyTree[Shaped[Array, "num_envs seq ..."]], _Q]:
        """`pop` under the name `call` (the flashbax drop-in's `trajectory_queue.sample`)."""
        length = check_positive_int(
            sequence_length, f"{call}(sequence_length=...)", maximum=self.max_length
        )
        t = self.trajectories
        m = self.max_length
        # The oldest unread step is `unread` steps behind the cursor (unread <= m).
        first = ring_sub(t.head, self.unread, m)
        slots = ring_add(first[:, None], jnp.arange(length, dtype=jnp.int32)[None, :], m)
        rows = jnp.arange(self.num_envs, dtype=jnp.int32)[:, None]
        items = jax.tree.map(lambda x: x.at[rows, slots].get(mode="promise_in_bounds"), t.data)
        online = jnp.maximum(self.unread - length, 0)
        fault = (
            jnp.any(self.unread < length),
            f"`{call}`: an env holds fewer than {plural(length, 'unread step')}; pop once "
            "`can_pop(sequence_length)` holds",
        )
        items, online = check_faults((items, online), [fault], order_reads=False)
        return items, eqx.tree_at(lambda q: q.trajectories.online_length, self, online)
