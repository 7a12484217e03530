"""TrajectoryBuffer: per-env streams with a replay window and an online queue."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Integer, PRNGKeyArray, PyTree, Real

from ._abstract import AbstractTrajectoryBuffer, Source
from ._checks import (
    as_float,
    check_choice,
    check_mask,
    check_nonnegative_int,
    check_real_scalar,
    LeafName,
    Prototype,
)
from ._deprecated import warn_replaced
from ._episode_laws import EpisodeStartLaw, require_episodes, WholeEpisode, WholeEpisodeLaw
from ._episodes import Episodes
from ._faults import check_faults, Fault
from ._laws import (
    AbstractEnumerableLaw,
    AbstractLaw,
    Candidates,
    Draw,
    in_union,
    MixedLaw,
    single,
    split_union,
)
from ._nstep import as_nstep, NStep, read_transitions, Transitions
from ._policy_age import AgedLaw, PolicyAge
from ._priorities import check_beta
from ._relabel import Relabel, relabelled_law
from ._results import initial_result, reports, Result
from ._sequences import admissible, draw_starts, Law, phase, start_log_weights
from ._streams import (
    Appended,
    check_append,
    check_stamps,
    grow,
    make_streams,
    step_backs,
    Streams,
)
from ._windows import as_window, EpisodeEnds, read_windows, SequenceSample, Window


_TB = TypeVar("_TB", bound="TrajectoryBuffer")

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
    episode-end policy), with replacement, over all envs and admissible starts together, or
    n-step transitions, described by an `NStep`; `source` picks the replay window, the online
    queue, or a number of rows from each. A sample costs O(num_envs + W + batch_size · W),
    whatever `max_length` (the method is in `dejax_eqx/README.md`).

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
            sample = buf.sample(key, 16, window, source={"replay": 12, "online": 4})
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
    result: Result | None
    """The first fault of the buffer's calls, as a `Result`, if it was built with
    `throw=False` (see `check`); `None` if it raises its faults (`throw=True`)."""

    def __init__(
        self,
        prototype: Prototype,
        num_envs: int,
        max_length: int,
        *,
        episodes: Episodes | None = None,
        written_back: Sequence[str] = (),
        throw: bool = True,
    ):
        """**Arguments:**

        - `prototype`: one step of one env, a pytree of arrays (or Python scalars). Only its
            structure, shapes and dtypes are used; stored steps must match them exactly.
        - `num_envs`: the number of envs (streams), a positive Python int.
        - `max_length`: the number of steps each env keeps, a positive Python int below
            `2**31`. Storage is `num_envs · max_length` steps.
        - `episodes`: an `Episodes` (which leaves end an episode, and the environment's
            auto-reset), to keep where every stored step's episode began and ended
            (`episodes_of`), at O(1) per added step and three int32 arrays of the storage's
            `(num_envs, max_length)`; what goal relabelling (`sample(..., relabel=...)`)
            needs. `None` (the default) keeps nothing.
        - `written_back`: keys of a dict step that adds may leave out: what a learner
            writes into stored steps with `write_back` (a recurrent state, a latent). A step
            added without them stores zeros there (`False` for booleans); one added with
            them stores what it is given. Default `()`.
        - `throw`: how a fault (a fact of the data: an empty buffer, an index out of range)
            is reported: raised at the faulty call (`True`, the default), or kept as the
            buffer's `result` and beside what a read returns (`False`: no conditional and no
            callback is compiled; see the guide's "Faults as results").
        """
        self.result = initial_result(throw, "TrajectoryBuffer(throw=...)")
        self.streams = make_streams(
            prototype, num_envs, max_length, "TrajectoryBuffer", episodes, written_back
        )
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

    @reports
    def add(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        done = check_append(self.streams, items, env_ids, "TrajectoryBuffer.add", sequences=False)
        return append_checked(self, done)[0]

    @reports
    def extend(
        self: _TB, items: PyTree[ArrayLike], env_ids: Integer[ArrayLike, " n"] | None = None
    ) -> _TB:
        done = check_append(self.streams, items, env_ids, "TrajectoryBuffer.extend", sequences=True)
        return append_checked(self, done)[0]

    def with_streams(self: _TB, streams: Streams) -> _TB:
        streams = self._check_streams(streams, "TrajectoryBuffer.with_streams")
        online = jnp.zeros(streams.num_envs, jnp.int32)
        return eqx.tree_at(lambda b: (b.streams, b.online_length), self, (streams, online))

    def with_written(self: _TB, streams: Streams) -> _TB:
        return eqx.tree_at(lambda b: b.streams, self, streams)

    def reset_online_queue(self: _TB) -> _TB:
        """Empty the online queue of every env; the replay windows keep all their steps."""
        return eqx.tree_at(lambda b: b.online_length, self, jnp.zeros_like(self.online_length))

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
        call: str = "TrajectoryBuffer.law",
    ) -> tuple[AbstractLaw, list[Fault]]:
        """Windows (`what` a `Window`): every admissible start of every env of the source,
        uniformly with a strict window, else a start whose window holds `r` real steps in
        proportion to `r ** distribution_power`; a `SequenceSample`. Transitions (`what` an
        `NStep`): every step whose `n` following steps are stored, uniformly; `Transitions`.
        With `age`, the same law times each start's age weight (an `AgedSample`, whose
        weights are 1). Costs O(num_envs + W + batch_size · W) per draw, whatever
        `max_length` (the method is in `dejax_eqx/README.md`); with `age`, O(num_envs ·
        max_length)."""
        sources = _sources(source, call)
        if age is None and beta is not None:
            raise TypeError(
                f"`{call}(beta=...)` sets the importance weights of an aged sample; windows "
                "and transitions of a TrajectoryBuffer have none. Give `age` too, or leave "
                "`beta` out."
            )
        parts_of = _PARTS.get(type(what))
        if parts_of is None:
            raise TypeError(
                f"`{call}`: `what` must be a `dx.Window` (windows), a `dx.NStep` (n-step "
                f"transitions) or a `dx.WholeEpisode` (whole episodes), got {what!r}."
            )
        if relabel is not None and parts_of is _episode_parts:
            raise TypeError(
                f"`{call}`: `relabel` relabels windows and transitions; whole episodes "
                "(`dx.WholeEpisode`) are not relabelled. Sample windows to relabel them."
            )
        parts, faults = parts_of(self, what, sources, distribution_power, discount, call)
        gamma = getattr(parts[0], "gamma", None)  # an n-step law's discount
        if age is not None:
            beta, beta_faults = check_beta(1.0 if beta is None else beta, call, jnp.float32)
            faults += beta_faults
            noun = parts[0].noun
            parts = [AgedLaw(part, self, age, noun=noun, call=call) for part in parts]
        if isinstance(source, Mapping):
            law: AbstractLaw = MixedLaw(tuple(parts), tuple(sources.values()), call)
        else:
            law = parts[0]
        if relabel is None:
            return law, faults
        what = cast(Window | NStep, what)  # whole episodes are refused above
        return relabelled_law(law, relabel, self.streams, what, gamma, age, call), faults

    @reports
    def sample(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        what: Window | NStep | WholeEpisode | int | None = None,
        *,
        distribution_power: Real[ArrayLike, ""] | None = None,
        source: Source | Mapping[Source, int] | None = None,
        discount: Real[ArrayLike, ""] | None = None,
        beta: Real[ArrayLike, ""] | None = None,
        age: PolicyAge | None = None,
        relabel: Relabel | None = None,
        burn_in: int | None = None,
        bootstrap: int | None = None,
        period: int | None = None,
        strict: bool | None = None,
        episode_ends: EpisodeEnds | None = None,
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> Any:
        """As `AbstractTrajectoryBuffer.sample`. `burn_in`, `bootstrap`, `period`, `strict`,
        `episode_ends` and `done`, with `what` an int (the sequence length), are the
        deprecated form of a `Window`."""
        call = "TrajectoryBuffer.sample"
        options = _given(
            burn_in=burn_in,
            bootstrap=bootstrap,
            period=period,
            strict=strict,
            episode_ends=episode_ends,
            done=done,
        )
        if options or type(what) not in _PARTS:  # the deprecated form of a `Window`
            what = as_window(what, options, call)
        return super().sample(
            key,
            batch_size,
            cast(Window | NStep | WholeEpisode, what),
            distribution_power=distribution_power,
            source=source,
            discount=discount,
            beta=beta,
            age=age,
            relabel=relabel,
        )

    @reports
    def sample_mixed(
        self,
        key: PRNGKeyArray,
        replay_batch_size: int,
        online_batch_size: int,
        window: Window | int,
        distribution_power: Real[ArrayLike, ""] = 1.0,
        *,
        burn_in: int | None = None,
        bootstrap: int | None = None,
        period: int | None = None,
        strict: bool | None = None,
        episode_ends: EpisodeEnds | None = None,
        done: LeafName | tuple[LeafName, ...] | None = None,
    ) -> SequenceSample:
        """Deprecated: `sample(key, replay_batch_size + online_batch_size, window,
        source={"replay": replay_batch_size, "online": online_batch_size},
        distribution_power=...)`, the same windows (removed in the next release)."""
        call = "TrajectoryBuffer.sample_mixed"
        warn_replaced(
            call,
            'sample(key, replay_batch_size + online_batch_size, window, source={"replay": '
            'replay_batch_size, "online": online_batch_size})',
        )
        sizes = {
            "replay": check_nonnegative_int(replay_batch_size, f"{call}(replay_batch_size=...)"),
            "online": check_nonnegative_int(online_batch_size, f"{call}(online_batch_size=...)"),
        }
        options = _given(
            burn_in=burn_in,
            bootstrap=bootstrap,
            period=period,
            strict=strict,
            episode_ends=episode_ends,
            done=done,
        )
        window = as_window(window, options, call)
        return super().sample(
            key,
            sizes["replay"] + sizes["online"],
            window,
            distribution_power=distribution_power,
            source=sizes,  # pyright: ignore[reportArgumentType]
        )

    @reports
    def sample_transitions(
        self,
        key: PRNGKeyArray,
        batch_size: int,
        nstep: NStep | int,
        *,
        discount: Real[ArrayLike, ""],
        source: Source = "replay",
        reward: LeafName | None = None,
        terminated: LeafName | None = None,
        truncated: LeafName | None = None,
    ) -> Transitions:
        """Deprecated: `sample(key, batch_size, nstep, discount=..., source=...)`, the same
        transitions (removed in the next release)."""
        call = "TrajectoryBuffer.sample_transitions"
        warn_replaced(call, "sample(key, batch_size, nstep, discount=..., source=...)")
        options = _given(reward=reward, terminated=terminated, truncated=truncated)
        nstep = as_nstep(nstep, options, call)
        return super().sample(key, batch_size, nstep, discount=discount, source=source)

    @reports
    def read(
        self,
        env_ids: Integer[ArrayLike, " n"],
        starts: Integer[ArrayLike, " n"],
        window: Window,
        *,
        mask: Bool[ArrayLike, " n"] | None = None,
    ) -> SequenceSample:
        """The windows named by stamps `(env_ids, starts)`, read again: as `sample` returned
        them if they are not stale and no step was added since; else with the steps they now
        hold (the steps past an env's newest step masked, as ever).

        **Arguments:**

        - `env_ids`, `starts`: integer arrays of shape `(n,)`, stamps as a sample gives them.
        - `window`: a `Window` (static). Its period and strictness are not consulted: the
            starts are given.
        - `mask`: optional boolean array of shape `(n,)`: only the entries where it is `True`
            are checked (the windows of the others are meaningless).

        **Returns:** a `SequenceSample` of `n` windows.

        **Raises:** as `stale`, and an `eqx.error_if` error for a stale window (its first step
        has been overwritten: check `stale` first).
        """
        call = "TrajectoryBuffer.read"
        window = as_window(window, {}, call)
        window.check(self.item_spec, self.max_length, call)
        stamps = check_stamps(self.streams, env_ids, starts, call, ndim=1)
        back = jnp.clip(stamps.taken - stamps.start, 1, self.max_length)
        faults = [
            *stamps.faults,
            (
                ~stamps.bad & stamps.stale,
                f"`{call}`: a window is stale (its first step has been overwritten); read only "
                "the windows `stale` says are not",
            ),
        ]
        if mask is not None:
            valid = check_mask(mask, stamps.env.shape[0], call)
            faults = [(jnp.asarray(pred) & valid, message) for pred, message in faults]
        out = read_windows(self.streams, stamps.env, back, window)
        return check_faults(out, faults, order_reads=False)

    @reports
    def overwritten(
        self, env_ids: Integer[ArrayLike, "*n"], starts: Integer[ArrayLike, "*n"]
    ) -> Bool[Array, "*n"]:
        """Deprecated: `stale` under its old name (removed in the next release)."""
        warn_replaced("TrajectoryBuffer.overwritten", "stale")
        return self.stale(env_ids, starts)


def _given(**options: Any) -> dict[str, Any]:
    """The deprecated keyword options that were given (not `None`)."""
    return {name: value for name, value in options.items() if value is not None}


def _sources(source: Any, call: str) -> dict[Source, int]:
    """`source` as the rows of each source: one source (the rows to be drawn, marked -1), or a
    mapping of both sources to their numbers of rows."""
    if source is None:
        return {"replay": -1}
    if isinstance(source, str):
        return {check_choice(source, SOURCES, f"{call}(source=...)"): -1}
    if isinstance(source, Mapping):
        if set(source) != set(SOURCES):
            raise ValueError(
                f"`{call}(source=...)`: a mapping of sources names both of {SOURCES}, each "
                f"with its number of rows; got the keys {sorted(map(str, source))}."
            )
        return {s: check_nonnegative_int(source[s], f"{call}(source[{s!r}]=...)") for s in SOURCES}
    raise TypeError(
        f"`{call}(source=...)` must be 'replay', 'online' or a mapping of both to their "
        f"numbers of rows, got {source!r}."
    )


def _window_parts(
    buffer: TrajectoryBuffer,
    window: Window,
    sources: dict[Source, int],
    distribution_power: Real[ArrayLike, ""] | None,
    discount: Real[ArrayLike, ""] | None,
    call: str,
) -> tuple[list[AbstractEnumerableLaw], list[Fault]]:
    """The laws of `window` from each source, and the faults of their arguments."""
    window.check(buffer.item_spec, buffer.max_length, call)
    if discount is not None:
        raise TypeError(
            f"`{call}(discount=...)` is for n-step transitions (`what` an `NStep`); a window "
            "has none."
        )
    power, faults = check_power(1.0 if distribution_power is None else distribution_power, call)
    laws: list[AbstractEnumerableLaw] = [
        WindowLaw(window, power, s, buffer.max_length) for s in sources
    ]
    if window.starts == "episode":
        require_episodes(buffer.streams, "`Window(starts='episode')`", call)
        laws = [EpisodeStartLaw(inner=law, stratified=False) for law in laws]
    return laws, faults


def _episode_parts(
    buffer: TrajectoryBuffer,
    episode: WholeEpisode,
    sources: dict[Source, int],
    distribution_power: Real[ArrayLike, ""] | None,
    discount: Real[ArrayLike, ""] | None,
    call: str,
) -> tuple[list[WholeEpisodeLaw], list[Fault]]:
    """The laws of whole episodes from each source (they take no options)."""
    episode.check(buffer.streams, call)
    for name, value in [("distribution_power", distribution_power), ("discount", discount)]:
        if value is not None:
            raise TypeError(
                f"`{call}({name}=...)`: whole episodes are drawn uniformly, each whole; "
                f"they take no `{name}`. Leave it out."
            )
    return [WholeEpisodeLaw(episode=episode, source=s) for s in sources], []


def _transition_parts(
    buffer: TrajectoryBuffer,
    nstep: NStep,
    sources: dict[Source, int],
    distribution_power: Real[ArrayLike, ""] | None,
    discount: Real[ArrayLike, ""] | None,
    call: str,
) -> tuple[list["TransitionsLaw"], list[Fault]]:
    """The laws of `nstep`'s transitions from each source, and the faults of their
    arguments."""
    nstep.check(buffer.item_spec, buffer.max_length, call)
    if distribution_power is not None:
        raise TypeError(
            f"`{call}(distribution_power=...)` weighs the starts of windows; n-step "
            "transitions are drawn uniformly. Leave it out."
        )
    if discount is None:
        raise TypeError(f"`{call}`: an `NStep` needs `discount=`, the per-step discount.")
    gamma, faults = check_discount(discount, call)
    return [TransitionsLaw(nstep, gamma, s, buffer.max_length) for s in sources], faults


# What a trajectory buffer draws, by the type of `what` (each type its law).
_PARTS: dict[type, Callable[..., tuple[list[Any], list[Fault]]]] = {
    Window: _window_parts,
    NStep: _transition_parts,
    WholeEpisode: _episode_parts,
}


def check_power(distribution_power: Real[ArrayLike, ""], call: str) -> tuple[Array, list[Fault]]:
    """`distribution_power` as a float32 scalar, and the fault of a value that is not finite."""
    power = check_real_scalar(distribution_power, call, "distribution_power")
    power, faults = as_float(power, jnp.float32, call, "distribution_power")
    return power, [
        *faults,
        (~jnp.isfinite(power), f"`{call}`: `distribution_power` must be finite"),
    ]


def check_discount(discount: Real[ArrayLike, ""], call: str) -> tuple[Array, list[Fault]]:
    """`discount` as a float32 scalar, and the fault of a value outside `[0, 1]`."""
    gamma, faults = as_float(
        check_real_scalar(discount, call, "discount"), jnp.float32, call, "discount"
    )
    return gamma, [
        *faults,
        (~((gamma >= 0) & (gamma <= 1)), f"`{call}`: `discount` must be in [0, 1]"),
    ]


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


class WindowLaw(AbstractEnumerableLaw):
    """A `TrajectoryBuffer`'s windows: every admissible start of every env of `source`, a
    start whose window holds `r` real steps weighing `r ** power` (1 when strict). Over a
    union of buffers, of every env of every buffer: the draw of one buffer of all their envs
    in order (`_sequences.py` draws it)."""

    window: Window
    power: Float[Array, ""]
    source: Source = eqx.field(static=True)
    max_length: int = eqx.field(static=True)  # the buffer's: bounds the number of starts
    noun: ClassVar[str] = "window start"  # what one candidate is, in policy age's messages

    def summary(self, buffer: TrajectoryBuffer) -> PyTree[Array]:
        return buffer.lengths(self.source), buffer.step_count

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        lengths, counts = summaries
        k = lengths.shape[1]
        lengths, counts = lengths.reshape(-1), counts.reshape(-1)
        starts = phase(counts, self.window.period)
        env, back, _ = draw_starts(
            key,
            lengths,
            starts,
            batch_size,
            self.window.law,
            self.power,
            max_length=self.max_length,
        )
        owner, env = _env_of(env, k, single(summaries))
        return Draw(owner, (env, back))

    def read(self, buffer: TrajectoryBuffer, at: PyTree[Array]) -> SequenceSample:
        env, back = at
        return read_windows(buffer.streams, env, back, self.window)

    def finish(self, rows: SequenceSample, draw: Draw, summaries: PyTree[Array]) -> SequenceSample:
        return self.name_candidates(rows, draw.owner, summaries)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        lengths, counts = summaries
        return ~jnp.asarray(self._no_start(lengths.reshape(-1), counts.reshape(-1), "")[0])

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        lengths, counts = summaries
        faults = [self._no_start(lengths.reshape(-1), counts.reshape(-1), call)]
        return [
            *faults,
            (~jnp.isfinite(self.power), f"`{call}`: `distribution_power` must be finite"),
        ]

    def _no_start(self, lengths: Array, counts: Array, call: str) -> Fault:
        return no_start_fault(lengths, counts, self.source, self.window, call)

    def candidates(self, buffer: TrajectoryBuffer) -> Candidates:
        back = step_backs(buffer.streams)
        starts = phase(buffer.step_count, self.window.period)
        lengths = buffer.lengths(self.source)
        log_law = start_log_weights(back, lengths, starts, self.window.law, self.power)
        return _step_candidates(buffer.streams, log_law.reshape(-1), back)

    def read_candidates(
        self, buffer: TrajectoryBuffer, index: Int[Array, " batch"]
    ) -> SequenceSample:
        env, back = _start_of(buffer.streams, index)
        return read_windows(buffer.streams, env, back, self.window)

    def name_candidates(
        self, rows: SequenceSample, owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> SequenceSample:
        return rows._replace(env=in_union(owner, rows.env, summaries[0].shape[1]))

    def num_candidates(self, buffer: TrajectoryBuffer) -> int:
        return buffer.num_envs * buffer.max_length


class TransitionsLaw(AbstractEnumerableLaw):
    """A `TrajectoryBuffer`'s n-step transitions: every step of `source` whose `n` following
    steps are stored, uniformly (the strict law of `n + 1` steps: the newest `n` steps of a
    stream wait). Over a union of buffers, of every env of every buffer."""

    nstep: NStep
    gamma: Float[Array, ""]
    source: Source = eqx.field(static=True)
    max_length: int = eqx.field(static=True)  # the buffer's: bounds the number of starts
    noun: ClassVar[str] = "transition start"  # what one candidate is, in policy age's messages

    @property
    def _law(self) -> Law:
        return Law(self.nstep.n + 1, strict=True)

    def summary(self, buffer: TrajectoryBuffer) -> PyTree[Array]:
        return buffer.lengths(self.source)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        k = summaries.shape[1]
        lengths = summaries.reshape(-1)
        power = jnp.zeros((), jnp.float32)
        env, back, _ = draw_starts(
            key,
            lengths,
            jnp.zeros_like(lengths),
            batch_size,
            self._law,
            power,
            max_length=self.max_length,
        )
        owner, env = _env_of(env, k, single(summaries))
        return Draw(owner, (env, back))

    def read(self, buffer: TrajectoryBuffer, at: PyTree[Array]) -> Transitions:
        env, back = at
        return read_transitions(buffer.streams, env, back, self.nstep, self.gamma)

    def finish(self, rows: Transitions, draw: Draw, summaries: PyTree[Array]) -> Transitions:
        return self.name_candidates(rows, draw.owner, summaries)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return jnp.any(summaries > self.nstep.n)

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        n = self.nstep.n
        return [
            (~((self.gamma >= 0) & (self.gamma <= 1)), f"`{call}`: `discount` must be in [0, 1]"),
            (
                ~self.available(summaries),
                f"`{call}`: no env's {self.source} window holds n + 1 = {n + 1} steps yet; a "
                "transition needs its n steps and the step after them",
            ),
        ]

    def candidates(self, buffer: TrajectoryBuffer) -> Candidates:
        back = step_backs(buffer.streams)
        lengths = buffer.lengths(self.source)
        zeros = jnp.zeros_like(lengths)
        log_law = start_log_weights(back, lengths, zeros, self._law, jnp.zeros((), jnp.float32))
        return _step_candidates(buffer.streams, log_law.reshape(-1), back)

    def read_candidates(self, buffer: TrajectoryBuffer, index: Int[Array, " batch"]) -> Transitions:
        env, back = _start_of(buffer.streams, index)
        return read_transitions(buffer.streams, env, back, self.nstep, self.gamma)

    def name_candidates(
        self, rows: Transitions, owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> Transitions:
        return rows._replace(env=in_union(owner, rows.env, summaries.shape[1]))

    def num_candidates(self, buffer: TrajectoryBuffer) -> int:
        return buffer.num_envs * buffer.max_length


def _env_of(
    env: Int[Array, " batch"], k: int, one: bool
) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """`(owner, env)` of env ids of a union of buffers of `k` envs each (`one`: a single
    buffer, whose ids are its own)."""
    if one:
        return jnp.zeros_like(env), env
    return split_union(env, k)


def _step_candidates(
    streams: Streams, log_law: Float[Array, " c"], back: Int[Array, "num_envs max_length"]
) -> Candidates:
    """Every slot of every env as a candidate start (flat: `env * max_length + slot`), of
    weight `log_law`, dated by the step it holds."""
    stored = (back <= streams.lengths[:, None]).reshape(-1)
    items = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), streams.data)
    return Candidates(log_law, None, items, stored)


def _start_of(
    streams: Streams, index: Int[Array, " batch"]
) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
    """`(env, back)` of flat candidate starts `env * max_length + slot`."""
    back = step_backs(streams).reshape(-1)[index]
    return index // streams.max_length, back


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
