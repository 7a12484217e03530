"""Policy age: how old the data a learner samples may be, and how much older data weighs. The
one home of the age law: `AgedLaw` reweighs any law whose candidates can be listed, so every
buffer's `sample(..., age=...)` and every layer over it (a global buffer's draw) share it.

A stored item (a step, for the trajectory buffers) carries the version of the policy that
produced it; its *age* is the learner's current version minus that. An aged draw enumerates
the candidates (the stored items, the admissible window starts, the sum-tree leaves), weighs
each by its buffer's own law times its age weight, and draws by inverse CDF over the cumulative
sum: O(candidates) per call, where a plain `sample` is O(batch).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, UInt32

from ._checks import check_index, check_index_fn, check_nonnegative_int, INT32_MAX, spec_of
from ._faults import Fault, is_concrete
from ._laws import (
    AbstractEnumerableLaw,
    AbstractLaw,
    Draw,
    draw_weighed,
    find_weighed,
    in_union,
    mixture_rows,
    MixtureRows,
    probability,
    union_scales,
    weights_summary,
)


Decay = Literal["inverse"]


class PolicyAge(eqx.Module):
    """Which stored data is young enough to sample, and how much each age weighs: the argument
    of every buffer's `sample(..., age=...)`.

    Each stored item (each step, for trajectory buffers) records the version of the policy that
    produced it, an integer leaf that `version` reads. Its *age* is `current - version`: the
    number of learner updates since. `sample(..., age=age)` admits the candidates of age at most
    `max_age` and draws them with probability

    `P(i) ∝ m_i · a_i`, `a_i = 1` (`decay=None`) or `1 / (age_i + 1)` (`decay="inverse"`, as
    torchrl weighs stale data),

    where `m_i` is the buffer's own law: 1 for `UniformReplay`, the window-start law
    `r ** distribution_power` for `TrajectoryBuffer`, the mass `priority ** priority_exponent`
    for the prioritised buffers. A window's age is that of its first step. A
    `ClusteredReplay` draws a cluster as its `sample` does, among the clusters that hold a
    young enough item, then an item of it by its inner replay's aged law; a global buffer
    draws by the aged law of all its shards' candidates together.

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
        s = buf.sample(jax.random.key(0), 32, age=age)
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
        self.version = version
        self.decay = decay
        self.current = _count(current, f"{call}(current=...)")
        self.max_age = (
            jnp.asarray(INT32_MAX, jnp.int32)
            if max_age is None
            else _count(max_age, f"{call}(max_age=...)")
        )

    def faults(self) -> list[Fault]:
        """The faults of an array `current` or `max_age` out of range (kept as -1 until
        then), reported by the call that uses the age, as that call reports its own."""
        return [
            (self.current < 0, "`PolicyAge(current=...)` must be in [0, 2**31 - 1]"),
            (self.max_age < 0, "`PolicyAge(max_age=...)` must be in [0, 2**31 - 1]"),
        ]

    def log_weights(self, ages: Int[Array, "*n"], dtype: Any) -> Float[Array, "*n"]:
        """The log of each age's weight `a` in the float `dtype`: 0 (`decay=None`) or
        `-log(age + 1)` (`"inverse"`) for an age in `[0, max_age]`, `-inf` outside."""
        young = (ages >= 0) & (ages <= self.max_age)
        if self.decay is None:
            log_a = jnp.zeros(ages.shape, dtype)
        else:
            log_a = -jnp.log1p(jnp.maximum(ages, 0).astype(dtype))
        return jnp.where(young, log_a, -jnp.inf).astype(dtype)


