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
from jaxtyping import Array, ArrayLike, Float, Int, Integer, PRNGKeyArray, Real

from .... import SumTree
from ....internal import check_faults, check_index, check_positive_int, Fault, priority_mass


def get_tree_depth(capacity: int) -> int:
    """The number of levels below the root of a binary tree with at least `capacity` leaves:
    the least `d` with `2**d >= capacity`."""
    return max(int(capacity) - 1, 0).bit_length()


def get_tree_index(
    depth_level: Integer[ArrayLike, "*s"], node_index: Integer[ArrayLike, "*s"]
) -> Int[Array, "*s"]:
    """The position in `SumTreeState.nodes` of node `node_index` of level `depth_level`."""
    return jnp.power(2, jnp.asarray(depth_level)) - 1 + jnp.asarray(node_index)


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


def _find(state: SumTreeState, fractions: Float[Array, " n"], call: str) -> Int[Array, " n"]:
    """The leaves whose intervals of the running sum hold `fractions * total`."""
    total = state.tree.total
    empty = (
        ~(total > 0),
        f"`{call}`: every leaf is 0 (nothing stored yet, or every priority 0), so no leaf "
        "can be drawn",
    )
    return check_faults(state.tree.find(fractions * total), [empty])


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
    `eqx.error_if` error if every leaf is 0 (flashbax returned a padding leaf)."""
    call = "sum_tree.sample"
    dtype = state.tree.total.dtype
    if query_value is None:
        if rng_key is None:
            raise ValueError(f"`{call}`: give `rng_key` or `query_value`.")
        query_value = jax.random.uniform(rng_key, (), dtype)
    return _find(state, jnp.reshape(jnp.asarray(query_value, dtype), (1,)), call)[0]


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
    return _find(state, fractions, call)
