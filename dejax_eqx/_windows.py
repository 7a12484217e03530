"""Windows of per-env streams: the options of a window (`Window`), checked once, and the
masking of gathered windows (`mask_windows`), the one code that turns stored steps into a
`SequenceSample`."""

import functools
import operator
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from ._checks import (
    check_bool,
    check_choice,
    check_leaf,
    check_nonnegative_int,
    check_positive_int,
    LeafName,
    pick_leaf,
)
from ._deprecated import as_options
from ._laws import mixture_rows, MixtureRows
from ._sequences import Law
from ._streams import gather_steps, Streams


EpisodeEnds = Literal["cross", "truncate", "within"]
_EPISODE_ENDS: tuple[EpisodeEnds, ...] = ("cross", "truncate", "within")
Starts = Literal["any", "episode"]
_STARTS: tuple[Starts, ...] = ("any", "episode")


class SequenceSample(NamedTuple):
    """What `TrajectoryBuffer.sample`, `sample_mixed` and `read` return: windows and what to do
    with each of their steps.

    A window of `W = burn_in + sequence_length + bootstrap` steps is laid out as
    `[burn-in | learning part | bootstrap]` along the sequence axis.

    **Fields:**

    - `items`: the windows, with the prototype's structure; each leaf of shape
        `(batch, W, *leaf_shape)`. Steps where `mask` is `False` are zeros (`False` for
        booleans).
    - `mask`: boolean `(batch, W)`, `True` at the steps the window holds: stored steps of its
        env, not cut off by the `episode_ends` policy.
    - `learn`: boolean `(batch, W)`, `mask` restricted to the learning part (positions
        `burn_in <= t < burn_in + sequence_length`): the steps a loss should train on.
    - `env`: int32 `(batch,)`, the env of each window.
    - `start`: int32 `(batch,)`, the absolute step number (in its env's stream, counting from 0
        at the first step ever added) of the window's position 0.

    `(env, start)` is the window's *stamp* (also as the property `stamp`):
    `buffer.stale(env, start)` tells whether the window has since lost steps to newer ones, and
    `buffer.read(env, start, window)` reads it again.
    """

    items: PyTree[Shaped[Array, "batch seq ..."]]
    mask: Bool[Array, "batch seq"]
    learn: Bool[Array, "batch seq"]
    env: Int[Array, " batch"]
    start: Int[Array, " batch"]

    @property
    def stamp(self) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
        """`(env, start)`: what `stale` and `read` take."""
        return self.env, self.start


@mixture_rows.register
def _(sample: SequenceSample) -> MixtureRows:
    return MixtureRows(sample, None)


