"""dejax's state classes, as views of dejax_eqx's modules.

dejax's states were chex dataclasses whose fields user code reads (`state.storage.head`,
`state.cluster_state_batch`, ...). Each class here holds one dejax_eqx module (its only field,
`module`, so the state's array leaves are exactly the module's) and computes dejax's fields
from it as read-only properties.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from ... import (
    CircularBuffer as EqxCircularBuffer,
    ClusteredReplay,
    UniformReplay,
)


class CircularBuffer(eqx.Module):
    """The state of dejax's `circular_buffer` functions: a view of a `dx.CircularBuffer`.

    Made by `circular_buffer.init`. dejax's fields are read-only properties with dejax's
    meaning; `module` is the `dx.CircularBuffer` that holds the arrays.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx.compat.dejax as dejax

        cb = dejax.circular_buffer.init({"x": jnp.zeros(2)}, max_size=3)
        for k in range(4):  # the fourth push overwrites the first item
            cb = dejax.circular_buffer.push(cb, {"x": jnp.full(2, float(k))})
        assert (int(cb.head), int(cb.tail), bool(cb.full)) == (1, 1, True)
        assert cb.data["x"][:, 0].tolist() == [3.0, 1.0, 2.0]
        ```
    """

    module: EqxCircularBuffer
    """The `dx.CircularBuffer` behind this state."""

    @property
    def data(self) -> PyTree[Shaped[Array, "max_size ..."]]:
        """The slots in ring order, each leaf with a leading `max_size` axis."""
        return self.module.data

    @property
    def head(self) -> Int[Array, "*c"]:
        """The slot the next push writes, in `[0, max_size)`."""
        return self.module.head

    @property
    def tail(self) -> Int[Array, "*c"]:
        """The slot of the oldest item, the next one `pop` returns, in `[0, max_size)`.

        `tail == head` both when the buffer is empty and when it is full; `full` tells which.
        """
        # `head - count` is at least `-max_size`: no overflow, and `%` wraps it into range.
        return (self.module.head - self.module.count) % self.module.max_size

    @property
    def full(self) -> Bool[Array, "*c"]:
        """Whether `max_size` items are stored (the next push overwrites the oldest)."""
        # Not `module.is_full`: that is typed for one buffer, and this view also serves a
        # stack of them (a clustered state's `cluster_state_batch.storage`).
        return self.module.count == self.module.max_size


class UniformReplayBufferState(eqx.Module):
    """The state of `uniform_replay`: a view of a `dx.UniformReplay`.

    Made by `uniform_replay(max_size).init_fn`. `storage` is dejax's field; `module` is the
    `dx.UniformReplay` that holds the arrays.
    """

    module: UniformReplay
    """The `dx.UniformReplay` behind this state."""

    @property
    def storage(self) -> CircularBuffer:
        """The stored items, as a circular-buffer state (`data`, `head`, `tail`, `full`)."""
        return CircularBuffer(self.module.storage)


class ClusteredReplayBufferState(eqx.Module):
    """The state of `clustered_replay`: a view of a `dx.ClusteredReplay`.

    Made by `clustered_replay(...).init_fn`. dejax's fields are read-only properties;
    `module` is the `dx.ClusteredReplay` that holds the arrays.
    """

    module: ClusteredReplay
    """The `dx.ClusteredReplay` behind this state."""

    @property
    def cluster_state_batch(self) -> Any:
        """The clusters' states stacked into one: the state of `cluster_buffer` with a leading
        `num_clusters` axis on every array (`state.cluster_state_batch.storage.head[c]` is the
        write position of cluster `c`)."""
        return state_of(self.module.clusters)

    @property
    def cluster_buffer(self) -> Any:
        """The buffer of one cluster (a `ReplayBuffer`, equal to the `cluster_buffer` that
        `clustered_replay` was given)."""
        return buffer_of(self.module.clusters)

    @property
    def clustering_fn(self) -> jax.tree_util.Partial:
        """`clustering_fn(item) -> cluster id`, as dejax kept it (a `jax.tree_util.Partial`)."""
        return jax.tree_util.Partial(self.module.cluster_fn)

    @property
    def distribution_power(self) -> float:
        """The exponent of the cluster sizes in the cluster weights (a Python float)."""
        return self.module.distribution_power


State = UniformReplayBufferState | ClusteredReplayBufferState | CircularBuffer

_STATE_OF: dict[type, Callable[[Any], State]] = {
    UniformReplay: UniformReplayBufferState,
    ClusteredReplay: ClusteredReplayBufferState,
    EqxCircularBuffer: CircularBuffer,
}


def state_of(module: Any) -> State:
    """The dejax state whose arrays are `module`'s (no copy)."""
    try:
        make = _STATE_OF[type(module)]
    except KeyError:
        raise TypeError(
            "dejax_eqx.compat.dejax has states of a dx.UniformReplay, dx.ClusteredReplay or "
            f"dx.CircularBuffer only, not of a {type(module).__name__}."
        ) from None
    return make(module)


@functools.singledispatch
def buffer_of(replay: Any) -> Any:
    """The `ReplayBuffer` whose `init_fn` makes states like `replay`'s (its static fields only
    are read, so a stack of replays gives the buffer of one).

    Each buffer constructor registers the replay it makes (`uniform.py`, `clustered.py`):
    they import this module for their states, so this module cannot import them.
    """
    raise TypeError(
        f"no buffer of dejax_eqx.compat.dejax makes a state of {type(replay).__name__}, so a "
        "clustered state of it has no `cluster_buffer`."
    )


def module_of(state: Any, expected: type | tuple[type, ...], call: str) -> Any:
    """The dejax_eqx module behind `state` (a state of this module, or the module itself).

    `expected` is the module type(s) `call` works on; anything else is a `TypeError`.
    """
    module = state.module if isinstance(state, State) else state
    if not isinstance(module, expected):
        made_by = "`circular_buffer.init`" if expected is EqxCircularBuffer else "an `init_fn`"
        raise TypeError(
            f"`{call}` takes a state made by {made_by} of this module (or the dejax_eqx module "
            f"behind one), got {type(state).__name__}."
        )
    return module


# The modules behind the states of `uniform_replay` and `clustered_replay`.
REPLAYS = (UniformReplay, ClusteredReplay)
