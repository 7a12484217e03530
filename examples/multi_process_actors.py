"""Actor threads and a replicated learner in every process of a `jax.distributed` program, held
to one global samples-per-insert law by a `dx.ReplayService` in each process.

`sebulba_cartpole.py`'s layout (actor threads and a learner thread around a service), spread
over the processes of `multi_process_dqn.py`'s program: every device of every process is one
shard of mesh axis "replay", and each process runs its own service over the one global buffer.

- **Replay: one `dx.GlobalReplay`** of `UniformReplay` shards of 50,000 / devices transitions,
    inside a `dx.RateLimited` with Reverb's samples-per-insert law (16 sampled rows per
    inserted transition, the balance within 1,024 rows of the target once 1,000 transitions
    are in), served in each process by a `dx.ReplayService`.
- **Actors: each process its own.** `--actors-per-process` threads (default 1), each stepping
    8 gymnax CartPole-v1 environments with the newest parameters its process's learner has
    published (epsilon-greedy; the policy and the environment step are one jitted call on this
    process's device). gymnax resets an ended episode inside the step and reports the final
    observation, so every row is a real transition and no insert needs a mask. Each step's 8
    transitions become a global batch whose only rows are this process's (`GlobalReplay.rows`)
    and go to `service.add_batch`: they are written into this process's shards, with no
    collective. An actor is held to its process's *share* of the law: it may insert while the
    balance would stay within the window if every process had inserted as much since the counts
    were last exchanged, so the processes' inserts together keep the global bound.
- **Learner: replicated.** One thread per process, all running the same loop: `service.sample`
    draws 128 transitions from the whole buffer (a collective: every process gets the same
    batch), then a Double DQN update with a Polyak target (optax Adam), the same in every
    process on the same parameters, so the parameters stay bit-identical (checked at the end)
    without a gradient being sent. When the law does not allow a sample, the learners exchange
    their processes' insert counts (one all-reduce) and all reach the same verdict: they wait
    together for the actors of every process. After each update a learner hands its process's
    actors a copy of the parameters on its own device.
- **Stopping.** Every 200 updates process 0 evaluates the greedy policy (32 episodes) and
    decides whether to stop (the return reached 400, its clock ran out, or the step cap);
    `multihost_utils.broadcast_one_to_all` gives its verdict to every learner at the same
    update, so that none is left waiting in a collective. Each process then closes its service,
    which wakes its actors, and the processes exchange the counts once more (`snapshot`).

Only the learner threads make collectives (samples, count exchanges, the stopping verdict), in
the same order in every process; the actors' inserts and the learner's update touch only the
process's own devices.

At the end it prints the mean greedy return, the samples per insert achieved against the
target, and the window the law allows at those counts (the balance `inserts * spi - samples`
within `[min_diff, max_diff]`), which it asserts.

Run (on one machine it starts the processes itself, each with its own CPU devices, and stops
them all if one fails):

    python examples/multi_process_actors.py [--processes 2] [--devices-per-process 1]
        [--actors-per-process 1] [--seed 0] [--max-seconds 600] [--smoke]

On several hosts, run one process per host, each given the coordinator's address (process 0's
host and a free port), the number of processes and its own id:

    python examples/multi_process_actors.py --processes N --process-id I --coordinator HOST:PORT

Exits with status 1, and says why, if the agent does not learn within its budget, the achieved
ratio leaves the law's window, the parameters diverge or a process fails. Results:
docs/actors-learners.md.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import multi_process_dqn  # beside this file: the process plumbing, shared with that example
import numpy as np
import optax
from jax.experimental import multihost_utils
from jaxtyping import Array, Float, PRNGKeyArray, PyTree
from multi_process_dqn import params_identical, replicated


AXIS = "replay"  # the mesh's one axis: the replay's shards


@dataclasses.dataclass(frozen=True)
class Config:
    """`sebulba_cartpole.py`'s agent. `replay_size`, `min_size_to_sample` and `max_steps` are
    global (over all processes), `envs_per_actor` per actor thread."""

    actors_per_process: int = 1
    envs_per_actor: int = 8
    replay_size: int = 50_000
    batch_size: int = 128
    # Rows sampled per inserted transition, over all processes: with batches of 128, one
    # learner update per 8 transitions inserted anywhere.
    samples_per_insert: float = 16.0
    # How far (in sampled rows) the balance may stray from the target.
    error_buffer: float = 1_024.0
    min_size_to_sample: int = 1_000
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01  # Polyak step of the target network after every update
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_steps: int = 20_000  # global environment steps over which epsilon decays
    hidden_size: int = 128
    eval_every: int = 200  # learner updates between evaluations (and stopping verdicts)
    eval_episodes: int = 32
    target_return: float = 400.0
    max_steps: int = 400_000  # cap on global environment steps
    wait_timeout: float = 300.0  # seconds a blocked call may wait before the run is stuck


# --- The agent ------------------------------------------------------------------------------------


def transition_prototype() -> dict[str, jax.ShapeDtypeStruct]:
    f32 = jnp.float32
    return {
        "obs": jax.ShapeDtypeStruct((4,), f32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), f32),
        "next_obs": jax.ShapeDtypeStruct((4,), f32),  # before gymnax's automatic reset
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),  # not set by the 500-step limit
    }


class Learner(eqx.Module):
    net: eqx.nn.MLP
    target: eqx.nn.MLP
    opt_state: optax.OptState


def make_optimiser(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate))


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

    # Replicated in, replicated out: every device computes the whole update, with no
    # collective. Not donated: the actors may still hold the parameters published last.
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


def on_this_device(tree: PyTree) -> PyTree:
    """This process's copy of a replicated `tree`: each array's first local shard, an array on
    one device of this process, which the actors' jitted calls take without any collective."""
    return jax.tree.map(
        lambda x: x.addressable_shards[0].data if isinstance(x, jax.Array) else x, tree
    )


