import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import (
    Array,
    ArrayLike,
    Bool,
    Float,
    Int,
    PRNGKeyArray,
    PyTree,
    Real,
    Shaped,
    UInt32,
)

from ._abstract import AbstractPrioritisedReplay, Indices
from ._checks import (
    as_prototype,
    check_fn_output,
    check_generations,
    check_index,
    check_items,
    check_mask,
    check_positive_int,
    check_real_scalar,
    check_vector,
    Prototype,
)
from ._deprecated import renamed
from ._faults import check_faults, Fault, vetoing
from ._laws import (
    AbstractEnumerableLaw,
    AbstractLaw,
    Candidates,
    Draw,
    float_targets,
    in_union,
    locate,
    probability,
)
from ._policy_age import AgedLaw, PolicyAge
from ._priorities import check_beta, HasPriorities, mass_faults, Priorities
from ._results import initial_result, reports, Result
from ._storage import (
    apply,
    check_batch,
    CircularBuffer,
    gather_slots,
    stored_mask,
    write,
    write_batch,
)
from ._sum_tree import find_leaves, MAX_CAPACITY
from ._writes import scatter


_P = TypeVar("_P", bound="PrioritisedReplay")


class PrioritisedSample(NamedTuple):
    """What `PrioritisedReplay.sample` returns: a batch and where it came from.

    **Fields:**

    - `items`: the sampled items, each leaf with a leading `batch` axis.
    - `indices`: int32 array of shape `(batch,)`, the storage slot of each sampled item (its
        sum-tree leaf), to pass to `PrioritisedReplay.set_priorities`.
    - `probabilities`: array of shape `(batch,)`, the probability `P(i)` of drawing each
        sampled item in one i.i.d. draw, to pass to `importance_weights`.
    - `generations`: uint32 array of shape `(batch,)`, the write generation of each sampled
        slot: pass it to `set_priorities(..., generations=...)` so that an update computed
        for an item is never applied to a newer item written to the same slot since.
    """

    items: PyTree[Shaped[Array, "batch ..."]]
    indices: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    generations: UInt32[Array, " batch"]

    @property
    def stamps(self) -> UInt32[Array, " batch"]:
        """Deprecated: `generations` under its old name (removed in the next release)."""
        warnings.warn(
            "`PrioritisedSample.stamps` is deprecated; read `generations` (the same).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.generations


class PrioritisedReplay(AbstractPrioritisedReplay, HasPriorities):
    """Prioritised experience replay (Schaul et al., 2016) on a sum tree.

    A FIFO replay of fixed capacity where each stored item `i` has a priority `p_i >= 0` and is
    drawn with probability `P(i) = p_i ** α / Σ_k p_k ** α`, with `α = priority_exponent`.
    Items with priority zero are never drawn (for every `α`, including 0).

    - New items take the priority given to `add`/`add_batch`, or by default the largest
        priority recorded so far (`max_priority`: at least 1.0, the starting value). An item
        that overwrites an old one takes the new item's priority.
    - `sample` returns a `PrioritisedSample` with the items, their storage slots (`indices`)
        and their probabilities; after computing new priorities (e.g. absolute TD errors),
        pass the slots back to `set_priorities`.
    - Slots are physical: the `k`-th item added to a fresh replay (from 0) sits in slot
        `k % max_size`, and a slot stays valid until it is overwritten.
    - Stale updates are dropped when asked: every slot counts the add calls that wrote it
        (its *generation*, `generations`), a sample returns the generation of each slot it
        drew, and `set_priorities(..., generations=sample.generations)` ignores the entries
        whose slot has been written since, as a learner that updates priorities a few steps
        after sampling needs. `stale` says which entries those are.

    Sampling and `set_priorities` cost O(batch · log max_size); adding costs
    O(n · log max_size) for `n` items, besides writing them.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        item = {"obs": jnp.zeros(4), "reward": jnp.zeros(())}
        buf = dx.PrioritisedReplay(item, max_size=1000, priority_exponent=0.6)
        buf = buf.add_batch({"obs": jnp.ones((8, 4)), "reward": jnp.arange(8.0)})

        @eqx.filter_jit(donate="all")
        def step(buf, key):
            s = buf.sample(key, batch_size=32)
            weights = dx.importance_weights(s.probabilities, buf.size, beta=0.4)
            td_error = s.items["reward"] - 1.0  # stands in for the learner's TD errors
            buf = buf.set_priorities(s.indices, jnp.abs(td_error) + 1e-3)
            return buf, jnp.mean(weights * td_error**2)

        buf, loss = step(buf, jax.random.key(0))
        ```
    """

    storage: CircularBuffer
    priorities: Priorities
    generations: UInt32[Array, " max_size"]
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self,
        prototype: Prototype,
        max_size: int,
        priority_exponent: float = 0.6,
        *,
        stratified: bool = False,
        dtype: Any = jnp.float32,
        throw: bool = True,
    ):
        """**Arguments:**

        - `prototype`: one item, a pytree of arrays (or Python scalars). Only its structure,
            shapes and dtypes are used.
        - `max_size`: the capacity, a positive Python int up to `2**30`.
        - `priority_exponent`: `α >= 0`, a Python float. 0 samples the items of positive
            priority uniformly; 1 in proportion to their priorities.
        - `stratified`: if `True`, `sample` splits the total priority mass into `batch_size`
            equal slices and draws one item from each: every item still has marginal
            probability `P(i)`, but a batch covers the distribution more evenly. If `False`
            (default), the draws are i.i.d.
        - `dtype`: the float dtype of the priority sums, `jnp.float32` (default) or
            `jnp.float64` (needs `jax_enable_x64`).
        - `throw`: how a fault (a fact of the data: an empty buffer, an index out of range)
            is reported: raised at the faulty call (`True`, the default), or kept as the
            buffer's `result` and beside what a read returns (`False`: no conditional and no
            callback is compiled; see the guide's "Faults as results").
        """
        call = "PrioritisedReplay"
        self.result = initial_result(throw, f"{call}(throw=...)")
        max_size = check_positive_int(max_size, f"{call}(max_size=...)", maximum=MAX_CAPACITY)
        self.priorities = Priorities(max_size, priority_exponent, stratified, dtype, call)
        self.storage = CircularBuffer(as_prototype(prototype, f"{call}(prototype=...)"), max_size)
        # uint32 and compared only for equality: a count that wraps after 2**32 writes of one
        # slot stays correct for any update made within 2**32 writes of its sample.
        self.generations = jnp.zeros(max_size, jnp.uint32)

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
    def add(self: _P, item: PyTree[ArrayLike], priority: Real[ArrayLike, ""] | None = None) -> _P:
        """Store one item, overwriting the oldest if the replay is full.

        **Arguments:**

        - `item`: a pytree with the prototype's structure, shapes and dtypes.
        - `priority`: the item's priority, a finite non-negative real scalar (not a bool); by
            default `max_priority`.

        **Returns:** the new replay.

        **Raises:** an `eqx.error_if` error if `priority` is negative, infinite or NaN.
        """
        call = "PrioritisedReplay.add"
        item, _ = check_items(self.item_spec, item, call, batched=False)
        if priority is not None:
            priority = check_real_scalar(priority, call, "priority")
        prepared = self.priorities.prepare(priority, 1, call, name="priority")
        with vetoing(prepared[2]):
            storage, slot = write(self.storage, item)
            return self._written(storage, slot[None], prepared, call)

    @reports
    def add_batch(
        self: _P,
        items: PyTree[ArrayLike],
        priorities: Real[ArrayLike, " n"] | None = None,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _P:
        """Store `n` items at once; the same as `n` calls to `add`, in order.

        **Arguments:**

        - `items`: a pytree with the prototype's structure whose leaves have one extra leading
            axis of the same length `n`.
        - `priorities`: optional array of shape `(n,)`, finite and non-negative. By default
            every item gets `max_priority` (as it was before this call).
        - `mask`: optional boolean array of shape `(n,)`: only the items where it is `True`
            are added (their priorities alone are checked and recorded).

        **Returns:** the new replay.

        **Raises:** an `eqx.error_if` error if a priority is negative, infinite or NaN.
        """
        call = "PrioritisedReplay.add_batch"
        items, mask = check_batch(self.item_spec, items, mask, call)
        if priorities is not None:
            n = jax.tree.leaves(items)[0].shape[0]
            priorities = check_vector(priorities, n, call, "priorities")
        # Items overwritten within the batch get the out-of-range slot max_size (dropped), but
        # their priorities are still recorded in `max_priority`, as n adds would.
        n = jax.tree.leaves(items)[0].shape[0]
        prepared = self.priorities.prepare(priorities, n, call, mask=mask)
        with vetoing(prepared[2]):  # a recording call's faulty add writes nothing
            storage, slots = write_batch(self.storage, items, mask)
            return self._written(storage, slots, prepared, call, mask)

    def _written(
        self: _P,
        storage: CircularBuffer,
        slots: Int[Array, " n"],
        prepared: tuple[Float[Array, " n"], Float[Array, ""], list[Fault]],
        call: str,
        mask: Bool[Array, " n"] | None = None,
    ) -> _P:
        """The replay with `storage`, into whose `slots` (distinct, or out of range where
        dropped) items were just written: their priorities set (as `Priorities.prepare`
        made them: masses, the new maximum, the faults), their generations advanced."""
        masses, top, faults = prepared
        # The check guards what the new replay is built from: the small vectors scattered
        # into the tree, and the new maximum. Not the tree or the storage: threading those
        # through a check could copy them.
        slots, masses, top = check_faults((slots, masses, top), faults)
        new = self.priorities.write(slots, masses, top, mask=mask, unique=True)
        one = jnp.ones(slots.shape, self.generations.dtype)
        generations = scatter(self.generations, slots, one, "add", unique=True)
        return eqx.tree_at(
            lambda r: (r.storage, r.priorities, r.generations), self, (storage, new, generations)
        )

    @reports
    def set_priorities(
        self: _P,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        generations: UInt32[ArrayLike, " n"] | None = None,
        stamps: UInt32[ArrayLike, " n"] | None = None,
    ) -> _P:
        call = "PrioritisedReplay.set_priorities"
        generations = renamed(generations, stamps, "generations", "stamps", call)
        slots, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        n = slots.shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        if mask is not None:
            mask = check_mask(mask, n, call)
        # Stale entries are checked like the others (a bad index or priority is an error
        # either way), then left out.
        current = None
        if generations is not None:
            current = self._current(slots, check_generations(generations, n, call))
        # A replay never pops, so its stored slots are exactly [0, size).
        bad = bad | (slots >= self.storage.size)
        masses, top, faults = self.priorities.prepare(priorities, n, call, mask=mask)
        index_fault = (
            bad if mask is None else bad & mask,
            f"`{call}`: index out of range; every index must satisfy 0 <= index < size (a "
            "stored slot)",
        )
        faults = [index_fault, *faults]
        slots, masses, top = check_faults((slots, masses, top), faults)
        if current is not None:
            mask = current if mask is None else mask & current
        with vetoing(faults):  # a recording call's faulty update sets nothing
            new = self.priorities.write(slots, masses, top, mask=mask)
        return eqx.tree_at(lambda r: r.priorities, self, new)

    @reports
    def note_priorities(
        self: _P,
        indices: Indices,
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _P:
        call = "PrioritisedReplay.note_priorities"
        n = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)[0].shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        valid = None if mask is None else check_mask(mask, n, call)
        return eqx.tree_at(lambda r: r.priorities, self, self.priorities.noted(priorities, valid))

    @reports
    def stale(
        self,
        indices: Indices,
        generations: UInt32[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> Bool[Array, " n"]:
        """Which sampled slots have been written since they were sampled.

        **Arguments:**

        - `indices`: integer array of shape `(n,)`, slots as `sample` returned them.
        - `generations`: uint32 array of shape `(n,)`, the `generations` of the same sample.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are checked and answered (the others answer `False`).

        **Returns:** a boolean array of shape `(n,)`, `True` where the slot holds a newer item
        than the one sampled: the entries `set_priorities(..., generations=...)` ignores.
        `jnp.sum(replay.stale(s.indices, s.generations))` counts the dropped updates.

        **Raises:** `TypeError`/`ValueError` at once if `generations` is not a uint32 array of
        shape `(n,)`; an `eqx.error_if` error if an index is not a stored slot.
        """
        call = "PrioritisedReplay.stale"
        slots, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        n = slots.shape[0]
        generations = check_generations(generations, n, call)
        bad = bad | (slots >= self.storage.size)
        out = ~self._current(slots, generations)
        if mask is not None:
            valid = check_mask(mask, n, call)
            bad, out = bad & valid, out & valid
        return check_faults(
            out,
            [
                (
                    bad,
                    f"`{call}`: index out of range; every index must satisfy 0 <= index < "
                    "size (a stored slot)",
                )
            ],
        )

    def _current(
        self, slots: Int[Array, " n"], generations: UInt32[Array, " n"]
    ) -> Bool[Array, " n"]:
        # Out-of-range slots (`max_size`) read generation 0: the caller reports them.
        return jnp.take(self.generations, slots, mode="fill", fill_value=0) == generations

    def law(
        self,
        *,
        age: PolicyAge | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        call: str = "PrioritisedReplay.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """`P(i) = p_i ** α / Σ_k p_k ** α`, i.i.d. or stratified; `sample` returns a
        `PrioritisedSample` (items, slots, probabilities, generations). With `age`, the
        same law times each item's age weight (an `AgedSample`, whose weights correct the
        priorities toward the age-weighted target with exponent `beta`, default 1). Faults:
        nothing stored, every stored priority 0, a total mass that is not finite."""
        base = PrioritisedLaw(self.max_size, self.priorities.stratified)
        if age is None:
            if beta is not None:
                raise TypeError(
                    f"`{call}(beta=...)` sets the importance weights of an aged sample; a "
                    "plain sample returns probabilities: weigh them with "
                    "`dx.importance_weights`. Give `age` too, or leave `beta` out."
                )
            return base, []
        dtype = self.priorities.max_priority.dtype
        beta, faults = check_beta(1.0 if beta is None else beta, call, dtype)
        stratified = self.priorities.stratified
        law = AgedLaw(base, self, age, beta=beta, stratified=stratified, noun="item", call=call)
        return law, faults

    def update(self: _P, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _P:
        """Apply `fn(item) -> item` to every stored item; priorities are unchanged."""
        check_fn_output(self.item_spec, fn, "PrioritisedReplay.update")
        return eqx.tree_at(lambda r: r.storage, self, apply(self.storage, fn))


class PrioritisedLaw(AbstractEnumerableLaw):
    """A `PrioritisedReplay`'s law: each stored item in proportion to its mass `p ** α`.
    Over a union of replays, in proportion to its mass over their total: the targets of
    the union's total, each found in the tree of the replay whose slice holds it."""

    max_size: int = eqx.field(static=True)
    stratified: bool = eqx.field(static=True)

    @property
    def independent_rows(self) -> bool:
        return not self.stratified

    def summary(self, buffer: PrioritisedReplay) -> PyTree[Array]:
        return buffer.storage.size, buffer.priorities.tree.total

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        _, totals = summaries
        targets = float_targets(key, batch_size, jnp.sum(totals), self.stratified)
        return Draw(*locate(targets, totals))

    def read(self, buffer: PrioritisedReplay, at: PyTree[Array]) -> PrioritisedSample:
        slots, value = find_leaves(buffer.priorities.tree, at)
        items = gather_slots(buffer.storage, slots)
        # The probability is the leaf's value over the union's total, in `finish`.
        return PrioritisedSample(items, slots, value, buffer.generations[slots])

    def finish(
        self, rows: PrioritisedSample, draw: Draw, summaries: PyTree[Array]
    ) -> PrioritisedSample:
        total = jnp.sum(summaries[1])
        return rows._replace(
            indices=in_union(draw.owner, rows.indices, self.max_size),
            probabilities=probability(rows.probabilities, total),
        )

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        total = jnp.sum(summaries[1])
        # A total that is not finite is drawn from, and reported.
        return (total > 0) | ~jnp.isfinite(total)

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        sizes, totals = summaries
        empty = (jnp.sum(sizes) == 0, f"`{call}`: cannot sample from an empty PrioritisedReplay")
        return [empty, *mass_faults(jnp.sum(totals), call, "item")]

    def candidates(self, buffer: PrioritisedReplay) -> Candidates:
        stored = stored_mask(buffer.storage)
        log_mass = jnp.log(buffer.priorities.tree.leaves)
        return Candidates(jnp.where(stored, 0.0, -jnp.inf), log_mass, buffer.storage.data, stored)

    def read_candidates(
        self, buffer: PrioritisedReplay, index: Int[Array, " batch"]
    ) -> PyTree[Array]:
        return gather_slots(buffer.storage, index)

    def num_candidates(self, buffer: PrioritisedReplay) -> int:
        return self.max_size

    def generations(self, buffer: PrioritisedReplay, index: Int[Array, " batch"]) -> Array:
        return buffer.generations[index]
