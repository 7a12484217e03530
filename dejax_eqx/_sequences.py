"""Drawing sequence starts from per-env windows: pure functions of the window lengths.

Env `e` has a window of `lengths[e]` steps, oldest first. A start is a pair `(e, i)`,
`0 <= i < lengths[e]`, with `r = min(lengths[e] - i, T)` real steps before the window ends,
and weight `r ** power`. These functions know nothing of storage: the caller turns a start
into slots (for `TrajectoryBuffer`, ring arithmetic from `_storage.py`). The method is
explained in `dejax_eqx/README.md`.

Later policies (starts on a period, only full starts, episode boundaries) are meant to enter
as keyword-only arguments of `draw_starts`/`starts_from_bits`/`env_log_weights`, with the
defaults giving today's draw.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float32, Int, PRNGKeyArray, UInt32


WORDS_PER_ROW = 4
"""Random 32-bit words `starts_from_bits` uses per row: two uniforms and a 64-bit integer."""


class Starts(NamedTuple):
    """Drawn starts, one per row. `env[b]` is the env, `offset[b]` the start's position in that
    env's window (0 is the oldest step), `remaining[b] = min(lengths[env] - offset, T)` the
    number of real steps of the sequence, in `[1, T]` (0 only when every window is empty)."""

    env: Int[Array, " batch"]
    offset: Int[Array, " batch"]
    remaining: Int[Array, " batch"]


class _Table(NamedTuple):
    full: Int[Array, " num_envs"]  # F_e: starts with T real steps
    tail: Int[Array, " num_envs"]  # k_e: one start for each r in 1 .. k_e
    log_s: Float[Array, " T"]  # log S[0 .. T-1], S[k] = w(1) + ... + w(k)
    log_env: Float[Array, " num_envs"]  # log W_e


def _unit_float(bits: UInt32[Array, " n"]) -> Float[Array, " n"]:
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


def _below(
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


def _table(lengths: Int[Array, " num_envs"], T: int, power: Float32[Array, ""]) -> _Table:
    # Start (e, i) has weight w(r) = r**p, r = min(L_e - i, T) in 1..T. Per env there are
    # F_e = max(L_e - T + 1, 0) starts with r = T and one start for each r in 1..k_e,
    # k_e = min(L_e, T - 1). With S[k] = w(1) + ... + w(k), env e weighs
    # W_e = F_e w(T) + S[k_e]. Weights are handled as logarithms, so that no power
    # overflows, and an empty env weighs exactly 0 (log W_e = -inf) for every power.
    log_w = power * jnp.log(jnp.arange(1, T + 1, dtype=jnp.float32))  # log w(1..T)
    full = jnp.maximum(lengths - (T - 1), 0)
    tail = jnp.minimum(lengths, T - 1)
    # log S[0..T-1] (S[0] = 0) from one cumulative sum, scaled by the largest term any env
    # uses, w(max k_e) (w is monotone in r): so no entry in use overflows and the largest
    # one in use is >= 1. Entries that underflow to 0 belong to envs whose weight is below
    # 1e-38 of another's.
    shift = jnp.maximum(0.0, power * jnp.log(jnp.maximum(jnp.max(tail), 1).astype(jnp.float32)))
    s = jnp.cumsum(jnp.exp(log_w[:-1] - shift))
    log_s = jnp.log(jnp.concatenate([jnp.zeros(1), s])) + shift
    log_env = jnp.logaddexp(jnp.log(full.astype(jnp.float32)) + log_w[-1], log_s[tail])
    return _Table(full, tail, log_s, log_env)


def env_log_weights(
    lengths: Int[Array, " num_envs"], sequence_length: int, power: Float32[Array, ""]
) -> Float[Array, " num_envs"]:
    """The log of each env's total start weight, `log W_e = log sum_i min(L_e - i, T) ** power`,
    as the sampler computes it: env `e` is drawn with probability `W_e / sum(W)`.

    **Arguments:**

    - `lengths`: an int32 array of shape `(num_envs,)`, the window lengths, each `>= 0`.
    - `sequence_length`: `T`, a positive Python int (static).
    - `power`: a finite float32 scalar (may be traced).

    **Returns:** a float32 array of shape `(num_envs,)`: exactly `-inf` for an empty window,
    for every power. Accurate to float32 rounding (of order `|power| · log T · 2**-24`) for
    every env whose weight is at least about `1e-37` of the heaviest env's; a lighter env may
    come out as `-inf`, which is what the sampler then uses (it is never drawn).
    """
    return _table(lengths, sequence_length, power).log_env


def starts_from_bits(
    bits: UInt32[Array, "4 batch"],
    lengths: Int[Array, " num_envs"],
    sequence_length: int,
    power: Float32[Array, ""],
) -> Starts:
    """Draw one start per column of `bits`, with probability proportional to
    `min(L_e - i, T) ** power` over all envs `e` and offsets `0 <= i < L_e` together.

    O(num_envs + T) set-up, then O(log num_envs + log T) per row.

    **Arguments:**

    - `bits`: uniformly random uint32 words, `WORDS_PER_ROW` per row, of shape
        `(4, batch_size)`: rows 0 and 1 give the uniforms for the env and for the kind of
        start, rows 2 and 3 the 64-bit integer for the offset of a full start.
    - `lengths`, `sequence_length`, `power`: as in `env_log_weights`.

    **Returns:** a `Starts` of int32 arrays of shape `(batch_size,)`. Empty windows are never
    drawn. If every window is empty the result is meaningless but in bounds (`env` is
    `num_envs - 1`, `offset` and `remaining` are 0) and nothing raises: the caller checks.
    """
    T = sequence_length
    full, tail, log_s, log_env = _table(lengths, T, power)
    u_env, u_kind = _unit_float(bits[0]), _unit_float(bits[1])

    # The env, by inverse CDF over W_e scaled so that the largest is 1. An empty env adds
    # exactly 0 to the running sum, so no x lands in it: `_count_at_most` picks e with
    # cdf[e-1] <= x < cdf[e]. And x < cdf[-1], since u <= 1 - 2**-23 keeps u * total at
    # least one float below total.
    top = jnp.max(log_env)
    cdf = jnp.cumsum(jnp.exp(log_env - jnp.where(jnp.isfinite(top), top, 0.0)))
    env = _count_at_most(cdf, u_env * cdf[-1])
    env = jnp.minimum(env, lengths.shape[0] - 1)  # only when every window is empty

    # The kind of start within env e, by inverse CDF over [tail r = 1, ..., tail r = k,
    # the F full starts]: x = u W_e falls in tail r when S[r-1] <= x < S[r], in the full
    # block when x >= S[k]. The table log S is shared by all envs and searched with
    # log x, so the only per-env value needed is log W_e.
    k = tail[env]
    below = jnp.minimum(_count_at_most(log_s[1:], jnp.log(u_kind) + log_env[env]), k)
    # With no full start, x >= S[k] = W_e only by rounding: it belongs to tail k.
    is_full = (below == k) & (full[env] > 0)
    remaining = jnp.where(is_full, T, jnp.minimum(below + 1, k))
    # Window offset: uniform among the full starts (0 .. F-1), else L - r.
    offset = _below(bits[2], bits[3], full[env])
    offset = jnp.where(is_full, offset, lengths[env] - remaining)
    return Starts(env, offset, remaining)


def draw_starts(
    key: PRNGKeyArray,
    lengths: Int[Array, " num_envs"],
    batch_size: int,
    sequence_length: int,
    power: Float32[Array, ""],
) -> Starts:
    """`starts_from_bits` on `(WORDS_PER_ROW, batch_size)` words from `key`.

    All the randomness comes from one `jax.random.bits` call, one PRNG kernel: on CPU every
    further call would cost about as much as the rest of a small draw.

    **Arguments:**

    - `key`: a JAX PRNG key.
    - `batch_size`: the number of rows, a positive Python int (static).
    - `lengths`, `sequence_length`, `power`: as in `env_log_weights`.

    **Returns:** a `Starts`, as `starts_from_bits`.
    """
    bits = jax.random.bits(key, (WORDS_PER_ROW, batch_size), jnp.uint32)
    return starts_from_bits(bits, lengths, sequence_length, power)
