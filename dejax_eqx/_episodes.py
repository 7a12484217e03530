"""Episodes in the per-env streams: which episode each stored step belongs to, where that
episode began and where it ended (or that it is still running), kept in O(1) per added step
with static shapes. The home of the episode bookkeeping that goal relabelling reads
(`_relabel.py`); the streams (`_streams.py`) update it in the same call as their steps.

The layout. Env `e` numbers its episodes `0, 1, 2, ...` in the order they begin. Per slot, the
number of the episode its step belongs to (`ids`, the slot's other leaf: it is written by the
same scatter as the step), or `~k` for the auto-reset step after episode `k` (see `Episodes`).
Per env, two rings
indexed by episode number modulo `max_length`: the absolute step number of episode `k`'s first
step (`first`) and of the step that ended it (`last`). A ring entry outlives every stored step
of its episode: episode `k + max_length` cannot begin (or end) before `max_length` episodes of
at least one step each have followed `k`, by which time no step of `k` is stored. So an
episode whose first step was overwritten still knows where it began, whatever its length.
Entries only grow over time, so the writes of one call are scatter-maxes: where two episodes
of one call share a ring entry (more than `max_length` of them in one `extend`), the later one
wins, as it must.

Per env, the number of episodes begun and what its next step is (`pending`): `0` the next
step of the running episode, `1` the first step of a new one, `2` an auto-reset step.
"""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree

from ._checks import check_choice, check_leaf, LeafName, pick_leaf


Autoreset = Literal["same-step", "next-step"]
AUTORESETS: tuple[Autoreset, ...] = ("same-step", "next-step")

# What an env's next step is.
_CONTINUES, _BEGINS, _RESETS = 0, 1, 2


class Episodes(eqx.Module):
    """How a trajectory buffer tells episodes apart in its streams: which leaves end an
    episode, and what the step after an end is. Given to a trajectory buffer's constructor
    (`episodes=`), it makes the buffer keep, for every stored step, the episode it belongs to,
    where that episode began and where it ended (`AbstractTrajectoryBuffer.episodes_of`), at
    O(1) per added step; goal relabelling (`dx.Relabel`) reads it.

    - `done`: the leaf or leaves whose `True` ends the episode at that step (one bool per
        step; several, such as `("terminated", "truncated")`, end it if any holds). Named as
        `Window(done=...)` names them.
    - `autoreset`: what the step after an episode end is, as the environment produced it
        (there is no default: read wrong, every episode would be off by one step).
        - `"same-step"` (gymnax, Brax, JaxGCRL, gymnasium's `SAME_STEP`): the next episode's
            first step. The step that ends an episode is its last.
        - `"next-step"` (envpool, gymnasium 1.x's default `NEXT_STEP`): an auto-reset step,
            which holds the final observation of the episode that ended, an action the
            environment ignores and no reward. It belongs to no episode (its own end flags are
            not read); the step after it is the next episode's first.

    A stream's first step begins an episode. `Episodes` is static: every field is a Python
    value, checked when made and against the buffer's steps when the buffer is made.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(3), "terminated": False, "truncated": False}
        episodes = dx.Episodes(done=("terminated", "truncated"), autoreset="same-step")
        buf = dx.TrajectoryBuffer(step, num_envs=4, max_length=100, episodes=episodes)
        ```
    """

    done: tuple[LeafName, ...] = eqx.field(static=True)
    autoreset: Autoreset = eqx.field(static=True)

    def __init__(self, done: LeafName | tuple[LeafName, ...], *, autoreset: str):
        """**Arguments:** as above."""
        call = "Episodes"
        self.done = tuple(done) if isinstance(done, tuple | list) else (done,)
        if not self.done:
            raise ValueError(f"`{call}(done=...)` is an empty tuple; name at least one leaf.")
        self.autoreset = check_choice(autoreset, AUTORESETS, f"{call}(autoreset=...)")

    def check(self, item_spec: PyTree[jax.ShapeDtypeStruct], call: str) -> None:
        """Check at trace time that `done` names boolean leaves of one value per step of
        `item_spec`; messages start with `call`."""
        for name in self.done:
            check_leaf(item_spec, name, f"`{call}`: `Episodes(done=...)`", floating=False)

    def ends(self, steps: PyTree[Array]) -> Bool[Array, "*steps"]:
        """Whether each of `steps` (leaves with any leading axes) ends its episode."""
        flags = [jnp.asarray(pick_leaf(steps, name)) for name in self.done]
        out = flags[0]
        for flag in flags[1:]:
            out = out | flag
        return out


def checked_episodes(episodes: Any, call: str) -> "Episodes":
    """`episodes` if it is an `Episodes`, else a `TypeError` quoting `call`."""
    if not isinstance(episodes, Episodes):
        raise TypeError(f"`{call}(episodes=...)` must be a `dx.Episodes`, got {episodes!r}.")
    return episodes


