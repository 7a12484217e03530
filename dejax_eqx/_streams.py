"""Per-env streams of steps: the storage under every trajectory buffer, as `CircularBuffer` is
under every replay. The only code that knows where a step of a stream sits."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, PyTree, Shaped

from ._checks import (
    as_prototype,
    check_index,
    check_items,
    check_mask_like,
    check_positive_int,
    check_sequences,
    count_ids,
    INT32_MAX,
    Prototype,
    spec_of,
)
from ._episodes import checked_episodes, EpisodeBook, EpisodeInfo, Episodes
from ._faults import check_faults, Fault, veto, vetoing
from ._storage import ring_add, ring_sub
from ._writes import scatter_at, scatter_rows


_S = TypeVar("_S", bound="Streams")


def out_of_range(num_envs: int) -> str:
    """The message of an env id out of range (without the call)."""
    return f"an env id is out of range; env ids must satisfy 0 <= env_id < num_envs = {num_envs}"


class Streams(eqx.Module):
    """Per-env rings of steps: each of `num_envs` envs keeps its last `max_length` steps, and
    counts every step it has taken.

    Step `s` of env `e` (its `s`-th step, from 0) sits in slot `s mod max_length` of row `e`,
    so the write cursor of an env is `step_count mod max_length` (`head`). Envs advance
    independently: an append writes the listed envs at their own cursors, in one scatter.
    Absolute step numbers never repeat, which is what lets a window be named by `(env,
    start)` long after it was sampled (`stale`).

    The trajectory buffers (`TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`,
    `TrajectoryQueue`) hold a `Streams` as `streams` and add their own state: an online
    window, priorities, an unread count. On its own it is a checked store of per-env steps.

    `Streams` is final: it is not meant to be subclassed.
    """

    data: PyTree[Shaped[Array, "num_envs max_length ..."]]
    """The slots: each leaf of the prototype with two leading axes `(num_envs, max_length)`,
    each row in ring order."""
    step_count: Int[Array, " num_envs"]
    """Per env, the number of steps ever appended, in `[0, 2**31 - 1]` (int32)."""
    lengths: Int[Array, " num_envs"]
    """Per env, the number of stored steps, `min(step_count, max_length)` unless restored
    otherwise (int32)."""
    book: EpisodeBook | None
    """The episode bookkeeping (`_episodes.py`), if made with `episodes`; else `None`."""
    num_envs: int = eqx.field(static=True)
    max_length: int = eqx.field(static=True)
    written_back: tuple[str, ...] = eqx.field(static=True)
    """The keys of the step that adds may leave out (see `written_back` below)."""

    def __init__(
        self,
        prototype: Prototype,
        num_envs: int,
        max_length: int,
        *,
        episodes: Episodes | None = None,
        written_back: Sequence[str] = (),
    ):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars). Only its
            structure, shapes and dtypes are used; stored steps must match them exactly.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the number of steps each env keeps, a positive Python int below
            `2**31`.
        - `episodes`: an `Episodes`, to keep where each stored step's episode began and
            ended (`episodes_of`); `None` (the default) keeps nothing.
        - `written_back`: keys of a dict step whose values adds may leave out, for what a
            learner writes back into stored steps (`write_back`): a recurrent state, a
            latent. A step added without them stores zeros there (`False` for booleans);
            one added with them stores what it is given. Default `()`.
        """
        call = "Streams"
        self.num_envs = check_positive_int(num_envs, f"{call}(num_envs=...)")
        self.max_length = check_positive_int(max_length, f"{call}(max_length=...)")
        spec = as_prototype(prototype, f"{call}(prototype=...)")
        self.written_back = check_written_back(spec, written_back, call)
        shape = (self.num_envs, self.max_length)
        self.data = jax.tree.map(lambda s: jnp.zeros((*shape, *s.shape), s.dtype), spec)
        self.step_count = jnp.zeros(self.num_envs, jnp.int32)
        self.lengths = jnp.zeros(self.num_envs, jnp.int32)
        self.book = _book(episodes, spec, self.num_envs, self.max_length, call)

    @property
    def episodes(self) -> Episodes | None:
        """How the streams tell episodes apart (`Episodes`), or `None`."""
        return None if self.book is None else self.book.episodes

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return spec_of(self.data, axes=2)

    @property
    def head(self) -> Int[Array, "*batch num_envs"]:
        """Each env's write cursor: the slot its next step goes to, `step_count mod
        max_length`."""
        return self.step_count % self.max_length

    def append(
        self: _S, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _S:
        """Append one step to each listed env (leaves `[n, ...]`; `env_ids` distinct ids in
        `[0, num_envs)`, `None` for every env in order), as `AbstractTrajectoryBuffer.add`."""
        done = check_append(self, items, env_ids, "Streams.append", sequences=False)
        return cast(_S, done.guarded(check_faults(done.counters(), done.faults)))

    def extend(
        self: _S, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _S:
        """Append `T` steps to each listed env (leaves `[n, T, ...]`, oldest first), as
        `AbstractTrajectoryBuffer.extend`."""
        done = check_append(self, items, env_ids, "Streams.extend", sequences=True)
        return cast(_S, done.guarded(check_faults(done.counters(), done.faults)))

    def newest(self, env_ids: Integer[ArrayLike, "*n"] | None = None) -> PyTree[Array]:
        """The newest step of each listed env, as `AbstractTrajectoryBuffer.peek`."""
        return check_faults(*check_newest(self, env_ids, "Streams.newest"))

    def stale(
        self, env_ids: Integer[ArrayLike, "*n"], starts: Integer[ArrayLike, "*n"]
    ) -> Bool[Array, "*n"]:
        """Whether each step `(env, start)` has been overwritten, as
        `AbstractTrajectoryBuffer.stale`."""
        return check_faults(*check_stale(self, env_ids, starts, "Streams.stale"))

    def restore(
        self: _S,
        steps: PyTree[ArrayLike],
        ends: Integer[ArrayLike, " num_envs"],
        lengths: Integer[ArrayLike, " num_envs"],
    ) -> _S:
        """Streams of this configuration holding given steps: env `e` has taken `ends[e]`
        steps and holds the last `lengths[e]` of them, given oldest first.

        For steps kept elsewhere (a `Dataset`, another buffer's history). Only the static
        configuration of `self` is used, so it may come from `eqx.filter_eval_shape`.

        **Arguments:**

        - `steps`: leaves `[num_envs, max_length, ...]`: row `e` holds env `e`'s stored steps,
            oldest first, in its first `lengths[e]` positions; the rest is ignored (stored as
            zeros).
        - `ends`, `lengths`: integer arrays of shape `(num_envs,)`, with `0 <= lengths[e] <=
            min(ends[e], max_length)` and `ends[e] <= 2**31 - 1`.

        **Returns:** the new streams.

        **Raises:** `ValueError`/`TypeError` at once if `steps` does not match; an
        `eqx.error_if` error for counts out of range.
        """
        call = "Streams.restore"
        items, n, length = check_sequences(self.item_spec, steps, call)
        if (n, length) != (self.num_envs, self.max_length):
            raise ValueError(
                f"`{call}`: the steps have leading axes ({n}, {length}), expected "
                f"(num_envs, max_length) = ({self.num_envs}, {self.max_length})."
            )
        m, shape = self.max_length, (self.num_envs,)
        count, bad_count = check_index(ends, INT32_MAX + 1, f"{call}(ends=...)", ndim=1)
        kept, bad_kept = check_index(lengths, m + 1, f"{call}(lengths=...)", ndim=1)
        if count.shape != shape or kept.shape != shape:
            raise ValueError(
                f"`{call}`: `ends` and `lengths` have shapes {count.shape} and {kept.shape}, "
                f"expected ({self.num_envs},): one per env."
            )
        # Position i of row e is step ends - lengths + i: every row is a rotation of its slots.
        first = jnp.where(bad_count | bad_kept, 0, count - kept) % m
        slots = ring_add(first[:, None], jnp.arange(m, dtype=jnp.int32)[None, :], m)
        rows = jnp.arange(self.num_envs, dtype=jnp.int32)[:, None]
        position = jnp.arange(m)[None, :] < kept[:, None]

        def place(x):
            real = position.reshape(position.shape + (1,) * (x.ndim - 2))
            y = jnp.where(real, x, jnp.zeros_like(x))
            return jnp.zeros_like(y).at[rows, slots].set(y, unique_indices=True)

        count, kept = check_faults(
            (count, kept),
            [
                (bad_count, f"`{call}`: `ends` must be in [0, 2**31 - 1]"),
                (bad_kept, f"`{call}`: `lengths` must be in [0, max_length = {m}]"),
                (~bad_count & ~bad_kept & (kept > count), f"`{call}`: `lengths` exceed `ends`"),
            ],
        )
        data = jax.tree.map(place, items)
        if self.book is None:
            return eqx.tree_at(
                lambda s: (s.data, s.step_count, s.lengths), self, (data, count, kept)
            )
        book, ids = self.book.restored(items, count, kept)
        book = eqx.tree_at(lambda b: b.ids, book, place(ids))
        return eqx.tree_at(
            lambda s: (s.data, s.step_count, s.lengths, s.book), self, (data, count, kept, book)
        )


def _book(
    episodes: Episodes | None, spec: PyTree, num_envs: int, max_length: int, call: str
) -> EpisodeBook | None:
    if episodes is None:
        return None
    episodes = checked_episodes(episodes, call)
    episodes.check(spec, call)
    return EpisodeBook(episodes, num_envs, max_length)


def make_streams(
    prototype: Prototype,
    num_envs: int,
    max_length: int,
    owner: str,
    episodes: Episodes | None = None,
    written_back: Sequence[str] = (),
) -> Streams:
    """`Streams(prototype, num_envs, max_length, episodes=episodes, written_back=...)` with
    the arguments checked under the name of the buffer that owns them (`owner`), so that a
    bad one is reported as that buffer's."""
    num_envs = check_positive_int(num_envs, f"{owner}(num_envs=...)")
    max_length = check_positive_int(max_length, f"{owner}(max_length=...)")
    spec = as_prototype(prototype, f"{owner}(prototype=...)")
    _book(episodes, spec, num_envs, max_length, owner)  # a bad one is the owner's
    written_back = check_written_back(spec, written_back, owner)
    return Streams(spec, num_envs, max_length, episodes=episodes, written_back=written_back)


def check_written_back(
    spec: PyTree[jax.ShapeDtypeStruct], written_back: Any, call: str
) -> tuple[str, ...]:
    """`written_back` as a tuple of distinct keys of the dict step `spec`, else an error
    quoting `call`."""
    if isinstance(written_back, str) or not isinstance(written_back, Sequence):
        raise TypeError(
            f"`{call}(written_back=...)` must be a tuple of keys of the step, got {written_back!r}."
        )
    keys = tuple(written_back)
    if not keys:
        return keys
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"`{call}(written_back=...)` names keys of a dict step, but the step is a "
            f"{type(spec).__name__}; make the step a dict to leave leaves out of adds."
        )
    for key in keys:
        if not isinstance(key, str) or key not in spec:
            raise ValueError(
                f"`{call}(written_back=...)`: {key!r} is not a key of the step; its keys are "
                f"{sorted(map(str, spec))}."
            )
    if len(set(keys)) != len(keys) or len(keys) == len(spec):
        raise ValueError(
            f"`{call}(written_back=...)` = {keys!r}: the keys must be distinct, and at least "
            "one key of the step must be left for adds to give."
        )
    return keys


def filled(streams: Streams, items: PyTree[ArrayLike], axes: int) -> PyTree[ArrayLike]:
    """`items` (leaves with `axes` leading axes) with the written-back keys it leaves out
    filled with zeros (`False`), as `Streams(written_back=...)` states."""
    if not streams.written_back or not isinstance(items, Mapping):
        return items
    missing = [k for k in streams.written_back if k not in items]
    given = jax.tree.leaves({k: v for k, v in items.items() if k not in streams.written_back})
    if not missing or not given:
        return items  # the structure check reports what is wrong
    lead = tuple(np.shape(given[0])[:axes])
    spec = cast(Mapping[str, Any], streams.item_spec)
    zeros = {
        k: jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), s.dtype), spec[k]) for k in missing
    }
    return {**items, **zeros}


