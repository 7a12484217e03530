"""DQN on CartPole-v1 with one replay spread over the processes of a `jax.distributed` program.

The agent is `dqn_cartpole.py`'s (Double DQN, its hyperparameters, its bar of 475), and so is
the loop: one donated, jitted chunk of `jax.lax.scan` steps per Python iteration, then an
evaluation of the greedy policy, until the mean greedy return clears the bar. What changes is
where things live. Every device of every process is one shard of mesh axis "replay":

- **Actors: each process its own.** The 8 environments are split over the devices; each
    process resets and steps only those beside its own shards. Each environment's keys fold in
    its global index, so the processes' actors draw different data, and a run does not depend
    on how the devices are grouped into processes (2 processes of 1 device repeat 1 process of
    2 devices). The environments' states are global arrays split over the mesh like the
    replay's shards (`GlobalReplay.rows` builds them from each process's own rows), so every
    environment steps on its own device.
- **Replay: one `dx.GlobalReplay`** of `UniformReplay` shards of 50,000 / devices transitions,
    the demo's capacity in all. Each process adds its own environments' transitions to its own
    shards: nothing crosses the network on add.
- **Learner: replicated.** `sample` draws the batch from the whole buffer (every stored
    transition of every process equally likely) and hands every device the same batch; every
    device then runs the same update on the same parameters, so they stay identical (checked
    bit for bit at the end) without a gradient being sent: for this 17,000-parameter network
    the batch (128 transitions, 5 kB) is cheaper to share than the gradients would be.

Before training it compiles the chunk and prints every collective in it, with the bytes of its
operands: what crosses the network. Per step, only `sample`'s two all-reduces: one 32-bit word
per shard (its size: a uniform shard's summary; 8 bytes for 2 shards), then the batch as 32-bit
words (11 per transition, 5,632 bytes for 128 transitions; a boolean travels as a word, so that
one collective carries every leaf): 5,640 bytes per step with 2 shards. Per chunk, the sums of
the metrics. Between chunks the processes also agree on when to stop (process 0's clock
decides: one byte, `multihost_utils.broadcast_one_to_all`). On CPUs every collective between
processes waits for both to be scheduled: on a busy 2-core machine a step of 2 processes takes
about 20 times as long as a step of 1 process with 2 devices.

Run (on one machine it starts the processes itself, each with its own CPU devices, and stops
them all if one fails):

    python examples/multi_process_dqn.py [--processes 2] [--devices-per-process 1] [--seed 0]
        [--max-seconds 300] [--smoke]

On several hosts, run one process per host, each given the coordinator's address (process 0's
host and a free port), the number of processes and its own id:

    python examples/multi_process_dqn.py --processes N --process-id I --coordinator HOST:PORT

(Under SLURM, Open MPI or on Cloud TPU, `jax.distributed.initialize()` with no arguments finds
all three itself.) Exits with status 1, and says why, if the agent does not learn within its
budget or a process fails.
"""

import time


_START = time.perf_counter()  # wall time is reported from here: imports and compilation included

import argparse
import dataclasses
import hashlib
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree


AXIS = "replay"  # the mesh's one axis: the replay's shards, and the environments beside them


@dataclasses.dataclass(frozen=True)
class Config:
    """`dqn_cartpole.py`'s; `num_envs` and `replay_size` are global, over all processes."""

    num_envs: int = 8
    replay_size: int = 50_000
    batch_size: int = 128
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_tau: float = 0.01
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_steps: int = 20_000
    prefill_steps: int = 1_024
    chunk_iterations: int = 16
    dense_eval_steps: int = 4_096
    hidden_size: int = 128
    eval_episodes: int = 32
    target_return: float = 475.0
    max_steps: int = 100_000


# --- State ----------------------------------------------------------------------------------------


class Actors(eqx.Module):
    """Every process's environments, as global arrays: the env axis split over the mesh in
    one block per device, as the replay's shards are, each process holding its own blocks."""

    env_state: PyTree
    obs: Float[Array, "num_envs 4"]
    episode_return: Float[Array, " num_envs"]  # running return of each training episode
    key: PRNGKeyArray  # one per environment


class TrainState(eqx.Module):
    """Everything a chunk reads and writes; donated to each chunk as a whole. The replay and
    the actors are split over the devices, the rest is replicated (the same in every device)."""

    replay: dx.GlobalReplay
    q_net: eqx.nn.MLP
    target_net: eqx.nn.MLP
    opt_state: PyTree
    actors: Actors
    env_steps: Int[Array, ""]  # of all processes together
    key: PRNGKeyArray  # the learner's


