"""`RateLimiter` and `RateLimited`: the jitted law held to the law on Python ints (`Rate`).

- Model tests: random sequences of inserts and samples (some the law refuses) run through a
    jitted limiter and through `Rate` on Python ints side by side, from fresh counters and from
    counts past `2**32` and near `2**40`; every predicate, budget and count must agree.
- Deadlock: over a grid of small configurations, every accepted one has no reachable state
    in which neither a full insert nor a full sample may proceed, and every refused one has.
- Loops: an Anakin-style `lax.scan` whose learner runs exactly `sample_budget` updates in a
    `while_loop`, under `eqx.filter_jit(donate="all")`.
- `RateLimited` over every buffer kind: the same results as the bare buffer, counted.
- Save/load, and the counts carried by a `Dataset`.
"""

import functools
import json
import math
import os
import re
import struct
from fractions import Fraction
from typing import Any, cast

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx import RateLimited, RateLimiter
from dejax_eqx._int64 import to_int
from dejax_eqx._rates import Rate, UNLIMITED
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import initialize, invariant, rule, RuleBasedStateMachine

from .helpers import machine_tests, profile_max_examples, rotation, SLOW, tree_equal


FAULT = RuntimeError  # what `eqx.error_if` raises, eagerly and under `jit`

# A small fixed catalogue, so that each compiled program is reused across examples: both
# bounds, one bound of either kind, none, a fractional ratio, and batch sizes above 1.
CONFIGS = {
    "ratio": lambda: RateLimiter.sample_to_insert_ratio(
        4, 10, 12, insert_batch_size=3, sample_batch_size=5
    ),
    "fraction": lambda: RateLimiter.sample_to_insert_ratio(0.3, 7, 2.5, insert_batch_size=2),
    "queue": lambda: RateLimiter.queue(5, insert_batch_size=2, sample_batch_size=3),
    "min_size": lambda: RateLimiter.min_size(6),
    "max_only": lambda: RateLimiter(2, 4, None, 20, insert_batch_size=2),
    "min_only": lambda: RateLimiter(Fraction(1, 3), 5, -2, None, sample_batch_size=2),
}
STEPS = 16  # operations per example: one compiled scan per configuration


def _observe(limiter, n_insert, n_sample):
    i, b = limiter.insert_batch_size, limiter.sample_batch_size
    predicates = jnp.stack([limiter.can_insert(n_insert), limiter.can_sample(n_sample)])
    budgets = jnp.stack(
        [
            limiter.sample_budget(1),
            limiter.sample_budget(b),
            limiter.insert_budget(1),
            limiter.insert_budget(i),
        ]
    )
    return predicates, budgets, jnp.stack([limiter.inserts, limiter.samples, limiter.balance])


@functools.cache
def _scan(name: str):
    """A jitted run of `STEPS` operations `(kind, n)` (0: insert, 1: sample) on a limiter of
    configuration `name`: each is observed, then done if the law allows it."""
    template = CONFIGS[name]()
    i, b = template.insert_batch_size, template.sample_batch_size

    def step(limiter, op):
        kind, n = op
        n_insert, n_sample = jnp.minimum(n, i), jnp.minimum(n, b)
        out = _observe(limiter, n_insert, n_sample)
        do_insert = (kind == 0) & out[0][0]
        do_sample = (kind == 1) & out[0][1]
        limiter = jax.lax.cond(do_insert, lambda r: r.insert(n_insert), lambda r: r, limiter)
        limiter = jax.lax.cond(do_sample, lambda r: r.sample(n_sample), lambda r: r, limiter)
        return limiter, out

    return eqx.filter_jit(lambda limiter, kinds, ns: jax.lax.scan(step, limiter, (kinds, ns)))


@functools.cache
def _count(name: str, kind: str):
    """The jitted `insert(n)` or `sample(n)` with a traced `n`."""
    return eqx.filter_jit(lambda limiter, n: getattr(limiter, kind)(n))


def _model(rate: Rate, inserts: int, samples: int, kinds, ns):
    """What `_scan` must return, on Python ints."""
    i, b = rate.insert_batch_size, rate.sample_batch_size
    out = []
    for kind, n in zip(kinds, ns):
        n_insert, n_sample = min(n, i), min(n, b)
        allowed = (
            rate.can_insert(inserts, samples, n_insert),
            rate.can_sample(inserts, samples, n_sample),
        )
        budgets = (
            rate.sample_budget(inserts, samples, 1),
            rate.sample_budget(inserts, samples, b),
            rate.insert_budget(inserts, samples, 1),
            rate.insert_budget(inserts, samples, i),
        )
        out.append((allowed, budgets, (inserts, samples, rate.balance(inserts, samples))))
        if kind == 0 and allowed[0]:
            inserts += n_insert
        if kind == 1 and allowed[1]:
            samples += n_sample
    return out, (inserts, samples)


