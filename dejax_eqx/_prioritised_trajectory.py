"""Prioritised replay of the whole windows of per-env streams: one sum-tree leaf per
period-aligned start."""

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer, Source, WindowPriorities
from ._checks import (
    as_float,
    check_index,
    check_mask,
    check_real_scalar,
    check_vector,
    LeafName,
    Prototype,
)
from ._deprecated import deprecated_property
from ._episode_laws import EpisodeStartLaw, require_episodes, WholeEpisode
from ._episodes import Episodes
from ._faults import check_faults, Fault, vetoing
from ._laws import (
    AbstractEnumerableLaw,
    AbstractLaw,
    Candidates,
    Draw,
    float_targets,
    in_union,
    locate,
    mixture_rows,
    MixtureRows,
    probability,
)
from ._nstep import NStep
from ._policy_age import AgedLaw, PolicyAge
from ._priorities import check_beta, HasPriorities, mass_faults, Priorities, weights
from ._relabel import Relabel, relabelled_law
from ._results import initial_result, reports, Result
from ._sequences import (
    count_starts,
    extend_changes,
    is_stored,
    is_window,
    latest_start,
    leaf_of,
    leaves_per_env,
    phase,
    step_changes,
    windows_share_leaves,
)
from ._streams import (
    Appended,
    check_append,
    check_stamps,
    make_streams,
    step_backs,
    Streams,
    window_slots,
)
from ._sum_tree import find_leaves, MAX_CAPACITY
from ._trajectory import append_checked, TrajectoryBuffer
from ._windows import as_whole_window, EpisodeEnds, read_windows, SequenceSample, Window


_PT = TypeVar("_PT", bound="PrioritisedTrajectoryBuffer")
_NAME = "PrioritisedTrajectoryBuffer"


class PrioritisedSequenceSample(NamedTuple):
    """What `PrioritisedTrajectoryBuffer.sample` returns.

    **Fields:**

    - `sample`: the windows, a `SequenceSample` `(items, mask, learn, env, start)`;
        `(sample.env, sample.start)` are the stamps `set_priorities` takes back.
    - `indices`: int32 `(batch,)`, each window's leaf in the sum tree (`env *
        leaves_per_env + (start // period) % leaves_per_env`).
    - `probabilities`: `(batch,)`, the probability of drawing each window in one i.i.d. draw.
    - `weights`: `(batch,)`, the importance weights for the `beta` of the call
        (`importance_weights(probabilities, num_windows, beta)`), at most 1.
    """

    sample: SequenceSample
    indices: Int[Array, " batch"]
    probabilities: Float[Array, " batch"]
    weights: Float[Array, " batch"]


@mixture_rows.register
def _(sample: PrioritisedSequenceSample) -> MixtureRows:
    return MixtureRows(sample.sample, sample.weights)


