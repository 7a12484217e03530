import inspect
import re
import textwrap

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant, precondition, rule, RuleBasedStateMachine

from .helpers import (
    assert_frequencies,
    assert_tree_equal,
    bump,
    enable_x64,
    machine_tests,
    random_batch,
    random_item,
    rotation,
    SLOW,
    SPECS,
    to_numpy,
    unstack,
)
from .reference import (
    AllZeroError,
    BadPriorityError,
    EmptyBufferError,
    ref_importance_weights,
    RefPrioritisedReplay,
)


ALPHA = 0.6
SAMPLE = 16
# Priorities: zeros (never drawn), small, ordinary and large ones.
PRIORITIES = [0.0, 1e-3, 0.25, 1.0, 2.0, 5.0, 40.0]
INVALID = {"negative": -1.0, "nan": np.nan, "inf": np.inf}

_add = eqx.filter_jit(lambda r, x: r.add(x))
_add_p = eqx.filter_jit(lambda r, x, p: r.add(x, p))
_add_batch = eqx.filter_jit(lambda r, x: r.add_batch(x))
_add_batch_p = eqx.filter_jit(lambda r, x, p: r.add_batch(x, p))
_add_batch_m = eqx.filter_jit(lambda r, x, m: r.add_batch(x, mask=m))
_add_batch_pm = eqx.filter_jit(lambda r, x, p, m: r.add_batch(x, p, mask=m))
_set_priorities = eqx.filter_jit(lambda r, i, p: r.set_priorities(i, p))
_set_stamped = eqx.filter_jit(
    lambda r, i, p, g: (r.set_priorities(i, p, generations=g), r.stale(i, g))
)
_update = eqx.filter_jit(lambda r: r.update(bump))
_sample = eqx.filter_jit(lambda r, key: r.sample(key, SAMPLE))


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def _slot(replay: dx.PrioritisedReplay, i: int):
    return jax.tree.map(lambda x: np.asarray(x[i]), replay.storage.data)


def _probabilities(model: RefPrioritisedReplay) -> np.ndarray:
    try:
        return model.probabilities()
    except (EmptyBufferError, AllZeroError):
        return np.zeros(model.max_size)


