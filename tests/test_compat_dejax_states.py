"""dejax's state fields on the compat layer's states, against a model of dejax's own ring.

dejax 0.1.3 kept a circular buffer as `data`, `head`, `tail`, `full`: a push writes slot `head`
and advances it (dragging `tail` along when the ring was full), `full` is set when `head`
catches up with `tail`, and a pop reads slot `tail`, advances it and clears `full`.
`DejaxRing` below is that algorithm in NumPy; the states must agree with it field by field.
"""

import dejax_eqx as dx
import dejax_eqx.compat.dejax as dejax
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from .helpers import assert_tree_equal, to_numpy


PROTO = {"obs": jnp.zeros(2, jnp.float32), "step": jnp.zeros((), jnp.int32)}


def make_item(k):
    return {"obs": jnp.full(2, k, jnp.float32), "step": jnp.asarray(k, jnp.int32)}


def make_items(steps):
    steps = jnp.asarray(steps, jnp.int32)
    return {"obs": jnp.repeat(steps[:, None].astype(jnp.float32), 2, axis=1), "step": steps}


class DejaxRing:
    """dejax 0.1.3's circular buffer (head, tail, full), on the `step` labels of the items."""

    def __init__(self, max_size):
        self.max_size = max_size
        self.data = np.zeros(max_size, np.int32)
        self.head, self.tail, self.full = 0, 0, False

    @property
    def size(self):
        if self.full:
            return self.max_size
        return (self.head - self.tail) % self.max_size

    def push(self, step):
        self.data[self.head] = step
        self.head = (self.head + 1) % self.max_size
        if self.full:
            self.tail = self.head
        self.full = self.head == self.tail

    def pop(self):
        step = self.data[self.tail]
        self.tail = (self.tail + 1) % self.max_size
        self.full = False
        return step


def assert_ring_fields(ring, model):
    """The dejax fields of a circular-buffer state (or a stack of them at `index`) match."""
    assert int(ring.head) == model.head
    assert int(ring.tail) == model.tail
    assert bool(ring.full) == model.full
    np.testing.assert_array_equal(np.asarray(ring.data["step"]), model.data)
    assert ring.head.dtype == jnp.int32 and ring.full.dtype == jnp.bool_


cb = dejax.circular_buffer
PUSH, POP = jax.jit(cb.push), jax.jit(cb.pop)


@given(
    max_size=st.sampled_from([1, 2, 3, 5]),
    ops=st.lists(st.one_of(st.just("pop"), st.integers(1, 99)), max_size=14),
)
def test_circular_buffer_fields_follow_dejax(max_size, ops):
    ring, model = cb.init(PROTO, max_size), DejaxRing(max_size)
    assert_ring_fields(ring, model)
    for op in ops:
        if op == "pop":
            if model.size == 0:
                continue
            item, ring = POP(ring)
            assert int(item["step"]) == model.pop()
        else:
            ring = PUSH(ring, make_item(op))
            model.push(op)
        assert_ring_fields(ring, model)
        assert int(cb.size(ring)) == model.size
        # dejax's size, computed from dejax's fields the way dejax did.
        full, head, tail = bool(ring.full), int(ring.head), int(ring.tail)
        assert int(cb.size(ring)) == (max_size if full else (head - tail) % max_size)


@pytest.mark.parametrize("max_size, steps", [(4, [1, 2, 3]), (3, [1, 2, 3, 4, 5, 6, 7]), (1, [5])])
def test_uniform_storage_fields_follow_dejax(max_size, steps):
    buffer = dejax.uniform_replay(max_size)
    model = DejaxRing(max_size)
    single = buffer.init_fn(PROTO)
    for k in steps:
        single = buffer.add_fn(single, make_item(k))
        model.push(k)
    batched = jax.jit(buffer.add_batch_fn)(buffer.init_fn(PROTO), make_items(steps))
    for state in [single, batched]:
        assert isinstance(state, dejax.uniform.UniformReplayBufferState)
        assert isinstance(state.storage, dejax.circular_buffer.CircularBuffer)
        assert_ring_fields(state.storage, model)
    # The storage state works with dejax's circular-buffer functions, as dejax's did.
    oldest = cb.get_at_index(batched.storage, 0)
    assert int(oldest["step"]) == model.data[model.tail]


def cluster_of(item):
    return (item["step"] >= 10).astype(jnp.int32)


