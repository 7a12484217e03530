"""Episodes as the unit of a sample: windows that start at an episode's first step
(`EpisodeStartLaw`, over any law whose window starts can be listed) and whole episodes padded to
a length (`WholeEpisode`, `WholeEpisodeLaw`). Both read the episode bookkeeping of the streams
(`_episodes.EpisodeBook`, through `_streams.slot_episodes`), the one home of where episodes
begin and end, and both are drawn by listing every stored step (`_laws.CandidateLaw`):
O(num_envs · max_length) per call, like policy age. So they reach every layer that evaluates a
buffer's law (a global buffer's draw, a rate-limited sample, a mixture's part) with no code of
their own, and an aged draw (`PolicyAge`) reweighs them like any listed law.
"""

from typing import Any, ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from ._checks import check_bool, check_choice, check_positive_int
from ._faults import Fault
from ._laws import (
    AbstractEnumerableLaw,
    CandidateLaw,
    Candidates,
    in_union,
    mixture_rows,
    MixtureRows,
)
from ._streams import episode_starts, gather_steps, slot_episodes, step_backs, Streams
from ._windows import zero_masked


Longer = Literal["head", "exclude"]
_LONGER: tuple[Longer, ...] = ("head", "exclude")


def require_episodes(streams: Streams, what: str, call: str) -> None:
    """Refuse at trace time, quoting `call`, a draw of `what` from streams that keep no
    episodes."""
    if streams.book is None:
        raise TypeError(
            f"`{call}`: {what} needs a buffer that keeps episodes; make it with "
            "`episodes=dx.Episodes(done=..., autoreset=...)`."
        )


