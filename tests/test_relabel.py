"""Episode bookkeeping (`dx.Episodes`) against a NumPy model, and goal relabelling
(`dx.Relabel`) against a NumPy model of SB3's `_sample_goals` semantics: the law of each
strategy (chi-square, fixed keys, false-failure rate 1e-6), the support (never another env,
episode, overwritten slot or auto-reset step), the rows left alone, the rewards and n-step
returns recomputed, and the layers."""

from typing import Any, cast

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, strategies as st

from .helpers import SLOW
from .hlo import aliased_parameters, copies
from .reference import episode_rows


STEP = {
    "obs": jnp.zeros(2),
    "goal": jnp.zeros(2),
    "achieved": jnp.zeros(2),  # the goal achieved after the step's action
    "reward": jnp.zeros(()),
    "done": jnp.zeros((), bool),
}
ALPHA = 1e-6  # each statistical test's false-failure rate


def reward_fn(achieved, goal):
    return -jnp.any(achieved != goal).astype(jnp.float32)


_extend = eqx.filter_jit(lambda buf, items, ids: buf.extend(items, ids))
_episodes_of = eqx.filter_jit(lambda buf, envs, steps: buf.episodes_of(envs, steps))


def _fill(autoreset, num_envs, max_length, calls, rng, *, p_end=0.25, wrap=None, **options):
    """A buffer after `calls` random adds and extends to random envs (env 0 never ends an
    episode: its one episode outlasts the ring), and each env's history of flags."""
    episodes = dx.Episodes("done", autoreset=autoreset)
    buf = dx.TrajectoryBuffer(STEP, num_envs, max_length, episodes=episodes, **options)
    buf = buf if wrap is None else wrap(buf)
    history = [[] for _ in range(num_envs)]
    for _ in range(calls):
        # Few shapes (each compiles once): one step, a few, and more than the ring holds.
        length = int(rng.choice([1, 3, max_length + 2]))
        ids = rng.permutation(num_envs)[: rng.integers(1, num_envs + 1)].astype(np.int32)
        done = rng.random((len(ids), length)) < p_end
        done[ids == 0] = False
        steps = []
        for i, env in enumerate(ids):
            start = len(history[env])
            steps.append(np.arange(start, start + length))
            history[env] += list(done[i])
        # The achieved goal names the step, (env, t): every goal says where it came from.
        at = np.stack([np.broadcast_to(ids[:, None], done.shape), np.stack(steps)], -1)
        at = at.astype(np.float32)
        goal = np.full_like(at, -1.0)
        items = {"obs": at, "goal": goal, "achieved": at, "done": done}
        items["reward"] = np.where((at == goal).all(-1), 0.0, -1.0).astype(np.float32)
        buf = _extend(buf, jax.tree.map(jnp.asarray, items), jnp.asarray(ids))
    return buf, history


# The bookkeeping of a few adds is held to the model in the default tier (below); random
# histories, in the slow tier.
@SLOW
@pytest.mark.parametrize("autoreset", ["same-step", "next-step"])
@given(seed=st.integers(0, 2**32 - 1), max_length=st.sampled_from([1, 4]))
def test_episode_bookkeeping_equals_theepisode_rows(autoreset, seed, max_length):
    rng = np.random.default_rng(seed)
    buf, history = _fill(autoreset, 3, max_length, 6, rng)
    for env, flags in enumerate(history):
        taken = len(flags)
        steps = np.arange(max(0, taken - max_length), taken)
        if not len(steps):
            continue
        # Padded to the ring's length with copies of the newest step: one shape.
        steps = np.concatenate([steps, np.full(max_length - len(steps), steps[-1])])
        envs = np.full(max_length, env, np.int32)
        info = _episodes_of(buf, jnp.asarray(envs), jnp.asarray(steps, jnp.int32))
        got = np.stack([np.asarray(x, np.int64) for x in jax.tree.leaves(info)], 1)
        want = np.asarray([episode_rows(flags, autoreset)[t] for t in steps], np.int64)
        np.testing.assert_array_equal(got, want)


