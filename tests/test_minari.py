"""Minari in and out (`dx.from_minari`, `dx.load_minari`, `dx.to_minari`) and the grain source
of a dataset's windows (`dx.WindowSource`), against Minari datasets made here with Minari's own
`DataCollector` over gymnasium environments."""

import gc
import pickle
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest


minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")
grain = pytest.importorskip("grain")

import dejax_eqx as dx
from dejax_eqx._windows import mask_windows

from .helpers import SLOW


# Minari advises, with a UserWarning each, to record an author, a description, an evaluation
# env and so on; the datasets made here leave some out.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(is set to None|no environment spec).*:UserWarning"
)

FIELDS = ("observations", "actions", "rewards", "terminations", "truncations", "infos")
SPACES = gym.spaces


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Minari's dataset root, in a temporary directory for the whole module."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("minari")
        patch.setenv("MINARI_DATASETS_PATH", str(path))
        yield path


class _DictObservation(gym.ObservationWrapper):
    """CartPole with a nested Dict observation."""

    def __init__(self, env):
        super().__init__(env)
        box = lambda n: SPACES.Box(-np.inf, np.inf, (n,), np.float32)  # noqa: E731
        self.observation_space = SPACES.Dict(
            {
                "cart": box(2),
                "pole": SPACES.Dict(
                    {"angle": box(1), "speed": SPACES.Box(-np.inf, np.inf, (), np.float32)}
                ),
            }
        )

    def observation(self, observation):
        o = np.asarray(observation, np.float32)
        return {"cart": o[:2], "pole": {"angle": o[2:3], "speed": o[3:4].reshape(())}}


class _Infos(gym.Wrapper):
    """Infos of static shapes on reset and on every step: a count and the cart's position."""

    def reset(self, **kwargs):
        obs, _ = self.env.reset(**kwargs)
        self.count = 0
        return obs, self._info(obs)

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.count += 1
        return obs, reward, terminated, truncated, self._info(obs)

    def _info(self, obs):
        cart = np.asarray(obs["cart"] if isinstance(obs, dict) else obs[:2], np.float32)
        return {"count": np.int64(self.count), "where": {"cart": cart}}


def _collect(env, dataset_id, episodes, record_infos=False):
    """`episodes` episodes of a random policy, as a Minari dataset made by its DataCollector."""
    # The collector replaces its temporary directory when it saves and leaves the old one to
    # the garbage collector, which warns; collected here, under this filter.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Implicitly cleaning up", ResourceWarning)
        env = minari.DataCollector(env, record_infos=record_infos)
        env.action_space.seed(0)
        for i in range(episodes):
            env.reset(seed=100 + i)
            while True:
                _, _, terminated, truncated, _ = env.step(env.action_space.sample())
                if terminated or truncated:
                    break
        out = env.create_dataset(
            dataset_id, algorithm_name="random", author="tests", description="random policy"
        )
        env.close()
        del env
        gc.collect()
    return out


@pytest.fixture(scope="module")
def cartpole(root):
    """CartPole-v1 cut at 20 steps: episodes end by termination and by truncation."""
    m = _collect(gym.make("CartPole-v1", max_episode_steps=20), "cartpole/random-v0", 13)
    ends = [(e.terminations[-1], e.truncations[-1]) for e in m.iterate_episodes()]
    assert any(t for t, _ in ends) and any(u for _, u in ends)
    return m


@pytest.fixture(scope="module")
def dict_cartpole(root):
    """The same with a nested Dict observation and infos of static shapes."""
    env = _Infos(_DictObservation(gym.make("CartPole-v1", max_episode_steps=15)))
    return _collect(env, "cartpole/dict-v0", 7, record_infos=True)


def _hand_made(root, dataset_id, observation_space, action_space, episodes):
    """A Minari dataset of given episodes (dicts of EpisodeBuffer fields)."""
    buffers = [minari.data_collector.EpisodeBuffer(**e) for e in episodes]
    return minari.create_dataset_from_buffers(
        dataset_id,
        buffers,
        observation_space=observation_space,
        action_space=action_space,
        algorithm_name="hand",
        author="tests",
        description="made by hand",
    )


