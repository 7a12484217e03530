"""TrajectoryBuffer: per-env streams with a replay window and an online queue."""

import warnings
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer
from ._checks import (
    as_float,
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    check_real_scalar,
    Prototype,
)
from ._faults import check_faults, Fault
from ._nstep import as_nstep, draw_transitions, NStep, Transitions
from ._sequences import admissible, draw_starts, phase, start_log_weights
from ._staleness import AgedSample, draw_by_age, PolicyAge, read_step_ages
from ._streams import Appended, check_append, check_stamps, grow, make_streams, Streams
from ._windows import as_window, read_windows, SequenceSample, Window


_TB = TypeVar("_TB", bound="TrajectoryBuffer")

Source = Literal["replay", "online"]
SOURCES: tuple[Source, ...] = ("replay", "online")
_EMPTY: dict[Source, str] = {
    "replay": "cannot sample from an empty TrajectoryBuffer: no env has any stored step",
    "online": (
        "cannot sample from an empty online queue: no step was added to any env since the "
        "last `reset_online_queue()`"
    ),
}


class TrajectoryBuffer(AbstractTrajectoryBuffer):
    """Per-env streams of steps, with a replay window and an online queue, sampled as windows
    (for recurrent learners) or as n-step transitions (for the DQN family).

    Two windows end at the newest step of each env's stream:

    - the *replay* window: every stored step of the env;
    - the *online* window (the online queue): the steps added since the last
        `reset_online_queue()`, at most `max_length`.

    Both share one storage: the online queue costs no memory.

    `sample` draws windows, described by a `Window` (its parts, period, strictness and
    episode-end policy), with replacement, over all envs and admissible starts together;
    `sample_transitions` draws n-step transitions described by an `NStep`. A sample costs
    O(num_envs + W + batch_size · W), whatever `max_length` (the method is in
    `dejax_eqx/README.md`).

    **Errors.** Arguments known at trace time (a window longer than `max_length`, items that
    do not match the prototype, ...) raise `ValueError`/`TypeError` at once. Faults in the data
    raise through `eqx.error_if`, eagerly and under `jit` alike: env ids out of range or
    repeated within one `add`, sampling with no admissible start, peeking at an env without
    steps. `EQX_ON_ERROR` chooses what happens instead (see Equinox's `error_if`).

    `TrajectoryBuffer` is final: it is not meant to be subclassed.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import numpy as np
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(4), "reward": jnp.zeros(()), "done": jnp.zeros((), bool)}
        buf = dx.TrajectoryBuffer(step, num_envs=8, max_length=1000)
        window = dx.Window(16)

        @eqx.filter_jit(donate="all-except-first")
        def train_step(key, buf, steps, env_ids):
            buf = buf.add(steps, env_ids=env_ids)  # only these envs advance
            sample = buf.sample_mixed(key, 12, 4, window)
            return buf, sample

        env_ids = np.array([5, 1, 6], np.int32)  # e.g. info["env_id"] from envpool's recv()
        steps = {"obs": jnp.ones((3, 4)), "reward": jnp.ones(3), "done": jnp.zeros(3, bool)}
        buf, sample = train_step(jax.random.key(0), buf, steps, env_ids)
        assert sample.items["obs"].shape == (16, 16, 4) and sample.mask.shape == (16, 16)
        assert buf.lengths().tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
        ```
    """

    streams: Streams
    online_length: Int[Array, " num_envs"]
    """Per env, the number of steps in the online queue, in `[0, max_length]`, at most the
    replay window's (int32)."""

    def __init__(self, prototype: Prototype, num_envs: int, max_length: int):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars). Only its
            structure, shapes and dtypes are used; stored steps must match them exactly.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the number of steps each env keeps, a positive Python int below
            `2**31`. Storage is `num_envs · max_length` steps.
        """
        self.streams = make_streams(prototype, num_envs, max_length, "TrajectoryBuffer")
        self.online_length = jnp.zeros(self.streams.num_envs, jnp.int32)

    @property
    def replay_length(self) -> Int[Array, "*batch num_envs"]:
        """Per env, the number of stored steps (the replay window), in `[0, max_length]`."""
        return self.streams.lengths

    def lengths(self, source: Source = "replay") -> Int[Array, " num_envs"]:
        """The number of steps in each env's window: `"replay"` (every stored step, the
        default) or `"online"` (the steps added since the last `reset_online_queue()`). An
        int32 array of shape `(num_envs,)` with values in `[0, max_length]`."""
        source = check_choice(source, SOURCES, "TrajectoryBuffer.lengths(source=...)")
        return self.streams.lengths if source == "replay" else self.online_length

    def add(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        done = check_append(self.streams, items, env_ids, "TrajectoryBuffer.add", sequences=False)
        return append_checked(self, done)[0]

    def extend(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        done = check_append(self.streams, items, env_ids, "TrajectoryBuffer.extend", sequences=True)
        return append_checked(self, done)[0]

    def with_streams(self: _TB, streams: Streams) -> _TB:
        streams = self._check_streams(streams, "TrajectoryBuffer.with_streams")
        online = jnp.zeros(streams.num_envs, jnp.int32)
        return eqx.tree_at(lambda b: (b.streams, b.online_length), self, (streams, online))

    def reset_online_queue(self: _TB) -> _TB:
        """Empty the online queue of every env; the replay windows keep all their steps."""
        return eqx.tree_at(lambda b: b.online_length, self, jnp.zeros_like(self.online_length))

    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        window: Window | int,
        *,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        source: Source = "replay",
        **options: Any,
    ) -> SequenceSample:
        """Draw `batch_size` windows, with replacement, from the replay windows or the online
        queue.

        Every admissible start of every env may be drawn (`Window` says which are): with
        `window.strict`, uniformly; else a start whose window holds `r` real steps with
        probability proportional to `r ** distribution_power`.

        **Arguments:**

        - `key`: a JAX PRNG key. It is used, never stored.
        - `batch_size`: the number of windows, a positive Python int (static).
        - `window`: a `Window` (static): `W = burn_in + sequence_length + bootstrap` at most
            `max_length`, and its `done` leaves booleans of one value per step.
        - `distribution_power`: a finite real exponent (default `1.0`; `0.0` makes every
            admissible start equally likely). A traced scalar: pass it as a JAX array to change
            it between calls of a jitted function without recompiling (a Python float is a
            static argument of `eqx.filter_jit`). With a strict window it has no effect.
        - `source`: `"replay"` (the default) or `"online"`.

        **Returns:** a `SequenceSample` `(items, mask, learn, env, start)`: `items` has the
        prototype's structure, each leaf of shape `(batch_size, W, *leaf_shape)`, zero where
        `mask` is `False`; `learn` is `mask` on the learning part; `(env, start)` is the stamp.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments or a window these
        streams cannot hold; an `eqx.error_if` error if no env has an admissible start in the
        chosen source (for example, an empty buffer), or if `distribution_power` is not
        finite.
        """
        call = "TrajectoryBuffer.sample"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        window = self._window(window, options, call)
        source = check_choice(source, SOURCES, f"{call}(source=...)")
        power, power_faults = check_power(distribution_power, call)
        out = self._draw(key, source, batch_size, window, power)
        faults = [*power_faults, _no_start_fault(self, source, window, call)]
        return check_faults(out, faults, order_reads=False)

    def sample_by_age(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        age: PolicyAge,
        window: Window,
        *,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        source: Source = "replay",
    ) -> AgedSample:
        """`sample`, restricted to the windows whose first step has policy age at most
        `age.max_age`, and weighted `1 / (age + 1)` for `age.decay="inverse"` (see
        `PolicyAge`). The other arguments are `sample`'s. Enumerates every stored step:
        O(num_envs · max_length) per call, where `sample` is O(num_envs + W + batch_size · W).

        **Returns:** an `AgedSample`; its `items` are a `SequenceSample`, its `weights` are 1.

        **Raises:** as `sample`; an `eqx.error_if` error for a stored version greater than
        `age.current` or negative, or if every admissible start is older than `max_age`.
        """
        call = "TrajectoryBuffer.sample_by_age"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        window = self._window(window, {}, call)
        source = check_choice(source, SOURCES, f"{call}(source=...)")
        power = distribution_power
        out, faults = _draw_by_age(self, key, batch_size, age, window, power, source, call)
        return check_faults(out, faults, order_reads=False)

    def sample_mixed(
        self,
        key: PRNGKeyArray,
        replay_batch_size: int,
        online_batch_size: int,
        window: Window | int,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        **options: Any,
    ) -> SequenceSample:
        """Windows from the replay windows and from the online queue, in one batch: the same
        as sampling `replay_batch_size` windows with `source="replay"` and `online_batch_size`
        with `source="online"` (from two keys split from `key`) and concatenating them, replay
        rows first. Either size may be 0 (not both); a part of size 0 is not sampled, so its
        source may be empty. The other arguments are as for `sample`.

        **Raises:** as `sample`, for each part of non-zero size.
        """
        call = "TrajectoryBuffer.sample_mixed"
        sizes: dict[Source, int] = {
            "replay": check_nonnegative_int(replay_batch_size, f"{call}(replay_batch_size=...)"),
            "online": check_nonnegative_int(online_batch_size, f"{call}(online_batch_size=...)"),
        }
        if sizes["replay"] + sizes["online"] == 0:
            raise ValueError(
                f"`{call}`: `replay_batch_size` and `online_batch_size` are both 0; ask for "
                "at least one sequence."
            )
        window = self._window(window, options, call)
        power, power_faults = check_power(distribution_power, call)
        keys: dict[Source, Array] = dict(zip(SOURCES, jax.random.split(key)))
        drawn: list[Source] = [s for s in SOURCES if sizes[s] > 0]
        parts = [self._draw(keys[s], s, sizes[s], window, power) for s in drawn]
        out = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
        faults = [*power_faults] + [_no_start_fault(self, s, window, call) for s in drawn]
        return check_faults(out, faults, order_reads=False)

    def sample_transitions(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        nstep: NStep | int,
        *,
        discount: Real[ArrayLike, ""],
        source: Source = "replay",
        **options: Any,
    ) -> Transitions:
        """Draw `batch_size` n-step transitions (described by `nstep`), uniformly with
        replacement, over every env.

        A step may start a transition once the `n` steps after it are stored, whether or not
        its episode ended sooner: the newest `n` steps of a stream wait. Transitions never
        read past an env's newest step, and the ring wrap is invisible.

        **Arguments:**

        - `key`: a JAX PRNG key.
        - `batch_size`: the number of transitions, a positive Python int (static).
        - `nstep`: an `NStep` (static), with `n + 1 <= max_length`.
        - `discount`: the per-step discount, a real scalar in `[0, 1]` (may be traced).
        - `source`: `"replay"` (the default) or `"online"`.

        **Returns:** `Transitions` `(first, returns, discount, next, env, start)`.

        **Raises:** `ValueError`/`TypeError` at once for bad static arguments or leaf names;
        an `eqx.error_if` error if no env holds `n + 1` steps in the chosen source, or if
        `discount` is not in `[0, 1]`.
        """
        call = "TrajectoryBuffer.sample_transitions"
        batch_size = check_positive_int(batch_size, f"{call}(batch_size=...)")
        nstep = as_nstep(nstep, options, call)
        nstep.check(self.item_spec, self.max_length, call)
        source = check_choice(source, SOURCES, f"{call}(source=...)")
        discount = check_real_scalar(discount, call, "discount")
        gamma, faults = as_float(discount, jnp.float32, call, "discount")
        lengths = self.lengths(source)
        out = draw_transitions(key, self.streams, lengths, batch_size, nstep, gamma)
        faults += [
            (~((gamma >= 0) & (gamma <= 1)), f"`{call}`: `discount` must be in [0, 1]"),
            (
                ~jnp.any(lengths > nstep.n),
                f"`{call}`: no env's {source} window holds n + 1 = {nstep.n + 1} steps yet; a "
                "transition needs its n steps and the step after them",
            ),
        ]
        return check_faults(out, faults, order_reads=False)

    def read(
        self,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        window: Window,
    ) -> SequenceSample:
        """The windows named by stamps `(env_ids, starts)`, read again: as `sample` returned
        them if they are not stale and no step was added since; else with the steps they now
        hold (the steps past an env's newest step masked, as ever).

        **Arguments:**

        - `env_ids`, `starts`: integer arrays of shape `(n,)`, stamps as a sample gives them.
        - `window`: a `Window` (static). Its period and strictness are not consulted: the
            starts are given.

        **Returns:** a `SequenceSample` of `n` windows.

        **Raises:** as `stale`, and an `eqx.error_if` error for a stale window (its first step
        has been overwritten: check `stale` first).
        """
        call = "TrajectoryBuffer.read"
        window = self._window(window, {}, call)
        stamps = check_stamps(self.streams, env_ids, starts, call, ndim=1)
        back = jnp.clip(stamps.taken - stamps.start, 1, self.max_length)
        stale = (
            ~stamps.bad & stamps.stale,
            f"`{call}`: a window is stale (its first step has been overwritten); read only "
            "the windows `stale` says are not",
        )
        out = read_windows(self.streams, stamps.env, back, window)
        return check_faults(out, [*stamps.faults, stale], order_reads=False)

    def overwritten(
        self, env_ids: Integer[ArrayLike, "*n"], starts: Integer[ArrayLike, "*n"]
    ) -> Bool[Array, "*n"]:
        """Deprecated: `stale` under its old name (removed in the next release)."""
        warnings.warn(
            "`TrajectoryBuffer.overwritten` is deprecated; use `stale` (the same).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.stale(env_ids, starts)

    def _window(self, window: Any, options: dict[str, Any], call: str) -> Window:
        window = as_window(window, options, call)
        window.check(self.item_spec, self.max_length, call)
        return window

    def _draw(
        self,
        key: PRNGKeyArray,
        source: Source,
        batch_size: int,
        window: Window,
        power: Float[Array, ""],
    ) -> SequenceSample:
        """Sample without run-time checks. If no env has an admissible start the result is
        meaningless (and nothing raises)."""
        lengths = self.lengths(source)
        starts = phase(self.step_count, window.period)
        env, back, _ = draw_starts(key, lengths, starts, batch_size, window.law, power)
        return read_windows(self.streams, env, back, window)


def check_power(distribution_power: Real[ArrayLike, ""], call: str) -> tuple[Array, list[Fault]]:
    """`distribution_power` as a float32 scalar, and the fault of a value that is not finite."""
    power = check_real_scalar(distribution_power, call, "distribution_power")
    power, faults = as_float(power, jnp.float32, call, "distribution_power")
    return power, [
        *faults,
        (~jnp.isfinite(power), f"`{call}`: `distribution_power` must be finite"),
    ]


def _draw_by_age(
    buffer: TrajectoryBuffer,
    key: PRNGKeyArray,
    batch_size: int,
    age: PolicyAge,
    window: Window,
    distribution_power: Real[ArrayLike, ""],
    source: Source,
    call: str,
) -> tuple[AgedSample, list[Fault]]:
    """`sample_by_age` after its trace-time checks, and its faults: every slot `s` of env `e`
    is the start at back distance `b = (head[e] - s) mod max_length` (`max_length` for 0),
    weighed by the window law and its first step's age."""
    power, faults = check_power(distribution_power, call)
    faults.append(_no_start_fault(buffer, source, window, call))
    back, ages, age_faults = read_step_ages(age, buffer.streams, call)
    starts = phase(buffer.step_count, window.period)
    law = start_log_weights(back, buffer.lengths(source), starts, window.law, power)
    draw, more = draw_by_age(key, batch_size, age, ages, law, call=call, what="window start")
    env = draw.indices // buffer.max_length
    windows = read_windows(buffer.streams, env, back.reshape(-1)[draw.indices], window)
    return AgedSample(windows, *draw), faults + age_faults + more


def _no_start_fault(buffer: TrajectoryBuffer, source: Source, window: Window, call: str) -> Fault:
    return no_start_fault(buffer.lengths(source), buffer.step_count, source, window, call)


def no_start_fault(
    lengths: Int[Array, " num_envs"],
    step_count: Int[Array, " num_envs"],
    source: Source,
    window: Window,
    call: str,
) -> Fault:
    """The fault of a draw from envs of these window `lengths` (of `source`) and step counts
    when none has an admissible start for `window`."""
    if window.law == Window(window.size).law:  # every stored step may start a window
        return jnp.all(lengths == 0), f"`{call}`: {_EMPTY[source]}"
    ok = admissible(lengths, phase(step_count, window.period), window.law)
    return (
        ~jnp.any(ok),
        f"`{call}`: no env's {source} window has an admissible start; a start needs "
        f"{window.needs()}",
    )


def append_checked(buffer: _TB, done: Appended, guard: Any = ()) -> tuple[_TB, Any]:
    """`buffer` after the checked append `done`, its online queue grown, with the append's
    faults checked once. The check guards the new counters and `guard`: what the caller
    builds its own update from (a prioritised buffer's tree writes), so that one check serves
    the whole call. Returns the new buffer and `guard` as the check returns it."""
    if done.length == 0:
        return buffer, guard
    online = grow(buffer.online_length, done.added, done.length, buffer.max_length)
    counters, online, guard = check_faults((done.counters(), online, guard), done.faults)
    streams = done.guarded(counters)
    return eqx.tree_at(lambda b: (b.streams, b.online_length), buffer, (streams, online)), guard
