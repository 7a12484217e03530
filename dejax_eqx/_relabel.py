"""Goal relabelling (hindsight experience replay) as an option of a trajectory buffer's
sampling: `sample(..., relabel=dx.Relabel(...))`. A law over the buffer's own law
(`RelabelledLaw`): the rows are drawn exactly as without relabelling (the same key gives the
same rows), and the last `round(fraction · batch)` of them take a goal that the row's own
episode achieved, read where the row's shard reads the row, so the layers over the buffer
(the global and rate-limited ones) relabel as they sample. The episodes come from the
streams' bookkeeping (`_episodes.py`): O(1) per row."""

import math
from collections.abc import Callable
from typing import Any, cast, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree, UInt32

from ._checks import check_leaf, LeafName, pick_leaf
from ._faults import Fault
from ._laws import AbstractLaw, Draw, mixture_rows, MixtureRows, single
from ._nstep import n_step, NStep, Transitions
from ._sequences import uniform_below, unit_float
from ._streams import episodes_of, gather_at, Streams
from ._windows import SequenceSample, Window


Strategy = Literal["final", "future", "episode", "geometric", "random"]
STRATEGIES: tuple[Strategy, ...] = ("final", "future", "episode", "geometric", "random")

# Folded into the sample's key for the goals' draws: the rows' own draw uses the key as it
# is, so the rows are those of the same sample without relabelling.
_GOAL_STREAM = 0x48455231


