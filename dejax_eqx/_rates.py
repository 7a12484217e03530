"""The rate law: when an insert or a sample may proceed, given the cumulative counts.

One owner for the arithmetic of rate limiting. `Rate` is static configuration (a frozen,
hashable dataclass, so it can be a static field of a module) whose predicates take the
cumulative counts as Python ints and are exact: every bound is scaled to an integer. The jitted
`RateLimiter` evaluates the same law on 64-bit counters held as two 32-bit words, and the host
`ReplayService` evaluates it here, on Python ints; the tests hold the two to each other.

The law is Reverb's. With `I` items inserted and `S` rows sampled so far, and `spi` samples per
insert, the *balance* is `d = I * spi - S`:

- an insert of `n` may proceed if `I + n <= min_size_to_sample` (the buffer is still filling),
  or if `d + n * spi <= max_diff`;
- a sample of `n` may proceed if `I >= min_size_to_sample` and `d - n >= min_diff`.

Everything is held scaled by the common denominator `scale` of `spi`, `min_diff` and
`max_diff`, so `D = I * p - S * scale` (with `p = spi * scale`) is an integer.
"""

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Any


UNLIMITED = 2**31 - 1
"""What `sample_budget` and `insert_budget` return when nothing bounds them (an int32's most)."""

# The scaled bounds, and the balance they keep, lie strictly inside (-2**62, 2**62), and an insert
# or a sample moves the balance by at most 2**62: every sum the device forms fits its signed
# 64-bit words. A run would need 2**62 / p inserts to leave that range where no bound holds it.
_MAX_SCALED = 2**62
_MAX_BATCH = 2**31 - 1


def as_fraction(value: Any, call: str, name: str) -> Fraction:
    """`value` (an int, a float or a `Fraction`) as an exact fraction: a float by its shortest
    decimal form (`0.3` is `3/10`, not the binary double nearest it)."""
    if isinstance(value, bool) or not isinstance(value, int | float | Fraction):
        raise TypeError(
            f"`{call}`: `{name}` must be a real number (int, float or Fraction), got "
            f"{type(value).__name__}."
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"`{call}`: `{name}` must be finite, got {value}.")
        return Fraction(repr(value))
    return Fraction(value)