class PrioritisedTrajectoryBuffer(AbstractTrajectoryBuffer, HasPriorities):
    """Per-env streams whose whole windows are replayed by priority (R2D2, Ape-X with
    sequences, MuZero).

    The items are the windows a strict `Window` describes: `W = burn_in + sequence_length +
    bootstrap` steps that start on a multiple of `period` in their env's absolute step count
    and lie wholly in the stored stream. Steps are added asynchronously (`env_ids`) or in
    lock-step, as to any trajectory buffer, and

    - a window *becomes admissible* when its last step is added, and then gets the largest
        priority recorded so far (`max_priority`, at least 1);
    - a window *leaves* when its first step is overwritten: its priority is 0 from that add
        on, exactly, whatever subset of envs each add touches;
    - `sample` draws windows with probability `P ∝ p ** priority_exponent` (i.i.d. or
        stratified), returns them with their sum-tree indices, probabilities and importance
        weights, and `(env, start)` stamps, masked by the window's `episode_ends` policy;
    - `set_priorities(env_ids, starts, priorities)` takes the stamps back and drops the
        entries whose window is stale (has left since it was sampled), so a delayed update
        never lands on a newer window; `stale` says which.

    The sum tree has one leaf per `(env, start // period mod (max_length // period))`. When
    `period` does not divide `max_length`, the window must be longer than `max_length mod
    period`, so that two stored windows never share a leaf.

    `PrioritisedTrajectoryBuffer` is final: it is not meant to be subclassed.
    """

    trajectories: TrajectoryBuffer
    """The streams and their online queue (read `trajectories.sample(..., source="online")`
    for fresh windows beside the prioritised ones)."""
    priorities: Priorities
    """The windows' priorities: a sum tree of their masses and the largest priority recorded
    (read them through `tree`, `max_priority`, `priority_exponent` and `stratified`)."""
    window: Window
    """The windows that are the items (strict), and how `sample` masks them."""
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self,
        prototype: Prototype,
        num_envs: int,
        max_length: int,
        window: Window | int | None = None,
        *,
        priority_exponent: float = 0.6,
        stratified: bool = False,
        dtype: Any = jnp.float32,
        episodes: Episodes | None = None,
        written_back: Sequence[str] = (),
        throw: bool = True,
        **options: Any,
    ):
        """**Arguments:**

        - `prototype`, `num_envs`, `max_length`: as for `TrajectoryBuffer`.
        - `window`: a strict `Window` (`strict=True`), `W` at most `max_length`, `period` at
            most `max_length`; if `period` does not divide `max_length`, `W` must exceed
            `max_length mod period`.
        - `priority_exponent`: `α >= 0` (default 0.6).
        - `stratified`: draw one window from each of `batch_size` equal slices of the total
            mass (default `False`: i.i.d. draws).
        - `dtype`: the float dtype of the priority sums (`jnp.float32` by default).
        - `episodes`, `written_back`: as for `TrajectoryBuffer`.
        - `throw`: how a fault (a fact of the data: an empty buffer, an index out of range)
            is reported: raised at the faulty call (`True`, the default), or kept as the
            buffer's `result` and beside what a read returns (`False`: no conditional and no
            callback is compiled; see the guide's "Faults as results").
        """
        call = "PrioritisedTrajectoryBuffer"
        self.result = initial_result(throw, f"{call}(throw=...)")
        streams = make_streams(prototype, num_envs, max_length, call, episodes, written_back)
        # The buffer around the streams, without allocating its own (a shape-only template).
        template = eqx.filter_eval_shape(
            TrajectoryBuffer,
            streams.item_spec,
            num_envs,
            max_length,
            episodes=episodes,
            written_back=written_back,
        )
        self.trajectories = template.with_streams(streams)
        self.window = _whole_windows(window, options, streams, call)
        capacity = num_envs * leaves_per_env(max_length, self.window.period)
        self.priorities = Priorities(capacity, priority_exponent, stratified, dtype, call)

    @property
    def streams(self) -> Streams:
        return self.trajectories.streams

    @property
    def leaves_per_env(self) -> int:
        """`max_length // period`: the sum-tree leaves of one env."""
        return leaves_per_env(self.max_length, self.window.period)

    # The old names, for one release.
    slots_per_env = deprecated_property(
        _NAME, "slots_per_env", "leaves_per_env", lambda b: b.leaves_per_env
    )
    sequence_length = deprecated_property(
        _NAME, "sequence_length", "window.sequence_length", lambda b: b.window.sequence_length
    )
    burn_in = deprecated_property(_NAME, "burn_in", "window.burn_in", lambda b: b.window.burn_in)
    bootstrap = deprecated_property(
        _NAME, "bootstrap", "window.bootstrap", lambda b: b.window.bootstrap
    )
    period = deprecated_property(_NAME, "period", "window.period", lambda b: b.window.period)

    @property
    def num_windows(self) -> Int[Array, ""]:
        """The number of admissible windows (stored whole), an int32 scalar."""
        starts = phase(self.step_count, self.window.period)
        return jnp.sum(count_starts(self.streams.lengths, starts, self.window.law), dtype=jnp.int32)

    @reports
    def add(
        self: _PT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _PT:
        call = "PrioritisedTrajectoryBuffer.add"
        return _appended(self, check_append(self.streams, items, env_ids, call, sequences=False))

    @reports
    def extend(
        self: _PT, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _PT:
        call = "PrioritisedTrajectoryBuffer.extend"
        return _appended(self, check_append(self.streams, items, env_ids, call, sequences=True))

    def with_streams(self: _PT, streams: Streams) -> _PT:
        streams = self._check_streams(streams, "PrioritisedTrajectoryBuffer.with_streams")
        fresh = self.priorities.fresh()
        trajectories = self.trajectories.with_streams(streams)
        new = eqx.tree_at(lambda b: (b.trajectories, b.priorities), self, (trajectories, fresh))
        held = new.window_priorities().held.reshape(-1)
        masses = jnp.where(held, fresh.new_mass(), 0)
        leaves = jnp.arange(held.shape[0], dtype=jnp.int32)
        written = fresh.write(leaves, masses, unique=True)
        return eqx.tree_at(lambda b: b.priorities, new, written)

    def with_written(self: _PT, streams: Streams) -> _PT:
        """The buffer holding `streams`; the windows' priorities stay as they are."""
        trajectories = self.trajectories.with_written(streams)
        return eqx.tree_at(lambda b: b.trajectories, self, trajectories)

    def law(
        self,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
        call: str = "PrioritisedTrajectoryBuffer.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """Its windows, each with probability `P ∝ p ** priority_exponent` (i.i.d. or
        stratified), masked by the window's `episode_ends` policy; a
        `PrioritisedSequenceSample` whose weights are `importance_weights(probabilities,
        num_windows, beta)`. `what` is `None` (the buffer's window) or a `Window` of the same
        parts, period and strictness that masks episode ends otherwise. With `age`, the same
        law times each window's age weight (an `AgedSample` of `SequenceSample`s, its indices
        the leaves, its weights toward the age-weighted target). Faults: no window admissible
        yet, every window of priority 0, a total mass that is not finite, a bad `beta`."""
        window = _masking(self, what, call)
        _refuse_online(distribution_power, discount, source, call)
        dtype = self.priorities.max_priority.dtype
        beta, faults = check_beta(1.0 if beta is None else beta, call, dtype)
        k, capacity = self.num_envs, self.priorities.tree.capacity
        base: Any = PrioritisedWindowLaw(window, beta, k, capacity, self.stratified)
        if window.starts == "episode":
            require_episodes(self.streams, "`Window(starts='episode')`", call)
            base = EpisodeStartLaw(inner=base, stratified=self.stratified)
        if relabel is not None:
            return relabelled_law(base, relabel, self.streams, window, None, age, call), faults
        if age is None:
            return base, faults
        stratified = self.stratified
        law = AgedLaw(base, self, age, beta=beta, stratified=stratified, noun="window", call=call)
        return law, faults

    @reports
    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        what: Window | NStep | WholeEpisode | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
        episode_ends: EpisodeEnds | None = None,
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> Any:
        """As `AbstractTrajectoryBuffer.sample`. `episode_ends` and `done` are the deprecated
        form of a `Window` that masks otherwise."""
        if episode_ends is not None or done is not None:
            what = _deprecated_masking(self.window, episode_ends, done, f"{_NAME}.sample")
        return super().sample(
            key,
            batch_size,
            what,
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
        )

    @reports
    def set_priorities(
        self: _PT,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _PT:
        """Set the priorities of the windows named by the stamps `(env_ids, starts)`, as
        `sample` returned them (`sample.env`, `sample.start`).

        `mask`, an optional boolean array of shape `(n,)`: only the entries where it is
        `True` are set (and checked); the others may hold anything.

        An entry whose window is stale (has left since it was sampled) is dropped: its leaf
        now belongs to a newer window (or to none). `stale` tells which. Of repeated stamps
        the last wins.

        **Raises:** an `eqx.error_if` error for a stamp this buffer cannot have given (an env
        id out of range, a start not on a multiple of `period` or whose window has not been
        stored), or a priority that is negative, infinite or NaN (stale entries are checked
        too).
        """
        call = "PrioritisedTrajectoryBuffer.set_priorities"
        stamps = check_stamps(self.streams, env_ids, starts, call, ndim=1)
        n = stamps.env.shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        size, period, k = self.window.size, self.window.period, self.leaves_per_env
        misfit = (
            ~stamps.bad & ~is_window(stamps.start, stamps.taken, size, period),
            f"`{call}`: a stamp this buffer cannot have given: its start is not on a multiple "
            f"of period = {period}, or its window of {size} steps has not been stored yet",
        )
        valid = None if mask is None else check_mask(mask, n, call)
        masses, top, faults = self.priorities.prepare(priorities, n, call, mask=valid)
        leaves = leaf_of(stamps.env, stamps.start, period, k)
        faults = [*stamps.faults, misfit, *faults]
        if valid is not None:
            faults = [(jnp.asarray(pred) & valid, message) for pred, message in faults]
        leaves, masses, top = check_faults((leaves, masses, top), faults)
        keep = ~stamps.stale & ~stamps.bad
        if valid is not None:
            keep = keep & valid
        with vetoing(faults):  # a recording call's faulty update sets nothing
            new = self.priorities.write(leaves, masses, top, mask=keep)
        return eqx.tree_at(lambda b: b.priorities, self, new)

    @reports
    def note_priorities(
        self: _PT,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        priorities: Real[ArrayLike, " n"],
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> _PT:
        call = "PrioritisedTrajectoryBuffer.note_priorities"
        n = check_index(env_ids, self.num_envs, f"{call}(env_ids=...)", ndim=1)[0].shape[0]
        priorities = check_vector(priorities, n, call, "priorities")
        valid = None if mask is None else check_mask(mask, n, call)
        return eqx.tree_at(lambda b: b.priorities, self, self.priorities.noted(priorities, valid))

    @reports
    def stamp_of(
        self, indices: Integer[ArrayLike, "*n"]
    ) -> tuple[Int[Array, "*n"], Int[Array, "*n"]]:
        """The stamps `(env, start)` of the windows that sum-tree leaves `indices` hold now (as
        `sample` returns them in `indices`). A leaf that holds no window gives the start of
        the last window it held (stale) or, if it has held none yet, a negative start.

        **Raises:** an `eqx.error_if` error for an index outside `[0, num_envs *
        leaves_per_env)`.
        """
        call = "PrioritisedTrajectoryBuffer.stamp_of"
        capacity = self.priorities.tree.capacity
        leaves, bad = check_index(indices, capacity, f"{call}(indices=...)")
        stamp = stamps_of(self, jnp.where(bad, 0, leaves))
        message = (
            f"`{call}`: index out of range; every index must satisfy 0 <= index < {capacity} "
            "(a sum-tree leaf)"
        )
        return check_faults(stamp, [(bad, message)])

    def priority_settings(self) -> dict[str, Any]:
        return {
            "priority_exponent": self.priority_exponent,
            "period": self.window.period,
            "window": self.window.size,
        }

    def window_priorities(self) -> WindowPriorities:
        """Every sum-tree leaf's window and mass, as `(num_envs, leaves_per_env)` arrays, and
        `max_priority`: what a `Dataset` stores of the priorities."""
        k = self.leaves_per_env
        leaves = jnp.arange(self.num_envs * k, dtype=jnp.int32).reshape(self.num_envs, k)
        env, start = stamps_of(self, leaves)
        count, length = self.step_count[env], self.streams.lengths[env]
        held = is_stored(start, count, length, self.window.size)
        masses = self.priorities.tree.leaves.reshape(self.num_envs, k)
        return WindowPriorities(start, held, masses, self.priorities.max_priority)

    @reports
    def with_window_priorities(
        self: _PT,
        masses: Real[ArrayLike, "num_envs leaves"],
        *,
        max_priority: Real[ArrayLike, ""] | None = None,
    ) -> _PT:
        """The buffer with the mass of every window it holds set (`masses[e, j]` for leaf `j`
        of env `e`, as `window_priorities` gives them; a NaN gives the window the mass of
        `max_priority`, as a new window gets; the masses of leaves that hold no window are
        ignored), and `max_priority` if given.

        **Raises:** `ValueError`/`TypeError` at once for a bad shape or dtype; an
        `eqx.error_if` error for a held window's mass that is negative or infinite, or a
        `max_priority` below 1 or not finite.
        """
        call = "PrioritisedTrajectoryBuffer.with_window_priorities"
        flat, top, faults = _window_masses(self, masses, max_priority, call)
        flat, top = check_faults((flat, top), faults)
        leaves = jnp.arange(self.priorities.tree.capacity, dtype=jnp.int32)
        with vetoing(faults):  # a recording call's faulty call sets nothing
            new = self.priorities.write(leaves, flat, top, unique=True)
        return eqx.tree_at(lambda b: b.priorities, self, new)


def stamps_of(
    buffer: PrioritisedTrajectoryBuffer, leaves: Int[Array, "*n"]
) -> tuple[Int[Array, "*n"], Int[Array, "*n"]]:
    """`PrioritisedTrajectoryBuffer.stamp_of` without its check: `leaves` in range."""
    k, w = buffer.leaves_per_env, buffer.window
    env = leaves // k
    return env, latest_start(buffer.step_count[env], leaves % k, w.size, w.period, k)


def _appended(buffer: _PT, done: Appended) -> _PT:
    """The buffer after a checked append: the windows that entered get `max_priority`, those
    that left 0, in one update of the tree."""
    if done.length == 0:
        return buffer
    leaves, write, entered = _changes(done, buffer.window, buffer.leaves_per_env)
    masses = jnp.where(entered, buffer.priorities.new_mass(), 0)
    # One check for the call, on the new counters and the vectors the tree is written from.
    trajectories, (leaves, masses) = append_checked(buffer.trajectories, done, (leaves, masses))
    priorities = buffer.priorities.write(leaves, masses, mask=write, unique=done.length == 1)
    return eqx.tree_at(lambda b: (b.trajectories, b.priorities), buffer, (trajectories, priorities))


def _masking(buffer: PrioritisedTrajectoryBuffer, what: Any, call: str) -> Window:
    """The window a sample reads: the buffer's own, or `what`, a window of the same parts
    that masks episode ends otherwise."""
    w = buffer.window
    if what is None:
        return w
    what = w.masked_as(what, call)
    what.check(buffer.item_spec, buffer.max_length, call)
    return what


def _deprecated_masking(
    window: Window, episode_ends: EpisodeEnds | None, done: Any, call: str
) -> Window:
    """The deprecated `sample(episode_ends=..., done=...)`: the buffer's `window`, masked
    so."""
    options = {"episode_ends": episode_ends, "done": done}
    warnings.warn(
        f"`{call}`: `episode_ends` and `done` are deprecated here; give them to a "
        "`Window` of the buffer's parts, as `what` (removed in the next release).",
        DeprecationWarning,
        stacklevel=4,
    )
    w, given = window, {k: v for k, v in options.items() if v is not None}
    parts = dict(burn_in=w.burn_in, bootstrap=w.bootstrap, period=w.period, strict=True)
    return Window(w.sequence_length, **parts, **given)


def _refuse_online(distribution_power: Any, discount: Any, source: Any, call: str) -> None:
    """Refuse, in `law`, the options of the online queue's law: the windows are drawn by
    priority, from the replay."""
    for name, value in [
        ("distribution_power", distribution_power),
        ("discount", discount),
    ]:
        if value is not None:
            raise TypeError(
                f"`{call}({name}=...)`: a PrioritisedTrajectoryBuffer draws its windows "
                f"by priority; it takes no `{name}`. The online queue's windows are drawn "
                "from `buffer.trajectories`."
            )
    if source is not None and source != "replay":
        raise TypeError(
            f"`{call}(source=...)`: a PrioritisedTrajectoryBuffer draws its windows by "
            "priority from its replay; draw the online queue from `buffer.trajectories`."
        )


def _window_masses(
    buffer: PrioritisedTrajectoryBuffer,
    masses: Real[ArrayLike, "num_envs leaves"],
    max_priority: Real[ArrayLike, ""] | None,
    call: str,
) -> tuple[Float[Array, " capacity"], Float[Array, ""], list[Fault]]:
    """`with_window_priorities`' masses, one per sum-tree leaf (a held window's NaN made the
    mass of `max_priority`, a leaf that holds no window 0), `max_priority`, and their
    faults."""
    k, capacity = buffer.leaves_per_env, buffer.priorities.tree.capacity
    if tuple(jnp.shape(masses)) != (buffer.num_envs, k):
        raise ValueError(
            f"`{call}`: `masses` has shape {tuple(jnp.shape(masses))}, expected (num_envs, "
            f"leaves_per_env) = ({buffer.num_envs}, {k})."
        )
    # Reshaped where it is (not `jnp.asarray`, which would wrap an int64 mass first).
    if isinstance(masses, jax.Array | np.ndarray):
        masses = masses.reshape(-1)
    flat = check_vector(masses, capacity, call, "masses")
    held = buffer.window_priorities().held.reshape(-1)
    dtype = buffer.priorities.max_priority.dtype
    flat, faults = as_float(flat, dtype, call, "masses", mask=held)
    top = buffer.priorities.max_priority
    if max_priority is not None:
        top, top_faults = as_float(
            check_real_scalar(max_priority, call, "max_priority"), dtype, call, "max_priority"
        )
        faults += top_faults
    flat = jnp.where(held, jnp.where(jnp.isnan(flat), buffer.priorities.mass(top), flat), 0)
    faults += [
        (
            ~(jnp.isfinite(flat) & (flat >= 0)),
            f"`{call}`: masses must be finite and non-negative",
        ),
        (
            ~(jnp.isfinite(top) & (top >= 1)),
            f"`{call}`: `max_priority` must be finite and at least 1",
        ),
    ]
    return flat, top, faults


def _whole_windows(window: Any, options: dict[str, Any], streams: Streams, call: str) -> Window:
    """The constructor's `window`: strict, fitting the streams, and never two stored windows
    in one leaf."""
    if window is None:  # the deprecated form given by keyword: `sequence_length=...`
        if "sequence_length" not in options:
            raise TypeError(f"`{call}`: missing the `window`, a strict `dx.Window`.")
        window = options.pop("sequence_length")
    window = as_whole_window(
        window, options, call, "the items of a prioritised buffer are whole windows"
    )
    m = streams.max_length
    window.check(streams.item_spec, m, call)
    per_env = leaves_per_env(m, window.period)
    if per_env == 0:
        raise ValueError(
            f"`{call}`: `Window(period=...)` must be at most max_length = {m}, got {window.period}."
        )
    if windows_share_leaves(m, window.size, window.period):
        raise ValueError(
            f"`{call}`: with max_length = {m} and period = {window.period}, each env has "
            f"max_length // period = {per_env} window slots, reused as its stream wraps; two "
            "stored windows would share one unless a window is longer than max_length mod "
            f"period = {m - per_env * window.period} steps, and it has {window.size}. Make "
            "max_length a multiple of period, or the window longer."
        )
    if streams.num_envs * per_env > MAX_CAPACITY:
        raise ValueError(
            f"`{call}`: num_envs * (max_length // period) = {streams.num_envs * per_env} "
            f"windows, more than the sum tree's {MAX_CAPACITY}."
        )
    return window


def _changes(
    done: Appended, window: Window, per_env: int
) -> tuple[Int[Array, " c"], Bool[Array, " c"], Bool[Array, " c"]]:
    """The leaves a checked append changes: `(leaves, write, entered)`, where a written leaf
    gets the largest priority's mass if `entered`, else 0 (its window left)."""
    size, period, m = window.size, window.period, done.streams.max_length
    rows = jnp.where(done.valid, done.rows, 0)
    count = done.streams.step_count[rows]
    if done.length == 1:  # the cheaper update of one step: distinct leaves
        enter_leaf, enter, leave_leaf, leave = step_changes(count, size, period, m, per_env)
        leaves = jnp.concatenate([rows * per_env + leave_leaf, rows * per_env + enter_leaf])
        write = jnp.concatenate([done.valid & leave, done.valid & enter])
        return leaves, write, jnp.concatenate([jnp.zeros_like(enter), jnp.ones_like(enter)])
    oldest = count - done.streams.lengths[rows]
    leaf, write, stored = extend_changes(count, done.length, oldest, size, period, m, per_env)
    leaves = (rows[:, None] * per_env + leaf).reshape(-1)
    return leaves, (done.valid[:, None] & write).reshape(-1), stored.reshape(-1)


class PrioritisedWindowLaw(AbstractEnumerableLaw):
    """A `PrioritisedTrajectoryBuffer`'s law: each admissible window in proportion to its
    mass `p ** α`. Over a union of buffers, over their total: the targets of the union's
    total, each found in the tree of the buffer whose slice holds it; env ids and leaves are
    named in the union, and the weights count the union's windows."""

    window: Window
    beta: Float[Array, ""]
    num_envs: int = eqx.field(static=True)
    capacity: int = eqx.field(static=True)  # the leaves of one buffer
    stratified: bool = eqx.field(static=True)

    @property
    def independent_rows(self) -> bool:
        return not self.stratified

    def summary(self, buffer: PrioritisedTrajectoryBuffer) -> PyTree[Array]:
        return buffer.priorities.tree.total, buffer.num_windows

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        totals, _ = summaries
        targets = float_targets(key, batch_size, jnp.sum(totals), self.stratified)
        return Draw(*locate(targets, totals))

    def read(self, buffer: PrioritisedTrajectoryBuffer, at: PyTree[Array]) -> PyTree[Array]:
        leaves, value = find_leaves(buffer.priorities.tree, at)
        # Only leaves of positive mass are drawn, so their windows are stored.
        sample = self.read_candidates(buffer, leaves)
        # The probability is the leaf's value over the union's total, in `finish`.
        return PrioritisedSequenceSample(sample, leaves, value, jnp.zeros_like(value))

    def finish(
        self, rows: PrioritisedSequenceSample, draw: Draw, summaries: PyTree[Array]
    ) -> PrioritisedSequenceSample:
        totals, numbers = summaries
        total = jnp.sum(totals)
        p = probability(rows.probabilities, total)
        number = jnp.maximum(jnp.sum(numbers), 1)
        # Probabilities are 0 only where nothing can be drawn, which the faults report.
        w = weights(jnp.where(total > 0, p, 1), number, self.beta)
        sample = self.name_candidates(rows.sample, draw.owner, summaries)
        return PrioritisedSequenceSample(
            sample, in_union(draw.owner, rows.indices, self.capacity), p, w
        )

    def finish_drawn(
        self,
        rows: SequenceSample,
        index: Int[Array, " batch"],
        probabilities: Float[Array, " batch"],
        log_mass: Float[Array, " batch"],
        owner: Int[Array, " batch"],
        summaries: PyTree[Array],
    ) -> PrioritisedSequenceSample:
        """Windows drawn among some of the held ones (`Window(starts="episode")`): the
        importance weights toward the uniform law over those, `mass ** -β` normalised by the
        batch's largest (as `importance_weights` is over all of them)."""
        log_w = -self.beta.astype(log_mass.dtype) * log_mass
        w = jnp.exp(log_w - jnp.max(log_w)).astype(probabilities.dtype)
        sample = self.name_candidates(rows, owner, summaries)
        return PrioritisedSequenceSample(
            sample, in_union(owner, index, self.capacity), probabilities, w
        )

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        total = jnp.sum(summaries[0])
        return (total > 0) | ~jnp.isfinite(total)

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        totals, numbers = summaries
        w = self.window
        return [
            (
                jnp.sum(numbers) == 0,
                f"`{call}`: no window is admissible yet: no env holds {w.size} steps from a "
                f"start on a multiple of period = {w.period}",
            ),
            *mass_faults(jnp.sum(totals), call, "window"),
        ]

    def candidates(self, buffer: PrioritisedTrajectoryBuffer) -> Candidates:
        held = buffer.window_priorities()
        env = jnp.repeat(jnp.arange(buffer.num_envs, dtype=jnp.int32), buffer.leaves_per_env)
        # Only held windows are drawn: their first steps are stored.
        first = jnp.clip(buffer.step_count[env] - held.start.reshape(-1), 1, buffer.max_length)
        slot = window_slots(buffer.streams, env, first, 1)[:, 0]
        stored = (step_backs(buffer.streams) <= buffer.streams.lengths[:, None]).reshape(-1)
        items = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), buffer.streams.data)
        log_law = jnp.where(held.held.reshape(-1), 0.0, -jnp.inf)
        log_mass = jnp.log(held.mass.reshape(-1))
        return Candidates(log_law, log_mass, items, stored, env * buffer.max_length + slot)

    def read_candidates(
        self, buffer: PrioritisedTrajectoryBuffer, index: Int[Array, " batch"]
    ) -> SequenceSample:
        env, start = stamps_of(buffer, index)
        back = jnp.clip(buffer.step_count[env] - start, 1, buffer.max_length)
        return read_windows(buffer.streams, env, back, self.window)

    def name_candidates(
        self, rows: SequenceSample, owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> SequenceSample:
        return rows._replace(env=in_union(owner, rows.env, self.num_envs))

    def num_candidates(self, buffer: PrioritisedTrajectoryBuffer) -> int:
        return self.capacity
