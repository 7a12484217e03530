"""The rules the buffers' hypothesis state machines share.

Each machine drives random operation sequences through a buffer and its NumPy model
(`tests/reference.py`) side by side. What they have in common lives here, once:

- `BufferMachine`: the state (`buffer`, `model`, `spec`, a NumPy `rng` and a JAX `key`, all from
  one seed), calls of the buffer's methods through jitted functions shared by every machine
  (compiled once per buffer configuration and argument shape) or eagerly, and mask drawing.
- `ItemRules`: `add`, `add_batch`, `add_batch_masked` and `update` of random items, applied to
  buffer and model alike (the method names are attributes, so `CircularBuffer`'s `push` and
  `push_batch` go through the same rules).
- `SampleSupportRule`: `sample` from the buffer either raises the empty-buffer error (the model
  is empty) or returns only stored items.

A machine overrides a rule by defining a method of the same name.
"""

import functools

import equinox as eqx
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis.stateful import precondition, rule, RuleBasedStateMachine

from .helpers import bump, random_batch, random_item, to_numpy, tree_equal, unstack


@functools.cache
def jitted_method(name: str):
    """`buffer.<name>(*args, **kwargs)`, jitted; one function for every buffer type."""
    return eqx.filter_jit(lambda buffer, *args, **kwargs: getattr(buffer, name)(*args, **kwargs))


def model_bump(item):
    """`bump` on a model's NumPy item."""
    return to_numpy(bump(item))


class BufferMachine(RuleBasedStateMachine):
    """State and helpers; no rules of its own."""

    jit = True  # call the buffer's methods jitted (else eagerly)

    def start(self, spec, seed: int, buffer, model) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.key = jax.random.key(seed)
        self.buffer = buffer
        self.model = model

    def call(self, name: str, *args, **kwargs):
        """`self.buffer.<name>(*args, **kwargs)`, jitted or eager as `self.jit` says."""
        if self.jit:
            return jitted_method(name)(self.buffer, *args, **kwargs)
        return getattr(self.buffer, name)(*args, **kwargs)

    def next_key(self):
        self.key, key = jax.random.split(self.key)
        return key

    @staticmethod
    def draw_mask(data, n: int) -> np.ndarray:
        return np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)


class ItemRules(BufferMachine):
    """Adding random items and updating stored ones, in the buffer and in the model."""

    add_one = "add"  # the buffer's and the model's method for one item
    add_many = "add_batch"  # ... and for a batch (with `mask=` on the buffer)
    batch_sizes: tuple[int, ...] = (0, 1, 4, 9)  # empty, smaller than and beyond the capacities

    @rule()
    def add(self):
        item = random_item(self.spec, self.rng)
        self.buffer = self.call(self.add_one, item)
        getattr(self.model, self.add_one)(item)

    @rule(data=st.data())
    def add_batch(self, data):
        n = data.draw(st.sampled_from(self.batch_sizes), label="n")
        items = random_batch(self.spec, n, self.rng)
        self.buffer = self.call(self.add_many, items)
        getattr(self.model, self.add_many)(unstack(items, n))

    @rule(data=st.data())
    def add_batch_masked(self, data):
        n = data.draw(st.sampled_from(self.batch_sizes), label="n")
        mask = self.draw_mask(data, n)
        items = random_batch(self.spec, n, self.rng)
        self.buffer = self.call(self.add_many, items, mask=mask)
        getattr(self.model, self.add_many)([x for x, m in zip(unstack(items, n), mask) if m])

    @precondition(lambda self: self.model.size > 0)
    @rule()
    def update(self):
        self.buffer = self.call("update", bump)
        self.model.update(model_bump)


class SampleSupportRule(BufferMachine):
    """Sampling either refuses an empty buffer or returns stored items only."""

    sample_size = 16
    empty_message = "cannot sample from an empty"

    @rule()
    def sample(self):
        key = self.next_key()
        if self.model.size == 0:
            with pytest.raises(RuntimeError, match=self.empty_message):
                self.call("sample", key, self.sample_size)
            return
        batch = self.call("sample", key, self.sample_size)
        stored = self.model.contents()
        # Every sampled row is one of the stored items (the support is exact).
        for row in unstack(batch, self.sample_size):
            assert any(tree_equal(row, item) for item in stored), row
