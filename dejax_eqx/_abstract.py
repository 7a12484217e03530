import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
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
    UInt32,
)

from ._checks import check_bool, check_positive_int
from ._episode_laws import WholeEpisode
from ._episodes import EpisodeInfo, Episodes
from ._faults import check_faults, Fault
from ._laws import AbstractLaw, draw_from, sample_with, split_union
from ._nstep import NStep
from ._policy_age import PolicyAge
from ._relabel import Relabel
from ._results import reports, Result
from ._streams import (
    check_newest,
    check_stale,
    check_stamps,
    check_write_back,
    checked_streams,
    episodes_of,
    Streams,
    WrittenBack,
)
from ._windows import Window


_B = TypeVar("_B", bound="AbstractBuffer")
_R = TypeVar("_R", bound="AbstractReplay")
_PR = TypeVar("_PR", bound="AbstractPrioritisedReplay")
_T = TypeVar("_T", bound="AbstractTrajectoryBuffer")

Source = Literal["replay", "online"]


class WindowPriorities(NamedTuple):
    """The priorities of the windows a buffer holds, as `window_priorities` gives them.

    **Fields:**

    - `start`, `held`, `mass`: per sum-tree leaf, each of shape `(num_envs,
        leaves_per_env)`: the start of the window it holds (or held last, or a negative
        number if none yet), whether that window is held (stored whole), and the leaf's mass
        (`priority ** priority_exponent`; 0 unless held).
    - `max_priority`: the largest priority recorded, a scalar.
    """

    start: Int[Array, "num_envs leaves"]
    held: Bool[Array, "num_envs leaves"]
    mass: Float[Array, "num_envs leaves"]
    max_priority: Float[Array, ""]


# What names the items of a replay's sample, for the calls that take them back: storage slots
# (`PrioritisedReplay`), or cluster ids and slots within a cluster (`ClusteredReplay`).
Indices = Integer[ArrayLike, " n"] | tuple[Integer[ArrayLike, " n"], Integer[ArrayLike, " n"]]


