"""W7: `TrajectoryBuffer` window sampling with each of its options, against the raw gather, at
1k, 4k and 16k steps per stream (issue 13: sampling must not grow with `max_length`).

Every system holds `NUM_ENVS` streams of `max_length + EXTRA` added steps (so every ring has
wrapped) of `{"obs": f32[64], "reward": f32[], "terminated": bool[], "truncated": bool[]}`,
with episodes ending about every 200 steps. A sample is `BATCH_SIZE` windows of
`WINDOW = 40 + 80 + 5 = 125` steps, an R2D2-like burn-in, learning part and bootstrap:

- `dejax_eqx defaults` (a): `sample(key, 64, dx.Window(125))`, the law of the sampler before
  issue 13.
- `dejax_eqx period=40` (b): `sample(key, 64, dx.Window(125, period=40))`.
- `dejax_eqx strict period=40` (c): as (b), whole windows only (`strict=True`).
- `dejax_eqx R2D2 truncate` (d): `sample(key, 64, dx.Window(80, burn_in=40, bootstrap=5,
  period=40, strict=True, episode_ends="truncate", done=("terminated", "truncated")))`.
- `dejax_eqx R2D2 within` (e): as (d) with `episode_ends="within"`.
- `raw`, the floor for (a)-(e): one gather per leaf of the `BATCH_SIZE` ring-wrapped windows at
  precomputed random `(env, start)` pairs from plain `[num_envs, max_length, ...]` arrays: no
  random draw, weights, mask or check, which any sampler must at least do.
- `dejax_eqx, transitions n=5` (f): `sample_transitions(key, 256, dx.NStep(5,
  reward="reward", terminated="terminated", truncated="truncated"), discount=0.99)`.
- `raw, transitions n=5`, its floor: at 256 precomputed `(env, start)` pairs, the first and
  the next item and the 5 rewards and flags between them; no return is computed.

What is timed, as in W5: `steps` samples inside one jitted `lax.scan`, every sampled leaf
summed into the result, on a state that is passed in and neither returned nor donated. The
dejax_eqx rows scan over `steps` keys; the raw rows over `steps` precomputed index sets.
The calls go through `_harness.sample_windows` and `sample_transitions`, which also speak
dejax_eqx 0.1's form (a sequence length or `n` and keywords) for before/after runs.
"""

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp

from . import _harness as h


NUM_ENVS = 16
BATCH_SIZE = 64
OBS_DIM = 64
BURN_IN, LENGTH, BOOTSTRAP, PERIOD = 40, 80, 5, 40
WINDOW = BURN_IN + LENGTH + BOOTSTRAP
EXTRA = 100  # steps added past max_length: every ring has wrapped, the windows cross its end
TRANSITIONS, N_STEP = 256, 5

_DONE = ("terminated", "truncated")
_R2D2 = {
    "burn_in": BURN_IN,
    "bootstrap": BOOTSTRAP,
    "period": PERIOD,
    "strict": True,
    "done": _DONE,
}
# Each option's `(sequence_length, options)`: it samples `dx.Window(sequence_length, **options)`.
OPTIONS: dict[str, tuple[int, dict]] = {
    "defaults": (WINDOW, {}),
    "period=40": (WINDOW, {"period": PERIOD}),
    "strict period=40": (WINDOW, {"period": PERIOD, "strict": True}),
    "R2D2 truncate": (LENGTH, {**_R2D2, "episode_ends": "truncate"}),
    "R2D2 within": (LENGTH, {**_R2D2, "episode_ends": "within"}),
}


def _steps(key, t) -> dict[str, jax.Array]:
    """Step `t` of each of the `NUM_ENVS` streams; episodes end about every 200 steps, by a
    termination (p = 1/250) or a time limit (every 1,000 steps, staggered over envs)."""
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "obs": jax.random.normal(k1, (NUM_ENVS, OBS_DIM)),
        "reward": jax.random.uniform(k2, (NUM_ENVS,)),
        "terminated": jax.random.uniform(k3, (NUM_ENVS,)) < 1 / 250,
        "truncated": (t + 61 * jnp.arange(NUM_ENVS)) % 1000 == 999,
    }


def _xs(max_length: int):
    n = max_length + EXTRA
    return jax.random.split(jax.random.key(0), n), jnp.arange(n, dtype=jnp.int32)


