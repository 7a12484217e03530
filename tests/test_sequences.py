"""The start drawing of `_sequences.py` against brute-force enumeration of every start."""

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from hypothesis import given

from .helpers import assert_frequencies, assert_tree_equal, profile_max_examples


# Fixed shapes, so that compiled functions are reused across examples: five envs (windows of
# length 0 stand for fewer envs), one batch size, and a fixed list of laws (static). Every test
# goes through the one function `_run`, so the file compiles it at most once per law (on a
# loaded 2-core machine each compilation takes seconds).
NUM_ENVS = 5
MAX_LENGTH = 12
DRAWS = 2**16
POWERS = [0.0, 0.5, 1.0, 2.0, -1.0]


def _law(*args, **kwargs):
    from dejax_eqx._sequences import Law

    return Law(*args, **kwargs)


# Plain windows of 1, 4 and 6 steps (today's law), periods that divide the window and periods
# that exceed it, a least number of real steps (burn-in), and strict windows.
LAWS = [
    _law(1),
    _law(4),
    _law(6),
    _law(5, period=2),
    _law(5, period=3, min_real=3),
    _law(4, strict=True),
    _law(6, period=4, strict=True),
    _law(3, period=7, min_real=2),
]
LAW_IDS = [f"W{w.size}-P{w.period}-min{w.min_real}{'-strict' if w.strict else ''}" for w in LAWS]

any_lengths_st = st.lists(st.integers(0, MAX_LENGTH), min_size=NUM_ENVS, max_size=NUM_ENVS)
lengths_st = any_lengths_st.filter(any)  # every window empty: see the test of its own
law_st = st.sampled_from(LAWS)


@st.composite
def windows_st(draw, lengths=lengths_st):
    """`(lengths, phase, law)`: each env's step count modulo the law's period is its phase."""
    law = draw(law_st)
    phase = draw(st.lists(st.integers(0, law.period - 1), min_size=NUM_ENVS, max_size=NUM_ENVS))
    return draw(lengths), phase, law


def _sequences():
    # Imported late: conftest's jaxtyping hook must be in place before `dejax_eqx` is imported.
    from dejax_eqx import _sequences

    return _sequences


@functools.partial(jax.jit, static_argnums=3)
def _run(words, lengths, phase, law, power):
    """`starts_from_bits`, `env_log_weights` and `admissible` (which share their set-up)."""
    s = _sequences()
    return (
        s.starts_from_bits(words, lengths, phase, law, power),
        s.env_log_weights(lengths, phase, law, power),
        s.admissible(lengths, phase, law),
    )


_key_words = jax.jit(lambda key: jax.random.bits(key, (4, DRAWS), jnp.uint32))


