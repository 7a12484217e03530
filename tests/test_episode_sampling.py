"""Episodes as the unit of a sample: `Window(starts="episode")` and `dx.WholeEpisode` against
a NumPy model of a buffer's history (which window starts are episode starts, with what weight;
which whole episodes can be drawn, with what steps), the laws by chi-square against the
model's exact probabilities, the faults (at run time, as results, at trace time), the layers
(rate-limited, a mixture's part, policy age) and `jit` against eager.

Statistics. Every chi-square test uses fixed keys and fails a correct sampler with probability
`ALPHA = 1e-6` (`assert_frequencies`). The support checks draw `BATCH = 2048` rows among at
most `3 · 12 = 36` candidates whose probabilities differ by at most a factor 2, so each
candidate has probability at least `1 / 72`: a correct sampler misses one with probability at
most `36 · (1 - 1/72) ** 2048 < 1e-10` per check.
"""

import functools
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from hypothesis import given, strategies as st

from .helpers import assert_frequencies, SLOW
from .reference import episode_rows


STEP = {
    "obs": jnp.zeros(2, jnp.float32),  # (env, absolute step number): every step names itself
    "done": jnp.zeros((), jnp.bool_),
    "version": jnp.zeros((), jnp.int32),  # the absolute step number, for policy age
}
NUM_ENVS = 3
ALPHA = 1e-6  # each statistical test's false-failure rate
BATCH = 2048  # rows of a support check (see the module's docstring)
KEY = jax.random.key(0)


def _version(step):
    return step["version"]


# --- the NumPy model -------------------------------------------------------------------------


class Model:
    """What a trajectory buffer of `max_length` holds after each env took the steps of
    `history[env]` (its done flags), and what it can draw."""

    def __init__(self, history, max_length, autoreset):
        self.history = [list(map(bool, h)) for h in history]
        self.m = max_length
        self.rows = [episode_rows(h, autoreset) for h in self.history]
        longest = max(1, *(len(h) for h in self.history))
        self.done = np.zeros((len(history), longest), bool)
        for e, h in enumerate(self.history):
            self.done[e, : len(h)] = h
        self.taken = np.asarray([len(h) for h in self.history])

    def stored(self, e):
        n = len(self.history[e])
        return range(max(0, n - self.m), n)

    def is_start(self, e, t):
        k, first, _, _ = self.rows[e][t]
        return k >= 0 and first == t

    def windows(self, window, power=1.0, *, episode=True, max_age=None):
        """Every admissible window start `(env, start)` and its weight: `r ** power` (`1` when
        strict), restricted to episode starts with `episode`, to versions (step numbers) of
        age at most `max_age` below the newest step count with `max_age`."""
        size = window.burn_in + window.sequence_length + window.bootstrap
        out = {}
        for e in range(len(self.history)):
            n = len(self.history[e])
            for t in self.stored(e):
                back = n - t
                if t % window.period:
                    continue
                if window.strict:
                    if back < size:
                        continue
                    w = 1.0
                else:
                    r = min(back, size)
                    if r < window.burn_in + 1:
                        continue
                    w = float(r) ** power
                if episode and not self.is_start(e, t):
                    continue
                if max_age is not None and t < max_age[0] - max_age[1]:
                    continue
                out[(e, t)] = w
        return out

    def episodes(self, max_steps, running, longer):
        """Every drawable whole episode `(env, first step)`: `(length held, complete)`."""
        out = {}
        for e in range(len(self.history)):
            for t in self.stored(e):
                if not self.is_start(e, t):
                    continue
                _, first, last, ended = self.rows[e][t]
                length = last - first + 1
                if not (running or ended) or (longer == "exclude" and length > max_steps):
                    continue
                out[(e, t)] = (min(length, max_steps), bool(ended and length <= max_steps))
        return out

    def steps(self, env, start, mask):
        """The items a row of `mask` (a prefix of real steps) from `(env, start)` holds,
        zeros elsewhere."""
        t = start[:, None] + np.arange(mask.shape[1])[None, :]
        safe = np.clip(t, 0, self.done.shape[1] - 1)
        obs = np.stack([np.broadcast_to(env[:, None], t.shape), t], -1).astype(np.float32)
        return {
            "obs": np.where(mask[..., None], obs, 0),
            "done": np.where(mask, self.done[env[:, None], safe], False),
            "version": np.where(mask, t, 0).astype(np.int32),
        }