class AbstractBuffer(eqx.Module):
    """What every buffer of either family has for the layers over it: whether it is itself a
    layer, its shards (where a layer that counts per shard keeps its counts), and what a
    layer that keeps the buffer elsewhere (a `Dataset`) keeps besides its contents: the
    priorities of its windows and the counts of a rate-limited buffer (`None` where there
    are none). `AbstractReplay` and `AbstractTrajectoryBuffer` inherit it; a buffer type of
    your own inherits it through them.

    It also says how the buffer reports a fault (a fact that depends on data: an empty
    buffer, an index out of range): by raising (`throw=True`, the default of every
    constructor), or as a `Result` (`throw=False`; see `result` and `check`). A buffer of
    the library keeps its result in a field `result` (`None` with `throw=True`); a buffer
    type of your own without that field raises."""

    @property
    def throw(self) -> bool:
        """Whether faults raise (`True`) or are kept as `result` (`False`): a static fact of
        the buffer, fixed by its constructor's `throw`."""
        return getattr(self, "result", None) is None

    def with_result(self: _B, result: Result) -> _B:
        """The buffer holding `result` (a `throw=False` buffer's; for the library's
        methods, which keep the first fault)."""
        if self.throw:
            raise TypeError(f"`{type(self).__name__}.with_result`: the buffer raises its faults.")
        return eqx.tree_at(lambda b: b.result, self, result)  # pyright: ignore[reportAttributeAccessIssue]

    def with_throw(self: _B, throw: bool) -> _B:
        """This buffer, reporting its faults as `throw` says (see the constructors' `throw`):
        for a buffer made elsewhere (`dx.load`, a `Dataset`, the flashbax layer). A buffer
        that becomes `throw=False` starts with no fault; one that becomes `throw=True` drops
        the fault it held (check it first). A buffer type of your own without a `result`
        field only raises."""
        if check_bool(throw, f"{type(self).__name__}.with_throw(throw=...)") == self.throw:
            return self
        if not hasattr(self, "result"):
            raise TypeError(
                f"`{type(self).__name__}.with_throw`: this buffer type has no `result` field, "
                "so it can only raise its faults."
            )
        new = None if throw else Result.successful()
        return eqx.tree_at(lambda b: b.result, self, new, is_leaf=lambda x: x is None)  # pyright: ignore[reportAttributeAccessIssue]

    def check(self) -> None:
        """Raise the first fault this buffer holds, as `equinox.EquinoxRuntimeError` with
        the message `throw=True` would have raised at the faulty call; nothing if it holds
        none or raises its faults itself (`throw=True`). On the host, outside `jit`."""
        result = getattr(self, "result", None)
        if result is not None:
            result.check()

    @property
    def layered(self) -> bool:
        """Whether this is a layer that keeps state of its own over other buffers (a global
        buffer, a rate-limited one): such a buffer cannot be a shard or a cluster, whose
        copies would each keep that state. `False` for a buffer."""
        return False

    @property
    def num_shards(self) -> int:
        """How many shards the buffer is split into: 1 (a global buffer has one per device
        of its mesh axis). A layer that counts per shard (`RateLimited`) keeps one count per
        shard, where the shard is."""
        return 1

    def place_shards(self, x: Array) -> Array:
        """`x`, one row per shard, placed where the shards are (as it is, for one shard)."""
        return x

    def map_shards(self, fn: Callable[..., Any], per_shard: Any, shared: Any) -> Any:
        """`fn(rows, shared, axis, num_shards) -> (rows, shared)` on each shard, where it is:
        `per_shard` has one row per shard (leading axis `num_shards`, as `place_shards`
        places it) and `fn` gets this shard's; `shared` is the same everywhere; `axis` names
        the mesh axis of the shards for collectives inside `fn` (`None` for one shard). The
        rows `fn` returns keep a leading axis of 1, the `shared` it returns must be the same
        in every shard."""
        rows = jax.tree.map(lambda x: x[0], per_shard)
        return fn(rows, shared, None, 1)

    # --- what a layer that keeps a buffer elsewhere (a `Dataset`) keeps besides its steps --

    def priority_settings(self) -> dict[str, Any] | None:
        """What the masses of this buffer's windows depend on (`priority_exponent`, the
        window's `period` and size), read from the static configuration alone; `None` for a
        buffer whose windows carry no priorities."""
        return None

    def window_priorities(self) -> WindowPriorities | None:
        """The priorities of every window this buffer holds, and its largest priority; `None`
        for a buffer whose windows carry no priorities."""
        return None

    def with_window_priorities(
        self: _B,
        masses: Real[ArrayLike, "num_envs leaves"],
        *,
        max_priority: Real[ArrayLike, ""],
    ) -> _B:
        """The buffer with the masses of the windows it holds set, as `window_priorities`
        gives them (`NaN`: none known, the window gets the mass of `max_priority`), and
        `max_priority`.

        **Raises:** `TypeError` for a buffer whose windows carry no priorities.
        """
        name = type(self).__name__
        raise TypeError(f"`{name}.with_window_priorities`: a {name} has no priorities.")

    def counts(self) -> tuple[int, int] | None:
        """The inserts and samples a rate-limited buffer has counted, or `None` for a buffer
        that counts nothing."""
        return None

    def with_counts(self: _B, counts: tuple[int, int] | None) -> _B:
        """The buffer with counts that were kept elsewhere (a `Dataset`'s record of a
        rate-limited buffer; `None`: none were kept). A buffer that counts nothing is
        returned as it is."""
        return self


