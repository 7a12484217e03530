"""The 64-bit integers of `_int64.py`, held to Python ints.

Every operation is jitted once per static constant (a small fixed set of constants, so the
compiled functions are reused across examples), and its result compared with Python's exact
arithmetic, overflow included.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st


def _i64():
    from dejax_eqx import _int64

    return _int64


MIN, MAX = -(2**63), 2**63 - 1
# Static constants: the edges of every word and of the range, and ordinary values.
CONSTANTS = [0, 1, 3, 2**16 - 1, 2**16 + 7, 2**31 - 1, 2**32 + 5, 2**40 + 3, 2**62 - 1, 2**62]
PRODUCT_CONSTANTS = [*CONSTANTS, 2**63 - 1, 2**63, 2**64 - 1]
SIGNED = [*CONSTANTS, -1, -(2**31), -(2**40) - 7, -(2**62) + 1, MAX, MIN]

# Values near the places where words carry, borrow or overflow, and anywhere in the range.
_edges = [0, 1, -1, 2**31, 2**32 - 1, 2**32, -(2**32), 2**62, -(2**62), 2**63 - 1, -(2**63)]
values = st.one_of(
    st.sampled_from(_edges).flatmap(lambda e: st.integers(-3, 3).map(lambda d: e + d)),
    st.integers(MIN, MAX),
).filter(lambda x: MIN <= x <= MAX)
amounts = st.one_of(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 2**16, 2**31 - 1]))
uamounts = st.one_of(amounts, st.sampled_from([2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


def _wrap(x: int) -> int:
    return (x - MIN) % 2**64 + MIN


@functools.cache
def _compiled(name: str, c: int):
    i64 = _i64()
    if name == "add":
        return jax.jit(lambda a, n: i64.add_product(a, n, c))
    if name == "sub":
        return jax.jit(lambda a, n: i64.sub_product(a, n, c))
    if name == "const":
        return jax.jit(lambda a: i64.add_constant(a, c))
    if name == "cmp":
        return jax.jit(lambda a: (i64.less(a, c), i64.less_equal(a, c)))
    if name == "div":
        return jax.jit(lambda a: i64.floor_div(a, c))
    if name == "neg":
        return jax.jit(i64.negate)
    raise AssertionError(name)


def test_round_trip_edges():
    i64 = _i64()
    for x in [*_edges, 12345, -12345]:
        a = i64.from_int(x)
        assert a.dtype == jnp.uint32 and a.shape == (2,)
        assert i64.to_int(a) == x
    for bad in (2**63, MIN - 1):
        with pytest.raises(ValueError, match="does not fit a signed 64-bit integer"):
            i64.from_int(bad)


@given(x=values)
def test_round_trip(x):
    i64 = _i64()
    assert i64.to_int(i64.from_int(x)) == x
    assert i64.to_int(_compiled("neg", 0)(i64.from_int(x))) == _wrap(-x)


@given(
    a=values, n=uamounts, c=st.sampled_from(PRODUCT_CONSTANTS), dtype=st.sampled_from(["i", "u"])
)
def test_add_and_sub_product(a, n, c, dtype):
    i64 = _i64()
    if dtype == "i" and n > 2**31 - 1:
        n //= 2
    n_array = jnp.asarray(n, jnp.int32 if dtype == "i" else jnp.uint32)
    for name, exact in (("add", a + n * c), ("sub", a - n * c)):
        out, overflow = _compiled(name, c)(i64.from_int(a), n_array)
        assert bool(overflow) == (not MIN <= exact <= MAX), (name, a, n, c)
        if MIN <= exact <= MAX:
            assert i64.to_int(out) == exact, (name, a, n, c)


def test_products_past_2_63_that_land_in_range():
    # `n * c` itself past 2**63, the sum or difference just inside the range (found by
    # hypothesis: an overflow flag on the product alone refused these).
    i64 = _i64()
    n, c = 2**31 - 1, 2**32 + 5
    product = n * c
    for name, a, exact in [
        ("sub", MIN + product, MIN),
        ("sub", MIN + product - 1, None),
        ("add", MAX - product, MAX),
        ("add", MAX - product + 1, None),
    ]:
        out, overflow = _compiled(name, c)(i64.from_int(a), jnp.asarray(n, jnp.int32))
        assert bool(overflow) == (exact is None), (name, a)
        if exact is not None:
            assert i64.to_int(out) == exact


@given(a=values, c=st.sampled_from(SIGNED))
def test_add_constant(a, c):
    i64 = _i64()
    out, overflow = _compiled("const", c)(i64.from_int(a))
    exact = a + c
    assert bool(overflow) == (not MIN <= exact <= MAX)
    assert i64.to_int(out) == _wrap(exact)


@given(a=values, c=st.sampled_from(SIGNED + [MAX + 1, MAX + 2, MIN - 1]))
def test_comparisons(a, c):
    i64 = _i64()
    less, less_equal = _compiled("cmp", c)(i64.from_int(a))
    assert (bool(less), bool(less_equal)) == (a < c, a <= c)


@given(a=values, c=st.sampled_from([1, 2, 3, 7, 2**16 + 1, 2**31, 2**40 + 1, 2**62, 2**63, 2**70]))
def test_floor_div_saturates(a, c):
    i64 = _i64()
    out = _compiled("div", c)(i64.from_int(a))
    assert out.dtype == jnp.int32
    assert int(out) == min(max(a // c, 0), 2**31 - 1)


def test_floor_div_edges():
    i64 = _i64()
    cases = [(2**31 - 1, 1), (2**31, 1), (2**31 * 5 - 1, 5), (-1, 1), (MAX, 2**32), (6, 3)]
    for a, c in cases:
        assert int(_compiled("div", c)(i64.from_int(a))) == min(max(a // c, 0), 2**31 - 1)


def test_under_vmap():
    # A batch of counters, one per agent: the operations are elementwise on the words.
    i64 = _i64()
    xs = [0, 2**32 - 1, -5, 2**40]
    a = jnp.stack([i64.from_int(x) for x in xs])
    n = jnp.asarray([1, 2, 3, 4], jnp.int32)
    out, overflow = jax.vmap(lambda a, n: i64.add_product(a, n, 2**33 + 1))(a, n)
    assert not np.asarray(overflow).any()
    assert [i64.to_int(o) for o in out] == [x + k * (2**33 + 1) for x, k in zip(xs, [1, 2, 3, 4])]
    div = jax.vmap(lambda a: i64.floor_div(a, 3))(a)
    assert div.tolist() == [0, (2**32 - 1) // 3, 0, 2**31 - 1]