class Relabel(eqx.Module):
    """Hindsight goal relabelling, given to a trajectory buffer's `sample` as `relabel=`: a
    fixed number of each batch's rows take as their goal one that their own episode achieved,
    and their rewards are recomputed for it. The buffer must keep episodes
    (`episodes=dx.Episodes(...)`).

    **The anchor.** A row's goal is drawn relative to its *anchor*: an n-step transition's
    first step, a window's first learning step (position `burn_in`). Step `j` gives the goal
    `achieved` of step `j`: the goal achieved **after** step `j`'s action (SB3's
    `next_achieved_goal`). Each step carries its own post-action goal, so the step that ends
    an episode never reads the next episode's first step (with same-step auto-reset) or an
    auto-reset step (with next-step auto-reset).

    **The strategies**, over the anchor `t`'s episode, whose steps run from `first` to `last`
    (its end, or for a running episode the env's newest step):

    - `"final"`: `j = last`.
    - `"future"`: `j` uniform over `[t, last]`, the anchor included (as SB3 and torchrl).
    - `"episode"`: `j` uniform over the episode's stored steps, `[max(first, oldest stored),
        last]`.
    - `"geometric"`: `j = t + i`, `i` in `[0, last - t]` with probability `∝ discount ** i`
        (a future truncated at the episode's end), drawn in O(1) by inverse CDF.
    - `"random"`: `j` uniform over every stored step of every env that belongs to an episode
        (torchrl's and SB2's law), in O(num_envs + batch · log max_length). Of one buffer only:
        over a `GlobalTrajectoryBuffer` its goals would come from other shards (refused).

    A goal never comes from an overwritten slot or an auto-reset step, and, but under
    `"random"`, never from another env or another episode.

    **Which rows.** The last `round(fraction · batch_size)` rows of a batch (halves round up)
    are relabelled; the others are exactly the rows the same sample without relabelling
    gives, and so are these apart from their goals and what depends on them. A row of the
    relabelled part whose anchor has no episode to draw from stays as it was and says so
    (`Relabelled.relabelled` is `False`): an auto-reset step, a window whose anchor is not
    stored, and, with `running=False`, a step of a running episode.

    **What changes in a relabelled row.** The `goal` leaf of every step it holds (a
    transition's `first` and `next`, every step of a window) becomes the drawn goal; the
    `reward` leaf is recomputed, `reward_fn(achieved, goal)` vmapped over the steps; with
    `terminated_fn`, the `terminated` leaf too. An n-step transition's `returns`,
    `discount` and `next` are recomputed over the new rewards and terminations. A window's
    `mask` is the one its stored episode ends gave (`episode_ends` reads the stored flags).

    **Arguments:**

    - `strategy`: one of the above.
    - `goal`: the desired-goal leaf, replaced in relabelled rows.
    - `achieved`: the leaf of the goal achieved after the step's action; same shape and
        dtype as `goal`.
    - `reward`: the reward leaf (one float per step), recomputed.
    - `reward_fn`: `(achieved, goal) -> reward`, pure, for one step (scalar of the reward
        leaf's dtype). Compared by identity (reuse one function object under `jit`).
    - `fraction`: the share of each batch that is relabelled, a Python float in `[0, 1]`
        (SB3's and torchrl's `her_ratio`; default 0.8, four of five rows).
    - `discount`: the `"geometric"` strategy's `γ`, a Python float in `(0, 1)`.
    - `terminated`, `terminated_fn`: optionally, the termination leaf (one bool per step)
        and `(achieved, goal) -> bool` to recompute it.
    - `running`: whether the steps of a running episode may give goals, its newest step
        standing for its end (default `True`: every goal so drawn is one the episode did
        achieve, and envs whose episodes outlast the ring would otherwise give none; SB3
        samples complete episodes only, `False`).
    """

    strategy: Strategy = eqx.field(static=True)
    goal: LeafName = eqx.field(static=True)
    achieved: LeafName = eqx.field(static=True)
    reward: LeafName = eqx.field(static=True)
    reward_fn: Callable[[Any, Any], Any] = eqx.field(static=True)
    fraction: float = eqx.field(static=True)
    discount: float | None = eqx.field(static=True)
    terminated: LeafName | None = eqx.field(static=True)
    terminated_fn: Callable[[Any, Any], Any] | None = eqx.field(static=True)
    running: bool = eqx.field(static=True)

    def __init__(
        self,
        strategy: Strategy,
        *,
        goal: LeafName,
        achieved: LeafName,
        reward: LeafName,
        reward_fn: Callable[[Any, Any], Any],
        fraction: float = 0.8,
        discount: float | None = None,
        terminated: LeafName | None = None,
        terminated_fn: Callable[[Any, Any], Any] | None = None,
        running: bool = True,
    ):
        call = "Relabel"
        if strategy not in STRATEGIES:
            options = ", ".join(repr(s) for s in STRATEGIES)
            raise ValueError(f"`{call}(strategy=...)` must be one of {options}, got {strategy!r}.")
        self.strategy = strategy
        self.goal, self.achieved, self.reward = goal, achieved, reward
        if not callable(reward_fn):
            raise TypeError(f"`{call}(reward_fn=...)` must be a function, got {reward_fn!r}.")
        self.reward_fn = reward_fn
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise TypeError(f"`{call}(fraction=...)` must be a Python float, got {fraction!r}.")
        if not 0 <= fraction <= 1:
            raise ValueError(f"`{call}(fraction=...)` must be in [0, 1], got {fraction}.")
        self.fraction = float(fraction)
        if strategy == "geometric":
            if isinstance(discount, bool) or not isinstance(discount, int | float):
                raise TypeError(
                    f"`{call}`: the 'geometric' strategy needs `discount=`, a Python float "
                    f"in (0, 1); got {discount!r}."
                )
            if not 0 < discount < 1:
                raise ValueError(f"`{call}(discount=...)` must be in (0, 1), got {discount}.")
            self.discount = float(discount)
        elif discount is not None:
            raise TypeError(
                f"`{call}(discount=...)` is the 'geometric' strategy's; {strategy!r} has none."
            )
        else:
            self.discount = None
        if (terminated is None) != (terminated_fn is None):
            raise TypeError(
                f"`{call}`: give `terminated` and `terminated_fn` together (the leaf and how "
                "to recompute it), or neither."
            )
        if terminated_fn is not None and not callable(terminated_fn):
            raise TypeError(f"`{call}(terminated_fn=...)` must be a function.")
        self.terminated, self.terminated_fn = terminated, terminated_fn
        if not isinstance(running, bool):
            raise TypeError(f"`{call}(running=...)` must be a bool, got {running!r}.")
        self.running = running

    def rows(self, batch_size: int) -> int:
        """How many rows of a batch of `batch_size` are relabelled: `round(fraction ·
        batch_size)`, halves up."""
        return math.floor(self.fraction * batch_size + 0.5)

    def check(self, item_spec: PyTree[jax.ShapeDtypeStruct], call: str) -> None:
        """Check at trace time that the leaves exist and agree, and that the functions give
        what the leaves hold."""
        what = f"`{call}`: `Relabel"
        check_leaf(item_spec, self.reward, f"{what}(reward=...)`", floating=True)
        if self.terminated is not None:
            check_leaf(item_spec, self.terminated, f"{what}(terminated=...)`", floating=False)
        goal = _leaf_spec(item_spec, self.goal, f"{what}(goal=...)`")
        achieved = _leaf_spec(item_spec, self.achieved, f"{what}(achieved=...)`")
        if (goal.shape, goal.dtype) != (achieved.shape, achieved.dtype):
            raise ValueError(
                f"{what}`: the goal leaf is {goal.dtype}{list(goal.shape)} but the achieved "
                f"goal leaf {achieved.dtype}{list(achieved.shape)}; they must match."
            )
        reward = pick_leaf(item_spec, self.reward)
        pairs = [("reward_fn", self.reward_fn, reward)]
        if self.terminated is not None and self.terminated_fn is not None:
            ends = pick_leaf(item_spec, self.terminated)
            pairs.append(("terminated_fn", self.terminated_fn, ends))
        for name, fn, leaf in pairs:
            out = jax.eval_shape(fn, achieved, goal)
            if not hasattr(out, "shape") or (tuple(out.shape), out.dtype) != ((), leaf.dtype):
                got = f"{out.dtype}{list(out.shape)}" if hasattr(out, "shape") else repr(out)
                raise TypeError(
                    f"{what}({name}=...)`: for one step it must return a scalar of the leaf's "
                    f"dtype {leaf.dtype}, got {got}. Nothing is cast."
                )


