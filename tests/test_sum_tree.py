import re

import dejax_eqx as dx
import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from dejax_eqx import _sum_tree
from hypothesis import given
from hypothesis.stateful import initialize, invariant, rule, RuleBasedStateMachine

from .helpers import enable_x64, machine_tests, rotation, SLOW
from .reference import BadPriorityError, RefSumTree


# 1: the leaf is the root; 8: one full row; 9: two levels; 70 and 600: three and four levels.
CAPACITIES = [1, 5, 8, 9, 70, 600]
BATCH_SIZES = [1, 3, 16]
# Leaf values: zeros (never to be found), ordinary values, and extremes side by side.
VALUES = [0.0, 0.0, 1.0, 0.5, 3.0, 1e-30, 1e-3, 1e30, 7.25]

_set = eqx.filter_jit(lambda t, i, v: t.set(i, v))
_set_masked = eqx.filter_jit(lambda t, i, v, m: t.set(i, v, mask=m))
_find = eqx.filter_jit(lambda t, u: t.find(u))


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def check_structure(tree: dx.SumTree) -> None:
    """Every internal node is the sum of its children, and positive exactly when one is."""
    nodes = np.asarray(tree.nodes, np.float64)
    offsets, num_nodes = _sum_tree._layout(tree.capacity)
    k = _sum_tree._BRANCHING
    assert nodes.shape == (num_nodes,)
    assert (nodes[tree.capacity : offsets[1] if len(offsets) > 1 else None] == 0).all()
    for lower, upper in zip(offsets[:-1], offsets[1:]):
        children = nodes[lower:upper].reshape(-1, k)
        parents = nodes[upper : upper + len(children)]
        np.testing.assert_allclose(parents, children.sum(axis=1), rtol=1e-6)
        assert ((parents > 0) == (children > 0).any(axis=1)).all()


def check_find(tree: dx.SumTree, model: RefSumTree, u: np.ndarray) -> None:
    """`find(u)` returns positive leaves whose interval holds u, up to float32 rounding."""
    found = np.asarray(_find(tree, jnp.asarray(_f32(u))))
    assert found.dtype == np.int32 and found.shape == u.shape
    assert ((found >= 0) & (found < tree.capacity)).all()
    total = model.total
    if total == 0:
        return
    values = model.values
    # The drawn leaves are never zero, whatever u is.
    assert (values[found] > 0).all(), (u, found, values[found])
    positive = np.flatnonzero(values > 0)
    slack = 1e-5 * total
    for ui, i in zip(_f32(u).astype(np.float64), found):
        lo, hi = model.interval(i)
        inside = lo - slack <= ui <= hi + slack
        # At or past the end (by rounding, or given so): the last positive leaf will do; below
        # the start, the first.
        past_end = ui >= total - slack and i == positive[-1]
        before_start = ui <= slack and i == positive[0]
        assert inside or past_end or before_start, (ui, i, lo, hi)


def adversarial_draws(model: RefSumTree) -> np.ndarray:
    """Draws at and next to every boundary: 0, each prefix sum, the total and beyond."""
    prefix = np.cumsum(model.values).astype(np.float32)
    total = np.float32(model.total)
    edges = np.concatenate([[0.0], prefix, [total]]).astype(np.float32)
    below = np.nextafter(edges, np.float32(-np.inf))
    above = np.nextafter(edges, np.float32(np.inf))
    u = np.concatenate([edges, below, above, [total * np.float32(1.5), -1.0, -np.inf]])
    # Pad to a fixed length so compiled functions are reused across examples.
    size = 4 * max(CAPACITIES) + 8
    return np.resize(u, size).astype(np.float32)