def episodes_of(streams: Streams, env: Int[Array, "*n"], step: Int[Array, "*n"]) -> EpisodeInfo:
    """The episodes of stored steps `step` of envs `env` (in range; unchecked)."""
    assert streams.book is not None, "the caller checks that the streams keep episodes"
    return streams.book.info(env, step, streams.step_count)


def slot_episodes(streams: Streams) -> tuple[EpisodeInfo, Int[Array, "num_envs max_length"]]:
    """The episode of the step in every slot (`EpisodeInfo` of shape `(num_envs,
    max_length)`) and that step's absolute number; meaningless where the slot holds no
    stored step (`step_backs` says which do)."""
    assert streams.book is not None, "the caller checks that the streams keep episodes"
    env = jnp.arange(streams.num_envs, dtype=jnp.int32)[:, None]
    step = streams.step_count[:, None] - step_backs(streams)
    safe = jnp.maximum(step, 0)
    return streams.book.info(jnp.broadcast_to(env, safe.shape), safe, streams.step_count), step


def episode_starts(streams: Streams) -> Bool[Array, "num_envs max_length"]:
    """Whether each slot holds a stored step that is the first step of its episode (an
    auto-reset step begins none; a step whose episode's first step is not known, after a
    restore, is not one)."""
    info, step = slot_episodes(streams)
    stored = step_backs(streams) <= streams.lengths[:, None]
    return stored & ~info.reset & (info.first == step)


