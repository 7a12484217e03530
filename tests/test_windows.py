"""`TrajectoryBuffer`'s windows (burn-in, bootstrap, period, strict, episode ends), n-step
transitions and stamps, against the NumPy model's enumeration and brute-force loops."""

import copy

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import assert_frequencies, rotation, unstack
from .reference import RefTrajectoryBuffer


# Every step is labelled with its env and its absolute step number, so that each sampled row
# can be checked step by step against the model, and carries rewards and episode ends.
PROTOTYPE = {
    "env": jnp.zeros((), jnp.int32),
    "pos": jnp.zeros((), jnp.int32),
    "reward": jnp.zeros((), jnp.float32),
    "terminated": jnp.zeros((), jnp.bool_),
    "truncated": jnp.zeros((), jnp.bool_),
    "done": jnp.zeros((), jnp.bool_),
}
NUM_ENVS, MAX_LENGTH = 4, 12
DRAWS = 2**15


def _steps(env_ids, count, rng, end_rate):
    n = len(env_ids)
    terminated = rng.random(n) < end_rate
    truncated = rng.random(n) < end_rate
    return {
        "env": np.asarray(env_ids, np.int32),
        "pos": np.asarray([count[e] for e in env_ids], np.int32),
        "reward": rng.standard_normal(n).astype(np.float32),
        "terminated": terminated,
        "truncated": truncated,
        "done": terminated | truncated,
    }


_add = eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))


def async_adds(buf, model, counts, rng, end_rate=0.2):
    """Add `counts[e]` steps to each env `e`, in random subsets and orders, one subset per add."""
    left = dict(counts)
    while any(left.values()):
        ready = [e for e, n in left.items() if n > 0]
        env_ids = [int(e) for e in rng.permutation(ready) if rng.random() < 0.6] or ready[:1]
        steps = _steps(env_ids, model.count, rng, end_rate)
        buf = _add(buf, steps, np.asarray(env_ids, np.int32))
        model.add(unstack(steps, len(env_ids)), env_ids)
        for e in env_ids:
            left[e] -= 1
    return buf


@pytest.fixture(scope="module")
def streams():
    """Replay lengths [0, 3, 7, 12] (env 3 wrapped around its 12 slots twice), online lengths
    [0, 2, 7, 9]; steps end episodes at random (rate 0.2 for each flag)."""
    rng = np.random.default_rng(0)
    buf = dx.TrajectoryBuffer(PROTOTYPE, NUM_ENVS, MAX_LENGTH)
    model = RefTrajectoryBuffer(NUM_ENVS, MAX_LENGTH)
    buf = async_adds(buf, model, {1: 1, 3: 22}, rng)
    buf, _ = buf.reset_online_queue(), model.reset_online_queue()
    buf = async_adds(buf, model, {1: 2, 2: 7, 3: 9}, rng)
    assert buf.lengths().tolist() == [0, 3, 7, 12]
    assert buf.lengths("online").tolist() == [0, 2, 7, 9]
    return buf, model


# One case per compiled sampler: (burn_in, length, bootstrap, period, strict, episode_ends,
# done, power, source).
CASES = {
    "burn-in+bootstrap": (2, 3, 1, 1, False, "cross", None, 1.0, "replay"),
    "period-2-online": (1, 2, 0, 2, False, "truncate", "done", 2.0, "online"),
    "strict-period-3": (1, 3, 1, 3, True, "truncate", ("terminated", "truncated"), 1.0, "replay"),
    "within": (2, 2, 1, 1, False, "within", "done", 0.0, "replay"),
    "period-5-within-online": (0, 4, 0, 5, False, "within", "done", -1.0, "online"),
}


def _window(case):
    burn_in, length, bootstrap, period, strict, ends, done, _, _ = case
    return dx.Window(
        length,
        burn_in=burn_in,
        bootstrap=bootstrap,
        period=period,
        strict=strict,
        episode_ends=ends,
        done=done,
    )


# The `Window` of each case, built once.
WINDOWS = {case: _window(case) for case in CASES.values()}


@eqx.filter_jit
def _sample(buf, key, power, case):
    source = case[8]
    return buf.sample(key, DRAWS, WINDOWS[case], distribution_power=power, source=source)