def _leaf_spec(spec: PyTree[jax.ShapeDtypeStruct], name: LeafName, what: str) -> Any:
    try:
        return pick_leaf(spec, name)
    except (KeyError, AttributeError, TypeError, IndexError) as error:
        raise ValueError(f"{what}: the step has no leaf {name!r} ({error}).") from None


class Relabelled(NamedTuple):
    """What a sample with `relabel=` returns.

    **Fields:**

    - `sample`: the rows, of the type the same sample without relabelling returns
        (`SequenceSample`, `Transitions`, `PrioritisedSequenceSample`), relabelled where
        `relabelled` holds.
    - `relabelled`: bool `(batch,)`, whether each row took a new goal.
    - `goal_env`, `goal_step`: int32 `(batch,)`, the env and the absolute step number of the
        step whose achieved goal the row took (`goal_env` is the row's own env but under
        `"random"`); `-1` where it took none.
    """

    sample: Any
    relabelled: Bool[Array, " batch"]
    goal_env: Int[Array, " batch"]
    goal_step: Int[Array, " batch"]


@mixture_rows.register
def _(sample: Relabelled) -> MixtureRows:
    return mixture_rows(sample.sample)


class RelabelledLaw(AbstractLaw):
    """`base`, a trajectory buffer's law of windows (`window`) or of n-step transitions
    (`nstep`, `gamma`), with the last rows of each batch relabelled by `relabel`."""

    base: AbstractLaw
    relabel: Relabel
    window: Window | None
    nstep: NStep | None
    gamma: Float[Array, ""] | None

    def summary(self, buffer: Any) -> PyTree[Array]:
        return self.base.summary(buffer)

    def draw(self, key: PRNGKeyArray, batch_size: int, summaries: PyTree[Array]) -> Draw:
        if self.relabel.strategy == "random" and not single(summaries):
            raise TypeError(
                "`Relabel('random')` draws goals from every env of one buffer; over a union "
                "of buffers (a GlobalTrajectoryBuffer's shards) they would come from other "
                "shards. Use another strategy there."
            )
        drawn = self.base.draw(key, batch_size, summaries)
        # Two random words per row: one call (a key per row would cost a hash per row).
        bits = jax.random.bits(jax.random.fold_in(key, _GOAL_STREAM), (batch_size, 2), jnp.uint32)
        return Draw(drawn.owner, (drawn.at, bits))

    def read(self, buffer: Any, at: PyTree[Array]) -> PyTree[Array]:
        base_at, bits = at
        rows = self.base.read(buffer, base_at)
        inner = rows.sample if _wrapped(rows) else rows
        inner, relabelled, goal_env, goal_step = self._relabel(buffer.streams, inner, bits)
        rows = rows._replace(sample=inner) if _wrapped(rows) else inner
        return rows, relabelled, goal_env, goal_step

    def finish(self, rows: PyTree[Array], draw: Draw, summaries: PyTree[Array]) -> Relabelled:
        rows, relabelled, goal_env, goal_step = rows
        out = self.base.finish(rows, Draw(draw.owner, draw.at[0]), summaries)
        if self.relabel.strategy != "random":  # the row's own env, as the base names it
            env = (out.sample if _wrapped(out) else out).env
            goal_env = jnp.where(relabelled, env, -1)
        return Relabelled(out, relabelled, goal_env, goal_step)

    def available(self, summaries: PyTree[Array]) -> Bool[Array, ""]:
        return self.base.available(summaries)

    def faults(self, summaries: PyTree[Array], call: str) -> list[Fault]:
        return self.base.faults(summaries, call)

    @property
    def independent_rows(self) -> bool:
        return False  # the last rows of a batch are relabelled

    # --- the goals -----------------------------------------------------------------------------

    def _relabel(
        self, streams: Streams, rows: SequenceSample | Transitions, bits: UInt32[Array, "batch 2"]
    ) -> tuple[Any, Bool[Array, " batch"], Int[Array, " batch"], Int[Array, " batch"]]:
        relabel = self.relabel
        batch = bits.shape[0]
        chosen = jnp.arange(batch) >= batch - relabel.rows(batch)
        env = rows.env
        if self.window is not None:  # windows: `rows` is a SequenceSample
            anchor = rows.start + self.window.burn_in
            stored = cast(SequenceSample, rows).mask[:, self.window.burn_in]
        else:
            anchor, stored = rows.start, jnp.ones(batch, bool)
        # Any stored step stands in for an anchor that is not, whose row is not relabelled.
        newest = streams.step_count[env] - 1
        anchor = jnp.where(stored, anchor, jnp.maximum(newest, 0))
        info = episodes_of(streams, env, anchor)
        ok = chosen & stored & ~info.reset & (info.ended | relabel.running)
        if relabel.strategy == "random":
            goal_env, goal_step, some = _random_goals(streams, bits)
            ok = chosen & stored & some
        else:
            oldest = streams.step_count[env] - streams.lengths[env]
            goal_env = env
            goal_step = _goal_steps(relabel, bits, anchor, info.first, info.last, oldest)
        goal_step = jnp.where(ok, goal_step, -1)
        goal_env = jnp.where(ok, goal_env, -1)
        slot = jnp.maximum(goal_step, 0) % streams.max_length
        leaf = pick_leaf(streams.data, relabel.achieved)
        achieved = gather_at(streams, jnp.maximum(goal_env, 0), slot, data=leaf)
        if self.window is not None:
            new = _relabel_windows(relabel, cast(SequenceSample, rows), achieved, ok)
        else:
            assert self.nstep is not None and self.gamma is not None
            rows = cast(Transitions, rows)
            new = _relabel_transitions(relabel, streams, rows, achieved, ok, self.nstep, self.gamma)
        return new, ok, goal_env, goal_step


