"""GlobalReplay: a replay's items split over every device of a mesh, across processes."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Real, UInt32

from ._abstract import AbstractPrioritisedReplay, AbstractReplay, Indices
from ._checks import (
    check_generations,
    check_index,
    check_items,
    check_positive_int,
    check_vector,
    INT32_MAX,
)
from ._faults import Fault
from ._global import (
    AbstractGlobalBuffer,
    add_blocks,
    Door,
    door_floats,
    door_mask,
    routed_query,
    routed_write,
)
from ._laws import AbstractLaw
from ._policy_age import PolicyAge
from ._results import reports
from ._shard_map import run
from ._storage import check_batch


_R = TypeVar("_R", bound="GlobalReplay")


class GlobalReplay(AbstractGlobalBuffer, AbstractReplay):
    """A replay of `num_shards · shard max_size` items whose shards (any replay: a
    `UniformReplay`, `PrioritisedReplay`, `ClusteredReplay`, or one of your own) live one per
    device of a mesh axis, also across the processes of a `jax.distributed` program. It is a
    replay itself (an `AbstractReplay`), so the layers over replays take it as they are
    (`RateLimited`, `ReplayService`).

    - **Adding is local.** `add_batch` takes a global batch split into `num_shards` equal
        blocks, block `k` for shard `k`; no collective. A process builds one from its own
        rows with `rows`.
    - **Sampling is exact and global.** `sample` draws by the shards' law over the whole
        replay (with every option of the shards' `sample`) and returns the same batch, with a
        single replay's layout, everywhere.
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

    def __init__(
        self,
        mesh: Mesh,
        make: Callable[[], AbstractReplay] | None = None,
        *,
        axis: str | None = None,
        shards: AbstractReplay | None = None,
        throw: bool | None = None,
    ):
        """`AbstractGlobalBuffer`'s, declared for type checkers (they would make one)."""
        super().__init__(mesh, make, axis=axis, shards=shards, throw=throw)

    @staticmethod
    def _family() -> type:
        return AbstractReplay

    @property
    def rows_per_shard(self) -> int:
        """Each shard's capacity (`max_size` of a shard)."""
        return self.template.max_size

    @property
    def max_size(self) -> int:
        """The capacity: `num_shards · rows_per_shard` (static)."""
        return self.num_shards * self.rows_per_shard

    @property
    def size(self) -> Int[Array, ""]:
        """The number of stored items, over every shard (int32)."""
        sizes = eqx.filter_vmap(lambda replay: replay.size)(self.shards)
        return jnp.sum(sizes, dtype=jnp.int32)

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.template.item_spec

    @reports
    def add(self: _R, item: PyTree[ArrayLike]) -> _R:
        """One item, for a replay of one shard (`add_batch` of one item).

        **Raises:** `ValueError` at once for more than one shard: each shard takes a block of
        every add (use `add_batch` with `num_shards · m` items).
        """
        call = "GlobalReplay.add"
        item, _ = check_items(self.item_spec, item, call, batched=False)
        if self.num_shards != 1:
            raise ValueError(
                f"`{call}`: each of the {self.num_shards} shards takes an equal block of every "
                "add; add `num_shards · m` items with `add_batch`."
            )
        return self.add_batch(jax.tree.map(lambda x: x[None], item))

    @reports
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

        `priorities` only for prioritised shards (`AbstractPrioritisedReplay`). An item added
        without one gets its shard's largest recorded priority, which `set_priorities` keeps
        equal on every shard (as in a single replay); `priorities` given here raise it only
        on the shards they go to (keeping it equal would need a collective on every add).

        **Raises:** `ValueError` at once if `num_shards` does not divide `n`; what the
        shards' own `add_batch` raises, in the process that holds the shard.
        """
        call = "GlobalReplay.add_batch"
        items, mask = check_batch(self.item_spec, items, mask, call)
        n = jax.tree.leaves(items)[0].shape[0]
        parts: dict[str, Any] = {"items": items}
        if mask is not None:
            parts["mask"] = mask
        door: list[Fault] = []
        if priorities is not None:
            if not isinstance(self.template, AbstractPrioritisedReplay):
                raise TypeError(
                    f"`{call}(priorities=...)`: only prioritised shards take priorities; "
                    f"these are {type(self.template).__name__}."
                )
            values = check_vector(priorities, n, call, "priorities")
            parts["priorities"], door = door_floats(values, call, "priorities", mask)
        self._split(parts, call)
        shard_call = f"{type(self.template).__name__}.add_batch"
        args = (_add_batch, (parts,), *Door.of(door), shard_call, call)
        shards = run(add_blocks, self.layout, self.shards, *args)
        return eqx.tree_at(lambda g: g.shards, self, shards)

    @reports
    def update(self: _R, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _R:
        """`fn(item) -> item` applied to every stored item of every shard."""
        shard_call = f"{type(self.template).__name__}.update"
        args = (_Updated(fn), (), [], (), shard_call, "GlobalReplay.update")
        return eqx.tree_at(
            lambda g: g.shards, self, run(add_blocks, self.layout, self.shards, *args)
        )

    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "GlobalReplay.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """The shards' law: what `sample` draws by, over every shard together. (A global replay
        is a layer: it is never a shard or a cluster, which would draw by it alone.)"""
        return self.template.law(age=age, beta=beta, call=call)

    @reports
    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
    ) -> Any:
        """`batch_size` items drawn by the shards' law over the whole replay, with
        replacement, in the form (and with the options) of the shards' own `sample`:

        - `UniformReplay`: each stored item with probability `1 / size`, also when the shards
            are unequally full: the items a single replay holding shard 0's items, then shard
            1's, ..., in order, draws with the same key.
        - `PrioritisedReplay`: `P(i) = p_i ** α / Σ_global p ** α`, i.i.d. or stratified over
            the global total; a `PrioritisedSample` with global `indices` and probabilities
            (`importance_weights(probabilities, replay.size, beta)`).
        - `ClusteredReplay`: non-empty cluster `c` with probability `∝ (Σ_shards size_c) **
            distribution_power`, then the inner law over cluster `c`'s items in every shard
            (a prioritised inner's `indices` are global within the cluster).
        - with `age`: the shards' aged law over every shard's candidates together.

        Besides the shards' own reads, it costs one all-reduce of the shards' summaries (a
        few numbers each) and one of the batch. The key is replicated; the batch is the same
        on every device.

        **Raises:** as the shards' `sample`, about the whole replay, in every process: an
        empty shard is no error, an empty replay is.
        """
        call = "GlobalReplay.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        law, faults = self.template.law(age=age, beta=beta, call=call)
        return self._sample_union(law, faults, key, batch_size, call)

    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """`sample`: a global replay's draw always checks its faults, in every process."""
        return self.sample(key, batch_size)

    @reports
    def set_priorities(
        self: _R,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _R:
        """The shards' `set_priorities`, with global indices (as `sample` returns them; for
        `ClusteredReplay` shards the pair `(cluster_ids, indices)`, indices global within
        the cluster); each entry is set by the shard that owns it, and an entry whose slot
        has been written since its `generations` is dropped.

        Every shard's largest recorded priority rises with every entry, as a single
        replay's. The arguments are replicated: every device reads them all.

        **Raises:** `TypeError` at once for shards without priorities; an `eqx.error_if`
        error, in every process, for an index that names no stored item or a priority that
        is negative or not finite.
        """
        call = "GlobalReplay.set_priorities"
        names, n, door = self._names(indices, call)
        valid = door_mask(mask, n, call)
        values = check_vector(priorities, n, call, "priorities")
        priorities, more = door_floats(values, call, "priorities", None if mask is None else valid)
        door += more
        extra = () if generations is None else (check_generations(generations, n, call),)
        args = (priorities, *extra)
        write = _set_with_generations if extra else _set
        out = run(
            routed_write,
            self.layout,
            self.shards,
            write,
            _note,
            _split_names,
            names,
            args,
            valid,
            *Door.of(door),
            f"{type(self.template).__name__}.set_priorities",
            call,
        )
        return eqx.tree_at(lambda g: g.shards, self, out)

    @reports
    def stale(
        self,
        indices: Indices,
        generations: UInt32[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Bool[Array, " n"]:
        """Which sampled global `indices` have been written since they were sampled (their
        `generations`): the entries `set_priorities` drops. Replicated; one all-reduce of a
        word per entry.

        **Raises:** an `eqx.error_if` error, in every process, for an index that names no
        stored item.
        """
        call = "GlobalReplay.stale"
        names, n, door = self._names(indices, call)
        generations = check_generations(generations, n, call)
        valid = door_mask(mask, n, call)
        return run(
            routed_query,
            self.layout,
            self.shards,
            _stale,
            _split_names,
            names,
            (generations,),
            valid,
            *Door.of(door),
            f"{type(self.template).__name__}.stale",
            call,
        )

    def _names(self, indices: Indices, call: str) -> tuple[Any, int, list[Fault]]:
        """Global indices, checked in their own dtype (never wrapped on the way to int32),
        their number, and the fault of one that names no shard's item."""
        leaves = indices if isinstance(indices, tuple) else (indices,)
        checked = [check_index(x, INT32_MAX + 1, f"{call}(indices=...)", ndim=1) for x in leaves]
        n = checked[0][0].shape[0]
        for value, _ in checked[1:]:
            if value.shape[0] != n:
                raise ValueError(
                    f"`{call}`: the parts of `indices` have {n} and {value.shape[0]} entries; "
                    "they must match."
                )
        values = tuple(value for value, _ in checked)
        names: Any = values if isinstance(indices, tuple) else values[0]
        bad = jnp.any(jnp.stack([b for _, b in checked]), axis=0)
        owner, _ = self.template.split_indices(names)
        fault = (
            bad | (owner >= self.num_shards),
            f"`{call}`: an index names no item of any shard (a global index is shard · "
            f"{self.rows_per_shard} + the index within the shard, below max_size = "
            f"{self.max_size})",
        )
        return names, n, [fault]


class _Updated(eqx.Module):
    """`update(fn)` on a shard, as `add_blocks` calls it (a module: compared by `fn`)."""

    fn: Callable[[PyTree[Array]], PyTree[Array]] = eqx.field(static=True)

    def __call__(self, shard: AbstractReplay) -> AbstractReplay:
        return shard.update(self.fn)


def _add_batch(shard: Any, parts: dict[str, Any]) -> Any:
    if "priorities" in parts:
        return shard.add_batch(parts["items"], parts["priorities"], mask=parts.get("mask"))
    return shard.add_batch(parts["items"], mask=parts.get("mask"))


def _split_names(shard: AbstractReplay, names: Any) -> tuple[Array, Any]:
    return shard.split_indices(names)


def _set(shard: AbstractReplay, names: Any, priorities: Array, *, mask: Array) -> Any:
    return shard.set_priorities(names, priorities, mask=mask)


def _set_with_generations(
    shard: AbstractReplay, names: Any, priorities: Array, generations: Array, *, mask: Array
) -> Any:
    return shard.set_priorities(names, priorities, mask=mask, generations=generations)


def _note(shard: AbstractReplay, names: Any, priorities: Array, *rest: Any, mask: Array) -> Any:
    return shard.note_priorities(names, priorities, mask=mask)


def _stale(shard: AbstractReplay, names: Any, generations: Array, *, mask: Array) -> Array:
    return shard.stale(names, generations, mask=mask)
