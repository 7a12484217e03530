"""Priorities of items on a sum tree, shared by both prioritised buffers: the mass of a
priority, the largest priority recorded, how items are drawn and weighted. The one home of
priority bookkeeping."""

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, Real

from ._checks import (
    as_float,
    check_bool,
    check_finite_float,
    check_float_dtype,
    check_nonnegative_float,
    check_positive_int,
    check_real_scalar,
)
from ._faults import check_faults, Fault, recording, veto
from ._results import result_of
from ._sum_tree import draw_leaves, set_leaves, SumTree


_P = TypeVar("_P", bound="Priorities")


def priority_mass(priorities: Float[Array, "*s"], exponent: float) -> Float[Array, "*s"]:
    """`p ** α`, with zero priority mapped to zero mass for every `α` (also `α = 0`)."""
    if exponent == 1.0:
        return priorities
    return jnp.where(priorities > 0, priorities**exponent, 0)


class Priorities(eqx.Module):
    """The priorities of `capacity` items: a `SumTree` of their masses `p ** α`, and the
    largest priority recorded so far (`max_priority`, at least 1.0, the priority new items
    get). Zero priority is zero mass for every `α`, and a leaf of zero mass is never drawn.

    Held by `PrioritisedReplay` (one leaf per storage slot) and `PrioritisedTrajectoryBuffer`
    (one leaf per window). The buffer decides which leaves change; this module what they
    hold. Its operations are unchecked: the buffer's public method checks its arguments and
    passes the faults these operations report to its own single check.
    """

    tree: SumTree
    max_priority: Float[Array, ""]
    exponent: float = eqx.field(static=True)
    stratified: bool = eqx.field(static=True)

    def __init__(self, capacity: int, exponent: float, stratified: bool, dtype: Any, owner: str):
        """Arguments are checked under the name of the buffer that owns them (`owner`), which
        checks `capacity` (at most `MAX_CAPACITY`) itself: `exponent` `α >= 0`, `stratified` a
        bool, `dtype` float32 or float64."""
        self.exponent = check_nonnegative_float(exponent, f"{owner}(priority_exponent=...)")
        self.stratified = check_bool(stratified, f"{owner}(stratified=...)")
        dtype = check_float_dtype(dtype, f"{owner}(dtype=...)")
        self.tree = SumTree(capacity, dtype)
        self.max_priority = jnp.asarray(1.0, dtype)

    def mass(self, priorities: Float[Array, "*s"]) -> Float[Array, "*s"]:
        """The masses of `priorities` (in the tree's dtype)."""
        return priority_mass(priorities, self.exponent)

    def new_mass(self) -> Float[Array, ""]:
        """The mass a new item gets: that of the largest priority recorded."""
        return self.mass(self.max_priority)

    def fresh(self: _P) -> _P:
        """Priorities of the same configuration with every mass 0 and `max_priority` 1.0 (from
        the static fields alone: `self` may be a shape-only template)."""
        dtype = self.max_priority.dtype
        return type(self)(self.tree.capacity, self.exponent, self.stratified, dtype, "")

    def prepare(
        self,
        priorities: Real[ArrayLike, "*n"] | None,
        n: int,
        call: str,
        *,
        mask: Bool[Array, " n"] | None = None,
        name: str = "priorities",
    ) -> tuple[Float[Array, " n"], Float[Array, ""], list[Fault]]:
        """For `n` items given `priorities` (checked in shape and kind, not yet converted:
        they are converted here, from their own dtype, by `as_float`; `None`: the largest
        recorded), `(masses, new max_priority, faults)`. Masked-out entries may hold
        anything: they are neither checked nor recorded. `name` names the argument."""
        if priorities is None:
            return jnp.broadcast_to(self.new_mass(), (n,)), self.max_priority, []
        dtype = self.max_priority.dtype
        priorities, faults = as_float(priorities, dtype, call, name, mask=mask)
        priorities = jnp.broadcast_to(priorities, (n,))
        if mask is not None:
            priorities = jnp.where(mask, priorities, 0)
        bad = ~(jnp.isfinite(priorities) & (priorities >= 0))
        top = jnp.maximum(self.max_priority, jnp.max(priorities, initial=0))
        fault = (bad, f"`{call}`: priorities must be finite and non-negative")
        return self.mass(priorities), top, [*faults, fault]

    def write(
        self: _P,
        leaves: Int[Array, " n"],
        masses: Float[Array, " n"],
        max_priority: Float[Array, ""] | None = None,
        *,
        mask: Bool[Array, " n"] | None = None,
        unique: bool = False,
    ) -> _P:
        """`masses` written to `leaves` (of repeated leaves the last wins, unless `unique`
        promises none; out-of-range or masked-out leaves are dropped), and `max_priority` if
        given (as `prepare` raised it). Nothing where a recording call vetoes its writes
        (`_faults.vetoing`)."""
        vetoed = veto()
        if vetoed is not None:
            keep = jnp.broadcast_to(~vetoed, leaves.shape)
            mask = keep if mask is None else mask & keep
            if max_priority is not None:
                max_priority = jnp.where(vetoed, self.max_priority, max_priority)
        tree = set_leaves(self.tree, leaves, masses, mask=mask, unique=unique)
        if max_priority is None:
            max_priority = self.max_priority
        return eqx.tree_at(lambda p: (p.tree, p.max_priority), self, (tree, max_priority))

    def noted(
        self: _P, priorities: Real[ArrayLike, " n"], mask: Bool[Array, " n"] | None = None
    ) -> _P:
        """`max_priority` raised by `priorities` (where `mask` holds) as `prepare` raises it,
        and nothing written: for priorities set on another buffer of a union. Entries that
        are not finite and non-negative raise nothing (the buffer that sets them reports
        them)."""
        dtype = self.max_priority.dtype
        values = jnp.asarray(priorities)
        valid = jnp.isfinite(values) & (values >= 0)
        if mask is not None:
            valid = valid & mask
        values = jnp.where(valid, values, 0).astype(dtype)
        top = jnp.maximum(self.max_priority, jnp.max(values, initial=0))
        vetoed = veto()
        if vetoed is not None:
            top = jnp.where(vetoed, self.max_priority, top)
        return eqx.tree_at(lambda p: p.max_priority, self, top)

    def draw(
        self, key: PRNGKeyArray, batch_size: int
    ) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
        """`batch_size` leaves drawn in proportion to their masses (stratified or i.i.d.), and
        the probability of each in one i.i.d. draw (0 everywhere on an all-zero tree)."""
        return draw_leaves(self.tree, key, batch_size, self.stratified)

    def sample_faults(self, call: str, items: str) -> list[Fault]:
        """The faults of a draw (after the buffer's own "nothing stored"): every stored item
        has priority 0, or the total mass is not finite. `items` names the items."""
        return mass_faults(self.tree.total, call, items)


