from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PyTree, Shaped

from ._checks import (
    as_prototype,
    check_fn_output,
    check_index,
    check_items,
    check_mask,
    check_positive_int,
    Prototype,
    spec_of,
)
from ._faults import check_faults, veto
from ._writes import scatter


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
        item, _ = check_items(self.item_spec, item, "CircularBuffer.push", batched=False)
        return write(self, item)[0]

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
        items, mask = check_batch(self.item_spec, items, mask, "CircularBuffer.push_batch")
        return write_batch(self, items, mask)[0]

    def pop(self: _CB) -> tuple[PyTree[Array], _CB]:
        """Remove and return the oldest item.

        **Returns:** `(item, buffer)`.

        **Raises:** an `eqx.error_if` error (`EquinoxRuntimeError`) if the buffer is empty.
        """
        item = gather_slots(self, oldest_slot(self))
        # The check guards the outputs themselves: a guard on an intermediate (the slot) can be
        # optimised away, e.g. when max_size == 1 makes the gather independent of its index.
        empty = "`CircularBuffer.pop`: cannot pop from an empty CircularBuffer"
        item, count = check_faults((item, self.count), [(self.count == 0, empty)])
        return item, eqx.tree_at(lambda b: b.count, self, jnp.maximum(count - 1, 0))

    def get(self, index: Integer[ArrayLike, ""]) -> PyTree[Array]:
        """The `index`-th oldest stored item: `get(0)` is the oldest, `get(size - 1)` the newest.

        **Raises:** `TypeError` at once unless `index` is one integer; an `eqx.error_if` error
        unless `0 <= index < size`.
        """
        call = "CircularBuffer.get(index)"
        index, bad = check_index(index, self.max_size, call, ndim=0)
        return check_faults(
            gather(self, index),
            [
                (
                    bad | (index >= self.count),
                    f"`{call}`: index out of range; it must satisfy 0 <= index < size",
                )
            ],
        )

    def update(self: _CB, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _CB:
        """Apply `fn` to every stored item.

        `fn(item) -> item` is traced once and vectorised over the slots; it must return an item
        of the same structure, shapes and dtypes (checked at trace time). Empty slots are left
        untouched.
        """
        check_fn_output(self.item_spec, fn, "CircularBuffer.update")
        return apply(self, fn)


# ---------------------------------------------------------------------------------------------
# The storage interface the replays are built on: unchecked operations, whose arguments the
# public method that calls them has already validated. Slots are physical (`data[slot]`);
# positions are logical (0 is the oldest stored item).


def check_batch(
    spec: PyTree[jax.ShapeDtypeStruct],
    items: PyTree[ArrayLike],
    mask: Bool[ArrayLike, " n"] | None,
    call: str,
) -> tuple[PyTree[Array], Bool[Array, " n"] | None]:
    """The public boundary of a batched add: `items` checked against `spec`, and `mask`."""
    items, n = check_items(spec, items, call, batched=True)
    assert n is not None
    return items, None if mask is None else check_mask(mask, n, call)


def oldest_slot(cb: CircularBuffer) -> Int[Array, ""]:
    """The slot of the oldest stored item (meaningless when empty)."""
    return ring_sub(cb.head, cb.count, cb.max_size)


def gather_slots(cb: CircularBuffer, slots: Int[ArrayLike, "*s"]) -> PyTree[Array]:
    """The items in `slots` (any shape)."""
    return jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), cb.data)


def gather(cb: CircularBuffer, positions: Int[ArrayLike, "*s"]) -> PyTree[Array]:
    """The items at logical `positions` (any shape), `0 <= position < size`."""
    return gather_slots(cb, ring_add(oldest_slot(cb), positions, cb.max_size))


def stored_mask(cb: CircularBuffer) -> Bool[Array, " max_size"]:
    """For each slot, whether it holds a stored item."""
    slot = jnp.arange(cb.max_size, dtype=jnp.int32)
    return ring_sub(slot, oldest_slot(cb), cb.max_size) < cb.count


