"""R2D2-style recurrent Q-learning on envpool's asynchronous CartPole-v1, with the velocities
removed from the observation.

The agent sees only the cart's position and the pole's angle, so it must infer both velocities
from what it saw before: a memoryless policy cannot balance the pole for long. What it uses:

- **Actors.** envpool in async mode (`num_envs` envs, `batch_size` of them per `recv()`, a
  different subset every time). A host loop receives a batch, picks actions with the LSTM
  Q-network (one jitted call, the envs' recurrent states kept on the device), appends the steps
  to those envs' streams with `env_ids` (one jitted call), and sends the actions. Each env has
  its own epsilon, Ape-X style: `0.4 ** (1 + 7 * i / (num_envs - 1))` for env `i`.
- **Replay.** A `dx.PrioritisedTrajectoryBuffer`: windows of `burn_in + sequence_length + n`
  steps starting every `period` steps of each env's stream, drawn by priority with importance
  weights; a new window enters at the largest priority seen so far and leaves when its first
  step is overwritten. Each learner batch is mixed with windows from the online queue (the
  steps added since it was last emptied), drawn uniformly, as in Muesli.
- **Learner.** An LSTM Q-network in equinox, trained with optax: a burn-in of `burn_in` steps
  that only warms up the recurrent state, started from zeros by default (R2D2's zero-state
  strategy with burn-in: the actors' states are not stored), n-step double Q-learning targets from a
  Polyak-averaged target network, R2D2's value rescaling, and R2D2's sequence priority
  `0.9 * max + 0.1 * mean` of |TD error|.
- **Stored state** (`--stored-state`, R2D2's other strategy). Each step also holds the actor's
  LSTM state before it saw that step's observation (key `"state"`, declared
  `written_back=("state",)`); the burn-in starts from the state stored at the window's first
  step, and the states the online network computed after the burn-in are written back into
  the stored steps with `write_back` (one learner step late, like the priorities: entries
  whose step was overwritten in between are dropped, and the run reports how many).
- **Stale priority updates are dropped.** Priorities are set one learner step late, as a
  pipelined learner would: the stamps the sample returned name the windows, and an update for a
  window that left the replay in the meantime is ignored (the run reports how many).
- **Evaluation.** Every `eval_every` env steps, 20 greedy episodes in a separate envpool. When
  the mean reaches `--target-return` (475 by default), 20 fresh episodes confirm it, and the
  run stops if they do too; the last line reports the confirming evaluation (or the last
  one, when the budget runs out).

The per-recv calls are plain `jax.jit` functions with `donate_argnums`, the fast path of
docs/jit-patterns.md: a buffer holds only arrays, so it goes to `jax.jit` as it is, without
`eqx.filter_jit`'s per-call partitioning. The add comes after `send`, so envpool steps the
envs while it runs.

Run: python examples/r2d2_envpool.py --seed 0 [--max-seconds 600] [--smoke] [--throughput]
[--memoryless] [--stored-state] (Linux; `pip install -e '.[examples]'` installs envpool.) Writes
`r2d2_envpool.png`, the greedy return against env steps and wall time, and exits with status 1
if the bar is not reached within the budget. `--throughput` measures the loop instead of
training: env steps per second of the actor loop with and without the buffer calls, and the
learner step. `--memoryless` is an ablation that restarts the recurrent state at every step.
`--stored-state` starts each burn-in from the stored state instead of zeros.
Results: docs/r2d2-envpool.md.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import dataclasses
import decimal
import functools
import math
import os
import sys
import warnings
from typing import NamedTuple

import dejax_eqx as dx
import envpool
import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np


matplotlib.use("Agg")  # write the PNG without a display
import matplotlib.pyplot as plt
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree
from tqdm import tqdm


# gymnasium warns that envpool's CartPole observation bounds are stored as float32.
warnings.filterwarnings("ignore", message=".*precision lowered", category=UserWarning)

OBSERVED = np.array([0, 2])  # cart position and pole angle; the two velocities are hidden
NUM_ACTIONS = 2


@dataclasses.dataclass(frozen=True)
class Config:
    num_envs: int = 16
    batch_size: int = 8  # envs per recv()
    max_length: int = 2_048  # steps kept per env: 32,768 in all
    burn_in: int = 8
    sequence_length: int = 16  # the learning part of a window
    n_step: int = 3  # also the window's bootstrap tail
    period: int = 8  # windows start every `period` steps of an env's stream
    replay_batch: int = 32
    online_batch: int = 8
    # The online queue is emptied every `online_cycle` recvs. The learner waits until it has
    # had (burn_in + 1) * num_envs / batch_size recvs (18): then some env holds at least
    # burn_in + 1 of its steps, enough for an online window with a step to learn from.
    online_cycle: int = 128
    hidden_size: int = 64
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01  # Polyak step of the target network after every update
    priority_exponent: float = 0.6
    importance_exponent: float = 0.6  # beta
    eta: float = 0.9  # R2D2's sequence priority: eta * max + (1 - eta) * mean
    rescale_eps: float = 1e-3  # R2D2's value rescaling h(x)
    learn_every: int = 2  # recvs per learner step
    warmup_steps: int = 2_000  # env steps before the first learner step
    eval_every: int = 5_000  # env steps between greedy evaluations
    eval_episodes: int = 20
    target_return: float = 475.0  # where a run stops; CartPole-v1 pays at most 500
    max_steps: int = 1_000_000
    # False: an ablation that restarts the recurrent state at every step (a feed-forward
    # Q-network with the same layers), to show what memory is worth on this task.
    memory: bool = True
    # True: R2D2's stored-state strategy (the burn-in starts from the state stored with the
    # window's first step, refreshed by the learner's write-back); False: from zeros.
    stored_state: bool = False


# --- The network ----------------------------------------------------------------------------------


class QNet(eqx.Module):
    """Observation -> Linear -> ReLU -> LSTM -> Linear -> ReLU -> Q-values. Arrays only (no
    function-valued fields), so the network goes to `jax.jit` as it is."""

    embed: eqx.nn.Linear
    lstm: eqx.nn.LSTMCell
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, obs_size: int, hidden_size: int, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(obs_size, hidden_size, key=k1)
        self.lstm = eqx.nn.LSTMCell(hidden_size, hidden_size, key=k2)
        self.hidden = eqx.nn.Linear(hidden_size, hidden_size, key=k3)
        self.out = eqx.nn.Linear(hidden_size, NUM_ACTIONS, key=k4)

    def step(
        self, obs: Float[Array, " obs"], state: tuple[Array, Array]
    ) -> tuple[Float[Array, " actions"], tuple[Array, Array]]:
        state = self.lstm(jax.nn.relu(self.embed(obs)), state)
        return self.out(jax.nn.relu(self.hidden(state[0]))), state

    def unroll(
        self, obs: Float[Array, "time obs"], first: Bool[Array, " time"], state: tuple[Array, Array]
    ) -> tuple[Float[Array, "time actions"], tuple[Array, Array]]:
        """Q-values along one env's steps; the state restarts from zeros at each episode's
        first step."""

        def body(state, x):
            obs, first = x
            state = jax.tree.map(lambda s: jnp.where(first, 0.0, s), state)
            q, state = self.step(obs, state)
            return state, q

        state, q = jax.lax.scan(body, state, (obs, first))
        return q, state

    def unroll_states(
        self, obs: Float[Array, "time obs"], first: Bool[Array, " time"], state: tuple[Array, Array]
    ) -> tuple[Float[Array, "time actions"], Float[Array, "time 2 hidden"], tuple[Array, Array]]:
        """`unroll`, with the state before each step as well (after the restart at a first
        step: the state that step's observation is fed with), `h` and `c` stacked."""

        def body(state, x):
            obs, first = x
            state = jax.tree.map(lambda s: jnp.where(first, 0.0, s), state)
            before = jnp.stack(state)
            q, state = self.step(obs, state)
            return state, (q, before)

        state, (q, before) = jax.lax.scan(body, state, (obs, first))
        return q, before, state


def zero_state(cfg: Config, *batch: int) -> tuple[Array, Array]:
    return (jnp.zeros((*batch, cfg.hidden_size)), jnp.zeros((*batch, cfg.hidden_size)))


# R2D2's invertible value rescaling: the network learns h(Q), which grows like sqrt(|Q|).
def rescale(x: Array, eps: float) -> Array:
    return jnp.sign(x) * (jnp.sqrt(jnp.abs(x) + 1.0) - 1.0) + eps * x


def unrescale(x: Array, eps: float) -> Array:
    root = (jnp.sqrt(1.0 + 4.0 * eps * (jnp.abs(x) + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return jnp.sign(x) * (root**2 - 1.0)


# --- What a stored step holds ---------------------------------------------------------------------
#
# One step per recv() of an env: what came back (the observation, the reward and the end flags
# of the previous action) and the action then sent. The step after an episode's last one holds
# the next episode's first observation (`first`), reward 0; the action sent with a last step is
# ignored by envpool, so a step whose observation ended an episode is never learnt from.


def step_prototype(cfg: Config | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    step = {
        "obs": jax.ShapeDtypeStruct((len(OBSERVED),), jnp.float32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), jnp.float32),  # for the previous action
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),  # the previous action ended it
        "truncated": jax.ShapeDtypeStruct((), jnp.bool_),  # the time limit ended it
        "first": jax.ShapeDtypeStruct((), jnp.bool_),  # the episode's first observation
    }
    if cfg is not None and cfg.stored_state:
        # The actor's LSTM state (h, c) before it fed this step's observation: the state a
        # window starting here starts from. The learner writes fresher ones back.
        step["state"] = jax.ShapeDtypeStruct((2, cfg.hidden_size), jnp.float32)
    return step


class Learner(eqx.Module):
    net: QNet
    target: QNet
    opt_state: PyTree
    key: PRNGKeyArray


class States(NamedTuple):
    """Recurrent states computed by one learner step along its windows (replay and online),
    written back at the next one (`--stored-state`)."""

    env: Int[Array, " rows"]
    start: Int[Array, " rows"]
    state: Float[Array, "rows window 2 hidden"]  # the state before each step of the window
    write: Bool[Array, "rows window"]  # which to write: real steps after the burn-in


class Pending(NamedTuple):
    """Priorities computed by one learner step, set at the next one (a pipelined learner),
    and with `--stored-state` the states to write back."""

    env: Int[Array, " batch"]
    start: Int[Array, " batch"]
    priority: Float[Array, " batch"]
    states: States | None = None


class Actors(NamedTuple):
    """What the acting side keeps on the device: each env's recurrent state and a key."""

    state: tuple[Array, Array]
    key: PRNGKeyArray


def make_optimiser(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate, eps=1e-4))


def replay_window(cfg: Config) -> dx.Window:
    """The prioritised windows: burn-in, the learning part, the n-step bootstrap, on a period."""
    return dx.Window(
        cfg.sequence_length,
        burn_in=cfg.burn_in,
        bootstrap=cfg.n_step,
        period=cfg.period,
        strict=True,
    )


def online_window(cfg: Config) -> dx.Window:
    """The online queue's windows: any start (strict=False: a window may run past an env's
    newest step, masked there)."""
    return dx.Window(cfg.sequence_length, burn_in=cfg.burn_in, bootstrap=cfg.n_step)


def make_buffer(cfg: Config) -> dx.PrioritisedTrajectoryBuffer:
    return dx.PrioritisedTrajectoryBuffer(
        step_prototype(cfg),
        num_envs=cfg.num_envs,
        max_length=cfg.max_length,
        window=replay_window(cfg),
        priority_exponent=cfg.priority_exponent,
        # The actors store the state with every add, but adds could leave it out (stored as
        # zeros): the learner's write-back is what keeps it fresh.
        written_back=("state",) if cfg.stored_state else (),
    )


def epsilons(cfg: Config) -> np.ndarray:
    i = np.arange(cfg.num_envs)
    return (0.4 ** (1 + 7 * i / max(cfg.num_envs - 1, 1))).astype(np.float32)


def n_step_targets(
    cfg: Config,
    items: dict[str, Array],
    mask: Bool[Array, "batch window"],
    q_online: Float[Array, "batch after_burn_in actions"],
    q_target: Float[Array, "batch after_burn_in actions"],
) -> tuple[Float[Array, "batch seq"], Bool[Array, "batch seq"]]:
    """n-step double-Q targets of the learning part (rescaled), and which of them are valid.

    For the step at position `t`, with the stored-step convention above: the rewards of
    positions `t + 1 ..`, up to the first that ends an episode or `n` of them, then the
    target network's value (of the online network's greedy action) at the position after
    them: none after a termination, the truncated step's own after a truncation. The
    target is valid where step `t` is real and its observation ended no episode (its action
    was ignored), and the position it bootstraps from (or ends at) is real. `q_online` and
    `q_target` are the two networks' Q-values of positions `burn_in ..` of the windows.
    """
    b, length, n = cfg.burn_in, cfg.sequence_length, cfg.n_step
    k = jnp.arange(length)  # learning positions, relative to burn_in
    reward, term = items["reward"][:, b:], items["terminated"][:, b:]
    end = term | items["truncated"][:, b:]
    batch = reward.shape[0]
    ret = jnp.zeros((batch, length))
    discount = jnp.zeros((batch, length))
    boot = jnp.broadcast_to(k + n, (batch, length))
    running = jnp.ones((batch, length), jnp.bool_)
    for i in range(1, n + 1):
        ret = ret + jnp.where(running, cfg.gamma ** (i - 1) * reward[:, k + i], 0.0)
        stop = running & end[:, k + i]
        # A termination pays nothing after it; a truncation bootstraps from its step.
        discount = jnp.where(stop, jnp.where(term[:, k + i], 0.0, cfg.gamma**i), discount)
        boot = jnp.where(stop, k + i, boot)
        running = running & ~end[:, k + i]
    discount = jnp.where(running, cfg.gamma**n, discount)
    rows = jnp.arange(batch)[:, None]
    next_action = jnp.argmax(q_online[rows, boot], axis=-1)  # double Q
    next_value = unrescale(
        jnp.take_along_axis(q_target[rows, boot], next_action[..., None], -1)[..., 0],
        cfg.rescale_eps,
    )
    target = rescale(ret + discount * next_value, cfg.rescale_eps)
    m = mask[:, b:]
    valid = m[:, k] & ~end[:, k] & jnp.take_along_axis(m, boot, axis=1)
    return jax.lax.stop_gradient(target), valid


# --- Jitted pieces --------------------------------------------------------------------------------


def make_functions(cfg: Config):
    optimiser = make_optimiser(cfg)
    eps = jnp.asarray(epsilons(cfg))

    # Acting: one call per recv(). The envs' recurrent states are donated and updated in place.
    # With `stored_state`, also the states the observations were fed with (`h`, `c` stacked),
    # for the add to store; else None.
    @functools.partial(jax.jit, donate_argnums=1)
    def act(net: QNet, actors: Actors, obs, first, env_ids) -> tuple[Array, Actors, Array | None]:
        first = first | (not cfg.memory)
        rows = jax.tree.map(lambda s: jnp.where(first[:, None], 0.0, s[env_ids]), actors.state)
        before = jnp.stack(rows, axis=1) if cfg.stored_state else None
        q, rows = jax.vmap(net.step)(obs, rows)
        state = jax.tree.map(lambda s, r: s.at[env_ids].set(r), actors.state, rows)
        key, k_explore, k_random = jax.random.split(actors.key, 3)
        explore = jax.random.uniform(k_explore, env_ids.shape) < eps[env_ids]
        random = jax.random.randint(k_random, env_ids.shape, 0, NUM_ACTIONS, jnp.int32)
        action = jnp.where(explore, random, jnp.argmax(q, axis=-1).astype(jnp.int32))
        return action, Actors(state, key), before

    # The buffer call of the actor loop: `add` under plain `jax.jit`, the buffer donated.
    @functools.partial(jax.jit, donate_argnums=0)
    def add(buf: dx.PrioritisedTrajectoryBuffer, steps, env_ids):
        return buf.add(steps, env_ids=env_ids)

    @jax.jit
    def greedy(net: QNet, state, obs, first):
        first = first | (not cfg.memory)
        state = jax.tree.map(lambda s: jnp.where(first[:, None], 0.0, s), state)
        q, state = jax.vmap(net.step)(obs, state)
        return jnp.argmax(q, axis=-1).astype(jnp.int32), state

    def unroll(net: QNet, items) -> Float[Array, "batch time actions"]:
        """Q-values of a batch of windows: the burn-in only warms up the state (no gradient),
        from zeros."""
        b = cfg.burn_in
        obs, first = items["obs"], items["first"] | (not cfg.memory)
        state = zero_state(cfg, obs.shape[0])
        run = jax.vmap(net.unroll)
        _, state = run(obs[:, :b], first[:, :b], state)
        q, _ = run(obs[:, b:], first[:, b:], jax.lax.stop_gradient(state))
        return q  # positions burn_in .. W - 1

    def unroll_stored(net: QNet, items) -> tuple[Array, Float[Array, "batch window 2 hidden"]]:
        """`unroll` from the state stored with each window's first step (R2D2's stored-state
        strategy), and the state before each of the window's steps along the way (no
        gradient), for the write-back."""
        b = cfg.burn_in
        obs, first = items["obs"], items["first"] | (not cfg.memory)
        stored = items["state"][:, 0]  # (batch, 2, hidden): h and c
        state = (stored[:, 0], stored[:, 1])
        run = jax.vmap(net.unroll_states)
        _, warm, state = run(obs[:, :b], first[:, :b], state)
        q, rest, _ = run(obs[:, b:], first[:, b:], jax.lax.stop_gradient(state))
        return q, jax.lax.stop_gradient(jnp.concatenate([warm, rest], axis=1))

    def loss_fn(net, target_net, items, mask, weights):
        b, length = cfg.burn_in, cfg.sequence_length
        if cfg.stored_state:
            q, states = unroll_stored(net, items)
            q_target, _ = unroll_stored(target_net, items)
        else:
            q, states = unroll(net, items), None
            q_target = unroll(target_net, items)
        target, valid = n_step_targets(cfg, items, mask, jax.lax.stop_gradient(q), q_target)
        action = items["action"][:, b : b + length]
        taken = jnp.take_along_axis(q[:, :length], action[..., None], -1)[..., 0]
        td = jnp.where(valid, taken - target, 0.0)
        per_seq = jnp.sum(0.5 * td**2, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1)
        return jnp.mean(weights * per_seq), (td, valid, states)

    def learn(learner: Learner, buf: dx.PrioritisedTrajectoryBuffer, pending: Pending):
        # The priorities of the previous step's sample, from the windows it named: any that
        # left the replay since (overwritten by the adds in between) are dropped.
        dropped = jnp.sum(buf.stale(pending.env, pending.start), dtype=jnp.int32)
        buf = buf.set_priorities(pending.env, pending.start, pending.priority)
        metrics = {"dropped": dropped}
        if pending.states is not None:
            # The states the previous step computed, written into the steps its windows read
            # (before this step samples, so that it reads them). An entry whose step the adds
            # in between overwrote is dropped: the stamps say which.
            s = pending.states
            buf, report = buf.write_back(s.env, s.start, {"state": s.state}, mask=s.write)
            metrics["write_back_attempted"] = jnp.sum(s.write, dtype=jnp.int32)
            metrics["write_back_dropped"] = report.num_dropped
        key, k_replay, k_online = jax.random.split(learner.key, 3)
        replay = buf.sample(k_replay, cfg.replay_batch, beta=cfg.importance_exponent)
        items, mask, weights = replay.sample.items, replay.sample.mask, replay.weights
        # Windows of the online queue (each start weighted by its real steps, the default
        # `distribution_power=1`), with importance weight 1.
        fresh = buf.trajectories.sample(
            k_online, cfg.online_batch, online_window(cfg), source="online"
        )
        items = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), items, fresh.items)
        mask = jnp.concatenate([mask, fresh.mask])
        weights = jnp.concatenate([weights, jnp.ones(cfg.online_batch)])
        (loss, (td, valid, states)), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            learner.net, learner.target, items, mask, weights
        )
        updates, opt_state = optimiser.update(grads, learner.opt_state)
        net = eqx.apply_updates(learner.net, updates)
        target = jax.tree.map(lambda t, o: t + cfg.target_tau * (o - t), learner.target, net)
        r = cfg.replay_batch
        priority = dx.sequence_priorities(jnp.abs(td[:r]), valid[:r], eta=cfg.eta)
        written = None
        if states is not None:
            # The states after the burn-in (positions burn_in ..), each computed by the online
            # network from the window's stored state: what the windows starting at those steps
            # will start from. Masked (padded) steps write nothing.
            after_burn_in = jnp.arange(mask.shape[1]) >= cfg.burn_in
            written = States(
                jnp.concatenate([replay.sample.env, fresh.env]),
                jnp.concatenate([replay.sample.start, fresh.start]),
                states,
                mask & after_burn_in,
            )
        pending = Pending(replay.sample.env, replay.sample.start, priority, written)
        metrics["loss"] = loss
        return Learner(net, target, opt_state, key), buf, pending, metrics

    # The learner step donates the buffer too: set_priorities writes the sum tree in place,
    # write_back the stored states.
    learn_jit = jax.jit(learn, donate_argnums=(0, 1, 2))
    return act, add, greedy, learn_jit


