"""The global draws of `GlobalReplay.sample` and `GlobalTrajectoryBuffer.sample`: every device
gathers a few numbers per shard, draws the same rows from the law of the whole buffer with the
shared key, reads the rows its shard owns, and the batch is assembled with one all-reduce."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, PRNGKeyArray, Real

from ._abstract import AbstractReplay
from ._clustered import choose_clusters, ClusteredReplay
from ._faults import check_faults, Fault
from ._priorities import check_beta, mass_faults, weights
from ._prioritised import PrioritisedReplay, PrioritisedSample
from ._prioritised_trajectory import (
    PrioritisedSequenceSample,
    PrioritisedTrajectoryBuffer,
    stamps_of,
)
from ._sequences import draw_starts, phase
from ._shard_map import assemble, float_targets, Layout, locate, per_shard
from ._storage import gather, gather_slots
from ._sum_tree import find_leaves
from ._trajectory import check_power, no_start_fault, SOURCES, TrajectoryBuffer
from ._uniform import UniformReplay
from ._windows import as_window, read_windows, SequenceSample


_NAME = "GlobalReplay"


def sample_replay(
    layout: Layout, call: str, shards: Any, key: PRNGKeyArray, batch_size: int
) -> Any:
    axis, n = layout.axis, layout.num_shards
    name = type(shards).__name__

    def local(replay: AbstractReplay, key: PRNGKeyArray):
        me = jax.lax.axis_index(axis)
        if isinstance(replay, ClusteredReplay):
            return _draw_clustered(replay, key, batch_size, axis, n, me, call)
        law = _item_law(replay)
        masses, sizes = per_shard((law.mass(replay), replay.size), axis, n)
        total = jnp.sum(masses)
        targets = law.targets(key, batch_size, total)
        owner, residual = locate(targets, masses)
        mine = owner == me
        rows = law.at(replay, jnp.where(mine, residual, 0), total)
        out = assemble(rows, mine, axis)
        out = law.globalize(out, owner, replay.max_size)
        faults = [
            (jnp.sum(sizes) == 0, f"`{call}`: cannot sample from an empty {name}"),
            *law.faults(total, call),
        ]
        return check_faults(out, faults, order_reads=False)

    return layout.map(shards, local, (key,), P())


def sample_windows(
    layout: Layout,
    call: str,
    shards: Any,
    key: PRNGKeyArray,
    batch_size: int,
    window: Any,
    *,
    distribution_power: Real[ArrayLike, ""] = 1.0,
    source: str = "replay",
    **options: Any,
) -> SequenceSample:
    shard: TrajectoryBuffer = shards  # type: ignore[assignment]
    window = as_window(window, options, call)
    window.check(shard.item_spec, shard.max_length, call)
    if source not in SOURCES:
        raise ValueError(f"`{call}(source=...)` must be one of {SOURCES}, got {source!r}.")
    power, power_faults = check_power(distribution_power, call)
    axis, n, k = layout.axis, layout.num_shards, shard.num_envs

    def local(buffer: TrajectoryBuffer, key: PRNGKeyArray, power: Array):
        me = jax.lax.axis_index(axis)
        lengths, counts = per_shard((buffer.lengths(source), buffer.step_count), axis, n)
        lengths, counts = lengths.reshape(-1), counts.reshape(-1)
        starts = phase(counts, window.period)
        # The draw of a single buffer of every env: the same rows in every device.
        env, back, _ = draw_starts(key, lengths, starts, batch_size, window.law, power)
        owner = env // k
        mine = owner == me
        local_env = jnp.where(mine, env - owner * k, 0)
        read = read_windows(buffer.streams, local_env, jnp.where(mine, back, 1), window)
        out = assemble(read, mine, axis)
        out = out._replace(env=env, start=counts[env] - back)
        faults = [*power_faults, no_start_fault(lengths, counts, source, window, call)]
        return check_faults(out, faults, order_reads=False)

    return layout.map(shards, local, (key, power), P())


def sample_prioritised_windows(
    layout: Layout,
    call: str,
    shards: Any,
    key: PRNGKeyArray,
    batch_size: int,
    *,
    beta: Real[ArrayLike, ""] = 1.0,
) -> PrioritisedSequenceSample:
    shard: PrioritisedTrajectoryBuffer = shards  # type: ignore[assignment]
    beta, beta_faults = check_beta(beta, call, shard.priorities.max_priority.dtype)
    axis, n = layout.axis, layout.num_shards
    leaves_per_shard = shard.priorities.tree.capacity
    k = shard.num_envs

    def local(buffer: PrioritisedTrajectoryBuffer, key: PRNGKeyArray, beta: Array):
        me = jax.lax.axis_index(axis)
        tree = buffer.priorities.tree
        masses, numbers = per_shard((tree.total, buffer.num_windows), axis, n)
        total = jnp.sum(masses)
        targets = float_targets(key, batch_size, total, buffer.priorities.stratified)
        owner, residual = locate(targets, masses)
        mine = owner == me
        leaves, value = find_leaves(tree, jnp.where(mine, residual, 0))
        env, start = stamps_of(buffer, leaves)
        back = jnp.clip(buffer.step_count[env] - start, 1, buffer.max_length)
        read = read_windows(buffer.streams, env, back, buffer.window)
        read, leaves, value = assemble((read, leaves, value), mine, axis)
        read = read._replace(env=read.env + owner * k)
        number = jnp.sum(numbers)
        positive = total > 0
        probabilities = jnp.where(positive, value / jnp.where(positive, total, 1), 0)
        w = weights(jnp.where(positive, probabilities, 1), jnp.maximum(number, 1), beta)
        out = PrioritisedSequenceSample(read, leaves + owner * leaves_per_shard, probabilities, w)
        faults = [
            (
                number == 0,
                f"`{call}`: no window is admissible yet in any shard: no env holds "
                f"{buffer.window.size} steps from a start on a multiple of period = "
                f"{buffer.window.period}",
            ),
            *mass_faults(total, call, "window"),
            *beta_faults,
        ]
        return check_faults(out, faults, order_reads=False)

    return layout.map(shards, local, (key, beta), P())


class _ItemLaw(NamedTuple):
    """How a replay's items are drawn from a global target: each item holds a slice of its
    shard's `mass`, and a target in `[0, total)` names the item whose slice holds it."""

    mass: Callable[[Any], Array]  # replay -> its total mass
    targets: Callable[[PRNGKeyArray, int, Array], Array]  # key, batch, total(s) -> targets
    at: Callable[[Any, Array, Array], Any]  # replay, targets within it, total(s) -> rows
    globalize: Callable[[Any, Array, int], Any]  # rows, owner shards, capacity -> rows
    faults: Callable[[Array, str], list[Fault]]  # total, call -> faults


