import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import initialize, invariant

from .helpers import (
    assert_frequencies,
    assert_tree_equal,
    machine_tests,
    random_batch,
    SPECS,
    to_numpy,
)
from .machines import ItemRules, SampleSupportRule
from .reference import RefUniformReplay


_get = eqx.filter_jit(lambda r, i: r.storage.get(i))


class UniformReplayMachine(ItemRules, SampleSupportRule):
    """Random add / add_batch / update / sample sequences against the model."""

    batch_sizes = (0, 1, 4, 9)
    empty_message = "cannot sample from an empty UniformReplay"

    @initialize(
        spec_name=st.sampled_from(sorted(SPECS)),
        max_size=st.sampled_from([1, 3, 8]),
        seed=st.integers(0, 2**32 - 1),
    )
    def init(self, spec_name, max_size, seed):
        spec = SPECS[spec_name]
        self.start(spec, seed, dx.UniformReplay(spec, max_size), RefUniformReplay(max_size))

    @invariant()
    def same_contents(self):
        assert int(self.buffer.size) == self.model.size
        assert self.buffer.max_size == self.model.buffer.max_size
        for i, expected in enumerate(self.model.contents()):
            assert_tree_equal(_get(self.buffer, jnp.asarray(i, jnp.int32)), expected)


TestUniformReplayMachine, TestUniformReplayMachineFull = machine_tests(UniformReplayMachine)


def _labelled_replay(max_size: int, num_adds: int) -> dx.UniformReplay:
    """A replay whose item `k` (the k-th added, from 0) is the int32 label `k`."""
    replay = dx.UniformReplay(jnp.zeros((), jnp.int32), max_size)
    return replay.add_batch(jnp.arange(num_adds, dtype=jnp.int32))


@pytest.mark.parametrize(
    "max_size, num_adds",
    [
        (50, 30),  # partly full: slots 30..49 are empty and must never be drawn
        (50, 173),  # wrapped several times: only the last 50 labels are stored
        (1, 5),
    ],
)
def test_sampling_is_uniform_over_stored_items(max_size, num_adds):
    replay = _labelled_replay(max_size, num_adds)
    labels = eqx.filter_jit(lambda r, k: r.sample(k, 100_000))(replay, jax.random.key(1234))
    labels = np.asarray(labels)
    stored = np.arange(max(0, num_adds - max_size), num_adds)
    # Exact support: every draw is a stored label.
    assert np.isin(labels, stored).all()
    if len(stored) > 1:
        counts = np.bincount(labels - stored[0], minlength=len(stored))
        # Chi-square goodness of fit against the uniform distribution over stored items:
        # a correct sampler fails this with probability 1e-6.
        model = RefUniformReplay(max_size)
        model.add_batch(list(range(num_adds)))
        assert_frequencies(counts, model.probabilities(), alpha=1e-6)


def test_frequency_check_rejects_a_biased_sampler():
    # The statistical test above must be able to fail: a sampler that skips the oldest item
    # half of the time is rejected with the same number of draws.
    rng = np.random.default_rng(0)
    probs = np.full(50, 1 / 50)
    biased = probs.copy()
    biased[0] /= 2
    biased /= biased.sum()
    counts = np.bincount(rng.choice(50, size=100_000, p=biased), minlength=50)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_frequencies(counts, probs)
    # A draw of an outcome of probability zero fails at once, however few.
    assert counts[0] > 0
    with pytest.raises(AssertionError, match="probability zero"):
        assert_frequencies(counts, np.r_[0.0, np.full(49, 1 / 49)])


def test_sample_shapes_and_dtypes():
    spec = SPECS["nested"]
    replay = dx.UniformReplay(spec, 10).add_batch(random_batch(spec, 4, np.random.default_rng(0)))
    batch = replay.sample(jax.random.key(0), 7)
    expected = jax.tree.map(lambda s: ((7, *s.shape), s.dtype), spec)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), batch) == expected


def test_add_and_sample_equals_add_batch_then_sample():
    spec = SPECS["dict"]
    rng = np.random.default_rng(0)
    replay = dx.UniformReplay(spec, 6).add_batch(random_batch(spec, 3, rng))
    items = random_batch(spec, 5, rng)
    key = jax.random.key(7)
    new, batch = replay.add_and_sample(items, key, 9)
    expected = replay.add_batch(items)
    assert_tree_equal(to_numpy(new), to_numpy(expected))
    assert_tree_equal(batch, expected.sample(key, 9))


def test_sampling_a_fresh_key_gives_new_draws():
    replay = _labelled_replay(1000, 1000)
    a = replay.sample(jax.random.key(0), 64)
    b = replay.sample(jax.random.key(1), 64)
    assert not np.array_equal(a, b)
    # Raw uint32 keys work too.
    assert replay.sample(jax.random.PRNGKey(0), 3).shape == (3,)


def test_vmap_empty_buffer_error():
    bufs = eqx.filter_vmap(lambda p: dx.UniformReplay(p, 5), in_axes=None, axis_size=2)(
        {"obs": jnp.zeros((4,), jnp.float32), "action": jnp.zeros((), jnp.int32)}
    )
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(RuntimeError, match="cannot sample from an empty UniformReplay"):
        eqx.filter_vmap(lambda b, k: b.sample(k, 3))(bufs, keys)
