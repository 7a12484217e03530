"""The buffers whose shards live on every device of a mesh, across processes: what
`GlobalReplay` (`_global_replay.py`) and `GlobalTrajectoryBuffer` (`_global_trajectories.py`)
share: how they are made, placed and given rows, and the three ways a method runs on the
shards, each written once over the families' protocol: a draw by a shard's law over the union
of every shard (`sample_union`), a write routed to the shard that owns each entry
(`routed_write`), and a question routed likewise (`routed_query`). How a function runs on the
shards is `_shard_map.py`; the laws, and what crosses devices for each, are in
`docs/multi-process.md`.
"""

import abc
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, PRNGKeyArray, PyTree

from ._checks import as_float, check_mask, check_positive_int, plural
from ._faults import check_faults, collect_faults, Fault, guarded, vetoing
from ._laws import AbstractLaw
from ._results import inherited_result, Result
from ._shard_map import (
    assemble,
    assemble_with_faults,
    Layout,
    per_shard,
    place,
    put,
    replicated_faults,
    run,
    shard_mapped,
)


_B = TypeVar("_B", bound=eqx.Module)
_G = TypeVar("_G", bound="AbstractGlobalBuffer")


def _has_shard_map() -> bool:
    return hasattr(jax, "shard_map")


class AbstractGlobalBuffer(eqx.Module, Generic[_B]):
    """One buffer spread over every device of a mesh axis, also across the processes of a
    `jax.distributed` program: one *shard* (an ordinary buffer) per device, stacked along a
    leading axis that the mesh splits. `GlobalReplay` splits a replay's items,
    `GlobalTrajectoryBuffer` a trajectory buffer's envs; this is what they share: how they
    are made, placed, restored and given rows.

    Writes run on each shard alone (no collective); draws gather a few numbers per shard and
    follow the law of the whole buffer; global names (indices, env ids) are `shard ·
    rows_per_shard + local name`. Every method works eagerly (compiled once per signature)
    and under `jax.jit`/`eqx.filter_jit` with donation. Needs JAX 0.7 or newer
    (`jax.shard_map`). See the guide, "Across processes".
    """

    shards: _B
    """The shards: one buffer per device of `axis`, every array leaf with a leading axis of
    length `num_shards`, split over the mesh."""
    mesh: Mesh = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self,
        mesh: Mesh,
        make: Callable[[], _B] | None = None,
        *,
        axis: str | None = None,
        shards: _B | None = None,
        throw: bool | None = None,
    ):
        """**Arguments:**

        - `mesh`: a `jax.sharding.Mesh`; with `jax.distributed`, one over the devices of
            every process (`jax.make_mesh` over `jax.devices()` makes one).
        - `make`: `make() -> buffer`, one shard: an empty buffer of one of the types above,
            of the size one device holds (`shard_size(mesh, N)` of a buffer of `N` items or
            envs, which refuses an `N` the shards do not divide).
            It runs once, inside `jax.jit`, so each device allocates only its own shard.
        - `axis`: the mesh axis the shards are split over (default: the mesh's only axis).
            Over the mesh's other axes, if any, every shard is replicated.
        - `shards`: instead of `make`, the shards themselves, already stacked and placed (as
            `from_process_local` and `jax.tree.map` give them).
        - `throw`: how a fault is reported (as `UniformReplay`'s `throw`), the same in every
            process; `None` (the default): as the shards report their own.

        **Raises:** `ValueError`/`TypeError` at once if the mesh has no such axis (or several
        axes and none named), if `make` gives something that is not one of the buffers
        above, or if `shards` has the wrong number of shards.
        """
        call = type(self).__name__
        if not _has_shard_map():
            raise RuntimeError(
                f"`{call}` needs JAX 0.7 or newer (`jax.shard_map`); this is JAX {jax.__version__}."
            )
        self.mesh = mesh
        self.axis = axis = _axis_of(mesh, axis, call)
        if make is not None and shards is None:
            shards = _make_shards(mesh, axis, make)
        elif make is not None or shards is None:
            raise TypeError(f"`{call}`: give exactly one of `make` and `shards`.")
        assert shards is not None
        _check_shard(shards, self._family(), call)
        leading = {x.shape[0] if len(x.shape) else None for x in _array_leaves(shards)}
        if leading != {mesh.shape[axis]}:
            raise ValueError(
                f"`{call}(shards=...)`: every array leaf needs a leading axis of "
                f"{mesh.shape[axis]} shards (the size of mesh axis {axis!r}); the leaves have "
                f"{sorted(leading, key=str)}."
            )
        self.shards = shards
        self.result = inherited_result(throw, shards, f"{call}(throw=...)")

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
        template = cls(mesh, shards=_stack_shape(mesh, axis, local_shards, cls.__name__), axis=axis)
        count = template.num_local_shards
        sharding = template.sharding
        for x in _array_leaves(local_shards):
            if x.shape[:1] != (count,):
                raise ValueError(
                    f"`{cls.__name__}.from_process_local`: process {jax.process_index()} holds "
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
    def shard_size(cls, mesh: Mesh, total: int, *, axis: str | None = None) -> int:
        """What one shard holds of `total` (items of a replay, envs of a trajectory buffer)
        on `mesh`: `total / num_shards`, for `make`.

        **Raises:** `ValueError` at once if the number of shards does not divide `total`.
        """
        call = f"{cls.__name__}.shard_size"
        total = check_positive_int(total, f"{call}(total=...)")
        axis = _axis_of(mesh, axis, call)
        shards = mesh.shape[axis]
        if total % shards:
            raise ValueError(
                f"`{call}`: the {shards} shards of mesh axis {axis!r} do not divide {total}; "
                f"take a multiple of {shards} (such as {total - total % shards or shards})."
            )
        return total // shards

    @classmethod
    def abstract(
        cls: type[_G], mesh: Mesh, make: Callable[[], _B], *, axis: str | None = None
    ) -> _G:
        """A shape-only global buffer: every array leaf a `jax.ShapeDtypeStruct` with the
        sharding it has on `mesh`. Allocates nothing; the target of an orbax restore onto
        this mesh (`checkpointer.restore(path, GlobalReplay.abstract(mesh, make))`), whatever
        the number of processes that saved it."""
        template = cls(mesh, shards=_stack_shape(mesh, axis, make, cls.__name__), axis=axis)
        sharding = template.sharding

        def spec(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return x

        return jax.tree.map(spec, template)

    # ------------------------------------------------------------------ layout

    @property
    def layout(self) -> Layout:
        """The mesh and the axis the shards are split over."""
        return Layout(self.mesh, self.axis)

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
    @abc.abstractmethod
    def rows_per_shard(self) -> int:
        """The global name of shard `k`'s first item or env is `k · rows_per_shard`: a
        replay shard's capacity, a trajectory shard's number of envs (static)."""

    @staticmethod
    @abc.abstractmethod
    def _family() -> type:
        """The family a shard belongs to (its abstract class)."""

    @property
    def template(self) -> _B:
        """One shard as shapes only: the shards without their leading axis (`jax.
        ShapeDtypeStruct` leaves). What the static parts of a shard's methods read (its
        law, its configuration)."""
        return jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
                if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray)
                else x
            ),
            self.shards,
        )

    @property
    def layered(self) -> bool:
        """A global buffer is a layer over its shards: it cannot be a shard or a cluster."""
        return True

    def place_shards(self, x: Array) -> Array:
        """`x`, one row per shard, split over the mesh as the shards are."""
        return put(x, self.sharding)

    def map_shards(self, fn: Callable[..., Any], per_shard: Any, shared: Any) -> Any:
        """`fn` on each shard, inside `shard_map` (see `AbstractReplay.map_shards`); the
        `shared` it returns is replicated."""
        return run(map_rows, self.layout, fn, per_shard, shared)

    def rows(self, local: PyTree[ArrayLike]) -> PyTree[Array]:
        """A global array of `add`/`add_batch`/`extend` arguments (items, or env ids) from
        this process's rows: the blocks of its own shards, in order. Any pytree laid out
        like the shards places so (an actor's env states, typed PRNG keys included).

        Every process calls it with its own rows (the same number of rows per shard in
        every process). For a trajectory buffer with every env (`env_ids=None`), the rows
        are this process's envs, `rows_per_shard` per local shard; with `env_ids`, any number
        per shard, each naming one of that shard's envs.

        **Raises:** `ValueError` at once if a leaf's leading axis is not a multiple of
        `num_local_shards`.
        """
        count, sharding = self.num_local_shards, self.sharding
        call = f"{type(self).__name__}.rows"

        def one(x):
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                data = one(jax.random.key_data(x))
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] % count:
                raise ValueError(
                    f"`{call}`: process {jax.process_index()} holds "
                    f"{plural(count, 'shard')}, and its rows are split into one equal block "
                    f"per shard; a leaf of shape {x.shape} has a leading axis that "
                    f"{count} does not divide."
                )
            narrowed = jax.dtypes.canonicalize_dtype(x.dtype)
            if narrowed != x.dtype:
                raise TypeError(
                    f"`{call}`: a leaf has dtype {x.dtype}, which JAX holds as {narrowed} "
                    "(64-bit mode is off): its values would be cast on the way, unseen. Give "
                    f"it as {narrowed} (or enable `jax_enable_x64`)."
                )
            if sharding.is_fully_addressable:  # one process: a plain (faster) placement
                return jax.device_put(x, sharding)
            return jax.make_array_from_process_local_data(sharding, x)

        return jax.tree.map(one, local)

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

    # ------------------------------------------------------------------ machinery

    def _split(self, tree: PyTree[Array], call: str) -> None:
        check_blocks(tree, self.num_shards, call)

    def _run(self: _G, fn: Callable[..., Any], *args: Any) -> _G:
        """The buffer whose shards are `fn(layout, shards, *args)`'s (`run`: `add_blocks` or
        `routed_write`)."""
        return eqx.tree_at(lambda g: g.shards, self, run(fn, self.layout, self.shards, *args))

    def _sample_union(
        self, law: AbstractLaw, faults: list[Fault], key: PRNGKeyArray, batch_size: int, call: str
    ) -> Any:
        """`sample_union` by a shard's `law`, with the `faults` of its arguments (both what the
        template's `law` gives)."""
        door = Door.of(faults)
        args = (law, door.preds, door.messages, key, batch_size, call)
        return run(sample_union, self.layout, self.shards, *args)


