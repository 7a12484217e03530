"""PrioritisedTrajectoryBuffer against its NumPy model: async adds, windows entering and
leaving, samples, delayed (stale) priority updates."""

import re
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, precondition, rule, RuleBasedStateMachine

from .helpers import assert_frequencies, machine_tests, SLOW, unstack
from .reference import (
    AllZeroError,
    BadPriorityError,
    EmptyBufferError,
    ref_importance_weights,
    RefPrioritisedTrajectory,
    StampError,
)


PROTOTYPE = {"env": jnp.zeros((), jnp.int32), "pos": jnp.zeros((), jnp.int32)}
ALPHA = 0.7
SAMPLE = 8
# (num_envs, max_length, burn_in, sequence_length, bootstrap, period): windows of 3 steps on
# a period of 2, and of 1 step on every step (a window that enters as another leaves).
# The third: a period that does not divide max_length (7 = 3 * 2 + 1; windows of 3 > 1 step).
CONFIGS = [(3, 6, 1, 1, 1, 2), (2, 4, 0, 1, 0, 1), (2, 7, 0, 2, 1, 2)]
PRIORITIES = [0.0, 0.5, 1.0, 3.0]


def _make(config, **kwargs):
    num_envs, max_length, burn_in, length, bootstrap, period = config
    window = dx.Window(length, burn_in=burn_in, bootstrap=bootstrap, period=period, strict=True)
    buf = dx.PrioritisedTrajectoryBuffer(
        PROTOTYPE, num_envs, max_length, window, priority_exponent=ALPHA, **kwargs
    )
    model = RefPrioritisedTrajectory(
        num_envs, max_length, burn_in + length + bootstrap, period, ALPHA
    )
    return buf, model


def _steps(model, env_ids):
    return {
        "env": np.asarray(env_ids, np.int32),
        "pos": np.asarray([model.streams.count[e] for e in env_ids], np.int32),
    }


_add = eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))
_add_all = eqx.filter_jit(lambda b, x: b.add(x))
_extend_all = eqx.filter_jit(lambda b, x: b.extend(x))
_sample = eqx.filter_jit(lambda b, k, beta: b.sample(k, SAMPLE, beta=beta))
_set = eqx.filter_jit(lambda b, e, s, p: (b.set_priorities(e, s, p), b.stale(e, s)))


def _leaf_masses(buf, model) -> np.ndarray:
    k = buf.leaves_per_env
    want = np.zeros(buf.tree.capacity)
    for env, start in model.priorities:
        want[env * k + (start // buf.window.period) % k] = model.mass((env, start))
    return want


class PrioritisedTrajectoryMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
    def init(self, config, seed):
        self.buf, self.model = _make(config)
        self.key = jax.random.key(seed)
        self.rng = np.random.default_rng(seed)
        self.samples: list = []

    @rule(data=st.data())
    def add(self, data):
        n = self.buf.num_envs
        env_ids = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1))
        steps = _steps(self.model, env_ids)
        self.buf = _add(self.buf, steps, np.asarray(env_ids, np.int32))
        self.model.add(unstack(steps, len(env_ids)), env_ids)

    @rule(times=st.sampled_from([1, 7]))
    def add_all(self, times):
        n = self.buf.num_envs
        for _ in range(times):  # 7 lock-step adds wrap every stream
            steps = _steps(self.model, list(range(n)))
            self.buf = _add_all(self.buf, steps)
            self.model.add(unstack(steps, n), list(range(n)))

    @rule(length=st.sampled_from([2, 9]))
    def extend(self, length):
        # `length` steps for every env in one call (lock-step, as flashbax adds); 9 wraps every
        # stream of every config. Partial `env_ids` go through the same code as in `add` and
        # are covered by the registry (tests/registry.py).
        env_ids = list(range(self.buf.num_envs))
        steps = []
        for _ in range(length):
            steps.append(_steps(self.model, env_ids))
            self.model.add(unstack(steps[-1], len(env_ids)), env_ids)
        sequences = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *steps)
        self.buf = _extend_all(self.buf, sequences)

    @rule(beta=st.sampled_from([0.4, 1.0]))
    def sample(self, beta):
        self.key, key = jax.random.split(self.key)
        try:
            expected = self.model.probabilities()
        except EmptyBufferError:
            with pytest.raises(RuntimeError, match="no window is admissible yet"):
                _sample(self.buf, key, jnp.asarray(beta))
            return
        except AllZeroError:
            with pytest.raises(RuntimeError, match="priority 0"):
                _sample(self.buf, key, jnp.asarray(beta))
            return
        out = _sample(self.buf, key, jnp.asarray(beta))
        s = out.sample
        stamps = list(zip(s.env.tolist(), s.start.tolist()))
        probabilities = [expected.get(w, 0.0) for w in stamps]
        assert all(p > 0 for p in probabilities), stamps  # only positive-priority windows
        np.testing.assert_allclose(np.asarray(out.probabilities), probabilities, rtol=1e-5)
        want = ref_importance_weights(np.asarray(probabilities), len(expected), beta)
        np.testing.assert_allclose(np.asarray(out.weights), want, rtol=1e-5)
        size = self.model.size
        assert s.items["env"].tolist() == [[e] * size for e, _ in stamps]
        assert s.items["pos"].tolist() == [list(range(st_, st_ + size)) for _, st_ in stamps]
        assert bool(jnp.all(s.mask))
        self.samples = [*self.samples[-2:], (s.env, s.start)]

    @precondition(lambda self: self.samples)
    @rule(data=st.data())
    def set_priorities_of_an_earlier_sample(self, data):
        env, start = data.draw(st.sampled_from(self.samples), label="sample")
        priorities = np.asarray(
            data.draw(st.lists(st.sampled_from(PRIORITIES), min_size=SAMPLE, max_size=SAMPLE)),
            np.float32,
        )
        self.buf, stale = _set(self.buf, env, start, priorities)
        assert stale.tolist() == self.model.stale(env.tolist(), start.tolist())
        self.model.set_priorities(env.tolist(), start.tolist(), priorities)

    @invariant()
    def same_state(self):
        assert float(self.buf.max_priority) == self.model.max_priority
        assert int(self.buf.num_windows) == len(self.model.priorities)
        np.testing.assert_allclose(
            np.asarray(self.buf.tree.leaves), _leaf_masses(self.buf, self.model), rtol=1e-6
        )


