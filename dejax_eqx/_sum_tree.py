import functools
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, Real

from ._checks import (
    as_float,
    check_float_dtype,
    check_index,
    check_mask,
    check_positive_int,
    check_vector,
)
from ._faults import check_faults
from ._writes import scatter


_T = TypeVar("_T", bound="SumTree")

# Children per internal node. A wider tree has fewer levels, so fewer sequential gathers and
# scatters per operation, at the price of reading more values per level (one contiguous row).
# 8 was fastest on CPU for 10k to 1M leaves; see `dejax_eqx/README.md`.
_BRANCHING = 8

# Node ids must fit int32: 2**30 leaves need fewer than 1.25 * 2**30 nodes.
MAX_CAPACITY = 2**30

# XLA's CPU compiler splits a fused loop across threads once it estimates that the loop reads
# 512 KiB or more, and a gather counts its whole operand however few values it reads. A tree
# operation reads a few rows per level, so the hand-off between threads would cost far more than
# the reads (about 2 µs per level on 2 cores, against 0.1 µs). Every gather therefore reads a
# static slice of the nodes: each level that is large on its own through a slice of just that
# level (those levels are unrolled), and all the levels above them, which together stay under
# this size, through one slice shared by a loop over those levels. See `dejax_eqx/README.md`.
_SMALL_BYTES = 256 << 10


@functools.cache
def _layout(capacity: int) -> tuple[tuple[int, ...], int]:
    """The offset of each level in the flat array (leaves first, the root last) and its size.

    Level 0 holds the leaves; node `j` of level `l + 1` is the sum of nodes
    `[k·j, k·j + k)` of level `l` (`k` = `_BRANCHING`). Each level below the root is padded
    with zeros to a multiple of `k` so that every node has exactly `k` children.
    """
    k = _BRANCHING
    counts = [capacity]
    while counts[-1] > 1:
        counts.append(-(-counts[-1] // k))
    sizes = [k * c for c in counts[1:]] + [1]
    offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]]))
    return offsets, sum(sizes)


@functools.cache
def _split(capacity: int, itemsize: int) -> int:
    """The lowest level from which on all the nodes, up to the root, fit in `_SMALL_BYTES`."""
    offsets, num_nodes = _layout(capacity)
    return next(
        level
        for level, offset in enumerate(offsets)
        if (num_nodes - offset) * itemsize < _SMALL_BYTES or level == len(offsets) - 1
    )


def _exact_positions(dtype: Any) -> int:
    """The largest batch whose entry positions `0 .. n - 1` the float `dtype` holds exactly."""
    return 2 ** (jnp.finfo(dtype).nmant + 1)


def _rows(nodes: Float[Array, " nodes"], starts: Int[Array, " n"]) -> Float[Array, "n k"]:
    """The `k` consecutive nodes from each start: one gather of contiguous rows."""
    return jax.vmap(lambda s: jax.lax.dynamic_slice(nodes, (s,), (_BRANCHING,)))(starts)


def _children(
    nodes: Float[Array, " nodes"],
    capacity: int,
    level: int | Int[Array, ""],
    node: Int[Array, " n"],
) -> Float[Array, "n k"]:
    """The `k` children of each `node` of `level` (so they lie on `level - 1`).

    A Python int `level` (an unrolled large level) reads through a slice of level `level - 1`
    alone; a traced one (the loop over the small top of the tree) through the slice from
    level `_split` up, which stays under `_SMALL_BYTES` (see there)."""
    offsets, _ = _layout(capacity)
    if isinstance(level, int):
        return _rows(nodes[offsets[level - 1] : offsets[level]], _BRANCHING * node)
    base = offsets[_split(capacity, nodes.dtype.itemsize)]
    first = jnp.asarray(offsets, jnp.int32)[level - 1] - base
    return _rows(nodes[base:], first + _BRANCHING * node)