class PrioritisedReplayMachine(RuleBasedStateMachine):
    """Random adds, priority updates, item updates and samples against the model."""

    @initialize(
        spec_name=st.sampled_from(["dict", "namedtuple"]),
        max_size=st.sampled_from([1, 3, 8]),
        seed=st.integers(0, 2**32 - 1),
    )
    def init(self, spec_name, max_size, seed):
        self.spec = SPECS[spec_name]
        self.rng = np.random.default_rng(seed)
        self.replay = dx.PrioritisedReplay(self.spec, max_size, ALPHA)
        self.model = RefPrioritisedReplay(max_size, ALPHA)
        self.key = jax.random.key(seed)
        self.samples: list = []  # (indices, generations) of the latest samples, oldest first

    def _priorities(self, data, n):
        return _f32(data.draw(st.lists(st.sampled_from(PRIORITIES), min_size=n, max_size=n)))

    @rule(data=st.data(), with_priority=st.booleans())
    def add(self, data, with_priority):
        item = random_item(self.spec, self.rng)
        if with_priority:
            priority = self._priorities(data, 1)[0]
            self.replay = _add_p(self.replay, item, priority)
            self.model.add(item, priority)
        else:
            self.replay = _add(self.replay, item)
            self.model.add(item)

    @rule(
        data=st.data(),
        n=st.sampled_from([0, 4, 9]),
        with_priorities=st.booleans(),
        with_mask=st.booleans(),
    )
    def add_batch(self, data, n, with_priorities, with_mask):
        items = random_batch(self.spec, n, self.rng)
        priorities = self._priorities(data, n)
        mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
        if with_mask:
            # Masked-out items may carry any priority: it is neither checked nor recorded.
            priorities = np.where(mask, priorities, np.nan).astype(np.float32)
        kept = [i for i in range(n) if mask[i] or not with_mask]
        if with_priorities and with_mask:
            self.replay = _add_batch_pm(self.replay, items, priorities, mask)
        elif with_priorities:
            self.replay = _add_batch_p(self.replay, items, priorities)
        elif with_mask:
            self.replay = _add_batch_m(self.replay, items, mask)
        else:
            self.replay = _add_batch(self.replay, items)
        self.model.add_batch(
            [unstack(items, n)[i] for i in kept],
            [priorities[i] for i in kept] if with_priorities else None,
        )

    @precondition(lambda self: self.model.size > 0)
    @rule(data=st.data(), n=st.sampled_from([1, 5]))
    def set_priorities(self, data, n):
        # Narrow ranges make duplicates (the last one wins) likely.
        high = data.draw(st.sampled_from([1, self.model.size])) - 1
        indices = data.draw(st.lists(st.integers(0, high), min_size=n, max_size=n))
        indices = np.asarray(indices, np.int32)
        priorities = self._priorities(data, n)
        self.replay = _set_priorities(self.replay, indices, priorities)
        self.model.set_priorities(indices, priorities)

    @rule(
        data=st.data(),
        fault=st.sampled_from(["index below", "index above", "negative", "nan", "inf"]),
    )
    def set_priorities_invalid(self, data, fault):
        indices = np.zeros(5, np.int32)
        priorities = _f32([1.0] * 5)
        position = data.draw(st.integers(0, 4))
        if fault == "index below":
            indices[position] = -1
        elif fault == "index above":
            indices[position] = self.model.size  # the first slot not stored
        else:
            priorities[position] = INVALID[fault]
        if fault.startswith("index") or self.model.size == 0:
            match, error = "index out of range", IndexError
        else:
            match, error = "priorities must be finite and non-negative", BadPriorityError
        with pytest.raises(RuntimeError, match=match):
            _set_priorities(self.replay, indices, priorities)
        with pytest.raises(error):
            self.model.set_priorities(indices, priorities)

    @rule(fault=st.sampled_from(sorted(INVALID)), n=st.sampled_from([4]))
    def add_batch_invalid(self, fault, n):
        priorities = _f32([1.0] * n)
        priorities[-1] = INVALID[fault]
        with pytest.raises(RuntimeError, match="priorities must be finite and non-negative"):
            _add_batch_p(self.replay, random_batch(self.spec, n, self.rng), priorities)

    @precondition(lambda self: self.model.size > 0)
    @rule()
    def update(self):
        self.replay = _update(self.replay)
        self.model.update(lambda item: to_numpy(bump(item)))

    @rule()
    def sample(self):
        self.key, key = jax.random.split(self.key)
        try:
            expected = self.model.probabilities()
        except EmptyBufferError:
            with pytest.raises(RuntimeError, match="cannot sample from an empty"):
                _sample(self.replay, key)
            return
        except AllZeroError:
            with pytest.raises(
                RuntimeError, match="every stored item has priority 0; none can be drawn"
            ):
                _sample(self.replay, key)
            return
        s = _sample(self.replay, key)
        indices = np.asarray(s.indices)
        # Exact support: only stored slots of positive priority are drawn.
        assert (expected[indices] > 0).all(), (indices, expected)
        np.testing.assert_allclose(np.asarray(s.probabilities), expected[indices], rtol=1e-5)
        for row, i in zip(unstack(s.items, SAMPLE), indices):
            assert_tree_equal(row, self.model.items[i])
        assert s.generations.dtype == jnp.uint32
        assert s.generations.tolist() == [self.model.generations[i] for i in indices]
        self.samples = [*self.samples[-2:], (indices, np.asarray(s.generations))]

    @precondition(lambda self: self.samples)
    @rule(data=st.data())
    def set_priorities_of_an_earlier_sample(self, data):
        # A learner that updates priorities a few steps after sampling (pipelined or async):
        # the slots written since must keep the priorities of their new items.
        indices, generations = data.draw(st.sampled_from(self.samples), label="sample")
        priorities = self._priorities(data, SAMPLE)
        self.replay, stale = _set_stamped(self.replay, indices, priorities, generations)
        assert stale.tolist() == self.model.stale(indices, generations)
        self.model.set_priorities(indices, priorities, generations)

    @invariant()
    def same_state(self):
        assert int(self.replay.size) == self.model.size
        assert self.replay.generations.tolist() == self.model.generations
        assert float(self.replay.max_priority) == self.model.max_priority
        np.testing.assert_allclose(
            np.asarray(self.replay.tree.leaves), self.model.masses(), rtol=1e-6
        )
        for i in range(self.model.size):
            assert_tree_equal(_slot(self.replay, i), self.model.items[i])


TestPrioritisedReplayMachine, TestPrioritisedReplayMachineFull = machine_tests(
    PrioritisedReplayMachine
)


def _labelled(max_size: int, num_adds: int, **kwargs) -> dx.PrioritisedReplay:
    """A replay whose k-th added item (from 0) is the int32 label k."""
    replay = dx.PrioritisedReplay(jnp.zeros((), jnp.int32), max_size, **kwargs)
    return replay.add_batch(jnp.arange(num_adds, dtype=jnp.int32))


def _priorities_with_zeros(max_size: int) -> np.ndarray:
    rng = np.random.default_rng(42)
    p = rng.choice(np.asarray([0.0, 0.5, 1.0, 3.0, 10.0], np.float32), size=max_size)
    p[:3] = [0.0, 0.5, 10.0]
    return p.astype(np.float32)


def _model_for(max_size, num_adds, priorities, alpha) -> RefPrioritisedReplay:
    model = RefPrioritisedReplay(max_size, alpha)
    model.add_batch(list(range(num_adds)))
    model.set_priorities(np.arange(max_size), priorities)
    return model


