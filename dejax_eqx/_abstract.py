import abc
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real, UInt32


_R = TypeVar("_R", bound="AbstractReplay")
_PR = TypeVar("_PR", bound="AbstractPrioritisedReplay")


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
        - `stamps`: optional uint32 array of shape `(n,)`, the `stamps` of the sample the
            indices came from: an entry whose slot has been written since that sample is
            ignored (it would give a new item the priority computed for the old one).
            `stale(indices, stamps)` tells which entries those are.

        **Returns:** the new replay.

        **Raises:** an `eqx.error_if` error if an index is not a stored slot
        (`0 <= index < size`) or a priority is negative, infinite or NaN.
        """
