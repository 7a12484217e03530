"""TrajectoryBuffer against its NumPy model: async adds, windows, peeks, sampled sequences."""

import re

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx._abstract import Source
from hypothesis.stateful import initialize, invariant, precondition, rule, RuleBasedStateMachine

from .helpers import (
    assert_frequencies,
    assert_tree_equal,
    enable_x64,
    machine_tests,
    random_batch,
    rotation,
    SLOW,
    SPECS,
    to_numpy,
    unstack,
)
from .reference import EmptyBufferError, EnvIdError, RefTrajectoryBuffer


# A small fixed catalogue, so that compiled functions are reused across examples: one item spec
# and three (num_envs, max_length) configurations. Every step carries a unique int32 label (from
# 1; 0 is what zero fill writes) next to a payload whose leaves cover the dtypes that must
# survive storage and zero fill (bfloat16, int8, float32, uint32, bool).
SPEC = {
    "label": jax.ShapeDtypeStruct((), jnp.int32),
    "reward": jax.ShapeDtypeStruct((), jnp.float32),
    "x": SPECS["nested"],
    "y": SPECS["tuple"],
}
CONFIGS = [(1, 3), (4, 1), (4, 5)]
BATCH = 8


@eqx.filter_jit
def _add(buf, items, env_ids):
    return buf.add(items, env_ids=env_ids)


@eqx.filter_jit
def _add_all(buf, items):
    return buf.add(items)


@eqx.filter_jit
def _reset(buf):
    return buf.reset_online_queue()


@eqx.filter_jit
def _peek(buf, env_ids):
    return buf.peek(env_ids)


# The plain windows the state machine samples with, one per sequence length (min(2, m) and m
# over the configurations' max_length m), built once so that compiled samplers are reused.
PLAIN_WINDOWS = {t: dx.Window(t) for t in (1, 2, 3, 5)}


@eqx.filter_jit
def _sample(buf, key, window, power, source):
    return buf.sample(key, BATCH, window, distribution_power=power, source=source)


MIXED = {"replay": 5, "online": 3}  # the rows of each source, replay rows first


@eqx.filter_jit
def _sample_mixed(buf, key, window, power):
    return buf.sample(key, 8, window, distribution_power=power, source=MIXED)


def _episode_end(step):
    return step["y"][1]  # a function that picks the stored bool leaf


# Window options the state machine samples with (sequence_length 1 or 2; static, so each
# compiles once per configuration): burn-in, bootstrap, period, strict, the episode-end
# policies. Each comes with its source and its `Window`, built once.
WINDOW_OPTIONS = [
    dict(sequence_length=1, burn_in=1, bootstrap=1, period=2, source="replay"),
    dict(
        sequence_length=2,
        strict=True,
        period=2,
        episode_ends="truncate",
        done=_episode_end,
        source="online",
    ),
    dict(sequence_length=1, burn_in=2, episode_ends="within", done=(_episode_end,)),
]
WINDOW_CASES = [
    (options, dx.Window(**{k: v for k, v in options.items() if k != "source"}))
    for options in WINDOW_OPTIONS
]


@eqx.filter_jit
def _sample_windows(buf, key, power, window, source):
    return buf.sample(key, BATCH, window, distribution_power=power, source=source)


# The n-step descriptions the state machine samples with, built once.
NSTEPS = {n: dx.NStep(n, reward="reward", terminated=_episode_end) for n in (1, 2)}


@eqx.filter_jit
def _sample_transitions(buf, key, n, source):
    return buf.sample(key, BATCH, NSTEPS[n], discount=0.5, source=source)


def stored_windows(buf: dx.TrajectoryBuffer, source: Source = "replay") -> list:
    """Each env's window read straight from the fields, oldest step first, as NumPy items."""
    data = to_numpy(buf.data)
    head, lengths = np.asarray(buf.head), np.asarray(buf.lengths(source))
    out = []
    for env in range(buf.num_envs):
        slots = (head[env] - lengths[env] + np.arange(lengths[env])) % buf.max_length
        out.append([jax.tree.map(lambda x: x[env, s], data) for s in slots])
    return out


def check_sequences(sample, model: RefTrajectoryBuffer, t: int, source: str, labels: dict):
    """Every sampled row is a start in the model's support, with the model's steps in it, its
    mask a prefix of length `min(L - offset, T)`, and zeros after it; `learn` is `mask` (no
    burn-in, no bootstrap), and the stamp is the start's env and absolute step number."""
    seqs, mask = to_numpy(sample.items), np.asarray(sample.mask)
    assert (np.asarray(sample.learn) == mask).all()
    stamps = list(zip(np.asarray(sample.env).tolist(), np.asarray(sample.start).tolist()))
    support = model.start_probabilities(t, 1.0, source)  # power only changes the weights
    for b, row in enumerate(unstack(seqs, mask.shape[0])):
        env, position = labels[int(row["label"][0])]
        assert stamps[b] == (env, position), (b, stamps[b], env, position)
        window = model.window(env, source)
        offsets = [i for i, step in enumerate(window) if int(step["label"]) == row["label"][0]]
        assert len(offsets) == 1, (b, env, position)
        offset = offsets[0]
        assert (env, offset) in support
        expected = model.sequence(env, offset, t, source)
        r = len(expected)
        assert r == min(len(window) - offset, t)
        assert mask[b].tolist() == [i < r for i in range(t)]
        for i in range(t):
            step = jax.tree.map(lambda x: x[i], row)
            if i < r:
                assert_tree_equal(step, expected[i], f"row {b} step {i}")
            else:
                zero = jax.tree.map(lambda x: np.zeros_like(x), expected[0])
                assert_tree_equal(step, zero, f"row {b} step {i} (masked)")