def _is_end(done):
    names = () if done is None else (done,) if isinstance(done, str) else done
    return lambda step: any(bool(step[name]) for name in names)


def check_rows(sample, model: RefTrajectoryBuffer, case, probabilities: dict):
    """Every row exactly: its stamp an admissible start of the model, its mask and learning
    mask the model's, its real steps the model's steps, its other steps zeros. Returns the
    row of each sample's cell in sorted(probabilities)."""
    burn_in, length, bootstrap, _, _, ends, done, _, _ = case
    size = burn_in + length + bootstrap
    items = jax.tree.map(np.asarray, sample.items)
    mask, learn = np.asarray(sample.mask), np.asarray(sample.learn)
    env, start = np.asarray(sample.env), np.asarray(sample.start)
    cells = sorted(probabilities)
    index = {cell: i for i, cell in enumerate(cells)}
    drawn = np.asarray([index.get(c, -1) for c in zip(env.tolist(), start.tolist())])
    assert (drawn >= 0).all(), "a stamp that is not an admissible start"
    t = np.arange(size)
    learning = (t >= burn_in) & (t < burn_in + length)
    for j in np.unique(drawn):
        e, s = cells[j]
        rows = drawn == j
        want = np.asarray(model.window_mask(e, s, size, burn_in, ends, _is_end(done)))
        assert (mask[rows] == want).all(), (e, s, mask[rows][0], want)
        assert (learn[rows] == (want & learning)).all(), (e, s)
        for name, leaf in items.items():
            real = np.asarray([model.step(e, s + i)[name] if want[i] else 0 for i in range(size)])
            assert (leaf[rows] == real.astype(leaf.dtype)).all(), (name, e, s)
    return drawn


@pytest.mark.parametrize("case", rotation(list(CASES.values()), 0, keep=3), ids=list(CASES))
def test_windows_match_enumeration(streams, case):
    buf, model = streams
    burn_in, length, bootstrap, period, strict, _, _, power, source = case
    probabilities = model.window_probabilities(
        burn_in + length + bootstrap,
        period=period,
        min_real=burn_in + 1,
        strict=strict,
        power=power,
        source=source,
    )
    key = jax.random.key(sum(map(ord, str(case))))
    sample = _sample(buf, key, jnp.asarray(power, jnp.float32), case)
    drawn = check_rows(sample, model, case, probabilities)
    counts = np.bincount(drawn, minlength=len(probabilities))
    # Pearson chi-square against the model's enumeration: a correct sampler fails with
    # probability 1e-6 per case (6e-6 over the six cases). The least likely start here has
    # probability above 1/400, an expected count above 80.
    assert_frequencies(counts, np.asarray([probabilities[c] for c in sorted(probabilities)]))


def test_window_checks_detect_a_wrong_law_or_policy(streams):
    # The tests above must be able to fail. Draws of "burn-in+bootstrap" against the model
    # without the least number of real steps; draws of "within" against "truncate" masks; and
    # draws of "strict-period-3" against a period aligned to the window instead of the step
    # count.
    buf, model = streams

    def draws(name):
        case = CASES[name]
        return case, _sample(buf, jax.random.key(99), jnp.asarray(case[7], jnp.float32), case)

    case, sample = draws("burn-in+bootstrap")
    probabilities = model.window_probabilities(6, min_real=1)
    drawn = check_rows(sample, model, case, probabilities)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(
            np.bincount(drawn, minlength=len(probabilities)),
            np.asarray([probabilities[c] for c in sorted(probabilities)]),
        )

    case, sample = draws("within")
    probabilities = model.window_probabilities(5, min_real=3, power=0.0)
    with pytest.raises(AssertionError):
        check_rows(sample, model, case[:5] + ("truncate",) + case[6:], probabilities)

    case, sample = draws("strict-period-3")
    shifted = {
        (e, s + 1): p
        for (e, s), p in model.window_probabilities(5, strict=True).items()
        if (s + 1) % 3 == 0
    }
    with pytest.raises(AssertionError, match="not an admissible start"):
        check_rows(sample, model, case, shifted)


