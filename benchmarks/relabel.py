"""The cost of goal relabelling: a relabelled sample against the same sample without it.

Issue 39: at most 1.5× at batch 256 from 64 envs of 1,000 steps. A `TrajectoryBuffer` that
keeps episodes (same-step auto-reset, an episode end every 50 steps on average), full, holds
steps `{"obs": f32[16], "goal": f32[3], "achieved": f32[3], "reward": f32[], "done": bool[]}`.
Each timed call draws 20 batches of 256 in a `lax.scan` (so a call is not dispatch), of:

- one-step windows (`dx.Window(1)`), plain and with `dx.Relabel("future", fraction=0.8)`;
- 3-step transitions (`dx.NStep(3)`), plain and relabelled (the rewards of the 3 steps and the
    returns recomputed);

each pair timed in one process, its repeats interleaved (`_harness.time_interleaved`), and
printed as microseconds per batch and the ratio relabelled / plain. Also timed beside them, the
raw floor: a gather of 256 random rows of the same storage with `jax.numpy` indexing.

    python -m benchmarks.relabel            # 15 repeats
    python -m benchmarks.relabel --quick    # a smoke run
"""

import argparse
import statistics

import dejax_eqx as dx
import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


ENVS, LENGTH, BATCH, DRAWS = 64, 1_000, 256, 20


def reward_fn(achieved, goal):
    return -(jnp.linalg.norm(achieved - goal) > 0.05).astype(jnp.float32)


def _buffer(envs: int, length: int) -> dx.TrajectoryBuffer:
    step = {
        "obs": jnp.zeros(16),
        "goal": jnp.zeros(3),
        "achieved": jnp.zeros(3),
        "reward": jnp.zeros(()),
        "done": jnp.zeros((), bool),
    }
    episodes = dx.Episodes("done", autoreset="same-step")
    buf = dx.TrajectoryBuffer(step, envs, length, episodes=episodes)
    rng = np.random.default_rng(0)
    steps = {
        "obs": rng.normal(size=(envs, length, 16)).astype(np.float32),
        "goal": rng.normal(size=(envs, length, 3)).astype(np.float32),
        "achieved": rng.normal(size=(envs, length, 3)).astype(np.float32),
        "reward": -np.ones((envs, length), np.float32),
        "done": rng.random((envs, length)) < 0.02,
    }
    return buf.extend(jax.tree.map(jnp.asarray, steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    envs, length, draws = (4, 50, 2) if args.quick else (ENVS, LENGTH, DRAWS)
    repeats = 2 if args.quick else args.repeats
    buf = _buffer(envs, length)
    her = dx.Relabel(
        "future", goal="goal", achieved="achieved", reward="reward", reward_fn=reward_fn
    )
    nstep = dx.NStep(3, reward="reward", terminated="done")

    def scan(sample):
        @jax.jit
        def step(state, key):
            def one(total, key):
                leaves = jax.tree.leaves(sample(buf, key))
                return total + sum(jnp.sum(x.astype(jnp.float32)) for x in leaves), None

            total, _ = jax.lax.scan(one, state, jax.random.split(key, draws))
            return total

        return step, jnp.zeros(())

    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), buf.data)

    def raw(_, key):
        rows = jax.random.randint(key, (BATCH,), 0, envs * length)
        return jax.tree.map(lambda x: x[rows], flat)

    pairs = {
        "windows": {
            "raw gather": scan(raw),
            "plain": scan(lambda b, k: b.sample(k, BATCH, dx.Window(1))),
            "relabelled": scan(lambda b, k: b.sample(k, BATCH, dx.Window(1), relabel=her)),
        },
        "3-step transitions": {
            "plain": scan(lambda b, k: b.sample(k, BATCH, nstep, discount=0.98)),
            "relabelled": scan(lambda b, k: b.sample(k, BATCH, nstep, discount=0.98, relabel=her)),
        },
    }
    m = h.machine()
    print(f"{m['cpu']}, jax {m['jax']}, load {m['load_before']}")
    print(f"batch {BATCH} from {envs} envs of {length} steps; µs per batch (median of {repeats})")
    for what, runs in pairs.items():
        seconds = h.time_interleaved(runs, repeats)
        median = {name: statistics.median(s) / draws * 1e6 for name, s in seconds.items()}
        ratio = [a / b for a, b in zip(seconds["relabelled"], seconds["plain"])]
        cells = ", ".join(f"{name} {us:.1f}" for name, us in median.items())
        print(
            f"{what}: {cells}; relabelled / plain {statistics.median(ratio):.2f}x "
            f"(repeats {min(ratio):.2f}-{max(ratio):.2f}x)"
        )


if __name__ == "__main__":
    main()