class TrajectoryMachine(RuleBasedStateMachine):
    """Random interleavings of async adds, online-queue resets, peeks and samples."""

    @initialize(config=st.sampled_from(CONFIGS), data=st.data(), seed=st.integers(0, 2**32 - 1))
    def init(self, config, data, seed):
        num_envs, max_length = config
        self.spec = SPEC
        self.rng = np.random.default_rng(seed)
        self.key = jax.random.key(seed)
        self.buf = dx.TrajectoryBuffer(self.spec, num_envs, max_length)
        self.model = RefTrajectoryBuffer(num_envs, max_length)
        # Only these envs ever receive data; the others stay empty throughout.
        self.active = sorted(data.draw(st.sets(st.integers(0, num_envs - 1)), label="active"))
        self.labels: dict[int, tuple[int, int]] = {}  # label -> (env, position in its stream)
        self.added = [0] * num_envs

    def _steps(self, env_ids):
        n = len(env_ids)
        items = random_batch(self.spec, n, self.rng)
        first = len(self.labels) + 1
        items["label"] = np.arange(first, first + n, dtype=np.int32)
        items["reward"] = self.rng.standard_normal(n).astype(np.float32)  # summed: finite
        return items

    def _add(self, env_ids, all_envs=False):
        items = self._steps(env_ids)
        if all_envs:
            self.buf = _add_all(self.buf, items)
        else:
            self.buf = _add(self.buf, items, np.asarray(env_ids, np.int32))
        self.model.add(unstack(items, len(env_ids)), list(env_ids))
        for label, env in zip(items["label"].tolist(), env_ids):
            self.labels[label] = (env, self.added[env])
            self.added[env] += 1

    def _subset(self, data):
        if not self.active:
            return []
        return data.draw(st.lists(st.sampled_from(self.active), unique=True), label="env_ids")

    @rule(data=st.data())
    def add(self, data):
        self._add(self._subset(data))

    @precondition(lambda self: len(self.active) == self.buf.num_envs)
    @rule()
    def add_all(self):
        self._add(list(range(self.buf.num_envs)), all_envs=True)

    @rule(data=st.data(), times=st.sampled_from([5, 13]))
    def add_repeatedly(self, data, times):
        # The same subset many times in a row: streams wrap around several times.
        env_ids = self._subset(data)
        for _ in range(times):
            self._add(env_ids)

    @rule(data=st.data(), fault=st.sampled_from(["repeat", "too large", "negative"]))
    def add_bad_ids(self, data, fault):
        num_envs = self.buf.num_envs
        # Two ids, so that the compiled add of two steps is reused.
        env = data.draw(st.integers(0, num_envs - 1))
        bad = {"repeat": env, "too large": num_envs, "negative": -1}[fault]
        env_ids = data.draw(st.permutations([env, bad]))
        items = self._steps(env_ids)
        with pytest.raises(EnvIdError):
            self.model.add(unstack(items, len(env_ids)), env_ids)
        with pytest.raises(RuntimeError, match="out of range|more than once"):
            _add(self.buf, items, np.asarray(env_ids, np.int32))

    @rule()
    def reset_online_queue(self):
        self.buf = _reset(self.buf)
        self.model.reset_online_queue()

    @rule(data=st.data())
    def peek(self, data):
        num_envs = self.buf.num_envs
        env_ids = data.draw(st.lists(st.integers(-1, num_envs), min_size=3, max_size=3))
        try:
            expected = self.model.peek(env_ids)
        except (EnvIdError, EmptyBufferError):
            with pytest.raises(RuntimeError, match="out of range|no stored step"):
                _peek(self.buf, np.asarray(env_ids, np.int32))
            return
        got = _peek(self.buf, np.asarray(env_ids, np.int32))
        for i, step in enumerate(expected):
            assert_tree_equal(jax.tree.map(lambda x: x[i], got), step)

    @rule(
        data=st.data(),
        source=st.sampled_from(["replay", "online"]),
        power=st.sampled_from([0.0, 1.0, 2.0]),
    )
    def sample(self, data, source, power):
        m = self.buf.max_length
        t = data.draw(st.sampled_from(sorted({min(2, m), m})), label="sequence_length")
        self.key, key = jax.random.split(self.key)
        args = (self.buf, key, PLAIN_WINDOWS[t], jnp.asarray(power, jnp.float32), source)
        if self.model.lengths(source).sum() == 0:
            with pytest.raises(RuntimeError, match="cannot sample from an empty"):
                _sample(*args)
            return
        check_sequences(_sample(*args), self.model, t, source, self.labels)

    @rule(power=st.sampled_from([0.0, 1.0]))
    def sample_mixed(self, power):
        t = min(2, self.buf.max_length)
        self.key, key = jax.random.split(self.key)
        if 0 in (self.model.lengths("replay").sum(), self.model.lengths("online").sum()):
            with pytest.raises(RuntimeError, match="cannot sample from an empty"):
                _sample_mixed(self.buf, key, PLAIN_WINDOWS[t], jnp.asarray(power, jnp.float32))
            return
        sample = _sample_mixed(self.buf, key, PLAIN_WINDOWS[t], jnp.asarray(power, jnp.float32))
        # Replay rows first, then online rows.
        check_sequences(jax.tree.map(lambda x: x[:5], sample), self.model, t, "replay", self.labels)
        check_sequences(jax.tree.map(lambda x: x[5:], sample), self.model, t, "online", self.labels)

    # Each option set comes with its source (static too), to keep compilations few.
    @rule(case=st.sampled_from(WINDOW_CASES), power=st.sampled_from([0.0, 1.0]))
    def sample_windows(self, case, power):
        options, window = case
        source = options.get("source", "replay")
        burn_in, length = options.get("burn_in", 0), options["sequence_length"]
        size = burn_in + length + options.get("bootstrap", 0)
        self.key, key = jax.random.split(self.key)
        args = (self.buf, key, jnp.asarray(power, jnp.float32), window, source)
        if size > self.buf.max_length:
            with pytest.raises(ValueError, match="is longer than max_length"):
                _sample_windows(*args)
            return
        try:
            support = self.model.window_probabilities(
                size,
                period=options.get("period", 1),
                min_real=burn_in + 1,
                strict=options.get("strict", False),
                source=source,
            )
        except EmptyBufferError:
            with pytest.raises(RuntimeError, match="no env's .* window has an admissible start"):
                _sample_windows(*args)
            return
        sample = _sample_windows(*args)
        policy = options.get("episode_ends", "cross")
        learning = [burn_in <= t < burn_in + length for t in range(size)]
        rows = unstack(to_numpy(sample.items), BATCH)
        for b, (env, start) in enumerate(zip(sample.env.tolist(), sample.start.tolist())):
            assert (env, start) in support, (env, start)
            mask = self.model.window_mask(env, start, size, burn_in, policy, _episode_end)
            assert sample.mask[b].tolist() == mask
            assert sample.learn[b].tolist() == [m and x for m, x in zip(mask, learning)]
            for t in range(size):
                step = jax.tree.map(lambda x: x[t], rows[b])
                if mask[t]:
                    assert_tree_equal(step, self.model.step(env, start + t), f"row {b} step {t}")
                else:
                    zero = jax.tree.map(np.zeros_like, step)
                    assert_tree_equal(step, zero, f"row {b} step {t} (masked)")

    @rule(n_source=st.sampled_from([(1, "replay"), (2, "online")]))
    def sample_transitions(self, n_source):
        n, source = n_source
        self.key, key = jax.random.split(self.key)
        if n + 1 > self.buf.max_length:
            with pytest.raises(ValueError, match="more than max_length"):
                _sample_transitions(self.buf, key, n, source)
            return
        starts = set(self.model.transition_starts(n, source))
        if not starts:
            with pytest.raises(RuntimeError, match="steps yet"):
                _sample_transitions(self.buf, key, n, source)
            return
        out = _sample_transitions(self.buf, key, n, source)
        first, following = to_numpy(out.first), to_numpy(out.next)
        for b, (env, t) in enumerate(zip(out.env.tolist(), out.start.tolist())):
            assert (env, t) in starts
            returns, discount, next_t = self.model.transition(
                env, t, n, 0.5, lambda s: s["reward"], _episode_end, lambda s: False
            )
            np.testing.assert_allclose(float(out.returns[b]), returns, rtol=1e-5, atol=1e-6)
            assert float(out.discount[b]) == discount
            assert_tree_equal(jax.tree.map(lambda x: x[b], first), self.model.step(env, t))
            assert_tree_equal(jax.tree.map(lambda x: x[b], following), self.model.step(env, next_t))

    @invariant()
    def same_state(self):
        m = self.buf.max_length
        head = np.asarray(self.buf.head)
        replay = np.asarray(self.buf.lengths("replay"))
        online = np.asarray(self.buf.lengths("online"))
        assert self.buf.head.dtype == replay.dtype == online.dtype == np.int32
        # Bounded counters, whatever the number of steps that went through.
        assert ((0 <= head) & (head < m)).all()
        assert ((0 <= online) & (online <= replay) & (replay <= m)).all()
        assert replay.tolist() == self.model.lengths("replay").tolist()
        assert np.asarray(self.buf.step_count).tolist() == self.model.count
        assert (head == np.asarray(self.model.count) % m).all()
        assert online.tolist() == self.model.lengths("online").tolist()
        for source in ("replay", "online"):
            windows = stored_windows(self.buf, source)
            for env in range(self.buf.num_envs):
                for got, expected in zip(windows[env], self.model.window(env, source)):
                    assert_tree_equal(got, expected, f"env {env} {source}")