# ---------------------------------------------------------------------------------------------
# The doors of the operations above, for buffers that add their own checks: each checks its
# arguments at trace time and returns its result with the faults the caller passes, together
# with its own, to one `check_faults`. Then the unchecked operations.


class Appended(NamedTuple):
    """A checked append: the new streams, and for the caller's own bookkeeping the rows the
    entries went to (`num_envs` for a bad id), which entries are valid, which envs took steps
    (`added`), how many (`length`), and the faults to report."""

    streams: Streams
    rows: Int[Array, " n"]
    valid: Bool[Array, " n"]
    added: Bool[Array, " num_envs"]
    length: int
    faults: list[Fault]

    def counters(self) -> tuple[Int[Array, " num_envs"], Int[Array, " num_envs"]]:
        """What a check guards: the new counters, which every later use depends on (never the
        storage, which a guard could copy)."""
        return self.streams.step_count, self.streams.lengths

    def guarded(self, counters: tuple[Array, Array]) -> Streams:
        """The new streams with `counters` as returned by `check_faults`."""
        return eqx.tree_at(lambda s: (s.step_count, s.lengths), self.streams, counters)


def check_append(
    streams: Streams,
    items: PyTree[ArrayLike],
    env_ids: Integer[ArrayLike, " n"] | None,
    call: str,
    *,
    sequences: bool,
    more: Callable[[Bool[Array, " num_envs"], int], list[Fault]] | None = None,
) -> Appended:
    """The door of an append: `items` (leaves `[n, ...]`, or `[n, T, ...]` with `sequences`)
    and `env_ids` checked, the steps written, and the faults: an env id out of range or
    repeated, an env that would pass `2**31 - 1` steps, and the caller's `more(added,
    length)` (which envs take steps, and how many each). A bad id writes nothing (its row is
    `num_envs`, which the scatter drops), whatever `EQX_ON_ERROR` says. Every fault is known
    before the write: in a recording call (`throw=False`) a faulty append writes nothing."""
    items = filled(streams, items, 2 if sequences else 1)
    if sequences:
        items, n, length = check_sequences(streams.item_spec, items, call)
    else:
        items, n = check_items(streams.item_spec, items, call, batched=True, what="batch of steps")
        assert n is not None
        items, length = jax.tree.map(lambda x: x[:, None], items), 1
    faults: list[Fault] = []
    if env_ids is None:
        if n != streams.num_envs:
            raise ValueError(
                f"`{call}`: without `env_ids` there must be steps for every env, but the "
                f"batch has {n} entries and num_envs is {streams.num_envs}. Pass "
                "`env_ids` to add steps for some envs only."
            )
        rows = jnp.arange(n, dtype=jnp.int32)
        valid = jnp.ones(n, jnp.bool_)
    else:
        rows, bad = check_index(
            env_ids, streams.num_envs, f"{call}(env_ids=...)", ndim=1, length=(n, "step")
        )
        valid = ~bad
        counts = count_ids(rows, streams.num_envs)
        faults += [
            (bad, f"`{call}`: {out_of_range(streams.num_envs)}"),
            (
                jnp.any(counts > 1),
                f"`{call}`: an env id occurs more than once; each call adds to each env at "
                "most once",
            ),
        ]
    if length == 0 or n == 0:  # nothing is added, so nothing can be wrong: the caller returns
        return Appended(streams, rows, valid, jnp.zeros(streams.num_envs, jnp.bool_), 0, [])
    if env_ids is None:
        taking = jnp.ones(streams.num_envs, jnp.bool_)
    else:
        taking = count_ids(rows, streams.num_envs) > 0
    faults.append(
        (
            jnp.any(taking & (streams.step_count > INT32_MAX - length)),
            f"`{call}`: an env would pass 2**31 - 1 steps, the most its int32 step count "
            "holds; the step numbers that align periods and stamp samples would wrap",
        )
    )
    if more is not None:
        faults += more(taking, length)
    with vetoing(faults):
        new, added = append_steps(streams, items, None if env_ids is None else rows, length)
    return Appended(new, rows, valid, added, length, faults)