def transition_prototype() -> dict[str, jax.ShapeDtypeStruct]:
    f32 = jnp.float32
    return {
        "obs": jax.ShapeDtypeStruct((4,), f32),
        "action": jax.ShapeDtypeStruct((), jnp.int32),
        "reward": jax.ShapeDtypeStruct((), f32),
        "next_obs": jax.ShapeDtypeStruct((4,), f32),  # before any automatic reset
        "terminated": jax.ShapeDtypeStruct((), jnp.bool_),  # not set by the 500-step limit
    }


def make_optimiser(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(10.0), optax.adam(cfg.learning_rate))


def replicated(mesh: Mesh, make: Callable[[], Any]) -> Any:
    """`make()`, computed inside `jax.jit` and placed whole on every device of `mesh`. Every
    process computes the same (`make` is deterministic), so nothing is sent."""
    shape = eqx.filter_eval_shape(make)
    static = eqx.filter(shape, lambda x: not isinstance(x, jax.ShapeDtypeStruct))
    dynamic = jax.jit(
        lambda: eqx.filter(make(), eqx.is_array), out_shardings=NamedSharding(mesh, P())
    )()
    return eqx.combine(dynamic, static)


def init_state(cfg: Config, env: Any, env_params: Any, mesh: Mesh, seed: int) -> TrainState:
    num_shards = mesh.shape[AXIS]
    shard_size = dx.GlobalReplay.shard_size(mesh, cfg.replay_size)  # refuses a remainder
    replay = dx.GlobalReplay(mesh, lambda: dx.UniformReplay(transition_prototype(), shard_size))

    def learner():
        k_net, k_learn = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0))
        q_net = eqx.nn.MLP(4, env.num_actions, cfg.hidden_size, depth=2, key=k_net)
        # A copy, not the same arrays: one buffer cannot be donated twice.
        target_net = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, q_net)
        opt_state = make_optimiser(cfg).init(eqx.filter(q_net, eqx.is_array))
        return q_net, target_net, opt_state, k_learn

    q_net, target_net, opt_state, key = replicated(mesh, learner)

    # This process's environments, made here and nowhere else: those beside its own shards.
    # Each environment's keys fold in its global index, so that the processes' actors draw
    # differently, and a run is the same however its devices are grouped into processes.
    per_shard = cfg.num_envs // num_shards
    env_ids = np.concatenate([np.arange(per_shard) + s * per_shard for s in replay.local_shard_ids])
    actor_key = jax.random.fold_in(jax.random.key(seed), 1)
    k_reset, k_steps = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(actor_key, i)))(
        env_ids
    ).T
    obs, env_state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(k_reset, env_params)
    local = {
        "env_state": env_state,
        "obs": obs,
        "episode_return": np.zeros(env_ids.size, np.float32),
        "key": k_steps,
    }
    actors = Actors(**replay.rows(local))  # placed as the shards are
    env_steps = jax.device_put(np.int32(0), NamedSharding(mesh, P()))
    return TrainState(replay, q_net, target_net, opt_state, actors, env_steps, key)


def epsilon(cfg: Config, env_steps: Int[Array, ""]) -> Float[Array, ""]:
    frac = jnp.clip(env_steps / cfg.epsilon_steps, 0.0, 1.0)
    return cfg.epsilon_start + frac * (cfg.epsilon_end - cfg.epsilon_start)


# --- Jitted pieces --------------------------------------------------------------------------------


def filter_scan(body: Callable, state: eqx.Module, length: int) -> tuple[Any, Any]:
    """`jax.lax.scan` over a module that also holds non-arrays (the MLP's activation)."""
    dynamic, static = eqx.partition(state, eqx.is_array)

    def array_body(dynamic, x):
        new_state, out = body(eqx.combine(dynamic, static), x)
        return eqx.filter(new_state, eqx.is_array), out

    dynamic, out = jax.lax.scan(array_body, dynamic, length=length)
    return eqx.combine(dynamic, static), out