def _random_goals(
    streams: Streams, bits: UInt32[Array, "batch 2"]
) -> tuple[Int[Array, " batch"], Int[Array, " batch"], Bool[Array, ""]]:
    """Per row, a stored step of any env that belongs to an episode, uniformly: `(env, step)`,
    and whether there is any. The `r`-th such step over the envs in order is found by its
    env (a cumulative count) and, in that env, by a binary search of the steps' ranks
    (`EpisodeBook.rank`): O(num_envs + batch · log max_length)."""
    book, m = streams.book, streams.max_length
    assert book is not None
    envs = jnp.arange(streams.num_envs, dtype=jnp.int32)
    oldest = streams.step_count - streams.lengths
    newest = jnp.maximum(streams.step_count - 1, 0)
    first_ids, last_ids = book.ids[envs, oldest % m], book.ids[envs, newest % m]
    low = book.rank(first_ids, oldest)
    end = book.rank(last_ids, newest) + (last_ids >= 0).astype(jnp.int32)
    counts = jnp.where(streams.lengths > 0, end - low, 0)
    ends = jnp.cumsum(counts)
    total = ends[-1]
    r = uniform_below(
        bits[:, 0], bits[:, 1], jnp.broadcast_to(jnp.maximum(total, 1), bits.shape[:1])
    )
    env = jnp.searchsorted(ends, r, side="right", method="compare_all").astype(jnp.int32)
    env = jnp.minimum(env, streams.num_envs - 1)
    target = low[env] + r - (ends - counts)[env]
    # The last position p in [0, lengths) whose step's rank is at most the target: a step of
    # an episode (an auto-reset step shares the next step's rank, and is never the last).
    lo, hi = jnp.zeros_like(env), jnp.maximum(streams.lengths[env] - 1, 0)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi + 1) // 2
        step = oldest[env] + mid
        fits = book.rank(book.ids[env, step % m], step) <= target
        return jnp.where(fits, mid, lo), jnp.where(fits, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, max(m - 1, 1).bit_length(), halve, (lo, hi))
    return env, oldest[env] + lo, total > 0


