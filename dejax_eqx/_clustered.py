from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real, UInt32

from ._abstract import AbstractPrioritisedReplay, AbstractReplay, Indices
from ._checks import (
    check_finite_float,
    check_fn_output,
    check_generations,
    check_index,
    check_index_fn,
    check_items,
    check_mask,
    check_positive_int,
    check_vector,
    INT32_MAX,
    plural,
)
from ._deprecated import renamed, warn_replaced
from ._faults import check_faults, Fault, guarded, is_concrete, vmap_checked
from ._laws import AbstractLaw, Draw
from ._policy_age import PolicyAge
from ._results import inherited_result, reports, Result
from ._storage import check_batch


_C = TypeVar("_C", bound="ClusteredReplay")


class ClusteredReplay(AbstractReplay):
    """Items sorted into clusters, each with its own replay; sampling balances the clusters.

    `cluster_fn(item)` names the cluster of every added item. Each cluster is a copy of the
    `inner` replay (any `AbstractReplay`: `UniformReplay`, another `ClusteredReplay`, ...) with
    its own capacity, so a flood of items in one cluster never evicts another cluster's items.
    Sampling first draws a cluster for each row, then lets that cluster's replay draw the item,
    so that, for example, rare high-reward episodes are replayed as often as common ones.

    A draw picks the non-empty cluster `c` with probability proportional to
    `size_c ** distribution_power`: `0.0` (the default) is uniform over the non-empty
    clusters, `1.0` is proportional to their sizes (for a `UniformReplay` inner, uniform over
    all stored items), values in between interpolate. Empty clusters are never drawn. Rows are
    independent draws (with replacement), and any `batch_size` works.

    The clusters are stored as one module: every array of `inner` gains a leading axis of
    length `num_clusters` (the `clusters` field), and every operation is vectorised over it.

    **Cost.** `add_batch` of `n` items does `num_clusters` masked writes of the batch:
    O(num_clusters · n) work, no loop over items. `sample` draws `batch_size` rows from every
    cluster and keeps, for each row, the one from its chosen cluster: O(num_clusters ·
    batch_size) inner draws. Memory is `num_clusters` times that of `inner`.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        item = {"obs": jnp.zeros(3), "reward": jnp.asarray(0.0)}


        def cluster_fn(item):  # 0: no reward, 1: some reward
            return (item["reward"] > 0).astype(jnp.int32)


        buf = dx.ClusteredReplay(dx.UniformReplay(item, max_size=100), 2, cluster_fn)
        rewards = jnp.zeros(20).at[3].set(1.0)  # one rewarded item among twenty
        buf = buf.add_batch({"obs": jnp.ones((20, 3)), "reward": rewards})
        assert buf.cluster_sizes.tolist() == [19, 1]
        batch = buf.sample(jax.random.key(0), batch_size=1000)
        # About half of the rows are the single rewarded item.
        assert 400 < int((batch["reward"] > 0).sum()) < 600
        ```
    """

    clusters: AbstractReplay
    num_clusters: int = eqx.field(static=True)
    cluster_fn: Callable[[PyTree[Array]], Integer[ArrayLike, ""]] = eqx.field(static=True)
    distribution_power: float = eqx.field(static=True)
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self,
        inner: AbstractReplay,
        num_clusters: int,
        cluster_fn: Callable[[PyTree[Array]], Integer[ArrayLike, ""]],
        distribution_power: float = 0.0,
        *,
        throw: bool | None = None,
    ):
        """**Arguments:**

        - `inner`: an empty replay, the template of every cluster: each cluster is a copy of
            it, with its capacity. Any `AbstractReplay`.
        - `num_clusters`: the number of clusters, a positive Python int.
        - `cluster_fn`: `cluster_fn(item) -> cluster id`, an integer scalar in
            `[0, num_clusters)`. It must be traceable (it runs under `jit` and `vmap`); an id
            outside the range is an error when the item is added, never clipped. It is a
            static part of the replay compared by identity: keep one function object (a
            module-level `def`); a fresh `lambda` for each new replay compiles the steps that
            use it again.
        - `distribution_power`: a finite Python float; a draw picks non-empty cluster `c` with
            probability proportional to `size_c ** distribution_power`.
        - `throw`: how a fault is reported (as `UniformReplay`'s `throw`); `None` (the
            default): as the buffer it is made over reports its own.
        """
        if not isinstance(inner, AbstractReplay):
            raise TypeError(
                "`ClusteredReplay(inner=...)` must be a replay (an `AbstractReplay` such as "
                f"`UniformReplay` or `PrioritisedReplay`), got a {type(inner).__name__}."
            )
        if inner.layered:
            raise TypeError(
                "`ClusteredReplay(inner=...)` must be a replay, not a layer over replays (a "
                f"{type(inner).__name__}): each cluster would keep its own copy of the layer's "
                "state. Cluster the replay, and wrap the ClusteredReplay instead."
            )
        self.num_clusters = check_positive_int(num_clusters, "ClusteredReplay(num_clusters=...)")
        if not callable(cluster_fn):
            raise TypeError(
                "`ClusteredReplay(cluster_fn=...)` must be a function `item -> cluster id`, "
                f"got {cluster_fn!r}."
            )
        self.cluster_fn = cluster_fn
        self.distribution_power = check_finite_float(
            distribution_power, "ClusteredReplay(distribution_power=...)"
        )
        if self.num_clusters * inner.max_size > INT32_MAX:
            raise ValueError(
                f"`ClusteredReplay`: {self.num_clusters} clusters of capacity {inner.max_size} "
                f"hold more than {INT32_MAX} items; the total size must fit in int32."
            )
        size = inner.size
        if is_concrete(size) and int(size) != 0:
            raise ValueError(
                f"`ClusteredReplay(inner=...)` must be an empty replay (it is the template of "
                f"every cluster), but it holds {plural(int(size), 'item')}."
            )
        check_index_fn(inner.item_spec, cluster_fn, "ClusteredReplay(cluster_fn=...)")
        self.result = inherited_result(throw, inner, "ClusteredReplay(throw=...)")
        self.clusters = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (self.num_clusters, *x.shape)) if eqx.is_array(x) else x,
            inner,
        )

    @property
    def max_size(self) -> int:
        """The total capacity, `num_clusters * inner.max_size`.

        Each cluster holds at most `inner.max_size` items of its own: the replay can be full
        only when every cluster is.
        """
        return self.num_clusters * self.clusters.max_size

    @property
    def size(self) -> Int[Array, ""]:
        """The number of stored items over all clusters."""
        return jnp.sum(self.cluster_sizes, dtype=jnp.int32)

    @property
    def cluster_sizes(self) -> Int[Array, " num_clusters"]:
        """The number of items stored in each cluster."""
        return eqx.filter_vmap(lambda r: r.size)(self.clusters)

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        # One cluster, as shapes only: the stacked clusters without their leading axis. (A
        # nested ClusteredReplay meets shapes here, not arrays: `self` may itself be one.)
        one = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
                if isinstance(x, jax.Array | jax.ShapeDtypeStruct)
                else x
            ),
            self.clusters,
        )
        return one.item_spec

    @reports
    def add(self: _C, item: PyTree[ArrayLike]) -> _C:
        call = "ClusteredReplay.add"
        item, _ = check_items(self.item_spec, item, call, batched=False)
        return self._insert(jax.tree.map(lambda x: x[None], item), None, call)

    @reports
    def add_batch(
        self: _C, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _C:
        call = "ClusteredReplay.add_batch"
        items, mask = check_batch(self.item_spec, items, mask, call)
        if jax.tree.leaves(items)[0].shape[0] == 0:
            return self
        return self._insert(items, mask, call)

    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "ClusteredReplay.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """For each row, a cluster `c` with probability `∝ size_c ** distribution_power` among
        those that hold an item the inner law can draw, then an item of `c` by the inner
        replay's law (with `age`, its aged law); the rows are what the inner replay's
        `sample` returns. Over a union of replays (a `GlobalReplay`'s shards), the cluster
        sizes are summed over the union, and the inner law runs over the cluster's union."""
        inner, faults = self.clusters.law(age=age, beta=beta, call=call)
        return ClusteredLaw(inner, self.num_clusters, self.distribution_power), faults

    def split_indices(self, indices: Indices) -> tuple[Int[Array, " n"], Any]:
        ids, local = _pair(indices, "ClusteredReplay.split_indices")
        owner, local = self.clusters.split_indices(local)
        return owner, (jnp.asarray(ids), local)

    @reports
    def set_priorities(
        self: _C,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        legacy: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
        stamps: UInt32[ArrayLike, " n"] | None = None,
    ) -> _C:
        """Set priorities in the clusters of a prioritised inner replay.

        For an inner `AbstractPrioritisedReplay` (a `PrioritisedReplay`): entry `j` of
        `indices = (cluster_ids, slots)` sets the priority of slot `slots[j]` of cluster
        `cluster_ids[j]`. A sample's `indices` are slots within the cluster each row came
        from, and the cluster of a row is `cluster_fn` of its item: `cluster_ids =
        jax.vmap(replay.cluster_fn)(sample.items)`. Within one cluster, the last of repeated
        indices wins.

        **Arguments:**

        - `indices`: a pair `(cluster_ids, slots)` of integer arrays of shape `(n,)`: ids in
            `[0, num_clusters)`, and stored slots of those clusters.
        - `priorities`: array of shape `(n,)`, finite and non-negative.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are set (and checked); the others may hold anything.
        - `generations`: optional uint32 array of shape `(n,)`, the sample's `generations`:
            an entry whose slot has been written since is ignored (see
            `PrioritisedReplay.set_priorities`).
        - `legacy`, `stamps`: the deprecated forms: `set_priorities(cluster_ids, slots,
            priorities)`, and `generations` under its old name (removed in the next release).

        **Returns:** the new replay.

        **Raises:** `TypeError` at once if the inner replay has no priorities; an
        `eqx.error_if` error if a cluster id is out of range, or for what the inner
        `set_priorities` rejects (an index that is not a stored slot of its cluster, a
        negative or non-finite priority).
        """
        call = "ClusteredReplay.set_priorities"
        if legacy is not None:
            warn_replaced(
                f"{call}(cluster_ids, indices, priorities)",
                f"{call}((cluster_ids, indices), priorities)",
            )
            indices, priorities = (indices, priorities), legacy  # pyright: ignore
        generations = renamed(generations, stamps, "generations", "stamps", call)
        if not isinstance(self.clusters, AbstractPrioritisedReplay):
            raise TypeError(
                f"`{call}`: the inner replay, a {type(self.clusters).__name__}, has no "
                "priorities (it is not an `AbstractPrioritisedReplay`)."
            )
        cluster_ids, slots = _pair(indices, call)
        # All three checked here, so that a mismatch names this call and its arguments.
        ids, bad = check_index(cluster_ids, self.num_clusters, f"{call}(cluster_ids=...)", ndim=1)
        n = ids.shape[0]
        # Out-of-range slots become `max_size`, which the inner `set_priorities` reports.
        slots, _ = check_index(
            slots, self.clusters.max_size, f"{call}(indices=...)", ndim=1, length=(n, "cluster id")
        )
        # Checked here, converted by the inner replay (to the dtype of its priorities, from
        # the values' own dtype: an int64 is not wrapped on the way).
        priorities = check_vector(priorities, n, call, "priorities")
        if generations is not None:
            generations = check_generations(generations, n, call)
        valid = jnp.ones(n, jnp.bool_) if mask is None else check_mask(mask, n, call)
        # The guard sits on the ids, which every cluster's update reads.
        ids = check_faults(
            ids,
            [
                (
                    bad & valid,
                    f"`{call}`: a cluster id is outside [0, num_clusters) = "
                    f"[0, {self.num_clusters})",
                )
            ],
            safe=jnp.full_like(ids, self.num_clusters),  # recording: no cluster is updated
        )

        def set_in(cluster: AbstractPrioritisedReplay, c: Int[Array, ""]):
            return cluster.set_priorities(
                slots, priorities, mask=valid & (ids == c), generations=generations
            )

        every = jnp.arange(self.num_clusters, dtype=jnp.int32)
        clusters, faults = vmap_checked(set_in, self.clusters, every)
        return eqx.tree_at(lambda r: r.clusters, self, guarded(clusters, faults))

    @reports
    def note_priorities(
        self: _C,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _C:
        call = "ClusteredReplay.note_priorities"
        cluster_ids, slots = _pair(indices, call)
        ids, _ = check_index(cluster_ids, self.num_clusters, f"{call}(cluster_ids=...)", ndim=1)
        n = ids.shape[0]
        valid = jnp.ones(n, jnp.bool_) if mask is None else check_mask(mask, n, call)

        def note_in(cluster: AbstractReplay, c: Int[Array, ""]) -> AbstractReplay:
            return cluster.note_priorities(slots, priorities, mask=valid & (ids == c))

        every = jnp.arange(self.num_clusters, dtype=jnp.int32)
        clusters = eqx.filter_vmap(note_in)(self.clusters, every)
        return eqx.tree_at(lambda r: r.clusters, self, clusters)

    @reports
    def update(self: _C, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _C:
        check_fn_output(self.item_spec, fn, "ClusteredReplay.update")
        clusters, faults = vmap_checked(lambda r: r.update(fn), self.clusters)
        return eqx.tree_at(lambda r: r.clusters, self, guarded(clusters, faults))

    def _insert(self: _C, items: PyTree[Array], mask: Bool[Array, " n"] | None, call: str) -> _C:
        """Add each valid item to the cluster `cluster_fn` names; an id out of range is an
        error. O(num_clusters · n): every cluster makes a masked add of the whole batch."""
        ids, bad = check_index(jax.vmap(self.cluster_fn)(items), self.num_clusters, call)
        valid = jnp.ones(ids.shape, jnp.bool_) if mask is None else mask
        # The guard sits on the ids, which every cluster's add reads.
        ids = check_faults(
            ids,
            [
                (
                    valid & bad,
                    f"`{call}`: `cluster_fn` returned a cluster id outside [0, num_clusters) = "
                    f"[0, {self.num_clusters})",
                )
            ],
            safe=jnp.full_like(ids, self.num_clusters),  # recording: no cluster takes an item
        )

        def add_to(cluster: AbstractReplay, c: Int[Array, ""]) -> AbstractReplay:
            # The masked add keeps the order of the valid items, so each cluster receives its
            # items exactly as sequential adds would give them, overflow included.
            return cluster.add_batch(items, mask=valid & (ids == c))

        every = jnp.arange(self.num_clusters, dtype=jnp.int32)
        clusters, faults = vmap_checked(add_to, self.clusters, every)
        return eqx.tree_at(lambda r: r.clusters, self, guarded(clusters, faults))


def choose_clusters(
    key: PRNGKeyArray, sizes: Int[Array, " num_clusters"], power: float, batch_size: int
) -> Int[Array, " batch"]:
    """`batch_size` clusters drawn with probability `∝ size ** power` among the non-empty
    ones (meaningless, in range, when every cluster is empty)."""
    # Weights in log space: `size ** power` can overflow float32 for large powers, and an
    # empty cluster must get weight exactly zero for every power (`0.0 ** 0.0 == 1`).
    log_size = jnp.log(jnp.maximum(sizes, 1).astype(jnp.float32))
    logits = jnp.where(sizes > 0, power * log_size, -jnp.inf)
    cdf = jnp.cumsum(jnp.exp(logits - jnp.max(logits)))
    # Inverse-CDF draw: row j takes the first cluster whose cumulative weight exceeds
    # u_j * total. An empty cluster adds nothing to the cdf, so it is never the first to
    # exceed. The clip guards the rounding of u_j * total up to total (and an empty replay).
    u = jax.random.uniform(key, (batch_size,), jnp.float32)
    chosen = jnp.searchsorted(cdf, u * cdf[-1], side="right", method="compare_all")
    return jnp.minimum(chosen, jnp.argmax(cdf)).astype(jnp.int32)


def _pair(indices: Any, call: str) -> tuple[Any, Any]:
    """The `(cluster_ids, slots)` of a clustered replay's `indices`."""
    if not (isinstance(indices, tuple) and len(indices) == 2):
        raise TypeError(
            f"`{call}`: the indices of a ClusteredReplay are a pair `(cluster_ids, slots)` "
            f"(a cluster, and a slot in it); got a {type(indices).__name__}."
        )
    return indices


class ClusteredLaw(AbstractLaw):
    """A `ClusteredReplay`'s law: for each row a cluster `c` by `size_c ** power` among the
    clusters whose inner law has something to draw, then the inner law within `c`. Over a
    union of replays, the cluster sizes add up across the union and the inner law runs over
    the union of cluster `c`'s replays (one per buffer), row by row."""

    inner: AbstractLaw
    num_clusters: int = eqx.field(static=True)
    power: float = eqx.field(static=True)

    def summary(self, buffer: ClusteredReplay) -> PyTree[Array]:
        inner = eqx.filter_vmap(self.inner.summary)(buffer.clusters)
        return buffer.cluster_sizes, inner

    def _clusters(self, summaries: PyTree[Array]) -> tuple[Array, Array, PyTree[Array]]:
        """Each cluster's size over the union, whether it has anything to draw, and its
        inner summaries (a leading axis of clusters, then of buffers)."""
        sizes, inner = summaries
        per_cluster = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), inner)
        available = jax.vmap(self.inner.available)(per_cluster)
        return jnp.sum(sizes, axis=0), available, per_cluster

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        sizes, available, per_cluster = self._clusters(summaries)
        cluster_key, row_key = jax.random.split(key)
        chosen = choose_clusters(
            cluster_key, jnp.where(available, sizes, 0), self.power, batch_size
        )
        # Row j is drawn by the inner law over the union of cluster chosen[j]'s replays.
        rows = jax.tree.map(lambda x: x[chosen], per_cluster)
        keys = jax.random.split(row_key, batch_size)
        drawn = jax.vmap(lambda k, s: self.inner.draw(k, 1, s))(keys, rows)
        at = jax.tree.map(lambda x: x[:, 0], drawn.at)
        return Draw(drawn.owner[:, 0], (chosen, at))

    def read(self, buffer: ClusteredReplay, at: PyTree[Array]) -> PyTree[Array]:
        chosen, inner_at = at
        # Every cluster reads every row (its own law's coordinates are in range for any of
        # them), and row j is kept from the cluster chosen for it: generic over whatever the
        # inner law reads. O(num_clusters · batch_size).
        rows = eqx.filter_vmap(lambda r: self.inner.read(r, inner_at))(buffer.clusters)
        return jax.tree.map(lambda x: x[chosen, jnp.arange(chosen.shape[0])], rows)

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> Any:
        chosen, inner_at = draw.at
        per_row = jax.tree.map(lambda x: x[chosen], self._clusters(summaries)[2])

        def one(row, owner, at, s):
            add = lambda x: x[None]  # noqa: E731
            out = self.inner.finish(
                jax.tree.map(add, row), Draw(owner[None], jax.tree.map(add, at)), s
            )
            return jax.tree.map(lambda x: x[0], out)

        return jax.vmap(one)(rows, draw.owner, inner_at, per_row)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return jnp.any(self._clusters(summaries)[1])

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        sizes, available, per_cluster = self._clusters(summaries)
        empty = jnp.sum(sizes) == 0
        # An inner fault counts where its cluster can be chosen (a cluster with nothing to
        # draw is left out, and only an error if every one is).
        inner = [
            (jnp.any(jnp.asarray(pred) & available), message)
            for pred, message in _cluster_faults(self.inner, per_cluster, call)
        ]
        return [
            (empty, f"`{call}`: cannot sample from an empty ClusteredReplay"),
            (
                ~empty & ~jnp.any(available),
                f"`{call}`: no cluster holds an item that can be drawn (every stored item "
                "has priority 0, or is older than `max_age`)",
            ),
            *inner,
        ]


def _cluster_faults(law: AbstractLaw, per_cluster: PyTree[Array], call: str) -> list[Fault]:
    """The inner law's faults of each cluster: one flag per cluster, and the message."""
    messages: list[str] = []

    def one(s):
        faults = law.faults(s, call)
        messages[:] = [m for _, m in faults]
        return [jnp.any(jnp.asarray(p)) for p, _ in faults]

    preds = jax.vmap(one)(per_cluster)
    return list(zip(preds, messages))