def make_train_functions(cfg: Config, env: Any, env_params: Any, mesh: Mesh):
    optimiser = make_optimiser(cfg)
    vmap_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    num_shards = mesh.shape[AXIS]

    def act_and_store(state: TrainState, epsilon_now: Float[Array, ""]):
        """One epsilon-greedy step of every environment; the transitions go into the replay.
        Everything is per environment, so each device steps its own and adds to its own shard.
        Returns the new state and, per environment, the return of an episode that ended."""
        actors = state.actors
        keys = jax.vmap(lambda k: jax.random.split(k, 4))(actors.key)
        next_key, k_explore, k_random, k_env = keys.T
        greedy = jnp.argmax(jax.vmap(state.q_net)(actors.obs), axis=-1).astype(jnp.int32)
        explore = jax.vmap(jax.random.uniform)(k_explore) < epsilon_now
        random = jax.vmap(lambda k: jax.random.randint(k, (), 0, env.num_actions, jnp.int32))(
            k_random
        )
        action = jnp.where(explore, random, greedy)
        obs, env_state, reward, terminated, truncated, info = vmap_step(
            k_env, actors.env_state, action, env_params
        )
        reward = reward.astype(jnp.float32)
        replay = state.replay.add_batch(
            {
                "obs": actors.obs,
                "action": action,
                "reward": reward,
                "next_obs": info["final_observation"],
                "terminated": terminated,
            }
        )
        episode_return = actors.episode_return + reward
        done = terminated | truncated
        actors = Actors(env_state, obs, jnp.where(done, 0.0, episode_return), next_key)
        state = dataclasses.replace(
            state, replay=replay, actors=actors, env_steps=state.env_steps + cfg.num_envs
        )
        return state, (jnp.where(done, episode_return, 0.0), done)

    def loss_fn(q_net, target_net, batch):
        q = jax.vmap(q_net)(batch["obs"])
        q_taken = jnp.take_along_axis(q, batch["action"][:, None], axis=-1)[:, 0]
        # Double DQN: the online network picks the next action, the target network values it.
        next_action = jnp.argmax(jax.vmap(q_net)(batch["next_obs"]), axis=-1)
        next_q = jax.vmap(target_net)(batch["next_obs"])
        next_value = jnp.take_along_axis(next_q, next_action[:, None], axis=-1)[:, 0]
        not_terminal = 1.0 - batch["terminated"].astype(jnp.float32)
        target = batch["reward"] + cfg.gamma * not_terminal * next_value
        return jnp.mean(optax.huber_loss(q_taken - jax.lax.stop_gradient(target)))

    def learn(state: TrainState, key: PRNGKeyArray) -> tuple[TrainState, Float[Array, ""]]:
        # The same batch on every device, drawn from every process's transitions.
        batch = state.replay.sample(key, cfg.batch_size)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(state.q_net, state.target_net, batch)
        updates, opt_state = optimiser.update(grads, state.opt_state)
        q_net = eqx.apply_updates(state.q_net, updates)
        target_net = jax.tree.map(
            lambda t, o: t + cfg.target_tau * (o - t) if eqx.is_array(t) else t,
            state.target_net,
            q_net,
        )
        state = dataclasses.replace(state, q_net=q_net, target_net=target_net, opt_state=opt_state)
        return state, loss

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
            state, finished = act_and_store(
                state, epsilon(cfg, state.env_steps - cfg.prefill_steps)
            )
            key, k_learn = jax.random.split(state.key)
            state, loss = learn(dataclasses.replace(state, key=key), k_learn)
            return state, (finished, loss)

        state, ((returns, done), loss) = filter_scan(body, state, cfg.chunk_iterations)
        # Summed over the environments once per chunk, not once per step: one small
        # all-reduce outside the loop.
        metrics = {
            "return_sum": jnp.sum(returns),
            "episodes": jnp.sum(done),
            "loss_sum": jnp.sum(loss),
        }
        return state, metrics

    @eqx.filter_jit
    def evaluate(q_net: eqx.nn.MLP, key: PRNGKeyArray) -> Float[Array, " episodes"]:
        """Undiscounted return of `eval_episodes` greedy episodes, each device running its
        share of them until its last one ends; the returns are gathered at the end."""
        dynamic, static = eqx.partition(q_net, eqx.is_array)
        count = cfg.eval_episodes // num_shards

        def episodes(dynamic, key):
            q_net = eqx.combine(dynamic, static)
            k_reset, k_steps = jax.random.split(jax.random.fold_in(key, jax.lax.axis_index(AXIS)))
            obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
                jax.random.split(k_reset, count), env_params
            )

            def running(carry):
                t, _, _, _, alive = carry
                return (t < env_params.max_steps_in_episode) & jnp.any(alive)

            def body(carry):
                t, obs, env_state, total, alive = carry
                action = jnp.argmax(jax.vmap(q_net)(obs), axis=-1).astype(jnp.int32)
                obs, env_state, reward, terminated, truncated, _ = vmap_step(
                    jax.random.split(jax.random.fold_in(k_steps, t), count),
                    env_state,
                    action,
                    env_params,
                )
                # An episode that ended is reset by the environment; its later rewards do not
                # count.
                total = total + jnp.where(alive, reward, 0.0)
                return t + 1, obs, env_state, total, alive & ~(terminated | truncated)

            alive = jnp.ones(count, jnp.bool_)
            carry = (jnp.asarray(0), obs, env_state, jnp.zeros(count), alive)
            _, _, _, total, _ = jax.lax.while_loop(running, body, carry)
            return jax.lax.all_gather(total, AXIS, tiled=True)

        # Unchecked: the carry's zeros are the same on every device, its updates are not.
        run = jax.shard_map(
            episodes, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
        )
        return run(dynamic, key)

    return prefill, train_chunk, evaluate