def assert_same_episodes(a, b, *, dtypes=True):
    """Two Minari datasets hold the same episodes, field by field, episode by episode."""
    assert a.total_episodes == b.total_episodes
    for x, y in zip(a.iterate_episodes(), b.iterate_episodes(), strict=True):
        for field in FIELDS:
            fx, fy = (getattr(z, field) for z in (x, y))
            fx, fy = ({} if f is None else f for f in (fx, fy))
            assert jax.tree.structure(fx) == jax.tree.structure(fy), (x.id, field)
            for u, v in zip(jax.tree.leaves(fx), jax.tree.leaves(fy)):
                assert u.shape == v.shape and np.array_equal(u, v), (x.id, field)
                assert not dtypes or u.dtype == v.dtype, (x.id, field, u.dtype, v.dtype)


def _spaces(m):
    return {"observation_space": m.observation_space, "action_space": m.action_space}


# ---------------------------------------------------------------------------------------------
# Round trips.


def test_minari_to_dataset_layout(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d", num_envs=3, episodes_per_read=4)
    assert set(dataset.item_spec) == {
        "observation",
        "action",
        "reward",
        "terminated",
        "truncated",
        "valid",
    }  # CartPole records no infos
    episodes = list(cartpole.iterate_episodes())
    for e in range(3):
        mine = episodes[e::3]  # episode k in env k % num_envs
        assert dataset.lengths[e] == sum(len(x) + 1 for x in mine)
        steps = dataset.read(e, 0, int(dataset.ends[e]))
        at = 0
        for x in mine:
            t = len(x)
            rows = jax.tree.map(lambda v: v[at : at + t + 1], steps)
            np.testing.assert_array_equal(rows["observation"], x.observations)
            np.testing.assert_array_equal(rows["action"][:t], x.actions)
            np.testing.assert_array_equal(rows["reward"][:t], x.rewards)
            np.testing.assert_array_equal(rows["terminated"][:t], x.terminations)
            np.testing.assert_array_equal(rows["truncated"][:t], x.truncations)
            # The reset step: the final observation, a zero action and reward, no end flag.
            assert rows["valid"].tolist() == [True] * t + [False]
            assert rows["action"][t] == 0 and rows["reward"][t] == 0
            assert not rows["terminated"][t] and not rows["truncated"][t]
            at += t + 1
    assert dataset.item_spec["observation"].dtype == cartpole.observation_space.dtype
    assert dataset.item_spec["reward"].dtype == episodes[0].rewards.dtype  # kept as Minari has it


def test_round_trip_through_a_dataset(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d", num_envs=3, episodes_per_read=5)
    written = dx.to_minari(
        dataset, "cartpole/back-v0", env=cartpole.env_spec, episodes_per_write=4, read_length=7
    )
    assert written.left_out == []
    assert written.episodes.tolist() == [5, 4, 4]
    assert_same_episodes(cartpole, written.dataset)
    # Read back from disk, as a user would.
    assert_same_episodes(cartpole, minari.load_dataset("cartpole/back-v0"))


def test_round_trip_dict_observations_and_infos(dict_cartpole, tmp_path):
    spec = dx.minari_spec(dict_cartpole)
    assert spec["observation"]["pole"]["speed"].shape == ()
    assert spec["info"]["where"]["cart"].shape == (2,)
    assert spec["info"]["count"].dtype == np.int64
    first = next(iter(dict_cartpole.iterate_episodes()))
    assert first.infos["count"][0] == 0  # the reset's info comes first
    dataset = dx.from_minari(dict_cartpole, tmp_path / "d", num_envs=2)
    steps = dataset.read(0, 0, len(first) + 1)
    np.testing.assert_array_equal(steps["info"]["count"], first.infos["count"])
    written = dx.to_minari(dataset, "cartpole/dict-back-v0", **_spaces(dict_cartpole))
    assert_same_episodes(dict_cartpole, written.dataset)
    # Without infos: the same but for them.
    bare = dx.from_minari(dict_cartpole, tmp_path / "bare", infos=False)
    assert "info" not in bare.item_spec


def _like32(spec):
    """A step prototype of `spec` in 32 bits, what a JAX buffer holds by default."""
    narrow = {np.dtype(np.int64): jnp.int32, np.dtype(np.float64): jnp.float32}
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, narrow.get(np.dtype(s.dtype), s.dtype)), spec
    )