def test_episode_bookkeeping_of_adds_of_every_env_and_a_refused_add():
    episodes = dx.Episodes(("done",), autoreset="next-step")
    buf = dx.TrajectoryBuffer(STEP, 2, 3, episodes=episodes, throw=False)
    flags = [[False, True], [True, False], [False, False], [True, True]]
    add = eqx.filter_jit(lambda b, s, e=None: b.add(s, e))
    steps = jax.tree.map(lambda x: jnp.zeros((2, *x.shape), x.dtype), STEP)
    for done in flags:
        buf = add(buf, {**steps, "done": jnp.asarray(done)})
    refused = add(buf, {**steps, "done": jnp.asarray([True, True])}, jnp.array([1, 1]))
    assert refused.result.kind == dx.RESULTS.env_id_repeated
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), buf.streams.book, refused.streams.book)
    assert all(jax.tree.leaves(same))  # the refused add changed no episode
    for env in range(2):
        history = [done[env] for done in flags]
        info, result = cast(Any, buf.episodes_of(jnp.full(3, env), jnp.arange(1, 4)))
        assert result.kind == dx.RESULTS.successful
        got = np.stack([np.asarray(x, np.int64) for x in jax.tree.leaves(info)], 1)
        want = np.asarray(episode_rows(history, "next-step")[1:4], np.int64)
        np.testing.assert_array_equal(got, want)


def test_episodes_errors():
    with pytest.raises(ValueError, match="autoreset"):
        dx.Episodes("done", autoreset="same")
    with pytest.raises(TypeError, match="dtype float32, expected bool"):
        dx.TrajectoryBuffer(STEP, 2, 4, episodes=dx.Episodes("reward", autoreset="same-step"))
    buf = dx.TrajectoryBuffer(STEP, 2, 4)
    with pytest.raises(TypeError, match="keeps no episodes"):
        buf.episodes_of(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(TypeError, match="keeps no episodes"):
        buf.sample(jax.random.key(0), 2, dx.Window(1), relabel=_relabel("final"))
    kept = dx.TrajectoryBuffer(STEP, 1, 2, episodes=dx.Episodes("done", autoreset="same-step"))
    kept = kept.extend(jax.tree.map(lambda x: jnp.zeros((1, 3, *x.shape), x.dtype), STEP))
    with pytest.raises(eqx.EquinoxRuntimeError, match="no longer stored"):
        kept.episodes_of(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="'geometric' strategy needs|must be in"):
        _relabel("geometric", discount=1.0)
    with pytest.raises(TypeError, match="must return a scalar of the leaf's dtype float32"):
        bad = dx.Relabel(
            "final", goal="goal", achieved="achieved", reward="reward", reward_fn=lambda a, g: a
        )
        kept.sample(jax.random.key(0), 2, dx.Window(1), relabel=bad)
    with pytest.raises(ValueError, match="they must match"):
        bad = dx.Relabel(
            "final", goal="goal", achieved="reward", reward="reward", reward_fn=reward_fn
        )
        kept.sample(jax.random.key(0), 2, dx.Window(1), relabel=bad)


def _relabel(strategy, fraction=1.0, **options):
    return dx.Relabel(
        strategy,
        goal="goal",
        achieved="achieved",
        reward="reward",
        reward_fn=reward_fn,
        fraction=fraction,
        **options,
    )


def _law(strategy, t, first, last, oldest, discount=None):
    """SB3's `_sample_goals` for one anchor `t`: the probability of each goal step."""
    if strategy == "final":
        return {last: 1.0}
    if strategy == "future":
        return {j: 1 / (last - t + 1) for j in range(t, last + 1)}
    if strategy == "episode":
        lo = max(first, oldest)
        return {j: 1 / (last - lo + 1) for j in range(lo, last + 1)}
    assert discount is not None
    weights = {t + i: discount**i for i in range(last - t + 1)}
    total = sum(weights.values())
    return {j: w / total for j, w in weights.items()}


CASES = [
    ("final", "same-step", {}),
    ("future", "same-step", {}),
    ("episode", "next-step", {}),
    ("geometric", "same-step", {"discount": 0.7}),
    ("future", "next-step", {"running": False}),
    ("episode", "same-step", {}),
]


# Relabelled rows are recomputed from their goals in the default tier
# (test_rows_left_alone_are_the_plain_sample_and_relabelled_rows_are_recomputed); each
# strategy's law, in the slow tier.
@SLOW
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_strategy_draws_goals_by_its_law(case):
    # Conditional on its anchor, a row's goal step is a draw from the strategy's law over the
    # anchor's episode: one Pearson chi-square per anchor, summed (independent given the
    # anchors), against the chi-square quantile of the summed degrees of freedom at 1 - 1e-6.
    strategy, autoreset, options = case
    rng = np.random.default_rng(3)
    buf, history = _fill(autoreset, 4, 12, 8, rng, p_end=0.25)
    relabel = _relabel(strategy, **options)
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 4096, dx.Window(1), relabel=relabel))
    anchors, goals, relabelled = [], [], []
    for i in range(6):
        out = sample(buf, jax.random.key(i))
        anchors.append(np.stack([out.sample.env, out.sample.start], 1))
        goals.append(np.asarray(out.goal_step))
        relabelled.append(np.asarray(out.relabelled))
        # The goal leaf holds the achieved goal of (env, goal step): never another env's.
        got = np.asarray(out.sample.items["goal"][:, 0])
        want = np.stack([out.goal_env, out.goal_step], 1).astype(np.float32)
        ok = np.asarray(out.relabelled)
        np.testing.assert_array_equal(np.asarray(out.goal_env)[ok], np.asarray(out.sample.env)[ok])
        np.testing.assert_array_equal(got[ok], want[ok])
    anchors, goals, relabelled = map(np.concatenate, (anchors, goals, relabelled))
    models = [episode_rows(flags, autoreset) for flags in history]
    counts = {}
    for (env, t), j, ok in zip(anchors, goals, relabelled):
        episode, first, last, ended = models[env][t]
        can = episode >= 0 and (ended or options.get("running", True))
        assert ok == can, (env, t)  # relabelled exactly where the anchor has an episode
        if not can:
            assert j == -1
            continue
        oldest = max(0, len(history[env]) - 12)
        law = _law(strategy, t, first, last, oldest, options.get("discount"))
        assert j in law, (strategy, env, t, j)  # the support: only steps of the episode
        counts.setdefault((env, t), []).append(j)
    assert len(counts) > 10
    statistic, dof = 0.0, 0
    for (env, t), js in counts.items():
        episode, first, last, _ = models[env][t]
        oldest = max(0, len(history[env]) - 12)
        law = _law(strategy, t, first, last, oldest, options.get("discount"))
        cells = sorted(law)
        expected = np.array([law[j] for j in cells]) * len(js)
        if len(cells) < 2 or expected.min() < 5:
            continue
        observed = np.array([js.count(j) for j in cells])
        statistic += float(((observed - expected) ** 2 / expected).sum())
        dof += len(cells) - 1
    if strategy == "final":
        assert dof == 0  # a point mass: the support check above is the whole law
        return
    assert dof > 20
    assert statistic < scipy.stats.chi2.ppf(1 - ALPHA, dof), (statistic, dof)