# --- What crosses the network ---------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4}
_BYTES |= {"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_DEFINITION = re.compile(r"\s*(?:ROOT )?%([\w.-]+) = ")
# What names the computations an instruction runs: a loop's, a reduction's, a branch's.
_CALLED = "body|condition|to_apply|calls|branch_computations|true_computation|false_computation"
_CALLS = re.compile(rf"\b(?:{_CALLED})=(\{{[^}}]*\}}|%[\w.-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shape: str
    dtype: str
    bytes: int
    loops: int  # how many `while` loops it is inside: 1 for the scan over a chunk's steps


def _instruction(line: str) -> tuple[str, str, str, list[str]] | None:
    """`(name, result shape, opcode, operand names)` of one line of HLO text, if it defines
    an instruction."""
    match = _DEFINITION.match(line)
    if not match:
        return None
    rest = line[match.end() :]
    if rest.startswith("("):  # a tuple shape, which holds spaces: up to its closing bracket
        depth = 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    operands = re.findall(r"%([\w.-]+)", rest[: rest.find(")")])
    return match.group(1), shape, opcode, operands


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled program's HLO text, one entry per operand (its shape and
    the bytes it holds), with the number of `while` loops around it."""
    shapes: dict[str, str] = {}
    calls: dict[str, list[tuple[str, list[str]]]] = {}  # computation -> (opcode, callees)
    found: list[tuple[str, str, list[str]]] = []  # (computation, opcode, operands)
    computation = entry = ""
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            computation = line.removeprefix("ENTRY ").split(" ")[0].lstrip("%")
            calls[computation] = []
            entry = computation if line.startswith("ENTRY ") else entry
            continue
        parsed = _instruction(line)
        if parsed is None:
            continue
        name, shape, opcode, operands = parsed
        shapes[name] = shape
        callees = [c for group in _CALLS.findall(line) for c in re.findall(r"%([\w.-]+)", group)]
        calls[computation].append((opcode, callees))
        base = opcode.removesuffix("-start")
        if base in COLLECTIVES:
            found.append((computation, base, operands))
    # Loop depth of each computation: a while loop's body runs once per iteration.
    depth: dict[str, int] = {}
    todo = [(entry, 0)]
    while todo:
        computation, d = todo.pop()
        if depth.get(computation, -1) >= d:
            continue
        depth[computation] = d
        for opcode, callees in calls.get(computation, []):
            todo.extend((c, d + (opcode == "while")) for c in callees)
    result = []
    for computation, op, operands in found:
        for operand in operands:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes[operand]):
                size = int(np.prod([int(d) for d in dims.split(",") if d]))
                result.append(
                    Collective(op, f"[{dims}]", dtype, size * _BYTES[dtype], depth[computation])
                )
    return result


def traffic_table(found: list[Collective], chunk_iterations: int) -> str:
    """One row per collective operand, those of every step first; then the totals."""
    when = {0: "per chunk", 1: "per step"}
    lines = [f"{'':11}{'op':<12}{'shape':<10}{'dtype':<7}{'bytes':>7}"]
    for c in sorted(found, key=lambda c: (-c.loops, -c.bytes)):
        lines.append(
            f"{when.get(c.loops, 'nested loop'):<11}{c.op:<12}{c.shape:<10}{c.dtype:<7}"
            f"{c.bytes:>7,}"
        )
    step = sum(c.bytes for c in found if c.loops == 1)
    chunk = sum(c.bytes for c in found if c.loops == 0)
    lines.append(
        f"total: {step:,} bytes per training step, plus {chunk:,} per chunk of "
        f"{chunk_iterations} steps: {step + chunk / chunk_iterations:,.1f} bytes per step"
    )
    if any(c.loops > 1 for c in found):
        lines.append("(collectives in nested loops run more than once per step: not in the total)")
    return "\n".join(lines)


# --- One process ----------------------------------------------------------------------------------


def params_identical(tree: PyTree) -> bool:
    """Whether every device of every process holds the same bits of every array of `tree`."""
    digests = []
    for shard in range(len(jax.local_devices())):
        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)):
            digest.update(np.asarray(leaf.addressable_shards[shard].data).tobytes())
        digests.append(np.frombuffer(digest.digest(), np.uint32))
    everyone = multihost_utils.process_allgather(np.stack(digests))
    return bool((everyone == everyone.reshape(-1, 8)[0]).all())


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

    cfg = Config()
    if args.smoke:
        cfg = dataclasses.replace(
            cfg,
            prefill_steps=128,
            dense_eval_steps=512,
            batch_size=32,
            eval_episodes=4,
            max_steps=512,
        )
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    num_shards = mesh.shape[AXIS]
    if cfg.num_envs % num_shards or cfg.eval_episodes % num_shards:
        raise ValueError(
            f"{num_shards} devices in all: each needs the same share of the {cfg.num_envs} "
            f"environments and {cfg.eval_episodes} evaluation episodes."
        )
    say(
        f"{jax.process_count()} processes x {len(jax.local_devices())} devices: one "
        f"GlobalReplay of {num_shards} UniformReplay shards of {cfg.replay_size // num_shards:,} "
        f"transitions, {cfg.num_envs // num_shards} environments per device"
    )
    env, env_params = gymnax.make("CartPole-v1")
    prefill, train_chunk, evaluate = make_train_functions(cfg, env, env_params, mesh)
    state = prefill(init_state(cfg, env, env_params, mesh, args.seed))

    # The chunk as it runs: compiled once, here, so that its collectives can be read.
    train_chunk = train_chunk.lower(state).compile()
    say("What crosses devices (and processes) in one training chunk, from the compiled HLO:")
    say(traffic_table(collectives(train_chunk.compiled.as_text()), cfg.chunk_iterations))

    eval_key = jax.random.fold_in(jax.random.key(args.seed), 2)

    def record() -> dict[str, float]:
        nonlocal eval_key
        eval_key, k = jax.random.split(eval_key)
        returns = np.asarray(evaluate(state.q_net, k))
        return {"env_steps": int(state.env_steps), "eval_mean": float(returns.mean())}

    history = [record()]
    say(f"{history[-1]['env_steps']:>7} env steps: greedy {history[-1]['eval_mean']:5.1f}")
    # Training statistics of the chunks since the last evaluation.
    since = {"return_sum": 0.0, "episodes": 0, "loss_sum": 0.0, "iterations": 0}
    chunk_steps = cfg.chunk_iterations * cfg.num_envs
    solved = out_of_time = at_cap = False
    while not (solved or out_of_time or at_cap):
        state, metrics = train_chunk(state)
        for name, value in metrics.items():
            since[name] += value.item()
        since["iterations"] += cfg.chunk_iterations
        steps = int(state.env_steps)
        # Each process has its own clock: process 0's decides, so that all stop together.
        out_of_time = bool(
            multihost_utils.broadcast_one_to_all(
                np.asarray(time.perf_counter() - _START > args.max_seconds)
            )
        )
        at_cap = steps >= cfg.max_steps
        interval = chunk_steps if steps <= cfg.dense_eval_steps else steps // 32
        # The last chunk is always evaluated.
        if steps - history[-1]["env_steps"] >= interval or out_of_time or at_cap:
            history.append(record())
            train = since["return_sum"] / since["episodes"] if since["episodes"] else math.nan
            say(
                f"{steps:>7} env steps: greedy {history[-1]['eval_mean']:5.1f}, training "
                f"episodes {train:5.1f}, loss {since['loss_sum'] / since['iterations']:.3f}, "
                f"{time.perf_counter() - _START:5.1f} s"
            )
            since = dict.fromkeys(since, 0)
            # The evaluation is replicated: every process reaches the same verdict.
            solved = not args.smoke and history[-1]["eval_mean"] >= cfg.target_return

    last = history[-1]
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
    say(f"{outcome}; stopping")
    if solved:
        # The stopping rule picked the evaluation that cleared the bar; fresh episodes give an
        # estimate without that selection bias.
        fresh = np.concatenate([evaluate(state.q_net, k) for k in jax.random.split(eval_key, 4)])
        held_out = f", {fresh.mean():.1f} on {fresh.size} fresh ones"
    else:
        held_out = ""
    identical = params_identical(state.q_net)
    wall = time.perf_counter() - _START
    say(
        f"seed {args.seed}, {jax.process_count()} processes: mean greedy return "
        f"{last['eval_mean']:.1f} over {cfg.eval_episodes} episodes{held_out} after "
        f"{last['env_steps']} environment steps\nwall time {wall:.1f} s (process 0, from its "
        "start, compilation included)\n"
        f"q-network bit-identical on all {num_shards} devices: {identical}"
    )
    if args.processes > 1:
        jax.distributed.shutdown()
    if not identical:
        say("FAILED: the processes' parameters diverged.")
        return 1
    if args.smoke:
        say("smoke run: no learning threshold")
        return 0
    if solved:
        return 0
    budget = f"{args.max_seconds:g} s" if out_of_time else f"{cfg.max_steps} environment steps"
    if first:
        print(
            f"FAILED: the mean greedy return did not reach {cfg.target_return:g} within {budget} "
            f"(best {max(h['eval_mean'] for h in history):.1f}).",
            file=sys.stderr,
        )
    return 1


# --- The launcher ---------------------------------------------------------------------------------


def free_port() -> int:
    """A port free now (another program could still take it before process 0 does: then the
    processes fail to start, and say so)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: argparse.Namespace,
    script: str = __file__,
    extra: list[str] | None = None,
    margin: float = 60.0,
) -> int:
    """Start `args.processes` copies of `script` (this one, or another example built on these
    functions, with its `extra` arguments) on this machine, one per process id, and wait for
    them; if one fails, or they outlast the budget, stop the others."""
    common = [
        *("--processes", str(args.processes), "--seed", str(args.seed)),
        *("--devices-per-process", str(args.devices_per_process)),
        *("--max-seconds", str(args.max_seconds), "--coordinator", f"127.0.0.1:{free_port()}"),
        *(["--smoke"] if args.smoke else []),
        *(extra or []),
    ]
    children = [
        subprocess.Popen([sys.executable, script, *common, "--process-id", str(i)])
        for i in range(args.processes)
    ]
    # Each process stops itself after --max-seconds; `margin` is for its last evaluation (and,
    # with threads, their shutdown).
    limit = args.max_seconds + margin
    failure = None
    while failure is None:
        codes = [child.poll() for child in children]
        failed = [i for i, code in enumerate(codes) if code]
        if failed:
            failure = f"process {failed[0]} exited with status {codes[failed[0]]}"
        elif None not in codes:
            break
        elif time.perf_counter() - _START > limit:
            failure = f"the processes were still running after {limit:g} s"
        else:
            time.sleep(0.1)
    for child in children:
        if child.poll() is None:
            child.kill()  # waiting, maybe forever, in a collective with one that failed
        child.wait()
    print(f"launcher: {args.processes} processes, {time.perf_counter() - _START:.1f} s in all")
    if failure is not None:
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