def check_newest(
    streams: Streams,
    env_ids: Integer[ArrayLike, "*n"] | None,
    call: str,
    *,
    mask: Bool[ArrayLike, "*n"] | None = None,
) -> tuple[PyTree[Array], list[Fault]]:
    """The door of `newest`: the newest step of each listed env, and the faults (an id out of
    range, an env without steps), of the entries where `mask` holds."""
    if env_ids is None:
        rows = jnp.arange(streams.num_envs, dtype=jnp.int32)
        bad = jnp.zeros(streams.num_envs, jnp.bool_)
    else:
        rows, bad = check_index(env_ids, streams.num_envs, f"{call}(env_ids=...)")
    valid = jnp.ones(rows.shape, jnp.bool_) if mask is None else check_mask_like(mask, rows, call)
    rows = jnp.where(bad, 0, rows)  # any row: the result is not used when one is bad
    flat = rows.reshape(-1)
    steps = jax.tree.map(
        lambda x: x.reshape(rows.shape + x.shape[2:]),
        gather_steps(streams, flat, jnp.ones_like(flat), 1),
    )
    return steps, [
        (bad & valid, f"`{call}`: {out_of_range(streams.num_envs)}"),
        (
            valid & ~bad & (streams.lengths[rows] == 0),
            f"`{call}`: an env has no stored step yet; there is nothing to peek at",
        ),
    ]


