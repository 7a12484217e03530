"""The dejax 0.1.3 API, tested from dejax's documented behaviour (its README, its signatures).

Written the way dejax users wrote their code: plain `jax.jit`, the buffer object closed over or
passed as an argument, the state passed in and out, `donate_argnums` on the state.
"""

from typing import cast

import dejax_eqx as dx
import dejax_eqx.compat.dejax as dejax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from .helpers import assert_frequencies, assert_tree_equal, python_blocks, rotation, to_numpy
from .reference import RefCircularBuffer, RefUniformReplay


PROTO = {"obs": jnp.zeros(3, jnp.float32), "step": jnp.zeros((), jnp.int32)}


def make_item(k):
    return {"obs": jnp.full(3, k, jnp.float32), "step": jnp.asarray(k, jnp.int32)}


def make_items(start, n):
    steps = jnp.arange(start, start + n, dtype=jnp.int32)
    return {"obs": jnp.repeat(steps[:, None].astype(jnp.float32), 3, axis=1), "step": steps}


def steps_of(buffer, state):
    """The stored `step` labels, oldest first (read through the circular-buffer functions)."""
    storage = state.storage
    get = jax.jit(dejax.circular_buffer.get_at_index)
    return [int(get(storage, jnp.asarray(i))["step"]) for i in range(int(buffer.size_fn(state)))]


# ---------------------------------------------------------------------------------------------
# The README's walk-through.


def test_readme_walkthrough():
    buffer = dejax.uniform_replay(max_size=5)
    buffer_state = buffer.init_fn(PROTO)
    add = jax.jit(buffer.add_fn)
    for k in range(8):
        buffer_state = add(buffer_state, make_item(k))
    batch = jax.jit(buffer.sample_fn, static_argnums=2)(buffer_state, jax.random.PRNGKey(0), 16)
    assert batch["obs"].shape == (16, 3) and batch["step"].dtype == jnp.int32
    assert set(np.asarray(batch["step"]).tolist()) <= {3, 4, 5, 6, 7}  # FIFO: the last 5

    def item_update_fn(item):
        return {"obs": item["obs"] * 2, "step": item["step"]}

    buffer_state = jax.jit(buffer.update_fn, static_argnums=1)(buffer_state, item_update_fn)
    batch = buffer.sample_fn(buffer_state, jax.random.PRNGKey(1), 16)
    np.testing.assert_array_equal(batch["obs"][:, 0], 2 * np.asarray(batch["step"]))


def test_readme_donated_train_step():
    buffer = dejax.uniform_replay(max_size=1000)

    def train_step(train_state, replay_buffer_state, trajectory_batch, rng):
        replay_buffer_state = buffer.add_batch_fn(replay_buffer_state, trajectory_batch)
        batch = buffer.sample_fn(replay_buffer_state, rng, 32)
        return train_state + batch["obs"].mean(), replay_buffer_state

    step = jax.jit(train_step, donate_argnums=(1,))
    train_state, state = jnp.zeros(()), buffer.init_fn(PROTO)
    pointer = state.storage.data["obs"].unsafe_buffer_pointer()
    for i in range(3):
        old = state.storage.data["obs"]
        train_state, state = step(train_state, state, make_items(8 * i, 8), jax.random.key(i))
        assert old.is_deleted()  # donated: updated in place
        assert state.storage.data["obs"].unsafe_buffer_pointer() == pointer
    assert int(buffer.size_fn(state)) == 24


def test_buffer_object_passes_through_jit_as_an_argument():
    buffer = dejax.uniform_replay(max_size=4)
    assert jax.tree.leaves(buffer) == []  # a pytree without leaves, as dejax's was

    @jax.jit
    def step(buffer, state, items):
        state = buffer.add_batch_fn(state, items)
        return buffer, state, buffer.size_fn(state)

    same, state, size = step(buffer, buffer.init_fn(PROTO), make_items(0, 3))
    assert same.add_fn.func is buffer.add_fn.func and int(size) == 3
    # The functions themselves are pytrees too (`jax.tree_util.Partial`).
    assert int(jax.jit(lambda f, s: f(s))(buffer.size_fn, state)) == 3


