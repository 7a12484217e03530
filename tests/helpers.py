"""Shared test helpers: item specs, random items, tree comparison, frequency tests."""

import re
import textwrap
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine


class Transition(NamedTuple):
    """An item spec (leaves `jax.ShapeDtypeStruct`) or an item (leaves arrays)."""

    obs: jax.ShapeDtypeStruct | jax.Array
    done: jax.ShapeDtypeStruct | jax.Array


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


def profile_max_examples() -> int:
    """`max_examples` of the hypothesis profile in use (conftest loads one, so
    `settings.default`, which hypothesis types as optional, is set)."""
    current = settings.default
    assert current is not None
    return current.max_examples


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
    if (~impossible).sum() == 1:
        return  # one possible outcome: nothing else was drawn, and there is nothing to test
    n = counts.sum()
    expected = n * probabilities[~impossible]
    assert expected.min() >= 5, f"expected count {expected.min():.1f} < 5: draw more samples"
    result = scipy.stats.chisquare(counts[~impossible], expected)
    assert result.pvalue > alpha, (
        f"chi-square p-value {result.pvalue:.3g} <= {alpha}: frequencies do not match "
        f"the expected probabilities"
    )


def _random_bits(spec: jax.ShapeDtypeStruct, shape: tuple[int, ...], rng: np.random.Generator):
    """Arbitrary bit patterns of `spec.dtype`; floats get NaNs with random signs and payloads."""
    dtype = np.dtype(spec.dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    values = raw.view(dtype).reshape(shape)
    if jnp.issubdtype(dtype, jnp.floating):
        # A quarter of the entries become NaNs: all-ones exponent, random sign and a random
        # non-zero payload (quiet and signalling alike), which must survive bit for bit.
        info = jnp.finfo(dtype)
        uint = np.dtype(f"uint{8 * dtype.itemsize}")
        payload = rng.integers(1, 2**info.nmant, size=shape, endpoint=False).astype(uint)
        sign = rng.integers(0, 2, size=shape).astype(uint) << uint.type(info.nexp + info.nmant)
        exponent = uint.type((2**info.nexp - 1) << info.nmant)
        nans = (sign | exponent | payload).view(dtype)
        values = np.where(rng.random(shape) < 0.25, nans, values)
    return values


def random_bits_batch(spec, n: int, rng: np.random.Generator):
    """`n` items of `spec` with arbitrary bit patterns (NaN payloads included), stacked."""
    return jax.tree.map(lambda s: np.asarray(_random_bits(s, (n, *s.shape), rng)), spec)


def _bits(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_bits_equal(actual, expected):
    """The same pytree (static fields included), and every leaf identical bit for bit.

    Also compares dtypes (typed PRNG keys included) and weak types: a weakly typed counter
    would cost a retrace.
    """
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        f"structure {jax.tree.structure(actual)} != {jax.tree.structure(expected)}"
    )
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)
    ):
        name = jax.tree_util.keystr(path)
        assert type(x) is type(y), f"leaf {name}: type {type(x)} != {type(y)}"
        if not isinstance(x, jax.Array | np.ndarray):
            assert x == y, f"leaf {name}: {x!r} != {y!r}"
            continue
        assert (x.shape, x.dtype) == (y.shape, y.dtype), f"leaf {name}: {x.dtype}{x.shape}"
        assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False), name
        bx, by = _bits(x), _bits(y)
        assert bx.tobytes() == by.tobytes(), f"leaf {name}: {bx!r} != {by!r}"


# A fenced ```python block, possibly indented (inside an admonition or a list); the closing fence
# has the same indentation as the opening one.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)


def python_blocks_with_lines(text: str) -> list[tuple[int, str]]:
    """`(line number of the opening fence, dedented code)` of each ```python block of a
    markdown page or docstring."""
    return [
        (text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group("code")))
        for m in _FENCE.finditer(text)
    ]


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page or docstring, dedented, ready to `exec`."""
    return [code for _, code in python_blocks_with_lines(text)]


def enable_x64(new_val: bool = True):
    """`jax.enable_x64` (JAX 0.8 and newer), or `jax.experimental.enable_x64` before it: the
    same context manager, so the tests of 64-bit inputs run on every supported JAX."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(new_val)
    # Gone from JAX 0.8 on (the JAX that pyright reads), which has `jax.enable_x64`.
    from jax.experimental import enable_x64 as experimental  # pyright: ignore[reportAttributeAccessIssue]

    return experimental(new_val)


# What the README's test command leaves out to stay within 5 minutes on 2 cores, marked `slow`
# (`pytest -m slow` runs it; CI runs both): the rest of each sweep over every buffer type (or
# every layer over every kind), of which it runs a rotation in which every value still appears;
# the guides' examples after each guide's first; the runs across real processes.
SLOW = pytest.mark.slow


def rotation(
    values: Sequence[Any], start: int, keep: int = 2, *, several: bool = False
) -> list[Any]:
    """`values` for `pytest.mark.parametrize`: `keep` of them, cyclically from index `start`,
    in the default run, the others marked `slow` (`several`: each value is a tuple of
    several arguments)."""
    n = len(values)
    fast = {(start + i) % n for i in range(keep)}
    slow = (
        (lambda v: pytest.param(*v, marks=SLOW))
        if several
        else (lambda v: pytest.param(v, marks=SLOW))
    )
    return [v if i in fast else slow(v) for i, v in enumerate(values)]


def machine_tests(machine: type[RuleBasedStateMachine], share: int = 4) -> tuple[type, type]:
    """The tests of a hypothesis state machine: a quick one with `1/share` of its runs (at
    least 2) in the README's test command, and one with all of them, marked `slow`.

    Each run of a machine draws a configuration of the buffer and compiles its functions for
    it: most of a machine's time. The slow tier keeps every run of the profile (8 in `ci`).
    """
    full = machine.TestCase
    runs = max(2, full.settings.max_examples // share)
    quick = type("Quick", (full,), {"settings": settings(full.settings, max_examples=runs)})
    return quick, SLOW(type("Full", (full,), {}))
