"""Policy age: how old the data a learner samples may be, and how much older data weighs. The
one home of the age law, shared by every buffer's `sample_by_age`.

A stored item (a step, for the trajectory buffers) carries the version of the policy that
produced it; its *age* is the learner's current version minus that. `sample_by_age` enumerates
the candidates (the stored items, the admissible window starts, the sum-tree leaves), weighs
each by its buffer's own law times its age weight, and draws by inverse CDF over the cumulative
sum: O(candidates) per call, where `sample` is O(batch).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, UInt32

from ._checks import check_index, check_index_fn, check_nonnegative_int, INT32_MAX, spec_of
from ._faults import check_faults, Fault
from ._priorities import Priorities
from ._storage import CircularBuffer, stored_mask
from ._streams import step_backs, Streams


Decay = Literal["inverse"]


class PolicyAge(eqx.Module):
    """Which stored data is young enough to sample, and how much each age weighs: the argument
    of every buffer's `sample_by_age`.

    Each stored item (each step, for trajectory buffers) records the version of the policy that
    produced it, an integer leaf that `version` reads. Its *age* is `current - version`: the
    number of learner updates since. `sample_by_age` admits the candidates of age at most
    `max_age` and draws them with probability

    `P(i) ∝ m_i · a_i`, `a_i = 1` (`decay=None`) or `1 / (age_i + 1)` (`decay="inverse"`, as
    torchrl weighs stale data),

    where `m_i` is the buffer's own law: 1 for `UniformReplay`, the window-start law
    `r ** distribution_power` for `TrajectoryBuffer`, the mass `priority ** priority_exponent`
    for the prioritised buffers. A window's age is that of its first step.

    The target distribution is `q_i ∝ ℓ_i · a_i` over the admitted candidates, where `ℓ_i` is
    the part of the law that is chosen rather than corrected: all of it for `UniformReplay`
    and `TrajectoryBuffer` (so `P = q`), none of it for the prioritised buffers (their
    priorities are a bias to correct). The importance weights are
    `w_i = (q_i / P_i) ** β / max_j (q_j / P_j) ** β` over the batch, that is
    `m_i ** -β / max_j m_j ** -β` for the prioritised buffers (exactly `importance_weights` of
    `sample` when every item is admitted and `decay=None`) and 1 for the others.

    A stored version greater than `current` (data from the future: a version counter that
    went wrong) is an error, as is a negative one.

    `PolicyAge` is a pytree: `current` and `max_age` are int32 arrays (traced under `jit`, so
    a new version recompiles nothing), `version` and `decay` are static. `version` is compared
    by identity: keep one function object (a module-level `def`); a fresh `lambda` in every
    call compiles the step that uses it again.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        def version(item):
            return item["policy_version"]

        item = {"obs": jnp.zeros(3), "policy_version": jnp.zeros((), jnp.int32)}
        buf = dx.UniformReplay(item, max_size=100)
        buf = buf.add_batch(
            {"obs": jnp.ones((6, 3)), "policy_version": jnp.arange(6, dtype=jnp.int32)}
        )
        age = dx.PolicyAge(version, current=5, max_age=2, decay="inverse")
        s = buf.sample_by_age(jax.random.key(0), 32, age)
        assert (s.ages <= 2).all() and (s.items["policy_version"] >= 3).all()
        ```
    """

    version: Callable[[PyTree[Array]], Integer[ArrayLike, ""]] = eqx.field(static=True)
    current: Int[Array, ""]
    """The learner's current policy version, an int32 scalar in `[0, 2**31 - 1]`."""
    max_age: Int[Array, ""]
    """The largest admitted age, an int32 scalar in `[0, 2**31 - 1]`."""
    decay: Decay | None = eqx.field(static=True)

    def __init__(
        self,
        version: Callable[[PyTree[Array]], Integer[ArrayLike, ""]],
        current: Integer[ArrayLike, ""],
        max_age: Integer[ArrayLike, ""] | None = None,
        *,
        decay: Decay | None = None,
    ):
        """**Arguments:**

        - `version`: `version(item) -> int scalar`, the policy version stored in one item
            (one step), e.g. `lambda item: item["policy_version"]`. Traceable; any integer
            dtype. Static, compared by identity.
        - `current`: the learner's current version, an integer scalar (a Python int or an
            array, which may be traced), in `[0, 2**31 - 1]`.
        - `max_age`: the largest admitted age, an integer scalar in `[0, 2**31 - 1]` (may
            be traced); `None` (the default) admits every age.
        - `decay`: `None` (the default: every admitted age weighs the same) or `"inverse"`
            (age `k` weighs `1 / (k + 1)`).

        **Raises:** `TypeError`/`ValueError` at once for a `version` that is not callable, a
        non-integer `current` or `max_age`, a negative Python int, or an unknown `decay`; an
        `eqx.error_if` error for an array `current` or `max_age` out of range.
        """
        call = "PolicyAge"
        if not callable(version):
            raise TypeError(
                f"`{call}(version=...)` must be a function `item -> policy version`, got "
                f"{version!r}."
            )
        if decay is not None and decay != "inverse":
            raise ValueError(
                f"`{call}(decay=...)` must be None (every admitted age weighs the same) or "
                f"'inverse' (age k weighs 1 / (k + 1)), got {decay!r}."
            )
        current, current_faults = _count(current, f"{call}(current=...)")
        if max_age is None:
            limit, limit_faults = jnp.asarray(INT32_MAX, jnp.int32), []
        else:
            limit, limit_faults = _count(max_age, f"{call}(max_age=...)")
        self.version = version
        self.decay = decay
        self.current, self.max_age = check_faults((current, limit), current_faults + limit_faults)

    def log_weights(self, ages: Int[Array, "*n"], dtype: Any) -> Float[Array, "*n"]:
        """The log of each age's weight `a` in the float `dtype`: 0 (`decay=None`) or
        `-log(age + 1)` (`"inverse"`) for an age in `[0, max_age]`, `-inf` outside."""
        young = (ages >= 0) & (ages <= self.max_age)
        if self.decay is None:
            log_a = jnp.zeros(ages.shape, dtype)
        else:
            log_a = -jnp.log1p(jnp.maximum(ages, 0).astype(dtype))
        return jnp.where(young, log_a, -jnp.inf).astype(dtype)


def _count(value: Any, call: str) -> tuple[Int[Array, ""], list[Fault]]:
    """A version number or an age limit: an int32 scalar in `[0, 2**31 - 1]`. A Python or
    NumPy int is checked at once; an array at run time (the returned faults)."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return jnp.asarray(check_nonnegative_int(int(value), call), jnp.int32), []
    number, bad = check_index(value, INT32_MAX + 1, call, ndim=0)
    return number, [(bad, f"`{call}` must be in [0, 2**31 - 1]")]


class AgedSample(NamedTuple):
    """What `sample_by_age` returns (every buffer's): the rows, where they came from, their
    ages, and their exact probabilities and importance weights (see `PolicyAge`).

    **Fields:**

    - `items`: the rows, as the buffer's `sample` gives them: a pytree of items with a
        leading `batch` axis (`UniformReplay`, `PrioritisedReplay`), or the windows as a
        `SequenceSample` (`TrajectoryBuffer`, `PrioritisedTrajectoryBuffer`: their steps are
        `items.items`, and `(items.env, items.start)` is each window's stamp).
    - `indices`: int32 `(batch,)`: the storage slot of each item (the replays), the sum-tree
        leaf of each window (`PrioritisedTrajectoryBuffer`), or the slot of each window's
        first step, as `env * max_length + slot` (`TrajectoryBuffer`).
    - `ages`: int32 `(batch,)`, each row's age, `current - version` (of its first step for a
        window), in `[0, max_age]`.
    - `probabilities`: `(batch,)`, the probability of drawing each row in one i.i.d. draw,
        `P(i)`.
    - `weights`: `(batch,)`, the importance weights toward the age-weighted target, at most
        1; all 1 for `UniformReplay` and `TrajectoryBuffer`.
    - `generations`: uint32 `(batch,)`, the write generation of each slot
        (`PrioritisedReplay`, for `set_priorities(..., generations=...)`), else `None`.
    """

    items: Any
    indices: Int[Array, " batch"]
    ages: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]
    generations: UInt32[Array, " batch"] | None = None


class AgeDraw(NamedTuple):
    """What `draw_by_age` returns: the drawn candidates (flat indices) and, per row, the
    fields of an `AgedSample` after `items` (`AgedSample(items, *draw)`)."""

    indices: Int[Array, " batch"]
    ages: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]


def read_ages(
    age: PolicyAge, data: PyTree[Array], stored: Bool[Array, "*s"], call: str, what: str
) -> tuple[Int[Array, "*s"], list[Fault]]:
    """The age of every stored item of `data` (leaves with the leading axes of `stored`:
    `(max_size,)` slots, `(num_envs, max_length)` steps), and the fault of a stored version
    outside `[0, current]`. `version` is checked at trace time to map one item to an integer
    scalar; it is mapped over every slot (it reads one leaf: XLA reads only that one).
    `what` names an item in the message."""
    axes = stored.ndim
    check_index_fn(spec_of(data, axes), age.version, "PolicyAge(version=...)")
    read = age.version
    for _ in range(axes):
        read = jax.vmap(read)
    # Checked in its own dtype before the cast to int32; a bad one reads as 2**31 - 1.
    version, bad = check_index(read(data), INT32_MAX + 1, "PolicyAge(version=...)")
    future = stored & (bad | (version > age.current))
    message = (
        f"`{call}`: a stored {what} has a policy version greater than `current` (or negative); "
        "every stored version must be in [0, current]"
    )
    return age.current - version, [(future, message)]


def read_step_ages(
    age: PolicyAge, streams: Streams, call: str
) -> tuple[Int[Array, "num_envs max_length"], Int[Array, "num_envs max_length"], list[Fault]]:
    """`read_ages` over every stored step of `streams`: the back distance of each slot
    (`step_backs`), the age of the step it holds, and the fault of a stored version outside
    `[0, current]`."""
    back = step_backs(streams)
    ages, faults = read_ages(age, streams.data, back <= streams.lengths[:, None], call, "step")
    return back, ages, faults


def draw_items_by_age(
    key: PRNGKeyArray,
    batch_size: int,
    age: PolicyAge,
    storage: CircularBuffer,
    priorities: Priorities | None = None,
    *,
    beta: Float[Array, ""] | None = None,
    call: str,
) -> tuple[AgeDraw, list[Fault]]:
    """`read_ages` and `draw_by_age` over the slots of a replay's `storage`, whose own law is
    1 on every stored slot, times the masses of `priorities` (one leaf per slot; drawn
    i.i.d. or stratified as they say) if given: the draw, and the faults of both."""
    stored = stored_mask(storage)
    ages, faults = read_ages(age, storage.data, stored, call, "item")
    law = jnp.where(stored, 0.0, -jnp.inf)
    log_mass = None if priorities is None else jnp.log(priorities.tree.leaves)
    stratified = priorities is not None and priorities.stratified
    draw, more = draw_by_age(
        key,
        batch_size,
        age,
        ages,
        law,
        log_mass,
        beta=beta,
        stratified=stratified,
        call=call,
        what="item",
    )
    return draw, faults + more


def draw_by_age(
    key: PRNGKeyArray,
    batch_size: int,
    age: PolicyAge,
    ages: Int[Array, "*n"],
    log_law: Float[Array, "*n"],
    log_mass: Float[Array, "*n"] | None = None,
    *,
    beta: Float[Array, ""] | None = None,
    stratified: bool = False,
    call: str,
    what: str,
) -> tuple[AgeDraw, list[Fault]]:
    """Draw `batch_size` candidates with `P(i) ∝ exp(log_law_i + log_mass_i) · a(age_i)` over
    those of age in `[0, max_age]`, by inverse CDF over the cumulative sum of the weights
    (i.i.d., or one draw from each of `batch_size` equal slices when `stratified`).

    **Arguments:**

    - `ages`, `log_law`, `log_mass`: one entry per candidate (any shape, the same for all;
        flat indices in the result). `log_law` is the chosen part of the law (`-inf` where a
        candidate is not stored or not admissible), `log_mass` the part the importance
        weights correct (`None`: none; weights 1). Computed in the dtype of `log_mass`
        (float32 without it).
    - `beta`: the importance-weight exponent (with `log_mass`).
    - `call`, `what`: the call and the name of a candidate, for messages.

    Every finite weight is used as it is: the weights are scaled by the largest before
    they are summed, so none overflows (a candidate below about `1e-38` of the heaviest
    underflows to weight 0, and is never drawn). The caller reports, before this draw's
    faults, its own: nothing stored or admissible, a mass that is not finite.

    **Returns:** an `AgeDraw`, and the fault of no candidate young enough. Where a fault
    holds the draw is meaningless but in bounds.
    """
    dtype = jnp.float32 if log_mass is None else log_mass.dtype
    log_p = log_law.reshape(-1).astype(dtype)
    if log_mass is not None:
        log_p = log_p + log_mass.reshape(-1)
    ages = ages.reshape(-1)
    log_p = log_p + age.log_weights(ages, dtype)
    # Scaled so that the largest weight is 1.
    top = jnp.max(log_p)
    weight = jnp.exp(log_p - jnp.where(jnp.isfinite(top), top, 0))
    cdf = jnp.cumsum(weight)
    total = cdf[-1]
    u = jax.random.uniform(key, (batch_size,), dtype)
    if stratified:
        x = (jnp.arange(batch_size, dtype=dtype) + u) * (total / batch_size)
    else:
        x = u * total
    # The first candidate whose cumulative weight exceeds x: never one of weight 0, whose
    # cumulative weight equals its predecessor's. Rounding that puts x at the total is
    # clipped to the last candidate of positive weight.
    index = jnp.searchsorted(cdf, x, side="right", method="scan_unrolled")
    last = weight.shape[0] - 1 - jnp.argmax(weight[::-1] > 0)
    index = jnp.minimum(index, last).astype(jnp.int32)
    positive = total > 0
    probabilities = jnp.where(positive, weight[index] / jnp.where(positive, total, 1), 0)
    if log_mass is None or beta is None:
        weights = jnp.ones(batch_size, dtype)
    else:
        # (q / P) ** β ∝ mass ** -β: the age weight and the chosen law cancel out.
        log_w = -beta.astype(dtype) * log_mass.reshape(-1)[index]
        weights = jnp.exp(log_w - jnp.max(log_w))
    draw = AgeDraw(index, ages[index], probabilities, weights)
    fault = (
        ~positive,
        f"`{call}`: every {what} that could be drawn is older than `max_age` (its age, "
        f"`current` minus its policy version, is above `max_age`); no {what} can be drawn",
    )
    return draw, [fault]
