import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import (
    Array,
    ArrayLike,
    Bool,
    Float,
    Int,
    Integer,
    PRNGKeyArray,
    PyTree,
    Real,
    Shaped,
)

from ._checks import (
    as_prototype,
    check_bool,
    check_choice,
    check_faults,
    check_index,
    check_items,
    check_nonnegative_int,
    check_positive_int,
    check_real_scalar,
    check_sequences,
    count_ids,
    INT32_MAX,
    plural,
    Prototype,
    spec_of,
)
from ._nstep import n_step
from ._sequences import admissible, draw_starts, Law
from ._storage import ring_add, ring_sub


_TB = TypeVar("_TB", bound="TrajectoryBuffer")

Source = Literal["replay", "online"]
_SOURCES: tuple[Source, ...] = ("replay", "online")
EpisodeEnds = Literal["cross", "truncate", "within"]
_EPISODE_ENDS: tuple[EpisodeEnds, ...] = ("cross", "truncate", "within")
LeafName = str | Callable[[Any], Any]
"""Names one leaf of a step: a key of the step (a mapping) or an attribute of it (a named
tuple, a dataclass, a module), or a function that returns the leaf from the step's pytree
(`lambda step: step.info.done`; structure only: it must return the stored leaf itself)."""

_EMPTY: dict[Source, str] = {
    "replay": "cannot sample from an empty TrajectoryBuffer: no env has any stored step",
    "online": (
        "cannot sample from an empty online queue: no step was added to any env since the "
        "last `reset_online_queue()`"
    ),
}


class SequenceSample(NamedTuple):
    """What `TrajectoryBuffer.sample` and `sample_mixed` return: windows and what to do with
    each of their steps.

    A window of `W = burn_in + sequence_length + bootstrap` steps is laid out as
    `[burn-in | learning part | bootstrap]` along the sequence axis.

    **Fields:**

    - `items`: the windows, with the prototype's structure; each leaf of shape
        `(batch, W, *leaf_shape)`. Steps where `mask` is `False` are zeros (`False` for
        booleans).
    - `mask`: boolean `(batch, W)`, `True` at the steps the window holds: stored steps of its
        env, not cut off by the `episode_ends` policy.
    - `learn`: boolean `(batch, W)`, `mask` restricted to the learning part (positions
        `burn_in <= t < burn_in + sequence_length`): the steps a loss should train on.
    - `env`: int32 `(batch,)`, the env of each window.
    - `start`: int32 `(batch,)`, the absolute step number (in its env's stream, counting from 0
        at the first step ever added) of the window's position 0.

    `(env, start)` is the window's *stamp* (also as the property `stamp`): it names the slot of
    the window's first step (`start mod max_length`) and the generation of that slot
    (`start // max_length`). `TrajectoryBuffer.overwritten(env, start)` tells whether the
    window has since lost steps to newer ones.
    """

    items: PyTree[Shaped[Array, "batch seq ..."]]
    mask: Bool[Array, "batch seq"]
    learn: Bool[Array, "batch seq"]
    env: Int[Array, " batch"]
    start: Int[Array, " batch"]

    @property
    def stamp(self) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
        """`(env, start)`: what `TrajectoryBuffer.overwritten` takes."""
        return self.env, self.start


class Transitions(NamedTuple):
    """What `TrajectoryBuffer.sample_transitions` returns: n-step transitions.

    **Fields:**

    - `first`: the step the transition starts from (its observation and action), with the
        prototype's structure, each leaf of shape `(batch, *leaf_shape)`.
    - `returns`: `(batch,)`, the discounted sum of the rewards up to the first episode end
        or `n` of them, in the reward leaf's dtype.
    - `discount`: `(batch,)`, the factor of the bootstrap value: `0` after a termination,
        else `discount ** k` for `k` rewards taken (a truncation keeps bootstrapping).
    - `next`: the step to bootstrap from (the step after the last reward taken), like
        `first`.
    - `env`: int32 `(batch,)`, the env of each transition.
    - `start`: int32 `(batch,)`, the absolute step number of `first`; `(env, start)` is the
        transition's stamp, as for `SequenceSample`.
    """

    first: PyTree[Shaped[Array, "batch ..."]]
    returns: Float[Array, " batch"]
    discount: Float[Array, " batch"]
    next: PyTree[Shaped[Array, "batch ..."]]
    env: Int[Array, " batch"]
    start: Int[Array, " batch"]


class _Windows(NamedTuple):
    """A checked description of the windows to sample (static)."""

    law: Law
    burn_in: int
    length: int
    episode_ends: EpisodeEnds
    done: tuple[LeafName, ...]


def _out_of_range(num_envs: int) -> str:
    return f"an env id is out of range; env ids must satisfy 0 <= env_id < num_envs = {num_envs}"