def _wrapped(rows: Any) -> bool:
    """Whether `rows` carry their windows in a `sample` field (a prioritised sample)."""
    return hasattr(rows, "_replace") and hasattr(rows, "sample")


def _goal_steps(
    relabel: Relabel,
    bits: UInt32[Array, "batch 2"],
    anchor: Int[Array, " batch"],
    first: Int[Array, " batch"],
    last: Int[Array, " batch"],
    oldest: Int[Array, " batch"],
) -> Int[Array, " batch"]:
    """Per row, the step whose achieved goal it takes, by the strategy's law."""
    if relabel.strategy == "final":
        return last
    if relabel.strategy == "future":
        lo = anchor
    elif relabel.strategy == "episode":
        lo = jnp.maximum(first, oldest)
    else:  # geometric: i in [0, L] with P(i) ∝ γ^i, by inverse CDF
        assert relabel.discount is not None
        span = (jnp.maximum(last - anchor, 0) + 1).astype(jnp.float32)
        u = unit_float(bits[:, 0])
        log_g = math.log(relabel.discount)
        # P(i <= x) = (1 - γ^(x + 1)) / (1 - γ^(L + 1)): i = floor(log(1 - u (1 - γ^(L+1)))
        # / log γ), clipped against rounding.
        tail = -jnp.expm1(span * log_g)  # 1 - γ^(L + 1)
        i = jnp.floor(jnp.log1p(-u * tail) / log_g)
        i = jnp.clip(i, 0, span - 1).astype(jnp.int32)
        return anchor + i
    span = jnp.maximum(last - lo, 0) + 1
    return lo + uniform_below(bits[:, 0], bits[:, 1], span)


def _set_leaf(tree: Any, name: LeafName, value: Array) -> Any:
    return eqx.tree_at(lambda t: pick_leaf(t, name), tree, value)


def _per_step(fn: Callable[[Any, Any], Any], achieved: Array, goal: Array, axes: int) -> Array:
    """`fn` over leading `axes` of `achieved`, with `goal` per row (the first axis)."""
    if axes == 1:
        return jax.vmap(fn)(achieved, goal)
    return jax.vmap(lambda a, g: jax.vmap(lambda x: fn(x, g))(a))(achieved, goal)


def _where_rows(ok: Bool[Array, " batch"], new: Array, old: Array) -> Array:
    return jnp.where(ok.reshape(ok.shape + (1,) * (new.ndim - 1)), new, old)