def _items(env_ids, starts, flags):
    """Steps of envs `env_ids` from their step numbers `starts`, with `flags` ([k, L])."""
    t = np.asarray(starts)[:, None] + np.arange(flags.shape[1])[None, :]
    env = np.broadcast_to(np.asarray(env_ids)[:, None], t.shape)
    return {
        "obs": np.stack([env, t], -1).astype(np.float32),
        "done": np.asarray(flags, bool),
        "version": t.astype(np.int32),
    }


_extend = eqx.filter_jit(lambda buf, items, ids: buf.extend(items, ids))
_add = eqx.filter_jit(lambda buf, items, ids: buf.add(items, ids))


def _grow(buf, history, env_ids, flags):
    """`buf` after envs `env_ids` took the steps of `flags` ([k, L]); `history` follows."""
    starts = [len(history[e]) for e in env_ids]
    ids = jnp.asarray(env_ids, jnp.int32)
    items = jax.tree.map(jnp.asarray, _items(env_ids, starts, flags))
    for e, f in zip(env_ids, flags):
        history[e] += list(map(bool, f))
    return _extend(buf, items, ids)


def _buffer(autoreset, max_length, flags, *, prioritised=None, throw=True):
    """A buffer whose envs each took the steps of their row of `flags` ([num_envs, L]), in one
    `extend`, and its model."""
    episodes = dx.Episodes("done", autoreset=autoreset)
    if prioritised is None:
        buf = dx.TrajectoryBuffer(STEP, NUM_ENVS, max_length, episodes=episodes, throw=throw)
    else:
        buf = dx.PrioritisedTrajectoryBuffer(
            STEP, NUM_ENVS, max_length, episodes=episodes, throw=throw, **prioritised
        )
    history = [[] for _ in range(NUM_ENVS)]
    buf = _grow(buf, history, list(range(NUM_ENVS)), np.asarray(flags, bool))
    return buf, Model(history, max_length, autoreset)


def _random_buffer(autoreset, max_length, rng, calls=6):
    """A buffer (`throw=False`) after `calls` random adds and extends to random subsets of
    envs with random done flags (one of them more steps than the ring holds), and its model.
    Few shapes, each compiled once."""
    episodes = dx.Episodes("done", autoreset=autoreset)
    buf = dx.TrajectoryBuffer(STEP, NUM_ENVS, max_length, episodes=episodes, throw=False)
    history = [[] for _ in range(NUM_ENVS)]
    p_end = rng.choice([0.1, 0.3, 0.6])
    wrap_at = rng.integers(calls)
    for call in range(calls):
        if call == wrap_at:
            flags = rng.random((NUM_ENVS, max_length + 3)) < p_end
            buf = _grow(buf, history, list(range(NUM_ENVS)), flags)
            continue
        ids = rng.permutation(NUM_ENVS)[: rng.integers(1, NUM_ENVS + 1)].tolist()
        if rng.random() < 0.5:  # one step each, through `add`
            flags = rng.random(len(ids)) < p_end
            starts = [len(history[e]) for e in ids]
            items = jax.tree.map(
                lambda x: jnp.asarray(x[:, 0]), _items(ids, starts, flags[:, None])
            )
            for e, f in zip(ids, flags):
                history[e].append(bool(f))
            buf = _add(buf, items, jnp.asarray(ids, jnp.int32))
        else:
            buf = _grow(buf, history, ids, rng.random((len(ids), 2)) < p_end)
    return buf, Model(history, max_length, autoreset)


# --- checks of drawn rows against the model ---------------------------------------------------


def _check_windows(sample, model, want, window):
    """Every row of a `SequenceSample` is a window of `want` (`(env, start): weight`), with
    the steps the model holds there; every window of `want` was drawn."""
    env, start = np.asarray(sample.env), np.asarray(sample.start)
    drawn = set(zip(env.tolist(), start.tolist()))
    assert drawn <= set(want), (
        f"drew starts that are not admissible episode starts: {drawn - set(want)}"
    )
    assert drawn == set(want), f"never drew {set(want) - drawn}"
    size = window.burn_in + window.sequence_length + window.bootstrap
    mask = start[:, None] + np.arange(size)[None, :] < model.taken[env][:, None]
    np.testing.assert_array_equal(np.asarray(sample.mask), mask)
    for name, value in model.steps(env, start, mask).items():
        np.testing.assert_array_equal(np.asarray(sample.items[name]), value, err_msg=name)


