"""The window law: which windows of per-env streams exist, and how they are drawn. Pure
functions of step counts and lengths; the one home of period arithmetic.

Env `e` stores a window of `lengths[e]` steps, ending at its newest step. A start is named by
its env and its *back distance* `b` in `1 .. lengths[e]`: the start is the `b`-th newest step,
and a window of `W` steps from it holds `r = min(b, W)` real steps. Which starts are
admissible and how they are weighted is a `Law`: a period that aligns starts to each env's
absolute step count, a least number of real steps, and `strict` (whole windows only). These
functions know nothing of storage: the caller turns `(env, b)` into slots (for
`TrajectoryBuffer`, ring arithmetic from `_storage.py`). The method is explained in
`dejax_eqx/README.md`.
"""

import math
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Float32, Int, PRNGKeyArray, UInt32


# Step numbers and counts: JAX int32 arrays on the device, NumPy int64 arrays on the host
# (`Dataset`). The functions written for both use only `//`, `%` and comparisons, which
# round and compare alike in NumPy and JAX.
_I = TypeVar("_I", Array, np.ndarray)


WORDS_PER_ROW = 4
"""Random 32-bit words `starts_from_bits` uses per row: two uniforms and a 64-bit integer."""


class Law(NamedTuple):
    """Which starts a window of `size` steps may have, and how they are weighted. Static.

    - `size`: `W`, the number of steps of a window, `>= 1`.
    - `period`: `P >= 1`. A start must be a multiple of `P` in its env's absolute step count:
        with `phase[e] = count[e] mod P` (`count[e]` steps ever added to env `e`), the
        admissible back distances are `b ≡ phase[e] (mod P)`.
    - `min_real`: a start must yield at least this many real steps, `1 <= min_real <= W`.
    - `strict`: only starts whose whole window is stored (`b >= W`), all of weight 1.

    A start with `r` real steps weighs `r ** power` (the power is a traced argument).
    """

    size: int
    period: int = 1
    min_real: int = 1
    strict: bool = False


class Starts(NamedTuple):
    """Drawn starts, one per row: `env[b]`, the back distance `back[b]` in
    `[1, lengths[env]]` (the start is the `back`-th newest step of the window) and
    `remaining[b] = min(back, W)`, the number of real steps of its window. All three are 0
    where no start was admissible at all (`env` is then `num_envs - 1`)."""

    env: Int[Array, " batch"]
    back: Int[Array, " batch"]
    remaining: Int[Array, " batch"]


class _Table(NamedTuple):
    full: Int[Array, " num_envs"]  # F_e: admissible starts with r = W
    full_back: Int[Array, " num_envs"]  # the smallest back distance of a full start
    tail_first: Int[Array, " num_envs"]  # r0_e: the smallest r of a tail start
    tail: Int[Array, " num_envs"]  # n_e: tail starts r0_e, r0_e + P, ..., r0_e + (n_e - 1) P
    log_g: Float[Array, " W"]  # log G[r], G[r] = w(r) + G[r - P], over admissible tail r
    log_env: Float[Array, " num_envs"]  # log W_e


def unit_float(bits: UInt32[Array, " n"]) -> Float[Array, " n"]:
    """Uniform floats in [0, 1) from random bits, as `jax.random.uniform` makes them: 23 random
    mantissa bits under the exponent of 1.0, minus 1. The largest value is 1 - 2**-23."""
    one = jnp.asarray(0x3F800000, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits >> 9) | one, jnp.float32) - 1.0


def _count_at_most(table: Float[Array, " n"], x: Float[Array, " b"]) -> Int[Array, " b"]:
    """For each `x`, the number of entries of the sorted `table` that are `<= x`.

    A binary search unrolled into straight-line code (O(log n) per query, no loop to launch
    step by step on an accelerator).
    """
    return jnp.searchsorted(table, x, side="right", method="scan_unrolled").astype(jnp.int32)