def test_clustered_fields_follow_dejax():
    cluster_buffer = dejax.uniform_replay(3)
    buffer = dejax.clustered_replay(2, cluster_buffer, cluster_of, 0.5)
    steps = [1, 11, 2, 12, 13, 14, 3]
    state = jax.jit(buffer.add_batch_fn)(buffer.init_fn(PROTO), make_items(steps))
    models = [DejaxRing(3), DejaxRing(3)]
    for k in steps:
        models[int(k >= 10)].push(k)

    batch = state.cluster_state_batch
    assert isinstance(batch, dejax.uniform.UniformReplayBufferState)
    assert batch.storage.head.shape == (2,) and batch.storage.data["obs"].shape == (2, 3, 2)
    for c, model in enumerate(models):
        assert_ring_fields(jax.tree.map(lambda x: x[c], batch.storage), model)
    # dejax's idioms on these fields: sizes per cluster through the cluster buffer, one
    # cluster's state by indexing the stack.
    sizes = jax.vmap(state.cluster_buffer.size_fn)(state.cluster_state_batch)
    assert sizes.tolist() == [m.size for m in models]
    one = dejax.utils.get_pytree_batch_item(state.cluster_state_batch, 1)
    assert int(state.cluster_buffer.size_fn(one)) == 3 and bool(one.storage.full)

    assert state.cluster_buffer == cluster_buffer
    assert int(state.clustering_fn(make_item(12))) == 1
    assert isinstance(state.clustering_fn, jax.tree_util.Partial)
    assert state.distribution_power == 0.5


def test_nested_clustered_fields():
    inner = dejax.clustered_replay(2, dejax.uniform_replay(4), cluster_of)
    buffer = dejax.clustered_replay(3, inner, lambda item: item["step"] % 3)
    state = buffer.add_batch_fn(buffer.init_fn(PROTO), make_items([0, 1, 2, 10, 11, 12, 3]))
    assert state.cluster_buffer == inner
    batch = state.cluster_state_batch
    assert isinstance(batch, dejax.clustered.ClusteredReplayBufferState)
    assert batch.cluster_state_batch.storage.head.shape == (3, 2)
    # Outer cluster 0 holds steps 0, 3 (inner cluster 0) and 12 (inner cluster 1).
    assert batch.cluster_state_batch.storage.head[0].tolist() == [2, 1]
    assert int(buffer.size_fn(state)) == 7


def test_equal_arguments_give_equal_buffers():
    assert dejax.uniform_replay(3) == dejax.uniform_replay(3)
    assert dejax.uniform_replay(3) != dejax.uniform_replay(4)
    a = dejax.clustered_replay(2, dejax.uniform_replay(3), cluster_of, 1.0)
    assert a == dejax.clustered_replay(2, dejax.uniform_replay(3), cluster_of, 1.0)
    assert a != dejax.clustered_replay(2, dejax.uniform_replay(3), cluster_of, 0.0)
    assert hash(a.init_fn.func) == hash(
        dejax.clustered_replay(2, dejax.uniform_replay(3), cluster_of, 1.0).init_fn.func
    )
    # So jitted code that takes the buffer as an argument compiles once for equal buffers.
    traces = []

    @jax.jit
    def size(buffer, state):
        traces.append(None)
        return buffer.size_fn(state)

    state = dejax.uniform_replay(3).init_fn(PROTO)
    size(dejax.uniform_replay(3), state)
    size(dejax.uniform_replay(3), state)
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------
# The states are pytrees of exactly the module's arrays: jit (donated), scan, vmap.


def test_states_have_the_modules_leaves():
    buffer = dejax.clustered_replay(2, dejax.uniform_replay(3), cluster_of)
    state = buffer.init_fn(PROTO)
    assert isinstance(state.module, dx.ClusteredReplay)
    assert all(
        a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state.module), strict=True)
    )
    ring = cb.init(PROTO, 3)
    assert isinstance(ring.module, dx.CircularBuffer) and ring.data is ring.module.data


def test_donated_jit_updates_a_clustered_state_in_place():
    buffer = dejax.clustered_replay(2, dejax.uniform_replay(8), cluster_of)

    def step(state, items, key):
        state = buffer.add_batch_fn(state, items)
        return state, buffer.sample_fn(state, key, 4)

    step = jax.jit(step, donate_argnums=(0,))
    state = buffer.init_fn(PROTO)
    pointer = state.cluster_state_batch.storage.data["obs"].unsafe_buffer_pointer()
    batch = None
    for i in range(3):
        old = state.cluster_state_batch.storage.data["obs"]
        state, batch = step(state, make_items([i, 10 + i]), jax.random.key(i))
        assert old.is_deleted()
        assert state.cluster_state_batch.storage.data["obs"].unsafe_buffer_pointer() == pointer
    assert state.cluster_state_batch.storage.head.tolist() == [3, 3]
    assert batch is not None
    assert batch["step"].shape == (4,)


