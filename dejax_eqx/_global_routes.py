"""Global names on the global buffers' shards: the priority updates and `stale` questions that
name items and windows by global indices and env ids, each entry applied by the shard that
owns it, and checked on every device so that a bad entry raises in every process."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Integer, Real, UInt32

from ._abstract import AbstractTrajectoryBuffer
from ._checks import check_generations, check_index, check_vector
from ._clustered import ClusteredReplay
from ._faults import check_faults, Fault
from ._prioritised import PrioritisedReplay
from ._prioritised_trajectory import PrioritisedTrajectoryBuffer
from ._sequences import is_window
from ._shard_map import assemble, Layout, per_shard


def set_item_priorities(
    layout: Layout,
    call: str,
    shards: Any,
    indices: Integer[ArrayLike, " n"],
    priorities: Real[ArrayLike, " n"],
    *,
    mask: Bool[ArrayLike, " n"] | None = None,
    generations: UInt32[ArrayLike, " n"] | None = None,
) -> Any:
    capacity = shards.max_size
    index, bad = check_index(indices, layout.num_shards * capacity, f"{call}(indices=...)", ndim=1)
    n = index.shape[0]
    priorities = check_vector(priorities, n, call, "priorities")
    mask = jnp.ones(n, jnp.bool_) if mask is None else jnp.asarray(mask)
    extra = () if generations is None else (jnp.asarray(generations),)
    fault = (bad & mask, f"`{call}`: an index names no item of any shard: {_RANGE}")

    axis, n = layout.axis, layout.num_shards

    def local(replay: PrioritisedReplay, index, priorities, mask, *generations):
        owner, slot = index // capacity, index % capacity
        owned = owner == jax.lax.axis_index(axis)
        # Checked on every device, so that a bad entry raises in every process.
        unstored = slot >= per_shard(replay.size, axis, n)[owner]
        faults = [
            (unstored & mask, f"`{call}`: {_NOT_STORED}"),
            (_bad_priorities(priorities) & mask, f"`{call}`: {_BAD_PRIORITIES}"),
        ]
        replay = check_faults(replay, faults)
        new = replay.set_priorities(
            jnp.where(owned, slot, 0),
            priorities,
            mask=mask & owned,
            generations=generations[0] if generations else None,
        )
        return _raise_max(new, priorities, mask)

    index = check_faults(index, [fault])
    return layout.update(shards, local, index, priorities, mask, *extra, sharded=False)


def set_cluster_priorities(
    layout: Layout,
    call: str,
    shards: Any,
    cluster_ids: Integer[ArrayLike, " n"],
    indices: Integer[ArrayLike, " n"],
    priorities: Real[ArrayLike, " n"],
    *,
    generations: UInt32[ArrayLike, " n"] | None = None,
) -> Any:
    shard: ClusteredReplay = shards  # type: ignore[assignment]
    capacity = shard.clusters.max_size
    index, bad = check_index(indices, layout.num_shards * capacity, f"{call}(indices=...)", ndim=1)
    n = index.shape[0]
    ids = jnp.asarray(cluster_ids)
    priorities = check_vector(priorities, n, call, "priorities")
    extra = () if generations is None else (jnp.asarray(generations),)
    fault = (bad, f"`{call}`: an index names no item of its cluster in any shard: {_RANGE}")

    axis, n, clusters = layout.axis, layout.num_shards, shard.num_clusters

    def local(replay: ClusteredReplay, ids, index, priorities, *generations):
        owner, slot = index // capacity, index % capacity
        owned = owner == jax.lax.axis_index(axis)
        # Checked on every device, so that a bad entry raises in every process.
        sizes = per_shard(replay.cluster_sizes, axis, n)
        unstored = slot >= sizes[owner, jnp.clip(ids, 0, clusters - 1)]
        faults = [
            (
                (ids < 0) | (ids >= clusters),
                f"`{call}`: a cluster id is outside [0, {clusters})",
            ),
            (unstored, f"`{call}`: {_NOT_STORED}"),
            (_bad_priorities(priorities), f"`{call}`: {_BAD_PRIORITIES}"),
        ]
        replay = check_faults(replay, faults)
        # Entries of other shards go to slot 0 of cluster `ids` and are masked out there.
        new = replay.set_priorities(
            ids,
            jnp.where(owned, slot, 0),
            priorities,
            mask=owned,
            generations=generations[0] if generations else None,
        )
        # Each cluster's largest recorded priority rises with its own entries, as in a
        # single ClusteredReplay.
        valid = jnp.where(_bad_priorities(priorities), 0, priorities)
        top = jnp.zeros(clusters, valid.dtype).at[ids].max(valid)
        inner = eqx.tree_at(
            lambda r: r.priorities.max_priority,
            new.clusters,
            replace_fn=lambda m: jnp.maximum(m, top.astype(m.dtype)),
        )
        return eqx.tree_at(lambda r: r.clusters, new, inner)

    index = check_faults(index, [fault])
    return layout.update(shards, local, ids, index, priorities, *extra, sharded=False)


def set_window_priorities(
    layout: Layout,
    call: str,
    shards: Any,
    env_ids: Integer[ArrayLike, " n"],
    starts: Integer[ArrayLike, " n"],
    priorities: Real[ArrayLike, " n"],
) -> Any:
    k = shards.num_envs
    num_envs = layout.num_shards * k
    env, bad = check_index(env_ids, num_envs, f"{call}(env_ids=...)", ndim=1)
    n = env.shape[0]
    priorities = check_vector(priorities, n, call, "priorities")
    fault = (bad, f"`{call}`: an env id is outside [0, num_envs) = [0, {num_envs})")

    axis, n = layout.axis, layout.num_shards

    def local(buffer: PrioritisedTrajectoryBuffer, env, starts, priorities):
        owner = env // k
        owned = owner == jax.lax.axis_index(axis)
        # Checked on every device, so that a bad entry raises in every process.
        stamps = _global_stamps(buffer, env, starts, jnp.zeros_like(owned), axis, n, call)
        w = buffer.window
        misfit = (
            ~is_window(stamps.start, stamps.taken, w.size, w.period),
            f"`{call}`: a stamp this buffer cannot have given: its start is not on a "
            f"multiple of period = {w.period}, or its window of {w.size} steps has not "
            "been stored yet",
        )
        priority_fault = (_bad_priorities(priorities), f"`{call}`: {_BAD_PRIORITIES}")
        buffer = check_faults(buffer, [*stamps.faults, misfit, priority_fault])
        new = buffer.set_priorities(
            jnp.where(owned, env - owner * k, 0), starts, priorities, mask=owned
        )
        return _raise_max(new, priorities, jnp.ones_like(owned))

    env = check_faults(env, [fault])
    return layout.update(shards, local, env, jnp.asarray(starts), priorities, sharded=False)


def stale_items(
    layout: Layout, shards: Any, indices: Any, generations: Any, call: str
) -> Bool[Array, " n"]:
    k = shards.max_size
    index, bad = check_index(indices, layout.num_shards * k, f"{call}(indices=...)", ndim=1)
    generations = check_generations(generations, index.shape[0], call)
    axis, n = layout.axis, layout.num_shards

    def local(replay: PrioritisedReplay, index, generations, bad):
        owner, slot = index // k, index % k
        mine = owner == jax.lax.axis_index(axis)
        unstored = slot >= per_shard(replay.size, axis, n)[owner]
        out = replay.generations[jnp.where(mine, slot, 0)] != generations
        out = assemble(out, mine, axis)
        return check_faults(out, [(bad | unstored, f"`{call}`: {_NOT_STORED}")])

    return layout.map(shards, local, (index, generations, bad), P())


def stale_windows(
    layout: Layout, shards: Any, env_ids: Any, starts: Any, call: str
) -> Bool[Array, " n"]:
    num_envs = layout.num_shards * shards.num_envs
    env, bad = check_index(env_ids, num_envs, f"{call}(env_ids=...)", ndim=1)
    start = check_vector(starts, env.shape[0], call, "starts")
    axis, n = layout.axis, layout.num_shards

    def local(buffer: AbstractTrajectoryBuffer, env, start, bad):
        stamps = _global_stamps(buffer, env, start, bad, axis, n, call)
        return check_faults(stamps.stale, stamps.faults)

    return layout.map(shards, local, (env, start, bad), P())


_RANGE = "global indices are shard · rows_per_shard + local index"
_NOT_STORED = (
    "an index names no stored item of any shard (a global index is shard · rows_per_shard + "
    "slot, and the slot must be stored)"
)
_BAD_PRIORITIES = "priorities must be finite and non-negative"


class _Stamps(NamedTuple):
    start: Array
    taken: Array
    stale: Array
    faults: list[Fault]


def _global_stamps(
    buffer: AbstractTrajectoryBuffer,
    env: Array,
    start: Array,
    bad_env: Array,
    axis: str,
    n: int,
    call: str,
) -> _Stamps:
    """Stamps `(env, start)` of global envs read against every shard's counters, gathered
    (two numbers per env), so that every device reaches the same verdict."""
    counts, lengths = per_shard((buffer.step_count, buffer.streams.lengths), axis, n)
    counts, lengths = counts.reshape(-1), lengths.reshape(-1)
    env = jnp.where(bad_env, 0, env)
    taken, length = counts[env], lengths[env]
    bad_start = ~bad_env & ((start < 0) | (start >= taken))
    faults: list[Fault] = [
        (bad_env, f"`{call}`: an env id is outside [0, num_envs)"),
        (
            bad_start,
            f"`{call}`: a start is not a step of its env (negative, or not yet taken); "
            "stamps must come from this buffer",
        ),
    ]
    start = jnp.where(bad_start, 0, start)
    return _Stamps(start, taken, start < taken - length, faults)


def _bad_priorities(priorities: Array) -> Array:
    return ~(jnp.isfinite(priorities) & (priorities >= 0))


def _raise_max(buffer: Any, priorities: Array, mask: Array) -> Any:
    """`buffer` with its largest recorded priority raised to that of every entry, as a single
    buffer does (each shard sees every entry, so every shard keeps the same)."""
    top = jnp.max(jnp.where(mask & jnp.isfinite(priorities), priorities, 0), initial=0)
    return eqx.tree_at(
        lambda b: b.priorities.max_priority,
        buffer,
        replace_fn=lambda m: jnp.maximum(m, top.astype(m.dtype)),
    )