def _start(rate: Rate, inserts: int, balance: int) -> tuple[int, int]:
    """Counts with `inserts` and a scaled balance at or just above `balance`."""
    samples = max(0, -((balance - inserts * rate.p) // rate.scale))
    return inserts, samples


@st.composite
def _runs(draw):
    name = draw(st.sampled_from(sorted(CONFIGS)))
    rate = CONFIGS[name]().rate
    inserts = draw(
        st.one_of(
            st.just(0),
            st.integers(0, 2 * rate.min_size_to_sample),
            st.integers(2**32 - 40, 2**32 + 40),  # the low word carries
            st.integers(2**40, 2**40 + 1000),
        )
    )
    low = -60 if rate.scaled_min is None else rate.scaled_min
    high = 60 if rate.scaled_max is None else rate.scaled_max
    balance = draw(st.integers(low - 3 * rate.scale, high + 3 * rate.scale))
    start = (0, 0) if inserts == 0 else _start(rate, inserts, balance)
    most = max(rate.insert_batch_size, rate.sample_batch_size)
    kinds = draw(st.lists(st.integers(0, 1), min_size=STEPS, max_size=STEPS))
    ns = draw(st.lists(st.integers(0, most), min_size=STEPS, max_size=STEPS))
    return name, start, kinds, ns


@SLOW
@given(run=_runs())
def test_jitted_limiter_follows_the_law_on_python_ints(run):
    name, (inserts, samples), kinds, ns = run
    limiter = CONFIGS[name]().with_counts(inserts, samples)
    rate = limiter.rate
    assert limiter.counts() == (inserts, samples)
    final, (predicates, budgets, words) = _scan(name)(
        limiter, jnp.asarray(kinds, jnp.int32), jnp.asarray(ns, jnp.int32)
    )
    expected, end = _model(rate, inserts, samples, kinds, ns)
    for t, (allowed, budget, counters) in enumerate(expected):
        assert tuple(predicates[t].tolist()) == allowed, (t, counters)
        assert tuple(budgets[t].tolist()) == budget, (t, counters)
        assert tuple(to_int(w) for w in words[t]) == counters, t
    assert final.counts() == end
    assert to_int(final.balance) == rate.balance(*end)
    # The first operation the law refuses raises, naming it, and counts nothing.
    refused = [
        (kind, n, state)
        for kind, n, (allowed, _, state) in zip(kinds, ns, expected)
        if not allowed[kind] and n <= (rate.insert_batch_size, rate.sample_batch_size)[kind]
    ]
    if refused:
        kind, n, (i, s, _) = refused[0]
        method = ("insert", "sample")[kind]
        with pytest.raises(FAULT, match=f"`RateLimiter.{method}`: the rate limit does not"):
            _count(name, method)(limiter.with_counts(i, s), jnp.asarray(n, jnp.int32))


def test_python_ints_and_traced_counts_agree_eagerly():
    limiter = CONFIGS["ratio"]()
    rate = limiter.rate
    inserts = samples = 0
    for n in [3, 3, 3, 0, 2]:  # filling to 9, then crossing 10 at a balance of 44 <= 52
        assert bool(limiter.can_insert(n)) == rate.can_insert(inserts, samples, n)
        limiter, inserts = limiter.insert(n), inserts + n
        assert limiter.counts() == (inserts, samples)
    for n in [np.int32(5), jnp.asarray(4, jnp.uint8), 5]:
        assert bool(limiter.can_sample(n)) == rate.can_sample(inserts, samples, int(n))
        limiter, samples = limiter.sample(n), samples + int(n)
    assert limiter.counts() == (inserts, samples) == (11, 14)
    assert int(limiter.sample_budget(5)) == rate.sample_budget(11, 14, 5) == 0  # at 30, min 28
    assert int(limiter.sample_budget(1)) == 2
    with pytest.raises(FAULT, match="`RateLimiter.sample`: the rate limit does not allow"):
        limiter.sample(3)
    with pytest.raises(FAULT, match="`RateLimiter.insert`: the rate limit does not allow"):
        limiter.insert(3).insert(3)  # 30 + 12 + 12 > 52


# ---------------------------------------------------------------------------------------------
# Deadlock


def _reverb_law(rate: Rate):
    """Reverb's law as it states it: an independent reference for `Rate`, free of the import
    hook's checks (the explorer below calls it a great many times). Both sides of each
    inequality are multiplied by the denominators, so that the comparisons are of ints."""
    spi, size, low, high = (
        rate.samples_per_insert,
        rate.min_size_to_sample,
        rate.min_diff,
        rate.max_diff,
    )
    d = math.prod(x.denominator for x in (spi, low, high) if x is not None)
    p, lo, hi = (None if x is None else int(x * d) for x in (spi, low, high))

    def can_insert(inserts, samples, n):
        if inserts + n <= size or hi is None:
            return True
        return (inserts + n) * p - samples * d <= hi  # (I + n) spi - S <= max_diff

    def can_sample(inserts, samples, n):
        return inserts >= size and (lo is None or inserts * p - (samples + n) * d >= lo)

    return can_insert, can_sample


@given(
    config=st.sampled_from(sorted(CONFIGS)),
    inserts=st.integers(0, 40),
    samples=st.integers(0, 120),
    n=st.integers(0, 5),
)
def test_rate_is_reverbs_law(config, inserts, samples, n):
    rate = CONFIGS[config]().rate
    can_insert, can_sample = _reverb_law(rate)
    assert rate.can_insert(inserts, samples, n) == can_insert(inserts, samples, n)
    assert rate.can_sample(inserts, samples, n) == can_sample(inserts, samples, n)
    b = rate.sample_batch_size
    runs = 0
    while can_sample(inserts, samples + runs * b, b) and runs < UNLIMITED:
        runs += 1
        if runs > 1000:
            runs = UNLIMITED
    assert rate.sample_budget(inserts, samples, b) == runs
    i = rate.insert_batch_size
    runs = 0
    while can_insert(inserts + runs * i, samples, i) and runs < UNLIMITED:
        runs += 1
        if runs > 1000:
            runs = UNLIMITED
    assert rate.insert_budget(inserts, samples, i) == runs


def _explore(rate: Rate, slack: int = 12) -> list[tuple[int, int]]:
    """Every reachable state `(inserts, samples)` (inserts of 1 ..
    insert_batch_size, samples of 1 .. sample_batch_size, within a box) in which neither an
    insert of insert_batch_size nor a sample of sample_batch_size may proceed."""
    i, b = rate.insert_batch_size, rate.sample_batch_size
    can_insert, can_sample = _reverb_law(rate)
    most_inserts = rate.min_size_to_sample + 4 * i + slack
    most_ahead = rate.samples_per_insert
    seen, todo, stuck = {(0, 0)}, [(0, 0)], []
    while todo:
        state = inserts, samples = todo.pop()
        if not can_insert(*state, i) and not can_sample(*state, b):
            stuck.append(state)
        moves = [(inserts + n, samples) for n in range(1, i + 1) if can_insert(*state, n)]
        moves += [(inserts, samples + n) for n in range(1, b + 1) if can_sample(*state, n)]
        for new in moves:
            inside = new[0] <= most_inserts and new[1] <= new[0] * most_ahead + slack
            if inside and new not in seen:
                seen.add(new)
                todo.append(new)
    return stuck


@SLOW
def test_deadlock_check_is_exact_on_a_grid_of_small_configurations():
    accepted = refused = 0
    grid = [
        (spi, size, low, high, i, b)
        for spi in (Fraction(1, 2), 1, Fraction(3, 2), 3)
        for size in (1, 3)
        for low in (None, -2, 0, 1, 2.5)
        for high in (None, 0, 2, 3, 5.5, 8)
        for i in (1, 2, 3)
        for b in (1, 2)
        if low is None or high is None or low <= high
    ]
    for spi, size, low, high, i, b in grid:
        try:
            rate = Rate.make(spi, size, low, high, i, b, "test")
        except ValueError as error:
            assert "this configuration can deadlock" in str(error)
            refused += 1
            lower, upper = (None if x is None else Fraction(x) for x in (low, high))
            rate = Rate(Fraction(spi), size, lower, upper, i, b)  # unchecked
            assert _explore(rate), (spi, size, low, high, i, b)  # a real deadlock
            continue
        accepted += 1
        assert not _explore(rate), (spi, size, low, high, i, b)
    assert accepted > 500 and refused > 300  # both kinds were explored


def test_deadlocking_configurations_are_refused_saying_why():
    with pytest.raises(ValueError, match=re.escape("`RateLimiter.queue`: this configuration")):
        RateLimiter.queue(3, insert_batch_size=2, sample_batch_size=3)
    with pytest.raises(ValueError, match=r"the window from min_diff = 39 to max_diff = 41"):
        RateLimiter.sample_to_insert_ratio(4, 10, 1)
    with pytest.raises(ValueError, match=r"Widen it to at least 9"):
        RateLimiter.sample_to_insert_ratio(4, 10, 1, sample_batch_size=5)
    with pytest.raises(ValueError, match=r"an insert of 3 items that crosses min_size_to_sample"):
        RateLimiter(1, 10, 0, 5, insert_batch_size=3)
    RateLimiter.queue(4, insert_batch_size=2, sample_batch_size=3)  # just wide enough


# ---------------------------------------------------------------------------------------------
# Errors


def test_constructor_errors_quote_the_call():
    cases = [
        (lambda: RateLimiter(0, 1, None, None), "`RateLimiter`: `samples_per_insert` must be"),
        (lambda: RateLimiter(1, 0, None, None), "`min_size_to_sample` must be in [1, 2**31 - 1]"),
        (lambda: RateLimiter(1, 1, 2, 1), "`min_diff` = 2 is above `max_diff` = 1"),
        (lambda: RateLimiter(1, 1, math.nan, None), "`min_diff` must be finite"),
        (lambda: RateLimiter(1, 1, None, 2.0**62), "does not fit 62 bits"),
        (lambda: RateLimiter(2**40, 2**30, None, None), "does not fit 62 bits"),
        (lambda: RateLimiter(Fraction(1, 2**31 + 1), 1, None, None), "above 2**31"),
        (
            lambda: RateLimiter.sample_to_insert_ratio(1, 1, -1),
            "`RateLimiter.sample_to_insert_ratio(error_buffer=...)` must be >= 0",
        ),
        (
            lambda: RateLimiter.sample_to_insert_ratio(1, 1, (1, 2, 3)),
            "`RateLimiter.sample_to_insert_ratio(error_buffer=...)` must be a number or a pair",
        ),
        (lambda: RateLimiter.queue(0), "`RateLimiter.queue(size=...)` must be positive"),
        (lambda: RateLimiter.min_size(-1), "`RateLimiter.min_size`: `min_size_to_sample`"),
    ]
    for make, message in cases:
        with pytest.raises((ValueError, TypeError)) as error:
            make()
        assert message in str(error.value), (message, str(error.value))


def test_reverb_constructors():
    r = RateLimiter.sample_to_insert_ratio(0.25, 100, 8).rate
    assert (r.samples_per_insert, r.min_diff, r.max_diff) == (Fraction(1, 4), 17, 33)
    r = RateLimiter.sample_to_insert_ratio(2, 10, (-math.inf, 30)).rate  # Reverb's pair form
    assert (r.min_diff, r.max_diff) == (None, 30)
    r = RateLimiter.min_size(7).rate
    assert (r.samples_per_insert, r.min_size_to_sample, r.min_diff, r.max_diff) == (
        1,
        7,
        None,
        None,
    )
    r = RateLimiter.queue(10).rate
    assert (r.min_size_to_sample, r.min_diff, r.max_diff) == (1, 0, 10)
    limiter = RateLimiter(0.1, 3, -1.5, math.inf)
    assert (limiter.samples_per_insert, limiter.min_diff, limiter.max_diff) == (
        Fraction(1, 10),
        Fraction(-3, 2),
        None,
    )
    assert (limiter.min_size_to_sample, limiter.insert_batch_size, limiter.sample_batch_size) == (
        3,
        1,
        1,
    )


def test_amounts_out_of_range_are_refused():
    limiter = CONFIGS["ratio"]()  # insert_batch_size 3, sample_batch_size 5
    with pytest.raises(ValueError, match=r"`RateLimiter.insert`: 4 items to insert, above "):
        limiter.insert(4)
    with pytest.raises(ValueError, match="a larger insert could deadlock it"):
        limiter.can_insert(4)
    with pytest.raises(ValueError, match=r"`RateLimiter.sample`: 6 rows to sample, above sample_"):
        limiter.sample(6)
    with pytest.raises(ValueError, match=r"`RateLimiter.insert`: `n` must be non-negative, got"):
        limiter.insert(-1)
    with pytest.raises(ValueError, match=r"sample_budget\(batch_size=...\)` is 6, above"):
        limiter.sample_budget(6)
    with pytest.raises(ValueError, match=r"insert_budget\(batch_size=...\)` must be positive"):
        limiter.insert_budget(0)
    with pytest.raises(TypeError):  # (the import hook's check of the annotation, or ours)
        limiter.insert(np.asarray(1.0))
    traced = _count("ratio", "insert")
    for n in (4, -1):
        with pytest.raises(FAULT, match=r"`RateLimiter.insert`: `n` must be in \[0, insert_batch"):
            traced(limiter, jnp.asarray(n, jnp.int32))
    with pytest.raises(FAULT, match=r"`n` must be in \[0, sample_batch_size = 5\]"):
        eqx.filter_jit(lambda r, n: r.can_sample(n))(limiter, jnp.asarray(9, jnp.uint32))


def test_counts_and_with_counts_are_checked_on_the_host():
    limiter = CONFIGS["ratio"]()
    big = limiter.with_counts(2**61, 2**63 - 40)  # a balance of 40
    assert big.counts() == (2**61, 2**63 - 40) and to_int(big.balance) == 40
    assert int(big.sample_budget(5)) == 2 and int(big.insert_budget(3)) == 1
    with pytest.raises(ValueError, match=r"`RateLimiter.with_counts\(inserts=...\)` must be at"):
        limiter.with_counts(2**63, 0)
    with pytest.raises(ValueError, match="must be non-negative"):
        limiter.with_counts(0, -1)
    with pytest.raises(TypeError):
        limiter.with_counts(0, 1.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"outside \(-2\*\*62, 2\*\*62\)"):
        limiter.with_counts(2**61, 0)
    with pytest.raises(TypeError, match="`RateLimiter.counts`: the counters are traced"):
        jax.jit(lambda r: r.counts())(limiter)


def test_counters_that_would_leave_their_range_raise():
    # No `max_diff`: the balance grows with every insert, until it would leave 62 bits.
    limiter = RateLimiter(2**20, 1, 0, None).with_counts(2**42 - 1, 0)
    assert limiter.counts() == (2**42 - 1, 0)
    with pytest.raises(FAULT, match="`RateLimiter.insert`: the limiter's counters would leave"):
        _count_insert_large(limiter)
    limiter = RateLimiter.min_size(1).with_counts(2**63 - 1, 2**63 - 2)
    with pytest.raises(FAULT, match="counts below 2\\*\\*63"):
        limiter.insert(1)


def _count_insert_large(limiter):
    return eqx.filter_jit(lambda r: r.insert(1))(limiter)


# ---------------------------------------------------------------------------------------------
# Loops


def test_anakin_loop_runs_exactly_the_budgeted_updates():
    # Actors insert a batch when the law allows; the learner then runs exactly
    # `sample_budget` updates in a `while_loop`. The counts follow `Rate` step by step.
    limiter = RateLimiter.sample_to_insert_ratio(
        Fraction(3, 2), 20, 16, insert_batch_size=8, sample_batch_size=4
    )
    rate = limiter.rate

    def iteration(carry, _):
        limiter, updates = carry
        limiter = jax.lax.cond(limiter.can_insert(8), lambda r: r.insert(8), lambda r: r, limiter)
        budget = limiter.sample_budget(4)

        def update(state):
            limiter, k = state
            return limiter.sample(4), k + 1

        limiter, done = jax.lax.while_loop(lambda s: s[1] < budget, update, (limiter, 0))
        exhausted = ~limiter.can_sample(4)
        return (limiter, updates + done), (budget, done, exhausted)

    run = eqx.filter_jit(
        lambda limiter: jax.lax.scan(iteration, (limiter, jnp.int32(0)), length=12),
        donate="all",
    )
    (limiter, updates), stacked = run(limiter)
    # `scan` stacks each iteration's outputs: one entry per iteration.
    budgets, done, exhausted = cast(tuple[jax.Array, jax.Array, jax.Array], stacked)
    inserts = samples = 0
    for t in range(12):
        if rate.can_insert(inserts, samples, 8):
            inserts += 8
        budget = rate.sample_budget(inserts, samples, 4)
        assert int(budgets[t]) == int(done[t]) == budget
        samples += 4 * budget
        assert bool(exhausted[t])
    assert limiter.counts() == (inserts, samples) and int(updates) * 4 == samples
    assert samples > 0 and inserts > 20


def test_filter_jit_donation_reuses_the_counters_and_the_buffer():
    limiter = CONFIGS["queue"]().insert(2)
    step = eqx.filter_jit(lambda r: r.insert(1).sample(3), donate="all")
    pointers = [x.unsafe_buffer_pointer() for x in (limiter.inserts, limiter.samples)]
    new = step(limiter)
    assert new.counts() == (3, 3)
    assert limiter.inserts.is_deleted() and limiter.samples.is_deleted()
    # jax 0.5.3's CPU backend compiled at the tests' `xla_backend_optimization_level=0`
    # (conftest.py) writes the two-word `samples` counter to a new buffer (8 of 8 calls in a
    # script with that flag, 0 of 8 without it; jax 0.10.2 reuses it either way): only that
    # pairing is spared the pointer check, the donated counters are consumed in every case.
    unoptimised = "xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    if jax.__version_info__ >= (0, 6) or not unoptimised:
        assert [x.unsafe_buffer_pointer() for x in (new.inserts, new.samples)] == pointers

    # A RateLimited buffer is updated in place, as the bare buffer is.
    limited = RateLimited(dx.UniformReplay({"x": jnp.zeros(64)}, 1000), CONFIGS["queue"]())
    add_and_sample = eqx.filter_jit(
        lambda r, key: r.add_batch({"x": jnp.ones((2, 64))}).sample(key, 2), donate="all"
    )
    storage = limited.buffer.storage.data["x"]
    pointer = storage.unsafe_buffer_pointer()
    limited, batch = add_and_sample(limited, jax.random.key(0))
    assert storage.is_deleted()
    assert limited.buffer.storage.data["x"].unsafe_buffer_pointer() == pointer
    assert batch["x"].shape == (2, 64) and limited.limiter.counts() == (2, 2)


# vmapped buffers run in the default tier (tests/test_transforms.py); limiters under vmap, in
# the slow tier.
@SLOW
def test_a_batch_of_limiters_under_vmap():
    limiters = eqx.filter_vmap(lambda _: CONFIGS["ratio"](), axis_size=3)(jnp.arange(3))
    n = jnp.asarray([3, 1, 0], jnp.int32)
    limiters = eqx.filter_vmap(lambda r, n: r.insert(n).insert(n).insert(n).insert(n))(limiters, n)
    budgets = eqx.filter_vmap(lambda r: r.sample_budget(5))(limiters)
    rate = CONFIGS["ratio"]().rate
    assert budgets.tolist() == [rate.sample_budget(4 * k, 0, 5) for k in (3, 1, 0)]


# ---------------------------------------------------------------------------------------------
# Save and load


def test_save_and_load_round_trip(tmp_path):
    limiter = CONFIGS["fraction"]().with_counts(2**40 + 7, 2**39)
    dx.save(tmp_path / "l.dx", limiter)
    loaded = dx.load(tmp_path / "l.dx", like=CONFIGS["fraction"]())
    assert loaded.counts() == (2**40 + 7, 2**39) and loaded.rate == limiter.rate
    assert to_int(loaded.balance) == to_int(limiter.balance)
    # The static `rate` is in the header, by its `repr`: the same for the same `Rate` every
    # time (fractions and ints only), and different for any other.
    data = (tmp_path / "l.dx").read_bytes()
    (size,) = struct.unpack("<Q", data[12:20])
    header = json.loads(data[20 : 20 + size])
    assert header["static"][".rate"] == {
        "repr": "Rate(samples_per_insert=Fraction(3, 10), min_size_to_sample=7, "
        "min_diff=Fraction(-2, 5), max_diff=Fraction(23, 5), insert_batch_size=2, "
        "sample_batch_size=1)"
    }
    dx.save(tmp_path / "m.dx", CONFIGS["fraction"]().with_counts(2**40 + 7, 2**39))
    assert (tmp_path / "m.dx").read_bytes() == data
    for other in (RateLimiter.sample_to_insert_ratio(0.3, 7, 2.5), CONFIGS["ratio"]()):
        with pytest.raises(ValueError, match=r"static value `\.rate`"):
            dx.load(tmp_path / "l.dx", like=other)


def test_save_and_load_a_rate_limited_buffer(tmp_path):
    buf = dx.UniformReplay({"x": jnp.zeros(2)}, 50)
    limited = RateLimited(buf, CONFIGS["ratio"]()).add_batch({"x": jnp.ones((3, 2))})
    dx.save(tmp_path / "r.dx", limited)
    like = eqx.filter_eval_shape(RateLimited, buf, CONFIGS["ratio"]())
    loaded = dx.load(tmp_path / "r.dx", like=like)
    assert loaded.limiter.counts() == (3, 0) and int(loaded.buffer.size) == 3


# ---------------------------------------------------------------------------------------------
# RateLimited over every buffer kind

ITEM = {
    "obs": jnp.zeros(2, jnp.float32),
    "reward": jnp.zeros((), jnp.float32),
    "done": jnp.zeros((), jnp.bool_),
}


def _items(n, t=None, offset=0):
    shape = (n,) if t is None else (n, t)
    values = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) + offset
    return {"obs": jnp.stack([values, -values], -1), "reward": values, "done": (values % 5) == 4}


def _unlimited(insert_batch_size=64, sample_batch_size=64, min_size=1):
    return RateLimiter(
        1,
        min_size,
        None,
        None,
        insert_batch_size=insert_batch_size,
        sample_batch_size=sample_batch_size,
    )


REPLAYS = {
    "uniform": lambda: dx.UniformReplay(ITEM, 32),
    "prioritised": lambda: dx.PrioritisedReplay(ITEM, 32),
    "clustered": lambda: dx.ClusteredReplay(
        dx.PrioritisedReplay(ITEM, 16), 2, lambda item: item["done"].astype(jnp.int32)
    ),
}


def _replay_ops(limited, buf, key, kind):
    """The same operations on a `RateLimited` and on its bare buffer, in one program."""
    first = jax.tree.map(lambda x: x[0], _items(1))
    mask = jnp.asarray([True, False, True, True, False, True])
    limited, buf = limited.add(first), buf.add(first)
    limited = limited.add_batch(_items(6, offset=1), mask=mask)
    buf = buf.add_batch(_items(6, offset=1), mask=mask)
    limited, buf = limited.add_batch(_items(5, offset=10)), buf.add_batch(_items(5, offset=10))
    counted = limited.limiter
    limited, got = limited.sample(key, 8)
    want = buf.sample(key, 8)
    if kind != "uniform":
        slots = jnp.asarray([0, 1])
        names = slots if kind == "prioritised" else (slots, slots)
        limited = limited.set_priorities(names, jnp.full(2, 0.5))
        buf = buf.set_priorities(names, jnp.full(2, 0.5))
    return limited, buf, got, want, counted


@pytest.mark.parametrize("kind", rotation(sorted(REPLAYS), 2, keep=1))
def test_rate_limited_replays_count_and_sample_as_the_bare_replay(kind):
    buf = REPLAYS[kind]()
    run = eqx.filter_jit(functools.partial(_replay_ops, kind=kind))
    limited, buf, got, want, counted = run(RateLimited(buf, _unlimited()), buf, jax.random.key(3))
    assert counted.counts() == (1 + 4 + 5, 0)  # add, then the masked batch's 4, then 5
    assert limited.limiter.counts() == (10, 8)  # and 8 rows; `set_priorities` counts nothing
    assert tree_equal(got, want) and tree_equal(limited.buffer, buf)
    # A rate-limited replay is a replay, and a replay has no `extend`.
    assert isinstance(limited, dx.AbstractReplay) and isinstance(limited, RateLimited)
    assert not hasattr(limited, "extend")


def _trajectory_ops(limited, buf, key):
    ids = jnp.asarray([2, 0], jnp.int32)
    limited, buf = limited.add(_items(2), ids), buf.add(_items(2), ids)
    limited, buf = limited.add(_items(3, offset=5)), buf.add(_items(3, offset=5))
    limited, buf = limited.extend(_items(3, 4, offset=9)), buf.extend(_items(3, 4, offset=9))
    limited = limited.extend(_items(1, 2), jnp.asarray([1], jnp.int32))
    buf = buf.extend(_items(1, 2), jnp.asarray([1], jnp.int32))
    counted = limited.limiter
    nstep = dx.NStep(2, reward="reward", terminated="done")
    limited, got_windows = limited.sample(key, 5, dx.Window(3))
    mixed = {"replay": 4, "online": 2}
    limited, got_mixed = limited.sample(key, 6, dx.Window(2), source=mixed)
    limited, got_transitions = limited.sample(key, 6, nstep, discount=0.9)
    got = (got_windows, got_mixed, got_transitions)
    want = (
        buf.sample(key, 5, dx.Window(3)),
        buf.sample(key, 6, dx.Window(2), source=mixed),
        buf.sample(key, 6, nstep, discount=0.9),
    )
    return limited, buf, got, want, counted


@SLOW
def test_rate_limited_trajectory_buffer_counts_steps_and_rows():
    buf = dx.TrajectoryBuffer(ITEM, num_envs=3, max_length=8)
    run = eqx.filter_jit(_trajectory_ops)
    limited, buf, got, want, counted = run(RateLimited(buf, _unlimited()), buf, jax.random.key(1))
    assert counted.counts() == (2 + 3 + 12 + 2, 0)  # steps: 1 per listed env, envs * T
    assert limited.limiter.counts() == (19, 5 + 6 + 6)  # rows
    assert tree_equal(got, want) and tree_equal(limited.buffer, buf)
    # A rate-limited trajectory buffer is a trajectory buffer: no `add_batch`, and `pop` only
    # for a queue, refused as the buffer refuses it.
    assert isinstance(limited, dx.AbstractTrajectoryBuffer) and not hasattr(limited, "add_batch")
    with pytest.raises(TypeError, match="`TrajectoryBuffer.pop`: a TrajectoryBuffer is sampled"):
        limited.pop(2)


def _prioritised_ops(limited, buf, key):
    limited, buf = limited.extend(_items(2, 5)), buf.extend(_items(2, 5))
    limited, got = limited.sample(key, 4)
    want = buf.sample(key, 4)
    env, start = got.sample.env, got.sample.start
    limited = limited.set_priorities(env, start, jnp.full(4, 2.0))
    buf = buf.set_priorities(env, start, jnp.full(4, 2.0))
    return limited, buf, got, want


def _queue_ops(limited, queue):
    limited, queue = limited.extend(_items(3, 3)), queue.extend(_items(3, 3))
    items, limited = limited.pop(2)
    want, queue = queue.pop(2)
    return limited, queue, items, want


@SLOW
def test_rate_limited_prioritised_trajectory_buffer_and_queue():
    window = dx.Window(2, strict=True)
    buf = dx.PrioritisedTrajectoryBuffer(ITEM, num_envs=2, max_length=8, window=window)
    key = jax.random.key(2)
    run = eqx.filter_jit(_prioritised_ops)
    limited, buf, got, want = run(RateLimited(buf, _unlimited()), buf, key)
    assert tree_equal(got, want) and tree_equal(limited.buffer, buf)
    assert limited.limiter.counts() == (10, 4)
    with pytest.raises(TypeError, match=r"`PrioritisedTrajectoryBuffer.sample\(source=...\)`: a "):
        limited.sample(key, 2, source={"replay": 1, "online": 1})

    queue = dx.TrajectoryQueue(ITEM, num_envs=3, max_length=6)
    limiter = RateLimiter.queue(12, insert_batch_size=9, sample_batch_size=3)
    limited, queue, items, want = eqx.filter_jit(_queue_ops)(RateLimited(queue, limiter), queue)
    assert tree_equal(items, want) and tree_equal(limited.buffer, queue)
    assert limited.limiter.counts() == (9, 3)  # 3 envs * 3 steps; one row per env
    with pytest.raises(TypeError, match="`TrajectoryQueue.sample`: a TrajectoryQueue is not samp"):
        limited.sample(key, 1)
    with pytest.raises(TypeError, match="`TrajectoryQueue.set_priorities`: a TrajectoryQueue"):
        limited.set_priorities(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1))


