"""Offline to online: DQN on CartPole-v1 with a Minari dataset mixed into its batches.

1. A behaviour DQN is trained online (gymnax CartPole-v1) until its greedy return first reaches
   150, and acts epsilon-greedily (epsilon 0.1) in gymnasium's CartPole-v1 under
   `minari.DataCollector` for 20,000 steps: the offline dataset, a partly trained policy's.
2. `dx.load_minari` loads it into a `dx.TrajectoryBuffer` of 16 streams (episode k in stream
   k % 16), Minari's int64 actions and float64 rewards cast to 32 bits.
3. For every seed, DQN learns twice from the same network, envs and keys: *mixed*, each batch
   of 128 drawn by a `dx.Mixture` of the offline buffer and the online one, the offline
   fraction annealed linearly from 0.5 to 0 over the first 2,048 updates (a traced value in
   the jitted step; the mixture takes exactly floor(f * 128 + 0.5) rows from the offline
   buffer), and *online only*, the same compiled step with the fraction 0 throughout.

Both buffers hold steps in Minari's layout, that of gymnasium's next-step auto-reset:
`(observation, action, reward, terminated, truncated, valid)`, and after the step that ends an
episode a *reset step* holding its final observation, `valid` False. gymnax resets in the same
step (the observation it returns is already the next episode's), so the online envs emulate
the next-step layout: an env whose episode just ended stores its reset step (the final
observation, `info["final_observation"]`) in the next iteration instead of stepping. The
n-step transitions of `dx.NStep(3, ...)` then never bootstrap across an episode boundary: after
a termination with factor 0, after a truncation (the 500-step limit) from the final
observation, not from the next episode's first; a transition that starts on a reset step
gets loss weight 0 through `first["valid"]`.

The learner: Double DQN, an MLP of two hidden layers of 128 with LayerNorm, 3-step returns,
gamma 0.99, Adam 1e-3 (gradient norm clipped at 10), a Polyak target (0.01 per update), 8
gymnax envs with one update per iteration (8 env steps), epsilon 1 -> 0.05 over 20,000 env
steps after 1,024 random ones, 4,096 updates (about 33,000 env steps). (In trial runs with
one-step returns, or without LayerNorm, the mixed runs did not all reach 475 within this
budget.) Everything on the hot
path runs under `jax.lax.scan` in one `eqx.filter_jit(donate="all")` call per 32 iterations:
acting, `online.add`, the mixture's draw, the update and the target's step; the buffers and
networks are donated. After each call the greedy policy is evaluated on 32 episodes. Env
steps count online interactions only (the offline dataset's are not counted).

Run: python examples/offline_to_online.py [--seeds 0 1 2] [--smoke] [--out DIR]
(needs the `examples` and `offline` extras: pip install -e '.[examples,offline]')

Prints a table per seed (the env steps at which the mean greedy return first reached 475,
the final return, the mean over the last quarter of the evaluations), writes
`offline_to_online.png` (the greedy return against env steps, per seed and averaged) to
`--out` (default: the repository's docs/), and exits with status 1 if a mixed run never
reached 475. `--smoke` runs tiny sizes end to end and asserts nothing about learning.

Measured (seeds 0 1 2, a shared 2-core CPU, JAX 0.10.2): the behaviour DQN had a greedy return
of 239 after 2,949 env steps; its dataset holds 106 episodes, 20,098 steps, of return 190 on
average (median 162, 30 to 500).

    seed | first >= 475, final, last-quarter mean
         | mixed                    | online only
       0 | 14,259   500.0   456.1   | 11,717   500.0   396.2
       1 | 10,467   500.0   500.0   |  1,481   484.7   306.9
       2 | 13,765   481.3   433.6   | 11,470   500.0   308.0

Every run reached 475 at least once; online only got there first on every seed (seed 1's
at 1,481 env steps is an early spike it lost at once). DQN's greedy return on CartPole swings
widely from one evaluation to the next, and the first evaluation above 475 mostly measures
those swings. What the mixture changed is the second half: over the last quarter (the last 32
evaluations, from about 25,500 env steps) the mixed runs averaged 463 (456, 500, 434), the
online-only ones 337 (396, 307, 308); from 22,000 env steps on (the offline fraction reached 0
at about 17,000), 64%, 89% and 71% of the mixed runs' evaluations were at 475 or above, 29%,
20% and 4% of the online-only ones'. Three seeds, one dataset. Wall time 108 s for the whole
run, dataset and compilation included (144 s while other jobs shared the machine); about 10 s
per training run after the first compilation.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import dejax_eqx as dx
import equinox as eqx
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree


@dataclasses.dataclass(frozen=True)
class Config:
    num_envs: int = 8  # online envs stepped together; one update per iteration
    online_length: int = 6_144  # steps kept per online env (49,152 in all: never overwritten)
    batch_size: int = 128
    hidden: int = 128  # two hidden layers, each with LayerNorm
    n_step: int = 3  # rewards summed by a transition (fewer at an episode's end)
    learning_rate: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.01  # Polyak step of the target network after every update
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_steps: int = 20_000  # env steps over which epsilon decays linearly, after the prefill
    prefill_iterations: int = 128  # random-policy iterations before learning (1,024 env steps)
    chunk_iterations: int = 32  # iterations per jitted call (256 env steps), then an evaluation
    updates: int = 4_096  # updates (iterations) per run, 128 chunks: about 33,000 env steps
    offline_start: float = 0.5  # the offline fraction of the first batch ...
    anneal_updates: int = 2_048  # ... annealed linearly to 0 over this many updates
    eval_episodes: int = 32
    target_return: float = 475.0
    # The offline dataset: a behaviour DQN trained online until its greedy return first reaches
    # `behaviour_return`, then acting epsilon-greedily in gymnasium for `dataset_steps` steps.
    behaviour_seed: int = 1_000
    behaviour_return: float = 150.0
    behaviour_max_chunks: int = 64
    behaviour_epsilon: float = 0.1
    dataset_steps: int = 20_000
    offline_envs: int = 16  # streams of the offline buffer (episode k in stream k % 16)


# --- Steps, networks, state -----------------------------------------------------------------------

# One step of one env, in Minari's layout (`dx.minari_spec` of the dataset, narrowed to 32 bits).
STEP = {
    "observation": jax.ShapeDtypeStruct((4,), jnp.float32),
    "action": jax.ShapeDtypeStruct((), jnp.int32),
    "reward": jax.ShapeDtypeStruct((), jnp.float32),
    "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
    "truncated": jax.ShapeDtypeStruct((), jnp.bool_),
    "valid": jax.ShapeDtypeStruct((), jnp.bool_),  # False on a reset step
}


class QNetwork(eqx.Module):
    """Observation -> one value per action: two hidden layers, each with LayerNorm."""

    layers: tuple[eqx.nn.Linear, ...]
    norms: tuple[eqx.nn.LayerNorm, ...]

    def __init__(self, hidden: int, actions: int, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(4, hidden, key=k1),
            eqx.nn.Linear(hidden, hidden, key=k2),
            eqx.nn.Linear(hidden, actions, key=k3),
        )
        self.norms = (eqx.nn.LayerNorm(hidden), eqx.nn.LayerNorm(hidden))

    def __call__(self, obs: Float[Array, " 4"]) -> Float[Array, " actions"]:
        x = obs
        for i, layer in enumerate(self.layers[:-1]):
            x = jax.nn.relu(self.norms[i](layer(x)))
        return self.layers[-1](x)


class Actors(eqx.Module):
    """The online envs between iterations, emulating next-step auto-reset over gymnax."""

    env_state: PyTree
    obs: Float[Array, "num_envs 4"]  # what the policy sees next (a new episode's first, if ended)
    final: Float[Array, "num_envs 4"]  # the final observation of the episode that just ended
    ended: Array  # bool (num_envs,): the env's last step ended an episode; its reset step is due


class State(eqx.Module):
    """Everything a chunk reads and writes; donated to each chunk as a whole."""

    buffers: dict[str, dx.TrajectoryBuffer]
    q: QNetwork
    target: QNetwork
    opt: PyTree
    actors: Actors
    key: PRNGKeyArray
    env_steps: Int[Array, ""]
    updates: Int[Array, ""]
    offline_start: Float[Array, ""]  # the offline fraction at update 0 (0: online only)
    offline_rows: Int[Array, ""]  # rows drawn from the offline buffer so far (valid or not)


def make_optimiser(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate))


def copy_arrays(tree: Any) -> Any:
    """New arrays for every array leaf: what a donated call consumes is not the original."""
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)


@eqx.filter_jit  # one compilation instead of dozens of small eager ones
def init_state(cfg: Config, env: Any, env_params: Any, key: PRNGKeyArray) -> State:
    """A fresh learner with an empty online buffer (and no offline one), online only."""
    k_net, k_env, key = jax.random.split(key, 3)
    q = QNetwork(cfg.hidden, env.num_actions, k_net)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_env, cfg.num_envs), env_params
    )
    return State(
        buffers={"online": dx.TrajectoryBuffer(STEP, cfg.num_envs, cfg.online_length)},
        q=q,
        target=copy_arrays(q),  # a copy, not the same arrays: one buffer cannot be donated twice
        opt=make_optimiser(cfg).init(eqx.filter(q, eqx.is_array)),
        actors=Actors(env_state, obs, jnp.zeros_like(obs), jnp.zeros(cfg.num_envs, bool)),
        key=key,
        env_steps=jnp.asarray(0, jnp.int32),
        updates=jnp.asarray(0, jnp.int32),
        offline_start=jnp.asarray(0.0, jnp.float32),
        offline_rows=jnp.asarray(0, jnp.int32),
    )


@eqx.filter_jit
def with_offline(
    state: State, offline: dx.TrajectoryBuffer, offline_start: Float[Array, ""]
) -> State:
    """`state` with a copy of the offline buffer (each run donates its own) and the offline
    fraction of the first batch."""
    return dataclasses.replace(
        state,
        buffers={**state.buffers, "offline": copy_arrays(offline)},
        offline_start=jnp.asarray(offline_start, jnp.float32),
    )


_M = TypeVar("_M", bound=eqx.Module)


def filter_scan(body: Callable[[_M], _M], state: _M, length: int) -> _M:
    """`jax.lax.scan` over a module that may also hold non-arrays (the carry is its arrays)."""
    dynamic, static = eqx.partition(state, eqx.is_array)

    def array_body(dynamic, _):
        return eqx.filter(body(eqx.combine(dynamic, static)), eqx.is_array), None

    dynamic, _ = jax.lax.scan(array_body, dynamic, length=length)
    return eqx.combine(dynamic, static)


def make_functions(cfg: Config, env: Any, env_params: Any):
    """The jitted prefill, training chunk and evaluation. A state with an offline buffer draws
    its batches from the mixture (the offline fraction in the state); one without, online only
    (a second compilation)."""
    optimiser = make_optimiser(cfg)
    vmap_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    what = dx.NStep(cfg.n_step, reward="reward", terminated="terminated", truncated="truncated")
    mixture = dx.Mixture(
        {
            # The offline part never gives more than half the batch: it draws 64 rows, not 128.
            "offline": dx.Part("offline", what, discount=cfg.gamma, max_fraction=cfg.offline_start),
            "online": dx.Part("online", what, discount=cfg.gamma),
        }
    )

    def act_and_store(state: State, epsilon: Float[Array, ""]) -> State:
        """One iteration of every env. An env whose last step ended an episode stores its reset
        step (the final observation, `valid` False) and is not stepped; the others act
        epsilon-greedily, step and store `(obs, action, reward, terminated, truncated)`."""
        a = state.actors
        key, k_explore, k_random, k_env = jax.random.split(state.key, 4)
        greedy = jnp.argmax(jax.vmap(state.q)(a.obs), axis=-1).astype(jnp.int32)
        explore = jax.random.uniform(k_explore, (cfg.num_envs,)) < epsilon
        random = jax.random.randint(k_random, (cfg.num_envs,), 0, env.num_actions, jnp.int32)
        action = jnp.where(explore, random, greedy)
        obs, env_state, reward, terminated, truncated, info = vmap_step(
            jax.random.split(k_env, cfg.num_envs), a.env_state, action, env_params
        )
        reset = a.ended
        step = {
            "observation": jnp.where(reset[:, None], a.final, a.obs),
            "action": jnp.where(reset, 0, action),
            "reward": jnp.where(reset, 0.0, reward.astype(jnp.float32)),
            "terminated": ~reset & terminated,
            "truncated": ~reset & truncated,
            "valid": ~reset,
        }
        online = state.buffers["online"].add(step)
        ended = ~reset & (terminated | truncated)

        def keep(new, old):  # an env that stored its reset step keeps its state
            return jnp.where(reset.reshape(reset.shape + (1,) * (new.ndim - 1)), old, new)

        actors = Actors(
            env_state=jax.tree.map(keep, env_state, a.env_state),
            obs=keep(obs, a.obs),
            final=jnp.where(ended[:, None], info["final_observation"], a.final),
            ended=ended,
        )
        return dataclasses.replace(
            state,
            buffers={**state.buffers, "online": online},
            actors=actors,
            key=key,
            env_steps=state.env_steps + jnp.sum(~reset, dtype=jnp.int32),
        )

    def loss_fn(q, target, t: dx.Transitions, weights):
        values = jax.vmap(q)(t.first["observation"])
        taken = jnp.take_along_axis(values, t.first["action"][:, None], axis=-1)[:, 0]
        # Double DQN: the online network picks the next action, the target network values it.
        following = t.next["observation"]
        best = jnp.argmax(jax.vmap(q)(following), axis=-1)
        value = jnp.take_along_axis(jax.vmap(target)(following), best[:, None], axis=-1)[:, 0]
        bootstrap = jax.lax.stop_gradient(t.returns + t.discount * value)
        return jnp.sum(weights * optax.huber_loss(taken - bootstrap)) / jnp.maximum(
            jnp.sum(weights), 1.0
        )

    def fraction(state: State) -> Float[Array, ""]:
        left = 1.0 - state.updates.astype(jnp.float32) / cfg.anneal_updates
        return state.offline_start * jnp.clip(left, 0.0, 1.0)

    def learn(state: State, key: PRNGKeyArray) -> State:
        buffers = state.buffers
        if "offline" in buffers:  # the dict's keys are static
            f = fraction(state)
            buffers, batch = mixture.sample(
                key, cfg.batch_size, buffers, {"offline": f, "online": 1.0 - f}
            )
            t, weights = batch.sample, batch.weights
            offline_rows = batch.counts[0]  # exactly floor(f * B + 0.5)
        else:
            t = buffers["online"].sample(key, cfg.batch_size, what, discount=cfg.gamma)
            weights, offline_rows = jnp.ones(cfg.batch_size), jnp.asarray(0, jnp.int32)
        # A transition from a reset step (its action and reward mean nothing) weighs nothing.
        weights = weights * t.first["valid"].astype(jnp.float32)
        grads = eqx.filter_grad(loss_fn)(state.q, state.target, t, weights)
        updates, opt = optimiser.update(grads, state.opt, eqx.filter(state.q, eqx.is_array))
        q = eqx.apply_updates(state.q, updates)
        target = jax.tree.map(
            lambda t_, o: t_ + cfg.tau * (o - t_) if eqx.is_array(t_) else t_, state.target, q
        )
        return dataclasses.replace(
            state,
            buffers=buffers,
            q=q,
            target=target,
            opt=opt,
            updates=state.updates + 1,
            offline_rows=state.offline_rows + offline_rows,
        )

    @eqx.filter_jit(donate="all")
    def prefill(state: State) -> State:
        return filter_scan(
            lambda s: act_and_store(s, jnp.asarray(1.0)), state, cfg.prefill_iterations
        )

    @eqx.filter_jit(donate="all")
    def train_chunk(state: State) -> State:
        def body(state: State) -> State:
            done = jnp.clip((state.env_steps - cfg.prefill_iterations * cfg.num_envs), 0, None)
            frac = jnp.minimum(done / cfg.epsilon_steps, 1.0)
            eps = cfg.epsilon_start + frac * (cfg.epsilon_end - cfg.epsilon_start)
            state = act_and_store(state, eps)
            key, k_learn = jax.random.split(state.key)
            return learn(dataclasses.replace(state, key=key), k_learn)

        return filter_scan(body, state, cfg.chunk_iterations)

    @eqx.filter_jit
    def evaluate(q: QNetwork, key: PRNGKeyArray) -> Float[Array, " episodes"]:
        """The return of one greedy episode in each of `eval_episodes` envs, side by side,
        until the last one ends."""
        k_reset, k_steps = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_reset, cfg.eval_episodes), env_params
        )

        def running(carry):
            t, *_, alive = carry
            return (t < env_params.max_steps_in_episode) & jnp.any(alive)

        def body(carry):
            t, obs, env_state, total, alive = carry
            action = jnp.argmax(jax.vmap(q)(obs), axis=-1).astype(jnp.int32)
            obs, env_state, reward, terminated, truncated, _ = vmap_step(
                jax.random.split(jax.random.fold_in(k_steps, t), cfg.eval_episodes),
                env_state,
                action,
                env_params,
            )
            total = total + jnp.where(alive, reward, 0.0)
            return t + 1, obs, env_state, total, alive & ~(terminated | truncated)

        alive = jnp.ones(cfg.eval_episodes, bool)
        carry = (jnp.asarray(0), obs, env_state, jnp.zeros(cfg.eval_episodes), alive)
        return jax.lax.while_loop(running, body, carry)[3]

    return prefill, train_chunk, evaluate


# --- The offline dataset --------------------------------------------------------------------------


def behaviour_policy(
    cfg: Config, functions: Any, env: Any, env_params: Any
) -> tuple[QNetwork, float, int]:
    """A DQN trained online (gymnax) until its greedy return first reaches
    `behaviour_return`: the network, that return, and the env steps it took."""
    prefill, train_chunk, evaluate = functions
    key, k_eval = jax.random.split(jax.random.key(cfg.behaviour_seed))
    state = prefill(init_state(cfg, env, env_params, key))
    value = 0.0
    for _ in range(cfg.behaviour_max_chunks):
        state = train_chunk(state)
        k_eval, k = jax.random.split(k_eval)
        value = float(jnp.mean(evaluate(state.q, k)))
        if value >= cfg.behaviour_return:
            break
    return state.q, value, int(state.env_steps)


def collect(cfg: Config, q: QNetwork) -> tuple[Any, list[int]]:
    """A Minari dataset (in Minari's root, `MINARI_DATASETS_PATH`) of whole episodes of
    gymnasium's CartPole-v1, at least `dataset_steps` steps, under the behaviour network acting
    epsilon-greedily; and each episode's return."""
    import gymnasium as gym
    import minari

    act = jax.jit(lambda obs: jnp.argmax(q(obs)))
    rng = np.random.default_rng(cfg.behaviour_seed)
    returns: list[int] = []
    # Minari 0.5.4's collector leaves its temporary directories to the garbage collector, which
    # warns; collected here, quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        env = minari.DataCollector(gym.make("CartPole-v1"))
        env.action_space.seed(cfg.behaviour_seed)
        while sum(returns) < cfg.dataset_steps:
            obs, _ = env.reset(seed=cfg.behaviour_seed + len(returns))
            steps, done = 0, False
            while not done:
                explore = rng.uniform() < cfg.behaviour_epsilon
                action = int(env.action_space.sample()) if explore else int(act(obs))
                obs, _, terminated, truncated, _ = env.step(action)
                steps, done = steps + 1, terminated or truncated
            returns.append(steps)  # a reward of 1 a step
        dataset = env.create_dataset(
            "cartpole/dqn-partly-trained-v0",
            eval_env="CartPole-v1",
            author="dejax_eqx",
            author_email="dejax_eqx@example.org",
            algorithm_name=f"DQN, greedy return {cfg.behaviour_return:g}, epsilon "
            f"{cfg.behaviour_epsilon:g}",
            code_permalink="https://example.org/examples/offline_to_online.py",
            description="CartPole-v1 episodes of a partly trained DQN",
        )
        env.close()
        del env
        gc.collect()
    return dataset, returns


def offline_buffer(cfg: Config, dataset: Any) -> dx.TrajectoryBuffer:
    """The dataset in a `TrajectoryBuffer` of `offline_envs` streams, just long enough."""
    narrow = {np.dtype("int64"): np.int32, np.dtype("float64"): np.float32}
    spec = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, narrow.get(s.dtype, s.dtype)),
        dx.minari_spec(dataset),
    )
    assert spec == STEP, f"the dataset's steps {spec} are not {STEP}"
    # Episode k goes to stream k % offline_envs, with its reset step: T + 1 steps.
    lengths = np.zeros(cfg.offline_envs, np.int64)
    for k, meta in enumerate(dataset.storage.get_episode_metadata(dataset.episode_indices)):
        lengths[k % cfg.offline_envs] += int(meta["total_steps"]) + 1
    like = dx.TrajectoryBuffer(STEP, cfg.offline_envs, int(lengths.max()))
    return dx.load_minari(dataset, like, cast=True, progress=False)