class Stamps(NamedTuple):
    """Checked stamps `(env, start)`: in-range rows and starts (0 where bad), the env's step
    count and stored length, and the faults of ids out of range and of starts that are not
    steps of their env."""

    env: Int[Array, "*n"]
    start: Int[Array, "*n"]
    taken: Int[Array, "*n"]
    length: Int[Array, "*n"]
    bad: Bool[Array, "*n"]
    faults: list[Fault]

    @property
    def stale(self) -> Bool[Array, "*n"]:
        """Whether each stamp's first step has been overwritten."""
        return self.start < self.taken - self.length


def check_stamps(
    streams: Streams,
    env_ids: Integer[ArrayLike, "*n"],
    starts: Integer[ArrayLike, "*n"],
    call: str,
    *,
    ndim: int | None = None,
) -> Stamps:
    """The door of every call that takes stamps back: `env_ids` and `starts` checked (same
    shape; `ndim` axes where given), and the faults of an id out of range and a start that is
    not a step its env has taken (negative, or at least its `step_count`)."""
    rows, bad_env = check_index(env_ids, streams.num_envs, f"{call}(env_ids=...)", ndim=ndim)
    steps, bad_step = check_index(starts, INT32_MAX, f"{call}(starts=...)", ndim=ndim)
    if rows.shape != steps.shape:
        raise ValueError(
            f"`{call}`: `env_ids` has shape {rows.shape} and `starts` {steps.shape}; they must "
            "match, one start per env id."
        )
    rows, steps = jnp.where(bad_env, 0, rows), jnp.where(bad_step, 0, steps)
    count, length = streams.step_count[rows], streams.lengths[rows]
    bad = bad_env | bad_step | (steps >= count)
    return Stamps(
        rows,
        steps,
        count,
        length,
        bad,
        [
            (bad_env, f"`{call}`: {out_of_range(streams.num_envs)}"),
            (
                ~bad_env & (bad_step | (steps >= count)),
                f"`{call}`: a start is not a step of its env (negative, or not yet taken); "
                "stamps must come from this buffer",
            ),
        ],
    )


def check_stale(
    streams: Streams,
    env_ids: Integer[ArrayLike, "*n"],
    starts: Integer[ArrayLike, "*n"],
    call: str,
    *,
    mask: Bool[ArrayLike, "*n"] | None = None,
) -> tuple[Bool[Array, "*n"], list[Fault]]:
    """The door of `stale`: whether each stamp's first step has been overwritten (`False`
    where `mask` does not hold, and no fault there)."""
    stamps = check_stamps(streams, env_ids, starts, call)
    if mask is None:
        return stamps.stale, stamps.faults
    valid = check_mask_like(mask, stamps.env, call)
    faults: list[Fault] = [(jnp.asarray(pred) & valid, msg) for pred, msg in stamps.faults]
    return stamps.stale & valid, faults