@functools.partial(jax.jit, static_argnums=1)
def first_stamps(buf: dx.PrioritisedTrajectoryBuffer, batch_size: int):
    return buf.sample(jax.random.key(0), batch_size).sample.stamp


def first_pending(cfg: Config, buf: dx.PrioritisedTrajectoryBuffer) -> Pending:
    """What the first learner step sets: priority 1, what every window holds until its first
    update, on the windows of a sample (a no-op); with `stored_state`, no state to write (the
    shapes of the states a learner step computes, on stamps of that sample, nothing marked to
    write)."""
    env, start = first_stamps(buf, cfg.replay_batch)
    states = None
    if cfg.stored_state:
        rows = cfg.replay_batch + cfg.online_batch
        window = cfg.burn_in + cfg.sequence_length + cfg.n_step
        states = States(
            jnp.resize(env, (rows,)),
            jnp.resize(start, (rows,)),
            jnp.zeros((rows, window, 2, cfg.hidden_size)),
            jnp.zeros((rows, window), jnp.bool_),
        )
    return Pending(env, start, jnp.ones(cfg.replay_batch), states)


def init(cfg: Config, seed: int):
    k_net, k_learn, k_act = jax.random.split(jax.random.key(seed), 3)
    net = QNet(len(OBSERVED), cfg.hidden_size, k_net)
    learner = Learner(
        net=net,
        # A copy, not the same arrays: one buffer cannot be donated twice.
        target=jax.tree.map(jnp.copy, net),
        opt_state=make_optimiser(cfg).init(net),
        key=k_learn,
    )
    actors = Actors(zero_state(cfg, cfg.num_envs), k_act)
    return learner, actors


