"""`RateLimited`: a buffer and its `RateLimiter`, counting every insert and sample through it.

A rate-limited replay is a replay and a rate-limited trajectory buffer a trajectory buffer
(`RateLimitedReplay`, `RateLimitedTrajectoryBuffer`: `dx.RateLimited(buffer, limiter)` makes
the one of the buffer's family), so every layer over a family takes it as it is, and it wraps
any member of its family, a global buffer included. What it counts is stated once, here:

- an insert counts one unit per item of a replay, one per step of a trajectory buffer;
- a sample counts its rows (`batch_size`); a trajectory queue's `pop` one row per env.

**Across shards.** Over a buffer of several shards (a global buffer, whose shards may be in
several processes), each shard counts the units of its own block of every insert where it is,
with no collective, in `pending`; every sample then folds them into the limiter's counts, by
one all-reduce of a word per shard in the sample's program. So a sample is judged by the exact
global counts, and an insert, which sees only its own shard, by the shard's share of the law:
it may proceed if the balance stays within `max_diff` *as if every shard had inserted what
this one did* since the last sample (summed over the shards, that keeps the global balance
within `max_diff`). With equal blocks, as `rows` makes them, that is the law exactly.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import (
    Array,
    ArrayLike,
    Bool,
    Int,
    Integer,
    PRNGKeyArray,
    PyTree,
    Real,
    Shaped,
    UInt32,
)

from ._abstract import (
    AbstractReplay,
    AbstractTrajectoryBuffer,
    Indices,
    Source,
    WindowPriorities,
)
from ._checks import check_nonnegative_int, check_positive_int
from ._episode_laws import WholeEpisode
from ._faults import check_faults, collect_faults, Fault, is_recording, vetoing
from ._int64 import add_product, less_equal
from ._laws import AbstractLaw
from ._nstep import NStep
from ._policy_age import PolicyAge
from ._rate_limiter import (
    checked_amount,
    checked_limiter,
    count_inserts,
    count_samples,
    folded_inserts,
    RateLimiter,
)
from ._rates import Rate
from ._relabel import Relabel
from ._results import inherited_result, reports, Result
from ._streams import Streams
from ._windows import Window


_W = TypeVar("_W", bound="RateLimited")
_RR = TypeVar("_RR", bound="RateLimitedReplay")
_RT = TypeVar("_RT", bound="RateLimitedTrajectoryBuffer")


class _ByFamily(type(eqx.Module)):
    """`RateLimited(buffer, limiter)` makes the member of the buffer's family."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is RateLimited:
            buffer = args[0] if args else kwargs.get("buffer")
            if isinstance(buffer, AbstractReplay):
                cls = RateLimitedReplay
            elif isinstance(buffer, AbstractTrajectoryBuffer):
                cls = RateLimitedTrajectoryBuffer
            else:
                raise TypeError(
                    "`RateLimited(buffer=...)` must be a buffer of dejax_eqx (a replay or a "
                    f"trajectory buffer), got {type(buffer).__name__}."
                )
        return super().__call__(*args, **kwargs)