class AbstractReplay(AbstractBuffer):
    """The surface every replay buffer shares, and the law every layer draws it by.

    A replay stores items (pytrees of arrays with the prototype's structure, shapes and dtypes)
    up to a fixed capacity and samples batches of them. It is an immutable `eqx.Module`: every
    method returns a new replay, and under `eqx.filter_jit(donate="all")` that copy is an
    in-place update.

    Each replay states how it draws through `law`: an `AbstractLaw` that says what can be
    drawn, with what weight, how a row is read and named. `sample` evaluates it over the
    replay; the layers evaluate the same law over a union of replays (a `GlobalReplay`'s
    shards, a `ClusteredReplay`'s clusters) and reweigh it by policy age. So a replay type
    added later is sampled, clustered, aged, spread over processes, rate-limited and served by
    implementing these methods, with no change to the layers.

    Concrete replays (`UniformReplay`, ...) are final: they are not meant to be subclassed.
    New behaviour comes by composition (`ClusteredReplay` wraps any `AbstractReplay`).
    """

    @property
    @abc.abstractmethod
    def max_size(self) -> int:
        """The capacity: the most items the replay holds (a static Python int)."""

    @property
    @abc.abstractmethod
    def size(self) -> Int[Array, ""]:
        """The number of stored items, an int32 scalar array in `[0, max_size]`."""

    @property
    @abc.abstractmethod
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shapes and dtypes of one item, as `jax.ShapeDtypeStruct` leaves.

        Known at trace time. Wrappers (`ClusteredReplay`) check their items against it.
        """

    @abc.abstractmethod
    def add(self: _R, item: PyTree[ArrayLike]) -> _R:
        """Store one item; when full, the oldest item is overwritten.

        **Arguments:**

        - `item`: a pytree with the prototype's structure, shapes and dtypes. Python scalars are
            converted to the stored dtype; arrays must have it already.

        **Returns:** the new replay.

        **Raises:** `ValueError`/`TypeError` at trace time if `item` does not match the prototype.
        """

    @abc.abstractmethod
    def add_batch(
        self: _R, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _R:
        """Store `n` items at once; the same as `n` calls to `add`, in order.

        One vectorised write, also when `n > max_size` (then only the last `max_size` items
        remain, as after `n` adds).

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis of the same length `n`.
        - `mask`: optional boolean array of shape `(n,)`: only the items where it is `True`
            are added, in order, as if the others were not in the batch. Shapes stay static
            under `jit` while the number of valid items varies.

        **Returns:** the new replay.
        """

    @abc.abstractmethod
    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """How this replay draws: the law that `sample` evaluates over the replay, and that
        the layers evaluate over a union of replays of its configuration. Checks the
        arguments (as `sample` documents them) and returns the law and the faults of the
        arguments' values, each message quoting `call`.
        """

    @reports
    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
    ) -> Any:
        """Draw `batch_size` stored items at random, with replacement, by the replay's law.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: a positive Python int (static: each value compiles once).
        - `age`: a `PolicyAge`: draw only among the items young enough, reweighed by age
            (see `PolicyAge`); the sample is then an `AgedSample`. O(max_size) per call, where
            a plain sample is O(batch_size) (O(batch_size · log max_size) prioritised).
        - `beta`: the importance-weight exponent `β >= 0` (may be traced; default 1) of the
            weights an aged sample returns. Only with `age`: a plain prioritised sample
            returns probabilities, for `importance_weights`.

        **Returns:** the sampled items, each leaf with a leading `batch_size` axis (replays
        that return more than items document their own result type), or an `AgedSample`.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments; an
        `eqx.error_if` error if nothing can be drawn (an empty replay), and for the faults of
        each replay's law and of `age`.
        """
        call = f"{type(self).__name__}.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        law, faults = self.law(age=age, beta=beta, call=call)
        return sample_with(law, self, key, batch_size, faults, call)

    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """`sample` without its run-time checks; `batch_size` must be a positive Python int.

        On an empty replay the result has the right structure, shapes and dtypes but
        meaningless values, and nothing raises.
        """
        law, _ = self.law(call=f"{type(self).__name__}.sample_unchecked")
        return draw_from(law, self, key, batch_size)[0]

    @abc.abstractmethod
    def update(self: _R, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _R:
        """Apply `fn(item) -> item` to every stored item.

        `fn` is vectorised over the stored items and must keep each item's structure, shapes
        and dtypes (checked at trace time).
        """

    @reports
    def add_and_sample(
        self: _R, items: PyTree[ArrayLike], key: PRNGKeyArray, batch_size: int
    ) -> tuple[_R, Any]:
        """`add_batch(items)`, then `sample(key, batch_size)` from the result, in one call.

        **Returns:** `(replay, batch)`.
        """
        replay = self.add_batch(items)
        return replay, replay.sample(key, batch_size)

    # --- names: what a sample's `indices` are, for the calls that take them back -------------

    def split_indices(self, indices: Indices) -> tuple[Int[Array, " n"], Any]:
        """For indices into a union of replays of this configuration (a `GlobalReplay`'s
        shards, where shard `k`'s index `i` is `k · max_size + i`): the replay of each entry,
        and its index in that replay. How a layer routes `set_priorities` and `stale` to the
        replay that owns each entry. `indices` are in range (checked by the caller)."""
        assert not isinstance(indices, tuple)
        return split_union(jnp.asarray(indices), self.max_size)

    def set_priorities(
        self: _R,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _R:
        """Set the priorities of the sampled items named by `indices` (a prioritised replay's:
        see `AbstractPrioritisedReplay.set_priorities`).

        **Raises:** `TypeError` at once for a replay without priorities.
        """
        raise TypeError(
            f"`{type(self).__name__}.set_priorities`: a {type(self).__name__} has no priorities."
        )

    def note_priorities(
        self: _R,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _R:
        """The replay with `max_priority` raised as `set_priorities(indices, priorities,
        mask=mask)` would raise it, and nothing set: for a layer that sets each entry on the
        replay that owns it and keeps every replay's largest priority equal (a
        `GlobalReplay`). The entries are checked by the call that sets them. A replay
        without priorities is returned as it is."""
        return self

    @reports
    def stale(
        self,
        indices: Indices,
        generations: UInt32[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Bool[Array, " n"]:
        """Which sampled items have been written since they were sampled (a prioritised
        replay's: see `PrioritisedReplay.stale`).

        **Raises:** `TypeError` at once for a replay without write generations.
        """
        raise TypeError(
            f"`{type(self).__name__}.stale`: a {type(self).__name__} keeps no write generations."
        )


class AbstractPrioritisedReplay(AbstractReplay):
    """A replay whose items carry priorities that the learner updates after sampling.

    Its `sample` returns the storage slots of the sampled items (as `indices`), and
    `set_priorities` takes them back. `ClusteredReplay` routes priority updates to a
    prioritised inner replay through this interface.
    """

    @abc.abstractmethod
    def set_priorities(
        self: _PR,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _PR:
        """Set the priorities of the items in slots `indices`.

        An index may occur more than once (a batch sampled with replacement often repeats an
        item); then the last occurrence wins.

        **Arguments:**

        - `indices`: integer array of shape `(n,)`, storage slots of stored items, as returned
            by `sample`.
        - `priorities`: array of shape `(n,)`, finite and non-negative.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are set (and checked); the others may hold anything.
        - `generations`: optional uint32 array of shape `(n,)`, the `generations` of the
            sample the indices came from: an entry whose slot has been written since that
            sample is ignored (it would give a new item the priority computed for the old one).
            `stale(indices, generations)` tells which entries those are.

        **Returns:** the new replay.

        **Raises:** an `eqx.error_if` error if an index is not a stored slot
        (`0 <= index < size`) or a priority is negative, infinite or NaN.
        """


class AbstractTrajectoryBuffer(AbstractBuffer):
    """The surface every trajectory buffer shares: per-env streams of steps.

    Made for actors that step environments asynchronously, such as envpool's async mode, where
    every `recv()` returns a different subset of the envs, and for rollouts collected in
    lock-step. Each of `num_envs` envs keeps its own stream of its last `max_length` steps,
    with its own write cursor, so envs advance independently. Every step has an absolute
    number in its env's stream (0 for the first step ever added; `step_count[e]` steps so far),
    which aligns periods and names sampled windows: a window is named by its *stamp*
    `(env, start)`.

    The streams are a `Streams` module (`streams`); each buffer adds its own state and its
    own way of reading them. Concrete trajectory buffers (`TrajectoryBuffer`,
    `PrioritisedTrajectoryBuffer`, `TrajectoryQueue`) are final: they are not meant to be
    subclassed.
    """

    streams: eqx.AbstractVar[Streams]

    @property
    def num_envs(self) -> int:
        """The number of envs (streams), a static Python int."""
        return self.streams.num_envs

    @property
    def max_length(self) -> int:
        """The number of steps each env keeps, a static Python int."""
        return self.streams.max_length

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return self.streams.item_spec

    @property
    def data(self) -> PyTree[Array]:
        """The stored steps: each leaf of the prototype with two leading axes `(num_envs,
        max_length)`, each row in ring order (read-only; `streams.data`)."""
        return self.streams.data

    @property
    def step_count(self) -> Int[Array, "*batch num_envs"]:
        """Per env, the number of steps ever added: an int32 array of shape `(num_envs,)`."""
        return self.streams.step_count

    @property
    def head(self) -> Int[Array, "*batch num_envs"]:
        """Each env's write cursor: the slot its next step goes to, `step_count mod
        max_length`, an int32 array of shape `(num_envs,)`."""
        return self.streams.head

    @abc.abstractmethod
    def add(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
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

    @abc.abstractmethod
    def extend(
        self: _T, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _T:
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

        **Raises:** as `add`.
        """

    @abc.abstractmethod
    def with_streams(self: _T, streams: Streams) -> _T:
        """This buffer's configuration holding `streams` (of the same `num_envs`,
        `max_length` and steps): what depends on the steps is made afresh from them (an empty
        online queue, no unread step, every stored window at the largest priority).

        For buffers restored from elsewhere (`Dataset.load`, `Streams.restore`). Only the
        static configuration of `self` is used, so it may come from `eqx.filter_eval_shape`.

        **Raises:** `ValueError` at once if `streams` has another configuration.
        """

    @reports
    def peek(
        self,
        env_ids: Integer[ArrayLike, "*n"] | None = None,
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> PyTree[Array]:
        """The newest step of each listed env (in an actor loop: the latest observation of
        the envs just returned).

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape (a scalar
            gives one step); repeats are allowed. `None` (the default) means every env.
        - `mask`: optional boolean array of the shape of `env_ids`: only the entries where it
            is `True` are checked (the steps of the others are meaningless).

        **Returns:** the steps, each leaf with the shape of `env_ids` in front of the
        prototype's shape.

        **Raises:** an `eqx.error_if` error if an env id is out of range or a listed env has
        no stored step.
        """
        call = f"{type(self).__name__}.peek"
        return check_faults(*check_newest(self.streams, env_ids, call, mask=mask))

    @reports
    def stale(
        self,
        env_ids: Integer[ArrayLike, "*n"],
        starts: Integer[ArrayLike, "*n"],
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> Bool[Array, "*n"]:
        """Whether the windows named by stamps `(env, start)` have lost steps since.

        A window is stale once its first step has been dropped to make room for a newer one
        (the first step goes first, so then the window's other stored steps may follow).
        Steps added after the newest step of a window do not make it stale. A prioritised
        buffer drops the priority updates of stale windows.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape.
        - `starts`: an integer array of the same shape: absolute step numbers, as
            `SequenceSample.start` and `Transitions.start` give them.
        - `mask`: optional boolean array of the same shape: only the entries where it is
            `True` are checked and answered (the others answer `False`).

        **Returns:** a boolean array of the shape of `env_ids`.

        **Raises:** `ValueError`/`TypeError` at once if the shapes differ or an argument is not
        an integer array; an `eqx.error_if` error if an env id is out of range or a start is
        not a step its env has taken (negative, or at least its `step_count`).
        """
        call = f"{type(self).__name__}.stale"
        return check_faults(*check_stale(self.streams, env_ids, starts, call, mask=mask))

    @property
    def episodes(self) -> Episodes | None:
        """How this buffer tells episodes apart (the `Episodes` it was made with), or `None`
        if it keeps no episodes."""
        return self.streams.episodes

    @reports
    def episodes_of(
        self, env_ids: Integer[ArrayLike, "*n"], steps: Integer[ArrayLike, "*n"]
    ) -> EpisodeInfo:
        """Where the episodes of stored steps `(env, step)` began and ended, in O(1) per
        step, from the bookkeeping a buffer made with `episodes=` keeps.

        **Arguments:**

        - `env_ids`: an integer array of env ids in `[0, num_envs)`, of any shape.
        - `steps`: an integer array of the same shape: absolute step numbers of stored steps
            (as `SequenceSample.start` gives them).

        **Returns:** an `EpisodeInfo` of arrays of the shape of `env_ids`.

        **Raises:** `TypeError` at once for a buffer made without `episodes`;
        `ValueError`/`TypeError` at once for arrays of other shapes or dtypes; an
        `eqx.error_if` error if an env id is out of range, a step is not one its env has
        taken, or a step is no longer stored.
        """
        call = f"{type(self).__name__}.episodes_of"
        if self.streams.book is None:
            raise TypeError(
                f"`{call}`: this buffer keeps no episodes; make it with `episodes=dx.Episodes"
                "(done=..., autoreset=...)`."
            )
        stamps = check_stamps(self.streams, env_ids, steps, call)
        faults = [
            *stamps.faults,
            (
                ~stamps.bad & stamps.stale,
                f"`{call}`: a step is no longer stored; a newer step took its slot",
            ),
        ]
        return check_faults(episodes_of(self.streams, stamps.env, stamps.start), faults)

    @reports
    def write_back(
        self: _T,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        values: Mapping[str, PyTree[ArrayLike]],
        *,
        mask: Bool[ArrayLike, "n T"] | None = None,
    ) -> tuple[_T, WrittenBack]:
        """Write per-step values into the stored steps a sample read (a learner's recurrent
        states or latents, as R2D2's stored state and DreamerV3's replay context do): row
        `i`'s value `t` goes to step `starts[i] + t` of env `env_ids[i]`, if that step is
        still stored. An entry whose step has since been overwritten (or was never taken) is
        dropped, and reported: the stamps say exactly which, so a value never lands on a
        step it was not computed from. Where rows of one call share a step, the later row
        wins (DreamerV3's rule). Only the keys of `values` change; nothing else (counters,
        priorities, episodes) does. Inside a donated `jit` the write is in place.

        **Arguments:**

        - `env_ids`, `starts`: integer arrays of shape `(n,)`, stamps as a sample gives them
            (`sample.env`, `sample.start`).
        - `values`: a dict of keys of the (dict) step, each with that key's structure and
            leaves of shape `(n, T, *leaf_shape)` in the stored dtype (nothing is cast):
            the values of `T <= max_length` steps from each start (`T = 1` for the first step
            of each window).
        - `mask`: optional boolean array `(n, T)`: only the entries where it is `True` are
            written (pass `sample.mask[:, :T]` so that padded steps write nothing), and a
            row with none is not checked (its stamp may be anything).

        **Returns:** `(buffer, WrittenBack)`: the new buffer, and per entry whether it was
        written or dropped (`WrittenBack.num_dropped`).

        **Raises:** `ValueError`/`TypeError` at once for `values` that do not match the step
        (a key it lacks, a shape, a dtype) or stamps of another shape; an `eqx.error_if`
        error if an env id is out of range or a start is not a step its env has taken.
        """
        call = f"{type(self).__name__}.write_back"
        streams, report, faults = check_write_back(
            self.streams, env_ids, starts, values, mask, call
        )
        return self.with_written(streams), check_faults(report, faults, order_reads=False)

    def with_written(self: _T, streams: Streams) -> _T:
        """This buffer holding `streams`, which differ from its own only in stored values
        (`write_back`): nothing made from the steps is made afresh.

        **Raises:** `TypeError` at once for a buffer that takes no write-back."""
        name = type(self).__name__
        raise TypeError(f"`{name}.write_back`: a {name} takes no write-back.")

    # --- the law: how this buffer draws, for `sample` and for every layer ---------------------

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
        call: str = "",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """How this buffer draws `what` (with the options `sample` documents): the law that
        `sample` evaluates over the buffer, and that the layers evaluate over a union of
        buffers of its configuration (a `GlobalTrajectoryBuffer`'s shards). Checks the
        arguments, and returns the law and the faults of their values, each message quoting
        `call`.

        **Raises:** `TypeError` at once for a buffer that is not sampled (a `TrajectoryQueue`
        is read with `pop`).
        """
        name = type(self).__name__
        raise TypeError(
            f"`{call or name + '.sample'}`: a {name} is not sampled; read it with `pop`."
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
        """Draw `batch_size` rows, with replacement, by this buffer's law for `what`.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: the number of rows, a positive Python int (static).
        - `what`: what a row is: a `Window` (static) for windows, as a `SequenceSample`; an
            `NStep` (static) for n-step transitions, as `Transitions`; a `WholeEpisode`
            (static) for whole episodes, as an `EpisodeSample`. A prioritised buffer
            draws its own window (`None`, or a `Window` of the same parts that masks
            episode ends otherwise).
        - `distribution_power`: windows of a `TrajectoryBuffer`: a start whose window holds
            `r` real steps weighs `r ** distribution_power` (default 1.0; 0.0 makes every
            admissible start equally likely; no effect with a strict window). A finite real
            scalar; traced (pass a JAX array to change it without recompiling).
        - `source`: a `TrajectoryBuffer`'s windows to draw from: `"replay"` (every stored
            step, the default) or `"online"` (the online queue), or a mapping of both to the
            number of rows each gives, in that order, which must add up to `batch_size`
            (`{"replay": 24, "online": 8}`: a source of 0 rows is not drawn from, and may be
            empty).
        - `discount`: for an `NStep`, the per-step discount, a real scalar in `[0, 1]`
            (traced).
        - `beta`: the importance-weight exponent `β >= 0` (traced; default 1) of the weights
            a prioritised sample or an aged sample returns.
        - `age`: a `PolicyAge`: draw only among the rows young enough (a window is as old as
            its first step), reweighed by age; the sample is then an `AgedSample` of the rows.
            O(num_envs · max_length) per call.

        **Returns:** what the buffer's law gives: a `SequenceSample`, `Transitions`, a
        `PrioritisedSequenceSample`, or an `AgedSample` of one of those.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments (an option
        that does not apply to this buffer or to `what`, a window these streams cannot
        hold); an `eqx.error_if` error if nothing can be drawn, and for the faults of the
        arguments' values.
        """
        call = f"{type(self).__name__}.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        law, faults = self.law(
            what,
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
            call=call,
        )
        return self.sample_by(law, key, batch_size, faults, call)[1]

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
        """`batch_size` rows drawn by `law` (this buffer's, from `law(...)`, or one made over
        it), the `faults` of its arguments and of the draw checked: what `sample` does, for
        the layers that draw by a law of their own making (a mixture's part). `rows`: how
        many of the rows are used (traced; a layer that counts samples counts those).

        **Returns:** `(buffer, sample)`: the buffer after the draw (a layer that counts
        samples has counted them; otherwise this buffer) and the sample."""
        return self, sample_with(law, self, key, batch_size, faults, call)

    # --- names: env ids, for the calls that take stamps back ---------------------------------

    def split_envs(self, env_ids: Int[Array, "*n"]) -> tuple[Int[Array, "*n"], Int[Array, "*n"]]:
        """For env ids of a union of buffers of this configuration (a
        `GlobalTrajectoryBuffer`'s shards, where shard `k`'s env `e` is `k · num_envs + e`):
        the buffer of each entry, and its env there. In-range ids (checked by the caller)."""
        return split_union(env_ids, self.num_envs)

    def read(
        self,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        window: Window,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Any:
        """The windows named by stamps `(env_ids, starts)`, read again (a `TrajectoryBuffer`'s:
        see `TrajectoryBuffer.read`).

        **Raises:** `TypeError` at once for a buffer that does not read windows by stamp.
        """
        name = type(self).__name__
        raise TypeError(f"`{name}.read`: a {name} does not read windows by stamp.")

    def pop(self: _T, sequence_length: int) -> tuple[PyTree[Array], _T]:
        """Remove and return the oldest unread steps of every env (a `TrajectoryQueue`'s: see
        `TrajectoryQueue.pop`).

        **Raises:** `TypeError` at once for a buffer that is sampled, not read once.
        """
        name = type(self).__name__
        raise TypeError(f"`{name}.pop`: a {name} is sampled (`sample`), not read once.")

    def can_pop(self, length: int) -> Bool[Array, ""]:
        """Whether `pop(length)` may run (a `TrajectoryQueue`'s).

        **Raises:** `TypeError` at once for a buffer that is sampled, not read once.
        """
        name = type(self).__name__
        raise TypeError(f"`{name}.can_pop`: a {name} is sampled (`sample`), not read once.")

    def set_priorities(
        self: _T,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _T:
        """Set the priorities of the windows named by stamps (a prioritised buffer's: see
        `PrioritisedTrajectoryBuffer.set_priorities`).

        **Raises:** `TypeError` at once for a buffer without priorities.
        """
        name = type(self).__name__
        raise TypeError(f"`{name}.set_priorities`: a {name} has no priorities.")

    def note_priorities(
        self: _T,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _T:
        """The buffer with `max_priority` raised as `set_priorities` would raise it, and
        nothing set (see `AbstractReplay.note_priorities`); a buffer without priorities as it
        is."""
        return self

    def _check_streams(self, streams: Streams, call: str) -> Streams:
        """`streams` if it has this buffer's configuration, else an error quoting `call`."""
        return checked_streams(
            streams,
            self.num_envs,
            self.max_length,
            self.item_spec,
            call,
            self.streams.episodes,
            self.streams.written_back,
        )
