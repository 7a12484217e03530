"""GlobalTrajectoryBuffer: a trajectory buffer's envs split over every device of a mesh,
across processes."""

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer, Source
from ._checks import (
    check_index,
    check_items,
    check_mask_like,
    check_positive_int,
    check_sequences,
    check_vector,
    INT32_MAX,
    plural,
)
from ._dataset import Dataset
from ._episode_laws import WholeEpisode
from ._faults import check_faults, collect_faults, Fault
from ._global import (
    AbstractGlobalBuffer,
    add_blocks,
    check_blocks,
    Door,
    door_floats,
    door_mask,
    routed_query,
    routed_write,
    shard_call_of,
)
from ._laws import AbstractLaw
from ._nstep import NStep
from ._policy_age import PolicyAge
from ._relabel import Relabel
from ._results import reports
from ._shard_map import Layout, run
from ._streams import filled, Streams
from ._windows import Window


_T = TypeVar("_T", bound="GlobalTrajectoryBuffer")
_B = TypeVar("_B", bound=eqx.Module)


class GlobalTrajectoryBuffer(AbstractGlobalBuffer, AbstractTrajectoryBuffer):
    """A trajectory buffer of `num_shards · shard num_envs` envs whose shards (any trajectory
    buffer: a `TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`, `TrajectoryQueue`, or one of
    your own) live one per device of a mesh axis, also across the processes of a
    `jax.distributed` program. Each env's stream lives whole on one device. It is a
    trajectory buffer itself (an `AbstractTrajectoryBuffer`: its `streams` are every shard's
    envs in order), so the layers over trajectory buffers take it as they are
    (`RateLimited`, `ReplayService`).

    - **Adding is local.** `add`/`extend` take every env's steps (or global `env_ids`, each
        block naming envs of its own shard); no collective. A process builds the arguments
        from its own envs with `rows`.
    - **Sampling is exact and global** (`sample`, with every option of the shards'
        `sample`: windows, n-step transitions, sources, policy age); a queue's `pop` returns
        every env's steps, each shard's on its own device.
    - **Global env ids.** Env `e` of shard `k` is env `k · rows_per_shard + e` (`env_range`);
        samples name windows by global stamps, which `set_priorities`, `stale`, `read` and
        `peek` take back, each entry answered by the shard that holds its env.
    - **On disk.** `write_datasets` keeps one `dx.Dataset` per shard, each written by the
        process that holds it; `load_datasets` reads them back.

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

    def __init__(
        self,
        mesh: Mesh,
        make: Callable[[], AbstractTrajectoryBuffer] | None = None,
        *,
        axis: str | None = None,
        shards: AbstractTrajectoryBuffer | None = None,
        throw: bool | None = None,
    ):
        """`AbstractGlobalBuffer`'s, declared for type checkers (they would make one)."""
        super().__init__(mesh, make, axis=axis, shards=shards, throw=throw)

    @staticmethod
    def _family() -> type:
        return AbstractTrajectoryBuffer

    @property
    def rows_per_shard(self) -> int:
        """Each shard's number of envs."""
        return self.template.num_envs

    @property
    def streams(self) -> Streams:
        """Every shard's streams as one `Streams` of `num_envs` envs, shard 0's first: its
        arrays are the shards' with their first two axes merged (split over the mesh as the
        shards are)."""
        stacked = self.shards.streams
        arrays = (stacked.data, stacked.step_count, stacked.lengths)
        merged = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), arrays)
        return _with_arrays(_streams_shape(self, self.num_envs), merged)

    @property
    def num_envs(self) -> int:
        """The number of envs: `num_shards · rows_per_shard` (static)."""
        return self.num_shards * self.rows_per_shard

    @property
    def max_length(self) -> int:
        return self.template.max_length

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.template.item_spec

    def env_range(self, shard: int) -> range:
        """The global env ids of `shard`."""
        k = self.rows_per_shard
        return range(shard * k, (shard + 1) * k)

    @reports
    def add(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """The shards' `add`: one step per listed env, each shard storing its own block.
        With `env_ids=None`, `items` holds every env (`num_envs` rows) in order; otherwise
        `n = num_shards · m` rows and global env ids, the `m` of block `k` all envs of shard
        `k` (`env_range(k)`). No collective.

        **Raises:** `ValueError`/`TypeError` at once if `num_shards` does not divide the
        rows, or for items the shards refuse; an `eqx.error_if` error, in the process that
        holds the shard, if an env id of block `k` is not an env of shard `k` (a process
        adding to envs it does not own), and for what the shards' own `add` raises.
        """
        call = "GlobalTrajectoryBuffer.add"
        items = filled(self.template.streams, items, 1)
        items, _ = check_items(self.item_spec, items, call, batched=True)
        blocks, door = _blocks(self, items, env_ids, call)
        return self._run(add_blocks, _add, blocks, *Door.of(door), shard_call_of(self, "add"), call)

    @reports
    def extend(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
        """The shards' `extend` (`T` steps per listed env), split as `add`."""
        call = "GlobalTrajectoryBuffer.extend"
        items = filled(self.template.streams, items, 2)
        items, _, _ = check_sequences(self.item_spec, items, call)
        blocks, door = _blocks(self, items, env_ids, call)
        shard_call = shard_call_of(self, "extend")
        return self._run(add_blocks, _extend, blocks, *Door.of(door), shard_call, call)

    def with_streams(self: _T, streams: Streams) -> _T:
        """The shards' `with_streams`, shard `k` taking envs `env_range(k)` of `streams`."""
        call = "GlobalTrajectoryBuffer.with_streams"
        streams = self._check_streams(streams, call)
        # Rows split over the shards in equal blocks, as `add` splits its rows.
        arrays = (streams.data, streams.step_count, streams.lengths)
        fn = _WithStreams(_streams_shape(self, self.rows_per_shard))
        shard_call = shard_call_of(self, "with_streams")
        return self._run(add_blocks, fn, (arrays,), [], (), shard_call, call)

    # --- sampling ---------------------------------------------------------------------

    def law(
        self,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
        call: str = "GlobalTrajectoryBuffer.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """The shards' law: what `sample` draws by, over every shard together. (A global
        buffer is a layer: it is never a shard, which would draw by it alone.)"""
        return self.template.law(
            what,
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
            call=call,
        )

    @reports
    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
    ) -> Any:
        """Rows drawn by the shards' law over the whole buffer, with replacement, with the
        arguments and in the form of the shards' own `sample` (see
        `AbstractTrajectoryBuffer.sample`):

        - `TrajectoryBuffer` shards: windows (every `Window` option) or n-step transitions by
            the start weights of every env of every shard: the rows a single buffer of
            `num_envs` envs draws with the same key; `env` is the global env. Every `source`,
            a mapping of sources included.
        - `PrioritisedTrajectoryBuffer` shards: `P ∝ p ** α` over the windows of every shard,
            i.i.d. or stratified over the global total; `indices` global (`shard · shard
            leaves + leaf`), `env` global, `weights` from the global number of windows.
        - with `age`: the shards' aged law over every shard's candidates together.

        Besides the shards' own reads, it costs one all-reduce of the shards' summaries (two
        numbers per env, or a few per shard) and one of the batch. The key is replicated;
        the batch is the same on every device.

        **Raises:** as the shards' `sample`, about the whole buffer, in every process.
        """
        call = "GlobalTrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        law, faults = self.template.law(
            what,
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
            call=call,
        )
        return self._sample_union(law, faults, key, batch_size, call)

    def sample_by(
        self: _T,
        law: AbstractLaw,
        key: PRNGKeyArray,
        batch_size: int,
        faults: Sequence[Fault],
        call: str,
        *,
        rows: Int[Array, ""] | None = None,
    ) -> tuple[_T, Any]:
        """`batch_size` rows drawn by `law` (a shard's) over every shard, as `sample` draws
        (see `AbstractTrajectoryBuffer.sample_by`)."""
        return self, self._sample_union(law, list(faults), key, batch_size, call)

    @reports
    def pop(self: _T, sequence_length: int) -> tuple[PyTree[Array], _T]:
        """The shards' `pop`: the `sequence_length` oldest unread steps of every env.

        **Returns:** `(items, buffer)`; `items` has the layout of a single queue's,
        `(num_envs, sequence_length, ...)`, its env axis split over the shards as the buffer's
        (each shard's steps stay on its device).

        **Raises:** `TypeError` at once for shards that are not read once; as the shards'
        `pop`, in every process when any env is short (one all-reduce of a word).
        """
        call = "GlobalTrajectoryBuffer.pop"
        # A buffer that is not read once says so here, at once.
        eqx.filter_eval_shape(lambda q: q.can_pop(1), self.template)
        length = check_positive_int(
            sequence_length, f"{call}(sequence_length=...)", maximum=self.max_length
        )
        shard_call = shard_call_of(self, "pop")
        items, shards = run(_pop, self.layout, self.shards, length, shard_call, call)
        return items, eqx.tree_at(lambda g: g.shards, self, shards)

    def can_pop(self, length: int) -> Bool[Array, ""]:
        """Whether every env of every shard holds `length` unread steps."""
        return jnp.all(eqx.filter_vmap(lambda q: q.can_pop(length))(self.shards))

    # --- stamps: each entry answered by the shard that holds its env --------------------

    @reports
    def set_priorities(
        self: _T,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _T:
        """The shards' `set_priorities` with global env ids: each entry is applied by the
        shard of its env, and a stale window's entry is dropped. Every shard's largest
        recorded priority rises with every entry, as a single buffer's. The arguments are
        replicated: every device reads them all.

        **Raises:** `TypeError` at once for shards without priorities; an `eqx.error_if`
        error, in every process, for a stamp this buffer cannot have given or a priority
        that is negative or not finite.
        """
        call = "GlobalTrajectoryBuffer.set_priorities"
        env, starts, n, door = _stamps(self, env_ids, starts, call)
        valid = door_mask(mask, n, call)
        values = check_vector(priorities, n, call, "priorities")
        priorities, more = door_floats(values, call, "priorities", None if mask is None else valid)
        args = (_set, _note, _split_envs, env, (starts, priorities), valid, *Door.of(door + more))
        return self._run(routed_write, *args, shard_call_of(self, "set_priorities"), call)

    @reports
    def stale(
        self,
        env_ids: Integer[ArrayLike, "*n"],
        starts: Integer[ArrayLike, "*n"],
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> Bool[Array, "*n"]:
        """Whether the windows named by global stamps `(env_ids, starts)` have lost steps
        since: the entries `set_priorities` drops. Replicated; one all-reduce of a word per
        entry.

        **Raises:** an `eqx.error_if` error, in every process, for an env id out of range or
        a start its env has not taken.
        """
        return _ask(self, _stale, "stale", env_ids, starts, mask)[0]

    @reports
    def read(
        self,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        window: Window,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Any:
        """The shards' `read` with global stamps: each window read again by the shard of its
        env, and put together in every device (one all-reduce of the windows)."""
        out, env = _ask(self, _Read(window), "read", env_ids, starts, mask)
        return out._replace(env=env)

    @reports
    def peek(
        self,
        env_ids: Integer[ArrayLike, "*n"] | None = None,
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> PyTree[Array]:
        """The newest step of each listed env (global ids; `None`: every env), read by the
        shard of its env and put together in every device."""
        if env_ids is None:
            env_ids = jnp.arange(self.num_envs, dtype=jnp.int32)
        starts = jnp.zeros(jnp.shape(env_ids), jnp.int32)
        return _ask(self, _peek, "peek", env_ids, starts, mask)[0]

    def write_datasets(
        self, root: str | os.PathLike, *, chunk_length: int = 1024, sync: bool = True
    ) -> int:
        """Each process appends its own shards to disk: shard `k` to its own `dx.Dataset`,
        `root/shard-<k>` (made at the first write, with `chunk_length` and `sync` as in
        `Dataset.create`), whose env `e` is the global env `k · rows_per_shard + e`.

        One writer per dataset, as `Dataset` requires: a shard lives on one device, whose
        process alone writes it. Every process calls it (no collective; on the host, between
        jitted steps), and `load_datasets` reads the shards back. It returns once this
        process's shards are written: to load them in the same program, wait for every
        process's call to return first (`jax.experimental.multihost_utils.sync_global_devices`),
        since adds do not keep the processes in step.

        **Returns:** the number of steps this process wrote.

        **Raises:** `ValueError` before anything is written if `root` holds the datasets of
        another number of shards, or if any of this process's shards could not be written
        (see `Dataset.write`): all of them are checked first.
        """
        call = "GlobalTrajectoryBuffer.write_datasets"
        return _write_datasets(self, Path(root), chunk_length, sync, call)

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

        **Raises:** `ValueError` before anything is read if `root` holds the datasets of
        another number of shards than the mesh has (their envs could not be laid out as
        they were written); `FileNotFoundError` if a shard's dataset is missing; what
        `Dataset.open` and `Dataset.load` raise.
        """
        call = "GlobalTrajectoryBuffer.load_datasets"
        template = cls.abstract(mesh, make, axis=axis)
        local = _read_datasets(template, Path(root), make, call)
        return cls.from_process_local(mesh, local, axis=template.axis)


class _WithStreams(eqx.Module):
    """`with_streams` on a shard, from its block of the streams' arrays."""

    template: Streams = eqx.field(static=True)  # a shard's streams, as shapes

    def __call__(self, shard: AbstractTrajectoryBuffer, arrays: Any) -> Any:
        return shard.with_streams(_with_arrays(self.template, arrays))


class _Read(eqx.Module):
    """`read` on a shard with a window (static)."""

    window: Window

    def __call__(self, shard: Any, env: Array, starts: Array, *, mask: Array) -> Any:
        return shard.read(env, starts, self.window, mask=mask)


def _add(shard: Any, items: Any, env_ids: Any) -> Any:
    return shard.add(items, env_ids)


def _extend(shard: Any, items: Any, env_ids: Any) -> Any:
    return shard.extend(items, env_ids)


def _split_envs(shard: AbstractTrajectoryBuffer, env: Array) -> tuple[Array, Array]:
    return shard.split_envs(env)


def _set(shard: Any, env: Array, starts: Array, priorities: Array, *, mask: Array) -> Any:
    return shard.set_priorities(env, starts, priorities, mask=mask)


def _note(shard: Any, env: Array, starts: Array, priorities: Array, *, mask: Array) -> Any:
    return shard.note_priorities(env, starts, priorities, mask=mask)


def _stale(shard: Any, env: Array, starts: Array, *, mask: Array) -> Array:
    return shard.stale(env, starts, mask=mask)


def _peek(shard: Any, env: Array, starts: Array, *, mask: Array) -> Any:
    return shard.peek(env, mask=mask)


def _streams_shape(buffer: GlobalTrajectoryBuffer, num_envs: int) -> Streams:
    """The streams of `num_envs` envs of the buffer's items and `max_length`, as shapes."""
    return eqx.filter_eval_shape(Streams, buffer.item_spec, num_envs, buffer.max_length)


def _with_arrays(streams: Streams, arrays: Any) -> Streams:
    """`streams` holding `arrays`: its `(data, step_count, lengths)`."""
    return eqx.tree_at(lambda s: (s.data, s.step_count, s.lengths), streams, arrays)


def _outside(bad: Bool[Array, "*n"], call: str, num_envs: int) -> Fault:
    """The fault of a global env id outside the buffer's envs."""
    return (bad, f"`{call}`: an env id is outside [0, num_envs) = [0, {num_envs})")


def _blocks(
    buffer: GlobalTrajectoryBuffer, items: PyTree[Array], env_ids: Any, call: str
) -> tuple[tuple[PyTree[Array], Array | None], list[Fault]]:
    """What `add`/`extend` give each shard, `(items, env ids of the shard)` split over the
    shards, and the faults of the env ids. With `env_ids=None`, every env's row in order
    (and `None` for the env ids)."""
    k, n, num_envs = buffer.rows_per_shard, buffer.num_shards, buffer.num_envs
    if env_ids is None:
        for x in jax.tree.leaves(items):
            if x.shape[0] != num_envs:
                raise ValueError(
                    f"`{call}`: with `env_ids=None`, each leaf of `items` needs a leading "
                    f"axis of num_envs = {num_envs} ({n} shards of {k} envs); got "
                    f"shape {x.shape}."
                )
        return (items, None), []
    ids, bad = check_index(env_ids, num_envs, f"{call}(env_ids=...)", ndim=1)
    check_blocks((items, ids), n, call)
    # Block s must name envs of shard s: checked where the block lands, in the process
    # that holds the shard, which made those rows.
    block = ids.shape[0] // n
    shard = jnp.repeat(jnp.arange(n, dtype=jnp.int32), block)
    local = ids - shard * k
    foreign = ~bad & ((local < 0) | (local >= k))
    door: list[Fault] = [
        _outside(bad, call, num_envs),
        (
            foreign,
            f"`{call}`: rows of block s of `env_ids` must name envs of shard s (s · {k} "
            f"<= env id < (s + 1) · {k}); a process adds only to its own envs",
        ),
    ]
    local = jnp.where(bad | foreign, k, local)  # out of range for the shard: dropped
    return (items, local), door


def _ask(
    buffer: GlobalTrajectoryBuffer,
    ask: Callable[..., Any],
    method: str,
    env_ids: Any,
    starts: Any,
    mask: Any,
) -> tuple[Any, Array]:
    """`ask` on the shard of each entry's env (`stale`, `read`, `peek`), and the checked
    global env ids."""
    call = f"GlobalTrajectoryBuffer.{method}"
    env, starts, _, door = _stamps(buffer, env_ids, starts, call, flat=False)
    valid = jnp.ones(env.shape, jnp.bool_) if mask is None else check_mask_like(mask, env, call)
    flat = (env.reshape(-1), (starts.reshape(-1),), valid.reshape(-1))
    args = (ask, _split_envs, *flat, *Door.of(door), shard_call_of(buffer, method), call)
    out = run(routed_query, buffer.layout, buffer.shards, *args)
    return jax.tree.map(lambda x: x.reshape(*env.shape, *x.shape[1:]), out), env


def _stamps(
    buffer: GlobalTrajectoryBuffer, env_ids: Any, starts: Any, call: str, *, flat: bool = True
) -> tuple[Array, Array, int, list[Fault]]:
    """Global stamps, checked in their own dtype (never wrapped on the way to int32), their
    number, and the faults of an env id out of range."""
    ndim, num_envs = (1 if flat else None), buffer.num_envs
    env, bad = check_index(env_ids, num_envs, f"{call}(env_ids=...)", ndim=ndim)
    start, bad_start = check_index(starts, INT32_MAX, f"{call}(starts=...)", ndim=ndim)
    if env.shape != start.shape:
        raise ValueError(
            f"`{call}`: `env_ids` has shape {env.shape} and `starts` {start.shape}; they "
            "must match, one start per env id."
        )
    faults: list[Fault] = [
        _outside(bad, call, num_envs),
        (
            ~bad & bad_start,
            f"`{call}`: a start is not a step of its env (negative, or not yet taken); "
            "stamps must come from this buffer",
        ),
    ]
    return jnp.where(bad, 0, env), start, int(np.prod(env.shape)), faults


def _pop(layout: Layout, shards: Any, length: int, shard_call: str, call: str) -> Any:
    """Every shard's `pop`, refused in every process if any env is short (one all-reduce)."""
    axis = layout.axis

    def local(queue: AbstractTrajectoryBuffer) -> Any:
        short = jax.lax.psum((~queue.can_pop(length)).astype(jnp.int32), axis) > 0
        fault = (
            short,
            f"`{call}`: an env holds fewer than {plural(length, 'unread step')}; pop once "
            "`can_pop(sequence_length)` holds",
        )
        # The queue's own fault is this one, found in its shard alone: raised everywhere above.
        (items, queue), _ = collect_faults(lambda: queue.pop(length))
        return check_faults(items, [fault], order_reads=False), queue

    return layout.map(shards, local, (), P(axis), module=True)


def _write_datasets(
    buffer: GlobalTrajectoryBuffer, root: Path, chunk_length: int, sync: bool, call: str
) -> int:
    """`write_datasets`: this process's shards, each to its dataset under `root`, every one
    checked before any is written; the number of steps written."""
    _check_shards_on_disk(root, buffer.num_shards, call, writing=True)
    local = buffer.local_shards()
    datasets = []
    try:
        shards = []
        for j, k in enumerate(buffer.local_shard_ids):
            shard = jax.tree.map(
                lambda x: jnp.asarray(x[j]) if isinstance(x, np.ndarray) else x, local
            )
            path = root / _shard_name(k)
            if path.exists():
                dataset = Dataset.open(path, shard, sync=sync)
                datasets.append(dataset)
                dataset.check_write(shard)  # every shard checked before any is written
            shards.append((path, shard))
        written = 0
        for (path, shard), dataset in zip(shards, _opened(shards, datasets)):
            if dataset is None:
                dataset = Dataset.create(
                    path, shard.item_spec, shard.num_envs, chunk_length=chunk_length, sync=sync
                )
                datasets.append(dataset)
            written += dataset.write(shard)
        return written
    finally:
        for dataset in datasets:
            dataset.close()


def _read_datasets(
    template: GlobalTrajectoryBuffer, root: Path, make: Callable[[], Any], call: str
) -> Any:
    """`load_datasets`: the shards of this process's devices on `template`'s mesh, read from
    their datasets under `root` into `make()`, stacked as `from_process_local` takes them."""
    _check_shards_on_disk(root, template.num_shards, call, writing=False)
    like = eqx.filter_eval_shape(make)
    shards = []
    for k in template.local_shard_ids:
        dataset = Dataset.open(root / _shard_name(k), like)
        try:
            shards.append(dataset.load(like))
        finally:
            dataset.close()
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *shards)


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def _opened(shards: list, datasets: list) -> list:
    """The open dataset of each shard (in `shards`' order), or `None` for one to create."""
    by_path = {d.path: d for d in datasets}
    return [by_path.get(path) for path, _ in shards]


def _check_shards_on_disk(root: Path, shards: int, call: str, *, writing: bool) -> None:
    """Refuse a `root` that holds the datasets of another number of shards (any at all for a
    read; none beyond `shards` for a write, whose own shards may not exist yet)."""
    found = sorted(p.name for p in root.glob("shard-*")) if root.is_dir() else []
    numbers = sorted(int(name.removeprefix("shard-")) for name in found if name[6:].isdigit())
    expected = list(range(shards))
    beyond = [k for k in numbers if k >= shards]
    if beyond or (not writing and numbers != expected):
        if not writing and not numbers:
            raise FileNotFoundError(
                f"`{call}`: no dataset for any shard under {str(root)!r}; {shards} shards "
                "need one each (`root/shard-<k>`)."
            )
        missing = [k for k in expected if k not in numbers]
        unfinished = (
            f" Or shards {missing} are not written yet: in one program, load only once every "
            "process's `write_datasets` has returned (after a barrier such as "
            "`jax.experimental.multihost_utils.sync_global_devices`)."
            if missing and not beyond and not writing and jax.process_count() > 1
            else ""
        )
        raise ValueError(
            f"`{call}`: {str(root)!r} holds the datasets of shards {numbers}, but this buffer "
            f"has {shards} shards ({expected[0]}..{expected[-1]}): they were written by "
            "another number of shards, whose envs cannot be laid out on these. Use the "
            f"number of shards that wrote them.{unfinished} Nothing was "
            f"{'written' if writing else 'read'}."
        )