def test_rate_limited_enforces_the_law_and_its_capacity():
    buf = dx.UniformReplay(ITEM, 16)
    limiter = RateLimiter.sample_to_insert_ratio(2, 4, 8, insert_batch_size=4, sample_batch_size=4)
    limited = RateLimited(buf, limiter)  # balance in [0, 16], starting at 8 once 4 items are in
    assert not limited.can_sample(1) and int(limited.sample_budget(1)) == 0
    assert int(limited.insert_budget(4)) == 2 and int(limited.insert_budget(1)) == 8
    key = jax.random.key(0)
    with pytest.raises(FAULT, match="`RateLimited.sample`: the rate limit does not allow"):
        limited.sample(key, 1)
    limited = limited.add_batch(_items(4)).add_batch(_items(4))  # a balance of 16
    with pytest.raises(FAULT, match="`RateLimited.add_batch`: the rate limit does not allow"):
        limited.add_batch(_items(4))
    with pytest.raises(ValueError, match="`RateLimited.add_batch`: 5 items to insert, above"):
        limited.add_batch(_items(5))
    with pytest.raises(FAULT, match=r"`RateLimited.add_batch`: `n` must be in \[0, insert_"):
        eqx.filter_jit(lambda r, m: r.add_batch(_items(6), mask=m))(limited, jnp.ones(6, bool))
    assert int(limited.sample_budget(4)) == 4 and not limited.can_insert(1)
    limited, _ = limited.sample(key, 4)
    assert limited.limiter.counts() == (8, 4) and bool(limited.can_insert(2))
    with pytest.raises(ValueError, match=r"min_size_to_sample = 17 is above the buffer's cap"):
        RateLimited(buf, RateLimiter.min_size(17))
    with pytest.raises(ValueError, match=r"capacity of 24 steps \(num_envs \* max_length = 3"):
        RateLimited(dx.TrajectoryBuffer(ITEM, 3, 8), RateLimiter.min_size(25))
    RateLimited(dx.TrajectoryBuffer(ITEM, 3, 8), RateLimiter.min_size(24))
    for bad in [(ITEM, limiter), (buf, limiter.rate)]:
        with pytest.raises(TypeError):  # (the import hook's check of the annotation, or ours)
            RateLimited(*bad)