TestPrioritisedTrajectoryMachine, TestPrioritisedTrajectoryMachineFull = machine_tests(
    PrioritisedTrajectoryMachine
)


def _filled(config, rng, **kwargs):
    """Every env of `config` fed asynchronously until its stream has wrapped, then random
    priorities (zeros included) on every window."""
    buf, model = _make(config, **kwargs)
    n = config[0]
    for _ in range(4 * config[1]):
        env_ids = [int(e) for e in rng.permutation(n) if rng.random() < 0.7] or [0]
        steps = _steps(model, env_ids)
        buf = _add(buf, steps, np.asarray(env_ids, np.int32))
        model.add(unstack(steps, len(env_ids)), env_ids)
    windows = sorted(model.priorities)
    env = np.asarray([e for e, _ in windows], np.int32)
    start = np.asarray([s for _, s in windows], np.int32)
    priorities = rng.choice([0.0, 0.25, 1.0, 4.0], len(windows)).astype(np.float32)
    priorities[0] = 1.0  # at least one positive
    buf = buf.set_priorities(env, start, priorities)
    model.set_priorities(env.tolist(), start.tolist(), priorities)
    return buf, model


# Stratified draws in the slow tier: tests/test_prioritised.py's test_stratified_sampling runs
# the same stratification of a sum tree in the default tier.
@pytest.mark.parametrize(
    "stratified", [False, pytest.param(True, marks=SLOW)], ids=["iid", "stratified"]
)
def test_sampling_frequencies_match_the_model(stratified):
    buf, model = _filled(CONFIGS[0], np.random.default_rng(0), stratified=stratified)
    draws = 2**15
    out = eqx.filter_jit(lambda b, k: b.sample(k, draws))(buf, jax.random.key(1))
    probabilities = model.probabilities()
    cells = sorted(probabilities)
    index = {c: i for i, c in enumerate(cells)}
    drawn = [index[c] for c in zip(out.sample.env.tolist(), out.sample.start.tolist())]
    # Pearson chi-square against the model's exact probabilities (windows of priority 0 have
    # probability 0 and must never be drawn): false-failure rate 1e-6 per case.
    assert_frequencies(
        np.bincount(drawn, minlength=len(cells)), np.asarray([probabilities[c] for c in cells])
    )


