"""W5: sampling sequences from per-env streams (`dx.TrajectoryBuffer`, flashbax's trajectory
buffer, the seed gist's sampler, the raw floor).

Every system holds `NUM_ENVS` full streams of `max_length` steps `{"obs": f32[obs_dim],
"action": i32[], "reward": f32[], "done": bool[]}` and draws `BATCH_SIZE` windows of
`SEQUENCE_LENGTH` steps per sample:

- `dejax_eqx`: `TrajectoryBuffer.sample` (weighted starts, masks, run-time checks included).
- `flashbax`: `make_trajectory_buffer(period=1)`, uniform starts among full windows, no mask.
- `gist`: the sampler of the Muesli gist this buffer grew from, re-implemented from its
  description on plain arrays: a sequential `lax.scan` over every stored step to find its
  remaining length, then a categorical draw over all of them, so O(num_envs · max_length).
- `raw`, the floor: uniform (env, start) pairs and one gather of their ring-wrapped windows
  from a plain `[num_envs, max_length, ...]` array; no weights, no mask, no checks.

What is timed: `steps` samples inside one jitted `lax.scan`, every sampled leaf summed into
the result, on a state that is passed in and neither returned nor donated
(`_harness.sampling_scan` and `time_reads`), so the time is the samples and nothing else.
"""

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp

from . import _harness as h


NUM_ENVS = 64
SEQUENCE_LENGTH = 32
BATCH_SIZE = 64


def _steps(key, num_envs: int, obs_dim: int) -> dict[str, jax.Array]:
    """One step for each of `num_envs` streams."""
    k1, k2 = jax.random.split(key)
    return {
        "obs": jax.random.normal(k1, (num_envs, obs_dim)),
        "action": jax.random.randint(k2, (num_envs,), 0, 2),
        "reward": jnp.ones(num_envs),
        "done": jax.random.uniform(k2, (num_envs,)) < 0.01,
    }


def _keys(max_length: int) -> jax.Array:
    return jax.random.split(jax.random.key(0), max_length)


def full_buffer(num_envs: int, max_length: int, obs_dim: int) -> dx.TrajectoryBuffer:
    """A `TrajectoryBuffer` whose every env holds `max_length` steps, added by public `add`
    calls in one donated scan."""
    buf = dx.TrajectoryBuffer(h.prototype(obs_dim), num_envs, max_length)

    @eqx.filter_jit(donate="all")
    def fill(buf, keys):
        def add(buf, key):
            return buf.add(_steps(key, num_envs, obs_dim)), None

        return jax.lax.scan(add, buf, keys)[0]

    return fill(buf, _keys(max_length))


def full_arrays(num_envs: int, max_length: int, obs_dim: int) -> dict[str, jax.Array]:
    """The same steps as `full_buffer`, as plain `[num_envs, max_length, ...]` arrays with the
    oldest step of every stream at index 0."""

    @jax.jit
    def make(keys):
        steps = jax.vmap(lambda k: _steps(k, num_envs, obs_dim))(keys)
        return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), steps)

    return make(_keys(max_length))


def raw_sample(data, key, batch_size: int, sequence_length: int):
    """The floor: `batch_size` uniformly placed, ring-wrapped windows, one gather per leaf."""
    num_envs, max_length = jax.tree.leaves(data)[0].shape[:2]
    k1, k2 = jax.random.split(key)
    env = jax.random.randint(k1, (batch_size,), 0, num_envs)
    start = jax.random.randint(k2, (batch_size,), 0, max_length)
    slots = (start[:, None] + jnp.arange(sequence_length)[None, :]) % max_length
    return jax.tree.map(lambda x: x[env[:, None], slots], data)


def gist_sample(state, key, batch_size: int, sequence_length: int):
    """The gist's sampler (power 1) on `state = {"data", "lengths", "head"}`: per-env streams
    of `[num_envs, max_length, ...]` arrays, each env's stored length, and its next write slot.

    For each stored step (flattened over envs), a sequential scan finds its env by an argmax
    over the cumulative lengths and its remaining length; starts are then drawn by a
    categorical over all stored steps with logits `log(remaining)`. The gist passes
    `arange(total stored steps)` in, so its shapes change (and it recompiles) as the buffer
    fills; here the streams are full and the total is static.
    """
    data, lengths, head = state["data"], state["lengths"], state["head"]
    num_envs, m = jax.tree.leaves(data)[0].shape[:2]
    cum = jnp.cumsum(lengths)

    def remaining(carry, x):
        row_end = cum[jnp.argmax(cum > x)]
        return carry, jnp.minimum(row_end - x, sequence_length)

    _, rem = jax.lax.scan(remaining, None, jnp.arange(num_envs * m, dtype=jnp.int32))
    flat = jax.random.categorical(key, jnp.log(rem.astype(jnp.float32)), shape=(batch_size,))
    env = jnp.argmax(cum[:, None] > flat[None, :], axis=0)
    env_first = jnp.concatenate([jnp.zeros(1, cum.dtype), cum[:-1]])
    tail = (head - lengths) % m
    col = flat + (tail - env_first)[env]
    cols = (jnp.arange(sequence_length)[None, :] + col[:, None]) % m
    seqs = jax.tree.map(lambda x: x[env[:, None], cols], data)
    mask = jnp.arange(sequence_length)[None, :] < rem[flat][:, None]
    return seqs, mask


def w5(system: str, max_length: int, steps: int, repeats: int) -> dict:
    """Microseconds per sample of `BATCH_SIZE` windows of `SEQUENCE_LENGTH` steps;
    `system` may end in `", obs f32[16]"` (a small item, where the sampler's own cost shows)."""
    num_envs, batch, seq = NUM_ENVS, BATCH_SIZE, SEQUENCE_LENGTH
    obs_dim = h.OBS_DIM
    if system.endswith(", obs f32[16]"):
        obs_dim = 16
        system = system.removesuffix(", obs f32[16]")

    if system == "dejax_eqx":
        state = full_buffer(num_envs, max_length, obs_dim)

        def sample(buf, key):
            return h.sample_windows(buf, key, batch, seq)
    elif system == "raw":
        state = full_arrays(num_envs, max_length, obs_dim)

        def sample(data, key):
            return raw_sample(data, key, batch, seq)
    elif system == "flashbax":
        import flashbax as fbx

        buffer = fbx.make_trajectory_buffer(
            add_batch_size=num_envs,
            sample_batch_size=batch,
            sample_sequence_length=seq,
            period=1,
            min_length_time_axis=seq,
            max_length_time_axis=max_length,
        )
        data = full_arrays(num_envs, max_length, obs_dim)
        first = jax.tree.map(lambda x: x[0, 0], data)
        state = jax.jit(buffer.add, donate_argnums=0)(buffer.init(first), data)
        del data

        def sample(state, key):
            return buffer.sample(state, key).experience
    elif system == "gist":
        state = {
            "data": full_arrays(num_envs, max_length, obs_dim),
            "lengths": jnp.full(num_envs, max_length, jnp.int32),
            "head": jnp.zeros(num_envs, jnp.int32),  # max_length writes: back at slot 0
        }

        def sample(state, key):
            return gist_sample(state, key, batch, seq)
    else:
        raise ValueError(system)

    seconds = h.time_reads(h.sampling_scan(sample, steps), state, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/sample"}
