from typing import Literal, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
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
    check_choice,
    check_faults,
    check_index,
    check_items,
    check_nonnegative_int,
    check_positive_int,
    count_ids,
    Prototype,
    spec_of,
)
from ._sequences import draw_starts
from ._storage import ring_add, ring_sub


_TB = TypeVar("_TB", bound="TrajectoryBuffer")

Source = Literal["replay", "online"]
_SOURCES: tuple[Source, ...] = ("replay", "online")
_EMPTY: dict[Source, str] = {
    "replay": "cannot sample from an empty TrajectoryBuffer: no env has any stored step",
    "online": (
        "cannot sample from an empty online queue: no step was added to any env since the "
        "last `reset_online_queue()`"
    ),
}


class SequenceSample(NamedTuple):
    """What `TrajectoryBuffer.sample` and `sample_mixed` return: sequences and their mask.

    A named tuple, so `sequences, mask = buf.sample(...)` unpacks it.

    **Fields:**

    - `items`: the sequences, with the prototype's structure; each leaf of shape
        `(batch, T, *leaf_shape)`. Steps past the end of a window are zeros (`False` for
        booleans).
    - `mask`: boolean array of shape `(batch, T)`, `True` at the real stored steps.
    """

    items: PyTree[Shaped[Array, "batch seq ..."]]
    mask: Bool[Array, "batch seq"]


def _out_of_range(num_envs: int) -> str:
    return f"an env id is out of range; env ids must satisfy 0 <= env_id < num_envs = {num_envs}"


def _power_fault(power: Float[Array, ""], call: str) -> tuple[Bool[Array, ""], str]:
    return ~jnp.isfinite(power), f"`{call}`: `distribution_power` must be finite"