@pytest.mark.parametrize("alpha", rotation([0.0, 0.6, 1.0], 1, keep=1))
def test_sampling_frequencies_match_the_model(alpha):
    max_size, num_adds, draws = 40, 97, 200_000
    priorities = _priorities_with_zeros(max_size)
    replay = _labelled(max_size, num_adds, priority_exponent=alpha)
    replay = replay.set_priorities(jnp.arange(max_size), priorities)
    s = eqx.filter_jit(lambda r, k: r.sample(k, draws))(replay, jax.random.key(7))
    model = _model_for(max_size, num_adds, priorities, alpha)
    expected = model.probabilities()
    indices = np.asarray(s.indices)
    # Each slot holds the item the model says it holds.
    np.testing.assert_array_equal(np.asarray(s.items), np.asarray(model.items)[indices])
    np.testing.assert_allclose(np.asarray(s.probabilities), expected[indices], rtol=1e-5)
    # Chi-square goodness of fit of P(i) = p_i^alpha / sum p^alpha; zero-priority slots never
    # drawn. A correct sampler fails with probability 1e-6.
    counts = np.bincount(indices, minlength=max_size)
    assert_frequencies(counts, expected, alpha=1e-6)


def test_frequency_test_rejects_the_wrong_exponent():
    # The test above can fail: the same draws are rejected against alpha = 1 probabilities.
    max_size, num_adds = 40, 97
    priorities = _priorities_with_zeros(max_size)
    replay = _labelled(max_size, num_adds, priority_exponent=0.6)
    replay = replay.set_priorities(jnp.arange(max_size), priorities)
    s = eqx.filter_jit(lambda r, k: r.sample(k, 200_000))(replay, jax.random.key(7))
    counts = np.bincount(np.asarray(s.indices), minlength=max_size)
    wrong = _model_for(max_size, num_adds, priorities, 1.0).probabilities()
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(counts, wrong)


def test_stratified_sampling():
    max_size, num_adds, batch, rounds = 40, 97, 64, 3000
    priorities = _priorities_with_zeros(max_size)
    replay = _labelled(max_size, num_adds, priority_exponent=ALPHA, stratified=True)
    replay = replay.set_priorities(jnp.arange(max_size), priorities)
    keys = jax.random.split(jax.random.key(3), rounds)
    s = eqx.filter_jit(eqx.filter_vmap(lambda k, r: r.sample(k, batch), in_axes=(0, None)))(
        keys, replay
    )
    model = _model_for(max_size, num_adds, priorities, ALPHA)
    expected = model.probabilities()
    indices = np.asarray(s.indices)  # [rounds, batch]
    # Draw j lands in the j-th slice of the cumulative mass: the item's interval overlaps
    # [j / batch, (j + 1) / batch) (within rounding).
    upper = np.cumsum(expected)
    lower = upper - expected
    j = np.arange(batch)[None, :]
    tol = 1e-5
    assert (lower[indices] <= (j + 1) / batch + tol).all()
    assert (upper[indices] >= j / batch - tol).all()
    # Marginally each draw is distributed as P(i). Stratified counts vary less than
    # multinomial ones, so this chi-square test fails a correct sampler with probability
    # at most 1e-6.
    counts = np.bincount(indices.ravel(), minlength=max_size)
    assert_frequencies(counts, expected, alpha=1e-6)
    np.testing.assert_allclose(np.asarray(s.probabilities), expected[indices], rtol=1e-5)


def test_new_items_get_the_largest_priority_recorded():
    replay = dx.PrioritisedReplay(jnp.zeros(()), 10, priority_exponent=1.0)
    replay = replay.add_batch(jnp.zeros(3))
    assert replay.tree.leaves[:3].tolist() == [1.0, 1.0, 1.0]  # 1.0 at first
    replay = replay.set_priorities(jnp.array([0, 1]), jnp.array([0.5, 4.0]))
    replay = replay.set_priorities(jnp.array([1]), jnp.array([0.1]))
    replay = replay.add(jnp.zeros(()))
    assert float(replay.max_priority) == 4.0  # recorded, although slot 1 is now 0.1
    assert replay.tree.leaves[:4].tolist() == pytest.approx([0.5, 0.1, 1.0, 4.0])
    replay = replay.add_batch(jnp.zeros(2), jnp.array([7.0, 2.0]))
    replay = replay.add(jnp.zeros(()), 0.25)
    replay = replay.add(jnp.zeros(()))
    assert replay.tree.leaves[4:8].tolist() == pytest.approx([7.0, 2.0, 0.25, 7.0])
    # Overwritten slots take the new item's priority.
    replay = replay.add_batch(jnp.zeros(3))
    assert replay.tree.leaves.tolist() == pytest.approx([7.0, 0.1, 1, 4, 7, 2, 0.25, 7, 7, 7])


