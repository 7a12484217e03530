"""`sample(..., age=...)` of every buffer against the NumPy models: the support and the frequencies
(chi-square), the exact probabilities, the importance weights, the errors, and the
transformations a training loop uses."""

from typing import cast

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from dejax_eqx import PolicyAge
from dejax_eqx._sequences import env_log_weights, Law, start_log_weights

from .helpers import assert_frequencies, assert_tree_equal, rotation, SLOW, to_numpy, unstack
from .reference import (
    EmptyBufferError,
    ref_aged,
    ref_aged_weights,
    RefPrioritisedReplay,
    RefPrioritisedTrajectory,
    RefTrajectoryBuffer,
)


DRAWS = 100_000
BETA = 0.7
ITEM = {"id": jnp.zeros((), jnp.int32), "version": jnp.zeros((), jnp.int32)}
STEP = {
    "env": jnp.zeros((), jnp.int32),
    "pos": jnp.zeros((), jnp.int32),
    "version": ITEM["version"],
}


def version(item):
    return item["version"]


def _age(current, max_age=None, decay=None, *, read=version):
    return PolicyAge(read, current, max_age, decay=decay)


# One compiled sampler per buffer type and static configuration, reused across tests.
_by_age = eqx.filter_jit(lambda b, k, a, n: b.sample(k, n, age=a))
_by_age_beta = eqx.filter_jit(lambda b, k, a, n, beta: b.sample(k, n, age=a, beta=beta))
_windows_by_age = eqx.filter_jit(
    lambda b, k, a, n, w, power, source: b.sample(
        k, n, w, age=a, distribution_power=power, source=source
    )
)


def _cells(probabilities: dict, drawn: list) -> tuple[np.ndarray, np.ndarray]:
    """Counts of `drawn` and the probabilities, over every cell of `probabilities` (and any
    drawn outside it, with probability 0, which fails the test)."""
    cells = sorted(set(probabilities) | set(drawn))
    index = {c: i for i, c in enumerate(cells)}
    counts = np.bincount([index[c] for c in drawn], minlength=len(cells))
    return counts, np.asarray([probabilities.get(c, 0.0) for c in cells])


def _replay_items(n: int) -> dict:
    # Versions that are not monotone in the slot: ages 0..12 spread over the ring.
    return {
        "id": np.arange(n, dtype=np.int32),
        "version": (np.arange(n, dtype=np.int32) * 7) % 13,
    }


# ---------------------------------------------------------------------------------------------
# UniformReplay


@pytest.mark.parametrize("decay", [None, "inverse"])
def test_uniform_replay_frequencies_and_probabilities(decay):
    max_size, n = 24, 37
    items = _replay_items(n)
    buf = dx.UniformReplay(ITEM, max_size).add_batch(items)
    current, max_age = 12, 8  # versions 0..3 are too old
    s = _by_age(buf, jax.random.key(1), _age(current, max_age, decay), DRAWS)
    slot_id = {k % max_size: k for k in range(n)}  # the item each slot holds
    ages = {slot: current - int(items["version"][k]) for slot, k in slot_id.items()}
    expected = ref_aged(dict.fromkeys(slot_id, 1.0), ages, max_age, decay)
    indices = np.asarray(s.indices)
    assert (np.asarray(s.items["id"]) == np.asarray([slot_id[i] for i in indices])).all()
    assert s.ages.tolist() == [ages[i] for i in indices]
    assert s.generations is None
    assert (np.asarray(s.weights) == 1).all()
    np.testing.assert_allclose(s.probabilities, [expected[i] for i in indices], rtol=1e-5)
    # Pearson chi-square against the model's exact probabilities; slots older than max_age
    # have probability 0 and must never be drawn. A correct sampler fails with probability
    # 1e-6.
    assert_frequencies(*_cells(expected, indices.tolist()), alpha=1e-6)


# ---------------------------------------------------------------------------------------------
# PrioritisedReplay

ALPHA = 0.6