# --- Actors ---------------------------------------------------------------------------------------


class Actors(eqx.Module):
    """One actor thread's environments, on this process's device."""

    env_state: PyTree
    obs: Float[Array, "n 4"]
    key: PRNGKeyArray


def make_actor_functions(cfg: Config, env: Any, env_params: Any):
    vmap_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    n = cfg.envs_per_actor

    @eqx.filter_jit
    def reset(key: PRNGKeyArray) -> Actors:
        k_reset, k_steps = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_reset, n), env_params
        )
        return Actors(env_state, obs, k_steps)

    @eqx.filter_jit
    def step(net: eqx.nn.MLP, actors: Actors, epsilon: Float[Array, ""]):
        """One epsilon-greedy step of every environment: the new state, the transitions, and
        per environment whether its episode ended and its training return so far."""
        key, k_explore, k_random, k_env = jax.random.split(actors.key, 4)
        greedy = jnp.argmax(jax.vmap(net)(actors.obs), axis=-1).astype(jnp.int32)
        explore = jax.random.uniform(k_explore, (n,)) < epsilon
        random = jax.random.randint(k_random, (n,), 0, env.num_actions, jnp.int32)
        action = jnp.where(explore, random, greedy)
        obs, env_state, reward, terminated, truncated, info = vmap_step(
            jax.random.split(k_env, n), actors.env_state, action, env_params
        )
        transitions = {
            "obs": actors.obs,
            "action": action,
            "reward": reward.astype(jnp.float32),
            "next_obs": info["final_observation"],
            "terminated": terminated,
        }
        return Actors(env_state, obs, key), transitions

    @eqx.filter_jit
    def evaluate(net: eqx.nn.MLP, key: PRNGKeyArray) -> Float[Array, " episodes"]:
        """The undiscounted return of `eval_episodes` greedy episodes, stepped together."""
        count = cfg.eval_episodes
        k_reset, k_steps = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(k_reset, count), env_params
        )

        def running(carry):
            t, _, _, _, alive = carry
            return (t < env_params.max_steps_in_episode) & jnp.any(alive)

        def body(carry):
            t, obs, env_state, total, alive = carry
            action = jnp.argmax(jax.vmap(net)(obs), axis=-1).astype(jnp.int32)
            obs, env_state, reward, terminated, truncated, _ = vmap_step(
                jax.random.split(jax.random.fold_in(k_steps, t), count),
                env_state,
                action,
                env_params,
            )
            # An episode that ended is reset by the environment; its later rewards do not count.
            total = total + jnp.where(alive, reward, 0.0)
            return t + 1, obs, env_state, total, alive & ~(terminated | truncated)

        carry = (jnp.asarray(0), obs, env_state, jnp.zeros(count), jnp.ones(count, jnp.bool_))
        return jax.lax.while_loop(running, body, carry)[3]

    return reset, step, evaluate


