"""The start drawing of `_sequences.py` against brute-force enumeration of every start."""

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings

from .helpers import assert_frequencies, assert_tree_equal


# Fixed shapes, so that compiled functions are reused across examples: five envs (windows of
# length 0 stand for fewer envs), one batch size, and T in 1..6 (static). Every test goes
# through the one function `_run`, so the file compiles it at most six times (on a loaded
# 2-core machine each compilation takes seconds).
NUM_ENVS = 5
MAX_LENGTH = 12
DRAWS = 2**16
POWERS = [0.0, 0.5, 1.0, 2.0, -1.0]

any_lengths_st = st.lists(st.integers(0, MAX_LENGTH), min_size=NUM_ENVS, max_size=NUM_ENVS)
lengths_st = any_lengths_st.filter(any)  # every window empty: see the test of its own
t_st = st.integers(1, 6)


def _sequences():
    # Imported late: conftest's jaxtyping hook must be in place before `dejax_eqx` is imported.
    from dejax_eqx import _sequences

    return _sequences


@functools.partial(jax.jit, static_argnums=2)
def _run(words, lengths, t, power):
    """`starts_from_bits` and `env_log_weights` (which share their set-up)."""
    s = _sequences()
    return s.starts_from_bits(words, lengths, t, power), s.env_log_weights(lengths, t, power)


_key_words = jax.jit(lambda key: jax.random.bits(key, (4, DRAWS), jnp.uint32))


def run(lengths, t: int, power: float, *, seed: int = 0, words=None):
    """`(starts, log_weights)` as NumPy arrays. `words` defaults to those `draw_starts` makes
    from `jax.random.key(seed)` (`test_draw_starts_is_starts_from_bits_on_the_key_s_words`)."""
    words = _key_words(jax.random.key(seed)) if words is None else jnp.asarray(words, jnp.uint32)
    out = _run(words, jnp.asarray(lengths, jnp.int32), t, jnp.asarray(power, jnp.float32))
    return jax.tree.map(np.asarray, out)


def enumerate_starts(lengths, t: int, power: float) -> dict:
    """`{(env, offset): (remaining, weight)}` for every start, in float64: offset `i` of a
    window of `L` steps has `r = min(L - i, T)` steps left and weight `r ** power`."""
    return {
        (env, i): (min(length - i, t), float(min(length - i, t)) ** power)
        for env, length in enumerate(lengths)
        for i in range(length)
    }


def assert_in_support(env, offset, remaining, lengths, t):
    """Every drawn start is a start of a non-empty window, with its exact remaining length."""
    lengths = np.asarray(lengths)
    assert ((0 <= env) & (env < len(lengths))).all()
    assert (lengths[env] > 0).all(), "drew an empty window"
    assert ((0 <= offset) & (offset < lengths[env])).all(), "offset outside the window"
    assert (remaining == np.minimum(lengths[env] - offset, t)).all(), "wrong remaining length"


def frequencies(env, offset, starts: dict, weight=lambda r, w: w):
    """Counts of the drawn starts and their enumerated probabilities, cell by cell."""
    cells = sorted(starts)
    index = np.full((NUM_ENVS, MAX_LENGTH), -1)
    for j, cell in enumerate(cells):
        index[cell] = j
    drawn = index[env, offset]
    assert (drawn >= 0).all()
    counts = np.bincount(drawn, minlength=len(cells))
    weights = np.asarray([weight(*starts[c]) for c in cells])
    return counts, weights / weights.sum()


# The chi-square test runs once per example, so its false-failure rate per example is 1e-6
# divided by the number of examples: at most 1e-6 per run of this test, in any profile.
def _alpha() -> float:
    return 1e-6 / settings.default.max_examples


@given(lengths=lengths_st, t=t_st, power=st.sampled_from(POWERS), seed=st.integers(0, 2**16))
def test_draws_match_enumeration(lengths, t, power, seed):
    (env, offset, remaining), _ = run(lengths, t, power, seed=seed)
    # (a) the support, exactly.
    assert_in_support(env, offset, remaining, lengths, t)
    # (b) the frequencies of 2**16 draws against the enumerated probabilities. The smallest
    # probability of any start here is above 1/1600 (power 2, T = 6, five windows of 12), so
    # every cell expects more than 40 draws and the chi-square approximation holds.
    counts, probabilities = frequencies(env, offset, enumerate_starts(lengths, t, power))
    assert_frequencies(counts, probabilities, alpha=_alpha())


@pytest.mark.parametrize(
    "wrong",
    [
        lambda r, w: 1.0,  # power 0
        lambda r, w: w * r**0.2,  # power 1.2
        lambda r, w: float(min(r + 1, 5)),  # one step too many at the window's end
    ],
    ids=["power-0", "power-1.2", "r-off-by-one"],
)
def test_frequency_test_detects_wrong_probabilities(wrong):
    # The test above must be able to fail: draws with power 1 are rejected against slightly
    # different weights with the same number of draws and the same false-failure rate.
    lengths, t = [0, 3, 12, 5, 1], 5
    (env, offset, _), _ = run(lengths, t, 1.0, seed=7)
    counts, probabilities = frequencies(env, offset, enumerate_starts(lengths, t, 1.0), wrong)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(counts, probabilities, alpha=1e-6 / 150)