def _item_law(replay: AbstractReplay) -> _ItemLaw:
    if isinstance(replay, UniformReplay):
        # Mass 1 per item and integer targets: the draw is exactly a single replay's.
        return _ItemLaw(
            mass=lambda r: r.size,
            targets=lambda key, b, total: jax.random.randint(
                key, (b,), 0, jnp.maximum(total, 1), dtype=jnp.int32
            ),
            at=lambda r, positions, total: gather(r.storage, positions),
            globalize=lambda out, owner, capacity: out,
            faults=lambda total, call: [],
        )
    if isinstance(replay, PrioritisedReplay):
        stratified = replay.priorities.stratified

        def at(r: PrioritisedReplay, values: Array, total: Array) -> PrioritisedSample:
            slots, value = find_leaves(r.priorities.tree, values)
            positive = total > 0
            probabilities = jnp.where(positive, value / jnp.where(positive, total, 1), 0)
            items = gather_slots(r.storage, slots)
            return PrioritisedSample(items, slots, probabilities, r.generations[slots])

        return _ItemLaw(
            mass=lambda r: r.priorities.tree.total,
            targets=lambda key, b, total: float_targets(key, b, total, stratified),
            at=at,
            globalize=lambda out, owner, capacity: out._replace(
                indices=out.indices + owner * capacity
            ),
            faults=lambda total, call: mass_faults(total, call, "item"),
        )
    raise TypeError(
        f"`{_NAME}`: a {type(replay).__name__} inside a ClusteredReplay shard is not supported "
        "(the inner replay must be a UniformReplay or a PrioritisedReplay)."
    )


def _draw_clustered(
    replay: ClusteredReplay,
    key: PRNGKeyArray,
    batch_size: int,
    axis: str,
    n: int,
    me: Array,
    call: str,
) -> Any:
    """The global clustered law: a cluster by the global cluster sizes, then the inner law
    over that cluster's items in every shard."""
    law = _item_law(replay.clusters)
    # (shards, clusters) each
    sizes, masses = per_shard((replay.cluster_sizes, jax.vmap(law.mass)(replay.clusters)), axis, n)
    cluster_key, target_key = jax.random.split(key)
    chosen = choose_clusters(
        cluster_key, jnp.sum(sizes, axis=0), replay.distribution_power, batch_size
    )
    row_masses = masses[:, chosen].T  # (batch, shards): the chosen cluster's mass per shard
    row_totals = jnp.sum(row_masses, axis=-1)
    targets = law.targets(target_key, batch_size, row_totals)
    owner, residual = locate(targets, row_masses)
    mine = owner == me
    residual = jnp.where(mine, residual, 0)
    draws = jax.vmap(lambda r: law.at(r, residual, row_totals))(replay.clusters)
    rows = jnp.arange(batch_size)
    picked = jax.tree.map(lambda x: x[chosen, rows], draws)
    # Each row's probability is within its cluster: divided by that cluster's global total.
    out = assemble(picked, mine, axis)
    out = law.globalize(out, owner, replay.clusters.max_size)
    total_size = jnp.sum(sizes)
    faults = [(total_size == 0, f"`{call}`: cannot sample from an empty ClusteredReplay")]
    return check_faults(out, faults, order_reads=False)