# Goals drawn by their law run in the default tier (test_each_strategy_draws_goals_by_its_law),
# the 'random' strategy's law over every env in the slow tier.
@SLOW
@pytest.mark.parametrize("autoreset", ["next-step", "same-step"])
def test_random_draws_every_stored_step_of_an_episode_uniformly(autoreset):
    # Over every env: each stored step that belongs to an episode (not an auto-reset step, not
    # an overwritten one) equally likely, whatever the row. One Pearson chi-square over the
    # cells, against the quantile at 1 - 1e-6.
    rng = np.random.default_rng(11)
    buf, history = _fill(autoreset, 4, 12, 8, rng, p_end=0.3)
    relabel = _relabel("random")
    sample = eqx.filter_jit(lambda b, k: b.sample(k, 4096, dx.Window(1), relabel=relabel))
    cells = [
        (env, t)
        for env, flags in enumerate(history)
        for t, row in enumerate(episode_rows(flags, autoreset))
        if t >= len(flags) - 12 and row[0] >= 0
    ]
    counts = dict.fromkeys(cells, 0)
    for i in range(4):
        out = sample(buf, jax.random.key(i))
        assert np.asarray(out.relabelled).all()
        for env, t, goal in zip(out.goal_env, out.goal_step, np.asarray(out.sample.items["goal"])):
            assert (int(env), int(t)) in counts  # the support
            counts[int(env), int(t)] += 1
            np.testing.assert_array_equal(goal[0], [env, t])
    observed = np.array(list(counts.values()))
    expected = observed.sum() / len(cells)
    assert expected >= 5 and len(cells) > 20
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < scipy.stats.chi2.ppf(1 - ALPHA, len(cells) - 1), statistic


