"""dejax's `clustered_replay`: one replay per cluster, on `dx.ClusteredReplay`."""

import dataclasses
from collections.abc import Callable

from ... import AbstractReplay, ClusteredReplay
from ...internal import check_finite_float, check_positive_int
from ._states import (
    buffer_of,
    ClusteredReplayBufferState as ClusteredReplayBufferState,
    State,
)
from .base import Item, replay_buffer, ReplayBuffer


@dataclasses.dataclass(frozen=True)
class _Init:
    # A value rather than a closure, as `uniform.py`'s: equal arguments give equal buffers.
    # The clusters' `init_fn` is kept, not their `ReplayBuffer` (whose `Partial`s hash by
    # identity), so equality and hashing agree.
    num_clusters: int
    cluster_init_fn: Callable[[Item], State]
    clustering_fn: Callable
    distribution_power: float

    def __call__(self, item_prototype: Item) -> ClusteredReplayBufferState:
        state = self.cluster_init_fn(item_prototype)
        inner = state.module if isinstance(state, State) else state
        if not isinstance(inner, AbstractReplay):
            raise TypeError(
                "`clustered_replay`: `cluster_buffer.init_fn` returned a "
                f"{type(state).__name__}, not a dejax_eqx replay; clusters must be buffers made "
                "by `uniform_replay` or `clustered_replay` of this module."
            )
        replay = ClusteredReplay(
            inner, self.num_clusters, self.clustering_fn, self.distribution_power
        )
        return ClusteredReplayBufferState(replay)


@buffer_of.register(ClusteredReplay)
def _buffer_of_clustered(replay: ClusteredReplay) -> ReplayBuffer:
    return clustered_replay(
        replay.num_clusters,
        buffer_of(replay.clusters),
        replay.cluster_fn,
        replay.distribution_power,
    )


def clustered_replay(
    num_clusters: int,
    cluster_buffer: ReplayBuffer,
    clustering_fn: Callable,
    distribution_power: float = 0.0,
) -> ReplayBuffer:
    """`num_clusters` copies of `cluster_buffer`; `clustering_fn(item)` picks each item's.

    A draw picks non-empty cluster `c` with probability proportional to
    `size_c ** distribution_power`, then an item from it; every `batch_size` works.
    `clustering_fn` must return an int scalar in `[0, num_clusters)`: an id out of range is an
    error (dejax dropped the item).

    The state is a `ClusteredReplayBufferState` with dejax's fields (`cluster_state_batch`:
    the clusters' states stacked; `cluster_buffer`, `clustering_fn`, `distribution_power`), and
    the `dx.ClusteredReplay` behind it as `module`, whose docs give the details.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx.compat.dejax as dejax


        def clustering_fn(item):
            return (item["reward"] > 0).astype(jnp.int32)


        buffer = dejax.clustered_replay(2, dejax.uniform_replay(100), clustering_fn)
        state = buffer.init_fn({"reward": jnp.asarray(0.0)})
        state = buffer.add_batch_fn(state, {"reward": jnp.asarray([0.0, 0.0, 1.0])})
        batch = buffer.sample_fn(state, jax.random.key(0), 3)
        assert int(buffer.size_fn(state)) == 3 and batch["reward"].shape == (3,)
        assert state.cluster_state_batch.storage.head.tolist() == [2, 1]  # per cluster
        ```
    """
    num_clusters = check_positive_int(num_clusters, "clustered_replay(num_clusters=...)")
    if not isinstance(cluster_buffer, ReplayBuffer):
        raise TypeError(
            "`clustered_replay(cluster_buffer=...)` must be a buffer made by "
            "`uniform_replay` or `clustered_replay` of this module, got "
            f"{type(cluster_buffer).__name__}."
        )
    if not callable(clustering_fn):
        raise TypeError(
            f"`clustered_replay(clustering_fn=...)` must be a function, got {clustering_fn!r}."
        )
    distribution_power = check_finite_float(
        distribution_power, "clustered_replay(distribution_power=...)"
    )

    # dejax called `cluster_buffer.init_fn` once per cluster; it is called once here, and the
    # state it returns is the template of every cluster.
    cluster_init_fn = cluster_buffer.init_fn
    if not cluster_init_fn.args and not cluster_init_fn.keywords:
        cluster_init_fn = cluster_init_fn.func  # compared by value where it is one of ours
    return replay_buffer(_Init(num_clusters, cluster_init_fn, clustering_fn, distribution_power))
