"""DQN on envpool's CartPole-v1 with actors and a learner that run apart, kept in proportion by a
rate limiter (Sebulba style: threads in one process).

- **Actors.** `num_actors` threads, each stepping its own envpool batch of `envs_per_actor`
  envs with the newest policy it has been handed (epsilon-greedy, one jitted call per step),
  and inserting the step's transitions into the replay through a `dx.ReplayService`. Every
  transition carries the version of the policy that chose its action (the learner's update
  count when the actor read the parameters).
- **Replay.** A `dx.UniformReplay` of transitions inside a `dx.RateLimited`, with Reverb's
  samples-per-insert limiter: a sampled row counts one, an inserted transition
  `samples_per_insert`, and the balance stays within `error_buffer` of the target once
  `min_size_to_sample` transitions are in. A fast actor blocks in `add_batch` until the learner
  has caught up; a fast learner blocks in `sample` until the actors have inserted enough.
- **Learner.** One thread: Double DQN with a Polyak-averaged target network (optax Adam). It
  samples with `sample(..., age=...)`: transitions whose policy is more than `max_age`
  versions older than the learner's are excluded, so the learner never trains on data from a
  policy long gone.
  After every update it publishes its parameters and the new version to the actors.
- **Evaluation.** The main thread runs greedy episodes in a separate envpool every
  `eval_every` seconds, stops everyone when the mean return reaches `--target-return` (400 by
  default), shuts the service down (which wakes every blocked thread) and joins the threads.

Writes `sebulba_cartpole.png`: the greedy return, the achieved samples per insert with the
limiter's window, and the policy age of the sampled transitions, against environment steps.

Run: python examples/sebulba_cartpole.py [--seed 0] [--max-seconds 120] [--smoke]
(Linux; `pip install -e '.[examples]'` installs envpool.) Exits with status 1, and says why, if
the agent does not reach the target within its budget. Results: docs/actors-learners.md.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import contextlib
import dataclasses
import sys
import threading

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
from jaxtyping import Array, Float, Int, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class Config:
    num_actors: int = 2  # actor threads, each with its own envpool
    envs_per_actor: int = 8  # each actor step inserts up to this many transitions
    replay_size: int = 50_000
    batch_size: int = 128
    # Rows sampled per inserted transition: with 8 envs per actor step and batches of 128, one
    # learner update per 8 inserted transitions, one per actor step (as in dqn_cartpole.py).
    samples_per_insert: float = 16.0
    # How far (in sampled rows) the balance may stray from the target: enough for an actor step
    # and a learner batch to pass each other (the limiter refuses a narrower window).
    error_buffer: float = 1_024.0
    min_size_to_sample: int = 1_000
    max_age: int = 6_000  # in learner updates: older transitions are never sampled
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01  # Polyak step of the target network after every update
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_steps: int = 20_000  # environment steps over which epsilon decays linearly
    hidden_size: int = 128
    eval_episodes: int = 16
    eval_every: float = 0.5  # seconds between evaluations
    target_return: float = 400.0
    max_steps: int = 200_000  # cap on environment steps (all actors together)
    wait_timeout: float = 60.0  # seconds a blocked call may wait before the run is declared stuck


# --- Networks and the learner step ----------------------------------------------------------------


def q_network(cfg: Config, key: PRNGKeyArray) -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 2, cfg.hidden_size, 2, key=key)


def transition_prototype() -> dict[str, jax.ShapeDtypeStruct]:
    f32 = jnp.float32
    return {
        "obs": jax.ShapeDtypeStruct((4,), f32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), f32),
        "next_obs": jax.ShapeDtypeStruct((4,), f32),
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
        # The learner's update count when the acting policy was handed out.
        "policy_version": jax.ShapeDtypeStruct((), jnp.int32),
    }


def policy_version(transition) -> Int[Array, ""]:
    """Where a transition keeps its policy's version: the one function `dx.PolicyAge` reads
    (defined once, so that the jitted sampler traces once)."""
    return transition["policy_version"]


class Learner(eqx.Module):
    net: eqx.nn.MLP
    target: eqx.nn.MLP
    opt_state: optax.OptState


@eqx.filter_jit
def act(net: eqx.nn.MLP, obs: Float[Array, "n 4"], key: PRNGKeyArray, epsilon: Array):
    greedy = jnp.argmax(jax.vmap(net)(obs), axis=-1).astype(jnp.int32)
    explore_key, action_key = jax.random.split(key)
    explore = jax.random.uniform(explore_key, greedy.shape) < epsilon
    random = jax.random.randint(action_key, greedy.shape, 0, 2, dtype=jnp.int32)
    return jnp.where(explore, random, greedy)


def make_update(cfg: Config, optimiser: optax.GradientTransformation):
    def loss_fn(net, target, batch):
        q = jax.vmap(net)(batch["obs"])
        q_taken = jnp.take_along_axis(q, batch["action"][:, None], axis=-1)[:, 0]
        # Double DQN: the online network picks the next action, the target network values it.
        next_action = jnp.argmax(jax.vmap(net)(batch["next_obs"]), axis=-1)
        next_q = jax.vmap(target)(batch["next_obs"])
        next_value = jnp.take_along_axis(next_q, next_action[:, None], axis=-1)[:, 0]
        discount = jnp.where(batch["terminated"], 0.0, cfg.gamma)
        td = q_taken - jax.lax.stop_gradient(batch["reward"] + discount * next_value)
        return jnp.mean(optax.huber_loss(td))

    # Not donated: the actors may still hold the parameters the learner published last.
    @eqx.filter_jit
    def update(learner: Learner, batch) -> Learner:
        grads = eqx.filter_grad(loss_fn)(learner.net, learner.target, batch)
        params = eqx.filter(learner.net, eqx.is_array)
        updates, opt_state = optimiser.update(grads, learner.opt_state, params)
        net = eqx.apply_updates(learner.net, updates)
        target = jax.tree.map(
            lambda t, o: t + cfg.target_tau * (o - t) if eqx.is_array(t) else t,
            learner.target,
            net,
        )
        return Learner(net, target, opt_state)

    return update


# --- Shared state between the threads -------------------------------------------------------------


class Policy:
    """The newest parameters and their version, handed from the learner to the actors.

    A reference swap: the learner replaces the tuple, actors read whichever tuple is current
    (one attribute read, atomic in CPython), so nobody waits for the parameters.
    """

    def __init__(self, net: eqx.nn.MLP):
        self.current: tuple[eqx.nn.MLP, int] = (net, 0)


@dataclasses.dataclass
class Trace:
    """What the learner records for the plot, every `every` updates."""

    every: int = 8
    env_steps: list[int] = dataclasses.field(default_factory=list)
    age_mean: list[float] = dataclasses.field(default_factory=list)
    age_max: list[int] = dataclasses.field(default_factory=list)


def actor(
    cfg: Config,
    index: int,
    seed: int,
    service: dx.ReplayService,
    membership: contextlib.AbstractContextManager,
    policy: Policy,
    env_steps: list[int],
    stop: threading.Event,
    errors: list[BaseException],
) -> None:
    n = cfg.envs_per_actor
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n, seed=seed * 100 + index)
    key = jax.random.key(seed * 100 + index)
    obs, _ = env.reset()
    # envpool resets an env on the step after its episode ended (that step's action is ignored
    # and its "transition" joins two episodes): those rows are masked out of the insert.
    ended = np.zeros(n, bool)
    try:
        with membership:  # counted in before any actor started: see `ReplayService`
            while not stop.is_set():
                net, version = policy.current
                done_so_far = sum(env_steps)
                fraction = min(done_so_far / cfg.epsilon_steps, 1.0)
                epsilon = cfg.epsilon_start + fraction * (cfg.epsilon_end - cfg.epsilon_start)
                key, step_key = jax.random.split(key)
                action = np.asarray(act(net, obs, step_key, jnp.float32(epsilon)))
                next_obs, reward, terminated, truncated, _ = env.step(action)
                items = {
                    "obs": obs,
                    "action": action.astype(np.int32),
                    "reward": reward.astype(np.float32),
                    "next_obs": next_obs,
                    "terminated": terminated,
                    "policy_version": np.full(n, version, np.int32),
                }
                service.add_batch(items, mask=~ended, timeout=cfg.wait_timeout)
                env_steps[index] += int((~ended).sum())
                ended = terminated | truncated
                obs = next_obs
    except dx.ServiceClosed:
        pass  # the run is over: the main thread closed the service to wake us
    except BaseException as e:  # reported by the main thread
        errors.append(e)
    finally:
        env.close()


def learner_loop(
    cfg: Config,
    seed: int,
    service: dx.ReplayService,
    policy: Policy,
    learner: Learner,
    update,
    trace: Trace,
    env_steps: list[int],
    stop: threading.Event,
    errors: list[BaseException],
) -> None:
    key = jax.random.key(seed + 1)
    version = 0
    max_age = jnp.int32(cfg.max_age)
    try:
        with service.learner():
            while not stop.is_set():
                key, sample_key = jax.random.split(key)
                age = dx.PolicyAge(policy_version, jnp.int32(version), max_age)
                sample = service.sample(
                    sample_key, cfg.batch_size, age=age, timeout=cfg.wait_timeout
                )
                learner = update(learner, sample.items)
                version += 1
                policy.current = (learner.net, version)
                if version % trace.every == 0:
                    ages = np.asarray(sample.ages)
                    trace.env_steps.append(sum(env_steps))
                    trace.age_mean.append(float(ages.mean()))
                    trace.age_max.append(int(ages.max()))
    except dx.ServiceClosed:
        pass
    except BaseException as e:
        errors.append(e)


# --- Evaluation and the plot ----------------------------------------------------------------------


@eqx.filter_jit
def greedy(net: eqx.nn.MLP, obs: Float[Array, "n 4"]) -> Int[Array, " n"]:
    return jnp.argmax(jax.vmap(net)(obs), axis=-1).astype(jnp.int32)


def evaluate(cfg: Config, net: eqx.nn.MLP, seed: int) -> np.ndarray:
    """The return of one greedy episode in each of `eval_episodes` envs, stepped together."""
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=cfg.eval_episodes, seed=seed)
    obs, _ = env.reset()
    total = np.zeros(cfg.eval_episodes)
    alive = np.ones(cfg.eval_episodes, bool)
    while alive.any():
        obs, reward, terminated, truncated, _ = env.step(np.asarray(greedy(net, obs)))
        total += np.where(alive, reward, 0.0)
        alive &= ~(terminated | truncated)
    env.close()
    return total


def save_plot(path: str, cfg: Config, history: list[dict], trace: Trace, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = [h["env_steps"] for h in history]
    axes[0].plot(steps, [h["eval_mean"] for h in history], ".-", label="greedy (mean)")
    axes[0].fill_between(
        steps, [h["eval_min"] for h in history], [h["eval_max"] for h in history], alpha=0.2
    )
    axes[0].axhline(cfg.target_return, color="grey", ls="--", label=f"target {cfg.target_return:g}")
    axes[0].set(xlabel="environment steps", ylabel="episode return", ylim=(0, 510))
    axes[0].legend(loc="upper left", fontsize=8)
    # The achieved ratio between consecutive records, and the band the limiter allows around the
    # target: a balance within ±error_buffer rows over the span of the run so far.
    ratio = [h["interval_ratio"] for h in history]
    axes[1].plot(steps, ratio, ".-", label="samples per insert (between evaluations)")
    axes[1].plot(
        steps, [h["cumulative_ratio"] for h in history], "-", label="cumulative (after warm-up)"
    )
    axes[1].axhline(cfg.samples_per_insert, color="grey", ls="--", label="target")
    axes[1].set(xlabel="environment steps", ylabel="sampled rows per inserted transition")
    axes[1].legend(loc="lower right", fontsize=8)
    axes[2].plot(trace.env_steps, trace.age_mean, label="mean age of a sampled batch")
    axes[2].plot(trace.env_steps, trace.age_max, alpha=0.6, label="oldest in the batch")
    axes[2].axhline(cfg.max_age, color="grey", ls="--", label=f"max_age {cfg.max_age}")
    axes[2].set(xlabel="environment steps", ylabel="policy age (learner updates)")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- Driver ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=180.0, help="wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=Config.max_steps)
    parser.add_argument("--target-return", type=float, default=Config.target_return)
    parser.add_argument("--num-actors", type=int, default=Config.num_actors)
    parser.add_argument("--samples-per-insert", type=float, default=Config.samples_per_insert)
    parser.add_argument("--max-age", type=int, default=Config.max_age)
    parser.add_argument(
        "--smoke", action="store_true", help="a few seconds of everything; no learning threshold"
    )
    parser.add_argument("--plot", default="sebulba_cartpole.png", help="figure path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        num_actors=args.num_actors,
        samples_per_insert=args.samples_per_insert,
        max_age=args.max_age,
        target_return=args.target_return,
        max_steps=args.max_steps,
    )
    if args.smoke:
        cfg = dataclasses.replace(
            cfg, replay_size=2_048, min_size_to_sample=256, max_steps=1_536, eval_every=0.5
        )
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        cfg.samples_per_insert,
        cfg.min_size_to_sample,
        cfg.error_buffer,
        insert_batch_size=cfg.envs_per_actor,
        sample_batch_size=cfg.batch_size,
    )
    replay = dx.UniformReplay(transition_prototype(), cfg.replay_size)
    service = dx.ReplayService(dx.RateLimited(replay, limiter))

    net_key, _ = jax.random.split(jax.random.key(args.seed))
    net = q_network(cfg, net_key)
    optimiser = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate))
    learner = Learner(net, net, optimiser.init(eqx.filter(net, eqx.is_array)))
    policy = Policy(net)
    update = make_update(cfg, optimiser)

    stop = threading.Event()
    errors: list[BaseException] = []
    env_steps = [0] * cfg.num_actors  # each actor writes only its own entry
    trace = Trace()
    threads = [
        threading.Thread(
            target=actor,
            args=(cfg, i, args.seed, service, service.actor(), policy, env_steps, stop, errors),
            name=f"actor-{i}",
        )
        for i in range(cfg.num_actors)
    ]
    threads.append(
        threading.Thread(
            target=learner_loop,
            args=(cfg, args.seed, service, policy, learner, update, trace, env_steps, stop, errors),
            name="learner",
        )
    )
    for t in threads:
        t.start()

    history: list[dict] = []
    last_counts, reached, outcome = (0, 0), False, ""
    warm = None  # counts when sampling first became possible
    evaluation = 0
    try:
        while True:
            stop.wait(cfg.eval_every)
            if errors:
                raise errors[0]
            steps = sum(env_steps)
            net, version = policy.current
            evaluation += 1
            returns = evaluate(cfg, net, seed=10_000 + evaluation)
            inserts, samples = service.counts()
            if warm is None and samples > 0:
                warm = (inserts, samples)
            d_inserts = inserts - last_counts[0]
            interval = (samples - last_counts[1]) / d_inserts if d_inserts else float("nan")
            cumulative = (
                (samples - warm[1]) / (inserts - warm[0])
                if warm is not None and inserts > warm[0]
                else float("nan")
            )
            last_counts = (inserts, samples)
            seconds = time.perf_counter() - _START
            history.append(
                {
                    "env_steps": steps,
                    "seconds": seconds,
                    "eval_mean": float(returns.mean()),
                    "eval_min": float(returns.min()),
                    "eval_max": float(returns.max()),
                    "interval_ratio": interval,
                    "cumulative_ratio": cumulative,
                    "updates": version,
                }
            )
            print(
                f"{seconds:6.1f} s  {steps:7,d} env steps  {version:6,d} updates  greedy return "
                f"{returns.mean():6.1f}  samples/insert {interval:5.2f} (cumulative "
                f"{cumulative:5.2f})",
                flush=True,
            )
            if not args.smoke and returns.mean() >= cfg.target_return:
                reached = True
                outcome = f"reached {returns.mean():.1f} >= {cfg.target_return:g}"
                break
            if steps >= cfg.max_steps:
                outcome = f"step cap reached: {steps:,d} env steps >= {cfg.max_steps:,d}"
                break
            if seconds >= args.max_seconds:
                outcome = f"time budget reached: {seconds:.0f} s >= {args.max_seconds:g} s"
                break
    finally:
        stop.set()
        service.close()  # wakes every actor and the learner if they are blocked
        for t in threads:
            t.join(timeout=cfg.wait_timeout)
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        print(f"FAILED: threads still running after shutdown: {alive}", file=sys.stderr)
        return 1
    if errors:
        raise errors[0]
    inserts, samples = service.counts()
    print(outcome)
    print(
        f"{inserts:,d} transitions inserted, {samples:,d} rows sampled: "
        f"{samples / max(inserts, 1):.2f} samples per insert (target {cfg.samples_per_insert:g}); "
        f"sampled policy age: mean {np.mean(trace.age_mean or [0]):.0f}, most "
        f"{max(trace.age_max or [0])} (max_age {cfg.max_age})"
    )
    title = (
        f"Sebulba-style DQN, {cfg.num_actors} actor threads x {cfg.envs_per_actor} envpool "
        f"CartPole-v1 envs, 1 learner thread, seed {args.seed}\n{outcome}"
    )
    save_plot(args.plot, cfg, history, trace, title)
    final = history[-1]
    print(
        f"seed {args.seed}: greedy return {final['eval_mean']:.1f} over {cfg.eval_episodes} "
        f"episodes after {final['env_steps']:,d} env steps and {final['updates']:,d} updates, "
        f"{final['seconds']:.0f} s"
    )
    if args.smoke:
        print("smoke run: no learning threshold")
        return 0
    if not reached:
        print(
            f"FAILED: the mean greedy return did not reach {cfg.target_return:g} ({outcome})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
