"""GlobalBuffer: one buffer whose shards live on every device of a mesh, across processes.

A `GlobalBuffer` holds one buffer per device of a mesh axis (its *shards*, stacked along a
leading axis that the mesh splits), and runs each method of the buffer inside `jax.shard_map`:

- what writes (`add`, `add_batch`, `extend`, `update`, `pop`) runs on each shard alone, with
    no collective, so each process writes to its own devices;
- what draws (`sample`) first gathers one small number per shard (or per env), draws every
    row from the *global* law with a key that every device holds, lets each shard read the
    rows it owns, and assembles the batch with one all-reduce;
- what names stored data (`set_priorities`, `stale`) takes global indices or env ids, and
    each shard applies the entries it owns.

The laws, and what crosses devices for each, are in `docs/multi-process.md`.
"""

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real, UInt32

from ._abstract import AbstractReplay, AbstractTrajectoryBuffer
from ._checks import (
    check_faults,
    check_generations,
    check_index,
    check_positive_int,
    check_vector,
    Fault,
    is_concrete,
    plural,
)
from ._clustered import choose_clusters, ClusteredReplay
from ._dataset import Dataset
from ._priorities import check_beta, weights
from ._prioritised import PrioritisedReplay, PrioritisedSample
from ._prioritised_trajectory import (
    PrioritisedSequenceSample,
    PrioritisedTrajectoryBuffer,
    stamps_of,
)
from ._queue import TrajectoryQueue
from ._sequences import draw_starts, is_window, phase
from ._storage import gather, gather_slots
from ._sum_tree import find_leaves
from ._trajectory import check_power, no_start_fault, SOURCES, TrajectoryBuffer
from ._uniform import UniformReplay
from ._windows import as_window, read_windows, SequenceSample


_B = TypeVar("_B", bound=eqx.Module)
_G = TypeVar("_G", bound="GlobalBuffer")

_REPLAYS = (UniformReplay, PrioritisedReplay, ClusteredReplay)
_TRAJECTORIES = (TrajectoryBuffer, PrioritisedTrajectoryBuffer, TrajectoryQueue)
_NAME = "GlobalBuffer"


