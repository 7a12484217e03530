"""TrajectoryBuffer: time to sample a batch of sequences, against the seed gist and a raw floor.

Run from the repository root with `python -m benchmarks.trajectory` (`--quick` for a smoke
run). Three samplers, each on a full buffer of `num_envs` streams of `max_length` steps
`{"obs": f32[obs_dim], "action": i32[], "reward": f32[], "done": bool[]}`, drawing
`batch_size` sequences of `sequence_length` steps:

- `dejax_eqx`: `TrajectoryBuffer.sample`, run-time checks included.
- `gist`: the sampler of the Muesli gist this buffer grew from (see `shared/seeds`),
    re-implemented from its description: a sequential `lax.scan` over every stored step to
    find its remaining length, then a categorical draw over all of them, so
    O(num_envs · max_length) per sample.
- `floor`: what no sampler can beat: pick `batch_size` (env, start) pairs uniformly and
    gather their ring-wrapped windows, no weights, no mask, no checks.

What is timed: `steps` samples inside one jitted `lax.scan` (each with its own key; every
sampled leaf is summed into the carry, so nothing is optimised away), so Python dispatch is
not counted. The floor grows with `max_length` too (the windows come from a larger array,
with more cache misses); `ours - floor` is the sampler's own cost. The functions
`time_dejax_eqx`, `time_gist` and `time_floor` return seconds per sample and can be imported
by another harness; `run` returns the whole table as dicts.
"""

import argparse
import os
import statistics
import time

import dejax_eqx as dx
import equinox as eqx
import jax
import jax.numpy as jnp


NUM_ENVS = 64
SEQUENCE_LENGTH = 32
BATCH_SIZE = 64
OBS_DIM = 16
MAX_LENGTHS = (1024, 4096, 16384)


def full_buffer(num_envs: int, max_length: int, obs_dim: int = OBS_DIM) -> dx.TrajectoryBuffer:
    """A buffer whose every env holds `max_length` steps (added in one jitted scan)."""
    step = {
        "obs": jnp.zeros(obs_dim, jnp.float32),
        "action": jnp.zeros((), jnp.int32),
        "reward": jnp.zeros((), jnp.float32),
        "done": jnp.zeros((), jnp.bool_),
    }
    buf = dx.TrajectoryBuffer(step, num_envs, max_length)

    @eqx.filter_jit(donate="all")
    def fill(buf, key):
        def add(buf, key):
            k1, k2 = jax.random.split(key)
            steps = {
                "obs": jax.random.normal(k1, (num_envs, obs_dim)),
                "action": jax.random.randint(k2, (num_envs,), 0, 2),
                "reward": jnp.ones(num_envs),
                "done": jax.random.uniform(k2, (num_envs,)) < 0.01,
            }
            return buf.add(steps), None

        return jax.lax.scan(add, buf, jax.random.split(key, max_length))[0]

    return fill(buf, jax.random.key(0))


def _consume(tree) -> jax.Array:
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))


def _seconds_per_sample(sample, state, steps: int, repeats: int) -> float:
    """Median seconds per `sample(state, key) -> tree`, over `repeats` scans of `steps`."""

    @jax.jit
    def run(state, key):
        def body(total, key):
            return total + _consume(sample(state, key)), None

        return jax.lax.scan(body, jnp.zeros(()), jax.random.split(key, steps))[0]

    jax.block_until_ready(run(state, jax.random.key(1)))  # compile and warm up
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(state, jax.random.key(2 + r)))
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def time_dejax_eqx(
    buf: dx.TrajectoryBuffer,
    batch_size: int = BATCH_SIZE,
    sequence_length: int = SEQUENCE_LENGTH,
    steps: int = 200,
    repeats: int = 5,
) -> float:
    """Seconds per `buf.sample(key, batch_size, sequence_length)`."""

    def sample(buf, key):
        return buf.sample(key, batch_size, sequence_length)

    return _seconds_per_sample(sample, buf, steps, repeats)


