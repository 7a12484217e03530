"""W8: prioritised replay of sequences (`dx.PrioritisedTrajectoryBuffer` against flashbax's
`make_prioritised_trajectory_buffer(device="cpu")` and a raw floor), issue 14's two settings.

Every system keeps `NUM_ENVS` streams of `size / NUM_ENVS` steps of `{"obs": f32[4],
"reward": f32[]}` (a small item, so the buffers' own bookkeeping shows and memory stays
modest), with whole windows of `SEQUENCE_LENGTH` steps at every start (`dx.Window(80,
strict=True)`, through `_harness.prioritised_trajectory_buffer`), priority exponent 0.6. The
system's name ends in the part of the workload it measures:

- `, add 1` and `, add 2` (flashbax issue #62's setting): `steps` calls in one jitted, donating
  `lax.scan` from an empty buffer, each adding 1 or 2 steps to every env; the result is time
  steps added per second (one time step is `NUM_ENVS` items). For dejax_eqx, 2 steps per call
  are two `add` calls in the scan's body (it adds one step per env per call); flashbax adds a
  `[NUM_ENVS, 2, ...]` batch. The raw floor writes the steps into plain `[NUM_ENVS,
  max_length, ...]` arrays at a ring index: no priorities at all.
- `, learn` (a learner's step): on full streams, `steps` steps in one jitted, donating
  `lax.scan`, each sampling `BATCH_SIZE` windows of `SEQUENCE_LENGTH` steps, computing new
  priorities from every sampled value, and setting them; the result is learner steps per
  second. flashbax always samples stratified; `dejax_eqx` draws i.i.d., `dejax_eqx
  stratified` as flashbax does. The raw floor gathers uniformly placed windows and computes
  the same priorities, with no tree.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _harness as h


NUM_ENVS = 16
OBS_DIM = 4
SEQUENCE_LENGTH = 80
BATCH_SIZE = 64
PRIORITY_EXPONENT = 0.6


def prototype() -> dict[str, jax.Array]:
    return {"obs": jnp.zeros(OBS_DIM, jnp.float32), "reward": jnp.zeros((), jnp.float32)}


def _step(t) -> dict[str, jax.Array]:
    """Time step `t` (traced) of every env: values that differ by env and by step, cheap to
    make so that the adds, not the data, are timed."""
    t = jnp.asarray(t, jnp.float32)
    env = jnp.arange(NUM_ENVS, dtype=jnp.float32)
    return {
        "obs": (t + env[:, None]) * jnp.ones((NUM_ENVS, OBS_DIM), jnp.float32),
        "reward": jnp.sin(t + env),
    }


def _new_priorities(items) -> jax.Array:
    """Stands in for a sequence's |TD error|: reads every sampled value of each window."""
    value = jnp.mean(items["obs"], axis=(1, 2)) + jnp.mean(items["reward"], axis=1)
    return jnp.abs(jnp.sin(value)) + 1e-3


# ---------------------------------------------------------------------------------------------
# (a) adds


def _adds_dejax_eqx(max_length: int, per_call: int, steps: int):
    buf = h.prioritised_trajectory_buffer(
        prototype(), NUM_ENVS, max_length, SEQUENCE_LENGTH, priority_exponent=PRIORITY_EXPONENT
    )

    def run(state, key):
        del key

        def body(carry, i):
            buf, t = carry
            for j in range(per_call):  # `add` takes one step per env
                buf = buf.add(_step(t + j))
            return (buf, t + per_call), None

        return jax.lax.scan(body, state, jnp.arange(steps))[0]

    return (buf, jnp.int32(0)), run


def _flashbax_buffer(max_length: int):
    import flashbax as fbx

    return fbx.make_prioritised_trajectory_buffer(
        add_batch_size=NUM_ENVS,
        sample_batch_size=BATCH_SIZE,
        sample_sequence_length=SEQUENCE_LENGTH,
        period=1,
        min_length_time_axis=SEQUENCE_LENGTH,
        max_length_time_axis=max_length,
        priority_exponent=PRIORITY_EXPONENT,
        device="cpu",
    )


def _adds_flashbax(max_length: int, per_call: int, steps: int):
    buffer = _flashbax_buffer(max_length)

    def run(state, key):
        del key

        def body(carry, i):
            state, t = carry
            batch = jax.vmap(_step, out_axes=1)(t + jnp.arange(per_call))  # [envs, per_call]
            return (buffer.add(state, batch), t + per_call), None

        return jax.lax.scan(body, state, jnp.arange(steps))[0]

    return (buffer.init(prototype()), jnp.int32(0)), run


