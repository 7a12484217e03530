"""GlobalReplay: a replay's items split over every device of a mesh, across processes."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Real

from ._checks import check_positive_int
from ._clustered import ClusteredReplay
from ._global import AbstractGlobalBuffer
from ._global_draws import sample_replay
from ._global_routes import set_cluster_priorities, set_item_priorities, stale_items
from ._prioritised import PrioritisedReplay
from ._shard_map import compiled
from ._uniform import UniformReplay


_R = TypeVar("_R", bound="GlobalReplay")


class GlobalReplay(AbstractGlobalBuffer):
    """A replay of `num_shards · shard max_size` items whose shards (a `UniformReplay`,
    `PrioritisedReplay` or `ClusteredReplay` each) live one per device of a mesh axis, also
    across the processes of a `jax.distributed` program.

    - **Adding is local.** `add_batch` takes a global batch split into `num_shards` equal
        blocks, block `k` for shard `k`; no collective. A process builds one from its own
        rows with `rows`.
    - **Sampling is exact and global.** `sample` draws from the law of the whole replay (see
        `sample`) and returns the same batch, with a single replay's layout, everywhere.
    - **Global indices.** Slot `i` of shard `k` is index `k · rows_per_shard + i`: samples
        return these, `set_priorities` and `stale` take them back, and each entry is applied
        by the shard that owns it.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        mesh = jax.make_mesh((jax.device_count(),), ("replay",))
        item = {"obs": jnp.zeros(4)}
        buf = dx.GlobalReplay(mesh, lambda: dx.UniformReplay(item, max_size=1000))
        # Each process gives the rows of its own devices: 8 per shard here.
        local = {"obs": np.ones((8 * buf.num_local_shards, 4), np.float32)}
        buf = buf.add_batch(buf.rows(local))
        batch = buf.sample(jax.random.key(0), 32)
        assert batch["obs"].shape == (32, 4) and int(buf.size) == 8 * buf.num_shards
        ```
    """

    @staticmethod
    def _kinds() -> tuple[type, ...]:
        return (UniformReplay, PrioritisedReplay, ClusteredReplay)

    @property
    def rows_per_shard(self) -> int:
        """Each shard's capacity (`max_size` of a shard)."""
        return self.shards.max_size

    @property
    def max_size(self) -> int:
        """The capacity: `num_shards · rows_per_shard` (static)."""
        return self.num_shards * self.rows_per_shard

    @property
    def size(self) -> Int[Array, ""]:
        """The number of stored items, over every shard (int32)."""
        sizes = jax.vmap(lambda replay: replay.size)(self.shards)
        return jnp.sum(sizes, dtype=jnp.int32)

    @compiled
    def add_batch(
        self: _R,
        items: PyTree[ArrayLike],
        priorities: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _R:
        """The shards' `add_batch`, each shard storing its own block of `items` (and of
        `priorities` and `mask`): rows `k · m .. (k + 1) · m - 1` of `n = num_shards · m`
        go to shard `k`, in order. No collective.

        `priorities` only for `PrioritisedReplay` shards. An item added without one gets its
        shard's largest recorded priority, which `set_priorities` keeps equal on every shard
        (as in a single replay); `priorities` given here raise it only on the shards they go
        to (keeping it equal would need a collective on every add).

        **Raises:** `ValueError` at once if `num_shards` does not divide `n`; what the
        shards' own `add_batch` raises.
        """
        call = "GlobalReplay.add_batch"
        parts: dict[str, Any] = {"items": jax.tree.map(jnp.asarray, items)}
        if mask is not None:
            parts["mask"] = jnp.asarray(mask)
        if priorities is not None:
            if not isinstance(self.shards, PrioritisedReplay):
                raise TypeError(
                    f"`{call}(priorities=...)`: only PrioritisedReplay shards take priorities; "
                    f"these are {type(self.shards).__name__}."
                )
            parts["priorities"] = jnp.asarray(priorities)
        self._split(parts, call)

        def local(replay: Any, parts: dict[str, Any]) -> Any:
            extra = {"priorities": parts["priorities"]} if "priorities" in parts else {}
            return replay.add_batch(parts["items"], mask=parts.get("mask"), **extra)

        return self._update(local, parts)

    @compiled
    def update(self: _R, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _R:
        """`fn(item) -> item` applied to every stored item of every shard."""
        return self._update(lambda replay: replay.update(fn))

    @compiled
    def sample(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """`batch_size` items drawn from the law of the whole replay, with replacement, in
        the form the shards' `sample` returns:

        - `UniformReplay`: each stored item with probability `1 / size`, also when the shards
            are unequally full: the items a single replay holding shard 0's items, then shard
            1's, ..., in order, draws with the same key.
        - `PrioritisedReplay`: `P(i) = p_i ** α / Σ_global p ** α`, i.i.d. or stratified over
            the global total; a `PrioritisedSample` with global `indices` and probabilities
            (`importance_weights(probabilities, replay.size, beta)`).
        - `ClusteredReplay`: non-empty cluster `c` with probability `∝ (Σ_shards size_c) **
            distribution_power`, then the inner law over cluster `c`'s items in every shard
            (a prioritised inner's `indices` are global within the cluster).

        Besides the shards' own reads, it costs one all-reduce of a number per shard (per
        shard and cluster for a `ClusteredReplay`) and one of the batch. The key is
        replicated; the batch is the same on every device.

        **Raises:** as the shards' `sample`, about the whole replay, in every process: an
        empty shard is no error, an empty replay is.
        """
        batch_size = check_positive_int(batch_size, "GlobalReplay.sample(batch_size=...)")
        return sample_replay(self.layout, "GlobalReplay.sample", self.shards, key, batch_size)

    @compiled
    def set_priorities(self: _R, *args: Any, **kwargs: Any) -> _R:
        """The shards' `set_priorities`, with global indices; each entry is applied by the
        shard that owns it:

        - `PrioritisedReplay`: `(indices, priorities, *, mask=None, generations=None)`; an
            entry whose slot has been written since its `generations` is dropped.
        - `ClusteredReplay` of a `PrioritisedReplay`: `(cluster_ids, indices, priorities, *,
            generations=None)`, `indices` global within the cluster.

        Every shard's largest recorded priority rises with every entry, as a single
        replay's. The arguments are replicated: every device reads them all.

        **Raises:** `TypeError` at once for shards without priorities; an `eqx.error_if`
        error, in every process, for an index that names no stored item or a priority that
        is negative or not finite.
        """
        call = "GlobalReplay.set_priorities"
        shard = self.shards
        if isinstance(shard, ClusteredReplay):
            shards = set_cluster_priorities(self.layout, call, shard, *args, **kwargs)
        elif isinstance(shard, PrioritisedReplay):
            shards = set_item_priorities(self.layout, call, shard, *args, **kwargs)
        else:
            raise TypeError(f"`{call}`: {type(shard).__name__} shards have no priorities.")
        return eqx.tree_at(lambda g: g.shards, self, shards)

    @compiled
    def stale(self, indices: Any, generations: Any) -> Bool[Array, " n"]:
        """Which sampled global `indices` have been written since they were sampled (their
        `generations`): the entries `set_priorities` drops. `PrioritisedReplay` shards.
        Replicated; one all-reduce of a byte per entry.

        **Raises:** an `eqx.error_if` error, in every process, for an index that names no
        stored item.
        """
        call = "GlobalReplay.stale"
        if not isinstance(self.shards, PrioritisedReplay):
            raise TypeError(f"`{call}`: {type(self.shards).__name__} shards have no `stale`.")
        return stale_items(self.layout, self.shards, indices, generations, call)