def run(lengths, phase, law, power: float, *, seed: int = 0, words=None):
    """`(starts, log_weights, admissible)` as NumPy arrays. `words` defaults to those
    `draw_starts` makes from `jax.random.key(seed)`
    (`test_draw_starts_is_starts_from_bits_on_the_key_s_words`)."""
    words = _key_words(jax.random.key(seed)) if words is None else jnp.asarray(words, jnp.uint32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = _run(words, i32(lengths), i32(phase), law, jnp.asarray(power, jnp.float32))
    return jax.tree.map(np.asarray, out)


def enumerate_starts(lengths, phase, law, power: float) -> dict:
    """`{(env, back): (remaining, weight)}` for every admissible start, in float64: the start
    `back` steps behind the cursor (1 = the newest step) has `r = min(back, W)` real steps. It
    is admissible when `back ≡ phase (mod P)` (its absolute step number, `count - back`, is a
    multiple of P), and, strict, when `r == W`, else when `r >= min_real`."""
    out = {}
    for env, (length, ph) in enumerate(zip(lengths, phase)):
        for back in range(1, length + 1):
            r = min(back, law.size)
            if (back - ph) % law.period or (law.strict and r < law.size) or r < law.min_real:
                continue
            out[(env, back)] = (r, 1.0 if law.strict else float(r) ** power)
    return out


def assert_in_support(env, back, remaining, starts: dict):
    """Every drawn start is an admissible start, with its exact number of real steps."""
    drawn = set(zip(env.tolist(), back.tolist(), remaining.tolist()))
    allowed = {(e, b, r) for (e, b), (r, _) in starts.items()}
    assert drawn <= allowed, f"drew inadmissible starts: {sorted(drawn - allowed)[:5]}"


def frequencies(env, back, starts: dict, weight=lambda r, w: w):
    """Counts of the drawn starts and their enumerated probabilities, cell by cell."""
    cells = sorted(starts)
    index = np.full((NUM_ENVS, MAX_LENGTH + 1), -1)
    for j, cell in enumerate(cells):
        index[cell] = j
    drawn = index[env, back]
    assert (drawn >= 0).all(), "a draw outside the enumerated starts"
    counts = np.bincount(drawn, minlength=len(cells))
    weights = np.asarray([weight(*starts[c]) for c in cells])
    return counts, weights / weights.sum()


# The chi-square test runs once per example, so its false-failure rate per example is 1e-6
# divided by the number of examples: at most 1e-6 per run of this test, in any profile.
def _alpha() -> float:
    return 1e-6 / profile_max_examples()


@given(windows=windows_st(), power=st.sampled_from(POWERS), seed=st.integers(0, 2**16))
def test_draws_match_enumeration(windows, power, seed):
    lengths, phase, law = windows
    starts = enumerate_starts(lengths, phase, law, power)
    (env, back, remaining), _, admissible = run(lengths, phase, law, power, seed=seed)
    want = [any(e == env_ for e, _ in starts) for env_ in range(NUM_ENVS)]
    assert admissible.tolist() == want
    if not starts:
        return  # see test_no_admissible_start_gives_in_bounds_nothing
    # (a) the support, exactly.
    assert_in_support(env, back, remaining, starts)
    # (b) the frequencies of 2**16 draws against the enumerated probabilities. The smallest
    # probability of any start here is above 1/2200 (power 2, W = 6, five windows of 12), so
    # every cell expects more than 29 draws and the chi-square approximation holds.
    counts, probabilities = frequencies(env, back, starts)
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
    lengths, phase, law = [0, 3, 12, 5, 1], [0] * NUM_ENVS, LAWS[2]
    (env, back, _), _, _ = run(lengths, phase, law, 1.0, seed=7)
    starts = enumerate_starts(lengths, phase, law, 1.0)
    counts, probabilities = frequencies(env, back, starts, wrong)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(counts, probabilities, alpha=1e-6 / 150)


@pytest.mark.parametrize(
    "wrong",
    [
        {"phase": [0] * NUM_ENVS},  # periods aligned to the window, not to the step count
        {"min_real": 1},  # starts with too few real steps allowed
        {"strict": True},  # only whole windows
    ],
    ids=["window-aligned", "no-min-real", "strict"],
)
def test_support_check_detects_a_wrong_law(wrong):
    # Draws under one law checked against the enumeration of a slightly different law.
    lengths, phase, law = [0, 3, 12, 5, 11], [1, 2, 0, 1, 2], LAWS[4]
    (env, back, remaining), _, _ = run(lengths, phase, law, 1.0, seed=8)
    other = law._replace(**{k: v for k, v in wrong.items() if k != "phase"})
    starts = enumerate_starts(lengths, wrong.get("phase", phase), other, 1.0)
    with pytest.raises(AssertionError, match="inadmissible|chi-square|outside"):
        assert_in_support(env, back, remaining, starts)
        assert_frequencies(*frequencies(env, back, starts), alpha=1e-6)


_edge_words = [0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1]
_word = st.sampled_from(_edge_words) | st.integers(0, 2**32 - 1)


@given(
    windows=windows_st(),
    power=st.sampled_from([*POWERS, 1000.0, -1000.0]),
    words=st.lists(_word, min_size=4 * 16, max_size=4 * 16),
)
def test_extreme_random_words_stay_in_support(windows, power, words):
    # Words at the ends of their range put the uniforms at 0 and at 1 - 2**-23, where an
    # inverse CDF could step past the last non-empty env or past the end of the table. Sixteen
    # rows of words, repeated to the fixed batch size.
    lengths, phase, law = windows
    starts = enumerate_starts(lengths, phase, law, 0.0)  # the support: the weights unused
    if not starts:
        return
    words = np.tile(np.asarray(words, np.uint32).reshape(4, 16), (1, DRAWS // 16))
    drawn, _, _ = run(lengths, phase, law, power, words=words)
    assert_in_support(*drawn, starts=starts)


@given(
    windows=windows_st(any_lengths_st),
    power=st.sampled_from([*POWERS, 30.0, -30.0, 1000.0, -1000.0]),
)
def test_env_log_weights_match_enumeration(windows, power):
    lengths, phase, law = windows
    _, got, _ = run(lengths, phase, law, power)
    starts = enumerate_starts(lengths, phase, law, 0.0)
    # Exact log weights in float64: log sum_i r_i ** p = logsumexp(p log r_i) (strict: every
    # start weighs 1).
    want = np.full(NUM_ENVS, -np.inf)
    for env in range(NUM_ENVS):
        rs = [r for (e, _), (r, _) in starts.items() if e == env]
        if rs:
            want[env] = scipy.special.logsumexp((0.0 if law.strict else power) * np.log(rs))
    none = want == -np.inf
    assert (got[none] == -np.inf).all(), "an env without starts must weigh exactly 0"
    if none.all():
        return
    # float32 rounding of p log r, of the exp/log round trip and of the sums of at most 12
    # terms.
    tol = 1e-5 * (1 + abs(power) * math.log(law.size) + math.log(MAX_LENGTH))
    # Envs lighter than 1e-30 of the heaviest may come out lighter still, down to -inf
    # (never drawn): parts of their weight may underflow.
    got, want = got[~none], want[~none]
    light = want < want.max() - 30 * math.log(10)
    close = np.abs(got - want) <= tol
    assert (close | (light & (got <= want + tol))).all(), (got, want)
    # And the sampler's env probabilities are the enumerated ones.
    np.testing.assert_allclose(
        scipy.special.softmax(got), scipy.special.softmax(want), rtol=1e-4, atol=1e-7
    )


@pytest.mark.parametrize(
    "lengths, law",
    [([0] * NUM_ENVS, LAWS[1]), ([3, 1, 0, 2, 3], LAWS[5]), ([2, 2, 1, 0, 2], LAWS[4])],
    ids=["empty", "short-for-strict", "short-for-min-real"],
)
def test_no_admissible_start_gives_in_bounds_nothing(lengths, law):
    (env, back, remaining), log_weights, admissible = run(lengths, [0] * NUM_ENVS, law, 1.0)
    assert not enumerate_starts(lengths, [0] * NUM_ENVS, law, 1.0)
    assert (log_weights == -np.inf).all() and not admissible.any()
    assert (env == NUM_ENVS - 1).all() and (back == 0).all() and (remaining == 0).all()


STRICT_LAWS = [law for law in LAWS if law.strict]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _draw_exactly(key, lengths, phase, law, max_length):
    from dejax_eqx._sequences import draw_starts

    power = jnp.zeros((), jnp.float32)  # unused by a strict law
    return draw_starts(key, lengths, phase, DRAWS, law, power, max_length=max_length)


@given(
    lengths=any_lengths_st,
    law=st.sampled_from(STRICT_LAWS),
    phase=st.lists(st.integers(0, 3), min_size=NUM_ENVS, max_size=NUM_ENVS),
    seed=st.integers(0, 2**16),
)
def test_strict_draws_in_integers_match_enumeration(lengths, law, phase, seed):
    # A strict law with a known max_length: `strict_starts_from_bits`, on two words a row.
    phase = [p % law.period for p in phase]
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    starts = enumerate_starts(lengths, phase, law, 0.0)
    drawn = _draw_exactly(jax.random.key(seed), i32(lengths), i32(phase), law, MAX_LENGTH)
    env, back, remaining = (np.asarray(x) for x in drawn)
    if not starts:  # nothing to draw: in bounds, and nothing
        assert (env == NUM_ENVS - 1).all() and (back == 0).all() and (remaining == 0).all()
        return
    assert_in_support(env, back, remaining, starts)
    # Every start alike. At most 5 envs of 12 steps: at most 45 starts, each expecting more
    # than 1,400 of the 2**16 draws.
    counts, probabilities = frequencies(env, back, starts)
    assert_frequencies(counts, probabilities, alpha=_alpha())


def test_strict_draws_in_integers_are_taken_only_when_the_starts_fit_int32():
    from dejax_eqx._sequences import draw_starts

    lengths, phase = jnp.asarray([3, 12, 0, 7, 9], jnp.int32), jnp.zeros(5, jnp.int32)
    key, power, law = jax.random.key(5), jnp.zeros((), jnp.float32), LAWS[5]
    floats = draw_starts(key, lengths, phase, 64, law, power)
    exact = draw_starts(key, lengths, phase, 64, law, power, max_length=MAX_LENGTH)
    too_many = draw_starts(key, lengths, phase, 64, law, power, max_length=2**31 // 5 + 1)
    assert_tree_equal(tuple(floats), tuple(too_many))  # 5 * max_length reaches 2**31
    assert not all(np.array_equal(a, b) for a, b in zip(floats, exact))


def test_draw_starts_is_starts_from_bits_on_the_key_s_words():
    # So that the tests above, which call `starts_from_bits` on those words, cover `draw_starts`.
    from dejax_eqx._sequences import draw_starts

    lengths = jnp.asarray([0, 3, 12, 5, 1], jnp.int32)
    phase = jnp.asarray([0, 1, 1, 0, 1], jnp.int32)
    key, power = jax.random.key(11), jnp.asarray(1.0, jnp.float32)
    law = LAWS[3]
    starts = jax.jit(draw_starts, static_argnums=(3, 4))(key, lengths, phase, DRAWS, law, power)
    drawn, _, _ = run(lengths, phase, law, 1.0, seed=11)
    assert_tree_equal(tuple(np.asarray(x) for x in starts), tuple(drawn))


def test_random_number_helpers():
    from dejax_eqx._sequences import uniform_below, unit_float

    below, unit_float = jax.jit(uniform_below), jax.jit(unit_float)  # one compilation each
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


def test_integers_below_reduces_one_call_s_two_words():
    from dejax_eqx._sequences import integers_below, uniform_below

    draw = jax.jit(integers_below, static_argnums=1)
    for seed, n in [(0, 0), (1, 1), (2, 7), (3, 100_000), (4, 2**31 - 1)]:
        key = jax.random.key(seed)
        got = np.asarray(draw(key, 300, jnp.asarray(n, jnp.int32)))
        high, low = jax.random.bits(key, (2, 300), jnp.uint32)
        want = np.asarray(uniform_below(high, low, jnp.full(300, n, jnp.int32)))
        assert got.dtype == np.int32 and got.tolist() == want.tolist(), n
        assert ((got >= 0) & (got < max(n, 1))).all(), n
