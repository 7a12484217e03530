"""Sequences from envpool's async mode: a TrajectoryBuffer fed by every `recv()`.

In async mode envpool steps `num_envs` environments in the background and each `recv()`
returns whichever `batch_size` of them finished first, so every call brings a different
subset of envs. `TrajectoryBuffer.add(steps, env_ids=info["env_id"])` appends each returned
step to its own env's stream. It is called once per `recv()` from Python, so it goes through
plain `jax.jit` with the buffer donated: a buffer holds only arrays, and `jax.jit` dispatches
it faster than `eqx.filter_jit`, whose per-call partitioning would cost more than the write
(docs/jit-patterns.md, "Dispatch overhead"). Every few `recv()`s, a jitted learner step
samples a batch of sequences, mixing old ones from the replay windows with fresh ones from the
online queue (the steps since the previous learner step), as Muesli does, and then empties
the online queue.

The policy is random and the "learner" only measures what it sampled: the point is the data
flow. Each stored step holds what `recv()` returned for that env (observation, the reward and
done flag that came with it) and the action then sent to it.

Run: python examples/envpool_async.py   (Linux; `pip install -e '.[examples]'` installs envpool)
"""

import functools
import time

import dejax_eqx as dx
import envpool
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def main(
    num_envs: int = 32,
    batch_size: int = 8,
    num_recvs: int = 4000,
    learn_every: int = 40,
    max_length: int = 2048,
    sequence_length: int = 16,
    replay_batch_size: int = 48,
    online_batch_size: int = 16,
    seed: int = 0,
) -> dict:
    """Run the actor/learner loop; print and return a summary of what was sampled."""
    env = envpool.make(
        "CartPole-v1", env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=seed
    )
    step = {
        "obs": jnp.zeros(4, jnp.float32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.bool_),
        "action": jnp.zeros((), jnp.int32),
    }
    buf = dx.TrajectoryBuffer(step, num_envs=num_envs, max_length=max_length)
    window = dx.Window(sequence_length)  # static: the learner compiles once

    # The buffer is donated, so adding a step writes into the existing storage in place. The
    # learner step below is called once per `learn_every` recvs and does far more work, so
    # `eqx.filter_jit`'s dispatch does not matter there.
    @functools.partial(jax.jit, donate_argnums=0)
    def add(buf, steps, env_ids):
        return buf.add(steps, env_ids=env_ids)

    @eqx.filter_jit(donate="all-except-first")
    def learn(key, buf):
        sources = {"replay": replay_batch_size, "online": online_batch_size}
        sample = buf.sample(key, replay_batch_size + online_batch_size, window, source=sources)
        seqs, mask = sample.items, sample.mask
        # A real learner would compute its loss on `seqs`, weighting steps by `mask` and
        # cutting returns at `seqs["done"]`; here we only measure the batch.
        stats = {
            "valid": mask.mean(dtype=jnp.float32),
            "valid_online": mask[replay_batch_size:].mean(dtype=jnp.float32),
            "episode_ends": jnp.sum(seqs["done"] & mask, dtype=jnp.int32),
        }
        return buf.reset_online_queue(), stats

    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    stats = []
    start = time.perf_counter()
    env.async_reset()
    for i in range(num_recvs):
        obs, reward, terminated, truncated, info = env.recv()
        env_ids = info["env_id"]  # int32, a different subset on every call
        action = rng.integers(0, 2, size=len(env_ids), dtype=np.int32)
        steps = {
            "obs": obs,
            "reward": reward,
            "done": terminated | truncated,
            "action": action,
        }
        buf = add(buf, steps, env_ids)
        env.send(action, env_ids)
        if (i + 1) % learn_every == 0:
            key, subkey = jax.random.split(key)
            buf, batch_stats = learn(subkey, buf)
            stats.append(batch_stats)
    stats = jax.tree.map(lambda *xs: np.asarray(xs), *stats)
    elapsed = time.perf_counter() - start

    lengths = np.asarray(buf.lengths("replay"))
    summary = {
        "steps": num_recvs * batch_size,
        "learner_steps": len(stats["valid"]),
        "valid_fraction": float(stats["valid"].mean()),
        "valid_fraction_online": float(stats["valid_online"].mean()),
        "episode_ends_per_batch": float(stats["episode_ends"].mean()),
        "lengths": lengths,
        "seconds": elapsed,
    }
    print(
        f"{summary['steps']} env steps from {num_recvs} recv() calls of {batch_size} of "
        f"{num_envs} envs, {summary['learner_steps']} learner steps in {elapsed:.1f} s"
    )
    print(
        f"fraction of valid steps in sampled sequences: {summary['valid_fraction']:.3f} "
        f"(online rows: {summary['valid_fraction_online']:.3f}); "
        f"episode ends per batch: {summary['episode_ends_per_batch']:.1f}"
    )
    print(f"per-env replay lengths: {lengths.tolist()}")
    return summary


if __name__ == "__main__":
    main()