class EpisodeInfo(eqx.Module):
    """Where the episodes of given stored steps begin and end, as
    `AbstractTrajectoryBuffer.episodes_of` returns it. Every field has the shape of the
    steps asked about.

    - `episode`: int32, the episode's number in its env (from 0, in the order episodes
        begin), `-1` for an auto-reset step (`Episodes(autoreset="next-step")`), which belongs
        to no episode.
    - `first`: int32, the absolute step number of the episode's first step, whether or not
        it is still stored (`-1` where the streams were restored without it: see
        `Streams.restore`).
    - `last`: int32, the absolute step number of the step that ended the episode, or, for a
        running episode, of its env's newest step.
    - `ended`: bool, whether the episode has ended (`False`: it is running).

    For an auto-reset step, `first` and `last` are the step itself and `ended` is `True`.
    """

    episode: Int[Array, "*n"]
    first: Int[Array, "*n"]
    last: Int[Array, "*n"]
    ended: Bool[Array, "*n"]

    @property
    def reset(self) -> Bool[Array, "*n"]:
        """Whether each step is an auto-reset step (of no episode)."""
        return self.episode < 0


class EpisodeBook(eqx.Module):
    """The episode bookkeeping of `num_envs` streams of `max_length` slots (see the module's
    docstring); a field of `Streams` when it was made with `episodes=`."""

    ids: Int[Array, "num_envs max_length"]
    first: Int[Array, "num_envs max_length"]
    last: Int[Array, "num_envs max_length"]
    begun: Int[Array, " num_envs"]
    pending: Int[Array, " num_envs"]
    episodes: Episodes = eqx.field(static=True)

    def __init__(self, episodes: Episodes, num_envs: int, max_length: int):
        shape = (num_envs, max_length)
        self.ids = jnp.zeros(shape, jnp.int32)
        self.first = jnp.full(shape, -1, jnp.int32)
        self.last = jnp.full(shape, -1, jnp.int32)
        self.begun = jnp.zeros(num_envs, jnp.int32)
        self.pending = jnp.full(num_envs, _BEGINS, jnp.int32)
        self.episodes = episodes

    def advance(
        self,
        steps: PyTree[Array],
        rows: Int[Array, " n"] | None,
        counts: Int[Array, " n"],
        vetoed: Bool[Array, ""] | None,
    ) -> tuple["EpisodeBook", Int[Array, "n length"]]:
        """The bookkeeping after `length` steps (leaves `[n, length, ...]`) were appended to
        envs `rows` (distinct; `num_envs` for an entry that is dropped), or to every env in
        order (`rows=None`), whose step counts before the append were `counts`; and the
        episode id of each appended step, for the slots. Nothing changes where `vetoed`
        holds. The ids are what the caller writes beside the steps (its write is vetoed by
        the same flag)."""
        num_envs, m = self.ids.shape
        ends = self.episodes.ends(steps)  # (n, length)
        if rows is None:
            begun, pending = self.begun, self.pending
        else:
            begun = jnp.take(self.begun, rows, mode="fill", fill_value=0)
            pending = jnp.take(self.pending, rows, mode="fill", fill_value=_BEGINS)
        after_end = _RESETS if self.episodes.autoreset == "next-step" else _BEGINS

        def one(state, end):
            begun, pending = state
            reset = pending == _RESETS
            begins = pending == _BEGINS
            begun = begun + begins.astype(jnp.int32)
            # The reset step after episode k is ~k (negative): `rank` reads k from it.
            ids = jnp.where(reset, ~(begun - 1), begun - 1)
            ends = end & ~reset
            pending = jnp.where(reset, _BEGINS, jnp.where(ends, after_end, _CONTINUES))
            return (begun, pending), (ids, begins, ends)

        (new_begun, new_pending), (ids, begins, closes) = jax.lax.scan(
            one, (begun, pending), ends.T
        )
        ids, begins, closes = ids.T, begins.T, closes.T  # (n, length)
        length = ids.shape[1]
        steps_at = counts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        env = jnp.arange(num_envs, dtype=jnp.int32) if rows is None else rows
        if vetoed is not None:
            env = jnp.where(vetoed, num_envs, env)  # every write dropped
        at = jnp.broadcast_to(env[:, None], ids.shape)
        entry = jnp.maximum(ids, 0) % m
        first = self.first.at[jnp.where(begins, at, num_envs), entry].max(steps_at, mode="drop")
        last = self.last.at[jnp.where(closes, at, num_envs), entry].max(steps_at, mode="drop")
        if rows is None:
            keep = jnp.zeros((), bool) if vetoed is None else vetoed
            begun = jnp.where(keep, self.begun, new_begun)
            pending = jnp.where(keep, self.pending, new_pending)
        else:
            begun = self.begun.at[env].set(new_begun, mode="drop")
            pending = self.pending.at[env].set(new_pending, mode="drop")
        new = eqx.tree_at(
            lambda b: (b.first, b.last, b.begun, b.pending), self, (first, last, begun, pending)
        )
        return new, ids

    def info(
        self,
        env: Int[Array, "*n"],
        step: Int[Array, "*n"],
        step_count: Int[Array, " num_envs"],
    ) -> EpisodeInfo:
        """The episodes of stored steps `step` (absolute numbers) of envs `env` (both in
        range, broadcast together). Unchecked: a step that is not stored reads another's."""
        m = self.ids.shape[1]
        ids = self.ids[env, step % m]
        reset = ids < 0
        episode = jnp.where(reset, -1, ids)
        entry = jnp.maximum(episode, 0) % m
        ended = reset | (episode < self.begun[env] - 1) | (self.pending[env] != _CONTINUES)
        first = jnp.where(reset, step, self.first[env, entry])
        last = jnp.where(ended, self.last[env, entry], step_count[env] - 1)
        last = jnp.where(reset, step, last)
        return EpisodeInfo(episode, first, last, ended)

    def rank(self, ids: Int[Array, "*n"], step: Int[Array, "*n"]) -> Int[Array, "*n"]:
        """Per step of its env (absolute number `step`, slot id `ids`), how many of its env's
        steps before it belong to an episode, up to a constant per env: `step` with same-step
        auto-reset (every step does), `step - k` with next-step auto-reset for a step of
        episode `k` or the auto-reset step after it (each of the `k` episodes before it was
        followed by one). Steps of episodes have ranks one apart; an auto-reset step shares
        the next step's."""
        if self.episodes.autoreset == "same-step":
            return step
        return step - jnp.where(ids < 0, ~ids, ids)

    def restored(
        self, steps: PyTree[Array], ends: Int[Array, " num_envs"], kept: Int[Array, " num_envs"]
    ) -> tuple["EpisodeBook", Int[Array, "num_envs max_length"]]:
        """The bookkeeping of streams restored from `steps` (leaves `[num_envs, max_length,
        ...]`, env `e`'s `kept[e]` stored steps oldest first, the last of them step `ends[e]
        - 1`), and the ids of those positions. Only the stored steps are known: the oldest is
        taken as a step of a running episode (not a reset step) whose first step is not
        known (`first = -1`), unless it is the stream's first step."""
        num_envs, m = self.ids.shape
        fresh = EpisodeBook(self.episodes, num_envs, m)
        oldest = ends - kept
        # Each env starts inside episode 0, as if its first step were stored, and the
        # episode numbers run from there; a stream that holds its first step starts fresh.
        unknown = oldest > 0
        start = eqx.tree_at(
            lambda b: (b.begun, b.pending),
            fresh,
            (
                jnp.where(unknown, 1, 0).astype(jnp.int32),
                jnp.where(unknown, _CONTINUES, _BEGINS).astype(jnp.int32),
            ),
        )
        rows = jnp.arange(num_envs, dtype=jnp.int32)
        first = start.first.at[rows, 0].set(jnp.where(unknown, -1, start.first[:, 0]))
        start = eqx.tree_at(lambda b: b.first, start, first)
        # Positions past `kept` are not steps: they end nothing and their ids are not read.
        position = jnp.arange(m)[None, :] < kept[:, None]
        live = jax.tree.map(
            lambda x: jnp.where(position.reshape(position.shape + (1,) * (x.ndim - 2)), x, 0),
            steps,
        )
        book, ids = _advance_positions(start, live, oldest, position)
        return book, ids


def _advance_positions(
    book: EpisodeBook,
    steps: PyTree[Array],
    counts: Int[Array, " num_envs"],
    position: Bool[Array, "num_envs max_length"],
) -> tuple[EpisodeBook, Int[Array, "num_envs max_length"]]:
    """`book.advance` over every env's steps, where each env takes only the steps where
    `position` holds (a prefix): the envs advance one position at a time, each only while it
    has steps."""
    num_envs, m = position.shape
    ids = jnp.zeros((num_envs, m), jnp.int32)

    def one(i, carry):
        book, ids = carry
        step = jax.tree.map(lambda x: x[:, i][:, None], steps)
        rows = jnp.where(position[:, i], jnp.arange(num_envs, dtype=jnp.int32), num_envs)
        book, new = book.advance(step, rows, counts + i, None)
        return book, ids.at[:, i].set(new[:, 0])

    return jax.lax.fori_loop(0, m, one, (book, ids))