def _compiled(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` under one `eqx.filter_jit` per method, when called outside `jit`: each of its
    `shard_map`s is then compiled once per signature, not at every eager call (a method's
    body closes over its static arguments, so eager `shard_map` would trace it afresh). Inside
    a traced function the method runs as it is."""
    jitted = eqx.filter_jit(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        leaves = jax.tree.leaves((self, args, kwargs))
        if not all(is_concrete(x) for x in leaves if eqx.is_array(x)):
            return method(self, *args, **kwargs)
        return jitted(self, *args, **kwargs)

    return call


def _has_shard_map() -> bool:
    return hasattr(jax, "shard_map")


class GlobalBuffer(eqx.Module, Generic[_B]):
    """One buffer spread over every device of a mesh axis, also across the processes of a
    `jax.distributed` program: the item axis of a replay, or the env axis of a trajectory
    buffer, split into one *shard* per device.

    Each shard is an ordinary buffer (`UniformReplay`, `PrioritisedReplay`,
    `ClusteredReplay`, `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer` or
    `TrajectoryQueue`), and together they behave as one buffer of `num_shards` times the
    size, whose global batches have the layout a single buffer's have:

    - **Writing is local.** `add_batch` (replays) and `add`/`extend` (trajectory buffers)
        take global arrays whose leading axis is split into `num_shards` equal blocks, block
        `k` for shard `k`; each shard stores its own block, with no collective. A process
        builds such an array from its own rows with `rows`.
    - **Sampling is exact and global.** `sample` draws each row from the law of the whole
        buffer, as one buffer holding every shard's data would: each stored item equally
        likely for a `UniformReplay`, also when the shards are unequally full; `P(i) = p_i **
        α / Σ_global p ** α` for the prioritised buffers (i.i.d. or stratified over the global
        total), with probabilities and importance weights from global totals; windows by the
        global start weights for a `TrajectoryBuffer`. The batch is the same on every device
        (replicated), with the layout of a single buffer's.
    - **Global names.** A replay's item `i` of shard `k` has the global index `k · shard
        max_size + i`; a trajectory shard's env `e` is the global env `k · shard num_envs +
        e`. Samples return global names, and `set_priorities`/`stale` take them back: each
        entry goes to the shard that owns it, and an update of an item or window written over
        since it was sampled is dropped, whichever process sends it.

    Every method works eagerly and under `jax.jit`/`eqx.filter_jit` with donation (buffers
    are updated in place on each device). Needs JAX 0.7 or newer (`jax.shard_map`).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        mesh = jax.make_mesh((jax.device_count(),), ("replay",))
        item = {"obs": jnp.zeros(4)}
        buf = dx.GlobalBuffer(mesh, lambda: dx.UniformReplay(item, max_size=1000))
        # Each process gives the rows of its own devices: 8 per shard here.
        local = {"obs": np.ones((8 * buf.num_local_shards, 4), np.float32)}
        buf = buf.add_batch(buf.rows(local))
        batch = buf.sample(jax.random.key(0), 32)
        assert batch["obs"].shape == (32, 4) and int(buf.size) == 8 * buf.num_shards
        ```
    """

    shards: _B
    """The shards: one buffer per device of `axis`, every array leaf with a leading axis of
    length `num_shards`, split over the mesh."""
    mesh: Mesh = eqx.field(static=True)
    axis: str = eqx.field(static=True)

    def __init__(
        self,
        mesh: Mesh,
        make: Callable[[], _B] | None = None,
        *,
        axis: str | None = None,
        shards: _B | None = None,
    ):
        """**Arguments:**

        - `mesh`: a `jax.sharding.Mesh`; with `jax.distributed`, one over the devices of
            every process (`jax.make_mesh` over `jax.devices()` makes one).
        - `make`: `make() -> buffer`, one shard: an empty buffer of one of the types above,
            of the size one device holds (a buffer of `N` items over `D` devices: `N // D`).
            It runs once, inside `jax.jit`, so each device allocates only its own shard.
        - `axis`: the mesh axis the shards are split over (default: the mesh's only axis).
            Over the mesh's other axes, if any, every shard is replicated.
        - `shards`: instead of `make`, the shards themselves, already stacked and placed (as
            `from_process_local` and `jax.tree.map` give them).

        **Raises:** `ValueError`/`TypeError` at once if the mesh has no such axis (or several
        axes and none named), if `make` gives something that is not one of the buffers
        above, or if `shards` has the wrong number of shards.
        """
        call = _NAME
        if not _has_shard_map():
            raise RuntimeError(
                f"`{call}` needs JAX 0.7 or newer (`jax.shard_map`); this is JAX {jax.__version__}."
            )
        if not isinstance(mesh, Mesh):
            raise TypeError(f"`{call}(mesh=...)` must be a `jax.sharding.Mesh`, got {mesh!r}.")
        if axis is None:
            if len(mesh.axis_names) != 1:
                raise ValueError(
                    f"`{call}`: the mesh has axes {mesh.axis_names}; name the one the shards "
                    "are split over with `axis=`."
                )
            axis = mesh.axis_names[0]
        if axis not in mesh.axis_names:
            raise ValueError(f"`{call}(axis={axis!r})`: the mesh has axes {mesh.axis_names}.")
        self.mesh, self.axis = mesh, str(axis)
        if make is not None and shards is None:
            shards = _make_shards(mesh, self.axis, make)
        elif make is not None or shards is None:
            raise TypeError(f"`{call}`: give exactly one of `make` and `shards`.")
        assert shards is not None
        _check_shard_type(_shard_type(shards), call)
        leading = {x.shape[0] if len(x.shape) else None for x in _array_leaves(shards)}
        if leading != {mesh.shape[axis]}:
            raise ValueError(
                f"`{call}(shards=...)`: every array leaf needs a leading axis of "
                f"{mesh.shape[axis]} shards (the size of mesh axis {axis!r}); the leaves have "
                f"{sorted(leading, key=str)}."
            )
        self.shards = shards

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_process_local(
        cls: type[_G], mesh: Mesh, local_shards: _B, *, axis: str | None = None
    ) -> _G:
        """The global buffer whose shards on this process's devices are `local_shards`.

        For a buffer restored by each process from its own file (`dx.load` of what
        `local_shards()` gave `dx.save`). Every process calls it, each with its own shards.

        **Arguments:**

        - `mesh`, `axis`: as for the constructor.
        - `local_shards`: this process's shards, stacked: every array leaf with a leading
            axis of `num_local_shards`, in the order of the mesh's devices.

        **Raises:** `ValueError` at once if the leading axes are not `num_local_shards`.
        """
        template = cls(mesh, shards=_stack_shape(mesh, axis, local_shards), axis=axis)
        count = template.num_local_shards
        sharding = template.sharding
        for x in _array_leaves(local_shards):
            if x.shape[:1] != (count,):
                raise ValueError(
                    f"`{_NAME}.from_process_local`: process {jax.process_index()} holds "
                    f"{plural(count, 'shard')} of mesh axis {template.axis!r}; every array leaf "
                    f"of `local_shards` needs a leading axis of {count}, got shape {x.shape}."
                )
        shards = jax.tree.map(
            lambda x: (
                jax.make_array_from_process_local_data(sharding, np.asarray(x))
                if isinstance(x, (jax.Array, np.ndarray))
                else x
            ),
            local_shards,
        )
        return cls(mesh, shards=shards, axis=template.axis)

    @classmethod
    def abstract(
        cls: type[_G], mesh: Mesh, make: Callable[[], _B], *, axis: str | None = None
    ) -> _G:
        """A shape-only global buffer: every array leaf a `jax.ShapeDtypeStruct` with the
        sharding it has on `mesh`. Allocates nothing; the target of an orbax restore onto
        this mesh (`checkpointer.restore(path, GlobalBuffer.abstract(mesh, make))`), whatever
        the number of processes that saved it."""
        template = cls(mesh, shards=_stack_shape(mesh, axis, make), axis=axis)
        sharding = template.sharding

        def spec(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return x

        return jax.tree.map(spec, template)

    # ------------------------------------------------------------------ layout

    @property
    def sharding(self) -> NamedSharding:
        """How the shards' leaves are placed: their leading axis over mesh axis `axis`."""
        return NamedSharding(self.mesh, P(self.axis))

    @property
    def num_shards(self) -> int:
        """The number of shards: the size of mesh axis `axis` (static)."""
        return self.mesh.shape[self.axis]

    @property
    def num_local_shards(self) -> int:
        """The number of shards whose device belongs to this process (static)."""
        return len(self.local_shard_ids)

    @property
    def local_shard_ids(self) -> tuple[int, ...]:
        """The shards on this process's devices, in order (static)."""
        where = self.mesh.axis_names.index(self.axis)
        mine = {d.id for d in jax.local_devices()}
        devices = self.mesh.devices
        ids = {pos[where] for pos in np.ndindex(devices.shape) if devices[pos].id in mine}  # pyright: ignore[reportAttributeAccessIssue]
        return tuple(sorted(int(i) for i in ids))

    @property
    def shard(self) -> type:
        """The type of each shard (`UniformReplay`, `TrajectoryBuffer`, ...)."""
        return _shard_type(self.shards)

    @property
    def rows_per_shard(self) -> int:
        """For trajectory buffers, each shard's number of envs; for replays, each shard's
        capacity (`max_size`): the global name of a shard's first env or item is
        `shard · rows_per_shard`."""
        if isinstance(self.shards, AbstractTrajectoryBuffer):
            return self.shards.num_envs
        assert isinstance(self.shards, AbstractReplay)
        return self.shards.max_size

    def rows(self, local: PyTree[ArrayLike]) -> PyTree[Array]:
        """A global array of `add`/`add_batch`/`extend` arguments (items, or env ids) from
        this process's rows: the blocks of its own shards, in order.

        Every process calls it with its own rows (the same number of rows per shard in
        every process). For a trajectory buffer with every env (`env_ids=None`), the rows
        are this process's envs, `rows_per_shard` per local shard; with `env_ids`, any number
        per shard, each naming one of that shard's envs.

        **Raises:** `ValueError` at once if a leaf's leading axis is not a multiple of
        `num_local_shards`.
        """
        count = self.num_local_shards

        def one(x):
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] % count:
                raise ValueError(
                    f"`{_NAME}.rows`: process {jax.process_index()} holds "
                    f"{plural(count, 'shard')}, and its rows are split into one equal block "
                    f"per shard; a leaf of shape {x.shape} has a leading axis that "
                    f"{count} does not divide."
                )
            return jax.make_array_from_process_local_data(self.sharding, x)

        return jax.tree.map(one, local)

    def env_range(self, shard: int) -> range:
        """The global env ids of `shard` (trajectory buffers)."""
        self._need(_TRAJECTORIES, "env_range")
        k = self.rows_per_shard
        return range(shard * k, (shard + 1) * k)

    def local_shards(self) -> _B:
        """This process's shards, as host arrays stacked in the order of
        `local_shard_ids`: what `dx.save` writes for this process (and
        `from_process_local` takes back)."""

        def local(x):
            if not eqx.is_array(x):
                return x
            blocks = {}
            for s in x.addressable_shards:
                blocks.setdefault(s.index[0].start or 0, np.asarray(s.data))
            return np.concatenate([blocks[k] for k in sorted(blocks)])

        return jax.tree.map(local, self.shards)

    # ------------------------------------------------------------------ datasets

    def write_datasets(
        self, root: str | os.PathLike, *, chunk_length: int = 1024, sync: bool = True
    ) -> int:
        """Each process appends its own shards to disk: shard `k` to its own `dx.Dataset`,
        `root/shard-<k>` (made at the first write, with `chunk_length` and `sync` as in
        `Dataset.create`), whose env `e` is the global env `k · rows_per_shard + e`.

        One writer per dataset, as `Dataset` requires: a shard lives on one device, whose
        process alone writes it. Every process calls it (no collective; on the host, between
        jitted steps), and `load_datasets` reads the shards back onto any number of
        processes. Trajectory buffers only (what `Dataset.write` takes).

        **Returns:** the number of steps this process wrote.
        """
        self._need(_TRAJECTORIES, "write_datasets")
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
        cls: type[_G],
        root: str | os.PathLike,
        mesh: Mesh,
        make: Callable[[], _B],
        *,
        axis: str | None = None,
    ) -> _G:
        """The global buffer whose shard `k` holds the newest steps of `root/shard-<k>` (what
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
                    f"`{_NAME}.load_datasets`: no dataset for shard {k} at {str(path)!r}; "
                    f"{template.num_shards} shards need one each."
                )
            dataset = Dataset.open(path, like)
            try:
                shards.append(dataset.load(like))
            finally:
                dataset.close()
        local = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *shards)
        return cls.from_process_local(mesh, local, axis=template.axis)

    # ------------------------------------------------------------------ sizes

    @property
    def max_size(self) -> int:
        """A replay's capacity: `num_shards · shard max_size` (static)."""
        self._need(_REPLAYS, "max_size")
        return self.num_shards * self.shards.max_size  # type: ignore[attr-defined]

    @property
    def size(self) -> Int[Array, ""]:
        """A replay's number of stored items, over every shard (int32)."""
        self._need(_REPLAYS, "size")
        sizes = jax.vmap(lambda replay: replay.size)(self.shards)
        return jnp.sum(sizes, dtype=jnp.int32)

    @property
    def num_envs(self) -> int:
        """A trajectory buffer's number of envs: `num_shards · shard num_envs` (static)."""
        self._need(_TRAJECTORIES, "num_envs")
        return self.num_shards * self.rows_per_shard

    @property
    def num_windows(self) -> Int[Array, ""]:
        """A `PrioritisedTrajectoryBuffer`'s number of admissible windows, over every shard."""
        self._need((PrioritisedTrajectoryBuffer,), "num_windows")
        return jnp.sum(jax.vmap(lambda b: b.num_windows)(self.shards), dtype=jnp.int32)

    # ------------------------------------------------------------------ writes (local)

    @_compiled
    def add_batch(
        self: _G,
        items: PyTree[ArrayLike],
        priorities: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _G:
        """A replay's `add_batch`, each shard storing its own block of `items` (and of
        `priorities` and `mask`): rows `k · m .. (k + 1) · m - 1` of `n = num_shards · m`
        rows go to shard `k`, in order. No collective.

        `priorities` only for a `PrioritisedReplay` shard. A new item without a priority gets
        its shard's largest recorded priority, which `set_priorities` keeps equal on every
        shard (as in a single replay), but which `priorities` given here raise only on the
        shards they go to.

        **Raises:** `ValueError` at once if `num_shards` does not divide `n`; what the
        shards' own `add_batch` raises.
        """
        call = f"{_NAME}.add_batch"
        self._need(_REPLAYS, "add_batch")
        parts: dict[str, Any] = {"items": jax.tree.map(jnp.asarray, items)}
        if mask is not None:
            parts["mask"] = jnp.asarray(mask)
        if priorities is not None:
            self._need((PrioritisedReplay,), "add_batch(priorities=...)")
            parts["priorities"] = jnp.asarray(priorities)
        self._split(parts, call)

        def local(replay: Any, parts: dict[str, Any]) -> Any:
            extra = {"priorities": parts["priorities"]} if "priorities" in parts else {}
            return replay.add_batch(parts["items"], mask=parts.get("mask"), **extra)

        return self._local(local, parts)

    @_compiled
    def add(
        self: _G, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _G:
        """A trajectory buffer's `add`: one step per listed env, each shard storing its own
        block. With `env_ids=None`, `items` holds every env (`num_envs` rows) in order;
        otherwise `n = num_shards · m` rows and global env ids, the `m` of block `k` all envs
        of shard `k` (`env_range(k)`). No collective.

        **Raises:** `ValueError` at once if `num_shards` does not divide the rows; an
        `eqx.error_if` error if an env id of block `k` is not an env of shard `k` (a process
        adding to envs it does not own), and what the shards' own `add` raises.
        """
        return self._append(items, env_ids, f"{_NAME}.add", lambda b, *a: b.add(*a))

    @_compiled
    def extend(
        self: _G, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _G:
        """A trajectory buffer's `extend` (`T` steps per listed env), split as `add`."""
        return self._append(items, env_ids, f"{_NAME}.extend", lambda b, *a: b.extend(*a))

    @_compiled
    def update(self: _G, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _G:
        """`fn(item) -> item` applied to every stored item of every shard (replays)."""
        self._need(_REPLAYS, "update")
        return self._local(lambda b: b.update(fn))

    @_compiled
    def pop(self: _G, sequence_length: int) -> tuple[PyTree[Array], _G]:
        """A `TrajectoryQueue`'s `pop`: the `sequence_length` oldest unread steps of every env.

        **Returns:** `(items, buffer)`; `items` has the layout of a single queue's,
        `(num_envs, sequence_length, ...)`, its env axis split over the shards as the buffer's
        (each shard's steps stay on its device).

        **Raises:** as `TrajectoryQueue.pop`, in every process when any env is short (one
        all-reduce of a boolean).
        """
        call = f"{_NAME}.pop"
        self._need((TrajectoryQueue,), "pop")
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

        items, shards = self._map(local, (), P(axis), module=True)
        return items, eqx.tree_at(lambda g: g.shards, self, shards)

    def can_pop(self, sequence_length: int) -> Bool[Array, ""]:
        """Whether every env of every shard holds `sequence_length` unread steps."""
        self._need((TrajectoryQueue,), "can_pop")
        return jnp.all(jax.vmap(lambda q: q.can_pop(sequence_length))(self.shards))

    # ------------------------------------------------------------------ sampling (global)

    @_compiled
    def sample(self, key: PRNGKeyArray, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        """`batch_size` rows drawn from the law of the whole buffer, with replacement, with
        the arguments and the result of the shards' own `sample`:

        - `UniformReplay`: each stored item equally likely. The items drawn are those a
            single `UniformReplay` holding shard 0's items, then shard 1's, ..., in order,
            draws with the same key.
        - `PrioritisedReplay`: `P(i) = p_i ** α / Σ_global p ** α`, i.i.d. or stratified over
            the global total; a `PrioritisedSample` with global `indices` and global
            probabilities (`importance_weights(probabilities, buffer.size, beta)`).
        - `ClusteredReplay`: non-empty cluster `c` with probability `∝ (Σ_shards size_c) **
            distribution_power`, then the inner law over that cluster's items in every shard
            (a prioritised inner: `indices` global within the cluster).
        - `TrajectoryBuffer(window, distribution_power=, source=)`: windows drawn by the
            global start weights, as a single buffer of `num_envs` envs draws them with the
            same key; `env` is the global env id.
        - `PrioritisedTrajectoryBuffer(beta=)`: `P ∝ p ** α` over the windows of every shard;
            `indices` global (`shard · shard leaves + leaf`), `weights` from the global
            number of windows.

        Costs, besides each shard's own draw: one all-reduce of a number per shard (per env
        for a `TrajectoryBuffer`), and one of the batch. The result is the same on every
        device.

        **Raises:** as the shards' `sample`, about the whole buffer: an empty shard is no
        error, an empty buffer is (raised in every process).
        """
        batch_size = check_positive_int(batch_size, f"{_NAME}.sample(batch_size=...)")
        shard = self.shards
        if isinstance(shard, TrajectoryQueue):
            raise TypeError(f"`{_NAME}.sample`: a TrajectoryQueue is read with `pop`.")
        if isinstance(shard, TrajectoryBuffer):
            return self._sample_windows(key, batch_size, *args, **kwargs)
        if isinstance(shard, PrioritisedTrajectoryBuffer):
            return self._sample_prioritised_windows(key, batch_size, *args, **kwargs)
        if args or kwargs:
            raise TypeError(
                f"`{_NAME}.sample`: a {type(shard).__name__} takes only `key` and `batch_size`."
            )
        return self._sample_replay(key, batch_size)

    def _sample_replay(self, key: PRNGKeyArray, batch_size: int) -> Any:
        call = f"{_NAME}.sample"
        axis, n = self.axis, self.num_shards
        name = type(self.shards).__name__

        def local(replay: AbstractReplay, key: PRNGKeyArray):
            me = jax.lax.axis_index(axis)
            if isinstance(replay, ClusteredReplay):
                return _draw_clustered(replay, key, batch_size, axis, n, me, call)
            law = _law(replay)
            masses = _per_shard(law.mass(replay), axis, n)
            total = jnp.sum(masses)
            targets = law.targets(key, batch_size, total)
            owner, residual = _locate(targets, masses)
            mine = owner == me
            rows = law.at(replay, jnp.where(mine, residual, 0), total)
            out = _assemble(rows, mine, axis)
            out = law.globalize(out, owner, replay.max_size)
            sizes = _per_shard(replay.size, axis, n)
            faults = [
                (jnp.sum(sizes) == 0, f"`{call}`: cannot sample from an empty {name}"),
                *law.faults(total, call),
            ]
            return check_faults(out, faults, order_reads=False)

        return self._map(local, (key,), P())

    def _sample_windows(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        window: Any,
        *,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        source: str = "replay",
        **options: Any,
    ) -> SequenceSample:
        call = f"{_NAME}.sample"
        shard: TrajectoryBuffer = self.shards  # type: ignore[assignment]
        window = as_window(window, options, call)
        window.check(shard.item_spec, shard.max_length, call)
        if source not in SOURCES:
            raise ValueError(f"`{call}(source=...)` must be one of {SOURCES}, got {source!r}.")
        power, power_faults = check_power(distribution_power, call)
        axis, n, k = self.axis, self.num_shards, shard.num_envs

        def local(buffer: TrajectoryBuffer, key: PRNGKeyArray, power: Array):
            me = jax.lax.axis_index(axis)
            lengths = _per_shard(buffer.lengths(source), axis, n).reshape(-1)
            counts = _per_shard(buffer.step_count, axis, n).reshape(-1)
            starts = phase(counts, window.period)
            # The draw of a single buffer of every env: the same rows in every device.
            env, back, _ = draw_starts(key, lengths, starts, batch_size, window.law, power)
            owner = env // k
            mine = owner == me
            local_env = jnp.where(mine, env - owner * k, 0)
            read = read_windows(buffer.streams, local_env, jnp.where(mine, back, 1), window)
            out = _assemble(read, mine, axis)
            out = out._replace(env=env, start=counts[env] - back)
            faults = [*power_faults, no_start_fault(lengths, counts, source, window, call)]
            return check_faults(out, faults, order_reads=False)

        return self._map(local, (key, power), P())

    def _sample_prioritised_windows(
        self, key: PRNGKeyArray, batch_size: int, *, beta: Real[ArrayLike, ""] = 1.0
    ) -> PrioritisedSequenceSample:
        call = f"{_NAME}.sample"
        shard: PrioritisedTrajectoryBuffer = self.shards  # type: ignore[assignment]
        beta, beta_faults = check_beta(beta, call, shard.priorities.max_priority.dtype)
        axis, n = self.axis, self.num_shards
        leaves_per_shard = shard.priorities.tree.capacity
        k = shard.num_envs

        def local(buffer: PrioritisedTrajectoryBuffer, key: PRNGKeyArray, beta: Array):
            me = jax.lax.axis_index(axis)
            tree = buffer.priorities.tree
            masses = _per_shard(tree.total, axis, n)
            total = jnp.sum(masses)
            targets = _float_targets(key, batch_size, total, buffer.priorities.stratified)
            owner, residual = _locate(targets, masses)
            mine = owner == me
            leaves, value = find_leaves(tree, jnp.where(mine, residual, 0))
            env, start = stamps_of(buffer, leaves)
            back = jnp.clip(buffer.step_count[env] - start, 1, buffer.max_length)
            read = read_windows(buffer.streams, env, back, buffer.window)
            read, leaves, value = _assemble((read, leaves, value), mine, axis)
            read = read._replace(env=read.env + owner * k)
            number = jnp.sum(_per_shard(buffer.num_windows, axis, n))
            positive = total > 0
            probabilities = jnp.where(positive, value / jnp.where(positive, total, 1), 0)
            w = weights(jnp.where(positive, probabilities, 1), jnp.maximum(number, 1), beta)
            out = PrioritisedSequenceSample(
                read, leaves + owner * leaves_per_shard, probabilities, w
            )
            faults = [
                (
                    number == 0,
                    f"`{call}`: no window is admissible yet in any shard: no env holds "
                    f"{buffer.window.size} steps from a start on a multiple of period = "
                    f"{buffer.window.period}",
                ),
                *_mass_faults(total, call, "window"),
                *beta_faults,
            ]
            return check_faults(out, faults, order_reads=False)

        return self._map(local, (key, beta), P())

    # ------------------------------------------------------------------ priorities (owner)

    @_compiled
    def set_priorities(self: _G, *args: Any, **kwargs: Any) -> _G:
        """The shards' `set_priorities`, with global names; each entry goes to the shard
        that owns it, and the others ignore it:

        - `PrioritisedReplay`: `(indices, priorities, *, mask=None, generations=None)`, the
            global `indices` of a sample; an entry whose slot has been written since its
            `generations` is dropped.
        - `ClusteredReplay` (prioritised inner): `(cluster_ids, indices, priorities, *,
            generations=None)`, `indices` global within the cluster.
        - `PrioritisedTrajectoryBuffer`: `(env_ids, starts, priorities)`, global env ids;
            a stale window's entry is dropped.

        Every shard's largest recorded priority (what new items get) rises to that of every
        entry, as in a single buffer. Arguments are replicated: every device sees them all.

        **Raises:** an `eqx.error_if` error, in every process, for an index or env id that
        names no shard's item, and what the shards' own `set_priorities` raises.
        """
        shard = self.shards
        if isinstance(shard, PrioritisedTrajectoryBuffer):
            return self._set_window_priorities(*args, **kwargs)
        if isinstance(shard, ClusteredReplay):
            return self._set_cluster_priorities(*args, **kwargs)
        if isinstance(shard, PrioritisedReplay):
            return self._set_item_priorities(*args, **kwargs)
        raise TypeError(f"`{_NAME}.set_priorities`: a {type(shard).__name__} has no priorities.")

    def _set_item_priorities(
        self: _G,
        indices: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _G:
        call = f"{_NAME}.set_priorities"
        capacity = self.rows_per_shard
        index, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        n = index.shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        mask = jnp.ones(n, jnp.bool_) if mask is None else jnp.asarray(mask)
        extra = () if generations is None else (jnp.asarray(generations),)
        fault = (bad & mask, f"`{call}`: an index names no item of any shard: {_RANGE}")

        axis, n = self.axis, self.num_shards

        def local(replay: PrioritisedReplay, index, priorities, mask, *generations):
            owner, slot = index // capacity, index % capacity
            owned = owner == jax.lax.axis_index(axis)
            # Checked on every device, so that a bad entry raises in every process.
            unstored = slot >= _per_shard(replay.size, axis, n)[owner]
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
        return self._local(local, index, priorities, mask, *extra, sharded=False)

    def _set_cluster_priorities(
        self: _G,
        cluster_ids: Integer[ArrayLike, " n"],
        indices: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _G:
        call = f"{_NAME}.set_priorities"
        shard: ClusteredReplay = self.shards  # type: ignore[assignment]
        capacity = shard.clusters.max_size
        index, bad = check_index(
            indices, self.num_shards * capacity, f"{call}(indices=...)", ndim=1
        )
        n = index.shape[0]
        ids = jnp.asarray(cluster_ids)
        priorities = check_vector(priorities, n, call, "priorities")
        extra = () if generations is None else (jnp.asarray(generations),)
        fault = (bad, f"`{call}`: an index names no item of its cluster in any shard: {_RANGE}")

        axis, n, clusters = self.axis, self.num_shards, shard.num_clusters

        def local(replay: ClusteredReplay, ids, index, priorities, *generations):
            owner, slot = index // capacity, index % capacity
            owned = owner == jax.lax.axis_index(axis)
            # Checked on every device, so that a bad entry raises in every process.
            sizes = _per_shard(replay.cluster_sizes, axis, n)
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
        return self._local(local, ids, index, priorities, *extra, sharded=False)

    def _set_window_priorities(
        self: _G,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
    ) -> _G:
        call = f"{_NAME}.set_priorities"
        k = self.rows_per_shard
        env, bad = check_index(env_ids, self.num_envs, f"{call}(env_ids=...)", ndim=1)
        n = env.shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        fault = (bad, f"`{call}`: an env id is outside [0, num_envs) = [0, {self.num_envs})")

        axis, n = self.axis, self.num_shards

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
        return self._local(local, env, jnp.asarray(starts), priorities, sharded=False)

    @_compiled
    def stale(self, *args: Any) -> Bool[Array, " n"]:
        """The shards' `stale`, with global names: `(indices, generations)` for a
        `PrioritisedReplay`, `(env_ids, starts)` for a trajectory buffer: which entries a
        `set_priorities` with the same names drops. Replicated; it costs one all-reduce of a
        byte per entry (a replay) or of two numbers per env (a trajectory buffer).

        **Raises:** an `eqx.error_if` error, in every process, for a name that is not a
        stored item of any shard (an index) or a step its env has taken (a stamp).
        """
        call = f"{_NAME}.stale"
        if isinstance(self.shards, PrioritisedReplay):
            return self._stale_items(*args, call=call)
        if isinstance(self.shards, AbstractTrajectoryBuffer):
            return self._stale_windows(*args, call=call)
        raise TypeError(f"`{call}`: a {type(self.shards).__name__} has no `stale`.")

    def _stale_items(self, indices: Any, generations: Any, *, call: str) -> Bool[Array, " n"]:
        index, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        generations = check_generations(generations, index.shape[0], call)
        axis, n, k = self.axis, self.num_shards, self.rows_per_shard

        def local(replay: PrioritisedReplay, index, generations, bad):
            owner, slot = index // k, index % k
            mine = owner == jax.lax.axis_index(axis)
            unstored = slot >= _per_shard(replay.size, axis, n)[owner]
            out = replay.generations[jnp.where(mine, slot, 0)] != generations
            out = _assemble(out, mine, axis)
            return check_faults(out, [(bad | unstored, f"`{call}`: {_NOT_STORED}")])

        return self._map(local, (index, generations, bad), P())

    def _stale_windows(self, env_ids: Any, starts: Any, *, call: str) -> Bool[Array, " n"]:
        env, bad = check_index(env_ids, self.num_envs, f"{call}(env_ids=...)", ndim=1)
        start = check_vector(starts, env.shape[0], call, "starts")
        axis, n = self.axis, self.num_shards

        def local(buffer: AbstractTrajectoryBuffer, env, start, bad):
            stamps = _global_stamps(buffer, env, start, bad, axis, n, call)
            return check_faults(stamps.stale, stamps.faults)

        return self._map(local, (env, start, bad), P())

    # ------------------------------------------------------------------ machinery

    def _need(self, types: tuple[type, ...], what: str) -> None:
        if not isinstance(self.shards, types):
            names = ", ".join(t.__name__ for t in types)
            raise TypeError(
                f"`{_NAME}.{what}` is for shards of type {names}; these are "
                f"{type(self.shards).__name__}."
            )

    def _split(self, tree: PyTree[Array], call: str) -> None:
        for x in jax.tree.leaves(tree):
            if x.ndim == 0 or x.shape[0] % self.num_shards:
                raise ValueError(
                    f"`{call}`: the rows are split into {self.num_shards} equal blocks, one per "
                    f"shard; an argument of shape {x.shape} has a leading axis that "
                    f"{self.num_shards} does not divide."
                )

    def _append(self: _G, items, env_ids, call: str, fn) -> _G:
        self._need(_TRAJECTORIES, call.split(".")[1])
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
            return self._local(fn, items)
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

        return self._local(local, items, ids)

    def _local(self: _G, fn: Callable[..., Any], *args: Any, sharded: bool = True) -> _G:
        """`fn(shard, *args) -> shard` on every shard; `args` split over the shards in equal
        blocks (`sharded`) or replicated."""
        spec = P(self.axis) if sharded else P()
        _, shards = self._map(lambda *a: (None, fn(*a)), args, P(), arg_spec=spec, module=True)
        return eqx.tree_at(lambda g: g.shards, self, shards)

    def _map(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        out_spec: Any,
        *,
        arg_spec: Any = P(),
        module: bool = False,
    ) -> Any:
        """`fn(shard, *args)` inside `shard_map`, each device with its own shard (a module
        of the shards' type). With `module`, `fn` returns `(out, shard)` and so does this,
        the new shards stacked and split over the axis; `out_spec` is that of `out`."""
        dynamic, static = eqx.partition(self.shards, eqx.is_array)
        new_static: list[Any] = []

        def body(dynamic, *args):
            out = fn(jax.tree.map(lambda x: x[0], eqx.combine(dynamic, static)), *args)
            if not module:
                return out
            out, shard = out
            shard_dynamic, shard_static = eqx.partition(shard, eqx.is_array)
            new_static.append(shard_static)
            return out, jax.tree.map(lambda x: x[None], shard_dynamic)

        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P(self.axis), *([arg_spec] * len(args))),
            out_specs=(out_spec, P(self.axis)) if module else out_spec,
            axis_names={self.axis},
        )
        # `shard_map` takes its inputs only as `in_specs` places them: eagerly, and under
        # `jit` on a mesh of explicit axes, where the sharding is part of an array's type.
        placed = NamedSharding(self.mesh, arg_spec)
        args = tuple(jax.tree.map(lambda x: _place(x, placed), a) for a in args)
        out = mapped(dynamic, *args)
        if not module:
            return out
        out, shard_dynamic = out
        return out, eqx.combine(shard_dynamic, new_static[0])


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


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
    counts = _per_shard(buffer.step_count, axis, n).reshape(-1)
    lengths = _per_shard(buffer.streams.lengths, axis, n).reshape(-1)
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


# ---------------------------------------------------------------------- construction helpers


def _place(x: Any, sharding: NamedSharding) -> Any:
    if is_concrete(x):
        return _put(x, sharding)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in getattr(sharding.mesh, "axis_types", ()):
        return jax.sharding.reshard(x, sharding)
    return x


def _put(x: Any, sharding: NamedSharding) -> Array:
    """`x` placed with `sharding`: a global array as it is if already so placed, else moved;
    a local or host value (the same in every process) as every process's part of it."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda y: y, out_shardings=sharding)(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _array_leaves(tree: Any) -> list[Any]:
    arrays = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)
    return [x for x in jax.tree.leaves(tree) if isinstance(x, arrays)]


def _shard_type(shards: Any) -> type:
    return type(shards)


def _check_shard_type(kind: type, call: str) -> None:
    if not issubclass(kind, (*_REPLAYS, *_TRAJECTORIES)):
        names = ", ".join(t.__name__ for t in (*_REPLAYS, *_TRAJECTORIES))
        raise TypeError(f"`{call}`: a shard must be one of {names}; got a {kind.__name__}.")


def _vmap_make(make: Callable[[], Any], n: int) -> Any:
    return eqx.filter_vmap(make, axis_size=n)()


def _make_shards(mesh: Mesh, axis: str, make: Callable[[], Any]) -> Any:
    n = mesh.shape[axis]
    shape = eqx.filter_eval_shape(_vmap_make, make, n)
    _check_shard_type(type(shape), _NAME)
    static = eqx.filter(shape, lambda x: not isinstance(x, jax.ShapeDtypeStruct))
    sharding = NamedSharding(mesh, P(axis))
    dynamic = jax.jit(
        lambda: eqx.filter(_vmap_make(make, n), eqx.is_array), out_shardings=sharding
    )()
    return eqx.combine(dynamic, static)


def _stack_shape(mesh: Mesh, axis: str | None, make_or_local: Any) -> Any:
    """A shape-only stack of `mesh.shape[axis]` shards: from `make`, or from one process's
    stacked shards (whose first shard is the template)."""
    axis = axis if axis is not None else (mesh.axis_names[0] if len(mesh.axis_names) == 1 else None)
    if axis is None or axis not in mesh.axis_names:
        raise ValueError(
            f"`{_NAME}`: the mesh has axes {mesh.axis_names}; name the one the shards are "
            "split over with `axis=`."
        )
    n = mesh.shape[axis]
    if callable(make_or_local) and not isinstance(make_or_local, eqx.Module):
        return eqx.filter_eval_shape(_vmap_make, make_or_local, n)

    def widen(x):
        if eqx.is_array(x) or isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct((n, *np.shape(x)[1:]), x.dtype)
        return x

    return jax.tree.map(widen, make_or_local)


# ---------------------------------------------------------------------- sampling helpers


def _per_shard(x: Array, axis: str, n: int) -> Array:
    """Every shard's `x`, stacked in shard order, in every device: one all-reduce of
    `n · x.size` numbers (each device adds its own at its place, zeros elsewhere: exact)."""
    me = jax.lax.axis_index(axis)
    x = jnp.asarray(x)
    return jax.lax.psum(jnp.zeros((n, *x.shape), x.dtype).at[me].set(x), axis)


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _assemble(rows: PyTree[Array], mine: Bool[Array, " b"], axis: str) -> PyTree[Array]:
    """The rows each device owns (`mine`), put together in every device: one all-reduce of
    the batch. Values travel as their bits, so a float comes back bit for bit (-0.0, NaN
    payloads included), not as a sum."""

    def one(x):
        if not eqx.is_array(x):
            return x
        keep = mine.reshape(mine.shape + (1,) * (x.ndim - 1))
        dtype = x.dtype
        if dtype == jnp.bool_:
            return jax.lax.psum(jnp.where(keep, x, False).astype(jnp.uint8), axis) > 0
        if jnp.issubdtype(dtype, jnp.integer):
            return jax.lax.psum(jnp.where(keep, x, 0), axis)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            parts = one(jnp.real(x)), one(jnp.imag(x))
            return jax.lax.complex(*parts).astype(dtype)
        bits = jax.lax.bitcast_convert_type(x, _BITS[dtype.itemsize])
        summed = jax.lax.psum(jnp.where(keep, bits, 0), axis)
        return jax.lax.bitcast_convert_type(summed, dtype)

    return jax.tree.map(one, rows)


def _locate(targets: Array, masses: Array) -> tuple[Int[Array, " b"], Array]:
    """For each target in `[0, Σ masses)`, the shard whose slice of the total holds it and the
    target's place in that shard's slice. `masses` is `(shards,)` or, per row, `(b,
    shards)`. A shard of zero mass is never chosen; a target rounded up to the total goes to
    the last shard of positive mass."""
    ends = jnp.cumsum(masses, axis=-1)
    if masses.ndim == 1:
        owner = jnp.searchsorted(ends, targets, side="right", method="compare_all")
        owner = jnp.minimum(owner, jnp.argmax(ends)).astype(jnp.int32)
        begin = (ends - masses)[owner]
        return owner, jnp.minimum(targets - begin, masses[owner])
    owner = jnp.sum(ends <= targets[:, None], axis=-1)
    owner = jnp.minimum(owner, jnp.argmax(ends, axis=-1)).astype(jnp.int32)
    rows = jnp.arange(targets.shape[0])
    begin = (ends - masses)[rows, owner]
    return owner, jnp.minimum(targets - begin, masses[rows, owner])


def _float_targets(key: PRNGKeyArray, batch_size: int, total: Array, stratified: bool) -> Array:
    """What `draw_leaves` draws from one tree of mass `total`, for a total over shards."""
    dtype = total.dtype
    uniform = jax.random.uniform(key, (batch_size,), dtype)
    if stratified:
        return (jnp.arange(batch_size, dtype=dtype) + uniform) * (total / batch_size)
    return uniform * total


def _mass_faults(total: Array, call: str, items: str) -> list[Fault]:
    return [
        (total <= 0, f"`{call}`: every stored {items} has priority 0; none can be drawn"),
        (
            ~jnp.isfinite(total),
            f"`{call}`: the total priority mass sum(priority ** priority_exponent) is not "
            "finite in the tree's dtype",
        ),
    ]


def _raise_max(buffer: Any, priorities: Array, mask: Array) -> Any:
    """`buffer` with its largest recorded priority raised to that of every entry, as a single
    buffer does (each shard sees every entry, so every shard keeps the same)."""
    top = jnp.max(jnp.where(mask & jnp.isfinite(priorities), priorities, 0), initial=0)
    return eqx.tree_at(
        lambda b: b.priorities.max_priority,
        buffer,
        replace_fn=lambda m: jnp.maximum(m, top.astype(m.dtype)),
    )


class _UniformLaw:
    """Each stored item with mass 1: integer targets, so a draw is exactly a single
    replay's."""

    @staticmethod
    def mass(replay: UniformReplay) -> Array:
        return replay.size

    @staticmethod
    def targets(key: PRNGKeyArray, batch_size: int, total: Array) -> Array:
        return jax.random.randint(key, (batch_size,), 0, total, dtype=jnp.int32)

    @staticmethod
    def at(replay: UniformReplay, positions: Array, total: Array) -> Any:
        del total
        return gather(replay.storage, positions)

    @staticmethod
    def globalize(out: Any, owner: Array, capacity: int) -> Any:
        del owner, capacity
        return out

    @staticmethod
    def faults(total: Array, call: str) -> list[Fault]:
        del total, call
        return []


class _PrioritisedLaw:
    """Each stored item with its mass `p ** α`: float targets over the global total."""

    @staticmethod
    def mass(replay: PrioritisedReplay) -> Array:
        return replay.priorities.tree.total

    @staticmethod
    def targets(key: PRNGKeyArray, batch_size: int, total: Array, stratified: bool) -> Array:
        return _float_targets(key, batch_size, total, stratified)

    @staticmethod
    def at(replay: PrioritisedReplay, values: Array, total: Array) -> PrioritisedSample:
        slots, value = find_leaves(replay.priorities.tree, values)
        positive = total > 0
        probabilities = jnp.where(positive, value / jnp.where(positive, total, 1), 0)
        return PrioritisedSample(
            gather_slots(replay.storage, slots), slots, probabilities, replay.generations[slots]
        )

    @staticmethod
    def globalize(out: PrioritisedSample, owner: Array, capacity: int) -> PrioritisedSample:
        return out._replace(indices=out.indices + owner * capacity)

    @staticmethod
    def faults(total: Array, call: str) -> list[Fault]:
        return _mass_faults(total, call, "item")


class _Bound:
    """A law with the replay's static options bound (a prioritised replay's stratification)."""

    def __init__(self, law: Any, replay: AbstractReplay):
        self.law = law
        self.stratified = isinstance(replay, PrioritisedReplay) and replay.priorities.stratified

    def mass(self, replay):
        return self.law.mass(replay)

    def targets(self, key, batch_size, total):
        if self.law is _PrioritisedLaw:
            return self.law.targets(key, batch_size, total, self.stratified)
        return self.law.targets(key, batch_size, total)

    def at(self, replay, values, total):
        return self.law.at(replay, values, total)

    def globalize(self, out, owner, capacity):
        return self.law.globalize(out, owner, capacity)

    def faults(self, total, call):
        return self.law.faults(total, call)


def _law(replay: AbstractReplay) -> _Bound:
    if isinstance(replay, UniformReplay):
        return _Bound(_UniformLaw, replay)
    if isinstance(replay, PrioritisedReplay):
        return _Bound(_PrioritisedLaw, replay)
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
    law = _law(replay.clusters)
    sizes = _per_shard(replay.cluster_sizes, axis, n)  # (shards, clusters)
    masses = _per_shard(jax.vmap(law.mass)(replay.clusters), axis, n)
    cluster_key, target_key = jax.random.split(key)
    chosen = choose_clusters(
        cluster_key, jnp.sum(sizes, axis=0), replay.distribution_power, batch_size
    )
    row_masses = masses[:, chosen].T  # (batch, shards): the chosen cluster's mass per shard
    row_totals = jnp.sum(row_masses, axis=-1)
    if law.law is _UniformLaw:
        targets = jax.random.randint(target_key, (batch_size,), 0, jnp.maximum(row_totals, 1))
    else:
        unit = jax.random.uniform(target_key, (batch_size,), row_masses.dtype)
        if law.stratified:
            unit = (jnp.arange(batch_size, dtype=row_masses.dtype) + unit) / batch_size
        targets = unit * row_totals
    owner, residual = _locate(targets, row_masses)
    mine = owner == me
    residual = jnp.where(mine, residual, 0)
    draws = jax.vmap(lambda r: law.at(r, residual, row_totals))(replay.clusters)
    rows = jnp.arange(batch_size)
    picked = jax.tree.map(lambda x: x[chosen, rows], draws)
    # Each row's probability is within its cluster: divided by that cluster's global total.
    out = _assemble(picked, mine, axis)
    out = law.globalize(out, owner, replay.clusters.max_size)
    total_size = jnp.sum(sizes)
    faults = [(total_size == 0, f"`{call}`: cannot sample from an empty ClusteredReplay")]
    return check_faults(out, faults, order_reads=False)
