"""The global buffers in this process, on meshes of its devices (the checks across processes
are `multi_process.py`'s): values of every kind come back bit for bit, and the draws are a
single buffer's."""

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import rotation, SLOW


pytestmark = pytest.mark.skipif(
    not hasattr(jax, "shard_map"), reason="the global buffers need JAX 0.7+ (jax.shard_map)"
)


def _mesh():
    return jax.make_mesh((1,), ("replay",))


# Every dtype through a global buffer: the slow tier (the values of one dtype come back in
# the tests below).
@SLOW
def test_sampled_values_come_back_bit_for_bit_whatever_their_dtype():
    # The batch crosses devices as 32-bit words: -0.0, NaN payloads, subnormals, 64-bit,
    # 8-bit, boolean and complex values must all survive it unchanged.
    item = {
        "f32": jnp.zeros(3, jnp.float32),
        "f16": jnp.zeros(2, jnp.float16),
        "bf16": jnp.zeros((), jnp.bfloat16),
        "i8": jnp.zeros(2, jnp.int8),
        "u16": jnp.zeros((), jnp.uint16),
        "bool": jnp.zeros(2, jnp.bool_),
        "c64": jnp.zeros((), jnp.complex64),
    }
    n = 8
    rng = np.random.default_rng(0)
    odd = np.array([-0.0, np.nan, 1e-45], np.float32)
    odd.view(np.uint32)[1] |= 0x1234  # a NaN with a payload
    items = {
        "f32": np.tile(odd, (n, 1)),
        "f16": rng.normal(size=(n, 2)).astype(np.float16),
        "bf16": jnp.asarray(rng.normal(size=n), jnp.bfloat16),
        "i8": rng.integers(-128, 128, (n, 2)).astype(np.int8),
        "u16": rng.integers(0, 2**16, n).astype(np.uint16),
        "bool": rng.random((n, 2)) < 0.5,
        "c64": (rng.normal(size=n) + 1j * rng.normal(size=n)).astype(np.complex64),
    }
    replay = dx.GlobalReplay(_mesh(), lambda: dx.UniformReplay(item, 16)).add_batch(items)
    single = dx.UniformReplay(item, 16).add_batch(items)
    key = jax.random.key(3)
    got, want = replay.sample(key, 32), single.sample(key, 32)
    for name in item:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


# Global buffers draw as one buffer of every env in the default tier (below); a prioritised
# replay of one shard, in the slow tier.
@SLOW
def test_a_prioritised_global_replay_on_one_device_draws_as_the_replay_it_holds():
    item = {"x": jnp.zeros(())}
    make = lambda: dx.PrioritisedReplay(item, 32, stratified=True)  # noqa: E731
    replay = dx.GlobalReplay(_mesh(), make)
    priorities = jnp.arange(1.0, 21.0)
    items = {"x": jnp.arange(20.0)}
    replay, single = replay.add_batch(items, priorities), make().add_batch(items, priorities)

    @eqx.filter_jit(donate="all")
    def step(replay, key):
        sample = replay.sample(key, 16)
        return replay.set_priorities(sample.indices, sample.items["x"] + 1), sample

    replay, got = step(replay, jax.random.key(0))
    want = single.sample(jax.random.key(0), 16)
    assert np.array_equal(got.indices, want.indices)
    np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-6)
    single = single.set_priorities(want.indices, want.items["x"] + 1)
    leaves = jax.vmap(lambda shard: shard.tree.leaves)(replay.shards)[0]
    assert np.array_equal(np.asarray(leaves), np.asarray(single.tree.leaves))


@pytest.mark.parametrize(
    "option",
    rotation(["windows", "strict", "transitions", "both sources", "aged", "online only"], 0, 1),
)
def test_every_sampling_option_draws_as_one_buffer_of_every_env(option):
    # Four shards of 2 envs against one buffer of 8 envs fed the same steps: each option of
    # the law (windows with `done`, episode ends, period and burn-in; strict windows; n-step
    # transitions; both sources; policy age) gives the same rows bit for bit.
    step = {
        "obs": jnp.zeros(3),
        "id": jnp.zeros((), jnp.int32),
        "r": jnp.zeros(()),
        "done": jnp.zeros((), bool),
        "v": jnp.zeros((), jnp.int32),
    }
    mesh = jax.make_mesh((4,), ("shards",))
    buffer = dx.GlobalTrajectoryBuffer(mesh, lambda: dx.TrajectoryBuffer(step, 2, 16))
    single = dx.TrajectoryBuffer(step, 8, 16)
    for t in range(11):
        steps = {
            "obs": np.full((8, 3), t, np.float32),
            "id": (np.arange(8) * 100 + t).astype(np.int32),
            "r": np.ones(8, np.float32),
            "done": (np.arange(8) + t) % 4 == 3,
            "v": np.full(8, t, np.int32),
        }
        buffer, single = buffer.add(buffer.rows(steps)), single.add(steps)
        if t == 6:  # the online queue restarts: steps 7 to 10 are online
            buffer = buffer.with_streams(buffer.streams)
            single = single.with_streams(single.streams)
    window = dx.Window(3, burn_in=1, period=2, done="done", episode_ends="within")
    strict = dx.Window(2, strict=True, done="done", episode_ends="truncate")
    age = dx.PolicyAge(lambda item: item["v"], 10, max_age=4)
    nstep = dx.NStep(2, reward="r", terminated="done")
    ask = {
        "windows": lambda b, k: b.sample(k, 16, window),
        "strict": lambda b, k: b.sample(k, 16, strict),
        "transitions": lambda b, k: b.sample(k, 16, nstep, discount=0.9),
        "both sources": lambda b, k: b.sample(k, 16, window, source={"replay": 10, "online": 6}),
        "aged": lambda b, k: b.sample(k, 16, window, age=age),
        "online only": lambda b, k: b.sample(k, 16, window, source="online"),
    }[option]
    key = jax.random.key(7)
    got, want = eqx.filter_jit(ask)(buffer, key), eqx.filter_jit(ask)(single, key)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if option == "windows":  # the stamps read back on the shard of their env
        again = buffer.read(got.env, got.start, window)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(got)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("kind", rotation([dx.TrajectoryBuffer, dx.TrajectoryQueue], 0, keep=1))
def test_extend_stores_each_env_as_one_buffer_of_every_env(kind):
    # `extend` of every env's sequences, then of named envs (block k naming envs of shard k),
    # stores what one buffer of 8 envs stores; a queue then pops every env's oldest steps.
    step = {"x": jnp.zeros((), jnp.int32)}
    mesh = jax.make_mesh((4,), ("shards",))
    buffer = dx.GlobalTrajectoryBuffer(mesh, lambda: kind(step, 2, 8))
    single = kind(step, 8, 8)
    every = {"x": np.arange(8 * 3, dtype=np.int32).reshape(8, 3)}
    buffer, single = buffer.extend(buffer.rows(every)), single.extend(every)
    ids = np.array([1, 2, 5, 6], np.int32)  # one env of each shard
    named = {"x": 100 + np.arange(4 * 2, dtype=np.int32).reshape(4, 2)}
    buffer, single = buffer.extend(named, ids), single.extend(named, ids)
    for a, b in zip(jax.tree.leaves(buffer.streams), jax.tree.leaves(single.streams)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    if kind is dx.TrajectoryQueue:
        (got, _), (want, _) = buffer.pop(2), single.pop(2)
        assert np.array_equal(np.asarray(got["x"]), np.asarray(want["x"]))