TestTrajectoryMachine, TestTrajectoryMachineFull = machine_tests(TrajectoryMachine)


# Sampling statistics. A buffer filled by random async adds, whose windows are, against
# T = 5: env 0 empty (it never receives a step); env 1 replay 3 / online 2 (shorter); env 2
# replay 5 / online 5 (equal); env 3 replay 12 / online 9 (longer; env 3 wrapped around its
# 12 slots three times).
STATS_NUM_ENVS, STATS_MAX_LENGTH = 4, 12
STATS_DRAWS = 40_000


def _labelled_steps(env_ids, added):
    env_ids = np.asarray(env_ids, np.int32)
    return {"env": env_ids, "pos": np.asarray([added[e] for e in env_ids], np.int32)}


def _async_adds(buf, model, added, counts, rng):
    """Add `counts[e]` steps to each env e, in random subsets and orders, one subset per add."""
    left = dict(counts)
    while any(left.values()):
        ready = [e for e, n in left.items() if n > 0]
        env_ids = [e for e in rng.permutation(ready) if rng.random() < 0.6] or ready[:1]
        steps = _labelled_steps(env_ids, added)
        buf = buf.add(steps, env_ids=np.asarray(env_ids, np.int32))
        model.add(unstack(steps, len(env_ids)), [int(e) for e in env_ids])
        for e in env_ids:
            added[e] += 1
            left[e] -= 1
    return buf


@pytest.fixture(scope="module")
def stats_buffer():
    rng = np.random.default_rng(0)
    prototype = {"env": jnp.zeros((), jnp.int32), "pos": jnp.zeros((), jnp.int32)}
    buf = dx.TrajectoryBuffer(prototype, STATS_NUM_ENVS, STATS_MAX_LENGTH)
    model = RefTrajectoryBuffer(STATS_NUM_ENVS, STATS_MAX_LENGTH)
    added = [0] * STATS_NUM_ENVS
    buf = _async_adds(buf, model, added, {1: 1, 3: 30}, rng)
    buf = buf.reset_online_queue()
    model.reset_online_queue()
    buf = _async_adds(buf, model, added, {1: 2, 2: 5, 3: 9}, rng)
    assert buf.lengths("replay").tolist() == [0, 3, 5, 12]
    assert buf.lengths("online").tolist() == [0, 2, 5, 9]
    return buf, model, added


# The windows the statistics sample with, one per sequence length, built once.
STATS_WINDOWS = {t: dx.Window(t) for t in (1, 5, 12)}

_sample_stats = eqx.filter_jit(
    lambda b, key, t, power, source: b.sample(
        key, STATS_DRAWS, STATS_WINDOWS[t], distribution_power=power, source=source
    )
)


def _decode(seqs, mask, model, added, t, source):
    """The (env, offset) of each sampled row, after checking the row's contents exactly."""
    env_, pos = np.asarray(seqs["env"]), np.asarray(seqs["pos"])
    mask = np.asarray(mask)
    env = env_[:, 0]
    lengths = model.lengths(source)
    offset = pos[:, 0] - (np.asarray(added)[env] - lengths[env])
    assert ((0 <= offset) & (offset < lengths[env])).all()
    r = np.minimum(lengths[env] - offset, t)
    steps = np.arange(t)[None, :]
    assert (mask == (steps < r[:, None])).all()
    # Real steps are consecutive steps of one env's stream; masked steps are zeros.
    assert (np.where(mask, env_, 0) == np.where(mask, env[:, None], 0)).all()
    assert (np.where(mask, pos, 0) == np.where(mask, pos[:, :1] + steps, 0)).all()
    assert (env_[~mask] == 0).all() and (pos[~mask] == 0).all()
    return env, offset


def _frequencies(env, offset, probabilities: dict):
    cells = sorted(probabilities)
    index = {cell: i for i, cell in enumerate(cells)}
    draws = [index[cell] for cell in zip(env.tolist(), offset.tolist())]  # KeyError: off support
    counts = np.bincount(draws, minlength=len(cells))
    return counts, np.asarray([probabilities[c] for c in cells])


