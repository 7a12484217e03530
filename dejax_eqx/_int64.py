"""Exact signed 64-bit integers on JAX arrays that have no 64-bit dtype.

JAX runs without 64-bit mode by default, so `int64` is not there; a counter of a long run
(items inserted, rows sampled) can pass `2**31`. Such a counter is held here as a uint32 array
of shape `(2,)`, `(hi, lo)`: the two words of its two's complement, the high word first.

Only what the rate limiter needs: adding or subtracting a product `n * c` of a traced
non-negative 32-bit scalar `n` and a static Python int `c`, comparing with a static Python int,
and a saturating floor division by a static positive int. Everything is scalar work, done on
16-bit halves so that no partial product wraps. Sums that leave the signed 64-bit range are not
wrapped silently: they come with an `overflow` flag, for the caller's `check_faults`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int, Integer, UInt32


MIN = -(2**63)
MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
_WORD = 2**32
_SIGN = np.uint32(2**31)
_LOW16 = np.uint32(0xFFFF)

Int64 = UInt32[Array, " 2"]
"""A signed 64-bit integer: the words `(hi, lo)` of its two's complement."""


def _words(x: int) -> tuple[int, int]:
    if not MIN <= x <= MAX:
        raise ValueError(f"{x} does not fit a signed 64-bit integer.")
    x %= _WORD * _WORD
    return x // _WORD, x % _WORD


def from_int(x: int) -> Int64:
    """The Python int `x`, in `[-2**63, 2**63)`, as an `Int64` (on the host's default device)."""
    return jnp.asarray(np.asarray(_words(x), np.uint32))


def to_int(a: UInt32[ArrayLike, " 2"]) -> int:
    """The value of a concrete `Int64`, as a Python int (reads it from the device)."""
    hi, lo = (int(w) for w in np.asarray(a, np.uint32))
    x = hi * _WORD + lo
    return x - _WORD * _WORD if x > MAX else x


def _join(hi: UInt32[Array, ""], lo: UInt32[Array, ""]) -> Int64:
    return jnp.stack([hi, lo])


def _add(a: Int64, b: Int64) -> tuple[Int64, Bool[Array, ""]]:
    """`a + b`, wrapped, and whether the true sum leaves the signed 64-bit range."""
    lo = a[1] + b[1]
    carry = (lo < a[1]).astype(jnp.uint32)
    hi = a[0] + b[0] + carry
    sign_a, sign_b, sign = a[0] >= _SIGN, b[0] >= _SIGN, hi >= _SIGN
    return _join(hi, lo), (sign_a == sign_b) & (sign != sign_a)


def negate(a: Int64) -> Int64:
    """`-a` (exact but for `-2**63`, which wraps to itself)."""
    lo = ~a[1] + np.uint32(1)
    hi = ~a[0] + (lo == 0).astype(jnp.uint32)
    return _join(hi, lo)


def _above(x: Int64, y: Int64) -> Bool[Array, ""]:
    """`x > y`, both words read as one unsigned 64-bit number."""
    return (x[0] > y[0]) | ((x[0] == y[0]) & (x[1] > y[1]))


def _offset(a: Int64) -> Int64:
    """`a + 2**63`, as an unsigned 64-bit number: the order of `a` among signed values."""
    return _join(a[0] ^ _SIGN, a[1])


def _times(n: Integer[Array, ""], c: int) -> tuple[Int64, Bool[Array, ""]]:
    """`n * c` for a traced `n` in `[0, 2**32)` and a static `c` in `[0, 2**64)`: its value
    modulo `2**64` as unsigned words, and whether it is `2**64` or more.

    By 16-bit halves: each partial product of a half of `n` and a half of `c` fits 32 bits,
    and is split again into halves summed by column, so no column sum passes `2**18`.
    """
    assert 0 <= c < _WORD * _WORD
    n = n.astype(jnp.uint32)
    halves_n = (n & _LOW16, n >> 16)
    halves_c = [(c >> (16 * k)) & 0xFFFF for k in range(4)]
    columns = [jnp.zeros((), jnp.uint32) for _ in range(6)]
    for j, nj in enumerate(halves_n):
        for k, ck in enumerate(halves_c):
            if ck:  # `c` is static: its zero halves cost nothing
                product = nj * np.uint32(ck)
                columns[j + k] = columns[j + k] + (product & _LOW16)
                columns[j + k + 1] = columns[j + k + 1] + (product >> 16)
    limbs = []
    carry = jnp.zeros((), jnp.uint32)
    for column in columns:
        total = column + carry
        limbs.append(total & _LOW16)
        carry = total >> 16
    lo = limbs[0] | (limbs[1] << 16)
    hi = limbs[2] | (limbs[3] << 16)
    return _join(hi, lo), (limbs[4] | limbs[5]) != 0


