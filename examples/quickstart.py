"""A short tour of dejax_eqx: a uniform replay inside a donated, jitted training step.

Run: python examples/quickstart.py
"""

import time

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp


def main(num_steps: int = 200, num_envs: int = 64, batch_size: int = 256) -> None:
    item = {
        "obs": jnp.zeros(8, jnp.float32),
        "action": jnp.zeros((), jnp.int32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.bool_),
    }
    buf = dx.UniformReplay(item, max_size=10_000)

    # The buffer is donated: XLA writes the new items into the old arrays in place.
    @eqx.filter_jit(donate="all-except-first")
    def train_step(key, buf, step):
        k_obs, k_sample = jax.random.split(key)
        steps = {  # stand-in for a batch of environment transitions
            "obs": jax.random.normal(k_obs, (num_envs, 8)),
            "action": jnp.full(num_envs, step, jnp.int32),
            "reward": jnp.ones(num_envs),
            "done": jnp.zeros(num_envs, bool),
        }
        buf, batch = buf.add_and_sample(steps, k_sample, batch_size)
        loss = jnp.mean(batch["obs"] ** 2)  # stand-in for a learner update
        return buf, loss, jnp.mean(batch["action"].astype(jnp.float32))

    pointer = buf.storage.data["obs"].unsafe_buffer_pointer()
    key = jax.random.key(0)
    start = time.perf_counter()
    for step in range(num_steps):
        key, sub = jax.random.split(key)
        buf, loss, mean_action = train_step(sub, buf, jnp.asarray(step, jnp.int32))
    jax.block_until_ready(buf)
    elapsed = time.perf_counter() - start

    in_place = buf.storage.data["obs"].unsafe_buffer_pointer() == pointer
    print(f"stored {int(buf.size)} / {buf.max_size} items after {num_steps} steps")
    print(f"last batch: loss {float(loss):.3f}, mean step sampled {float(mean_action):.1f}")
    print(f"buffer updated in place: {in_place}")
    print(f"{elapsed / num_steps * 1e6:.0f} us per step (including the first compile)")


if __name__ == "__main__":
    main()