class SumTree(eqx.Module):
    """A tree of non-negative values in one flat array, for sampling in proportion to them.

    Leaf `i` (for `0 <= i < capacity`) holds a value; every internal node holds the sum of its
    children, so the root holds the total. Setting a batch of leaves and finding a batch of
    prefix sums both cost O(batch · log capacity) time and memory, whatever the capacity.

    The tree is an immutable `eqx.Module`: `set` returns a new tree, which
    `eqx.filter_jit(donate="all")` updates in place. It is the index structure of
    `PrioritisedReplay`, and is usable on its own.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        tree = dx.SumTree(capacity=4)
        tree = tree.set(jnp.array([0, 2, 3]), jnp.array([1.0, 3.0, 0.0]))
        assert float(tree.total) == 4.0
        # Leaf i covers [sum of the leaves before i, that + leaf i): [0, 1) and [1, 4) here.
        assert tree.find(jnp.array([0.5, 1.0, 3.9])).tolist() == [0, 2, 2]
        ```
    """

    nodes: Float[Array, " nodes"]
    capacity: int = eqx.field(static=True)

    def __init__(self, capacity: int, dtype: Any = jnp.float32):
        """**Arguments:**

        - `capacity`: the number of leaves, a positive Python int up to `2**30`.
        - `dtype`: `jnp.float32` (default) or `jnp.float64` (which needs
            `jax_enable_x64`). All leaves start at zero.
        """
        self.capacity = check_positive_int(capacity, "SumTree(capacity=...)", maximum=MAX_CAPACITY)
        dtype = check_float_dtype(dtype, "SumTree(dtype=...)")
        self.nodes = jnp.zeros(_layout(self.capacity)[1], dtype)

    @property
    def total(self) -> Float[Array, ""]:
        """The sum of all leaves (the root)."""
        return self.nodes[-1]

    @property
    def leaves(self) -> Float[Array, " capacity"]:
        """The `capacity` leaf values."""
        return self.nodes[: self.capacity]

    def get(self, indices: Integer[ArrayLike, "*s"]) -> Float[Array, "*s"]:
        """The values of leaves `indices` (an integer array of any shape, or a Python int).

        **Raises:** an `eqx.error_if` error unless every index is in `[0, capacity)`.
        """
        call = "SumTree.get(indices)"
        index, bad = check_index(indices, self.capacity, call)
        message = f"`{call}`: index out of range; every index must satisfy 0 <= index < capacity"
        return check_faults(jnp.take(self.nodes, index, mode="clip"), [(bad, message)])

    def set(
        self: _T,
        indices: Integer[ArrayLike, " n"],
        values: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _T:
        """Set leaves `indices[j]` to `values[j]` and update their ancestors.

        One gather and one scatter per level of the tree: O(n · log capacity) work and memory,
        with no sequential loop over the batch.

        When an index occurs more than once, the last occurrence wins, as in a loop of single
        updates. (XLA leaves the order of duplicate writes in a scatter unspecified, so the
        duplicates are resolved explicitly before the write.)

        **Arguments:**

        - `indices`: integer array of shape `(n,)`, each in `[0, capacity)`.
        - `values`: array of shape `(n,)`, each finite and non-negative; converted to the
            tree's dtype from their own (an int64 `2**32` is `4294967296.0`, not wrapped).
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are set (then the last valid occurrence of an index wins).

        **Returns:** the new tree.

        **Raises:** an `eqx.error_if` error if an index is out of range or a value is negative,
        infinite, NaN or too large for the tree's dtype (among the entries that `mask` keeps).
        """
        call = "SumTree.set"
        index, bad_index = check_index(indices, self.capacity, f"{call}(indices=...)", ndim=1)
        n = index.shape[0]
        value = check_vector(values, n, call, "values")
        keep = None if mask is None else check_mask(mask, n, call)
        valid = jnp.ones(n, jnp.bool_) if keep is None else keep
        value, faults = as_float(value, self.nodes.dtype, call, "values", mask=keep)
        # Guard the scatter's operands (small, and the new tree cannot be built without them),
        # not the tree itself: threading the whole tree through a check could copy it.
        index, value = check_faults(
            (index, value),
            [
                *faults,
                (
                    valid & bad_index,
                    f"`{call}`: index out of range; every index must satisfy 0 <= index < capacity",
                ),
                (
                    valid & ~(jnp.isfinite(value) & (value >= 0)),
                    f"`{call}`: values must be finite and non-negative",
                ),
            ],
        )
        return set_leaves(self, index, value, mask=keep)

    def find(self, values: Real[ArrayLike, " n"]) -> Int[Array, " n"]:
        """For each value `u`, the leaf `i` whose interval `[prefix_i, prefix_i + leaf_i)`
        contains `u`, where `prefix_i` is the sum of the leaves before `i`.

        With `u` drawn uniformly from `[0, total)`, leaf `i` is found with probability
        `leaf_i / total` (up to rounding). A leaf of value zero is never returned, even when
        rounding pushes `u` to or past `total`: such a `u` finds the last positive leaf (and a
        negative `u` the first). On an all-zero tree the result is meaningless (but in range).

        O(n · log capacity): one gather per level.

        **Arguments:**

        - `values`: array of shape `(n,)`, converted to the tree's dtype.

        **Returns:** int32 leaf indices of shape `(n,)`, in `[0, capacity)`.

        **Raises:** an `eqx.error_if` error for a finite value too large for the tree's
        dtype (a NumPy float64 past the float32 range).
        """
        call = "SumTree.find"
        values = check_vector(values, None, call, "values")
        values, faults = as_float(values, self.nodes.dtype, call, "values")
        return check_faults(find_leaves(self, values)[0], faults)


# ---------------------------------------------------------------------------------------------
# Unchecked operations, for the replays that validate their own arguments.


def set_leaves(
    tree: _T,
    indices: Int[Array, " n"],
    values: Float[Array, " n"],
    *,
    mask: Bool[Array, " n"] | None = None,
    unique: bool = False,
) -> _T:
    """`SumTree.set` without checks. Out-of-range and masked-out entries are dropped. `unique`
    promises that the kept indices are distinct, which skips resolving duplicates.

    If `indices` or `values` were computed from this same tree (a draw, its total), let
    them pass through a check first, as `SumTree.set` and `PrioritisedReplay` do: the check's
    conditional orders those reads before the first write. Without it XLA may copy the
    whole tree so that the old values stay readable.
    """
    n = indices.shape[0]
    if n == 0:
        return tree
    cap = tree.capacity
    offsets, num_nodes = _layout(cap)
    keep = (indices >= 0) & (indices < cap)
    if mask is not None:
        keep = keep & mask
    drop = jnp.where(keep, indices, num_nodes)  # num_nodes: out of range, dropped
    # The writes go through `_writes.py`: one unbatched scatter under `vmap` (issue 38).
    if unique:
        nodes = scatter(tree.nodes, drop, values)
    elif n <= _exact_positions(tree.nodes.dtype):
        # Resolve duplicates with the leaves about to be overwritten as scratch space: a
        # scatter-min of -(position + 1) (exact in this float dtype, and below every leaf,
        # as leaves are non-negative) leaves at each leaf the marker of its last
        # occurrence. A scatter-min is order-independent, so this is deterministic on
        # every backend, and several times faster than sorting the batch on CPU.
        marker = -1 - jnp.arange(n, dtype=tree.nodes.dtype)  # -(position + 1)
        nodes = scatter(tree.nodes, drop, marker, "min")
        last = jnp.take(nodes, drop, mode="fill", fill_value=0) == marker
        nodes = scatter(nodes, jnp.where(last, drop, num_nodes), values)
    else:
        # Too many entries for exact positions: stable sort by index (dropped entries
        # last), then the last entry of each run of equal indices is the last occurrence.
        key = jnp.where(keep, indices, cap)
        order = jnp.argsort(key, stable=True)
        indices, values = key[order], values[order]
        last = jnp.append(indices[1:] != indices[:-1], True) & (indices < cap)
        nodes = scatter(tree.nodes, jnp.where(last, indices, num_nodes), values)
    if len(offsets) == 1:  # capacity 1: the leaf is the root
        return eqx.tree_at(lambda t: t.nodes, tree, nodes)

    # Recompute each ancestor from its children, level by level. An ancestor reached by
    # several entries is written several times with the same value, so the order of those
    # writes does not matter; dropped entries recompute some ancestor, which is harmless.
    # The levels whose children are on a large level, unrolled; then the small top of the
    # tree in a loop (a smaller program, and faster on CPU when measured; see
    # `dejax_eqx/README.md`).
    top = len(offsets) - 1
    split = _split(cap, tree.nodes.dtype.itemsize)
    carry = (nodes, jnp.clip(indices, 0, cap - 1))
    for lvl in range(1, split + 1):
        carry = _sum_level(lvl, carry, cap)
    if split < top:
        carry = _sum_levels(carry, cap, split + 1, top + 1)
    return eqx.tree_at(lambda t: t.nodes, tree, carry[0])


def _sum_level(
    lvl: int | Int[Array, ""], carry: tuple[Array, Array], capacity: int
) -> tuple[Array, Array]:
    """Level `lvl` of `set_leaves`: the parents of `node` (on level `lvl - 1`), recomputed."""
    nodes, node = carry
    node = node // _BRANCHING
    offsets, _ = _layout(capacity)
    sums = jnp.sum(_children(nodes, capacity, lvl, node), axis=1)
    offset = offsets[lvl] if isinstance(lvl, int) else jnp.asarray(offsets, jnp.int32)[lvl]
    return scatter(nodes, offset + node, sums, mode="promise_in_bounds"), node


# The two loops over the small top of the tree are jitted functions of module level, with the
# tree's shape static: called eagerly, a loop whose body is a closure made per call compiles
# again on every call (60-80 ms each, measured); inside a traced function the `jit` is inlined.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sum_levels(
    carry: tuple[Array, Array], capacity: int, first: int, stop: int
) -> tuple[Array, Array]:
    """`_sum_level` for the levels `first .. stop - 1`, in a loop."""
    return jax.lax.fori_loop(first, stop, functools.partial(_sum_level, capacity=capacity), carry)


