"""Prioritised replay of windows of per-env streams: one sum-tree leaf per period-aligned
start."""

from typing import NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, Real

from ._checks import (
    check_bool,
    check_faults,
    check_float_dtype,
    check_index,
    check_nonnegative_float,
    check_positive_int,
    check_real_scalar,
    check_sequences,
    check_vector,
    INT32_MAX,
    Prototype,
)
from ._prioritised import importance_weights
from ._sequences import count_starts, Law
from ._sum_tree import draw_leaves, MAX_CAPACITY, priority_mass, set_leaves, SumTree
from ._trajectory import (
    EpisodeEnds,
    LeafName,
    SequenceSample,
    TrajectoryBuffer,
)


_PT = TypeVar("_PT", bound="PrioritisedTrajectoryBuffer")


class PrioritisedSequenceSample(NamedTuple):
    """What `PrioritisedTrajectoryBuffer.sample` returns.

    **Fields:**

    - `sample`: the windows, a `SequenceSample` `(items, mask, learn, env, start)`;
        `(sample.env, sample.start)` are the stamps `set_priorities` takes back.
    - `indices`: int32 `(batch,)`, each window's leaf in the sum tree (`env * slots_per_env +
        (start // period) % slots_per_env`).
    - `probabilities`: `(batch,)`, the probability of drawing each window in one i.i.d. draw.
    - `weights`: `(batch,)`, the importance weights for the `beta` of the call
        (`importance_weights(probabilities, num_windows, beta)`), at most 1.
    """

    sample: SequenceSample
    indices: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]