def test_r2d2_units_per_step():
    # Reverb's R2D2: 4 samples per inserted sequence of period P = 40 steps, so 4 / 40 rows per
    # step; a learner sampling 8 sequences waits for 80 steps.
    buf = dx.TrajectoryBuffer(ITEM, num_envs=4, max_length=100)
    limiter = RateLimiter.sample_to_insert_ratio(
        Fraction(4, 40), 80, 8, insert_batch_size=40, sample_batch_size=8
    )

    @eqx.filter_jit
    def run(limited, key):
        limited = limited.extend(_items(4, 10)).extend(_items(4, 10))  # 80 steps
        budget = limited.sample_budget(8)
        limited, _ = limited.sample(key, 8, dx.Window(5))
        return limited, budget, limited.can_sample(8)

    limited, budget, again = run(RateLimited(buf, limiter), jax.random.key(0))
    assert int(budget) == 1 and not again and limited.limiter.counts() == (80, 8)


# ---------------------------------------------------------------------------------------------
# Datasets


@SLOW
def test_dataset_keeps_the_counts_of_a_rate_limited_buffer(tmp_path):
    pytest.importorskip("tensorstore")
    buf = dx.TrajectoryBuffer(ITEM, num_envs=2, max_length=6)
    limiter = _unlimited().with_counts(2**40, 2**33)
    limited = RateLimited(buf, limiter).extend(_items(2, 4))
    limited, _ = limited.sample(jax.random.key(0), 3, dx.Window(2))
    ds = dx.Dataset.create(tmp_path / "d", limited, num_envs=2)
    assert ds.write(limited) == 8
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["limiter"] == {"inserts": 2**40 + 8, "samples": 2**33 + 3}
    like = eqx.filter_eval_shape(RateLimited, dx.TrajectoryBuffer(ITEM, 2, 6), _unlimited())
    loaded = dx.Dataset.open(tmp_path / "d", like).load(like)
    assert isinstance(loaded, RateLimited)
    assert loaded.limiter.counts() == (2**40 + 8, 2**33 + 3)
    assert tree_equal(loaded.buffer.streams, limited.buffer.streams)
    # `append` keeps the counts; a write from a buffer without a limiter records none, and
    # loading into a RateLimited is then refused (the plain buffer still loads).
    ds.append(_items(2, 1, offset=50))
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["limiter"] is not None
    plain = ds.load(dx.TrajectoryBuffer(ITEM, 2, 6))
    ds.write(plain.extend(_items(2, 1)))
    assert "limiter" not in json.loads((tmp_path / "d" / "manifest.json").read_text())
    with pytest.raises(ValueError, match="`RateLimited.with_counts`: no counts were kept"):
        ds.load(like)
    assert int(ds.load(like.buffer).step_count.sum()) == 12