# --- Driver ---------------------------------------------------------------------------------------


class Run(NamedTuple):
    steps: list[int]  # env steps at each evaluation
    returns: list[float]  # mean greedy return there
    offline_rows: int
    seconds: float

    def first(self, target: float) -> int | None:
        """The env steps at the first evaluation of a mean greedy return >= `target`."""
        return next((s for s, r in zip(self.steps, self.returns) if r >= target), None)

    def late(self) -> float:
        """The mean greedy return over the last quarter of the evaluations."""
        return float(np.mean(self.returns[-max(len(self.returns) // 4, 1) :]))


def train(
    cfg: Config,
    functions: Any,
    env: Any,
    env_params: Any,
    seed: int,
    offline: dx.TrajectoryBuffer,
    offline_start: float,
) -> Run:
    prefill, train_chunk, evaluate = functions
    began = time.perf_counter()
    key, k_eval = jax.random.split(jax.random.key(seed))
    state = prefill(init_state(cfg, env, env_params, key))
    state = with_offline(state, offline, jnp.float32(offline_start))
    steps, returns = [], []
    for _ in range(cfg.updates // cfg.chunk_iterations):
        state = train_chunk(state)
        k_eval, k = jax.random.split(k_eval)
        returns.append(float(jnp.mean(evaluate(state.q, k))))
        steps.append(int(state.env_steps))
    return Run(steps, returns, int(state.offline_rows), time.perf_counter() - began)


def figure(cfg: Config, runs: dict[str, list[Run]], seeds: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(seeds) + (len(seeds) > 1)
    columns = min(panels, 2)
    rows = -(-panels // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3 * rows), sharex=True, sharey=True, squeeze=False
    )
    colours = {"mixed": "C0", "online only": "C3"}
    labels = {
        "mixed": f"offline fraction {cfg.offline_start:g} -> 0 over {cfg.anneal_updates:,} updates",
        "online only": "online only",
    }
    # The anneal ends at the evaluation after update `anneal_updates` (env steps vary a little).
    anneal_end = cfg.anneal_updates // cfg.chunk_iterations - 1
    for p, ax in enumerate(axes.flat):
        if p >= panels:
            ax.axis("off")
            continue
        title = f"seed {seeds[p]}" if p < len(seeds) else f"mean over the {len(seeds)} seeds"
        for mode, mode_runs in runs.items():
            if p < len(seeds):
                x, y = mode_runs[p].steps, mode_runs[p].returns
            else:  # the mean over seeds, evaluation by evaluation
                x = np.mean([r.steps for r in mode_runs], axis=0)
                y = np.mean([r.returns for r in mode_runs], axis=0)
            ax.plot(x, y, color=colours[mode], lw=1.0, label=labels[mode])
        mixed_steps = runs["mixed"][min(p, len(seeds) - 1)].steps
        if 0 <= anneal_end < len(mixed_steps):
            ax.axvspan(0, mixed_steps[anneal_end], color="C0", alpha=0.07, lw=0)
        ax.axhline(cfg.target_return, color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 510)
    for ax in axes[-1]:
        ax.set_xlabel("env steps")
    for ax in axes[:, 0]:
        ax.set_ylabel(f"greedy return ({cfg.eval_episodes} ep.)")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        "DQN on CartPole-v1 with a partly trained policy's Minari dataset mixed in "
        "(shaded: the anneal)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; nothing about learning")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    parser.add_argument("--out", default=docs, help="the folder offline_to_online.png goes to")
    args = parser.parse_args(argv)
    cfg = Config()
    if args.smoke:
        cfg = dataclasses.replace(
            cfg,
            prefill_iterations=8,
            chunk_iterations=8,
            updates=16,
            anneal_updates=8,
            batch_size=32,
            eval_episodes=4,
            behaviour_max_chunks=1,
            dataset_steps=200,
            offline_envs=4,
        )
    env, env_params = gymnax.make("CartPole-v1")
    functions = make_functions(cfg, env, env_params)

    began = time.perf_counter()
    q, value, behaviour_steps = behaviour_policy(cfg, functions, env, env_params)
    with tempfile.TemporaryDirectory() as root:
        os.environ["MINARI_DATASETS_PATH"] = root  # where Minari keeps its datasets
        dataset, episode_returns = collect(cfg, q)
        offline = offline_buffer(cfg, dataset)
        del dataset
        gc.collect()
    r = np.asarray(episode_returns)
    print(
        f"behaviour DQN: greedy return {value:.1f} after {behaviour_steps:,} env steps; dataset "
        f"of {len(r)} episodes, {int(r.sum()):,} steps (epsilon {cfg.behaviour_epsilon:g}), "
        f"return {r.mean():.1f} mean, {np.median(r):.0f} median, {r.min()}-{r.max()} "
        f"({time.perf_counter() - began:.0f} s)\n"
        f"offline buffer: {cfg.offline_envs} streams of up to {offline.max_length:,} steps",
        flush=True,
    )

    runs: dict[str, list[Run]] = {"mixed": [], "online only": []}
    for seed in args.seeds:
        for mode, start in (("mixed", cfg.offline_start), ("online only", 0.0)):
            run = train(cfg, functions, env, env_params, seed, offline, start)
            runs[mode].append(run)
            first = run.first(cfg.target_return)
            print(
                f"seed {seed} {mode}: first >= {cfg.target_return:g} at "
                f"{'never' if first is None else f'{first:,} env steps'}, final "
                f"{run.returns[-1]:.1f} after {run.steps[-1]:,}, last quarter {run.late():.1f}; "
                f"{run.offline_rows:,} offline rows ({run.seconds:.0f} s)",
                flush=True,
            )

    print(
        f"\nper seed: env steps to a mean greedy return >= {cfg.target_return:g}, the final "
        "return, and the mean return over the last quarter of the evaluations"
    )
    print(f"{'seed':>4} | {'mixed':^26} | {'online only':^26}")
    for i, seed in enumerate(args.seeds):
        cells = []
        for mode in runs:
            run = runs[mode][i]
            first = run.first(cfg.target_return)
            reached = "never" if first is None else f"{first:,}"
            cells.append(f"{reached:>8} {run.returns[-1]:>8.1f} {run.late():>8.1f}")
        print(f"{seed:>4} | {cells[0]} | {cells[1]}")
    path = os.path.join(args.out, "offline_to_online.png")
    figure(cfg, runs, args.seeds, path)
    print(f"figure: {path}\nwall time {time.perf_counter() - _START:.0f} s")
    if args.smoke:
        print("smoke run: no learning threshold")
        return 0
    failed = [
        s for s, run in zip(args.seeds, runs["mixed"]) if run.first(cfg.target_return) is None
    ]
    if failed:
        print(
            f"FAILED: the mixed runs of seeds {failed} never reached a mean greedy return of "
            f"{cfg.target_return:g}.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