class Policy:
    """The newest parameters (on this process's device) and the update count that made them:
    the learner swaps the tuple, an actor reads whichever is current (atomic in CPython)."""

    def __init__(self, net: eqx.nn.MLP):
        self.current: tuple[eqx.nn.MLP, int] = (net, 0)


@dataclasses.dataclass
class Shared:
    """What the threads of one process share besides the service and the policy."""

    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    env_steps: list[int] = dataclasses.field(default_factory=list)  # one entry per actor


def actor(
    cfg: Config,
    index: int,
    key: PRNGKeyArray,
    service: dx.ReplayService,
    membership: Any,
    replay: dx.GlobalReplay,
    policy: Policy,
    shared: Shared,
    functions: tuple,
) -> None:
    reset, step, _ = functions
    processes = jax.process_count()
    try:
        with membership:  # counted in before any actor started: see `ReplayService`
            actors = reset(key)
            while not shared.stop.is_set():
                net, _ = policy.current
                # This process's steps stand for every process's (each does as many: the law
                # holds each to its share).
                fraction = min(processes * sum(shared.env_steps) / cfg.epsilon_steps, 1.0)
                epsilon = cfg.epsilon_start + fraction * (cfg.epsilon_end - cfg.epsilon_start)
                actors, transitions = step(net, actors, jnp.float32(epsilon))
                # The global batch of this process's rows: written into its own shards.
                batch = replay.rows(jax.device_get(transitions))
                service.add_batch(batch, timeout=cfg.wait_timeout)
                shared.env_steps[index] += cfg.envs_per_actor
    except (dx.ServiceClosed, dx.WaitCannotEnd):
        pass  # the run is over: the learner has left, or the main thread closed the service
    except BaseException as e:  # reported by the main thread
        shared.errors.append(e)


# --- The learner ----------------------------------------------------------------------------------

# The learner's verdicts, broadcast from process 0 (0: go on).
GO_ON, SOLVED, OUT_OF_TIME, AT_CAP = range(4)


@dataclasses.dataclass
class Outcome:
    learner: Learner | None = None
    updates: int = 0
    verdict: int = GO_ON
    eval_mean: float = float("nan")


def learner_loop(
    cfg: Config,
    args: argparse.Namespace,
    service: dx.ReplayService,
    policy: Policy,
    learner: Learner,
    update: Callable,
    evaluate: Callable,
    shared: Shared,
    outcome: Outcome,
) -> None:
    first = jax.process_index() == 0
    learn_key = jax.random.fold_in(jax.random.key(args.seed), 1)  # the same in every process
    eval_key = jax.random.fold_in(jax.random.key(args.seed), 2)
    updates = 0
    try:
        with service.learner():
            while outcome.verdict == GO_ON:
                # A collective: every process's learner samples the same batch, in step.
                batch = service.sample(
                    jax.random.fold_in(learn_key, updates), cfg.batch_size, timeout=cfg.wait_timeout
                )
                learner = update(learner, batch)
                updates += 1
                policy.current = (on_this_device(learner.net), updates)
                if updates % cfg.eval_every:
                    continue
                # Process 0 evaluates and decides; every learner takes its verdict at this
                # same update (a collective, after the same number of samples everywhere).
                verdict, mean = GO_ON, 0.0
                if first:
                    returns = np.asarray(
                        evaluate(policy.current[0], jax.random.fold_in(eval_key, updates))
                    )
                    mean = float(returns.mean())
                    steps, samples = service.counts()  # inserts: one per transition
                    seconds = time.perf_counter() - _START
                    print(
                        f"{seconds:6.1f} s  {steps:8,d} transitions  {updates:6,d} updates  "
                        f"greedy return {mean:5.1f}  samples/insert "
                        f"{samples / max(steps, 1):5.2f}",
                        flush=True,
                    )
                    if not args.smoke and mean >= cfg.target_return:
                        verdict = SOLVED
                    elif seconds > args.max_seconds:
                        verdict = OUT_OF_TIME
                    elif steps >= cfg.max_steps:
                        verdict = AT_CAP
                told = multihost_utils.broadcast_one_to_all(np.asarray([verdict, mean], np.float32))
                outcome.verdict, outcome.eval_mean = int(told[0]), float(told[1])
    except dx.ServiceClosed:
        pass
    except BaseException as e:
        shared.errors.append(e)
    outcome.learner, outcome.updates = learner, updates