class SumTreeMachine(RuleBasedStateMachine):
    """Random batched sets (with duplicates and masks) and finds against the model."""

    @initialize(capacity=st.sampled_from(CAPACITIES))
    def init(self, capacity):
        self.tree = dx.SumTree(capacity)
        self.model = RefSumTree(capacity)

    def _indices(self, data, n):
        # A narrow range makes duplicates likely; sometimes the whole range.
        high = data.draw(st.sampled_from([min(2, self.model.values.size), self.tree.capacity]))
        return np.asarray(
            data.draw(st.lists(st.integers(0, high - 1), min_size=n, max_size=n)), np.int32
        )

    @rule(data=st.data(), n=st.sampled_from(BATCH_SIZES))
    def set(self, data, n):
        indices = self._indices(data, n)
        values = _f32(data.draw(st.lists(st.sampled_from(VALUES), min_size=n, max_size=n)))
        self.tree = _set(self.tree, indices, values)
        self.model.set(indices, values)

    @rule(data=st.data(), n=st.sampled_from(BATCH_SIZES))
    def set_masked(self, data, n):
        indices = self._indices(data, n)
        values = _f32(data.draw(st.lists(st.sampled_from(VALUES), min_size=n, max_size=n)))
        mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
        # Masked-out entries may hold anything, even invalid indices and values.
        indices = np.where(mask, indices, -7).astype(np.int32)
        values = np.where(mask, values, np.nan).astype(np.float32)
        self.tree = _set_masked(self.tree, indices, values, mask)
        self.model.set(indices, values, mask)

    @rule(data=st.data(), bad=st.sampled_from(["index", "negative", "nan", "inf"]))
    def set_invalid(self, data, bad):
        indices = self._indices(data, 3)
        values = _f32([1.0, 2.0, 3.0])
        if bad == "index":
            indices[1] = data.draw(st.sampled_from([-1, self.tree.capacity]))
            match, error = "index out of range", IndexError
        else:
            values[2] = {"negative": -1.0, "nan": np.nan, "inf": np.inf}[bad]
            match, error = "values must be finite and non-negative", BadPriorityError
        with pytest.raises(RuntimeError, match=match):
            _set(self.tree, indices, values)
        with pytest.raises(error):
            self.model.set(indices, values)

    @rule(seed=st.integers(0, 2**32 - 1))
    def find_uniform(self, seed):
        u = np.random.default_rng(seed).random(64) * self.model.total
        check_find(self.tree, self.model, u)

    @rule()
    def find_adversarial(self):
        check_find(self.tree, self.model, adversarial_draws(self.model))

    @invariant()
    def same_leaves(self):
        np.testing.assert_array_equal(np.asarray(self.tree.leaves), _f32(self.model.values))
        np.testing.assert_allclose(float(self.tree.total), self.model.total, rtol=1e-6)
        check_structure(self.tree)


TestSumTreeMachine, TestSumTreeMachineFull = machine_tests(SumTreeMachine)


def test_duplicates_last_wins():
    tree = dx.SumTree(10)
    tree = tree.set(jnp.array([3, 7, 3, 3, 7, 1]), jnp.array([1.0, 2.0, 5.0, 4.0, 0.0, 6.0]))
    assert tree.leaves.tolist() == [0, 6, 0, 4, 0, 0, 0, 0, 0, 0]
    assert float(tree.total) == 10
    # With a mask, the last kept occurrence wins.
    tree = tree.set(
        jnp.array([1, 1, 1]), jnp.array([7.0, 8.0, 9.0]), mask=jnp.array([True, True, False])
    )
    assert tree.leaves.tolist()[1] == 8


def test_duplicates_last_wins_for_huge_batches(monkeypatch):
    # Batches too long for exact float positions resolve duplicates by sorting instead.
    monkeypatch.setattr(_sum_tree, "_exact_positions", lambda dtype: 2)
    tree = dx.SumTree(10).set(jnp.array([3, 7, 3, 3, 7, 1]), jnp.array([1.0, 2, 5, 4, 0, 6]))
    assert tree.leaves.tolist() == [0, 6, 0, 4, 0, 0, 0, 0, 0, 0]
    tree = tree.set(
        jnp.array([1, 1, 12]), jnp.array([7.0, 8.0, 9.0]), mask=jnp.array([True, False, False])
    )
    assert tree.leaves.tolist()[1] == 7
    check_structure(tree)