def process_arguments(
    description: str, max_seconds: float, seconds_help: str
) -> argparse.ArgumentParser:
    """The arguments of an example run as processes on this machine (this one, and the
    examples built on its functions): how many, their devices, the seed, the budget, the
    smoke run, and the two that make a started copy one process of the program."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="CPU devices per process (default 1); GPU and TPU hosts use their own",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=max_seconds, help=seconds_help)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run a few hundred steps end to end without a learning threshold (for CI)",
    )
    parser.add_argument(
        "--process-id",
        type=int,
        help="run as this process of a jax.distributed program (with --coordinator) instead "
        "of starting every process here",
    )
    parser.add_argument("--coordinator", help="process 0's HOST:PORT")
    return parser


def parsed(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments from `argv`, `--process-id` and `--coordinator` together or not
    at all."""
    args = parser.parse_args(argv)
    if (args.process_id is None) != (args.coordinator is None):
        parser.error("--process-id and --coordinator go together")
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = process_arguments(
        __doc__.split("\n\n")[0],
        300.0,
        "wall-clock budget of each process from its start, compilation included (default "
        "300: a step waits on collectives between processes, slow on CPUs)",
    )
    return parsed(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(args) if args.process_id is None else run_process(args)


if __name__ == "__main__":
    sys.exit(main())
