"""dejax's `clustered_replay`: one replay per cluster, on `dx.ClusteredReplay`."""

from collections.abc import Callable

from ..._abstract import AbstractReplay
from ..._checks import check_finite_float, check_positive_int
from ..._clustered import ClusteredReplay
from .base import Item, replay_buffer, ReplayBuffer


# The state `clustered_replay(...).init_fn` returns.
ClusteredReplayBufferState = ClusteredReplay


def clustered_replay(
    num_clusters: int,
    cluster_buffer: ReplayBuffer,
    clustering_fn: Callable,
    distribution_power: float = 0.0,
) -> ReplayBuffer:
    """`num_clusters` copies of `cluster_buffer`; `clustering_fn(item)` picks each item's.

    A draw picks non-empty cluster `c` with probability proportional to
    `size_c ** distribution_power`, then an item from it; every `batch_size` works. The state
    is a `dx.ClusteredReplay`, whose docs give the details. `clustering_fn` must return an int
    scalar in `[0, num_clusters)`: an id out of range is an error (dejax dropped the item).

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

    def init_fn(item_prototype: Item) -> ClusteredReplay:
        inner = cluster_buffer.init_fn(item_prototype)
        if not isinstance(inner, AbstractReplay):
            raise TypeError(
                "`clustered_replay`: `cluster_buffer.init_fn` returned a "
                f"{type(inner).__name__}, not a dejax_eqx replay; clusters must be buffers made "
                "by `uniform_replay` or `clustered_replay` of this module."
            )
        return ClusteredReplay(inner, num_clusters, clustering_fn, distribution_power)

    return replay_buffer(init_fn)