def add_product(a: Int64, n: Integer[Array, ""], c: int) -> tuple[Int64, Bool[Array, ""]]:
    """`(a + n * c, overflow)`: for a traced `n` in `[0, 2**32)` (int32 or uint32; the caller
    checks that an int32 is not negative) and a static Python int `c` in `[0, 2**64)`.
    `overflow` is whether the true result leaves `[-2**63, 2**63)`; the sum is then wrapped."""
    product, huge = _times(n, c)
    # The sum fits iff `product <= 2**63 - 1 - a`, which is the complement of `a + 2**63`.
    room = _offset(a)
    total, _ = _add(a, product)
    return total, huge | _above(product, _join(~room[0], ~room[1]))


def sub_product(a: Int64, n: Integer[Array, ""], c: int) -> tuple[Int64, Bool[Array, ""]]:
    """`(a - n * c, overflow)`, as `add_product`."""
    product, huge = _times(n, c)
    # The difference fits iff `product <= a + 2**63`.
    total, _ = _add(a, negate(product))  # modulo 2**64, so exact where it fits
    return total, huge | _above(product, _offset(a))


def add_constant(a: Int64, c: int) -> tuple[Int64, Bool[Array, ""]]:
    """`(a + c, overflow)` for a static Python int `c` in `[-2**63, 2**63)`."""
    return _add(a, jnp.asarray(np.asarray(_words(c), np.uint32)))


def _ordered(a: Int64) -> tuple[UInt32[Array, ""], UInt32[Array, ""]]:
    # Flipping the sign bit maps the signed order of the high word onto the unsigned order.
    return a[0] ^ _SIGN, a[1]


def less(a: Int64, c: int) -> Bool[Array, ""]:
    """`a < c` for a static Python int `c` (of any size)."""
    if c > MAX:
        return jnp.ones((), jnp.bool_)
    if c <= MIN:
        return jnp.zeros((), jnp.bool_)
    hi, lo = _words(c)
    c_hi, c_lo = np.uint32(hi) ^ _SIGN, np.uint32(lo)
    a_hi, a_lo = _ordered(a)
    return (a_hi < c_hi) | ((a_hi == c_hi) & (a_lo < c_lo))


def less_equal(a: Int64, c: int) -> Bool[Array, ""]:
    """`a <= c` for a static Python int `c` (of any size)."""
    return less(a, c + 1)


def floor_div(a: Int64, c: int) -> Int[Array, ""]:
    """`a // c`, clipped to `[0, 2**31 - 1]`, as an int32, for a static Python int `c >= 1`.

    A binary search over the 31 bits of the quotient (the largest `q` with `q * c <= a`),
    in a `fori_loop`: scalar work, and a small program.
    """
    assert c >= 1
    if c > MAX:  # then |a| < c: the quotient is 0 or -1, clipped to 0
        return jnp.zeros((), jnp.int32)

    negative = a[0] >= _SIGN  # then no positive multiple of `c` is at most `a`

    def bit(i: Int[Array, ""], q: Int[Array, ""]) -> Int[Array, ""]:
        trial = q | jnp.left_shift(jnp.int32(1), jnp.int32(30) - i)
        product, huge = _times(trial, c)
        fits = ~negative & ~huge & ~_above(product, a)
        return jnp.where(fits, trial, q)

    return jax.lax.fori_loop(0, 31, bit, jnp.zeros((), jnp.int32))
