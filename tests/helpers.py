"""Shared test helpers: item specs, random items, tree comparison, frequency tests."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats


class Transition(NamedTuple):
    obs: jax.ShapeDtypeStruct
    done: jax.ShapeDtypeStruct


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


# A small fixed catalogue of item specs: every pytree kind (dict, tuple, nested, NamedTuple, a bare
# array) and every dtype the buffers must keep exactly. Few enough that compiled functions are
# reused across hypothesis examples.
SPECS = {
    "dict": {"obs": _s((3,), jnp.float32), "action": _s((), jnp.int8)},
    "tuple": (_s((2, 2), jnp.uint32), _s((), jnp.bool_)),
    "nested": {"a": (_s((2,), jnp.bfloat16), {"b": _s((), jnp.int8)}), "c": _s((1,), jnp.float32)},
    "namedtuple": Transition(obs=_s((2,), jnp.float32), done=_s((), jnp.bool_)),
    "leaf": _s((), jnp.uint32),
}


def _random_leaf(spec: jax.ShapeDtypeStruct, shape: tuple[int, ...], rng: np.random.Generator):
    dtype = spec.dtype
    if dtype == jnp.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    # Floats: ordinary values mixed with the special ones that must survive storage bit for bit.
    values = rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4, size=shape)
    special = np.array([np.nan, np.inf, -np.inf, -0.0])
    pick = rng.random(shape) < 0.1
    values = np.where(pick, special[rng.integers(0, len(special), size=shape)], values)
    return values.astype(dtype)


def random_item(spec, rng: np.random.Generator):
    """One item of `spec` as a pytree of NumPy arrays."""
    return jax.tree.map(lambda s: np.asarray(_random_leaf(s, s.shape, rng)), spec)


def random_batch(spec, n: int, rng: np.random.Generator):
    """`n` items of `spec`, stacked along a new leading axis."""
    return jax.tree.map(lambda s: np.asarray(_random_leaf(s, (n, *s.shape), rng)), spec)


def unstack(batch, n: int) -> list:
    """The `n` items of a stacked batch, as a list of NumPy pytrees."""
    return [jax.tree.map(lambda x: np.asarray(x[i]), batch) for i in range(n)]


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def leaf_equal(a, b) -> bool:
    """Same shape, same dtype and the same values (NaN equal to NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if jnp.issubdtype(a.dtype, jnp.floating):
        return bool(np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True))
    return bool(np.array_equal(a, b))


def tree_equal(a, b) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(leaf_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def assert_tree_equal(actual, expected, msg: str = ""):
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        f"{msg} structure {jax.tree.structure(actual)} != {jax.tree.structure(expected)}"
    )
    for path_leaf, y in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    ):
        path, x = path_leaf
        assert leaf_equal(x, y), (
            f"{msg} leaf {jax.tree_util.keystr(path)}: {np.asarray(x)!r} != {np.asarray(y)!r}"
        )


def bump(item):
    """A deterministic item -> item map used by `update` tests: changes every leaf, keeps dtypes.

    Not an involution, so applying it twice (or to the wrong items) is visible.
    """

    def leaf(x):
        if x.dtype == jnp.bool_:
            return ~x
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x + jnp.asarray(1, x.dtype)
        return x * 2 + 1

    return jax.tree.map(leaf, item)


def assert_frequencies(counts, probabilities, *, alpha: float = 1e-6):
    """Pearson chi-square goodness-of-fit test of observed `counts` against `probabilities`.

    For a correct sampler the test fails with probability `alpha` (1e-6 by default). Outcomes of
    probability zero must never occur: any count there fails at once. Cells with an expected
    count under 5 would make the chi-square approximation unreliable, so they are refused.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    assert counts.shape == probabilities.shape
    assert np.isclose(probabilities.sum(), 1.0), probabilities.sum()
    impossible = probabilities == 0
    assert not counts[impossible].any(), (
        f"sampled outcomes of probability zero: {np.flatnonzero(impossible & (counts > 0))}"
    )
    n = counts.sum()
    expected = n * probabilities[~impossible]
    assert expected.min() >= 5, f"expected count {expected.min():.1f} < 5: draw more samples"
    result = scipy.stats.chisquare(counts[~impossible], expected)
    assert result.pvalue > alpha, (
        f"chi-square p-value {result.pvalue:.3g} <= {alpha}: frequencies do not match "
        f"the expected probabilities"
    )


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page or docstring, dedented, ready to `exec`."""
    import re
    import textwrap

    return [
        textwrap.dedent(block)
        for block in re.findall(r"```python\n(.*?)^\s*```", text, re.S | re.M)
    ]