# ---------------------------------------------------------------------- construction helpers


def _array_leaves(tree: Any) -> list[Any]:
    arrays = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)
    return [x for x in jax.tree.leaves(tree) if isinstance(x, arrays)]


def _check_shard(shard: Any, family: type, call: str) -> None:
    """A shard is a buffer of the family, and no layer over other buffers."""
    if not isinstance(shard, family):
        raise TypeError(
            f"`{call}`: a shard must be a {family.__name__.removeprefix('Abstract')} (a "
            f"`dx.{family.__name__}`), got a {type(shard).__name__}."
        )
    if shard.layered:
        raise TypeError(
            f"`{call}`: a shard must be a buffer, not a layer over buffers (a "
            f"{type(shard).__name__}): its own state would be kept once per shard. Wrap the "
            "global buffer instead."
        )


def _vmap_make(make: Callable[[], Any], n: int) -> Any:
    return eqx.filter_vmap(make, axis_size=n)()


def _make_shards(mesh: Mesh, axis: str, make: Callable[[], Any]) -> Any:
    n = mesh.shape[axis]
    shape = eqx.filter_eval_shape(_vmap_make, make, n)
    static = eqx.filter(shape, lambda x: not isinstance(x, jax.ShapeDtypeStruct))
    sharding = NamedSharding(mesh, P(axis))
    dynamic = jax.jit(
        lambda: eqx.filter(_vmap_make(make, n), eqx.is_array), out_shardings=sharding
    )()
    return eqx.combine(dynamic, static)