def _check_episodes(sample, model, want, max_steps):
    """Every row of an `EpisodeSample` is an episode of `want` (`(env, first): (length,
    complete)`), its steps as the model holds them, zero-padded; every one was drawn."""
    env, start = np.asarray(sample.env), np.asarray(sample.start)
    drawn = set(zip(env.tolist(), start.tolist()))
    assert drawn <= set(want), f"drew episodes that cannot be drawn: {drawn - set(want)}"
    assert drawn == set(want), f"never drew {set(want) - drawn}"
    length = np.asarray([want[(e, s)][0] for e, s in zip(env.tolist(), start.tolist())])
    complete = np.asarray([want[(e, s)][1] for e, s in zip(env.tolist(), start.tolist())])
    mask = np.arange(max_steps)[None, :] < length[:, None]
    np.testing.assert_array_equal(np.asarray(sample.length), length)
    np.testing.assert_array_equal(np.asarray(sample.complete), complete)
    np.testing.assert_array_equal(np.asarray(sample.mask), mask)
    assert sample.length.dtype == jnp.int32 and sample.env.dtype == jnp.int32
    for name, value in model.steps(env, start, mask).items():
        got = np.asarray(sample.items[name])
        assert got.shape == (len(env), max_steps, *STEP[name].shape), name
        np.testing.assert_array_equal(got, value, err_msg=name)


# --- the default tier: one fixed history against the model ------------------------------------

# Three envs of 14 steps in a ring of 8 (steps 6-13 stored): env 0's episodes end at 3, 7 and
# 10; env 1's at 5 and 12 (the auto-reset step after 12 is its newest); env 2's at 0 only, so
# its running episode began before the stored steps (same-step: at 1; next-step: at 2).
FIXED = np.zeros((NUM_ENVS, 14), bool)
FIXED[0, [3, 7, 10]] = True
FIXED[1, [5, 12]] = True
FIXED[2, 0] = True
WINDOW = dx.Window(1, burn_in=1, starts="episode")  # r in {1, 2}, r >= 2


@functools.cache
def _fixed(autoreset, prioritised=None):
    return _buffer(autoreset, 8, FIXED)


@eqx.filter_jit
def _draw_fixed(buf, key, what, power):
    return buf.sample(key, BATCH, what, distribution_power=power)


# The default tier draws whole episodes (one compilation, within its time); the windows of the
# same history in the slow tier, as the random histories and the laws.
@pytest.mark.parametrize("what", ["whole", pytest.param("window", marks=SLOW)])
def test_fixed_history_draws_what_the_model_can(what):
    buf, model = _fixed("next-step")
    # The model itself, by hand (steps 6-13 stored; next-step: the step after an end resets):
    # env 0's episodes begin at 9 (ends at 10) and 12 (running); env 1's at 7 (6 steps, ends
    # at 12); env 2's running one at 2, not stored. A window of r = 2 real steps needs a start
    # at most 12.
    if what == "window":
        starts = model.windows(WINDOW, -1.0)
        assert set(starts) == {(0, 9), (0, 12), (1, 7)}
        _check_windows(_draw_fixed(buf, KEY, WINDOW, -1.0), model, starts, WINDOW)
    else:
        whole = model.episodes(3, running=True, longer="head")
        assert whole == {(0, 9): (2, True), (0, 12): (2, False), (1, 7): (3, False)}
        episodes = _draw_fixed(buf, KEY, dx.WholeEpisode(3, running=True), None)
        _check_episodes(episodes, model, whole, 3)