# A dataset's counts of a rate-limited buffer: the slow tier, as the test above.
@SLOW
def test_dataset_manifest_counts_are_validated(tmp_path):
    pytest.importorskip("tensorstore")
    from .test_dataset import _resign

    buf = dx.TrajectoryBuffer(ITEM, num_envs=1, max_length=4)
    limited = RateLimited(buf, _unlimited()).add(_items(1))
    dx.Dataset.create(tmp_path / "d", ITEM, num_envs=1).write(limited)
    bad = [{"inserts": -1, "samples": 0}, {"inserts": 1}, {"inserts": 2**63, "samples": 0}, 5]
    for value in bad:
        _resign(tmp_path / "d", lambda body: body.update(limiter=value))
        with pytest.raises(ValueError, match="`limiter` must be absent or"):
            dx.Dataset.open(tmp_path / "d", ITEM)
    _resign(tmp_path / "d", lambda body: body.update(limiter={"inserts": 3, "samples": 1}))
    ds = dx.Dataset.open(tmp_path / "d", ITEM)
    assert ds.load(RateLimited(buf, _unlimited())).limiter.counts() == (3, 1)
    # A limiter whose balance cannot hold those counts is refused before anything is read.
    _resign(tmp_path / "d", lambda body: body.update(limiter={"inserts": 2**62, "samples": 0}))
    with pytest.raises(ValueError, match="`RateLimiter.with_counts`"):
        dx.Dataset.open(tmp_path / "d", ITEM).load(RateLimited(buf, _unlimited()))