# ---------------------------------------------------------------------------------------------
# Uniform replay: FIFO contents, batches equal single adds, sampling.


@pytest.mark.parametrize("max_size, n", [(5, 3), (5, 12), (1, 4)])
def test_uniform_add_batch_equals_adds_and_keeps_the_newest(max_size, n):
    buffer = dejax.uniform_replay(max_size)
    batched = jax.jit(buffer.add_batch_fn)(buffer.init_fn(PROTO), make_items(0, n))
    single = buffer.init_fn(PROTO)
    for k in range(n):
        single = buffer.add_fn(single, make_item(k))
    assert_tree_equal(to_numpy(batched), to_numpy(single))
    model = RefUniformReplay(max_size)
    model.add_batch(list(range(n)))
    assert steps_of(buffer, batched) == model.contents()
    assert int(buffer.size_fn(batched)) == model.size


def test_uniform_sampling_is_uniform_over_stored_items():
    buffer = dejax.uniform_replay(8)
    state = buffer.add_batch_fn(buffer.init_fn(PROTO), make_items(0, 13))
    steps = jax.jit(buffer.sample_fn, static_argnums=2)(state, jax.random.key(0), 40_000)["step"]
    counts = np.bincount(np.asarray(steps) - 5, minlength=8)
    assert counts.sum() == 40_000 and len(counts) == 8  # only steps 5..12 are stored
    # Chi-square against 1/8 each: fails with probability 1e-6 for a correct sampler.
    assert_frequencies(counts, np.full(8, 1 / 8), alpha=1e-6)


def test_scan_over_add_fn_as_dejax_add_batch_did():
    buffer = dejax.uniform_replay(4)
    scanned, _ = jax.lax.scan(
        lambda s, item: (buffer.add_fn(s, item), None), buffer.init_fn(PROTO), make_items(0, 6)
    )
    batched = buffer.add_batch_fn(buffer.init_fn(PROTO), make_items(0, 6))
    assert_tree_equal(to_numpy(scanned), to_numpy(batched))


def test_numpy_items_get_the_dtypes_jit_would_give_them():
    # Environments hand out float64 NumPy arrays; with x64 off, jit makes them float32, and
    # eager calls agree. A different kind (float into int) is still refused.
    buffer = dejax.uniform_replay(4)
    state = buffer.init_fn({"obs": np.zeros(3)})  # float64 prototype: float32 storage, as dejax
    assert state.storage.data["obs"].dtype == jnp.float32
    eager = buffer.add_fn(state, {"obs": np.ones(3)})
    jitted = jax.jit(buffer.add_fn)(state, {"obs": np.ones(3)})
    assert_tree_equal(to_numpy(eager), to_numpy(jitted))
    eager = buffer.add_batch_fn(eager, {"obs": np.ones((2, 3))})
    assert int(buffer.size_fn(eager)) == 3
    with pytest.raises(TypeError, match="has dtype int32, expected float32"):
        buffer.add_fn(state, {"obs": np.ones(3, np.int64)})


# ---------------------------------------------------------------------------------------------
# circular_buffer: init, max_size, size, push, pop, get_at_index (0 = oldest).


def test_circular_buffer_functions_match_the_model():
    cb = dejax.circular_buffer
    buf = cb.init(PROTO, 3)
    assert cb.max_size(buf) == 3 and isinstance(cb.max_size(buf), int)
    model = RefCircularBuffer(3)
    push, pop = jax.jit(cb.push), jax.jit(cb.pop)
    for k in range(5):
        buf = push(buf, make_item(k))
        model.push(k)
        assert int(cb.size(buf)) == model.size
    assert [int(cb.get_at_index(buf, i)["step"]) for i in range(3)] == list(model.items)
    item, buf = pop(buf)
    assert int(item["step"]) == model.pop() == 2
    assert int(cb.get_at_index(buf, jnp.asarray(0))["step"]) == 3
    assert int(cb.size(buf)) == 2