@pytest.mark.parametrize("source", rotation(["replay", "online"], 0, keep=1))
@pytest.mark.parametrize(
    "t, power",
    rotation([(5, 0.0), (5, 1.0), (5, 2.0), (1, 1.0), (12, 1.0), (12, 2.0)], 2, 1, several=True),
)
def test_start_frequencies_match_exact_probabilities(stats_buffer, source, t, power):
    buf, model, added = stats_buffer
    key = jax.random.key(1000 * t + int(10 * power) + (source == "online"))
    seqs, mask, *_ = _sample_stats(buf, key, t, jnp.asarray(power, jnp.float32), source)
    env, offset = _decode(seqs, mask, model, added, t, source)
    counts, probabilities = _frequencies(env, offset, model.start_probabilities(t, power, source))
    # Pearson chi-square against the model's brute-force probabilities: a correct sampler
    # fails with probability 1e-6 per case (1.2e-5 over the 12 cases).
    assert_frequencies(counts, probabilities, alpha=1e-6)


def test_frequency_test_detects_a_wrong_power(stats_buffer):
    # The test above must be able to fail: draws made with power 1 are rejected against the
    # probabilities of power 0 (and of power 1.2) with the same number of draws.
    buf, model, added = stats_buffer
    seqs, mask, *_ = _sample_stats(buf, jax.random.key(7), 5, jnp.asarray(1.0), "replay")
    env, offset = _decode(seqs, mask, model, added, 5, "replay")
    for wrong in [0.0, 1.2]:
        counts, probabilities = _frequencies(
            env, offset, model.start_probabilities(5, wrong, "replay")
        )
        with pytest.raises(AssertionError, match="chi-square"):
            assert_frequencies(counts, probabilities, alpha=1e-6)


def test_sample_mixed_rows_follow_their_sources(stats_buffer):
    buf, model, added = stats_buffer
    n = STATS_DRAWS // 2
    mixed = eqx.filter_jit(
        lambda b, k: b.sample(
            k, 2 * n, STATS_WINDOWS[5], distribution_power=2.0, source={"replay": n, "online": n}
        )
    )
    seqs, mask, *_ = mixed(buf, jax.random.key(3))
    for source, rows in [("replay", slice(0, n)), ("online", slice(n, 2 * n))]:
        part = jax.tree.map(lambda x: x[rows], (seqs, mask))
        env, offset = _decode(*part, model=model, added=added, t=5, source=source)
        probabilities = model.start_probabilities(5, 2.0, source)
        # False-failure rate 1e-6 per source.
        assert_frequencies(*_frequencies(env, offset, probabilities), alpha=1e-6)


@pytest.fixture(scope="module")
def short_windows():
    """Windows all shorter than T = 12, the longest not in the last env: replay lengths
    [9, 2, 0, 11], online lengths [9, 2, 0, 5]."""
    rng = np.random.default_rng(1)
    prototype = {"env": jnp.zeros((), jnp.int32), "pos": jnp.zeros((), jnp.int32)}
    buf = dx.TrajectoryBuffer(prototype, 4, 12)
    model = RefTrajectoryBuffer(4, 12)
    added = [0] * 4
    buf = _async_adds(buf, model, added, {3: 6}, rng)
    buf = buf.reset_online_queue()
    model.reset_online_queue()
    buf = _async_adds(buf, model, added, {0: 9, 1: 2, 3: 5}, rng)
    return buf, model, added


# Extreme powers: the slow tier.
@SLOW
@pytest.mark.parametrize("source", ["replay", "online"])
def test_extreme_powers_neither_overflow_nor_underflow(short_windows, source):
    buf, model, added = short_windows
    lengths = model.lengths(source)
    # Power 1000 with T = 12: the longest single start (offset 0 of the longest window)
    # outweighs all others together by more than 1e40. Computed naively, 12**1000 overflows
    # float32, and scaled by 11**1000 (the largest possible tail weight) every window shorter
    # than 10 underflows to weight 0.
    seqs, mask, *_ = _sample_stats(buf, jax.random.key(5), 12, jnp.asarray(1000.0), source)
    env, offset = _decode(seqs, mask, model, added, 12, source)
    assert (env == np.argmax(lengths)).all() and (offset == 0).all()
    # Power -1000: only the starts with one step left (the newest step of each non-empty env)
    # have non-negligible weight, all equal.
    seqs, mask, *_ = _sample_stats(buf, jax.random.key(6), 5, jnp.asarray(-1000.0), source)
    env, offset = _decode(seqs, mask, model, added, 5, source)
    assert (offset == lengths[env] - 1).all()
    counts = np.bincount(env, minlength=4)
    nonempty = lengths > 0
    # Uniform over the non-empty envs; false-failure rate 1e-6.
    assert_frequencies(counts, nonempty / nonempty.sum(), alpha=1e-6)


# Errors: static facts at trace time, faults in the data through eqx.error_if.

STEP = {"obs": jnp.zeros(3, jnp.float32), "done": jnp.zeros((), jnp.bool_)}
# Windows of 2 and 3 steps, built once.
TWO, THREE = dx.Window(2), dx.Window(3)


def _steps(n, value=1.0):
    return {"obs": jnp.full((n, 3), value, jnp.float32), "done": jnp.zeros(n, jnp.bool_)}


def _ids(*ids):
    return np.asarray(ids, np.int32)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"TrajectoryBuffer\(num_envs=...\)` must be positive"):
        dx.TrajectoryBuffer(STEP, 0, 4)
    with pytest.raises(ValueError, match=r"TrajectoryBuffer\(max_length=...\)` must be positive"):
        dx.TrajectoryBuffer(STEP, 2, 0)
    with pytest.raises((TypeError, ValueError), match="no array leaves|prototype"):
        dx.TrajectoryBuffer({}, 2, 4)


@pytest.mark.parametrize("jit", [False, True])
def test_add_static_errors(jit):
    buf = dx.TrajectoryBuffer(STEP, 3, 4)
    add = (
        eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))
        if jit
        else (lambda b, x, i: b.add(x, env_ids=i))
    )
    with pytest.raises(ValueError, match="has 2 entries, expected 3: one per step"):
        add(buf, _steps(3), _ids(0, 1))
    with pytest.raises((ValueError, TypeError), match="must have 1 axis|parameter 'env_ids'"):
        add(buf, _steps(2), np.zeros((2, 1), np.int32))
    with pytest.raises(TypeError, match="must be an integer array|parameter 'env_ids'"):
        add(buf, _steps(2), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"leaf `\['obs'\]` has dtype float16, expected float32"):
        add(buf, {"obs": np.ones((2, 3), np.float16), "done": np.zeros(2, bool)}, _ids(0, 1))
    with pytest.raises(ValueError, match="steps for every env.*2 entries and num_envs is 3"):
        buf.add(_steps(2))


