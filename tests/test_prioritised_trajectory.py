"""PrioritisedTrajectoryBuffer against its NumPy model: async adds, windows entering and
leaving, samples, delayed (stale) priority updates."""

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, precondition, rule, RuleBasedStateMachine

from .helpers import assert_frequencies, unstack
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
    buf = dx.PrioritisedTrajectoryBuffer(
        PROTOTYPE,
        num_envs,
        max_length,
        length,
        burn_in=burn_in,
        bootstrap=bootstrap,
        period=period,
        priority_exponent=ALPHA,
        **kwargs,
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
    k = buf.slots_per_env
    want = np.zeros(buf.tree.capacity)
    for env, start in model.priorities:
        want[env * k + (start // buf.period) % k] = model.mass((env, start))
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
        n = self.buf.trajectories.num_envs
        env_ids = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1))
        steps = _steps(self.model, env_ids)
        self.buf = _add(self.buf, steps, np.asarray(env_ids, np.int32))
        self.model.add(unstack(steps, len(env_ids)), env_ids)

    @rule(times=st.sampled_from([1, 7]))
    def add_all(self, times):
        n = self.buf.trajectories.num_envs
        for _ in range(times):  # 7 lock-step adds wrap every stream
            steps = _steps(self.model, list(range(n)))
            self.buf = _add_all(self.buf, steps)
            self.model.add(unstack(steps, n), list(range(n)))

    @rule(length=st.sampled_from([2, 9]))
    def extend(self, length):
        # `length` steps for every env in one call (lock-step, as flashbax adds); 9 wraps every
        # stream of every config. Partial `env_ids` go through the same code as in `add` and
        # are covered by the registry (tests/registry.py).
        env_ids = list(range(self.buf.trajectories.num_envs))
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


TestPrioritisedTrajectoryMachine = PrioritisedTrajectoryMachine.TestCase


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


@pytest.mark.parametrize("stratified", [False, True], ids=["iid", "stratified"])
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


def test_errors():
    buf, model = _make(CONFIGS[0])
    key = jax.random.key(0)
    with pytest.raises(RuntimeError, match="no window is admissible yet"):
        buf.sample(key, 4)
    with pytest.raises(ValueError, match="longer than max_length mod period = 2 steps"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, 2, period=4)
    with pytest.raises(ValueError, match="must be at most max_length = 6, got 8"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, 2, period=8)
    with pytest.raises(ValueError, match="longer than max_length"):
        dx.PrioritisedTrajectoryBuffer(PROTOTYPE, 2, 6, 5, burn_in=2)
    for _ in range(4):
        buf = buf.add(_steps(model, [0, 1, 2]))
        model.add(unstack(_steps(model, [0, 1, 2]), 3), [0, 1, 2])
    ids = np.asarray([0, 1], np.int32)
    for starts in ([1, 0], [-2, 0], [2, 0], [0, 4]):  # off period, negative, not yet stored
        with pytest.raises(RuntimeError, match="a stamp this buffer cannot have given"):
            buf.set_priorities(ids, np.asarray(starts, np.int32), jnp.ones(2))
        with pytest.raises(StampError):
            model.set_priorities(ids.tolist(), starts, [1.0, 1.0])
    with pytest.raises(RuntimeError, match="priorities must be finite and non-negative"):
        buf.set_priorities(ids, np.asarray([0, 0], np.int32), jnp.asarray([1.0, jnp.nan]))
    with pytest.raises(BadPriorityError):
        model.set_priorities(ids.tolist(), [0, 0], [1.0, float("nan")])
    zero = buf.set_priorities(np.asarray([0, 1, 2], np.int32), np.zeros(3, np.int32), jnp.zeros(3))
    with pytest.raises(RuntimeError, match="every admissible window has priority 0"):
        zero.sample(key, 4)