def test_vmap_over_a_stack_of_states():
    buffer = dejax.uniform_replay(3)
    states = dejax.utils.stack_trees(*[buffer.init_fn(PROTO) for _ in range(4)])
    items = make_items(jnp.arange(4 * 5).reshape(4, 5).T.ravel())  # row t: step t of each
    items = jax.tree.map(lambda x: x.reshape(5, 4, *x.shape[1:]), items)

    def run(state, own):  # five adds to one buffer
        state, _ = jax.lax.scan(lambda s, item: (buffer.add_fn(s, item), None), state, own)
        return state

    states = jax.vmap(run, in_axes=(0, 1))(states, items)
    assert states.storage.head.tolist() == [2, 2, 2, 2]
    assert states.storage.tail.tolist() == [2, 2, 2, 2]
    assert states.storage.full.tolist() == [True] * 4
    assert jax.vmap(buffer.size_fn)(states).tolist() == [3, 3, 3, 3]
    # Buffer b was given steps 5b .. 5b + 4 and keeps the last three, the oldest in slot 2.
    second = dejax.utils.get_pytree_batch_item(states, 1)
    assert np.asarray(second.storage.data["step"]).tolist() == [8, 9, 7]


def test_functions_take_the_module_as_well_as_the_state():
    buffer = dejax.uniform_replay(3)
    replay = dx.UniformReplay(PROTO, 3).add(make_item(4))
    state = buffer.add_fn(replay, make_item(5))
    assert isinstance(state, dejax.uniform.UniformReplayBufferState)
    assert int(buffer.size_fn(replay)) == 1 and int(buffer.size_fn(state)) == 2
    ring = cb.push(dx.CircularBuffer(PROTO, 2), make_item(1))
    assert isinstance(ring, cb.CircularBuffer) and int(ring.head) == 1
    # (With the tests' beartype hook, the annotation refuses it before the function does.)
    with pytest.raises(TypeError, match="circular_buffer.push"):
        cb.push(buffer.init_fn(PROTO), make_item(1))
    with pytest.raises(TypeError, match="`add_fn` takes a state"):
        buffer.add_fn(cb.init(PROTO, 3), make_item(1))


# ---------------------------------------------------------------------------------------------
# dejax's other importable helpers.


def test_make_default_add_batch_fn_equals_add_batch_fn():
    buffer = dejax.uniform_replay(3)
    scanned = dejax.base.make_default_add_batch_fn(buffer.add_fn)
    items = make_items([1, 2, 3, 4, 5])
    assert_tree_equal(
        to_numpy(jax.jit(scanned)(buffer.init_fn(PROTO), items)),
        to_numpy(buffer.add_batch_fn(buffer.init_fn(PROTO), items)),
    )


def test_uniform_sample_draws_stored_items():
    ring = cb.init(PROTO, 4)
    for k in [1, 2, 3, 4, 5]:
        ring = cb.push(ring, make_item(k))
    batch = jax.jit(dejax.uniform.uniform_sample, static_argnums=2)(ring, jax.random.key(0), 400)
    assert set(np.asarray(batch["step"]).tolist()) == {2, 3, 4, 5}
    with pytest.raises(ValueError, match="Cannot sample from an empty buffer"):
        dejax.uniform.uniform_sample(cb.init(PROTO, 4), jax.random.key(0), 3)


def test_utils():
    utils = dejax.utils
    for value, dtype in [(3, jnp.int32), (2.5, jnp.float32), (True, jnp.bool_)]:
        x = utils.scalar_to_jax(value)
        assert x.shape == () and x.dtype == dtype and x.item() == value
    with pytest.raises(TypeError, match="scalar"):
        utils.scalar_to_jax(np.zeros(()))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="Unsupported type"):
        utils.type_to_dtype(str)
    assert utils.tile_over_axis(jnp.arange(3), axis=0, size=2).tolist() == [[0, 1, 2]] * 2
    tree = {"a": jnp.zeros((4, 2)), "b": jnp.zeros(4, jnp.int32)}
    assert utils.get_pytree_axis_dim(tree, axis=0) == 4
    with pytest.raises(ValueError, match="share axis 1"):
        utils.get_pytree_axis_dim({"a": jnp.zeros((4, 2)), "b": jnp.zeros((4, 3))}, axis=1)
    tree = utils.set_pytree_batch_item(tree, 2, {"a": jnp.ones(2), "b": jnp.asarray(7)})
    assert utils.get_pytree_batch_item(tree, 2)["b"] == 7 and tree["a"][2].tolist() == [1, 1]
    with pytest.raises(AssertionError, match=r"\(2,\) != \(3,\)"):
        utils.set_pytree_batch_item(tree, 0, {"a": jnp.ones(3), "b": jnp.asarray(7)})
    parts = [{"a": jnp.full(2, float(i))} for i in range(3)]
    assert utils.stack_trees(*parts)["a"].shape == (3, 2)
    assert utils.concatenate_trees(*parts)["a"].tolist() == [0, 0, 1, 1, 2, 2]
    # On states too: a state's leaves are its arrays.
    stacked = utils.stack_trees(*[cb.init(PROTO, 2)] * 3)
    assert isinstance(stacked, cb.CircularBuffer) and stacked.tail.shape == (3,)
    assert isinstance(eqx.filter(stacked, eqx.is_array), cb.CircularBuffer)