# Stale updates are dropped in the default tier by tests/test_prioritised.py (a replay) and
# the machine above; across a whole ring of a trajectory buffer, in the slow tier.
@SLOW
def test_stale_updates_change_nothing_across_the_wrap():
    # A learner that updates a sample after the streams moved on by a whole ring: every
    # window of the sample has left, and the update must leave the new windows' priorities.
    buf, model = _filled(CONFIGS[0], np.random.default_rng(2))
    out = buf.sample(jax.random.key(3), 16)
    for _ in range(6):
        steps = _steps(model, [0, 1, 2])
        buf = buf.add(steps)
        model.add(unstack(steps, 3), [0, 1, 2])
    before = np.asarray(buf.tree.leaves)
    stale = buf.stale(out.sample.env, out.sample.start)
    assert stale.tolist() == [True] * 16
    after = buf.set_priorities(out.sample.env, out.sample.start, jnp.full(16, 9.0))
    assert np.asarray(after.tree.leaves).tolist() == before.tolist()
    assert float(after.max_priority) == 9.0  # recorded, as for any update


# The faults of every buffer run in the default tier (tests/test_results.py); these, in the
# slow tier.
@SLOW
def test_errors():
    buf, model = _make(CONFIGS[0])
    key = jax.random.key(0)
    with pytest.raises(RuntimeError, match="no window is admissible yet"):
        buf.sample(key, 4)
    with pytest.raises(ValueError, match="longer than max_length mod period = 2 steps"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, dx.Window(2, period=4, strict=True))
    with pytest.raises(ValueError, match="must be at most max_length = 6, got 8"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, dx.Window(2, period=8, strict=True))
    with pytest.raises(ValueError, match="longer than max_length"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, dx.Window(5, burn_in=2, strict=True))
    for _ in range(4):
        buf = buf.add(_steps(model, [0, 1, 2]))
        model.add(unstack(_steps(model, [0, 1, 2]), 3), [0, 1, 2])
    ids = np.asarray([0, 1], np.int32)
    not_taken = "a start is not a step of its env"
    not_given = "a stamp this buffer cannot have given: its start is not on a multiple of period"
    for starts, match in [
        ([1, 0], not_given),  # off period
        ([-2, 0], not_taken),  # negative
        ([2, 0], not_given),  # taken, but its window not yet stored
        ([0, 4], not_taken),  # not yet taken
    ]:
        with pytest.raises(RuntimeError, match=match):
            buf.set_priorities(ids, np.asarray(starts, np.int32), jnp.ones(2))
        with pytest.raises(StampError):
            model.set_priorities(ids.tolist(), starts, [1.0, 1.0])
    with pytest.raises(RuntimeError, match="an env id is out of range"):
        buf.set_priorities(np.asarray([0, 3], np.int32), np.zeros(2, np.int32), jnp.ones(2))
    # `stale` answers for any step its env has taken, window start or not (as
    # `TrajectoryBuffer.stale`), and refuses only the others.
    assert buf.stale(ids, np.asarray([1, 2], np.int32)).tolist() == [False, False]
    for starts in ([-2, 0], [0, 4]):
        with pytest.raises(RuntimeError, match=not_taken):
            buf.stale(ids, np.asarray(starts, np.int32))
    with pytest.raises(RuntimeError, match="an env id is out of range"):
        buf.stale(np.asarray([0, 3], np.int32), np.zeros(2, np.int32))
    with pytest.raises(RuntimeError, match="priorities must be finite and non-negative"):
        buf.set_priorities(ids, np.asarray([0, 0], np.int32), jnp.asarray([1.0, jnp.nan]))
    with pytest.raises(BadPriorityError):
        model.set_priorities(ids.tolist(), [0, 0], [1.0, float("nan")])
    zero = buf.set_priorities(np.asarray([0, 1, 2], np.int32), np.zeros(3, np.int32), jnp.zeros(3))
    with pytest.raises(RuntimeError, match="every stored window has priority 0; none can be drawn"):
        zero.sample(key, 4)
    # A bad `beta` is reported under the name of the call.
    with pytest.raises(ValueError, match=r"`PrioritisedTrajectoryBuffer.sample\(beta=...\)`"):
        buf.sample(key, 4, beta=-1.0)
    with pytest.raises(
        RuntimeError, match="`PrioritisedTrajectoryBuffer.sample`: `beta` must be finite"
    ):
        buf.sample(key, 4, beta=jnp.asarray(jnp.nan))


