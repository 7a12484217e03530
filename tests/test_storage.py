import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx._storage import ring_add, ring_sub
from hypothesis.stateful import initialize, invariant, rule

from .helpers import (
    assert_tree_equal,
    machine_tests,
    random_batch,
    rotation,
    SPECS,
    to_numpy,
    unstack,
)
from .machines import ItemRules
from .reference import EmptyBufferError, RefCircularBuffer


MAX_SIZES = [1, 2, 3, 5, 8]
# Batch lengths: empty, smaller than, equal to and (several times) larger than the capacities.
BATCH_SIZES = [0, 1, 2, 3, 5, 7, 13, 17]

_get = eqx.filter_jit(lambda cb, i: cb.get(i))


class CircularBufferMachine(ItemRules):
    """Random operation sequences through `CircularBuffer` and the model, side by side."""

    add_one, add_many = "push", "push_batch"
    batch_sizes = tuple(BATCH_SIZES)

    @initialize(
        spec_name=st.sampled_from(sorted(SPECS)),
        max_size=st.sampled_from(MAX_SIZES),
        jit=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def init(self, spec_name, max_size, jit, seed):
        spec = SPECS[spec_name]
        self.jit = jit
        self.start(spec, seed, dx.CircularBuffer(spec, max_size), RefCircularBuffer(max_size))

    @rule()
    def pop(self):
        try:
            expected = self.model.pop()
        except EmptyBufferError:
            with pytest.raises(RuntimeError, match="cannot pop from an empty CircularBuffer"):
                self.call("pop")
        else:
            item, self.buffer = self.call("pop")
            assert_tree_equal(item, expected, "pop")

    @rule(index=st.integers(-2, 9))
    def get(self, index):
        try:
            expected = self.model.get(index)
        except IndexError:
            with pytest.raises(RuntimeError, match="index out of range"):
                self.call("get", jnp.asarray(index, jnp.int32))
        else:
            assert_tree_equal(self.call("get", jnp.asarray(index, jnp.int32)), expected)

    @invariant()
    def same_state(self):
        m = self.model
        assert int(self.buffer.size) == m.size
        assert bool(self.buffer.is_full) == m.is_full
        assert bool(self.buffer.is_empty) == m.is_empty
        # Bounded ring indices: the write position stays in [0, max_size).
        assert 0 <= int(self.buffer.head) < self.buffer.max_size
        for i, expected in enumerate(m.items):
            assert_tree_equal(_get(self.buffer, jnp.asarray(i, jnp.int32)), expected, f"get({i})")


TestCircularBufferMachine, TestCircularBufferMachineFull = machine_tests(CircularBufferMachine)


def test_docstring_example():
    cb = dx.CircularBuffer({"x": jnp.zeros(2)}, max_size=3)
    cb = cb.push_batch({"x": jnp.arange(8.0).reshape(4, 2)})
    item, cb = cb.pop()
    assert item["x"].tolist() == [2.0, 3.0]
    assert int(cb.size) == 2
    assert cb.get(0)["x"].tolist() == [4.0, 5.0]
    assert cb.get(1)["x"].tolist() == [6.0, 7.0]


@pytest.mark.parametrize("max_size", rotation([1, 4, 7], 1, keep=1))
def test_push_batch_equals_pushes(max_size):
    # Also when the batch wraps around the ring several times, from every starting head.
    rng = np.random.default_rng(max_size)
    spec = SPECS["dict"]
    for start in range(max_size + 1):
        for n in [1, max_size - 1, max_size, max_size + 1, 3 * max_size + 2]:
            if n < 1:
                continue
            base = dx.CircularBuffer(spec, max_size).push_batch(random_batch(spec, start, rng))
            items = random_batch(spec, n, rng)
            one = base.push_batch(items)
            many = base
            for item in unstack(items, n):
                many = many.push(item)
            assert_tree_equal(to_numpy(one), to_numpy(many), f"start={start} n={n}")


def test_update_leaves_empty_slots_alone():
    cb = dx.CircularBuffer(jnp.zeros((), jnp.float32), max_size=4)
    cb = cb.push_batch(jnp.asarray([1.0, 2.0, 3.0]))
    _, cb = cb.pop()  # slots 1, 2 hold items; slots 0 and 3 are empty
    cb = cb.update(lambda x: x + 10)
    assert cb.data.tolist() == [1.0, 12.0, 13.0, 0.0]


def test_ring_indices_stay_bounded_after_many_pushes():
    # The state after 2**31 + 5 pushes into a buffer of 7 slots is reached by construction
    # (pushing that many is too slow), then pushed further: nothing overflows int32.
    cb = dx.CircularBuffer(jnp.zeros((), jnp.int32), max_size=7)
    cb = eqx.tree_at(
        lambda b: (b.head, b.count),
        cb,
        (jnp.asarray((2**31 + 5) % 7, jnp.int32), jnp.asarray(7, jnp.int32)),
    )
    for _ in range(20):
        cb = cb.push_batch(jnp.arange(5, dtype=jnp.int32))
        assert 0 <= int(cb.head) < 7 and int(cb.size) == 7


def test_ring_arithmetic_near_int32_limit():
    m = 2**31 - 1
    a = jnp.asarray([0, m - 1, m - 1, 5, m - 3], jnp.int32)
    b = jnp.asarray([m, 1, m - 1, 3, 2], jnp.int32)
    expected = [(int(x) + int(y)) % m for x, y in zip(a, b)]
    assert ring_add(a, b, m).tolist() == expected
    expected = [(int(x) - int(y)) % m for x, y in zip(a, b)]
    assert ring_sub(a, b, m).tolist() == expected


def test_python_scalars_and_numpy_arrays_are_accepted():
    cb = dx.CircularBuffer({"r": jnp.zeros((), jnp.float32), "a": np.zeros(2, np.int32)}, 2)
    cb = cb.push({"r": 1.5, "a": np.asarray([1, 2], np.int32)})
    item = cb.get(0)
    assert item["r"].dtype == jnp.float32 and float(item["r"]) == 1.5
    assert item["a"].dtype == jnp.int32 and item["a"].tolist() == [1, 2]


def test_prototype_python_scalars_become_arrays():
    cb = dx.CircularBuffer({"r": 0.0, "a": 0, "d": False}, 3)
    dtypes = {k: v.dtype for k, v in cb.item_spec.items()}
    assert dtypes == {"r": jnp.float32, "a": jnp.int32, "d": jnp.bool_}
    assert all(not leaf.weak_type for leaf in jax.tree.leaves(cb.data))