class Window(eqx.Module):
    """What a sampled window is: its parts, which starts it may have, and what it does at an
    episode end. Checked once, when made; every field is a static Python value.

    A window is `W = burn_in + sequence_length + bootstrap` consecutive steps of one env's
    stream, laid out as `[burn-in | learning part | bootstrap]`: the burn-in primes a recurrent
    state, the learning part is trained on, the bootstrap steps give n-step targets their last
    values. `SequenceSample.learn` marks the learning part.

    Its start may be any stored step such that

    - the start's absolute step number (counting from 0 at its env's first step) is a multiple
        of `period`: windows of a period `P <= W` overlap by `W - P` steps, each step is in at
        most `ceil(W / P)` of them, and every step is a window's first step when `P = 1`;
    - with `strict=True`, the whole window is stored. Every such start is equally likely.
    - with `strict=False` (the default), the window holds at least `burn_in + 1` real steps (so
        at least one to learn from). Near the newest step of a stream a window runs past it:
        the steps past it are masked. A start whose window holds `r` real steps is drawn with
        probability proportional to `r ** distribution_power` (an argument of `sample`), over
        all envs and starts together.

    With `starts="episode"`, a start must also be the first step of an episode, as the
    buffer's `Episodes` says (the buffer must be made with `episodes=`): windows for memory
    models that begin where their recurrent state does, without burn-in. Among such starts
    the law is the same (uniform when strict, `r ** distribution_power` otherwise; by
    priority in a `PrioritisedTrajectoryBuffer`), drawn by listing every stored step,
    O(num_envs · max_length) per call. An auto-reset step begins no episode, nor does a
    step whose episode's first step is not known (the oldest steps of restored streams).
    When no admissible start is an episode's first step, the sample fails (or reports it,
    with `throw=False`); it never falls back to other starts.

    Envs without such a start are never drawn. At an episode end inside a window:

    - `episode_ends="cross"` (the default): nothing happens; windows run on into the next
        episode, and the steps carry their own `done` flags.
    - `"truncate"`: the steps after the first episode end at or past the learning part are
        masked (the end step itself is kept).
    - `"within"`: as `"truncate"`, and the steps up to the last episode end inside the burn-in
        are masked too, so every step the window holds belongs to the episode of its first
        learning step.

    The episode end is read from `done`: the leaf that marks the step that ends an episode (a
    key or attribute name, or a function that returns the leaf from a step), one bool per
    step; or a tuple of them, such as `("terminated", "truncated")`, any of which ends an
    episode. A function is compared by identity: reuse one function object, or each new one
    compiles anew under `jit`.

    The same window may be given to `TrajectoryBuffer.sample`, `sample_mixed` and `read`, to
    `PrioritisedTrajectoryBuffer` (whose items are its whole windows) and to `Dataset.sample`.
    The docs page "Sequences for recurrent and n-step learners" explains each option with
    examples.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(3), "done": jnp.zeros((), bool)}
        buf = dx.TrajectoryBuffer(step, num_envs=2, max_length=64)
        buf = buf.extend({"obs": jnp.ones((2, 30, 3)), "done": jnp.zeros((2, 30), bool)})
        r2d2 = dx.Window(8, burn_in=4, bootstrap=1, period=4, episode_ends="truncate", done="done")
        sample = buf.sample(jax.random.key(0), 16, r2d2)
        assert sample.items["obs"].shape == (16, 13, 3)  # W = 4 + 8 + 1
        assert (sample.start % 4 == 0).all()
        ```
    """

    sequence_length: int = eqx.field(static=True)
    burn_in: int = eqx.field(static=True)
    bootstrap: int = eqx.field(static=True)
    period: int = eqx.field(static=True)
    strict: bool = eqx.field(static=True)
    episode_ends: EpisodeEnds = eqx.field(static=True)
    done: tuple[LeafName, ...] = eqx.field(static=True)
    starts: Starts = eqx.field(static=True)

    def __init__(
        self,
        sequence_length: int,
        *,
        burn_in: int = 0,
        bootstrap: int = 0,
        period: int = 1,
        strict: bool = False,
        episode_ends: EpisodeEnds = "cross",
        done: LeafName | tuple[LeafName, ...] | None = None,
        starts: Starts = "any",
    ):
        """**Arguments:**

        - `sequence_length`: the length of the learning part, a positive Python int.
        - `burn_in`, `bootstrap`: the numbers of steps before and after the learning part,
            non-negative Python ints (default 0).
        - `period`: a positive Python int (default 1: every step may start a window).
        - `strict`: a Python bool (default `False`): only whole windows.
        - `episode_ends`: `"cross"` (the default), `"truncate"` or `"within"`.
        - `done`: the episode-end leaf or leaves; required unless `episode_ends="cross"`,
            refused with it.
        - `starts`: `"any"` (the default) or `"episode"`: only an episode's first step may
            start a window.

        **Raises:** `ValueError`/`TypeError` at once for a bad value. Whether `done` names
        boolean leaves of one value per step, and whether `W` fits in a buffer's
        `max_length`, is checked by the buffer the window is given to.
        """
        call = "Window"
        self.sequence_length = check_positive_int(sequence_length, f"{call}(sequence_length=...)")
        self.burn_in = check_nonnegative_int(burn_in, f"{call}(burn_in=...)")
        self.bootstrap = check_nonnegative_int(bootstrap, f"{call}(bootstrap=...)")
        self.period = check_positive_int(period, f"{call}(period=...)")
        self.strict = check_bool(strict, f"{call}(strict=...)")
        self.episode_ends = check_choice(episode_ends, _EPISODE_ENDS, f"{call}(episode_ends=...)")
        self.starts = check_choice(starts, _STARTS, f"{call}(starts=...)")
        if episode_ends == "cross":
            if done is not None:
                raise ValueError(
                    f"`{call}(done=...)` is given, but episode_ends='cross' does not read it; "
                    "pass episode_ends='truncate' or 'within', or leave `done` out."
                )
            self.done = ()
            return
        if done is None:
            raise ValueError(
                f"`{call}(episode_ends={episode_ends!r})` needs `done`: the name of the step's "
                "boolean episode-end leaf, or a tuple of names such as "
                "('terminated', 'truncated')."
            )
        self.done = tuple(done) if isinstance(done, tuple | list) else (done,)
        if not self.done:
            raise ValueError(f"`{call}(done=...)` is an empty tuple; name at least one leaf.")

    @property
    def size(self) -> int:
        """`W = burn_in + sequence_length + bootstrap`, the number of steps of a window."""
        return self.burn_in + self.sequence_length + self.bootstrap

    @property
    def law(self) -> Law:
        """Which starts the window may have, as the sampler takes it: `(size, period,
        min_real, strict)`, with `min_real = burn_in + 1` real steps at least."""
        return Law(self.size, self.period, min_real=self.burn_in + 1, strict=self.strict)

    def check(self, item_spec: PyTree[jax.ShapeDtypeStruct], max_length: int, call: str) -> None:
        """Check at trace time that streams of `max_length` steps of `item_spec` can hold the
        window: `W <= max_length`, and `done` names boolean leaves of one value per step.
        Messages start with `call`."""
        if self.size > max_length:
            raise ValueError(
                f"`{call}`: a window of burn_in + sequence_length + bootstrap = {self.burn_in} "
                f"+ {self.sequence_length} + {self.bootstrap} = {self.size} steps is longer "
                f"than max_length = {max_length}; no env ever holds one."
            )
        for name in self.done:
            check_leaf(item_spec, name, f"`{call}`: `Window(done=...)`", floating=False)

    def refuse_episode_starts(self, call: str) -> None:
        """Refuse at once, quoting `call`, a window that starts only at episodes
        (`starts="episode"`) where there is no episode bookkeeping to read (a dataset on
        disk)."""
        if self.starts == "episode":
            raise ValueError(
                f"`{call}`: `Window(starts='episode')` reads a buffer's episode bookkeeping, "
                "which a dataset does not keep; load the dataset into a buffer made with "
                "`episodes=` (`Dataset.load`) and sample that."
            )

    def needs(self) -> str:
        """What a start needs to be admissible, in words (for messages)."""
        needs = []
        if self.strict:
            needs.append(f"its whole window of {self.size} steps stored")
        elif self.burn_in > 0:
            needs.append(f"burn_in + 1 = {self.burn_in + 1} stored steps")
        if self.period > 1:
            needs.append(f"a step number that is a multiple of period = {self.period}")
        if self.starts == "episode":
            needs.append("to be the first step of a stored episode")
        return " and ".join(needs) or "a stored step"

    def masked_as(self, what: Any, call: str) -> "Window":
        """`what`, a `Window` of this window's parts (`sequence_length`, `burn_in`,
        `bootstrap`, `period`, `strict`) that may mask episode ends otherwise, or draw only
        the windows that start an episode (`starts`): how a buffer that draws its own windows
        is asked to mask them. Else an error quoting `call`."""
        if not isinstance(what, Window):
            raise TypeError(
                f"`{call}`: a PrioritisedTrajectoryBuffer draws its own windows: `what` must be "
                f"None or a `dx.Window` of the same parts, got {what!r}."
            )
        parts = lambda v: (v.sequence_length, v.burn_in, v.bootstrap, v.period, v.strict)  # noqa: E731
        if parts(what) != parts(self):
            raise ValueError(
                f"`{call}`: the buffer's windows are (sequence_length, burn_in, bootstrap, "
                f"period, strict) = {parts(self)}; a sample may mask them otherwise "
                f"(`episode_ends`, `done`) or draw those that start an episode (`starts`), "
                f"but not change them, and {parts(what)} does."
            )
        return what


