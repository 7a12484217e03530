"""dejax's `utils`: small helpers on pytrees of arrays that dejax code and tests import.

They work on any pytree, the states of this module included (a state's leaves are its arrays).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree


_DTYPES: dict[type, Any] = {int: jnp.int32, float: jnp.float32, bool: jnp.bool_}


def tile_over_axis(tensor: ArrayLike, axis: int, size: int) -> Array:
    """`size` copies of `tensor` along a new axis `axis`."""
    return jnp.repeat(jnp.expand_dims(tensor, axis), size, axis=axis)


def type_to_dtype(t: type) -> Any:
    """The dtype dejax stores a Python `int`, `float` or `bool` as (32-bit)."""
    try:
        return _DTYPES[t]
    except KeyError:
        raise ValueError(f"Unsupported type: {t}") from None


def scalar_to_jax(scalar: bool | int | float) -> Array:
    """A Python scalar as a JAX scalar: `int` as int32, `float` as float32, `bool` as bool."""
    if type(scalar) not in _DTYPES:
        raise TypeError(
            f"`scalar_to_jax` takes a Python int, float or bool, got {type(scalar).__name__}."
        )
    return jnp.asarray(scalar, dtype=type_to_dtype(type(scalar)))


def assert_tree_is_batch_of_tree(tree_batch: PyTree, tree: PyTree) -> None:
    """Raise `AssertionError` unless `tree_batch` is `tree`'s structure with one extra leading
    axis on every leaf."""
    batch_leaves, batch_def = jax.tree.flatten(tree_batch)
    leaves, treedef = jax.tree.flatten(tree)
    if batch_def != treedef:
        raise AssertionError(f"Tree structures differ: {batch_def} != {treedef}")
    for b, t in zip(batch_leaves, leaves):
        if np.shape(b)[1:] != np.shape(t):
            raise AssertionError(f"{np.shape(b)[1:]} != {np.shape(t)}")


def set_pytree_batch_item(tree_batch: PyTree, index: ArrayLike, tree: PyTree) -> PyTree:
    """`tree_batch` with row `index` of every leaf replaced by the matching leaf of `tree`."""
    assert_tree_is_batch_of_tree(tree_batch, tree)
    return jax.tree.map(lambda b, t: b.at[index].set(t), tree_batch, tree)


def get_pytree_batch_item(tree_batch: PyTree, index: ArrayLike) -> PyTree:
    """Row `index` of every leaf of `tree_batch`."""
    return jax.tree.map(lambda b: b[index], tree_batch)


def get_pytree_axis_dim(tree: PyTree, axis: int) -> int:
    """The length of axis `axis`, which every leaf of `tree` must share."""
    dims = {np.shape(leaf)[axis] for leaf in jax.tree.leaves(tree)}
    if len(dims) != 1:
        raise ValueError(
            f"`get_pytree_axis_dim`: the leaves must share axis {axis}, found lengths "
            f"{sorted(dims)}."
        )
    return dims.pop()


def concatenate_trees(*trees: PyTree, axis: int = 0) -> PyTree:
    """The leaves of `trees` (one structure) concatenated along `axis`."""
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves, axis=axis), *trees)


def stack_trees(*trees: PyTree, axis: int = 0) -> PyTree:
    """The leaves of `trees` (one structure) stacked along a new axis `axis`."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves, axis=axis), *trees)