def test_stamp_of_gives_the_stamps_of_drawn_leaves():
    buf, _ = _filled(CONFIGS[2], np.random.default_rng(4))
    out = buf.sample(jax.random.key(5), 32)
    env, start = eqx.filter_jit(lambda b, i: b.stamp_of(i))(buf, out.indices)
    assert env.tolist() == out.sample.env.tolist()
    assert start.tolist() == out.sample.start.tolist()
    capacity = buf.tree.capacity
    with pytest.raises(
        RuntimeError,
        match=r"index out of range; every index must satisfy 0 <= index < \d+ \(a sum-tree leaf\)",
    ):
        buf.stamp_of(np.asarray([0, capacity], np.int32))


@SLOW
def test_window_priorities_round_trip():
    buf, model = _filled(CONFIGS[0], np.random.default_rng(6))
    masses = buf.window_priorities()
    shape = (buf.num_envs, buf.leaves_per_env)
    assert masses.start.shape == masses.held.shape == masses.mass.shape == shape
    np.testing.assert_array_equal(np.asarray(masses.mass).reshape(-1), buf.tree.leaves)
    assert float(masses.max_priority) == float(buf.max_priority)
    held = np.asarray(masses.held)
    stamps = {(e, int(masses.start[e, j])) for e, j in zip(*np.nonzero(held))}
    assert stamps == set(model.priorities)
    for e, s in stamps:
        assert float(masses.mass[e, s // buf.window.period % buf.leaves_per_env]) == (
            pytest.approx(model.mass((e, s)), rel=1e-6)
        )
    # Onto a buffer of the same steps at fresh priorities: the masses and max_priority come
    # back, and with them the same draws. Leaves that hold no window ignore their mass.
    fresh = buf.with_streams(buf.streams)
    garbage = jnp.where(masses.held, masses.mass, 7.0)
    back = fresh.with_window_priorities(garbage, max_priority=buf.max_priority)
    np.testing.assert_array_equal(back.tree.leaves, buf.tree.leaves)
    np.testing.assert_array_equal(back.tree.total, buf.tree.total)
    assert float(back.max_priority) == float(buf.max_priority)
    a, b = back.sample(jax.random.key(7), 16), buf.sample(jax.random.key(7), 16)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"`masses` has shape \(3, 2\), expected"):
        fresh.with_window_priorities(np.ones((3, 2), np.float32))
    with pytest.raises(RuntimeError, match="masses must be finite and non-negative"):
        fresh.with_window_priorities(jnp.where(masses.held, -1.0, 0.0))
    with pytest.raises(RuntimeError, match="`max_priority` must be finite and at least 1"):
        fresh.with_window_priorities(masses.mass, max_priority=0.5)
    # A NaN mass gives its window the mass of `max_priority`, as a new window gets.
    unknown = fresh.with_window_priorities(
        jnp.where(masses.held, jnp.nan, 0.0), max_priority=buf.max_priority
    )
    top = float(buf.max_priority) ** buf.priority_exponent
    np.testing.assert_allclose(unknown.tree.leaves, np.where(held.reshape(-1), top, 0.0), rtol=1e-6)


# with_streams runs in the default tier on a TrajectoryBuffer (tests/test_trajectory.py);
# its fresh priorities here, in the slow tier.
@SLOW
def test_with_streams_keeps_the_steps_at_fresh_priorities():
    buf, model = _filled(CONFIGS[2], np.random.default_rng(8))
    (env, start), *_ = sorted(model.priorities)
    buf = buf.set_priorities(
        np.asarray([env], np.int32), np.asarray([start], np.int32), jnp.ones(1) * 4
    )
    assert float(buf.max_priority) == 4.0  # the filled buffer has priorities of its own
    fresh = buf.with_streams(buf.streams)
    for x, y in zip(jax.tree.leaves(fresh.streams), jax.tree.leaves(buf.streams)):
        np.testing.assert_array_equal(x, y)
    assert fresh.window == buf.window and fresh.priority_exponent == buf.priority_exponent
    # Every window it holds at max_priority 1.0 (mass 1.0 ** alpha), no other leaf.
    assert float(fresh.max_priority) == 1.0
    held = np.asarray(fresh.window_priorities().held).reshape(-1)
    assert int(held.sum()) == int(fresh.num_windows) == len(model.priorities)
    np.testing.assert_array_equal(fresh.tree.leaves, np.where(held, 1.0, 0.0))
    with pytest.raises(ValueError, match="the streams have"):
        buf.with_streams(dx.Streams(PROTOTYPE, 3, 7))


DONE_STEP = {"pos": jnp.zeros((), jnp.int32), "done": jnp.zeros((), jnp.bool_)}