@pytest.mark.parametrize("jit", [False, True])
def test_add_bad_env_ids(jit):
    buf = dx.TrajectoryBuffer(STEP, 3, 4)
    add = (
        eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))
        if jit
        else (lambda b, x, i: b.add(x, env_ids=i))
    )
    for ids, msg in [
        (_ids(0, 3), "out of range"),
        (_ids(-1, 0), "out of range"),
        (_ids(2, 2), "occurs more than once"),
        (np.asarray([1, 2**32 - 1], np.uint32), "out of range"),
    ]:
        with pytest.raises(RuntimeError, match=msg):
            add(buf, _steps(2), ids)
    # Unsigned and narrow integer ids are fine; an empty list adds nothing.
    buf = add(buf, _steps(2), np.asarray([2, 0], np.uint8))
    assert buf.lengths().tolist() == [1, 0, 1]
    assert buf.add(_steps(0), env_ids=_ids()) is buf


# An eager 64-bit edge case: the slow tier (tests/test_faults.py's test_env_ids_and_peek_do_not_wrap
# runs in the default one).
@SLOW
def test_env_ids_are_checked_in_their_own_dtype():
    # int64 ids under x64: 2**32 + 1 would wrap to the valid id 1 in int32.
    with enable_x64(True):
        buf = dx.TrajectoryBuffer(STEP, 3, 4)
        ids = np.asarray([2**32 + 1, 0], np.int64)
        with pytest.raises(RuntimeError, match="out of range"):
            buf.add(_steps(2), env_ids=ids)
        with pytest.raises(RuntimeError, match="out of range"):
            buf.add(_steps(3)).peek(ids)


def test_sample_static_errors():
    buf = dx.TrajectoryBuffer(STEP, 2, 4).add(_steps(2))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"sample\(batch_size=...\)` must be positive"):
        buf.sample(key, 0, TWO)
    with pytest.raises(ValueError, match=r"= 0 \+ 5 \+ 0 = 5 steps is longer than max_length = 4"):
        buf.sample(key, 3, dx.Window(5))
    with pytest.raises(ValueError, match=r"`Window\(sequence_length=...\)` must be positive"):
        dx.Window(0)
    with pytest.raises(Exception, match="must be one of 'replay', 'online'|parameter 'source'"):
        buf.sample(key, 3, TWO, source="both")  # pyright: ignore[reportArgumentType]
    with pytest.raises(Exception, match="must be a scalar|parameter 'distribution_power'"):
        buf.sample(key, 3, TWO, distribution_power=jnp.ones(2))
    with pytest.raises(ValueError, match=r"sample\(batch_size=...\)` must be positive"):
        buf.sample(key, 0, TWO, source={"replay": 0, "online": 0})
    with pytest.raises(ValueError, match=r"sample\(source\['online'\]=...\)` must be non-neg"):
        buf.sample(key, 1, TWO, source={"replay": 2, "online": -1})
    with pytest.raises(
        ValueError, match=r"the batch has 3 rows, but its sources give 4 \(2 \+ 2\)"
    ):
        buf.sample(key, 3, TWO, source={"replay": 2, "online": 2})
    with pytest.raises(ValueError, match="a mapping of sources names both"):
        buf.sample(key, 3, TWO, source={"replay": 3})
    with pytest.raises(Exception, match="must be one of|parameter 'source'"):
        buf.lengths("all")  # pyright: ignore[reportArgumentType]


# The faults of every buffer run in the default tier (tests/test_results.py), and the
# machine above samples empty sources; these, in the slow tier.
@SLOW
def test_sample_runtime_errors():
    sample = eqx.filter_jit(lambda b, k, p, s: b.sample(k, 3, TWO, distribution_power=p, source=s))
    mixed = eqx.filter_jit(
        lambda b, k, r, o: b.sample(k, r + o, TWO, source={"replay": r, "online": o})
    )
    key = jax.random.key(0)
    empty = dx.TrajectoryBuffer(STEP, 2, 4)
    with pytest.raises(RuntimeError, match="empty TrajectoryBuffer: no env has any stored step"):
        sample(empty, key, jnp.asarray(1.0), "replay")
    buf = _reset(_add(empty, _steps(1), _ids(1)))
    sample(buf, key, jnp.asarray(1.0), "replay")
    with pytest.raises(RuntimeError, match="empty online queue"):
        sample(buf, key, jnp.asarray(1.0), "online")
    for bad in [jnp.nan, jnp.inf, -jnp.inf]:
        with pytest.raises(RuntimeError, match="`distribution_power` must be finite"):
            sample(buf, key, jnp.asarray(bad), "replay")
    with pytest.raises(RuntimeError, match="sample`: cannot sample from an empty online"):
        mixed(buf, key, 2, 1)
    # A part of size zero is not sampled, so its source may be empty.
    seqs, mask, *_ = mixed(buf, key, 2, 0)
    assert mask.shape == (2, 2) and bool(mask[:, 0].all())
    with pytest.raises(RuntimeError, match="sample`: cannot sample from an empty Traj"):
        mixed(empty, key, 1, 0)


# Eager faults: the slow tier; the same faults under jit are checked by default (above).
@SLOW
def test_runtime_errors_outside_jit():
    empty = dx.TrajectoryBuffer(STEP, 2, 4)
    with pytest.raises(RuntimeError, match="empty TrajectoryBuffer"):
        empty.sample(jax.random.key(0), 3, TWO)
    with pytest.raises(RuntimeError, match="no stored step yet"):
        empty.peek(_ids(0))


@pytest.mark.parametrize("jit", rotation([False, True], 1, keep=1))
def test_peek(jit):
    peek = eqx.filter_jit(lambda b, i: b.peek(i)) if jit else (lambda b, i: b.peek(i))
    buf = dx.TrajectoryBuffer(STEP, 3, 2)
    buf = buf.add(_steps(2, 1.0), env_ids=_ids(0, 2))
    buf = buf.add(_steps(1, 2.0), env_ids=_ids(2))
    buf = buf.add(_steps(1, 3.0), env_ids=_ids(2))  # env 2 wraps: its newest step is in slot 1
    assert peek(buf, _ids(2, 0, 2))["obs"][:, 0].tolist() == [3.0, 1.0, 3.0]
    assert peek(buf, np.asarray(2, np.int32))["obs"].tolist() == [3.0] * 3  # a scalar id
    with pytest.raises(RuntimeError, match="no stored step yet"):
        peek(buf, _ids(0, 1))
    with pytest.raises(RuntimeError, match="out of range"):
        peek(buf, _ids(3))
    with pytest.raises(RuntimeError, match="no stored step yet"):
        buf.peek()  # every env, and env 1 has nothing
    full = buf.add(_steps(1, 4.0), env_ids=_ids(1))
    assert full.peek()["obs"][:, 0].tolist() == [1.0, 4.0, 3.0]