def mass_faults(total: Float[Array, ""], call: str, items: str) -> list[Fault]:
    """The faults of a draw from a total mass `total` (one tree's, or the sum of several):
    every stored item has priority 0, or the total is not finite."""
    return [
        (total <= 0, f"`{call}`: every stored {items} has priority 0; none can be drawn"),
        (
            ~jnp.isfinite(total),
            f"`{call}`: the total priority mass sum(priority ** priority_exponent) is not "
            "finite in the tree's dtype",
        ),
    ]


class HasPriorities(eqx.Module):
    """What both prioritised buffers show of their `Priorities`, read-only."""

    priorities: eqx.AbstractVar[Priorities]

    @property
    def tree(self) -> SumTree:
        """The sum tree of the items' masses `p ** α` (read-only)."""
        return self.priorities.tree

    @property
    def max_priority(self) -> Float[Array, "*batch"]:
        """The largest priority recorded so far (at least 1.0): what new items get."""
        return self.priorities.max_priority

    @property
    def priority_exponent(self) -> float:
        """`α`, a static Python float."""
        return self.priorities.exponent

    @property
    def stratified(self) -> bool:
        """Whether `sample` draws one item from each of `batch_size` equal slices of the mass."""
        return self.priorities.stratified


def check_beta(
    beta: Real[ArrayLike, ""], call: str, dtype: Any
) -> tuple[Float[Array, ""], list[Fault]]:
    """An importance-weight exponent: a real scalar (checked at once; a Python or NumPy number
    must be finite and non-negative), converted to the float `dtype` of the probabilities it
    weighs (`as_float`), and the faults of an array that is not finite and non-negative or
    that `dtype` cannot hold."""
    if isinstance(beta, int | float | np.integer | np.floating):
        check_nonnegative_float(beta, f"{call}(beta=...)")
    beta, faults = as_float(check_real_scalar(beta, call, "beta"), dtype, call, "beta")
    return beta, [
        *faults,
        (~(jnp.isfinite(beta) & (beta >= 0)), f"`{call}`: `beta` must be finite and non-negative"),
    ]


