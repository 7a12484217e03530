"""flashbax 0.1.3's `flashbax.utils`: the helpers user code calls on states and functions."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from ...internal import check_nonnegative_int
from ._states import LockStepState


def get_tree_shape_prefix(tree: PyTree[Array], n_axes: int = 1) -> tuple[int, ...]:
    """The sizes of the first `n_axes` axes, which every leaf of `tree` must share.

    **Raises:** `ValueError`/`TypeError` if `n_axes` is not a non-negative Python int (flashbax
    sliced the shapes with it: a negative one dropped axes from the end), if `tree` has no
    leaves, or if its leaves do not share `n_axes` leading axes."""
    n_axes = check_nonnegative_int(n_axes, "get_tree_shape_prefix(n_axes=...)")
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("`get_tree_shape_prefix`: the tree has no array leaves.")
    prefix = tuple(jnp.shape(leaves[0])[:n_axes])
    if len(prefix) < n_axes or any(tuple(jnp.shape(x)[:n_axes]) != prefix for x in leaves):
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(
            f"`get_tree_shape_prefix`: the leaves do not share {n_axes} leading axes: {shapes}."
        )
    return prefix


def add_dim_to_args(
    func: Callable,
    axis: int = 1,
    starting_arg_index: int | None = 1,
    ending_arg_index: int | None = None,
    kwargs_on_device_keys: Sequence[str] | None = None,
) -> Callable:
    """Wrap `func` so that the positional arguments `starting_arg_index:ending_arg_index`
    (pytrees) get a new axis at `axis` before the call, as do the keyword arguments named in
    `kwargs_on_device_keys` (all of them if it is `None`), which get it at axis 1, as flashbax's
    do.

    Unlike flashbax's, the new axis changes no value and no dtype: a JAX array is expanded by
    JAX, a NumPy value (or a Python scalar, as the NumPy array of its own precision) by NumPy.
    flashbax's `jnp.expand_dims` converted NumPy and Python values as JAX does without 64-bit
    mode, before any check could see them: an int64 wrapped to int32, a float64 was rounded to
    float32, a Python `1e39` became inf.

    The arguments expanded are `args[starting_arg_index:ending_arg_index]`, a Python slice as
    in flashbax: `starting_arg_index=None` starts at the first argument (not at the default 1),
    `ending_arg_index=None` ends after the last, and negative indices count from the end.

    **Raises:** `TypeError` at once if `axis` is not a Python int or an index is neither a
    Python int nor `None` (flashbax raised it at the first call)."""
    for name, value in [
        ("starting_arg_index", starting_arg_index),
        ("ending_arg_index", ending_arg_index),
    ]:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(
                f"`add_dim_to_args({name}=...)` must be a Python int or None, got {value!r} of "
                f"type {type(value).__name__}."
            )
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(
            f"`add_dim_to_args(axis=...)` must be a Python int, got {axis!r} of type "
            f"{type(axis).__name__}."
        )
    chosen = slice(starting_arg_index, ending_arg_index)

    def expand_leaf(x: Any, at: int) -> Any:
        if isinstance(x, jax.Array):
            return jnp.expand_dims(x, at)
        return np.expand_dims(np.asarray(x), at)

    def expand(tree: Any, at: int) -> Any:
        return jax.tree.map(lambda x: expand_leaf(x, at), tree)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        expanded = range(len(args))[chosen]
        args = tuple(expand(a, axis) if i in expanded else a for i, a in enumerate(args))
        kwargs = {
            k: expand(v, 1) if kwargs_on_device_keys is None or k in kwargs_on_device_keys else v
            for k, v in kwargs.items()
        }
        return func(*args, **kwargs)

    return wrapper


def get_timestep_count(buffer_state: Any) -> Array:
    """The number of steps a trajectory, flat or item buffer's state holds (all rows).

    **Raises:** `TypeError` for anything else, such as a queue's state (flashbax's `assert`s;
    here it was an `AttributeError` naming a field the caller never wrote)."""
    if not isinstance(buffer_state, LockStepState):
        raise TypeError(
            "`get_timestep_count` takes the state of a trajectory, flat or item buffer (plain "
            f"or prioritised), got a {type(buffer_state).__name__}."
        )
    rows, max_length = get_tree_shape_prefix(buffer_state.experience, 2)
    per_row = jnp.where(buffer_state.is_full, max_length, buffer_state.current_index)
    return rows * per_row
