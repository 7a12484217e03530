"""DQN on CartPole-v1 (gymnax) with a dejax_eqx replay inside one donated, jitted training step.

Everything on the hot path runs under `jax.lax.scan` in one `eqx.filter_jit(donate="all")` call per
chunk: acting in a batch of environments, `replay.add_batch`, `replay.sample`, a Double DQN update
and the target network's update. Between chunks (128 environment steps each) Python updates the
progress bar and evaluates the greedy policy on a batch of episodes in one jitted call (after
every chunk at first, then at growing intervals); it stops as soon as the mean greedy return
clears the bar, and says so. The step count on the bar is a cap, not a forecast: CartPole is
usually solved after a few thousand steps.

Run: python examples/dqn_cartpole.py [--seed 0] [--max-seconds 60] [--smoke]

Exits with status 1, and says why, if the agent does not learn within its budget.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import gymnax
import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")  # write the PNG without a display
import matplotlib.pyplot as plt
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class Config:
    num_envs: int = 8  # environments stepped together; each iteration adds num_envs transitions
    replay_size: int = 50_000
    batch_size: int = 128
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01  # Polyak step of the target network after every update
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_steps: int = 20_000  # environment steps over which epsilon decays linearly
    prefill_steps: int = 1_024  # random-policy environment steps before learning starts
    # Iterations per jitted chunk: 16 are 128 environment steps, the finest spacing of the
    # evaluations, which gives a few dozen points on the learning curve before CartPole is solved
    # (typically after 3,000 to 5,000 steps).
    chunk_iterations: int = 16
    # Evaluations are one chunk apart up to this many steps, then 1/32 of the step count apart (a
    # 3% longer interval each time), so that in a long run evaluation stays a few percent of the
    # work and the curve a hundred points or so.
    dense_eval_steps: int = 4_096
    hidden_size: int = 128
    eval_episodes: int = 32
    target_return: float = 475.0  # CartPole-v1 caps an episode at 500
    # Cap on environment steps; the wall-clock budget (--max-seconds) usually binds first.
    max_steps: int = 100_000


# --- The replay -----------------------------------------------------------------------------------
#
# The learner meets its replay in three places, and only here: how the replay is made, how a batch
# is drawn from it, with a loss weight per transition, and what the replay is told after the
# update. Another replay is one more entry in `REPLAYS`; `--replay` offers every entry. A
# prioritised replay would return importance weights (annealed with `progress`) and the sampled
# slots from `sample`, and set those slots' priorities from the TD errors in `feedback`.


@dataclasses.dataclass(frozen=True)
class ReplayKind:
    make: Callable[[PyTree, Config], dx.AbstractReplay]
    # (replay, key, batch_size, progress in [0, 1] of the step budget)
    #     -> (transitions, loss weights [batch], whatever `feedback` needs)
    sample: Callable[
        [Any, PRNGKeyArray, int, Float[Array, ""]], tuple[PyTree, Float[Array, " batch"], Any]
    ]
    # (replay, what `sample` returned third, |TD error| [batch]) -> replay
    feedback: Callable[[Any, Any, Float[Array, " batch"]], Any]


def _uniform_sample(replay: dx.UniformReplay, key: PRNGKeyArray, batch_size: int, progress):
    del progress
    return replay.sample(key, batch_size), jnp.ones(batch_size), None


REPLAYS = {
    "uniform": ReplayKind(
        make=lambda item, cfg: dx.UniformReplay(item, cfg.replay_size),
        sample=_uniform_sample,
        feedback=lambda replay, _, __: replay,
    ),
}


# --- Agent and training state ---------------------------------------------------------------------


class TrainState(eqx.Module):
    """Everything a chunk of training reads and writes; donated to each chunk as a whole."""

    replay: dx.AbstractReplay
    q_net: eqx.nn.MLP
    target_net: eqx.nn.MLP
    opt_state: PyTree
    env_state: PyTree
    obs: Float[Array, "num_envs 4"]
    episode_return: Float[Array, " num_envs"]  # running return of each training episode
    env_steps: Int[Array, ""]
    key: PRNGKeyArray


def transition_prototype() -> dict[str, jax.ShapeDtypeStruct]:
    f32 = jnp.float32
    return {
        "obs": jax.ShapeDtypeStruct((4,), f32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), f32),
        # The observation after the action, before any automatic reset.
        "next_obs": jax.ShapeDtypeStruct((4,), f32),
        # The pole fell or the cart left the track. Hitting the 500-step limit is a truncation,
        # not a termination: the learner bootstraps through it.
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
    }


def make_optimiser(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate))


@eqx.filter_jit  # one compilation instead of dozens of small eager ones
def init_state(
    cfg: Config, replay_kind: ReplayKind, env: Any, env_params: Any, key: PRNGKeyArray
) -> TrainState:
    k_net, k_env, key = jax.random.split(key, 3)
    q_net = eqx.nn.MLP(4, env.num_actions, cfg.hidden_size, depth=2, key=k_net)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(k_env, cfg.num_envs), env_params
    )
    return TrainState(
        replay=replay_kind.make(transition_prototype(), cfg),
        q_net=q_net,
        # A copy, not the same arrays: one buffer cannot be donated twice.
        target_net=jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, q_net),
        opt_state=make_optimiser(cfg).init(eqx.filter(q_net, eqx.is_array)),
        env_state=env_state,
        obs=obs,
        episode_return=jnp.zeros(cfg.num_envs),
        env_steps=jnp.asarray(0, jnp.int32),
        key=key,
    )


def epsilon(cfg: Config, env_steps: Int[Array, ""]) -> Float[Array, ""]:
    frac = jnp.clip(env_steps / cfg.epsilon_steps, 0.0, 1.0)
    return cfg.epsilon_start + frac * (cfg.epsilon_end - cfg.epsilon_start)


# --- Jitted pieces --------------------------------------------------------------------------------


def filter_scan(body: Callable, state: eqx.Module, length: int) -> tuple[Any, Any]:
    """`jax.lax.scan` over a module that also holds non-arrays (the MLP's activation function).

    A replay alone is a valid scan carry (its configuration is static), an `eqx.nn.MLP` is not:
    the carry is the module's arrays, and the rest is closed over.
    """
    dynamic, static = eqx.partition(state, eqx.is_array)

    def array_body(dynamic, x):
        new_state, out = body(eqx.combine(dynamic, static), x)
        return eqx.filter(new_state, eqx.is_array), out

    dynamic, out = jax.lax.scan(array_body, dynamic, length=length)
    return eqx.combine(dynamic, static), out


def make_train_functions(cfg: Config, replay_kind: ReplayKind, env: Any, env_params: Any):
    optimiser = make_optimiser(cfg)
    vmap_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def act_and_store(state: TrainState, epsilon_now: Float[Array, ""]):
        """One step of every environment with an epsilon-greedy policy; the transitions go into
        the replay. Returns the new state and the summed return of episodes that ended."""
        key, k_explore, k_random, k_env = jax.random.split(state.key, 4)
        greedy = jnp.argmax(jax.vmap(state.q_net)(state.obs), axis=-1).astype(jnp.int32)
        explore = jax.random.uniform(k_explore, (cfg.num_envs,)) < epsilon_now
        random = jax.random.randint(k_random, (cfg.num_envs,), 0, env.num_actions, jnp.int32)
        action = jnp.where(explore, random, greedy)
        obs, env_state, reward, terminated, truncated, info = vmap_step(
            jax.random.split(k_env, cfg.num_envs), state.env_state, action, env_params
        )
        reward = reward.astype(jnp.float32)
        replay = state.replay.add_batch(
            {
                "obs": state.obs,
                "action": action,
                "reward": reward,
                "next_obs": info["final_observation"],
                "terminated": terminated,
            }
        )
        episode_return = state.episode_return + reward
        done = terminated | truncated
        finished = (jnp.sum(jnp.where(done, episode_return, 0.0)), jnp.sum(done))
        state = dataclasses.replace(
            state,
            replay=replay,
            env_state=env_state,
            obs=obs,
            episode_return=jnp.where(done, 0.0, episode_return),
            env_steps=state.env_steps + cfg.num_envs,
            key=key,
        )
        return state, finished

    def loss_fn(q_net, target_net, batch, weights):
        q = jax.vmap(q_net)(batch["obs"])
        q_taken = jnp.take_along_axis(q, batch["action"][:, None], axis=-1)[:, 0]
        # Double DQN: the online network picks the next action, the target network values it.
        next_action = jnp.argmax(jax.vmap(q_net)(batch["next_obs"]), axis=-1)
        next_q = jax.vmap(target_net)(batch["next_obs"])
        next_value = jnp.take_along_axis(next_q, next_action[:, None], axis=-1)[:, 0]
        not_terminal = 1.0 - batch["terminated"].astype(jnp.float32)
        target = batch["reward"] + cfg.gamma * not_terminal * next_value
        td_error = q_taken - jax.lax.stop_gradient(target)
        loss = jnp.mean(weights * optax.huber_loss(td_error))
        return loss, td_error

    def learn(state: TrainState, key: PRNGKeyArray) -> tuple[TrainState, Float[Array, ""]]:
        progress = jnp.minimum(state.env_steps / cfg.max_steps, 1.0)
        batch, weights, aux = replay_kind.sample(state.replay, key, cfg.batch_size, progress)
        (loss, td_error), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            state.q_net, state.target_net, batch, weights
        )
        updates, opt_state = optimiser.update(grads, state.opt_state)
        q_net = eqx.apply_updates(state.q_net, updates)
        target_net = jax.tree.map(
            lambda t, o: t + cfg.target_tau * (o - t) if eqx.is_array(t) else t,
            state.target_net,
            q_net,
        )
        replay = replay_kind.feedback(state.replay, aux, jnp.abs(td_error))
        state = dataclasses.replace(
            state, replay=replay, q_net=q_net, target_net=target_net, opt_state=opt_state
        )
        return state, loss

    # The training state is donated: the replay's storage, the networks and the optimiser state
    # are updated in place instead of being copied on every call.
    @eqx.filter_jit(donate="all")
    def prefill(state: TrainState) -> TrainState:
        def body(state, _):
            state, _ = act_and_store(state, jnp.asarray(1.0))
            return state, None

        state, _ = filter_scan(body, state, -(-cfg.prefill_steps // cfg.num_envs))
        return state

    @eqx.filter_jit(donate="all")
    def train_chunk(state: TrainState) -> tuple[TrainState, dict[str, Array]]:
        def body(state, _):
            # Epsilon counts from the end of the prefill.
            state, finished = act_and_store(
                state, epsilon(cfg, state.env_steps - cfg.prefill_steps)
            )
            key, k_learn = jax.random.split(state.key)
            state, loss = learn(dataclasses.replace(state, key=key), k_learn)
            return state, (finished, loss)

        state, ((return_sum, episodes), loss) = filter_scan(body, state, cfg.chunk_iterations)
        # Sums, not means: the driver adds them up over the chunks between two evaluations.
        metrics = {
            "return_sum": jnp.sum(return_sum),
            "episodes": jnp.sum(episodes),
            "loss_sum": jnp.sum(loss),
        }
        return state, metrics

    @eqx.filter_jit
    def evaluate(q_net: eqx.nn.MLP, key: PRNGKeyArray) -> Float[Array, " episodes"]:
        """Undiscounted return of one greedy episode in each of `eval_episodes` environments.

        The episodes run side by side, and the loop stops when the last of them ends: an early,
        poor policy is evaluated in a few dozen steps instead of the episode limit of 500.
        """
        k_reset, k_steps = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_reset, cfg.eval_episodes), env_params
        )

        def running(carry):
            t, _, _, _, alive = carry
            return (t < env_params.max_steps_in_episode) & jnp.any(alive)

        def body(carry):
            t, obs, env_state, total, alive = carry
            action = jnp.argmax(jax.vmap(q_net)(obs), axis=-1).astype(jnp.int32)
            obs, env_state, reward, terminated, truncated, _ = vmap_step(
                jax.random.split(jax.random.fold_in(k_steps, t), cfg.eval_episodes),
                env_state,
                action,
                env_params,
            )
            # An episode that ended is reset by the environment; its later rewards do not count.
            total = total + jnp.where(alive, reward, 0.0)
            return t + 1, obs, env_state, total, alive & ~(terminated | truncated)

        alive = jnp.ones(cfg.eval_episodes, jnp.bool_)
        carry = (jnp.asarray(0), obs, env_state, jnp.zeros(cfg.eval_episodes), alive)
        _, _, _, total, _ = jax.lax.while_loop(running, body, carry)
        return total

    return prefill, train_chunk, evaluate


# --- Driver ---------------------------------------------------------------------------------------


def save_curve(
    path: str, history: list[dict[str, float]], cfg: Config, seed: int, outcome: str
) -> None:
    steps = [h["env_steps"] for h in history]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.fill_between(
        steps, [h["eval_min"] for h in history], [h["eval_max"] for h in history], alpha=0.2
    )
    ax.plot(
        steps,
        [h["eval_mean"] for h in history],
        ".-",
        label=f"greedy evaluation, {cfg.eval_episodes} episodes (mean, min-max)",
    )
    # Evaluations with no training episode ended since the one before have no training return
    # (NaN): left out, so that the line joins the others.
    trained = [h for h in history if math.isfinite(h["train_return"])]
    ax.plot(
        [h["env_steps"] for h in trained],
        [h["train_return"] for h in trained],
        ".-",
        label="training episodes ended since the last evaluation (epsilon-greedy, mean)",
    )
    ax.axhline(cfg.target_return, color="grey", linestyle="--", label=f"bar: {cfg.target_return:g}")
    ax.set(xlabel="environment steps", ylabel="episode return", ylim=(0, 510))
    ax.set_title(f"DQN on CartPole-v1 with dejax_eqx, seed {seed}\n{outcome}", fontsize=10)
    # Below the axes: a solved run ends top right, a struggling one can fill the top left.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay", choices=sorted(REPLAYS), default="uniform")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=60.0,
        help="wall-clock budget from process start, compilation included (default 60)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=Config.max_steps,
        help=f"budget of environment steps (default {Config.max_steps})",
    )
    parser.add_argument(
        "--target-return",
        type=float,
        default=Config.target_return,
        help="the mean greedy return that counts as learnt (default 475; an episode pays at most "
        "500)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run a few hundred steps end to end without a learning threshold (for CI)",
    )
    parser.add_argument("--plot", default="dqn_cartpole.png", help="learning-curve PNG path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(target_return=args.target_return, max_steps=args.max_steps)
    if args.smoke:
        cfg = dataclasses.replace(
            cfg,
            prefill_steps=128,
            chunk_iterations=16,
            dense_eval_steps=512,
            batch_size=32,
            eval_episodes=4,
            max_steps=512,
        )
    replay_kind = REPLAYS[args.replay]
    env, env_params = gymnax.make("CartPole-v1")
    prefill, train_chunk, evaluate = make_train_functions(cfg, replay_kind, env, env_params)

    key, eval_key = jax.random.split(jax.random.key(args.seed))
    state = prefill(init_state(cfg, replay_kind, env, env_params, key))

    history: list[dict[str, float]] = []
    # Training statistics of the chunks since the last evaluation.
    since = {"return_sum": 0.0, "episodes": 0, "loss_sum": 0.0, "iterations": 0}

    def record(state: TrainState) -> dict[str, float]:
        nonlocal eval_key
        eval_key, k = jax.random.split(eval_key)
        returns = evaluate(state.q_net, k)
        history.append(
            {
                "env_steps": int(state.env_steps),
                "eval_mean": float(jnp.mean(returns)),
                "eval_min": float(jnp.min(returns)),
                "eval_max": float(jnp.max(returns)),
                # NaN where no training episode ended since the last evaluation (a long episode
                # can outlast a chunk): the plot leaves those out.
                "train_return": since["return_sum"] / since["episodes"]
                if since["episodes"]
                else math.nan,
                "loss": since["loss_sum"] / since["iterations"]
                if since["iterations"]
                else math.nan,
            }
        )
        since.update(return_sum=0.0, episodes=0, loss_sum=0.0, iterations=0)
        return history[-1]

    # The step count is a cap, not a forecast: the run stops as soon as it is solved (typically a
    # few thousand steps) or out of time, so the bar shows no percentage and no ETA.
    stop_rule = "smoke run" if args.smoke else "stops when solved"
    bar = tqdm(
        total=cfg.max_steps,
        unit="step",
        unit_scale=True,
        desc=f"DQN seed {args.seed}",
        bar_format="{desc}: {n_fmt} env steps (cap {total_fmt}; "
        + stop_rule
        + ") [{elapsed}, {rate_fmt}{postfix}]",
    )
    # Where the learning curve starts: the untrained network, after the random-policy prefill.
    last = record(state)
    bar.update(last["env_steps"])
    bar.set_postfix(eval=f"{last['eval_mean']:.1f}")
    chunk_steps = cfg.chunk_iterations * cfg.num_envs
    solved = False
    while True:
        state, metrics = train_chunk(state)
        since["return_sum"] += float(metrics["return_sum"])
        since["episodes"] += int(metrics["episodes"])
        since["loss_sum"] += float(metrics["loss_sum"])
        since["iterations"] += cfg.chunk_iterations
        steps = int(state.env_steps)
        bar.update(steps - bar.n)
        out_of_time = time.perf_counter() - _START > args.max_seconds
        at_cap = steps >= cfg.max_steps
        interval = chunk_steps if steps <= cfg.dense_eval_steps else steps // 32
        # The last chunk is always evaluated, so the final figure is the final network's.
        if steps - last["env_steps"] >= interval or out_of_time or at_cap:
            last = record(state)
            bar.set_postfix(eval=f"{last['eval_mean']:.1f}", loss=f"{last['loss']:.3f}")
            solved = not args.smoke and last["eval_mean"] >= cfg.target_return
        if solved or out_of_time or at_cap:
            break
    bar.close()

    steps = f"{last['env_steps']:,} env steps"
    if solved:
        outcome = (
            f"solved: mean greedy return {last['eval_mean']:.1f} >= {cfg.target_return:g} over "
            f"{cfg.eval_episodes} episodes at {steps}"
        )
    elif out_of_time:
        outcome = f"out of time: the {args.max_seconds:g} s budget ran out at {steps}"
    else:
        outcome = f"step cap reached: {steps} >= {cfg.max_steps:,}"
    print(f"{outcome}; stopping")

    if solved:
        # The stopping rule picked the evaluation that cleared the bar; fresh episodes give an
        # estimate without that selection bias.
        fresh = jnp.stack([evaluate(state.q_net, k) for k in jax.random.split(eval_key, 4)])
        held_out = f", {float(jnp.mean(fresh)):.1f} on {fresh.size} fresh ones"
    else:
        held_out = ""

    wall = time.perf_counter() - _START
    cpu = time.process_time()
    save_curve(args.plot, history, cfg, args.seed, f"{outcome}, {wall:.0f} s")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"seed {args.seed}: mean greedy return {last['eval_mean']:.1f} over {cfg.eval_episodes} "
        f"episodes{held_out} after {last['env_steps']} environment steps\n"
        f"wall time {wall:.1f} s, process CPU time {cpu:.1f} s (from process start, compilation "
        f"included), load average {load}\n"
        f"learning curve ({len(history)} evaluations, {chunk_steps} env steps apart up to "
        f"{cfg.dense_eval_steps:,}, then 1/32 of the step count): {os.path.abspath(args.plot)}"
    )
    if args.smoke:
        print("smoke run: no learning threshold")
        return 0
    if solved:
        return 0
    budget = f"{args.max_seconds:g} s" if out_of_time else f"{cfg.max_steps} environment steps"
    print(
        f"FAILED: the mean greedy return did not reach {cfg.target_return:g} within {budget} "
        f"(best {max(h['eval_mean'] for h in history):.1f}).",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
