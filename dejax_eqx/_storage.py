from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, PyTree, Shaped

from ._checks import (
    as_prototype,
    check_fn_output,
    check_items,
    check_mask,
    check_positive_int,
    Prototype,
    spec_of,
)


_CB = TypeVar("_CB", bound="CircularBuffer")


# Ring arithmetic. Every index lives in [0, m) and every count in [0, m], so the helpers below
# never form a value above m (or below -m): with m < 2**31 nothing overflows int32, however many
# items pass through the buffer. See `dejax_eqx/README.md` for the invariants.


def ring_add(a: Int[ArrayLike, "*#s"], b: Int[ArrayLike, "*#s"], m: int) -> Int[Array, "*#s"]:
    """`(a + b) % m` for `0 <= a < m` and `0 <= b <= m`, without forming `a + b`."""
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    room = m - a  # in (0, m]
    return jnp.where(b >= room, b - room, a + b)


def ring_sub(a: Int[ArrayLike, "*#s"], b: Int[ArrayLike, "*#s"], m: int) -> Int[Array, "*#s"]:
    """`(a - b) % m` for `0 <= a < m` and `0 <= b <= m`."""
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    return jnp.where(a >= b, a - b, a + (m - b))


class CircularBuffer(eqx.Module):
    """A fixed-capacity ring of items: the storage under every replay.

    Holds `max_size` slots of one pytree of arrays (each leaf gains a leading `max_size` axis).
    Pushing into a full buffer overwrites the oldest item. Items are addressed logically:
    `get(0)` is the oldest stored item, `get(size - 1)` the newest.

    All methods are pure and return a new buffer; under `eqx.filter_jit(donate="all")` the
    update happens in place.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        cb = dx.CircularBuffer({"x": jnp.zeros(2)}, max_size=3)
        cb = cb.push_batch({"x": jnp.arange(8.0).reshape(4, 2)})  # 4 pushes into 3 slots
        item, cb = cb.pop()
        assert item["x"].tolist() == [2.0, 3.0]  # the first push was overwritten
        assert int(cb.size) == 2
        ```
    """

    data: PyTree[Shaped[Array, "max_size ..."]]
    """The slots: each leaf of the prototype with a leading `max_size` axis, in ring order (slot
    0 is not the oldest item once the ring has wrapped; use `get` for logical order)."""
    head: Int[Array, ""]
    count: Int[Array, ""]
    max_size: int = eqx.field(static=True)
    """The number of slots (a static Python int)."""

    def __init__(self, prototype: Prototype, max_size: int):
        """**Arguments:**

        - `prototype`: one item, a pytree of arrays (or Python scalars). Only its structure,
            shapes and dtypes are used; stored items must match them exactly.
        - `max_size`: the number of slots, a positive Python int below `2**31`.
        """
        self.max_size = check_positive_int(max_size, "CircularBuffer(max_size=...)")
        spec = as_prototype(prototype, "CircularBuffer(prototype=...)")
        self.data = jax.tree.map(lambda s: jnp.zeros((self.max_size, *s.shape), s.dtype), spec)
        # Write position in [0, max_size) and number of stored items in [0, max_size].
        self.head = jnp.asarray(0, jnp.int32)
        self.count = jnp.asarray(0, jnp.int32)

    @property
    def size(self) -> Int[Array, ""]:
        """The number of stored items, in `[0, max_size]`."""
        return self.count

    @property
    def is_empty(self) -> Bool[Array, ""]:
        """Whether no item is stored."""
        return self.count == 0

    @property
    def is_full(self) -> Bool[Array, ""]:
        """Whether `max_size` items are stored (the next push overwrites the oldest)."""
        return self.count == self.max_size

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one item, as `jax.ShapeDtypeStruct` leaves."""
        return spec_of(self.data)

    def push(self: _CB, item: PyTree[ArrayLike]) -> _CB:
        """Store one item, overwriting the oldest if the buffer is full.

        **Arguments:**

        - `item`: a pytree with the prototype's structure, shapes and dtypes.

        **Returns:** the new buffer.
        """
        return self._push(item, "CircularBuffer.push")

    def push_batch(
        self: _CB, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _CB:
        """Store `n` items at once; the same as `n` calls to `push`, in order.

        One vectorised write. When `n > max_size` only the last `max_size` items remain, as
        after `n` pushes.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis of length `n` (the same `n` for every leaf; `n = 0` is allowed).
        - `mask`: optional boolean array of shape `(n,)`. Only the items where it is `True` are
            stored, as if those alone had been pushed, in order. Useful to keep shapes static
            under `jit` when the number of valid items varies.

        **Returns:** the new buffer.
        """
        return self._push_batch(items, "CircularBuffer.push_batch", mask)

    def pop(self: _CB) -> tuple[PyTree[Array], _CB]:
        """Remove and return the oldest item.

        **Returns:** `(item, buffer)`.

        **Raises:** an `eqx.error_if` error (`EquinoxRuntimeError`) if the buffer is empty.
        """
        item = jax.tree.map(lambda x: x[self._oldest_slot()], self.data)
        # The check guards the outputs themselves: a guard on an intermediate (the slot) can be
        # optimised away, e.g. when max_size == 1 makes the gather independent of its index.
        item, count = eqx.error_if(
            (item, self.count), self.count == 0, "cannot pop from an empty CircularBuffer"
        )
        return item, eqx.tree_at(lambda b: b.count, self, count - 1)

    def get(self, index: Int[ArrayLike, ""]) -> PyTree[Array]:
        """The `index`-th oldest stored item: `get(0)` is the oldest, `get(size - 1)` the newest.

        **Raises:** an `eqx.error_if` error unless `0 <= index < size`.
        """
        index = jnp.asarray(index)
        if index.shape != () or not jnp.issubdtype(index.dtype, jnp.integer):
            raise TypeError(
                "`CircularBuffer.get(index)` takes one integer scalar, got "
                f"{index.dtype}{list(index.shape)}."
            )
        index = index.astype(jnp.int32)
        return eqx.error_if(
            self._gather(index),
            (index < 0) | (index >= self.count),
            "`CircularBuffer.get(index)`: index out of range; it must satisfy 0 <= index < size",
        )

    def update(self: _CB, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _CB:
        """Apply `fn` to every stored item.

        `fn(item) -> item` is traced once and vectorised over the slots; it must return an item
        of the same structure, shapes and dtypes (checked at trace time). Empty slots are left
        untouched.
        """
        return self._update(fn, "CircularBuffer.update")

    # The methods below are the storage interface the replays are built on. `call` names the
    # public method for error messages. Index helpers assume valid arguments and do no checks.

    def _update(self: _CB, fn: Callable[[PyTree[Array]], PyTree[Array]], call: str) -> _CB:
        check_fn_output(self.item_spec, fn, call)
        new = jax.vmap(fn)(self.data)
        stored = self._stored_mask()
        data = jax.tree.map(
            lambda n, o: jnp.where(stored.reshape((-1,) + (1,) * (o.ndim - 1)), n, o),
            new,
            self.data,
        )
        return eqx.tree_at(lambda b: b.data, self, data)

    def _oldest_slot(self, count: Int[ArrayLike, ""] | None = None) -> Int[Array, ""]:
        """The slot of the oldest stored item (meaningless when empty)."""
        return ring_sub(self.head, self.count if count is None else count, self.max_size)

    def _slots(self, index: Int[ArrayLike, "*s"]) -> Int[Array, "*s"]:
        """The slots of the `index`-th oldest items, for `0 <= index < size`."""
        return ring_add(self._oldest_slot(), index, self.max_size)

    def _gather(self, index: Int[ArrayLike, "*s"]) -> PyTree[Array]:
        """The items at logical positions `index` (any shape), unchecked."""
        return self._gather_slots(self._slots(index))

    def _gather_slots(self, slots: Int[ArrayLike, "*s"]) -> PyTree[Array]:
        """The items in physical `slots` (any shape), unchecked."""
        return jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), self.data)

    def _stored_mask(self) -> Bool[Array, " max_size"]:
        """For each slot, whether it holds a stored item."""
        slot = jnp.arange(self.max_size, dtype=jnp.int32)
        return ring_sub(slot, self._oldest_slot(), self.max_size) < self.count

    def _write_slots(self, n: int) -> Int[Array, " k"]:
        """The slots the next `n` pushes would write to and keep: the last `min(n, max_size)`."""
        m = self.max_size
        k = min(n, m)
        # Offsets (from head) of the pushes that survive, reduced mod m in Python (static).
        offsets = jnp.asarray(np.arange(n - k, n) % m, dtype=jnp.int32)
        return ring_add(self.head, offsets, m)

    def _push(self: _CB, item: PyTree[ArrayLike], call: str) -> _CB:
        item, _ = check_items(self.item_spec, item, call, batched=False)
        data = jax.tree.map(lambda x, y: x.at[self.head].set(y), self.data, item)
        head = ring_add(self.head, 1, self.max_size)
        count = jnp.minimum(self.count + 1, self.max_size)
        return eqx.tree_at(lambda b: (b.data, b.head, b.count), self, (data, head, count))

    def _push_batch(
        self: _CB, items: PyTree[ArrayLike], call: str, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _CB:
        items, n = check_items(self.item_spec, items, call, batched=True)
        assert n is not None
        if mask is not None:
            return self._push_masked(items, check_mask(mask, n, call))
        if n == 0:
            return self
        m = self.max_size
        k = min(n, m)
        slots = self._write_slots(n)
        data = jax.tree.map(
            lambda x, y: x.at[slots].set(y[n - k :], unique_indices=True, mode="promise_in_bounds"),
            self.data,
            items,
        )
        head = ring_add(self.head, n % m, m)
        count = jnp.minimum(self.count, m - k) + k
        return eqx.tree_at(lambda b: (b.data, b.head, b.count), self, (data, head, count))

    def _masked_slots(self, mask: Bool[Array, " n"]) -> Int[Array, " n"]:
        """For a masked push of `n` items, the slot each item ends up in.

        Items that are masked out, or overwritten within the same push, get the out-of-range
        slot `max_size`; the surviving slots are distinct.
        """
        m = self.max_size
        rank = jnp.cumsum(mask, dtype=jnp.int32) - 1  # position among the valid items
        total = jnp.sum(mask, dtype=jnp.int32)
        kept = jnp.minimum(total, m)
        # Like the unmasked path: of `total` pushes only the last `kept` survive; valid item r
        # lands at offset r mod m from head.
        survives = mask & (rank >= total - kept)
        return jnp.where(survives, ring_add(self.head, rank % m, m), m)

    def _push_masked(self: _CB, items: PyTree[Array], mask: Bool[Array, " n"]) -> _CB:
        """Push the items where `mask` holds, in order; the count is known only at run time."""
        m = self.max_size
        total = jnp.sum(mask, dtype=jnp.int32)
        kept = jnp.minimum(total, m)
        slots = self._masked_slots(mask)  # the scatter drops the out-of-range slot m
        data = jax.tree.map(lambda x, y: x.at[slots].set(y, mode="drop"), self.data, items)
        head = ring_add(self.head, total % m, m)
        count = jnp.minimum(self.count, m - kept) + kept
        return eqx.tree_at(lambda b: (b.data, b.head, b.count), self, (data, head, count))
