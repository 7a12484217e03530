"""flashbax 0.1.3's `sum_tree`, as a read-only view of a `dx.SumTree`.

flashbax keeps its priorities in a binary tree stored root first: level `d` (the root is level
0) holds `2**d` nodes from index `2**d - 1`, and the leaves, padded with zeros to
`2**tree_depth`, form the last level. dejax_eqx's `SumTree` is laid out differently (wider
nodes, leaves first), so `SumTreeState.nodes` rebuilds flashbax's array from the leaves when
read. Nothing here writes: priorities change through the buffer's `set_priorities`.

The state is an `eqx.Module`, so it goes through `jax.pmap`, `jax.jit` and `jax.vmap` as a
pytree, and each of its fields also reads a stack of states (leading axes).
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer

from .... import SumTree
from ....internal import priority_mass


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


def _leaf_values(state: SumTreeState, indices: Integer[ArrayLike, "*s"]) -> Float[Array, "*s"]:
    # Padding leaves (from `capacity` on) hold 0, as in flashbax's tree.
    return jnp.take(state.leaves, jnp.asarray(indices), mode="fill", fill_value=0)


def get(state: SumTreeState, node_index: Integer[ArrayLike, "*s"]) -> Float[Array, "*s"]:
    """The values (masses `p ** α`) of leaves `node_index` (the buffer's `indices`) of one
    state; map it (`jax.pmap`, `jax.vmap`) over a stack of states."""
    return _leaf_values(state, node_index)


def get_batch(state: SumTreeState, node_indices: Integer[ArrayLike, " n"]) -> Float[Array, " n"]:
    """The values of a batch of leaves, as `get`."""
    return _leaf_values(state, node_indices)


def get_probability(
    state: SumTreeState, node_index: Integer[ArrayLike, "*s"]
) -> Float[Array, "*s"]:
    """The probability of drawing leaves `node_index` in one draw: value over total."""
    return _leaf_values(state, node_index) / state.tree.total