def gist_sample(buf: dx.TrajectoryBuffer, key, batch_size: int, sequence_length: int):
    """The gist's sampler on our storage, as the gist describes it (power 1).

    For each stored step (flattened over envs), a sequential scan finds its env by an argmax
    over the cumulative window lengths and its remaining length; starts are then drawn by a
    categorical over all stored steps with logits `log(remaining)`. The gist passes
    `arange(total stored steps)` in, so its shapes change (and it recompiles) as the buffer
    fills; here the buffer is full and the total is static.
    """
    lengths = buf.replay_length
    m = buf.max_length
    total = buf.num_envs * m
    cum = jnp.cumsum(lengths)

    def remaining(carry, x):
        row_end = cum[jnp.argmax(cum > x)]
        return carry, jnp.minimum(row_end - x, sequence_length)

    _, rem = jax.lax.scan(remaining, None, jnp.arange(total, dtype=jnp.int32))
    flat = jax.random.categorical(key, jnp.log(rem.astype(jnp.float32)), shape=(batch_size,))
    env = jnp.argmax(cum[:, None] > flat[None, :], axis=0)
    env_first = jnp.concatenate([jnp.zeros(1, jnp.int32), cum[:-1]])
    tail = (buf.head - lengths) % m
    col = flat + (tail - env_first)[env]
    cols = (jnp.arange(sequence_length)[None, :] + col[:, None]) % m
    seqs = jax.tree.map(lambda x: x[env[:, None], cols], buf.data)
    mask = jnp.arange(sequence_length)[None, :] < rem[flat][:, None]
    return seqs, mask


def time_gist(
    buf: dx.TrajectoryBuffer,
    batch_size: int = BATCH_SIZE,
    sequence_length: int = SEQUENCE_LENGTH,
    steps: int = 3,
    repeats: int = 3,
) -> float:
    """Seconds per sample of the gist's algorithm (`gist_sample`)."""

    def sample(buf, key):
        return gist_sample(buf, key, batch_size, sequence_length)

    return _seconds_per_sample(sample, buf, steps, repeats)


def time_floor(
    buf: dx.TrajectoryBuffer,
    batch_size: int = BATCH_SIZE,
    sequence_length: int = SEQUENCE_LENGTH,
    steps: int = 200,
    repeats: int = 5,
) -> float:
    """Seconds per gather of `batch_size` uniformly placed, ring-wrapped windows."""
    num_envs, m = buf.num_envs, buf.max_length

    def sample(data, key):
        k1, k2 = jax.random.split(key)
        env = jax.random.randint(k1, (batch_size,), 0, num_envs)
        start = jax.random.randint(k2, (batch_size,), 0, m)
        slots = (start[:, None] + jnp.arange(sequence_length)[None, :]) % m
        return jax.tree.map(lambda x: x[env[:, None], slots], data)

    return _seconds_per_sample(sample, buf.data, steps, repeats)


def run(max_lengths=MAX_LENGTHS, num_envs: int = NUM_ENVS, gist: bool = True) -> list[dict]:
    """One row per max_length: seconds per sample of each sampler."""
    rows = []
    for max_length in max_lengths:
        buf = full_buffer(num_envs, max_length)
        row = {"max_length": max_length, "dejax_eqx": time_dejax_eqx(buf)}
        row["floor"] = time_floor(buf)
        if gist:
            row["gist"] = time_gist(buf)
        rows.append(row)
        del buf
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="max_length 1k and 4k only")
    parser.add_argument("--no-gist", action="store_true", help="skip the (slow) gist sampler")
    args = parser.parse_args(argv)
    max_lengths = MAX_LENGTHS[:2] if args.quick else MAX_LENGTHS
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, "
        f"load average {load}; num_envs {NUM_ENVS}, sequence_length {SEQUENCE_LENGTH}, "
        f"batch {BATCH_SIZE}, obs f32[{OBS_DIM}]\n"
    )
    rows = run(max_lengths, gist=not args.no_gist)
    print(
        "| max_length | dejax_eqx (µs) | floor (µs) | gist (µs) | ours / floor "
        "| ours - floor (µs) | gist / ours |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ours, floor, gist = row["dejax_eqx"], row["floor"], row.get("gist")
        gist_time = f"{gist * 1e6:,.0f}" if gist else "-"
        speedup = f"{gist / ours:,.0f}x" if gist else "-"
        print(
            f"| {row['max_length']:,} | {ours * 1e6:,.1f} | {floor * 1e6:,.1f} | {gist_time} "
            f"| {ours / floor:.2f}x | {(ours - floor) * 1e6:,.1f} | {speedup} |"
        )
    first, last = rows[0], rows[-1]
    print(
        f"\ndejax_eqx: t({last['max_length']:,}) / t({first['max_length']:,}) = "
        f"{last['dejax_eqx'] / first['dejax_eqx']:.2f}"
    )


if __name__ == "__main__":
    main()