def test_round_trip_through_a_buffer(cartpole):
    prototype = _like32(dx.minari_spec(cartpole))
    like = dx.TrajectoryBuffer(prototype, num_envs=2, max_length=256)
    with pytest.raises(TypeError, match=r"`load_minari`: `action` is int64 .* int32 .*cast=True"):
        dx.load_minari(cartpole, like)
    buf = dx.load_minari(cartpole, like, cast=True)
    episodes = list(cartpole.iterate_episodes())
    assert buf.streams.step_count.tolist() == [
        sum(len(x) + 1 for x in episodes[e::2]) for e in range(2)
    ]
    written = dx.to_minari(buf, "cartpole/buffer-v0", **_spaces(cartpole))
    assert written.left_out == []
    # The values are Minari's; the dtypes the buffer's (cast exactly).
    assert_same_episodes(cartpole, written.dataset, dtypes=False)
    # And a buffer too short for an env's episodes is refused before anything is read.
    short = dx.TrajectoryBuffer(prototype, num_envs=2, max_length=32)
    with pytest.raises(ValueError, match=r"env 0 would hold \d+ steps .* max_length = 32"):
        dx.load_minari(cartpole, short, cast=True)


def test_both_end_flags_and_tuple_spaces(root, tmp_path):
    """A step may terminate and truncate at once; Tuple and MultiBinary spaces."""
    observation_space = SPACES.Tuple((SPACES.Box(-1, 1, (2,), np.float32), SPACES.Discrete(3)))
    action_space = SPACES.MultiBinary(2)
    rng = np.random.default_rng(0)

    def episode(t, terminated, truncated):
        return dict(
            observations=(
                rng.uniform(-1, 1, (t + 1, 2)).astype(np.float32),
                rng.integers(0, 3, t + 1),
            ),
            actions=rng.integers(0, 2, (t, 2)).astype(np.int8),
            rewards=rng.normal(size=t).astype(np.float32),
            terminations=np.arange(t) == t - 1 if terminated else np.zeros(t, bool),
            truncations=np.arange(t) == t - 1 if truncated else np.zeros(t, bool),
            infos={"x": rng.normal(size=(t + 1, 3))},
        )

    episodes = [episode(4, True, True), episode(1, False, True), episode(3, True, False)]
    m = _hand_made(root, "hand/both-v0", observation_space, action_space, episodes)
    dataset = dx.from_minari(m, tmp_path / "d", num_envs=2)
    steps = dataset.read(0, 0, 5)
    assert steps["terminated"][3] and steps["truncated"][3]
    written = dx.to_minari(dataset, "hand/both-back-v0", **_spaces(m))
    assert_same_episodes(m, written.dataset)


# ---------------------------------------------------------------------------------------------
# What is left out when writing, and steps that break the layout.


def _narrow(steps):
    """Steps as a 32-bit buffer holds them, with a leading env axis of 1."""
    narrow = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}
    return jax.tree.map(lambda x: x.astype(narrow.get(x.dtype, x.dtype))[None], steps)


def test_running_and_cut_episodes_are_reported(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d")
    episodes = list(cartpole.iterate_episodes())
    total = int(dataset.ends[0])
    steps = _narrow(dataset.read(0, 0, total))
    prototype = _like32(dataset.item_spec)
    # A ring that holds only the newest 40 steps, the last 3 of an episode still running.
    buf = dx.TrajectoryBuffer(prototype, num_envs=1, max_length=40).extend(steps)
    buf = buf.extend(jax.tree.map(lambda x: x[:, :3], steps))
    written = dx.to_minari(buf, "cartpole/cut-v0", **_spaces(cartpole))
    first = total + 3 - 40
    ends = np.cumsum([len(x) + 1 for x in episodes])  # one past each episode's reset step
    j = int(np.searchsorted(ends - 1, first))  # the episode of the first reset step held
    # Its start may be lost (the source cannot tell), so it is left out, and so is the running one.
    assert written.left_out == [(0, first, int(ends[j]), "cut"), (0, total, total + 3, "running")]
    assert written.episodes.tolist() == [len(episodes) - j - 1]
    got = list(written.dataset.iterate_episodes())
    assert len(got) == len(episodes) - j - 1
    for x, y in zip(got, episodes[j + 1 :], strict=True):
        for field in FIELDS[:-1]:
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))