def apply(cb: _CB, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _CB:
    """`fn` applied to every stored item (its output spec already checked)."""
    new = jax.vmap(fn)(cb.data)
    stored = stored_mask(cb)
    data = jax.tree.map(
        lambda n, o: jnp.where(stored.reshape((-1,) + (1,) * (o.ndim - 1)), n, o), new, cb.data
    )
    return eqx.tree_at(lambda b: b.data, cb, data)


def write(cb: _CB, item: PyTree[Array]) -> tuple[_CB, Int[Array, ""]]:
    """Push one item: `(buffer, the slot it went to)`. Nothing where a recording call vetoes
    its writes (`_faults.vetoing`): then the slot is `max_size`, out of range."""
    if veto() is not None:
        cb, slots = _write_masked(cb, jax.tree.map(lambda x: x[None], item), jnp.ones(1, bool))
        return cb, slots[0]
    slot = cb.head
    # Every storage write goes through `_writes.py`, whose `vmap`s merge into one batching
    # dimension (issue 38: on jax 0.5.3 nested ones transposed the whole storage every step).
    data = jax.tree.map(
        lambda x, y: scatter(x, slot, y, mode="promise_in_bounds", unique=True), cb.data, item
    )
    head = ring_add(slot, 1, cb.max_size)
    count = jnp.minimum(cb.count + 1, cb.max_size)
    return eqx.tree_at(lambda b: (b.data, b.head, b.count), cb, (data, head, count)), slot


def write_batch(
    cb: _CB, items: PyTree[Array], mask: Bool[Array, " n"] | None = None
) -> tuple[_CB, Int[Array, " n"]]:
    """Push the `n` items (those where `mask` holds), in order: `(buffer, slots)`.

    `slots[j]` is the slot item `j` went to, or `max_size` (out of range) if it was masked
    out or overwritten within the same push. The kept slots are distinct.
    """
    n = jax.tree.leaves(items)[0].shape[0]
    m = cb.max_size
    if mask is not None or veto() is not None:
        return _write_masked(cb, items, jnp.ones(n, jnp.bool_) if mask is None else mask)
    if n == 0:
        return cb, jnp.zeros(0, jnp.int32)
    # Of n pushes only the last k = min(n, m) survive; push j lands at offset j mod m from
    # head (reduced in Python: static).
    k = min(n, m)
    every = ring_add(cb.head, jnp.asarray(np.arange(n) % m, dtype=jnp.int32), m)
    kept = every[n - k :]
    data = jax.tree.map(
        lambda x, y: scatter(x, kept, y[n - k :], mode="promise_in_bounds", unique=True),
        cb.data,
        items,
    )
    head = ring_add(cb.head, n % m, m)
    count = jnp.minimum(cb.count, m - k) + k
    # Derived from `every` (not a concatenation with fresh constants), so that under `vmap`
    # the slots carry the batch's sharding like every other output.
    slots = jnp.where(np.arange(n) >= n - k, every, m)
    return eqx.tree_at(lambda b: (b.data, b.head, b.count), cb, (data, head, count)), slots


def _write_masked(
    cb: _CB, items: PyTree[Array], mask: Bool[Array, " n"]
) -> tuple[_CB, Int[Array, " n"]]:
    """`write_batch` with a mask: the number of pushes is known only at run time. A vetoed
    write (`_faults.vetoing`) masks every item out."""
    vetoed = veto()
    if vetoed is not None:
        mask = mask & ~vetoed
    m = cb.max_size
    rank = jnp.cumsum(mask, dtype=jnp.int32) - 1  # position among the valid items
    total = jnp.sum(mask, dtype=jnp.int32)
    kept = jnp.minimum(total, m)
    # Like the unmasked path: of `total` pushes only the last `kept` survive; valid item r
    # lands at offset r mod m from head.
    survives = mask & (rank >= total - kept)
    slots = jnp.where(survives, ring_add(cb.head, rank % m, m), m)
    data = jax.tree.map(lambda x, y: scatter(x, slots, y), cb.data, items)
    head = ring_add(cb.head, total % m, m)
    count = jnp.minimum(cb.count, m - kept) + kept
    return eqx.tree_at(lambda b: (b.data, b.head, b.count), cb, (data, head, count)), slots
