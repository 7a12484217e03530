"""GlobalTrajectoryBuffer: a trajectory buffer's envs split over every device of a mesh,
across processes."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real

from ._checks import check_positive_int, plural
from ._dataset import Dataset
from ._faults import check_faults
from ._global import AbstractGlobalBuffer
from ._global_draws import sample_prioritised_windows, sample_windows
from ._global_routes import set_window_priorities, stale_windows
from ._prioritised_trajectory import PrioritisedTrajectoryBuffer
from ._queue import TrajectoryQueue
from ._shard_map import compiled
from ._trajectory import TrajectoryBuffer


_T = TypeVar("_T", bound="GlobalTrajectoryBuffer")
_B = TypeVar("_B", bound=eqx.Module)


class GlobalTrajectoryBuffer(AbstractGlobalBuffer):
    """A trajectory buffer of `num_shards · shard num_envs` envs whose shards (a
    `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer` or `TrajectoryQueue` each) live one per
    device of a mesh axis, also across the processes of a `jax.distributed` program. Each
    env's stream lives whole on one device.

    - **Adding is local.** `add`/`extend` take every env's steps (or global `env_ids`, each
        block naming envs of its own shard); no collective. A process builds the arguments
        from its own envs with `rows`.
    - **Sampling is exact and global** (`sample`); a queue's `pop` returns every env's steps,
        each shard's on its own device.
    - **Global env ids.** Env `e` of shard `k` is env `k · rows_per_shard + e` (`env_range`);
        samples name windows by global stamps, which `set_priorities` and `stale` take back.
    - **On disk.** `write_datasets` keeps one `dx.Dataset` per shard, each written by the
        process that holds it; `load_datasets` reads them onto any number of processes.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        mesh = jax.make_mesh((jax.device_count(),), ("replay",))
        step = {"obs": jnp.zeros(3)}
        buf = dx.GlobalTrajectoryBuffer(mesh, lambda: dx.TrajectoryBuffer(step, 4, 100))
        for t in range(8):  # this process's envs: 4 per shard it holds
            local = {"obs": np.full((4 * buf.num_local_shards, 3), t, np.float32)}
            buf = buf.add(buf.rows(local))
        batch = buf.sample(jax.random.key(0), 16, dx.Window(5))
        assert batch.items["obs"].shape == (16, 5, 3) and buf.num_envs == 4 * buf.num_shards
        ```
    """

    @staticmethod
    def _kinds() -> tuple[type, ...]:
        return (TrajectoryBuffer, PrioritisedTrajectoryBuffer, TrajectoryQueue)

    @property
    def rows_per_shard(self) -> int:
        """Each shard's number of envs."""
        return self.shards.num_envs

    @property
    def num_envs(self) -> int:
        """The number of envs: `num_shards · rows_per_shard` (static)."""
        return self.num_shards * self.rows_per_shard

    @property
    def num_windows(self) -> Int[Array, ""]:
        """A `PrioritisedTrajectoryBuffer`'s number of admissible windows, over every shard."""
        if not isinstance(self.shards, PrioritisedTrajectoryBuffer):
            raise TypeError(
                f"`GlobalTrajectoryBuffer.num_windows`: {type(self.shards).__name__} shards "
                "have no windows of their own."
            )
        return jnp.sum(jax.vmap(lambda b: b.num_windows)(self.shards), dtype=jnp.int32)

    def env_range(self, shard: int) -> range:
        """The global env ids of `shard`."""
        k = self.rows_per_shard
        return range(shard * k, (shard + 1) * k)

    @compiled
    def add(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """The shards' `add`: one step per listed env, each shard storing its own
        block. With `env_ids=None`, `items` holds every env (`num_envs` rows) in order;
        otherwise `n = num_shards · m` rows and global env ids, the `m` of block `k` all envs
        of shard `k` (`env_range(k)`). No collective.

        **Raises:** `ValueError` at once if `num_shards` does not divide the rows; an
        `eqx.error_if` error if an env id of block `k` is not an env of shard `k` (a process
        adding to envs it does not own), and what the shards' own `add` raises.
        """
        return self._append(items, env_ids, "GlobalTrajectoryBuffer.add", lambda b, *a: b.add(*a))

    @compiled
    def extend(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """The shards' `extend` (`T` steps per listed env), split as `add`."""
        return self._append(
            items, env_ids, "GlobalTrajectoryBuffer.extend", lambda b, *a: b.extend(*a)
        )

    @compiled
    def pop(self: _T, sequence_length: int) -> tuple[PyTree[Array], _T]:
        """A `TrajectoryQueue`'s `pop`: the `sequence_length` oldest unread steps of every env.

        **Returns:** `(items, buffer)`; `items` has the layout of a single queue's,
        `(num_envs, sequence_length, ...)`, its env axis split over the shards as the buffer's
        (each shard's steps stay on its device).

        **Raises:** as `TrajectoryQueue.pop`, in every process when any env is short (one
        all-reduce of a boolean).
        """
        call = "GlobalTrajectoryBuffer.pop"
        if not isinstance(self.shards, TrajectoryQueue):
            raise TypeError(f"`{call}`: {type(self.shards).__name__} shards are not queues.")
        length = check_positive_int(
            sequence_length, f"{call}(sequence_length=...)", maximum=self.shards.max_length
        )
        axis = self.axis

        def local(queue: TrajectoryQueue):
            short = jax.lax.psum(jnp.any(queue.unread < length).astype(jnp.int32), axis) > 0
            fault = (
                short,
                f"`{call}`: an env holds fewer than {plural(length, 'unread step')}; pop once "
                "`can_pop(sequence_length)` holds",
            )
            queue = check_faults(queue, [fault])
            items, queue = queue.pop(length)
            return items, queue

        items, shards = self.layout.map(self.shards, local, (), P(axis), module=True)
        return items, eqx.tree_at(lambda g: g.shards, self, shards)

    def can_pop(self, sequence_length: int) -> Bool[Array, ""]:
        """Whether every env of every shard holds `sequence_length` unread steps."""
        return jnp.all(jax.vmap(lambda q: q.can_pop(sequence_length))(self.shards))

    @compiled
    def sample(self, key: PRNGKeyArray, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        """Windows drawn from the law of the whole buffer, with replacement, with the
        arguments and in the form of the shards' own `sample`:

        - `TrajectoryBuffer` (`window`, `distribution_power=`, `source=`): windows by the
            global start weights: the windows a single buffer of `num_envs` envs draws with
            the same key; `env` is the global env.
        - `PrioritisedTrajectoryBuffer` (`beta=`): `P ∝ p ** α` over the windows of every
            shard, i.i.d. or stratified over the global total; `indices` global (`shard ·
            shard leaves + leaf`), `env` global, `weights` from the global number of windows.

        Besides the shards' own reads, it costs one all-reduce of two numbers per env (a
        `TrajectoryBuffer`) or per shard (prioritised), and one of the batch. The key is
        replicated; the batch is the same on every device.

        **Raises:** as the shards' `sample`, about the whole buffer, in every process.
        """
        call = "GlobalTrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        shard = self.shards
        if isinstance(shard, TrajectoryBuffer):
            return sample_windows(self.layout, call, shard, key, batch_size, *args, **kwargs)
        if isinstance(shard, PrioritisedTrajectoryBuffer):
            return sample_prioritised_windows(
                self.layout, call, shard, key, batch_size, *args, **kwargs
            )
        raise TypeError(f"`{call}`: a {type(shard).__name__} is read with `pop`.")

    @compiled
    def set_priorities(
        self: _T,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
    ) -> _T:
        """`PrioritisedTrajectoryBuffer.set_priorities` with global env ids: each entry is
        applied by the shard of its env, and a stale window's entry is dropped. Every shard's
        largest recorded priority rises with every entry, as a single buffer's. The
        arguments are replicated: every device reads them all.

        **Raises:** an `eqx.error_if` error, in every process, for a stamp this buffer cannot
        have given or a priority that is negative or not finite.
        """
        call = "GlobalTrajectoryBuffer.set_priorities"
        if not isinstance(self.shards, PrioritisedTrajectoryBuffer):
            raise TypeError(f"`{call}`: {type(self.shards).__name__} shards have no priorities.")
        shards = set_window_priorities(self.layout, call, self.shards, env_ids, starts, priorities)
        return eqx.tree_at(lambda g: g.shards, self, shards)

    @compiled
    def stale(
        self, env_ids: Integer[ArrayLike, " n"], starts: Integer[ArrayLike, " n"]
    ) -> Bool[Array, " n"]:
        """Whether the windows named by global stamps `(env_ids, starts)` have lost steps
        since: the entries `set_priorities` drops. Replicated; it gathers two numbers per env.

        **Raises:** an `eqx.error_if` error, in every process, for an env id out of range or
        a start its env has not taken.
        """
        call = "GlobalTrajectoryBuffer.stale"
        return stale_windows(self.layout, self.shards, env_ids, starts, call)

    def write_datasets(
        self, root: str | os.PathLike, *, chunk_length: int = 1024, sync: bool = True
    ) -> int:
        """Each process appends its own shards to disk: shard `k` to its own `dx.Dataset`,
        `root/shard-<k>` (made at the first write, with `chunk_length` and `sync` as in
        `Dataset.create`), whose env `e` is the global env `k · rows_per_shard + e`.

        One writer per dataset, as `Dataset` requires: a shard lives on one device, whose
        process alone writes it. Every process calls it (no collective; on the host, between
        jitted steps), and `load_datasets` reads the shards back onto any number of
        processes.

        **Returns:** the number of steps this process wrote.
        """
        root = Path(root)
        local = self.local_shards()
        written = 0
        for j, k in enumerate(self.local_shard_ids):
            shard = jax.tree.map(
                lambda x: jnp.asarray(x[j]) if isinstance(x, np.ndarray) else x, local
            )
            path = root / _shard_name(k)
            if path.exists():
                dataset = Dataset.open(path, shard, sync=sync)
            else:
                dataset = Dataset.create(
                    path, shard.item_spec, shard.num_envs, chunk_length=chunk_length, sync=sync
                )
            try:
                written += dataset.write(shard)
            finally:
                dataset.close()
        return written

    @classmethod
    def load_datasets(
        cls: type[_T],
        root: str | os.PathLike,
        mesh: Mesh,
        make: Callable[[], _B],
        *,
        axis: str | None = None,
    ) -> _T:
        """The buffer whose shard `k` holds the newest steps of `root/shard-<k>` (what
        `write_datasets` wrote, from any number of processes), as `Dataset.load` reads them
        into `make()`. Every process calls it and reads only its own shards.

        **Raises:** `FileNotFoundError` if a shard's dataset is missing; what `Dataset.open`
        and `Dataset.load` raise.
        """
        template = cls.abstract(mesh, make, axis=axis)
        like = eqx.filter_eval_shape(make)
        shards = []
        for k in template.local_shard_ids:
            path = Path(root) / _shard_name(k)
            if not path.exists():
                raise FileNotFoundError(
                    f"`GlobalTrajectoryBuffer.load_datasets`: no dataset for shard {k} at "
                    f"{str(path)!r}; {template.num_shards} shards need one each."
                )
            dataset = Dataset.open(path, like)
            try:
                shards.append(dataset.load(like))
            finally:
                dataset.close()
        local = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *shards)
        return cls.from_process_local(mesh, local, axis=template.axis)

    def _append(self: _T, items, env_ids, call: str, fn) -> _T:
        items = jax.tree.map(jnp.asarray, items)
        k = self.rows_per_shard
        if env_ids is None:
            for x in jax.tree.leaves(items):
                if x.ndim == 0 or x.shape[0] != self.num_envs:
                    raise ValueError(
                        f"`{call}`: with `env_ids=None`, each leaf of `items` needs a leading "
                        f"axis of num_envs = {self.num_envs} ({self.num_shards} shards of {k} "
                        f"envs); got shape {x.shape}."
                    )
            return self._update(fn, items)
        ids = jnp.asarray(env_ids)
        self._split(ids, call)
        self._split(items, call)
        axis = self.axis

        def local(buffer, items, ids):
            first = jax.lax.axis_index(axis) * k
            foreign = (ids < first) | (ids >= first + k)
            fault = (
                foreign,
                f"`{call}`: rows of block s of `env_ids` must name envs of shard s "
                f"(s · {k} <= env id < (s + 1) · {k}); a process adds only to its own envs",
            )
            ids = check_faults(ids - first, [fault])
            return fn(buffer, items, ids)

        return self._update(local, items, ids)


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"