def _axis_of(mesh: Mesh, axis: str | None, call: str) -> str:
    """The mesh axis the shards are split over: `axis`, or the mesh's only one."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"`{call}(mesh=...)` must be a `jax.sharding.Mesh`, got {mesh!r}.")
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"`{call}`: the mesh has axes {mesh.axis_names}; name the one the shards are "
                "split over with `axis=`."
            )
        axis = mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"`{call}(axis={axis!r})`: the mesh has axes {mesh.axis_names}.")
    return str(axis)


def _stack_shape(mesh: Mesh, axis: str | None, make_or_local: Any, name: str) -> Any:
    """A shape-only stack of `mesh.shape[axis]` shards: from `make`, or from one process's
    stacked shards (whose first shard is the template)."""
    n = mesh.shape[_axis_of(mesh, axis, name)]
    if callable(make_or_local) and not isinstance(make_or_local, eqx.Module):
        return eqx.filter_eval_shape(_vmap_make, make_or_local, n)

    def widen(x):
        if eqx.is_array(x) or isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct((n, *np.shape(x)[1:]), x.dtype)
        return x

    return jax.tree.map(widen, make_or_local)


# ---------------------------------------------------------------------- running on the shards
#
# Each function below runs one method on the shards (through `run`: module level, so that an
# eager call compiles once). Its faults are checked on every device with the same verdict
# (from numbers every device holds, or gathered), so that a fault raises in every process and
# none waits in a collective for a process that raised; the only exception is an add, whose
# rows are each shard's own and which has no collective (see `add_blocks`).


def sample_union(
    layout: Layout,
    shards: Any,
    law: AbstractLaw,
    preds: list[Array],
    messages: tuple[str, ...],
    key: PRNGKeyArray,
    batch_size: int,
    call: str,
) -> Any:
    """A draw by `law` (a shard's) over the union of every shard: each shard's summary is
    gathered (one all-reduce), every device draws the same rows from the key, each reads the
    rows its shard owns, and the batch is assembled (a second all-reduce). `preds` are the
    faults of the call's arguments (with their `messages`), checked with the draw's."""
    axis, n = layout.axis, layout.num_shards
    arrays, static = eqx.partition(law, eqx.is_array)

    def local(shard: Any, key: PRNGKeyArray, arrays: Any, preds: list[Array]) -> Any:
        law = eqx.combine(arrays, static)
        me = jax.lax.axis_index(axis)
        summaries = per_shard(law.summary(shard), axis, n)
        drawn = law.draw(key, batch_size, summaries)
        rows = assemble(law.read(shard, drawn.at), drawn.owner == me, axis)
        out = law.finish(rows, drawn, summaries)
        faults = [*zip(preds, messages), *law.faults(summaries, call)]
        return check_faults(out, faults, order_reads=False)

    return layout.map(shards, local, (key, arrays, preds), P())


def add_blocks(
    layout: Layout,
    shards: Any,
    add: Callable[..., Any],
    blocks: Any,
    preds: list[Array],
    messages: tuple[str, ...],
    shard_call: str,
    call: str,
) -> Any:
    """`add(shard, *block)` on every shard, block `k` of `blocks` (split over the shards in
    equal blocks, as `rows` makes them) to shard `k`: no collective. Its faults (an env id of
    another shard, a repeated one, a full queue, a bad priority), and those of the door
    (`preds`, one flag per row, split likewise), are each shard's own and raise in the process
    that holds it, which made those rows."""

    def local(shard: Any, blocks: Any, preds: list[Array]) -> Any:
        with vetoing(list(zip(preds, messages))):  # recording: a faulty block adds nothing
            new, found = collect_faults(lambda: add(shard, *blocks))
        return guarded(new, [*zip(preds, messages), *renamed(found, shard_call, call)])

    return layout.update(shards, local, blocks, preds, sharded=True)


def routed_write(
    layout: Layout,
    shards: Any,
    write: Callable[..., Any],
    note: Callable[..., Any],
    split: Callable[[Any, Any], tuple[Array, Any]],
    names: Any,
    args: Any,
    mask: Bool[Array, " n"],
    preds: list[Array],
    messages: tuple[str, ...],
    shard_call: str,
    call: str,
) -> Any:
    """`write(shard, local_names, *args, mask=...)` on every shard for the entries it owns
    (`split(shard, names)`: each entry's shard, and its name there), and `note(...)` of the
    others (so that every shard's largest priority rises with every entry). The arguments are
    replicated; each entry is checked by its owner and the verdicts gathered (one all-reduce
    of a word per fault), so a bad entry raises in every process."""
    axis = layout.axis

    def local(shard: Any, names: Any, args: Any, mask: Array, preds: list[Array]) -> Any:
        owner, local_names = split(shard, names)
        owned = mask & (owner == jax.lax.axis_index(axis))
        with vetoing(list(zip(preds, messages))):  # recording: a faulty call writes nothing
            new, found = collect_faults(lambda: write(shard, local_names, *args, mask=owned))
            new = note(new, local_names, *args, mask=mask & ~owned)
        faults = replicated_faults(renamed(found, shard_call, call), axis)
        return guarded(new, [*zip(preds, messages), *faults])

    return layout.update(shards, local, names, args, mask, preds, sharded=False)


def routed_query(
    layout: Layout,
    shards: Any,
    ask: Callable[..., Any],
    split: Callable[[Any, Any], tuple[Array, Any]],
    names: Any,
    args: Any,
    mask: Bool[Array, " n"],
    preds: list[Array],
    messages: tuple[str, ...],
    shard_call: str,
    call: str,
) -> Any:
    """`ask(shard, local_names, *args, mask=...)` on every shard for the entries it owns, the
    answers put together in every device, with the faults each owner found (one all-reduce
    for both)."""
    axis = layout.axis

    def local(shard: Any, names: Any, args: Any, mask: Array, preds: list[Array]) -> Any:
        owner, local_names = split(shard, names)
        owned = mask & (owner == jax.lax.axis_index(axis))
        out, found = collect_faults(lambda: ask(shard, local_names, *args, mask=owned))
        out, faults = assemble_with_faults(out, owned, renamed(found, shard_call, call), axis)
        return check_faults(out, [*zip(preds, messages), *faults], order_reads=False)

    return layout.map(shards, local, (names, args, mask, preds), P())


def shard_call_of(buffer: AbstractGlobalBuffer, method: str) -> str:
    """The call a shard's `method` names in its messages, which `renamed` gives the global
    call's name."""
    return f"{type(buffer.template).__name__}.{method}"


def renamed(faults: list[tuple[Array, str]], shard_call: str, call: str) -> list[Fault]:
    """A shard's faults under the name of the global call that made them: a message that
    begins with the shard's call quotes the global one instead."""
    old = f"`{shard_call}`"
    return [
        (pred, f"`{call}`{message[len(old) :]}" if message.startswith(old) else message)
        for pred, message in faults
    ]


class Door(NamedTuple):
    """What a global method's door found in its arguments: the faults of their values, each
    a boolean array and its message, to be checked on every device with the method's own."""

    preds: list[Array]
    messages: tuple[str, ...]

    @staticmethod
    def of(faults: list[Fault]) -> "Door":
        preds = [jnp.asarray(pred) for pred, _ in faults]
        return Door(preds, tuple(message for _, message in faults))


def door_floats(
    values: ArrayLike, call: str, name: str, mask: ArrayLike | None
) -> tuple[Array, list[Fault]]:
    """Real `values` (checked in shape by the caller) in the float dtype JAX holds them in
    (float32 without 64-bit mode), converted from their own dtype at the door of a global
    call: what a compiled call would otherwise cast on the way in, unseen (an int64 `2**32`
    wrapped to 0, a float64 past the float32 range made inf). The shards convert them on to
    their own dtype, with their own checks. The faults are those of a value too large."""
    dtype = jax.dtypes.canonicalize_dtype(np.float64)
    return as_float(values, dtype, call, name, mask=mask)


def door_mask(mask: ArrayLike | None, n: int, call: str) -> Bool[Array, " n"]:
    """The `mask` of `n` replicated entries, checked at the door (`None`: every entry)."""
    return jnp.ones(n, jnp.bool_) if mask is None else check_mask(mask, n, call)


def check_blocks(tree: PyTree[Array], num_shards: int, call: str) -> None:
    """Refuse rows that do not split into `num_shards` equal blocks, one per shard."""
    for x in jax.tree.leaves(tree):
        if x.ndim == 0 or x.shape[0] % num_shards:
            raise ValueError(
                f"`{call}`: the rows are split into {num_shards} equal blocks, one per "
                f"shard; an argument of shape {x.shape} has a leading axis that "
                f"{num_shards} does not divide."
            )


def map_rows(layout: Layout, fn: Callable[..., Any], per_shard: Any, shared: Any) -> Any:
    """`fn(rows, shared, axis, num_shards)` on each device's row of `per_shard`, inside
    `shard_map`: rows in and out split over the axis, `shared` replicated."""
    axis, n = layout.axis, layout.num_shards
    arrays, static = eqx.partition(shared, eqx.is_array)

    def body(per_shard: Any, arrays: Any) -> Any:
        rows = jax.tree.map(lambda x: x[0], per_shard)
        return fn(rows, eqx.combine(arrays, static), axis, n)

    mapped = shard_mapped(body, layout.mesh, axis, (P(axis), P()), (P(axis), P()))
    placed = (
        jax.tree.map(lambda x: place(x, layout.sharding), per_shard),
        jax.tree.map(lambda x: place(x, NamedSharding(layout.mesh, P())), arrays),
    )
    return mapped(*placed)
