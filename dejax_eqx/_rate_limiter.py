"""Rate limiting inside `jit`: `RateLimiter`, a module of counters that evaluates the rate law
of `_rates.py` (`RateLimited`, a buffer together with its limiter, is `_rate_limited.py`).

Blocking is not here: a jitted loop asks the predicates and budgets and does as much as they
allow; a host service for threads waits on them. The limiter itself is pure, like the buffers.
"""

import numbers
from fractions import Fraction
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, UInt32

from ._checks import check_index, check_nonnegative_int, check_positive_int
from ._faults import check_faults, Fault, is_concrete
from ._int64 import (
    add_constant,
    add_product,
    floor_div,
    from_int,
    Int64,
    less,
    less_equal,
    negate,
    sub_product,
    to_int,
)
from ._rates import as_fraction, Rate, UNLIMITED


_L = TypeVar("_L", bound="RateLimiter")

# The invariants a limiter's counters keep, checked on every change (see `_rates.py`): every
# sum the predicates form then fits 64 bits.
_MAX_COUNT = 2**63 - 1
_MAX_BALANCE = 2**62


class RateLimiter(eqx.Module):
    """Reverb's rate limiter as a pure module: cumulative counts of inserted items and sampled
    rows, and the law that says when an insert or a sample may proceed.

    With `I` items inserted and `S` rows sampled so far, and `spi = samples_per_insert`, the
    *balance* is `I * spi - S`, the samples owed to the data inserted:

    - an insert of `n` items may proceed while the buffer fills (`I + n <=
        min_size_to_sample`), and after that if it leaves the balance at most `max_diff`;
    - a sample of `n` rows may proceed once `I >= min_size_to_sample`, if it leaves the
        balance at least `min_diff`.

    So the learner samples about `spi` rows per inserted item, within `[min_diff, max_diff]`
    of that ratio: the actors wait when the learner falls behind, the learner when the actors
    do. Every bound is held exactly (as fractions, scaled to integers), and the counts in 64
    bits (as two 32-bit words each: JAX has no `int64` without 64-bit mode), so a run never
    drifts and never wraps.

    Use the predicates (`can_insert`, `can_sample`) or the budgets (`sample_budget`,
    `insert_budget`) to decide what to do, then count what was done with `insert` and
    `sample`, which raise if the law did not allow it. Everything is jittable, works under
    `eqx.filter_jit(donate="all")`, as a `lax.scan` or `lax.while_loop` carry, with
    `eqx.filter_vmap` (one limiter per agent) and with `dx.save`/`dx.load`. To limit a buffer,
    wrap both in a `RateLimited`, which counts for you.

    Every configuration is checked for deadlock when it is made: if some state would let
    neither an insert of `insert_batch_size` items nor a sample of `sample_batch_size` rows
    proceed, the constructor refuses it and says why. Calls with more than those sizes are
    refused too (they could deadlock).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import dejax_eqx as dx

        # 4 sampled rows per inserted item, give or take 64, from 100 items on.
        limiter = dx.RateLimiter.sample_to_insert_ratio(
            4, 100, 64, insert_batch_size=8, sample_batch_size=32
        )

        @eqx.filter_jit(donate="all")
        def learn(limiter):
            def update(i, limiter):
                return limiter.sample(32)  # and a gradient step on 32 sampled rows
            # Exactly as many updates as the limiter allows now.
            return jax.lax.fori_loop(0, limiter.sample_budget(32), update, limiter)

        for _ in range(13):
            limiter = limiter.insert(8)  # 104 items: sampling may start
        limiter = learn(limiter)
        assert limiter.counts() == (104, 64)  # a balance of 4 * 104 - 64 = min_diff + 16
        assert not limiter.can_sample(32) and limiter.can_insert(8)
        ```
    """

    rate: Rate = eqx.field(static=True)
    """The configuration and the law on Python ints (a frozen dataclass; see `_rates.py`)."""
    inserts: UInt32[Array, " 2"]
    """The items inserted so far, a 64-bit count as the words `(hi, lo)`; `counts()` reads it."""
    samples: UInt32[Array, " 2"]
    """The rows sampled so far, likewise."""
    balance: UInt32[Array, " 2"]
    """The scaled balance `inserts * p - samples * scale` (signed, likewise): what the
    predicates read, kept with the counts so that they need no 64-bit multiplication."""

    def __init__(
        self,
        samples_per_insert: int | float | Fraction,
        min_size_to_sample: int,
        min_diff: int | float | Fraction | None,
        max_diff: int | float | Fraction | None,
        *,
        insert_batch_size: int = 1,
        sample_batch_size: int = 1,
    ):
        """**Arguments:**

        - `samples_per_insert`: the target number of sampled rows per inserted item, a
            positive int, float or `Fraction`. A float is taken at its shortest decimal form
            (`0.3` is exactly `3/10`).
        - `min_size_to_sample`: the number of items to insert before sampling may start, a
            positive int.
        - `min_diff`, `max_diff`: the least and most balance `inserts * samples_per_insert -
            samples` allowed after a sample or insert, numbers (decimals taken as for
            `samples_per_insert`), or `None`/`-math.inf`/`math.inf` for no bound.
        - `insert_batch_size`, `sample_batch_size`: the most items one insert and rows one
            sample may count (default 1). The deadlock check holds for these sizes, so larger
            calls are refused.

        **Raises:** `TypeError`/`ValueError` naming the argument; `ValueError` saying why for
        a configuration that can deadlock, or whose scaled bounds do not fit 62 bits.
        """
        self.rate = Rate.make(
            samples_per_insert,
            min_size_to_sample,
            min_diff,
            max_diff,
            insert_batch_size,
            sample_batch_size,
            "RateLimiter",
        )
        self.inserts = from_int(0)
        self.samples = from_int(0)
        self.balance = from_int(0)

    # --- Reverb's constructors --------------------------------------------------------------

    @classmethod
    def sample_to_insert_ratio(
        cls: type[_L],
        samples_per_insert: int | float | Fraction,
        min_size_to_sample: int,
        error_buffer: int | float | Fraction | tuple[Any, ...] | list[Any],
        *,
        insert_batch_size: int = 1,
        sample_batch_size: int = 1,
    ) -> _L:
        """Reverb's `SampleToInsertRatio`: about `samples_per_insert` rows sampled per item
        inserted, once `min_size_to_sample` items are in.

        The balance is centred on `offset = samples_per_insert * min_size_to_sample` (what it
        is when sampling starts): `error_buffer` is the slack either way, `min_diff = offset -
        error_buffer` and `max_diff = offset + error_buffer`, or, as in Reverb, a pair
        `(min_diff, max_diff)` given directly. The slack must hold a batch of either kind
        (about `samples_per_insert * insert_batch_size + sample_batch_size` rows wide): the
        deadlock check says when it does not.
        """
        call = "RateLimiter.sample_to_insert_ratio"
        if isinstance(error_buffer, tuple | list):
            if len(error_buffer) != 2:
                raise ValueError(
                    f"`{call}(error_buffer=...)` must be a number or a pair (min_diff, "
                    f"max_diff), got {len(error_buffer)} values."
                )
            low, high = error_buffer
        else:
            spi = as_fraction(samples_per_insert, call, "samples_per_insert")
            size = check_positive_int(min_size_to_sample, f"{call}(min_size_to_sample=...)")
            slack = as_fraction(error_buffer, call, "error_buffer")
            if slack < 0:
                raise ValueError(f"`{call}(error_buffer=...)` must be >= 0, got {slack}.")
            low, high = spi * size - slack, spi * size + slack
        sizes = (insert_batch_size, sample_batch_size)
        return _made(cls, call, samples_per_insert, min_size_to_sample, low, high, *sizes)

    @classmethod
    def min_size(
        cls: type[_L],
        min_size_to_sample: int,
        *,
        insert_batch_size: int = UNLIMITED,
        sample_batch_size: int = UNLIMITED,
    ) -> _L:
        """Reverb's `MinSize`: sampling may start once `min_size_to_sample` items are in, and
        nothing else is limited (`samples_per_insert` 1, no `min_diff`, no `max_diff`).

        An unbounded law cannot deadlock, so calls of any size (up to `2**31 - 1`) are
        allowed unless the batch sizes say less."""
        sizes = (insert_batch_size, sample_batch_size)
        return _made(cls, "RateLimiter.min_size", 1, min_size_to_sample, None, None, *sizes)

    @classmethod
    def queue(
        cls: type[_L], size: int, *, insert_batch_size: int = 1, sample_batch_size: int = 1
    ) -> _L:
        """Reverb's `Queue`: each item sampled once, in turn with inserts, at most `size`
        ahead (`samples_per_insert` 1, `min_size_to_sample` 1, `min_diff` 0, `max_diff`
        `size`). `size` must be at least `insert_batch_size + sample_batch_size - 1`."""
        call = "RateLimiter.queue"
        size = check_positive_int(size, f"{call}(size=...)")
        return _made(cls, call, 1, 1, 0, size, insert_batch_size, sample_batch_size)

    # --- configuration --------------------------------------------------------------------

    @property
    def samples_per_insert(self) -> Fraction:
        """The target number of sampled rows per inserted item, exactly."""
        return self.rate.samples_per_insert

    @property
    def min_size_to_sample(self) -> int:
        """The number of items to insert before sampling may start."""
        return self.rate.min_size_to_sample

    @property
    def min_diff(self) -> Fraction | None:
        """The least balance after a sample, or `None` for none."""
        return self.rate.min_diff

    @property
    def max_diff(self) -> Fraction | None:
        """The most balance after an insert, or `None` for none."""
        return self.rate.max_diff

    @property
    def insert_batch_size(self) -> int:
        """The most items one insert may count."""
        return self.rate.insert_batch_size

    @property
    def sample_batch_size(self) -> int:
        """The most rows one sample may count."""
        return self.rate.sample_batch_size

    # --- the law, jitted ----------------------------------------------------------------------

    def can_insert(self, n: Integer[ArrayLike, ""] = 1) -> Bool[Array, ""]:
        """Whether an insert of `n` items may proceed now.

        `n` is a Python int or an integer scalar array (may be traced), in `[0,
        insert_batch_size]`: else `ValueError` at once for a Python int, an `eqx.error_if`
        error for an array. Returns a boolean scalar array.
        """
        call = "RateLimiter.can_insert"
        n, faults = checked_amount(n, self.insert_batch_size, call, "insert", "items")
        return check_faults(insertable(self, n), faults)

    def can_sample(self, n: Integer[ArrayLike, ""] = 1) -> Bool[Array, ""]:
        """Whether a sample of `n` rows may proceed now: `n` as for `can_insert`, in `[0,
        sample_batch_size]`."""
        call = "RateLimiter.can_sample"
        n, faults = checked_amount(n, self.sample_batch_size, call, "sample", "rows")
        return check_faults(sampleable(self, n), faults)

    def sample_budget(self, batch_size: int = 1) -> Int[Array, ""]:
        """How many samples of `batch_size` rows may proceed now, one after another with no
        insert between them: an int32 scalar array, `2**31 - 1` when nothing bounds them.

        A learner's jitted loop may run exactly this many updates (`lax.fori_loop`).
        `batch_size` is a positive Python int, at most `sample_batch_size`.
        """
        rate = self.rate
        call = "RateLimiter.sample_budget"
        b = _batch(batch_size, rate.sample_batch_size, call, "sample", "rows")
        started = ~less(self.inserts, rate.min_size_to_sample)
        if rate.scaled_min is None:
            return jnp.where(started, UNLIMITED, 0).astype(jnp.int32)
        room, _ = add_constant(self.balance, -rate.scaled_min)  # |both| < 2**62
        return jnp.where(started, floor_div(room, b * rate.scale), 0)

    def insert_budget(self, batch_size: int = 1) -> Int[Array, ""]:
        """How many inserts of `batch_size` items may proceed now, one after another with no
        sample between them: an int32 scalar array, `2**31 - 1` when nothing bounds them.
        `batch_size` is a positive Python int, at most `insert_batch_size`."""
        rate = self.rate
        call = "RateLimiter.insert_budget"
        step = _batch(batch_size, rate.insert_batch_size, call, "insert", "items")
        if rate.scaled_max is None:
            return jnp.asarray(UNLIMITED, jnp.int32)
        size = rate.min_size_to_sample
        # While the buffer fills, inserts pass whatever the balance: count those first. Then
        # `inserts <= size - step` fits the low word.
        filling = less_equal(self.inserts, size - step)
        low = jnp.minimum(self.inserts[1], np.uint32(size)).astype(jnp.int32)
        count = jnp.where(filling, (size - low) // step, 0)
        filled, _ = add_product(self.balance, count * step, rate.p)  # at most size * p
        room, _ = add_constant(negate(filled), rate.scaled_max)  # |both| < 2**62
        more = floor_div(room, step * rate.p)
        return count + jnp.minimum(more, UNLIMITED - count)

    # --- counting -------------------------------------------------------------------------

    def insert(self: _L, n: Integer[ArrayLike, ""] = 1) -> _L:
        """Count an insert of `n` items (`n` as for `can_insert`).

        **Returns:** the new limiter.

        **Raises:** an `eqx.error_if` error if the law does not allow the insert now (call
        `can_insert` first), if `n` is out of range, or if a count would pass `2**63`.
        """
        return count_inserts(self, n, "RateLimiter.insert")

    def sample(self: _L, n: Integer[ArrayLike, ""] = 1) -> _L:
        """Count a sample of `n` rows (`n` as for `can_sample`).

        **Returns:** the new limiter.

        **Raises:** an `eqx.error_if` error if the law does not allow the sample now (call
        `can_sample` first), if `n` is out of range, or if a count would pass `2**63`.
        """
        return count_samples(self, n, "RateLimiter.sample")

    # --- host -----------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """`(inserts, samples)`: the items inserted and rows sampled so far, as exact Python
        ints. Reads the device; call it outside `jit`.

        **Raises:** `TypeError` inside `jit` (the counters are traced).
        """
        for x in (self.inserts, self.samples):
            if not (isinstance(x, jax.Array | np.ndarray) and is_concrete(x)):
                raise TypeError(
                    "`RateLimiter.counts`: the counters are traced or abstract; read them "
                    "outside `jit`, from a concrete limiter."
                )
        return to_int(self.inserts), to_int(self.samples)

    def with_counts(self: _L, inserts: int, samples: int) -> _L:
        """This limiter's configuration with the counts `inserts` and `samples` (to resume a
        run, or to start one at a chosen point). `self` may come from `eqx.filter_eval_shape`.

        **Raises:** `TypeError`/`ValueError` unless both are ints in `[0, 2**63)` whose
        scaled balance `inserts * p - samples * scale` lies within `±2**62` (see `rate`).
        """
        call = "RateLimiter.with_counts"
        inserts = check_nonnegative_int(inserts, f"{call}(inserts=...)", maximum=_MAX_COUNT)
        samples = check_nonnegative_int(samples, f"{call}(samples=...)", maximum=_MAX_COUNT)
        balance = self.rate.balance(inserts, samples)
        if abs(balance) >= _MAX_BALANCE:
            raise ValueError(
                f"`{call}`: {inserts} inserts and {samples} samples make a scaled balance of "
                f"{balance} (inserts * {self.rate.p} - samples * {self.rate.scale}), outside "
                "(-2**62, 2**62), where the limiter keeps it."
            )
        words = [from_int(x) for x in (inserts, samples, balance)]
        return eqx.tree_at(lambda r: (r.inserts, r.samples, r.balance), self, tuple(words))


def _made(cls: type[_L], call: str, *args: Any) -> _L:
    """A limiter of the configuration `Rate.make(*args)`, checked, and refused, under the name
    of the constructor called."""
    rate = Rate.make(*args, call=call)
    return cls(
        rate.samples_per_insert,
        rate.min_size_to_sample,
        rate.min_diff,
        rate.max_diff,
        insert_batch_size=rate.insert_batch_size,
        sample_batch_size=rate.sample_batch_size,
    )


# ---------------------------------------------------------------------------------------------
# The law on the device. The functions take amounts already checked by `amount`.


def insertable(limiter: RateLimiter, n: Int[Array, ""]) -> Bool[Array, ""]:
    """`Rate.can_insert` on the device, for `n` in `[0, insert_batch_size]`."""
    rate = limiter.rate
    if rate.scaled_max is None:
        return jnp.ones((), jnp.bool_)
    total, over = add_product(limiter.inserts, n, 1)
    filling = ~over & less_equal(total, rate.min_size_to_sample)
    after, over = add_product(limiter.balance, n, rate.p)
    return filling | (~over & less_equal(after, rate.scaled_max))


def sampleable(limiter: RateLimiter, n: Int[Array, ""]) -> Bool[Array, ""]:
    """`Rate.can_sample` on the device, for `n` in `[0, sample_batch_size]`."""
    rate = limiter.rate
    started = ~less(limiter.inserts, rate.min_size_to_sample)
    if rate.scaled_min is None:
        return started
    after, over = sub_product(limiter.balance, n, rate.scale)
    return started & ~over & ~less(after, rate.scaled_min)


def count_inserts(limiter: _L, n: Integer[ArrayLike, ""], call: str) -> _L:
    """`limiter` after an insert of `n` items, checked: the law, the range of `n`, and the
    counters' range. `call` names the user's call in the messages."""
    amount, faults = checked_amount(n, limiter.insert_batch_size, call, "insert", "items")
    rate = limiter.rate
    inserts, big = add_product(limiter.inserts, amount, 1)
    balance, wide = add_product(limiter.balance, amount, rate.p)
    faults = [
        *faults,
        (~insertable(limiter, amount), f"`{call}`: {_refused_insert(rate)}"),
        (big | _outside(balance, wide), f"`{call}`: {_OVERFLOW}"),
    ]
    inserts, balance = check_faults(
        (inserts, balance), faults, safe=(limiter.inserts, limiter.balance)
    )
    return eqx.tree_at(lambda r: (r.inserts, r.balance), limiter, (inserts, balance))


def folded_inserts(limiter: _L, n: UInt32[Array, ""], call: str) -> _L:
    """`limiter` with `n` more inserts (in `[0, 2**32)`) counted that have already been
    judged by the law (a shard's share of it): only the counters' range is checked."""
    rate = limiter.rate
    inserts, big = add_product(limiter.inserts, n, 1)
    balance, wide = add_product(limiter.balance, n, rate.p)
    inserts, balance = check_faults(
        (inserts, balance),
        [(big | _outside(balance, wide), f"`{call}`: {_OVERFLOW}")],
        safe=(limiter.inserts, limiter.balance),
    )
    return eqx.tree_at(lambda r: (r.inserts, r.balance), limiter, (inserts, balance))


def count_samples(limiter: _L, n: Integer[ArrayLike, ""], call: str, *, some: bool = False) -> _L:
    """`limiter` after a sample of `n` rows, checked as `count_inserts` checks inserts. With
    `some`, a sample of 0 rows is no sample, and the law never refuses it (a mixture's part
    whose traced count is 0)."""
    amount, faults = checked_amount(n, limiter.sample_batch_size, call, "sample", "rows")
    rate = limiter.rate
    samples, big = add_product(limiter.samples, amount, 1)
    balance, wide = sub_product(limiter.balance, amount, rate.scale)
    refused = ~sampleable(limiter, amount)
    faults = [
        *faults,
        (refused & (amount > 0) if some else refused, f"`{call}`: {_refused_sample(rate)}"),
        (big | _outside(balance, wide), f"`{call}`: {_OVERFLOW}"),
    ]
    samples, balance = check_faults(
        (samples, balance), faults, safe=(limiter.samples, limiter.balance)
    )
    return eqx.tree_at(lambda r: (r.samples, r.balance), limiter, (samples, balance))


_OVERFLOW = (
    "the limiter's counters would leave their range (counts below 2**63, the scaled balance "
    "within ±2**62); a bound (`min_diff`, `max_diff`) that holds the balance keeps it there"
)


def _outside(balance: Int64, wrapped: Bool[Array, ""]) -> Bool[Array, ""]:
    low = less_equal(balance, -_MAX_BALANCE)
    return wrapped | low | ~less(balance, _MAX_BALANCE)


def _refused_insert(rate: Rate) -> str:
    return (
        f"the rate limit does not allow this insert now (samples_per_insert = "
        f"{rate.samples_per_insert}, min_size_to_sample = {rate.min_size_to_sample}, max_diff "
        f"= {rate.max_diff}): the learner is behind. Call `can_insert` first, and insert when "
        "it is True"
    )


def _refused_sample(rate: Rate) -> str:
    return (
        f"the rate limit does not allow this sample now (samples_per_insert = "
        f"{rate.samples_per_insert}, min_size_to_sample = {rate.min_size_to_sample}, min_diff "
        f"= {rate.min_diff}): fewer than min_size_to_sample items are in, or the actors are "
        "behind. Call `can_sample` (or `sample_budget`) first, and sample when it allows"
    )


# What `kind` and `unit` the helpers below are given: ("insert", "items") or ("sample", "rows").


def _batch(batch_size: Any, most: int, call: str, kind: str, unit: str) -> int:
    """A budget's static batch size: positive, and at most the declared one."""
    batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
    if batch_size > most:
        what = f"`{call}(batch_size=...)` is {batch_size}"
        raise ValueError(_too_many(what, most, kind, unit))
    return batch_size


def _too_many(what: str, most: int, kind: str, unit: str) -> str:
    return (
        f"{what}, above {kind}_batch_size = {most}, the most this limiter was declared for: "
        f"its deadlock check holds for {kind}s of at most {most} {unit}, and a larger "
        f"{kind} could deadlock it. Declare a larger `{kind}_batch_size`."
    )


def checked_amount(
    n: Any, most: int, call: str, kind: str, unit: str
) -> tuple[Int[Array, ""], list[Fault]]:
    """The amount `n` of an insert or a sample as an int32 in `[0, most]` (0 where it is out
    of range), and its faults. A Python int is checked now."""
    if isinstance(n, numbers.Integral) and not isinstance(n, bool | np.generic):
        n = int(n)
        if n < 0:
            raise ValueError(f"`{call}`: `n` must be non-negative, got {n}.")
        if n > most:
            raise ValueError(_too_many(f"`{call}`: {n} {unit} to {kind}", most, kind, unit))
        return jnp.asarray(n, jnp.int32), []
    index: Any = n
    value, bad = check_index(index, most + 1, f"{call}(n=...)", ndim=0)
    message = (
        f"`{call}`: `n` must be in [0, {kind}_batch_size = {most}]; a larger {kind} could "
        f"deadlock the limiter (its deadlock check holds for {kind}s of at most {most} {unit})"
    )
    return jnp.where(bad, 0, value), [(bad, message)]


def checked_limiter(limiter: Any, call: str) -> RateLimiter:
    """`limiter` if it is a `RateLimiter`, else a `TypeError` quoting `call`."""
    if not isinstance(limiter, RateLimiter):
        raise TypeError(f"`{call}` must be a `RateLimiter`, got {type(limiter).__name__}.")
    return limiter