class WrittenBack(NamedTuple):
    """What `write_back` did with each of its entries (row `i`, step `t`: the step `starts[i]
    + t` of env `env_ids[i]`).

    **Fields:**

    - `written`: boolean `(n, T)`, `True` where the entry's value is now stored.
    - `dropped`: boolean `(n, T)`, `True` where the entry was to be written (its `mask`
        holds) but its step is no longer stored (a newer step took its slot) or was never
        taken (past the env's newest step): nothing was written there.

    An entry that is neither was masked out, or its step was written by a later row of the
    same call (later rows win).
    """

    written: Bool[Array, "n T"]
    dropped: Bool[Array, "n T"]

    @property
    def num_dropped(self) -> Int[Array, ""]:
        """How many entries were dropped, an int32 scalar."""
        return jnp.sum(self.dropped, dtype=jnp.int32)


def check_write_back(
    streams: Streams,
    env_ids: Integer[ArrayLike, " n"],
    starts: Integer[ArrayLike, " n"],
    values: Mapping[str, PyTree[ArrayLike]],
    mask: Bool[ArrayLike, "n T"] | None,
    call: str,
) -> tuple[Streams, WrittenBack, list[Fault]]:
    """The door of `write_back`: the arguments checked, the streams with every entry written
    whose step is still stored (the last row wins where rows share a step), what was done
    with each entry, and the faults (bad stamps). Nothing is written where a fault holds in a
    recording call."""
    items, n, length = _check_values(streams, values, call)
    stamps = check_stamps(streams, env_ids, starts, call, ndim=1)
    if stamps.env.shape[0] != n:
        raise ValueError(
            f"`{call}`: `values` hold {n} rows, but there are {stamps.env.shape[0]} stamps; "
            "one row of values per stamp."
        )
    if length > streams.max_length:
        raise ValueError(
            f"`{call}`: `values` hold {length} steps per row, more than max_length = "
            f"{streams.max_length} steps that a stream stores."
        )
    wanted = jnp.ones((n, length), jnp.bool_)
    faults: list[Fault] = stamps.faults
    if mask is not None:  # a row of no entry to write is not checked (as `read`'s mask)
        wanted = check_mask_like(mask, wanted, call)
        used = jnp.any(wanted, axis=1)
        faults = [(jnp.asarray(pred) & used, msg) for pred, msg in stamps.faults]
    wanted = wanted & ~stamps.bad[:, None]
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    # Step `start + t` is taken and still stored; written as differences, nothing overflows.
    ahead = (stamps.taken - stamps.start)[:, None]
    oldest = (stamps.taken - stamps.length - stamps.start)[:, None]
    stored = (t < ahead) & (t >= oldest)
    live = wanted & stored
    m = streams.max_length
    slots = ring_add((stamps.start % m)[:, None], t, m)
    written = _last_wins(live, stamps.env, slots, streams.num_envs, m)
    with vetoing(faults):
        vetoed = veto()
        if vetoed is not None:
            written = written & ~vetoed
        rows = jnp.where(written, stamps.env[:, None], streams.num_envs)
        data = dict(cast(Mapping[str, Any], streams.data))
        for key_, value in items.items():
            data[key_] = jax.tree.map(lambda x, y: scatter_at(x, rows, slots, y), data[key_], value)
    new = eqx.tree_at(lambda s: s.data, streams, type(streams.data)(data))
    return new, WrittenBack(written, wanted & ~stored), faults


# Below this many storage cells per written entry, `_last_wins` marks the winners in a table of
# the cells; above it, it sorts the entries (the table would be mostly cleared for nothing).
_CELLS_PER_ENTRY = 32


def _last_wins(
    live: Bool[Array, "n T"],
    env: Int[Array, " n"],
    slots: Int[Array, "n T"],
    num_envs: int,
    m: int,
) -> Bool[Array, "n T"]:
    """Which `live` entries (row `i` to slot `slots[i, t]` of env `env[i]`) are written when
    later rows win: the last entry of each slot in row order. No two entries of one row share
    a slot (`T <= max_length`), so row order is the entries' flat order.

    For storage of at most `_CELLS_PER_ENTRY` cells per entry, a scatter-max of each entry's
    flat number into a table of the cells, then a gather (O(cells + entries)); else a stable
    sort of the entries by cell (O(entries log entries)). Measured at 64 envs x 1,000 steps and
    64 x 80 entries (`benchmarks/write_back.py`), the sort cost 1.9-2.2 ms a call on 2 CPU
    cores, the table a tenth of that."""
    n, length = slots.shape
    order = jnp.arange(n * length, dtype=jnp.int32).reshape(n, length)
    rows = jnp.where(live, env[:, None], num_envs)
    if num_envs * m <= _CELLS_PER_ENTRY * n * length:
        table = jnp.full((num_envs, m), -1, jnp.int32)
        table = table.at[rows, slots].max(order, mode="drop")
        return live & (table.at[rows, slots].get(mode="fill", fill_value=-1) == order)
    cells = num_envs * m
    key = jnp.where(live, rows * m + slots, cells).reshape(-1)
    ranked_order = jnp.argsort(key, stable=True)
    ranked = key[ranked_order]
    last = jnp.concatenate([ranked[1:] != ranked[:-1], jnp.ones(1, jnp.bool_)]) & (ranked < cells)
    written = jnp.zeros(key.shape, jnp.bool_).at[ranked_order].set(last, unique_indices=True)
    return written.reshape(n, length)