def test_period_alignment_survives_the_ring_wrap(streams):
    # Env 3 has taken 31 steps in 12 slots: its strict windows of 5 steps with period 3 start
    # at the multiples of 3 among its stored steps 19..26, whatever slot they sit in.
    buf, _ = streams
    case = CASES["strict-period-3"]
    sample = _sample(buf, jax.random.key(5), jnp.asarray(1.0, jnp.float32), case)
    env, start = np.asarray(sample.env), np.asarray(sample.start)
    assert set(start[env == 3].tolist()) == {21, 24}
    assert (start % 3 == 0).all()


# n-step transitions: a stream whose episode ends sit at every position relative to a
# transition, across the ring wrap.

N_STEPS = [1, 3, 7]


@pytest.fixture(scope="module")
def ended_streams():
    """Env 0: 21 steps through 8 slots; env 1: 13 steps. Terminations, truncations, both at
    once, and ends on consecutive steps."""
    buf = dx.TrajectoryBuffer(PROTOTYPE, 2, 8)
    model = RefTrajectoryBuffer(2, 8)
    flags = {
        0: {"terminated": {5, 11, 16, 17}, "truncated": {8, 13, 17, 19}},
        1: {"terminated": {7, 10}, "truncated": {3, 9}},
    }
    rng = np.random.default_rng(3)
    for i in range(21):
        env_ids = [0, 1] if i < 13 else [0]
        steps = _steps(env_ids, model.count, rng, 0.0)
        for j, e in enumerate(env_ids):
            for name in ["terminated", "truncated"]:
                steps[name][j] = i in flags[e][name]
        steps["done"] = steps["terminated"] | steps["truncated"]
        buf = _add(buf, steps, np.asarray(env_ids, np.int32))
        model.add(unstack(steps, len(env_ids)), env_ids)
    return buf, model


# The `NStep` of each case, built once.
NSTEPS = {
    (n, truncated): dx.NStep(n, reward="reward", terminated="terminated", truncated=truncated)
    for n, truncated in [(n, "truncated") for n in N_STEPS] + [(3, None)]
}


@eqx.filter_jit
def _transitions(buf, key, gamma, n, truncated):
    return buf.sample(key, 4096, NSTEPS[n, truncated], discount=gamma)


@pytest.mark.parametrize(
    "n, truncated",
    rotation([(n, "truncated") for n in N_STEPS] + [(3, None)], 3, keep=2, several=True),
    ids=str,
)
def test_transitions_match_brute_force(ended_streams, n, truncated):
    buf, model = ended_streams
    gamma = 0.9
    out = _transitions(buf, jax.random.key(n), jnp.asarray(gamma), n, truncated)
    env, start = np.asarray(out.env), np.asarray(out.start)
    first = jax.tree.map(np.asarray, out.first)
    following = jax.tree.map(np.asarray, out.next)
    cells = model.transition_starts(n)
    index = {cell: i for i, cell in enumerate(cells)}
    drawn = np.asarray([index.get(c, -1) for c in zip(env.tolist(), start.tolist())])
    assert (drawn >= 0).all(), "a transition whose n steps and next step are not all stored"
    never = (lambda step: False) if truncated is None else (lambda step: step["truncated"])
    for j in np.unique(drawn):
        e, t = cells[j]
        rows = drawn == j
        returns, discount, next_t = model.transition(
            e, t, n, gamma, lambda s: s["reward"], lambda s: s["terminated"], never
        )
        np.testing.assert_allclose(np.asarray(out.returns)[rows], returns, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.discount)[rows], discount, rtol=1e-6)
        assert (first["pos"][rows] == t).all() and (first["env"][rows] == e).all()
        assert (following["pos"][rows] == next_t).all() and (following["env"][rows] == e).all()
    # Uniform over the admissible starts; false-failure rate 1e-6 per case.
    assert_frequencies(
        np.bincount(drawn, minlength=len(cells)), np.full(len(cells), 1 / len(cells))
    )