def full_buffer(max_length: int) -> dx.TrajectoryBuffer:
    """A `TrajectoryBuffer` after `max_length + EXTRA` public `add`s of every env, in one
    donated scan."""
    prototype = jax.tree.map(lambda x: x[0], _steps(jax.random.key(0), 0))
    buf = dx.TrajectoryBuffer(prototype, NUM_ENVS, max_length)

    @eqx.filter_jit(donate="all")
    def fill(buf, xs):
        return jax.lax.scan(lambda buf, x: (buf.add(_steps(*x)), None), buf, xs)[0]

    return fill(buf, _xs(max_length))


def full_arrays(max_length: int) -> dict[str, jax.Array]:
    """The same steps as plain `[NUM_ENVS, max_length, ...]` arrays, each stream a ring whose
    write position is `EXTRA` (the floor never needs it: its windows are placed at random)."""

    @jax.jit
    def make(xs):
        steps = jax.vmap(_steps)(*xs)
        # Step k is at slot k mod max_length; the last max_length steps survive.
        steps = jax.tree.map(lambda x: jnp.roll(x[-max_length:], EXTRA, axis=0), steps)
        return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), steps)

    return make(_xs(max_length))


def _indices(steps: int, batch: int, max_length: int) -> dict[str, jax.Array]:
    """`steps` sets of `batch` uniform `(env, start)` pairs, drawn before the timing."""
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "env": jax.random.randint(k1, (steps, batch), 0, NUM_ENVS, jnp.int32),
        "start": jax.random.randint(k2, (steps, batch), 0, max_length, jnp.int32),
    }


def raw_windows(data, env, start):
    """The floor of (a)-(e): the ring-wrapped windows of `WINDOW` steps, one gather per leaf."""
    max_length = jax.tree.leaves(data)[0].shape[1]
    slots = (start[:, None] + jnp.arange(WINDOW, dtype=jnp.int32)[None, :]) % max_length
    return jax.tree.map(lambda x: x[env[:, None], slots], data)


def raw_transitions(data, env, start):
    """The floor of (f): the first and next items of each transition and the `N_STEP`
    rewards and flags from the first on."""
    max_length = jax.tree.leaves(data)[0].shape[1]
    slots = (start[:, None] + jnp.arange(N_STEP, dtype=jnp.int32)[None, :]) % max_length
    following = (start + N_STEP) % max_length
    return (
        jax.tree.map(lambda x: x[env, start], data),
        {k: data[k][env[:, None], slots] for k in ("reward", *_DONE)},
        jax.tree.map(lambda x: x[env, following], data),
    )


def _index_scan(gather):
    """`read(state, key) -> f32[]`: one `gather(data, env, start)` per precomputed index set of
    `state`, in one jitted scan, as `h.sampling_scan` does with keys (the key is not used)."""

    @jax.jit
    def read(state, key):
        del key

        def body(total, idx):
            return total + h.consume(gather(state["data"], idx["env"], idx["start"])), None

        return jax.lax.scan(body, jnp.zeros(()), state["indices"])[0]

    return read


def w7(system: str, max_length: int, steps: int, repeats: int) -> dict:
    """Microseconds per sample of `BATCH_SIZE` windows of `WINDOW` steps (or of
    `TRANSITIONS` n-step transitions)."""
    if system in ("raw", "raw, transitions n=5"):
        transitions = system != "raw"
        batch = TRANSITIONS if transitions else BATCH_SIZE
        state = {
            "data": full_arrays(max_length),
            "indices": _indices(steps, batch, max_length),
        }
        read = _index_scan(raw_transitions if transitions else raw_windows)
    elif system == "dejax_eqx, transitions n=5":
        state = full_buffer(max_length)

        def sample(buf, key):
            return h.sample_transitions(
                buf,
                key,
                TRANSITIONS,
                N_STEP,
                discount=0.99,
                reward="reward",
                terminated="terminated",
                truncated="truncated",
            )

        read = h.sampling_scan(sample, steps)
    elif system.removeprefix("dejax_eqx ") in OPTIONS:
        sequence_length, options = OPTIONS[system.removeprefix("dejax_eqx ")]
        state = full_buffer(max_length)

        def sample(buf, key):
            return h.sample_windows(buf, key, BATCH_SIZE, sequence_length, **options)

        read = h.sampling_scan(sample, steps)
    else:
        raise ValueError(system)

    seconds = h.time_reads(read, state, repeats)
    return {"values": [1e6 * s / steps for s in seconds], "unit": "us/sample"}
