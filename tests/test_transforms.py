"""Buffers under the transformations a training loop uses: donation, scan, vmap, jit caching."""

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import assert_tree_equal, random_batch, SPECS, to_numpy


ITEM = {"obs": jnp.zeros((4,), jnp.float32), "action": jnp.zeros((), jnp.int32)}


def _items(n, start=0):
    return {
        "obs": jnp.arange(start, start + 4 * n, dtype=jnp.float32).reshape(n, 4),
        "action": jnp.arange(start, start + n, dtype=jnp.int32),
    }


@pytest.mark.parametrize("cls", [dx.UniformReplay, dx.CircularBuffer])
def test_donated_step_updates_in_place(cls):
    # The non-donated first argument holds the step's inputs; everything after it is donated,
    # and "warn" turns any donated buffer XLA could not reuse into a warning, which
    # `filterwarnings = error` makes a failure.
    @eqx.filter_jit(donate="warn-except-first")
    def step(inputs, buf):
        items, key = inputs
        if isinstance(buf, dx.CircularBuffer):
            return buf.push_batch(items)
        return buf.add_batch(items)

    buf = cls(ITEM, 1000)
    pointer = buf_obs(buf).unsafe_buffer_pointer()
    for i in range(5):
        old = buf_obs(buf)
        buf = step((_items(8, 8 * i), jax.random.key(i)), buf)
        assert old.is_deleted()
        assert buf_obs(buf).unsafe_buffer_pointer() == pointer
    assert int(buf.size) == 40


def buf_obs(buf):
    storage = buf if isinstance(buf, dx.CircularBuffer) else buf.storage
    return storage.data["obs"]


def test_donated_training_step_with_sample():
    @eqx.filter_jit(donate="warn-except-first")
    def step(inputs, buf):
        items, key = inputs
        buf, batch = buf.add_and_sample(items, key, 32)
        return buf, batch["obs"].sum()

    buf = dx.UniformReplay(ITEM, 1000)
    pointer = buf.storage.data["obs"].unsafe_buffer_pointer()
    for i in range(3):
        buf, _ = step((_items(16, i), jax.random.key(i)), buf)
    assert buf.storage.data["obs"].unsafe_buffer_pointer() == pointer


def test_donate_all_as_in_the_readme():
    @eqx.filter_jit(donate="all")
    def step(buf, items, key):
        buf = buf.add_batch(items)
        return buf, buf.sample(key, 8)

    buf = dx.UniformReplay(ITEM, 100)
    pointer = buf.storage.data["obs"].unsafe_buffer_pointer()
    buf, batch = step(buf, _items(4), jax.random.key(0))
    buf, batch = step(buf, _items(4, 100), jax.random.key(1))
    assert buf.storage.data["obs"].unsafe_buffer_pointer() == pointer
    assert batch["obs"].shape == (8, 4)


def test_scan_carry_equals_python_loop():
    def body(buf, xs):
        items, key = xs
        buf, batch = buf.add_and_sample(items, key, 5)
        return buf, batch

    n_steps = 6
    items = jax.tree.map(lambda x: x.reshape(n_steps, 3, *x.shape[1:]), _items(3 * n_steps))
    keys = jax.random.split(jax.random.key(0), n_steps)
    buf0 = dx.UniformReplay(ITEM, 10)
    scanned, batches = jax.lax.scan(body, buf0, (items, keys))

    buf = buf0
    for t in range(n_steps):
        buf, batch = body(buf, jax.tree.map(lambda x: x[t], (items, keys)))
        assert_tree_equal(jax.tree.map(lambda x: x[t], batches), batch)
    assert_tree_equal(to_numpy(scanned), to_numpy(buf))


