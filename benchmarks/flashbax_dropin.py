"""W9: one program written against flashbax's API, run on flashbax 0.1.3 and on
`dejax_eqx.compat.flashbax` with only the import changed, against a raw floor.

The program is a function of the module it is given (`fbx`): the two systems run the same
lines. Each part times `steps` training steps in one jitted, donating `lax.scan`, on a buffer
filled beforehand (the result is steps per second):

- `dqn`, PureJaxRL's DQN: a flat buffer (`make_flat_buffer(add_batch_size=NUM_ENVS)`) of
    `size` transitions; each step adds one transition of every env, then, under
    `lax.cond(buffer.can_sample(state), ...)` as PureJaxRL gates its learner, samples
    `DQN_BATCH` pairs `(first, second)` and reduces them to a scalar (the loss's stand-in).
- `r2d2`, a prioritised sequence learner (Stoix's R2D2 and MuZero use this buffer): a
    prioritised trajectory buffer of `NUM_ENVS` rows of `size / NUM_ENVS` steps; each step adds
    a rollout of `ROLLOUT` steps of every env (`[NUM_ENVS, ROLLOUT, ...]`), samples
    `R2D2_BATCH` windows of `SEQUENCE_LENGTH` steps on `PERIOD`, computes new priorities from
    every sampled value and sets them by the sample's indices.

The raw floor does the same work in plain `jax.numpy`: ring writes and uniformly placed
gathers, with no checks and, for `r2d2`, no sum tree (so it is no prioritised buffer at all: the
gap to it is the whole cost of priorities and of the API).
"""

import importlib

import jax
import jax.numpy as jnp

from . import _harness as h


NUM_ENVS = 16
DQN_BATCH = 128
ROLLOUT = 40
SEQUENCE_LENGTH = 80
PERIOD = 40
R2D2_BATCH = 64
PRIORITY_EXPONENT = 0.6

MODULES = {"flashbax": "flashbax", "dejax_eqx.compat.flashbax": "dejax_eqx.compat.flashbax"}


def _steps(t) -> dict[str, jax.Array]:
    """Time step `t` (traced) of every env, in the harness's item layout: values that differ by
    env and by step, cheap to make so that the buffer, not the data, is timed."""
    t = jnp.asarray(t, jnp.float32)
    env = jnp.arange(NUM_ENVS, dtype=jnp.float32)
    return {
        "obs": (t + env[:, None]) * jnp.ones((NUM_ENVS, h.OBS_DIM), jnp.float32),
        "action": (t + env).astype(jnp.int32) % 7,
        "reward": jnp.sin(t + env),
        "done": (t + env) % 100 == 0,
    }


def _rollout(t) -> dict[str, jax.Array]:
    """`ROLLOUT` time steps from `t`, leaves `[NUM_ENVS, ROLLOUT, ...]`."""
    return jax.vmap(_steps, out_axes=1)(t + jnp.arange(ROLLOUT))


def _new_priorities(items) -> jax.Array:
    """Stands in for a sequence's |TD error|: reads every sampled value of each window."""
    value = jnp.mean(items["obs"], axis=(1, 2)) + jnp.mean(items["reward"], axis=1)
    return jnp.abs(jnp.sin(value)) + 1e-3


# ---------------------------------------------------------------------------------------------
# The program: only `fbx` differs between the two systems


def dqn_program(fbx, size: int, steps: int):
    buffer = fbx.make_flat_buffer(
        max_length=size,
        min_length=DQN_BATCH,
        sample_batch_size=DQN_BATCH,
        add_sequences=False,
        add_batch_size=NUM_ENVS,
    )
    fill = size // NUM_ENVS
    state = buffer.init(jax.tree.map(lambda x: x[0], _steps(0)))
    state = jax.jit(
        lambda s: jax.lax.scan(lambda s, t: (buffer.add(s, _steps(t)), None), s, jnp.arange(fill))[
            0
        ],
        donate_argnums=0,
    )(state)

    def run(carry, key):
        def step(carry, key):
            state, t, loss = carry
            state = buffer.add(state, _steps(t))

            def learn(loss):
                pair = buffer.sample(state, key).experience
                return loss + h.consume(pair.first) + h.consume(pair.second)

            loss = jax.lax.cond(buffer.can_sample(state), learn, lambda loss: loss, loss)
            return (state, t + 1, loss), None

        return jax.lax.scan(step, carry, jax.random.split(key, steps))[0]

    return (state, jnp.int32(fill), jnp.float32(0)), run