def test_transition_checks_detect_wrong_ends(ended_streams):
    # The test above must be able to fail: treating truncation as termination (no bootstrap)
    # changes the discounts of the transitions cut by a truncation.
    buf, model = ended_streams
    out = _transitions(buf, jax.random.key(3), jnp.asarray(0.9), 3, "truncated")
    env, start, discount = (np.asarray(x) for x in (out.env, out.start, out.discount))
    wrong = np.asarray(
        [
            model.transition(
                e, t, 3, 0.9, lambda s: s["reward"], lambda s: s["done"], lambda s: False
            )[1]
            for e, t in zip(env.tolist(), start.tolist())
        ]
    )
    assert not np.allclose(discount, wrong)


_stale = eqx.filter_jit(lambda b, e, s: b.stale(e, s))


def test_stale_follows_the_model(streams):
    buf, model = streams
    model = copy.deepcopy(model)
    case = CASES["burn-in+bootstrap"]
    sample = _sample(buf, jax.random.key(4), jnp.asarray(1.0, jnp.float32), case)
    buf = async_adds(buf, model, {1: 2, 2: 6, 3: 3}, np.random.default_rng(4))
    got = np.asarray(_stale(buf, *sample.stamp))
    want = [
        s < model.count[e] - len(model.streams[e])
        for e, s in zip(np.asarray(sample.env).tolist(), np.asarray(sample.start).tolist())
    ]
    assert got.tolist() == want and any(want) and not all(want)
    # Stamps from elsewhere are refused.
    ids = np.asarray([0, 2], np.int32)
    with pytest.raises(RuntimeError, match="not a step of its env"):
        _stale(buf, ids, np.asarray([0, 1], np.int32))  # env 0 has taken no step
    with pytest.raises(RuntimeError, match="not a step of its env"):
        _stale(buf, ids[::-1], np.asarray([-1, 0], np.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        _stale(buf, np.asarray([4, 1], np.int32), np.asarray([0, 0], np.int32))
    with pytest.raises(Exception, match="must match|parameter .starts."):
        buf.stale(ids, np.asarray([0], np.int32))


# Errors: static facts at trace time, faults in the data through eqx.error_if.


def test_window_static_errors():
    buf = dx.TrajectoryBuffer(PROTOTYPE, 2, 6)
    key = jax.random.key(0)
    sample = buf.sample
    # Checks that need the buffer are made by the call.
    with pytest.raises(ValueError, match=r"= 2 \+ 4 \+ 1 = 7 steps is longer than max_length = 6"):
        sample(key, 3, dx.Window(4, burn_in=2, bootstrap=1))
    # The options on their own are checked when the `Window` is built.
    with pytest.raises(ValueError, match=r"`Window\(burn_in=...\)` must be non-negative"):
        dx.Window(2, burn_in=-1)
    with pytest.raises(ValueError, match=r"`Window\(period=...\)` must be positive"):
        dx.Window(2, period=0)
    with pytest.raises(
        Exception, match=r"`Window\(strict=...\)` must be a bool|parameter 'strict'"
    ):
        dx.Window(2, strict=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(Exception, match="be one of 'cross', 'truncate', 'within'|'episode_ends'"):
        dx.Window(2, episode_ends="stop", done="done")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`Window\(done=...\)` is given.*does not read it"):
        dx.Window(2, done="done")
    with pytest.raises(ValueError, match=r"`Window\(episode_ends='truncate'\)` needs `done`"):
        dx.Window(2, episode_ends="truncate")
    with pytest.raises(ValueError, match=r"`Window\(done=...\)` is an empty tuple"):
        dx.Window(2, episode_ends="within", done=())
    with pytest.raises(Exception, match="must name a leaf of the step|parameter 'done'"):
        dx.Window(2, episode_ends="within", done=3)  # pyright: ignore[reportArgumentType]
    # Whether `done` names suitable leaves is checked by the call.
    call = r"`TrajectoryBuffer.sample`: `Window\(done=...\)`: "
    with pytest.raises(ValueError, match=call + "the step has no leaf 'finished'"):
        sample(key, 3, dx.Window(2, episode_ends="truncate", done="finished"))
    with pytest.raises(TypeError, match=call + "the leaf 'pos' has dtype int32, expected bool"):
        sample(key, 3, dx.Window(2, episode_ends="within", done=("done", "pos")))
    with pytest.raises(
        ValueError, match=call + ".* must pick one leaf of the step as it is stored"
    ):
        sample(
            key, 3, dx.Window(2, episode_ends="within", done=lambda s: s["done"] & s["truncated"])
        )
    transitions = buf.sample
    leaves = {"reward": "reward", "terminated": "terminated"}
    call = "`TrajectoryBuffer.sample`: "
    with pytest.raises(ValueError, match=r"reads n \+ 1 = 7 steps, more than max_length = 6"):
        transitions(key, 3, dx.NStep(6, **leaves), discount=0.9)
    with pytest.raises(
        TypeError,
        match=call + r"`NStep\(reward=...\)`: the leaf 'done' has dtype bool, expected a float",
    ):
        transitions(key, 3, dx.NStep(2, **{**leaves, "reward": "done"}), discount=0.9)
    with pytest.raises(
        TypeError,
        match=call
        + r"`NStep\(truncated=...\)`: the leaf 'reward' has dtype float32, expected bool",
    ):
        transitions(key, 3, dx.NStep(2, **leaves, truncated="reward"), discount=0.9)
    with pytest.raises(Exception, match="`discount` has shape|parameter 'discount'"):
        transitions(key, 3, dx.NStep(2, **leaves), discount=jnp.ones(2))
    wide = dx.TrajectoryBuffer({"done": jnp.zeros(2, bool)}, 2, 6)
    with pytest.raises(ValueError, match=r"has shape \(2,\) per step"):
        wide.sample(key, 3, dx.Window(2, episode_ends="truncate", done="done"))


def test_window_runtime_errors():
    rng = np.random.default_rng(5)
    buf = dx.TrajectoryBuffer(PROTOTYPE, 2, 6)
    model = RefTrajectoryBuffer(2, 6)
    buf = async_adds(buf, model, {0: 3, 1: 2}, rng)
    key = jax.random.key(0)
    sample = eqx.filter_jit(lambda b, k, w: b.sample(k, 3, w))
    with pytest.raises(RuntimeError, match="a start needs its whole window of 4 steps stored"):
        sample(buf, key, dx.Window(2, strict=True, burn_in=2))
    with pytest.raises(RuntimeError, match=r"needs burn_in \+ 1 = 4 stored steps"):
        sample(buf, key, dx.Window(2, burn_in=3))
    with pytest.raises(RuntimeError, match="a multiple of period = 5"):
        sample(buf, key, dx.Window(2, period=5, strict=True, burn_in=2))
    transitions = eqx.filter_jit(lambda b, k, n, g: b.sample(k, 3, n, discount=g))
    leaves = {"reward": "reward", "terminated": "terminated"}
    three, two = dx.NStep(3, **leaves), dx.NStep(2, **leaves)
    with pytest.raises(RuntimeError, match=r"holds n \+ 1 = 4 steps yet"):
        transitions(buf, key, three, jnp.asarray(0.9))
    transitions(buf, key, two, jnp.asarray(1.0))
    for bad in [1.5, -0.1, jnp.nan]:
        with pytest.raises(RuntimeError, match=r"`discount` must be in \[0, 1\]"):
            transitions(buf, key, two, jnp.asarray(bad))


def test_step_count_limit_is_an_error():
    # The last step an env can number is 2**31 - 2; the next add is refused, not wrapped.
    buf = dx.TrajectoryBuffer({"x": jnp.zeros(())}, 2, 3)
    buf = eqx.tree_at(lambda b: b.streams.step_count, buf, jnp.asarray([2**31 - 2, 5], jnp.int32))
    one = {"x": jnp.ones(1)}
    buf = buf.add(one, env_ids=np.asarray([0], np.int32))
    assert buf.step_count.tolist() == [2**31 - 1, 5]
    with pytest.raises(RuntimeError, match="2\\*\\*31 - 1 steps"):
        buf.add(one, env_ids=np.asarray([0], np.int32))
    with pytest.raises(RuntimeError, match="2\\*\\*31 - 1 steps"):
        buf.add({"x": jnp.ones(2)})
    assert buf.add(one, env_ids=np.asarray([1], np.int32)).step_count.tolist() == [2**31 - 1, 6]