def _check_values(
    streams: Streams, values: Any, call: str
) -> tuple[dict[str, PyTree[Array]], int, int]:
    """`write_back`'s `values`: a dict of keys of the (dict) step, each with its subtree's
    structure and leaves `[n, T, *shape]` of the stored dtypes, the same `n` and `T` for all;
    returned as JAX arrays with `n` and `T`."""
    spec = streams.item_spec
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"`{call}`: `values` name keys of a dict step, but the step is a "
            f"{type(spec).__name__}; write back into a buffer of dict steps."
        )
    if not isinstance(values, Mapping) or not values:
        raise TypeError(
            f"`{call}`: `values` must be a non-empty dict of keys of the step (such as "
            f"{{'state': states}}), got {type(values).__name__}."
        )
    unknown = [k for k in values if k not in spec]
    if unknown:
        raise ValueError(
            f"`{call}`: `values` has keys {unknown!r} that the step does not have; its keys "
            f"are {sorted(map(str, spec))}."
        )
    sub = {k: spec[k] for k in values}
    items, n, length = check_sequences(sub, dict(values), f"{call}(values=...)")
    return items, n, length


def append_steps(
    streams: _S, items: PyTree[Array], rows: Int[Array, " n"] | None, length: int
) -> tuple[_S, Bool[Array, " num_envs"]]:
    """Append `length >= 1` steps (leaves `[n, length, ...]`) to envs `rows` (distinct; a row
    of `num_envs` is dropped), or to every env in order (`rows=None`). Unchecked. Returns the
    new streams and which envs took the steps. An env past `2**31 - 1 - length` steps keeps its
    count (the caller reports it)."""
    m = streams.max_length
    # A faulty recording call (`_faults.vetoing`): no env takes a step. A listed env's row
    # becomes `num_envs`, and without `env_ids` every slot becomes `max_length`: either way
    # out of range, so the scatter drops it and keeps its form (in place).
    vetoed = veto()
    if vetoed is not None and rows is not None:
        rows = jnp.where(vetoed, streams.num_envs, rows)
    book, store = streams.book, streams.data
    if book is not None:  # the episode ids go beside the steps, written by the same scatter
        counts = streams.step_count
        counts = counts if rows is None else jnp.take(counts, rows, mode="fill", fill_value=0)
        book, ids = book.advance(items, rows, counts, vetoed)
        items, store = (items, ids), (streams.data, book.ids)
    if length > m:  # only the last m steps of each env survive, as after `length` appends
        items = jax.tree.map(lambda x: x[:, length - m :], items)
    kept = min(length, m)
    # Step t of the kept ones goes `length - kept + t` slots past the env's cursor.
    offsets = jnp.asarray(np.arange(length - kept, length) % m, jnp.int32)
    head = streams.head
    # One scatter of every listed env's steps, through `_writes.py`, whose `vmap`s merge into
    # one batching dimension. (It was a `vmap` of `dynamic_update_index_in_dim` over the envs:
    # under a `vmap` over seeds jax 0.5.3 made that a scatter with two batching dimensions,
    # the seeds' last, and PureJaxRL's DQN transposed its whole storage to and from that
    # layout on every step, issue 38.) Without `env_ids` row e takes its steps at its own
    # cursor, the env axis a batching dimension: sharded along it, every device writes its
    # own envs' steps with no communication.
    if rows is None:
        slots = ring_add(head[:, None], offsets[None, :], m)
        if vetoed is None:
            data = jax.tree.map(lambda x, y: scatter_rows(x, slots, y), store, items)
        else:
            slots = jnp.where(vetoed, m, slots)
            data = jax.tree.map(lambda x, y: scatter_rows(x, slots, y, mode="drop"), store, items)
        added = jnp.full(streams.num_envs, True if vetoed is None else ~vetoed)
    else:
        cursors = jnp.take(head, rows, mode="fill", fill_value=0)
        slots = ring_add(cursors[:, None], offsets[None, :], m)
        data = jax.tree.map(lambda x, y: scatter_at(x, rows[:, None], slots, y), store, items)
        added = count_ids(rows, streams.num_envs) > 0
    fits = added & (streams.step_count <= INT32_MAX - length)
    step_count = jnp.where(fits, streams.step_count + length, streams.step_count)
    lengths = grow(streams.lengths, added, length, m)
    if book is not None:
        data, ids = data
        book = eqx.tree_at(lambda b: b.ids, book, ids)
        streams = eqx.tree_at(lambda s: s.book, streams, book)
    new = eqx.tree_at(
        lambda s: (s.data, s.step_count, s.lengths), streams, (data, step_count, lengths)
    )
    return new, added