@pytest.mark.parametrize("capacity", rotation([4, 64, 1000], 1, keep=1))
def test_zero_leaves_are_never_found(capacity):
    # Adversarial layouts: trailing zeros after the last positive leaf, a tiny leaf beside huge
    # ones, and positive leaves separated by zeros; each probed at every boundary.
    layouts = {
        "trailing zeros": {0: 1.0, 1: 2.0},
        "tiny beside huge": {0: 3e38 / capacity, 1: 1e-37, capacity // 2: 3e38 / capacity},
        "sparse": {i: float(i + 1) for i in range(1, capacity, 3)},
        "one leaf": {capacity - 1: 1e-20},
    }
    for name, leaves in layouts.items():
        model = RefSumTree(capacity)
        indices = np.asarray(list(leaves), np.int32)
        values = _f32(list(leaves.values()))
        model.set(indices, values)
        tree = dx.SumTree(capacity).set(indices, values)
        total = np.float32(tree.total)
        u = np.concatenate(
            [
                adversarial_draws(model),
                [total, np.nextafter(total, np.float32(0)), np.float32(np.inf), 0.0],
                np.random.default_rng(0).random(1000).astype(np.float32) * total,
            ]
        ).astype(np.float32)
        found = np.asarray(tree.find(u))
        assert (model.values[found] > 0).all(), (name, u[model.values[found] == 0])


def test_u_at_total_finds_the_last_positive_leaf():
    tree = dx.SumTree(20).set(jnp.array([2, 5, 11]), jnp.array([1.0, 1.0, 1.0]))
    total = tree.total
    assert tree.find(jnp.stack([total, jnp.nextafter(total, 0.0), total * 2])).tolist() == [
        11,
        11,
        11,
    ]


def test_many_updates_leave_no_residue():
    # Each ancestor is recomputed from its children rather than adjusted by a difference, so
    # after any history the sums depend on the current leaves only: clearing every leaf gives
    # exactly zero, and a single leaf gives exactly its value.
    rng = np.random.default_rng(0)
    capacity = 1000
    tree = dx.SumTree(capacity)
    for _ in range(200):
        indices = rng.integers(0, capacity, 64).astype(np.int32)
        values = _f32(rng.random(64) * 10.0 ** rng.integers(-6, 6, 64))
        tree = _set(tree, indices, values)
    tree = tree.set(jnp.arange(capacity), jnp.zeros(capacity))
    assert float(tree.total) == 0.0
    assert not np.asarray(tree.nodes).any()
    tree = tree.set(jnp.array([417]), jnp.array([0.1]))
    assert tree.total == jnp.float32(0.1)
    assert tree.find(jnp.array([0.0, 0.05, 0.1])).tolist() == [417, 417, 417]


def test_find_frequencies_are_proportional():
    # Not a chi-square test (the draws are our own uniforms): the leaf found for each of a fine
    # grid of u must be the model's leaf for that u, except within rounding of a boundary.
    values = _f32([0, 1, 0, 2, 3, 0, 0, 4, 0.5, 0])
    tree = dx.SumTree(len(values)).set(jnp.arange(len(values)), values)
    model = RefSumTree(len(values))
    model.set(np.arange(len(values)), values)
    u = (np.arange(10_000) + 0.5) / 10_000 * model.total
    found = np.asarray(tree.find(_f32(u)))
    expected = np.searchsorted(np.cumsum(model.values), u, side="right")
    assert (found == expected).mean() > 0.999
    counts = np.bincount(found, minlength=len(values))
    np.testing.assert_allclose(counts / counts.sum(), values / values.sum(), atol=1e-3)


def test_set_find_cost_is_logarithmic_in_the_jaxpr():
    # No array of the capacity's size is created besides the tree itself, and the only loops
    # run over the levels of the tree, never over the batch.
    capacity, n = 4096, 32
    tree = dx.SumTree(capacity)
    offsets, num_nodes = _sum_tree._layout(capacity)

    def subjaxprs(params):
        for param in params.values():
            for p in param if isinstance(param, tuple | list) else [param]:
                if isinstance(p, jax.extend.core.ClosedJaxpr):
                    yield p.jaxpr
                elif isinstance(p, jax.extend.core.Jaxpr):
                    yield p

    def check(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("scan", "while"):
                # fori_loop with static bounds is a scan of one step per level.
                assert eqn.params.get("length", 0) < len(offsets), eqn
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                assert np.prod(shape) <= n * _sum_tree._BRANCHING or shape == (num_nodes,), eqn
            for sub in subjaxprs(eqn.params):
                check(sub)

    indices = jnp.arange(n, dtype=jnp.int32)
    check(jax.make_jaxpr(lambda t, i, v: t.set(i, v))(tree, indices, jnp.ones(n)).jaxpr)
    check(jax.make_jaxpr(lambda t, u: t.find(u))(tree, jnp.ones(n)).jaxpr)


# An eager 64-bit edge case: CI's slow tier (tests/helpers.py).
@SLOW
def test_float64_tree():
    with enable_x64(True):
        tree = dx.SumTree(10, dtype=jnp.float64)
        tree = tree.set(jnp.array([1, 2]), jnp.array([1e-300, 1.0]))
        assert tree.nodes.dtype == jnp.float64
        assert float(tree.total) == 1.0
        assert tree.find(jnp.array([0.0, 0.5, 1.0])).tolist() == [1, 2, 2]


def test_dtype_validation():
    with pytest.raises(ValueError, match="float32 or float64"):
        dx.SumTree(4, dtype=jnp.bfloat16)
    if not jax.config.read("jax_enable_x64"):
        with pytest.raises(ValueError, match="64-bit mode"):
            dx.SumTree(4, dtype=jnp.float64)
    with pytest.raises(ValueError, match="must be positive"):
        dx.SumTree(0)
    with pytest.raises(ValueError, match="at most"):
        dx.SumTree(2**30 + 1)


def test_argument_validation():
    tree = dx.SumTree(4)
    with pytest.raises((ValueError, TypeError), match="shape|parameter"):
        tree.set(jnp.array([[0]]), jnp.array([[1.0]]))
    with pytest.raises((ValueError, TypeError), match="has shape|parameter"):
        tree.set(jnp.array([0, 1]), jnp.array([1.0]))
    with pytest.raises(TypeError, match="integer dtype|parameter"):
        tree.set(jnp.array([0.0]), jnp.array([1.0]))


@given(
    values=st.lists(st.sampled_from(VALUES), min_size=70, max_size=70),
    seed=st.integers(0, 2**32 - 1),
)
def test_set_all_then_find(values, seed):
    values = _f32(values)
    model = RefSumTree(70)
    model.set(np.arange(70), values)
    tree = _set(dx.SumTree(70), np.arange(70, dtype=np.int32), values)
    np.testing.assert_allclose(float(tree.total), model.total, rtol=1e-6)
    check_find(tree, model, np.random.default_rng(seed).random(64) * model.total)


def test_find_then_set_in_a_loop_never_copies_the_tree():
    # Values computed from the tree itself (its total) flow into the update; the update must
    # still happen in place, with no copy of the tree inside the loop.
    tree = dx.SumTree(5003).set(jnp.arange(5003), jnp.ones(5003))

    def run(tree, key):
        def step(tree, key):
            u = jax.random.uniform(key, (64,)) * tree.total
            return tree.set(tree.find(u), u / tree.total + 0.5), None

        return jax.lax.scan(step, tree, jax.random.split(key, 4))[0]

    hlo = jax.jit(run, donate_argnums=0).lower(tree, jax.random.key(0)).compile().as_text()
    assert hlo is not None
    shape = f"f32[{tree.nodes.shape[0]}]"
    copies = [line for line in hlo.splitlines() if shape in line and " copy(" in line]
    assert not copies, copies


# The levels read through slices of every size: the slow tier (the default reads as usual).
@SLOW
@pytest.mark.parametrize("small_bytes", [16, 300, 2600, 3000])
def test_levels_read_through_slices_agree_with_the_loop(monkeypatch, small_bytes):
    # Large trees read their large levels through one static slice each (unrolled) and the
    # rest in a loop; small trees loop over every level. Shrinking the size limit puts the
    # split at every height of a 5,000-leaf tree: the nodes written and the leaves found (and
    # their values) must be bit for bit those of the all-loop path.
    capacity = 5000
    rng = np.random.default_rng(small_bytes)
    batches = []
    for _ in range(6):
        n = 24
        indices = rng.integers(0, capacity, n).astype(np.int32)
        indices[:8] = indices[0]  # duplicates
        batches.append((indices, rng.random(n).astype(np.float32), rng.random(n) < 0.8))
    u = rng.random(64).astype(np.float32)

    def run():
        _sum_tree._split.cache_clear()
        tree = dx.SumTree(capacity)
        for indices, values, mask in batches:
            tree = tree.set(indices, values, mask=mask)
        leaves, value = _sum_tree.find_leaves(tree, jnp.asarray(u) * tree.total)
        return np.asarray(tree.nodes), np.asarray(leaves), np.asarray(value), tree

    loop = run()
    assert _sum_tree._split(capacity, 4) == 0
    monkeypatch.setattr(_sum_tree, "_SMALL_BYTES", small_bytes)
    sliced = run()
    assert _sum_tree._split(capacity, 4) > 0
    _sum_tree._split.cache_clear()
    for a, b in zip(loop[:3], sliced[:3]):
        np.testing.assert_array_equal(a, b)
    check_structure(sliced[3])
    np.testing.assert_array_equal(sliced[2], sliced[0][sliced[1]])


def test_values_are_converted_from_their_own_dtype():
    # `jnp.asarray` without 64-bit mode wraps an int64 2**32 to 0 before the tree's float32.
    tree = dx.SumTree(4).set(np.array([0, 1]), np.array([2**32, 2**33], np.int64))
    assert tree.leaves.tolist() == [2.0**32, 2.0**33, 0.0, 0.0]
    # find: an int64 target of 2**32 + 2**31 lies in leaf 1 (it wrapped to 2**31 - 2**32 < 0,
    # which finds leaf 0).
    assert tree.find(np.array([2**32 + 2**31], np.int64)).tolist() == [1]
    too_large = "holds a finite value too large for float32"
    with pytest.raises(RuntimeError, match=re.escape(f"`SumTree.set`: `values` {too_large}")):
        tree.set(np.array([0]), np.array([1e39]))
    with pytest.raises(RuntimeError, match=re.escape(f"`SumTree.find`: `values` {too_large}")):
        tree.find(np.array([1e39]))
    # Masked out, a value too large is not checked (nor written).
    kept = tree.set(np.array([2, 3]), np.array([1e39, 1.0]), mask=np.array([False, True]))
    assert kept.leaves.tolist() == [2.0**32, 2.0**33, 0.0, 1.0]