def _descend(
    children: Float[Array, "n k"], node: Int[Array, " n"], u: Float[Array, " n"]
) -> tuple[Int[Array, " n"], Float[Array, " n"], Float[Array, " n"]]:
    """One level of `find`: the child of `node` whose range holds `u` (relative to the first
    leaf below `node`), `u` relative to that child, and the child's value."""
    # Take the first positive child whose range ends after u; if rounding put u past the end
    # of every child, the last positive child. Either way a positive child: a positive node
    # has one (its value is their sum), so the leaf reached is positive.
    found = jnp.zeros(u.shape, jnp.bool_)
    choice = last = jnp.zeros(u.shape, jnp.int32)
    before = before_last = end = value = value_last = jnp.zeros_like(u)
    for c in range(_BRANCHING):
        x = children[:, c]
        positive = x > 0
        take = ~found & positive & (u < end + x)
        choice = jnp.where(take, c, choice)
        before = jnp.where(take, end, before)
        value = jnp.where(take, x, value)
        found = found | take
        last = jnp.where(positive, c, last)
        before_last = jnp.where(positive, end, before_last)
        value_last = jnp.where(positive, x, value_last)
        end = end + x
    node = _BRANCHING * node + jnp.where(found, choice, last)
    u = u - jnp.where(found, before, before_last)
    return node, u, jnp.where(found, value, value_last)


