"""dejax's `ReplayBuffer`: the bundle of functions every buffer constructor returns."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray, PyTree

from ... import AbstractReplay
from ...internal import is_concrete
from ._states import module_of, REPLAYS, State, state_of


ReplayBufferState = Any
Item = PyTree[ArrayLike]
ItemBatch = PyTree[ArrayLike]
IntScalar = Int[Array, ""]
ItemUpdateFn = Callable[[Item], Item]


def _partial(fn: Callable) -> jax.tree_util.Partial:
    return fn if isinstance(fn, jax.tree_util.Partial) else jax.tree_util.Partial(fn)


class ReplayBuffer(eqx.Module):
    """A replay buffer as dejax has it: pure functions that take and return a state.

    A pytree without array leaves (each function is a `jax.tree_util.Partial`, as in dejax),
    so a `ReplayBuffer` can be closed over by a jitted function or passed to it as an argument.

    **Fields:**

    - `init_fn(item_prototype) -> state`
    - `size_fn(state) -> int32 scalar`
    - `add_fn(state, item) -> state`
    - `add_batch_fn(state, item_batch) -> state`
    - `sample_fn(state, rng, batch_size) -> item_batch`
    - `update_fn(state, item_update_fn) -> state`
    """

    init_fn: jax.tree_util.Partial
    size_fn: jax.tree_util.Partial
    add_fn: jax.tree_util.Partial
    add_batch_fn: jax.tree_util.Partial
    sample_fn: jax.tree_util.Partial
    update_fn: jax.tree_util.Partial

    def __init__(
        self,
        init_fn: Callable,
        size_fn: Callable,
        add_fn: Callable,
        add_batch_fn: Callable,
        sample_fn: Callable,
        update_fn: Callable,
    ):
        self.init_fn = _partial(init_fn)
        self.size_fn = _partial(size_fn)
        self.add_fn = _partial(add_fn)
        self.add_batch_fn = _partial(add_batch_fn)
        self.sample_fn = _partial(sample_fn)
        self.update_fn = _partial(update_fn)


def as_jax(tree: PyTree) -> PyTree:
    """NumPy leaves as JAX arrays, with the dtypes `jax.jit` would give them.

    dejax cast whatever was pushed to the stored dtype. The modules cast nothing, but a NumPy
    float64 item (what most environments return) must keep working where x64 is off: passed
    through `jax.jit` it becomes float32 anyway, and this makes eager calls agree.
    """
    return jax.tree.map(
        lambda x: jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x, tree
    )


def _size_fn(state: State | AbstractReplay) -> Int[Array, ""]:
    return module_of(state, REPLAYS, "size_fn").size


def _add_fn(state: State | AbstractReplay, item: Item) -> State:
    return state_of(module_of(state, REPLAYS, "add_fn").add(as_jax(item)))


def _add_batch_fn(state: State | AbstractReplay, item_batch: ItemBatch) -> State:
    return state_of(module_of(state, REPLAYS, "add_batch_fn").add_batch(as_jax(item_batch)))


def _sample_fn(state: State | AbstractReplay, rng: PRNGKeyArray, batch_size: int) -> Any:
    replay = module_of(state, REPLAYS, "sample_fn")
    size = replay.size
    # Eagerly, the error dejax raised (through `checkify.check`); under a transformation the
    # module's own `eqx.error_if` reports it.
    if is_concrete(size) and int(size) == 0:
        raise ValueError("Cannot sample from an empty buffer")
    return replay.sample(rng, batch_size)


def _update_fn(state: State | AbstractReplay, item_update_fn: ItemUpdateFn) -> State:
    return state_of(module_of(state, REPLAYS, "update_fn").update(item_update_fn))


def replay_buffer(init_fn: Callable[[Item], State]) -> ReplayBuffer:
    """The dejax functions of a replay whose state `init_fn` builds."""
    # Module-level functions: the same objects for every buffer, so jitted code that takes a
    # `ReplayBuffer` as an argument retraces only for a new `init_fn`.
    return ReplayBuffer(
        init_fn=init_fn,
        size_fn=_size_fn,
        add_fn=_add_fn,
        add_batch_fn=_add_batch_fn,
        sample_fn=_sample_fn,
        update_fn=_update_fn,
    )


def make_default_add_batch_fn(
    add_fn: Callable[[ReplayBufferState, Item], ReplayBufferState],
) -> Callable[[ReplayBufferState, ItemBatch], ReplayBufferState]:
    """An `add_batch_fn` that adds the items of a batch one by one with `add_fn`.

    For buffers written on top of dejax's `ReplayBuffer`: the batch's leading axis is scanned
    over, so `add_fn` is traced once. The buffers of this module do not use it; their
    `add_batch_fn` is one vectorised write.
    """

    def add_batch_fn(state: ReplayBufferState, item_batch: ItemBatch) -> ReplayBufferState:
        state, _ = jax.lax.scan(lambda s, item: (add_fn(s, item), None), state, item_batch)
        return state

    return add_batch_fn