# The slow tier: static powers (above, and the machine) and traced ones run by default.
@SLOW
def test_power_accepts_python_numbers_and_arrays():
    buf = _add_all(dx.TrajectoryBuffer(STEP, 2, 4), _steps(2))
    key = jax.random.key(0)
    # Python and NumPy numbers are static arguments of filter_jit: they reach `sample` as is.
    sample = eqx.filter_jit(lambda b, k, p: b.sample(k, 5, THREE, distribution_power=p))
    expected = sample(buf, key, jnp.asarray(2.0))
    for power in [2, np.float64(2.0)]:
        assert_tree_equal(sample(buf, key, power), expected)


@SLOW
def test_power_and_discount_are_not_wrapped():
    # Without 64-bit mode `jnp.asarray` wraps an int64: a power of 2**32 + 2 became 2 and a
    # discount of 2**32 + 1 became 1, both accepted silently.
    buf = dx.TrajectoryBuffer({**STEP, "r": jnp.zeros(())}, 1, 8)
    buf = buf.extend(
        {**jax.tree.map(lambda x: x[:, None].repeat(5, 1), _steps(1)), "r": jnp.ones((1, 5))}
    )
    key = jax.random.key(0)
    huge = np.int64(2**32 + 2)
    # A power of 2**32 draws only the windows of the most real steps (3, from starts 0..2).
    assert buf.sample(key, 256, THREE, distribution_power=huge).mask.all()
    mixed: dict[Source, int] = {"replay": 128, "online": 128}
    assert buf.sample(key, 256, THREE, distribution_power=huge, source=mixed).mask.all()
    assert not buf.sample(key, 256, THREE, distribution_power=np.int64(2)).mask.all()
    nstep = dx.NStep(2, reward="r", terminated="done")
    for discount in [np.int64(2**32 + 1), np.array(2**32 + 1, np.int64)]:
        with pytest.raises(RuntimeError, match=r"`discount` must be in \[0, 1\]"):
            buf.sample(key, 4, nstep, discount=discount)
    out = buf.sample(key, 4, nstep, discount=np.int64(1))
    assert out.discount.dtype == jnp.float32
    for source in [None, {"replay": 2, "online": 2}]:  # one source, and both
        msg = re.escape("`TrajectoryBuffer.sample`: `distribution_power` holds a finite value")
        for power in [10**400, np.float64(1e39)]:  # 10**400: JAX's OverflowError named nothing
            with pytest.raises(RuntimeError, match=msg):
                buf.sample(key, 4, THREE, distribution_power=power, source=source)
    with pytest.raises(RuntimeError, match=re.escape("`discount` holds a finite value too")):
        buf.sample(key, 4, nstep, discount=-(10**400))


def test_restore_checks_counts_in_their_own_dtype():
    # `Streams.restore` takes its counts through the index check: an int64 2**32 + 3 is out
    # of range, not the count 3.
    streams = dx.Streams(STEP, 1, 4)
    steps = jax.tree.map(lambda x: x[:, None].repeat(4, 1), _steps(1))
    with pytest.raises(RuntimeError, match=re.escape("`Streams.restore`: `ends` must be in")):
        streams.restore(steps, np.array([2**32 + 3], np.int64), np.array([2], np.int64))
    with pytest.raises(RuntimeError, match=re.escape("`Streams.restore`: `lengths` must be in")):
        streams.restore(steps, np.array([3], np.int64), np.array([2**32 + 2], np.int64))
    restored = streams.restore(steps, np.array([3], np.int64), np.array([2], np.int64))
    assert restored.step_count.tolist() == [3] and restored.lengths.tolist() == [2]


# 1000 adds: the slow tier. The machine above wraps the rings in the default tier.
@SLOW
def test_bounded_counters_after_many_adds():
    # 1000 adds through 3 slots: the cursor and lengths stay in [0, 3]; the step counts, int32,
    # count every step (they number the steps; `add` refuses a step past 2**31 - 1).
    add = eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))
    buf = dx.TrajectoryBuffer(STEP, 2, 3)
    for i in range(1000):
        buf = add(buf, _steps(1, float(i)), _ids(i % 2))
    assert buf.head.tolist() == [500 % 3, 500 % 3]
    assert buf.step_count.dtype == jnp.int32 and buf.step_count.tolist() == [500, 500]
    assert buf.lengths().tolist() == [3, 3] and buf.lengths("online").tolist() == [3, 3]
    assert buf.peek()["obs"][:, 0].tolist() == [998.0, 999.0]


# The machine above checks zero-filled steps in the default tier; this one, in the slow tier.
@SLOW
def test_sample_shapes_dtypes_and_zero_fill():
    spec = SPEC
    buf = dx.TrajectoryBuffer(spec, 2, 6)
    items = random_batch(spec, 1, np.random.default_rng(0))
    buf = _add(buf, items, _ids(1))  # one step: every sequence is 1 real + 3 zero steps
    four = dx.Window(4)
    seqs, mask, *_ = eqx.filter_jit(lambda b, k: b.sample(k, 7, four))(buf, jax.random.key(0))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), seqs) == jax.tree.map(
        lambda s: ((7, 4, *s.shape), s.dtype), spec
    )
    assert mask.dtype == jnp.bool_ and mask.tolist() == [[True, False, False, False]] * 7
    for t in range(4):
        step = jax.tree.map(lambda x: x[:, t], seqs)
        expected = jax.tree.map(lambda x: np.repeat(x if t == 0 else np.zeros_like(x), 7, 0), items)
        assert_tree_equal(step, expected, f"step {t}")


# Transformations: donation in place, scan carry, vmap, one compilation per configuration.


def _async_inputs(i, n=2, num_envs=4):
    """Step i of a deterministic async schedule: n distinct env ids, steps labelled by i."""
    env_ids = np.asarray([(i + 3 * j) % num_envs for j in range(n)], np.int32)
    return _steps(n, float(i)), env_ids