def _prioritised(max_size=30, n=45, **kwargs):
    items = _replay_items(n)
    buf = dx.PrioritisedReplay(ITEM, max_size, ALPHA, **kwargs).add_batch(items)
    model = RefPrioritisedReplay(max_size, ALPHA)
    model.add_batch(unstack(items, n))
    rng = np.random.default_rng(0)
    priorities = rng.choice([0.0, 0.1, 1.0, 3.0, 10.0], max_size).astype(np.float32)
    buf = buf.set_priorities(jnp.arange(max_size), priorities)
    model.set_priorities(np.arange(max_size), priorities)
    return buf, model


def _slot_ages(model, current):
    return {i: current - int(model.items[i]["version"]) for i in range(model.size)}


@pytest.mark.parametrize(
    "decay, stratified",
    rotation([(None, False), ("inverse", False), ("inverse", True)], 2, keep=1, several=True),
)
def test_prioritised_replay_frequencies_probabilities_and_weights(decay, stratified):
    buf, model = _prioritised(stratified=stratified)
    current, max_age = 13, 9
    s = _by_age_beta(buf, jax.random.key(2), _age(current, max_age, decay), DRAWS, BETA)
    ages = _slot_ages(model, current)
    masses = dict(enumerate(model.masses()[: model.size]))
    expected = ref_aged(masses, ages, max_age, decay)
    target = ref_aged(dict.fromkeys(masses, 1.0), ages, max_age, decay)
    indices = np.asarray(s.indices)
    assert (np.asarray(s.items["id"]) == np.asarray([model.items[i]["id"] for i in indices])).all()
    assert s.ages.tolist() == [ages[i] for i in indices]
    assert s.generations.tolist() == [model.generations[i] for i in indices]
    np.testing.assert_allclose(s.probabilities, [expected[i] for i in indices], rtol=1e-5)
    weights = ref_aged_weights(target, expected, indices.tolist(), BETA)
    np.testing.assert_allclose(s.weights, weights, rtol=1e-5)
    # Chi-square as above (false-failure rate 1e-6). Stratified draws vary less than
    # multinomial ones, so for them the test is conservative: still at most 1e-6.
    assert_frequencies(*_cells(expected, indices.tolist()), alpha=1e-6)