def as_window(window: Any, options: dict[str, Any], call: str) -> Window:
    """`window` checked to be a `Window`; or, for one release, the old form: the learning
    length as an int and the options as keywords (`options`), with a `DeprecationWarning`."""
    return as_options(
        window, options, Window, call, "a sequence length with window options as keywords"
    )


def as_whole_window(window: Any, options: dict[str, Any], call: str, why: str) -> Window:
    """`as_window` for a call that takes whole windows only, `why` saying so: the window must
    be strict (the deprecated form is made strict)."""
    if not isinstance(window, Window):
        options = {**options, "strict": True}
    window = as_window(window, options, call)
    if not window.strict:
        raise ValueError(
            f"`{call}(window=...)`: {why}; pass a strict window, `dx.Window(..., strict=True)`."
        )
    return window


def _cut(
    ends: Bool[Array, "batch seq"], burn_in: int, policy: EpisodeEnds
) -> Bool[Array, "batch seq"]:
    """The steps an `episode_ends` policy removes from windows whose real steps end episodes
    at `ends`: after the first end at or past the learning part, and (`"within"`) up to the
    last end inside the burn-in."""
    t = jnp.arange(ends.shape[1])[None, :]
    late = ends & (t >= burn_in)
    cut = jnp.cumsum(late, axis=1, dtype=jnp.int32) > late.astype(jnp.int32)
    if policy == "within":
        early = ends & (t < burn_in)
        cut = cut | (jnp.cumsum(early[:, ::-1], axis=1, dtype=jnp.int32)[:, ::-1] > 0)
    return cut