def r2d2_program(fbx, size: int, steps: int):
    max_length = size // NUM_ENVS
    buffer = fbx.make_prioritised_trajectory_buffer(
        add_batch_size=NUM_ENVS,
        sample_batch_size=R2D2_BATCH,
        sample_sequence_length=SEQUENCE_LENGTH,
        period=PERIOD,
        min_length_time_axis=SEQUENCE_LENGTH,
        max_length_time_axis=max_length,
        priority_exponent=PRIORITY_EXPONENT,
    )
    state = buffer.init(jax.tree.map(lambda x: x[0], _steps(0)))
    fill = max_length // ROLLOUT
    state = jax.jit(
        lambda s: jax.lax.scan(
            lambda s, i: (buffer.add(s, _rollout(i * ROLLOUT)), None), s, jnp.arange(fill)
        )[0],
        donate_argnums=0,
    )(state)

    def run(carry, key):
        def step(carry, key):
            state, t = carry
            state = buffer.add(state, _rollout(t))
            sample = buffer.sample(state, key)
            priorities = _new_priorities(sample.experience)
            state = buffer.set_priorities(state, sample.indices, priorities)
            return (state, t + ROLLOUT), None

        return jax.lax.scan(step, carry, jax.random.split(key, steps))[0]

    return (state, jnp.int32(fill * ROLLOUT)), run


# ---------------------------------------------------------------------------------------------
# The raw floor


def _ring(size_per_env: int) -> dict[str, jax.Array]:
    return jax.tree.map(
        lambda x: jnp.zeros((NUM_ENVS, size_per_env, *x.shape[1:]), x.dtype), _steps(0)
    )


def dqn_raw(size: int, steps: int):
    m = size // NUM_ENVS

    def run(carry, key):
        def step(carry, key):
            data, t, loss = carry
            data = jax.tree.map(
                lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, t % m, 1), data, _steps(t)
            )
            k1, k2 = jax.random.split(key)
            env = jax.random.randint(k1, (DQN_BATCH,), 0, NUM_ENVS)
            first = (t + 1 + jax.random.randint(k2, (DQN_BATCH,), 0, m - 1)) % m
            pair = [jax.tree.map(lambda x: x[env, (first + i) % m], data) for i in (0, 1)]
            return (data, t + 1, loss + h.consume(pair[0]) + h.consume(pair[1])), None

        return jax.lax.scan(step, carry, jax.random.split(key, steps))[0]

    return (_ring(m), jnp.int32(m), jnp.float32(0)), run


def r2d2_raw(size: int, steps: int):
    m = size // NUM_ENVS

    def run(carry, key):
        def step(carry, key):
            data, t, total = carry
            slots = (t + jnp.arange(ROLLOUT)) % m
            data = jax.tree.map(lambda x, y: x.at[:, slots].set(y), data, _rollout(t))
            k1, k2 = jax.random.split(key)
            env = jax.random.randint(k1, (R2D2_BATCH,), 0, NUM_ENVS)
            start = t + ROLLOUT + PERIOD * jax.random.randint(k2, (R2D2_BATCH,), 0, m // PERIOD - 1)
            window = (start[:, None] + jnp.arange(SEQUENCE_LENGTH)[None, :]) % m
            items = jax.tree.map(lambda x: x[env[:, None], window], data)
            return (data, t + ROLLOUT, total + jnp.sum(_new_priorities(items))), None

        return jax.lax.scan(step, carry, jax.random.split(key, steps))[0]

    return (_ring(m), jnp.int32(m), jnp.float32(0)), run


def w9(system: str, size: int, steps: int, repeats: int) -> dict:
    """`size` is the capacity in items (`NUM_ENVS` rows of `size / NUM_ENVS` steps)."""
    name, _, part = system.partition(", ")
    rows = NUM_ENVS * (PERIOD if part == "r2d2" else 1)
    if size % rows:
        raise ValueError(f"W9 {part}: size {size} is not a multiple of {rows}")
    programs = {"dqn": (dqn_program, dqn_raw), "r2d2": (r2d2_program, r2d2_raw)}
    if part not in programs:
        raise ValueError(system)
    program, raw = programs[part]
    if name == "raw":
        state, run = raw(size, steps)
    elif name in MODULES:
        state, run = program(importlib.import_module(MODULES[name]), size, steps)
    else:
        raise ValueError(system)
    seconds = h.time_steps(jax.jit(run, donate_argnums=0), state, repeats)
    return {"values": [steps / s for s in seconds], "unit": "steps/s"}