def _count(value: Any, call: str) -> Int[Array, ""]:
    """A version number or an age limit: an int32 scalar in `[0, 2**31 - 1]`. A Python or
    NumPy int is checked at once; an array out of range becomes -1, which `PolicyAge.faults`
    reports when the age is used (so that a `throw=False` buffer records it, and nothing is
    compiled where the age is made)."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return jnp.asarray(check_nonnegative_int(int(value), call), jnp.int32)
    number, bad = check_index(value, INT32_MAX + 1, call, ndim=0)
    if is_concrete(bad) and bool(bad):  # an eager value: refused at once, where it is made
        raise eqx.EquinoxRuntimeError(f"`{call}` must be in [0, 2**31 - 1]")
    return jnp.where(bad, -1, number)


class AgedSample(NamedTuple):
    """What `sample(..., age=...)` returns (every buffer's): the rows, where they came from, their
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
        `P(i)` (for a `ClusteredReplay`, within the row's cluster, as its plain sample's).
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


@mixture_rows.register
def _(sample: AgedSample) -> MixtureRows:
    return MixtureRows(mixture_rows(sample.items).rows, sample.weights)


class AgedLaw(AbstractLaw):
    """A law reweighed by policy age: the candidates of `base` of age at most `age.max_age`,
    each with its weight under `base` times its age weight (see `PolicyAge`). Drawn by
    inverse CDF over the cumulative weights of every candidate: O(candidates) per draw.

    Over a union, each buffer's weights are scaled by its own largest weight (so that none
    overflows) and summarised by that scale and their sum; the draw puts them on one scale,
    picks the buffer whose slice of the total holds each target, and that buffer finds the
    candidate in its own cumulative weights.
    """

    base: AbstractEnumerableLaw
    age: PolicyAge
    beta: Float[Array, ""] | None
    count: int = eqx.field(static=True)  # the base's candidates per buffer
    stratified: bool = eqx.field(static=True)
    noun: str = eqx.field(static=True)  # what a candidate is, for messages

    @property
    def independent_rows(self) -> bool:
        return not self.stratified

    def __init__(
        self,
        base: AbstractEnumerableLaw,
        buffer: Any,
        age: PolicyAge,
        *,
        beta: Float[Array, ""] | None = None,
        stratified: bool = False,
        noun: str = "item",
        call: str = "AgedLaw",
    ):
        """**Arguments:**

        - `base`: the law to reweigh, one whose candidates can be listed.
        - `buffer`: a buffer of the configuration it is drawn from (only its static
            configuration is read: how many candidates it has).
        - `age`: a `PolicyAge`.
        - `beta`: the exponent of the importance weights that correct `base`'s masses
            (`None`: weights of 1, for a law without masses to correct).
        - `stratified`: one draw from each of `batch_size` equal slices of the total, else
            i.i.d.
        - `noun`: what a candidate is, for messages ("item", "window start").
        - `call`: the call the law is made for, for messages.

        **Raises:** `TypeError` at once if `age` is not a `PolicyAge`.
        """
        if not isinstance(age, PolicyAge):
            raise TypeError(
                f"`{call}(age=...)` must be a `dx.PolicyAge`, got {type(age).__name__}."
            )
        self.base, self.age, self.beta = base, age, beta
        self.count = base.num_candidates(buffer)
        self.stratified, self.noun = stratified, noun

    def _weigh(
        self, buffer: Any
    ) -> tuple[Float[Array, " c"], Int[Array, " c"], Bool[Array, ""], Float[Array, " c"] | None]:
        """Per candidate of `buffer`: the log of its weight, its age, and (for the buffer)
        whether a stored version is out of range, and the log masses."""
        c = self.base.candidates(buffer)
        dtype = jnp.float32 if c.log_mass is None else c.log_mass.dtype
        spec = spec_of(c.items, 1)
        check_index_fn(spec, self.age.version, "PolicyAge(version=...)")
        # `version` reads one leaf: XLA reads only that one of every stored item.
        versions = jax.vmap(self.age.version)(c.items)
        # Checked in its own dtype before the cast to int32; a bad one reads as 2**31 - 1.
        version, bad = check_index(versions, INT32_MAX + 1, "PolicyAge(version=...)")
        future = jnp.any(c.stored & (bad | (version > self.age.current)))
        if c.dates is not None:
            version = version[c.dates]
        ages = self.age.current - version
        log_p = c.log_law.astype(dtype)
        if c.log_mass is not None:
            log_p = log_p + c.log_mass
        log_p = log_p + self.age.log_weights(ages, dtype)
        return log_p, ages, future, c.log_mass

    def summary(self, buffer: Any) -> PyTree[Array]:
        log_p, _, future, _ = self._weigh(buffer)
        return self.base.summary(buffer), *weights_summary(log_p), future

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        _, tops, totals, _ = summaries
        return draw_weighed(key, batch_size, tops, totals, self.stratified)

    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        log_p, ages, _, log_mass = self._weigh(buffer)
        index, weight = find_weighed(log_p, at)
        mass = jnp.zeros_like(weight) if log_mass is None else log_mass
        rows = self.base.read_candidates(buffer, index)
        return (
            rows,
            index,
            ages[index],
            weight[index],
            mass[index],
            self.base.generations(buffer, index),
        )

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> AgedSample:
        rows, index, ages, weight, log_mass, generations = rows
        scale, masses = union_scales(*summaries[1:3])
        probabilities = probability(weight * scale[draw.owner], jnp.sum(masses))
        if self.beta is None:
            weights = jnp.ones_like(probabilities)
        else:
            # (q / P) ** β ∝ mass ** -β: the age weight and the chosen law cancel out.
            log_w = -self.beta.astype(log_mass.dtype) * log_mass
            weights = jnp.exp(log_w - jnp.max(log_w)).astype(probabilities.dtype)
        rows = self.base.name_candidates(rows, draw.owner, summaries[0])
        indices = in_union(draw.owner, index, self.count)
        return AgedSample(rows, indices, ages, probabilities, weights, generations)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return jnp.sum(union_scales(*summaries[1:3])[1]) > 0

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        base, _, _, future = summaries
        noun = self.noun
        return [
            *self.age.faults(),
            *self.base.faults(base, call),
            (
                jnp.any(future),
                f"`{call}`: a stored {_item_of(noun)} has a policy version greater than "
                "`current` (or negative); every stored version must be in [0, current]",
            ),
            (
                self.base.available(base) & ~self.available(summaries),
                f"`{call}`: every {noun} that could be drawn is older than `max_age` (its "
                f"age, `current` minus its policy version, is above `max_age`); no {noun} "
                "can be drawn",
            ),
        ]


def _item_of(noun: str) -> str:
    """What is dated, for a candidate `noun`: a window start is dated by its step."""
    return "step" if "window" in noun else "item"