def test_masked_set_priorities_sets_and_checks_only_the_kept_entries():
    replay = _labelled(4, 4, priority_exponent=1.0)
    indices = jnp.array([1, 9, 2, 1, -1, 3])  # 9 and -1 hold nothing, but are masked out
    priorities = jnp.array([5.0, 2.0, jnp.nan, 6.0, -1.0, 0.5])
    mask = jnp.array([True, False, False, True, False, True])
    masked = eqx.filter_jit(lambda r, i, p, m: r.set_priorities(i, p, mask=m))
    replay = masked(replay, indices, priorities, mask)
    assert replay.tree.leaves.tolist() == [1.0, 6.0, 1.0, 0.5]  # slot 1: the last kept entry
    assert float(replay.max_priority) == 6.0  # masked-out priorities are not recorded
    with pytest.raises(RuntimeError, match="index out of range"):
        masked(replay, indices, priorities.at[1].set(1.0), mask.at[1].set(True))
    with pytest.raises(RuntimeError, match="priorities must be finite"):
        masked(replay, indices, priorities, mask.at[2].set(True))


# Eager 64-bit edge case: CI's slow tier.
@SLOW
def test_set_priorities_checks_indices_in_their_own_dtype():
    with enable_x64(True):
        replay = dx.PrioritisedReplay(jnp.zeros(()), 4).add_batch(jnp.zeros(3))
        # 2**32 + 1 would wrap to the stored slot 1 in int32.
        with pytest.raises(RuntimeError, match="index out of range"):
            replay.set_priorities(np.array([2**32 + 1], np.int64), jnp.array([1.0]))


# Zero priorities are never drawn in the default tier by the machine and the frequency tests;
# with exponent 0 too, in the slow tier.
@SLOW
def test_zero_priority_is_never_drawn_even_with_exponent_zero():
    replay = _labelled(5, 5, priority_exponent=0.0)
    replay = replay.set_priorities(jnp.arange(5), jnp.array([0.0, 1e-6, 3.0, 0.0, 100.0]))
    s = replay.sample(jax.random.key(0), 30_000)
    assert set(np.asarray(s.indices).tolist()) == {1, 2, 4}
    np.testing.assert_allclose(np.asarray(s.probabilities), 1 / 3, rtol=1e-6)


def test_importance_weights():
    p = np.asarray([0.5, 0.1, 0.02, 0.1], np.float32)
    for beta in [0.0, 0.4, 1.0]:
        w = dx.importance_weights(jnp.asarray(p), 20, beta)
        assert w.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(w), ref_importance_weights(p, 20, beta), rtol=1e-6)
    # Tiny probabilities do not overflow.
    w = dx.importance_weights(jnp.array([1e-30, 0.5]), jnp.asarray(10, jnp.int32), 1.0)
    np.testing.assert_allclose(np.asarray(w), [1.0, 2e-30], rtol=1e-5)
    # From a sample: traced size and beta.
    replay = _labelled(8, 8).set_priorities(jnp.arange(8), jnp.arange(8.0))
    s = replay.sample(jax.random.key(0), 32)
    w = eqx.filter_jit(dx.importance_weights)(s.probabilities, replay.size, jnp.asarray(0.5))
    expected = ref_importance_weights(np.asarray(s.probabilities), 8, 0.5)
    np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-5)
    with pytest.raises(RuntimeError, match="probabilities must be positive"):
        dx.importance_weights(jnp.array([0.5, 0.0]), 2, 1.0)
    with pytest.raises(TypeError, match="floating dtype|parameter"):
        dx.importance_weights(jnp.array([1, 2]), 2, 1.0)


def test_errors():
    replay = dx.PrioritisedReplay(jnp.zeros(()), 4)
    with pytest.raises(RuntimeError, match="cannot sample from an empty PrioritisedReplay"):
        replay.sample(jax.random.key(0), 2)
    replay = replay.add_batch(jnp.zeros(2), jnp.zeros(2))
    with pytest.raises(RuntimeError, match="every stored item has priority 0; none can be drawn"):
        replay.sample(jax.random.key(0), 2)
    with pytest.raises(RuntimeError, match="index out of range"):
        replay.set_priorities(jnp.array([2]), jnp.array([1.0]))  # slot 2 holds nothing yet
    with pytest.raises(RuntimeError, match=r"`PrioritisedReplay.add`: priorities must be"):
        replay.add(jnp.zeros(()), -1.0)
    # The total mass overflows float32: 1e30 ** 2 is inf.
    big = dx.PrioritisedReplay(jnp.zeros(()), 4, priority_exponent=2.0)
    big = big.add_batch(jnp.zeros(2), jnp.array([1e30, 1.0]))
    with pytest.raises(RuntimeError, match="total priority mass"):
        big.sample(jax.random.key(0), 2)


