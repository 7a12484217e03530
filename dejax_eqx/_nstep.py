"""n-step transitions from per-env streams: the options (`NStep`), the return of a window of
steps (`n_step`, a pure function) and the draw.

A window holds steps `t, t + 1, ..., t + n` of one env's stream. Step `t + i` carries the
reward `r_{t+i}` for the action taken at step `t + i`, and two flags that say whether the
episode ended with that reward: `terminated` (a true end: nothing follows) and `truncated` (a
time limit: the episode could have gone on). The transition from `t` adds up the rewards up to
the first step that ends the episode, or `n` rewards if none does, and bootstraps from the step
after the last reward it took:

    k = min(n, 1 + the first i with terminated or truncated at t + i)
    R = sum_{i < k} gamma**i r_{t+i}
    discount = 0 if step t + k - 1 terminated, else gamma**k
    next = step t + k

A step that is both terminated and truncated counts as terminated.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree, Shaped

from ._checks import check_leaf, check_positive_int, LeafName, pick_leaf
from ._deprecated import as_options
from ._laws import mixture_rows, MixtureRows
from ._streams import gather_at, Streams, window_slots


class Transitions(NamedTuple):
    """What `TrajectoryBuffer.sample_transitions` returns: n-step transitions.

    **Fields:**

    - `first`: the step the transition starts from (its observation and action), with the
        prototype's structure, each leaf of shape `(batch, *leaf_shape)`.
    - `returns`: `(batch,)`, the discounted sum of the rewards up to the first episode end
        or `n` of them, in the reward leaf's dtype.
    - `discount`: `(batch,)`, the factor of the bootstrap value: `0` after a termination,
        else `discount ** k` for `k` rewards taken (a truncation keeps bootstrapping).
    - `next`: the step to bootstrap from (the step after the last reward taken), like
        `first`.
    - `env`: int32 `(batch,)`, the env of each transition.
    - `start`: int32 `(batch,)`, the absolute step number of `first`; `(env, start)` is the
        transition's stamp, as for `SequenceSample`.
    """

    first: PyTree[Shaped[Array, "batch ..."]]
    returns: Float[Array, " batch"]
    discount: Float[Array, " batch"]
    next: PyTree[Shaped[Array, "batch ..."]]
    env: Int[Array, " batch"]
    start: Int[Array, " batch"]


@mixture_rows.register
def _(sample: Transitions) -> MixtureRows:
    return MixtureRows(sample, None)


class NStep(eqx.Module):
    """What an n-step transition is: how many rewards it sums, and which leaves of a step hold
    the reward and the episode ends. Checked once, when made; every field is static.

    A step `t` of a stream carries the reward for the action taken at `t` and the flags that
    say whether that reward ended the episode. The transition from `t` takes the rewards of
    steps `t, t + 1, ...` up to the first step that ends the episode, or `n` of them, `k` in
    all: `returns = sum_{i < k} discount**i reward_{t+i}`, and it bootstraps from step `t + k`
    with factor `0` if step `t + k - 1` terminated, else `discount**k` (a truncation, a time
    limit, cuts the return but keeps bootstrapping: store the observation that followed it as
    the next step, as envpool and gymnasium's next-step autoreset do). A step that is both
    terminated and truncated counts as terminated.

    Leaves are named as `Window(done=...)` names them: a key or attribute of the step, or a
    function that returns the leaf (compared by identity).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import dejax_eqx as dx

        step = {"obs": jnp.zeros(3), "reward": jnp.zeros(()), "done": jnp.zeros((), bool)}
        buf = dx.TrajectoryBuffer(step, num_envs=2, max_length=32)
        buf = buf.extend(jax.tree.map(lambda x: jnp.zeros((2, 10, *x.shape), x.dtype), step))
        three = dx.NStep(3, reward="reward", terminated="done")
        t = buf.sample(jax.random.key(0), 8, three, discount=0.99)
        assert t.returns.shape == (8,) and t.next["obs"].shape == (8, 3)
        ```
    """

    n: int = eqx.field(static=True)
    reward: LeafName = eqx.field(static=True)
    terminated: LeafName = eqx.field(static=True)
    truncated: LeafName | None = eqx.field(static=True)

    def __init__(
        self,
        n: int,
        *,
        reward: LeafName,
        terminated: LeafName,
        truncated: LeafName | None = None,
    ):
        """**Arguments:**

        - `n`: the most rewards a transition sums, a positive Python int.
        - `reward`: the reward leaf: one floating value per step.
        - `terminated`: the termination leaf: one bool per step.
        - `truncated`: the truncation leaf, one bool per step, or `None` (the default) if the
            steps have none.

        **Raises:** `ValueError`/`TypeError` at once for a bad `n` or a name that is neither a
        str nor a function. Whether the names pick suitable leaves is checked by the buffer.
        """
        self.n = check_positive_int(n, "NStep(n=...)")
        for what, name in [
            ("reward", reward),
            ("terminated", terminated),
            ("truncated", truncated),
        ]:
            if not (
                isinstance(name, str) or callable(name) or (what == "truncated" and name is None)
            ):
                raise TypeError(
                    f"`NStep({what}=...)` must name a leaf of the step: a str (a key or "
                    f"attribute of the step) or a function that returns the leaf, got {name!r}."
                )
        self.reward, self.terminated, self.truncated = reward, terminated, truncated

    def check(self, item_spec: PyTree[jax.ShapeDtypeStruct], max_length: int, call: str) -> None:
        """Check at trace time that streams of `max_length` steps of `item_spec` hold such
        transitions: `n + 1 <= max_length`, and the names pick suitable leaves."""
        if self.n + 1 > max_length:
            raise ValueError(
                f"`{call}`: an n-step transition reads n + 1 = {self.n + 1} steps, more than "
                f"max_length = {max_length}; no env ever holds them."
            )
        check_leaf(item_spec, self.reward, f"`{call}`: `NStep(reward=...)`", floating=True)
        check_leaf(item_spec, self.terminated, f"`{call}`: `NStep(terminated=...)`", floating=False)
        if self.truncated is not None:
            check_leaf(
                item_spec, self.truncated, f"`{call}`: `NStep(truncated=...)`", floating=False
            )


def as_nstep(nstep: Any, options: dict[str, Any], call: str) -> NStep:
    """`nstep` checked to be an `NStep`; or, for one release, the old form: `n` as an int and
    the leaves as keywords (`options`), with a `DeprecationWarning`."""
    return as_options(
        nstep, options, NStep, call, "`n` with the reward and episode-end leaves as keywords"
    )


class NStepReturns(NamedTuple):
    """`returns[b] = R`, `discount[b]`, and `taken[b] = k`, the number of rewards summed (the
    position of the bootstrap step in the window)."""

    returns: Float[Array, " batch"]
    discount: Float[Array, " batch"]
    taken: Int[Array, " batch"]


def n_step(
    rewards: Float[Array, "batch n"],
    terminated: Bool[Array, "batch n"],
    truncated: Bool[Array, "batch n"],
    gamma: Float[Array, ""],
) -> NStepReturns:
    """The n-step return of each row of a batch of windows (see the module's docstring).

    **Arguments:**

    - `rewards`: the rewards of the first `n` steps of each window (a floating dtype, kept).
    - `terminated`, `truncated`: the end flags of those steps.
    - `gamma`: the per-step discount, a scalar in `[0, 1]` (converted to the rewards' dtype).

    **Returns:** an `NStepReturns` of arrays of shape `(batch,)`; `returns` and `discount` in
    the rewards' dtype, `taken` int32 in `[1, n]`.
    """
    n = rewards.shape[1]
    gamma = gamma.astype(rewards.dtype)
    ends = terminated | truncated
    # Reward i is taken when no step before it ended the episode.
    ended_before = jnp.cumsum(ends, axis=1, dtype=jnp.int32) - ends.astype(jnp.int32)
    taken_mask = ended_before == 0
    taken = jnp.sum(taken_mask, axis=1, dtype=jnp.int32)
    powers = gamma ** jnp.arange(n, dtype=rewards.dtype)
    returns = jnp.sum(jnp.where(taken_mask, rewards, 0) * powers[None, :], axis=1)
    last = jnp.take_along_axis(terminated, (taken - 1)[:, None], axis=1)[:, 0]
    discount = jnp.where(last, jnp.zeros((), rewards.dtype), gamma ** taken.astype(rewards.dtype))
    return NStepReturns(returns, discount, taken)


def read_transitions(
    streams: Streams,
    env: Int[Array, " batch"],
    back: Int[Array, " batch"],
    nstep: NStep,
    gamma: Float[Array, ""],
) -> Transitions:
    """The transitions that start at the `back`-th newest step of each `env` (`back` in
    `[n + 1, max_length]` for a transition whose `n` following steps are stored). Only the
    reward and end leaves are read for the `n` steps, then the first and the bootstrap step.
    Unchecked."""
    n = nstep.n
    # The slots of the n + 1 steps from the start: the rewards and end flags of the first n
    # are gathered, then only the first step and the one to bootstrap from.
    slots = window_slots(streams, env, back, n + 1)

    def steps(name):
        return gather_at(streams, env[:, None], slots[:, :n], data=pick_leaf(streams.data, name))

    ends = steps(nstep.terminated)
    cut = steps(nstep.truncated) if nstep.truncated is not None else jnp.zeros_like(ends)
    returns, factor, taken = n_step(steps(nstep.reward), ends, cut, gamma)
    following = jnp.take_along_axis(slots, taken[:, None], axis=1)[:, 0]
    return Transitions(
        first=gather_at(streams, env, slots[:, 0]),
        returns=returns,
        discount=factor,
        next=gather_at(streams, env, following),
        env=env,
        start=streams.step_count[env] - back,
    )