def grow(
    lengths: Int[Array, " num_envs"], added: Bool[Array, " num_envs"], length: int, max_length: int
) -> Int[Array, " num_envs"]:
    """A window that ends at the newest step (stored steps, an online queue), after `length`
    steps were appended to the envs `added`: `min(lengths + length, max_length)` there."""
    # `min(w, m - length) + length` rather than `min(w + length, m)`: no int32 overflow, and
    # nothing ever exceeds m.
    grown = jnp.minimum(lengths, max(max_length - length, 0)) + min(length, max_length)
    return jnp.where(added, grown, lengths)


def step_backs(streams: Streams) -> Int[Array, "num_envs max_length"]:
    """The back distance of every slot: slot `s` of env `e` holds its env's `b`-th newest step,
    `b` in `[1, max_length]`, if it is stored (`b <= lengths[e]`)."""
    m = streams.max_length
    back = ring_sub(streams.head[:, None], jnp.arange(m, dtype=jnp.int32)[None, :], m)
    return jnp.where(back == 0, m, back)


def window_slots(
    streams: Streams, env: Int[Array, " batch"], back: Int[Array, " batch"], size: int
) -> Int[Array, "batch size"]:
    """Per row, the slots of `size` consecutive steps of env `env` from its `back`-th newest
    step (`back` in `[0, max_length]`; steps past the newest wrap into stale slots, for the
    caller to mask)."""
    m = streams.max_length
    # back is in [0, m], so every term stays in [0, m].
    first = ring_sub(streams.head[env], back, m)
    return ring_add(first[:, None], jnp.arange(size, dtype=jnp.int32)[None, :], m)


def gather_at(
    streams: Streams,
    env: Int[Array, "*#batch"],
    slots: Int[Array, "*#batch"],
    data: PyTree[Array] | None = None,
) -> PyTree[Array]:
    """The steps in `slots` of envs `env` (broadcast together; both in range). `data` is
    `streams.data` or a part of it (one leaf, say) with the same two leading axes."""
    source = streams.data if data is None else data
    return jax.tree.map(lambda x: x.at[env, slots].get(mode="promise_in_bounds"), source)


def gather_steps(
    streams: Streams,
    env: Int[Array, " batch"],
    back: Int[Array, " batch"],
    size: int,
    data: PyTree[Array] | None = None,
) -> PyTree[Shaped[Array, "batch size ..."]]:
    """Per row, `size` consecutive steps of env `env` from its `back`-th newest step (as
    `window_slots`). Unchecked."""
    return gather_at(streams, env[:, None], window_slots(streams, env, back, size), data)


def checked_streams(
    streams: Any,
    num_envs: int,
    max_length: int,
    item_spec: PyTree,
    call: str,
    episodes: Episodes | None = None,
    written_back: tuple[str, ...] | None = None,
) -> Streams:
    """`streams` if it is a `Streams` of this configuration, else an error quoting `call`."""
    if not isinstance(streams, Streams):
        raise TypeError(f"`{call}`: expected a `dx.Streams`, got {type(streams).__name__}.")
    mine = (num_envs, max_length, item_spec)
    theirs = (streams.num_envs, streams.max_length, streams.item_spec)
    if written_back is not None and streams.written_back != written_back:
        raise ValueError(
            f"`{call}`: the streams' written-back keys are {streams.written_back}, but this "
            f"buffer's are {written_back}; they must be the same."
        )
    if mine != theirs:
        raise ValueError(
            f"`{call}`: the streams have (num_envs, max_length, steps) = {theirs}, but "
            f"this buffer has {mine}."
        )
    if streams.episodes != episodes:
        raise ValueError(
            f"`{call}`: the streams keep episodes as {streams.episodes}, but this buffer "
            f"as {episodes}; they must be the same."
        )
    return streams