def _relabel_windows(
    relabel: Relabel, rows: SequenceSample, goal: Array, ok: Bool[Array, " batch"]
) -> SequenceSample:
    items = rows.items
    size = rows.mask.shape[1]
    mask = rows.mask
    goals = jnp.broadcast_to(goal[:, None], (goal.shape[0], size, *goal.shape[1:]))

    def masked(x):
        return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x, jnp.zeros_like(x))

    achieved = pick_leaf(items, relabel.achieved)
    new = _set_leaf(items, relabel.goal, masked(goals))
    new = _set_leaf(new, relabel.reward, masked(_per_step(relabel.reward_fn, achieved, goal, 2)))
    if relabel.terminated is not None:
        assert relabel.terminated_fn is not None
        ends = _per_step(relabel.terminated_fn, achieved, goal, 2)
        new = _set_leaf(new, relabel.terminated, masked(ends))
    items = jax.tree.map(lambda a, b: _where_rows(ok, a, b), new, items)
    return rows._replace(items=items)


def _relabel_transitions(
    relabel: Relabel,
    streams: Streams,
    rows: Transitions,
    goal: Array,
    ok: Bool[Array, " batch"],
    nstep: NStep,
    gamma: Float[Array, ""],
) -> Transitions:
    n, m = nstep.n, streams.max_length
    slots = (rows.start[:, None] + jnp.arange(n + 1, dtype=jnp.int32)[None, :]) % m
    env = rows.env[:, None]

    def steps(name):
        return gather_at(streams, env, slots[:, :n], data=pick_leaf(streams.data, name))

    achieved = steps(relabel.achieved)
    rewards = _per_step(relabel.reward_fn, achieved, goal, 2)
    # The n-step's own termination leaf, recomputed if it is the one `relabel` recomputes.
    if relabel.terminated_fn is not None and relabel.terminated == nstep.terminated:
        terminated = _per_step(relabel.terminated_fn, achieved, goal, 2)
    else:
        terminated = steps(nstep.terminated)
    if nstep.truncated is None:
        truncated = jnp.zeros_like(terminated)
    else:
        truncated = steps(nstep.truncated)
    returns, discount, taken = n_step(rewards, terminated, truncated, gamma)
    following = jnp.take_along_axis(slots, taken[:, None], axis=1)[:, 0]
    first = rows.first  # the start as the base law read it
    nxt = gather_at(streams, rows.env, following)
    first = _relabelled_step(relabel, first, goal)
    nxt = _set_leaf(nxt, relabel.goal, goal)
    new = Transitions(first, returns, discount, nxt, rows.env, rows.start)
    return jax.tree.map(lambda a, b: _where_rows(ok, a, b), new, rows)


def _relabelled_step(relabel: Relabel, step: PyTree[Array], goal: Array) -> PyTree[Array]:
    """One step per row with the goal `goal`, its reward (and termination) recomputed."""
    achieved = pick_leaf(step, relabel.achieved)
    new = _set_leaf(step, relabel.goal, goal)
    new = _set_leaf(new, relabel.reward, _per_step(relabel.reward_fn, achieved, goal, 1))
    if relabel.terminated is not None:
        assert relabel.terminated_fn is not None
        new = _set_leaf(
            new, relabel.terminated, _per_step(relabel.terminated_fn, achieved, goal, 1)
        )
    return new


def relabelled_law(
    law: AbstractLaw,
    relabel: Relabel | None,
    streams: Streams,
    what: Window | NStep,
    gamma: Float[Array, ""] | None,
    age: Any,
    call: str,
) -> AbstractLaw:
    """`law` (a trajectory buffer's, of `what`, over `streams` of its configuration) with
    `relabel`'s goals, or as it is without one. Checked at trace time."""
    if relabel is None:
        return law
    if not isinstance(relabel, Relabel):
        raise TypeError(f"`{call}(relabel=...)` must be a `dx.Relabel`, got {relabel!r}.")
    if streams.book is None:
        raise TypeError(
            f"`{call}(relabel=...)`: the buffer keeps no episodes, and goals are drawn from "
            "the episodes; make it with `episodes=dx.Episodes(done=..., autoreset=...)`."
        )
    if age is not None:
        raise TypeError(
            f"`{call}`: `relabel` and `age` do not combine yet; sample with one of them."
        )
    relabel.check(streams.item_spec, call)
    if gamma is not None:  # an n-step law's discount: `what` is an NStep
        return RelabelledLaw(law, relabel, None, cast(NStep, what), gamma)
    return RelabelledLaw(law, relabel, cast(Window, what), None, None)