# --- One process ----------------------------------------------------------------------------------


def run_process(args: argparse.Namespace) -> int:
    # These must come before JAX starts its CPU backend. The device count concerns the CPU
    # platform only: a GPU or TPU host uses its own devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.devices_per_process}"
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(
            args.coordinator, num_processes=args.processes, process_id=args.process_id
        )
    # Imported only now: gymnax starts JAX's backend when imported, which must come after
    # `jax.distributed.initialize`.
    import gymnax

    first = jax.process_index() == 0

    def say(message: str) -> None:
        if first:
            print(message, flush=True)

    cfg = Config(actors_per_process=args.actors_per_process)
    if args.smoke:
        cfg = dataclasses.replace(
            cfg,
            replay_size=4_096,
            min_size_to_sample=256,
            eval_every=16,
            eval_episodes=8,
            max_steps=768,
        )
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    shard_size = dx.GlobalReplay.shard_size(mesh, cfg.replay_size)  # refuses a remainder
    replay = dx.GlobalReplay(mesh, lambda: dx.UniformReplay(transition_prototype(), shard_size))
    if cfg.envs_per_actor % replay.num_local_shards:
        raise ValueError(
            f"each of this process's {replay.num_local_shards} shards takes an equal block of "
            f"an actor's {cfg.envs_per_actor} transitions"
        )
    spi = Fraction(repr(cfg.samples_per_insert))  # exact, as the limiter reads a float
    limiter = dx.RateLimiter.sample_to_insert_ratio(
        cfg.samples_per_insert,
        cfg.min_size_to_sample,
        cfg.error_buffer,
        # A process's insert is judged as if every process inserted as much: the law's batch
        # is one actor step of every process.
        insert_batch_size=cfg.envs_per_actor * jax.process_count(),
        sample_batch_size=cfg.batch_size,
    )
    service = dx.ReplayService(dx.RateLimited(replay, limiter))
    rate = service.rate
    say(
        f"{jax.process_count()} processes x {len(jax.local_devices())} devices: one "
        f"GlobalReplay of {replay.num_shards} UniformReplay shards of {shard_size:,} transitions; "
        f"{cfg.actors_per_process} actor threads x {cfg.envs_per_actor} envs and 1 learner "
        f"thread per process; law: {spi} samples per insert, min_size_to_sample "
        f"{cfg.min_size_to_sample:,}, balance within [{rate.min_diff}, {rate.max_diff}] rows"
    )

    env, env_params = gymnax.make("CartPole-v1")
    functions = make_actor_functions(cfg, env, env_params)
    optimiser = make_optimiser(cfg)

    def init_learner() -> Learner:
        net = eqx.nn.MLP(4, env.num_actions, cfg.hidden_size, 2, key=jax.random.key(args.seed))
        # A copy, not the same arrays: the target is updated apart.
        target = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, net)
        return Learner(net, target, optimiser.init(eqx.filter(net, eqx.is_array)))

    learner = replicated(mesh, init_learner)
    policy = Policy(on_this_device(learner.net))
    shared = Shared(env_steps=[0] * cfg.actors_per_process)
    outcome = Outcome()
    # Each actor's environments draw from a key of its own over all processes.
    actor_keys = jax.random.split(
        jax.random.fold_in(jax.random.key(args.seed), 3),
        jax.process_count() * cfg.actors_per_process,
    )[jax.process_index() * cfg.actors_per_process :]
    actors = [
        threading.Thread(
            target=actor,
            args=(
                cfg,
                i,
                actor_keys[i],
                service,
                service.actor(),
                replay,
                policy,
                shared,
                functions,
            ),
            name=f"actor-{i}",
            daemon=True,
        )
        for i in range(cfg.actors_per_process)
    ]
    learner_thread = threading.Thread(
        target=learner_loop,
        args=(
            cfg,
            args,
            service,
            policy,
            learner,
            make_update(cfg, optimiser),
            functions[2],
            shared,
            outcome,
        ),
        name="learner",
        daemon=True,
    )
    for thread in [*actors, learner_thread]:
        thread.start()
    while learner_thread.is_alive() and not shared.errors:
        learner_thread.join(0.5)
    if shared.errors:
        # The other processes may be waiting for this one in a collective: exit at once (the
        # launcher stops them).
        traceback.print_exception(shared.errors[0])
        print(f"FAILED: process {jax.process_index()}: {shared.errors[0]!r}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    shared.stop.set()
    service.close()  # wakes the actors if they wait for the law
    for thread in actors:
        thread.join(timeout=cfg.wait_timeout)
    if any(thread.is_alive() for thread in actors):
        print("FAILED: an actor thread did not stop", file=sys.stderr)
        os._exit(1)

    # Every process's counts, exchanged once more: the same in every process.
    inserts, samples = service.snapshot().counts()
    transitions = int(multihost_utils.process_allgather(np.int64(sum(shared.env_steps))).sum())
    identical = params_identical(outcome.learner.net)
    wall = time.perf_counter() - _START
    stopped = {
        SOLVED: f"solved: mean greedy return {outcome.eval_mean:.1f} >= {cfg.target_return:g}",
        OUT_OF_TIME: f"out of time: the {args.max_seconds:g} s budget ran out",
        AT_CAP: f"step cap reached: {cfg.max_steps:,} transitions",
    }[outcome.verdict]
    say(f"{stopped} after {outcome.updates:,} learner updates; stopping")
    held_out = ""
    if outcome.verdict == SOLVED and first:
        # The stopping rule picked the evaluation that cleared the bar; fresh episodes give an
        # estimate without that selection bias.
        keys = jax.random.split(jax.random.fold_in(jax.random.key(args.seed), 4), 4)
        fresh = np.concatenate([functions[2](policy.current[0], k) for k in keys])
        held_out = f", {fresh.mean():.1f} on {fresh.size} fresh ones"

    # The law, on the transitions stored: the balance `inserts * spi - samples` within
    # [min_diff, max_diff] once min_size_to_sample transitions are in.
    balance = rate.balance(inserts, samples)
    within = (
        transitions >= cfg.min_size_to_sample and rate.scaled_min <= balance <= rate.scaled_max  # type: ignore[operator]
    )
    low = float(spi - rate.max_diff / transitions)  # type: ignore[operator]
    high = float(spi - rate.min_diff / transitions)  # type: ignore[operator]
    say(
        f"seed {args.seed}, {jax.process_count()} processes: mean greedy return "
        f"{outcome.eval_mean:.1f} over {cfg.eval_episodes} episodes{held_out} after "
        f"{transitions:,} environment steps and {outcome.updates:,} learner updates\n"
        f"samples per insert: {samples:,} rows sampled / {transitions:,} transitions inserted "
        f"= {samples / transitions:.3f} (target {float(spi):g}, window [{low:.3f}, {high:.3f}] "
        f"at these inserts): within the window: {within}\n"
        f"the services counted {inserts:,} inserts for {transitions:,} transitions\n"
        f"wall time {wall:.1f} s (process 0, from its start, compilation included)\n"
        f"q-network bit-identical on all {replay.num_shards} devices: {identical}"
    )
    if args.processes > 1:
        jax.distributed.shutdown()
    failures = []
    if not identical:
        failures.append("the processes' parameters diverged")
    if not within:
        failures.append("the achieved samples per insert left the law's window")
    if inserts != transitions:
        failures.append(f"the services counted {inserts:,} inserts for {transitions:,} transitions")
    if not args.smoke and outcome.verdict != SOLVED:
        failures.append(f"the mean greedy return did not reach {cfg.target_return:g} ({stopped})")
    if failures:
        if first:
            print(f"FAILED: {'; '.join(failures)}.", file=sys.stderr)
        return 1
    if args.smoke:
        say("smoke run: no learning threshold")
    return 0


# --- The launcher ---------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> int:
    """`multi_process_dqn.launch` of this script, with its actor threads' argument."""
    extra = ["--actors-per-process", str(args.actors_per_process)]
    return multi_process_dqn.launch(args, __file__, extra, margin=90.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = multi_process_dqn.process_arguments(
        __doc__.split("\n\n")[0],
        600.0,
        "wall-clock budget of each process from its start, compilation included",
    )
    parser.add_argument("--actors-per-process", type=int, default=Config.actors_per_process)
    return multi_process_dqn.parsed(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(args) if args.process_id is None else run_process(args)


if __name__ == "__main__":
    sys.exit(main())