class RateLimited(eqx.Module, metaclass=_ByFamily):
    """A buffer and its `RateLimiter`, which counts every insert and sample through it.

    `RateLimited(buffer, limiter)` is a member of the buffer's family: a `RateLimitedReplay`
    (an `AbstractReplay`) for a replay, a `RateLimitedTrajectoryBuffer` (an
    `AbstractTrajectoryBuffer`) for a trajectory buffer; `isinstance(x, dx.RateLimited)`
    holds for both. The wrapped buffer behaves exactly as it does alone (the same key gives
    the same sample); each method forwards to it and counts what it did, raising
    (`eqx.error_if`) when the law does not allow it: call `can_insert`/`can_sample` (or the
    budgets) first. A sample returns `(limited, sample)`, the new `RateLimited` first.

    **Units.** Inserts are counted in *items* for a replay and in *steps* for a trajectory
    buffer: `add` of `n` envs' steps counts `n`, `extend` of `T` steps of `n` envs `n * T`.
    Samples are counted in *rows*: the items, windows or transitions a sample returns
    (`batch_size`); a trajectory queue's `pop` counts one per env. So `samples_per_insert`
    is rows per step for a trajectory buffer: an R2D2 learner that, as with Reverb, samples
    each sequence of period `P` (one inserted every `P` steps) about 4 times sets
    `samples_per_insert = 4 / P`, and `min_size_to_sample` in steps.

    | method | counts |
    | --- | --- |
    | `add(item)` (replay) | 1 insert |
    | `add_batch(items, mask=None)` (replay) | `n` inserts, or `mask.sum()` |
    | `add(items, env_ids=None)` (trajectory buffer) | 1 per listed env |
    | `extend(items, env_ids=None)` (trajectory buffer) | envs × `T` |
    | `sample(key, batch_size, ...)` | `batch_size` rows |
    | `pop(sequence_length)` (trajectory queue) | `num_envs` rows |
    | `set_priorities`, `update`, queries | nothing |

    **Over a global buffer** (`GlobalReplay`, `GlobalTrajectoryBuffer`): every shard counts
    its own block of every insert, where it is, and every sample folds those counts into
    the limiter's with one all-reduce in the sample's own program: a sample is judged by the
    exact global counts, and an insert by its shard's share of the law (the balance it would
    leave if every shard had inserted as much as this one since the last sample). See the
    guide, "Actors and learners across processes".

    For a change that is not counted (`reset_online_queue`, ...), replace the buffer:
    `limited.with_buffer(limited.buffer.reset_online_queue())`. A `RateLimited` is a layer: it
    cannot be a shard of a global buffer or a cluster (its counts would be kept once per
    copy); wrap the outermost buffer.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        buf = dx.UniformReplay({"obs": jnp.zeros(2)}, max_size=1000)
        limiter = dx.RateLimiter.sample_to_insert_ratio(
            2, min_size_to_sample=10, error_buffer=16, insert_batch_size=4, sample_batch_size=8
        )
        limited = dx.RateLimited(buf, limiter)
        assert isinstance(limited, dx.AbstractReplay)
        while not limited.can_sample(8):
            limited = limited.add_batch({"obs": jnp.ones((4, 2))})
        limited, batch = limited.sample(jax.random.key(0), 8)
        assert batch["obs"].shape == (8, 2) and limited.counts() == (12, 8)
        ```
    """

    buffer: eqx.AbstractVar[Any]
    limiter: eqx.AbstractVar[RateLimiter]
    pending: eqx.AbstractVar[UInt32[Array, " shards"]]

    @property
    def num_shards(self) -> int:
        """The wrapped buffer's number of shards (one count each)."""
        return self.buffer.num_shards

    def place_shards(self, x: Array) -> Array:
        return self.buffer.place_shards(x)

    def map_shards(self, fn: Callable[..., Any], per_shard: Any, shared: Any) -> Any:
        return self.buffer.map_shards(fn, per_shard, shared)

    @property
    def rate(self) -> Rate:
        """The law (`limiter.rate`)."""
        return self.limiter.rate

    @property
    def layered(self) -> bool:
        """A `RateLimited` is a layer: it cannot be a shard or a cluster."""
        return True

    # --- the law ------------------------------------------------------------------------

    @reports
    def can_insert(self, n: Integer[ArrayLike, ""] = 1) -> Bool[Array, ""]:
        """Whether an insert of `n` units may proceed now (`limiter.can_insert`). Over a
        buffer of several shards, whether every shard may take its equal block of the insert
        (`n / num_shards` units) by its share of the law: one all-reduce, the same verdict in
        every process."""
        if self.pending.shape[0] == 1:
            return self.limiter.can_insert(n)
        call = "RateLimited.can_insert"
        units = _blocks(n, self.pending.shape[0], call)
        shared = (self.limiter, units)
        return self.buffer.map_shards(_share_allows, (self.pending,), shared)[1]

    @reports
    def can_sample(self, n: Integer[ArrayLike, ""] = 1) -> Bool[Array, ""]:
        """Whether a sample of `n` rows may proceed now (`limiter.can_sample`), by the exact
        counts (over a buffer of several shards: one all-reduce, in every process)."""
        if self.pending.shape[0] == 1:
            return self.limiter.can_sample(n)
        limiter = self._folded("RateLimited.can_sample")
        return limiter.can_sample(n)

    @reports
    def sample_budget(self, batch_size: int = 1) -> Int[Array, ""]:
        """`limiter.sample_budget(batch_size)`, by the exact counts (see `can_sample`)."""
        return self._folded("RateLimited.sample_budget").sample_budget(batch_size)

    @reports
    def insert_budget(self, batch_size: int = 1) -> Int[Array, ""]:
        """`limiter.insert_budget(batch_size)`, by the counts as of the last sample."""
        return self._folded("RateLimited.insert_budget").insert_budget(batch_size)

    def counts(self) -> tuple[int, int]:
        """`(inserts, samples)` so far, exact, as Python ints (over a buffer of several
        shards, with every shard's pending inserts: one all-reduce, in every process)."""
        return self._folded("RateLimited.counts").counts()

    def _counted(self: _W, counts: tuple[int, int] | None) -> _W:
        """This `RateLimited` with the counts `(inserts, samples)` (kept elsewhere: a
        `Dataset`'s record), and no pending inserts.

        **Raises:** `ValueError` for `None` (no counts were kept: wrap the buffer with a
        limiter of the counts you choose).
        """
        if counts is None:
            raise ValueError(
                "`RateLimited.with_counts`: no counts were kept (the dataset's last write was "
                "from a buffer without a limiter, or before datasets recorded them). Load the "
                "buffer alone, and wrap it with a limiter of the counts you choose: "
                "`RateLimited(buffer, limiter.with_counts(inserts, samples))`."
            )
        limiter = self.limiter.with_counts(*counts)
        pending = self.place_shards(jnp.zeros(self.num_shards, jnp.uint32))
        return eqx.tree_at(lambda r: (r.limiter, r.pending), self, (limiter, pending))

    def with_buffer(self: _W, buffer: Any) -> _W:
        """This `RateLimited` around `buffer` (of the same type and configuration), its
        counts unchanged: for a change that is not counted (`reset_online_queue`, ...)."""
        if type(buffer) is not type(self.buffer):
            raise TypeError(
                f"`RateLimited.with_buffer`: expected a {type(self.buffer).__name__}, got a "
                f"{type(buffer).__name__}."
            )
        return eqx.tree_at(lambda r: r.buffer, self, buffer)

    # --- counting -----------------------------------------------------------------------

    def _insert(
        self: _W,
        write: Callable[[], Any],
        units: int | Int[Array, "*shards"],
        call: str,
        total: int | None,
    ) -> _W:
        """This `RateLimited` after the insert `write()` (the buffer's add) of `units`, counted
        as `_inserted` counts. Inside a recording call (`throw=False`) the law judges the
        insert first: one it refuses writes nothing and counts nothing."""
        if not is_recording():
            return self._inserted(write(), units, call, total)
        counted, faults = collect_faults(lambda: self._inserted(self.buffer, units, call, total))
        with vetoing(faults):
            buffer = write()
        counts = check_faults(
            (counted.limiter, counted.pending), faults, safe=(self.limiter, self.pending)
        )
        return eqx.tree_at(lambda r: (r.buffer, r.limiter, r.pending), self, (buffer, *counts))

    def _inserted(
        self: _W, buffer: Any, units: int | Int[Array, "*shards"], call: str, total: int | None
    ) -> _W:
        """This `RateLimited` around `buffer`, after an insert of `units` (per shard, over
        several: see `_per_shard`), of `total` units in all where that is static."""
        if self.pending.shape[0] == 1:
            limiter = count_inserts(self.limiter, units, call)
            return eqx.tree_at(lambda r: (r.buffer, r.limiter), self, (buffer, limiter))
        assert not isinstance(units, int), "over several shards, the units are per shard"
        if total is not None:  # refused at once, as for one shard
            checked_amount(total, self.limiter.insert_batch_size, call, "insert", "items")
        shared = (self.limiter, units, call)
        (pending,), _ = buffer.map_shards(_count_share, (self.pending,), shared)
        return eqx.tree_at(lambda r: (r.buffer, r.pending), self, (buffer, pending))

    def _sampled(self: _W, rows: int | Int[Array, ""], call: str) -> _W:
        """This `RateLimited` after a sample of `rows` rows, checked by the exact counts (a
        traced count of 0 is no sample, and never refused)."""
        if self.pending.shape[0] == 1:
            limiter = count_samples(self.limiter, rows, call, some=not isinstance(rows, int))
            return eqx.tree_at(lambda r: r.limiter, self, limiter)
        shared = (self.limiter, rows, call)
        (pending,), limiter = self.buffer.map_shards(_fold_and_sample, (self.pending,), shared)
        return eqx.tree_at(lambda r: (r.pending, r.limiter), self, (pending, limiter))

    def _folded(self, call: str) -> RateLimiter:
        """The limiter with every shard's pending inserts counted (no law is checked)."""
        if self.pending.shape[0] == 1:
            return self.limiter
        shared = (self.limiter, 0, call)
        return self.buffer.map_shards(_fold_and_sample, (self.pending,), shared)[1]