def _power_fault(power: Float[Array, ""], call: str) -> tuple[Bool[Array, ""], str]:
    return ~jnp.isfinite(power), f"`{call}`: `distribution_power` must be finite"


def _pick(step: PyTree, name: LeafName) -> Any:
    if callable(name):
        return name(step)
    if isinstance(step, Mapping):
        return step[name]
    return getattr(step, name)


def _check_leaf(
    data: PyTree[Array | jax.ShapeDtypeStruct], name: Any, what: str, floating: bool
) -> None:
    """Check at trace time that `name` picks one stored leaf with one value per step, of a
    floating dtype (`floating`) or bool. `what` names the argument in messages."""
    if not (isinstance(name, str) or callable(name)):
        raise TypeError(
            f"{what} must name a leaf of the step: a str (a key or attribute of the step) or a "
            f"function that returns the leaf, got {name!r}."
        )
    try:
        leaf = _pick(data, name)
    except (KeyError, AttributeError, TypeError, IndexError) as error:
        raise ValueError(
            f"{what}: the step has no leaf {name!r} ({type(error).__name__}: {error})."
        ) from None
    if not any(leaf is x for x in jax.tree.leaves(data)):
        raise ValueError(
            f"{what}: {name!r} must pick one leaf of the step as it is stored, but it gave a "
            f"{type(leaf).__name__}."
        )
    shape = tuple(leaf.shape[2:])
    if shape != ():
        raise ValueError(
            f"{what}: the leaf {name!r} has shape {shape} per step; it must hold one value per "
            "step (shape ())."
        )
    if floating and not jnp.issubdtype(leaf.dtype, jnp.floating):
        raise TypeError(f"{what}: the leaf {name!r} has dtype {leaf.dtype}, expected a float.")
    if not floating and leaf.dtype != jnp.bool_:
        raise TypeError(f"{what}: the leaf {name!r} has dtype {leaf.dtype}, expected bool.")


def _cut(
    ends: Bool[Array, "batch seq"], burn_in: int, policy: EpisodeEnds
) -> Bool[Array, "batch seq"]:
    """The steps an `episode_ends` policy removes from windows whose real steps end episodes
    at `ends`: after the first end at or past the learning part, and (`"within"`) up to the
    last end inside the burn-in."""
    t = jnp.arange(ends.shape[1])[None, :]
    late = ends & (t >= burn_in)
    cut = jnp.cumsum(late, axis=1, dtype=jnp.int32) > late.astype(jnp.int32)
    if policy == "within":
        early = ends & (t < burn_in)
        cut = cut | (jnp.cumsum(early[:, ::-1], axis=1, dtype=jnp.int32)[:, ::-1] > 0)
    return cut


def _zero_where_not(mask: Bool[Array, "batch seq"], items: PyTree[Array]) -> PyTree[Array]:
    def fill(x):
        keep = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
        return jnp.where(keep, x, jnp.zeros_like(x))

    return jax.tree.map(fill, items)