@pytest.mark.parametrize("jit", rotation([False, True], 1, keep=1))
def test_errors_on_a_one_slot_replay(jit):
    # A gather from a one-slot buffer ignores its index: the guards must still hold.
    wrap = eqx.filter_jit if jit else (lambda f: f)
    replay = dx.PrioritisedReplay(jnp.zeros(()), 1)
    with pytest.raises(RuntimeError, match="empty"):
        wrap(lambda r: r.sample(jax.random.key(0), 3).items)(replay)
    replay = replay.add(jnp.ones(()))
    with pytest.raises(RuntimeError, match="index out of range"):
        wrap(lambda r: r.set_priorities(jnp.array([1]), jnp.array([1.0])).tree)(replay)
    with pytest.raises(RuntimeError, match="priorities must be"):
        wrap(lambda r: r.set_priorities(jnp.array([0]), jnp.array([-1.0])).tree)(replay)
    s = wrap(lambda r: r.sample(jax.random.key(0), 3))(replay)
    assert s.indices.tolist() == [0, 0, 0] and s.probabilities.tolist() == [1.0, 1.0, 1.0]


def test_constructor_and_argument_validation():
    item = jnp.zeros(())
    with pytest.raises(ValueError, match="finite and non-negative"):
        dx.PrioritisedReplay(item, 4, priority_exponent=-0.5)
    with pytest.raises(ValueError, match="finite and non-negative"):
        dx.PrioritisedReplay(item, 4, priority_exponent=float("nan"))
    with pytest.raises(TypeError, match="Python float|parameter"):
        dx.PrioritisedReplay(item, 4, priority_exponent=True)
    with pytest.raises(TypeError, match="must be a bool|parameter"):
        dx.PrioritisedReplay(item, 4, stratified=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="at most"):
        dx.PrioritisedReplay(item, 2**30 + 1)
    with pytest.raises(ValueError, match="float32 or float64"):
        dx.PrioritisedReplay(item, 4, dtype=jnp.float16)
    replay = dx.PrioritisedReplay(item, 4).add_batch(jnp.zeros(3))
    with pytest.raises(
        (ValueError, TypeError), match=r"add_batch`: `priorities` has shape|parameter"
    ):
        replay.add_batch(jnp.zeros(3), jnp.ones(2))
    with pytest.raises(TypeError, match="floating or integer dtype|parameter"):
        replay.add_batch(jnp.zeros(3), jnp.ones(3, bool))
    with pytest.raises(TypeError, match="integer dtype|parameter"):
        replay.set_priorities(jnp.array([0.0]), jnp.array([1.0]))
    with pytest.raises((ValueError, TypeError), match="expected a scalar|parameter"):
        replay.add(jnp.zeros(()), jnp.ones(2))
    with pytest.raises(ValueError, match="must be positive"):
        replay.sample(jax.random.key(0), 0)
    # Integer priorities are accepted and converted.
    replay = replay.set_priorities(jnp.array([0, 1]), jnp.array([3, 0], jnp.int32))
    assert replay.tree.leaves[:2].tolist() == pytest.approx([3**0.6, 0.0])


# Eager 64-bit edge cases: CI's slow tier (tests/helpers.py).
@SLOW
def test_float64_replay():
    with enable_x64(True):
        replay = dx.PrioritisedReplay(jnp.zeros(()), 4, dtype=jnp.float64)
        replay = replay.add_batch(jnp.zeros(3), jnp.array([1e-200, 1.0, 0.0]))
        s = replay.sample(jax.random.key(0), 8)
        assert s.probabilities.dtype == jnp.float64 and replay.max_priority.dtype == jnp.float64
        assert set(s.indices.tolist()) <= {0, 1}


ITEM = {"obs": jnp.zeros((4,), jnp.float32), "action": jnp.zeros((), jnp.int32)}


def _items(n, start=0):
    return {
        "obs": jnp.arange(start, start + 4 * n, dtype=jnp.float32).reshape(n, 4),
        "action": jnp.arange(start, start + n, dtype=jnp.int32),
    }


# Scans of every buffer type: tests/test_transforms.py; this one, in the slow tier.
@SLOW
def test_scan_carry_equals_python_loop():
    def body(replay, xs):
        items, key = xs
        replay, s = replay.add_and_sample(items, key, 5)
        replay = replay.set_priorities(s.indices, s.items["obs"][:, 1] + 1.0)
        return replay, s

    n_steps = 6
    items = jax.tree.map(lambda x: x.reshape(n_steps, 3, *x.shape[1:]), _items(3 * n_steps))
    keys = jax.random.split(jax.random.key(0), n_steps)
    replay0 = dx.PrioritisedReplay(ITEM, 10, stratified=True)
    scanned, samples = eqx.filter_jit(jax.lax.scan)(body, replay0, (items, keys))
    replay = replay0
    step = eqx.filter_jit(body)
    for t in range(n_steps):
        replay, s = step(replay, jax.tree.map(lambda x: x[t], (items, keys)))
        assert_tree_equal(jax.tree.map(lambda x: x[t], samples), s)
    assert_tree_equal(to_numpy(scanned), to_numpy(replay))