def _count_strided_at_most(
    table: Float[Array, " W"],
    first: Int[Array, " b"],
    n: Int[Array, " b"],
    stride: int,
    x: Float[Array, " b"],
) -> Int[Array, " b"]:
    """For each row, the number of `j` in `[0, n)` with `table[first + j * stride] <= x`, where
    those entries increase with `j`. A binary search over `j`, unrolled: `ceil(log2(W / stride
    + 1))` gathers per row."""
    size = table.shape[0]
    lo, hi = jnp.zeros_like(n), n
    for _ in range(max(1, math.ceil(math.log2(-(-size // stride) + 1)))):
        mid = (lo + hi) // 2
        at = table[jnp.minimum(first + mid * stride, size - 1)]
        go_right = (mid < hi) & (at <= x)
        lo, hi = jnp.where(go_right, mid + 1, lo), jnp.where(go_right, hi, mid)
    return lo


def uniform_below(
    high: UInt32[Array, " n"], low: UInt32[Array, " n"], n: Int[Array, " n"]
) -> Int[Array, " n"]:
    """A random integer in [0, n) from two random words (0 where n is 0).

    `(high * 2**32 + low) mod n` for n <= 2**16 (bias at most n / 2**64), computed in uint32
    without overflow; above that, `low mod n` (bias at most n / 2**32). This is the reduction
    `jax.random.randint` makes; calling it would cost a second PRNG kernel.
    """
    span = jnp.maximum(n, 1).astype(jnp.uint32)
    # 2**32 mod span, as (2**32 - span) mod span; zero (high unused) where products could wrap.
    multiplier = jnp.where(span <= 2**16, (jnp.asarray(0, jnp.uint32) - span) % span, 0)
    return (((high % span) * multiplier + low % span) % span).astype(jnp.int32)


def integers_below(key: PRNGKeyArray, batch_size: int, n: Int[Array, ""]) -> Int[Array, " batch"]:
    """`batch_size` random integers in `[0, n)` (0 where `n` is 0), as `jax.random.randint(key,
    (batch_size,), 0, n)` draws them (`uniform_below`), from one `jax.random.bits` call: one
    PRNG kernel where `randint` has three (a split, then a call per word), each a loop that a
    Python-called step on CPU runs op by op."""
    bits = jax.random.bits(key, (2, batch_size), jnp.uint32)
    return uniform_below(bits[0], bits[1], jnp.broadcast_to(n, (batch_size,)))


def _progression(first, last, stride: int):
    """The number of `first, first + stride, ...` that are `<= last` (0 if `first > last`)."""
    return jnp.where(last >= first, (last - first) // stride + 1, 0)


def _full_starts(
    lengths: Int[Array, " num_envs"], phase: Int[Array, " num_envs"], law: Law
) -> tuple[Int[Array, " num_envs"], Int[Array, " num_envs"]]:
    """Per env, the back distance of its nearest start with a whole window (`b >= W` on the
    period) and the number of such starts stored."""
    full_back = law.size + (phase - law.size) % law.period
    return full_back, _progression(full_back, lengths, law.period)


def _table(
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    law: Law,
    power: Float32[Array, ""],
) -> _Table:
    # A start with back distance b has r = min(b, W) real steps, weight w(r) = r**p. It is
    # admissible when b is in [1, L_e] and b ≡ phase_e (mod P), and, for b < W (a *tail*
    # start, r = b), r >= lo (lo = W when strict: no tail). Per env that is F_e *full* starts
    # (b >= W, weight w(W)) and a progression of tail starts r0_e, r0_e + P, ... up to
    # r_last <= min(L_e, W - 1). With the table G[r] = w(r) + G[r - P] (over admissible r of
    # one residue), env e weighs W_e = F_e w(W) + G[r_last]. Weights are handled as logarithms,
    # so that no power overflows, and an env without admissible starts weighs exactly 0
    # (log W_e = -inf) for every power.
    size, period = law.size, law.period
    lo = size if law.strict else law.min_real
    log_w = power * jnp.log(jnp.arange(1, size + 1, dtype=jnp.float32))  # log w(1..W)
    full_back, full = _full_starts(lengths, phase, law)
    tail_first = lo + (phase - lo) % period
    tail = _progression(tail_first, jnp.minimum(lengths, size - 1), period)
    last = jnp.where(tail > 0, tail_first + (tail - 1) * period, 0)
    # G in one strided cumulative sum (a (rows, P) reshape summed down its rows), scaled by
    # the largest term any env uses: w is monotone in r, so that is w(max r_last) for p >= 0
    # and w(min r0) for p < 0. So no entry in use overflows and the largest one in use is
    # >= 1. Entries that underflow to 0 belong to envs whose weight is below 1e-38 of
    # another's.
    used = tail > 0
    high = jnp.max(jnp.where(used, last, 1))
    low = jnp.min(jnp.where(used, tail_first, size))
    log_r = jnp.log(jnp.stack([high, jnp.minimum(low, high)]).astype(jnp.float32))
    shift = jnp.where(jnp.any(used), jnp.max(power * log_r), 0.0)
    r = jnp.arange(size)
    terms = jnp.where(r >= lo, jnp.exp(jnp.concatenate([jnp.zeros(1), log_w[:-1]]) - shift), 0.0)
    rows = -(-size // period)
    terms = jnp.pad(terms, (0, rows * period - size)).reshape(rows, period)
    log_g = jnp.log(jnp.cumsum(terms, axis=0).reshape(-1)[:size]) + shift
    log_tail = jnp.where(tail > 0, log_g[last], -jnp.inf)
    log_full = jnp.log(full.astype(jnp.float32)) + (0.0 if law.strict else log_w[-1])
    log_env = jnp.logaddexp(log_full, log_tail)
    return _Table(full, full_back, tail_first, tail, log_g, log_env)


def count_starts(
    lengths: Int[Array, " num_envs"], phase: Int[Array, " num_envs"], law: Law
) -> Int[Array, " num_envs"]:
    """The number of admissible starts of each env (exact integer arithmetic)."""
    t = _table(lengths, phase, law, jnp.zeros((), jnp.float32))
    return t.full + t.tail


def admissible(
    lengths: Int[Array, " num_envs"], phase: Int[Array, " num_envs"], law: Law
) -> Bool[Array, " num_envs"]:
    """Whether each env has at least one admissible start (exact integer arithmetic)."""
    return count_starts(lengths, phase, law) > 0


def env_log_weights(
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    law: Law,
    power: Float32[Array, ""],
) -> Float[Array, " num_envs"]:
    """The log of each env's total start weight, `log W_e = log sum min(b, W) ** power` over its
    admissible back distances `b`, as the sampler computes it: env `e` is drawn with
    probability `W_e / sum(W)`.

    **Arguments:**

    - `lengths`: an int32 array of shape `(num_envs,)`, the window lengths, each `>= 0`.
    - `phase`: an int32 array of shape `(num_envs,)`, each env's step count modulo
        `law.period`, in `[0, period)`.
    - `law`: a `Law` (static).
    - `power`: a finite float32 scalar (may be traced).

    **Returns:** a float32 array of shape `(num_envs,)`: exactly `-inf` for an env without
    admissible starts, for every power. Accurate to float32 rounding (of order
    `|power| · log W · 2**-24`) for every env whose weight is at least about `1e-37` of the
    heaviest env's; a lighter env may come out lighter still, down to `-inf` (parts of its
    weight underflow), which is what the sampler then uses: it is drawn with probability
    below about `1e-37`, or never.
    """
    return _table(lengths, phase, law, power).log_env


def start_log_weights(
    back: Int[Array, "num_envs n"],
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    law: Law,
    power: Float32[Array, ""],
) -> Float32[Array, "num_envs n"]:
    """The log weight of each start, by enumeration: row `e` of `back` holds back distances
    of env `e` (any values), and a start weighs `min(b, W) ** power` (1 when strict) if it is
    admissible (`1 <= b <= lengths[e]`, `b ≡ phase[e] (mod P)`, at least `min_real` real
    steps, or a whole window when strict), else 0 (log `-inf`). The law `starts_from_bits`
    draws from, start by start; O(size of `back`).

    **Arguments:** `back`, an int32 array of shape `(num_envs, n)`; the others as in
    `env_log_weights`.

    **Returns:** a float32 array of the shape of `back`.
    """
    size, period = law.size, law.period
    lengths, phase = lengths[:, None], phase[:, None]
    real = jnp.minimum(back, size)
    least = size if law.strict else law.min_real
    ok = (back >= 1) & (back <= lengths) & ((back - phase) % period == 0) & (real >= least)
    log_w = power * jnp.log(jnp.maximum(real, 1).astype(jnp.float32))
    return jnp.where(ok, 0.0 if law.strict else log_w, -jnp.inf).astype(jnp.float32)


def starts_from_bits(
    bits: UInt32[Array, "4 batch"],
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    law: Law,
    power: Float32[Array, ""],
) -> Starts:
    """Draw one start per column of `bits`, with probability proportional to
    `min(b, W) ** power` over every admissible `(env, b)` together.

    O(num_envs + W) set-up, then O(log num_envs + log(W / period)) per row.

    **Arguments:**

    - `bits`: uniformly random uint32 words, `WORDS_PER_ROW` per row, of shape
        `(4, batch_size)`: rows 0 and 1 give the uniforms for the env and for the kind of
        start, rows 2 and 3 the 64-bit integer that picks a full start.
    - `lengths`, `phase`, `law`, `power`: as in `env_log_weights`.

    **Returns:** a `Starts` of int32 arrays of shape `(batch_size,)`. Envs without admissible
    starts are never drawn. If no env has one the result is meaningless but in bounds
    (`env = num_envs - 1`, `back = remaining = 0`) and nothing raises: the caller checks.
    """
    size, period = law.size, law.period
    table = _table(lengths, phase, law, power)
    u_env, u_kind = unit_float(bits[0]), unit_float(bits[1])

    # The env, by inverse CDF over W_e scaled so that the largest is 1. An env of weight 0
    # adds exactly 0 to the running sum, so no x lands in it: `_count_at_most` picks e with
    # cdf[e-1] <= x < cdf[e]. And x < cdf[-1], since u <= 1 - 2**-23 keeps u * total at
    # least one float below total.
    log_env = table.log_env
    top = jnp.max(log_env)
    cdf = jnp.cumsum(jnp.exp(log_env - jnp.where(jnp.isfinite(top), top, 0.0)))
    env = _count_at_most(cdf, u_env * cdf[-1])
    env = jnp.minimum(env, lengths.shape[0] - 1)  # only when no env has a start

    # The kind of start within env e, by inverse CDF over [tail r0, tail r0 + P, ..., the F
    # full starts]: x = u W_e falls in the j-th tail start when G[r0 + (j-1)P] <= x <
    # G[r0 + jP], in the full block when x >= G[r_last]. The table log G is shared by all
    # envs and searched with log x, so the only per-env values needed are r0, n and log W_e.
    first, n, full = table.tail_first[env], table.tail[env], table.full[env]
    below = _count_strided_at_most(table.log_g, first, n, period, jnp.log(u_kind) + log_env[env])
    # With no full start, x >= G[r_last] = W_e only by rounding: it belongs to the last tail.
    is_full = (below == n) & (full > 0)
    tail_r = first + jnp.maximum(jnp.minimum(below, n - 1), 0) * period
    pick = uniform_below(bits[2], bits[3], full)
    back = jnp.where(is_full, table.full_back[env] + pick * period, tail_r)
    some = (full > 0) | (n > 0)
    back = jnp.where(some, back, 0)
    return Starts(env, back, jnp.minimum(back, size))


def strict_starts_from_bits(
    bits: UInt32[Array, "2 batch"],
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    law: Law,
) -> Starts:
    """Draw one start per column of `bits` uniformly among the starts of a strict `law` (every
    one weighs 1), in exact integer arithmetic: the two words of a column give an integer in
    `[0, total)` (`uniform_below`), which names the start, env by env in order.

    O(num_envs) set-up, then O(log num_envs) per row. The number of starts of all envs
    together must be below `2**31` (`draw_starts` takes this path only when it is).

    **Arguments:** `bits`, uniformly random uint32 words of shape `(2, batch_size)`; the others
    as in `env_log_weights` (`law.strict`).

    **Returns:** a `Starts`, as `starts_from_bits`, from the same law.
    """
    assert law.strict
    size, period = law.size, law.period
    full_back, full = _full_starts(lengths, phase, law)
    ends = jnp.cumsum(full)  # env e holds the integers [ends[e] - full[e], ends[e])
    total = ends[-1]
    pick = uniform_below(bits[0], bits[1], jnp.broadcast_to(total, bits.shape[1:]))
    env = jnp.searchsorted(ends, pick, side="right", method="scan_unrolled").astype(jnp.int32)
    env = jnp.minimum(env, lengths.shape[0] - 1)  # only when no env has a start
    back = full_back[env] + (pick - (ends[env] - full[env])) * period
    back = jnp.where(total > 0, back, 0)
    return Starts(env, back, jnp.minimum(back, size))


def draw_starts(
    key: PRNGKeyArray,
    lengths: Int[Array, " num_envs"],
    phase: Int[Array, " num_envs"],
    batch_size: int,
    law: Law,
    power: Float32[Array, ""],
    *,
    max_length: int | None = None,
) -> Starts:
    """`batch_size` starts drawn from `key` by `law`: `starts_from_bits` on `(WORDS_PER_ROW,
    batch_size)` words, or, for a strict law where `max_length` (static: no env holds more
    steps) bounds the number of starts below `2**31`, `strict_starts_from_bits` on two words a
    row, the same law drawn exactly and at about half the cost (a quarter under `vmap`).

    All the randomness comes from one `jax.random.bits` call, one PRNG kernel: on CPU every
    further call would cost about as much as the rest of a small draw.

    **Arguments:**

    - `key`: a JAX PRNG key.
    - `batch_size`: the number of rows, a positive Python int (static).
    - `lengths`, `phase`, `law`, `power`: as in `env_log_weights`.
    - `max_length`: the most steps an env holds (static), or `None` if unknown.

    **Returns:** a `Starts`, as `starts_from_bits`.
    """
    if law.strict and max_length is not None and lengths.shape[0] * max_length < 2**31:
        bits = jax.random.bits(key, (2, batch_size), jnp.uint32)
        return strict_starts_from_bits(bits, lengths, phase, law)
    bits = jax.random.bits(key, (WORDS_PER_ROW, batch_size), jnp.uint32)
    return starts_from_bits(bits, lengths, phase, law, power)


def phase(count: _I, period: int) -> _I:
    """The back distances of the starts on a multiple of `period` are `b ≡ phase (mod period)`
    for a stream that has taken `count` steps. (Starts counted from another origin, `o` steps
    before the newest's successor, have `phase(o, period)`.)"""
    return count % period


# ---------------------------------------------------------------------------------------------
# Whole windows as items (`PrioritisedTrajectoryBuffer`, `Dataset`).
#
# Window `j` of an env starts at step `j * P` and holds its `W` steps `j * P .. j * P + W - 1`.
# It is *stored* while all its steps are: once its last step is added (`j * P <= count - W`)
# and until its first one is overwritten (`j * P >= count - length`). A prioritised buffer
# keeps `K = max_length // P` sum-tree leaves per env, and window `j` sits in leaf `j mod K` of
# its env. Two stored windows are at most `max_length - W` steps apart, so they never share a
# leaf as long as `K * P >= max_length - W + 1` (always when P divides max_length, else when
# `W > max_length mod P`). The functions below work in window numbers `j` rather than start
# steps, so that nothing near 2**31 steps overflows int32.


def leaves_per_env(max_length: int, period: int) -> int:
    """`K = max_length // period`: the sum-tree leaves of an env, one per window slot."""
    return max_length // period


def windows_share_leaves(max_length: int, size: int, period: int) -> bool:
    """Whether two stored windows of `size` steps could share a leaf: `K * P < max_length -
    size + 1`, that is `size <= max_length mod period`."""
    return size <= max_length % period


def leaf_of(env: _I, start: _I, period: int, per_env: int) -> _I:
    """The sum-tree leaf of window `(env, start)` (`start` a multiple of `period`)."""
    return env * per_env + (start // period) % per_env


def latest_start(count: Array, leaf: Array, size: int, period: int, per_env: int) -> Array:
    """The start of the window that leaf `leaf` of an env (in `[0, per_env)`) holds once the env
    has taken `count` steps: the latest `j * period <= count - size` with `j ≡ leaf (mod
    per_env)`. Negative if no such window has been stored yet; stored while it is at least
    `count - length`."""
    last = (count - size) // period
    return (last - (last - leaf) % per_env) * period


def is_stored(start: _I, count: _I, length: _I, size: int) -> _I:
    """Whether the window of `size` steps from `start` is stored whole in a stream that has
    taken `count` steps and holds the last `length` of them."""
    return (start >= count - length) & (start <= count - size)


def is_window(start: Array, count: Array, size: int, period: int) -> Array:
    """Whether a window of `size` steps on a multiple of `period` starts at `start` and has
    been stored whole (its last step taken) once its env has taken `count` steps."""
    return (start % period == 0) & (start <= count - size)


def step_changes(
    count: Int[Array, " n"], size: int, period: int, max_length: int, per_env: int
) -> tuple[Int[Array, " n"], Bool[Array, " n"], Int[Array, " n"], Bool[Array, " n"]]:
    """The windows that enter and leave when an env takes its `count`-th step (`count >= 1`,
    after the add): `(enter_leaf, enter, leave_leaf, leave)`, leaves in `[0, per_env)`.

    The window whose last step was just written (start `count - size`) enters; the one whose
    first step was just overwritten (start `count - 1 - max_length`) leaves; each only if it
    starts on a multiple of `period`. The two share a leaf only when `K * P = max_length - W
    + 1`; then only the entering one is flagged, which is right: the leaf is now its.
    """
    new = count - size
    gone = count - 1 - max_length
    enter = (new >= 0) & (new % period == 0)
    leave = (gone >= 0) & (gone % period == 0)
    enter_leaf = (jnp.maximum(new, 0) // period) % per_env
    leave_leaf = (jnp.maximum(gone, 0) // period) % per_env
    return enter_leaf, enter, leave_leaf, leave & ~(enter & (leave_leaf == enter_leaf))


def extend_changes(
    count: Int[Array, " n"],
    length: int,
    oldest: Int[Array, " n"],
    size: int,
    period: int,
    max_length: int,
    per_env: int,
) -> tuple[Int[Array, "n c"], Bool[Array, "n c"], Bool[Array, "n c"]]:
    """The leaves that `length` new steps may have changed, for envs that have now taken
    `count` steps and store them from step `oldest`: `(leaf, write, stored)`, each of shape
    `(n, 2 * ceil(length / period))`.

    Several windows may enter and leave (with `length` near `max_length`, one may do both
    within the call). The candidates are the windows whose last step is new and those whose
    first step was overwritten, `ceil(length / period)` of each. A leaf's value after the add
    depends on the leaf alone: it holds its latest window if that is stored (`stored`; new
    windows get the largest priority, older ones keep theirs), else nothing. So `write` flags
    the candidates whose leaf lost its window or gained a new one; candidates that repeat a
    leaf agree on its value, and may be written in any order.
    """
    before = count - length
    per = -(-length // period)
    k = jnp.arange(per, dtype=count.dtype)[None, :]
    last = ((count - size) // period)[:, None]  # the newest window stored whole
    # Windows whose last step is new: starts in (before - size, count - size].
    enter = ((before - size) // period + 1)[:, None] + k
    # Windows whose first step was overwritten: starts in [before - m, count - m).
    leave = (-((max_length - before) // period))[:, None] + k
    j = jnp.concatenate([enter, leave], axis=1)
    touched = (j >= 0) & jnp.concatenate(
        [enter <= last, leave <= ((count - max_length - 1) // period)[:, None]], axis=1
    )
    leaf = j % per_env
    held = last - (last - leaf) % per_env  # the leaf's latest window now
    stored = held >= (-((-oldest) // period))[:, None]
    entered = held > ((before - size) // period)[:, None]
    return leaf, touched & (~stored | entered), stored


def whole_windows(oldest: _I, end: _I, size: int, period: int) -> tuple[_I, _I]:
    """Per stream holding steps `oldest .. end - 1`: the first start on a multiple of `period`
    at or after `oldest`, and the number of whole windows of `size` steps on that period."""
    first = -((-oldest) // period) * period
    number = (end - size - first) // period + 1
    return first, number * (number > 0)


def draw_whole_windows(
    key: PRNGKeyArray, first: np.ndarray, number: np.ndarray, period: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`batch_size` windows drawn uniformly, with replacement, among the `number[e]` windows
    of each stream from `first[e]` on (`whole_windows`), on the host in int64: `(env,
    start)`. A 64-bit random integer per draw, reduced modulo the total (bias at most
    `total / 2**64`). The total must be positive."""
    words = np.asarray(jax.random.bits(key, (2, batch_size), jnp.uint32)).astype(np.uint64)
    draws = (((words[0] << np.uint64(32)) | words[1]) % np.uint64(number.sum())).astype(np.int64)
    ends = np.cumsum(number)
    env = np.searchsorted(ends, draws, side="right")
    start = first[env] + (draws - (ends[env] - number[env])) * period
    return env, start