# Faults of a vmapped buffer: tests/test_results.py (each lane keeps its own result) and
# tests/test_uniform.py in the default tier; a trajectory buffer's, in the slow tier.
@SLOW
def test_vmap_errors():
    bufs = eqx.filter_vmap(lambda p: dx.TrajectoryBuffer(p, 2, 3), in_axes=None, axis_size=2)(STEP)
    keys = jax.random.split(jax.random.key(0), 2)
    sample = eqx.filter_jit(eqx.filter_vmap(lambda b, k: b.sample(k, 3, TWO)))
    add = eqx.filter_jit(eqx.filter_vmap(lambda b, x, i: b.add(x, env_ids=i)))
    with pytest.raises(RuntimeError, match="cannot sample from an empty TrajectoryBuffer"):
        sample(bufs, keys)
    items = jax.tree.map(lambda x: jnp.stack([x, x]), _steps(2))
    # Only the second buffer gets a repeated id: the error still fires.
    with pytest.raises(RuntimeError, match="occurs more than once"):
        add(bufs, items, jnp.asarray([[0, 1], [1, 1]], jnp.int32))
    # Only the first buffer stays empty: sampling still fails.
    bufs = add(bufs, items, jnp.asarray([[0, 1], [1, 0]], jnp.int32))
    bufs = eqx.tree_at(lambda b: b.streams.lengths, bufs, bufs.streams.lengths.at[0].set(0))
    with pytest.raises(RuntimeError, match="cannot sample from an empty TrajectoryBuffer"):
        sample(bufs, keys)


# Re-reading windows by their stamps, and buffers around given streams.

# A window with every part and an episode-end policy, built once.
READ_WINDOW = dx.Window(2, burn_in=1, bootstrap=1, episode_ends="within", done=_episode_end)
_sample_mixed_read = eqx.filter_jit(
    lambda b, k: b.sample(k, 16, READ_WINDOW, source={"replay": 8, "online": 8})
)
_read = eqx.filter_jit(lambda b, e, s: b.read(e, s, READ_WINDOW))