# ---------------------------------------------------------------------------------------------
# RateLimited against the law on Python ints, over one buffer and over the shards of a global
# one: random runs of inserts and samples, each allowed exactly when the law allows it.


class _Counted:
    """The Python model of a `RateLimited` over `shards` shards: the counts as of the last
    sample (`inserts`, `samples`) and each shard's pending inserts since (equal blocks, so one
    number), by `Rate`'s law on Python ints with each shard's share."""

    def __init__(self, rate: Rate, shards: int):
        self.rate, self.shards = rate, shards
        self.inserts = self.samples = self.pending = 0

    def counts(self) -> tuple[int, int]:
        return self.inserts + self.shards * self.pending, self.samples

    def can_insert(self, n: int) -> bool:
        block = n // self.shards
        return self.rate.can_insert(
            self.inserts, self.samples, block, shares=self.shards, pending=self.pending
        )

    def can_sample(self, n: int) -> bool:
        return self.rate.can_sample(*self.counts(), n)


_LAWS = {  # (samples_per_insert, min_size_to_sample, error_buffer) of `sample_to_insert_ratio`
    "tight": (1, 8, 8),
    "two samples per insert": (2, 8, 24),
    "half a sample per insert": (0.5, 16, 12),
}


class RateLimitedMachine(RuleBasedStateMachine):
    """`RateLimited(buffer)` beside `_Counted`: every insert and sample the model allows
    proceeds, every other one is refused with the law's message and changes nothing, and the
    predicates, budgets and counts are the model's."""

    shards = 1

    def __init__(self):
        super().__init__()
        self.limited: Any = None
        self.model: _Counted | None = None

    def make(self) -> Any:
        return dx.UniformReplay(ITEM, 64)

    @initialize(law=st.sampled_from(sorted(_LAWS)))
    def start(self, law):
        spi, min_size, error = _LAWS[law]
        limiter = RateLimiter.sample_to_insert_ratio(
            spi, min_size, error, insert_batch_size=8, sample_batch_size=4
        )
        self.limited = RateLimited(self.make(), limiter)
        self.model = _Counted(limiter.rate, self.shards)

    @rule(blocks=st.integers(1, 8 // 4))
    def insert(self, blocks):
        n = 4 * blocks  # a multiple of every shard count here
        assert self.model is not None  # made by `start`
        allowed = self.model.can_insert(n)
        assert bool(self.limited.can_insert(n)) == allowed
        if allowed:
            self.limited = _ADD(self.limited, _items(n))
            self.model.pending += n // self.shards
        else:
            with pytest.raises(FAULT, match="`RateLimited.add_batch`: the rate limit does not"):
                _ADD(self.limited, _items(n))

    @rule(n=st.sampled_from([1, 2, 4]))
    def sample(self, n):
        assert self.model is not None  # made by `start`
        allowed = self.model.can_sample(n)
        assert bool(self.limited.can_sample(n)) == allowed
        if allowed:
            self.limited, batch = _SAMPLE(self.limited, jax.random.key(n), n)
            assert jax.tree.leaves(batch)[0].shape[0] == n
            self.model.inserts, self.model.samples = self.model.counts()
            self.model.samples += n
            self.model.pending = 0
        else:
            # Under `jit` an empty buffer may raise its own fault instead (both hold).
            empty = self.model.counts()[0] == 0
            refused = "`RateLimited.sample`: the rate limit does not"
            with pytest.raises(FAULT, match=f"{refused}|empty UniformReplay" if empty else refused):
                _SAMPLE(self.limited, jax.random.key(n), n)

    @invariant()
    def counts_and_budgets_are_the_laws(self):
        if self.limited is None:
            return
        assert self.model is not None  # made with `limited`, by `start`
        inserts, samples = self.model.counts()
        assert self.limited.counts() == (inserts, samples)
        rate = self.model.rate
        assert int(self.limited.sample_budget(2)) == rate.sample_budget(inserts, samples, 2)
        assert int(self.limited.insert_budget(4)) == rate.insert_budget(inserts, samples, 4)


_ADD = eqx.filter_jit(lambda limited, items: limited.add_batch(items))
_SAMPLE = eqx.filter_jit(lambda limited, key, n: limited.sample(key, n))


class GlobalRateLimitedMachine(RateLimitedMachine):
    """The same over a `GlobalReplay` of 4 shards: each counts its own block of an insert by
    its share of the law, and a sample folds the counts in."""

    shards = 4

    def make(self) -> Any:
        mesh = jax.make_mesh((4,), ("shards",))
        return dx.GlobalReplay(mesh, lambda: dx.UniformReplay(ITEM, 16))


TestRateLimitedMachine, TestRateLimitedMachineFull = machine_tests(RateLimitedMachine)
# Each run of the global machine builds a mesh of shards and compiles its collectives: half as
# many runs (the law is the same; the single machine explores it with every run).
GlobalRateLimitedMachine.TestCase.settings = settings(
    max_examples=max(2, profile_max_examples() // 2)
)
TestGlobalRateLimitedMachine = SLOW(
    pytest.mark.skipif(
        not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
    )(GlobalRateLimitedMachine.TestCase)
)