def test_trace_time_refusals():
    plain = dx.TrajectoryBuffer(STEP, NUM_ENVS, 8)
    with pytest.raises(TypeError, match="needs a buffer that keeps episodes"):
        plain.sample(KEY, 2, dx.Window(1, starts="episode"))
    with pytest.raises(TypeError, match="needs a buffer that keeps episodes"):
        plain.sample(KEY, 2, dx.WholeEpisode(2))
    window = dx.Window(2, strict=True)
    prioritised = dx.PrioritisedTrajectoryBuffer(STEP, NUM_ENVS, 8, window=window)
    with pytest.raises(TypeError, match="needs a buffer that keeps episodes"):
        prioritised.sample(KEY, 2, dx.Window(2, strict=True, starts="episode"))
    episodes = dx.Episodes("done", autoreset="same-step")
    buf = dx.TrajectoryBuffer(STEP, NUM_ENVS, 8, episodes=episodes)
    with pytest.raises(ValueError, match="longer than max_length = 8"):
        buf.sample(KEY, 2, dx.WholeEpisode(9))
    with pytest.raises(TypeError, match="whole episodes"):
        buf.sample(KEY, 2, dx.WholeEpisode(2), distribution_power=1.0)
    relabel = dx.Relabel(
        "future", goal="obs", achieved="obs", reward="obs", reward_fn=lambda a, g: a[0]
    )
    with pytest.raises(TypeError, match="not relabelled"):
        buf.sample(KEY, 2, dx.WholeEpisode(2), relabel=relabel)
    # A bad choice: the library's ValueError, or first (under the tests' import hook) the
    # annotation's check, which names the parameter.
    bad = (ValueError, jaxtyping.TypeCheckError)
    with pytest.raises(bad, match="be one of 'any', 'episode'|parameter 'starts'"):
        dx.Window(1, starts="episodes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(bad, match="be one of 'head', 'exclude'|parameter 'longer'"):
        dx.WholeEpisode(2, longer="tail")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`WholeEpisode\(max_steps=...\)` must be positive"):
        dx.WholeEpisode(0)


# --- the slow tier: random histories against the model ----------------------------------------

# What the property test draws, each with its `distribution_power` (None: none given).
WHATS: list[tuple[Any, float | None]] = [
    (dx.Window(2, strict=True, starts="episode"), None),
    (dx.Window(1, burn_in=1, starts="episode"), 1.0),
    (dx.Window(2, period=2, starts="episode"), -1.0),
    (dx.WholeEpisode(3), None),
    (dx.WholeEpisode(3, running=True, longer="exclude"), None),
    (dx.WholeEpisode(4, running=True), None),
]


@eqx.filter_jit
def _draw_all(buf, key):
    keys = jax.random.split(key, len(WHATS))
    return [
        buf.sample(k, BATCH, what, distribution_power=power)
        for k, (what, power) in zip(keys, WHATS)
    ]


@SLOW
@pytest.mark.parametrize("autoreset", ["same-step", "next-step"])
@given(seed=st.integers(0, 2**32 - 1), max_length=st.sampled_from([4, 12]))
def test_random_histories_draw_exactly_what_the_model_can(autoreset, seed, max_length):
    # Every drawn row is one the model can draw, with its steps, mask, length and
    # completeness; every one the model can draw is drawn (a miss has probability < 1e-10);
    # where the model has none, the sample reports the fault (`throw=False`).
    rng = np.random.default_rng(seed)
    buf, model = _random_buffer(autoreset, max_length, rng)
    for (what, power), (sample, result) in zip(WHATS, _draw_all(buf, KEY)):
        if isinstance(what, dx.Window):
            want = model.windows(what, 1.0 if power is None else power)
            if not want:
                anywhere = model.windows(what, 1.0, episode=False)
                kind = dx.RESULTS.no_episode_start if anywhere else None
                assert not bool(result.ok), (what, model.history)
                assert kind is None or result.kind == kind, result.kind
                continue
            assert bool(result.ok), (what, result.kind)
            _check_windows(sample, model, want, what)
        else:
            want = model.episodes(what.max_steps, what.running, what.longer)
            if not want:
                assert result.kind == dx.RESULTS.no_episode, (what, model.history)
                continue
            assert bool(result.ok), (what, result.kind)
            _check_episodes(sample, model, want, what.max_steps)


# --- the laws, by chi-square against the model's exact probabilities -----------------------

# A history of many short episodes: env 0 ends one every 2 steps, env 1 every 3, env 2 at 9 and
# 13 (16 steps each, steps 4-15 stored in a ring of 12).
LAW = np.zeros((NUM_ENVS, 16), bool)
LAW[0, 1::2] = True
LAW[1, 2::3] = True
LAW[2, [9, 13]] = True
DRAWS = 20_000


def _counts(env, start, want):
    cells = {c: i for i, c in enumerate(want)}
    got = np.zeros(len(cells))
    for e, s in zip(np.asarray(env).tolist(), np.asarray(start).tolist()):
        assert (e, s) in cells, f"drew {(e, s)}, which the model cannot"
        got[cells[e, s]] += 1
    p = np.asarray(list(want.values()), np.float64)
    return got, p / p.sum()


@SLOW
@pytest.mark.parametrize("autoreset", ["same-step", "next-step"])
@pytest.mark.parametrize(
    "window, power",
    [
        (dx.Window(3, strict=True, starts="episode"), None),
        (dx.Window(2, burn_in=2, starts="episode"), 1.0),
        (dx.Window(3, bootstrap=1, starts="episode"), -1.0),
        (dx.Window(2, period=3, starts="episode"), 2.0),
    ],
    ids=["strict", "burn_in-power1", "power-1", "period3-power2"],
)
def test_episode_start_windows_follow_the_law(autoreset, window, power):
    # False-failure rate 1e-6 (one chi-square test).
    buf, model = _buffer(autoreset, 12, LAW)
    want = model.windows(window, 1.0 if power is None else power)
    assert len(want) >= 3
    draw = eqx.filter_jit(lambda b, k: b.sample(k, DRAWS, window, distribution_power=power))
    sample = draw(buf, jax.random.key(11))
    assert_frequencies(*_counts(sample.env, sample.start, want), alpha=ALPHA)


@SLOW
@pytest.mark.parametrize("autoreset", ["same-step", "next-step"])
@pytest.mark.parametrize(
    "episode",
    [dx.WholeEpisode(3), dx.WholeEpisode(2, running=True), dx.WholeEpisode(3, longer="exclude")],
    ids=["ended", "running-head", "exclude"],
)
def test_whole_episodes_are_uniform(autoreset, episode):
    # False-failure rate 1e-6 (one chi-square test).
    buf, model = _buffer(autoreset, 12, LAW)
    want = model.episodes(episode.max_steps, episode.running, episode.longer)
    assert len(want) >= 3
    sample = eqx.filter_jit(lambda b, k: b.sample(k, DRAWS, episode))(buf, jax.random.key(12))
    got, p = _counts(sample.env, sample.start, {c: 1.0 for c in want})
    assert_frequencies(got, p, alpha=ALPHA)


PRIORITY_EXPONENT, BETA = 0.7, 0.6


@SLOW
@pytest.mark.parametrize("autoreset", ["same-step", "next-step"])
def test_prioritised_episode_starts_follow_their_mass(autoreset):
    # Priorities 1..4 set on every held window; the episode-start windows drawn by mass
    # p ** alpha among themselves: the probabilities returned are the model's exactly, the
    # importance weights mass ** -beta over the batch's largest, and the counts pass a
    # chi-square test (false-failure rate 1e-6).
    window = dx.Window(2, strict=True)
    options = dict(window=window, priority_exponent=PRIORITY_EXPONENT)
    buf, model = _buffer(autoreset, 12, LAW, prioritised=options)
    held = model.windows(window, episode=False)
    envs, starts = (np.asarray(x, np.int32) for x in zip(*held))
    priority = (1.0 + (envs * 7 + starts) % 4).astype(np.float32)
    buf = eqx.filter_jit(lambda b, e, s, p: b.set_priorities(e, s, p))(buf, envs, starts, priority)
    mass = {
        (int(e), int(s)): float(p) ** PRIORITY_EXPONENT for e, s, p in zip(envs, starts, priority)
    }
    episode = dx.Window(2, strict=True, starts="episode")
    want = {c: mass[c] for c in model.windows(episode)}
    assert len(want) >= 3 and len(want) < len(held)
    draw = eqx.filter_jit(lambda b, k: b.sample(k, DRAWS, episode, beta=BETA))
    out = draw(buf, jax.random.key(13))
    env, start = np.asarray(out.sample.env), np.asarray(out.sample.start)
    got, p = _counts(env, start, want)
    cells = list(want)
    row_mass = np.asarray([want[c] for c in zip(env.tolist(), start.tolist())])
    row_p = np.asarray([p[cells.index(c)] for c in zip(env.tolist(), start.tolist())])
    np.testing.assert_allclose(np.asarray(out.probabilities), row_p, rtol=1e-5)
    w = row_mass**-BETA
    np.testing.assert_allclose(np.asarray(out.weights), w / w.max(), rtol=1e-5)
    assert_frequencies(got, p, alpha=ALPHA)


# --- faults at run time ------------------------------------------------------------------------

# One env's 5 steps in a ring of 4 (steps 1-4 stored), its one episode ending at 3. Same-step:
# step 4 begins an episode (its only stored start). Next-step: step 4 is the auto-reset step,
# which begins none, and episode 0 began at 0, overwritten: no stored step starts an episode.
FAULT = np.zeros((NUM_ENVS, 5), bool)
FAULT[:, 3] = True


@SLOW
def test_no_episode_start_or_episode_is_a_fault_raised_or_reported():
    window = dx.Window(1, starts="episode")
    whole = dx.WholeEpisode(2, running=True)
    same, same_model = _buffer("same-step", 4, FAULT)
    assert set(same_model.windows(window)) == {(e, 4) for e in range(NUM_ENVS)}
    ok = eqx.filter_jit(lambda b, k: b.sample(k, 8, window))(same, KEY)
    assert (np.asarray(ok.start) == 4).all()
    buf, model = _buffer("next-step", 4, FAULT)
    assert not model.windows(window) and model.windows(window, episode=False)
    assert not model.episodes(2, True, "head")
    with pytest.raises(eqx.EquinoxRuntimeError, match="is the first step of a stored episode"):
        eqx.filter_jit(lambda b, k: b.sample(k, 8, window))(buf, KEY)
    with pytest.raises(eqx.EquinoxRuntimeError, match="no stored replay episode can be drawn"):
        eqx.filter_jit(lambda b, k: b.sample(k, 8, whole))(buf, KEY)
    quiet, _ = _buffer("next-step", 4, FAULT, throw=False)
    _, result = eqx.filter_jit(lambda b, k: b.sample(k, 8, window))(quiet, KEY)
    assert result.kind == dx.RESULTS.no_episode_start
    _, result = eqx.filter_jit(lambda b, k: b.sample(k, 8, whole))(quiet, KEY)
    assert result.kind == dx.RESULTS.no_episode
    with pytest.raises(eqx.EquinoxRuntimeError, match="no stored replay episode"):
        result.check()
    # A prioritised buffer: its held windows (steps 1-2, 2-3, 3-4) start no episode.
    options = dict(window=dx.Window(2, strict=True), priority_exponent=1.0)
    per, _ = _buffer("next-step", 4, FAULT, prioritised=options, throw=False)
    episode = dx.Window(2, strict=True, starts="episode")
    _, result = eqx.filter_jit(lambda b, k: b.sample(k, 8, episode))(per, KEY)
    assert result.kind == dx.RESULTS.no_episode_start


# --- the layers ------------------------------------------------------------------------------


def _starts_of(sample, model, window, power=1.0):
    want = model.windows(window, power)
    drawn = set(zip(np.asarray(sample.env).tolist(), np.asarray(sample.start).tolist()))
    assert drawn <= set(want), drawn - set(want)
    return drawn


@SLOW
def test_rate_limited_draws_as_its_buffer():
    buf, model = _buffer("next-step", 12, LAW)
    limiter = dx.RateLimiter.min_size(1, insert_batch_size=64, sample_batch_size=64)
    limited = dx.RateLimited(
        dx.TrajectoryBuffer(STEP, NUM_ENVS, 12, episodes=buf.episodes), limiter
    )
    limited = _extend(
        limited, jax.tree.map(jnp.asarray, _items(range(3), [0] * 3, LAW)), jnp.arange(3)
    )
    window = dx.Window(2, starts="episode")
    key = jax.random.key(5)
    for what in [window, dx.WholeEpisode(3, running=True)]:
        want = eqx.filter_jit(lambda b, k: b.sample(k, 64, what))(buf, key)
        _, got = eqx.filter_jit(lambda b, k: b.sample(k, 64, what))(limited, key)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _starts_of(got, model, dx.Window(1, starts="episode"))  # the last: whole episodes' firsts


@SLOW
def test_a_mixture_part_draws_episode_starts():
    same, same_model = _buffer("same-step", 12, LAW)
    nxt, next_model = _buffer("next-step", 12, LAW)
    window = dx.Window(2, starts="episode")
    mixture = dx.Mixture(
        {"a": dx.Part("x", window), "b": dx.Part("y", window, distribution_power=-1.0)}
    )
    run = eqx.filter_jit(lambda bufs, k: mixture.sample(k, 256, bufs, {"a": 0.5, "b": 0.5}))
    _, out = run({"x": same, "y": nxt}, KEY)
    source = np.asarray(out.source)
    assert (source == np.repeat([0, 1], [128, 128])).all()
    for i, (model, power) in enumerate([(same_model, 1.0), (next_model, -1.0)]):
        part = jax.tree.map(lambda x: x[source == i], out.sample)
        assert _starts_of(part, model, window, power) == set(model.windows(window, power))
    whole = dx.Mixture(
        {"a": dx.Part("x", dx.WholeEpisode(3)), "b": dx.Part("y", dx.WholeEpisode(3))}
    )
    _, out = eqx.filter_jit(lambda bufs, k: whole.sample(k, 64, bufs, [0.5, 0.5]))(
        {"x": same, "y": nxt}, KEY
    )
    source = np.asarray(out.source)
    for i, model in enumerate([same_model, next_model]):
        part = jax.tree.map(lambda x: x[source == i], out.sample)
        drawn = set(zip(np.asarray(part.env).tolist(), np.asarray(part.start).tolist()))
        assert drawn <= set(model.episodes(3, False, "head"))


@SLOW
def test_policy_age_reweighs_episode_starts():
    # Versions are step numbers (16 taken): current 15, max_age 6 admits starts >= 9; with no
    # decay the aged law is uniform over the admitted episode-start windows, exactly.
    buf, model = _buffer("same-step", 12, LAW)
    window = dx.Window(2, strict=True, starts="episode")
    age = dx.PolicyAge(_version, current=15, max_age=6)
    out = eqx.filter_jit(lambda b, k: b.sample(k, BATCH, window, age=age))(buf, KEY)
    assert isinstance(out, dx.AgedSample)
    want = model.windows(window, max_age=(15, 6))
    assert 3 <= len(want) < len(model.windows(window))
    drawn = set(zip(np.asarray(out.items.env).tolist(), np.asarray(out.items.start).tolist()))
    assert drawn == set(want)
    np.testing.assert_array_equal(np.asarray(out.ages), 15 - np.asarray(out.items.start))
    np.testing.assert_allclose(np.asarray(out.probabilities), 1 / len(want), rtol=1e-5)


# --- jit against eager -------------------------------------------------------------------------


@SLOW
def test_jit_equals_eager():
    buf, _ = _buffer("next-step", 12, LAW)
    options = dict(window=dx.Window(2, strict=True), priority_exponent=1.0)
    per, _ = _buffer("next-step", 12, LAW, prioritised=options)
    cases = [
        (buf, dx.Window(2, burn_in=1, starts="episode"), dict(distribution_power=-1.0)),
        (buf, dx.WholeEpisode(4, running=True), {}),
        (per, dx.Window(2, strict=True, starts="episode"), dict(beta=0.5)),
    ]
    key = jax.random.key(7)
    for b, what, kwargs in cases:
        eager = b.sample(key, 16, what, **kwargs)
        with_jit = jax.jit(lambda b, k: b.sample(k, 16, what, **kwargs))(b, key)
        with_filter_jit = eqx.filter_jit(lambda b, k: b.sample(k, 16, what, **kwargs))(b, key)
        for got in (with_jit, with_filter_jit):
            assert jax.tree.structure(got) == jax.tree.structure(eager)
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(eager)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@SLOW
@pytest.mark.skipif(
    not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
)
@pytest.mark.parametrize(
    "what",
    [dx.Window(2, starts="episode"), dx.WholeEpisode(5), dx.WholeEpisode(5, running=True)],
    ids=["episode starts", "whole episodes", "running episodes"],
)
def test_a_global_buffer_draws_as_one_buffer_of_every_env(what):
    # The laws reach the global layer with no code of their own: over 4 shards of 2 envs, the
    # rows equal, bit for bit, those of one buffer of the 8 envs with the same steps and key.
    step = {"obs": jnp.zeros(3), "done": jnp.zeros((), bool)}
    episodes = dx.Episodes("done", autoreset="same-step")
    mesh = jax.make_mesh((4,), ("shards",))
    buffer = dx.GlobalTrajectoryBuffer(
        mesh, lambda: dx.TrajectoryBuffer(step, 2, 16, episodes=episodes)
    )
    single = dx.TrajectoryBuffer(step, 8, 16, episodes=episodes)
    for t in range(11):
        steps = {"obs": np.full((8, 3), t, np.float32), "done": (np.arange(8) + t) % 4 == 3}
        buffer, single = buffer.add(buffer.rows(steps)), single.add(steps)
    key = jax.random.key(3)
    got, want = buffer.sample(key, 16, what), single.sample(key, 16, what)
    assert type(got) is type(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
