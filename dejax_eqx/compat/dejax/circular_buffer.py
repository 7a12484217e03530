"""dejax's `circular_buffer` functions, on `dx.CircularBuffer`."""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, PyTree

from ..._checks import is_concrete
from ..._storage import CircularBuffer as CircularBuffer
from .base import as_jax


def init(item_prototype: PyTree[ArrayLike], max_size: int) -> CircularBuffer:
    """An empty ring of `max_size` slots for items shaped like `item_prototype`."""
    return CircularBuffer(item_prototype, max_size)


def max_size(buffer: CircularBuffer) -> int:
    """The number of slots (a Python int)."""
    return buffer.max_size


def size(buffer: CircularBuffer) -> Int[Array, ""]:
    """The number of stored items."""
    return buffer.size


def push(buffer: CircularBuffer, item: PyTree[ArrayLike]) -> CircularBuffer:
    """Store `item`; when full, the oldest item is overwritten."""
    return buffer.push(as_jax(item))


def pop(buffer: CircularBuffer) -> tuple[PyTree[Array], CircularBuffer]:
    """Remove the oldest item: `(item, buffer)`. An empty buffer is an error."""
    # Eagerly, dejax's `ValueError`; under a transformation, the module's `eqx.error_if`.
    if is_concrete(buffer.size) and int(buffer.size) == 0:
        raise ValueError("There are no items in storage")
    return buffer.pop()


def get_at_index(buffer: CircularBuffer, index: Int[ArrayLike, ""]) -> PyTree[Array]:
    """The `index`-th oldest item (`0` is the oldest). `index` outside `[0, size)` is an error."""
    if is_concrete(index) and is_concrete(buffer.size):
        i = jnp.asarray(index)
        integer = i.shape == () and jnp.issubdtype(i.dtype, jnp.integer)
        if integer and not 0 <= int(i) < int(buffer.size):
            raise ValueError("Index out of bounds")
    return buffer.get(index)