@SLOW
def test_vmapped_draw_from_empty_replays_does_not_raise():
    # As ClusteredReplay does: draw from every copy, empty ones included, keep some rows.
    replays = eqx.filter_vmap(lambda p: dx.PrioritisedReplay(p, 5), in_axes=None, axis_size=3)(ITEM)
    replays = eqx.filter_vmap(lambda r, x, m: r.add_batch(x, mask=m))(
        replays,
        jax.tree.map(lambda x: jnp.stack([x] * 3), _items(2)),
        jnp.array([[True, True], [False, False], [True, False]]),
    )
    keys = jax.random.split(jax.random.key(0), 3)
    s = eqx.filter_jit(eqx.filter_vmap(lambda r, k: r.sample_unchecked(k, 4)))(replays, keys)
    probabilities = np.asarray(s.probabilities)
    assert np.isfinite(probabilities).all()
    assert (probabilities[1] == 0).all() and (probabilities[2] == 1).all()
    # Under vmap the message is that of a faulty replay, not of a healthy one.
    with pytest.raises(RuntimeError, match="cannot sample from an empty"):
        eqx.filter_jit(eqx.filter_vmap(lambda r, k: r.sample(k, 4)))(replays, keys)
    # Sizes 3, 1, 2 after one more item each.
    replays = eqx.filter_vmap(lambda r, x: r.add(x))(
        replays, jax.tree.map(lambda x: jnp.stack([x[0]] * 3), _items(1))
    )
    set_priorities = eqx.filter_jit(eqx.filter_vmap(lambda r, i, p: r.set_priorities(i, p)))
    indices = jnp.array([[0, 1], [0, 0], [0, 0]])
    with pytest.raises(RuntimeError, match="priorities must be finite"):
        set_priorities(replays, indices, jnp.array([[1.0, 1.0], [1.0, -1.0], [1.0, 1.0]]))
    with pytest.raises(RuntimeError, match="index out of range"):
        set_priorities(replays, indices.at[1, 1].set(1), jnp.ones((3, 2)))


# In place: every buffer's donated step in tests/test_transforms.py (default tier); this loop's
# HLO, in the slow tier.
@SLOW
def test_training_loop_never_copies_the_tree_or_the_items():
    # Donation only shows that the result reuses the input's memory; a copy of the whole tree
    # inside every step of a loop would go unnoticed. Count copies in the compiled program.
    capacity = 5003  # makes the array shapes recognisable
    replay = dx.PrioritisedReplay(ITEM, capacity).add_batch(_items(100))

    def run(replay, key):
        def step(replay, key):
            s = replay.sample(key, 64)
            w = dx.importance_weights(s.probabilities, replay.size, 0.5)
            return replay.set_priorities(s.indices, w * s.items["obs"][:, 0] ** 2 + 0.1), None

        return jax.lax.scan(step, replay, jax.random.split(key, 4))[0]

    hlo = jax.jit(run, donate_argnums=0).lower(replay, jax.random.key(0)).compile().as_text()
    assert hlo is not None
    big = {replay.tree.nodes.shape[0], capacity}
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"\bcopy\(", line)
        and any(re.search(rf"\[{n}[,\]]", line.split("copy(")[0]) for n in big)
    ]
    assert not copies, copies


# The blocks tests/test_docs.py's test_snippet_runs runs (a rotation of the docstrings in the
# default tier, every one in the slow tier).
@SLOW
@pytest.mark.parametrize("obj", [dx.SumTree, dx.PrioritisedReplay, dx.importance_weights])
def test_docstring_examples_run(obj):
    blocks = re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", re.S)
    assert blocks
    for block in blocks:
        exec(textwrap.dedent(block), {})