_edge_words = [0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1]
_word = st.sampled_from(_edge_words) | st.integers(0, 2**32 - 1)


@given(
    lengths=lengths_st,
    t=t_st,
    power=st.sampled_from([*POWERS, 1000.0, -1000.0]),
    words=st.lists(_word, min_size=4 * 16, max_size=4 * 16),
)
def test_extreme_random_words_stay_in_support(lengths, t, power, words):
    # Words at the ends of their range put the uniforms at 0 and at 1 - 2**-23, where an
    # inverse CDF could step past the last non-empty env or past the end of the table. Sixteen
    # rows of words, repeated to the fixed batch size.
    words = np.tile(np.asarray(words, np.uint32).reshape(4, 16), (1, DRAWS // 16))
    starts, _ = run(lengths, t, power, words=words)
    assert_in_support(*starts, lengths, t)


@given(
    lengths=any_lengths_st,
    t=t_st,
    power=st.sampled_from([*POWERS, 30.0, -30.0, 1000.0, -1000.0]),
)
def test_env_log_weights_match_enumeration(lengths, t, power):
    _, got = run(lengths, t, power)
    starts = enumerate_starts(lengths, t, 0.0)
    # Exact log weights in float64: log sum_i r_i ** p = logsumexp(p log r_i).
    want = np.full(NUM_ENVS, -np.inf)
    for env in range(NUM_ENVS):
        rs = [r for (e, _), (r, _) in starts.items() if e == env]
        if rs:
            want[env] = scipy.special.logsumexp(power * np.log(rs))
    empty = np.asarray(lengths) == 0
    assert (got[empty] == -np.inf).all(), "an empty window must weigh exactly 0"
    if empty.all():
        return
    # float32 rounding of p log r, of the exp/log round trip and of the sums of at most 12
    # terms.
    tol = 1e-5 * (1 + abs(power) * math.log(t) + math.log(MAX_LENGTH))
    # Envs lighter than 1e-30 of the heaviest may underflow to -inf (never drawn), or not.
    got, want = got[~empty], want[~empty]
    light = want < want.max() - 30 * math.log(10)
    close = np.abs(got - want) <= tol
    assert (close | (light & (got == -np.inf))).all(), (got, want)
    # And the sampler's env probabilities are the enumerated ones.
    np.testing.assert_allclose(
        scipy.special.softmax(got), scipy.special.softmax(want), rtol=1e-4, atol=1e-7
    )


def test_all_windows_empty_gives_in_bounds_nothing():
    (env, offset, remaining), log_weights = run([0] * NUM_ENVS, 3, 1.0)
    assert (log_weights == -np.inf).all()
    assert (env == NUM_ENVS - 1).all() and (offset == 0).all() and (remaining == 0).all()


def test_draw_starts_is_starts_from_bits_on_the_key_s_words():
    # So that the tests above, which call `starts_from_bits` on those words, cover `draw_starts`.
    from dejax_eqx._sequences import draw_starts

    lengths = jnp.asarray([0, 3, 12, 5, 1], jnp.int32)
    key, power = jax.random.key(11), jnp.asarray(1.0, jnp.float32)
    starts = jax.jit(draw_starts, static_argnums=(2, 3))(key, lengths, DRAWS, 4, power)
    (env, offset, remaining), _ = run(lengths, 4, 1.0, seed=11)
    assert_tree_equal(tuple(np.asarray(x) for x in starts), (env, offset, remaining))


def test_random_number_helpers():
    from dejax_eqx._sequences import _below, _unit_float

    below, unit_float = jax.jit(_below), jax.jit(_unit_float)  # one compilation each
    rng = np.random.default_rng(0)
    high, low = (rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32) for _ in "hl")
    for n in [0, 1, 2, 3, 7, 1000, 2**16 - 1, 2**16, 2**16 + 1, 2**31 - 1]:
        got = np.asarray(below(jnp.asarray(high), jnp.asarray(low), jnp.full(5000, n, jnp.int32)))
        if n == 0:  # no integer in [0, 0): 0 by convention
            want = [0] * 5000
        elif n <= 2**16:  # the exact 64-bit remainder
            want = [(int(h) * 2**32 + int(lo)) % n for h, lo in zip(high, low)]
        else:
            want = (low.astype(np.int64) % n).tolist()
        assert got.tolist() == want, n
    # Bit for bit what jax.random.uniform makes from the same bits; never 1.
    key = jax.random.key(3)
    words = jax.random.bits(key, (1000,), jnp.uint32)
    assert_tree_equal(unit_float(words), jax.random.uniform(key, (1000,)))
    top = unit_float(words.at[0].set(2**32 - 1))
    assert float(top[0]) == 1 - 2**-23