@SLOW
def test_deprecated_forms_still_work_with_a_warning():
    # The constructor's window arguments, `sample(episode_ends=..., done=...)` and
    # `slots_per_env`: the old forms, for one release.
    parts: dict[str, Any] = dict(burn_in=1, bootstrap=1, period=2)
    with pytest.warns(DeprecationWarning, match="window options as keywords is deprecated"):
        old = dx.PrioritisedTrajectoryBuffer(DONE_STEP, 2, 8, 2, **parts)
    new = dx.PrioritisedTrajectoryBuffer(DONE_STEP, 2, 8, dx.Window(2, **parts, strict=True))
    assert old.window == new.window and old.window.size == 4 and old.window.strict
    truncate = dx.Window(2, **parts, strict=True, episode_ends="truncate", done="done")
    masked = dx.PrioritisedTrajectoryBuffer(DONE_STEP, 2, 8, truncate)
    steps = {
        "pos": np.broadcast_to(np.arange(10, dtype=np.int32), (2, 10)),
        "done": np.broadcast_to(np.arange(10) % 3 == 2, (2, 10)),
    }
    old, masked = old.extend(steps), masked.extend(steps)
    key = jax.random.key(0)
    with pytest.warns(DeprecationWarning, match="`episode_ends` and `done` are deprecated here"):
        a = old.sample(key, 8, episode_ends="truncate", done="done")
    b = masked.sample(key, 8)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert not bool(jnp.all(b.sample.mask))  # the episode ends did cut windows
    # Its new form: a `Window` of the buffer's parts that masks episode ends otherwise.
    c = old.sample(key, 8, truncate)
    assert jax.tree.structure(c) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(c), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    with pytest.warns(DeprecationWarning, match="slots_per_env` is deprecated"):
        slots = old.slots_per_env
    assert slots == old.leaves_per_env == 4
    # The window's parts, once fields of the buffer.
    for name, value in [("sequence_length", 2), ("burn_in", 1), ("bootstrap", 1), ("period", 2)]:
        with pytest.warns(DeprecationWarning, match=f"{name}` is deprecated; read `window"):
            assert getattr(old, name) == value == getattr(old.window, name)


def test_sample_masks_by_a_window_of_the_same_parts():
    # `sample(key, b, what)`: `what` a `Window` of the buffer's parts (sequence_length, burn_in,
    # bootstrap, period, strict) that masks episode ends otherwise; the same windows drawn.
    parts: dict[str, Any] = dict(burn_in=1, bootstrap=1, period=2, strict=True)
    buf = dx.PrioritisedTrajectoryBuffer(DONE_STEP, 2, 8, dx.Window(2, **parts))
    buf = buf.extend(
        {
            "pos": np.broadcast_to(np.arange(10, dtype=np.int32), (2, 10)),
            "done": np.broadcast_to(np.arange(10) % 3 == 2, (2, 10)),
        }
    )
    key = jax.random.key(1)
    plain = buf.sample(key, 16)
    for ends in ("truncate", "within"):
        window = dx.Window(2, **parts, episode_ends=ends, done="done")
        masked = eqx.filter_jit(lambda b, k, w: b.sample(k, 16, w))(buf, key, window)
        # The same draws: stamps, leaves, probabilities and weights; only the masks differ,
        # and the steps they cut are zeros.
        np.testing.assert_array_equal(masked.sample.env, plain.sample.env)
        np.testing.assert_array_equal(masked.sample.start, plain.sample.start)
        for x, y in zip(masked[1:], plain[1:]):
            np.testing.assert_array_equal(x, y)
        mask = np.asarray(masked.sample.mask)
        assert bool(jnp.all(plain.sample.mask)) and not mask.all()  # the ends did cut windows
        for x, y in zip(jax.tree.leaves(masked.sample.items), jax.tree.leaves(plain.sample.items)):
            np.testing.assert_array_equal(x, np.where(mask, y, 0).astype(y.dtype))
        np.testing.assert_array_equal(masked.sample.learn, plain.sample.learn & mask)
    # The buffer's own window as `what` is the plain sample.
    same = buf.sample(key, 16, buf.window)
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(x, y)
    # Other parts, or not a `Window`, are refused at once.
    with pytest.raises(ValueError, match=r"may mask them otherwise .* but not change them"):
        buf.sample(key, 4, dx.Window(3, burn_in=1, bootstrap=1, period=2, strict=True))
    with pytest.raises(ValueError, match=r"may mask them otherwise .* but not change them"):
        buf.sample(key, 4, dx.Window(2, burn_in=1, bootstrap=1, period=1, strict=True))
    with pytest.raises(TypeError, match="`what` must be None or a `dx.Window`"):
        buf.sample(key, 4, dx.NStep(1, reward="pos", terminated="done"))


