from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import (
    Array,
    ArrayLike,
    Bool,
    Float,
    Int,
    Integer,
    PRNGKeyArray,
    PyTree,
    Real,
    Shaped,
    UInt32,
)

from ._abstract import AbstractPrioritisedReplay
from ._checks import (
    as_prototype,
    check_bool,
    check_faults,
    check_finite_float,
    check_float_dtype,
    check_fn_output,
    check_index,
    check_items,
    check_mask,
    check_nonnegative_float,
    check_positive_int,
    check_real_scalar,
    check_stamps,
    check_vector,
    Fault,
    Prototype,
)
from ._storage import apply, check_batch, CircularBuffer, gather_slots, write, write_batch
from ._sum_tree import draw_leaves, MAX_CAPACITY, priority_mass, set_leaves, SumTree


_P = TypeVar("_P", bound="PrioritisedReplay")


class PrioritisedSample(NamedTuple):
    """What `PrioritisedReplay.sample` returns: a batch and where it came from.

    **Fields:**

    - `items`: the sampled items, each leaf with a leading `batch` axis.
    - `indices`: int32 array of shape `(batch,)`, the storage slot of each sampled item, to
        pass to `PrioritisedReplay.set_priorities`.
    - `probabilities`: array of shape `(batch,)`, the probability `P(i)` of drawing each
        sampled item in one i.i.d. draw, to pass to `importance_weights`.
    - `stamps`: uint32 array of shape `(batch,)`, the write generation of each sampled slot:
        pass it to `set_priorities(..., stamps=...)` so that an update computed for an item
        is never applied to a newer item written to the same slot since.
    """

    items: PyTree[Shaped[Array, "batch ..."]]
    indices: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    stamps: UInt32[Array, " batch"]