def _bits(tree):
    """The structure, and each leaf's shape, dtype and bytes: equal only when bit for bit."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(x.shape, x.dtype, x.tobytes()) for x in map(np.asarray, leaves)]


def _filled(rng, adds):
    """A buffer of SPEC, 3 envs of 6 steps, after `adds` adds of two envs each (env 0 wraps)."""
    buf = dx.TrajectoryBuffer(SPEC, 3, 6)
    for i in range(adds):
        buf = _add(buf, random_batch(SPEC, 2, rng), _ids(0, 1 + i % 2))
        if i == 5:
            buf = _reset(buf)
    return buf


def test_read_returns_what_sample_returned():
    rng = np.random.default_rng(2)
    buf = _filled(rng, 10)
    sample = _sample_mixed_read(buf, jax.random.key(0))
    assert _bits(_read(buf, *sample.stamp)) == _bits(sample)
    # Steps added since: the windows whose first step was overwritten are refused.
    for _ in range(4):
        buf = _add(buf, random_batch(SPEC, 2, rng), _ids(0, 2))
    stale = np.asarray(buf.stale(*sample.stamp))
    assert stale.any() and not stale.all()
    with pytest.raises(RuntimeError, match="TrajectoryBuffer.read`: a window is stale"):
        _read(buf, *sample.stamp)


def test_mask_checks_and_answers_only_the_entries_it_holds():
    # `peek`, `stale` and `read` take `mask=`: an entry where it is False is not checked (an
    # env id out of range, an env without steps, a stale window), and `stale` answers False.
    peek = eqx.filter_jit(lambda b, i, m: b.peek(i, mask=m))
    buf = dx.TrajectoryBuffer(STEP, 3, 2)
    buf = buf.add(_steps(2, 1.0), env_ids=_ids(0, 2))
    buf = buf.add(_steps(1, 2.0), env_ids=_ids(2))
    ids, mask = _ids(2, 1, 0, 3), np.asarray([True, False, True, False])
    for run in [peek, lambda b, i, m: b.peek(i, mask=m)]:  # under jit and eagerly
        got = run(buf, ids, mask)
        assert got["obs"][mask, 0].tolist() == buf.peek(_ids(2, 0))["obs"][:, 0].tolist()
        for bad in [np.asarray([False, True, True, False]), np.asarray([True, False, True, True])]:
            with pytest.raises(RuntimeError, match="no stored step yet|out of range"):
                run(buf, ids, bad)
    assert_tree_equal(peek(buf, _ids(0, 2), np.ones(2, bool)), buf.peek(_ids(0, 2)))
    # Env 2 has taken 2 steps in 2 slots; a third drops step 0.
    buf = buf.add(_steps(1, 3.0), env_ids=_ids(2))
    env, start = _ids(2, 2, 1, 0), _ids(0, 1, 5, 0)
    stale = eqx.filter_jit(lambda b, e, s, m: b.stale(e, s, mask=m))
    keep = np.asarray([True, True, False, True])
    assert stale(buf, env, start, keep).tolist() == [True, False, False, False]
    assert stale(buf, env, start, np.asarray([False, True, False, True])).tolist() == [False] * 4
    with pytest.raises(RuntimeError, match="not a step of its env"):
        stale(buf, env, start, np.ones(4, bool))  # env 1 has taken no step
    with pytest.raises(RuntimeError, match="out of range"):
        stale(buf, _ids(3, 2), _ids(0, 1), np.asarray([True, True]))
    assert stale(buf, _ids(3, 2), _ids(0, 1), np.asarray([False, True])).tolist() == [False] * 2
    read = eqx.filter_jit(lambda b, e, s, m: b.read(e, s, TWO, mask=m))
    fresh = np.asarray([False, True, False, True])  # the windows that are not stale
    got = read(buf, env, start, fresh)
    want = buf.read(env[fresh], start[fresh], TWO)
    assert _bits(jax.tree.map(lambda x: x[fresh], got)) == _bits(want)
    for bad in [keep, np.ones(4, bool)]:  # a stale window, an env without steps
        with pytest.raises(RuntimeError, match="a window is stale|not a step of its env"):
            read(buf, env, start, bad)
    with pytest.raises(Exception, match="`mask` has shape|parameter 'mask'"):
        buf.stale(env, start, mask=np.ones(3, bool))


def test_with_streams_keeps_the_steps_and_empties_the_online_queue():
    buf = _filled(np.random.default_rng(3), 8)
    assert buf.lengths("online").tolist() == [2, 1, 1]
    new = buf.with_streams(buf.streams)
    assert _bits(new.streams) == _bits(buf.streams)
    assert new.lengths().tolist() == buf.lengths().tolist() == [6, 4, 4]
    assert new.lengths("online").tolist() == [0, 0, 0]
    key = jax.random.key(1)
    assert _bits(_sample(new, key, TWO, 1.0, "replay")) == _bits(
        _sample(buf, key, TWO, 1.0, "replay")
    )
    with pytest.raises(RuntimeError, match="empty online queue"):
        _sample(new, key, TWO, 1.0, "online")
    with pytest.raises(ValueError, match="the streams have"):
        dx.TrajectoryBuffer(SPEC, 3, 5).with_streams(buf.streams)


# The old forms: deprecated, they still work, with a DeprecationWarning.


def _three_steps():
    buf = dx.TrajectoryBuffer(STEP, 2, 4)
    for i in range(3):
        buf = _add_all(buf, _steps(2, float(i)))
    return buf


@SLOW
def test_sample_old_form_is_deprecated():
    buf = _three_steps()
    key = jax.random.key(0)
    window = dx.Window(2, burn_in=1, period=2)
    with pytest.warns(DeprecationWarning, match=r"pass `dx.Window\(2, ...\)`"):
        old = buf.sample(key, 3, 2, burn_in=1, period=2)
    assert _bits(old) == _bits(buf.sample(key, 3, window))
    # With a `Window`, its options go into it.
    with pytest.raises(TypeError, match="are options of the `Window`"):
        buf.sample(key, 3, window, burn_in=1)


SAMPLE_MIXED_IS_DEPRECATED = r"`TrajectoryBuffer.sample_mixed` is deprecated; use `sample\("


@SLOW
def test_sample_mixed_is_deprecated():
    # `sample_mixed(key, r, o, window, power)`: the old form of `sample(key, r + o, window,
    # distribution_power=power, source={"replay": r, "online": o})`, the same draws bit for bit.
    buf = _add(_three_steps(), _steps(1, 7.0), _ids(1))
    key = jax.random.key(0)
    window = dx.Window(2, burn_in=1, period=2)
    for r, o, power in [(2, 1, 1.0), (3, 0, 0.5), (0, 2, 2.0)]:
        new = buf.sample(key, r + o, window, distribution_power=power, source=_mixed(r, o))
        with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
            old = buf.sample_mixed(key, r, o, window, power)
        assert _bits(old) == _bits(new)
    # Its default power is 1, as `sample`'s.
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        old = buf.sample_mixed(key, 2, 1, window)
    assert _bits(old) == _bits(buf.sample(key, 3, window, source=_mixed(2, 1)))
    # The old window options as keywords: two warnings, the same windows.
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        with pytest.warns(DeprecationWarning, match=r"pass `dx.Window\(2, ...\)`"):
            old = buf.sample_mixed(key, 2, 1, 2, 1.0, burn_in=1, period=2)
    assert _bits(old) == _bits(buf.sample(key, 3, window, source=_mixed(2, 1)))
    # Its static errors, and its run-time errors as those of `sample` (a source of 0 rows is
    # not drawn from, so its source may be empty).
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        with pytest.raises(ValueError, match=r"online_batch_size=...\)` must be non-negative"):
            buf.sample_mixed(key, 2, -1, TWO)
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        with pytest.raises(ValueError, match="must be positive"):
            buf.sample_mixed(key, 0, 0, TWO)
    empty = _reset(buf)
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        with pytest.raises(
            RuntimeError, match="`TrajectoryBuffer.sample`: cannot sample from an empty online"
        ):
            empty.sample_mixed(key, 2, 1, TWO)
    with pytest.warns(DeprecationWarning, match=SAMPLE_MIXED_IS_DEPRECATED):
        old = empty.sample_mixed(key, 2, 0, TWO)
    assert _bits(old) == _bits(empty.sample(key, 2, TWO, source=_mixed(2, 0)))


def _mixed(replay: int, online: int) -> dict:
    return {"replay": replay, "online": online}


# A deprecated form: CI's slow tier (test_overwritten_is_deprecated stays in the default one).
@SLOW
def test_sample_transitions_is_deprecated():
    # `sample_transitions(key, b, nstep, discount=..., source=...)`: the old form of
    # `sample(key, b, nstep, discount=..., source=...)`, the same transitions bit for bit.
    buf = dx.TrajectoryBuffer({"reward": jnp.zeros(()), "done": jnp.zeros((), jnp.bool_)}, 2, 4)
    rewards = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    buf = buf.extend({"reward": rewards, "done": jnp.asarray([[0, 1, 0], [0, 0, 0]], bool)})
    key = jax.random.key(0)
    nstep = dx.NStep(2, reward="reward", terminated="done")
    deprecated = r"`TrajectoryBuffer.sample_transitions` is deprecated; use `sample\("
    for source in ("replay", "online"):
        new = buf.sample(key, 3, nstep, discount=0.5, source=source)
        with pytest.warns(DeprecationWarning, match=deprecated):
            old = buf.sample_transitions(key, 3, nstep, discount=0.5, source=source)
        assert _bits(old) == _bits(new)
    # The older form still: an int and the leaves as keywords, with two warnings.
    with pytest.warns(DeprecationWarning, match=deprecated):
        with pytest.warns(DeprecationWarning, match=r"pass `dx.NStep\(2, "):
            old = buf.sample_transitions(
                key, 3, 2, discount=0.5, reward="reward", terminated="done"
            )
    assert _bits(old) == _bits(buf.sample(key, 3, nstep, discount=0.5))
    with pytest.warns(DeprecationWarning, match=deprecated):
        with pytest.raises(TypeError, match="are options of the `NStep`"):
            buf.sample_transitions(key, 3, nstep, discount=0.5, terminated="done")
    # Its errors quote `sample`.
    with pytest.warns(DeprecationWarning, match=deprecated):
        with pytest.raises(
            RuntimeError, match=r"`TrajectoryBuffer.sample`: `discount` must be in \[0, 1\]"
        ):
            buf.sample_transitions(key, 3, nstep, discount=1.5)


def test_overwritten_is_deprecated():
    buf = dx.TrajectoryBuffer(STEP, 2, 2)
    for i in range(3):
        buf = _add(buf, _steps(1, float(i)), _ids(0))
    env, start = _ids(0, 0), _ids(0, 2)
    with pytest.warns(DeprecationWarning, match="use `stale`"):
        got = buf.overwritten(env, start)
    assert got.tolist() == buf.stale(env, start).tolist() == [True, False]