def _check_limiter(buffer: Any, limiter: Any, call: str) -> tuple[Any, UInt32[Array, " s"]]:
    """The limiter, checked against the buffer's capacity, and zero pending inserts for each
    of the buffer's shards, placed where they are."""
    limiter = checked_limiter(limiter, f"{call}(limiter=...)")
    if isinstance(buffer, RateLimited):
        raise TypeError(f"`{call}(buffer=...)` is already rate-limited: wrap its buffer.")
    shards = buffer.num_shards
    return limiter, buffer.place_shards(jnp.zeros(shards, jnp.uint32))


def _blocks(n: Any, shards: int, call: str) -> Int[Array, " shards"]:
    """A static total of units split into equal blocks, one per shard."""
    n = check_nonnegative_int(n, f"{call}(n=...)")
    if n % shards:
        raise ValueError(
            f"`{call}`: an insert's rows are split into {shards} equal blocks, one per shard; "
            f"{n} units do not split so."
        )
    return jnp.full(shards, n // shards, jnp.int32)


def insert_units(
    items: PyTree[ArrayLike], call: str, *, steps: bool, mask: ArrayLike | None = None
) -> int:
    """How many units an insert of `items` counts, on the host: one per item (a replay's
    batch of `n`, or the `True`s of `mask`, read to the host) or one per step (a trajectory
    buffer's `n` envs; `T` steps each when `steps`, leaves `(n, T, ...)`). The rule the
    `RateLimited` methods count by (`_per_shard`), for a caller that must know it first (the
    service's waits)."""
    leaves = jax.tree.leaves(items)
    shape = tuple(int(d) for d in jnp.shape(leaves[0])) if leaves else (0,) * 0
    axes = 2 if steps else 1
    if len(shape) < axes:
        what = "leading axes (n, T)" if steps else "a leading batch axis"
        raise ValueError(f"`{call}`: `items` must have {what}; its first leaf has shape {shape}.")
    if mask is not None:
        return int(np.count_nonzero(np.asarray(mask)))
    return shape[0] * (shape[1] if steps else 1)


def _per_shard(
    units: Shaped[ArrayLike, " n"] | int, rows: int, shards: int
) -> int | Int[Array, "*s"]:
    """The units of an insert of `rows` rows, `units` per row (a static int) or one flag per
    row (a mask): for a buffer of one shard, their number (a Python int when static, so that
    an amount above the limiter's batch size is refused at once); for several, the units each
    shard receives of its equal block of the rows (an int32 array, one per shard)."""
    if shards == 1:
        if isinstance(units, int):
            return rows * units
        return jnp.sum(jnp.asarray(units), dtype=jnp.int32)
    if isinstance(units, int):
        return jnp.full(shards, (rows // shards) * units, jnp.int32)
    flags = jnp.asarray(units).astype(jnp.int32).reshape(shards, rows // shards)
    return jnp.sum(flags, axis=1, dtype=jnp.int32)


# The law per shard (run inside each shard by the buffer's `map_shards`: `axis` names the
# mesh axis of the shards, for the collective of a fold).


def _share(
    limiter: RateLimiter, pending: UInt32[Array, ""], units: Int[Array, ""], shards: int
) -> Bool[Array, ""]:
    """Whether a shard with `pending` inserts since the last fold may insert `units` more: the
    law with `shards · (pending + units)` inserts after the limiter's (its share, as if every
    shard had inserted as much)."""
    rate = limiter.rate
    after = pending.astype(jnp.uint32) + units.astype(jnp.uint32)
    if rate.scaled_max is None:
        return jnp.ones((), jnp.bool_)
    total, over = add_product(limiter.inserts, after, shards)
    filling = ~over & less_equal(total, rate.min_size_to_sample)
    balance, wide = add_product(limiter.balance, after, shards * rate.p)
    return filling | (~wide & less_equal(balance, rate.scaled_max))


def _share_allows(
    row: tuple[Array], shared: tuple[RateLimiter, Array], axis: str | None, shards: int
) -> tuple[tuple[Array], Array]:
    """Whether every shard may take its block: each shard's verdict on its share, and-ed."""
    (pending,) = row
    limiter, units = shared
    me = 0 if axis is None else jax.lax.axis_index(axis)
    refused = (~_share(limiter, pending, units[me], shards)).astype(jnp.int32)
    if axis is not None:
        refused = jax.lax.psum(refused, axis)
    return (pending[None],), refused == 0


def _count_share(
    row: tuple[Array],
    shared: tuple[RateLimiter, Array, str],
    axis: str | None,
    shards: int,
) -> tuple[tuple[Array], None]:
    (pending,) = row
    limiter, units, call = shared
    me = 0 if axis is None else jax.lax.axis_index(axis)
    mine = units[me]
    rate = limiter.rate
    fault: Fault = (
        ~_share(limiter, pending, mine, shards),
        f"`{call}`: the rate limit does not allow this insert now (samples_per_insert = "
        f"{rate.samples_per_insert}, max_diff = {rate.max_diff}, this shard's share of it "
        f"among {shards} shards): the learner is behind. Call `can_insert` first, and insert "
        "when it is True",
    )
    new = pending + mine.astype(jnp.uint32)
    return (check_faults(new, [fault], safe=pending)[None],), None


def _fold_and_sample(
    row: tuple[Array],
    shared: tuple[RateLimiter, int, str],
    axis: str | None,
    shards: int,
) -> tuple[tuple[Array], RateLimiter]:
    """Every shard's pending inserts counted into the limiter (one all-reduce), then a sample
    of `rows` rows counted and checked (none for 0): the same in every shard."""
    (pending,) = row
    limiter, rows, call = shared
    counts = pending if axis is None else _gathered(pending, axis, shards)
    for k in range(shards):  # a handful of shards: 64-bit sums, word by word
        limiter = folded_inserts(limiter, counts[k], call)
    if not isinstance(rows, int) or rows:
        limiter = count_samples(limiter, rows, call, some=not isinstance(rows, int))
    return (jnp.zeros_like(pending)[None],), limiter


def _gathered(pending: UInt32[Array, ""], axis: str, shards: int) -> UInt32[Array, " shards"]:
    """Every shard's pending count, in every device: one all-reduce."""
    me = jax.lax.axis_index(axis)
    return jax.lax.psum(jnp.zeros(shards, jnp.uint32).at[me].set(pending), axis)


class RateLimitedReplay(RateLimited, AbstractReplay):
    """A replay and its `RateLimiter`: what `dx.RateLimited(replay, limiter)` makes (see
    `RateLimited`). A replay itself: every method of `AbstractReplay`, the inserts counted,
    `sample` returning `(limited, sample)`."""

    buffer: AbstractReplay
    """The wrapped replay, unchanged in behaviour."""
    limiter: RateLimiter
    """The counts (as of the last sample, over several shards), and the law they obey."""
    pending: UInt32[Array, " shards"]
    """Per shard of the buffer, the units inserted since the last sample folded them into
    the limiter (always 0 for a buffer of one shard, whose inserts are counted at once)."""
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(self, buffer: AbstractReplay, limiter: RateLimiter, *, throw: bool | None = None):
        """**Arguments:**

        - `buffer`: any replay (`AbstractReplay`), a `GlobalReplay` included. It may already
            hold data.
        - `limiter`: a `RateLimiter`, with the counts to start from (`with_counts`).
        - `throw`: how a fault is reported (as `UniformReplay`'s `throw`); `None` (the
            default): as `buffer` reports its own.

        **Raises:** `TypeError` for anything else; `ValueError` if the limiter's
        `min_size_to_sample` is above the replay's `max_size`: sampling could never start.
        """
        call = "RateLimited"
        self.result = inherited_result(throw, buffer, f"{call}(throw=...)")
        self.limiter, self.pending = _check_limiter(buffer, limiter, call)
        _check_capacity(limiter, buffer.max_size, "items (max_size)", call)
        self.buffer = buffer

    @property
    def max_size(self) -> int:
        return self.buffer.max_size

    @property
    def size(self) -> Int[Array, ""]:
        return self.buffer.size

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.buffer.item_spec

    @reports
    def add(self: _RR, item: PyTree[ArrayLike], priority: Real[ArrayLike, ""] | None = None) -> _RR:
        """The replay's `add` (with `priority` for a prioritised replay), counted: 1 insert."""
        if priority is None:
            write = lambda: self.buffer.add(item)  # noqa: E731
        else:
            write = lambda: self.buffer.add(item, priority)  # pyright: ignore[reportCallIssue]  # noqa: E731
        return self._insert(
            write, _per_shard(1, self.num_shards, self.num_shards), "RateLimited.add", 1
        )

    @reports
    def add_batch(
        self: _RR,
        items: PyTree[ArrayLike],
        priorities: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _RR:
        """The replay's `add_batch` (with `priorities` for a prioritised replay), counted:
        `n` inserts, or `mask.sum()`."""
        call = "RateLimited.add_batch"
        if priorities is None:
            write = lambda: self.buffer.add_batch(items, mask=mask)  # noqa: E731
        else:
            write = lambda: self.buffer.add_batch(items, priorities, mask=mask)  # pyright: ignore  # noqa: E731
        n = jax.tree.leaves(items)[0].shape[0]
        units = _per_shard(1 if mask is None else mask, n, self.num_shards)
        return self._insert(write, units, call, n if mask is None else None)

    @reports
    def update(self: _RR, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _RR:
        """The replay's `update`, not counted."""
        return self.with_buffer(self.buffer.update(fn))

    def with_counts(self: _RR, counts: tuple[int, int] | None) -> _RR:
        """This `RateLimited` with the counts `(inserts, samples)` (kept elsewhere), and no
        pending inserts. **Raises:** `ValueError` for `None` (none were kept)."""
        return self._counted(counts)

    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "RateLimited.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """The buffer's law: what `sample` draws by. (A `RateLimited` is a layer: it is never
        a shard or a cluster, which would draw by it without counting.)"""
        return self.buffer.law(age=age, beta=beta, call=call)

    @reports
    def sample(  # pyright: ignore[reportIncompatibleMethodOverride]
        self: _RR,
        key: PRNGKeyArray,
        batch_size: int,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
    ) -> tuple[_RR, Any]:
        """The replay's `sample(key, batch_size, ...)`, counted: `batch_size` rows.

        **Returns:** `(limited, sample)`: the new `RateLimited`, and what the replay's
        `sample` returns for the same arguments.

        **Raises:** what the replay's `sample` raises, and an `eqx.error_if` error if the law
        does not allow the sample (see `RateLimiter.sample`). When both hold (a sample of an
        empty replay, which no law allows), a compiled call raises either one.
        """
        call = "RateLimited.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        limited = self._sampled(batch_size, call)
        return limited, self.buffer.sample(key, batch_size, age=age, beta=beta)

    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> Any:
        """The replay's `sample_unchecked`, not counted (nothing is sampled for a learner)."""
        return self.buffer.sample_unchecked(key, batch_size)

    @reports
    def add_and_sample(  # pyright: ignore[reportIncompatibleMethodOverride]
        self: _RR, items: PyTree[ArrayLike], key: PRNGKeyArray, batch_size: int
    ) -> tuple[_RR, Any]:
        """`add_batch(items)`, then `sample(key, batch_size)`, both counted."""
        return self.add_batch(items).sample(key, batch_size)

    def split_indices(self, indices: Indices) -> tuple[Int[Array, " n"], Any]:
        return self.buffer.split_indices(indices)

    @reports
    def set_priorities(
        self: _RR,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
    ) -> _RR:
        """The replay's `set_priorities`, not counted."""
        new = self.buffer.set_priorities(indices, priorities, mask=mask, generations=generations)
        return self.with_buffer(new)

    @reports
    def note_priorities(
        self: _RR,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _RR:
        return self.with_buffer(self.buffer.note_priorities(indices, priorities, mask=mask))

    @reports
    def stale(
        self,
        indices: Indices,
        generations: UInt32[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Bool[Array, " n"]:
        """The replay's `stale`."""
        return self.buffer.stale(indices, generations, mask=mask)


class RateLimitedTrajectoryBuffer(RateLimited, AbstractTrajectoryBuffer):
    """A trajectory buffer and its `RateLimiter`: what `dx.RateLimited(buffer, limiter)`
    makes for a trajectory buffer (see `RateLimited`). A trajectory buffer itself: every
    method of `AbstractTrajectoryBuffer`, the inserts counted, `sample` returning `(limited,
    sample)` and a queue's `pop` `(items, limited)`."""

    buffer: AbstractTrajectoryBuffer
    """The wrapped trajectory buffer, unchanged in behaviour."""
    limiter: RateLimiter
    """The counts (as of the last sample, over several shards), and the law they obey."""
    pending: UInt32[Array, " shards"]
    """Per shard of the buffer, the steps inserted since the last sample folded them into
    the limiter (always 0 for a buffer of one shard)."""
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self, buffer: AbstractTrajectoryBuffer, limiter: RateLimiter, *, throw: bool | None = None
    ):
        """**Arguments:**

        - `buffer`: any trajectory buffer (`AbstractTrajectoryBuffer`), a
            `GlobalTrajectoryBuffer` included. It may already hold data.
        - `limiter`: a `RateLimiter`, with the counts to start from (`with_counts`).
        - `throw`: how a fault is reported (as `UniformReplay`'s `throw`); `None` (the
            default): as `buffer` reports its own.

        **Raises:** `TypeError` for anything else; `ValueError` if the limiter's
        `min_size_to_sample` is above the buffer's capacity in steps (`num_envs *
        max_length`): sampling could never start.
        """
        call = "RateLimited"
        self.result = inherited_result(throw, buffer, f"{call}(throw=...)")
        self.limiter, self.pending = _check_limiter(buffer, limiter, call)
        capacity = buffer.num_envs * buffer.max_length
        units = f"steps (num_envs * max_length = {buffer.num_envs} * {buffer.max_length})"
        _check_capacity(limiter, capacity, units, call)
        self.buffer = buffer

    @property
    def streams(self) -> Streams:
        return self.buffer.streams

    @property
    def num_envs(self) -> int:
        return self.buffer.num_envs

    @reports
    def add(
        self: _RT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _RT:
        """The buffer's `add`, counted: 1 step per listed env."""
        rows = jax.tree.leaves(items)[0].shape[0]
        units = _per_shard(1, rows, self.num_shards)
        write = lambda: self.buffer.add(items, env_ids)  # noqa: E731
        return self._insert(write, units, "RateLimited.add", rows)

    @reports
    def extend(
        self: _RT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _RT:
        """The buffer's `extend`, counted: `T` steps of each of `n` envs are `n * T`."""
        rows, length = jax.tree.leaves(items)[0].shape[:2]
        units = _per_shard(length, rows, self.num_shards)
        write = lambda: self.buffer.extend(items, env_ids)  # noqa: E731
        return self._insert(write, units, "RateLimited.extend", rows * length)

    def with_streams(self: _RT, streams: Streams) -> _RT:
        """The buffer's `with_streams`, the counts unchanged."""
        return self.with_buffer(self.buffer.with_streams(streams))

    def with_counts(self: _RT, counts: tuple[int, int] | None) -> _RT:
        """This `RateLimited` with the counts `(inserts, samples)` a `Dataset` kept, and no
        pending inserts. **Raises:** `ValueError` for `None` (the dataset kept none)."""
        return self._counted(counts)

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
        call: str = "RateLimited.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """The buffer's law: what `sample` draws by. (A `RateLimited` is a layer: it is never
        a shard, which would draw by it without counting.)"""
        return self.buffer.law(
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
    def sample(  # pyright: ignore[reportIncompatibleMethodOverride]
        self: _RT,
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
    ) -> tuple[_RT, Any]:
        """The buffer's `sample(key, batch_size, ...)`, counted: `batch_size` rows.

        **Returns:** `(limited, sample)`: the new `RateLimited`, and what the buffer's
        `sample` returns for the same arguments.

        **Raises:** what the buffer's `sample` raises, and an `eqx.error_if` error if the law
        does not allow the sample (see `RateLimiter.sample`). When both hold (a sample of an
        empty buffer, which no law allows), a compiled call raises either one.
        """
        call = "RateLimited.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        limited = self._sampled(batch_size, call)
        out = self.buffer.sample(
            key,
            batch_size,
            what,
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
        )
        return limited, out

    def sample_by(
        self: _RT,
        law: AbstractLaw,
        key: PRNGKeyArray,
        batch_size: int,
        faults: Sequence[Fault],
        call: str,
        *,
        rows: Int[Array, ""] | None = None,
    ) -> tuple[_RT, Any]:
        """The buffer's `sample_by`, counted: `rows` rows (traced), or `batch_size`."""
        limited = self._sampled(batch_size if rows is None else rows, call)
        return limited, self.buffer.sample_by(law, key, batch_size, faults, call, rows=rows)[1]

    @reports
    def pop(self: _RT, sequence_length: int) -> tuple[PyTree[Array], _RT]:
        """A trajectory queue's `pop`, counted: `num_envs` rows (one sequence per env).
        Returns `(items, limited)`, in the queue's order."""
        call = "RateLimited.pop"
        # A buffer that is not read once says so here, at once.
        eqx.filter_eval_shape(lambda b: b.pop(sequence_length), self.buffer)
        limited = self._sampled(self.num_envs, call)
        items, buffer = self.buffer.pop(sequence_length)
        return items, limited.with_buffer(buffer)

    def can_pop(self, length: int) -> Bool[Array, ""]:
        """The queue's `can_pop` (the law is asked with `can_sample(num_envs)`)."""
        return self.buffer.can_pop(length)

    @reports
    def read(
        self,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        window: Window,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Any:
        """The buffer's `read`, not counted."""
        return self.buffer.read(env_ids, starts, window, mask=mask)

    def with_written(self: _RT, streams: Streams) -> _RT:
        """The buffer's `with_written`, not counted (a write-back inserts nothing)."""
        return self.with_buffer(self.buffer.with_written(streams))

    @reports
    def peek(
        self,
        env_ids: Integer[ArrayLike, "*n"] | None = None,
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> PyTree[Array]:
        return self.buffer.peek(env_ids, mask=mask)

    @reports
    def stale(
        self,
        env_ids: Integer[ArrayLike, "*n"],
        starts: Integer[ArrayLike, "*n"],
        *,
        mask: Bool[ArrayLike, "*n"] | None = None,
    ) -> Bool[Array, "*n"]:
        return self.buffer.stale(env_ids, starts, mask=mask)

    def split_envs(self, env_ids: Int[Array, "*n"]) -> tuple[Int[Array, "*n"], Int[Array, "*n"]]:
        return self.buffer.split_envs(env_ids)

    def priority_settings(self) -> dict[str, Any] | None:
        return self.buffer.priority_settings()

    def window_priorities(self) -> WindowPriorities | None:
        return self.buffer.window_priorities()

    @reports
    def with_window_priorities(
        self: _RT,
        masses: Real[ArrayLike, "num_envs leaves"],
        *,
        max_priority: Real[ArrayLike, ""],
    ) -> _RT:
        new = self.buffer.with_window_priorities(masses, max_priority=max_priority)
        return self.with_buffer(new)

    @reports
    def set_priorities(
        self: _RT,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _RT:
        """The buffer's `set_priorities`, not counted."""
        return self.with_buffer(self.buffer.set_priorities(env_ids, starts, priorities, mask=mask))

    @reports
    def note_priorities(
        self: _RT,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _RT:
        new = self.buffer.note_priorities(env_ids, starts, priorities, mask=mask)
        return self.with_buffer(new)


def _check_capacity(limiter: RateLimiter, capacity: int, units: str, call: str) -> None:
    if limiter.min_size_to_sample > capacity:
        raise ValueError(
            f"`{call}`: the limiter's min_size_to_sample = {limiter.min_size_to_sample} is "
            f"above the buffer's capacity of {capacity} {units}: sampling could never start. "
            "Lower min_size_to_sample, or give the buffer more room."
        )


def checked_rate_limited(limited: Any, call: str) -> RateLimited:
    """`limited` if it is a `RateLimited`, else a `TypeError` quoting `call`."""
    if not isinstance(limited, RateLimited):
        raise TypeError(
            f"`{call}` must be a `RateLimited` (a buffer and its `RateLimiter`), got "
            f"{type(limited).__name__}."
        )
    return limited