class PrioritisedReplay(AbstractPrioritisedReplay):
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
        drew (`stamps`), and `set_priorities(..., stamps=sample.stamps)` ignores the entries
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
    tree: SumTree
    max_priority: Float[Array, ""]
    generations: UInt32[Array, " max_size"]
    priority_exponent: float = eqx.field(static=True)
    stratified: bool = eqx.field(static=True)

    def __init__(
        self,
        prototype: Prototype,
        max_size: int,
        priority_exponent: float = 0.6,
        *,
        stratified: bool = False,
        dtype: Any = jnp.float32,
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
        """
        max_size = check_positive_int(
            max_size, "PrioritisedReplay(max_size=...)", maximum=MAX_CAPACITY
        )
        self.priority_exponent = check_nonnegative_float(
            priority_exponent, "PrioritisedReplay(priority_exponent=...)"
        )
        self.stratified = check_bool(stratified, "PrioritisedReplay(stratified=...)")
        dtype = check_float_dtype(dtype, "PrioritisedReplay(dtype=...)")
        self.storage = CircularBuffer(
            as_prototype(prototype, "PrioritisedReplay(prototype=...)"), max_size
        )
        self.tree = SumTree(max_size, dtype)
        self.max_priority = jnp.asarray(1.0, dtype)
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
            priority = check_real_scalar(priority, call, "priority")[None]
        storage, slot = write(self.storage, item)
        return self._with_priorities(storage, slot[None], priority, call, unique=True, written=True)

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
        storage, slots = write_batch(self.storage, items, mask)
        # Every slot the batch writes ends up holding its last item, which `write_batch`
        # returns: its generation counts this call once.
        return self._with_priorities(
            storage, slots, priorities, call, mask=mask, unique=True, written=True
        )

    def set_priorities(
        self: _P,
        indices: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
        stamps: UInt32[ArrayLike, " n"] | None = None,
    ) -> _P:
        call = "PrioritisedReplay.set_priorities"
        slots, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        n = slots.shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        if mask is not None:
            mask = check_mask(mask, n, call)
        # Stale entries are checked like the others (a bad index or priority is an error
        # either way), then left out.
        keep = None if stamps is None else self._current(slots, check_stamps(stamps, n, call))
        # A replay never pops, so its stored slots are exactly [0, size).
        bad = bad | (slots >= self.storage.size)
        return self._with_priorities(
            self.storage,
            slots,
            priorities,
            call,
            mask=mask,
            keep=keep,
            index_fault=(
                bad if mask is None else bad & mask,
                f"`{call}`: index out of range; every index must be a stored slot, "
                "0 <= index < size",
            ),
        )

    def stale(
        self, indices: Integer[ArrayLike, " n"], stamps: UInt32[ArrayLike, " n"]
    ) -> Bool[Array, " n"]:
        """Which sampled slots have been written since they were sampled.

        **Arguments:**

        - `indices`: integer array of shape `(n,)`, slots as `sample` returned them.
        - `stamps`: uint32 array of shape `(n,)`, the `stamps` of the same sample.

        **Returns:** a boolean array of shape `(n,)`, `True` where the slot holds a newer item
        than the one sampled: the entries `set_priorities(..., stamps=stamps)` ignores.
        `jnp.sum(replay.stale(s.indices, s.stamps))` counts the dropped updates.

        **Raises:** `TypeError`/`ValueError` at once if `stamps` is not a uint32 array of
        shape `(n,)`; an `eqx.error_if` error if an index is not a stored slot.
        """
        call = "PrioritisedReplay.stale"
        slots, bad = check_index(indices, self.max_size, f"{call}(indices=...)", ndim=1)
        stamps = check_stamps(stamps, slots.shape[0], call)
        return check_faults(
            ~self._current(slots, stamps),
            [
                (
                    bad | (slots >= self.storage.size),
                    f"`{call}`: index out of range; every index must be a stored slot, "
                    "0 <= index < size",
                )
            ],
        )

    def _current(self, slots: Int[Array, " n"], stamps: UInt32[Array, " n"]) -> Bool[Array, " n"]:
        # Out-of-range slots (`max_size`) read generation 0: the caller reports them.
        return jnp.take(self.generations, slots, mode="fill", fill_value=0) == stamps

    def sample(self, key: PRNGKeyArray, batch_size: int) -> PrioritisedSample:
        """Draw `batch_size` stored items with probabilities `P(i)`, with replacement.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: a positive Python int (static).

        **Returns:** a `PrioritisedSample` of `items`, `indices` and `probabilities`.

        **Raises:** an `eqx.error_if` error if the replay is empty, if every stored priority is
        zero, or if the total mass `Σ p ** α` overflows the tree's dtype.
        """
        call = "PrioritisedReplay.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        total = self.tree.total
        return check_faults(
            self.sample_unchecked(key, batch_size),
            [
                (
                    self.storage.size == 0,
                    f"`{call}`: cannot sample from an empty PrioritisedReplay",
                ),
                (
                    total <= 0,
                    f"`{call}`: cannot sample from a PrioritisedReplay whose stored priorities "
                    "are all zero",
                ),
                (
                    ~jnp.isfinite(total),
                    f"`{call}`: cannot sample from a PrioritisedReplay: the total priority mass "
                    "sum(priority ** priority_exponent) is not finite in the tree's dtype",
                ),
            ],
            order_reads=False,
        )

    def sample_unchecked(self, key: PRNGKeyArray, batch_size: int) -> PrioritisedSample:
        slots, probabilities = draw_leaves(self.tree, key, batch_size, self.stratified)
        return PrioritisedSample(
            gather_slots(self.storage, slots), slots, probabilities, self.generations[slots]
        )

    def update(self: _P, fn: Callable[[PyTree[Array]], PyTree[Array]]) -> _P:
        """Apply `fn(item) -> item` to every stored item; priorities are unchanged."""
        check_fn_output(self.item_spec, fn, "PrioritisedReplay.update")
        return eqx.tree_at(lambda r: r.storage, self, apply(self.storage, fn))

    def _mass(self, priorities: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return priority_mass(priorities, self.priority_exponent)

    def _with_priorities(
        self: _P,
        storage: CircularBuffer,
        slots: Int[Array, " n"],
        priorities: Real[Array, " n"] | None,
        call: str,
        *,
        mask: Bool[Array, " n"] | None = None,
        unique: bool = False,
        index_fault: Fault | None = None,
        written: bool = False,
        keep: Bool[Array, " n"] | None = None,
    ) -> _P:
        """The replay with `storage`, and the priorities of `slots` set (out-of-range or
        masked-out slots dropped; `unique`: the kept slots are distinct). `None` priorities
        mean `max_priority`. `index_fault` reports indices the caller found invalid.
        `written`: `slots` were just written (distinct, dropped ones out of range): their
        generations advance. `keep`: of the (checked) entries, set only these."""
        faults = [] if index_fault is None else [index_fault]
        if priorities is None:
            mass = jnp.broadcast_to(self._mass(self.max_priority), slots.shape)
            max_priority = self.max_priority
        else:
            priorities = priorities.astype(self.max_priority.dtype)
            if mask is not None:  # masked-out items may carry anything
                priorities = jnp.where(mask, priorities, 0)
            faults.append(
                (
                    ~(jnp.isfinite(priorities) & (priorities >= 0)),
                    f"`{call}`: priorities must be finite and non-negative",
                )
            )
            max_priority = jnp.maximum(self.max_priority, jnp.max(priorities, initial=0))
            mass = self._mass(priorities)
        # The check guards what the new replay is built from: the small vectors scattered
        # into the tree, and the new maximum. Not the tree or the storage: threading those
        # through a check could copy them.
        slots, mass, max_priority = check_faults((slots, mass, max_priority), faults)
        if keep is not None:
            mask = keep if mask is None else mask & keep
        tree = set_leaves(self.tree, slots, mass, mask=mask, unique=unique)
        generations = self.generations
        if written:
            generations = generations.at[slots].add(1, mode="drop", unique_indices=True)
        return eqx.tree_at(
            lambda r: (r.storage, r.tree, r.max_priority, r.generations),
            self,
            (storage, tree, max_priority, generations),
        )


def importance_weights(
    probabilities: Float[ArrayLike, "*batch"],
    size: Integer[ArrayLike, ""],
    beta: Real[ArrayLike, ""],
) -> Float[Array, "*batch"]:
    """Importance-sampling weights that correct the bias of prioritised sampling.

    `w_i = (N · P(i)) ** -β / max_j (N · P(j)) ** -β`, the maximum taken over the batch
    (Schaul et al., 2016), so the largest weight is 1. With `β = 1` the weights fully correct
    for sampling with probabilities `P` instead of uniformly; `β` is usually annealed from about
    0.4 to 1 over training.

    Computed in log space, so tiny probabilities neither overflow nor lose precision. (After
    normalisation `N` cancels out; it is taken for the formula's sake.)

    **Arguments:**

    - `probabilities`: the probabilities `P(i)` of the sampled items, as in
        `PrioritisedSample.probabilities` (any shape; all must be positive).
    - `size`: `N`, the number of stored items (`replay.size`), positive.
    - `beta`: the exponent `β`, a finite non-negative scalar.

    **Returns:** weights with the shape and dtype of `probabilities`, at most 1.

    **Raises:** `ValueError`/`TypeError` at once for a Python `size` or `beta` out of range;
    an `eqx.error_if` error if a probability is not positive (or is NaN), or if an array
    `size` is not positive or an array `beta` is negative or not finite.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        w = dx.importance_weights(jnp.array([0.1, 0.4]), 10, beta=1.0)
        assert jnp.allclose(w, jnp.array([1.0, 0.25]))
        ```
    """
    call = "importance_weights"
    probabilities = jnp.asarray(probabilities)
    if not jnp.issubdtype(probabilities.dtype, jnp.floating):
        raise TypeError(
            f"`{call}`: `probabilities` must have a floating dtype, got {probabilities.dtype}."
        )
    # Python values are configuration, checked now; arrays are data, checked at run time.
    if isinstance(size, int | np.integer):
        check_positive_int(size, f"{call}(size=...)")
    if isinstance(beta, int | float | np.integer | np.floating):
        check_nonnegative_float(beta, f"{call}(beta=...)")
    size = check_real_scalar(size, call, "size")
    beta = check_real_scalar(beta, call, "beta")
    dtype = probabilities.dtype
    log_n = jnp.log(size.astype(dtype))
    log_w = -beta.astype(dtype) * (log_n + jnp.log(probabilities))
    weights = jnp.exp(log_w - jnp.max(log_w))
    return check_faults(
        weights,
        [
            (~(probabilities > 0), f"`{call}`: probabilities must be positive"),
            (~(size > 0), f"`{call}`: `size` must be positive"),
            (
                ~(jnp.isfinite(beta) & (beta >= 0)),
                f"`{call}`: `beta` must be finite and non-negative",
            ),
        ],
    )


def sequence_priorities(
    td_errors: Float[ArrayLike, "batch seq"],
    mask: Bool[ArrayLike, "batch seq"],
    eta: float = 0.9,
) -> Float[Array, " batch"]:
    """R2D2's priority of each sequence: a mixture of the largest and the mean absolute TD
    error over the steps that count.

    `p = η · max_t |δ_t| + (1 - η) · mean_t |δ_t|` over the steps `t` where `mask` is `True`
    (Kapturowski et al., 2019, with `η = 0.9`). The mean alone washes out the rare large
    errors of a long sequence; the max alone is noisy. A row with no masked-in step gets
    priority 0 (it has nothing to learn from, and is then never drawn).

    **Arguments:**

    - `td_errors`: floating array of shape `(batch, seq)`, e.g. over a window's steps.
    - `mask`: boolean array of the same shape, e.g. `SequenceSample.learn`.
    - `eta`: `η`, a Python float in `[0, 1]` (default 0.9).

    **Returns:** an array of shape `(batch,)` in the dtype of `td_errors`, non-negative
    where the masked-in errors are finite.

    **Raises:** `TypeError`/`ValueError` at once for a non-floating `td_errors`, a non-bool
    `mask`, shapes that differ or an `eta` outside `[0, 1]`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import dejax_eqx as dx

        td = jnp.array([[1.0, -3.0, 2.0], [5.0, 0.0, 0.0]])
        learn = jnp.array([[True, True, True], [False, False, False]])
        p = dx.sequence_priorities(td, learn, eta=0.5)
        assert jnp.allclose(p, jnp.array([0.5 * 3.0 + 0.5 * 2.0, 0.0]))
        ```
    """
    call = "sequence_priorities"
    td_errors, mask = jnp.asarray(td_errors), jnp.asarray(mask)
    if not jnp.issubdtype(td_errors.dtype, jnp.floating):
        raise TypeError(f"`{call}`: `td_errors` must have a floating dtype, got {td_errors.dtype}.")
    if mask.dtype != jnp.bool_:
        raise TypeError(f"`{call}`: `mask` must be a bool array, got dtype {mask.dtype}.")
    if td_errors.ndim != 2 or mask.shape != td_errors.shape:
        raise ValueError(
            f"`{call}`: `td_errors` and `mask` must both have shape (batch, seq), got "
            f"{td_errors.shape} and {mask.shape}."
        )
    eta = check_finite_float(eta, f"{call}(eta=...)")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"`{call}(eta=...)` must be in [0, 1], got {eta}.")
    size = jnp.sum(mask, axis=1, dtype=td_errors.dtype)
    magnitude = jnp.where(mask, jnp.abs(td_errors), 0)
    largest = jnp.max(magnitude, axis=1)
    mean = jnp.sum(magnitude, axis=1) / jnp.maximum(size, 1)
    return (eta * largest + (1 - eta) * mean).astype(td_errors.dtype)