def weights(
    probabilities: Float[Array, "*batch"], size: Real[Array, ""], beta: Real[Array, ""]
) -> Float[Array, "*batch"]:
    """`importance_weights` without its checks."""
    dtype = probabilities.dtype
    log_n = jnp.log(size.astype(dtype))
    log_w = -beta.astype(dtype) * (log_n + jnp.log(probabilities))
    return jnp.exp(log_w - jnp.max(log_w))


def importance_weights(
    probabilities: Float[ArrayLike, "*batch"],
    size: Integer[ArrayLike, ""],
    beta: Real[ArrayLike, ""],
    *,
    throw: bool = True,
) -> Any:
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
    - `throw`: `True` (the default) raises the faults below; `False` returns them as a
        `Result`, as a `throw=False` buffer's reads do: `(weights, result)`. Inside a call of
        a buffer, the buffer decides.

    **Returns:** weights with the shape and dtype of `probabilities`, at most 1 (and the
    result, with `throw=False`).

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
    throw = check_bool(throw, "importance_weights(throw=...)")
    out, faults = recording(lambda: _weights(probabilities, size, beta), record=not throw)
    return out if faults is None else (out, result_of(faults))


def _weights(
    probabilities: Float[ArrayLike, "*batch"],
    size: Integer[ArrayLike, ""],
    beta: Real[ArrayLike, ""],
) -> Float[Array, "*batch"]:
    """`importance_weights`, its faults reported as the call decides."""
    call = "importance_weights"
    probabilities = jnp.asarray(probabilities)
    if not jnp.issubdtype(probabilities.dtype, jnp.floating):
        raise TypeError(
            f"`{call}`: `probabilities` must have a floating dtype, got {probabilities.dtype}."
        )
    # Python values are configuration, checked now; arrays are data, checked at run time.
    if isinstance(size, int | np.integer):
        check_positive_int(size, f"{call}(size=...)")
    dtype = probabilities.dtype
    size, size_faults = as_float(check_real_scalar(size, call, "size"), dtype, call, "size")
    beta, beta_faults = check_beta(beta, call, dtype)
    return check_faults(
        weights(probabilities, size, beta),
        [
            (~(probabilities > 0), f"`{call}`: probabilities must be positive"),
            *size_faults,
            (~(size > 0), f"`{call}`: `size` must be positive"),
            *beta_faults,
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

    **Returns:** an array of shape `(batch,)` in the dtype of `td_errors` (as JAX has it: a
    NumPy float64 is float32 without 64-bit mode), non-negative where the masked-in errors
    are finite. A priority is at most the largest masked-in `|δ_t|` of its row, so it is
    finite in that dtype whenever the errors are: it is computed in float32 or wider (for a
    float16 `td_errors` too), and without a sum that could overflow (a float16 row of 60000s
    has priority 60000, not inf).

    **Raises:** `TypeError`/`ValueError` at once for a non-floating `td_errors`, a non-bool
    `mask`, shapes that differ or an `eta` outside `[0, 1]`; an `eqx.error_if` error for a
    finite NumPy `td_errors` too large for that dtype (a float64 past the float32 range).

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
    # Not `jnp.asarray`: a NumPy float64 too large for float32 would become inf unseen.
    td_errors = td_errors if isinstance(td_errors, jax.Array) else np.asarray(td_errors)
    mask = jnp.asarray(mask)
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
    dtype = jax.dtypes.canonicalize_dtype(td_errors.dtype)
    td_errors, faults = as_float(td_errors, dtype, call, "td_errors")
    # In float32 at least (a float16 mean of long rows loses precision), and without a sum
    # that could overflow where the answer does not (a float16 row of 60000s sums to inf):
    # each error is divided by the row's count before the sum, and the mixture is written as
    # the largest error less a non-negative part, so it never passes the largest error.
    # (Scaling by the largest error instead fails on CPU: 1 / 3e38 is flushed to zero.)
    wide = jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype
    magnitude = jnp.where(mask, jnp.abs(td_errors).astype(wide), 0)
    largest = jnp.max(magnitude, axis=1)
    size = jnp.maximum(jnp.sum(mask, axis=1, dtype=wide), 1)
    mean = jnp.sum(magnitude / size[:, None], axis=1)
    below = jnp.maximum(largest - mean, 0)
    priority = jnp.where(jnp.isfinite(largest), largest - (1 - eta) * below, largest)
    return check_faults(priority.astype(dtype), faults)