def zero_masked(
    items: PyTree[Shaped[Array, "batch seq ..."]], mask: Bool[Array, "batch seq"]
) -> PyTree[Shaped[Array, "batch seq ..."]]:
    """Gathered steps (leaves `[batch, seq, ...]`) with the steps where `mask` is `False`
    zeroed (`False` for booleans): what a padded sample holds there."""

    def fill(x):
        keep = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
        return jnp.where(keep, x, jnp.zeros_like(x))

    return jax.tree.map(fill, items)


def mask_windows(
    items: PyTree[Shaped[Array, "batch seq ..."]],
    remaining: Int[Array, " batch"],
    window: Window,
    env: Int[Array, " batch"],
    start: Int[Array, " batch"],
) -> SequenceSample:
    """Gathered windows (leaves `[batch, W, ...]`) whose first `remaining` steps are real, as
    a `SequenceSample`: the steps past the real ones and those the `episode_ends` policy cuts
    are masked and zeroed. Unchecked: the window must have been checked against the steps."""
    t = jnp.arange(window.size, dtype=jnp.int32)
    mask = t[None, :] < remaining[:, None]
    if window.done:
        ends = functools.reduce(operator.or_, [pick_leaf(items, d) for d in window.done])
        mask = mask & ~_cut(ends & mask, window.burn_in, window.episode_ends)
    learning = (t >= window.burn_in) & (t < window.burn_in + window.sequence_length)

    return SequenceSample(
        items=zero_masked(items, mask),
        mask=mask,
        learn=mask & learning[None, :],
        env=env,
        start=start,
    )


def read_windows(
    streams: Streams, env: Int[Array, " batch"], back: Int[Array, " batch"], window: Window
) -> SequenceSample:
    """The windows that start at the `back`-th newest step of each `env` (`back` in `[1,
    max_length]`): `min(back, W)` real steps, then masked. Unchecked."""
    items = gather_steps(streams, env, back, window.size)
    size = jnp.minimum(back, window.size)
    return mask_windows(items, size, window, env, streams.step_count[env] - back)
