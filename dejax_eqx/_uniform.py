from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractReplay
from ._checks import as_prototype, check_fn_output, check_items, check_positive_int, Prototype
from ._faults import Fault
from ._laws import AbstractEnumerableLaw, AbstractLaw, Candidates, Draw, locate
from ._policy_age import AgedLaw, PolicyAge
from ._priorities import check_beta
from ._results import initial_result, reports, Result
from ._sequences import integers_below
from ._storage import (
    apply,
    check_batch,
    CircularBuffer,
    gather,
    gather_slots,
    stored_mask,
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
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(self, prototype: Prototype, max_size: int, *, throw: bool = True):
        """**Arguments:**

        - `prototype`: one item, a pytree of arrays (or Python scalars). Only its structure,
            shapes and dtypes are used.
        - `max_size`: the capacity, a positive Python int below `2**31`.
        - `throw`: how a fault (a fact of the data: an empty buffer, an index out of range)
            is reported: raised at the faulty call (`True`, the default), or kept as the
            buffer's `result` and beside what a read returns (`False`: no conditional and no
            callback is compiled; see the guide's "Faults as results").
        """
        self.result = initial_result(throw, "UniformReplay(throw=...)")
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

    @reports
    def add(self: _U, item: PyTree[ArrayLike]) -> _U:
        item, _ = check_items(self.item_spec, item, "UniformReplay.add", batched=False)
        return eqx.tree_at(lambda r: r.storage, self, write(self.storage, item)[0])

    @reports
    def add_batch(
        self: _U, items: PyTree[ArrayLike], *, mask: Bool[ArrayLike, " n"] | None = None
    ) -> _U:
        items, mask = check_batch(self.item_spec, items, mask, "UniformReplay.add_batch")
        return eqx.tree_at(lambda r: r.storage, self, write_batch(self.storage, items, mask)[0])

    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "UniformReplay.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        if age is None:
            if beta is not None:
                raise TypeError(_NO_WEIGHTS.format(call=call))
            return UniformLaw(self.max_size), []
        beta, faults = check_beta(1.0 if beta is None else beta, call, jnp.float32)
        base = UniformLaw(self.max_size)
        return AgedLaw(base, self, age, noun="item", call=call), faults

    def update(self: _U, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _U:
        check_fn_output(self.item_spec, fn, "UniformReplay.update")
        return eqx.tree_at(lambda r: r.storage, self, apply(self.storage, fn))


_NO_WEIGHTS = (
    "`{call}(beta=...)` sets the importance weights of an aged sample; a plain sample has "
    "none. Give `age` too, or leave `beta` out."
)


class UniformLaw(AbstractEnumerableLaw):
    """A `UniformReplay`'s law: every stored item alike. Over a union of replays, every item
    of every replay alike: the draw of one replay holding their items end to end."""

    max_size: int = eqx.field(static=True)

    def summary(self, buffer: UniformReplay) -> Int[Array, ""]:
        return buffer.storage.size

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        total = jnp.sum(summaries)
        # An empty union draws position 0, which the faults report.
        position = integers_below(key, batch_size, total)
        owner, position = locate(position, summaries)
        return Draw(owner, position)

    def read(self, buffer: UniformReplay, at: PyTree[Array]) -> PyTree[Array]:
        return gather(buffer.storage, at)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return jnp.sum(summaries) > 0

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return [(jnp.sum(summaries) == 0, f"`{call}`: cannot sample from an empty UniformReplay")]

    def candidates(self, buffer: UniformReplay) -> Candidates:
        stored = stored_mask(buffer.storage)
        return Candidates(jnp.where(stored, 0.0, -jnp.inf), None, buffer.storage.data, stored)

    def read_candidates(self, buffer: UniformReplay, index: Int[Array, " batch"]) -> PyTree[Array]:
        return gather_slots(buffer.storage, index)

    def num_candidates(self, buffer: UniformReplay) -> int:
        return self.max_size