def test_vmap_batch_of_buffers():
    num = 3

    @eqx.filter_vmap(in_axes=None, axis_size=num)
    def make(proto):
        return dx.UniformReplay(proto, 5)

    bufs = make(ITEM)
    assert bufs.storage.data["obs"].shape == (num, 5, 4)
    assert bufs.max_size == 5

    per_buffer = [_items(k + 2, 10 * k) for k in range(num)]
    # Different buffers receive different items; one vmapped add_batch of equal-length batches.
    batch = jax.tree.map(lambda *xs: jnp.stack([x[:2] for x in xs]), *per_buffer)
    bufs = eqx.filter_vmap(lambda b, x: b.add_batch(x))(bufs, batch)
    keys = jax.random.split(jax.random.key(0), num)
    samples = eqx.filter_vmap(lambda b, k: b.sample(k, 7))(bufs, keys)

    for k in range(num):
        single = dx.UniformReplay(ITEM, 5).add_batch(jax.tree.map(lambda x: x[:2], per_buffer[k]))
        assert_tree_equal(to_numpy(jax.tree.map(lambda x: x[k], bufs)), to_numpy(single))
        assert_tree_equal(jax.tree.map(lambda x: x[k], samples), single.sample(keys[k], 7))


def test_vmap_empty_buffer_error():
    bufs = eqx.filter_vmap(lambda p: dx.UniformReplay(p, 5), in_axes=None, axis_size=2)(ITEM)
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(RuntimeError, match="cannot sample from an empty UniformReplay"):
        eqx.filter_vmap(lambda b, k: b.sample(k, 3))(bufs, keys)


def test_same_shapes_compile_once():
    traces = []

    @eqx.filter_jit
    def step(buf, items, key):
        traces.append(None)
        buf = buf.add_batch(items)
        buf = buf.add(jax.tree.map(lambda x: x[0], items))
        return buf, buf.sample(key, 4)

    rng = np.random.default_rng(0)
    spec = SPECS["nested"]
    for max_size in [3, 3, 3]:
        buf = dx.UniformReplay(spec, max_size)  # a fresh buffer each time: same static config
        for i in range(4):
            buf, _ = step(buf, random_batch(spec, 2, rng), jax.random.key(i))
    # One trace in all: the buffer's counters keep their dtype (no weak types) across steps and
    # fresh buffers of the same configuration hash equal.
    assert len(traces) == 1
    step(dx.UniformReplay(spec, 4), random_batch(spec, 2, rng), jax.random.key(0))
    assert len(traces) == 2


def _every_buffer_type():
    item = {"obs": jnp.zeros(3), "reward": jnp.zeros(())}
    items = {"obs": jnp.ones((2, 3)), "reward": jnp.ones(2)}

    def cluster_of(item):
        return (item["reward"] > 0).astype(jnp.int32)

    return [
        (
            dx.CircularBuffer(item, 8),
            lambda b, k: (lambda b: (b, b.get(0)))(b.push_batch(items)),
        ),
        (dx.UniformReplay(item, 8), lambda b, k: b.add_and_sample(items, k, 4)),
        (
            dx.PrioritisedReplay(item, 8),
            lambda b, k: (lambda b: (b, b.sample(k, 4)))(b.add_batch(items)),
        ),
        (
            dx.ClusteredReplay(dx.UniformReplay(item, 4), 2, cluster_of),
            lambda b, k: (lambda b: (b, b.sample(k, 4)))(b.add_batch(items)),
        ),
        (
            dx.TrajectoryBuffer(item, 2, 8),
            lambda b, k: (lambda b: (b, b.sample(k, 4, 2)))(b.add(items)),
        ),
    ]


@pytest.mark.parametrize("index", range(5))
def test_every_buffer_is_a_pytree_of_arrays_for_plain_jax_jit(index):
    # The dispatch fast path of docs/jit-patterns.md: no `eqx.partition` needed for a buffer.
    buf, step = _every_buffer_type()[index]
    assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(buf)), type(buf).__name__
    jitted = jax.jit(step, donate_argnums=0)
    buf, _ = jitted(buf, jax.random.key(0))
    pointers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(buf)]
    for i in range(3):
        old = buf
        buf, _ = jitted(buf, jax.random.key(i))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))  # donated
    # The storage (the largest leaves) stays where it was: updated in place.
    big = max(range(len(pointers)), key=lambda i: jax.tree.leaves(buf)[i].size)
    assert jax.tree.leaves(buf)[big].unsafe_buffer_pointer() == pointers[big]
