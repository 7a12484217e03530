"""TrajectoryQueue: per-env streams read once, oldest first."""

from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PyTree, Shaped

from ._abstract import AbstractTrajectoryBuffer
from ._checks import check_positive_int, plural, Prototype
from ._faults import check_faults, Fault
from ._results import initial_result, reports, Result
from ._streams import Appended, check_append, gather_steps, grow, make_streams, Streams


_Q = TypeVar("_Q", bound="TrajectoryQueue")


class TrajectoryQueue(AbstractTrajectoryBuffer):
    """A consume-once queue of per-env streams: `pop` returns the oldest unread steps of every
    env and removes them, so each step is read exactly once, in order.

    For on-policy learners that consume rollouts in fixed-length chunks (IMPALA, PPO with a
    separate actor, Muesli's online part) and for anyone who wants each step trained on once.
    Each of `num_envs` envs keeps a stream of at most `max_length` unread steps. Adding to an
    env whose unread steps would not fit is an error, never a silent overwrite: pop first
    (`can_add` tells when an add fits).

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

    streams: Streams
    unread: Int[Array, " num_envs"]
    """The number of unread steps of each env, an int32 array in `[0, max_length]`."""
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(self, prototype: Prototype, num_envs: int, max_length: int, *, throw: bool = True):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars); only its
            structure, shapes and dtypes are used.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the most unread steps each env holds, a positive Python int below
            `2**31`. Storage is `num_envs · max_length` steps.
        - `throw`: how a fault (a fact of the data: an empty buffer, an index out of range)
            is reported: raised at the faulty call (`True`, the default), or kept as the
            buffer's `result` and beside what a read returns (`False`: no conditional and no
            callback is compiled; see the guide's "Faults as results").
        """
        self.result = initial_result(throw, "TrajectoryQueue(throw=...)")
        self.streams = make_streams(prototype, num_envs, max_length, "TrajectoryQueue")
        self.unread = jnp.zeros(self.streams.num_envs, jnp.int32)

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

    @reports
    def add(
        self: _Q, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _Q:
        """As `AbstractTrajectoryBuffer.add`; also an `eqx.error_if` error if a listed env
        already holds `max_length` unread steps."""
        return extend_queue(self, items, env_ids, "TrajectoryQueue.add", sequences=False)

    @reports
    def extend(
        self: _Q, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _Q:
        """As `AbstractTrajectoryBuffer.extend`; also `ValueError` at once if `T >
        max_length`, and an `eqx.error_if` error if a listed env holds more than `max_length
        - T` unread steps (the add would overwrite some)."""
        return extend_queue(self, items, env_ids, "TrajectoryQueue.extend", sequences=True)

    def with_streams(self: _Q, streams: Streams) -> _Q:
        streams = self._check_streams(streams, "TrajectoryQueue.with_streams")
        unread = jnp.zeros(streams.num_envs, jnp.int32)
        return eqx.tree_at(lambda q: (q.streams, q.unread), self, (streams, unread))

    @reports
    def pop(self: _Q, sequence_length: int) -> tuple[PyTree[Shaped[Array, "num_envs seq ..."]], _Q]:
        """Remove and return the `sequence_length` oldest unread steps of every env.

        **Arguments:**

        - `sequence_length`: a positive Python int (static), at most `max_length`.

        **Returns:** `(items, queue)`: `items` has the prototype's structure, each leaf of
        shape `(num_envs, sequence_length, *leaf_shape)`, oldest step first.

        **Raises:** `ValueError` at once for a bad `sequence_length`; an `eqx.error_if` error
        if an env holds fewer than `sequence_length` unread steps.
        """
        return pop_queue(self, sequence_length, "TrajectoryQueue.pop")


def extend_queue(
    queue: _Q,
    items: PyTree[ArrayLike],
    env_ids: Integer[ArrayLike, " n"] | None,
    call: str,
    *,
    sequences: bool,
) -> _Q:
    """`TrajectoryQueue.add` (or `extend`, with `sequences`) under the name `call`: an append
    that may not push an unread step out of a listed env's queue."""
    m = queue.max_length

    def full(taking: Bool[Array, " num_envs"], length: int) -> list[Fault]:
        if length > m:
            raise ValueError(
                f"`{call}`: {length} steps per env do not fit in a queue of max_length = {m}; "
                "the oldest would be overwritten before they are read."
            )
        return [
            (
                jnp.any(taking & (queue.unread > m - length)),
                f"`{call}`: an env's queue has no room for {plural(length, 'more step')}; the "
                f"add would overwrite unread ones (max_length = {m}). Pop first, or check "
                "`can_add`",
            )
        ]

    done: Appended = check_append(
        queue.streams, items, env_ids, call, sequences=sequences, more=full
    )
    if done.length == 0:
        return queue
    unread = grow(queue.unread, done.added, done.length, m)
    counters, unread = check_faults((done.counters(), unread), done.faults)
    streams = done.guarded(counters)
    return eqx.tree_at(lambda q: (q.streams, q.unread), queue, (streams, unread))


def pop_queue(
    queue: _Q, sequence_length: int, call: str
) -> tuple[PyTree[Shaped[Array, "num_envs seq ..."]], _Q]:
    """`TrajectoryQueue.pop` under the name `call`."""
    length = check_positive_int(
        sequence_length, f"{call}(sequence_length=...)", maximum=queue.max_length
    )
    every = jnp.arange(queue.num_envs, dtype=jnp.int32)
    # The oldest unread step is the `unread`-th newest.
    items = gather_steps(queue.streams, every, queue.unread, length)
    unread = jnp.maximum(queue.unread - length, 0)
    fault = (
        jnp.any(queue.unread < length),
        f"`{call}`: an env holds fewer than {plural(length, 'unread step')}; pop once "
        "`can_pop(sequence_length)` holds",
    )
    items, unread = check_faults(
        (items, unread), [fault], order_reads=False, safe=(items, queue.unread)
    )
    return items, eqx.tree_at(lambda q: q.unread, queue, unread)