def test_stale_priority_updates_are_dropped_and_counted():
    # Sample slots 0..3 of a full replay of 4, then add 2 items (slots 0 and 1 rewritten, new
    # items at priority 5): a delayed update of the sample must leave slots 0 and 1 alone.
    replay = dx.PrioritisedReplay({"x": jnp.zeros(())}, 4, 1.0)
    replay = replay.add_batch({"x": jnp.arange(4.0)}, _f32([1.0, 1.0, 1.0, 1.0]))
    indices = np.arange(4, dtype=np.int32)
    generations = replay.generations[indices]
    replay = replay.add_batch({"x": jnp.asarray([10.0, 11.0])}, _f32([5.0, 5.0]))
    update = _f32([0.25, 0.5, 2.0, 3.0])
    stale = replay.stale(indices, generations)
    assert stale.tolist() == [True, True, False, False] and int(jnp.sum(stale)) == 2
    kept = replay.set_priorities(indices, update, generations=generations)
    assert kept.tree.leaves.tolist() == [5.0, 5.0, 2.0, 3.0]
    # Without generations the update would hit the new items: what the generations prevent.
    assert replay.set_priorities(indices, update).tree.leaves.tolist() == update.tolist()
    # A batch that writes a slot twice counts once; a masked-out item writes nothing.
    gens = replay.add_batch({"x": jnp.arange(6.0)}, mask=np.asarray([1, 1, 1, 1, 1, 0], bool))
    assert (gens.generations - replay.generations).tolist() == [1, 1, 1, 1]
    # Stale entries are still checked.
    with pytest.raises(RuntimeError, match="priorities must be finite"):
        replay.set_priorities(indices, _f32([np.nan, 1, 1, 1]), generations=generations)
    with pytest.raises(RuntimeError, match="index out of range"):
        replay.set_priorities(np.asarray([4], np.int32), _f32([1.0]), generations=generations[:1])
    with pytest.raises(RuntimeError, match="index out of range"):
        replay.stale(np.asarray([4], np.int32), generations[:1])


def test_generations_must_be_what_sample_returned():
    replay = dx.PrioritisedReplay({"x": jnp.zeros(())}, 4).add({"x": jnp.ones(())})
    s = replay.sample(jax.random.key(0), 3)
    assert s.generations.dtype == jnp.uint32 and s.generations.tolist() == [1, 1, 1]
    for bad, error, match in [
        (np.asarray(s.generations, np.int32), TypeError, "dtype int32, expected uint32"),
        (s.generations[:2], ValueError, r"shape \(2,\), expected \(3,\)"),
        ([1, 1, 1], TypeError, "must be the uint32 array a sample returned"),
    ]:
        for call in (
            lambda: replay.set_priorities(s.indices, _f32([1, 1, 1]), generations=bad),
            lambda: replay.stale(s.indices, bad),
        ):
            with pytest.raises((error, Exception), match=f"{match}|parameter 'generations'"):
                call()


# A deprecated form: CI's slow tier.
@SLOW
def test_deprecated_stamps_still_work_with_a_warning():
    # `PrioritisedSample.stamps` and `set_priorities(stamps=...)`: the old names of
    # `generations`, for one release.
    replay = dx.PrioritisedReplay({"x": jnp.zeros(())}, 4, 1.0)
    replay = replay.add_batch({"x": jnp.arange(4.0)}, _f32([1.0, 1.0, 1.0, 1.0]))
    s = replay.sample(jax.random.key(0), 4)
    with pytest.warns(DeprecationWarning, match=r"`PrioritisedSample.stamps` is deprecated"):
        stamps = s.stamps
    assert stamps.dtype == jnp.uint32 and stamps.tolist() == s.generations.tolist()
    replay = replay.add({"x": jnp.asarray(10.0)}, 5.0)  # slot 0 rewritten
    update = _f32([2.0, 2.0, 2.0, 2.0])
    indices = np.arange(4, dtype=np.int32)
    generations = replay.generations.at[0].add(-1)  # slot 0 as sampled before the add
    want = replay.set_priorities(indices, update, generations=generations)
    with pytest.warns(DeprecationWarning, match=r"set_priorities\(stamps=...\)` is deprecated"):
        old = replay.set_priorities(indices, update, stamps=generations)
    assert old.tree.leaves.tolist() == want.tree.leaves.tolist() == [5.0, 2.0, 2.0, 2.0]
    with pytest.raises(TypeError, match="pass `generations` only"):
        replay.set_priorities(indices, update, generations=generations, stamps=generations)


def test_sequence_priorities_match_a_loop():
    rng = np.random.default_rng(5)
    td = rng.standard_normal((64, 7)).astype(np.float32) * 3
    mask = rng.random((64, 7)) < 0.6
    mask[0] = False  # a row with nothing to learn from
    for eta in [0.0, 0.9, 1.0]:
        got = np.asarray(jax.jit(dx.sequence_priorities, static_argnums=2)(td, mask, eta))
        want = [
            eta * np.abs(row[m]).max() + (1 - eta) * np.abs(row[m]).mean() if m.any() else 0.0
            for row, m in zip(td, mask)
        ]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert got.dtype == np.float32
    td_f, mask_b = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
    with pytest.raises(Exception, match=r"eta=...\)` must be in \[0, 1\]|parameter 'eta'"):
        dx.sequence_priorities(td_f, mask_b, 1.5)
    with pytest.raises(Exception, match="must both have shape|jaxtyping"):
        dx.sequence_priorities(td_f, mask_b[:, :2])
    with pytest.raises(Exception, match="must be a bool array|parameter 'mask'"):
        dx.sequence_priorities(td_f, jnp.ones((2, 3)))
    with pytest.raises(Exception, match="must have a floating dtype|parameter 'td_errors'"):
        dx.sequence_priorities(jnp.zeros((2, 3), jnp.int32), mask_b)


