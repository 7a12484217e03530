"""flashbax 0.1.3's `sum_tree`, as a read-only view of a `dx.SumTree`.

flashbax keeps its priorities in a binary tree stored root first: level `d` (the root is level
0) holds `2**d` nodes from index `2**d - 1`, and the leaves, padded with zeros to
`2**tree_depth`, form the last level. dejax_eqx's `SumTree` is laid out differently (wider
nodes, leaves first), so `SumTreeState.nodes` rebuilds flashbax's array from the leaves when
read. Nothing here writes: priorities change through the buffer's `set_priorities`, so
flashbax's writers (`init`, `set_non_batched`, `set_batch_bincount`, `set_batch_scan`) are not
here. The draws (`sample`, `stratified_sample`) are `dx.SumTree.find`'s, which never returns a
leaf of value 0.

The state is an `eqx.Module`, so it goes through `jax.pmap`, `jax.jit` and `jax.vmap` as a
pytree, and each of its fields also reads a stack of states (leading axes).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray, Real

from .... import SumTree
from ....internal import check_faults, check_index, check_positive_int, Fault, priority_mass


# The deepest level a tree of int32 node positions has room for: 2**31 - 1 nodes in all.
_MAX_DEPTH = 30


def get_tree_depth(capacity: int) -> int:
    """The number of levels below the root of a binary tree with at least `capacity` leaves:
    the least `d` with `2**d >= capacity`.

    **Raises:** `ValueError`/`TypeError` if `capacity` is not a positive Python int (flashbax
    raised NumPy's `OverflowError` for 0 and `ValueError` for a negative one, from a float
    logarithm that also rounds above `2**53`)."""
    capacity = check_positive_int(capacity, "get_tree_depth(capacity=...)")
    return (capacity - 1).bit_length()


def get_tree_index(
    depth_level: Integer[ArrayLike, "*s"], node_index: Integer[ArrayLike, "*s"]
) -> Int[Array, "*s"]:
    """The position in `SumTreeState.nodes` of node `node_index` of level `depth_level`:
    `2**depth_level - 1 + node_index`.

    **Raises:** an `eqx.error_if` error for a level outside `[0, 30]` or a node outside
    `[0, 2**depth_level)`, where flashbax returned the position of a node of another level
    (or JAX's error for a negative level); `TypeError` for a non-integer argument."""
    call = "sum_tree.get_tree_index"
    depth, bad_depth = check_index(depth_level, _MAX_DEPTH + 1, f"{call}(depth_level=...)")
    node, bad_node = check_index(node_index, 2**_MAX_DEPTH, f"{call}(node_index=...)")
    width = jnp.left_shift(jnp.int32(1), jnp.where(bad_depth, 0, depth))
    bad_node = bad_node | (node >= width)
    return check_faults(
        width - 1 + node,
        [
            (bad_depth, f"`{call}`: depth_level must be in [0, {_MAX_DEPTH}] (the root is 0)"),
            (
                bad_node,
                f"`{call}`: node_index must be in [0, 2**depth_level): level d holds 2**d nodes",
            ),
        ],
    )


class SumTreeState(eqx.Module):
    """The priorities of a prioritised buffer, as flashbax's sum-tree state shows them.

    **Fields:** `tree`, the buffer's `dx.SumTree` (its leaves are the masses `p ** α`),
    `max_priority`, the largest priority recorded (at least 1), and `priority_exponent` (`α`).

    **Properties (flashbax's fields):** `nodes`, `max_recorded_priority`, `tree_depth`,
    `capacity`.
    """

    tree: SumTree
    max_priority: Float[Array, "*d"]
    priority_exponent: float = eqx.field(static=True)

    @property
    def capacity(self) -> int:
        """The number of leaves (items) the buffer has."""
        return self.tree.capacity

    @property
    def tree_depth(self) -> int:
        """The levels below the root: the leaves lie on level `tree_depth`."""
        return get_tree_depth(self.capacity)

    @property
    def max_recorded_priority(self) -> Float[Array, "*d"]:
        """The mass `max_priority ** α` that a newly added item gets."""
        return priority_mass(self.max_priority, self.priority_exponent)

    @property
    def leaves(self) -> Float[Array, "*d leaves"]:
        """The leaves, padded with zeros to `2**tree_depth`."""
        leaves = self.tree.nodes[..., : self.capacity]
        padding = [(0, 0)] * (leaves.ndim - 1) + [(0, 2**self.tree_depth - self.capacity)]
        return jnp.pad(leaves, padding)

    @property
    def nodes(self) -> Float[Array, "*d nodes"]:
        """flashbax's array of `2**(tree_depth + 1) - 1` nodes: the root at 0, then each
        level in turn, every node the sum of its two children."""
        levels = [self.leaves]
        while levels[-1].shape[-1] > 1:
            below = levels[-1]
            levels.append(below.reshape(*below.shape[:-1], -1, 2).sum(axis=-1))
        return jnp.concatenate(levels[::-1], axis=-1)


def _leaf_values(
    state: SumTreeState, indices: Integer[ArrayLike, "*s"], call: str
) -> tuple[Float[Array, "*s"], list[Fault]]:
    """The values of leaves `indices` of one state, and the fault of an index that is no
    item's leaf (outside `[0, capacity)`: flashbax read the padding's zeros, or past the end of
    its node array, without a word). Checked in the index's own dtype (`check_index`)."""
    leaves, bad = check_index(indices, state.capacity, f"{call}(node_index=...)")
    values = jnp.take(state.tree.leaves, leaves, mode="fill", fill_value=0)
    message = (
        f"`{call}`: index out of range; every index must satisfy 0 <= index < capacity = "
        f"{state.capacity} (an item's leaf, as a sample's `indices`)"
    )
    return values, [(bad, message)]


def get(state: SumTreeState, node_index: Integer[ArrayLike, "*s"]) -> Float[Array, "*s"]:
    """The values (masses `p ** α`) of leaves `node_index` (the buffer's `indices`) of one
    state; map it (`jax.pmap`, `jax.vmap`) over a stack of states.

    **Raises:** an `eqx.error_if` error for an index outside `[0, capacity)`."""
    return check_faults(*_leaf_values(state, node_index, "sum_tree.get"))


def get_batch(state: SumTreeState, node_indices: Integer[ArrayLike, " n"]) -> Float[Array, " n"]:
    """The values of a batch of leaves, as `get`."""
    return check_faults(*_leaf_values(state, node_indices, "sum_tree.get_batch"))


def get_probability(
    state: SumTreeState, node_index: Integer[ArrayLike, "*s"]
) -> Float[Array, "*s"]:
    """The probability of drawing leaves `node_index` in one draw: value over total.

    **Raises:** an `eqx.error_if` error for an index outside `[0, capacity)`, or if every
    leaf is 0 (flashbax returned `0 / 0 = NaN`)."""
    call = "sum_tree.get_probability"
    values, faults = _leaf_values(state, node_index, call)
    total = state.tree.total
    empty = (
        ~(total > 0),
        f"`{call}`: every leaf is 0 (nothing stored yet, or every priority 0), so no leaf "
        "has a probability",
    )
    return check_faults(values / jnp.where(total > 0, total, 1), [*faults, empty])


def _find(
    state: SumTreeState, fractions: Float[Array, " n"], call: str, faults: list[Fault]
) -> Int[Array, " n"]:
    """The leaves whose intervals of the running sum hold `fractions * total`, after `faults`
    (those of the fractions) and that of a tree with nothing to draw."""
    total = state.tree.total
    empty = (
        ~(total > 0),
        f"`{call}`: every leaf is 0 (nothing stored yet, or every priority 0), so no leaf "
        "can be drawn",
    )
    return check_faults(state.tree.find(fractions * total), [*faults, empty])


def _query(query_value: object, dtype: np.dtype, call: str) -> tuple[Float[Array, ""], list[Fault]]:
    """`query_value`, a real scalar in `[0, 1]`, as a `dtype` array, and its fault.

    flashbax documents the query as a float in `[0, 1]` and draws its own in `[0, 1)`; 1 is
    the end of the last interval, drawn here as the last leaf of positive value. A Python or
    NumPy value is checked at once (`ValueError`), a JAX array, which may be traced, as a
    fault. flashbax took any value, and answered an end leaf for one outside `[0, 1]` or NaN.
    """
    where = f"{call}(query_value=...)"
    if isinstance(query_value, bool | np.bool_) or not isinstance(
        query_value, jax.Array | np.ndarray | np.generic | int | float
    ):
        raise TypeError(
            f"`{where}` must be a real scalar (a Python float, a NumPy or JAX scalar), got "
            f"{query_value!r} of type {type(query_value).__name__}."
        )
    shape = tuple(np.shape(query_value))
    if shape != ():
        raise ValueError(f"`{where}` must be a scalar, got shape {shape}.")
    if isinstance(query_value, jax.Array | np.ndarray | np.generic):
        kind = np.dtype(query_value.dtype)
        if not (jnp.issubdtype(kind, jnp.integer) or jnp.issubdtype(kind, jnp.floating)):
            raise TypeError(f"`{where}` must be a real number, got dtype {kind}.")
    if isinstance(query_value, jax.Array):
        outside = ~((query_value >= 0) & (query_value <= 1))
        message = f"`{call}`: query_value must be in [0, 1] (a fraction of the total), not NaN"
        return query_value.astype(dtype), [(outside, message)]
    # In the value's own type, before any cast: a float64 just past 1 is not rounded into range.
    if isinstance(query_value, int | float):
        inside = 0 <= query_value <= 1
    else:
        value = np.asarray(query_value)
        inside = bool(np.greater_equal(value, 0) & np.less_equal(value, 1))
    if not inside:
        raise ValueError(
            f"`{where}` must be in [0, 1] (a fraction of the total), got {query_value}."
        )
    return jnp.asarray(query_value, dtype), []


def sample(
    state: SumTreeState,
    rng_key: PRNGKeyArray | None = None,
    query_value: Real[ArrayLike, ""] | None = None,
) -> Int[Array, ""]:
    """One leaf of one state, drawn with probability `value / total`: the leaf whose interval
    of the running sum holds `query_value * total`, `query_value` in `[0, 1]` (drawn
    uniformly with `rng_key` if not given).

    Where rounding puts the query on or past the end of a leaf's interval, flashbax's float32
    descent may return a leaf of value 0 (even a padding leaf past the capacity); this never
    does (`dx.SumTree.find`).

    **Raises:** `ValueError` if neither `rng_key` nor `query_value` is given; an
    `eqx.error_if` error if every leaf is 0 (flashbax returned a padding leaf). A
    `query_value` outside `[0, 1]` or NaN (flashbax returned an end leaf) raises `ValueError`
    if it is a Python or NumPy value, an `eqx.error_if` error if it is a JAX array; one that
    is not a real scalar raises `TypeError`/`ValueError`."""
    call = "sum_tree.sample"
    dtype = state.tree.total.dtype
    if query_value is None:
        if rng_key is None:
            raise ValueError(f"`{call}`: give `rng_key` or `query_value`.")
        query, faults = jax.random.uniform(rng_key, (), dtype), []
    else:
        query, faults = _query(query_value, dtype, call)
    return _find(state, jnp.reshape(query, (1,)), call, faults)[0]


def stratified_sample(
    state: SumTreeState, batch_size: int, rng_key: PRNGKeyArray
) -> Int[Array, " batch_size"]:
    """`batch_size` leaves of one state, drawn stratified as in prioritised replay (Schaul et
    al., 2015): one from each of `batch_size` equal slices of the total, in proportion to the
    leaves' values within it. A leaf of value 0 is never returned (see `sample`).

    **Raises:** an `eqx.error_if` error if every leaf is 0."""
    call = "sum_tree.stratified_sample"
    batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
    dtype = state.tree.total.dtype
    uniform = jax.random.uniform(rng_key, (batch_size,), dtype)
    fractions = (jnp.arange(batch_size, dtype=dtype) + uniform) / batch_size
    return _find(state, fractions, call, [])
