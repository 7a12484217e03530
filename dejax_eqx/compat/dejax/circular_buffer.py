"""dejax's `circular_buffer` functions, on `dx.CircularBuffer`.

The state, `CircularBuffer`, has dejax's fields `data`, `head` (the slot the next push
writes), `tail` (the slot of the oldest item) and `full`; `module` is the `dx.CircularBuffer`
behind it. The functions also take that module itself.
"""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, PyTree

from ... import CircularBuffer as EqxCircularBuffer
from ...internal import is_concrete
from ._states import CircularBuffer as CircularBuffer, module_of
from .base import as_jax


_Ring = CircularBuffer | EqxCircularBuffer


def _ring(buffer: _Ring, call: str) -> EqxCircularBuffer:
    return module_of(buffer, EqxCircularBuffer, call)


def init(item_prototype: PyTree[ArrayLike], max_size: int) -> CircularBuffer:
    """An empty ring of `max_size` slots for items shaped like `item_prototype`."""
    return CircularBuffer(EqxCircularBuffer(item_prototype, max_size))


def max_size(buffer: _Ring) -> int:
    """The number of slots (a Python int)."""
    return _ring(buffer, "circular_buffer.max_size").max_size


def size(buffer: _Ring) -> Int[Array, ""]:
    """The number of stored items."""
    return _ring(buffer, "circular_buffer.size").size


def push(buffer: _Ring, item: PyTree[ArrayLike]) -> CircularBuffer:
    """Store `item`; when full, the oldest item is overwritten."""
    return CircularBuffer(_ring(buffer, "circular_buffer.push").push(as_jax(item)))


def pop(buffer: _Ring) -> tuple[PyTree[Array], CircularBuffer]:
    """Remove the oldest item: `(item, buffer)`. An empty buffer is an error."""
    ring = _ring(buffer, "circular_buffer.pop")
    # Eagerly, dejax's `ValueError`; under a transformation, the module's `eqx.error_if`.
    if is_concrete(ring.size) and int(ring.size) == 0:
        raise ValueError("There are no items in storage")
    item, ring = ring.pop()
    return item, CircularBuffer(ring)


def get_at_index(buffer: _Ring, index: Int[ArrayLike, ""]) -> PyTree[Array]:
    """The `index`-th oldest item (`0` is the oldest). `index` outside `[0, size)` is an error."""
    ring = _ring(buffer, "circular_buffer.get_at_index")
    if is_concrete(index) and is_concrete(ring.size):
        i = jnp.asarray(index)
        integer = i.shape == () and jnp.issubdtype(i.dtype, jnp.integer)
        if integer and not 0 <= int(i) < int(ring.size):
            raise ValueError("Index out of bounds")
    return ring.get(index)