def test_circular_buffer_eager_errors_are_value_errors():
    cb = dejax.circular_buffer
    empty = cb.init(PROTO, 2)
    with pytest.raises(ValueError, match="There are no items in storage"):
        cb.pop(empty)
    buf = cb.push(empty, make_item(7))
    item, buf = cb.pop(buf)
    with pytest.raises(ValueError, match="There are no items in storage"):
        cb.pop(buf)
    buf = cb.push(buf, make_item(8))
    for index in [-1, 1, 2, jnp.asarray(5)]:
        with pytest.raises(ValueError, match="Index out of bounds"):
            cb.get_at_index(buf, index)


# Plain jax.jit, as dejax users wrote it, and the checkify wrappers dejax made them add. JAX
# reports a fault in a jax.jit-compiled call as a JaxRuntimeError (a RuntimeError) or, from its
# cached fast path, as a ValueError; both carry the message.
FAULT = (RuntimeError, ValueError)
TRANSFORMS = {
    "jit": lambda f: jax.jit(f),
    "checkify(jit)": lambda f: checkify.checkify(jax.jit(f)),
    "jit(checkify)": lambda f: jax.jit(checkify.checkify(f)),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_faults_are_reported_under_jit_with_or_without_checkify(transform):
    wrap = TRANSFORMS[transform]
    cb = dejax.circular_buffer
    buffer = dejax.uniform_replay(1)
    pop, get = wrap(cb.pop), wrap(cb.get_at_index)
    sample = wrap(lambda s, k: buffer.sample_fn(s, k, 2))
    empty = cb.init(PROTO, 1)
    one = cb.push(empty, make_item(1))  # one slot: the index guard must survive
    # Each is called first without a fault, so that the faulty call takes JAX's cached path.
    pop(one)
    get(one, jnp.asarray(0))
    sample(buffer.add_fn(buffer.init_fn(PROTO), make_item(1)), jax.random.key(0))
    with pytest.raises(FAULT, match="cannot pop from an empty CircularBuffer"):
        pop(empty)
    for index in [1, -1]:
        with pytest.raises(FAULT, match="index out of range"):
            get(one, jnp.asarray(index))
    with pytest.raises(FAULT, match="cannot sample from an empty UniformReplay"):
        sample(buffer.init_fn(PROTO), jax.random.key(0))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_code_without_faults_runs_under_jit_with_or_without_checkify(transform):
    wrap = TRANSFORMS[transform]
    buffer = dejax.uniform_replay(4)

    def step(state, items, rng):
        state = buffer.add_batch_fn(state, items)
        return state, buffer.sample_fn(state, rng, 3)

    out = wrap(step)(buffer.init_fn(PROTO), make_items(0, 2), jax.random.key(0))
    if transform != "jit":
        error, out = out
        error.throw()  # no fault: nothing raised
    state, batch = out
    assert int(buffer.size_fn(state)) == 2 and batch["step"].shape == (3,)


# ---------------------------------------------------------------------------------------------
# clustered_replay.


def clustering_fn(item):
    return item["step"] % 2


def test_clustered_replay_balances_clusters():
    buffer = dejax.clustered_replay(2, dejax.uniform_replay(100), clustering_fn)
    state = buffer.init_fn(PROTO)
    # Eight even steps and two odd ones: each cluster is drawn half of the time.
    steps = jnp.asarray([0, 2, 4, 6, 8, 10, 12, 14, 1, 3], jnp.int32)
    state = jax.jit(buffer.add_batch_fn)(state, {"obs": jnp.zeros((10, 3)), "step": steps})
    state = buffer.add_fn(state, make_item(16))
    assert int(buffer.size_fn(state)) == 11
    batch = jax.jit(buffer.sample_fn, static_argnums=2)(state, jax.random.key(0), 20_000)
    odd = int((batch["step"] % 2).sum())
    # Chi-square over the two clusters: fails with probability 1e-6 for a correct sampler.
    assert_frequencies([20_000 - odd, odd], [0.5, 0.5], alpha=1e-6)
    assert set(np.asarray(batch["step"]).tolist()) <= {0, 2, 4, 6, 8, 10, 12, 14, 16, 1, 3}


def test_clustered_sampling_takes_any_batch_size():
    # dejax 0.1.3 refused a batch of 3 from two equal clusters (1.5 rows each rounds to 2 + 2).
    buffer = dejax.clustered_replay(2, dejax.uniform_replay(10), clustering_fn)
    state = buffer.add_batch_fn(buffer.init_fn(PROTO), make_items(0, 4))
    batch = jax.jit(buffer.sample_fn, static_argnums=2)(state, jax.random.key(0), 3)
    assert batch["step"].shape == (3,)


def test_clustered_state_holds_a_clustered_replay_with_the_power():
    buffer = dejax.clustered_replay(3, dejax.uniform_replay(4), clustering_fn, 1.0)
    state = jax.jit(buffer.update_fn, static_argnums=1)(
        buffer.add_batch_fn(buffer.init_fn(PROTO), make_items(0, 5)),
        lambda item: {"obs": item["obs"], "step": item["step"] + 100},
    )
    replay = state.module
    assert isinstance(replay, dx.ClusteredReplay) and replay.distribution_power == 1.0
    assert replay.cluster_sizes.tolist() == [3, 2, 0]
    clusters = cast(dx.UniformReplay, replay.clusters)  # stacked, one per cluster
    assert sorted(np.asarray(clusters.storage.data["step"])[:2, :2].ravel()) == [
        100,
        101,
        102,
        103,
    ]


def test_clustered_errors():
    buffer = dejax.clustered_replay(2, dejax.uniform_replay(10), clustering_fn)
    with pytest.raises(ValueError, match="Cannot sample from an empty buffer"):
        buffer.sample_fn(buffer.init_fn(PROTO), jax.random.key(0), 4)
    # dejax dropped an item whose cluster id was out of range; here it is an error.
    three = dejax.clustered_replay(2, dejax.uniform_replay(10), lambda item: item["step"])
    with pytest.raises(RuntimeError, match="cluster id outside"):
        three.add_fn(three.init_fn(PROTO), make_item(2))
    with pytest.raises(TypeError, match="cluster_buffer=...\\)` must be a buffer|parameter"):
        dejax.clustered_replay(2, "uniform", clustering_fn)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="num_clusters=...\\)` must be positive"):
        dejax.clustered_replay(0, dejax.uniform_replay(10), clustering_fn)
    with pytest.raises(ValueError, match="max_size=...\\)` must be positive"):
        dejax.uniform_replay(0)


def test_uniform_eager_sample_error():
    buffer = dejax.uniform_replay(3)
    with pytest.raises(ValueError, match="Cannot sample from an empty buffer"):
        buffer.sample_fn(buffer.init_fn(PROTO), jax.random.key(0), 4)


# ---------------------------------------------------------------------------------------------
# The examples of the compat layer's docstrings run as written (those of the docs pages and of
# `dejax_eqx`'s own docstrings run in test_docs.py).

EXAMPLES = {
    "uniform_replay": lambda: dejax.uniform_replay.__doc__,
    "clustered_replay": lambda: dejax.clustered_replay.__doc__,
    "circular_buffer.CircularBuffer": lambda: dejax.circular_buffer.CircularBuffer.__doc__,
}


@pytest.mark.parametrize("name", rotation(list(EXAMPLES), 0, keep=1))
def test_examples_run(name):
    doc = EXAMPLES[name]()
    assert doc is not None
    blocks = python_blocks(doc)
    assert blocks
    for block in blocks:
        exec(compile(block, name, "exec"), {})