# As its trajectory twin below: the weights are checked against the model in the default tier
# (test_prioritised_replay_frequencies_probabilities_and_weights), this agreement in the slow one.
@SLOW
def test_prioritised_replay_weights_are_those_of_sample_when_nothing_is_excluded():
    buf, model = _prioritised()
    s = _by_age_beta(buf, jax.random.key(4), _age(20), 2000, BETA)  # every age admitted
    indices = np.asarray(s.indices)
    np.testing.assert_allclose(s.probabilities, model.probabilities()[indices], rtol=1e-5)
    weights = dx.importance_weights(s.probabilities, buf.size, BETA)
    np.testing.assert_allclose(s.weights, weights, rtol=1e-5)
    # The stamps go back to `set_priorities` as those of `sample`.
    new = buf.set_priorities(s.indices, jnp.full(2000, 3.0), generations=s.generations)
    np.testing.assert_allclose(new.tree.leaves[s.indices], 3.0**ALPHA, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# ClusteredReplay: a cluster as its `sample` draws one, among those that hold a young enough
# item, then an item of it by the inner replay's aged law.


def cluster_of(item):
    return (item["id"] % 5) % 3  # clusters of 15, 15 and 7 of the 37 ids below


def _clustered_items(n: int) -> dict:
    """`_replay_items`, with the versions of cluster 0 in [0, 3]: too old for `current` 12
    and `max_age` 4, so that cluster 0 holds items and none can be drawn."""
    items = _replay_items(n)
    cluster = (items["id"] % 5) % 3
    items["version"] = np.where(cluster == 0, items["version"] % 4, items["version"])
    return items


# Clustered ages: test_clustered_replay_draws_no_cluster_whose_items_are_all_too_old in the
# default tier; the law, in the slow tier.
@SLOW
@pytest.mark.parametrize("power", [0.0, 1.0])
def test_clustered_replay_frequencies_and_probabilities(power):
    max_size, n = 16, 37
    items = _clustered_items(n)
    inner = dx.UniformReplay(ITEM, max_size)
    buf = dx.ClusteredReplay(inner, 3, cluster_of, power).add_batch(items)
    assert buf.cluster_sizes.tolist() == [15, 15, 7]
    current, max_age, decay = 12, 4, "inverse"
    s = _by_age(buf, jax.random.key(3), _age(current, max_age, decay), DRAWS)
    # Each cluster's ids in the order they were added (no cluster wraps): id -> slot.
    held = {c: [k for k in range(n) if (k % 5) % 3 == c] for c in range(3)}
    slot = {k: i for ks in held.values() for i, k in enumerate(ks)}
    ages = {k: current - int(items["version"][k]) for k in range(n)}
    within = {}  # per cluster that holds a young enough item: its aged law
    for c, ks in held.items():
        try:
            within[c] = ref_aged(dict.fromkeys(ks, 1.0), ages, max_age, decay)
        except EmptyBufferError:
            pass
    assert sorted(within) == [1, 2]  # cluster 0 holds 15 items, none young enough
    weights = {c: len(held[c]) ** power for c in within}
    expected = {
        k: weights[c] / sum(weights.values()) * p
        for c, law in within.items()
        for k, p in law.items()
    }
    ids = np.asarray(s.items["id"]).tolist()
    # Each row names its slot within its cluster, its age and its probability within its
    # cluster (as a plain sample of a ClusteredReplay does); the weights are 1.
    assert np.asarray(s.indices).tolist() == [slot[k] for k in ids]
    assert s.ages.tolist() == [ages[k] for k in ids]
    np.testing.assert_allclose(s.probabilities, [within[(k % 5) % 3][k] for k in ids], rtol=1e-5)
    assert (np.asarray(s.weights) == 1).all() and s.generations is None
    # Chi-square (false-failure rate 1e-6); items too old, and cluster 0, never drawn.
    assert_frequencies(*_cells(expected, ids), alpha=1e-6)


def test_clustered_replay_draws_no_cluster_whose_items_are_all_too_old():
    items = _clustered_items(37)
    buf = dx.ClusteredReplay(dx.UniformReplay(ITEM, 16), 3, cluster_of).add_batch(items)
    with pytest.raises(RuntimeError, match="no cluster holds an item that can be drawn"):
        _by_age(buf, jax.random.key(0), _age(30, 2), 4)  # every version is at most 12


# ---------------------------------------------------------------------------------------------
# TrajectoryBuffer


def _feed(buf, model, rounds, rng, *, reset_at=None):
    """Asynchronous adds: each round a random subset of the envs takes a step whose version is
    `round // 2`."""
    n = buf.num_envs
    add = eqx.filter_jit(lambda b, x, i: b.add(x, env_ids=i))
    for r in range(rounds):
        if r == reset_at:
            buf = buf.reset_online_queue()
            cast(RefTrajectoryBuffer, model).reset_online_queue()  # the one with an online queue
        env_ids = [int(e) for e in rng.permutation(n) if rng.random() < 0.7] or [0]
        streams = model.streams if isinstance(model, RefPrioritisedTrajectory) else model
        steps = {
            "env": np.asarray(env_ids, np.int32),
            "pos": np.asarray([streams.count[e] for e in env_ids], np.int32),
            "version": np.full(len(env_ids), r // 2, np.int32),
        }
        buf = add(buf, steps, np.asarray(env_ids, np.int32))
        model.add(unstack(steps, len(env_ids)), env_ids)
    return buf, model


def _window_ages(streams: RefTrajectoryBuffer, windows, current) -> dict:
    return {(e, s): current - int(streams.step(e, s)["version"]) for e, s in windows}


def _check_windows(s, window, streams: RefTrajectoryBuffer) -> None:
    """Each window holds the steps of its stamp: real ones up to its env's newest step."""
    env, start = np.asarray(s.items.env), np.asarray(s.items.start)
    t = np.arange(window.size)[None, :]
    real = start[:, None] + t < np.asarray(streams.count)[env][:, None]
    assert (np.asarray(s.items.mask) == real).all()
    pos = np.asarray(s.items.items["pos"])
    assert (np.where(real, pos, 0) == np.where(real, start[:, None] + t, 0)).all()
    assert (np.where(real, np.asarray(s.items.items["env"]) == env[:, None], True)).all()


@pytest.mark.parametrize(
    "decay, source, window",
    rotation(
        [
            (None, "replay", dx.Window(2, burn_in=1, period=2)),
            ("inverse", "online", dx.Window(3)),
        ],
        1,
        keep=1,
        several=True,
    ),
    ids=["replay-period", "online-inverse"],
)
def test_trajectory_buffer_frequencies_and_probabilities(decay, source, window):
    num_envs, max_length, power = 3, 7, 1.5
    buf = dx.TrajectoryBuffer(STEP, num_envs, max_length)
    buf, model = _feed(
        buf, RefTrajectoryBuffer(num_envs, max_length), 40, np.random.default_rng(5), reset_at=33
    )
    current, max_age = 20, 3  # versions 17..19 are admitted
    args = (jnp.asarray(power), source)
    s = _windows_by_age(buf, jax.random.key(6), _age(current, max_age, decay), DRAWS, window, *args)
    law = model.window_probabilities(
        window.size, period=window.period, min_real=window.burn_in + 1, power=power, source=source
    )
    ages = _window_ages(model, law, current)
    expected = ref_aged(law, ages, max_age, decay)
    drawn = list(zip(s.items.env.tolist(), s.items.start.tolist()))
    assert s.ages.tolist() == [ages[c] for c in drawn]
    assert (np.asarray(s.weights) == 1).all() and s.generations is None
    env, start = np.asarray(s.items.env), np.asarray(s.items.start)
    assert (np.asarray(s.indices) == env * max_length + start % max_length).all()
    np.testing.assert_allclose(s.probabilities, [expected[c] for c in drawn], rtol=1e-5)
    _check_windows(s, window, model)
    # Chi-square over every admissible start (those too old, or not admissible, have
    # probability 0): false-failure rate 1e-6.
    assert_frequencies(*_cells(expected, drawn), alpha=1e-6)


# The sampler's two laws agree: the draws are held to the model's law in the default tier
# (test_trajectory_buffer_frequencies_and_probabilities), this internal identity in the slow one.
@SLOW
def test_start_log_weights_sum_to_the_env_weights_of_the_sampler():
    lengths = jnp.asarray([0, 3, 9, 12, 12], jnp.int32)
    phase = jnp.asarray([0, 1, 2, 0, 2], jnp.int32)
    back = jnp.broadcast_to(jnp.arange(-1, 15, dtype=jnp.int32), (5, 16))
    for law in [Law(4), Law(4, period=3, min_real=2), Law(5, period=3, strict=True)]:
        for power in [0.0, 1.0, -2.5]:
            p = jnp.asarray(power, jnp.float32)
            got = jax.nn.logsumexp(start_log_weights(back, lengths, phase, law, p), axis=1)
            want = env_log_weights(lengths, phase, law, p)
            np.testing.assert_allclose(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# PrioritisedTrajectoryBuffer

PTB_ALPHA = 0.7


def _prioritised_windows(rng, **kwargs):
    num_envs, max_length = 3, 8
    window = dx.Window(2, burn_in=1, period=2, strict=True)
    buf = dx.PrioritisedTrajectoryBuffer(
        STEP, num_envs, max_length, window, priority_exponent=PTB_ALPHA, **kwargs
    )
    model = RefPrioritisedTrajectory(num_envs, max_length, window.size, 2, PTB_ALPHA)
    buf, model = _feed(buf, model, 40, rng)
    windows = sorted(model.priorities)
    env = np.asarray([e for e, _ in windows], np.int32)
    start = np.asarray([s for _, s in windows], np.int32)
    priorities = rng.choice([0.0, 0.25, 1.0, 4.0], len(windows)).astype(np.float32)
    buf = buf.set_priorities(env, start, priorities)
    model.set_priorities(env.tolist(), start.tolist(), priorities)
    return buf, model


# Aged draws of the replays and of a trajectory buffer run in the default tier (above); of a
# prioritised trajectory buffer, in the slow tier.
@SLOW
@pytest.mark.parametrize("decay", [None, "inverse"])
def test_prioritised_trajectory_frequencies_probabilities_and_weights(decay):
    buf, model = _prioritised_windows(np.random.default_rng(7))
    current, max_age = 20, 3
    s = _by_age_beta(buf, jax.random.key(8), _age(current, max_age, decay), DRAWS, BETA)
    ages = _window_ages(model.streams, model.priorities, current)
    masses = {w: model.mass(w) for w in model.priorities}
    expected = ref_aged(masses, ages, max_age, decay)
    target = ref_aged(dict.fromkeys(masses, 1.0), ages, max_age, decay)
    drawn = list(zip(s.items.env.tolist(), s.items.start.tolist()))
    assert s.ages.tolist() == [ages[c] for c in drawn]
    k = buf.leaves_per_env
    assert s.indices.tolist() == [e * k + (t // 2) % k for e, t in drawn]
    np.testing.assert_allclose(s.probabilities, [expected[c] for c in drawn], rtol=1e-5)
    _check_windows(s, buf.window, model.streams)
    np.testing.assert_allclose(
        s.weights, ref_aged_weights(target, expected, drawn, BETA), rtol=1e-5
    )
    # Chi-square (false-failure rate 1e-6); windows of priority 0 or too old never drawn.
    assert_frequencies(*_cells(expected, drawn), alpha=1e-6)


@SLOW
def test_prioritised_trajectory_weights_are_those_of_sample_when_nothing_is_excluded():
    buf, model = _prioritised_windows(np.random.default_rng(9))
    s = _by_age_beta(buf, jax.random.key(10), _age(20), 2000, BETA)
    expected = model.probabilities()
    drawn = list(zip(s.items.env.tolist(), s.items.start.tolist()))
    np.testing.assert_allclose(s.probabilities, [expected[c] for c in drawn], rtol=1e-5)
    weights = dx.importance_weights(s.probabilities, buf.num_windows, BETA)
    np.testing.assert_allclose(s.weights, weights, rtol=1e-5)
    # The stamps go back to `set_priorities` as those of `sample`.
    assert not buf.stale(s.items.env, s.items.start).any()
    new = buf.set_priorities(s.items.env, s.items.start, jnp.full(2000, 2.0))
    np.testing.assert_allclose(new.tree.leaves[s.indices], 2.0**PTB_ALPHA, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Errors


def test_policy_age_arguments_are_checked():
    # (Under the tests' import hook, a value the annotation refuses fails there first.)
    with pytest.raises(TypeError, match=r"must be a function|parameter"):
        PolicyAge("version", 3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(
        (ValueError, jaxtyping.TypeCheckError), match=r"must be None .* or 'inverse'|parameter"
    ):
        PolicyAge(version, 3, decay="linear")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"PolicyAge\(max_age=...\)` must be non-negative"):
        PolicyAge(version, 3, -1)
    with pytest.raises(ValueError, match=r"PolicyAge\(current=...\)` must be non-negative"):
        PolicyAge(version, -2)
    with pytest.raises(TypeError, match=r"must be an integer array|parameter"):
        PolicyAge(version, jnp.asarray(3.0))  # a float version
    with pytest.raises(RuntimeError, match=r"PolicyAge\(max_age=...\)` must be in \[0, 2\*\*31"):
        PolicyAge(version, 3, jnp.asarray(-1, jnp.int32))
    # Traced, the age is reported by the call it is given to, as its other arguments are.
    sample = eqx.filter_jit(
        lambda buf, c, m: buf.sample(jax.random.key(0), 2, age=PolicyAge(version, c, m))
    )
    buf = dx.UniformReplay(ITEM, 6).add_batch(_replay_items(4))
    with pytest.raises(RuntimeError, match=r"PolicyAge\(max_age=...\)` must be in"):
        sample(buf, jnp.asarray(3), jnp.asarray(-1))
    age = PolicyAge(version, np.int64(7), np.uint8(2))
    assert age.current.dtype == jnp.int32 and int(age.current) == 7 and int(age.max_age) == 2


@SLOW
def test_errors_of_the_replays():
    empty = dx.UniformReplay(ITEM, 6)
    key = jax.random.key(0)
    with pytest.raises(RuntimeError, match="cannot sample from an empty UniformReplay"):
        _by_age(empty, key, _age(3), 4)
    buf = empty.add_batch(_replay_items(4))  # versions 0, 7, 1, 8
    with pytest.raises(RuntimeError, match="has a policy version greater than `current`"):
        _by_age(buf, key, _age(7), 4)
    with pytest.raises(RuntimeError, match="older than `max_age`.*no item can be drawn"):
        _by_age(buf, key, _age(12, 3), 4)
    # Eagerly too, from the caller's line, quoting the call.
    with pytest.raises(RuntimeError, match=r"`UniformReplay.sample`: every item .* older than"):
        buf.sample(key, 4, age=_age(12, 3))
    # `beta` weighs an aged sample; a plain one has no weights.
    with pytest.raises(TypeError, match=r"`UniformReplay.sample\(beta=...\)` sets the importance"):
        buf.sample(key, 4, beta=0.5)
    with pytest.raises(TypeError, match=r"PolicyAge\(version=...\)` must map one item to one int"):
        buf.sample(key, 4, age=_age(12, read=lambda item: item["version"].astype(jnp.float32)))
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(key, 0, age=_age(12))
    replay = dx.PrioritisedReplay(ITEM, 6).add_batch(_replay_items(4))
    replay = replay.set_priorities(jnp.arange(4), jnp.asarray([0.0, 1.0, 0.0, 0.0]))
    with pytest.raises(RuntimeError, match="older than `max_age`.*no item can be drawn"):
        _by_age_beta(replay, key, _age(12, 4), 4, BETA)  # the item of priority 1 has age 5
    replay = replay.set_priorities(jnp.arange(4), jnp.zeros(4))
    with pytest.raises(RuntimeError, match="every stored item has priority 0"):
        _by_age_beta(replay, key, _age(12), 4, BETA)
    replay = replay.set_priorities(jnp.arange(1), jnp.ones(1))
    with pytest.raises(RuntimeError, match="`beta` must be finite and non-negative"):
        _by_age_beta(replay, key, _age(12), 4, jnp.asarray(-1.0))
    with pytest.raises(TypeError, match=r"`PrioritisedReplay.sample\(beta=...\)` sets the impo"):
        replay.sample(key, 4, beta=0.5)


# As test_errors_of_the_replays: the slow tier (the arguments are checked by default, above).
@SLOW
def test_errors_of_the_trajectory_buffers():
    key, window = jax.random.key(0), dx.Window(2)
    buf = dx.TrajectoryBuffer(STEP, 2, 4)
    args = (jnp.asarray(1.0), "replay")
    with pytest.raises(RuntimeError, match="cannot sample from an empty TrajectoryBuffer"):
        _windows_by_age(buf, key, _age(3), 4, window, *args)
    steps = {"env": jnp.arange(2), "pos": jnp.zeros(2, jnp.int32), "version": jnp.asarray([1, 5])}
    buf = buf.add(steps)
    with pytest.raises(RuntimeError, match="a stored step has a policy version greater"):
        _windows_by_age(buf, key, _age(4), 4, window, *args)
    with pytest.raises(RuntimeError, match="every window start that could be drawn is older"):
        _windows_by_age(buf, key, _age(9, 3), 4, window, *args)
    with pytest.raises(RuntimeError, match="`distribution_power` must be finite"):
        _windows_by_age(buf, key, _age(9), 4, window, jnp.asarray(jnp.nan), "replay")
    ptb = dx.PrioritisedTrajectoryBuffer(STEP, 2, 4, dx.Window(2, strict=True))
    with pytest.raises(RuntimeError, match="no window is admissible yet"):
        _by_age_beta(ptb, key, _age(9), 4, BETA)
    ptb = ptb.add(steps).add(steps)
    with pytest.raises(RuntimeError, match="a stored step has a policy version greater"):
        _by_age_beta(ptb, key, _age(4), 4, BETA)
    with pytest.raises(RuntimeError, match="every window that could be drawn is older"):
        _by_age_beta(ptb, key, _age(9, 3), 4, BETA)


# ---------------------------------------------------------------------------------------------
# Transformations


def test_a_donated_training_step_updates_the_buffer_in_place():
    @eqx.filter_jit(donate="all-except-first")
    def step(current, buf, items, key):
        buf = buf.add_batch(items)
        s = buf.sample(key, 8, age=_age(current, 3, decay="inverse"))
        return buf, s

    buf = dx.UniformReplay(ITEM, 64).add_batch(_replay_items(10))
    for t in range(3):
        pointer = buf.storage.data["id"].unsafe_buffer_pointer()
        old = buf.storage.data["id"]
        items = {"id": jnp.arange(4, dtype=jnp.int32), "version": jnp.full(4, 13 + t, jnp.int32)}
        buf, s = step(jnp.asarray(13 + t), buf, items, jax.random.key(t))
        assert buf.storage.data["id"].unsafe_buffer_pointer() == pointer
        assert old.is_deleted()
        assert (np.asarray(s.ages) <= 3).all()


# A donated step runs in the default tier (above), scans of every buffer in
# tests/test_transforms.py; this scan with ages, in the slow tier.
@SLOW
def test_scan_carry_equals_a_python_loop():
    def body(carry, key):
        buf, current = carry
        items = {"id": jnp.arange(3, dtype=jnp.int32), "version": jnp.full(3, current)}
        buf = buf.add_batch(items)
        s = buf.sample(key, 5, age=_age(current, 2, decay="inverse"), beta=0.5)
        buf = buf.set_priorities(s.indices, s.weights + 0.5, generations=s.generations)
        return (buf, current + 1), s

    keys = jax.random.split(jax.random.key(0), 6)
    carry = (dx.PrioritisedReplay(ITEM, 10), jnp.asarray(0, jnp.int32))
    scanned, samples = eqx.filter_jit(jax.lax.scan)(body, carry, keys)
    step = eqx.filter_jit(body)
    for t in range(6):
        carry, s = step(carry, keys[t])
        assert_tree_equal(jax.tree.map(lambda x: x[t], samples), s)
    assert_tree_equal(to_numpy(scanned), to_numpy(carry))


def test_the_frequency_test_rejects_the_wrong_decay():
    # The chi-square tests above can fail: draws weighted 1 / (age + 1) are rejected against
    # the probabilities without decay.
    max_size, n = 24, 37
    items = _replay_items(n)
    buf = dx.UniformReplay(ITEM, max_size).add_batch(items)
    s = _by_age(buf, jax.random.key(1), _age(12, 8, "inverse"), DRAWS)
    slot_id = {k % max_size: k for k in range(n)}
    ages = {slot: 12 - int(items["version"][k]) for slot, k in slot_id.items()}
    wrong = ref_aged(dict.fromkeys(slot_id, 1.0), ages, 8, None)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(*_cells(wrong, np.asarray(s.indices).tolist()))
