from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Shaped

from ._abstract import AbstractReplay
from ._checks import as_prototype, check_positive_int, Prototype
from ._storage import CircularBuffer


_U = TypeVar("_U", bound="UniformReplay")


class UniformReplay(AbstractReplay):
    """A FIFO replay of fixed capacity that samples stored items uniformly, with replacement.

    Once `max_size` items are stored, each new item overwrites the oldest.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        item = {"obs": jnp.zeros(4), "action": jnp.asarray(0, jnp.int32)}
        buf = dx.UniformReplay(item, max_size=1000)

        @eqx.filter_jit(donate="all")
        def step(buf, items, key):
            buf = buf.add_batch(items)
            return buf, buf.sample(key, batch_size=32)

        items = {"obs": jnp.ones((8, 4)), "action": jnp.arange(8, dtype=jnp.int32)}
        buf, batch = step(buf, items, jax.random.key(0))
        assert batch["obs"].shape == (32, 4)
        ```
    """

    storage: CircularBuffer
    """The stored items, as a `CircularBuffer` (its `data` holds the slots)."""

    def __init__(self, prototype: Prototype, max_size: int):
        """**Arguments:**

        - `prototype`: one item, a pytree of arrays (or Python scalars). Only its structure,
            shapes and dtypes are used.
        - `max_size`: the capacity, a positive Python int below `2**31`.
        """
        max_size = check_positive_int(max_size, "UniformReplay(max_size=...)")
        self.storage = CircularBuffer(
            as_prototype(prototype, "UniformReplay(prototype=...)"), max_size
        )

    @property
    def max_size(self) -> int:
        return self.storage.max_size

    @property
    def size(self) -> Int[Array, ""]:
        return self.storage.size

    def add(self: _U, item: PyTree[ArrayLike]) -> _U:
        storage = self.storage._push(item, "UniformReplay.add")
        return eqx.tree_at(lambda r: r.storage, self, storage)

    def add_batch(
        self: _U, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _U:
        storage = self.storage._push_batch(items, "UniformReplay.add_batch", mask)
        return eqx.tree_at(lambda r: r.storage, self, storage)

    def sample(self, key: PRNGKeyArray, batch_size: int) -> PyTree[Shaped[Array, "batch ..."]]:
        batch_size = check_positive_int(batch_size, "UniformReplay.sample(batch_size=...)")
        return eqx.error_if(
            self._draw(key, batch_size),
            self.storage.size == 0,
            "cannot sample from an empty UniformReplay",
        )

    def _draw(self, key: PRNGKeyArray, batch_size: int) -> PyTree[Shaped[Array, "batch ..."]]:
        index = jax.random.randint(key, (batch_size,), 0, self.storage.size, dtype=jnp.int32)
        return self.storage._gather(index)

    def update(self: _U, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _U:
        return eqx.tree_at(
            lambda r: r.storage, self, self.storage._update(fn, "UniformReplay.update")
        )