def evaluate(cfg: Config, greedy, net: QNet, seed: int) -> np.ndarray:
    """The return of one greedy episode in each of `eval_episodes` envs, stepped together."""
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=cfg.eval_episodes, seed=seed)
    obs, _ = env.reset()
    state = zero_state(cfg, cfg.eval_episodes)
    first = np.ones(cfg.eval_episodes, bool)
    total = np.zeros(cfg.eval_episodes)
    alive = np.ones(cfg.eval_episodes, bool)
    while alive.any():
        action, state = greedy(net, state, obs[:, OBSERVED], first)
        obs, reward, terminated, truncated, _ = env.step(np.asarray(action))
        total += np.where(alive, reward, 0.0)
        alive &= ~(terminated | truncated)
        first = np.zeros_like(first)
    env.close()
    return total


# --- Driver ---------------------------------------------------------------------------------------


def save_curve(path: str, history: list[dict[str, float]], cfg: Config, seed: int, outcome: str):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, x, label in zip(
        axes, ("env_steps", "seconds"), ("environment steps", "wall time (s, from process start)")
    ):
        xs = [h[x] for h in history]
        ax.fill_between(
            xs, [h["eval_min"] for h in history], [h["eval_max"] for h in history], alpha=0.2
        )
        ax.plot(
            xs,
            [h["eval_mean"] for h in history],
            ".-",
            label=f"greedy, {cfg.eval_episodes} episodes (mean, min-max)",
        )
        ax.axhline(
            cfg.target_return, color="grey", linestyle="--", label=f"target: {cfg.target_return:g}"
        )
        ax.set(xlabel=label, ylim=(0, 510))
    axes[0].set_ylabel("episode return")
    axes[0].legend(loc="upper left", fontsize=8)
    strategy = "stored state" if cfg.stored_state else "zero state"
    fig.suptitle(
        f"R2D2-style LSTM agent{'' if cfg.memory else ' (memoryless ablation)'} ({strategy}), "
        "envpool async "
        f"CartPole-v1 without velocities, seed {seed}\n"
        f"{outcome}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="wall-clock budget from process start, compilation included (default 600)",
    )
    parser.add_argument("--max-steps", type=int, default=Config.max_steps)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument(
        "--smoke", action="store_true", help="a few seconds end to end, no learning threshold"
    )
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="measure the actor loop (env steps/s with and without the buffer calls) and exit",
    )
    parser.add_argument(
        "--memoryless",
        action="store_true",
        help="ablation: restart the recurrent state at every step (no memory)",
    )
    parser.add_argument(
        "--stored-state",
        action="store_true",
        help="R2D2's stored-state strategy: the burn-in starts from the state stored with the "
        "window's first step (the learner writes fresh ones back), not from zeros",
    )
    parser.add_argument("--plot", default="r2d2_envpool.png", help="learning-curve PNG path")
    return parser.parse_args(argv)


