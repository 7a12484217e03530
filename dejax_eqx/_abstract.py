import abc
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real, UInt32

from ._faults import check_faults
from ._streams import check_newest, check_stale, Streams


_R = TypeVar("_R", bound="AbstractReplay")
_PR = TypeVar("_PR", bound="AbstractPrioritisedReplay")
_T = TypeVar("_T", bound="AbstractTrajectoryBuffer")


class AbstractReplay(eqx.Module):
    """The surface every replay buffer shares.

    A replay stores items (pytrees of arrays with the prototype's structure, shapes and dtypes)
    up to a fixed capacity and samples batches of them. It is an immutable `eqx.Module`: every
    method returns a new replay, and under `eqx.filter_jit(donate="all")` that copy is an
    in-place update.

    Concrete replays (`UniformReplay`, ...) are final: they are not meant to be subclassed.
    New behaviour comes by composition (`ClusteredReplay` wraps any `AbstractReplay`).
    """

    @property
    @abc.abstractmethod
    def max_size(self) -> int:
        """The capacity: the most items the replay holds (a static Python int)."""

    @property
    @abc.abstractmethod
    def size(self) -> Int[Array, ""]:
        """The number of stored items, an int32 scalar array in `[0, max_size]`."""

    @property
    @abc.abstractmethod
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shapes and dtypes of one item, as `jax.ShapeDtypeStruct` leaves.

        Known at trace time. Wrappers (`ClusteredReplay`) check their items against it.
        """

    @abc.abstractmethod
    def add(self: _R, item: PyTree[ArrayLike]) -> _R:
        """Store one item; when full, the oldest item is overwritten.

        **Arguments:**

        - `item`: a pytree with the prototype's structure, shapes and dtypes. Python scalars are
            converted to the stored dtype; arrays must have it already.

        **Returns:** the new replay.

        **Raises:** `ValueError`/`TypeError` at trace time if `item` does not match the prototype.
        """

    @abc.abstractmethod
    def add_batch(
        self: _R, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _R:
        """Store `n` items at once; the same as `n` calls to `add`, in order.

        One vectorised write, also when `n > max_size` (then only the last `max_size` items
        remain, as after `n` adds).

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis of the same length `n`.
        - `mask`: optional boolean array of shape `(n,)`: only the items where it is `True`
            are added, in order, as if the others were not in the batch. Shapes stay static
            under `jit` while the number of valid items varies.

        **Returns:** the new replay.
        """

    @abc.abstractmethod
    def sample(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """Draw `batch_size` stored items at random, with replacement.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: a positive Python int (static: each value compiles once).

        **Returns:** the sampled items, each leaf with a leading `batch_size` axis (replays
        that return more than items document their own result type).

        **Raises:** an `eqx.error_if` error if the replay is empty.
        """

    @abc.abstractmethod
    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """`sample` without its run-time checks; `batch_size` must be a positive Python int.

        For wrappers such as `ClusteredReplay`, which draw from every wrapped replay at once
        (empty ones included) and keep only the rows they need. On an empty replay the result
        has the right structure, shapes and dtypes but meaningless values, and nothing raises.
        """

    @abc.abstractmethod
    def update(self: _R, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _R:
        """Apply `fn(item) -> item` to every stored item.

        `fn` is vectorised over the stored items and must keep each item's structure, shapes
        and dtypes (checked at trace time).
        """

    def add_and_sample(
        self: _R, items: PyTree[ArrayLike], key: PRNGKeyArray, batch_size: int
    ) -> tuple[_R, Any]:
        """`add_batch(items)`, then `sample(key, batch_size)` from the result, in one call.

        **Returns:** `(replay, batch)`.
        """
        replay = self.add_batch(items)
        return replay, replay.sample(key, batch_size)


class AbstractPrioritisedReplay(AbstractReplay):
    """A replay whose items carry priorities that the learner updates after sampling.

    Its `sample` returns the storage slots of the sampled items (as `indices`), and
    `set_priorities` takes them back. `ClusteredReplay` routes priority updates to a
    prioritised inner replay through this interface.
    """

    @abc.abstractmethod
    def set_priorities(
        self: _PR,
        indices: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
        stamps: UInt32[ArrayLike, " n"] | None = None,
    ) -> _PR:
        """Set the priorities of the items in slots `indices`.

        An index may occur more than once (a batch sampled with replacement often repeats an
        item); then the last occurrence wins.

        **Arguments:**

        - `indices`: integer array of shape `(n,)`, storage slots of stored items, as returned
            by `sample`.
        - `priorities`: array of shape `(n,)`, finite and non-negative.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are set (and checked); the others may hold anything.
        - `generations`: optional uint32 array of shape `(n,)`, the `generations` of the
            sample the indices came from: an entry whose slot has been written since that
            sample is ignored (it would give a new item the priority computed for the old one).
            `stale(indices, generations)` tells which entries those are.
        - `stamps`: the deprecated name of `generations` (removed in the next release).

        **Returns:** the new replay.

        **Raises:** an `eqx.error_if` error if an index is not a stored slot
        (`0 <= index < size`) or a priority is negative, infinite or NaN.
        """


class AbstractTrajectoryBuffer(eqx.Module):
    """The surface every trajectory buffer shares: per-env streams of steps.

    Made for actors that step environments asynchronously, such as envpool's async mode, where
    every `recv()` returns a different subset of the envs, and for rollouts collected in
    lock-step. Each of `num_envs` envs keeps its own stream of its last `max_length` steps,
    with its own write cursor, so envs advance independently. Every step has an absolute
    number in its env's stream (0 for the first step ever added; `step_count[e]` steps so far),
    which aligns periods and names sampled windows: a window is named by its *stamp*
    `(env, start)`.

    The streams are a `Streams` module (`streams`); each buffer adds its own state and its
    own way of reading them. Concrete trajectory buffers (`TrajectoryBuffer`,
    `PrioritisedTrajectoryBuffer`, `TrajectoryQueue`) are final: they are not meant to be
    subclassed.
    """

    streams: eqx.AbstractVar[Streams]

    @property
    def num_envs(self) -> int:
        """The number of envs (streams), a static Python int."""
        return self.streams.num_envs

    @property
    def max_length(self) -> int:
        """The number of steps each env keeps, a static Python int."""
        return self.streams.max_length

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return self.streams.item_spec

    @property
    def data(self) -> PyTree[Array]:
        """The stored steps: each leaf of the prototype with two leading axes `(num_envs,
        max_length)`, each row in ring order (read-only; `streams.data`)."""
        return self.streams.data

    @property
    def step_count(self) -> Int[Array, "*batch num_envs"]:
        """Per env, the number of steps ever added: an int32 array of shape `(num_envs,)`."""
        return self.streams.step_count

    @property
    def head(self) -> Int[Array, "*batch num_envs"]:
        """Each env's write cursor: the slot its next step goes to, `step_count mod
        max_length`, an int32 array of shape `(num_envs,)`."""
        return self.streams.head

    @abc.abstractmethod
    def add(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """Append one step to the stream of each listed env.

        The envs not listed are untouched: their cursors and windows stay where they are.
        An env whose stream holds `max_length` steps drops its oldest. All listed envs are
        written in one scatter, at their own cursors.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis: one step per listed env, in the order of `env_ids`.
        - `env_ids`: an integer array of shape `(n,)` of distinct env ids in
            `[0, num_envs)`, such as `info["env_id"]` from envpool's `recv()`. `None` (the
            default) means every env, in order: then `n = num_envs`.

        **Returns:** the new buffer.

        **Raises:** `ValueError`/`TypeError` at trace time if `items` does not match the
        prototype or its leading axis is not `n`; an `eqx.error_if` error if an env id is out
        of range or occurs twice, or if an env has taken `2**31 - 1` steps (the most its int32
        step count holds).
        """

    @abc.abstractmethod
    def extend(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """Append `T` consecutive steps to the stream of each listed env: the same as `T`
        calls of `add` (step `t` of every listed env in call `t`), in one write.

        For actors that collect a rollout of `T` steps from every env before storing it (a
        `lax.scan` over the env step, as in PureJaxRL or Stoix), and for flashbax's
        trajectory buffers, which add `[num_envs, T]` batches.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have two extra
            leading axes `(n, T)`: `T` steps for each listed env, oldest first. `T = 0` adds
            nothing. `T > max_length` is allowed: as after `T` adds, the last `max_length`
            steps remain.
        - `env_ids`: as for `add`; `None` (the default) means every env, in order.

        **Returns:** the new buffer.

        **Raises:** as `add`.
        """

    @abc.abstractmethod
    def with_streams(self: _T, streams: Streams) -> _T:
        """This buffer's configuration holding `streams` (of the same `num_envs`,
        `max_length` and steps): what depends on the steps is made afresh from them (an empty
        online queue, no unread step, every stored window at the largest priority).

        For buffers restored from elsewhere (`Dataset.load`, `Streams.restore`). Only the
        static configuration of `self` is used, so it may come from `eqx.filter_eval_shape`.

        **Raises:** `ValueError` at once if `streams` has another configuration.
        """

    def peek(self, env_ids: Integer[ArrayLike, "*n"] | None = None) -> PyTree[Array]:
        """The newest step of each listed env.

        Useful in an actor loop, e.g. to read the latest observation of the envs that were
        just returned.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape (a scalar
            gives one step); repeats are allowed. `None` (the default) means every env.

        **Returns:** the steps, each leaf with the shape of `env_ids` in front of the
        prototype's shape.

        **Raises:** an `eqx.error_if` error if an env id is out of range or a listed env has
        no stored step.
        """
        return check_faults(*check_newest(self.streams, env_ids, f"{type(self).__name__}.peek"))

    def stale(
        self, env_ids: Integer[ArrayLike, "*n"], starts: Integer[ArrayLike, "*n"]
    ) -> Bool[Array, "*n"]:
        """Whether the windows named by stamps `(env, start)` have lost steps since.

        A window is stale once its first step has been dropped to make room for a newer one
        (the first step goes first, so then the window's other stored steps may follow).
        Steps added after the newest step of a window do not make it stale. A prioritised
        buffer drops the priority updates of stale windows.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape.
        - `starts`: an integer array of the same shape: absolute step numbers, as
            `SequenceSample.start` and `Transitions.start` give them.

        **Returns:** a boolean array of the shape of `env_ids`.

        **Raises:** `ValueError`/`TypeError` at once if the shapes differ or an argument is not
        an integer array; an `eqx.error_if` error if an env id is out of range or a start is
        not a step its env has taken (negative, or at least its `step_count`).
        """
        call = f"{type(self).__name__}.stale"
        return check_faults(*check_stale(self.streams, env_ids, starts, call))

    def _check_streams(self, streams: Streams, call: str) -> Streams:
        """`streams` if it has this buffer's configuration, else an error quoting `call`."""
        if not isinstance(streams, Streams):
            raise TypeError(f"`{call}`: expected a `dx.Streams`, got {type(streams).__name__}.")
        mine = (self.num_envs, self.max_length, self.item_spec)
        theirs = (streams.num_envs, streams.max_length, streams.item_spec)
        if mine != theirs:
            raise ValueError(
                f"`{call}`: the streams have (num_envs, max_length, steps) = {theirs}, but "
                f"this buffer has {mine}."
            )
        return streams
