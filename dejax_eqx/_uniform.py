from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Shaped

from ._abstract import AbstractReplay
from ._checks import as_prototype, check_fn_output, check_items, check_positive_int, Prototype
from ._faults import check_faults
from ._staleness import AgedSample, draw_items_by_age, PolicyAge
from ._storage import (
    apply,
    check_batch,
    CircularBuffer,
    gather,
    gather_slots,
    write,
    write_batch,
)


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

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.storage.item_spec

    def add(self: _U, item: PyTree[ArrayLike]) -> _U:
        item, _ = check_items(self.item_spec, item, "UniformReplay.add", batched=False)
        return eqx.tree_at(lambda r: r.storage, self, write(self.storage, item)[0])

    def add_batch(
        self: _U, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _U:
        items, mask = check_batch(self.item_spec, items, mask, "UniformReplay.add_batch")
        return eqx.tree_at(lambda r: r.storage, self, write_batch(self.storage, items, mask)[0])

    def sample(self, key: PRNGKeyArray, batch_size: int) -> PyTree[Shaped[Array, "batch ..."]]:
        batch_size = check_positive_int(batch_size, "UniformReplay.sample(batch_size=...)")
        return check_faults(
            self.sample_unchecked(key, batch_size),
            [
                (
                    self.storage.size == 0,
                    "`UniformReplay.sample`: cannot sample from an empty UniformReplay",
                )
            ],
            order_reads=False,
        )

    def sample_by_age(self, key: PRNGKeyArray, batch_size: int, age: PolicyAge) -> AgedSample:
        """Draw `batch_size` stored items, with replacement, among those of policy age at
        most `age.max_age`: uniformly, or with weight `1 / (age + 1)` for
        `age.decay="inverse"` (see `PolicyAge`).

        Enumerates the slots: O(max_size) per call, where `sample` is O(batch_size).

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: a positive Python int (static).
        - `age`: a `PolicyAge`: how to read an item's policy version, the current version,
            `max_age` and the decay.

        **Returns:** an `AgedSample` `(items, indices, ages, probabilities, weights,
        generations)`: the items, their slots, ages and probabilities; the weights are 1 and
        `generations` is `None`.

        **Raises:** `TypeError` at once if `age.version` does not map an item to an integer
        scalar; an `eqx.error_if` error if the replay is empty, if a stored version is
        greater than `age.current` or negative, or if every item is older than `max_age`.
        """
        call = "UniformReplay.sample_by_age"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        draw, faults = draw_items_by_age(key, batch_size, age, self.storage, call=call)
        out = AgedSample(gather_slots(self.storage, draw.indices), *draw)
        empty = (self.storage.size == 0, f"`{call}`: cannot sample from an empty UniformReplay")
        return check_faults(out, [empty, *faults], order_reads=False)

    def sample_unchecked(
        self, key: PRNGKeyArray, batch_size: int
    ) -> PyTree[Shaped[Array, "batch ..."]]:
        position = jax.random.randint(key, (batch_size,), 0, self.storage.size, dtype=jnp.int32)
        return gather(self.storage, position)

    def update(self: _U, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _U:
        check_fn_output(self.item_spec, fn, "UniformReplay.update")
        return eqx.tree_at(lambda r: r.storage, self, apply(self.storage, fn))