class TrajectoryBuffer(eqx.Module):
    """Per-env streams of steps, with a replay window and an online queue, sampled as sequences.

    Made for actors that step environments asynchronously, such as envpool's async mode, where
    every `recv()` returns a different subset of the envs. Each of the `num_envs` envs keeps
    its own stream of its last `max_length` steps, with its own write cursor, so envs advance
    independently. Two windows end at the newest step of each stream:

    - the *replay* window: every stored step of the env;
    - the *online* window (the online queue): the steps added since the last
        `reset_online_queue()`, at most `max_length`.

    Both share one storage: the online queue costs no memory.

    **Sampling.** `sample` draws `batch_size` sequences of `sequence_length = T` steps, with
    replacement, over all envs and start offsets together. In a window of `L` steps, the
    start offset `i` (`0 <= i < L`) has `r = min(L - i, T)` remaining steps and is drawn with
    probability proportional to `r ** distribution_power`: with `1.0` (the default) each
    start is weighted by the number of real steps it yields, with `0.0` all starts are
    equally likely. The sequence holds steps `i .. i + r - 1` of the window followed by
    `T - r` zero-filled steps; `mask[b, t]` is `t < r`. Sequences run across episode
    boundaries: store a `done` flag in the items to find them. A sample costs
    O(num_envs + batch_size · T), whatever `max_length` (the method is in
    `dejax_eqx/README.md`).

    **Errors.** Arguments that are known at trace time (`sequence_length > max_length`,
    `batch_size < 1`, a bad `source`, items that do not match the prototype) raise
    `ValueError`/`TypeError` at once. Faults in the data raise through `eqx.error_if`, eagerly
    and under `jit` alike: env ids out of range or repeated within one `add`, sampling an
    empty source, peeking at an env without steps. `EQX_ON_ERROR` chooses what happens
    instead (`raise` by default; see Equinox's `error_if`).

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
            seqs, mask = buf.sample_mixed(key, 12, 4, sequence_length=16)
            return buf, seqs, mask

        env_ids = np.array([5, 1, 6], np.int32)  # e.g. info["env_id"] from envpool's recv()
        steps = {"obs": jnp.ones((3, 4)), "reward": jnp.ones(3), "done": jnp.zeros(3, bool)}
        buf, seqs, mask = train_step(jax.random.key(0), buf, steps, env_ids)
        assert seqs["obs"].shape == (16, 16, 4) and mask.shape == (16, 16)
        assert buf.lengths().tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
        ```
    """

    data: PyTree[Shaped[Array, "num_envs max_length ..."]]
    head: Int[Array, " num_envs"]
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
        # Per env: the slot the next step goes to, in [0, max_length), and the lengths of the
        # two windows, in [0, max_length], with online_length <= replay_length. Nothing grows
        # without bound, however many steps pass through.
        self.head = jnp.zeros(self.num_envs, jnp.int32)
        self.replay_length = jnp.zeros(self.num_envs, jnp.int32)
        self.online_length = jnp.zeros(self.num_envs, jnp.int32)

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return spec_of(self.data, axes=2)

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
        of range or occurs twice.
        """
        call = "TrajectoryBuffer.add"
        items, n = check_items(self.item_spec, items, call, batched=True, what="batch of steps")
        assert n is not None
        if env_ids is None:
            if n != self.num_envs:
                raise ValueError(
                    f"`{call}`: without `env_ids` there must be one step for every env, but the "
                    f"batch of steps has {n} entries and num_envs is {self.num_envs}. Pass "
                    "`env_ids` to add steps for some envs only."
                )
            # Row e of every leaf takes step e at its own cursor: a vmapped one-step update,
            # which is one scatter whose env axis is a batch axis. Sharded along that axis,
            # every device writes its own envs' steps with no communication.
            write = jax.vmap(lambda row, y, h: lax.dynamic_update_index_in_dim(row, y, h, 0))
            data = jax.tree.map(lambda x, y: write(x, y, self.head), self.data, items)
            added = jnp.ones(self.num_envs, jnp.bool_)
            return self._advance(data, added)
        rows, bad = check_index(
            env_ids, self.num_envs, f"{call}(env_ids=...)", ndim=1, length=(n, "step")
        )
        if n == 0:
            return self
        counts = count_ids(rows, self.num_envs)
        # An id out of range is row `num_envs` and is dropped, so a bad call writes nothing
        # outside the arrays, whatever `EQX_ON_ERROR` says.
        cursors = jnp.take(self.head, rows, mode="fill", fill_value=0)
        data = jax.tree.map(lambda x, y: x.at[rows, cursors].set(y, mode="drop"), self.data, items)
        new = self._advance(data, counts > 0)
        # The guard sits on the new cursors and lengths, outputs every later use depends on,
        # not on the storage (threading it through `error_if` could force a copy).
        state = check_faults(
            (new.head, new.replay_length, new.online_length),
            [
                (bad, f"`{call}`: {_out_of_range(self.num_envs)}"),
                (
                    jnp.any(counts > 1),
                    f"`{call}`: an env id occurs more than once; each call adds at most one "
                    "step per env",
                ),
            ],
        )
        return eqx.tree_at(lambda b: (b.head, b.replay_length, b.online_length), new, state)

    def _advance(self: _TB, data: PyTree[Array], added: Bool[Array, " num_envs"]) -> _TB:
        m = self.max_length

        def grow(length):
            # `length < m` rather than `min(length + 1, m)`: nothing ever exceeds m.
            return jnp.where(added & (length < m), length + 1, length)

        head = jnp.where(added, ring_add(self.head, 1, m), self.head)
        return eqx.tree_at(
            lambda b: (b.data, b.head, b.replay_length, b.online_length),
            self,
            (data, head, grow(self.replay_length), grow(self.online_length)),
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
        distribution_power: Real[ArrayLike, ""] = 1.0,
        source: Source = "replay",
    ) -> SequenceSample:
        """Draw `batch_size` sequences, with replacement, from the replay windows or the online
        queue.

        A start (env `e`, offset `i`) in a window of `L_e` steps is drawn with probability
        proportional to `min(L_e - i, T) ** distribution_power` over all envs and offsets
        together (`T = sequence_length`). Envs with an empty window are never drawn.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: the number of sequences, a positive Python int (static).
        - `sequence_length`: `T`, a Python int in `[1, max_length]` (static).
        - `distribution_power`: a finite real exponent (default `1.0`; `0.0` makes every
            start equally likely). A traced scalar: pass it as a JAX array to change it
            between calls of a jitted function without recompiling (a Python float is a
            static argument of `eqx.filter_jit`).
        - `source`: `"replay"` (the default) or `"online"`.

        **Returns:** a `SequenceSample` `(items, mask)`. `items` has the prototype's structure,
        each leaf of shape `(batch_size, T, *leaf_shape)`; `mask` is a boolean
        `(batch_size, T)` array, `True` at the real steps. The masked steps of `items` are
        zeros (`False` for booleans).

        **Raises:** `ValueError`/`TypeError` at once for bad `batch_size`, `sequence_length` or
        `source`; an `eqx.error_if` error if the chosen source is empty in every env, or if
        `distribution_power` is not finite.
        """
        call = "TrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        sequence_length = self._check_sequence_length(sequence_length, call)
        source = check_choice(source, _SOURCES, f"{call}(source=...)")
        power = self._check_power(distribution_power, call)
        lengths = self.lengths(source)
        out = self._draw(key, lengths, batch_size, sequence_length, power)
        out = check_faults(
            out,
            [_power_fault(power, call), (jnp.all(lengths == 0), f"`{call}`: {_EMPTY[source]}")],
        )
        return SequenceSample(*out)

    def sample_mixed(
        self,
        key: PRNGKeyArray,
        replay_batch_size: int,
        online_batch_size: int,
        sequence_length: int,
        distribution_power: Real[ArrayLike, ""] = 1.0,
    ) -> SequenceSample:
        """Sequences from the replay windows and from the online queue, in one batch.

        The same as sampling `replay_batch_size` sequences with `source="replay"` and
        `online_batch_size` with `source="online"` (from two keys split from `key`) and
        concatenating them: replay rows first, then online rows.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `replay_batch_size`, `online_batch_size`: non-negative Python ints, not both zero.
            A part of size zero is not sampled, so its source may be empty.
        - `sequence_length`, `distribution_power`: as in `sample`, for both parts.

        **Returns:** a `SequenceSample` `(items, mask)` with a leading axis of
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
        sequence_length = self._check_sequence_length(sequence_length, call)
        power = self._check_power(distribution_power, call)
        keys: dict[Source, Array] = dict(zip(_SOURCES, jax.random.split(key)))
        parts = [
            self._draw(keys[source], self.lengths(source), size, sequence_length, power)
            for source, size in sizes.items()
            if size > 0
        ]
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        faults = [_power_fault(power, call)]
        faults += [
            (jnp.all(self.lengths(source) == 0), f"`{call}`: {_EMPTY[source]}")
            for source, size in sizes.items()
            if size > 0
        ]
        return SequenceSample(*check_faults(out, faults))

    def _check_sequence_length(self, sequence_length: int, call: str) -> int:
        name = f"{call}(sequence_length=...)"
        sequence_length = check_positive_int(sequence_length, name)
        if sequence_length > self.max_length:
            raise ValueError(
                f"`{name}` must be at most max_length = {self.max_length}, got "
                f"{sequence_length}: no env ever holds a longer sequence."
            )
        return sequence_length

    @staticmethod
    def _check_power(distribution_power: Real[ArrayLike, ""], call: str) -> Float[Array, ""]:
        power = jnp.asarray(distribution_power)
        if power.shape != ():
            raise ValueError(
                f"`{call}(distribution_power=...)` must be a scalar, got shape {power.shape}."
            )
        return power.astype(jnp.float32)

    def _draw(
        self,
        key: PRNGKeyArray,
        lengths: Int[Array, " num_envs"],
        batch_size: int,
        sequence_length: int,
        power: Float[Array, ""],
    ) -> tuple[PyTree[Shaped[Array, "batch seq ..."]], Bool[Array, "batch seq"]]:
        """Sample without run-time checks: starts from `_sequences.draw_starts`, then the
        gather. If every window is empty the result is meaningless (and nothing raises)."""
        env, offset, remaining = draw_starts(key, lengths, batch_size, sequence_length, power)
        m = self.max_length
        # The window starts `lengths[env]` steps behind the cursor; every term stays in [0, m].
        first = ring_add(ring_sub(self.head[env], lengths[env], m), offset, m)
        t = jnp.arange(sequence_length, dtype=jnp.int32)
        slots = ring_add(first[:, None], t[None, :], m)
        mask = t[None, :] < remaining[:, None]
        rows = env[:, None]

        def gather(x):
            seq = x.at[rows, slots].get(mode="promise_in_bounds")
            keep = mask.reshape(mask.shape + (1,) * (seq.ndim - 2))
            return jnp.where(keep, seq, jnp.zeros_like(seq))

        return jax.tree.map(gather, self.data), mask