@pytest.mark.parametrize("what", ["window", pytest.param("nstep", marks=SLOW)])
def test_rows_left_alone_are_the_plain_sample_and_relabelled_rows_are_recomputed(what):
    rng = np.random.default_rng(5)
    buf, _ = _fill("same-step", 3, 10, 6, rng)
    relabel = _relabel("future", fraction=0.4)
    key = jax.random.key(9)
    if what == "window":
        args: tuple[Any, ...] = (dx.Window(3, burn_in=1, done="done", episode_ends="within"),)
        kwargs: dict[str, Any] = {}
    else:
        args = (dx.NStep(3, reward="reward", terminated="done"),)
        kwargs = {"discount": 0.9}
    plain = buf.sample(key, 50, *args, **kwargs)
    out = buf.sample(key, 50, *args, relabel=relabel, **kwargs)
    assert relabel.rows(50) == 20
    assert not np.asarray(out.relabelled[:30]).any() and np.asarray(out.relabelled[30:]).all()
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(out.sample)):
        np.testing.assert_array_equal(np.asarray(a)[:30], np.asarray(b)[:30])
    # Stored rewards are the reward function of the stored goals (as ALF checks).
    stored = jax.vmap(reward_fn)(
        buf.data["achieved"].reshape(-1, 2), buf.data["goal"].reshape(-1, 2)
    )
    np.testing.assert_array_equal(stored, buf.data["reward"].reshape(-1))
    goal = np.stack([out.sample.env, out.goal_step], 1).astype(np.float32)[30:]
    if what == "window":
        items, mask = out.sample.items, np.asarray(out.sample.mask)[30:]
        achieved = np.asarray(items["achieved"])[30:]
        want = np.where((achieved == goal[:, None]).all(-1), 0.0, -1.0)
        np.testing.assert_array_equal(np.asarray(items["reward"])[30:], np.where(mask, want, 0))
        np.testing.assert_array_equal(
            np.asarray(items["goal"])[30:], np.where(mask[..., None], goal[:, None], 0)
        )
        return
    # n-step: the returns over the rewards for the new goal, up to the first episode end.
    first = out.sample.first
    for row in range(30, 50):
        env, t = int(out.sample.env[row]), int(out.sample.start[row])
        achieved = np.asarray(buf.data["achieved"][env, (t + np.arange(3)) % 10])
        done = np.asarray(buf.data["done"][env, (t + np.arange(3)) % 10])
        g = goal[row - 30]
        ret, k = 0.0, 0
        for i in range(3):
            ret += 0.9**i * (0.0 if (achieved[i] == g).all() else -1.0)
            k += 1
            if done[i]:
                break
        np.testing.assert_allclose(float(out.sample.returns[row]), ret, rtol=1e-6)
        assert float(out.sample.discount[row]) == pytest.approx(0.0 if done[k - 1] else 0.9**k)
        np.testing.assert_array_equal(np.asarray(first["goal"][row]), g)
        np.testing.assert_array_equal(np.asarray(out.sample.next["goal"][row]), g)
        assert float(first["reward"][row]) == (0.0 if (achieved[0] == g).all() else -1.0)


@SLOW
def test_relabelling_through_the_layers_and_a_donated_scan():
    limiter = dx.RateLimiter.min_size(1, insert_batch_size=64, sample_batch_size=16)
    limit = lambda b: dx.RateLimited(b, limiter)  # noqa: E731
    limited, _ = cast(Any, _fill("same-step", 4, 8, 5, np.random.default_rng(2), wrap=limit))
    buf = limited.buffer
    relabel = _relabel("geometric", fraction=0.5, discount=0.5)
    window = dx.Window(2)
    key = jax.random.key(4)
    want = buf.sample(key, 16, window, relabel=relabel)
    _, got = limited.sample(key, 16, window, relabel=relabel)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @eqx.filter_jit(donate="all-except-first")
    def steps(key, buf):
        def one(buf, key):
            out = buf.sample(key, 16, window, relabel=relabel)
            more = jax.tree.map(lambda x: x[:4, 0], out.sample.items)
            return buf.add(more), out.goal_step

        return jax.lax.scan(one, buf, jax.random.split(key, 3))

    taken = int(buf.step_count.sum())
    new, goals = steps(key, buf)
    assert goals.shape == (3, 16) and int(new.step_count.sum()) == taken + 12


