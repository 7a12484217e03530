from typing import NamedTuple

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx._faults import Fault
from dejax_eqx._laws import AbstractLaw, Draw, locate
from dejax_eqx._storage import gather
from hypothesis.stateful import initialize, invariant, rule

from .helpers import (
    assert_bits_equal,
    assert_frequencies,
    assert_tree_equal,
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
from .machines import ItemRules, SampleSupportRule
from .reference import ClusterIdError, RefClusteredReplay, RefPrioritisedReplay, RefUniformReplay


# Items of the state machine carry their cluster id in the int32 leaf "c" next to a payload "x"
# from the spec catalogue; `cluster_of` is one module-level function, so compiled steps are
# reused across examples.
def cluster_of(item):
    return item["c"]


def _machine_spec(name):
    return {"c": jax.ShapeDtypeStruct((), jnp.int32), "x": SPECS[name]}


_add = eqx.filter_jit(lambda r, x: r.add(x))
_add_batch = eqx.filter_jit(lambda r, x: r.add_batch(x))
_add_batch_masked = eqx.filter_jit(lambda r, x, m: r.add_batch(x, mask=m))
_sample_n = eqx.filter_jit(lambda r, key, n: r.sample(key, n))  # n: a static Python int


@eqx.filter_jit
def _cluster_contents(replay):
    """Every cluster's slots in logical order (oldest first), and the cluster sizes."""
    slots = eqx.filter_vmap(lambda r: gather(r.storage, jnp.arange(r.max_size)))(replay.clusters)
    return slots, replay.cluster_sizes, replay.size


ID_ERROR = "cluster id outside"
BAD_IDS = [-1, -(2**31), 2**31 - 1]  # plus num_clusters itself, added per machine


class ClusteredReplayMachine(ItemRules, SampleSupportRule):
    """Random add / add_batch / update / sample sequences, good and bad ids, against the model."""

    empty_message = "cannot sample from an empty ClusteredReplay"

    # A few configurations, so that compiled steps are reused across examples; the powers are
    # covered exactly by the statistical tests below.
    @initialize(
        spec_name=st.sampled_from(["dict", "nested"]),
        shape=st.sampled_from([(1, 1), (3, 1), (3, 3)]),
        seed=st.integers(0, 2**32 - 1),
    )
    def init(self, spec_name, shape, seed):
        num_clusters, max_size = shape
        power = 0.5
        self.num_clusters = num_clusters
        spec = _machine_spec(spec_name)
        inner = dx.UniformReplay(spec, max_size)
        model = RefClusteredReplay(
            num_clusters, cluster_of, power, inner=lambda: RefUniformReplay(max_size)
        )
        self.start(spec, seed, dx.ClusteredReplay(inner, num_clusters, cluster_of, power), model)

    def _ids(self, data, n, *, bad):
        ids = data.draw(st.lists(st.integers(0, self.num_clusters - 1), min_size=n, max_size=n))
        if bad and n:
            ids[data.draw(st.integers(0, n - 1))] = data.draw(
                st.sampled_from(BAD_IDS + [self.num_clusters])
            )
        return np.asarray(ids, np.int32)

    def _batch(self, ids):
        items = random_batch(self.spec, len(ids), self.rng)
        items["c"] = ids
        return items

    def _expect(self, op, model_op):
        """Run `op` on the replay and `model_op` on the model; they fail or succeed together."""
        try:
            model_op()
        except ClusterIdError:
            with pytest.raises(RuntimeError, match=ID_ERROR):
                op()
            return
        self.buffer = op()

    @rule(data=st.data(), bad=st.booleans())
    def add(self, data, bad):
        item = random_item(self.spec, self.rng)
        item["c"] = self._ids(data, 1, bad=bad)[0]
        self._expect(lambda: self.call("add", item), lambda: self.model.add(item))

    @rule(data=st.data(), n=st.sampled_from([0, 2, 7]), bad=st.booleans())
    def add_batch(self, data, n, bad):  # overrides ItemRules.add_batch: ids, good and bad
        items = self._batch(self._ids(data, n, bad=bad))
        self._expect(
            lambda: self.call("add_batch", items), lambda: self.model.add_batch(unstack(items, n))
        )

    @rule(data=st.data(), n=st.sampled_from([0, 2, 7]), bad=st.booleans())
    def add_batch_masked(self, data, n, bad):
        # A bad id under a False mask entry is no error: that item is not in the batch.
        mask = self.draw_mask(data, n)
        items = self._batch(self._ids(data, n, bad=bad))
        valid = [item for item, m in zip(unstack(items, n), mask) if m]
        self._expect(
            lambda: self.call("add_batch", items, mask=mask),
            lambda: self.model.add_batch(valid),
        )

    @invariant()
    def same_contents(self):
        slots, sizes, size = _cluster_contents(self.buffer)
        assert sizes.tolist() == self.model.cluster_sizes
        assert int(size) == self.model.size
        assert self.buffer.max_size == self.num_clusters * self.model.clusters[0].buffer.max_size
        for c, cluster in enumerate(self.model.clusters):
            for i, expected in enumerate(cluster.contents()):
                assert_tree_equal(jax.tree.map(lambda x: x[c, i], slots), expected)


TestClusteredReplayMachine, TestClusteredReplayMachineFull = machine_tests(ClusteredReplayMachine)


# ---------------------------------------------------------------------------------------------
# Sampling statistics: exact per-item probabilities from the model, chi-square tested.


def label_cluster(label):
    """Items are int32 labels; label // 1000 is the cluster."""
    return label // 1000


def _labelled(num_clusters, power, counts, inner, model_inner):
    """A clustered replay and its model, `counts[c]` labels added to cluster c in mixed order.

    Half the labels go in through `add_batch`, the rest one by one through `add`.
    """
    labels = np.concatenate([1000 * c + np.arange(n) for c, n in enumerate(counts)])
    labels = np.random.default_rng(0).permutation(labels).astype(np.int32)
    replay = dx.ClusteredReplay(inner, num_clusters, label_cluster, power)
    half = len(labels) // 2
    replay = _add_batch(replay, jnp.asarray(labels[:half]))
    for label in labels[half:]:
        replay = _add(replay, jnp.asarray(label))
    model = RefClusteredReplay(num_clusters, label_cluster, power, inner=model_inner)
    model.add_batch(list(labels))
    return replay, model


def _uniform(max_size):
    """An empty UniformReplay of int32 labels and its model's factory."""
    return dx.UniformReplay(jnp.zeros((), jnp.int32), max_size), lambda: RefUniformReplay(max_size)


_draws = eqx.filter_jit(lambda r, key: r.sample(key, 100_000))


def _check_frequencies(labels, model):
    labels = np.asarray(labels)
    stored = np.asarray(model.contents())
    # Exact support: every draw is a stored label.
    assert np.isin(labels, stored).all()
    position = {int(label): i for i, label in enumerate(stored)}
    counts = np.bincount([position[int(x)] for x in labels], minlength=len(stored))
    # Chi-square goodness of fit against the model's exact per-item probabilities: a correct
    # sampler fails this with probability 1e-6.
    assert_frequencies(counts, model.probabilities(), alpha=1e-6)


@pytest.mark.parametrize("power", rotation([0.0, 1.0, 0.5], 2, keep=1))
def test_sampling_matches_exact_probabilities(power):
    # Unequal clusters: 5 items; 20 items into 8 slots (wrapped: the oldest 12 are gone);
    # an empty cluster, which must never be drawn; 2 items.
    replay, model = _labelled(4, power, [5, 20, 0, 2], *_uniform(8))
    assert replay.cluster_sizes.tolist() == [5, 8, 0, 2]
    if power == 1.0:  # proportional to size: uniform over all stored items
        np.testing.assert_allclose(model.probabilities(), np.full(15, 1 / 15))
    _check_frequencies(_draws(replay, jax.random.key(int(power * 10))), model)


# Clusters of clusters: the slow tier (one level's law runs in the default tier, above).
@SLOW
def test_nested_clusters_sample_with_the_product_of_probabilities():
    # Any AbstractReplay is an inner replay, a ClusteredReplay too: the outer replay splits by
    # label // 1000 (power 1), each of its clusters by label parity (power 0).
    def parity(label):
        return label % 2

    uniform, uniform_model = _uniform(4)
    replay, model = _labelled(
        3,
        1.0,
        [6, 3, 0],
        dx.ClusteredReplay(uniform, 2, parity),
        lambda: RefClusteredReplay(2, parity, 0.0, inner=uniform_model),
    )
    assert replay.max_size == 3 * 2 * 4
    assert replay.cluster_sizes.tolist() == model.cluster_sizes == [6, 3, 0]
    _check_frequencies(_draws(replay, jax.random.key(3)), model)


# Batch sizes of clustered draws: tests/test_compat_dejax.py's
# test_clustered_sampling_takes_any_batch_size in the default tier; these, in the slow tier.
@SLOW
def test_any_batch_size_works():
    # dejax refused batch sizes whose per-cluster shares do not round to the total.
    replay, _ = _labelled(2, 0.0, [4, 4], *_uniform(8))
    for batch_size in [3, 5]:
        assert _sample_n(replay, jax.random.key(batch_size), batch_size).shape == (batch_size,)


class Drawn(NamedTuple):
    items: jax.Array
    indices: jax.Array
    probabilities: jax.Array


class IndexedReplay(dx.AbstractReplay):
    """A test double of a replay whose draws are a NamedTuple, as PrioritisedReplay's are: a
    user-defined replay states its law (`IndexedLaw`), and `sample` evaluates it."""

    inner: dx.UniformReplay

    @property
    def max_size(self):
        return self.inner.max_size

    @property
    def size(self):
        return self.inner.size

    def add(self, item):
        return eqx.tree_at(lambda r: r.inner, self, self.inner.add(item))

    def add_batch(self, items, *, mask=None):
        return eqx.tree_at(lambda r: r.inner, self, self.inner.add_batch(items, mask=mask))

    @property
    def item_spec(self):
        return self.inner.item_spec

    def law(self, *, age=None, beta=None, call="IndexedReplay.law"):
        if age is not None or beta is not None:
            raise TypeError(f"`{call}`: an IndexedReplay has no aged draw.")
        return IndexedLaw(self.max_size), []

    def update(self, fn):
        return eqx.tree_at(lambda r: r.inner, self, self.inner.update(fn))


class IndexedLaw(AbstractLaw):
    """Every stored item alike (over a union of replays, every item of every replay alike);
    a row is `Drawn(item, index, probability)`, the index named in the union."""

    max_size: int = eqx.field(static=True)

    def summary(self, buffer):
        return buffer.size

    def draw(self, key, batch_size, summaries):
        total = jnp.sum(summaries)
        index = jax.random.randint(key, (batch_size,), 0, jnp.maximum(total, 1), dtype=jnp.int32)
        return Draw(*locate(index, summaries))

    def read(self, buffer, at):
        return Drawn(gather(buffer.inner.storage, at), at, jnp.zeros(at.shape, jnp.float32))

    def finish(self, rows, draw, summaries):
        total = jnp.sum(summaries).astype(jnp.float32)
        probability = jnp.full(draw.owner.shape, 1.0, jnp.float32) / total
        return Drawn(rows.items, draw.at + draw.owner * self.max_size, probability)

    def available(self, summaries):
        return jnp.sum(summaries) > 0

    def faults(self, summaries, call) -> list[Fault]:
        return [(jnp.sum(summaries) == 0, f"`{call}`: empty")]


# Structured draws: the slow tier.
@SLOW
def test_rows_of_structured_draws_stay_together():
    # Each row of a NamedTuple draw (item, index, probability) must come whole from one cluster.
    uniform, uniform_model = _uniform(8)
    replay, model = _labelled(3, 0.5, [2, 7, 4], IndexedReplay(uniform), uniform_model)
    drawn = eqx.filter_jit(lambda r, k: r.sample(k, 2000))(replay, jax.random.key(0))
    assert isinstance(drawn, Drawn)
    for label, index, probability in zip(*map(np.asarray, drawn)):
        cluster = model.clusters[label // 1000]
        assert cluster.contents()[index] == label
        assert probability == np.float32(1 / cluster.size)
    _check_frequencies(drawn.items, model)
    # The double's own `sample` is the abstract class's: its law, and its law's faults.
    double = IndexedReplay(uniform.add_batch(jnp.arange(3, dtype=jnp.int32)))
    alone = double.sample(jax.random.key(1), 500)
    assert isinstance(alone, Drawn) and set(np.asarray(alone.items).tolist()) == {0, 1, 2}
    assert (np.asarray(alone.indices) == np.asarray(alone.items)).all()
    assert (np.asarray(alone.probabilities) == np.float32(1 / 3)).all()
    with pytest.raises(RuntimeError, match="`IndexedReplay.sample`: empty"):
        IndexedReplay(uniform).sample(jax.random.key(0), 2)


# ---------------------------------------------------------------------------------------------
# A PrioritisedReplay inner: draws and priority updates go through the cluster of each row.

_set_priorities = eqx.filter_jit(lambda r, c, i, p: r.set_priorities((c, i), p))


def _prioritised(power):
    inner = dx.PrioritisedReplay(jnp.zeros((), jnp.int32), 8, priority_exponent=0.5)
    replay, model = _labelled(
        3, power, [5, 11, 0], inner, lambda: RefPrioritisedReplay(8, priority_exponent=0.5)
    )
    # Slot 2 of cluster 1 appears twice (the last entry wins); a zero priority is never drawn.
    update = (
        np.array([0, 0, 1, 1, 1, 1], np.int32),
        np.array([0, 4, 2, 7, 2, 5], np.int32),
        np.array([3.0, 0.0, 0.5, 9.0, 2.0, 0.25], np.float32),
    )
    model.set_priorities(*update)
    return _set_priorities(replay, *map(jnp.asarray, update)), model


@pytest.mark.parametrize("power", rotation([0.0, 1.0], 1, keep=1))
def test_prioritised_inner_samples_cluster_then_priority(power):
    replay, model = _prioritised(power)
    drawn = _draws(replay, jax.random.key(7))
    assert isinstance(drawn, dx.PrioritisedSample)
    # Each row's index and probability are those of its item within its own cluster.
    rows = np.stack([np.asarray(x) for x in drawn[:3]], axis=1)  # items, indices, probs
    # `generations` are the write generations of each row's slot in its own cluster.
    clusters = np.asarray(drawn.items) // 1000
    generations = [model.clusters[c].generations[i] for c, i in zip(clusters, drawn.indices)]
    assert np.asarray(drawn.generations).tolist() == generations
    for label, index, probability in np.unique(rows, axis=0):
        cluster = model.clusters[int(label) // 1000]
        assert cluster.contents()[int(index)] == label
        np.testing.assert_allclose(probability, cluster.probabilities()[int(index)], rtol=1e-5)
    zero = [c.contents()[i] for c in model.clusters for i in range(c.size) if c.priorities[i] == 0]
    assert len(zero) == 1 and not np.isin(drawn.items, zero).any()
    _check_frequencies(drawn.items, model)


# The prioritised inner replay's law runs in the default tier (above); this edge of it, and
# the other dtype, stale-update and empty-replay checks marked `slow` below, in CI's slow tier
# (tests/helpers.py).
@SLOW
@pytest.mark.parametrize("power", [0.0, 1.0])
def test_prioritised_inner_never_draws_a_cluster_whose_items_all_have_priority_0(power):
    # Cluster 0 holds 5 items, all of priority 0 after the update: it is not chosen (its
    # rows would be items of probability 0); cluster 1 takes every draw.
    replay, model = _prioritised(power)
    zero = (np.zeros(5, np.int32), np.arange(5, dtype=np.int32), np.zeros(5, np.float32))
    model.set_priorities(*zero)
    replay = _set_priorities(replay, *map(jnp.asarray, zero))
    assert replay.cluster_sizes.tolist() == [5, 8, 0]
    assert model.cluster_probabilities().tolist() == [0.0, 1.0, 0.0]
    drawn = _draws(replay, jax.random.key(11))
    assert (np.asarray(drawn.items) // 1000 == 1).all()
    cluster = model.clusters[1]
    index = np.asarray(drawn.indices)
    assert (np.asarray(drawn.items) == np.asarray(cluster.contents())[index]).all()
    np.testing.assert_allclose(drawn.probabilities, cluster.probabilities()[index], rtol=1e-5)
    _check_frequencies(drawn.items, model)
    # With every cluster's items at priority 0, nothing can be drawn.
    everything = (np.ones(8, np.int32), np.arange(8, dtype=np.int32), np.zeros(8, np.float32))
    replay = _set_priorities(replay, *map(jnp.asarray, everything))
    for sample in [lambda r, k, n: r.sample(k, n), _sample_n]:  # eagerly and under jit
        with pytest.raises(RuntimeError, match="no cluster holds an item that can be drawn"):
            sample(replay, jax.random.key(0), 4)


def test_prioritised_inner_set_priorities_errors():
    replay, _ = _prioritised(1.0)
    good = jnp.asarray([1.0])
    with pytest.raises(RuntimeError, match="cluster id is outside"):
        _set_priorities(replay, jnp.asarray([3]), jnp.asarray([0]), good)
    with pytest.raises(RuntimeError, match="index out of range"):  # cluster 0 holds 5 items
        _set_priorities(replay, jnp.asarray([0]), jnp.asarray([5]), good)
    with pytest.raises(RuntimeError, match="finite and non-negative"):
        _set_priorities(replay, jnp.asarray([1]), jnp.asarray([0]), jnp.asarray([-1.0]))
    with pytest.raises(TypeError, match="one-axis integer array|parameter .(cluster_ids|indices)."):
        replay.set_priorities((jnp.asarray([0.0]), jnp.asarray([0])), good)
    uniform = dx.ClusteredReplay(_uniform(4)[0], 2, label_cluster)
    with pytest.raises(TypeError, match="has no priorities"):
        uniform.set_priorities((jnp.asarray([0]), jnp.asarray([0])), good)


@SLOW
def test_prioritised_inner_set_priorities_takes_priorities_in_their_own_dtype():
    # An int64 priority of 2**32 is not wrapped to 0 on the way to the inner replay, which
    # converts it; one too large for the inner tree's float32 is refused.
    replay, _ = _prioritised(1.0)
    ids, indices = np.array([0, 1]), np.array([0, 0])
    replay = replay.set_priorities((ids, indices), np.array([2**32, 2**33], np.int64))
    assert replay.clusters.max_priority.tolist()[:2] == [2.0**32, 2.0**33]
    with pytest.raises(RuntimeError, match="`priorities` holds a finite value too large"):
        replay.set_priorities((ids, indices), np.array([1e39, 1.0]))


# ---------------------------------------------------------------------------------------------
# Adding: batches equal sequential adds, ids are checked, never clipped.


def test_add_batch_overflowing_one_cluster_equals_sequential_adds():
    # Cluster 1 receives 10 items in one batch but holds 3; cluster 0 receives 2.
    ids = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1], np.int32)
    items = {"c": ids, "x": np.arange(12, dtype=np.float32)}
    proto = {"c": jnp.zeros((), jnp.int32), "x": jnp.zeros(())}
    empty = dx.ClusteredReplay(dx.UniformReplay(proto, 3), 2, cluster_of)
    batched = empty.add_batch(items)
    sequential = empty
    for i in range(12):
        sequential = sequential.add(jax.tree.map(lambda x: x[i], items))
    assert_tree_equal(to_numpy(batched), to_numpy(sequential))
    slots, sizes, _ = _cluster_contents(batched)
    assert sizes.tolist() == [2, 3]
    assert slots["x"][1].tolist() == [9.0, 10.0, 11.0]
    assert slots["x"][0, :2].tolist() == [2.0, 7.0]


def _id_replay(dtype, num_clusters):
    proto = {"c": jnp.zeros((), dtype), "x": jnp.zeros((), jnp.float32)}
    return dx.ClusteredReplay(dx.UniformReplay(proto, 2), num_clusters, cluster_of)


def _id_items(ids, dtype):
    return {"c": np.asarray(ids, dtype), "x": np.zeros(len(ids), np.float32)}


@pytest.mark.parametrize("jit", [False, True])
def test_out_of_range_ids_are_errors(jit):
    replay = _id_replay(jnp.int32, 3)
    add = eqx.filter_jit(lambda r, x: r.add(x)) if jit else (lambda r, x: r.add(x))
    add_batch = (
        eqx.filter_jit(lambda r, x: r.add_batch(x)) if jit else (lambda r, x: r.add_batch(x))
    )
    for bad in [-1, 3, 2**31 - 1]:
        with pytest.raises(RuntimeError, match=r"`ClusteredReplay.add`: .* \[0, 3\)"):
            add(replay, {"c": np.int32(bad), "x": np.float32(0)})
        with pytest.raises(RuntimeError, match=r"`ClusteredReplay.add_batch`: .* \[0, 3\)"):
            add_batch(replay, _id_items([0, bad, 2], np.int32))


def test_out_of_range_id_is_caught_with_one_cluster_of_one_slot():
    # The degenerate shapes where XLA drops guards on intermediates (a 1-slot write ignores
    # its index): the guard sits on the counters, so it survives.
    proto = {"c": jnp.zeros((), jnp.int32), "x": jnp.zeros(())}
    replay = dx.ClusteredReplay(dx.UniformReplay(proto, 1), 1, cluster_of)
    add = eqx.filter_jit(lambda r, x: r.add(x))
    with pytest.raises(RuntimeError, match=ID_ERROR):
        add(replay, {"c": np.int32(1), "x": np.float32(0)})


def test_masked_out_items_need_no_valid_id():
    replay = _id_replay(jnp.int32, 2)
    items = _id_items([0, -5, 1, 99], np.int32)
    new = _add_batch_masked(replay, items, np.array([True, False, True, False]))
    assert new.cluster_sizes.tolist() == [1, 1]
    with pytest.raises(RuntimeError, match=ID_ERROR):
        _add_batch_masked(replay, items, np.array([True, False, True, True]))


@SLOW
def test_ids_are_checked_in_their_own_dtype():
    # uint32 ids above 2**31 would wrap to negative int32 values; they are errors all the same.
    replay = _id_replay(jnp.uint32, 3)
    assert _add_batch(replay, _id_items([0, 2], np.uint32)).cluster_sizes.tolist() == [1, 0, 1]
    for bad in [2**32 - 1, 2**31 + 1]:
        with pytest.raises(RuntimeError, match=ID_ERROR):
            _add_batch(replay, _id_items([bad, 0], np.uint32))
    # int64 ids: 2**32 + 1 would wrap to the valid id 1 in int32.
    with enable_x64(True):
        replay = _id_replay(jnp.int64, 3)
        assert int(replay.add_batch(_id_items([1, 2], np.int64)).size) == 2
        with pytest.raises(RuntimeError, match=ID_ERROR):
            replay.add_batch(_id_items([2**32 + 1, 0], np.int64))
    # int8 ids with more clusters than int8 can name: no spurious upper-bound error.
    replay = _id_replay(jnp.int8, 200)
    assert int(_add_batch(replay, _id_items([127, 0], np.int8)).size) == 2
    with pytest.raises(RuntimeError, match=ID_ERROR):
        _add_batch(replay, _id_items([-128, 0], np.int8))


@SLOW
def test_sampling_an_empty_replay_is_an_error():
    replay = _id_replay(jnp.int32, 3)
    for sample in [lambda r, k: r.sample(k, 4), eqx.filter_jit(lambda r, k: r.sample(k, 4))]:
        with pytest.raises(RuntimeError, match="cannot sample from an empty ClusteredReplay"):
            sample(replay, jax.random.key(0))


def test_update_reaches_every_cluster():
    replay, model = _labelled(3, 0.0, [2, 0, 3], *_uniform(4))
    replay = eqx.filter_jit(lambda r: r.update(lambda x: x + 7))(replay)
    model.update(lambda x: x + 7)
    slots, sizes, _ = _cluster_contents(replay)
    assert [slots[c, : sizes[c]].tolist() for c in range(3)] == [
        [int(x) for x in c.contents()] for c in model.clusters
    ]


# ---------------------------------------------------------------------------------------------
# Static errors: at construction or at trace time, quoting the call.


def _inner():
    return dx.UniformReplay({"c": jnp.zeros((), jnp.int32), "x": jnp.zeros(2)}, 4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_clusters=0), ValueError, r"num_clusters=...\)` must be positive"),
        (dict(num_clusters=2.0), TypeError, r"num_clusters=...\)` must be a Python int"),
        (dict(cluster_fn=3), TypeError, r"cluster_fn=...\)` must be a function"),
        (dict(cluster_fn=lambda item: item["x"]), TypeError, r"returned float32\[2\]"),
        (dict(cluster_fn=lambda item: item["c"] > 0), TypeError, r"returned bool\[\]"),
        (dict(cluster_fn=lambda item: item["x"][0]), TypeError, r"integer scalar"),
        (dict(distribution_power=float("nan")), ValueError, "must be finite"),
        (dict(distribution_power=float("inf")), ValueError, "must be finite"),
        (dict(distribution_power=jnp.asarray(1.0)), TypeError, "must be a Python float"),
        (dict(inner=_inner().add({"c": 0, "x": jnp.zeros(2)})), ValueError, "must be an empty"),
        (
            # Shapes only (`filter_eval_shape`): a real 2**30-slot replay is 4 GB, and this
            # list is built when the tests are collected.
            dict(
                inner=eqx.filter_eval_shape(lambda: dx.UniformReplay(jnp.zeros(()), 2**30)),
                num_clusters=2,
            ),
            ValueError,
            "must fit in int32",
        ),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    args = dict(inner=_inner(), num_clusters=2, cluster_fn=cluster_of) | kwargs
    # The import hook's beartype check may refuse a badly typed argument before our own check.
    with pytest.raises((error, TypeError), match=f"{match}|parameter"):
        dx.ClusteredReplay(**args)


def test_items_are_checked_against_the_prototype():
    replay = dx.ClusteredReplay(_inner(), 2, cluster_of)
    with pytest.raises(ValueError, match=r"`ClusteredReplay.add_batch`: .* leaf `\['x'\]`"):
        replay.add_batch({"c": np.zeros(3, np.int32), "x": np.zeros((3, 5), np.float32)})
    with pytest.raises(ValueError, match=r"`ClusteredReplay.add`: the item does not have"):
        replay.add({"c": np.int32(0)})
    with pytest.raises(TypeError, match=r"`ClusteredReplay.add`: item leaf `\['x'\]` has dtype"):
        replay.add({"c": np.int32(0), "x": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match=r"`ClusteredReplay.add_batch`: `mask` has shape"):
        replay.add_batch(
            {"c": np.zeros(3, np.int32), "x": np.zeros((3, 2), np.float32)}, mask=np.ones(2, bool)
        )
    with pytest.raises(ValueError, match=r"ClusteredReplay.update`: `fn` returned shape"):
        replay.update(lambda item: {"c": item["c"], "x": item["x"][:1]})
    with pytest.raises(ValueError, match=r"ClusteredReplay.sample\(batch_size=...\)"):
        replay.sample(jax.random.key(0), 0)
    # Python scalars take the stored dtype.
    assert replay.add({"c": 1, "x": np.zeros(2, np.float32)}).cluster_sizes.tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------
# Transformations a training loop uses.


def _proto():
    return {"c": jnp.zeros((), jnp.int32), "x": jnp.zeros(4, jnp.float32)}


def _items(n, start=0):
    return {
        "c": jnp.arange(start, start + n, dtype=jnp.int32) % 3,
        "x": jnp.arange(start, start + 4 * n, dtype=jnp.float32).reshape(n, 4),
    }


# One compilation per configuration: tests/test_transforms.py's donation test in the default
# tier; a clustered replay's cluster function, in the slow tier.
@SLOW
def test_same_function_compiles_once_a_fresh_lambda_retraces():
    traces = []

    @eqx.filter_jit
    def step(replay, items, key):
        traces.append(None)
        return replay.add_and_sample(items, key, 4)

    for i in range(3):  # fresh replays, the same cluster_fn: one trace
        replay = dx.ClusteredReplay(dx.UniformReplay(_proto(), 4), 3, cluster_of)
        step(replay, _items(2, i), jax.random.key(i))
    assert len(traces) == 1
    replay = dx.ClusteredReplay(dx.UniformReplay(_proto(), 4), 3, lambda item: item["c"])
    step(replay, _items(2), jax.random.key(0))
    assert len(traces) == 2


@SLOW
def test_prioritised_inner_drops_stale_priority_updates():
    replay, _ = _prioritised(1.0)
    drawn = eqx.filter_jit(lambda r, k: r.sample(k, 64))(replay, jax.random.key(3))
    clusters = (np.asarray(drawn.items) // 1000).astype(np.int32)
    assert {0, 1} <= set(clusters.tolist())
    # Eight new items of cluster 1 rewrite all of its slots.
    replay = _add_batch(replay, jnp.arange(1100, 1108, dtype=jnp.int32))
    leaves = eqx.filter_vmap(lambda r: r.tree.leaves)  # one row per cluster
    before = np.asarray(leaves(replay.clusters))
    priorities = np.random.default_rng(0).uniform(1, 2, 64).astype(np.float32)
    update = eqx.filter_jit(lambda r, c, i, p, g: r.set_priorities((c, i), p, generations=g))
    after = np.asarray(
        leaves(update(replay, clusters, drawn.indices, priorities, drawn.generations).clusters)
    )
    want = before.copy()
    for c, i, p in zip(clusters, np.asarray(drawn.indices), priorities):
        if c != 1:  # cluster 1's sampled slots hold new items: left alone
            want[c, i] = p**0.5
    np.testing.assert_allclose(after, want, rtol=1e-6)


@SLOW
def test_prioritised_inner_takes_the_deprecated_stamps_with_a_warning():
    # `set_priorities(stamps=...)`: the old name of `generations`, for one release.
    replay, _ = _prioritised(1.0)
    drawn = replay.sample(jax.random.key(3), 8)
    clusters = (np.asarray(drawn.items) // 1000).astype(np.int32)
    priorities = jnp.arange(1.0, 9.0)
    indices = (clusters, drawn.indices)
    want = replay.set_priorities(indices, priorities, generations=drawn.generations)
    with pytest.warns(DeprecationWarning, match=r"set_priorities\(stamps=...\)` is deprecated"):
        old = replay.set_priorities(indices, priorities, stamps=drawn.generations)
    leaves = eqx.filter_vmap(lambda r: r.tree.leaves)
    np.testing.assert_array_equal(leaves(old.clusters), leaves(want.clusters))
    assert not np.array_equal(leaves(old.clusters), leaves(replay.clusters))


_leaves = eqx.filter_vmap(lambda r: r.tree.leaves)  # one row per cluster


@SLOW
def test_prioritised_inner_takes_the_deprecated_three_argument_form_with_a_warning():
    # `set_priorities(cluster_ids, indices, priorities)`: the old form of
    # `set_priorities((cluster_ids, indices), priorities)`, for one release.
    replay, _ = _prioritised(1.0)
    drawn = replay.sample(jax.random.key(5), 8)
    clusters = (np.asarray(drawn.items) // 1000).astype(np.int32)
    priorities = jnp.arange(1.0, 9.0)
    want = replay.set_priorities((clusters, drawn.indices), priorities)
    message = r"set_priorities\(cluster_ids, indices, priorities\)` is deprecated"
    with pytest.warns(DeprecationWarning, match=message):
        old = replay.set_priorities(clusters, drawn.indices, priorities)
    assert_bits_equal(old, want)
    assert not np.array_equal(_leaves(old.clusters), _leaves(replay.clusters))
    # With `mask` and `generations` too.
    mask = np.arange(8) % 2 == 0
    want = replay.set_priorities(
        (clusters, drawn.indices), priorities, mask=mask, generations=drawn.generations
    )
    with pytest.warns(DeprecationWarning, match=message):
        old = replay.set_priorities(
            clusters, drawn.indices, priorities, mask=mask, generations=drawn.generations
        )
    assert_bits_equal(old, want)