def _adds_raw(max_length: int, per_call: int, steps: int):
    data = jax.tree.map(lambda x: jnp.zeros((NUM_ENVS, max_length, *x.shape), x.dtype), prototype())

    def run(state, key):
        del key

        def body(carry, i):
            data, t = carry
            for j in range(per_call):
                slot = (t + j) % max_length
                data = jax.tree.map(
                    lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, slot, 1),
                    data,
                    _step(t + j),
                )
            return (data, t + per_call), None

        return jax.lax.scan(body, state, jnp.arange(steps))[0]

    return (data, jnp.int32(0)), run


# ---------------------------------------------------------------------------------------------
# (b) learner steps


def _full_streams(max_length: int) -> dict[str, jax.Array]:
    """`[NUM_ENVS, max_length, ...]` arrays of time steps 0 .. max_length - 1."""
    steps = jax.jit(jax.vmap(_step, out_axes=1))(jnp.arange(max_length))
    return steps


def _learn_dejax_eqx(max_length: int, steps: int, stratified: bool):
    buf = h.prioritised_trajectory_buffer(
        prototype(),
        NUM_ENVS,
        max_length,
        SEQUENCE_LENGTH,
        priority_exponent=PRIORITY_EXPONENT,
        stratified=stratified,
    )

    @eqx.filter_jit(donate="all")
    def fill(buf):
        return jax.lax.scan(lambda b, t: (b.add(_step(t)), None), buf, jnp.arange(max_length))[0]

    buf = fill(buf)

    def run(buf, key):
        def step(buf, key):
            s = buf.sample(key, BATCH_SIZE)
            new = _new_priorities(s.sample.items)
            return buf.set_priorities(s.sample.env, s.sample.start, new), None

        return jax.lax.scan(step, buf, jax.random.split(key, steps))[0]

    return buf, run


def _learn_flashbax(max_length: int, steps: int):
    buffer = _flashbax_buffer(max_length)
    full = _full_streams(max_length)
    first = jax.tree.map(lambda x: x[0, 0], full)
    state = jax.jit(buffer.add, donate_argnums=0)(buffer.init(first), full)
    del full

    def run(state, key):
        def step(state, key):
            s = buffer.sample(state, key)
            new = _new_priorities(s.experience)
            return buffer.set_priorities(state, s.indices, new), None

        return jax.lax.scan(step, state, jax.random.split(key, steps))[0]

    return state, run


def _learn_raw(max_length: int, steps: int):
    """Uniformly placed ring-wrapped windows, gathered, and their priorities; no tree."""

    def run(state, key):
        data, acc = state

        def step(acc, key):
            k1, k2 = jax.random.split(key)
            env = jax.random.randint(k1, (BATCH_SIZE,), 0, NUM_ENVS)
            start = jax.random.randint(k2, (BATCH_SIZE,), 0, max_length)
            slots = (start[:, None] + jnp.arange(SEQUENCE_LENGTH)[None, :]) % max_length
            batch = jax.tree.map(lambda x: x[env[:, None], slots], data)
            return acc + jnp.sum(_new_priorities(batch)), None

        return data, jax.lax.scan(step, acc, jax.random.split(key, steps))[0]

    return (_full_streams(max_length), jnp.float32(0)), run


def w8(system: str, size: int, steps: int, repeats: int) -> dict:
    """`size` is the total capacity in items (`NUM_ENVS * max_length`)."""
    if size % NUM_ENVS:
        raise ValueError(f"W8: size {size} is not a multiple of {NUM_ENVS} envs")
    max_length = size // NUM_ENVS
    name, _, part = system.partition(", ")
    if part in ("add 1", "add 2"):
        per_call = int(part[-1])
        make = {"dejax_eqx": _adds_dejax_eqx, "flashbax": _adds_flashbax, "raw": _adds_raw}
        state, run = make[name](max_length, per_call, steps)
        seconds = h.time_steps(jax.jit(run, donate_argnums=0), state, repeats)
        return {"values": [steps * per_call / s for s in seconds], "unit": "steps/s"}
    if part == "learn":
        if name == "dejax_eqx":
            state, run = _learn_dejax_eqx(max_length, steps, stratified=False)
        elif name == "dejax_eqx stratified":
            state, run = _learn_dejax_eqx(max_length, steps, stratified=True)
        elif name == "flashbax":
            state, run = _learn_flashbax(max_length, steps)
        elif name == "raw":
            state, run = _learn_raw(max_length, steps)
        else:
            raise ValueError(system)
        seconds = h.time_steps(jax.jit(run, donate_argnums=0), state, repeats)
        return {"values": [steps / s for s in seconds], "unit": "steps/s"}
    raise ValueError(system)