def _find_level(
    nodes: Float[Array, " nodes"],
    capacity: int,
    lvl: int | Int[Array, ""],
    carry: tuple[Array, Array, Array],
) -> tuple[Array, Array, Array]:
    """One step of `find_leaves`: from the nodes of level `lvl` to their children."""
    node, u, _ = carry
    return _descend(_children(nodes, capacity, lvl, node), node, u)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _find_levels(
    nodes: Float[Array, " nodes"],
    carry: tuple[Array, Array, Array],
    capacity: int,
    top: int,
    split: int,
) -> tuple[Array, Array, Array]:
    """`_find_level` from level `top` down to `split + 1`, in a loop (see `_sum_levels`)."""
    return jax.lax.fori_loop(
        0, top - split, lambda i, c: _find_level(nodes, capacity, top - i, c), carry
    )


def find_leaves(
    tree: SumTree, values: Float[Array, " n"]
) -> tuple[Int[Array, " n"], Float[Array, " n"]]:
    """`SumTree.find` without checks, and the value of each leaf found."""
    top = len(_layout(tree.capacity)[0]) - 1
    # The carry starts with the varying manual axes of both the tree and the values (inside
    # `shard_map`, a loop's carry must keep its type, and the body mixes the two).
    zero = jnp.zeros_like(values) + jnp.zeros_like(tree.total)
    if top == 0:  # capacity 1: the leaf is the root
        return zero.astype(jnp.int32), tree.total + zero
    split = _split(tree.capacity, tree.nodes.dtype.itemsize)
    # From the root down the small top of the tree in a loop (`lvl` counts down from `top`
    # to `split + 1`), then one unrolled step per large level.
    carry = (zero.astype(jnp.int32), values + zero, zero)
    if split < top:
        carry = _find_levels(tree.nodes, carry, tree.capacity, top, split)
    for lvl in range(split, 0, -1):
        carry = _find_level(tree.nodes, tree.capacity, lvl, carry)
    node, _, value = carry
    # Only an all-zero tree can end on padding past the last leaf (its value is then 0).
    return jnp.minimum(node, tree.capacity - 1), value


def draw_leaves(
    tree: SumTree, key: Array, batch_size: int, stratified: bool
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """`batch_size` leaves drawn in proportion to their values, and the probability of each in
    one i.i.d. draw. No checks: on a tree whose total is 0 the leaves are meaningless (in
    range) and the probabilities 0.

    `stratified`: one draw from each of `batch_size` equal slices of the total, else i.i.d.
    """
    total = tree.total
    dtype = total.dtype
    uniform = jax.random.uniform(key, (batch_size,), dtype)
    if stratified:
        start = jnp.arange(batch_size, dtype=dtype)
        leaves, value = find_leaves(tree, (start + uniform) * (total / batch_size))
    else:
        # Unsorted: sorting the targets first (so that neighbouring draws share cache lines)
        # cost more on CPU than it saved, 110 µs against 30 µs for 256 draws from 1M leaves.
        leaves, value = find_leaves(tree, uniform * total)
    positive = total > 0
    # No NaN even on an all-zero tree (wrappers draw from those too, then discard the rows).
    return leaves, jnp.where(positive, value / jnp.where(positive, total, 1), 0)