def to_steps(
    obs, reward, terminated, truncated, info, action, state: Array | None = None
) -> dict[str, np.ndarray | Array]:
    steps: dict[str, np.ndarray | Array] = {
        "obs": obs[:, OBSERVED],
        "action": action,
        "reward": reward,
        "terminated": terminated,
        "truncated": truncated,
        "first": info["elapsed_step"] == 0,
    }
    if state is not None:
        steps["state"] = state  # the actor's state before this observation, on the device
    return steps


def fraction_down(part: int, whole: int) -> str:
    """`part / whole` in scientific notation, 4 significant digits, truncated (never rounded
    up), so that a small fraction is not shown as 0 nor made larger than it is."""
    if part == 0 or whole == 0:
        return "0"
    with decimal.localcontext() as context:
        context.rounding = decimal.ROUND_DOWN
        return format(decimal.Decimal(part) / decimal.Decimal(whole), ".3e")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        target_return=args.target_return,
        max_steps=args.max_steps,
        memory=not args.memoryless,
        stored_state=args.stored_state,
    )
    if args.smoke:
        cfg = dataclasses.replace(
            cfg,
            max_length=64,
            warmup_steps=512,
            eval_every=512,
            max_steps=1_536,
            eval_episodes=4,
            online_cycle=48,
        )
    if args.throughput:
        return throughput(cfg, args.seed, *((50, 1) if args.smoke else ()))
    act, add, greedy, learn = make_functions(cfg)
    learner, actors = init(cfg, args.seed)
    buf = make_buffer(cfg)
    env = envpool.make(
        "CartPole-v1",
        env_type="gymnasium",
        num_envs=cfg.num_envs,
        batch_size=cfg.batch_size,
        seed=args.seed,
    )

    history: list[dict[str, float]] = []
    eval_seed = 10_000 * (args.seed + 1)

    def record(steps: int) -> dict[str, float]:
        nonlocal eval_seed
        # envpool seeds env i with seed + i: successive evaluations move past all of them, so
        # that no two evaluations share an episode.
        eval_seed += cfg.eval_episodes
        returns = evaluate(cfg, greedy, learner.net, eval_seed)
        history.append(
            {
                "env_steps": steps,
                "seconds": time.perf_counter() - _START,
                "eval_mean": float(returns.mean()),
                "eval_min": float(returns.min()),
                "eval_max": float(returns.max()),
            }
        )
        return history[-1]

    bar = tqdm(
        total=cfg.max_steps,
        unit="step",
        unit_scale=True,
        desc=f"R2D2 seed {args.seed}",
        bar_format="{desc}: {n_fmt} env steps [{elapsed}, {rate_fmt}{postfix}]",
    )
    pending = None
    since_reset = 0  # recvs since the online queue was emptied
    learner_steps = dropped = wb_attempted = wb_dropped = 0
    losses: list[Array] = []
    dropped_since: list[Array] = []
    wb_since: list[tuple[Array, Array]] = []  # write-back entries (attempted, dropped)
    steps = 0
    last = record(0)
    outcome = ""
    env.async_reset()
    while True:
        obs, reward, terminated, truncated, info = env.recv()
        env_ids = info["env_id"]
        action, actors, before = act(
            learner.net, actors, obs[:, OBSERVED], info["elapsed_step"] == 0, env_ids
        )
        action = np.asarray(action)
        env.send(action, env_ids)
        buf = add(buf, to_steps(obs, reward, terminated, truncated, info, action, before), env_ids)
        steps += len(env_ids)
        since_reset += 1
        if pending is None and steps >= cfg.warmup_steps and int(buf.num_windows) > 0:
            # The first learner step has no earlier priorities to set: it sets priority 1, what
            # every window holds until its first update, on the windows of a sample (a no-op).
            pending = first_pending(cfg, buf)
        online_ready = since_reset * cfg.batch_size >= (cfg.burn_in + 1) * cfg.num_envs
        if pending is not None and online_ready and since_reset % cfg.learn_every == 0:
            learner, buf, pending, metrics = learn(learner, buf, pending)
            learner_steps += 1
            # Kept on the device and summed at the next evaluation: no sync per step.
            dropped_since.append(metrics["dropped"])
            losses.append(metrics["loss"])
            if cfg.stored_state:
                wb_since.append((metrics["write_back_attempted"], metrics["write_back_dropped"]))
        if since_reset >= cfg.online_cycle:
            buf = eqx.tree_at(lambda b: b.trajectories, buf, buf.trajectories.reset_online_queue())
            since_reset = 0
        bar.update(len(env_ids))
        out_of_time = time.perf_counter() - _START > args.max_seconds
        if steps - last["env_steps"] >= cfg.eval_every or out_of_time or steps >= cfg.max_steps:
            last = record(steps)
            loss = float(jnp.mean(jnp.stack(losses))) if losses else math.nan
            losses.clear()
            dropped += int(sum(int(d) for d in dropped_since))
            dropped_since.clear()
            wb_attempted += sum(int(a) for a, _ in wb_since)
            wb_dropped += sum(int(d) for _, d in wb_since)
            wb_since.clear()
            bar.set_postfix(eval=f"{last['eval_mean']:.1f}", loss=f"{loss:.4f}")
            if not args.smoke and last["eval_mean"] >= cfg.target_return:
                confirm = record(steps)
                if confirm["eval_mean"] >= cfg.target_return:
                    outcome = (
                        f"solved: greedy return {last['eval_mean']:.1f}, then "
                        f"{confirm['eval_mean']:.1f} on fresh episodes"
                    )
                    break
            if out_of_time:
                outcome = f"out of time after {args.max_seconds:g} s"
                break
            if steps >= cfg.max_steps:
                outcome = f"step cap reached: {steps:,} env steps"
                break
    bar.close()
    env.close()
    wall = time.perf_counter() - _START
    final = history[-1]
    save_curve(args.plot, history, cfg, args.seed, f"{outcome}, {wall:.0f} s")
    print(
        f"{outcome}; {learner_steps} learner steps, {dropped} stale priority updates dropped "
        "(windows overwritten between sample and update)"
    )
    stored = ""
    if cfg.stored_state:
        fraction = fraction_down(wb_dropped, wb_attempted)
        stored = (
            f"; stored state: {wb_dropped} of {wb_attempted} write-back entries dropped as "
            f"stale ({fraction})"
        )
        print(
            f"stored state: {wb_attempted} write-back entries attempted, {wb_dropped} dropped "
            f"(their step overwritten between sample and write-back), fraction {fraction}"
        )
    print(f"learning curve: {os.path.abspath(args.plot)}")
    print(
        f"seed {args.seed}: greedy return {final['eval_mean']:.1f} over {cfg.eval_episodes} "
        f"episodes after {final['env_steps']} env steps, {wall:.0f} s{stored}"
    )
    solved = outcome.startswith("solved")
    return 0 if solved or args.smoke else 1