class PrioritisedTrajectoryBuffer(eqx.Module):
    """Per-env streams whose windows are replayed by priority (R2D2, Ape-X with sequences,
    MuZero).

    A `TrajectoryBuffer` underneath keeps each env's last `max_length` steps, added
    asynchronously (`env_ids`) or in lock-step. The items are the windows of
    `W = burn_in + sequence_length + bootstrap` steps that start on a multiple of `period`
    in their env's absolute step count and lie wholly in the stored stream:

    - a window *becomes admissible* when its last step is added, and then gets the largest
        priority recorded so far (`max_priority`, at least 1);
    - a window *leaves* when its first step is overwritten: its priority is 0 from that add
        on, exactly, whatever subset of envs each add touches;
    - `sample` draws windows with probability `P ∝ p ** priority_exponent` (i.i.d. or
        stratified), returns them with their sum-tree indices, probabilities and importance
        weights, and `(env, start)` stamps;
    - `set_priorities(env_ids, starts, priorities)` takes the stamps back and drops the
        entries whose window has left since it was sampled, so a delayed update never lands
        on a newer window; `stale` says which.

    The sum tree has one leaf per `(env, start // period mod (max_length // period))`. When
    `period` does not divide `max_length`, the window must be longer than `max_length mod
    period`, so that two stored windows never share a leaf. Its nodes are always recomputed
    from their children (no accumulated deltas), and a leaf of priority 0 is never drawn.

    `PrioritisedTrajectoryBuffer` is final: it is not meant to be subclassed.
    """

    trajectories: TrajectoryBuffer
    tree: SumTree
    max_priority: Float[Array, ""]
    sequence_length: int = eqx.field(static=True)
    burn_in: int = eqx.field(static=True)
    bootstrap: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    priority_exponent: float = eqx.field(static=True)
    stratified: bool = eqx.field(static=True)

    def __init__(
        self,
        prototype: Prototype,
        num_envs: int,
        max_length: int,
        sequence_length: int,
        *,
        burn_in: int = 0,
        bootstrap: int = 0,
        period: int = 1,
        priority_exponent: float = 0.6,
        stratified: bool = False,
        dtype=jnp.float32,
    ):
        """**Arguments:**

        - `prototype`, `num_envs`, `max_length`: as for `TrajectoryBuffer`.
        - `sequence_length`, `burn_in`, `bootstrap`: the window, as for
            `TrajectoryBuffer.sample` (`W` at most `max_length`).
        - `period`: a positive int, at most `max_length` (default 1). If it does not divide
            `max_length`, `W` must exceed `max_length mod period`.
        - `priority_exponent`: `α >= 0` (default 0.6).
        - `stratified`: draw one window from each of `batch_size` equal slices of the total
            mass (default `False`: i.i.d. draws).
        - `dtype`: the float dtype of the priority sums (`jnp.float32` by default).
        """
        call = "PrioritisedTrajectoryBuffer"
        self.trajectories = TrajectoryBuffer(prototype, num_envs, max_length)
        windows = self.trajectories._windows(
            call, sequence_length, burn_in, bootstrap, period, True, "cross", None
        )
        self.sequence_length, self.burn_in = windows.length, windows.burn_in
        self.bootstrap, self.period = bootstrap, windows.law.period
        slots, spare = divmod(max_length, self.period)
        if slots == 0:
            raise ValueError(
                f"`{call}(period=...)` must be at most max_length = {max_length}, got "
                f"{self.period}."
            )
        if self.window <= spare:
            raise ValueError(
                f"`{call}(period=...)`: with max_length = {max_length} and period = "
                f"{self.period}, each env has max_length // period = {slots} window slots, "
                f"reused as its stream wraps; two stored windows would share one unless a "
                f"window is longer than max_length mod period = {spare} steps, and it has "
                f"{self.window}. Make max_length a multiple of period, or the window longer."
            )
        capacity = num_envs * (max_length // self.period)
        if capacity > MAX_CAPACITY:
            raise ValueError(
                f"`{call}`: num_envs * (max_length // period) = {capacity} windows, more than the "
                f"sum tree's {MAX_CAPACITY}."
            )
        self.priority_exponent = check_nonnegative_float(
            priority_exponent, f"{call}(priority_exponent=...)"
        )
        self.stratified = check_bool(stratified, f"{call}(stratified=...)")
        dtype = check_float_dtype(dtype, f"{call}(dtype=...)")
        self.tree = SumTree(capacity, dtype)
        self.max_priority = jnp.asarray(1.0, dtype)

    @property
    def item_spec(self) -> PyTree[jax.ShapeDtypeStruct]:
        """The structure, shape and dtype of one step, as `jax.ShapeDtypeStruct` leaves."""
        return self.trajectories.item_spec

    @property
    def window(self) -> int:
        """`W = burn_in + sequence_length + bootstrap`, the steps of a window."""
        return self.burn_in + self.sequence_length + self.bootstrap

    @property
    def slots_per_env(self) -> int:
        """`max_length // period`: the sum-tree leaves of one env."""
        return self.trajectories.max_length // self.period

    @property
    def num_windows(self) -> Int[Array, ""]:
        """The number of admissible windows (those of positive or zero priority that may be
        drawn once their priority is positive), an int32 scalar."""
        return jnp.sum(self._starts_per_env(), dtype=jnp.int32)

    def _starts_per_env(self) -> Int[Array, " num_envs"]:
        t = self.trajectories
        law = Law(self.window, self.period, strict=True)
        return count_starts(t.replay_length, t._phase(law), law)

    def _leaf(self, env: Int[Array, "*n"], start: Int[Array, "*n"]) -> Int[Array, "*n"]:
        k = self.slots_per_env
        return env * k + (start // self.period) % k

    def add(
        self: _PT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _PT:
        """Append one step to the stream of each listed env (as `TrajectoryBuffer.add`).

        For each listed env, the window whose first step this add overwrites leaves (priority
        0), and the window whose last step this add writes becomes admissible (priority
        `max_priority`), when they start on a multiple of `period`.

        **Raises:** as `TrajectoryBuffer.add`.
        """
        trajectories = self.trajectories.add(items, env_ids)
        # Checked by the add above (a fault raises there); here only kept in bounds.
        rows, valid = self._rows(env_ids, trajectories.num_envs, "PrioritisedTrajectoryBuffer.add")
        if rows.shape[0] == 0:
            return self
        count = trajectories.step_count[rows]  # after the add: the new step is count - 1
        m, w, p = trajectories.max_length, self.window, self.period
        gone = count - 1 - m  # the start whose first step was just overwritten
        new = count - w  # the start whose last step was just written
        enter = valid & (new >= 0) & (new % p == 0)
        leave = valid & (gone >= 0) & (gone % p == 0)
        enter_leaf = self._leaf(rows, jnp.maximum(new, 0))
        leave_leaf = self._leaf(rows, jnp.maximum(gone, 0))
        # One update of the tree for both. The two leaves of a row differ unless W = 1, where
        # the window that leaves and the one that enters share a slot: then only the entering
        # one is written. Rows are distinct envs, so every kept leaf is distinct.
        leave = leave & ~(enter & (leave_leaf == enter_leaf))
        mass = self._mass(self.max_priority)
        tree = set_leaves(
            self.tree,
            jnp.concatenate([leave_leaf, enter_leaf]),
            jnp.concatenate(
                [jnp.zeros(rows.shape, mass.dtype), jnp.broadcast_to(mass, rows.shape)]
            ),
            mask=jnp.concatenate([leave, enter]),
            unique=True,
        )
        return eqx.tree_at(lambda b: (b.trajectories, b.tree), self, (trajectories, tree))

    def extend(
        self: _PT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _PT:
        """Append `T` consecutive steps to the stream of each listed env: the same as `T`
        calls of `add`, in one write and one update of the sum tree (as
        `TrajectoryBuffer.extend`).

        Every window that leaves during the `T` steps gets priority 0, and every window that
        becomes admissible and is still stored at the end gets `max_priority`; the other
        windows keep theirs.

        **Raises:** as `TrajectoryBuffer.extend`.
        """
        call = "PrioritisedTrajectoryBuffer.extend"
        items, n, length = check_sequences(self.item_spec, items, call)
        if length == 1:  # the cheaper update of one step
            return self.add(jax.tree.map(lambda x: x[:, 0], items), env_ids)
        if length == 0:
            return self
        trajectories = self.trajectories._append(items, n, length, env_ids, call)
        rows, valid = self._rows(env_ids, trajectories.num_envs, call)
        if rows.shape[0] == 0:
            return self
        t = trajectories
        count = t.step_count[rows]  # after the add
        before = count - length
        first = count - t.replay_length[rows]  # the oldest stored step
        m, w, p = t.max_length, self.window, self.period
        # A slot can change only if a window of it enters (its last step is among the new
        # ones) or leaves (its first step is overwritten): at most ceil(T / p) starts each.
        # The value of such a slot after the add is a function of the slot alone, so the
        # candidates may repeat a slot: every copy writes the same.
        per = -(-length // p)
        k = (jnp.arange(per, dtype=jnp.int32) * p)[None, :]
        enter = _ceil_to(before - w + 1, p)[:, None] + k  # last step in (before, count]
        leave = _ceil_to(before - m, p)[:, None] + k  # first step in [before - m, count - m)
        starts = jnp.concatenate([enter, leave], axis=1)
        touched = valid[:, None] & jnp.concatenate(
            [enter <= (count - w)[:, None], leave < (count - m)[:, None]], axis=1
        )
        touched = touched & (starts >= 0)
        slot = (jnp.maximum(starts, 0) // p) % self.slots_per_env
        # The slot's admissible start after the add, if it is still stored (a negative
        # `latest`, no start yet, is below `first >= 0`).
        latest = self._latest_start(count[:, None], slot)
        stored = latest >= first[:, None]
        entered = latest > (before - w)[:, None]
        write = touched & (~stored | entered)
        mass = jnp.where(stored, self._mass(self.max_priority), 0)
        tree = set_leaves(
            self.tree,
            (rows[:, None] * self.slots_per_env + slot).reshape(-1),
            mass.reshape(-1),
            mask=write.reshape(-1),
        )
        return eqx.tree_at(lambda b: (b.trajectories, b.tree), self, (trajectories, tree))

    def _latest_start(self, count: Int[Array, "*#s"], slot: Int[Array, "*#s"]) -> Int[Array, "..."]:
        """The latest start `s = j * period <= count - W` with `j ≡ slot (mod slots_per_env)`:
        the window a slot holds once an env has taken `count` steps, if any is stored."""
        k = self.slots_per_env
        j_max = (count - self.window) // self.period
        return (j_max - (j_max - slot) % k) * self.period

    def _rows(
        self, env_ids: Integer[ArrayLike, " n"] | None, num_envs: int, call: str
    ) -> tuple[Int[Array, " n"], Bool[Array, " n"]]:
        """The rows an add touched, and which are valid (checked by the add itself)."""
        if env_ids is None:
            return jnp.arange(num_envs, dtype=jnp.int32), jnp.ones(num_envs, jnp.bool_)
        rows, bad = check_index(env_ids, num_envs, f"{call}(env_ids=...)")
        return jnp.where(bad, 0, rows), ~bad

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        *,
        beta: Real[ArrayLike, ""] = 1.0,
        episode_ends: EpisodeEnds = "cross",
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> PrioritisedSequenceSample:
        """Draw `batch_size` windows with probabilities `P ∝ p ** priority_exponent`, with
        replacement.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: a positive Python int (static).
        - `beta`: the importance-weight exponent `β >= 0` (default 1; may be traced).
        - `episode_ends`, `done`: how windows are cut at episode ends, as for
            `TrajectoryBuffer.sample` (they change masks, not which windows are drawn).

        **Returns:** a `PrioritisedSequenceSample` `(sample, indices, probabilities, weights)`.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments; an
        `eqx.error_if` error if no window is admissible yet, if every admissible window has
        priority 0, or if the total mass is not finite.
        """
        call = "PrioritisedTrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        t = self.trajectories
        windows = t._windows(
            call,
            self.sequence_length,
            self.burn_in,
            self.bootstrap,
            self.period,
            True,
            episode_ends,
            done,
        )
        beta = check_real_scalar(beta, call, "beta")
        tree = self.tree
        total = tree.total
        leaves, probabilities = draw_leaves(tree, key, batch_size, self.stratified)
        k = self.slots_per_env
        env, slot = leaves // k, leaves % k
        # Only leaves of positive priority are drawn, so the slot's latest start is stored.
        count = t.step_count[env]
        start = self._latest_start(count, slot)
        back = jnp.clip(count - start, 0, t.max_length)
        sample = t._gather(env, back, jnp.full_like(back, self.window), windows)
        num = jnp.maximum(self.num_windows, 1)
        # Probabilities are 0 only on an all-zero tree, which the checks below report.
        weights = importance_weights(jnp.where(total > 0, probabilities, 1), num, beta)
        out = PrioritisedSequenceSample(sample, leaves, probabilities, weights)
        return check_faults(
            out,
            [
                (
                    self.num_windows == 0,
                    f"`{call}`: no window is admissible yet: no env holds {self.window} "
                    f"steps from a start on a multiple of period = {self.period}",
                ),
                (
                    (self.num_windows > 0) & (total <= 0),
                    f"`{call}`: every admissible window has priority 0",
                ),
                (~jnp.isfinite(total), f"`{call}`: the total priority mass is not finite"),
            ],
            order_reads=False,
        )

    def stale(
        self, env_ids: Integer[ArrayLike, " n"], starts: Integer[ArrayLike, " n"]
    ) -> Bool[Array, " n"]:
        """Which stamps name windows that have left (their first step overwritten) since
        they were sampled: the entries `set_priorities` drops.

        **Raises:** an `eqx.error_if` error for a stamp this buffer cannot have given (an env
        id out of range, a start not yet reached, or not on a multiple of `period`).
        """
        rows, steps, fault = self._stamps(env_ids, starts, "PrioritisedTrajectoryBuffer.stale")
        return check_faults(self._gone(rows, steps), [fault])

    def set_priorities(
        self: _PT,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
    ) -> _PT:
        """Set the priorities of the windows named by the stamps `(env_ids, starts)`, as
        `sample` returned them (`sample.env`, `sample.start`).

        An entry whose window has left since it was sampled is dropped: its leaf now belongs
        to a newer window (or to none). `stale` tells which. Of repeated stamps the last
        wins.

        **Raises:** an `eqx.error_if` error for a bad stamp (as `stale`), or a priority that
        is negative, infinite or NaN (stale entries are checked too).
        """
        call = "PrioritisedTrajectoryBuffer.set_priorities"
        rows, steps, fault = self._stamps(env_ids, starts, call)
        priorities = check_vector(priorities, rows.shape[0], call, "priorities").astype(
            self.max_priority.dtype
        )
        keep = ~self._gone(rows, steps) & ~fault[0]
        max_priority = jnp.maximum(self.max_priority, jnp.max(priorities, initial=0))
        mass = self._mass(priorities)
        leaves, mass, max_priority = check_faults(
            (self._leaf(rows, steps), mass, max_priority),
            [
                fault,
                (
                    ~(jnp.isfinite(priorities) & (priorities >= 0)),
                    f"`{call}`: priorities must be finite and non-negative",
                ),
            ],
        )
        tree = set_leaves(self.tree, leaves, mass, mask=keep)
        return eqx.tree_at(lambda b: (b.tree, b.max_priority), self, (tree, max_priority))

    def _stamps(self, env_ids, starts, call):
        t = self.trajectories
        rows, bad_env = check_index(env_ids, t.num_envs, f"{call}(env_ids=...)", ndim=1)
        steps, bad_step = check_index(
            starts, INT32_MAX, f"{call}(starts=...)", ndim=1, length=(rows.shape[0], "env id")
        )
        rows = jnp.where(bad_env, 0, rows)
        steps = jnp.where(bad_step, 0, steps)
        count = t.step_count[rows]
        bad = bad_env | bad_step | (steps + self.window > count) | (steps % self.period != 0)
        return (
            rows,
            steps,
            (
                bad,
                f"`{call}`: a stamp this buffer cannot have given: an env id out of range, or "
                "a start that is negative, not on a multiple of period, or whose window is not "
                "yet stored",
            ),
        )

    def _gone(self, rows: Int[Array, " n"], steps: Int[Array, " n"]) -> Bool[Array, " n"]:
        t = self.trajectories
        return steps < t.step_count[rows] - t.replay_length[rows]

    def _mass(self, priorities: Float[Array, "*s"]) -> Float[Array, "*s"]:
        return priority_mass(priorities, self.priority_exponent)


def _ceil_to(x: Int[Array, "*s"], p: int) -> Int[Array, "*s"]:
    """The least multiple of `p` at least `x` (floor division rounds towards -inf)."""
    return -((-x) // p) * p