# ---------------------------------------------------------------------------------------------
# Numbers near the top of int32, and numeric arguments in their own dtype


def _near_the_top(window_size=4, max_length=8):
    """One env whose step count is 2**31 - 1, the most it holds: stamps near 2**31."""
    window = dx.Window(window_size, strict=True)
    buf = dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 1, max_length, window, priority_exponent=1.0)
    count = 2**31 - 1
    steps = {
        "env": jnp.zeros((1, max_length), jnp.int32),
        "pos": jnp.arange(count - max_length, count, dtype=jnp.int32)[None],
    }
    streams = buf.streams.restore(steps, np.array([count]), np.array([max_length]))
    return buf.with_streams(streams), count


@SLOW
def test_stamps_near_2_31_do_not_overflow():
    # `start + W <= count` overflows int32 for a start near 2**31: a window whose last step
    # is not yet taken passed for a stored one, and its update was written to a leaf. The
    # check is `start <= count - W`.
    buf, count = _near_the_top()
    env = np.zeros(1, np.int32)
    for start in [count - 3, count - 2, count - 1]:  # taken, but not whole windows yet
        with pytest.raises(RuntimeError, match="a stamp this buffer cannot have given"):
            buf.set_priorities(env, np.array([start], np.int32), jnp.ones(1))
    stale = buf.stale(np.zeros(3, np.int32), np.array([count - 9, count - 8, count - 1]))
    assert stale.tolist() == [True, False, False]
    # A stored window near the top takes its update, and samples stay among stored windows.
    buf = buf.set_priorities(env, np.array([count - 4], np.int32), jnp.array([1000.0]))
    out = buf.sample(jax.random.key(0), 64)
    start = np.asarray(out.sample.start).astype(np.int64)
    assert ((start >= count - 8) & (start <= count - 4)).all()
    assert (start == count - 4).mean() > 0.9
    items = np.asarray(out.sample.items["pos"]).astype(np.int64)
    np.testing.assert_array_equal(items, start[:, None] + np.arange(4))


@SLOW
def test_priorities_masses_and_beta_are_not_wrapped():
    buf, model = _make(CONFIGS[1])
    for _ in range(3):
        buf = buf.add(_steps(model, [0, 1]))
        model.add(unstack(_steps(model, [0, 1]), 2), [0, 1])
    ids, starts = np.array([0, 1], np.int32), np.array([0, 1], np.int32)
    big = buf.set_priorities(ids, starts, np.array([2**32, 1], np.int64))
    assert float(big.max_priority) == 2.0**32  # not the int32 0
    masses = big.window_priorities()
    assert float(masses.mass[0, 0]) == pytest.approx((2.0**32) ** ALPHA, rel=1e-6)
    # beta = 2**32 (not 0, which would make every weight 1): the heavier windows weigh 0.
    two = buf.set_priorities(ids, starts, np.array([2, 2], np.int64))
    w = np.asarray(two.sample(jax.random.key(1), 64, beta=np.int64(2**32)).weights)
    assert set(w.tolist()) == {0.0, 1.0}
    # with_window_priorities: int64 masses and max_priority, each in its own dtype.
    m = np.where(np.asarray(masses.held), 1, 0).astype(np.int64)
    m[0, 0] = 2**32
    back = buf.with_window_priorities(m, max_priority=np.int64(2**32 + 5))
    assert float(back.tree.leaves[0]) == 2.0**32
    assert float(back.max_priority) == float(np.float32(2**32 + 5))
    call = "`PrioritisedTrajectoryBuffer.with_window_priorities`"
    with pytest.raises(RuntimeError, match=re.escape(f"{call}: `masses` holds a finite value")):
        buf.with_window_priorities(np.where(m > 0, 1e39, 0.0))
    with pytest.raises(RuntimeError, match=re.escape(f"{call}: `max_priority` holds a finite")):
        buf.with_window_priorities(masses.mass, max_priority=10**400)
    with pytest.raises(RuntimeError, match="`PrioritisedTrajectoryBuffer.set_priorities`: `pri"):
        buf.set_priorities(ids, starts, np.array([1e39, 1.0]))
    with pytest.raises(RuntimeError, match=re.escape("`PrioritisedTrajectoryBuffer.sample`: `b")):
        buf.sample(jax.random.key(1), 4, beta=np.float64(1e39))