def throughput(cfg: Config, seed: int, recvs: int = 2_000, rounds: int = 5) -> int:
    """Env steps per second of the actor loop (recv, act, send), without a buffer call, with
    `add` through plain `jax.jit` (what `main` runs), with `add` through `eqx.filter_jit`, and
    with a raw scatter into per-env rings of plain arrays (the floor: no checks, no counters
    beyond a head per env). The variants take turns, `rounds` times; medians are reported."""
    act, add, _, learn = make_functions(cfg)
    learner, actors = init(cfg, seed)
    env = envpool.make(
        "CartPole-v1",
        env_type="gymnasium",
        num_envs=cfg.num_envs,
        batch_size=cfg.batch_size,
        seed=seed,
    )
    filter_add = eqx.filter_jit(
        lambda buf, steps, env_ids: buf.add(steps, env_ids=env_ids), donate="all"
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def raw_add(rings, steps, env_ids):
        data, head = rings
        rows = head[env_ids]
        data = jax.tree.map(lambda d, x: d.at[env_ids, rows].set(x), data, steps)
        return data, head.at[env_ids].set((rows + 1) % cfg.max_length)

    def fresh(name):
        if name in ("jax.jit add", "eqx.filter_jit add"):
            return make_buffer(cfg)
        if name == "raw scatter":
            data = jax.tree.map(
                lambda s: jnp.zeros((cfg.num_envs, cfg.max_length, *s.shape), s.dtype),
                step_prototype(cfg),
            )
            return data, jnp.zeros(cfg.num_envs, jnp.int32)
        return None

    calls = {
        "no buffer call": None,
        "jax.jit add": add,
        "eqx.filter_jit add": filter_add,
        "raw scatter": raw_add,
    }

    def loop(name, store, actors, n):
        call = calls[name]
        start = time.perf_counter()
        for _ in range(n):
            obs, reward, terminated, truncated, info = env.recv()
            env_ids = info["env_id"]
            first = info["elapsed_step"] == 0
            action, actors, before = act(learner.net, actors, obs[:, OBSERVED], first, env_ids)
            action = np.asarray(action)
            env.send(action, env_ids)
            if call is not None:
                store = call(
                    store,
                    to_steps(obs, reward, terminated, truncated, info, action, before),
                    env_ids,
                )
        jax.block_until_ready((store, actors))
        return store, actors, n * cfg.batch_size / (time.perf_counter() - start)

    env.async_reset()
    stores = {name: fresh(name) for name in calls}
    for name in calls:  # compile, and warm up envpool's threads
        stores[name], actors, _ = loop(name, stores[name], actors, 200)
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name in calls:
            stores[name], actors, rate = loop(name, stores[name], actors, recvs)
            rates[name].append(rate)
    env.close()

    # The learner step on the buffer the loop filled (its online queue holds every step).
    buf = stores["jax.jit add"]
    assert isinstance(buf, dx.PrioritisedTrajectoryBuffer)
    pending = first_pending(cfg, buf)
    learner, buf, pending, _ = jax.block_until_ready(learn(learner, buf, pending))
    learn_seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(recvs // 10):
            learner, buf, pending, _ = learn(learner, buf, pending)
        jax.block_until_ready((learner, buf, pending))
        learn_seconds.append((time.perf_counter() - start) / (recvs // 10))

    base = float(np.median(rates["no buffer call"]))
    floor = float(np.median(rates["raw scatter"]))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"actor loop: {cfg.num_envs} envs, {cfg.batch_size} per recv(), {rounds} rounds of "
        f"{recvs} recvs per variant, median [min, max]; load average {load}"
    )
    print(
        f"{'variant':<22}{'env steps/s':>24}{'buffer µs/recv':>16}{'share of loop':>15}"
        f"{'vs raw':>9}"
    )
    for name, r in rates.items():
        rate = float(np.median(r))
        extra = (1 / rate - 1 / base) * cfg.batch_size * 1e6  # µs per recv over no buffer
        raw_extra = (1 / floor - 1 / base) * cfg.batch_size * 1e6
        share = 1 - rate / base
        spread = f"{rate:,.0f} [{min(r):,.0f}, {max(r):,.0f}]"
        ratio = f"{extra / raw_extra:.2f}x" if name != "no buffer call" and raw_extra > 0 else ""
        print(f"{name:<22}{spread:>24}{extra:>16.1f}{share:>15.1%}{ratio:>9}")
    learn_ms = 1e3 * float(np.median(learn_seconds))
    recv_ms = 1e3 * cfg.batch_size / float(np.median(rates["jax.jit add"]))
    per_learn = cfg.learn_every * cfg.batch_size
    print(
        f"learner step ({cfg.replay_batch} prioritised + {cfg.online_batch} online windows of "
        f"{cfg.burn_in + cfg.sequence_length + cfg.n_step} steps, set_priorities): "
        f"{learn_ms:.2f} ms, median [{1e3 * min(learn_seconds):.2f}, "
        f"{1e3 * max(learn_seconds):.2f}]; with one per {cfg.learn_every} recvs "
        f"({per_learn} env steps), the training loop runs at most "
        f"{per_learn / (learn_ms + cfg.learn_every * recv_ms) * 1e3:,.0f} env steps/s, "
        f"{learn_ms / (learn_ms + cfg.learn_every * recv_ms):.0%} of it in the learner"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