def test_to_minari_refuses_a_broken_layout(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d")
    steps = dataset.read(0, 0, int(dataset.ends[0]))
    t = len(next(iter(cartpole.iterate_episodes())))
    prototype = _like32(dataset.item_spec)

    def buffer_of(steps):
        return dx.TrajectoryBuffer(prototype, num_envs=1, max_length=512).extend(_narrow(steps))

    broken = jax.tree.map(np.copy, steps)
    broken["valid"][t] = True  # the reset step is gone: an end flag not followed by one
    with pytest.raises(ValueError, match=rf"step {t - 1} of env 0 ends an episode"):
        dx.to_minari(buffer_of(broken), "cartpole/broken-v0", **_spaces(cartpole))
    broken = jax.tree.map(np.copy, steps)
    broken["terminated"][t - 1] = broken["truncated"][t - 1] = False
    with pytest.raises(ValueError, match=rf"step {t - 1} before it ends no episode"):
        dx.to_minari(buffer_of(broken), "cartpole/broken-v1", **_spaces(cartpole))
    broken = jax.tree.map(np.copy, steps)
    broken["truncated"][t] = True
    with pytest.raises(ValueError, match=rf"step {t} of env 0 has `valid` False .* end flag"):
        dx.to_minari(buffer_of(broken), "cartpole/broken-v2", **_spaces(cartpole))
    # Nothing of a refused write is left in Minari's root.
    assert not any("broken" in name for name in minari.list_local_datasets())


def test_to_minari_refuses_steps_that_do_not_fit(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d")
    wrong = SPACES.Box(-1, 1, (3,), np.float32)
    with pytest.raises(ValueError, match=r"`observation` is a Box space of shape \(3,\)"):
        dx.to_minari(
            dataset, "cartpole/x-v0", observation_space=wrong, action_space=cartpole.action_space
        )
    with pytest.raises(ValueError, match="Minari needs the observation and action spaces"):
        dx.to_minari(dataset, "cartpole/x-v0")
    step = {"observation": jnp.zeros(4), "action": jnp.zeros((), jnp.int32)}
    buf = dx.TrajectoryBuffer(step, num_envs=1, max_length=4)
    with pytest.raises(ValueError, match=r"lack the fields \['reward', 'terminated', 'truncated'"):
        dx.to_minari(buf, "cartpole/x-v0", **_spaces(cartpole))
    assert "cartpole/x-v0" not in minari.list_local_datasets()


# ---------------------------------------------------------------------------------------------
# What a step cannot hold.


def test_unsupported_spaces_are_refused_naming_the_field(root, tmp_path):
    observation_space = SPACES.Dict(
        {"pos": SPACES.Box(-1, 1, (2,), np.float32), "mission": SPACES.Text(8)}
    )
    episode = dict(
        observations={"pos": np.zeros((3, 2), np.float32), "mission": ["go", "go", "go"]},
        actions=np.zeros(2, np.int64),
        rewards=np.zeros(2),
        terminations=np.array([False, True]),
        truncations=np.zeros(2, bool),
    )
    m = _hand_made(root, "hand/text-v0", observation_space, SPACES.Discrete(2), [episode])
    with pytest.raises(ValueError, match=r"`observation\['mission'\]` is a Text space"):
        dx.from_minari(m, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def _info_episode(t, info):
    return dict(
        observations=np.zeros((t + 1, 2), np.float32),
        actions=np.zeros(t, np.int64),
        rewards=np.zeros(t),
        terminations=np.arange(t) == t - 1,
        truncations=np.zeros(t, bool),
        infos=info,
    )


def test_infos_that_vary_are_refused_naming_the_field(root, tmp_path):
    box, discrete = SPACES.Box(-1, 1, (2,), np.float32), SPACES.Discrete(2)
    varying = [
        _info_episode(2, {"x": np.zeros((3, 2))}),
        _info_episode(3, {"x": np.zeros((4, 5))}),
    ]
    m = _hand_made(root, "hand/infos-v0", box, discrete, varying)
    with pytest.raises(ValueError, match=r"`info\['x'\]` of episode 1 .* \(2,\) float64 per step"):
        dx.from_minari(m, tmp_path / "d", num_envs=2, episodes_per_read=1)
    assert not (tmp_path / "d").exists()  # the dataset begun is removed
    keys = [_info_episode(2, {"x": np.zeros(3)}), _info_episode(2, {"y": np.zeros(3)})]
    m = _hand_made(root, "hand/keys-v0", box, discrete, keys)
    with pytest.raises(ValueError, match=r"episode 1 has the fields .*info\['y'\]"):
        dx.from_minari(m, tmp_path / "d")
    text = [_info_episode(2, {"name": np.array([b"a", b"b", b"c"])})]
    m = _hand_made(root, "hand/text-info-v0", box, discrete, text)
    with pytest.raises(ValueError, match=r"`info\['name'\]` is not an array of numbers"):
        dx.minari_spec(m)
    short = [_info_episode(2, {"x": np.zeros(2)})]  # T entries, not T + 1
    m = _hand_made(root, "hand/short-info-v0", box, discrete, short)
    with pytest.raises(ValueError, match=r"`info\['x'\]` has shape \(2,\) .* leading axis of 3"):
        dx.minari_spec(m)


def test_a_like_that_does_not_match_is_refused(cartpole, tmp_path):
    spec = dx.minari_spec(cartpole)
    wrong = dict(spec, observation=jax.ShapeDtypeStruct((5,), np.float32))
    with pytest.raises(ValueError, match=r"`observation` is \(4,\) per step .* \(5,\) in `like`"):
        dx.from_minari(cartpole, tmp_path / "d", like=wrong)
    fewer = {k: v for k, v in spec.items() if k != "valid"}
    with pytest.raises(ValueError, match=r"lacks \['valid'\]"):
        dx.from_minari(cartpole, tmp_path / "d", like=fewer)
    # A cast that would change a value is refused.
    narrow = dict(spec, observation=jax.ShapeDtypeStruct((4,), np.int32))
    with pytest.raises(ValueError, match=r"`observation` of episode 0 holds .* int32 cannot"):
        dx.from_minari(cartpole, tmp_path / "d", like=narrow, cast=True)
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------------------------
# The grain source.


def _windows(dataset, window):
    """Every admitted (env, start), enumerated by brute force."""
    out = []
    need = window.size if window.strict else window.burn_in + 1
    for e in range(dataset.num_envs):
        for s in range(int(dataset.starts[e]), int(dataset.ends[e])):
            if s % window.period == 0 and s + need <= dataset.ends[e]:
                out.append((e, s))
    return out


def test_window_source_reads_what_the_dataset_holds(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d", num_envs=3)
    window = dx.Window(6, burn_in=2, period=3, strict=True)
    source = dx.WindowSource(dataset, window)
    stamps = [source.stamp(i) for i in range(len(source))]
    assert stamps == _windows(dataset, window)
    for i in (0, 7, len(source) - 1):
        env, start = stamps[i]
        record = source[i]
        expected = dataset.read(env, start, start + window.size)
        assert jax.tree.structure(record["items"]) == jax.tree.structure(expected)
        for a, b in zip(jax.tree.leaves(record["items"]), jax.tree.leaves(expected)):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert record["mask"].all() and (int(record["env"]), int(record["start"])) == (env, start)
        assert record["learn"].tolist() == [False] * 2 + [True] * 6
    with pytest.raises(IndexError):
        source[len(source)]
    # Pickled, it reopens the dataset by path on its first read.
    again = pickle.loads(pickle.dumps(source))
    assert again._dataset is None and len(again) == len(source)
    for a, b in zip(jax.tree.leaves(again[5]), jax.tree.leaves(source[5])):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("episode_ends", ["cross", "truncate", "within"])
def test_window_source_masks_as_the_buffers_do(cartpole, tmp_path, episode_ends):
    dataset = dx.from_minari(cartpole, tmp_path / "d", num_envs=2)
    done = None if episode_ends == "cross" else ("terminated", "truncated")
    window = dx.Window(4, burn_in=3, bootstrap=1, episode_ends=episode_ends, done=done)
    source = dx.WindowSource(dataset, window)
    assert [source.stamp(i) for i in range(len(source))] == _windows(dataset, window)
    picks = np.random.default_rng(0).choice(len(source), 24, replace=False).tolist()
    picks += [len(source) - 1, len(source) - 2]  # windows that run past the env's last step
    records = [source[i] for i in picks]
    # The same windows through `mask_windows`, which every buffer's sample uses.
    raw = [
        jax.tree.map(
            lambda x: np.concatenate([x, np.zeros((window.size - len(x), *x.shape[1:]), x.dtype)]),
            dataset.read(
                int(r["env"]),
                int(r["start"]),
                min(int(r["start"]) + 8, int(dataset.ends[int(r["env"])])),
            ),
        )
        for r in records
    ]
    real = [min(8, int(dataset.ends[int(r["env"])]) - int(r["start"])) for r in records]
    items = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *raw)
    env = jnp.asarray([int(r["env"]) for r in records], jnp.int32)
    start = jnp.asarray([int(r["start"]) for r in records], jnp.int32)
    expected = mask_windows(items, jnp.asarray(real, jnp.int32), window, env, start)
    got = jax.tree.map(lambda *xs: np.stack(xs), *records)
    np.testing.assert_array_equal(got["mask"], expected.mask)
    np.testing.assert_array_equal(got["learn"], expected.learn)
    assert not got["mask"].all()  # something was masked
    for a, b in zip(jax.tree.leaves(got["items"]), jax.tree.leaves(expected.items)):
        np.testing.assert_array_equal(a, np.asarray(b).astype(a.dtype))


# The WindowSource is checked in the default tier (test_window_source_masks_as_the_buffers_do);
# grain's epochs over it, in the slow tier.
@SLOW
def test_grain_shuffles_every_window_once_per_epoch(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d", num_envs=2)
    source = dx.WindowSource(dataset, dx.Window(5, period=2, strict=True))
    assert isinstance(source, grain.sources.RandomAccessDataSource)
    everything = sorted(source.stamp(i) for i in range(len(source)))
    shuffled = grain.MapDataset.source(source).shuffle(seed=3)
    stamps = [(int(r["env"]), int(r["start"])) for r in shuffled]
    assert sorted(stamps) == everything and stamps != everything
    sampler = grain.samplers.IndexSampler(len(source), shuffle=True, num_epochs=1, seed=7)
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=0)
    seen = [(int(r["env"]), int(r["start"])) for r in loader]
    assert sorted(seen) == everything
    again = [
        (int(r["env"]), int(r["start"]))
        for r in grain.DataLoader(data_source=source, sampler=sampler, worker_count=0)
    ]
    assert again == seen  # deterministic


def test_window_source_refuses(cartpole, tmp_path):
    dataset = dx.from_minari(cartpole, tmp_path / "d")
    with pytest.raises(TypeError, match="needs `like`"):
        dx.WindowSource(dataset.path, dx.Window(4))
    with pytest.raises(ValueError, match=re.escape("`Window(done=...)`")):
        dx.WindowSource(dataset, dx.Window(4, episode_ends="truncate", done="observation"))
    by_path = dx.WindowSource(dataset.path, dx.Window(4, strict=True), like=dataset.item_spec)
    assert len(by_path) == len(_windows(dataset, dx.Window(4, strict=True)))
