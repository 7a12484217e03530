from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractReplay
from ._checks import (
    _INT32_MAX,
    check_finite_float,
    check_fn_output,
    check_index_fn,
    check_items,
    check_mask,
    check_positive_int,
    check_vector,
    is_concrete,
    out_of_range,
)


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
        if self.num_clusters * inner.max_size > _INT32_MAX:
            raise ValueError(
                f"`ClusteredReplay`: {self.num_clusters} clusters of capacity {inner.max_size} "
                f"hold more than {_INT32_MAX} items; the total size must fit in int32."
            )
        size = inner.size
        if is_concrete(size) and int(size) != 0:
            raise ValueError(
                f"`ClusteredReplay(inner=...)` must be an empty replay (it is the template of "
                f"every cluster), but it holds {int(size)} items."
            )
        check_index_fn(_item_spec(inner), cluster_fn, "ClusteredReplay(cluster_fn=...)")
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

    def add(self: _C, item: PyTree[ArrayLike]) -> _C:
        call = "ClusteredReplay.add"
        item, _ = check_items(self._item_spec(), item, call, batched=False)
        return _insert(self, jax.tree.map(lambda x: x[None], item), None, call)

    def add_batch(
        self: _C, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _C:
        call = "ClusteredReplay.add_batch"
        items, n = check_items(self._item_spec(), items, call, batched=True)
        assert n is not None
        if mask is not None:
            mask = check_mask(mask, n, call)
        if n == 0:
            return self
        return _insert(self, items, mask, call)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """Draw `batch_size` rows: for each, a cluster, then an item from that cluster.

        **Returns:** what the inner replay's `sample` returns, with a leading `batch_size`
        axis; each row comes from the cluster drawn for it.

        **Raises:** an `eqx.error_if` error if every cluster is empty.
        """
        batch_size = check_positive_int(batch_size, "ClusteredReplay.sample(batch_size=...)")
        return _sample(self, key, batch_size)

    def _draw(self, key: PRNGKeyArray, batch_size: int) -> Any:
        keys = jax.random.split(key, self.num_clusters + 1)
        sizes = self.cluster_sizes
        # Weights in log space: `size ** power` can overflow float32 for large powers, and an
        # empty cluster must get weight exactly zero for every power (`0.0 ** 0.0 == 1`).
        log_size = jnp.log(jnp.maximum(sizes, 1).astype(jnp.float32))
        logits = jnp.where(sizes > 0, self.distribution_power * log_size, -jnp.inf)
        cdf = jnp.cumsum(jnp.exp(logits - jnp.max(logits)))
        # Inverse-CDF draw: row j takes the first cluster whose cumulative weight exceeds
        # u_j * total. An empty cluster adds nothing to the cdf, so it is never the first to
        # exceed. The clip guards the rounding of u_j * total up to total (and an empty replay).
        u = jax.random.uniform(keys[0], (batch_size,), jnp.float32)
        chosen = jnp.searchsorted(cdf, u * cdf[-1], side="right", method="compare_all")
        chosen = jnp.minimum(chosen, jnp.argmax(cdf)).astype(jnp.int32)
        # Every cluster draws a full batch (empty ones too: `_draw` does not check), and row j
        # is kept from the cluster chosen for it. Generic over whatever `_draw` returns, and
        # rows stay independent because each cluster's rows are.
        draws = eqx.filter_vmap(lambda r, k: r._draw(k, batch_size))(self.clusters, keys[1:])
        rows = jnp.arange(batch_size)
        return jax.tree.map(lambda x: x[chosen, rows], draws)

    def set_priorities(
        self: _C,
        cluster_ids: Integer[ArrayLike, " n"],
        indices: Int[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
    ) -> _C:
        """Set priorities in the clusters of a prioritised inner replay.

        For an inner replay with `set_priorities` (a `PrioritisedReplay`): entry `j` sets
        the priority of slot `indices[j]` of cluster `cluster_ids[j]`. A sample's `indices`
        are slots within the cluster each row came from, and the cluster of a row is
        `cluster_fn` of its item: `cluster_ids = jax.vmap(replay.cluster_fn)(sample.items)`.
        Within one cluster, the last of repeated indices wins.

        **Arguments:**

        - `cluster_ids`: integer array of shape `(n,)`, ids in `[0, num_clusters)`.
        - `indices`: integer array of shape `(n,)`, stored slots of those clusters.
        - `priorities`: array of shape `(n,)`, finite and non-negative.

        **Returns:** the new replay.

        **Raises:** `TypeError` at once if the inner replay has no `set_priorities`; an
        `eqx.error_if` error if a cluster id is out of range, or for what the inner
        `set_priorities` rejects (an index that is not a stored slot of its cluster, a
        negative or non-finite priority).
        """
        call = "ClusteredReplay.set_priorities"
        if not callable(getattr(self.clusters, "set_priorities", None)):
            raise TypeError(
                f"`{call}`: the inner replay, a {type(self.clusters).__name__}, has no "
                "priorities (no `set_priorities` method)."
            )
        # All three checked here, so that a mismatch names this call and its arguments.
        cluster_ids = check_vector(cluster_ids, None, call, "cluster_ids", kind="integer")
        n = cluster_ids.shape[0]
        indices = check_vector(indices, n, call, "indices", kind="integer")
        priorities = check_vector(priorities, n, call, "priorities", kind="real")
        return _set_priorities(self, cluster_ids, indices, priorities, call)

    def update(self: _C, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _C:
        check_fn_output(self._item_spec(), fn, "ClusteredReplay.update")
        clusters = eqx.filter_vmap(lambda r: r.update(fn))(self.clusters)
        return eqx.tree_at(lambda r: r.clusters, self, clusters)

    def _item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return _item_spec(self.clusters, stacked=True)


# The vectorised bodies of add and sample are jitted: inside a user's `jit` they are inlined, and
# called eagerly they compile once instead of dispatching (and compiling) every vmapped primitive
# on its own. Not `update`: its `fn` is often a fresh lambda, which would compile on every call.


@eqx.filter_jit
def _insert(replay: _C, items: PyTree[Array], mask: Bool[Array, " n"] | None, call: str) -> _C:
    """Add each valid item to the cluster `cluster_fn` names; an id out of range is an error."""
    ids = jnp.asarray(jax.vmap(replay.cluster_fn)(items))
    bad = out_of_range(ids, replay.num_clusters)
    valid = jnp.ones(ids.shape, jnp.bool_) if mask is None else mask
    # Checked before the cast, which could wrap an out-of-range id into range.
    ids = ids.astype(jnp.int32)

    def add_to(cluster: AbstractReplay, c: Int[Array, ""]) -> AbstractReplay:
        # The masked add keeps the order of the valid items, so each cluster receives its
        # items exactly as sequential adds would give them, overflow included.
        return cluster.add_batch(items, mask=valid & (ids == c))

    clusters = eqx.filter_vmap(add_to)(
        replay.clusters, jnp.arange(replay.num_clusters, dtype=jnp.int32)
    )
    clusters = _guard_counters(
        clusters,
        jnp.any(valid & bad),
        f"`{call}`: `cluster_fn` returned a cluster id outside [0, num_clusters) = "
        f"[0, {replay.num_clusters})",
    )
    return eqx.tree_at(lambda r: r.clusters, replay, clusters)


@eqx.filter_jit
def _set_priorities(
    replay: _C, ids: Array, indices: ArrayLike, priorities: ArrayLike, call: str
) -> _C:
    bad = out_of_range(ids, replay.num_clusters)
    ids = ids.astype(jnp.int32)  # after the check: a cast could wrap an id into range

    def set_in(cluster: Any, c: Int[Array, ""]) -> Any:
        return cluster.set_priorities(indices, priorities, mask=ids == c)

    clusters = eqx.filter_vmap(set_in)(
        replay.clusters, jnp.arange(replay.num_clusters, dtype=jnp.int32)
    )
    clusters = _guard_counters(
        clusters,
        jnp.any(bad),
        f"`{call}`: a cluster id is outside [0, num_clusters) = [0, {replay.num_clusters})",
    )
    return eqx.tree_at(lambda r: r.clusters, replay, clusters)


@eqx.filter_jit
def _sample(replay: ClusteredReplay, key: PRNGKeyArray, batch_size: int) -> Any:
    return eqx.error_if(
        replay._draw(key, batch_size),
        replay.size == 0,
        "cannot sample from an empty ClusteredReplay",
    )


def _item_spec(replay: AbstractReplay, *, stacked: bool = False) -> PyTree[jax.ShapeDtypeStruct]:
    """The structure, shapes and dtypes of one item of any replay, found at trace time.

    The abstract surface has no item spec, but every replay's `update(fn)` calls `fn` on items:
    a probe `fn` records what it is given, under `eval_shape`, so nothing runs.
    """
    seen = []

    def probe(item: PyTree[Array]) -> PyTree[Array]:
        if not seen:
            seen.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), item))
        return item

    def run(r: AbstractReplay) -> AbstractReplay:
        return eqx.filter_vmap(lambda c: c.update(probe))(r) if stacked else r.update(probe)

    eqx.filter_eval_shape(run, replay)
    return seen[0]


def _guard_counters(clusters: AbstractReplay, pred: Bool[Array, ""], msg: str) -> AbstractReplay:
    """Thread `eqx.error_if(pred, msg)` through the small counters of the new clusters.

    The guard must sit on an output, but the layout of the inner replay is not ours to know:
    its leaves of the fewest dimensions are its scalars (sizes, write positions), one per
    cluster. Guarding those, never the storage, costs nothing and keeps the check alive.
    """
    leaves, treedef = jax.tree.flatten(clusters)
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    fewest = min(leaves[i].ndim for i in arrays)
    small = [i for i in arrays if leaves[i].ndim == fewest]
    guarded = eqx.error_if([leaves[i] for i in small], pred, msg)
    for i, x in zip(small, guarded):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