class TrajectoryBuffer(eqx.Module):
    """Per-env streams of steps, with a replay window and an online queue, sampled as windows
    (for recurrent learners) or as n-step transitions (for the DQN family).

    Made for actors that step environments asynchronously, such as envpool's async mode, where
    every `recv()` returns a different subset of the envs. Each of the `num_envs` envs keeps
    its own stream of its last `max_length` steps, with its own write cursor, so envs advance
    independently. Two windows end at the newest step of each stream:

    - the *replay* window: every stored step of the env;
    - the *online* window (the online queue): the steps added since the last
        `reset_online_queue()`, at most `max_length`.

    Both share one storage: the online queue costs no memory. Every step has an absolute
    number in its env's stream (0 for the first step ever added; `step_count[e]` steps so
    far), which aligns periods and stamps samples.

    **Sampling.** `sample` draws `batch_size` windows of `W = burn_in + sequence_length +
    bootstrap` steps, with replacement, over all envs and admissible starts together. A start
    whose window holds `r` real steps (`r < W` at the newest end of a stream) is drawn with
    probability proportional to `r ** distribution_power`; `period` aligns starts to the
    envs' absolute step numbers, `strict` keeps only whole windows, and `episode_ends` cuts
    windows at episode ends. `sample_transitions` draws n-step transitions. A sample costs
    O(num_envs + W + batch_size · W), whatever `max_length` (the method is in
    `dejax_eqx/README.md`); the options are explained on the docs page "Sequences for
    recurrent and n-step learners".

    **Errors.** Arguments that are known at trace time (a window longer than `max_length`,
    `batch_size < 1`, a bad `source`, items that do not match the prototype, a leaf name that
    names no suitable leaf) raise `ValueError`/`TypeError` at once. Faults in the data raise
    through `eqx.error_if`, eagerly and under `jit` alike: env ids out of range or repeated
    within one `add`, sampling with no admissible start, peeking at an env without steps.
    `EQX_ON_ERROR` chooses what happens instead (`raise` by default; see Equinox's `error_if`).

    `TrajectoryBuffer` is final: it is not meant to be subclassed.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(4), "reward": jnp.zeros(()), "done": jnp.zeros((), bool)}
        buf = dx.TrajectoryBuffer(step, num_envs=8, max_length=1000)

        @eqx.filter_jit(donate="all-except-first")
        def train_step(key, buf, steps, env_ids):
            buf = buf.add(steps, env_ids=env_ids)  # only these envs advance
            sample = buf.sample_mixed(key, 12, 4, sequence_length=16)
            return buf, sample

        env_ids = np.array([5, 1, 6], np.int32)  # e.g. info["env_id"] from envpool's recv()
        steps = {"obs": jnp.ones((3, 4)), "reward": jnp.ones(3), "done": jnp.zeros(3, bool)}
        buf, sample = train_step(jax.random.key(0), buf, steps, env_ids)
        assert sample.items["obs"].shape == (16, 16, 4) and sample.mask.shape == (16, 16)
        assert buf.lengths().tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
        ```
    """

    data: PyTree[Shaped[Array, "num_envs max_length ..."]]
    step_count: Int[Array, " num_envs"]
    replay_length: Int[Array, " num_envs"]
    online_length: Int[Array, " num_envs"]
    num_envs: int = eqx.field(static=True)
    max_length: int = eqx.field(static=True)

    def __init__(self, prototype: Prototype, num_envs: int, max_length: int):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars). Only its
            structure, shapes and dtypes are used; stored steps must match them exactly.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the number of steps each env keeps, a positive Python int below
            `2**31`. Storage is `num_envs · max_length` steps.
        """
        self.num_envs = check_positive_int(num_envs, "TrajectoryBuffer(num_envs=...)")
        self.max_length = check_positive_int(max_length, "TrajectoryBuffer(max_length=...)")
        spec = as_prototype(prototype, "TrajectoryBuffer(prototype=...)")
        shape = (self.num_envs, self.max_length)
        self.data = jax.tree.map(lambda s: jnp.zeros((*shape, *s.shape), s.dtype), spec)
        # Per env: the number of steps ever added, in [0, 2**31 - 1] (the write cursor is
        # step_count mod max_length), and the lengths of the two windows, in [0, max_length],
        # with online_length <= replay_length.
        self.step_count = jnp.zeros(self.num_envs, jnp.int32)
        self.replay_length = jnp.zeros(self.num_envs, jnp.int32)
        self.online_length = jnp.zeros(self.num_envs, jnp.int32)

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return spec_of(self.data, axes=2)

    @property
    def head(self) -> Int[Array, " num_envs"]:
        """Each env's write cursor: the slot its next step goes to, `step_count mod
        max_length`, an int32 array of shape `(num_envs,)`."""
        return self.step_count % self.max_length

    def lengths(self, source: Source = "replay") -> Int[Array, " num_envs"]:
        """The number of steps in each env's window.

        **Arguments:**

        - `source`: `"replay"` (every stored step, the default) or `"online"` (the steps added
            since the last `reset_online_queue()`).

        **Returns:** an int32 array of shape `(num_envs,)` with values in `[0, max_length]`.
        """
        source = check_choice(source, _SOURCES, "TrajectoryBuffer.lengths(source=...)")
        return self.replay_length if source == "replay" else self.online_length

    def add(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        """Append one step to the stream of each listed env.

        The envs not listed are untouched: their cursors and windows stay where they are.
        An env whose stream holds `max_length` steps drops its oldest. All listed envs are
        written in one scatter, at their own cursors.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis: one step per listed env, in the order of `env_ids`.
        - `env_ids`: an integer array of shape `(n,)` of distinct env ids in
            `[0, num_envs)`, such as `info["env_id"]` from envpool's `recv()`. `None` (the
            default) means every env, in order: then `n = num_envs`.

        **Returns:** the new buffer.

        **Raises:** `ValueError`/`TypeError` at trace time if `items` does not match the
        prototype or its leading axis is not `n`; an `eqx.error_if` error if an env id is out
        of range or occurs twice, or if an env has taken `2**31 - 1` steps (the most its int32
        step count holds).
        """
        return self._add(items, env_ids, "TrajectoryBuffer.add")

    def extend(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        """Append `T` consecutive steps to the stream of each listed env: the same as `T`
        calls of `add` (step `t` of every listed env in call `t`), in one write.

        For actors that collect a rollout of `T` steps from every env before storing it (a
        `lax.scan` over the env step, as in PureJaxRL or Stoix), and for flashbax's
        trajectory buffers, which add `[num_envs, T]` batches.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have two extra
            leading axes `(n, T)`: `T` steps for each listed env, oldest first. `T = 0` adds
            nothing. `T > max_length` is allowed: as after `T` adds, the last `max_length`
            steps remain.
        - `env_ids`: as for `add`; `None` (the default) means every env, in order.

        **Returns:** the new buffer.

        **Raises:** as `add`, and an `eqx.error_if` error if an env would pass `2**31 - 1`
        steps.
        """
        return self._extend(items, env_ids, "TrajectoryBuffer.extend")

    def _add(self: _TB, items, env_ids, call: str, *, keep_unread: bool = False) -> _TB:
        """`add` under the name `call`; `keep_unread` as for `_append`."""
        items, n = check_items(self.item_spec, items, call, batched=True, what="batch of steps")
        assert n is not None
        steps = jax.tree.map(lambda x: x[:, None], items)
        return self._append(steps, n, 1, env_ids, call, keep_unread=keep_unread)

    def _extend(self: _TB, items, env_ids, call: str, *, keep_unread: bool = False) -> _TB:
        """`extend` under the name `call`; `keep_unread` as for `_append`."""
        items, n, length = check_sequences(self.item_spec, items, call)
        return self._append(items, n, length, env_ids, call, keep_unread=keep_unread)

    def _append(
        self: _TB,
        items: PyTree[Array],
        n: int,
        length: int,
        env_ids: Integer[ArrayLike, " n"] | None,
        call: str,
        *,
        keep_unread: bool = False,
    ) -> _TB:
        """Append `length` steps to each of `n` envs (leaves `[n, length, ...]`, checked).

        With `keep_unread` (`TrajectoryQueue`: the online window holds the unread steps), an
        add that would push an unread step out of a listed env's online window is refused.
        """
        m = self.max_length
        if keep_unread and length > m:
            raise ValueError(
                f"`{call}`: {length} steps per env do not fit in a queue of max_length = "
                f"{m}; the oldest would be overwritten before they are read."
            )
        if length == 0:
            return self
        if length > m:  # only the last m steps of each env survive, as after `length` adds
            items = jax.tree.map(lambda x: x[:, length - m :], items)
        kept = min(length, m)
        # Step t of the kept ones goes `length - kept + t` slots past the env's cursor.
        offsets = jnp.asarray(np.arange(length - kept, length) % m, jnp.int32)
        head = self.head
        faults = []
        if env_ids is None:
            if n != self.num_envs:
                raise ValueError(
                    f"`{call}`: without `env_ids` there must be steps for every env, but the "
                    f"batch has {n} entries and num_envs is {self.num_envs}. Pass "
                    "`env_ids` to add steps for some envs only."
                )
            if kept == 1:
                # Row e of every leaf takes step e at its own cursor: a vmapped one-step
                # update, which is one scatter whose env axis is a batch axis. Sharded along
                # that axis, every device writes its own envs' steps with no communication.
                write = jax.vmap(lambda row, y, h: lax.dynamic_update_index_in_dim(row, y, h, 0))
                last = ring_add(head, offsets[0], m)
                data = jax.tree.map(lambda x, y: write(x, y[:, 0], last), self.data, items)
            else:
                rows = jnp.arange(self.num_envs, dtype=jnp.int32)[:, None]
                slots = ring_add(head[:, None], offsets[None, :], m)
                data = jax.tree.map(
                    lambda x, y: x.at[rows, slots].set(y, unique_indices=True), self.data, items
                )
            added = jnp.ones(self.num_envs, jnp.bool_)
        else:
            rows, bad = check_index(
                env_ids, self.num_envs, f"{call}(env_ids=...)", ndim=1, length=(n, "step")
            )
            if n == 0:
                return self
            counts = count_ids(rows, self.num_envs)
            # An id out of range is row `num_envs` and is dropped, so a bad call writes nothing
            # outside the arrays, whatever `EQX_ON_ERROR` says.
            cursors = jnp.take(head, rows, mode="fill", fill_value=0)
            slots = ring_add(cursors[:, None], offsets[None, :], m)
            data = jax.tree.map(
                lambda x, y: x.at[rows[:, None], slots].set(y, mode="drop"), self.data, items
            )
            added = counts > 0
            faults += [
                (bad, f"`{call}`: {_out_of_range(self.num_envs)}"),
                (
                    jnp.any(counts > 1),
                    f"`{call}`: an env id occurs more than once; each call adds to each env "
                    "at most once",
                ),
            ]
        if keep_unread:
            faults.append(
                (
                    jnp.any(added & (self.online_length > m - length)),
                    f"`{call}`: an env's queue has no room for {plural(length, 'more step')}; "
                    f"the add would overwrite unread ones (max_length = {m}). Pop first, or "
                    "check `can_add`",
                )
            )
        faults.append(
            (
                jnp.any(added & (self.step_count > INT32_MAX - length)),
                f"`{call}`: an env would pass 2**31 - 1 steps, the most its int32 step count "
                "holds; the step numbers that align periods and stamp samples would wrap",
            )
        )
        new = self._advance(data, added, length)
        # The guard sits on the new counters, outputs every later use depends on, not on the
        # storage (threading it through `error_if` could force a copy).
        state = check_faults((new.step_count, new.replay_length, new.online_length), faults)
        return eqx.tree_at(lambda b: (b.step_count, b.replay_length, b.online_length), new, state)

    def _advance(
        self: _TB, data: PyTree[Array], added: Bool[Array, " num_envs"], length: int
    ) -> _TB:
        m = self.max_length

        def grow(window):
            # `min(window, m - length) + length` rather than `min(window + length, m)`: no
            # int32 overflow, and nothing ever exceeds m.
            grown = jnp.minimum(window, max(m - length, 0)) + min(length, m)
            return jnp.where(added, grown, window)

        # Past 2**31 - 1 the count stays put: the add is refused by the caller's check.
        fits = added & (self.step_count <= INT32_MAX - length)
        step_count = jnp.where(fits, self.step_count + length, self.step_count)
        return eqx.tree_at(
            lambda b: (b.data, b.step_count, b.replay_length, b.online_length),
            self,
            (data, step_count, grow(self.replay_length), grow(self.online_length)),
        )

    def reset_online_queue(self: _TB) -> _TB:
        """Empty the online queue of every env; the replay windows keep all their steps.

        **Returns:** the new buffer.
        """
        return eqx.tree_at(lambda b: b.online_length, self, jnp.zeros_like(self.online_length))

    def peek(self, env_ids: Integer[ArrayLike, "*n"] | None = None) -> PyTree[Array]:
        """The newest step of each listed env.

        Useful in an actor loop, e.g. to read the latest observation of the envs that were
        just returned. The online queue and the replay window share their newest step.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape (a scalar
            gives one step); repeats are allowed. `None` (the default) means every env.

        **Returns:** the steps, each leaf with the shape of `env_ids` in front of the
        prototype's shape.

        **Raises:** an `eqx.error_if` error if an env id is out of range or a listed env has
        no stored step.
        """
        call = "TrajectoryBuffer.peek"
        if env_ids is None:
            rows = jnp.arange(self.num_envs, dtype=jnp.int32)
            bad = jnp.zeros(self.num_envs, jnp.bool_)
        else:
            rows, bad = check_index(env_ids, self.num_envs, f"{call}(env_ids=...)")
        rows = jnp.where(bad, 0, rows)  # any row: the result is not used when one is bad
        slots = ring_sub(self.head[rows], 1, self.max_length)
        steps = jax.tree.map(lambda x: x[rows, slots], self.data)
        return check_faults(
            steps,
            [
                (bad, f"`{call}`: {_out_of_range(self.num_envs)}"),
                (
                    ~bad & (self.replay_length[rows] == 0),
                    f"`{call}`: an env has no stored step yet; there is nothing to peek at",
                ),
            ],
        )

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        sequence_length: int,
        *,
        burn_in: int = 0,
        bootstrap: int = 0,
        period: int = 1,
        strict: bool = False,
        episode_ends: EpisodeEnds = "cross",
        done: LeafName | tuple[LeafName, ...] | None = None,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        source: Source = "replay",
    ) -> SequenceSample:
        """Draw `batch_size` windows, with replacement, from the replay windows or the online
        queue.

        A window is `W = burn_in + sequence_length + bootstrap` consecutive steps of one env's
        stream. Its start may be any stored step such that

        - the start's absolute step number is a multiple of `period`;
        - with `strict=True`: the whole window is stored. Every such start is equally likely.
        - with `strict=False` (the default): the window holds at least `burn_in + 1` real
            steps (so at least one to learn from). A start whose window holds `r` real steps
            is drawn with probability proportional to `r ** distribution_power`, over all
            envs and starts together; steps past the newest are masked.

        Envs without such a start are never drawn.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: the number of windows, a positive Python int (static).
        - `sequence_length`: the length of the learning part, a positive Python int (static).
        - `burn_in`, `bootstrap`: the numbers of steps before and after the learning part,
            non-negative Python ints (static; default 0). `W` must be at most `max_length`.
        - `period`: a positive Python int (static; default 1, every step may start a window).
        - `strict`: a Python bool (static; default `False`).
        - `episode_ends`: what a window does at an episode end (static):
            - `"cross"` (the default): nothing; windows run on into the next episode.
            - `"truncate"`: the steps after the first episode end at or past the learning
                part are masked (the end step itself is kept).
            - `"within"`: as `"truncate"`, and the steps up to the last episode end inside the
                burn-in are masked too, so every step the window holds belongs to the episode
                of its first learning step.
        - `done`: the leaf that marks the step that ends an episode (a `LeafName`: a key or
            attribute name, or a function that picks the leaf), of dtype bool and one value
            per step; or a tuple of them, such as `("terminated", "truncated")`, any of which
            ends an episode. Required unless `episode_ends="cross"`, refused with it.
        - `distribution_power`: a finite real exponent (default `1.0`; `0.0` makes every
            admissible start equally likely). A traced scalar: pass it as a JAX array to change
            it between calls of a jitted function without recompiling (a Python float is a
            static argument of `eqx.filter_jit`). With `strict=True` it has no effect.
        - `source`: `"replay"` (the default) or `"online"`.

        **Returns:** a `SequenceSample` `(items, mask, learn, env, start)`: `items` has the
        prototype's structure, each leaf of shape `(batch_size, W, *leaf_shape)`, zero where
        `mask` is `False`; `learn` is `mask` on the learning part; `(env, start)` is the stamp.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments or a `done` that
        names no boolean per-step leaf; an `eqx.error_if` error if no env has an admissible
        start in the chosen source (for example, an empty buffer), or if
        `distribution_power` is not finite.
        """
        call = "TrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        windows = self._windows(
            call, sequence_length, burn_in, bootstrap, period, strict, episode_ends, done
        )
        source = check_choice(source, _SOURCES, f"{call}(source=...)")
        power = self._check_power(distribution_power, call)
        out = self._draw(key, source, batch_size, windows, power)
        return check_faults(
            out,
            [_power_fault(power, call), self._no_start_fault(source, windows, call)],
            order_reads=False,
        )

    def sample_mixed(
        self,
        key: PRNGKeyArray,
        replay_batch_size: int,
        online_batch_size: int,
        sequence_length: int,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        *,
        burn_in: int = 0,
        bootstrap: int = 0,
        period: int = 1,
        strict: bool = False,
        episode_ends: EpisodeEnds = "cross",
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> SequenceSample:
        """Windows from the replay windows and from the online queue, in one batch.

        The same as sampling `replay_batch_size` windows with `source="replay"` and
        `online_batch_size` with `source="online"` (from two keys split from `key`) and
        concatenating them: replay rows first, then online rows.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `replay_batch_size`, `online_batch_size`: non-negative Python ints, not both zero.
            A part of size zero is not sampled, so its source may be empty.
        - the others: as in `sample`, for both parts.

        **Returns:** a `SequenceSample` with a leading axis of
        `replay_batch_size + online_batch_size`.

        **Raises:** as `sample`, for each part of non-zero size.
        """
        call = "TrajectoryBuffer.sample_mixed"
        sizes: dict[Source, int] = {
            "replay": check_nonnegative_int(replay_batch_size, f"{call}(replay_batch_size=...)"),
            "online": check_nonnegative_int(online_batch_size, f"{call}(online_batch_size=...)"),
        }
        if sizes["replay"] + sizes["online"] == 0:
            raise ValueError(
                f"`{call}`: `replay_batch_size` and `online_batch_size` are both 0; ask for "
                "at least one sequence."
            )
        windows = self._windows(
            call, sequence_length, burn_in, bootstrap, period, strict, episode_ends, done
        )
        power = self._check_power(distribution_power, call)
        keys: dict[Source, Array] = dict(zip(_SOURCES, jax.random.split(key)))
        parts = [
            self._draw(keys[source], source, size, windows, power)
            for source, size in sizes.items()
            if size > 0
        ]
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        faults = [_power_fault(power, call)]
        faults += [
            self._no_start_fault(source, windows, call)
            for source, size in sizes.items()
            if size > 0
        ]
        return check_faults(out, faults, order_reads=False)

    def sample_transitions(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        n: int,
        *,
        discount: Real[ArrayLike, ""],
        reward: LeafName,
        terminated: LeafName,
        truncated: LeafName | None = None,
        source: Source = "replay",
    ) -> Transitions:
        """Draw `batch_size` n-step transitions, uniformly with replacement, over every env.

        A step `t` of a stream carries the reward for the action taken at `t` and the flags
        that say whether that reward ended the episode. The transition from `t` takes the
        rewards of steps `t, t + 1, ...` up to the first step that ends the episode, or `n` of
        them, `k` in all: `returns = sum_{i < k} discount**i reward_{t+i}`, and it bootstraps
        from step `t + k` with factor `0` if step `t + k - 1` terminated, else `discount**k`
        (a truncation, a time limit, cuts the return but keeps bootstrapping: store the
        observation that followed it as the next step, as envpool and gymnasium's next-step
        autoreset do). A step that is both terminated and truncated counts as terminated.

        A step may start a transition once the `n` steps after it are stored, whether or not
        its episode ended sooner: the newest `n` steps of a stream wait. Transitions never
        read past an env's newest step, and the ring wrap is invisible.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of transitions, a positive Python int (static).
        - `n`: the number of steps, a positive Python int with `n + 1 <= max_length` (static).
        - `discount`: the per-step discount, a real scalar in `[0, 1]` (may be traced).
        - `reward`: the reward leaf (a `LeafName`): one floating value per step.
        - `terminated`: the termination leaf: one bool per step.
        - `truncated`: the truncation leaf, one bool per step, or `None` (the default) if
            the steps have none.
        - `source`: `"replay"` (the default) or `"online"`.

        **Returns:** `Transitions` `(first, returns, discount, next, env, start)`.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments or leaf names;
        an `eqx.error_if` error if no env holds `n + 1` steps in the chosen source, or if
        `discount` is not in `[0, 1]`.
        """
        call = "TrajectoryBuffer.sample_transitions"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        n = check_positive_int(n, f"{call}(n=...)")
        if n + 1 > self.max_length:
            raise ValueError(
                f"`{call}(n=...)`: an n-step transition reads n + 1 = {n + 1} steps, more than "
                f"max_length = {self.max_length}; no env ever holds them."
            )
        source = check_choice(source, _SOURCES, f"{call}(source=...)")
        gamma = check_real_scalar(discount, call, "discount").astype(jnp.float32)
        _check_leaf(self.data, reward, f"`{call}(reward=...)`", floating=True)
        _check_leaf(self.data, terminated, f"`{call}(terminated=...)`", floating=False)
        if truncated is not None:
            _check_leaf(self.data, truncated, f"`{call}(truncated=...)`", floating=False)

        lengths = self.lengths(source)
        env, back, _ = draw_starts(
            key,
            lengths,
            jnp.zeros_like(lengths),
            batch_size,
            Law(n + 1, strict=True),
            jnp.zeros((), jnp.float32),
        )
        m = self.max_length
        first = ring_sub(self.head[env], back, m)
        slots = ring_add(first[:, None], jnp.arange(n, dtype=jnp.int32)[None, :], m)

        def window(name):
            return _pick(self.data, name).at[env[:, None], slots].get(mode="promise_in_bounds")

        ends = window(terminated)
        cut = window(truncated) if truncated is not None else jnp.zeros_like(ends)
        returns, factor, taken = n_step(window(reward), ends, cut, gamma)
        following = ring_add(first, taken, m)
        out = Transitions(
            first=jax.tree.map(lambda x: x[env, first], self.data),
            returns=returns,
            discount=factor,
            next=jax.tree.map(lambda x: x[env, following], self.data),
            env=env,
            start=self.step_count[env] - back,
        )
        return check_faults(
            out,
            [
                (
                    ~((gamma >= 0) & (gamma <= 1)),
                    f"`{call}`: `discount` must be in [0, 1]",
                ),
                (
                    ~jnp.any(lengths > n),
                    f"`{call}`: no env's {source} window holds n + 1 = {n + 1} steps yet; a "
                    "transition needs its n steps and the step after them",
                ),
            ],
            order_reads=False,
        )

    def overwritten(
        self, env_ids: Integer[ArrayLike, "*n"], starts: Integer[ArrayLike, "*n"]
    ) -> Bool[Array, "*n"]:
        """Whether the windows named by stamps `(env, start)` have lost steps since.

        A window is overwritten once its first step has been dropped to make room for a newer
        one (the first step goes first, so then the window's other stored steps may follow).
        Steps added after the newest step of a window do not overwrite it.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape.
        - `starts`: an integer array of the same shape: absolute step numbers, as
            `SequenceSample.start` and `Transitions.start` give them.

        **Returns:** a boolean array of the shape of `env_ids`.

        **Raises:** `ValueError`/`TypeError` at once if the shapes differ or an argument is not
        an integer array; an `eqx.error_if` error if an env id is out of range or a start is
        not a step its env has taken (negative, or at least its `step_count`).
        """
        call = "TrajectoryBuffer.overwritten"
        rows, bad_env = check_index(env_ids, self.num_envs, f"{call}(env_ids=...)")
        steps, bad_step = check_index(starts, INT32_MAX, f"{call}(starts=...)")
        if rows.shape != steps.shape:
            raise ValueError(
                f"`{call}`: `env_ids` has shape {rows.shape} and `starts` {steps.shape}; they "
                "must match, one start per env id."
            )
        count = jnp.take(self.step_count, rows, mode="fill", fill_value=0)
        length = jnp.take(self.replay_length, rows, mode="fill", fill_value=0)
        gone = steps < count - length
        return check_faults(
            gone,
            [
                (bad_env, f"`{call}`: {_out_of_range(self.num_envs)}"),
                (
                    ~bad_env & (bad_step | (steps >= count)),
                    f"`{call}`: a start is not a step of its env (negative, or not yet taken); "
                    "stamps must come from this buffer",
                ),
            ],
        )

    def _windows(
        self,
        call: str,
        sequence_length: int,
        burn_in: int,
        bootstrap: int,
        period: int,
        strict: bool,
        episode_ends: EpisodeEnds,
        done: LeafName | tuple[LeafName, ...] | None,
    ) -> _Windows:
        """The checked, static description of a sample's windows."""
        length = check_positive_int(sequence_length, f"{call}(sequence_length=...)")
        burn_in = check_nonnegative_int(burn_in, f"{call}(burn_in=...)")
        bootstrap = check_nonnegative_int(bootstrap, f"{call}(bootstrap=...)")
        period = check_positive_int(period, f"{call}(period=...)")
        strict = check_bool(strict, f"{call}(strict=...)")
        episode_ends = check_choice(episode_ends, _EPISODE_ENDS, f"{call}(episode_ends=...)")
        size = burn_in + length + bootstrap
        if size > self.max_length:
            raise ValueError(
                f"`{call}`: a window of burn_in + sequence_length + bootstrap = {burn_in} + "
                f"{length} + {bootstrap} = {size} steps is longer than max_length = "
                f"{self.max_length}; no env ever holds one."
            )
        if episode_ends == "cross":
            if done is not None:
                raise ValueError(
                    f"`{call}(done=...)` is given, but episode_ends='cross' does not read it; "
                    "pass episode_ends='truncate' or 'within', or leave `done` out."
                )
            names: tuple[LeafName, ...] = ()
        else:
            if done is None:
                raise ValueError(
                    f"`{call}(episode_ends={episode_ends!r})` needs `done`: the name of the "
                    "step's boolean episode-end leaf, or a tuple of names such as "
                    "('terminated', 'truncated')."
                )
            names = tuple(done) if isinstance(done, tuple | list) else (done,)
            if not names:
                raise ValueError(f"`{call}(done=...)` is an empty tuple; name at least one leaf.")
            for name in names:
                _check_leaf(self.data, name, f"`{call}(done=...)`", floating=False)
        law = Law(size, period, min_real=burn_in + 1, strict=strict)
        return _Windows(law, burn_in, length, episode_ends, names)

    @staticmethod
    def _check_power(distribution_power: Real[ArrayLike, ""], call: str) -> Float[Array, ""]:
        return check_real_scalar(distribution_power, call, "distribution_power").astype(jnp.float32)

    def _phase(self, law: Law) -> Int[Array, " num_envs"]:
        return self.step_count % law.period

    def _no_start_fault(
        self, source: Source, windows: _Windows, call: str
    ) -> tuple[Bool[Array, ""], str]:
        law = windows.law
        lengths = self.lengths(source)
        if law == Law(law.size):  # every stored step may start a window
            return jnp.all(lengths == 0), f"`{call}`: {_EMPTY[source]}"
        needs = []
        if law.strict:
            needs.append(f"its whole window of {law.size} steps stored")
        elif law.min_real > 1:
            needs.append(f"burn_in + 1 = {law.min_real} stored steps")
        if law.period > 1:
            needs.append(f"a step number that is a multiple of period = {law.period}")
        ok = admissible(lengths, self._phase(law), law)
        conditions = " and ".join(needs)
        return (
            ~jnp.any(ok),
            f"`{call}`: no env's {source} window has an admissible start; a start needs "
            f"{conditions}",
        )

    def _draw(
        self,
        key: PRNGKeyArray,
        source: Source,
        batch_size: int,
        windows: _Windows,
        power: Float[Array, ""],
    ) -> SequenceSample:
        """Sample without run-time checks: starts from `_sequences.draw_starts`, then the
        gather and the episode-end policy. If no env has an admissible start the result is
        meaningless (and nothing raises)."""
        law = windows.law
        lengths = self.lengths(source)
        env, back, remaining = draw_starts(key, lengths, self._phase(law), batch_size, law, power)
        return self._gather(env, back, remaining, windows)

    def _gather(
        self,
        env: Int[Array, " batch"],
        back: Int[Array, " batch"],
        remaining: Int[Array, " batch"],
        windows: _Windows,
    ) -> SequenceSample:
        """The windows whose starts are the `back`-th newest steps (`back` in `[0,
        max_length]`) of envs `env`, holding `remaining` real steps, cut by the episode-end
        policy. No checks: every index must be in range."""
        law = windows.law
        m = self.max_length
        # The start is the back-th newest step; back is in [0, m], so every term stays in
        # [0, m].
        first = ring_sub(self.head[env], back, m)
        t = jnp.arange(law.size, dtype=jnp.int32)
        slots = ring_add(first[:, None], t[None, :], m)
        mask = t[None, :] < remaining[:, None]
        rows = env[:, None]
        items = jax.tree.map(lambda x: x.at[rows, slots].get(mode="promise_in_bounds"), self.data)
        if windows.done:
            ends = functools.reduce(operator.or_, [_pick(items, d) for d in windows.done])
            mask = mask & ~_cut(ends & mask, windows.burn_in, windows.episode_ends)
        learning = (t >= windows.burn_in) & (t < windows.burn_in + windows.length)
        return SequenceSample(
            items=_zero_where_not(mask, items),
            mask=mask,
            learn=mask & learning[None, :],
            env=env,
            start=self.step_count[env] - back,
        )
