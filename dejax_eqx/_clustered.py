from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real, UInt32

from ._abstract import AbstractPrioritisedReplay, AbstractReplay
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
from ._deprecated import renamed
from ._faults import check_faults, is_concrete
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

    def __init__(
        self,
        inner: AbstractReplay,
        num_clusters: int,
        cluster_fn: Callable[[PyTree[Array]], Integer[ArrayLike, ""]],
        distribution_power: float = 0.0,
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
        """
        if not isinstance(inner, AbstractReplay):
            raise TypeError(
                "`ClusteredReplay(inner=...)` must be a replay (an `AbstractReplay` such as "
                f"`UniformReplay` or `PrioritisedReplay`), got a {type(inner).__name__}."
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

    def add(self: _C, item: PyTree[ArrayLike]) -> _C:
        call = "ClusteredReplay.add"
        item, _ = check_items(self.item_spec, item, call, batched=False)
        return self._insert(jax.tree.map(lambda x: x[None], item), None, call)

    def add_batch(
        self: _C, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _C:
        call = "ClusteredReplay.add_batch"
        items, mask = check_batch(self.item_spec, items, mask, call)
        if jax.tree.leaves(items)[0].shape[0] == 0:
            return self
        return self._insert(items, mask, call)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """Draw `batch_size` rows: for each, a cluster, then an item from that cluster.

        **Returns:** what the inner replay's `sample` returns, with a leading `batch_size`
        axis; each row comes from the cluster drawn for it.

        **Raises:** an `eqx.error_if` error if every cluster is empty.
        """
        call = "ClusteredReplay.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        return check_faults(
            self.sample_unchecked(key, batch_size),
            [(self.size == 0, f"`{call}`: cannot sample from an empty ClusteredReplay")],
            order_reads=False,
        )

    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> Any:
        keys = jax.random.split(key, self.num_clusters + 1)
        chosen = choose_clusters(keys[0], self.cluster_sizes, self.distribution_power, batch_size)
        # Every cluster draws a full batch (empty ones too: the draw is unchecked), and row j
        # is kept from the cluster chosen for it. Generic over whatever the inner replay
        # returns, and rows stay independent because each cluster's rows are.
        draws = eqx.filter_vmap(lambda r, k: r.sample_unchecked(k, batch_size))(
            self.clusters, keys[1:]
        )
        rows = jnp.arange(batch_size)
        return jax.tree.map(lambda x: x[chosen, rows], draws)

    def set_priorities(
        self: _C,
        cluster_ids: Integer[ArrayLike, " n"],
        indices: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
        stamps: UInt32[ArrayLike, " n"] | None = None,
    ) -> _C:
        """Set priorities in the clusters of a prioritised inner replay.

        For an inner `AbstractPrioritisedReplay` (a `PrioritisedReplay`): entry `j` sets
        the priority of slot `indices[j]` of cluster `cluster_ids[j]`. A sample's `indices`
        are slots within the cluster each row came from, and the cluster of a row is
        `cluster_fn` of its item: `cluster_ids = jax.vmap(replay.cluster_fn)(sample.items)`.
        Within one cluster, the last of repeated indices wins.

        **Arguments:**

        - `cluster_ids`: integer array of shape `(n,)`, ids in `[0, num_clusters)`.
        - `indices`: integer array of shape `(n,)`, stored slots of those clusters.
        - `priorities`: array of shape `(n,)`, finite and non-negative.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are set (and checked); the others may hold anything.
        - `generations`: optional uint32 array of shape `(n,)`, the sample's `generations`:
            an entry whose slot has been written since is ignored (see
            `PrioritisedReplay.set_priorities`).
        - `stamps`: the deprecated name of `generations` (removed in the next release).

        **Returns:** the new replay.

        **Raises:** `TypeError` at once if the inner replay has no priorities; an
        `eqx.error_if` error if a cluster id is out of range, or for what the inner
        `set_priorities` rejects (an index that is not a stored slot of its cluster, a
        negative or non-finite priority).
        """
        call = "ClusteredReplay.set_priorities"
        generations = renamed(generations, stamps, "generations", "stamps", call)
        if not isinstance(self.clusters, AbstractPrioritisedReplay):
            raise TypeError(
                f"`{call}`: the inner replay, a {type(self.clusters).__name__}, has no "
                "priorities (it is not an `AbstractPrioritisedReplay`)."
            )
        # All three checked here, so that a mismatch names this call and its arguments.
        ids, bad = check_index(cluster_ids, self.num_clusters, f"{call}(cluster_ids=...)", ndim=1)
        n = ids.shape[0]
        # Out-of-range slots become `max_size`, which the inner `set_priorities` reports.
        indices, _ = check_index(
            indices,
            self.clusters.max_size,
            f"{call}(indices=...)",
            ndim=1,
            length=(n, "cluster id"),
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
        )
        clusters: AbstractPrioritisedReplay = self.clusters

        def set_in(cluster: AbstractPrioritisedReplay, c: Int[Array, ""]):
            return cluster.set_priorities(
                indices, priorities, mask=valid & (ids == c), generations=generations
            )

        clusters = eqx.filter_vmap(set_in)(clusters, jnp.arange(self.num_clusters, dtype=jnp.int32))
        return eqx.tree_at(lambda r: r.clusters, self, clusters)

    def update(self: _C, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _C:
        check_fn_output(self.item_spec, fn, "ClusteredReplay.update")
        clusters = eqx.filter_vmap(lambda r: r.update(fn))(self.clusters)
        return eqx.tree_at(lambda r: r.clusters, self, clusters)

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
        )

        def add_to(cluster: AbstractReplay, c: Int[Array, ""]) -> AbstractReplay:
            # The masked add keeps the order of the valid items, so each cluster receives its
            # items exactly as sequential adds would give them, overflow included.
            return cluster.add_batch(items, mask=valid & (ids == c))

        clusters = eqx.filter_vmap(add_to)(
            self.clusters, jnp.arange(self.num_clusters, dtype=jnp.int32)
        )
        return eqx.tree_at(lambda r: r.clusters, self, clusters)


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