# Relabelling runs in the default tier on one buffer (above), and the global buffers sample as
# one buffer of every env there (tests/test_global.py); both together, in the slow tier.
@SLOW
@pytest.mark.skipif(not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+")
@pytest.mark.parametrize("what", ["window", "nstep"])
def test_a_global_buffer_relabels_as_one_buffer_of_every_env(what):
    mesh = jax.make_mesh((2,), ("shards",), devices=jax.devices()[:2])
    episodes = dx.Episodes("done", autoreset="same-step")
    make = lambda: dx.TrajectoryBuffer(STEP, 2, 8, episodes=episodes)  # noqa: E731
    glob, single = (
        dx.GlobalTrajectoryBuffer(mesh, make),
        dx.TrajectoryBuffer(STEP, 4, 8, episodes=episodes),
    )
    rng = np.random.default_rng(1)
    for t in range(13):
        at = np.stack([np.arange(4), np.full(4, t)], 1).astype(np.float32)
        steps = {
            "obs": at,
            "goal": np.zeros_like(at),
            "achieved": at,
            "reward": np.full(4, -1.0, np.float32),
            "done": rng.random(4) < 0.3,
        }
        glob, single = glob.add(glob.rows(steps)), single.add(steps)
    relabel = _relabel("episode", fraction=0.75)
    if what == "window":
        ask = lambda b, k: b.sample(k, 16, dx.Window(2), relabel=relabel)  # noqa: E731
    else:
        nstep = dx.NStep(2, reward="reward", terminated="done")
        ask = lambda b, k: b.sample(k, 16, nstep, discount=0.9, relabel=relabel)  # noqa: E731
    key = jax.random.key(3)
    got, want = eqx.filter_jit(ask)(glob, key), eqx.filter_jit(ask)(single, key)
    assert int(np.asarray(got.relabelled).sum()) == 12
    # And rate-limited: the limiter lets the sample through and the rows are the same.
    limiter = dx.RateLimiter.min_size(1, sample_batch_size=16)
    limited = dx.RateLimited(glob, limiter)
    limited = eqx.tree_at(lambda r: r.limiter, limited, limiter.with_counts(13 * 4, 0))
    _, again = eqx.filter_jit(ask)(limited, key)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with pytest.raises(TypeError, match="other shards"):
        glob.sample(key, 4, dx.Window(1), relabel=_relabel("random"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@SLOW
def test_a_donated_step_that_adds_and_relabels_updates_the_buffer_in_place():
    # The episode ids are written by the steps' scatter and the rings by scatter-max: a
    # donated add-and-relabelled-sample step aliases every array of the buffer and copies none.
    episodes = dx.Episodes("done", autoreset="next-step")
    buf = dx.TrajectoryBuffer(STEP, 4, 256, episodes=episodes)
    relabel = _relabel("future", fraction=0.5, terminated="done", terminated_fn=_reached)
    window = dx.Window(2)

    def step(buf, steps, key):
        def one(buf, key):
            buf = buf.add(steps)
            return buf, buf.sample(key, 8, window, relabel=relabel).goal_step

        return jax.lax.scan(one, buf, jax.random.split(key, 3))

    steps = jax.tree.map(lambda x: jnp.zeros((4, *x.shape), x.dtype), STEP)
    arrays, static = eqx.partition(buf, eqx.is_array)
    run = lambda a, s, k: step(eqx.combine(a, static), s, k)  # noqa: E731
    compiled = jax.jit(run, donate_argnums=0).lower(arrays, steps, jax.random.key(0)).compile()
    hlo = compiled.as_text()
    assert hlo is not None
    leaves = len(jax.tree.leaves(arrays))
    assert set(range(leaves)) <= aliased_parameters(hlo)
    assert not copies(hlo, 4 * 256)  # nothing the size of a leaf of the storage is copied


def _reached(achieved, goal):
    return jnp.all(achieved == goal)