# ---------------------------------------------------------------------------------------------
# Numeric arguments are converted from their own dtype: nothing wraps, nothing overflows unseen


def test_priorities_are_not_wrapped_on_the_way_to_float():
    # Without 64-bit mode `jnp.asarray` wraps an int64 2**32 to 0: the item would get mass 0
    # and never be drawn.
    big = 2.0**32
    replay = dx.PrioritisedReplay(jnp.zeros(()), 4, priority_exponent=1.0)
    replay = replay.add(jnp.zeros(()), np.int64(2**32))
    replay = replay.add_batch(jnp.zeros(1), np.array([2**32], np.int64))
    replay = replay.add(jnp.zeros(()), 2**40)  # a Python int past int32: no OverflowError
    replay = replay.add_batch(jnp.zeros(1))
    replay = replay.set_priorities(np.array([3], np.int64), np.array([2**33], np.int64))
    assert replay.tree.leaves.tolist() == [big, big, 2.0**40, 2.0**33]
    assert float(replay.max_priority) == 2.0**40


def test_priorities_too_large_for_the_tree_are_refused_by_name():
    replay = dx.PrioritisedReplay(jnp.zeros(()), 4).add_batch(jnp.zeros(2))
    too_large = "holds a finite value too large for float32"
    for call, run in [
        ("`PrioritisedReplay.add`: `priority`", lambda: replay.add(jnp.zeros(()), 10**400)),
        ("`PrioritisedReplay.add`: `priority`", lambda: replay.add(jnp.zeros(()), 1e39)),
        (
            "`PrioritisedReplay.add_batch`: `priorities`",
            lambda: replay.add_batch(jnp.zeros(1), np.array([1e39])),
        ),
        (
            "`PrioritisedReplay.set_priorities`: `priorities`",
            lambda: replay.set_priorities(np.array([0]), np.array([-1e39])),
        ),
    ]:
        with pytest.raises(RuntimeError, match=re.escape(f"{call} {too_large}")):
            run()
    # A masked-out entry may hold anything, a value too large for the tree included.
    masked = replay.set_priorities(
        np.array([0, 1]), np.array([1e39, 3.0]), mask=np.array([False, True])
    )
    assert masked.tree.leaves.tolist()[:2] == [1.0, pytest.approx(3.0**ALPHA, rel=1e-6)]


def test_importance_weights_take_beta_and_size_in_their_own_dtype():
    p = jnp.array([0.1, 0.4])
    # beta = 2**32, not 0 (which would make every weight 1): the heavier item's weight is 0.
    for beta in [np.int64(2**32), np.array(2**32, np.int64)]:
        assert dx.importance_weights(p, 10, beta).tolist() == [1.0, 0.0]
    # size = 2**32 + 5, not 5 (after normalising, N cancels: the weights are the same).
    w = dx.importance_weights(p, np.array(2**32 + 5, np.int64), 1.0)
    np.testing.assert_allclose(np.asarray(w), [1.0, 0.25], rtol=1e-6)
    with pytest.raises(RuntimeError, match=re.escape("`importance_weights`: `beta` holds")):
        dx.importance_weights(p, 10, np.array(1e39))


# An edge case of sequence_priorities (test_sequence_priorities_match_a_loop): the slow tier.
@SLOW
def test_sequence_priorities_do_not_overflow_where_the_answer_fits():
    # float16 holds 60000, but a float16 sum of four of them is inf.
    td = jnp.full((2, 4), 60000.0, jnp.float16).at[1].set(-65504.0)
    p = dx.sequence_priorities(td, jnp.ones((2, 4), bool), eta=0.5)
    assert p.dtype == jnp.float16 and p.tolist() == [60000.0, 65504.0]
    # The largest float32, and a mix: never above the largest error, never inf.
    top = float(np.finfo(np.float32).max)
    p = dx.sequence_priorities(
        jnp.array([[top, top, top], [top, 0.0, -top]]), jnp.ones((2, 3), bool)
    )
    assert np.isfinite(np.asarray(p)).all() and float(p[0]) == top
    np.testing.assert_allclose(float(p[1]), top * (0.9 + 0.1 * 2 / 3), rtol=1e-6)
    # An inf or NaN error still gives an inf or NaN priority (refused by `set_priorities`).
    p = dx.sequence_priorities(jnp.array([[jnp.inf, 1.0], [jnp.nan, 1.0]]), jnp.ones((2, 2), bool))
    assert float(p[0]) == np.inf and np.isnan(float(p[1]))
    # A float64 NumPy error too large for float32 (the dtype JAX gives it) is refused.
    with pytest.raises(RuntimeError, match=re.escape("`sequence_priorities`: `td_errors` holds")):
        dx.sequence_priorities(np.array([[1e39, 1.0]]), np.ones((1, 2), bool))