class EpisodeStartLaw(CandidateLaw):
    """`inner`'s law restricted to the window starts that are an episode's first step
    (`Window(starts="episode")`): each such start weighs what it weighs under `inner` (its
    `r ** power`, its priority's mass), every other weighs 0. The sample is `inner`'s
    (`finish_drawn`)."""

    inner: AbstractEnumerableLaw
    stratified: bool = eqx.field(static=True)

    @property
    def noun(self) -> str:
        """What a candidate is, for messages."""
        return getattr(self.inner, "noun", "window start")

    def inner_summary(self, buffer: Any) -> PyTree[Array]:
        return self.inner.summary(buffer)

    def candidates(self, buffer: Any) -> Candidates:
        c = self.inner.candidates(buffer)
        starts = episode_starts(buffer.streams).reshape(-1)
        at = starts if c.dates is None else starts[c.dates]
        return c._replace(log_law=jnp.where(at, c.log_law, -jnp.inf))

    def read_candidates(self, buffer: Any, index: Int[Array, " batch"]) -> PyTree[Array]:
        return self.inner.read_candidates(buffer, index)

    def name_candidates(
        self, rows: PyTree[Array], owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> PyTree[Array]:
        return self.inner.name_candidates(rows, owner, summaries[0])

    def num_candidates(self, buffer: Any) -> int:
        return self.inner.num_candidates(buffer)

    def generations(self, buffer: Any, index: Int[Array, " batch"]) -> Array | None:
        return self.inner.generations(buffer, index)

    def finish_drawn(self, rows, index, probabilities, log_mass, owner, summaries) -> Any:
        return self.inner.finish_drawn(rows, index, probabilities, log_mass, owner, summaries[0])

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        inner = summaries[0]
        return [
            *self.inner.faults(inner, call),
            (
                self.inner.available(inner) & ~self.available(summaries),
                f"`{call}`: no {self.noun} that could be drawn is the first step of a stored "
                "episode (`Window(starts='episode')`)",
            ),
        ]


class WholeEpisode(eqx.Module):
    """Whole episodes as the rows of a sample: `what` for `TrajectoryBuffer.sample`, in a
    buffer made with `episodes=`. Each row is one stored episode from its first step,
    padded to `max_steps` steps, with a mask and its length (an `EpisodeSample`).

    **The law.** Every stored episode whose first step is still stored is equally likely
    (not in proportion to its length: for that, draw windows with `Window(starts=
    "episode")`). An episode whose first step was overwritten is never drawn (its head is
    gone). With `running=False` (the default) only episodes that have ended are drawn; with
    `running=True` the running one of each env too, as far as it has gone. An episode longer
    than `max_steps` steps is drawn as its first `max_steps` steps, marked incomplete
    (`longer="head"`, the default), or never drawn (`longer="exclude"`). The steps of an
    episode are those its bookkeeping assigns it: with next-step auto-reset, the auto-reset
    step after an episode's end is not one of them. When no stored episode qualifies, the
    sample fails (or reports it, with `throw=False`).

    Drawn by listing every stored step: O(num_envs · max_length) per call, plus the gather
    of `batch · max_steps` steps. Static: every field is a Python value.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(2), "done": jnp.zeros((), bool)}
        episodes = dx.Episodes("done", autoreset="same-step")
        buf = dx.TrajectoryBuffer(step, num_envs=2, max_length=32, episodes=episodes)
        done = jnp.zeros((2, 20), bool).at[:, 6].set(True).at[:, 15].set(True)
        buf = buf.extend({"obs": jnp.ones((2, 20, 2)), "done": done})
        sample = buf.sample(jax.random.key(0), 8, dx.WholeEpisode(12))
        assert sample.items["obs"].shape == (8, 12, 2)
        assert set(sample.length.tolist()) <= {7, 9}  # steps 0-6 and 7-15 of each env
        assert sample.complete.all()
        ```
    """

    max_steps: int = eqx.field(static=True)
    running: bool = eqx.field(static=True)
    longer: Longer = eqx.field(static=True)

    def __init__(self, max_steps: int, *, running: bool = False, longer: Longer = "head"):
        """**Arguments:**

        - `max_steps`: the padded length of every row, a positive Python int (at most the
            buffer's `max_length`).
        - `running`: whether episodes that have not ended may be drawn (default `False`).
        - `longer`: what becomes of an episode longer than `max_steps`: `"head"` (the
            default: its first `max_steps` steps, `complete=False`) or `"exclude"` (never
            drawn).

        **Raises:** `ValueError`/`TypeError` at once for a bad value.
        """
        call = "WholeEpisode"
        self.max_steps = check_positive_int(max_steps, f"{call}(max_steps=...)")
        self.running = check_bool(running, f"{call}(running=...)")
        self.longer = check_choice(longer, _LONGER, f"{call}(longer=...)")

    def check(self, streams: Streams, call: str) -> None:
        """Check at trace time that `streams` keep episodes and can hold `max_steps`."""
        require_episodes(streams, "a whole-episode sample", call)
        if self.max_steps > streams.max_length:
            raise ValueError(
                f"`{call}`: `WholeEpisode(max_steps={self.max_steps})` is longer than "
                f"max_length = {streams.max_length}; no stream holds that many steps."
            )

    def needs(self) -> str:
        """What an episode needs to be drawn, in words (for messages)."""
        needs = ["its first step stored"]
        if not self.running:
            needs.append("to have ended")
        if self.longer == "exclude":
            needs.append(f"at most max_steps = {self.max_steps} steps")
        return ", ".join(needs)


class EpisodeSample(NamedTuple):
    """What a sample of `WholeEpisode` rows returns.

    **Fields:**

    - `items`: each row's episode from its first step, with the step's structure; each leaf
        `(batch, max_steps, *leaf_shape)`. Steps where `mask` is `False` are zeros (`False`
        for booleans).
    - `mask`: boolean `(batch, max_steps)`, `True` at the episode's steps (a prefix).
    - `length`: int32 `(batch,)`, the number of steps held, `mask.sum(axis=1)`.
    - `complete`: boolean `(batch,)`, whether the row holds the whole episode: it has ended
        and it has at most `max_steps` steps.
    - `env`: int32 `(batch,)`, the env of each episode.
    - `start`: int32 `(batch,)`, the absolute step number of the episode's first step.

    `(env, start)` is the row's stamp, as a window's: `write_back` takes it.
    """

    items: PyTree[Shaped[Array, "batch seq ..."]]
    mask: Bool[Array, "batch seq"]
    length: Int[Array, " batch"]
    complete: Bool[Array, " batch"]
    env: Int[Array, " batch"]
    start: Int[Array, " batch"]

    @property
    def stamp(self) -> tuple[Int[Array, " batch"], Int[Array, " batch"]]:
        """`(env, start)`: what `stale`, `read` and `write_back` take."""
        return self.env, self.start


@mixture_rows.register
def _(sample: EpisodeSample) -> MixtureRows:
    return MixtureRows(sample, None)


class WholeEpisodeLaw(CandidateLaw):
    """A trajectory buffer's whole episodes (`WholeEpisode`) from `source`: every slot that
    holds the first step of an episode that qualifies weighs 1, every other 0. Over a union of
    buffers, of every env of every buffer."""

    episode: WholeEpisode
    source: str = eqx.field(static=True)
    stratified: bool = eqx.field(static=True, default=False)
    noun: ClassVar[str] = "episode"

    def inner_summary(self, buffer: Any) -> PyTree[Array]:
        return buffer.lengths(self.source)

    def candidates(self, buffer: Any) -> Candidates:
        streams = buffer.streams
        info, step = slot_episodes(streams)
        stored = step_backs(streams) <= buffer.lengths(self.source)[:, None]
        ok = stored & ~info.reset & (info.first == step)
        if not self.episode.running:
            ok = ok & info.ended
        if self.episode.longer == "exclude":
            ok = ok & (info.last - info.first < self.episode.max_steps)
        log_law = jnp.where(ok, 0.0, -jnp.inf).astype(jnp.float32).reshape(-1)
        items = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), streams.data)
        every = (step_backs(streams) <= streams.lengths[:, None]).reshape(-1)
        return Candidates(log_law, None, items, every)

    def read_candidates(self, buffer: Any, index: Int[Array, " batch"]) -> EpisodeSample:
        streams = buffer.streams
        assert streams.book is not None
        m, size = streams.max_length, self.episode.max_steps
        env = (index // m).astype(jnp.int32)
        back = step_backs(streams)[env, index % m]
        items = gather_steps(streams, env, back, size)
        ids = gather_steps(streams, env, back, size, data=streams.book.ids)
        t = jnp.arange(size, dtype=jnp.int32)[None, :]
        mask = (t < back[:, None]) & (ids == ids[:, :1])
        start = streams.step_count[env] - back
        info = streams.book.info(env, start, streams.step_count)
        complete = info.ended & (info.last - info.first < size)

        length = jnp.sum(mask, axis=1, dtype=jnp.int32)
        return EpisodeSample(zero_masked(items, mask), mask, length, complete, env, start)

    def name_candidates(
        self, rows: EpisodeSample, owner: Int[Array, " batch"], summaries: PyTree[Array]
    ) -> EpisodeSample:
        return rows._replace(env=in_union(owner, rows.env, summaries[0].shape[1]))

    def num_candidates(self, buffer: Any) -> int:
        return buffer.num_envs * buffer.max_length

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return [
            (
                ~self.available(summaries),
                f"`{call}`: no stored {self.source} episode can be drawn; a whole-episode "
                f"row needs {self.episode.needs()}",
            )
        ]