def _positive_int(value: Any, call: str, name: str, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{call}`: `{name}` must be a Python int, got {type(value).__name__}.")
    if not low <= value <= _MAX_BATCH:
        raise ValueError(f"`{call}`: `{name}` must be in [{low}, 2**31 - 1], got {value}.")
    return value


@dataclasses.dataclass(frozen=True)
class Rate:
    """The static configuration of a rate limiter, and its law on Python ints.

    Made by `RateLimiter`'s constructors, which check it; read it as `limiter.rate`.
    `min_diff`/`max_diff` of `None` stand for minus/plus infinity.
    """

    samples_per_insert: Fraction
    min_size_to_sample: int
    min_diff: Fraction | None
    max_diff: Fraction | None
    insert_batch_size: int
    sample_batch_size: int

    @staticmethod
    def make(
        samples_per_insert: Any,
        min_size_to_sample: Any,
        min_diff: Any,
        max_diff: Any,
        insert_batch_size: Any,
        sample_batch_size: Any,
        call: str,
    ) -> "Rate":
        """A checked `Rate`. `min_diff`/`max_diff` may be `None` or `±math.inf` (unbounded).

        **Raises:** `TypeError`/`ValueError` naming the argument, and `ValueError` saying why
        for a configuration that can deadlock: a state in which neither an insert of
        `insert_batch_size` nor a sample of `sample_batch_size` may proceed.
        """
        spi = as_fraction(samples_per_insert, call, "samples_per_insert")
        if spi <= 0:
            raise ValueError(f"`{call}`: `samples_per_insert` must be positive, got {spi}.")
        min_size = _positive_int(min_size_to_sample, call, "min_size_to_sample")
        bounds = []
        for name, value, infinite in (("min_diff", min_diff, -1), ("max_diff", max_diff, 1)):
            if value is None or (isinstance(value, float) and value == infinite * math.inf):
                bounds.append(None)
            else:
                bounds.append(as_fraction(value, call, name))
        low, high = bounds
        if low is not None and high is not None and low > high:
            raise ValueError(f"`{call}`: `min_diff` = {low} is above `max_diff` = {high}.")
        rate = Rate(
            spi,
            min_size,
            low,
            high,
            _positive_int(insert_batch_size, call, "insert_batch_size"),
            _positive_int(sample_batch_size, call, "sample_batch_size"),
        )
        if rate.scale > 2**31:
            raise ValueError(
                f"`{call}`: `samples_per_insert`, `min_diff` and `max_diff` have a common "
                f"denominator of {rate.scale}, above 2**31: too many decimal places to be "
                "counted exactly in 64 bits."
            )
        for name, bound in (("min_diff", rate.scaled_min), ("max_diff", rate.scaled_max)):
            if bound is not None and abs(bound) >= _MAX_SCALED:
                raise ValueError(
                    f"`{call}`: `{name}` scaled to an integer ({bound}, by {rate.scale}) does "
                    "not fit 62 bits; give the rates with fewer decimal places."
                )
        # The balance while the buffer fills reaches `min_size_to_sample * p`, and an insert
        # adds up to `insert_batch_size * p`: both must stay inside 62 bits.
        if (rate.min_size_to_sample + rate.insert_batch_size) * rate.p > _MAX_SCALED:
            raise ValueError(
                f"`{call}`: `samples_per_insert` = {spi} times (`min_size_to_sample` + "
                f"`insert_batch_size`) = {rate.min_size_to_sample + rate.insert_batch_size}, "
                f"scaled to an integer by {rate.scale}, does not fit 62 bits."
            )
        why = rate.deadlock()
        if why is not None:
            raise ValueError(f"`{call}`: this configuration can deadlock: {why}")
        return rate

    # --- the scaled integers --------------------------------------------------------------

    @functools.cached_property
    def scale(self) -> int:
        """The common denominator of `samples_per_insert`, `min_diff` and `max_diff`."""
        scale = self.samples_per_insert.denominator
        for bound in (self.min_diff, self.max_diff):
            if bound is not None:
                scale = math.lcm(scale, bound.denominator)
        return scale

    @functools.cached_property
    def p(self) -> int:
        """`samples_per_insert * scale`: what one insert adds to the scaled balance."""
        return int(self.samples_per_insert * self.scale)

    @functools.cached_property
    def scaled_min(self) -> int | None:
        return None if self.min_diff is None else int(self.min_diff * self.scale)

    @functools.cached_property
    def scaled_max(self) -> int | None:
        return None if self.max_diff is None else int(self.max_diff * self.scale)

    def balance(self, inserts: int, samples: int) -> int:
        """The scaled balance `D = inserts * p - samples * scale`."""
        return inserts * self.p - samples * self.scale

    # --- the law on Python ints -----------------------------------------------------------

    def can_insert(
        self, inserts: int, samples: int, n: int, *, shares: int = 1, pending: int = 0
    ) -> bool:
        """Whether an insert of `n` items may proceed after `inserts` and `samples`.

        With `shares > 1`, for one of `shares` inserters (the shards, or the processes, of a
        buffer spread across devices) that sees only its own `pending` inserts since
        `inserts` was last counted over all of them: its *share* of the law, as if every
        inserter had inserted as much. Summed over the inserters, that keeps the law's bound;
        with equal inserts everywhere, it is the law."""
        ahead = shares * (pending + n)
        if inserts + ahead <= self.min_size_to_sample or self.scaled_max is None:
            return True
        return self.balance(inserts, samples) + ahead * self.p <= self.scaled_max

    def can_sample(self, inserts: int, samples: int, n: int) -> bool:
        """Whether a sample of `n` rows may proceed after `inserts` and `samples`."""
        if inserts < self.min_size_to_sample:
            return False
        if self.scaled_min is None:
            return True
        return self.balance(inserts, samples) - n * self.scale >= self.scaled_min

    def sample_budget(self, inserts: int, samples: int, batch_size: int = 1) -> int:
        """How many samples of `batch_size` rows may proceed now, one after another with no
        insert between them (`UNLIMITED` if nothing bounds them)."""
        if inserts < self.min_size_to_sample:
            return 0
        if self.scaled_min is None:
            return UNLIMITED
        room = self.balance(inserts, samples) - self.scaled_min
        return min(max(room, 0) // (batch_size * self.scale), UNLIMITED)

    def insert_budget(self, inserts: int, samples: int, batch_size: int = 1) -> int:
        """How many inserts of `batch_size` items may proceed now, one after another with no
        sample between them (`UNLIMITED` if nothing bounds them)."""
        if self.scaled_max is None:
            return UNLIMITED
        count, step = 0, batch_size
        # While the buffer fills, inserts pass regardless of the balance.
        if inserts + step <= self.min_size_to_sample:
            count = (self.min_size_to_sample - inserts) // step
            inserts += count * step
        room = self.scaled_max - self.balance(inserts, samples)
        return min(count + max(room, 0) // (step * self.p), UNLIMITED)

    # --- deadlock --------------------------------------------------------------------------

    def deadlock(self) -> str | None:
        """Why this configuration can deadlock, or `None` if it cannot.

        Inserts come `i = insert_batch_size` items at a time and samples `b =
        sample_batch_size` rows at a time (the most each call may ask for). Once the buffer has
        filled, the balance `D` moves on the lattice of multiples of `gcd(p, scale)`; both
        sides are stuck at a `D` with `D + i * p > max` and `D - b * scale < min`. While it
        fills, no sample can happen, so an insert that crosses `min_size_to_sample` must fit
        under `max_diff` on its own.
        """
        low, high = self.scaled_min, self.scaled_max
        i, b, p, k = self.insert_batch_size, self.sample_batch_size, self.p, self.scale
        if high is None:
            return None
        if i > 1 and (self.min_size_to_sample + i - 1) * p > high:
            return (
                f"an insert of {i} items that crosses min_size_to_sample = "
                f"{self.min_size_to_sample} needs a balance of "
                f"{Fraction((self.min_size_to_sample + i - 1) * p, k)} samples, above "
                f"max_diff = {self.max_diff}, and nothing can be sampled before that size."
            )
        if low is None:
            return None
        g = math.gcd(p, k)
        # The smallest multiple of g strictly above high - i*p; stuck if it is below low + b*k.
        first = ((high - i * p) // g + 1) * g
        if first < low + b * k:
            return (
                f"the window from min_diff = {self.min_diff} to max_diff = {self.max_diff} "
                f"(a width of {Fraction(high - low, k)} samples) is too narrow for "
                f"inserts of {i} items at {self.samples_per_insert} samples each and samples of "
                f"{b} rows: at a balance of {Fraction(first, k)} samples neither may proceed. "
                f"Widen it to at least {Fraction(i * p + b * k, k)} (or lower the batch sizes)."
            )
        return None
